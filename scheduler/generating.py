"""Generative versions served by this process's runtimes: one step loop (scheduler.generator) per
loaded generative version, fed by the API's streams, metered per sequence when it ends.

A stream is an async iterator of TokenEvents; leaving it early (a client that disconnects)
cancels the sequence, which the loop frees at its next step. What a sequence used is written
to the ledger when it ends, however it ends, and never its queue time.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from cloud.errors import Overloaded, Unavailable
from cloud.usage import Usage
from compiler.kv_layout import CacheLayout
from runtime import Runtime
from runtime.kv_cache import blocks_that_fit
from runtime.tokenizer import TextCodec
from scheduler.generator import GenerationRequest, GenerationUsage, Generator, GeneratorLimits, TokenEvent
from scheduler.observer import SchedulerObserver
from scheduler.pricing import UsageSink, price_for

log = logging.getLogger(__name__)

# a stream's first event once its sequence is accepted, before any token: no text, no finish
ACCEPTED = TokenEvent()


@dataclass(frozen=True)
class GenerationSettings:
    kv_cache_bytes: int = 256 * 1024**2
    block_tokens: int = 16
    step_tokens: int = 512
    prefill_tokens: int = 256
    max_sequences: int = 64
    max_waiting: int = 256
    idle_unload_s: float = 600.0
    # a step's program waits at most this long for the tokens of the step before to be written
    # to their streams (the event loop's work), 0 for never (see _Deliveries)
    delivery_wait_s: float = 0.001
    # the step loop's thread, and the compiled program's threads it starts, run this much nicer
    # than the process (Linux thread niceness), so that the event loop writing the tokens gets a
    # core first; 0 for as the process. See _lower_priority.
    step_nice: int = 5


def generation_settings(settings) -> GenerationSettings:
    """From the one settings class (cloud.settings.Settings)."""
    return GenerationSettings(
        kv_cache_bytes=settings.generation_kv_cache_bytes,
        block_tokens=settings.generation_block_tokens,
        step_tokens=settings.generation_step_tokens,
        prefill_tokens=settings.generation_prefill_tokens,
        max_sequences=settings.generation_max_sequences,
        max_waiting=settings.generation_max_waiting,
        idle_unload_s=settings.idle_unload_s,
    )


class ProgramChooser:
    """Which of equivalent programs runs a one-token step, by measurement on the steps
    themselves: the decode program is searched at one batch size, and a product's best form for
    one sequence (a matrix-vector loop) is not its best for sixty-four; a program that reads the
    cache in place loses to one that takes its past gathered at a short past and wins at a long
    one. Per bucket of batch size and past length (powers of two, the past's from 64), each
    program runs TRIES steps in turn, then the one of least median time runs them all; the
    programs give the same tokens (each verified), so trying costs no answer. Programs in
    `one_row` take a single sequence and are tried for one-row steps only. One step loop uses
    it: a step picks (maybe more than once), runs, then records against its pick's bucket."""

    TRIES = 3
    SHORTEST_PAST = 64

    def __init__(self, programs: list[str], one_row: Collection[str] = ()) -> None:
        self.programs = programs
        self.one_row = frozenset(one_row)
        self._times: dict[tuple[int, int], dict[str, list[float]]] = {}
        self._chosen: dict[tuple[int, int], str] = {}
        self._picked = (1, self.SHORTEST_PAST)  # the bucket of the step being run
        self._lock = threading.Lock()

    @classmethod
    def bucket(cls, rows: int, past: int = 0) -> tuple[int, int]:
        return 1 << max(0, rows - 1).bit_length(), max(cls.SHORTEST_PAST, 1 << max(0, past - 1).bit_length())

    def _serving(self, bucket: tuple[int, int]) -> list[str]:
        return [p for p in self.programs if bucket[0] == 1 or p not in self.one_row]

    def pick(self, rows: int, past: int = 0) -> str:
        bucket = self.bucket(rows, past)
        serving = self._serving(bucket)
        with self._lock:
            self._picked = bucket
            chosen = self._chosen.get(bucket)
            if chosen is not None or len(serving) == 1:
                return chosen or serving[0]
            times = self._times.setdefault(bucket, {p: [] for p in serving})
            return min(serving, key=lambda p: len(times[p]))

    def record(self, program: str, seconds: float) -> None:
        """The step just run (on `program`, as picked) took `seconds`."""
        with self._lock:
            bucket = self._picked
            serving = self._serving(bucket)
            if bucket in self._chosen or len(serving) == 1 or program not in serving:
                return
            times = self._times.setdefault(bucket, {p: [] for p in serving})
            times[program].append(seconds)
            if all(len(t) >= self.TRIES for t in times.values()):
                self._chosen[bucket] = min(serving, key=lambda p: sorted(times[p])[len(times[p]) // 2])

    def chosen(self) -> dict[tuple[int, int], str]:
        """The program chosen by (batch-size bucket, past-length bucket)."""
        with self._lock:
            return dict(self._chosen)


class _Deliveries:
    """Tokens handed to the event loop and not yet written to their streams. A step's program
    runs on every core (the compiled program's threads) and holds them for milliseconds, while
    the event loop that writes the tokens of the step before (and, on one machine, the client
    that reads them) waits for a core and for the interpreter lock the step loop's Python holds:
    so the next program run waits for those writes, up to `limit_s`. The step's own preparation
    (plan, cache gather) still overlaps them; only its program waits."""

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self.pending = 0
        self._written = threading.Condition(threading.Lock())

    def open(self) -> list[int]:
        """A stream's count of tokens handed and not written; [-1] once it is closed."""
        return [0]

    def handed(self, stream: list[int]) -> None:
        with self._written:
            if stream[0] >= 0:
                stream[0] += 1
                self.pending += 1

    def written(self, stream: list[int]) -> None:
        with self._written:
            if stream[0] > 0:
                stream[0] -= 1
                self.pending -= 1
                if not self.pending:
                    self._written.notify_all()

    def close(self, stream: list[int]) -> None:
        """The stream is read no more (it ended, or its client left): no step waits for it."""
        with self._written:
            if stream[0] > 0:
                self.pending -= stream[0]
                if not self.pending:
                    self._written.notify_all()
            stream[0] = -1

    def wait(self) -> None:
        if self.pending and self.limit_s > 0:
            with self._written:
                self._written.wait_for(lambda: not self.pending, timeout=self.limit_s)


def _lower_priority(nice: int) -> None:
    """This thread runs `nice` steps nicer (Linux: a thread's niceness is its own, and threads
    it starts inherit it, as the compiled program's workers started by its first run do). The
    program's threads take every core for each step; the event loop that writes the step's tokens
    to their streams (and on one machine the client reading them) then waited for a core: a
    streamed token's p99 from sampled to the client was 6.5 ms against 2.1 with the step's
    threads at nice 5 (one stream, 2 cores, load ~3). Raising one's own niceness needs no
    privilege; where it fails the thread runs as before."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError:
        log.debug("could not lower the step loop's priority", exc_info=True)


@dataclass
class _Served:
    generator: Generator
    route: object  # scheduler.engine.Route
    last_used: float
    deliveries: _Deliveries


def generation_usage(route, request_id: str, usage: GenerationUsage, price: float) -> Usage:
    """A finished sequence's usage record: its rows are its tokens, its batch the steps it ran
    in, its billed seconds its shares of those steps' device time."""
    tokens = usage.prompt_tokens + usage.completion_tokens
    return Usage(
        request_id=request_id,
        tenant_id=route.tenant_id,
        model_name=route.model_name,
        version=route.version,
        target=route.target,
        rows=tokens,
        batch_size=usage.steps,
        batch_rows=tokens,
        batch_exec_seconds=usage.billed_seconds,
        billed_seconds=usage.billed_seconds,
        price_per_second=price,
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
    )


class GenerationService:
    """Thread-safe; `stream` runs on the event loop."""

    def __init__(
        self,
        runtimes: Mapping[str, Runtime],
        load_codec: Callable[[dict], TextCodec],
        ledger: UsageSink | None,
        prices: Mapping[str, float],
        settings: GenerationSettings,
        observer: SchedulerObserver,
    ) -> None:
        self.runtimes = runtimes
        self.load_codec = load_codec
        self.ledger = ledger
        self.prices = prices
        self.settings = settings
        self.observer = observer
        self._served: dict[int, _Served] = {}
        self._lock = threading.Lock()
        # usage records are written off the step loop and off the event loop, in order
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="generation-ledger")

    def generator(self, route) -> Generator:
        """The version's step loop, started on first use (loading its program and its cache)."""
        with self._lock:
            served = self._served.get(route.version_id)
            if served is not None:
                served.last_used = time.monotonic()
                return served.generator
        runtime = self.runtimes.get(route.target)
        if runtime is None:
            raise Unavailable(f"no runtime serves device type {route.target!r}")
        bundle = route.bundle or {}
        layout = CacheLayout.from_json(bundle["layout"])
        signature = runtime.signature(route.artifact_key)
        key = route.artifact_key
        # the decode programs (one token per sequence) the compile made: one takes its past
        # gathered, as the general program does; a paged one reads the KV cache in place; one
        # serves a single sequence. One-token steps run whichever measures fastest
        decode_key = bundle.get("decode_artifact_key")
        paged_key = bundle.get("decode_paged_key")
        one_key = bundle.get("decode_one_key")
        chooser = ProgramChooser(
            [k for k in (paged_key, one_key, decode_key) if k] + [key], one_row=[one_key] if one_key else []
        )
        deliveries = _Deliveries(self.settings.delivery_wait_s)
        niced: list[bool] = []

        def before_run() -> None:
            if not niced:  # the step loop's thread, before its program's first run starts workers
                _lower_priority(self.settings.step_nice)
                niced.append(True)
            deliveries.wait()

        def run_program(program: str, inputs, rows: int):
            before_run()
            return runtime.run_batch(program, [inputs], [rows])

        gathered = [0.0]  # the step's gather of its past, which the paged program does without

        def run_step(inputs):
            rows, tokens = (int(n) for n in inputs["input_ids"].shape)
            # (a one-token step comes here when the chooser's pick is not the paged program)
            past = int(inputs[layout.past_keys[0]].shape[2]) if layout.past_keys else 0
            program = chooser.pick(rows, past) if tokens == 1 else key
            result = run_program(program, inputs, rows)
            if tokens == 1:
                chooser.record(program, result.exec_seconds + gathered[0])
            return result.outputs[0], result.exec_seconds

        def paged_step(inputs):
            rows = int(inputs["input_ids"].shape[0])
            result = run_program(paged_key, inputs, rows)
            chooser.record(paged_key, result.exec_seconds)
            return result.outputs[0], result.exec_seconds

        def paged_step_on_device(run):
            # the pools lie in the GPU's memory: the step runs there (DeviceKVStorage.run_paged)
            before_run()
            outputs, seconds = runtime.run_on_device(paged_key, run)
            chooser.record(paged_key, seconds)
            return outputs, seconds

        block_tokens = self.settings.block_tokens
        limits = GeneratorLimits(
            num_blocks=blocks_that_fit(layout, block_tokens, self.settings.kv_cache_bytes),
            block_size=block_tokens,
            max_step_tokens=self.settings.step_tokens,
            max_running=self.settings.max_sequences,
            prefill_chunk=min(self.settings.prefill_tokens, self.settings.step_tokens),
            context_length=int(bundle.get("context_length") or 2048),
        )
        # the cache in the device's memory: a GPU's pools never travel through the host
        storage = runtime.kv_storage(layout, limits.num_blocks * limits.block_size)
        on_device = storage.runs_on_device
        try:
            generator = Generator(
                layout,
                run_step,
                self.load_codec(bundle),
                {spec.name: spec.dtype for spec in signature.inputs},
                limits,
                name=f"{route.model_name}-v{route.version}",
                paged_step=(paged_step_on_device if on_device else paged_step) if paged_key else None,
                paged_for=lambda rows, past: chooser.pick(rows, past) == paged_key,
                kv_storage=storage,
                on_gathered=lambda seconds: gathered.__setitem__(0, seconds),
            )
        except BaseException:
            storage.close()
            raise
        with self._lock:
            served = self._served.get(route.version_id)
            if served is not None:  # another request started it meanwhile
                generator.close()
                return served.generator
            self._served[route.version_id] = _Served(generator, route, time.monotonic(), deliveries)
        return generator

    def _deliveries(self, version_id: int) -> _Deliveries | None:
        with self._lock:
            served = self._served.get(version_id)
        return None if served is None else served.deliveries

    def start(self, route, request: GenerationRequest, sink: Callable[[TokenEvent], None]) -> None:
        """Starts the sequence; `sink` gets its events on the step loop's thread (it must not
        block). With a ledger, its usage is recorded when it ends, however it ends."""
        generator = self.generator(route)
        waiting = generator.active() - self.settings.max_sequences
        if waiting >= self.settings.max_waiting:
            raise Overloaded(
                f"model {route.model_name!r} has {waiting} generations waiting for its KV cache, its limit",
                retry_after=1,
            )
        price = price_for(route.target, self.prices)

        def metered(event: TokenEvent) -> None:
            if event.usage is not None and self.ledger is not None:
                self._writer.submit(self._meter, route, request.request_id, event, price)
            sink(event)

        generator.submit(request, metered)

    def cancel(self, version_id: int, request_id: str) -> None:
        with self._lock:
            served = self._served.get(version_id)
        if served is not None:
            served.generator.cancel(request_id)

    def active(self) -> int:
        """Sequences running or waiting, over every generative version."""
        with self._lock:
            served = list(self._served.values())
        return sum(item.generator.active() for item in served)

    async def stream(self, route, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        """The sequence's events as they come; closing the iterator early cancels it."""
        from starlette.concurrency import run_in_threadpool

        loop = asyncio.get_running_loop()
        events: asyncio.Queue[TokenEvent] = asyncio.Queue()
        # each token's event counts as handed to this loop until the stream's reader asks for the
        # next one (it has then written it): the step loop's next program waits for that
        deliveries: list[_Deliveries] = []
        counted = [-1]  # this stream's count (closed until the version's deliveries are found)

        def sink(event: TokenEvent) -> None:
            if deliveries and event.finish_reason is None:
                deliveries[0].handed(counted)
            loop.call_soon_threadsafe(events.put_nowait, event)

        def start() -> None:
            self.generator(route)  # loaded (or found) first, so that its deliveries exist
            found = self._deliveries(route.version_id)
            if found is not None:
                counted[0] = 0
                deliveries.append(found)
            self.start(route, request, sink)

        await run_in_threadpool(start)
        finished = False
        try:
            # the sequence is accepted (its refusals were raised above): a route may start its
            # response now, so that its first token travels like the others, not behind headers
            yield ACCEPTED
            while True:
                event = await events.get()
                yield event
                if event.finish_reason is not None:
                    finished = True
                    return
                if deliveries:
                    deliveries[0].written(counted)
        finally:
            if deliveries:
                deliveries[0].close(counted)
            if not finished:
                self.cancel(route.version_id, request.request_id)

    def _meter(self, route, request_id: str, event: TokenEvent, price: float) -> None:
        assert event.usage is not None
        try:
            self.ledger.record([generation_usage(route, request_id, event.usage, price)])
        except Exception:  # the ledger's outage must not stop generation; operators see it logged
            log.exception("could not record the usage of generation %s", request_id)
        self.observer.generation_finished(
            route.tenant_name,
            route.model_name,
            route.target,
            event.usage.prompt_tokens,
            event.usage.completion_tokens,
            event.usage.billed_seconds,
        )

    def free_blocks(self, version_id: int) -> int | None:
        with self._lock:
            served = self._served.get(version_id)
        return None if served is None else served.generator.free_blocks

    def forget(self, version_id: int):
        """The version was deleted: its sequences end ('cancelled') and its cache is freed.
        Returns the route it was served for, if it was."""
        with self._lock:
            served = self._served.pop(version_id, None)
        if served is None:
            return None
        served.generator.close()
        return served.route

    def unload_idle(self, now: float | None = None) -> None:
        """A generative version with no sequence for idle_unload_s gives its cache back."""
        now = time.monotonic() if now is None else now
        with self._lock:
            idle = [
                version_id
                for version_id, served in self._served.items()
                if served.generator.active() == 0 and now - served.last_used >= self.settings.idle_unload_s
            ]
        for version_id in idle:
            self.forget(version_id)

    def close(self) -> None:
        with self._lock:
            served, self._served = list(self._served.values()), {}
        for item in served:
            item.generator.close()
        self._writer.shutdown(wait=True)


__all__ = [
    "ACCEPTED",
    "GenerationService",
    "GenerationSettings",
    "ProgramChooser",
    "generation_settings",
    "generation_usage",
]
