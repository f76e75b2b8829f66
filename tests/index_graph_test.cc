#include "index/graph_index.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "index/flat_index.h"
#include "kernels/dtype.h"
#include "kernels/fidelity.h"
#include "tests/test_util.h"

namespace kvrecall {
namespace {

using ::kvrecall::testing::StopAfterAsks;
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

// Keys stored in 16 bits (the tiered placement's host KV in the session's dtype): the graph built,
// grown and searched over bf16 / f16 keys is the graph over f32 keys of the same values, and
// finds the same keys with the same scores (rows are widened exactly; the arithmetic is f32).
TEST(GraphIndexTest, SixteenBitKeysGiveTheGraphOfTheirValues) {
  const int64_t tokens = 3000;
  const int d = 32, k = 10;
  OodCase ood(tokens, 400 + 50, d, 16, 17);
  for (const KvElement element : {KvElement::kBf16, KvElement::kF16}) {
    std::vector<uint16_t> narrow(ood.keys.size());
    std::vector<float> wide(ood.keys.size());
    for (size_t i = 0; i < narrow.size(); ++i) {
      narrow[i] = element == KvElement::kBf16 ? FloatToBf16(ood.keys[i]) : FloatToF16(ood.keys[i]);
      wide[i] = element == KvElement::kBf16 ? Bf16ToFloat(narrow[i]) : F16ToFloat(narrow[i]);
    }
    const VectorSet narrow_keys{narrow.data(), tokens, d, d, element};
    const VectorSet wide_keys{wide.data(), tokens, d, d};
    GraphIndexParams params;
    params.build_queries = 400;
    params.link_threshold = 64;
    GraphIndex a(params), b(params);
    // Built over the first 2500 keys, then grown by the rest (linking reads the keys too).
    ASSERT_TRUE(a.Build(narrow_keys.Slice(0, 2500), BuildQueries{ood.query_set(0, 400)}).ok());
    ASSERT_TRUE(b.Build(wide_keys.Slice(0, 2500), BuildQueries{ood.query_set(0, 400)}).ok());
    for (int64_t end = 2600; end <= tokens; end += 100) {
      ASSERT_TRUE(a.Add(narrow_keys.Slice(0, end), ood.query_set(0, 8)).ok());
      ASSERT_TRUE(b.Add(wide_keys.Slice(0, end), ood.query_set(0, 8)).ok());
    }
    ASSERT_EQ(a.linked(), b.linked());
    for (int64_t node = 0; node < a.linked(); node += 97) {
      ASSERT_THAT(a.neighbors(node), ::testing::ElementsAreArray(b.neighbors(node))) << node;
    }
    for (int64_t i = 400; i < 450; ++i) {
      const float* q = ood.queries.data() + i * d;
      SearchResult ra, rb;
      a.Search(narrow_keys, q, k, SearchParams{}, &ra);
      b.Search(wide_keys, q, k, SearchParams{}, &rb);
      EXPECT_EQ(ra.ids, rb.ids) << KvElementName(element) << " query " << i;
      EXPECT_EQ(ra.scores, rb.scores);
      EXPECT_EQ(ra.stats.scored, rb.stats.scored);
    }
  }
}

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
      for (int j = 0; j < d; ++j) {
        dist += (q[j] - ood.keys[t * d + j]) * (q[j] - ood.keys[t * d + j]);
      }
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

// A graph over 8192 out-of-distribution keys built from the first 1024 of ood's queries (the
// other 100 are held out for searching).
GraphIndex BuildOn1024Queries(const OodCase& ood) {
  GraphIndexParams params;
  params.build_queries = 1024;
  GraphIndex graph(params);
  EXPECT_TRUE(graph.Build(ood.key_set(), BuildQueries{ood.query_set(0, 1024)}).ok());
  return graph;
}

TEST(GraphIndexTest, LargerListsScoreMoreAndFindMore) {
  OodCase ood(8192, 1024 + 100, 32, 32, 3);
  GraphIndex graph = BuildOn1024Queries(ood);
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

// Expanding 2-4 candidates a round (their keys fetched together) keeps what strict best-first
// finds: recall within a point at about the same keys scored, the results sorted and distinct;
// a width beyond kMaxSearchWidth is held to it.
TEST(GraphIndexTest, WiderSearchRoundsFindWhatBestFirstFinds) {
  OodCase ood(8192, 1024 + 100, 32, 32, 5);
  GraphIndex graph = BuildOn1024Queries(ood);
  std::vector<uint8_t> marks;
  double recall[kMaxSearchWidth + 2] = {}, scored[kMaxSearchWidth + 2] = {};
  for (int width = 1; width <= kMaxSearchWidth + 1; ++width) {
    for (int64_t i = 1024; i < 1124; ++i) {
      const float* q = ood.queries.data() + i * 32;
      SearchResult result;
      graph.Search(ood.key_set(), q, 50, SearchParams{100, width}, &result);
      ASSERT_EQ(result.ids.size(), 50u);
      EXPECT_TRUE(std::is_sorted(result.scores.begin(), result.scores.end(),
                                 [](float a, float b) { return a > b; }));
      EXPECT_EQ(std::set<int32_t>(result.ids.begin(), result.ids.end()).size(), 50u);
      recall[width] += SupportRecall(result.ids, testing::ReferenceTopK(q, ood.view(), 0, 1.0, 50),
                                     8192, &marks) / 100;
      scored[width] += result.stats.scored / 100.0;
    }
  }
  for (int width = 2; width <= kMaxSearchWidth; ++width) {
    EXPECT_GE(recall[width], recall[1] - 0.01) << "width " << width;
    EXPECT_LE(scored[width], scored[1] * 1.25) << "width " << width;
  }
  EXPECT_EQ(recall[kMaxSearchWidth + 1], recall[kMaxSearchWidth]) << "held to the maximum";
  EXPECT_GE(recall[1], 0.9);
}

// A list shorter than k is a narrow beam: the same search as one for its own list's top
// (the same keys scored, the same hops), whose result goes on past the list with the best of
// the other keys it scored: k distinct keys, best first, the first `list` of them the narrow
// search's own result. It scores fewer keys than a list of k and finds most of the exact top k.
TEST(GraphIndexTest, AListShorterThanKReturnsTheBestKOfEveryKeyScored) {
  OodCase ood(8192, 1024 + 100, 32, 32, 21);
  GraphIndex graph = BuildOn1024Queries(ood);
  std::vector<uint8_t> marks;
  const int k = 80, narrow = 20;
  double recall_narrow = 0, recall_full = 0, scored_narrow = 0, scored_full = 0;
  for (int64_t i = 1024; i < 1124; ++i) {
    const float* q = ood.queries.data() + i * 32;
    SearchResult wide, beam, own;
    graph.Search(ood.key_set(), q, k, SearchParams{narrow}, &wide);
    graph.Search(ood.key_set(), q, narrow, SearchParams{narrow}, &own);
    graph.Search(ood.key_set(), q, k, SearchParams{k}, &beam);
    ASSERT_EQ(wide.ids.size(), static_cast<size_t>(k));
    EXPECT_EQ(std::set<int32_t>(wide.ids.begin(), wide.ids.end()).size(), wide.ids.size());
    EXPECT_TRUE(std::is_sorted(wide.scores.begin(), wide.scores.end(),
                               [](float a, float b) { return a > b; }));
    EXPECT_EQ(std::vector<int32_t>(wide.ids.begin(), wide.ids.begin() + narrow), own.ids);
    EXPECT_EQ(wide.stats.scored, own.stats.scored);
    EXPECT_EQ(wide.stats.hops, own.stats.hops);
    for (size_t j = 0; j < wide.ids.size(); ++j) {
      float score = 0;
      for (int d = 0; d < 32; ++d) score += q[d] * ood.keys[wide.ids[j] * 32 + d];
      EXPECT_NEAR(wide.scores[j], score, 1e-4f * (1 + std::abs(score)));
    }
    const std::vector<int32_t> exact = testing::ReferenceTopK(q, ood.view(), 0, 1.0, k);
    recall_narrow += SupportRecall(wide.ids, exact, 8192, &marks) / 100;
    recall_full += SupportRecall(beam.ids, exact, 8192, &marks) / 100;
    scored_narrow += wide.stats.scored / 100.0;
    scored_full += beam.stats.scored / 100.0;
  }
  EXPECT_LT(scored_narrow, 0.7 * scored_full);
  // The default list is never narrow: max(k, kDefaultSearchListFloor).
  const float* q = ood.queries.data() + 1024 * 32;
  for (int k_default : {80, 300}) {
    SearchResult by_default, explicit_list;
    graph.Search(ood.key_set(), q, k_default, SearchParams{}, &by_default);
    graph.Search(ood.key_set(), q, k_default,
                 SearchParams{std::max(k_default, kDefaultSearchListFloor)}, &explicit_list);
    EXPECT_EQ(by_default.ids, explicit_list.ids) << "k " << k_default;
    EXPECT_EQ(by_default.stats.hops, explicit_list.stats.hops) << "k " << k_default;
  }
  EXPECT_GE(recall_narrow, 0.6);
  EXPECT_GE(recall_full, recall_narrow);
  std::printf("list %d for k = %d: recall %.3f scoring %.0f keys; list %d: %.3f, %.0f keys\n",
              narrow, k, recall_narrow, scored_narrow, k, recall_full, scored_full);
}

// Lists long enough to fill many of the search pool's 64-entry blocks (splits) and to drop
// entries from a full pool: the list is still the best `list` keys of every key the search
// scored (the first `list` of a narrow beam's result, which takes the best of every scored key),
// best first, each key once.
TEST(GraphIndexTest, LongListsAreTheBestOfEveryKeyScored) {
  OodCase ood(8192, 1024 + 20, 32, 32, 23);
  GraphIndex graph = BuildOn1024Queries(ood);
  for (int list : {65, 300, 1000}) {
    for (int64_t i = 1024; i < 1044; ++i) {
      const float* q = ood.queries.data() + i * 32;
      SearchResult own, every;
      graph.Search(ood.key_set(), q, list, SearchParams{list}, &own);
      graph.Search(ood.key_set(), q, 8192, SearchParams{list}, &every);
      ASSERT_EQ(own.ids.size(), static_cast<size_t>(list));
      ASSERT_EQ(static_cast<int64_t>(every.ids.size()), every.stats.scored);
      EXPECT_EQ(every.stats.hops, own.stats.hops);
      EXPECT_EQ(std::vector<int32_t>(every.ids.begin(), every.ids.begin() + list), own.ids)
          << "list " << list;
      EXPECT_EQ(std::set<int32_t>(own.ids.begin(), own.ids.end()).size(), own.ids.size());
      EXPECT_TRUE(std::is_sorted(own.scores.begin(), own.scores.end(),
                                 [](float a, float b) { return a > b; }));
      // Every kept key was expanded: a search ends when none in its list is left unexpanded.
      EXPECT_GE(own.stats.hops, list);
    }
  }
}

// Keys planted along their own strong directions, so that each is the top match of a query
// along it; appended after the build, they must be found in the tail and once linked, whether
// each Add links one key (the default) or the whole tail at the threshold (the old batch).
class GraphGrowthTest : public ::testing::TestWithParam<int> {};

TEST_P(GraphGrowthTest, GrowthKeepsEveryAddedKeyFindable) {
  const int link_batch = GetParam();
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
  params.link_batch = link_batch;
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
  if (link_batch >= 256) {
    EXPECT_EQ(graph.linked(), prompt + 2 * 256);  // two link steps, 188 keys still in the tail
  } else {
    EXPECT_EQ(graph.linked(), prompt + added - 255);  // the tail stays one under the threshold
  }
  for (int64_t t = prompt; t < prompt + added; ++t) {
    EXPECT_TRUE(finds(t, upto)) << "token " << t << (t < graph.linked() ? " (linked)" : " (tail)");
  }
  for (int64_t t = prompt; t < graph.linked(); ++t) {
    EXPECT_FALSE(graph.neighbors(t).empty()) << "token " << t;
  }
}

INSTANTIATE_TEST_SUITE_P(LinkBatches, GraphGrowthTest, ::testing::Values(1, 256));

// A graph over the first `prompt` keys of `ood`, built from its first `build_queries` queries,
// that links `link_batch` keys per Add once `link_threshold` wait.
std::unique_ptr<GraphIndex> GrowingGraph(const OodCase& ood, int64_t prompt, int build_queries,
                                         int link_threshold, int link_batch) {
  GraphIndexParams params;
  params.build_queries = build_queries;
  params.link_threshold = link_threshold;
  params.link_batch = link_batch;
  auto graph = std::make_unique<GraphIndex>(params);
  EXPECT_TRUE(graph->Build(ood.key_set().Slice(0, prompt),
                           BuildQueries{ood.query_set(0, build_queries)})
                  .ok());
  return graph;
}

// Issue 15: an Add's linking work is bounded. Once the tail holds link_threshold keys, every
// one-key Add links exactly link_batch keys and searches at most one recent query (the batch
// linking's rate, recent_queries per link_threshold keys), the tail never reaches the threshold
// after an Add, and a burst links as many keys as it appended.
TEST(GraphIndexTest, IncrementalLinkingBoundsEachAddAndTheTail) {
  const int d = 32;
  const int64_t prompt = 2048, added = 1200;
  OodCase ood(prompt + added + 600, 512 + 32, d, 16, 11);
  const std::unique_ptr<GraphIndex> owned = GrowingGraph(ood, prompt, 512, 64, 2);
  GraphIndex& graph = *owned;
  const VectorSet recent = ood.query_set(512, 512 + 32);
  int64_t linked_total = 0, searches_total = 0;
  for (int64_t upto = prompt + 1; upto <= prompt + added; ++upto) {
    const int64_t tail_before = graph.size() - graph.linked();
    const int64_t expected = tail_before + 1 >= 64 ? 2 : 0;
    EXPECT_EQ(graph.KeysToLink(upto), expected);
    ASSERT_TRUE(graph.Add(ood.key_set().Slice(0, upto), recent).ok());
    const GraphLinkStats& link = graph.last_link();
    EXPECT_EQ(link.linked_keys, expected) << "key " << upto - 1;
    EXPECT_LE(link.projection_queries, 1);
    EXPECT_LT(graph.size() - graph.linked(), 64);
    linked_total += link.linked_keys;
    searches_total += link.projection_queries;
  }
  // 32 recent queries per 64 keys linked: one search per 2 keys.
  EXPECT_EQ(linked_total, graph.linked() - prompt);
  EXPECT_NEAR(static_cast<double>(searches_total), linked_total / 2.0, 1.0);
  // A burst of 600 keys links 600 (at least what it appended), with each recent query once.
  const int64_t tail_before = graph.size() - graph.linked();
  ASSERT_TRUE(graph.Add(ood.key_set(), recent).ok());
  EXPECT_EQ(graph.last_link().linked_keys, 600);
  EXPECT_EQ(graph.last_link().projection_queries, 32);
  EXPECT_EQ(graph.size() - graph.linked(), tail_before);
}

// link_batch >= link_threshold is the batch linking from before issue 15: an Add that brings the
// tail to the threshold links all of it, whatever it appended, with every recent query.
TEST(GraphIndexTest, BatchLinkingLinksTheWholeTail) {
  const int d = 16;
  const int64_t prompt = 1024;
  OodCase ood(prompt + 400, 256 + 32, d, 8, 13);
  const std::unique_ptr<GraphIndex> owned = GrowingGraph(ood, prompt, 256, 64, 64);
  GraphIndex& graph = *owned;
  const VectorSet recent = ood.query_set(256, 256 + 32);
  for (int64_t upto = prompt + 1; upto <= prompt + 63; ++upto) {
    ASSERT_TRUE(graph.Add(ood.key_set().Slice(0, upto), recent).ok());
    EXPECT_EQ(graph.last_link().linked_keys, 0);
  }
  ASSERT_TRUE(graph.Add(ood.key_set().Slice(0, prompt + 64), recent).ok());
  EXPECT_EQ(graph.last_link().linked_keys, 64);
  EXPECT_EQ(graph.last_link().projection_queries, 32);
  EXPECT_EQ(graph.linked(), prompt + 64);
  // 50 keys wait; a burst of 100 links all 150 (the rationed rule would link its 100 alone).
  ASSERT_TRUE(graph.Add(ood.key_set().Slice(0, prompt + 114), recent).ok());
  EXPECT_EQ(graph.last_link().linked_keys, 0);
  EXPECT_EQ(graph.KeysToLink(prompt + 214), 150);
  ASSERT_TRUE(graph.Add(ood.key_set().Slice(0, prompt + 214), recent).ok());
  EXPECT_EQ(graph.last_link().linked_keys, 150);
  EXPECT_EQ(graph.last_link().projection_queries, 32);
  EXPECT_EQ(graph.linked(), graph.size());
}

// Issue 15: linking one key per Add finds what the batch linking finds. Two graphs over the
// same prompt grow by the same 3000 keys, one key per Add with the latest 32 queries as a
// decode step gives them; then held-out queries search both against a brute-force reference,
// over every key and over the grown keys alone (what linking decides).
TEST(GraphIndexTest, IncrementalLinkingRecallMatchesBatchLinking) {
  const int d = 32, k = 10;
  const int64_t prompt = 4096, added = 3000;
  const int64_t tokens = prompt + added;
  OodCase ood(tokens, 1024 + added + 200, d, 48, 21);
  auto grow = [&](int link_batch) {
    std::unique_ptr<GraphIndex> graph = GrowingGraph(ood, prompt, 1024, 256, link_batch);
    for (int64_t i = 1; i <= added; ++i) {
      const int64_t q_end = 1024 + i;
      const VectorSet recent = ood.query_set(std::max<int64_t>(1024, q_end - 32), q_end);
      EXPECT_TRUE(graph->Add(ood.key_set().Slice(0, prompt + i), recent).ok());
    }
    return graph;
  };
  const std::unique_ptr<GraphIndex> batch = grow(256);
  const std::unique_ptr<GraphIndex> incremental = grow(1);
  EXPECT_EQ(incremental->linked(), tokens - 255);
  EXPECT_EQ(batch->linked(), prompt + 11 * 256);

  // The grown keys alone: a query's top-k among them, searched as the top-k of all keys
  // restricted to them would hide them behind prompt keys, so the reference and the index are
  // both asked for the best 4k and scored on the grown ones.
  std::vector<uint8_t> marks;
  double recall[2] = {0, 0}, grown_recall[2] = {0, 0};
  const VectorSet held_out = ood.query_set(1024 + added, 1024 + added + 200);
  for (int64_t i = 0; i < held_out.count; ++i) {
    const float* q = held_out.row(i);
    const std::vector<int32_t> exact = testing::ReferenceTopK(q, ood.view(), 0, 1.0, k);
    std::vector<int32_t> exact_grown;
    for (int32_t id : testing::ReferenceTopK(q, ood.view(), 0, 1.0, 4 * k)) {
      if (id >= prompt) exact_grown.push_back(id);
    }
    for (int g = 0; g < 2; ++g) {
      const GraphIndex& graph = g == 0 ? *batch : *incremental;
      SearchResult result;
      graph.Search(ood.key_set(), q, k, SearchParams{64}, &result);
      recall[g] += SupportRecall(result.ids, exact, tokens, &marks);
      graph.Search(ood.key_set(), q, 4 * k, SearchParams{64}, &result);
      grown_recall[g] += SupportRecall(result.ids, exact_grown, tokens, &marks);
    }
  }
  for (int g = 0; g < 2; ++g) {
    recall[g] /= held_out.count;
    grown_recall[g] /= held_out.count;
  }
  RecordProperty("recall_batch", std::to_string(recall[0]));
  RecordProperty("recall_incremental", std::to_string(recall[1]));
  RecordProperty("grown_recall_batch", std::to_string(grown_recall[0]));
  RecordProperty("grown_recall_incremental", std::to_string(grown_recall[1]));
  std::printf("recall@%d batch %.4f incremental %.4f; grown keys batch %.4f incremental %.4f\n",
              k, recall[0], recall[1], grown_recall[0], grown_recall[1]);
  // Tolerance: one point of recall below the batch linking.
  EXPECT_GE(recall[1], recall[0] - 0.01);
  EXPECT_GE(grown_recall[1], grown_recall[0] - 0.01);
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

  // Lists from elsewhere (BuildFromLists): of the wrong k, holding a key beyond the keys, or
  // with a query sum of another dim, they are refused and the graph stays as it was.
  std::vector<std::vector<int32_t>> rows;
  for (int64_t i = 0; i < graph.linked(); ++i) {
    rows.emplace_back(graph.neighbors(i).begin(), graph.neighbors(i).end());
  }
  TopKLists lists;
  ASSERT_TRUE(CpuBatchTopK(ood.query_set(0, 10), ood.key_set(), 100, &lists).ok());
  const std::vector<float> sum(16, 1.0f);
  TopKLists short_lists = lists;
  short_lists.k = 50;
  short_lists.ids.resize(10 * 50);
  s = graph.BuildFromLists(ood.key_set().Slice(0, 60), sum, lists, 0.0);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("expected lists of 60"));
  s = graph.BuildFromLists(ood.key_set(), sum, short_lists, 0.0);
  EXPECT_THAT(s.message(),
              HasSubstr("10 top-k lists of 50 ids (500 in all): expected lists of 100"));
  TopKLists beyond = lists;
  beyond.ids[7] = 100;
  s = graph.BuildFromLists(ood.key_set(), sum, beyond, 0.0);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("holding key 100 of 100"));
  s = graph.BuildFromLists(ood.key_set(), std::vector<float>(8, 1.0f), lists, 0.0);
  EXPECT_THAT(s.message(), HasSubstr("query sum of 8 dims over keys of 16"));
  EXPECT_EQ(graph.size(), 100);
  for (int64_t i = 0; i < graph.linked(); ++i) {
    EXPECT_EQ(std::vector<int32_t>(graph.neighbors(i).begin(), graph.neighbors(i).end()),
              rows[i]);
  }
}

// Build is its steps apart: the sampled queries, their top-k lists, and the graph from those.
TEST(GraphIndexTest, BuildFromListsIsBuildsLastStep) {
  OodCase ood(3000, 700, 16, 4, 5);
  GraphIndexParams params;
  params.build_queries = 256;
  BuildQueries queries{ood.query_set(0, 700), /*causal=*/true, /*first_key_position=*/40};
  GraphIndex built(params), from_lists(params);
  ASSERT_TRUE(built.Build(ood.key_set(), queries).ok());
  const int64_t sampled = GraphIndex::SampledQueryCount(params, 3000, queries);
  EXPECT_EQ(sampled, 256);
  std::vector<float> copies(sampled * 16);
  std::vector<int64_t> visible;
  const std::vector<float> sum =
      GraphIndex::SampleQueries(params, ood.key_set(), queries, copies.data(), &visible);
  ASSERT_EQ(visible.size(), 256u);
  // Query i sits at token 700 * i / 256 and saw the keys up to it (key 0 is token 40).
  EXPECT_EQ(visible[255], 700 * 255 / 256 - 40 + 1);
  TopKLists lists;
  ASSERT_TRUE(CpuBatchTopK(VectorSet{copies.data(), sampled, 16, 16}, ood.key_set(),
                           GraphIndexParams().build_topk, &lists, visible)
                  .ok());
  ASSERT_TRUE(from_lists.BuildFromLists(ood.key_set(), sum, lists, 0.5).ok());
  EXPECT_EQ(from_lists.build_stats().topk_seconds, 0.5);
  ASSERT_EQ(from_lists.linked(), built.linked());
  for (int64_t i = 0; i < built.linked(); ++i) {
    EXPECT_EQ(std::vector<int32_t>(from_lists.neighbors(i).begin(), from_lists.neighbors(i).end()),
              std::vector<int32_t>(built.neighbors(i).begin(), built.neighbors(i).end()))
        << "key " << i;
  }
}

// A build nobody will use stops (index/build_stop.h): BuildFromLists asks before each of its
// steps, and a stop requested at any of them ends the build with CANCELLED and the index empty;
// a stop never requested is asked at every step and builds the graph a plain build does.
TEST(GraphIndexTest, AStopEndsBuildFromListsBeforeItsNextStepAndLeavesItEmpty) {
  OodCase ood(3000, 700, 16, 4, 5);
  GraphIndexParams params;
  params.build_queries = 256;
  const BuildQueries queries{ood.query_set(0, 700), /*causal=*/true, /*first_key_position=*/0};
  const int64_t sampled = GraphIndex::SampledQueryCount(params, 3000, queries);
  std::vector<float> copies(sampled * 16);
  std::vector<int64_t> visible;
  const std::vector<float> sum =
      GraphIndex::SampleQueries(params, ood.key_set(), queries, copies.data(), &visible);
  TopKLists lists;
  ASSERT_TRUE(CpuBatchTopK(VectorSet{copies.data(), sampled, 16, 16}, ood.key_set(),
                           GraphIndexParams().build_topk, &lists, visible)
                  .ok());
  GraphIndex plain(params);
  ASSERT_TRUE(plain.BuildFromLists(ood.key_set(), sum, lists, 0.0).ok());

  StopAfterAsks never(0);
  GraphIndex asked(params);
  ASSERT_TRUE(asked.BuildFromLists(ood.key_set(), sum, lists, 0.0, never.stop()).ok());
  const int steps = never.asks();
  EXPECT_GE(steps, 5) << "asked between the build's steps";
  ASSERT_EQ(asked.linked(), plain.linked());
  for (int64_t i = 0; i < plain.linked(); ++i) {
    ASSERT_EQ(std::vector<int32_t>(asked.neighbors(i).begin(), asked.neighbors(i).end()),
              std::vector<int32_t>(plain.neighbors(i).begin(), plain.neighbors(i).end()))
        << "key " << i;
  }

  for (int from = 1; from <= steps; ++from) {
    SCOPED_TRACE(from);
    StopAfterAsks stop(from);
    GraphIndex graph(params);
    const absl::Status s = graph.BuildFromLists(ood.key_set(), sum, lists, 0.0, stop.stop());
    EXPECT_EQ(s.code(), absl::StatusCode::kCancelled) << s;
    EXPECT_THAT(s.message(), HasSubstr("the graph build stopped"));
    EXPECT_EQ(stop.asks(), from) << "nothing asked after it stopped";
    EXPECT_EQ(graph.size(), 0);
    EXPECT_EQ(graph.linked(), 0);
    EXPECT_EQ(graph.MemoryBytes(), 0) << "a stopped build holds nothing";
    SearchResult result;
    graph.Search(ood.key_set().Slice(0, 0), ood.queries.data(), 5, SearchParams{}, &result);
    EXPECT_TRUE(result.ids.empty());
  }
}

}  // namespace
}  // namespace kvrecall
