// The server's host KV store and memory budget: two-phase appends keep content exact through
// growth, growth is geometric while the budget allows and exact when it does not, a refused
// reservation changes nothing, and every byte is given back. Large arrays are 2 MiB-aligned
// mappings, in huge pages unless the process turned them off (server/host_memory.h). The prompt
// query window keeps exactly the prompt's last rows, and nothing when none are kept.
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "index/support_selector.h"
#include "kernels/dtype.h"
#include "server/backends/cpu_backend.h"
#include "server/host_memory.h"
#include "server/kv_growth.h"
#include "server/kv_store.h"
#include "server/memory_budget.h"
#include "server/session.h"
#include "server/status_util.h"
#include "server/work_queue.h"
#include "tests/server_fixture.h"

namespace kvrecall {
namespace {

using ::kvrecall::testing::HasStatus;

// Appends n rows of `width` floats whose values encode (row, column).
void AppendRows(BudgetedRows& rows, int64_t n) {
  ASSERT_TRUE(rows.Reserve(n, "test rows").ok());
  float* tail = rows.tail();
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t c = 0; c < rows.row_width(); ++c) {
      tail[r * rows.row_width() + c] = static_cast<float>((rows.rows() + r) * 1000 + c);
    }
  }
  rows.Commit(n);
}

void ExpectRowsIntact(const BudgetedRows& rows) {
  for (int64_t r = 0; r < rows.rows(); ++r) {
    for (int64_t c = 0; c < rows.row_width(); ++c) {
      ASSERT_EQ(rows.data()[r * rows.row_width() + c], static_cast<float>(r * 1000 + c));
    }
  }
}

TEST(KvStoreTest, GrowsGeometricallyAndKeepsContent) {
  MemoryBudget budget(0);
  BudgetedRows rows(3, &budget);
  int reallocations = 0;
  int64_t last_bytes = 0;
  for (int i = 0; i < 1000; ++i) {
    AppendRows(rows, 1);
    if (rows.allocated_bytes() != last_bytes) ++reallocations;
    last_bytes = rows.allocated_bytes();
    EXPECT_EQ(budget.used(), rows.allocated_bytes());
  }
  ExpectRowsIntact(rows);
  EXPECT_EQ(rows.rows(), 1000);
  // 16, 24, 36, ... : amortized O(1) appends take O(log n) reallocations.
  EXPECT_LE(reallocations, 15);
  EXPECT_LE(rows.capacity_bytes(), 1000 * 3 * 4 * 3 / 2 + 3 * 4 * 16);
  // Charged as the allocation takes the host's memory: whole pages, and a page table's.
  EXPECT_EQ(rows.allocated_bytes(), HostFootprint(rows.capacity_bytes()));
  rows.Free();
  EXPECT_EQ(budget.used(), 0);
  EXPECT_EQ(rows.rows(), 0);
}

TEST(KvStoreTest, UncommittedRowsAreNotContent) {
  BudgetedRows rows(2, nullptr);
  AppendRows(rows, 5);
  ASSERT_TRUE(rows.Reserve(3, "test").ok());
  std::fill(rows.tail(), rows.tail() + 6, -1.0f);  // written, never committed
  EXPECT_EQ(rows.rows(), 5);
  AppendRows(rows, 2);  // overwrites the abandoned tail
  ExpectRowsIntact(rows);
}

TEST(KvStoreTest, BudgetRefusalChangesNothingAndFallsBackToExactGrowth) {
  // Keys and values of 1024 floats per token: a page each, so that every row added is a page
  // more of the host's memory (and the budget's: HostFootprint, an array's pages and its page
  // table's). A budget of exactly 40 tokens.
  constexpr int kWidth = 1024;
  const int64_t page = sysconf(_SC_PAGESIZE);
  if (page != 4096) GTEST_SKIP() << "pages of " << page << " bytes";
  const int64_t forty = 2 * HostFootprint(40 * kWidth * 4);
  ASSERT_EQ(forty, 2 * (40 + 1) * 4096);
  MemoryBudget budget(forty);
  LayerKvStore kv(1, kWidth, &budget);
  std::vector<float> token(kWidth);
  int64_t appended = 0;
  absl::Status refused;
  while (refused.ok() && appended < 100) {
    refused = kv.Reserve(1, "the new token");
    if (!refused.ok()) break;
    token[0] = static_cast<float>(appended);
    token[1] = -static_cast<float>(appended);
    std::memcpy(kv.key_tail(), token.data(), sizeof(float) * kWidth);
    std::memcpy(kv.value_tail(), token.data(), sizeof(float) * kWidth);
    kv.Commit(1);
    ++appended;
  }
  // Growth 16 -> 24 -> 36 -> exactly 37..40 when 54 no longer fits: the budget is used to
  // the last token.
  EXPECT_EQ(appended, 40);
  EXPECT_TRUE(HasStatus(refused, absl::StatusCode::kResourceExhausted,
                        absl::StrCat("host memory budget exceeded: the new token needs 8192 more "
                                     "bytes, ", forty, " of the ", forty, "-byte budget")));
  EXPECT_EQ(kv.tokens(), 40);
  EXPECT_EQ(budget.used(), forty);
  const KvView view = kv.view();
  for (int64_t t = 0; t < view.tokens; ++t) {
    EXPECT_EQ(view.key(t, 0)[0], static_cast<float>(t));
    EXPECT_EQ(view.value(t, 0)[1], -static_cast<float>(t));
  }
  kv.Free();
  EXPECT_EQ(budget.used(), 0);
}

// A 16-bit store (the tiered placement's host KV in the session's dtype) charges two bytes an
// element and stages f32 tokens rounded to nearest even.
TEST(KvStoreTest, SixteenBitStoreHalvesTheBytesAndRoundsStagedTokens) {
  for (KvElement element : {KvElement::kBf16, KvElement::kF16}) {
    MemoryBudget budget(0);
    LayerKvStore kv(2, 8, &budget, element);
    EXPECT_EQ(kv.element(), element);
    ASSERT_TRUE(kv.Reserve(16, "the prompt").ok());
    EXPECT_EQ(kv.capacity_bytes(), 2 * 16 * 16 * 2);
    EXPECT_EQ(budget.used(), kv.allocated_bytes());
    EXPECT_EQ(kv.allocated_bytes(), LayerKvStore::BytesFor(16, 2, 8, element));
    std::vector<float> key(16), value(16);
    for (int i = 0; i < 16; ++i) {
      key[i] = 1.0f + i / 3.0f;
      value[i] = -0.001f * i;
    }
    kv.StageToken(key.data(), value.data());
    kv.Commit(1);
    const KvView view = kv.view();
    EXPECT_EQ(view.element, element);
    EXPECT_EQ(view.tokens, 1);
    for (int h = 0; h < 2; ++h) {
      const auto* k = static_cast<const uint16_t*>(view.key_row(0, h));
      const auto* v = static_cast<const uint16_t*>(view.value_row(0, h));
      for (int j = 0; j < 8; ++j) {
        const float want_k = key[h * 8 + j], want_v = value[h * 8 + j];
        EXPECT_EQ(k[j], element == KvElement::kBf16 ? FloatToBf16(want_k) : FloatToF16(want_k));
        EXPECT_EQ(v[j], element == KvElement::kBf16 ? FloatToBf16(want_v) : FloatToF16(want_v));
      }
    }
    kv.Free();
    EXPECT_EQ(budget.used(), 0);
  }
}

TEST(KvStoreTest, MovingTransfersTheChargeOnce) {
  MemoryBudget budget(0);
  {
    BudgetedRows a(4, &budget);
    AppendRows(a, 10);
    const int64_t charged = budget.used();
    BudgetedRows b = std::move(a);
    EXPECT_EQ(budget.used(), charged);
    EXPECT_EQ(b.rows(), 10);
    ExpectRowsIntact(b);
    BudgetedRows c(4, &budget);
    AppendRows(c, 3);
    c = std::move(b);  // c's own rows are released
    EXPECT_EQ(budget.used(), charged);
    ExpectRowsIntact(c);
  }
  EXPECT_EQ(budget.used(), 0);
}

// The system's page: what a pinning pins whole.
uintptr_t Page() { return static_cast<uintptr_t>(sysconf(_SC_PAGESIZE)); }

// Records what a HostPinning is asked, and refuses pins while `refuse` is set. A pin may not
// share a page with a live one (cudaHostRegister refuses it); each Unpin must name a live
// pin, and the pinned bytes must still be readable then (the rows unpin an allocation before
// freeing it).
struct RecordingPinning final : HostPinning {
  absl::Status Pin(void* data, size_t bytes) override {
    events.push_back({true, data, bytes});
    if (refuse) return absl::ResourceExhaustedError("refused");
    const auto first_page = [](const void* p) { return reinterpret_cast<uintptr_t>(p) / Page(); };
    const auto last_page = [](const void* p, size_t n) {
      return (reinterpret_cast<uintptr_t>(p) + n - 1) / Page();
    };
    for (const auto& [start, size] : live) {
      if (first_page(data) <= last_page(start, size) &&
          first_page(start) <= last_page(data, bytes)) {
        ADD_FAILURE() << "a pin shares a page with a live one";
        return absl::AlreadyExistsError("already registered");
      }
    }
    live.push_back({data, bytes});
    return absl::OkStatus();
  }
  void Unpin(void* data) override {
    events.push_back({false, data, 0});
    auto it =
        std::find_if(live.begin(), live.end(), [&](const auto& p) { return p.first == data; });
    ASSERT_NE(it, live.end()) << "unpinning what is not pinned";
    volatile const char* bytes = static_cast<const char*>(data);
    for (size_t i = 0; i < it->second; i += Page()) (void)bytes[i];  // still mapped
    live.erase(it);
  }
  struct Event {
    bool pin;
    void* data;
    size_t bytes;
  };
  std::vector<Event> events;
  std::vector<std::pair<void*, size_t>> live;
  bool refuse = false;
};

TEST(KvStoreTest, PinningFollowsEveryAllocationAndUnpinsBeforeFreeing) {
  MemoryBudget budget(0);
  RecordingPinning pinning;
  BudgetedRows rows(3, &budget);
  EXPECT_FALSE(rows.SetPinning(&pinning)) << "an empty array has nothing to pin";
  EXPECT_TRUE(pinning.events.empty());
  AppendRows(rows, 10);
  ASSERT_TRUE(rows.pinned());
  ASSERT_EQ(pinning.live.size(), 1u);
  EXPECT_EQ(pinning.live[0].first, rows.raw_data());
  EXPECT_EQ(pinning.live[0].second, static_cast<size_t>(rows.capacity_bytes()));
  // Growth pins the new allocation and unpins the old one before it goes.
  const void* before = rows.raw_data();
  AppendRows(rows, 100);
  ExpectRowsIntact(rows);
  ASSERT_TRUE(rows.pinned());
  ASSERT_EQ(pinning.live.size(), 1u);
  EXPECT_EQ(pinning.live[0].first, rows.raw_data());
  EXPECT_NE(rows.raw_data(), before);
  // A refused pin leaves the array unpinned (and never unpinned); the next growth tries again.
  pinning.refuse = true;
  AppendRows(rows, 1000);
  EXPECT_FALSE(rows.pinned());
  EXPECT_TRUE(pinning.live.empty());
  pinning.refuse = false;
  EXPECT_TRUE(rows.SetPinning(&pinning)) << "setting it again pins the current allocation";
  // Moving carries the pin; freeing unpins.
  BudgetedRows moved = std::move(rows);
  EXPECT_TRUE(moved.pinned());
  EXPECT_FALSE(rows.pinned());
  moved.Free();
  EXPECT_TRUE(pinning.live.empty());
  EXPECT_FALSE(moved.pinned());
  // A layer's store pins keys and values alike; no pinning unpins both.
  LayerKvStore kv(2, 4, &budget, KvElement::kBf16);
  ASSERT_TRUE(kv.Reserve(8, "test").ok());
  EXPECT_TRUE(kv.SetPinning(&pinning));
  EXPECT_TRUE(kv.pinned());
  EXPECT_EQ(pinning.live.size(), 2u);
  EXPECT_FALSE(kv.SetPinning(nullptr));
  EXPECT_TRUE(pinning.live.empty());
  EXPECT_EQ(budget.used(), kv.allocated_bytes());
}

// A mapped array grows (HostMemory::Grow, or a new allocation where that fails), its rows kept
// and its budget charged for the new capacity. Within the address space it reserved
// (kHostRowsAddressReserve times its allocation) it stays where it is: a pinned one stays
// pinned, and only the pages it added are pinned, next to the rest (no page pinned twice).
// Past it, it moves: every range unpinned while still mapped where it was, newest first, then
// the array pinned again whole where it is now.
TEST(KvStoreTest, AMappedArrayGrowsInPlacePinningWhatItAddsThenMovesPinnedWhole) {
  MemoryBudget budget(0);
  RecordingPinning pinning;
  BudgetedRows rows(1024, &budget);  // 4 KiB rows: 512 of them fill 2 MiB
  AppendRows(rows, 600);
  ASSERT_TRUE(rows.SetPinning(&pinning));
  ASSERT_GE(rows.capacity_bytes(), int64_t{kHugePageBytes});
  int in_place = 0, moved = 0;
  for (int growth = 0; growth < 8 && moved < 2; ++growth) {
    SCOPED_TRACE(growth);
    const int64_t capacity = rows.capacity_rows();
    const int64_t in_place_rows = rows.rows_in_place();
    ASSERT_GE(in_place_rows, capacity);
    const void* before = rows.raw_data();
    const std::vector<std::pair<void*, size_t>> live_before = pinning.live;
    const size_t events = pinning.events.size();
    AppendRows(rows, capacity - rows.rows() + 1);  // one row past it: a growth
    ASSERT_GT(rows.capacity_rows(), capacity);
    ExpectRowsIntact(rows);
    EXPECT_EQ(budget.used(), rows.allocated_bytes());
    ASSERT_TRUE(rows.pinned());
    if (capacity + 1 <= in_place_rows) {
      ++in_place;
      // Grown to at most the end of its reservation, where it was; one pin of what it added,
      // from the first page past the old end.
      EXPECT_LE(rows.capacity_rows(), in_place_rows);
      EXPECT_EQ(rows.raw_data(), before);
      ASSERT_EQ(pinning.events.size(), events + 1);
      const RecordingPinning::Event& pin = pinning.events.back();
      EXPECT_TRUE(pin.pin);
      const auto old_end = reinterpret_cast<uintptr_t>(before) + capacity * rows.row_bytes();
      EXPECT_EQ(reinterpret_cast<uintptr_t>(pin.data), (old_end + Page() - 1) / Page() * Page());
      EXPECT_EQ(reinterpret_cast<uintptr_t>(pin.data) + pin.bytes,
                reinterpret_cast<uintptr_t>(rows.raw_data()) + rows.capacity_bytes());
      ASSERT_EQ(pinning.live.size(), live_before.size() + 1);
    } else {
      ++moved;
      // Every range unpinned where it was, newest first, then one pin of the whole.
      ASSERT_EQ(pinning.events.size(), events + live_before.size() + 1);
      for (size_t i = 0; i < live_before.size(); ++i) {
        const RecordingPinning::Event& unpin = pinning.events[events + i];
        EXPECT_FALSE(unpin.pin);
        EXPECT_EQ(unpin.data, live_before[live_before.size() - 1 - i].first);
      }
      const RecordingPinning::Event& pin = pinning.events.back();
      EXPECT_TRUE(pin.pin);
      EXPECT_EQ(pin.data, rows.raw_data());
      EXPECT_EQ(pin.bytes, static_cast<size_t>(rows.capacity_bytes()));
      ASSERT_EQ(pinning.live.size(), 1u);
    }
    // The live pins cover the allocation from its start, one after another.
    uintptr_t next = reinterpret_cast<uintptr_t>(rows.raw_data());
    for (const auto& [start, size] : pinning.live) {
      EXPECT_EQ(reinterpret_cast<uintptr_t>(start), next);
      next = (reinterpret_cast<uintptr_t>(start) + size + Page() - 1) / Page() * Page();
    }
    EXPECT_GE(next, reinterpret_cast<uintptr_t>(rows.raw_data()) + rows.capacity_bytes());
  }
  EXPECT_GE(in_place, 2) << "grown in place within its reservation";
  EXPECT_GE(moved, 1) << "moved past it";
  rows.Free();
  EXPECT_TRUE(pinning.live.empty());
  EXPECT_EQ(budget.used(), 0);
}

// An array told the most rows it will hold (its layer's length) is a mapping from its first
// row, which reserves address space for them (a length someone set whole; the most a layer can
// hold up to kHostRowsReserveMostBytes) and grows there without moving, far past four times its
// first allocation (where an array told nothing moves); its rows are kept and its budget
// charged for its capacity alone.
// Whether an array's share of the process's bound on reservations holds 1 GiB (a bound of 4 TiB
// or more: none under an address-space limit of less than 8 TiB), as the tests of what arrays
// reserve assume; they skip where it does not.
bool SharesHoldAGiB() {
  return static_cast<int64_t>(HostAddressSpaceBound()) / kHostRowsReserveShares >=
         kHostRowsReserveMostBytes;
}

TEST(KvStoreTest, AnArrayToldItsMostRowsGrowsToThemWithoutMoving) {
  if (!SharesHoldAGiB()) GTEST_SKIP() << "an address-space limit under 8 TiB";
  MemoryBudget budget(0);
  constexpr int64_t kMost = 20000;
  {
    BudgetedRows first_row(1024, &budget);  // 4 KiB rows
    first_row.set_most_rows(kMost, MostRows::kSet);
    AppendRows(first_row, 1);
    EXPECT_EQ(first_row.rows_in_place(), kMost) << "a mapping from its first row";
  }
  BudgetedRows rows(1024, &budget);
  rows.set_most_rows(kMost, MostRows::kSet);
  AppendRows(rows, 600);
  ASSERT_GE(rows.capacity_bytes(), int64_t{kHugePageBytes});
  EXPECT_EQ(rows.rows_in_place(), kMost) << "80 MB of address space, not 4x 2.4 MB";
  const void* const where = rows.raw_data();
  int growths = 0;
  while (rows.rows() < kMost) {
    const int64_t capacity = rows.capacity_rows();
    AppendRows(rows, std::min(capacity - rows.rows() + 1, kMost - rows.rows()));
    growths += rows.capacity_rows() > capacity;
    ASSERT_EQ(rows.raw_data(), where) << "moved at " << rows.rows() << " rows";
    EXPECT_EQ(budget.used(), rows.allocated_bytes());
  }
  EXPECT_GE(growths, 8) << "grew geometrically, from 600 rows";
  EXPECT_EQ(rows.capacity_rows(), kMost);
  ExpectRowsIntact(rows);
  // Past them it may still grow: it moves then, its rows kept.
  AppendRows(rows, 1);
  ExpectRowsIntact(rows);

  // Told nothing, it reserves four times its allocation. Told only the most a layer can hold,
  // it reserves up to kHostRowsReserveMostBytes; told a length someone set, all of it, past that.
  BudgetedRows plain(1024, &budget);
  AppendRows(plain, 600);
  EXPECT_EQ(plain.rows_in_place(),
            WholePages(plain.capacity_bytes() * kHostRowsAddressReserve) / 4096);
  BudgetedRows capped(1024, &budget);
  capped.set_most_rows(int64_t{1} << 31, MostRows::kCeiling);
  AppendRows(capped, 600);
  EXPECT_EQ(capped.rows_in_place(), kHostRowsReserveMostBytes / 4096);
  constexpr int64_t kSetPastTheCap = 3 * kHostRowsReserveMostBytes / 4096;  // 3 GiB
  if (HostAddressSpaceBound() / kHostRowsReserveShares >= 3 * kHostRowsReserveMostBytes) {
    BudgetedRows whole(1024, &budget);
    whole.set_most_rows(kSetPastTheCap, MostRows::kSet);
    AppendRows(whole, 600);
    EXPECT_EQ(whole.rows_in_place(), kSetPastTheCap);
  }  // (else a process bound under 12 TiB: the share test below covers it)
  // Where the process's reservations have no room for its most rows, 4x as before.
  SetHostAddressSpaceBoundForTesting(HostAddressSpaceHeld() + (kMost * 4096 - 1));
  absl::Cleanup unbound = [] { SetHostAddressSpaceBoundForTesting(0); };
  BudgetedRows bounded(1024, &budget);
  bounded.set_most_rows(kMost, MostRows::kSet);
  AppendRows(bounded, 600);
  EXPECT_EQ(bounded.rows_in_place(), plain.rows_in_place());
  // Where they have no room for 4x either, the allocation alone.
  SetHostAddressSpaceBoundForTesting(HostAddressSpaceHeld() + 2 * 600 * 4096);
  BudgetedRows alone(1024, &budget);
  alone.set_most_rows(kMost, MostRows::kSet);
  AppendRows(alone, 600);
  EXPECT_TRUE(alone.raw_data() != nullptr);
  EXPECT_EQ(alone.rows_in_place(), alone.capacity_rows());
  AppendRows(alone, 1);  // grows, moved (nothing reserved), its rows kept
  ExpectRowsIntact(alone);
}

// No array reserves more than its share of the process's bound (1/kHostRowsReserveShares),
// whatever length it is told; and where the bound has no room left for a length someone set,
// it reserves what still fits of 1 GiB, then 4x its allocation.
TEST(KvStoreTest, AnArraysReservationKeepsToItsShareAndTakesWhatStillFits) {
  MemoryBudget budget(0);
  constexpr int64_t kTwoGiB = 2 * kHostRowsReserveMostBytes / 4096;  // rows of 4 KiB
  SetHostAddressSpaceBoundForTesting(HostAddressSpaceHeld() + (size_t{64} << 30));
  absl::Cleanup unbound = [] { SetHostAddressSpaceBoundForTesting(0); };
  const int64_t share = static_cast<int64_t>(HostAddressSpaceBound()) / kHostRowsReserveShares;
  ASSERT_LT(share, kHostRowsReserveMostBytes) << "a 64 GiB bound: a share of ~16 MiB";
  for (const MostRows kind : {MostRows::kSet, MostRows::kCeiling}) {
    BudgetedRows told(1024, &budget);
    told.set_most_rows(kTwoGiB, kind);
    AppendRows(told, 600);
    EXPECT_EQ(told.rows_in_place(), WholePages(share) / 4096);
  }

  // A bound whose share would reserve 2 GiB whole (8 TiB / 4096), all but 1.5 GiB of it held by
  // another allocation's reservation: 1 GiB of the length fits.
  constexpr size_t kBound = size_t{8} << 40, kRoom = size_t{3} << 29;
  SetHostAddressSpaceBoundForTesting(kBound);
  const size_t hog_bytes = kBound - kRoom - HostAddressSpaceHeld();
  absl::StatusOr<HostMemory> hog = AllocateHostMemory(kHugePageBytes, true, hog_bytes);
  ASSERT_TRUE(hog.ok()) << hog.status();
  if (hog->reserved_bytes() != hog_bytes) {
    GTEST_SKIP() << "no 8 TiB of address space to reserve here (an address-space limit)";
  }
  BudgetedRows set(1024, &budget);
  set.set_most_rows(kTwoGiB, MostRows::kSet);
  AppendRows(set, 600);
  EXPECT_EQ(set.rows_in_place(), kHostRowsReserveMostBytes / 4096) << "1 GiB of the 2";
  // With under 1 GiB of room, four times its allocation.
  BudgetedRows four_times(1024, &budget);
  four_times.set_most_rows(kTwoGiB, MostRows::kSet);
  AppendRows(four_times, 600);
  EXPECT_EQ(four_times.rows_in_place(),
            WholePages(four_times.capacity_bytes() * kHostRowsAddressReserve) / 4096);
}

// A layer's prompt staging (cpu and tiered placements) tells its KV arrays the most tokens the
// layer will hold: its announced max_tokens, else the server's --max_context_tokens (both
// reserved whole), else the most a layer can hold (reserved up to kHostRowsReserveMostBytes).
TEST(KvStoreTest, APromptStagingsArraysReserveForTheLayersMostTokens) {
  if (!SharesHoldAGiB()) GTEST_SKIP() << "an address-space limit under 8 TiB";
  MemoryBudget budget(0);
  LayerConfig config;
  config.shape = LayerShape{4, 2, 512, 1.0f};  // 4 KiB f32 rows of keys
  config.max_layer_tokens = 30000;
  absl::StatusOr<std::unique_ptr<HostPromptStaging>> staging =
      HostPromptStaging::Create(config, &budget, KvElement::kF32, /*kept_queries=*/0);
  ASSERT_TRUE(staging.ok()) << staging.status();
  ASSERT_TRUE((*staging)->Reserve(600, "test prompt").ok());
  EXPECT_EQ((*staging)->kv.tokens_in_place(), 30000);
  for (const int64_t ceiling : {int64_t{600000}, LayerConfig().max_layer_tokens}) {
    // 2.4 GB of keys (where the process's bound gives an array that share); then none set.
    if (ceiling == 600000 &&
        HostAddressSpaceBound() / kHostRowsReserveShares < size_t{600000} * 4096) {
      continue;
    }
    config.max_layer_tokens = ceiling;
    staging->reset();  // its reservations given back first
    staging = HostPromptStaging::Create(config, &budget, KvElement::kF32, 0);
    ASSERT_TRUE(staging.ok()) << staging.status();
    ASSERT_TRUE((*staging)->Reserve(600, "test prompt").ok());
    EXPECT_EQ((*staging)->kv.tokens_in_place(),
              ceiling == 600000 ? ceiling : kHostRowsReserveMostBytes / 4096);
  }
  config.expected_tokens = 700;  // announced: its allocation, and 4x that reserved
  staging = HostPromptStaging::Create(config, &budget, KvElement::kF32, 0);
  ASSERT_TRUE(staging.ok()) << staging.status();
  EXPECT_EQ((*staging)->kv.capacity(), 700);
  EXPECT_EQ((*staging)->kv.tokens_in_place(), 2800);
}

// A growth ahead (BudgetedRows::StartGrowthAhead) runs on another thread while the owner
// appends within its capacity: its bytes charged at the start, its pages pinned by the run next
// to the rest, and at its end the capacity taken where the array is, every row kept. One never
// run gives its charge back; one whose pin is refused leaves the array unpinned whole (as a
// growth in the step does). It cannot start past where the array grows in place, on a heap
// array, or beyond the budget, and then charges nothing.
TEST(KvStoreTest, AGrowthAheadRunsElsewhereAndIsTakenOrGivenBack) {
  MemoryBudget budget(0);
  RecordingPinning pinning;
  BudgetedRows rows(1024, &budget);  // 4 KiB rows: mapped from 128 on (512 KiB, reserving 4x)
  AppendRows(rows, 600);
  ASSERT_TRUE(rows.SetPinning(&pinning));
  const int64_t capacity = rows.capacity_rows();
  const int64_t in_place = rows.rows_in_place();
  ASSERT_GT(in_place, capacity + 10);
  absl::StatusOr<GrowthAhead> held = rows.StartGrowthAhead(capacity, "ahead");
  ASSERT_TRUE(held.ok()) << held.status();  // rows it holds already: an empty growth
  held->Run();
  EXPECT_TRUE(rows.EndGrowthAhead(*std::move(held)).ok());
  EXPECT_EQ(rows.capacity_rows(), capacity);
  EXPECT_TRUE(HasStatus(rows.StartGrowthAhead(in_place + 1, "ahead").status(),
                        absl::StatusCode::kFailedPrecondition, "cannot be made ahead"));
  EXPECT_EQ(budget.used(), rows.allocated_bytes());

  // Run on another thread while this one appends up to the old capacity.
  const int64_t target = capacity + (in_place - capacity) / 2;
  absl::StatusOr<GrowthAhead> growth = rows.StartGrowthAhead(target, "ahead");
  ASSERT_TRUE(growth.ok()) << growth.status();
  EXPECT_EQ(budget.used(), HostFootprint(target * rows.row_bytes())) << "charged when it starts";
  const void* data = rows.raw_data();
  const size_t pins = pinning.live.size();
  std::thread runner([&] { growth->Run(); });
  AppendRows(rows, capacity - rows.rows());
  runner.join();
  EXPECT_TRUE(HasStatus(rows.Reserve(1, "past it"), absl::StatusCode::kFailedPrecondition,
                        "while a growth made ahead of need is in flight"));
  EXPECT_TRUE(growth->status().ok()) << growth->status();
  EXPECT_EQ(rows.capacity_rows(), capacity) << "not taken before it ends";
  ASSERT_TRUE(rows.EndGrowthAhead(*std::move(growth)).ok());
  EXPECT_EQ(rows.capacity_rows(), target);
  EXPECT_EQ(rows.raw_data(), data);
  EXPECT_EQ(budget.used(), rows.allocated_bytes());
  ASSERT_TRUE(rows.pinned());
  ASSERT_EQ(pinning.live.size(), pins + 1) << "its pin joined the rest";
  EXPECT_EQ(reinterpret_cast<uintptr_t>(pinning.live.back().first) + pinning.live.back().second,
            reinterpret_cast<uintptr_t>(rows.raw_data()) + rows.capacity_bytes());
  const size_t events = pinning.events.size();
  AppendRows(rows, target - rows.rows());  // the rows it added: no growth in the step
  EXPECT_EQ(rows.capacity_rows(), target);
  EXPECT_EQ(pinning.events.size(), events);
  ExpectRowsIntact(rows);

  // Never run: its charge given back, nothing taken.
  growth = rows.StartGrowthAhead(rows.rows_in_place(), "ahead");
  ASSERT_TRUE(growth.ok()) << growth.status();
  EXPECT_GT(budget.used(), rows.allocated_bytes());
  EXPECT_TRUE(rows.EndGrowthAhead(*std::move(growth)).ok());
  EXPECT_EQ(rows.capacity_rows(), target);
  EXPECT_EQ(budget.used(), rows.allocated_bytes());

  // Its pin refused: the capacity taken, the array no longer the device's to read, its
  // ranges kept registered (a reader may be using them) until the array is freed.
  growth = rows.StartGrowthAhead(rows.rows_in_place(), "ahead");
  ASSERT_TRUE(growth.ok()) << growth.status();
  pinning.refuse = true;
  growth->Run();
  pinning.refuse = false;
  const size_t live = pinning.live.size();
  EXPECT_TRUE(rows.EndGrowthAhead(*std::move(growth)).ok());
  EXPECT_EQ(rows.capacity_rows(), rows.rows_in_place());
  EXPECT_FALSE(rows.pinned());
  EXPECT_EQ(pinning.live.size(), live) << "nothing unpinned while the rows stay";
  EXPECT_EQ(budget.used(), rows.allocated_bytes());
  ExpectRowsIntact(rows);

  // Refused by the budget, or on a heap array: nothing charged.
  rows.Free();
  MemoryBudget tight(4 << 20);
  BudgetedRows small(1024, &tight);
  AppendRows(small, 600);
  EXPECT_TRUE(HasStatus(small.StartGrowthAhead(small.rows_in_place(), "the growth").status(),
                        absl::StatusCode::kResourceExhausted, "the growth"));
  EXPECT_EQ(tight.used(), small.allocated_bytes());
  BudgetedRows heap(4, &budget);
  AppendRows(heap, 10);
  EXPECT_TRUE(HasStatus(heap.StartGrowthAhead(heap.capacity_rows() + 1, "ahead").status(),
                        absl::StatusCode::kFailedPrecondition, "cannot be made ahead"));
  EXPECT_EQ(budget.used(), heap.allocated_bytes());
}

// Appends one token to `kv` as a tiered layer steps (KvGrowthAhead around the reservation);
// returns whether the reservation itself grew the store.
bool StepToken(LayerKvStore& kv, KvGrowthAhead& ahead, int64_t limit) {
  ahead.BeforeReserve(kv, 1);
  const int64_t capacity = kv.capacity();
  EXPECT_TRUE(kv.Reserve(1, "the token").ok());
  const bool grew = kv.capacity() != capacity;
  std::memset(kv.key_tail(), 1, kv.view().kv_heads * kv.view().head_dim * 2);
  kv.Commit(1);
  ahead.AfterCommit(kv, limit);
  return grew;
}

// A layer's store stepped token by token grows ahead of its steps (here in AfterCommit's call,
// as without a queue thread, so that nothing races the loop): no reservation
// grows it where it could have grown in place (a heap array's, or one past its reserved address
// space, still grows in the step, moving), and every growth within the reservation came ahead.
// A limit (an announced max_tokens) is never grown past ahead.
TEST(KvGrowthAheadTest, AStoreGrowsAheadOfItsStepsUntilItMustMove) {
  MemoryBudget budget(0);
  LayerKvStore kv(8, 128, &budget, KvElement::kBf16);  // 2 KiB a token: mapped from 256 on
  KvGrowthAhead ahead(nullptr);  // each growth made in AfterCommit's call: no race with the loop
  int in_step = 0, in_step_in_place = 0;
  for (int t = 0; t < 12000; ++t) {
    const bool could_stay = kv.tokens() + 1 <= kv.tokens_in_place();
    const void* keys = kv.view().keys;
    if (StepToken(kv, ahead, kMaxLayerTokens)) {
      ++in_step;
      if (could_stay || kv.view().keys == keys) ++in_step_in_place;
    }
  }
  ahead.Finish(kv);
  EXPECT_GE(ahead.grown(), 3) << "grown ahead";
  EXPECT_GE(in_step, 2) << "the heap array's growths, and the moves";
  EXPECT_EQ(in_step_in_place, 0) << "a step grew what could have grown ahead";
  EXPECT_EQ(budget.used(), kv.allocated_bytes());
  // With a limit: ahead to it, never past it.
  LayerKvStore limited(8, 128, &budget, KvElement::kBf16);
  ASSERT_TRUE(limited.Reserve(3000, "prompt").ok());
  limited.Commit(3000);
  KvGrowthAhead limited_ahead(nullptr);
  limited_ahead.AfterCommit(limited, 4000);  // the prompt filled it: a growth starts at once
  for (int t = 0; t < 1000; ++t) StepToken(limited, limited_ahead, 4000);
  limited_ahead.Finish(limited);
  EXPECT_EQ(limited.capacity(), 4000);
  EXPECT_EQ(limited_ahead.grown(), 1);
}

// Something on a queue that holds its thread until released.
struct Blocker final : WorkItem {
  void Run() override { release.WaitForNotification(); }
  absl::Notification release;
};

// Finish drops a growth still queued: the store as it was, its charge given back; with no
// queue thread the growth runs in AfterCommit's call; with growths ahead turned off none starts.
TEST(KvGrowthAheadTest, AGrowthStillQueuedIsDroppedAndNoQueueGrowsInTheCall) {
  MemoryBudget budget(0);
  Blocker blocker;  // outlives the queue, which runs it
  WorkQueue queue(1, "test-grow");
  queue.Push(&blocker);
  LayerKvStore kv(8, 128, &budget, KvElement::kBf16);
  ASSERT_TRUE(kv.Reserve(1200, "prompt").ok());
  kv.Commit(1200);
  ASSERT_GT(kv.tokens_in_place(), kv.capacity());
  KvGrowthAhead ahead(&queue);
  ahead.AfterCommit(kv, kMaxLayerTokens);
  EXPECT_TRUE(ahead.in_flight()) << "its store is full: a growth starts";
  EXPECT_GT(budget.used(), kv.allocated_bytes()) << "charged";
  ahead.Finish(kv);
  EXPECT_FALSE(ahead.in_flight());
  EXPECT_EQ(kv.capacity(), 1200);
  EXPECT_EQ(budget.used(), kv.allocated_bytes());
  // A token that needs the rows while the growth is still queued: dropped, and the reservation
  // grows the store itself, in place.
  ahead.AfterCommit(kv, kMaxLayerTokens);
  ASSERT_TRUE(ahead.in_flight());
  const void* keys = kv.view().keys;
  ahead.BeforeReserve(kv, 1);
  EXPECT_FALSE(ahead.in_flight());
  EXPECT_EQ(budget.used(), kv.allocated_bytes());
  ASSERT_TRUE(kv.Reserve(1, "the token").ok());
  EXPECT_EQ(kv.capacity(), 1800);
  EXPECT_EQ(kv.view().keys, keys);
  EXPECT_EQ(ahead.grown(), 0);
  blocker.release.Notify();

  KvGrowthAhead inline_ahead(nullptr);
  kv.Commit(1);
  ASSERT_TRUE(kv.Reserve(1799 - kv.tokens(), "prompt").ok());
  kv.Commit(1799 - kv.tokens());
  {
    SetHostKvGrowthAhead(false);  // kvrecalld --host_kv_growth_ahead=false: none starts
    const absl::Cleanup on_again = [] { SetHostKvGrowthAhead(true); };
    inline_ahead.AfterCommit(kv, kMaxLayerTokens);
    EXPECT_FALSE(inline_ahead.in_flight());
  }
  inline_ahead.AfterCommit(kv, kMaxLayerTokens);
  inline_ahead.BeforeReserve(kv, 0);  // taken at once: it ran in the call
  EXPECT_FALSE(inline_ahead.in_flight());
  EXPECT_EQ(kv.capacity(), 2700);
  EXPECT_EQ(inline_ahead.grown(), 1);
  EXPECT_EQ(budget.used(), kv.allocated_bytes());
}

bool HugePageAligned(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % kHugePageBytes == 0;
}

TEST(KvStoreTest, ContentSurvivesGrowthInHugePagesAndInSmallOnes) {
  for (const bool huge_pages : {true, false}) {
    SCOPED_TRACE(huge_pages ? "huge pages" : "4 KiB pages");
    cpu::SetHostHugePages(huge_pages);
    MemoryBudget budget(0);
    BudgetedRows rows(1024, &budget);  // 4 KiB rows: 16 rows, 24, ... past 2 MiB at 512
    int large = 0;
    for (int step = 0; step < 40; ++step) {
      const int64_t capacity = rows.capacity_rows();
      AppendRows(rows, 50);
      // (A mapped array may grow where it is: a growth is a new capacity, not a new address.)
      if (rows.capacity_rows() != capacity && rows.capacity_bytes() >= int64_t{kHugePageBytes}) {
        ++large;
        EXPECT_TRUE(HugePageAligned(rows.raw_data())) << rows.capacity_bytes();
      }
      EXPECT_EQ(budget.used(), rows.allocated_bytes());
    }
    EXPECT_GE(large, 2) << "grown more than once in mappings of their own";
    EXPECT_EQ(rows.rows(), 2000);
    ExpectRowsIntact(rows);
    absl::StatusOr<int64_t> huge = AnonHugePageBytes(rows.raw_data(), rows.capacity_bytes());
    ASSERT_TRUE(huge.ok()) << huge.status();
    if (!huge_pages) EXPECT_EQ(*huge, 0);
    rows.Free();
    EXPECT_EQ(budget.used(), 0);
  }
  cpu::SetHostHugePages(true);
}

TEST(KvStoreTest, LayerKvIsInHugePagesWhereTheHostAllowsThem) {
  const std::string mode = TransparentHugePagesMode();
  if (mode != "madvise" && mode != "always") {
    GTEST_SKIP() << "transparent huge pages are '" << mode
                 << "' on this host (/sys/kernel/mm/transparent_hugepage/enabled)";
  }
  // 1024 tokens of 8 KV heads x d = 128 in bf16: 2 MiB of keys and 2 MiB of values.
  MemoryBudget budget(0);
  LayerKvStore kv(8, 128, &budget, KvElement::kBf16);
  ASSERT_TRUE(kv.Reserve(1024, "the prompt").ok());
  const KvView view = kv.view();
  ASSERT_TRUE(HugePageAligned(view.keys) && HugePageAligned(view.values));
  for (const void* array : {view.keys, view.values}) {
    absl::StatusOr<int64_t> huge = AnonHugePageBytes(array, kHugePageBytes);
    ASSERT_TRUE(huge.ok()) << huge.status();
    EXPECT_GE(*huge, int64_t{kHugePageBytes});
  }
}

TEST(KvStoreTest, MemoryThatCannotBeHadIsAnErrorAndChangesNothing) {
  MemoryBudget budget(0);
  LayerKvStore kv(1, 1 << 16, &budget);  // 256 KiB keys and values per token
  ASSERT_TRUE(kv.Reserve(2, "the prompt").ok());
  std::memset(kv.key_tail(), 1, 2 << 18);
  std::memset(kv.value_tail(), 2, 2 << 18);
  kv.Commit(2);
  const int64_t allocated = kv.allocated_bytes();
  // 2^43 tokens: 2^61 bytes each, beyond any address space (and the budget is unlimited).
  EXPECT_TRUE(HasStatus(kv.Reserve(int64_t{1} << 43, "the announced max_tokens"),
                        absl::StatusCode::kResourceExhausted,
                        "the announced max_tokens: cannot allocate"));
  EXPECT_EQ(kv.tokens(), 2);
  EXPECT_EQ(kv.allocated_bytes(), allocated);
  EXPECT_EQ(budget.used(), allocated) << "the charge of what was not allocated is given back";
  const KvView view = kv.view();
  EXPECT_EQ(static_cast<const char*>(view.keys)[(2 << 18) - 1], 1);
  EXPECT_EQ(static_cast<const char*>(view.values)[(2 << 18) - 1], 2);
  ASSERT_TRUE(kv.Reserve(20, "the new tokens").ok()) << "it still grows";
  EXPECT_GT(kv.allocated_bytes(), allocated);
  kv.Free();
  EXPECT_EQ(budget.used(), 0);
}

// Stages the prompt's next n query rows, [first_row, first_row + n), whose values encode
// (prompt row, column), as a chunk: Reserve, write at the tail, Commit.
void AppendQueryChunk(PromptQueryWindow& window, int64_t first_row, int64_t n) {
  ASSERT_TRUE(window.Reserve(n, "test queries").ok());
  float* tail = window.tail();
  ASSERT_NE(tail, nullptr);
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t c = 0; c < window.row_width(); ++c) {
      tail[r * window.row_width() + c] = static_cast<float>((first_row + r) * 1000 + c);
    }
  }
  window.Commit(n);
}

// Expects the window to hold exactly the prompt's rows [first, end) as AppendQueryChunk wrote
// them, read through the PromptQueries a selector's build gets.
void ExpectQueryRows(const PromptQueryWindow& window, int64_t first, int64_t end) {
  ASSERT_EQ(window.first(), first);
  ASSERT_EQ(window.rows(), end - first);
  const PromptQueries queries = window.prompt_queries();
  ASSERT_NE(queries.data, nullptr);
  ASSERT_EQ(queries.first, first);
  const int64_t width = window.row_width();
  for (int64_t p = first; p < end; ++p) {
    for (int64_t c = 0; c < width; ++c) {
      ASSERT_EQ(queries.row(p, width)[c], static_cast<float>(p * 1000 + c)) << p << ", " << c;
    }
  }
}

TEST(KvStoreTest, PromptQueryWindowKeepsThePromptsLastRows) {
  MemoryBudget budget(0);
  PromptQueryWindow window(/*row_width=*/4, /*kept=*/3, &budget);
  EXPECT_EQ(window.prompt_queries().data, nullptr) << "nothing allocated before the prompt";
  AppendQueryChunk(window, 0, 2);
  ExpectQueryRows(window, 0, 2);
  AppendQueryChunk(window, 2, 2);
  ExpectQueryRows(window, 1, 4);
  AppendQueryChunk(window, 4, 1);
  ExpectQueryRows(window, 2, 5);
  // A chunk longer than the window: written whole, only its last rows kept.
  AppendQueryChunk(window, 5, 7);
  ExpectQueryRows(window, 9, 12);
  EXPECT_EQ(budget.used(), window.allocated_bytes());
  // Room for the window and the whole chunk: 10 rows.
  EXPECT_GE(window.allocated_bytes(), 10 * 4 * int64_t{sizeof(float)});
}

TEST(KvStoreTest, PromptQueryWindowZeroFillsAChunkWithoutQueries) {
  MemoryBudget budget(0);
  PromptQueryWindow window(/*row_width=*/2, /*kept=*/3, &budget);
  AppendQueryChunk(window, 0, 2);
  ASSERT_TRUE(window.Reserve(2, "test queries").ok());
  std::fill_n(window.tail(), 2 * 2, -1.0f);  // whatever the tail held before
  window.Commit(2, /*written=*/false);
  // Prompt rows 1..3: row 1 as written, rows 2 and 3 zeros.
  ASSERT_EQ(window.first(), 1);
  ASSERT_EQ(window.rows(), 3);
  const PromptQueries queries = window.prompt_queries();
  ASSERT_EQ(queries.first, 1);
  EXPECT_EQ(queries.row(1, 2)[0], 1000.0f);
  EXPECT_EQ(queries.row(1, 2)[1], 1001.0f);
  for (int64_t p = 2; p < 4; ++p) {
    EXPECT_EQ(queries.row(p, 2)[0], 0.0f) << p;
    EXPECT_EQ(queries.row(p, 2)[1], 0.0f) << p;
  }
  AppendQueryChunk(window, 4, 1);
  ASSERT_EQ(window.first(), 2);
  EXPECT_EQ(window.prompt_queries().row(3, 2)[1], 0.0f);
  EXPECT_EQ(window.prompt_queries().row(4, 2)[1], 4001.0f);
}

TEST(KvStoreTest, PromptQueryWindowOfNoneStoresNothing) {
  MemoryBudget budget(0);
  PromptQueryWindow window(/*row_width=*/4, /*kept=*/0, &budget);
  ASSERT_TRUE(window.Reserve(16, "test queries").ok());
  EXPECT_EQ(budget.used(), 0);
  EXPECT_EQ(window.allocated_bytes(), 0);
  EXPECT_EQ(window.tail(), nullptr);
  window.Commit(16);
  ASSERT_TRUE(window.Reserve(8, "test queries").ok());
  window.Commit(8, /*written=*/false);
  EXPECT_EQ(window.rows(), 0);
  EXPECT_EQ(window.first(), 0);
  EXPECT_EQ(window.prompt_queries().data, nullptr);
  EXPECT_EQ(window.prompt_queries().first, 0);
  EXPECT_EQ(budget.used(), 0);
}

TEST(KvStoreTest, BudgetChargesBeyondTheLimitOnlyWhenForced) {
  MemoryBudget budget(100);
  EXPECT_TRUE(budget.Reserve(60, "a").ok());
  EXPECT_TRUE(HasStatus(budget.Reserve(41, "b"), absl::StatusCode::kResourceExhausted,
                        "b needs 41 more bytes, 60 of the 100-byte budget"));
  budget.Charge(50);  // state that exists already, e.g. a built index
  EXPECT_EQ(budget.used(), 110);
  EXPECT_FALSE(budget.Reserve(1, "c").ok());
  budget.Release(110);
  EXPECT_TRUE(budget.Reserve(100, "d").ok());
}

// A tenant's budget within the server's: a Reserve must fit both, is refused by whichever is
// exceeded (and then charges neither), and charges and releases reach the server's.
TEST(KvStoreTest, ATenantsBudgetIsChargedWithinTheServers) {
  MemoryBudget server(100);
  TenantBudgets alice("alice", 60, 0, &server);
  TenantBudgets bob("bob", 0, 0, &server);  // bounded by the server's alone
  ASSERT_TRUE(alice.host()->Reserve(50, "a").ok());
  EXPECT_TRUE(HasStatus(alice.host()->Reserve(11, "b"), absl::StatusCode::kResourceExhausted,
                        "host memory (tenant 'alice') budget exceeded: b needs 11 more bytes, 50 "
                        "of the 60-byte budget (host_memory_budget_per_tenant_gb=5.58794e-08)"));
  EXPECT_EQ(RefusedLimit(alice.host()->Reserve(11, "b")), "host_memory_budget_per_tenant");
  EXPECT_EQ(alice.host()->used(), 50);
  EXPECT_EQ(server.used(), 50);
  ASSERT_TRUE(bob.host()->Reserve(45, "c").ok());
  // Alice's 10 bytes left do not fit the server's: refused there, charged nowhere.
  const absl::Status full = alice.host()->Reserve(10, "d");
  EXPECT_TRUE(HasStatus(full, absl::StatusCode::kResourceExhausted,
                        "host memory budget exceeded: d needs 10 more bytes, 95 of the 100-byte"));
  EXPECT_EQ(RefusedLimit(full), "host_memory_budget");
  EXPECT_EQ(alice.host()->used(), 50);
  EXPECT_EQ(server.used(), 95);
  alice.host()->Charge(30);  // built state, past both limits
  EXPECT_EQ(server.used(), 125);
  EXPECT_EQ(alice.host()->server_wide().used(), 125);
  alice.host()->Release(80);
  bob.host()->Release(45);
  EXPECT_EQ(alice.host()->used(), 0);
  EXPECT_EQ(server.used(), 0);

  // A GPU's budget per tenant is made on first use, one per device, named after it.
  MemoryBudget gpu0(0, "GPU 0 memory", "gpu_memory_budget_gb");
  MemoryBudget gpu1(0, "GPU 1 memory", "gpu_memory_budget_gb");
  TenantBudgets carol("carol", 0, 8, &server);
  MemoryBudget* on0 = carol.Within(&gpu0);
  EXPECT_EQ(carol.Within(&gpu0), on0);
  EXPECT_NE(carol.Within(&gpu1), on0);
  EXPECT_EQ(on0->parent(), &gpu0);
  ASSERT_TRUE(on0->Reserve(8, "e").ok());
  EXPECT_TRUE(HasStatus(on0->Reserve(1, "f"), absl::StatusCode::kResourceExhausted,
                        "GPU 0 memory (tenant 'carol') budget exceeded"));
  EXPECT_TRUE(carol.Within(&gpu1)->Reserve(8, "g").ok());
  EXPECT_EQ(gpu0.used(), 8);
  EXPECT_EQ(gpu1.used(), 8);
  EXPECT_TRUE(carol.host()->Reserve(1000, "h").code() == absl::StatusCode::kResourceExhausted);
}

}  // namespace
}  // namespace kvrecall
