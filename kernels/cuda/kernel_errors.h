// A device word in which kernels record violated preconditions of inputs that live on the GPU
// (ids, counts, lengths), which the host cannot check before a launch without synchronizing.
#ifndef KVRECALL_KERNELS_CUDA_KERNEL_ERRORS_H_
#define KVRECALL_KERNELS_CUDA_KERNEL_ERRORS_H_

#include <cuda_runtime_api.h>

#include <span>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#include "kernels/cuda/device_buffer.h"

namespace kvrecall::cuda {

// Bits of the error word.
inline constexpr unsigned kErrorIndexOutOfRange = 1u;  // an id outside [0, sequence size)
inline constexpr unsigned kErrorCountOutOfRange = 2u;  // a count above its stated maximum
inline constexpr unsigned kErrorSeqTooLong = 4u;       // a sequence longer than max_tokens
inline constexpr unsigned kErrorHostWordsLate = 8u;    // AwaitHostWords timed out (step_io.h)

// Kernels skip the offending element (it is neither read nor attended) and set a bit here;
// the owner checks the word where a synchronization is acceptable (tests, the end of a request)
// and turns it into INVALID_ARGUMENT (UNAVAILABLE for a late host alone). A step never
// synchronizes on it.
class KernelErrors {
 public:
  static absl::StatusOr<KernelErrors> Create();

  unsigned* device_word() const { return word_.data(); }
  static constexpr int64_t kDeviceBytes = sizeof(unsigned);  // what Create allocates

  // Synchronizes `stream`, then reads and clears the word: OK, or INVALID_ARGUMENT naming every
  // violated precondition seen since the last check, or UNAVAILABLE when the only bit is
  // kErrorHostWordsLate (the host's lateness, not an input's fault: retryable).
  absl::Status CheckAndClear(cudaStream_t stream) const;

 private:
  DeviceBuffer<unsigned> word_;
};

// At most this many words per GatherErrorWords.
inline constexpr int kMaxGatheredErrorWords = 4;

// dst[i] = the word of errors[i] (device memory), for each i, in one launch: a step gathers its
// kernels' words into its download with one kernel node of its captured graph rather than a copy
// node each (each copy node added ~2 us to a graph's launch on the H200 host, d40).
// INVALID_ARGUMENT for more than kMaxGatheredErrorWords words or a null one.
absl::Status GatherErrorWords(std::span<const KernelErrors* const> errors, unsigned* dst,
                              cudaStream_t stream);

}  // namespace kvrecall::cuda

#endif  // KVRECALL_KERNELS_CUDA_KERNEL_ERRORS_H_
