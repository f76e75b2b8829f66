// The query-aware key graph of RetrievalAttention (arXiv 2409.10516, Sec. 3.2), built the
// RoarGraph way: query->key links found by exact top-k of sampled prefill queries are projected
// onto a key-key graph that decode queries walk with a beam search.
#ifndef KVRECALL_INDEX_GRAPH_INDEX_H_
#define KVRECALL_INDEX_GRAPH_INDEX_H_

#include <cstdint>
#include <span>
#include <vector>

#include "index/batch_topk.h"
#include "index/build_stop.h"
#include "index/key_index.h"
#include "index/selector_params.h"
#include "kernels/cpu/mapped_memory.h"

namespace kvrecall {

// What an Add linked, for benchmarks and tests: the work an Add did beyond appending.
struct GraphLinkStats {
  int64_t linked_keys = 0;         // tail keys linked into the graph
  int64_t projection_queries = 0;  // recent queries searched to project their top keys
};

// What a build did, for benchmarks and tests.
struct GraphBuildStats {
  int64_t build_queries = 0;     // sampled queries whose top-k lists were projected
  int64_t covered_keys = 0;      // keys in at least one sampled query's top-k list
  int64_t repaired_keys = 0;     // keys the connectivity pass had to link
  int64_t unreachable_keys = 0;  // keys still unreachable from the entry point afterwards
  double average_degree = 0.0;
  double topk_seconds = 0.0;     // exact top-k of the sampled queries
  double graph_seconds = 0.0;    // projection, reverse edges, connectivity: the sum of
  // its steps below
  double key_copy_seconds = 0.0;    // the build's packed copy of the keys
  double projection_seconds = 0.0;  // the projected edges and chain, merged and pruned
  double reverse_seconds = 0.0;     // reverse edges, merged and pruned
  double entry_seconds = 0.0;       // the entry point and the mean key
  double outlier_seconds = 0.0;     // the outliers' own searches and their edges
  double repair_seconds = 0.0;      // the connectivity pass
  int64_t pruning_distances = 0;    // key distances computed to prune rows over max_degree

  // Adds every field of `other` (sums over several builds, for benchmarks).
  GraphBuildStats& operator+=(const GraphBuildStats& other);
};

// Keys are a KV head's tokens in token order (key j is token first_key_position + j).
//
// Build (per query head):
//   1. sample `build_queries` of the head's prompt queries, evenly spaced, and find each one's
//      exact top-`build_topk` keys (BatchTopKFunction: a blocked GEMM on the CPU), among the
//      keys it attended to when the queries are causal;
//   2. projection: each query picks a pivot, its best key not yet a pivot (the best key alone
//      would make every query pivot on the attention sinks), and the pivot gets edges to the
//      query's other top keys: keys that the same query wants become one hop apart; each list
//      member also links to a few random members of the same list (with sampled queries most
//      keys are pivots of none, and these links give them projected edges of their own);
//   3. neighboring tokens are linked (a positional chain: attention reads passages);
//   4. every edge u->v adds v->u; a node over `max_degree` keeps its closest candidates in L2
//      that are not occluded (a candidate closer to an already kept neighbor than to the node
//      is dropped, keeping edges that leave in different directions), then fills up with the
//      closest remaining ones;
//   5. outliers: the keys farthest from the mean key (1%), which can win a query that no prefill
//      query resembled (a needle), are searched for with themselves (minus the mean key) as
//      the query and linked both ways to the best keys found, and so are any keys not reachable
//      from the entry point (the key with the highest score for the mean sampled query; the
//      token chain makes these rare).
// Search: best-first beam search over the graph from the entry point with a candidate list of
// `list_size`, plus an exact scan of the tail (keys added but not linked yet); the result is
// the best k of every key scored. With a list of k or more that is the list's own top k; a
// shorter list is a narrow beam (fewer hops, fewer keys scored) whose result also takes the
// keys it scored on its way without keeping them. The default list is max(k, 200); a shorter
// one is the caller's choice of speed over recall (bench/results/index_bench.md, "A narrow
// beam").
// Growth: Add puts keys in the tail. Once the tail holds `link_threshold` keys, an Add links its
// oldest `link_batch` keys (at least as many as it appended, so the tail stays under
// `link_threshold`). A decode step appends one key, so every step links `link_batch` keys
// (default 1) instead of one step in `link_threshold` linking them all under the session's lock:
// the linking work per step is a small constant (the adjacency still grows geometrically, an
// amortized copy). (Amortized rather than moved to a background thread,
// which would need the graph to be read while it changes.) A linked key x gets edges to its
// token neighbors; to its nearest (L2) keys among the newest max(link_threshold, the keys this
// Add links) linked keys, x's batch included (a window, so that a key linked alone meets as many
// fellow keys as one linked in a batch); projection-style, from the pivot of a recent query to the
// query's other top keys where either end is in that window; and to the keys its own (centered)
// search finds. Every edge adds its reverse. The recent queries' searches are rationed to the
// batch rate, `recent_queries` searches per `link_threshold` keys linked, the queries in turn.
// link_batch >= link_threshold links the whole tail with every recent query at once: the batch
// linking before issue 15. Either way the tail is scanned exactly by every search, and nothing is
// rebuilt.
class GraphIndex : public KeyIndex {
 public:
  // params: zeros take the defaults (GraphIndexParams::WithDefaults).
  explicit GraphIndex(const GraphIndexParams& params,
                      BatchTopKFunction batch_topk = CpuBatchTopK);

  const char* name() const override { return "graph"; }
  absl::Status Build(const VectorSet& keys, const BuildQueries& build_queries) override;
  absl::Status Add(const VectorSet& keys, const VectorSet& recent_queries) override;
  void Search(const VectorSet& keys, const float* q, int k, const SearchParams& params,
              SearchResult* out) const override;
  int64_t size() const override { return size_; }
  int64_t MemoryBytes() const override;
  // Room for `keys` keys' links, so that adding up to them allocates nothing more (GraphBytes).
  void ReserveCapacity(int64_t keys);

  // What a graph over `keys` keys holds (the adjacency; MemoryBytes after a Build).
  static int64_t GraphBytes(const GraphIndexParams& params, int64_t keys);
  // The most a Build from `queries` prompt queries of dimension `dim` allocates beyond that on
  // the way, in parts that its owner sums with its batched top-k's scratch and reserves before
  // building (IndexSelector): the sampled queries' copies and causal counts, their top-k lists,
  // and the graph's own scratch once the lists are there (projection, pruning, reverse edges,
  // outliers, repair) with `threads` threads merging.
  static int64_t SampledQueryBytes(const GraphIndexParams& params, int64_t keys, int64_t queries,
                                   int dim);
  static int64_t TopKListBytes(const GraphIndexParams& params, int64_t keys, int64_t queries);
  // `heads`: the graph is built from the lists of that many query heads' sampled queries
  // (BuildFromLists from several heads' lists; 1 for Build). The build's copy of the keys is
  // counted at 4 bytes an element (f32, the widest: the bound does not know the keys' type).
  static int64_t GraphScratchBytesBound(const GraphIndexParams& params, int64_t keys,
                                        int64_t queries, int dim, int threads, int heads = 1);

  // Build's steps apart, for an owner that computes the top-k lists of several heads' queries
  // in one batch top-k (IndexSelector: the query heads of a KV head share its keys):
  // how many queries a Build over `key_count` keys samples from `build_queries`;
  static int64_t SampledQueryCount(const GraphIndexParams& params, int64_t key_count,
                                   const BuildQueries& build_queries);
  // copies them, evenly spaced, into `queries` ([SampledQueryCount, keys.dim], packed) and
  // appends the keys each saw to `visible` when they are causal (the batch top-k's causal
  // counts); returns their sum ([keys.dim]: the entry point's query);
  static std::vector<float> SampleQueries(const GraphIndexParams& params, const VectorSet& keys,
                                          const BuildQueries& build_queries, float* queries,
                                          std::vector<int64_t>* visible);
  // builds from their top-k lists over `keys` (k = build_topk, as a BatchTopKFunction returns
  // them) and their sum; `topk_seconds` (what the lists took) goes to build_stats.
  // INVALID_ARGUMENT for lists of another k or holding ids outside the keys, or a sum of
  // another dim; the index is unchanged then. CANCELLED once `stop` is requested, asked
  // before each step of the build; the index is empty then.
  absl::Status BuildFromLists(const VectorSet& keys, std::span<const float> query_sum,
                              const TopKLists& lists, double topk_seconds,
                              const BuildStop& stop = BuildStop());

  const GraphBuildStats& build_stats() const { return build_stats_; }
  // Keys linked into the graph; [linked(), size()) is the tail.
  int64_t linked() const { return linked_; }
  // Keys an Add of a set of `key_count` keys would link (0: it would only append them).
  int64_t KeysToLink(int64_t key_count) const;
  // What the last Add linked (zeros when it only appended).
  const GraphLinkStats& last_link() const { return last_link_; }
  // Out-neighbors of a linked key.
  std::span<const int32_t> neighbors(int64_t node) const {
    return {adjacency_.data() + node * params_.max_degree, degree_[node]};
  }

 private:
  struct Edge {
    int32_t from;
    int32_t to;
    // A kept edge survives pruning at `from` (it displaces an unkept neighbor): the edges that
    // keep keys reachable (token chain, links to new or repaired keys) are kept.
    bool keep = false;
  };

  // Beam search over the linked keys only; `list` receives the candidates found, best first,
  // as (score, id), and `scored` (when not null) every key the search scored, in the order it
  // scored them.
  // `width` (1 to kMaxSearchWidth) best unexpanded candidates are expanded per round.
  void SearchGraph(const VectorSet& keys, const float* q, int list_size, int width,
                   std::vector<std::pair<float, int32_t>>* list, SearchStats* stats,
                   std::vector<std::pair<float, int32_t>>* scored = nullptr) const;
  struct GroupedTargets;
  // Merges edges into the graph: each node's current neighbors plus its new targets, pruned to
  // max_degree when over it. Nodes in parallel. Costs O(linked keys) for many edges (a
  // counting sort, in `grouped` when given, else in a buffer of its own) but O(edges) for a
  // few (a sort), as an incremental link has.
  // Returns the key distances its pruning computed.
  int64_t MergeEdges(const VectorSet& keys, std::vector<Edge>* edges,
                     GroupedTargets* grouped = nullptr);
  // A node's new targets: ids and, aligned with them, their keep marks (empty: none kept) and
  // their known distances to the node (empty: none known; NaN: that one not known).
  struct Targets {
    std::span<const int32_t> ids;
    std::span<const uint8_t> kept;
    std::span<const float> distances;
  };
  // MergeEdges for one node: `targets` join its row.
  int64_t MergeNode(const VectorSet& keys, int64_t node, const Targets& targets);
  // MergeNode for every node with targets in `grouped`, nodes in parallel.
  int64_t MergeGrouped(const VectorSet& keys, const GroupedTargets& grouped);
  // Adds v->u for every edge u->v of the linked keys (grouped in `grouped`).
  int64_t AddReverseEdges(const VectorSet& keys, GroupedTargets* grouped);
  // Links each of `nodes` both ways to the best keys its own (centered) search finds, the edges
  // into it kept (MergeEdges, with `grouped` when given).
  int64_t LinkByOwnSearch(const VectorSet& keys, std::span<const int32_t> nodes,
                          GroupedTargets* grouped = nullptr);
  // LinkByOwnSearch for the 1% of the keys farthest from the mean key (64 to 4096 keys).
  int64_t LinkOutliers(const VectorSet& keys, GroupedTargets* grouped);
  // key(node) - key_mean_: a key's own search looks along what sets it apart, not along the
  // offset that all keys share.
  void CenteredKey(const VectorSet& keys, int32_t node, float* out) const;
  // Links keys unreachable from the entry point; returns how many it linked. (Those that
  // return int64_t above return the key distances their pruning computed.)
  int64_t RepairConnectivity(const VectorSet& keys, GroupedTargets* grouped,
                             int64_t* still_unreachable, int64_t* distances);
  // Links the oldest `count` tail keys [linked_, linked_ + count) into the graph.
  void LinkOldest(const VectorSet& keys, const VectorSet& recent_queries, int64_t count);
  // Sets entry_ to the linked key with the highest score for the mean of `queries` (or their
  // sum, which ranks keys the same).
  void ChooseEntry(const VectorSet& keys, const VectorSet& queries);
  void ChooseEntry(const VectorSet& keys, std::span<const float> query_sum);
  // INVALID_ARGUMENT for parameters or keys a Build cannot take.
  absl::Status CheckBuildArgs(const VectorSet& keys) const;
  void Reserve(int64_t nodes);

  GraphIndexParams params_;
  BatchTopKFunction batch_topk_;
  int64_t size_ = 0;
  int64_t linked_ = 0;
  // [capacity, max_degree]; row i holds degree_[i] ids. Mapped memory: 16 MiB at 128K keys.
  cpu::MappedVector<int32_t> adjacency_;
  std::vector<uint16_t> degree_;
  // During a Build only: KeyDistance(i, row i's j-th id) at [i * max_degree + j] when the
  // pruning computed it, NaN otherwise, so that reverse edges reuse it.
  cpu::MappedVector<float> row_distances_;
  int32_t entry_ = -1;              // -1 while no key is linked
  std::vector<float> key_mean_;     // [dim]: mean of the keys at build time
  // The recent-query ration: keys linked x recent queries since the last projection search,
  // in units of 1 / link_threshold searches; and the next recent query to search.
  int64_t projection_credit_ = 0;
  int64_t projection_cursor_ = 0;
  GraphBuildStats build_stats_;
  GraphLinkStats last_link_;
};

}  // namespace kvrecall

#endif  // KVRECALL_INDEX_GRAPH_INDEX_H_
