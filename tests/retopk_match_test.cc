// ReTopK's cache match on the CPU (ReTopKHead::Match, UnionReuseCandidates,
// QuerySupportCache::AgeOfSlot) against a brute-force reference: cosines, path, the R most
// similar entries and their candidate union over a wrapped FIFO; and Step deciding as Match does.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <set>
#include <span>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "index/retopk.h"
#include "kernels/cpu/attention.h"
#include "tests/test_util.h"

namespace kvrecall {
namespace {

using ::kvrecall::testing::RandomKv;
using ::kvrecall::testing::RandomNormal;
using ::testing::ElementsAreArray;
using ::testing::IsEmpty;

constexpr int kDim = 16;
constexpr int kCapacity = 8;
constexpr int kTokens = 300;

// `size` distinct ids of [0, tokens), in random order.
std::vector<int32_t> RandomSupport(int size, int64_t tokens, std::mt19937_64* rng) {
  std::vector<int32_t> all(tokens);
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), *rng);
  all.resize(size);
  return all;
}

std::vector<int32_t> Vec(std::span<const int32_t> s) { return {s.begin(), s.end()}; }

std::vector<float> Unit(const std::vector<float>& x) {
  std::vector<float> unit(x.size());
  cpu::Normalize(x.data(), static_cast<int>(x.size()), unit.data());
  return unit;
}

// A head whose cache received `pushes` entries (wrapping when pushes > kCapacity); the pushed
// supports in push order.
struct FilledHead {
  FilledHead(const ReTopKHeadParams& params, int pushes, uint64_t seed)
      : head(params, kCapacity, kDim) {
    std::mt19937_64 rng(seed);
    for (int i = 0; i < pushes; ++i) {
      const std::vector<float> unit = Unit(RandomNormal(kDim, seed + 100 + i));
      supports.push_back(RandomSupport(1 + static_cast<int>(rng() % params.top_k), kTokens, &rng));
      head.mutable_cache()->Push(unit.data(), supports.back());
    }
  }
  ReTopKHead head;
  std::vector<std::vector<int32_t>> supports;
};

TEST(ReTopKMatchTest, MatchesBruteForceOverAWrappedCache) {
  ReTopKHeadParams params;
  params.top_k = 24;
  params.reuse_neighbors = 3;
  params.recent_window = 10;
  params.refresh_interval = 0;
  params.tau = 0.6f;
  FilledHead filled(params, kCapacity + 3, 7);
  const QuerySupportCache& cache = filled.head.cache();
  ASSERT_EQ(cache.size(), kCapacity);
  int reuse = 0, fallback = 0;
  for (int trial = 0; trial < 40; ++trial) {
    // Queries near one cached entry (reuse) or random (mostly fallback at this tau).
    std::vector<float> q = RandomNormal(kDim, 1000 + trial);
    if (trial % 2 == 0) {
      const float* near = cache.query(trial % kCapacity);
      for (int j = 0; j < kDim; ++j) q[j] = 0.3f * q[j] + 3.0f * near[j];
    }
    float best = 0;
    const SelectionPath path = filled.head.Match(q.data(), kTokens, /*decode_step=*/trial + 1,
                                                 &best);
    const std::vector<float> unit = Unit(q);
    EXPECT_THAT(std::vector<float>(filled.head.unit_query(), filled.head.unit_query() + kDim),
                ElementsAreArray(unit));
    std::vector<double> cosines(kCapacity);
    for (int age = 0; age < kCapacity; ++age) {
      double dot = 0;
      for (int j = 0; j < kDim; ++j) dot += double{unit[j]} * cache.query(age)[j];
      cosines[age] = dot;
    }
    const double want_best = *std::max_element(cosines.begin(), cosines.end());
    EXPECT_NEAR(best, want_best, 1e-5);
    if (std::abs(want_best - params.tau) < 1e-5) continue;
    ASSERT_EQ(path, want_best >= params.tau ? SelectionPath::kReuse : SelectionPath::kFallback);
    if (path != SelectionPath::kReuse) {
      ++fallback;
      EXPECT_THAT(Vec(filled.head.neighbors()), IsEmpty());
      EXPECT_THAT(Vec(filled.head.candidates()), IsEmpty());
      continue;
    }
    ++reuse;
    std::vector<int32_t> ages(kCapacity);
    std::iota(ages.begin(), ages.end(), 0);
    std::stable_sort(ages.begin(), ages.end(),
                     [&](int32_t a, int32_t b) { return cosines[a] > cosines[b]; });
    ages.resize(params.reuse_neighbors);
    EXPECT_THAT(Vec(filled.head.neighbors()), ElementsAreArray(ages));
    std::set<int32_t> want;
    for (int32_t age : ages) {
      const std::span<const int32_t> s = cache.support(age);
      want.insert(s.begin(), s.end());
    }
    for (int32_t t = kTokens - params.recent_window; t < kTokens; ++t) want.insert(t);
    EXPECT_THAT(Vec(filled.head.candidates()), ElementsAreArray(want));
  }
  EXPECT_GT(reuse, 5);
  EXPECT_GT(fallback, 5);
}

TEST(ReTopKMatchTest, AgeOfSlotFollowsTheFifo) {
  ReTopKHeadParams params;
  params.top_k = 8;
  for (int pushes : {3, kCapacity, kCapacity + 5, 3 * kCapacity + 1}) {
    SCOPED_TRACE(pushes);
    FilledHead filled(params, pushes, 11);
    const QuerySupportCache& cache = filled.head.cache();
    // Entry i went into slot i % C (as on the GPU); the live ones are the last `size`.
    for (int i = pushes - cache.size(); i < pushes; ++i) {
      const int age = cache.AgeOfSlot(i % kCapacity);
      EXPECT_EQ(age, i - (pushes - cache.size()));
      EXPECT_THAT(Vec(cache.support(age)), ElementsAreArray(filled.supports[i]));
    }
  }
}

TEST(ReTopKMatchTest, UnionWithoutNeighborsIsTheWindow) {
  ReTopKHeadParams params;
  FilledHead filled(params, 2, 3);
  std::vector<int32_t> candidates = {99};
  UnionReuseCandidates(filled.head.cache(), {}, /*tokens=*/5, /*window=*/8, &candidates);
  EXPECT_THAT(candidates, ElementsAreArray({0, 1, 2, 3, 4}));
  UnionReuseCandidates(filled.head.cache(), {}, /*tokens=*/50, /*window=*/0, &candidates);
  EXPECT_THAT(candidates, IsEmpty());
}

// Step's decision and candidate count are Match's: the same state, the same query.
TEST(ReTopKMatchTest, StepDecidesAsMatch) {
  ReTopKHeadParams params;
  params.top_k = 16;
  params.refresh_interval = 5;
  params.tau = 0.2f;
  params.scale = 0.25f;
  const RandomKv kv(kTokens, 1, kDim, 5);
  FilledHead matched(params, kCapacity + 1, 9);
  FilledHead stepped(params, kCapacity + 1, 9);
  int reuse = 0;
  for (int step = 1; step <= 20; ++step) {
    std::vector<float> q = RandomNormal(kDim, 500 + step);
    if (step % 3 != 0) {
      const float* near = matched.head.cache().query(step % kCapacity);
      for (int j = 0; j < kDim; ++j) q[j] = 0.2f * q[j] + 2.0f * near[j];
    }
    float best = 0;
    const SelectionPath path = matched.head.Match(q.data(), kv.tokens, step, &best);
    HeadSelection selection;
    stepped.head.Step(q.data(), kv.view(), 0, step, &selection);
    EXPECT_EQ(selection.path, path);
    EXPECT_EQ(selection.best_cosine, best);
    if (path == SelectionPath::kReuse) {
      ++reuse;
      EXPECT_EQ(selection.candidates, static_cast<int32_t>(matched.head.candidates().size()));
    }
    // Keep the two caches alike: Match leaves its cache as it was, Step pushed.
    matched.head.mutable_cache()->Push(matched.head.unit_query(), selection.support);
  }
  EXPECT_GT(reuse, 3);
}

}  // namespace
}  // namespace kvrecall
