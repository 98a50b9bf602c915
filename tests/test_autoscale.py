"""The autoscaling rule (scheduler/autoscale.py) alone, with plain values for the lag, the
runtimes and the clock: KEDA's rule, desired = ceil(lag / target) within [min, max], and scale-in
of idle runtimes only, one at a time, to zero after the idle time."""

from __future__ import annotations

import pytest

from scheduler.autoscale import RuntimeState, ScalePolicy, Scaling, desired_runtimes, scale

POLICY = ScalePolicy(min_runtimes=0, max_runtimes=3, target_lag=4, idle_s=30.0)


def busy(name: str, held: int = 1, last_active: float = 100.0) -> RuntimeState:
    return RuntimeState(name, announced=True, held=held, last_active=last_active)


def idle_since(name: str, when: float) -> RuntimeState:
    return RuntimeState(name, announced=True, held=0, last_active=when)


def test_desired_is_the_lag_over_the_target_rounded_up_within_min_and_max() -> None:
    assert [desired_runtimes(lag, POLICY) for lag in (0, 1, 4, 5, 8, 9, 12, 13, 1000)] == [0, 1, 1, 2, 2, 3, 3, 3, 3]
    floor = ScalePolicy(min_runtimes=1, max_runtimes=2, target_lag=4, idle_s=30.0)
    assert [desired_runtimes(lag, floor) for lag in (0, 3, 5, 9)] == [1, 1, 2, 2]
    assert desired_runtimes(-3, POLICY) == 0  # an unknown lag read as negative is none


def test_a_request_waiting_at_zero_starts_one_runtime() -> None:
    assert scale(1, [], POLICY, now=0.0) == Scaling(start=1)


def test_a_backlog_starts_as_many_as_it_calls_for_up_to_max_counting_those_starting() -> None:
    assert scale(9, [], POLICY, now=0.0) == Scaling(start=3)
    assert scale(100, [], POLICY, now=0.0) == Scaling(start=3)
    starting = RuntimeState("runtime-1", announced=False, held=0, last_active=0.0)
    assert scale(100, [starting], POLICY, now=0.0) == Scaling(start=2)
    assert scale(100, [starting, busy("runtime-2"), busy("runtime-3")], POLICY, now=0.0) == Scaling()


def test_nothing_waiting_and_no_runtime_is_nothing_to_do() -> None:
    assert scale(0, [], POLICY, now=0.0) == Scaling()


def test_a_runtime_idle_for_the_idle_time_stops_and_the_pool_goes_to_zero() -> None:
    runtime = idle_since("runtime-1", 100.0)
    assert scale(0, [runtime], POLICY, now=129.9) == Scaling()
    assert scale(0, [runtime], POLICY, now=130.0) == Scaling(stop=("runtime-1",))


def test_a_busy_or_starting_runtime_is_never_stopped_however_long_ago_it_last_answered() -> None:
    assert scale(0, [busy("runtime-1", held=2, last_active=0.0)], POLICY, now=1000.0) == Scaling()
    starting = RuntimeState("runtime-1", announced=False, held=0, last_active=0.0)
    assert scale(0, [starting], POLICY, now=1000.0) == Scaling()


def test_scale_in_stops_the_longest_idle_one_at_a_time_and_keeps_the_minimum() -> None:
    runtimes = [idle_since("runtime-1", 50.0), idle_since("runtime-2", 10.0), busy("runtime-3")]
    assert scale(0, runtimes, POLICY, now=200.0) == Scaling(stop=("runtime-2",))
    floor = ScalePolicy(min_runtimes=1, max_runtimes=3, target_lag=4, idle_s=30.0)
    assert scale(0, [idle_since("runtime-1", 0.0)], floor, now=1000.0) == Scaling()
    # waiting requests keep as many as they call for, idle or not
    two = [idle_since("runtime-1", 0.0), idle_since("runtime-2", 0.0)]
    assert scale(8, two, POLICY, now=1000.0) == Scaling()
    assert scale(4, two, POLICY, now=1000.0) == Scaling(stop=("runtime-1",))


@pytest.mark.parametrize(
    ("minimum", "maximum", "target", "idle_s"), [(-1, 2, 4, 1.0), (3, 2, 4, 1.0), (0, 2, 0, 1.0), (0, 2, 4, -1.0)]
)
def test_a_policy_that_cannot_hold_is_refused(minimum: int, maximum: int, target: int, idle_s: float) -> None:
    with pytest.raises(ValueError):
        ScalePolicy(minimum, maximum, target, idle_s)
