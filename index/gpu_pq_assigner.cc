#include "index/gpu_pq_assigner.h"

#include <cuda_runtime_api.h>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/pq_encode.h"
#include "kernels/cuda/pq_shortlist.h"

namespace kvrecall {

int64_t GpuPqAssigner::DeviceBytesFor(int64_t max_rows, int dim) {
  if (max_rows < 1 || dim < 1) return 0;
  return max_rows * dim * static_cast<int64_t>(sizeof(float)) +
         int64_t{ProductQuantizer::kCentroids} * dim * static_cast<int64_t>(sizeof(float)) +
         max_rows * cuda::kMaxPqSubspaces;
}

absl::StatusOr<std::unique_ptr<GpuPqAssigner>> GpuPqAssigner::Create(int64_t max_rows, int dim) {
  if (max_rows < 1 || dim < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a GPU PQ assigner needs max_rows >= 1 and dim >= 1, got ", max_rows, " and ", dim));
  }
  std::unique_ptr<GpuPqAssigner> assigner(new GpuPqAssigner());
  assigner->max_rows_ = max_rows;
  assigner->dim_ = dim;
  auto rows = cuda::DeviceBuffer<float>::Zeroed(max_rows * dim);
  if (!rows.ok()) return rows.status();
  auto books = cuda::DeviceBuffer<float>::Zeroed(int64_t{ProductQuantizer::kCentroids} * dim);
  if (!books.ok()) return books.status();
  auto codes = cuda::DeviceBuffer<uint8_t>::Zeroed(max_rows * cuda::kMaxPqSubspaces);
  if (!codes.ok()) return codes.status();
  assigner->rows_ = *std::move(rows);
  assigner->books_ = *std::move(books);
  assigner->codes_ = *std::move(codes);
  return assigner;
}

absl::Status GpuPqAssigner::Load(const float* rows, int64_t count, int dim) {
  if (count < 0 || count > max_rows_ || dim != dim_) {
    return absl::InvalidArgumentError(
        absl::StrCat("the GPU PQ assigner has room for ", max_rows_, " rows of ", dim_,
                     " dims; got ", count, " rows of ", dim));
  }
  count_ = count;
  if (count == 0) return absl::OkStatus();
  return cuda::CudaStatus(cudaMemcpy(rows_.data(), rows, count * dim * sizeof(float),
                                     cudaMemcpyHostToDevice),
                          "uploading the PQ training rows");
}

absl::Status GpuPqAssigner::Assign(std::span<const float> codebooks, int subspaces,
                                   uint8_t* codes) {
  if (static_cast<int64_t>(codebooks.size()) != int64_t{ProductQuantizer::kCentroids} * dim_) {
    return absl::InvalidArgumentError(
        absl::StrCat("codebooks of ", codebooks.size(), " floats for keys of ", dim_, " dims"));
  }
  if (count_ == 0) return absl::OkStatus();
  KVRECALL_CUDA_RETURN_IF_ERROR(
      cuda::CudaStatus(cudaMemcpy(books_.data(), codebooks.data(),
                                  codebooks.size() * sizeof(float), cudaMemcpyHostToDevice),
                       "uploading the PQ codebooks"));
  cuda::PqEncodeParams p;
  p.keys = rows_.data();
  p.element = KvElement::kF32;
  p.count = count_;
  p.row_stride = dim_;
  p.dim = dim_;
  p.subspaces = subspaces;
  p.codebooks = books_.data();
  p.codes = codes_.data();
  if (absl::Status s = cuda::PqEncode(p, nullptr); !s.ok()) return s;
  return cuda::CudaStatus(cudaMemcpy(codes, codes_.data(), count_ * subspaces,
                                     cudaMemcpyDeviceToHost),
                          "downloading the PQ training codes");
}

}  // namespace kvrecall
