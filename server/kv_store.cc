#include "server/kv_store.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cassert>
#include <cstdint>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "proto/tensor_codec.h"

namespace kvrecall {

namespace {

// HostKvGrowthCounts's, by how.
std::atomic<int64_t> growths_ahead{0}, growths_waited{0}, growths_in_place{0}, growths_moved{0};

void Count(std::atomic<int64_t>& growths, bool counted) {
  if (counted) growths.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace

HostKvGrowths HostKvGrowthCounts() {
  return {growths_ahead.load(std::memory_order_relaxed),
          growths_waited.load(std::memory_order_relaxed),
          growths_in_place.load(std::memory_order_relaxed),
          growths_moved.load(std::memory_order_relaxed)};
}

BudgetedRows& BudgetedRows::operator=(BudgetedRows&& other) noexcept {
  assert(other.growths_ahead_ == 0 && "a growth ahead in flight holds the array's address");
  if (this != &other) {
    Free();
    row_width_ = other.row_width_;
    element_ = other.element_;
    budget_ = other.budget_;
    data_ = std::move(other.data_);
    rows_ = std::exchange(other.rows_, 0);
    capacity_rows_ = std::exchange(other.capacity_rows_, 0);
    pinning_ = std::exchange(other.pinning_, nullptr);
    pinned_ranges_ = std::exchange(other.pinned_ranges_, {});
    pin_broken_ = std::exchange(other.pin_broken_, false);
    most_rows_ = std::exchange(other.most_rows_, 0);
    most_rows_kind_ = other.most_rows_kind_;
    counts_growths_ = other.counts_growths_;
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
  // the exact size may still fit. Arrays that hold what is needed in place grow at most to
  // the end of their reserved address space: their rows then stay where they are.
  int64_t grown = std::max({needed, largest + largest / 2, int64_t{16}});
  int64_t in_place = grown;
  for (const BudgetedRows* a : arrays) in_place = std::min(in_place, a->rows_in_place());
  if (needed <= in_place) grown = in_place;
  absl::Status status;
  for (const int64_t capacity : {grown, needed}) {
    // (Charged as the allocations take the host's memory: HostFootprint.)
    const auto extra_for = [capacity](const BudgetedRows* a) {
      return capacity > a->capacity_rows_
                 ? HostFootprint(capacity * a->row_bytes()) - a->allocated_bytes()
                 : int64_t{0};
    };
    int64_t extra_bytes = 0;
    for (const BudgetedRows* a : arrays) extra_bytes += extra_for(a);
    MemoryAccount* budget = arrays[0]->budget_;
    status = budget != nullptr ? budget->Reserve(extra_bytes, what) : absl::OkStatus();
    for (size_t i = 0; status.ok() && i < arrays.size(); ++i) {
      if (arrays[i]->capacity_rows_ >= capacity) continue;
      status = arrays[i]->Reallocate(capacity, what);
      if (!status.ok() && budget != nullptr) {
        // The arrays grown keep their room; the others give their share of the charge back.
        int64_t unused = 0;
        for (size_t j = i; j < arrays.size(); ++j) unused += extra_for(arrays[j]);
        budget->Release(unused);
      }
    }
    if (status.ok()) return status;
  }
  return status;
}

absl::Status BudgetedRows::Reserve(int64_t more, absl::string_view what) {
  BudgetedRows* const self[] = {this};
  return ReserveRows(self, more, what);
}

int64_t BudgetedRows::rows_in_place() const {
  if (!data_.mapped() || row_bytes() == 0) return capacity_rows_;
  return std::max(capacity_rows_,
                  static_cast<int64_t>(data_.reserved_bytes() / static_cast<size_t>(row_bytes())));
}

absl::Status BudgetedRows::Reallocate(int64_t capacity_rows, absl::string_view what) {
  // Its pages are mapped now: left to first touch, every 4 KiB page faulted on its own, and a
  // decode step appends a key and a value row (4 KiB each at 8 KV heads x d=128), so nearly
  // every step took two page faults, several microseconds in a VM (issue 12).
  // (The sessions' token ceiling keeps this product small; an allocator wraps no size.)
  int64_t bytes = 0;
  if (capacity_rows < 0 || __builtin_mul_overflow(capacity_rows, row_bytes(), &bytes)) {
    return absl::ResourceExhaustedError(absl::StrCat(what, ": ", capacity_rows, " rows of ",
                                                     row_bytes(), " bytes cannot be counted"));
  }
  if (growths_ahead_ > 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        what, ": the array cannot grow while a growth made ahead of need is in flight (end it "
              "first)"));
  }
  // Address space for the growths to come (a mapped allocation's only; none mapped yet): the
  // largest of these that the process's reservations leave room for (HostMemory chooses and
  // holds it at once; kHostRowsReserveShares): the rows the array may ever hold (MostRows:
  // whole, or up to kHostRowsReserveMostBytes), up to 1 GiB of them, four times the
  // allocation; else none (the allocation alone: it moves at every growth).
  std::array<size_t, 3> reserve_choices{};
  size_t choices = 0;
  if (int64_t four_times = 0;
      !__builtin_mul_overflow(bytes, int64_t{kHostRowsAddressReserve}, &four_times)) {
    reserve_choices[choices++] = static_cast<size_t>(four_times);
  }
  if (most_rows_ > 0) {
    int64_t most_bytes = 0;
    if (__builtin_mul_overflow(most_rows_, row_bytes(), &most_bytes)) {
      most_bytes = std::numeric_limits<int64_t>::max();  // more than any bound allows
    }
    most_bytes = std::min(
        most_bytes, static_cast<int64_t>(HostAddressSpaceBound() / kHostRowsReserveShares));
    const int64_t capped = std::min(most_bytes, kHostRowsReserveMostBytes);
    reserve_choices[choices++] = static_cast<size_t>(capped);
    if (most_rows_kind_ == MostRows::kSet) {
      reserve_choices[choices++] = static_cast<size_t>(most_bytes);
    }
  }
  const absl::Span<const size_t> reserve =
      absl::MakeConstSpan(reserve_choices.data(), choices);
  // A mapped allocation grows without a copy: only the new rows' pages are populated. A copy
  // into a new allocation populated and wrote every byte of both, in the step that needed the
  // row, and every layer of a model fills at the same token (bench/results/tiered_serving.md,
  // "A model's layers in turn": 128-191 ms a 32-layer token at 1.7K tokens, ~0.5 GB a layer at
  // 128K). Within its reserved address space it stays where it is: its pinned rows stay pinned
  // and only the added ones are pinned (kv_growth.md: at 128K rows 2.3 ms, against 8.6 to
  // unpin and pin again whole); past it, it moves and is pinned again whole.
  if (capacity_rows > capacity_rows_ && data_.mapped()) {
    const int64_t old_bytes = capacity_bytes();
    if (data_.GrowsInPlaceTo(static_cast<size_t>(bytes))) {
      // No fallback to a new allocation: the caller was told the rows stay (rows_in_place:
      // a learning may be reading them), so a growth that cannot stay is refused.
      if (absl::Status s = data_.Grow(static_cast<size_t>(bytes)); !s.ok()) {
        return absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
      }
      capacity_rows_ = capacity_rows;
      PinAdded(old_bytes);
      Count(growths_in_place, counts_growths_);
      return absl::OkStatus();
    } else {
      UnpinCurrent();
      if (data_.Grow(static_cast<size_t>(bytes), reserve).ok()) {
        capacity_rows_ = capacity_rows;
        PinCurrent();
        Count(growths_moved, counts_growths_);
        return absl::OkStatus();
      }
      // Left unpinned (the old pages may have moved, a failed Grow keeps their content) for
      // the new allocation below, which is pinned once made; pinned again only if that fails.
    }
  }
  absl::StatusOr<HostMemory> grown =
      AllocateHostMemory(static_cast<size_t>(bytes), cpu::HostHugePages(), reserve);
  if (!grown.ok()) {
    PinCurrent();  // as it was
    return absl::Status(grown.status().code(),
                        absl::StrCat(what, ": ", grown.status().message()));
  }
  if (rows_ > 0) std::memcpy(grown->data(), data_.data(), rows_ * row_bytes());
  UnpinCurrent();
  Count(growths_moved, counts_growths_ && capacity_rows_ > 0);  // (else its first allocation)
  data_ = *std::move(grown);
  capacity_rows_ = capacity_rows;
  PinCurrent();
  return absl::OkStatus();
}

void GrowthAhead::Run() {
  if (ran_ || memory_ == nullptr) return;
  ran_ = true;
  status_ = memory_->MapAhead(bytes_);
  if (status_.ok() && pinning_ != nullptr && pin_bytes_ > 0) {
    // Where the pin fails, the pages stay: the owner takes them, and the array is then not
    // the device's to read (EndGrowthAhead: the device reads all of it or none of it).
    pinned_ = pinning_->Pin(pin_start_, pin_bytes_).ok();
  }
}

absl::StatusOr<GrowthAhead> BudgetedRows::StartGrowthAhead(int64_t capacity_rows,
                                                          absl::string_view what) {
  if (capacity_rows <= capacity_rows_) return GrowthAhead();  // holds them already: nothing
  if (capacity_rows > rows_in_place() || !data_.mapped()) {
    return absl::FailedPreconditionError(absl::StrCat(
        what, ": ", capacity_rows, " rows cannot be made ahead where the array is (it holds ",
        capacity_rows_, " and ", rows_in_place(), " in place)"));
  }
  GrowthAhead growth;
  growth.charged_bytes_ = HostFootprint(capacity_rows * row_bytes()) - allocated_bytes();
  if (budget_ != nullptr) {
    if (absl::Status s = budget_->Reserve(growth.charged_bytes_, what); !s.ok()) return s;
  }
  ++growths_ahead_;
  growth.memory_ = &data_;
  growth.bytes_ = static_cast<size_t>(capacity_rows * row_bytes());
  growth.capacity_rows_ = capacity_rows;
  if (pinning_ != nullptr && !pin_broken_) {
    // The pages it adds, next to the pinned rest; or, where a pinning was refused before and
    // nothing is pinned, the whole array, asked again.
    const int64_t first =
        pinned() ? static_cast<int64_t>(WholePages(static_cast<size_t>(capacity_bytes()))) : 0;
    if (first < capacity_rows * row_bytes()) {
      growth.pinning_ = pinning_;
      growth.pin_start_ = data_.data() + first;
      growth.pin_bytes_ = static_cast<size_t>(capacity_rows * row_bytes() - first);
    }
  }
  return growth;
}

absl::Status BudgetedRows::EndGrowthAhead(GrowthAhead growth) {
  if (growth.memory_ == nullptr) return absl::OkStatus();  // an empty one: nothing to end
  if (growth.memory_ != &data_) {
    return absl::InvalidArgumentError("a growth ahead ended on another array than its own");
  }
  --growths_ahead_;
  if (growth.ran_ && growth.status_.ok()) {
    // Its pages are ready: the allocation takes them as they are (nothing mapped again).
    growth.status_ = data_.TakeMappedAhead(growth.bytes_);
    if (growth.status_.ok()) {
      capacity_rows_ = growth.capacity_rows_;
      Count(growth.waited_for_ ? growths_waited : growths_ahead, counts_growths_);
      if (growth.pinned_) {
        pinned_ranges_.push_back(growth.pin_start_);
      } else if (growth.pinning_ != nullptr && !pinned_ranges_.empty()) {
        pin_broken_ = true;  // as PinAdded: the device reads none of it from now on
      }
      return absl::OkStatus();
    }
  }
  if (growth.pinned_) growth.pinning_->Unpin(growth.pin_start_);
  data_.UnmapAhead(growth.bytes_);
  if (budget_ != nullptr) budget_->Release(growth.charged_bytes_);
  return growth.status_;
}

void BudgetedRows::Free() {
  assert(growths_ahead_ == 0 && "a growth ahead in flight maps this allocation");
  if (budget_ != nullptr) budget_->Release(allocated_bytes());
  UnpinCurrent();
  data_.reset();
  rows_ = 0;
  capacity_rows_ = 0;
}

bool BudgetedRows::SetPinning(HostPinning* pinning) {
  assert(growths_ahead_ == 0 && "a growth ahead in flight pins by the current pinning");
  if (pinning != pinning_) {
    UnpinCurrent();
    pinning_ = pinning;
  }
  PinCurrent();
  return pinned();
}

void BudgetedRows::PinCurrent() {
  if (pinning_ == nullptr || !pinned_ranges_.empty() || capacity_rows_ == 0) return;
  if (pinning_->Pin(data_.data(), static_cast<size_t>(capacity_bytes())).ok()) {
    pinned_ranges_.push_back(data_.data());
  }
}

void BudgetedRows::PinAdded(int64_t from) {
  if (pinned_ranges_.empty()) {
    PinCurrent();  // a pinning refused before is asked again, for the whole allocation
    return;
  }
  if (pin_broken_) return;  // its ranges stay until the rows move or go
  // From the first whole page added: the page the old end was in is pinned already (a
  // registration covers whole pages, and two may not share one).
  const auto first = static_cast<int64_t>(WholePages(static_cast<size_t>(from)));
  if (first >= capacity_bytes()) return;
  std::byte* const start = data_.data() + first;
  if (pinning_->Pin(start, static_cast<size_t>(capacity_bytes() - first)).ok()) {
    pinned_ranges_.push_back(start);
  } else {
    // The device reads none of it from now on; the pinned ranges stay registered (a learning
    // may be copying from them) until the rows move or are freed, which wait for it.
    pin_broken_ = true;
  }
}

void BudgetedRows::UnpinCurrent() {
  // The newest range first, as pinned in reverse.
  for (auto it = pinned_ranges_.rbegin(); it != pinned_ranges_.rend(); ++it) pinning_->Unpin(*it);
  pinned_ranges_.clear();
  pin_broken_ = false;
}

void PromptQueryWindow::Commit(int64_t n, bool written) {
  if (kept_ == 0) return;
  if (!written) std::fill_n(rows_.tail(), n * rows_.row_width(), 0.0f);
  rows_.Commit(n);
  if (const int64_t excess = rows_.rows() - kept_; excess > 0) {
    rows_.DropFront(excess);
    first_ += excess;
  }
}

absl::Status LayerKvStore::Reserve(int64_t more, absl::string_view what) {
  BudgetedRows* const arrays[] = {&keys_, &values_};
  return ReserveRows(arrays, more, what);
}

absl::StatusOr<LayerKvStore::Growth> LayerKvStore::StartGrowthAhead(
    int64_t capacity, absl::string_view what) {
  absl::StatusOr<GrowthAhead> keys = keys_.StartGrowthAhead(capacity, what);
  if (!keys.ok()) return keys.status();
  absl::StatusOr<GrowthAhead> values = values_.StartGrowthAhead(capacity, what);
  if (!values.ok()) {
    keys_.EndGrowthAhead(*std::move(keys)).IgnoreError();  // never ran: its charge given back
    return values.status();
  }
  return Growth{*std::move(keys), *std::move(values)};
}

absl::Status LayerKvStore::EndGrowthAhead(Growth growth) {
  absl::Status keys = keys_.EndGrowthAhead(std::move(growth.keys));
  absl::Status values = values_.EndGrowthAhead(std::move(growth.values));
  return keys.ok() ? values : keys;
}

void LayerKvStore::StageToken(const float* key, const float* value) {
  const size_t width = static_cast<size_t>(kv_heads_) * head_dim_;
  ConvertFromF32(std::span<const float>(key, width), DTypeOf(element()), key_tail());
  ConvertFromF32(std::span<const float>(value, width), DTypeOf(element()), value_tail());
}

}  // namespace kvrecall
