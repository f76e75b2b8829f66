#include "kernels/cuda/batch_topk.h"

#include <cublas_v2.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <limits>
#include <numeric>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/topk_workspace.h"

namespace kvrecall::cuda {
namespace {

// The grid's second dimension carries the rows of a selection launch.
constexpr int64_t kMaxRowsPerLaunch = 65535;

// Copies `count` strided f32 vectors of `dim` into a packed [count, dim] device buffer, growing
// it when needed.
absl::Status UploadPacked(const float* src, int64_t count, int64_t stride, int dim,
                          DeviceBuffer<float>* dst, cudaStream_t stream) {
  const size_t need = static_cast<size_t>(count) * dim;
  if (dst->size() < need) KVRECALL_CUDA_RETURN_IF_ERROR(AllocateZeroed(need, dst));
  return CudaStatus(cudaMemcpy2DAsync(dst->data(), dim * sizeof(float), src,
                                      stride * sizeof(float), dim * sizeof(float), count,
                                      cudaMemcpyHostToDevice, stream),
                    "uploading vectors");
}

template <typename T>
absl::Status Grow(size_t count, DeviceBuffer<T>* buffer) {
  return buffer->size() >= count ? absl::OkStatus() : AllocateZeroed(count, buffer);
}

// out[i] = in[i] widened to f32, for n 16-bit elements (bf16 when `bf16`, else f16).
__global__ void WidenKernel(const uint16_t* in, int64_t n, bool bf16, float* out) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    out[i] = bf16 ? __uint_as_float(static_cast<uint32_t>(in[i]) << 16)
                  : __half2float(__ushort_as_half(in[i]));
  }
}

// The keys as a packed [count, dim] f32 device buffer: f32 keys are copied as they are; 16-bit
// keys travel in their own width (half the bytes) into `staging` and are widened on the device.
absl::Status UploadKeys(const VectorSet& keys, DeviceBuffer<uint16_t>* staging,
                        DeviceBuffer<float>* dst, cudaStream_t stream) {
  if (keys.element == KvElement::kF32) {
    return UploadPacked(static_cast<const float*>(keys.data), keys.count, keys.stride, keys.dim,
                        dst, stream);
  }
  const size_t need = static_cast<size_t>(keys.count) * keys.dim;
  if (dst->size() < need) KVRECALL_CUDA_RETURN_IF_ERROR(AllocateZeroed(need, dst));
  if (staging->size() < need) KVRECALL_CUDA_RETURN_IF_ERROR(AllocateZeroed(need, staging));
  KVRECALL_CUDA_RETURN_IF_ERROR(CudaStatus(
      cudaMemcpy2DAsync(staging->data(), keys.dim * sizeof(uint16_t), keys.data,
                        keys.stride * sizeof(uint16_t), keys.dim * sizeof(uint16_t), keys.count,
                        cudaMemcpyHostToDevice, stream),
      "uploading keys"));
  const int blocks = static_cast<int>(std::min<int64_t>((need + 255) / 256, 4096));
  WidenKernel<<<blocks, 256, 0, stream>>>(staging->data(), static_cast<int64_t>(need),
                                          keys.element == KvElement::kBf16, dst->data());
  return CudaStatus(cudaGetLastError(), "widening keys");
}

}  // namespace

struct GpuBatchTopK::Impl {
  int64_t max_score_bytes = 0;
  cudaStream_t stream = nullptr;
  cublasHandle_t cublas = nullptr;
  DeviceBuffer<float> keys;
  DeviceBuffer<uint16_t> key_staging;  // 16-bit keys before widening
  DeviceBuffer<float> queries;
  DeviceBuffer<int32_t> support;
  DeviceBuffer<int32_t> support_size;
  DeviceBuffer<int32_t> lengths;
  DeviceBuffer<float> support_scores;
  std::unique_ptr<TopKWorkspace> ws;

  ~Impl() {
    if (cublas != nullptr) cublasDestroy(cublas);
    if (stream != nullptr) cudaStreamDestroy(stream);
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
  KVRECALL_CUDA_RETURN_IF_ERROR(Grow(lists, &m.support));
  KVRECALL_CUDA_RETURN_IF_ERROR(Grow(lists, &m.support_scores));
  KVRECALL_CUDA_RETURN_IF_ERROR(Grow(static_cast<size_t>(rows_per_block), &m.support_size));
  KVRECALL_CUDA_RETURN_IF_ERROR(Grow(static_cast<size_t>(rows_per_block), &m.lengths));
  KVRECALL_CUDA_RETURN_IF_ERROR(UploadKeys(keys, &m.key_staging, &m.keys, m.stream));

  std::vector<int32_t> ids(lists), sizes(rows_per_block), lengths(rows_per_block);
  std::vector<float> scores(lists);
  std::vector<int32_t> order(k_eff);
  const float one = 1.0f, zero = 0.0f;
  const int64_t stride = m.ws->max_tokens();
  for (int64_t q0 = 0; q0 < queries.count; q0 += rows_per_block) {
    const int rows = static_cast<int>(std::min(rows_per_block, queries.count - q0));
    KVRECALL_CUDA_RETURN_IF_ERROR(UploadPacked(queries.row(q0), rows, queries.stride, dim,
                                               &m.queries, m.stream));
    // Column-major view: scores^T [n, rows] (ld = stride) = keys [dim, n]^T * queries [dim, rows].
    KVRECALL_CUDA_RETURN_IF_ERROR(CublasStatus(
        cublasSgemm(m.cublas, CUBLAS_OP_T, CUBLAS_OP_N, n, rows, dim, &one, m.keys.data(), dim,
                    m.queries.data(), dim, &zero, m.ws->scores(), static_cast<int>(stride)),
        "cublasSgemm"));
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
    const size_t got = static_cast<size_t>(rows) * k_eff;
    KVRECALL_CUDA_RETURN_IF_ERROR(CudaStatus(
        cudaMemcpyAsync(ids.data(), m.support.data(), got * sizeof(int32_t),
                        cudaMemcpyDeviceToHost, m.stream),
        "downloading top-k ids"));
    KVRECALL_CUDA_RETURN_IF_ERROR(CudaStatus(
        cudaMemcpyAsync(scores.data(), m.support_scores.data(), got * sizeof(float),
                        cudaMemcpyDeviceToHost, m.stream),
        "downloading top-k scores"));
    KVRECALL_CUDA_RETURN_IF_ERROR(CudaStatus(
        cudaMemcpyAsync(sizes.data(), m.support_size.data(), rows * sizeof(int32_t),
                        cudaMemcpyDeviceToHost, m.stream),
        "downloading top-k sizes"));
    KVRECALL_CUDA_RETURN_IF_ERROR(
        CudaStatus(cudaStreamSynchronize(m.stream), "running the batch top-k"));
    // The GPU returns each list as a set; order it as the CPU backend does, pad with -1.
    for (int r = 0; r < rows; ++r) {
      const int32_t* row_ids = ids.data() + static_cast<size_t>(r) * k_eff;
      const float* row_scores = scores.data() + static_cast<size_t>(r) * k_eff;
      const int size = sizes[r];
      std::iota(order.begin(), order.begin() + size, 0);
      std::sort(order.begin(), order.begin() + size, [&](int a, int b) {
        return row_scores[a] > row_scores[b] ||
               (row_scores[a] == row_scores[b] && row_ids[a] < row_ids[b]);
      });
      int32_t* dst = out->ids.data() + static_cast<size_t>(q0 + r) * k_eff;
      for (int j = 0; j < k_eff; ++j) dst[j] = j < size ? row_ids[order[j]] : -1;
    }
  }
  return absl::OkStatus();
}

}  // namespace kvrecall::cuda
