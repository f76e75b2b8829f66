#include "kernels/cuda/kernel_errors.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/cuda/cuda_status.h"

namespace kvrecall::cuda {
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
  std::vector<std::string> what;
  if (bits & kErrorIndexOutOfRange) what.push_back("an index outside its sequence");
  if (bits & kErrorCountOutOfRange) what.push_back("a count above its stated maximum");
  if (bits & kErrorSeqTooLong) what.push_back("a sequence longer than max_tokens");
  return absl::InvalidArgumentError(
      absl::StrCat("device inputs violated preconditions: ", absl::StrJoin(what, "; "),
                   " (those elements were skipped)"));
}

}  // namespace kvrecall::cuda
