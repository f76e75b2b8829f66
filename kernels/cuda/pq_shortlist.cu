#include "kernels/cuda/pq_shortlist.h"

#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/launch.cuh"

namespace kvrecall::cuda {
namespace {

constexpr int kCentroids = 256;
constexpr int kThreads = 256;
// Keys one block scores: a row of 128K keys is spread over 32 blocks.
constexpr int kKeysPerBlock = 4096;
static_assert(kThreads == kCentroids, "a block builds its table one centroid per thread");

// Block r: row r's table of <q part m, centroid c> ([M, 256]; thread c computes centroid c's
// products), built once per row rather than by every block of the scan.
__global__ void __launch_bounds__(kThreads)
    PqTableKernel(PqCodeSets sets, PqShortlistRows rows) {
  __shared__ float q[kMaxPqDim];
  const int r = blockIdx.x;
  const int dim = sets.dim, m_count = sets.subspaces, sub = dim / m_count;
  for (int j = threadIdx.x; j < dim; j += kThreads) q[j] = rows.queries[int64_t{r} * dim + j];
  __syncthreads();
  const float* books = sets.codebooks + int64_t{rows.set_of_row[r]} * m_count * kCentroids * sub;
  float* table = rows.tables + int64_t{r} * m_count * kCentroids;
  for (int m = 0; m < m_count; ++m) {
    const float* centroid = books + (int64_t{m} * kCentroids + threadIdx.x) * sub;
    float sum = 0.0f;
    for (int j = 0; j < sub; ++j) sum = fmaf(q[m * sub + j], centroid[j], sum);
    table[m * kCentroids + threadIdx.x] = sum;
  }
}

// Block (x: a part of the row's keys, y: the row): the row's table into shared memory, then
// every key of its part scored by M table lookups.
__global__ void __launch_bounds__(kThreads)
    PqScoreKernel(PqCodeSets sets, PqShortlistRows rows, float* scores, int64_t score_stride) {
  __shared__ float table[kMaxPqSubspaces * kCentroids];
  const int r = blockIdx.y;
  const int64_t length = rows.lengths != nullptr ? rows.lengths[r] : rows.max_length;
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kKeysPerBlock;
  if (begin >= length) return;
  const int m_count = sets.subspaces;
  const float* row_table = rows.tables + int64_t{r} * m_count * kCentroids;
  for (int i = threadIdx.x; i < m_count * kCentroids; i += kThreads) table[i] = row_table[i];
  __syncthreads();
  const uint8_t* codes = sets.codes + int64_t{rows.set_of_row[r]} * sets.set_stride * m_count;
  const int64_t end = min(length, begin + kKeysPerBlock);
  float* out = scores + int64_t{r} * score_stride;
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    const uint8_t* code = codes + i * m_count;
    float sum = 0.0f;
    if (m_count == 8) {
      // One 8-byte load per key (codes of 8-byte keys are 8-byte aligned).
      const uint2 word = *reinterpret_cast<const uint2*>(code);
#pragma unroll
      for (int m = 0; m < 4; ++m) sum += table[m * kCentroids + ((word.x >> (8 * m)) & 0xff)];
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        sum += table[(m + 4) * kCentroids + ((word.y >> (8 * m)) & 0xff)];
      }
    } else {
      for (int m = 0; m < m_count; ++m) sum += table[m * kCentroids + code[m]];
    }
    out[i] = sum;
  }
}

}  // namespace

absl::Status PqShortlist(const PqCodeSets& sets, const PqShortlistRows& rows, int shortlist,
                         TopKWorkspace* ws, int32_t* ids, int32_t* sizes, float* id_scores,
                         cudaStream_t stream) {
  if (sets.subspaces < 1 || sets.subspaces > kMaxPqSubspaces || sets.dim < 1 ||
      sets.dim > kMaxPqDim || sets.dim % sets.subspaces != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "PQ code sets need 1 <= subspaces <= ", kMaxPqSubspaces, " dividing a dim in [1, ",
        kMaxPqDim, "]; got subspaces=", sets.subspaces, " dim=", sets.dim));
  }
  if (rows.rows < 0 || rows.max_length < 0 || shortlist < 1 ||
      sets.set_stride < rows.max_length) {
    return absl::InvalidArgumentError(absl::StrCat(
        "need rows >= 0, max_length >= 0, shortlist >= 1 and set_stride >= max_length; got rows=",
        rows.rows, " max_length=", rows.max_length, " shortlist=", shortlist,
        " set_stride=", sets.set_stride));
  }
  if (ws == nullptr) return absl::InvalidArgumentError("a TopKWorkspace is required");
  KVRECALL_CUDA_RETURN_IF_ERROR(ws->CheckFits(rows.rows, rows.max_length));
  if (rows.rows == 0 || rows.max_length == 0) {
    // Every row is empty: nothing to score, every size 0.
    if (rows.rows > 0) {
      KVRECALL_CUDA_RETURN_IF_ERROR(CudaStatus(
          cudaMemsetAsync(sizes, 0, sizeof(int32_t) * rows.rows, stream), "clearing sizes"));
    }
    return absl::OkStatus();
  }
  if (sets.codebooks == nullptr || sets.codes == nullptr || rows.queries == nullptr ||
      rows.set_of_row == nullptr || rows.tables == nullptr || ids == nullptr || sizes == nullptr) {
    return absl::InvalidArgumentError(
        "codebooks, codes, queries, set_of_row, tables, ids and sizes must be device pointers");
  }
  if (sets.subspaces == 8 && reinterpret_cast<uintptr_t>(sets.codes) % 8 != 0) {
    return absl::InvalidArgumentError("8-byte codes must start 8-byte aligned");
  }
  PqTableKernel<<<rows.rows, kThreads, 0, stream>>>(sets, rows);
  KVRECALL_CUDA_RETURN_IF_ERROR(LaunchStatus("PqTableKernel"));
  const dim3 grid((rows.max_length + kKeysPerBlock - 1) / kKeysPerBlock, rows.rows);
  PqScoreKernel<<<grid, kThreads, 0, stream>>>(sets, rows, ws->scores(), ws->max_tokens());
  KVRECALL_CUDA_RETURN_IF_ERROR(LaunchStatus("PqScoreKernel"));
  return SelectRowTopK(ws->scores(), ws->max_tokens(), rows.rows, rows.max_length, rows.lengths,
                       shortlist, ws, ids, shortlist, sizes, id_scores, stream);
}

}  // namespace kvrecall::cuda
