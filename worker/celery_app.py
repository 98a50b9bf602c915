"""Compile jobs on Celery: the distributed compile backend (settings.compile_backend="celery").

The task is a thin wrapper over worker.compile.compile_version. A message is acknowledged only
after its compile ends (acks_late), so a worker killed midway leaves it in Redis, and the broker
hands it to a worker again once its visibility timeout passes. Two deliveries of one version
never compile at once: a worker holds a lease on the version in Redis while it compiles. Graphs
under compile_small_graph_bytes are sent at the highest priority, so a worker takes them before
any waiting giant.

A worker takes a GPU target's queue only when it holds that GPU, or when settings let it compile
the target unmeasured (worker/devices.py). A version compiled unmeasured is compiled again by a
worker holding the GPU: a recompile message waits for one in the target's measured queue, and
each such worker, as it starts, queues every unmeasured version of its targets there too.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache

import redis
from celery import Celery
from celery.signals import worker_ready
from kombu.exceptions import KombuError

from cloud.settings import Settings, get_settings
from compiler.targets import GPU_TYPES
from registry import Registry
from worker.compile import (
    TRANSIENT_ERRORS,
    compile_candidates,
    compile_options,
    compile_version,
    recompile_measured,
)
from worker.devices import TargetCheck, is_unmeasured, show_only_gpu
from worker.sandbox import CompileHandle, Sandbox

log = logging.getLogger(__name__)

COMPILE_TASK = "luminal.compile_version"
RECOMPILE_TASK = "luminal.recompile_measured"
# the app's setting naming the targets this worker compiles without their GPU
UNMEASURED_TARGETS_CONF = "luminal_unmeasured_targets"
# a lease outlives its holder by this long: a dead worker's version is free again well before
# the broker's visibility timeout hands its message to another worker
LEASE_S = 10.0
HEARTBEAT_S = 2.0
# the longest an upload's answer waits for its compile to reach the broker: a send takes
# milliseconds, a failed one (the broker just went down) seconds; once a send failed, a second
SUBMIT_WAIT_S = 8.0
SUBMIT_WAIT_DOWN_S = 1.0
# message priorities on the Redis broker, where 0 is taken first: small graphs, then the rest
SMALL_PRIORITY = 0
LARGE_PRIORITY = 6


def compile_queue(target: str) -> str:
    """The queue of a target's compiles: a worker takes only the targets it can compile for."""
    return f"compile.{target}"


def measured_queue(target: str) -> str:
    """The queue of a GPU target's compiles that need its GPU (an unmeasured version compiled
    again): only workers holding that GPU take it."""
    return f"compile.{target}.measured"


def redelivery_s(settings: Settings) -> float:
    """How long a taken, unacknowledged compile waits before the broker gives it to another
    worker: longer than any compile may run, so a live worker's job is never handed out twice."""
    return settings.compile_timeout_s + 2 * LEASE_S


def make_celery(settings: Settings) -> Celery:
    app = Celery("luminal", broker=settings.redis_url, backend=settings.redis_url)
    app.conf.update(
        task_acks_late=True,
        # a worker that dies midway (OOM killer, SIGKILL) puts its message back
        task_reject_on_worker_lost=True,
        # one message at a time per thread: a long compile never holds others hostage
        worker_prefetch_multiplier=1,
        # the hard limit: the sandbox kills a compile's process group at compile_timeout_s (the
        # worker's threads pool cannot enforce Celery's own time limits)
        task_time_limit=settings.compile_timeout_s + LEASE_S,
        broker_transport_options={
            "visibility_timeout": redelivery_s(settings),
            # one Redis list per priority, read in this order (kombu's default steps)
            "priority_steps": [SMALL_PRIORITY, 3, LARGE_PRIORITY, 9],
            # look for messages of dead workers every few seconds, not every 100 s
            "unacked_restore_interval": 5,
            "unacked_restore_throttle": 1,
        },
        broker_connection_retry_on_startup=True,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_expires=24 * 3600,
        worker_hijack_root_logger=False,
        task_default_queue=compile_queue(settings.targets[0]),
    )
    for name, task in ((COMPILE_TASK, _compile_task), (RECOMPILE_TASK, _recompile_task)):
        # a broker or database that is briefly away: retried with backoff, not failed
        app.task(
            name=name,
            bind=True,
            autoretry_for=TRANSIENT_ERRORS,
            retry_backoff=2,
            retry_backoff_max=60,
            retry_jitter=True,
            max_retries=settings.compile_max_retries,
        )(task)
    return app


# -- the worker side --


@dataclass
class WorkerContext:
    """What a worker process compiles with, built once per process after Celery forks it."""

    registry: Registry
    sandbox: Sandbox
    options: dict[str, object]
    redis: redis.Redis
    holder: str


@cache
def worker_context() -> WorkerContext:
    from cloud.db import open_database
    from cloud.storage import make_object_store

    settings = get_settings()
    db = open_database(settings)
    registry = Registry(db, make_object_store(settings), settings.targets)
    candidates, search = compile_candidates(settings.compile_candidates), settings.compile_search
    return WorkerContext(
        registry=registry,
        sandbox=Sandbox(settings.compile_timeout_s, settings.compile_memory_bytes, candidates, search, settings),
        options=compile_options(candidates, search),
        redis=redis.Redis.from_url(settings.redis_url),
        holder=f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}",
    )


def _lease_key(version_id: int) -> str:
    return f"luminal:compile-lease:{version_id}"


@contextmanager
def compile_lease(context: WorkerContext, version_id: int, handle: CompileHandle | None = None) -> Iterator[bool]:
    """Yields whether this process holds the version's lease. While held, a thread renews it
    and stops the compile of `handle` if the version is deleted."""
    key = _lease_key(version_id)
    if not context.redis.set(key, context.holder, nx=True, px=int(LEASE_S * 1000)):
        yield False
        return
    done = threading.Event()

    def renew() -> None:
        while not done.wait(HEARTBEAT_S):
            try:
                context.redis.set(key, context.holder, xx=True, px=int(LEASE_S * 1000))
                if handle is not None and context.registry.get_version(version_id) is None:
                    handle.cancel()
            except Exception:  # an outage must not end the compile; the next beat retries
                log.warning("renewing the compile lease of version %s failed", version_id, exc_info=True)

    thread = threading.Thread(target=renew, name=f"lease-{version_id}", daemon=True)
    thread.start()
    try:
        yield True
    finally:
        done.set()
        thread.join()
        if context.redis.get(key) == context.holder.encode():
            context.redis.delete(key)


@contextmanager
def _leased_compile(version_id: int):
    """(this delivery's sandboxed compile, the worker's context) while it holds the version's lease;
    the compile is None where another worker holds it."""
    context = worker_context()
    # this delivery's compile, and nothing after it: what the lease's watch cancels
    handle = CompileHandle(version_id)
    with compile_lease(context, version_id, handle) as held:
        if not held:
            log.info("version %s is compiling in another worker; this delivery ends", version_id)
            yield None, context
        else:
            yield functools.partial(context.sandbox.compile, handle=handle), context


def _compile_task(task, version_id: int) -> str | None:
    unmeasured = task.app.conf.get(UNMEASURED_TARGETS_CONF) or ()
    with _leased_compile(version_id) as (compile_fn, context):
        if compile_fn is None:
            return "leased"
        status = compile_version(version_id, context.registry, compile_fn, context.options, unmeasured)
    if status == "queued":  # stopped while its version remains: compiled again, never left compiling
        raise task.retry(countdown=1)
    version = context.registry.get_version(version_id) if status == "ready" and unmeasured else None
    if version is not None and is_unmeasured(version.report):  # for the first worker holding its GPU
        send_recompile(task.app, version_id, version.target)
    return status


def _recompile_task(task, version_id: int) -> str | None:
    with _leased_compile(version_id) as (compile_fn, context):
        if compile_fn is None:
            return "leased"
        return recompile_measured(version_id, context.registry, compile_fn, context.options)


def send_recompile(app: Celery, version_id: int, target: str) -> None:
    """Queues the version for a worker holding `target`'s GPU, behind any first compile."""
    app.send_task(
        RECOMPILE_TASK, args=[version_id], queue=measured_queue(target), priority=LARGE_PRIORITY, ignore_result=True
    )


def requeue_unmeasured(app: Celery, registry: Registry, gpu_targets: tuple[str, ...]) -> int:
    """Queues every unmeasured version of `gpu_targets` for a compile on their GPU (a worker
    holding it has started); returns how many. A version queued twice compiles once."""
    version_ids = [(v, t) for t in gpu_targets for v in registry.unmeasured_versions([t])]
    for version_id, target in version_ids:
        send_recompile(app, version_id, target)
    return len(version_ids)


def run_worker(settings: Settings, check: TargetCheck, concurrency: int, loglevel: str = "INFO") -> None:
    """Runs a Celery worker that takes the compiles of the targets `check` accepts (blocks until
    stopped): their queues, and the measured queues of the GPU targets whose GPU it holds, whose
    unmeasured versions it queues there once ready. Its /metrics on worker_metrics_port when one
    is set (the compile panels read them)."""
    if settings.worker_metrics_port:
        from prometheus_client import start_http_server

        from cloud.metrics import REGISTRY

        start_http_server(settings.worker_metrics_port, registry=REGISTRY)
    if check.gpu_ordinal is not None:
        show_only_gpu(check.gpu_ordinal)
    app = make_celery(settings)
    app.conf.update({UNMEASURED_TARGETS_CONF: list(check.unmeasured)})
    held_gpus = tuple(t for t in check.measured if t in GPU_TYPES)
    queues = ",".join([*(compile_queue(t) for t in check.accepted), *(measured_queue(t) for t in held_gpus)])

    def on_ready(**_: object) -> None:
        try:
            queued = requeue_unmeasured(app, worker_context().registry, held_gpus)
        except Exception:  # the next start tries again; this worker compiles meanwhile
            log.exception("queueing the unmeasured versions of %s again failed", ", ".join(held_gpus))
            return
        if queued:
            log.info("queued %d unmeasured version(s) of %s to compile on this GPU", queued, ", ".join(held_gpus))

    if held_gpus:
        worker_ready.connect(on_ready, weak=False)
    targets = check.accepted
    app.worker_main(
        # threads: each compile already runs in a sandbox process of its own, which a pool
        # process (a daemon) could not start
        ["worker", "--pool", "threads", "--queues", queues, "--concurrency", str(concurrency), "--loglevel", loglevel,
         "--hostname", f"compile-{'+'.join(targets)}@{socket.gethostname()}-{os.getpid()}"]
    )


# -- the gateway side --


class CeleryCompileQueue:
    """The gateway's end. An outbox thread sends, and keeps what it could not send (Redis down)
    until the broker is back. `submit` waits for the send, a few milliseconds: an upload is
    answered once the broker holds its compile, so a gateway killed after answering loses no
    compile. While the broker is down (a send failed, which takes redis-py's retries, about 6 s)
    it waits a second at most and the outbox keeps the job: a gateway killed then leaves it
    queued until a gateway starts and resumes it."""

    def __init__(self, registry: Registry, settings: Settings) -> None:
        self.registry = registry
        self.app = make_celery(settings)
        self.small_graph_bytes = settings.compile_small_graph_bytes
        # version id -> (target, priority), in submission order
        self._outbox: dict[int, tuple[str, int]] = {}
        self._wake = threading.Condition()
        self._closed = False
        # sends tried so far, and whether the last failed: a submit waits for one try, not a broker
        self._attempts = 0
        self._broker_down = False
        self._sender = threading.Thread(target=self._send_loop, name="compile-outbox", daemon=True)
        self._sender.start()

    def submit(self, version_id: int, tenant_id: int) -> None:
        """Hands the compile to the broker, or to the outbox while the broker is down; blocks (a
        database read, then the send): call it off the event loop."""
        version = self.registry.get_version(version_id)
        if version is None:
            return
        small = version.graph_bytes < self.small_graph_bytes
        with self._wake:
            self._outbox[version_id] = (version.target, SMALL_PRIORITY if small else LARGE_PRIORITY)
            self._wake.notify_all()  # a sender waiting out its backoff tries again now
            tried = self._attempts
            self._wake.wait_for(
                lambda: version_id not in self._outbox or self._closed or (self._broker_down and self._attempts > tried),
                # known down: a failed try takes seconds, and the outbox keeps the job meanwhile
                timeout=SUBMIT_WAIT_DOWN_S if self._broker_down else SUBMIT_WAIT_S,
            )

    def cancel(self, version_ids: list[int]) -> None:
        """A deleted version's message ends at once when it is taken; a running compile is
        stopped by its worker, which watches for the deletion."""
        with self._wake:
            for version_id in version_ids:
                self._outbox.pop(version_id, None)

    def resume_unfinished(self) -> None:
        """Sends again what is still queued: a gateway that stopped between storing an upload
        and sending it leaves it so (a duplicate message is harmless: the task is idempotent)."""
        for version_id, tenant_id in self.registry.queued_versions():
            self.submit(version_id, tenant_id)

    def _send_loop(self) -> None:
        delay = 0.5
        while True:
            with self._wake:
                while not self._outbox and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                version_id, (target, priority) = next(iter(self._outbox.items()))
            try:
                self.app.send_task(
                    COMPILE_TASK,
                    args=[version_id],
                    queue=compile_queue(target),
                    priority=priority,
                    retry=False,
                    # the version's row says how it went: no subscription to a result nobody reads
                    ignore_result=True,
                )
            except (KombuError, redis.exceptions.RedisError, OSError):  # the broker is down: keep the job
                log.warning("could not send the compile of version %s; retrying in %.1f s", version_id, delay)
                with self._wake:
                    self._attempts, self._broker_down = self._attempts + 1, True
                    self._wake.notify_all()
                    self._wake.wait(delay)
                delay = min(delay * 2, 10.0)
                continue
            delay = 0.5
            with self._wake:
                self._attempts, self._broker_down = self._attempts + 1, False
                if self._outbox.get(version_id) == (target, priority):
                    del self._outbox[version_id]
                self._wake.notify_all()

    def pending(self) -> int:
        with self._wake:
            return len(self._outbox)

    def shutdown(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify_all()
        self._sender.join(timeout=10)
        self.app.close()


def wait_for_broker(settings: Settings, timeout_s: float = 5.0) -> None:
    """Raises Unavailable naming the URL when Redis does not answer within `timeout_s`."""
    from cloud.db import masked_url
    from cloud.errors import Unavailable

    client = redis.Redis.from_url(settings.redis_url, socket_connect_timeout=2)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.ping()
            return
        except redis.exceptions.RedisError as exc:
            if time.monotonic() > deadline:
                raise Unavailable(f"Redis at {masked_url(settings.redis_url)} is unreachable: {exc}") from None
            time.sleep(0.5)
        finally:
            client.close()
