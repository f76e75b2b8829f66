// ReTopK on the GPU (the GPU-resident placement): per query head a FIFO of (unit query, top-K
// support) entries and the decode step as fused kernels, mirroring the CPU reference
// index/retopk.h decision for decision: cosine against the C cached queries, path choice
// (refresh / fallback / reuse), the top-R entries' supports ∪ the last W positions deduplicated
// exactly, candidates scored in place, their top K (ties to the lower position), softmax·V, and
// the cache update on every path. Refresh and fallback heads run the exact top-K kernels.
// All state is allocated by Create; Seed may synchronize (it is part of prefill), Step neither
// allocates nor synchronizes, so a step can be captured in a CUDA graph.
#ifndef KVRECALL_KERNELS_CUDA_RETOPK_H_
#define KVRECALL_KERNELS_CUDA_RETOPK_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <span>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/retopk_params.h"
#include "kernels/cuda/decode_types.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/topk_workspace.h"

namespace kvrecall::cuda {

struct ReTopKDeviceState;

// One layer's ReTopK caches for up to shape.batch sequence slots, with its step workspaces.
class ReTopKGpuLayer {
 public:
  // shape.batch: sequence slots; max_tokens: the longest history a step may see. Device memory
  // is about rows * (C * (head_dim + K) * 4 + 8 * max_tokens) bytes, rows = batch * q_heads.
  // INVALID_ARGUMENT for knobs outside what the kernels serve (cache_capacity in [1, 64]).
  static absl::StatusOr<std::unique_ptr<ReTopKGpuLayer>> Create(const DecodeShape& shape,
                                                                int top_k,
                                                                const ReTopKParams& params,
                                                                int max_tokens);

  // Seeds the caches of sequence slot b after its prompt (as ReTopKSelector::Build does):
  // entry i of head h gets prompt query T - count + i and its exact top-K over the keys up to
  // its own position. seq: slot b's contiguous history of T = seq.head_count prompt tokens (a
  // host copy of the descriptor); last_queries: device [count, q_heads, head_dim] f32, the last
  // count = min(C, T) prompt queries in order. head_taus: tau per query head (calibrated on the
  // CPU under auto_tau), or empty for params.tau. Synchronizes `stream`.
  absl::Status Seed(int b, const DeviceSeq& seq, const float* last_queries, int count,
                    std::span<const float> head_taus, cudaStream_t stream);

  // One decode step of the first `batch` sequence slots: seqs [batch] (device) include the
  // step's token; q: [batch, q_heads, head_dim] f32 (device). Writes o [batch, q_heads,
  // head_dim] and lse [batch, q_heads] (f32, device). max_tokens bounds every history.
  absl::Status Step(int batch, const DeviceSeq* seqs, const float* q, int max_tokens, float* o,
                    float* lse, cudaStream_t stream);

  // What the last Step chose, device arrays over rows = b * q_heads + h:
  const uint8_t* paths() const { return paths_.data(); }          // SelectionPath values
  const int32_t* supports() const { return support_.data(); }     // [rows, K], any order
  const int32_t* support_sizes() const { return support_size_.data(); }
  const int32_t* candidates() const { return candidate_count_.data(); }  // tokens scored
  const float* best_cosines() const { return best_cosine_.data(); }
  int top_k() const { return top_k_; }
  int max_candidates() const { return max_candidates_; }

  // Device-input violations seen by the exact kernels (histories beyond max_tokens).
  const KernelErrors& errors() const { return exact_ws_->errors(); }

 private:
  ReTopKGpuLayer() = default;
  // The kernels' view of the buffers below (retopk.cuh).
  ReTopKDeviceState DeviceView() const;

  DecodeShape shape_;
  int top_k_ = 0;
  ReTopKParams params_;
  int max_tokens_ = 0;
  int max_candidates_ = 0;
  int log2_hash_slots_ = 0;
  DeviceBuffer<float> cache_queries_;
  DeviceBuffer<int32_t> cache_supports_;
  DeviceBuffer<int32_t> cache_sizes_;
  DeviceBuffer<int32_t> cache_count_;
  DeviceBuffer<int32_t> cache_oldest_;
  DeviceBuffer<float> tau_;
  DeviceBuffer<int32_t> prompt_tokens_;
  DeviceBuffer<float> unit_q_;
  DeviceBuffer<uint8_t> paths_;
  DeviceBuffer<uint8_t> exact_rows_;
  DeviceBuffer<float> best_cosine_;
  DeviceBuffer<int32_t> candidates_;
  DeviceBuffer<int32_t> candidate_count_;
  DeviceBuffer<float> candidate_scores_;
  DeviceBuffer<int32_t> support_;
  DeviceBuffer<int32_t> support_size_;
  DeviceBuffer<DeviceSeq> seed_seqs_;   // [batch] prefix views of a prompt
  DeviceBuffer<float> seed_o_;          // [rows, head_dim]: seeding computes and drops these
  DeviceBuffer<float> seed_lse_;        // [rows]
  DeviceBuffer<int32_t> seed_support_;  // [C, q_heads, K]
  DeviceBuffer<int32_t> seed_sizes_;    // [C, q_heads]
  std::unique_ptr<TopKWorkspace> exact_ws_;
};

}  // namespace kvrecall::cuda

#endif  // KVRECALL_KERNELS_CUDA_RETOPK_H_
