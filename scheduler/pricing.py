"""The pure pricing core: each request's share of its batch's time, and its price. No clocks, no I/O.

A batch's measured device time is split across its requests in proportion to their rows.
Queue time, model loading and compilation never enter these numbers. What a request consumed is
a Usage record (cloud/usage.py); where the priced usage goes (the SQL ledger in
cloud/metering.py, in production) is a UsageSink the engines are given.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from cloud.usage import Usage


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


class UsageSink(Protocol):
    """Where the engines send usage: each request recorded once, a request id seen before left
    as it was (a batch run again after a runtime died must not bill twice); a voided request
    never billed, its record deleted or never written."""

    def record(self, usages: Sequence[Usage]) -> None: ...

    def void(self, request_ids: Sequence[str]) -> None:
        """The requests answered with an error after a runtime may have run them: billed never."""
        ...
