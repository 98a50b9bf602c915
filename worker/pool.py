"""The embedded compile pool: a bounded number of compiles at a time, taken fairly across
tenants, each in a child process (worker/sandbox.py) that DELETE can stop."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque

from registry import Registry
from worker.compile import TRANSIENT_ERRORS, compile_options, compile_version
from worker.sandbox import Sandbox

log = logging.getLogger(__name__)

# a compile that met a database or storage outage is queued again after this long
OUTAGE_RETRY_S = 5.0


class FairQueue:
    """Version ids queued per tenant, taken round-robin: one tenant's hundred uploads wait
    behind every other tenant's next one."""

    def __init__(self) -> None:
        # tenant -> its queued version ids; the first tenant is the next to be served
        self._queues: OrderedDict[int, deque[int]] = OrderedDict()
        self._ready = threading.Condition()
        self._closed = False

    def put(self, tenant_id: int, version_id: int) -> None:
        with self._ready:
            self._queues.setdefault(tenant_id, deque()).append(version_id)
            self._ready.notify()

    def get(self) -> int | None:
        """The next version id, blocking; None once closed."""
        with self._ready:
            while not self._queues and not self._closed:
                self._ready.wait()
            if self._closed:
                return None
            tenant_id, queue = next(iter(self._queues.items()))
            version_id = queue.popleft()
            del self._queues[tenant_id]
            if queue:
                self._queues[tenant_id] = queue  # to the back of the line
            return version_id

    def remove(self, version_id: int) -> bool:
        with self._ready:
            for tenant_id, queue in list(self._queues.items()):
                if version_id in queue:
                    queue.remove(version_id)
                    if not queue:
                        del self._queues[tenant_id]
                    return True
        return False

    def close(self) -> None:
        with self._ready:
            self._closed = True
            self._ready.notify_all()


class EmbeddedCompilePool:
    def __init__(
        self,
        registry: Registry,
        workers: int,
        timeout_s: float,
        memory_bytes: int,
        candidates: tuple[str, ...],
        search: bool = True,
    ) -> None:
        self.registry = registry
        self.sandbox = Sandbox(timeout_s, memory_bytes, candidates, search)
        self.options = compile_options(candidates, search)
        self._queue = FairQueue()
        self._tenants: dict[int, int] = {}  # version id -> tenant, to queue a retry fairly
        self._threads = [
            threading.Thread(target=self._work, name=f"compile-{i}", daemon=True) for i in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    def _work(self) -> None:
        while (version_id := self._queue.get()) is not None:
            try:
                compile_version(version_id, self.registry, self.sandbox.compile, self.options)
            except TRANSIENT_ERRORS as exc:
                log.warning("compiling version %s met an outage (%s); queued again", version_id, exc)
                retry = threading.Timer(OUTAGE_RETRY_S, self._resubmit, (version_id,))
                retry.daemon = True
                retry.start()
            else:
                self._tenants.pop(version_id, None)

    def submit(self, version_id: int, tenant_id: int) -> None:
        self._tenants[version_id] = tenant_id
        self._queue.put(tenant_id, version_id)

    def _resubmit(self, version_id: int) -> None:
        self.submit(version_id, self._tenants[version_id])

    def cancel(self, version_ids: list[int]) -> None:
        """Stops the compiles of deleted versions, queued or running."""
        for version_id in version_ids:
            if not self._queue.remove(version_id):
                self.sandbox.cancel(version_id)

    def resume_unfinished(self) -> None:
        """Re-queues what a previous process left unfinished; a compile that was interrupted
        twice (it may be what brought the server down) is failed instead of resumed forever."""
        for version_id, tenant_id in self.registry.resume_unfinished():
            self.submit(version_id, tenant_id)

    def shutdown(self) -> None:
        self._queue.close()
        for version_id in list(self.sandbox.running()):
            self.sandbox.cancel(version_id)
        for thread in self._threads:
            thread.join(timeout=30)
