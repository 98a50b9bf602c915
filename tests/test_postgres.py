"""PostgreSQL, the distributed mode's database: the Alembic migrations build exactly the schema
the models declare, servers starting together upgrade once, the API and the ledger work on it,
and a server that cannot reach it exits with a message instead of a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnxruntime
import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, text

from api.services import open_database
from cloud.db import Base
from cloud.errors import Conflict
from cloud.metering import Ledger
from cloud.migrations import alembic_config
from cloud.settings import Settings
from cloud.storage import LocalObjectStore
from cloud.usage import Usage
from registry import Registry
from tests.conftest import auth, make_settings, upload, wait_for
from tests.onnx_models import mlp

MLP = mlp().SerializeToString()


@pytest.fixture
def settings(tmp_path: Path, postgres_url: str) -> Settings:
    """The conftest's client and keys, on a new PostgreSQL database."""
    return make_settings(tmp_path / "data", database_url=postgres_url)


def test_migrations_build_an_empty_database_exactly_as_the_models_declare(settings: Settings) -> None:
    open_database(settings).dispose()
    engine = create_engine(settings.database_url)
    try:
        with engine.connect() as connection:
            current = MigrationContext.configure(connection).get_current_revision()
            differences = compare_metadata(MigrationContext.configure(connection), Base.metadata)
    finally:
        engine.dispose()
    assert current == ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert differences == []


# a server's start up to its database: imports, then waits for the word to open it
STARTER = """
import sys
from api.services import open_database
from cloud.settings import Settings
settings = Settings()
print("ready", flush=True)
sys.stdin.readline()
open_database(settings).dispose()
"""


def test_servers_starting_together_upgrade_the_schema_once(settings: Settings) -> None:
    env = {
        **os.environ,
        "LUMINAL_DATABASE_URL": settings.database_url,
        "LUMINAL_DATA_DIR": str(settings.data_dir),
    }
    servers = [
        subprocess.Popen(
            [sys.executable, "-c", STARTER], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        for _ in range(4)
    ]
    try:
        for server in servers:
            assert server.stdout.readline().strip() == "ready"
        for server in servers:  # all at once: without the advisory lock, all but one would fail
            server.stdin.write("go\n")
            server.stdin.flush()
        assert [server.wait(60) for server in servers] == [0, 0, 0, 0]
    finally:
        for server in servers:
            server.kill()
            server.communicate()
    engine = create_engine(settings.database_url)
    try:
        with engine.connect() as connection:
            revisions = connection.scalars(text("SELECT version_num FROM alembic_version")).all()
    finally:
        engine.dispose()
    assert revisions == [ScriptDirectory.from_config(alembic_config()).get_current_head()]


def test_the_api_uploads_compiles_serves_and_bills_on_postgresql(client, keys, settings: Settings) -> None:
    upload(client, keys["alice"], "mlp", MLP)
    assert wait_for(client, keys["alice"], "mlp", 1)["status"] == "ready"
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    expected = onnxruntime.InferenceSession(MLP, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    request_ids = []
    for _ in range(3):
        response = client.post(
            "/v1/models/mlp/infer", headers=auth(keys["alice"]), json={"inputs": {"x": x.tolist()}}
        )
        assert response.status_code == 200, response.text
        np.testing.assert_allclose(np.array(response.json()["outputs"]["y"]), expected, rtol=1e-5, atol=1e-6)
        request_ids.append(response.headers["X-Request-ID"])

    engine = create_engine(settings.database_url)
    try:
        with engine.connect() as connection:
            rows = connection.execute(
                text(
                    "SELECT u.request_id, u.model_name, u.rows, u.billed_seconds, t.name FROM usage_records u"
                    " JOIN tenants t ON t.id = u.tenant_id ORDER BY u.id"
                )
            ).all()
            status = connection.scalar(text("SELECT status FROM model_versions"))
    finally:
        engine.dispose()
    assert status == "ready"
    assert [row.request_id for row in rows] == request_ids
    assert all(row.name == "alice" and row.model_name == "mlp" and row.rows == 3 for row in rows)
    assert all(row.billed_seconds > 0 for row in rows)


def test_the_aliases_revision_keeps_existing_versions_and_numbers_on(settings: Settings) -> None:
    """A database at 0002 with models gains aliases and models.last_version (from the versions it
    has), then takes aliases, promote, rollback and deletions on PostgreSQL."""
    config = alembic_config(settings.database_url)
    command.upgrade(config, "0002")
    engine = create_engine(settings.database_url)
    try:
        with engine.begin() as connection:
            connection.execute(text("INSERT INTO tenants (name, created_at) VALUES ('alice', now())"))
            connection.execute(text("INSERT INTO models (tenant_id, name, created_at) VALUES (1, 'm', now())"))
            for number in (1, 2, 4):
                connection.execute(
                    text(
                        "INSERT INTO model_versions (model_id, number, status, target, graph_key, graph_bytes,"
                        " created_at, updated_at) VALUES (1, :n, 'ready', 'cpu', :key, 1, now(), now())"
                    ),
                    {"n": number, "key": f"graphs/{number}"},
                )
    finally:
        engine.dispose()
    db = open_database(settings)  # to head, as a server's start does
    try:
        registry = Registry(db, LocalObjectStore(settings.objects_dir), settings.targets)
        assert registry.get_model(1, "m").last_version == 4
        registry.set_alias(1, "m", "prod", 1)
        assert registry.set_alias(1, "m", "prod", 4).version.number == 4
        assert registry.resolve(1, "m", "prod").number == 4
        with pytest.raises(Conflict, match="alias 'prod'"):
            registry.delete_version(1, "m", 4)
        assert registry.rollback_alias(1, "m", "prod").version.number == 1
        registry.delete_version(1, "m", 4)
        registry.set_alias(1, "m", "prod", 2)
        registry.delete_version(1, "m", 1)
        with pytest.raises(Conflict, match="version 1 before, which was deleted"):
            registry.rollback_alias(1, "m", "prod")
        assert [v.number for v in registry.get_model(1, "m").versions] == [2]
    finally:
        db.dispose()


def test_the_precision_revision_gives_existing_versions_the_exported_precision(settings: Settings) -> None:
    command.upgrade(alembic_config(settings.database_url), "0003")
    engine = create_engine(settings.database_url)
    try:
        with engine.begin() as connection:
            connection.execute(text("INSERT INTO tenants (name, created_at) VALUES ('alice', now())"))
            connection.execute(text("INSERT INTO models (tenant_id, name, created_at) VALUES (1, 'm', now())"))
            connection.execute(
                text(
                    "INSERT INTO model_versions (model_id, number, status, target, graph_key, graph_bytes,"
                    " created_at, updated_at) VALUES (1, 1, 'ready', 'cpu', 'graphs/1', 1, now(), now())"
                )
            )
    finally:
        engine.dispose()
    db = open_database(settings)  # to head, as a server's start does
    try:
        registry = Registry(db, LocalObjectStore(settings.objects_dir), settings.targets)
        assert [v.precision for v in registry.get_model(1, "m").versions] == ["exported"]
    finally:
        db.dispose()


def test_racing_writers_of_the_same_requests_leave_one_record_each(settings: Settings) -> None:
    db = open_database(settings)
    ledger = Ledger(db)
    request_ids = [uuid.uuid4().hex for _ in range(50)]
    # every writer records every request: what redelivered usage events would do
    batches = [
        [Usage(r, 1, "m", 1, "cpu", 1, 1, 1, 0.001, 0.001, 0.5) for r in request_ids] for _ in range(6)
    ]
    try:
        with ThreadPoolExecutor(6) as pool:
            list(pool.map(ledger.record, batches))
        with db.engine.connect() as connection:
            recorded = connection.scalars(text("SELECT request_id FROM usage_records")).all()
        [summary] = ledger.summary(1)
    finally:
        db.dispose()
    assert sorted(recorded) == sorted(request_ids)
    assert summary["requests"] == 50 and summary["cost"] == pytest.approx(50 * 0.0005)


def test_serve_exits_naming_an_unreachable_database_with_its_password_masked(tmp_path: Path) -> None:
    url = "postgresql+psycopg://postgres:hunter2@127.0.0.1:1/nope"
    env = {**os.environ, "LUMINAL_DATABASE_URL": url, "LUMINAL_DATA_DIR": str(tmp_path / "data")}
    started = time.monotonic()
    done = subprocess.run(
        [str(Path(sys.executable).parent / "luminal-cloud"), "serve", "--port", "0"],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1, done.stderr
    assert time.monotonic() - started < 20
    assert "postgresql+psycopg://postgres:***@127.0.0.1:1/nope" in done.stderr
    assert "hunter2" not in done.stderr and "Traceback" not in done.stderr


def test_an_embedded_database_made_before_a_column_gets_it_with_its_default(tmp_path) -> None:
    # the embedded SQLite has no migrations: a data directory from an earlier version gets the
    # columns added since when it is opened, its rows taking their defaults
    from cloud.db import Database

    url = f"sqlite:///{tmp_path / 'old.db'}"
    old = Database(url)
    old.create_all()
    with old.engine.begin() as connection:
        connection.exec_driver_sql("PRAGMA foreign_keys=OFF")
        connection.exec_driver_sql("ALTER TABLE model_versions DROP COLUMN precision")
        connection.exec_driver_sql(
            "INSERT INTO model_versions (id, model_id, number, status, target, graph_key, graph_bytes, created_at, updated_at) "
            "VALUES (1, 1, 1, 'ready', 'h100', 'graphs/x', 10, '2026-11-01', '2026-11-01')"
        )
    old.dispose()
    reopened = Database(url)
    reopened.create_all()
    with reopened.engine.connect() as connection:
        rows = connection.exec_driver_sql("SELECT target, precision FROM model_versions").all()
    reopened.dispose()
    assert rows == [("h100", "exported")]
