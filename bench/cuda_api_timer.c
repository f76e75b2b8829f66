// An LD_PRELOAD shim that times a process's blocking CUDA runtime calls (allocations, frees,
// copies, synchronizations, graph instantiation), for finding where a stall on the step path
// goes on a machine without Nsight Systems (the H200/H100 machines of bench/results). It wraps
// the calls of libcudart.so (kvrecalld links it dynamically) by name and forwards each to the
// real one; a call over KVRECALL_API_TIMER_US microseconds (default 100) is written to
// KVRECALL_API_TIMER_OUT (default stderr) as "start_us duration_us name thread", start from the
// first call; at exit every wrapped function's count, total and largest duration follow.
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

enum { kMaxFunctions = 32 };

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
  const char* path = getenv("KVRECALL_API_TIMER_OUT");
  out = path != NULL ? fopen(path, "w") : NULL;
  if (out == NULL) out = stderr;
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

static void Record(const char* name, int* slot, long long start, long long end) {
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
  fprintf(out, "%lld %lld %s %s\n", (start - origin_ns) / 1000, ns / 1000, name, thread);
  fflush(out);
  pthread_mutex_unlock(&out_mutex);
}

__attribute__((destructor)) static void Summary(void) {
  pthread_mutex_lock(&out_mutex);
  Open();
  const int n = atomic_load(&functions);
  fprintf(out, "# function calls total_us max_us\n");
  for (int i = 0; i < n && i < kMaxFunctions; ++i) {
    fprintf(out, "# %s %lld %lld %lld\n", tallies[i].name, atomic_load(&tallies[i].count),
            atomic_load(&tallies[i].total_ns) / 1000, atomic_load(&tallies[i].max_ns) / 1000);
  }
  fflush(out);
  pthread_mutex_unlock(&out_mutex);
}

// Defines `name(params)` to time the real `name(args)`.
#define TIMED(name, params, args)                                              \
  int name params {                                                            \
    static int (*real) params = NULL;                                          \
    static int slot = -1;                                                      \
    if (real == NULL) {                                                        \
      pthread_mutex_lock(&out_mutex);                                          \
      Open();                                                                  \
      pthread_mutex_unlock(&out_mutex);                                        \
      real = (int(*) params)dlsym(RTLD_NEXT, #name);                           \
    }                                                                          \
    const long long start = NowNs();                                           \
    const int result = real args;                                              \
    Record(#name, &slot, start, NowNs());                                      \
    return result;                                                             \
  }

TIMED(cudaMalloc, (void** p, size_t n), (p, n))
TIMED(cudaFree, (void* p), (p))
TIMED(cudaMallocHost, (void** p, size_t n), (p, n))
TIMED(cudaHostAlloc, (void** p, size_t n, unsigned flags), (p, n, flags))
TIMED(cudaFreeHost, (void* p), (p))
TIMED(cudaHostRegister, (void* p, size_t n, unsigned flags), (p, n, flags))
TIMED(cudaHostUnregister, (void* p), (p))
TIMED(cudaMemset, (void* p, int v, size_t n), (p, v, n))
TIMED(cudaMemcpy, (void* d, const void* s, size_t n, int kind), (d, s, n, kind))
TIMED(cudaMemcpy2D, (void* d, size_t dp, const void* s, size_t sp, size_t w, size_t h, int kind),
      (d, dp, s, sp, w, h, kind))
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
