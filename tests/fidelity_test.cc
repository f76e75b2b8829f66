// The fidelity figures (kernels/fidelity.h) against values worked out by hand: every benchmark
// and the server's compare_exact report them, and tests elsewhere hold selectors to them.
#include "kernels/fidelity.h"

#include <cmath>
#include <cstdint>
#include <vector>

#include "gtest/gtest.h"

namespace kvrecall {
namespace {

using Ids = std::vector<int32_t>;

TEST(FidelityTest, SupportRecallCountsEachExactTokenFoundOnce) {
  std::vector<uint8_t> marks;
  // Of the exact {1, 2, 3}, the support finds 2 and 3; 4 is not exact, and listed twice.
  EXPECT_DOUBLE_EQ(SupportRecall(Ids{2, 3, 4, 4}, Ids{1, 2, 3}, 8, &marks), 2.0 / 3.0);
  // An exact token listed twice in the support counts once.
  EXPECT_DOUBLE_EQ(SupportRecall(Ids{2, 2, 2}, Ids{1, 2}, 8, &marks), 0.5);
  EXPECT_DOUBLE_EQ(SupportRecall(Ids{5, 6}, Ids{1, 2}, 8, &marks), 0.0);
  EXPECT_DOUBLE_EQ(SupportRecall(Ids{7, 1, 0}, Ids{0, 1, 7}, 8, &marks), 1.0);
  EXPECT_DOUBLE_EQ(SupportRecall(Ids{1}, {}, 8, &marks), 1.0);
  // The scratch is left all zero, so the next call starts clean.
  for (uint8_t m : marks) EXPECT_EQ(m, 0);
}

TEST(FidelityTest, WeightedSupportRecallIsTheShareOfTheExactSupportsMass) {
  std::vector<uint8_t> marks;
  // Scores 0 and ln 3: weights 1 and 3 of 4.
  const std::vector<int32_t> exact = {4, 9};
  const std::vector<float> scores = {0.0f, std::log(3.0f)};
  EXPECT_NEAR(WeightedSupportRecall(Ids{9}, exact, scores, 16, &marks), 0.75, 1e-7);
  EXPECT_NEAR(WeightedSupportRecall(Ids{4, 5}, exact, scores, 16, &marks), 0.25, 1e-7);
  EXPECT_NEAR(WeightedSupportRecall(Ids{4, 9}, exact, scores, 16, &marks), 1.0, 1e-12);
  EXPECT_EQ(WeightedSupportRecall(Ids{1}, {}, {}, 16, &marks), 1.0);
  // Scores far from 0 (the max is subtracted first): 1000 and 1000 + ln 3.
  const std::vector<float> large = {1000.0f, 1000.0f + std::log(3.0f)};
  EXPECT_NEAR(WeightedSupportRecall(Ids{9}, exact, large, 16, &marks), 0.75, 1e-4);
  for (uint8_t m : marks) EXPECT_EQ(m, 0);
}

TEST(FidelityTest, OutputCosineAndRelativeL2AgainstWorkedValues) {
  const float a[] = {1.0f, 0.0f};
  const float b[] = {1.0f, 1.0f};
  EXPECT_NEAR(OutputCosine(a, b, 2), 1.0 / std::sqrt(2.0), 1e-12);
  const float c[] = {1.0f, 2.0f, 3.0f};
  const float minus_c[] = {-1.0f, -2.0f, -3.0f};
  EXPECT_NEAR(OutputCosine(c, minus_c, 3), -1.0, 1e-12);
  EXPECT_NEAR(OutputCosine(c, c, 3), 1.0, 1e-12);
  const float zero[] = {0.0f, 0.0f, 0.0f};
  EXPECT_EQ(OutputCosine(zero, zero, 3), 1.0);
  EXPECT_EQ(OutputCosine(c, zero, 3), 0.0);

  // ||(3, 5) - (3, 4)|| / ||(3, 4)|| = 1 / 5.
  const float exact[] = {3.0f, 4.0f};
  const float approx[] = {3.0f, 5.0f};
  EXPECT_NEAR(RelativeL2(approx, exact, 2), 0.2, 1e-12);
  EXPECT_EQ(RelativeL2(exact, exact, 2), 0.0);
  // Against zero, the absolute error: ||(3, 4)|| = 5.
  EXPECT_NEAR(RelativeL2(exact, zero, 2), 5.0, 1e-12);
}

TEST(FidelityTest, RetainedMassIsTheSupportsShareOfTheFullSoftmax) {
  EXPECT_NEAR(RetainedMass(std::log(0.25f), 0.0f), 0.25, 1e-7);
  EXPECT_NEAR(RetainedMass(10.0f, 10.0f + std::log(8.0f)), 0.125, 1e-6);
  // Rounding that puts the support's lse a hair above the full one's reads 1.
  EXPECT_EQ(RetainedMass(5.0f + 1e-6f, 5.0f), 1.0);
}

}  // namespace
}  // namespace kvrecall
