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

namespace kvrecall::cuda {

// How a block of kThreads threads walks tokens: kLanes lanes share one token (each holds 8 of
// its head_dim elements), kRows tokens per pass, kTokensPerLane passes per pipeline stage.
// Every stage is staged in shared memory by cp.async, kStages deep.
template <int kHeadDim, int kStages_, int kThreads_ = 128>
struct TileShape {
  static constexpr int kThreads = kThreads_;
  static constexpr int kLanes = kHeadDim / kVecElems;
  static constexpr int kRows = kThreads / kLanes;
  static constexpr int kTokensPerLane = 4;
  static constexpr int kTile = kRows * kTokensPerLane;
  static constexpr int kStages = kStages_;
  static constexpr int kCopiesPerThread = kTile * kLanes / kThreads;  // 16-byte copies per tensor
  static_assert(kThreads % kLanes == 0 && kLanes <= 32);
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
// head into a pipeline stage: keys (and values) [kTile, kHeadDim], plus a validity byte per
// token. Invalid tokens are zero-filled.
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
    CpAsync16(k_stage + r * kHeadDim + part * kVecElems, keys + offset, ok);
    if constexpr (kWithValues) {
      CpAsync16(v_stage + r * kHeadDim + part * kVecElems, values + offset, ok);
    }
    if (part == 0) valid_stage[r] = ok;
  }
}

// Partial dot products of this lane's 8 elements of its kTokensPerLane tokens of a staged tile
// with kGroup queries, flattened as partial[t * kGroup + h], then summed over the lane group by
// TransposeReduce (see there for where each total lands). Queries are pre-multiplied by
// scale * log2(e), so totals are scores in the log2 domain.
template <typename T, typename Shape, int kGroup>
__device__ __forceinline__ void ReduceStagedTileScores(
    const T* k_stage, const float (&q)[kGroup][kVecElems],
    float (&partial)[Shape::kTokensPerLane * kGroup]) {
  constexpr int kHeadDim = Shape::kLanes * kVecElems;
  const int part = threadIdx.x % Shape::kLanes;
  const int row = threadIdx.x / Shape::kLanes;
#pragma unroll
  for (int t = 0; t < Shape::kTokensPerLane; ++t) {
    const int r = row + t * Shape::kRows;
    float k[kVecElems];
    Widen8<T>(*reinterpret_cast<const uint4*>(k_stage + r * kHeadDim + part * kVecElems), k);
#pragma unroll
    for (int h = 0; h < kGroup; ++h) {
      float acc = 0.0f;
#pragma unroll
      for (int j = 0; j < kVecElems; ++j) acc = fmaf(q[h][j], k[j], acc);
      partial[t * kGroup + h] = acc;
    }
  }
  TransposeReduce<Shape::kTokensPerLane * kGroup, Shape::kLanes>(partial);
}

// Every lane's scores of its kTokensPerLane tokens of a staged tile against kGroup queries, in
// the log2 domain; invalid tokens score -inf.
template <typename T, typename Shape, int kGroup>
__device__ __forceinline__ void ScoreStagedTile(const T* k_stage, const uint8_t* valid_stage,
                                                const float (&q)[kGroup][kVecElems],
                                                float (&s)[Shape::kTokensPerLane][kGroup]) {
  constexpr int kValues = Shape::kTokensPerLane * kGroup;
  float flat[kValues];
  ReduceStagedTileScores<T, Shape, kGroup>(k_stage, q, flat);
  AllGather<kValues, Shape::kLanes>(flat);
  const int row = threadIdx.x / Shape::kLanes;
#pragma unroll
  for (int t = 0; t < Shape::kTokensPerLane; ++t) {
    const bool valid = valid_stage[row + t * Shape::kRows];
#pragma unroll
    for (int h = 0; h < kGroup; ++h) s[t][h] = valid ? flat[t * kGroup + h] : -INFINITY;
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

// Loads this lane's 8 elements of kGroup consecutive queries (f32, [q_heads, head_dim] rows
// starting at `q`), times `factor`.
template <int kLanes, int kGroup>
__device__ __forceinline__ void LoadQueries(const float* q, int head_dim, float factor,
                                            float (&out)[kGroup][kVecElems]) {
  const int part = threadIdx.x % kLanes;
#pragma unroll
  for (int h = 0; h < kGroup; ++h) {
    const float4* src = reinterpret_cast<const float4*>(q + h * head_dim + part * kVecElems);
    const float4 a = __ldg(src);
    const float4 b = __ldg(src + 1);
    out[h][0] = a.x * factor;
    out[h][1] = a.y * factor;
    out[h][2] = a.z * factor;
    out[h][3] = a.w * factor;
    out[h][4] = b.x * factor;
    out[h][5] = b.y * factor;
    out[h][6] = b.z * factor;
    out[h][7] = b.w * factor;
  }
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
  constexpr size_t reduce = (Shape::kRows * kGroup * kHeadDim + 2 * Shape::kRows * kGroup) * 4;
  return (tiles + valid) > reduce ? tiles + valid : reduce;
}

// One block: kGroup query heads that share KV head (q0 / group), one split of one sequence.
// grid = (splits, q_heads / kGroup, batch). Online softmax per lane group over the staged tiles,
// then a merge of the kRows lane groups through shared memory.
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

  float q[kGroup][kVecElems];
  LoadQueries<Shape::kLanes, kGroup>(p.batch.q + row0 * kHeadDim, kHeadDim, p.batch.scale_log2,
                                     q);

  float m[kGroup], l[kGroup], o[kGroup][kVecElems];
#pragma unroll
  for (int h = 0; h < kGroup; ++h) {
    m[h] = -INFINITY;
    l[h] = 0.0f;
#pragma unroll
    for (int j = 0; j < kVecElems; ++j) o[h][j] = 0.0f;
  }

  auto issue = [&](int tile) {
    const int stage = tile % kStages;
    IssueTile<T, Shape, true>(tokens, begin + tile * kTile, keys, values, kv_head, p.batch.kv_heads,
                              k_tiles + stage * kTile * kHeadDim,
                              v_tiles + stage * kTile * kHeadDim, valid + stage * kTile);
  };
  const int part = threadIdx.x % Shape::kLanes;
  const int row = threadIdx.x / Shape::kLanes;
  RunTilePipeline<kStages>(num_tiles, issue, [&](int tile) {
    const int stage = tile % kStages;
    const T* k_stage = k_tiles + stage * kTile * kHeadDim;
    const T* v_stage = v_tiles + stage * kTile * kHeadDim;
    float s[Shape::kTokensPerLane][kGroup];
    ScoreStagedTile<T, Shape, kGroup>(k_stage, valid + stage * kTile, q, s);

#pragma unroll
    for (int h = 0; h < kGroup; ++h) {
      float mx = m[h];
#pragma unroll
      for (int t = 0; t < Shape::kTokensPerLane; ++t) mx = fmaxf(mx, s[t][h]);
      if (mx != m[h]) {  // only ever raised; m = -inf -> alpha = 0 on zero state
        const float alpha = exp2f(m[h] - mx);
        l[h] *= alpha;
#pragma unroll
        for (int j = 0; j < kVecElems; ++j) o[h][j] *= alpha;
        m[h] = mx;
      }
    }
#pragma unroll
    for (int t = 0; t < Shape::kTokensPerLane; ++t) {
      const int r = row + t * Shape::kRows;
      float v[kVecElems];
      Widen8<T>(*reinterpret_cast<const uint4*>(v_stage + r * kHeadDim + part * kVecElems), v);
#pragma unroll
      for (int h = 0; h < kGroup; ++h) {
        const float w = m[h] == -INFINITY ? 0.0f : exp2f(s[t][h] - m[h]);
        l[h] += w;
#pragma unroll
        for (int j = 0; j < kVecElems; ++j) o[h][j] = fmaf(w, v[j], o[h][j]);
      }
    }
  });

  // Merge the kRows lane groups.
  float* red_o = reinterpret_cast<float*>(smem);  // [kRows][kGroup][kHeadDim]
  float* red_m = red_o + Shape::kRows * kGroup * kHeadDim;
  float* red_l = red_m + Shape::kRows * kGroup;
#pragma unroll
  for (int h = 0; h < kGroup; ++h) {
    float* dst = red_o + (row * kGroup + h) * kHeadDim + part * kVecElems;
    reinterpret_cast<float4*>(dst)[0] = make_float4(o[h][0], o[h][1], o[h][2], o[h][3]);
    reinterpret_cast<float4*>(dst)[1] = make_float4(o[h][4], o[h][5], o[h][6], o[h][7]);
    if (part == 0) {
      red_m[row * kGroup + h] = m[h];
      red_l[row * kGroup + h] = l[h];
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < kGroup * kHeadDim; e += Shape::kThreads) {
    const int h = e / kHeadDim;
    const int dim = e % kHeadDim;
    float big = -INFINITY;
    for (int r = 0; r < Shape::kRows; ++r) big = fmaxf(big, red_m[r * kGroup + h]);
    float out_o = 0.0f;
    float out_lse = kEmptyLse;
    if (big != -INFINITY) {
      float sum_l = 0.0f, sum_o = 0.0f;
      for (int r = 0; r < Shape::kRows; ++r) {
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
