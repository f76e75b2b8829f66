// ThreadSanitizer's view of gRPC (scripts/sanitize.sh tsan). Debian's gRPC is not instrumented,
// so TSan cannot see the order gRPC guarantees between two pieces of the project's code that it
// runs, often on different threads: a reactor's reaction (OnReadDone, OnWriteDone, OnCancel,
// OnDone) after the call that started it (StartRead, StartWrite, Finish, or the handler that made
// the reactor); an interceptor's hook points one after another and its deletion after the last;
// Server::Wait's return after every call has ended. Every field read on the later side would
// look like a race with the earlier one. In a TSan build, the earlier side announces the
// hand-off just before it gives the object to gRPC (HandoffToGrpc: a release on `object`), and
// the later side takes it first thing (ReactionFromGrpc: an acquire on the same address): the
// order gRPC's API guarantees, and no more. A reaction other than OnDone also hands the object
// back when it returns (GrpcReaction), since gRPC runs OnDone only after every other reaction
// has returned. Used by the server's reactors and the client's (client/kvrecall_client.cc).
// Elsewhere all of it is empty.
#ifndef KVRECALL_PROTO_TSAN_HANDOFF_H_
#define KVRECALL_PROTO_TSAN_HANDOFF_H_

#if defined(__SANITIZE_THREAD__)
#define KVRECALL_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define KVRECALL_TSAN 1
#endif
#endif
#ifdef KVRECALL_TSAN
#include <atomic>
#include <thread>

extern "C" void __tsan_acquire(void* addr);
extern "C" void __tsan_release(void* addr);
#endif

namespace kvrecall {

inline void HandoffToGrpc([[maybe_unused]] const void* object) {
#ifdef KVRECALL_TSAN
  __tsan_release(const_cast<void*>(object));
#endif
}

inline void ReactionFromGrpc([[maybe_unused]] const void* object) {
#ifdef KVRECALL_TSAN
  __tsan_acquire(const_cast<void*>(object));
#endif
}

// A reaction that hands what it wrote to an application thread waiting for it through a
// primitive TSan cannot see into either (absl::Notification: its mutex is inside Debian's
// uninstrumented Abseil): the reaction calls HandoffToWaiter just before it notifies, the waiter
// TakeFromReaction just after its wait returns.
inline void HandoffToWaiter(const void* object) { HandoffToGrpc(object); }
inline void TakeFromReaction(const void* object) { ReactionFromGrpc(object); }

// A call from gRPC into an object it holds, for the call's whole body: a reactor's reaction
// other than OnDone, an auth processor's Process. Takes the object from gRPC first and hands it
// back on return (OnDone follows every reaction's return, the processor's destruction its last
// Process; the object is alive until then, so the hand-back never touches a deleted one).
class GrpcReaction {
 public:
  explicit GrpcReaction(const void* reactor) : reactor_(reactor) { ReactionFromGrpc(reactor); }
  ~GrpcReaction() { HandoffToGrpc(reactor_); }
  GrpcReaction(const GrpcReaction&) = delete;
  GrpcReaction& operator=(const GrpcReaction&) = delete;

 private:
  const void* const reactor_;
};

// An operation a reactor starts outside its own lock (DecodeCall's StartWrite: under the lock,
// a completion on another gRPC thread would wait for it). gRPC completes it only after the start
// has returned, but the start's own writes into gRPC's operation objects (header code, so
// instrumented) come after the HandoffToGrpc before it, and its completion runs on another
// thread than the next start: every such pair of starts would read as a race. In a TSan build,
// Started() marks the start's return, and Completed(), first thing in the completion's reaction,
// waits for that mark (the few instructions between the start's return and the mark at most),
// so TSan sees the order gRPC keeps; elsewhere both are empty. Every start of the kind must be
// followed by Started(), or its completion would wait forever.
class GrpcStartOutsideLock {
 public:
  void Started() {
#ifdef KVRECALL_TSAN
    started_.store(true, std::memory_order_release);
#endif
  }
  void Completed() {
#ifdef KVRECALL_TSAN
    while (!started_.exchange(false, std::memory_order_acquire)) std::this_thread::yield();
#endif
  }

 private:
#ifdef KVRECALL_TSAN
  std::atomic<bool> started_{false};
#endif
};

}  // namespace kvrecall

#endif  // KVRECALL_PROTO_TSAN_HANDOFF_H_
