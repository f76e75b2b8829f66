// Host storage of a session's per-layer KV cache (and of staged prompt tensors): growable
// row-major arrays of f32 or of the model's 16-bit dtype whose allocations are charged to a
// MemoryAccount (the host budget, or a session's grant on it). Large arrays are in huge pages
// unless the process turned them off (server/host_memory.h).
#ifndef KVRECALL_SERVER_KV_STORE_H_
#define KVRECALL_SERVER_KV_STORE_H_

#include <algorithm>
#include <cassert>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "index/support_selector.h"
#include "kernels/dtype.h"
#include "kernels/kv_view.h"
#include "server/host_memory.h"
#include "server/memory_budget.h"

namespace kvrecall {

// Makes host allocations readable by a device, and undoes it: on a GPU tier, cudaHostRegister,
// so that its kernels read the tiered placement's bulk over PCIe (server/backends/
// gpu_static_set.cc). Pin may fail (the allocation then stays unpinned and the device does not
// read it); Unpin is called, before the memory is freed, for every allocation Pin accepted.
// An array grown where it is holds one pinned range per growth: kernels read across them (by
// address), but a single cudaMemcpy from it must not span two (the driver refuses it:
// cudaErrorInvalidValue); copy through memory of your own.
class HostPinning {
 public:
  virtual ~HostPinning() = default;
  virtual absl::Status Pin(void* data, size_t bytes) = 0;
  virtual void Unpin(void* data) = 0;
};

// Address space a mapped BudgetedRows sets aside, as a multiple of its allocation, to grow into
// without moving (HostMemory::Grow): four growths (half again three times, then to the
// reservation's end, ReserveRows's cap) keep its rows where they are, so readers elsewhere (a
// device's exact heads, a learning in flight) need not wait for it and a pinned array pins
// only the rows it adds. Address space only: no memory is mapped there.
inline constexpr int kHostRowsAddressReserve = 4;
// A mapped BudgetedRows reserves address space for the rows it may ever hold (set_most_rows)
// where that is more than kHostRowsAddressReserve times its allocation: with 4x alone, a layer
// that grew from a short prompt moved at every 4x, and every layer of a model at the same token
// (d130: 155 ms for 32 layers at 4.6K tokens, against ~11 for its neighbours; a move populates
// the added rows and pins the array again whole in the step). Address space only: no memory
// (PROT_NONE; counted against the system's commit limit only once it has moved, which matters
// only under vm.overcommit_memory=2). No array reserves more than 1/kHostRowsReserveShares of the
// process's bound on reservations (HostAddressSpaceBound: 32 TiB, or half its RLIMIT_AS), so
// that at least 64 sessions of 64 arrays reserve in full before any has to do with less. Where
// the bound's room is spent an array reserves the largest that still fits of its most rows,
// 1 GiB and 4x (chosen and held in one step: HostMemory), else nothing beyond its allocation
// (it then moves in the step at each growth).
enum class MostRows {
  // A length someone set (kvrecalld --max_context_tokens, an announced max_tokens): reserved
  // whole, within the share above, so that the array never moves below it. (An announced
  // length is allocated, and charged to the budget, at once: its 4x is the larger. The
  // operator's ceiling is what reaches here: 2 GiB an array at 1M tokens of a bf16 layer of 8
  // KV heads x d = 128.)
  kSet,
  // Only the most a layer can hold (kMaxLayerTokens, 2^31 - 1): reserved up to
  // kHostRowsReserveMostBytes, 1 GiB (512K such rows; a 32-layer session's 64 arrays take
  // 64 GiB of the 32 TiB bound). Past it the array moves once in the step, pinned again whole,
  // and reserves 4x from there.
  kCeiling,
};
inline constexpr int64_t kHostRowsReserveMostBytes = int64_t{1} << 30;
inline constexpr int64_t kHostRowsReserveShares = 4096;

// Sessions' host KV arrays' growths since the process started, by how each was made (a
// LayerKvStore's keys and values are an array each; other BudgetedRows are not counted).
// Thread-safe; for the metrics (kvrecall_host_kv_growths_total).
struct HostKvGrowths {
  int64_t ahead = 0;     // ahead of need, off the request's path (KvGrowthAhead)
  int64_t waited = 0;    // ahead, but still running when a request needed its rows and waited
  int64_t in_place = 0;  // in the request that needed the rows, where the array is
  int64_t moved = 0;     // in that request, to a new address: moved or copied, pinned again whole
};
HostKvGrowths HostKvGrowthCounts();

class BudgetedRows;

// A growth of a BudgetedRows within its reserved address space, made ahead of need by another
// thread while the array's owner goes on appending below its capacity: the owner starts it
// (BudgetedRows::StartGrowthAhead: the budget charged), any thread runs it (Run: the pages
// added mapped and populated, and pinned next to the rest where the array is pinned), and the
// owner ends it (BudgetedRows::EndGrowthAhead: the new capacity taken, or all of it given back).
// The work Run does is what a growth costs a decode step otherwise (kv_growth.md: ~17 ms to
// populate and ~2 ms to pin the rows added to an array of 128K rows). Move-only.
class GrowthAhead {
 public:
  // An empty one (nothing to make: BudgetedRows::StartGrowthAhead of rows it holds already).
  GrowthAhead() = default;
  // Moved from, it is empty (nothing for an owner to end).
  GrowthAhead(GrowthAhead&& other) noexcept : GrowthAhead(other) { other.memory_ = nullptr; }
  GrowthAhead& operator=(GrowthAhead&& other) noexcept {
    if (this != &other) {
      *this = other;
      other.memory_ = nullptr;
    }
    return *this;
  }

  // Maps (and pins) the pages; at most once. Safe beside the owner's reads and appends below
  // the old capacity.
  void Run();
  // A request needed its rows while it ran, and waited for it (counted so: HostKvGrowths).
  void MarkWaitedFor() { waited_for_ = true; }
  int64_t capacity_rows() const { return capacity_rows_; }
  // Run's outcome (OK before it ran).
  const absl::Status& status() const { return status_; }

 private:
  friend class BudgetedRows;
  // Copies only through the moves above, which empty their source.
  GrowthAhead(const GrowthAhead&) = default;
  GrowthAhead& operator=(const GrowthAhead&) = default;

  const HostMemory* memory_ = nullptr;
  HostPinning* pinning_ = nullptr;  // null: the array is not pinned
  size_t bytes_ = 0;                // the allocation's size after the growth
  std::byte* pin_start_ = nullptr;  // the first whole page added (pinned from there)
  size_t pin_bytes_ = 0;
  int64_t capacity_rows_ = 0;
  int64_t charged_bytes_ = 0;
  bool ran_ = false;
  bool pinned_ = false;
  bool waited_for_ = false;
  absl::Status status_;
};

// A [rows, row_width] array of `element`s, row-major, that grows geometrically (amortized O(1)
// per appended row). Appending is two-phase so that callers can validate in place and stay
// atomic: Reserve room, write (or decode) rows at the tail, then Commit them; rows never
// committed are not part of the content, whatever was written there.
class BudgetedRows {
 public:
  BudgetedRows() = default;
  BudgetedRows(int64_t row_width, MemoryAccount* budget, KvElement element = KvElement::kF32)
      : row_width_(row_width), element_(element), budget_(budget) {}
  BudgetedRows(BudgetedRows&& other) noexcept { *this = std::move(other); }
  BudgetedRows& operator=(BudgetedRows&& other) noexcept;
  ~BudgetedRows() { Free(); }

  // Makes room for `more` rows beyond the committed ones (see ReserveRows).
  absl::Status Reserve(int64_t more, absl::string_view what);

  // Where the next row goes, in the array's element type; valid for the rows reserved, until
  // the next Reserve.
  void* raw_tail() { return data_.data() + rows_ * row_bytes(); }
  // raw_tail() of an f32 array.
  float* tail() {
    assert(element_ == KvElement::kF32);
    return static_cast<float*>(raw_tail());
  }
  // Makes the next n reserved rows part of the content.
  void Commit(int64_t n) { rows_ += n; }
  // Drops the first n committed rows (n <= rows()): the rest move to the front, the allocation
  // stays (a window over the last rows of a stream).
  void DropFront(int64_t n) {
    std::memmove(data_.data(), data_.data() + n * row_bytes(), (rows_ - n) * row_bytes());
    rows_ -= n;
  }

  // Releases the allocation and its budget charge; the array is empty afterwards.
  void Free();

  // Starts a growth to `capacity_rows` (at most rows_in_place()) that another thread makes
  // ahead of need (GrowthAhead), its bytes charged to the budget now; an empty one where the
  // array holds them already. Until EndGrowthAhead the array may be read, reserved within its
  // capacity and appended to, but not grown past it (a Reserve that would is refused:
  // FAILED_PRECONDITION), nor freed, moved from or (un)pinned (asserted). FAILED_PRECONDITION
  // when it cannot grow there in place; RESOURCE_EXHAUSTED naming `what` when the budget
  // refuses.
  absl::StatusOr<GrowthAhead> StartGrowthAhead(int64_t capacity_rows, absl::string_view what);
  // Ends a growth started here (after its Run, or without it): the array's capacity is then
  // its (where its pin was refused, the device reads none of the array from then on: pinned()
  // false), or, where it failed or never ran, its pages, pin and charge are given back and
  // Run's status returned (OK for one that never ran, or an empty one: nothing to report).
  absl::Status EndGrowthAhead(GrowthAhead growth);

  // Pins the allocation, and every one after it, with `pinning` (null: none; the current one is
  // unpinned first). Returns whether the allocation is pinned now (an empty array is not).
  bool SetPinning(HostPinning* pinning);
  // Whether the current allocation is pinned (its address is the device's to read).
  bool pinned() const { return !pinned_ranges_.empty() && !pin_broken_; }

  const void* raw_data() const { return data_.data(); }
  // raw_data() of an f32 array.
  const float* data() const {
    assert(element_ == KvElement::kF32);
    return static_cast<const float*>(raw_data());
  }
  int64_t rows() const { return rows_; }
  int64_t row_width() const { return row_width_; }
  KvElement element() const { return element_; }
  int64_t row_bytes() const { return row_width_ * KvElementBytes(element_); }
  // The bytes of its capacity (capacity_rows() x row_bytes(): the extent written and pinned).
  int64_t capacity_bytes() const { return capacity_rows_ * row_bytes(); }
  // The host memory its allocation takes, and its budget is charged: HostFootprint of
  // capacity_bytes() (whole pages, and a page for each 2 MiB begun).
  int64_t allocated_bytes() const { return HostFootprint(capacity_bytes()); }
  // Rows the allocation holds.
  int64_t capacity_rows() const { return capacity_rows_; }
  // Rows it can hold without moving (at least capacity_rows()): a mapped allocation grows into
  // its reserved address space in place; a Reserve beyond them moves the content.
  int64_t rows_in_place() const;
  // The most rows the array will hold (0: not known), and what bounds them: a mapped allocation
  // made from now on reserves address space for them (MostRows says how much; at least
  // kHostRowsAddressReserve times itself), so that it grows to them without moving.
  void set_most_rows(int64_t rows, MostRows kind) {
    most_rows_ = rows;
    most_rows_kind_ = kind;
  }
  // Whether its growths count in HostKvGrowthCounts (a session's host KV: LayerKvStore's).
  void set_counts_growths(bool on) { counts_growths_ = on; }

 private:
  friend absl::Status ReserveRows(std::span<BudgetedRows* const> arrays, int64_t more,
                                  absl::string_view what);
  // Grows the allocation to `capacity_rows` (>= rows), which the caller has already charged to
  // the budget: within rows_in_place() where it is (only the rows added pinned, when it is
  // pinned), else moved, without a copy where it is mapped (HostMemory::Grow), into an
  // allocation pinned whole (the old one unpinned). RESOURCE_EXHAUSTED naming `what` when the
  // memory cannot be had; then nothing changed but, perhaps, the address.
  absl::Status Reallocate(int64_t capacity_rows, absl::string_view what);
  // Pins the current allocation when there is pinning and it is not pinned yet.
  void PinCurrent();
  // Pins the bytes from `from` to the allocation's end, added by a growth in place, next to
  // the pinned rest; when that fails, the array is not the device's to read (pin_broken_: the
  // device reads all of it or none), its ranges kept until the rows move or are freed.
  void PinAdded(int64_t from);
  void UnpinCurrent();

  int64_t row_width_ = 0;
  KvElement element_ = KvElement::kF32;
  MemoryAccount* budget_ = nullptr;
  HostMemory data_;
  int64_t rows_ = 0;
  int64_t capacity_rows_ = 0;
  HostPinning* pinning_ = nullptr;
  // The starts of the allocation's pinned ranges, in address order: the whole allocation as it
  // was pinned, then the rows each growth in place added. Empty: not pinned.
  std::vector<std::byte*> pinned_ranges_;
  // A growth's rows could not be pinned: the device reads none of the array (pinned() false),
  // though its ranges stay registered, since a reader (a learning's copy) may be using them;
  // they go when the rows move or are freed, which wait for it.
  bool pin_broken_ = false;
  // Growths ahead started and not ended (StartGrowthAhead): the allocation is theirs to map.
  int growths_ahead_ = 0;
  int64_t most_rows_ = 0;  // set_most_rows
  MostRows most_rows_kind_ = MostRows::kCeiling;
  bool counts_growths_ = false;
};

// Makes room for `more` rows in each of `arrays` (which hold equally many rows and share one
// budget), all growing to one capacity: at least half again the largest current one, or —
// when the budget or the host's memory cannot afford that slack — exactly the rows needed.
// RESOURCE_EXHAUSTED (naming `what`) when not even that fits; then the content did not change
// (arrays grown before an allocation failed keep their room, and its charge).
absl::Status ReserveRows(std::span<BudgetedRows* const> arrays, int64_t more,
                         absl::string_view what);

// The prompt's queries that a selector's build reads, staged as the prompt's chunks arrive: a
// window over the prompt's last `kept` rows (PromptQueriesNeeded), so that a placement holds
// those rather than [T, q_heads, head_dim] f32 of which the build reads a few hundred rows, or
// none. Appends are two-phase as in BudgetedRows: Reserve room for a chunk, write its queries
// at tail(), then Commit them.
class PromptQueryWindow {
 public:
  // row_width: floats per row (q_heads * head_dim). kept: how many of the prompt's last rows
  // the window holds (0: none; then nothing is reserved, stored or charged to `budget`).
  PromptQueryWindow(int64_t row_width, int64_t kept, MemoryAccount* budget)
      : rows_(row_width, budget), kept_(kept) {}

  // Room for a chunk's `more` rows, all of them: a chunk is written whole, and its rows before
  // the window are only dropped at Commit. RESOURCE_EXHAUSTED naming `what`. Nothing with none
  // kept.
  absl::Status Reserve(int64_t more, absl::string_view what) {
    return kept_ > 0 ? rows_.Reserve(more, what) : absl::OkStatus();
  }
  // [more, row_width] f32 slots, row-major, for the reserved rows; valid until Commit or the
  // next Reserve. Null with none kept (the caller writes nothing).
  float* tail() { return kept_ > 0 ? rows_.tail() : nullptr; }
  // Makes the next n reserved rows the prompt's next ones — zeros where `written` is false (a
  // chunk that came without queries: the selector must not have needed them, but the rows
  // keep the window's positions) — then keeps only the last `kept`.
  void Commit(int64_t n, bool written = true);

  // The window as the selector's build reads it: rows [first(), first() + rows()) of the
  // prompt's [T, row_width], data at row first(); empty (PromptQueries()) with none kept.
  PromptQueries prompt_queries() const {
    return kept_ > 0 ? PromptQueries(rows_.data(), first_) : PromptQueries();
  }
  // The window's rows: min(prompt rows committed, kept).
  int64_t rows() const { return rows_.rows(); }
  // The prompt's row index of the window's first row.
  int64_t first() const { return first_; }
  int64_t kept() const { return kept_; }
  int64_t row_width() const { return rows_.row_width(); }
  int64_t allocated_bytes() const { return rows_.allocated_bytes(); }

 private:
  BudgetedRows rows_;  // f32 [rows, row_width]: the prompt's rows [first_, first_ + rows)
  int64_t kept_ = 0;
  int64_t first_ = 0;
};

// One layer's KV cache: keys and values, [tokens, kv_heads, head_dim] each, row-major, stored
// as `element` (f32, or the model's bf16 / f16) — exactly the layout of KvView. Appends are
// two-phase as in BudgetedRows.
class LayerKvStore {
 public:
  LayerKvStore() = default;
  LayerKvStore(int kv_heads, int head_dim, MemoryAccount* budget,
               KvElement element = KvElement::kF32)
      : keys_(int64_t{kv_heads} * head_dim, budget, element),
        values_(int64_t{kv_heads} * head_dim, budget, element),
        kv_heads_(kv_heads),
        head_dim_(head_dim) {
    keys_.set_counts_growths(true);
    values_.set_counts_growths(true);
  }

  // Host bytes of `tokens` tokens' keys and values of this shape and element type, as a store
  // allocated for them is charged (allocated_bytes()).
  static int64_t BytesFor(int64_t tokens, int kv_heads, int head_dim, KvElement element) {
    return 2 * HostFootprint(tokens * kv_heads * head_dim * int64_t{KvElementBytes(element)});
  }

  // Room for `more` tokens beyond the committed ones; RESOURCE_EXHAUSTED naming `what`.
  absl::Status Reserve(int64_t more, absl::string_view what);
  // [more, kv_heads, head_dim] slots of element() for the next tokens' keys and values (after
  // Reserve).
  void* key_tail() { return keys_.raw_tail(); }
  void* value_tail() { return values_.raw_tail(); }
  // Writes one token's f32 key and value ([kv_heads, head_dim] each) into the first reserved
  // slot, converted to element() (bf16 / f16 round to nearest even); not committed yet.
  void StageToken(const float* key, const float* value);
  void Commit(int64_t n) {
    keys_.Commit(n);
    values_.Commit(n);
  }
  void Free() {
    keys_.Free();
    values_.Free();
  }
  // Keys' and values' growths to `capacity` tokens ahead of need, as BudgetedRows's
  // (StartGrowthAhead: the same contract until EndGrowthAhead). Run them on any thread.
  struct Growth {
    GrowthAhead keys, values;
    void Run() {
      keys.Run();
      values.Run();
    }
    void MarkWaitedFor() {
      keys.MarkWaitedFor();
      values.MarkWaitedFor();
    }
  };
  absl::StatusOr<Growth> StartGrowthAhead(int64_t capacity, absl::string_view what);
  // Ends both (the arrays' capacity then theirs, or what either took given back: a failure's
  // status); see BudgetedRows::EndGrowthAhead.
  absl::Status EndGrowthAhead(Growth growth);

  // The most tokens the layer will hold (LayerConfig::tokens_to_hold) and what bounds them: the
  // arrays reserve address space for them (BudgetedRows::set_most_rows).
  void set_most_tokens(int64_t tokens, MostRows kind) {
    keys_.set_most_rows(tokens, kind);
    values_.set_most_rows(tokens, kind);
  }
  // Pins keys and values, now and after every growth (BudgetedRows::SetPinning); returns whether
  // both are pinned.
  bool SetPinning(HostPinning* pinning) {
    const bool keys = keys_.SetPinning(pinning);
    return values_.SetPinning(pinning) && keys;
  }
  bool pinned() const { return keys_.pinned() && values_.pinned(); }

  // Valid until the next Reserve that moves the rows (past tokens_in_place()), or Free.
  KvView view() const {
    return KvView{keys_.raw_data(), values_.raw_data(), keys_.rows(), kv_heads_, head_dim_,
                  keys_.element()};
  }
  int64_t tokens() const { return keys_.rows(); }
  // Tokens the allocations hold (both arrays grow together, though a growth refused halfway
  // may leave the keys the larger).
  int64_t capacity() const {
    return std::min(keys_.capacity_rows(), values_.capacity_rows());
  }
  // Tokens they hold without moving: a Reserve up to them keeps view()'s addresses (the rows
  // already there may be read meanwhile); beyond them the rows move.
  int64_t tokens_in_place() const {
    return std::min(keys_.rows_in_place(), values_.rows_in_place());
  }
  KvElement element() const { return keys_.element(); }
  int64_t allocated_bytes() const { return keys_.allocated_bytes() + values_.allocated_bytes(); }
  // The bytes of both arrays' capacity (BudgetedRows::capacity_bytes).
  int64_t capacity_bytes() const { return keys_.capacity_bytes() + values_.capacity_bytes(); }

 private:
  BudgetedRows keys_;
  BudgetedRows values_;
  int kv_heads_ = 0;
  int head_dim_ = 0;
};

}  // namespace kvrecall

#endif  // KVRECALL_SERVER_KV_STORE_H_
