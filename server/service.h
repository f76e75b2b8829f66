// The gRPC service kvrecall.v1.KvRecall on gRPC's callback API: sessions, Prefill streams and
// Decode streams over a SessionRegistry. An open gRPC stream holds no thread (a DecodeShared
// stream holds one of its own); the compute of every call runs on the service's own work
// queues, so gRPC's threads stay free for I/O and health checks under any load, except for a
// bounded number of Decode steps at once (ServiceOptions::inline_steps), which run on the gRPC
// thread that read them. Messages are taken raw (server/raw_messages.h) so that an undecodable
// message gets INVALID_ARGUMENT and changes nothing.
#ifndef KVRECALL_SERVER_SERVICE_H_
#define KVRECALL_SERVER_SERVICE_H_

#include <atomic>
#include <functional>
#include <memory>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/server_callback.h"
#include "kvrecall/v1/kvrecall.grpc.pb.h"
#include "server/auth.h"
#include "server/session.h"
#include "server/work_queue.h"

namespace kvrecall {

// Points inside the service's calls where a test acts, on the thread that serves the call: to
// cancel a call at an instant no client could aim at. Unset in kvrecalld.
struct ServiceTestHooks {
  // Once CreateSession's handler has made the session, before the call is answered.
  std::function<void()> after_create_session;
  // On the build queue, before a Prefill stream's commit starts its builds.
  std::function<void()> before_prefill_commit;
  // Run right after a Prefill's commit installed its layers, before the call is answered (on
  // the build queue's thread).
  std::function<void()> after_prefill_install;
  // Asked when a Prefill call is done (its OnDone) after its commit was answered OK: true makes
  // the call's status count as lost, as when gRPC cancels the call before the OK goes out, so
  // that what the commit installed is taken back (a race gRPC alone gives only by chance). The
  // call is still counted by what gRPC says (OK here, CANCELLED where gRPC lost it).
  std::function<bool()> prefill_answer_lost;
  // Asked right after a Prefill's commit installed its layers (after after_prefill_install):
  // true makes the run find the call's deadline passed there, as when the builds outlast it
  // and gRPC's own cancellation has not come yet (its threads busy), so that the run takes
  // what it installed back and answers DEADLINE_EXCEEDED (a race gRPC alone gives by chance).
  std::function<bool()> prefill_deadline_passed_at_install;
  // Run as a call is identified against the token table, after the auth processor accepted
  // its token: a test reloads the table here, the race a reload between the two meets by chance.
  std::function<void()> before_call_identified;
  // Run before each decode step is applied (Decode and DecodeShared), given a function that
  // tells whether the call has been cancelled: a test holds a step here to play a wedged
  // server, until its client gives up (a deadline, a cancellation).
  std::function<void(const std::function<bool()>& cancelled)> before_decode_step;
};

struct ServiceOptions {
  // Threads that serve decode steps, prompt chunks and the short unary calls (FIFO, so every
  // stream gets its turn); 0: one per hardware thread.
  int worker_threads = 0;
  // Decode steps that may run at once on the gRPC thread that read them, saving the hand-off
  // to worker_threads (a thread wake-up per step); further steps queue for worker_threads.
  // Bounded so that gRPC's threads stay free for I/O and health checks. -1: a quarter of the
  // hardware threads, at least 1; 0: every step queues.
  int inline_steps = -1;
  // Decode and Prefill streams record their calls (status code, duration), and Decode each
  // request's latency from its arrival to its reply, into the registry's ServerMetrics: the part
  // of the RPC metrics that server/rpc_metrics_interceptor.h leaves to the service. On when
  // metrics are served.
  bool stream_call_metrics = false;
  // DecodeShared (kvrecall.proto): the directory where shared-memory regions are created, one
  // file per stream, removed when it ends; a runner on the same host must be able to open its
  // files (same user; a pod's shared emptyDir). Empty: DecodeShared answers FAILED_PRECONDITION.
  std::string shared_memory_dir;
  // Shared streams open at once; each holds a thread of its own while it lives.
  int max_shared_streams = 16;
  // Of them, at most this many of one tenant (without tokens every caller is the one tenant
  // ""), so that no tenant takes every slot; 0: no limit but max_shared_streams.
  int max_shared_streams_per_tenant = 0;
  // How long a shared stream's thread polls for the next request before it sleeps (a futex
  // wake-up then costs the runner a system call and the step a scheduler wake-up).
  absl::Duration shared_memory_spin = absl::Microseconds(100);
  // The largest message either way (the gRPC limit), and the most a DecodeShared region's
  // capacities may be (4 MiB each way unless the runner asks for more).
  int64_t max_message_bytes = 64ll << 20;
  ServiceTestHooks test_hooks;
};

// Every method of kvrecall.v1.KvRecall, raw and callback-based.
using KvRecallRawCallbackService = v1::KvRecall::WithRawCallbackMethod_CreateSession<
    v1::KvRecall::WithRawCallbackMethod_Prefill<v1::KvRecall::WithRawCallbackMethod_Decode<
        v1::KvRecall::WithRawCallbackMethod_DecodeShared<
            v1::KvRecall::WithRawCallbackMethod_GetSession<
                v1::KvRecall::WithRawCallbackMethod_ListSessions<
                    v1::KvRecall::WithRawCallbackMethod_CloseSession<v1::KvRecall::Service>>>>>>>;

class KvRecallService final : public KvRecallRawCallbackService {
 public:
  KvRecallService(SessionRegistry* registry, const ServiceOptions& options);
  // The gRPC server using the service must have shut down (every call is done).
  ~KvRecallService() override;

  // The tokens whose tenants own sessions (--auth_token_file; null: no tenants). Set before the
  // server starts, read by every call after (the store's table may be replaced meanwhile).
  void SetTokens(std::shared_ptr<const TokenStore> tokens) { tokens_ = std::move(tokens); }

  // Who a stream acts for: its tenant, and the bearer token that named it, checked again on
  // each request once the token file has been reloaded (StillAuthorized), so that a token
  // revoked by a reload stops the streams open with it too.
  struct CallIdentity {
    std::string tenant;
    std::string token;
    uint64_t epoch = 0;  // TokenStore::epoch() of the last check
  };
  CallIdentity IdentityOf(const grpc::ServerContextBase& context) const;
  // OK while the identity's token still names its tenant; UNAUTHENTICATED once a reload took
  // the token away (or gave it to another tenant).
  absl::Status StillAuthorized(CallIdentity& identity) const;
  // Whether the token table in force no longer gives the identity's token its tenant.
  bool Revoked(const CallIdentity& identity) const;
  // After the token file was reloaded: every open stream whose token it revoked ends now if it
  // is idle (UNAUTHENTICATED), else at its next request; an idle stream of a revoked token held
  // its slot (a DecodeShared one of --max_shared_streams) until its client sent again, which
  // one that wants the slot never does (probe 26, 3).
  void TokensReloaded();

  // The first step of a drain: from now on new calls, new Decode steps and new Prefill chunks
  // get UNAVAILABLE; a step or chunk in flight finishes (a Decode step's reply is sent with the
  // stream's UNAVAILABLE status), idle streams end at once. Idempotent.
  void StartDrain();
  bool draining() const { return draining_.load(std::memory_order_acquire); }
  // Waits until no call is open (streams and unary calls), or until `deadline`; true if none is.
  bool AwaitIdle(absl::Time deadline) const;
  // Whether work is queued or running on the service's threads (possibly for calls that were
  // cancelled: their results are dropped).
  bool busy() const {
    return steps_.active() + builds_.active() + frees_.active() +
               inline_steps_.load(std::memory_order_acquire) >
           0;
  }
  // Prefill commits (selector builds) queued or running.
  int builds_in_flight() const { return builds_.active(); }
  // Frees of layers taken back from a Prefill whose OK was lost, queued or running.
  int frees_in_flight() const { return frees_.active(); }

  // Decode and Prefill streams open right now.
  int open_streams() const;
  int worker_threads() const { return steps_.threads(); }
  // RESOURCE_EXHAUSTED when the system refused some of the service's threads.
  absl::Status ThreadsStarted() const {
    for (const WorkQueue* queue : {&steps_, &builds_, &frees_}) {
      if (!queue->status().ok()) return queue->status();
    }
    return absl::OkStatus();
  }

  grpc::ServerUnaryReactor* CreateSession(grpc::CallbackServerContext* context,
                                          const grpc::ByteBuffer* request,
                                          grpc::ByteBuffer* response) override;
  grpc::ServerReadReactor<grpc::ByteBuffer>* Prefill(grpc::CallbackServerContext* context,
                                                     grpc::ByteBuffer* response) override;
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Decode(
      grpc::CallbackServerContext* context) override;
  grpc::ServerWriteReactor<grpc::ByteBuffer>* DecodeShared(grpc::CallbackServerContext* context,
                                                           const grpc::ByteBuffer* request) override;
  grpc::ServerUnaryReactor* GetSession(grpc::CallbackServerContext* context,
                                       const grpc::ByteBuffer* request,
                                       grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ListSessions(grpc::CallbackServerContext* context,
                                         const grpc::ByteBuffer* request,
                                         grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* CloseSession(grpc::CallbackServerContext* context,
                                         const grpc::ByteBuffer* request,
                                         grpc::ByteBuffer* response) override;

 private:
  // A CreateSession answered CANCELLED while its handler ran (the client cancelled, or its
  // deadline passed): the session it made, whose id the client was not sent, is closed again
  // (a ListSessions in the meantime may have listed it).
  void UndoCreateSession(absl::string_view tenant, const v1::CreateSessionResponse& response);

  // The unary methods' logic, on typed messages (run on a work queue).
  // The gRPC status of a call's or a step's outcome; a refusal by a limit (RefusedLimit) is
  // counted in the metrics on the way.
  grpc::Status Answer(const absl::Status& status);

  // `tenant` is the caller's (server/auth.h's TenantOf).
  absl::Status DoCreateSession(absl::string_view tenant, const v1::CreateSessionRequest& request,
                               v1::CreateSessionResponse* response);
  absl::Status DoGetSession(absl::string_view tenant, const v1::GetSessionRequest& request,
                            v1::SessionInfo* response);
  absl::Status DoListSessions(absl::string_view tenant, const v1::ListSessionsRequest& request,
                              v1::ListSessionsResponse* response);
  absl::Status DoCloseSession(absl::string_view tenant, const v1::CloseSessionRequest& request,
                              v1::CloseSessionResponse* response);

  // A Decode or Prefill stream, as the drain and the sessions' closing see it.
  class Stream {
   public:
    // Ends the stream with UNAVAILABLE when it is idle; otherwise after the work in flight.
    virtual void Drain() = 0;
    // The token file was reloaded: a stream whose token it revoked ends with UNAUTHENTICATED
    // when it is idle (at work, its next request is refused by StillAuthorized).
    virtual void TokensReloaded() = 0;
    // Some session closed: a stream that holds memory for one that did (a Prefill stream's
    // staged prompt) and is waiting for its client ends now, with the NOT_FOUND its next
    // message would get (a stream at work meets the closed session itself). Returns what it
    // let go of (null: nothing), for the caller to destroy once it holds no lock: freeing a
    // staged prompt may take long (unmapping it, or a device's free).
    virtual std::shared_ptr<void> OnSessionsClosed() { return nullptr; }

   protected:
    ~Stream() = default;
  };

  template <typename Request, typename Response>
  class UnaryCall;
  template <typename Reactor, typename Call>
  class StreamCall;
  class PrefillCall;
  class DecodeCall;
  class SharedDecodeCall;

  // `undo` (may be null): what undoes a successful handler whose call was answered CANCELLED
  // while it ran.
  template <typename Request, typename Response>
  grpc::ServerUnaryReactor* StartUnary(
      grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
      grpc::ByteBuffer* response,
      absl::Status (KvRecallService::*handler)(absl::string_view, const Request&, Response*),
      void (KvRecallService::*undo)(absl::string_view, const Response&) = nullptr);

  // Streams register while open, so that StartDrain reaches them. Register returns false when
  // the drain has begun (the stream must then end with UNAVAILABLE). Unary calls are counted.
  bool Register(Stream* stream);
  void Unregister(Stream* stream);
  // The registry's closed listener: tells every open stream (Stream::OnSessionsClosed).
  void TellStreamsSessionsClosed();
  void CountUnary(int delta);
  // A slot to run a Decode step on gRPC's thread (ServiceOptions::inline_steps); false: queue it.
  bool TakeInlineStep();
  void ReturnInlineStep();
  // A DecodeShared slot for `tenant`: RESOURCE_EXHAUSTED naming the limit when the server's
  // (max_shared_streams) or the tenant's (max_shared_streams_per_tenant) are all taken.
  absl::Status TakeSharedSlot(const std::string& tenant);
  void ReturnSharedSlot(const std::string& tenant);

  SessionRegistry* registry_;
  std::shared_ptr<const TokenStore> tokens_;  // SetTokens'

  std::atomic<bool> draining_{false};
  mutable absl::Mutex calls_mu_;
  absl::flat_hash_set<Stream*> streams_ ABSL_GUARDED_BY(calls_mu_);
  int unary_calls_ ABSL_GUARDED_BY(calls_mu_) = 0;
  // (Before the queues, so that they outlive every run: a commit's run may outlast its call,
  // and reads the test hooks.)
  const ServiceOptions options_;
  // Where Decode and Prefill streams count their calls (ServiceOptions::stream_call_metrics,
  // which turns both on); null: nowhere.
  MethodMetrics* const decode_calls_;
  MethodMetrics* const prefill_calls_;
  // Frees the layers a Prefill's OnDone took back (review 17c, 3; review 18, 1): off gRPC's
  // thread, and behind no selector build (those queue for seconds), so that their memory is
  // back promptly. One thread; declared before the other queues, which it outlives.
  WorkQueue frees_;
  WorkQueue steps_;
  WorkQueue builds_;
  const int max_inline_steps_;
  std::atomic<int> inline_steps_{0};
  // DecodeShared slots taken, in all and by tenant (max_shared_streams and
  // max_shared_streams_per_tenant).
  absl::Mutex shared_slots_mu_;
  int shared_streams_ ABSL_GUARDED_BY(shared_slots_mu_) = 0;
  absl::flat_hash_map<std::string, int> shared_streams_of_ ABSL_GUARDED_BY(shared_slots_mu_);
};

// The status of work refused because the server is draining.
grpc::Status ShuttingDownStatus();

}  // namespace kvrecall

#endif  // KVRECALL_SERVER_SERVICE_H_
