#include "index/index_selector.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "client/trace/synthetic.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "index/basic_selectors.h"
#include "index/batch_topk.h"
#include "kernels/cpu/attention.h"
#include "kernels/fidelity.h"
#include "tests/test_util.h"

namespace kvrecall {
namespace {

using ::kvrecall::testing::StopAfterAsks;
using ::testing::HasSubstr;
using ::testing::IsSupersetOf;

// One layer of a synthetic trace (sinks, recency, topics, queries out of distribution for the
// keys), its prompt and decode steps held as f32 with room for the decode tokens.
struct Layer {
  explicit Layer(const SyntheticTraceParams& params) : trace(*SyntheticTrace::Create(params)) {
    const TraceGeometry g = trace.geometry();
    const int64_t total = g.context + g.decode_steps;
    const int64_t kv_row = static_cast<int64_t>(g.kv_heads) * g.head_dim;
    const int64_t q_row = static_cast<int64_t>(g.q_heads) * g.head_dim;
    keys.resize(total * kv_row);
    values.resize(total * kv_row);
    prompt_q.resize(g.context * q_row);
    decode_q.resize(g.decode_steps * q_row);
    trace.GenerateRows(0, TracePhase::kPrefill, TraceTensor::kK, 0, g.context, keys.data());
    trace.GenerateRows(0, TracePhase::kPrefill, TraceTensor::kV, 0, g.context, values.data());
    trace.GenerateRows(0, TracePhase::kPrefill, TraceTensor::kQ, 0, g.context, prompt_q.data());
    trace.GenerateRows(0, TracePhase::kDecode, TraceTensor::kK, 0, g.decode_steps,
                       keys.data() + g.context * kv_row);
    trace.GenerateRows(0, TracePhase::kDecode, TraceTensor::kV, 0, g.decode_steps,
                       values.data() + g.context * kv_row);
    trace.GenerateRows(0, TracePhase::kDecode, TraceTensor::kQ, 0, g.decode_steps,
                       decode_q.data());
    shape = LayerShape{g.q_heads, g.kv_heads, g.head_dim,
                       1.0f / std::sqrt(static_cast<float>(g.head_dim))};
  }
  KvView view(int64_t tokens) const {
    return KvView{keys.data(), values.data(), tokens, shape.kv_heads, shape.head_dim};
  }
  const float* decode_query(int64_t step, int head) const {
    return decode_q.data() + (step * shape.q_heads + head) * shape.head_dim;
  }

  SyntheticTrace trace;
  LayerShape shape;
  std::vector<float> keys, values, prompt_q, decode_q;
};

SyntheticTraceParams SmallTrace() {
  SyntheticTraceParams p;
  p.context = 6144;
  p.decode_steps = 40;
  p.q_heads = 4;
  p.kv_heads = 2;
  p.needles = 4;
  p.seed = 17;
  return p;
}

SelectorParams IndexParams(int list_size, GraphScope scope = GraphScope::kDefault) {
  SelectorParams params;
  params.kind = SelectorKind::kIndex;
  params.top_k = 64;
  params.sinks = 16;
  params.recent = 128;
  params.index.build_queries = 2048;
  params.index.search_list_size = list_size;
  params.index.link_threshold = 16;
  params.index.graph_scope = scope;
  return params;
}

// The tests that hold for either graph scope run for both: one graph per KV head, shared by its
// query heads, and one per query head.
class IndexSelectorScopeTest : public ::testing::TestWithParam<GraphScope> {};

INSTANTIATE_TEST_SUITE_P(Scopes, IndexSelectorScopeTest,
                         ::testing::Values(GraphScope::kKvHead, GraphScope::kQueryHead),
                         [](const ::testing::TestParamInfo<GraphScope>& info) {
                           return std::string(GraphScopeName(info.param));
                         });

// The bound the Prefill reserves before building (SelectorStateBytesBound) covers what a build
// holds: each graph (one per KV head or per query head) is exactly GraphIndex::GraphBytes of its
// bulk once built, and the bound adds the rings of recent queries and a build's scratch on top.
TEST_P(IndexSelectorScopeTest, MemoryBoundCoversWhatABuildHolds) {
  const Layer layer(SmallTrace());
  const int graphs =
      GetParam() == GraphScope::kKvHead ? layer.shape.kv_heads : layer.shape.q_heads;
  for (int max_degree : {16, 64}) {
    for (int64_t prompt : {int64_t{0}, int64_t{100}, int64_t{6144}}) {
      SCOPED_TRACE(::testing::Message() << "max_degree " << max_degree << ", prompt " << prompt);
      SelectorParams params = IndexParams(128, GetParam());
      params.index.max_degree = max_degree;
      IndexSelector selector(layer.shape, params);
      ASSERT_TRUE(selector.Build(layer.view(prompt), layer.prompt_q.data()).ok());
      const int64_t bulk = BulkTokens(prompt, params.sinks, params.recent);
      ASSERT_EQ(selector.graph_count(), graphs);
      int64_t graph_bytes = 0;
      for (int i = 0; i < graphs; ++i) {
        EXPECT_EQ(selector.graph(i).MemoryBytes(), GraphIndex::GraphBytes(params.index, bulk));
        graph_bytes += selector.graph(i).MemoryBytes();
      }
      // The graphs and, per query head, its 32 recent decode queries and their count.
      EXPECT_EQ(selector.MemoryBytes(),
                graph_bytes + layer.shape.q_heads * (32 * layer.shape.head_dim * 4 + 8));
      const int threads = omp_get_max_threads();
      const int64_t bound = SelectorStateBytesBound(params, layer.shape, prompt, threads);
      EXPECT_EQ(bound, IndexSelector::MemoryBytesBound(layer.shape, params, prompt, threads));
      EXPECT_LE(selector.MemoryBytes(), bound);
      if (bulk > 0) {
        // The projection's grouped edges alone: every sampled query of the graph's heads (an
        // equal share of build_queries each), its list, five 4-byte targets per member, and
        // every head's lists (4-byte ids).
        const int heads_per_graph = layer.shape.q_heads / graphs;
        const int64_t sampled =
            std::min<int64_t>(params.index.build_queries / heads_per_graph, prompt);
        const int64_t k = std::min<int64_t>(GraphIndexParams().build_topk, bulk);
        EXPECT_GE(bound - selector.MemoryBytes(),
                  heads_per_graph * sampled * k * 5 * 4 + layer.shape.q_heads * sampled * k * 4);
      }
    }
  }
}

// Every graph, row by row.
std::vector<std::vector<int32_t>> Graphs(const IndexSelector& selector) {
  std::vector<std::vector<int32_t>> rows;
  for (int g = 0; g < selector.graph_count(); ++g) {
    const GraphIndex& index = selector.graph(g);
    for (int64_t i = 0; i < index.linked(); ++i) {
      rows.emplace_back(index.neighbors(i).begin(), index.neighbors(i).end());
    }
  }
  return rows;
}

// Query head h's prompt queries as a graph build takes them.
BuildQueries HeadBuildQueries(const Layer& layer, const SelectorParams& params, int h) {
  BuildQueries queries;
  queries.queries = VectorSet{layer.prompt_q.data() + h * layer.shape.head_dim,
                              layer.trace.geometry().context,
                              layer.shape.q_heads * layer.shape.head_dim, layer.shape.head_dim};
  queries.causal = true;
  queries.first_key_position = params.sinks;
  return queries;
}

// Builds a selector of `params` over the layer's prompt on all the threads, on one, and on
// twice as many as there are KV heads (with a graph per KV head: fewer graphs than threads, so
// each builds on two threads of its own), each with CpuBatchTopK and with a batch top-k that is
// not it (the GPU's stand-in, which runs on a thread of its own), and expects every build's
// graphs to be `want` and a KV head's query heads to share one batch top-k.
void ExpectEveryBuildMakes(const Layer& layer, const SelectorParams& params,
                           const std::vector<std::vector<int32_t>>& want) {
  const KvView kv = layer.view(layer.trace.geometry().context);
  std::atomic<int> calls = 0;
  const BatchTopKFunction elsewhere = [&calls](const VectorSet& queries, const VectorSet& keys,
                                               int k, TopKLists* out,
                                               std::span<const int64_t> visible,
                                               const BuildStop& stop) {
    ++calls;
    return CpuBatchTopK(queries, keys, k, out, visible, stop);
  };
  for (const int threads : {omp_get_max_threads(), 1, 2 * layer.shape.kv_heads}) {
    SCOPED_TRACE(::testing::Message() << threads << " threads");
    for (const BatchTopKFunction& topk : {BatchTopKFunction(CpuBatchTopK), elsewhere}) {
      calls = 0;
      IndexSelector selector(layer.shape, params, /*bulk_only=*/false, topk);
      const int saved = omp_get_max_threads();
      omp_set_num_threads(threads);
      const absl::Status built = selector.Build(kv, layer.prompt_q.data());
      omp_set_num_threads(saved);
      ASSERT_TRUE(built.ok()) << built;
      EXPECT_EQ(Graphs(selector), want);
    }
    EXPECT_EQ(calls, layer.shape.kv_heads);
  }
}

// A KV head's query heads share one batch top-k. A batch top-k that is not CpuBatchTopK (the
// GPU's) runs on a thread of its own, one KV head after another, while the heads whose lists
// are ready build; with one thread, a KV head's lists come just before its heads. Either way
// the graphs are those of each head's own Build.
TEST(IndexSelectorTest, KvHeadsShareABatchTopKAndTheGraphsAreTheHeadsOwn) {
  const Layer layer(SmallTrace());
  const SelectorParams params = IndexParams(128, GraphScope::kQueryHead);
  const int64_t prompt = layer.trace.geometry().context;
  const KvView kv = layer.view(prompt);
  std::vector<std::vector<int32_t>> own;
  for (int h = 0; h < layer.shape.q_heads; ++h) {
    GraphIndex index(params.index);
    ASSERT_TRUE(index.Build(VectorSet::KeysOf(kv, KvHeadOf(h, 4, 2), params.sinks,
                                              prompt - params.recent),
                            HeadBuildQueries(layer, params, h))
                    .ok());
    for (int64_t i = 0; i < index.linked(); ++i) {
      own.emplace_back(index.neighbors(i).begin(), index.neighbors(i).end());
    }
  }
  ExpectEveryBuildMakes(layer, params, own);
}

// One graph per KV head: it is the graph that GraphIndex::BuildFromLists makes from the top-k
// lists of all its query heads' sampled queries (build_queries in all, an equal share of each
// head's prompt queries) and their sum, whichever thread computes the lists and however many
// threads build.
TEST(IndexSelectorTest, AKvHeadsGraphIsBuiltFromAllItsQueryHeadsLists) {
  const Layer layer(SmallTrace());
  const SelectorParams params = IndexParams(128, GraphScope::kKvHead);
  const int64_t prompt = layer.trace.geometry().context;
  const KvView kv = layer.view(prompt);
  const int d = layer.shape.head_dim;
  const int group = layer.shape.q_heads / layer.shape.kv_heads;
  GraphIndexParams head_sampling = params.index;
  head_sampling.build_queries = params.index.build_queries / group;
  std::vector<std::vector<int32_t>> pooled;
  for (int kv_head = 0; kv_head < layer.shape.kv_heads; ++kv_head) {
    const VectorSet keys =
        VectorSet::KeysOf(kv, kv_head, params.sinks, prompt - params.recent);
    std::vector<float> queries, sum(d, 0.0f);
    std::vector<int64_t> visible;
    for (int h = kv_head * group; h < (kv_head + 1) * group; ++h) {
      const BuildQueries head_queries = HeadBuildQueries(layer, params, h);
      const int64_t count = GraphIndex::SampledQueryCount(head_sampling, keys.count, head_queries);
      const size_t at = queries.size();
      queries.resize(at + count * d);
      const std::vector<float> head_sum = GraphIndex::SampleQueries(
          head_sampling, keys, head_queries, queries.data() + at, &visible);
      for (int j = 0; j < d; ++j) sum[j] += head_sum[j];
    }
    TopKLists lists;
    ASSERT_TRUE(CpuBatchTopK(VectorSet{queries.data(), static_cast<int64_t>(queries.size()) / d,
                                       d, d},
                             keys, GraphIndexParams().build_topk, &lists, visible)
                    .ok());
    EXPECT_EQ(lists.queries, params.index.build_queries);
    GraphIndex index(params.index);
    ASSERT_TRUE(index.BuildFromLists(keys, sum, lists, 0.0).ok());
    for (int64_t i = 0; i < index.linked(); ++i) {
      pooled.emplace_back(index.neighbors(i).begin(), index.neighbors(i).end());
    }
  }
  ExpectEveryBuildMakes(layer, params, pooled);
  IndexSelector selector(layer.shape, params);
  ASSERT_TRUE(selector.Build(kv, layer.prompt_q.data()).ok());
  ASSERT_EQ(selector.graph_count(), layer.shape.kv_heads);
  for (int h = 0; h < layer.shape.q_heads; ++h) {
    EXPECT_EQ(&selector.head_index(h), &selector.graph(KvHeadOf(h, 4, 2)));
  }
  EXPECT_EQ(selector.graph(0).build_stats().build_queries, params.index.build_queries);
}

TEST_P(IndexSelectorScopeTest, ABatchTopKErrorFailsTheBuild) {
  const Layer layer(SmallTrace());
  const int64_t prompt = layer.trace.geometry().context;
  std::atomic<int> calls = 0;
  // The second KV head's batch top-k fails.
  const BatchTopKFunction failing = [&calls](const VectorSet& queries, const VectorSet& keys,
                                             int k, TopKLists* out,
                                             std::span<const int64_t> visible,
                                             const BuildStop& stop) {
    if (++calls == 2) return absl::ResourceExhaustedError("device out of memory");
    return CpuBatchTopK(queries, keys, k, out, visible, stop);
  };
  for (const int threads : {omp_get_max_threads(), 1}) {
    calls = 0;
    IndexSelector selector(layer.shape, IndexParams(128, GetParam()), /*bulk_only=*/false,
                           failing);
    const int saved = omp_get_max_threads();
    omp_set_num_threads(threads);
    const absl::Status built = selector.Build(layer.view(prompt), layer.prompt_q.data());
    omp_set_num_threads(saved);
    EXPECT_EQ(built.code(), absl::StatusCode::kResourceExhausted) << threads << " threads";
    EXPECT_EQ(built.message(), "device out of memory");
  }
}

TEST_P(IndexSelectorScopeTest, SupportIsTheStaticSetPlusTheIndexResults) {
  const Layer layer(SmallTrace());
  const SelectorParams params = IndexParams(128, GetParam());
  absl::StatusOr<std::unique_ptr<SupportSelector>> made = MakeSelector(params, layer.shape);
  ASSERT_TRUE(made.ok()) << made.status();
  auto* selector = dynamic_cast<IndexSelector*>(made->get());
  ASSERT_NE(selector, nullptr);
  const int64_t prompt = layer.trace.geometry().context;
  ASSERT_TRUE(selector->Build(layer.view(prompt), layer.prompt_q.data()).ok());
  EXPECT_GT(selector->MemoryBytes(), 0);

  const KvView kv = layer.view(prompt + 1);
  selector->OnAppend(kv);
  for (int h = 0; h < layer.shape.q_heads; ++h) {
    HeadSelection selection;
    selector->Select(h, layer.decode_query(0, h), kv, &selection);
    std::vector<int32_t> static_set;
    AppendStaticSet(kv.tokens, params.sinks, params.recent, &static_set);
    // The index over the bulk [sinks, tokens - recent), searched the same way.
    const int64_t bulk_end = kv.tokens - params.recent;
    const GraphIndex& index = selector->head_index(h);
    ASSERT_EQ(index.size(), bulk_end - params.sinks);
    SearchResult result;
    index.Search(VectorSet::KeysOf(kv, KvHeadOf(h, 4, 2), params.sinks, bulk_end),
                 layer.decode_query(0, h), params.top_k, SearchParams{128}, &result);
    std::vector<int32_t> expected = static_set;
    for (int32_t id : result.ids) expected.push_back(static_cast<int32_t>(params.sinks + id));
    std::vector<int32_t> support = selection.support;
    std::sort(support.begin(), support.end());
    std::sort(expected.begin(), expected.end());
    EXPECT_EQ(support, expected) << "head " << h;
    EXPECT_EQ(std::set<int32_t>(support.begin(), support.end()).size(), support.size());
    EXPECT_EQ(selection.candidates, result.stats.scored);
    EXPECT_EQ(selection.path, SelectionPath::kExact);
  }
}

// The tiered bulk (bulk_only): the support is the search's tokens alone, and each comes with the
// score the search gave it, bit for bit what cpu::ScoreTokens gives (the attention then skips
// scoring them again); the CPU placement's support holds the static set and no scores. Unlinked
// bulk tokens, scored exactly, keep theirs too.
TEST_P(IndexSelectorScopeTest, BulkOnlySupportCarriesTheScoresTheSearchComputed) {
  const Layer layer(SmallTrace());
  const SelectorParams params = IndexParams(128, GetParam());
  IndexSelector bulk_only(layer.shape, params, /*bulk_only=*/true);
  IndexSelector with_static_set(layer.shape, params);
  const int64_t prompt = layer.trace.geometry().context;
  ASSERT_TRUE(bulk_only.Build(layer.view(prompt), layer.prompt_q.data()).ok());
  ASSERT_TRUE(with_static_set.Build(layer.view(prompt), layer.prompt_q.data()).ok());
  // Step 0 after its OnAppend; step 5 with five tokens not absorbed yet.
  for (const int64_t tokens : {prompt + 1, prompt + 6}) {
    const KvView kv = layer.view(tokens);
    if (tokens == prompt + 1) bulk_only.OnAppend(kv);
    for (int h = 0; h < layer.shape.q_heads; ++h) {
      const float* q = layer.decode_query(tokens - prompt - 1, h);
      HeadSelection selection;
      bulk_only.Select(h, q, kv, &selection);
      ASSERT_EQ(selection.support.size(), static_cast<size_t>(params.top_k));
      ASSERT_EQ(selection.support_scores.size(), selection.support.size());
      std::vector<float> want(selection.support.size());
      cpu::ScoreTokens(q, kv, KvHeadOf(h, 4, 2), selection.support, layer.shape.scale,
                       want.data());
      EXPECT_EQ(selection.support_scores, want) << "head " << h << " tokens " << tokens;
      HeadSelection cpu_selection;
      with_static_set.Select(h, q, kv, &cpu_selection);
      EXPECT_TRUE(cpu_selection.support_scores.empty());
    }
  }
}

// With a generous list the index policy is the RetrievalAttention policy with an exact search:
// its output matches that of the static set plus the exact top-K of the bulk (computed by a
// scan), and the retrieved tokens bring it much closer to full attention than the static set
// alone (streaming).
TEST_P(IndexSelectorScopeTest, WithAGenerousListItsOutputIsCloseToExactTopK) {
  const Layer layer(SmallTrace());
  const LayerShape& shape = layer.shape;
  const SelectorParams params = IndexParams(1024, GetParam());
  std::unique_ptr<SupportSelector> selector = *MakeSelector(params, shape);
  SelectorParams streaming_params = params;
  streaming_params.kind = SelectorKind::kStreaming;
  std::unique_ptr<SupportSelector> streaming = *MakeSelector(streaming_params, shape);
  const int64_t prompt = layer.trace.geometry().context;
  ASSERT_TRUE(selector->Build(layer.view(prompt), layer.prompt_q.data()).ok());

  const int d = shape.head_dim;
  const int steps = 40;
  std::vector<float> o_index(shape.q_heads * d), o_oracle(shape.q_heads * d);
  std::vector<float> o_static(shape.q_heads * d), o_full(shape.q_heads * d), lse(shape.q_heads);
  std::vector<uint8_t> marks;
  double worst_cosine = 1.0, bulk_recall = 0, index_error = 0, static_error = 0;
  for (int64_t step = 0; step < steps; ++step) {
    const KvView kv = layer.view(prompt + step + 1);
    selector->OnAppend(kv);
    const int64_t bulk_end = kv.tokens - params.recent;
    std::vector<std::vector<int32_t>> index_supports(shape.q_heads),
        oracle_supports(shape.q_heads), static_supports(shape.q_heads);
    for (int h = 0; h < shape.q_heads; ++h) {
      const float* q = layer.decode_query(step, h);
      HeadSelection selection;
      selector->Select(h, q, kv, &selection);
      index_supports[h] = selection.support;
      streaming->Select(h, q, kv, &selection);
      static_supports[h] = selection.support;
      // The exact top-K of the bulk, by a scan.
      std::vector<int32_t> bulk_top;
      const VectorSet bulk = VectorSet::KeysOf(kv, KvHeadOf(h, 4, 2), params.sinks, bulk_end);
      cpu::ExactTopK(q, bulk.AsKeyView(), 0, 1.0f, params.top_k, &bulk_top);
      for (int32_t& t : bulk_top) t += params.sinks;
      bulk_recall += SupportRecall(index_supports[h], bulk_top, kv.tokens, &marks);
      AppendStaticSet(kv.tokens, params.sinks, params.recent, &bulk_top);
      oracle_supports[h] = bulk_top;
    }
    const float* q = layer.decode_query(step, 0);
    cpu::MultiHeadAttention(q, shape.q_heads, kv, index_supports, shape.scale, o_index.data(),
                            lse.data());
    cpu::MultiHeadAttention(q, shape.q_heads, kv, oracle_supports, shape.scale, o_oracle.data(),
                            lse.data());
    cpu::MultiHeadAttention(q, shape.q_heads, kv, static_supports, shape.scale, o_static.data(),
                            lse.data());
    cpu::MultiHeadFullAttention(q, shape.q_heads, kv, shape.scale, o_full.data(), lse.data());
    for (int h = 0; h < shape.q_heads; ++h) {
      worst_cosine = std::min(worst_cosine,
                              OutputCosine(o_index.data() + h * d, o_oracle.data() + h * d, d));
      index_error += RelativeL2(o_index.data() + h * d, o_full.data() + h * d, d);
      static_error += RelativeL2(o_static.data() + h * d, o_full.data() + h * d, d);
    }
  }
  const int samples = steps * shape.q_heads;
  EXPECT_GE(bulk_recall / samples, 0.98);
  EXPECT_GE(worst_cosine, 0.99);
  EXPECT_LE(index_error, 0.5 * static_error);
}

TEST_P(IndexSelectorScopeTest, TokensLeavingTheRecentWindowJoinTheIndex) {
  const Layer layer(SmallTrace());
  std::unique_ptr<SupportSelector> selector =
      *MakeSelector(IndexParams(256, GetParam()), layer.shape);
  const int64_t prompt = layer.trace.geometry().context;
  ASSERT_TRUE(selector->Build(layer.view(prompt), layer.prompt_q.data()).ok());
  auto* index_selector = dynamic_cast<IndexSelector*>(selector.get());
  const int heads_per_graph = layer.shape.q_heads / index_selector->graph_count();
  for (int64_t step = 0; step < 40; ++step) {
    const KvView kv = layer.view(prompt + step + 1);
    selector->OnAppend(kv);
    for (int h = 0; h < layer.shape.q_heads; ++h) {
      const GraphIndex& index = index_selector->head_index(h);
      EXPECT_EQ(index.size(), kv.tokens - 128 - 16);
      // Issue 15: past the link threshold (16) each step links one key per graph, no more, and
      // the tail stays under the threshold.
      EXPECT_LE(index.last_link().linked_keys, 1);
      EXPECT_LT(index.size() - index.linked(), 16);
      // The recent queries of every head of the graph place its new keys: each head's ring
      // (32 queries, two Selects a step here) is full from step 16 on, and the searches are
      // rationed at the ring's size per 16 keys linked.
      if (step >= 16) {
        EXPECT_EQ(index.last_link().projection_queries, 2 * heads_per_graph) << "step " << step;
      }
      HeadSelection selection;
      selector->Select(h, layer.decode_query(step, h), kv, &selection);
      // The token that just left the recent window is findable: a query along its key
      // (scaled up) gets it.
      const int32_t newest_bulk = static_cast<int32_t>(kv.tokens - 128 - 1);
      std::vector<float> q(kv.key(newest_bulk, KvHeadOf(h, 4, 2)),
                           kv.key(newest_bulk, KvHeadOf(h, 4, 2)) + layer.shape.head_dim);
      for (float& x : q) x *= 10.0f;
      selector->Select(h, q.data(), kv, &selection);
      std::vector<int32_t> best;
      cpu::ExactTopK(q.data(), KvView{kv.keys, nullptr, newest_bulk + 1, 2, 64},
                     KvHeadOf(h, 4, 2), 1.0f, 1, &best);
      if (best[0] >= 16) {
        EXPECT_THAT(selection.support, IsSupersetOf({best[0]})) << "step " << step;
      }
    }
  }
  // 40 steps, 15 of them before the tail reached the threshold: 25 keys linked one per step.
  EXPECT_EQ(index_selector->head_index(0).linked(), prompt - 128 - 16 + 40 - 15);
}

// OnAppend may run after a step's Selects (off the decode path): until it has, the bulk tokens
// the index does not hold are scored exactly and compete with the search's results for the top
// K, as the index's own unlinked tail does; none is attended merely for being new.
TEST_P(IndexSelectorScopeTest, BulkTokensNotYetAbsorbedCompeteForTheTopKByScore) {
  const Layer layer(SmallTrace());
  const SelectorParams params = IndexParams(128, GetParam());
  std::unique_ptr<SupportSelector> selector = *MakeSelector(params, layer.shape);
  auto* index_selector = dynamic_cast<IndexSelector*>(selector.get());
  const int64_t prompt = layer.trace.geometry().context;
  ASSERT_TRUE(selector->Build(layer.view(prompt), layer.prompt_q.data()).ok());
  const KvView kv = layer.view(prompt + 30);  // 30 decode tokens, no OnAppend yet
  const int64_t bulk_end = kv.tokens - params.recent;
  const int d = layer.shape.head_dim;
  for (int h = 0; h < layer.shape.q_heads; ++h) {
    const int kv_head = KvHeadOf(h, 4, 2);
    const GraphIndex& index = index_selector->head_index(h);
    const int64_t indexed = index.size();
    ASSERT_EQ(params.sinks + indexed + 30, bulk_end);
    // A query along the newest bulk token's key (scaled up) must get it; most of the others
    // must not get in for being new.
    const int32_t newest = static_cast<int32_t>(bulk_end - 1);
    std::vector<float> q(kv.key(newest, kv_head), kv.key(newest, kv_head) + d);
    for (float& x : q) x *= 10.0f;
    HeadSelection selection;
    selector->Select(h, q.data(), kv, &selection);
    // Expected: the top K of the search's results and the unabsorbed tokens' exact scores.
    SearchResult result;
    index.Search(VectorSet::KeysOf(kv, kv_head, params.sinks, params.sinks + indexed), q.data(),
                 params.top_k, SearchParams{128}, &result);
    std::vector<float> scores = result.scores;
    std::vector<int32_t> ids;
    for (int32_t id : result.ids) ids.push_back(static_cast<int32_t>(params.sinks + id));
    for (int64_t t = params.sinks + indexed; t < bulk_end; ++t) {
      ids.push_back(static_cast<int32_t>(t));
      scores.push_back(cpu::DotProduct(q.data(), kv.key(t, kv_head), d));
    }
    std::vector<int32_t> best;
    cpu::TopKPositions(scores, params.top_k, &best);
    std::vector<int32_t> expected;
    AppendStaticSet(kv.tokens, params.sinks, params.recent, &expected);
    for (int32_t at : best) expected.push_back(ids[at]);
    std::vector<int32_t> support = selection.support;
    std::sort(support.begin(), support.end());
    std::sort(expected.begin(), expected.end());
    EXPECT_EQ(support, expected) << "head " << h;
    EXPECT_EQ(support.size(), static_cast<size_t>(params.sinks + params.recent + params.top_k));
    EXPECT_THAT(selection.support, IsSupersetOf({newest})) << "head " << h;
    EXPECT_EQ(selection.candidates, result.stats.scored + 30);
  }
  // Absorbed after the Selects, the tokens are in the index.
  selector->OnAppend(kv);
  for (int h = 0; h < layer.shape.q_heads; ++h) {
    EXPECT_EQ(params.sinks + index_selector->head_index(h).size(), bulk_end);
  }
}

// A KV head's query heads share its graph and each searches it with its own query: each head's
// bulk support is close to its own exact top-K, about as close as with a graph of its own (the
// graphs are searched with the same list), over decode steps that link new keys.
TEST(IndexSelectorTest, EachQueryHeadFindsItsOwnTopKInTheSharedGraph) {
  const Layer layer(SmallTrace());
  const LayerShape& shape = layer.shape;
  const int64_t prompt = layer.trace.geometry().context;
  double recall[2] = {0, 0};
  const GraphScope scopes[2] = {GraphScope::kKvHead, GraphScope::kQueryHead};
  constexpr int kSteps = 40;
  for (int s = 0; s < 2; ++s) {
    const SelectorParams params = IndexParams(128, scopes[s]);
    IndexSelector selector(shape, params, /*bulk_only=*/true);
    ASSERT_TRUE(selector.Build(layer.view(prompt), layer.prompt_q.data()).ok());
    std::vector<uint8_t> marks;
    for (int64_t step = 0; step < kSteps; ++step) {
      const KvView kv = layer.view(prompt + step + 1);
      selector.OnAppend(kv);
      const int64_t bulk_end = kv.tokens - params.recent;
      for (int h = 0; h < shape.q_heads; ++h) {
        const float* q = layer.decode_query(step, h);
        HeadSelection selection;
        selector.Select(h, q, kv, &selection);
        std::vector<int32_t> exact;
        cpu::ExactTopK(q, VectorSet::KeysOf(kv, KvHeadOf(h, 4, 2), params.sinks, bulk_end)
                              .AsKeyView(),
                       0, 1.0f, params.top_k, &exact);
        for (int32_t& t : exact) t += params.sinks;
        recall[s] += SupportRecall(selection.support, exact, kv.tokens, &marks);
      }
    }
    recall[s] /= kSteps * shape.q_heads;
  }
  std::printf("recall@64 at list 128: shared graph %.4f, graph per query head %.4f\n",
              recall[0], recall[1]);
  EXPECT_GE(recall[0], 0.9);
  EXPECT_GE(recall[0], recall[1] - 0.02);
}

// A build nobody will use stops (index/build_stop.h) wherever the stop is first seen: before a
// KV head's lists, between blocks of their batch top-k, or between a graph's build steps; it
// ends with CANCELLED. A stop never requested is asked, and the build is a plain one's.
TEST_P(IndexSelectorScopeTest, AStopEndsTheBuildWhereverItIsSeen) {
  const Layer layer(SmallTrace());
  const int64_t prompt = layer.trace.geometry().context;
  const SelectorParams params = IndexParams(128, GetParam());
  IndexSelector plain(layer.shape, params, /*bulk_only=*/false);
  ASSERT_TRUE(plain.Build(layer.view(prompt), layer.prompt_q.data()).ok());
  StopAfterAsks never(0);
  IndexSelector asked(layer.shape, params, /*bulk_only=*/false);
  ASSERT_TRUE(asked.BuildUnless(never.stop(), layer.view(prompt), layer.prompt_q.data()).ok());
  const int asks = never.asks();
  EXPECT_GT(asks, layer.shape.kv_heads);
  EXPECT_EQ(asked.MemoryBytes(), plain.MemoryBytes());
  const KvView kv = layer.view(prompt + 1);
  for (int h = 0; h < layer.shape.q_heads; ++h) {
    HeadSelection a, b;
    asked.Select(h, layer.decode_query(0, h), kv, &a);
    plain.Select(h, layer.decode_query(0, h), kv, &b);
    EXPECT_EQ(a.support, b.support) << "head " << h;
  }
  for (const int from : {1, 2, asks / 2, asks}) {
    StopAfterAsks stop(from);
    IndexSelector stopped(layer.shape, params, /*bulk_only=*/false);
    const absl::Status s =
        stopped.BuildUnless(stop.stop(), layer.view(prompt), layer.prompt_q.data());
    EXPECT_EQ(s.code(), absl::StatusCode::kCancelled) << "stopped at ask " << from << " of "
                                                      << asks << ": " << s;
    EXPECT_THAT(s.message(), HasSubstr("stopped: its result will not be used"));
  }
}

// The Selects of a step may run concurrently, the heads of one graph among them: each head
// writes only its own slots of the graph's recent queries, so a step's supports and the links
// that the next OnAppend makes with those queries are those of Selects one after another.
TEST_P(IndexSelectorScopeTest, ConcurrentSelectsOfAGraphsHeadsMatchSerialOnes) {
  const Layer layer(SmallTrace());
  const SelectorParams params = IndexParams(128, GetParam());
  const int64_t prompt = layer.trace.geometry().context;
  IndexSelector serial(layer.shape, params);
  IndexSelector concurrent(layer.shape, params);
  ASSERT_TRUE(serial.Build(layer.view(prompt), layer.prompt_q.data()).ok());
  ASSERT_TRUE(concurrent.Build(layer.view(prompt), layer.prompt_q.data()).ok());
  const int heads = layer.shape.q_heads;
  for (int64_t step = 0; step < 40; ++step) {
    const KvView kv = layer.view(prompt + step + 1);
    serial.OnAppend(kv);
    concurrent.OnAppend(kv);
    std::vector<HeadSelection> want(heads), got(heads);
    for (int h = 0; h < heads; ++h) serial.Select(h, layer.decode_query(step, h), kv, &want[h]);
#pragma omp parallel for schedule(static, 1) num_threads(heads)
    for (int h = 0; h < heads; ++h) {
      concurrent.Select(h, layer.decode_query(step, h), kv, &got[h]);
    }
    for (int h = 0; h < heads; ++h) {
      EXPECT_EQ(got[h].support, want[h].support) << "step " << step << " head " << h;
    }
  }
  EXPECT_EQ(Graphs(concurrent), Graphs(serial));
  EXPECT_GT(serial.graph(0).linked(), prompt - params.sinks - params.recent);
}

}  // namespace
}  // namespace kvrecall
