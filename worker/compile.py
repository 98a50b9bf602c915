"""Compiling one model version: a plain function the embedded pool and the Celery task call."""

from __future__ import annotations

import logging
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import redis
from sqlalchemy.exc import InterfaceError, OperationalError

from cloud.db import ModelVersion
from cloud.errors import Unavailable
from cloud.metrics import PrometheusObserver
from cloud.storage import ObjectStore, artifact_key, load_artifact, save_artifact
from compiler import Artifact, CompilerError, UnsupportedModel, compile_onnx, pipeline
from compiler.backends.native_cpu import cpu_fingerprint
from compiler.errors import CorruptArtifact
from compiler.pipeline import CANDIDATES, COMPILER_VERSION, SEARCH, Progress
from compiler.targets import EXPORTED
from compiler.tuning import KNOWN_CANDIDATES
from registry import UNMEASURED, Registry
from registry.bundle import GENERATION
from worker.devices import is_unmeasured, unmeasured_label
from worker.observer import CompileObserver
from worker.sandbox import CompileCancelled

log = logging.getLogger(__name__)

# a compile's progress is written to its version at most this often
PROGRESS_WRITE_INTERVAL_S = 1.0
# where compiles are reported unless a caller says otherwise: the one metrics registry
_METRICS: CompileObserver = PrometheusObserver()

# outages of the database, the object store or Redis: a compile that meets one is tried again
# later, never failed for it
TRANSIENT_ERRORS: tuple[type[Exception], ...] = (
    OperationalError,
    InterfaceError,
    Unavailable,
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
)


class CompileFn(Protocol):
    """(version id, the graph's file, target, precision) -> artifact, in this process or in a
    sandbox's child, telling `progress` what the compile is doing as it goes."""

    def __call__(
        self,
        version_id: int,
        graph: Path,
        target: str,
        progress: Progress | None = None,
        precision: str = EXPORTED,
    ) -> Artifact: ...


def compile_here(
    version_id: int, graph: Path, target: str, progress: Progress | None = None, precision: str = EXPORTED
) -> Artifact:
    return compile_onnx(graph.read_bytes(), target, progress=progress, precision=precision)


class ProgressWriter:
    """A compile's progress callback that stores the latest event on its version, from a timer
    thread and at most once per `interval_s`: a slow or unreachable database delays or loses
    progress (logged), never the compile."""

    def __init__(
        self, registry: Registry, version_id: int, interval_s: float = PROGRESS_WRITE_INTERVAL_S
    ) -> None:
        self._registry = registry
        self._version_id = version_id
        self._interval_s = interval_s
        self._started_at = time.time()
        self._lock = threading.Lock()
        self._pending: dict[str, Any] | None = None
        # the write scheduled or under way; None when there is none
        self._timer: threading.Timer | None = None
        self._written_at = -interval_s
        self._closed = False

    def __call__(self, event: dict[str, Any]) -> None:
        with self._lock:
            self._pending = event
            if self._timer is None and not self._closed:
                self._schedule()

    def _schedule(self) -> None:
        delay = max(0.0, self._written_at + self._interval_s - time.monotonic())
        self._timer = threading.Timer(delay, self._write)
        self._timer.daemon = True
        self._timer.start()

    def _write(self) -> None:
        with self._lock:
            event, self._pending = self._pending, None
            if self._closed or event is None:
                self._timer = None
                return
            self._written_at = time.monotonic()
        try:
            self._registry.set_progress(self._version_id, {**event, "started_at": self._started_at})
        except Exception as exc:  # noqa: BLE001 - progress is a courtesy: the compile goes on without it
            log.warning("could not store the progress of version %s: %s", self._version_id, exc)
        with self._lock:
            self._timer = None
            if self._pending is not None and not self._closed:
                self._schedule()

    def close(self) -> None:
        """No more writes; one under way cannot overwrite the final status (see set_progress)."""
        with self._lock:
            self._closed = True
            if self._timer is not None:
                self._timer.cancel()


def compile_candidates(named: Sequence[str]) -> tuple[str, ...]:
    """The programs a cpu compile builds: those named (settings.compile_candidates), or the
    compiler's default when none are. ValueError naming the setting and the choices for a name
    the compiler cannot build: checked here, where the compiler is, not in cloud/settings.py,
    whose import must not import the compiler."""
    if not named:
        return pipeline.CANDIDATES
    unknown = sorted(set(named) - set(KNOWN_CANDIDATES))
    if unknown:
        raise ValueError(
            f"unknown compile candidates {unknown} in LUMINAL_COMPILE_CANDIDATES; known: {list(KNOWN_CANDIDATES)}"
        )
    return tuple(named)


def compile_options(candidates: Sequence[str] = CANDIDATES, search: bool = SEARCH) -> dict[str, object]:
    """What besides the graph and the target decides which program a compile ships."""
    return {"candidates": list(candidates), "search": search}


def cache_key(graph_key: str, target: str, options: Mapping[str, object], precision: str = EXPORTED) -> str:
    """Where a compile with these options stores its artifact: a cpu program is built for, and
    measured on, the CPU type of the worker that compiles it, which is part of the key; so is a
    narrow precision (left out for "exported", so the keys of artifacts stored before stay)."""
    if precision != EXPORTED:
        options = {**options, "precision": precision}
    if target == "cpu":
        options = {**options, "cpu": cpu_fingerprint()}
    return artifact_key(graph_key, target, options, compiler_version=COMPILER_VERSION)


def compile_version(
    version_id: int,
    registry: Registry,
    compile_fn: CompileFn = compile_here,
    options: Mapping[str, object] | None = None,
    unmeasured_targets: Collection[str] = (),
    observer: CompileObserver = _METRICS,
) -> str | None:
    """Compile a queued version for its target in its precision with `compile_fn`, which
    compiles with `options` (the defaults' when None); idempotent, and an artifact compiled
    before from the same bytes with the same options and precision is reused. The graph reaches
    `compile_fn` as a temporary file streamed from the store. A target in `unmeasured_targets`
    is compiled without its GPU (unless a measured artifact of it is stored): its artifact is
    stored apart from measured ones and its report labelled UNMEASURED. How each compile ends is
    told to `observer` (by default the metrics at /metrics). Returns the final status: None if
    the version was deleted, "queued" if its compile was cancelled while the version remains (the
    caller queues it again). Only a process that stops midway leaves it "compiling"."""
    version = registry.get_version(version_id)
    if version is None:
        return None
    if version.status in ("ready", "failed"):
        return version.status
    registry.set_status(version_id, "compiling", report=None)
    started = time.perf_counter()
    options = compile_options() if options is None else options
    key = _artifact_key_of(version, options, unmeasured=False)
    # without the GPU, a measured artifact of the same compile is still the one to ship
    unmeasured = version.target in unmeasured_targets and not registry.store.exists(f"{key}/manifest.json")
    if unmeasured:
        key = _artifact_key_of(version, options, unmeasured=True)
    progress = ProgressWriter(registry, version_id)
    try:
        artifact, cached = _compiled_or_cached(
            version, registry.store, key, compile_fn, progress, transform=_prefill_transform(version)
        )
        decode = (
            _decode_phase(version, registry.store, key, compile_fn) if version.task == GENERATION else None
        )
    except CompileCancelled:
        return _after_cancel(registry, version_id)
    except UnsupportedModel as exc:
        message = "the graph uses operations the compiler does not support: " + ", ".join(exc.missing)
        return _fail(registry, version_id, message, started, observer)
    except CompilerError as exc:
        return _fail(registry, version_id, f"compilation failed: {exc}", started, observer)
    except TRANSIENT_ERRORS:
        raise
    except Exception as exc:  # a compiler bug must fail the version, not the worker
        log.exception("compiling version %s crashed", version_id)
        # the exception's text may name storage keys and paths: it stays in the operators' log
        message = f"internal compiler error ({type(exc).__name__}); operators can find version {version_id} in the log"
        return _fail(registry, version_id, message, started, observer)
    finally:
        progress.close()
    seconds = time.perf_counter() - started
    # the report is the artifact's own, the same for every uploader of these bytes: whether this
    # compile hit the shared cache would tell a tenant what another tenant uploaded
    report = (
        {**artifact.report, UNMEASURED: unmeasured_label(version.target)} if unmeasured else artifact.report
    )
    extra: dict[str, Any] = {}
    if decode is not None:
        decode_keys, decode_report = decode
        report = {**report, "decode_phase": decode_report}
        if decode_keys:
            extra["bundle"] = {**(version.bundle or {}), **decode_keys}
    registry.set_status(
        version_id,
        "ready",
        artifact_key=key,
        signature=artifact.signature.to_json(),
        report=report,
        error=None,
        **extra,
    )
    log.info("version %s ready in %.3f s (cached artifact: %s)", version_id, seconds, cached)
    observer.compile_finished("cached" if cached else "ready", seconds)
    return "ready"


def recompile_measured(
    version_id: int,
    registry: Registry,
    compile_fn: CompileFn = compile_here,
    options: Mapping[str, object] | None = None,
) -> str | None:
    """Compiles again, on the GPU this process holds, a ready version whose report says
    UNMEASURED, then swaps in the new artifact and report once stored: the version serves the
    one it has until then, and keeps it if this compile fails. Idempotent: a version no longer
    labelled (or not ready) is left alone. Returns None if the version is gone, "replaced",
    "unchanged" (nothing to do, or another compile replaced it first) or "failed"."""
    version = registry.get_version(version_id)
    if version is None:
        return None
    if version.status != "ready" or not is_unmeasured(version.report) or version.artifact_key is None:
        return "unchanged"
    key = _artifact_key_of(version, compile_options() if options is None else options, unmeasured=False)
    try:
        artifact, _ = _compiled_or_cached(
            version, registry.store, key, compile_fn, progress=None, transform=_prefill_transform(version)
        )
    except CompileCancelled:
        return None if registry.get_version(version_id) is None else "unchanged"
    except TRANSIENT_ERRORS:
        raise
    except Exception:  # the version keeps serving what it has; the next worker start tries again
        log.warning(
            "compiling version %s again on its GPU failed; it keeps its unmeasured artifact",
            version_id,
            exc_info=True,
        )
        return "failed"
    signature = artifact.signature.to_json()
    if not registry.replace_artifact(version_id, version.artifact_key, key, signature, artifact.report):
        return None if registry.get_version(version_id) is None else "unchanged"
    log.info(
        "version %s compiled again on its GPU; its measured artifact replaced the unmeasured one", version_id
    )
    return "replaced"


def _artifact_key_of(version: ModelVersion, options: Mapping[str, object], unmeasured: bool) -> str:
    # an unmeasured artifact is kept apart, so a compile where the GPU is never reuses it
    if unmeasured:
        options = {**options, UNMEASURED: True}
    # a merged decoder compiled with its use_cache_branch bound is not the graph as uploaded
    if _merged_decoder(version):
        options = {**options, "use_cache_branch": True}
    return cache_key(version.graph_key, version.target, options, version.precision)


def _decode_phase(
    version: ModelVersion, store: ObjectStore, key: str, compile_fn: CompileFn
) -> tuple[dict[str, str], dict[str, Any]]:
    """A generative version's decode programs, its graph with one new token per sequence
    (compiler.kv_layout.decode_step_graph), searched and verified like the first: one that takes
    its past whole, one that reads the paged KV cache in place
    (compiler.kv_layout.paged_decode_graph), and one for a single sequence
    (compiler.kv_layout.one_sequence_graph: its products searched for one row). The service
    measures them and the first on the one-token steps and runs the fastest at each batch size.
    Returns the bundle's keys (decode_artifact_key, decode_paged_key, decode_one_key) of those
    that compiled, and the report: the gathered program's choice, with "paged" and
    "one_sequence" the others' (False where there is none, "paged_refused" and
    "one_sequence_error" saying why). A decode program that fails to compile leaves the others
    serving."""
    keys: dict[str, str] = {}
    paged, why = _decode_program(version, store, f"{key}-decode-paged", compile_fn, _as_paged_decode_step)
    if paged is not None:
        keys["decode_paged_key"] = f"{key}-decode-paged"
    paged_report = {"paged": paged} if paged is not None else {"paged": False, "paged_refused": why}
    gathered, why = _decode_program(version, store, f"{key}-decode", compile_fn, _as_decode_step)
    if gathered is None:
        return keys, {"chosen": None, "error": why, **paged_report}
    keys["decode_artifact_key"] = f"{key}-decode"
    one, why = _decode_program(version, store, f"{key}-decode-one", compile_fn, _as_one_sequence_step)
    if one is not None:
        keys["decode_one_key"] = f"{key}-decode-one"
    one_report = {"one_sequence": one} if one is not None else {"one_sequence": False, "one_sequence_error": why}
    return keys, {**gathered, **paged_report, **one_report}


def _decode_program(
    version: ModelVersion, store: ObjectStore, key: str, compile_fn: CompileFn, transform: Callable[[Path], None]
) -> tuple[dict[str, Any] | None, str | None]:
    """The report of a decode program compiled (or found) at `key` from the graph as `transform`
    rewrites it; or None and why it did not compile (the others serve without it)."""
    try:
        artifact, _ = _compiled_or_cached(version, store, key, compile_fn, None, transform=transform)
    except CompileCancelled:
        raise
    except (CompilerError, ValueError) as exc:
        log.warning("the program %s of version %s did not compile: %s", key, version.id, exc)
        return None, str(exc)
    return _decode_report(artifact), None


def _decode_report(artifact: Artifact) -> dict[str, Any]:
    return {key: artifact.report.get(key) for key in ("chosen", "seconds", "kernels", "verify_max_abs_error")}


def _merged_decoder(version: ModelVersion) -> bool:
    """Whether the version is a generative merged decoder (its upload check found use_cache_branch)."""
    layout = (version.bundle or {}).get("layout") or {}
    return version.task == GENERATION and bool(layout.get("cache_branch_input"))


def _prefill_transform(version: ModelVersion) -> Callable[[Path], None] | None:
    return _bind_cache_branch if _merged_decoder(version) else None


def _bind_cache_branch(graph: Path) -> None:
    """The merged decoder's with-past branch, always (compiler.kv_layout.bind_cache_branch)."""
    import onnx

    from compiler.kv_layout import bind_cache_branch

    model = onnx.load(str(graph))
    bind_cache_branch(model)
    onnx.save(model, str(graph))


def _as_decode_step(graph: Path) -> None:
    import onnx

    from compiler.kv_layout import decode_step_graph

    model = onnx.load(str(graph))
    if not decode_step_graph(model):
        raise ValueError("the graph's input_ids has no symbolic sequence dimension to fix")
    onnx.save(model, str(graph))


def _as_one_sequence_step(graph: Path) -> None:
    """The decode step's graph for one sequence (compiler.kv_layout.one_sequence_graph)."""
    import onnx

    from compiler.kv_layout import decode_step_graph, one_sequence_graph

    model = onnx.load(str(graph))
    if not (decode_step_graph(model) and one_sequence_graph(model)):
        raise ValueError("the graph's input_ids has no symbolic batch and sequence dimensions to fix")
    onnx.save(model, str(graph))


def _as_paged_decode_step(graph: Path) -> None:
    """The decode step's graph reading its past from the paged KV cache (found as the upload
    check finds it); UnsupportedModel naming what breaks it."""
    import onnx

    from compiler.kv_layout import decode_step_graph, find_cache_layout, onnx_specs, paged_decode_graph

    model = onnx.load(str(graph))
    if not decode_step_graph(model):
        raise ValueError("the graph's input_ids has no symbolic sequence dimension to fix")
    paged_decode_graph(model, find_cache_layout(*onnx_specs(model)))
    onnx.save(model, str(graph))


def _compiled_or_cached(
    version: ModelVersion,
    store: ObjectStore,
    key: str,
    compile_fn: CompileFn,
    progress: Progress | None,
    transform: Callable[[Path], None] | None = None,
) -> tuple[Artifact, bool]:
    """The artifact stored at `key`, else the version compiled by `compile_fn` (from its graph
    as `transform` rewrites it) and stored there; and whether it was stored already."""
    artifact = _cached_artifact(store, key)
    if artifact is not None:
        return artifact, True
    with tempfile.TemporaryDirectory(prefix="luminal-compile-") as folder:
        graph = Path(folder) / "graph.onnx"
        store.get_file(version.graph_key, graph)
        if transform is not None:
            transform(graph)
        artifact = compile_fn(
            version.id, graph, version.target, progress=progress, precision=version.precision
        )
    save_artifact(store, key, artifact)
    return artifact, False


def _after_cancel(registry: Registry, version_id: int) -> str | None:
    """None when the version is gone, as a cancel means; else (a cancel meant for a deleted
    version, or the server stopping) it is queued again, never left compiling."""
    if registry.get_version(version_id) is None:
        return None
    registry.set_status(version_id, "queued", report=None)
    log.info("the compile of version %s was stopped while the version remains; queued again", version_id)
    return "queued"


def _cached_artifact(store: ObjectStore, key: str) -> Artifact | None:
    """The stored artifact, or None when there is none or it was left incomplete by a crash."""
    if not store.exists(f"{key}/manifest.json"):
        return None
    try:
        return load_artifact(store, key, Artifact.from_files)
    except CorruptArtifact as exc:
        log.warning("artifact %s is corrupt, compiling again: %s", key, exc)
        return None


def _fail(
    registry: Registry, version_id: int, message: str, started: float, observer: CompileObserver
) -> str:
    # (the report held the compile's progress)
    registry.set_status(version_id, "failed", error=message, report=None)
    observer.compile_finished("failed", time.perf_counter() - started)
    return "failed"
