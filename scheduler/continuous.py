"""Iteration-level scheduling of generation ("continuous batching", as Orca and vLLM do it): the
plan of one step of a generative model. Pure policy over block counts; the runtime runs it.

Each step every running sequence that has sampled its last token feeds that token (a decode);
sequences still reading their prompt feed a chunk of it (a prefill), bounded by the step's
token budget, so a long prompt never stalls the streams already decoding. A waiting sequence
joins as soon as the blocks for its next chunk are free; a finished one leaves at once, its
blocks back in the pool. When a decode needs a block and none is free, the youngest running
sequence is preempted: its blocks are freed and it waits again, to recompute its tokens.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol


class Blocks(Protocol):
    """The block pool as the policy sees it (runtime.kv_cache.BlockAllocator)."""

    num_blocks: int
    block_size: int

    @property
    def free_count(self) -> int: ...
    def blocks_for(self, tokens: int) -> int: ...
    def allocate(self, count: int) -> list[int]: ...
    def free(self, blocks: list[int]) -> None: ...


@dataclass
class SequenceState:
    """A sequence as the scheduler tracks it: every token it holds (prompt, then what was
    sampled), how many of them have their keys and values in the cache, and its blocks."""

    seq_id: str
    tokens: list[int]
    arrival: int = 0
    cached: int = 0
    blocks: list[int] = field(default_factory=list)
    preemptions: int = 0

    @property
    def pending(self) -> int:
        """Tokens not yet in the cache: the whole prompt at first, then the one just sampled."""
        return len(self.tokens) - self.cached


@dataclass(frozen=True)
class Chunk:
    """One sequence's share of a step: its tokens[start : start + count] are fed with the first
    `start` tokens as the past; `samples` when they reach its last token (then the step's
    logits at the chunk's end choose the next one)."""

    seq_id: str
    start: int
    count: int
    samples: bool


@dataclass
class StepPlan:
    decodes: list[Chunk] = field(default_factory=list)  # one token each, run as one batch
    prefills: list[Chunk] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)

    @property
    def chunks(self) -> Iterator[Chunk]:
        yield from self.decodes
        yield from self.prefills

    @property
    def tokens(self) -> int:
        return sum(c.count for c in self.chunks)

    def __bool__(self) -> bool:
        return bool(self.decodes or self.prefills)


class IterationScheduler:
    """Not thread-safe: the runtime's step loop owns it (others go through the loop's inbox)."""

    def __init__(
        self, blocks: Blocks, max_step_tokens: int = 256, max_running: int = 64, prefill_chunk: int = 64
    ) -> None:
        if max_step_tokens < 1 or max_running < 1 or prefill_chunk < 1:
            raise ValueError("the step's token budget, running sequences and prefill chunk must be positive")
        self.blocks = blocks
        self.max_step_tokens = max_step_tokens
        self.max_running = max_running
        self.prefill_chunk = prefill_chunk
        self.waiting: deque[SequenceState] = deque()
        self.running: list[SequenceState] = []  # by arrival, oldest first
        self._arrivals = 0

    def capacity_tokens(self) -> int:
        """The most tokens one sequence may ever hold: the whole pool."""
        return self.blocks.num_blocks * self.blocks.block_size

    def add(self, seq: SequenceState) -> None:
        if len(seq.tokens) < 1:
            raise ValueError("a sequence needs at least one token")
        seq.arrival = self._arrivals
        self._arrivals += 1
        self.waiting.append(seq)

    def remove(self, seq_id: str) -> SequenceState | None:
        """Takes a sequence out (finished, cancelled or failed) and frees its blocks."""
        for seq in self.running:
            if seq.seq_id == seq_id:
                self.running.remove(seq)
                self._release(seq)
                return seq
        for seq in self.waiting:
            if seq.seq_id == seq_id:
                self.waiting.remove(seq)
                self._release(seq)
                return seq
        return None

    def __len__(self) -> int:
        return len(self.running) + len(self.waiting)

    def _release(self, seq: SequenceState) -> None:
        if seq.blocks:
            self.blocks.free(seq.blocks)
        seq.blocks = []
        seq.cached = 0

    def _grow(self, seq: SequenceState, tokens: int) -> bool:
        """Gives `seq` the blocks to hold `tokens` tokens, if the pool has them."""
        need = self.blocks.blocks_for(tokens) - len(seq.blocks)
        if need <= 0:
            return True
        if need > self.blocks.free_count:
            return False
        seq.blocks.extend(self.blocks.allocate(need))
        return True

    def _preempt_youngest(self, plan: StepPlan) -> SequenceState:
        victim = self.running.pop()  # the latest arrival
        self._release(victim)
        victim.preemptions += 1
        self.waiting.appendleft(victim)  # first to come back
        plan.preempted.append(victim.seq_id)
        return victim

    def plan(self) -> StepPlan:
        """The next step, with its blocks allocated. `advance` records that it ran."""
        plan = StepPlan()
        budget = self.max_step_tokens
        # decodes first, oldest first: a running stream is never starved by newcomers
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            if seq.pending != 1:
                index += 1
                continue
            while not self._grow(seq, seq.cached + 1):
                if self._preempt_youngest(plan) is seq:
                    break
            else:
                plan.decodes.append(Chunk(seq.seq_id, seq.cached, 1, samples=True))
                budget -= 1
                index += 1
                continue
            break  # seq itself was the youngest and is waiting again
        # prompts being read, then newcomers in arrival order, while the budget and pool allow
        for seq in [s for s in self.running if s.pending > 1]:
            if budget <= 0:
                break
            budget -= self._prefill(plan, seq, budget)
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            seq = self.waiting[0]
            taken = self._prefill(plan, seq, budget)
            if taken == 0:
                break  # its chunk's blocks are not free: it waits for a sequence to finish
            self.waiting.popleft()
            self.running.append(seq)
            budget -= taken
        return plan

    def _prefill(self, plan: StepPlan, seq: SequenceState, budget: int) -> int:
        count = min(seq.pending, self.prefill_chunk, budget)
        if count <= 0 or not self._grow(seq, seq.cached + count):
            return 0
        plan.prefills.append(
            Chunk(seq.seq_id, seq.cached, count, samples=seq.cached + count == len(seq.tokens))
        )
        return count

    def advance(self, plan: StepPlan) -> None:
        """The step ran: its chunks' tokens are in the cache."""
        states = {s.seq_id: s for s in self.running}
        for chunk in plan.chunks:
            seq = states.get(chunk.seq_id)
            if seq is not None and seq.cached == chunk.start:
                seq.cached += chunk.count

    def get(self, seq_id: str) -> SequenceState | None:
        for seq in (*self.running, *self.waiting):
            if seq.seq_id == seq_id:
                return seq
        return None


def split_by_tokens(seconds: float, tokens: dict[str, int]) -> dict[str, float]:
    """Each sequence's share of a step's device time, by the tokens it fed in that step."""
    total = sum(tokens.values())
    if total <= 0:
        return {key: 0.0 for key in tokens}
    return {key: seconds * count / total for key, count in tokens.items()}


__all__ = ["Chunk", "IterationScheduler", "SequenceState", "StepPlan", "split_by_tokens"]
