"""Builds the service's components from settings: the factory that picks each adapter."""

from __future__ import annotations

import fcntl
import logging
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from api.codec import Codec
from api.runtime_role import GPU_WEIGHTS_FRACTION, build_runtime, run_runtime_process
from cloud.auth import Authenticator
from cloud.db import Database, masked_url, open_database
from cloud.errors import LuminalError
from cloud.metering import Ledger
from cloud.metrics import PrometheusObserver
from cloud.settings import Settings
from cloud.storage import ObjectStore, make_object_store
from compiler.targets import GPU_TYPES
from registry import Registry
from registry.checks import CheckInChild
from runtime import Runtime
from runtime.tokenizer import CodecCache
from scheduler.engine import Engine, InProcessEngine
from scheduler.generating import GenerationService, generation_settings
from worker.queue import CompileQueue, compile_check, make_compile_queue

log = logging.getLogger(__name__)

# the runtime role's wiring lives apart (a runtime process starts without the gateway's imports);
# its names stay importable from here
__all__ = ["GPU_WEIGHTS_FRACTION", "build_runtime", "run_runtime_process"]


class DataDirInUse(RuntimeError):
    """Another server already runs on this data directory."""


class DataDirLock:
    """An exclusive lock on the data directory, held while a server runs: two servers on one
    directory would resume the same compiles and race on its files."""

    def __init__(self, data_dir: Path) -> None:
        data_dir.mkdir(parents=True, exist_ok=True)
        self.path = data_dir / "server.lock"
        self._file = open(self.path, "a+")  # noqa: SIM115  held open for the server's lifetime
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.close()
            raise DataDirInUse(
                f"another Luminal Cloud server is using {data_dir}; stop it, or give this one its own "
                "LUMINAL_DATA_DIR"
            ) from None

    def release(self) -> None:
        if not self._file.closed:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()


@dataclass
class Services:
    settings: Settings
    db: Database
    auth: Authenticator
    store: ObjectStore
    registry: Registry
    ledger: Ledger
    compiler: CompileQueue
    codec: Codec
    lock: DataDirLock
    # generative models' tokenizers, by bundle (the gateway encodes prompts, runtimes decode)
    codecs: CodecCache
    engine: Engine | None = None
    def close(self) -> None:
        self.compiler.shutdown()
        self.codec.close()
        self.db.dispose()
        self.lock.release()


def build_services(settings: Settings) -> Services:
    """Everything a server holds; raises DataDirInUse before any work if another server holds
    the data directory, Unreachable if the database or the object store cannot be reached."""
    with ExitStack() as undo:  # a database or store that cannot be reached frees what came before
        lock = DataDirLock(settings.data_dir)
        undo.callback(lock.release)
        db = open_database(settings)
        undo.callback(db.dispose)
        store = make_object_store(settings)
        undo.pop_all()
    registry = Registry(
        db,
        store,
        settings.targets,
        check_model=CheckInChild(settings.compile_memory_bytes),
        max_models_per_tenant=settings.max_models_per_tenant or None,
        max_versions_per_model=settings.max_versions_per_model or None,
        refused_targets=compile_check(settings).refused,
    )
    return Services(
        settings=settings,
        db=db,
        auth=Authenticator(db, ttl_s=settings.auth_cache_ttl_s),
        store=store,
        registry=registry,
        ledger=Ledger(db),
        compiler=make_compile_queue(settings, registry),
        codec=Codec(settings.codec_process_above_bytes, settings.codec_workers),
        lock=lock,
        codecs=CodecCache(store),
    )


def build_engine(services: Services) -> Engine:
    """The engine settings.request_queue names; needs a running event loop (both keep asyncio
    tasks). With "redis" the gateway queues requests for the runtime processes and runs none."""
    settings, store = services.settings, services.store
    if settings.request_queue == "redis":
        from scheduler.streams import StreamEngine

        return StreamEngine(
            settings.redis_url,
            services.ledger,
            max_queue_requests=settings.max_queue_requests,
            max_batch_rows=settings.max_batch_rows,
            request_timeout_s=settings.request_timeout_s,
            retry_after_s=settings.retry_after_s,
            claim_idle_s=settings.runtime_claim_idle_s,
            masked_redis_url=masked_url(settings.redis_url),
            observer=PrometheusObserver(),
        )
    runtimes = _embedded_runtimes(settings, store)
    generation = GenerationService(
        runtimes,
        services.codecs,
        services.ledger,
        settings.price_per_second,
        generation_settings(settings),
        PrometheusObserver(),
    )
    return InProcessEngine(
        runtimes=runtimes,
        generation=generation,
        ledger=services.ledger,
        prices=settings.price_per_second,
        max_batch_rows=settings.max_batch_rows,
        max_delay_s=settings.max_queue_delay_ms / 1000.0,
        max_queue_requests=settings.max_queue_requests,
        request_timeout_s=settings.request_timeout_s,
        retry_after_s=settings.retry_after_s,
        adaptive_batching=settings.adaptive_batching,
        # a model leaves memory within a quarter of idle_unload_s after it goes idle
        idle_check_s=max(0.05, min(30.0, settings.idle_unload_s / 4)),
        observer=PrometheusObserver(),
    )


def _embedded_runtimes(settings: Settings, store: ObjectStore) -> dict[str, Runtime]:
    """The gateway's own runtimes: the CPU's, and GPU 0's for each GPU type offered when this
    machine has a GPU (requests for a type without one get 503, naming the type)."""
    runtimes = {"cpu": build_runtime(settings, store)}
    for target in settings.targets:
        if target in GPU_TYPES:
            try:
                runtimes[target] = build_runtime(settings, store, f"{target}:0")
            except LuminalError as exc:
                log.warning("no %s runtime in this gateway: %s", target, exc)
    return runtimes
