#include "kernels/cpu/mapped_memory.h"

#include <sys/mman.h>
#include <unistd.h>

namespace kvrecall::cpu {

void MapPagesNow(void* p, size_t bytes) {
  if (bytes < kMappedAllocationBytes) return;
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

}  // namespace kvrecall::cpu
