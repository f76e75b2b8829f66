// Host API of the CUDA partial-attention kernels: attention states (o, lse) of one decode step
// over each sequence's token range (sinks + a wrapping ring, or the whole history) or over id
// lists, for every head of a layer and a batch of sequences in one launch, split-K when long;
// and the exact log-sum-exp merge of states, e.g. a GPU part with a CPU part.
//
// Every pointer argument is device memory; nothing here allocates or synchronizes, so a step
// can be captured in a CUDA graph and replayed while lengths and ids (device data) change.
#ifndef KVRECALL_KERNELS_CUDA_PARTIAL_ATTENTION_H_
#define KVRECALL_KERNELS_CUDA_PARTIAL_ATTENTION_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/cuda/decode_types.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/kernel_errors.h"

namespace kvrecall::cuda {

// Scratch of split-K attention, allocated once: partial states of up to `max_splits` splits of
// up to `max_rows` rows (batch * q_heads), head_dim <= 128. One per stream in flight.
class AttentionWorkspace {
 public:
  static absl::StatusOr<std::unique_ptr<AttentionWorkspace>> Create(int max_rows,
                                                                    int max_splits = 128);
  // Exact device bytes Create(max_rows, max_splits) allocates, so that a caller can charge its
  // GPU budget first (0 for arguments Create rejects).
  static int64_t DeviceBytesFor(int max_rows, int max_splits = 128);
  int64_t device_bytes() const;

  int max_rows() const { return max_rows_; }
  int max_splits() const { return max_splits_; }
  float* partial_o() const { return partial_o_.data(); }      // [max_rows, max_splits, 128]
  float* partial_lse() const { return partial_lse_.data(); }  // [max_rows, max_splits]
  // Device-input precondition violations of every call made with this workspace.
  const KernelErrors& errors() const { return errors_; }

 private:
  AttentionWorkspace() = default;
  int max_rows_ = 0;
  int max_splits_ = 0;
  DeviceBuffer<float> partial_o_;
  DeviceBuffer<float> partial_lse_;
  KernelErrors errors_;
};

// Attention state of every (sequence b, query head h) over all logical positions
// [0, seqs[b].size()) of seqs[b]:
//   seqs: [batch] DeviceSeq (device memory);
//   q:    [batch, q_heads, head_dim] f32;
//   o:    [batch, q_heads, head_dim] f32 out;  lse: [batch, q_heads] f32 out (natural log,
//         -inf with o = 0 for an empty range).
// max_tokens bounds every seqs[b].size() and sets the split plan; a longer sequence is cut
// there and reported by ws->errors(). Query heads of one KV head share each key read (GQA).
absl::Status PartialAttentionOverSeqs(const DecodeShape& shape, const DeviceSeq* seqs,
                                      const float* q, int max_tokens, AttentionWorkspace* ws,
                                      float* o, float* lse, cudaStream_t stream);

// Attention state of every (b, h) over the logical positions ids[b, h, 0:counts[b, h]] of
// seqs[b] (each attended once per occurrence):
//   ids: [batch, q_heads, max_ids] int32; counts: [batch, q_heads] int32 in [0, max_ids];
//   other arguments as PartialAttentionOverSeqs. Out-of-range ids or counts are skipped and
//   reported by ws->errors().
absl::Status PartialAttentionOverIds(const DecodeShape& shape, const DeviceSeq* seqs,
                                     const float* q, const int32_t* ids, const int32_t* counts,
                                     int max_ids, AttentionWorkspace* ws, float* o, float* lse,
                                     cudaStream_t stream);

// (o, lse) <- the state over the union of the two disjoint sets, for `rows` rows:
// o, o_other: [rows, head_dim] f32; lse, lse_other: [rows] f32. Exact (kernels/attention_state.h).
absl::Status MergeAttentionStates(int rows, int head_dim, const float* o_other,
                                  const float* lse_other, float* o, float* lse,
                                  cudaStream_t stream);

// The split plan PartialAttentionOverSeqs uses for this shape and bound (for benchmarks that
// count launches and bytes).
absl::StatusOr<SplitPlan> PlanSeqAttention(const DecodeShape& shape, int max_tokens,
                                           const AttentionWorkspace& ws);

}  // namespace kvrecall::cuda

#endif  // KVRECALL_KERNELS_CUDA_PARTIAL_ATTENTION_H_
