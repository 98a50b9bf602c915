"""The object store on a real S3 endpoint (moto's standalone server, a subprocess on loopback):
the store's contract, paging through more keys than one listing returns, a model uploaded,
compiled and served with its graph and artifact in the bucket, and a clear error when the
endpoint is down or refuses the credentials. Also the spool that uploads stream through."""

from __future__ import annotations

import hashlib
import io
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import boto3
import httpx
import numpy as np
import onnxruntime
import pytest

from cloud.errors import NotFound, PayloadTooLarge, Unreachable
from cloud.s3 import S3ObjectStore
from cloud.settings import Settings
from cloud.storage import make_object_store, spool
from tests.conftest import auth, make_settings, upload, wait_for
from tests.onnx_models import mlp

MLP = mlp().SerializeToString()
# moto accepts any credentials unless asked to check them
CREDENTIALS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def moto_server(**env: str) -> Iterator[str]:
    """moto's S3 server in a subprocess on a free loopback port; yields its URL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            env={**os.environ, **env},
            stdout=log,
            stderr=log,
        )
        try:
            deadline = time.monotonic() + 30
            while not _answers(url):
                if server.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    output = log.read().decode(errors="replace")
                    pytest.fail(
                        f"moto's S3 server did not start on {url} (pip install 'moto[server]'):\n{output}"
                    )
                time.sleep(0.1)
            yield url
        finally:
            server.terminate()
            server.wait(10)


def _answers(url: str) -> bool:
    try:
        httpx.get(f"{url}/moto-api/", timeout=1)
    except httpx.TransportError:
        return False
    return True


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """The URL of an S3 endpoint that runs for the whole session."""
    with moto_server() as url:
        yield url


def s3_settings(data_dir: Path, endpoint: str, **overrides) -> Settings:
    """Settings for a bucket of this test's own."""
    bucket = f"luminal-{uuid.uuid4().hex[:12]}"
    return make_settings(
        data_dir,
        object_store="s3",
        s3_endpoint_url=endpoint,
        s3_bucket=bucket,
        s3_access_key_id=CREDENTIALS["aws_access_key_id"],
        s3_secret_access_key=CREDENTIALS["aws_secret_access_key"],
        **overrides,
    )


def bucket_keys(settings: Settings) -> list[str]:
    """Every key in the settings' bucket, read with a boto3 client of the test's own."""
    client = boto3.client(
        "s3", endpoint_url=settings.s3_endpoint_url, region_name=settings.s3_region, **CREDENTIALS
    )
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=settings.s3_bucket)
    return sorted(item["Key"] for page in pages for item in page.get("Contents", []))


@pytest.fixture
def settings(tmp_path: Path, s3_endpoint: str) -> Settings:
    """The conftest's client and keys, with the objects in a bucket of this test's own."""
    return s3_settings(tmp_path / "data", s3_endpoint)


@pytest.fixture
def store(settings: Settings) -> S3ObjectStore:
    made = make_object_store(settings)
    assert isinstance(made, S3ObjectStore)
    return made


def test_put_get_exists_and_a_missing_key(store: S3ObjectStore, tmp_path: Path) -> None:
    store.put("graphs/a.onnx", b"graph bytes")
    assert store.get("graphs/a.onnx") == b"graph bytes"
    assert store.exists("graphs/a.onnx") and not store.exists("graphs/b.onnx")
    with pytest.raises(NotFound):
        store.get("graphs/b.onnx")

    # a file over the multipart threshold (8 MiB) streams up in parts and reads back whole
    big = np.random.default_rng(0).bytes(9 * 1024 * 1024)
    path = tmp_path / "big.onnx"
    path.write_bytes(big)
    store.put_file("graphs/big.onnx", path)
    assert store.get("graphs/big.onnx") == big


def test_delete_prefix_pages_through_more_keys_than_one_listing(store: S3ObjectStore) -> None:
    client = store.client
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: store.put(f"artifacts/abc/cpu/{i:04d}", b"x"), range(1100)))
    store.put("artifacts/abcd/manifest.json", b"{}")  # shares the prefix's text, not its folder
    store.put("artifacts/abc", b"a file named as the folder")
    store.delete_prefix("artifacts/abc")
    keys = [item["Key"] for item in client.list_objects_v2(Bucket=store.bucket).get("Contents", [])]
    assert keys == ["artifacts/abcd/manifest.json"]
    store.delete_prefix("artifacts/nothing-here")  # deleting nothing is no error


def test_a_model_compiles_and_serves_from_the_bucket_through_the_api(
    client, keys, settings: Settings
) -> None:
    key = keys["alice"]
    upload(client, key, "mlp", MLP)
    assert wait_for(client, key, "mlp", 1)["status"] == "ready"
    x = np.random.default_rng(1).standard_normal((2, 8)).astype(np.float32)
    response = client.post("/v1/models/mlp/infer", headers=auth(key), json={"inputs": {"x": x.tolist()}})
    assert response.status_code == 200, response.text
    expected = onnxruntime.InferenceSession(MLP, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(np.array(response.json()["outputs"]["y"]), expected, rtol=1e-5, atol=1e-6)
    artifact = client.app.state.services.registry.get_version(1).artifact_key

    stored = bucket_keys(settings)
    tenant_id = client.app.state.services.auth(f"Bearer {key}").id
    assert f"graphs/t{tenant_id}/{hashlib.sha256(MLP).hexdigest()}.onnx" in stored
    assert f"{artifact}/manifest.json" in stored
    assert not settings.objects_dir.exists()  # nothing went to the local folder


def test_an_unreachable_endpoint_is_a_clear_error(tmp_path: Path) -> None:
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    settings = s3_settings(tmp_path / "data", endpoint)
    started = time.monotonic()
    with pytest.raises(Unreachable) as error:
        make_object_store(settings)
    assert endpoint in error.value.message and settings.s3_bucket in error.value.message
    assert time.monotonic() - started < 30


def test_refused_credentials_are_a_clear_error(tmp_path: Path) -> None:
    # this server checks every request's access key against its (empty) IAM
    with moto_server(INITIAL_NO_AUTH_ACTION_COUNT="0") as endpoint:
        settings = s3_settings(tmp_path / "data", endpoint)
        with pytest.raises(Unreachable) as error:
            make_object_store(settings)
    assert endpoint in error.value.message and settings.s3_bucket in error.value.message
    assert "LUMINAL_S3_ACCESS_KEY_ID" in error.value.message


def test_the_upload_spool_hashes_what_it_reads_and_stops_past_the_limit() -> None:
    data = np.random.default_rng(2).bytes(3 * 1024 * 1024 + 5)  # several chunks and a tail
    with spool(io.BytesIO(data), max_bytes=len(data)) as spooled:
        assert spooled.path.read_bytes() == data
        assert (spooled.sha256, spooled.size) == (hashlib.sha256(data).hexdigest(), len(data))
    assert not spooled.path.exists()
    with pytest.raises(PayloadTooLarge), spool(io.BytesIO(data), max_bytes=len(data) - 1):
        pass
