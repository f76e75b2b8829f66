#include "index/flat_index.h"

#include <limits>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/attention.h"

namespace kvrecall {
namespace {

absl::Status CheckCount(const VectorSet& keys, int64_t indexed) {
  if (keys.count > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat("flat index over ", keys.count, " keys: ids must fit in int32"));
  }
  if (keys.count < indexed) {
    return absl::InvalidArgumentError(
        absl::StrCat("flat index holds ", indexed, " keys; got a set of ", keys.count));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status FlatIndex::Build(const VectorSet& keys, const BuildQueries&) {
  if (absl::Status s = CheckCount(keys, 0); !s.ok()) return s;
  size_ = keys.count;
  return absl::OkStatus();
}

absl::Status FlatIndex::Add(const VectorSet& keys, const VectorSet&) {
  if (absl::Status s = CheckCount(keys, size_); !s.ok()) return s;
  size_ = keys.count;
  return absl::OkStatus();
}

void FlatIndex::Search(const VectorSet& keys, const float* q, int k, const SearchParams&,
                       SearchResult* out) const {
  out->stats = SearchStats{size_, 0};
  if (size_ == 0 || k < 1) {
    out->ids.clear();
    out->scores.clear();
    return;
  }
  const KvView view = keys.Slice(0, size_).AsKeyView();
  cpu::ExactTopK(q, view, 0, 1.0f, k, &out->ids);
  out->scores.resize(out->ids.size());
  cpu::ScoreTokens(q, view, 0, out->ids, 1.0f, out->scores.data());
}

}  // namespace kvrecall
