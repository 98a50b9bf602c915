"""The pure pricing core: what one request consumed and what it costs. No clocks, no I/O.

A batch's measured device time is split across its requests in proportion to their rows.
Queue time, model loading and compilation never enter these numbers. Where the priced usage
goes (the SQL ledger in cloud/metering.py, in production) is a UsageSink the engines are given.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol


def split_by_rows(batch_seconds: float, rows: Sequence[int]) -> list[float]:
    """Each request's share of a batch's device time, proportional to its rows."""
    total = sum(rows)
    if total <= 0:
        raise ValueError("a batch has at least one row")
    return [batch_seconds * r / total for r in rows]


def price_for(target: str, prices: Mapping[str, float]) -> float:
    if target not in prices:
        raise ValueError(f"no price configured for device type {target!r}")
    return prices[target]


@dataclass(frozen=True)
class Usage:
    """What one request consumed: the record the ledger writes."""

    request_id: str
    tenant_id: int
    model_name: str
    version: int
    target: str
    # rows this request contributed to its batch
    rows: int
    # requests and rows in the batch it ran in
    batch_size: int
    batch_rows: int
    # measured device time of the whole batch
    batch_exec_seconds: float
    # this request's share of it
    billed_seconds: float
    price_per_second: float

    @property
    def cost(self) -> float:
        return self.billed_seconds * self.price_per_second


class UsageSink(Protocol):
    """Where the engines send usage: each request recorded once, a request id seen before left
    as it was (a batch run again after a runtime died must not bill twice)."""

    def record(self, usages: Sequence[Usage]) -> None: ...
