// The graph build's batch top-k on the GPU: a BatchTopKFunction (index/batch_topk.h) backed by
// the cuBLAS kernels of kernels/cuda/batch_topk.h. Built only with KVRECALL_WITH_CUDA.
#ifndef KVRECALL_INDEX_GPU_BATCH_TOPK_H_
#define KVRECALL_INDEX_GPU_BATCH_TOPK_H_

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "index/batch_topk.h"

namespace kvrecall {

// What the calls of a GPU batch top-k did, for benchmarks: how many, their seconds (each call's
// own, waiting for the device included, not for another call) and how many multiplied bf16,
// f16 or f32 inputs (cuda::GpuBatchTopK::GemmInput).
struct GpuBatchTopKStats {
  int64_t calls = 0;
  double seconds = 0;
  int64_t bf16_calls = 0;
  int64_t f16_calls = 0;
  int64_t f32_calls = 0;
};

// A BatchTopKFunction backed by one cuda::GpuBatchTopK on the current device; concurrent
// calls are serialized. Errors of CUDA (no device, out of memory) come back from this call or
// from a call of the function. `stats`, when given, is updated by every successful call (under
// the function's lock: read it when no call runs).
absl::StatusOr<BatchTopKFunction> MakeGpuBatchTopKFunction(
    std::shared_ptr<GpuBatchTopKStats> stats = nullptr);

}  // namespace kvrecall

#endif  // KVRECALL_INDEX_GPU_BATCH_TOPK_H_
