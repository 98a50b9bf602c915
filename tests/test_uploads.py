"""What an upload may cost the gateway: bounded memory whatever the model's size (the file is
spooled to disk, checked in a child process and streamed to the store and to the compile), a
bounded number in flight per tenant (429 with Retry-After before the body is read), and quotas
on a tenant's models and a model's versions (403 naming the quota)."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from onnx import numpy_helper

from api.server import BackgroundServer, free_port
from api.services import open_database
from cloud.auth import create_key
from tests.conftest import auth, make_settings, upload
from tests.onnx_models import mlp, unsupported_model
from tests.processes import ServiceProcess

MB = 1024 * 1024


def peak_rss_bytes(pid: int) -> int:
    """The process's resident-set high-water mark (VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc")


def big_model(megabytes: int) -> bytes:
    """A model the parser accepts and the compiler refuses at once, carrying `megabytes` of weights."""
    model = unsupported_model()
    weights = np.random.default_rng(0).standard_normal(megabytes * MB // 4).astype(np.float32)
    model.graph.initializer.append(numpy_helper.from_array(weights, "unused"))
    return model.SerializeToString()


def wait_until_done(url: str, key: str, name: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        version = httpx.get(f"{url}/v1/models/{name}", headers=auth(key)).json()["versions"][-1]
        if version["status"] in ("ready", "failed"):
            return version
        time.sleep(0.1)
    raise AssertionError(f"{name} did not finish compiling")


def test_a_large_upload_costs_the_gateway_a_fraction_of_its_size(tmp_path) -> None:
    settings = make_settings(tmp_path / "data", max_upload_bytes=200 * MB)
    db = open_database(settings)
    key = create_key(db, "alice")
    db.dispose()
    port = free_port()
    server = ServiceProcess(settings, tmp_path / "serve.log", "serve", "--port", str(port),
                            ready_text="Application startup complete")
    url = f"http://127.0.0.1:{port}"
    try:
        server.wait_ready()
        # a small upload first: what every upload imports and allocates once is in the baseline
        for name, data in (("small", big_model(1)), ("large", big_model(64))):
            if name == "large":
                before = peak_rss_bytes(server.process.pid)
            reply = httpx.post(f"{url}/v1/models", headers=auth(key), data={"name": name},
                               files={"file": ("m.onnx", data)}, timeout=120)
            assert reply.status_code == 202, reply.text
            failed = wait_until_done(url, key, name)
            assert failed["status"] == "failed" and "Unique" in failed["error"]
        grown = peak_rss_bytes(server.process.pid) - before
        # parsing it in the gateway took about twice its size, holding it for the compile once more
        assert grown < 16 * MB, f"the gateway's peak memory grew by {grown / MB:.0f} MB for a 64 MB upload"
    finally:
        server.stop()


class SlowUpload:
    """An upload whose headers are sent and whose body is not, holding its slot."""

    def __init__(self, port: int, key: str) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        head = (
            "POST /v1/models HTTP/1.1\r\nHost: x\r\n"
            f"Authorization: Bearer {key}\r\n"
            "Content-Type: multipart/form-data; boundary=b\r\nContent-Length: 100000\r\n\r\n--b\r\n"
        )
        self.sock.sendall(head.encode())

    def close(self) -> None:
        self.sock.close()


def test_a_tenant_has_at_most_its_uploads_in_flight_and_others_are_not_held_up(settings, keys) -> None:
    assert settings.max_uploads_per_tenant == 2
    with BackgroundServer(settings) as server:
        held = [SlowUpload(server.port, keys["alice"]) for _ in range(2)]
        try:
            time.sleep(0.3)  # both are inside the app, reading their bodies
            files = {"file": ("m.onnx", mlp().SerializeToString())}
            refused = httpx.post(f"{server.url}/v1/models", headers=auth(keys["alice"]), data={"name": "m"},
                                 files=files)
            assert refused.status_code == 429, refused.text
            assert refused.headers["Retry-After"] == "5"
            assert "2 uploads in flight" in refused.json()["error"]["message"]
            # another tenant is not held up by alice's uploads
            other = httpx.post(f"{server.url}/v1/models", headers=auth(keys["bob"]), data={"name": "m"}, files=files)
            assert other.status_code == 202, other.text
        finally:
            for upload_ in held:
                upload_.close()
        deadline = time.monotonic() + 10
        while True:  # the slots come back once the server sees the clients gone
            again = httpx.post(f"{server.url}/v1/models", headers=auth(keys["alice"]), data={"name": "m"},
                               files={"file": ("m.onnx", mlp().SerializeToString())})
            if again.status_code == 202 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert again.status_code == 202, again.text


@pytest.fixture
def quota_client(tmp_path):
    from fastapi.testclient import TestClient

    from api.main import create_app

    settings = make_settings(tmp_path / "data", max_models_per_tenant=2, max_versions_per_model=2)
    db = open_database(settings)
    key = create_key(db, "alice")
    db.dispose()
    with TestClient(create_app(settings)) as client:
        yield client, key


def test_quotas_on_models_and_versions_are_403_naming_the_quota(quota_client) -> None:
    client, key = quota_client
    data = mlp().SerializeToString()
    upload(client, key, "a", data)
    upload(client, key, "a", data)
    upload(client, key, "b", data)

    def refused(name: str) -> dict:
        response = client.post("/v1/models", headers=auth(key), files={"file": ("m.onnx", data)}, data={"name": name})
        assert response.status_code == 403, response.text
        return response.json()["error"]

    error = refused("c")
    assert (error["code"], error["quota"], error["limit"]) == ("quota_exceeded", "models", 2)
    assert "past its quota of 2" in error["message"]
    error = refused("a")
    assert error["quota"] == "versions" and "already keeps 2 versions" in error["message"]
    assert client.delete("/v1/models/a/versions/1", headers=auth(key)).status_code == 200
    upload(client, key, "a", data)  # room again
    assert client.delete("/v1/models/b", headers=auth(key)).status_code == 200
    upload(client, key, "c", data)



def test_a_check_that_fails_unexpectedly_is_a_400_naming_it(tmp_path) -> None:
    """An exception the checker did not expect (here: a file gone before its child reads it)
    is named in the refusal, not reported as a crash of the parser."""
    from cloud.errors import InvalidModelFile
    from registry.checks import CheckInChild

    with pytest.raises(InvalidModelFile, match=r"could not be checked: the checker failed on it \(FileNotFoundError\)"):
        CheckInChild(memory_bytes=4 * 1024**3)(tmp_path / "gone.onnx")
    graph = tmp_path / "m.onnx"
    graph.write_bytes(mlp().SerializeToString())
    CheckInChild(memory_bytes=4 * 1024**3)(graph)  # a usable model passes


def test_a_check_child_that_ends_while_it_is_stopped_still_gets_a_4xx(tmp_path, monkeypatch) -> None:
    """A check past its time is killed; a child that ended just before (already reaped by the
    forkserver: the kill finds no process) must not turn the refusal into a 500."""
    import os

    from cloud.errors import InvalidModelFile
    from registry import checks

    kill = os.kill

    def kill_after_it_ended(pid: int, sig: int) -> None:
        kill(pid, sig)
        raise ProcessLookupError(3, "No such process")

    monkeypatch.setattr(checks.os, "kill", kill_after_it_ended)
    graph = tmp_path / "m.onnx"
    graph.write_bytes(mlp().SerializeToString())
    with pytest.raises(InvalidModelFile, match="took longer than"):
        checks.CheckInChild(memory_bytes=4 * 1024**3, timeout_s=0.0)(graph)
