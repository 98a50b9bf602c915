"""The compile queue the gateway submits to: one small interface, the adapter chosen by settings."""

from __future__ import annotations

from typing import Protocol

from cloud.settings import Settings
from registry import Registry


class CompileQueue(Protocol):
    def submit(self, version_id: int, tenant_id: int) -> None: ...
    def cancel(self, version_ids: list[int]) -> None: ...
    def resume_unfinished(self) -> None: ...
    def shutdown(self) -> None: ...


def make_compile_queue(settings: Settings, registry: Registry) -> CompileQueue:
    """Embedded: compiles in child processes of this server. Celery: the workers compile."""
    if settings.compile_backend == "celery":
        from worker.celery_app import CeleryCompileQueue

        return CeleryCompileQueue(registry, settings)
    from worker.pool import EmbeddedCompilePool

    return EmbeddedCompilePool(
        registry,
        settings.compile_workers,
        settings.compile_timeout_s,
        settings.compile_memory_bytes,
        settings.compile_candidates,
        settings.compile_search,
    )
