// Host storage of a session's per-layer KV cache (and of staged prompt tensors): growable
// row-major f32 arrays whose allocations are charged to a MemoryAccount (the host budget, or a
// session's grant on it).
#ifndef KVRECALL_SERVER_KV_STORE_H_
#define KVRECALL_SERVER_KV_STORE_H_

#include <cstdint>
#include <memory>
#include <span>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "kernels/kv_view.h"
#include "server/memory_budget.h"

namespace kvrecall {

// A [rows, row_width] f32 array, row-major, that grows geometrically (amortized O(1) per
// appended row). Appending is two-phase so that callers can validate in place and stay atomic:
// Reserve room, write (or decode) rows at tail(), then Commit them; rows never committed are
// not part of the content, whatever was written there.
class BudgetedRows {
 public:
  BudgetedRows() = default;
  BudgetedRows(int64_t row_width, MemoryAccount* budget)
      : row_width_(row_width), budget_(budget) {}
  BudgetedRows(BudgetedRows&& other) noexcept { *this = std::move(other); }
  BudgetedRows& operator=(BudgetedRows&& other) noexcept;
  ~BudgetedRows() { Free(); }

  // Makes room for `more` rows beyond the committed ones (see ReserveRows).
  absl::Status Reserve(int64_t more, absl::string_view what);

  // Where the next row goes; valid for the rows reserved, until the next Reserve.
  float* tail() { return data_.get() + rows_ * row_width_; }
  // Makes the next n reserved rows part of the content.
  void Commit(int64_t n) { rows_ += n; }

  // Releases the allocation and its budget charge; the array is empty afterwards.
  void Free();

  const float* data() const { return data_.get(); }
  int64_t rows() const { return rows_; }
  int64_t row_width() const { return row_width_; }
  int64_t allocated_bytes() const { return capacity_rows_ * row_width_ * int64_t{sizeof(float)}; }

 private:
  friend absl::Status ReserveRows(std::span<BudgetedRows* const> arrays, int64_t more,
                                  absl::string_view what);
  // Moves the content to an allocation of `capacity_rows` (>= rows) that the caller has
  // already charged to the budget.
  void Reallocate(int64_t capacity_rows);

  int64_t row_width_ = 0;
  MemoryAccount* budget_ = nullptr;
  std::unique_ptr<float[]> data_;
  int64_t rows_ = 0;
  int64_t capacity_rows_ = 0;
};

// Makes room for `more` rows in each of `arrays` (which hold equally many rows and share one
// budget), all growing to one capacity: at least half again the largest current one, or —
// when the budget cannot afford that slack — exactly the rows needed. RESOURCE_EXHAUSTED
// (naming `what`) when not even that fits; then nothing changed.
absl::Status ReserveRows(std::span<BudgetedRows* const> arrays, int64_t more,
                         absl::string_view what);

// One layer's KV cache: keys and values, [tokens, kv_heads, head_dim] each, row-major f32 —
// exactly the layout of KvView. Appends are two-phase as in BudgetedRows.
class LayerKvStore {
 public:
  LayerKvStore() = default;
  LayerKvStore(int kv_heads, int head_dim, MemoryAccount* budget)
      : keys_(int64_t{kv_heads} * head_dim, budget),
        values_(int64_t{kv_heads} * head_dim, budget),
        kv_heads_(kv_heads),
        head_dim_(head_dim) {}

  // Room for `more` tokens beyond the committed ones; RESOURCE_EXHAUSTED naming `what`.
  absl::Status Reserve(int64_t more, absl::string_view what);
  // [more, kv_heads, head_dim] slots for the next tokens' keys and values (after Reserve).
  float* key_tail() { return keys_.tail(); }
  float* value_tail() { return values_.tail(); }
  void Commit(int64_t n) {
    keys_.Commit(n);
    values_.Commit(n);
  }
  void Free() {
    keys_.Free();
    values_.Free();
  }

  // Valid until the next Reserve or Free.
  KvView view() const {
    return KvView{keys_.data(), values_.data(), keys_.rows(), kv_heads_, head_dim_};
  }
  int64_t tokens() const { return keys_.rows(); }
  int64_t allocated_bytes() const { return keys_.allocated_bytes() + values_.allocated_bytes(); }

 private:
  BudgetedRows keys_;
  BudgetedRows values_;
  int kv_heads_ = 0;
  int head_dim_ = 0;
};

}  // namespace kvrecall

#endif  // KVRECALL_SERVER_KV_STORE_H_
