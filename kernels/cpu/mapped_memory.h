// Large host buffers whose pages are mapped in one call (huge pages where the kernel offers
// them) instead of faulting in 4 KiB at a time on first touch, which costs microseconds per
// page in a VM: the allocator of the graph index's adjacency and build scratch.
#ifndef KVRECALL_KERNELS_CPU_MAPPED_MEMORY_H_
#define KVRECALL_KERNELS_CPU_MAPPED_MEMORY_H_

#include <cstddef>
#include <cstdint>
#include <new>
#include <vector>

namespace kvrecall::cpu {

// Allocations of at least this many bytes are mapped now, aligned to it and rounded up to a
// multiple of it, so that they can be backed by whole 2 MiB pages.
inline constexpr size_t kMappedAllocationBytes = size_t{2} << 20;

// What MapPagesNow did: whether the kernel accepted the huge-page advice, and the errno of
// the population (0: mapped; EINVAL where the kernel lacks it; ENOMEM: out of memory).
struct PageMapping {
  bool huge_pages_advised = false;
  int populate_errno = 0;
};

// Whether large host allocations ask for huge pages (kvrecalld's --host_huge_pages; true unless
// turned off): MappedAllocator's below and server/host_memory.h's, one switch for both.
// Thread-safe, read at every allocation.
void SetHostHugePages(bool on);
bool HostHugePages();

// Maps the pages of a fresh allocation [p, p + bytes) in one call (MADV_POPULATE_WRITE), after
// MADV_HUGEPAGE, or with huge_pages false after MADV_NOHUGEPAGE (4 KiB pages even where the THP
// mode is "always"), whatever its size. Best effort: kernels without these advices (Linux <
// 5.14) fault the pages in on first touch as before.
PageMapping MapPagesNow(void* p, size_t bytes, bool huge_pages = true);

// The bytes an allocation of `bytes` through MappedAllocator takes.
inline size_t MappedBytes(size_t bytes) {
  return bytes < kMappedAllocationBytes
             ? bytes
             : (bytes + kMappedAllocationBytes - 1) / kMappedAllocationBytes *
                   kMappedAllocationBytes;
}

// A std::allocator whose large allocations (MappedBytes) are 2 MiB-aligned and mapped now, in
// huge pages unless HostHugePages() is off.
template <typename T>
struct MappedAllocator {
  using value_type = T;
  MappedAllocator() = default;
  template <typename U>
  MappedAllocator(const MappedAllocator<U>&) {}  // NOLINT: rebinding, as std::allocator

  T* allocate(size_t n) {
    const size_t bytes = n * sizeof(T);
    if (bytes < kMappedAllocationBytes) return std::allocator<T>().allocate(n);
    void* p = ::operator new(MappedBytes(bytes), std::align_val_t{kMappedAllocationBytes});
    MapPagesNow(p, MappedBytes(bytes), HostHugePages());
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t n) {
    const size_t bytes = n * sizeof(T);
    if (bytes < kMappedAllocationBytes) {
      std::allocator<T>().deallocate(p, n);
    } else {
      // The unsized aligned form: clang (the fuzz and sanitizer builds) leaves sized
      // deallocation off unless asked.
      ::operator delete(p, std::align_val_t{kMappedAllocationBytes});
    }
  }
  friend bool operator==(const MappedAllocator&, const MappedAllocator&) { return true; }
};

template <typename T>
using MappedVector = std::vector<T, MappedAllocator<T>>;

// The bytes a MappedVector's buffer takes.
template <typename T>
int64_t MappedCapacityBytes(const MappedVector<T>& v) {
  return static_cast<int64_t>(MappedBytes(v.capacity() * sizeof(T)));
}

}  // namespace kvrecall::cpu

#endif  // KVRECALL_KERNELS_CPU_MAPPED_MEMORY_H_
