#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/attention_state.h"
#include "kernels/cpu/attention.h"
#include "tests/test_util.h"

namespace kvrecall {
namespace {

using ::kvrecall::testing::AllTokens;
using ::kvrecall::testing::RandomKv;
using ::kvrecall::testing::RandomNormal;
using ::kvrecall::testing::ReferenceAttention;
using ::kvrecall::testing::ReferenceTopK;

struct Shape {
  int64_t tokens;
  int q_heads;
  int kv_heads;
  int head_dim;
};

class CpuAttentionTest : public ::testing::TestWithParam<Shape> {};

// Both vector primitives against double references, at lengths through every path of their
// loops (16 at a time, 8 at a time, scalar tail).
TEST(CpuVectorTest, DotProductAndSquaredDistanceMatchDoubleReferences) {
  for (int n : {1, 7, 8, 16, 37, 64, 128}) {
    const std::vector<float> a = RandomNormal(n, 100 + n, 2.0f);
    const std::vector<float> b = RandomNormal(n, 200 + n, 2.0f);
    double dot = 0, distance = 0;
    for (int i = 0; i < n; ++i) {
      dot += static_cast<double>(a[i]) * b[i];
      distance += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    }
    EXPECT_NEAR(cpu::DotProduct(a.data(), b.data(), n), dot, 1e-4 * (1 + std::abs(dot))) << n;
    EXPECT_NEAR(cpu::SquaredDistance(a.data(), b.data(), n), distance, 1e-4 * (1 + distance))
        << n;
    EXPECT_EQ(cpu::SquaredDistance(a.data(), a.data(), n), 0.0f) << n;
  }
}

// Scattered rows scored together give DotProduct's result bit for bit (the graph search relies
// on it: its results do not depend on how a node's neighbors were batched), for every count of
// rows through the 4-at-a-time loop and its remainders, and lengths through the scalar path.
TEST(CpuVectorTest, DotProductRowsEqualsDotProductBitForBit) {
  for (int n : {1, 7, 8, 16, 37, 64, 128}) {
    const std::vector<float> x = RandomNormal(n, 300 + n, 2.0f);
    const std::vector<float> data = RandomNormal(11 * n, 400 + n, 2.0f);
    std::vector<const float*> rows;
    for (int r = 0; r < 11; ++r) rows.push_back(data.data() + ((r * 7) % 11) * n);
    for (int count = 0; count <= 11; ++count) {
      std::vector<float> out(count + 1, -1.0f);
      cpu::DotProductRows(x.data(), rows.data(), count, n, out.data());
      for (int r = 0; r < count; ++r) {
        EXPECT_EQ(out[r], cpu::DotProduct(x.data(), rows[r], n)) << n << " " << count << " " << r;
      }
      EXPECT_EQ(out[count], -1.0f) << "wrote past count";
    }
  }
}

TEST_P(CpuAttentionTest, FullAttentionMatchesDoubleReference) {
  const Shape s = GetParam();
  RandomKv kv(s.tokens, s.kv_heads, s.head_dim, 7);
  std::vector<float> q = RandomNormal(s.q_heads * s.head_dim, 11, 2.0f);
  const float scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim));
  std::vector<float> o(s.q_heads * s.head_dim), lse(s.q_heads);
  cpu::MultiHeadFullAttention(q.data(), s.q_heads, kv.view(), scale, o.data(), lse.data());

  const std::vector<int32_t> all = AllTokens(s.tokens);
  for (int h = 0; h < s.q_heads; ++h) {
    std::vector<double> ref;
    const double ref_lse = ReferenceAttention(q.data() + h * s.head_dim, kv.view(),
                                              KvHeadOf(h, s.q_heads, s.kv_heads), all, scale, &ref);
    EXPECT_NEAR(lse[h], ref_lse, 1e-4 * std::max(1.0, std::abs(ref_lse)));
    for (int j = 0; j < s.head_dim; ++j) EXPECT_NEAR(o[h * s.head_dim + j], ref[j], 2e-5);
  }
}

TEST_P(CpuAttentionTest, MergingPartialsOfASplitEqualsAttentionOverTheUnion) {
  const Shape s = GetParam();
  RandomKv kv(s.tokens, s.kv_heads, s.head_dim, 3);
  std::vector<float> q = RandomNormal(s.head_dim, 5, 3.0f);
  const float scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim));
  // An interleaved split: even tokens in one part, odd in the other, plus an empty part.
  std::vector<int32_t> even, odd;
  for (int32_t t = 0; t < s.tokens; ++t) (t % 2 ? odd : even).push_back(t);
  std::vector<float> o(s.head_dim), o_odd(s.head_dim), o_empty(s.head_dim);
  float lse, lse_odd, lse_empty;
  cpu::PartialAttention(q.data(), kv.view(), 0, even, scale, o.data(), &lse);
  cpu::PartialAttention(q.data(), kv.view(), 0, odd, scale, o_odd.data(), &lse_odd);
  cpu::PartialAttention(q.data(), kv.view(), 0, {}, scale, o_empty.data(), &lse_empty);
  EXPECT_EQ(lse_empty, kEmptyLse);
  MergeStateInto(o_odd.data(), lse_odd, o.data(), &lse, s.head_dim);
  MergeStateInto(o_empty.data(), lse_empty, o.data(), &lse, s.head_dim);

  std::vector<double> ref;
  const double ref_lse =
      ReferenceAttention(q.data(), kv.view(), 0, AllTokens(s.tokens), scale, &ref);
  EXPECT_NEAR(lse, ref_lse, 1e-4 * std::max(1.0, std::abs(ref_lse)));
  for (int j = 0; j < s.head_dim; ++j) EXPECT_NEAR(o[j], ref[j], 2e-5);
}

TEST_P(CpuAttentionTest, RangeEqualsIndexSet) {
  const Shape s = GetParam();
  RandomKv kv(s.tokens, s.kv_heads, s.head_dim, 9);
  std::vector<float> q = RandomNormal(s.head_dim, 1);
  const int64_t begin = s.tokens / 3, end = s.tokens - 1;
  std::vector<int32_t> ids(end - begin);
  std::iota(ids.begin(), ids.end(), static_cast<int32_t>(begin));
  std::vector<float> a(s.head_dim), b(s.head_dim);
  float lse_a, lse_b;
  const int kv_head = s.kv_heads - 1;
  cpu::PartialAttentionRange(q.data(), kv.view(), kv_head, begin, end, 0.1f, a.data(), &lse_a);
  cpu::PartialAttention(q.data(), kv.view(), kv_head, ids, 0.1f, b.data(), &lse_b);
  EXPECT_EQ(lse_a, lse_b);
  EXPECT_EQ(a, b);
}

TEST_P(CpuAttentionTest, ExactTopKMatchesBruteForce) {
  const Shape s = GetParam();
  RandomKv kv(s.tokens, s.kv_heads, s.head_dim, 13);
  std::vector<float> q = RandomNormal(s.head_dim, 17);
  const float scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim));
  for (int k : {1, 16, static_cast<int>(s.tokens), static_cast<int>(s.tokens) + 5}) {
    std::vector<int32_t> got;
    cpu::ExactTopK(q.data(), kv.view(), 0, scale, k, &got);
    std::vector<int32_t> want = ReferenceTopK(q.data(), kv.view(), 0, scale, k);
    // Float and double scores may order near-ties differently; compare as sets.
    std::sort(got.begin(), got.end());
    std::sort(want.begin(), want.end());
    EXPECT_EQ(got, want) << "k=" << k;
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, CpuAttentionTest,
                         ::testing::Values(Shape{1, 1, 1, 8}, Shape{37, 4, 4, 64},
                                           Shape{1000, 8, 2, 64}, Shape{513, 32, 8, 128}));

TEST(TopKPositionsTest, TiesAreBrokenByLowerPosition) {
  const std::vector<float> scores = {1, 3, 3, 2, 3, 0};
  std::vector<int32_t> top;
  cpu::TopKPositions(scores, 2, &top);
  EXPECT_EQ(top, (std::vector<int32_t>{1, 2}));
  cpu::TopKPositions(scores, 4, &top);
  EXPECT_EQ(top, (std::vector<int32_t>{1, 2, 4, 3}));
  cpu::TopKPositions(scores, 0, &top);
  EXPECT_TRUE(top.empty());
}

TEST(MergeStateTest, LargeLseGapsDoNotOverflow) {
  std::vector<float> o = {1, 2}, other = {3, 4};
  float lse = 1000.0f;
  MergeStateInto(other.data(), -1000.0f, o.data(), &lse, 2);
  EXPECT_FLOAT_EQ(lse, 1000.0f);
  EXPECT_FLOAT_EQ(o[0], 1.0f);
  EXPECT_FLOAT_EQ(o[1], 2.0f);
}

}  // namespace
}  // namespace kvrecall
