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
// has returned. Elsewhere all of it is empty.
#ifndef KVRECALL_SERVER_TSAN_HANDOFF_H_
#define KVRECALL_SERVER_TSAN_HANDOFF_H_

#if defined(__SANITIZE_THREAD__)
#define KVRECALL_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define KVRECALL_TSAN 1
#endif
#endif
#ifdef KVRECALL_TSAN
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

}  // namespace kvrecall

#endif  // KVRECALL_SERVER_TSAN_HANDOFF_H_
