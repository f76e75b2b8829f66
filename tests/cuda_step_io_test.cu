// The step I/O kernels (kernels/cuda/step_io.h) on the device: copies by kernel between pinned
// host and device memory of every size class (under a vector, vectors and a tail, many blocks'
// worth) equal their source byte for byte; inside a captured graph they read their source when
// the graph runs, not when it was captured; a published copy's bytes are on the host once its
// flag is, without a stream call, launch after launch of a captured graph; stamps are one
// reading of a clock that advances, written to every place; misfits refused by name.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cuda/step_io.h"
#include "tests/cuda_test_util.h"

namespace kvrecall {
namespace {

using ::kvrecall::testing::ToDevice;
using ::kvrecall::testing::ToHost;
using ::testing::HasSubstr;

// Pinned host memory, as the server's step buffers are.
class Pinned {
 public:
  explicit Pinned(size_t bytes) {
    EXPECT_EQ(cudaHostAlloc(reinterpret_cast<void**>(&data_), bytes, cudaHostAllocDefault),
              cudaSuccess);
  }
  ~Pinned() { cudaFreeHost(data_); }
  unsigned char* data() const { return data_; }

 private:
  unsigned char* data_ = nullptr;
};

TEST(StepIoTest, CopiesByKernelEqualTheirSourceAtEverySize) {
  KVRECALL_SKIP_WITHOUT_GPU();
  for (size_t bytes : {size_t{1}, size_t{15}, size_t{16}, size_t{17}, size_t{4096 + 5},
                       size_t{33} << 10, (size_t{1} << 21) + 3}) {
    SCOPED_TRACE(bytes);
    Pinned in(bytes), out(bytes);
    for (size_t i = 0; i < bytes; ++i) in.data()[i] = static_cast<unsigned char>(i * 131 + 7);
    std::fill_n(out.data(), bytes, 0);
    auto device = ToDevice(std::vector<unsigned char>(bytes + 16, 0xee));
    ASSERT_TRUE(cuda::CopyByKernel(in.data(), device.data(), bytes, nullptr).ok());
    ASSERT_TRUE(cuda::CopyByKernel(device.data(), out.data(), bytes, nullptr).ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ASSERT_TRUE(std::equal(in.data(), in.data() + bytes, out.data())) << "round trip";
    const std::vector<unsigned char> whole = ToHost(device.data(), bytes + 16);
    for (size_t i = bytes; i < bytes + 16; ++i) ASSERT_EQ(whole[i], 0xee) << "past the end, " << i;
  }
}

TEST(StepIoTest, ACapturedCopyReadsItsSourceWhenTheGraphRuns) {
  KVRECALL_SKIP_WITHOUT_GPU();
  constexpr size_t kBytes = 1000;
  Pinned in(kBytes), out(kBytes);
  auto device = ToDevice(std::vector<unsigned char>(kBytes, 0));
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  const bool queued = cuda::CopyByKernel(in.data(), device.data(), kBytes, stream).ok() &&
                      cuda::CopyByKernel(device.data(), out.data(), kBytes, stream).ok();
  cudaGraph_t graph;
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_TRUE(queued);
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (int round = 1; round <= 3; ++round) {
    std::fill_n(in.data(), kBytes, static_cast<unsigned char>(round));
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    EXPECT_EQ(out.data()[0], round);
    EXPECT_EQ(out.data()[kBytes - 1], round);
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// Polls the flag as the server's WaitShortlists does, for at most 5 s.
bool FlagRaised(const uint64_t* flag) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (__atomic_load_n(flag, __ATOMIC_ACQUIRE) == 0) {
    if (std::chrono::steady_clock::now() > end) return false;
  }
  return true;
}

TEST(StepIoTest, APublishedCopyIsOnTheHostOnceItsFlagIs) {
  KVRECALL_SKIP_WITHOUT_GPU();
  auto counter = ToDevice(std::vector<unsigned>{0});
  Pinned flag_memory(16);
  auto* flag = reinterpret_cast<uint64_t*>(flag_memory.data());
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  // One block, many blocks (a step's ids at batch 8 and more), and the flag alone.
  for (size_t bytes : {size_t{17}, (size_t{132} << 10) + 4, (size_t{2} << 20) + 3, size_t{0}}) {
    SCOPED_TRACE(bytes);
    Pinned out(bytes + 16);
    std::vector<unsigned char> source(bytes + 16);
    auto device = ToDevice(source);
    // Captured, then launched three times with other bytes: the count starts at 0 every time.
    cudaGraph_t graph;
    ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    const absl::Status queued =
        cuda::PublishToHost(device.data(), out.data(), bytes, counter.data(), flag, stream);
    ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
    ASSERT_TRUE(queued.ok()) << queued;
    cudaGraphExec_t exec;
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    for (int round = 1; round <= 3; ++round) {
      for (size_t i = 0; i < bytes; ++i) source[i] = static_cast<unsigned char>(i * 7 + round);
      ASSERT_EQ(cudaMemcpy(device.data(), source.data(), bytes, cudaMemcpyHostToDevice),
                cudaSuccess);
      std::fill_n(out.data(), bytes, 0);
      __atomic_store_n(flag, 0, __ATOMIC_RELEASE);
      ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
      ASSERT_TRUE(FlagRaised(flag)) << "round " << round;
      // Read before any stream call: the flag alone says the bytes are here.
      ASSERT_TRUE(std::equal(source.begin(), source.begin() + bytes, out.data()))
          << "round " << round;
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
  EXPECT_EQ(cuda::PublishToHost(flag, flag, 8, nullptr, flag, stream).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cuda::PublishToHost(flag, flag, 8, counter.data(), nullptr, stream).code(),
            absl::StatusCode::kInvalidArgument);
  cudaStreamDestroy(stream);
}

__global__ void SpinKernel(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

TEST(StepIoTest, StampsAreOneReadingOfAClockThatAdvances) {
  KVRECALL_SKIP_WITHOUT_GPU();
  Pinned host(16);
  auto device = ToDevice(std::vector<uint64_t>(2, 0));
  auto* pinned = reinterpret_cast<uint64_t*>(host.data());
  pinned[0] = pinned[1] = 0;
  ASSERT_TRUE(cuda::StampTime({device.data(), pinned}, nullptr).ok());
  SpinKernel<<<1, 1>>>(2'000'000);  // ~1 ms at the H200's clock
  ASSERT_TRUE(cuda::StampTime({device.data() + 1}, nullptr).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<uint64_t> stamps = ToHost(device.data(), 2);
  EXPECT_NE(stamps[0], 0u);
  EXPECT_EQ(pinned[0], stamps[0]) << "one reading, every place";
  EXPECT_GT(stamps[1], stamps[0] + 100'000) << "nanoseconds: the spin took well over 0.1 ms";
}

TEST(StepIoTest, MisfitsAreRefusedByName) {
  KVRECALL_SKIP_WITHOUT_GPU();
  auto device = ToDevice(std::vector<uint64_t>(8, 0));
  auto* bytes = reinterpret_cast<unsigned char*>(device.data());
  const absl::Status misaligned = cuda::CopyByKernel(bytes + 4, bytes + 32, 8, nullptr);
  EXPECT_EQ(misaligned.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(misaligned.message()), HasSubstr("the source at 4"));
  EXPECT_EQ(cuda::CopyByKernel(nullptr, bytes, 8, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(cuda::CopyByKernel(nullptr, nullptr, 0, nullptr).ok()) << "nothing to copy";
  uint64_t* p = device.data();
  EXPECT_EQ(cuda::StampTime({}, nullptr).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cuda::StampTime({p, p, p, p, p}, nullptr).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cuda::StampTime({p, nullptr}, nullptr).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

}  // namespace
}  // namespace kvrecall
