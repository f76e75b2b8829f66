// Host allocations in huge pages (server/host_memory.h): large ones are 2 MiB-aligned mappings
// of their own, in huge pages where the host's THP mode allows it and in 4 KiB pages when
// asked; small ones are ordinary; the process-wide switch picks the default; an allocation that
// cannot be had is RESOURCE_EXHAUSTED. The memory a process may use: the machine's, or its
// control group's limit.
#include "server/host_memory.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "gtest/gtest.h"
#include "tests/server_fixture.h"
#include "tests/test_util.h"

namespace kvrecall {
namespace {

using ::kvrecall::testing::HasStatus;

bool Aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % kHugePageBytes == 0; }

// Writes a pattern over every byte and reads it back.
void ExpectWritable(const HostMemory& memory) {
  for (size_t i = 0; i < memory.size(); ++i) memory.data()[i] = static_cast<std::byte>(i * 7);
  for (size_t i = 0; i < memory.size(); ++i) {
    ASSERT_EQ(memory.data()[i], static_cast<std::byte>(i * 7)) << "byte " << i;
  }
}

// Whether the host backs MADV_HUGEPAGE mappings with huge pages.
bool HugePagesAvailable() {
  const std::string mode = TransparentHugePagesMode();
  return mode == "madvise" || mode == "always";
}

TEST(HostMemoryTest, LargeAllocationsAreAlignedMappingsOfTheirOwn) {
  const size_t bytes = 3 * kHugePageBytes + 100;
  absl::StatusOr<HostMemory> memory = AllocateHostMemory(bytes, /*huge_pages=*/true);
  ASSERT_TRUE(memory.ok()) << memory.status();
  EXPECT_TRUE(Aligned(memory->data()));
  EXPECT_EQ(memory->size(), bytes);
  EXPECT_TRUE(memory->mapped());
  EXPECT_TRUE(memory->huge_pages_requested());
  // Any kernel built with THP accepts the advice, whatever its mode (even "never").
  EXPECT_EQ(memory->huge_pages_advised(), TransparentHugePagesMode() != "unavailable");
  ExpectWritable(*memory);

  absl::StatusOr<HostMemory> small_pages = AllocateHostMemory(kHugePageBytes, false);
  ASSERT_TRUE(small_pages.ok()) << small_pages.status();
  EXPECT_TRUE(Aligned(small_pages->data()));
  EXPECT_TRUE(small_pages->mapped());
  EXPECT_FALSE(small_pages->huge_pages_requested());
  EXPECT_FALSE(small_pages->huge_pages_advised());
  ExpectWritable(*small_pages);
}

// Smaller allocations come from the heap, in whole pages of their own (a pinning of one never
// meets another's page): two made one after the other share none.
TEST(HostMemoryTest, SmallAllocationsAreHeapPagesOfTheirOwn) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  for (const size_t bytes : {size_t{0}, size_t{1}, size_t{4096}, kHugePageBytes - 1}) {
    absl::StatusOr<HostMemory> memory = AllocateHostMemory(bytes, /*huge_pages=*/true);
    absl::StatusOr<HostMemory> next = AllocateHostMemory(bytes, /*huge_pages=*/true);
    ASSERT_TRUE(memory.ok()) << bytes << ": " << memory.status();
    ASSERT_TRUE(next.ok()) << bytes << ": " << next.status();
    EXPECT_NE(memory->data(), nullptr) << bytes;
    EXPECT_EQ(reinterpret_cast<uintptr_t>(memory->data()) % page, 0u) << bytes;
    const auto first = reinterpret_cast<uintptr_t>(memory->data()) / page;
    const auto last = (reinterpret_cast<uintptr_t>(memory->data()) + std::max<size_t>(bytes, 1) +
                       page - 1) / page;
    const auto other = reinterpret_cast<uintptr_t>(next->data()) / page;
    EXPECT_TRUE(other < first || other >= last) << bytes << ": a page shared";
    EXPECT_EQ(memory->size(), bytes);
    EXPECT_FALSE(memory->mapped()) << bytes;
    EXPECT_FALSE(memory->huge_pages_requested()) << bytes;
    ExpectWritable(*memory);
  }
}

// The share of the pages of [data, data + bytes) (page-aligned) that are resident.
double ResidentShare(const std::byte* data, size_t bytes) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> resident((bytes + page - 1) / page);
  if (mincore(const_cast<std::byte*>(data), bytes, resident.data()) != 0) return -1;
  size_t n = 0;
  for (unsigned char r : resident) n += r & 1;
  return static_cast<double>(n) / resident.size();
}

// The pages of [p, p + bytes) (page-aligned) that are mapped, inaccessible ones too (mincore
// answers ENOMEM for an address nothing maps).
size_t MappedPages(const std::byte* p, size_t bytes) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> resident(1);
  size_t mapped = 0;
  for (size_t at = 0; at < bytes; at += page) {
    mapped += mincore(const_cast<std::byte*>(p + at), page, resident.data()) == 0;
  }
  return mapped;
}

// Whether [p, p + bytes) (page-aligned) is mapped by nothing.
bool Unmapped(const std::byte* p, size_t bytes) { return MappedPages(p, bytes) == 0; }

// A mapped allocation grows without a copy: where the addresses after it are free it stays
// where it is (unless kHostMemoryGrowsWhereItIs says it always moves), else (a mapping right
// after it) it moves to a 2 MiB-aligned range; either way its content is kept and the new
// bytes are mapped now (where the kernel maps a fresh allocation's now) and writable. A heap
// allocation, or a smaller size, is FAILED_PRECONDITION and changes nothing.
TEST(HostMemoryTest, AMappedAllocationGrowsKeepingItsContent) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  for (const bool huge_pages : {true, false}) {
    SCOPED_TRACE(huge_pages ? "huge pages" : "4 KiB pages");
    absl::StatusOr<HostMemory> fresh = AllocateHostMemory(kHugePageBytes, huge_pages);
    ASSERT_TRUE(fresh.ok());
    const bool populates = ResidentShare(fresh->data(), kHugePageBytes) == 1.0;  // Linux 5.14+
    absl::StatusOr<HostMemory> memory = AllocateHostMemory(kHugePageBytes + 12345, huge_pages);
    ASSERT_TRUE(memory.ok()) << memory.status();
    const size_t old_size = memory->size();
    for (size_t i = 0; i < old_size; ++i) memory->data()[i] = static_cast<std::byte>(i * 13);
    int stayed = 0, moved = 0;
    for (const bool blocked : {false, true, false, true}) {
      const size_t from = (memory->size() + page - 1) / page * page;
      const size_t bytes = from + (blocked ? 3 * kHugePageBytes : 16 * page) + 7;
      std::byte* const end = memory->data() + from;
      // A one-page mapping right after it where asked (and where the addresses are free).
      void* blocker = nullptr;
      if (blocked && Unmapped(end, page)) {
        blocker = mmap(end, page, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE,
                       -1, 0);
        ASSERT_EQ(blocker, static_cast<void*>(end));
      }
      const bool free_after = Unmapped(end, (bytes - from + page - 1) / page * page);
      const std::byte* before = memory->data();
      ASSERT_TRUE(memory->Grow(bytes).ok()) << bytes;
      if (blocker != nullptr) munmap(blocker, page);
      if (memory->data() == before) {
        ++stayed;
        EXPECT_TRUE(free_after) << "grown over a mapping";
      } else {
        ++moved;
        if (kHostMemoryGrowsWhereItIs) EXPECT_FALSE(free_after) << "moved though it could stay";
      }
      EXPECT_EQ(memory->size(), bytes);
      EXPECT_TRUE(memory->mapped());
      EXPECT_EQ(reinterpret_cast<uintptr_t>(memory->data()) % kHugePageBytes, 0u) << bytes;
      for (size_t i = 0; i < old_size; ++i) {
        ASSERT_EQ(memory->data()[i], static_cast<std::byte>(i * 13)) << bytes << " byte " << i;
      }
      if (populates) {
        EXPECT_EQ(ResidentShare(memory->data() + from, bytes - from), 1.0) << bytes;
      }
      std::memset(memory->data() + from, 0x5a, bytes - from);  // the new bytes
    }
    EXPECT_GE(moved, 2) << "a mapping right after it moves it";
    EXPECT_EQ(stayed + moved, 4);
    const size_t size = memory->size();
    EXPECT_EQ(memory->Grow(100).code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(memory->size(), size);
    absl::StatusOr<HostMemory> small = AllocateHostMemory(4096, huge_pages);
    ASSERT_TRUE(small.ok());
    const std::byte* small_data = small->data();
    EXPECT_EQ(small->Grow(2 * kHugePageBytes).code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(small->data(), small_data);
    EXPECT_EQ(small->size(), 4096u);
  }
}

// An allocation made with address space reserved after it grows within that space where it
// is: no memory there until then (only its first pages resident), then the pages added mapped
// and writable, the content and the address kept, up to the last reserved byte. Past it, it
// moves to a new range with the reservation asked for, content kept, and the old range is
// given back whole (its reserved tail too); grown within that one, it moves again.
TEST(HostMemoryTest, AReservedAllocationGrowsWhereItIsUntilItsReservationEnds) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  for (const bool huge_pages : {true, false}) {
    SCOPED_TRACE(huge_pages ? "huge pages" : "4 KiB pages");
    const size_t reserve = 4 * kHugePageBytes + 3 * page;
    const size_t held = HostAddressSpaceHeld();
    absl::StatusOr<HostMemory> memory =
        AllocateHostMemory(kHugePageBytes + 12345, huge_pages, reserve - 100);
    ASSERT_TRUE(memory.ok()) << memory.status();
    ASSERT_TRUE(memory->mapped());
    EXPECT_EQ(memory->reserved_bytes(), reserve) << "whole pages";
    EXPECT_EQ(HostAddressSpaceHeld(), held + reserve) << "the reservation counted";
    EXPECT_TRUE(memory->GrowsInPlaceTo(reserve));
    EXPECT_FALSE(memory->GrowsInPlaceTo(reserve + 1));
    std::byte* const data = memory->data();
    const size_t first = (memory->size() + page - 1) / page * page;
    EXPECT_EQ(ResidentShare(data + first, reserve - first), 0.0) << "reserved, not mapped";
    EXPECT_FALSE(Unmapped(data + first, reserve - first)) << "the range is held";
    const bool populates = ResidentShare(data, first) == 1.0;  // Linux 5.14+
    const size_t old_size = memory->size();
    for (size_t i = 0; i < old_size; ++i) data[i] = static_cast<std::byte>(i * 13);
    for (const size_t bytes : {2 * kHugePageBytes + 77, 3 * kHugePageBytes, reserve}) {
      SCOPED_TRACE(bytes);
      const size_t from = (memory->size() + page - 1) / page * page;
      ASSERT_TRUE(memory->Grow(bytes).ok());
      EXPECT_EQ(memory->data(), data) << "grown where it is";
      EXPECT_EQ(memory->size(), bytes);
      EXPECT_EQ(memory->reserved_bytes(), reserve);
      for (size_t i = 0; i < old_size; ++i) {
        ASSERT_EQ(data[i], static_cast<std::byte>(i * 13)) << "byte " << i;
      }
      if (populates) EXPECT_EQ(ResidentShare(data + from, bytes - from), 1.0);
      std::memset(data + from, 0x5a, bytes - from);  // the new bytes, writable
      if (bytes < reserve) {
        const size_t end = (bytes + page - 1) / page * page;
        EXPECT_EQ(ResidentShare(data + end, reserve - end), 0.0) << "the rest still reserved";
      }
    }
    // Past the reservation: moved to a new one of the size asked for.
    const size_t moved_reserve = 8 * kHugePageBytes;
    ASSERT_TRUE(memory->Grow(reserve + 1, moved_reserve).ok());
    EXPECT_NE(memory->data(), data);
    EXPECT_TRUE(Aligned(memory->data()));
    EXPECT_EQ(memory->reserved_bytes(), moved_reserve);
    EXPECT_EQ(HostAddressSpaceHeld(), held + moved_reserve);
    EXPECT_TRUE(memory->GrowsInPlaceTo(moved_reserve));
    for (size_t i = 0; i < old_size; ++i) {
      ASSERT_EQ(memory->data()[i], static_cast<std::byte>(i * 13)) << "byte " << i;
    }
    EXPECT_EQ(memory->data()[reserve - 1], std::byte{0x5a});
    EXPECT_TRUE(Unmapped(data, reserve)) << "the old range, its reservation too, given back";
    // Grown in place within the new reservation, then moved again past it (one mapping to
    // move: the reserved tail merged into the moved pages as it became accessible).
    std::byte* const moved = memory->data();
    ASSERT_TRUE(memory->Grow(moved_reserve - page).ok());
    EXPECT_EQ(memory->data(), moved);
    std::memset(moved + reserve + 1, 0x6b, moved_reserve - page - reserve - 1);
    ASSERT_TRUE(memory->Grow(moved_reserve + 1, 2 * moved_reserve).ok()) << "moved again";
    EXPECT_NE(memory->data(), moved);
    EXPECT_EQ(memory->reserved_bytes(), 2 * moved_reserve);
    EXPECT_EQ(HostAddressSpaceHeld(), held + 2 * moved_reserve);
    for (size_t i = 0; i < old_size; ++i) {
      ASSERT_EQ(memory->data()[i], static_cast<std::byte>(i * 13)) << "byte " << i;
    }
    EXPECT_EQ(memory->data()[moved_reserve - page - 1], std::byte{0x6b});
    EXPECT_TRUE(Unmapped(moved, moved_reserve)) << "the second range given back";
    std::byte* const last = memory->data();
    memory->reset();
    EXPECT_TRUE(Unmapped(last, 2 * moved_reserve)) << "reset gives the reservation back";
    EXPECT_EQ(HostAddressSpaceHeld(), held);
  }
}

// The address space reservations may take is bounded (HostAddressSpaceAllows: what the mapped
// allocations hold, and what is asked, within the bound), and a heap allocation holds none.
TEST(HostMemoryTest, ReservationsKeepWithinTheProcesssBound) {
  EXPECT_TRUE(HostAddressSpaceAllows(size_t{1} << 30)) << "32 TiB, or half of RLIMIT_AS";
  EXPECT_FALSE(HostAddressSpaceAllows(size_t{1} << 62));
  const size_t held = HostAddressSpaceHeld();
  absl::StatusOr<HostMemory> small = AllocateHostMemory(1000, true, 100000);
  ASSERT_TRUE(small.ok()) << small.status();
  EXPECT_FALSE(small->mapped());
  EXPECT_EQ(HostAddressSpaceHeld(), held) << "a heap allocation reserves nothing";
  // Under a huge page, but with room to grow past one: a mapping however small (whole pages,
  // as the heap's), its reservation held, its pages populated as a larger mapping's are (where
  // the kernel populates: Linux 5.14+).
  absl::StatusOr<HostMemory> large = AllocateHostMemory(kHugePageBytes, true);
  ASSERT_TRUE(large.ok()) << large.status();
  const bool kernel_populates = ResidentShare(large->data(), kHugePageBytes) == 1.0;
  large->reset();
  const int64_t mappings = HostMappings();
  absl::StatusOr<HostMemory> tiny = AllocateHostMemory(1000, true, kHugePageBytes);
  ASSERT_TRUE(tiny.ok()) << tiny.status();
  EXPECT_TRUE(tiny->mapped());
  EXPECT_EQ(tiny->size(), 1000u);
  EXPECT_EQ(HostMappings(), mappings + 1);
  EXPECT_EQ(HostAddressSpaceHeld(), held + kHugePageBytes);
  if (kernel_populates) EXPECT_EQ(ResidentShare(tiny->data(), 1000), 1.0);
  ExpectWritable(*tiny);
  tiny->reset();
  EXPECT_EQ(HostAddressSpaceHeld(), held);
  absl::StatusOr<HostMemory> growing =
      AllocateHostMemory(kHugePageBytes / 4, true, kHugePageBytes);
  ASSERT_TRUE(growing.ok()) << growing.status();
  EXPECT_TRUE(growing->mapped());
  EXPECT_EQ(HostMappings(), mappings + 1);
  EXPECT_EQ(growing->reserved_bytes(), kHugePageBytes);
  EXPECT_EQ(HostAddressSpaceHeld(), held + kHugePageBytes);
  EXPECT_TRUE(Aligned(growing->data()));
  if (kernel_populates) EXPECT_EQ(ResidentShare(growing->data(), kHugePageBytes / 4), 1.0);
  std::memset(growing->data(), 0x3c, kHugePageBytes / 4);
  ASSERT_TRUE(growing->Grow(kHugePageBytes).ok());
  EXPECT_EQ(growing->data()[kHugePageBytes / 4 - 1], std::byte{0x3c});
  EXPECT_EQ(growing->size(), kHugePageBytes) << "grown where it is";
  // With the process's mappings at their bound, such an allocation is the heap's again.
  SetHostSmallMappingsBoundForTesting(HostMappings());
  absl::StatusOr<HostMemory> bounded =
      AllocateHostMemory(kHugePageBytes / 4, true, kHugePageBytes);
  SetHostSmallMappingsBoundForTesting(0);
  ASSERT_TRUE(bounded.ok()) << bounded.status();
  EXPECT_FALSE(bounded->mapped());
  growing->reset();
  EXPECT_EQ(HostMappings(), mappings);
  EXPECT_EQ(HostAddressSpaceHeld(), held);
  SetHostAddressSpaceBoundForTesting(held + (64 << 20));
  absl::Cleanup unbound = [] { SetHostAddressSpaceBoundForTesting(0); };
  EXPECT_TRUE(HostAddressSpaceAllows(64 << 20));
  EXPECT_FALSE(HostAddressSpaceAllows((64 << 20) + 1));
  absl::StatusOr<HostMemory> memory = AllocateHostMemory(kHugePageBytes, true, 16 << 20);
  ASSERT_TRUE(memory.ok()) << memory.status();
  EXPECT_TRUE(HostAddressSpaceAllows(48 << 20));
  EXPECT_FALSE(HostAddressSpaceAllows((48 << 20) + 1)) << "16 MiB of it held";
  memory->reset();
  EXPECT_TRUE(HostAddressSpaceAllows(64 << 20));
}

// Allocations made at once: `each` made by `allocate` on each of eight threads, all kept (a
// failed one fails the test).
std::vector<HostMemory> AllocateOnEightThreads(
    int each, const std::function<absl::StatusOr<HostMemory>()>& allocate) {
  std::vector<std::vector<HostMemory>> made(8);
  std::vector<std::thread> threads;
  for (std::vector<HostMemory>& mine : made) {
    threads.emplace_back([&mine, &allocate, each] {
      for (int i = 0; i < each; ++i) {
        absl::StatusOr<HostMemory> memory = allocate();
        EXPECT_TRUE(memory.ok()) << memory.status();
        if (memory.ok()) mine.push_back(*std::move(memory));
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  std::vector<HostMemory> all;
  for (std::vector<HostMemory>& mine : made) {
    for (HostMemory& memory : mine) all.push_back(std::move(memory));
  }
  return all;
}

// An allocation holds its reservation only where the process's bound has room for it, checked
// and held in one atomic step: allocations made at once on eight threads, each asking for
// 4 MiB for 100 bytes, hold as many reservations as fit the bound and no more; the rest are
// heap allocations (and still work).
TEST(HostMemoryTest, ReservationsMadeAtOnceNeverPassTheBoundTogether) {
  constexpr size_t kReserve = 4 << 20;
  constexpr int kThreads = 8, kEach = 8, kFit = 10;
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  // Room for ten reservations, and slack less than an eleventh.
  const size_t room = kFit * kReserve + kThreads * kEach * page;
  SetHostAddressSpaceBoundForTesting(HostAddressSpaceHeld() + room);
  absl::Cleanup unbound = [] { SetHostAddressSpaceBoundForTesting(0); };
  std::vector<HostMemory> made =
      AllocateOnEightThreads(kEach, [] { return AllocateHostMemory(100, true, kReserve); });
  int reserved = 0, total = 0;
  for (HostMemory& memory : made) {
    ++total;
    reserved += memory.reserved_bytes() == kReserve;
    // (A small one without its room to grow is the heap's: no reservation, no mapping.)
    EXPECT_EQ(memory.mapped(), memory.reserved_bytes() == kReserve);
    if (memory.reserved_bytes() != kReserve) EXPECT_EQ(memory.reserved_bytes(), 0u);
    ExpectWritable(memory);
  }
  EXPECT_EQ(total, kThreads * kEach);
  EXPECT_EQ(reserved, kFit) << "as many as fit the bound, and no more";
}

// Given several reservations to choose from, an allocation holds the largest that still fits,
// chosen and held in one step: on eight threads, 64 allocations asking for 16 MiB or else 4
// MiB hold exactly the ten 16 MiB and then the three 4 MiB reservations that fit (no 4 MiB is
// taken while 16 MiB still fits); the rest hold their pages alone (past the bound). Before, the
// choice was made by an unlocked check (HostAddressSpaceAllows), and an allocation that lost a
// race for it got its pages alone, however much room the smaller choice still had.
TEST(HostMemoryTest, ReservationsMadeAtOnceTakeTheLargestChoiceThatStillFits) {
  constexpr size_t kLarge = 16 << 20, kSmall = 4 << 20;
  constexpr int kThreads = 8, kEach = 8, kLargeFit = 10, kSmallFit = 3;
  // (kSmallFit small ones take less than a large one: the eleventh large one does not fit.)
  const size_t room = kLargeFit * kLarge + kSmallFit * kSmall;
  SetHostAddressSpaceBoundForTesting(HostAddressSpaceHeld() + room);
  absl::Cleanup unbound = [] { SetHostAddressSpaceBoundForTesting(0); };
  std::vector<HostMemory> made = AllocateOnEightThreads(kEach, [] {
    const size_t choices[] = {kSmall, kLarge};  // (any order: the largest that fits)
    return AllocateHostMemory(kHugePageBytes, true, choices);
  });
  std::map<size_t, int> by_reservation;
  for (HostMemory& memory : made) {
    ASSERT_TRUE(memory.mapped());
    ++by_reservation[memory.reserved_bytes()];
    ExpectWritable(memory);
  }
  EXPECT_EQ(by_reservation,
            (std::map<size_t, int>{{kHugePageBytes, kThreads * kEach - kLargeFit - kSmallFit},
                                   {kSmall, kSmallFit},
                                   {kLarge, kLargeFit}}));
}

// A small allocation whose every choice of room to grow past a huge page is refused by the
// bound is the heap's (as one that asks for none), not a mapping without room that moves at
// every growth and counts against the process's mappings; and a move holds its new reservation
// in place of its old one, so that near the bound it needs room for the new one only.
TEST(HostMemoryTest, ReservationsLeftWithoutRoomFallBackAndMovesReplaceTheirOwn) {
  const size_t held = HostAddressSpaceHeld();
  SetHostAddressSpaceBoundForTesting(held + (16 << 20));
  absl::Cleanup unbound = [] { SetHostAddressSpaceBoundForTesting(0); };
  const size_t too_large[] = {size_t{32} << 20, size_t{64} << 20};
  absl::StatusOr<HostMemory> small = AllocateHostMemory(4096, true, too_large);
  ASSERT_TRUE(small.ok()) << small.status();
  EXPECT_FALSE(small->mapped()) << "no room to grow into: the heap's";
  EXPECT_EQ(HostAddressSpaceHeld(), held);
  const size_t fits[] = {size_t{32} << 20, size_t{8} << 20, 4 * kHugePageBytes};
  absl::StatusOr<HostMemory> array = AllocateHostMemory(4096, true, fits);
  ASSERT_TRUE(array.ok()) << array.status();
  ASSERT_TRUE(array->mapped());
  EXPECT_EQ(array->reserved_bytes(), size_t{8} << 20);
  EXPECT_EQ(HostAddressSpaceHeld(), held + (8 << 20));
  std::memset(array->data(), 0x5a, 4096);
  // Past its reservation, asking for 12 MiB: with its own 8 MiB given back as it moves, the
  // bound's 16 MiB have room for it (counting both, they would not: 20 MiB).
  const size_t twelve[] = {size_t{12} << 20};
  ASSERT_TRUE(array->Grow((8 << 20) + 4096, twelve).ok());
  EXPECT_EQ(array->reserved_bytes(), size_t{12} << 20);
  EXPECT_EQ(HostAddressSpaceHeld(), held + (12 << 20));
  EXPECT_EQ(array->data()[4095], std::byte{0x5a});
  ExpectWritable(*array);
  array->reset();
  EXPECT_EQ(HostAddressSpaceHeld(), held);
}

// Whether every page of [p, p + bytes) (page-aligned) is mapped (inaccessible ones too).
bool WhollyMapped(const std::byte* p, size_t bytes) {
  return MappedPages(p, bytes) * static_cast<size_t>(sysconf(_SC_PAGESIZE)) == bytes;
}

// A move the kernel refuses for the commit limit (vm.overcommit_memory=2) has unmapped its
// target first (mm/mremap.c). Refused twice (the move, then the move without growing), Grow fails
// with the allocation where it was, its content kept, and the address space it held for the move
// given back. Refused once, Grow takes the range back and moves the pages as they are, so that
// its reservation stays its own (mapped, inaccessible: no hole another mapping could take) and
// growths into it work; its pages and its tail are then two mappings, which it never moves again:
// a growth past the reservation is refused (BudgetedRows then copies), whatever the kernel.
TEST(HostMemoryTest, AMoveRefusedForTheCommitKeepsItsReservation) {
  absl::StatusOr<HostMemory> memory = AllocateHostMemory(kHugePageBytes, true);
  ASSERT_TRUE(memory.ok()) << memory.status();
  std::memset(memory->data(), 0x5a, kHugePageBytes);
  absl::Cleanup refuse_none = [] { SetHostMemoryRefusedMovesForTesting(0); };
  std::byte* where = memory->data();
  const size_t held = HostAddressSpaceHeld();
  SetHostMemoryRefusedMovesForTesting(2);
  const absl::Status refused = memory->Grow(2 * kHugePageBytes, 8 * kHugePageBytes);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_EQ(memory->data(), where);
  EXPECT_EQ(memory->size(), kHugePageBytes);
  EXPECT_EQ(memory->data()[kHugePageBytes - 1], std::byte{0x5a});
  EXPECT_EQ(HostAddressSpaceHeld(), held);

  SetHostMemoryRefusedMovesForTesting(1);
  ASSERT_TRUE(memory->Grow(2 * kHugePageBytes, 8 * kHugePageBytes).ok());
  EXPECT_EQ(memory->reserved_bytes(), 8 * kHugePageBytes);
  EXPECT_EQ(memory->data()[kHugePageBytes - 1], std::byte{0x5a});
  EXPECT_TRUE(WhollyMapped(memory->data() + 2 * kHugePageBytes, 6 * kHugePageBytes))
      << "a hole in its reservation";
  std::memset(memory->data() + kHugePageBytes, 0x6b, kHugePageBytes);
  where = memory->data();
  ASSERT_TRUE(memory->Grow(6 * kHugePageBytes).ok()) << "into its reservation";
  EXPECT_EQ(memory->data(), where);
  EXPECT_EQ(memory->data()[2 * kHugePageBytes - 1], std::byte{0x6b});
  std::memset(memory->data() + 2 * kHugePageBytes, 0x7c, 4 * kHugePageBytes);
  const absl::Status split = memory->Grow(10 * kHugePageBytes, 16 * kHugePageBytes);
  EXPECT_EQ(split.code(), absl::StatusCode::kResourceExhausted) << split;
  EXPECT_EQ(memory->data(), where);
  EXPECT_EQ(memory->data()[0], std::byte{0x5a});
  EXPECT_EQ(memory->data()[6 * kHugePageBytes - 1], std::byte{0x7c});
}

// A /proc/meminfo figure in bytes (its kB), or -1.
int64_t MeminfoBytes(const std::string& name) {
  std::ifstream in("/proc/meminfo");
  std::string key;
  int64_t kb = 0;
  std::string unit;
  while (in >> key >> kb) {
    if (key == name + ":") return kb * 1024;
    std::getline(in, unit);
  }
  return -1;
}

// Under strict accounting (vm.overcommit_memory=2: skipped elsewhere; the device calls set it
// for this test, device_calls/d140.sh), a growth past the reservation whose move the commit
// limit cannot take is refused before anything moves: its target is mapped writable first, so
// the refusal comes there, not after the kernel unmapped the target for the move. The array
// stays where it was, as it was, its reservation whole and its own, and grows within it; a move
// the limit can take goes on working. (With the target reserved inaccessible, the move was
// refused after that unmapping, and the pages moved as they were, split from their tail.)
TEST(HostMemoryTest, UnderStrictOvercommitAMoveTheLimitRefusesChangesNothing) {
  std::ifstream mode_file("/proc/sys/vm/overcommit_memory");
  int mode = -1;
  if (!(mode_file >> mode) || mode != 2) {
    GTEST_SKIP() << "vm.overcommit_memory is " << mode << ", not 2 (strict accounting)";
  }
  const int64_t room = MeminfoBytes("CommitLimit") - MeminfoBytes("Committed_AS");
  ASSERT_GT(room, int64_t{64} << 20) << "the commit limit has no room for the test itself";
  constexpr size_t kReserved = 8 * kHugePageBytes;
  absl::StatusOr<HostMemory> memory = AllocateHostMemory(4 * kHugePageBytes, true, kReserved);
  ASSERT_TRUE(memory.ok()) << memory.status();
  std::memset(memory->data(), 0x3d, memory->size());
  std::byte* const where = memory->data();
  // A reservation a gibibyte past what the limit has room for (whatever else the machine
  // commits meanwhile).
  const size_t too_much = static_cast<size_t>(room) + (size_t{1} << 30);
  const absl::Status refused = memory->Grow(kReserved + 4096, too_much);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_EQ(memory->data(), where) << "nothing moved";
  EXPECT_EQ(memory->size(), 4 * kHugePageBytes);
  EXPECT_EQ(memory->reserved_bytes(), kReserved);
  EXPECT_EQ(memory->data()[4 * kHugePageBytes - 1], std::byte{0x3d});
  EXPECT_TRUE(WhollyMapped(where, kReserved)) << "its reservation still its own";
  ASSERT_TRUE(memory->Grow(kReserved).ok()) << "within its reservation";
  EXPECT_EQ(memory->data(), where);
  ExpectWritable(*memory);
  const absl::Status moved = memory->Grow(kReserved + 4096, 2 * kReserved);
  ASSERT_TRUE(moved.ok()) << moved;
  EXPECT_EQ(memory->reserved_bytes(), 2 * kReserved);
  EXPECT_EQ(memory->data()[kReserved - 1], static_cast<std::byte>((kReserved - 1) * 7));
}

TEST(HostMemoryTest, MovingHandsTheAllocationOver) {
  absl::StatusOr<HostMemory> memory = AllocateHostMemory(kHugePageBytes * 2, true);
  ASSERT_TRUE(memory.ok()) << memory.status();
  std::byte* const data = memory->data();
  std::memset(data, 5, memory->size());
  HostMemory moved = *std::move(memory);
  EXPECT_EQ(moved.data(), data);
  EXPECT_TRUE(moved.mapped());
  EXPECT_TRUE(moved.huge_pages_requested());
  EXPECT_EQ(moved.data()[moved.size() - 1], std::byte{5});
  EXPECT_EQ(memory->data(), nullptr);  // NOLINT: moved from, and empty
  EXPECT_EQ(memory->size(), 0u);       // NOLINT
  EXPECT_FALSE(memory->mapped());      // NOLINT
  moved = HostMemory();
  EXPECT_EQ(moved.data(), nullptr);
  EXPECT_FALSE(moved.huge_pages_requested());
}

TEST(HostMemoryTest, TheSwitchPicksTheDefault) {
  ASSERT_TRUE(cpu::HostHugePages()) << "on unless turned off";
  cpu::SetHostHugePages(false);
  absl::StatusOr<HostMemory> off = AllocateHostMemory(2 * kHugePageBytes);
  cpu::SetHostHugePages(true);
  absl::StatusOr<HostMemory> on = AllocateHostMemory(2 * kHugePageBytes);
  ASSERT_TRUE(off.ok() && on.ok());
  EXPECT_FALSE(off->huge_pages_requested());
  EXPECT_TRUE(on->huge_pages_requested());
  // Both are aligned mappings of their own: only the advice differs.
  EXPECT_TRUE(off->mapped() && Aligned(off->data()));
  EXPECT_TRUE(on->mapped() && Aligned(on->data()));
  absl::StatusOr<int64_t> off_huge = AnonHugePageBytes(off->data(), off->size());
  ASSERT_TRUE(off_huge.ok()) << off_huge.status();
  EXPECT_EQ(*off_huge, 0) << "MADV_NOHUGEPAGE keeps 4 KiB pages in every THP mode";
}

TEST(HostMemoryTest, MemoryThatCannotBeHadIsResourceExhausted) {
  // Beyond any address space; and beyond what a size_t can round up.
  EXPECT_TRUE(HasStatus(AllocateHostMemory(size_t{1} << 62, true).status(),
                        absl::StatusCode::kResourceExhausted,
                        "cannot allocate 4611686018427387904 bytes of host memory"));
  EXPECT_TRUE(HasStatus(AllocateHostMemory(SIZE_MAX, false).status(),
                        absl::StatusCode::kResourceExhausted, "bytes of host memory"));
}

TEST(HostMemoryTest, HugePagesBackTheMappingWhereTheHostAllowsThem) {
  if (!HugePagesAvailable()) {
    GTEST_SKIP() << "transparent huge pages are '" << TransparentHugePagesMode()
                 << "' on this host (/sys/kernel/mm/transparent_hugepage/enabled): the kernel "
                    "backs no mapping with them";
  }
  // Two whole huge pages, then 8 KiB past the last boundary, which stay small pages.
  const size_t bytes = 2 * kHugePageBytes + 8192;
  absl::StatusOr<HostMemory> memory = AllocateHostMemory(bytes, /*huge_pages=*/true);
  ASSERT_TRUE(memory.ok()) << memory.status();
  ASSERT_TRUE(memory->huge_pages_advised());
  absl::StatusOr<int64_t> huge = AnonHugePageBytes(memory->data(), memory->size());
  ASSERT_TRUE(huge.ok()) << huge.status();
  // Populated at allocation (after the advice): at least one huge page, at most the two whole
  // ones (defragmentation may fail to find a second on a busy host).
  EXPECT_GE(*huge, static_cast<int64_t>(kHugePageBytes));
  EXPECT_LE(*huge, static_cast<int64_t>(2 * kHugePageBytes));
}

TEST(HostMemoryTest, TheModeIsTheBracketedWord) {
  std::ifstream file("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string line;
  if (!std::getline(file, line)) {
    EXPECT_EQ(TransparentHugePagesMode(), "unavailable");
    return;
  }
  const std::string mode = TransparentHugePagesMode();
  EXPECT_TRUE(mode == "always" || mode == "madvise" || mode == "never") << mode;
  EXPECT_NE(line.find("[" + mode + "]"), std::string::npos) << line;
}

// A fake /sys/fs/cgroup: writes `contents` to each mount-relative file in `files`.
void WriteFiles(const ::kvrecall::testing::TempDirectory& mount,
                const std::vector<std::pair<std::string, std::string>>& files) {
  for (const auto& [name, contents] : files) {
    const std::string path = mount.path() + name;
    std::filesystem::create_directories(std::filesystem::path(path).parent_path());
    std::ofstream(path) << contents;
  }
}

TEST(MemoryLimitTest, CgroupV2TakesTheLowestLimitOfTheGroupAndItsAncestors) {
  ::kvrecall::testing::TempDirectory mount("cgroup-v2");
  ASSERT_FALSE(mount.path().empty());
  WriteFiles(mount, {{"/memory.max", "max\n"},
                     {"/pod/memory.max", "8589934592\n"},
                     {"/pod/app/memory.max", "max\n"}});
  EXPECT_EQ(CgroupMemoryLimitBytes(mount.path(), "0::/pod/app\n"), int64_t{8} << 30);
  // A limit on the group itself below its parent's.
  WriteFiles(mount, {{"/pod/app/memory.max", "1073741824\n"}});
  EXPECT_EQ(CgroupMemoryLimitBytes(mount.path(), "0::/pod/app\n"), int64_t{1} << 30);
  // The namespace's own root (a container's view: "0::/"), and no limit anywhere.
  EXPECT_EQ(CgroupMemoryLimitBytes(mount.path(), "0::/\n"), 0);
  WriteFiles(mount, {{"/memory.max", "2147483648"}});
  EXPECT_EQ(CgroupMemoryLimitBytes(mount.path(), "0::/\n"), int64_t{2} << 30);
  // A path that would climb out of the mount is not followed.
  EXPECT_EQ(CgroupMemoryLimitBytes(mount.path(), "0::/pod/../..\n"), 0);
}

TEST(MemoryLimitTest, CgroupV1ReadsTheMemoryControllersHierarchy) {
  // A hybrid host, as this project's development machine: v1 controllers beside an empty
  // unified hierarchy; "unlimited" is a huge number there, which the caller bounds by the
  // machine's memory.
  ::kvrecall::testing::TempDirectory mount("cgroup-v1");
  ASSERT_FALSE(mount.path().empty());
  WriteFiles(mount, {{"/memory/memory.limit_in_bytes", "9223372036854771712\n"},
                     {"/memory/api/job/memory.limit_in_bytes", "4294967296\n"},
                     {"/cpu/api/job/cpu.shares", "1024\n"},
                     {"/unified/cgroup.procs", ""}});
  const std::string membership =
      "9:name=systemd:/\n8:pids:/\n4:memory:/api/job\n2:cpu,cpuacct:/api/job\n0::/\n";
  EXPECT_EQ(CgroupMemoryLimitBytes(mount.path(), membership), int64_t{4} << 30);
  // The controller listed among others on its line.
  EXPECT_EQ(CgroupMemoryLimitBytes(mount.path(), "4:blkio,memory:/api/job\n"), int64_t{4} << 30);
  // Outside the limited group only the root's "unlimited" is left.
  EXPECT_EQ(CgroupMemoryLimitBytes(mount.path(), "4:memory:/other\n"), 9223372036854771712);
}

TEST(MemoryLimitTest, WhatSaysNothingIsNoLimit) {
  ::kvrecall::testing::TempDirectory mount("cgroup-none");
  ASSERT_FALSE(mount.path().empty());
  WriteFiles(mount, {{"/memory.max", "lots\n"}, {"/a/memory.max", "-5\n"}});
  EXPECT_EQ(CgroupMemoryLimitBytes(mount.path(), ""), 0);
  EXPECT_EQ(CgroupMemoryLimitBytes(mount.path(), "0::/a\n"), 0) << "unparsable limits";
  EXPECT_EQ(CgroupMemoryLimitBytes(mount.path(), "0::/missing\n"), 0);
  EXPECT_EQ(CgroupMemoryLimitBytes(mount.path(), "garbage\n7:memory\n0::relative\n"), 0);
}

TEST(MemoryLimitTest, TheProcessLimitIsAtMostThePhysicalMemory) {
  const int64_t physical = PhysicalMemoryBytes();
  if (physical <= 0) GTEST_SKIP() << "the system does not say how much memory it has";
  const int64_t usable = MemoryLimitBytes();
  EXPECT_GT(usable, 0);
  EXPECT_LE(usable, physical);
}

}  // namespace
}  // namespace kvrecall
