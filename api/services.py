"""Builds the service's components from settings: the factory that picks each adapter."""

from __future__ import annotations

import fcntl
from dataclasses import dataclass
from pathlib import Path

from api.codec import Codec
from cloud.db import Database
from cloud.metering import Ledger
from cloud.registry import Registry
from cloud.settings import Settings
from cloud.storage import ObjectStore, load_artifact, make_object_store
from compiler import Artifact
from runtime import CpuDevice, Runtime
from scheduler.engine import Engine, InProcessEngine
from worker.queue import CompileQueue, make_compile_queue


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
    store: ObjectStore
    registry: Registry
    ledger: Ledger
    compiler: CompileQueue
    codec: Codec
    lock: DataDirLock
    engine: Engine | None = None
    def close(self) -> None:
        self.compiler.shutdown()
        self.codec.close()
        self.db.dispose()
        self.lock.release()


def open_database(settings: Settings) -> Database:
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    db = Database(settings.resolved_database_url)
    db.create_all()
    return db


def build_services(settings: Settings) -> Services:
    """Everything a server holds; raises DataDirInUse before any work if another server holds
    the data directory."""
    lock = DataDirLock(settings.data_dir)
    db = open_database(settings)
    store = make_object_store(settings)
    registry = Registry(db, store, settings.targets)
    return Services(
        settings=settings,
        db=db,
        store=store,
        registry=registry,
        ledger=Ledger(db),
        compiler=make_compile_queue(settings, registry),
        codec=Codec(settings.codec_process_above_bytes, settings.codec_workers),
        lock=lock,
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
        )

    def fetch(key: str) -> Artifact:
        return load_artifact(store, key)

    runtime = Runtime(CpuDevice(), fetch, settings.max_loaded_models, settings.idle_unload_s)
    return InProcessEngine(
        runtimes={"cpu": runtime},
        ledger=services.ledger,
        prices=settings.price_per_second,
        max_batch_rows=settings.max_batch_rows,
        max_delay_s=settings.max_queue_delay_ms / 1000.0,
        max_queue_requests=settings.max_queue_requests,
        request_timeout_s=settings.request_timeout_s,
        retry_after_s=settings.retry_after_s,
        # a model leaves memory within a quarter of idle_unload_s after it goes idle
        idle_check_s=max(0.05, min(30.0, settings.idle_unload_s / 4)),
    )
