// Block-level attention over a selected token list whose scores are already known (the last
// stage of the exact top-K and ReTopK paths): softmax of the scores, then a gather of the
// selected value rows, all of them in flight at once.
#ifndef KVRECALL_KERNELS_CUDA_SELECTED_ATTENTION_CUH_
#define KVRECALL_KERNELS_CUDA_SELECTED_ATTENTION_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/attention_state.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/topk_select.cuh"

namespace kvrecall::cuda {

// Shared memory AttendSelected needs, in floats.
template <int kDim, int kThreads>
__host__ __device__ constexpr int AttendSelectedSmemFloats() {
  return (kThreads / (kDim / kVecElems)) * kDim + 32;
}

// The attention state over `count` selected tokens of `seq` for one query: pos_at(i) is the
// logical position of token i, score_at(i) its score in the log2 domain (scale * log2(e) *
// <q, k>). Writes o_out[0:kDim] and *lse_out (natural log; -inf and zeros when count == 0).
// One whole block calls it; `smem`: AttendSelectedSmemFloats floats. kUnroll value rows are
// in flight per lane.
template <typename T, int kDim, int kThreads, int kUnroll = 8, typename PosAt, typename ScoreAt>
__device__ void AttendSelected(int count, PosAt pos_at, ScoreAt score_at, const DeviceSeq& seq,
                               int kv_head, int kv_heads, float* o_out, float* lse_out,
                               float* smem) {
  constexpr int kLanes = kDim / kVecElems;
  constexpr int kGroups = kThreads / kLanes;
  float* scratch = smem + kGroups * kDim;

  float mx = -INFINITY;
  for (int i = threadIdx.x; i < count; i += kThreads) mx = fmaxf(mx, score_at(i));
  mx = BlockMax<kThreads>(mx, scratch);
  if (mx == -INFINITY) {  // empty selection
    for (int d = threadIdx.x; d < kDim; d += kThreads) o_out[d] = 0.0f;
    if (threadIdx.x == 0) *lse_out = kEmptyLse;
    return;
  }
  float sum = 0.0f;
  for (int i = threadIdx.x; i < count; i += kThreads) sum += exp2f(score_at(i) - mx);
  sum = BlockSum<kThreads>(sum, scratch);

  const int group = threadIdx.x / kLanes;
  const int part = threadIdx.x % kLanes;
  const T* values = static_cast<const T*>(seq.values);
  float acc[kVecElems] = {};
  for (int base = group; base < count; base += kGroups * kUnroll) {
    uint4 raw[kUnroll];
    float w[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + u * kGroups;
      raw[u] = make_uint4(0, 0, 0, 0);
      w[u] = 0.0f;
      if (i < count) {
        const int32_t slot = SlotOf(seq, pos_at(i));
        raw[u] = LoadKv16(values + KvOffset(slot, kv_head, kv_heads, kDim) + part * kVecElems);
        w[u] = exp2f(score_at(i) - mx);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      float v[kVecElems];
      Widen8<T>(raw[u], v);
#pragma unroll
      for (int j = 0; j < kVecElems; ++j) acc[j] = fmaf(w[u], v[j], acc[j]);
    }
  }
#pragma unroll
  for (int j = 0; j < kVecElems; ++j) smem[group * kDim + part * kVecElems + j] = acc[j];
  __syncthreads();
  const float inv = 1.0f / sum;
  for (int d = threadIdx.x; d < kDim; d += kThreads) {
    float total = 0.0f;
    for (int g = 0; g < kGroups; ++g) total += smem[g * kDim + d];
    o_out[d] = total * inv;
  }
  if (threadIdx.x == 0) *lse_out = (mx + log2f(sum)) * kLn2;
  __syncthreads();  // smem is free again
}

}  // namespace kvrecall::cuda

#endif  // KVRECALL_KERNELS_CUDA_SELECTED_ATTENTION_CUH_
