// Host API of the kernels that move a captured decode step's inputs and outputs between pinned
// host memory and the device, and stamp its times, as kernel nodes: a copy node or an event
// record node costs a graph's launch ~2 us of host time on the H200 host, a kernel node ~0.1 us
// (bench/driver_call_bench.cu, bench/results/tiered_serving.md d40-d43). Nothing here
// allocates or synchronizes.
#ifndef KVRECALL_KERNELS_CUDA_STEP_IO_H_
#define KVRECALL_KERNELS_CUDA_STEP_IO_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <initializer_list>

#include "absl/status/status.h"

namespace kvrecall::cuda {

// dst[0, bytes) = src[0, bytes), read when the kernel runs. Either side may be pinned host
// memory (cudaHostAlloc: the device reaches it at the same address) or device memory; both
// 16-byte aligned, not overlapping. A device write to pinned memory is visible to the host once
// the stream is synchronized. INVALID_ARGUMENT for null or misaligned pointers with bytes > 0.
absl::Status CopyByKernel(const void* src, void* dst, size_t bytes, cudaStream_t stream);

// CopyByKernel from device memory to pinned host memory that a host thread waits for without a
// stream call: once every byte of dst is visible to the host, *flag (pinned host memory, which
// the host set to 0 before the launch) becomes the device's clock (nonzero). Each block fences
// its writes system-wide before it counts itself done in *blocks_done (one device word, 0 before
// the first launch); the last one sets it back to 0, for the next launch, and writes the flag.
// INVALID_ARGUMENT for a null or misaligned counter or flag, or null or misaligned src and dst
// (even with bytes == 0: the flag alone).
absl::Status PublishToHost(const void* src, void* dst, size_t bytes, unsigned* blocks_done,
                           uint64_t* flag, cudaStream_t stream);

// At most this many places per StampTime.
inline constexpr int kMaxStampPlaces = 4;

// Writes the device's global nanosecond clock (%globaltimer: one reading) to every place
// (uint64_t, device or pinned host memory), when the kernel runs: two stamps on one stream
// time what ran between them. INVALID_ARGUMENT for no place, more than kMaxStampPlaces, or a
// null or misaligned one.
absl::Status StampTime(std::initializer_list<uint64_t*> places, cudaStream_t stream);

}  // namespace kvrecall::cuda

#endif  // KVRECALL_KERNELS_CUDA_STEP_IO_H_
