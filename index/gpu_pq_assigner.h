// Product-quantizer training's assignment step on a CUDA device: a PqAssigner
// (index/product_quantizer.h) backed by kernels/cuda/pq_encode.h, so that a layer's quantizers
// train in milliseconds rather than in most of its build. Built only with KVRECALL_WITH_CUDA.
#ifndef KVRECALL_INDEX_GPU_PQ_ASSIGNER_H_
#define KVRECALL_INDEX_GPU_PQ_ASSIGNER_H_

#include <cstdint>
#include <memory>
#include <span>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "index/product_quantizer.h"
#include "kernels/cuda/device_buffer.h"

namespace kvrecall {

// On the current device: the training rows go up once (Load), each round's codebooks go up and
// the codes come down (Assign), both synchronously on the default stream. One training at a
// time; reusable for the next (a Load replaces the rows).
class GpuPqAssigner final : public PqAssigner {
 public:
  // Room for up to `max_rows` rows of `dim` dims (f32) and their codes of up to
  // cuda::kMaxPqSubspaces bytes. INVALID_ARGUMENT for max_rows < 1 or dim < 1; CUDA's errors
  // (no device, out of memory) as they come.
  static absl::StatusOr<std::unique_ptr<GpuPqAssigner>> Create(int64_t max_rows, int dim);
  // Device bytes Create(max_rows, dim) allocates, so that a caller can charge its budget first.
  static int64_t DeviceBytesFor(int64_t max_rows, int dim);

  // INVALID_ARGUMENT beyond the room Create made.
  absl::Status Load(const float* rows, int64_t count, int dim) override;
  // INVALID_ARGUMENT for codebooks that are not [M, 256, dim / M] of the loaded dim, or an M
  // cuda::PqEncode does not take.
  absl::Status Assign(std::span<const float> codebooks, int subspaces, uint8_t* codes) override;

 private:
  GpuPqAssigner() = default;
  int64_t max_rows_ = 0;
  int dim_ = 0;
  int64_t count_ = 0;
  cuda::DeviceBuffer<float> rows_;      // [max_rows, dim]
  cuda::DeviceBuffer<float> books_;     // [256 * dim]
  cuda::DeviceBuffer<uint8_t> codes_;   // [max_rows, kMaxPqSubspaces]
};

}  // namespace kvrecall

#endif  // KVRECALL_INDEX_GPU_PQ_ASSIGNER_H_
