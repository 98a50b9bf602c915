"""The compile queue the gateway submits to: one small interface, the adapter chosen by settings."""

from __future__ import annotations

from functools import cache
from typing import Protocol

from cloud.settings import Settings
from registry import Registry
from worker.devices import TargetCheck, check_targets, known_targets, probe_cuda


class CompileQueue(Protocol):
    def submit(self, version_id: int, tenant_id: int) -> None: ...
    def cancel(self, version_ids: list[int]) -> None: ...
    def resume_unfinished(self) -> None: ...
    def shutdown(self) -> None: ...


def check_compile_settings(settings: Settings) -> None:
    """ValueError naming the setting unless its targets are device types the compiler knows and
    its compile candidates programs it can build: what the settings cannot check themselves,
    since importing them must not import the compiler. Each process that compiles or takes
    uploads (a gateway, a worker) checks them as it starts."""
    from worker.compile import compile_candidates

    known_targets(settings.targets)
    compile_candidates(settings.compile_candidates)


def compile_check(settings: Settings) -> TargetCheck:
    """What this server may compile for: on Celery every target (each worker checks its own
    device); embedded, each GPU type only when GPU 0 is of its compute capability, or unmeasured
    where settings allow. Its `refused` targets are refused at upload. ValueError for a target
    the compiler does not know (known_targets)."""
    known_targets(settings.targets)
    if settings.compile_backend == "celery":
        return TargetCheck(measured=settings.targets)
    return _embedded_check(settings.targets, settings.allow_unmeasured_compile)


@cache  # the machine's GPU stays what it is: asked once per process
def _embedded_check(targets: tuple[str, ...], allow_unmeasured: bool) -> TargetCheck:
    return check_targets(targets, None, probe_cuda, allow_unmeasured)


def make_compile_queue(settings: Settings, registry: Registry) -> CompileQueue:
    """Embedded: compiles in child processes of this server. Celery: the workers compile."""
    if settings.compile_backend == "celery":
        from worker.celery_app import CeleryCompileQueue

        return CeleryCompileQueue(registry, settings)
    from worker.compile import compile_candidates, compile_options
    from worker.pool import EmbeddedCompilePool
    from worker.sandbox import Sandbox

    candidates, search = compile_candidates(settings.compile_candidates), settings.compile_search
    sandbox = Sandbox(settings.compile_timeout_s, settings.compile_memory_bytes, candidates, search, settings)
    return EmbeddedCompilePool.with_sandbox(
        registry,
        sandbox,
        compile_options(candidates, search),
        settings.compile_workers,
        unmeasured_targets=compile_check(settings).unmeasured,
        slots_per_tenant=settings.compile_slots_per_tenant,
        small_graph_bytes=settings.compile_small_graph_bytes,
    )
