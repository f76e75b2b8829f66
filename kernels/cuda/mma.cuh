// Tensor-core building blocks of the key-scanning kernels: warp-level bf16/f16 mma.sync
// (m16n8k16, f32 accumulation) over swizzled shared-memory tiles of keys and values, with f32
// queries and softmax weights carried as a (hi, lo) pair of 16-bit values so that the products
// keep about 16 bits of their f32 operands' precision.
//
// Row layout of the m16n8k16 operands used here: a warp scores 16 tokens against up to 8 query
// heads of one KV head. Row g < 8 of A holds the hi part of head g's query (or weights), row
// g + 8 its lo part, so that lane (g = lane / 4, t = lane % 4) receives both halves of head g's
// results in its C fragment (c0, c1: hi; c2, c3: lo) and adds them. Heads >= kGroup are zero.
#ifndef KVRECALL_KERNELS_CUDA_MMA_CUH_
#define KVRECALL_KERNELS_CUDA_MMA_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "kernels/cuda/common.cuh"

namespace kvrecall::cuda {

// Element offset of 16-byte chunk `chunk` of token row `token` in a staged tile of
// [tokens, kHeadDim] elements, the chunk index XOR-ed with token % 8 so that the 8 rows one
// ldmatrix reads at a logical chunk fall in 8 distinct bank groups.
template <int kHeadDim>
__device__ __forceinline__ int SwizzledOffset(int token, int chunk) {
  return token * kHeadDim + ((chunk ^ (token & 7)) * kVecElems);
}

// Four 8x8 b16 matrices from shared memory; lanes 8i..8i+7 give the row addresses of matrix i.
__device__ __forceinline__ void LdMatrixX4(const void* row, uint32_t (&r)[4]) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
// The same, each matrix transposed.
__device__ __forceinline__ void LdMatrixX4Trans(const void* row, uint32_t (&r)[4]) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// d += a * b for one m16n8k16 tile with elements of T (bf16 or f16) and f32 accumulators.
#define KVRECALL_MMA_16816(type)                                                              \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." type "." type                        \
               ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"     \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                              \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))
template <typename T>
__device__ __forceinline__ void Mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    KVRECALL_MMA_16816("bf16");
  } else {
    KVRECALL_MMA_16816("f16");
  }
}
#undef KVRECALL_MMA_16816

// (x, y) as a packed pair of T (x in the low half) rounded to nearest, and the pair of what
// that rounding left over: x = hi.x + lo.x to about 2^-16 relative (2^-22 for f16 where
// |x| >= 2^-3, whose lo part is a normal f16; below that to 2^-25 absolute).
template <typename T>
__device__ __forceinline__ void SplitPair(float x, float y, uint32_t* hi, uint32_t* lo) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
    const __nv_bfloat162 l = __floats2bfloat162_rn(x - __low2float(h), y - __high2float(h));
    *hi = *reinterpret_cast<const uint32_t*>(&h);
    *lo = *reinterpret_cast<const uint32_t*>(&l);
  } else {
    const __half2 h = __floats2half2_rn(x, y);
    const __half2 l = __floats2half2_rn(x - __low2float(h), y - __high2float(h));
    *hi = *reinterpret_cast<const uint32_t*>(&h);
    *lo = *reinterpret_cast<const uint32_t*>(&l);
  }
}

// How a score factor (softmax scale x log2(e)) is applied: the part folded into the query
// operand before the products, and the part that multiplies the f32 scores after them. bf16
// has f32's range, so all of it is folded. f16 holds only |x| <= 65504, which a query the API
// accepts (|q| <= 65504) keeps only while the folded factor is at most 1, so a larger factor is
// applied to the scores instead (a scale past ln 2, e.g. 1 for a model that scales its queries
// in their projection). Folded or not, the products keep the same precision: the query is
// carried as a (hi, lo) pair either way.
struct ScoreFactor {
  float folded;  // multiplies the query before it is split into (hi, lo)
  float after;   // multiplies the f32 scores; exactly 1 where everything was folded
};
template <typename T>
__host__ __device__ __forceinline__ ScoreFactor SplitScoreFactor(float factor) {
  if constexpr (std::is_same_v<T, __half>) {
    if (factor > 1.0f) return ScoreFactor{1.0f, factor};
  }
  return ScoreFactor{factor, 1.0f};
}

// A-operand fragments of kGroup consecutive f32 queries (rows of kHeadDim starting at q, times
// `factor.folded`), one per 16-element k-step, hi parts in rows g, lo parts in rows g + 8.
// MmaScores' scores of them are then to be multiplied by `factor.after`.
template <typename T, int kGroup, int kHeadDim>
__device__ __forceinline__ void LoadQueryFragments(const float* q, ScoreFactor factor,
                                                   uint32_t (&frag)[kHeadDim / 16][4]) {
  static_assert(kGroup <= 8);
  const int g = (threadIdx.x % 32) / 4;
  const int t = threadIdx.x % 4;
  const float f = factor.folded;
#pragma unroll
  for (int ks = 0; ks < kHeadDim / 16; ++ks) {
    if (g < kGroup) {
      const float* src = q + g * kHeadDim + ks * 16 + 2 * t;
      const float2 low = __ldg(reinterpret_cast<const float2*>(src));
      const float2 high = __ldg(reinterpret_cast<const float2*>(src + 8));
      SplitPair<T>(low.x * f, low.y * f, &frag[ks][0], &frag[ks][1]);
      SplitPair<T>(high.x * f, high.y * f, &frag[ks][2], &frag[ks][3]);
    } else {
      frag[ks][0] = frag[ks][1] = frag[ks][2] = frag[ks][3] = 0u;
    }
  }
}

// The local token (of a warp's 16) of this lane's score i in MmaScores' output.
__device__ __forceinline__ int MmaScoreToken(int i) {
  return 2 * (threadIdx.x % 4) + (i & 1) + (i >> 1) * 8;
}

// Scores of the 16 staged tokens at k_rows (token rows of a swizzled tile, the first of them a
// multiple of 8) against the queries of `frag`, times `after` (ScoreFactor::after): lane (g, t)
// gets head g's scores of tokens MmaScoreToken(0..3) = 2t, 2t + 1, 2t + 8, 2t + 9 (zeros for
// g >= kGroup).
template <typename T, int kHeadDim>
__device__ __forceinline__ void MmaScores(const T* k_rows, const uint32_t (&frag)[kHeadDim / 16][4],
                                          float after, float (&s)[4]) {
  const int lane = threadIdx.x % 32;
  // ldmatrix matrix i = lane / 8: tokens (i / 2) * 8 + lane % 8, chunk 2 * ks + i % 2.
  const int token = (lane >> 4) * 8 + (lane & 7);
  const int half = (lane >> 3) & 1;
  // c[2 * parity + column block]: even and odd k-steps accumulate apart, halving the chain of
  // dependent mma.sync operations.
  float c[4][4] = {};
#pragma unroll
  for (int ks = 0; ks < kHeadDim / 16; ++ks) {
    uint32_t b[4];
    LdMatrixX4(k_rows + SwizzledOffset<kHeadDim>(token, 2 * ks + half), b);
    Mma16816<T>(c[2 * (ks & 1)], frag[ks], b[0], b[1]);
    Mma16816<T>(c[2 * (ks & 1) + 1], frag[ks], b[2], b[3]);
  }
  s[0] = ((c[0][0] + c[0][2]) + (c[2][0] + c[2][2])) * after;
  s[1] = ((c[0][1] + c[0][3]) + (c[2][1] + c[2][3])) * after;
  s[2] = ((c[1][0] + c[1][2]) + (c[3][0] + c[3][2])) * after;
  s[3] = ((c[1][1] + c[1][3]) + (c[3][1] + c[3][3])) * after;
}

// acc += P V for the 16 staged tokens at v_rows (as MmaScores' k_rows), P being this lane's
// weights p[i] of head g at tokens MmaScoreToken(i). acc[j]: dims 8j + 2t, 8j + 2t + 1 of head g
// in [0], [1] (from the hi parts of P) and [2], [3] (from the lo parts): their sums are the
// result.
template <typename T, int kHeadDim>
__device__ __forceinline__ void MmaAccumulatePV(const T* v_rows, const float (&p)[4],
                                                float (&acc)[kHeadDim / 8][4]) {
  uint32_t a[4];
  SplitPair<T>(p[0], p[1], &a[0], &a[1]);
  SplitPair<T>(p[2], p[3], &a[2], &a[3]);
  const int lane = threadIdx.x % 32;
  // ldmatrix.trans matrix i = lane / 8: tokens (i % 2) * 8 + lane % 8, chunk j + i / 2.
  const int token = ((lane >> 3) & 1) * 8 + (lane & 7);
  const int next = lane >> 4;
#pragma unroll
  for (int j = 0; j < kHeadDim / 8; j += 2) {
    uint32_t b[4];
    LdMatrixX4Trans(v_rows + SwizzledOffset<kHeadDim>(token, j + next), b);
    Mma16816<T>(acc[j], a, b[0], b[1]);
    Mma16816<T>(acc[j + 1], a, b[2], b[3]);
  }
}

}  // namespace kvrecall::cuda

#endif  // KVRECALL_KERNELS_CUDA_MMA_CUH_
