// Exact top-K selection over rows of f32 scores on the GPU, the shared machinery of the exact
// top-K decode path, the ReTopK reuse path and the batch top-k of the index build.
//
// Order: a larger score first, equal scores by the lower position (RankKey in common.cuh), the
// order of cpu::TopKPositions. A row is selected by radix select:
//   1. a histogram of each score's top kBinBits order-key bits (built while scoring, or by
//      RowHistogramKernel) locates the threshold bin holding the K-th largest score; or, for rows
//      whose scores lie in a range known before they are scored (linear_bins: the PQ
//      shortlist's, bounded by its lookup tables), of kBins equal parts of that range, where the
//      order-key bins of a narrow range would put thousands of scores in the threshold bin;
//   2. a pass over the row appends positions above that bin to the output and the threshold
//      bin's positions to a candidate list;
//   3. one block radix-selects the missing ones among the candidates on the remaining bits of
//      the unique 64-bit RankKey (on all of them for linear bins), so the result is exact
//      whatever the ties.
// Per-row state and histograms live in a workspace that starts zeroed and is left zeroed by
// the last block of each row (no memset inside a step; CUDA-graph friendly).
#ifndef KVRECALL_KERNELS_CUDA_TOPK_SELECT_CUH_
#define KVRECALL_KERNELS_CUDA_TOPK_SELECT_CUH_

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/topk_workspace.h"

namespace kvrecall::cuda {

inline constexpr int kBinBits = 11;
inline constexpr int kBins = 1 << kBinBits;
inline constexpr int kBinShift = 32 - kBinBits;
// RankKey bits below the threshold bin's: 21 order-key bits and 32 position bits.
inline constexpr int kBitsBelowBin = 64 - kBinBits;
inline constexpr uint32_t kNoThreshold = 0xffffffffu;

__device__ __forceinline__ uint32_t BinOf(float score) { return OrderKey(score) >> kBinShift; }

// The linear bin of a score in a row whose histogram spans [low, low + kBins / scale): the part
// of the range it falls in, scores below and above the range counted in the first and last
// bins. Non-decreasing in the score, and equal scores share a bin, so a bin above another holds
// only larger scores, as with BinOf. The rounding is explicit, so that every kernel that bins a
// score agrees on its bin.
__device__ __forceinline__ uint32_t LinearBinOf(float score, float low, float scale) {
  const float x = __fmul_rn(__fsub_rn(score, low), scale);
  if (!(x > 0.0f)) return 0;  // (NaN from a zero scale and an infinite distance, too)
  return x >= static_cast<float>(kBins - 1) ? kBins - 1 : static_cast<uint32_t>(x);
}

// The scale LinearBinOf needs for a row of scores in [low, high]: 0 (every score in bin 0) for
// an empty or degenerate range.
__device__ __forceinline__ float LinearBinScale(float low, float high) {
  const float width = high - low;
  return width > 0.0f && isfinite(width) ? static_cast<float>(kBins) / width : 0.0f;
}

// Block-wide sum / max; every thread gets the result. `scratch`: 32 floats of shared memory,
// free on entry and on return.
template <int kThreads>
__device__ float BlockSum(float x, float* scratch) {
  static_assert(kThreads % 32 == 0);
  x = GroupSum<32>(x);
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0) scratch[warp] = x;
  __syncthreads();
  float total = 0.0f;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) total += scratch[w];
  __syncthreads();
  return total;
}
template <int kThreads>
__device__ float BlockMax(float x, float* scratch) {
  x = GroupMax<32>(x);
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0) scratch[warp] = x;
  __syncthreads();
  float best = -INFINITY;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) best = fmaxf(best, scratch[w]);
  __syncthreads();
  return best;
}

// Block-wide inclusive prefix sum of one value per thread. `scratch`: 32 words of shared memory.
template <int kThreads>
__device__ uint32_t BlockInclusiveScan(uint32_t x, uint32_t* scratch) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
#pragma unroll
  for (int offset = 1; offset < 32; offset *= 2) {
    const uint32_t y = __shfl_up_sync(0xffffffffu, x, offset);
    if (lane >= offset) x += y;
  }
  if (lane == 31) scratch[warp] = x;
  __syncthreads();
  uint32_t before = 0;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) before += w < warp ? scratch[w] : 0u;
  __syncthreads();
  return x + before;
}

// Reserves one slot of a list grown through *counter for every lane with `keep`, with one
// atomic per warp; returns the lane's slot (unspecified without `keep`). Call with all lanes.
__device__ __forceinline__ uint32_t WarpReserve(bool keep, uint32_t* counter) {
  const unsigned mask = __ballot_sync(0xffffffffu, keep);
  if (mask == 0) return 0;
  const int lane = threadIdx.x % 32;
  const int leader = __ffs(mask) - 1;
  uint32_t base = 0;
  if (lane == leader) base = atomicAdd(counter, static_cast<uint32_t>(__popc(mask)));
  base = __shfl_sync(0xffffffffu, base, leader);
  return base + __popc(mask & ((1u << lane) - 1));
}

// Appends `value` to the list grown through *counter for every lane with `keep`.
__device__ __forceinline__ void WarpAppend(bool keep, int32_t value, uint32_t* counter,
                                           int32_t* list) {
  const uint32_t slot = WarpReserve(keep, counter);
  if (keep) list[slot] = value;
}

// Adds a block's shared-memory histogram into the row's global one, skipping empty bins.
template <int kThreads>
__device__ __forceinline__ void FlushHistogram(const uint32_t* block_hist, uint32_t* row_hist) {
  for (int bin = threadIdx.x; bin < kBins; bin += kThreads) {
    const uint32_t c = block_hist[bin];
    if (c != 0) atomicAdd(row_hist + bin, c);
  }
}

// How a launch's blocks are shared out among the units (rows, or head groups) that have work.
struct BlockShare {
  int unit;    // the unit this block serves
  int split;   // its part of the unit, of `blocks` parts of `chunk` positions
  int blocks;
  int chunk;
  bool ok;     // false: nothing for this block
};

// The most units ShareBlocks shares out (64 ballot words).
inline constexpr int kMaxSharedUnits = 64 * 32;

// Shares the blocks of the launch among the units u in [0, units) with is_active(u), in order:
// each gets as many parts of `length` positions as divide the launch, every part at least
// min_chunk positions (but one) and a multiple of `align`. So a step whose few rows have work
// spreads them over every multiprocessor instead of leaving the blocks planned for the others
// idle. Called by the whole block; warp 0 decides. units <= kMaxSharedUnits.
template <typename IsActive>
__device__ BlockShare ShareBlocks(int units, const IsActive& is_active, int length, int align,
                                  int min_chunk) {
  __shared__ uint32_t words[kMaxSharedUnits / 32];
  __shared__ BlockShare shared;
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    int active = 0;
    for (int w = 0; w * 32 < units; ++w) {
      const int u = w * 32 + lane;
      const unsigned mask = __ballot_sync(0xffffffffu, u < units && is_active(u));
      if (lane == 0) words[w] = mask;
      active += __popc(mask);
    }
    if (lane == 0) {
      BlockShare share{0, 0, 1, align, false};
      if (active > 0) {
        const int launch = gridDim.x * gridDim.y * gridDim.z;
        const int linear = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
        const int longest = max(length, 1);
        const int per = max(1, min(launch / active, (longest + min_chunk - 1) / min_chunk));
        const int chunk = ((longest + per - 1) / per + align - 1) / align * align;
        const int blocks = (longest + chunk - 1) / chunk;
        const int nth = linear / per;
        const int split = linear - nth * per;
        if (nth < active && split < blocks) {
          int seen = 0;
          for (int w = 0;; ++w) {  // the nth active unit
            const uint32_t m = words[w];
            const int c = __popc(m);
            if (seen + c > nth) {
              uint32_t rest = m;
              for (int k = nth - seen; k > 0; --k) rest &= rest - 1;
              share = BlockShare{w * 32 + __ffs(rest) - 1, split, blocks, chunk, true};
              break;
            }
            seen += c;
          }
        }
      }
      shared = share;
    }
  }
  __syncthreads();
  return shared;
}

// Locates the threshold bin of the k-th largest score from a complete row histogram and writes
// state->threshold_bin / need. Called by one whole block. `scratch`: 32 words of shared memory.
template <int kThreads>
__device__ void FindThresholdBin(const uint32_t* row_hist, uint32_t k, TopKRowState* state,
                                 uint32_t* scratch) {
  static_assert(kBins % kThreads == 0);
  constexpr int kPerThread = kBins / kThreads;
  // Thread i owns bins counted from the top: i * kPerThread ... (descending score).
  uint32_t counts[kPerThread];
  uint32_t mine = 0;
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    counts[j] = __ldcg(row_hist + (kBins - 1 - (threadIdx.x * kPerThread + j)));
    mine += counts[j];
  }
  const uint32_t through = BlockInclusiveScan<kThreads>(mine, scratch);
  uint32_t above = through - mine;  // elements in higher bins than this thread's
  if (threadIdx.x == 0 && k == 0) {
    state->threshold_bin = kNoThreshold;
    state->need = 0;
  }
  if (k == 0 || above >= k || through < k) return;
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    if (above < k && above + counts[j] >= k) {
      state->threshold_bin = kBins - 1 - (threadIdx.x * kPerThread + j);
      state->need = k - above;
    }
    above += counts[j];
  }
}

// The result of a radix select: element i is in the top `need` iff (key & mask) >= prefix.
struct RadixThreshold {
  uint64_t prefix;
  uint64_t mask;
};

// Appends every element whose rank key clears `t` (a BlockRadixSelect threshold over key_at(0..
// count)), in no particular order, at slots reserved from *appended (shared): its position to
// positions[] and support[], its score to scores[]. All threads of the block call it.
template <int kThreads, typename KeyAt>
__device__ void AppendSelected(int count, KeyAt key_at, const RadixThreshold& t,
                               uint32_t* appended, int32_t* positions, float* scores,
                               int32_t* support) {
  for (int base = 0; base < count; base += kThreads) {
    const int i = base + threadIdx.x;
    const uint64_t key = i < count ? key_at(i) : 0;
    const bool keep = i < count && (key & t.mask) >= t.prefix;
    const uint32_t at = WarpReserve(keep, appended);
    if (keep) {
      const int32_t position = PositionOfRankKey(key);
      positions[at] = position;
      scores[at] = __uint_as_float(OrderKeyToBits(static_cast<uint32_t>(key >> 32)));
      support[at] = position;
    }
  }
}

// Shared memory of BlockRadixSelect.
struct RadixSelectSmem {
  uint32_t hist[256];
  uint32_t scratch[32];
  uint64_t prefix;
  uint64_t mask;
  uint32_t remaining;
  uint32_t done;
};

// Finds the threshold of the `need` largest keys among `count` unique 64-bit keys that all
// share their bits above `low_bits` (0 < need <= count). key_at(i) returns key i. One whole
// block calls it; it reads each key once per 8-bit digit, stopping as soon as the threshold
// digit's bucket is exactly what is missing.
template <int kThreads, typename KeyAt>
__device__ RadixThreshold BlockRadixSelect(int count, uint32_t need, int low_bits, KeyAt key_at,
                                           RadixSelectSmem* smem) {
  static_assert(kThreads >= 256);
  if (threadIdx.x == 0) {
    // All keys share the bits above low_bits; take them from key 0.
    smem->mask = low_bits >= 64 ? 0 : ~((uint64_t{1} << low_bits) - 1);
    smem->prefix = key_at(0) & smem->mask;
    smem->remaining = need;
    smem->done = need == static_cast<uint32_t>(count);
  }
  __syncthreads();
  int bits = low_bits;
  while (!smem->done && bits > 0) {
    const int width = bits >= 8 ? 8 : bits;
    const int shift = bits - width;
    const uint64_t prefix = smem->prefix;
    const uint64_t mask = smem->mask;
    for (int b = threadIdx.x; b < 256; b += kThreads) smem->hist[b] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < count; i += kThreads) {
      const uint64_t key = key_at(i);
      if ((key & mask) == prefix) {
        atomicAdd(&smem->hist[(key >> shift) & ((1u << width) - 1)], 1u);
      }
    }
    __syncthreads();
    // Digit d such that count(digits > d) < remaining <= count(digits >= d), scanning from 255.
    const uint32_t c = threadIdx.x < 256 ? smem->hist[255 - threadIdx.x] : 0u;
    const uint32_t through = BlockInclusiveScan<kThreads>(c, smem->scratch);
    const uint32_t remaining = smem->remaining;
    const uint32_t above = through - c;
    const bool found = threadIdx.x < 256 && c > 0 && above < remaining && through >= remaining;
    __syncthreads();
    if (found) {
      const uint64_t digit = 255 - threadIdx.x;
      smem->prefix = prefix | (digit << shift);
      smem->mask = mask | (uint64_t{(1u << width) - 1} << shift);
      smem->remaining = remaining - above;
      smem->done = c == remaining - above;  // the whole bucket is taken
    }
    __syncthreads();
    bits = shift;
  }
  return RadixThreshold{smem->prefix, smem->mask};
}

// Rows of scores to select from, and where the selection goes.
struct RowTopKParams {
  const float* scores;         // [rows, score_stride]; position p of row r at r * stride + p
  int64_t score_stride;
  const uint8_t* active;       // [rows], or null for all: inactive rows are left untouched
  const DeviceSeq* seqs;       // row r has SeqSize(seqs[r / q_heads]) scores, or
  int q_heads;
  const int32_t* lengths;      //   lengths[r] when seqs is null, or
  int length;                  //   `length` when both are null;
  int max_length;              // longer rows are cut here (the score rows' capacity)
  int k;
  int splits;                  // blocks per row of the histogram and collect passes
  int chunk;                   // positions per block
  uint32_t* hist;              // [rows, kBins], zero between steps
  TopKRowState* state;         // [rows], zero between steps
  int32_t* candidates;         // [rows, score_stride]
  int32_t* support;            // [rows, support_stride]: the top min(k, length) positions,
  int support_stride;          //   in no particular order
  int32_t* support_size;       // [rows]
  float* support_scores;       // [rows, support_stride] or null: their scores, aligned
  // Bins of the row's known score range (state[r].bin_low / bin_scale, set by its scorer before
  // pass 1) instead of order-key bins.
  bool linear_bins = false;
};

// A row's binning under p (order-key or linear bins), read once from the row's state and used
// for every score of the row by the histogram and collect passes, so that both agree.
class RowBins {
 public:
  __device__ RowBins(const RowTopKParams& p, const TopKRowState& state)
      : linear_(p.linear_bins), low_(state.bin_low), scale_(state.bin_scale) {}
  __device__ __forceinline__ uint32_t operator()(float score) const {
    return linear_ ? LinearBinOf(score, low_, scale_) : BinOf(score);
  }

 private:
  bool linear_;
  float low_, scale_;
};

__device__ __forceinline__ int RowLength(const RowTopKParams& p, int row) {
  const int n = p.seqs != nullptr      ? SeqSize(p.seqs[row / p.q_heads])
                : p.lengths != nullptr ? p.lengths[row]
                                       : p.length;
  return max(0, min(n, p.max_length));
}
__device__ __forceinline__ bool RowActive(const RowTopKParams& p, int row) {
  return p.active == nullptr || p.active[row] != 0;
}

// Positions a row-pass thread reads per iteration: kScoreUnroll 16-byte loads of 4 scores,
// all in flight before the first is used.
inline constexpr int kScoreUnroll = 4;
inline constexpr int kScoresPerThread = 4 * kScoreUnroll;

// scores[i, i + 4) of a row into v; positions at or past `end` read as -inf (never loaded).
// `aligned`: the row starts on 16 bytes (then, i being a multiple of 4, so does every load).
__device__ __forceinline__ void LoadScores4(const float* row, int i, int end, bool aligned,
                                            float (&v)[4]) {
  if (aligned && i + 3 < end) {
    const float4 f = __ldg(reinterpret_cast<const float4*>(row + i));
    v[0] = f.x;
    v[1] = f.y;
    v[2] = f.z;
    v[3] = f.w;
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = i + j < end ? __ldg(row + i + j) : -INFINITY;
  }
}

// Calls visit(position, score) for the positions [begin, end) of a score row, every thread
// of the block taking part in every call (block-uniform trip count; positions past `end` come
// with in_range = false), kScoresPerThread positions per thread per iteration.
template <int kThreads, typename Visit>
__device__ __forceinline__ void ForEachScore(const float* row, int begin, int end,
                                             const Visit& visit) {
  const bool aligned = (reinterpret_cast<uintptr_t>(row) & 15) == 0;
  for (int base = begin; base < end; base += kThreads * kScoresPerThread) {
    float v[kScoreUnroll][4];
#pragma unroll
    for (int u = 0; u < kScoreUnroll; ++u) {
      LoadScores4(row, base + (u * kThreads + threadIdx.x) * 4, end, aligned, v[u]);
    }
#pragma unroll
    for (int u = 0; u < kScoreUnroll; ++u) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int i = base + (u * kThreads + threadIdx.x) * 4 + j;
        visit(i, v[u][j], i < end);
      }
    }
  }
}

// Pass 1 for rows of given scores: histogram, then the last block of each row locates the
// threshold bin. grid = (splits, rows).
template <int kThreads>
__global__ void __launch_bounds__(kThreads) RowHistogramKernel(const RowTopKParams p) {
  __shared__ uint32_t hist[kBins];
  __shared__ uint32_t scratch[32];
  __shared__ bool last;
  const int row = blockIdx.y;
  if (!RowActive(p, row)) return;
  for (int b = threadIdx.x; b < kBins; b += kThreads) hist[b] = 0;
  __syncthreads();
  const int n = RowLength(p, row);
  const int begin = blockIdx.x * p.chunk;
  const int end = min(begin + p.chunk, n);
  const RowBins bin_of(p, p.state[row]);
  ForEachScore<kThreads>(p.scores + row * p.score_stride, begin, end,
                         [&](int, float score, bool in_range) {
                           if (in_range) atomicAdd(&hist[bin_of(score)], 1u);
                         });
  __syncthreads();
  uint32_t* row_hist = p.hist + static_cast<int64_t>(row) * kBins;
  FlushHistogram<kThreads>(hist, row_hist);
  if (!FinishedLast(&p.state[row].blocks_done, gridDim.x, &last)) return;
  FindThresholdBin<kThreads>(row_hist, min(p.k, n), &p.state[row], scratch);
  if (threadIdx.x == 0) p.state[row].blocks_done = 0;
}

// The default finishing step of a row's selection: nothing beyond the support itself.
struct NoFinish {
  static constexpr int kSmemFloats = 0;
  __device__ void operator()(const RowTopKParams&, int, const int32_t*, const float*, int,
                             float*) const {}
};

// The fewest positions one row-pass block reads.
inline constexpr int kMinRowChunk = 2048;

// Candidates whose keys fit in shared memory skip re-reading scores on every radix pass.
inline constexpr int kSmemCandidates = 4096;

// Dynamic shared memory of RowCollectKernel: the selected positions and scores.
inline size_t RowCollectSmemBytes(int k) { return static_cast<size_t>(k) * 8; }

// Pass 2: appends each row's positions above the threshold bin to the support and the
// threshold bin's to the candidates; the last block of the row radix-selects the missing ones,
// gathers the whole selection (positions and scores) in shared memory, calls
// finish(p, row, positions, scores, count, smem) on it, and zeroes the row's state and
// histogram. grid = (splits, rows); dynamic shared memory RowCollectSmemBytes(p.k).
template <int kThreads, typename Finish>
__global__ void __launch_bounds__(kThreads) RowCollectKernel(const RowTopKParams p,
                                                             const Finish finish) {
  constexpr int kPoolBytes = kSmemCandidates * 8 > Finish::kSmemFloats * 4
                                 ? kSmemCandidates * 8
                                 : Finish::kSmemFloats * 4;
  __shared__ __align__(16) unsigned char pool[kPoolBytes];
  __shared__ RadixSelectSmem radix;
  __shared__ uint32_t appended;
  __shared__ bool last;
  extern __shared__ int32_t chosen[];  // [p.k] positions, then [p.k] scores
  // With active rows (and few enough of them) the launch's blocks serve only those rows.
  BlockShare share{static_cast<int>(blockIdx.y), static_cast<int>(blockIdx.x),
                   static_cast<int>(gridDim.x), p.chunk, true};
  if (p.active != nullptr && static_cast<int>(gridDim.y) <= kMaxSharedUnits) {
    share = ShareBlocks(
        gridDim.y, [&](int r) { return p.active[r] != 0; }, p.max_length, 4, kMinRowChunk);
    if (!share.ok) return;
  }
  const int row = share.unit;
  if (!RowActive(p, row)) return;
  const int n = RowLength(p, row);
  const int k = min(p.k, n);
  TopKRowState* state = p.state + row;
  const float* scores = p.scores + row * p.score_stride;
  int32_t* support = p.support + static_cast<int64_t>(row) * p.support_stride;
  int32_t* candidates = p.candidates + row * p.score_stride;
  const uint32_t threshold = state->threshold_bin;
  const RowBins bin_of(p, *state);
  if (k > 0) {
    const int begin = share.split * share.chunk;
    ForEachScore<kThreads>(scores, begin, min(begin + share.chunk, n),
                           [&](int i, float score, bool in_range) {
                             const uint32_t bin = bin_of(score);
                             const bool kept = in_range && bin >= threshold;
                             // Most of a row lies below its threshold bin: a warp with none
                             // of its 32 scores at or above it appends nothing.
                             if (!__any_sync(0xffffffffu, kept)) return;
                             WarpAppend(kept && bin > threshold, i, &state->selected, support);
                             WarpAppend(kept && bin == threshold, i, &state->candidates,
                                        candidates);
                           });
  }
  if (!FinishedLast(&state->blocks_done, share.blocks, &last)) return;

  // The positions above the threshold bin, which every block appended, with their scores.
  float* chosen_scores = reinterpret_cast<float*>(chosen + p.k);
  const uint32_t need = state->need;
  const int above = static_cast<int>(__ldcg(&state->selected));
  const int count = static_cast<int>(__ldcg(&state->candidates));
  for (int j = threadIdx.x; j < above; j += kThreads) {
    const int32_t pos = __ldcg(support + j);
    chosen[j] = pos;
    chosen_scores[j] = __ldg(scores + pos);
  }
  if (threadIdx.x == 0) appended = above;
  __syncthreads();
  if (need > 0 && count > 0) {
    uint64_t* cached = reinterpret_cast<uint64_t*>(pool);
    const bool fits = count <= kSmemCandidates;
    auto fresh_key = [&](int i) {
      const int32_t pos = __ldcg(candidates + i);
      return RankKey(__ldg(scores + pos), pos);
    };
    if (fits) {
      for (int i = threadIdx.x; i < count; i += kThreads) cached[i] = fresh_key(i);
      __syncthreads();
    }
    auto key_at = [&](int i) { return fits ? cached[i] : fresh_key(i); };
    // Order-key bins share their top kBinBits key bits; linear bins share none.
    const RadixThreshold t = BlockRadixSelect<kThreads>(
        count, need, p.linear_bins ? 64 : kBitsBelowBin, key_at, &radix);
    AppendSelected<kThreads>(count, key_at, t, &appended, chosen, chosen_scores, support);
    __syncthreads();
  }
  if (threadIdx.x == 0) p.support_size[row] = k;
  if (p.support_scores != nullptr) {
    float* out = p.support_scores + static_cast<int64_t>(row) * p.support_stride;
    for (int j = threadIdx.x; j < k; j += kThreads) out[j] = chosen_scores[j];
  }
  finish(p, row, chosen, chosen_scores, k, reinterpret_cast<float*>(pool));
  // Leave the row's workspace as it was found: zero.
  uint32_t* row_hist = p.hist + static_cast<int64_t>(row) * kBins;
  for (int b = threadIdx.x; b < kBins; b += kThreads) row_hist[b] = 0;
  if (threadIdx.x == 0) *state = TopKRowState{};
}

// Block size of the row passes.
inline constexpr int kRowPassThreads = 512;

// Splits rows of `length` positions for the row passes over a device that holds `slots` of
// their blocks at once: one wave, no block reading fewer than kMinRowChunk positions.
inline void PlanRowPasses(int rows, int length, int slots, RowTopKParams* p) {
  const int splits = std::max(1, std::min(slots / rows, CeilDiv(length, kMinRowChunk)));
  // Chunks start on 16-byte boundaries of their rows, for LoadScores4.
  p->chunk = std::max(4, CeilDiv(CeilDiv(length, splits), 4) * 4);
  p->splits = std::max(1, CeilDiv(length, p->chunk));
}

// INVALID_ARGUMENT unless Finish's collect pass can hold a row's k positions and scores
// (RowCollectSmemBytes: 8 bytes a position) beside its static shared memory within the current
// device's opt-in limit per block: k is bounded there, far below kMaxTopK (about 28,000 on an
// H100 or H200). For checks before a step (a server's admission): at a step, PlanRowCollect's
// AllowDynamicSharedMemory refuses a k past the bound on its first raise, and costs nothing
// once the size is allowed. Cached per device after the first call.
template <typename Finish>
absl::Status CheckRowCollectFits(int k) {
  constexpr auto kCollect = &RowCollectKernel<kRowPassThreads, Finish>;
  static PerDevice<int> static_bytes;
  const absl::StatusOr<int> fixed = static_bytes.Get([](int) -> absl::StatusOr<int> {
    cudaFuncAttributes attrs{};
    KVRECALL_CUDA_RETURN_IF_ERROR(
        CudaStatus(cudaFuncGetAttributes(&attrs, kCollect), "reading kernel attributes"));
    return static_cast<int>(attrs.sharedSizeBytes);
  });
  if (!fixed.ok()) return fixed.status();
  const absl::StatusOr<int> most = MaxSharedMemoryPerBlock();
  if (!most.ok()) return most.status();
  const int64_t room = int64_t{*most} - *fixed;
  if (k < 0 || static_cast<int64_t>(RowCollectSmemBytes(k)) > room) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a top-K selection of ", k, " a row holds 8 bytes a position in shared memory, ",
        RowCollectSmemBytes(k), " bytes, where this GPU leaves ", room, ": at most ", room / 8));
  }
  return absl::OkStatus();
}

// The collect pass of `rows` rows of up to `length` scores (RowCollectKernel ending each row
// with a Finish): PlanRowCollect sets p->splits / p->chunk and prepares the kernel, and runs
// before pass 1 is launched, so that a failure leaves the workspace as it was (zero);
// LaunchRowCollect launches it once pass 1 has located every row's threshold bin. Each Finish's
// collect kernel is instantiated in one translation unit: a kernel template instantiated in two
// is registered once in each, and the shared-memory opt-in set through one is not the other's
// (while the caches of launch.cuh hold one answer per kernel). NoFinish's lives in
// topk_select.cu, behind PlanRowSelection / LaunchRowSelection below.
template <typename Finish>
absl::Status PlanRowCollect(int rows, int length, RowTopKParams* p) {
  constexpr auto kCollect = &RowCollectKernel<kRowPassThreads, Finish>;
  // Registers, not shared memory, bound how many collect blocks a multiprocessor holds.
  const absl::StatusOr<int> slots = DeviceBlockSlots<kCollect>(kRowPassThreads, 0);
  if (!slots.ok()) return slots.status();
  PlanRowPasses(rows, length, *slots, p);
  return AllowDynamicSharedMemory<kCollect>(RowCollectSmemBytes(p->k));
}
template <typename Finish>
absl::Status LaunchRowCollect(const RowTopKParams& p, int rows, const Finish& finish,
                              cudaStream_t stream) {
  constexpr auto kCollect = &RowCollectKernel<kRowPassThreads, Finish>;
  kCollect<<<dim3(p.splits, rows), kRowPassThreads, RowCollectSmemBytes(p.k), stream>>>(p,
                                                                                      finish);
  return LaunchStatus("RowCollectKernel");
}

// PlanRowCollect / LaunchRowCollect of NoFinish (the selection alone: SelectRowTopK's, or after
// a pass 1 of the caller's own, such as the PQ shortlist's scan). PlanRowSelection takes
// SelectRowTopK's arguments (checked by the caller) and returns the selection's parameters on
// ws's histograms, states and candidates, planned.
absl::StatusOr<RowTopKParams> PlanRowSelection(const float* scores, int64_t stride, int rows,
                                               int length, const int32_t* lengths, int k,
                                               TopKWorkspace* ws, int32_t* support,
                                               int support_stride, int32_t* support_size,
                                               float* support_scores);
absl::Status LaunchRowSelection(const RowTopKParams& p, int rows, cudaStream_t stream);

}  // namespace kvrecall::cuda

#endif  // KVRECALL_KERNELS_CUDA_TOPK_SELECT_CUH_
