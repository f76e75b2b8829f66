#include "kernels/cuda/pq_shortlist.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/topk_select.cuh"

namespace kvrecall::cuda {
namespace {

constexpr int kCentroids = 256;
constexpr int kThreads = 256;
static_assert(kThreads == kCentroids, "a block builds its table one centroid per thread");
// The fewest keys a scan block scores (16 per thread): fewer would spend a block's time on
// loading its tables and clearing and flushing its histograms.
constexpr int kMinScanChunk = 4096;

// Block r: row r's table of <q part m, centroid c> ([M, 256]; thread c computes centroid c's
// products), built once per row rather than by every block of the scan, and the range its
// scores can take (the sums of each part's least and greatest entries, summed in part order as
// the scan sums a score, so that no score falls outside), which the selection's linear bins
// span (state[r].bin_low / bin_scale). kSub: the dims of a part when known at compile time (16,
// the server's), whose centroids are read as 16-byte vectors, every part's at once (a part at a
// time waited for the memory M times); 0: any (sets.dim / M).
template <int kSub>
__global__ void __launch_bounds__(kThreads)
    PqTableKernel(PqCodeSets sets, PqShortlistRows rows, TopKRowState* state) {
  constexpr int kWarps = kThreads / 32;
  __shared__ float q[kMaxPqDim];
  __shared__ float part_low[kWarps][kMaxPqSubspaces], part_high[kWarps][kMaxPqSubspaces];
  const int r = blockIdx.x;
  const int dim = sets.dim, m_count = sets.subspaces;
  const int sub = kSub > 0 ? kSub : dim / m_count;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int j = threadIdx.x; j < dim; j += kThreads) q[j] = rows.queries[int64_t{r} * dim + j];
  __syncthreads();
  const float* books = sets.codebooks + int64_t{rows.set_of_row[r]} * m_count * kCentroids * sub;
  float* table = rows.tables + int64_t{r} * m_count * kCentroids;
  // The products, each summed in dim order (as ProductQuantizer::QueryTable).
  float sums[kMaxPqSubspaces];
#pragma unroll
  for (int m = 0; m < kMaxPqSubspaces; ++m) {
    sums[m] = 0.0f;
    if (m >= m_count) continue;
    const float* centroid = books + (int64_t{m} * kCentroids + threadIdx.x) * sub;
    if constexpr (kSub > 0) {
#pragma unroll
      for (int j = 0; j < kSub; j += 4) {
        const float4 c = __ldg(reinterpret_cast<const float4*>(centroid + j));
        sums[m] = fmaf(q[m * kSub + j], c.x, sums[m]);
        sums[m] = fmaf(q[m * kSub + j + 1], c.y, sums[m]);
        sums[m] = fmaf(q[m * kSub + j + 2], c.z, sums[m]);
        sums[m] = fmaf(q[m * kSub + j + 3], c.w, sums[m]);
      }
    } else {
      for (int j = 0; j < sub; ++j) sums[m] = fmaf(q[m * sub + j], centroid[j], sums[m]);
    }
  }
#pragma unroll
  for (int m = 0; m < kMaxPqSubspaces; ++m) {
    if (m >= m_count) continue;
    const float sum = sums[m];
    table[m * kCentroids + threadIdx.x] = sum;
    const float low = -GroupMax<32>(-sum), high = GroupMax<32>(sum);
    if (lane == 0) {
      part_low[warp][m] = low;
      part_high[warp][m] = high;
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float low = 0.0f, high = 0.0f;
    for (int m = 0; m < m_count; ++m) {
      float part_min = part_low[0][m], part_max = part_high[0][m];
      for (int w = 1; w < kWarps; ++w) {
        part_min = fminf(part_min, part_low[w][m]);
        part_max = fmaxf(part_max, part_high[w][m]);
      }
      low += part_min;
      high += part_max;
    }
    state[r].bin_low = low;
    state[r].bin_scale = LinearBinScale(low, high);
  }
}

// Rows one scan block serves: the largest of 4, 2, 1 dividing the group (HeadsPerBlock's, capped
// at 4 so that the tables and histograms of 16-byte codes fit beside each other in 96 KB).
inline int PqRowsPerBlock(int group) { return std::min(HeadsPerBlock(group), 4); }

// Dynamic shared memory of PqScanKernel: kRows tables of up to kMaxM codebooks, then kRows
// selection histograms.
template <int kRows, int kMaxM>
constexpr size_t PqScanSmemBytes() {
  return static_cast<size_t>(kRows) * (kMaxM * kCentroids + kBins) * 4;
}

// Block (x: a part of `chunk` keys, y: kRows consecutive rows of a group): their tables into
// shared memory, then every key of the part scored for each of them from one read of its code
// (M table lookups per row, summed in codebook order as ScanCodes does), the scores written to
// their rows and counted in their histograms; the last block of the rows locates each row's
// threshold bin for the collect pass (RowHistogramKernel's work, done while scoring).
// kEightByteCodes: M == 8, one 8-byte load per code.
template <int kRows, bool kEightByteCodes>
__global__ void __launch_bounds__(kThreads)
    PqScanKernel(PqCodeSets sets, const float* tables, const int32_t* set_of_row, int chunk,
                 float* scores, RowTopKParams p) {
  constexpr int kMaxM = kEightByteCodes ? 8 : kMaxPqSubspaces;
  extern __shared__ __align__(16) unsigned char smem[];
  float* table = reinterpret_cast<float*>(smem);  // [kRows][M][256], then [kRows][kBins]:
  uint32_t* hist = reinterpret_cast<uint32_t*>(table + kRows * kMaxM * kCentroids);
  __shared__ uint32_t scratch[32];
  __shared__ bool last;
  const int m_count = kEightByteCodes ? 8 : sets.subspaces;
  const int table_size = m_count * kCentroids;
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kRows;
  for (int i = threadIdx.x; i < kRows * table_size; i += kThreads) {
    table[i] = tables[row0 * table_size + i];
  }
  for (int i = threadIdx.x; i < kRows * kBins; i += kThreads) hist[i] = 0;
  __syncthreads();
  float bin_low[kRows], bin_scale[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    bin_low[r] = p.state[row0 + r].bin_low;
    bin_scale[r] = p.state[row0 + r].bin_scale;
  }
  const int n = RowLength(p, static_cast<int>(row0));  // the group's (its rows share it)
  const int begin = blockIdx.x * chunk;
  const int end = min(begin + chunk, n);
  const uint8_t* codes = sets.codes + int64_t{set_of_row[row0]} * sets.set_stride * m_count;
  for (int i = begin + threadIdx.x; i < end; i += kThreads) {
    float sum[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) sum[r] = 0.0f;
    if constexpr (kEightByteCodes) {
      const uint2 word = __ldg(reinterpret_cast<const uint2*>(codes) + i);
#pragma unroll
      for (int m = 0; m < 8; ++m) {
        const uint32_t byte = ((m < 4 ? word.x : word.y) >> (8 * (m % 4))) & 0xff;
#pragma unroll
        for (int r = 0; r < kRows; ++r) sum[r] += table[r * table_size + m * kCentroids + byte];
      }
    } else {
      const uint8_t* code = codes + static_cast<int64_t>(i) * m_count;
      for (int m = 0; m < m_count; ++m) {
        const uint32_t byte = __ldg(code + m);
#pragma unroll
        for (int r = 0; r < kRows; ++r) sum[r] += table[r * table_size + m * kCentroids + byte];
      }
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      scores[(row0 + r) * p.score_stride + i] = sum[r];
      atomicAdd(&hist[r * kBins + LinearBinOf(sum[r], bin_low[r], bin_scale[r])], 1u);
    }
  }
  __syncthreads();
  for (int r = 0; r < kRows; ++r) {
    FlushHistogram<kThreads>(hist + r * kBins, p.hist + (row0 + r) * static_cast<int64_t>(kBins));
  }
  if (!FinishedLast(&p.state[row0].blocks_done, gridDim.x, &last)) return;
  for (int r = 0; r < kRows; ++r) {
    FindThresholdBin<kThreads>(p.hist + (row0 + r) * static_cast<int64_t>(kBins), min(p.k, n),
                               &p.state[row0 + r], scratch);
  }
  if (threadIdx.x == 0) p.state[row0].blocks_done = 0;
}

// Plans and launches the table and the scan for kRows rows per block, then the collect pass of
// the selection `p` (planned).
template <int kRows, bool kEightByteCodes>
absl::Status LaunchPqScan(const PqCodeSets& sets, const PqShortlistRows& rows, float* scores,
                          const RowTopKParams& p, cudaStream_t stream) {
  constexpr auto kScan = &PqScanKernel<kRows, kEightByteCodes>;
  constexpr size_t kSmem = PqScanSmemBytes<kRows, kEightByteCodes ? 8 : kMaxPqSubspaces>();
  const absl::StatusOr<int> slots = DeviceBlockSlots<kScan>(kThreads, kSmem);
  if (!slots.ok()) return slots.status();
  // The server's parts are 16 dims (BulkCodes::kDimsPerCode), read as vectors when aligned.
  if (sets.dim == 16 * sets.subspaces && (reinterpret_cast<uintptr_t>(sets.codebooks) & 15) == 0) {
    PqTableKernel<16><<<rows.rows, kThreads, 0, stream>>>(sets, rows, p.state);
  } else {
    PqTableKernel<0><<<rows.rows, kThreads, 0, stream>>>(sets, rows, p.state);
  }
  KVRECALL_CUDA_RETURN_IF_ERROR(LaunchStatus("PqTableKernel"));
  // One wave of blocks, each scoring at least kMinScanChunk keys.
  const int blocks = rows.rows / kRows;
  const int splits =
      std::max(1, std::min(*slots / blocks, CeilDiv(rows.max_length, kMinScanChunk)));
  const int chunk = CeilDiv(rows.max_length, splits);
  kScan<<<dim3(CeilDiv(rows.max_length, chunk), blocks), kThreads, kSmem, stream>>>(
      sets, rows.tables, rows.set_of_row, chunk, scores, p);
  KVRECALL_CUDA_RETURN_IF_ERROR(LaunchStatus("PqScanKernel"));
  return LaunchRowSelection(p, rows.rows, stream);
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
  if (rows.group < 1 || rows.rows % rows.group != 0) {
    return absl::InvalidArgumentError(absl::StrCat("rows come in groups that divide them; got ",
                                                   rows.rows, " rows in groups of ", rows.group));
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
  absl::StatusOr<RowTopKParams> selection =
      PlanRowSelection(ws->scores(), ws->max_tokens(), rows.rows, rows.max_length, rows.lengths,
                       shortlist, ws, ids, shortlist, sizes, id_scores);
  if (!selection.ok()) return selection.status();
  RowTopKParams& p = *selection;
  p.linear_bins = true;  // over each row's range, from its table
  const bool eight_bytes = sets.subspaces == 8;
  switch (PqRowsPerBlock(rows.group)) {
    case 4:
      return eight_bytes ? LaunchPqScan<4, true>(sets, rows, ws->scores(), p, stream)
                         : LaunchPqScan<4, false>(sets, rows, ws->scores(), p, stream);
    case 2:
      return eight_bytes ? LaunchPqScan<2, true>(sets, rows, ws->scores(), p, stream)
                         : LaunchPqScan<2, false>(sets, rows, ws->scores(), p, stream);
    default:
      return eight_bytes ? LaunchPqScan<1, true>(sets, rows, ws->scores(), p, stream)
                         : LaunchPqScan<1, false>(sets, rows, ws->scores(), p, stream);
  }
}

}  // namespace kvrecall::cuda
