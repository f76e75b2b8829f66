// The knobs of every support selector, in one struct that travels from the API to the index.
#ifndef KVRECALL_INDEX_SELECTOR_PARAMS_H_
#define KVRECALL_INDEX_SELECTOR_PARAMS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/retopk_params.h"

namespace kvrecall {

enum class SelectorKind { kFull, kExactTopK, kStreaming, kIndex, kReTopK };

const char* SelectorKindName(SelectorKind kind);

// The largest out-degree the graph index accepts for max_degree.
inline constexpr int kMaxGraphDegree = 256;
// Upper bounds of the other size-like knobs (SelectorParams::Validate): K and the graph search
// list; sinks, recent, ReTopK's window and the graph's link threshold and batch; ReTopK's cache
// (C); the graph build's sampled queries and their top-k.
inline constexpr int kMaxTopK = 1 << 20;
inline constexpr int kMaxWindowTokens = 1 << 24;
inline constexpr int kMaxReTopKCacheCapacity = 4096;
inline constexpr int kMaxGraphBuildQueries = 1 << 16;
inline constexpr int kMaxGraphBuildTopK = 4096;
// The default graph search list is max(K, this) (GraphIndexParams::search_list_size = 0).
inline constexpr int kDefaultSearchListFloor = 200;
// The most candidates a graph search expands per round (GraphIndexParams::search_width).
inline constexpr int kMaxSearchWidth = 4;

// Which query heads of a layer share one graph index (IndexSelector). Under grouped-query
// attention a KV head's query heads search the same keys, so one key graph can serve them all.
enum class GraphScope {
  kDefault,    // the default below (GraphIndexParams::WithDefaults)
  kKvHead,     // one graph per KV head, shaped by all its query heads' prompt queries
  kQueryHead,  // one graph per query head, shaped by that head's prompt queries
};

const char* GraphScopeName(GraphScope scope);

// How the tiered placement's exact steps find the top K of the bulk (policy.index.exact_search).
enum class ExactSearch {
  kDefault,    // the placement's choice (a GPU static tier: kShortlist; host memory: kGraph)
  kGraph,      // the query-aware graph index's search (IndexSelector)
  kShortlist,  // product-quantized scores on the static tier, rescored exactly (ShortlistSelector)
};

// What kDefault resolves to.
// (bench/results/index_bench.md, "One graph per KV head": the same recall at the same scanned
// fraction within 0.01, a quarter of the build work and graph memory in GQA models.)
inline constexpr GraphScope kDefaultGraphScope = GraphScope::kKvHead;

// The query-aware graph index (index/graph_index.h). A zero field means "the default below"
// (the API sends zeros for unset knobs); WithDefaults() resolves them.
struct GraphIndexParams {
  // Prefill queries per graph, evenly spaced over the prompt, whose exact top-k keys shape the
  // graph (a graph shared by several query heads samples build_queries / heads of each). More
  // queries cover more keys with query-aware edges but cost a GEMM of build_queries x bulk
  // keys and a longer projection per graph.
  int build_queries = 4096;
  // Exact top-k keys per sampled query: the query->key links projected onto the key graph.
  int build_topk = 100;
  // Out-degree cap of the key-key graph; memory is 4 bytes x max_degree per key and head.
  int max_degree = 32;
  // Candidate list of the decode-time beam search: larger lists score more keys for more
  // recall. The support is the best K of every key the search scored, so a list shorter than
  // K is a narrow beam: fewer hops and keys scored for less recall (at K = 512, a list of 200
  // served the tiered 128K step in 0.6-0.8x the time on the H200 and kept tinylm-a's
  // bits/byte, but found 0.91-0.95 of the synthetic needles that a list of K finds all of;
  // bench/results/index_bench.md, "A narrow beam"). 0: max(K, kDefaultSearchListFloor), a
  // list of at least K.
  int search_list_size = 0;
  // Candidates the decode-time search expands per round: their neighbors' keys are fetched and
  // scored together, so that the memory latency of one's rows overlaps another's (1: strict
  // best-first, each round waiting for the last).
  int search_width = 1;
  // Keys appended after the build wait in a tail that every search scans exactly; once it
  // holds this many, each Add links its oldest keys into the graph (link_batch), so the tail
  // stays under this size.
  int link_threshold = 256;
  // Keys an Add links once the tail holds link_threshold (at least as many as the Add
  // appended): a small constant keeps a decode step's linking work bounded; a value >=
  // link_threshold links the whole tail in one step (the batch linking before issue 15, a
  // latency spike every link_threshold steps).
  int link_batch = 1;
  // Which query heads share a graph (IndexSelector; a GraphIndex is one graph either way).
  // kKvHead builds a KV head's graph from the top-k lists of its query heads' sampled queries
  // (build_queries split among them), searched by each head with its own query: q_heads /
  // kv_heads times fewer graphs to build and hold.
  GraphScope graph_scope = GraphScope::kDefault;

  GraphIndexParams WithDefaults() const;
};

struct SelectorParams {
  SelectorKind kind = SelectorKind::kFull;
  int top_k = 512;  // K
  int sinks = 128;
  int recent = 512;
  ReTopKParams retopk;
  GraphIndexParams index;
  // How the tiered placement's exact steps (index, and retopk's exact path) find their top K
  // (policy.index.exact_search). kDefault until the server resolves it: its ResolvePolicy names
  // kGraph when a graph knob is set, then the placement's ResolveExactSearch: kGraph, or
  // kShortlist with shortlist > 0 (or by default on a GPU tier), or kDefault where no index is
  // searched.
  ExactSearch exact_search = ExactSearch::kDefault;
  // The shortlist's N (policy.index.shortlist): > 0, each query head's best `shortlist` bulk keys
  // by their scores over product-quantized keys on the static tier, rescored exactly
  // (index/shortlist_selector.h); 0: no shortlist. The backends read this field alone.
  int shortlist = 0;

  // INVALID_ARGUMENT naming the field when a knob is out of its domain.
  absl::Status Validate() const;
};

}  // namespace kvrecall

#endif  // KVRECALL_INDEX_SELECTOR_PARAMS_H_
