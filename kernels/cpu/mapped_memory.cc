#include "kernels/cpu/mapped_memory.h"

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>

namespace kvrecall::cpu {
namespace {

std::atomic<bool> huge_pages_on{true};

}  // namespace

void SetHostHugePages(bool on) { huge_pages_on.store(on, std::memory_order_relaxed); }
bool HostHugePages() { return huge_pages_on.load(std::memory_order_relaxed); }

PageMapping MapPagesNow(void* p, size_t bytes, bool huge_pages) {
  PageMapping mapping;
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + page - 1) & ~(page - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + bytes) & ~(page - 1);
  if (end <= begin) return mapping;
  void* const start = reinterpret_cast<void*>(begin);
#ifdef MADV_HUGEPAGE
  mapping.huge_pages_advised =
      madvise(start, end - begin, huge_pages ? MADV_HUGEPAGE : MADV_NOHUGEPAGE) == 0 &&
      huge_pages;
#endif
#ifndef MADV_POPULATE_WRITE
  constexpr int MADV_POPULATE_WRITE = 23;  // <linux/mman.h>, Linux 5.14
#endif
  if (madvise(start, end - begin, MADV_POPULATE_WRITE) != 0) mapping.populate_errno = errno;
  return mapping;
}

}  // namespace kvrecall::cpu
