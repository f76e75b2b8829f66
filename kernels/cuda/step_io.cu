#include "kernels/cuda/step_io.h"

#include <cuda_runtime.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_status.h"

namespace kvrecall::cuda {
namespace {

constexpr int kThreads = 256;
// Blocks of a copy: enough 16-byte loads in flight to cover PCIe's latency for a step's few
// hundred kilobytes, few enough to start at once.
constexpr int kMaxCopyBlocks = 64;
constexpr size_t kVectorsPerBlock = 4 * kThreads;

__global__ void __launch_bounds__(kThreads)
    CopyKernel(const uint4* __restrict__ src, uint4* __restrict__ dst, size_t vectors,
               const unsigned char* __restrict__ tail_src, unsigned char* __restrict__ tail_dst,
               int tail) {
  const size_t stride = static_cast<size_t>(gridDim.x) * kThreads;
  for (size_t i = static_cast<size_t>(blockIdx.x) * kThreads + threadIdx.x; i < vectors;
       i += stride) {
    dst[i] = src[i];
  }
  if (blockIdx.x == 0 && threadIdx.x < tail) tail_dst[threadIdx.x] = tail_src[threadIdx.x];
}

struct StampPlaces {
  uint64_t* at[kMaxStampPlaces];
  int count;
};

__global__ void StampKernel(const StampPlaces places) {
  uint64_t now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  for (int i = 0; i < places.count; ++i) places.at[i][0] = now;
}

}  // namespace

absl::Status CopyByKernel(const void* src, void* dst, size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return absl::OkStatus();
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
  const size_t vectors = bytes / 16;
  const int tail = static_cast<int>(bytes % 16);
  const int blocks = static_cast<int>(std::clamp<size_t>(
      (vectors + kVectorsPerBlock - 1) / kVectorsPerBlock, 1, kMaxCopyBlocks));
  const auto* from = static_cast<const unsigned char*>(src);
  auto* to = static_cast<unsigned char*>(dst);
  CopyKernel<<<blocks, kThreads, 0, stream>>>(reinterpret_cast<const uint4*>(from),
                                              reinterpret_cast<uint4*>(to), vectors,
                                              from + vectors * 16, to + vectors * 16, tail);
  return LaunchStatus("CopyKernel");
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
    at.at[at.count++] = place;
  }
  StampKernel<<<1, 1, 0, stream>>>(at);
  return LaunchStatus("StampKernel");
}

}  // namespace kvrecall::cuda
