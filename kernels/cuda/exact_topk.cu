#include "kernels/cuda/exact_topk.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/exact_topk.cuh"
#include "kernels/cuda/launch.cuh"

namespace kvrecall::cuda {

absl::Status ExactTopKAttention(const DecodeShape& shape, const DeviceSeq* seqs, const float* q,
                                int max_tokens, int k, const uint8_t* active_rows,
                                TopKWorkspace* ws, int32_t* support, int32_t* support_size,
                                float* o, float* lse, cudaStream_t stream) {
  absl::StatusOr<ScoreKeysParams> params = ExactTopKParams(
      shape, seqs, q, max_tokens, k, active_rows, ws, support, support_size);
  if (!params.ok()) return params.status();
  if (o == nullptr || lse == nullptr) {
    return absl::InvalidArgumentError(
        "seqs, q, support, support_size, o and lse must be device pointers, got null");
  }
  return LaunchExactTopK(
      shape, *params, max_tokens,
      [&]<typename KvT, int kDim>() {
        return AttendFinish<KvT, kDim, kRowPassThreads>{seqs, shape.q_heads, shape.kv_heads, o,
                                                         lse};
      },
      stream);
}

absl::Status CheckExactTopK(const DecodeShape& shape, int k) {
  KVRECALL_CUDA_RETURN_IF_ERROR(shape.Validate());
  return KVRECALL_DISPATCH_KV_DTYPE(shape.dtype, KvT, [&] {
    return KVRECALL_DISPATCH_HEAD_DIM(shape.head_dim, kDim, [&] {
      return CheckRowCollectFits<AttendFinish<KvT, kDim, kRowPassThreads>>(k);
    });
  });
}

}  // namespace kvrecall::cuda
