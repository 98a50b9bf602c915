"""The CUDA backend: compile (CUDA C to PTX and a cubin for one compute capability, with NVRTC
through cuda-python, which needs no GPU), allocate and run (`CudaProgram`: weights uploaded once,
one arena per call's layout, the launch plan run by a `Driver`).

    ptx, cubin = compile_cuda(source, "sm_90")
    program = CudaProgram(artifact.kernels[0], artifact.all_weights(), artifact.binaries, driver)
    outputs = program.run(inputs)                      # NumPy in, NumPy out (a served request)
    device_outputs = program.run_on_device(device_inputs)  # DeviceTensors in and out, no host copies
"""

from __future__ import annotations

import contextlib
import ctypes
import re
import threading
import weakref
from collections import OrderedDict, deque
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from compiler.backends.cublas import GemmArguments
from compiler.backends.layout import ArenaPlan, bind_inputs, describe
from compiler.dtypes import numpy_dtype
from compiler.errors import CompilerError
from compiler.kernels.ir import Buffer, Program
from compiler.render.cuda import MAX_GRID_X, PRELUDE, CudaSource
from compiler.shape import dim_from_json, evaluate, shape_from_json

# -default-device: every function not marked otherwise is __device__ (the prelude's helpers)
NVRTC_OPTIONS = ("--std=c++17", "-default-device")


class CudaBuildFailed(CompilerError):
    """NVRTC refused the rendered source (a renderer bug): the log says where."""


def _check(result, what: str, program=None) -> None:
    from cuda.bindings import nvrtc

    if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        log = _log(program) if program is not None else ""
        raise CudaBuildFailed(f"NVRTC {what} failed ({result.name}){': ' + log if log else ''}")


def _log(program) -> str:
    from cuda.bindings import nvrtc

    _, size = nvrtc.nvrtcGetProgramLogSize(program)
    buffer = b" " * size
    nvrtc.nvrtcGetProgramLog(program, buffer)
    return buffer.rstrip(b"\0 ").decode(errors="replace")[-4000:]


def compile_cuda(source: str, arch: str, name: str = "program.cu") -> tuple[bytes, bytes]:
    """(PTX, cubin) of `source` for `arch` ("sm_90"); CudaBuildFailed with NVRTC's log if it fails."""
    if not re.fullmatch(r"sm_\d+a?", arch):
        raise ValueError(f"not a compute capability: {arch!r} (expected e.g. 'sm_90')")
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:  # the CUDA extra is not installed
        raise CudaBuildFailed(f"NVRTC is not available here ({exc}); install cuda-bindings and nvidia-cuda-nvrtc") from None
    ptx = _compile(nvrtc, source, name, f"--gpu-architecture=compute_{arch[3:]}", ptx=True)
    cubin = _compile(nvrtc, source, name, f"--gpu-architecture={arch}", ptx=False)
    return ptx, cubin


def _compile(nvrtc, source: str, name: str, target: str, ptx: bool) -> bytes:
    status, program = nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], [])
    _check(status, "create")
    try:
        options = [o.encode() for o in (*NVRTC_OPTIONS, target)]
        (status,) = nvrtc.nvrtcCompileProgram(program, len(options), options)
        _check(status, "compile", program)
        if ptx:
            status, size = nvrtc.nvrtcGetPTXSize(program)
            _check(status, "PTX size")
            data = b" " * size
            (status,) = nvrtc.nvrtcGetPTX(program, data)
            _check(status, "PTX")
        else:
            status, size = nvrtc.nvrtcGetCUBINSize(program)
            _check(status, "cubin size")
            data = b" " * size
            (status,) = nvrtc.nvrtcGetCUBIN(program, data)
            _check(status, "cubin")
        return data
    finally:
        nvrtc.nvrtcDestroyProgram(program)




# ---- running: a loaded program on a device, behind a small driver interface ----------------------

# every buffer of a call starts at a multiple of this many bytes in the arena (float4 loads, and
# the 256-byte alignment cudaMalloc itself gives)
ARENA_ALIGNMENT = 256
# call layouts a loaded program keeps worked out (one per distinct set of sizes)
MAX_PLANS = 64
# page-locked staging blocks come in powers of two from this size up: a runtime's batches of
# varying sizes reuse one block rather than pinning memory per size
MIN_STAGING_BYTES = 64 * 1024
# output blocks one program lends out at once; past it a call's outputs go to fresh pageable arrays
# (a caller that keeps every output must not page-lock all of the host's memory)
MAX_LENT_OUTPUT_BLOCKS = 8


@dataclass(frozen=True)
class DeviceTensor:
    """A tensor in device memory: what `CudaProgram.run_on_device` takes and returns."""

    # its device address (a torch tensor's data_ptr(), say)
    address: int
    shape: tuple[int, ...]
    # the compiler's dtype name: "float32", "float16", "int64", ...
    dtype: str


@dataclass(frozen=True)
class LaunchCall:
    """One kernel launch of a call: its function, blocks along x, y, z, threads per block, the
    symbols' values and the device address of each buffer it takes."""

    function: str
    grid: tuple[int, int, int]
    threads: int
    symbols: np.ndarray
    pointers: tuple[int, ...]
    # a library launch's call (a cuBLAS product: pointers are its A, B and C), else None
    library: GemmArguments | None = None


class Driver(Protocol):
    """What a CUDA program needs of a device: the driver API on a GPU (compiler.backends.cuda_driver),
    or the CPU emulation (compiler.backends.cuda_emulator.EmulatedDriver) where there is none."""

    def load(self, kernel: Mapping[str, Any], binaries: Mapping[str, bytes]) -> Any:
        """The program's module (its functions named by the launch plan)."""

    def alloc(self, nbytes: int) -> int:
        """A device address of at least nbytes, aligned to ARENA_ALIGNMENT."""

    def free(self, address: int) -> None: ...

    def upload(self, address: int, array: np.ndarray) -> None: ...

    def download(self, address: int, array: np.ndarray) -> None: ...

    def host_alloc(self, nbytes: int) -> np.ndarray:
        """At least nbytes of page-locked host memory as a uint8 array (a copy between it and the
        device runs at the bus's speed, with no staging by the driver); ordinary host memory
        where the system refuses to lock more. Python owns the memory: it stays valid after
        `host_free` and after the driver closes, for as long as an array views it."""

    def host_free(self, block: np.ndarray) -> None:
        """A block of `host_alloc` is page-locked no more (its memory goes once nothing views it)."""

    def execute(self, module: Any, calls: list[LaunchCall], key: Hashable) -> float:
        """Runs the calls in order and returns the device seconds they took; the same key means
        the same calls (a driver may capture them once, as a CUDA graph, and replay it)."""

    def profile(self, module: Any, calls: list[LaunchCall]) -> list[float]:
        """The calls launched one by one, each one's device seconds (a schedule search's measure)."""

    def bad_index(self, module: Any) -> bool:
        """Whether the last call gathered with an index out of range (lc_bad_index), cleared."""

    def unload(self, module: Any) -> None:
        """The module (and whatever the driver keeps for its calls) leaves the device."""

    def load_source(self, source: str, functions: list[str]) -> Any:
        """A module built here from CUDA C (NVRTC for this GPU; the emulator's compiler without
        one) holding `functions`: the runtime's own small kernels (SlotCopies)."""


# a library launch's entries that are names, not dims
_LIBRARY_NAMES = ("op", "a_type", "b_type", "c_type", "compute")


def gemm_arguments(library: Mapping[str, Any], bindings: Mapping[str, int]) -> GemmArguments:
    """A library launch's cuBLAS call at a call's sizes (its dims evaluated)."""
    sizes = {k: evaluate(dim_from_json(v), bindings) for k, v in library.items() if k not in _LIBRARY_NAMES}
    return GemmArguments(**sizes, **{k: library[k] for k in _LIBRARY_NAMES if k != "op"})


def kernel_record(program: Program, rendered: CudaSource, arch: str, size_limits: Mapping[str, int]) -> dict[str, Any]:
    """What an artifact keeps of a CUDA program besides its PTX and cubin."""
    return {
        "kind": "cuda",
        "arch": arch,
        "source": rendered.source,
        "launches": [launch.to_json() for launch in rendered.launches],
        # (as rendered: windows a cuBLAS product stores whole are temps there)
        "layout": describe(rendered.program or program, size_limits),
    }


def staging_size(nbytes: int) -> int:
    """The size class of a staging block holding nbytes: a power of two, MIN_STAGING_BYTES or more."""
    return max(MIN_STAGING_BYTES, 1 << max(0, nbytes - 1).bit_length())


class StagingPool:
    """One program's page-locked host blocks, by size class, allocated once and reused by its calls.

    The inputs block is filled and copied to the device during a call, so the next call simply
    overwrites it. Outputs are copied from the device straight into a block that is then lent
    with the arrays `run` returns (views of it): the block comes back once the last array viewing
    it is collected, so a later call never overwrites outputs a caller still holds, and no host
    copy is made. That is the fastest safe choice: a copy out into a fresh NumPy array costs the
    page faults of its first touch (a 206 MB logits array: about 50 ms of the 80 ms a fresh copy
    took on the development machine) on top of the copy itself. Past MAX_LENT_OUTPUT_BLOCKS
    blocks still held, outputs go to fresh pageable arrays (the old, slow copy) instead."""

    def __init__(self, driver: Driver) -> None:
        self.driver = driver
        # blocks page-locked so far, and unlocked again (the tests check that calls reuse them)
        self.allocated = 0
        self.freed = 0
        self._inputs: np.ndarray | None = None
        self._idle: dict[int, list[np.ndarray]] = {}
        # blocks whose last array was collected: appended by a finalizer, from any thread at any
        # moment (a deque's append and popleft need no lock)
        self._returned: deque[np.ndarray] = deque()
        self._lent = 0
        self._closed = False

    @property
    def lent(self) -> int:
        """Output blocks that arrays a caller holds still view."""
        return self._lent - len(self._returned)

    def inputs_block(self, nbytes: int) -> np.ndarray:
        """The inputs' block, grown to nbytes' size class when smaller."""
        size = staging_size(nbytes)
        if self._inputs is None or self._inputs.nbytes < size:
            if self._inputs is not None:
                block, self._inputs = self._inputs, None
                self._unlock(block)
            self._inputs = self._lock_block(size)
        return self._inputs

    def lend(self, nbytes: int) -> ctypes.Array | None:
        """A block of nbytes' size class as a buffer to make the outputs' arrays from (with
        np.frombuffer: they keep it alive, and it returns here once they are all collected), or
        None when MAX_LENT_OUTPUT_BLOCKS are out."""
        self._take_back()
        size = staging_size(nbytes)
        idle = self._idle.get(size)
        if idle:
            block = idle.pop()
        elif self._lent >= MAX_LENT_OUTPUT_BLOCKS:
            return None
        else:
            block = self._lock_block(size)
        self._lent += 1
        # the lease addresses the block without owning it: the finalizer keeps the block alive
        lease = (ctypes.c_uint8 * size).from_address(block.ctypes.data)
        finalizer = weakref.finalize(lease, self._give_back, block)
        finalizer.atexit = False  # (the process's memory goes with it)
        return lease

    def close(self) -> None:
        """Unlocks every block not lent; a lent one is unlocked when its arrays are collected
        (its memory stays valid for them: Python owns it)."""
        self._closed = True
        blocks = [*([self._inputs] if self._inputs is not None else []), *(b for idle in self._idle.values() for b in idle)]
        self._inputs, self._idle = None, {}
        for block in blocks:
            self._unlock(block)
        self._free_returned()

    def _lock_block(self, size: int) -> np.ndarray:
        block = self.driver.host_alloc(size)[:size]
        self.allocated += 1
        return block

    def _unlock(self, block: np.ndarray) -> None:
        self.driver.host_free(block)
        self.freed += 1

    def _give_back(self, block: np.ndarray) -> None:
        self._returned.append(block)
        if self._closed:
            self._free_returned()

    def _take_back(self) -> None:
        while self._returned:
            block = self._returned.popleft()
            self._lent -= 1
            self._idle.setdefault(block.nbytes, []).append(block)

    def _free_returned(self) -> None:
        while True:
            try:
                block = self._returned.popleft()
            except IndexError:
                return
            self._lent -= 1
            # (from a finalizer, after the driver closed, there is nothing left to unlock)
            with contextlib.suppress(Exception):
                self._unlock(block)


class CudaProgram:
    """A CUDA artifact loaded on a device: its weights uploaded once; a call lays out its inputs,
    outputs and temps in one arena (grown to the largest call, then kept), copies the inputs in,
    runs the launch plan, and copies the outputs out, both copies through page-locked staging
    blocks (`StagingPool`). One call at a time (`run` and `run_on_device` are thread-safe)."""

    def __init__(self, kernel: Mapping[str, Any], weights: Mapping[str, np.ndarray], binaries: Mapping[str, bytes], driver: Driver) -> None:
        layout = kernel["layout"]
        self.buffers = [
            Buffer(i, b["dtype"], shape_from_json(b["shape"]), b["role"], b["name"]) for i, b in enumerate(layout["buffers"])
        ]
        self.slots = {int(k): v for k, v in layout["slots"].items()}
        self.symbols = list(layout["symbols"])
        self.size_limits = dict(layout.get("size_limits", {}))
        self.launches = [
            (launch["kernel"], tuple(launch["buffers"]), tuple(dim_from_json(d) for d in launch["grid"]), launch["threads"])
            for launch in kernel["launches"]
        ]
        self.libraries = [launch.get("library") for launch in kernel["launches"]]
        self.driver = driver
        self.module = driver.load(kernel, binaries)
        self._inputs = [b for b in self.buffers if b.role == "input"]
        self._outputs = [b for b in self.buffers if b.role == "output"]
        self._temps = [b for b in self.buffers if b.role == "temp" and b.id in self.slots]
        self._arena_plan = ArenaPlan(self._outputs, self._temps, self.slots, ARENA_ALIGNMENT)
        self._addresses: dict[int, int] = {}
        self._weight_bytes = 0
        try:
            for b in self.buffers:
                if b.role == "weight":
                    array = np.ascontiguousarray(weights[b.name], dtype=numpy_dtype(b.dtype))
                    self._addresses[b.id] = driver.alloc(max(1, array.nbytes))
                    driver.upload(self._addresses[b.id], array)
                    self._weight_bytes += array.nbytes
        except BaseException:
            # (the device has no room for them, say): what was uploaded leaves with the module
            for address in self._addresses.values():
                driver.free(address)
            driver.unload(self.module)
            raise
        self._arena, self._arena_bytes = 0, 0
        self._plans: OrderedDict[tuple[tuple[str, int], ...], _CallPlan] = OrderedDict()
        self._lock = threading.Lock()
        self._closed = False
        # the host side of a call's copies: page-locked blocks reused across calls
        self.staging = StagingPool(driver)
        # the device seconds of the last call's launches (CUDA events on a GPU): what is billed
        self.last_device_seconds = 0.0

    def resident_bytes(self) -> int:
        """Device memory held while loaded: the weights (the arena is per call's size)."""
        return self._weight_bytes

    def close(self) -> None:
        """Frees the weights, the arena and the module on the device, and unlocks the staging
        blocks (after a call under way)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for address in [*self._addresses.values(), *([self._arena] if self._arena else [])]:
                self.driver.free(address)
            self._addresses.clear()
            self._arena, self._arena_bytes = 0, 0
            self.driver.unload(self.module)
            self.staging.close()

    def run(self, inputs: Mapping[str, np.ndarray], busy: bool = False) -> dict[str, np.ndarray]:
        """The outputs (`busy` is for CPU programs' threads: a GPU runs one call at a time). They
        view a page-locked block that is the caller's until they are collected: no later call
        writes to it."""
        return self._call(inputs, None)

    def run_on_device(self, inputs: Mapping[str, DeviceTensor]) -> dict[str, DeviceTensor]:
        """The outputs of inputs already in device memory, with no copy either way: the launches
        read the inputs where they are, and the outputs stay in this program's arena, valid until
        its next call (copy them on the device to keep them; torch.compile's CUDA graphs give
        theirs the same lifetime). The inputs must be written before this is called (a torch
        stream synchronized, say): the launches go on the driver's own stream."""
        for b in self._inputs:
            given = inputs[b.name]
            if given.dtype != b.dtype or len(given.shape) != len(b.shape):
                raise ValueError(f"input {b.name!r} is {b.dtype} of rank {len(b.shape)}; got {given.dtype} of shape {tuple(given.shape)}")
        bindings = bind_inputs(self._inputs, inputs, self.size_limits)
        plan = self._plan(bindings, tuple(tuple(int(n) for n in inputs[b.name].shape) for b in self._inputs))
        placed = tuple((b.id, int(inputs[b.name].address)) for b in self._inputs)
        with self._lock:
            self._open_arena(plan.total)
            calls = plan.calls(self._arena, self._addresses, placed)
            # the inputs' addresses are part of the call: a captured graph holds them
            self.last_device_seconds = self.driver.execute(self.module, calls, (plan.key, self._arena, placed))
            if self.driver.bad_index(self.module):
                raise IndexError("an index is out of bounds for the axis it selects from")
            return {
                b.name: DeviceTensor(self._arena + plan.offsets[b.id], shape, b.dtype)
                for b, shape in zip(self._outputs, plan.output_shapes)
            }

    def profile(self, inputs: Mapping[str, np.ndarray]) -> list[float | None]:
        """The device seconds of each launch of the plan on these inputs, its kernels launched one
        by one (None for a launch with nothing to compute at these sizes)."""
        seconds: list[float | None] = [None] * len(self.launches)
        self._call(inputs, seconds)
        return seconds

    def _call(self, inputs: Mapping[str, np.ndarray], per_launch: list[float | None] | None) -> dict[str, np.ndarray]:
        """The outputs, the launches run as one graph; or launched one by one when `per_launch` is
        given, their device seconds written into it."""
        arrays = {b.id: np.ascontiguousarray(inputs[b.name], dtype=numpy_dtype(b.dtype)) for b in self._inputs}
        bindings = bind_inputs(self._inputs, inputs, self.size_limits)
        plan = self._plan(bindings, tuple(array.shape for array in arrays.values()))
        with self._lock:
            self._open_arena(plan.total)
            calls = plan.calls(self._arena, self._addresses)
            self._copy_in(plan, arrays)
            if per_launch is None:
                self.last_device_seconds = self.driver.execute(self.module, calls, (plan.key, self._arena))
            else:
                for number, seconds in zip(plan.launched, self.driver.profile(self.module, calls)):
                    per_launch[number] = seconds
            if self.driver.bad_index(self.module):
                raise IndexError("an index is out of bounds for the axis it selects from")
            return self._copy_out(plan)

    def _open_arena(self, nbytes: int) -> None:
        """Checks the program is loaded and its arena holds nbytes (under the lock)."""
        if self._closed:
            raise RuntimeError("this program was unloaded from its device")
        if nbytes > self._arena_bytes:
            # at least doubled: a runtime's batches grow a few times, not once per size (each
            # new arena address invalidates the graphs captured for the old one)
            grown = max(nbytes, 2 * self._arena_bytes)
            if self._arena:
                self.driver.free(self._arena)
                self._arena, self._arena_bytes = 0, 0  # (consistent if the allocation fails)
            try:
                self._arena, self._arena_bytes = self.driver.alloc(grown), grown
            except MemoryError:
                self._arena, self._arena_bytes = self.driver.alloc(nbytes), nbytes  # exactly what it needs

    def _copy_in(self, plan: _CallPlan, arrays: Mapping[int, np.ndarray]) -> None:
        """The inputs into the staging block at their arena offsets, then one copy of the span."""
        span = plan.outputs_start - plan.inputs_start
        if not any(array.nbytes for array in arrays.values()):
            return
        block = self.staging.inputs_block(span)
        for buffer_id, array in arrays.items():
            start = plan.offsets[buffer_id] - plan.inputs_start
            np.copyto(block[start : start + array.nbytes].view(array.dtype).reshape(array.shape), array)
        self.driver.upload(self._arena + plan.inputs_start, block[:span])

    def _copy_out(self, plan: _CallPlan) -> dict[str, np.ndarray]:
        """Each output copied from the arena into a lent staging block, returned as views of it."""
        lease = self.staging.lend(plan.total - plan.outputs_start)
        outputs = {}
        for b, shape in zip(self._outputs, plan.output_shapes):
            dtype, count = numpy_dtype(b.dtype), int(np.prod(shape, dtype=np.int64))
            if lease is None or count == 0:
                array = np.empty(shape, dtype)
            else:
                array = np.frombuffer(lease, dtype, count, plan.offsets[b.id] - plan.outputs_start).reshape(shape)
            if array.nbytes:
                self.driver.download(self._arena + plan.offsets[b.id], array)
            outputs[b.name] = array
        return outputs

    def _plan(self, bindings: dict[str, int], input_shapes: tuple[tuple[int, ...], ...]) -> _CallPlan:
        """What a call at these sizes lays out and launches, worked out once per size (the Python
        of a call is the runtime's overhead on every request: a BERT's 120 launches' grids took
        about a millisecond to evaluate each time)."""
        key = tuple(sorted(bindings.items()))
        with self._lock:
            plan = self._plans.get(key)
            if plan is not None and plan.input_shapes == input_shapes:
                self._plans.move_to_end(key)
                return plan
        itemsizes = [numpy_dtype(b.dtype).itemsize for b in self._inputs]
        output_shapes, temp_offsets, temps_bytes = self._arena_plan(bindings)
        offsets = dict(zip((b.id for b in self._temps), temp_offsets))
        total = temps_bytes
        sized = [
            *((b.id, int(np.prod(shape, dtype=np.int64)) * size) for b, shape, size in zip(self._inputs, input_shapes, itemsizes)),
            *((b.id, int(np.prod(shape, dtype=np.int64)) * numpy_dtype(b.dtype).itemsize) for b, shape in zip(self._outputs, output_shapes)),
        ]
        outputs_start = total
        for number, (buffer_id, nbytes) in enumerate(sized):  # inputs, then outputs, after the temps
            if number == len(self._inputs):
                outputs_start = total
            offsets[buffer_id] = total
            total += -(-max(1, nbytes) // ARENA_ALIGNMENT) * ARENA_ALIGNMENT
        if len(sized) == len(self._inputs):
            outputs_start = total
        symbols = np.array([bindings[s] for s in self.symbols] or [0], np.int64)
        launches = []
        for number, (function, buffers, grid, threads) in enumerate(self.launches):
            blocks = tuple(evaluate(d, bindings) for d in grid)
            if min(blocks) <= 0:
                continue  # nothing to compute (an empty batch or axis)
            library = self.libraries[number]
            if library is None:
                # kernels stride over x: a capped grid still covers every element
                blocks = (min(blocks[0], MAX_GRID_X), blocks[1], blocks[2])
            launches.append((number, function, blocks, threads, buffers, None if library is None else gemm_arguments(library, bindings)))
        plan = _CallPlan(key, input_shapes, output_shapes, offsets, total, temps_bytes, outputs_start, symbols, launches)
        with self._lock:
            self._plans[key] = plan
            while len(self._plans) > MAX_PLANS:
                self._plans.popitem(last=False)
        return plan


# ---- the runtime's own kernels: KV-cache slots copied on the device --------------------------

# one thread per element; a grid past MAX_GRID_X blocks strides
SLOT_COPY_THREADS = 128
# element i of a [batch, heads, n, dim] tensor and its place in a [pool_slots, heads, dim] pool at
# slots[batch, n] (S.v: elements, heads, n, dim)
_SLOT_INDEX = """
        const int64_t d = i % S.v[3], t = (i / S.v[3]) % S.v[2], h = (i / (S.v[3] * S.v[2])) % S.v[1];
        const int64_t b = i / (S.v[3] * S.v[2] * S.v[1]);
        const int64_t at = (b2[b * S.v[2] + t] * S.v[1] + h) * S.v[3] + d;"""
_SLOT_LOOP = "for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < S.v[0]; i += (int64_t)gridDim.x * blockDim.x) {"
# (name, source element type, destination element type, the copy): scatters write new tokens
# into a pool (a bfloat16 value widened to the float32 a pool holds it in), gathers read a pool
_SLOT_KERNELS = (
    ("k0_scatter_16", "uint16_t", "uint16_t", "b1[at] = b0[i];"),
    ("k1_scatter_32", "uint32_t", "uint32_t", "b1[at] = b0[i];"),
    ("k2_scatter_bf16_f32", "uint16_t", "uint32_t", "b1[at] = (uint32_t)b0[i] << 16;"),
    ("k3_scatter_64", "uint64_t", "uint64_t", "b1[at] = b0[i];"),
    ("k4_gather_16", "uint16_t", "uint16_t", "b1[i] = b0[at];"),
    ("k5_gather_32", "uint32_t", "uint32_t", "b1[i] = b0[at];"),
    ("k6_gather_64", "uint64_t", "uint64_t", "b1[i] = b0[at];"),
)
# the copy of an element of 2, 4 or 8 bytes, whatever its type
_SAME_WIDTH = {
    ("scatter", 2): "k0_scatter_16", ("scatter", 4): "k1_scatter_32", ("scatter", 8): "k3_scatter_64",
    ("gather", 2): "k4_gather_16", ("gather", 4): "k5_gather_32", ("gather", 8): "k6_gather_64",
}


def slot_copy_source() -> str:
    """The slot copies as CUDA C, in the rendered programs' form (their prelude, lc_symbols, one
    `b<n>` pointer per buffer), so that NVRTC and the emulator build them as they build those."""
    kernels = "".join(
        f'extern "C" __global__ void __launch_bounds__({SLOT_COPY_THREADS}) {name}(const lc_symbols S, '
        f"const {source} *__restrict__ b0, {destination} *__restrict__ b1, const int64_t *__restrict__ b2) {{\n"
        f"    {_SLOT_LOOP}{_SLOT_INDEX}\n        {copy}\n    }}\n}}\n"
        for name, source, destination, copy in _SLOT_KERNELS
    )
    return PRELUDE + "typedef struct { int64_t v[4]; } lc_symbols;\n" + kernels


class SlotCopies:
    """Copies between tokens laid out [batch, heads, n, dim] and a KV pool [pool_slots, heads, dim]
    at slots [batch, n], on the device (a paged decode step's new keys and values go into the pool
    without leaving the GPU): one kernel launch per tensor, the module built once per driver."""

    def __init__(self, driver: Driver) -> None:
        self.driver = driver
        self.module = driver.load_source(slot_copy_source(), [name for name, *_ in _SLOT_KERNELS])

    def scatter(self, copies: list[tuple[DeviceTensor, DeviceTensor]], slots: DeviceTensor) -> float:
        """Each (tokens [batch, heads, n, dim], pool) pair's tokens written into its pool at `slots`
        [batch, n]; the device seconds."""
        return self._run([(self._scatter_kernel(tokens.dtype, pool.dtype), tokens, pool) for tokens, pool in copies], slots)

    def gather(self, copies: list[tuple[DeviceTensor, DeviceTensor]], slots: DeviceTensor) -> float:
        """Each (pool, out [batch, heads, width, dim]) pair's out filled from its pool at `slots`
        [batch, width]; the device seconds."""
        return self._run([(self._gather_kernel(pool.dtype, out.dtype), pool, out) for pool, out in copies], slots)

    def close(self) -> None:
        self.driver.unload(self.module)

    @staticmethod
    def _scatter_kernel(tokens: str, pool: str) -> str:
        if tokens == "bfloat16" and pool == "float32":
            return "k2_scatter_bf16_f32"
        return SlotCopies._same_width("scatter", tokens, pool)

    @staticmethod
    def _gather_kernel(pool: str, out: str) -> str:
        return SlotCopies._same_width("gather", pool, out)

    @staticmethod
    def _same_width(kind: str, source: str, destination: str) -> str:
        function = _SAME_WIDTH.get((kind, numpy_dtype(source).itemsize))
        if source != destination or function is None:
            raise ValueError(f"no slot {kind} from {source} to {destination} (elements of 2, 4 or 8 bytes of one dtype)")
        return function

    def _run(self, launches: list[tuple[str, DeviceTensor, DeviceTensor]], slots: DeviceTensor) -> float:
        calls = []
        for function, source, destination in launches:
            # the [batch, heads, n, dim] side gives the sizes
            tokens = source if "scatter" in function else destination
            batch, heads, count, dim = tokens.shape
            elements = batch * heads * count * dim
            if not elements:
                continue
            blocks = min(-(-elements // SLOT_COPY_THREADS), MAX_GRID_X)
            symbols = np.array([elements, heads, count, dim], np.int64)
            calls.append(LaunchCall(function, (blocks, 1, 1), SLOT_COPY_THREADS, symbols, (source.address, destination.address, slots.address)))
        if not calls:
            return 0.0
        # the same copies are the same calls: a GPU driver replays the graph it captured for them
        key = tuple((c.function, c.grid, c.pointers, tuple(c.symbols.tolist())) for c in calls)
        return self.driver.execute(self.module, calls, key)


# LaunchCall lists a plan keeps made (one per arena address and placement of device inputs)
MAX_CALL_LISTS = 4


@dataclass
class _CallPlan:
    """A call's layout at one set of sizes: its outputs' shapes, each input's, output's and temp's
    offset in the arena, the arena's bytes (the inputs from `inputs_start`, the outputs from
    `outputs_start`, both after the temps), the symbols, and the launches with something to
    compute (number, function, blocks, threads, buffers, cuBLAS call), made into LaunchCalls once
    per arena address and placement of the inputs (the weights' addresses are fixed while the
    program is loaded)."""

    key: tuple[tuple[str, int], ...]
    input_shapes: tuple[tuple[int, ...], ...]
    output_shapes: list[tuple[int, ...]]
    offsets: dict[int, int]
    total: int
    inputs_start: int
    outputs_start: int
    symbols: np.ndarray
    launches: list[tuple[int, str, tuple[int, int, int], int, tuple[int, ...], GemmArguments | None]]
    _calls: OrderedDict[Hashable, list[LaunchCall]] = field(default_factory=OrderedDict)

    @property
    def launched(self) -> list[int]:
        return [launch[0] for launch in self.launches]

    def calls(self, arena: int, weights: Mapping[int, int], placed: tuple[tuple[int, int], ...] = ()) -> list[LaunchCall]:
        """The launches with the arena at `arena`, and the inputs of `placed` (buffer id, device
        address) read where they are rather than from the arena."""
        made = self._calls.get((arena, placed))
        if made is None:
            address = {**weights, **{b: arena + o for b, o in self.offsets.items()}, **dict(placed)}
            made = [
                LaunchCall(function, blocks, threads, self.symbols, tuple(address.get(b, 0) for b in buffers), library)
                for _, function, blocks, threads, buffers, library in self.launches
            ]
            self._calls[(arena, placed)] = made
            while len(self._calls) > MAX_CALL_LISTS:
                self._calls.popitem(last=False)
        return made


__all__ = [
    "ARENA_ALIGNMENT", "CudaBuildFailed", "CudaProgram", "DeviceTensor", "Driver", "LaunchCall", "SlotCopies", "StagingPool",
    "compile_cuda", "gemm_arguments", "kernel_record", "slot_copy_source", "staging_size",
]
