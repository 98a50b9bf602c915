/* A stand-in for the CUDA driver library (libcuda.so.1) for tests on machines without a GPU:
   cuda-bindings loads it as it loads the real one (dlopen, then cuGetProcAddress per function),
   so compiler/backends/cuda_driver.py's calls go through the bindings' argument marshalling for
   real. Device memory is host memory; kernels do not run: each launch a CUDA graph replays is
   written to the file $FAKE_CUDA_LOG as one line (function, grid, block, then every parameter's
   bytes in hex, sized from the module's PTX), for the test to compare with what it launched.

   $FAKE_CUDA_ARCH: the compute capability reported (default 52: a cubin built for another
   is refused, so the PTX is what the driver loads); $FAKE_CUDA_MEMORY: device bytes (default 1 GiB). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
enum { OK = 0, INVALID_VALUE = 1, OUT_OF_MEMORY = 2, NOT_INITIALIZED = 3, INVALID_IMAGE = 200,
       INVALID_DEVICE = 101, NOT_FOUND = 500, STREAM_CAPTURE_INVALIDATED = 901 };

static int initialized, retained, captures, modules_loaded;
static size_t used_bytes;
static char context_storage, stream_storage, event_storage;

static size_t device_memory(void) {
    const char *s = getenv("FAKE_CUDA_MEMORY");
    return s ? strtoull(s, 0, 10) : (size_t)1 << 30;
}

/* ---- modules: the PTX's entries and their parameter sizes -------------------------------- */
#define MAX_FUNCTIONS 512
#define MAX_PARAMS 64
typedef struct { char name[64]; int params; int sizes[MAX_PARAMS]; } Function;
typedef struct { Function functions[MAX_FUNCTIONS]; int count; int bad_index; } Module;

static void parse_ptx(Module *m, const char *ptx) {
    const char *p = ptx;
    while ((p = strstr(p, ".entry ")) && m->count < MAX_FUNCTIONS) {
        Function *f = &m->functions[m->count++];
        p += 7;
        int n = 0;
        while (p[n] && p[n] != '(' && n < 63) { f->name[n] = p[n]; ++n; }
        f->name[n] = 0;
        const char *end = strchr(p, ')');
        const char *q = p;
        while ((q = strstr(q, ".param ")) && q < end && f->params < MAX_PARAMS) {
            /* ".param .u64 name" (8 bytes) or ".param .align 8 .b8 name[24]" */
            const char *bracket = strchr(q, '[');
            const char *comma = strchr(q, ',');
            const char *stop = comma && comma < end ? comma : end;
            f->sizes[f->params++] = bracket && bracket < stop ? atoi(bracket + 1) : 8;
            q = stop;
        }
        p = end;
    }
}

CUresult cuModuleLoadData(void **module, const void *image) {
    if (!initialized) return NOT_INITIALIZED;
    if (memcmp(image, "\x7f" "ELF", 4) == 0) return INVALID_IMAGE; /* a cubin: not for this "GPU" */
    Module *m = calloc(1, sizeof(Module));
    parse_ptx(m, (const char *)image);
    *module = m;
    ++modules_loaded;
    return OK;
}
CUresult cuModuleUnload(void *module) { free(module); --modules_loaded; return OK; }
CUresult cuModuleGetFunction(void **function, void *module, const char *name) {
    Module *m = module;
    for (int i = 0; i < m->count; ++i)
        if (strcmp(m->functions[i].name, name) == 0) { *function = &m->functions[i]; return OK; }
    return NOT_FOUND;
}
CUresult cuModuleGetGlobal(CUdeviceptr *address, size_t *bytes, void *module, const char *name) {
    if (strcmp(name, "lc_bad_index") != 0) return NOT_FOUND;
    *address = (CUdeviceptr)(uintptr_t)&((Module *)module)->bad_index;
    if (bytes) *bytes = 4;
    return OK;
}

/* ---- graphs: launches recorded while a stream captures, written to the log when replayed ---- */
typedef struct { char *lines; size_t length; } Graph;
static Graph *capturing;

static void append(Graph *g, const char *text) {
    size_t n = strlen(text);
    g->lines = realloc(g->lines, g->length + n + 1);
    memcpy(g->lines + g->length, text, n + 1);
    g->length += n;
}

static int direct_launches;
int fake_cuda_direct_launches(void) { return direct_launches; }
CUresult cuLaunchKernel(void *function, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shared, void *stream, void **params, void **extra) {
    Function *f = function;
    if (!capturing) { /* a profiled launch, timed on its own */
        ++direct_launches;
        return f ? OK : INVALID_VALUE;
    }
    char line[8192];
    int at = snprintf(line, sizeof line, "%s %u %u %u %u %u %u", f->name, gx, gy, gz, bx, by, bz);
    for (int i = 0; i < f->params; ++i) {
        at += snprintf(line + at, sizeof line - at, " ");
        const unsigned char *bytes = params[i];
        for (int b = 0; b < f->sizes[i] && at < (int)sizeof line - 3; ++b) at += snprintf(line + at, sizeof line - at, "%02x", bytes[b]);
    }
    snprintf(line + at, sizeof line - at, "\n");
    append(capturing, line);
    return OK;
}
/* for the stand-in cuBLAS (tests/fake_libcublas.c): whether a stream captures, and a library
   call recorded into the graph it captures, as cuBLAS's kernels would be */
int fake_cuda_capturing(void) { return capturing != 0; }
void fake_cuda_record(const char *line) { if (capturing) append(capturing, line); }
CUresult cuStreamBeginCapture(void *stream, int mode) { capturing = calloc(1, sizeof(Graph)); ++captures; return OK; }
CUresult cuStreamEndCapture(void *stream, void **graph) { *graph = capturing; capturing = 0; return OK; }
CUresult cuGraphInstantiateWithFlags(void **exec, void *graph, unsigned long long flags) {
    Graph *g = graph, *copy = calloc(1, sizeof(Graph));
    if (g->length) append(copy, g->lines);
    *exec = copy;
    return OK;
}
CUresult cuGraphDestroy(void *graph) { free(((Graph *)graph)->lines); free(graph); return OK; }
CUresult cuGraphExecDestroy(void *exec) { return cuGraphDestroy(exec); }
CUresult cuGraphLaunch(void *exec, void *stream) {
    const char *path = getenv("FAKE_CUDA_LOG");
    Graph *g = exec;
    if (path && g->length) {
        FILE *log = fopen(path, "a");
        fputs(g->lines, log);
        fputs("--\n", log);
        fclose(log);
    }
    return OK;
}

/* ---- memory: host memory ----------------------------------------------------------------- */
CUresult cuMemAlloc(CUdeviceptr *address, size_t bytes) {
    if (used_bytes + bytes > device_memory()) return OUT_OF_MEMORY;
    size_t *block = malloc(bytes + 16);
    block[0] = bytes;
    used_bytes += bytes;
    *address = (CUdeviceptr)(uintptr_t)(block + 2);
    return OK;
}
CUresult cuMemFree(CUdeviceptr address) {
    size_t *block = (size_t *)(uintptr_t)address - 2;
    used_bytes -= block[0];
    free(block);
    return OK;
}
CUresult cuMemGetInfo(size_t *free_bytes, size_t *total) { *free_bytes = device_memory() - used_bytes; *total = device_memory(); return OK; }
CUresult cuMemcpyHtoDAsync(CUdeviceptr to, const void *from, size_t bytes, void *stream) { memcpy((void *)(uintptr_t)to, from, bytes); return OK; }
CUresult cuMemcpyDtoHAsync(void *to, CUdeviceptr from, size_t bytes, void *stream) { memcpy(to, (void *)(uintptr_t)from, bytes); return OK; }
CUresult cuMemHostRegister(void *p, size_t bytes, unsigned flags) { return OK; }  /* host memory is all alike here */
CUresult cuMemHostUnregister(void *p) { return OK; }
CUresult cuMemsetD32Async(CUdeviceptr to, unsigned value, size_t count, void *stream) {
    for (size_t i = 0; i < count; ++i) ((unsigned *)(uintptr_t)to)[i] = value;
    return OK;
}

/* ---- the device, its context, streams and events ------------------------------------------ */
CUresult cuInit(unsigned flags) { initialized = 1; return OK; }
CUresult cuDriverGetVersion(int *version) { *version = 13000; return OK; }
CUresult cuDeviceGetCount(int *count) { if (!initialized) return NOT_INITIALIZED; *count = 1; return OK; }
CUresult cuDeviceGet(int *device, int ordinal) { if (ordinal != 0) return INVALID_DEVICE; *device = 0; return OK; }
CUresult cuDevicePrimaryCtxRetain(void **context, int device) { *context = &context_storage; ++retained; return OK; }
CUresult cuDevicePrimaryCtxRelease(int device) { --retained; return OK; }
CUresult cuCtxSetCurrent(void *context) { return OK; }
CUresult cuDeviceGetAttribute(int *value, int attribute, int device) {
    const char *arch = getenv("FAKE_CUDA_ARCH");
    int cc = arch ? atoi(arch) : 52;
    if (attribute == 75) *value = cc / 10;       /* CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR */
    else if (attribute == 76) *value = cc % 10;  /* ..._MINOR */
    else return INVALID_VALUE;
    return OK;
}
CUresult cuDeviceGetName(char *name, int length, int device) { snprintf(name, length, "Fake GPU"); return OK; }
CUresult cuDeviceTotalMem(size_t *bytes, int device) { *bytes = device_memory(); return OK; }
CUresult cuStreamCreate(void **stream, unsigned flags) { *stream = &stream_storage; return OK; }
CUresult cuStreamDestroy(void *stream) { return OK; }
CUresult cuStreamSynchronize(void *stream) { return OK; }
CUresult cuEventCreate(void **event, unsigned flags) { *event = &event_storage; return OK; }
CUresult cuEventRecord(void *event, void *stream) { return OK; }
CUresult cuEventSynchronize(void *event) { return OK; }
CUresult cuEventElapsedTime(float *ms, void *start, void *end) { *ms = 0.25f; return OK; }
CUresult cuGetErrorName(CUresult error, const char **name) {
    static char text[64];
    snprintf(text, sizeof text, error == OUT_OF_MEMORY ? "CUDA_ERROR_OUT_OF_MEMORY" : "CUDA_ERROR_%d", error);
    *name = text;
    return OK;
}

/* what the test reads back: contexts retained, graphs captured, modules loaded, bytes allocated */
void fake_cuda_state(int *state) { state[0] = retained; state[1] = captures; state[2] = modules_loaded; state[3] = (int)used_bytes; }

/* how cuda-bindings finds every other function */
CUresult cuGetProcAddress_v2(const char *symbol, void **function, int version, unsigned long long flags, int *status) {
    *function = dlsym(RTLD_DEFAULT, symbol);
    if (status) *status = *function ? 0 : 1;
    return *function ? OK : NOT_FOUND;
}
CUresult cuGetProcAddress(const char *symbol, void **function, int version, unsigned long long flags) {
    return cuGetProcAddress_v2(symbol, function, version, flags, 0);
}
