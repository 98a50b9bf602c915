"""One tenant's compiles never hold everyone's: a tenant holds at most its share of the compile
slots, one more slot takes small graphs only, and a compile never measures at a size that would
not fit its memory limit (it falls back to a smaller one, or fails at once, saying how much the
model needs)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from onnx import helper

from api.main import create_app
from api.services import build_services
from cloud.auth import create_key
from tests.conftest import make_settings, upload, wait_for
from tests.onnx_models import init, make_model, mlp, tensor
from tests.test_compile_pool import FakeCompiles, _Versions
from worker.pool import CompileJob, EmbeddedCompilePool, SlotScheduler, tenant_share

MB = 1024 * 1024
GIANT, SMALL = 80 * MB, 1 * MB
ALICE, BOB, CAROL = 1, 2, 3


def test_a_tenant_holds_at_most_its_share_and_small_graphs_have_a_slot_of_their_own() -> None:
    scheduler = SlotScheduler(per_tenant=1, small_bytes=10 * MB)
    scheduler.put(CompileJob(1, ALICE, GIANT))
    scheduler.put(CompileJob(2, ALICE, GIANT))
    scheduler.put(CompileJob(3, ALICE, SMALL))
    first = scheduler.take(small_slot=False)
    assert first is not None and first.version_id == 1
    # a general slot is free, but alice holds her share: her next giant waits
    assert scheduler.take(small_slot=False) is None
    # the small slot passes over her giant to her small graph
    small = scheduler.take(small_slot=True)
    assert small is not None and small.version_id == 3
    assert scheduler.take(small_slot=True) is None  # no small graph left
    scheduler.put(CompileJob(4, BOB, GIANT))
    bobs = scheduler.take(small_slot=False)
    assert bobs is not None and bobs.version_id == 4
    scheduler.done(first, small_slot=False)
    second = scheduler.take(small_slot=False)
    assert second is not None and second.version_id == 2


def test_a_small_graph_is_left_to_the_small_slot_while_that_slot_is_free() -> None:
    scheduler = SlotScheduler(per_tenant=2, small_bytes=10 * MB)
    scheduler.put(CompileJob(1, ALICE, SMALL))
    scheduler.put(CompileJob(2, BOB, SMALL))
    assert scheduler.take(small_slot=False) is None  # (a general slot stays free for a giant)
    first = scheduler.take(small_slot=True)
    assert first is not None and first.version_id == 1
    second = scheduler.take(small_slot=False)  # the small slot is busy: a general one helps
    assert second is not None and second.version_id == 2


def test_a_tenants_share_is_half_the_slots_rounded_up_unless_set() -> None:
    assert [tenant_share(workers, 0) for workers in (1, 2, 3, 4)] == [1, 1, 2, 2]
    assert tenant_share(4, 3) == 3


def test_a_giant_holds_one_slot_while_another_tenants_small_model_runs_at_once() -> None:
    compiles = FakeCompiles()
    sizes = {1: GIANT, 2: SMALL, 3: GIANT, 4: GIANT}
    pool = EmbeddedCompilePool(_Versions(sizes), workers=2, run=compiles, small_graph_bytes=10 * MB)
    try:
        pool.submit(1, tenant_id=ALICE)
        compiles.wait(lambda: compiles.started == [1], "alice's giant did not start")
        pool.submit(2, tenant_id=BOB)
        compiles.wait(lambda: 2 in compiles.started, "bob's small model waited")
        pool.submit(3, tenant_id=ALICE)
        pool.submit(4, tenant_id=CAROL)
        # carol's giant, queued after alice's second, takes the free slot: alice holds her share
        compiles.wait(lambda: 4 in compiles.started, "carol's giant did not start")
        assert pool.queued() == [3] and 3 not in compiles.started
        compiles.finish(1)
        compiles.wait(lambda: 3 in compiles.started, "alice's second giant did not start once her first ended")
        for version_id in (2, 3, 4):
            compiles.finish(version_id)
        compiles.wait(lambda: not pool.running(), "the compiles did not end")
    finally:
        pool.shutdown()


# -- measuring within the memory limit


def add_model(width: int) -> bytes:
    """One Add of a (batch, width) input and a width-long weight: every batch row costs 2 x width x 4 bytes."""
    weight = init("w", np.ones(width, np.float32))
    nodes = [helper.make_node("Add", ["x", "w"], ["y"])]
    return make_model(nodes, [tensor("x", ["batch", width])], [tensor("y", ["batch", width])], [weight]).SerializeToString()


def serve(tmp_path: Path, **overrides) -> tuple[TestClient, str]:
    settings = make_settings(tmp_path / "data", **overrides)
    services = build_services(settings)
    key = create_key(services.db, "alice")
    services.close()
    return TestClient(create_app(settings)), key


def test_a_model_too_large_to_measure_at_a_full_batch_is_measured_at_a_smaller_one(tmp_path: Path) -> None:
    # 12 MB of weights: about 1.1 GiB of values at batch 32 (drawn in float64 first), past the limit
    client, key = serve(
        tmp_path,
        compile_memory_bytes=3 * 1024**3 // 2,
        compile_candidates=("native-blas", "numpy"),
        max_upload_bytes=16 * MB,
    )
    with client:
        upload(client, key, "wide", add_model(3 * 1024 * 1024))
        version = wait_for(client, key, "wide", 1, timeout=120)
    assert version["status"] == "ready", version
    measuring = version["report"]["measuring"]
    assert 32 not in measuring["symbol_sizes"] and 8 in measuring["symbol_sizes"], measuring
    assert any(
        note.startswith("the large measuring size 32 passed over: it needs about")
        and note.endswith("over the compile's memory limit of 1.5 GiB")
        for note in measuring["notes"]
    ), measuring["notes"]


def test_a_model_that_does_not_fit_at_its_smallest_size_fails_at_once_saying_why(tmp_path: Path) -> None:
    # a few hundred bytes declaring rows of 1.2 GB: one row in and one out pass the limit
    client, key = serve(tmp_path, compile_memory_bytes=3 * 1024**3 // 2, compile_timeout_s=120)
    nodes = [helper.make_node("Sin", ["x"], ["y"])]
    width = 300_000_000
    graph = make_model(nodes, [tensor("x", ["batch", width])], [tensor("y", ["batch", width])])
    with client:
        upload(client, key, "huge", graph.SerializeToString())
        version = wait_for(client, key, "huge", 1, timeout=120)
        assert version["status"] == "failed"
        error = version["error"]
        assert "the model needs about 4.47 GiB of memory to run once at its smallest size (every symbol 1)" in error
        assert "more than the limit of 1.5 GiB" in error and "ran longer" not in error
        # and the slot is free again for a model that fits
        upload(client, key, "mlp", mlp().SerializeToString())
        assert wait_for(client, key, "mlp", 1)["status"] == "ready"


@pytest.fixture(autouse=True)
def _no_leftover_children():
    yield
    import multiprocessing

    assert not [p for p in multiprocessing.active_children() if p.name.startswith("compile-")]
