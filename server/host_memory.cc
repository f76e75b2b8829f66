#include "server/host_memory.h"

#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "absl/algorithm/container.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/types/span.h"

namespace kvrecall {
namespace {

// HostAddressSpaceHeld, and the bound set for tests (0: none set).
std::atomic<size_t> address_space_held{0};
std::atomic<size_t> address_space_bound_for_testing{0};
// HostMappings, and the bound set for tests (0: none set).
std::atomic<int64_t> mappings{0};
std::atomic<int64_t> mappings_bound_for_testing{0};
// SetHostMemoryRefusedMovesForTesting's count of moves still to refuse.
std::atomic<int> refused_moves_for_testing{0};

// Mapped allocations under a huge page are made while the process's mappings stay under a
// quarter of the kernel's limit on memory areas (vm.max_map_count, 65530 by default: each
// mapping takes two or three, its reserved tail apart), so that they never take the areas that
// larger allocations, the allocator and the CUDA driver need.
int64_t SmallMappingsBound() {
  if (const int64_t set = mappings_bound_for_testing.load(std::memory_order_relaxed)) return set;
  static const int64_t bound = [] {
    int64_t areas = 65530;
    std::ifstream in("/proc/sys/vm/max_map_count");
    if (int64_t read = 0; in >> read && read > 0) areas = read;
    return areas / 4 / 3;
  }();
  return bound;
}

size_t AddressSpaceBound() {
  if (const size_t set = address_space_bound_for_testing.load(std::memory_order_relaxed)) {
    return set;
  }
  static const size_t bound = [] {
    size_t bound = size_t{32} << 40;
    rlimit limit{};
    if (getrlimit(RLIMIT_AS, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY) {
      bound = std::min<size_t>(bound, limit.rlim_cur / 2);
    }
    return bound;
  }();
  return bound;
}

// Whether `bytes` more beside `held` stay within `bound`.
bool Fits(size_t held, size_t bytes, size_t bound) {
  return bytes <= bound && held <= bound - bytes;
}

// Adds to the address space the process's allocations hold the largest of `choices` (in whole
// pages; none counts under `least`) that stays within the bound, else `least` (an allocation's
// own pages, held whatever the bound), in place of `replacing` bytes held until now (a moving
// allocation's old reservation, given back as the new one is held), and returns which it
// added: the choice and the hold are one atomic step, so that allocations made at once never
// pass the bound together, and one that finds its first choice taken gets the next that fits,
// not its pages alone.
size_t HoldAddressSpace(size_t least, absl::Span<const size_t> choices, size_t replacing = 0) {
  const size_t bound = AddressSpaceBound();
  size_t held = address_space_held.load(std::memory_order_relaxed);
  for (;;) {
    size_t pick = least;
    for (const size_t bytes : choices) {
      const size_t choice = WholePages(bytes);
      if (choice > pick && Fits(held - replacing, choice, bound)) pick = choice;
    }
    if (address_space_held.compare_exchange_weak(held, held - replacing + pick,
                                                 std::memory_order_relaxed)) {
      return pick;
    }
  }
}

void ReleaseAddressSpace(size_t bytes) {
  address_space_held.fetch_sub(bytes, std::memory_order_relaxed);
}

// Undoes HoldAddressSpace(.., replacing): `held` given back, `replacing` held again (it is
// still mapped; added first, so that the count never reads low meanwhile).
void HoldAgainInstead(size_t replacing, size_t held) {
  address_space_held.fetch_add(replacing, std::memory_order_relaxed);
  address_space_held.fetch_sub(held, std::memory_order_relaxed);
}

#ifndef MADV_POPULATE_WRITE
constexpr int MADV_POPULATE_WRITE = 23;  // <linux/mman.h>, Linux 5.14
#endif

// A private anonymous mapping of exactly `length` bytes (whole pages) from a 2 MiB boundary,
// with `prot` and `flags` besides MAP_PRIVATE | MAP_ANONYMOUS; null (errno set) when it cannot
// be had. Mapped with a huge page's slack, whose ends are unmapped again.
std::byte* MapAligned(size_t length, int prot, int flags) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t reserved = length + kHugePageBytes - page;
  void* const raw = mmap(nullptr, reserved, prot, MAP_PRIVATE | MAP_ANONYMOUS | flags, -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t aligned = (begin + kHugePageBytes - 1) & ~uintptr_t{kHugePageBytes - 1};
  if (aligned > begin) munmap(raw, aligned - begin);
  if (begin + reserved > aligned + length) {
    munmap(reinterpret_cast<void*>(aligned + length), begin + reserved - (aligned + length));
  }
  return reinterpret_cast<std::byte*>(aligned);
}

// The alignment of a heap allocation: a page.
std::align_val_t HeapAlignment() {
  return static_cast<std::align_val_t>(sysconf(_SC_PAGESIZE));
}

absl::Status Exhausted(size_t bytes, int error) {
  return absl::ResourceExhaustedError(
      absl::StrCat("cannot allocate ", bytes, " bytes of host memory: ", std::strerror(error)));
}

}  // namespace

size_t WholePages(size_t bytes) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return (bytes + page - 1) / page * page;
}

int64_t HostFootprint(int64_t bytes) {
  if (bytes <= 0) return 0;
  const int64_t page = sysconf(_SC_PAGESIZE);
  const int64_t huge = static_cast<int64_t>(kHugePageBytes);
  return static_cast<int64_t>(WholePages(static_cast<size_t>(bytes))) +
         page * ((bytes + huge - 1) / huge);
}

size_t HostAddressSpaceHeld() { return address_space_held.load(std::memory_order_relaxed); }

size_t HostAddressSpaceBound() { return AddressSpaceBound(); }

bool HostAddressSpaceAllows(size_t bytes) {
  return Fits(HostAddressSpaceHeld(), bytes, AddressSpaceBound());
}

void SetHostAddressSpaceBoundForTesting(size_t bytes) {
  address_space_bound_for_testing.store(bytes, std::memory_order_relaxed);
}

int64_t HostMappings() { return mappings.load(std::memory_order_relaxed); }

void SetHostSmallMappingsBoundForTesting(int64_t mappings) {
  mappings_bound_for_testing.store(mappings, std::memory_order_relaxed);
}

HostMemory& HostMemory::operator=(HostMemory&& other) noexcept {
  if (this != &other) {
    reset();
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    mapped_bytes_ = std::exchange(other.mapped_bytes_, 0);
    reserved_bytes_ = std::exchange(other.reserved_bytes_, 0);
    huge_pages_requested_ = std::exchange(other.huge_pages_requested_, false);
    huge_pages_advised_ = std::exchange(other.huge_pages_advised_, false);
    split_ = std::exchange(other.split_, false);
  }
  return *this;
}

void HostMemory::reset() {
  if (data_ != nullptr) {
    if (mapped_bytes_ > 0) {
      munmap(data_, reserved_bytes_);
      ReleaseAddressSpace(reserved_bytes_);
      mappings.fetch_sub(1, std::memory_order_relaxed);
    } else {
      ::operator delete(data_, HeapAlignment());
    }
  }
  data_ = nullptr;
  bytes_ = 0;
  mapped_bytes_ = 0;
  reserved_bytes_ = 0;
  huge_pages_requested_ = false;
  huge_pages_advised_ = false;
  split_ = false;
}

int64_t PhysicalMemoryBytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page = sysconf(_SC_PAGE_SIZE);
  if (pages <= 0 || page <= 0) return 0;
  return static_cast<int64_t>(pages) * page;
}

namespace {

// The limit a cgroup file holds (a decimal byte count), or 0 when it is absent, unreadable or
// "max" (no limit).
int64_t ReadLimitFile(const std::string& path) {
  std::ifstream file(path);
  std::string word;
  if (!(file >> word)) return 0;
  int64_t bytes = 0;
  return absl::SimpleAtoi(word, &bytes) && bytes > 0 ? bytes : 0;
}

}  // namespace

int64_t CgroupMemoryLimitBytes(const std::string& mount, const std::string& membership) {
  int64_t lowest = 0;
  for (absl::string_view line : absl::StrSplit(membership, '\n', absl::SkipWhitespace())) {
    const std::vector<std::string> fields = absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (fields.size() != 3 || !absl::StartsWith(fields[2], "/") ||
        absl::StrContains(absl::StrCat(fields[2], "/"), "/../")) {
      continue;
    }
    std::vector<std::pair<std::string, const char*>> hierarchies;  // mount point, limit file
    if (fields[0] == "0" && fields[1].empty()) {
      hierarchies = {{mount, "memory.max"}, {mount + "/unified", "memory.max"}};
    } else if (absl::c_linear_search(absl::StrSplit(fields[1], ','), "memory")) {
      hierarchies = {{mount + "/memory", "memory.limit_in_bytes"}};
    } else {
      continue;
    }
    for (const auto& [root, file] : hierarchies) {
      // The group, then each one above it up to the hierarchy's root: a limit anywhere above
      // bounds the group too.
      std::string group = fields[2];
      while (true) {
        const std::string dir = group == "/" ? root : root + group;
        if (const int64_t limit = ReadLimitFile(absl::StrCat(dir, "/", file));
            limit > 0 && (lowest == 0 || limit < lowest)) {
          lowest = limit;
        }
        if (group == "/") break;
        const size_t slash = group.rfind('/');
        group = slash == 0 ? "/" : group.substr(0, slash);
      }
    }
  }
  return lowest;
}

int64_t MemoryLimitBytes() {
  const int64_t physical = PhysicalMemoryBytes();
  std::ifstream file("/proc/self/cgroup");
  const std::string membership((std::istreambuf_iterator<char>(file)),
                               std::istreambuf_iterator<char>());
  const int64_t group = CgroupMemoryLimitBytes("/sys/fs/cgroup", membership);
  if (group > 0 && (physical <= 0 || group < physical)) return group;
  return physical;
}

absl::StatusOr<HostMemory> AllocateHostMemory(size_t bytes) {
  return AllocateHostMemory(bytes, cpu::HostHugePages());
}

namespace {

// A 2 MiB-aligned range of max(length, reserve) bytes (whole pages) of address space, its first
// `length` bytes readable and writable (not yet populated), the rest PROT_NONE; the whole range
// advised as `huge_pages` asks (MADV_HUGEPAGE or MADV_NOHUGEPAGE), so that the part made
// accessible later is like the first, and their mappings merge. Null (errno set) when it cannot
// be had. Only accessible pages count against the system's commit limit.
std::byte* MapReserved(size_t length, size_t reserve, bool huge_pages) {
  const size_t reserved = std::max(length, WholePages(reserve));
  std::byte* const aligned = MapAligned(reserved, PROT_NONE, 0);
  if (aligned == nullptr) return nullptr;
  if (mprotect(aligned, length, PROT_READ | PROT_WRITE) != 0) {
    const int error = errno;
    munmap(aligned, reserved);
    errno = error;
    return nullptr;
  }
#ifdef MADV_HUGEPAGE
  madvise(aligned, reserved, huge_pages ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
#endif
  return aligned;
}

#ifndef MAP_FIXED_NOREPLACE
constexpr int MAP_FIXED_NOREPLACE = 0x100000;  // <linux/mman.h>, Linux 4.17
#endif

// Maps [at, at + bytes) again as reserved address space (PROT_NONE, with the huge-page advice)
// where nothing is mapped there now, and leaves it as it is where something is
// (MAP_FIXED_NOREPLACE: all of it or none; a kernel before 4.17 takes the address as a hint,
// and what it mapped elsewhere is undone). Where something is, it is taken to be the range as
// it was (a move refused before its target was unmapped: the mapping count, a source of several
// mappings): another thread's mapping could have landed in a hole only between the kernel's
// unmapping and this call.
void RetakeReserved(std::byte* at, size_t bytes, bool huge_pages) {
  void* const p =
      mmap(at, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
  if (p == MAP_FAILED) return;
  if (p != at) {
    munmap(p, bytes);
    return;
  }
#ifdef MADV_HUGEPAGE
  madvise(at, bytes, huge_pages ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
#endif
}

// mremap(old, old_length, new_length, MREMAP_MAYMOVE | MREMAP_FIXED, to), or, while tests ask
// for it, that call refused as the kernel refuses it for the commit limit: `to`'s range unmapped
// first, then ENOMEM.
void* MoveMapping(void* old, size_t old_length, size_t new_length, std::byte* to) {
  int left = refused_moves_for_testing.load(std::memory_order_relaxed);
  while (left > 0 && !refused_moves_for_testing.compare_exchange_weak(
                         left, left - 1, std::memory_order_relaxed)) {
  }
  if (left > 0) {
    munmap(to, new_length);
    errno = ENOMEM;
    return MAP_FAILED;
  }
  return mremap(old, old_length, new_length, MREMAP_MAYMOVE | MREMAP_FIXED, to);
}

}  // namespace

void SetHostMemoryRefusedMovesForTesting(int moves) {
  refused_moves_for_testing.store(moves, std::memory_order_relaxed);
}

absl::StatusOr<HostMemory> AllocateHostMemory(size_t bytes, bool huge_pages,
                                              size_t reserve_bytes) {
  return AllocateHostMemory(bytes, huge_pages, absl::MakeConstSpan(&reserve_bytes, 1));
}

absl::StatusOr<HostMemory> AllocateHostMemory(size_t bytes, bool huge_pages,
                                              absl::Span<const size_t> reserve_choices) {
  HostMemory memory;
  memory.bytes_ = bytes;
  const size_t most_reserved =
      reserve_choices.empty() ? 0 : *absl::c_max_element(reserve_choices);
  // (One that reserves room to grow past a huge page is a mapping already, however small: a
  // heap allocation grows by a copy into a new allocation, in the step that needs the room
  // (d136: 29-44 ms a 32-layer token for arrays of 128-500 KiB), and every layer of a model at
  // the same token, where a mapping grows ahead of need, off the step. Its pages are whole
  // pages, as the heap's below, but all populated at once, and each mapping takes a page-table
  // page of the kernel's.)
  // (And none of no bytes: a mapping of none would not be mapped().)
  const bool small = bytes < kHugePageBytes;
  size_t length = 0, reserved = 0;
  if (bytes > 0 && (!small || (most_reserved >= kHugePageBytes &&
                               mappings.load(std::memory_order_relaxed) < SmallMappingsBound()))) {
    if (bytes > SIZE_MAX / 2 || most_reserved > SIZE_MAX / 2) return Exhausted(bytes, ENOMEM);
    length = WholePages(bytes);
    // The largest reservation the process's bound has room for, else the pages alone; a
    // small one left without room to grow past a huge page is the heap's after all.
    reserved = HoldAddressSpace(length, reserve_choices);
    if (small && reserved < kHugePageBytes) {
      ReleaseAddressSpace(reserved);
      reserved = 0;
    }
  }
  if (reserved == 0) {
    // Whole pages of their own, so that pinning one (cudaHostRegister, which pins whole pages
    // and refuses a page pinned twice) never meets another's: a layer's keys and values were
    // neighbours in one page where the heap put them so.
    memory.data_ = static_cast<std::byte*>(
        ::operator new(WholePages(std::max<size_t>(bytes, 1)), HeapAlignment(), std::nothrow));
    if (memory.data_ == nullptr) return Exhausted(bytes, ENOMEM);
    return memory;
  }
  // Whole pages from a 2 MiB boundary: every 2 MiB range but a partial last one can be a
  // huge page, and the tail beyond the last boundary stays in small pages (no huge page is
  // faulted in for a few KiB past it).
  std::byte* aligned = MapReserved(length, reserved, huge_pages);
  if (aligned == nullptr && reserved > length) {
    // The reservation refused (an address-space limit, RLIMIT_AS): the pages alone, or, for a
    // small allocation, which would then have no room to grow, the heap.
    if (small) {
      ReleaseAddressSpace(reserved);
      return AllocateHostMemory(bytes, huge_pages, /*reserve_bytes=*/0);
    }
    ReleaseAddressSpace(reserved - length);
    reserved = length;
    aligned = MapReserved(length, reserved, huge_pages);
  }
  if (aligned == nullptr) {
    const int error = errno;
    ReleaseAddressSpace(reserved);
    return Exhausted(bytes, error);
  }
  memory.data_ = aligned;
  memory.mapped_bytes_ = length;
  memory.reserved_bytes_ = reserved;
  mappings.fetch_add(1, std::memory_order_relaxed);
  memory.huge_pages_requested_ = huge_pages;
  // Kernels before 5.14 refuse the population (EINVAL): their pages fault in on first touch.
  const cpu::PageMapping pages = cpu::MapPagesNow(memory.data_, length, huge_pages);
  memory.huge_pages_advised_ = pages.huge_pages_advised;
  if (pages.populate_errno == ENOMEM) return Exhausted(bytes, ENOMEM);  // `memory` unmaps it
  return memory;
}

absl::Status HostMemory::Grow(size_t bytes, size_t reserve_bytes) {
  return Grow(bytes, absl::MakeConstSpan(&reserve_bytes, 1));
}

absl::Status HostMemory::Grow(size_t bytes, absl::Span<const size_t> reserve_choices) {
  if (!mapped() || bytes < bytes_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "only a mapped allocation grows in place (", bytes_, " bytes, ",
        mapped() ? "mapped" : "a heap allocation", ", asked for ", bytes, ")"));
  }
  const size_t most_reserved =
      reserve_choices.empty() ? 0 : *absl::c_max_element(reserve_choices);
  if (bytes > SIZE_MAX / 2 || most_reserved > SIZE_MAX / 2) return Exhausted(bytes, ENOMEM);
  const size_t length = WholePages(bytes);
  if (length <= mapped_bytes_) {
    bytes_ = bytes;
    return absl::OkStatus();
  }
  const size_t old_length = mapped_bytes_;
  if (length > reserved_bytes_ && split_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "cannot grow ", bytes_, " bytes of host memory to ", bytes,
        " without a copy: its pages and its reservation are two mappings, which do not move "
        "together"));
  }
  if (length > reserved_bytes_) {
    if (reserved_bytes_ == old_length && WholePages(most_reserved) <= length &&
        kHostMemoryGrowsWhereItIs && mremap(data_, old_length, length, 0) != MAP_FAILED) {
      // Nothing reserved past it or asked for, and the addresses after it were free: grown
      // where it is.
      HoldAddressSpace(length - reserved_bytes_, {});  // its own pages
      reserved_bytes_ = length;
    } else {
      // Its pages move to a new 2 MiB-aligned range, mapped without memory, which mremap
      // replaces; the old range's reserved tail is given back. Moved and grown to the whole
      // reservation in one call, the tail past `length` then made inaccessible again: one
      // mapping whose page offsets run on through the tail, so that the tail's pages merge
      // into it as growths make them accessible, and a later move is one call again (mremap
      // moves one mapping, not several). That tail stays counted against the system's commit
      // limit (it was writable once), which matters only under vm.overcommit_memory=2. There
      // the target is mapped writable, so that its mapping takes that charge: refused, nothing
      // has moved; taken, the kernel gives it back as it unmaps the target for the move, which
      // then needs less (the growth), so that the move is not refused after the target's
      // unmapping (mm/mremap.c charges after it) unless another process takes the commit in
      // between. Where it still is, the pages move as they are (a move charges nothing), the
      // tail stays a mapping of its own that MapAhead makes accessible, and a growth past it is
      // refused (split_), which BudgetedRows answers with a copy.
      // The new reservation is held in place of the old one, which it replaces (so that near
      // the bound a move needs room for the new one only).
      size_t reserved =
          HoldAddressSpace(length, reserve_choices, /*replacing=*/reserved_bytes_);
      std::byte* aligned = MapReserved(/*length=*/reserved, reserved, huge_pages_requested_);
      if (aligned == nullptr && reserved > length) {
        // The reservation refused (its commit, an address-space limit): the pages alone, which
        // still move without a copy (a copy would hold both, in the step).
        ReleaseAddressSpace(reserved - length);
        reserved = length;
        aligned = MapReserved(length, reserved, huge_pages_requested_);
      }
      if (aligned == nullptr) {
        const int error = errno;
        HoldAgainInstead(reserved_bytes_, reserved);
        return Exhausted(bytes, error);
      }
      void* moved = MoveMapping(data_, old_length, reserved, aligned);
      if (moved != MAP_FAILED) {
        // (A split of one mapping, not expected to fail; where it did, the tail would stay
        // accessible, unpopulated, and reserved all the same.)
        if (reserved > length) mprotect(aligned + length, reserved - length, PROT_NONE);
      } else {
        // The kernel unmaps the target before it charges the commit (mm/mremap.c): a move
        // refused for the commit left the reserved range unmapped, where anything could be
        // mapped next. Taken back first, so that the range stays this allocation's.
        const int refused = errno;
        RetakeReserved(aligned, reserved, huge_pages_requested_);
        moved = MoveMapping(data_, old_length, old_length, aligned);
        if (moved != MAP_FAILED) {
          split_ = reserved > old_length;
          // (Inaccessible as a reservation is, where the refusal left the target mapped.)
          if (split_) mprotect(aligned + old_length, reserved - old_length, PROT_NONE);
        } else {
          errno = refused;  // the first refusal's reason
        }
      }
      if (moved == MAP_FAILED) {
        const int error = errno;
        // (What that move's refusal may have unmapped, taken back: all ours to unmap, then.)
        RetakeReserved(aligned, old_length, huge_pages_requested_);
        munmap(aligned, reserved);
        HoldAgainInstead(reserved_bytes_, reserved);
        return Exhausted(bytes, error);
      }
      if (reserved_bytes_ > old_length) {
        munmap(data_ + old_length, reserved_bytes_ - old_length);
      }
      data_ = static_cast<std::byte*>(moved);
      reserved_bytes_ = reserved;
    }
  }
  // The pages added, within the reserved range now, mapped as AllocateHostMemory maps a fresh
  // allocation's, whatever their size (they share its huge-page advice). Where that fails, the
  // allocation is as it was (perhaps moved).
  if (absl::Status s = MapAhead(bytes); !s.ok()) return s;
  mapped_bytes_ = length;
  bytes_ = bytes;
  return absl::OkStatus();
}

absl::Status HostMemory::MapAhead(size_t bytes) const {
  if (!GrowsInPlaceTo(bytes)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "only pages of the reserved address space are mapped ahead (", reserved_bytes_,
        " bytes reserved, asked for ", bytes, ")"));
  }
  const size_t length = WholePages(bytes);
  if (length <= mapped_bytes_) return absl::OkStatus();
  std::byte* const from = data_ + mapped_bytes_;
  if (mprotect(from, length - mapped_bytes_, PROT_READ | PROT_WRITE) != 0) {
    return Exhausted(bytes, errno);
  }
  // In pieces: each call holds the process's memory map for reading while it faults its pages
  // in (tens of ms for a large growth), and every mmap or munmap of the process, a step's
  // included, waits for the write side until it ends.
  constexpr size_t kPiece = size_t{8} << 20;
  for (size_t at = mapped_bytes_; at < length; at += kPiece) {
    if (madvise(data_ + at, std::min(kPiece, length - at), MADV_POPULATE_WRITE) != 0) {
      if (errno != ENOMEM) break;  // kernels before 5.14: pages fault in on first touch
      UnmapAhead(bytes);
      return Exhausted(bytes, ENOMEM);
    }
  }
  return absl::OkStatus();
}

absl::Status HostMemory::TakeMappedAhead(size_t bytes) {
  if (!GrowsInPlaceTo(bytes) || bytes < bytes_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "only pages mapped ahead within the reserved address space are taken (", bytes_,
        " bytes, ", reserved_bytes_, " reserved, asked for ", bytes, ")"));
  }
  mapped_bytes_ = std::max(mapped_bytes_, WholePages(bytes));
  bytes_ = bytes;
  return absl::OkStatus();
}

void HostMemory::UnmapAhead(size_t bytes) const {
  const size_t length = std::min(WholePages(bytes), reserved_bytes_);
  if (!mapped() || length <= mapped_bytes_) return;
  std::byte* const from = data_ + mapped_bytes_;
  madvise(from, length - mapped_bytes_, MADV_DONTNEED);
  mprotect(from, length - mapped_bytes_, PROT_NONE);
}

std::string TransparentHugePagesMode(const std::string& setting) {
  std::ifstream file("/sys/kernel/mm/transparent_hugepage/" + setting);
  std::string line;
  if (!std::getline(file, line)) return "unavailable";
  const size_t open = line.find('['), close = line.find(']');
  if (open == std::string::npos || close == std::string::npos || close < open) {
    return "unavailable";
  }
  return line.substr(open + 1, close - open - 1);
}

absl::StatusOr<int64_t> AnonHugePageBytes(const void* data, size_t bytes) {
  std::ifstream smaps("/proc/self/smaps");
  if (!smaps) return absl::UnavailableError("cannot read /proc/self/smaps");
  const uintptr_t first = reinterpret_cast<uintptr_t>(data), last = first + bytes;
  bool overlaps = false;
  int64_t total = 0;
  std::string line;
  while (std::getline(smaps, line)) {
    uintptr_t start = 0, end = 0;
    int64_t kib = 0;
    if (std::sscanf(line.c_str(), "AnonHugePages: %" SCNd64 " kB", &kib) == 1) {
      if (overlaps) total += kib << 10;
    } else if (std::sscanf(line.c_str(), "%" SCNxPTR "-%" SCNxPTR, &start, &end) == 2) {
      overlaps = start < last && first < end;  // a mapping's first line: START-END perms ...
    }
  }
  return total;
}

}  // namespace kvrecall
