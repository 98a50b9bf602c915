"""Renders a kernel-IR program as one C translation unit with a single entry point.

    int lc_run(const int64_t *S, void **B)    (nonzero: a gathered index was out of range)
    void lc_set_wake_work(int64_t work)       (between runs: the least job that wakes a sleeping worker)

`S` holds the program's symbols (batch, sequence...) in `Program.symbols` order and `B` a
pointer per buffer, in `Program.buffers` order. Loop nests share their output loops among the
program's threads (`_THREADS`: the caller and workers of its own) when the work is large enough;
GEMM calls go to OpenBLAS (the `scipy-openblas32` wheel's `scipy_cblas_*` symbols). Nothing here knows how the code is compiled or loaded.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import replace

import numpy as np

from compiler.dtypes import is_signed_int, is_unsigned_int
from compiler.kernels.ir import (
    Apply,
    Atom,
    AttentionCall,
    Buffer,
    Const,
    Expr,
    GemmCall,
    Guarded,
    IndexValue,
    Ix,
    Load,
    LoopKernel,
    Program,
)
from compiler.kernels.ir_walk import (
    exclusive_feeders,
    expr_reads,
    expr_variables,
    kernel_reads,
    kernel_stores,
    lets_reads,
    linear,
    walk,
)
from compiler.kernels.lower import OP_COST
from compiler.kernels.windows import (
    Axis,
    DepthwiseWindows,
    PoolingWindows,
    WindowGeometry,
    depthwise_windows,
    pooling_windows,
    window_geometry,
)
from compiler.render.c_gemm import (
    CONV_SGEMM,
    DIRECT_SGEMM,
    STRIP_SGEMM,
    TILED_SGEMM,
    pack_weight,
    padded_columns,
)
from compiler.shape import Dim, Shape, dim_sub, provably_le

C_TYPES = {
    "float32": "float",
    "float64": "double",
    "int8": "int8_t",
    "int16": "int16_t",
    "int32": "int32_t",
    "int64": "int64_t",
    "uint8": "uint8_t",
    "uint16": "uint16_t",
    "uint32": "uint32_t",
    "uint64": "uint64_t",
    "bool": "uint8_t",
}
_MAX_INIT = {
    "float32": "-INFINITY",
    "float64": "-INFINITY",
    "int8": "INT8_MIN",
    "int16": "INT16_MIN",
    "int32": "INT32_MIN",
    "int64": "INT64_MIN",
}
# fused attention (AttentionCall): a task's query rows at most (K's staging is shared by that many),
# the keys a tile (whole 16-lane vectors: the register tile reads the staged rows in vectors), and
# the widest head (Q K^T's k, P V's n) its staged tiles hold on the stack
ATTENTION_ROWS = 64
ATTENTION_KEYS = 64
ATTENTION_HEAD_MAX = 128
# a float sum or max over at most this many elements (constant extents) runs as a pooling window
WINDOW_MAX = 64
# below this much work (output elements times the operations each costs, by the lowering's
# OP_COST; a reduction's reads, padding checks and accumulation count) a loop nest runs on the
# calling thread alone: publishing a job and splitting its loop cost more than the loop
PARALLEL_MIN_WORK = 1 << 18
# likewise for a matrix product, in multiply-adds
GEMM_PARALLEL_MIN_FLOPS = 1 << 21
# while the server has requests waiting (NativeProgram.run's `busy`), a loop or product below this
# much work is shared only with a worker already awake (spinning in the same run): a worker woken for
# it then spins on the CPU the server's other processes need between requests. An idle server wakes
# workers for any loop worth splitting: the request's latency is all there is to save.
WAKE_MIN_WORK = 1 << 21
# a matrix-vector product is bound by reading the matrix, which two cores read faster from 256 KiB
# up: an MLP at batch 1 ran 0.066 ms with its 512x512 layers split, 0.123 on one thread
# (onnxruntime 0.066); before the threads took tasks as they came (lc_next) a split one stalled on a
# descheduled partner, and the bound was 2 MiB
GEMV_PARALLEL_MIN_FLOPS = 1 << 16
# a panel of a convolution's windows is filled and multiplied while it stays in a core's L2
PANEL_BYTES = 256 * 1024
# and is at least this many columns wide
PANEL_MIN_COLUMNS = 128
# with gemm="mixed", a panel's product runs the generated kernel (reading A in place) up to this
# many elements of A (256 KiB: L2-resident), and the library above
DIRECT_A_MAX_ELEMENTS = 64 * 1024
# how float32 matrix products run: the library call or the generated tiled product
GEMM_KINDS = (
    "blas", "tiled", "mixed", "panels", "transposed", "direct", "depthwise", "depthwise-registers", "loops",
    "loops-inside", "loops-columns", "dequantized",
)
# the floats of the widest vector register the C targets (AVX-512): a depthwise convolution whose
# input and output planes fit one can run a plane a register ("depthwise-registers")
REGISTER_PLANE_LANES = 16
# the most vectors of a plane held in registers: input (a 16x16 image) and output (8x8)
REGISTER_PLANE_INPUTS = 16
REGISTER_PLANE_OUTPUTS = 4
# the work of a tap of a plane in a register (a permutation and a multiply-add), in loop-nest work units
REGISTER_PLANE_COST = 4
# planes in registers share the threads from this much work (3072 planes of 2x2, 1.2M, ran 1.6x
# faster on two threads; 384 of 4x4, 320K, 4x slower: the woken worker costs more than it does)
REGISTER_PLANES_PARALLEL_MIN_WORK = 1 << 19
# the kinds that run a product as its loop form (GemmCall.loops)
LOOP_FORMS = ("loops", "loops-inside", "loops-columns")
# "loops-columns": the output row is split into a block of columns per thread, at most this many
# (its accumulators stay in L1: 1.4x faster than 16K-column rows, one thread, measured) and at least COLUMN_BLOCK_MIN
COLUMN_BLOCK_MAX = 1024
COLUMN_BLOCK_MIN = 64
# "dequantized": a task widens at most this many of B's columns (whole strips of LC_NR) for every row
# of A, LC_KC rows at a time into 384 KiB of scratch (L2): each row of B is read as a run that long
DEQUANTIZED_COLUMNS = 384
# ... prefetching the row of an int8 weight this many rows ahead (its rows lie a row's length apart)
STRIP_PREFETCH_ROWS = 16
# a convolution whose output rows are at least this wide multiplies its windows in place (lc_conv_rows)
# in the generated kinds: narrower rows waste too many of the padded rows' columns
CONV_MIN_WIDTH = 20
# ... and whose windows read each input element at least this many times (kh*kw / strides): the copy
# of its input costs too much otherwise (3x3 stride 2 reads each 2.25 times and measured slower)
CONV_MIN_REUSE = 4
# the input rows one thread copies for a block of output rows (its phase planes) stay in L2
CONV_PLANE_BYTES = 192 * 1024
# a direct convolution's threads share its channels where its weight is more than this many times
# its image's input, each thread copying the image's rows in one block where they are at most
DIRECT_SHARE_CHANNELS = 1.0
DIRECT_IMAGE_MAX_BYTES = 1024 * 1024
# a row of a loop with lets is computed this many elements at a time, each let into a local array
LET_CHUNK = 256
# at most this many row-invariant padding guards choose a version of a row each (rows_by_guard);
# the rest are checked per element
ROW_CASES_MAX = 8

_PRELUDE = """\
#define _GNU_SOURCE
#include <math.h>
#include <omp.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

void scipy_cblas_sgemm(int, int, int, int, int, int, float, const float *, int, const float *, int,
                       float, float *, int);
void scipy_cblas_dgemm(int, int, int, int, int, int, double, const double *, int, const double *,
                       int, double, double *, int);
void scipy_cblas_sgemv(int, int, int, int, float, const float *, int, const float *, int, float,
                       float *, int);
void scipy_cblas_dgemv(int, int, int, int, double, const double *, int, const double *, int, double,
                       double *, int);


static inline int64_t lc_fdiv(int64_t a, int64_t b) {
    int64_t q = a / b;
    return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}
static inline int64_t lc_fmod(int64_t a, int64_t b) {
    int64_t r = a % b;
    return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}
/* set when a gathered index was out of range; lc_run returns it (calls are serialized by the caller) */
static int lc_bad_index;
/* set when a kernel could not allocate its scratch memory; lc_run returns 2 */
static int lc_no_memory;
/* a gathered index: negative counts from the end; out of range reads element 0 and is reported */
static inline int64_t lc_index(int64_t v, int64_t n) {
    if (v < 0) v += n;
    if (v < 0 || v >= n) { lc_bad_index = 1; return 0; }
    return v;
}
static inline int64_t lc_imod(int64_t a, int64_t b) { return b == 0 ? 0 : a % b; }
/* the calling thread's scratch of at least `bytes`, grown on demand and kept (a panel of an
   operand computed in pieces); NULL, with lc_no_memory set, when it cannot grow */
static void *lc_scratch(int64_t bytes) {
    static __thread void *buffer;
    static __thread int64_t size;
    if (bytes > size) {
        free(buffer);
        buffer = aligned_alloc(64, (size_t)((bytes + 63) / 64 * 64));
        size = buffer ? bytes : 0;
        if (!buffer) lc_no_memory = 1;
    }
    return buffer;
}

/* 2^x for float32 in plain arithmetic, so loops that call it vectorize (libm's exp2f does not):
   x = n + f with |f| <= 1/2, 2^f by its degree-7 Taylor polynomial (truncation error under
   6e-9), 2^n built from exponent bits in two halves so that n in [-150, 128] stays exact;
   NaN propagates through the polynomial, +-inf clamp to inf and 0 */
static inline float lc_exp2f(float x) {
    const float c = x < -150.0f ? -150.0f : (x > 128.0f ? 128.0f : x);
    const float n = __builtin_rintf(c);
    const float f = c - n;
    float p = 1.5252733804059841e-05f;
    p = p * f + 1.5403530393381608e-04f;
    p = p * f + 1.3333558146428443e-03f;
    p = p * f + 9.6181291076284772e-03f;
    p = p * f + 5.5504108664821580e-02f;
    p = p * f + 2.4022650695910071e-01f;
    p = p * f + 6.9314718055994531e-01f;
    p = p * f + 1.0f;
    const int32_t i = (int32_t)n, half = i / 2;
    const uint32_t hi = (uint32_t)(half + 127) << 23, lo = (uint32_t)(i - half + 127) << 23;
    float scale_hi, scale_lo;
    memcpy(&scale_hi, &hi, 4);
    memcpy(&scale_lo, &lo, 4);
    return p * scale_hi * scale_lo;
}
/* max that propagates NaN from either side, as NumPy's maximum does */
/* loops-columns' register tile: LC_QR output rows by LC_QW columns of accumulators (16 vector registers) */
#define LC_QR 4
#if defined(__AVX512F__)
#define LC_QW 64
#else
#define LC_QW 32
#endif
/* the larger, NaN if a is (b's NaN wins the comparison): the plain select compiles to vmaxss where
   `(a > b) | (a != a)` branched on the data (a 3x3 max pool's scalar edges ran 1.5x slower) */
#define LC_MAX(a, b) ({ __typeof__(a) lc_a_ = (a), lc_b_ = (b), lc_m_ = lc_a_ > lc_b_ ? lc_a_ : lc_b_; lc_a_ != lc_a_ ? lc_a_ : lc_m_; })
"""

# a float32 pooling's output row (CRenderer.pooling; needs the prelude's lc_scratch and LC_MAX)
_POOL_ROW = r"""
/* Output row y of a 2-D window reduction (the max where is_max, else the sum) into out, its ow
   elements contiguous: the plane x's element (row, column) is at x[row * row stride + column *
   column stride] inside the input's size, `fill` outside. g: for y, then x: window extent,
   dilation, step, pad, input size, element stride, output extent. Each input row a window reads is
   copied once into scratch, padded and split by phase (column u at phase u % step), so that every
   tap reads a contiguous run: a vector loop over the output row with no bounds checks (reading the
   taps in place, a 3x3 max pool at stride 2 ran 4x onnxruntime's time in strided loops, each tap
   split three ways at the padding). */
static void lc_pool_row(int is_max, const float *x, const int64_t *g, float fill, int64_t y, float *restrict out) {
    const int64_t *gy = g, *gx = g + 7, ow = gx[6], sx = gx[2], pad = gx[3], width = gx[4], cs = gx[5];
    const int64_t wp = (ow - 1) * sx + (gx[0] - 1) * gx[1] + 1, per = (wp + sx - 1) / sx;
    float *restrict stage = (float *)lc_scratch((int64_t)sizeof(float) * gy[0] * sx * per);
    if (!stage) return;
    /* every row staged before any tap reads one: a read spanning stores still in flight waits */
    for (int64_t i = 0; i < gy[0]; ++i) {
        const int64_t row = y * gy[2] + i * gy[1] - gy[3];
        const int inside = row >= 0 && row < gy[4];
        for (int64_t ph = 0; ph < sx; ++ph) {
            int read = 0;  /* only the phases some tap reads */
            for (int64_t j = 0; j < gx[0]; ++j) read |= (j * gx[1]) % sx == ph;
            if (!read) continue;
            float *restrict dst = stage + (i * sx + ph) * per;
            /* v reads column v * sx + ph - pad: inside the input for v in [lo, hi) */
            int64_t lo = 0, hi = 0;
            if (inside && width - 1 + pad - ph >= 0) {
                lo = pad > ph ? (pad - ph + sx - 1) / sx : 0;
                hi = (width - 1 + pad - ph) / sx + 1;
                if (hi > per) hi = per;
                if (lo > hi) lo = hi;
            }
            for (int64_t v = 0; v < lo; ++v) dst[v] = fill;
            if (hi > lo) {
                const float *src = x + row * gy[5] + (lo * sx + ph - pad) * cs;
                const int64_t step = sx * cs, count = hi - lo;
                if (step == 1) memcpy(dst + lo, src, sizeof(float) * count);
                else if (step == 2) for (int64_t v = 0; v < count; ++v) dst[lo + v] = src[2 * v];
                else for (int64_t v = 0; v < count; ++v) dst[lo + v] = src[v * step];
            }
            for (int64_t v = hi; v < per; ++v) dst[v] = fill;
        }
    }
    for (int64_t o = 0; o < ow; ++o) out[o] = is_max ? -INFINITY : 0.0f;
    for (int64_t i = 0; i < gy[0]; ++i)
        for (int64_t j = 0; j < gx[0]; ++j) {
            const int64_t u = j * gx[1];
            const float *restrict tap = stage + (i * sx + u % sx) * per + u / sx;
            if (is_max) {
                #pragma omp simd
                for (int64_t o = 0; o < ow; ++o) out[o] = LC_MAX(out[o], tap[o]);
            } else {
                #pragma omp simd
                for (int64_t o = 0; o < ow; ++o) out[o] += tap[o];
            }
        }
}
"""


# the threads of a program (after its #defines of LC_SYMBOLS, LC_SYMBOLS_READ and LC_BUFFERS)
_THREADS = r"""
/* The threads: the caller of lc_run and lc_threads - 1 workers of this library's own. A parallel
   loop is a job of numbered chunks of tasks that every awake thread takes from one counter, the
   caller among them; the caller then waits only for chunks a worker has taken and not finished.
   With OpenMP a parallel region waited for every thread of its team: on a shared virtual machine
   a sleeping or descheduled worker was slow to come, and a small CNN ran slower on two threads
   than on one (12 ms a call against 8; 2.6-3.3 ms now). Workers spin LC_SPIN_NS for the next job,
   then sleep on a futex. A job wakes them only if it is at least lc_wake_work (`wake`); a smaller
   one is shared only with a worker still spinning. The caller raises lc_wake_work while requests
   wait, so that a small program then never keeps a worker busy: a spinning worker takes the CPU a
   server's other processes need between requests (a batch-of-one MLP behind HTTP served 245
   requests a second when every run woke its worker, 427 when none did, as with OpenMP's 5 us
   spins); idle, every split job wakes them (that MLP alone: 2.1x onnxruntime's latency on one
   thread, 1.1x on two). One that has slept LC_IDLE_S without work exits
   (lc_run starts another), so that a library loaded once and never called keeps no threads. Jobs
   are tagged with the even value of `seq`: a worker that wakes after its job claims nothing. */
#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#define LC_SPIN_NS 200000
#define LC_IDLE_S 2
#define LC_CHUNKS_PER_THREAD 8
typedef void (*lc_kernel_fn)(const int64_t *, void **);
static struct {
    uint32_t seq;  /* odd while the caller rewrites the job; even: the tag of the job published */
    int sleepers, alive;
    uint64_t next;  /* the job's tag << 32 | the next chunk */
    int64_t done;   /* its tasks finished */
    int64_t grain;  /* tasks a claim takes (each thread counts the tasks itself, as its caller) */
    lc_kernel_fn kernel;
    int64_t S[LC_SYMBOLS];
    void *B[LC_BUFFERS];
} lc_pool;
static int lc_threads;
/* a job smaller than this wakes no sleeping worker (set by lc_set_wake_work between runs) */
static int64_t lc_wake_work;
void lc_set_wake_work(int64_t work) { lc_wake_work = work; }
static __thread int lc_is_worker;
static __thread uint32_t lc_worker_tag;
static __thread int64_t lc_worker_grain;

/* While a program runs its threads flush denormals to zero (FTZ and DAZ, as TensorFlow's threads
   do): on Intel an FMA with a denormal operand takes a microcode assist, a hundred times its cost,
   and the exponentials of a softmax whose scores spread past 87 are denormal. Values below
   1.2e-38 become 0. lc_run gives the caller back its own mode. */
#if defined(__SSE2__)
#include <xmmintrin.h>
static inline unsigned lc_flush_denormals(void) {
    const unsigned saved = _mm_getcsr();
    _mm_setcsr(saved | 0x8040u);
    return saved;
}
static inline void lc_restore_mode(unsigned saved) { _mm_setcsr(saved); }
#else
static inline unsigned lc_flush_denormals(void) { return 0; }
static inline void lc_restore_mode(unsigned saved) { (void)saved; }
#endif

static inline void lc_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}
static int64_t lc_now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}
/* the caller is about to rewrite the job or the run's symbols and pointers: tags read now are stale */
static void lc_pool_open(void) {
    if (!(__atomic_load_n(&lc_pool.seq, __ATOMIC_RELAXED) & 1)) __atomic_add_fetch(&lc_pool.seq, 1, __ATOMIC_SEQ_CST);
}
static void *lc_worker(void *unused) {
    (void)unused;
    lc_is_worker = 1;
    lc_flush_denormals();
    int64_t S[LC_SYMBOLS];
    void *B[LC_BUFFERS];
    uint32_t seen = __atomic_load_n(&lc_pool.seq, __ATOMIC_ACQUIRE);
    for (;;) {
        uint32_t s = __atomic_load_n(&lc_pool.seq, __ATOMIC_ACQUIRE);
        if (s == seen || (s & 1)) {
            const int64_t since = lc_now_ns();
            int spins = 0;
            while (((s = __atomic_load_n(&lc_pool.seq, __ATOMIC_ACQUIRE)) == seen || (s & 1))
                   && (++spins & 63 || lc_now_ns() - since < LC_SPIN_NS))
                lc_relax();
            if (s == seen || (s & 1)) {
                __atomic_add_fetch(&lc_pool.sleepers, 1, __ATOMIC_SEQ_CST);
                struct timespec idle = {LC_IDLE_S, 0};
                const long woke = syscall(SYS_futex, &lc_pool.seq, FUTEX_WAIT_PRIVATE, s, &idle, NULL, 0);
                __atomic_sub_fetch(&lc_pool.sleepers, 1, __ATOMIC_SEQ_CST);
                if (woke != 0 && __atomic_load_n(&lc_pool.seq, __ATOMIC_ACQUIRE) == s && !(s & 1)) {
                    __atomic_sub_fetch(&lc_pool.alive, 1, __ATOMIC_SEQ_CST);
                    return NULL;  /* idle for LC_IDLE_S (or interrupted with nothing new): lc_run starts another */
                }
            }
            continue;
        }
        const lc_kernel_fn kernel = lc_pool.kernel;
        const int64_t grain = lc_pool.grain;
        memcpy(S, lc_pool.S, sizeof S);
        memcpy(B, lc_pool.B, sizeof B);
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if (__atomic_load_n(&lc_pool.seq, __ATOMIC_RELAXED) != s) continue;  /* rewritten while read */
        seen = lc_worker_tag = s;
        lc_worker_grain = grain;
        kernel(S, B);
    }
}
/* lc_run's calls are one at a time: the pool has one caller */
static pthread_mutex_t lc_run_lock = PTHREAD_MUTEX_INITIALIZER;
/* a forked child has none of its parent's workers (and the lock may have been held by another thread) */
static void lc_pool_forked(void) {
    lc_pool.alive = lc_pool.sleepers = 0;
    pthread_mutex_init(&lc_run_lock, NULL);
}
/* at the start of a run: the workers that are missing, and the run's symbols and pointers */
static void lc_pool_start(const int64_t *S, void **B) {
    if (!lc_threads) {
        lc_threads = omp_get_max_threads() > 0 ? omp_get_max_threads() : 1;
        pthread_atfork(NULL, NULL, lc_pool_forked);
    }
    while (__atomic_load_n(&lc_pool.alive, __ATOMIC_SEQ_CST) < lc_threads - 1) {
        pthread_t thread;
        pthread_attr_t attributes;
        pthread_attr_init(&attributes);
        pthread_attr_setdetachstate(&attributes, PTHREAD_CREATE_DETACHED);
        const int failed = pthread_create(&thread, &attributes, lc_worker, NULL);
        pthread_attr_destroy(&attributes);
        if (failed) break;  /* the caller takes every task */
        __atomic_add_fetch(&lc_pool.alive, 1, __ATOMIC_SEQ_CST);
    }
    lc_pool_open();
    memcpy(lc_pool.S, S, sizeof(int64_t) * LC_SYMBOLS_READ);
    memcpy(lc_pool.B, B, sizeof(void *) * LC_BUFFERS);
}
/* a parallel loop's tasks [0, total) as its thread claims them: chunks [lo, hi) */
typedef struct { int64_t total, grain, lo, hi; uint32_t tag; int shared; } lc_tasks;
static inline void lc_begin(lc_tasks *t, lc_kernel_fn kernel, int64_t total, int parallel, int64_t grain, int wake) {
    t->total = total, t->lo = t->hi = 0;
    if (lc_is_worker) { t->shared = 1, t->tag = lc_worker_tag, t->grain = lc_worker_grain; return; }
    t->shared = parallel && total > 1 && __atomic_load_n(&lc_pool.alive, __ATOMIC_RELAXED) > 0;
    t->grain = t->shared ? (grain > 0 ? grain : (total + LC_CHUNKS_PER_THREAD * lc_threads - 1) / (LC_CHUNKS_PER_THREAD * lc_threads)) : total;
    t->tag = -1;
    if (!t->shared) return;
    lc_pool_open();
    lc_pool.kernel = kernel, lc_pool.grain = t->grain;
    const uint32_t tag = __atomic_load_n(&lc_pool.seq, __ATOMIC_RELAXED) + 1;
    __atomic_store_n(&lc_pool.done, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&lc_pool.next, (uint64_t)tag << 32, __ATOMIC_RELAXED);
    __atomic_store_n(&lc_pool.seq, tag, __ATOMIC_SEQ_CST);
    t->tag = tag;
    if (wake && __atomic_load_n(&lc_pool.sleepers, __ATOMIC_SEQ_CST))
        syscall(SYS_futex, &lc_pool.seq, FUTEX_WAKE_PRIVATE, lc_threads, NULL, NULL, 0);
}
/* the thread's next chunk into t->lo, t->hi; 0 when none is left (the caller has then waited for
   every chunk taken) */
static inline int lc_next(lc_tasks *t) {
    if (!t->shared) {
        if (t->hi >= t->total) return 0;
        t->lo = 0, t->hi = t->total;
        return 1;
    }
    if (t->hi > t->lo) __atomic_add_fetch(&lc_pool.done, t->hi - t->lo, __ATOMIC_RELEASE);
    t->lo = t->hi = 0;
    if (lc_is_worker && __atomic_load_n(&lc_pool.seq, __ATOMIC_RELAXED) != t->tag) return 0;
    const int64_t grain = t->grain;
    uint64_t v = __atomic_load_n(&lc_pool.next, __ATOMIC_RELAXED);
    for (;;) {
        if ((uint32_t)(v >> 32) != t->tag) break;
        const int64_t chunk = (uint32_t)v, lo = chunk * grain;
        if (lo >= t->total) break;
        if (__atomic_compare_exchange_n(&lc_pool.next, &v, v + 1, 1, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED)) {
            t->lo = lo, t->hi = lo + grain < t->total ? lo + grain : t->total;
            return 1;
        }
    }
    if (!lc_is_worker)
        for (int spins = 0; __atomic_load_n(&lc_pool.done, __ATOMIC_ACQUIRE) < t->total; ++spins)
            if (spins < 4096) lc_relax(); else sched_yield();  /* a worker may share the caller's CPU */
    return 0;
}
"""


def prepack_weights(program: Program, only: Collection[int] | None = None, transposed: Collection[int] = ()) -> Program:
    """The program with every float32 product whose B is a whole weight matrix (shared by the
    batch) reading it packed in the generated product's panels (`GemmCall.packed_b`): packed once
    here, where lc_sgemm would pack it again on every run (12-35% of a 64..128-row product's time
    here, single-threaded). A weight that nothing else reads is replaced by its packing, so a
    loaded program holds no more memory than before (a padded last panel aside). `only`: the
    kernel numbers of the products to pack (those the schedule runs generated), else all.
    `transposed`: products to compute transposed instead, their weight A packed as A^T's panels
    (`GemmCall.packed_a`; where A is such a weight, transposed_packable)."""
    if transposed:
        program = _pack_operands(program, {n for n in transposed if transposed_packable(program, program.kernels[n])}, "a")
    chosen = {
        n for n, kernel in enumerate(program.kernels)
        if _packable(program, kernel) and not kernel.packed_a and (only is None or n in only)
    }
    return _pack_operands(program, chosen, "b")


def _pack_operands(program: Program, chosen: Collection[int], operand: str) -> Program:
    """The program with operand "a" or "b" of each chosen product, a weight, read as the panels
    pack_weight makes of it as a [k, columns] matrix (B as it is, A transposed): packed once, its
    rows dropped where only such products read them."""
    if not chosen:
        return program
    reads = Counter(b for kernel in program.kernels for b in kernel_reads(kernel))
    buffers, weights = list(program.buffers), dict(program.weights)
    packed: dict[tuple[int, bool], int] = {}
    kernels = []
    for number, kernel in enumerate(program.kernels):
        if number not in chosen:
            kernels.append(kernel)
            continue
        stored, trans = getattr(kernel, operand), getattr(kernel, f"trans_{operand}")
        key = (stored, trans)
        if key not in packed:
            buffer = program.buffers[stored]
            columns = kernel.n if operand == "b" else kernel.m
            by_rows = trans == (operand == "a")  # stored as [k, columns]: B untransposed, A transposed
            matrix = np.asarray(program.weights[buffer.name], np.float32).reshape(
                (kernel.k, columns) if by_rows else (columns, kernel.k)
            )
            panels = pack_weight(matrix if by_rows else matrix.T)
            name = f"{buffer.name}:panels{'' if operand == 'b' else '-of-transpose'}{'T' if trans else ''}"
            weights[name] = panels
            # every kernel that reads the weight reads it packed this way: the rows can go
            alone = reads[stored] == sum(
                1 for n in chosen
                if getattr(program.kernels[n], operand) == stored and getattr(program.kernels[n], f"trans_{operand}") == trans
            )
            target = stored if alone else len(buffers)
            if alone:
                del weights[buffer.name]
                buffers[target] = Buffer(target, "float32", panels.shape, "weight", name)
            else:
                buffers.append(Buffer(target, "float32", panels.shape, "weight", name))
            packed[key] = target
        kernels.append(replace(kernel, **{operand: packed[key], f"packed_{operand}": True, f"trans_{operand}": False}))
    return Program(buffers, kernels, program.symbols, dict(program.slots), weights)


def transposed_packable(program: Program, kernel: LoopKernel | GemmCall) -> bool:
    """A float32 product whose A is one whole weight matrix of known size, the same for the batch
    (a convolution's or a left-multiplied weight): it can run transposed, A packed (lc_sgemm_t)."""
    return (
        isinstance(kernel, GemmCall) and kernel.dtype == "float32" and not kernel.packed_b
        and program.buffers[kernel.a].role == "weight" and kernel.b != kernel.a and kernel.lda is None
        and _shared(kernel.a_batch_strides, kernel.batch) and isinstance(kernel.k, int) and isinstance(kernel.m, int)
    )


# the widest rows a plain product's columns are read in, as windows of one (direct_windows)
DIRECT_PLAIN_WIDTH = 64


def direct_windows(program: Program, kernel: LoopKernel | GemmCall) -> WindowGeometry | None:
    """The 2-D convolution windows of a product whose A is a weight (transposed_packable), which the
    "direct" kind reads in place from a channels-last copy of the input; None for any other. A plain
    product's B (a 1x1 convolution's input: k channels of n positions) is windows of one, its n
    columns read as rows of the widest width up to DIRECT_PLAIN_WIDTH that divides n (its base is
    over the product's batch indices t0.., where a convolution's is over its panels' o0..)."""
    if not transposed_packable(program, kernel):
        return None
    if kernel.b_panels is not None:
        return window_geometry(kernel.b_panels)
    if kernel.trans_b or not isinstance(kernel.n, int) or not (kernel.ldb is None or isinstance(kernel.ldb, int)):
        return None
    n = kernel.n
    width = max(w for w in range(1, min(n, DIRECT_PLAIN_WIDTH) + 1) if n % w == 0)
    rows = n // width
    base = Ix()
    for j, stride in enumerate(kernel.b_batch_strides):
        base = base + Ix.var(f"t{j}").scale(stride)
    return WindowGeometry(
        kernel.b, base, kernel.k, n if kernel.ldb is None else kernel.ldb,
        (Axis(1, 1, 1, 0, rows, width, rows), Axis(1, 1, 1, 0, width, 1, width)),
    )


def depthwise_of(kernel: LoopKernel | GemmCall) -> DepthwiseWindows | None:
    """The depthwise convolution a float32 product computes, read off its loop form (either
    orientation: the windows as A or as B), which the "depthwise" kind computes plane by plane;
    None for any other product. Its C is the loop's output, an output plane per batch index."""
    if not isinstance(kernel, GemmCall) or kernel.dtype != "float32" or kernel.loops is None:
        return None
    loops = kernel.loops
    if loops.out != kernel.c or tuple(loops.shape[:-2]) != tuple(kernel.batch):
        return None
    windows = depthwise_windows(loops)
    if windows is None or max(a.step for a in windows.axes) > 8 or not isinstance(kernel.m, int) or not isinstance(kernel.n, int):
        return None
    y, x = windows.axes
    return windows if kernel.m * kernel.n == y.out * x.out else None


def plane_taps(windows: DepthwiseWindows) -> dict[int, list[tuple[int, int]]]:
    """Each tap's reads of a depthwise convolution's plane: (output position, input position), both
    flat in their planes, where the input position is inside the input (padding reads nothing)."""
    y, x = windows.axes
    taps: dict[int, list[tuple[int, int]]] = {}
    for i in range(y.kernel):
        for j in range(x.kernel):
            reads = taps.setdefault(i * x.kernel + j, [])
            for oy in range(y.out):
                for ox in range(x.out):
                    iy, ix = oy * y.step + y.dilation * i - y.pad, ox * x.step + x.dilation * j - x.pad
                    if 0 <= iy < y.size and 0 <= ix < x.size:
                        reads.append((oy * x.out + ox, iy * x.size + ix))
    return taps


def register_planes(kernel: LoopKernel | GemmCall) -> DepthwiseWindows | None:
    """The depthwise convolution (depthwise_of) whose planes fit a few vector registers
    (REGISTER_PLANE_LANES floats each: at most REGISTER_PLANE_INPUTS of the input, REGISTER_PLANE_OUTPUTS
    of the output) and whose every tap reads each output vector's lanes from at most two input
    vectors, which the "depthwise-registers" kind computes a plane in registers, each tap a
    two-source permutation; None for any other product."""
    windows = depthwise_of(kernel)
    if windows is None:
        return None
    y, x = windows.axes
    lanes = REGISTER_PLANE_LANES
    if y.size * x.size > lanes * REGISTER_PLANE_INPUTS or y.out * x.out > lanes * REGISTER_PLANE_OUTPUTS:
        return None
    for reads in plane_taps(windows).values():
        sources: dict[int, set[int]] = {}
        for out, at in reads:
            sources.setdefault(out // lanes, set()).add(at // lanes)
        if any(len(vectors) > 2 for vectors in sources.values()):
            return None
    return windows


def _scaled_int8(program: Program, value: Expr, column: str, row: str, summed: set[str]) -> tuple[Load, Load, Dim] | None:
    """(q, scale, q's step per row) where a Panels kernel's value is an int8 weight's element times a
    float32 scale, both contiguous along the column variable and the scale the same for every
    `summed` (k) variable (compiler.quantize's cast(q) * scale): the "dequantized" product widens a
    strip's row of q with lc_widen_int8 and scales C's columns after. None otherwise."""
    if not (isinstance(value, Apply) and value.op == "mul" and len(value.args) == 2):
        return None
    for widened, scale in (value.args, value.args[::-1]):
        if not (isinstance(widened, Apply) and widened.op == "cast" and widened.dtype == "float32"):
            continue
        (q,) = widened.args
        if not (isinstance(q, Load) and isinstance(scale, Load)):
            continue
        if program.buffers[q.buffer].dtype != "int8" or program.buffers[scale.buffer].dtype != "float32":
            continue
        q_steps, scale_steps = dict(q.index.terms), dict(scale.index.terms)
        if any(not isinstance(v, str) for v in (*q_steps, *scale_steps)):
            continue  # a gathered or divided index: not a plain strided row
        if q_steps.get(column) == 1 and scale_steps.get(column) == 1 and row in q_steps and not summed & set(scale_steps):
            return q, scale, q_steps[row]
    return None


def widens_integer_panels(program: Program, kernel: LoopKernel | GemmCall) -> bool:
    """Whether a float32 product's B is computed by its Panels kernel from an integer weight
    (compiler.quantize's int8 weights widened and scaled) along one n axis: the products that can
    run "dequantized"."""
    if not isinstance(kernel, GemmCall) or kernel.dtype != "float32" or kernel.b_panels is None:
        return False
    panels = kernel.b_panels
    if len(panels.kernel.shape) != len(panels.batch_axes) + panels.k_axes + 1 or panels.kernel.reduce is not None:
        return False
    return any(
        isinstance(e, Load) and program.buffers[e.buffer].role == "weight"
        and (is_signed_int(program.buffers[e.buffer].dtype) or is_unsigned_int(program.buffers[e.buffer].dtype))
        for e in walk(panels.kernel.value)
    )


def _packable(program: Program, kernel: LoopKernel | GemmCall) -> bool:
    """A float32 product whose B is one whole weight matrix of known size, the same for the batch."""
    return (
        isinstance(kernel, GemmCall) and kernel.dtype == "float32" and kernel.b_panels is None
        and program.buffers[kernel.b].role == "weight" and kernel.b != kernel.a and kernel.ldb is None
        and _shared(kernel.b_batch_strides, kernel.batch) and isinstance(kernel.k, int) and isinstance(kernel.n, int)
    )


def _shared(strides: tuple[Dim, ...], batch: tuple[Dim, ...]) -> bool:
    """Whether an operand is the same matrix at every batch index (a group axis of one counts)."""
    return all(s == 0 or d == 1 for s, d in zip(strides, batch, strict=True))


def render(program: Program, profile: bool = False, gemm: str | Mapping[int, str] = "blas") -> str:
    """The program's C source; with `profile`, lc_run also adds each kernel's wall time to
    `lc_kernel_seconds[n]` (for benchmarks/profile_native.py, never in an artifact). `gemm` says
    how float32 GEMM calls run: "blas" (OpenBLAS), "tiled" (the generated products of c_gemm),
    "mixed" (a wide 2-D convolution's product reads its windows in place, lc_conv_rows; other
    convolutions' panel products are generated where A fits in cache; the rest OpenBLAS) or
    "panels" (as mixed, with every convolution's panel product generated) or "transposed" (computed
    as C^T = B^T A^T, the weight A packed: products marked `packed_a`). A product marked `packed_b`
    (prepack_weights) is the generated one whatever `gemm` says. `gemm` may also map
    kernel numbers to kinds: each product as the schedule search chose ("blas" where unnamed)."""
    renderer = CRenderer(program, gemm)
    symbols, buffers = len(program.symbols), len(program.buffers)
    sizes = f"#define LC_SYMBOLS {max(1, symbols)}\n#define LC_SYMBOLS_READ {symbols}\n#define LC_BUFFERS {max(1, buffers)}\n"
    parts = [_PRELUDE, sizes + _THREADS]
    kinds = {n: renderer.kind_of(n) for n in range(len(program.kernels))}
    if any(
        isinstance(k, GemmCall) and k.dtype == "float32"
        and (kinds[n] == "tiled" or k.packed_b or k.packed_a or kinds[n] in ("mixed", "panels") and k.b_panels is not None)
        for n, k in enumerate(program.kernels)
    ):
        parts.append(TILED_SGEMM)
        if any(isinstance(k, GemmCall) and renderer.windows(k, n) is not None for n, k in enumerate(program.kernels)):
            parts.append(CONV_SGEMM)
        if any(isinstance(k, GemmCall) and kinds[n] == "direct" for n, k in enumerate(program.kernels)):
            parts.append(DIRECT_SGEMM)
    if any(isinstance(k, AttentionCall) for k in program.kernels) and TILED_SGEMM not in parts:
        parts.append(TILED_SGEMM)  # (its register tile computes the scores and P V)
    if any(isinstance(k, GemmCall) and kinds[n] == "depthwise-registers" for n, k in enumerate(program.kernels)):
        parts.append("#include <immintrin.h>\n")  # (the planes' permutations)
    if any(isinstance(k, GemmCall) and kinds[n] == "dequantized" for n, k in enumerate(program.kernels)):
        parts.extend((TILED_SGEMM, STRIP_SGEMM) if TILED_SGEMM not in parts else (STRIP_SGEMM,))
    if any(isinstance(k, LoopKernel) and renderer.pooling(k) is not None for k in program.kernels):
        parts.append(_POOL_ROW)
    for number, kernel in enumerate(program.kernels):
        parts.append(renderer.kernel(number, kernel))
    if profile:
        parts.append(f"double lc_kernel_seconds[{max(1, len(program.kernels))}];\n")
        calls = "".join(
            f"    {{ double t = omp_get_wtime(); k{n}(S, B); lc_kernel_seconds[{n}] += omp_get_wtime() - t; }}\n"
            for n in range(len(program.kernels))
        )
    else:
        calls = "".join(f"    k{n}(S, B);\n" for n in range(len(program.kernels)))
    # nonzero when an index was out of range: the outputs are then garbage and the caller raises
    parts.append(
        f"int lc_run(const int64_t *S, void **B) {{\n    pthread_mutex_lock(&lc_run_lock);\n"
        "    const unsigned lc_mode = lc_flush_denormals();\n"
        "    lc_bad_index = 0;\n    lc_no_memory = 0;\n    lc_pool_start(S, B);\n"
        f"{calls}    const int status = lc_no_memory ? 2 : lc_bad_index;\n"
        "    lc_restore_mode(lc_mode);\n    pthread_mutex_unlock(&lc_run_lock);\n    return status;\n}\n"
    )
    return "\n".join(parts)


class CRenderer:
    """A program's kernels as C: loops, products, and the expressions inside them (which the
    CUDA renderer, compiler.render.cuda, shares)."""

    def __init__(self, program: Program, gemm: str | Mapping[int, str] = "blas") -> None:
        self.program = program
        # how each product runs (GEMM_KINDS): one kind for all, or by kernel number ("blas" where
        # a map does not say: the schedule search's per-product choice)
        self.gemm_kinds: Mapping[int, str] = {} if isinstance(gemm, str) else dict(gemm)
        self.default_gemm = gemm if isinstance(gemm, str) else "blas"
        for kind in [self.default_gemm, *self.gemm_kinds.values()]:
            if kind not in GEMM_KINDS:
                raise ValueError(f"gemm must be one of {GEMM_KINDS}, not {kind!r}")
        # the kernel being rendered
        self.number = 0
        # kernels that pack an operand for a product run as its loop form alone: dead, not rendered
        self.skipped = frozenset(
            f for n in self.looped() for f in exclusive_feeders(program, n)
        )
        # the conditions of the padding guards around the expression being rendered ("" outside
        # any; None below a guard that is not affine, where loads are not wrapped)
        self.guard: str | None = ""
        # padding guards known to hold where the expression is being rendered (a split loop's middle)
        self.known: frozenset = frozenset()
        # padding guards known to fail there (a row of a concatenation outside one part's range)
        self.known_false: frozenset = frozenset()
        # buffers whose element is a local of the statement being rendered (a loop's lets)
        self.locals: dict[int, str] = {}
        # gathered indices computed once before the row being rendered: atom -> its local
        self.hoisted: dict[Atom, str] = {}

    def symbols(self) -> str:
        return "".join(f"    const int64_t s_{s} = S[{i}];\n" for i, s in enumerate(self.program.symbols))

    def pointer(self, buffer: int, writable: bool = False) -> str:
        ctype = C_TYPES[self.program.buffers[buffer].dtype]
        const = "" if writable else "const "
        return f"    {const}{ctype} *restrict b{buffer} = ({const}{ctype} *)B[{buffer}];\n"

    def kind_of(self, number: int) -> str:
        """How the program's kernel `number` runs if it is a product (GEMM_KINDS)."""
        return self.gemm_kinds.get(number, self.default_gemm)

    @property
    def gemm_kind(self) -> str:
        return self.kind_of(self.number)

    def looped(self) -> list[int]:
        """The products that run from their reduction loop (GemmCall.loops), as it stands or as
        the depthwise convolution it computes: what packs their operands is then dead."""
        numbers = []
        for number, kernel in enumerate(self.program.kernels):
            if isinstance(kernel, GemmCall) and self.kind_of(number) in (*LOOP_FORMS, "depthwise", "depthwise-registers"):
                if kernel.loops is None:
                    raise ValueError(f"kernel {number} is a product with no loop form: it cannot run as {self.kind_of(number)!r}")
                numbers.append(number)
        return numbers

    def kernel(self, number: int, kernel: LoopKernel | GemmCall) -> str:
        self.number = number  # its parallel loop names its function, which the workers call
        head = f"static void k{number}(const int64_t *S, void **B) {{\n    (void)S;\n" + self.symbols()
        if number in self.skipped:
            return head + "    (void)B;  /* its product runs as its loop form and reads no packed operand */\n}\n"
        if isinstance(kernel, AttentionCall):
            return head + self.attention(kernel) + "}\n"
        if isinstance(kernel, GemmCall) and self.gemm_kind in LOOP_FORMS:
            return head + self.loop_form(kernel, self.gemm_kind) + "}\n"
        if isinstance(kernel, GemmCall) and (self.gemm_kind in ("transposed", "direct")) != kernel.packed_a:
            raise ValueError(
                f"kernel {number}: a product runs transposed (or direct) exactly when its weight A is packed for it "
                f"(prepack_weights' `transposed`), here kind {self.gemm_kind!r} with packed_a={kernel.packed_a}"
            )
        if isinstance(kernel, GemmCall) and self.gemm_kind == "depthwise":
            windows = depthwise_of(kernel)
            if windows is None:
                raise ValueError(f"kernel {number} is not a depthwise convolution's product: it cannot run as 'depthwise'")
            return head + self.depthwise_gemm(kernel, windows) + "}\n"
        if isinstance(kernel, GemmCall) and self.gemm_kind == "depthwise-registers":
            windows = register_planes(kernel)
            if windows is None:
                raise ValueError(
                    f"kernel {number} is not a depthwise convolution whose planes fit a register: it cannot run as 'depthwise-registers'"
                )
            return head + self.depthwise_registers(kernel, windows) + "}\n"
        if isinstance(kernel, GemmCall) and self.gemm_kind == "dequantized":
            if not widens_integer_panels(self.program, kernel):
                raise ValueError(f"kernel {number} is a product whose B widens no integer weight: it cannot run as 'dequantized'")
            return head + self.strip_gemm(kernel) + "}\n"
        if isinstance(kernel, GemmCall) and self.gemm_kind == "direct":
            geometry = direct_windows(self.program, kernel)
            if geometry is None:
                raise ValueError(f"kernel {number} is not a convolution's product by its weight: it cannot run as 'direct'")
            return head + self.direct_conv(kernel, geometry) + "}\n"
        if isinstance(kernel, GemmCall):
            if kernel.b_panels is None:
                return head + (self.transposed_gemm(kernel) if kernel.packed_a else self.gemm(kernel)) + "}\n"
            geometry = self.windows(kernel)
            return head + (self.panel_gemm(kernel) if geometry is None else self.conv_gemm(kernel, geometry)) + "}\n"
        stored = sorted(kernel_stores(kernel))
        reads = sorted(kernel_reads(kernel) - set(stored))
        body = "".join(self.pointer(b) for b in reads) + "".join(self.pointer(b, writable=True) for b in stored)
        return head + body + self.loops(kernel) + "}\n"

    def attention(self, call: AttentionCall) -> str:
        """Attention with online softmax (AttentionCall): a task per batch index and block of at
        most ATTENTION_ROWS query rows (even blocks). For each tile of ATTENTION_KEYS keys, K's rows
        staged transposed; the scores S = Q K^T by the generated product's register tile
        (lc_micro_direct) reading Q's rows in place; then per query row, a vector over
        the tile's keys, the score expression (scale, mask), the running max, the exponentials and
        their sum, and the row's accumulator rescaled; then the accumulator += P V by the same tile
        (V's rows read in place where they are whole vectors). float32, heads of at most
        ATTENTION_HEAD_MAX."""
        scores, values = call.scores, call.values
        head, width = scores.k, values.n
        if not (isinstance(head, int) and isinstance(width, int) and max(head, width) <= ATTENTION_HEAD_MAX):
            raise ValueError(f"kernel {self.number}: attention heads must be known and at most {ATTENTION_HEAD_MAX}")
        if scores.dtype != "float32" or values.dtype != "float32" or scores.b_panels or values.b_panels:
            raise ValueError(f"kernel {self.number}: fused attention reads float32 operands stored whole")
        rows, keys = ATTENTION_ROWS, ATTENTION_KEYS
        stored = kernel_stores(call)
        reads = kernel_reads(call) - stored
        lines = [self.pointer(b) for b in sorted(reads)] + [self.pointer(b, writable=True) for b in sorted(stored)]
        batch = " * ".join(f"(int64_t)({dim(d)})" for d in scores.batch) or "1"
        lines.append(f"    const int64_t m = {dim(scores.m)}, n = {dim(scores.n)}, batch = {batch};\n")
        lines.append(f"    const int64_t blocks = (m + {rows - 1}) / {rows}, span = (m + blocks - 1) / blocks;  /* even blocks */\n")
        lines.append("    if (m == 0 || batch == 0) return;\n")
        work = f"batch * m * n * {head + width}"
        lines.extend(self.parallel_for(
            [("t", "batch"), ("qb", "blocks")], f"batch * blocks > 1 && {work} >= {PARALLEL_MIN_WORK}",
            f"{work} >= lc_wake_work", grain="1",
        ))
        body = "            "
        lines.extend(self.batch_indices(scores, body))
        q_off = self.ix(self.batch_offset(scores.batch, scores.a_batch_strides))
        k_off = self.ix(self.batch_offset(scores.batch, scores.b_batch_strides))
        v_off = self.ix(self.batch_offset(values.batch, values.b_batch_strides))
        lda = f"({dim(scores.lda)})" if scores.lda is not None else (f"({dim(scores.m)})" if scores.trans_a else str(head))
        ldk = f"({dim(scores.ldb)})" if scores.ldb is not None else (str(head) if scores.trans_b else f"({dim(scores.n)})")
        ldv = f"({dim(values.ldb)})" if values.ldb is not None else (f"({dim(values.k)})" if values.trans_b else str(width))
        # Q's row i, element c at i * q_rows + c * q_columns: the tile's A, read in place
        q_rows, q_columns = ("1", lda) if scores.trans_a else (lda, "1")
        k_at = f"j * {ldk} + lc_c" if scores.trans_b else f"lc_c * {ldk} + j"  # key j's element c
        # V's rows read in place where the tile's whole vectors stay inside each row; else staged
        v_in_place = not values.trans_b and width % 16 == 0
        nb = len(scores.batch)
        variables = "".join(f"const int64_t o{j} = t{j}; " for j in range(nb)) + f"const int64_t o{nb} = i; (void)o{nb};"
        self.locals[scores.c] = "lc_s[r][jj]"
        score = self.expr(call.score)
        del self.locals[scores.c]
        # a row with no finite score: zeros where the attention asks for them, else NaN (0 / 0) as unfused
        value = "lc_sum[r] > 0.0f ? lc_acc[r][lc_c] * lc_inv : 0.0f" if call.empty_rows_zero else "lc_acc[r][lc_c] * lc_inv"
        scale = f"{call.log2_scale!r}f"
        inner = body + "        "
        lines += [
            f"{body}const int64_t i0 = qb * span, rn = m - i0 < span ? m - i0 : span;\n",
            f"{body}float lc_kt[{head}][{keys}] __attribute__((aligned(64))), lc_acc[{rows}][{width}] __attribute__((aligned(64)));\n",
            f"{body}float lc_top[{rows}] __attribute__((aligned(64))), lc_sum[{rows}] __attribute__((aligned(64)));\n",
            f"{body}float lc_s[{rows}][{keys}] __attribute__((aligned(64)));\n",
            *([] if v_in_place else [f"{body}float lc_vt[{keys}][{-(-width // 16) * 16}] __attribute__((aligned(64)));\n"]),
            # (the columns past the head that the last vector reads: zeros, as lc_kt's)
            *([] if v_in_place or width % 16 == 0 else [
                f"{body}for (int64_t jj = 0; jj < {keys}; ++jj)\n",
                f"{body}    for (int64_t lc_c = {width}; lc_c < {-(-width // 16) * 16}; ++lc_c) lc_vt[jj][lc_c] = 0.0f;\n",
            ]),
            f"{body}const float *lc_q = b{scores.a} + {q_off} + i0 * {q_rows};\n",
            f"{body}for (int64_t r = 0; r < rn; ++r) {{\n",
            f"{body}    for (int64_t lc_c = 0; lc_c < {width}; ++lc_c) lc_acc[r][lc_c] = 0.0f;\n",
            f"{body}    lc_top[r] = -INFINITY; lc_sum[r] = 0.0f;\n",
            f"{body}}}\n",
            f"{body}for (int64_t j0 = 0; j0 < n; j0 += {keys}) {{\n",
            f"{body}    const int64_t kn = n - j0 < {keys} ? n - j0 : {keys};\n",
            f"{body}    for (int64_t jj = 0; jj < kn; ++jj) {{\n",
            f"{body}        const int64_t j = j0 + jj;\n",
            f"{body}        for (int64_t lc_c = 0; lc_c < {head}; ++lc_c) lc_kt[lc_c][jj] = b{scores.b}[{k_off} + {k_at}];\n",
            f"{body}    }}\n",
            # the tile's last vector reads columns past kn: zeros, not what the stack held (a
            # denormal there costs an FMA a microcode assist on Intel: ViT's attention 8x slower)
            f"{body}    for (int64_t lc_c = 0; lc_c < {head}; ++lc_c)\n",
            f"{body}        for (int64_t jj = kn; jj < (kn + 15) / 16 * 16; ++jj) lc_kt[lc_c][jj] = 0.0f;\n",
            f"{body}    for (int64_t ir = 0; ir < rn; ir += LC_MR)\n",
            f"{body}        for (int64_t jr = 0; jr < kn; jr += LC_NR)\n",
            f"{body}            lc_micro_direct({head}, lc_q + ir * {q_rows}, {q_rows}, {q_columns}, &lc_kt[0][jr], {keys}, &lc_s[ir][jr], {keys}, 0,\n",
            f"{body}                            rn - ir < LC_MR ? rn - ir : LC_MR, kn - jr < LC_NR ? kn - jr : LC_NR);\n",
            # per query row, a vector over the tile's keys (a mask's loads are contiguous in the key):
            # the scores, their max, the exponentials and their sum
            f"{body}    for (int64_t r = 0; r < rn; ++r) {{\n",
            f"{inner}const int64_t i = i0 + r;\n",
            f"{inner}{{ {variables}\n",
            f"{inner}  #pragma omp simd\n",
            f"{inner}  for (int64_t jj = 0; jj < kn; ++jj) {{ const int64_t r0 = j0 + jj; (void)r0; lc_s[r][jj] = (float)({score}); }} }}\n",
            f"{inner}float lc_new = lc_top[r];\n",
            f"{inner}#pragma omp simd reduction(max:lc_new)\n",
            f"{inner}for (int64_t jj = 0; jj < kn; ++jj) lc_new = lc_s[r][jj] > lc_new ? lc_s[r][jj] : lc_new;\n",
            f"{inner}if (lc_new == -INFINITY) {{  /* no finite score yet: nothing to add, and the row keeps what it has */\n",
            f"{inner}    for (int64_t jj = 0; jj < kn; ++jj) lc_s[r][jj] = 0.0f;\n",
            f"{inner}    continue;\n",
            f"{inner}}}\n",
            f"{inner}const float lc_alpha = lc_top[r] == -INFINITY ? 0.0f : lc_exp2f({scale} * (lc_top[r] - lc_new));  /* (a first tile: nothing to rescale) */\n",
            f"{inner}float lc_part = 0.0f;\n",
            f"{inner}#pragma omp simd reduction(+:lc_part)\n",
            f"{inner}for (int64_t jj = 0; jj < kn; ++jj) {{ lc_s[r][jj] = lc_exp2f({scale} * (lc_s[r][jj] - lc_new)); lc_part += lc_s[r][jj]; }}\n",
            f"{inner}lc_sum[r] = lc_sum[r] * lc_alpha + lc_part;\n",
            f"{inner}lc_top[r] = lc_new;\n",
            f"{inner}if (lc_alpha != 1.0f)\n",
            f"{inner}    #pragma omp simd\n",
            f"{inner}    for (int64_t lc_c = 0; lc_c < {width}; ++lc_c) lc_acc[r][lc_c] *= lc_alpha;\n",
            f"{body}    }}\n",
        ]
        if v_in_place:
            lines.append(f"{body}    const float *lc_v = b{values.b} + {v_off} + j0 * {ldv};\n")
            v_tile, v_ld = "lc_v + jc", ldv
        else:
            v_at = f"lc_c * {ldv} + j" if values.trans_b else f"j * {ldv} + lc_c"
            lines += [
                f"{body}    for (int64_t jj = 0; jj < kn; ++jj) {{\n",
                f"{body}        const int64_t j = j0 + jj;\n",
                f"{body}        for (int64_t lc_c = 0; lc_c < {width}; ++lc_c) lc_vt[jj][lc_c] = b{values.b}[{v_off} + {v_at}];\n",
                f"{body}    }}\n",
            ]
            v_tile, v_ld = "&lc_vt[0][jc]", str(-(-width // 16) * 16)
        lines += [
            f"{body}    for (int64_t ir = 0; ir < rn; ir += LC_MR)\n",
            f"{body}        for (int64_t jc = 0; jc < {width}; jc += LC_NR)\n",
            f"{body}            lc_micro_direct(kn, &lc_s[ir][0], {keys}, 1, {v_tile}, {v_ld}, &lc_acc[ir][jc], {width}, 1,\n",
            f"{body}                            rn - ir < LC_MR ? rn - ir : LC_MR, {width} - jc < LC_NR ? {width} - jc : LC_NR);\n",
            f"{body}}}\n",
            f"{body}for (int64_t r = 0; r < rn; ++r) {{\n",
            f"{body}    const float lc_inv = 1.0f / lc_sum[r];\n",
            f"{body}    float *restrict lc_out = b{values.c} + (t * m + i0 + r) * {width};\n",
            f"{body}    #pragma omp simd\n",
            f"{body}    for (int64_t lc_c = 0; lc_c < {width}; ++lc_c) lc_out[lc_c] = {value};\n",
            f"{body}}}\n",
            "        }\n",
        ]
        return "".join(lines)

    def loop_form(self, call: GemmCall, kind: str = "loops") -> str:
        """A product as its reduction loop (GemmCall.loops), which writes C, then its epilogue over
        the whole of C. The loop runs as a window reduction (its loops around the output row),
        "loops-inside" with each element's sum inside the row's vector loop, or "loops-columns"
        with the reduced loops outside the row and the row's columns shared by the threads."""
        loops = call.loops
        assert loops is not None and loops.reduce is not None and not loops.lets
        stored = kernel_stores(call)
        reads = lets_reads(loops) | (lets_reads(call.epilogue) if call.epilogue is not None else set())
        text = "".join(self.pointer(b) for b in sorted(reads - stored)) + "".join(self.pointer(b, writable=True) for b in sorted(stored))
        # the window form runs a row a task too, where the loop is a window reduction
        windowed = kind == "loops" and len(loops.shape) >= 2 and self.window_reduction(loops)
        by_row = (kind == "loops-inside" or windowed) and self.epilogue_by_row(call)
        if kind == "loops-inside":
            text += self.sums_inside_row(loops, call if by_row else None)
        elif kind == "loops-columns":
            text += self.sums_by_columns(loops)
        else:
            text += self.loops(loops, call if by_row else None)
        if call.epilogue is not None and not by_row:
            # workers run this function too: past its loop they return, and the caller, whose last
            # lc_next waited for every task, applies the epilogue once (twice, a bias was added twice)
            text += "    if (lc_is_worker) return;\n"
            batch = " * ".join(f"(int64_t)({dim(d)})" for d in call.batch) or "1"
            text += f"    const int64_t m = {dim(call.m)}, n = {dim(call.n)}, batch = {batch};\n"
            text += "    for (int64_t t = 0; t < batch; ++t) {\n" + self.epilogue(call, ("0", "m"), ("0", "n"), "        ") + "    }\n"
        return text

    def sum_head(self, kernel: LoopKernel) -> tuple[int, Shape, str, list[str]]:
        """A sum reduction's rank, reduced extents, output C type, and its work count's lines."""
        rank = len(kernel.shape)
        kind, extents = kernel.reduce
        assert kind == "sum" and rank >= 1
        total = " * ".join(f"(int64_t)({dim(d)})" for d in (*kernel.shape, *extents))
        out_type = C_TYPES[self.program.buffers[kernel.out].dtype]
        return rank, extents, out_type, [f"    const int64_t work = {total};\n", "    (void)work;\n"]

    @staticmethod
    def epilogue_by_row(call: GemmCall) -> bool:
        """Whether a loop form's epilogue can follow each output row in its task: C is the loop's
        output, its rows of known length a block of C's: within one of C's rows (dividing them), or
        whole rows of C (a depthwise product's C is [images x channels, positions, 1])."""
        loops = call.loops
        if call.epilogue is None or loops is None or loops.out != call.c:
            return False
        row, m, n = loops.shape[-1], call.m, call.n
        if not (isinstance(row, int) and isinstance(n, int) and row > 0 and n > 0):
            return False
        return n % row == 0 or (row % n == 0 and isinstance(m, int) and (m * n) % row == 0)

    def sums_inside_row(self, kernel: LoopKernel, epilogue_of: GemmCall | None = None) -> str:
        """A sum reduction with the output's last axis as the vector loop and each element's sum
        (every reduced loop, constant trip counts unrolled by the C compiler) inside it: rows too
        short for the window form's split loops (a 7x7 window over a 4x4 image) still vectorize.
        With `epilogue_of` (epilogue_by_row), that product's epilogue runs on each row as its task
        writes it, on every thread (not once over all of C after the loop, on one)."""
        rank, extents, out_type, lines = self.sum_head(kernel)
        cost = max(1, _operations(kernel.value) + 1)
        outer = [(f"o{j}", dim(d)) for j, d in enumerate(kernel.shape[: rank - 1])]
        lines.extend(self.parallel_for(outer, f"work * {cost} >= {PARALLEL_MIN_WORK}", f"work * {cost} >= lc_wake_work"))
        indent, inner = "            ", f"o{rank - 1}"
        if not self.gathers(kernel.value):
            lines.append(f"{indent}#pragma omp simd\n")
        lines.append(f"{indent}for (int64_t {inner} = 0; {inner} < {dim(kernel.shape[-1])}; ++{inner}) {{\n")
        lines.append(f"{indent}    {out_type} acc = 0;\n")
        body = indent + "    "
        for j, d in enumerate(extents):
            lines.append(f"{body}for (int64_t r{j} = 0; r{j} < {dim(d)}; ++r{j})\n")
            body += "    "
        lines.append(f"{body}acc += ({out_type})({self.expr(kernel.value)});\n")
        lines.append(f"{indent}    {self.target(kernel)} = acc;\n{indent}}}\n")
        if epilogue_of is not None:
            lines.append(self.row_epilogue(epilogue_of, kernel, indent))
        return "".join(lines) + "        }\n"

    def row_epilogue(self, call: GemmCall, kernel: LoopKernel, indent: str) -> str:
        """`call`'s epilogue over the output row its loop form's task (o0.. but the last) has just
        written (epilogue_by_row: the row is a piece of one of C's rows, or whole rows of C)."""
        rank, row = len(kernel.shape), dim(kernel.shape[-1])
        start = self.ix(linear([Ix.var(f"o{j}") for j in range(rank - 1)], kernel.shape[: rank - 1]))
        text = f"{indent}{{\n{indent}    const int64_t m = {dim(call.m)}, n = {dim(call.n)};\n"
        text += f"{indent}    const int64_t lc_flat = ({start}) * {row}, t = lc_flat / (m * n), lc_row = lc_flat % (m * n) / n, lc_col = lc_flat % n;\n"
        if call.n % kernel.shape[-1] == 0:  # a piece of one of C's rows
            block = (("lc_row", "lc_row + 1"), ("lc_col", f"lc_col + {row}"))
        else:  # whole rows of C
            block = (("lc_row", f"lc_row + {kernel.shape[-1] // call.n}"), ("0", "n"))
        return text + self.epilogue(call, *block, indent + "    ") + f"{indent}}}\n"

    def sums_by_columns(self, kernel: LoopKernel) -> str:
        """A sum reduction whose reduced loops run outside the output's row, which accumulates in
        place and vectorizes, the row split into blocks of columns (a thread's share, within
        COLUMN_BLOCK_MIN..MAX): a product of a few rows by a row-major B (a decoding step's dense
        layers, int8 weights widened as they are read) streams B's rows contiguously, each thread
        its own columns. Where the summed value is a row factor times a column factor (A[m, k] *
        B[k, n]), a task is a block of columns for every row: B's piece of each summed row is
        computed once into a local and multiplies every output row, so an int8 weight is widened
        once per call whatever the row count; otherwise a task is a block of one output row."""
        rank, extents, out_type, lines = self.sum_head(kernel)
        lines.append(f"    const int64_t lc_width = {dim(kernel.shape[-1])};\n")
        lines.append("    int64_t lc_cols = (lc_width + lc_threads - 1) / lc_threads;\n")
        lines.append(f"    if (lc_cols > {COLUMN_BLOCK_MAX}) lc_cols = {COLUMN_BLOCK_MAX};\n")
        lines.append(f"    lc_cols = lc_cols < {COLUMN_BLOCK_MIN} ? {COLUMN_BLOCK_MIN} : (lc_cols + 15) / 16 * 16;\n")
        lines.append("    const int64_t lc_blocks = (lc_width + lc_cols - 1) / lc_cols;\n")
        cost = max(1, _operations(kernel.value) + 1)
        rows = [(f"o{j}", dim(d)) for j, d in enumerate(kernel.shape[: rank - 1])]
        factors = self.row_and_column_factors(kernel)
        # blocks outermost: a thread's consecutive tasks are rows of one block, which stays in cache
        tasks = [("lc_block", "lc_blocks")] + ([] if factors is not None else rows)
        lines.extend(self.parallel_for(tasks, f"work * {cost} >= {PARALLEL_MIN_WORK}", f"work * {cost} >= lc_wake_work"))
        indent, inner = "            ", f"o{rank - 1}"
        target = self.target(kernel)
        lines.append(f"{indent}const int64_t lc_c0 = lc_block * lc_cols, lc_c1 = lc_c0 + lc_cols < lc_width ? lc_c0 + lc_cols : lc_width;\n")
        if factors is None:
            lines.append(f"{indent}for (int64_t {inner} = lc_c0; {inner} < lc_c1; ++{inner}) {target} = ({out_type})0;\n")
            body = indent
            for j, d in enumerate(extents):
                lines.append(f"{body}for (int64_t r{j} = 0; r{j} < {dim(d)}; ++r{j})\n")
                body += "    "
            lines.append(self.row(kernel, body, lambda value: f"{target} += ({out_type})({value});", "lc_c0", "lc_c1"))
            return "".join(lines) + "        }\n"
        row_factor, column_factor = factors
        lines.append(self.factored_columns(kernel, rows, extents, row_factor, column_factor, out_type, indent))
        return "".join(lines) + "        }\n"

    def factored_columns(
        self, kernel: LoopKernel, rows: list[tuple[str, str]], extents, row_factor: Expr, column_factor: Expr,
        out_type: str, indent: str,
    ) -> str:
        """loops-columns' task when the summed value is A[row, k] * B[k, column]: the rows in
        groups of LC_QR (the last few one at a time), each group's columns [lc_c0, lc_c1) in
        register tiles of LC_QW columns (group x LC_QW accumulators; B's piece of a summed row
        computed once into a local and multiplied by each of the group's rows: twice the speed of
        accumulating in C's row, measured), the columns left over accumulated in C's rows."""
        rank = len(kernel.shape)
        inner = f"o{rank - 1}"
        target = self.target(kernel)
        count = " * ".join(f"(int64_t)({extent})" for _, extent in rows) or "1"
        lines = [f"{indent}const int64_t lc_rows = {count};\n"]
        lines.append(f"{indent}for (int64_t lc_g = 0, lc_rn = 0; lc_g < lc_rows; lc_g += lc_rn) {{\n")
        at = indent + "    "
        lines.append(f"{at}lc_rn = lc_rows - lc_g >= LC_QR ? LC_QR : 1;\n")
        # each of the group's rows as its output loops' values, worked out once per group
        for name, _ in rows:
            lines.append(f"{at}int64_t lc_{name}[LC_QR];\n")
        lines.append(f"{at}for (int64_t lc_i = 0; lc_i < lc_rn; ++lc_i) {{\n{at}    int64_t lc_left = lc_g + lc_i; (void)lc_left;\n")
        for depth, (name, extent) in enumerate(reversed(rows)):
            if depth == len(rows) - 1:
                lines.append(f"{at}    lc_{name}[lc_i] = lc_left;\n")
            else:
                lines.append(f"{at}    lc_{name}[lc_i] = lc_left % ({extent}); lc_left /= ({extent});\n")
        lines.append(f"{at}}}\n")
        unpack = "".join(f"const int64_t {name} = lc_{name}[lc_i]; " for name, _ in rows)

        def reduced(pad: str) -> tuple[str, str]:
            text = ""
            for j, d in enumerate(extents):
                text += f"{pad}for (int64_t r{j} = 0; r{j} < {dim(d)}; ++r{j}) {{\n"
                pad += "    "
            return text, pad

        def closed(pad: str) -> str:
            return "".join(f"{pad}{'    ' * j}}}\n" for j in reversed(range(len(extents))))

        lines.append(f"{at}int64_t lc_lo = lc_c0;\n")

        def tiles(height: str, pad: str) -> str:
            text = f"{pad}for (; lc_lo + LC_QW <= lc_c1; lc_lo += LC_QW) {{\n"
            tile = pad + "    "
            text += f"{tile}{out_type} lc_acc[{height}][LC_QW];\n"
            text += f"{tile}for (int lc_i = 0; lc_i < {height}; ++lc_i) for (int lc_j = 0; lc_j < LC_QW; ++lc_j) lc_acc[lc_i][lc_j] = 0;\n"
            head, body = reduced(tile)
            text += head + f"{body}{out_type} lc_piece[LC_QW];\n"
            text += (f"{body}#pragma omp simd\n{body}for (int lc_j = 0; lc_j < LC_QW; ++lc_j) {{ const int64_t {inner} = lc_lo + lc_j; "
                     f"lc_piece[lc_j] = ({out_type})({self.expr(column_factor)}); }}\n")
            text += f"{body}for (int lc_i = 0; lc_i < {height}; ++lc_i) {{\n"
            text += f"{body}    {unpack}const {out_type} lc_a = ({out_type})({self.expr(row_factor)});\n"
            text += (f"{body}    #pragma omp simd\n{body}    for (int lc_j = 0; lc_j < LC_QW; ++lc_j) "
                     f"lc_acc[lc_i][lc_j] += lc_a * lc_piece[lc_j];\n{body}}}\n")
            text += closed(tile)
            text += f"{tile}for (int lc_i = 0; lc_i < {height}; ++lc_i) {{\n{tile}    {unpack}\n"
            text += (f"{tile}    for (int lc_j = 0; lc_j < LC_QW; ++lc_j) {{ const int64_t {inner} = lc_lo + lc_j; "
                     f"{target} = lc_acc[lc_i][lc_j]; }}\n{tile}}}\n")
            return text + f"{pad}}}\n"

        # a full group in LC_QR-row tiles; the last rows one at a time, each in one-row tiles
        lines.append(f"{at}if (lc_rn == LC_QR) {{\n" + tiles("LC_QR", at + "    ") + f"{at}}} else {{\n" + tiles("1", at + "    ") + f"{at}}}\n")
        # the rest: columns [lc_lo, lc_c1) of the group's rows, accumulated in place
        lines.append(f"{at}if (lc_lo < lc_c1) {{\n")
        rest = at + "    "
        lines.append(f"{rest}for (int64_t lc_i = 0; lc_i < lc_rn; ++lc_i) {{ {unpack}for (int64_t {inner} = lc_lo; {inner} < lc_c1; ++{inner}) {target} = ({out_type})0; }}\n")
        head, pad = reduced(rest)
        lines.append(head)
        lines.append(f"{pad}{out_type} lc_column[{COLUMN_BLOCK_MAX}];\n")
        lines.append(f"{pad}#pragma omp simd\n{pad}for (int64_t {inner} = lc_lo; {inner} < lc_c1; ++{inner}) "
                     f"lc_column[{inner} - lc_lo] = ({out_type})({self.expr(column_factor)});\n")
        lines.append(f"{pad}for (int64_t lc_i = 0; lc_i < lc_rn; ++lc_i) {{\n")
        lines.append(f"{pad}    {unpack}const {out_type} lc_a = ({out_type})({self.expr(row_factor)});\n")
        lines.append(f"{pad}    #pragma omp simd\n{pad}    for (int64_t {inner} = lc_lo; {inner} < lc_c1; ++{inner}) "
                     f"{target} += lc_a * lc_column[{inner} - lc_lo];\n{pad}}}\n")
        lines.append(closed(rest))
        lines.append(f"{at}}}\n{indent}}}\n")
        return "".join(lines)

    def row_and_column_factors(self, kernel: LoopKernel) -> tuple[Expr, Expr] | None:
        """(f, g) where a product's summed value is f * g, f reading no column variable (the last
        output loop) and g no other output loop: A[m, k] and B[k, n]; None otherwise, or where
        either reads through a gathered index or padding (which the plain loop checks)."""
        value = kernel.value
        if not isinstance(value, Apply) or value.op != "mul" or kernel.lets or self.gathers(value):
            return None
        if any(isinstance(e, Guarded) for e in walk(value)):
            return None
        rank = len(kernel.shape)
        column, rows = f"o{rank - 1}", {f"o{j}" for j in range(rank - 1)}
        for f, g in (value.args, value.args[::-1]):
            if column not in expr_variables(f) and not (expr_variables(g) & rows):
                return f, g
        return None

    def loops(self, kernel: LoopKernel, epilogue_of: GemmCall | None = None) -> str:
        """The output loops, the outer ones shared among threads. The innermost output loop stays
        out of the parallel collapse so that it is a plain counted loop the C compiler vectorizes:
        for elementwise kernels, and for reductions over a small window (pooling), which run the
        window's loops outside it and accumulate into the output row. Padding guards that depend
        on that loop split it in three: the middle part, where every guard holds, reads without
        checks (a row that lies in the padding runs whole in the checked part). `epilogue_of`: a
        window reduction that is that product's loop form applies its epilogue to each row."""
        rank = len(kernel.shape)
        window = rank >= 2 and self.window_reduction(kernel)
        # a reduction's reads count as work: a 3x3 pool reads 9 elements per output
        sizes = (*kernel.shape, *kernel.reduce[1]) if kernel.reduce is not None else kernel.shape
        total = " * ".join(f"(int64_t)({dim(d)})" for d in sizes) or "1"
        lines = [f"    const int64_t work = {total};\n", "    (void)work;\n"]
        across = rank >= 2 and (kernel.reduce is None or window)
        parallel = rank - 1 if across else rank
        if not parallel:
            return "".join(lines) + self.body(kernel, "    ")
        cost = max(1, sum(_operations(v) for v in kernel.values) + (kernel.reduce is not None))
        # a flat elementwise loop is both the threads' loop and the vector loop
        simd = rank == 1 and kernel.reduce is None and not self.kernel_gathers(kernel)
        outer = [(f"o{j}", dim(d)) for j, d in enumerate(kernel.shape[:parallel])]
        lines.extend(self.parallel_for(outer, f"work * {cost} >= {PARALLEL_MIN_WORK}", f"work * {cost} >= lc_wake_work", simd=simd))
        indent, close = "            ", "        }\n"
        if not across:
            return "".join(lines) + self.body(kernel, indent) + close
        if not window:
            return "".join(lines) + self.row(kernel, indent, self.elementwise_store(kernel)) + close
        pooling = self.pooling(kernel) if epilogue_of is None else None
        if pooling is not None:
            return "".join(lines) + self.pool_row(kernel, pooling, indent) + close
        kind, extents = kernel.reduce
        out_type = C_TYPES[self.program.buffers[kernel.out].dtype]
        inner = f"o{rank - 1}"
        lines.append(f"{indent}for (int64_t {inner} = 0; {inner} < {dim(kernel.shape[-1])}; ++{inner})\n")
        init = "0" if kind == "sum" else _MAX_INIT[self.program.buffers[kernel.out].dtype]
        lines.append(f"{indent}    {self.target(kernel)} = ({out_type})({init});\n")
        body = indent
        for j, d in enumerate(extents):
            lines.append(f"{body}for (int64_t r{j} = 0; r{j} < {dim(d)}; ++r{j})\n")
            body += "    "

        def accumulate(value: str) -> str:
            target = self.target(kernel)
            if kind == "sum":
                return f"{target} += ({out_type})({value});"
            return f"{target} = LC_MAX({target}, ({out_type})({value}));"

        lines.append(self.row(kernel, body, accumulate))
        if epilogue_of is not None:
            lines.append(self.row_epilogue(epilogue_of, kernel, indent))
        return "".join(lines) + close

    def pooling(self, kernel: LoopKernel) -> PoolingWindows | None:
        """The 2-D pooling a float32 window reduction computes, where lc_pool_row renders its rows:
        where a row's reads are strided or checked at the padding. In place, a contiguous unpadded
        window ran faster (a 7x7 average at stride 1 over 14x14: 2.05x the time staged), as did a
        single output column or windows that do not overlap along the row (a global pool: 1.1-1.2x);
        a 3x3/2 max pool took 0.39-0.59x the time staged."""
        if len(kernel.shape) < 2 or not self.window_reduction(kernel) or self.program.buffers[kernel.out].dtype != "float32":
            return None
        windows = pooling_windows(kernel)
        if windows is None:
            return None
        y, x = windows.axes
        padded = any(a.pad > 0 or (a.out - 1) * a.step + (a.kernel - 1) * a.dilation + 1 > a.size + a.pad for a in (y, x))
        overlapping = (x.kernel - 1) * x.dilation + 1 > x.step  # (a global pool's rows read as windows do not)
        return windows if x.out > 1 and overlapping and (x.step > 1 or padded) else None

    def pool_row(self, kernel: LoopKernel, windows: PoolingWindows, indent: str) -> str:
        """A pooling's task: one output row by lc_pool_row (its planes' and row's loop variables set)."""
        inner = f"o{len(kernel.shape) - 1}"
        numbers = [n for axis in windows.axes for n in (axis.kernel, axis.dilation, axis.step, axis.pad, axis.size, axis.stride, axis.out)]
        return (
            f"{indent}{{\n{indent}    static const int64_t g[] = {{{', '.join(map(str, numbers))}}};\n"
            f"{indent}    const int64_t {inner} = 0;\n"
            f"{indent}    lc_pool_row({int(windows.kind == 'max')}, b{windows.source} + ({self.ix(windows.base)}), g, "
            f"{literal(windows.fill, 'float32')}, o{len(kernel.shape) - 2}, &{self.target(kernel)});\n{indent}}}\n"
        )

    def target(self, kernel: LoopKernel) -> str:
        return f"b{kernel.out}[{self.out_index(kernel)}]"

    def out_index(self, kernel: LoopKernel) -> str:
        """The element the loop's variables name in its output (and in its lets' buffers)."""
        return self.ix(linear([Ix.var(f"o{j}") for j in range(len(kernel.shape))], kernel.shape))

    def with_lets(self, lets, index: str, value: Expr, statement) -> str:
        """`statement(value)` after the lets as locals, each stored at `index` where it is kept."""
        if not lets:
            return statement(self.expr(value))
        parts = []
        for let in lets:
            ctype = self.value_type(let.buffer)
            parts.append(f"const {ctype} lc_v{let.buffer} = ({ctype})({self.expr(let.value)});")
            if let.store:
                parts.append(f"b{let.buffer}[{index}] = {self.stored(let.buffer, f'lc_v{let.buffer}')};")
            self.locals[let.buffer] = f"lc_v{let.buffer}"
        parts.append(statement(self.expr(value)))
        for let in lets:
            del self.locals[let.buffer]
        return "{ " + " ".join(parts) + " }"

    def kernel_gathers(self, kernel: LoopKernel) -> bool:
        return any(self.gathers(v) for v in kernel.values)

    def elementwise_store(self, kernel: LoopKernel):
        return lambda value: f"{self.target(kernel)} = {self.stored(kernel.out, value)};"

    def value_type(self, buffer: int) -> str:
        """The C type a value of `buffer` is computed in (a local, an accumulator)."""
        return C_TYPES[self.program.buffers[buffer].dtype]

    def stored(self, buffer: int, value: str) -> str:
        """`value`, computed in value_type, as `buffer` stores it."""
        return f"({self.value_type(buffer)})({value})"

    def loaded(self, buffer: int, element: str) -> str:
        """An element read from `buffer`, as a value of its value_type."""
        return element

    def window_reduction(self, kernel: LoopKernel) -> bool:
        """A float sum or max over a small window of constant extents (pooling): its loops run
        outside the loop over the output row, which then vectorizes (strided reads included)."""
        if kernel.reduce is None or self.gathers(kernel.value):
            return False
        if self.program.buffers[kernel.out].dtype not in ("float32", "float64"):
            return False
        extents = kernel.reduce[1]
        return all(isinstance(d, int) for d in extents) and math.prod(extents) <= WINDOW_MAX

    def row(self, kernel: LoopKernel, indent: str, statement, start: str = "0", stop: str | None = None) -> str:
        """The innermost output loop (from start to stop, its whole extent by default) around
        `statement(value)`, split by its padding guards."""
        invariant = self.row_invariant_guards(kernel, f"o{len(kernel.shape) - 1}")
        if invariant:
            return self.rows_by_guard(kernel, indent, statement, start, stop, invariant)
        return self.split_row(kernel, indent, statement, start, stop)

    def split_row(self, kernel: LoopKernel, indent: str, statement, start: str = "0", stop: str | None = None) -> str:
        """The innermost output loop split by the padding guards that depend on it (guard_split),
        after the gathered indices that hold for the whole row, computed once (a paged cache's slot
        of a key: the row of 64 values it picks is then a contiguous read that vectorizes)."""
        inner = f"o{len(kernel.shape) - 1}"
        hoistable, remaining = self.row_gathers(kernel, {inner})
        if not hoistable:
            return self.unhoisted_row(kernel, indent, statement, start, stop, vector=not remaining)
        outside = self.hoisted
        lines = [f"{indent}{{\n", *self.hoist(hoistable, indent + "    ")]
        lines.append(self.unhoisted_row(kernel, indent + "    ", statement, start, stop, vector=not remaining))
        lines.append(f"{indent}}}\n")
        self.hoisted = outside
        return "".join(lines)

    def hoist(self, atoms: list[Atom], indent: str) -> list[str]:
        """Declarations of gathered indices computed once, which the expressions rendered next
        read as locals (the caller restores self.hoisted after them)."""
        self.hoisted = dict(self.hoisted)
        lines = []
        for atom in atoms:
            name = f"lc_g{len(self.hoisted)}"
            lines.append(f"{indent}const int64_t {name} = {self.ix_atom(atom)};\n")
            self.hoisted[atom] = name
        return lines

    def row_gathers(self, kernel: LoopKernel, inner: set[str]) -> tuple[list[Atom], bool]:
        """(the gathered indices of the row that read none of the loops `inner` and lie under no
        guard left to check per element, whether other gathered indices remain in it). Under a
        guard C reads only the branch taken, so an index there is not read ahead of its check;
        under a guard known to fail nothing is read at all."""
        hoistable: list[Atom] = []
        remaining = False
        written = kernel_stores(kernel)

        def visit(e, checked: bool) -> None:
            nonlocal remaining
            if isinstance(e, Guarded):
                if not any(guard in self.known_false for guard in e.guards):
                    visit(e.value, checked or any(guard not in self.known for guard in e.guards))
            elif isinstance(e, Apply):
                for arg in e.args:
                    visit(arg, checked)
            elif isinstance(e, (Load, IndexValue)):
                visit(e.index, checked)
            elif isinstance(e, Ix):
                for var, _ in e.terms:
                    if isinstance(var, Atom):
                        visit(var, checked)
            elif isinstance(e, Atom):
                if e.op == "value" and (e in hoistable or e in self.hoisted):
                    return
                if e.op == "value" and not checked and _reads_only_outside(e.args[0], inner, written):
                    hoistable.append(e)
                    return
                remaining |= e.op == "value"
                for arg in e.args:
                    if isinstance(arg, (Ix, Load, Guarded, Apply, IndexValue, Atom)):
                        visit(arg, checked)

        for value in kernel.values:
            visit(value, False)
        return hoistable, remaining

    def unhoisted_row(
        self, kernel: LoopKernel, indent: str, statement, start: str, stop: str | None, vector: bool
    ) -> str:
        rank = len(kernel.shape)
        inner, extent = f"o{rank - 1}", stop or dim(kernel.shape[-1])
        # without it GCC unrolls a short row (12 wide) completely and then vectorizes nothing;
        # every element is independent (the written buffer is read only at its own element)
        simd = "#pragma omp simd\n" if vector else ""
        split = self.guard_split(kernel, inner)
        if split is None:
            return self.let_rows(kernel.lets, kernel.value, inner, (start, extent), self.out_index(kernel), statement, indent, simd)
        bounds, known = split
        lines = [f"{indent}{{\n"]
        lines.extend(f"{indent}    {line}\n" for line in bounds(start, extent))
        edge = self.with_lets(kernel.lets, self.out_index(kernel), kernel.value, statement)
        outside = self.known
        self.known = outside | known
        middle = self.with_lets(kernel.lets, self.out_index(kernel), kernel.value, statement)
        self.known = outside
        for lo, hi, text in ((start, "lc_lo", edge), ("lc_lo", "lc_hi", middle), ("lc_hi", extent, edge)):
            if simd:
                lines.append(f"{indent}    {simd}")
            lines.append(f"{indent}    for (int64_t {inner} = {lo}; {inner} < {hi}; ++{inner})\n")
            lines.append(f"{indent}        {text}\n")
        lines.append(f"{indent}}}\n")
        return "".join(lines)

    def row_invariant_guards(self, kernel: LoopKernel, inner: str) -> list[tuple[Ix, Dim]]:
        """The padding guards not yet resolved whose index does not depend on the row's loop
        `inner` (a concatenation along an outer axis, a repeat's parity): each holds or fails for
        the whole row."""
        every = {(g, n) for v in kernel.values for e in walk(v) if isinstance(e, Guarded) for g, n in e.guards}
        resolved = self.known | self.known_false
        found = [(g, n) for g, n in every if (g, n) not in resolved and _independent_of(g, inner)]
        return sorted(found, key=repr)[:ROW_CASES_MAX]

    def rows_by_guard(
        self, kernel: LoopKernel, indent: str, statement, start: str, stop: str | None, guards: list[tuple[Ix, Dim]]
    ) -> str:
        """The row once per guard that may hold for it, chosen by testing the guards in turn, and
        once where none does (index-set splitting at the boundaries of a concatenation's parts):
        in each version the guard taken holds, the ones tested before it and those provably
        disjoint from it fail, so the parts of a concatenation are plain copies the C compiler
        vectorizes instead of a sum of checked reads per element."""
        outside_known, outside_false = self.known, self.known_false
        lines = []
        for position, (g, n) in enumerate(guards):
            failed = set(guards[:position]) | {other for other in guards if _disjoint((g, n), other)}
            self.known, self.known_false = outside_known | {(g, n)}, outside_false | failed
            keyword = "if" if position == 0 else "} else if"
            lines.append(f"{indent}{keyword} ({self.checks([(g, n)])}) {{\n")
            lines.append(self.split_row(kernel, indent + "    ", statement, start, stop))
        self.known, self.known_false = outside_known, outside_false | set(guards)
        lines.append(f"{indent}}} else {{\n")
        lines.append(self.split_row(kernel, indent + "    ", statement, start, stop))
        lines.append(f"{indent}}}\n")
        self.known, self.known_false = outside_known, outside_false
        return "".join(lines)

    def guard_split(self, kernel: LoopKernel, inner: str):
        """(bounds, guards) when padding guards `0 <= a*inner + rest < n` (a > 0) depend on the
        innermost loop `inner`: `bounds(start, stop)` declares lc_lo and lc_hi, between which
        every such guard holds; None when there is none. Guards on the loops outside alone are checked
        once for the whole range."""
        resolved = self.known | self.known_false
        every = {
            (g, n) for v in kernel.values for e in walk(v) if isinstance(e, Guarded) for g, n in e.guards
        } - resolved
        guards = {(g, n) for g, n in every if any(v == inner for v, _ in g.terms)}
        steady = sorted(
            ((g, n) for g, n in every if all(isinstance(v, str) and v != inner for v, _ in g.terms)),
            key=repr,
        )
        lows, highs = [], []
        for g, n in sorted(guards, key=repr):
            coefs = dict(g.terms)
            step = coefs.pop(inner)
            if not isinstance(step, int) or step <= 0 or not all(isinstance(v, str) for v in coefs):
                return None
            # 0 <= step*inner + rest < n  <=>  ceil(-rest/step) <= inner < floor((n-1-rest)/step) + 1
            rest = f"({self.ix(Ix(tuple(coefs.items()), g.const))})"
            if step == 1:
                lows.append(f"-{rest}")
                highs.append(f"{dim(n)} - {rest}")
            else:
                lows.append(f"-lc_fdiv({rest}, {step}LL)")
                highs.append(f"lc_fdiv({dim(n)} - 1 - {rest}, {step}LL) + 1")
        if not lows:
            return None

        def bounds(start: str, extent: str) -> list[str]:
            lines = [f"int64_t lc_lo = {start}, lc_hi = {extent};"]
            lines += [f"{{ const int64_t v = {low}; if (v > lc_lo) lc_lo = v; }}" for low in lows]
            lines += [f"{{ const int64_t v = {high}; if (v < lc_hi) lc_hi = v; }}" for high in highs]
            lines += [f"if (lc_lo > {extent}) lc_lo = {extent};", "if (lc_hi < lc_lo) lc_hi = lc_lo;"]
            if steady:  # a row in the padding runs whole in the checked loop
                lines.append(f"if (!({self.checks(steady)})) lc_lo = lc_hi = {extent};")
            return lines

        return bounds, frozenset(guards) | frozenset(steady)

    def body(self, kernel: LoopKernel, indent: str) -> str:
        """One output element: its store, or its accumulator, reduced loops and store."""
        out_type = C_TYPES[self.program.buffers[kernel.out].dtype]
        lines = [f"{indent}{{\n"]
        inner = indent + "    "
        target = self.target(kernel)
        if kernel.reduce is None:
            store = lambda value: f"{target} = ({out_type})({value});"
            lines.append(f"{inner}{self.with_lets(kernel.lets, self.out_index(kernel), kernel.value, store)}\n")
        else:
            kind, extents = kernel.reduce
            dtype = self.program.buffers[kernel.out].dtype
            acc_type = "double" if dtype in ("float32", "float64") and kind == "sum" else out_type
            if kind == "sum" and dtype not in ("float32", "float64"):
                acc_type = "int64_t"  # a bool sum (any) counts, then tests the count
            init = "0" if kind == "sum" else _MAX_INIT.get(dtype, "0")
            floating = dtype in ("float32", "float64")
            # a gathered index that holds for the whole reduction (a row of an embedding) is read once
            hoistable, remaining = self.row_gathers(kernel, {f"r{j}" for j in range(len(extents))})
            outside = self.hoisted
            lines.extend(self.hoist(hoistable, inner))
            lines.append(f"{inner}{acc_type} acc = {init};\n")
            if kind == "max" and floating:
                lines.append(f"{inner}int lc_nan = 0;\n")
            body = inner
            # the innermost reduced loop may add (or compare) in any order: it vectorizes
            clause = "reduction(+:acc)" if kind == "sum" else ("reduction(max:acc) reduction(|:lc_nan)" if floating else "reduction(max:acc)")
            for j, d in enumerate(extents):
                if j == len(extents) - 1 and not remaining:
                    lines.append(f"{body}#pragma omp simd {clause}\n")
                lines.append(f"{body}for (int64_t r{j} = 0; r{j} < {dim(d)}; ++r{j})\n")
                body += "    "
            value = self.expr(kernel.value)
            if kind == "sum":
                lines.append(f"{body}acc += ({acc_type})({value});\n")
            elif floating:
                lines.append(f"{body}{{ const {out_type} v = {value}; acc = v > acc ? v : acc; lc_nan |= v != v; }}\n")
                lines.append(f"{inner}if (lc_nan) acc = NAN;\n")
            else:
                lines.append(f"{body}{{ const {out_type} v = {value}; acc = v > acc ? v : acc; }}\n")
            lines.append(f"{inner}{target} = ({out_type})({'acc != 0' if dtype == 'bool' else 'acc'});\n")
            self.hoisted = outside
        lines.append(f"{indent}}}\n")
        return "".join(lines)

    def panel_gemm(self, call: GemmCall) -> str:
        """A product whose B is computed a block of its leading n axis at a time (Panels): each
        thread fills its own scratch panel of about PANEL_BYTES, which stays in cache, and
        multiplies it at once; blocks and batch indices are shared among threads."""
        panels = call.b_panels
        producer = panels.kernel
        ctype = C_TYPES[call.dtype]
        shape = producer.shape
        first = len(panels.batch_axes) + panels.k_axes  # the leading n axis: the one split in blocks
        lines = self.gemm_head(call, expr_reads(producer.value) | {call.a})
        rest = " * ".join(f"(int64_t)({dim(d)})" for d in shape[first + 1:]) or "1"
        lines.append(f"    const int64_t lc_lead = {dim(shape[first])}, lc_rest = {rest};\n")
        lines.append("    const int threads = lc_threads;\n")
        lines.append(f"    int64_t rows = {PANEL_BYTES} / ((int64_t)sizeof({ctype}) * k * lc_rest);\n")
        # a product of a few columns runs far below the library's speed and packs A again per call
        lines.append(f"    const int64_t least = ({PANEL_MIN_COLUMNS} + lc_rest - 1) / lc_rest;\n")
        lines.append("    if (rows < least) rows = least;\n")
        # enough blocks for every thread, where they stay wide enough
        lines.append("    const int64_t share = (batch * lc_lead + threads - 1) / threads;\n")
        lines.append("    if (rows > share) rows = share > least ? share : least;\n")
        lines.append("    if (rows > lc_lead) rows = lc_lead;\n")
        lines.append("    if (rows < 1) rows = 1;\n")
        lines.append("    const int64_t blocks = (lc_lead + rows - 1) / rows;\n")
        lines.append("    rows = (lc_lead + blocks - 1) / blocks;  /* blocks of equal width */\n")
        # too few blocks for the threads (the last layers' small images): they split m as well,
        # each filling the panel it multiplies
        lines.append("    const int64_t parts = batch * blocks < threads && m >= 32 ? threads : 1;\n")
        lines.append("    const int64_t m_span = (m + parts - 1) / parts;\n" if not call.packed_a else
                     "    const int64_t m_span = ((m + parts - 1) / parts + LC_PW - 1) / LC_PW * LC_PW;\n")
        lines.extend(self.tasks(("t", "block", "part")))
        body = "            "
        lines.extend(self.batch_indices(call, body))
        a_off = self.batch_offset(call.batch, call.a_batch_strides)
        lines.append(f"{body}const int64_t lo = block * rows, hi = lo + rows < lc_lead ? lo + rows : lc_lead, nc = (hi - lo) * lc_rest;\n")
        lines.append(f"{body}{ctype} *restrict panel = ({ctype} *)lc_scratch((int64_t)sizeof({ctype}) * k * nc);\n")
        lines.append(f"{body}if (!panel) continue;\n")
        for j, axis in enumerate(panels.batch_axes):
            lines.append(f"{body}const int64_t o{j} = t{axis};\n")
        rank = len(shape)
        k_index = self.ix(linear([Ix.var(f"o{j}") for j in range(len(panels.batch_axes), first)], shape[len(panels.batch_axes):first]))
        n_index = self.ix(linear([Ix.var(f"o{j}") for j in range(first + 1, rank)], shape[first + 1:]))
        target = f"panel[({k_index}) * nc + (o{first} - lo) * lc_rest + {n_index}]"
        loops = body
        for j in range(len(panels.batch_axes), rank - 1):
            start, stop = ("lo", "hi") if j == first else ("0", dim(shape[j]))
            lines.append(f"{loops}for (int64_t o{j} = {start}; o{j} < {stop}; ++o{j})\n")
            loops += "    "
        start, stop = ("lo", "hi") if first == rank - 1 else ("0", None)
        lines.append(self.row(producer, loops, lambda value: f"{target} = ({ctype})({value});", start, stop))
        lda = self.lda(call)
        a_rows, a_cols = ("1", lda) if call.trans_a else (lda, "1")  # A's (row, column) strides
        lines.append(f"{body}const int64_t m_lo = part * m_span, rows_m = m_lo + m_span < m ? m_span : m - m_lo;\n")
        lines.append(f"{body}if (rows_m <= 0) continue;\n")
        lines.append(f"{body}const {ctype} *a = b{call.a} + ({self.ix(a_off)}) + m_lo * {a_rows};\n")
        lines.append(f"{body}{ctype} *c = b{call.c} + t * m * n + m_lo * n + lo * lc_rest;\n")
        direct = f"lc_sgemm_direct(rows_m, nc, k, a, {a_rows}, {a_cols}, panel, nc, c, n);"
        prefix = "s" if call.dtype == "float32" else "d"
        library = (
            f"scipy_cblas_{prefix}gemm(101, {112 if call.trans_a else 111}, 111, (int)rows_m, (int)nc, (int)k, 1, a, "
            f"(int){lda}, panel, (int)nc, 0, c, (int)n);"
        )
        if call.packed_a:  # A^T's panels, shared by the batch: C's block [m_lo, +rows_m) x [lo * lc_rest, +nc)
            lines.append(
                f"{body}lc_sgemm_t(k, panel, nc, 1, b{call.a}, {padded_columns(call.m)}, m_lo, m_lo + rows_m, 0, nc, "
                f"b{call.c} + t * m * n + lo * lc_rest, n);\n"
            )
        elif self.gemm_kind in ("tiled", "panels") and call.dtype == "float32":
            lines.append(f"{body}{direct}\n")
        elif self.gemm_kind == "mixed" and call.dtype == "float32":
            # the generated product reads A in place: a narrow panel's library call packs A again
            # each time; a large A, read once per 16 columns, stays with the library
            lines.append(f"{body}if (rows_m * k <= {DIRECT_A_MAX_ELEMENTS}) {direct}\n")
            lines.append(f"{body}else {library}\n")
        else:
            lines.append(f"{body}{library}\n")
        lines.append(self.epilogue(call, ("m_lo", "m_lo + rows_m"), ("lo * lc_rest", "hi * lc_rest"), body))
        lines.append("        }\n")
        return "".join(lines)

    def strip_gemm(self, call: GemmCall) -> str:
        """A product whose B is an integer weight widened by its Panels kernel ("dequantized"): a
        task is a block of at most DEQUANTIZED_COLUMNS of C's columns for every row; LC_KC rows of
        B at a time, the block is widened into the thread's scratch as strips of LC_NR columns, the
        layout the register tile reads (each of B's rows read as one run of the block's width: a
        strip's row alone, a run of LC_NR, measured 10-25% slower), and each strip multiplied by all
        of A's rows (lc_strip_product), so each weight is widened once per call however many rows A
        has (loops-columns widens it once per LC_QR rows)."""
        panels = call.b_panels
        producer = panels.kernel
        shape = producer.shape
        rank = len(shape)
        first = len(panels.batch_axes)  # the k axes: o{first} .. o{rank - 2}; the n axis: o{rank - 1}
        column = f"o{rank - 1}"
        lines = self.gemm_head(call, expr_reads(producer.value) | {call.a})
        lines.append("    const int64_t strips = (n + LC_NR - 1) / LC_NR;\n")
        lines.append("    int64_t per_task = (strips + lc_threads - 1) / lc_threads;\n")
        lines.append(f"    if (per_task > {DEQUANTIZED_COLUMNS} / LC_NR) per_task = {DEQUANTIZED_COLUMNS} / LC_NR;\n")
        lines.append("    const int64_t blocks = (strips + per_task - 1) / per_task;\n")
        # widening B costs about as much as LC_MR rows of multiply-adds, whatever A's rows
        lines.extend(self.parallel_for(
            [("t", "batch"), ("block", "blocks")],
            f"batch * blocks > 1 && (m + LC_MR) * n * k * batch >= {GEMM_PARALLEL_MIN_FLOPS}", "1", grain="1",
        ))
        body = "            "
        lines.extend(self.batch_indices(call, body))
        for j, axis in enumerate(panels.batch_axes):
            lines.append(f"{body}const int64_t o{j} = t{axis};\n")
        lda = self.lda(call)
        a_rows, a_cols = ("1", lda) if call.trans_a else (lda, "1")  # A's (row, column) strides
        a_off = self.batch_offset(call.batch, call.a_batch_strides)
        lines.append(f"{body}const float *a = b{call.a} + ({self.ix(a_off)});\n")
        lines.append(f"{body}float *c = b{call.c} + t * m * n;\n")
        lines.append(f"{body}const int64_t lo = block * per_task * LC_NR, hi = lo + per_task * LC_NR < n ? lo + per_task * LC_NR : n;\n")
        lines.append(f"{body}const int64_t full = lo + (hi - lo) / LC_NR * LC_NR;  /* past it: the last strip, part of one */\n")
        lines.append(f"{body}float *restrict panel = (float *)lc_scratch((int64_t)sizeof(float) * (k < LC_KC ? k : LC_KC) * per_task * LC_NR);\n")
        lines.append(f"{body}if (!panel) continue;\n")
        lines.append(f"{body}for (int64_t pc = 0; pc < k; pc += LC_KC) {{\n")
        at = body + "    "
        lines.append(f"{at}const int64_t kc = k - pc < LC_KC ? k - pc : LC_KC;\n")
        lines.append(f"{at}for (int64_t p = 0; p < kc; ++p) {{\n")
        row = at + "    "
        lines.append(f"{row}int64_t lc_left = pc + p; (void)lc_left;\n")  # B's row pc + p as its k axes' indices
        for j in range(rank - 2, first - 1, -1):
            if j == first:
                lines.append(f"{row}const int64_t o{j} = lc_left;\n")
            else:
                lines.append(f"{row}const int64_t o{j} = lc_left % ({dim(shape[j])}); lc_left /= ({dim(shape[j])});\n")
        # strip (j0 - lo) / LC_NR holds column j at [p][j - j0]
        store = lambda value: f"panel[(j0 - lo) * kc + p * LC_NR + ({column} - j0)] = (float)({value});"
        summed = {f"o{j}" for j in range(first, rank - 1)}
        widened = _scaled_int8(self.program, producer.value, column, f"o{rank - 2}", summed)
        if widened is not None:
            q, scale, row_step = widened
            widen = (
                f"lc_widen_int8({{count}}, &b{q.buffer}[{self.ix(q.index)}], {STRIP_PREFETCH_ROWS} * ({dim(row_step)}), "
                "&panel[(j0 - lo) * kc + p * LC_NR]);\n"
            )
            lines.append(f"{row}for (int64_t j0 = lo; j0 < full; j0 += LC_NR) {{\n")
            lines.append(f"{row}    const int64_t {column} = j0;\n{row}    " + widen.format(count="LC_NR"))
            lines.append(f"{row}}}\n{row}if (full < hi) {{\n{row}    const int64_t j0 = full, {column} = j0;\n")
            lines.append(f"{row}    " + widen.format(count="hi - j0"))
        else:
            lines.append(f"{row}for (int64_t j0 = lo; j0 < full; j0 += LC_NR) {{\n")
            # a whole strip's row: a loop of constant length, which GCC vectorizes whole
            lines.append(self.row(producer, row + "    ", store, "j0", "j0 + LC_NR"))
            lines.append(f"{row}}}\n{row}if (full < hi) {{\n{row}    const int64_t j0 = full;\n")
            lines.append(self.row(producer, row + "    ", store, "j0", "hi"))
        lines.append(f"{row}    for (int64_t j = hi - j0; j < LC_NR; ++j) panel[(j0 - lo) * kc + p * LC_NR + j] = 0.0f;\n")
        lines.append(f"{row}}}\n{at}}}\n")
        lines.append(f"{at}for (int64_t j0 = lo; j0 < hi; j0 += LC_NR)\n")
        lines.append(
            f"{at}    lc_strip_product(m, kc, a + pc * {a_cols}, {a_rows}, {a_cols}, panel + (j0 - lo) * kc, c + j0, n, pc > 0, "
            "hi - j0 < LC_NR ? hi - j0 : LC_NR);\n"
        )
        lines.append(f"{body}}}\n")
        if widened is not None:  # sum_k a q s = s sum_k a q: the scale once per element of C, not per weight
            lines.append(f"{body}{{\n{body}    const int64_t {column} = lo;\n")
            lines.append(f"{body}    const float *restrict lc_scale = &b{scale.buffer}[{self.ix(scale.index)}];\n")
            lines.append(f"{body}    for (int64_t i = 0; i < m; ++i) {{\n{body}        #pragma omp simd\n")
            lines.append(f"{body}        for (int64_t j = lo; j < hi; ++j) c[i * n + j] *= lc_scale[j - lo];\n{body}    }}\n{body}}}\n")
        lines.append(self.epilogue(call, ("0", "m"), ("lo", "hi"), body))
        lines.append("        }\n")
        return "".join(lines)

    def windows(self, call: GemmCall, number: int | None = None) -> WindowGeometry | None:
        """A convolution's windows that the generated kinds multiply in place, else None (of the
        kernel being rendered, or of kernel `number`)."""
        if self.kind_of(self.number if number is None else number) in ("blas", "transposed", "direct") or call.dtype != "float32" or call.b_panels is None:
            return None
        geometry = window_geometry(call.b_panels)
        if geometry is None or geometry.axes[1].out < CONV_MIN_WIDTH or max(a.step for a in geometry.axes) > 32:
            return None
        y, x = geometry.axes
        if y.kernel * x.kernel < CONV_MIN_REUSE * y.step * x.step:
            return None
        return geometry

    def conv_gemm(self, call: GemmCall, geometry: WindowGeometry) -> str:
        """A convolution's product with its windows read in place (lc_conv_rows): each task is a
        block of output rows of one batch index (and a share of m where there are too few),
        copying the input rows it reads, split by phase, into its own scratch in L2."""
        y, x = geometry.axes
        phases = [sum(1 << r for r in axis.phases()) for axis in (y, x)]
        numbers = [geometry.channels, geometry.channel_stride]
        for axis, mask in zip((y, x), phases):
            numbers += [axis.kernel, axis.dilation, axis.step, axis.pad, axis.size, axis.stride, axis.out, mask, axis.reach()]
        row_bytes = geometry.channels * len(y.phases()) * len(x.phases()) * (x.out + x.reach()) * 4  # a plane row, all planes
        rows = max(1, min(y.out, CONV_PLANE_BYTES // row_bytes - y.reach()))
        lines = self.gemm_head(call, {geometry.source, call.a})
        lines.append(f"    static const int64_t g[] = {{{', '.join(map(str, numbers))}}};\n")
        lines.append("    const int64_t call = __atomic_add_fetch(&lc_conv_calls, 1, __ATOMIC_RELAXED);\n")
        lines.append("    const int threads = lc_threads;\n")
        lines.append(f"    int64_t blocks = ({y.out} + {rows} - 1) / {rows};\n")
        # a multiple of the threads, down to a row each; then shares of m
        lines.append(f"    while (blocks < {y.out} && (batch * blocks) % threads) ++blocks;  /* every thread an equal share */\n")
        # parts of m outermost: a thread takes the tasks of one part in a row and packs its A once
        body = "            "
        lines.extend(self.row_block_tasks(call, y.out, body, [
            "    const int64_t parts = batch * blocks < threads && m >= 2 * LC_CMR ? (threads + batch * blocks - 1) / (batch * blocks) : 1;\n",
            "    const int64_t m_span = ((m + parts - 1) / parts + LC_CMR - 1) / LC_CMR * LC_CMR;\n",
        ]))
        a_off = self.batch_offset(call.batch, call.a_batch_strides)
        lda = self.lda(call)
        a_rows, a_cols = ("1", lda) if call.trans_a else (lda, "1")  # A's (row, column) strides
        lines.append(f"{body}const int64_t rows_m = m_hi - m_lo;\n")
        lines.append(
            f"{body}lc_conv_rows(g, b{geometry.source} + ({self.ix(geometry.base)}), rows_m, "
            f"b{call.a} + ({self.ix(a_off)}) + m_lo * {a_rows}, {a_rows}, {a_cols}, b{call.c} + t * m * n + m_lo * n, n, r0, r1, call);\n"
        )
        lines.append(self.epilogue(call, ("m_lo", "m_lo + rows_m"), (f"r0 * {x.out}", f"r1 * {x.out}"), body))
        lines.append("        }\n")
        return "".join(lines)

    def row_block_tasks(self, call: GemmCall, out_rows: int, body: str, shares: list[str]) -> list[str]:
        """The blocks of output rows evened out (`blocks` of them, as many as the caller chose), the
        lines `shares` (which split m into `parts` of `m_span`), then the threads' loop over a
        convolution's tasks (a part of m, a batch index t, a block of rows) and each task's batch
        indices, its panels' indices o0.. (where B is windows), its rows of C [m_lo, m_hi) and its
        output rows [r0, r1); a task with none of either is skipped."""
        lines = [
            f"    const int64_t rows = ({out_rows} + blocks - 1) / blocks;\n",
            f"    blocks = ({out_rows} + rows - 1) / rows;\n",
            *shares,
            *self.tasks(("part", "t", "block")),
        ]
        lines.extend(self.batch_indices(call, body))
        for j, axis in enumerate(call.b_panels.batch_axes if call.b_panels is not None else ()):
            lines.append(f"{body}const int64_t o{j} = t{axis}; (void)o{j};\n")
        lines.append(f"{body}const int64_t m_lo = part * m_span, m_hi = m_lo + m_span < m ? m_lo + m_span : m;\n")
        lines.append(f"{body}const int64_t r0 = block * rows, r1 = r0 + rows < {out_rows} ? r0 + rows : {out_rows};\n")
        lines.append(f"{body}if (m_lo >= m_hi || r0 >= r1) continue;\n")
        return lines

    def direct_conv(self, call: GemmCall, geometry: WindowGeometry) -> str:
        """A convolution's product computed transposed from its windows in place (lc_conv_direct):
        each task is a block of output rows of one batch index (and a share of the channels where
        there are too few), copying the input rows it reads into its scratch channels innermost."""
        y, x = geometry.axes
        numbers = [geometry.channels, geometry.channel_stride]
        for axis in (y, x):
            numbers += [axis.kernel, axis.dilation, axis.step, axis.pad, axis.size, axis.stride, axis.out]
        columns = (x.out - 1) * x.step + (x.kernel - 1) * x.dilation + 1
        row_bytes = geometry.channels * columns * 4 * y.step  # the input an output row adds to a block
        rows = max(1, min(y.out, CONV_PLANE_BYTES // row_bytes))
        # a weight larger than the image (3x3 at 256 channels on 14x14): the threads share its
        # channels, so each panel is read from memory once, where sharing the rows read all of
        # them on every thread
        image_bytes = geometry.channels * ((y.out - 1) * y.step + (y.kernel - 1) * y.dilation + 1) * columns * 4
        weight_larger = isinstance(call.m, int) and isinstance(call.k, int) and call.m * call.k * 4 > DIRECT_SHARE_CHANNELS * image_bytes
        one_block = weight_larger and image_bytes <= DIRECT_IMAGE_MAX_BYTES
        lines = self.gemm_head(call, {geometry.source, call.a})
        lines.append(f"    static const int64_t g[] = {{{', '.join(map(str, numbers))}}};\n")
        lines.append("    const int threads = lc_threads;\n")
        lines.append(f"    int64_t blocks = ({y.out} + {rows} - 1) / {rows}, parts = 1;\n")
        # images the threads cannot share evenly, whose rows they cannot either (7 rows for 2
        # threads), or a weight larger than the image: the channels are shared, in whole panels,
        # and every thread copies the rows (all of them at once where they fit)
        uneven = "1" if weight_larger else f"({y.out} % threads || blocks < threads)"
        share = "{ parts = threads; blocks = 1; }" if one_block else "parts = threads;"
        lines.append(f"    if (batch % threads && {uneven} && m >= threads * LC_PW) {share}\n")
        lines.append(f"    else while (blocks < {y.out} && (batch * blocks) % threads) ++blocks;  /* every thread an equal share */\n")
        body = "            "
        lines.extend(self.row_block_tasks(call, y.out, body, [
            "    const int64_t m_span = ((m + parts - 1) / parts + LC_PW - 1) / LC_PW * LC_PW;  /* whole panels */\n",
        ]))
        lines.append(
            f"{body}lc_conv_direct(g, b{geometry.source} + ({self.ix(geometry.base)}), b{call.a}, {padded_columns(call.m)}, "
            f"m_lo, m_hi, b{call.c} + t * m * n, n, r0, r1);\n"
        )
        lines.append(self.epilogue(call, ("m_lo", "m_hi"), (f"r0 * {x.out}", f"r1 * {x.out}"), body))
        lines.append("        }\n")
        return "".join(lines)

    def parallel_for(
        self, loops: list[tuple[str, str]], condition: str, wake: str, grain: str = "0", simd: bool = False,
        chunk_block: bool = False,
    ) -> list[str]:
        """The threads' loops over the tasks `loops` ((variable, extent), outermost first) as one
        flat range, shared when `condition` holds (with sleeping workers woken when `wake` does):
        each thread runs the chunks it claims (lc_next, `grain` tasks each; 0: about
        LC_CHUNKS_PER_THREAD a thread). The body follows at 12 spaces and is closed by the caller
        at 8; with `chunk_block`, a chunk's statements are a block the caller closes at 4 (more
        loops over the chunk's tasks may follow the first)."""
        total = " * ".join(f"(int64_t)({extent})" for _, extent in loops) or "1"
        lines = [
            "    lc_tasks lc_t;\n",
            f"    lc_begin(&lc_t, k{self.number}, {total}, {condition}, {grain}, {wake});\n",
            "    while (lc_next(&lc_t)) {\n" if chunk_block else "    while (lc_next(&lc_t))\n",
        ]
        if len(loops) == 1:
            if simd:
                lines.append("        #pragma omp simd\n")
            return lines + [f"        for (int64_t {loops[0][0]} = lc_t.lo; {loops[0][0]} < lc_t.hi; ++{loops[0][0]}) {{\n"]
        lines.append("        for (int64_t lc_i = lc_t.lo; lc_i < lc_t.hi; ++lc_i) {\n")
        lines.append("            int64_t lc_left = lc_i; (void)lc_left;\n")
        for depth, (var, extent) in enumerate(reversed(loops)):
            if depth == len(loops) - 1:
                lines.append(f"            const int64_t {var} = lc_left;\n")
            else:
                lines.append(f"            const int64_t {var} = lc_left % ({extent}); lc_left /= ({extent});\n")
        return lines

    def tasks(self, order: tuple[str, str, str]) -> list[str]:
        """The threads' loops over a product's tasks: batch indices t, blocks of columns, parts of m
        (a task each claim: they are few and large)."""
        extent = {"t": "batch", "block": "blocks", "part": "parts"}
        condition = f"batch * blocks * parts > 1 && m * n * k * batch >= {GEMM_PARALLEL_MIN_FLOPS}"
        return self.parallel_for([(var, extent[var]) for var in order], condition, "1", grain="1")

    def gemm(self, call: GemmCall) -> str:
        """One library call per (batch index, block): the blocks split the larger of m and n
        across the program's threads, so the loops and the library share one pool of threads (the
        library itself runs single-threaded; see native_cpu)."""
        prefix = "s" if call.dtype == "float32" else "d"
        ctype = C_TYPES[call.dtype]
        lines = self.gemm_head(call, [call.a, call.b])
        lines.append("    const int threads = lc_threads;\n")
        lines.append(f"    const int64_t least = (m == 1 || n == 1) ? {GEMV_PARALLEL_MIN_FLOPS} : {GEMM_PARALLEL_MIN_FLOPS};\n")
        lines.append("    const int64_t blocks = (batch >= threads || m * n * k < least) ? 1 : threads;\n")
        lines.append("    const int split_m = m >= n;\n")
        lines.append("    int64_t span = ((split_m ? m : n) + blocks - 1) / blocks;\n")
        generated = (self.gemm_kind == "tiled" or call.packed_b) and call.dtype == "float32"
        if generated:  # blocks of whole register tiles of rows, or of whole panels of columns (even shares)
            lines.append("    span = split_m ? (span + LC_MR - 1) / LC_MR * LC_MR : (span + LC_PW - 1) / LC_PW * LC_PW;\n")
        lines.extend(self.parallel_for(
            [("t", "batch"), ("block", "blocks")], "batch * blocks > 1 && m * n * k * batch >= least",
            "m * n * k * batch >= lc_wake_work", grain="1",
        ))
        body = "            "
        lines.extend(self.batch_indices(call, body))
        a_off = self.batch_offset(call.batch, call.a_batch_strides)
        b_off = self.batch_offset(call.batch, call.b_batch_strides)
        lines.append(f"{body}const int64_t lo = block * span, hi = (lo + span < (split_m ? m : n)) ? lo + span : (split_m ? m : n);\n")
        lines.append(f"{body}if (lo >= hi) continue;\n")
        block = (("(split_m ? lo : 0)", "(split_m ? hi : m)"), ("(split_m ? 0 : lo)", "(split_m ? n : hi)"))
        lda, ldb = self.lda(call), self.ldb(call)
        a_row = "lo" if call.trans_a else f"lo * {lda}"  # where row lo of A starts
        b_col = f"lo * {ldb}" if call.trans_b else "lo"  # where column lo of B starts
        lines.append(f"{body}const {ctype} *a = b{call.a} + ({self.ix(a_off)}) + (split_m ? {a_row} : 0);\n")
        trans_a = 112 if call.trans_a else 111
        trans_b = 112 if call.trans_b else 111
        if call.packed_b:
            a_strides = f"1, {lda}" if call.trans_a else f"{lda}, 1"  # A's (row, column) strides
            npad = padded_columns(call.n)
            # the panels are addressed by whole columns: a block of n is columns [lo, hi) of C's rows
            lines.append(f"{body}{ctype} *c = b{call.c} + t * m * n + (split_m ? lo * n : 0);\n")
            lines.append(
                f"{body}lc_sgemm_pw(split_m ? hi - lo : m, k, a, {a_strides}, b{call.b}, {npad}, "
                "split_m ? 0 : lo, split_m ? n : hi, c, n);\n"
            )
            lines.append(self.epilogue(call, *block, body))
            return "".join(lines) + "        }\n"
        lines.append(f"{body}const {ctype} *bm = b{call.b} + ({self.ix(b_off)}) + (split_m ? 0 : {b_col});\n")
        lines.append(f"{body}{ctype} *c = b{call.c} + t * m * n + (split_m ? lo * n : lo);\n")
        if generated:
            a_strides = f"1, {lda}" if call.trans_a else f"{lda}, 1"  # A's (row, column) strides
            b_strides = f"1, {ldb}" if call.trans_b else f"{ldb}, 1"
            lines.append(
                f"{body}lc_sgemm(split_m ? hi - lo : m, split_m ? n : hi - lo, k, a, {a_strides}, bm, {b_strides}, c, n);\n"
            )
        else:
            # a matrix-vector product (batch 1 through a dense layer) is memory-bound: GEMV streams
            # the matrix once, where GEMM would first pack it (4x slower at 1x784 @ 784x512)
            rows, cols = ("hi - lo", "k") if not call.trans_a else ("k", "hi - lo")
            lines.append(
                f"{body}if (m == 1) scipy_cblas_{prefix}gemv(101, {111 if call.trans_b else 112}, "
                + ("(int)(hi - lo), (int)k" if call.trans_b else "(int)k, (int)(hi - lo)")
                + f", 1, bm, (int){ldb}, a, (int)({lda if call.trans_a else 1}), 0, c, 1);\n"
            )
            lines.append(
                f"{body}else if (n == 1) scipy_cblas_{prefix}gemv(101, {112 if call.trans_a else 111}, "
                f"(int)({rows}), (int)({cols}), 1, a, (int){lda}, bm, (int)({1 if call.trans_b else ldb}), 0, c, 1);\n"
            )
            lines.append(
                f"{body}else scipy_cblas_{prefix}gemm(101, {trans_a}, {trans_b}, (int)(split_m ? hi - lo : m), "
                f"(int)(split_m ? n : hi - lo), (int)k, 1, a, (int){lda}, bm, (int){ldb}, 0, c, (int)n);\n"
            )
        lines.append(self.epilogue(call, *block, body))
        lines.append("        }\n")
        return "".join(lines)

    def depthwise_gemm(self, call: GemmCall, windows: DepthwiseWindows) -> str:
        """A depthwise convolution's product (depthwise_geometry), a task per image and channel:
        its input plane copied into the thread's scratch, zero-padded and split by phase (so that
        every tap reads at stride 1), then each output row one vector loop over its columns that
        sums every tap, the taps' weights in locals; the epilogues after a chunk's planes (plane_loop)."""
        y, x = windows.axes
        phases_y, phases_x = y.phases(), x.phases()
        qh, qw = y.out + y.reach(), x.out + x.reach()  # a phase plane's rows and columns
        plane = qh * qw
        lines = self.gemm_head(call, {windows.source, windows.weight})
        head = len(lines)
        body = "            "
        lines.extend(self.plane_task(call, windows, body))
        lines.append(f"{body}float *restrict planes = (float *)lc_scratch((int64_t)sizeof(float) * {len(phases_y) * len(phases_x) * plane});\n")
        lines.append(f"{body}if (!planes) continue;\n")
        for py, ry in enumerate(phases_y):
            for px, rx in enumerate(phases_x):
                # the plane's (v, u) is the input's (step*v + r - pad): inside it for u in [lo, hi)
                first = rx - x.pad
                lo = 0 if first >= 0 else -(first // x.step)
                hi = min(qw, 0 if x.size - first <= 0 else -(-(x.size - first) // x.step))
                lo = min(lo, qw)
                hi = max(hi, lo)
                step = x.step * x.stride
                lines.append(f"{body}for (int64_t v = 0; v < {qh}; ++v) {{\n")
                inner = body + "    "
                lines.append(f"{inner}float *restrict dst = planes + {(py * len(phases_x) + px) * plane} + v * {qw};\n")
                lines.append(f"{inner}const int64_t row = {y.step} * v + {ry - y.pad};\n")
                lines.append(f"{inner}if (row < 0 || row >= {y.size}) {{ memset(dst, 0, sizeof(float) * {qw}); continue; }}\n")
                lines.append(f"{inner}const float *restrict from = src + row * {y.stride} + {first * x.stride};\n")
                lines.append(f"{inner}for (int64_t u = 0; u < {lo}; ++u) dst[u] = 0.0f;\n")
                lines.append(f"{inner}for (int64_t u = {lo}; u < {hi}; ++u) dst[u] = from[u * {step}];\n")
                lines.append(f"{inner}for (int64_t u = {hi}; u < {qw}; ++u) dst[u] = 0.0f;\n")
                lines.append(f"{body}}}\n")
        taps = []
        for i in range(y.kernel):
            for j in range(x.kernel):
                dy, dx = y.dilation * i, x.dilation * j
                where = (phases_y.index(dy % y.step) * len(phases_x) + phases_x.index(dx % x.step)) * plane
                taps.append((i * x.kernel + j, where + dy // y.step * qw + dx // x.step))
                lines.append(f"{body}const float w{i * x.kernel + j} = a[{i * windows.weight_steps[0] + j * windows.weight_steps[1]}];\n")
        # a sum per window row, then their sum: independent chains of multiply-adds, where one
        # chain of 49 (a 7x7 window) waited on each add's latency (2.2x slower, one thread)
        rows = [taps[i * x.kernel : (i + 1) * x.kernel] for i in range(y.kernel)]
        total = " + ".join("(" + " + ".join(f"w{p} * at[ox + {offset}]" for p, offset in row) + ")" for row in rows)
        lines.append(f"{body}for (int64_t oy = 0; oy < {y.out}; ++oy) {{\n")
        lines.append(f"{body}    const float *restrict at = planes + oy * {qw};\n")
        lines.append(f"{body}    #pragma omp simd\n")
        lines.append(f"{body}    for (int64_t ox = 0; ox < {x.out}; ++ox) c[oy * {x.out} + ox] = {total};\n")
        lines.append(f"{body}}}\n")
        condition = f"batch > 1 && n * k * batch >= {GEMM_PARALLEL_MIN_FLOPS}", "n * k * batch >= lc_wake_work"
        return "".join(lines[:head] + self.plane_loop(call, *condition, lines[head:]))

    def plane_task(self, call: GemmCall, windows: DepthwiseWindows, body: str) -> list[str]:
        """A depthwise product's task t (one plane): its batch indices, the loop's plane indices
        o0.., and the plane's weights `a`, input `src` and output `c`."""
        lines = self.batch_indices(call, body)
        for j in range(len(call.batch)):  # the loop's plane axes are the product's batch axes
            lines.append(f"{body}const int64_t o{j} = t{j}; (void)o{j};\n")
        lines.append(f"{body}const float *restrict a = b{windows.weight} + ({self.ix(windows.weight_base)});\n")
        lines.append(f"{body}const float *restrict src = b{windows.source} + ({self.ix(windows.base)});\n")
        lines.append(f"{body}float *restrict c = b{call.c} + t * m * n;\n")
        return lines

    def depthwise_registers(self, call: GemmCall, windows: DepthwiseWindows) -> str:
        """A depthwise convolution's product (register_planes) a plane a task, the plane in vector
        registers: for each output vector, each tap's windows are one two-source permutation of
        the input vectors its lanes read (lanes reading padding zeroed by the mask), times the
        tap's weight, summed per window row (a dense plane read in place, masked past its end); the
        epilogues after a chunk's planes (plane_loop). Without AVX-512 each output is its
        taps' sum, unrolled. Small planes (a 4x4 image's 2x2 output, 8x8 ones) spent their time on
        the plane form's loops and phase copies, not on multiply-adds."""
        y, x = windows.axes
        lanes = REGISTER_PLANE_LANES
        lines = self.gemm_head(call, {windows.source, windows.weight})
        # a plane costs its permutations and multiply-adds, and about 64 more for its copy, store and
        # epilogue; shared from REGISTER_PLANES_PARALLEL_MIN_WORK
        work = f"batch * (n * k + 64) * {REGISTER_PLANE_COST}"
        condition = f"batch > 1 && {work} >= {REGISTER_PLANES_PARALLEL_MIN_WORK}", f"{work} >= lc_wake_work"
        head = len(lines)
        body = "            "
        lines.extend(self.plane_task(call, windows, body))
        for i in range(y.kernel):
            for j in range(x.kernel):
                lines.append(f"{body}const float w{i * x.kernel + j} = a[{i * windows.weight_steps[0] + j * windows.weight_steps[1]}];\n")
        taps = plane_taps(windows)
        plane_in, plane_out = y.size * x.size, y.out * x.out
        inputs, outputs = -(-plane_in // lanes), -(-plane_out // lanes)
        inner = body + "    "
        lines.append("#if defined(__AVX512F__)\n")
        lines.append(f"{body}{{\n")
        if x.stride == 1 and y.stride == x.size:  # a dense plane: read in place, the lanes past it masked
            for v in range(inputs):  # (copied to the stack, the loads waited on the copy's stores)
                valid = min(lanes, plane_in - v * lanes)
                lines.append(f"{inner}const __m512 x{v} = _mm512_maskz_loadu_ps(0x{(1 << valid) - 1:04x}, src + {v * lanes});\n")
        else:
            lines.append(f"{inner}float plane[{inputs * lanes}] __attribute__((aligned(64)));\n")
            for iy in range(y.size):
                for ix in range(x.size):
                    lines.append(f"{inner}plane[{iy * x.size + ix}] = src[{iy * y.stride + ix * x.stride}];\n")
            if plane_in % lanes:
                lines.append(f"{inner}memset(plane + {plane_in}, 0, sizeof(float) * {inputs * lanes - plane_in});\n")
            for v in range(inputs):
                lines.append(f"{inner}const __m512 x{v} = _mm512_load_ps(plane + {v * lanes});\n")
        for v in range(outputs):
            row_sums = []
            for i in range(y.kernel):
                terms = []
                for j in range(x.kernel):
                    tap = i * x.kernel + j
                    reads = [(out % lanes, at) for out, at in taps[tap] if out // lanes == v]
                    if not reads:
                        continue  # this vector's lanes of this tap read only padding
                    sources = sorted({at // lanes for _, at in reads})
                    first, second = sources[0], sources[-1]
                    index, mask = [0] * lanes, 0
                    for lane, at in reads:
                        index[lane] = at % lanes + (lanes if at // lanes != first else 0)
                        mask |= 1 << lane
                    picks = f"_mm512_maskz_permutex2var_ps(0x{mask:04x}, x{first}, _mm512_setr_epi32({', '.join(map(str, index))}), x{second})"
                    terms.append(f"_mm512_mul_ps(_mm512_set1_ps(w{tap}), {picks})")
                if terms:
                    row_sums.append(" + ".join(terms))
            total = " + ".join(f"({row})" for row in row_sums) or "_mm512_setzero_ps()"
            valid = min(lanes, plane_out - v * lanes)
            lines.append(f"{inner}{{\n{inner}    const __m512 sums = {total};\n")
            if valid == lanes:
                lines.append(f"{inner}    _mm512_storeu_ps(c + {v * lanes}, sums);\n")
            else:
                lines.append(f"{inner}    _mm512_mask_storeu_ps(c + {v * lanes}, 0x{(1 << valid) - 1:04x}, sums);\n")
            lines.append(f"{inner}}}\n")
        lines.append(f"{body}}}\n")
        lines.append("#else\n")
        by_output: dict[int, list[str]] = {o: [] for o in range(plane_out)}
        for tap, reads in taps.items():
            for out, at in reads:
                iy, ix = divmod(at, x.size)
                by_output[out].append(f"w{tap} * src[{iy * y.stride + ix * x.stride}]")
        for out, terms in by_output.items():
            lines.append(f"{body}c[{out}] = {' + '.join(terms) or '0.0f'};\n")
        lines.append("#endif\n")
        return "".join(lines[:head] + self.plane_loop(call, *condition, lines[head:]))

    def plane_loop(self, call: GemmCall, condition: str, wake: str, plane: list[str]) -> list[str]:
        """The threads' loop over a depthwise product's planes, a task each (`plane`: a task's
        statements, from plane_task on): a chunk's planes, then their epilogues, which read C back
        long after its stores retired (a plane's epilogue read the stores just made, waiting on store
        forwarding; with the registers' planes read in place, MobileNetV2 at batch 8 took 0.78x the
        time, at batch 1 0.84x, ConvNeXt at batch 8 0.97x)."""
        epilogue = self.epilogue(call, ("0", "m"), ("0", "n"), "            ")
        if not epilogue:
            return [*self.parallel_for([("t", "batch")], condition, wake), *plane, "        }\n"]
        return [
            *self.parallel_for([("t", "batch")], condition, wake, chunk_block=True), *plane, "        }\n",
            "        for (int64_t t = lc_t.lo; t < lc_t.hi; ++t) {\n", *self.batch_indices(call, "            "), epilogue,
            "        }\n    }\n",
        ]

    def transposed_gemm(self, call: GemmCall) -> str:
        """A product computed as C^T = B^T A^T (lc_sgemm_t), its weight A packed transposed at
        compile time: one task per (batch index, block), the blocks splitting C's rows in whole
        panels of A^T where they are many, else its columns."""
        lines = self.gemm_head(call, [call.a, call.b])
        lines.append("    const int threads = lc_threads;\n")
        lines.append(f"    const int64_t blocks = (batch >= threads || m * n * k < {GEMM_PARALLEL_MIN_FLOPS}) ? 1 : threads;\n")
        lines.append("    const int split_m = m >= LC_NR * threads;\n")
        lines.append("    int64_t span = ((split_m ? m : n) + blocks - 1) / blocks;\n")
        lines.append("    if (split_m) span = (span + LC_PW - 1) / LC_PW * LC_PW;  /* whole panels: even shares */\n")
        lines.extend(self.parallel_for(
            [("t", "batch"), ("block", "blocks")], f"batch * blocks > 1 && m * n * k * batch >= {GEMM_PARALLEL_MIN_FLOPS}",
            "m * n * k * batch >= lc_wake_work", grain="1",
        ))
        body = "            "
        lines.extend(self.batch_indices(call, body))
        b_off = self.batch_offset(call.batch, call.b_batch_strides)
        lines.append(f"{body}const int64_t lo = block * span, hi = (lo + span < (split_m ? m : n)) ? lo + span : (split_m ? m : n);\n")
        lines.append(f"{body}if (lo >= hi) continue;\n")
        ldb = self.ldb(call)
        b_strides = f"1, {ldb}" if call.trans_b else f"{ldb}, 1"  # B's (row, column) strides
        lines.append(
            f"{body}lc_sgemm_t(k, b{call.b} + ({self.ix(b_off)}), {b_strides}, b{call.a}, {padded_columns(call.m)}, "
            "split_m ? lo : 0, split_m ? hi : m, split_m ? 0 : lo, split_m ? n : hi, b" + str(call.c) + " + t * m * n, n);\n"
        )
        block = (("(split_m ? lo : 0)", "(split_m ? hi : m)"), ("(split_m ? 0 : lo)", "(split_m ? n : hi)"))
        lines.append(self.epilogue(call, *block, body))
        lines.append("        }\n")
        return "".join(lines)

    @staticmethod
    def lda(call: GemmCall) -> str:
        """A's row stride: its own, or the packed one ([m, k], or [k, m] transposed)."""
        return f"({dim(call.lda)})" if call.lda is not None else ("m" if call.trans_a else "k")

    @staticmethod
    def ldb(call: GemmCall) -> str:
        """B's row stride: its own, or the packed one ([k, n], or [n, k] transposed)."""
        return f"({dim(call.ldb)})" if call.ldb is not None else ("k" if call.trans_b else "n")

    def gemm_head(self, call: GemmCall, reads) -> list[str]:
        """A product's pointers, sizes, and its early exits (no output; an empty sum is zeros)."""
        ctype = C_TYPES[call.dtype]
        stored = kernel_stores(call)
        if call.epilogue is not None:
            reads = set(reads) | lets_reads(call.epilogue)
        lines = [self.pointer(b) for b in sorted(set(reads) - stored)] + [self.pointer(b, writable=True) for b in sorted(stored)]
        batch = " * ".join(f"(int64_t)({dim(d)})" for d in call.batch) or "1"
        lines.append(f"    const int64_t m = {dim(call.m)}, n = {dim(call.n)}, k = {dim(call.k)}, batch = {batch};\n")
        lines.append("    if (m == 0 || n == 0 || batch == 0) return;\n")
        lines.append(f"    if (k == 0) {{\n        memset(b{call.c}, 0, sizeof({ctype}) * m * n * batch);\n")
        if call.epilogue is not None:
            lines.append("        for (int64_t t = 0; t < batch; ++t) {\n")
            lines.append(self.epilogue(call, ("0", "m"), ("0", "n"), "            "))
            lines.append("        }\n")
        lines.append("        return;\n    }\n")
        return lines

    def epilogue(self, call: GemmCall, rows: tuple[str, str], columns: tuple[str, str], indent: str) -> str:
        """The product's fused epilogue over the block of C it has just written (batch index t):
        rows [rows), columns [columns), rewritten in place while they are in cache."""
        if call.epilogue is None:
            return ""
        ctype = C_TYPES[call.dtype]
        store = lambda value: f"b{call.c}[t * m * n + i * n + j] = ({ctype})({value});"
        # the epilogue's own element of C, read and written: a row at a time the loop vectorizes
        # (its bounds computed first: GCC vectorizes no loop whose bound is a conditional)
        inner = indent + "        "
        # C of one column (a depthwise product whose windows are A): the rows are the vector loop
        outer, vector = ("j", "i") if call.n == 1 and call.m != 1 else ("i", "j")
        return (
            f"{indent}{{\n"
            f"{indent}    const int64_t lc_i0 = {rows[0]}, lc_i1 = {rows[1]}, lc_j0 = {columns[0]}, lc_j1 = {columns[1]};\n"
            f"{indent}    for (int64_t {outer} = lc_{outer}0; {outer} < lc_{outer}1; ++{outer}) {{\n"
            + self.let_rows(call.epilogue.lets, call.epilogue.value, vector, (f"lc_{vector}0", f"lc_{vector}1"),
                            "t * m * n + i * n + j", store, inner)
            + f"{indent}    }}\n"
            f"{indent}}}\n"
        )

    def let_rows(
        self, lets, value: Expr, var: str, bounds: tuple[str, str], index: str, statement, indent: str,
        simd: str = "#pragma omp simd\n",
    ) -> str:
        """The loop of `var` over [bounds) around `statement(value)`; with lets, a chunk of the
        row at a time, each let a loop of its own into a local array (stored where it is kept),
        then the value's: every loop a plain one GCC vectorizes, where one loop computing all
        in registers is not (its if-conversion gives up on chains of NaN-propagating max)."""
        if not lets:
            return (
                (f"{indent}{simd}" if simd else "")
                + f"{indent}for (int64_t {var} = {bounds[0]}; {var} < {bounds[1]}; ++{var})\n"
                f"{indent}    {statement(self.expr(value))}\n"
            )
        inner = indent + "    "
        lines = [
            f"{indent}for (int64_t lc_c = {bounds[0]}; lc_c < {bounds[1]}; lc_c += {LET_CHUNK}) {{\n",
            f"{inner}const int64_t lc_e = lc_c + {LET_CHUNK} < {bounds[1]} ? lc_c + {LET_CHUNK} : {bounds[1]};\n",
        ]
        loop = (f"{inner}{simd}" if simd else "") + f"{inner}for (int64_t {var} = lc_c; {var} < lc_e; ++{var})\n"
        for let in lets:
            ctype = C_TYPES[self.program.buffers[let.buffer].dtype]
            local = f"lc_v{let.buffer}[{var} - lc_c]"
            lines.append(f"{inner}{ctype} lc_v{let.buffer}[{LET_CHUNK}];\n")
            store = f" b{let.buffer}[{index}] = {local};" if let.store else ""
            lines.append(f"{loop}{inner}    {{ {local} = ({ctype})({self.expr(let.value)});{store} }}\n")
            self.locals[let.buffer] = local
        lines.append(f"{loop}{inner}    {statement(self.expr(value))}\n")
        for let in lets:
            del self.locals[let.buffer]
        lines.append(f"{indent}}}\n")
        return "".join(lines)

    @staticmethod
    def batch_indices(call: GemmCall, indent: str) -> list[str]:
        """The flat batch index t unflattened into t0.. over the call's batch axes."""
        lines, rest = [], "t"
        for j in range(len(call.batch) - 1, -1, -1):
            extent = dim(call.batch[j])
            lines.append(f"{indent}const int64_t t{j} = {rest} % ({extent}); const int64_t q{j} = {rest} / ({extent});\n")
            lines.append(f"{indent}(void)t{j}; (void)q{j};\n")
            rest = f"q{j}"
        return lines

    @staticmethod
    def batch_offset(batch: tuple, strides: tuple) -> Ix:
        """An operand's offset at batch indices t0.., from its stride per batch axis."""
        offset = Ix()
        for j in range(len(batch)):
            offset = offset + Ix.var(f"t{j}").scale(strides[j])
        return offset

    def checks(self, guards) -> str:
        """Padding guards as one condition: `&`, not `&&`, so there is no branch and the loop
        stays vectorizable (one unsigned comparison tests 0 <= index < size)."""
        return " & ".join(f"((uint64_t)({self.ix(g)}) < (uint64_t)({dim(n)}))" for g, n in guards)

    @staticmethod
    def gathers(expr: Expr) -> bool:
        """Whether an expression reads through a gathered index (which reports out-of-range
        indices through a global flag: not a loop to vectorize)."""
        return any(isinstance(e, Atom) and e.op == "value" for e in walk(expr))

    def ix(self, e: Ix) -> str:
        parts = []
        for var, coef in e.terms:
            term = var if isinstance(var, str) else self.ix_atom(var)
            parts.append(term if coef == 1 else f"{term} * {dim(coef)}")
        if e.const != 0 or not parts:
            parts.append(dim(e.const))
        return " + ".join(parts)

    def ix_atom(self, atom: Atom) -> str:
        if atom in self.hoisted:
            return self.hoisted[atom]
        if atom.op == "floordiv":
            return f"(({self.ix(atom.args[0])}) / {dim(atom.args[1])})"
        if atom.op == "mod":
            return f"(({self.ix(atom.args[0])}) % {dim(atom.args[1])})"
        if atom.op == "flag":
            return f"((int64_t)({self.expr(atom.args[0])}))"
        if atom.op == "value":
            return f"lc_index((int64_t)({self.expr(atom.args[0])}), {dim(atom.args[1])})"
        raise TypeError(f"cannot render index atom {atom.op}")

    def dtype_of(self, e: Expr) -> str:
        return self.program.buffers[e.buffer].dtype if isinstance(e, Load) else e.dtype

    def expr(self, e: Expr) -> str:
        if isinstance(e, Load):
            if e.buffer in self.locals:  # a let of the loop, read at its own element
                return self.locals[e.buffer]
            if self.guard:  # None under a non-affine guard: no wrapping below it
                # inside padding's guard: an index that is never out of range whatever the guard
                # says, so the load may run before the check and the loop vectorizes
                return self.loaded(e.buffer, f"b{e.buffer}[({self.guard}) ? ({self.ix(e.index)}) : 0]")
            return self.loaded(e.buffer, f"b{e.buffer}[{self.ix(e.index)}]")
        if isinstance(e, Const):
            return literal(e.value, e.dtype)
        if isinstance(e, IndexValue):
            return f"(({C_TYPES[e.dtype]})({self.ix(e.index)}))"
        if isinstance(e, Guarded):
            if any(guard in self.known_false for guard in e.guards):
                return literal(e.fill, e.dtype)
            guards = [(g, n) for g, n in e.guards if (g, n) not in self.known]
            if not guards:
                return self.expr(e.value)
            checks = self.checks(guards)
            outer = self.guard
            # only affine guards are repeated in the loads: a gathered index in a guard would be
            # copied into every load under it, nested guards multiplying the source (the ternary
            # alone is still correct, as C evaluates only the branch taken)
            affine = all(isinstance(v, str) for g, _ in guards for v, _ in g.terms)
            self.guard = (f"{outer} & {checks}" if outer else checks) if affine and outer is not None else None
            value = self.expr(e.value)
            self.guard = outer
            return f"(({checks}) ? ({value}) : ({literal(e.fill, e.dtype)}))"
        if isinstance(e, Apply):
            return self.apply(e)
        raise TypeError(f"cannot render {e!r}")

    def apply(self, e: Apply) -> str:
        args = [self.expr(a) for a in e.args]
        dtype = e.dtype
        ctype = C_TYPES[dtype]
        arg_dtype = self.dtype_of(e.args[0])
        if e.op == "cast":
            if dtype == "bool":
                return f"((uint8_t)(({args[0]}) != 0))"
            return f"(({ctype})({args[0]}))"
        if e.op == "less_than":
            return f"((uint8_t)(({args[0]}) < ({args[1]})))"
        if e.op == "add":
            return f"(({args[0]}) || ({args[1]}))" if dtype == "bool" else f"(({ctype})(({args[0]}) + ({args[1]})))"
        if e.op == "mul":
            return f"(({args[0]}) && ({args[1]}))" if dtype == "bool" else f"(({ctype})(({args[0]}) * ({args[1]})))"
        if e.op == "max":
            return f"LC_MAX(({ctype})({args[0]}), ({ctype})({args[1]}))"
        if e.op == "mod":
            if dtype == "float32":
                return f"fmodf({args[0]}, {args[1]})"
            if dtype == "float64":
                return f"fmod({args[0]}, {args[1]})"
            return f"(({ctype})lc_imod({args[0]}, {args[1]}))"
        if e.op == "recip":
            if dtype in ("float32", "float64"):
                one = "1.0f" if dtype == "float32" else "1.0"
                return f"({one} / ({args[0]}))"
            return f"(({ctype})(({args[0]}) == 0 ? 0 : 1 / ({args[0]})))"
        if e.op in ("log2", "exp2", "sin", "sqrt"):
            # float32 goes through double too: pow is exp2(y * log2 x), which magnifies a last-bit
            # error of log2f past what NumPy's float32 functions give (onnx's pow cases fail)
            if e.op == "sqrt" and arg_dtype == "float32":
                return f"sqrtf({args[0]})"
            if e.op == "exp2" and arg_dtype == "float32" and not _uses(e.args[0], "log2"):
                return f"lc_exp2f({args[0]})"
            return f"(({ctype}){e.op}((double)({args[0]})))"
        raise TypeError(f"cannot render op {e.op}")


def _independent_of(ix: Ix, var: str) -> bool:
    """Whether an index reads no loop variable `var` and no loaded value (divisions and remainders
    of other loop variables allowed)."""
    for term, _ in ix.terms:
        if isinstance(term, str):
            if term == var:
                return False
        elif term.op not in ("floordiv", "mod") or not _independent_of(term.args[0], var):
            return False
    return True


def _reads_only_outside(expr: Expr, inner: set[str], written: set[int]) -> bool:
    """Whether a value reads no index of the loops `inner` and nothing its own kernel writes."""
    for e in walk(expr):
        if isinstance(e, Ix) and any(var in inner for var, _ in e.terms):
            return False
        if isinstance(e, Load) and e.buffer in written:
            return False
    return True


def _disjoint(guard: tuple[Ix, Dim], other: tuple[Ix, Dim]) -> bool:
    """Whether two guards `0 <= t + a < n` and `0 <= t + b < m` on the same t never both hold:
    t lies in [-a, n - a) and in [-b, m - b)."""
    (g, n), (h, m) = guard, other
    if g.terms != h.terms or g == h:
        return False
    return provably_le(dim_sub(n, g.const), dim_sub(0, h.const)) or provably_le(dim_sub(m, h.const), dim_sub(0, g.const))


def _operations(expr: Expr) -> int:
    """About how many operations one evaluation of the expression costs (index arithmetic aside)."""
    count = 0
    for e in walk(expr):
        if isinstance(e, Apply):
            count += OP_COST.get(e.op, 1)
        elif isinstance(e, Load):
            count += 1
        elif isinstance(e, Guarded):
            count += len(e.guards)
    return count


def _uses(expr: Expr, op: str) -> bool:
    """Whether `op` is applied anywhere in the expression (outside index computations)."""
    stack: list[Expr] = [expr]
    while stack:
        e = stack.pop()
        if isinstance(e, Apply):
            if e.op == op:
                return True
            stack.extend(e.args)
        elif isinstance(e, Guarded):
            stack.append(e.value)
    return False


def literal(value: object, dtype: str) -> str:
    if dtype in ("float32", "float64"):
        x = float(value)  # type: ignore[arg-type]
        suffix = "f" if dtype == "float32" else ""
        if math.isnan(x):
            return "NAN"
        if math.isinf(x):
            return "INFINITY" if x > 0 else "-INFINITY"
        return f"{x!r}{suffix}" if "e" in repr(x) or "." in repr(x) else f"{x!r}.0{suffix}"
    if dtype == "bool":
        return "1" if value else "0"
    v = int(value)  # type: ignore[call-overload]
    if dtype == "int64" and v == -(2**63):
        return "INT64_MIN"
    if dtype == "uint64":
        return f"{v}ULL"
    return f"(({C_TYPES[dtype]}){v}LL)"


def dim(d: Dim) -> str:
    if isinstance(d, int):
        return f"{d}LL"
    parts = []
    for atoms, coef in d.terms:
        factors = [str(coef)] + [_dim_atom(a) for a in atoms]
        parts.append("*".join(f"({f})" for f in factors))
    return "(" + " + ".join(parts) + ")"


def _dim_atom(atom: object) -> str:
    if isinstance(atom, str):
        return f"s_{atom}"
    op, *operands = atom  # type: ignore[misc]
    if op == "floordiv":
        return f"lc_fdiv({dim(operands[0])}, {operands[1]})"
    if op == "mod":
        return f"lc_fmod({dim(operands[0])}, {operands[1]})"
    a, b = dim(operands[0]), dim(operands[1])
    return f"(({a}) > ({b}) ? ({a}) : ({b}))" if op == "max" else f"(({a}) < ({b}) ? ({a}) : ({b}))"




__all__ = ["C_TYPES", "CRenderer", "dim", "literal", "render"]
