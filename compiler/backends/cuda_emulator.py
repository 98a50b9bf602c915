"""Runs rendered CUDA C on the CPU: what the kernels compute, checked where there is no GPU (CI,
and a compile worker without the target's GPU, which verifies a cuda program this way).

The same source NVRTC compiles is compiled by the system C++ compiler behind a small header that
gives CUDA's names CPU meanings: every thread of a block is a fiber of one OS thread,
blocks run one after another, `__shared__` storage is the block's (static: blocks never overlap),
`__syncthreads` switches to the next fiber until every thread of the block has reached it,
`__syncwarp` until every thread of the warp has, and a warp shuffle is an exchange through
per-thread slots between two warp barriers. It runs kernels
the way a GPU may (any interleaving the barriers allow), not fast: a scalar CPU thread, which is
why verification runs at the small verification sizes.

    program = emulate(kernel_ir)          # a CudaProgram on the EmulatedDriver
    outputs = program.run(inputs)

`EmulatedArtifact` stands in for `compiler.pipeline.executable` (the ONNX backend's), so that a
compiled artifact's graph runs as rendered CUDA C: benchmarks/onnx_conformance.py --cuda-emulated.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from compiler.backends.cublas import emulated_gemm
from compiler.backends.cuda import ARENA_ALIGNMENT, CudaBuildFailed, CudaProgram, LaunchCall, kernel_record
from compiler.kernels.ir import Program
from compiler.render.cuda import DEFAULT_SCHEDULE, CudaSchedule, render_cuda, scheduled

_SCHEDULER = r"""
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <ucontext.h>
typedef struct { unsigned x, y, z; } lc_dim3;
lc_dim3 threadIdx, blockIdx, blockDim, gridDim;
enum { RUNNABLE, AT_BARRIER, AT_WARP_BARRIER, DONE };
#define MAX_THREADS 1024
#define STACK_BYTES (128 * 1024)
static char *stacks[MAX_THREADS];
static int state[MAX_THREADS], current;
static void (*body)(void *);
static void *context;
static unsigned long long slots[MAX_THREADS];

#if defined(__x86_64__)
/* A switch between fibers that saves only what the ABI says a call preserves (swapcontext also
   saves the signal mask, a system call per switch: the emulation spent most of its time there).
   lc_switch(&from, to): push the callee-saved registers, store the stack pointer in `from`, load
   `to`, pop, return into the other fiber. */
__asm__(
    ".text\n.globl lc_switch\n.type lc_switch,@function\nlc_switch:\n"
    "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
    "  movq %rsp, (%rdi)\n  movq %rsi, %rsp\n"
    "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n  ret\n");
void lc_switch(void **from, void *to);
static void *scheduler_sp, *fiber_sp[MAX_THREADS];

static void entry(void) {
    body(context);
    state[current] = DONE;
    lc_switch(&fiber_sp[current], scheduler_sp);
}
static void fiber_start(unsigned t) {
    /* the stack as lc_switch leaves a fiber: six saved registers, then where `ret` goes (entry),
       16-byte aligned so that entry starts as a called function does */
    void **top = (void **)(((uintptr_t)(stacks[t] + STACK_BYTES)) & ~(uintptr_t)15);
    top -= 2;
    top[0] = (void *)entry;
    top[1] = 0;
    top -= 6;
    for (int i = 0; i < 6; ++i) top[i] = 0;
    fiber_sp[t] = top;
}
static void fiber_resume(unsigned t) { lc_switch(&scheduler_sp, fiber_sp[t]); }
void lc_emu_sync(void) {
    state[current] = AT_BARRIER;
    lc_switch(&fiber_sp[current], scheduler_sp);
}
void lc_emu_warp_sync(void) {
    state[current] = AT_WARP_BARRIER;
    lc_switch(&fiber_sp[current], scheduler_sp);
}
#else
static ucontext_t scheduler, fibers[MAX_THREADS];
static void entry(void) {
    body(context);
    state[current] = DONE;
    swapcontext(&fibers[current], &scheduler);
}
static void fiber_start(unsigned t) {
    getcontext(&fibers[t]);
    fibers[t].uc_stack.ss_sp = stacks[t];
    fibers[t].uc_stack.ss_size = STACK_BYTES;
    fibers[t].uc_link = NULL;
    makecontext(&fibers[t], entry, 0);
}
static void fiber_resume(unsigned t) { swapcontext(&scheduler, &fibers[t]); }
void lc_emu_sync(void) {
    state[current] = AT_BARRIER;
    swapcontext(&fibers[current], &scheduler);
}
void lc_emu_warp_sync(void) {
    state[current] = AT_WARP_BARRIER;
    swapcontext(&fibers[current], &scheduler);
}
#endif
void *lc_emu_slot(unsigned thread) { return &slots[thread]; }
/* 0, or 1 when some threads of a block finished while others wait at a barrier (a divergent
   __syncthreads, undefined on a GPU) */
int lc_emu_run(void (*kernel_body)(void *), void *kernel_context, unsigned gx, unsigned gy, unsigned gz, unsigned threads) {
    if (threads > MAX_THREADS) return 2;
    body = kernel_body, context = kernel_context;
    gridDim.x = gx, gridDim.y = gy, gridDim.z = gz;
    blockDim.x = threads, blockDim.y = blockDim.z = 1;
    for (unsigned z = 0; z < gz; ++z) for (unsigned y = 0; y < gy; ++y) for (unsigned x = 0; x < gx; ++x) {
        blockIdx.x = x, blockIdx.y = y, blockIdx.z = z;
        for (unsigned t = 0; t < threads; ++t) {
            if (!stacks[t]) stacks[t] = (char *)malloc(STACK_BYTES);
            fiber_start(t);
            state[t] = RUNNABLE;
        }
        for (;;) {
            for (unsigned t = 0; t < threads; ++t) {
                if (state[t] != RUNNABLE) continue;
                current = (int)t;
                threadIdx.x = t, threadIdx.y = threadIdx.z = 0;
                fiber_resume(t);
            }
            /* a warp whose 32 threads all wait at a warp barrier goes on; one where only some do
               diverged (its other threads finished, or wait for the whole block) */
            int released = 0;
            for (unsigned w = 0; w < threads; w += 32) {
                unsigned waiting = 0, lanes = threads - w < 32 ? threads - w : 32;
                for (unsigned t = w; t < w + lanes; ++t) waiting += state[t] == AT_WARP_BARRIER;
                if (!waiting) continue;
                if (waiting != lanes) return 1;
                for (unsigned t = w; t < w + lanes; ++t) state[t] = RUNNABLE;
                released = 1;
            }
            if (released) continue;
            unsigned done = 0;
            for (unsigned t = 0; t < threads; ++t) done += state[t] == DONE;
            if (done == threads) break;
            if (done) return 1;
            for (unsigned t = 0; t < threads; ++t) state[t] = RUNNABLE;
        }
    }
    return 0;
}
"""

_HEADER = r"""
#include <math.h>
#include <stdint.h>
#undef NAN
#undef INFINITY
typedef struct { unsigned x, y, z; } lc_dim3;
extern "C" {
extern lc_dim3 threadIdx, blockIdx, blockDim, gridDim;
void lc_emu_sync(void);
void lc_emu_warp_sync(void);
void *lc_emu_slot(unsigned thread);
int lc_emu_run(void (*)(void *), void *, unsigned, unsigned, unsigned, unsigned);
}
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(threads)
#define __shared__ static
static inline float __int_as_float(int i) { float f; __builtin_memcpy(&f, &i, 4); return f; }
static inline void __syncthreads(void) { lc_emu_sync(); }
static inline void __syncwarp(unsigned mask = 0xffffffffu) { lc_emu_warp_sync(); }
template <typename T> T __shfl_down_sync(unsigned, T value, int delta) {
    *(T *)lc_emu_slot(threadIdx.x) = value;
    lc_emu_warp_sync();
    const unsigned from = threadIdx.x + delta;
    const T got = ((threadIdx.x & 31) + delta < 32 && from < blockDim.x) ? *(T *)lc_emu_slot(from) : value;
    lc_emu_warp_sync();
    return got;
}
template <typename T> T __shfl_xor_sync(unsigned, T value, int mask) {
    *(T *)lc_emu_slot(threadIdx.x) = value;
    lc_emu_warp_sync();
    const unsigned from = threadIdx.x ^ (unsigned)mask;
    const T got = from < blockDim.x ? *(T *)lc_emu_slot(from) : value;
    lc_emu_warp_sync();
    return got;
}
struct lc_call { const void *S; void *const *B; };
#define __align__(n) __attribute__((aligned(n)))
/* narrow floats: float16 through the C++ compiler's _Float16 (round to nearest even, as the GPU's
   cvt.rn), bfloat16 by its bits */
static inline float lc_from_f16(unsigned short h) { _Float16 v; __builtin_memcpy(&v, &h, 2); return (float)v; }
static inline unsigned short lc_to_f16(float f) { _Float16 v = (_Float16)f; unsigned short h; __builtin_memcpy(&h, &v, 2); return h; }
static inline float lc_from_bf16(unsigned short h) { unsigned u = (unsigned)h << 16; float f; __builtin_memcpy(&f, &u, 4); return f; }
static inline unsigned short lc_to_bf16(float f) {
    unsigned u; __builtin_memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);  /* a quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}
/* a warp product's 16x16 tiles, whole (the GPU spreads them over the warp's registers, in a layout
   the code never sees): the warp's lane 0 loads, multiplies and stores them for its warp, which
   is what the warp's 32 lanes do together between the same barriers */
struct lc_frag_ab { float v[256]; };
struct lc_frag_c { float v[256]; };
static inline bool lc_lane0(void) { return (threadIdx.x & 31) == 0; }
static inline void lc_mma_zero(lc_frag_c &d) { for (int i = 0; i < 256; ++i) d.v[i] = 0.0f; }
static inline void lc_mma_load(lc_frag_ab &f, const unsigned short *p, int ldm, float (*from)(unsigned short)) {
    if (lc_lane0()) for (int r = 0; r < 16; ++r) for (int c = 0; c < 16; ++c) f.v[r * 16 + c] = from(p[r * ldm + c]);
}
static inline void lc_mma(lc_frag_c &d, const lc_frag_ab &a, const lc_frag_ab &b) {
    if (!lc_lane0()) return;
    for (int i = 0; i < 16; ++i) for (int j = 0; j < 16; ++j) {
        float sum = d.v[i * 16 + j];
        for (int k = 0; k < 16; ++k) sum += a.v[i * 16 + k] * b.v[k * 16 + j];
        d.v[i * 16 + j] = sum;
    }
}
static inline void lc_mma_load_a_f16(lc_frag_ab &a, const unsigned short *p, int ldm) { lc_mma_load(a, p, ldm, lc_from_f16); }
static inline void lc_mma_load_b_f16(lc_frag_ab &b, const unsigned short *p, int ldm) { lc_mma_load(b, p, ldm, lc_from_f16); }
static inline void lc_mma_load_a_bf16(lc_frag_ab &a, const unsigned short *p, int ldm) { lc_mma_load(a, p, ldm, lc_from_bf16); }
static inline void lc_mma_load_b_bf16(lc_frag_ab &b, const unsigned short *p, int ldm) { lc_mma_load(b, p, ldm, lc_from_bf16); }
static inline void lc_mma_f16(lc_frag_c &d, const lc_frag_ab &a, const lc_frag_ab &b) { lc_mma(d, a, b); }
static inline void lc_mma_bf16(lc_frag_c &d, const lc_frag_ab &a, const lc_frag_ab &b) { lc_mma(d, a, b); }
/* tf32: 10 mantissa bits, rounded to nearest with ties away from zero (cvt.rna) */
static inline float lc_to_tf32(float f) {
    unsigned u; __builtin_memcpy(&u, &f, 4);
    if ((u & 0x7f800000u) != 0x7f800000u) u = (u + 0x1000u) & 0xffffe000u;
    float r; __builtin_memcpy(&r, &u, 4); return r;
}
/* tf32 products are 16x8 (A) by 8x16 (B): the tiles hold them in their first columns or rows */
static inline void lc_mma_load_a_tf32(lc_frag_ab &a, const float *p, int ldm) {
    if (lc_lane0()) for (int r = 0; r < 16; ++r) for (int c = 0; c < 16; ++c) a.v[r * 16 + c] = c < 8 ? p[r * ldm + c] : 0.0f;
}
static inline void lc_mma_load_b_tf32(lc_frag_ab &b, const float *p, int ldm) {
    if (lc_lane0()) for (int r = 0; r < 16; ++r) for (int c = 0; c < 16; ++c) b.v[r * 16 + c] = r < 8 ? p[r * ldm + c] : 0.0f;
}
static inline void lc_mma_tf32(lc_frag_c &d, const lc_frag_ab &a, const lc_frag_ab &b) { lc_mma(d, a, b); }
static inline void lc_mma_store(float *p, const lc_frag_c &d, int ldm) {
    if (lc_lane0()) for (int r = 0; r < 16; ++r) for (int c = 0; c < 16; ++c) p[r * ldm + c] = d.v[r * 16 + c];
}
"""

_BUILD_DIR = Path(tempfile.gettempdir()) / f"luminal-cuda-emulator-{os.getuid()}"


def _wrappers(source: str) -> str:
    """Per kernel function: a body the scheduler runs in each fiber, and an entry point."""
    lines = []
    for name, parameters in re.findall(r"\) (k\d+\w*)\(const lc_symbols S, ([^)]*)\) \{", source):
        types = [re.sub(r"\b__restrict__\s+b\d+$", "", p.strip()).strip() for p in parameters.split(",")]
        arguments = ", ".join(f"({t})c->B[{i}]" for i, t in enumerate(types))
        lines.append(
            f"static void body_{name}(void *x) {{ const lc_call *c = (const lc_call *)x; "
            f"{name}(*(const lc_symbols *)c->S, {arguments}); }}\n"
            f'extern "C" int launch_{name}(const void *S, void *const *B, unsigned gx, unsigned gy, unsigned gz, unsigned t) '
            f"{{ lc_call c = {{S, B}}; return lc_emu_run(body_{name}, &c, gx, gy, gz, t); }}\n"
        )
    return "".join(lines)


def _build(source: str) -> ctypes.CDLL:
    # the C library's headers declare the fixed-width types the prelude declares for NVRTC
    kernels = re.sub(r"(?m)^typedef [a-z ]+ u?int\d+_t;$", "", source)
    text = _HEADER + kernels + "\n" + _wrappers(source)
    key = hashlib.sha256((text + _SCHEDULER).encode()).hexdigest()[:24]
    _BUILD_DIR.mkdir(exist_ok=True)
    library = _BUILD_DIR / f"{key}.so"
    if not library.exists():
        # each process builds apart (tests run in parallel) and the last rename wins
        kernels = _BUILD_DIR / f"{key}-{os.getpid()}.cpp"
        scheduler = _BUILD_DIR / f"{key}-{os.getpid()}-scheduler.c"
        kernels.write_text(text)
        scheduler.write_text(_SCHEDULER)
        partial = _BUILD_DIR / f"{key}-{os.getpid()}.tmp"
        done = subprocess.run(
            [os.environ.get("CXX", "g++"), "-O2", "-shared", "-fPIC", "-w", "-x", "c++", str(kernels), "-x", "c", str(scheduler), "-o", str(partial)],
            capture_output=True, text=True, check=False,
        )
        if done.returncode:
            raise CudaBuildFailed(f"the emulated CUDA source did not build: {done.stderr[-3000:]}")
        os.replace(partial, library)
    return ctypes.CDLL(str(library))


class EmulatedDriver:
    """A `Driver` (compiler.backends.cuda) without a GPU: device memory is host memory, filled with
    0xFF bytes when allocated (NaN floats: a kernel that reads before writing shows), and each
    launch runs in the emulation. Its device seconds are the emulation's wall time."""

    def __init__(self) -> None:
        self._blocks: dict[int, np.ndarray] = {}
        # "page-locked" host blocks by address: host memory is all alike here, but a program's
        # staging goes through the same calls as on a GPU, and tests count what is locked
        self.host_blocks: dict[int, np.ndarray] = {}

    # products as cuBLAS calls are emulated (compiler.backends.cublas.emulated_gemm)
    has_cublas = True

    def load(self, kernel, binaries) -> ctypes.CDLL:
        return _build(kernel["source"])

    def alloc(self, nbytes: int) -> int:
        raw = np.full(nbytes + ARENA_ALIGNMENT, 0xFF, np.uint8)
        address = raw.ctypes.data + -raw.ctypes.data % ARENA_ALIGNMENT
        self._blocks[address] = raw
        return address

    def free(self, address: int) -> None:
        del self._blocks[address]

    def upload(self, address: int, array: np.ndarray) -> None:
        ctypes.memmove(address, np.ascontiguousarray(array).ctypes.data, array.nbytes)

    def download(self, address: int, array: np.ndarray) -> None:
        ctypes.memmove(array.ctypes.data, address, array.nbytes)

    def host_alloc(self, nbytes: int) -> np.ndarray:
        block = np.empty(max(1, nbytes), np.uint8)
        self.host_blocks[block.ctypes.data] = block
        return block

    def host_free(self, block: np.ndarray) -> None:
        del self.host_blocks[block.ctypes.data]

    def load_source(self, source: str, functions: list[str]) -> ctypes.CDLL:
        return _build(source)

    def unload(self, module: ctypes.CDLL) -> None:
        pass  # the library stays mapped: others built from the same source share it

    def close(self) -> None:
        pass  # (host memory: what is still allocated goes with the object)

    def bad_index(self, module: ctypes.CDLL) -> bool:
        flag = ctypes.c_int.in_dll(module, "lc_bad_index")
        found, flag.value = bool(flag.value), 0
        return found

    def execute(self, module: ctypes.CDLL, calls: list[LaunchCall], key) -> float:
        return sum(self.profile(module, calls))

    def profile(self, module: ctypes.CDLL, calls: list[LaunchCall]) -> list[float]:
        seconds = []
        for call in calls:
            started = time.perf_counter()
            if call.library is not None:
                emulated_gemm(call.library, *call.pointers)
                seconds.append(time.perf_counter() - started)
                continue
            symbols = (ctypes.c_int64 * len(call.symbols))(*call.symbols.tolist())
            pointers = (ctypes.c_void_p * max(1, len(call.pointers)))(*call.pointers)
            status = getattr(module, f"launch_{call.function}")(
                ctypes.byref(symbols), pointers, *(ctypes.c_uint(g) for g in call.grid), ctypes.c_uint(call.threads)
            )
            if status:
                raise RuntimeError(f"{call.function}: threads of a block diverged at a barrier (status {status})")
            seconds.append(time.perf_counter() - started)
        return seconds


def emulate(program: Program, size_limits: dict[str, int] | None = None, schedule: CudaSchedule = DEFAULT_SCHEDULE) -> CudaProgram:
    """A kernel-IR program rendered as CUDA C (in `schedule`) and loaded on the emulated device:
    the same CudaProgram (arena, launch plan) a GPU runtime runs."""
    kernel = kernel_record(program, render_cuda(program, schedule), "emulated", size_limits or {})
    return CudaProgram(kernel, program.weights, {}, EmulatedDriver())


class EmulatedArtifact:
    """An artifact's graph lowered and rendered as CUDA C as a GPU compile does it (a float16 or
    bfloat16 graph computed in float32, stored in its format) and emulated; a graph that does not
    lower to kernels is refused as unsupported."""

    def __init__(self, artifact) -> None:
        from compiler.errors import UnsupportedModel
        from compiler.kernels.fusion import fuse
        from compiler.kernels.lower import NotNative, lower
        from compiler.kernels.precision import (
            computed_in_float32,
            narrow_storage,
            narrow_values,
            with_interface_dtypes,
        )

        self.graph = artifact.graph
        narrow = narrow_values(self.graph)
        try:
            program = fuse(lower(computed_in_float32(self.graph) if narrow else self.graph))
        except NotNative as exc:
            raise UnsupportedModel([f"not lowered to kernels: {exc}"]) from None
        if narrow:
            program = narrow_storage(with_interface_dtypes(program, self.graph), narrow)
        self.program = emulate(scheduled(program, DEFAULT_SCHEDULE))

    def run(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.program.run(feed)
