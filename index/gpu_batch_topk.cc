#include "index/gpu_batch_topk.h"

#include <memory>
#include <mutex>
#include <utility>

#include "kernels/cuda/batch_topk.h"

namespace kvrecall {

absl::StatusOr<BatchTopKFunction> MakeGpuBatchTopKFunction() {
  absl::StatusOr<std::unique_ptr<cuda::GpuBatchTopK>> gpu = cuda::GpuBatchTopK::Create();
  if (!gpu.ok()) return gpu.status();
  struct Shared {
    std::mutex mu;
    std::unique_ptr<cuda::GpuBatchTopK> gpu;
  };
  auto shared = std::make_shared<Shared>();
  shared->gpu = *std::move(gpu);
  return BatchTopKFunction(
      [shared](const VectorSet& queries, const VectorSet& keys, int k, TopKLists* out,
               std::span<const int64_t> visible) {
        if (absl::Status s = CheckBatchTopKArgs(queries, keys, k, visible); !s.ok()) return s;
        std::lock_guard<std::mutex> lock(shared->mu);
        return shared->gpu->Run(queries, keys, k, out, visible);
      });
}

}  // namespace kvrecall
