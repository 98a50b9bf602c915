"""Deleting a model while its requests run: every request gets an answer (the batch under way
finishes and answers 200; the queued ones 503 naming the deletion), the ledger bills exactly the
requests that were answered 200, and the server still shuts down at once."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from api.server import BackgroundServer
from api.services import open_database
from cloud.db import UsageRecord
from cloud.errors import Unavailable
from runtime.runtime import BatchResult
from scheduler.engine import InProcessEngine, Route
from tests.conftest import auth

ROUTE = Route(version_id=1, tenant_id=1, tenant_name="t", model_name="m", version=1, target="cpu",
              artifact_key="artifacts/m", batchable=True)


class SlowRuntime:
    """Each batch takes `seconds` on a worker thread, like a large model on a CPU."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.unloaded: list[str] = []

    def run_batch(self, key, requests, rows, busy=False) -> BatchResult:
        time.sleep(self.seconds)
        return BatchResult([dict(r) for r in requests], self.seconds, 0.0)

    def unload(self, key: str) -> None:
        self.unloaded.append(key)

    def unload_idle(self) -> list[str]:
        return []


class Ledger:
    def __init__(self) -> None:
        self.request_ids: list[str] = []

    def record(self, usages) -> None:
        self.request_ids.extend(u.request_id for u in usages)


def test_forgetting_a_version_mid_batch_answers_every_request_and_bills_only_the_answered() -> None:
    async def scenario() -> None:
        runtime, ledger = SlowRuntime(0.3), Ledger()
        engine = InProcessEngine({"cpu": runtime}, ledger, {"cpu": 1.0}, max_batch_rows=4, max_delay_s=0.0,
                                 max_queue_requests=100, request_timeout_s=30, retry_after_s=1)
        x = {"x": np.ones((1, 2), np.float32)}
        calls = [asyncio.create_task(engine.infer(ROUTE, x, 1, f"r{i}")) for i in range(16)]
        await asyncio.sleep(0.1)  # the first batch of 4 is on the device, 12 wait
        engine.forget(ROUTE.version_id)
        _, pending = await asyncio.wait(calls, timeout=5)
        assert not pending, f"{len(pending)} requests never answered"
        answered = [c for c in calls if c.exception() is None]
        refused = [c.exception() for c in calls if c.exception() is not None]
        assert len(answered) == 4 and len(refused) == 12
        assert all(isinstance(e, Unavailable) and "'m' version 1 was deleted" in e.message for e in refused)
        assert sorted(ledger.request_ids) == sorted(f"r{i}" for i in range(4))
        assert runtime.unloaded == ["artifacts/m"]
        # a request that resolved the version just before the delete is refused, not run
        with pytest.raises(Unavailable, match="was deleted"):
            await engine.infer(ROUTE, x, 1, "late")
        started = time.monotonic()
        await engine.close()
        assert time.monotonic() - started < 1

    asyncio.run(scenario())


def test_closing_the_engine_lets_the_batch_under_way_answer() -> None:
    async def scenario() -> None:
        engine = InProcessEngine({"cpu": SlowRuntime(0.3)}, Ledger(), {"cpu": 1.0}, max_batch_rows=1, max_delay_s=0.0,
                                 max_queue_requests=100, request_timeout_s=30, retry_after_s=1)
        calls = [asyncio.create_task(engine.infer(ROUTE, {"x": np.ones((1, 2))}, 1, f"r{i}")) for i in range(3)]
        await asyncio.sleep(0.05)
        await engine.close()
        assert all(c.done() for c in calls)
        assert [c.exception() is None for c in calls] == [True, False, False]

    asyncio.run(scenario())


def large_matmul(size: int = 1536) -> bytes:
    """A product by a size x size weight (9 MB): a batch of 64 rows takes tens of milliseconds."""
    weight = np.random.default_rng(0).standard_normal((size, size)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "big",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", size])],
        [numpy_helper.from_array(weight, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model).SerializeToString()


def test_deleting_a_model_under_concurrent_load_answers_everyone_and_bills_what_was_answered(tmp_path) -> None:
    from cloud.auth import create_key
    from tests.conftest import make_settings

    settings = make_settings(tmp_path / "data", max_upload_bytes=32 * 1024 * 1024, max_infer_body_bytes=16 * 1024 * 1024)
    db = open_database(settings)
    key = create_key(db, "alice")
    headers = auth(key)
    body = {"inputs": {"x": np.ones((64, 1536), np.float32).tolist()}}
    with BackgroundServer(settings) as server:
        uploaded = httpx.post(f"{server.url}/v1/models", headers=headers, data={"name": "big"},
                              files={"file": ("big.onnx", large_matmul())}, timeout=60)
        assert uploaded.status_code == 202, uploaded.text
        deadline = time.monotonic() + 120
        while httpx.get(f"{server.url}/v1/models/big", headers=headers).json()["versions"][0]["status"] != "ready":
            assert time.monotonic() < deadline, "the model did not compile"
            time.sleep(0.1)
        assert httpx.post(f"{server.url}/v1/models/big/infer", json=body, headers=headers, timeout=60).status_code == 200

        start = threading.Barrier(17)

        def call(_: int) -> httpx.Response:
            start.wait()
            return httpx.post(f"{server.url}/v1/models/big/infer", json=body, headers=headers, timeout=45)

        with ThreadPoolExecutor(16) as pool:
            replies = [pool.submit(call, i) for i in range(16)]
            start.wait()
            time.sleep(0.3)
            assert httpx.delete(f"{server.url}/v1/models/big", headers=headers, timeout=30).status_code == 200
            statuses = [r.result(timeout=40).status_code for r in replies]
        assert set(statuses) <= {200, 503, 404}, statuses
        for reply in (r.result() for r in replies):
            if reply.status_code != 200:
                assert "deleted" in reply.json()["error"]["message"] or "not found" in reply.json()["error"]["message"]
        with db.session() as session:
            billed = session.query(UsageRecord).count()
        # the warm-up request, and each request answered 200
        assert billed == 1 + statuses.count(200), statuses
        stopping = time.monotonic()
    assert time.monotonic() - stopping < 15, "the server took too long to stop"
    db.dispose()
