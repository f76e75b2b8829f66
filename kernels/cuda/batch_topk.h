// The GPU version of the index build's batch top-k (index/batch_topk.h adapts it): exact top-k
// keys of many prefill queries at once, with one cuBLAS GEMM per block of queries against all
// keys (bf16 or f16 tensor cores when the inputs are exact in that type, else f32) and the GPU
// row selection of topk_select.cuh.
#ifndef KVRECALL_KERNELS_CUDA_BATCH_TOPK_H_
#define KVRECALL_KERNELS_CUDA_BATCH_TOPK_H_

#include <cstdint>
#include <memory>
#include <span>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/vector_set.h"

namespace kvrecall::cuda {

// Scores are sums of exact products accumulated in f32, so lists match CpuBatchTopK's up to
// f32 rounding of the sums (near-ties may differ), with the same order: highest <q, key> first,
// ties to the lower id (the GPU orders each list by its own scores). The products are exact
// whatever the GEMM: a call whose keys and queries are all exact in bf16 (a bf16 session's,
// widened to f32) multiplies them as bf16 on tensor cores, else exact in f16 as f16, else as
// f32 (cuBLAS pedantic math: no TF32); a product of two bf16 or two f16 values is exact in f32.
// Device memory grows to the largest call (keys, the queries, one block of score rows: at most
// `max_score_bytes` of scores at a time) and is kept for the next, and so does a pinned host
// buffer that the keys and queries are packed into on their way up (a chunk's upload overlaps
// the packing of the next) and the lists come down through.
class GpuBatchTopK {
 public:
  // The element type a call's GEMM multiplied (see above).
  enum class GemmInput { kF32, kBf16, kF16 };

  static absl::StatusOr<std::unique_ptr<GpuBatchTopK>> Create(int64_t max_score_bytes = 512
                                                                                     << 20);
  ~GpuBatchTopK();
  GpuBatchTopK(const GpuBatchTopK&) = delete;
  GpuBatchTopK& operator=(const GpuBatchTopK&) = delete;

  // index/batch_topk.h's BatchTopKFunction contract: the top-k lists of every query, causal
  // `visible` counts included; synchronous. Keys of any element type (16-bit keys are uploaded
  // as they are, exact in their own type, and widened on the device only for an f32 GEMM), f32
  // queries. INVALID_ARGUMENT when k < 1, the dims
  // differ, keys.count exceeds int32, `visible` is neither empty nor one count per query, or the
  // queries are not f32.
  absl::Status Run(const VectorSet& queries, const VectorSet& keys, int k, TopKLists* out,
                   std::span<const int64_t> visible = {});

  // One small Run per GEMM type and key width (bf16, f16 and f32 products; f32 and 16-bit
  // keys; a causal mask): CUDA loads kernels on their first launch and cuBLAS sets up on its
  // first GEMM of a type, which would otherwise land in the first index build (~0.1 s of a
  // 128K layer's). Allocates little (its buffers grow later, to the largest call).
  absl::Status WarmUp();

  // What the last successful Run's GEMM multiplied.
  GemmInput last_gemm_input() const;

 private:
  struct Impl;
  explicit GpuBatchTopK(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvrecall::cuda

#endif  // KVRECALL_KERNELS_CUDA_BATCH_TOPK_H_
