// ThreadSanitizer annotations for Debian's uninstrumented Abseil: absl::Mutex is implemented in
// libabsl_synchronization.so, which TSan cannot see into, so every access guarded by an
// absl::Mutex would look like a race. scripts/sanitize.sh links this file into every binary of
// the TSan build with -Wl,--wrap=SYMBOL for each symbol below (the list is in
// tests/sanitizers/absl_mutex_wrap.txt): each call from the project's code then tells TSan that
// the mutex was taken or released, the way Abseil's own ABSL_TSAN_MUTEX_* annotations would in
// an instrumented build.
//
// Conditions (absl::Condition) are evaluated inside the library, sometimes by the thread that
// releases the mutex on behalf of a waiter; their reads are ignored (conditions only read), so
// that they do not show up as races outside the lock.
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

extern "C" {
// The TSan runtime's mutex and ignore interfaces (sanitizer/tsan_interface.h and dynamic
// annotations).
void __tsan_mutex_pre_lock(void* addr, unsigned flags);
void __tsan_mutex_post_lock(void* addr, unsigned flags, int recursion);
int __tsan_mutex_pre_unlock(void* addr, unsigned flags);
void __tsan_mutex_post_unlock(void* addr, unsigned flags);
void __tsan_mutex_destroy(void* addr, unsigned flags);
void AnnotateIgnoreReadsBegin(const char* file, int line);
void AnnotateIgnoreReadsEnd(const char* file, int line);
}

namespace {

constexpr unsigned kReadLock = 1 << 3;    // __tsan_mutex_read_lock
constexpr unsigned kTryLock = 1 << 4;     // __tsan_mutex_try_lock
constexpr unsigned kTryFailed = 1 << 5;   // __tsan_mutex_try_lock_failed

void Acquired(void* mu, unsigned flags) {
  __tsan_mutex_pre_lock(mu, flags);
  __tsan_mutex_post_lock(mu, flags, 0);
}
void Released(void* mu, unsigned flags) {
  __tsan_mutex_pre_unlock(mu, flags);
  __tsan_mutex_post_unlock(mu, flags);
}

// Runs a library call during which conditions may be evaluated, their reads ignored.
template <typename F>
auto Quietly(F f) {
  AnnotateIgnoreReadsBegin(__FILE__, __LINE__);
  auto result = f();
  AnnotateIgnoreReadsEnd(__FILE__, __LINE__);
  return result;
}

// Abseil's deadlock detection is off in this build. Debian builds Abseil without NDEBUG, so every
// Mutex::Lock runs it: a global graph of lock ids (libabsl_graphcycles_internal), kept under
// an Abseil SpinLock that TSan cannot see, so each of its memcpy/free calls read as a race with
// the last thread's (thousands of reports per test, none of them the project's). TSan's own
// lock-order detector (detect_deadlocks, on by default) still sees every absl::Mutex taken by
// the project's code through the annotations above, so lock-order inversions are still found.
// A static initializer here runs in every binary these wrappers are linked into, before main.
const bool kAbslDeadlockDetectionOff = [] {
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  return true;
}();

}  // namespace

using absl::Condition;
using absl::Duration;
using absl::Mutex;
using absl::Time;

// The real functions (the linker resolves __real_X to X) and their wrappers.
#define KVRECALL_WRAP(ret, sym, params, args, body) \
  extern "C" ret __real_##sym params;               \
  extern "C" ret __wrap_##sym params body

// void Mutex::Lock() / ReaderLock()
KVRECALL_WRAP(void, _ZN4absl7debian35Mutex4LockEv, (Mutex * mu), (mu), {
  __tsan_mutex_pre_lock(mu, 0);
  Quietly([&] { __real__ZN4absl7debian35Mutex4LockEv(mu); return 0; });
  __tsan_mutex_post_lock(mu, 0, 0);
})
KVRECALL_WRAP(void, _ZN4absl7debian35Mutex10ReaderLockEv, (Mutex * mu), (mu), {
  __tsan_mutex_pre_lock(mu, kReadLock);
  Quietly([&] { __real__ZN4absl7debian35Mutex10ReaderLockEv(mu); return 0; });
  __tsan_mutex_post_lock(mu, kReadLock, 0);
})
// void Mutex::Unlock() / ReaderUnlock(): the release happens before waiters' conditions run.
KVRECALL_WRAP(void, _ZN4absl7debian35Mutex6UnlockEv, (Mutex * mu), (mu), {
  __tsan_mutex_pre_unlock(mu, 0);
  Quietly([&] { __real__ZN4absl7debian35Mutex6UnlockEv(mu); return 0; });
  __tsan_mutex_post_unlock(mu, 0);
})
KVRECALL_WRAP(void, _ZN4absl7debian35Mutex12ReaderUnlockEv, (Mutex * mu), (mu), {
  __tsan_mutex_pre_unlock(mu, kReadLock);
  Quietly([&] { __real__ZN4absl7debian35Mutex12ReaderUnlockEv(mu); return 0; });
  __tsan_mutex_post_unlock(mu, kReadLock);
})
// bool Mutex::TryLock() / ReaderTryLock()
KVRECALL_WRAP(bool, _ZN4absl7debian35Mutex7TryLockEv, (Mutex * mu), (mu), {
  __tsan_mutex_pre_lock(mu, kTryLock);
  const bool locked = __real__ZN4absl7debian35Mutex7TryLockEv(mu);
  __tsan_mutex_post_lock(mu, kTryLock | (locked ? 0 : kTryFailed), 0);
  return locked;
})
KVRECALL_WRAP(bool, _ZN4absl7debian35Mutex13ReaderTryLockEv, (Mutex * mu), (mu), {
  __tsan_mutex_pre_lock(mu, kTryLock | kReadLock);
  const bool locked = __real__ZN4absl7debian35Mutex13ReaderTryLockEv(mu);
  __tsan_mutex_post_lock(mu, kTryLock | kReadLock | (locked ? 0 : kTryFailed), 0);
  return locked;
})
// Mutex::Await*(): the mutex is released while waiting and held again on return.
KVRECALL_WRAP(void, _ZN4absl7debian35Mutex5AwaitERKNS0_9ConditionE,
              (Mutex * mu, const Condition& c), (mu, c), {
  Released(mu, 0);
  Quietly([&] { __real__ZN4absl7debian35Mutex5AwaitERKNS0_9ConditionE(mu, c); return 0; });
  Acquired(mu, 0);
})
KVRECALL_WRAP(bool, _ZN4absl7debian35Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE,
              (Mutex * mu, const Condition& c, Duration d), (mu, c, d), {
  Released(mu, 0);
  const bool r = Quietly([&] {
    return __real__ZN4absl7debian35Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE(mu, c,
                                                                                           d);
  });
  Acquired(mu, 0);
  return r;
})
KVRECALL_WRAP(bool, _ZN4absl7debian35Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE,
              (Mutex * mu, const Condition& c, Time t), (mu, c, t), {
  Released(mu, 0);
  const bool r = Quietly([&] {
    return __real__ZN4absl7debian35Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE(mu, c, t);
  });
  Acquired(mu, 0);
  return r;
})
// Mutex::LockWhen*(): a lock taken once the condition holds.
KVRECALL_WRAP(void, _ZN4absl7debian35Mutex8LockWhenERKNS0_9ConditionE,
              (Mutex * mu, const Condition& c), (mu, c), {
  Quietly([&] { __real__ZN4absl7debian35Mutex8LockWhenERKNS0_9ConditionE(mu, c); return 0; });
  Acquired(mu, 0);
})
KVRECALL_WRAP(void, _ZN4absl7debian35Mutex14ReaderLockWhenERKNS0_9ConditionE,
              (Mutex * mu, const Condition& c), (mu, c), {
  Quietly([&] {
    __real__ZN4absl7debian35Mutex14ReaderLockWhenERKNS0_9ConditionE(mu, c);
    return 0;
  });
  Acquired(mu, kReadLock);
})
KVRECALL_WRAP(bool, _ZN4absl7debian35Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE,
              (Mutex * mu, const Condition& c, Duration d), (mu, c, d), {
  const bool r = Quietly([&] {
    return __real__ZN4absl7debian35Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE(
        mu, c, d);
  });
  Acquired(mu, 0);
  return r;
})
KVRECALL_WRAP(bool, _ZN4absl7debian35Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE,
              (Mutex * mu, const Condition& c, Time t), (mu, c, t), {
  const bool r = Quietly([&] {
    return __real__ZN4absl7debian35Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE(mu, c,
                                                                                           t);
  });
  Acquired(mu, 0);
  return r;
})
// Mutex::~Mutex()
KVRECALL_WRAP(void, _ZN4absl7debian35MutexD1Ev, (Mutex * mu), (mu), {
  __tsan_mutex_destroy(mu, 0);
  __real__ZN4absl7debian35MutexD1Ev(mu);
})
