"""`luminal-cloud stack` for real: it starts moto's S3 server, a Celery worker, two runtime
processes and a gateway against the local Redis and a PostgreSQL database it creates; a model is
deployed and served through the SDK and matches onnxruntime; Ctrl-C stops every process it
started. A piece that cannot start, or a database that cannot be reached, is named in a message
and the command exits 1, leaving nothing running. Once running, the stack restarts a role killed
under load (runtime, worker, gateway, S3) and every request still succeeds; the restart policy
(backoff, crash loops) is tested alone with a fake clock, and the supervisor with tiny children."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Self

import numpy as np
import onnxruntime
import pytest
import sqlalchemy

from api.stack import Child, RestartPolicy, Stack, StackError, StopRequested, log_says
from luminal_cloud import Client
from luminal_cloud.errors import APIError, LuminalCloudError
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

    def __init__(self, tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.out, self.err = tmp_path / "stack.out", tmp_path / "stack.err"
        env = {
            **os.environ,
            "LUMINAL_DATA_DIR": str(tmp_path / "data"),
            # one C build per compile, at a test's pace
            "LUMINAL_COMPILE_CANDIDATES": '["native-blas"]',
            **(env or {}),
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

    def all_pids(self) -> set[int]:
        """Every child's pid, the restarted ones' and those they replaced."""
        return {int(pid) for pid in re.findall(r"^\S+\s+pid (\d+)", self.stdout(), re.MULTILINE)}

    def wait_restarted(self, name: str, old_pid: int, timeout: float = 90) -> int:
        """The new pid of `name`, once its restart is listed and it is ready again."""
        deadline = time.monotonic() + timeout
        ready_again = rf"^{name}\s+ready again"
        while self.child_pids()[name] == old_pid or not re.search(ready_again, self.stdout(), re.MULTILINE):
            assert self.process.poll() is None, f"the stack exited:\n{self.stdout()}{self.stderr()}"
            assert time.monotonic() < deadline, f"{name} was not restarted in {timeout} s:\n{self.stdout()}"
            time.sleep(0.2)
        return self.child_pids()[name]

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


# -- a role killed while the stack runs

# the takeover of a dead runtime's requests within a test's patience (the default waits 10 s)
FAST_TAKEOVER = {"LUMINAL_RUNTIME_HEARTBEAT_S": "0.5", "LUMINAL_RUNTIME_CLAIM_IDLE_S": "2"}


class Load:
    """Client threads predicting through the SDK in a loop, each request until it succeeds: the
    SDK retries 503, and a thread tries again when the connection fails (the gateway is restarting)."""

    def __init__(self, url: str, key: str, threads: int = 4) -> None:
        self.url, self.key = url, key
        self.answered = 0
        self.reconnects: list[str] = []  # connections that failed and were tried again
        self.failures: list[str] = []  # requests that did not succeed: wrong outputs, error answers
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._predict, args=(seed,)) for seed in range(threads)]

    def __enter__(self) -> Self:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=120)
        assert not any(thread.is_alive() for thread in self._threads), "a request hung"

    def wait_for(self, answers: int, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while self.answered < answers:
            assert not self.failures, self.failures
            assert time.monotonic() < deadline, f"{self.answered} answers, not {answers}, in {timeout} s"
            time.sleep(0.1)

    def _predict(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        with Client(self.url, self.key, timeout=60) as client:
            while not self._stop.is_set():
                x = rng.standard_normal((int(rng.integers(1, 4)), 8)).astype(np.float32)
                if (y := self._until_answered(client, x)) is None:
                    return
                try:
                    np.testing.assert_allclose(y, reference(x), rtol=1e-4, atol=1e-5)
                except AssertionError as exc:
                    self.failures.append(str(exc))
                with self._lock:
                    self.answered += 1

    def _until_answered(self, client: Client, x: np.ndarray) -> np.ndarray | None:
        deadline = time.monotonic() + 90
        while True:
            try:
                return client.predict("mlp", {"x": x})["y"]
            except APIError as exc:  # an answer, after the SDK's retries: a failure
                self.failures.append(f"{exc.status}: {exc}")
                return None
            except LuminalCloudError as exc:
                self.reconnects.append(str(exc))
                if time.monotonic() > deadline:
                    self.failures.append(f"no connection for 90 s: {exc}")
                    return None
                time.sleep(0.2)


def serving_runtime(stack: StackCommand, logs: Path) -> str:
    """The runtime the gateway placed mlp on first (its id ends in the process's pid)."""
    pid = int(re.search(r"placed mlp v1 on \S+-(\d+)-[0-9a-f]{6}$", (logs / "gateway.log").read_text(), re.MULTILINE).group(1))
    return next(name for name, known in stack.child_pids().items() if known == pid)


def test_the_stack_restarts_any_role_killed_under_load_and_every_request_succeeds(
    tmp_path, redis_url, missing_database
) -> None:
    port = free_port()
    logs = tmp_path / "data" / "logs"
    stack = StackCommand(
        tmp_path, "--port", str(port), "--workers", "1", "--runtimes", "2", "--redis-url", redis_url,
        "--database-url", missing_database, "--tenant", "alice", env=FAST_TAKEOVER,
    )
    try:
        stack.wait_ready()
        url = f"http://127.0.0.1:{port}"
        with Client(url, stack.api_key()) as client:
            assert client.deploy(MODEL.SerializeToString(), name="mlp")["status"] == "ready"

        with Load(url, stack.api_key()) as load:
            load.wait_for(answers=20)
            killed = [serving_runtime(stack, logs), "worker-1", "gateway"]
            for name in killed:
                old_pid = stack.child_pids()[name]
                os.kill(old_pid, signal.SIGKILL)
                assert stack.wait_restarted(name, old_pid) != old_pid
                if name != "gateway":
                    assert load.reconnects == [], f"the gateway stopped answering when {name} died"
                load.wait_for(answers=load.answered + 20)  # served after the restart too
        assert load.failures == [], load.failures

        # S3 too: moto comes back empty but with its bucket, and the restarted worker compiles a new upload
        old_pid = stack.child_pids()["s3"]
        os.kill(old_pid, signal.SIGKILL)
        stack.wait_restarted("s3", old_pid)
        killed.append("s3")
        with Client(url, stack.api_key()) as client:
            other = mlp(seed=1)
            assert client.deploy(other.SerializeToString(), name="other")["status"] == "ready"
            x = np.ones((2, 8), np.float32)
            session = onnxruntime.InferenceSession(other.SerializeToString(), providers=["CPUExecutionProvider"])
            expected = session.run(None, {"x": x})[0]
            np.testing.assert_allclose(client.predict("other", {"x": x})["y"], expected, rtol=1e-4, atol=1e-5)

        out = stack.stdout()
        for name in killed:
            log = logs / f"{name}.log"
            died = rf"^{name}\s+killed by SIGKILL after [\d.]+ s up; restarting in 0\.5 s \(restart 1 within 60 s, 5 allowed\)"
            assert re.search(rf"{died}.*; log {re.escape(str(log))}$", out, re.MULTILINE), out
            # appended: the run that was killed is still there, with a line saying how it ended
            assert "--- luminal-cloud stack: restarted; the run above killed by SIGKILL ---" in log.read_text()
        assert "moto keeps objects in memory, so the restarted S3 server starts empty" in out
        assert re.search(r"^s3\s+ready again.*; bucket 'luminal-cloud' created again, empty$", out, re.MULTILINE), out
        assert (logs / f"{killed[0]}.log").read_text().count("serving device cpu") == 2

        stack.process.send_signal(signal.SIGINT)
        assert stack.wait() == 0, stack.stderr()
        for pid in stack.all_pids():
            assert running_in_group(pid) == [], f"process group {pid} left processes running"
    finally:
        stack.close()


# -- the supervisor, with children that are a line of Python

CHILD = """
import os, signal, sys, time
from pathlib import Path
here = Path(sys.argv[1])
runs = len(list(here.glob("run-*")))
(here / f"run-{runs}").touch()
print("up", runs, os.environ["MARK"], sys.argv[2], flush=True)
if runs == 0:  # the first run dies once the test says go
    while not (here / "go").exists():
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(60) if os.environ["LATER_RUNS"] == "live" else sys.exit(3)
"""


def tiny_child(tmp_path: Path, later_runs: str, policy: RestartPolicy) -> Child:
    """A child whose first run kills itself when `tmp_path/go` appears; later runs live, or exit 3."""
    env = {**os.environ, "MARK": "same-env", "LATER_RUNS": later_runs}
    command = [sys.executable, "-c", CHILD, str(tmp_path), "same-args"]
    return Child("tiny", "a test child", command, env, tmp_path / "tiny.log", log_says("up"), policy=policy)


def test_a_dead_child_is_restarted_with_its_command_and_env_and_its_log_appended(tmp_path, capsys) -> None:
    stack = Stack(start_timeout_s=60)
    child = tiny_child(tmp_path, "live", RestartPolicy(backoff_s=0.01))
    try:
        stack.start(child)
        first_pid = child.process.pid
        (tmp_path / "go").touch()

        def stop_once_ready_again() -> None:
            deadline = time.monotonic() + 60
            while not (child.ready and child.process.pid != first_pid) and time.monotonic() < deadline:
                time.sleep(0.01)
            stack.request_stop()

        stopper = threading.Thread(target=stop_once_ready_again)
        stopper.start()
        with pytest.raises(StopRequested):
            stack.watch()
        stopper.join()
    finally:
        stack.stop()
    assert child.log.read_text().splitlines() == [
        "up 0 same-env same-args",
        "--- luminal-cloud stack: restarted; the run above killed by SIGKILL ---",
        "up 1 same-env same-args",
    ]
    out = capsys.readouterr().out
    assert re.search(rf"^tiny\s+killed by SIGKILL after [\d.]+ s up; restarting in 0\.0 s .*; log {child.log}$", out, re.MULTILINE)
    assert re.search(rf"^tiny\s+pid {child.process.pid}\s+restarted: a test child; log {child.log} \(appended\)$", out, re.MULTILINE)
    assert re.search(r"^tiny\s+ready again, [\d.]+ s after its restart$", out, re.MULTILINE)
    assert child.exited() is not None  # and stopped


def test_a_child_in_a_crash_loop_stops_the_stack_naming_it_with_its_log(tmp_path, capsys) -> None:
    stack = Stack(start_timeout_s=60)
    child = tiny_child(tmp_path, "exit", RestartPolicy(backoff_s=0.01, crash_loop_restarts=3))
    try:
        stack.start(child)
        (tmp_path / "go").touch()
        with pytest.raises(StackError) as failure:
            stack.watch()
    finally:
        stack.stop()
    message = str(failure.value)
    assert message.startswith(f"tiny exited with status 3 again after 3 restarts within 60 s, a crash loop; "
                              f"the last lines of {child.log}:\n")
    assert "up 3 same-env same-args" in message  # the tail of its log
    assert len(list(tmp_path.glob("run-*"))) == 4  # the first run and three restarts, no more
    out = capsys.readouterr().out
    assert out.count("restarted: a test child") == 3
    assert re.search(rf"^tiny\s+exited with status 3 after [\d.]+ s up; a crash loop \(3 restarts within 60 s\): "
                     rf"the stack stops; log {child.log}$", out, re.MULTILINE)


# -- the restart policy, with a fake clock: times are plain numbers


def deaths(policy: RestartPolicy, uptimes: list[float], start: float = 1000.0) -> list[float | None]:
    """The restart delays the policy gives a child that dies after each of `uptimes`, restarted
    when told (None: it gave up, and the child is not restarted)."""
    delays: list[float | None] = []
    started = start
    for up in uptimes:
        verdict = policy.died(started, started + up)
        delays.append(verdict.restart_in_s)
        if verdict.restart_in_s is None:
            break
        started += up + verdict.restart_in_s
    return delays


def test_the_backoff_doubles_from_half_a_second_up_to_ten() -> None:
    policy = RestartPolicy(crash_loop_restarts=100)
    assert deaths(policy, [1.0] * 8) == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0, 10.0]


def test_a_child_that_stayed_up_a_while_is_restarted_after_half_a_second_again() -> None:
    policy = RestartPolicy()
    assert deaths(policy, [1.0, 1.0, 1.0, 30.0, 1.0]) == [0.5, 1.0, 2.0, 0.5, 1.0]


def test_a_sixth_quick_death_within_a_minute_is_a_crash_loop() -> None:
    policy = RestartPolicy()
    assert deaths(policy, [1.0] * 7) == [0.5, 1.0, 2.0, 4.0, 8.0, None]


def test_restarts_older_than_the_window_do_not_count_towards_a_crash_loop() -> None:
    # five quick deaths, then one when the first restarts are more than a minute old: restarted,
    # after the longest backoff (never healthy for long enough to start over)
    policy = RestartPolicy(healthy_after_s=1000.0)
    assert deaths(policy, [1.0, 1.0, 1.0, 1.0, 1.0, 45.0]) == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0]


def test_a_child_that_dies_now_and_then_is_restarted_for_ever() -> None:
    # up 20 s each time: never healthy for long, so the backoff stays at its cap, but two deaths a minute
    assert deaths(RestartPolicy(), [20.0] * 50)[-3:] == [10.0, 10.0, 10.0]
