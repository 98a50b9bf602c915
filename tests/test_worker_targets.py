"""Compiling where the device is: a worker takes a GPU target only when it holds a GPU of that
type's compute capability (a fake probe stands in for the driver), refuses it otherwise, or
compiles it unmeasured where settings allow, labelled so, until a worker holding the GPU starts
and compiles it again while the version keeps serving. Real Redis, Celery workers, PostgreSQL."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from fastapi.testclient import TestClient

from api.main import create_app
from api.server import BackgroundServer
from cloud.auth import authenticate, create_key
from cloud.db import open_database
from cloud.settings import Settings
from cloud.storage import make_object_store
from luminal_cloud import Client
from registry import RESOLVE_CACHE_S, UNMEASURED, Registry
from tests.conftest import auth, make_settings, upload, wait_for
from tests.onnx_models import mlp
from tests.processes import ServiceProcess, flushed_redis, settings_env
from worker import queue
from worker.celery_app import measured_queue
from worker.devices import (
    ALLOW_UNMEASURED_SETTING,
    FoundGpu,
    NoGpu,
    check_targets,
    show_only_gpu,
    unmeasured_label,
)

# a Redis database of its own, emptied before each test
REDIS_DB = 14
H100 = FoundGpu(0, "NVIDIA H100 80GB HBM3", "sm_90")
MLP = mlp().SerializeToString()


def no_gpu(ordinal: int) -> FoundGpu:
    raise NoGpu("no CUDA driver on this machine")


def gpu(found: FoundGpu):
    asked: list[int] = []

    def probe(ordinal: int) -> FoundGpu:
        asked.append(ordinal)
        return FoundGpu(ordinal, found.name, found.arch)

    probe.asked = asked  # type: ignore[attr-defined]
    return probe


# -- the check, with fake probes


def test_a_worker_refuses_a_target_whose_device_it_lacks() -> None:
    check = check_targets(("cpu", "h100"), "cuda:0", no_gpu, allow_unmeasured=False)
    assert check.measured == ("cpu",) and check.unmeasured == () and check.gpu_ordinal is None
    reason = check.refused["h100"]
    # the target, its compute capability, what was found, and the way out
    assert "target 'h100'" in reason and "sm_90" in reason
    assert "found no GPU at cuda:0 (no CUDA driver on this machine)" in reason
    assert f"{ALLOW_UNMEASURED_SETTING}=true" in reason and "--device cuda:N" in reason


def test_a_gpu_of_another_compute_capability_is_named_in_the_refusal() -> None:
    a100 = FoundGpu(0, "NVIDIA A100-SXM4-80GB", "sm_80")
    check = check_targets(("h100", "a100"), "cuda:0", gpu(a100), allow_unmeasured=False)
    assert check.measured == ("a100",) and check.gpu_ordinal == 0
    assert "the GPU at cuda:0 is a NVIDIA A100-SXM4-80GB (sm_80)" in check.refused["h100"]


def test_a_worker_holding_the_gpu_takes_every_type_of_its_compute_capability() -> None:
    probe = gpu(H100)
    check = check_targets(("cpu", "h100", "cuda", "h200"), "cuda:1", probe, allow_unmeasured=False)
    assert check.measured == ("cpu", "h100", "cuda", "h200") and not check.refused
    assert probe.asked == [1] and check.gpu_ordinal == 1
    # no device named: GPU 0, the one the compiler times on
    assert check_targets(("h100",), None, probe, allow_unmeasured=False).gpu_ordinal == 0


def test_device_cpu_asks_no_gpu_and_cpu_targets_ask_none() -> None:
    probe = gpu(H100)
    check = check_targets(("cpu", "h100"), "cpu", probe, allow_unmeasured=False)
    assert "was given no GPU (--device cpu)" in check.refused["h100"]
    assert check_targets(("cpu",), "cuda:0", probe, allow_unmeasured=False).measured == ("cpu",)
    assert probe.asked == []


def test_the_setting_lets_a_worker_without_the_gpu_compile_unmeasured() -> None:
    check = check_targets(("cpu", "h100"), None, no_gpu, allow_unmeasured=True)
    assert check.measured == ("cpu",) and check.unmeasured == ("h100",) and not check.refused
    assert check.accepted == ("cpu", "h100") and check.gpu_ordinal is None


def test_an_unknown_device_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="device 'tpu:0' is not known"):
        check_targets(("cpu",), "tpu:0", no_gpu, allow_unmeasured=False)


def test_the_worker_gpu_becomes_gpu_0_of_its_compiles() -> None:
    environ: dict[str, str] = {}
    show_only_gpu(0, environ)
    assert environ == {}
    show_only_gpu(2, environ)
    assert environ == {"CUDA_VISIBLE_DEVICES": "2"}
    restricted = {"CUDA_VISIBLE_DEVICES": "4,5,6"}
    show_only_gpu(1, restricted)
    assert restricted == {"CUDA_VISIBLE_DEVICES": "5"}


# -- the worker command, for real (this machine has no GPU)


def test_the_worker_command_refuses_a_gpu_target_without_its_gpu(tmp_path) -> None:
    settings = make_settings(tmp_path / "data", targets=("cpu", "h100"))
    env = {**settings_env(settings), "LUMINAL_REDIS_URL": "redis://127.0.0.1:6379/14"}
    env.pop(ALLOW_UNMEASURED_SETTING, None)
    for device in (["--device", "cuda:0"], ["--device", "cpu"], []):
        refused = subprocess.run(
            [sys.executable, "-m", "luminal_cloud.cli", "worker", "--targets", "cpu,h100", *device],
            env=env, capture_output=True, text=True, timeout=120, check=False,
        )
        assert refused.returncode == 1, refused.stderr
        assert "luminal-cloud worker: target 'h100'" in refused.stderr, refused.stderr
        assert ALLOW_UNMEASURED_SETTING in refused.stderr and "Traceback" not in refused.stderr
        # refused before it subscribed to anything
        assert "ready." not in refused.stderr
        found = "was given no GPU (--device cpu)" if device[-1:] == ["cpu"] else "found no GPU at cuda:0"
        assert found in refused.stderr, refused.stderr


# -- the embedded server


def test_the_embedded_server_refuses_a_gpu_upload_without_the_gpu_or_the_setting(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(queue, "probe_cuda", no_gpu)
    queue._embedded_check.cache_clear()
    settings = make_settings(tmp_path / "data", targets=("cpu", "h100"))
    db = open_database(settings)
    key = create_key(db, "alice")
    db.dispose()
    try:
        with TestClient(create_app(settings)) as client:
            response = client.post(
                "/v1/models", headers=auth(key), files={"file": ("m.onnx", MLP)}, data={"name": "mlp", "target": "h100"}
            )
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["code"] == "invalid_request" and error["target"] == "h100"
            assert "cannot compile for h100 here" in error["message"] and ALLOW_UNMEASURED_SETTING in error["message"]
            assert client.get("/v1/models/mlp", headers=auth(key)).status_code == 404
            assert upload(client, key, "cpu-mlp", MLP)["status"] == "queued"  # cpu is not refused

        allowed = settings.model_copy(update={"allow_unmeasured_compile": True})
        with BackgroundServer(allowed) as live:
            with Client(live.url, key) as sdk:
                sdk.deploy(MLP, "mlp", target="h100", progress=False, timeout=120)
                [version] = sdk.model("mlp")["versions"]
            assert version["report"][UNMEASURED] == unmeasured_label("h100")
            assert "not timed" in version["report"][UNMEASURED]["why"]
            assert version["report"]["verified_on"] == "cpu emulation"
            # and the command line's view of the version says so
            env = {k: v for k, v in os.environ.items() if not k.startswith("LUMINAL_")}
            status = subprocess.run(
                [sys.executable, "-m", "luminal_cloud.cli", "status", "mlp"],
                env={**env, "LUMINAL_URL": live.url, "LUMINAL_API_KEY": key},
                capture_output=True, text=True, timeout=60, check=False,
            )
            assert status.returncode == 0, status.stderr
            assert "unmeasured" in status.stdout and "not timed" in status.stdout, status.stdout
    finally:
        queue._embedded_check.cache_clear()


# -- the registry's part, on SQLite and PostgreSQL


@pytest.fixture(params=["sqlite", "postgresql"])
def registry(request, tmp_path: Path) -> Iterator[Registry]:
    database_url = request.getfixturevalue("postgres_url") if request.param == "postgresql" else ""
    settings = make_settings(tmp_path / "data", targets=("cpu", "h100"), database_url=database_url)
    db = open_database(settings)
    yield Registry(db, make_object_store(settings), settings.targets)
    db.dispose()


def test_the_registry_finds_unmeasured_versions_and_swaps_their_artifact_once(registry: Registry) -> None:
    tenant = authenticate(registry.db, f"Bearer {create_key(registry.db, 'alice')}").id
    labelled, measured, other, queued = (
        registry.create_version(tenant, name, io.BytesIO(MLP), target)
        for name, target in (("a", "h100"), ("b", "h100"), ("c", "cpu"), ("d", "h100"))
    )
    registry.set_status(labelled.id, "ready", artifact_key="old", signature={}, report={"k": 1, UNMEASURED: {}})
    registry.set_status(measured.id, "ready", artifact_key="m", signature={}, report={"k": 1})
    registry.set_status(other.id, "ready", artifact_key="c", signature={}, report={"k": 1, UNMEASURED: {}})
    assert registry.unmeasured_versions(["h100"]) == [labelled.id]
    assert registry.resolve(tenant, "a", None).artifact_key == "old"

    # a swap from an artifact the version no longer has changes nothing
    assert not registry.replace_artifact(labelled.id, "stale", "new", {}, {"k": 2})
    assert not registry.replace_artifact(queued.id, "old", "new", {}, {"k": 2})
    assert registry.replace_artifact(labelled.id, "old", "new", {"s": 1}, {"k": 2})
    assert not registry.replace_artifact(labelled.id, "old", "newer", {}, {"k": 3})
    swapped = registry.get_version(labelled.id)
    assert (swapped.status, swapped.artifact_key, swapped.report) == ("ready", "new", {"k": 2})
    assert registry.resolve(tenant, "a", None).artifact_key == "new"  # served at once, not after the cache
    assert registry.unmeasured_versions(["h100"]) == []


# -- the distributed mode: an unmeasured compile, then a worker holding the GPU starts

# `luminal-cloud worker` with a probe that finds an H100 at every ordinal (its compiles still
# run in the CPU emulation: what is tested is who compiles what, and the swap)
FAKE_H100_WORKER = """
import sys
import worker.devices
from worker.devices import FoundGpu
worker.devices.probe_cuda = lambda ordinal: FoundGpu(ordinal, "NVIDIA H100 80GB HBM3 (fake)", "sm_90")
from luminal_cloud.cli import main
sys.exit(main(sys.argv[1:]))
"""


class FakeH100Worker(ServiceProcess):
    def __init__(self, settings: Settings, log: Path, *args: str) -> None:
        self.log = log
        self.ready_text = " ready."
        with open(log, "ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-c", FAKE_H100_WORKER, "worker", *args],
                env=settings_env(settings), stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )


@pytest.fixture
def redis_url() -> Iterator[str]:
    yield from flushed_redis(REDIS_DB)


def test_a_worker_holding_the_gpu_compiles_unmeasured_versions_again_while_they_serve(
    tmp_path, redis_url, monkeypatch
) -> None:
    settings = make_settings(
        tmp_path / "data", compile_backend="celery", redis_url=redis_url, targets=("cpu", "h100"), compile_timeout_s=60.0
    )
    db = open_database(settings)
    key = create_key(db, "alice")
    db.dispose()
    workers: list[ServiceProcess] = []
    try:
        with TestClient(create_app(settings)) as client:
            # a worker without the GPU, allowed to compile for it anyway
            monkeypatch.setenv(ALLOW_UNMEASURED_SETTING, "true")
            unmeasured = ServiceProcess(
                settings, tmp_path / "unmeasured.log", "worker", "--targets", "h100", "--device", "cpu",
                "--concurrency", "1", ready_text=" ready.",
            )
            workers.append(unmeasured)
            unmeasured.wait_ready()
            monkeypatch.delenv(ALLOW_UNMEASURED_SETTING)
            upload(client, key, "mlp", MLP, target="h100")
            first = wait_for(client, key, "mlp", 1, timeout=120)
            assert first["status"] == "ready", first
            assert first["report"][UNMEASURED]["recompile_when"] == "a worker holding an sm_90 GPU for h100 starts"
            registry = client.app.state.services.registry
            version_id = registry.unmeasured_versions(["h100"])[0]
            old_key = registry.get_version(version_id).artifact_key
            unmeasured.stop()

            # the recompile it queued is dropped: the next worker finds the version by itself
            broker = redis.Redis.from_url(redis_url)
            dropped = [k for k in broker.scan_iter(match=f"{measured_queue('h100')}*")]
            assert dropped, "the unmeasured compile queued no recompile"
            broker.delete(*dropped)
            broker.close()

            holding = FakeH100Worker(settings, tmp_path / "holding.log", "--targets", "h100", "--concurrency", "1")
            workers.append(holding)
            holding.wait_ready()
            tenant = authenticate(registry.db, f"Bearer {key}").id
            seen: list[tuple[str, bool, str]] = []
            deadline = time.monotonic() + 120
            while not seen or seen[-1][1]:
                assert time.monotonic() < deadline, f"the version was not compiled again:\n{holding.text()}"
                [shown] = client.get("/v1/models/mlp", headers=auth(key)).json()["versions"]
                served = registry.resolve(tenant, "mlp", 1)
                seen.append((shown["status"], UNMEASURED in (shown["report"] or {}), served.artifact_key))
                time.sleep(0.05)
            # ready and served throughout: the old artifact until the new one replaced it (which
            # this gateway serves once its answer of the last RESOLVE_CACHE_S expires)
            new_key = registry.get_version(version_id).artifact_key
            assert new_key != old_key
            assert seen[0] == ("ready", True, old_key), seen  # (the compile takes seconds)
            assert {status for status, _, _ in seen} == {"ready"}, seen
            assert {k for _, _, k in seen} <= {old_key, new_key}, seen
            time.sleep(RESOLVE_CACHE_S)
            assert registry.resolve(tenant, "mlp", 1).artifact_key == new_key
            assert "queued 1 unmeasured version(s) of h100" in holding.text()
            assert "its measured artifact replaced the unmeasured one" in holding.text()
    finally:
        for worker in workers:
            worker.stop()


