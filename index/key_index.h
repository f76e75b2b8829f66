// The faiss-like abstraction of a top-k inner-product index over one KV head's keys, which the
// query-aware graph, the hnswlib key-key baseline and the flat scan implement.
#ifndef KVRECALL_INDEX_KEY_INDEX_H_
#define KVRECALL_INDEX_KEY_INDEX_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "kernels/kv_view.h"
#include "kernels/vector_set.h"

namespace kvrecall {

// The queries a query-aware index learns the query distribution from: typically one query
// head's prompt queries, query i issued at token position i.
struct BuildQueries {
  VectorSet queries;                 // count 0: none (the index then uses the keys themselves)
  bool causal = false;               // query i attended only to keys at positions <= i
  // Position of key 0 of the key set, with query i at position i: a causal query i saw keys
  // [0, i - first_key_position] (negative when the queries start after key 0's token).
  int64_t first_key_position = 0;
};

struct SearchParams {
  // Candidate list size of a graph search (hnswlib's ef). The query-aware graph returns the
  // best k of every key its search scored, so a list shorter than k is a narrower, cheaper
  // search; hnswlib uses at least k. 0: the index's default. Ignored by the flat scan.
  int list_size = 0;
  // Candidates a graph search expands per round, their neighbors scored together (a beam
  // search's width; 1 is strict best-first). 0: the index's default. Ignored by other indexes.
  int width = 0;
};

// What one search cost.
struct SearchStats {
  int64_t scored = 0;  // keys whose inner product with the query was computed
  int64_t hops = 0;    // graph nodes expanded (0 for scans)
};

struct SearchResult {
  std::vector<int32_t> ids;    // positions in the key set, highest score first
  std::vector<float> scores;   // <q, key(id)>, unscaled, aligned with ids
  SearchStats stats;
};

// One instance indexes one key set for one query head (or one KV head, for query-agnostic
// indexes). The key storage is passed to every call instead of being held, because the owner
// may reallocate it as tokens are appended; it must hold the same keys at the same positions
// every time. Search is const and may run from several threads at once; Build and Add must not
// overlap anything else on the same instance.
class KeyIndex {
 public:
  virtual ~KeyIndex() = default;

  virtual const char* name() const = 0;

  // Indexes keys [0, keys.count). `build_queries` come from the distribution the index will
  // serve (the head's prefill queries, post-RoPE); query-agnostic indexes ignore them.
  virtual absl::Status Build(const VectorSet& keys, const BuildQueries& build_queries) = 0;

  // Indexes the keys [size(), keys.count) appended since the last Build or Add. `recent_queries`
  // (possibly empty) are the latest queries served, which a query-aware index may use to place
  // the new keys.
  virtual absl::Status Add(const VectorSet& keys, const VectorSet& recent_queries) = 0;

  // The min(k, size()) keys of [0, size()) with the highest <q, key>, q: [keys.dim].
  virtual void Search(const VectorSet& keys, const float* q, int k, const SearchParams& params,
                      SearchResult* out) const = 0;

  // Keys indexed so far.
  virtual int64_t size() const = 0;

  // Host bytes the index holds (graphs, copies), not counting the key storage it reads.
  virtual int64_t MemoryBytes() const = 0;
};

}  // namespace kvrecall

#endif  // KVRECALL_INDEX_KEY_INDEX_H_
