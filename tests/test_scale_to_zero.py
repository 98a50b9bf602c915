"""Scale to zero and back, for real: a gateway whose device type has no live runtime queues a
request on the pool stream (scheduler/wire.py pool_stream) instead of refusing it; the stack's
autoscaler (api/stack.py RuntimeAutoscaler, the rule of scheduler/autoscale.py) sees the pool's
backlog and starts `luminal-cloud runtime` processes, which answer it; an idle one is stopped
with SIGTERM and the pool goes back to zero. The wait is reported as cold start and never billed.

Against the local Redis and PostgreSQL, as the other distributed tests. The model is compiled
once for the module; each test has its own gateway, autoscaler and flushed Redis database.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import httpx
import numpy as np
import pytest
import redis
import sqlalchemy
from sqlalchemy import select

from api.server import BackgroundServer
from api.services import open_database
from api.stack import RuntimeAutoscaler, Stack, StopRequested, pool_lag
from cloud.auth import create_key
from cloud.db import UsageRecord
from cloud.metrics import REGISTRY
from compiler import compile_onnx
from luminal_cloud import Client
from runtime import CpuDevice, Runtime
from runtime.process import RuntimeConfig, RuntimeProcess
from scheduler import wire
from scheduler.autoscale import ScalePolicy
from scheduler.engine import Route
from scheduler.streams import route_fields
from tests.conftest import fresh_postgres_database
from tests.onnx_models import mlp
from tests.processes import settings_env
from tests.test_distributed import distributed_settings, post, reference, wait_until

REDIS_DB = 10
MODEL = mlp()
X = np.arange(16, dtype=np.float32).reshape(2, 8) / 16


@pytest.fixture(scope="module")
def database() -> Iterator[str]:
    """A new PostgreSQL database for the module, dropped after it."""
    with fresh_postgres_database("luminal_zero") as url:
        yield url


@dataclass
class Deployed:
    data_dir: Path
    database_url: str
    key: str


@pytest.fixture(scope="module")
def deployed(tmp_path_factory: pytest.TempPathFactory, database: str) -> Deployed:
    """The MLP, compiled once (embedded compile) into the module's database and object store."""
    data_dir = tmp_path_factory.mktemp("zero") / "data"
    settings = distributed_settings(
        data_dir, f"redis://127.0.0.1:6379/{REDIS_DB}", database_url=database, compile_backend="embedded"
    )
    db = open_database(settings)
    key = create_key(db, "alice")
    db.dispose()
    with BackgroundServer(settings) as server, Client(server.url, key) as client:
        assert client.deploy(MODEL.SerializeToString(), name="mlp")["status"] == "ready"
    return Deployed(data_dir, database, key)


@pytest.fixture
def redis_client() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(f"redis://127.0.0.1:6379/{REDIS_DB}")
    try:
        client.flushdb()
    except redis.exceptions.ConnectionError as exc:
        pytest.fail(f"these tests need the local Redis, which is unreachable: {exc}")
    yield client
    client.flushdb()
    client.close()


class Pool:
    """The stack's supervisor with one autoscaled cpu pool, watching in a thread."""

    def __init__(self, settings, logs: Path, policy: ScalePolicy) -> None:
        logs.mkdir(parents=True, exist_ok=True)
        self.stack = Stack(start_timeout_s=60)
        self.autoscaler = RuntimeAutoscaler("cpu", policy, settings.redis_url, settings_env(settings), logs)
        self.stack.adopt(self.autoscaler)
        self.errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._watch, name="autoscaler")

    def _watch(self) -> None:
        try:
            self.stack.watch()
        except StopRequested:
            pass
        except BaseException as exc:  # noqa: BLE001  reported by the test
            self.errors.append(exc)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stack.request_stop()
        self._thread.join(timeout=30)
        self.stack.stop()
        assert not self.errors, self.errors

    @property
    def running(self) -> int:
        return len(self.autoscaler.children)


def settings_for(deployed: Deployed, **overrides):
    return distributed_settings(
        deployed.data_dir, f"redis://127.0.0.1:6379/{REDIS_DB}", database_url=deployed.database_url,
        compile_backend="embedded", **overrides,
    )


def live_runtimes(client: redis.Redis) -> list[str]:
    return [m.decode() for m in client.smembers(wire.RUNTIMES) if client.exists(wire.heartbeat_key(m.decode()))]


def usage_count(settings) -> int:
    db = open_database(settings)
    try:
        with db.session() as session:
            return session.scalar(select(sqlalchemy.func.count(UsageRecord.id)))
    finally:
        db.dispose()


def usage_record(settings, request_id: str) -> UsageRecord | None:
    db = open_database(settings)
    try:
        with db.session() as session:
            return session.scalars(select(UsageRecord).where(UsageRecord.request_id == request_id)).first()
    finally:
        db.dispose()


def cold_starts_observed() -> float:
    return sum(
        sample.value
        for metric in REGISTRY.collect()
        if metric.name == "luminal_cold_start_seconds"
        for sample in metric.samples
        if sample.name.endswith("_count")
    )


def test_a_request_to_a_pool_at_zero_waits_for_a_runtime_and_its_cold_start_is_reported_not_billed(
    deployed, redis_client, tmp_path
) -> None:
    settings = settings_for(deployed)
    before = cold_starts_observed()
    with (
        BackgroundServer(settings) as server,
        Pool(settings, tmp_path, ScalePolicy(0, 1, target_lag=4, idle_s=60)) as pool,
        httpx.Client(base_url=server.url, timeout=30) as http,
    ):
        assert pool.running == 0 and live_runtimes(redis_client) == []
        started = time.monotonic()
        reply = post(http, deployed.key, X)
        took = time.monotonic() - started
        assert reply.status_code == 200, reply.text
        np.testing.assert_allclose(np.asarray(reply.json()["outputs"]["y"], np.float32), reference(X), rtol=1e-5, atol=1e-6)
        assert pool.running == 1 and len(live_runtimes(redis_client)) == 1
        usage = reply.json()["usage"]
        # the wait for the runtime's start is its cold start: most of the answer's time, not billed
        assert 0.3 < usage["cold_start_ms"] / 1000 <= took
        assert usage["exec_ms"] < usage["cold_start_ms"] / 10
        assert cold_starts_observed() == before + 1
        request_id = reply.headers["X-Request-ID"]
        wait_until(lambda: usage_record(settings, request_id) is not None, 10, "no usage record")
        record = usage_record(settings, request_id)
        assert record.billed_seconds == pytest.approx(usage["exec_ms"] / 1000, rel=1e-6)
        assert record.billed_seconds == pytest.approx(record.batch_exec_seconds)

        # warm now: the version is placed on the runtime, no cold start
        warm = post(http, deployed.key, X)
        assert warm.status_code == 200 and warm.json()["usage"]["cold_start_ms"] == 0
        assert pool.running == 1
    log = (tmp_path / "runtime-1.log").read_text()
    assert "cold start of mlp v1" in log and "Traceback" not in log


def test_a_request_whose_deadline_passes_before_a_runtime_starts_gets_503_naming_the_pool_and_leaves_nothing(
    deployed, redis_client, tmp_path
) -> None:
    settings = settings_for(deployed, request_timeout_s=1.0)
    records = usage_count(settings)
    with (
        BackgroundServer(settings) as server,
        Pool(settings, tmp_path, ScalePolicy(0, 0, target_lag=4, idle_s=60)) as pool,  # starts nothing
        httpx.Client(base_url=server.url, timeout=30) as http,
    ):
        started = time.monotonic()
        reply = post(http, deployed.key, X)
        assert 1.0 <= time.monotonic() - started < 3.0
        assert reply.status_code == 503, reply.text
        error = reply.json()["error"]
        pool_stream = wire.pool_stream("cpu")
        assert error["code"] == "no_runtime_started" and error["waited_for"] == "runtime_start"
        assert error["device_type"] == "cpu" and error["pool"] == pool_stream
        assert "no cpu runtime started" in error["message"] and pool_stream in error["message"]
        assert redis_client.xlen(pool_stream) == 0 and pool_lag(redis_client, "cpu") == 0
        assert redis_client.xpending(pool_stream, wire.RUNTIME_GROUP)["pending"] == 0
        assert pool.running == 0
    time.sleep(1.0)
    assert usage_count(settings) == records


def test_an_idle_runtime_is_stopped_and_the_pool_goes_to_zero_and_back(deployed, redis_client, tmp_path) -> None:
    settings = settings_for(deployed)
    with (
        BackgroundServer(settings) as server,
        Pool(settings, tmp_path, ScalePolicy(0, 1, target_lag=4, idle_s=1.5)) as pool,
        httpx.Client(base_url=server.url, timeout=30) as http,
    ):
        assert post(http, deployed.key, X).status_code == 200
        answered = time.monotonic()
        first = pool.autoscaler._started
        wait_until(lambda: pool.running == 0 and not pool.autoscaler._stopping, 15, "the idle runtime was not stopped")
        assert time.monotonic() - answered >= 1.5
        wait_until(lambda: live_runtimes(redis_client) == [], 5, "the stopped runtime is still announced")
        assert redis_client.smembers(wire.placement_key(1)) == set()
        # and back: the next request starts a runtime again
        again = post(http, deployed.key, X)
        assert again.status_code == 200 and again.json()["usage"]["cold_start_ms"] > 0
        assert pool.autoscaler._started == first + 1
    log = (tmp_path / "runtime-1.log").read_text()
    assert "Traceback" not in log


def test_a_backlog_larger_than_a_runtimes_share_scales_to_max_and_no_further(deployed, redis_client, tmp_path) -> None:
    settings = settings_for(deployed)
    policy = ScalePolicy(0, 2, target_lag=2, idle_s=60)  # 16 waiting would call for 8
    with (
        BackgroundServer(settings) as server,
        Pool(settings, tmp_path, policy) as pool,
        httpx.Client(base_url=server.url, timeout=30) as http,
        ThreadPoolExecutor(max_workers=16) as clients,
    ):
        replies = list(clients.map(lambda _: post(http, deployed.key, X), range(16)))
        assert [r.status_code for r in replies] == [200] * 16, [r.text for r in replies if r.status_code != 200]
        assert pool.autoscaler._started == 2 and pool.running == 2
        wait_until(lambda: len(live_runtimes(redis_client)) == 2, 10, "both runtimes announced")
    assert pool_lag(redis_client, "cpu") == 0


def test_twenty_parallel_requests_to_a_pool_at_zero_all_succeed(deployed, redis_client, tmp_path) -> None:
    settings = settings_for(deployed)
    rng = np.random.default_rng(5)
    inputs = [rng.standard_normal((1 + i % 3, 8)).astype(np.float32) for i in range(20)]
    with (
        BackgroundServer(settings) as server,
        Pool(settings, tmp_path, ScalePolicy(0, 1, target_lag=4, idle_s=60)) as pool,
        httpx.Client(base_url=server.url, timeout=30) as http,
        ThreadPoolExecutor(max_workers=20) as clients,
    ):
        replies = list(clients.map(lambda x: post(http, deployed.key, x), inputs))
        assert [r.status_code for r in replies] == [200] * 20, [r.text for r in replies if r.status_code != 200]
        for x, reply in zip(inputs, replies):
            np.testing.assert_allclose(np.asarray(reply.json()["outputs"]["y"], np.float32), reference(x), rtol=1e-5, atol=1e-6)
        assert all(r.json()["usage"]["cold_start_ms"] > 0 for r in replies)
        assert pool.running == 1
        ids = {r.headers["X-Request-ID"] for r in replies}
        wait_until(lambda: all(usage_record(settings, i) is not None for i in ids), 10, "usage records missing")
    lines = (tmp_path / "runtime-1.log").read_text()
    assert re.search(r"cold start of mlp v1: [\d.]+ s waiting for a runtime", lines)


def test_requests_a_runtime_took_from_the_pool_and_never_answered_are_claimed_and_answered_once(
    redis_client,
) -> None:
    """In process, step by step: runtime A takes requests from the pool stream and dies before
    answering; runtime B claims them once idle past claim_idle_s, answers each once, and leaves
    the stream empty and its group's lag exact (trimmed, not deleted entry by entry)."""
    artifact = compile_onnx(MODEL.SerializeToString(), "cpu", ("numpy",))

    def runtime_process() -> RuntimeProcess:
        runtime = Runtime(CpuDevice(), {"mlp": artifact}.__getitem__, memory_budget_bytes=1 << 30)
        config = RuntimeConfig("cpu", 1.0, 0.3, max_batch_rows=4, max_delay_s=0.0, adaptive_batching=True,
                               prices={"cpu": 1e-5})
        return RuntimeProcess(redis_client, runtime, config)

    route = Route(1, 1, "alice", "mlp", 1, "cpu", "mlp", batchable=True)
    reply_to, pool = wire.reply_stream("test-gateway"), wire.pool_stream("cpu")
    dying = runtime_process()
    dying.refresh_streams()
    for i in range(3):
        message = wire.RequestMessage(f"r{i}", reply_to, time.time() + 30, 2, route_fields(route), {"x": X},
                                      enqueued_at=time.time())
        redis_client.xadd(pool, message.to_fields())
    assert pool_lag(redis_client, "cpu") == 3
    assert len(dying._read(0.1)) == 3  # taken, then the process dies
    assert pool_lag(redis_client, "cpu") == 0 and redis_client.xpending(pool, wire.RUNTIME_GROUP)["pending"] == 3
    time.sleep(0.4)
    survivor = runtime_process()
    survivor.refresh_streams()
    deadline = time.monotonic() + 10
    while len(done := [r for _, f in redis_client.xrange(reply_to) if (r := wire.ReplyMessage.from_fields(f)).kind != "started"]) < 3:
        assert time.monotonic() < deadline, done
        survivor.step()
    assert sorted(a.request_id for a in done) == ["r0", "r1", "r2"]
    for answer in done:
        np.testing.assert_allclose(answer.outputs["y"], reference(X), rtol=1e-5, atol=1e-6)
        assert answer.cold_start_seconds > 0  # queued before this runtime served: it waited for one
    assert redis_client.xlen(pool) == 0 and redis_client.xpending(pool, wire.RUNTIME_GROUP)["pending"] == 0
    assert pool_lag(redis_client, "cpu") == 0
    usages = [json.loads(f[b"usage"])["request_id"] for _, f in redis_client.xrange(wire.USAGE_STREAM)]
    assert sorted(usages) == ["r0", "r1", "r2"]


def test_the_stack_takes_runtimes_auto_with_its_bounds_and_refuses_bounds_that_cannot_hold(capsys) -> None:
    from luminal_cloud.cli import build_parser

    parser = build_parser()
    auto = parser.parse_args(["stack", "--runtimes", "auto", "--runtime-min", "0", "--runtime-max", "2",
                              "--runtime-idle", "30"])
    assert (auto.runtimes, auto.runtime_min, auto.runtime_max, auto.runtime_idle) == (None, 0, 2, 30.0)
    assert parser.parse_args(["stack", "--runtimes", "3"]).runtimes == 3
    with pytest.raises(SystemExit):
        parser.parse_args(["stack", "--runtimes", "some"])
    assert "a number of runtimes or auto" in capsys.readouterr().err
    backwards = parser.parse_args(["stack", "--runtimes", "auto", "--runtime-min", "3", "--runtime-max", "1"])
    with pytest.raises(SystemExit, match="--runtimes auto: need 0 <= min <= max runtimes"):
        backwards.run(backwards)
