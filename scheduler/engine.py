"""The inference engine the API talks to, and its in-process implementation.

The API calls `Engine.infer` with a Route (which model version, whose) and validated inputs.
The in-process engine keeps one Batcher per model version; each drives a pure BatchQueue,
runs due batches on the runtime for the version's device in a worker thread, meters them,
and resolves the callers' futures.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Protocol

import numpy as np

from cloud.errors import (
    DeadlineExceeded,
    InvalidInput,
    LuminalError,
    Overloaded,
    PayloadTooLarge,
    Unavailable,
)
from cloud.usage import Usage
from compiler.shape import ShapeError
from runtime import Runtime
from runtime.runtime import DoesNotFit
from scheduler.observer import NO_OBSERVER, SchedulerObserver
from scheduler.policy import BatchPolicy, BatchQueue, Pending, QueueFull
from scheduler.pricing import UsageSink, price_for, split_by_rows

if TYPE_CHECKING:  # annotations only: a runtime process of inference models never loads generation
    from scheduler.generating import GenerationService
    from scheduler.generator import GenerationRequest, TokenEvent

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Route:
    """Everything the engine needs to know about the model version a request is for."""

    # database id of the version: the queue key
    version_id: int
    tenant_id: int
    tenant_name: str
    model_name: str
    version: int
    # device type the version was compiled for
    target: str
    # object-store prefix of its artifact
    artifact_key: str
    # whether requests may be concatenated along a batch dimension
    batchable: bool
    # memory the loaded program holds (its weights), to place it on a runtime with room for it
    model_bytes: int = 0
    # a generative version's tokenizer bundle and cache layout (registry.bundle); None otherwise
    bundle: dict | None = None


@dataclass
class InferenceResult:
    outputs: dict[str, np.ndarray]
    # requests and rows in the batch this request ran in
    batch_size: int
    batch_rows: int
    # this request's billed share of the batch's device time, and the whole batch's
    exec_seconds: float
    batch_exec_seconds: float
    # time spent waiting in the queue (not billed)
    queue_seconds: float
    # cold start (not billed): waiting for a runtime to start when its pool was at zero, and
    # loading the model when its batch had to
    cold_start_seconds: float = 0.0


class Engine(Protocol):
    async def infer(
        self, route: Route, inputs: Mapping[str, np.ndarray], rows: int, request_id: str
    ) -> InferenceResult: ...

    def generate(self, route: Route, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        """A generative version's sequence, its events as they come (scheduler.generating)."""
        ...

    def forget(self, version_id: int) -> None: ...

    async def close(self) -> None: ...


@dataclass
class _Job:
    inputs: Mapping[str, np.ndarray]
    future: asyncio.Future


class InProcessEngine:
    def __init__(
        self,
        runtimes: Mapping[str, Runtime],
        ledger: UsageSink,
        prices: Mapping[str, float],
        max_batch_rows: int,
        max_delay_s: float,
        max_queue_requests: int,
        request_timeout_s: float,
        retry_after_s: int,
        idle_check_s: float = 30.0,
        adaptive_batching: bool = True,
        observer: SchedulerObserver = NO_OBSERVER,
        generation: GenerationService | None = None,
    ) -> None:
        self.runtimes = runtimes
        self.generation = generation
        self.ledger = ledger
        self.observer = observer
        self.prices = prices
        self._policy = {
            "max_batch_rows": max_batch_rows,
            "max_delay_s": max_delay_s,
            "max_queue_requests": max_queue_requests,
            "adaptive": adaptive_batching,
        }
        self.request_timeout_s = request_timeout_s
        self.retry_after_s = retry_after_s
        self._batchers: dict[int, Batcher] = {}
        # versions forgotten lately (deleted) -> when: a request that resolved its version just
        # before the delete is refused, not given a new batcher for a program that is gone
        self._forgotten: dict[tuple[int, int, str, int], float] = {}
        # batchers closed but maybe still finishing a batch; awaited by close()
        self._closing: set[Batcher] = set()
        # needs the running loop the engine is built in (see api.services.build_engine)
        self._janitor = asyncio.get_running_loop().create_task(self._unload_idle_every(idle_check_s))

    async def _unload_idle_every(self, period_s: float) -> None:
        """Scale to zero: models idle past the runtime's idle_unload_s leave device memory."""
        while True:
            await asyncio.sleep(period_s)
            for runtime in self.runtimes.values():
                runtime.unload_idle()
            if self.generation is not None:
                self.generation.unload_idle()

    def generate(self, route: Route, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        if self.generation is None:
            raise Unavailable("this server does not serve text generation")
        if _route_identity(route) in self._forgotten:
            raise Unavailable(_deleted_message(route))
        return self.generation.stream(route, request)

    async def infer(
        self, route: Route, inputs: Mapping[str, np.ndarray], rows: int, request_id: str
    ) -> InferenceResult:
        if route.target not in self.runtimes:
            raise Unavailable(f"no runtime serves device type {route.target!r}")
        batcher = self._batchers.get(route.version_id)
        if batcher is None:
            if _route_identity(route) in self._forgotten:
                raise Unavailable(_deleted_message(route))
            policy = BatchPolicy(**self._policy, batchable=route.batchable)
            batcher = Batcher(self, route, policy)
            self._batchers[route.version_id] = batcher
        return await batcher.submit(inputs, rows, request_id)

    def forget(self, version_id: int) -> None:
        """The version was deleted: its queued requests get 503 now, a batch it is running
        finishes and answers (it ran, and is billed), and its program leaves the device after."""
        generated = self.generation.forget(version_id) if self.generation is not None else None
        if generated is not None:
            self._forgotten[_route_identity(generated)] = time.monotonic()
        batcher = self._batchers.pop(version_id, None)
        if batcher is None:
            return
        now = time.monotonic()
        self._forgotten = {k: t for k, t in self._forgotten.items() if now - t < 2 * self.request_timeout_s}
        self._forgotten[_route_identity(batcher.route)] = now
        batcher.close()
        self._closing.add(batcher)
        batcher.finished.add_done_callback(lambda _: self._closing.discard(batcher))
        self.runtimes[batcher.route.target].unload(batcher.route.artifact_key)

    async def close(self, grace_s: float = 30.0) -> None:
        """Stops every batcher; batches under way get `grace_s` to finish and answer."""
        self._janitor.cancel()
        if self.generation is not None:
            self.generation.close()
        for version_id in list(self._batchers):
            self.forget(version_id)
        running = [b.finished for b in self._closing]
        if running:
            _, late = await asyncio.wait(running, timeout=grace_s)
            for task in late:
                task.cancel()

    def run_and_meter(self, route: Route, batch: list[Pending], busy: bool = False) -> list[InferenceResult]:
        """Runs in a worker thread: execute the batch, then write its usage records."""
        results, usages = run_priced(self.runtimes[route.target], self.prices, route, batch, self.observer, busy)
        self.ledger.record(usages)
        return results


def run_priced(
    runtime: Runtime,
    prices: Mapping[str, float],
    route: Route,
    batch: list[Pending],
    observer: SchedulerObserver,
    busy: bool = False,
) -> tuple[list[InferenceResult], list[Usage]]:
    """Executes a batch (each Pending's payload has `.inputs`) and prices each request's share
    of its device time; reports the batch to the observer. `busy`: other requests wait behind it."""
    rows = [p.rows for p in batch]
    result = runtime.run_batch(route.artifact_key, [p.payload.inputs for p in batch], rows, busy)
    shares = split_by_rows(result.exec_seconds, rows)
    price = price_for(route.target, prices)
    usages = [
        Usage(
            request_id=p.request_id,
            tenant_id=route.tenant_id,
            model_name=route.model_name,
            version=route.version,
            target=route.target,
            rows=p.rows,
            batch_size=len(batch),
            batch_rows=sum(rows),
            batch_exec_seconds=result.exec_seconds,
            billed_seconds=share,
            price_per_second=price,
        )
        for p, share in zip(batch, shares)
    ]
    observer.batch_executed(
        route.tenant_name, route.model_name, route.target, len(batch), result.exec_seconds, sum(shares)
    )
    results = [
        InferenceResult(out, len(batch), sum(rows), share, result.exec_seconds, 0.0, result.load_seconds)
        for out, share in zip(result.outputs, shares)
    ]
    return results, usages


def run_isolating[T](
    run: Callable[[list[Pending]], list[T]], batch: list[Pending], label: str
) -> list[tuple[Pending, T | BaseException]]:
    """Each request's result or error. A request whose own input breaks the batch (an index out
    of range, a size the model refuses, too much memory) fails alone: the others run again
    without it."""
    try:
        return list(zip(batch, run(batch)))
    except DoesNotFit as exc:  # the model, not a request: every request of it waits for room
        return [(pending, Unavailable(str(exc))) for pending in batch]
    except FileNotFoundError:  # its artifact left the store: the version was deleted meanwhile
        gone = Unavailable(f"the compiled program of {label} is no longer stored: the model was deleted")
        return [(pending, gone) for pending in batch]
    except (IndexError, ShapeError, MemoryError) as exc:
        if len(batch) > 1:
            return [outcome for pending in batch for outcome in run_isolating(run, [pending], label)]
        return [(batch[0], _request_error(exc))]
    except Exception as exc:  # a failing batch fails its requests, never the batcher
        log.exception("batch for %s failed", label)
        return [(pending, exc) for pending in batch]


class Batcher:
    """Drives one BatchQueue for one model version on the event loop."""

    def __init__(self, engine: InProcessEngine, route: Route, policy: BatchPolicy) -> None:
        self.engine = engine
        self.route = route
        self.queue = BatchQueue(policy)
        self._loop = asyncio.get_running_loop()
        self._wakeup = asyncio.Event()
        self._closed = False
        self.finished = self._loop.create_task(self._run(), name=f"batcher-{route.version_id}")

    async def submit(self, inputs: Mapping[str, np.ndarray], rows: int, request_id: str):
        if self._closed:
            raise Unavailable(_deleted_message(self.route))
        now = self._loop.time()
        future = self._loop.create_future()
        pending = Pending(
            request_id,
            rows,
            now,
            now + self.engine.request_timeout_s,
            _Job(inputs, future),
            shape_key=tuple((name, np.shape(x)[1:]) for name, x in sorted(inputs.items())),
        )
        try:
            self.queue.submit(pending, now)
        except QueueFull as exc:
            self.engine.observer.request_rejected(self.route.tenant_name, self.route.model_name)
            raise Overloaded(
                f"the queue for {self.route.model_name} v{self.route.version} is full ({exc})",
                retry_after=self.engine.retry_after_s,
            ) from None
        self._wakeup.set()
        return await future

    def close(self) -> None:
        """Queued requests fail now; the task ends once a batch under way has answered. Never
        cancels that batch: its thread would run on, and its callers wait forever."""
        self._closed = True
        for pending in self.queue.expired(float("inf")):
            _fail(pending, Unavailable(_deleted_message(self.route, "while the request was queued")))
        self._wakeup.set()

    async def _run(self) -> None:
        while not self._closed:
            now = self._loop.time()
            for pending in self.queue.expired(now):
                _fail(pending, DeadlineExceeded("the request waited in the queue past its deadline"))
            batch = self.queue.take_batch(now)
            if batch is not None:
                await self._execute(batch, now, busy=len(self.queue) > 0)
                continue
            wake = self.queue.wake_at(now)
            self._wakeup.clear()
            try:
                timeout = None if wake is None else max(0.0, wake - now)
                await asyncio.wait_for(self._wakeup.wait(), timeout)
            except TimeoutError:
                pass

    async def _execute(self, batch: list[Pending], started: float, busy: bool = False) -> None:
        for pending in batch:
            self.engine.observer.queue_waited(self.route.tenant_name, self.route.model_name, started - pending.enqueued_at)
        await self._run_batch(batch, started, busy)

    async def _run_batch(self, batch: list[Pending], started: float, busy: bool = False) -> None:
        run = partial(self.engine.run_and_meter, self.route, busy=busy)
        outcomes = await asyncio.to_thread(run_isolating, run, batch, self.route.model_name)
        ran = [o.batch_exec_seconds for _, o in outcomes if not isinstance(o, BaseException)]
        if ran:
            self.queue.record_execution(max(ran))
        for pending, outcome in outcomes:
            if isinstance(outcome, BaseException):
                _fail(pending, outcome)
                continue
            outcome.queue_seconds = started - pending.enqueued_at
            if not pending.payload.future.done():
                pending.payload.future.set_result(outcome)


def _route_identity(route: Route) -> tuple[int, int, str, int]:
    return (route.version_id, route.tenant_id, route.model_name, route.version)


def _deleted_message(route: Route, when: str = "") -> str:
    return f"model {route.model_name!r} version {route.version} was deleted{' ' + when if when else ''}"


def _request_error(exc: Exception) -> LuminalError:
    """What a request that broke its own batch is told."""
    if isinstance(exc, MemoryError):
        return PayloadTooLarge(
            "this request needs more memory than the server can give it; send a smaller batch or sequence"
        )
    what = "an input value" if isinstance(exc, IndexError) else "an input's size"
    return InvalidInput(f"{what} is out of range for this model ({exc})")


def _fail(pending: Pending, exc: BaseException) -> None:
    if not pending.payload.future.done():
        pending.payload.future.set_exception(exc)
