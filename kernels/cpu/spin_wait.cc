#include "kernels/cpu/spin_wait.h"

#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace kvrecall::cpu {

void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#endif
}

void YieldCore() { sched_yield(); }

void FutexWait(std::atomic<uint32_t>* word, uint32_t seen, FutexScope scope,
               const timespec* timeout) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word),
          scope == FutexScope::kProcess ? FUTEX_WAIT_PRIVATE : FUTEX_WAIT, seen, timeout, nullptr,
          0);
}

void FutexWake(std::atomic<uint32_t>* word, int count, FutexScope scope) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word),
          scope == FutexScope::kProcess ? FUTEX_WAKE_PRIVATE : FUTEX_WAKE, count, nullptr,
          nullptr, 0);
}

}  // namespace kvrecall::cpu
