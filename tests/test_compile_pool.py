"""Compiles cannot starve or take down the server: each runs in a child process under time and
memory limits, tenants are served round-robin, DELETE stops a compile (that compile, never a
later one that reuses its id), and a compile that keeps interrupting the server is failed
instead of resumed forever. While one runs, its progress shows on its version, written at most
once a second and never at the compile's expense. (Slot shares: tests/test_compile_fairness.py.)"""

from __future__ import annotations

import io
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.exc import OperationalError

from api.main import create_app
from api.services import build_services
from cloud.auth import authenticate, create_key
from cloud.errors import Unavailable
from cloud.storage import artifact_key
from compiler import Artifact, compile_onnx
from compiler.backends.native_cpu import cpu_fingerprint
from compiler.pipeline import COMPILER_VERSION, PHASES
from registry import INTERRUPTED
from tests.conftest import auth, make_settings, upload, wait_for
from tests.onnx_models import heavy_compile_model, mlp
from worker import pool
from worker.compile import ProgressWriter, cache_key, compile_here, compile_options, compile_version
from worker.pool import CompileJob, EmbeddedCompilePool, SlotScheduler
from worker.sandbox import CompileCancelled, CompileCrashed, CompileHandle, Sandbox

# eight passes over 1.6 GB: about half a minute of compiling here; one pass needs 1.6 GB at once
SLOW_GRAPH = heavy_compile_model(repeats=8).SerializeToString()
HUNGRY_GRAPH = heavy_compile_model(repeats=1).SerializeToString()


def test_the_queue_serves_tenants_round_robin() -> None:
    scheduler = SlotScheduler(per_tenant=1, small_bytes=0)

    def run_next() -> int:
        job = scheduler.take(small_slot=False)
        assert job is not None
        scheduler.done(job, small_slot=False)
        return job.version_id

    for version_id in (1, 2, 3):
        scheduler.put(CompileJob(version_id, tenant_id=10, graph_bytes=100))
    scheduler.put(CompileJob(4, tenant_id=20, graph_bytes=100))
    scheduler.put(CompileJob(5, tenant_id=30, graph_bytes=100))
    assert [run_next() for _ in range(5)] == [1, 4, 5, 2, 3]
    scheduler.put(CompileJob(6, 10, 100))
    scheduler.put(CompileJob(7, 10, 100))
    assert scheduler.remove(6) and not scheduler.remove(6)
    assert run_next() == 7
    assert scheduler.take(small_slot=False) is None


def serve(tmp_path: Path, **overrides):
    settings = make_settings(tmp_path / "data", **overrides)
    services = build_services(settings)
    keys = {name: create_key(services.db, name) for name in ("alice", "bob")}
    services.close()
    return TestClient(create_app(settings)), keys


def test_a_compile_past_its_time_limit_is_stopped_and_says_so(tmp_path: Path) -> None:
    # the limit must stop the slow graph (about half a minute) and leave the MLP's compile, which
    # follows, room on a loaded machine: the NumPy candidate alone (a native one's C builds and
    # schedule search took the MLP past 2 s on a busy CI-sized machine)
    client, keys = serve(tmp_path, compile_timeout_s=5.0, compile_candidates=("numpy",))
    with client:
        upload(client, keys["alice"], "slow", SLOW_GRAPH)
        version = wait_for(client, keys["alice"], "slow", 1, timeout=60)
        assert version["status"] == "failed"
        assert "ran longer than the limit of 5 s" in version["error"]
        upload(client, keys["bob"], "mlp", mlp().SerializeToString())
        assert wait_for(client, keys["bob"], "mlp", 1)["status"] == "ready"


def test_a_compile_past_its_memory_limit_fails_the_version_not_the_server(tmp_path: Path) -> None:
    client, keys = serve(tmp_path, compile_memory_bytes=3 * 1024**3 // 2)
    with client:
        upload(client, keys["alice"], "hungry", HUNGRY_GRAPH)
        version = wait_for(client, keys["alice"], "hungry", 1, timeout=120)
        assert version["status"] == "failed"
        # refused before the 1.6 GB it asks for is allocated, naming what it needs
        assert "needs about 1.49 GiB of memory to run once" in version["error"], version["error"]
        assert "more than the limit of 1.5 GiB" in version["error"]
        assert client.get("/healthz").status_code == 200
        upload(client, keys["alice"], "mlp", mlp().SerializeToString())  # the limit leaves room for real models
        assert wait_for(client, keys["alice"], "mlp", 1)["status"] == "ready"


def test_delete_stops_a_running_compile(tmp_path: Path) -> None:
    client, keys = serve(tmp_path)
    with client:
        upload(client, keys["alice"], "slow", SLOW_GRAPH)
        deadline = time.monotonic() + 30
        while client.get("/v1/models/slow", headers=auth(keys["alice"])).json()["versions"][0]["status"] != "compiling":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert client.delete("/v1/models/slow", headers=auth(keys["alice"])).status_code == 200
        # one compile slot: the next model compiles now, not after the slow graph's half minute
        started = time.monotonic()
        upload(client, keys["alice"], "mlp", mlp().SerializeToString())
        assert wait_for(client, keys["alice"], "mlp", 1, timeout=60)["status"] == "ready"
        assert time.monotonic() - started < 20


def test_a_compile_interrupted_twice_fails_instead_of_resuming_forever(tmp_path: Path) -> None:
    services = build_services(make_settings(tmp_path / "data"))
    try:
        registry = services.registry
        tenant = authenticate(services.db, f"Bearer {create_key(services.db, 'alice')}").id
        once = registry.create_version(tenant, "a", io.BytesIO(mlp(seed=1).SerializeToString()), "cpu")
        twice = registry.create_version(tenant, "b", io.BytesIO(mlp(seed=2).SerializeToString()), "cpu")
        queued = registry.create_version(tenant, "c", io.BytesIO(mlp(seed=3).SerializeToString()), "cpu")
        registry.set_status(once.id, "compiling")
        registry.set_status(twice.id, "compiling", error=INTERRUPTED)
        assert registry.resume_unfinished() == [(once.id, tenant), (queued.id, tenant)]
        assert registry.get_version(once.id).status == "queued"
        assert registry.get_version(once.id).error == INTERRUPTED
        failed = registry.get_version(twice.id)
        assert failed.status == "failed" and "interrupted twice" in failed.error
    finally:
        services.close()


@pytest.fixture(autouse=True)
def _no_leftover_children():
    yield
    import multiprocessing

    assert not [p for p in multiprocessing.active_children() if p.name.startswith("compile-")]


def test_a_compile_that_meets_a_storage_outage_is_tried_again(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(pool, "OUTAGE_RETRY_S", 0.2)
    client, keys = serve(tmp_path)
    with client:
        store = client.app.state.services.store
        real_get_file, calls = store.get_file, []

        def flaky_get_file(key: str, path: Path) -> None:
            calls.append(key)
            if len(calls) == 1:
                raise Unavailable("the object store is unreachable")
            real_get_file(key, path)

        monkeypatch.setattr(store, "get_file", flaky_get_file)
        upload(client, keys["alice"], "mlp", mlp().SerializeToString())
        version = wait_for(client, keys["alice"], "mlp", 1)
        assert version["status"] == "ready", version
        assert len(calls) >= 2


# -- progress while compiling


class _Seen(list):
    """Progress the test has seen, and an event set at the first."""

    def __init__(self) -> None:
        super().__init__()
        self.first = threading.Event()

    def append(self, item) -> None:
        super().append(item)
        self.first.set()


def test_progress_shows_while_compiling_and_is_gone_once_ready(tmp_path: Path, monkeypatch) -> None:
    client, keys = serve(tmp_path, compile_candidates=("native-blas", "native-loops", "numpy"))
    seen = _Seen()
    with client:
        registry = client.app.state.services.registry
        real_set_status = registry.set_status

        def ready_once_seen(version_id: int, status: str, **fields):
            if status == "ready":  # a compile faster than the polling (cached builds) waits for it, 30 s at most
                seen.first.wait(30)
            return real_set_status(version_id, status, **fields)

        monkeypatch.setattr(registry, "set_status", ready_once_seen)
        upload(client, keys["alice"], "mlp", mlp(hidden=256).SerializeToString())
        version = wait_for(client, keys["alice"], "mlp", 1, progress=seen)
    assert version["status"] == "ready", version
    assert version["progress"] is None and version["report"]["chosen"]
    assert seen, "no progress was shown while the version compiled"
    assert {p["phase"] for p in seen} <= set(PHASES)
    assert all(p["candidates_total"] == 3 and 0 <= p["candidates_measured"] <= 3 for p in seen), seen
    assert all(p["elapsed_seconds"] >= 0 for p in seen), seen


class _Registry:
    """set_progress calls, with their times; optionally failing like a database that is down."""

    def __init__(self, failing: bool = False) -> None:
        self.failing = failing
        self.written: list[tuple[float, dict]] = []

    def set_progress(self, version_id: int, progress: dict) -> None:
        self.written.append((time.monotonic(), progress))
        if self.failing:
            raise OperationalError("UPDATE model_versions", {}, Exception("could not connect to server"))


def test_progress_is_written_at_most_once_a_second_and_the_latest_last() -> None:
    registry = _Registry()
    writer = ProgressWriter(registry, version_id=7, interval_s=1.0)

    def written(count: int) -> None:
        deadline = time.monotonic() + 5
        while len(registry.written) < count and time.monotonic() < deadline:
            time.sleep(0.01)

    writer({"phase": "measure", "candidates_total": 100, "candidates_measured": 0})
    written(1)  # the first at once
    for k in range(1, 100):
        writer({"phase": "measure", "candidates_total": 100, "candidates_measured": k})
    written(2)
    time.sleep(0.2)
    writer.close()
    (first_at, first), (then_at, then) = registry.written
    assert first["candidates_measured"] == 0 and then["candidates_measured"] == 99
    assert then_at - first_at >= 0.99 and then["started_at"] == first["started_at"]
    writer({"phase": "measure", "candidates_total": 100, "candidates_measured": 100})
    time.sleep(1.2)
    assert len(registry.written) == 2, "a closed writer wrote"


def test_a_failing_progress_write_does_not_fail_the_compile(tmp_path: Path, monkeypatch, caplog) -> None:
    services = build_services(make_settings(tmp_path / "data"))
    try:
        registry = services.registry
        tenant = authenticate(services.db, f"Bearer {create_key(services.db, 'alice')}").id
        version = registry.create_version(tenant, "mlp", io.BytesIO(mlp().SerializeToString()), "cpu")
        failing = _Registry(failing=True)
        monkeypatch.setattr(registry, "set_progress", failing.set_progress)
        assert compile_version(version.id, registry) == "ready"
        stored = registry.get_version(version.id)
        assert stored.status == "ready" and stored.report["chosen"] == "native-blas"
        assert failing.written, "the compile reported no progress"
        assert "could not store the progress of version" in caplog.text
    finally:
        services.close()


def test_a_status_write_to_a_version_deleted_after_its_read_is_dropped(tmp_path: Path) -> None:
    """A compile finishing while its version is deleted: the delete lands between set_status's
    read and its write (an UPDATE of no row), which must not raise into the compile slot."""
    from sqlalchemy import delete, event

    from cloud.db import ModelVersion

    services = build_services(make_settings(tmp_path / "data"))
    try:
        registry = services.registry
        tenant = authenticate(services.db, f"Bearer {create_key(services.db, 'alice')}").id
        version = registry.create_version(tenant, "mlp", io.BytesIO(mlp().SerializeToString()), "cpu")

        def delete_first(session, context, instances) -> None:
            with services.db.engine.begin() as other:
                other.execute(delete(ModelVersion).where(ModelVersion.id == version.id))

        event.listen(services.db._sessions, "before_flush", delete_first)
        try:
            registry.set_status(version.id, "ready", report={"chosen": "native-blas"})
        finally:
            event.remove(services.db._sessions, "before_flush", delete_first)
        assert registry.get_version(version.id) is None
    finally:
        services.close()


def test_a_late_progress_write_does_not_cover_the_final_report(tmp_path: Path) -> None:
    services = build_services(make_settings(tmp_path / "data"))
    try:
        registry = services.registry
        tenant = authenticate(services.db, f"Bearer {create_key(services.db, 'alice')}").id
        version = registry.create_version(tenant, "mlp", io.BytesIO(mlp().SerializeToString()), "cpu")
        registry.set_status(version.id, "compiling")
        registry.set_progress(version.id, {"phase": "build", "candidates_total": 1, "candidates_measured": 0})
        registry.set_status(version.id, "ready", report={"chosen": "native-blas"})
        registry.set_progress(version.id, {"phase": "measure", "candidates_total": 1, "candidates_measured": 1})
        assert registry.get_version(version.id).report == {"chosen": "native-blas"}
    finally:
        services.close()


# -- precision


def test_the_worker_compiles_a_version_in_its_precision_and_caches_each_apart(tmp_path: Path) -> None:
    services = build_services(make_settings(tmp_path / "data", targets=("cpu", "h100"), allow_unmeasured_compile=True))
    data = mlp().SerializeToString()
    stand_in = compile_onnx(data)  # what the fake returns: the compile's arguments are the point
    compiled: list[tuple[int, str, str]] = []

    def recording(version_id: int, data: bytes, target: str, progress=None, precision="exported") -> Artifact:
        compiled.append((version_id, target, precision))
        return stand_in

    try:
        registry = services.registry
        tenant = authenticate(services.db, f"Bearer {create_key(services.db, 'alice')}").id
        exported = registry.create_version(tenant, "mlp", io.BytesIO(data), "h100")
        half = registry.create_version(tenant, "mlp", io.BytesIO(data), "h100", precision="float16")
        half_again = registry.create_version(tenant, "mlp", io.BytesIO(data), "h100", precision="float16")
        for version in (exported, half, half_again):
            assert compile_version(version.id, registry, recording) == "ready"
        # the same bytes and target in another precision compile again; in the same one, not
        assert compiled == [(exported.id, "h100", "exported"), (half.id, "h100", "float16")]
        keys = [registry.get_version(v.id).artifact_key for v in (exported, half, half_again)]
        assert keys[0] != keys[1] == keys[2]
    finally:
        services.close()


def test_the_cache_key_names_a_narrow_precision_and_keeps_the_exported_keys() -> None:
    options, graph = compile_options(), "graphs/abc"
    # the keys before precisions existed: exported artifacts stored then are found again
    version = COMPILER_VERSION
    assert cache_key(graph, "h100", options, "exported") == artifact_key(graph, "h100", options, compiler_version=version)
    assert cache_key(graph, "cpu", options) == artifact_key(
        graph, "cpu", {**options, "cpu": cpu_fingerprint()}, compiler_version=version
    )
    keys = {cache_key(graph, "h100", options, p) for p in ("exported", "float16", "bfloat16")}
    assert len(keys) == 3


def mlp_file(folder: Path) -> Path:
    """A graph file, as the sandbox takes one."""
    path = folder / "mlp.onnx"
    path.write_bytes(mlp().SerializeToString())
    return path


def test_the_sandbox_hands_the_precision_to_the_compile_in_its_child(tmp_path: Path) -> None:
    sandbox = Sandbox(timeout_s=60, memory_bytes=4 * 1024**3)
    # the compiler refuses a narrow float on the cpu before any work: the child got the precision
    with pytest.raises(CompileCrashed, match="ValueError"):
        sandbox.compile(1, mlp_file(tmp_path), "cpu", precision="float16")


def test_a_deleted_model_does_not_poison_the_next_upload_of_another_tenant(tmp_path: Path) -> None:
    client, keys = serve(tmp_path)
    with client:
        upload(client, keys["alice"], "first", mlp(seed=1).SerializeToString())
        assert wait_for(client, keys["alice"], "first", 1)["status"] == "ready"
        assert client.delete("/v1/models/first", headers=auth(keys["alice"])).status_code == 200
        # bytes never seen before, so no artifact to reuse: the compile must run and finish
        upload(client, keys["bob"], "second", mlp(seed=2).SerializeToString())
        assert wait_for(client, keys["bob"], "second", 1, timeout=30)["status"] == "ready"


# -- cancelling names a compile, not a version id


def test_cancelling_a_compile_that_ended_or_never_ran_stops_no_later_compile(tmp_path: Path) -> None:
    sandbox = Sandbox(timeout_s=60, memory_bytes=4 * 1024**3, candidates=("numpy",), search=False)
    data = mlp_file(tmp_path)
    ended = CompileHandle(1)
    sandbox.compile(1, data, "cpu", handle=ended)
    ended.cancel()  # too late: nothing runs under it any more
    # the next compile with that id (SQLite gives a deleted version's id again) is its own
    assert sandbox.compile(1, data, "cpu").report["chosen"] == "numpy"
    early = CompileHandle(2)
    early.cancel()
    with pytest.raises(CompileCancelled):
        sandbox.compile(2, data, "cpu", handle=early)


class _Versions:
    """The registry as the pool reads it: each version's graph size."""

    def __init__(self, sizes: dict[int, int]) -> None:
        self.sizes = sizes

    def get_version(self, version_id: int):
        return SimpleNamespace(graph_bytes=self.sizes[version_id])


class FakeCompiles:
    """A pool's compile function that runs until the test finishes it or its handle is cancelled."""

    def __init__(self) -> None:
        self.started: list[int] = []
        self.handles: dict[int, CompileHandle] = {}
        self.results: dict[int, str | None] = {}
        self._finish: dict[int, threading.Event] = {}
        self._lock = threading.Lock()

    def __call__(self, version_id: int, handle: CompileHandle) -> str | None:
        with self._lock:
            self.started.append(version_id)
            self.handles[version_id] = handle
            finish = self._finish.setdefault(version_id, threading.Event())
        while not finish.wait(0.01):
            if handle.cancelled:
                self.results[version_id] = None
                return None
        finish.clear()
        self.results[version_id] = "ready"
        return "ready"

    def finish(self, version_id: int) -> None:
        with self._lock:
            self._finish.setdefault(version_id, threading.Event()).set()

    def wait(self, condition, what: str) -> None:
        deadline = time.monotonic() + 10
        while not condition():
            assert time.monotonic() < deadline, what
            time.sleep(0.005)


def test_the_pool_cancels_only_the_compile_running_when_asked() -> None:
    compiles = FakeCompiles()
    pool = EmbeddedCompilePool(_Versions({1: 100, 2: 100}), workers=1, run=compiles)
    try:
        pool.submit(1, tenant_id=10)
        compiles.wait(lambda: 1 in compiles.started, "version 1 did not start")
        compiles.finish(1)
        compiles.wait(lambda: compiles.results.get(1) == "ready" and not pool.running(), "version 1 did not end")
        pool.cancel([1])  # deleted after its compile ended: there is nothing to stop
        pool.submit(1, tenant_id=20)  # the id again, for another version
        compiles.wait(lambda: compiles.started.count(1) == 2, "the second version 1 did not start")
        second = compiles.handles[1]
        assert not second.cancelled
        pool.cancel([1])  # while it runs: this compile stops
        compiles.wait(lambda: compiles.results[1] is None, "the running compile was not stopped")
        assert second.cancelled
        pool.submit(2, tenant_id=10)
        compiles.wait(lambda: 2 in compiles.started, "version 2 did not start")
        compiles.finish(2)
        compiles.wait(lambda: compiles.results.get(2) == "ready", "version 2 did not end")
    finally:
        pool.shutdown()


def test_a_compile_cancelled_while_its_version_remains_is_queued_again(tmp_path: Path) -> None:
    services = build_services(make_settings(tmp_path / "data"))
    try:
        registry = services.registry
        tenant = authenticate(services.db, f"Bearer {create_key(services.db, 'alice')}").id
        version = registry.create_version(tenant, "mlp", io.BytesIO(mlp().SerializeToString()), "cpu")

        def cancelled(*args, **kwargs) -> Artifact:
            raise CompileCancelled("stopped")

        assert compile_version(version.id, registry, cancelled) == "queued"
        assert registry.get_version(version.id).status == "queued"
    finally:
        services.close()


def test_the_server_streams_the_graph_to_a_file_the_compile_reads(tmp_path: Path, monkeypatch) -> None:
    services = build_services(make_settings(tmp_path / "data"))
    try:
        registry, store = services.registry, services.store
        tenant = authenticate(services.db, f"Bearer {create_key(services.db, 'alice')}").id
        version = registry.create_version(tenant, "mlp", io.BytesIO(mlp().SerializeToString()), "cpu")
        read_whole: list[str] = []
        real_get = store.get

        def get(key: str) -> bytes:
            if key.startswith("graphs/"):
                read_whole.append(key)
            return real_get(key)

        monkeypatch.setattr(store, "get", get)
        files: list[Path] = []

        def from_file(version_id: int, graph: Path, target: str, progress=None, precision="exported") -> Artifact:
            files.append(graph)
            return compile_here(version_id, graph, target, progress, precision)

        assert compile_version(version.id, registry, from_file) == "ready"
        assert not read_whole, "the server read the graph whole into memory"
        assert files and not files[0].exists()  # the temporary file is gone
    finally:
        services.close()
