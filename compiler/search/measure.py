"""Running candidate programs apart from the compile, and timing candidates fairly.

Generated code that crashes (a segfault) or never returns would take the compile down with it:
each native candidate is loaded, verified and timed in a helper process instead, so such a
candidate is rejected with the reason ("crashed with signal 11 (SIGSEGV)", "timed out after
60 s") and the compile goes on with the others.

    with session() as runner:                     # this process's helper, started on first use
        runner.put_inputs("verify", inputs)
        runner.load("native-blas", layout, weights, library)     # raises CandidateFailed
        outputs = runner.run("native-blas", "verify")
        seconds = runner.time("native-blas", "verify")

The helper is a fresh interpreter started with subprocess, not multiprocessing: a compile may
itself run in the compile sandbox's daemonic child (which may not start multiprocessing
children), and a forked copy of a process that has run OpenMP code can hang in its first
parallel region. It serves one request at a time over two pipes and is kept for the next compile
in the same process (the test suite compiles hundreds of models; starting one costs about half a
second). After a crash or a timeout it is killed and the next request starts another, which
loads the surviving candidates again. It exits when its pipe closes or its parent goes away, and
it stays in the compile's process group, so the sandbox's kill reaches it.

`round_robin` times several candidates in turns (a different one first each round), so a burst
of load on a shared machine hits all of them alike.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

# a request (load, verify, one timed run) that takes longer than this is a hung candidate
REQUEST_TIMEOUT_S = 60.0
# a new helper must be serving within this long (importing NumPy and the compiler)
START_TIMEOUT_S = 120.0
# a timing is a burst of back-to-back runs: at least this many, more while it lasts under BURST_SECONDS
BURST_MIN_RUNS = 3
BURST_MAX_RUNS = 16
BURST_SECONDS = 0.02
_SERVE = "import sys; from compiler.search.measure import serve; serve(int(sys.argv[1]), int(sys.argv[2]))"
_ROOT = str(Path(__file__).resolve().parents[2])


class CandidateFailed(Exception):
    """A candidate could not be loaded or run; `crashed` when it took its process down (a signal,
    an exit or a timeout) rather than raising."""

    def __init__(self, reason: str, crashed: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.crashed = crashed


class _Helper:
    """One helper process and the two ends of its pipes."""

    def __init__(self) -> None:
        request_read, request_write = os.pipe()
        reply_read, reply_write = os.pipe()
        path = os.environ.get("PYTHONPATH")
        env = {**os.environ, "PYTHONPATH": _ROOT + (os.pathsep + path if path else "")}
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-c", _SERVE, str(request_read), str(reply_write)],
                pass_fds=(request_read, reply_write),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                env=env,
            )
        except BaseException:
            for fd in (request_read, request_write, reply_read, reply_write):
                os.close(fd)
            raise
        os.close(request_read)
        os.close(reply_write)
        self.requests = Connection(request_write, readable=False)
        self.replies = Connection(reply_read, writable=False)
        self.serving = False
        # what this process holds: program names, input keys
        self.loaded: set[str] = set()
        self.inputs: set[str] = set()

    def send(self, request: tuple) -> None:
        try:
            self.requests.send(request)
        except OSError:
            raise CandidateFailed(self._death(), crashed=True) from None

    def ask(self, request: tuple, timeout_s: float) -> Any:
        """Sends a request and waits for its answer; CandidateFailed when it raised, died or took
        longer than timeout_s (the helper is then killed)."""
        if not self.serving:
            self._wait_ready()
        self.send(request)
        if not self.replies.poll(timeout_s):
            self.kill()
            raise CandidateFailed(f"timed out after {timeout_s:g} s", crashed=True)
        try:
            kind, payload = self.replies.recv()
        except (EOFError, OSError):
            raise CandidateFailed(self._death(), crashed=True) from None
        if kind == "error":
            raise CandidateFailed(payload)
        return payload

    def _wait_ready(self) -> None:
        if not self.replies.poll(START_TIMEOUT_S):
            self.kill()
            raise CandidateFailed(f"the measuring process did not start in {START_TIMEOUT_S:g} s", crashed=True)
        try:
            self.replies.recv()
        except (EOFError, OSError):
            raise CandidateFailed("the measuring process failed to start: " + self._death(), crashed=True) from None
        self.serving = True

    def _death(self) -> str:
        try:
            code = self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()
            return "its process stopped answering"
        self.close()
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = "unknown"
            return f"crashed with signal {-code} ({name})"
        return f"its process exited with code {code}"

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.close()

    def close(self) -> None:
        self.requests.close()
        self.replies.close()

    def alive(self) -> bool:
        return not self.requests.closed and self.process.poll() is None


class Runner:
    """Native candidates in a helper process. Programs and inputs are kept here as well, so a
    helper started after a crash gets the ones it needs again."""

    def __init__(self) -> None:
        self._helper: _Helper | None = None
        self._programs: dict[str, tuple[dict[str, Any], Mapping[str, np.ndarray], bytes]] = {}
        self._inputs: dict[str, dict[str, np.ndarray]] = {}

    def start(self) -> None:
        """Starts the helper now without waiting for it (it imports while the caller works)."""
        if self._helper is None or not self._helper.alive():
            try:
                self._helper = _Helper()
            except OSError as exc:  # no interpreter, no process or file slots left
                raise CandidateFailed(f"the measuring process could not start: {exc}", crashed=True) from None

    def put_inputs(self, key: str, inputs: dict[str, np.ndarray]) -> None:
        self._inputs[key] = inputs
        if self._helper is not None:
            self._helper.inputs.discard(key)

    def load(self, name: str, layout: dict[str, Any], weights: Mapping[str, np.ndarray], library: bytes) -> None:
        self._programs[name] = (layout, weights, library)
        if self._helper is not None:
            self._helper.loaded.discard(name)
        self._ask(name, None, None)

    def run(self, name: str, key: str) -> dict[str, np.ndarray]:
        """The program's outputs for the inputs stored under key."""
        return self._ask(name, key, ("run", name, key))

    def time(self, name: str, key: str) -> float:
        """Seconds one run takes when runs come back to back (measured in the helper, around the
        program's calls alone: the median of a short burst)."""
        return self._ask(name, key, ("time", name, key))

    def profile(self, name: str, key: str, kernels: int) -> list[float]:
        """Seconds each of the program's `kernels` kernels takes in one run (its library built
        with compiler.render.c.render's `profile`): the mean over a short burst."""
        return self._ask(name, key, ("profile", name, key, kernels))

    def _ask(self, name: str, key: str | None, request: tuple | None) -> Any:
        try:
            self.start()
            helper = self._helper
            if name not in helper.loaded:
                helper.ask(("load", name, *self._programs[name]), REQUEST_TIMEOUT_S)
                helper.loaded.add(name)
            if key is not None and key not in helper.inputs:
                helper.send(("inputs", key, self._inputs[key]))
                helper.inputs.add(key)
            return None if request is None else helper.ask(request, REQUEST_TIMEOUT_S)
        except CandidateFailed as exc:
            if exc.crashed:
                self._helper = None
            raise

    def reset(self) -> None:
        """Forgets this compile's programs and inputs, here and in the helper."""
        self._programs.clear()
        self._inputs.clear()
        helper = self._helper
        if helper is not None and helper.alive():
            with contextlib.suppress(CandidateFailed):
                helper.send(("reset",))
            helper.loaded.clear()
            helper.inputs.clear()

    def close(self) -> None:
        """Stops the helper: it exits once its pipe closes."""
        helper, self._helper = self._helper, None
        if helper is None:
            return
        helper.close()
        try:
            helper.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            helper.kill()


_lock = threading.Lock()
# the process's runner, and the process it belongs to (a fork must not share its pipes)
_runner: Runner | None = None
_runner_pid = 0


def _current() -> Runner:
    global _runner, _runner_pid
    if _runner is None or _runner_pid != os.getpid():
        _runner, _runner_pid = Runner(), os.getpid()
    return _runner


def prestart() -> None:
    """Starts this process's helper if no compile is using it (so it imports while the compile
    parses, searches and builds); never waits."""
    if _lock.acquire(blocking=False):
        try:
            _current().start()
        except CandidateFailed:
            pass  # the session says why, for each candidate
        finally:
            _lock.release()


@contextlib.contextmanager
def session() -> Iterator[Runner]:
    """The process's runner, for one compile at a time."""
    with _lock:
        runner = _current()
        try:
            yield runner
        finally:
            runner.reset()


@atexit.register
def _close_at_exit() -> None:
    if _runner is not None and _runner_pid == os.getpid():
        _runner.close()


# ---- timing -----------------------------------------------------------------------------------


def round_robin(
    timers: Mapping[str, Callable[[], float]],
    budget_s: float,
    min_repeats: int,
    max_repeats: int,
    failed: Callable[[str, CandidateFailed], None],
    far_behind: float | None = None,
) -> dict[str, list[float]]:
    """Seconds per run of each candidate: one warm-up run each, then rounds in which every
    candidate runs once, the first of a round moving along each time, until each has min_repeats
    and budget_s has passed, or max_repeats. From two runs each on, a candidate whose fastest run
    is far_behind times slower than the fastest of all runs no more (it has lost; its runs are
    kept). A timer that raises CandidateFailed is reported to `failed` and dropped."""
    alive = list(timers)
    for name in list(alive):
        try:
            timers[name]()
        except CandidateFailed as exc:
            alive.remove(name)
            failed(name, exc)
    times: dict[str, list[float]] = {name: [] for name in alive}
    deadline = time.perf_counter() + budget_s
    for round_number in range(max_repeats):
        if round_number >= min_repeats and time.perf_counter() >= deadline:
            break
        shift = round_number % max(1, len(alive))
        for name in alive[shift:] + alive[:shift]:
            try:
                times[name].append(timers[name]())
            except CandidateFailed as exc:
                alive.remove(name)
                del times[name]
                failed(name, exc)
        if far_behind is not None and round_number >= 1 and len(alive) > 1:
            fastest = min(min(times[name]) for name in alive)
            alive = [name for name in alive if min(times[name]) <= far_behind * fastest]
    return times


def median_ms(seconds: list[float]) -> float:
    return statistics.median(seconds) * 1000


# ---- the helper's side ------------------------------------------------------------------------


def _burst_seconds(program: Any, feed: dict[str, np.ndarray]) -> float:
    """Seconds a run takes when runs come back to back, as batches do under load: the median of a
    short burst after one run that wakes the threads and warms the caches. A lone run after the
    helper waited on its pipe read BERT's candidates 1.5x slow and in either order from one
    compile to the next."""
    program.run(feed)
    runs: list[float] = []
    started = time.perf_counter()
    while len(runs) < BURST_MIN_RUNS or (len(runs) < BURST_MAX_RUNS and time.perf_counter() - started < BURST_SECONDS):
        began = time.perf_counter()
        program.run(feed)
        runs.append(time.perf_counter() - began)
    return statistics.median(runs)


def _kernel_seconds(program: Any, feed: dict[str, np.ndarray], kernels: int) -> list[float]:
    """Each kernel's median seconds a run over a burst, from the program's lc_kernel_seconds (the
    median: a slow spell of the shared machine during one run must not decide a schedule)."""
    program.run(feed)
    totals = np.frombuffer(program.kernel_seconds(kernels), dtype=np.float64, count=kernels)
    runs: list[np.ndarray] = []
    started = time.perf_counter()
    while len(runs) < BURST_MIN_RUNS or (len(runs) < BURST_MAX_RUNS and time.perf_counter() - started < BURST_SECONDS):
        before = totals.copy()
        program.run(feed)
        runs.append(totals - before)
    return [float(x) for x in np.median(np.stack(runs), axis=0)]


def serve(request_fd: int, reply_fd: int) -> None:
    """The helper: serves until its parent closes the pipes (or is gone)."""
    requests = Connection(request_fd, writable=False)
    replies = Connection(reply_fd, readable=False)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it closes the pipes
    _exit_with_parent()
    with contextlib.suppress(EOFError, OSError):  # the parent closed the pipes: nothing to answer
        _serve(requests, replies)


def _serve(requests: Connection, replies: Connection) -> None:
    """One request at a time: load, run, time, profile (answered), inputs and reset (not answered)."""
    from compiler.backends.native_cpu import NativeProgram

    programs: dict[str, NativeProgram] = {}
    inputs: dict[str, dict[str, np.ndarray]] = {}
    replies.send(("ready", os.getpid()))
    while True:
        request = requests.recv()
        kind = request[0]
        if kind == "reset":
            programs.clear()
            inputs.clear()
            continue
        if kind == "inputs":
            inputs[request[1]] = request[2]
            continue
        try:
            if kind == "load":
                _, name, layout, weights, library = request
                programs[name] = NativeProgram(layout, weights, library)
                answer: Any = None
            elif kind == "run":
                answer = programs[request[1]].run(inputs[request[2]])
            elif kind == "time":
                answer = _burst_seconds(programs[request[1]], inputs[request[2]])
            elif kind == "profile":
                answer = _kernel_seconds(programs[request[1]], inputs[request[2]], request[3])
            else:
                raise ValueError(f"unknown request {kind!r}")
        except Exception as exc:  # noqa: BLE001 - the parent rejects the candidate with the reason
            replies.send(("error", f"raised {type(exc).__name__}: {exc}"))
        else:
            replies.send(("ok", answer))


def _exit_with_parent() -> None:
    """Exits when the parent is gone, even while a candidate's code runs (it may never return)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


__all__ = ["CandidateFailed", "Runner", "median_ms", "prestart", "round_robin", "session"]
