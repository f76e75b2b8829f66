// Exact top-k keys of many queries at once: the step of the query-aware graph build that needs
// real arithmetic, kept behind one function type so that a GPU (cuBLAS) version can replace the
// CPU one.
#ifndef KVRECALL_INDEX_BATCH_TOPK_H_
#define KVRECALL_INDEX_BATCH_TOPK_H_

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "index/build_stop.h"
#include "index/key_index.h"

namespace kvrecall {

// Computes the exact top-k keys of every query. queries and keys have the same dim;
// keys.count must fit in int32. `visible` is empty (every query sees every key) or holds one
// count per query: query i sees only keys [0, visible[i]) (a causal mask), and its list is
// min(k, visible[i]) long, padded with -1. Once `stop` is requested it returns CANCELLED
// (BuildStop::Status), `out` unspecified: the CPU's asks before each block of queries, the GPU's
// once it has the device.
using BatchTopKFunction = std::function<absl::Status(
    const VectorSet& queries, const VectorSet& keys, int k, TopKLists* out,
    std::span<const int64_t> visible, const BuildStop& stop)>;

// The argument checks every backend applies: INVALID_ARGUMENT when k < 1, the dims differ,
// keys.count exceeds int32, `visible` is neither empty nor one count per query, or the queries
// are not f32 (keys may be of any element type).
absl::Status CheckBatchTopKArgs(const VectorSet& queries, const VectorSet& keys, int k,
                                std::span<const int64_t> visible);

// The CPU backend: scores blocks of queries against blocks of keys with cblas_sgemm (f32 keys
// read in place through their strides, 16-bit keys widened a block at a time) and keeps each
// query's best k with a running threshold, query blocks in parallel with OpenMP. BLAS runs
// single-threaded inside (the parallelism is ours). Errors: CheckBatchTopKArgs; CANCELLED once
// `stop` is requested (asked before each block of 64 queries).
absl::Status CpuBatchTopK(const VectorSet& queries, const VectorSet& keys, int k,
                          TopKLists* out, std::span<const int64_t> visible = {},
                          const BuildStop& stop = {});

// Whether `batch_topk` is CpuBatchTopK itself: the CPU backend, which runs on the caller's
// OpenMP team (any other function is taken to run elsewhere, as the GPU's does).
bool IsCpuBatchTopK(const BatchTopKFunction& batch_topk);

// The most CpuBatchTopK allocates beyond its output ([queries, k] ids) over `keys` keys of
// `dim` elements with `threads` OpenMP threads: each thread's block of scores, its query block's
// running top-k and its block of keys widened to f32 (16-bit keys).
int64_t CpuBatchTopKScratchBytes(int64_t keys, int k, int dim, int threads);

}  // namespace kvrecall

#endif  // KVRECALL_INDEX_BATCH_TOPK_H_
