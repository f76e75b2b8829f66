#include "server/kv_store.h"

#include <algorithm>
#include <cstring>

namespace kvrecall {

BudgetedRows& BudgetedRows::operator=(BudgetedRows&& other) noexcept {
  if (this != &other) {
    Free();
    row_width_ = other.row_width_;
    budget_ = other.budget_;
    data_ = std::move(other.data_);
    rows_ = std::exchange(other.rows_, 0);
    capacity_rows_ = std::exchange(other.capacity_rows_, 0);
  }
  return *this;
}

absl::Status BudgetedRows::Reserve(int64_t more, absl::string_view what) {
  const int64_t needed = rows_ + more;
  if (needed <= capacity_rows_) return absl::OkStatus();
  // Geometric growth keeps appends amortized O(1); when the budget cannot afford the slack,
  // the exact size may still fit.
  const int64_t grown = std::max({needed, capacity_rows_ + capacity_rows_ / 2, int64_t{16}});
  if (Reallocate(grown, what).ok()) return absl::OkStatus();
  return Reallocate(needed, what);
}

absl::Status BudgetedRows::Reallocate(int64_t capacity_rows, absl::string_view what) {
  const int64_t extra_bytes = (capacity_rows - capacity_rows_) * row_width_ * int64_t{sizeof(float)};
  if (budget_ != nullptr) {
    if (absl::Status s = budget_->Reserve(extra_bytes, what); !s.ok()) return s;
  }
  auto grown = std::make_unique_for_overwrite<float[]>(capacity_rows * row_width_);
  if (rows_ > 0) std::memcpy(grown.get(), data_.get(), rows_ * row_width_ * sizeof(float));
  data_ = std::move(grown);
  capacity_rows_ = capacity_rows;
  return absl::OkStatus();
}

void BudgetedRows::Free() {
  if (budget_ != nullptr) budget_->Release(allocated_bytes());
  data_.reset();
  rows_ = 0;
  capacity_rows_ = 0;
}

absl::Status LayerKvStore::Reserve(int64_t more, absl::string_view what) {
  if (absl::Status s = keys_.Reserve(more, what); !s.ok()) return s;
  return values_.Reserve(more, what);
}

}  // namespace kvrecall
