// An LD_PRELOAD shim that times a process's CUDA runtime calls (allocations, frees, copies,
// synchronizations, graph instantiation; launches, events and attributes too, since d117), for
// finding where a stall on the step path goes on a machine without Nsight Systems (the H200/H100
// machines of bench/results). It wraps the calls of libcudart.so (kvrecalld links it
// dynamically) by name and forwards each to the real one; a call over KVRECALL_API_TIMER_US
// microseconds (default 100) is written to KVRECALL_API_TIMER_OUT (default stderr) as "start_us
// duration_us name thread", start from the first call; at exit every wrapped function's count,
// total and largest duration follow.
//
//   LD_PRELOAD=libkvrecall_cuda_api_timer.so KVRECALL_API_TIMER_OUT=calls.txt kvrecalld ...
//
// The signatures are the runtime API's with its handle and enum types spelled as void* and int,
// so that the shim builds without the CUDA headers.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

enum { kMaxFunctions = 48 };

struct Tally {
  const char* name;
  _Atomic long long count, total_ns, max_ns;
};

static struct Tally tallies[kMaxFunctions];
static _Atomic int functions = 0;
static pthread_mutex_t out_mutex = PTHREAD_MUTEX_INITIALIZER;
static FILE* out = NULL;
static long long threshold_ns = 100000;
static long long origin_ns = -1;

static long long NowNs(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1000000000LL + t.tv_nsec;
}

static void Open(void) {
  if (out != NULL) return;
  const char* us = getenv("KVRECALL_API_TIMER_US");
  if (us != NULL) threshold_ns = atoll(us) * 1000;
  // Appended to: every process that inherits LD_PRELOAD loads the shim, and one that makes no
  // CUDA call must not wipe what the process being timed wrote.
  const char* path = getenv("KVRECALL_API_TIMER_OUT");
  out = path != NULL ? fopen(path, "a") : NULL;
  if (out == NULL) {
    if (path != NULL) fprintf(stderr, "cuda_api_timer: cannot open %s: writing here\n", path);
    out = stderr;
  }
  origin_ns = NowNs();
}

// The tally of `name`, registered at its first call.
static struct Tally* TallyOf(const char* name, int* slot) {
  if (*slot < 0) {
    pthread_mutex_lock(&out_mutex);
    if (*slot < 0) {
      const int i = atomic_fetch_add(&functions, 1);
      if (i < kMaxFunctions) tallies[i].name = name;
      *slot = i;
    }
    pthread_mutex_unlock(&out_mutex);
  }
  return *slot < kMaxFunctions ? &tallies[*slot] : NULL;
}

// Records a call of `name` from `start` to `end`; when it is written (slow), `detail` (null:
// none) follows its name: what it moved or allocated.
static void Record(const char* name, int* slot, long long start, long long end,
                   const char* detail) {
  struct Tally* tally = TallyOf(name, slot);
  const long long ns = end - start;
  if (tally != NULL) {
    atomic_fetch_add(&tally->count, 1);
    atomic_fetch_add(&tally->total_ns, ns);
    long long max = atomic_load(&tally->max_ns);
    while (ns > max && !atomic_compare_exchange_weak(&tally->max_ns, &max, ns)) {
    }
  }
  if (ns < threshold_ns) return;
  char thread[32] = "?";
  pthread_getname_np(pthread_self(), thread, sizeof(thread));
  pthread_mutex_lock(&out_mutex);
  Open();
  fprintf(out, "%lld %lld %s%s%s %s\n", (start - origin_ns) / 1000, ns / 1000, name,
          detail != NULL ? ":" : "", detail != NULL ? detail : "", thread);
  fflush(out);
  pthread_mutex_unlock(&out_mutex);
}

// At exit (from main or exit(); not after _Exit or a kill: the slow calls are written as they
// happen).
__attribute__((destructor)) static void Summary(void) {
  const int n = atomic_load(&functions);
  if (n == 0) return;  // a process that made no timed call (a shell's child)
  pthread_mutex_lock(&out_mutex);
  Open();
  fprintf(out, "# function calls total_us max_us\n");
  for (int i = 0; i < n && i < kMaxFunctions; ++i) {
    fprintf(out, "# %s %lld %lld %lld\n", tallies[i].name, atomic_load(&tallies[i].count),
            atomic_load(&tallies[i].total_ns) / 1000, atomic_load(&tallies[i].max_ns) / 1000);
  }
  fflush(out);
  pthread_mutex_unlock(&out_mutex);
}

// The real function `name` of the runtime after the shim.
static void* Real(const char* name) {
  pthread_mutex_lock(&out_mutex);
  Open();
  pthread_mutex_unlock(&out_mutex);
  void* real = dlsym(RTLD_NEXT, name);
  if (real == NULL) {
    fprintf(stderr, "cuda_api_timer: no %s after the shim\n", name);
    abort();
  }
  return real;
}

// The memory type of `p` (cudaPointerGetAttributes: 0 unregistered host, 1 registered or pinned
// host, 2 device, 3 managed; -1 when it fails).
static int MemoryType(const void* p) {
  struct Attributes {
    int type, device;
    void *device_pointer, *host_pointer;
    long reserved[8];
  } attributes;
  static int (*get)(struct Attributes*, const void*) = NULL;
  if (get == NULL) get = (int (*)(struct Attributes*, const void*))Real("cudaPointerGetAttributes");
  return get(&attributes, p) == 0 ? attributes.type : -1;
}

// Defines `name(params)` to time the real `name(args)`; a call written (slow) says after its
// name what `format` and its arguments make of the call's (what it moved or allocated).
#define TIMED_DETAIL(name, params, args, format, ...)                        \
  int name params {                                                         \
    static int (*real) params = NULL;                                       \
    static int slot = -1;                                                   \
    if (real == NULL) real = (int(*) params)Real(#name);                    \
    const long long start = NowNs();                                        \
    const int result = real args;                                           \
    const long long end = NowNs();                                          \
    char detail[96] = "";                                                   \
    if (end - start >= threshold_ns) {                                      \
      snprintf(detail, sizeof(detail), format, __VA_ARGS__);                \
    }                                                                       \
    Record(#name, &slot, start, end, detail[0] != '\0' ? detail : NULL);    \
    return result;                                                          \
  }
#define TIMED(name, params, args) TIMED_DETAIL(name, params, args, "%s", "")

// Copies: kind (cudaMemcpyKind), bytes and the two sides' memory types; allocations: bytes.
TIMED_DETAIL(cudaMemcpy, (void* d, const void* s, size_t n, int kind), (d, s, n, kind),
             "kind%d,%zuB,src%d,dst%d", kind, n, MemoryType(s), MemoryType(d))
TIMED_DETAIL(cudaMemcpy2D,
             (void* d, size_t dp, const void* s, size_t sp, size_t w, size_t h, int kind),
             (d, dp, s, sp, w, h, kind), "kind%d,%zuB,src%d,dst%d", kind, w * h, MemoryType(s),
             MemoryType(d))
TIMED_DETAIL(cudaMalloc, (void** p, size_t n), (p, n), "%zuB", n)
TIMED_DETAIL(cudaHostAlloc, (void** p, size_t n, unsigned flags), (p, n, flags), "%zuB", n)
TIMED_DETAIL(cudaHostRegister, (void* p, size_t n, unsigned flags), (p, n, flags), "%zuB", n)

TIMED(cudaFree, (void* p), (p))
TIMED(cudaMallocHost, (void** p, size_t n), (p, n))
TIMED(cudaFreeHost, (void* p), (p))
TIMED(cudaHostUnregister, (void* p), (p))
TIMED(cudaMemset, (void* p, int v, size_t n), (p, v, n))
TIMED(cudaMemcpyAsync, (void* d, const void* s, size_t n, int kind, void* stream),
      (d, s, n, kind, stream))
TIMED(cudaStreamSynchronize, (void* stream), (stream))
TIMED(cudaDeviceSynchronize, (void), ())
TIMED(cudaEventSynchronize, (void* event), (event))
TIMED(cudaStreamBeginCapture, (void* stream, int mode), (stream, mode))
TIMED(cudaStreamEndCapture, (void* stream, void** graph), (stream, graph))
TIMED(cudaGraphInstantiate, (void** exec, void* graph, unsigned long long flags),
      (exec, graph, flags))
TIMED(cudaGraphInstantiateWithFlags, (void** exec, void* graph, unsigned long long flags),
      (exec, graph, flags))
TIMED(cudaGraphExecDestroy, (void* exec), (exec))
TIMED(cudaGraphDestroy, (void* graph), (graph))
TIMED(cudaGraphLaunch, (void* exec, void* stream), (exec, stream))
TIMED(cudaStreamCreateWithFlags, (void** stream, unsigned flags), (stream, flags))
TIMED(cudaStreamDestroy, (void* stream), (stream))
TIMED(cudaEventCreateWithFlags, (void** event, unsigned flags), (event, flags))
TIMED(cudaEventDestroy, (void* event), (event))

// The calls a step makes many of (launches, their attributes, events, async copies), so that a
// low threshold shows where a step's host time goes between the blocking ones. dim3 by value, as
// the runtime's launch takes it.
struct Dim3 {
  unsigned x, y, z;
};
TIMED_DETAIL(cudaLaunchKernel,
             (const void* func, struct Dim3 grid, struct Dim3 block, void** args, size_t shmem,
              void* stream),
             (func, grid, block, args, shmem, stream), "%p,%ux%u,%zuB", func, grid.x, grid.y,
             shmem)
// (What nvcc's launch stubs call since CUDA 13: a kernel handle where cudaLaunchKernel takes the
// function.)
TIMED_DETAIL(__cudaLaunchKernel,
             (const void* kernel, struct Dim3 grid, struct Dim3 block, void** args, size_t shmem,
              void* stream),
             (kernel, grid, block, args, shmem, stream), "%p,%ux%u,%zuB", kernel, grid.x, grid.y,
             shmem)
TIMED(cudaFuncSetAttribute, (const void* func, int attribute, int value), (func, attribute, value))
TIMED(cudaFuncGetAttributes, (void* attributes, const void* func), (attributes, func))
TIMED(cudaMemsetAsync, (void* p, int v, size_t n, void* stream), (p, v, n, stream))
TIMED(cudaMemcpy2DAsync,
      (void* d, size_t dp, const void* s, size_t sp, size_t w, size_t h, int kind, void* stream),
      (d, dp, s, sp, w, h, kind, stream))
TIMED(cudaEventRecord, (void* event, void* stream), (event, stream))
TIMED(cudaStreamWaitEvent, (void* stream, void* event, unsigned flags), (stream, event, flags))
TIMED(cudaSetDevice, (int device), (device))
