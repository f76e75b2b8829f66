#include "index/index_selector.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "index/basic_selectors.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/mapped_memory.h"
#include "kernels/cpu/thread_pool.h"

namespace kvrecall {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace

IndexSelector::IndexSelector(const LayerShape& shape, const SelectorParams& params,
                             bool bulk_only, BatchTopKFunction batch_topk, int64_t query_lead)
    : shape_(shape),
      top_k_(params.top_k),
      sinks_(params.sinks),
      recent_(params.recent),
      query_lead_(query_lead),
      index_params_(params.index.WithDefaults()),
      bulk_only_(bulk_only),
      batch_topk_(batch_topk),
      heads_per_graph_(HeadsPerGraph(shape, index_params_)),
      head_sampling_(HeadSampling(index_params_, heads_per_graph_)) {
  const int graphs = shape.q_heads / heads_per_graph_;
  graphs_.reserve(graphs);
  for (int g = 0; g < graphs; ++g) {
    graphs_.emplace_back(index_params_, batch_topk, heads_per_graph_);
  }
}

int IndexSelector::HeadsPerGraph(const LayerShape& shape, const GraphIndexParams& params) {
  return params.WithDefaults().graph_scope == GraphScope::kKvHead
             ? shape.q_heads / shape.kv_heads
             : 1;
}

GraphIndexParams IndexSelector::HeadSampling(const GraphIndexParams& params,
                                             int heads_per_graph) {
  GraphIndexParams out = params.WithDefaults();
  out.build_queries = (out.build_queries + heads_per_graph - 1) / heads_per_graph;
  return out;
}

int64_t IndexSelector::BulkEnd(int64_t tokens) const {
  return std::max<int64_t>(sinks_, tokens - recent_);
}

VectorSet IndexSelector::BulkKeys(const KvView& kv, int kv_head, int64_t end) const {
  if (end <= sinks_) return VectorSet{kv.keys, 0, kv.token_stride(), kv.head_dim, kv.element};
  return VectorSet::KeysOf(kv, kv_head, sinks_, end);
}

VectorSet IndexSelector::RecentQueries(const Graph& graph) const {
  const int64_t seen = *std::min_element(graph.queries_seen.begin(), graph.queries_seen.end());
  const int64_t held = std::min<int64_t>(seen, kRecentQueries) * heads_per_graph_;
  return VectorSet{graph.recent_queries.data(), held, shape_.head_dim, shape_.head_dim};
}

// One KV head's batch top-k for all its query heads (IndexSelector::Build), split by graph:
// each graph's lists (its query heads' one after another) and query sum, ready once `ready`
// (under the build's mutex).
struct IndexSelector::GroupLists {
  std::vector<TopKLists> lists;
  std::vector<std::vector<float>> query_sums;
  double seconds_per_graph = 0;
  absl::Status status;
  bool ready = false;
};

BuildQueries IndexSelector::HeadQueries(int q_head, const float* prompt_queries,
                                        int64_t tokens) const {
  BuildQueries queries;
  // No queries (an empty prompt: the tiered bulk before it has any token) is no query set;
  // offsetting a null pointer would be undefined even unread.
  if (prompt_queries != nullptr) {
    queries.queries = VectorSet{prompt_queries + q_head * shape_.head_dim, tokens,
                                static_cast<int64_t>(shape_.q_heads) * shape_.head_dim,
                                shape_.head_dim};
  }
  queries.causal = true;
  // Query i is token i + query_lead's: key 0 (token sinks) sits at i's position sinks - lead.
  queries.first_key_position = sinks_ - query_lead_;
  return queries;
}

void IndexSelector::ComputeGroupLists(const KvView& kv, const float* prompt_queries, int kv_head,
                                      GroupLists* out) const {
  const Clock::time_point start = Clock::now();
  const int group = shape_.q_heads / shape_.kv_heads;
  const VectorSet keys = BulkKeys(kv, kv_head, BulkEnd(kv.tokens));
  // The group's sampled queries side by side ([group x sampled, head_dim]) with their causal
  // counts: one top-k over the keys they share.
  int64_t total = 0;
  std::vector<int64_t> counts(group);
  for (int i = 0; i < group; ++i) {
    counts[i] = GraphIndex::SampledQueryCount(
        head_sampling_, keys.count, HeadQueries(kv_head * group + i, prompt_queries, kv.tokens));
    total += counts[i];
  }
  cpu::MappedVector<float> queries(static_cast<size_t>(total) * shape_.head_dim);
  std::vector<int64_t> visible;
  out->query_sums.resize(group);
  int64_t offset = 0;
  for (int i = 0; i < group; ++i) {
    out->query_sums[i] = GraphIndex::SampleQueries(
        head_sampling_, keys, HeadQueries(kv_head * group + i, prompt_queries, kv.tokens),
        queries.data() + offset * shape_.head_dim, &visible);
    offset += counts[i];
  }
  // A graph's query sum: its heads' (the entry point's query).
  const int graphs = group / heads_per_graph_;
  for (int g = 0; g < graphs; ++g) {
    for (int i = 1; i < heads_per_graph_; ++i) {
      std::vector<float>& sum = out->query_sums[g * heads_per_graph_];
      const std::vector<float>& other = out->query_sums[g * heads_per_graph_ + i];
      for (int j = 0; j < shape_.head_dim; ++j) sum[j] += other[j];
    }
    if (g * heads_per_graph_ != g) {
      out->query_sums[g] = std::move(out->query_sums[g * heads_per_graph_]);
    }
  }
  out->query_sums.resize(graphs);
  out->lists.assign(graphs, TopKLists());
  if (keys.count == 0) return;
  TopKLists all;
  out->status = batch_topk_(VectorSet{queries.data(), total, shape_.head_dim, shape_.head_dim},
                            keys, index_params_.build_topk, &all, visible, build_stop());
  if (!out->status.ok()) return;
  if (graphs == 1) {
    out->lists[0] = std::move(all);  // the KV head's one graph takes every list
  } else {
    offset = 0;
    for (int g = 0; g < graphs; ++g) {
      int64_t count = 0;
      for (int i = 0; i < heads_per_graph_; ++i) count += counts[g * heads_per_graph_ + i];
      TopKLists& lists = out->lists[g];
      lists.k = all.k;
      lists.queries = count;
      lists.ids.assign(all.ids.begin() + offset * all.k,
                       all.ids.begin() + (offset + count) * all.k);
      offset += count;
    }
  }
  out->seconds_per_graph = SecondsSince(start) / graphs;
}

absl::Status IndexSelector::Build(const KvView& kv, const PromptQueries& queries) {
  if (kv.head_dim != shape_.head_dim || kv.kv_heads != shape_.kv_heads) {
    return absl::InvalidArgumentError(absl::StrCat(
        "index selector built for kv_heads=", shape_.kv_heads, " head_dim=", shape_.head_dim,
        " got a KV of kv_heads=", kv.kv_heads, " head_dim=", kv.head_dim));
  }
  // Every prompt query shapes the graph.
  if (queries.data != nullptr && queries.first != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "index: the graph is built from every prompt query, got them from row ", queries.first));
  }
  const float* prompt_queries = queries.data;
  const int64_t bulk_end = BulkEnd(kv.tokens);
  const int group = shape_.q_heads / shape_.kv_heads;
  const int graphs_per_kv_head = group / heads_per_graph_;
  const int graphs = static_cast<int>(graphs_.size());
  std::vector<GroupLists> groups(shape_.kv_heads);
  std::mutex mu;
  std::condition_variable ready;
  auto compute = [&](int kv_head) {
    GroupLists lists;
    lists.status = build_stop().Check("the index build");
    if (lists.status.ok()) ComputeGroupLists(kv, prompt_queries, kv_head, &lists);
    std::lock_guard<std::mutex> lock(mu);
    groups[kv_head] = std::move(lists);
    groups[kv_head].ready = true;
    ready.notify_all();
  };
  std::vector<absl::Status> built(graphs);
  auto build_graph = [&](int g) {
    Graph& graph = graphs_[g];
    const int kv_head = g / graphs_per_kv_head;
    GroupLists* lists = &groups[kv_head];
    {
      std::unique_lock<std::mutex> lock(mu);
      ready.wait(lock, [&] { return lists->ready; });
    }
    if (!lists->status.ok()) {  // (its lists may not be there: stopped before they were made)
      built[g] = lists->status;
      return;
    }
    const int i = g - kv_head * graphs_per_kv_head;
    built[g] = graph.index.BuildFromLists(BulkKeys(kv, kv_head, bulk_end), lists->query_sums[i],
                                          lists->lists[i], lists->seconds_per_graph,
                                          build_stop());
    lists->lists[i] = TopKLists();  // its lists are done with
    graph.recent_queries.assign(
        static_cast<size_t>(kRecentQueries) * heads_per_graph_ * shape_.head_dim, 0.0f);
    std::fill(graph.queries_seen.begin(), graph.queries_seen.end(), 0);
  };
  // The top-k lists come one KV head at a time (one batch top-k for its query heads, which
  // share its keys). With several graphs and threads, graphs build side by side: a build has
  // serial stretches that one graph at a time on every thread leaves the other cores idle
  // through. With at least a graph per thread each builds on one thread; with fewer graphs
  // than threads (8 KV-head graphs on 16 cores) each builds on a share of the threads, on a
  // std::thread of its own whose OpenMP regions are teams of their own (regions nested in an
  // OpenMP loop would run on one thread). Their lists are computed first on the whole team
  // when the batch top-k is the CPU's, else (the GPU's) by a thread of their own, one KV head
  // after another, while the graphs whose lists are ready build. With one graph, or inside a
  // parallel region (the server building a prompt's layers side by side), graphs build one
  // after another, each on the threads there are, a KV head's lists just before its graphs.
  const int build_threads = BuildThreads();
  const int side_by_side = BuildSideBySide(graphs, build_threads);
  const int threads_each = BuildThreadsPerGraph(graphs, build_threads);
  if (side_by_side > 1) {
    std::thread producer;
    if (IsCpuBatchTopK(batch_topk_)) {
      for (int g = 0; g < shape_.kv_heads; ++g) compute(g);
    } else {
      producer = std::thread([&] {
        for (int g = 0; g < shape_.kv_heads; ++g) compute(g);
      });
    }
    if (threads_each == 1) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(side_by_side)
      for (int g = 0; g < graphs; ++g) build_graph(g);
    } else {
      std::atomic<int> next = 0;
      std::vector<std::thread> builders;
      builders.reserve(side_by_side);
      for (int b = 0; b < side_by_side; ++b) {
        builders.emplace_back([&] {
          omp_set_num_threads(threads_each);
          for (int g = next++; g < graphs; g = next++) build_graph(g);
        });
      }
      for (std::thread& builder : builders) builder.join();
    }
    if (producer.joinable()) producer.join();
  } else {
    for (int kv_head = 0; kv_head < shape_.kv_heads; ++kv_head) {
      compute(kv_head);
      for (int g = kv_head * graphs_per_kv_head; g < (kv_head + 1) * graphs_per_kv_head; ++g) {
        build_graph(g);
      }
    }
  }
  for (const absl::Status& s : built) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

int IndexSelector::BuildThreads() { return omp_in_parallel() ? 1 : omp_get_max_threads(); }

int IndexSelector::BuildSideBySide(int graphs, int build_threads) {
  return std::max(1, std::min(graphs, build_threads));
}

int IndexSelector::BuildThreadsPerGraph(int graphs, int build_threads) {
  return std::max(1, build_threads / BuildSideBySide(graphs, build_threads));
}

void IndexSelector::OnAppend(const KvView& kv) {
  const int64_t bulk_end = BulkEnd(kv.tokens);
  const int graphs = static_cast<int>(graphs_.size());
  bool links = false;
  for (const Graph& graph : graphs_) {
    links = links || graph.index.KeysToLink(bulk_end - sinks_) > 0;
  }
  // Graphs in parallel when any links: a decode step's Add links a few keys per graph
  // (GraphIndex's link_batch), too little work to spread over threads inside one index; an Add
  // that only appends is cheaper than entering a parallel region.
  cpu::ParallelFor(graphs, links ? graphs : 1, [&](int64_t g) {
    Graph& graph = graphs_[g];
    if (sinks_ + graph.index.size() >= bulk_end) return;
    const int kv_head =
        KvHeadOf(static_cast<int>(g) * heads_per_graph_, shape_.q_heads, shape_.kv_heads);
    // Add fails only for a key set smaller than the index's; Select then attends the
    // unindexed bulk tokens directly, so the output stays exact for them.
    (void)graph.index.Add(BulkKeys(kv, kv_head, bulk_end), RecentQueries(graph));
  });
}

void IndexSelector::Select(int q_head, const float* q, const KvView& kv, HeadSelection* out) {
  Graph& graph = graphs_[GraphOf(q_head)];
  const GraphIndex& index = graph.index;
  const int kv_head = KvHeadOf(q_head, shape_.q_heads, shape_.kv_heads);
  const int64_t bulk_end = BulkEnd(kv.tokens);
  const int64_t indexed = std::min<int64_t>(index.size(), bulk_end - sinks_);
  out->support.clear();
  out->support_scores.clear();
  if (!bulk_only_) AppendStaticSet(kv.tokens, sinks_, recent_, &out->support);
  // The searches scored every bulk token they return: with no static set in the support, the
  // attention can take those scores (scaled as cpu::ScoreTokens scales them).
  auto keep = [&](int32_t id, float score) {
    out->support.push_back(static_cast<int32_t>(sinks_ + id));
    if (bulk_only_) out->support_scores.push_back(shape_.scale * score);
  };
  out->path = SelectionPath::kExact;
  out->candidates = 0;
  thread_local SearchResult result;
  result.ids.clear();
  result.scores.clear();
  if (indexed > 0) {
    SearchParams params;
    params.list_size = index_params_.search_list_size;
    params.width = index_params_.search_width;
    index.Search(BulkKeys(kv, kv_head, sinks_ + index.size()), q, top_k_, params, &result);
    out->candidates = static_cast<int32_t>(result.stats.scored);
  }
  if (sinks_ + indexed >= bulk_end) {
    for (size_t i = 0; i < result.ids.size(); ++i) {
      if (result.ids[i] < indexed) keep(result.ids[i], result.scores[i]);
    }
  } else {
    // Bulk tokens the index does not hold yet (OnAppend has not absorbed them, or an Add
    // failed) are scored exactly, as the index's own unlinked tail is, and compete for the top
    // K with what the search found: every bulk token is a candidate whether OnAppend ran before
    // this step or runs after it.
    const VectorSet bulk = BulkKeys(kv, kv_head, bulk_end);
    for (int64_t t = sinks_ + indexed; t < bulk_end; ++t) {
      const int32_t id = static_cast<int32_t>(t - sinks_);
      result.ids.push_back(id);
      result.scores.push_back(
          cpu::DotProduct(q, bulk.row_data(id), bulk.element, shape_.head_dim));
    }
    out->candidates += static_cast<int32_t>(bulk_end - sinks_ - indexed);
    thread_local std::vector<int32_t> best;
    cpu::TopKPositions(result.scores, top_k_, &best);
    for (int32_t at : best) {
      if (result.ids[at] < bulk_end - sinks_) {
        keep(result.ids[at], result.scores[at]);
      }
    }
  }
  // Remember the query for placing the keys that join the bulk later (in this head's slots).
  const int i = q_head - GraphOf(q_head) * heads_per_graph_;
  int64_t& seen = graph.queries_seen[i];
  float* slot = graph.recent_queries.data() +
                ((seen % kRecentQueries) * heads_per_graph_ + i) *
                    static_cast<int64_t>(shape_.head_dim);
  std::copy(q, q + shape_.head_dim, slot);
  ++seen;
}

int64_t IndexSelector::MemoryBytesBound(const LayerShape& shape, const SelectorParams& params,
                                        int64_t tokens, int build_threads) {
  const int64_t bulk = BulkTokens(tokens, params.sinks, params.recent);
  const int heads_per_graph = HeadsPerGraph(shape, params.index);
  const GraphIndexParams sampling = HeadSampling(params.index, heads_per_graph);
  const int graphs = shape.q_heads / heads_per_graph;
  const int64_t per_graph = GraphIndex::GraphBytes(params.index, bulk) +
                            int64_t{kRecentQueries} * heads_per_graph * shape.head_dim *
                                int64_t{sizeof(float)} +
                            heads_per_graph * int64_t{sizeof(int64_t)};
  if (build_threads == 0) return per_graph * graphs;  // the state alone, no build
  // A build holds every head's top-k lists at most (their KV heads' batch top-k may run ahead
  // of the graphs), one KV head's sampled queries at a time with the batch top-k's scratch,
  // and the graph scratch of the graphs that build at once, each on its share of the threads
  // (a graph's projection grows with its heads' lists).
  const int group = shape.q_heads / shape.kv_heads;
  const int side_by_side = BuildSideBySide(graphs, build_threads);
  const int64_t k = std::min<int64_t>(params.index.WithDefaults().build_topk, bulk);
  const int64_t group_queries =
      group * GraphIndex::SampledQueryBytes(sampling, bulk, tokens, shape.head_dim);
  const int64_t head_lists = GraphIndex::TopKListBytes(sampling, bulk, tokens);
  const int64_t group_topk =
      bulk == 0 ? 0
                : CpuBatchTopKScratchBytes(bulk, static_cast<int>(k), shape.head_dim,
                                           std::max(1, build_threads)) +
                      group * head_lists;
  return per_graph * graphs + shape.q_heads * head_lists + group_queries + group_topk +
         side_by_side * GraphIndex::GraphScratchBytesBound(
                            sampling, bulk, tokens, shape.head_dim,
                            BuildThreadsPerGraph(graphs, build_threads), heads_per_graph);
}

void IndexSelector::ReserveTokens(int64_t tokens) {
  const int64_t bulk = BulkTokens(tokens, sinks_, recent_);
  for (Graph& graph : graphs_) graph.index.ReserveCapacity(bulk);
}

int64_t IndexSelector::MemoryBytes() const {
  int64_t bytes = 0;
  for (const Graph& graph : graphs_) {
    bytes += graph.index.MemoryBytes() +
             static_cast<int64_t>(graph.recent_queries.capacity() * sizeof(float) +
                                  graph.queries_seen.capacity() * sizeof(int64_t));
  }
  return bytes;
}

}  // namespace kvrecall
