"""Checking that an uploaded file is an ONNX model this service can take, before it is stored
(and, for a text-generation upload, that it is a decoder the runtime can serve with its
tokenizer: registry.bundle.check_generative, which runs a merged decoder's branches).

Parsing a model holds it whole in memory, about twice its size: a gateway that parsed every
upload itself grew by hundreds of megabytes per concurrent upload. The gateway's check runs in a
child process instead, under an address-space limit and a wall-time limit, so what an upload
costs the gateway stays a few buffers whatever its size; a graph that crashes a runner (the
merged-decoder check runs it) takes the child down, not the gateway. Tools and tests check
in-process.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import resource
import signal
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Protocol

from cloud.errors import InvalidModelFile
from compiler import InvalidModel, UnsupportedModel
from compiler.frontends.onnx import parse_model
from registry.bundle import Bundle, check_generative

log = logging.getLogger(__name__)

# what a model check may take before it is stopped: parsing and the ONNX checker run in
# seconds even for the largest upload allowed
CHECK_TIMEOUT_S = 120.0


class ModelCheck(Protocol):
    def __call__(self, path: Path, bundle: Bundle | None = None) -> dict[str, Any] | None:
        """InvalidModelFile, naming why, unless the file at `path` is a usable ONNX model; with a
        generative upload's `bundle`, also unless it is a decoder served with that tokenizer, and
        then what the version keeps of the bundle (registry.bundle.check_generative)."""


def check_here(path: Path, bundle: Bundle | None = None) -> dict[str, Any] | None:
    """The check in this process (command-line tools, tests, workers)."""
    _refuse_unless_usable(path.read_bytes())
    return None if bundle is None else check_generative(path, bundle)


def _refuse_unless_usable(data: bytes) -> None:
    try:
        parse_model(data)
    except (InvalidModel, UnsupportedModel) as exc:
        raise InvalidModelFile(f"the uploaded file is not a usable ONNX model: {exc}") from None


def _check_child(conn: Connection, path: str, memory_bytes: int, bundle: Bundle | None) -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, hard))
    try:
        conn.send(("ok", check_here(Path(path), bundle)))
    except InvalidModelFile as exc:
        conn.send(("invalid", exc.message))
    except MemoryError:
        conn.send(("memory", None))
    except Exception as exc:  # noqa: BLE001  a bug the file set off: the parent says so, with its type
        conn.send(("crash", type(exc).__name__))


class CheckInChild:
    """The check in a child process from the forkserver the compile sandbox also uses (its
    children start in milliseconds with the compiler imported)."""

    def __init__(self, memory_bytes: int, timeout_s: float = CHECK_TIMEOUT_S) -> None:
        self.memory_bytes = memory_bytes
        self.timeout_s = timeout_s
        self._context = multiprocessing.get_context("forkserver")
        # children start with the parser imported (the pipeline: `compiler` alone imports lazily);
        # the compile sandbox asks for a superset
        self._context.set_forkserver_preload(["compiler.pipeline"])

    def __call__(self, path: Path, bundle: Bundle | None = None) -> dict[str, Any] | None:
        receiver, sender = self._context.Pipe(duplex=False)
        child = self._context.Process(
            target=_check_child, args=(sender, str(path), self.memory_bytes, bundle), daemon=True, name="model-check"
        )
        child.start()
        sender.close()
        try:
            if not receiver.poll(self.timeout_s):
                raise InvalidModelFile(f"checking the uploaded model took longer than {self.timeout_s:g} s")
            try:
                kind, message = receiver.recv()
            except EOFError:
                child.join()
                log.warning("the check of an uploaded model died without an answer (exit code %s)", child.exitcode)
                raise InvalidModelFile(
                    f"the uploaded model could not be checked: the process reading it died (exit code {child.exitcode})"
                ) from None
        finally:
            if child.exitcode is None:
                # it may have ended since (a forkserver's child is reaped by the forkserver)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.pid, signal.SIGKILL)
            child.join()
            receiver.close()
        if kind == "ok":
            return message
        if kind == "invalid":
            raise InvalidModelFile(message)
        if kind == "crash":
            log.warning("the check of an uploaded model raised %s", message)
            raise InvalidModelFile(f"the uploaded model could not be checked: the checker failed on it ({message})")
        if kind == "memory":
            raise InvalidModelFile(
                f"the uploaded model needs more than {self.memory_bytes / 2**30:g} GiB to read, the limit of a model here"
            )
