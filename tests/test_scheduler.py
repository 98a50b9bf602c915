"""The batching policy as a pure core: plain objects and a fake clock."""

from __future__ import annotations

import pytest

from scheduler.policy import BatchPolicy, BatchQueue, Pending, QueueFull


def req(i: int, rows: int = 1, at: float = 0.0, deadline: float = 100.0) -> Pending:
    return Pending(f"r{i}", rows, at, deadline)


def queue(max_rows=8, delay=0.01, max_requests=4, batchable=True) -> BatchQueue:
    return BatchQueue(BatchPolicy(max_rows, delay, max_requests, batchable, adaptive=False))


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


def adaptive(max_rows=8, delay=0.005) -> BatchQueue:
    return BatchQueue(BatchPolicy(max_rows, delay, max_queue_requests=100))


def test_adaptive_a_lone_request_on_an_idle_device_runs_at_once() -> None:
    q = adaptive()
    q.submit(req(1, at=0.0), now=0.0)
    assert [p.request_id for p in q.take_batch(now=0.0)] == ["r1"]  # no history: nobody to wait for
    q.record_execution(0.002)
    # a sequential client: the next request comes after the answer, later than a batch takes
    q.submit(req(2, at=0.010), now=0.010)
    assert q.delay_s() == 0.0
    assert [p.request_id for p in q.take_batch(now=0.010)] == ["r2"]


def test_adaptive_waits_while_requests_come_faster_than_a_batch_runs_and_no_longer() -> None:
    q = adaptive(delay=0.005)
    for i in range(6):  # one every 0.5 ms
        q.submit(req(i, at=i * 0.0005), now=i * 0.0005)
        q.take_batch(now=i * 0.0005)
    q.record_execution(0.002)  # a batch takes 2 ms: four more would come meanwhile
    q.submit(req(10, at=0.010), now=0.010)
    assert q.delay_s() == pytest.approx(0.002)  # its batch time, below max_delay_s
    assert q.take_batch(now=0.011) is None
    q.submit(req(11, at=0.0115), now=0.0115)
    assert q.wake_at(now=0.0115) == pytest.approx(0.012)
    assert [p.request_id for p in q.take_batch(now=0.012)] == ["r10", "r11"]
    q.record_execution(0.050)  # slower than max_delay_s: the cap holds
    q.submit(req(12, at=0.0120), now=0.0120)
    assert q.delay_s() == pytest.approx(0.005)


def test_a_model_that_does_not_fit_its_device_fails_each_request_with_503_and_a_large_one_alone_with_413() -> None:
    from cloud.errors import PayloadTooLarge, Unavailable
    from runtime.runtime import DoesNotFit
    from scheduler.engine import run_isolating

    batch = [Pending(f"r{i}", rows, 0.0, 10.0) for i, rows in enumerate((1, 64, 1))]

    def too_large_for_the_device(pending: list[Pending]) -> list[str]:
        raise DoesNotFit("model 'big' does not fit in this device's free memory: 1 of 80 GB free")

    outcomes = run_isolating(too_large_for_the_device, batch, "big")
    assert [type(error) for _, error in outcomes] == [Unavailable] * 3
    assert all(error.status == 503 and "does not fit" in error.message for _, error in outcomes)

    def device_memory_for_32_rows(pending: list[Pending]) -> list[str]:
        if sum(p.rows for p in pending) > 32:
            raise MemoryError("the GPU has 1 of its 80 bytes free")
        return [p.request_id for p in pending]

    outcomes = run_isolating(device_memory_for_32_rows, batch, "m")
    assert [o if isinstance(o, str) else type(o) for _, o in outcomes] == ["r0", PayloadTooLarge, "r2"]
