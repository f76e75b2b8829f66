// Exact top-k by a full scan of the keys: the reference the graph and hnswlib are measured
// against, and the fallback that needs no build.
#ifndef KVRECALL_INDEX_FLAT_INDEX_H_
#define KVRECALL_INDEX_FLAT_INDEX_H_

#include "index/key_index.h"

namespace kvrecall {

// Holds nothing but the number of keys; every search scores all of them.
class FlatIndex : public KeyIndex {
 public:
  const char* name() const override { return "flat"; }
  absl::Status Build(const VectorSet& keys, const BuildQueries& build_queries) override;
  absl::Status Add(const VectorSet& keys, const VectorSet& recent_queries) override;
  void Search(const VectorSet& keys, const float* q, int k, const SearchParams& params,
              SearchResult* out) const override;
  int64_t size() const override { return size_; }
  int64_t MemoryBytes() const override { return 0; }

 private:
  int64_t size_ = 0;
};

}  // namespace kvrecall

#endif  // KVRECALL_INDEX_FLAT_INDEX_H_
