// How many threads a parallel loop of the CPU kernels and the server is worth (the compute
// pool's, kernels/cpu/thread_pool.h, for the decode path; OpenMP's for prompt-time builds).
#ifndef KVRECALL_KERNELS_CPU_PARALLEL_H_
#define KVRECALL_KERNELS_CPU_PARALLEL_H_

#include <omp.h>

#include <algorithm>
#include <cstdint>

namespace kvrecall::cpu {

// A loop's hand-out to other threads and their join cost microseconds per thread and, on a
// busy host (or when they slept), a wait for each thread to be scheduled, so a thread must
// have enough work to pay for itself: a decode step over a small support (a streaming
// session's static set, a few hundred top-K tokens per head) is done sooner by a few threads
// than by all of the host's cores (measured on a 16-core host with OpenMP teams: a 32-head
// step over 64 tokens took 40 us on 4 threads, 35-95 us on 16 and 85-100 us on one).
// 2^17 multiply-adds take about 10-20 us on one core.
inline constexpr int64_t kMultiplyAddsPerThread = int64_t{1} << 17;

// Threads for a loop of `multiply_adds` arithmetic in total over `items` independent items
// (at most one thread per item, at most OpenMP's limit, at least 1).
inline int ThreadsFor(int64_t multiply_adds, int64_t items) {
  const int64_t by_work = multiply_adds / kMultiplyAddsPerThread;
  return static_cast<int>(
      std::max<int64_t>(1, std::min({by_work, items, int64_t{omp_get_max_threads()}})));
}

}  // namespace kvrecall::cpu

#endif  // KVRECALL_KERNELS_CPU_PARALLEL_H_
