// ReTopK's cache match alone on the GPU, for a placement whose candidates are scored elsewhere
// (the tiered placement's bulk lives in host DRAM): per (sequence, query head) row the path,
// the best cosine and the R most similar cached entries — decided by the GPU-resident step's
// own kernel (ReTopKDecideKernel, kernels/cuda/retopk.cuh), so both placements decide alike —
// optionally the reuse candidates themselves (the R entries' supports ∪ the last W positions,
// ascending and distinct, as UnionReuseCandidates in index/retopk.h lists them), and the cache
// push of the supports the scorer chose. The caches are ReTopKCaches (kernels/cuda/retopk.h).
//
// Nothing here allocates or synchronizes after ReTopKMatchWorkspace::Create.
#ifndef KVRECALL_KERNELS_CUDA_RETOPK_MATCH_H_
#define KVRECALL_KERNELS_CUDA_RETOPK_MATCH_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/cuda/decode_types.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/kernel_errors.h"
#include "kernels/cuda/retopk.h"
#include "kernels/retopk_params.h"

namespace kvrecall::cuda {

// Where a match writes, device-accessible memory (device memory, or mapped pinned host memory
// that the kernels write across the bus). Rows are row = b * q_heads + h; C = cache capacity.
struct ReTopKMatchOutputs {
  float* unit_q = nullptr;        // [rows, head_dim]: q / ||q||, what ReTopKPushEntries appends
  uint8_t* paths = nullptr;       // [rows]: SelectionPath values
  float* best_cosine = nullptr;   // [rows]: -inf with an empty cache
  // [rows, 1 + C]: r (0 off the reuse path), then the slots of the r <= R most similar entries,
  // most similar first, ties to the older (QuerySupportCache::AgeOfSlot maps them to ages).
  int32_t* neighbors = nullptr;
  // [rows]: n (every token) for an exact row; for a reuse row the number of candidates when
  // `candidates` is given, else left as it was.
  int32_t* candidate_count = nullptr;
  // [rows, ReTopKMaxCandidates(top_k, params)], or null for no union on the GPU: a reuse row's
  // candidates, ascending and distinct, in its first candidate_count entries.
  int32_t* candidates = nullptr;
};

// Scratch and bounds of the matches of one stream: up to max_shape.rows() rows over histories
// of up to max_tokens tokens. The union keeps a bitmap of the history in shared memory, so
// max_tokens is bounded by the device's shared memory per block (about 1.5M tokens on an H200 at
// K = 2048).
class ReTopKMatchWorkspace {
 public:
  // INVALID_ARGUMENT for knobs the kernels do not serve (ReTopKCaches::CheckParams) or a
  // max_tokens whose bitmap and candidate list exceed the device's shared memory per block.
  static absl::StatusOr<std::unique_ptr<ReTopKMatchWorkspace>> Create(const DecodeShape& max_shape,
                                                                      int top_k,
                                                                      const ReTopKParams& params,
                                                                      int max_tokens);

  int max_rows() const { return max_rows_; }
  int max_tokens() const { return max_tokens_; }
  int64_t device_bytes() const;
  // Device-input violations seen by the kernels: support ids outside their history, support
  // sizes above K, histories longer than max_tokens (those elements are skipped).
  const KernelErrors& errors() const { return errors_; }

  // OK when a match or push of `shape` with these knobs over histories of up to max_tokens fits
  // this workspace; else INVALID_ARGUMENT naming what exceeds it.
  absl::Status CheckFits(const DecodeShape& shape, int top_k, const ReTopKParams& params,
                         int max_tokens) const;

 private:
  friend struct ReTopKMatchLaunch;  // retopk_match.cu
  ReTopKMatchWorkspace() = default;

  int max_rows_ = 0;
  int q_heads_ = 0;
  int head_dim_ = 0;
  int top_k_ = 0;
  int capacity_ = 0;
  int max_tokens_ = 0;
  DeviceBuffer<uint8_t> exact_rows_;  // [max_rows]: the decision kernel's exact-row flags
  KernelErrors errors_;
};

// The match of one decode step of shape.batch sequences, without scoring anything: for every
// row, ChooseReTopKPath's path against the row's cache, its best cosine and (reuse) the R most
// similar entries; with out.candidates, also the reuse candidates. seqs [batch] (device): only
// their lengths n are read (the history including the step's token; keys and values may be
// null); the decode step is n - caches[b].prompt_tokens. caches [batch] (device): created for
// this shape's q_heads, head_dim, top_k and params.cache_capacity. q [batch, q_heads, head_dim]
// f32 (device). max_tokens bounds every n and must fit ws. Leaves the caches unchanged.
absl::Status ReTopKMatch(const DecodeShape& shape, int top_k, const ReTopKParams& params,
                         const DeviceSeq* seqs, const ReTopKCachesView* caches, const float* q,
                         int max_tokens, ReTopKMatchWorkspace* ws, const ReTopKMatchOutputs& out,
                         cudaStream_t stream);

// Appends one entry per row to the caches (QuerySupportCache::Push): unit_q [rows, head_dim]
// f32 (a match's out.unit_q), supports [rows, top_k] int32 with sizes [rows] in [0, top_k] (the
// support the scorer chose for the row), all device memory. A size above top_k is cut there and
// reported by ws->errors().
absl::Status ReTopKPushEntries(const DecodeShape& shape, int top_k, const ReTopKParams& params,
                               const ReTopKCachesView* caches, const float* unit_q,
                               const int32_t* supports, const int32_t* sizes,
                               ReTopKMatchWorkspace* ws, cudaStream_t stream);

}  // namespace kvrecall::cuda

#endif  // KVRECALL_KERNELS_CUDA_RETOPK_MATCH_H_
