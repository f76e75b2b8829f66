// The GPU version of the index build's batch top-k (index/batch_topk.h adapts it): exact top-k
// keys of many prefill queries at once, with one cuBLAS SGEMM per block of queries against all keys and
// the GPU row selection of topk_select.cuh.
#ifndef KVRECALL_KERNELS_CUDA_BATCH_TOPK_H_
#define KVRECALL_KERNELS_CUDA_BATCH_TOPK_H_

#include <cstdint>
#include <memory>
#include <span>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/vector_set.h"

namespace kvrecall::cuda {

// Scores are f32 with f32 arithmetic (cuBLAS pedantic math: no TF32), so lists match
// CpuBatchTopK's up to f32 summation order, with the same order: highest <q, key> first, ties
// to the lower id. Device memory grows to the largest call (keys, one block of queries and its
// score rows, at most `max_score_bytes` of scores at a time) and is kept for the next.
class GpuBatchTopK {
 public:
  static absl::StatusOr<std::unique_ptr<GpuBatchTopK>> Create(int64_t max_score_bytes = 512
                                                                                     << 20);
  ~GpuBatchTopK();
  GpuBatchTopK(const GpuBatchTopK&) = delete;
  GpuBatchTopK& operator=(const GpuBatchTopK&) = delete;

  // index/batch_topk.h's BatchTopKFunction contract: the top-k lists of every query, causal
  // `visible` counts included; synchronous. Keys of any element type (16-bit keys are uploaded
  // as they are and widened on the device), f32 queries. INVALID_ARGUMENT when k < 1, the dims
  // differ, keys.count exceeds int32, `visible` is neither empty nor one count per query, or the
  // queries are not f32.
  absl::Status Run(const VectorSet& queries, const VectorSet& keys, int k, TopKLists* out,
                   std::span<const int64_t> visible = {});

 private:
  struct Impl;
  explicit GpuBatchTopK(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvrecall::cuda

#endif  // KVRECALL_KERNELS_CUDA_BATCH_TOPK_H_
