// The step I/O kernels (kernels/cuda/step_io.h) on the device: copies by kernel between pinned
// host and device memory of every size class (under a vector, vectors and a tail, many blocks'
// worth) equal their source byte for byte; inside a captured graph they read their source when
// the graph runs, not when it was captured; a published copy's bytes are on the host once its
// flag is, without a stream call, launch after launch of a captured graph; words the host gives
// a running captured step after its launch reach the device, each launch its own, and a wait for
// words that never come ends at its timeout with the fill and the error bit; stamps are one
// reading of a clock that advances, written to every place; misfits refused by name.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cuda/kernel_errors.h"
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
      // (Landed before the launch: a pageable cudaMemcpy may return before its bytes are on the
      // device, and `stream` does not wait for the legacy stream: d151 once found other bytes.)
      const absl::Status copied = cuda::CopyToDevice(device.data(), source.data(), bytes, "source");
      ASSERT_TRUE(copied.ok()) << copied;
      std::fill_n(out.data(), bytes + 16, 0xee);
      __atomic_store_n(flag, 0, __ATOMIC_RELEASE);
      ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
      ASSERT_TRUE(FlagRaised(flag)) << "round " << round;
      // Read before any stream call: the flag alone says the bytes are here.
      ASSERT_TRUE(std::equal(source.begin(), source.begin() + bytes, out.data()))
          << "round " << round;
      ASSERT_TRUE(std::all_of(out.data() + bytes, out.data() + bytes + 16,
                              [](unsigned char b) { return b == 0xee; }))
          << "round " << round << ": nothing past the bytes (the server's flag lies there)";
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
  cudaStreamDestroy(stream);
}

__global__ void SpinKernel(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

// The server's exact heads: a captured step waits for rows the host writes only after the launch
// (while the step's earlier kernels run), a new number each launch.
TEST(StepIoTest, WordsTheHostGivesAfterTheLaunchReachTheStep) {
  KVRECALL_SKIP_WITHOUT_GPU();
  constexpr int kWords = 300;  // more than a block's threads
  Pinned host(16 + kWords * sizeof(int32_t));
  auto* ready = reinterpret_cast<uint64_t*>(host.data());
  auto* words = reinterpret_cast<int32_t*>(host.data() + 16);
  *ready = 0;
  Pinned expected_memory(16);
  auto* expected_host = reinterpret_cast<uint64_t*>(expected_memory.data());
  auto expected = ToDevice(std::vector<uint64_t>{0});
  auto dst = ToDevice(std::vector<int32_t>(kWords + 4, 0));
  auto stamp = ToDevice(std::vector<uint64_t>{0, 0});
  absl::StatusOr<cuda::KernelErrors> errors = cuda::KernelErrors::Create();
  ASSERT_TRUE(errors.ok()) << errors.status();
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  cuda::HostWords w;
  w.ready = ready;
  w.expected = expected.data();
  w.words = words;
  w.dst = dst.data();
  w.count = kWords;
  w.timeout_ns = 5'000'000'000;
  w.error_word = errors->device_word();
  w.stamp = stamp.data() + 1;
  // The graph: the expected number up (as the step's upload), ~1 ms of other work, the wait.
  cudaGraph_t graph;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  absl::Status queued =
      cuda::CopyByKernel(expected_host, expected.data(), sizeof(uint64_t), stream);
  SpinKernel<<<1, 1, 0, stream>>>(2'000'000);
  if (queued.ok()) queued = cuda::StampTime({stamp.data()}, stream);
  if (queued.ok()) queued = cuda::AwaitHostWords(w, stream);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_TRUE(queued.ok()) << queued;
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (uint64_t round = 1; round <= 3; ++round) {
    SCOPED_TRACE(round);
    *expected_host = round;
    std::fill_n(words, kWords, -7);  // the last round's words, until the host gives these
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    // After the launch, while the step spins: a late host (5 ms) is waited for too.
    if (round == 3) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    for (int i = 0; i < kWords; ++i) words[i] = static_cast<int32_t>(round * 1000 + i);
    __atomic_store_n(ready, round, __ATOMIC_RELEASE);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    const std::vector<int32_t> got = ToHost(dst.data(), kWords + 4);
    for (int i = 0; i < kWords; ++i) {
      ASSERT_EQ(got[i], static_cast<int32_t>(round * 1000 + i)) << "word " << i;
    }
    for (int i = kWords; i < kWords + 4; ++i) ASSERT_EQ(got[i], 0) << "past the words, " << i;
    const std::vector<uint64_t> stamps = ToHost(stamp.data(), 2);
    EXPECT_GE(stamps[1], stamps[0]) << "the wait's stamp, when the words came";
    if (round == 3) {
      EXPECT_GT(stamps[1], stamps[0] + 1'000'000) << "it waited for the late host";
    }
    EXPECT_TRUE(errors->CheckAndClear(stream).ok());
  }
  // Words that never come (the number stays the last round's): the wait ends at its timeout,
  // the destination holds the fill, and the error word says so.
  w.timeout_ns = 2'000'000;
  w.fill = -1;
  *expected_host = 4;
  ASSERT_TRUE(cuda::CopyByKernel(expected_host, expected.data(), sizeof(uint64_t), stream).ok());
  ASSERT_TRUE(cuda::AwaitHostWords(w, stream).ok());
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  const std::vector<int32_t> got = ToHost(dst.data(), kWords);
  EXPECT_TRUE(std::all_of(got.begin(), got.end(), [](int32_t v) { return v == -1; }));
  const absl::Status late = errors->CheckAndClear(stream);
  EXPECT_EQ(late.code(), absl::StatusCode::kUnavailable) << "the host's lateness: retryable";
  EXPECT_THAT(std::string(late.message()), HasSubstr("past its timeout"));
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
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

// Refused before any device call: this runs without a GPU too.
TEST(StepIoTest, MisfitsAreRefusedByName) {
  alignas(16) unsigned char bytes[64] = {};
  auto* word = reinterpret_cast<uint64_t*>(bytes);
  auto* count = reinterpret_cast<unsigned*>(bytes + 48);
  const absl::Status misaligned = cuda::CopyByKernel(bytes + 4, bytes + 32, 8, nullptr);
  EXPECT_EQ(misaligned.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(misaligned.message()), HasSubstr("the source at 4"));
  EXPECT_EQ(cuda::CopyByKernel(nullptr, bytes, 8, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(cuda::CopyByKernel(nullptr, nullptr, 0, nullptr).ok()) << "nothing to copy";

  auto expect_invalid = [](const absl::Status& status, const char* what) {
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << what;
    EXPECT_THAT(std::string(status.message()), HasSubstr(what));
  };
  expect_invalid(cuda::PublishToHost(bytes, bytes + 16, 8, nullptr, word + 5, nullptr),
                 "a block count and a flag");
  expect_invalid(cuda::PublishToHost(bytes, bytes + 16, 8, count, nullptr, nullptr),
                 "a block count and a flag");
  expect_invalid(cuda::PublishToHost(bytes, bytes + 16, 8, count,
                                     reinterpret_cast<uint64_t*>(bytes + 44), nullptr),
                 "an 8-byte aligned flag");
  expect_invalid(cuda::PublishToHost(bytes, bytes + 16, 8,
                                     reinterpret_cast<unsigned*>(bytes + 49), word + 5, nullptr),
                 "a 4-byte aligned block count");
  expect_invalid(cuda::PublishToHost(bytes + 8, bytes + 16, 8, count, word + 5, nullptr),
                 "the source at 8");
  expect_invalid(cuda::PublishToHost(nullptr, nullptr, 0, count, word + 5, nullptr),
                 "a source and a destination");

  cuda::HostWords w;
  w.ready = word;
  w.expected = word + 1;
  w.error_word = count;
  w.count = 4;
  expect_invalid(cuda::AwaitHostWords(w, nullptr), "words and a destination");
  w.count = 0;
  w.ready = reinterpret_cast<const uint64_t*>(bytes + 4);
  expect_invalid(cuda::AwaitHostWords(w, nullptr), "8-byte aligned ready");
  w.ready = nullptr;
  expect_invalid(cuda::AwaitHostWords(w, nullptr), "a ready word");

  expect_invalid(cuda::StampTime({}, nullptr), "1 to 4 places; got 0");
  expect_invalid(cuda::StampTime({word, word, word, word, word}, nullptr), "got 5");
  expect_invalid(cuda::StampTime({word, nullptr}, nullptr), "a null place");
  expect_invalid(cuda::StampTime({reinterpret_cast<uint64_t*>(bytes + 4)}, nullptr),
                 "8-byte aligned");
}

}  // namespace
}  // namespace kvrecall
