// The graph build's batch top-k on the GPU: a BatchTopKFunction (index/batch_topk.h) backed by
// the cuBLAS kernels of kernels/cuda/batch_topk.h. Built only with KVRECALL_WITH_CUDA.
#ifndef KVRECALL_INDEX_GPU_BATCH_TOPK_H_
#define KVRECALL_INDEX_GPU_BATCH_TOPK_H_

#include "absl/status/statusor.h"
#include "index/batch_topk.h"

namespace kvrecall {

// A BatchTopKFunction backed by one cuda::GpuBatchTopK on the current device; concurrent
// calls are serialized. Errors of CUDA (no device, out of memory) come back from this call or
// from a call of the function.
absl::StatusOr<BatchTopKFunction> MakeGpuBatchTopKFunction();

}  // namespace kvrecall

#endif  // KVRECALL_INDEX_GPU_BATCH_TOPK_H_
