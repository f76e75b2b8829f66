#include "kernels/cuda/step_io.h"

#include <cuda_runtime.h>

#include <algorithm>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/kernel_errors.h"

namespace kvrecall::cuda {
namespace {

constexpr int kThreads = 256;
// Blocks of a copy: enough 16-byte loads in flight to cover PCIe's latency for a step's few
// hundred kilobytes, few enough to start at once.
constexpr int kMaxCopyBlocks = 64;
constexpr size_t kVectorsPerBlock = 4 * kThreads;

// What a copy's kernel is given: `vectors` 16-byte vectors, then `tail` bytes.
struct CopyPlan {
  const uint4* src;
  uint4* dst;
  size_t vectors;
  const unsigned char* tail_src;
  unsigned char* tail_dst;
  int tail;
  int blocks;
};

__device__ __forceinline__ void CopyShare(const CopyPlan& p) {
  const size_t stride = static_cast<size_t>(gridDim.x) * kThreads;
  for (size_t i = static_cast<size_t>(blockIdx.x) * kThreads + threadIdx.x; i < p.vectors;
       i += stride) {
    p.dst[i] = p.src[i];
  }
  if (blockIdx.x == 0 && threadIdx.x < p.tail) p.tail_dst[threadIdx.x] = p.tail_src[threadIdx.x];
}

__device__ __forceinline__ uint64_t GlobalTimer() {
  uint64_t now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  return now;
}

__global__ void __launch_bounds__(kThreads) CopyKernel(const CopyPlan p) { CopyShare(p); }

__global__ void __launch_bounds__(kThreads)
    PublishKernel(const CopyPlan p, unsigned* blocks_done, uint64_t* flag) {
  CopyShare(p);
  __threadfence_system();  // this thread's bytes, visible to the host before the count below
  __syncthreads();
  if (threadIdx.x != 0) return;
  // Again after the barrier, so that the block's bytes are ordered before the count in the
  // memory model's terms too (not only because each fence waited for its thread's writes).
  __threadfence_system();
  if (atomicAdd(blocks_done, 1u) != gridDim.x - 1) return;
  // The last block: every other block's bytes were fenced before it counted itself.
  *blocks_done = 0;
  __threadfence_system();
  *reinterpret_cast<volatile uint64_t*>(flag) = max(GlobalTimer(), uint64_t{1});
}

// One block: thread 0 polls (a PCIe read each, spaced so as not to crowd the link the step's
// other kernels read the host over), then the block copies.
__global__ void __launch_bounds__(kThreads) AwaitHostWordsKernel(const HostWords w) {
  __shared__ bool came;
  if (threadIdx.x == 0) {
    const uint64_t expected = *w.expected;
    const uint64_t start = GlobalTimer();
    const volatile uint64_t* ready = w.ready;
    bool seen = *ready == expected;
    while (!seen && GlobalTimer() - start < w.timeout_ns) {
      __nanosleep(500);
      seen = *ready == expected;
    }
    // The words were written before `ready`: ordered before this thread's reads of them below
    // (and, through the barrier, the block's).
    __threadfence_system();
    came = seen;
    if (!seen) atomicOr(w.error_word, kErrorHostWordsLate);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < w.count; i += kThreads) {
    w.dst[i] = came ? reinterpret_cast<const volatile int32_t*>(w.words)[i] : w.fill;
  }
  if (w.stamp != nullptr && threadIdx.x == 0) *w.stamp = GlobalTimer();
}

struct StampPlaces {
  uint64_t* at[kMaxStampPlaces];
  int count;
};

__global__ void StampKernel(const StampPlaces places) {
  const uint64_t now = GlobalTimer();
  for (int i = 0; i < places.count; ++i) places.at[i][0] = now;
}

// The plan of a copy of `bytes` (> 0), or INVALID_ARGUMENT for null or misaligned pointers.
absl::StatusOr<CopyPlan> PlanCopy(const void* src, void* dst, size_t bytes) {
  if (src == nullptr || dst == nullptr) {
    return absl::InvalidArgumentError("a copy by kernel needs a source and a destination");
  }
  const uintptr_t src_offset = reinterpret_cast<uintptr_t>(src) % 16;
  const uintptr_t dst_offset = reinterpret_cast<uintptr_t>(dst) % 16;
  if (src_offset != 0 || dst_offset != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a copy by kernel needs 16-byte aligned pointers; got the source at ", src_offset,
        " and the destination at ", dst_offset, " bytes past a multiple of 16"));
  }
  CopyPlan p;
  p.vectors = bytes / 16;
  p.tail = static_cast<int>(bytes % 16);
  p.blocks = static_cast<int>(std::clamp<size_t>(
      (p.vectors + kVectorsPerBlock - 1) / kVectorsPerBlock, 1, kMaxCopyBlocks));
  const auto* from = static_cast<const unsigned char*>(src);
  auto* to = static_cast<unsigned char*>(dst);
  p.src = reinterpret_cast<const uint4*>(from);
  p.dst = reinterpret_cast<uint4*>(to);
  p.tail_src = from + p.vectors * 16;
  p.tail_dst = to + p.vectors * 16;
  return p;
}

}  // namespace

absl::Status CopyByKernel(const void* src, void* dst, size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return absl::OkStatus();
  absl::StatusOr<CopyPlan> p = PlanCopy(src, dst, bytes);
  if (!p.ok()) return p.status();
  CopyKernel<<<p->blocks, kThreads, 0, stream>>>(*p);
  return LaunchStatus("CopyKernel");
}

absl::Status PublishToHost(const void* src, void* dst, size_t bytes, unsigned* blocks_done,
                           uint64_t* flag, cudaStream_t stream) {
  if (blocks_done == nullptr || flag == nullptr) {
    return absl::InvalidArgumentError("publishing to the host needs a block count and a flag");
  }
  if (reinterpret_cast<uintptr_t>(blocks_done) % alignof(unsigned) != 0 ||
      reinterpret_cast<uintptr_t>(flag) % alignof(uint64_t) != 0) {
    return absl::InvalidArgumentError(
        "publishing to the host needs a 4-byte aligned block count and an 8-byte aligned flag");
  }
  absl::StatusOr<CopyPlan> p = PlanCopy(src, dst, std::max<size_t>(bytes, 1));
  if (!p.ok()) return p.status();
  if (bytes == 0) p->tail = 0;  // nothing to copy: the flag alone
  PublishKernel<<<p->blocks, kThreads, 0, stream>>>(*p, blocks_done, flag);
  return LaunchStatus("PublishKernel");
}

absl::Status AwaitHostWords(const HostWords& w, cudaStream_t stream) {
  if (w.ready == nullptr || w.expected == nullptr || w.error_word == nullptr ||
      (w.count > 0 && (w.words == nullptr || w.dst == nullptr)) || w.count < 0) {
    return absl::InvalidArgumentError(
        "awaiting host words needs a ready word, an expected value, an error word, and words and "
        "a destination for a count >= 0");
  }
  if (reinterpret_cast<uintptr_t>(w.ready) % alignof(uint64_t) != 0 ||
      reinterpret_cast<uintptr_t>(w.expected) % alignof(uint64_t) != 0 ||
      reinterpret_cast<uintptr_t>(w.stamp) % alignof(uint64_t) != 0) {
    return absl::InvalidArgumentError(
        "awaiting host words needs 8-byte aligned ready, expected and stamp words");
  }
  AwaitHostWordsKernel<<<1, kThreads, 0, stream>>>(w);
  return LaunchStatus("AwaitHostWordsKernel");
}

absl::Status StampTime(std::initializer_list<uint64_t*> places, cudaStream_t stream) {
  if (places.size() == 0 || places.size() > kMaxStampPlaces) {
    return absl::InvalidArgumentError(absl::StrCat("a time stamp goes to 1 to ",
                                                   kMaxStampPlaces, " places; got ",
                                                   places.size()));
  }
  StampPlaces at{};
  for (uint64_t* place : places) {
    if (place == nullptr) return absl::InvalidArgumentError("a null place for a time stamp");
    if (reinterpret_cast<uintptr_t>(place) % alignof(uint64_t) != 0) {
      return absl::InvalidArgumentError("a time stamp's place must be 8-byte aligned");
    }
    at.at[at.count++] = place;
  }
  StampKernel<<<1, 1, 0, stream>>>(at);
  return LaunchStatus("StampKernel");
}

}  // namespace kvrecall::cuda
