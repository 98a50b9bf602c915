"""Kill every role under load, with nothing lost (issue 32, part 4).

One stack of real processes, the distributed mode as docker-compose.yml runs it: two Celery
compile workers, two runtime processes and two gateways (each process with a data directory of
its own, as containers have), over a PostgreSQL and a Redis of their own (`initdb` into the work
directory; `redis-server --appendonly yes`, as compose runs it, on a free port) and moto's S3
server. Each scenario sends 16 clients' inference requests over HTTP, uploads a model that
compiles meanwhile, and kills one role midway:

    runtime   SIGKILL to the runtime the model is placed on
    worker    SIGKILL to the worker compiling the upload, mid-compile
    gateway   SIGKILL to one of the gateways; its clients send to the other, as a load balancer would
    redis     SIGKILL to Redis, started again on the same port from its append-only file
    postgres  an immediate shutdown of PostgreSQL (every backend gone at once, no checkpoint),
              started again on the same port

Once its checks are done, whatever died is started again (as `luminal-cloud stack` or Kubernetes would)
for the next scenario. Each checks that every request is answered (200, or 429/503/504 with a
JSON error body: no 500, no other error, no hang), that every 200 carries the model's outputs for
its inputs, that the usage records the scenario added are the 200s' request ids (none twice; on
the gateway kill, at most one more per request cut in flight: it ran, its answer died with the
gateway), and that every accepted upload compiles. Recovery is timed from the kill to the first
200 of a request sent after it, and to steady state: from then on every request sent was answered
200 within twice the slowest 200 before the kill (at least 0.5 s).

    .venv/bin/python benchmarks/reliability.py [--scenarios runtime,worker,gateway,redis,postgres]
        [--quick] [--write docs/reliability.md] [--keep DIR] [--verbose]

Needs `redis-server` on PATH, PostgreSQL's initdb and pg_ctl (PATH or /usr/lib/postgresql/*/bin;
without them the stack uses a new database on the local PostgreSQL at 127.0.0.1:5432 and the
postgres scenario fails naming what is missing; as root they run as the user postgres), and moto's
server (the test extra). The table's rows come from one run; --keep keeps every process's log.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import onnx
import redis
from onnx import TensorProto, helper, numpy_helper
from sqlalchemy import create_engine, text
from sqlalchemy.exc import SQLAlchemyError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SCENARIOS = ("runtime", "worker", "gateway", "redis", "postgres")
SYSTEM_POSTGRES = "postgresql+psycopg://postgres@127.0.0.1:5432"
CLIENTS = 16
TENANT = "acme"
MODEL = "mlp"
# moto takes any credentials, but boto3 signs its requests with some
S3_CREDENTIALS = {"LUMINAL_S3_ACCESS_KEY_ID": "testing", "LUMINAL_S3_SECRET_ACCESS_KEY": "testing"}
# the statuses a request may end with while a role is down; anything else breaks the rules
ALLOWED_ERRORS = (429, 503, 504)
START_TIMEOUT_S = 120.0


class Unavailable(Exception):
    """Something this machine lacks to run a scenario; the message names it."""


@dataclass(frozen=True)
class Timing:
    """How long each part of a scenario lasts."""

    before_s: float = 4.0  # load before the kill
    steady_for_s: float = 5.0  # load once steady again, before the load stops
    max_after_s: float = 40.0  # load after the kill at most
    down_s: float = 2.0  # how long a restarted service (Redis, PostgreSQL) stays down
    compile_timeout_s: float = 20.0  # LUMINAL_COMPILE_TIMEOUT_S; the worker's redelivery waits this + 20 s
    request_timeout_s: float = 10.0  # LUMINAL_REQUEST_TIMEOUT_S
    claim_idle_s: float = 2.0  # LUMINAL_RUNTIME_CLAIM_IDLE_S
    heartbeat_s: float = 0.5  # LUMINAL_RUNTIME_HEARTBEAT_S

    @property
    def hang_s(self) -> float:
        """An answer later than this is a hang: a request waits at most its deadline, then its
        runtime's takeover (the gateway's own bound), plus slack for a loaded machine."""
        return self.request_timeout_s + self.claim_idle_s + 15.0


# the tests' durations: each scenario in about 25 s but the worker's, which waits for the broker's
# redelivery of the killed compile (compile_timeout_s + 20 s)
QUICK = Timing(before_s=1.0, steady_for_s=1.5, max_after_s=20.0, down_s=1.0, compile_timeout_s=10.0)


# -- the model, and what it must answer --


def mlp_bytes(seed: int) -> bytes:
    """Gemm -> Relu -> Gemm -> Softmax, x [batch, 8] -> y [batch, 3]; the seed makes each upload
    a different graph (a compile of its own)."""
    rng = np.random.default_rng(seed)
    weights = {
        "w0": rng.standard_normal((8, 16)).astype(np.float32),
        "b0": rng.standard_normal(16).astype(np.float32),
        "w1": rng.standard_normal((16, 3)).astype(np.float32),
        "b1": rng.standard_normal(3).astype(np.float32),
    }
    nodes = [
        helper.make_node("Gemm", ["x", "w0", "b0"], ["h"]),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("Gemm", ["r", "w1", "b1"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["y"], axis=-1),
    ]
    graph = helper.make_graph(
        nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
        [numpy_helper.from_array(value, name) for name, value in weights.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    return model.SerializeToString()


def mlp_reference(seed: int) -> Callable[[np.ndarray], np.ndarray]:
    weights = {t.name: numpy_helper.to_array(t) for t in onnx.load_from_string(mlp_bytes(seed)).graph.initializer}

    def run(x: np.ndarray) -> np.ndarray:
        logits = np.maximum(x @ weights["w0"] + weights["b0"], 0) @ weights["w1"] + weights["b1"]
        e = np.exp(logits - logits.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)

    return run


# -- processes --


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(condition: Callable[[], bool], timeout: float, what: str, every: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout:.0f} s")
        time.sleep(every)


class Process:
    """A command in its own process group (a container, as far as a kill goes), its output in a log."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], log: Path) -> None:
        self.name, self.command, self.env, self.log = name, command, env, log
        self.popen: subprocess.Popen[bytes] | None = None
        self.offset = 0  # where this run's output begins in the log (a restart appends)

    def start(self) -> Process:
        with open(self.log, "ab") as out:
            self.offset = out.tell()
            self.popen = subprocess.Popen(
                self.command, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        return self

    def text(self) -> str:
        """What this run has written so far."""
        try:
            with open(self.log, "rb") as log:
                log.seek(self.offset)
                return log.read().decode(errors="replace")
        except FileNotFoundError:
            return ""

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.text().splitlines()[-lines:])

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def wait_ready(self, ready: Callable[[Process], bool], timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while not ready(self):
            if not self.alive():
                raise RuntimeError(f"{self.name} exited before it was ready; {self.log}:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} was not ready within {timeout:.0f} s; {self.log}:\n{self.tail()}")
            time.sleep(0.1)

    def signal_group(self, signum: int) -> None:
        if self.popen is not None:
            try:
                os.killpg(self.popen.pid, signum)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        """SIGKILL to the whole group: no handler runs, nothing is cleaned up."""
        self.signal_group(signal.SIGKILL)
        if self.popen is not None:
            self.popen.wait(timeout=30)

    def stop(self) -> None:
        if self.popen is None:
            return
        self.signal_group(signal.SIGTERM)
        try:
            self.popen.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
        self.kill()  # what it started and left behind goes too


def says(words: str) -> Callable[[Process], bool]:
    return lambda process: words in process.text()


def answers(url: str) -> Callable[[Process], bool]:
    def check(_: Process) -> bool:
        try:
            return httpx.get(url, timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    return check


class PrivateRedis:
    """A redis-server of the scenario's own on a free port, persisted as docker-compose.yml
    persists it (appendonly yes), so that a restart on the same port and directory keeps its
    streams, consumer groups and queues."""

    def __init__(self, workdir: Path) -> None:
        if shutil.which("redis-server") is None:
            raise Unavailable("these scenarios start their own Redis and need `redis-server` on PATH")
        self.dir = workdir / "redis"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        command = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
                   "--appendonly", "yes"]
        self.process = Process("redis", command, dict(os.environ), workdir / "redis.log")

    def start(self) -> None:
        self.process.start()
        client = redis.Redis.from_url(self.url, socket_connect_timeout=1)
        try:
            wait_until(lambda: _pings(client), 20, "redis-server did not answer")
        finally:
            client.close()

    def kill(self) -> None:
        self.process.kill()

    def stop(self) -> None:
        self.process.stop()


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


def postgres_bin() -> Path:
    """The folder of initdb and pg_ctl: PATH first, then the newest /usr/lib/postgresql/*/bin."""
    found = shutil.which("initdb")
    candidates = [Path(found).parent] if found else []
    candidates += [Path(p) for p in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)]
    for folder in candidates:
        if (folder / "initdb").exists() and (folder / "pg_ctl").exists():
            return folder
    raise Unavailable(
        "the postgres scenario starts a PostgreSQL of its own and needs PostgreSQL's server binaries, initdb "
        "and pg_ctl, which are neither on PATH nor in /usr/lib/postgresql/*/bin (apt-get install postgresql)"
    )


class PrivatePostgres:
    """A PostgreSQL cluster of the stack's own (initdb, trust auth, a free port), so that it can
    be shut down and started again. initdb refuses to run as root: as root, its commands run as
    the user postgres, and its directory is one of its own under the system's temporary folder
    (postgres may not enter pytest's, which pytest keeps private); its log is copied to the work
    directory at the end."""

    def __init__(self, workdir: Path) -> None:
        self.bin = postgres_bin()
        self.workdir = workdir
        self.as_user: list[str] = []
        if os.geteuid() == 0:
            if shutil.which("runuser") is None:
                raise Unavailable("running as root, the postgres scenario needs `runuser` to run initdb as postgres")
            self.as_user = ["runuser", "-u", "postgres", "--"]
        self.dir = Path(tempfile.mkdtemp(prefix="luminal-reliability-pg-"))
        if self.as_user:
            shutil.chown(self.dir, "postgres")
        self.data = self.dir / "data"
        self.port = free_port()
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/luminal"

    def _run(self, *args: str) -> None:
        result = subprocess.run([*self.as_user, *args], check=False, capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(args[:2])} failed ({result.returncode}):\n{result.stdout}{result.stderr}")

    def init(self) -> None:
        self._run(str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8",
                  "--no-sync")
        self.start()
        server = create_engine(f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres",
                               isolation_level="AUTOCOMMIT")
        with server.connect() as connection:
            connection.exec_driver_sql("CREATE DATABASE luminal")
        server.dispose()

    def start(self) -> None:
        options = f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1"
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.dir / "postgres.log"),
                  "-o", options, "-w", "-t", "60", "start")

    def crash(self) -> None:
        """An immediate shutdown: every backend ends at once, no checkpoint (recovery at the next
        start replays the WAL), as when the server's process dies."""
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop")

    def stop(self) -> None:
        """Stops the server and removes its directory, keeping its log in the work directory."""
        try:
            if (self.data / "postmaster.pid").exists():
                self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop")
        finally:
            if (self.dir / "postgres.log").exists():
                shutil.copy(self.dir / "postgres.log", self.workdir / "postgres.log")
            shutil.rmtree(self.dir, ignore_errors=True)


@contextmanager
def scratch_database() -> Iterator[str]:
    """A new database on the local PostgreSQL, dropped afterwards."""
    name = f"luminal_reliability_{uuid.uuid4().hex[:12]}"
    server = create_engine(f"{SYSTEM_POSTGRES}/postgres", isolation_level="AUTOCOMMIT")
    try:
        with server.connect() as connection:
            connection.exec_driver_sql(f"CREATE DATABASE {name}")
    except SQLAlchemyError as exc:
        server.dispose()
        raise Unavailable(f"these scenarios need the local PostgreSQL at {SYSTEM_POSTGRES}: {exc}") from None
    try:
        yield f"{SYSTEM_POSTGRES}/{name}"
    finally:
        with server.connect() as connection:
            connection.exec_driver_sql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        server.dispose()


# -- the stack --


class Stack:
    """The distributed mode as processes, each with a data directory of its own (a container): two
    Celery workers, two runtimes, two gateways, moto's S3 server, over a Redis and a PostgreSQL
    of its own. Every scenario runs on one stack, as a chaos run does: a role killed in one is
    started again (as `luminal-cloud stack` or Kubernetes would) before the next."""

    def __init__(self, workdir: Path, timing: Timing) -> None:
        self.workdir = workdir
        self.timing = timing
        self.redis = PrivateRedis(workdir)
        self.postgres: PrivatePostgres | None = None
        self.postgres_missing = ""  # why there is no private PostgreSQL (the local one serves instead)
        self.database_url = ""
        self.s3_port = free_port()
        self.gateway_ports = [free_port() for _ in range(2)]
        self.urls = [f"http://127.0.0.1:{port}" for port in self.gateway_ports]
        self.key = ""
        self.next_seed = 1  # each upload a graph of its own

    @classmethod
    @contextmanager
    def running(cls, workdir: Path, timing: Timing) -> Iterator[Stack]:
        """A started stack serving the model, stopped (and its services) at the end."""
        workdir.mkdir(parents=True, exist_ok=True)
        stack = cls(workdir, timing)
        with ExitStack() as undo:
            stack.redis.start()
            undo.callback(stack.redis.stop)
            try:
                stack.postgres = PrivatePostgres(workdir)
                undo.callback(stack.postgres.stop)
                stack.postgres.init()
                stack.database_url = stack.postgres.url
            except Unavailable as exc:
                stack.postgres, stack.postgres_missing = None, str(exc)
                stack.database_url = undo.enter_context(scratch_database())
            stack._build()
            undo.callback(stack.stop)
            stack.start()
            yield stack

    def _build(self) -> None:
        base = {k: v for k, v in os.environ.items() if not k.startswith("LUMINAL_")}
        self.env = {
            **base,
            **S3_CREDENTIALS,
            "PYTHONUNBUFFERED": "1",
            "LUMINAL_DATABASE_URL": self.database_url,
            "LUMINAL_REDIS_URL": self.redis.url,
            "LUMINAL_COMPILE_BACKEND": "celery",
            "LUMINAL_REQUEST_QUEUE": "redis",
            "LUMINAL_OBJECT_STORE": "s3",
            "LUMINAL_S3_ENDPOINT_URL": f"http://127.0.0.1:{self.s3_port}",
            # one C build per compile, as the tests compile: a compile takes seconds, not a minute
            "LUMINAL_COMPILE_CANDIDATES": '["native-blas"]',
            "LUMINAL_COMPILE_TIMEOUT_S": str(self.timing.compile_timeout_s),
            "LUMINAL_REQUEST_TIMEOUT_S": str(self.timing.request_timeout_s),
            "LUMINAL_RUNTIME_CLAIM_IDLE_S": str(self.timing.claim_idle_s),
            "LUMINAL_RUNTIME_HEARTBEAT_S": str(self.timing.heartbeat_s),
            "LUMINAL_MAX_BATCH_ROWS": "8",
        }
        moto = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.s3_port)]
        self.s3 = Process("s3", moto, self.env, self.workdir / "s3.log")
        self.workers = [self._role(f"worker-{i}", "worker", "--concurrency", "1") for i in (1, 2)]
        self.runtimes = [self._role(f"runtime-{i}", "runtime", "--device", "cpu") for i in (1, 2)]
        self.gateways = [self._role(f"gateway-{i}", "serve", "--port", str(p)) for i, p in enumerate(self.gateway_ports, 1)]

    def _role(self, name: str, *args: str) -> Process:
        env = {**self.env, "LUMINAL_DATA_DIR": str(self.workdir / name)}
        return Process(name, [sys.executable, "-m", "luminal_cloud.cli", *args], env, self.workdir / f"{name}.log")

    def start(self) -> None:
        self.s3.start().wait_ready(answers(f"http://127.0.0.1:{self.s3_port}/moto-api/"))
        for process in (*self.workers, *self.runtimes, *self.gateways):
            process.start()
        for process in (*self.workers, *self.runtimes, *self.gateways):
            process.wait_ready(self.ready_check(process))
        self.key = _create_key(self.database_url, self.workdir)
        model = upload(self, None, MODEL, seed=0, timeout=60)
        wait_compiled(self, None, [model], timeout=120)
        if model.status != "ready":
            raise RuntimeError(f"the model did not compile ({model.status}); logs in {self.workdir}")

    def ready_check(self, process: Process) -> Callable[[Process], bool]:
        if process in self.workers:
            return says(" ready.")
        if process in self.runtimes:
            return says("serving device cpu")
        return answers(f"{self.urls[self.gateways.index(process)]}/readyz")

    def restart(self, process: Process) -> None:
        """Starts a role that died again, as its supervisor would, and waits until it is ready."""
        if not process.alive():
            process.start().wait_ready(self.ready_check(process))

    def stop(self) -> None:
        """The gateways first, so nothing new arrives, then the rest; each wave stops at once."""
        for wave in (self.gateways, [*self.runtimes, *self.workers], [self.s3]):
            for process in wave:
                process.signal_group(signal.SIGTERM)
            for process in wave:
                process.stop()

    def processes(self) -> list[Process]:
        return [self.s3, *self.workers, *self.runtimes, *self.gateways]

    def seed(self) -> int:
        self.next_seed += 1
        return self.next_seed

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}


def _create_key(database_url: str, workdir: Path) -> str:
    from cloud.auth import create_key
    from cloud.db import open_database
    from cloud.settings import Settings

    db = open_database(Settings(database_url=database_url, data_dir=workdir / "driver"))
    try:
        return create_key(db, TENANT)
    finally:
        db.dispose()


# -- the clients --


@dataclass
class Answer:
    """One request a client sent, and how it ended."""

    client: int
    gateway: int  # which gateway it was sent to
    sent: float  # time.monotonic()
    done: float
    status: int | None  # None: no HTTP answer (a connection error, or a hang)
    # the JSON error's code; for no answer: "refused" (never reached a gateway), "cut" (the
    # connection broke mid-request), "hang"; "non-json" for an error body that is not one
    code: str = ""
    request_id: str | None = None  # X-Request-ID of a 200, the key of its usage record
    correct: bool = True  # a 200's outputs match the model's
    message: str = ""  # the JSON error's message


class Load:
    """CLIENTS threads, each sending requests back to back on its own keep-alive connection to its
    gateway (client i to gateway i mod n). A client whose gateway refuses or drops its connection
    marks that gateway down and sends the same request to the next one, as a load balancer
    would. After an error answer a client waits a moment, as a client honouring Retry-After
    would (but shorter, so that recovery shows within a tenth of a second)."""

    PAUSE_AFTER_ERROR_S = 0.1

    def __init__(self, urls: list[str], auth: dict[str, str], timing: Timing, seed: int = 0) -> None:
        self.urls = urls
        self.auth = auth
        self.timing = timing
        self.reference = mlp_reference(seed)
        self.answers: list[Answer] = []
        self.down: set[int] = set()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(CLIENTS)]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=self.timing.hang_s + 10)
        if any(thread.is_alive() for thread in self._threads):
            raise RuntimeError("a client thread did not finish: a request hangs past every timeout")

    def _client(self, i: int) -> None:
        rng = np.random.default_rng(1000 + i)
        gateway = i % len(self.urls)
        clients = [httpx.Client(base_url=url, timeout=self.timing.hang_s) for url in self.urls]
        try:
            while not self._stop.is_set():
                x = rng.standard_normal((int(rng.integers(1, 4)), 8)).astype(np.float32)
                answer = self._send(clients[gateway], i, gateway, x)
                self.answers.append(answer)
                if answer.status is None and answer.code in ("refused", "cut"):
                    self.down.add(gateway)
                    live = [g for g in range(len(self.urls)) if g not in self.down]
                    if live:  # the same request to a live gateway; else wait for one
                        gateway = live[i % len(live)]
                        self.answers.append(self._send(clients[gateway], i, gateway, x))
                if self.answers[-1].status != 200:
                    self._stop.wait(self.PAUSE_AFTER_ERROR_S)
        finally:
            for client in clients:
                client.close()

    def _send(self, client: httpx.Client, i: int, gateway: int, x: np.ndarray) -> Answer:
        sent = time.monotonic()
        try:
            reply = client.post(f"/v1/models/{MODEL}/infer", headers=self.auth, json={"inputs": {"x": x.tolist()}})
        except httpx.ConnectError:
            return Answer(i, gateway, sent, time.monotonic(), None, "refused")
        except httpx.TimeoutException:
            return Answer(i, gateway, sent, time.monotonic(), None, "hang")
        except httpx.TransportError:
            return Answer(i, gateway, sent, time.monotonic(), None, "cut")
        done = time.monotonic()
        try:
            body = reply.json()
        except ValueError:
            return Answer(i, gateway, sent, done, reply.status_code, "non-json")
        if reply.status_code == 200:
            y = np.asarray(body["outputs"]["y"], np.float32)
            correct = y.shape == (x.shape[0], 3) and np.allclose(y, self.reference(x), rtol=1e-4, atol=1e-5)
            return Answer(i, gateway, sent, done, 200, "", reply.headers.get("X-Request-ID"), bool(correct))
        error = body.get("error") if isinstance(body, dict) else None
        if not (isinstance(error, dict) and error.get("message")):
            return Answer(i, gateway, sent, done, reply.status_code, "non-json")
        return Answer(i, gateway, sent, done, reply.status_code, str(error.get("code", "")), message=str(error["message"]))


# -- uploads --


@dataclass
class Upload:
    name: str
    accepted_at: float | None = None  # when it got its 202
    refusals: list[str] = field(default_factory=list)  # what came before the 202: "503 backend_unreachable"
    status: str = "not accepted"  # its version's status at the end
    ready_at: float | None = None


def upload(stack: Stack, load: Load | None, name: str, seed: int, timeout: float) -> Upload:
    """POSTs a graph to a live gateway until it is accepted (202), as the SDK retries 429 and 503
    (and a load balancer skips a dead gateway); every other answer is noted as a refusal."""
    result = Upload(name)
    deadline = time.monotonic() + timeout
    files = {"file": ("model.onnx", mlp_bytes(seed), "application/octet-stream")}
    while time.monotonic() < deadline:
        for g, url in enumerate(stack.urls):
            if load is not None and g in load.down:
                continue
            try:
                reply = httpx.post(f"{url}/v1/models", headers=stack.auth, files=files, data={"name": name}, timeout=30)
            except httpx.TransportError as exc:
                result.refusals.append(type(exc).__name__)
                continue
            if reply.status_code == 202:
                result.accepted_at = time.monotonic()
                return result
            result.refusals.append(f"{reply.status_code} {_error_code(reply)}{_internal_message(reply)}")
        time.sleep(0.2)
    return result


def _internal_message(reply: httpx.Response) -> str:
    """A 500's message (it names the exception's type), so a failure's table says what broke."""
    if reply.status_code != 500:
        return ""
    try:
        return f" ({reply.json()['error']['message']})"
    except (ValueError, KeyError, TypeError):
        return ""


def _last_traceback(log: str, lines: int = 12) -> str:
    """The end of the last traceback in a log: CI keeps the test's output, never the stack's logs."""
    start = log.rfind("Traceback")
    return "\n".join(log[start:].splitlines()[-lines:]) if start >= 0 else ""


def _error_code(reply: httpx.Response) -> str:
    try:
        return str(reply.json()["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return "non-json"


def version_status(stack: Stack, load: Load | None, name: str) -> str | None:
    for g, url in enumerate(stack.urls):
        if load is not None and g in load.down:
            continue
        try:
            reply = httpx.get(f"{url}/v1/models/{name}", headers=stack.auth, timeout=10)
        except httpx.TransportError:
            continue
        if reply.status_code == 200:
            return str(reply.json()["versions"][-1]["status"])
    return None


def wait_compiled(stack: Stack, load: Load | None, uploads: list[Upload], timeout: float) -> None:
    """Until every accepted upload is ready or failed, or `timeout`: one still queued or compiling
    then is a lost compile."""
    deadline = time.monotonic() + timeout
    for item in uploads:
        if item.accepted_at is None:
            continue
        while not poll(stack, load, item) and time.monotonic() < deadline:
            time.sleep(0.1)


def poll(stack: Stack, load: Load | None, item: Upload) -> bool:
    """Whether the upload has finished compiling (ready or failed), noting when it was first seen so."""
    if item.accepted_at is not None and item.ready_at is None:
        item.status = version_status(stack, load, item.name) or item.status
        if item.status in ("ready", "failed"):
            item.ready_at = time.monotonic()
    return item.ready_at is not None


# -- the ledger --


def settle(redis_url: str, timeout: float) -> bool:
    """Waits until no request is queued on a runtime stream and every usage event is recorded
    (the ledger consumer deletes the events it wrote): then the ledger is final."""
    from scheduler import wire

    client = redis.Redis.from_url(redis_url, socket_connect_timeout=2)

    def empty() -> bool:
        try:
            streams = list(client.scan_iter(match=wire.request_stream("*"), count=1000))
            return sum(client.xlen(s) for s in [*streams, wire.USAGE_STREAM]) == 0
        except redis.RedisError:
            return False

    try:
        wait_until(lambda: empty() and (time.sleep(0.5) or empty()), timeout, "usage events still waiting")
        return True
    except TimeoutError:
        return False
    finally:
        client.close()


def ledger_ids(database_url: str) -> list[str]:
    engine = create_engine(database_url)
    try:
        with engine.connect() as connection:
            return [row[0] for row in connection.execute(text("SELECT request_id FROM usage_records"))]
    finally:
        engine.dispose()


# -- one scenario --


@dataclass
class Outcome:
    """What a scenario saw, and which of its rules broke."""

    role: str
    what: str  # how the role died
    requests: int = 0
    ok: int = 0
    errors: dict[str, int] = field(default_factory=dict)  # "503 unavailable" -> count
    connection_errors: dict[str, int] = field(default_factory=dict)  # "cut" / "refused" -> count
    ledger: int = 0  # usage records the scenario added
    ledger_of_200s: int = 0  # of those, records whose request id a 200 carried
    extra_records: int = 0  # records of no 200: requests cut in flight that ran (the gateway kill)
    duplicates: int = 0
    uploads: list[Upload] = field(default_factory=list)
    first_ok_s: float | None = None
    steady_s: float | None = None
    compile_ready_s: float | None = None  # from the kill until the last upload was ready
    down_s: float | None = None  # how long a restarted service was down
    notes: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    answers: list[Answer] = field(default_factory=list, repr=False)  # every request, for the tests
    killed_at: float = 0.0  # time.monotonic() of the kill

    @property
    def compiles(self) -> str:
        ready = sum(u.status == "ready" for u in self.uploads)
        return f"{ready}/{len(self.uploads)} ready"


def recovery(answers: list[Answer], killed_at: float) -> tuple[float | None, float | None]:
    """(kill to the first 200 of a request sent after it, kill to steady state): the time from
    which every request sent was answered 200 within twice the slowest 200 before the kill."""
    before = [a.done - a.sent for a in answers if a.sent < killed_at and a.status == 200]
    threshold = max(2 * max(before, default=0.25), 0.5)
    after = sorted((a for a in answers if a.sent >= killed_at), key=lambda a: a.sent)
    oks = [a.done for a in after if a.status == 200]
    first_ok = min(oks) - killed_at if oks else None
    bad = [i for i, a in enumerate(after) if not (a.status == 200 and a.done - a.sent <= threshold)]
    if not bad:
        return first_ok, first_ok
    if bad[-1] + 1 >= len(after):
        return first_ok, None
    return first_ok, max(after[bad[-1] + 1].sent - killed_at, first_ok or 0.0)


def judge(outcome: Outcome, answers: list[Answer], killed_at: float, ids: list[str], cut_allowed: bool) -> None:
    """Fills in the counts and the rules each scenario must keep."""
    oks = [a for a in answers if a.status == 200]
    outcome.answers, outcome.killed_at = answers, killed_at
    outcome.requests, outcome.ok = len(answers), len(oks)
    outcome.errors = dict(collections.Counter(f"{a.status} {a.code}" for a in answers if a.status not in (None, 200)))
    outcome.connection_errors = dict(collections.Counter(a.code for a in answers if a.status is None))
    outcome.first_ok_s, outcome.steady_s = recovery(answers, killed_at)
    ok_ids = {a.request_id for a in oks}
    outcome.ledger, outcome.duplicates = len(ids), len(ids) - len(set(ids))
    outcome.ledger_of_200s = len(ok_ids & set(ids))
    outcome.extra_records = len(set(ids) - ok_ids)
    broken = outcome.violations
    forbidden = {k: n for k, n in outcome.errors.items() if int(k.split()[0]) not in ALLOWED_ERRORS or "non-json" in k}
    if forbidden:
        broken.append(f"answers other than 200 or a JSON 429/503/504: {forbidden}")
    if hung := outcome.connection_errors.get("hang"):
        broken.append(f"{hung} requests hung (no answer within the deadline, a takeover and 15 s)")
    cut = outcome.connection_errors.get("cut", 0)
    if (cut or outcome.connection_errors.get("refused")) and not cut_allowed:
        broken.append(f"connection errors {outcome.connection_errors}, with every gateway up")
    if wrong := sum(not a.correct for a in oks):
        broken.append(f"{wrong} 200s with wrong outputs")
    if None in ok_ids or len(ok_ids) != len(oks):
        broken.append("200s without a request id of their own")
    if outcome.ledger_of_200s != len(ok_ids):
        broken.append(f"{len(ok_ids) - outcome.ledger_of_200s} 200s have no usage record")
    allowed_extra = cut if cut_allowed else 0
    if outcome.extra_records > allowed_extra:
        broken.append(f"{outcome.extra_records} usage records of no 200 ({allowed_extra} requests were cut in flight)")
    if outcome.duplicates:
        broken.append(f"{outcome.duplicates} request ids billed twice")
    if outcome.first_ok_s is None:
        broken.append("no 200 after the kill")
    elif outcome.steady_s is None:
        broken.append("no steady state before the load stopped")
    for item in outcome.uploads:
        if item.status != "ready":
            broken.append(f"upload {item.name!r} is {item.status} (answers before its 202: {item.refusals})")
        odd = [r for r in item.refusals if not r.startswith(("429 ", "503 ")) and not (cut_allowed and "Error" in r)]
        if odd:
            broken.append(f"upload {item.name!r} was answered {odd}")


class Scenario:
    """16 clients on the stack, one role killed midway, an upload compiling meanwhile; once the
    checks are done, what died starts again. Subclasses say which role, and how it dies."""

    role = ""
    what = ""
    # connection errors are allowed (and counted) only where a gateway dies
    cut_allowed = False

    def __init__(self, stack: Stack, timing: Timing) -> None:
        self.stack = stack
        self.timing = timing
        self.outcome = Outcome(self.role, self.what)
        self.uploads: list[Upload] = []
        self.phases: list[tuple[float, str]] = []
        self.load = Load(stack.urls, stack.auth, timing)

    def phase(self, what: str) -> None:
        self.phases.append((time.monotonic(), what))

    def run(self) -> Outcome:
        stack, load = self.stack, self.load
        self.phase("start")
        settle(stack.redis.url, timeout=30)
        billed_before = set(ledger_ids(stack.database_url))
        self.phase("settled")
        load.start()
        try:
            wait_until(lambda: any(a.status == 200 for a in load.answers), 30, "no 200 under load")
            self.phase("first 200")
            time.sleep(self.timing.before_s)
            killed_at = self.kill()
            self.phase("killed")
            self.while_down()
            self._keep_loading(killed_at)
        finally:
            load.stop()
        self.phase("load stopped")
        self.finish_outage()
        # before the dead role starts again: what it held must be taken over, not resumed
        wait_compiled(stack, load, self.uploads, timeout=self.compile_wait_s())
        self.phase("uploads compiled")
        if not settle(stack.redis.url, timeout=30):
            self.outcome.notes.append("usage events were still waiting in Redis after 30 s")
        self.phase("ledger settled")
        self.outcome.uploads = self.uploads
        ready = [u.ready_at for u in self.uploads if u.status == "ready" and u.ready_at is not None]
        self.outcome.compile_ready_s = max(ready) - killed_at if ready else None
        billed = [i for i in ledger_ids(stack.database_url) if i not in billed_before]
        judge(self.outcome, load.answers, killed_at, billed, self.cut_allowed)
        for process in stack.gateways:
            if "Traceback" in (text := process.text()):
                self.outcome.notes.append(
                    f"{process.name} logged a traceback ({process.log}), ending:\n{_last_traceback(text)}"
                )
        for process in stack.processes():  # for the next scenario, as a supervisor would
            stack.restart(process)
        self.phase("restarted")
        return self.outcome

    def _keep_loading(self, killed_at: float) -> None:
        """Until steady for steady_for_s, or max_after_s after the kill."""
        while time.monotonic() - killed_at < self.timing.max_after_s:
            time.sleep(0.25)
            for item in list(self.uploads):
                poll(self.stack, self.load, item)
            _, steady = recovery(list(self.load.answers), killed_at)
            if steady is not None and time.monotonic() - (killed_at + steady) >= self.timing.steady_for_s:
                return

    def upload(self, name: str) -> Upload:
        item = upload(self.stack, self.load, name, self.stack.seed(), timeout=60)
        self.uploads.append(item)
        self.phase(f"{name} accepted")
        return item

    def kill(self) -> float:
        """Kills the role; returns when (time.monotonic())."""
        raise NotImplementedError

    def while_down(self) -> None:
        """What happens under load once the role died (a service is started again here)."""

    def finish_outage(self) -> None:
        """Once the load stopped: waits for what the outage left running."""

    def compile_wait_s(self) -> float:
        return 2 * self.timing.compile_timeout_s + 30


class RuntimeKill(Scenario):
    role = "runtime"
    what = "SIGKILL to the runtime serving the model"

    def kill(self) -> float:
        from scheduler import wire

        client = redis.Redis.from_url(self.stack.redis.url)
        placed = {m.decode() for m in client.smembers(wire.placement_key(1))}
        client.close()
        serving = [r for r in self.stack.runtimes if any(f"runtime {p} serving" in r.text() for p in placed)]
        self.upload(f"{self.role}-upload")
        (serving or self.stack.runtimes)[0].kill()
        return time.monotonic()


class WorkerKill(Scenario):
    role = "worker"
    what = "SIGKILL to the worker compiling an upload"

    def kill(self) -> float:
        workers = self.stack.workers
        seen = {w.name: len(w.text()) for w in workers}
        item = self.upload(f"{self.role}-upload")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            took = [w for w in workers if "Task luminal.compile_version" in w.text()[seen[w.name]:]]
            if took and version_status(self.stack, None, item.name) == "compiling":
                took[0].kill()
                killed_at = time.monotonic()
                if version_status(self.stack, None, item.name) != "compiling":
                    self.outcome.notes.append("the compile ended before the kill: nothing was tested")
                return killed_at
            time.sleep(0.02)
        raise RuntimeError("the upload's compile did not start on a worker within 60 s")

    def compile_wait_s(self) -> float:
        from cloud.settings import Settings
        from worker.celery_app import redelivery_s  # the compiler loads with it: only here

        return redelivery_s(Settings(compile_timeout_s=self.timing.compile_timeout_s)) + 60


class GatewayKill(Scenario):
    role = "gateway"
    what = "SIGKILL to one of two gateways"
    cut_allowed = True

    def kill(self) -> float:
        self.upload(f"{self.role}-upload")  # answered by the gateway about to die
        self.stack.gateways[0].kill()
        return time.monotonic()

    def finish_outage(self) -> None:
        from scheduler import wire

        client = redis.Redis.from_url(self.stack.redis.url)
        try:
            streams = list(client.scan_iter(match=wire.reply_stream("*")))
            if len(streams) > 1:  # one live gateway's
                entries = sum(client.xlen(s) for s in streams)
                self.outcome.notes.append(f"{len(streams)} reply streams in Redis with {entries} replies, "
                                          "the dead gateway's among them")
        finally:
            client.close()


class Restart(Scenario):
    """A backing service killed and started again after down_s, an upload sent while it is down."""

    def while_down(self) -> None:
        self.uploading = threading.Thread(target=self.upload, args=(f"{self.role}-upload-2",), daemon=True)
        self.uploading.start()
        time.sleep(self.timing.down_s)
        self.start_again()
        self.outcome.down_s = time.monotonic() - self.killed_at

    def start_again(self) -> None:
        raise NotImplementedError

    def finish_outage(self) -> None:
        self.uploading.join(timeout=90)


class RedisRestart(Restart):
    role = "redis"
    what = "SIGKILL to Redis (appendonly yes), restarted on its port"

    def kill(self) -> float:
        self.stack.redis.kill()
        self.killed_at = time.monotonic()
        return self.killed_at

    def start_again(self) -> None:
        # the upload sent meanwhile is stored, and sent to the workers once Redis is back
        self.stack.redis.start()


class PostgresRestart(Restart):
    role = "postgres"
    what = "immediate shutdown of PostgreSQL, started again"

    def kill(self) -> float:
        if self.stack.postgres is None:
            raise Unavailable(self.stack.postgres_missing)
        self.upload(f"{self.role}-upload")  # compiling while the database goes away
        self.stack.postgres.crash()
        self.killed_at = time.monotonic()
        return self.killed_at

    def start_again(self) -> None:
        # the upload sent meanwhile is refused with 503 until the database is back, then accepted
        assert self.stack.postgres is not None
        self.stack.postgres.start()


KINDS: dict[str, type[Scenario]] = {
    "runtime": RuntimeKill,
    "worker": WorkerKill,
    "gateway": GatewayKill,
    "redis": RedisRestart,
    "postgres": PostgresRestart,
}


def run_scenario(stack: Stack, name: str, verbose: bool = False) -> Outcome:
    """Runs one scenario on the stack, which serves again at the end (its logs stay in the stack's
    work directory); Unavailable when this machine lacks what it needs."""
    scenario = KINDS[name](stack, stack.timing)
    try:
        return scenario.run()
    finally:
        if verbose and scenario.phases:
            start = scenario.phases[0][0]
            print("  " + ", ".join(f"{what} {at - start:.1f} s" for at, what in scenario.phases), flush=True)


# -- the table --


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} x{n}" for k, n in sorted(counts.items())) or "0"


def table(outcomes: list[Outcome]) -> str:
    head = ("| role | killed | requests | 200s | errors by code | connection errors | ledger / 200s "
            "| duplicates | compiles | first 200 after kill (s) | steady (s) | rules |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for o in outcomes:
        ledger = f"{o.ledger} / {o.ok}" + (f" (+{o.extra_records} cut in flight)" if o.extra_records else "")
        compiles = o.compiles + (f", {o.compile_ready_s:.1f} s after the kill" if o.compile_ready_s else "")
        rules = "kept" if not o.violations else "BROKEN: " + "; ".join(o.violations)
        what = o.what + (f", down {o.down_s:.1f} s" if o.down_s is not None else "")
        lines.append(
            f"| {o.role} | {what} | {o.requests} | {o.ok} | {_counts(o.errors)} | {_counts(o.connection_errors)} "
            f"| {ledger} | {o.duplicates} | {compiles} | {_seconds(o.first_ok_s)} | {_seconds(o.steady_s)} | {rules} |"
        )
    notes = [f"- {o.role}: {note}" for o in outcomes for note in o.notes]
    return "\n".join(lines + (["", "Notes:", "", *notes] if notes else []))


def write_table(path: Path, rendered: str, command: str) -> None:
    """Replaces the table between the markers in `path`; the rest of the page is prose."""
    begin, end = "<!-- reliability table: begin -->", "<!-- reliability table: end -->"
    block = f"{begin}\n\n    {command}\n\n{rendered}\n\n{end}"
    page = path.read_text() if path.exists() else f"# Reliability\n\n{begin}\n{end}\n"
    if begin not in page:
        page += f"\n{begin}\n{end}\n"
    before, rest = page.split(begin, 1)
    path.write_text(before + block + rest.split(end, 1)[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated, of " + ", ".join(SCENARIOS))
    parser.add_argument("--quick", action="store_true", help="the tests' shorter durations")
    parser.add_argument("--write", type=Path, help="write the table into this Markdown file (docs/reliability.md)")
    parser.add_argument("--keep", type=Path, help="keep the logs in this folder (default: a temporary one, removed)")
    parser.add_argument("--verbose", action="store_true", help="say when each phase of a scenario ended")
    args = parser.parse_args()
    names = [n for n in args.scenarios.split(",") if n]
    if unknown := [n for n in names if n not in KINDS]:
        parser.error(f"unknown scenario {', '.join(unknown)}; known: {', '.join(SCENARIOS)}")
    timing = QUICK if args.quick else Timing()
    outcomes = []
    with ExitStack() as undo:
        root = args.keep or Path(undo.enter_context(tempfile.TemporaryDirectory(prefix="luminal-reliability-")))
        started = time.monotonic()
        stack = undo.enter_context(Stack.running(root, timing))
        print(f"stack serving in {time.monotonic() - started:.0f} s (logs in {root})", flush=True)
        for name in names:
            started = time.monotonic()
            try:
                outcome = run_scenario(stack, name, args.verbose)
            except Unavailable as exc:
                outcome = Outcome(name, KINDS[name].what, violations=[f"not run: {exc}"])
            said = "".join(f"; {line}" for line in (*outcome.violations, *outcome.notes))
            print(f"{name}: {time.monotonic() - started:.0f} s, rules {'kept' if not outcome.violations else 'BROKEN'}"
                  f"{said}", flush=True)
            outcomes.append(outcome)
    rendered = table(outcomes)
    print(rendered)
    if args.write:
        flags = (["--quick"] if args.quick else []) + ([f"--scenarios {args.scenarios}"] if names != list(SCENARIOS) else [])
        command = " ".join(["$ .venv/bin/python benchmarks/reliability.py", *flags, f"--write {args.write}"])
        write_table(args.write, rendered, command)
    return 1 if any(o.violations for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
