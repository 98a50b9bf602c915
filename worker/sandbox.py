"""Compiles in a child process, under a wall-time and an address-space limit.

A graph may ask the compiler for unbounded time or memory (twenty nested If levels, a constant
expanded to 10^12 elements): in a child, that costs the child only. Children fork from a
forkserver that has the compiler imported, so each starts in milliseconds without inheriting
the server's threads. A child reads the graph's file itself, so the server never holds a
graph whole. It sends its compile's progress over its pipe before the answer; the parent hands
it to the caller's callback. Each compile has a CompileHandle, which is what DELETE cancels.
"""

from __future__ import annotations

import multiprocessing
import os
import resource
import signal
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from compiler import Artifact, CompilerError, UnsupportedModel, compile_onnx
from compiler.pipeline import Progress
from compiler.targets import EXPORTED

# a child sends a progress message at most this often within one phase (a new phase at once)
PROGRESS_INTERVAL_S = 0.25


class CompileTimeout(CompilerError):
    """The compile ran past its wall-time limit and was stopped."""


class CompileOutOfMemory(CompilerError):
    """The compile needed more memory than its limit."""


class CompileCrashed(CompilerError):
    """The compile's process died without an answer."""


class CompileCancelled(CompilerError):
    """The compile was stopped through its handle (its version was deleted)."""


class _ProgressSender:
    """The child's progress callback: ("progress", event) on the pipe, at once for a new phase,
    else at most every PROGRESS_INTERVAL_S (a later event carries what a dropped one said)."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._phase: str | None = None
        self._sent_at = -PROGRESS_INTERVAL_S

    def __call__(self, event: dict[str, Any]) -> None:
        now = time.monotonic()
        if event.get("phase") == self._phase and now - self._sent_at < PROGRESS_INTERVAL_S:
            return
        self._phase, self._sent_at = event.get("phase"), now
        self._conn.send(("progress", event))


def _compile_child(
    conn: Connection,
    graph: Path,
    target: str,
    memory_bytes: int,
    candidates: tuple[str, ...] | None,
    search: bool | None = None,
    precision: str = EXPORTED,
    settings: Any = None,
) -> None:
    os.setpgid(0, 0)  # its own process group: stopping it stops the C compiler it may be running
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, hard))
    try:
        cache = _kernel_cache(settings)
        seconds = None if settings is None else settings.compile_search_seconds
        artifact = compile_onnx(
            graph.read_bytes(), target, candidates, search, _ProgressSender(conn), precision, memory_bytes, cache, seconds
        )
        conn.send(("ok", artifact.to_files()))
    except UnsupportedModel as exc:
        conn.send(("unsupported", exc.missing))
    except CompilerError as exc:
        conn.send(("error", str(exc)))
    except MemoryError:
        conn.send(("memory", None))
    except Exception as exc:  # noqa: BLE001  a compiler bug: the parent fails the version with its type
        conn.send(("crash", type(exc).__name__))


def _kernel_cache(settings: Any):
    """The schedule search's kernel cache in the settings' object store (None without settings)."""
    if settings is None:
        return None
    from cloud.storage import make_object_store
    from worker.kernel_cache import ObjectStoreKernelCache

    return ObjectStoreKernelCache(make_object_store(settings))


def _kill_group(child: multiprocessing.Process) -> None:
    """The child and everything it started (gcc and its cc1), which would otherwise outlive it."""
    if child.exitcode is not None:
        return  # reaped: its pid, and so its group id, may belong to someone else now
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError, TypeError):
        child.kill()  # not started, already gone, or the group was never made


class CompileHandle:
    """One compile, from when its job is taken until it ends: what a cancel names. A version id
    can come back (SQLite gives a deleted row's id again), a handle cannot: cancelling a compile
    that has ended, or one that never started, touches no other compile."""

    def __init__(self, version_id: int) -> None:
        self.version_id = version_id
        self._lock = threading.Lock()
        self._cancelled = False
        # the compile's process while it runs
        self._child: multiprocessing.Process | None = None

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        """Stops the compile: at once when its process runs, before it starts otherwise."""
        with self._lock:
            self._cancelled = True
            child = self._child
        if child is not None:
            _kill_group(child)

    def _start(self, child: multiprocessing.Process) -> None:
        with self._lock:
            if self._cancelled:
                raise CompileCancelled(f"version {self.version_id} was deleted")
            child.start()
            self._child = child

    def _ended(self) -> None:
        with self._lock:
            self._child = None


class Sandbox:
    """Runs compile_onnx in child processes; a compile's CompileHandle stops it."""

    def __init__(
        self,
        timeout_s: float,
        memory_bytes: int,
        candidates: tuple[str, ...] | None = None,
        search: bool | None = None,
        settings: Any = None,
    ) -> None:
        self.timeout_s = timeout_s
        # where the child finds the object store that holds the kernel cache (None: no cache)
        self.settings = settings
        self.memory_bytes = memory_bytes
        self.candidates = candidates
        # whether the compile runs the search (None: the compiler's default)
        self.search = search
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload(["compiler.pipeline", "worker.sandbox"])

    def compile(
        self,
        version_id: int,
        graph: Path,
        target: str,
        progress: Progress | None = None,
        precision: str = EXPORTED,
        handle: CompileHandle | None = None,
    ) -> Artifact:
        """The artifact, compiled in a child for `target` in `precision` from the graph's file
        (the child reads it: the caller never holds the graph); `progress` is called (in
        this thread) with each progress event the child sends while it compiles. `handle`, when
        given, is how the caller stops this compile (CompileCancelled)."""
        handle = handle or CompileHandle(version_id)
        receiver, sender = self._context.Pipe(duplex=False)
        child = self._context.Process(
            target=_compile_child,
            args=(sender, graph, target, self.memory_bytes, self.candidates, self.search, precision, self.settings),
            daemon=True,
            name=f"compile-{version_id}",
        )
        try:
            handle._start(child)
        except BaseException:
            receiver.close()
            raise
        finally:
            sender.close()
        try:
            return self._answer(handle, child, receiver, progress)
        finally:
            _kill_group(child)
            child.join()
            handle._ended()
            receiver.close()

    def _answer(
        self, handle: CompileHandle, child: multiprocessing.Process, receiver: Connection, progress: Progress | None
    ) -> Artifact:
        deadline = time.monotonic() + self.timeout_s
        while True:
            if not receiver.poll(max(0.0, deadline - time.monotonic())):
                raise CompileTimeout(f"it ran longer than the limit of {self.timeout_s:g} s")
            try:
                kind, payload = receiver.recv()
            except EOFError:
                child.join()
                if handle.cancelled:
                    raise CompileCancelled(f"version {handle.version_id} was deleted") from None
                raise CompileCrashed(f"the compiler's process died (exit code {child.exitcode})") from None
            if kind != "progress":
                break
            if progress is not None:
                progress(payload)
        if kind == "ok":
            return Artifact.from_files(payload.__getitem__)
        if kind == "unsupported":
            raise UnsupportedModel(payload)
        if kind == "memory":
            raise CompileOutOfMemory(f"it needed more than the limit of {self.memory_bytes / 2**30:g} GiB")
        if kind == "crash":
            raise CompileCrashed(f"internal compiler error ({payload})")
        raise CompilerError(payload)
