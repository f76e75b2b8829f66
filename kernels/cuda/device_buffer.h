// An owning handle to device memory, so workspaces and caches are allocated once, up front,
// and freed with their owner.
#ifndef KVRECALL_KERNELS_CUDA_DEVICE_BUFFER_H_
#define KVRECALL_KERNELS_CUDA_DEVICE_BUFFER_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "kernels/cuda/cuda_status.h"

namespace kvrecall::cuda {

// Waits for the work queued on the legacy default stream. cudaMemset, and cudaMemcpy between
// device buffers or from pageable host memory, return before the device is done, on that
// stream; the kernels run on non-blocking streams, which do not wait for it. A buffer that
// cudaMalloc recycled holds its previous owner's bytes until the fill lands, and a kernel that
// reads its counters and histograms before then walks off its buffers (the likely cause of a
// 1M-token seeding fault seen once, only in a server that had freed sessions before). So every
// fill and copy below waits here.
inline absl::Status WaitForLegacyStream(absl::string_view what) {
  return CudaStatus(cudaStreamSynchronize(cudaStreamLegacy), what);
}

// `count` elements of T in device memory: zero-filled at allocation by Zeroed (workspaces rely
// on it: their counters and histograms start at zero and every step leaves them at zero again;
// the zeros are in place, for every stream, when Zeroed returns), or left unfilled by
// ForOverwrite for staging that is written in full before it is read.
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
    absl::StatusOr<DeviceBuffer> buffer = ForOverwrite(count);
    if (!buffer.ok() || count == 0) return buffer;
    KVRECALL_CUDA_RETURN_IF_ERROR(
        CudaStatus(cudaMemset(buffer->data(), 0, buffer->bytes()), "zeroing a device buffer"));
    KVRECALL_CUDA_RETURN_IF_ERROR(WaitForLegacyStream("zeroing a device buffer"));
    return buffer;
  }

  // `count` elements left as cudaMalloc gives them (a recycled block's old bytes), for a buffer
  // whose every element is written before any is read, the writes ordered before the reads
  // (the same stream, or a wait): staging that a copy or a kernel fills. Saves Zeroed's fill and
  // its wait for the legacy stream (~50 us for a MB; a take-over's coding stages its rows on
  // the step's path).
  static absl::StatusOr<DeviceBuffer> ForOverwrite(size_t count) {
    DeviceBuffer buffer;
    if (count == 0) return buffer;
    void* ptr = nullptr;
    KVRECALL_CUDA_RETURN_IF_ERROR(CudaStatus(
        cudaMalloc(&ptr, count * sizeof(T)), absl::StrCat("allocating ", count * sizeof(T),
                                                          " device bytes")));
    buffer.data_ = static_cast<T*>(ptr);
    buffer.count_ = count;
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

// Copies `bytes` from one device buffer to another; the copy is complete, for every stream,
// when it returns.
inline absl::Status CopyDeviceToDevice(void* dst, const void* src, size_t bytes,
                                       absl::string_view what) {
  KVRECALL_CUDA_RETURN_IF_ERROR(
      CudaStatus(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToDevice), what));
  return WaitForLegacyStream(what);
}

// Copies `bytes` from host memory (pageable or pinned) to device memory; the copy is complete,
// for every stream, when it returns.
inline absl::Status CopyToDevice(void* dst, const void* src, size_t bytes,
                                 absl::string_view what) {
  KVRECALL_CUDA_RETURN_IF_ERROR(
      CudaStatus(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), what));
  return WaitForLegacyStream(what);
}

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
