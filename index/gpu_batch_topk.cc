#include "index/gpu_batch_topk.h"

#include <chrono>
#include <memory>
#include <mutex>
#include <utility>

#include "kernels/cuda/batch_topk.h"

namespace kvrecall {

absl::StatusOr<BatchTopKFunction> MakeGpuBatchTopKFunction(
    std::shared_ptr<GpuBatchTopKStats> stats) {
  absl::StatusOr<std::unique_ptr<cuda::GpuBatchTopK>> gpu = cuda::GpuBatchTopK::Create();
  if (!gpu.ok()) return gpu.status();
  // The kernels' first launches and cuBLAS's setup now, not in the first build.
  if (absl::Status s = (*gpu)->WarmUp(); !s.ok()) return s;
  struct Shared {
    std::mutex mu;
    std::unique_ptr<cuda::GpuBatchTopK> gpu;
    std::shared_ptr<GpuBatchTopKStats> stats;
  };
  auto shared = std::make_shared<Shared>();
  shared->gpu = *std::move(gpu);
  shared->stats = std::move(stats);
  return BatchTopKFunction(
      [shared](const VectorSet& queries, const VectorSet& keys, int k, TopKLists* out,
               std::span<const int64_t> visible, const BuildStop& stop) {
        if (absl::Status s = CheckBatchTopKArgs(queries, keys, k, visible); !s.ok()) return s;
        std::lock_guard<std::mutex> lock(shared->mu);
        // Asked once the device is ours: other builds' calls may have kept it long. A call
        // itself is short (a 128K layer's lists take ~0.3 s on an H200) and is not stopped.
        if (stop.requested()) return BuildStop::Status("the GPU batch top-k");
        const auto start = std::chrono::steady_clock::now();
        absl::Status s = shared->gpu->Run(queries, keys, k, out, visible);
        if (s.ok() && shared->stats != nullptr) {
          GpuBatchTopKStats& stats = *shared->stats;
          ++stats.calls;
          stats.seconds +=
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
          switch (shared->gpu->last_gemm_input()) {
            case cuda::GpuBatchTopK::GemmInput::kBf16:
              ++stats.bf16_calls;
              break;
            case cuda::GpuBatchTopK::GemmInput::kF16:
              ++stats.f16_calls;
              break;
            case cuda::GpuBatchTopK::GemmInput::kF32:
              ++stats.f32_calls;
              break;
          }
        }
        return s;
      });
}

}  // namespace kvrecall
