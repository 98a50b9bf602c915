"""JSON in and out of inference, kept off the event loop.

`json` holds the interpreter lock for a whole parse or dump (a 20 MB body: about 0.45 s), so a
worker thread alone still stalls `/healthz` and every other request for that long. Small bodies
are handled in a thread; large ones in a child process, which returns arrays (cheap to pickle)
or rendered bytes, so the server's interpreter only copies buffers.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

import numpy as np
from starlette.concurrency import run_in_threadpool

from cloud.errors import Unavailable
from compiler.dtypes import is_float

T = TypeVar("T")

# JSON characters per element when a response is rendered: a float32 is about 12
_RENDERED_BYTES_PER_ELEMENT = 12


def encode_output(array: np.ndarray) -> Any:
    """Nested lists; non-finite floats as the strings "NaN", "Infinity", "-Infinity"."""
    if is_float(array.dtype.name) and array.dtype.itemsize < 4:
        array = array.astype(np.float32)  # bfloat16 and float8 scalars are not JSON numbers
    if is_float(array.dtype.name) and not np.all(np.isfinite(array)):
        as_object = array.astype(object)
        as_object[np.isnan(array)] = "NaN"
        as_object[np.isposinf(array)] = "Infinity"
        as_object[np.isneginf(array)] = "-Infinity"
        return as_object.tolist()
    return array.tolist()


def render_infer_response(model: str, version: int, outputs: Mapping[str, np.ndarray], usage: dict) -> bytes:
    """The body of a successful inference; a plain function, so a child process can run it."""
    from api.schemas import InferResponse  # the child imports the schema only when it renders

    encoded = {k: encode_output(v) for k, v in outputs.items()}
    return (
        InferResponse(model=model, version=version, outputs=encoded, usage=usage).model_dump_json().encode()
    )


def rendered_size(outputs: Mapping[str, np.ndarray]) -> int:
    """About how many bytes of JSON the outputs become."""
    return sum(int(a.size) for a in outputs.values()) * _RENDERED_BYTES_PER_ELEMENT


# below this many bytes a body is decoded or rendered on the event loop itself: it takes
# microseconds, less than handing it to a thread
INLINE_BELOW_BYTES = 16 * 1024


class Codec:
    """Runs decode and render functions: inline for small bodies, in a thread below
    `process_above_bytes`, in one of `workers` child processes (started on first use) above it."""

    def __init__(self, process_above_bytes: int, workers: int) -> None:
        self.process_above_bytes = process_above_bytes
        self.workers = max(1, workers)
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    def _executor(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                # forkserver: a child must not inherit the server's threads and event loop
                context = multiprocessing.get_context("forkserver")
                self._pool = ProcessPoolExecutor(self.workers, mp_context=context)
            return self._pool

    async def run(self, size: int, function: Callable[..., T], *args: Any) -> T:
        if size < min(INLINE_BELOW_BYTES, self.process_above_bytes):
            return function(*args)
        if size < self.process_above_bytes:
            return await run_in_threadpool(function, *args)
        pool = self._executor()
        try:
            return await asyncio.wrap_future(pool.submit(function, *args))
        except BrokenProcessPool:
            # a child died (killed from outside, or out of memory); the next request gets a new pool
            with self._lock:
                if self._pool is pool:
                    self._pool = None
            pool.shutdown(wait=False, cancel_futures=True)
            raise Unavailable("the request decoder stopped while handling this request; retry it") from None

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
