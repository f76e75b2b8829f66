#include "server/kv_store.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "proto/tensor_codec.h"

namespace kvrecall {
namespace {

// Maps the pages of a fresh allocation [p, p + bytes) in one call. Left to first touch, every
// 4 KiB page faults on its own: a decode step appends a key and a value row (4 KiB each at
// 8 KV heads x d=128), so nearly every step took two page faults, several microseconds in a VM
// (issue 12). Large allocations may take transparent huge pages. Best effort: without
// MADV_POPULATE_WRITE (Linux < 5.14) the pages fault in on first touch as before.
void MapPagesNow(void* p, size_t bytes) {
  constexpr size_t kLarge = size_t{2} << 20;
  if (bytes < kLarge) return;
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + page - 1) & ~(page - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + bytes) & ~(page - 1);
  if (end <= begin) return;
  void* const start = reinterpret_cast<void*>(begin);
#ifdef MADV_HUGEPAGE
  madvise(start, end - begin, MADV_HUGEPAGE);
#endif
#ifndef MADV_POPULATE_WRITE
  constexpr int MADV_POPULATE_WRITE = 23;  // <linux/mman.h>, Linux 5.14
#endif
  madvise(start, end - begin, MADV_POPULATE_WRITE);
}

}  // namespace

BudgetedRows& BudgetedRows::operator=(BudgetedRows&& other) noexcept {
  if (this != &other) {
    Free();
    row_width_ = other.row_width_;
    element_ = other.element_;
    budget_ = other.budget_;
    data_ = std::move(other.data_);
    rows_ = std::exchange(other.rows_, 0);
    capacity_rows_ = std::exchange(other.capacity_rows_, 0);
  }
  return *this;
}

absl::Status ReserveRows(std::span<BudgetedRows* const> arrays, int64_t more,
                         absl::string_view what) {
  const int64_t needed = arrays[0]->rows_ + more;
  int64_t largest = 0;
  for (const BudgetedRows* a : arrays) largest = std::max(largest, a->capacity_rows_);
  if (std::all_of(arrays.begin(), arrays.end(),
                  [&](const BudgetedRows* a) { return needed <= a->capacity_rows_; })) {
    return absl::OkStatus();
  }
  // Geometric growth keeps appends amortized O(1); when the budget cannot afford the slack,
  // the exact size may still fit.
  const int64_t grown = std::max({needed, largest + largest / 2, int64_t{16}});
  absl::Status status;
  for (const int64_t capacity : {grown, needed}) {
    int64_t extra_bytes = 0;
    for (const BudgetedRows* a : arrays) {
      extra_bytes += std::max<int64_t>(capacity - a->capacity_rows_, 0) * a->row_bytes();
    }
    MemoryAccount* budget = arrays[0]->budget_;
    status = budget != nullptr ? budget->Reserve(extra_bytes, what) : absl::OkStatus();
    if (status.ok()) {
      for (BudgetedRows* a : arrays) {
        if (a->capacity_rows_ < capacity) a->Reallocate(capacity);
      }
      return status;
    }
  }
  return status;
}

absl::Status BudgetedRows::Reserve(int64_t more, absl::string_view what) {
  BudgetedRows* const self[] = {this};
  return ReserveRows(self, more, what);
}

void BudgetedRows::Reallocate(int64_t capacity_rows) {
  auto grown = std::make_unique_for_overwrite<std::byte[]>(capacity_rows * row_bytes());
  MapPagesNow(grown.get(), capacity_rows * row_bytes());
  if (rows_ > 0) std::memcpy(grown.get(), data_.get(), rows_ * row_bytes());
  data_ = std::move(grown);
  capacity_rows_ = capacity_rows;
}

void BudgetedRows::Free() {
  if (budget_ != nullptr) budget_->Release(allocated_bytes());
  data_.reset();
  rows_ = 0;
  capacity_rows_ = 0;
}

absl::Status LayerKvStore::Reserve(int64_t more, absl::string_view what) {
  BudgetedRows* const arrays[] = {&keys_, &values_};
  return ReserveRows(arrays, more, what);
}

void LayerKvStore::StageToken(const float* key, const float* value) {
  const size_t width = static_cast<size_t>(kv_heads_) * head_dim_;
  ConvertFromF32(std::span<const float>(key, width), DTypeOf(element()), key_tail());
  ConvertFromF32(std::span<const float>(value, width), DTypeOf(element()), value_tail());
}

}  // namespace kvrecall
