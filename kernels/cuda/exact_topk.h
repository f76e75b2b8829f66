// Host API of the exact top-K decode path on the GPU: each query head's K highest-scoring
// tokens of the whole history, found by one scan that reads every key once (shared by the
// query heads of a KV head), and the attention state over them. ReTopK's exact path in the
// GPU-resident placement. Nothing here allocates or synchronizes (CUDA-graph friendly).
#ifndef KVRECALL_KERNELS_CUDA_EXACT_TOPK_H_
#define KVRECALL_KERNELS_CUDA_EXACT_TOPK_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/decode_types.h"
#include "kernels/cuda/topk_workspace.h"

namespace kvrecall::cuda {

// For every (sequence b, query head h) with active_rows[b, h] != 0 (all when null):
//   support[b, h, 0:support_size[b, h]]: the min(k, n_b) logical positions of seqs[b] with the
//     highest scale * <q[b, h], key>, ties to the lower position (cpu::ExactTopK's order as a
//     set; listed in no particular order);
//   (o[b, h], lse[b, h]): the attention state over exactly those tokens.
// Shapes (device memory): seqs [batch]; q [batch, q_heads, head_dim] f32; active_rows
// [batch, q_heads] u8 or null; support [batch, q_heads, k] int32; support_size [batch, q_heads];
// o [batch, q_heads, head_dim] f32; lse [batch, q_heads] f32. Inactive rows are not written.
// max_tokens bounds every n_b (a longer sequence is cut and reported by ws->errors()) and must
// fit ws; ws must have batch * q_heads rows.
absl::Status ExactTopKAttention(const DecodeShape& shape, const DeviceSeq* seqs, const float* q,
                                int max_tokens, int k, const uint8_t* active_rows,
                                TopKWorkspace* ws, int32_t* support, int32_t* support_size,
                                float* o, float* lse, cudaStream_t stream);

// INVALID_ARGUMENT unless the current device can run ExactTopKAttention (and ReTopK's exact
// path, whose selection is the same) for `shape` with this k: a row's k positions and scores
// are gathered in shared memory (CheckRowTopK), which bounds k far below kMaxTopK.
absl::Status CheckExactTopK(const DecodeShape& shape, int k);

}  // namespace kvrecall::cuda

#endif  // KVRECALL_KERNELS_CUDA_EXACT_TOPK_H_
