// When a loop of the CPU kernels and the server is worth an OpenMP team.
#ifndef KVRECALL_KERNELS_CPU_PARALLEL_H_
#define KVRECALL_KERNELS_CPU_PARALLEL_H_

#include <cstdint>

namespace kvrecall::cpu {

// A team's fork and join cost a few microseconds and, on a busy host, a wait for the other
// threads to be scheduled; a decode step over a small support (the static set of a streaming
// session, a few hundred top-K tokens) is done sooner by its own thread. 2^16 multiply-adds
// take about 5-10 us on one core.
inline constexpr int64_t kMinParallelMultiplyAdds = int64_t{1} << 16;

// Whether a loop of `multiply_adds` arithmetic in total should run on an OpenMP team.
inline bool WorthParallel(int64_t multiply_adds) {
  return multiply_adds >= kMinParallelMultiplyAdds;
}

}  // namespace kvrecall::cpu

#endif  // KVRECALL_KERNELS_CPU_PARALLEL_H_
