// Host-side launch helpers shared by the CUDA wrappers: the device's multiprocessor count and
// a kernel's resident blocks per multiprocessor, each read once per device, and the opt-in to
// more than 48 KB of dynamic shared memory.
#ifndef KVRECALL_KERNELS_CUDA_LAUNCH_CUH_
#define KVRECALL_KERNELS_CUDA_LAUNCH_CUH_

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <mutex>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/decode_types.h"

namespace kvrecall::cuda {

// Device ordinals the per-device caches below hold; kvrecalld serves several GPUs in one
// process, and a kernel's attributes belong to each device's context.
inline constexpr int kMaxCachedDevices = 64;

// The current device, checked against kMaxCachedDevices.
inline absl::StatusOr<int> CachedDevice() {
  int device = 0;
  KVRECALL_CUDA_RETURN_IF_ERROR(CudaStatus(cudaGetDevice(&device), "cudaGetDevice"));
  if (device < 0 || device >= kMaxCachedDevices) {
    return absl::OutOfRangeError(absl::StrCat("CUDA device ", device, " is beyond the ",
                                              kMaxCachedDevices, " the launch helpers serve"));
  }
  return device;
}

// Something computed once per device, on first use from that device: compute(device).
template <typename T>
class PerDevice {
 public:
  template <typename Compute>
  absl::StatusOr<T> Get(const Compute& compute) {
    const absl::StatusOr<int> device = CachedDevice();
    if (!device.ok()) return device.status();
    Slot& slot = slots_[*device];
    // (void): nvcc warns of the discarded StatusOr& that the assignment yields.
    std::call_once(slot.once, [&] { (void)(slot.value = compute(*device)); });
    return slot.value;
  }

 private:
  struct Slot {
    std::once_flag once;
    absl::StatusOr<T> value;
  };
  Slot slots_[kMaxCachedDevices];
};

// Multiprocessors of the current device (read once per device).
inline absl::StatusOr<int> MultiprocessorCount() {
  static PerDevice<int> count;
  return count.Get([](int device) -> absl::StatusOr<int> {
    int sms = 0;
    KVRECALL_CUDA_RETURN_IF_ERROR(CudaStatus(
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
        "reading the multiprocessor count"));
    return sms;
  });
}

// The current device's shared memory per block when a kernel opts in (its static and dynamic
// parts together), read once per device.
inline absl::StatusOr<int> MaxSharedMemoryPerBlock() {
  static PerDevice<int> bytes;
  return bytes.Get([](int device) -> absl::StatusOr<int> {
    int value = 0;
    KVRECALL_CUDA_RETURN_IF_ERROR(CudaStatus(
        cudaDeviceGetAttribute(&value, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
        "reading the shared memory per block"));
    return value;
  });
}

// Prepares kKernel for `smem_bytes` of dynamic shared memory and returns how many of its blocks
// of `threads` fit on one multiprocessor. Done once per kernel and device (each kernel launches
// with one fixed shared-memory size), before any graph capture that launches it.
template <auto kKernel>
absl::StatusOr<int> PrepareKernel(int threads, size_t smem_bytes) {
  static PerDevice<int> blocks;
  return blocks.Get([&](int /*device: the current one*/) -> absl::StatusOr<int> {
    cudaFuncAttributes attrs{};
    KVRECALL_CUDA_RETURN_IF_ERROR(
        CudaStatus(cudaFuncGetAttributes(&attrs, kKernel), "reading kernel attributes"));
    // Without the opt-in a block has 48 KB, its static shared memory included.
    if (smem_bytes + attrs.sharedSizeBytes > 48 * 1024) {
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
  });
}

// Makes sure kKernel may launch with `bytes` of dynamic shared memory on the current device,
// raising its limit when needed and never lowering it, so that callers with different sizes
// coexist. Raises are serialized: two threads raising to different sizes at once could
// otherwise leave the smaller limit set while recording the larger. INVALID_ARGUMENT when
// `bytes` and the kernel's static shared memory exceed what the device gives a block.
template <auto kKernel>
absl::Status AllowDynamicSharedMemory(size_t bytes) {
  static std::atomic<size_t> allowed[kMaxCachedDevices];
  static std::mutex raising;
  const absl::StatusOr<int> device = CachedDevice();
  if (!device.ok()) return device.status();
  std::atomic<size_t>& limit = allowed[*device];
  if (bytes <= limit.load(std::memory_order_acquire)) return absl::OkStatus();
  const std::lock_guard<std::mutex> lock(raising);
  if (bytes <= limit.load(std::memory_order_relaxed)) return absl::OkStatus();
  cudaFuncAttributes attrs{};
  KVRECALL_CUDA_RETURN_IF_ERROR(
      CudaStatus(cudaFuncGetAttributes(&attrs, kKernel), "reading kernel attributes"));
  // Beyond what the device gives a block, beside the kernel's static part, the raise (or the
  // launch) would fail as the device's error: it is the caller's size, said as such.
  const absl::StatusOr<int> most = MaxSharedMemoryPerBlock();
  if (!most.ok()) return most.status();
  if (bytes + attrs.sharedSizeBytes > static_cast<size_t>(*most)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a launch asks ", bytes, " bytes of dynamic shared memory beside the kernel's ",
        attrs.sharedSizeBytes, " static; this GPU gives a block ", *most));
  }
  if (static_cast<size_t>(attrs.maxDynamicSharedSizeBytes) < bytes) {
    KVRECALL_CUDA_RETURN_IF_ERROR(CudaStatus(
        cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(bytes)),
        "raising a kernel's dynamic shared-memory limit"));
  }
  limit.store(bytes, std::memory_order_release);
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
