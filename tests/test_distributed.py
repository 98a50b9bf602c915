"""The distributed path with real processes: a gateway (uvicorn) that runs no model, Celery
compile workers, `luminal-cloud runtime` processes reading Redis Streams, the ledger fed by
usage events. The processes share a data directory (database and object store) and a Redis."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import onnxruntime
import pytest
import redis
from sqlalchemy import select

from api.server import BackgroundServer
from api.services import open_database
from cloud.auth import create_key
from cloud.db import UsageRecord
from cloud.settings import Settings
from luminal_cloud import Client
from scheduler import wire
from tests.conftest import make_settings
from tests.onnx_models import mlp
from tests.processes import ServiceProcess, flushed_redis, free_port

REDIS_DB = 12
MODEL = mlp()


@pytest.fixture
def redis_url() -> Iterator[str]:
    yield from flushed_redis(REDIS_DB)


def distributed_settings(data_dir: Path, redis_url: str, **overrides) -> Settings:
    values = {
        "request_queue": "redis",
        "compile_backend": "celery",
        "redis_url": redis_url,
        "compile_timeout_s": 20.0,
        "max_batch_rows": 4,
        "runtime_heartbeat_s": 0.5,
        "runtime_claim_idle_s": 2.0,
        "request_timeout_s": 10.0,
    }
    values.update(overrides)
    return make_settings(data_dir, **values)


class Stack:
    """Starts the processes of one test and stops them at its end."""

    def __init__(self, settings: Settings, logs: Path) -> None:
        self.settings = settings
        self.logs = logs
        self.processes: list[ServiceProcess] = []
        db = open_database(settings)
        self.key = create_key(db, "alice")
        db.dispose()

    def start(self, *args: str, ready_text: str) -> ServiceProcess:
        process = ServiceProcess(self.settings, self.logs / f"{args[0]}-{len(self.processes)}.log", *args, ready_text=ready_text)
        self.processes.append(process)
        process.wait_ready()
        return process

    def worker(self) -> ServiceProcess:
        return self.start("worker", "--concurrency", "1", ready_text=" ready.")

    def runtime(self) -> ServiceProcess:
        return self.start("runtime", "--device", "cpu", ready_text="serving device cpu")

    def close(self) -> None:
        for process in self.processes:
            process.stop()


def reference(x: np.ndarray) -> np.ndarray:
    session = onnxruntime.InferenceSession(MODEL.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def post(http: httpx.Client, key: str, x: np.ndarray) -> httpx.Response:
    return http.post(
        "/v1/models/mlp/infer", headers={"Authorization": f"Bearer {key}"}, json={"inputs": {"x": x.tolist()}}
    )


def ledger_ids(settings: Settings) -> list[str]:
    db = open_database(settings)
    try:
        with db.session() as session:
            return list(session.scalars(select(UsageRecord.request_id)))
    finally:
        db.dispose()


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def runtime_id(process: ServiceProcess) -> str:
    return process.text().split("runtime ", 1)[1].split(" serving", 1)[0]


def test_requests_run_batched_on_two_runtime_processes(tmp_path, redis_url) -> None:
    # heartbeats every second: a runtime stalled for a moment below stays alive to the gateway
    stack = Stack(distributed_settings(tmp_path / "data", redis_url, runtime_heartbeat_s=1.0), tmp_path)
    try:
        _batched_on_two_runtimes(stack)
    finally:
        stack.close()


def _batched_on_two_runtimes(stack: Stack) -> None:
    stack.worker()
    runtimes = [stack.runtime(), stack.runtime()]
    rng = np.random.default_rng(1)
    payloads = [rng.standard_normal((1 + i % 2, 8)).astype(np.float32) for i in range(96)]
    placement = redis.Redis.from_url(stack.settings.redis_url)
    with BackgroundServer(stack.settings) as server:
        with Client(server.url, stack.key) as client:
            assert client.deploy(MODEL.SerializeToString(), name="mlp")["status"] == "ready"
        with httpx.Client(base_url=server.url, timeout=30) as http, ThreadPoolExecutor(max_workers=24) as pool:
            assert post(http, stack.key, payloads[0]).status_code == 200
            placed = {m.decode() for m in placement.smembers(wire.placement_key(1))}
            assert len(placed) == 1
            # the runtime it is on stalls for a moment: the backlog grows past two batches, and
            # the gateway spreads the version to the other runtime
            busy = next(r for r in runtimes if runtime_id(r) in placed)
            busy.signal(signal.SIGSTOP)
            pending = [pool.submit(post, http, stack.key, x) for x in payloads]
            try:
                wait_until(lambda: len(placement.smembers(wire.placement_key(1))) == 2, 2.5, "no spread")
            finally:
                busy.signal(signal.SIGCONT)
            replies = [future.result() for future in pending]
        for x, reply in zip(payloads, replies):
            assert reply.status_code == 200, reply.text
            np.testing.assert_allclose(np.asarray(reply.json()["outputs"]["y"], np.float32), reference(x), rtol=1e-5, atol=1e-6)
        assert max(r.json()["usage"]["batch_size"] for r in replies) > 1
        assert {m.decode() for m in placement.smembers(wire.placement_key(1))} == {runtime_id(r) for r in runtimes}
        ok_ids = {r.headers["X-Request-ID"] for r in replies}
        wait_until(lambda: len(ledger_ids(stack.settings)) >= len(ok_ids) + 1, 20, "usage events did not reach the ledger")
        assert set(ok_ids) <= set(ledger_ids(stack.settings)) and len(ledger_ids(stack.settings)) == len(ok_ids) + 1
    placement.close()
    assert all("Traceback" not in r.text() for r in runtimes)


def test_a_request_past_its_deadline_is_answered_504_and_never_run(tmp_path, redis_url) -> None:
    stack = Stack(distributed_settings(tmp_path / "data", redis_url, request_timeout_s=1.0, max_queue_requests=3), tmp_path)
    try:
        stack.worker()
        runtime = stack.runtime()
        with BackgroundServer(stack.settings) as server:
            with Client(server.url, stack.key) as client:
                assert client.deploy(MODEL.SerializeToString(), name="mlp")["status"] == "ready"
            x = np.ones((1, 8), np.float32)
            with httpx.Client(base_url=server.url, timeout=30) as http:
                assert post(http, stack.key, x).status_code == 200  # placed, loaded
                runtime.signal(signal.SIGSTOP)  # alive to its heartbeat key for a moment, reading nothing
                with ThreadPoolExecutor(max_workers=4) as pool:
                    replies = list(pool.map(lambda _: post(http, stack.key, x), range(4)))
                statuses = sorted(r.status_code for r in replies)
                assert statuses == [429, 504, 504, 504], [r.text for r in replies]
                full = next(r for r in replies if r.status_code == 429)
                assert full.headers["Retry-After"] == "1" and "is full" in full.json()["error"]["message"]
                late = [r for r in replies if r.status_code == 504]
                assert all("past its deadline" in r.json()["error"]["message"] for r in late)
                runtime.signal(signal.SIGCONT)  # it finds them expired: drops them unrun
                wait_until(lambda: post(http, stack.key, x).status_code == 200, 20, "the runtime did not recover")
        time.sleep(1.5)
        ids = set(ledger_ids(stack.settings))
        assert not ids & {r.headers.get("X-Request-ID") for r in late}
    finally:
        stack.close()


def test_a_model_no_runtime_can_hold_is_refused_with_503(tmp_path, redis_url) -> None:
    # (a device type with no runtime at all is no refusal: the request waits for one to start,
    # tests/test_scale_to_zero.py)
    stack = Stack(distributed_settings(tmp_path / "data", redis_url, runtime_memory_bytes=64), tmp_path)
    try:
        stack.worker()
        stack.runtime()
        with BackgroundServer(stack.settings) as server:
            with Client(server.url, stack.key) as client:
                assert client.deploy(MODEL.SerializeToString(), name="mlp")["status"] == "ready"
            with httpx.Client(base_url=server.url, timeout=30) as http:
                small = post(http, stack.key, np.ones((1, 8), np.float32))
                assert small.status_code == 503, small.text
                assert "more than the memory budget of every cpu runtime" in small.json()["error"]["message"]
    finally:
        stack.close()


def test_redis_stopped_gives_503_and_the_gateway_recovers_without_a_restart(tmp_path) -> None:
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    command = ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no", "--dir", str(tmp_path)]

    def start_redis() -> subprocess.Popen:
        try:
            server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        except FileNotFoundError:
            pytest.fail("this test starts its own Redis and needs `redis-server` on PATH")
        probe = redis.Redis.from_url(url)
        wait_until(lambda: _pings(probe), 10, "redis-server did not start")
        probe.close()
        return server

    redis_server = start_redis()
    stack = Stack(distributed_settings(tmp_path / "data", url, compile_backend="embedded"), tmp_path)
    try:
        stack.runtime()
        with BackgroundServer(stack.settings) as server:
            with Client(server.url, stack.key) as client:
                assert client.deploy(MODEL.SerializeToString(), name="mlp")["status"] == "ready"
            x = np.ones((1, 8), np.float32)
            with httpx.Client(base_url=server.url, timeout=30) as http:
                assert post(http, stack.key, x).status_code == 200
                redis_server.terminate()
                redis_server.wait(timeout=10)
                down = post(http, stack.key, x)
                assert down.status_code == 503, down.text
                assert f"Redis at {url}" in down.json()["error"]["message"]
                redis_server = start_redis()
                wait_until(lambda: post(http, stack.key, x).status_code == 200, 30, "no recovery after Redis came back")
    finally:
        stack.close()
        redis_server.terminate()
        redis_server.wait(timeout=10)


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.exceptions.ConnectionError:
        return False
