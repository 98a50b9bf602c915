"""Builds the service's components from settings: the factory that picks each adapter."""

from __future__ import annotations

from dataclasses import dataclass

from cloud.db import Database
from cloud.metering import Ledger
from cloud.registry import Registry
from cloud.settings import Settings
from cloud.storage import ObjectStore, load_artifact, make_object_store
from compiler import Artifact
from runtime import CpuDevice, Runtime
from scheduler.engine import Engine, InProcessEngine
from worker.pool import EmbeddedCompilePool


@dataclass
class Services:
    settings: Settings
    db: Database
    store: ObjectStore
    registry: Registry
    ledger: Ledger
    compiler: EmbeddedCompilePool
    engine: Engine | None = None

    def close(self) -> None:
        self.compiler.shutdown()
        self.db.dispose()


def open_database(settings: Settings) -> Database:
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    db = Database(settings.resolved_database_url)
    db.create_all()
    return db


def build_services(settings: Settings) -> Services:
    db = open_database(settings)
    store = make_object_store(settings)
    registry = Registry(db, store, settings.targets)
    return Services(
        settings=settings,
        db=db,
        store=store,
        registry=registry,
        ledger=Ledger(db),
        compiler=EmbeddedCompilePool(registry, settings.compile_threads),
    )


def build_engine(services: Services) -> Engine:
    """The in-process engine; needs a running event loop (its batchers are asyncio tasks)."""
    settings, store = services.settings, services.store

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
    )
