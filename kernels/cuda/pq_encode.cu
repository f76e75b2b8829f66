#include "kernels/cuda/pq_encode.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/launch.cuh"

namespace kvrecall::cuda {
namespace {

constexpr int kCentroids = 256;
constexpr int kThreads = 256;
static_assert(kThreads == kCentroids, "a block weighs its codebook one centroid per thread");

__device__ __forceinline__ float Widen(float x) { return x; }
__device__ __forceinline__ float Widen(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float Widen(__half x) { return __half2float(x); }

// Thread i of block b codes key b * kThreads + i: codebook after codebook, the block stages the
// codebook and its centroids' |c|^2 in shared memory, and every thread weighs all 256 centroids
// against its key's part (each centroid read by the whole block at once: a broadcast).
template <typename T, int kSub>
__global__ void __launch_bounds__(kThreads) PqEncodeKernel(const PqEncodeParams p) {
  __shared__ __align__(16) float book[kCentroids * kSub];
  __shared__ float norms[kCentroids];
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const bool valid = i < p.count;
  const T* key = static_cast<const T*>(p.keys) + (valid ? i : 0) * p.row_stride;
  float error = 0.0f;
  for (int m = 0; m < p.subspaces; ++m) {
    __syncthreads();  // the previous codebook's last readers are done
    const float* src = p.codebooks + static_cast<int64_t>(m) * kCentroids * kSub;
    for (int e = threadIdx.x; e < kCentroids * kSub; e += kThreads) book[e] = src[e];
    __syncthreads();
    {
      const float* centroid = book + threadIdx.x * kSub;
      float norm = 0.0f;
#pragma unroll
      for (int j = 0; j < kSub; ++j) norm = fmaf(centroid[j], centroid[j], norm);
      norms[threadIdx.x] = norm;
    }
    __syncthreads();
    // -2 x (exact: a power of two), as the host's assignment scales it.
    float scaled[kSub];
#pragma unroll
    for (int j = 0; j < kSub; ++j) scaled[j] = -2.0f * Widen(key[m * kSub + j]);
    float best = 0.0f;
    int best_c = 0;
    for (int c = 0; c < kCentroids; ++c) {
      const float* centroid = book + c * kSub;
      float distance = norms[c];
#pragma unroll
      for (int j = 0; j < kSub; ++j) distance = fmaf(scaled[j], centroid[j], distance);
      if (c == 0 || distance < best) {
        best = distance;
        best_c = c;
      }
    }
    const float* chosen = book + best_c * kSub;
#pragma unroll
    for (int j = 0; j < kSub; ++j) {
      const float diff = -0.5f * scaled[j] - chosen[j];
      error = fmaf(diff, diff, error);
    }
    if (valid) p.codes[i * p.subspaces + m] = static_cast<uint8_t>(best_c);
  }
  if (valid && p.errors != nullptr) p.errors[i] = error;
}

template <typename T>
absl::Status LaunchPqEncode(const PqEncodeParams& p, cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>((p.count + kThreads - 1) / kThreads);
  switch (p.dim / p.subspaces) {
    case 4:
      PqEncodeKernel<T, 4><<<blocks, kThreads, 0, stream>>>(p);
      break;
    case 8:
      PqEncodeKernel<T, 8><<<blocks, kThreads, 0, stream>>>(p);
      break;
    case 16:
      PqEncodeKernel<T, 16><<<blocks, kThreads, 0, stream>>>(p);
      break;
    default:
      PqEncodeKernel<T, 32><<<blocks, kThreads, 0, stream>>>(p);
      break;
  }
  return LaunchStatus("PqEncodeKernel");
}

}  // namespace

absl::Status PqEncode(const PqEncodeParams& p, cudaStream_t stream) {
  const int sub = p.subspaces > 0 && p.dim % p.subspaces == 0 ? p.dim / p.subspaces : 0;
  if (p.subspaces < 1 || p.subspaces > kMaxPqSubspaces ||
      (sub != 4 && sub != 8 && sub != 16 && sub != 32)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "PQ encoding needs 1 <= subspaces <= ", kMaxPqSubspaces,
        " dividing dim into parts of 4, 8, 16 or 32 dims; got subspaces=", p.subspaces,
        " dim=", p.dim));
  }
  if (p.count < 0 || p.row_stride < p.dim) {
    return absl::InvalidArgumentError(
        absl::StrCat("PQ encoding needs count >= 0 and row_stride >= dim; got count=", p.count,
                     " row_stride=", p.row_stride, " dim=", p.dim));
  }
  if (p.count > int64_t{kThreads} * 0x7fffffff) {
    return absl::InvalidArgumentError(absl::StrCat("too many keys to code in one call: ", p.count));
  }
  if (p.count == 0) return absl::OkStatus();
  if (p.keys == nullptr || p.codebooks == nullptr || p.codes == nullptr) {
    return absl::InvalidArgumentError("keys, codebooks and codes must be device pointers");
  }
  switch (p.element) {
    case KvElement::kF32:
      return LaunchPqEncode<float>(p, stream);
    case KvElement::kBf16:
      return LaunchPqEncode<__nv_bfloat16>(p, stream);
    case KvElement::kF16:
      return LaunchPqEncode<__half>(p, stream);
  }
  return absl::InvalidArgumentError("PQ encoding: unknown key element type");
}

}  // namespace kvrecall::cuda
