// Host allocations for large, long-lived arrays (a session's KV): 2 MiB-aligned mappings of their
// own backed by transparent huge pages, so that scattered row reads, by host threads and by a GPU
// over PCIe, need fewer address translations; a process-wide switch (kvrecalld
// --host_huge_pages) backs them with 4 KiB pages instead.
#ifndef KVRECALL_SERVER_HOST_MEMORY_H_
#define KVRECALL_SERVER_HOST_MEMORY_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/cpu/mapped_memory.h"

namespace kvrecall {

// A huge page; allocations of at least this many bytes get a mapping of their own (the
// threshold of kernels/cpu/mapped_memory.h's, which maps their pages).
inline constexpr size_t kHugePageBytes = cpu::kMappedAllocationBytes;

// Whether HostMemory::Grow grows an allocation with no address space reserved past it where
// it is, when the addresses after it are free. Not in ThreadSanitizer builds, which move it
// then, into a fresh mapping: TSan does not see mremap, and pages grown into a range a moved
// allocation left could carry that range's access history. (Growths within reserved address
// space stay where they are in every build: that range was never accessible before.)
#if defined(__SANITIZE_THREAD__)
inline constexpr bool kHostMemoryGrowsWhereItIs = false;
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
inline constexpr bool kHostMemoryGrowsWhereItIs = false;
#else
inline constexpr bool kHostMemoryGrowsWhereItIs = true;
#endif
#else
inline constexpr bool kHostMemoryGrowsWhereItIs = true;
#endif

// An owning handle of one host allocation (see AllocateHostMemory); move-only.
class HostMemory {
 public:
  HostMemory() = default;
  HostMemory(HostMemory&& other) noexcept { *this = std::move(other); }
  HostMemory& operator=(HostMemory&& other) noexcept;
  ~HostMemory() { reset(); }

  std::byte* data() const { return data_; }
  // The bytes asked for.
  size_t size() const { return bytes_; }
  // Whether it has a 2 MiB-aligned mapping of its own (it is large, or reserves room to grow
  // past a huge page).
  bool mapped() const { return mapped_bytes_ > 0; }
  // Whether MADV_HUGEPAGE was asked for, and whether the kernel accepted it (it refuses where
  // transparent huge pages are not built in). Accepted advice backs it with 2 MiB pages when
  // the THP mode (TransparentHugePagesMode) is "madvise" or "always" and memory is available.
  bool huge_pages_requested() const { return huge_pages_requested_; }
  bool huge_pages_advised() const { return huge_pages_advised_; }

  // The address space the allocation holds from data(): at least its mapped pages, and beyond
  // them what AllocateHostMemory or a moving Grow set aside (mapped without memory, PROT_NONE),
  // into which it grows without moving. 0 for a heap allocation.
  size_t reserved_bytes() const { return reserved_bytes_; }
  // Whether Grow(bytes) keeps data() where it is: a mapped allocation whose reserved address
  // space holds `bytes`. Readers of the old bytes may then go on while it grows.
  bool GrowsInPlaceTo(size_t bytes) const { return mapped() && bytes <= reserved_bytes_; }

  // Grows a mapped allocation to `bytes` (>= size()) without copying it, and maps only the pages
  // added (as AllocateHostMemory maps its pages), so a growth costs the new rows, not the old
  // ones (a copy into a new allocation populated and wrote every byte of both):
  // - within reserved_bytes(), the pages added are made accessible where they are; data() and
  //   every old byte stay as they were (GrowsInPlaceTo);
  // - beyond it, its pages move, by their page tables (mremap), to a new 2 MiB-aligned range of
  //   max(bytes, reserve) bytes of address space, `reserve` the largest of `reserve_choices`
  //   that the process's bound has room for (HostAddressSpaceBound; bytes alone where none
  //   has; the old reservation counts as given back), or grow where they are, when no address
  //   space is reserved past them or asked for, and the addresses after them are free. data()
  //   may change; the content up to the old size() is kept.
  // FAILED_PRECONDITION for a heap allocation (not mapped()) or a smaller `bytes`;
  // RESOURCE_EXHAUSTED when the address space or the pages cannot be had, the allocation then
  // as it was (perhaps moved), and past the reservation of one whose move the kernel refused
  // for the commit once (its pages and its reservation are then two mappings: it does not move
  // again; a caller copies).
  absl::Status Grow(size_t bytes, absl::Span<const size_t> reserve_choices);
  absl::Status Grow(size_t bytes, size_t reserve_bytes = 0);
  // Makes the pages a growth to `bytes` within the reserved address space adds accessible and
  // maps them now (populated), without changing this object: another thread may run it while
  // the mapped bytes are read and written, so that the growth itself (Grow(bytes), on the
  // owner's thread) finds them ready and costs next to nothing. GrowsInPlaceTo(bytes) must
  // hold, and nothing else may grow or free the allocation meanwhile (else FAILED_PRECONDITION
  // when that is seen); RESOURCE_EXHAUSTED when the pages cannot be had (those mapped given
  // back).
  absl::Status MapAhead(size_t bytes) const;
  // Grows to `bytes` over pages MapAhead(bytes) made ready: records them, no system call
  // (Grow would walk their page tables again: ~10 ms for 128 MiB of 4 KiB pages, on the
  // owner's thread). FAILED_PRECONDITION outside the reserved address space or below size().
  absl::Status TakeMappedAhead(size_t bytes);
  // Gives back the pages MapAhead(bytes) mapped past size() that nothing took: their memory
  // freed and their range reserved again (still counted against the system's commit limit,
  // which matters only under vm.overcommit_memory=2).
  void UnmapAhead(size_t bytes) const;

  // Frees the allocation; empty afterwards.
  void reset();

 private:
  friend absl::StatusOr<HostMemory> AllocateHostMemory(
      size_t bytes, bool huge_pages, absl::Span<const size_t> reserve_choices);

  std::byte* data_ = nullptr;
  size_t bytes_ = 0;
  size_t mapped_bytes_ = 0;  // 0: an ordinary heap allocation
  size_t reserved_bytes_ = 0;  // >= mapped_bytes_; beyond them PROT_NONE
  bool huge_pages_requested_ = false;
  bool huge_pages_advised_ = false;
  // Its pages and its reserved tail are two mappings (a move refused for the commit, then made
  // without growing): never moved again, since a move of several mappings fails (Linux before
  // 6.17) or may stop halfway; a growth past its reservation is refused (the caller copies).
  bool split_ = false;
};

// `bytes` rounded up to whole pages of the system (what a mapping, or a pinning, covers).
size_t WholePages(size_t bytes);

// The host memory an allocation of `bytes` (AllocateHostMemory) takes: its whole pages, and a
// page for each 2 MiB it begins (a mapping's page table; a heap allocation's alignment and
// header). What a budget is charged for it, so that many small allocations are not charged a
// fraction of what they hold (probe 17: a 32-layer session of 16 tokens of 1 KiB arrays was
// charged 73 KiB and held ~460). 0 for none.
int64_t HostFootprint(int64_t bytes);

// The address space the process's mapped HostMemory allocations hold, their reservations
// included (thread-safe).
size_t HostAddressSpaceHeld();
// The bound on what they hold with their reservations: half the process's address-space limit
// (RLIMIT_AS), or 32 TiB (a quarter of x86-64's user space) without one, so that reservations
// made only to grow into never starve other mappings (the allocator's, the CUDA driver's). An
// allocation's reservation is held only where it fits (AllocateHostMemory, HostMemory::Grow:
// the largest choice that fits, else its pages alone, in one atomic step with the check); its
// pages are held whatever the bound.
size_t HostAddressSpaceBound();
// Whether `bytes` more would fit the bound now (thread-safe; what is held may change at once:
// AllocateHostMemory and Grow choose and hold a reservation in one step).
bool HostAddressSpaceAllows(size_t bytes);
// Sets the bound (0: the default above), for tests.
void SetHostAddressSpaceBoundForTesting(size_t bytes);
// Refuses the next `moves` moves of a growing HostMemory::Grow as the kernel refuses one for the
// commit limit (vm.overcommit_memory=2): the target's range unmapped first, then ENOMEM. Tests.
void SetHostMemoryRefusedMovesForTesting(int moves);
// The process's mapped HostMemory allocations (thread-safe). Allocations under kHugePageBytes
// are mapped only while they stay under a quarter of the kernel's limit on memory areas
// (vm.max_map_count / 12: each mapping takes up to three); past it, the heap.
int64_t HostMappings();
// Sets that bound (0: the default), for tests.
void SetHostSmallMappingsBoundForTesting(int64_t mappings);

// The machine's physical memory in bytes (0 when the system does not say).
int64_t PhysicalMemoryBytes();

// The memory this process may use, in bytes: the machine's physical memory, or less where its
// control group says so (a container's limit: cgroup v2 memory.max, v1 memory.limit_in_bytes,
// of its group or any group above it). 0 when nothing says.
int64_t MemoryLimitBytes();

// The lowest memory limit, in bytes, of the control groups named by `membership` (the lines of
// /proc/self/cgroup: "0::PATH" for cgroup v2, "ID:CONTROLLERS:PATH" for v1) and of every group
// above them, read from the hierarchies mounted under `mount` (/sys/fs/cgroup: v2 there or in
// its unified/, v1's memory controller in its memory/), each assumed mounted at its root (as
// in a container with its own cgroup namespace, or on the host). 0 when none is set ("max",
// absent or unreadable); v1 writes "no limit" as a huge number, returned as it is (the caller
// bounds it by the machine's memory). A path with a ".." component is ignored.
int64_t CgroupMemoryLimitBytes(const std::string& mount, const std::string& membership);

// `bytes` of host memory (uninitialized). An allocation of at least kHugePageBytes is a mapping of
// its own, aligned to kHugePageBytes, whose pages are all mapped now (MADV_POPULATE_WRITE: first
// touches would fault them in one by one, microseconds each in a VM), after MADV_HUGEPAGE when
// `huge_pages`, else after MADV_NOHUGEPAGE (4 KiB pages even where the THP mode is "always"),
// with the address space after it up to the largest of `reserve_choices` (bytes from its start)
// that the process's bound (HostAddressSpaceBound) has room for set aside for it to grow into
// without moving (HostMemory::Grow; no memory is mapped there, and none counted against the
// system's commit limit). The choice and its hold are one atomic step: allocations made at once
// each get the largest that still fits, else none is reserved, as where an address-space limit
// refuses it. So is a smaller one, of any size, that reserves room to grow to kHugePageBytes or
// more, while the process's mappings are few (HostMappings). Any other (and one of no bytes) is
// a heap allocation of whole pages of its own (nothing reserved), so that pinning it never
// meets another's pages. RESOURCE_EXHAUSTED, saying how many bytes, when the memory or the
// address space cannot be had. The first form follows cpu::HostHugePages() and reserves
// nothing; the third reserves up to `reserve_bytes` (one choice).
absl::StatusOr<HostMemory> AllocateHostMemory(size_t bytes);
absl::StatusOr<HostMemory> AllocateHostMemory(size_t bytes, bool huge_pages,
                                              absl::Span<const size_t> reserve_choices);
absl::StatusOr<HostMemory> AllocateHostMemory(size_t bytes, bool huge_pages,
                                              size_t reserve_bytes = 0);

// The host's transparent huge page mode, the bracketed word of
// /sys/kernel/mm/transparent_hugepage/<setting>: for "enabled", "always", "madvise" or "never";
// for "defrag", when faults compact memory to find huge pages. "unavailable" when that cannot be
// read.
std::string TransparentHugePagesMode(const std::string& setting = "enabled");

// The AnonHugePages bytes (/proc/self/smaps) of the mappings that overlap [data, data + bytes):
// how much of them the kernel backs with huge pages now (a neighbouring allocation merged into
// the same mapping counts too). UNAVAILABLE when smaps cannot be read.
absl::StatusOr<int64_t> AnonHugePageBytes(const void* data, size_t bytes);

}  // namespace kvrecall

#endif  // KVRECALL_SERVER_HOST_MEMORY_H_
