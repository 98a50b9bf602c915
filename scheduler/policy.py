"""The dynamic batching policy: a pure core with no I/O and no clock of its own.

Contract (the caller is the batcher):
  - `submit(request, now)` when a request arrives; raises QueueFull when the queue is full.
  - `expired(now)` to take out requests whose deadline passed while queued.
  - `take_batch(now)` returns the next batch when one is due, else None. A batch is due when
    the queued rows fill a batch, or the oldest request has waited its delay: `max_delay_s`, or
    with `adaptive`, only as long as company is likely to come (see `delay_s`).
  - `record_execution(seconds)` after each batch ran, so the adaptive delay knows its cost.
  - `wake_at(now)` says when a batch or an expiry will next be due, so the caller can sleep.
Requests are taken in arrival order; a request is never split across batches, and a batch only
holds requests with equal `shape_key` (their sizes apart from the batch axis, e.g. a sequence
length), since only those can be concatenated.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any


class QueueFull(Exception):
    """The queue holds max_queue_requests already."""


@dataclass(frozen=True)
class BatchPolicy:
    # most rows in one batch; with batchable=False every batch is one request
    max_batch_rows: int
    # longest the oldest request waits for company before a partial batch runs
    max_delay_s: float
    # most requests waiting; one more is refused
    max_queue_requests: int
    # whether requests may be concatenated (the model has a symbolic batch dimension)
    batchable: bool = True
    # wait for company only while requests arrive faster than a batch runs, and then no longer
    # than a batch takes: a lone request on an idle device runs at once
    adaptive: bool = True


# weight of the newest sample in the running averages of arrival gaps and batch times
SMOOTHING = 0.2


@dataclass
class Pending:
    # unique id, also the usage record's id
    request_id: str
    # rows along the batch dimension (1 for a model without one)
    rows: int
    # when it was queued and when it must have started, in the caller's clock
    enqueued_at: float
    deadline: float
    # whatever the adapter carries along (inputs, future); the policy never looks inside
    payload: Any = field(default=None, repr=False)
    # requests join one batch only when these agree (the non-batch dims of their inputs)
    shape_key: tuple = ()


class BatchQueue:
    def __init__(self, policy: BatchPolicy) -> None:
        self.policy = policy
        self._queue: deque[Pending] = deque()
        self._rows = 0
        # running averages: seconds between arrivals, and seconds a batch runs (None: no sample)
        self._arrival_gap: float | None = None
        self._last_arrival: float | None = None
        self._batch_seconds: float | None = None

    def delay_s(self) -> float:
        """How long the oldest request waits for company before a partial batch runs."""
        if not self.policy.adaptive:
            return self.policy.max_delay_s
        if self._arrival_gap is None or self._batch_seconds is None or self._arrival_gap >= self._batch_seconds:
            return 0.0  # nobody is likely to come before the batch would have finished anyway
        return min(self.policy.max_delay_s, self._batch_seconds)

    def record_execution(self, seconds: float) -> None:
        self._batch_seconds = _smooth(self._batch_seconds, seconds)

    @property
    def batch_seconds(self) -> float | None:
        """How long a batch has been running lately (None before the first)."""
        return self._batch_seconds

    def __len__(self) -> int:
        return len(self._queue)

    def submit(self, request: Pending, now: float) -> None:
        if len(self._queue) >= self.policy.max_queue_requests:
            raise QueueFull(f"{len(self._queue)} requests already queued")
        self._queue.append(request)
        self._rows += request.rows
        if self._last_arrival is not None:
            self._arrival_gap = _smooth(self._arrival_gap, max(0.0, now - self._last_arrival))
        self._last_arrival = now

    def expired(self, now: float) -> list[Pending]:
        gone = [r for r in self._queue if r.deadline <= now]
        if gone:
            self._queue = deque(r for r in self._queue if r.deadline > now)
            self._rows -= sum(r.rows for r in gone)
        return gone

    def _due(self, now: float) -> bool:
        if not self._queue:
            return False
        if not self.policy.batchable or self._rows >= self.policy.max_batch_rows:
            return True
        return now - self._queue[0].enqueued_at >= self.delay_s()

    def take_batch(self, now: float) -> list[Pending] | None:
        if not self._due(now):
            return None
        batch = [self._queue.popleft()]
        if self.policy.batchable:
            rows = batch[0].rows
            while (
                self._queue
                and self._queue[0].shape_key == batch[0].shape_key
                and rows + self._queue[0].rows <= self.policy.max_batch_rows
            ):
                rows += self._queue[0].rows
                batch.append(self._queue.popleft())
        self._rows -= sum(r.rows for r in batch)
        return batch

    def wake_at(self, now: float) -> float | None:
        if not self._queue:
            return None
        if self._due(now):
            return now
        batch_due = self._queue[0].enqueued_at + self.delay_s()
        return min(batch_due, min(r.deadline for r in self._queue))


def _smooth(average: float | None, sample: float) -> float:
    return sample if average is None else (1 - SMOOTHING) * average + SMOOTHING * sample
