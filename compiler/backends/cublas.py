"""Products as cuBLAS calls: a launch plan's library launches (compiler.render.cuda renders a
product as one where the schedule asks for the library) run `cublasGemmStridedBatchedEx_64` on
the driver's stream, inside the program's CUDA graph like its kernels. cuBLAS is column-major,
so a row-major C = A @ B is asked for as C^T = B^T A^T: the arguments below are cuBLAS's own
(first operand B, second A), and `emulated_gemm` computes exactly what cuBLAS would from them,
so the CPU emulation checks the argument mapping that a GPU runs.

libcublas comes from the `nvidia-cublas` wheel (the GPU machines' images have it; CI does not
need it) and is loaded through cuda-pathfinder, as cuda-bindings loads NVRTC.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from compiler.dtypes import numpy_dtype
from compiler.errors import CompilerError

# cudaDataType_t and cublasComputeType_t values (library_types.h, cublas_api.h)
DATA_TYPES = {"float32": 0, "float16": 2, "bfloat16": 14}
COMPUTE_TYPES = {"float32": 68, "tf32": 77}  # CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_FAST_TF32
OP_N, OP_T = 0, 1
GEMM_DEFAULT_ALGO = -1
# cuBLAS's scratch for split-k and the like, set once per handle: a call captured into a CUDA
# graph must not allocate
WORKSPACE_BYTES = 32 * 1024 * 1024
# where no wheel provides it: a CUDA toolkit's, by its soname
SYSTEM_LIBRARY = "libcublas.so.13"


class CublasUnavailable(CompilerError):
    """cuBLAS cannot be loaded or a call failed, named."""


@dataclass(frozen=True)
class GemmArguments:
    """One cublasGemmStridedBatchedEx_64 call at a call's sizes, in cuBLAS's column-major terms:
    C (m x n, ldc) = op(A) (m x k) @ op(B) (k x n) for each of `batch`, alpha 1, beta 0."""

    transa: int
    transb: int
    m: int
    n: int
    k: int
    lda: int
    ldb: int
    ldc: int
    stride_a: int
    stride_b: int
    stride_c: int
    batch: int
    a_type: str
    b_type: str
    c_type: str
    compute: str


def emulated_gemm(args: GemmArguments, a: int, b: int, c: int) -> None:
    """What cuBLAS computes from `args` on host memory at addresses a, b, c (the emulated
    device's), with float32 sums; tf32 operands are not rounded (its tolerance covers that)."""

    def operand(address: int, dtype: str, rows: int, cols: int, ld: int, stride: int, transposed: bool) -> np.ndarray:
        item = numpy_dtype(dtype).itemsize
        # op(X)[r, s] = X[r + s * ld] untransposed, X[s + r * ld] transposed (column-major X)
        strides = (stride * item, *((ld * item, item) if transposed else (item, ld * item)))
        span = 1 + (args.batch - 1) * stride + ((cols - 1) * ld + rows if not transposed else (rows - 1) * ld + cols)
        memory = np.ctypeslib.as_array((ctypes.c_uint8 * (span * item)).from_address(address)).view(numpy_dtype(dtype))
        return np.lib.stride_tricks.as_strided(memory, (args.batch, rows, cols), strides)

    if min(args.m, args.n, args.batch) <= 0:
        return
    out = operand(c, args.c_type, args.m, args.n, args.ldc, args.stride_c, False)
    if args.k <= 0:
        out[...] = 0
        return
    first = operand(a, args.a_type, args.m, args.k, args.lda, args.stride_a, args.transa == OP_T).astype(np.float32)
    second = operand(b, args.b_type, args.k, args.n, args.ldb, args.stride_b, args.transb == OP_T).astype(np.float32)
    out[...] = np.matmul(first, second).astype(out.dtype)


class Cublas:
    """A cuBLAS handle bound to one stream, with its workspace (device memory from `alloc`)."""

    def __init__(self, stream: int, alloc, free) -> None:
        self.library = _library()
        handle = ctypes.c_void_p()
        self._check(self.library.cublasCreate_v2(ctypes.byref(handle)), "cublasCreate")
        self.handle = handle
        self._free = free
        self.workspace = alloc(WORKSPACE_BYTES)
        self._check(self.library.cublasSetStream_v2(handle, ctypes.c_void_p(stream)), "cublasSetStream")
        self._check(
            self.library.cublasSetWorkspace_v2(handle, ctypes.c_void_p(self.workspace), ctypes.c_size_t(WORKSPACE_BYTES)),
            "cublasSetWorkspace",
        )
        self._one, self._zero = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def gemm(self, args: GemmArguments, a: int, b: int, c: int) -> None:
        i64 = ctypes.c_int64
        self._check(
            self.library.cublasGemmStridedBatchedEx_64(
                self.handle, ctypes.c_int(args.transa), ctypes.c_int(args.transb), i64(args.m), i64(args.n), i64(args.k),
                ctypes.byref(self._one),
                ctypes.c_void_p(a), ctypes.c_int(DATA_TYPES[args.a_type]), i64(args.lda), ctypes.c_longlong(args.stride_a),
                ctypes.c_void_p(b), ctypes.c_int(DATA_TYPES[args.b_type]), i64(args.ldb), ctypes.c_longlong(args.stride_b),
                ctypes.byref(self._zero),
                ctypes.c_void_p(c), ctypes.c_int(DATA_TYPES[args.c_type]), i64(args.ldc), ctypes.c_longlong(args.stride_c),
                i64(args.batch), ctypes.c_int(COMPUTE_TYPES[args.compute]), ctypes.c_int(GEMM_DEFAULT_ALGO),
            ),
            f"cublasGemmStridedBatchedEx ({args.m}x{args.n}x{args.k}, batch {args.batch})",
        )

    def close(self) -> None:
        self.library.cublasDestroy_v2(self.handle)
        self._free(self.workspace)

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise CublasUnavailable(f"{what} failed: cuBLAS status {status}")


_LOADED: list[ctypes.CDLL] = []


def _library() -> ctypes.CDLL:
    """libcublas, loaded once; CublasUnavailable naming why not."""
    if not _LOADED:
        try:
            from cuda.pathfinder import load_nvidia_dynamic_lib

            library = ctypes.CDLL(load_nvidia_dynamic_lib("cublas").abs_path)
        except Exception as exc:  # noqa: BLE001 - not found, or not loadable: then the system's, if any
            try:
                library = ctypes.CDLL(SYSTEM_LIBRARY)
            except OSError:
                raise CublasUnavailable(f"cuBLAS cannot be loaded ({type(exc).__name__}: {exc}); install nvidia-cublas") from None
        library.cublasCreate_v2.restype = ctypes.c_int
        library.cublasGemmStridedBatchedEx_64.restype = ctypes.c_int
        _LOADED.append(library)
    return _LOADED[0]


__all__ = ["COMPUTE_TYPES", "DATA_TYPES", "Cublas", "CublasUnavailable", "GemmArguments", "emulated_gemm"]
