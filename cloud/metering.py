"""Metering: the pure pricing core and the ledger that records usage once per request.

A batch's measured device time is split across its requests in proportion to their rows.
Queue time, model loading and compilation never enter these numbers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from cloud.db import Database, UsageRecord, utcnow


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


class Ledger:
    """Writes usage records; a request id already recorded is left as it was."""

    def __init__(self, db: Database) -> None:
        self.db = db
        insert = pg_insert if db.engine.dialect.name == "postgresql" else sqlite_insert
        # one statement for every call, run with a list of rows: compiled once, not per batch
        self._insert = insert(UsageRecord).on_conflict_do_nothing(index_elements=["request_id"])

    def record(self, usages: Sequence[Usage]) -> None:
        if not usages:
            return
        now = utcnow()
        rows = [{**u.__dict__, "cost": u.cost, "created_at": now} for u in usages]
        with self.db.engine.begin() as connection:
            connection.execute(self._insert, rows)

    def summary(self, tenant_id: int) -> list[dict]:
        """Per model and version: requests, rows, billed seconds and cost."""
        query = (
            select(
                UsageRecord.model_name,
                UsageRecord.version,
                UsageRecord.target,
                UsageRecord.price_per_second,
                func.count(UsageRecord.id),
                func.sum(UsageRecord.rows),
                func.sum(UsageRecord.billed_seconds),
                func.sum(UsageRecord.cost),
            )
            .where(UsageRecord.tenant_id == tenant_id)
            .group_by(
                UsageRecord.model_name,
                UsageRecord.version,
                UsageRecord.target,
                UsageRecord.price_per_second,
            )
            .order_by(UsageRecord.model_name, UsageRecord.version)
        )
        with self.db.session() as session:
            result = session.execute(query).all()
        return [
            {
                "model": name,
                "version": version,
                "target": target,
                "price_per_second": price,
                "requests": count,
                "rows": int(rows),
                "billed_seconds": float(seconds),
                "cost": float(cost),
            }
            for name, version, target, price, count, rows, seconds, cost in result
        ]
