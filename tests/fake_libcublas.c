/* A stand-in for cuBLAS (libcublas.so.13) beside tests/fake_libcuda.c, for tests on machines
   without a GPU: compiler/backends/cublas.py's ctypes calls reach it as they reach the real one.
   As cuBLAS does, it refuses to make a handle while a stream captures (the real one returns
   CUBLAS_STATUS_NOT_INITIALIZED and the capture is invalidated). Outside a capture a product is
   computed on the stand-in's device memory (host memory), float32 only; inside one it is
   recorded into the graph as a line of its arguments, which the stand-in libcuda writes to
   $FAKE_CUDA_LOG when the graph is replayed. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>

static int handles, (*capturing)(void);
static void (*record)(const char *);

static void bind_libcuda(void) {
    if (capturing) return;
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    capturing = cuda ? (int (*)(void))dlsym(cuda, "fake_cuda_capturing") : 0;
    record = cuda ? (void (*)(const char *))dlsym(cuda, "fake_cuda_record") : 0;
}

int cublasCreate_v2(void **handle) {
    bind_libcuda();
    if (!capturing || capturing()) return 1;
    *handle = &handles;
    ++handles;
    return 0;
}
int cublasDestroy_v2(void *handle) { --handles; return 0; }
int cublasSetStream_v2(void *handle, void *stream) { return 0; }
int cublasSetWorkspace_v2(void *handle, void *workspace, size_t bytes) { return workspace && bytes ? 0 : 7; }
int fake_cublas_handles(void) { return handles; }

int cublasGemmStridedBatchedEx_64(void *handle, int transa, int transb, int64_t m, int64_t n, int64_t k,
                                  const float *alpha, const float *a, int a_type, int64_t lda, long long stride_a,
                                  const float *b, int b_type, int64_t ldb, long long stride_b, const float *beta,
                                  float *c, int c_type, int64_t ldc, long long stride_c, int64_t batch, int compute, int algo) {
    if (capturing()) {
        char line[512];
        snprintf(line, sizeof line, "cublas %d %d %lld %lld %lld %g %d %lld %lld %d %lld %lld %g %d %lld %lld %lld %d %d\n",
                 transa, transb, (long long)m, (long long)n, (long long)k, *alpha, a_type, (long long)lda, stride_a, b_type,
                 (long long)ldb, stride_b, *beta, c_type, (long long)ldc, stride_c, (long long)batch, compute, algo);
        record(line);
        return 0;
    }
    if (a_type != 0 || b_type != 0 || c_type != 0) return 15; /* CUBLAS_STATUS_NOT_SUPPORTED, here */
    for (int64_t t = 0; t < batch; ++t)
        for (int64_t col = 0; col < n; ++col)
            for (int64_t row = 0; row < m; ++row) {
                double total = 0;
                for (int64_t p = 0; p < k; ++p) {
                    double x = a[t * stride_a + (transa ? p + row * lda : row + p * lda)];
                    double y = b[t * stride_b + (transb ? col + p * ldb : p + col * ldb)];
                    total += x * y;
                }
                float *out = &c[t * stride_c + row + col * ldc];
                *out = (float)(*alpha * total + (*beta != 0 ? *beta * *out : 0));
            }
    return 0;
}
