#include "kernels/cuda/batch_topk.h"

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/topk_workspace.h"

namespace kvrecall::cuda {
namespace {

// The grid's second dimension carries the rows of a selection launch.
constexpr int64_t kMaxRowsPerLaunch = 65535;

template <typename T>
absl::Status Grow(size_t count, DeviceBuffer<T>* buffer) {
  return buffer->size() >= count ? absl::OkStatus() : AllocateZeroed(count, buffer);
}

// Rows packed into pinned host memory a chunk at a time, each chunk's upload queued as soon as
// it is packed, so that the host packs the next chunk while the DMA engine moves this one.
// (A cudaMemcpy2D from pageable memory, the keys' rows a token's KV heads apart, was staged by
// the driver row by row.)
constexpr size_t kStageChunkBytes = size_t{4} << 20;

// Copies `count` rows of `row_bytes` bytes, `stride_bytes` apart at `src`, through `pinned`
// (at least count * row_bytes, free until the stream has run the copies) to the packed
// device buffer `dst`, on `stream`.
absl::Status UploadRows(const void* src, int64_t count, size_t stride_bytes, size_t row_bytes,
                        std::byte* pinned, void* dst, cudaStream_t stream) {
  if (row_bytes == 0) return absl::OkStatus();
  const int64_t rows_per_chunk =
      std::max<int64_t>(1, static_cast<int64_t>(kStageChunkBytes / row_bytes));
  const std::byte* from = static_cast<const std::byte*>(src);
  for (int64_t begin = 0; begin < count; begin += rows_per_chunk) {
    const int64_t rows = std::min(rows_per_chunk, count - begin);
    std::byte* chunk = pinned + begin * row_bytes;
    if (stride_bytes == row_bytes) {
      std::memcpy(chunk, from + begin * stride_bytes, rows * row_bytes);
    } else {
      for (int64_t r = 0; r < rows; ++r) {
        std::memcpy(chunk + r * row_bytes, from + (begin + r) * stride_bytes, row_bytes);
      }
    }
    KVRECALL_CUDA_RETURN_IF_ERROR(
        CudaStatus(cudaMemcpyAsync(static_cast<std::byte*>(dst) + begin * row_bytes, chunk,
                                   rows * row_bytes, cudaMemcpyHostToDevice, stream),
                   "uploading rows"));
  }
  return absl::OkStatus();
}

// out[i] = in[i] widened to f32, for n 16-bit elements (bf16 when `bf16`, else f16).
__global__ void WidenKernel(const uint16_t* in, int64_t n, bool bf16, float* out) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    out[i] = bf16 ? __uint_as_float(static_cast<uint32_t>(in[i]) << 16)
                  : __half2float(__ushort_as_half(in[i]));
  }
}

absl::Status Widen(const uint16_t* in, int64_t n, bool bf16, float* out, cudaStream_t stream) {
  const int blocks = static_cast<int>(std::min<int64_t>((n + 255) / 256, 4096));
  WidenKernel<<<blocks, 256, 0, stream>>>(in, n, bf16, out);
  return LaunchStatus("WidenKernel");
}

// 16-bit keys (bf16 when `bf16`, else f16), exact in their own type by construction: rounds
// them to the other 16-bit type into `other` and sets inexact[0] (bf16) / inexact[1] (f16) as
// ToSixteenBitsKernel below would for the keys widened to f32: the other type's flag when one
// does not come back equal, and both for a NaN (which equals nothing).
__global__ void OtherSixteenBitsKernel(const uint16_t* in, int64_t n, bool bf16,
                                       uint16_t* other, unsigned int* inexact) {
  bool nan = false;
  bool other_lost = false;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float v = bf16 ? __uint_as_float(static_cast<uint32_t>(in[i]) << 16)
                         : __half2float(__ushort_as_half(in[i]));
    nan |= v != v;
    if (bf16) {
      const __half h = __float2half_rn(v);
      other_lost |= !(__half2float(h) == v);
      other[i] = __half_as_ushort(h);
    } else {
      const __nv_bfloat16 b = __float2bfloat16_rn(v);
      other_lost |= !(__bfloat162float(b) == v);
      other[i] = __bfloat16_as_ushort(b);
    }
  }
  const bool own_lost = nan;
  if (__syncthreads_or(own_lost) && threadIdx.x == 0) atomicOr(inexact + (bf16 ? 0 : 1), 1u);
  if (__syncthreads_or(other_lost) && threadIdx.x == 0) atomicOr(inexact + (bf16 ? 1 : 0), 1u);
}

absl::Status OtherSixteenBits(const uint16_t* in, int64_t n, bool bf16, uint16_t* other,
                              unsigned int* inexact, cudaStream_t stream) {
  if (n == 0) return absl::OkStatus();
  const int blocks = static_cast<int>(std::min<int64_t>((n + 255) / 256, 4096));
  OtherSixteenBitsKernel<<<blocks, 256, 0, stream>>>(in, n, bf16, other, inexact);
  return LaunchStatus("OtherSixteenBitsKernel");
}

// Rounds x[0, n) to bf16 and to f16 and sets inexact[0] (bf16) / inexact[1] (f16) when an
// element does not come back equal (it lost bits, overflowed, or is NaN).
__global__ void ToSixteenBitsKernel(const float* x, int64_t n, __nv_bfloat16* bf16, __half* f16,
                                    unsigned int* inexact) {
  bool bf16_lost = false;
  bool f16_lost = false;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float v = x[i];
    const __nv_bfloat16 b = __float2bfloat16_rn(v);
    const __half h = __float2half_rn(v);
    bf16_lost |= !(__bfloat162float(b) == v);
    f16_lost |= !(__half2float(h) == v);
    bf16[i] = b;
    f16[i] = h;
  }
  if (__syncthreads_or(bf16_lost) && threadIdx.x == 0) atomicOr(inexact, 1u);
  if (__syncthreads_or(f16_lost) && threadIdx.x == 0) atomicOr(inexact + 1, 1u);
}

absl::Status ToSixteenBits(const float* x, int64_t n, __nv_bfloat16* bf16, __half* f16,
                           unsigned int* inexact, cudaStream_t stream) {
  if (n == 0) return absl::OkStatus();
  constexpr int kThreads = 256;
  const int blocks = static_cast<int>(std::min<int64_t>((n + kThreads - 1) / kThreads, 4096));
  ToSixteenBitsKernel<<<blocks, kThreads, 0, stream>>>(x, n, bf16, f16, inexact);
  return LaunchStatus("ToSixteenBitsKernel");
}

// Orders each row's selected keys (support [rows, k], their scores alongside, sizes[r] of them)
// by score, higher first, ties to the lower id (RankKey), into ordered [rows, k] padded with
// -1: a bitonic sort of the row's `padded` (a power of two >= k) keys in shared memory.
__global__ void OrderRowsKernel(const int32_t* support, const float* scores,
                                const int32_t* sizes, int k, int padded, int32_t* ordered) {
  extern __shared__ uint64_t keys[];
  const int64_t row = blockIdx.x;
  const int size = sizes[row];
  for (int j = threadIdx.x; j < padded; j += blockDim.x) {
    // 0 ranks below every real key (a real one has a position below 0x7fffffff).
    keys[j] = j < size ? RankKey(scores[row * k + j], support[row * k + j]) : 0;
  }
  __syncthreads();
  for (int width = 2; width <= padded; width <<= 1) {
    for (int stride = width >> 1; stride > 0; stride >>= 1) {
      for (int i = threadIdx.x; i < padded; i += blockDim.x) {
        const int partner = i ^ stride;
        if (partner > i) {
          // Descending within blocks of `width` whose bit is clear, ascending in the others,
          // so that the final merge leaves the whole row descending.
          const bool descending = (i & width) == 0;
          const uint64_t a = keys[i];
          const uint64_t b = keys[partner];
          if (descending ? a < b : a > b) {
            keys[i] = b;
            keys[partner] = a;
          }
        }
      }
      __syncthreads();
    }
  }
  for (int j = threadIdx.x; j < k; j += blockDim.x) {
    ordered[row * k + j] = j < size ? PositionOfRankKey(keys[j]) : -1;
  }
}

absl::Status OrderRows(const int32_t* support, const float* scores, const int32_t* sizes,
                       int rows, int k, int32_t* ordered, cudaStream_t stream) {
  int padded = 1;
  while (padded < k) padded <<= 1;
  const int threads = std::clamp(padded / 2, 32, 1024);
  OrderRowsKernel<<<rows, threads, padded * sizeof(uint64_t), stream>>>(support, scores, sizes,
                                                                         k, padded, ordered);
  return LaunchStatus("OrderRowsKernel");
}

}  // namespace

struct GpuBatchTopK::Impl {
  int64_t max_score_bytes = 0;
  cudaStream_t stream = nullptr;
  cublasHandle_t cublas = nullptr;
  GemmInput last_gemm_input = GemmInput::kF32;
  DeviceBuffer<float> keys;  // f32 keys, and 16-bit keys widened when the GEMM is f32's
  DeviceBuffer<float> queries;
  // Pinned host memory the keys and queries are packed into on their way up and the lists
  // come down through: the largest call's, kept for the next.
  std::byte* pinned = nullptr;
  size_t pinned_bytes = 0;
  // The keys and queries rounded to bf16 and to f16, and whether any lost bits (per type).
  DeviceBuffer<__nv_bfloat16> keys_bf16, queries_bf16;
  DeviceBuffer<__half> keys_f16, queries_f16;
  DeviceBuffer<unsigned int> inexact;
  DeviceBuffer<int32_t> ordered;
  DeviceBuffer<int32_t> support;
  DeviceBuffer<int32_t> support_size;
  DeviceBuffer<int32_t> lengths;
  DeviceBuffer<float> support_scores;
  std::unique_ptr<TopKWorkspace> ws;

  ~Impl() {
    if (cublas != nullptr) cublasDestroy(cublas);
    if (stream != nullptr) cudaStreamDestroy(stream);
    if (pinned != nullptr) cudaFreeHost(pinned);
  }

  absl::Status EnsurePinned(size_t bytes) {
    if (bytes <= pinned_bytes) return absl::OkStatus();
    if (pinned != nullptr) cudaFreeHost(pinned);
    pinned = nullptr;
    pinned_bytes = 0;
    void* p = nullptr;
    KVRECALL_CUDA_RETURN_IF_ERROR(CudaStatus(cudaHostAlloc(&p, bytes, cudaHostAllocDefault),
                                             absl::StrCat("allocating ", bytes, " pinned bytes")));
    pinned = static_cast<std::byte*>(p);
    pinned_bytes = bytes;
    return absl::OkStatus();
  }
};

GpuBatchTopK::GpuBatchTopK(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
GpuBatchTopK::~GpuBatchTopK() = default;

absl::StatusOr<std::unique_ptr<GpuBatchTopK>> GpuBatchTopK::Create(int64_t max_score_bytes) {
  if (max_score_bytes < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_score_bytes must be positive, got ", max_score_bytes));
  }
  auto impl = std::make_unique<Impl>();
  impl->max_score_bytes = max_score_bytes;
  KVRECALL_CUDA_RETURN_IF_ERROR(
      CudaStatus(cudaStreamCreateWithFlags(&impl->stream, cudaStreamNonBlocking),
                 "creating a stream"));
  KVRECALL_CUDA_RETURN_IF_ERROR(CublasStatus(cublasCreate(&impl->cublas), "cublasCreate"));
  KVRECALL_CUDA_RETURN_IF_ERROR(
      CublasStatus(cublasSetStream(impl->cublas, impl->stream), "cublasSetStream"));
  // Plain f32 arithmetic: TF32 would change which keys tie at the k-th place.
  KVRECALL_CUDA_RETURN_IF_ERROR(CublasStatus(
      cublasSetMathMode(impl->cublas, CUBLAS_PEDANTIC_MATH), "cublasSetMathMode"));
  return std::unique_ptr<GpuBatchTopK>(new GpuBatchTopK(std::move(impl)));
}

absl::Status GpuBatchTopK::Run(const VectorSet& queries, const VectorSet& keys, int k,
                               TopKLists* out, std::span<const int64_t> visible) {
  if (k < 1) return absl::InvalidArgumentError(absl::StrCat("top-k needs k >= 1, got ", k));
  if (queries.dim != keys.dim) {
    return absl::InvalidArgumentError(
        absl::StrCat("query dim ", queries.dim, " differs from key dim ", keys.dim));
  }
  if (keys.count > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat("top-k over ", keys.count, " keys: ids must fit in int32"));
  }
  if (!visible.empty() && static_cast<int64_t>(visible.size()) != queries.count) {
    return absl::InvalidArgumentError(absl::StrCat("causal mask of ", visible.size(),
                                                   " counts for ", queries.count, " queries"));
  }
  if (queries.element != KvElement::kF32) {
    return absl::InvalidArgumentError(absl::StrCat("queries must be f32, got ",
                                                   KvElementName(queries.element)));
  }
  out->k = static_cast<int>(std::min<int64_t>(k, keys.count));
  out->queries = queries.count;
  out->ids.assign(static_cast<size_t>(out->queries) * out->k, 0);
  if (out->k == 0 || queries.count == 0) return absl::OkStatus();
  Impl& m = *impl_;
  const int n = static_cast<int>(keys.count);
  const int dim = keys.dim;
  const int k_eff = out->k;
  const int64_t rows_per_block =
      std::clamp<int64_t>(m.max_score_bytes / (static_cast<int64_t>(n) * 4), 1,
                          std::min<int64_t>(queries.count, kMaxRowsPerLaunch));
  if (m.ws == nullptr || m.ws->max_rows() < rows_per_block || m.ws->max_tokens() < n) {
    const int max_rows = static_cast<int>(std::max<int64_t>(rows_per_block, m.ws ? m.ws->max_rows() : 0));
    const int max_tokens = std::max(n, m.ws ? m.ws->max_tokens() : 0);
    m.ws.reset();  // free before allocating the larger one
    absl::StatusOr<std::unique_ptr<TopKWorkspace>> ws = TopKWorkspace::Create(max_rows, max_tokens);
    if (!ws.ok()) return ws.status();
    m.ws = *std::move(ws);
  }
  const size_t lists = static_cast<size_t>(rows_per_block) * k_eff;
  const size_t key_values = static_cast<size_t>(n) * dim;
  const size_t query_values = static_cast<size_t>(queries.count) * dim;
  const bool f32_keys = keys.element == KvElement::kF32;
  const bool bf16_keys = keys.element == KvElement::kBf16;
  KVRECALL_CUDA_RETURN_IF_ERROR(Grow(lists, &m.support));
  KVRECALL_CUDA_RETURN_IF_ERROR(Grow(lists, &m.support_scores));
  KVRECALL_CUDA_RETURN_IF_ERROR(Grow(lists, &m.ordered));
  KVRECALL_CUDA_RETURN_IF_ERROR(Grow(static_cast<size_t>(rows_per_block), &m.support_size));
  KVRECALL_CUDA_RETURN_IF_ERROR(Grow(static_cast<size_t>(rows_per_block), &m.lengths));
  if (f32_keys) KVRECALL_CUDA_RETURN_IF_ERROR(Grow(key_values, &m.keys));
  KVRECALL_CUDA_RETURN_IF_ERROR(Grow(key_values, &m.keys_bf16));
  KVRECALL_CUDA_RETURN_IF_ERROR(Grow(key_values, &m.keys_f16));
  KVRECALL_CUDA_RETURN_IF_ERROR(Grow(query_values, &m.queries));
  KVRECALL_CUDA_RETURN_IF_ERROR(Grow(query_values, &m.queries_bf16));
  KVRECALL_CUDA_RETURN_IF_ERROR(Grow(query_values, &m.queries_f16));
  KVRECALL_CUDA_RETURN_IF_ERROR(Grow(size_t{2}, &m.inexact));
  // Pinned: the keys, the queries, then the lists (each region 256-byte aligned).
  auto aligned = [](size_t bytes) { return (bytes + 255) / 256 * 256; };
  const size_t key_row_bytes = static_cast<size_t>(dim) * KvElementBytes(keys.element);
  const size_t key_bytes = aligned(key_values * KvElementBytes(keys.element));
  const size_t query_bytes = aligned(query_values * sizeof(float));
  KVRECALL_CUDA_RETURN_IF_ERROR(m.EnsurePinned(key_bytes + query_bytes +
                                               out->ids.size() * sizeof(int32_t)));
  int32_t* pinned_ids = reinterpret_cast<int32_t*>(m.pinned + key_bytes + query_bytes);
  // 16-bit keys go up as they are, into their own type's buffer: they are exact in it.
  void* key_dst = f32_keys    ? static_cast<void*>(m.keys.data())
                  : bf16_keys ? static_cast<void*>(m.keys_bf16.data())
                              : static_cast<void*>(m.keys_f16.data());
  KVRECALL_CUDA_RETURN_IF_ERROR(UploadRows(keys.data, n,
                                           keys.stride * KvElementBytes(keys.element),
                                           key_row_bytes, m.pinned, key_dst, m.stream));
  KVRECALL_CUDA_RETURN_IF_ERROR(UploadRows(queries.data, queries.count,
                                           queries.stride * sizeof(float), dim * sizeof(float),
                                           m.pinned + key_bytes, m.queries.data(), m.stream));
  // Which GEMM: the narrowest type every key and query is exact in.
  KVRECALL_CUDA_RETURN_IF_ERROR(CudaStatus(
      cudaMemsetAsync(m.inexact.data(), 0, 2 * sizeof(unsigned int), m.stream), "zeroing flags"));
  if (f32_keys) {
    KVRECALL_CUDA_RETURN_IF_ERROR(ToSixteenBits(m.keys.data(), static_cast<int64_t>(key_values),
                                                m.keys_bf16.data(), m.keys_f16.data(),
                                                m.inexact.data(), m.stream));
  } else {
    const uint16_t* own = static_cast<const uint16_t*>(key_dst);
    uint16_t* other = bf16_keys ? reinterpret_cast<uint16_t*>(m.keys_f16.data())
                                : reinterpret_cast<uint16_t*>(m.keys_bf16.data());
    KVRECALL_CUDA_RETURN_IF_ERROR(OtherSixteenBits(own, static_cast<int64_t>(key_values),
                                                   bf16_keys, other, m.inexact.data(),
                                                   m.stream));
  }
  KVRECALL_CUDA_RETURN_IF_ERROR(
      ToSixteenBits(m.queries.data(), static_cast<int64_t>(query_values), m.queries_bf16.data(),
                    m.queries_f16.data(), m.inexact.data(), m.stream));
  unsigned int inexact[2] = {1, 1};
  KVRECALL_CUDA_RETURN_IF_ERROR(
      CudaStatus(cudaMemcpyAsync(inexact, m.inexact.data(), sizeof(inexact),
                                 cudaMemcpyDeviceToHost, m.stream),
                 "downloading the exactness flags"));
  KVRECALL_CUDA_RETURN_IF_ERROR(
      CudaStatus(cudaStreamSynchronize(m.stream), "converting to 16 bits"));
  const GemmInput gemm = !inexact[0]   ? GemmInput::kBf16
                         : !inexact[1] ? GemmInput::kF16
                                       : GemmInput::kF32;
  if (gemm == GemmInput::kF32 && !f32_keys) {
    KVRECALL_CUDA_RETURN_IF_ERROR(Grow(key_values, &m.keys));
    KVRECALL_CUDA_RETURN_IF_ERROR(Widen(static_cast<const uint16_t*>(key_dst),
                                        static_cast<int64_t>(key_values), bf16_keys,
                                        m.keys.data(), m.stream));
  }
  // Tensor cores for the 16-bit products (exact in f32, summed in f32); plain f32 otherwise
  // (TF32 would round the inputs).
  KVRECALL_CUDA_RETURN_IF_ERROR(CublasStatus(
      cublasSetMathMode(m.cublas,
                        gemm == GemmInput::kF32
                            ? CUBLAS_PEDANTIC_MATH
                            : static_cast<cublasMath_t>(
                                  CUBLAS_DEFAULT_MATH |
                                  CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)),
      "cublasSetMathMode"));

  std::vector<int32_t> lengths(rows_per_block);
  const float one = 1.0f, zero = 0.0f;
  const int64_t stride = m.ws->max_tokens();
  for (int64_t q0 = 0; q0 < queries.count; q0 += rows_per_block) {
    const int rows = static_cast<int>(std::min(rows_per_block, queries.count - q0));
    // Column-major view: scores^T [n, rows] (ld = stride) = keys [dim, n]^T * queries [dim, rows].
    cublasStatus_t gemm_status;
    if (gemm == GemmInput::kF32) {
      gemm_status = cublasSgemm(m.cublas, CUBLAS_OP_T, CUBLAS_OP_N, n, rows, dim, &one,
                                m.keys.data(), dim, m.queries.data() + q0 * dim, dim, &zero,
                                m.ws->scores(), static_cast<int>(stride));
    } else {
      const bool bf16 = gemm == GemmInput::kBf16;
      const cudaDataType_t type = bf16 ? CUDA_R_16BF : CUDA_R_16F;
      const void* key_data = bf16 ? static_cast<const void*>(m.keys_bf16.data())
                                  : static_cast<const void*>(m.keys_f16.data());
      const void* query_data =
          bf16 ? static_cast<const void*>(m.queries_bf16.data() + q0 * dim)
               : static_cast<const void*>(m.queries_f16.data() + q0 * dim);
      gemm_status = cublasGemmEx(m.cublas, CUBLAS_OP_T, CUBLAS_OP_N, n, rows, dim, &one,
                                 key_data, type, dim, query_data, type, dim, &zero,
                                 m.ws->scores(), CUDA_R_32F, static_cast<int>(stride),
                                 CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    }
    KVRECALL_CUDA_RETURN_IF_ERROR(CublasStatus(gemm_status, "scoring the queries"));
    if (!visible.empty()) {
      for (int r = 0; r < rows; ++r) {
        lengths[r] = static_cast<int32_t>(std::clamp<int64_t>(visible[q0 + r], 0, n));
      }
      KVRECALL_CUDA_RETURN_IF_ERROR(CudaStatus(
          cudaMemcpyAsync(m.lengths.data(), lengths.data(), rows * sizeof(int32_t),
                          cudaMemcpyHostToDevice, m.stream),
          "uploading the causal mask"));
    }
    KVRECALL_CUDA_RETURN_IF_ERROR(SelectRowTopK(
        m.ws->scores(), stride, rows, n, visible.empty() ? nullptr : m.lengths.data(), k_eff,
        m.ws.get(), m.support.data(), k_eff, m.support_size.data(), m.support_scores.data(),
        m.stream));
    // The GPU selects each list as a set; it orders them too, as the CPU backend does.
    KVRECALL_CUDA_RETURN_IF_ERROR(OrderRows(m.support.data(), m.support_scores.data(),
                                            m.support_size.data(), rows, k_eff,
                                            m.ordered.data(), m.stream));
    KVRECALL_CUDA_RETURN_IF_ERROR(CudaStatus(
        cudaMemcpyAsync(pinned_ids + q0 * k_eff, m.ordered.data(),
                        static_cast<size_t>(rows) * k_eff * sizeof(int32_t),
                        cudaMemcpyDeviceToHost, m.stream),
        "downloading top-k ids"));
  }
  KVRECALL_CUDA_RETURN_IF_ERROR(
      CudaStatus(cudaStreamSynchronize(m.stream), "running the batch top-k"));
  std::memcpy(out->ids.data(), pinned_ids, out->ids.size() * sizeof(int32_t));
  m.last_gemm_input = gemm;
  return absl::OkStatus();
}

absl::Status GpuBatchTopK::WarmUp() {
  constexpr int kKeys = 256, kQueries = 8, kDim = 128, kK = 4;
  const GemmInput last = impl_->last_gemm_input;
  // Values exact in bf16 (0.5, 0.25), in f16 but not bf16 (1 + 2^-9), in neither (1 + 2^-20).
  for (const float value : {0.5f, 1.0f + 0x1p-9f, 1.0f + 0x1p-20f}) {
    std::vector<float> keys(kKeys * kDim, value), queries(kQueries * kDim, 0.25f);
    for (int i = 0; i < kKeys; ++i) keys[i * kDim] = static_cast<float>(i % 16);
    TopKLists lists;
    const std::vector<int64_t> visible(kQueries, kKeys / 2);
    if (absl::Status s = Run(VectorSet{queries.data(), kQueries, kDim, kDim},
                             VectorSet{keys.data(), kKeys, kDim, kDim}, kK, &lists, visible);
        !s.ok()) {
      return s;
    }
  }
  // 16-bit keys travel in their own width.
  for (const KvElement element : {KvElement::kBf16, KvElement::kF16}) {
    const uint16_t half = element == KvElement::kBf16 ? 0x3F00 : 0x3800;  // 0.5
    std::vector<uint16_t> keys(kKeys * kDim, half);
    std::vector<float> queries(kQueries * kDim, 0.25f);
    TopKLists lists;
    if (absl::Status s = Run(VectorSet{queries.data(), kQueries, kDim, kDim},
                             VectorSet{keys.data(), kKeys, kDim, kDim, element}, kK, &lists);
        !s.ok()) {
      return s;
    }
  }
  impl_->last_gemm_input = last;
  return absl::OkStatus();
}

GpuBatchTopK::GemmInput GpuBatchTopK::last_gemm_input() const { return impl_->last_gemm_input; }

}  // namespace kvrecall::cuda
