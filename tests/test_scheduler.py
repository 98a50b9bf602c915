"""The batching policy as a pure core: plain objects and a fake clock."""

from __future__ import annotations

import pytest

from scheduler.policy import BatchPolicy, BatchQueue, Pending, QueueFull


def req(i: int, rows: int = 1, at: float = 0.0, deadline: float = 100.0) -> Pending:
    return Pending(f"r{i}", rows, at, deadline)


def queue(max_rows=8, delay=0.01, max_requests=4, batchable=True) -> BatchQueue:
    return BatchQueue(BatchPolicy(max_rows, delay, max_requests, batchable))


def test_partial_batch_waits_for_the_delay() -> None:
    q = queue()
    q.submit(req(1, at=0.0), now=0.0)
    q.submit(req(2, at=0.004), now=0.004)
    assert q.take_batch(now=0.005) is None
    assert q.wake_at(now=0.005) == pytest.approx(0.01)
    batch = q.take_batch(now=0.01)
    assert [p.request_id for p in batch] == ["r1", "r2"]
    assert len(q) == 0 and q.wake_at(0.02) is None


def test_full_batch_runs_at_once_and_never_splits_a_request() -> None:
    q = queue(max_rows=4)
    for i, rows in enumerate([2, 1, 3]):
        q.submit(req(i, rows), now=0.0)
    batch = q.take_batch(now=0.0)  # 6 rows queued >= 4: due now
    assert [p.rows for p in batch] == [2, 1]  # the 3-row request does not fit: next batch
    assert q.take_batch(now=0.0) is None
    assert [p.rows for p in q.take_batch(now=1.0)] == [3]


def test_requests_of_different_sequence_lengths_never_share_a_batch() -> None:
    q = queue(max_rows=8)
    for i, key in enumerate([(7,), (7,), (9,), (7,)]):
        q.submit(Pending(f"r{i}", 1, 0.0, 100.0, shape_key=key), now=0.0)
    assert [p.request_id for p in q.take_batch(now=1.0)] == ["r0", "r1"]
    assert [p.request_id for p in q.take_batch(now=1.0)] == ["r2"]
    assert [p.request_id for p in q.take_batch(now=1.0)] == ["r3"]


def test_oversized_request_runs_alone() -> None:
    q = queue(max_rows=4)
    q.submit(req(1, rows=10), now=0.0)
    assert [p.rows for p in q.take_batch(now=0.0)] == [10]


def test_bounded_queue_rejects_when_full() -> None:
    q = queue(max_requests=2)
    q.submit(req(1), 0.0)
    q.submit(req(2), 0.0)
    with pytest.raises(QueueFull):
        q.submit(req(3), 0.0)


def test_expired_requests_leave_the_queue() -> None:
    q = queue(delay=10.0)
    q.submit(req(1, deadline=0.5), 0.0)
    q.submit(req(2, deadline=5.0), 0.0)
    assert q.wake_at(0.0) == 0.5
    assert [p.request_id for p in q.expired(now=0.6)] == ["r1"]
    assert [p.request_id for p in q.take_batch(now=10.0)] == ["r2"]


def test_unbatchable_model_runs_one_request_per_batch() -> None:
    q = queue(batchable=False)
    q.submit(req(1), 0.0)
    q.submit(req(2), 0.0)
    assert [p.request_id for p in q.take_batch(0.0)] == ["r1"]
    assert [p.request_id for p in q.take_batch(0.0)] == ["r2"]
