"""`luminal-cloud stack` for real: it starts moto's S3 server, a Celery worker, two runtime
processes and a gateway against the local Redis and a PostgreSQL database it creates; a model is
deployed and served through the SDK and matches onnxruntime; Ctrl-C stops every process it
started. A piece that cannot start, or a database that cannot be reached, is named in a message
and the command exits 1, leaving nothing running."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnxruntime
import pytest
import sqlalchemy
from luminal_cloud import Client

from tests.conftest import POSTGRES_SERVER
from tests.onnx_models import mlp
from tests.processes import free_port
from tests.test_distributed import redis_url as flushed_redis_url

MODEL = mlp()
# a flushed Redis database: the new PostgreSQL database's model ids meet no streams of an earlier run
redis_url = flushed_redis_url


@pytest.fixture
def missing_database() -> Iterator[str]:
    """The URL of a database that does not exist yet (the stack creates it), dropped after the test."""
    name = f"luminal_stack_{uuid.uuid4().hex[:12]}"
    yield f"{POSTGRES_SERVER}/{name}"
    server = sqlalchemy.create_engine(f"{POSTGRES_SERVER}/postgres", isolation_level="AUTOCOMMIT")
    try:
        with server.connect() as connection:
            connection.exec_driver_sql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    finally:
        server.dispose()


def database_exists(url: str) -> bool:
    name = sqlalchemy.make_url(url).database
    server = sqlalchemy.create_engine(f"{POSTGRES_SERVER}/postgres")
    try:
        with server.connect() as connection:
            query = sqlalchemy.text("SELECT 1 FROM pg_database WHERE datname = :name")
            return connection.scalar(query, {"name": name}) is not None
    finally:
        server.dispose()


def running_in_group(pgid: int) -> list[int]:
    """The processes of a process group that still run (a zombie left for init to reap has ended)."""
    running = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _parent, group = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except OSError:
            continue  # it ended while we looked
        if int(group) == pgid and state != "Z":
            running.append(int(stat.parent.name))
    return running


class StackCommand:
    """`luminal-cloud stack <args>` in its own process group, its output in files."""

    def __init__(self, tmp_path: Path, *args: str) -> None:
        self.out, self.err = tmp_path / "stack.out", tmp_path / "stack.err"
        env = {
            **os.environ,
            "LUMINAL_DATA_DIR": str(tmp_path / "data"),
            # one C build per compile, at a test's pace
            "LUMINAL_COMPILE_CANDIDATES": '["native-blas"]',
        }
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "luminal_cloud.cli", "stack", *args],
                env=env, stdout=out, stderr=err, start_new_session=True,
            )

    def stdout(self) -> str:
        return self.out.read_text(errors="replace")

    def stderr(self) -> str:
        return self.err.read_text(errors="replace")

    def wait_ready(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while "stack ready" not in self.stdout():
            if self.process.poll() is not None:
                raise AssertionError(f"the stack exited ({self.process.returncode}):\n{self.stdout()}{self.stderr()}")
            assert time.monotonic() < deadline, f"the stack was not ready in {timeout} s:\n{self.stdout()}"
            time.sleep(0.2)

    def child_pids(self) -> dict[str, int]:
        return {name: int(pid) for name, pid in re.findall(r"^(\S+)\s+pid (\d+)", self.stdout(), re.MULTILINE)}

    def api_key(self) -> str:
        return re.search(r"API key for tenant 'alice': (\S+)", self.stdout()).group(1)

    def wait(self, timeout: float = 90) -> int:
        return self.process.wait(timeout=timeout)

    def close(self) -> None:
        """Whatever a failed test left running goes."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        for pid in self.child_pids().values():
            if running_in_group(pid):
                os.killpg(pid, signal.SIGKILL)


def reference(x: np.ndarray) -> np.ndarray:
    session = onnxruntime.InferenceSession(MODEL.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def test_the_stack_serves_a_model_and_ctrl_c_stops_every_process(tmp_path, redis_url, missing_database) -> None:
    port = free_port()
    stack = StackCommand(
        tmp_path, "--port", str(port), "--workers", "1", "--runtimes", "2", "--redis-url", redis_url,
        "--database-url", missing_database, "--tenant", "alice",
    )
    try:
        stack.wait_ready()
        assert database_exists(missing_database)
        children = stack.child_pids()
        assert sorted(children) == ["gateway", "runtime-1", "runtime-2", "s3", "worker-1"]
        for name in children:
            assert (tmp_path / "data" / "logs" / f"{name}.log").exists()

        rng = np.random.default_rng(3)
        with Client(f"http://127.0.0.1:{port}", stack.api_key()) as client:
            assert client.deploy(MODEL.SerializeToString(), name="mlp")["status"] == "ready"
            for rows in (1, 3, 7):
                x = rng.standard_normal((rows, 8)).astype(np.float32)
                outputs = client.predict("mlp", {"x": x})
                np.testing.assert_allclose(outputs["y"], reference(x), rtol=1e-4, atol=1e-5)

        stack.process.send_signal(signal.SIGINT)  # what Ctrl-C in its terminal sends
        assert stack.wait() == 0, stack.stderr()
        assert "stopping the stack" in stack.stdout()
        for name, pid in children.items():
            assert running_in_group(pid) == [], f"{name} left processes running"
    finally:
        stack.close()


def test_a_piece_that_cannot_start_is_named_with_its_log_and_nothing_is_left(
    tmp_path, redis_url, missing_database
) -> None:
    # nothing listens there: the runtimes cannot reach their object store
    endpoint = f"http://127.0.0.1:{free_port()}"
    stack = StackCommand(
        tmp_path, "--port", str(free_port()), "--runtimes", "1", "--redis-url", redis_url,
        "--database-url", missing_database, "--s3-endpoint", endpoint, "--start-timeout", "60",
    )
    try:
        assert stack.wait() == 1
        message = stack.stderr()
        assert "runtime-1 exited with status 1 before it was ready" in message
        assert "luminal-cloud runtime:" in message  # the runtime's own message, from its log
        assert endpoint in message
        assert "gateway" not in stack.child_pids()  # it starts only once the rest is ready
        for name, pid in stack.child_pids().items():
            assert running_in_group(pid) == [], f"{name} left processes running"
    finally:
        stack.close()


def test_an_unreachable_database_stops_the_stack_before_anything_starts(tmp_path, redis_url) -> None:
    url = "postgresql+psycopg://postgres:secret@127.0.0.1:1/luminal"
    stack = StackCommand(tmp_path, "--redis-url", redis_url, "--database-url", url)
    try:
        assert stack.wait() == 1
        assert "cannot reach PostgreSQL at postgresql+psycopg://postgres:***@127.0.0.1:1/luminal" in stack.stderr()
        assert "secret" not in stack.stderr()
        assert stack.child_pids() == {}
    finally:
        stack.close()
