"""Versions and aliases against a live server: an alias that inference resolves on /v1 and KServe
v2, promote and rollback with the alias's history, deleting one version, and the 409s that keep
traffic off failed, unfinished and deleted versions."""

from __future__ import annotations

import asyncio
import io
import time

import httpx
import numpy as np
import onnxruntime
import pytest

from api.server import BackgroundServer
from api.services import open_database
from cloud.db import Database, ModelVersion, Tenant
from cloud.storage import artifacts_prefix, make_object_store
from luminal_cloud import AsyncClient, Client, Conflict, InvalidRequest, NotFound
from registry import RESOLVE_CACHE_S, Registry
from tests.onnx_models import mlp, unsupported_model

V1, V2 = mlp(seed=0).SerializeToString(), mlp(seed=1).SerializeToString()
X = np.random.default_rng(0).standard_normal((2, 8)).astype(np.float32)


def expected(model: bytes) -> np.ndarray:
    return onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": X})[0]


def close(got, model: bytes) -> bool:
    return np.allclose(np.asarray(got, dtype=np.float32), expected(model), rtol=1e-5, atol=1e-6)


@pytest.fixture
def server(settings, keys):
    with BackgroundServer(settings) as running:
        yield running


@pytest.fixture
def alice(server, keys):
    with Client(server.url, keys["alice"]) as client:
        yield client


@pytest.fixture
def two_versions(alice) -> Client:
    """Model "m": v1 and v2 are different networks with the same signature."""
    assert alice.deploy(V1, "m", progress=False)["status"] == "ready"
    assert alice.deploy(V2, "m", progress=False)["status"] == "ready"
    return alice


def infer_y(client: Client, version) -> tuple[int, list]:
    reply = client.infer("m", {"x": X}, version=version)
    return reply["version"], reply["outputs"]["y"]


def test_infer_follows_an_alias_through_promote_and_rollback(two_versions: Client) -> None:
    client = two_versions
    alias = client.set_alias("m", "prod", 1)
    assert (alias["version"], alias["previous"], [e["action"] for e in alias["history"]]) == (1, None, ["set"])
    version, y = infer_y(client, "prod")
    assert version == 1 and close(y, V1)
    # the binary KServe v2 path, /v2/models/m/versions/prod/infer
    assert np.allclose(client.predict("m", {"x": X}, version="prod")["y"], expected(V1), rtol=1e-5, atol=1e-6)
    assert infer_y(client, None)[0] == 2  # no version: still the newest ready one

    promoted = client.promote("m", "prod", 2)
    assert (promoted["version"], promoted["previous"]) == (2, 1)
    version, y = infer_y(client, "prod")  # at once: the server's cache is cleared by the move
    assert version == 2 and close(y, V2)
    assert np.allclose(client.predict("m", {"x": X}, version="prod")["y"], expected(V2), rtol=1e-5, atol=1e-6)

    rolled = client.rollback("m", "prod")
    assert (rolled["version"], rolled["previous"]) == (1, None)
    assert [(e["action"], e["version"]) for e in rolled["history"]] == [("set", 1), ("set", 2), ("rollback", 1)]
    version, y = infer_y(client, "prod")
    assert version == 1 and close(y, V1)
    with pytest.raises(Conflict, match="no earlier version"):
        client.rollback("m", "prod")

    client.set_alias("m", "canary", 2)
    listed = client.versions("m")
    assert [(v["version"], v["status"], v["aliases"]) for v in listed["versions"]] == [
        (1, "ready", ["prod"]),
        (2, "ready", ["canary"]),
    ]
    assert {a["alias"]: a["version"] for a in listed["aliases"]} == {"canary": 2, "prod": 1}
    assert all(v["created_at"] for v in listed["versions"])

    client.delete_alias("m", "canary")
    assert [v["aliases"] for v in client.versions("m")["versions"]] == [["prod"], []]
    with pytest.raises(NotFound, match="no alias 'canary'"):
        client.infer("m", {"x": X}, version="canary")


def test_deleting_a_version_an_alias_points_at_is_refused_naming_the_alias(two_versions: Client) -> None:
    client = two_versions
    client.promote("m", "prod", 1)
    client.promote("m", "prod", 2)
    client.set_alias("m", "canary", 2)
    with pytest.raises(Conflict, match="'canary', 'prod'") as refused:
        client.delete_version("m", 2)
    assert refused.value.status == 409

    assert client.delete_version("m", 1) == {"model": "m", "version": 1, "deleted": True}
    assert [v["version"] for v in client.versions("m")["versions"]] == [2]
    with pytest.raises(NotFound, match="no version 1"):
        client.infer("m", {"x": X}, version=1)
    # prod pointed at v1 before v2: that version is gone, and the 409 names it
    with pytest.raises(Conflict, match="version 1 before, which was deleted"):
        client.rollback("m", "prod")
    # a deleted version's number is not given again
    assert client.deploy(V1, "m", progress=False)["version"] == 3


def test_an_alias_takes_only_a_ready_version(two_versions: Client, settings) -> None:
    client = two_versions
    failed = client.deploy(unsupported_model().SerializeToString(), "m", wait=False, progress=False)["version"]
    with pytest.raises(Exception, match="failed to compile"):
        client.wait("m", failed)
    with pytest.raises(Conflict, match=f"version {failed} of model 'm': it is failed") as refused:
        client.set_alias("m", "prod", failed)
    assert refused.value.status == 409

    # a version still queued (a registry of its own, whose uploads nobody compiles) may yet fail
    db = open_database(settings)
    try:
        registry = Registry(db, make_object_store(settings), settings.targets)
        queued = registry.create_version(_tenant_id(db, "alice"), "m", io.BytesIO(V1), "cpu").number
    finally:
        db.dispose()
    with pytest.raises(Conflict, match=f"version {queued} of model 'm': it is queued"):
        client.set_alias("m", "prod", queued)
    statuses = {v["version"]: v["status"] for v in client.versions("m")["versions"]}
    assert statuses == {1: "ready", 2: "ready", failed: "failed", queued: "queued"}

    with pytest.raises(InvalidRequest, match="alias 'Prod!' is invalid"):
        client.set_alias("m", "Prod!", 1)
    with pytest.raises(NotFound, match="no version 99"):
        client.set_alias("m", "prod", 99)
    with pytest.raises(NotFound, match="model 'nope' not found"):
        client.set_alias("nope", "prod", 1)
    with pytest.raises(NotFound, match="no alias 'prod'"):
        client.rollback("m", "prod")


def test_bad_version_references_on_v1_and_v2(two_versions: Client, server, keys) -> None:
    headers = {"Authorization": f"Bearer {keys['alice']}"}
    body = {"inputs": {"x": X.tolist()}}
    for ref, status in (("0", 400), ("Prod!", 400), ("prod", 404), ("7", 404)):
        response = httpx.post(f"{server.url}/v1/models/m/infer", params={"version": ref}, json=body, headers=headers)
        assert response.status_code == status, (ref, response.text)
    v2 = {"inputs": [{"name": "x", "shape": list(X.shape), "datatype": "FP32", "data": X.ravel().tolist()}]}
    response = httpx.post(f"{server.url}/v2/models/m/versions/prod/infer", json=v2, headers=headers)
    assert response.status_code == 404 and "no alias 'prod'" in response.json()["error"]
    two_versions.set_alias("m", "prod", 2)
    response = httpx.post(f"{server.url}/v2/models/m/versions/prod/infer", json=v2, headers=headers)
    assert response.status_code == 200 and response.json()["model_version"] == "2"
    metadata = httpx.get(f"{server.url}/v2/models/m/versions/prod", headers=headers).json()
    assert metadata["inputs"][0]["name"] == "x"
    # an alias is the tenant's own: bob's model of the same name knows nothing of alice's
    response = httpx.post(
        f"{server.url}/v1/models/m/infer", params={"version": "prod"}, json=body,
        headers={"Authorization": f"Bearer {keys['bob']}"},
    )
    assert response.status_code == 404


def test_an_alias_moved_by_another_process_shows_within_the_cache_time(two_versions: Client, settings) -> None:
    client = two_versions
    client.set_alias("m", "prod", 1)
    assert infer_y(client, "prod")[0] == 1  # now remembered by the server for RESOLVE_CACHE_S
    db = open_database(settings)
    try:  # another gateway's registry: the server's cache is not told
        Registry(db, make_object_store(settings), settings.targets).set_alias(_tenant_id(db, "alice"), "m", "prod", 2)
    finally:
        db.dispose()
    moved = time.monotonic()
    while True:
        sent = time.monotonic()  # (when a request was sent, not when its answer came: a loaded machine is slow to answer)
        if infer_y(client, "prod")[0] == 2:
            break
        assert sent - moved < RESOLVE_CACHE_S + 0.25, "a stale alias served to a request sent past the cache time"
        time.sleep(0.05)


def test_deleting_versions_frees_what_no_other_version_uses(alice: Client, settings) -> None:
    alice.deploy(V1, "m", progress=False)
    alice.deploy(V1, "m", progress=False)  # the same graph: one blob, one artifact
    db = open_database(settings)
    try:
        with db.session() as session:
            key = session.query(ModelVersion.graph_key).first()[0]
    finally:
        db.dispose()
    store = make_object_store(settings)
    artifacts = settings.objects_dir / artifacts_prefix(key)
    assert store.exists(key) and artifacts.exists()
    alice.delete_version("m", 1)
    assert store.exists(key) and artifacts.exists()  # v2 still uses them
    assert infer_y(alice, None)[0] == 2
    alice.delete_version("m", 2)  # the last version: the model goes with it
    assert not store.exists(key) and not artifacts.exists()
    assert alice.models() == []
    with pytest.raises(NotFound):
        alice.versions("m")


def test_the_async_client_has_the_same_verbs(two_versions: Client, server, keys) -> None:
    async def run() -> tuple[dict, dict, dict]:
        async with AsyncClient(server.url, keys["alice"]) as client:
            promoted = await client.promote("m", "prod", 2)
            rolled = await client.set_alias("m", "prod", 1)
            return promoted, rolled, await client.versions("m")

    promoted, moved, listed = asyncio.run(run())
    assert (promoted["version"], moved["version"], moved["previous"]) == (2, 1, 2)
    assert listed["versions"][0]["aliases"] == ["prod"]


def _tenant_id(db: Database, name: str) -> int:
    with db.session() as session:
        return session.query(Tenant.id).filter(Tenant.name == name).scalar()
