#include "kernels/cuda/kernel_errors.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/cuda/cuda_status.h"

namespace kvrecall::cuda {
namespace {

struct ErrorWords {
  const unsigned* words[kMaxGatheredErrorWords];
  int count;
};

__global__ void GatherErrorWordsKernel(const ErrorWords words, unsigned* dst) {
  if (threadIdx.x < words.count) dst[threadIdx.x] = *words.words[threadIdx.x];
}

}  // namespace

absl::StatusOr<KernelErrors> KernelErrors::Create() {
  KernelErrors errors;
  absl::StatusOr<DeviceBuffer<unsigned>> word = DeviceBuffer<unsigned>::Zeroed(1);
  if (!word.ok()) return word.status();
  errors.word_ = *std::move(word);
  return errors;
}

absl::Status KernelErrors::CheckAndClear(cudaStream_t stream) const {
  unsigned bits = 0;
  KVRECALL_CUDA_RETURN_IF_ERROR(CudaStatus(
      cudaMemcpyAsync(&bits, word_.data(), sizeof bits, cudaMemcpyDeviceToHost, stream),
      "reading the kernel error word"));
  KVRECALL_CUDA_RETURN_IF_ERROR(
      CudaStatus(cudaStreamSynchronize(stream), "synchronizing to read kernel errors"));
  if (bits == 0) return absl::OkStatus();
  KVRECALL_CUDA_RETURN_IF_ERROR(CudaStatus(cudaMemsetAsync(word_.data(), 0, sizeof bits, stream),
                                           "clearing the kernel error word"));
  // A wait past its timeout alone is no input's fault but the host's lateness (an overloaded
  // host): UNAVAILABLE, which a caller may retry.
  if (bits == kErrorHostWordsLate) {
    return absl::UnavailableError(
        "host words a step waited for past its timeout (a tiered step's exact heads not named "
        "by the host in time; those elements were skipped)");
  }
  std::vector<std::string> what;
  if (bits & kErrorIndexOutOfRange) what.push_back("an index outside its sequence");
  if (bits & kErrorCountOutOfRange) what.push_back("a count above its stated maximum");
  if (bits & kErrorSeqTooLong) what.push_back("a sequence longer than max_tokens");
  if (bits & kErrorHostWordsLate) {
    what.push_back("host words a step waited for past its timeout (a tiered step's exact heads "
                   "not named by the host)");
  }
  return absl::InvalidArgumentError(
      absl::StrCat("device inputs violated preconditions: ", absl::StrJoin(what, "; "),
                   " (those elements were skipped)"));
}

absl::Status GatherErrorWords(std::span<const KernelErrors* const> errors, unsigned* dst,
                              cudaStream_t stream) {
  if (errors.size() > kMaxGatheredErrorWords || dst == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("gathering ", errors.size(),
                                                   " error words (at most ",
                                                   kMaxGatheredErrorWords, ") into ",
                                                   dst == nullptr ? "null" : "a device word"));
  }
  ErrorWords words{};
  words.count = static_cast<int>(errors.size());
  for (size_t i = 0; i < errors.size(); ++i) {
    if (errors[i] == nullptr) return absl::InvalidArgumentError("a null error word to gather");
    words.words[i] = errors[i]->device_word();
  }
  if (words.count == 0) return absl::OkStatus();
  GatherErrorWordsKernel<<<1, 32, 0, stream>>>(words, dst);
  return LaunchStatus("GatherErrorWordsKernel");
}

}  // namespace kvrecall::cuda
