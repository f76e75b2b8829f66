#include "kernels/cuda/pq_encode.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/launch.cuh"

namespace kvrecall::cuda {
namespace {

constexpr int kCentroids = 256;
constexpr int kThreads = 256;
static_assert(kThreads == kCentroids,
              "a block stages a codebook's norms, and PqEncodeRows weighs it, a centroid a thread");

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

// The warps of a PqEncodeKernel block; each weighs kKeysPerWarp keys, one of the splits below
// (PqEncodeKeysPerWarp), so a block codes kWarps * kKeysPerWarp.
constexpr int kWarps = kThreads / 32;
constexpr int kMostKeysPerWarp = 8;
constexpr int kFewerKeysPerWarp = 2;
constexpr int kFewestKeysPerWarp = 1;
static_assert(kMostKeysPerWarp <= 32, "a lane of each warp keeps one of its keys' errors");

// The least (distance, centroid) of two, the lower centroid on a tie: PqEncodeKernel's and
// PqEncodeRowsKernel's reductions, so that both pick as a scan of the centroids in order does.
__device__ __forceinline__ void KeepLeast(float other, int other_c, float* best, int* best_c) {
  if (other < *best || (other == *best && other_c < *best_c)) {
    *best = other;
    *best_c = other_c;
  }
}
// A centroid's distance as the reductions order it: a scan in order keeps centroid 0 when its
// distance is NaN (nothing compares below NaN) and passes over any other NaN.
__device__ __forceinline__ float Ordered(float distance, int c) {
  return isnan(distance) ? (c == 0 ? -INFINITY : INFINITY) : distance;
}

// Block (b, s) codes keys [b * kTileKeys, (b + 1) * kTileKeys) of set s (kTileKeys = kWarps *
// kKeysPerWarp), codebook after codebook. For each codebook the block stages the codebook (each
// centroid padded by a float, so that the 32 centroids a warp reads at once fall in different
// banks), its centroids' |c|^2 and the tile's parts of the keys, already scaled by -2; the next
// codebook's and parts' loads are issued before the block weighs this one, so that their
// latency is hidden behind it. Warp w weighs its tile keys w, w + kWarps, ... (so that a few keys
// still spread over the warps) all at once: lane l takes centroids l, l + 32, ..., reads each
// centroid once for all its keys, and keeps a least per key (KeepLeast); then the warp reduces the
// keys' leasts by shuffles, interleaved. The keys' independent chains hide the latencies that
// weighing one key at a time waited on (d112's kernel: ~160 us for 8 to 2048 keys of 8 sets).
// Lane k of the warp adds its k-th key's part errors, in part order. A warp skips its keys past
// `count` (their staged parts are zeros).
template <typename T, int kSub, int kKeysPerWarp>
__global__ void __launch_bounds__(kThreads) PqEncodeKernel(const PqEncodeParams p) {
  constexpr int kStride = kSub + 1;
  constexpr int kTileKeys = kWarps * kKeysPerWarp;
  // A thread's share of a codebook's and of the tile's parts' elements (the last share of the
  // parts partial when the tile has fewer than kThreads).
  constexpr int kBookLoads = kCentroids * kSub / kThreads;
  constexpr int kPartElements = kTileKeys * kSub;
  constexpr int kPartLoads = (kPartElements + kThreads - 1) / kThreads;
  static_assert(kBookLoads * kThreads == kCentroids * kSub);
  __shared__ float book[kCentroids * kStride];
  __shared__ float norms[kCentroids];
  __shared__ __align__(16) float parts[kTileKeys * kSub];  // the tile's scaled parts, [key, dim]
  const int set = blockIdx.y;
  const T* keys = static_cast<const T*>(p.keys) + set * p.key_set_stride;
  const float* codebooks = p.codebooks + set * p.codebook_set_stride;
  uint8_t* codes = p.codes + set * p.code_set_stride;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t tile = static_cast<int64_t>(blockIdx.x) * kTileKeys;
  // This warp's keys before `count`: its keys k < live.
  const int64_t ahead = p.count - tile - warp;  // (>= 1 for a warp with a key)
  const int live = ahead >= int64_t{kKeysPerWarp} * kWarps
                       ? kKeysPerWarp
                       : static_cast<int>(ahead <= 0 ? 0 : (ahead + kWarps - 1) / kWarps);
  // Codebook m's and the parts' elements of this thread, loaded into registers.
  float next_book[kBookLoads], next_parts[kPartLoads];
  auto load = [&](int m) {
    const float* src = codebooks + static_cast<int64_t>(m) * kCentroids * kSub;
#pragma unroll
    for (int r = 0; r < kBookLoads; ++r) next_book[r] = src[r * kThreads + threadIdx.x];
#pragma unroll
    for (int r = 0; r < kPartLoads; ++r) {
      const int e = r * kThreads + threadIdx.x;
      const int64_t i = tile + e / kSub;
      next_parts[r] = e < kPartElements && i < p.count
                          ? Widen(keys[i * p.row_stride + m * kSub + e % kSub])
                          : 0.0f;
    }
  };
  load(0);
  float error = 0.0f;  // lane k < kKeysPerWarp: tile key warp + k * kWarps's
  for (int m = 0; m < p.subspaces; ++m) {
    __syncthreads();  // the previous codebook's and parts' last readers are done
#pragma unroll
    for (int r = 0; r < kBookLoads; ++r) {
      const int e = r * kThreads + threadIdx.x;
      book[(e / kSub) * kStride + e % kSub] = next_book[r];
    }
#pragma unroll
    for (int r = 0; r < kPartLoads; ++r) {
      const int e = r * kThreads + threadIdx.x;
      if (e < kPartElements) parts[e] = -2.0f * next_parts[r];
    }
    __syncthreads();
    if (m + 1 < p.subspaces) load(m + 1);
    norms[threadIdx.x] = CentroidNorm<kSub>(book + threadIdx.x * kStride);
    __syncthreads();
    float best[kKeysPerWarp];
    int best_c[kKeysPerWarp];
// (Unrolled twice below 32 dims a part: two centroids' loads ahead of their keys' multiply-adds.
// At 32 a first form of this loop spilled so (d114's, 8 keys a warp); not tried again since.)
#pragma unroll(kSub < 32 ? 2 : 1)
    for (int q = 0; q < kCentroids / 32; ++q) {
      const int c = q * 32 + lane;
      float centroid[kSub];
#pragma unroll
      for (int j = 0; j < kSub; ++j) centroid[j] = book[c * kStride + j];
      const float norm = norms[c];
#pragma unroll
      for (int k = 0; k < kKeysPerWarp; ++k) {
        if (k >= live) break;  // (uniform across the warp)
        // The key's part, four floats a load (every lane reads the same: a broadcast).
        float part[kSub];
        const auto* part4 = reinterpret_cast<const float4*>(parts + (warp + k * kWarps) * kSub);
#pragma unroll
        for (int j = 0; j < kSub / 4; ++j) {
          const float4 v = part4[j];
          part[4 * j] = v.x;
          part[4 * j + 1] = v.y;
          part[4 * j + 2] = v.z;
          part[4 * j + 3] = v.w;
        }
        const float distance = Ordered(Distance<kSub>(norm, part, centroid), c);
        if (q == 0) {
          best[k] = distance;
          best_c[k] = c;
        } else {
          KeepLeast(distance, c, &best[k], &best_c[k]);
        }
      }
    }
    for (int offset = 16; offset > 0; offset /= 2) {
#pragma unroll
      for (int k = 0; k < kKeysPerWarp; ++k) {
        if (k >= live) break;
        const float other = __shfl_xor_sync(0xffffffffu, best[k], offset);
        const int other_c = __shfl_xor_sync(0xffffffffu, best_c[k], offset);
        KeepLeast(other, other_c, &best[k], &best_c[k]);
      }
    }
#pragma unroll
    for (int k = 0; k < kKeysPerWarp; ++k) {
      if (k >= live) break;
      if (lane != k) continue;
      const int key = warp + k * kWarps;
      error = AddSquaredError<kSub>(error, parts + key * kSub, book + best_c[k] * kStride);
      codes[(tile + key) * p.subspaces + m] = static_cast<uint8_t>(best_c[k]);
    }
  }
  if (lane < live && p.errors != nullptr) {
    p.errors[set * p.error_set_stride + tile + warp + lane * kWarps] = error;
  }
}

// Block j codes job j's key: codebook after codebook, thread c weighs centroid c (its |c|^2 and
// distance with PqEncodeKernel's arithmetic), the block takes the least distance (KeepLeast,
// then the warps' winners in order), and the winning thread adds its part's squared errors to
// the key's, in PqEncodeKernel's order.
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
    float best = Ordered(Distance<kSub>(CentroidNorm<kSub>(centroid), scaled, centroid), c);
    int best_c = c;
    for (int offset = 16; offset > 0; offset /= 2) {
      const float other = __shfl_xor_sync(0xffffffffu, best, offset);
      const int other_c = __shfl_xor_sync(0xffffffffu, best_c, offset);
      KeepLeast(other, other_c, &best, &best_c);
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

// Blocks of `keys_per_warp` keys a warp that cover `count` keys of one set.
int64_t TilesOf(int64_t count, int keys_per_warp) {
  const int64_t tile = int64_t{kWarps} * keys_per_warp;
  return (count + tile - 1) / tile;
}

}  // namespace

int PqEncodeKeysPerWarp(int64_t count, int sets, int sms) {
  // More keys a warp share each centroid's reads and each codebook's staging; more blocks keep
  // more of the device busy: at 64 rows of 8 sets, 8 keys a warp kept 8 of 132 SMs busy (d114).
  if (TilesOf(count, kMostKeysPerWarp) * sets >= sms) return kMostKeysPerWarp;
  if (TilesOf(count, kFewerKeysPerWarp) * sets >= sms) return kFewerKeysPerWarp;
  return kFewestKeysPerWarp;
}

absl::Status PqEncode(const PqEncodeParams& p, cudaStream_t stream) {
  if (absl::Status s = CheckParts(p.dim, p.subspaces); !s.ok()) return s;
  if (p.count < 0 || p.row_stride < p.dim) {
    return absl::InvalidArgumentError(
        absl::StrCat("PQ encoding needs count >= 0 and row_stride >= dim; got count=", p.count,
                     " row_stride=", p.row_stride, " dim=", p.dim));
  }
  // (So that a grid of a key a warp, the smallest tiles, fits the grid's x.)
  if (p.count > int64_t{kWarps} * 0x7fffffff) {
    return absl::InvalidArgumentError(absl::StrCat("too many keys to code in one call: ", p.count));
  }
  if (p.sets < 1 || p.sets > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("PQ encoding needs 1 <= sets <= 65535; got sets=", p.sets));
  }
  if (p.keys_per_warp != 0 && p.keys_per_warp != kMostKeysPerWarp &&
      p.keys_per_warp != kFewerKeysPerWarp && p.keys_per_warp != kFewestKeysPerWarp) {
    return absl::InvalidArgumentError(absl::StrCat(
        "PQ encoding's keys_per_warp is 0 (chosen), 1, 2 or 8; got ", p.keys_per_warp));
  }
  // Sets that write over one another would race: their codes (and errors) must not overlap.
  if (p.sets > 1 &&
      (std::abs(p.code_set_stride) < p.count * p.subspaces ||
       (p.errors != nullptr && std::abs(p.error_set_stride) < p.count))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "PQ encoding's sets would overlap: code_set_stride=", p.code_set_stride,
        " error_set_stride=", p.error_set_stride, " for count=", p.count,
        " subspaces=", p.subspaces));
  }
  if (p.count == 0) return absl::OkStatus();
  if (p.keys == nullptr || p.codebooks == nullptr || p.codes == nullptr) {
    return absl::InvalidArgumentError("keys, codebooks and codes must be device pointers");
  }
  int keys_per_warp = p.keys_per_warp;
  if (keys_per_warp == 0) {
    const absl::StatusOr<int> sms = MultiprocessorCount();
    if (!sms.ok()) return sms.status();
    keys_per_warp = PqEncodeKeysPerWarp(p.count, p.sets, *sms);
  }
  const dim3 blocks(static_cast<unsigned>(TilesOf(p.count, keys_per_warp)),
                    static_cast<unsigned>(p.sets));
  return WithKeyAndPart(p.element, p.dim / p.subspaces, [&](auto key, auto part) {
    using T = typename decltype(key)::type;
    constexpr int kSub = decltype(part)::dims;
    if (keys_per_warp == kMostKeysPerWarp) {
      PqEncodeKernel<T, kSub, kMostKeysPerWarp><<<blocks, kThreads, 0, stream>>>(p);
    } else if (keys_per_warp == kFewerKeysPerWarp) {
      PqEncodeKernel<T, kSub, kFewerKeysPerWarp><<<blocks, kThreads, 0, stream>>>(p);
    } else {
      PqEncodeKernel<T, kSub, kFewestKeysPerWarp><<<blocks, kThreads, 0, stream>>>(p);
    }
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
