"""The CUDA driver API behind compiler.backends.cuda's `Driver`: one GPU, its primary context (the
one PyTorch uses too), one stream. A program's launches for one layout are captured once into a
CUDA graph and replayed (about 1 us a kernel inside a graph against 5 us launched one by one);
the device time of a call is measured with CUDA events around the graph launch: what is billed.

With cuda-bindings 13 every call returns a tuple whose first element is the status; `_ok` checks
it and returns the rest. Nothing here runs without a GPU: the tests that need one skip cleanly
(tests/test_cuda.py), and everything else runs on compiler.backends.cuda_emulator's driver.
"""

from __future__ import annotations

import ctypes
from collections import OrderedDict
from collections.abc import Hashable, Mapping
from itertools import pairwise
from typing import Any

import numpy as np

from compiler.backends.cublas import Cublas, CublasUnavailable
from compiler.backends.cuda import LaunchCall, compile_cuda
from compiler.errors import CompilerError

# captured graphs a loaded program keeps (one per distinct call layout: batch and sequence sizes)
MAX_GRAPHS_PER_PROGRAM = 64
# host memory is locked in whole pages
HOST_PAGE = 4096


class CudaUnavailable(CompilerError):
    """No usable GPU here (no driver, no device at that ordinal, or a failing call), named."""


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise CudaUnavailable(f"the CUDA driver bindings are not installed ({exc})") from None
    return driver


def _ok(result: Any, what: str) -> Any:
    """The values of a driver call after its status, or CudaUnavailable naming the call."""
    cu = _driver()
    status, *values = result if isinstance(result, tuple) else (result,)
    if status != cu.CUresult.CUDA_SUCCESS:
        _, name = cu.cuGetErrorName(status)
        raise CudaUnavailable(f"{what} failed: {name.decode() if isinstance(name, bytes) else name}")
    return values[0] if len(values) == 1 else tuple(values)


class CudaModule:
    """A loaded module: its functions by name and the graphs captured for its calls."""

    def __init__(self, module: Any, functions: dict[str, Any]) -> None:
        self.module = module
        self.functions = functions
        self.graphs: OrderedDict[Hashable, Any] = OrderedDict()
        # the device address of the module's lc_bad_index flag
        self.bad_index: Any = None


class CudaDriver:
    """GPU `ordinal` through the driver API; raises CudaUnavailable when there is none."""

    def __init__(self, ordinal: int = 0) -> None:
        cu = _driver()
        self.cu = cu
        try:
            _ok(cu.cuInit(0), "cuInit")
            count = _ok(cu.cuDeviceGetCount(), "cuDeviceGetCount")
        except RuntimeError as exc:  # the bindings raise when libcuda itself cannot be loaded
            raise CudaUnavailable(f"no CUDA driver on this machine ({exc})") from None
        if ordinal >= count:
            raise CudaUnavailable(f"no CUDA device {ordinal}: this machine has {count}")
        self.device = _ok(cu.cuDeviceGet(ordinal), "cuDeviceGet")
        self.context = _ok(cu.cuDevicePrimaryCtxRetain(self.device), "cuDevicePrimaryCtxRetain")
        self._current()
        major = _ok(cu.cuDeviceGetAttribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self.device), "compute capability")
        minor = _ok(cu.cuDeviceGetAttribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self.device), "compute capability")
        self.arch = f"sm_{major}{minor}"
        self.name = _ok(cu.cuDeviceGetName(256, self.device), "cuDeviceGetName").split(b"\0")[0].decode()
        self.memory_bytes = int(_ok(cu.cuDeviceTotalMem(self.device), "cuDeviceTotalMem"))
        self.stream = _ok(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING.value), "cuStreamCreate")
        self.start = _ok(cu.cuEventCreate(0), "cuEventCreate")
        self.end = _ok(cu.cuEventCreate(0), "cuEventCreate")
        # events between launches when a program is profiled kernel by kernel
        self._marks: list[Any] = []
        # cuBLAS on this stream, made on a program's first library launch
        self._blas: Cublas | None = None
        # the host addresses of the page-locked blocks of host_alloc
        self._registered: set[int] = set()

    def _current(self) -> None:
        # the runtime calls from its worker threads: each needs the context made current
        _ok(self.cu.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")

    def load(self, kernel: Mapping[str, Any], binaries: Mapping[str, bytes]) -> CudaModule:
        """The cubin when it was built for this GPU's compute capability, else the PTX (the
        driver compiles it for this GPU: slower to load, for a newer GPU than the artifact's)."""
        self._current()
        image = binaries["program.cubin"] if kernel["arch"] == self.arch else binaries["program.ptx"] + b"\0"
        module = _ok(self.cu.cuModuleLoadData(image), f"loading the program for {self.arch}")
        names = {launch["kernel"] for launch in kernel["launches"] if "library" not in launch}
        if any("library" in launch for launch in kernel["launches"]):
            self.blas()  # made now: cuBLAS cannot start inside the stream capture of a first call
        functions = {name: _ok(self.cu.cuModuleGetFunction(module, name.encode()), f"function {name}") for name in names}
        loaded = CudaModule(module, functions)
        loaded.bad_index, _ = _ok(self.cu.cuModuleGetGlobal(module, b"lc_bad_index"), "the module's lc_bad_index")
        return loaded

    def load_source(self, source: str, functions: list[str]) -> CudaModule:
        """`source` built by NVRTC for this GPU's compute capability and loaded."""
        ptx, cubin = compile_cuda(source, self.arch)
        kernel = {"arch": self.arch, "launches": [{"kernel": name} for name in functions]}
        return self.load(kernel, {"program.cubin": cubin, "program.ptx": ptx})

    def unload(self, module: CudaModule) -> None:
        """The module's captured graphs and code leave the device."""
        self._current()
        for graph in module.graphs.values():
            _ok(self.cu.cuGraphExecDestroy(graph), "cuGraphExecDestroy")
        module.graphs.clear()
        _ok(self.cu.cuModuleUnload(module.module), "cuModuleUnload")

    def bad_index(self, module: CudaModule) -> bool:
        """Whether the last call gathered with an index out of range (the flag is then cleared)."""
        self._current()
        flag = np.zeros(1, np.int32)
        _ok(self.cu.cuMemcpyDtoHAsync(flag.ctypes.data, module.bad_index, 4, self.stream), "reading lc_bad_index")
        _ok(self.cu.cuStreamSynchronize(self.stream), "reading lc_bad_index")
        if flag[0]:
            _ok(self.cu.cuMemsetD32Async(module.bad_index, 0, 1, self.stream), "clearing lc_bad_index")
        return bool(flag[0])

    @property
    def has_cublas(self) -> bool:
        """Whether products may run as cuBLAS calls here (its library loads and makes a handle)."""
        try:
            self.blas()
        except CublasUnavailable:
            return False
        return True

    def blas(self) -> Cublas:
        if self._blas is None:
            self._current()
            self._blas = Cublas(int(self.stream), self.alloc, self.free)
        return self._blas

    def close(self) -> None:
        """Gives the primary context back (the device's memory is freed once every user has)."""
        self._current()
        if self._blas is not None:
            self._blas.close()
            self._blas = None
        # blocks that arrays still view: their memory is Python's and stays; only the lock goes
        for address in self._registered:
            _ok(self.cu.cuMemHostUnregister(address), "cuMemHostUnregister")
        self._registered.clear()
        _ok(self.cu.cuStreamDestroy(self.stream), "cuStreamDestroy")
        _ok(self.cu.cuDevicePrimaryCtxRelease(self.device), "cuDevicePrimaryCtxRelease")

    def alloc(self, nbytes: int) -> int:
        """A device allocation; MemoryError when the GPU has no room for it (a runtime then frees
        what it can and tries again, or fails the request that asked for too much)."""
        self._current()
        cu = self.cu
        status, address = cu.cuMemAlloc(max(1, nbytes))
        if status == cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
            free, total = _ok(cu.cuMemGetInfo(), "cuMemGetInfo")
            raise MemoryError(f"the GPU has {free} of its {total} bytes free; {nbytes} were asked for")
        return int(_ok((status, address), f"allocating {nbytes} bytes of device memory"))

    def free(self, address: int) -> None:
        self._current()
        _ok(self.cu.cuMemFree(self.cu.CUdeviceptr(address)), "cuMemFree")

    # copies go on the program's stream: a plain cuMemcpy runs on the legacy default stream, which
    # a non-blocking stream's kernels do not wait for
    def upload(self, address: int, array: np.ndarray) -> None:
        self._current()
        array = np.ascontiguousarray(array)
        _ok(self.cu.cuMemcpyHtoDAsync(self.cu.CUdeviceptr(address), array.ctypes.data, array.nbytes, self.stream), "copying to the device")
        # the host array may be freed once this returns
        _ok(self.cu.cuStreamSynchronize(self.stream), "copying to the device")

    def download(self, address: int, array: np.ndarray) -> None:
        self._current()
        _ok(self.cu.cuMemcpyDtoHAsync(array.ctypes.data, self.cu.CUdeviceptr(address), array.nbytes, self.stream), "copying from the device")
        _ok(self.cu.cuStreamSynchronize(self.stream), "copying from the device")

    def host_alloc(self, nbytes: int) -> np.ndarray:
        """Page-locked host memory that Python owns: a NumPy block registered with the driver
        (cuMemHostRegister) rather than allocated by it (cuMemHostAlloc), so that an output array
        viewing it stays valid after the program or this driver closes (the context's own
        allocations go with the context). The same DMA speed either way; ordinary pageable memory
        where the system refuses to lock more (its memlock limit)."""
        self._current()
        pages = -(-max(1, nbytes) // HOST_PAGE) * HOST_PAGE
        raw = np.empty(pages + HOST_PAGE, np.uint8)
        # whole pages of its own: two registrations must never share a page
        start = -raw.ctypes.data % HOST_PAGE
        block = raw[start : start + pages]
        try:
            _ok(self.cu.cuMemHostRegister(block.ctypes.data, pages, 0), "cuMemHostRegister")
        except (CudaUnavailable, RuntimeError):  # (RuntimeError: a driver without the call)
            return block
        self._registered.add(block.ctypes.data)
        return block

    def host_free(self, block: np.ndarray) -> None:
        if block.ctypes.data in self._registered:
            self._current()
            self._registered.discard(block.ctypes.data)
            _ok(self.cu.cuMemHostUnregister(block.ctypes.data), "cuMemHostUnregister")

    def execute(self, module: CudaModule, calls: list[LaunchCall], key: Hashable) -> float:
        """The calls as one CUDA graph (captured on the first call with this key), timed by events."""
        cu = self.cu
        self._current()
        graph = module.graphs.get(key)
        if graph is None:
            graph = self._capture(module, calls)
            module.graphs[key] = graph
            while len(module.graphs) > MAX_GRAPHS_PER_PROGRAM:
                _, old = module.graphs.popitem(last=False)
                _ok(cu.cuGraphExecDestroy(old), "cuGraphExecDestroy")
        else:
            module.graphs.move_to_end(key)
        _ok(cu.cuEventRecord(self.start, self.stream), "cuEventRecord")
        _ok(cu.cuGraphLaunch(graph, self.stream), "cuGraphLaunch")
        _ok(cu.cuEventRecord(self.end, self.stream), "cuEventRecord")
        _ok(cu.cuEventSynchronize(self.end), "running the program")
        elapsed = getattr(cu, "cuEventElapsedTime_v2", None) or cu.cuEventElapsedTime
        return float(_ok(elapsed(self.start, self.end), "cuEventElapsedTime")) / 1000.0

    def profile(self, module: CudaModule, calls: list[LaunchCall]) -> list[float]:
        """Each call's device seconds: launched one by one on the stream, an event after each (a
        schedule search's per-kernel measure; a served call runs as one graph, `execute`)."""
        cu = self.cu
        self._current()
        while len(self._marks) < len(calls) + 1:
            self._marks.append(_ok(cu.cuEventCreate(0), "cuEventCreate"))
        marks = self._marks[: len(calls) + 1]
        _ok(cu.cuEventRecord(marks[0], self.stream), "cuEventRecord")
        for call, mark in zip(calls, marks[1:]):
            self._launch(module, call)
            _ok(cu.cuEventRecord(mark, self.stream), "cuEventRecord")
        _ok(cu.cuEventSynchronize(marks[-1]), "running the program")
        elapsed = getattr(cu, "cuEventElapsedTime_v2", None) or cu.cuEventElapsedTime
        return [float(_ok(elapsed(a, b), "cuEventElapsedTime")) / 1000.0 for a, b in pairwise(marks)]

    def _launch(self, module: CudaModule, call: LaunchCall) -> None:
        if call.library is not None:
            self.blas().gemm(call.library, *call.pointers)
            return
        symbols = (ctypes.c_int64 * len(call.symbols))(*call.symbols.tolist())
        pointers = [ctypes.c_uint64(p) for p in call.pointers]
        # kernelParams: a pointer to each argument's value (the launch copies them)
        values = [symbols, *pointers]
        params = (ctypes.c_void_p * len(values))(*(ctypes.addressof(v) for v in values))
        _ok(
            self.cu.cuLaunchKernel(
                module.functions[call.function], *call.grid, call.threads, 1, 1, 0, self.stream,
                ctypes.addressof(params), 0,  # (extra is a void pointer: 0, not None)
            ),
            f"launching {call.function}",
        )

    def _capture(self, module: CudaModule, calls: list[LaunchCall]) -> Any:
        cu = self.cu
        mode = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        _ok(cu.cuStreamBeginCapture(self.stream, mode), "cuStreamBeginCapture")
        try:
            for call in calls:
                self._launch(module, call)
        finally:
            graph = _ok(cu.cuStreamEndCapture(self.stream), "cuStreamEndCapture")
        try:
            return _ok(cu.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
        finally:
            _ok(cu.cuGraphDestroy(graph), "cuGraphDestroy")  # the executable graph is a copy


__all__ = ["CudaDriver", "CudaModule", "CudaUnavailable"]
