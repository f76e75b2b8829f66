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
constexpr int kWarps = kThreads / 32;
static_assert(kThreads == kCentroids, "a table block computes one centroid per thread");
// The fewest keys a scan block scores (16 per thread): fewer would spend a block's time on
// loading its tables and clearing and flushing its histograms.
constexpr int kMinScanChunk = 4096;
// Codes a scan thread loads before scoring the first of them: one 8-byte load waits for the
// memory once for kScanUnroll keys, not once per key.
constexpr int kScanUnroll = 4;

// A table of kRows rows, interleaved ([M][256][kRows]): entry e (codebook m, centroid c at e =
// m * 256 + c) of every row in one shared-memory load, so that a code costs the scan M loads
// of 16 bytes rather than M x kRows loads of 4. (Random centroids conflict on the banks either
// way, a 16-byte load a quarter-warp at a time: the scan gained ~1.5 us of ~25, k1.)
template <int kRows>
__device__ __forceinline__ void LoadEntry(const float* table, int entry, float (&v)[kRows]) {
  static_assert(kRows == 1 || kRows == 2 || kRows == 4);
  if constexpr (kRows == 4) {
    const float4 t = reinterpret_cast<const float4*>(table)[entry];
    v[0] = t.x;
    v[1] = t.y;
    v[2] = t.z;
    v[3] = t.w;
  } else if constexpr (kRows == 2) {
    const float2 t = reinterpret_cast<const float2*>(table)[entry];
    v[0] = t.x;
    v[1] = t.y;
  } else {
    v[0] = table[entry];
  }
}

// Block (x: codebook m, y: kRows consecutive rows of a group, which share their code set):
// thread c's <q_r part m, centroid c of codebook m> for each row r, summed in dim order (as
// ProductQuantizer::QueryTable), into the rows' interleaved table (tables + row0 * M * 256,
// [M][256][kRows]). M x rows / kRows blocks, each waiting on one centroid read per thread: the
// one block per row that this was (32 at 128K) took 8.5 us under Nsight Compute, these 64 take
// 3.6 (k3). kSub: the dims of a part when known at compile time (16, the server's), whose
// centroids are read as 16-byte vectors; 0: any (sets.dim / M).
template <int kRows, int kSub>
__global__ void __launch_bounds__(kThreads)
    PqTableKernel(PqCodeSets sets, PqShortlistRows rows) {
  __shared__ float q[kRows][kMaxPqDim];
  const int m = blockIdx.x;
  const int m_count = sets.subspaces, dim = sets.dim;
  const int sub = kSub > 0 ? kSub : dim / m_count;
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kRows;
  for (int j = threadIdx.x; j < kRows * sub; j += kThreads) {
    const int r = j / sub, e = j % sub;
    q[r][e] = rows.queries[(row0 + r) * dim + m * sub + e];
  }
  __syncthreads();
  const float* centroid =
      sets.codebooks +
      ((int64_t{rows.set_of_row[row0]} * m_count + m) * kCentroids + threadIdx.x) * sub;
  float sums[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) sums[r] = 0.0f;
  if constexpr (kSub > 0) {
    float4 c[kSub / 4];
#pragma unroll
    for (int j = 0; j < kSub / 4; ++j) c[j] = __ldg(reinterpret_cast<const float4*>(centroid) + j);
#pragma unroll
    for (int j = 0; j < kSub / 4; ++j) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        sums[r] = fmaf(q[r][4 * j], c[j].x, sums[r]);
        sums[r] = fmaf(q[r][4 * j + 1], c[j].y, sums[r]);
        sums[r] = fmaf(q[r][4 * j + 2], c[j].z, sums[r]);
        sums[r] = fmaf(q[r][4 * j + 3], c[j].w, sums[r]);
      }
    }
  } else {
    for (int j = 0; j < sub; ++j) {
      const float c = __ldg(centroid + j);
#pragma unroll
      for (int r = 0; r < kRows; ++r) sums[r] = fmaf(q[r][j], c, sums[r]);
    }
  }
  float* out = rows.tables + row0 * m_count * kCentroids +
               (static_cast<int64_t>(m) * kCentroids + threadIdx.x) * kRows;
  if constexpr (kRows == 4) {
    *reinterpret_cast<float4*>(out) = make_float4(sums[0], sums[1], sums[2], sums[3]);
  } else if constexpr (kRows == 2) {
    *reinterpret_cast<float2*>(out) = make_float2(sums[0], sums[1]);
  } else {
    out[0] = sums[0];
  }
}

// Rows one scan block serves: the largest of 4, 2, 1 dividing the group (HeadsPerBlock's, capped
// at 4 so that the tables and histograms of 16-byte codes fit beside each other in 96 KB).
inline int PqRowsPerBlock(int group) { return std::min(HeadsPerBlock(group), 4); }

// Dynamic shared memory of PqScanKernel: the kRows rows' interleaved table of up to kMaxM
// codebooks, then kRows selection histograms.
template <int kRows, int kMaxM>
constexpr size_t PqScanSmemBytes() {
  return static_cast<size_t>(kRows) * (kMaxM * kCentroids + kBins) * 4;
}

// For the kRows rows whose complete histograms are hists[r * kBins, (r + 1) * kBins) (global),
// each capped at k: FindThresholdBin's threshold bin and need into states[r], the rows side by
// side (kThreads / kRows threads scan each row's bins) rather than one after another. Called by
// the whole block. `scratch`: kWarps words of shared memory.
template <int kRows>
__device__ void FindThresholdBins(const uint32_t* hists, uint32_t k, TopKRowState* states,
                                  uint32_t* scratch) {
  constexpr int kRowThreads = kThreads / kRows;
  constexpr int kPerThread = kBins / kRowThreads;  // 8, 16 or 32
  static_assert(kRowThreads % 32 == 0 && kPerThread % 4 == 0);
  const int r = threadIdx.x / kRowThreads, t = threadIdx.x % kRowThreads;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // Thread t owns kPerThread bins counted from the top: t * kPerThread, ... (descending score),
  // which are the ascending bins [kBins - (t + 1) * kPerThread, kBins - t * kPerThread).
  const uint4* own = reinterpret_cast<const uint4*>(hists + static_cast<int64_t>(r) * kBins +
                                                    kBins - (t + 1) * kPerThread);
  uint32_t counts[kPerThread];  // descending: counts[j] is bin kBins - 1 - (t * kPerThread + j)
#pragma unroll
  for (int v = 0; v < kPerThread / 4; ++v) {
    const uint4 c = __ldcg(own + v);
    counts[kPerThread - 1 - 4 * v] = c.x;
    counts[kPerThread - 2 - 4 * v] = c.y;
    counts[kPerThread - 3 - 4 * v] = c.z;
    counts[kPerThread - 4 - 4 * v] = c.w;
  }
  uint32_t mine = 0;
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) mine += counts[j];
  // Inclusive scan over the row's threads: within the warp, then the row's warps before it.
  uint32_t through = mine;
#pragma unroll
  for (int offset = 1; offset < 32; offset *= 2) {
    const uint32_t y = __shfl_up_sync(0xffffffffu, through, offset);
    if (lane >= offset) through += y;
  }
  if (lane == 31) scratch[warp] = through;
  __syncthreads();
  for (int w = r * (kRowThreads / 32); w < warp; ++w) through += scratch[w];
  uint32_t above = through - mine;  // elements in higher bins than this thread's
  TopKRowState* state = states + r;
  if (k == 0) {
    if (t == 0) {
      state->threshold_bin = kNoThreshold;
      state->need = 0;
    }
    return;
  }
  if (above >= k || through < k) return;
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    if (above < k && above + counts[j] >= k) {
      state->threshold_bin = kBins - 1 - (t * kPerThread + j);
      state->need = k - above;
    }
    above += counts[j];
  }
}

// Block (x: a part of `chunk` keys, y: kRows consecutive rows of a group): their interleaved
// table (PqTableKernel's) into shared memory and each row's score range from it (the sums of
// each codebook's least and greatest entries, in codebook order as the scan sums a score, so
// that no score falls outside; every block of the rows computes the same range, and block 0
// leaves it in the rows' state, state[r].bin_low / bin_scale, for the collect pass), then every
// key of the part scored for each of them from one read of its code (M table loads for all
// kRows rows, summed in codebook order as ScanCodes does), the scores written to their rows and
// counted in their histograms, binned linearly over the range; the last block of the rows
// locates each row's threshold bin for the collect pass (RowHistogramKernel's work, done while
// scoring). kEightByteCodes: M == 8, one 8-byte load per code.
template <int kRows, bool kEightByteCodes>
__global__ void __launch_bounds__(kThreads)
    PqScanKernel(PqCodeSets sets, const float* tables, const int32_t* set_of_row, int chunk,
                 float* scores, RowTopKParams p) {
  constexpr int kMaxM = kEightByteCodes ? 8 : kMaxPqSubspaces;
  extern __shared__ __align__(16) unsigned char smem[];
  float* table = reinterpret_cast<float*>(smem);  // [M][256][kRows], then [kRows][kBins]:
  uint32_t* hist = reinterpret_cast<uint32_t*>(table + kRows * kMaxM * kCentroids);
  __shared__ float part_low[kMaxM][kRows], part_high[kMaxM][kRows];
  __shared__ uint32_t scratch[kWarps];
  __shared__ bool last;
  const int m_count = kEightByteCodes ? 8 : sets.subspaces;
  const int table_size = m_count * kCentroids;  // entries of one row
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kRows;
  {
    const float4* from = reinterpret_cast<const float4*>(tables + row0 * table_size);
    float4* to = reinterpret_cast<float4*>(table);
    for (int i = threadIdx.x; i < kRows * table_size / 4; i += kThreads) to[i] = __ldg(from + i);
  }
  for (int i = threadIdx.x; i < kRows * kBins; i += kThreads) hist[i] = 0;
  __syncthreads();
  // Each codebook's least and greatest entry of each row: warp w takes codebooks w, w + 8, ...
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int m = warp; m < m_count; m += kWarps) {
    float low[kRows], high[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      low[r] = INFINITY;
      high[r] = -INFINITY;
    }
#pragma unroll
    for (int c = lane; c < kCentroids; c += 32) {
      float v[kRows];
      LoadEntry<kRows>(table, m * kCentroids + c, v);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        low[r] = fminf(low[r], v[r]);
        high[r] = fmaxf(high[r], v[r]);
      }
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      low[r] = -GroupMax<32>(-low[r]);
      high[r] = GroupMax<32>(high[r]);
      if (lane == 0) {
        part_low[m][r] = low[r];
        part_high[m][r] = high[r];
      }
    }
  }
  __syncthreads();
  float bin_low[kRows], bin_scale[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    float low = 0.0f, high = 0.0f;
    for (int m = 0; m < m_count; ++m) {
      low += part_low[m][r];
      high += part_high[m][r];
    }
    bin_low[r] = low;
    bin_scale[r] = LinearBinScale(low, high);
    if (blockIdx.x == 0 && threadIdx.x == 0) {
      p.state[row0 + r].bin_low = low;
      p.state[row0 + r].bin_scale = bin_scale[r];
    }
  }
  const int n = RowLength(p, static_cast<int>(row0));  // the group's (its rows share it)
  const int begin = blockIdx.x * chunk;
  const int end = min(begin + chunk, n);
  const uint8_t* codes = sets.codes + int64_t{set_of_row[row0]} * sets.set_stride * m_count;
  // Scores key i for every row, then writes and counts them.
  auto score = [&](int i, const auto& byte_of) {
    float sum[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) sum[r] = 0.0f;
#pragma unroll
    for (int m = 0; m < kMaxM; ++m) {
      if (m >= m_count) break;
      float v[kRows];
      LoadEntry<kRows>(table, m * kCentroids + byte_of(m), v);
#pragma unroll
      for (int r = 0; r < kRows; ++r) sum[r] += v[r];
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      scores[(row0 + r) * p.score_stride + i] = sum[r];
      atomicAdd(&hist[r * kBins + LinearBinOf(sum[r], bin_low[r], bin_scale[r])], 1u);
    }
  };
  if constexpr (kEightByteCodes) {
    const uint2* words = reinterpret_cast<const uint2*>(codes);
    for (int base = begin; base < end; base += kScanUnroll * kThreads) {
      uint2 word[kScanUnroll];
#pragma unroll
      for (int u = 0; u < kScanUnroll; ++u) {
        const int i = base + u * kThreads + threadIdx.x;
        word[u] = i < end ? __ldg(words + i) : make_uint2(0, 0);
      }
#pragma unroll
      for (int u = 0; u < kScanUnroll; ++u) {
        const int i = base + u * kThreads + threadIdx.x;
        if (i >= end) break;
        score(i, [&](int m) { return ((m < 4 ? word[u].x : word[u].y) >> (8 * (m % 4))) & 0xff; });
      }
    }
  } else {
    for (int i = begin + threadIdx.x; i < end; i += kThreads) {
      const uint8_t* code = codes + static_cast<int64_t>(i) * m_count;
      score(i, [&](int m) { return static_cast<uint32_t>(__ldg(code + m)); });
    }
  }
  __syncthreads();
  for (int r = 0; r < kRows; ++r) {
    FlushHistogram<kThreads>(hist + r * kBins, p.hist + (row0 + r) * static_cast<int64_t>(kBins));
  }
  if (!FinishedLast(&p.state[row0].blocks_done, gridDim.x, &last)) return;
  FindThresholdBins<kRows>(p.hist + row0 * kBins, min(p.k, n), p.state + row0, scratch);
  if (threadIdx.x == 0) p.state[row0].blocks_done = 0;
}

// Block size of the collect pass.
constexpr int kCollectThreads = 512;
constexpr int kCollectWarps = kCollectThreads / 32;
// The most threshold-bin candidates whose keys the collect's last block caches in shared memory
// (more are read again from the scores on every radix pass).
constexpr int kCachedCandidates = 4096;
// Up to this many candidates are ranked by counting, each against all (one step, a few hundred
// clocks), rather than by radix passes (each a handful of block barriers).
constexpr int kCountedCandidates = 128;

// Appends, at slots reserved from *appended (shared), the position of every candidate i in
// [0, count) with keep(i, key_at(i)) to support[] and, with kScores, its score to
// support_scores[]. All threads of the block call it.
template <bool kScores, typename KeyAt, typename Keep>
__device__ void AppendCandidates(int count, const KeyAt& key_at, const Keep& keep,
                                 uint32_t* appended, int32_t* support, float* support_scores) {
  for (int base = 0; base < count; base += kCollectThreads) {
    const int i = base + threadIdx.x;
    const uint64_t key = i < count ? key_at(i) : 0;
    const bool kept = i < count && keep(i, key);
    const uint32_t at = WarpReserve(kept, appended);
    if (kept) {
      support[at] = PositionOfRankKey(key);
      if constexpr (kScores) {
        support_scores[at] = __uint_as_float(OrderKeyToBits(static_cast<uint32_t>(key >> 32)));
      }
    }
  }
}

// The collect pass of the shortlist's selection (RowCollectKernel's, for what the shortlist
// needs): block (x: a part of p.chunk positions, y: row r) appends the part's positions above
// the row's threshold bin to its ids (with kScores, their scores beside them, so that nothing
// is gathered afterwards) and the threshold bin's to its candidates; the row's last block then
// picks the `need` best candidates by RankKey (score, then lower position): all of them when
// that is all there are, by counting each one's betters when there are few, else by
// BlockRadixSelect from the candidates' first differing key bit (linear bins leave the
// candidates no known common bits, and a radix pass over bits they all share picks nothing),
// appends them, and leaves the row's state and histogram zero. grid = (p.splits, rows).
template <bool kScores>
__global__ void __launch_bounds__(kCollectThreads, 2) PqCollectKernel(const RowTopKParams p) {
  __shared__ uint64_t cached[kCachedCandidates];
  __shared__ RadixSelectSmem radix;
  __shared__ uint64_t diff_words[kCollectWarps];
  __shared__ uint32_t appended;
  __shared__ bool last;
  const int row = blockIdx.y;
  const int n = RowLength(p, row);
  const int k = min(p.k, n);
  TopKRowState* state = p.state + row;
  const float* scores = p.scores + row * p.score_stride;
  int32_t* support = p.support + static_cast<int64_t>(row) * p.support_stride;
  float* support_scores =
      kScores ? p.support_scores + static_cast<int64_t>(row) * p.support_stride : nullptr;
  int32_t* candidates = p.candidates + row * p.score_stride;
  const uint32_t threshold = state->threshold_bin;
  const RowBins bin_of(p, *state);
  if (k > 0) {
    const int begin = blockIdx.x * p.chunk;
    ForEachScore<kCollectThreads>(
        scores, begin, min(begin + p.chunk, n), [&](int i, float score, bool in_range) {
          const uint32_t bin = bin_of(score);
          const bool kept = in_range && bin >= threshold;
          // Most of a row lies below its threshold bin: a warp with none of its 32 scores at
          // or above it appends nothing.
          if (!__any_sync(0xffffffffu, kept)) return;
          const bool above = kept && bin > threshold;
          const uint32_t at = WarpReserve(above, &state->selected);
          if (above) {
            support[at] = i;
            if constexpr (kScores) support_scores[at] = score;
          }
          WarpAppend(kept && bin == threshold, i, &state->candidates, candidates);
        });
  }
  if (!FinishedLast(&state->blocks_done, gridDim.x, &last)) return;

  const uint32_t need = state->need;
  const int count = static_cast<int>(__ldcg(&state->candidates));
  if (threadIdx.x == 0) appended = __ldcg(&state->selected);
  __syncthreads();
  if (need > 0 && count > 0) {
    const bool fits = count <= kCachedCandidates;
    auto fresh_key = [&](int i) {
      const int32_t pos = __ldcg(candidates + i);
      return RankKey(__ldg(scores + pos), pos);
    };
    if (fits) {
      for (int i = threadIdx.x; i < count; i += kCollectThreads) cached[i] = fresh_key(i);
      __syncthreads();
    }
    auto key_at = [&](int i) { return fits ? cached[i] : fresh_key(i); };
    if (need == static_cast<uint32_t>(count)) {
      AppendCandidates<kScores>(
          count, key_at, [](int, uint64_t) { return true; }, &appended, support,
          support_scores);
    } else if (count <= kCountedCandidates) {  // (then fits)
      AppendCandidates<kScores>(
          count, key_at,
          [&](int, uint64_t key) {
            uint32_t better = 0;  // keys are unique: exactly `need` have fewer than need
            for (int j = 0; j < count; ++j) better += cached[j] > key ? 1u : 0u;
            return better < need;
          },
          &appended, support, support_scores);
    } else {
      // The bits every candidate shares: those above the highest bit any differs from key 0 in.
      const uint64_t first = key_at(0);
      uint64_t diff = 0;
      for (int i = threadIdx.x; i < count; i += kCollectThreads) diff |= key_at(i) ^ first;
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) {
        diff |= __shfl_xor_sync(0xffffffffu, diff, offset);
      }
      if (threadIdx.x % 32 == 0) diff_words[threadIdx.x / 32] = diff;
      __syncthreads();
      diff = 0;
#pragma unroll
      for (int w = 0; w < kCollectWarps; ++w) diff |= diff_words[w];
      const int low_bits = diff == 0 ? 0 : 64 - __clzll(static_cast<long long>(diff));
      const RadixThreshold t =
          BlockRadixSelect<kCollectThreads>(count, need, low_bits, key_at, &radix);
      AppendCandidates<kScores>(
          count, key_at, [&](int, uint64_t key) { return (key & t.mask) >= t.prefix; },
          &appended, support, support_scores);
    }
  }
  if (threadIdx.x == 0) p.support_size[row] = k;
  // Leave the row's workspace as it was found: zero (every thread is past its reads of it).
  __syncthreads();
  uint32_t* row_hist = p.hist + static_cast<int64_t>(row) * kBins;
  for (int b = threadIdx.x; b < kBins; b += kCollectThreads) row_hist[b] = 0;
  if (threadIdx.x == 0) *state = TopKRowState{};
}

// Plans and launches the table, the scan for kRows rows per block and the collect pass of the
// selection `p` (its splits planned here, before any launch, so that a failure leaves the
// workspace as it was).
template <int kRows, bool kEightByteCodes>
absl::Status LaunchPqShortlist(const PqCodeSets& sets, const PqShortlistRows& rows, float* scores,
                               RowTopKParams p, cudaStream_t stream) {
  constexpr auto kScan = &PqScanKernel<kRows, kEightByteCodes>;
  constexpr size_t kSmem = PqScanSmemBytes<kRows, kEightByteCodes ? 8 : kMaxPqSubspaces>();
  const absl::StatusOr<int> slots = DeviceBlockSlots<kScan>(kThreads, kSmem);
  if (!slots.ok()) return slots.status();
  const bool scores_out = p.support_scores != nullptr;
  const absl::StatusOr<int> collect_slots =
      scores_out ? DeviceBlockSlots<&PqCollectKernel<true>>(kCollectThreads, 0)
                 : DeviceBlockSlots<&PqCollectKernel<false>>(kCollectThreads, 0);
  if (!collect_slots.ok()) return collect_slots.status();
  PlanRowPasses(rows.rows, rows.max_length, *collect_slots, &p);

  const dim3 table_grid(sets.subspaces, rows.rows / kRows);
  // The server's parts are 16 dims (BulkCodes::kDimsPerCode), read as vectors when aligned.
  if (sets.dim == 16 * sets.subspaces && (reinterpret_cast<uintptr_t>(sets.codebooks) & 15) == 0) {
    PqTableKernel<kRows, 16><<<table_grid, kThreads, 0, stream>>>(sets, rows);
  } else {
    PqTableKernel<kRows, 0><<<table_grid, kThreads, 0, stream>>>(sets, rows);
  }
  KVRECALL_CUDA_RETURN_IF_ERROR(LaunchStatus("PqTableKernel"));
  // One wave of blocks, each scoring at least kMinScanChunk keys, and at most one block per
  // multiprocessor while the rows' blocks fit that: blocks side by side only share the
  // multiprocessor's shared-memory pipe, which the lookups keep busy, while each block loads
  // its rows' tables and flushes their histograms to global memory, so fewer, longer blocks
  // do less of that (k3 at 128K: the shortlist 38.6 us in process against 40.6 with up to
  // three blocks per multiprocessor).
  const int blocks = rows.rows / kRows;
  const absl::StatusOr<int> sms = MultiprocessorCount();
  if (!sms.ok()) return sms.status();
  const int wave = blocks <= *sms ? *sms : *slots;
  const int splits =
      std::max(1, std::min(wave / blocks, CeilDiv(rows.max_length, kMinScanChunk)));
  const int chunk = CeilDiv(rows.max_length, splits);
  kScan<<<dim3(CeilDiv(rows.max_length, chunk), blocks), kThreads, kSmem, stream>>>(
      sets, rows.tables, rows.set_of_row, chunk, scores, p);
  KVRECALL_CUDA_RETURN_IF_ERROR(LaunchStatus("PqScanKernel"));
  const dim3 collect_grid(p.splits, rows.rows);
  if (scores_out) {
    PqCollectKernel<true><<<collect_grid, kCollectThreads, 0, stream>>>(p);
  } else {
    PqCollectKernel<false><<<collect_grid, kCollectThreads, 0, stream>>>(p);
  }
  return LaunchStatus("PqCollectKernel");
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
  if (reinterpret_cast<uintptr_t>(rows.tables) % 16 != 0) {
    return absl::InvalidArgumentError("the tables must start 16-byte aligned");
  }
  RowTopKParams p{};
  p.scores = ws->scores();
  p.score_stride = ws->max_tokens();
  p.lengths = rows.lengths;
  p.length = rows.max_length;
  p.max_length = rows.max_length;
  p.k = shortlist;
  p.hist = ws->histograms();
  p.state = ws->states();
  p.candidates = ws->candidates();
  p.support = ids;
  p.support_stride = shortlist;
  p.support_size = sizes;
  p.support_scores = id_scores;
  p.linear_bins = true;  // over each row's range, from its table
  const bool eight_bytes = sets.subspaces == 8;
  switch (PqRowsPerBlock(rows.group)) {
    case 4:
      return eight_bytes ? LaunchPqShortlist<4, true>(sets, rows, ws->scores(), p, stream)
                         : LaunchPqShortlist<4, false>(sets, rows, ws->scores(), p, stream);
    case 2:
      return eight_bytes ? LaunchPqShortlist<2, true>(sets, rows, ws->scores(), p, stream)
                         : LaunchPqShortlist<2, false>(sets, rows, ws->scores(), p, stream);
    default:
      return eight_bytes ? LaunchPqShortlist<1, true>(sets, rows, ws->scores(), p, stream)
                         : LaunchPqShortlist<1, false>(sets, rows, ws->scores(), p, stream);
  }
}

}  // namespace kvrecall::cuda
