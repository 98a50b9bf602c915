"""Compile jobs on Celery: real `luminal-cloud worker` processes against the local Redis.

The gateway and the workers share a data directory (its SQLite database and object store), as
they share PostgreSQL and S3 in a deployment."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import onnxruntime
import pytest
import redis
from fastapi.testclient import TestClient

from api.main import create_app
from cloud.settings import Settings
from compiler.pipeline import PHASES
from tests.conftest import auth, make_settings, upload, wait_for
from tests.onnx_models import heavy_compile_model, mlp
from tests.processes import ServiceProcess, flushed_redis, free_port
from worker.celery_app import (
    COMPILE_TASK,
    LARGE_PRIORITY,
    WorkerContext,
    compile_lease,
    compile_queue,
    make_celery,
    redelivery_s,
)
from worker.sandbox import CompileHandle

# a Redis database of its own, emptied before each test: queues and leases start empty
REDIS_DB = 11
COMPILE_TIMEOUT_S = 8.0


@pytest.fixture
def redis_url() -> Iterator[str]:
    yield from flushed_redis(REDIS_DB)


def celery_settings(data_dir: Path, redis_url: str, **overrides) -> Settings:
    return make_settings(
        data_dir, compile_backend="celery", redis_url=redis_url, compile_timeout_s=COMPILE_TIMEOUT_S, **overrides
    )


@pytest.fixture
def settings(tmp_path: Path, redis_url: str) -> Settings:
    return celery_settings(tmp_path / "data", redis_url)


def worker_process(settings: Settings, log: Path, *args: str) -> ServiceProcess:
    return ServiceProcess(settings, log, "worker", "--concurrency", "1", *args, ready_text=" ready.")


@pytest.fixture
def start_worker(settings: Settings, tmp_path: Path):
    started: list[ServiceProcess] = []

    def start(*args: str, settings: Settings = settings) -> ServiceProcess:
        worker = worker_process(settings, tmp_path / f"worker-{len(started)}.log", *args)
        started.append(worker)
        worker.wait_ready()
        return worker

    yield start
    for worker in started:
        worker.stop()


def ort(model, x):
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def ready_lines(*workers: ServiceProcess, version_id: int) -> int:
    return sum(w.text().count(f"version {version_id} ready in") for w in workers)


def test_an_upload_compiles_on_a_celery_worker_and_serves(settings, keys, start_worker) -> None:
    metrics_port = free_port()
    worker = start_worker(settings=settings.model_copy(update={"worker_metrics_port": metrics_port}))
    model = mlp()
    with TestClient(create_app(settings)) as client:
        assert type(client.app.state.services.compiler).__name__ == "CeleryCompileQueue"
        upload(client, keys["alice"], "mlp", model.SerializeToString())
        progress: list[dict] = []
        version = wait_for(client, keys["alice"], "mlp", 1, progress=progress)
        assert version["status"] == "ready", version
        # the worker's compile showed its progress while it ran, and shows none once ready
        assert progress and {p["phase"] for p in progress} <= set(PHASES), progress
        assert version["progress"] is None
        x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
        reply = client.post("/v1/models/mlp/infer", headers=auth(keys["alice"]), json={"inputs": {"x": x.tolist()}})
        assert reply.status_code == 200, reply.text
        np.testing.assert_allclose(np.asarray(reply.json()["outputs"]["y"], np.float32), ort(model, x), rtol=1e-5, atol=1e-6)
    assert ready_lines(worker, version_id=1) == 1
    # the worker counts its compiles where Prometheus scrapes it (the gateway compiled nothing)
    scraped = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    assert 'luminal_compiles_total{status="ready"} 1.0' in scraped, scraped
    assert "luminal_compile_seconds_count 1.0" in scraped

    # the task is idempotent: a second message for a compiled version changes nothing, and its
    # result reaches the result backend
    app = make_celery(settings)
    try:
        result = app.send_task(COMPILE_TASK, args=[1], queue=compile_queue("cpu"))
        assert result.get(timeout=30) == "ready"
        del result  # it unsubscribes from its result as it goes, which needs the app still open
        gc.collect()
    finally:
        app.close()
    assert ready_lines(worker, version_id=1) == 1


def test_a_worker_killed_mid_compile_leaves_the_job_to_its_restart_once(settings, keys, start_worker) -> None:
    first = start_worker()
    with TestClient(create_app(settings)) as client:
        upload(client, keys["alice"], "mlp", mlp().SerializeToString())
        deadline = time.monotonic() + 60
        status = "queued"
        while status == "queued" and time.monotonic() < deadline:
            status = client.get("/v1/models/mlp", headers=auth(keys["alice"])).json()["versions"][0]["status"]
            time.sleep(0.01)
        assert status == "compiling", f"the worker did not start the compile (status {status})"
        first.kill()
        killed_at = time.monotonic()
        assert ready_lines(first, version_id=1) == 0, "the compile ended before the kill: nothing was tested"

        second = start_worker()
        # the broker hands the unacknowledged message out again after its visibility timeout
        version = wait_for(client, keys["alice"], "mlp", 1, timeout=redelivery_s(settings) + 60)
        assert version["status"] == "ready", version
        assert time.monotonic() - killed_at < redelivery_s(settings) + 60
    assert ready_lines(first, second, version_id=1) == 1


def test_a_worker_takes_only_the_queues_of_its_targets(tmp_path, redis_url, keys, start_worker) -> None:
    both = celery_settings(tmp_path / "data", redis_url, targets=("cpu", "cuda"))
    start_worker("--targets", "cpu", settings=both)
    with TestClient(create_app(both)) as client:
        upload(client, keys["alice"], "gpu-net", mlp().SerializeToString(), target="cuda")
        upload(client, keys["alice"], "cpu-net", mlp().SerializeToString(), target="cpu")
        assert wait_for(client, keys["alice"], "cpu-net", 1)["status"] == "ready"
        gpu = client.get("/v1/models/gpu-net", headers=auth(keys["alice"])).json()["versions"][0]
        assert gpu["status"] == "queued"
    queued = redis.Redis.from_url(redis_url)
    assert queued.llen(compile_queue("cuda")) == 1
    queued.close()


def test_a_version_leased_by_one_worker_is_not_compiled_by_another(redis_url) -> None:
    client = redis.Redis.from_url(redis_url)

    def context(holder: str) -> WorkerContext:
        return WorkerContext(registry=None, sandbox=None, options={}, redis=client, holder=holder)  # type: ignore[arg-type]

    with compile_lease(context("a"), 7) as first:
        assert first
        with compile_lease(context("b"), 7) as second:
            assert not second
        assert client.get("luminal:compile-lease:7") == b"a"
    assert client.get("luminal:compile-lease:7") is None  # released by its holder
    with compile_lease(context("b"), 7) as again:
        assert again
    client.close()


def test_uploads_while_redis_is_down_compile_once_it_is_back(tmp_path, keys, start_worker) -> None:
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    settings = celery_settings(tmp_path / "data", url)
    server_args = ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no", "--dir", str(tmp_path)]
    with TestClient(create_app(settings)) as client:
        # no Redis yet: the upload is stored and answered, its compile waits in the outbox
        upload(client, keys["alice"], "mlp", mlp().SerializeToString())
        time.sleep(1.0)
        assert client.app.state.services.compiler.pending() == 1
        try:
            redis_server = subprocess.Popen(server_args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        except FileNotFoundError:
            pytest.fail("this test starts its own Redis and needs `redis-server` on PATH")
        try:
            start_worker(settings=settings)
            assert wait_for(client, keys["alice"], "mlp", 1, timeout=60)["status"] == "ready"
            assert client.app.state.services.compiler.pending() == 0
        finally:
            redis_server.terminate()
            redis_server.wait(timeout=10)


def test_the_worker_command_refuses_unreachable_redis_and_unknown_targets(tmp_path) -> None:
    env = {**os.environ, "LUMINAL_DATA_DIR": str(tmp_path), "LUMINAL_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"}
    down = subprocess.run(
        [sys.executable, "-m", "luminal_cloud.cli", "worker"], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert down.returncode == 1
    assert env["LUMINAL_REDIS_URL"] in down.stderr and "unreachable" in down.stderr
    assert "Traceback" not in down.stderr
    unknown = subprocess.run(
        [sys.executable, "-m", "luminal_cloud.cli", "worker", "--targets", "tpu"],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )
    assert unknown.returncode == 1 and "unknown target tpu" in unknown.stderr


def test_deleting_a_model_stops_its_compile_on_the_worker(settings, keys, start_worker) -> None:
    worker = start_worker()
    with TestClient(create_app(settings)) as client:
        # half a minute of compiling, far past the worker's limit if nothing stops it
        upload(client, keys["alice"], "slow", heavy_compile_model(repeats=8).SerializeToString())
        deadline = time.monotonic() + 30
        while client.get("/v1/models/slow", headers=auth(keys["alice"])).json()["versions"][0]["status"] != "compiling":
            assert time.monotonic() < deadline, "the worker did not start the compile"
            time.sleep(0.02)
        deleted_at = time.monotonic()
        assert client.delete("/v1/models/slow", headers=auth(keys["alice"])).status_code == 200
        # the worker's lease renewal sees the deletion and kills the compile's process group
        while "succeeded in" not in worker.text():
            assert time.monotonic() - deleted_at < COMPILE_TIMEOUT_S, "the compile was not stopped"
            time.sleep(0.05)
    assert "succeeded in" in worker.text() and ": None" in worker.text()
    assert "ran longer than the limit" not in worker.text()


def test_small_graphs_are_compiled_before_giants_that_queued_first(settings, keys, start_worker, redis_url) -> None:
    # 25 KB is a giant here, 1 KB small
    small_first = settings.model_copy(update={"compile_small_graph_bytes": 4096})
    with TestClient(create_app(small_first)) as client:
        upload(client, keys["alice"], "giant", mlp(hidden=512).SerializeToString())
        upload(client, keys["bob"], "small", mlp().SerializeToString())
        compiler = client.app.state.services.compiler
        deadline = time.monotonic() + 10
        while compiler.pending():
            assert time.monotonic() < deadline, "the outbox did not send"
            time.sleep(0.02)
        queued = redis.Redis.from_url(redis_url)
        # Redis keeps one list per priority; the worker reads the first (the small graphs') first
        assert queued.llen(compile_queue("cpu")) == 1
        assert queued.llen(f"{compile_queue('cpu')}\x06\x16{LARGE_PRIORITY}") == 1
        queued.close()
        worker = start_worker()
        assert wait_for(client, keys["alice"], "giant", 1)["status"] == "ready"
        assert wait_for(client, keys["bob"], "small", 1)["status"] == "ready"
    log = worker.text()
    assert log.index("version 2 ready in") < log.index("version 1 ready in"), log


def test_the_lease_stops_its_own_compile_once_the_version_is_deleted(redis_url) -> None:
    client = redis.Redis.from_url(redis_url)

    class Deleted:
        def get_version(self, version_id: int) -> None:
            return None

    context = WorkerContext(registry=Deleted(), sandbox=None, options={}, redis=client, holder="a")  # type: ignore[arg-type]
    handle = CompileHandle(7)
    with compile_lease(context, 7, handle) as held:
        assert held
        deadline = time.monotonic() + 10
        while not handle.cancelled:
            assert time.monotonic() < deadline, "the lease did not stop the compile"
            time.sleep(0.05)
    client.close()
