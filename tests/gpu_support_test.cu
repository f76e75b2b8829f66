// What the GPU placements share (server/backends/gpu_support.h): the bounds captured steps are
// planned for (host arithmetic, run without a device): GraphTokenBound's buckets, and the
// tiered shortlists' CapturedScanBound, which plans one row ahead so that the step after a
// take-over keeps the take-over's bound; and ChargedBuffer's charges to its account, zeroed or
// for overwrite (on a device).
#include "server/backends/gpu_support.h"

#include <cstdint>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/backends/codes_learning.h"
#include "server/memory_budget.h"
#include "tests/cuda_test_util.h"

namespace kvrecall::gpu {
namespace {

using ::testing::HasSubstr;

TEST(GraphTokenBoundTest, RoundsUpToASixteenthOfThePowerOfTwo) {
  EXPECT_EQ(GraphTokenBound(1), 256);
  EXPECT_EQ(GraphTokenBound(256), 256);
  EXPECT_EQ(GraphTokenBound(257), 512);
  EXPECT_EQ(GraphTokenBound(1536), 1536);
  EXPECT_EQ(GraphTokenBound(1537), 1792);
  EXPECT_EQ(GraphTokenBound(8191), 8192);
  EXPECT_EQ(GraphTokenBound(8193), 8704);  // buckets of 512 from 8192
  for (int64_t tokens = 1; tokens <= 70000; ++tokens) {
    const int64_t bound = GraphTokenBound(tokens);
    ASSERT_GE(bound, tokens);
    ASSERT_LE(bound, tokens + std::max<int64_t>(255, tokens / 16)) << tokens;
  }
}

TEST(CapturedScanBoundTest, PlansTheNextStepsRowWithinTheCapacity) {
  constexpr int64_t kRoom = int64_t{1} << 20;
  EXPECT_EQ(CapturedScanBound(0, kRoom), 0);
  for (int64_t coded = 1; coded <= 70000; ++coded) {
    ASSERT_EQ(CapturedScanBound(coded, kRoom), GraphTokenBound(coded + 1)) << coded;
    ASSERT_GT(CapturedScanBound(coded, kRoom), coded) << coded;
  }
  // Never past the codes' room, never below the rows scanned.
  EXPECT_EQ(CapturedScanBound(1536, 1537), 1537);
  EXPECT_EQ(CapturedScanBound(1536, 1536), 1536);
  EXPECT_EQ(CapturedScanBound(1000, 1000), 1000);
}

// A layer whose codes were first learned at CodesLearning::kFirstLearnRows rows takes over at
// bucket ends: under GraphTokenBound(coded) the next step's bound moved (a second capture);
// CapturedScanBound keeps it, and a growing bulk still moves its bound as often as before.
TEST(CapturedScanBoundTest, TheStepAfterATakeOverKeepsItsBound) {
  constexpr int64_t kRoom = int64_t{1} << 20;
  for (int64_t learned = CodesLearning::kFirstLearnRows; learned <= 16384; learned *= 2) {
    const int64_t take_over = CodesLearning::TakeOverAt(learned);
    EXPECT_NE(GraphTokenBound(take_over), GraphTokenBound(take_over + 1)) << take_over;
    EXPECT_EQ(CapturedScanBound(take_over, kRoom), CapturedScanBound(take_over + 1, kRoom))
        << take_over;
  }
  int moves_before = 0, moves_now = 0;
  for (int64_t coded = 2; coded <= 70000; ++coded) {
    moves_before += GraphTokenBound(coded) != GraphTokenBound(coded - 1);
    moves_now += CapturedScanBound(coded, kRoom) != CapturedScanBound(coded - 1, kRoom);
  }
  EXPECT_EQ(moves_now, moves_before);
  EXPECT_GT(moves_now, 0);
}

// Both allocations charge the account their bytes while they live, and a refused reservation
// allocates and charges nothing.
TEST(ChargedBufferTest, ChargesItsBytesWhileItLives) {
  KVRECALL_SKIP_WITHOUT_GPU();
  MemoryBudget budget(int64_t{1} << 20, "GPU 0 memory", "gpu_memory_budget_gb");
  {
    ChargedBuffer<float> zeroed, staging;
    ASSERT_TRUE(zeroed.Allocate(1000, &budget, "zeroed").ok());
    ASSERT_TRUE(staging.AllocateForOverwrite(3000, &budget, "staging").ok());
    EXPECT_EQ(budget.used(), 4000 * int64_t{sizeof(float)});
    EXPECT_EQ(staging.size(), 3000u);
    EXPECT_NE(staging.data(), nullptr);
    zeroed.Free();
    EXPECT_EQ(budget.used(), 3000 * int64_t{sizeof(float)});
  }
  EXPECT_EQ(budget.used(), 0);
  ChargedBuffer<float> refused;
  for (const bool overwrite : {false, true}) {
    const absl::Status status =
        overwrite ? refused.AllocateForOverwrite(1 << 20, &budget, "the big staging")
                  : refused.Allocate(1 << 20, &budget, "the big staging");
    EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << overwrite;
    EXPECT_THAT(std::string(status.message()), HasSubstr("the big staging"));
    EXPECT_EQ(budget.used(), 0);
    EXPECT_EQ(refused.size(), 0u);
  }
}

}  // namespace
}  // namespace kvrecall::gpu
