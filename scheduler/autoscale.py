"""How many runtime processes a device type's pool should run: a pure rule, no clock and no I/O.

It is the rule KEDA applies to a runtime Deployment in Kubernetes (deploy/k8s: a redis-streams
trigger on the pool stream's consumer-group lag), for `luminal-cloud stack --runtimes auto` on
one machine, whose supervisor (api/stack.py) reads the lag and the runtimes' heartbeats, passes
them here with the time, and starts or stops processes as told:

  - desired = ceil(lag / target_lag), clamped to [min_runtimes, max_runtimes]: requests waiting
    for a runtime of the pool (the lag of scheduler.wire.pool_stream's group) start runtimes at
    once, as many as the backlog calls for and never more than max_runtimes;
  - past the desired count, one runtime at a time stops, and only one that has been idle (held no
    request and answered none) for idle_s: KEDA's cooldown, so a pool goes to zero once every
    runtime has been idle that long and nothing waits. A runtime still starting, or busy, stays.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ScalePolicy:
    # runtimes kept however idle the pool is (0: scale to zero), and never exceeded
    min_runtimes: int
    max_runtimes: int
    # the backlog one runtime is meant to take: KEDA's lagCount
    target_lag: int
    # seconds a runtime stays idle before it may be stopped: KEDA's cooldownPeriod
    idle_s: float

    def __post_init__(self) -> None:
        if not 0 <= self.min_runtimes <= self.max_runtimes:
            raise ValueError(f"need 0 <= min <= max runtimes, not {self.min_runtimes} and {self.max_runtimes}")
        if self.target_lag < 1:
            raise ValueError(f"the target lag per runtime is at least 1, not {self.target_lag}")
        if self.idle_s < 0:
            raise ValueError(f"the idle time is not negative, not {self.idle_s}")


@dataclass(frozen=True)
class RuntimeState:
    """One runtime of the pool as its supervisor sees it."""

    # the supervisor's name for it
    name: str
    # False until its heartbeat announced it: a runtime still starting is never stopped
    announced: bool
    # requests it has taken and not yet answered
    held: int
    # when it last took or answered a request (its start before the first), on the caller's clock
    last_active: float


@dataclass(frozen=True)
class Scaling:
    """What to do now: start this many runtimes, and stop these (by name)."""

    start: int = 0
    stop: tuple[str, ...] = ()


def desired_runtimes(lag: int, policy: ScalePolicy) -> int:
    """ceil(lag / target_lag), clamped to [min_runtimes, max_runtimes]."""
    wanted = math.ceil(max(0, lag) / policy.target_lag)
    return min(max(wanted, policy.min_runtimes), policy.max_runtimes)


def idle(runtime: RuntimeState, now: float, policy: ScalePolicy) -> bool:
    return runtime.announced and runtime.held == 0 and now - runtime.last_active >= policy.idle_s


def scale(lag: int, runtimes: Sequence[RuntimeState], policy: ScalePolicy, now: float) -> Scaling:
    """The pool's next step, from the lag of its pool stream and its runtimes at `now`."""
    desired = desired_runtimes(lag, policy)
    if desired > len(runtimes):
        return Scaling(start=desired - len(runtimes))
    if desired < len(runtimes):
        # the longest idle goes first, one per step: a scale-in never drops a pool's capacity at once
        candidates = sorted((r for r in runtimes if idle(r, now, policy)), key=lambda r: r.last_active)
        if candidates:
            return Scaling(stop=(candidates[0].name,))
    return Scaling()
