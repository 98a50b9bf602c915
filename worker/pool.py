"""The embedded compile pool: compile jobs on threads inside the server process."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from cloud.registry import Registry
from worker.compile import compile_version


class EmbeddedCompilePool:
    def __init__(self, registry: Registry, threads: int = 1) -> None:
        self.registry = registry
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="compile")

    def submit(self, version_id: int) -> Future:
        return self._executor.submit(compile_version, version_id, self.registry)

    def resume_unfinished(self) -> None:
        """Re-queue versions a previous process left queued or compiling."""
        for version_id in self.registry.unfinished_version_ids():
            self.registry.set_status(version_id, "queued")
            self.submit(version_id)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
