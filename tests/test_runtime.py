"""The runtime's memory: programs load on first use, the least recently used leave when the
loaded ones pass the memory budget, and idle ones leave after idle_unload_s; what drives the
unloading in each mode (the engine's janitor is tested in test_api.py, the runtime process's
heartbeat here, against the local Redis)."""

from __future__ import annotations

import gc
import json
import threading
import time
import weakref
from collections.abc import Iterator

import numpy as np
import pytest
import redis

from api.services import build_runtime
from cloud.metrics import PrometheusObserver
from cloud.storage import make_object_store
from compiler import Artifact, compile_onnx
from runtime import CpuDevice, Runtime
from runtime.process import STARTED_NOTICE_S, RuntimeConfig, RuntimeProcess
from scheduler import wire
from scheduler.engine import Route
from scheduler.streams import route_fields
from tests.conftest import make_settings
from tests.onnx_models import mlp
from tests.processes import flushed_redis

REDIS_DB = 13


@pytest.fixture(scope="module")
def artifacts() -> dict[str, Artifact]:
    # the NumPy program: no C build, and its size is its weights
    return {
        name: compile_onnx(mlp(seed=i, hidden=hidden).SerializeToString(), "cpu", ("numpy",))
        for i, (name, hidden) in enumerate({"small": 16, "medium": 64, "large": 256}.items())
    }


def run(runtime: Runtime, key: str) -> None:
    result = runtime.run_batch(key, [{"x": np.ones((1, 8), np.float32)}], [1])
    assert result.outputs[0]["y"].shape == (1, 3)


def test_the_least_recently_used_leaves_when_the_budget_is_passed(artifacts) -> None:
    sizes = {name: CpuDevice().load(a).resident_bytes for name, a in artifacts.items()}
    assert sizes["small"] < sizes["medium"] < sizes["large"]
    budget = sizes["large"] + sizes["medium"]  # room for large and medium, not all three
    runtime = Runtime(CpuDevice(), artifacts.__getitem__, max_loaded=8, memory_budget_bytes=budget)
    run(runtime, "medium")
    run(runtime, "small")
    run(runtime, "medium")  # small is now the least recently used
    run(runtime, "large")
    assert runtime.loaded_keys == ["medium", "large"]
    assert runtime.loaded_bytes == sizes["medium"] + sizes["large"] <= budget
    run(runtime, "small")  # back on demand, pushing out medium
    assert runtime.loaded_keys == ["large", "small"]


def test_a_program_larger_than_the_budget_still_runs_alone(artifacts) -> None:
    runtime = Runtime(CpuDevice(), artifacts.__getitem__, memory_budget_bytes=1)
    run(runtime, "small")
    run(runtime, "large")
    assert runtime.loaded_keys == ["large"]


def test_a_loaded_native_program_holds_only_the_weights_its_code_reads() -> None:
    artifact = compile_onnx(mlp(seed=0, hidden=256).SerializeToString(), "cpu", ("native-tiled",))
    layout = artifact.kernels[0]["layout"]["buffers"]
    read = {b["name"] for b in layout if b["role"] == "weight"}
    # the products read their weights as panels packed at compile time, in place of the rows
    replaced = sorted(name for name in set(artifact.graph.weights) - read if f"{name}:panels" in read)
    assert replaced, read
    library = len(artifact.binaries["program.so"])
    store = {"mlp": artifact}
    runtime = Runtime(CpuDevice(), store.__getitem__)
    run(runtime, "mlp")
    held = sum(artifact.all_weights()[name].nbytes for name in read) + library
    assert runtime.loaded_bytes == held < sum(a.nbytes for a in artifact.all_weights().values()) + library
    rows = weakref.ref(artifact.graph.weights[replaced[0]])
    del artifact, store["mlp"]
    gc.collect()
    assert rows() is None, "a loaded program still holds the rows its panels replaced"
    run(runtime, "mlp")


def test_idle_programs_leave_after_idle_unload_s(artifacts) -> None:
    runtime = Runtime(CpuDevice(), artifacts.__getitem__, idle_unload_s=10.0)
    run(runtime, "small")
    run(runtime, "medium")
    assert runtime.unload_idle(now=0.0) == []
    assert sorted(runtime.unload_idle(now=float("inf"))) == ["medium", "small"]
    assert runtime.loaded_keys == [] and runtime.loaded_bytes == 0


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple] = []

    def model_loaded(self, target: str, seconds: float) -> None:
        self.events.append(("loaded", target, seconds > 0))

    def models_loaded_now(self, target: str, count: int) -> None:
        self.events.append(("count", target, count))


def test_the_observer_hears_each_load_and_unload(artifacts) -> None:
    observer = Recorder()
    runtime = Runtime(CpuDevice(), artifacts.__getitem__, idle_unload_s=10.0, observer=observer)
    run(runtime, "small")
    run(runtime, "small")  # warm: nothing to report
    run(runtime, "medium")
    runtime.unload("medium")
    runtime.unload_idle(now=float("inf"))
    assert observer.events == [
        ("loaded", "cpu", True),
        ("count", "cpu", 1),
        ("loaded", "cpu", True),
        ("count", "cpu", 2),
        ("count", "cpu", 1),
        ("count", "cpu", 0),
    ]


def test_the_built_runtime_takes_its_budget_and_metrics_from_settings(tmp_path) -> None:
    settings = make_settings(tmp_path / "data", runtime_memory_bytes=123_456, idle_unload_s=7.0)
    runtime = build_runtime(settings, make_object_store(settings))
    assert runtime.memory_budget_bytes == 123_456
    assert isinstance(runtime.observer, PrometheusObserver)


@pytest.fixture
def redis_url() -> Iterator[str]:
    yield from flushed_redis(REDIS_DB)


def runtime_process(client: redis.Redis, runtime: Runtime) -> RuntimeProcess:
    config = RuntimeConfig(
        device="cpu",
        heartbeat_s=0.05,
        claim_idle_s=1.0,
        max_batch_rows=4,
        max_delay_s=0.0,
        adaptive_batching=True,
        prices={"cpu": 1.0},
    )
    return RuntimeProcess(client, runtime, config)


def test_a_runtime_process_heartbeat_unloads_idle_models_and_announces_it(artifacts, redis_url) -> None:
    budget = CpuDevice().load(artifacts["large"]).resident_bytes
    runtime = Runtime(CpuDevice(), artifacts.__getitem__, idle_unload_s=1.0, memory_budget_bytes=budget)
    client = redis.Redis.from_url(redis_url)
    process = runtime_process(client, runtime)
    run(runtime, "small")
    serving = threading.Thread(target=process.serve, daemon=True)
    serving.start()
    try:
        announced = wire.heartbeat_key(process.runtime_id)
        deadline = time.monotonic() + 10
        while json.loads(client.hget(announced, "loaded") or b"null") != ["small"]:
            assert time.monotonic() < deadline, "the heartbeat never announced the loaded model"
            time.sleep(0.01)
        # placement reads the budget the runtime evicts by
        assert int(client.hget(announced, "memory_budget_bytes")) == budget
        while runtime.loaded_keys or json.loads(client.hget(announced, "loaded")) != []:
            assert time.monotonic() < deadline, "the idle model was never unloaded, or never announced so"
            time.sleep(0.01)
        assert int(client.hget(announced, "loaded_bytes")) == 0
    finally:
        process.stop()
        serving.join(timeout=5)
        client.close()


def test_a_runtime_process_needs_a_memory_budget(artifacts) -> None:
    with pytest.raises(ValueError, match="memory budget"):
        runtime_process(redis.Redis(), Runtime(CpuDevice(), artifacts.__getitem__))


def test_a_request_is_told_its_batch_started_only_when_a_slow_run_could_pass_its_deadline(
    artifacts, redis_url
) -> None:
    """"started" tells a gateway to wait for a running batch rather than answer 504 at the
    deadline; it costs a round trip, so it goes only where that could happen: a batch that may
    be slow (a first run, a cold start), or a deadline nearer than STARTED_NOTICE_S."""
    runtime = Runtime(CpuDevice(), artifacts.__getitem__, memory_budget_bytes=1 << 30)
    client = redis.Redis.from_url(redis_url)
    process = runtime_process(client, runtime)
    route = Route(1, 1, "t", "small", 1, "cpu", "small", batchable=True)
    client.sadd(wire.assigned_key(process.runtime_id), route.version_id)
    process.refresh_streams()
    reply_to = wire.reply_stream("test-gateway")

    def kinds_of_replies(request_id: str, seconds_to_deadline: float) -> list[str]:
        message = wire.RequestMessage(
            request_id, reply_to, time.time() + seconds_to_deadline, 1, route_fields(route),
            {"x": np.ones((1, 8), np.float32)},
        )
        client.xadd(wire.request_stream(route.version_id), message.to_fields())
        deadline = time.monotonic() + 10
        replies: list[wire.ReplyMessage] = []
        while not any(r.kind != "started" for r in replies):
            assert time.monotonic() < deadline, "the runtime never answered"
            process.step()
            replies = [
                reply
                for _, fields in client.xrange(reply_to)
                if (reply := wire.ReplyMessage.from_fields(fields)).request_id == request_id
            ]
        return [r.kind for r in replies]

    try:
        assert kinds_of_replies("first", 60) == ["started", "ok"]  # no batch time known yet
        assert kinds_of_replies("far", 60) == ["ok"]
        assert kinds_of_replies("near", STARTED_NOTICE_S / 2) == ["started", "ok"]
        runtime.unload("small")
        assert kinds_of_replies("cold", 60) == ["started", "ok"]
    finally:
        client.close()


def test_the_engine_tells_the_device_when_requests_wait_behind_a_batch(artifacts) -> None:
    # a native program wakes its sleeping threads for small loops only when nothing waits: with a
    # queue, their spinning would take the CPU the server needs to take the next requests
    import asyncio

    from scheduler.engine import InProcessEngine

    class RecordingDevice(CpuDevice):
        def __init__(self) -> None:
            self.busy: list[bool] = []

        def execute(self, loaded, inputs, busy=False):
            self.busy.append(busy)
            return super().execute(loaded, inputs, busy)

    class Ledger:
        def __init__(self) -> None:
            self.usages = []

        def record(self, usages) -> None:
            self.usages.extend(usages)

    device, ledger = RecordingDevice(), Ledger()
    route = Route(1, 1, "t", "small", 1, "cpu", "small", batchable=True)

    async def serve() -> None:
        engine = InProcessEngine(
            {"cpu": Runtime(device, artifacts.__getitem__)}, ledger, {"cpu": 1.0}, max_batch_rows=1,
            max_delay_s=0.0, max_queue_requests=16, request_timeout_s=30.0, retry_after_s=1,
            adaptive_batching=False,
        )
        inputs = {"x": np.ones((1, 8), np.float32)}
        try:
            results = await asyncio.gather(*(engine.infer(route, inputs, 1, f"r{i}") for i in range(4)))
            assert [r.batch_size for r in results] == [1, 1, 1, 1]
            await engine.infer(route, inputs, 1, "alone")
        finally:
            await engine.close()

    asyncio.run(serve())
    # three batches ran with requests behind them, the fourth and the lone request with none
    assert device.busy == [True, True, True, False, False]
    assert len(ledger.usages) == 5
