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

// The arithmetic both kernels share, so that PqEncodeRows is PqEncode's bit for bit.
// A centroid's |c|^2, summed in dim order.
template <int kSub>
__device__ __forceinline__ float CentroidNorm(const float* centroid) {
  float norm = 0.0f;
#pragma unroll
  for (int j = 0; j < kSub; ++j) norm = fmaf(centroid[j], centroid[j], norm);
  return norm;
}
// -2 x of a key's part (exact: a power of two), as the host's assignment scales it.
template <typename T, int kSub>
__device__ __forceinline__ void ScaledPart(const T* part, float* scaled) {
#pragma unroll
  for (int j = 0; j < kSub; ++j) scaled[j] = -2.0f * Widen(part[j]);
}
// |c|^2 - 2 <x, c>: from the norm, one multiply-add per dim in order.
template <int kSub>
__device__ __forceinline__ float Distance(float norm, const float* scaled, const float* centroid) {
  float distance = norm;
#pragma unroll
  for (int j = 0; j < kSub; ++j) distance = fmaf(scaled[j], centroid[j], distance);
  return distance;
}
// `error` plus the part's squared differences between the key and its chosen centroid, in order.
template <int kSub>
__device__ __forceinline__ float AddSquaredError(float error, const float* scaled,
                                                 const float* chosen) {
#pragma unroll
  for (int j = 0; j < kSub; ++j) {
    const float diff = -0.5f * scaled[j] - chosen[j];
    error = fmaf(diff, diff, error);
  }
  return error;
}

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
    norms[threadIdx.x] = CentroidNorm<kSub>(book + threadIdx.x * kSub);
    __syncthreads();
    float scaled[kSub];
    ScaledPart<T, kSub>(key + m * kSub, scaled);
    float best = 0.0f;
    int best_c = 0;
    for (int c = 0; c < kCentroids; ++c) {
      const float distance = Distance<kSub>(norms[c], scaled, book + c * kSub);
      if (c == 0 || distance < best) {
        best = distance;
        best_c = c;
      }
    }
    error = AddSquaredError<kSub>(error, scaled, book + best_c * kSub);
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
    float scaled[kSub];
    ScaledPart<T, kSub>(key + m * kSub, scaled);
    float best = Distance<kSub>(CentroidNorm<kSub>(centroid), scaled, centroid);
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
      error = AddSquaredError<kSub>(error, scaled, centroid);
      job.codes[m] = static_cast<uint8_t>(c);
    }
    __syncthreads();  // the error is added and the winners' slots free for the next part
  }
  if (c == 0 && job.error != nullptr) *job.error = error;
}

// Calls launch(Key<T>{}, Part<kSub>{}) for the key element type and the part's dims (4, 8, 16 or
// 32, checked by CheckParts): the kernels' instantiations, chosen in one place.
template <typename T>
struct Key {
  using type = T;
};
template <int kSub>
struct Part {
  static constexpr int dims = kSub;
};
template <typename Launch>
absl::Status WithKeyAndPart(KvElement element, int part_dims, const Launch& launch) {
  auto with_part = [&](auto key) {
    switch (part_dims) {
      case 4:
        return launch(key, Part<4>{});
      case 8:
        return launch(key, Part<8>{});
      case 16:
        return launch(key, Part<16>{});
      default:
        return launch(key, Part<32>{});
    }
  };
  switch (element) {
    case KvElement::kF32:
      return with_part(Key<float>{});
    case KvElement::kBf16:
      return with_part(Key<__nv_bfloat16>{});
    case KvElement::kF16:
      return with_part(Key<__half>{});
  }
  return absl::InvalidArgumentError("PQ encoding: unknown key element type");
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
  const unsigned blocks = static_cast<unsigned>((p.count + kThreads - 1) / kThreads);
  return WithKeyAndPart(p.element, p.dim / p.subspaces, [&](auto key, auto part) {
    PqEncodeKernel<typename decltype(key)::type, decltype(part)::dims>
        <<<blocks, kThreads, 0, stream>>>(p);
    return LaunchStatus("PqEncodeKernel");
  });
}

absl::Status PqEncodeRows(const PqEncodeRowsParams& p, cudaStream_t stream) {
  if (absl::Status s = CheckParts(p.dim, p.subspaces); !s.ok()) return s;
  if (p.count < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("PQ encoding needs count >= 0; got count=", p.count));
  }
  if (p.count == 0) return absl::OkStatus();
  if (p.jobs == nullptr) return absl::InvalidArgumentError("the jobs must be a device pointer");
  return WithKeyAndPart(p.element, p.dim / p.subspaces, [&](auto key, auto part) {
    PqEncodeRowsKernel<typename decltype(key)::type, decltype(part)::dims>
        <<<p.count, kThreads, 0, stream>>>(p.jobs, p.subspaces);
    return LaunchStatus("PqEncodeRowsKernel");
  });
}

}  // namespace kvrecall::cuda
