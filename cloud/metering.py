"""The usage ledger: records usage once per request in the metadata database, and sums it.
A request voided (answered with an error after a runtime may have run it) is never billed.

It records Usage (cloud/usage.py), which the scheduler's pure pricing core (scheduler/pricing.py)
fills in by splitting a batch's time by rows; the ledger is the UsageSink the engines are given.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime

from sqlalchemy import Date, cast, delete, func, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Connection

from cloud.db import Database, Tenant, UsageRecord, UsageVoid, utcnow
from cloud.usage import Usage

log = logging.getLogger(__name__)

# what usage can be grouped by: a tenant (by name), a model, a version (with its target and
# price), a UTC calendar day
DIMENSIONS = ("tenant", "model", "version", "day")
# PostgreSQL advisory lock ordering records against voids: records share it, a void holds it alone
LEDGER_LOCK = 0x6C756D696E616C  # "luminal"


class Ledger:
    """Writes usage records; a request id already recorded, or voided, is left as it was."""

    def __init__(self, db: Database) -> None:
        self.db = db
        insert = pg_insert if db.engine.dialect.name == "postgresql" else sqlite_insert
        # one statement for every call, run with a list of rows: compiled once, not per batch
        self._insert = insert(UsageRecord).on_conflict_do_nothing(index_elements=["request_id"])
        self._insert_void = insert(UsageVoid).on_conflict_do_nothing(index_elements=["request_id"])

    def record(self, usages: Sequence[Usage], at: datetime | None = None) -> None:
        """Writes the records, stamped `at` (now unless given: backfills and tests), but those of
        voided requests."""
        if not usages:
            return
        stamp = utcnow() if at is None else at.astimezone(UTC)
        with self._ordered(exclusive=False) as connection:
            ids = [u.request_id for u in usages]
            voided = set(connection.scalars(select(UsageVoid.request_id).where(UsageVoid.request_id.in_(ids))))
            rows = [{**u.__dict__, "cost": u.cost, "created_at": stamp} for u in usages if u.request_id not in voided]
            if rows:
                connection.execute(self._insert, rows)
        if voided:
            log.warning("not billed: %d requests a runtime ran after their clients were answered with an error (%s)",
                        len(voided), " ".join(sorted(voided)))

    def void(self, request_ids: Sequence[str]) -> None:
        """Marks the requests never to be billed: a record written already is deleted, one that
        comes later is not written. Voiding twice changes nothing."""
        if not request_ids:
            return
        stamp = utcnow()
        with self._ordered(exclusive=True) as connection:
            connection.execute(self._insert_void, [{"request_id": r, "voided_at": stamp} for r in request_ids])
            recorded = UsageRecord.request_id.in_(request_ids)
            deleted = connection.scalars(select(UsageRecord.request_id).where(recorded)).all()
            if deleted:
                connection.execute(delete(UsageRecord).where(recorded))
        if deleted:
            log.warning("billed no more: %d requests a runtime ran, their clients answered with an error (%s)",
                        len(deleted), " ".join(sorted(deleted)))

    @contextmanager
    def _ordered(self, exclusive: bool) -> Iterator[Connection]:
        """A transaction no void interleaves with, so that a record's look for voids and its
        insert are one step: SQLite's write lock taken first; on PostgreSQL the ledger's advisory
        lock, shared by records, held alone by a void (taken before any read, each statement of a
        READ COMMITTED transaction then sees what committed before it)."""
        with self.db.serialized() as session:
            connection = session.connection()
            if not self.db.is_sqlite:
                lock = func.pg_advisory_xact_lock if exclusive else func.pg_advisory_xact_lock_shared
                connection.execute(select(lock(LEDGER_LOCK)))
            yield connection

    def summary(self, tenant_id: int) -> list[dict]:
        """Per model and version, all time: requests, rows, billed seconds and cost."""
        return self.totals(("model", "version"), tenant_id=tenant_id)

    def totals(
        self,
        group_by: Sequence[str],
        *,
        tenant_id: int | None = None,
        start: datetime | None = None,
        end: datetime | None = None,
    ) -> list[dict]:
        """Requests, rows, billed seconds and cost of the records made in [start, end), a row per
        value of the `group_by` dimensions (DIMENSIONS), ordered by them. tenant_id None reads
        every tenant (the operators' view)."""
        unknown = [d for d in group_by if d not in DIMENSIONS]
        if unknown:
            raise ValueError(f"unknown usage dimension {unknown[0]!r}; known: {', '.join(DIMENSIONS)}")
        keys = [column for d in group_by for column in self._dimension(d)]
        query = select(
            *keys,
            func.count(UsageRecord.id).label("requests"),
            func.sum(UsageRecord.rows).label("rows"),
            func.sum(UsageRecord.billed_seconds).label("billed_seconds"),
            func.sum(UsageRecord.cost).label("cost"),
            func.coalesce(func.sum(UsageRecord.prompt_tokens), 0).label("prompt_tokens"),
            func.coalesce(func.sum(UsageRecord.completion_tokens), 0).label("completion_tokens"),
        ).select_from(UsageRecord)
        if "tenant" in group_by:
            query = query.outerjoin(Tenant, Tenant.id == UsageRecord.tenant_id)
        if tenant_id is not None:
            query = query.where(UsageRecord.tenant_id == tenant_id)
        if start is not None:
            query = query.where(UsageRecord.created_at >= start.astimezone(UTC))
        if end is not None:
            query = query.where(UsageRecord.created_at < end.astimezone(UTC))
        query = query.group_by(*keys).order_by(*keys)
        with self.db.session() as session:
            result = session.execute(query).mappings().all()
        return [
            {
                **{key.name: row[key.name] for key in keys},
                "requests": row["requests"],
                "rows": int(row["rows"]),
                "billed_seconds": float(row["billed_seconds"]),
                "cost": float(row["cost"]),
                "prompt_tokens": int(row["prompt_tokens"]),
                "completion_tokens": int(row["completion_tokens"]),
            }
            for row in result
        ]

    def _dimension(self, name: str) -> list:
        if name == "tenant":
            return [Tenant.name.label("tenant")]
        if name == "model":
            return [UsageRecord.model_name.label("model")]
        if name == "version":
            # a version runs on one target; its price is kept with each record, so a price
            # change shows as a row of its own rather than a wrong cost
            return [
                UsageRecord.version.label("version"),
                UsageRecord.target.label("target"),
                UsageRecord.price_per_second.label("price_per_second"),
            ]
        return [self._utc_day().label("day")]

    def _utc_day(self):
        """The UTC calendar day of a record, as a date, in this database's dialect."""
        if self.db.engine.dialect.name == "postgresql":
            # timestamptz: take the day in UTC, whatever the session's time zone
            return cast(func.timezone("UTC", UsageRecord.created_at), Date)
        # SQLite keeps the UTC time as ISO text; date() reads its day
        return func.date(UsageRecord.created_at, type_=Date)
