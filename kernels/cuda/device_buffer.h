// An owning handle to device memory, so workspaces and caches are allocated once, up front,
// and freed with their owner.
#ifndef KVRECALL_KERNELS_CUDA_DEVICE_BUFFER_H_
#define KVRECALL_KERNELS_CUDA_DEVICE_BUFFER_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_status.h"

namespace kvrecall::cuda {

// `count` elements of T in device memory, zero-filled at allocation (workspaces rely on it:
// their counters and histograms start at zero and every step leaves them at zero again).
template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), count_(std::exchange(other.count_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    if (this != &other) {
      Release();
      data_ = std::exchange(other.data_, nullptr);
      count_ = std::exchange(other.count_, 0);
    }
    return *this;
  }
  ~DeviceBuffer() { Release(); }

  static absl::StatusOr<DeviceBuffer> Zeroed(size_t count) {
    DeviceBuffer buffer;
    if (count == 0) return buffer;
    void* ptr = nullptr;
    KVRECALL_CUDA_RETURN_IF_ERROR(CudaStatus(
        cudaMalloc(&ptr, count * sizeof(T)), absl::StrCat("allocating ", count * sizeof(T),
                                                          " device bytes")));
    buffer.data_ = static_cast<T*>(ptr);
    buffer.count_ = count;
    KVRECALL_CUDA_RETURN_IF_ERROR(
        CudaStatus(cudaMemset(ptr, 0, count * sizeof(T)), "zeroing a device buffer"));
    return buffer;
  }

  T* data() const { return data_; }
  size_t size() const { return count_; }
  size_t bytes() const { return count_ * sizeof(T); }

 private:
  void Release() {
    if (data_ != nullptr) cudaFree(data_);
    data_ = nullptr;
    count_ = 0;
  }

  T* data_ = nullptr;
  size_t count_ = 0;
};

// *buffer = `count` zeroed elements, the previous contents freed.
template <typename T>
absl::Status AllocateZeroed(size_t count, DeviceBuffer<T>* buffer) {
  absl::StatusOr<DeviceBuffer<T>> fresh = DeviceBuffer<T>::Zeroed(count);
  if (!fresh.ok()) return fresh.status();
  *buffer = *std::move(fresh);
  return absl::OkStatus();
}

}  // namespace kvrecall::cuda

#endif  // KVRECALL_KERNELS_CUDA_DEVICE_BUFFER_H_
