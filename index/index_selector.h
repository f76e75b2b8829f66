// The RetrievalAttention policy as a support selector for the CPU placement: every head attends
// to the static set (attention sinks + the recent window) and to the top-K keys of the bulk (the
// tokens in between) that its query-aware graph index finds.
#ifndef KVRECALL_INDEX_INDEX_SELECTOR_H_
#define KVRECALL_INDEX_INDEX_SELECTOR_H_

#include <cstdint>
#include <utility>
#include <vector>

#include "index/batch_topk.h"
#include "index/graph_index.h"
#include "index/support_selector.h"

namespace kvrecall {

// Per query head: a GraphIndex over its KV head's bulk keys [sinks, tokens - recent), read in
// place from the layer's KV, built from the head's prompt queries (causally: a prompt query saw
// only the keys before it), the top-k lists of a KV head's query heads in one batch top-k over
// the keys they share (on the GPU when the selector is given its batch top-k). Tokens that leave the recent window as decode appends tokens join the
// bulk through GraphIndex::Add (a tail scanned exactly until linked, each step linking a bounded
// number of keys per head: GraphIndexParams::link_batch), with the head's latest decode queries
// to place them; OnAppend runs the heads' Adds in parallel when they link. The support is the
// static set plus the top `top_k` bulk tokens among what the index finds and the bulk tokens it
// does not hold yet, which are scored exactly (like its unlinked tail). So OnAppend may run
// before a step's Selects or after them, off the decode path: either way every bulk token is a
// candidate, and only the graph that the search walks differs (by the step's link).
class IndexSelector : public SupportSelector {
 public:
  // params.index zeros take GraphIndexParams defaults. bulk_only: the support holds the bulk's
  // tokens alone (the tiered placement attends the static set elsewhere). batch_topk: the exact
  // top-k of the graph build's sampled queries (CpuBatchTopK, or the GPU's).
  IndexSelector(const LayerShape& shape, const SelectorParams& params, bool bulk_only = false,
                BatchTopKFunction batch_topk = CpuBatchTopK);

  absl::Status Build(const KvView& kv, const float* prompt_queries) override;
  void OnAppend(const KvView& kv) override;
  bool OnAppendIsCostly() const override { return true; }
  void Select(int q_head, const float* q, const KvView& kv, HeadSelection* out) override;
  int64_t MemoryBytes() const override;

  // What MemoryBytes() is, or a Build on `build_threads` OpenMP threads uses on the way, at
  // most, for a selector of `params` built from a prompt of `tokens` tokens: every head's graph
  // over the bulk and its ring of recent queries, every head's top-k lists, one KV head's
  // sampled queries and batch top-k scratch, and the graph scratch of the heads that build at
  // once (BuildSideBySide).
  static int64_t MemoryBytesBound(const LayerShape& shape, const SelectorParams& params,
                                  int64_t tokens, int build_threads);

  // How many of `q_heads` heads a Build on `build_threads` threads builds at once: one per
  // thread when there are at least as many heads as threads, else 1 (one head at a time on all
  // the threads).
  static int BuildSideBySide(int q_heads, int build_threads);

  const GraphIndex& head_index(int q_head) const { return heads_[q_head].index; }

 private:
  // Decode queries a head keeps for linking new bulk keys.
  static constexpr int kRecentQueries = 32;

  struct Head {
    Head(const GraphIndexParams& params, BatchTopKFunction batch_topk)
        : index(params, std::move(batch_topk)) {}
    GraphIndex index;
    std::vector<float> recent_queries;  // ring of [kRecentQueries, head_dim]
    int64_t queries_seen = 0;
  };

  struct GroupLists;
  // The query heads' build queries from a prompt of `tokens` tokens ([tokens, q_heads,
  // head_dim], or null: none).
  BuildQueries HeadQueries(int q_head, const float* prompt_queries, int64_t tokens) const;
  // The top-k lists of the query heads of `kv_head` over its bulk keys, in one batch top-k.
  void ComputeGroupLists(const KvView& kv, const float* prompt_queries, int kv_head,
                         GroupLists* out) const;
  // The threads a Build called here has: OpenMP's team size, or 1 inside a parallel region
  // (nested regions are inactive).
  static int BuildThreads();
  // The first token after the bulk for a layer of `tokens` tokens.
  int64_t BulkEnd(int64_t tokens) const;
  // Keys [sinks, end) of a KV head (an empty set when end <= sinks).
  VectorSet BulkKeys(const KvView& kv, int kv_head, int64_t end) const;
  VectorSet RecentQueries(const Head& head) const;

  LayerShape shape_;
  int top_k_;
  int sinks_;
  int recent_;
  GraphIndexParams index_params_;
  bool bulk_only_;
  BatchTopKFunction batch_topk_;
  std::vector<Head> heads_;
};

}  // namespace kvrecall

#endif  // KVRECALL_INDEX_INDEX_SELECTOR_H_
