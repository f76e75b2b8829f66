// Host-side launch helpers shared by the CUDA wrappers: the device's multiprocessor count and
// a kernel's resident blocks per multiprocessor, each read once, and the opt-in to more than
// 48 KB of dynamic shared memory.
#ifndef KVRECALL_KERNELS_CUDA_LAUNCH_CUH_
#define KVRECALL_KERNELS_CUDA_LAUNCH_CUH_

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>

#include "absl/status/statusor.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/decode_types.h"

namespace kvrecall::cuda {

// Multiprocessors of the current device (read on first use; one device per process).
inline absl::StatusOr<int> MultiprocessorCount() {
  static const absl::StatusOr<int> count = []() -> absl::StatusOr<int> {
    int device = 0;
    KVRECALL_CUDA_RETURN_IF_ERROR(CudaStatus(cudaGetDevice(&device), "cudaGetDevice"));
    int sms = 0;
    KVRECALL_CUDA_RETURN_IF_ERROR(CudaStatus(
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
        "reading the multiprocessor count"));
    return sms;
  }();
  return count;
}

// Prepares kKernel for `smem_bytes` of dynamic shared memory and returns how many of its blocks
// of `threads` fit on one multiprocessor. Done once per kernel (each launches with one fixed shared-memory size), before
// any graph capture that launches it.
template <auto kKernel>
absl::StatusOr<int> PrepareKernel(int threads, size_t smem_bytes) {
  static const absl::StatusOr<int> blocks = [&]() -> absl::StatusOr<int> {
    if (smem_bytes > 48 * 1024) {
      KVRECALL_CUDA_RETURN_IF_ERROR(CudaStatus(
          cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(smem_bytes)),
          "raising a kernel's shared-memory limit"));
    }
    int per_sm = 0;
    KVRECALL_CUDA_RETURN_IF_ERROR(CudaStatus(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kKernel, threads, smem_bytes),
        "reading a kernel's occupancy"));
    return std::max(per_sm, 1);
  }();
  return blocks;
}

// Makes sure kKernel may launch with `bytes` of dynamic shared memory, raising its limit when
// needed (never lowering it, so callers with different sizes coexist). The limit is read from
// the device only when a larger size than any before is asked for.
template <auto kKernel>
absl::Status AllowDynamicSharedMemory(size_t bytes) {
  static std::atomic<size_t> allowed{0};
  if (bytes <= allowed.load(std::memory_order_relaxed)) return absl::OkStatus();
  cudaFuncAttributes attrs{};
  KVRECALL_CUDA_RETURN_IF_ERROR(
      CudaStatus(cudaFuncGetAttributes(&attrs, kKernel), "reading kernel attributes"));
  if (static_cast<size_t>(attrs.maxDynamicSharedSizeBytes) < bytes) {
    KVRECALL_CUDA_RETURN_IF_ERROR(CudaStatus(
        cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(bytes)),
        "raising a kernel's dynamic shared-memory limit"));
  }
  size_t seen = allowed.load(std::memory_order_relaxed);
  while (seen < bytes && !allowed.compare_exchange_weak(seen, bytes)) {
  }
  return absl::OkStatus();
}

// Blocks of kKernel the whole device holds at once (PrepareKernel's count times the
// multiprocessors): the size of one full wave.
template <auto kKernel>
absl::StatusOr<int> DeviceBlockSlots(int threads, size_t smem_bytes) {
  const absl::StatusOr<int> per_sm = PrepareKernel<kKernel>(threads, smem_bytes);
  if (!per_sm.ok()) return per_sm.status();
  const absl::StatusOr<int> sms = MultiprocessorCount();
  if (!sms.ok()) return sms.status();
  return *per_sm * *sms;
}

inline int CeilDiv(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

// Query heads one key-scanning block serves: the largest of 8, 4, 2, 1 dividing the GQA group,
// so that the heads of a KV head share its key reads while registers stay bounded.
inline int HeadsPerBlock(int group) {
  for (int g : {8, 4, 2}) {
    if (group % g == 0) return g;
  }
  return 1;
}

// Splits up to max_tokens keys of each of `row_blocks` block rows for a kernel of which the
// device holds `slots` blocks at once: as many splits as fit in one wave (a second, partial
// wave would double the time), each split at least four tiles (so each block amortizes its
// pipeline fill and its share of any merge), at most max_splits splits.
inline SplitPlan PlanKeySplits(int max_tokens, int tile, int row_blocks, int slots,
                               int max_splits) {
  constexpr int kMinTilesPerSplit = 4;
  if (max_tokens <= 0) return SplitPlan{1, tile};
  int splits = slots / row_blocks;
  splits = std::min({splits, max_splits, CeilDiv(max_tokens, tile * kMinTilesPerSplit)});
  splits = std::max(splits, 1);
  const int chunk = CeilDiv(CeilDiv(max_tokens, splits), tile) * tile;
  return SplitPlan{CeilDiv(max_tokens, chunk), chunk};
}

}  // namespace kvrecall::cuda

#endif  // KVRECALL_KERNELS_CUDA_LAUNCH_CUH_
