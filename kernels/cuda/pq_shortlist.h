// Host API of the GPU shortlist over product-quantized keys: each query row's approximate
// (ADC) score of every key of its code set from 8-bit PQ codes, and the positions of its best
// `shortlist` scores, which the host then rescores exactly against the real keys (issue 15's
// candidate scoring off the host). The CPU reference of the arithmetic is
// index/product_quantizer.h (QueryTable + ScanCodes), held to by tests/cuda_pq_shortlist_test.cu.
// Nothing here allocates or synchronizes.
#ifndef KVRECALL_KERNELS_CUDA_PQ_SHORTLIST_H_
#define KVRECALL_KERNELS_CUDA_PQ_SHORTLIST_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/topk_workspace.h"

namespace kvrecall::cuda {

// The most codebooks (code bytes per key) a code set may have.
inline constexpr int kMaxPqSubspaces = 16;
// The most dims a query may have.
inline constexpr int kMaxPqDim = 256;

// Code sets (one per KV head of each sequence, typically) in device memory. Set s has
// codebooks [M, 256, dim / M] f32 at codebooks + s * M * 256 * (dim / M) and codes [keys, M] u8
// at codes + s * set_stride * M (set_stride >= every row's length).
struct PqCodeSets {
  const float* codebooks = nullptr;
  const uint8_t* codes = nullptr;
  int64_t set_stride = 0;
  int subspaces = 0;  // M, in [1, kMaxPqSubspaces], dividing dim
  int dim = 0;        // in [1, kMaxPqDim]
};

// The query rows of a call, in device memory: queries [rows, dim] f32; set_of_row [rows] (each
// in the code sets); lengths [rows] (each in [0, max_length]) or null for max_length keys;
// tables: scratch of rows x M x 256 f32, 16-byte aligned, for the rows' lookup tables (laid out
// as the kernels see fit: up to four rows' entries of a centroid side by side). Rows come in
// groups of `group` consecutive rows that share their set and their length (the query heads of
// one KV head: a GQA group): each code is read once for up to four rows of a group.
// rows % group == 0; a group whose rows differ in set or length is device data out of range
// (not checked).
struct PqShortlistRows {
  const float* queries = nullptr;
  const int32_t* set_of_row = nullptr;
  const int32_t* lengths = nullptr;
  float* tables = nullptr;
  int rows = 0;
  int max_length = 0;
  int group = 1;
};

// For every row r, with n_r its length and s = set_of_row[r]:
//   score_i = sum over m of <q_r part m, centroid codes[s, i, m] of codebook m of set s>
//     for i < n_r (ProductQuantizer::QueryTable then ScanCodes, up to f32 summation order; in
//     f32 throughout: each table entry an fmaf chain over its part's dims in dim order, each
//     score the entries summed in codebook order, so that a score depends on nothing but the
//     query and the code): one launch builds the tables, a block per (codebook, up to four
//     rows of a group); one scores every key for the rows of a group that share a block, from
//     the range each row's table bounds its scores to, building their selection histograms as
//     it goes (as the exact top-K scan does, exact_topk.cuh), binned over that range (the
//     order-key bins would put the thousands of scores near the K-th in one bin); a collect
//     pass of its own on topk_select.cuh's parts then selects, and writes id_scores only when
//     they are asked for;
//   ids[r, 0:sizes[r]]: the positions of the min(shortlist, n_r) highest score_i, ties to the
//     lower position (SelectRowTopK's order as a set, listed in no particular order): exact
//     over the score_i, whatever their ties, so that two calls over the same inputs give the
//     same set;
//   id_scores[r, j] (when non-null): score of ids[r, j] (-0 may come back as +0).
// ids and id_scores are [rows, shortlist]. The scores are staged in ws->scores(), so ws must fit
// rows x max_length. INVALID_ARGUMENT for shapes outside the bounds above, shortlist < 1, a
// workspace that does not fit or misaligned tables, and for a group < 1 or not dividing rows;
// device data out of range (a set or length) is not checked.
absl::Status PqShortlist(const PqCodeSets& sets, const PqShortlistRows& rows, int shortlist,
                         TopKWorkspace* ws, int32_t* ids, int32_t* sizes, float* id_scores,
                         cudaStream_t stream);

}  // namespace kvrecall::cuda

#endif  // KVRECALL_KERNELS_CUDA_PQ_SHORTLIST_H_
