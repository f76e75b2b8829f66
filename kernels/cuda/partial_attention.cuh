// Templated decode-attention kernels: split-K partial attention of one query per head over a
// token list (a DeviceSeq's logical range, or an id list), producing attention states, and the
// tile pipeline they share with the key scan of the exact top-K path. Host wrappers and the
// log-sum-exp merge kernels live in partial_attention.cu.
#ifndef KVRECALL_KERNELS_CUDA_PARTIAL_ATTENTION_CUH_
#define KVRECALL_KERNELS_CUDA_PARTIAL_ATTENTION_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/attention_state.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/mma.cuh"

namespace kvrecall::cuda {

// How a block of kThreads threads stages and scores tokens: a tile holds 16 tokens per warp
// (the token columns of two m16n8k16 products, mma.cuh), staged in shared memory by cp.async
// kStages deep, swizzled (SwizzledOffset); kLanes threads copy the kLanes 16-byte chunks of
// one token row, kRows rows per pass.
template <int kHeadDim, int kStages_, int kThreads_ = 128>
struct TileShape {
  static constexpr int kThreads = kThreads_;
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kLanes = kHeadDim / kVecElems;
  static constexpr int kRows = kThreads / kLanes;
  static constexpr int kTile = 16 * kWarps;
  static constexpr int kStages = kStages_;
  static constexpr int kCopiesPerThread = kTile / kRows;  // 16-byte copies per tensor
  static_assert(kThreads % 32 == 0 && kTile % kRows == 0);
};

// The logical positions [0, end) of a DeviceSeq; a block reads a sub-range of it.
struct RangeTokens {
  DeviceSeq seq;
  int32_t end;
  __device__ __forceinline__ bool Resolve(int32_t i, int32_t* slot) const {
    if (i >= end) return false;
    *slot = SlotOf(seq, i);
    return true;
  }
};

// Entries [0, end) of an id list of logical positions of a DeviceSeq. Ids outside the sequence
// are skipped and reported through the error word.
struct IndexedTokens {
  DeviceSeq seq;
  const int32_t* ids;
  int32_t end;
  int32_t seq_size;
  unsigned* errors;
  __device__ __forceinline__ bool Resolve(int32_t i, int32_t* slot) const {
    if (i >= end) return false;
    const int32_t id = __ldg(ids + i);
    if (id < 0 || id >= seq_size) {
      atomicOr(errors, kErrorIndexOutOfRange);
      return false;
    }
    *slot = SlotOf(seq, id);
    return true;
  }
};

// Issues the cp.async copies of one tile (tokens tile_begin + [0, kTile) of `tokens`) of one KV
// head into a pipeline stage: keys (and values) [kTile, kHeadDim] swizzled, plus a validity
// byte per token. Invalid tokens are zero-filled.
template <typename T, typename Shape, bool kWithValues, typename Tokens>
__device__ __forceinline__ void IssueTile(const Tokens& tokens, int32_t tile_begin, const T* keys,
                                          const T* values, int kv_head, int kv_heads, T* k_stage,
                                          T* v_stage, uint8_t* valid_stage) {
  constexpr int kHeadDim = Shape::kLanes * kVecElems;
  const int part = threadIdx.x % Shape::kLanes;
#pragma unroll
  for (int c = 0; c < Shape::kCopiesPerThread; ++c) {
    const int r = threadIdx.x / Shape::kLanes + c * Shape::kRows;
    int32_t slot = 0;
    const bool ok = tokens.Resolve(tile_begin + r, &slot);
    const int64_t offset = KvOffset(slot, kv_head, kv_heads, kHeadDim) + part * kVecElems;
    const int staged = SwizzledOffset<kHeadDim>(r, part);
    CpAsync16(k_stage + staged, keys + offset, ok);
    if constexpr (kWithValues) CpAsync16(v_stage + staged, values + offset, ok);
    if (part == 0) valid_stage[r] = ok;
  }
}

// Streams num_tiles tiles through kStages shared-memory stages: issue(tile) starts the copies of
// a tile into stage tile % kStages and compute(tile) runs once it has landed, with kStages - 1
// tiles in flight meanwhile. Called by the whole block; compute may hold barriers. On return
// every copy has landed and shared memory may be reused.
template <int kStages, typename Issue, typename Compute>
__device__ __forceinline__ void RunTilePipeline(int num_tiles, const Issue& issue,
                                                const Compute& compute) {
#pragma unroll
  for (int t = 0; t < kStages - 1; ++t) {
    if (t < num_tiles) issue(t);
    CpAsyncCommit();
  }
  for (int tile = 0; tile < num_tiles; ++tile) {
    // Refill the stage freed by the previous iteration before computing on this one.
    if (tile + kStages - 1 < num_tiles) issue(tile + kStages - 1);
    CpAsyncCommit();
    CpAsyncWait<kStages - 1>();
    __syncthreads();
    compute(tile);
    __syncthreads();  // the stage is refilled next iteration
  }
  CpAsyncWait<0>();
  __syncthreads();
}

// The queries of one decode step and where their keys live, as every key-reading kernel takes
// them.
struct DecodeBatch {
  const DeviceSeq* seqs;  // [batch]
  const float* q;         // [batch, q_heads, head_dim]
  int q_heads;
  int kv_heads;
  float scale_log2;       // scale * log2(e): scores live in the log2 domain
};

inline DecodeBatch MakeDecodeBatch(const DecodeShape& shape, const DeviceSeq* seqs,
                                   const float* q) {
  return DecodeBatch{seqs, q, shape.q_heads, shape.kv_heads, shape.scale * kLog2e};
}

struct PartialAttentionParams {
  DecodeBatch batch;
  const int32_t* ids;     // indexed only: [batch, q_heads, max_ids]
  const int32_t* counts;  // indexed only: [batch, q_heads]
  int max_ids;
  int splits;
  int chunk;              // tokens (or ids) per split, a multiple of the tile
  float* o;               // splits == 1: [batch, q_heads, head_dim]
  float* lse;             // splits == 1: [batch, q_heads]
  float* partial_o;       // splits > 1: [batch * q_heads, splits, head_dim]
  float* partial_lse;     // splits > 1: [batch * q_heads, splits]
  unsigned* errors;
};

template <typename T, typename Shape, int kGroup>
constexpr size_t PartialAttentionSmemBytes() {
  constexpr int kHeadDim = Shape::kLanes * kVecElems;
  constexpr size_t tiles = 2ull * Shape::kStages * Shape::kTile * kHeadDim * sizeof(T);
  constexpr size_t valid = Shape::kStages * Shape::kTile;
  constexpr size_t reduce = (Shape::kWarps * kGroup * kHeadDim + 2 * Shape::kWarps * kGroup) * 4;
  return (tiles + valid) > reduce ? tiles + valid : reduce;
}

// One block: kGroup (<= 8) query heads that share KV head (q0 / group), one split of one
// sequence. grid = (splits, q_heads / kGroup, batch). Each warp keeps an online softmax over its
// 16 tokens of every staged tile, scores and P V on tensor cores (mma.cuh); the warps' states
// merge through shared memory at the end.
template <typename T, typename Shape, int kGroup, bool kIndexed>
__global__ void __launch_bounds__(Shape::kThreads)
    PartialAttentionKernel(const PartialAttentionParams p) {
  constexpr int kHeadDim = Shape::kLanes * kVecElems;
  constexpr int kTile = Shape::kTile;
  constexpr int kStages = Shape::kStages;
  extern __shared__ __align__(16) unsigned char smem[];
  T* k_tiles = reinterpret_cast<T*>(smem);
  T* v_tiles = k_tiles + kStages * kTile * kHeadDim;
  uint8_t* valid = reinterpret_cast<uint8_t*>(v_tiles + kStages * kTile * kHeadDim);

  const int split = blockIdx.x;
  const int q0 = blockIdx.y * kGroup;
  const int b = blockIdx.z;
  const int group = p.batch.q_heads / p.batch.kv_heads;
  const int kv_head = q0 / group;
  const DeviceSeq seq = p.batch.seqs[b];
  const T* keys = static_cast<const T*>(seq.keys);
  const T* values = static_cast<const T*>(seq.values);
  const int64_t row0 = static_cast<int64_t>(b) * p.batch.q_heads + q0;

  int32_t n;
  if constexpr (kIndexed) {
    n = p.counts[row0];
    if (n > p.max_ids || n < 0) {
      if (threadIdx.x == 0 && split == 0) atomicOr(p.errors, kErrorCountOutOfRange);
      n = n < 0 ? 0 : p.max_ids;
    }
  } else {
    n = SeqSize(seq);
    if (n > p.splits * p.chunk && threadIdx.x == 0 && split == 0) {
      atomicOr(p.errors, kErrorSeqTooLong);
    }
  }
  const int32_t begin = split * p.chunk;
  const int32_t end = min(begin + p.chunk, n);
  const int num_tiles = end > begin ? (end - begin + kTile - 1) / kTile : 0;

  auto tokens = [&] {
    if constexpr (kIndexed) {
      return IndexedTokens{seq, p.ids + row0 * p.max_ids, end, SeqSize(seq), p.errors};
    } else {
      return RangeTokens{seq, end};
    }
  }();

  uint32_t q_frag[kHeadDim / 16][4];
  const ScoreFactor factor = SplitScoreFactor<T>(p.batch.scale_log2);
  LoadQueryFragments<T, kGroup, kHeadDim>(p.batch.q + row0 * kHeadDim, factor, q_frag);
  // Lane (g, t) holds head g's state: m (log2 domain) and l agree over the lanes of a quad,
  // l summed over it only at the end; acc as MmaAccumulatePV leaves it.
  float m = -INFINITY;
  float l = 0.0f;
  float acc[kHeadDim / 8][4] = {};

  auto issue = [&](int tile) {
    const int stage = tile % kStages;
    IssueTile<T, Shape, true>(tokens, begin + tile * kTile, keys, values, kv_head, p.batch.kv_heads,
                              k_tiles + stage * kTile * kHeadDim,
                              v_tiles + stage * kTile * kHeadDim, valid + stage * kTile);
  };
  const int warp = threadIdx.x / 32;
  RunTilePipeline<kStages>(num_tiles, issue, [&](int tile) {
    const int first = tile % kStages * kTile + warp * 16;  // the warp's first staged token
    float s[4];
    MmaScores<T, kHeadDim>(k_tiles + first * kHeadDim, q_frag, factor.after, s);
    float mx = m;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (!valid[first + MmaScoreToken(i)]) s[i] = -INFINITY;
      mx = fmaxf(mx, s[i]);
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    if (mx != m) {  // only ever raised; m = -inf -> alpha = 0 on zero state
      const float alpha = exp2f(m - mx);
      l *= alpha;
#pragma unroll
      for (int j = 0; j < kHeadDim / 8; ++j) {
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[j][c] *= alpha;
      }
      m = mx;
    }
    float w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      w[i] = m == -INFINITY ? 0.0f : exp2f(s[i] - m);
      l += w[i];
    }
    MmaAccumulatePV<T, kHeadDim>(v_tiles + first * kHeadDim, w, acc);
  });
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);

  // Merge the warps' states.
  constexpr int kWarps = Shape::kWarps;
  float* red_o = reinterpret_cast<float*>(smem);  // [kWarps][kGroup][kHeadDim]
  float* red_m = red_o + kWarps * kGroup * kHeadDim;
  float* red_l = red_m + kWarps * kGroup;
  const int g = (threadIdx.x % 32) / 4;
  const int t = threadIdx.x % 4;
  if (g < kGroup) {
    float* dst = red_o + (warp * kGroup + g) * kHeadDim + 2 * t;
#pragma unroll
    for (int j = 0; j < kHeadDim / 8; ++j) {
      *reinterpret_cast<float2*>(dst + 8 * j) =
          make_float2(acc[j][0] + acc[j][2], acc[j][1] + acc[j][3]);
    }
    if (t == 0) {
      red_m[warp * kGroup + g] = m;
      red_l[warp * kGroup + g] = l;
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < kGroup * kHeadDim; e += Shape::kThreads) {
    const int h = e / kHeadDim;
    const int dim = e % kHeadDim;
    float big = -INFINITY;
    for (int r = 0; r < kWarps; ++r) big = fmaxf(big, red_m[r * kGroup + h]);
    float out_o = 0.0f;
    float out_lse = kEmptyLse;
    if (big != -INFINITY) {
      float sum_l = 0.0f, sum_o = 0.0f;
      for (int r = 0; r < kWarps; ++r) {
        const float w = exp2f(red_m[r * kGroup + h] - big);
        sum_l += red_l[r * kGroup + h] * w;
        sum_o += red_o[(r * kGroup + h) * kHeadDim + dim] * w;
      }
      out_o = sum_o / sum_l;
      out_lse = (big + log2f(sum_l)) * kLn2;
    }
    const int64_t out_row = row0 + h;
    if (p.splits == 1) {
      p.o[out_row * kHeadDim + dim] = out_o;
      if (dim == 0) p.lse[out_row] = out_lse;
    } else {
      p.partial_o[(out_row * p.splits + split) * kHeadDim + dim] = out_o;
      if (dim == 0) p.partial_lse[out_row * p.splits + split] = out_lse;
    }
  }
}

}  // namespace kvrecall::cuda

#endif  // KVRECALL_KERNELS_CUDA_PARTIAL_ATTENTION_CUH_
