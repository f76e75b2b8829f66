// Fatal checks of the CUDA benchmarks: a failed absl::Status or CUDA call prints where it
// happened and exits, so that a broken run never reports figures.
#ifndef KVRECALL_BENCH_CUDA_BENCH_CHECK_H_
#define KVRECALL_BENCH_CUDA_BENCH_CHECK_H_

#include <cstdio>
#include <cstdlib>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/cuda/cuda_status.h"

#define CHECK_OK(expr)                                                                  \
  do {                                                                                  \
    const absl::Status _s = (expr);                                                     \
    if (!_s.ok()) {                                                                     \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, _s.ToString().c_str());  \
      std::exit(1);                                                                     \
    }                                                                                   \
  } while (false)
#define CHECK_CUDA(expr) CHECK_OK(::kvrecall::cuda::CudaStatus((expr), #expr))

namespace kvrecall::bench {

template <typename T>
T ValueOrDie(absl::StatusOr<T> v) {
  CHECK_OK(v.status());
  return *std::move(v);
}

}  // namespace kvrecall::bench

#endif  // KVRECALL_BENCH_CUDA_BENCH_CHECK_H_
