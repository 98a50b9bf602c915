"""Through a real uvicorn socket: the SDK, batching under concurrency, a full queue, the CLI."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import onnxruntime
import pytest

from api.demo import run_demo
from api.server import BackgroundServer
from api.services import DataDirInUse, build_services, open_database
from cloud.auth import authenticate, create_key
from luminal_cloud import APIError, Client, DeployFailed
from tests.conftest import FIXTURES, make_settings
from tests.onnx_models import mlp, unsupported_model


@pytest.fixture
def server(settings, keys):
    with BackgroundServer(settings) as running:
        yield running


def ort(path, inputs):
    return onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, inputs)[0]


@pytest.mark.parametrize(("fixture", "shape"), [("torch_mlp.onnx", (20,)), ("torch_cnn.onnx", (1, 12, 12))])
def test_concurrent_requests_batch_and_split_correctly(server, keys, fixture, shape) -> None:
    path = FIXTURES / fixture
    rng = np.random.default_rng(3)
    payloads = [rng.standard_normal((1 + i % 3, *shape)).astype(np.float32) for i in range(24)]
    with Client(server.url, keys["alice"]) as client:
        assert client.deploy(path, name="net")["status"] == "ready"
        with ThreadPoolExecutor(max_workers=12) as pool:
            replies = list(pool.map(lambda x: client.infer("net", {"input": x}), payloads))
        for x, reply in zip(payloads, replies):
            got = np.asarray(reply["outputs"]["output"], np.float32)
            np.testing.assert_allclose(got, ort(path, {"input": x}), rtol=1e-4, atol=1e-5)
        assert max(r["usage"]["batch_size"] for r in replies) > 1
        predicted = client.predict("net", {"input": payloads[0]})["output"]
        assert predicted.dtype == np.float32 and predicted.shape[0] == payloads[0].shape[0]
        bill = client.usage()
        assert bill["items"][0]["requests"] == 25
        assert bill["items"][0]["rows"] == sum(x.shape[0] for x in payloads) + payloads[0].shape[0]


def test_sdk_raises_server_errors_with_their_message(server, keys, tmp_path) -> None:
    with Client(server.url, keys["alice"]) as client:
        with pytest.raises(APIError) as missing:
            client.predict("ghost", {"x": np.zeros((1, 8), np.float32)})
        assert missing.value.status == 404 and missing.value.message == "model 'ghost' not found"
        bad = tmp_path / "exotic.onnx"
        bad.write_bytes(unsupported_model().SerializeToString())
        with pytest.raises(DeployFailed, match="NonZero, Unique"):
            client.deploy(bad, name="exotic")
    with Client(server.url, "lc_not_a_key") as stranger, pytest.raises(APIError) as denied:
        stranger.models()
    assert denied.value.status == 401


def test_full_queue_answers_429_with_retry_after(tmp_path, keys) -> None:
    # a fixed batching window: the first request waits in the queue for company
    settings = make_settings(
        tmp_path / "data", max_queue_requests=1, max_queue_delay_ms=1500, max_batch_rows=64, adaptive_batching=False
    )
    model = tmp_path / "mlp.onnx"
    model.write_bytes(mlp().SerializeToString())
    db = open_database(settings)
    key = create_key(db, "carol")
    db.dispose()
    with BackgroundServer(settings) as server, Client(server.url, key) as client:
        client.deploy(model, name="mlp")
        first = threading.Thread(target=client.infer, args=("mlp", {"x": np.zeros((1, 8), np.float32)}))
        first.start()
        time.sleep(0.3)  # the first request now waits in the queue for company
        response = httpx.post(
            f"{server.url}/v1/models/mlp/infer",
            headers={"Authorization": f"Bearer {key}"},
            json={"inputs": {"x": [[0.0] * 8]}},
        )
        first.join()
    assert response.status_code == 429
    assert response.headers["Retry-After"] == str(settings.retry_after_s)
    assert "queue" in response.json()["error"]["message"]


def run_cli(*args: str, env: dict) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "luminal_cloud.cli", *args], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_cli_create_key_deploy_and_predict(settings, tmp_path) -> None:
    env = {**os.environ, "LUMINAL_DATA_DIR": str(settings.data_dir)}
    key = run_cli("admin", "create-key", "--tenant", "dave", env=env).split()[-1]
    assert key.startswith("lc_")
    x = np.random.default_rng(0).standard_normal((2, 20)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    with BackgroundServer(settings) as server:
        env = {**env, "LUMINAL_URL": server.url, "LUMINAL_API_KEY": key}
        deployed = run_cli("deploy", str(FIXTURES / "torch_mlp.onnx"), "--name", "m", "--json", env=env)
        assert json.loads(deployed)["status"] == "ready"
        out = run_cli("predict", "m", "--input", f"input={tmp_path / 'x.npy'}", "--output-dir", str(tmp_path), env=env)
    assert "output: float32[2, 5]" in out
    np.testing.assert_allclose(np.load(tmp_path / "output.npy"), ort(FIXTURES / "torch_mlp.onnx", {"input": x}), rtol=1e-4)


def test_demo_prints_outputs_batches_and_bill_and_leaves_a_sample_to_try(settings, capsys, tmp_path) -> None:
    run_demo(settings, requests=12, sample_dir=tmp_path / "sample")
    out = capsys.readouterr().out
    assert "12 concurrent requests: all match onnxruntime" in out
    # one entry per batch, not per request: the sizes of the batches add up to the requests
    ran = re.search(r"they ran in (\d+) batches: (.*)", out)
    assert ran is not None, out
    sizes = [(int(n), int(k)) for n, k in re.findall(r"(\d+) of (\d+) request", ran.group(2))]
    assert sum(n for n, _ in sizes) == int(ran.group(1)) and sum(n * k for n, k in sizes) == 12
    assert "bill for tenant 'demo'" in out and "demo-mlp" in out
    # what the README's "Using it" deploys and predicts with
    model, features = tmp_path / "sample" / "demo-mlp.onnx", tmp_path / "sample" / "features.npy"
    assert f"luminal-cloud predict mlp --input features={features}" in out
    expected = ort(model, {"features": np.load(features)})
    assert expected.shape == (2, 10)


def test_batches_are_counted_once_each() -> None:
    from api.demo import batches_by_size

    assert batches_by_size([1, 3, 3, 3, 2, 2, 3, 3, 3]) == {1: 1, 2: 1, 3: 2}


def test_versions_left_unfinished_compile_after_a_restart(settings, keys) -> None:
    services = build_services(settings)  # a server that accepted an upload, then died
    tenant_model = mlp().SerializeToString()
    tenant = authenticate(services.db, f"Bearer {keys['alice']}")
    version = services.registry.create_version(tenant.id, "orphan", io.BytesIO(tenant_model), "cpu")
    services.close()
    with BackgroundServer(settings) as server, Client(server.url, keys["alice"]) as client:
        assert client.wait("orphan", version.number, timeout=30)["status"] == "ready"


def _send_head(url: str, path: str, headers: dict[str, str], body: bytes = b"") -> tuple[int, bytes]:
    """Sends a request's head (and `body`, maybe less than Content-Length says) on a raw socket and
    returns the status and body the server answers with, without sending the rest."""
    import socket

    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        lines = [f"POST {path} HTTP/1.1", f"Host: {host}", *(f"{k}: {v}" for k, v in headers.items()), "", ""]
        sock.sendall("\r\n".join(lines).encode() + body)
        reply = b""
        while b"\r\n\r\n" not in reply or len(reply.split(b"\r\n\r\n", 1)[1]) < int(
            next((line.split(b":")[1] for line in reply.split(b"\r\n") if line.lower().startswith(b"content-length")), b"0")
        ):
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
    status = int(reply.split(b" ", 2)[1])
    return status, reply.split(b"\r\n\r\n", 1)[1]


def test_a_request_without_a_key_is_refused_before_its_body_arrives(server) -> None:
    # 100 MB announced, none of it sent: the answer must not wait for it
    started = time.monotonic()
    status, body = _send_head(
        server.url, "/v1/models/mlp/infer", {"Content-Type": "application/json", "Content-Length": str(100 << 20)}
    )
    assert status == 401 and b"Authorization" in body
    assert time.monotonic() - started < 5
    status, _ = _send_head(
        server.url, "/v1/models", {"Content-Type": "multipart/form-data; boundary=x", "Content-Length": str(100 << 20),
                                   "Authorization": "Bearer lc_wrong"},
    )
    assert status == 401


def test_infer_bodies_have_their_own_smaller_limit(server, keys, settings) -> None:
    limit = settings.max_infer_body_bytes
    assert limit < settings.max_upload_bytes
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {keys['alice']}"}
    status, body = _send_head(server.url, "/v1/models/mlp/infer", {**headers, "Content-Length": str(limit + 1)})
    assert status == 413 and str(limit).encode() in body
    # a chunked body that grows past the limit is cut off as well
    chunk = b"[" + b"0," * (1 << 19)
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(limit // len(chunk) + 2))
    status, body = _send_head(server.url, "/v1/models/mlp/infer", {**headers, "Transfer-Encoding": "chunked"}, chunked)
    assert status == 413


def test_a_second_server_on_the_same_data_directory_stops_before_any_work(settings, keys) -> None:
    with BackgroundServer(settings):
        with pytest.raises(DataDirInUse, match=str(settings.data_dir)):
            build_services(settings)
        env = {**os.environ, "LUMINAL_DATA_DIR": str(settings.data_dir)}
        second = subprocess.run(
            [sys.executable, "-m", "luminal_cloud.cli", "serve", "--port", "0"],
            env=env, capture_output=True, text=True, timeout=60, check=False,
        )
        assert second.returncode != 0
        assert "another Luminal Cloud server is using" in second.stderr
    build_services(settings).close()  # free again once the first has stopped
