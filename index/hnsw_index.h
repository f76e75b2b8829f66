// The key-key baseline: hnswlib's HNSW over the keys with the inner product, which knows nothing
// of the queries (the index RetrievalAttention shows decode queries to be out of distribution
// for).
#ifndef KVRECALL_INDEX_HNSW_INDEX_H_
#define KVRECALL_INDEX_HNSW_INDEX_H_

#include <memory>
#include <shared_mutex>

#include "index/key_index.h"

namespace kvrecall {

struct HnswParams {
  int m = 16;                 // hnswlib's M: links per node (2M on the base layer)
  int ef_construction = 200;  // candidate list while inserting
  int ef_search = 200;        // default candidate list of a search (SearchParams.list_size)
};

// hnswlib keeps its own copy of every key (counted in MemoryBytes). Searches with the same list
// size run concurrently; changing hnswlib's list size (ef) waits for the searches in flight.
// stats.hops stays 0: hnswlib does not report it per search.
class HnswIndex : public KeyIndex {
 public:
  explicit HnswIndex(const HnswParams& params);
  ~HnswIndex() override;

  const char* name() const override { return "hnsw"; }
  absl::Status Build(const VectorSet& keys, const BuildQueries& build_queries) override;
  absl::Status Add(const VectorSet& keys, const VectorSet& recent_queries) override;
  void Search(const VectorSet& keys, const float* q, int k, const SearchParams& params,
              SearchResult* out) const override;
  int64_t size() const override { return size_; }
  int64_t MemoryBytes() const override;

 private:
  struct Impl;  // hnswlib's types stay out of this header (its globals allow one includer)

  absl::Status Insert(const VectorSet& keys, int64_t begin);

  HnswParams params_;
  std::unique_ptr<Impl> impl_;
  int64_t size_ = 0;
  mutable std::shared_mutex ef_mutex_;
};

}  // namespace kvrecall

#endif  // KVRECALL_INDEX_HNSW_INDEX_H_
