"""Compiling one model version: a plain function the embedded pool and the Celery task call."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence

import redis
from sqlalchemy.exc import InterfaceError, OperationalError

from cloud import metrics
from cloud.errors import Unavailable
from cloud.registry import Registry
from cloud.storage import ObjectStore, artifact_key, load_artifact, save_artifact
from compiler import Artifact, CompilerError, UnsupportedModel, compile_onnx
from compiler.backends.native_cpu import cpu_fingerprint
from compiler.errors import CorruptArtifact
from compiler.pipeline import CANDIDATES, SEARCH
from worker.sandbox import CompileCancelled

log = logging.getLogger(__name__)


# outages of the database, the object store or Redis: a compile that meets one is tried again
# later, never failed for it
TRANSIENT_ERRORS: tuple[type[Exception], ...] = (
    OperationalError,
    InterfaceError,
    Unavailable,
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
)


# (version id, graph bytes, target) -> artifact: in this process, or in a sandbox's child
CompileFn = Callable[[int, bytes, str], Artifact]


def compile_here(version_id: int, data: bytes, target: str) -> Artifact:
    return compile_onnx(data, target)


def compile_options(candidates: Sequence[str] = CANDIDATES, search: bool = SEARCH) -> dict[str, object]:
    """What besides the graph and the target decides which program a compile ships."""
    return {"candidates": list(candidates), "search": search}


def cache_key(graph_key: str, target: str, options: Mapping[str, object]) -> str:
    """Where a compile with these options stores its artifact: a cpu program is built for, and
    measured on, the CPU type of the worker that compiles it, which is part of the key."""
    if target == "cpu":
        options = {**options, "cpu": cpu_fingerprint()}
    return artifact_key(graph_key, target, options)


def compile_version(
    version_id: int, registry: Registry, compile_fn: CompileFn = compile_here, options: Mapping[str, object] | None = None
) -> str | None:
    """Compile a queued version with `compile_fn`, which compiles with `options` (the defaults'
    when None); idempotent, and an artifact compiled before from the same bytes with the same
    options is reused. Returns the final status (None if deleted or stopped midway, which leaves
    it to be resumed)."""
    version = registry.get_version(version_id)
    if version is None:
        return None
    if version.status in ("ready", "failed"):
        return version.status
    registry.set_status(version_id, "compiling")
    started = time.perf_counter()
    store = registry.store
    key = cache_key(version.graph_key, version.target, compile_options() if options is None else options)
    try:
        artifact = _cached_artifact(store, key)
        cached = artifact is not None
        if artifact is None:
            artifact = compile_fn(version_id, store.get(version.graph_key), version.target)
            save_artifact(store, key, artifact)
    except CompileCancelled:
        return None
    except UnsupportedModel as exc:
        message = "the graph uses operations the compiler does not support: " + ", ".join(exc.missing)
        return _fail(registry, version_id, message, started)
    except CompilerError as exc:
        return _fail(registry, version_id, f"compilation failed: {exc}", started)
    except TRANSIENT_ERRORS:
        raise
    except Exception as exc:  # a compiler bug must fail the version, not the worker
        log.exception("compiling version %s crashed", version_id)
        # the exception's text may name storage keys and paths: it stays in the operators' log
        message = f"internal compiler error ({type(exc).__name__}); operators can find version {version_id} in the log"
        return _fail(registry, version_id, message, started)
    seconds = time.perf_counter() - started
    # the report is the artifact's own, the same for every uploader of these bytes: whether this
    # compile hit the shared cache would tell a tenant what another tenant uploaded
    registry.set_status(
        version_id,
        "ready",
        artifact_key=key,
        signature=artifact.signature.to_json(),
        report=artifact.report,
        error=None,
    )
    log.info("version %s ready in %.3f s (cached artifact: %s)", version_id, seconds, cached)
    metrics.COMPILES.labels("cached" if cached else "ready").inc()
    metrics.COMPILE_SECONDS.observe(seconds)
    return "ready"


def _cached_artifact(store: ObjectStore, key: str) -> Artifact | None:
    """The stored artifact, or None when there is none or it was left incomplete by a crash."""
    if not store.exists(f"{key}/manifest.json"):
        return None
    try:
        return load_artifact(store, key)
    except CorruptArtifact as exc:
        log.warning("artifact %s is corrupt, compiling again: %s", key, exc)
        return None


def _fail(registry: Registry, version_id: int, message: str, started: float) -> str:
    registry.set_status(version_id, "failed", error=message)
    metrics.COMPILES.labels("failed").inc()
    metrics.COMPILE_SECONDS.observe(time.perf_counter() - started)
    return "failed"
