#include "index/graph_index.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "index/flat_index.h"
#include "kernels/fidelity.h"
#include "tests/test_util.h"

namespace kvrecall {
namespace {

using ::testing::HasSubstr;

// A planted case where queries are out of distribution for the keys, as attention's are: both
// share `clusters` content directions in dims [0, d/2), but every key also carries a large
// common offset and large noise in dims [d/2, d) that queries do not have. A key's nearest keys
// are decided by that noise; a query's best keys only by content.
struct OodCase {
  OodCase(int64_t tokens, int64_t query_count, int d, int clusters, uint64_t seed)
      : tokens(tokens), d(d), keys(tokens * d), queries(query_count * d) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const int half = d / 2;
    auto unit = [&](int begin, int end) {
      std::vector<float> v(d, 0.0f);
      double norm = 0;
      for (int i = begin; i < end; ++i) norm += (v[i] = normal(rng)) * v[i];
      for (float& x : v) x /= static_cast<float>(std::sqrt(norm));
      return v;
    };
    std::vector<std::vector<float>> centers;
    for (int c = 0; c < clusters; ++c) centers.push_back(unit(0, half));
    const std::vector<float> offset = unit(half, d);
    const float noise = 1.0f / std::sqrt(static_cast<float>(half));
    for (int64_t t = 0; t < tokens; ++t) {
      const std::vector<float>& c = centers[rng() % clusters];
      for (int i = 0; i < d; ++i) {
        keys[t * d + i] = i < half ? 3.0f * c[i] + 1.5f * noise * normal(rng)
                                   : 6.0f * offset[i] + 5.0f * noise * normal(rng);
      }
    }
    for (int64_t n = 0; n < query_count; ++n) {
      const std::vector<float>& c = centers[rng() % clusters];
      for (int i = 0; i < half; ++i) queries[n * d + i] = 4.0f * c[i] + 1.0f * noise * normal(rng);
    }
  }
  VectorSet key_set() const { return VectorSet{keys.data(), tokens, d, d}; }
  VectorSet query_set(int64_t begin, int64_t end) const {
    return VectorSet{queries.data() + begin * d, end - begin, d, d};
  }
  KvView view() const { return KvView{keys.data(), nullptr, tokens, 1, d}; }

  int64_t tokens;
  int d;
  std::vector<float> keys;
  std::vector<float> queries;
};

TEST(GraphIndexTest, OutOfDistributionQueriesFindTheirTopKScanningAFewPercent) {
  const int64_t tokens = 16384;
  const int d = 32, k = 10;
  OodCase ood(tokens, 2048 + 200, d, 64, 7);
  GraphIndexParams params;
  params.build_queries = 2048;
  GraphIndex graph(params);
  ASSERT_TRUE(graph.Build(ood.key_set(), BuildQueries{ood.query_set(0, 2048)}).ok());
  const GraphBuildStats& stats = graph.build_stats();
  EXPECT_EQ(stats.build_queries, 2048);
  EXPECT_EQ(stats.unreachable_keys, 0);
  EXPECT_EQ(graph.linked(), tokens);
  EXPECT_EQ(graph.MemoryBytes(),
            tokens * params.max_degree * static_cast<int64_t>(sizeof(int32_t)) +
                tokens * static_cast<int64_t>(sizeof(uint16_t)));

  // The case is out of distribution: a query's L2-nearest key is rarely among its top-k.
  const VectorSet held_out = ood.query_set(2048, 2048 + 200);
  std::vector<uint8_t> marks;
  double recall = 0, scanned = 0;
  int nearest_in_topk = 0;
  for (int64_t i = 0; i < held_out.count; ++i) {
    const float* q = held_out.row(i);
    const std::vector<int32_t> exact = testing::ReferenceTopK(q, ood.view(), 0, 1.0, k);
    float best = INFINITY;
    int32_t nearest = 0;
    for (int64_t t = 0; t < tokens; ++t) {
      float dist = 0;
      for (int j = 0; j < d; ++j) dist += (q[j] - ood.keys[t * d + j]) * (q[j] - ood.keys[t * d + j]);
      if (dist < best) best = dist, nearest = static_cast<int32_t>(t);
    }
    nearest_in_topk += std::find(exact.begin(), exact.end(), nearest) != exact.end();

    SearchResult result;
    graph.Search(ood.key_set(), q, k, SearchParams{192}, &result);
    recall += SupportRecall(result.ids, exact, tokens, &marks);
    scanned += static_cast<double>(result.stats.scored) / tokens;
    EXPECT_GT(result.stats.hops, 0);
  }
  EXPECT_LT(nearest_in_topk, held_out.count / 10);
  EXPECT_GE(recall / held_out.count, 0.95);
  EXPECT_LE(scanned / held_out.count, 0.07);
}

TEST(GraphIndexTest, LargerListsScoreMoreAndFindMore) {
  OodCase ood(8192, 1024 + 100, 32, 32, 3);
  GraphIndexParams params;
  params.build_queries = 1024;
  GraphIndex graph(params);
  ASSERT_TRUE(graph.Build(ood.key_set(), BuildQueries{ood.query_set(0, 1024)}).ok());
  std::vector<uint8_t> marks;
  double previous_recall = 0, previous_scored = 0;
  for (int list_size : {20, 80, 320}) {
    double recall = 0, scored = 0;
    for (int64_t i = 1024; i < 1124; ++i) {
      const float* q = ood.queries.data() + i * 32;
      SearchResult result;
      graph.Search(ood.key_set(), q, 20, SearchParams{list_size}, &result);
      recall += SupportRecall(result.ids, testing::ReferenceTopK(q, ood.view(), 0, 1.0, 20),
                              8192, &marks);
      scored += result.stats.scored;
    }
    EXPECT_GE(recall, previous_recall) << "list " << list_size;
    EXPECT_GT(scored, previous_scored) << "list " << list_size;
    previous_recall = recall;
    previous_scored = scored;
  }
  EXPECT_GE(previous_recall / 100, 0.97);
}

// Keys planted along their own strong directions, so that each is the top match of a query
// along it; appended after the build, they must be found in the tail and once linked.
TEST(GraphIndexTest, GrowthKeepsEveryAddedKeyFindable) {
  const int d = 32;
  const int64_t prompt = 4096, added = 700;
  OodCase ood(prompt + added, 1024 + 64, d, 32, 5);
  std::mt19937_64 rng(9);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<std::vector<float>> directions;
  for (int64_t t = prompt; t < prompt + added; ++t) {
    std::vector<float> u(d);
    double norm = 0;
    for (float& x : u) norm += (x = normal(rng)) * x;
    for (float& x : u) x /= static_cast<float>(std::sqrt(norm));
    for (int j = 0; j < d; ++j) ood.keys[t * d + j] += 25.0f * u[j];
    directions.push_back(u);
  }
  GraphIndexParams params;
  params.build_queries = 1024;
  params.link_threshold = 256;
  GraphIndex graph(params);
  ASSERT_TRUE(graph.Build(ood.key_set().Slice(0, prompt), BuildQueries{ood.query_set(0, 1024)})
                  .ok());
  const VectorSet recent = ood.query_set(1024, 1024 + 64);

  auto finds = [&](int64_t token, int64_t upto) {
    SearchResult result;
    std::vector<float> q(d);
    for (int j = 0; j < d; ++j) q[j] = 10.0f * directions[token - prompt][j];
    graph.Search(ood.key_set().Slice(0, upto), q.data(), 5, SearchParams{}, &result);
    return std::find(result.ids.begin(), result.ids.end(), token) != result.ids.end();
  };
  // One token at a time, as decode appends them: below the threshold they wait in the tail.
  int64_t upto = prompt;
  int tail_checks = 0;
  while (upto < prompt + added) {
    upto += 1;
    ASSERT_TRUE(graph.Add(ood.key_set().Slice(0, upto), recent).ok());
    EXPECT_EQ(graph.size(), upto);
    if (graph.linked() < upto) {
      ++tail_checks;
      EXPECT_TRUE(finds(upto - 1, upto)) << "tail token " << upto - 1;
    }
  }
  EXPECT_GT(tail_checks, 0);
  EXPECT_EQ(graph.linked(), prompt + 2 * 256);  // two link steps, 188 keys still in the tail
  for (int64_t t = prompt; t < prompt + added; ++t) {
    EXPECT_TRUE(finds(t, upto)) << "token " << t << (t < graph.linked() ? " (linked)" : " (tail)");
  }
  for (int64_t t = prompt; t < graph.linked(); ++t) {
    EXPECT_FALSE(graph.neighbors(t).empty()) << "token " << t;
  }
}

TEST(GraphIndexTest, BuildsWithoutQueriesAndOnEmptyKeys) {
  OodCase ood(2000, 10, 16, 8, 2);
  GraphIndex graph(GraphIndexParams{});
  ASSERT_TRUE(graph.Build(ood.key_set().Slice(0, 0), BuildQueries{}).ok());
  EXPECT_EQ(graph.size(), 0);
  SearchResult result;
  graph.Search(ood.key_set().Slice(0, 0), ood.queries.data(), 5, SearchParams{}, &result);
  EXPECT_TRUE(result.ids.empty());

  // No queries: the keys stand in for them; every key stays reachable.
  ASSERT_TRUE(graph.Build(ood.key_set(), BuildQueries{}).ok());
  EXPECT_EQ(graph.build_stats().unreachable_keys, 0);
  graph.Search(ood.key_set(), ood.queries.data(), 5, SearchParams{2000}, &result);
  EXPECT_EQ(result.ids, testing::ReferenceTopK(ood.queries.data(), ood.view(), 0, 1.0, 5));
}

TEST(GraphIndexTest, RejectsBadInput) {
  OodCase ood(100, 10, 16, 4, 2);
  GraphIndexParams params;
  params.build_topk = 1;
  absl::Status s = GraphIndex(params).Build(ood.key_set(), BuildQueries{});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("build_topk must be >= 2, got 1"));

  GraphIndex graph(GraphIndexParams{});
  s = graph.Build(ood.key_set(), BuildQueries{VectorSet{ood.queries.data(), 10, 8, 8}});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("build query dim 8 differs from key dim 16"));

  ASSERT_TRUE(graph.Build(ood.key_set(), BuildQueries{ood.query_set(0, 10)}).ok());
  s = graph.Add(ood.key_set().Slice(0, 50), VectorSet{});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("holds 100 keys; Add got a set of 50"));
}

}  // namespace
}  // namespace kvrecall
