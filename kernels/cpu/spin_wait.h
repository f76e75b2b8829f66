// Waiting for a 32-bit word that another thread or process changes: poll on the core, then
// yield it, then sleep in futex(2). Shared by the compute pool (kernels/cpu/thread_pool.h) and
// the shared-memory Decode region (proto/shared_decode_region.h).
#ifndef KVRECALL_KERNELS_CPU_SPIN_WAIT_H_
#define KVRECALL_KERNELS_CPU_SPIN_WAIT_H_

#include <time.h>

#include <atomic>
#include <chrono>
#include <cstdint>

namespace kvrecall::cpu {

// A spinning thread's pause (x86's PAUSE): lets the sibling hyperthread run.
void CpuRelax();
// sched_yield(2): lets a runnable thread of this core (the peer, on a busy machine) run.
void YieldCore();

// Whom a futex word is shared with: this process's threads (FUTEX_PRIVATE_FLAG, cheaper) or
// other processes that map the same file (MAP_SHARED).
enum class FutexScope { kProcess, kShared };
// Sleeps while *word holds `seen`, for at most `timeout` (null: until woken).
void FutexWait(std::atomic<uint32_t>* word, uint32_t seen, FutexScope scope,
               const timespec* timeout = nullptr);
// Wakes up to `count` sleepers of `word`.
void FutexWake(std::atomic<uint32_t>* word, int count, FutexScope scope);

// Polls ready() until it holds or `spin` has passed; returns its last value. The clock is read
// every 64 polls (a poll costs a few ns, the clock tens). Past the first 1024 polls (a few µs)
// each poll yields the core: on a machine with no core to spare the thread being waited for
// may need this one, and spinning would only delay it.
template <typename Ready>
bool PollUntil(std::chrono::nanoseconds spin, const Ready& ready) {
  if (ready()) return true;
  const auto end = std::chrono::steady_clock::now() + spin;
  for (int i = 1;; ++i) {
    CpuRelax();
    if (ready()) return true;
    if (i % 64 == 0 && std::chrono::steady_clock::now() >= end) return false;
    if (i > 1024) YieldCore();
  }
}

}  // namespace kvrecall::cpu

#endif  // KVRECALL_KERNELS_CPU_SPIN_WAIT_H_
