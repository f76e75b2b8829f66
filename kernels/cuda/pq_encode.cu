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

// Block j codes job j's key: codebook after codebook, thread c weighs centroid c (its |c|^2 and
// distance with PqEncodeKernel's arithmetic), the block takes the least distance (the lower c on
// a tie, as PqEncodeKernel's scan in order does), and the winning thread adds its part's squared
// errors to the key's, in PqEncodeKernel's order.
template <typename T, int kSub>
__global__ void __launch_bounds__(kThreads) PqEncodeRowsKernel(const PqEncodeJob* jobs,
                                                               int subspaces) {
  __shared__ float warp_best[kThreads / 32];
  __shared__ int warp_best_c[kThreads / 32];
  __shared__ float error;
  const PqEncodeJob job = jobs[blockIdx.x];
  if (job.codes == nullptr) return;  // (uniform across the block)
  const T* key = static_cast<const T*>(job.key);
  const int c = threadIdx.x;
  const int lane = c % 32, warp = c / 32;
  if (c == 0) error = 0.0f;
  for (int m = 0; m < subspaces; ++m) {
    float centroid[kSub];
    const float* src = job.codebooks + (static_cast<int64_t>(m) * kCentroids + c) * kSub;
#pragma unroll
    for (int j = 0; j < kSub; ++j) centroid[j] = src[j];
    float norm = 0.0f;
#pragma unroll
    for (int j = 0; j < kSub; ++j) norm = fmaf(centroid[j], centroid[j], norm);
    float scaled[kSub];
#pragma unroll
    for (int j = 0; j < kSub; ++j) scaled[j] = -2.0f * Widen(key[m * kSub + j]);
    float best = norm;
#pragma unroll
    for (int j = 0; j < kSub; ++j) best = fmaf(scaled[j], centroid[j], best);
    // PqEncodeKernel's scan keeps centroid 0 when its distance is NaN (nothing compares below
    // NaN) and passes over any other NaN: the same order, for keys that are not finite.
    if (isnan(best)) best = c == 0 ? -INFINITY : INFINITY;
    int best_c = c;
    for (int offset = 16; offset > 0; offset /= 2) {
      const float other = __shfl_xor_sync(0xffffffffu, best, offset);
      const int other_c = __shfl_xor_sync(0xffffffffu, best_c, offset);
      if (other < best || (other == best && other_c < best_c)) {
        best = other;
        best_c = other_c;
      }
    }
    if (lane == 0) {
      warp_best[warp] = best;
      warp_best_c[warp] = best_c;
    }
    __syncthreads();
    // Every thread reduces the warps' winners in order (lower warps hold lower centroids).
    best = warp_best[0];
    best_c = warp_best_c[0];
    for (int w = 1; w < kThreads / 32; ++w) {
      if (warp_best[w] < best) {
        best = warp_best[w];
        best_c = warp_best_c[w];
      }
    }
    if (c == best_c) {
      float e = error;
#pragma unroll
      for (int j = 0; j < kSub; ++j) {
        const float diff = -0.5f * scaled[j] - centroid[j];
        e = fmaf(diff, diff, e);
      }
      error = e;
      job.codes[m] = static_cast<uint8_t>(c);
    }
    __syncthreads();  // the error is added and the winners' slots free for the next part
  }
  if (c == 0 && job.error != nullptr) *job.error = error;
}

template <typename T, int kSub>
absl::Status LaunchPqEncodeRowsAs(const PqEncodeRowsParams& p, cudaStream_t stream) {
  PqEncodeRowsKernel<T, kSub><<<p.count, kThreads, 0, stream>>>(p.jobs, p.subspaces);
  return LaunchStatus("PqEncodeRowsKernel");
}

template <typename T>
absl::Status LaunchPqEncodeRows(const PqEncodeRowsParams& p, cudaStream_t stream) {
  switch (p.dim / p.subspaces) {
    case 4:
      return LaunchPqEncodeRowsAs<T, 4>(p, stream);
    case 8:
      return LaunchPqEncodeRowsAs<T, 8>(p, stream);
    case 16:
      return LaunchPqEncodeRowsAs<T, 16>(p, stream);
    default:
      return LaunchPqEncodeRowsAs<T, 32>(p, stream);
  }
}

// INVALID_ARGUMENT unless `dim` splits into `subspaces` parts of 4, 8, 16 or 32 dims.
absl::Status CheckParts(int dim, int subspaces) {
  const int sub = subspaces > 0 && dim % subspaces == 0 ? dim / subspaces : 0;
  if (subspaces < 1 || subspaces > kMaxPqSubspaces ||
      (sub != 4 && sub != 8 && sub != 16 && sub != 32)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "PQ encoding needs 1 <= subspaces <= ", kMaxPqSubspaces,
        " dividing dim into parts of 4, 8, 16 or 32 dims; got subspaces=", subspaces,
        " dim=", dim));
  }
  return absl::OkStatus();
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
  if (absl::Status s = CheckParts(p.dim, p.subspaces); !s.ok()) return s;
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

absl::Status PqEncodeRows(const PqEncodeRowsParams& p, cudaStream_t stream) {
  if (absl::Status s = CheckParts(p.dim, p.subspaces); !s.ok()) return s;
  if (p.count < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("PQ encoding needs count >= 0; got count=", p.count));
  }
  if (p.count == 0) return absl::OkStatus();
  if (p.jobs == nullptr) return absl::InvalidArgumentError("the jobs must be a device pointer");
  switch (p.element) {
    case KvElement::kF32:
      return LaunchPqEncodeRows<float>(p, stream);
    case KvElement::kBf16:
      return LaunchPqEncodeRows<__nv_bfloat16>(p, stream);
    case KvElement::kF16:
      return LaunchPqEncodeRows<__half>(p, stream);
  }
  return absl::InvalidArgumentError("PQ encoding: unknown key element type");
}

}  // namespace kvrecall::cuda
