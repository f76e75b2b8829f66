#include "index/shortlist_selector.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <random>
#include <set>
#include <thread>
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
  for (int g = 0; g < kKvHeads; ++g) selector.SetOutliers(g, outliers);
  for (int h = 0; h < kQHeads; ++h) selector.SetShortlist(h, ids, coded);
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

// Shortlists of many ids with many repeats, of growing and shrinking lengths on one thread (the
// set of ids taken is sized to a Select's ids, not to the bulk, and reused): every candidate
// once, every time.
TEST(ShortlistSelectorTest, LongShortlistsWithRepeatsAreTakenOnceEveryTime) {
  constexpr int64_t kLong = 20000;
  const testing::RandomKv kv(kLong, kKvHeads, kDim, /*seed=*/9);
  const std::vector<float> q = testing::RandomNormal(kQHeads * kDim, /*seed=*/10);
  std::mt19937 rng(11);
  ShortlistSelector selector(Shape(), kTopK);
  for (const int n : {100, 5000, 40, 9000, 3000}) {
    const int64_t coded = kLong - 64;
    std::uniform_int_distribution<int32_t> position(0, static_cast<int32_t>(n));  // repeats
    std::vector<int32_t> ids(n), outliers(n / 10);
    for (int32_t& id : ids) id = position(rng);
    for (int32_t& id : outliers) id = position(rng) + static_cast<int32_t>(n / 2);
    for (int g = 0; g < kKvHeads; ++g) selector.SetOutliers(g, outliers);
    for (int h = 0; h < kQHeads; ++h) selector.SetShortlist(h, ids, coded);
    std::set<int32_t> expected(ids.begin(), ids.end());
    expected.insert(outliers.begin(), outliers.end());
    for (int64_t t = coded; t < kLong; ++t) expected.insert(static_cast<int32_t>(t));
    for (int h = 0; h < kQHeads; ++h) {
      HeadSelection out;
      selector.Select(h, q.data() + h * kDim, kv.view(), &out);
      EXPECT_EQ(out.candidates, static_cast<int32_t>(expected.size())) << n << " ids, head " << h;
      EXPECT_THAT(out.support,
                  UnorderedElementsAreArray(TopKOf(expected, q.data() + h * kDim, kv,
                                                   KvHeadOf(h, kQHeads, kKvHeads), kTopK)))
          << n << " ids, head " << h;
    }
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

// Outliers scored ahead of the shortlists (PlanOutlierScores, ScoreOutliers) leave every
// planned head's support and scores what they are when its Select scores them itself, bit for
// bit, whoever scores which chunk. Five steps whose plans and outliers change (positions outside
// the view, repeats, rows the shortlist holds too):
//   0: three chunks a group, every chunk scored on this thread before the Selects;
//   1: the groups' lists swapped (last step's scores would be wrong), one head of each group
//      planned, one chunk scored on other threads while the planned Selects take the others;
//   2: every head planned, no chunk scored ahead: the Selects take them all;
//   3: group 0's list grown to six chunks, the last wholly outside the view; group 1 planned
//      for none (no chunks);
//   4: group 1's list empty and planned (no chunks), group 0's list shrunk to one chunk.
TEST(ShortlistSelectorTest, OutliersScoredAheadChangeNoSelection) {
  const testing::RandomKv kv(kTokens, kKvHeads, kDim, /*seed=*/11);
  const std::vector<float> q = testing::RandomNormal(kQHeads * kDim, /*seed=*/12);
  const int64_t coded = 280;
  const std::vector<int32_t> ids = {5, 17, 42, 99, 120, 249, 250, 7, -1, 310};
  auto list = [](int count, int g) {
    std::vector<int32_t> out;
    for (int j = 0; j < count; ++j) out.push_back((j * (37 + 2 * g) + g) % 340 - 20);
    return out;
  };
  std::vector<int32_t> grown = list(5 * ShortlistSelector::kOutlierChunk, 0);
  for (int j = 0; j < 60; ++j) grown.push_back(kTokens + j);  // the sixth chunk: past the view
  // [step][group]
  const std::vector<std::vector<std::vector<int32_t>>> outliers = {
      {list(300, 0), list(300, 1)}, {list(300, 1), list(300, 0)}, {list(300, 0), list(300, 1)},
      {grown, list(300, 1)},        {list(100, 0), {}}};
  const std::vector<std::vector<int>> chunks = {{3, 3}, {3, 3}, {3, 3}, {6, 0}, {1, 0}};
  auto planned = [](int step, int h) {
    switch (step) {
      case 1: return h == 0 || h == 3;
      case 3: return KvHeadOf(h, kQHeads, kKvHeads) == 0;
      default: return true;
    }
  };
  auto select_all = [&](ShortlistSelector& selector, std::vector<HeadSelection>* out) {
    out->assign(kQHeads, HeadSelection());
    std::vector<std::thread> threads;
    for (int h = 0; h < kQHeads; ++h) {
      threads.emplace_back(
          [&, h] { selector.Select(h, q.data() + h * kDim, kv.view(), &(*out)[h]); });
    }
    for (std::thread& t : threads) t.join();
  };
  ShortlistSelector reference(Shape(), kTopK);
  ShortlistSelector ahead(Shape(), kTopK);
  for (int step = 0; step < 5; ++step) {
    for (int g = 0; g < kKvHeads; ++g) {
      reference.SetOutliers(g, outliers[step][g]);
      ahead.SetOutliers(g, outliers[step][g]);
    }
    for (int h = 0; h < kQHeads; ++h) {
      reference.SetShortlist(h, ids, coded);
      ahead.SetShortlist(h, ids, coded);
    }
    ahead.PlanOutlierScores(q.data(), [&](int h) { return planned(step, h); });
    std::vector<std::thread> scorers;
    for (int g = 0; g < kKvHeads; ++g) {
      ASSERT_EQ(ahead.OutlierChunks(g), chunks[step][g]) << "step " << step << " group " << g;
      if (step == 0 || step == 3) {
        for (int c = 0; c < chunks[step][g]; ++c) ahead.ScoreOutliers(g, c, kv.view());
      } else if (step == 1) {
        scorers.emplace_back([&, g] { ahead.ScoreOutliers(g, 1, kv.view()); });
      }
    }
    std::vector<HeadSelection> want, got;
    select_all(reference, &want);
    select_all(ahead, &got);
    for (std::thread& t : scorers) t.join();
    for (int h = 0; h < kQHeads; ++h) {
      EXPECT_EQ(got[h].support, want[h].support) << "step " << step << " head " << h;
      EXPECT_EQ(got[h].support_scores, want[h].support_scores)
          << "step " << step << " head " << h;
      EXPECT_EQ(got[h].candidates, want[h].candidates) << "step " << step << " head " << h;
      // Every chunk's outliers are among the candidates, each once.
      std::set<int32_t> expected;
      for (int32_t id : ids) {
        if (id >= 0 && id < coded) expected.insert(id);
      }
      for (int32_t id : outliers[step][KvHeadOf(h, kQHeads, kKvHeads)]) {
        if (id >= 0 && id < coded) expected.insert(id);
      }
      EXPECT_EQ(want[h].candidates, static_cast<int32_t>(expected.size() + kTokens - coded))
          << "step " << step << " head " << h;
    }
  }
  // Held since: the scores of group 0's 700 outliers (step 3) and group 1's 300 for each of
  // their two heads, and the chunks' claims.
  EXPECT_GE(ahead.MemoryBytes(), (2 * 700 + 2 * 300) * static_cast<int64_t>(sizeof(float)));
}

}  // namespace
}  // namespace kvrecall
