"""A GPU device: runs the CUDA programs compiled for its type (`luminal-cloud runtime --device
cuda:0`, or `h100:1`: a GPU type of compiler/targets.py and the GPU's ordinal), and holds a
generative model's KV cache in its memory (DeviceKVStorage)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from compiler.dtypes import numpy_dtype
from compiler.kv_layout import CacheLayout, pool_input
from compiler.targets import GPU_TYPES
from runtime.kv_cache import pool_dtype
from runtime.runtime import LoadedProgram

if TYPE_CHECKING:
    from compiler import Artifact
    from compiler.backends.cuda import CudaProgram, DeviceTensor, Driver


class CudaDevice:
    def __init__(self, target: str, driver: Driver) -> None:
        if target not in GPU_TYPES:
            raise ValueError(f"{target!r} is not a GPU type; known: {', '.join(GPU_TYPES)}")
        self.target = target
        self.driver = driver

    def load(self, artifact: Artifact) -> LoadedProgram:
        if artifact.target != self.target:
            raise ValueError(f"artifact for {artifact.target!r} cannot load on {self.target!r}")
        # imported here: the CUDA backend brings the compiler's renderer, which a CPU runtime
        # process (importing this module for parse_device) has no use for
        from compiler.backends.cuda import CudaProgram

        program = CudaProgram(artifact.kernels[0], artifact.all_weights(), artifact.binaries, self.driver)
        return LoadedProgram(artifact.signature, program, program.resident_bytes())

    def release(self, loaded: LoadedProgram) -> None:
        """Frees the program's device memory: its weights, arena and module (the runtime calls
        this once no batch uses it)."""
        loaded.program.close()

    def execute(
        self, loaded: LoadedProgram, inputs: Mapping[str, np.ndarray], busy: bool = False
    ) -> tuple[dict[str, np.ndarray], float]:
        """Outputs and the device seconds of the batch's kernels (CUDA events around its graph:
        the copies in and out are not billed, as queueing is not)."""
        outputs = loaded.program.run(inputs, busy=busy)
        return outputs, loaded.program.last_device_seconds

    def kv_storage(self, layout: CacheLayout, pool_slots: int, device_lock: threading.Lock) -> DeviceKVStorage:
        """A KV cache's pools in this GPU's memory; `device_lock` is the runtime's (one user of the
        device at a time)."""
        return DeviceKVStorage(self.driver, layout, pool_slots, device_lock)


class DeviceStaging:
    """One device block, grown when a step needs more, that a step's small host arrays (tokens,
    slots, a prompt's new keys and values) reach in one upload, with room after them for what the
    step reads back: no allocation per step."""

    def __init__(self, driver: Driver) -> None:
        self.driver = driver
        self.address, self.nbytes = 0, 0

    def place(
        self, arrays: Sequence[np.ndarray], room: Sequence[tuple[tuple[int, ...], str]] = ()
    ) -> tuple[list[DeviceTensor], list[DeviceTensor]]:
        """The arrays uploaded (one copy) and tensors of `room`'s (shape, dtype) after them."""
        from compiler.backends.cuda import ARENA_ALIGNMENT, DeviceTensor

        sizes = [array.nbytes for array in arrays] + [
            int(np.prod(shape, dtype=np.int64)) * numpy_dtype(dtype).itemsize for shape, dtype in room
        ]
        offsets = []
        total = 0
        for nbytes in sizes:
            offsets.append(total)
            total += -(-max(1, nbytes) // ARENA_ALIGNMENT) * ARENA_ALIGNMENT
        self._hold(total)
        uploaded = offsets[len(arrays)] if room else total
        host = np.zeros(uploaded, np.uint8)
        for array, offset in zip(arrays, offsets):
            host[offset : offset + array.nbytes] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        self.driver.upload(self.address, host)
        placed = [DeviceTensor(self.address + o, a.shape, a.dtype.name) for a, o in zip(arrays, offsets)]
        reserved = [
            DeviceTensor(self.address + o, tuple(shape), dtype)
            for (shape, dtype), o in zip(room, offsets[len(arrays) :])
        ]
        return placed, reserved

    def fetch(self, tensors: Sequence[DeviceTensor]) -> list[np.ndarray]:
        """Tensors of this block downloaded in one copy of the span they cover."""
        start = tensors[0].address
        ends = [t.address + int(np.prod(t.shape, dtype=np.int64)) * numpy_dtype(t.dtype).itemsize for t in tensors]
        host = np.empty(max(ends) - start, np.uint8)
        self.driver.download(start, host)
        return [
            host[t.address - start : end - start].view(numpy_dtype(t.dtype)).reshape(t.shape)
            for t, end in zip(tensors, ends)
        ]

    def close(self) -> None:
        if self.address:
            self.driver.free(self.address)
            self.address, self.nbytes = 0, 0

    def _hold(self, nbytes: int) -> None:
        if nbytes > self.nbytes:
            grown = max(nbytes, 2 * self.nbytes)  # doubled: a few growths, not one per step size
            self.close()
            self.address, self.nbytes = self.driver.alloc(grown), grown


class DeviceKVStorage:
    """The pools (per layer, keys and values, [pool_slots, heads, dim] in the cache's dtype) in a
    GPU's memory, allocated once and freed by `close`. A paged decode step reads them in place and
    its new keys and values go into them on the device (SlotCopies.scatter): the cache never
    travels through the host between steps. A step on a program that takes its past whole (a
    prompt's, or a one-token step measured faster there) gets its past gathered on the device and
    downloaded, and its new tokens uploaded and scattered: the fallbacks' host round trip is of
    the step's tokens, never of the pools."""

    # run_paged's step runs a function on the loaded program (Runtime.run_on_device)
    runs_on_device = True

    def __init__(self, driver: Driver, layout: CacheLayout, pool_slots: int, device_lock: threading.Lock) -> None:
        from compiler.backends.cuda import DeviceTensor, SlotCopies

        self.driver = driver
        self.layout = layout
        self.pool_slots = pool_slots
        self._lock = device_lock
        dtype = pool_dtype(layout)
        shape = (pool_slots, layout.kv_heads, layout.head_dim)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        self._addresses: list[int] = []
        self.keys: list[DeviceTensor] = []
        self.values: list[DeviceTensor] = []
        self._staging = DeviceStaging(driver)
        self._copies: SlotCopies | None = None
        try:
            # zeros: a step's left padding reads slot 0 before any token is written there, and a
            # masked position must hold a finite value (0 * NaN is NaN)
            zeros = np.zeros(nbytes, np.uint8)
            for _ in range(layout.layers):
                for pools in (self.keys, self.values):
                    self._addresses.append(driver.alloc(nbytes))
                    driver.upload(self._addresses[-1], zeros)
                    pools.append(DeviceTensor(self._addresses[-1], shape, dtype.name))
            self._copies = SlotCopies(driver)
        except BaseException:
            self.close()
            raise

    def pools(self, layer: int) -> tuple[DeviceTensor, DeviceTensor]:
        return self.keys[layer], self.values[layer]

    def gather(self, slots: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """(The fallback programs' past: gathered on the device, downloaded, then uploaded again by
        the program's run; the pools themselves stay.)"""
        layout = self.layout
        batch, width = slots.shape
        shape = (batch, layout.kv_heads, width, layout.head_dim)
        with self._lock:
            (placed,), gathered = self._staging.place([slots], [(shape, self.keys[0].dtype)] * (2 * layout.layers))
            self._copies.gather(list(zip(self.keys + self.values, gathered)), placed)
            past = self._staging.fetch(gathered)
        return past[: layout.layers], past[layout.layers :]

    def write(self, slots: np.ndarray, keys: Sequence[np.ndarray], values: Sequence[np.ndarray]) -> None:
        """(A fallback program's new tokens, on the host: uploaded, then scattered on the device.)"""
        dtype = pool_dtype(self.layout)
        tokens = [np.ascontiguousarray(array, dtype=dtype) for array in (*keys, *values)]
        with self._lock:
            placed, _ = self._staging.place([*tokens, np.ascontiguousarray(slots, np.int64)])
            self._copies.scatter(list(zip(placed[:-1], self.keys + self.values)), placed[-1])

    def run_paged(
        self, step: Callable[[Callable[[CudaProgram], Any]], Any], inputs: dict[str, np.ndarray], new_slots: np.ndarray
    ) -> tuple[dict[str, np.ndarray], float]:
        """`step(run)` calls `run` with the loaded paged program, the device held
        (Runtime.run_on_device): the step's tokens and slots go up in one copy, the program reads
        the pools in place, its logits come down and its new keys and values are scattered into
        the pools where they lie. Returns the logits and the device seconds of both."""
        layout = self.layout
        names = list(inputs)

        def run(program: CudaProgram) -> tuple[dict[str, np.ndarray], float]:
            placed, _ = self._staging.place([*inputs.values(), np.ascontiguousarray(new_slots, np.int64)])
            tensors = dict(zip(names, placed))
            for layer in range(layout.layers):
                tensors[pool_input(layer, "key")], tensors[pool_input(layer, "value")] = self.pools(layer)
            outputs = program.run_on_device(tensors)
            seconds = program.last_device_seconds
            # written before the program's next call reuses its arena, under the same hold
            new_tokens = [outputs[name] for name in (*layout.present_keys, *layout.present_values)]
            seconds += self._copies.scatter(list(zip(new_tokens, self.keys + self.values)), placed[-1])
            logits = outputs["logits"]
            host = np.empty(logits.shape, numpy_dtype(logits.dtype))
            self.driver.download(logits.address, host)
            return {"logits": host}, seconds

        return step(run)

    def close(self) -> None:
        """Frees the pools, the staging block and the copies' module (idempotent)."""
        with self._lock:
            for address in self._addresses:
                self.driver.free(address)
            self._addresses, self.keys, self.values = [], [], []
            self._staging.close()
            if self._copies is not None:
                self._copies.close()
                self._copies = None


def parse_device(device: str) -> tuple[str, int]:
    """("cuda", 0) from "cuda:0", ("h100", 1) from "h100:1", ("cpu", 0) from "cpu"."""
    target, _, ordinal = device.partition(":")
    if not ordinal:
        return target, 0
    if not ordinal.isdigit():
        raise ValueError(f"device {device!r}: the GPU ordinal after ':' must be a number")
    return target, int(ordinal)


__all__ = ["CudaDevice", "DeviceKVStorage", "DeviceStaging", "parse_device"]
