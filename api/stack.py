"""`luminal-cloud stack`: the distributed mode as local processes, for development and the
integration tests. Celery compile workers, runtime processes and a gateway, each a child in its
own process group with its output in a log file, against a Redis, a PostgreSQL (the database is
created when missing) and an S3 endpoint (moto's standalone server, started here, when none is
given). Once the stack runs it supervises its children as systemd or Kubernetes would: a child
that dies is restarted with the same command, environment and ports after a backoff
(RestartPolicy decides when; the supervisor only acts), each death and restart one line on
stdout; a child in a crash loop stops the stack. Ctrl-C or SIGTERM stops them all: the gateway
first, so nothing new arrives, then the runtimes and workers, then the S3 server.

With `--runtimes auto` the runtimes are autoscaled as KEDA scales them in Kubernetes
(RuntimeAutoscaler: the rule is scheduler/autoscale.py's): none, or --runtime-min, at first; more
when requests wait in the pool stream for a runtime (up to --runtime-max); one stopped with
SIGTERM, which drains it, once it has been idle --runtime-idle seconds."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError

from api.server import free_port
from cloud.db import masked_url
from cloud.errors import LuminalError, Unreachable
from cloud.settings import Settings
from scheduler import wire
from scheduler.autoscale import RuntimeState, ScalePolicy, scale

# the local PostgreSQL, used when neither --database-url nor LUMINAL_DATABASE_URL names one
DEFAULT_DATABASE_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/luminal"
# moto accepts any credentials, but boto3 needs some to sign its requests with
MOTO_CREDENTIALS = {"LUMINAL_S3_ACCESS_KEY_ID": "testing", "LUMINAL_S3_SECRET_ACCESS_KEY": "testing"}
LOG_TAIL_LINES = 25
# how long a stopping child may take before its process group is killed
STOP_GRACE_S = 20.0
POLL_S = 0.1

# a dead child's first restart waits this long: a role killed once is back within a second
RESTART_BACKOFF_S = 0.5
# each quick death doubles the wait up to this, so a failing role never spins and one whose
# dependency came back is up again within seconds
RESTART_BACKOFF_MAX_S = 10.0
# a child up this long was healthy: its next death waits RESTART_BACKOFF_S again
HEALTHY_AFTER_S = 30.0
# a child restarted this often within the window that dies again is in a crash loop, which
# restarting cannot fix: five quick restarts take about 16 s of backoff plus five starts
CRASH_LOOP_RESTARTS = 5
CRASH_LOOP_WINDOW_S = 60.0


class StackError(Exception):
    """A piece of the stack did not start or died; the message names it and shows its log."""


class StopRequested(Exception):
    """Ctrl-C or SIGTERM arrived: the stack stops, whatever it was doing."""


@dataclass
class StackOptions:
    """What `luminal-cloud stack` was asked for; None takes the LUMINAL_* setting."""

    host: str = "127.0.0.1"  # the gateway's address
    port: int = 8000  # the gateway's port
    workers: int = 1  # Celery compile workers
    runtimes: int | None = 2  # runtime processes (device cpu); None: autoscaled (--runtimes auto)
    runtime_min: int = 0  # autoscaled: runtimes kept however idle the pool is
    runtime_max: int = 2  # autoscaled: at most this many
    runtime_idle_s: float = 30.0  # autoscaled: a runtime idle this long is stopped (scale to zero)
    runtime_target: int | None = None  # autoscaled: waiting requests per runtime; None: LUMINAL_MAX_BATCH_ROWS
    redis_url: str | None = None
    database_url: str | None = None  # DEFAULT_DATABASE_URL when the setting is empty too
    s3_endpoint: str | None = None  # empty starts moto's server
    runtime_metrics_port: int = 0  # the first runtime's /metrics port, the others follow; 0 picks free ports
    log_dir: Path | None = None  # data_dir/logs by default
    tenant: str | None = None  # create and print an API key for this tenant once ready
    start_timeout_s: float = 120.0  # for each wave of children to become ready


@dataclass(frozen=True)
class Verdict:
    """What to do about one death of a child."""

    restart_in_s: float | None  # the backoff before restarting it; None: a crash loop, give up
    restarts_in_window: int  # restarts within the crash-loop window, counting this one if any


class RestartPolicy:
    """When to restart one child, from the times it started and died (no clock, no I/O: the
    supervisor passes them). Exponential backoff that starts over once the child has stayed up
    `healthy_after_s`; a crash loop when it dies again after `crash_loop_restarts` restarts within
    `crash_loop_window_s`."""

    def __init__(
        self,
        backoff_s: float = RESTART_BACKOFF_S,
        max_backoff_s: float = RESTART_BACKOFF_MAX_S,
        healthy_after_s: float = HEALTHY_AFTER_S,
        crash_loop_restarts: int = CRASH_LOOP_RESTARTS,
        crash_loop_window_s: float = CRASH_LOOP_WINDOW_S,
    ) -> None:
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.healthy_after_s = healthy_after_s
        self.crash_loop_restarts = crash_loop_restarts
        self.crash_loop_window_s = crash_loop_window_s
        self._quick_deaths = 0  # deaths in a row, each before the child had stayed up healthy_after_s
        self._restarts: deque[float] = deque()  # when the restarts still within the window were decided

    def died(self, started_at: float, now: float) -> Verdict:
        """The child started at `started_at` died at `now`: restart it after a delay, or give up."""
        if now - started_at >= self.healthy_after_s:
            self._quick_deaths = 0
        while self._restarts and now - self._restarts[0] >= self.crash_loop_window_s:
            self._restarts.popleft()
        if len(self._restarts) >= self.crash_loop_restarts:
            return Verdict(None, len(self._restarts))
        # the exponent stops growing long before a float would overflow
        delay = min(self.backoff_s * 2 ** min(self._quick_deaths, 32), self.max_backoff_s)
        self._quick_deaths += 1
        self._restarts.append(now)
        return Verdict(delay, len(self._restarts))


def exit_reason(code: int) -> str:
    """How a child ended, from Popen's returncode (negative: the signal that killed it)."""
    if code >= 0:
        return f"exited with status {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


@dataclass
class Child:
    """One process of the stack, in its own process group so that a stop reaches its children."""

    name: str  # how messages call it: s3, worker-1, runtime-2, gateway
    where: str  # what it serves, for the listing
    command: list[str]
    env: dict[str, str]
    log: Path
    is_ready: Callable[[Child], bool]
    # said when it dies: what a restart loses (moto's S3 server keeps its objects in memory)
    restart_loses: str = ""
    # run once a restarted child is ready again; returns what it did, for the log line
    after_restart: Callable[[Child], str] | None = field(default=None, repr=False)
    policy: RestartPolicy = field(default_factory=RestartPolicy, repr=False)
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    started_at: float = 0.0  # time.monotonic() at the last start
    ready: bool = False  # this run answered its readiness check
    restart_at: float | None = None  # a restart waiting out its backoff
    last_exit: str = ""  # how the last run ended, for the log line that opens the next
    log_offset: int = 0  # where this run's output begins in the log

    def start(self, restarted_after: str | None = None) -> None:
        """Runs the command; a restart appends to the log, after a line saying how the run before
        ended, so that a crash stays readable (the first start truncates it: a failure's tail is
        from this stack)."""
        with open(self.log, "ab" if restarted_after else "wb") as out:
            if restarted_after:
                out.write(f"--- luminal-cloud stack: restarted; the run above {restarted_after} ---\n".encode())
                out.flush()  # before the child writes after it
            self.log_offset = out.tell()
            self.process = subprocess.Popen(
                self.command, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.started_at = time.monotonic()
        self.ready = False
        self.restart_at = None

    def exited(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def output(self) -> str:
        """What this run has written to the log so far."""
        try:
            with open(self.log, "rb") as log:
                log.seek(self.log_offset)
                return log.read().decode(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self) -> str:
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(lines[-LOG_TAIL_LINES:]) or "(empty log)"

    def failure(self, what: str) -> StackError:
        return StackError(f"{self.name} {what}; the last lines of {self.log}:\n{self.log_tail()}")

    def signal_group(self, signum: int) -> None:
        if self.process is not None:
            try:
                os.killpg(self.process.pid, signum)
            except ProcessLookupError:
                pass


def log_says(words: str) -> Callable[[Child], bool]:
    """Ready when this run of the child has logged `words`."""
    return lambda child: words in child.output()


def answers(url: str) -> Callable[[Child], bool]:
    """Ready when `url` answers 200."""

    def check(_: Child) -> bool:
        try:
            return httpx.get(url, timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    return check


class Stack:
    """Children started in waves (each wave ready before the next starts), supervised while the
    stack runs, stopped in reverse."""

    def __init__(self, start_timeout_s: float) -> None:
        self.start_timeout_s = start_timeout_s
        self.waves: list[list[Child]] = []
        self.autoscalers: list[RuntimeAutoscaler] = []
        self.stop_requested = False

    def request_stop(self, *_: object) -> None:
        self.stop_requested = True

    def start(self, *children: Child) -> None:
        self.waves.append(list(children))
        for child in children:
            child.start()
            assert child.process is not None
            print(f"{child.name:<10} pid {child.process.pid:<8} {child.where}\n{'':<10} log {child.log}", flush=True)
        deadline = time.monotonic() + self.start_timeout_s
        waiting = list(children)
        while waiting:
            self._check_stop()
            for child in list(waiting):
                if (code := child.exited()) is not None:
                    raise child.failure(f"{exit_reason(code)} before it was ready")
                if child.is_ready(child):
                    child.ready = True
                    waiting.remove(child)
            if waiting and time.monotonic() > deadline:
                raise waiting[0].failure(f"was not ready within {self.start_timeout_s:.0f} s")
            time.sleep(POLL_S)

    def adopt(self, autoscaler: RuntimeAutoscaler) -> None:
        """Supervises the runtimes an autoscaler starts (a wave that grows and shrinks), and lets it
        scale them while the stack runs."""
        self.autoscalers.append(autoscaler)
        self.waves.append(autoscaler.children)

    def watch(self) -> None:
        """Supervises the children until a stop is requested (then StopRequested): one that dies is
        restarted after its policy's backoff; StackError when one is in a crash loop. Autoscalers
        scale their pools on each turn."""
        while True:
            self._check_stop()
            for child in self.children():
                self._tend(child, time.monotonic())
            for autoscaler in self.autoscalers:
                autoscaler.tend(time.time())
            time.sleep(POLL_S)

    def _tend(self, child: Child, now: float) -> None:
        if child.restart_at is not None:
            if now >= child.restart_at:
                self._restart(child)
        elif (code := child.exited()) is not None:
            self._died(child, exit_reason(code), now)
        elif not child.ready and child.is_ready(child):
            child.ready = True
            if not child.last_exit:  # its first run: an autoscaler started it while the stack ran
                print(f"{child.name:<10} ready, {now - child.started_at:.1f} s after its start", flush=True)
                return
            did = child.after_restart(child) if child.after_restart else ""
            print(f"{child.name:<10} ready again, {now - child.started_at:.1f} s after its restart{did}", flush=True)

    def _died(self, child: Child, how: str, now: float) -> None:
        # what it started and left behind goes too: an orphan may hold its port or its stream
        child.signal_group(signal.SIGKILL)
        verdict = child.policy.died(child.started_at, now)
        said = f"{child.name:<10} {how} after {now - child.started_at:.1f} s up"
        count, window = verdict.restarts_in_window, f"within {child.policy.crash_loop_window_s:.0f} s"
        if verdict.restart_in_s is None:
            print(f"{said}; a crash loop ({count} restarts {window}): the stack stops; log {child.log}", flush=True)
            raise child.failure(f"{how} again after {count} restarts {window}, a crash loop")
        child.restart_at, child.last_exit = now + verdict.restart_in_s, how
        loses = f"; {child.restart_loses}" if child.restart_loses else ""
        print(f"{said}; restarting in {verdict.restart_in_s:.1f} s (restart {count} {window}, "
              f"{child.policy.crash_loop_restarts} allowed){loses}; log {child.log}", flush=True)

    def _restart(self, child: Child) -> None:
        child.start(restarted_after=child.last_exit)
        assert child.process is not None
        print(f"{child.name:<10} pid {child.process.pid:<8} restarted: {child.where}; log {child.log} (appended)",
              flush=True)

    def stop(self) -> None:
        for wave in reversed(self.waves):
            for child in wave:
                child.signal_group(signal.SIGTERM)
            deadline = time.monotonic() + STOP_GRACE_S
            for child in wave:
                if child.process is not None:
                    try:
                        child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
                    except subprocess.TimeoutExpired:
                        print(f"{child.name} did not stop within {STOP_GRACE_S:.0f} s; killed", file=sys.stderr)
                # what the child started and left behind goes with it
                child.signal_group(signal.SIGKILL)
                if child.process is not None:
                    child.process.wait()
        self.waves.clear()
        for autoscaler in self.autoscalers:
            autoscaler.close()  # the runtimes it was stopping already
        self.autoscalers.clear()

    def children(self) -> list[Child]:
        return [child for wave in self.waves for child in wave]

    def _check_stop(self) -> None:
        if self.stop_requested:
            raise StopRequested


def pool_lag(client: redis.Redis, device: str) -> int:
    """Requests waiting for a runtime of the device type, read as KEDA's redis-streams trigger
    reads them (lagCount): the lag of the pool stream's consumer group; 0 without the stream, its
    length without the group; an unknown lag (Redis says null) is 0, as KEDA reads it."""
    stream = wire.pool_stream(device)
    try:
        groups = client.xinfo_groups(stream)
    except redis.ResponseError as exc:
        if "no such key" in str(exc):
            return 0
        raise
    for group in groups:
        if group["name"].decode() == wire.RUNTIME_GROUP:
            return int(group["lag"] or 0)
    return int(client.xlen(stream))


class RuntimeAutoscaler:
    """`--runtimes auto`: the runtime processes of one device type, scaled by scheduler.autoscale's
    rule on the pool stream's lag and the runtimes' heartbeats (held requests, last activity),
    read on each turn of the stack's watch. Its children are a wave of the stack: one that dies is
    restarted like any other (a Deployment's pod); one it stops gets SIGTERM (it drains: what it
    took runs first) and leaves the wave."""

    def __init__(
        self, device: str, policy: ScalePolicy, redis_url: str, env: dict[str, str], log_dir: Path,
        first_metrics_port: int = 0,
    ) -> None:
        self.device = device
        self.policy = policy
        self.redis = redis.Redis.from_url(redis_url, socket_connect_timeout=2, socket_timeout=5)
        self.env = env
        self.log_dir = log_dir
        self.first_metrics_port = first_metrics_port
        self.children: list[Child] = []  # the pool's runtimes, a wave of the stack
        self._stopping: list[tuple[Child, float]] = []  # given SIGTERM (and when), until they exit
        self._started = 0  # runtimes started so far: names and metrics ports follow it
        self._redis_failing = False

    def tend(self, now: float) -> None:
        """One turn at wall-clock time `now`: reap the runtimes stopped before, then scale."""
        self._reap()
        try:
            lag = pool_lag(self.redis, self.device)
            runtimes = self._states()
        except redis.RedisError as exc:
            if not self._redis_failing:
                print(f"autoscaler cannot read the {self.device} pool from Redis ({exc}); it keeps "
                      f"{len(self.children)} runtimes until it can", flush=True)
            self._redis_failing = True
            return
        self._redis_failing = False
        step = scale(lag, runtimes, self.policy, now)
        for _ in range(step.start):
            self._start(f"{lag} requests wait for a {self.device} runtime" if lag else
                        f"--runtime-min {self.policy.min_runtimes}")
        for name in step.stop:
            (state,) = [r for r in runtimes if r.name == name]
            self._stop(name, f"idle for {now - state.last_active:.1f} s")

    def _states(self) -> list[RuntimeState]:
        """Each runtime as the rule sees it, from the heartbeats (matched by process id)."""
        ids = [m.decode() for m in self.redis.smembers(wire.RUNTIMES)]
        with self.redis.pipeline(transaction=False) as pipe:
            for runtime_id in ids:
                pipe.hgetall(wire.heartbeat_key(runtime_id))
            beats = [b for b in pipe.execute() if b and b.get(b"device", b"").decode() == self.device]
        by_pid = {int(b[b"pid"]): b for b in beats if b"pid" in b}
        states = []
        for child in self.children:
            beat = by_pid.get(child.process.pid) if child.process is not None and child.exited() is None else None
            if beat is None:  # starting, restarting, or not yet announced: never idle
                states.append(RuntimeState(child.name, False, 0, time.time()))
            else:
                states.append(RuntimeState(child.name, True, int(beat[b"held"]), float(beat[b"last_active"])))
        return states

    def _start(self, why: str) -> None:
        self._started += 1
        port = self.first_metrics_port + self._started - 1 if self.first_metrics_port else free_port()
        child = Child(
            f"runtime-{self._started}", f"device {self.device}, metrics http://127.0.0.1:{port}/metrics",
            _command("runtime", "--device", self.device), {**self.env, "LUMINAL_RUNTIME_METRICS_PORT": str(port)},
            self.log_dir / f"runtime-{self._started}.log", log_says(f"serving device {self.device}"),
        )
        child.start()
        self.children.append(child)
        assert child.process is not None
        print(f"{child.name:<10} pid {child.process.pid:<8} {child.where}\n{'':<10} log {child.log}\n"
              f"{'':<10} started: {why} ({self._count()})", flush=True)

    def _stop(self, name: str, why: str) -> None:
        (child,) = [c for c in self.children if c.name == name]
        self.children.remove(child)  # no longer supervised: its exit is no death to restart
        child.signal_group(signal.SIGTERM)
        self._stopping.append((child, time.monotonic()))
        print(f"{child.name:<10} stopping: {why}, SIGTERM drains it ({self._count()})", flush=True)

    def _count(self) -> str:
        return f"pool {self.device}: {len(self.children)} runtimes, {self.policy.min_runtimes} to {self.policy.max_runtimes}"

    def _reap(self, grace_s: float = STOP_GRACE_S) -> None:
        for child, asked in list(self._stopping):
            if (code := child.exited()) is None and time.monotonic() - asked < grace_s:
                continue
            if code is None:
                print(f"{child.name} did not stop within {grace_s:.0f} s; killed", file=sys.stderr, flush=True)
            child.signal_group(signal.SIGKILL)  # what it left behind goes with it
            assert child.process is not None
            code = child.process.wait()
            self._stopping.remove((child, asked))
            print(f"{child.name:<10} stopped, {exit_reason(code)}", flush=True)

    def close(self) -> None:
        """Waits for the runtimes it was stopping (the stack stops the others)."""
        while self._stopping:
            self._reap()
            time.sleep(POLL_S)
        self.redis.close()


def ensure_database(url: str) -> None:
    """Creates the PostgreSQL database that `url` names when it is missing (other kinds of
    database are left as they are); Unreachable, naming the URL, when the server does not answer."""
    target = make_url(url)
    if target.get_backend_name() != "postgresql" or not target.database:
        return
    server = create_engine(target.set(database="postgres"), isolation_level="AUTOCOMMIT")
    try:
        with server.connect() as connection:
            found = connection.scalar(text("SELECT 1 FROM pg_database WHERE datname = :name"), {"name": target.database})
            if not found:
                quoted = connection.dialect.identifier_preparer.quote(target.database)
                connection.exec_driver_sql(f"CREATE DATABASE {quoted}")
                print(f"created the database {masked_url(url)}", flush=True)
    except SQLAlchemyError as exc:
        reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
        raise Unreachable(f"cannot reach PostgreSQL at {masked_url(url)}: {reason}") from None
    finally:
        server.dispose()


def _command(*args: str) -> list[str]:
    return [sys.executable, "-m", "luminal_cloud.cli", *args]


def _moto_server(log_dir: Path, env: dict[str, str]) -> tuple[Child, str]:
    """moto's S3 server on a free loopback port, and its URL."""
    if importlib.util.find_spec("moto") is None or importlib.util.find_spec("flask") is None:
        raise StackError(
            "moto's S3 server is not installed: run .venv/bin/pip install 'moto[server]' (scripts/bootstrap "
            "--test installs it), or pass --s3-endpoint with an S3 endpoint of your own"
        )
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    # restarted all the same: the rest of the stack keeps serving what it has loaded, and new uploads work
    loses = "moto keeps objects in memory, so the restarted S3 server starts empty: what was uploaded before is lost"
    child = Child("s3", f"{url} (moto, kept in memory)", command, env, log_dir / "s3.log", answers(f"{url}/moto-api/"),
                  restart_loses=loses, after_restart=lambda _: _create_bucket(url))
    return child, url


def _create_bucket(url: str) -> str:
    """The bucket again, in a restarted (empty) moto server: the children created it at their start."""
    from cloud.s3 import S3ObjectStore

    credentials = {name.removeprefix("LUMINAL_").lower(): value for name, value in MOTO_CREDENTIALS.items()}
    try:
        store = S3ObjectStore.from_settings(Settings(s3_endpoint_url=url, **credentials))
    except LuminalError as exc:
        return f"; the bucket could not be created again: {exc.message}"
    return f"; bucket {store.bucket!r} created again, empty"


def _runtime_metrics_ports(first: int, count: int) -> list[int]:
    return [first + i for i in range(count)] if first else [free_port() for _ in range(count)]


def run_stack(options: StackOptions) -> int:
    """Starts the stack, waits for Ctrl-C or SIGTERM, stops it; 1 when a piece failed."""
    settings = Settings()
    redis_url = options.redis_url or settings.redis_url
    database_url = options.database_url or settings.database_url or DEFAULT_DATABASE_URL
    s3_endpoint = options.s3_endpoint if options.s3_endpoint is not None else settings.s3_endpoint_url
    log_dir = options.log_dir or settings.data_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",  # the logs show what happened up to a crash
        "LUMINAL_DATA_DIR": str(settings.data_dir),
        "LUMINAL_REDIS_URL": redis_url,
        "LUMINAL_DATABASE_URL": database_url,
        "LUMINAL_COMPILE_BACKEND": "celery",
        "LUMINAL_REQUEST_QUEUE": "redis",
        "LUMINAL_OBJECT_STORE": "s3",
    }
    stack = Stack(options.start_timeout_s)
    signal.signal(signal.SIGINT, stack.request_stop)
    signal.signal(signal.SIGTERM, stack.request_stop)
    try:
        _start(stack, options, env, s3_endpoint, log_dir)
        stack.watch()
    except StopRequested:
        print("stopping the stack", flush=True)
    except (StackError, LuminalError) as exc:
        print(f"luminal-cloud stack: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        stack.stop()
    return 0


def _start(stack: Stack, options: StackOptions, env: dict[str, str], s3_endpoint: str, log_dir: Path) -> None:
    from worker.celery_app import wait_for_broker

    # the services the children need, checked first so that their absence reads as one message
    wait_for_broker(Settings(redis_url=env["LUMINAL_REDIS_URL"]))
    ensure_database(env["LUMINAL_DATABASE_URL"])
    if not s3_endpoint:
        env.update(MOTO_CREDENTIALS)
        moto, s3_endpoint = _moto_server(log_dir, env)
        stack.start(moto)
    env["LUMINAL_S3_ENDPOINT_URL"] = s3_endpoint

    workers = [
        Child(f"worker-{i}", f"Celery compile worker, metrics http://127.0.0.1:{port}/metrics", _command("worker"),
              {**env, "LUMINAL_WORKER_METRICS_PORT": str(port)}, log_dir / f"worker-{i}.log", log_says(" ready."))
        for i, port in enumerate([free_port() for _ in range(options.workers)], start=1)
    ]
    runtimes = [
        Child(f"runtime-{i}", f"device cpu, metrics http://127.0.0.1:{port}/metrics",
              _command("runtime", "--device", "cpu"), {**env, "LUMINAL_RUNTIME_METRICS_PORT": str(port)},
              log_dir / f"runtime-{i}.log", log_says("serving device cpu"))
        for i, port in enumerate(_runtime_metrics_ports(options.runtime_metrics_port, options.runtimes or 0), start=1)
    ]
    stack.start(*workers, *runtimes)
    if options.runtimes is None:
        policy = ScalePolicy(
            options.runtime_min, options.runtime_max, options.runtime_target or Settings().max_batch_rows,
            options.runtime_idle_s,
        )
        stack.adopt(RuntimeAutoscaler("cpu", policy, env["LUMINAL_REDIS_URL"], env, log_dir, options.runtime_metrics_port))
        print(f"runtimes autoscaled: {policy.min_runtimes} to {policy.max_runtimes} on device cpu, one per "
              f"{policy.target_lag} requests waiting, stopped after {policy.idle_s:g} s idle", flush=True)

    # loopback reaches a gateway bound to every address
    probe_host = "127.0.0.1" if options.host in ("0.0.0.0", "::", "") else options.host
    url = f"http://{options.host}:{options.port}"
    gateway = Child("gateway", url, _command("serve", "--host", options.host, "--port", str(options.port)), env,
                    log_dir / "gateway.log", answers(f"http://{probe_host}:{options.port}/readyz"))
    stack.start(gateway)
    if options.tenant:
        _print_key(env["LUMINAL_DATABASE_URL"], options.tenant)
    print(f"stack ready: gateway at {url}, S3 at {s3_endpoint}, Redis at {env['LUMINAL_REDIS_URL']}, "
          f"database {masked_url(env['LUMINAL_DATABASE_URL'])} (Ctrl-C stops everything)", flush=True)


def _print_key(database_url: str, tenant: str) -> None:
    from api.services import open_database
    from cloud.auth import create_key

    db = open_database(Settings(database_url=database_url))
    try:
        print(f"API key for tenant {tenant!r}: {create_key(db, tenant)}", flush=True)
    finally:
        db.dispose()
