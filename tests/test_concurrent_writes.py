"""Concurrent writes to one model are linearisable, on SQLite and PostgreSQL alike: parallel
rollbacks, promotes, new aliases and deletions each end as if they had run one after another,
with 200 or a 4xx naming why, never a 500 and never a state that later requests trip on."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from api.server import BackgroundServer
from api.services import open_database
from cloud.db import AliasEvent, ModelAlias
from tests.conftest import make_settings
from tests.onnx_models import mlp

MODEL = mlp(seed=0).SerializeToString()
PARALLEL = 20


@pytest.fixture(params=["sqlite", "postgresql"])
def server(request, tmp_path, keys_for) -> Iterator[tuple[str, dict[str, str], object]]:
    overrides = {}
    if request.param == "postgresql":
        overrides["database_url"] = request.getfixturevalue("postgres_url")
    settings = make_settings(tmp_path / "data", **overrides)
    key = keys_for(settings)
    with BackgroundServer(settings) as running:
        yield running.url, {"Authorization": f"Bearer {key}"}, settings


@pytest.fixture
def keys_for() -> Callable:
    from cloud.auth import create_key

    def make(settings) -> str:
        db = open_database(settings)
        try:
            return create_key(db, "alice")
        finally:
            db.dispose()

    return make


def deploy(url: str, headers: dict[str, str]) -> int:
    """A new ready version of model "m" (the same bytes each time: compiled once, then reused)."""
    response = httpx.post(
        f"{url}/v1/models", headers=headers, files={"file": ("m.onnx", MODEL)}, data={"name": "m"}, timeout=30
    )
    assert response.status_code == 202, response.text
    number = response.json()["version"]
    for _ in range(600):
        found = httpx.get(f"{url}/v1/models/m", headers=headers).json()
        status = next(v["status"] for v in found["versions"] if v["version"] == number)
        if status == "ready":
            return number
        assert status != "failed", found
        threading.Event().wait(0.1)
    raise AssertionError(f"version {number} did not compile")


def at_once(*calls: Callable[[], httpx.Response]) -> list[httpx.Response]:
    """The calls from as many threads, released together."""
    start = threading.Barrier(len(calls))

    def run(call: Callable[[], httpx.Response]) -> httpx.Response:
        start.wait()
        return call()

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(run, calls))


def test_parallel_alias_moves_and_deletions_are_linearisable(server) -> None:
    url, headers, _ = server
    one, two = deploy(url, headers), deploy(url, headers)

    def put(alias: str, version: int) -> Callable[[], httpx.Response]:
        return lambda: httpx.put(f"{url}/v1/models/m/aliases/{alias}", json={"version": version}, headers=headers)

    assert put("prod", one)().status_code == 200 and put("prod", two)().status_code == 200
    rollback = lambda: httpx.post(f"{url}/v1/models/m/aliases/prod/rollback", headers=headers)
    replies = at_once(*[rollback] * PARALLEL)
    assert Counter(r.status_code for r in replies) == {200: 1, 409: PARALLEL - 1}, [r.text for r in replies]
    assert all("no earlier version" in r.json()["error"]["message"] for r in replies if r.status_code == 409)
    listed = httpx.get(f"{url}/v1/models/m/versions", headers=headers)
    assert listed.status_code == 200, listed.text
    prod = next(a for a in listed.json()["aliases"] if a["alias"] == "prod")
    assert prod["version"] == one and [e["action"] for e in prod["history"]] == ["set", "set", "rollback"]
    assert put("prod", two)().status_code == 200  # promote still works after the storm

    # a new alias, PUT twenty times at once: one creation, the rest find it already there
    replies = at_once(*[put("canary", two)] * PARALLEL)
    assert [r.status_code for r in replies] == [200] * PARALLEL, [r.text for r in replies if r.status_code != 200]
    canary = next(a for a in httpx.get(f"{url}/v1/models/m/versions", headers=headers).json()["aliases"]
                  if a["alias"] == "canary")
    assert canary["version"] == two and len(canary["history"]) == 1

    # an alias pointed at a version while that version is deleted: one of them wins, cleanly
    for _ in range(3):
        doomed = deploy(url, headers)
        delete = lambda n=doomed: httpx.delete(f"{url}/v1/models/m/versions/{n}", headers=headers)
        pointed, deleted = at_once(put("green", doomed), delete)
        outcome = (pointed.status_code, deleted.status_code)
        assert outcome in ((200, 409), (404, 200)), (pointed.text, deleted.text)
        versions = httpx.get(f"{url}/v1/models/m/versions", headers=headers).json()
        green = next((a for a in versions["aliases"] if a["alias"] == "green"), None)
        numbers = {v["version"] for v in versions["versions"]}
        if outcome == (200, 409):
            assert green is not None and green["version"] == doomed and doomed in numbers
            assert httpx.delete(f"{url}/v1/models/m/aliases/green", headers=headers).status_code == 200
            assert httpx.delete(f"{url}/v1/models/m/versions/{doomed}", headers=headers).status_code == 200
        else:
            assert doomed not in numbers and (green is None or green["version"] in numbers)


def test_a_history_with_more_rollbacks_than_moves_still_reads(server) -> None:
    """Databases written before moves were serialised may hold such histories: they read, and
    the alias can still be moved."""
    url, headers, settings = server
    one = deploy(url, headers)
    assert httpx.put(f"{url}/v1/models/m/aliases/prod", json={"version": one}, headers=headers).status_code == 200
    db = open_database(settings)
    try:
        with db.session() as session:
            alias = session.query(ModelAlias).one()
            session.add_all(AliasEvent(alias_id=alias.id, action="rollback", version_id=alias.version_id, version=one)
                            for _ in range(3))
    finally:
        db.dispose()
    listed = httpx.get(f"{url}/v1/models/m/versions", headers=headers)
    assert listed.status_code == 200, listed.text
    rolled = httpx.post(f"{url}/v1/models/m/aliases/prod/rollback", headers=headers)
    assert rolled.status_code == 409 and "no earlier version" in rolled.json()["error"]["message"]
    assert httpx.put(f"{url}/v1/models/m/aliases/prod", json={"version": one}, headers=headers).status_code == 200
