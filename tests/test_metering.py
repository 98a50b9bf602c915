"""Pricing is a pure split of batch time; the ledger writes each request once (SQLite and PostgreSQL)."""

from __future__ import annotations

import uuid

import pytest
from sqlalchemy import select

from api.services import open_database
from cloud.db import Database, UsageRecord
from cloud.metering import Ledger
from cloud.settings import Settings
from cloud.usage import Usage
from scheduler.pricing import split_by_rows


def test_split_is_proportional_to_rows_and_sums_to_the_batch() -> None:
    shares = split_by_rows(0.03, [1, 2, 3])
    assert shares == pytest.approx([0.005, 0.01, 0.015])
    assert sum(shares) == pytest.approx(0.03)


def test_split_refuses_an_empty_batch() -> None:
    with pytest.raises(ValueError):
        split_by_rows(1.0, [])


@pytest.fixture(params=["sqlite", "postgresql"])
def database(request, tmp_path):
    """The ledger's database as a server opens it: SQLite by create_all, a new PostgreSQL
    database by the migrations."""
    url = "" if request.param == "sqlite" else request.getfixturevalue("postgres_url")
    db = open_database(Settings(data_dir=tmp_path / "data", database_url=url))
    yield db
    db.dispose()


def usage(request_id: str, tenant_id: int, rows: int, seconds: float) -> Usage:
    return Usage(request_id, tenant_id, "m", 1, "cpu", rows, 2, 3, 0.003, seconds, 0.5)


def test_ledger_records_once_and_sums(database: Database) -> None:
    ledger = Ledger(database)
    tenant = 7
    first, second = uuid.uuid4().hex, uuid.uuid4().hex
    ledger.record([usage(first, tenant, 1, 0.001), usage(second, tenant, 2, 0.002)])
    ledger.record([usage(first, tenant, 1, 0.001)])  # a retry of the same request changes nothing
    with database.session() as session:
        rows = session.scalars(select(UsageRecord).where(UsageRecord.tenant_id == tenant)).all()
    assert sorted(r.request_id for r in rows) == sorted([first, second])
    [summary] = ledger.summary(tenant)
    assert summary["requests"] == 2 and summary["rows"] == 3
    assert summary["billed_seconds"] == pytest.approx(0.003)
    assert summary["cost"] == pytest.approx(0.0015)
