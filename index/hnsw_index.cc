#include "index/hnsw_index.h"

#include <hnswlib/hnswlib.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <mutex>
#include <string>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/attention.h"

namespace kvrecall {
namespace {

// Distances computed by this thread since the last reset: hnswlib's own counters are shared by
// every thread, so a search's cost is counted through the distance function instead.
thread_local int64_t t_distance_count = 0;

// hnswlib's inner-product space (distance 1 - <a, b>), counting the distances it computes.
class CountingInnerProductSpace : public hnswlib::SpaceInterface<float> {
 public:
  explicit CountingInnerProductSpace(size_t dim) : inner_(dim) {
    param_.inner = inner_.get_dist_func();
    param_.inner_param = inner_.get_dist_func_param();
  }
  size_t get_data_size() override { return inner_.get_data_size(); }
  hnswlib::DISTFUNC<float> get_dist_func() override { return &Distance; }
  void* get_dist_func_param() override { return &param_; }

 private:
  struct Param {
    hnswlib::DISTFUNC<float> inner;
    void* inner_param;
  };
  static float Distance(const void* a, const void* b, const void* param) {
    ++t_distance_count;
    const Param* p = static_cast<const Param*>(param);
    return p->inner(a, b, p->inner_param);
  }

  hnswlib::InnerProductSpace inner_;
  Param param_;
};

}  // namespace

struct HnswIndex::Impl {
  explicit Impl(int dim) : space(dim) {}
  CountingInnerProductSpace space;
  std::unique_ptr<hnswlib::HierarchicalNSW<float>> graph;
};

HnswIndex::HnswIndex(const HnswParams& params) : params_(params) {}
HnswIndex::~HnswIndex() = default;

absl::Status HnswIndex::Build(const VectorSet& keys, const BuildQueries&) {
  if (params_.m < 2 || params_.ef_construction < 1 || params_.ef_search < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "hnsw needs m >= 2, ef_construction >= 1 and ef_search >= 1; got m=", params_.m,
        " ef_construction=", params_.ef_construction, " ef_search=", params_.ef_search));
  }
  impl_ = std::make_unique<Impl>(keys.dim);
  impl_->graph = std::make_unique<hnswlib::HierarchicalNSW<float>>(
      &impl_->space, std::max<int64_t>(keys.count, 1), params_.m, params_.ef_construction);
  impl_->graph->setEf(params_.ef_search);
  size_ = 0;
  return Insert(keys, 0);
}

absl::Status HnswIndex::Add(const VectorSet& keys, const VectorSet&) {
  if (impl_ == nullptr) return absl::FailedPreconditionError("hnsw index: Add before Build");
  if (keys.count < size_) {
    return absl::InvalidArgumentError(
        absl::StrCat("hnsw index holds ", size_, " keys; Add got a set of ", keys.count));
  }
  return Insert(keys, size_);
}

absl::Status HnswIndex::Insert(const VectorSet& keys, int64_t begin) {
  if (keys.count > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat("hnsw index over ", keys.count, " keys: ids must fit in int32"));
  }
  hnswlib::HierarchicalNSW<float>& graph = *impl_->graph;
  std::atomic<bool> failed = false;
  std::string error;
  auto add = [&](int64_t i) {
    try {
      // hnswlib copies the point in f32 (its space's type), whatever the keys are stored in.
      thread_local std::vector<float> point;
      point.resize(keys.dim);
      cpu::LoadRow(keys.row_data(i), keys.element, keys.dim, point.data());
      graph.addPoint(point.data(), static_cast<hnswlib::labeltype>(i));
    } catch (const std::exception& e) {
      if (!failed.exchange(true)) error = e.what();
    }
  };
  try {
    if (static_cast<size_t>(keys.count) > graph.max_elements_) {
      graph.resizeIndex(std::max<size_t>(keys.count, 2 * graph.max_elements_));
    }
  } catch (const std::exception& e) {
    return absl::ResourceExhaustedError(absl::StrCat("hnsw index resize: ", e.what()));
  }
  // The first key becomes the entry point alone; the rest go in in parallel.
  int64_t first = begin;
  if (graph.cur_element_count == 0 && first < keys.count) add(first++);
#pragma omp parallel for schedule(dynamic, 64)
  for (int64_t i = first; i < keys.count; ++i) add(i);
  if (failed) return absl::InternalError(absl::StrCat("hnswlib addPoint: ", error));
  size_ = keys.count;
  return absl::OkStatus();
}

void HnswIndex::Search(const VectorSet&, const float* q, int k, const SearchParams& params,
                       SearchResult* out) const {
  out->ids.clear();
  out->scores.clear();
  out->stats = SearchStats();
  if (size_ == 0 || k < 1) return;
  hnswlib::HierarchicalNSW<float>& graph = *impl_->graph;
  const size_t ef =
      static_cast<size_t>(std::max(k, params.list_size > 0 ? params.list_size : params_.ef_search));
  std::priority_queue<std::pair<float, hnswlib::labeltype>> found;
  t_distance_count = 0;
  {
    std::shared_lock shared(ef_mutex_);
    if (graph.ef_ == ef) found = graph.searchKnn(q, k);
  }
  if (found.empty()) {
    std::unique_lock exclusive(ef_mutex_);
    t_distance_count = 0;
    graph.setEf(ef);
    found = graph.searchKnn(q, k);
  }
  out->stats.scored = t_distance_count;
  // hnswlib hands the worst first.
  out->ids.resize(found.size());
  out->scores.resize(found.size());
  for (size_t i = found.size(); i-- > 0;) {
    out->ids[i] = static_cast<int32_t>(found.top().second);
    out->scores[i] = 1.0f - found.top().first;
    found.pop();
  }
}

int64_t HnswIndex::MemoryBytes() const {
  if (impl_ == nullptr) return 0;
  const hnswlib::HierarchicalNSW<float>& graph = *impl_->graph;
  int64_t upper_links = 0;
  for (size_t i = 0; i < graph.cur_element_count; ++i) {
    upper_links += static_cast<int64_t>(graph.element_levels_[i]) * graph.size_links_per_element_;
  }
  // Base layer (links + key copy + label), upper layers, and the per-element bookkeeping: a
  // link-list pointer, a level, a lock and a label-map entry.
  const int64_t per_element = sizeof(void*) + sizeof(int) + sizeof(std::mutex) +
                              sizeof(std::pair<hnswlib::labeltype, hnswlib::tableint>) +
                              2 * sizeof(void*);
  return static_cast<int64_t>(graph.max_elements_ * graph.size_data_per_element_) + upper_links +
         static_cast<int64_t>(graph.max_elements_) * per_element;
}

}  // namespace kvrecall
