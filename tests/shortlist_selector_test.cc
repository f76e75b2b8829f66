#include "index/shortlist_selector.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <set>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/test_util.h"

namespace kvrecall {
namespace {

using ::testing::UnorderedElementsAreArray;

constexpr int kQHeads = 4, kKvHeads = 2, kDim = 32, kTopK = 8;
constexpr int64_t kTokens = 300;

LayerShape Shape() {
  return LayerShape{kQHeads, kKvHeads, kDim, 1.0f / std::sqrt(static_cast<float>(kDim))};
}

// <q, key `id` of KV head kv_head> in double precision.
double Dot(const float* q, const testing::RandomKv& kv, int32_t id, int kv_head) {
  double s = 0;
  for (int j = 0; j < kDim; ++j) {
    s += static_cast<double>(q[j]) * kv.keys[(id * kv.kv_heads + kv_head) * kDim + j];
  }
  return s;
}

// The top K by brute force (double) of the candidates `ids` for query q of KV head kv_head.
std::vector<int32_t> TopKOf(const std::set<int32_t>& ids, const float* q,
                            const testing::RandomKv& kv, int kv_head, int k) {
  std::vector<std::pair<double, int32_t>> scored;
  for (int32_t id : ids) scored.emplace_back(-Dot(q, kv, id, kv_head), id);
  std::sort(scored.begin(), scored.end());
  std::vector<int32_t> top;
  for (int i = 0; i < std::min<int>(k, static_cast<int>(scored.size())); ++i) {
    top.push_back(scored[i].second);
  }
  return top;
}

// What a tier hands the exact path: a shortlist with positions it must skip (negative, at or past
// `coded`: what a kernel that skipped elements could leave), repeats, and outliers the shortlist
// holds too. The support is the exact top K of shortlist ∪ outliers ∪ [coded, T), each once.
TEST(ShortlistSelectorTest, RescoresTheShortlistTheOutliersAndTheUncodedTailOnce) {
  const testing::RandomKv kv(kTokens, kKvHeads, kDim, /*seed=*/7);
  const std::vector<float> q = testing::RandomNormal(kQHeads * kDim, /*seed=*/8);
  const int64_t coded = 250;
  const std::vector<int32_t> ids = {3, 17, 17, 42, -5, 99, 249, 250, 299, 400, 120, 7};
  const std::vector<int32_t> outliers = {42, 180, 260};
  ShortlistSelector selector(Shape(), kTopK);
  for (int h = 0; h < kQHeads; ++h) selector.SetShortlist(h, ids, outliers, coded);
  std::set<int32_t> expected_candidates = {3, 17, 42, 99, 249, 120, 7, 180};
  for (int64_t t = coded; t < kTokens; ++t) expected_candidates.insert(static_cast<int32_t>(t));
  for (int h = 0; h < kQHeads; ++h) {
    HeadSelection out;
    selector.Select(h, q.data() + h * kDim, kv.view(), &out);
    EXPECT_EQ(out.candidates, static_cast<int32_t>(expected_candidates.size())) << "head " << h;
    const int kv_head = KvHeadOf(h, kQHeads, kKvHeads);
    EXPECT_THAT(out.support, UnorderedElementsAreArray(
                                 TopKOf(expected_candidates, q.data() + h * kDim, kv, kv_head,
                                        kTopK)))
        << "head " << h;
    ASSERT_EQ(out.support_scores.size(), out.support.size());
    for (size_t i = 0; i < out.support.size(); ++i) {
      EXPECT_NEAR(out.support_scores[i],
                  Dot(q.data() + h * kDim, kv, out.support[i], kv_head) * Shape().scale, 1e-4)
          << "head " << h;
    }
    EXPECT_EQ(out.path, SelectionPath::kExact);
  }
}

// Before a fetch hands it a shortlist, Select calls the fetch; without any (coded 0) it scans the
// whole bulk: the exact top K.
TEST(ShortlistSelectorTest, FetchesFirstAndScansEverythingWithoutAShortlist) {
  const testing::RandomKv kv(kTokens, kKvHeads, kDim, /*seed=*/9);
  const std::vector<float> q = testing::RandomNormal(kQHeads * kDim, /*seed=*/10);
  ShortlistSelector selector(Shape(), kTopK);
  int fetched = 0;
  const std::function<void()> fetch = [&] { ++fetched; };
  selector.set_fetch(&fetch);
  HeadSelection out;
  selector.Select(1, q.data() + kDim, kv.view(), &out);
  EXPECT_EQ(fetched, 1);
  EXPECT_EQ(out.candidates, kTokens);
  EXPECT_THAT(out.support,
              UnorderedElementsAreArray(testing::ReferenceTopK(
                  q.data() + kDim, kv.view(), KvHeadOf(1, kQHeads, kKvHeads), 1.0, kTopK)));
  selector.set_fetch(nullptr);
}

}  // namespace
}  // namespace kvrecall
