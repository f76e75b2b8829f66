// ReTopK on the GPU (the GPU-resident placement): per query head a FIFO of (unit query, top-K
// support) entries and the decode step as fused kernels, mirroring the CPU reference
// index/retopk.h decision for decision: cosine against the C cached queries, path choice
// (refresh / fallback / reuse), the top-R entries' supports ∪ the last W positions deduplicated
// exactly, candidates scored in place, their top K (ties to the lower position), softmax·V, and
// the cache update on every path. A step decides every row's path first (one small kernel);
// the reuse rows then run in one fused kernel (union, tensor-core scoring of the candidates,
// top K, softmax·V, cache push) while the refresh and fallback rows run the exact top-K kernels
// beside it, on a stream of the workspace's own (forked and joined with events, so a captured
// graph holds both branches). The exact kernels share their launch among the head groups that
// have an exact row, so a step with few exact rows reads only those KV heads' keys.
//
// State is split by owner: ReTopKCaches holds one sequence's caches of one layer (a session's
// layer owns one), ReTopKWorkspace the scratch of the steps of one stream. A step runs a batch
// of sequences whose caches were allocated separately, in one launch sequence, through a device
// array of ReTopKCachesView. Seeding may synchronize (it is part of prefill); a step neither
// allocates nor synchronizes, so it can be captured in a CUDA graph.
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
#include "kernels/cuda/kernel_errors.h"
#include "kernels/cuda/topk_workspace.h"

namespace kvrecall::cuda {

// The largest cache capacity C the kernels serve (cosines live in shared memory, neighbors are
// picked by one warp holding two ages per lane).
inline constexpr int kMaxGpuReTopKCacheCapacity = 64;

// R * K + W: the most candidates a reuse step unions (R capped at C).
inline int64_t ReTopKMaxCandidates(int top_k, const ReTopKParams& params) {
  const int neighbors = params.reuse_neighbors < params.cache_capacity ? params.reuse_neighbors
                                                                       : params.cache_capacity;
  return static_cast<int64_t>(neighbors) * top_k + params.recent_window;
}

// One sequence's ReTopK caches of one layer, device memory, as the kernels see them. A step
// takes a device array [batch] of these, one per sequence (like DeviceSeq), so that sequences
// whose caches were allocated separately run in one launch. Query head h's entries live at
// offset h of each per-head array; slots are FIFO positions, `oldest` the slot of age 0.
struct ReTopKCachesView {
  float* queries = nullptr;     // [q_heads, C, head_dim] unit queries, by slot
  int32_t* supports = nullptr;  // [q_heads, C, K], by slot
  int32_t* sizes = nullptr;     // [q_heads, C] support sizes, by slot
  int32_t* count = nullptr;     // [q_heads] entries held
  int32_t* oldest = nullptr;    // [q_heads] slot of the oldest entry
  float* tau = nullptr;         // [q_heads]
  int32_t prompt_tokens = 0;    // decode step = n - prompt_tokens (n includes the step's token)
};

// Owns one sequence's caches of one layer: q_heads * C * (head_dim + K + 1) * 4 bytes plus
// three words per head, allocated once by Create (zeroed: no entries) and written only by
// SeedReTopKCaches and ReTopKStep.
class ReTopKCaches {
 public:
  // INVALID_ARGUMENT for knobs outside what the kernels serve (C in [1, 64], head_dim 64 or
  // 128, top_k >= 1); RESOURCE_EXHAUSTED when the device memory is not there.
  static absl::StatusOr<std::unique_ptr<ReTopKCaches>> Create(int q_heads, int head_dim,
                                                              int top_k,
                                                              const ReTopKParams& params);
  // Exact device bytes Create(...) allocates (for a GPU memory budget; 0 for arguments Create
  // rejects).
  static int64_t DeviceBytesFor(int q_heads, int head_dim, int top_k, const ReTopKParams& params);
  // OK when the kernels serve this geometry and these knobs (what Create, ReTopKWorkspace::Create
  // and a step check), else INVALID_ARGUMENT naming the knob; allocates nothing, needs no GPU.
  static absl::Status CheckParams(const DecodeShape& shape, int top_k, const ReTopKParams& params);

  // The kernels' view; prompt_tokens is the one of the last seeding, so take the view after
  // SeedReTopKCaches (and upload it into the step's [batch] array then).
  ReTopKCachesView view() const;
  int64_t device_bytes() const;
  int q_heads() const { return q_heads_; }
  int head_dim() const { return head_dim_; }
  int top_k() const { return top_k_; }
  int capacity() const { return capacity_; }

 private:
  friend struct ReTopKLaunch;  // retopk.cu
  ReTopKCaches() = default;

  int q_heads_ = 0;
  int head_dim_ = 0;
  int top_k_ = 0;
  int capacity_ = 0;
  int32_t prompt_tokens_ = 0;
  DeviceBuffer<float> queries_;
  DeviceBuffer<int32_t> supports_;
  DeviceBuffer<int32_t> sizes_;
  DeviceBuffer<int32_t> count_;
  DeviceBuffer<int32_t> oldest_;
  DeviceBuffer<float> tau_;
};

// Per-stream scratch of ReTopK steps and seeding: up to max_rows = max_shape.batch * q_heads
// rows over histories of up to max_tokens tokens, and the results of the last step per row.
// One per CUDA stream in flight; grow it (Create a larger one) when a longer history or a
// larger batch arrives. Device memory is about rows * (8 * max_tokens + 4 * (R * K + W) * 2)
// bytes; DeviceBytesFor gives the exact figure.
class ReTopKWorkspace {
 public:
  // INVALID_ARGUMENT for knobs outside what the kernels serve (as ReTopKCaches, plus
  // R * K + W within the shared-memory candidate set of 2^14 entries).
  static absl::StatusOr<std::unique_ptr<ReTopKWorkspace>> Create(const DecodeShape& max_shape,
                                                                 int top_k,
                                                                 const ReTopKParams& params,
                                                                 int max_tokens);
  // Exact device bytes Create(...) would allocate, so a caller can charge its GPU budget first
  // (0 for arguments Create rejects).
  static int64_t DeviceBytesFor(const DecodeShape& max_shape, int top_k,
                                const ReTopKParams& params, int max_tokens);

  int max_batch() const { return max_shape_.batch; }
  int max_rows() const { return max_shape_.rows(); }
  int max_tokens() const { return max_tokens_; }
  int top_k() const { return top_k_; }
  int max_candidates() const { return max_candidates_; }
  int64_t device_bytes() const;
  ~ReTopKWorkspace();
  ReTopKWorkspace(const ReTopKWorkspace&) = delete;
  ReTopKWorkspace& operator=(const ReTopKWorkspace&) = delete;

  // OK when a step or seeding of `shape` with these knobs over histories of up to max_tokens
  // fits this workspace; else INVALID_ARGUMENT naming what exceeds it.
  absl::Status CheckFits(const DecodeShape& shape, int top_k, const ReTopKParams& params,
                         int max_tokens) const;

  // What the last step chose, device arrays over rows = b * q_heads + h of that step:
  const uint8_t* paths() const { return paths_.data(); }              // SelectionPath values
  const int32_t* supports() const { return support_.data(); }         // [rows, K], any order
  const int32_t* support_sizes() const { return support_size_.data(); }
  const int32_t* candidates() const { return candidate_count_.data(); }  // tokens scored
  const float* best_cosines() const { return best_cosine_.data(); }

  // Device-input violations seen by the step's kernels (histories beyond max_tokens).
  const KernelErrors& errors() const { return exact_ws_->errors(); }

 private:
  friend struct ReTopKLaunch;  // retopk.cu
  ReTopKWorkspace() = default;

  DecodeShape max_shape_;
  int top_k_ = 0;
  int capacity_ = 0;
  int max_tokens_ = 0;
  int max_candidates_ = 0;
  DeviceBuffer<float> unit_q_;             // [rows, head_dim]
  DeviceBuffer<uint8_t> paths_;            // [rows]
  DeviceBuffer<uint8_t> exact_rows_;       // [rows]: 1 when the exact kernels serve the row
  DeviceBuffer<float> best_cosine_;        // [rows]
  DeviceBuffer<int32_t> neighbors_;        // [rows, 1 + C]: entries a reuse row unions
  DeviceBuffer<int32_t> candidates_;       // [rows, max_candidates]
  DeviceBuffer<int32_t> candidate_count_;  // [rows]
  DeviceBuffer<float> candidate_scores_;   // [rows, max_candidates]
  DeviceBuffer<int32_t> support_;          // [rows, K]
  DeviceBuffer<int32_t> support_size_;     // [rows]
  DeviceBuffer<DeviceSeq> seed_seqs_;      // [batch] prefix views of a prompt
  DeviceBuffer<float> seed_o_;             // [rows, head_dim]: seeding computes and drops these
  DeviceBuffer<float> seed_lse_;           // [rows]
  DeviceBuffer<int32_t> seed_support_;     // [C, q_heads, K]
  DeviceBuffer<int32_t> seed_sizes_;       // [C, q_heads]
  std::unique_ptr<TopKWorkspace> exact_ws_;
  // A step's refresh and fallback rows run on side_ (forked at fork_, joined at join_) while
  // the reuse rows run on the caller's stream.
  cudaStream_t side_ = nullptr;
  cudaEvent_t fork_ = nullptr;
  cudaEvent_t join_ = nullptr;
};

// Seeds one sequence's caches after its prompt, exactly as ReTopKSelector::Build does: entry i
// of head h gets prompt query T - count + i and its exact top-K over the keys up to its own
// position. shape: the layer's geometry (batch ignored; the workspace's batch bounds how many
// seeding queries share a launch). seq: the contiguous prompt of T = seq.head_count tokens (a
// host copy of the descriptor). last_queries: device [count, q_heads, head_dim] f32, the last
// count = min(C, T) prompt queries in order. head_taus: tau per query head (calibrated on the
// CPU under auto_tau), or empty for params.tau. caches must have been created for these
// q_heads, head_dim, top_k and C. Synchronizes `stream`.
absl::Status SeedReTopKCaches(const DecodeShape& shape, int top_k, const ReTopKParams& params,
                              const DeviceSeq& seq, const float* last_queries, int count,
                              std::span<const float> head_taus, ReTopKWorkspace* ws,
                              ReTopKCaches* caches, cudaStream_t stream);

// One decode step of shape.batch sequences: seqs [batch] and caches [batch] are device arrays
// (sequence b's history including the step's token, and its caches, created for this shape's
// q_heads and head_dim, top_k and params.cache_capacity); q [batch, q_heads, head_dim] f32
// device. Writes o [batch, q_heads, head_dim], lse [batch, q_heads] and the per-row results
// into ws. Every sequence of the batch shares top_k and params (batch only such sequences);
// tau is each cache's own. max_tokens bounds every history and must fit ws. Neither allocates
// nor synchronizes (CUDA-graph capturable).
// The launches run on `stream` and on the workspace's side stream, joined back into `stream`
// before the call returns (ordered: a second step on `stream` follows the first).
absl::Status ReTopKStep(const DecodeShape& shape, int top_k, const ReTopKParams& params,
                        const DeviceSeq* seqs, const ReTopKCachesView* caches, const float* q,
                        int max_tokens, ReTopKWorkspace* ws, float* o, float* lse,
                        cudaStream_t stream);

}  // namespace kvrecall::cuda

#endif  // KVRECALL_KERNELS_CUDA_RETOPK_H_
