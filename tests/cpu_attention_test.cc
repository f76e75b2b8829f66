#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <string>
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
    std::vector<const void*> rows;
    for (int r = 0; r < 11; ++r) rows.push_back(data.data() + ((r * 7) % 11) * n);
    for (int count = 0; count <= 11; ++count) {
      std::vector<float> out(count + 1, -1.0f);
      cpu::DotProductRows(x.data(), rows.data(), KvElement::kF32, count, n, out.data());
      for (int r = 0; r < count; ++r) {
        EXPECT_EQ(out[r], cpu::DotProduct(x.data(), static_cast<const float*>(rows[r]), n))
            << n << " " << count << " " << r;
      }
      EXPECT_EQ(out[count], -1.0f) << "wrote past count";
    }
  }
}

// 16-bit storage (the tiered placement's host KV): every kernel over a bf16 or f16 view gives,
// bit for bit, what it gives over an f32 view of the same values (rows are widened exactly and
// the arithmetic is the f32 kernels'), and matches the double reference over the stored values.
class CpuStoredElementTest : public ::testing::TestWithParam<KvElement> {};

TEST_P(CpuStoredElementTest, KernelsOverSixteenBitRowsEqualThemOverTheWidenedValues) {
  constexpr int kHeads = 2, kDim = 40;  // 40: the 16-wide, 8-wide and scalar paths all run
  const RandomKv f32(300, kHeads, kDim, 21);
  const testing::NarrowedKv stored(f32, GetParam());
  const KvView narrow = stored.view();
  const KvView wide = stored.widened_view();
  const std::vector<float> q = RandomNormal(kDim, 23, 1.5f);
  std::vector<int32_t> ids;
  for (int32_t t = 0; t < 300; t += 3) ids.push_back(t);
  const float scale = 0.3f;
  for (int h = 0; h < kHeads; ++h) {
    std::vector<float> a(ids.size()), b(ids.size());
    cpu::ScoreTokens(q.data(), narrow, h, ids, scale, a.data());
    cpu::ScoreTokens(q.data(), wide, h, ids, scale, b.data());
    EXPECT_EQ(a, b);
    std::vector<float> ra(300), rb(300);
    cpu::ScoreRange(q.data(), narrow, h, 0, 300, scale, ra.data());
    cpu::ScoreRange(q.data(), wide, h, 0, 300, scale, rb.data());
    EXPECT_EQ(ra, rb);

    std::vector<float> oa(kDim), ob(kDim);
    float lse_a, lse_b;
    cpu::PartialAttention(q.data(), narrow, h, ids, scale, oa.data(), &lse_a);
    cpu::PartialAttention(q.data(), wide, h, ids, scale, ob.data(), &lse_b);
    EXPECT_EQ(oa, ob);
    EXPECT_EQ(lse_a, lse_b);
    std::vector<double> ref;
    const double ref_lse = ReferenceAttention(q.data(), narrow, h, ids, scale, &ref);
    EXPECT_NEAR(lse_a, ref_lse, 1e-4);
    for (int j = 0; j < kDim; ++j) EXPECT_NEAR(oa[j], ref[j], 1e-4) << j;

    // Already-scored tokens: the same state without scoring again.
    std::vector<float> oc(kDim);
    float lse_c;
    cpu::PartialAttentionScored(a, narrow, h, ids, oc.data(), &lse_c);
    EXPECT_EQ(oc, oa);
    EXPECT_EQ(lse_c, lse_a);

    cpu::PartialAttentionRange(q.data(), narrow, h, 17, 250, scale, oa.data(), &lse_a);
    cpu::PartialAttentionRange(q.data(), wide, h, 17, 250, scale, ob.data(), &lse_b);
    EXPECT_EQ(oa, ob);
    EXPECT_EQ(lse_a, lse_b);

    std::vector<int32_t> top_a, top_b;
    cpu::ExactTopK(q.data(), narrow, h, scale, 25, &top_a);
    cpu::ExactTopK(q.data(), wide, h, scale, 25, &top_b);
    EXPECT_EQ(top_a, top_b);
    EXPECT_EQ(top_a, ReferenceTopK(q.data(), narrow, h, scale, 25));

    // Row primitives: the graph index's scoring, pruning distance and widening.
    std::vector<const void*> narrow_rows, wide_rows;
    for (int32_t t : {5, 77, 3, 150, 299, 42, 8}) {
      narrow_rows.push_back(narrow.key_row(t, h));
      wide_rows.push_back(wide.key_row(t, h));
    }
    std::vector<float> da(7), db(7);
    cpu::DotProductRows(q.data(), narrow_rows.data(), GetParam(), 7, kDim, da.data());
    cpu::DotProductRows(q.data(), wide_rows.data(), KvElement::kF32, 7, kDim, db.data());
    EXPECT_EQ(da, db);
    for (int r = 0; r < 7; ++r) {
      EXPECT_EQ(cpu::DotProduct(q.data(), narrow_rows[r], GetParam(), kDim), da[r]);
      const float distance =
          cpu::SquaredDistance(narrow_rows[r], narrow_rows[(r + 1) % 7], GetParam(), kDim);
      EXPECT_EQ(distance,
                cpu::SquaredDistance(static_cast<const float*>(wide_rows[r]),
                                     static_cast<const float*>(wide_rows[(r + 1) % 7]), kDim));
      // An f32 vector against a stored row (the graph build's pruning), in either order.
      EXPECT_EQ(distance, cpu::SquaredDistance(static_cast<const float*>(wide_rows[r]),
                                               narrow_rows[(r + 1) % 7], GetParam(), kDim));
      EXPECT_EQ(distance, cpu::SquaredDistance(static_cast<const float*>(wide_rows[(r + 1) % 7]),
                                               narrow_rows[r], GetParam(), kDim));
      std::vector<float> row(kDim);
      cpu::LoadRow(narrow_rows[r], GetParam(), kDim, row.data());
      const float* want = static_cast<const float*>(wide_rows[r]);
      EXPECT_EQ(row, std::vector<float>(want, want + kDim));
    }
  }
  std::vector<float> qs = RandomNormal(4 * kDim, 29, 1.5f);
  std::vector<float> oa(4 * kDim), ob(4 * kDim), la(4), lb(4);
  cpu::MultiHeadFullAttention(qs.data(), 4, narrow, scale, oa.data(), la.data());
  cpu::MultiHeadFullAttention(qs.data(), 4, wide, scale, ob.data(), lb.data());
  EXPECT_EQ(oa, ob);
  EXPECT_EQ(la, lb);
  // A group's heads over one support (the static set): 4, 2 and 1 heads at a time.
  for (const int heads : {4, 3, 1}) {
    cpu::GroupedPartialAttention(qs.data(), heads, narrow, 1, ids, scale, oa.data(), la.data());
    cpu::GroupedPartialAttention(qs.data(), heads, wide, 1, ids, scale, ob.data(), lb.data());
    for (int i = 0; i < heads * kDim; ++i) ASSERT_EQ(oa[i], ob[i]) << heads << " " << i;
    for (int h = 0; h < heads; ++h) {
      EXPECT_EQ(la[h], lb[h]);
      std::vector<double> ref;
      const double ref_lse =
          ReferenceAttention(qs.data() + h * kDim, narrow, 1, ids, scale, &ref);
      EXPECT_NEAR(la[h], ref_lse, 1e-4);
      for (int j = 0; j < kDim; ++j) EXPECT_NEAR(oa[h * kDim + j], ref[j], 1e-4);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(SixteenBit, CpuStoredElementTest,
                         ::testing::Values(KvElement::kBf16, KvElement::kF16),
                         [](const ::testing::TestParamInfo<KvElement>& info) {
                           return std::string(KvElementName(info.param));
                         });

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

// Each query head's output and lse against the double reference over `supports[h]`.
void ExpectMatchesReference(const std::vector<float>& q, int q_heads, const KvView& kv,
                            std::span<const std::vector<int32_t>> supports, float scale,
                            const std::vector<float>& o, const std::vector<float>& lse) {
  const int d = kv.head_dim;
  for (int h = 0; h < q_heads; ++h) {
    std::vector<double> ref;
    const double ref_lse = ReferenceAttention(q.data() + h * d, kv, KvHeadOf(h, q_heads, kv.kv_heads),
                                              supports[h], scale, &ref);
    if (supports[h].empty()) {
      EXPECT_EQ(lse[h], kEmptyLse) << "head " << h;
    } else {
      EXPECT_NEAR(lse[h], ref_lse, 1e-4 * std::max(1.0, std::abs(ref_lse))) << "head " << h;
    }
    for (int j = 0; j < d; ++j) EXPECT_NEAR(o[h * d + j], ref[j], 2e-5) << "head " << h << " " << j;
  }
}

// The grouped kernel against the double reference for every count of heads through its 4-head
// blocks and their remainders, supports of every length through its token blocks and tails
// (scattered and repeated ids included), and head sizes through its value-block tails.
TEST(CpuGroupedAttentionTest, MatchesDoubleReference) {
  for (int d : {8, 24, 64, 128}) {
    RandomKv kv(700, 2, d, 21 + d);
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    for (int heads : {1, 2, 3, 4, 5, 8}) {
      const std::vector<float> q = RandomNormal(heads * d, 31 + heads, 2.0f);
      for (int64_t n : {1, 2, 7, 8, 9, 63, 64, 513}) {
        std::vector<int32_t> ids(n);
        for (int64_t i = 0; i < n; ++i) ids[i] = static_cast<int32_t>((i * 37 + n) % 700);
        if (n > 2) ids[1] = ids[0];  // a token twice counts twice, as in PartialAttention
        std::vector<float> o(heads * d, -1.0f), lse(heads, -1.0f);
        cpu::GroupedPartialAttention(q.data(), heads, kv.view(), 1, ids, scale, o.data(),
                                     lse.data());
        std::vector<double> ref;
        for (int h = 0; h < heads; ++h) {
          const double ref_lse =
              ReferenceAttention(q.data() + h * d, kv.view(), 1, ids, scale, &ref);
          EXPECT_NEAR(lse[h], ref_lse, 1e-4 * std::max(1.0, std::abs(ref_lse)))
              << "d " << d << " heads " << heads << " n " << n << " head " << h;
          for (int j = 0; j < d; ++j) {
            ASSERT_NEAR(o[h * d + j], ref[j], 2e-5)
                << "d " << d << " heads " << heads << " n " << n << " head " << h << " " << j;
          }
        }
      }
    }
  }
}

// Scores far apart (a large query): most exponentials underflow, the largest dominates.
TEST(CpuGroupedAttentionTest, ScoresFarApartMatchDoubleReference) {
  const int d = 64;
  RandomKv kv(300, 1, d, 5);
  const std::vector<float> q = RandomNormal(4 * d, 6, 60.0f);
  const std::vector<int32_t> ids = AllTokens(300);
  std::vector<float> o(4 * d), lse(4);
  cpu::GroupedPartialAttention(q.data(), 4, kv.view(), 0, ids, 1.0f, o.data(), lse.data());
  const std::vector<std::vector<int32_t>> supports(4, ids);
  ExpectMatchesReference(q, 4, kv.view(), supports, 1.0f, o, lse);
}

TEST(CpuGroupedAttentionTest, EmptySupportGivesTheEmptyState) {
  RandomKv kv(10, 1, 16, 5);
  const std::vector<float> q = RandomNormal(3 * 16, 6);
  std::vector<float> o(3 * 16, 7.0f), lse(3, 7.0f);
  cpu::GroupedPartialAttention(q.data(), 3, kv.view(), 0, {}, 0.25f, o.data(), lse.data());
  for (float x : lse) EXPECT_EQ(x, kEmptyLse);
  for (float x : o) EXPECT_EQ(x, 0.0f);
}

// MultiHeadAttention over supports shared by a whole group (the grouped path), distinct per
// head, and shared by part of a group, at one thread and at the team its work asks for.
TEST_P(CpuAttentionTest, MultiHeadAttentionMatchesDoubleReference) {
  const Shape s = GetParam();
  RandomKv kv(s.tokens, s.kv_heads, s.head_dim, 19);
  const std::vector<float> q = RandomNormal(s.q_heads * s.head_dim, 23, 2.0f);
  const float scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim));
  const int group = s.q_heads / s.kv_heads;
  std::vector<int32_t> scattered;
  for (int32_t t = 0; t < s.tokens; t += 3) scattered.push_back(t);
  for (const char* kind : {"shared", "distinct", "partly shared"}) {
    std::vector<std::vector<int32_t>> supports(s.q_heads);
    for (int h = 0; h < s.q_heads; ++h) {
      if (std::string(kind) == "shared") {
        supports[h] = scattered;
      } else if (std::string(kind) == "distinct") {
        supports[h] = ReferenceTopK(q.data() + h * s.head_dim, kv.view(),
                                    KvHeadOf(h, s.q_heads, s.kv_heads), scale,
                                    1 + h % static_cast<int>(s.tokens));
      } else {
        supports[h] = h % group == group - 1 && group > 1 ? AllTokens(s.tokens) : scattered;
      }
    }
    for (int threads : {1, 0}) {
      std::vector<float> o(s.q_heads * s.head_dim), lse(s.q_heads);
      const int saved = omp_get_max_threads();
      if (threads > 0) omp_set_num_threads(threads);
      cpu::MultiHeadAttention(q.data(), s.q_heads, kv.view(), supports, scale, o.data(),
                              lse.data());
      omp_set_num_threads(saved);
      SCOPED_TRACE(std::string(kind) + (threads == 1 ? ", one thread" : ", a team"));
      ExpectMatchesReference(q, s.q_heads, kv.view(), supports, scale, o, lse);
    }
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

// The brute-force order TopKPositions promises: score descending, equal scores
// (-0 equal to +0) by position ascending.
std::vector<int32_t> ReferenceTopK(const std::vector<float>& scores, int k) {
  std::vector<int32_t> all(scores.size());
  std::iota(all.begin(), all.end(), 0);
  std::stable_sort(all.begin(), all.end(),
                   [&](int32_t a, int32_t b) { return scores[a] > scores[b]; });
  all.resize(std::min<size_t>(std::max(k, 0), all.size()));
  return all;
}

TEST(TopKPositionsTest, MatchesASortOfEveryScore) {
  std::mt19937 rng(7);
  // Both ways TopKPositions sorts: by comparison up to 64 scores, by radix above.
  for (int n : {1, 2, 9, 32, 64, 65, 300, 1537, 5000}) {
    for (int distinct : {1, 3, 50, 0}) {  // 0: continuous scores, else that many values
      std::vector<float> scores = RandomNormal(n, 1000 + n + distinct, 3.0f);
      if (distinct > 0) {
        for (float& x : scores) x = static_cast<float>(static_cast<int>(rng() % distinct) - 1);
      }
      // Signed zeros and infinities among them.
      scores[rng() % n] = -0.0f;
      scores[rng() % n] = 0.0f;
      scores[rng() % n] = -std::numeric_limits<float>::infinity();
      if (n > 3) scores[rng() % n] = std::numeric_limits<float>::infinity();
      for (int k : {0, 1, 7, 512, n - 1, n, n + 5}) {
        std::vector<int32_t> top;
        cpu::TopKPositions(scores, k, &top);
        EXPECT_EQ(top, ReferenceTopK(scores, k)) << n << " " << distinct << " " << k;
      }
    }
  }
}

// Scattered rows, scored four at a time with prefetching: each score is what
// DotProduct gives for its row alone, scaled, bit for bit, for every element
// type and count.
TEST_P(CpuStoredElementTest, ScoreTokensEqualsDotProductPerRowBitForBit) {
  for (int dim : {40, 128}) {
    const RandomKv f32(700, 2, dim, 31 + dim);
    const testing::NarrowedKv stored(f32, GetParam());
    const std::vector<float> q = RandomNormal(dim, 37, 1.5f);
    const float scale = 0.125f;
    std::mt19937 rng(dim);
    for (const KvView& kv : {stored.view(), stored.widened_view()}) {
      for (int count : {0, 1, 3, 4, 5, 16, 17, 21, 250}) {
        std::vector<int32_t> ids(count);
        for (int32_t& id : ids) id = static_cast<int32_t>(rng() % 700);
        for (int h = 0; h < 2; ++h) {
          std::vector<float> scores(count + 1, -1.0f);
          cpu::ScoreTokens(q.data(), kv, h, ids, scale, scores.data());
          for (int i = 0; i < count; ++i) {
            EXPECT_EQ(scores[i],
                      scale * cpu::DotProduct(q.data(), kv.key_row(ids[i], h), kv.element, dim))
                << dim << " " << count << " " << i;
          }
          EXPECT_EQ(scores[count], -1.0f) << "wrote past count";
        }
      }
    }
  }
}

// Several queries against one row, and scattered rows scored for several queries (the query
// heads of a KV group, each row widened once for all): each score is ScoreTokens' for its query
// and row, bit for bit, for every element type, every count of queries through the
// four-at-a-time loop and its remainders, and masks naming some of them per row.
TEST_P(CpuStoredElementTest, ScoreTokensForQueriesEqualsScoreTokensBitForBit) {
  // Every bit of a float: -0 and +0 differ here.
  auto bits = [](float x) { return std::bit_cast<uint32_t>(x); };
  for (int dim : {44, 40, 128}) {
    const RandomKv f32(700, 2, dim, 41 + dim);
    const testing::NarrowedKv stored(f32, GetParam());
    const float scale = 0.125f;
    std::mt19937 rng(dim);
    for (const KvView& kv : {stored.view(), stored.widened_view()}) {
      for (int queries : {1, 3, 4, 5, 9, 32, 33, 70}) {
        const std::vector<float> q = RandomNormal(queries * dim, 43 + queries, 1.5f);
        std::vector<const float*> query(queries);
        for (int j = 0; j < queries; ++j) query[j] = q.data() + j * dim;
        // One row, every query.
        std::vector<float> one(queries + 1, -1.0f);
        cpu::DotProductQueries(query.data(), queries, kv.key_row(5, 1), kv.element, dim,
                               one.data());
        for (int j = 0; j < queries; ++j) {
          EXPECT_EQ(bits(one[j]),
                    bits(cpu::DotProduct(query[j], kv.key_row(5, 1), kv.element, dim)));
        }
        EXPECT_EQ(one[queries], -1.0f) << "wrote past count";
        for (int count : {0, 1, 17, 250}) {
          std::vector<int32_t> ids(count);
          for (int32_t& id : ids) id = static_cast<int32_t>(rng() % 700);
          for (bool masked : {false, true}) {
            if (masked && queries > 32) continue;  // a mask names 32 queries at most
            // Bits past the queries may be set: they name nothing.
            std::vector<uint32_t> which;
            if (masked) {
              for (int i = 0; i < count; ++i) which.push_back(static_cast<uint32_t>(rng()));
            }
            std::vector<std::vector<float>> scores(queries, std::vector<float>(count, -1.0f));
            std::vector<float*> out(queries);
            for (int j = 0; j < queries; ++j) out[j] = scores[j].data();
            cpu::ScoreTokensForQueries(query, kv, 1, ids, which, scale, out.data());
            for (int j = 0; j < queries; ++j) {
              std::vector<float> want(count);
              cpu::ScoreTokens(query[j], kv, 1, ids, scale, want.data());
              for (int i = 0; i < count; ++i) {
                const bool named = !masked || (which[i] >> j & 1) != 0;
                EXPECT_EQ(bits(scores[j][i]), bits(named ? want[i] : -1.0f))
                    << dim << " " << queries << " " << count << " " << j << " " << i;
              }
            }
          }
        }
      }
    }
  }
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
