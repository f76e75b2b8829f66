// CUDA and cuBLAS error codes as absl::Status, so device failures travel like every other error.
#ifndef KVRECALL_KERNELS_CUDA_CUDA_STATUS_H_
#define KVRECALL_KERNELS_CUDA_CUDA_STATUS_H_

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace kvrecall::cuda {

// OK for cudaSuccess; otherwise INTERNAL (RESOURCE_EXHAUSTED for out-of-memory) naming
// `what` and CUDA's own description.
inline absl::Status CudaStatus(cudaError_t err, absl::string_view what) {
  if (err == cudaSuccess) return absl::OkStatus();
  const std::string message =
      absl::StrCat(what, ": ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")");
  if (err == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(message);
  return absl::InternalError(message);
}

inline absl::Status CublasStatus(cublasStatus_t err, absl::string_view what) {
  if (err == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  const std::string message = absl::StrCat(what, ": ", cublasGetStatusName(err), " (",
                                           cublasGetStatusString(err), ")");
  if (err == CUBLAS_STATUS_ALLOC_FAILED) return absl::ResourceExhaustedError(message);
  return absl::InternalError(message);
}

// The launch error of the kernel just launched (configuration, missing image), without
// synchronizing: asynchronous faults surface at the caller's next synchronization.
inline absl::Status LaunchStatus(absl::string_view kernel) {
  return CudaStatus(cudaGetLastError(), absl::StrCat("launching ", kernel));
}

}  // namespace kvrecall::cuda

// Variadic so that an expression holding template arguments (commas) needs no extra parentheses.
#define KVRECALL_CUDA_RETURN_IF_ERROR(...)                                \
  do {                                                                    \
    const absl::Status _kvrecall_status = (__VA_ARGS__);                  \
    if (!_kvrecall_status.ok()) return _kvrecall_status;                  \
  } while (false)

#endif  // KVRECALL_KERNELS_CUDA_CUDA_STATUS_H_
