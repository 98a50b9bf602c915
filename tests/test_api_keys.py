"""Listing and revoking API keys (issue 29, finding 10): operators see every key (never the key
itself) and revoke one by id or prefix; a key revoked through a gateway is refused by it at once,
cache or not, and one revoked elsewhere within LUMINAL_AUTH_CACHE_TTL_S. An operator's key on a
tenant route is refused as what it is (403), not as an invalid key."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

from api.main import create_app
from api.services import open_database
from cloud.auth import create_admin_key, create_key, list_keys, revoke_admin_key, revoke_key
from cloud.errors import Conflict, NotFound
from tests.conftest import auth, make_settings


@pytest.fixture
def operator(settings) -> dict[str, str]:
    db = open_database(settings)
    try:
        return auth(create_admin_key(db, "ops"))
    finally:
        db.dispose()


def _infer(client: TestClient, key: str, protocol: str = "v1"):
    # a body route: its key is checked before the body is read (api.main.GuardedBody)
    path = "/v1/models/m/infer" if protocol == "v1" else "/v2/models/m/infer"
    return client.post(path, headers=auth(key), json={"inputs": {"x": [[1.0]]}})


def test_operators_list_keys_and_a_revoked_key_gets_401_at_once(client, keys, operator) -> None:
    listed = client.get("/v1/admin/keys", headers=operator)
    assert listed.status_code == 200, listed.text
    rows = listed.json()["keys"]
    assert [(k["tenant"], k["prefix"]) for k in rows] == [("alice", keys["alice"][:10]), ("bob", keys["bob"][:10])]
    assert all(set(k) == {"id", "prefix", "tenant", "created_at"} for k in rows)
    assert keys["alice"] not in listed.text
    only_bob = client.get("/v1/admin/keys", headers=operator, params={"tenant": "bob"}).json()["keys"]
    assert [k["tenant"] for k in only_bob] == ["bob"]
    missing = client.get("/v1/admin/keys", headers=operator, params={"tenant": "carol"})
    assert missing.status_code == 404 and "carol" in missing.json()["error"]["message"]

    # alice's key is in the gateway's cache now, on both kinds of route
    assert client.get("/v1/models", headers=auth(keys["alice"])).status_code == 200
    assert _infer(client, keys["alice"]).status_code == 404  # no model m: but she got in
    alice_id = rows[0]["id"]
    revoked = client.delete(f"/v1/admin/keys/{alice_id}", headers=operator)
    assert revoked.status_code == 200, revoked.text
    assert revoked.json() | {"created_at": None} == {
        "id": alice_id, "prefix": keys["alice"][:10], "tenant": "alice", "created_at": None, "revoked": True
    }
    for response in (
        client.get("/v1/models", headers=auth(keys["alice"])),
        _infer(client, keys["alice"]),
        _infer(client, keys["alice"], "v2"),
    ):
        assert response.status_code == 401, response.text
    assert client.get("/v1/models", headers=auth(keys["bob"])).status_code == 200
    assert [k["tenant"] for k in client.get("/v1/admin/keys", headers=operator).json()["keys"]] == ["bob"]

    again = client.delete(f"/v1/admin/keys/{alice_id}", headers=operator)
    assert again.status_code == 404 and str(alice_id) in again.json()["error"]["message"]
    # by prefix, as listed
    by_prefix = client.delete(f"/v1/admin/keys/{keys['bob'][:10]}", headers=operator)
    assert by_prefix.status_code == 200 and by_prefix.json()["tenant"] == "bob"
    assert client.get("/v1/models", headers=auth(keys["bob"])).status_code == 401


def test_a_prefix_matching_several_keys_is_409_naming_them_and_revokes_none(client, keys, operator) -> None:
    ambiguous = client.delete("/v1/admin/keys/lc_", headers=operator)
    assert ambiguous.status_code == 409, ambiguous.text
    error = ambiguous.json()["error"]
    assert error["code"] == "conflict"
    assert keys["alice"][:10] in error["message"] and keys["bob"][:10] in error["message"]
    assert "alice" in error["message"] and "bob" in error["message"]
    assert len(error["matches"]) == 2
    assert client.get("/v1/models", headers=auth(keys["alice"])).status_code == 200
    assert client.delete("/v1/admin/keys/lc_nosuchkey", headers=operator).status_code == 404


def test_only_operators_manage_keys(client, keys, operator) -> None:
    for response in (
        client.get("/v1/admin/keys", headers=auth(keys["alice"])),
        client.delete("/v1/admin/keys/1", headers=auth(keys["alice"])),
    ):
        assert response.status_code == 403
    assert client.get("/v1/admin/keys").status_code == 401
    assert client.delete("/v1/admin/keys/1").status_code == 401
    assert client.get("/v1/models", headers=auth(keys["alice"])).status_code == 200  # nothing was revoked


def test_an_operator_key_on_a_tenant_route_gets_403_saying_what_it_is(client, keys, operator) -> None:
    operator_key = operator["Authorization"].removeprefix("Bearer ")
    for response in (
        client.get("/v1/models", headers=operator),
        client.get("/v1/usage", headers=operator),
        _infer(client, operator_key),
    ):
        assert response.status_code == 403, response.text
        message = response.json()["error"]["message"]
        assert "operator key" in message and "/v1/admin" in message and "--tenant" in message
    v2 = _infer(client, operator_key, "v2")
    assert v2.status_code == 403 and "operator key" in v2.json()["error"]
    # a key that only looks like an operator's is just invalid
    unknown = client.get("/v1/models", headers=auth("lca_not-a-key"))
    assert unknown.status_code == 401 and unknown.json()["error"]["message"] == "invalid API key"


def test_a_key_revoked_elsewhere_is_refused_once_the_cache_ttl_passes(tmp_path) -> None:
    # the command line, or another gateway, deletes the key: this gateway's cache bounds how long
    ttl = 0.5
    settings = make_settings(tmp_path / "data", auth_cache_ttl_s=ttl)
    db = open_database(settings)
    try:
        key = create_key(db, "alice")
        with TestClient(create_app(settings)) as client:
            assert client.get("/v1/models", headers=auth(key)).status_code == 200  # cached from here
            revoke_key(db, key[:10])
            time.sleep(ttl)
            assert client.get("/v1/models", headers=auth(key)).status_code == 401
    finally:
        db.dispose()


def test_revoking_by_id_prefix_or_the_key_itself(settings) -> None:
    db = open_database(settings)
    try:
        first, second, third = (create_key(db, "alice") for _ in range(3))
        ids = {k.prefix: k.id for k in list_keys(db, "alice")}
        assert revoke_key(db, str(ids[first[:10]])).prefix == first[:10]
        assert revoke_key(db, second[:10]).id == ids[second[:10]]
        assert revoke_key(db, third).prefix == third[:10]  # the whole key, pasted
        assert list_keys(db, "alice") == []
        with pytest.raises(NotFound):
            revoke_key(db, third)
        # prefixes compare exactly: SQLite's LIKE would ignore case
        fourth = create_key(db, "alice")
        with pytest.raises(NotFound):
            revoke_key(db, fourth[:10].upper())
        create_key(db, "bob")
        with pytest.raises(Conflict, match="matches 2 tenant keys"):
            revoke_key(db, "lc_")
        admin = create_admin_key(db, "ops")
        with pytest.raises(NotFound):
            revoke_key(db, admin[:10])  # tenant keys and operator keys are apart
        assert revoke_admin_key(db, admin[:10]).owner == "ops"
    finally:
        db.dispose()
