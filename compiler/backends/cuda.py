"""The CUDA backend: compile (CUDA C to PTX and a cubin for one compute capability, with NVRTC
through cuda-python, which needs no GPU), allocate and run (`CudaProgram`: weights uploaded once,
one arena per call's layout, the launch plan run by a `Driver`).

    ptx, cubin = compile_cuda(source, "sm_90")
    program = CudaProgram(artifact.kernels[0], artifact.all_weights(), artifact.binaries, driver)
    outputs = program.run(inputs)
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from compiler.backends.cublas import GemmArguments
from compiler.backends.layout import arena_layout, bind_inputs, describe
from compiler.dtypes import numpy_dtype
from compiler.errors import CompilerError
from compiler.kernels.ir import Buffer, Program
from compiler.render.cuda import MAX_GRID_X, CudaSource
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

    def execute(self, module: Any, calls: list[LaunchCall], key: Hashable) -> float:
        """Runs the calls in order and returns the device seconds they took; the same key means
        the same calls (a driver may capture them once, as a CUDA graph, and replay it)."""

    def profile(self, module: Any, calls: list[LaunchCall]) -> list[float]:
        """The calls launched one by one, each one's device seconds (a schedule search's measure)."""

    def bad_index(self, module: Any) -> bool:
        """Whether the last call gathered with an index out of range (lc_bad_index), cleared."""

    def unload(self, module: Any) -> None:
        """The module (and whatever the driver keeps for its calls) leaves the device."""


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


class CudaProgram:
    """A CUDA artifact loaded on a device: its weights uploaded once; a call lays out its inputs,
    outputs and temps in one arena (grown to the largest call, then kept), copies the inputs in,
    runs the launch plan, and copies the outputs out. One call at a time (`run` is thread-safe)."""

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
        # the device seconds of the last call's launches (CUDA events on a GPU): what is billed
        self.last_device_seconds = 0.0

    def resident_bytes(self) -> int:
        """Device memory held while loaded: the weights (the arena is per call's size)."""
        return self._weight_bytes

    def close(self) -> None:
        """Frees the weights, the arena and the module on the device (after a call under way)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for address in [*self._addresses.values(), *([self._arena] if self._arena else [])]:
                self.driver.free(address)
            self._addresses.clear()
            self._arena, self._arena_bytes = 0, 0
            self.driver.unload(self.module)

    def run(self, inputs: Mapping[str, np.ndarray], busy: bool = False) -> dict[str, np.ndarray]:
        """The outputs (`busy` is for CPU programs' threads: a GPU runs one call at a time)."""
        return self._call(inputs, None)

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
        outputs = {b.id: np.empty(shape, numpy_dtype(b.dtype)) for b, shape in zip(self._outputs, plan.output_shapes)}
        with self._lock:
            if self._closed:
                raise RuntimeError("this program was unloaded from its device")
            if plan.total > self._arena_bytes:
                # at least doubled: a runtime's batches grow a few times, not once per size (each
                # new arena address invalidates the graphs captured for the old one)
                grown = max(plan.total, 2 * self._arena_bytes)
                if self._arena:
                    self.driver.free(self._arena)
                    self._arena, self._arena_bytes = 0, 0  # (consistent if the allocation fails)
                try:
                    self._arena, self._arena_bytes = self.driver.alloc(grown), grown
                except MemoryError:
                    self._arena, self._arena_bytes = self.driver.alloc(plan.total), plan.total  # exactly what it needs
            calls = plan.calls(self._arena, self._addresses)
            for buffer_id, array in arrays.items():
                if array.nbytes:
                    self.driver.upload(self._arena + plan.offsets[buffer_id], array)
            if per_launch is None:
                self.last_device_seconds = self.driver.execute(self.module, calls, (plan.key, self._arena))
            else:
                for number, seconds in zip(plan.launched, self.driver.profile(self.module, calls)):
                    per_launch[number] = seconds
            if self.driver.bad_index(self.module):
                raise IndexError("an index is out of bounds for the axis it selects from")
            for buffer_id, array in outputs.items():
                if array.nbytes:
                    self.driver.download(self._arena + plan.offsets[buffer_id], array)
        return {b.name: outputs[b.id] for b in self._outputs}

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
        output_shapes, temp_offsets, temps_bytes = arena_layout(self._outputs, self._temps, self.slots, bindings, ARENA_ALIGNMENT)
        offsets = dict(zip((b.id for b in self._temps), temp_offsets))
        total = temps_bytes
        sized = [
            *((b.id, int(np.prod(shape, dtype=np.int64)) * size) for b, shape, size in zip(self._inputs, input_shapes, itemsizes)),
            *((b.id, int(np.prod(shape, dtype=np.int64)) * numpy_dtype(b.dtype).itemsize) for b, shape in zip(self._outputs, output_shapes)),
        ]
        for buffer_id, nbytes in sized:  # inputs and outputs after the temps
            offsets[buffer_id] = total
            total += -(-max(1, nbytes) // ARENA_ALIGNMENT) * ARENA_ALIGNMENT
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
        plan = _CallPlan(key, input_shapes, output_shapes, offsets, total, symbols, launches)
        with self._lock:
            self._plans[key] = plan
            while len(self._plans) > MAX_PLANS:
                self._plans.popitem(last=False)
        return plan


@dataclass
class _CallPlan:
    """A call's layout at one set of sizes: its outputs' shapes, each input's, output's and temp's
    offset in the arena, the arena's bytes, the symbols, and the launches with something to
    compute (number, function, blocks, threads, buffers, cuBLAS call), made into LaunchCalls for
    an arena address once (the weights' addresses are fixed while the program is loaded)."""

    key: tuple[tuple[str, int], ...]
    input_shapes: tuple[tuple[int, ...], ...]
    output_shapes: list[tuple[int, ...]]
    offsets: dict[int, int]
    total: int
    symbols: np.ndarray
    launches: list[tuple[int, str, tuple[int, int, int], int, tuple[int, ...], GemmArguments | None]]
    _arena: int = -1
    _calls: list[LaunchCall] = field(default_factory=list)

    @property
    def launched(self) -> list[int]:
        return [launch[0] for launch in self.launches]

    def calls(self, arena: int, weights: Mapping[int, int]) -> list[LaunchCall]:
        if arena != self._arena:
            address = {**weights, **{b: arena + o for b, o in self.offsets.items()}}
            self._calls = [
                LaunchCall(function, blocks, threads, self.symbols, tuple(address.get(b, 0) for b in buffers), library)
                for _, function, blocks, threads, buffers, library in self.launches
            ]
            self._arena = arena
        return self._calls


__all__ = [
    "ARENA_ALIGNMENT", "CudaBuildFailed", "CudaProgram", "Driver", "LaunchCall", "compile_cuda", "gemm_arguments", "kernel_record",
]
