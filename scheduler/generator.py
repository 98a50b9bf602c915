"""Token generation: one step loop per loaded generative model.

Each step the iteration scheduler (scheduler/continuous.py) says which sequences feed which
tokens; the runtime's decoder step (runtime/decoder.py) runs the compiled decoder on them (the
decodes as one batch, reading their past from the paged KV cache in place where the decode
program is paged; each prompt chunk on its own) and writes the new keys and values into the
cache; the loop samples, and hands each sequence's new text to its sink as it is made.
Sequences join and leave between steps; a cancelled one is freed at the next step. Each step's
device time is split over its sequences by the tokens each fed, and a finished sequence
reports what it used (tokens and billed seconds) once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from compiler.kv_layout import CacheLayout
from runtime.decoder import DecoderSteps, StepRow, StepRunner
from runtime.kv_cache import KVStorage
from runtime.sampling import Sampler, SamplingParams
from runtime.tokenizer import IncrementalText, TextCodec
from scheduler.continuous import Chunk, IterationScheduler, SequenceState, split_by_tokens

log = logging.getLogger(__name__)


class GenerationRefused(ValueError):
    """A request this model can never serve (too long for its context or its cache)."""


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class GenerationUsage:
    prompt_tokens: int
    completion_tokens: int
    billed_seconds: float  # this sequence's share of the device time of the steps it was in
    steps: int
    preemptions: int


@dataclass(frozen=True)
class TokenEvent:
    """What a sequence's sink receives: text as it is made (`token_id` the token that completed
    it), then one last event with `finish_reason` and `usage`."""

    text: str = ""
    token_id: int | None = None
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    usage: GenerationUsage | None = None
    error: str | None = None


def event_to_json(index: int, event: TokenEvent) -> dict:
    """An event as JSON for the wire (scheduler.wire.ReplyMessage.event); `index` orders a
    sequence's events, so a receiver drops those it had from a sequence generated again."""
    return {
        "index": index,
        "text": event.text,
        "token_id": event.token_id,
        "finish_reason": event.finish_reason,
        "usage": None if event.usage is None else asdict(event.usage),
        "error": event.error,
    }


def event_from_json(data: dict) -> tuple[int, TokenEvent]:
    usage = data.get("usage")
    return int(data["index"]), TokenEvent(
        text=str(data.get("text") or ""),
        token_id=data.get("token_id"),
        finish_reason=data.get("finish_reason"),
        usage=None if usage is None else GenerationUsage(**usage),
        error=data.get("error"),
    )


def request_to_json(request: GenerationRequest) -> dict:
    return {"prompt_ids": list(request.prompt_ids), "params": asdict(request.params)}


def request_from_json(request_id: str, data: dict) -> GenerationRequest:
    params = dict(data["params"])
    for name in ("stop", "stop_token_ids"):
        params[name] = tuple(params.get(name) or ())
    return GenerationRequest(request_id, [int(t) for t in data["prompt_ids"]], SamplingParams(**params))


@dataclass
class _Sequence:
    request: GenerationRequest
    sink: Callable[[TokenEvent], None]
    sampler: Sampler
    text: IncrementalText
    state: SequenceState
    generated: int = 0
    billed_seconds: float = 0.0
    steps: int = 0
    started_at: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class GeneratorLimits:
    num_blocks: int = 512
    block_size: int = 16
    max_step_tokens: int = 256
    max_running: int = 64
    prefill_chunk: int = 64
    context_length: int = 2048  # the model's positions: prompt plus generated tokens


class Generator:
    """One generative model's step loop (a thread). Thread-safe: `submit` and `cancel` may be
    called from any thread; sinks are called on the loop's thread and must not block."""

    def __init__(
        self,
        layout: CacheLayout,
        run_step: StepRunner,
        codec: TextCodec,
        input_dtypes: Mapping[str, str],
        limits: GeneratorLimits = GeneratorLimits(),
        name: str = "generator",
        paged_step: Callable | None = None,
        paged_for: Callable[[int, int], bool] = lambda rows, past: True,
        kv_storage: KVStorage | None = None,
        on_gathered: Callable[[float], None] | None = None,
    ) -> None:
        """`paged_step` runs the paged decode program, when there is one, for the one-token
        steps whose rows and past width `paged_for` accepts (runtime.decoder.DecoderSteps); `kv_storage`
        holds the cache's pools (host memory unless given: a GPU runtime's Runtime.kv_storage),
        freed by `close`; `on_gathered` is told how long each step's gather of the past took."""
        self.layout = layout
        self.codec = codec
        self.limits = limits
        self.decoder = DecoderSteps(
            layout,
            run_step,
            input_dtypes,
            limits.num_blocks,
            limits.block_size,
            paged_step,
            paged_for,
            kv_storage,
            on_gathered,
        )
        self.scheduler = IterationScheduler(
            self.decoder.allocator, limits.max_step_tokens, limits.max_running, limits.prefill_chunk
        )
        self.eos_ids = set(codec.eos_token_ids())
        self._sequences: dict[str, _Sequence] = {}
        self._inbox: list[_Sequence] = []
        self._cancelled: set[str] = set()
        self._wake = threading.Condition()
        self._closed = False
        self.steps_run = 0
        self._thread = threading.Thread(target=self._loop, name=f"{name}-steps", daemon=True)
        self._thread.start()

    # -- the callers' side --

    @property
    def free_blocks(self) -> int:
        return self.decoder.allocator.free_count

    def max_prompt_tokens(self, max_tokens: int) -> int:
        return min(self.limits.context_length, self.scheduler.capacity_tokens()) - max_tokens

    def check(self, prompt_tokens: int, params: SamplingParams) -> None:
        """GenerationRefused when a request can never run here, naming the limit."""
        if prompt_tokens < 1:
            raise GenerationRefused("the prompt is empty: it needs at least one token")
        total = prompt_tokens + params.max_tokens
        if total > self.limits.context_length:
            raise GenerationRefused(
                f"this model's context is {self.limits.context_length} tokens; the prompt has {prompt_tokens} "
                f"and max_tokens asks {params.max_tokens} more ({total})"
            )
        if total > self.scheduler.capacity_tokens():
            raise GenerationRefused(
                f"the prompt ({prompt_tokens} tokens) and max_tokens ({params.max_tokens}) exceed the KV cache "
                f"of this runtime ({self.scheduler.capacity_tokens()} tokens)"
            )

    def submit(self, request: GenerationRequest, sink: Callable[[TokenEvent], None]) -> None:
        self.check(len(request.prompt_ids), request.params)
        sequence = _Sequence(
            request,
            sink,
            Sampler(request.params),
            IncrementalText(self.codec, request.params.stop),
            SequenceState(request.request_id, list(request.prompt_ids)),
        )
        with self._wake:
            if self._closed:
                raise GenerationRefused("this model is being unloaded")
            self._inbox.append(sequence)
            self._wake.notify_all()

    def cancel(self, request_id: str) -> None:
        """Frees the sequence at the next step; its sink gets a last 'cancelled' event."""
        with self._wake:
            self._cancelled.add(request_id)
            self._wake.notify_all()

    def active(self) -> int:
        with self._wake:
            return len(self._sequences) + len(self._inbox)

    def close(self, timeout_s: float = 10.0) -> None:
        """Cancels every sequence, stops the loop and frees the cache's memory."""
        with self._wake:
            self._closed = True
            self._wake.notify_all()
        self._thread.join(timeout=timeout_s)
        if self._thread.is_alive():  # a step still runs on the pools: they must outlive it
            log.warning("the step loop of %s did not stop in %s s; its KV cache stays allocated", self._thread.name, timeout_s)
            return
        self.decoder.close()

    # -- the loop --

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._closed and not self._inbox and not self._cancelled and not self._sequences:
                    self._wake.wait()
                closed = self._closed
                arrivals, self._inbox = self._inbox, []
                cancelled, self._cancelled = self._cancelled, set()
            for sequence in arrivals:
                self._sequences[sequence.request.request_id] = sequence
                self.scheduler.add(sequence.state)
            for request_id in cancelled:
                self._finish(request_id, "cancelled")
            if closed:
                for request_id in list(self._sequences):
                    self._finish(request_id, "cancelled")
                return
            if self._sequences:
                try:
                    self._step()
                except Exception as exc:  # a failed step fails its sequences, not the loop
                    log.exception("a generation step failed")
                    for request_id in list(self._sequences):
                        self._finish(
                            request_id, "error", error=f"the decoder failed: {type(exc).__name__}: {exc}"
                        )

    def _step(self) -> None:
        plan = self.scheduler.plan()
        if not plan:
            if self.scheduler.waiting and not self.scheduler.running:
                # nothing runs and the head cannot start: it can never fit (check() prevents it)
                head = self.scheduler.waiting[0]
                self._finish(head.seq_id, "error", error="the sequence does not fit in the KV cache")
            return
        # each token's text goes to its sink as soon as its batch is sampled (the decodes' before
        # the step's prompt chunks run: a chunk of a long prompt would hold them back); what ends
        # a sequence is sent once the step's device time is known, its share in the usage
        seconds = 0.0
        ending: list[tuple[str, str]] = []
        if plan.decodes:
            rows, took = self._run(plan.decodes)
            seconds += took
            chosen = [
                (chunk.seq_id, self._choose(self._sequences[chunk.seq_id], row))
                for chunk, row in zip(plan.decodes, rows, strict=True)
            ]
            for seq_id, token in chosen:
                self._emit(self._sequences[seq_id], token, ending)
        for chunk in plan.prefills:
            rows, took = self._run([chunk])
            seconds += took
            if chunk.samples:
                sequence = self._sequences[chunk.seq_id]
                self._emit(sequence, self._choose(sequence, rows[0]), ending)
        self.scheduler.advance(plan)
        self.steps_run += 1
        shares = split_by_tokens(seconds, {c.seq_id: c.count for c in plan.chunks})
        for seq_id, share in shares.items():
            sequence = self._sequences[seq_id]
            sequence.billed_seconds += share
            sequence.steps += 1
        for seq_id, reason in ending:
            self._finish(seq_id, reason)

    def _choose(self, sequence: _Sequence, logits: np.ndarray) -> int:
        params = sequence.request.params
        if sequence.generated < params.min_tokens:
            ending = [t for t in (*self.eos_ids, *params.stop_token_ids) if 0 <= t < logits.size]
            logits = logits.copy()
            logits[ending] = -np.inf
        return sequence.sampler.choose(logits)

    def _run(self, chunks: Sequence[Chunk]) -> tuple[list[np.ndarray], float]:
        states = [self._sequences[c.seq_id].state for c in chunks]
        rows = [
            StepRow(s.tokens[c.start : c.start + c.count], c.start, s.blocks)
            for s, c in zip(states, chunks, strict=True)
        ]
        return self.decoder.run(rows)

    def _emit(self, sequence: _Sequence, token: int, ending: list[tuple[str, str]]) -> None:
        """Records the sampled token and sends its text; a sequence it ends goes on `ending`."""
        params = sequence.request.params
        sequence.generated += 1
        sequence.state.tokens.append(token)
        request_id = sequence.request.request_id
        if (token in self.eos_ids and not params.ignore_eos) or token in params.stop_token_ids:
            ending.append((request_id, "stop"))
            return
        piece = sequence.text.add(token)
        self._send(sequence, TokenEvent(piece, token))
        if sequence.text.stopped:
            ending.append((request_id, "stop"))
        elif sequence.generated >= params.max_tokens:
            ending.append((request_id, "length"))

    def _finish(self, request_id: str, reason: str, error: str | None = None) -> None:
        sequence = self._sequences.pop(request_id, None)
        if sequence is None:
            return
        self.scheduler.remove(request_id)
        rest = sequence.text.flush() if reason in ("length", "stop") else ""
        usage = GenerationUsage(
            prompt_tokens=len(sequence.request.prompt_ids),
            completion_tokens=sequence.generated,
            billed_seconds=sequence.billed_seconds,
            steps=sequence.steps,
            preemptions=sequence.state.preemptions,
        )
        self._send(sequence, TokenEvent(rest, None, reason, usage, error))

    def _send(self, sequence: _Sequence, event: TokenEvent) -> None:
        try:
            sequence.sink(event)
        except Exception:  # a broken sink is its caller's loss, never the loop's
            log.exception("a generation sink failed")
            with self._wake:
                self._cancelled.add(sequence.request.request_id)


__all__ = [
    "GenerationRefused",
    "GenerationRequest",
    "GenerationUsage",
    "Generator",
    "GeneratorLimits",
    "StepRunner",
    "TokenEvent",
    "event_from_json",
    "event_to_json",
    "request_from_json",
    "request_to_json",
]
