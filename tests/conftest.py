from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy
from fastapi.testclient import TestClient

from api.main import create_app
from api.services import open_database
from cloud.auth import create_key
from cloud.settings import Settings
from compiler import pipeline

FIXTURES = Path(__file__).parent / "fixtures"
# the PostgreSQL on this machine; tests create their own databases from here and drop them
POSTGRES_SERVER = "postgresql+psycopg://postgres@127.0.0.1:5432"


@pytest.fixture(autouse=True)
def one_native_candidate(monkeypatch) -> None:
    """Compiles in tests build the generated C alone (a C build and timing per candidate would
    triple the suite's compile time); tests of the candidate search ask for several by name."""
    monkeypatch.setattr(pipeline, "CANDIDATES", ("native-blas",))


def make_settings(data_dir: Path, **overrides) -> Settings:
    values = {
        "data_dir": data_dir,
        "max_queue_delay_ms": 20.0,
        "max_upload_bytes": 2 * 1024 * 1024,
        "max_infer_body_bytes": 1024 * 1024,
        # one C build per compile: the service is tested on generated code, at a test's pace
        "compile_candidates": ("native-blas",),
    }
    values.update(overrides)
    return Settings(**values)


@contextlib.contextmanager
def fresh_postgres_database(prefix: str = "luminal_test") -> Iterator[str]:
    """The URL of a new, empty database on the local PostgreSQL, dropped on leaving."""
    name = f"{prefix}_{uuid.uuid4().hex[:16]}"
    server = sqlalchemy.create_engine(f"{POSTGRES_SERVER}/test", isolation_level="AUTOCOMMIT")
    try:
        with server.connect() as connection:
            connection.exec_driver_sql(f"CREATE DATABASE {name}")
    except sqlalchemy.exc.OperationalError as exc:
        server.dispose()
        pytest.fail(f"PostgreSQL is needed at {POSTGRES_SERVER} and cannot be reached: {exc}")
    try:
        yield f"{POSTGRES_SERVER}/{name}"
    finally:
        with server.connect() as connection:
            connection.exec_driver_sql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        server.dispose()


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """The URL of a new, empty database on the local PostgreSQL, dropped after the test."""
    with fresh_postgres_database() as url:
        yield url


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return make_settings(tmp_path / "data")


@pytest.fixture
def keys(settings: Settings) -> dict[str, str]:
    db = open_database(settings)
    try:
        return {"alice": create_key(db, "alice"), "bob": create_key(db, "bob")}
    finally:
        db.dispose()


@pytest.fixture
def client(settings: Settings, keys: dict[str, str]) -> Iterator[TestClient]:
    with TestClient(create_app(settings)) as test_client:
        yield test_client


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def upload(client: TestClient, key: str, name: str, data: bytes, **form) -> dict:
    response = client.post(
        "/v1/models",
        headers=auth(key),
        files={"file": ("model.onnx", data, "application/octet-stream")},
        data={"name": name, **form},
    )
    assert response.status_code == 202, response.text
    return response.json()


def wait_for(
    client: TestClient, key: str, name: str, version: int, timeout: float = 60, progress: list | None = None
) -> dict:
    """The version once compiled or failed; `progress` collects what it showed while compiling."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        model = client.get(f"/v1/models/{name}", headers=auth(key)).json()
        found = next(v for v in model["versions"] if v["version"] == version)
        if found["status"] in ("ready", "failed"):
            return found
        if progress is not None and found["status"] == "compiling" and found.get("progress"):
            progress.append(found["progress"])
        time.sleep(0.02)
    raise AssertionError(f"{name} v{version} did not finish compiling in {timeout}s")
