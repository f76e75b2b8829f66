// Host API of the kernels that move a captured decode step's inputs and outputs between pinned
// host memory and the device, and stamp its times, as kernel nodes: a copy node or an event
// record node costs a graph's launch ~2 us of host time on the H200 host, a kernel node ~0.1 us
// (bench/driver_call_bench.cu, bench/results/tiered_serving_history.md d40-d43). Nothing here
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

// Words the host gives a launched step, read by the device once they are there: the host
// writes words [count] (pinned host memory), then stores `ready` (pinned host memory, 8-byte
// aligned) with release order; the step's `expected` (device memory, e.g. a word of its upload)
// names the value that marks this step's words, so that a captured step replays with each
// step's own. When the kernel runs it polls `ready` until it equals *expected, then copies the
// words to dst [count] (device memory) and, when `stamp` is non-null, writes the device's clock
// there (when the words came). A wait past timeout_ns on the device's clock gives up: dst is
// filled with `fill` and kErrorHostWordsLate is set in *error_word (kernel_errors.h), so that a
// host that fails before it gives the words costs the stream a timeout, not a hang.
// INVALID_ARGUMENT for null or misaligned pointers or count < 0. Nothing allocates.
struct HostWords {
  const uint64_t* ready = nullptr;
  const uint64_t* expected = nullptr;
  const int32_t* words = nullptr;
  int32_t* dst = nullptr;
  int count = 0;
  int32_t fill = -1;
  uint64_t timeout_ns = 0;
  unsigned* error_word = nullptr;
  uint64_t* stamp = nullptr;
};
absl::Status AwaitHostWords(const HostWords& w, cudaStream_t stream);

// At most this many places per StampTime.
inline constexpr int kMaxStampPlaces = 4;

// Writes the device's global nanosecond clock (%globaltimer: one reading) to every place
// (uint64_t, device or pinned host memory), when the kernel runs: two stamps on one stream
// time what ran between them. INVALID_ARGUMENT for no place, more than kMaxStampPlaces, or a
// null or misaligned one.
absl::Status StampTime(std::initializer_list<uint64_t*> places, cudaStream_t stream);

}  // namespace kvrecall::cuda

#endif  // KVRECALL_KERNELS_CUDA_STEP_IO_H_
