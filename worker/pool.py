"""The embedded compile pool: a bounded number of compiles at a time, each in a child process
(worker/sandbox.py) that DELETE can stop.

Who runs next is SlotScheduler's decision alone (no threads, no I/O): tenants are served
round-robin, one tenant holds at most a share of the slots, and one extra slot runs small graphs
only, so a demo never waits behind another tenant's giant."""

from __future__ import annotations

import functools
import logging
import math
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Collection
from dataclasses import dataclass

from registry import Registry
from worker.compile import TRANSIENT_ERRORS, compile_version
from worker.sandbox import CompileHandle, Sandbox

log = logging.getLogger(__name__)

# a compile that met a database or storage outage is queued again after this long
OUTAGE_RETRY_S = 5.0


@dataclass(frozen=True)
class CompileJob:
    """A version waiting for a compile slot, or holding one."""

    version_id: int
    # whose turn it takes in the round-robin, and whose share of the slots it counts against
    tenant_id: int
    # the uploaded graph's size: under the small-graph threshold it may take the small slot
    graph_bytes: int


class SlotScheduler:
    """Which queued compile runs next, and in which slot.

    General slots (as many as the pool has threads for) take any graph, a tenant holding at most
    `per_tenant` of them at once (the others' compiles are never all stuck behind one tenant's).
    One more slot, when `small_bytes` > 0, takes only graphs smaller than that; a general slot
    leaves those to it while it is free, so as to stay free for a giant. Within a kind of slot,
    tenants are served round-robin: one tenant's hundred uploads wait behind every other
    tenant's next one.
    The pool calls `put` and `remove` as versions are queued and deleted, `take` when a slot is
    free (the job then holds the slot) and `done` when its compile ends."""

    def __init__(self, per_tenant: int, small_bytes: int) -> None:
        self.per_tenant = per_tenant
        self.small_bytes = small_bytes
        # tenant -> its queued jobs, oldest first; the first tenant is the next to be served
        self._queues: OrderedDict[int, deque[CompileJob]] = OrderedDict()
        # tenant -> the general slots it holds
        self._holding: dict[int, int] = {}
        self._small_busy = False

    def put(self, job: CompileJob) -> None:
        self._queues.setdefault(job.tenant_id, deque()).append(job)

    def remove(self, version_id: int) -> bool:
        """Whether the version was queued (it is no longer)."""
        for tenant_id, queue in self._queues.items():
            job = next((j for j in queue if j.version_id == version_id), None)
            if job is not None:
                queue.remove(job)
                if not queue:
                    del self._queues[tenant_id]
                return True
        return False

    def take(self, small_slot: bool) -> CompileJob | None:
        """The next job a free slot of this kind may run, now holding it; None when none may."""
        small_slot_free = self.small_bytes > 0 and not self._small_busy
        for tenant_id, queue in self._queues.items():
            if small_slot:
                job = next((j for j in queue if j.graph_bytes < self.small_bytes), None)
            elif self._holding.get(tenant_id, 0) < self.per_tenant:
                job = next((j for j in queue if not (small_slot_free and j.graph_bytes < self.small_bytes)), None)
            else:
                job = None
            if job is None:
                continue
            queue.remove(job)
            del self._queues[tenant_id]
            if queue:
                self._queues[tenant_id] = queue  # to the back of the line
            if small_slot:
                self._small_busy = True
            else:
                self._holding[tenant_id] = self._holding.get(tenant_id, 0) + 1
            return job
        return None

    def done(self, job: CompileJob, small_slot: bool) -> None:
        """The job's compile ended: its slot is free."""
        if small_slot:
            self._small_busy = False
        else:
            self._holding[job.tenant_id] -= 1
            if not self._holding[job.tenant_id]:
                del self._holding[job.tenant_id]

    def queued(self) -> list[int]:
        """Queued version ids, in no particular order."""
        return [job.version_id for queue in self._queues.values() for job in queue]


def tenant_share(workers: int, configured: int) -> int:
    """The general slots one tenant may hold: `configured`, or half of them rounded up when 0."""
    return configured if configured > 0 else max(1, math.ceil(workers / 2))


# compiles one version under a handle that stops it; returns compile_version's status
type RunFn = Callable[[int, CompileHandle], str | None]


class EmbeddedCompilePool:
    """`workers` general compile threads and, when `small_graph_bytes` > 0, one for small graphs,
    fed by a SlotScheduler. Each running compile has a CompileHandle: cancelling a version stops
    its compile if it is queued or running, and does nothing otherwise."""

    def __init__(
        self,
        registry: Registry,
        workers: int,
        run: RunFn,
        slots_per_tenant: int = 0,
        small_graph_bytes: int = 0,
    ) -> None:
        self.registry = registry
        self._run = run
        self._scheduler = SlotScheduler(tenant_share(workers, slots_per_tenant), small_graph_bytes)
        self._changed = threading.Condition()
        # version id -> the handle of its running compile
        self._running: dict[int, CompileHandle] = {}
        self._closed = False
        # one thread per slot: (its name, whether it is the small graphs' slot)
        slots = [(f"compile-{i}", False) for i in range(workers)]
        if small_graph_bytes > 0:
            slots.append(("compile-small", True))
        self._threads = [
            threading.Thread(target=self._work, args=(small,), name=name, daemon=True) for name, small in slots
        ]
        for thread in self._threads:
            thread.start()

    @classmethod
    def with_sandbox(
        cls,
        registry: Registry,
        sandbox: Sandbox,
        options: dict[str, object],
        workers: int,
        slots_per_tenant: int = 0,
        small_graph_bytes: int = 0,
        unmeasured_targets: Collection[str] = (),
    ) -> EmbeddedCompilePool:
        """A pool whose compiles run in `sandbox`'s child processes with `options`; those of
        `unmeasured_targets` without their GPU (compile_version labels them)."""

        def run(version_id: int, handle: CompileHandle) -> str | None:
            compile_fn = functools.partial(sandbox.compile, handle=handle)
            return compile_version(version_id, registry, compile_fn, options, unmeasured_targets)

        return cls(registry, workers, run, slots_per_tenant, small_graph_bytes)

    def _next(self, small_slot: bool) -> tuple[CompileJob, CompileHandle] | None:
        with self._changed:
            while not self._closed:
                job = self._scheduler.take(small_slot)
                if job is not None:
                    # registered as it is taken: a cancel from now on reaches this compile
                    handle = self._running[job.version_id] = CompileHandle(job.version_id)
                    return job, handle
                self._changed.wait()
            return None

    def _work(self, small_slot: bool) -> None:
        while (taken := self._next(small_slot)) is not None:
            job, handle = taken
            try:
                status = self._run(job.version_id, handle)
            except TRANSIENT_ERRORS as exc:
                log.warning("compiling version %s met an outage (%s); queued again", job.version_id, exc)
                retry = threading.Timer(OUTAGE_RETRY_S, self._put, (job,))
                retry.daemon = True
                retry.start()
                status = None
            except Exception:  # a bug here must not end the thread, and with it the slot
                log.exception("the compile of version %s raised", job.version_id)
                status = None
            with self._changed:
                if self._running.get(job.version_id) is handle:
                    del self._running[job.version_id]
                self._scheduler.done(job, small_slot)
                self._changed.notify_all()
            if status == "queued":  # stopped while its version remained: its turn comes again
                self._put(job)

    def submit(self, version_id: int, tenant_id: int) -> None:
        version = self.registry.get_version(version_id)
        if version is not None:
            self._put(CompileJob(version_id, tenant_id, version.graph_bytes))

    def _put(self, job: CompileJob) -> None:
        with self._changed:
            if self._closed:
                return
            self._scheduler.put(job)
            self._changed.notify_all()

    def cancel(self, version_ids: list[int]) -> None:
        """Stops the compiles of deleted versions, queued or running; nothing for the others."""
        with self._changed:
            handles = [
                self._running[version_id]
                for version_id in version_ids
                if not self._scheduler.remove(version_id) and version_id in self._running
            ]
        for handle in handles:
            handle.cancel()

    def running(self) -> list[int]:
        with self._changed:
            return list(self._running)

    def queued(self) -> list[int]:
        with self._changed:
            return self._scheduler.queued()

    def resume_unfinished(self) -> None:
        """Re-queues what a previous process left unfinished; a compile that was interrupted
        twice (it may be what brought the server down) is failed instead of resumed forever."""
        for version_id, tenant_id in self.registry.resume_unfinished():
            self.submit(version_id, tenant_id)

    def shutdown(self) -> None:
        with self._changed:
            self._closed = True
            handles = list(self._running.values())
            self._changed.notify_all()
        for handle in handles:
            handle.cancel()
        for thread in self._threads:
            thread.join(timeout=30)
