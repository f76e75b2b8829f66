// Device building blocks shared by the CUDA decode kernels: 16-byte KV vectors widened to f32,
// cp.async staging into shared memory, group reductions over warp lanes, the logical-position
// to slot mapping of a DeviceSeq, order-preserving score keys, and the dtype/head-dim dispatch.
#ifndef KVRECALL_KERNELS_CUDA_COMMON_CUH_
#define KVRECALL_KERNELS_CUDA_COMMON_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/decode_types.h"
#include "kernels/cuda/kernel_errors.h"

namespace kvrecall::cuda {

inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.6931471805599453f;

// Elements of T per 16-byte access, the unit of every KV load.
inline constexpr int kVecElems = 8;

template <typename T>
__device__ __forceinline__ void Widen8(const uint4& raw, float* out);

template <>
__device__ __forceinline__ void Widen8<__nv_bfloat16>(const uint4& raw, float* out) {
  const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(pairs[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

template <>
__device__ __forceinline__ void Widen8<__half>(const uint4& raw, float* out) {
  const __half2* pairs = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __half22float2(pairs[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

// A 16-byte load of KV data that is read once per step: skip L1, keep L2's normal policy.
__device__ __forceinline__ uint4 LoadKv16(const void* ptr) {
  return __ldcg(reinterpret_cast<const uint4*>(ptr));
}

// Asynchronous 16-byte copy global -> shared (sm_80+). With valid == false nothing is read and
// the destination is zero-filled, so masked rows never hold stale bits (0 * NaN would poison).
__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem, bool valid) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem),
               "r"(src_bytes));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// Sum / max over aligned groups of kLanes consecutive lanes (kLanes a power of two <= 32);
// every lane of the group gets the result.
template <int kLanes>
__device__ __forceinline__ float GroupSum(float x) {
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}
template <int kLanes>
__device__ __forceinline__ float GroupMax(float x) {
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset /= 2) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  }
  return x;
}

// Slot of logical position p (0 <= p < head_count + ring_count) of a DeviceSeq.
__device__ __forceinline__ int32_t SlotOf(const DeviceSeq& seq, int32_t p) {
  if (p < seq.head_count) return p;
  int32_t r = seq.ring_start + (p - seq.head_count);
  if (r >= seq.ring_capacity) r -= seq.ring_capacity;
  return seq.ring_begin + r;
}

__device__ __forceinline__ int32_t SeqSize(const DeviceSeq& seq) {
  return seq.head_count + seq.ring_count;
}

// Element offset of (slot, kv_head) in a [slots, kv_heads, head_dim] tensor.
__device__ __forceinline__ int64_t KvOffset(int32_t slot, int kv_head, int kv_heads, int head_dim) {
  return (static_cast<int64_t>(slot) * kv_heads + kv_head) * head_dim;
}

// An unsigned key that orders like the float (larger score, larger key); -0 counts as +0 so
// that equal scores compare equal, as they do on the CPU.
__device__ __forceinline__ uint32_t OrderKey(float score) {
  const uint32_t bits = __float_as_uint(score == 0.0f ? 0.0f : score);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// The float bits OrderKey came from (-0 comes back as +0).
__device__ __forceinline__ uint32_t OrderKeyToBits(uint32_t key) {
  return (key & 0x80000000u) ? (key & 0x7fffffffu) : ~key;
}

// A unique 64-bit key for (score, position): higher score first, then lower position — the
// order of cpu::TopKPositions. The K largest of these are the exact top-K.
__device__ __forceinline__ uint64_t RankKey(float score, int32_t position) {
  return (static_cast<uint64_t>(OrderKey(score)) << 32) |
         static_cast<uint32_t>(0x7fffffff - position);
}
__device__ __forceinline__ int32_t PositionOfRankKey(uint64_t key) {
  return 0x7fffffff - static_cast<int32_t>(key & 0xffffffffu);
}

// Signals that this block finished its share of a pass; true in the one block that finishes
// last, which then sees every other block's writes. Call with all threads; `flag`: shared.
__device__ __forceinline__ bool FinishedLast(uint32_t* counter, uint32_t blocks, bool* flag) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) *flag = atomicAdd(counter, 1u) == blocks - 1;
  __syncthreads();
  if (*flag) __threadfence();
  return *flag;
}

}  // namespace kvrecall::cuda

// Inserts key (>= 0) into an open-addressing set of `slots` (a power of two) in shared memory,
// empty = -1; true for the one call that added it. Safe under concurrent inserts from the whole
// block.
__device__ __forceinline__ bool HashInsert(int32_t* table, int log2_slots, int32_t key) {
  const uint32_t mask = (1u << log2_slots) - 1;
  uint32_t h = (static_cast<uint32_t>(key) * 2654435761u) >> (32 - log2_slots);
  while (true) {
    const int32_t prev = atomicCAS(table + h, -1, key);
    if (prev == -1) return true;
    if (prev == key) return false;
    h = (h + 1) & mask;
  }
}

// Runs `body` with `KvT` bound to the element type of `dtype` (a KvDtype).
#define KVRECALL_DISPATCH_KV_DTYPE(dtype, KvT, ...) \
  [&] {                                             \
    if ((dtype) == ::kvrecall::cuda::KvDtype::kBf16) { \
      using KvT = __nv_bfloat16;                    \
      return __VA_ARGS__();                         \
    }                                               \
    using KvT = __half;                             \
    return __VA_ARGS__();                           \
  }()

// Runs `body` with the constexpr int `kDim` bound to head_dim (64 or 128, already validated).
#define KVRECALL_DISPATCH_HEAD_DIM(head_dim, kDim, ...) \
  [&] {                                                 \
    if ((head_dim) == 64) {                             \
      constexpr int kDim = 64;                          \
      return __VA_ARGS__();                             \
    }                                                   \
    constexpr int kDim = 128;                           \
    return __VA_ARGS__();                               \
  }()

#endif  // KVRECALL_KERNELS_CUDA_COMMON_CUH_
