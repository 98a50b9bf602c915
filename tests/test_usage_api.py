"""The usage API: a tenant's totals over a period by model, version or day, the CSV export,
and the operators' view across tenants with operator keys (issue 12 part 8)."""

from __future__ import annotations

import csv
import io
import os
import subprocess
import sys
import uuid
from datetime import UTC, datetime
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from api.main import create_app
from api.services import open_database
from cloud.auth import create_admin_key, create_key
from cloud.db import Tenant
from cloud.metering import Ledger
from cloud.usage import Usage
from tests.conftest import auth, make_settings, upload, wait_for
from tests.onnx_models import mlp

MLP = mlp().SerializeToString()
PRICE = 0.5


@pytest.fixture
def operator_key(settings) -> str:
    db = open_database(settings)
    try:
        return create_admin_key(db, "ops")
    finally:
        db.dispose()


def tenant_id(ledger: Ledger, name: str) -> int:
    with ledger.db.session() as session:
        return session.scalar(select(Tenant.id).where(Tenant.name == name))


def record(ledger: Ledger, tenant: int, at: str, model: str = "m", version: int = 1, rows: int = 1,
           seconds: float = 0.001) -> None:
    usage = Usage(uuid.uuid4().hex, tenant, model, version, "cpu", rows, 1, rows, seconds, seconds, PRICE)
    ledger.record([usage], at=datetime.fromisoformat(at))


def rows_of(response) -> list[dict[str, str]]:
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/csv")
    return list(csv.DictReader(io.StringIO(response.text)))


def infer(client: TestClient, key: str, name: str, rows: int, **params) -> float:
    body = {"inputs": {"x": [[0.5] * 8] * rows}}
    response = client.post(f"/v1/models/{name}/infer", headers=auth(key), json=body, params=params)
    assert response.status_code == 200, response.text
    return response.json()["usage"]["exec_ms"] / 1000


def test_totals_by_version_model_and_day_match_real_inference(client, keys, settings) -> None:
    alice = keys["alice"]
    upload(client, alice, "mlp", MLP)
    assert wait_for(client, alice, "mlp", 1)["status"] == "ready"
    upload(client, alice, "mlp", MLP)  # the same bytes: version 2 from the compile cache
    upload(client, alice, "other", MLP)
    assert wait_for(client, alice, "mlp", 2)["status"] == "ready"
    assert wait_for(client, alice, "other", 1)["status"] == "ready"
    billed = {
        ("mlp", 1): sum(infer(client, alice, "mlp", rows, version=1) for rows in (1, 3)),
        ("mlp", 2): sum(infer(client, alice, "mlp", rows) for rows in (2,)),
        ("other", 1): sum(infer(client, alice, "other", rows) for rows in (1, 1, 4)),
    }
    price = settings.price_per_second["cpu"]

    report = client.get("/v1/usage", headers=auth(alice), params={"group_by": "version"}).json()
    assert report["tenant"] == "alice" and report["group_by"] == "version"
    got = {(i["model"], i["version"]): (i["requests"], i["rows"], i["billed_seconds"]) for i in report["items"]}
    assert got == {
        ("mlp", 1): (2, 4, pytest.approx(billed["mlp", 1], rel=1e-6)),
        ("mlp", 2): (1, 2, pytest.approx(billed["mlp", 2], rel=1e-6)),
        ("other", 1): (3, 6, pytest.approx(billed["other", 1], rel=1e-6)),
    }
    assert all(i["target"] == "cpu" and i["price_per_second"] == price for i in report["items"])
    assert report["total_cost"] == pytest.approx(sum(billed.values()) * price, rel=1e-6)
    assert client.get("/v1/usage", headers=auth(alice)).json() == report  # version is the default

    by_model = client.get("/v1/usage", headers=auth(alice), params={"group_by": "model"}).json()["items"]
    assert [(i["model"], i["requests"], i["rows"]) for i in by_model] == [("mlp", 3, 6), ("other", 3, 6)]
    assert "version" not in by_model[0] and "day" not in by_model[0]

    today = datetime.now(UTC).date().isoformat()
    [day] = client.get("/v1/usage", headers=auth(alice), params={"group_by": "day"}).json()["items"]
    assert (day["day"], day["requests"], day["rows"]) == (today, 6, 12)
    assert day["billed_seconds"] == pytest.approx(sum(billed.values()), rel=1e-6)
    # the day ends at midnight UTC: a period ending today holds none of it
    assert client.get("/v1/usage", headers=auth(alice), params={"to": today}).json()["items"] == []
    assert client.get("/v1/usage", headers=auth(keys["bob"])).json()["items"] == []


def test_from_is_inclusive_to_is_exclusive_and_offsets_are_read_as_utc(client, keys) -> None:
    ledger = client.app.state.services.ledger
    alice = tenant_id(ledger, "alice")
    for at in ("2026-01-30T23:59:59Z", "2026-01-31T00:00:00Z", "2026-01-31T23:59:59.5Z", "2026-02-01T00:00:00Z"):
        record(ledger, alice, at)
    record(ledger, tenant_id(ledger, "bob"), "2026-01-31T12:00:00Z")

    def requests(**params) -> list[tuple]:
        items = client.get("/v1/usage", headers=auth(keys["alice"]), params={"group_by": "day", **params}).json()
        return [(i["day"], i["requests"]) for i in items["items"]]

    assert requests() == [("2026-01-30", 1), ("2026-01-31", 2), ("2026-02-01", 1)]
    assert requests(**{"from": "2026-01-31", "to": "2026-02-01"}) == [("2026-01-31", 2)]
    assert requests(**{"from": "2026-01-31T00:00:00.001"}) == [("2026-01-31", 1), ("2026-02-01", 1)]
    # 01:00 at +01:00 is midnight UTC; 2026-02-01T00:00:00 UTC is excluded by the exclusive end
    assert requests(**{"from": "2026-01-31T01:00:00+01:00", "to": "2026-02-01T00:00:00Z"}) == [("2026-01-31", 2)]
    assert requests(to="2026-01-31") == [("2026-01-30", 1)]
    assert requests(**{"from": "2026-01-31", "to": "2026-01-31"}) == []  # an empty period is no error
    report = client.get("/v1/usage", headers=auth(keys["alice"]), params={"from": "2026-01-31", "to": "2026-02-01"})
    assert (report.json()["from"], report.json()["to"]) == ("2026-01-31T00:00:00Z", "2026-02-01T00:00:00Z")


# inference records count no tokens; generation's do (tests/test_generation_api.py)
NO_TOKENS = {"prompt_tokens": "0", "completion_tokens": "0"}


def test_csv_export_has_a_header_row_the_same_numbers_and_a_filename(client, keys) -> None:
    ledger = client.app.state.services.ledger
    alice = tenant_id(ledger, "alice")
    record(ledger, alice, "2026-03-01T10:00:00Z", model="a", rows=2, seconds=0.004)
    record(ledger, alice, "2026-03-01T11:00:00Z", model="a", version=2, rows=1, seconds=0.002)
    record(ledger, alice, "2026-03-02T10:00:00Z", model="b", rows=3, seconds=0.006)
    headers = auth(keys["alice"])
    params = {"from": "2026-03-01", "to": "2026-03-03", "group_by": "version"}

    as_csv = client.get("/v1/usage", headers=headers, params={**params, "format": "csv"})
    rows = rows_of(as_csv)
    assert as_csv.text.splitlines()[0] == (
        "model,version,target,price_per_second,requests,rows,billed_seconds,cost,prompt_tokens,completion_tokens"
    )
    assert as_csv.headers["content-disposition"] == (
        'attachment; filename="luminal-usage-alice-version-2026-03-01-2026-03-03.csv"'
    )
    as_json = client.get("/v1/usage", headers=headers, params=params).json()["items"]
    assert len(rows) == len(as_json) == 3
    for row, item in zip(rows, as_json, strict=True):
        assert (row["model"], int(row["version"]), row["target"]) == (item["model"], item["version"], item["target"])
        assert (int(row["requests"]), int(row["rows"])) == (item["requests"], item["rows"])
        assert float(row["billed_seconds"]) == item["billed_seconds"] and float(row["cost"]) == item["cost"]
    # Accept: text/csv asks for the same; ?format=json overrides it
    by_day = client.get("/v1/usage", headers={**headers, "Accept": "text/csv"}, params={"group_by": "day"})
    assert rows_of(by_day) == [
        {"day": "2026-03-01", "requests": "2", "rows": "3", "billed_seconds": "0.006", "cost": "0.003", **NO_TOKENS},
        {"day": "2026-03-02", "requests": "1", "rows": "3", "billed_seconds": "0.006", "cost": "0.003", **NO_TOKENS},
    ]
    assert 'filename="luminal-usage-alice-day-start-now.csv"' in by_day.headers["content-disposition"]
    forced = client.get("/v1/usage", headers={**headers, "Accept": "text/csv"}, params={"format": "json"})
    assert forced.headers["content-type"] == "application/json"


@pytest.mark.parametrize(
    ("params", "parameter", "words"),
    [
        ({"from": "yesterday"}, "from", "not an ISO-8601 date"),
        ({"to": "2026-13-01"}, "to", "not an ISO-8601 date"),
        ({"from": "2026-01-31T12:00:00 02:00"}, "from", "%2B"),
        ({"from": "2026-02-01", "to": "2026-01-31"}, "from", "is after to"),
        ({"group_by": "week"}, "group_by", "'model', 'version' or 'day'"),
        ({"format": "xml"}, "format", "'json' or 'csv'"),
    ],
)
def test_bad_parameters_get_400_naming_the_parameter(client, keys, params, parameter, words) -> None:
    response = client.get("/v1/usage", headers=auth(keys["alice"]), params=params)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_request"
    assert parameter in error["message"] and words in error["message"], error["message"]


def test_operator_keys_see_every_tenant_and_tenant_keys_get_403(client, keys, operator_key) -> None:
    ledger = client.app.state.services.ledger
    alice, bob = tenant_id(ledger, "alice"), tenant_id(ledger, "bob")
    record(ledger, alice, "2026-04-01T08:00:00Z", model="m", rows=2, seconds=0.002)
    record(ledger, alice, "2026-04-02T08:00:00Z", model="n", rows=1, seconds=0.001)
    record(ledger, bob, "2026-04-02T09:00:00Z", model="m", rows=5, seconds=0.010)
    operator = auth(operator_key)

    for key in (keys["alice"], keys["bob"]):
        refused = client.get("/v1/admin/usage", headers=auth(key))
        assert refused.status_code == 403
        assert "create-key --admin" in refused.json()["error"]["message"]
    assert client.get("/v1/admin/usage").status_code == 401
    assert client.get("/v1/admin/usage", headers=auth("lca_not-a-key")).status_code == 401
    # an operator key acts for no tenant: refused as one (tests/test_api_keys.py)
    assert client.get("/v1/usage", headers=operator).status_code == 403

    report = client.get("/v1/admin/usage", headers=operator).json()
    assert "tenant" not in report and report["group_by"] == "tenant"
    assert [(i["tenant"], i["requests"], i["rows"]) for i in report["items"]] == [("alice", 2, 3), ("bob", 1, 5)]
    assert report["total_billed_seconds"] == pytest.approx(0.013)
    by_model = client.get("/v1/admin/usage", headers=operator, params={"group_by": "model"}).json()["items"]
    assert [(i["tenant"], i["model"], i["rows"]) for i in by_model] == [("alice", "m", 2), ("alice", "n", 1),
                                                                       ("bob", "m", 5)]
    days = client.get("/v1/admin/usage", headers=operator, params={"group_by": "day", "from": "2026-04-02"})
    assert [(i["day"], i["requests"]) for i in days.json()["items"]] == [("2026-04-02", 2)]
    only_bob = client.get("/v1/admin/usage", headers=operator, params={"tenant": "bob", "group_by": "model"}).json()
    assert only_bob["tenant"] == "bob" and [(i["tenant"], i["model"]) for i in only_bob["items"]] == [("bob", "m")]

    exported = client.get("/v1/admin/usage", headers=operator, params={"group_by": "model", "format": "csv"})
    assert [(r["tenant"], r["model"], r["rows"]) for r in rows_of(exported)] == [
        ("alice", "m", "2"), ("alice", "n", "1"), ("bob", "m", "5")
    ]
    assert 'filename="luminal-usage-all-tenants-model-start-now.csv"' in exported.headers["content-disposition"]

    missing = client.get("/v1/admin/usage", headers=operator, params={"tenant": "carol"})
    assert missing.status_code == 404 and "carol" in missing.json()["error"]["message"]
    bad = client.get("/v1/admin/usage", headers=operator, params={"group_by": "version"})
    assert bad.status_code == 400 and "group_by" in bad.json()["error"]["message"]
    assert client.get("/v1/admin/usage", headers=operator, params={"to": "soon"}).status_code == 400


def test_cli_creates_operator_keys_apart_from_tenant_keys(tmp_path: Path) -> None:
    env = {**os.environ, "LUMINAL_DATA_DIR": str(tmp_path / "data")}

    def cli(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "luminal_cloud.cli", "admin", "create-key", *args]
        return subprocess.run(command, check=False, env=env, capture_output=True, text=True, timeout=120)

    made = cli("--admin", "--name", "ops")
    assert made.returncode == 0, made.stderr
    key = made.stdout.split()[-1]
    assert key.startswith("lca_") and "ops" in made.stdout
    neither = cli()
    assert neither.returncode != 0 and "--tenant NAME" in neither.stderr
    assert cli("--admin", "--tenant", "alice").returncode != 0
    with TestClient(create_app(make_settings(tmp_path / "data"))) as client:
        assert client.get("/v1/admin/usage", headers=auth(key)).json()["items"] == []


def test_admin_usage_by_day_on_postgresql_in_utc_whatever_the_session_zone(tmp_path: Path, postgres_url) -> None:
    # the session's zone is Tokyo (UTC+9): 20:00 UTC is the next day there, still this day in UTC
    settings = make_settings(tmp_path / "data", database_url=postgres_url + "?options=-c%20timezone%3DAsia/Tokyo")
    db = open_database(settings)
    try:
        alice_key, bob_key = create_key(db, "alice"), create_key(db, "bob")
        operator_key = create_admin_key(db, "ops")
    finally:
        db.dispose()
    with TestClient(create_app(settings)) as client:
        ledger = client.app.state.services.ledger
        alice, bob = tenant_id(ledger, "alice"), tenant_id(ledger, "bob")
        record(ledger, alice, "2026-05-01T20:00:00Z", rows=2)
        record(ledger, alice, "2026-05-02T00:00:00Z", rows=1)
        record(ledger, bob, "2026-05-01T23:59:59Z", rows=4)
        operator = auth(operator_key)
        days = client.get("/v1/admin/usage", headers=operator, params={"group_by": "day"}).json()["items"]
        assert [(i["day"], i["requests"], i["rows"]) for i in days] == [("2026-05-01", 2, 6), ("2026-05-02", 1, 1)]
        tenants = client.get("/v1/admin/usage", headers=operator, params={"to": "2026-05-02"}).json()["items"]
        assert [(i["tenant"], i["rows"]) for i in tenants] == [("alice", 2), ("bob", 4)]
        mine = client.get("/v1/usage", headers=auth(alice_key), params={"group_by": "day", "format": "csv"})
        assert [(r["day"], r["rows"]) for r in rows_of(mine)] == [("2026-05-01", "2"), ("2026-05-02", "1")]
        assert client.get("/v1/admin/usage", headers=auth(bob_key)).status_code == 403
