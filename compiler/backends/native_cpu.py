"""The native CPU backend: C from the renderer, built by the system C compiler, run through ctypes.

The trio every backend has: `build` (source to a shared object, for this CPU), `NativeProgram`
(loads it and allocates: outputs per call, temps in one arena that grows to the largest request
seen and is reused), and `NativeProgram.run` (one call into `lc_run` per batch; ctypes releases
the interpreter lock while it runs). A shared object is only valid on the CPU type it was built
for (`-march=native`): `cpu_fingerprint` names that type, and a program loaded elsewhere is
rebuilt from its source.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import weakref
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from compiler.backends.layout import ArenaPlan, bind_inputs, describe
from compiler.dtypes import numpy_dtype
from compiler.errors import CompilerError
from compiler.kernels.ir import Buffer
from compiler.shape import shape_from_json

ALIGNMENT = 64
# -fno-trapping-math: no program reads FP exception flags, and without it GCC keeps the branches
# of a NaN-propagating max (clamps, ReLU) and vectorizes none of the loop
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fwrapv", "-fno-math-errno", "-fno-trapping-math")


class NativeBuildFailed(CompilerError):
    """The C compiler rejected generated code (a renderer bug) or is missing."""


@cache
def cpu_fingerprint() -> str:
    """The CPU model and feature flags: code built with -march=native runs where these match."""
    model, flags = platform.processor(), ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not model:
                model = value.strip()
            if key.strip() == "flags":
                flags = value.strip()
                break
    except OSError:
        pass
    digest = hashlib.sha256(" ".join(sorted(flags.split())).encode()).hexdigest()[:16]
    return f"{platform.machine()}:{model}:{digest}"


@cache
def _openblas() -> tuple[str, str]:
    import scipy_openblas32

    return scipy_openblas32.get_lib_dir(), scipy_openblas32.get_library()


def compiler_command() -> str:
    found = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not found:
        raise NativeBuildFailed("no C compiler found (install gcc, or set CC)")
    return found


_LIBRARY_DIR = Path(tempfile.gettempdir()) / f"luminal-native-{os.getuid()}"


def build(source: str) -> bytes:
    """The shared object for `source`, built for this CPU; a source built before on this machine
    (a re-upload, a recompile after a restart) is read back instead of compiled again."""
    command_key = " ".join((compiler_command(), *CFLAGS, cpu_fingerprint()))
    cached = _LIBRARY_DIR / f"build-{hashlib.sha256((command_key + source).encode()).hexdigest()}.so"
    if cached.exists():
        return cached.read_bytes()
    library = _compile(source)
    _write_atomically(cached, library)
    return library


def _compile(source: str) -> bytes:
    lib_dir, lib_name = _openblas()
    with tempfile.TemporaryDirectory(prefix="luminal-build-") as tmp:
        src, out = Path(tmp) / "program.c", Path(tmp) / "program.so"
        src.write_text(source)
        command = [
            compiler_command(), *CFLAGS, str(src), "-o", str(out),
            f"-L{lib_dir}", f"-l{lib_name}", f"-Wl,-rpath,{lib_dir}", "-lm",
        ]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise NativeBuildFailed(f"the C compiler failed: {done.stderr.strip()[-2000:]}")
        return out.read_bytes()


@cache
def _wake_min_work() -> int:
    """The work a loop needs to wake a busy program's sleeping threads (the renderer's constant):
    the renderer is imported on a program's first busy run, not by a runtime at its start."""
    from compiler.render.c import WAKE_MIN_WORK

    return WAKE_MIN_WORK


@cache
def _single_threaded_blas() -> None:
    """The generated code splits each GEMM across its own threads; OpenBLAS's own threads on top
    would double the threads on every core."""
    lib_dir, lib_name = _openblas()
    library = ctypes.CDLL(str(Path(lib_dir) / f"lib{lib_name}.so"))
    library.scipy_openblas_set_num_threads(1)


def _load_library(data: bytes) -> ctypes.CDLL:
    """dlopen needs a file: each distinct library is written once, by content hash."""
    _single_threaded_blas()
    path = _LIBRARY_DIR / f"{hashlib.sha256(data).hexdigest()}.so"
    if not path.exists() or path.stat().st_size != len(data):
        _write_atomically(path, data)
    return ctypes.CDLL(str(path))


def _write_atomically(path: Path, data: bytes) -> None:
    path.parent.mkdir(mode=0o700, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
    partial.write_bytes(data)
    os.replace(partial, path)


# input shapes whose buffer layout a loaded program remembers (batch sizes times sequence lengths)
_LAYOUT_CACHE_SIZE = 256


def _aligned(array: np.ndarray) -> np.ndarray:
    """The array at an ALIGNMENT-byte boundary (copied there if it is not): weights read from an
    artifact can start anywhere, and a 64-byte vector load across two cache lines costs two
    (a batch-64 MLP: 0.64 ms aligned, 0.69-0.72 with its weights 16 or 48 bytes off)."""
    if array.ctypes.data % ALIGNMENT == 0:
        return array
    raw = np.empty(array.nbytes + ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % ALIGNMENT
    copy = raw[start : start + array.nbytes].view(array.dtype).reshape(array.shape)
    copy[...] = array
    return copy


def _own(array: np.ndarray) -> np.ndarray:
    """The array in memory of its own: a read-only view (an artifact's weights are views of its
    whole weights file, compiler/artifact.py) is copied, so that a loaded program keeps only the
    weights its code reads, not the file they were read from."""
    if array.flags.writeable or array.base is None:
        return array
    copy = _aligned(np.empty_like(array))
    copy[...] = array
    return copy


# the weights the programs loaded in this process hold, by name, dtype and shape: a weight's name
# is a hash of its content (compiler.ir.GraphBuilder.constant) or of how it is derived from named
# weights (folded, quantized, packed), so two programs of one model (a decoder's prompt and step
# programs) hold one copy; "folded:..." names (a lowering's operands) are not, and are never shared
_SHARED_WEIGHTS: weakref.WeakValueDictionary[tuple, np.ndarray] = weakref.WeakValueDictionary()
_SHARED_LOCK = threading.Lock()


def _shared_weight(name: str, array: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """The weight as a program holds it (aligned, in memory of its own), the copy another loaded
    program holds where there is one."""
    if name.startswith("folded"):
        return _own(_aligned(np.ascontiguousarray(array, dtype=dtype)))
    key = (name, np.dtype(dtype).str, tuple(np.shape(array)))
    with _SHARED_LOCK:
        held = _SHARED_WEIGHTS.get(key)
        if held is None:
            held = _own(_aligned(np.ascontiguousarray(array, dtype=dtype)))
            _SHARED_WEIGHTS[key] = held
        return held


class NativeProgram:
    """A built program bound to its weights; `run` is thread-safe (one call at a time)."""

    def __init__(self, layout: Mapping[str, Any], weights: Mapping[str, np.ndarray], library: bytes) -> None:
        self.buffers = [
            Buffer(i, b["dtype"], shape_from_json(b["shape"]), b["role"], b["name"])
            for i, b in enumerate(layout["buffers"])
        ]
        self.slots = {int(k): v for k, v in layout["slots"].items()}
        self.symbols = list(layout["symbols"])
        self.size_limits = dict(layout.get("size_limits", {}))
        self._library = _load_library(library)
        self._library_bytes = len(library)
        self._entry = self._library.lc_run
        self._entry.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self._entry.restype = ctypes.c_int
        # a library built before lc_set_wake_work (an older compiler's artifact) always wakes workers
        self._set_wake_work = getattr(self._library, "lc_set_wake_work", None)
        if self._set_wake_work is not None:
            self._set_wake_work.argtypes = [ctypes.c_int64]
            self._set_wake_work.restype = None
        self._busy = False
        self._pointers = (ctypes.c_void_p * max(1, len(self.buffers)))()
        self._weights: list[np.ndarray] = []
        for b in self.buffers:
            if b.role == "weight":
                array = _shared_weight(b.name, weights[b.name], numpy_dtype(b.dtype))
                self._weights.append(array)
                self._pointers[b.id] = array.ctypes.data
        self._inputs = [b for b in self.buffers if b.role == "input"]
        self._outputs = [b for b in self.buffers if b.role == "output"]
        # a temp with no slot is never written (a product's C whose epilogue writes elsewhere)
        self._temps = [b for b in self.buffers if b.role == "temp" and b.id in self.slots]
        self._arena_plan = ArenaPlan(self._outputs, self._temps, self.slots, ALIGNMENT)
        self._arena = np.empty(0, np.uint8)
        self._arena_base = 0
        self._lock = threading.Lock()
        self._layouts: dict[tuple, tuple] = {}
        # the layout whose temps' pointers are set now (a run at the same shapes sets none)
        self._temps_bound: tuple | None = None

    def resident_bytes(self) -> int:
        """Memory held for the program's lifetime: the weights its code reads and the library (the
        arena is per call's size, like the outputs, and not counted)."""
        return sum(w.nbytes for w in self._weights) + self._library_bytes

    def kernel_seconds(self, kernels: int):
        """The library's per-kernel seconds (lc_kernel_seconds, a ctypes array of `kernels`
        doubles) where it was rendered with `profile`; ValueError otherwise."""
        try:
            return (ctypes.c_double * max(1, kernels)).in_dll(self._library, "lc_kernel_seconds")
        except ValueError:
            raise ValueError("this program was not built to time its kernels (render(profile=True))") from None

    def run(self, inputs: Mapping[str, np.ndarray], busy: bool = False) -> dict[str, np.ndarray]:
        """The outputs; `busy` says other requests are waiting, so only large loops wake the
        program's sleeping threads (their spinning would take the CPU the server needs)."""
        arrays = [np.ascontiguousarray(inputs[b.name], dtype=numpy_dtype(b.dtype)) for b in self._inputs]
        shapes = tuple(a.shape for a in arrays)
        layout = self._layouts.get(shapes)
        if layout is None:
            layout = self._layout(inputs)
        dims, output_shapes, offsets, total = layout
        outputs = {b.name: np.empty(shape, numpy_dtype(b.dtype)) for b, shape in zip(self._outputs, output_shapes)}
        with self._lock:
            if shapes not in self._layouts:
                if len(self._layouts) >= _LAYOUT_CACHE_SIZE:
                    self._layouts.pop(next(iter(self._layouts)))
                self._layouts[shapes] = layout
            if self._arena.nbytes < total + ALIGNMENT:
                self._arena = np.empty(total + ALIGNMENT, np.uint8)  # grows to the largest request
                base = self._arena.ctypes.data
                self._arena_base = base + -base % ALIGNMENT
                self._temps_bound = None
            pointers = self._pointers
            if self._temps_bound is not layout:  # reading an array's address costs 1.6 us
                for b, offset in zip(self._temps, offsets):
                    pointers[b.id] = self._arena_base + offset
                self._temps_bound = layout
            if busy != self._busy and self._set_wake_work is not None:
                self._set_wake_work(_wake_min_work() if busy else 0)
                self._busy = busy
            for b, array in zip(self._inputs, arrays):
                pointers[b.id] = array.ctypes.data
            for b in self._outputs:
                pointers[b.id] = outputs[b.name].ctypes.data
            status = self._entry(dims, pointers)
        if status == 2:
            raise MemoryError("the program could not allocate its scratch memory")
        if status:
            raise IndexError("an index is out of bounds for the axis it selects from")
        return outputs

    def _layout(self, inputs: Mapping[str, np.ndarray]) -> tuple:
        """What a call at these input shapes needs besides the data: the symbols' values, the
        outputs' shapes, each temp's offset in the arena and the arena's size (cached per shapes:
        evaluating every buffer's symbolic size costs more than a small model's run)."""
        bindings = bind_inputs(self._inputs, inputs, self.size_limits)
        output_shapes, offsets, total = self._arena_plan(bindings)
        dims = (ctypes.c_int64 * max(1, len(self.symbols)))(*(bindings[s] for s in self.symbols))
        return dims, output_shapes, offsets, total


def load(kernel: Mapping[str, Any], weights: Mapping[str, np.ndarray], library: bytes | None) -> NativeProgram:
    """A program from an artifact; rebuilt from its source when built for another CPU type."""
    if library is None or kernel.get("fingerprint") != cpu_fingerprint():
        library = build(kernel["source"])
    return NativeProgram(kernel["layout"], weights, library)


__all__ = ["NativeBuildFailed", "NativeProgram", "build", "cpu_fingerprint", "describe", "load"]
