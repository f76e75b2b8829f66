#include "kernels/cuda/kv_write.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_status.h"

namespace kvrecall::cuda {
namespace {

template <typename T>
__device__ __forceinline__ T FromFloat(float x);
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __half FromFloat<__half>(float x) {
  return __float2half_rn(x);
}

template <typename T>
__global__ void ConvertKernel(const float* __restrict__ src, int64_t count, T* __restrict__ dst) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dst[i] = FromFloat<T>(src[i]);
  }
}

// grid = (batch, 2): y = 0 writes keys, y = 1 values.
template <typename T>
__global__ void AppendKernel(const TokenRows* __restrict__ rows, int row_elems,
                             const float* __restrict__ keys, const float* __restrict__ values) {
  const int b = blockIdx.x;
  const bool value = blockIdx.y == 1;
  const float* src = (value ? values : keys) + static_cast<int64_t>(b) * row_elems;
  T* dst = static_cast<T*>(value ? rows[b].value : rows[b].key);
  for (int i = threadIdx.x; i < row_elems; i += blockDim.x) dst[i] = FromFloat<T>(src[i]);
}

constexpr int kThreads = 256;

}  // namespace

absl::Status ConvertToKv(const float* src, int64_t count, KvDtype dtype, void* dst,
                         cudaStream_t stream) {
  if (count <= 0) return absl::OkStatus();
  const int blocks = static_cast<int>(std::min<int64_t>((count + kThreads - 1) / kThreads, 4096));
  return KVRECALL_DISPATCH_KV_DTYPE(dtype, T, [&] {
    ConvertKernel<T><<<blocks, kThreads, 0, stream>>>(src, count, static_cast<T*>(dst));
    return LaunchStatus("ConvertKernel");
  });
}

absl::Status AppendTokens(int batch, int row_elems, KvDtype dtype, const TokenRows* rows,
                          const float* keys, const float* values, cudaStream_t stream) {
  if (batch <= 0) return absl::OkStatus();
  return KVRECALL_DISPATCH_KV_DTYPE(dtype, T, [&] {
    AppendKernel<T><<<dim3(batch, 2), kThreads, 0, stream>>>(rows, row_elems, keys, values);
    return LaunchStatus("AppendKernel");
  });
}

}  // namespace kvrecall::cuda
