// DeviceBuffer's contract with the non-blocking streams every kernel runs on: a zero-filled
// buffer reads as zeros there as soon as Zeroed returns, and a copy between device buffers is
// complete when CopyDeviceToDevice returns. Memory that cudaMalloc recycles holds its previous
// owner's bytes, so a zero fill still in flight on the legacy default stream (which
// non-blocking streams do not wait for) hands a kernel garbage counters. A buffer for overwrite
// (not filled) is device memory of its size.
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_buffer.h"
#include "tests/cuda_test_util.h"

namespace kvrecall::cuda {
namespace {

// *count += the words of [data, data + n) that differ from `expected`, read from the end: a
// fill or copy in flight writes from the start, so the end is the last to land.
__global__ void CountMismatches(const uint32_t* data, int64_t n, uint32_t expected,
                                unsigned long long* count) {
  unsigned long long local = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    local += data[n - 1 - i] != expected;
  }
  if (local != 0) atomicAdd(count, local);
}

// Large enough that a fill or copy takes far longer than a kernel launch (~0.2 ms at HBM speed).
constexpr int64_t kWords = int64_t{256} << 20;  // 1 GiB

class DeviceBufferTest : public ::testing::Test {
 protected:
  void SetUp() override {
    KVRECALL_SKIP_WITHOUT_GPU();
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
    absl::StatusOr<DeviceBuffer<unsigned long long>> count =
        DeviceBuffer<unsigned long long>::Zeroed(1);
    ASSERT_TRUE(count.ok()) << count.status();
    count_ = *std::move(count);
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  // The mismatching words of `data`, counted by a kernel launched on the non-blocking stream
  // right away: nothing orders it after work on the legacy default stream.
  unsigned long long MismatchesSeenOnTheStream(const uint32_t* data, uint32_t expected) {
    EXPECT_EQ(cudaMemsetAsync(count_.data(), 0, sizeof(unsigned long long), stream_),
              cudaSuccess);
    CountMismatches<<<1024, 256, 0, stream_>>>(data, kWords, expected, count_.data());
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
    unsigned long long mismatches = 0;
    EXPECT_EQ(cudaMemcpyAsync(&mismatches, count_.data(), sizeof(mismatches),
                              cudaMemcpyDeviceToHost, stream_),
              cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    return mismatches;
  }

  cudaStream_t stream_ = nullptr;
  DeviceBuffer<unsigned long long> count_;
};

TEST_F(DeviceBufferTest, AZeroedBufferReadsAsZerosOnANonBlockingStreamAtOnce) {
  for (int round = 0; round < 8; ++round) {
    {
      // Dirty memory for cudaMalloc to hand out again.
      absl::StatusOr<DeviceBuffer<uint32_t>> dirty = DeviceBuffer<uint32_t>::Zeroed(kWords);
      ASSERT_TRUE(dirty.ok()) << dirty.status();
      ASSERT_EQ(cudaMemset(dirty->data(), 0xff, dirty->bytes()), cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    }
    absl::StatusOr<DeviceBuffer<uint32_t>> fresh = DeviceBuffer<uint32_t>::Zeroed(kWords);
    ASSERT_TRUE(fresh.ok()) << fresh.status();
    EXPECT_EQ(MismatchesSeenOnTheStream(fresh->data(), 0u), 0u) << "round " << round;
  }
}

TEST_F(DeviceBufferTest, ACopyBetweenDeviceBuffersIsCompleteWhenItReturns) {
  absl::StatusOr<DeviceBuffer<uint32_t>> src = DeviceBuffer<uint32_t>::Zeroed(kWords);
  absl::StatusOr<DeviceBuffer<uint32_t>> dst = DeviceBuffer<uint32_t>::Zeroed(kWords);
  ASSERT_TRUE(src.ok() && dst.ok());
  ASSERT_EQ(cudaMemset(src->data(), 0x5a, src->bytes()), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (int round = 0; round < 8; ++round) {
    ASSERT_EQ(cudaMemset(dst->data(), 0, dst->bytes()), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const absl::Status copied = CopyDeviceToDevice(dst->data(), src->data(), src->bytes(),
                                                   "copying the test buffer");
    ASSERT_TRUE(copied.ok()) << copied;
    EXPECT_EQ(MismatchesSeenOnTheStream(dst->data(), 0x5a5a5a5au), 0u) << "round " << round;
  }
}

TEST_F(DeviceBufferTest, AnUploadFromPageableMemoryIsCompleteWhenItReturns) {
  absl::StatusOr<DeviceBuffer<uint32_t>> dst = DeviceBuffer<uint32_t>::Zeroed(kWords);
  ASSERT_TRUE(dst.ok());
  const std::vector<uint32_t> host(kWords, 0x13572468u);
  for (int round = 0; round < 4; ++round) {
    ASSERT_EQ(cudaMemset(dst->data(), 0, dst->bytes()), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const absl::Status copied = CopyToDevice(dst->data(), host.data(), dst->bytes(),
                                             "uploading the test buffer");
    ASSERT_TRUE(copied.ok()) << copied;
    EXPECT_EQ(MismatchesSeenOnTheStream(dst->data(), 0x13572468u), 0u) << "round " << round;
  }
}

// A buffer for overwrite is device memory of the size asked for and holds what a copy writes;
// none for zero elements.
TEST_F(DeviceBufferTest, ABufferForOverwriteIsDeviceMemoryOfItsSize) {
  absl::StatusOr<DeviceBuffer<uint32_t>> none = DeviceBuffer<uint32_t>::ForOverwrite(0);
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ(none->data(), nullptr);
  EXPECT_EQ(none->size(), 0u);
  constexpr size_t kCount = 1000;
  absl::StatusOr<DeviceBuffer<uint32_t>> staging = DeviceBuffer<uint32_t>::ForOverwrite(kCount);
  ASSERT_TRUE(staging.ok()) << staging.status();
  EXPECT_EQ(staging->size(), kCount);
  EXPECT_EQ(staging->bytes(), kCount * sizeof(uint32_t));
  cudaPointerAttributes attributes;
  ASSERT_EQ(cudaPointerGetAttributes(&attributes, staging->data()), cudaSuccess);
  EXPECT_EQ(attributes.type, cudaMemoryTypeDevice);
  std::vector<uint32_t> host(kCount);
  for (size_t i = 0; i < kCount; ++i) host[i] = static_cast<uint32_t>(i * 2654435761u);
  ASSERT_TRUE(CopyToDevice(staging->data(), host.data(), staging->bytes(), "staging").ok());
  std::vector<uint32_t> back(kCount);
  ASSERT_EQ(cudaMemcpy(back.data(), staging->data(), staging->bytes(), cudaMemcpyDeviceToHost),
            cudaSuccess);
  EXPECT_EQ(back, host);
}

}  // namespace
}  // namespace kvrecall::cuda
