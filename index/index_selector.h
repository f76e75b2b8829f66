// The RetrievalAttention policy as a support selector for the CPU placement and the tiered
// placement's bulk (where the static set is attended apart): every head attends to the static
// set (attention sinks + the recent window) and to the top-K keys of the bulk (the tokens in
// between) that its query-aware graph index finds.
#ifndef KVRECALL_INDEX_INDEX_SELECTOR_H_
#define KVRECALL_INDEX_INDEX_SELECTOR_H_

#include <cstdint>
#include <utility>
#include <vector>

#include "index/batch_topk.h"
#include "index/graph_index.h"
#include "index/support_selector.h"

namespace kvrecall {

// A GraphIndex per KV head (GraphScope::kKvHead: its query heads share one graph, built from
// the top-k lists of all their sampled prompt queries, GraphIndexParams::build_queries split
// evenly among them) or per query head (kQueryHead: built from that head's queries), over the
// KV head's bulk keys [sinks, tokens - recent), read in place from the layer's KV ([tokens,
// kv_heads, head_dim], row-major). The graphs are built from prompt queries (causally: a prompt query saw only the
// keys before it), the top-k lists of a KV head's query heads in one batch top-k over the keys
// they share (on the GPU when the selector is given its batch top-k). Each query head searches
// its graph with its own query. Tokens that leave the recent window as decode appends tokens join
// the bulk through GraphIndex::Add (a tail scanned exactly until linked, each step linking a
// bounded number of keys per graph: GraphIndexParams::link_batch), with the latest decode
// queries of the graph's query heads to place them; OnAppend runs the graphs' Adds in parallel
// when they link. The support is the static set plus the top `top_k` bulk tokens among what the
// index finds and the bulk tokens it does not hold yet, which are scored exactly (like its
// unlinked tail). So OnAppend may run before a step's Selects or after them, off the decode
// path: either way every bulk token is a candidate, and only the graph that the search walks
// differs (by the step's link). Selects of different query heads may run concurrently (the
// searches only read a graph; each head writes its own slots of the recent queries), never
// beside OnAppend or Build.
class IndexSelector : public SupportSelector {
 public:
  // params.index zeros take GraphIndexParams defaults. bulk_only: the support holds the bulk's
  // tokens alone (the tiered placement attends the static set elsewhere). batch_topk: the exact
  // top-k of the graph build's sampled queries (CpuBatchTopK, or the GPU's). query_lead: prompt
  // query p sits query_lead positions after token p and saw the keys up to its own position
  // (0: the prompt's own queries; ReTopK's exact search over the tiered bulk gets query r of
  // token sinks + recent + r for bulk row r, which saw rows [0, r + recent]: lead `recent`).
  IndexSelector(const LayerShape& shape, const SelectorParams& params, bool bulk_only = false,
                BatchTopKFunction batch_topk = CpuBatchTopK, int64_t query_lead = 0);

  absl::Status Build(const KvView& kv, const PromptQueries& prompt_queries) override;
  void OnAppend(const KvView& kv) override;
  bool OnAppendIsCostly() const override { return true; }
  void Select(int q_head, const float* q, const KvView& kv, HeadSelection* out) override;
  int64_t MemoryBytes() const override;
  void ReserveTokens(int64_t tokens) override;

  // What MemoryBytes() is, or a Build on `build_threads` OpenMP threads uses on the way, at
  // most, for a selector of `params` built from a prompt of `tokens` tokens: every graph over
  // the bulk and its ring of recent queries, every query head's top-k lists, one KV head's
  // sampled queries and batch top-k scratch, and the graph scratch of the graphs that build at
  // once (BuildSideBySide), each on its threads (BuildThreadsPerGraph). build_threads 0: the
  // graphs and rings alone (no build).
  static int64_t MemoryBytesBound(const LayerShape& shape, const SelectorParams& params,
                                  int64_t tokens, int build_threads);

  // How many of `graphs` graphs a Build on `build_threads` threads builds at once (one per
  // thread, at most), and on how many threads each builds (a share of them: 1 when there are
  // at least as many graphs as threads; all of them when one graph builds at a time).
  static int BuildSideBySide(int graphs, int build_threads);
  static int BuildThreadsPerGraph(int graphs, int build_threads);

  // Query heads per graph under `params` (q_heads / kv_heads for kKvHead, else 1), and the
  // layer's graphs.
  static int HeadsPerGraph(const LayerShape& shape, const GraphIndexParams& params);
  // What each query head of a graph of `heads_per_graph` heads samples: params with
  // build_queries, the graph's, split evenly among them (rounded up).
  static GraphIndexParams HeadSampling(const GraphIndexParams& params, int heads_per_graph);
  int graph_count() const { return static_cast<int>(graphs_.size()); }
  const GraphIndex& graph(int i) const { return graphs_[i].index; }
  // The graph that query head `q_head` searches.
  const GraphIndex& head_index(int q_head) const { return graphs_[GraphOf(q_head)].index; }

 private:
  // Decode queries a query head keeps for linking new bulk keys.
  static constexpr int kRecentQueries = 32;

  struct Graph {
    Graph(const GraphIndexParams& params, BatchTopKFunction batch_topk, int heads)
        : index(params, std::move(batch_topk)), queries_seen(heads, 0) {}
    GraphIndex index;
    // Ring of the graph's query heads' latest queries, [kRecentQueries, heads, head_dim]: head
    // i's query of its step s at slot s % kRecentQueries, row slot * heads + i, so that the
    // rows every head has filled are a prefix.
    std::vector<float> recent_queries;
    std::vector<int64_t> queries_seen;  // [heads]: Selects of each of its query heads
  };

  int GraphOf(int q_head) const { return q_head / heads_per_graph_; }
  struct GroupLists;
  // The query heads' build queries from a prompt of `tokens` tokens ([tokens, q_heads,
  // head_dim], or null: none).
  BuildQueries HeadQueries(int q_head, const float* prompt_queries, int64_t tokens) const;
  // The top-k lists of the query heads of `kv_head` over its bulk keys, in one batch top-k,
  // split by graph.
  void ComputeGroupLists(const KvView& kv, const float* prompt_queries, int kv_head,
                         GroupLists* out) const;
  // The threads a Build called here has: OpenMP's team size, or 1 inside a parallel region
  // (nested regions are inactive).
  static int BuildThreads();
  // The first token after the bulk for a layer of `tokens` tokens.
  int64_t BulkEnd(int64_t tokens) const;
  // Keys [sinks, end) of a KV head (an empty set when end <= sinks).
  VectorSet BulkKeys(const KvView& kv, int kv_head, int64_t end) const;
  // The recent queries of a graph's heads that every one of its heads has filled.
  VectorSet RecentQueries(const Graph& graph) const;

  LayerShape shape_;
  int top_k_;
  int sinks_;
  int recent_;
  int64_t query_lead_;
  GraphIndexParams index_params_;
  bool bulk_only_;
  BatchTopKFunction batch_topk_;
  int heads_per_graph_;
  GraphIndexParams head_sampling_;  // HeadSampling(index_params_, heads_per_graph_)
  std::vector<Graph> graphs_;  // graph g serves query heads [g, g + 1) x heads_per_graph_
};

}  // namespace kvrecall

#endif  // KVRECALL_INDEX_INDEX_SELECTOR_H_
