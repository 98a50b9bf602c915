"""Renders a kernel-IR program as CUDA C: one `__global__` function per kernel and a launch plan.

A kernel's parameters are the program's symbols by value (`S.v[i]` in `Program.symbols` order),
then a pointer per buffer it reads or writes:

    extern "C" __global__ void k<n>(const lc_symbols S, const float *__restrict__ b0, float *__restrict__ b1)

The launch plan says, per kernel, which function runs it with which buffers (a model's repeated
layers share one function), its grid as symbolic dims and its threads per block; a runtime
evaluates the grid at the call's sizes and skips a launch whose grid is empty. Kernels loop over their work with a stride of the whole grid, so a runtime may launch
fewer blocks along x than planned (a grid is capped at MAX_GRID_X) and still compute every element.

  - an elementwise loop: one thread per output element (its lets as locals);
  - a reduction: a warp per output element where the reduced extent is known and small (eight
    outputs a block), combined with warp shuffles; else a block per output element, its threads
    striding over the reduced elements, combined with warp shuffles, then across warps in shared
    memory;
  - a matrix product: tiles of C per block, A and B staged through shared memory, the fused
    epilogue applied as each element is stored; a convolution's windows (Panels) are read in
    place while B's tile is loaded (an implicit GEMM), never stored;
  - attention (AttentionCall, where the schedule fuses it): a block per batch index and tile of
    query rows, keys a tile at a time with a running max and sum (online softmax), the scores
    never stored; on tensor cores for 16-bit formats.

The expressions (loads, padding guards, gathers, arithmetic) are the C renderer's: CUDA C is C
there, and the device functions they call (lc_index, lc_exp2f...) are defined here. The code needs
no header (NVRTC has none), so fixed-width types and limits are defined in the prelude.
"""

from __future__ import annotations

import itertools
import re
import weakref
from dataclasses import dataclass, replace

from compiler.kernels.attention import fuse_attention
from compiler.kernels.ir import AttentionCall, GemmCall, Kernel, Load, LoopKernel, Program
from compiler.kernels.ir_walk import kernel_reads, kernel_stores, lets_reads
from compiler.kernels.schedule import KernelSchedule
from compiler.render.c import _MAX_INIT, C_TYPES, CRenderer, dim
from compiler.shape import Dim, dim_ceildiv, dim_to_json, numel

# threads of an elementwise kernel's block
ELEMENTWISE_THREADS = 256
# a reduction over at most WARP_ROWS_MAX elements (a known extent: a norm's or a small softmax's
# row) takes a warp per output, WARP_ROWS outputs a block: shuffles alone, no shared memory or
# block barrier; a longer or symbolic one a block of REDUCE_THREADS per output
WARP_ROWS_MAX = 1024
WARP_ROWS = 8
REDUCE_THREADS = 256
# a product's tile of C per block (GEMM_TILE x GEMM_TILE), the k step staged in shared memory, and
# its threads (each computes (GEMM_TILE / 16)^2 elements of the tile)
GEMM_TILE = 64
GEMM_K_STEP = 16
GEMM_THREADS = 256
# a product on tensor cores: a MMA_TILE square of C per block of MMA_THREADS (four warps, each a
# 32x32 quarter), the k step staged in shared memory, and the padding of the staged rows (keeps
# every 16x16 fragment 32-byte aligned, as wmma loads need, and spreads rows over banks)
MMA_TILE = 64
MMA_K_STEP = 32
MMA_THREADS = 128
MMA_PAD_BYTES = 16
MMA_C_PAD = 4
# the large tensor-core product's k step, in bytes of a staged row (its two buffers of each tile
# stay within the 48 KB of static shared memory)
MMA_STEP_BYTES = 64
# the large product: a LARGE_TILE square of C per block of LARGE_THREADS, LARGE_PER^2 elements a
# thread, a k step of LARGE_K_STEP, the next step's tiles loaded into registers while this one's
# are multiplied (two shared buffers, one barrier a step)
LARGE_TILE = 128
LARGE_PER = 8
LARGE_K_STEP = 8
LARGE_THREADS = 256
# fused attention: a block of ATTENTION_WARPS warps takes 8 query rows a warp (4 where a head is
# wider than 64: its tiles stay in static shared memory), keys ATTENTION_KEYS at a time (a lane
# each); heads of at most ATTENTION_HEAD_MAX are fused
ATTENTION_WARPS = 4
ATTENTION_KEYS = 32
ATTENTION_HEAD_MAX = 128
# on tensor cores (16-bit formats): ATTENTION_MMA_ROWS query rows a block, keys
# ATTENTION_MMA_KEYS at a time, heads of at most ATTENTION_MMA_HEAD_MAX (what fits the 48 KB of
# static shared memory); wider heads take the CUDA-core kernel
ATTENTION_MMA_ROWS = 32
ATTENTION_MMA_KEYS = 64
ATTENTION_MMA_HEAD_MAX = 64
# the most blocks a runtime launches along x (kernels stride over the rest)
MAX_GRID_X = 1 << 20
# a schedule's "tile" for a product that runs as a cuBLAS call (compiler.backends.cublas) where
# it can (plain strided operands of one type), its epilogue then a kernel of its own
LIBRARY_TILE = 0
# a narrow float's storage type and the suffix of its conversions in the prelude
NARROW_TYPES = {"float16": ("lc_half", "f16"), "bfloat16": ("lc_bf16", "bf16")}


@dataclass(frozen=True)
class MmaFormat:
    """A tensor-core input format: the type its operands are staged in, its k per warp product,
    its bytes an element, and the suffix of its prelude functions (lc_to_<suffix>, lc_mma_<suffix>...)."""

    staged: str
    k: int
    itemsize: int
    suffix: str


MMA_FORMATS = {
    "float16": MmaFormat("lc_half", 16, 2, "f16"),
    "bfloat16": MmaFormat("lc_bf16", 16, 2, "bf16"),
    # float32 operands rounded to 10 mantissa bits (nearest, ties away), as cuBLAS's TF32 mode does
    "tf32": MmaFormat("float", 8, 4, "tf32"),
}

PRELUDE = r"""typedef signed char int8_t;
typedef short int16_t;
typedef int int32_t;
typedef long long int64_t;
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
#define INT8_MIN (-128)
#define INT16_MIN (-32768)
#define INT32_MIN (-2147483647 - 1)
#define INT64_MIN (-9223372036854775807LL - 1)
#define INFINITY __int_as_float(0x7f800000)
#define NAN __int_as_float(0x7fffffff)

/* max that propagates NaN from either side, as NumPy's maximum does */
template <typename T> __device__ __forceinline__ T lc_max(T a, T b) { return ((a > b) | (a != a)) ? a : b; }
#define LC_MAX(a, b) lc_max(a, b)
__device__ __forceinline__ int64_t lc_fdiv(int64_t a, int64_t b) {
    const int64_t q = a / b;
    return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}
__device__ __forceinline__ int64_t lc_fmod(int64_t a, int64_t b) {
    const int64_t r = a % b;
    return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}
__device__ __forceinline__ int64_t lc_imod(int64_t a, int64_t b) { return b == 0 ? 0 : a % b; }
/* set when a gathered index was out of range; the runtime reads it after the run */
__device__ int lc_bad_index;
/* a gathered index: negative counts from the end; out of range reads element 0 and is reported */
__device__ __forceinline__ int64_t lc_index(int64_t v, int64_t n) {
    if (v < 0) v += n;
    if (v < 0 || v >= n) { lc_bad_index = 1; return 0; }
    return v;
}
__device__ __forceinline__ float lc_exp2f(float x) { return exp2f(x); }
"""

# Narrow floats are 16-bit storage: read into float, computed in float, rounded to nearest even as
# they are stored; tensor-core products (wmma 16x16x16, or 16x16x8 for tf32; float32 accumulators)
# take their operands from shared memory. The fragments are opaque registers, so the code never depends on their layout.
# (The CPU emulation, compiler.backends.cuda_emulator, defines these names itself.)
NARROW_PRELUDE = r"""typedef unsigned short lc_half;
typedef unsigned short lc_bf16;
#ifdef __CUDACC__
__device__ __forceinline__ float lc_from_f16(lc_half h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }
__device__ __forceinline__ lc_half lc_to_f16(float f) { lc_half h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }
__device__ __forceinline__ float lc_from_bf16(lc_bf16 h) { return __uint_as_float(((unsigned)h) << 16); }
__device__ __forceinline__ lc_bf16 lc_to_bf16(float f) { lc_bf16 h; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }
struct lc_frag_ab { unsigned r[8]; };
struct lc_frag_c { float r[8]; };
__device__ __forceinline__ void lc_mma_zero(lc_frag_c &d) { for (int i = 0; i < 8; ++i) d.r[i] = 0.0f; }
#define LC_AB8(f) "=r"(f.r[0]), "=r"(f.r[1]), "=r"(f.r[2]), "=r"(f.r[3]), "=r"(f.r[4]), "=r"(f.r[5]), "=r"(f.r[6]), "=r"(f.r[7])
#define LC_AB4(f) "=r"(f.r[0]), "=r"(f.r[1]), "=r"(f.r[2]), "=r"(f.r[3])
#define LC_IN8(f) "r"(f.r[0]), "r"(f.r[1]), "r"(f.r[2]), "r"(f.r[3]), "r"(f.r[4]), "r"(f.r[5]), "r"(f.r[6]), "r"(f.r[7])
#define LC_IN4(f) "r"(f.r[0]), "r"(f.r[1]), "r"(f.r[2]), "r"(f.r[3])
#define LC_C8(f) "+f"(f.r[0]), "+f"(f.r[1]), "+f"(f.r[2]), "+f"(f.r[3]), "+f"(f.r[4]), "+f"(f.r[5]), "+f"(f.r[6]), "+f"(f.r[7])
#define LC_SHARED(p) ((unsigned)__cvta_generic_to_shared(p))
__device__ __forceinline__ void lc_mma_load_a_f16(lc_frag_ab &a, const lc_half *p, int ldm) {
    asm volatile("wmma.load.a.sync.aligned.row.m16n16k16.shared.f16 {%0,%1,%2,%3,%4,%5,%6,%7}, [%8], %9;" : LC_AB8(a) : "r"(LC_SHARED(p)), "r"(ldm));
}
__device__ __forceinline__ void lc_mma_load_b_f16(lc_frag_ab &b, const lc_half *p, int ldm) {
    asm volatile("wmma.load.b.sync.aligned.row.m16n16k16.shared.f16 {%0,%1,%2,%3,%4,%5,%6,%7}, [%8], %9;" : LC_AB8(b) : "r"(LC_SHARED(p)), "r"(ldm));
}
__device__ __forceinline__ void lc_mma_f16(lc_frag_c &d, const lc_frag_ab &a, const lc_frag_ab &b) {
    asm volatile("wmma.mma.sync.aligned.row.row.m16n16k16.f32.f32 {%0,%1,%2,%3,%4,%5,%6,%7}, "
                 "{%8,%9,%10,%11,%12,%13,%14,%15}, {%16,%17,%18,%19,%20,%21,%22,%23}, {%0,%1,%2,%3,%4,%5,%6,%7};"
                 : LC_C8(d) : LC_IN8(a), LC_IN8(b));
}
__device__ __forceinline__ void lc_mma_load_a_bf16(lc_frag_ab &a, const lc_bf16 *p, int ldm) {
    asm volatile("wmma.load.a.sync.aligned.row.m16n16k16.shared.bf16 {%0,%1,%2,%3}, [%4], %5;" : LC_AB4(a) : "r"(LC_SHARED(p)), "r"(ldm));
}
__device__ __forceinline__ void lc_mma_load_b_bf16(lc_frag_ab &b, const lc_bf16 *p, int ldm) {
    asm volatile("wmma.load.b.sync.aligned.row.m16n16k16.shared.bf16 {%0,%1,%2,%3}, [%4], %5;" : LC_AB4(b) : "r"(LC_SHARED(p)), "r"(ldm));
}
__device__ __forceinline__ void lc_mma_bf16(lc_frag_c &d, const lc_frag_ab &a, const lc_frag_ab &b) {
    asm volatile("wmma.mma.sync.aligned.row.row.m16n16k16.f32.bf16.bf16.f32 {%0,%1,%2,%3,%4,%5,%6,%7}, "
                 "{%8,%9,%10,%11}, {%12,%13,%14,%15}, {%0,%1,%2,%3,%4,%5,%6,%7};"
                 : LC_C8(d) : LC_IN4(a), LC_IN4(b));
}
__device__ __forceinline__ float lc_to_tf32(float f) { unsigned u; asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(u) : "f"(f)); return __uint_as_float(u); }
__device__ __forceinline__ void lc_mma_load_a_tf32(lc_frag_ab &a, const float *p, int ldm) {
    asm volatile("wmma.load.a.sync.aligned.row.m16n16k8.shared.tf32 {%0,%1,%2,%3}, [%4], %5;" : LC_AB4(a) : "r"(LC_SHARED(p)), "r"(ldm));
}
__device__ __forceinline__ void lc_mma_load_b_tf32(lc_frag_ab &b, const float *p, int ldm) {
    asm volatile("wmma.load.b.sync.aligned.row.m16n16k8.shared.tf32 {%0,%1,%2,%3}, [%4], %5;" : LC_AB4(b) : "r"(LC_SHARED(p)), "r"(ldm));
}
__device__ __forceinline__ void lc_mma_tf32(lc_frag_c &d, const lc_frag_ab &a, const lc_frag_ab &b) {
    asm volatile("wmma.mma.sync.aligned.row.row.m16n16k8.f32.tf32.tf32.f32 {%0,%1,%2,%3,%4,%5,%6,%7}, "
                 "{%8,%9,%10,%11}, {%12,%13,%14,%15}, {%0,%1,%2,%3,%4,%5,%6,%7};"
                 : LC_C8(d) : LC_IN4(a), LC_IN4(b));
}
__device__ __forceinline__ void lc_mma_store(float *p, const lc_frag_c &d, int ldm) {
    asm volatile("wmma.store.d.sync.aligned.row.m16n16k16.shared.f32 [%0], {%1,%2,%3,%4,%5,%6,%7,%8}, %9;"
                 :: "r"(LC_SHARED(p)), "f"(d.r[0]), "f"(d.r[1]), "f"(d.r[2]), "f"(d.r[3]), "f"(d.r[4]), "f"(d.r[5]),
                    "f"(d.r[6]), "f"(d.r[7]), "r"(ldm) : "memory");
}
#endif
"""


def _normalized(call: AttentionCall, acc: str, inverse: str, row_sum: str) -> str:
    """An output element: the accumulator times the row's inverse sum; a row with no finite score
    (sum 0, or NaN) zeros where the attention asks for it (AttentionCall.empty_rows_zero)."""
    value = f"{acc} * {inverse}"
    return f"({row_sum} > 0.0f ? {value} : 0.0f)" if call.empty_rows_zero else value


def _shifted_exp2(scale: str, x: str, top: str) -> str:
    """exp2(scale * (x - top)) as the unfused exponentials compute it (x + -1 * top), in CUDA C."""
    return f"lc_exp2f({scale} * ({x} + -1.0f * {top}))"


def _halvings(count: int) -> list[int]:
    """The xor distances of a butterfly over `count` lanes (a power of two): count/2, ..., 1."""
    return [1 << e for e in range(count.bit_length() - 2, -1, -1)]


def _symbols_struct(count: int) -> str:
    return f"typedef struct {{ int64_t v[{max(1, count)}]; }} lc_symbols;\n"


@dataclass(frozen=True)
class Launch:
    """How one kernel is launched: its function, the buffers it takes (its parameters after the
    symbols, in order), its blocks along x, y and z at the call's sizes, and threads per block.
    A library launch (`library`: a cuBLAS product's arguments, compiler.backends.cublas) names no
    function of the source; its buffers are cuBLAS's A, B and C (the product's B, A and C: cuBLAS
    computes C^T = B^T A^T, column-major). `kernel_number` is the
    program's kernel the launch computes (a product on cuBLAS with an epilogue takes two)."""

    kernel: str
    buffers: tuple[int, ...]
    grid: tuple[Dim, Dim, Dim]
    threads: int
    kernel_number: int = -1
    library: dict[str, object] | None = None

    def to_json(self) -> dict[str, object]:
        record: dict[str, object] = {
            "kernel": self.kernel,
            "buffers": list(self.buffers),
            "grid": [dim_to_json(d) for d in self.grid],
            "threads": self.threads,
        }
        if self.library is not None:
            record["library"] = self.library
        return record


@dataclass(frozen=True)
class CudaSchedule:
    """How a program's kernels run on the GPU: each kernel's `KernelSchedule` as the search
    extracted it (compiler.search.schedule; by the kernel's number in the program as scheduled),
    and whether attention runs as one kernel. A kernel the choices do not name runs as
    `product_tile` says (products) or in the first alternative the search would try (other
    kernels): what a program rendered without a search (a test, a uniform round) gets."""

    name: str
    product_tile: int = GEMM_TILE
    # attention as one kernel (compiler.kernels.attention), or as the kernels lowering spells
    fused_attention: bool = True
    # (kernel number, its schedule), as the search chose
    choices: tuple[tuple[int, KernelSchedule], ...] = ()

    def of(self, kernel: int) -> KernelSchedule | None:
        return dict(self.choices).get(kernel)

    def tile_of(self, kernel: int) -> int:
        chosen = self.of(kernel)
        if chosen is None or chosen.kind not in ("tiled", "tensor-core-tiled", "library"):
            return self.product_tile
        return LIBRARY_TILE if chosen.kind == "library" else chosen.size

    def threads_of(self, kernel: int) -> int:
        """Threads per block of an elementwise loop."""
        chosen = self.of(kernel)
        return chosen.size if chosen is not None and chosen.kind == "threads" else ELEMENTWISE_THREADS

    def warp_rows(self, kernel: int, reduced: Dim) -> bool:
        """Whether a reduction runs a warp per output (else a block per output)."""
        chosen = self.of(kernel)
        if chosen is not None and chosen.kind in ("warp-rows", "block-rows"):
            return chosen.kind == "warp-rows"
        return isinstance(reduced, int) and reduced <= WARP_ROWS_MAX


# uniform schedules: every product in one tile (a test's or a benchmark's fixed rendering)
SCHEDULES = {
    "cuda-tile64": CudaSchedule("cuda-tile64", GEMM_TILE),
    "cuda-tile128": CudaSchedule("cuda-tile128", LARGE_TILE),
    "cuda-tile64-unfused-attention": CudaSchedule("cuda-tile64-unfused-attention", GEMM_TILE, fused_attention=False),
    "cuda-cublas": CudaSchedule("cuda-cublas", LIBRARY_TILE),
}
DEFAULT_SCHEDULE = SCHEDULES["cuda-tile64"]


def scheduled(program: Program, schedule: CudaSchedule) -> Program:
    """The program as `schedule` renders it: its attention fused where the schedule says (found
    once per program: every candidate of a compile renders the same one)."""
    if not schedule.fused_attention:
        return program
    key = id(program)
    fused = _FUSED.get(key)
    if fused is None or fused[0]() is not program:
        found = fuse_attention(program, ATTENTION_HEAD_MAX)
        # (None where there was nothing to fuse: the entry must not hold the program itself)
        fused = _FUSED[key] = (weakref.ref(program), None if found is program else found)
        weakref.finalize(program, _FUSED.pop, key, None)
    return program if fused[1] is None else fused[1]


# id(program) -> (the program, weakly; its attention fused), while the program lives (the kernel rules
# take about a second on a 6-layer BERT, and a search renders a program several times)
_FUSED: dict[int, tuple[weakref.ref, Program | None]] = {}


@dataclass(frozen=True)
class CudaSource:
    """A program as one CUDA C translation unit and the launches that run it, in order; `program`
    is the program as rendered (its layout: a product on cuBLAS whose B is a convolution's windows
    stores them whole first, in a temp of their own)."""

    source: str
    launches: tuple[Launch, ...]
    program: Program | None = None


def render_cuda(program: Program, schedule: CudaSchedule = DEFAULT_SCHEDULE) -> CudaSource:
    """The program's CUDA C and launch plan (every kernel; none runs on the host) in `schedule`.
    Kernels that differ only in the buffers they read and write (a model's repeated layers) are
    one function, launched once per kernel with its own buffers."""
    program = materialized_panels(program, schedule)
    renderer = CudaRenderer(program, schedule)
    narrow = renderer.tensor_cores or any(b.dtype in NARROW_TYPES for b in program.buffers)
    parts = [PRELUDE, *([NARROW_PRELUDE] if narrow else []), _symbols_struct(len(program.symbols))]
    names: dict[str, str] = {}  # a function's text (named NAME) -> its name
    launches = []

    def function(text: str, number: int, role: str = "") -> str:
        name = names.get(text)
        if name is None:
            name = names[text] = f"k{number}{role}"
            parts.append(text.replace("NAME", name, 1))
        return name

    for number, kernel in enumerate(program.kernels):
        library = library_gemm(program, kernel) if schedule.tile_of(number) == LIBRARY_TILE else None
        if library is not None:
            if kernel.b_panels is not None and program.buffers[kernel.b].role == "temp":
                # its windows stored whole first (im2col), then multiplied as a plain operand
                text, buffers, grid, threads = renderer.cuda_kernel(kernel.b_panels.kernel, number)
                launches.append(Launch(function(text, number, "_windows"), buffers, grid, threads, number))
            launches.append(Launch("cublas", (library_b(program, kernel)[0], kernel.a, kernel.c), library_grid(kernel), 0, number, library))
            if kernel.epilogue is None:
                continue
            text, buffers, grid, threads = renderer.cuda_kernel(kernel, number, epilogue_only=True)
        else:
            text, buffers, grid, threads = renderer.cuda_kernel(kernel, number)
        launches.append(Launch(function(text, number), buffers, grid, threads, number))
    return CudaSource("\n".join(parts), tuple(launches), program)


def library_gemm(program: Program, kernel: Kernel) -> dict[str, object] | None:
    """A product's cublasGemmStridedBatchedEx arguments as dims (compiler.backends.cublas: cuBLAS
    is column-major, so C^T = B^T A^T: its first operand is B), or None where cuBLAS cannot
    compute it: B computed by panels that are not a buffer's rows as they stand (a convolution's
    windows; a 1x1 convolution of stride 1 reads its input as it is), operands of different types
    or of another type than the program multiplies in, batch offsets not one stride."""
    if not isinstance(kernel, GemmCall) or kernel.packed_b or kernel.packed_a or kernel.dtype != "float32":
        return None
    formats = program.tensor_cores if program.tensor_cores in NARROW_TYPES else "float32"
    b_buffer, ldb, b_strides = library_b(program, kernel)
    # windows stored whole are stored in the format the products multiply in
    materialize = kernel.b_panels is not None and b_buffer == kernel.b
    a, b, c = (program.buffers[x].dtype for x in (kernel.a, b_buffer, kernel.c))
    b = formats if materialize else b
    if a != formats or b != formats or c not in ("float32", formats):
        return None
    stride_a, stride_b = _flat_stride(kernel.batch, kernel.a_batch_strides), _flat_stride(kernel.batch, b_strides)
    if stride_a is None or stride_b is None:
        return None
    lda = kernel.lda if kernel.lda is not None else (kernel.m if kernel.trans_a else kernel.k)
    arguments = {
        "op": "gemm",
        "transa": int(kernel.trans_b), "transb": int(kernel.trans_a),
        "m": kernel.n, "n": kernel.m, "k": kernel.k, "lda": ldb, "ldb": lda, "ldc": kernel.n,
        "stride_a": stride_b, "stride_b": stride_a, "stride_c": numel((kernel.m, kernel.n)), "batch": numel(kernel.batch),
    }
    types = {"a_type": b, "b_type": a, "c_type": c, "compute": "tf32" if program.tensor_cores == "tf32" else "float32"}
    return {**{key: value if isinstance(value, str) else dim_to_json(value) for key, value in arguments.items()}, **types}


def library_b(program: Program, call: GemmCall) -> tuple[int, Dim, tuple[Dim, ...]]:
    """The buffer cuBLAS reads B from, its row stride and its offset per batch axis: the call's
    own; or where B is panels whose value is a buffer's element at (batch offset + flat k * ldb
    + flat n), as a 1x1 convolution of stride 1 reads its input, that buffer; else the panels'
    own buffer, stored whole first (materialized_panels), packed as lowering laid it out."""
    if call.b_panels is None or program.buffers[call.b].role == "temp":
        return call.b, (call.ldb if call.ldb is not None else (call.k if call.trans_b else call.n)), call.b_batch_strides
    return _read_in_place(call) or (call.b, call.n, call.b_batch_strides)


def materialized_panels(program: Program, schedule: CudaSchedule) -> Program:
    """The program with the windows of each product that runs on cuBLAS and cannot read them in
    place stored whole: their buffer a temp, in the products' format, in one arena slot of their
    own (each is written just before its product and read by it alone)."""
    formats = program.tensor_cores if program.tensor_cores in NARROW_TYPES else "float32"
    panels = [
        k.b for n, k in enumerate(program.kernels)
        if isinstance(k, GemmCall) and k.b_panels is not None and program.buffers[k.b].role == "panel"
        and schedule.tile_of(n) == LIBRARY_TILE and _read_in_place(k) is None and library_gemm(program, k) is not None
    ]
    if not panels:
        return program
    slot = max(program.slots.values(), default=-1) + 1
    buffers = [replace(b, role="temp", dtype=formats) if b.id in panels else b for b in program.buffers]
    return replace(program, buffers=buffers, slots={**program.slots, **dict.fromkeys(panels, slot)})


def _read_in_place(call: GemmCall) -> tuple[int, Dim, tuple[Dim, ...]] | None:
    """Where a product's panels are a buffer's rows as they stand (a 1x1 convolution of stride 1):
    that buffer, its row stride and offsets per batch axis; else None."""
    panels = call.b_panels
    value = panels.kernel.value
    if panels.kernel.lets or not isinstance(value, Load) or dim_to_json(value.index.const) != 0:
        return None
    shape = panels.kernel.shape
    first = len(panels.batch_axes)
    coefficients = {var: coef for var, coef in value.index.terms}
    if any(not (isinstance(var, str) and var.startswith("o")) for var in coefficients):
        return None
    k_extents, n_extents = shape[first : first + panels.k_axes], shape[first + panels.k_axes :]
    # row-major over the n axes with unit stride, over the k axes with ldb a row
    wanted: dict[str, Dim] = {}
    for j in range(len(n_extents)):
        wanted[f"o{first + panels.k_axes + j}"] = numel(n_extents[j + 1 :])
    ldb = numel(n_extents)
    for j in range(len(k_extents)):
        wanted[f"o{first + j}"] = numel((ldb, *k_extents[j + 1 :]))
    for j, extent in enumerate(shape[first:]):
        name = f"o{first + j}"
        if extent != 1 and dim_to_json(coefficients.get(name, 0)) != dim_to_json(wanted[name]):
            return None
    strides = [0] * len(call.batch)
    for j, axis in enumerate(panels.batch_axes):
        strides[axis] = coefficients.get(f"o{j}", 0)
    if set(coefficients) - {f"o{j}" for j in range(len(shape))}:
        return None
    return value.buffer, ldb, tuple(strides)


def library_grid(call: GemmCall) -> tuple[Dim, Dim, Dim]:
    """A library launch's 'grid': its extents, so a call with nothing to compute is skipped."""
    return (call.n, call.m, numel(call.batch))


def _flat_stride(batch: tuple[Dim, ...], strides: tuple[Dim, ...]) -> Dim | None:
    """S where an operand's offset at batch indices t0.. is S times the flat index t, else None
    (an axis of extent 1 is always at 0: its stride does not matter)."""
    axes = [(extent, stride) for extent, stride in zip(batch, strides) if extent != 1]
    if not axes:
        return 0
    for (_, stride), (extent, inner) in itertools.pairwise(axes):
        if dim_to_json(stride) != dim_to_json(numel((inner, extent))):
            return None
    return axes[-1][1]


class CudaRenderer(CRenderer):
    """CUDA C of a program's kernels; a buffer of a narrow float (compiler.kernels.precision) is
    read into float and rounded as it is stored; products run on tensor cores where the program
    says (Program.tensor_cores)."""

    def __init__(self, program: Program, schedule: CudaSchedule = DEFAULT_SCHEDULE) -> None:
        super().__init__(program)
        self.schedule = schedule
        # the input format of the program's products on tensor cores, if they run there
        self.tensor_cores = program.tensor_cores

    def symbols(self) -> str:
        return "".join(f"    const int64_t s_{s} = S.v[{i}];\n" for i, s in enumerate(self.program.symbols))

    def parameter(self, buffer: int, writable: bool) -> str:
        dtype = self.program.buffers[buffer].dtype
        ctype = NARROW_TYPES[dtype][0] if dtype in NARROW_TYPES else C_TYPES[dtype]
        return f"{'' if writable else 'const '}{ctype} *__restrict__ b{buffer}"

    def computed_dtype(self, buffer: int) -> str:
        dtype = self.program.buffers[buffer].dtype
        return "float32" if dtype in NARROW_TYPES else dtype

    def value_type(self, buffer: int) -> str:
        return C_TYPES[self.computed_dtype(buffer)]

    def stored(self, buffer: int, value: str) -> str:
        dtype = self.program.buffers[buffer].dtype
        if dtype in NARROW_TYPES:
            return f"lc_to_{NARROW_TYPES[dtype][1]}({value})"
        return super().stored(buffer, value)

    def loaded(self, buffer: int, element: str) -> str:
        dtype = self.program.buffers[buffer].dtype
        return f"lc_from_{NARROW_TYPES[dtype][1]}({element})" if dtype in NARROW_TYPES else element

    def dtype_of(self, e) -> str:
        return self.computed_dtype(e.buffer) if isinstance(e, Load) else e.dtype

    def cuda_kernel(self, kernel: Kernel, number: int = -1, epilogue_only: bool = False) -> tuple[str, tuple[int, ...], tuple, int]:
        """(the function's text, named NAME, with its buffers renumbered by position; the buffers
        it takes, in order; its grid; its threads per block) of the program's kernel `number`; of
        a product's epilogue alone where `epilogue_only` (its sums already in C: cuBLAS's)."""
        stored = sorted(kernel_stores(kernel))
        reads = kernel_reads(kernel)
        if epilogue_only:
            body, grid, threads = self.product_epilogue(kernel)
            reads = lets_reads(kernel.epilogue) - {kernel.c}
        elif isinstance(kernel, GemmCall):
            body, grid, threads = self.product(kernel, self.schedule.tile_of(number))
        elif isinstance(kernel, AttentionCall):
            body, grid, threads = self.attention(kernel)
        else:
            body, grid, threads = (self.elementwise if kernel.reduce is None else self.reduction)(kernel, number)
        buffers = (*sorted(reads - set(stored)), *stored)
        parameters = ", ".join(self.parameter(b, b in stored) for b in buffers)
        text = (
            f'extern "C" __global__ void __launch_bounds__({threads}) NAME(const lc_symbols S, {parameters}) {{\n'
            "    (void)S;\n" + self.symbols() + body + "}\n"
        )
        # buffers by position (and a let's local by its buffer's): equal layers render equal text
        position = {b: i for i, b in enumerate(buffers)}
        locals_ = sorted({int(v) for v in re.findall(r"\blc_v(\d+)\b", text)} - set(position))
        position.update({b: len(buffers) + i for i, b in enumerate(locals_)})
        text = re.sub(r"\b(b|lc_v)(\d+)\b", lambda m: f"{m[1]}{position[int(m[2])]}", text)
        return text, buffers, grid, threads

    @staticmethod
    def unflatten(flat: str, names: list[str], shape, indent: str, rest: str = "lc_rest") -> str:
        """`names[j]` declared as the row-major coordinates of the flat index `flat` over `shape`
        (`rest` names the running quotient: two in one scope need two names)."""
        if not names:
            return ""
        lines = [f"{indent}int64_t {rest} = {flat};\n"]
        for j in range(len(names) - 1, 0, -1):
            lines.append(f"{indent}const int64_t {names[j]} = {rest} % {dim(shape[j])}; {rest} /= {dim(shape[j])};\n")
        lines.append(f"{indent}const int64_t {names[0]} = {rest};\n")
        return "".join(lines)

    @staticmethod
    def grid_stride(total: str, var: str, over: str, per: str, indent: str) -> str:
        """A loop of `var` over [0, total) starting at this thread's (or block's) place."""
        return f"{indent}for (int64_t {var} = {over}; {var} < {total}; {var} += {per}) {{\n"

    def elementwise(self, kernel: LoopKernel, number: int = -1) -> tuple[str, tuple[Dim, Dim, Dim], int]:
        threads = self.schedule.threads_of(number)
        rank = len(kernel.shape)
        total = numel(kernel.shape)
        names = [f"o{j}" for j in range(rank)]
        lines = [
            f"    const int64_t lc_total = {dim(total)};\n",
            self.grid_stride(
                "lc_total", "lc_e", "(int64_t)blockIdx.x * blockDim.x + threadIdx.x", "(int64_t)gridDim.x * blockDim.x", "    "
            ),
            self.unflatten("lc_e", names, kernel.shape, "        "),
            f"        {self.with_lets(kernel.lets, self.out_index(kernel), kernel.value, self.elementwise_store(kernel))}\n",
            "    }\n",
        ]
        return "".join(lines), (dim_ceildiv(total, threads), 1, 1), threads

    def reduction(self, kernel: LoopKernel, number: int = -1) -> tuple[str, tuple[Dim, Dim, Dim], int]:
        kind, extents = kernel.reduce
        dtype = self.computed_dtype(kernel.out)
        out_type = C_TYPES[dtype]
        floating = dtype in ("float32", "float64")
        # float32 sums accumulate in float (a tree of partial sums, not one long chain); integers
        # and bools in 64 bits, a type warp shuffles take
        acc_type = out_type if floating else ("uint64_t" if dtype == "uint64" else "int64_t")
        init = "0" if kind == "sum" else _MAX_INIT.get(dtype, "0")
        reduced = numel(extents)
        # a warp per output, WARP_ROWS of them a block; or a block per output, its warps combined
        # through shared memory: as the schedule says
        warp_rows = self.schedule.warp_rows(number, reduced)
        threads = 32 * WARP_ROWS if warp_rows else REDUCE_THREADS
        combine = "lc_a + lc_b" if kind == "sum" else ("lc_max(lc_a, lc_b)" if floating else "(lc_a > lc_b ? lc_a : lc_b)")
        rank = len(kernel.shape)
        names = [f"o{j}" for j in range(rank)]
        value = self.expr(kernel.value)
        warps = 1 if warp_rows else threads // 32
        if warp_rows:
            rows = self.grid_stride(
                "lc_total", "lc_o", f"(int64_t)blockIdx.x * {WARP_ROWS} + threadIdx.x / 32", f"(int64_t)gridDim.x * {WARP_ROWS}", "    "
            )
            lanes = self.grid_stride("lc_reduced", "lc_r", "(int64_t)(threadIdx.x % 32)", "32", "        ")
        else:
            rows = self.grid_stride("lc_total", "lc_o", "(int64_t)blockIdx.x", "(int64_t)gridDim.x", "    ")
            lanes = self.grid_stride("lc_reduced", "lc_r", "(int64_t)threadIdx.x", f"{threads}", "        ")
        lines = [
            f"    const int64_t lc_total = {dim(numel(kernel.shape))}, lc_reduced = {dim(reduced)};\n",
            f"    __shared__ {acc_type} lc_partial[{warps}];\n" if warps > 1 else "",
            rows,
            self.unflatten("lc_o", names, kernel.shape, "        "),
            f"        {acc_type} lc_acc = ({acc_type})({init});\n",
            lanes,
            self.unflatten("lc_r", [f"r{j}" for j in range(len(extents))], extents, "            ", "lc_rr"),
            f"            const {acc_type} lc_a = lc_acc, lc_b = ({acc_type})({value});\n",
            f"            lc_acc = {combine};\n",
            "        }\n",
            "        for (int lc_d = 16; lc_d > 0; lc_d /= 2) {\n",
            f"            const {acc_type} lc_a = lc_acc, lc_b = __shfl_down_sync(0xffffffffu, lc_acc, lc_d);\n",
            f"            lc_acc = {combine};\n",
            "        }\n",
        ]
        if warps > 1:
            lines += [
                "        if ((threadIdx.x & 31) == 0) lc_partial[threadIdx.x / 32] = lc_acc;\n",
                "        __syncthreads();\n",
                "        if (threadIdx.x == 0) {\n",
                f"            for (int lc_w = 1; lc_w < {warps}; ++lc_w) {{\n",
                f"                const {acc_type} lc_a = lc_acc, lc_b = lc_partial[lc_w];\n",
                f"                lc_acc = {combine};\n",
                "            }\n",
                "        }\n",
                "        __syncthreads();  /* lc_partial is written again for the next output */\n",
            ]
        result = "lc_acc != 0" if dtype == "bool" else "lc_acc"
        writer = "(threadIdx.x % 32) == 0" if warp_rows else "threadIdx.x == 0"
        lines.append(f"        if ({writer}) {self.target(kernel)} = {self.stored(kernel.out, result)};\n")
        lines.append("    }\n")
        blocks = dim_ceildiv(numel(kernel.shape), WARP_ROWS) if warp_rows else numel(kernel.shape)
        return "".join(lines), (blocks, 1, 1), threads

    def attention(self, call: AttentionCall) -> tuple[str, tuple[Dim, Dim, Dim], int]:
        """Attention with online softmax (AttentionCall): a block per batch index (striding over
        x) and tile of query rows (y); Q's rows staged in shared memory once, then per tile of
        keys K's and V's rows. Each warp owns its rows: a lane computes one key's score per row
        (the dot product, then the score expression: scale, mask), the warp's shuffles give the
        tile's max and sum, the running max rescales the row's sum and accumulator, and each lane
        accumulates the head columns lane, lane + 32... of P V from the tile's probabilities in
        shared memory. Computed in float32, whatever the operands are stored in."""
        scores, values = call.scores, call.values
        head, width = scores.k, values.n
        assert isinstance(head, int) and isinstance(width, int) and max(head, width) <= ATTENTION_HEAD_MAX
        mma = MMA_FORMATS.get(self.tensor_cores or "")
        if mma is not None and mma.itemsize == 2 and max(head, width) <= ATTENTION_MMA_HEAD_MAX and head % 16 == 0 and width % 16 == 0:
            return self.attention_mma(call, mma)
        per_warp = 8 if max(head, width) <= 64 else 4
        rows = ATTENTION_WARPS * per_warp
        keys = ATTENTION_KEYS
        columns = -(-width // 32)
        threads = 32 * ATTENTION_WARPS
        variables, score, scale = self.attention_score(call, "lc_dot")
        lines = [
            *self.attention_head(call),
            f"    __shared__ float lc_qs[{rows}][{head}];\n",
            f"    __shared__ float lc_ks[{keys}][{head} + 1];\n",
            f"    __shared__ float lc_vs[{keys}][{width}];\n",
            f"    __shared__ float lc_ps[{ATTENTION_WARPS}][{per_warp}][{keys}];\n",
            "    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;\n",
            *self.attention_rows(call, rows, "(float)"),
            f"        float lc_row_max[{per_warp}], lc_row_sum[{per_warp}], lc_acc[{per_warp}][{columns}];\n",
            f"        _Pragma(\"unroll\") for (int r = 0; r < {per_warp}; ++r) {{\n",
            "            lc_row_max[r] = -INFINITY; lc_row_sum[r] = 0.0f;\n",
            f"            _Pragma(\"unroll\") for (int c = 0; c < {columns}; ++c) lc_acc[r][c] = 0.0f;\n",
            "        }\n",
            f"        for (int64_t j0 = 0; j0 < n; j0 += {keys}) {{\n",
            "            __syncthreads();  /* Q is staged; the last tile's K, V and P are read */\n",
            *self.attention_keys(scores, True, keys, head, "lc_ks[lc_jj][lc_c] = lc_v;"),
            *self.attention_keys(values, False, keys, width, "lc_vs[lc_jj][lc_c] = lc_v;"),
            "            __syncthreads();\n",
            # a head of at most 64: the lane's key in registers, read from shared memory once a tile
            *(
                [f"            float lc_kr[{head}];\n", f"            _Pragma(\"unroll\") for (int c = 0; c < {head}; ++c) lc_kr[c] = lc_ks[lane][c];\n"]
                if head <= 64 else []
            ),
            f"            _Pragma(\"unroll\") for (int r = 0; r < {per_warp}; ++r) {{\n",
            f"                const int lr = warp * {per_warp} + r;\n",
            "                const int64_t i = row0 + lr, j = j0 + lane;\n",
            "                float lc_dot = 0.0f;\n",
            f"                _Pragma(\"unroll\") for (int c = 0; c < {head}; ++c) lc_dot += lc_qs[lr][c] * {'lc_kr[c]' if head <= 64 else 'lc_ks[lane][c]'};\n",
            "                float lc_x = -INFINITY;\n",
            f"                if (i < m && j < n) {{ {variables} lc_x = (float)({score}); }}\n",
            "                float lc_top = lc_x;\n",
            "                for (int d = 16; d > 0; d /= 2) lc_top = lc_max(lc_top, __shfl_xor_sync(0xffffffffu, lc_top, d));\n",
            "                const float lc_new = lc_max(lc_row_max[r], lc_top);\n",
            "                /* a row with no finite score yet adds nothing (and keeps what it has) */\n",
            "                const bool lc_none = lc_new == -INFINITY;\n",
            f"                const float lc_p = (i < m && j < n && !lc_none) ? {_shifted_exp2(scale, 'lc_x', 'lc_new')} : 0.0f;\n",
            f"                const float lc_alpha = lc_none ? 1.0f : {_shifted_exp2(scale, 'lc_row_max[r]', 'lc_new')};\n",
            "                float lc_tile = lc_p;\n",
            "                for (int d = 16; d > 0; d /= 2) lc_tile += __shfl_xor_sync(0xffffffffu, lc_tile, d);\n",
            "                lc_row_sum[r] = lc_row_sum[r] * lc_alpha + lc_tile;\n",
            "                lc_row_max[r] = lc_new;\n",
            "                lc_ps[warp][r][lane] = lc_p;\n",
            f"                _Pragma(\"unroll\") for (int c = 0; c < {columns}; ++c) lc_acc[r][c] *= lc_alpha;\n",
            "            }\n",
            "            __syncwarp();\n",
            f"            for (int jj = 0; jj < {keys}; ++jj) {{\n",
            f"                _Pragma(\"unroll\") for (int c = 0; c < {columns}; ++c) {{\n",
            "                    const int col = lane + 32 * c;\n",
            f"                    const float lc_w = col < {width} ? lc_vs[jj][col] : 0.0f;\n",
            f"                    _Pragma(\"unroll\") for (int r = 0; r < {per_warp}; ++r) lc_acc[r][c] += lc_ps[warp][r][jj] * lc_w;\n",
            "                }\n",
            "            }\n",
            "        }\n",
            f"        _Pragma(\"unroll\") for (int r = 0; r < {per_warp}; ++r) {{\n",
            f"            const int64_t i = row0 + warp * {per_warp} + r;\n",
            "            if (i >= m) continue;\n",
            "            const float lc_inv = 1.0f / lc_row_sum[r];\n",
            f"            _Pragma(\"unroll\") for (int c = 0; c < {columns}; ++c) {{\n",
            "                const int col = lane + 32 * c;\n",
            f"                if (col < {width}) b{values.c}[(t * m + i) * {width} + col] = {self.stored(values.c, _normalized(call, 'lc_acc[r][c]', 'lc_inv', 'lc_row_sum[r]'))};\n",
            "            }\n",
            "        }\n",
            "    }\n",
        ]
        grid = (numel(scores.batch), dim_ceildiv(scores.m, rows), 1)
        return "".join(lines), grid, threads

    def attention_score(self, call: AttentionCall, dot: str) -> tuple[str, str, str]:
        """(the score's loop variables declared from t0.., i and j; the score, the product's sum
        being `dot`; the exponent's scale as a float literal)."""
        nb = len(call.scores.batch)
        variables = "".join(f"const int64_t o{j} = t{j}; " for j in range(nb)) + f"const int64_t o{nb} = i, r0 = j; (void)r0;"
        self.locals[call.scores.c] = dot
        score = self.expr(call.score)
        del self.locals[call.scores.c]
        return variables, score, f"{call.log2_scale!r}f"

    def attention_head(self, call: AttentionCall) -> list[str]:
        """Sizes as the scores' product names them (m, n, k; V's rows are read where its own
        names hold) and the flat batch size."""
        scores = call.scores
        batch = " * ".join(f"(int64_t)({dim(d)})" for d in scores.batch) or "1"
        return [f"    const int64_t m = {dim(scores.m)}, n = {dim(scores.n)}, k = {scores.k}, batch = {batch};\n", "    (void)k;\n"]

    def attention_rows(self, call: AttentionCall, rows: int, convert: str) -> list[str]:
        """The loop over batch indices (a block's x, striding) opened, t0.. declared, and the
        block's `rows` query rows of Q staged into lc_qs (zeros past the last), converted."""
        scores, head = call.scores, call.scores.k
        return [
            f"    const int64_t row0 = (int64_t)blockIdx.y * {rows};\n",
            "    for (int64_t t = blockIdx.x; t < batch; t += gridDim.x) {\n",
            *self.batch_indices(scores, "        "),
            "        __syncthreads();  /* the last batch index's tiles are read */\n",
            f"        for (int lc_e = threadIdx.x; lc_e < {rows * head}; lc_e += {32 * ATTENTION_WARPS}) {{\n",
            f"            const int64_t lc_i = row0 + lc_e / {head}, lc_k = lc_e % {head};\n",
            f"            lc_qs[lc_e / {head}][lc_k] = {convert}(lc_i < m ? (float)({self.a_element(scores)}) : 0.0f);\n",
            "        }\n",
        ]

    def attention_keys(self, call: GemmCall, keys_are_columns: bool, keys: int, extent: int, store: str) -> list[str]:
        """`store` run for each element lc_v of a tile of `keys` keys' rows of `call`'s B, at key
        lc_jj and column lc_c (zeros past the last key): K (the scores' B, whose columns are the
        keys) or V (the values' B, whose rows are), walked in B's stored order so neighbouring
        threads read neighbouring elements."""
        by_key = call.trans_b == keys_are_columns  # B stored with a key's elements together
        key, column = (f"lc_e / {extent}", f"lc_e % {extent}") if by_key else (f"lc_e % {keys}", f"lc_e / {keys}")
        if keys_are_columns:
            place, inside, names = "lc_k = lc_c, lc_j = j0 + lc_jj", "lc_j < n", ""
        else:  # V's own sizes where its element is read: k the keys, n the head's width
            place, inside, names = "lc_k = j0 + lc_jj, lc_j = lc_c", "lc_k < n", f"const int64_t k = n, n = {extent}; (void)k; (void)n;"
        return [
            f"            for (int lc_e = threadIdx.x; lc_e < {keys * extent}; lc_e += {32 * ATTENTION_WARPS}) {{\n",
            f"                const int lc_jj = {key}, lc_c = {column};\n",
            f"                const int64_t {place};\n",
            "                float lc_v = 0.0f;\n",
            f"                if ({inside}) {{\n",
            *([f"                    {names}\n"] if names else []),
            self.b_element(call, "                    "),
            "                }\n",
            f"                {store}\n",
            "            }\n",
        ]

    def attention_mma(self, call: AttentionCall, mma: MmaFormat) -> tuple[str, tuple[Dim, Dim, Dim], int]:
        """Attention with online softmax on tensor cores (a 16-bit format, heads of at most
        ATTENTION_MMA_HEAD_MAX, multiples of 16): a block per batch index and ATTENTION_MMA_ROWS
        query rows, keys ATTENTION_MMA_KEYS at a time. Q, K (transposed) and V are staged in the
        format; the warps compute the tile's scores S = Q K^T as 16x16 warp products into shared
        memory (float); four threads a row take the score expression, the tile's max and sum
        (shuffles), store the probabilities in the format and the row's rescaling factor; the
        warps compute P V the same way, and each element of the output, kept in shared memory in
        float32, is rescaled and added to."""
        scores, values = call.scores, call.values
        head, width = scores.k, values.n
        suffix, pad = mma.suffix, MMA_PAD_BYTES // mma.itemsize
        rows, keys, threads = ATTENTION_MMA_ROWS, ATTENTION_MMA_KEYS, 32 * ATTENTION_WARPS
        per_row = threads // rows  # threads sharing a row of the tile's scores
        span = keys // per_row
        q_ld, k_ld, v_ld, p_ld = head + pad, keys + pad, width + pad, keys + pad
        s_ld, o_ld = keys + MMA_C_PAD, width + MMA_C_PAD
        score_frags, output_frags = (rows // 16) * (keys // 16), (rows // 16) * (width // 16)
        variables, score, scale = self.attention_score(call, "lc_ss[lc_r][lc_jj]")
        shuffle = " ".join(f"lc_top = lc_max(lc_top, __shfl_xor_sync(0xffffffffu, lc_top, {d}));" for d in _halvings(per_row))
        total = " ".join(f"lc_tile += __shfl_xor_sync(0xffffffffu, lc_tile, {d});" for d in _halvings(per_row))
        lines = [
            *self.attention_head(call),
            f"    __shared__ __align__(32) {mma.staged} lc_qs[{rows}][{q_ld}];\n",
            f"    __shared__ __align__(32) {mma.staged} lc_kt[{head}][{k_ld}];\n",
            f"    __shared__ __align__(32) {mma.staged} lc_vs[{keys}][{v_ld}];\n",
            f"    __shared__ __align__(32) {mma.staged} lc_ps[{rows}][{p_ld}];\n",
            f"    __shared__ __align__(32) float lc_ss[{rows}][{max(s_ld, o_ld)}];\n",
            f"    __shared__ __align__(32) float lc_os[{rows}][{o_ld}];\n",
            f"    __shared__ float lc_row_max[{rows}], lc_row_sum[{rows}], lc_alpha[{rows}];\n",
            "    const int warp = threadIdx.x / 32;\n",
            *self.attention_rows(call, rows, f"lc_to_{suffix}"),
            f"        for (int lc_e = threadIdx.x; lc_e < {rows * width}; lc_e += {threads}) lc_os[lc_e / {width}][lc_e % {width}] = 0.0f;\n",
            f"        if (threadIdx.x < {rows}) {{ lc_row_max[threadIdx.x] = -INFINITY; lc_row_sum[threadIdx.x] = 0.0f; }}\n",
            f"        for (int64_t j0 = 0; j0 < n; j0 += {keys}) {{\n",
            "            __syncthreads();  /* Q is staged; the last tile's K, V, P and sums are read */\n",
            *self.attention_keys(scores, True, keys, head, f"lc_kt[lc_c][lc_jj] = lc_to_{suffix}(lc_v);"),
            *self.attention_keys(values, False, keys, width, f"lc_vs[lc_jj][lc_c] = lc_to_{suffix}(lc_v);"),
            "            __syncthreads();\n",
            f"            for (int f = warp; f < {score_frags}; f += {ATTENTION_WARPS}) {{  /* S = Q K^T */\n",
            f"                const int fr = (f / {keys // 16}) * 16, fc = (f % {keys // 16}) * 16;\n",
            "                lc_frag_c lc_acc; lc_mma_zero(lc_acc);\n",
            f"                for (int kk = 0; kk < {head}; kk += {mma.k}) {{\n",
            "                    lc_frag_ab lc_a, lc_b;\n",
            f"                    lc_mma_load_a_{suffix}(lc_a, &lc_qs[fr][kk], {q_ld});\n",
            f"                    lc_mma_load_b_{suffix}(lc_b, &lc_kt[kk][fc], {k_ld});\n",
            f"                    lc_mma_{suffix}(lc_acc, lc_a, lc_b);\n",
            "                }\n",
            f"                lc_mma_store(&lc_ss[fr][fc], lc_acc, {max(s_ld, o_ld)});\n",
            "            }\n",
            "            __syncthreads();\n",
            "            {  /* the online softmax: this thread's part of a row of the tile */\n",
            f"                const int lc_r = threadIdx.x / {per_row}, lc_part = threadIdx.x % {per_row};\n",
            "                const int64_t i = row0 + lc_r;\n",
            f"                float lc_x[{span}], lc_top = -INFINITY;\n",
            f"                for (int u = 0; u < {span}; ++u) {{\n",
            f"                    const int lc_jj = lc_part * {span} + u;\n",
            "                    const int64_t j = j0 + lc_jj;\n",
            "                    lc_x[u] = -INFINITY;\n",
            f"                    if (i < m && j < n) {{ {variables} lc_x[u] = (float)({score}); }}\n",
            "                    lc_top = lc_max(lc_top, lc_x[u]);\n",
            "                }\n",
            f"                {shuffle}\n",
            "                const float lc_old = lc_row_max[lc_r], lc_new = lc_max(lc_old, lc_top);\n",
            "                /* a row with no finite score yet adds nothing (and keeps what it has) */\n",
            "                const bool lc_none = lc_new == -INFINITY;\n",
            "                float lc_tile = 0.0f;\n",
            f"                for (int u = 0; u < {span}; ++u) {{\n",
            f"                    const int lc_jj = lc_part * {span} + u;\n",
            f"                    const float lc_p = (lc_x[u] == -INFINITY || lc_none) ? 0.0f : {_shifted_exp2(scale, 'lc_x[u]', 'lc_new')};\n",
            f"                    lc_ps[lc_r][lc_jj] = lc_to_{suffix}(lc_p);\n",
            "                    lc_tile += lc_p;\n",
            "                }\n",
            f"                {total}\n",
            f"                const float lc_a = lc_none ? 1.0f : {_shifted_exp2(scale, 'lc_old', 'lc_new')};\n",
            "                __syncwarp();  /* every thread of the row has read its running max */\n",
            "                if (lc_part == 0) { lc_alpha[lc_r] = lc_a; lc_row_sum[lc_r] = lc_row_sum[lc_r] * lc_a + lc_tile; lc_row_max[lc_r] = lc_new; }\n",
            "            }\n",
            "            __syncthreads();\n",
            f"            for (int f = warp; f < {output_frags}; f += {ATTENTION_WARPS}) {{  /* P V */\n",
            f"                const int fr = (f / {width // 16}) * 16, fc = (f % {width // 16}) * 16;\n",
            "                lc_frag_c lc_acc; lc_mma_zero(lc_acc);\n",
            f"                for (int kk = 0; kk < {keys}; kk += {mma.k}) {{\n",
            "                    lc_frag_ab lc_a, lc_b;\n",
            f"                    lc_mma_load_a_{suffix}(lc_a, &lc_ps[fr][kk], {p_ld});\n",
            f"                    lc_mma_load_b_{suffix}(lc_b, &lc_vs[kk][fc], {v_ld});\n",
            f"                    lc_mma_{suffix}(lc_acc, lc_a, lc_b);\n",
            "                }\n",
            f"                lc_mma_store(&lc_ss[fr][fc], lc_acc, {max(s_ld, o_ld)});\n",
            "            }\n",
            "            __syncthreads();\n",
            f"            for (int lc_e = threadIdx.x; lc_e < {rows * width}; lc_e += {threads}) {{\n",
            f"                const int lc_r = lc_e / {width}, lc_c = lc_e % {width};\n",
            "                lc_os[lc_r][lc_c] = lc_os[lc_r][lc_c] * lc_alpha[lc_r] + lc_ss[lc_r][lc_c];\n",
            "            }\n",
            "        }\n",
            "        __syncthreads();\n",
            f"        for (int lc_e = threadIdx.x; lc_e < {rows * width}; lc_e += {threads}) {{\n",
            f"            const int lc_r = lc_e / {width}, lc_c = lc_e % {width};\n",
            "            const int64_t i = row0 + lc_r;\n",
            f"            if (i < m) b{values.c}[(t * m + i) * {width} + lc_c] = {self.stored(values.c, _normalized(call, 'lc_os[lc_r][lc_c]', '(1.0f / lc_row_sum[lc_r])', 'lc_row_sum[lc_r]'))};\n",
            "        }\n",
            "    }\n",
        ]
        grid = (numel(scores.batch), dim_ceildiv(scores.m, rows), 1)
        return "".join(lines), grid, threads

    def product_epilogue(self, call: GemmCall) -> tuple[str, tuple[Dim, Dim, Dim], int]:
        """A product's epilogue over C, whose elements hold the sums (a library product's)."""
        total = numel((*call.batch, call.m, call.n))
        batch = " * ".join(f"(int64_t)({dim(d)})" for d in call.batch) or "1"
        lines = [
            f"    const int64_t m = {dim(call.m)}, n = {dim(call.n)}, batch = {batch};\n",
            "    (void)batch;\n",
            self.grid_stride(
                f"{dim(total)}", "lc_e", "(int64_t)blockIdx.x * blockDim.x + threadIdx.x", "(int64_t)gridDim.x * blockDim.x", "    "
            ),
            "        const int64_t t = lc_e / (m * n), i = lc_e / n % m, j = lc_e % n;\n",
            *self.batch_indices(call, "        "),
            *self.product_store(call, None, "        "),
            "    }\n",
        ]
        return "".join(lines), (dim_ceildiv(total, ELEMENTWISE_THREADS), 1, 1), ELEMENTWISE_THREADS

    def product(self, call: GemmCall, tile: int = GEMM_TILE) -> tuple[str, tuple[Dim, Dim, Dim], int]:
        """C = A @ B per batch index, a GEMM_TILE square of C per block; on tensor cores where
        the program asks for them (see product_mma), else in the product's own dtype:
        each thread computes a (GEMM_TILE/16)^2 lattice of the tile (rows ty + 16*i, columns
        tx + 16*j: conflict-free reads of the staged tiles and coalesced stores), then the
        epilogue at each element it stores."""
        if self.tensor_cores is not None and call.dtype == "float32":
            if tile == LARGE_TILE:
                return self.product_mma_large(call, MMA_FORMATS[self.tensor_cores])
            return self.product_mma(call, MMA_FORMATS[self.tensor_cores])
        if tile == LARGE_TILE:
            return self.product_large(call)
        ctype = C_TYPES[call.dtype]
        per = GEMM_TILE // 16
        tile, step = GEMM_TILE, GEMM_K_STEP
        lines = [
            *self.product_head(call, tile),
            f"    __shared__ {ctype} lc_as[{step}][{tile} + 1];\n",
            f"    __shared__ {ctype} lc_bs[{step}][{tile} + 1];\n",
            "    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;\n",
            f"    {ctype} lc_acc[{per}][{per}];\n",
            f"    for (int i = 0; i < {per}; ++i) for (int j = 0; j < {per}; ++j) lc_acc[i][j] = 0;\n",
            f"    for (int64_t k0 = 0; k0 < k; k0 += {step}) {{\n",
            f"        for (int lc_e = threadIdx.x; lc_e < {tile * step}; lc_e += {GEMM_THREADS}) {{\n",
            f"            const int lc_r = lc_e % {tile}, lc_c = lc_e / {tile};\n",
            "            const int64_t lc_i = row0 + lc_r, lc_k = k0 + lc_c;\n",
            f"            lc_as[lc_c][lc_r] = (lc_i < m && lc_k < k) ? {self.a_element(call)} : ({ctype})0;\n",
            "        }\n",
            f"        for (int lc_e = threadIdx.x; lc_e < {tile * step}; lc_e += {GEMM_THREADS}) {{\n",
            f"            const int lc_c = lc_e % {tile}, lc_r = lc_e / {tile};\n",
            "            const int64_t lc_k = k0 + lc_r, lc_j = col0 + lc_c;\n",
            f"            {ctype} lc_v = 0;\n",
            "            if (lc_k < k && lc_j < n) {\n",
            self.b_element(call, "                "),
            "            }\n",
            "            lc_bs[lc_r][lc_c] = lc_v;\n",
            "        }\n",
            "        __syncthreads();\n",
            f"        for (int kk = 0; kk < {step}; ++kk) {{\n",
            f"            {ctype} lc_a[{per}], lc_b[{per}];\n",
            f"            for (int i = 0; i < {per}; ++i) lc_a[i] = lc_as[kk][ty + 16 * i];\n",
            f"            for (int j = 0; j < {per}; ++j) lc_b[j] = lc_bs[kk][tx + 16 * j];\n",
            f"            for (int i = 0; i < {per}; ++i) for (int j = 0; j < {per}; ++j) lc_acc[i][j] += lc_a[i] * lc_b[j];\n",
            "        }\n",
            "        __syncthreads();\n",
            "    }\n",
            f"    for (int lc_ti = 0; lc_ti < {per}; ++lc_ti) for (int lc_tj = 0; lc_tj < {per}; ++lc_tj) {{\n",
            "        const int64_t i = row0 + ty + 16 * lc_ti, j = col0 + tx + 16 * lc_tj;\n",
            "        if (i >= m || j >= n) continue;\n",
            *self.product_store(call, "lc_acc[lc_ti][lc_tj]", "        "),
            "    }\n",
        ]
        grid = (dim_ceildiv(call.n, tile), dim_ceildiv(call.m, tile), numel(call.batch))
        return "".join(lines), grid, GEMM_THREADS

    def product_mma(self, call: GemmCall, mma: MmaFormat) -> tuple[str, tuple[Dim, Dim, Dim], int]:
        """C = A @ B on tensor cores: A and B staged through shared memory in the format's type,
        a MMA_TILE square of C per block of four warps, each warp a 32x32 quarter as 2x2 16x16
        warp products (wmma, k of the format's) accumulated in float32; the sums go through shared
        memory to the epilogue, applied as each element is stored."""
        suffix = mma.suffix
        tile, step = MMA_TILE, MMA_K_STEP
        pad = MMA_PAD_BYTES // mma.itemsize
        a_ld, b_ld, c_ld = step + pad, tile + pad, tile + MMA_C_PAD
        lines = [
            *self.product_head(call, tile),
            f"    __shared__ __align__(32) {mma.staged} lc_as[{tile}][{a_ld}];\n",
            f"    __shared__ __align__(32) {mma.staged} lc_bs[{step}][{b_ld}];\n",
            f"    __shared__ __align__(32) float lc_cs[{tile}][{c_ld}];\n",
            "    const int lc_wm = (threadIdx.x / 32) / 2, lc_wn = (threadIdx.x / 32) % 2;\n",
            "    lc_frag_c lc_acc[2][2];\n",
            "    _Pragma(\"unroll\") for (int i = 0; i < 2; ++i) _Pragma(\"unroll\") for (int j = 0; j < 2; ++j) lc_mma_zero(lc_acc[i][j]);\n",
            f"    for (int64_t k0 = 0; k0 < k; k0 += {step}) {{\n",
            f"        for (int lc_e = threadIdx.x; lc_e < {tile * step}; lc_e += {MMA_THREADS}) {{\n",
            f"            const int lc_r = lc_e / {step}, lc_c = lc_e % {step};\n",
            "            const int64_t lc_i = row0 + lc_r, lc_k = k0 + lc_c;\n",
            f"            lc_as[lc_r][lc_c] = lc_to_{suffix}((lc_i < m && lc_k < k) ? (float)({self.a_element(call)}) : 0.0f);\n",
            "        }\n",
            f"        for (int lc_e = threadIdx.x; lc_e < {tile * step}; lc_e += {MMA_THREADS}) {{\n",
            f"            const int lc_r = lc_e / {tile}, lc_c = lc_e % {tile};\n",
            "            const int64_t lc_k = k0 + lc_r, lc_j = col0 + lc_c;\n",
            "            float lc_v = 0;\n",
            "            if (lc_k < k && lc_j < n) {\n",
            self.b_element(call, "                "),
            "            }\n",
            f"            lc_bs[lc_r][lc_c] = lc_to_{suffix}(lc_v);\n",
            "        }\n",
            "        __syncthreads();\n",
            f"        for (int kk = 0; kk < {step}; kk += {mma.k}) {{\n",
            "            lc_frag_ab lc_a[2], lc_b[2];\n",
            f"            for (int i = 0; i < 2; ++i) lc_mma_load_a_{suffix}(lc_a[i], &lc_as[lc_wm * 32 + 16 * i][kk], {a_ld});\n",
            f"            for (int j = 0; j < 2; ++j) lc_mma_load_b_{suffix}(lc_b[j], &lc_bs[kk][lc_wn * 32 + 16 * j], {b_ld});\n",
            f"            for (int i = 0; i < 2; ++i) for (int j = 0; j < 2; ++j) lc_mma_{suffix}(lc_acc[i][j], lc_a[i], lc_b[j]);\n",
            "        }\n",
            "        __syncthreads();\n",
            "    }\n",
            "    _Pragma(\"unroll\") for (int i = 0; i < 2; ++i) _Pragma(\"unroll\") for (int j = 0; j < 2; ++j)\n",
            f"        lc_mma_store(&lc_cs[lc_wm * 32 + 16 * i][lc_wn * 32 + 16 * j], lc_acc[i][j], {c_ld});\n",
            "    __syncthreads();\n",
            f"    for (int lc_e = threadIdx.x; lc_e < {tile * tile}; lc_e += {MMA_THREADS}) {{\n",
            f"        const int64_t i = row0 + lc_e / {tile}, j = col0 + lc_e % {tile};\n",
            "        if (i >= m || j >= n) continue;\n",
            *self.product_store(call, f"lc_cs[lc_e / {tile}][lc_e % {tile}]", "        "),
            "    }\n",
        ]
        grid = (dim_ceildiv(call.n, tile), dim_ceildiv(call.m, tile), numel(call.batch))
        return "".join(lines), grid, MMA_THREADS

    def product_mma_large(self, call: GemmCall, mma: MmaFormat) -> tuple[str, tuple[Dim, Dim, Dim], int]:
        """C = A @ B on tensor cores, a LARGE_TILE square of C per block of eight warps, each a
        32x64 part as 2x4 warp products; the next k step's elements are loaded into registers
        while this step's are multiplied, then staged into the other pair of shared buffers (one
        barrier a step). Each warp takes its sums through its own 16x16 scratch to the epilogue."""
        tile, threads = LARGE_TILE, LARGE_THREADS
        step = MMA_STEP_BYTES // mma.itemsize  # 32 16-bit elements, 16 tf32 ones: 64 bytes a row
        pad = MMA_PAD_BYTES // mma.itemsize
        a_ld, b_ld, c_ld = step + pad, tile + pad, 16 + MMA_C_PAD
        loads = tile * step // threads
        suffix = mma.suffix
        lines = [
            *self.product_head(call, tile),
            f"    __shared__ __align__(32) {mma.staged} lc_as[2][{tile}][{a_ld}];\n",
            f"    __shared__ __align__(32) {mma.staged} lc_bs[2][{step}][{b_ld}];\n",
            f"    __shared__ __align__(32) float lc_cs[{threads // 32}][16][{c_ld}];\n",
            "    const int lc_warp = threadIdx.x / 32, lc_lane = threadIdx.x % 32;\n",
            "    const int lc_wm = lc_warp / 2, lc_wn = lc_warp % 2;\n",
            "    lc_frag_c lc_acc[2][4];\n",
            "    _Pragma(\"unroll\") for (int fi = 0; fi < 2; ++fi) _Pragma(\"unroll\") for (int fj = 0; fj < 4; ++fj) lc_mma_zero(lc_acc[fi][fj]);\n",
            f"    float lc_ra[{loads}], lc_rb[{loads}];\n",
            *self.staged_loads(call, "float", step, "0", "    ", rows_first=True),
            *self.staged_stores("0", step, "    ", rows_first=True, convert=f"lc_to_{suffix}"),
            "    __syncthreads();\n",
            "    int lc_cur = 0;\n",
            f"    for (int64_t k0 = 0; k0 < k; k0 += {step}) {{\n",
            f"        const bool lc_more = k0 + {step} < k;\n",
            "        if (lc_more) {\n",
            *self.staged_loads(call, "float", step, f"k0 + {step}", "            ", rows_first=True),
            "        }\n",
            f"        for (int kk = 0; kk < {step}; kk += {mma.k}) {{\n",
            "            lc_frag_ab lc_a[2], lc_b[4];\n",
            f"            _Pragma(\"unroll\") for (int fi = 0; fi < 2; ++fi) lc_mma_load_a_{suffix}(lc_a[fi], &lc_as[lc_cur][lc_wm * 32 + 16 * fi][kk], {a_ld});\n",
            f"            _Pragma(\"unroll\") for (int fj = 0; fj < 4; ++fj) lc_mma_load_b_{suffix}(lc_b[fj], &lc_bs[lc_cur][kk][lc_wn * 64 + 16 * fj], {b_ld});\n",
            f"            _Pragma(\"unroll\") for (int fi = 0; fi < 2; ++fi) _Pragma(\"unroll\") for (int fj = 0; fj < 4; ++fj) lc_mma_{suffix}(lc_acc[fi][fj], lc_a[fi], lc_b[fj]);\n",
            "        }\n",
            "        if (lc_more) {\n",
            *self.staged_stores("lc_cur ^ 1", step, "            ", rows_first=True, convert=f"lc_to_{suffix}"),
            "        }\n",
            "        __syncthreads();\n",
            "        lc_cur ^= 1;\n",
            "    }\n",
            "    _Pragma(\"unroll\") for (int fi = 0; fi < 2; ++fi) _Pragma(\"unroll\") for (int fj = 0; fj < 4; ++fj) {\n",
            f"        lc_mma_store(&lc_cs[lc_warp][0][0], lc_acc[fi][fj], {c_ld});\n",
            "        __syncwarp();\n",
            "        for (int lc_e = lc_lane; lc_e < 256; lc_e += 32) {\n",
            "            const int64_t i = row0 + lc_wm * 32 + 16 * fi + lc_e / 16, j = col0 + lc_wn * 64 + 16 * fj + lc_e % 16;\n",
            "            if (i < m && j < n) {\n",
            *self.product_store(call, "lc_cs[lc_warp][lc_e / 16][lc_e % 16]", "                "),
            "            }\n",
            "        }\n",
            "        __syncwarp();  /* the scratch is written again for the next fragment */\n",
            "    }\n",
        ]
        grid = (dim_ceildiv(call.n, tile), dim_ceildiv(call.m, tile), numel(call.batch))
        return "".join(lines), grid, threads

    def product_large(self, call: GemmCall) -> tuple[str, tuple[Dim, Dim, Dim], int]:
        """C = A @ B, a LARGE_TILE square of C per block, each thread a LARGE_PER^2 lattice of it
        (rows ty + 16*i, columns tx + 16*j); while a k step's staged tiles are multiplied, the
        next step's elements are already loaded into registers, then stored into the other pair of
        shared buffers: one barrier a step."""
        ctype = C_TYPES[call.dtype]
        tile, step, per, threads = LARGE_TILE, LARGE_K_STEP, LARGE_PER, LARGE_THREADS
        loads = tile * step // threads  # elements of A's (and B's) tile a thread loads
        lines = [
            *self.product_head(call, tile),
            f"    __shared__ {ctype} lc_as[2][{step}][{tile} + 4];\n",
            f"    __shared__ {ctype} lc_bs[2][{step}][{tile} + 4];\n",
            "    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;\n",
            f"    {ctype} lc_acc[{per}][{per}];\n",
            f"    for (int i = 0; i < {per}; ++i) for (int j = 0; j < {per}; ++j) lc_acc[i][j] = 0;\n",
            f"    {ctype} lc_ra[{loads}], lc_rb[{loads}];\n",
            *self.staged_loads(call, ctype, step, "0", "    ", rows_first=False),
            *self.staged_stores("0", step, "    ", rows_first=False),
            "    __syncthreads();\n",
            "    int lc_cur = 0;\n",
            f"    for (int64_t k0 = 0; k0 < k; k0 += {step}) {{\n",
            f"        const bool lc_more = k0 + {step} < k;\n",
            "        if (lc_more) {\n",
            *self.staged_loads(call, ctype, step, f"k0 + {step}", "            ", rows_first=False),
            "        }\n",
            "        #pragma unroll\n",
            f"        for (int kk = 0; kk < {step}; ++kk) {{\n",
            f"            {ctype} lc_a[{per}], lc_b[{per}];\n",
            f"            for (int i = 0; i < {per}; ++i) lc_a[i] = lc_as[lc_cur][kk][ty + 16 * i];\n",
            f"            for (int j = 0; j < {per}; ++j) lc_b[j] = lc_bs[lc_cur][kk][tx + 16 * j];\n",
            f"            for (int i = 0; i < {per}; ++i) for (int j = 0; j < {per}; ++j) lc_acc[i][j] += lc_a[i] * lc_b[j];\n",
            "        }\n",
            "        if (lc_more) {\n",
            *self.staged_stores("lc_cur ^ 1", step, "            ", rows_first=False),
            "        }\n",
            "        __syncthreads();\n",
            "        lc_cur ^= 1;\n",
            "    }\n",
            f"    for (int lc_ti = 0; lc_ti < {per}; ++lc_ti) for (int lc_tj = 0; lc_tj < {per}; ++lc_tj) {{\n",
            "        const int64_t i = row0 + ty + 16 * lc_ti, j = col0 + tx + 16 * lc_tj;\n",
            "        if (i >= m || j >= n) continue;\n",
            *self.product_store(call, "lc_acc[lc_ti][lc_tj]", "        "),
            "    }\n",
        ]
        grid = (dim_ceildiv(call.n, tile), dim_ceildiv(call.m, tile), numel(call.batch))
        return "".join(lines), grid, threads

    def staged_loads(self, call: GemmCall, ctype: str, step: int, k0: str, indent: str, rows_first: bool) -> list[str]:
        """This thread's elements of A's and B's tiles at k step k0 (a LARGE_TILE by `step`), as
        `ctype`, into registers lc_ra, lc_rb. Consecutive threads read consecutive columns of B;
        of A, consecutive k of a row where `rows_first` (A staged [row][k]), else consecutive rows
        (A staged [k][row])."""
        tile, threads = LARGE_TILE, LARGE_THREADS
        loads = tile * step // threads
        inner = indent + "    "
        a_place = f"lc_e / {step}, lc_k = {k0} + lc_e % {step}" if rows_first else f"lc_e % {tile}, lc_k = {k0} + lc_e / {tile}"
        return [
            f"{indent}for (int lc_l = 0; lc_l < {loads}; ++lc_l) {{\n",
            f"{inner}const int lc_e = threadIdx.x + lc_l * {threads};\n",
            f"{inner}{{\n",
            f"{inner}    const int64_t lc_i = row0 + {a_place};\n",
            f"{inner}    lc_ra[lc_l] = (lc_i < m && lc_k < k) ? ({ctype})({self.a_element(call)}) : ({ctype})0;\n",
            f"{inner}}}\n",
            f"{inner}{{\n",
            f"{inner}    const int64_t lc_k = {k0} + lc_e / {tile}, lc_j = col0 + lc_e % {tile};\n",
            f"{inner}    {ctype} lc_v = 0;\n",
            f"{inner}    if (lc_k < k && lc_j < n) {{\n",
            self.b_element(call, inner + "        "),
            f"{inner}    }}\n",
            f"{inner}    lc_rb[lc_l] = lc_v;\n",
            f"{inner}}}\n",
            f"{indent}}}\n",
        ]

    @staticmethod
    def staged_stores(buffer: str, step: int, indent: str, rows_first: bool, convert: str = "") -> list[str]:
        """This thread's registers lc_ra, lc_rb into the staged tiles' `buffer`, through `convert`
        (a prelude function to the staged type, or none), A in the layout staged_loads read it."""
        tile, threads = LARGE_TILE, LARGE_THREADS
        loads = tile * step // threads
        a_place = f"[lc_e / {step}][lc_e % {step}]" if rows_first else f"[lc_e / {tile}][lc_e % {tile}]"
        return [
            f"{indent}for (int lc_l = 0; lc_l < {loads}; ++lc_l) {{\n",
            f"{indent}    const int lc_e = threadIdx.x + lc_l * {threads};\n",
            f"{indent}    lc_as[{buffer}]{a_place} = {convert}(lc_ra[lc_l]);\n",
            f"{indent}    lc_bs[{buffer}][lc_e / {tile}][lc_e % {tile}] = {convert}(lc_rb[lc_l]);\n",
            f"{indent}}}\n",
        ]

    def product_head(self, call: GemmCall, tile: int) -> list[str]:
        """A product's sizes, its block's batch index t (t0.. per batch axis) and tile corner."""
        batch = " * ".join(f"(int64_t)({dim(d)})" for d in call.batch) or "1"
        return [
            f"    const int64_t m = {dim(call.m)}, n = {dim(call.n)}, k = {dim(call.k)}, batch = {batch};\n",
            "    (void)batch;\n",
            f"    const int64_t t = blockIdx.z, row0 = (int64_t)blockIdx.y * {tile}, col0 = (int64_t)blockIdx.x * {tile};\n",
            *self.batch_indices(call, "    "),
        ]

    def a_element(self, call: GemmCall) -> str:
        """A[lc_i, lc_k] at batch index t."""
        a_off = self.ix(self.batch_offset(call.batch, call.a_batch_strides))
        lda = self.lda(call)
        index = f"lc_k * {lda} + lc_i" if call.trans_a else f"lc_i * {lda} + lc_k"
        return self.loaded(call.a, f"b{call.a}[{a_off} + {index}]")

    def product_store(self, call: GemmCall, value: str | None, indent: str) -> list[str]:
        """C[t, i, j] = value, then the epilogue at that element, if any: it reads C's own
        element, which holds the sum (stored first: the epilogue's expression may read it through
        a view the local cannot stand for)."""
        element = f"b{call.c}[t * m * n + i * n + j]"
        # (no value: the sums are in C already, a library product's)
        lines = [] if value is None else [f"{indent}{element} = {self.stored(call.c, value)};\n"]
        if call.epilogue is not None:
            store = lambda v: f"{element} = {self.stored(call.c, v)};"
            lines.append(f"{indent}{self.with_lets(call.epilogue.lets, 't * m * n + i * n + j', call.epilogue.value, store)}\n")
        return lines

    def b_element(self, call: GemmCall, indent: str) -> str:
        """`lc_v` = B[lc_k, lc_j] at batch index t: read from its buffer, or computed from its
        Panels kernel (a convolution's window element, padding included)."""
        ctype = C_TYPES[call.dtype]
        if call.b_panels is None:
            b_off = self.ix(self.batch_offset(call.batch, call.b_batch_strides))
            ldb = self.ldb(call)
            index = f"lc_j * {ldb} + lc_k" if call.trans_b else f"lc_k * {ldb} + lc_j"
            return f"{indent}lc_v = {self.loaded(call.b, f'b{call.b}[{b_off} + {index}]')};\n"
        panels = call.b_panels
        assert not panels.kernel.lets, "a Panels kernel computes one value per element"
        shape = panels.kernel.shape
        first = len(panels.batch_axes)
        k_names = [f"o{j}" for j in range(first, first + panels.k_axes)]
        n_names = [f"o{j}" for j in range(first + panels.k_axes, len(shape))]
        lines = [f"{indent}const int64_t o{j} = t{axis};\n" for j, axis in enumerate(panels.batch_axes)]
        lines.append(self.unflatten("lc_k", k_names, shape[first : first + panels.k_axes], indent, "lc_kr"))
        lines.append(self.unflatten("lc_j", n_names, shape[first + panels.k_axes :], indent, "lc_nr"))
        lines.append(f"{indent}lc_v = ({ctype})({self.expr(panels.kernel.value)});\n")
        return "".join(lines)


__all__ = ["DEFAULT_SCHEDULE", "SCHEDULES", "CudaRenderer", "CudaSchedule", "CudaSource", "Launch", "render_cuda", "scheduled"]
