#include "server/service.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "proto/shared_decode_region.h"
#include "proto/tsan_handoff.h"  // HandoffToGrpc, ReactionFromGrpc: what TSan cannot see in gRPC
#include "server/auth.h"
#include "server/decode.h"
#include "server/prefill.h"
#include "server/raw_messages.h"
#include "server/rpc_metrics_interceptor.h"
#include "server/status_util.h"

namespace kvrecall {
namespace {

int ThreadsOrDefault(int threads, int fallback) {
  if (threads > 0) return threads;
  return std::max(1, fallback);
}

// Whether gRPC's peer string names a caller on this host: a Unix socket ("unix:", either kind)
// or a loopback address ("ipv4:127.0.0.1:5000"; gRPC 1.51 prints IPv6 URL-encoded,
// "ipv6:%5B::1%5D:5000", and an IPv4-mapped one as ipv4; review 23 found [::1] refused).
bool IsLocalPeer(absl::string_view peer) {
  return absl::StartsWith(peer, "unix:") || absl::StartsWith(peer, "unix-abstract:") ||
         absl::StartsWith(peer, "ipv4:127.") || absl::StartsWith(peer, "ipv6:%5B::1%5D:") ||
         absl::StartsWith(peer, "ipv6:[::1]:");
}

// How a stream of a revoked token ends when the reload finds it idle (TokensReloaded).
grpc::Status RevokedWhileIdleStatus() {
  return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                      "this stream's bearer token was revoked (the token file was reloaded) "
                      "while it waited for its next request");
}

// How a call ends whose token the auth processor accepted but whose tenant lookup, an instant
// later, no longer found it (a reload in between): the no-tenant identity owns nothing, and a
// call under it would only meet NOT_FOUND (review 23), so it is refused by name.
absl::Status TokenReloadedAtCallStartStatus() {
  return absl::UnauthenticatedError(
      "this call's bearer token is no longer valid (the token file was reloaded as the call "
      "started); nothing was applied");
}

grpc::Status CancelledStatus() {
  return grpc::Status(grpc::StatusCode::CANCELLED,
                      "the call was cancelled (by the client, or its deadline passed)");
}

// A call's deadline on the steady clock (max() without one): immune to the wall clock's steps,
// and read where gRPC's context may be gone.
std::chrono::steady_clock::time_point SteadyDeadline(
    std::chrono::system_clock::time_point deadline) {
  if (deadline == std::chrono::system_clock::time_point::max()) {
    return std::chrono::steady_clock::time_point::max();
  }
  return std::chrono::steady_clock::now() + (deadline - std::chrono::system_clock::now());
}

grpc::Status DeadlinePassedStatus() {
  return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                      "the call's deadline passed before the server answered it");
}

// Shared ownership of a call object between gRPC (until OnDone) and the work queue (while an
// item is queued or running): whoever lets go last deletes it.
template <typename Call>
class CallRefs {
 public:
  void Ref() { refs_.fetch_add(1, std::memory_order_relaxed); }
  void Unref(Call* call) {
    if (refs_.fetch_sub(1, std::memory_order_acq_rel) == 1) delete call;
  }

 private:
  std::atomic<int> refs_{1};
};

}  // namespace

grpc::Status ShuttingDownStatus() {
  return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                      "kvrecalld is shutting down: this call or step was not served (steps "
                      "answered before were committed); retry on another server");
}

// ---------------------------------------------------------------------------------------------
// Unary calls: parsed on gRPC's thread, served on the step queue, answered unless the call was
// cancelled first. Once it is finished nothing of gRPC's call is touched but, in OnDone, the
// context's IsCancelled (whether the answer reached the client).

template <typename Request, typename Response>
class KvRecallService::UnaryCall final : public grpc::ServerUnaryReactor, public WorkItem {
 public:
  using Handler = absl::Status (KvRecallService::*)(absl::string_view, const Request&, Response*);
  using Undo = void (KvRecallService::*)(absl::string_view, const Response&);

  UnaryCall(KvRecallService* service, grpc::CallbackServerContext* context,
            grpc::ByteBuffer* reply, Handler handler, Undo undo, std::string tenant)
      : service_(service),
        context_(context),
        deadline_(SteadyDeadline(context->deadline())),
        reply_(reply),
        handler_(handler),
        undo_(undo),
        tenant_(std::move(tenant)) {
    service_->CountUnary(1);
  }

  // In the handler: gRPC reacts (OnCancel, OnDone, even to a Finish here) only once the handler
  // has returned, so all of Start, the unlock of mu_ included, comes before any reaction.
  void Start(const grpc::ByteBuffer* request) {
    StartInHandler(request);
    HandoffToGrpc(this);
  }

  void Run() override {
    bool skip;
    {
      absl::MutexLock lock(&mu_);
      skip = finished_;
    }
    grpc::Status status;
    bool made = false;  // the handler ran and succeeded
    if (!skip) {
      if (service_->draining()) {
        status = ShuttingDownStatus();
      } else if (Expired()) {
        status = DeadlinePassedStatus();  // queued past it: the client has given up
      } else if (tenant_ == kNoTenant) {
        status = service_->Answer(TokenReloadedAtCallStartStatus());
      } else {
        status = service_->Answer((service_->*handler_)(tenant_, request_, &response_));
        made = status.ok();
      }
    }
    if (made && undo_ != nullptr && Expired()) {
      // The deadline passed while the handler ran: gRPC drops a late answer (its OnCancel may
      // come much later, its threads busy), so what the call made is undone before it answers.
      (service_->*undo_)(tenant_, response_);
      made = false;
      status = DeadlinePassedStatus();
    }
    bool undo = false;
    {
      absl::MutexLock lock(&mu_);
      if (!finished_) {
        if (status.ok()) SerializeRawMessage(response_, reply_);
        answered_made_ = made;
        FinishLocked(std::move(status));
      } else {
        // Answered CANCELLED while the handler ran: the client never learns what it made.
        undo = made && undo_ != nullptr;
      }
    }
    if (undo) (service_->*undo_)(tenant_, response_);
    refs_.Unref(this);
  }

  void OnCancel() override {
    const GrpcReaction reaction(this);
    FinishOnce(CancelledStatus());
  }
  void OnDone() override {
    ReactionFromGrpc(this);
    KvRecallService* const service = service_;
    bool undo;
    {
      absl::MutexLock lock(&mu_);
      undo = answered_made_ && undo_ != nullptr;
    }
    // Answered OK, but the answer never reached the client (its deadline passed or it
    // cancelled first: the server's deadline runs later than the client's by the request's
    // transit and gRPC's rounding of the timeout): it never learns what the call made.
    if (undo && context_->IsCancelled()) (service_->*undo_)(tenant_, response_);
    service->CountUnary(-1);
    refs_.Unref(this);  // may delete the call (and what it holds: sessions, their grants)
    HandoffToGrpc(service);  // gRPC's last touch of the service for this call (Server::Wait)
  }

 private:
  bool Expired() const { return std::chrono::steady_clock::now() >= deadline_; }

  void StartInHandler(const grpc::ByteBuffer* request) {
    if (service_->draining()) return FinishOnce(ShuttingDownStatus());
    // Past its deadline, or cancelled before its request came, the call has no request to
    // parse: not the client's error.
    if (Expired()) return FinishOnce(DeadlinePassedStatus());
    if (request == nullptr || !request->Valid()) return FinishOnce(CancelledStatus());
    grpc::ByteBuffer bytes(*request);  // shares the slices
    if (!ParseRawMessage(&bytes, &request_)) {
      return FinishOnce(UnparsableStatus("the request", request_));
    }
    refs_.Ref();
    service_->steps_.Push(this);
  }

  void FinishOnce(grpc::Status status) {
    absl::MutexLock lock(&mu_);
    if (!finished_) FinishLocked(std::move(status));
  }
  void FinishLocked(grpc::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    finished_ = true;
    HandoffToGrpc(this);
    Finish(std::move(status));
  }

  KvRecallService* const service_;
  grpc::CallbackServerContext* const context_;  // gRPC's; read in OnDone
  const std::chrono::steady_clock::time_point deadline_;  // SteadyDeadline's
  grpc::ByteBuffer* const reply_;  // gRPC's; written only before Finish
  const Handler handler_;
  const Undo undo_;
  const std::string tenant_;  // the caller's (server/auth.h)
  Request request_;
  Response response_;
  CallRefs<UnaryCall> refs_;
  absl::Mutex mu_;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  // Answered OK with what the handler made (which OnDone undoes if the answer was lost).
  bool answered_made_ ABSL_GUARDED_BY(mu_) = false;
};

template <typename Request, typename Response>
grpc::ServerUnaryReactor* KvRecallService::StartUnary(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
    grpc::ByteBuffer* response,
    absl::Status (KvRecallService::*handler)(absl::string_view, const Request&, Response*),
    void (KvRecallService::*undo)(absl::string_view, const Response&)) {
  auto* call = new UnaryCall<Request, Response>(this, context, response, handler, undo,
                                                IdentityOf(*context).tenant);
  call->Start(request);
  return call;
}

// ---------------------------------------------------------------------------------------------
// What the Prefill and Decode calls share: registration for the drain, the lock and flags that
// order gRPC's reactions against the runs on a work queue, and the shared ownership.

template <typename Reactor, typename Call>
class KvRecallService::StreamCall : public Reactor, public WorkItem, public KvRecallService::Stream {
 public:
  // The stream counts itself (the RPC interceptor leaves Decode and Prefill to it) here, where
  // gRPC says whether its status reached the client: one that ended OK on its side but whose
  // status never arrived is CANCELLED (gRPC failed the call itself: a request past
  // --max_message_mb fails the read as a half-close does, and the client gets
  // RESOURCE_EXHAUSTED; or the client went first; probe 17, 2: such calls were counted OK).
  void OnDone() override {
    ReactionFromGrpc(static_cast<Call*>(this));
    KvRecallService* const service = service_;
    const bool cancelled = context_->IsCancelled();
    grpc::StatusCode code;
    absl::Duration after;
    {
      absl::MutexLock lock(&mu_);
      code = finished_code_;
      after = finished_after_;
    }
    // (Before the call leaves the open streams: whoever waits for none to be open sees it
    // counted, and its commit taken back.)
    static_cast<Call*>(this)->OnCallDone(cancelled);
    if (MethodMetrics* const calls = static_cast<Call*>(this)->calls(); calls != nullptr) {
      calls->CountCall(code == grpc::StatusCode::OK && cancelled ? grpc::StatusCode::CANCELLED
                                                                 : code,
                       absl::ToDoubleSeconds(after));
    }
    if (registered_) service->Unregister(this);
    Unref();  // may delete the call (and what it holds: sessions, their grants)
    HandoffToGrpc(service);  // gRPC's last touch of the service for this call (Server::Wait)
  }

 protected:
  StreamCall(KvRecallService* service, grpc::CallbackServerContext* context)
      : service_(service), context_(context) {}

  // Registers for the drain and reads the first message into `in`, or, when the drain has
  // begun, ends the call with UNAVAILABLE.
  // In the handler (the constructor): gRPC reacts to the read or the Finish only once the
  // handler has returned, so the hand-off comes after the unlock of mu_.
  void Begin(grpc::ByteBuffer* in) {
    registered_ = service_->Register(this);
    {
      absl::MutexLock lock(&mu_);
      if (registered_) {
        this->StartRead(in);
      } else {
        FinishLocked(ShuttingDownStatus());
      }
    }
    HandoffToGrpc(static_cast<Call*>(this));
  }
  // Ends the call. What the call holds for its work (a Prefill's staged prompt) is released
  // first unless a run is using it (that run releases it; one still queued will not start),
  // so that a client that got the status sees the memory back, not once a queue of builds
  // reaches the run (a run in flight releases it as it ends). (Layers a commit installed and
  // then takes back are freed once taken back: by the run, or on the frees queue from
  // OnCallDone.)
  void FinishLocked(grpc::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    finished_ = true;
    if (!running_) static_cast<Call*>(this)->ReleaseLocked();
    RecordFinishLocked(status);
    HandoffToGrpc(static_cast<Call*>(this));
    this->Finish(std::move(status));
  }
  void ReleaseLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {}
  // Records how and when the call finished, for OnDone's count.
  void RecordFinishLocked(const grpc::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    finished_code_ = status.error_code();
    finished_after_ = absl::Now() - opened_;
  }
  // What the call does once gRPC says it is done, and whether its status reached the client.
  void OnCallDone(bool /*cancelled*/) {}
  // Queues a run of the call on `queue`.
  void QueueLocked(WorkQueue& queue) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    busy_ = true;
    refs_.Ref();
    queue.Push(this);
  }
  // At the start of a run: false (and the run's reference dropped) when the call finished
  // while the run was queued, so that the run must do nothing.
  bool BeginRun() {
    {
      absl::MutexLock lock(&mu_);
      if (!finished_) {
        running_ = true;
        return true;
      }
      busy_ = false;
    }
    Unref();
    return false;
  }
  void Ref() { refs_.Ref(); }
  void Unref() { refs_.Unref(static_cast<Call*>(this)); }

  KvRecallService* const service_;
  // gRPC's: valid until OnDone (a run still working after the call finished must not use it).
  grpc::CallbackServerContext* const context_;
  const absl::Time opened_ = absl::Now();
  absl::Mutex mu_;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool busy_ ABSL_GUARDED_BY(mu_) = false;  // a run of this call is queued or running
  bool running_ ABSL_GUARDED_BY(mu_) = false;  // ... and has begun (BeginRun, or inline)
  // How the call finished, and when (RecordFinishLocked).
  grpc::StatusCode finished_code_ ABSL_GUARDED_BY(mu_) = grpc::StatusCode::OK;
  absl::Duration finished_after_ ABSL_GUARDED_BY(mu_);

 private:
  bool registered_ = false;
  CallRefs<Call> refs_;
};

// ---------------------------------------------------------------------------------------------
// A Prefill stream: each chunk is validated and staged on the step queue, then the next one is
// read; when the client closes its side the selectors are built and the prompt committed on
// the build queue. Any error, a cancellation or the drain ends the stream with nothing
// committed (the staged prompt is freed with the call).

class KvRecallService::PrefillCall final
    : public StreamCall<grpc::ServerReadReactor<grpc::ByteBuffer>, PrefillCall> {
 public:
  PrefillCall(KvRecallService* service, grpc::CallbackServerContext* context,
              grpc::ByteBuffer* reply, CallIdentity identity)
      : StreamCall(service, context),
        deadline_(SteadyDeadline(context->deadline())),
        reply_(reply),
        identity_(std::move(identity)),
        stream_(service->registry_, identity_.tenant) {
    Begin(&in_);
  }

  void OnReadDone(bool ok) override {
    const GrpcReaction reaction(this);
    absl::MutexLock lock(&mu_);
    if (finished_) return;
    if (service_->draining()) return FinishLocked(ShuttingDownStatus());
    // A read also fails when the call is cancelled or its deadline passes, and that failure
    // can reach here before OnCancel does: only a clean close of the client's side commits.
    if (!ok && (cancelled_ || context_->IsCancelled() ||
                std::chrono::system_clock::now() >= context_->deadline())) {
      abandoned_.store(true, std::memory_order_release);
      return FinishLocked(CancelledStatus());
    }
    // !ok: the client closed its side cleanly, so the prompt is complete.
    committing_ = !ok;
    if (committing_) {
      // Its builds may wait in the build queue and then take longer than the idle TTL: the
      // session is in use from now until the call lets go of its prompt (ReleaseLocked).
      if (std::optional<Session::Use> use = stream_.UseSession()) {
        commit_use_.emplace(*std::move(use));
      }
    }
    QueueLocked(committing_ ? service_->builds_ : service_->steps_);
  }

  void Run() override {
    if (!BeginRun()) return;
    CommittedPrompt installed;  // what a commit installs, handed to OnDone with its OK
    bool committing;
    {
      absl::MutexLock lock(&mu_);
      committing = committing_;
    }
    grpc::Status status;
    bool deadline_passed_at_install = false;  // the test hook's say
    if (committing && service_->draining()) {
      status = ShuttingDownStatus();  // the builds have not started: refuse them
    } else if (absl::Status s = service_->StillAuthorized(identity_); !s.ok()) {
      status = service_->Answer(s);  // nothing staged is committed
    } else if (!committing) {
      if (!ParseRawMessage(&in_, &chunk_)) {
        status = UnparsableStatus(absl::StrCat("chunks[", chunks_, "]"), chunk_);
      } else {
        status = service_->Answer(stream_.Add(chunk_, chunks_));
      }
      ++chunks_;
    } else {
      if (service_->options_.test_hooks.before_prefill_commit) {
        service_->options_.test_hooks.before_prefill_commit();
      }
      // Cancelled when OnCancel says so, or once the deadline has passed (gRPC's OnCancel may
      // come much later, its threads busy: the builds take the cores). (Not gRPC's context:
      // once OnCancel has finished the call, gRPC may run OnDone and free it while this runs.)
      absl::StatusOr<v1::PrefillResponse> committed = stream_.Commit(
          [this] {
            return abandoned_.load(std::memory_order_acquire) || Expired();
          },
          &installed);
      if (committed.ok()) {
        response_ = *std::move(committed);
        const ServiceTestHooks& hooks = service_->options_.test_hooks;
        if (hooks.after_prefill_install) hooks.after_prefill_install();
        deadline_passed_at_install =
            hooks.prefill_deadline_passed_at_install && hooks.prefill_deadline_passed_at_install();
      } else {
        status = service_->Answer(committed.status());
      }
    }
    bool take_back = false;
    {
      absl::MutexLock lock(&mu_);
      busy_ = false;
      running_ = false;
      if (finished_) {
        // Cancelled while this run worked: what it installed is taken back here (the call's
        // OnDone may have run already).
        take_back = true;
        ReleaseLocked();
      } else if (!status.ok()) {
        FinishLocked(std::move(status));
      } else if (committing && (deadline_passed_at_install || Expired())) {
        // The deadline passed since the commit last asked (just before the install): the
        // client has given up, or will before an OK arrives. Taken back, and said so.
        take_back = true;
        FinishLocked(DeadlinePassedStatus());
      } else if (committing) {
        installed_ = std::move(installed);  // OnDone's to take back, should the OK be lost
        SerializeRawMessage(response_, reply_);
        FinishLocked(grpc::Status::OK);
      } else if (service_->draining()) {
        FinishLocked(ShuttingDownStatus());
      } else if (absl::Status closed = stream_.SessionStatus(); !closed.ok()) {
        // Its session closed while the chunk was staged (OnSessionsClosed passed it by).
        FinishLocked(service_->Answer(closed));
      } else if (!service_->StillAuthorized(identity_).ok()) {
        // A reload revoked its token while the chunk was staged (TokensReloaded passed it by).
        FinishLocked(RevokedWhileIdleStatus());
      } else {
        HandoffToGrpc(this);
        StartRead(&in_);
      }
    }
    if (take_back) installed.Undo();
    Unref();
  }

  void Drain() override {
    absl::MutexLock lock(&mu_);
    // A commit in flight finishes; a chunk in flight ends the stream when it is staged.
    if (!finished_ && !busy_) FinishLocked(ShuttingDownStatus());
  }

  void TokensReloaded() override {
    if (!service_->Revoked(identity_)) return;
    absl::MutexLock lock(&mu_);
    if (!finished_ && !busy_) FinishLocked(RevokedWhileIdleStatus());  // nothing staged commits
  }

  void OnCancel() override {
    const GrpcReaction reaction(this);
    abandoned_.store(true, std::memory_order_release);
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
    // Finished at once, even while a chunk or a commit runs: that work's result is dropped
    // (a commit running stops its builds, index/build_stop.h, and installs nothing).
    if (!finished_) FinishLocked(CancelledStatus());
  }

  // A stream waiting for its next chunk whose session closed (a CloseSession, or it expired
  // while the client paused) ends now, and its staging is freed with it: it would otherwise
  // hold the memory of a session that no longer exists until the client writes again or its
  // deadline passes. (A run in flight checks the session itself: a chunk's once it is staged,
  // a commit's builds as they go, and the commit before it installs them.)
  std::shared_ptr<void> OnSessionsClosed() override {
    absl::MutexLock lock(&mu_);
    if (finished_ || busy_) return nullptr;
    absl::Status closed = stream_.SessionStatus();
    if (closed.ok()) return nullptr;
    // The staging leaves with the caller (FinishLocked's release then frees nothing).
    auto released = std::make_shared<PrefillStream>(
        std::exchange(stream_, PrefillStream(service_->registry_, identity_.tenant)));
    FinishLocked(service_->Answer(closed));
    return released;
  }

  // A commit answered OK whose answer never reached the client (gRPC failed the call
  // meanwhile: a chunk past --max_message_mb fails the read as a clean close does, and the
  // client hears RESOURCE_EXHAUSTED; or the client went first) is taken back: the client, told
  // of a failure, finds nothing committed (review 17, 1: a prompt cut short at that chunk was
  // committed).
  // (What a run that was still working when the call finished installed, that run takes back
  // itself: this sees only what a FinishLocked(OK) handed over.) The layers leave the session
  // here, before the call is counted and leaves the open streams; they are freed on the frees
  // queue, not on this gRPC thread (a long prompt's munmaps and device frees, malloc_trim), and
  // not behind the builds.
  void OnCallDone(bool cancelled) {
    CommittedPrompt installed;
    {
      absl::MutexLock lock(&mu_);
      installed = std::move(installed_);
    }
    const ServiceTestHooks& hooks = service_->options_.test_hooks;
    if (!cancelled && hooks.prefill_answer_lost && hooks.prefill_answer_lost()) cancelled = true;
    if (cancelled) installed.Undo(&service_->frees_);
  }
  MethodMetrics* calls() const { return service_->prefill_calls_; }

  // Frees the staged prompt (a commit has moved what it committed into the session), and ends
  // the commit's use of the session before the stream lets go of it.
  void ReleaseLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    commit_use_.reset();
    stream_ = PrefillStream(service_->registry_, identity_.tenant);
  }

 private:

  // Whether the call's deadline has passed (a run asks it; gRPC's own OnCancel may come late).
  bool Expired() const { return std::chrono::steady_clock::now() >= deadline_; }

  const std::chrono::steady_clock::time_point deadline_;  // SteadyDeadline's
  grpc::ByteBuffer* const reply_;  // gRPC's; written only before Finish
  CallIdentity identity_;          // the caller's (server/auth.h), checked on each chunk
  grpc::ByteBuffer in_;
  v1::PrefillChunk chunk_;
  v1::PrefillResponse response_;
  PrefillStream stream_;
  CommittedPrompt installed_ ABSL_GUARDED_BY(mu_);  // a commit's, answered OK, until OnDone
  int64_t chunks_ = 0;
  bool committing_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<Session::Use> commit_use_ ABSL_GUARDED_BY(mu_);  // from the commit's queueing
  std::atomic<bool> abandoned_{false};  // cancelled: a commit in flight must install nothing
};

// ---------------------------------------------------------------------------------------------
// A Decode stream: read a request, serve it on the step queue, write the reply, read the next.
// One request is in flight per stream; the request and reply objects (and their allocations)
// are reused for the whole stream. A request that fails (does not parse, or is refused by the
// decode pipeline) ends the stream with its status and appends nothing.

class KvRecallService::DecodeCall final
    : public StreamCall<grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>, DecodeCall> {
 public:
  DecodeCall(KvRecallService* service, grpc::CallbackServerContext* context,
             CallIdentity identity)
      : StreamCall(service, context), identity_(std::move(identity)),
        decoder_(service->registry_, identity_.tenant) {
    Begin(&in_);
  }

  void OnReadDone(bool ok) override {
    const GrpcReaction reaction(this);
    {
      absl::MutexLock lock(&mu_);
      if (finished_) return;
      // !ok: the client closed its side, or the call was cancelled or its deadline passed
      // (a failure that can reach here before OnCancel does): the stream ends, counted so.
      if (!ok) {
        if (std::chrono::system_clock::now() >= context_->deadline()) {
          return FinishLocked(DeadlinePassedStatus());
        }
        return FinishLocked(cancelled_ || context_->IsCancelled() ? CancelledStatus()
                                                                  : grpc::Status::OK);
      }
      if (service_->decode_calls_ != nullptr) arrived_ = absl::Now();
      if (service_->draining()) return FinishLocked(ShuttingDownStatus());
      if (!service_->TakeInlineStep()) return QueueLocked(service_->steps_);
      busy_ = true;  // a run, on this thread
      running_ = true;
      Ref();
    }
    // Served on the gRPC thread that read the request, while few steps run so: a hand-off to
    // the step queue costs a thread wake-up per layer-step (bench/results/rpc_floor.md). The
    // slot is given back before the reply is written: the client's next request may be read on
    // another gRPC thread as soon as the reply is out, and must find it free.
    grpc::Status status = Serve();
    service_->ReturnInlineStep();
    Reply(std::move(status));
  }

  void Run() override {
    if (!BeginRun()) return;
    Reply(Serve());
  }

  void OnWriteDone(bool ok) override {
    const GrpcReaction reaction(this);
    write_start_.Completed();
    absl::MutexLock lock(&mu_);
    writing_ = false;
    if (finished_) return;
    if (!ok) return FinishLocked(CancelledStatus());  // the stream broke under the reply
    if (service_->draining()) return FinishLocked(ShuttingDownStatus());
    // A reload that found the stream at work (TokensReloaded passed it by) is met here, as
    // it goes idle (review 23: it waited for a request its client need never send).
    if (!service_->StillAuthorized(identity_).ok()) {
      return FinishLocked(RevokedWhileIdleStatus());
    }
    HandoffToGrpc(this);
    StartRead(&in_);
  }

  void Drain() override {
    absl::MutexLock lock(&mu_);
    if (!finished_ && !busy_ && !writing_) FinishLocked(ShuttingDownStatus());
  }

  void TokensReloaded() override {
    if (!service_->Revoked(identity_)) return;
    absl::MutexLock lock(&mu_);
    if (!finished_ && !busy_ && !writing_) FinishLocked(RevokedWhileIdleStatus());
  }

  void OnCancel() override {
    const GrpcReaction reaction(this);
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
    // With a write pending, OnWriteDone (not ok) finishes the stream.
    if (!finished_ && !writing_) FinishLocked(CancelledStatus());
  }

  MethodMetrics* calls() const { return service_->decode_calls_; }

 private:
  // The latency of the request being answered, from its arrival to its reply.
  void CountReplyLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (service_->decode_calls_ != nullptr) {
      service_->registry_->metrics()->ObserveDecodeRequest(
          absl::ToDoubleSeconds(absl::Now() - arrived_));
    }
  }

  // The step of the request read into in_, its reply serialized into out_ when it succeeds.
  // Run by the one run of the call in flight (busy_).
  grpc::Status Serve() {
    const int64_t index = requests_++;
    if (absl::Status s = service_->StillAuthorized(identity_); !s.ok()) {
      return service_->Answer(s);
    }
    if (!ParseRawMessage(&in_, &request_)) {
      return UnparsableStatus(absl::StrCat("Decode request ", index, " of this stream"),
                              request_);
    }
    // A step whose client has given up (its deadline, a cancellation) is not applied once the
    // cancellation has reached the server: the client was told nothing of it. (One still on
    // its way is not seen here: the step's position settles that, kvrecall.proto's Decode.)
    const auto cancelled = [this] {
      absl::MutexLock lock(&mu_);
      return cancelled_ || context_->IsCancelled();
    };
    if (const ServiceTestHooks& hooks = service_->options_.test_hooks; hooks.before_decode_step) {
      hooks.before_decode_step(cancelled);
    }
    if (cancelled()) return CancelledStatus();
    response_.Clear();
    // A reply over gRPC's message limit, the server's or the client's (Serve reads that one
    // from the request), would fail to arrive after the step was applied.
    grpc::Status status = service_->Answer(
        decoder_.Serve(request_, &response_, service_->options_.max_message_bytes,
                       "the server's message limit (--max_message_mb)"));
    if (status.ok()) SerializeRawMessage(response_, &out_);
    return status;
  }

  // Ends the run: writes the reply (and then reads the next request) or ends the stream with
  // `status`, unless the call finished meanwhile; drops the run's reference.
  void Reply(grpc::Status status) {
    bool write = false;
    {
      absl::MutexLock lock(&mu_);
      busy_ = false;
      running_ = false;
      if (!finished_) {
        if (!status.ok()) {
          FinishLocked(std::move(status));
        } else if (service_->draining()) {
          // The step in flight is answered; the stream ends with it.
          finished_ = true;
          CountReplyLocked();
          RecordFinishLocked(ShuttingDownStatus());
          HandoffToGrpc(this);
          StartWriteAndFinish(&out_, grpc::WriteOptions(), ShuttingDownStatus());
        } else {
          writing_ = true;
          write = true;
          CountReplyLocked();
        }
      }
    }
    // Outside mu_: the write may complete at once, and OnWriteDone (on another gRPC thread)
    // would wait for the lock. While writing_ is set nothing else starts or finishes the call.
    if (write) {
      HandoffToGrpc(this);
      StartWrite(&out_);
      write_start_.Started();
    }
    Unref();
  }

  grpc::ByteBuffer in_;
  grpc::ByteBuffer out_;
  v1::DecodeRequest request_;
  v1::DecodeResponse response_;
  CallIdentity identity_;  // the caller's (server/auth.h), checked on each request
  DecodeStream decoder_;
  int64_t requests_ = 0;  // touched by one run at a time
  bool writing_ ABSL_GUARDED_BY(mu_) = false;  // the reply is being written
  GrpcStartOutsideLock write_start_;  // the reply's StartWrite, outside mu_ (TSan's view)
  absl::Time arrived_ ABSL_GUARDED_BY(mu_);  // the request in flight's (with decode_calls_)
};

// ---------------------------------------------------------------------------------------------
// A DecodeShared stream: the call answers the region, then a thread of the stream's own serves
// the steps that arrive through it (proto/shared_decode_region.h) with a DecodeStream, as a
// Decode stream serves them, until the runner closes it, a step fails, the call is cancelled or
// the drain begins; then the region says so, the call ends with that status, and the region's
// file is removed. The thread polls for a request for ServiceOptions::shared_memory_spin after
// each reply, then sleeps in futex(2) until the runner's signal (or a cancellation's or the
// drain's wake-up).

// A shared region's capacity each way when the runner names none (SharedDecodeRequest).
constexpr uint64_t kDefaultSharedCapacity = 4 << 20;

class KvRecallService::SharedDecodeCall final : public grpc::ServerWriteReactor<grpc::ByteBuffer>,
                                                public KvRecallService::Stream {
 public:
  SharedDecodeCall(KvRecallService* service, const grpc::ByteBuffer* request,
                   CallIdentity identity, absl::string_view peer)
      : service_(service), identity_(std::move(identity)),
        decoder_(service->registry_, identity_.tenant) {
    grpc::Status status = Open(request, peer);
    if (!status.ok()) {
      ReleaseSlot();  // before the status: a runner that reopens at once finds it free
      Finish(std::move(status));
    } else {
      StartWrite(&region_message_);
    }
    // In the handler: gRPC reacts only once it has returned, so all of this comes before any
    // reaction.
    HandoffToGrpc(this);
  }

  void OnWriteDone(bool ok) override {
    const GrpcReaction reaction(this);
    if (!ok) {  // the runner is gone before it got the region
      ReleaseSlot();
      Finish(CancelledStatus());
      return;
    }
    try {
      server_thread_ = std::thread([this] { Serve(); });
    } catch (const std::system_error& e) {
      ReleaseSlot();
      Finish(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                          absl::StrCat("kvrecalld could not start the shared stream's thread: ",
                                       e.what())));
    }
  }

  void OnCancel() override {
    const GrpcReaction reaction(this);
    cancelled_.store(true);
    Wake();
  }

  void Drain() override {
    draining_.store(true);
    Wake();
  }

  void TokensReloaded() override {
    if (!service_->Revoked(identity_)) return;
    revoked_.store(true);
    Wake();
  }

  void OnDone() override {
    // The thread's last act was Finish (OnDone comes after it), so this join does not wait on
    // a step.
    ReactionFromGrpc(this);
    if (server_thread_.joinable()) server_thread_.join();
    if (registered_) service_->Unregister(this);
    ReleaseSlot();
    KvRecallService* const service = service_;
    delete this;  // unmaps the region (and removes its file if that was not done yet)
    HandoffToGrpc(service);  // gRPC's last touch of the service for this call (Server::Wait)
  }

 private:
  // Checks the request and the server's limits, creates the region and its answer; registered
  // for the drain once it holds a slot.
  grpc::Status Open(const grpc::ByteBuffer* request, absl::string_view peer) {
    const ServiceOptions& options = service_->options_;
    // Before it takes a slot and a region (review 25: it was refused at its first request).
    if (identity_.tenant == kNoTenant) return service_->Answer(TokenReloadedAtCallStartStatus());
    if (options.shared_memory_dir.empty()) {
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                          "shared-memory decode is off on this server: kvrecalld serves "
                          "DecodeShared with --shared_memory_dir=DIR, a directory the runner "
                          "on the same host can open files in; use Decode otherwise");
    }
    // Only a runner on this host can map the region: a remote caller would only hold a slot
    // of --max_shared_streams (and learn the directory), as one tenant did for every slot from
    // another host (probe 26, 2).
    if (!IsLocalPeer(peer)) {
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                          "DecodeShared is for a runner on the server's host, over a Unix socket "
                          "or loopback; this call came over another network address: use "
                          "Decode");
    }
    // Two sizes: anything more is padding, which gRPC holds for the stream's life (60 MB of it
    // in each of 8 streams pinned 490 MB that no budget saw, probe 26, 1).
    constexpr size_t kMaxOpenBytes = 1024;
    if (request->Length() > kMaxOpenBytes) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat("a SharedDecodeRequest of ", request->Length(),
                                       " bytes: at most ", kMaxOpenBytes));
    }
    grpc::ByteBuffer bytes(*request);  // shares the slices
    v1::SharedDecodeRequest open;
    if (!ParseRawMessage(&bytes, &open)) return UnparsableStatus("the request", open);
    const uint64_t limit = static_cast<uint64_t>(options.max_message_bytes);
    // The region's blocks are allocated up front: by default room for a batch of a few hundred
    // layer-steps, not the message limit.
    const uint64_t default_capacity = std::min<uint64_t>(limit, kDefaultSharedCapacity);
    for (const auto& [name, value] : {std::pair{"max_request_bytes", open.max_request_bytes()},
                                      std::pair{"max_reply_bytes", open.max_reply_bytes()}}) {
      if (value > limit) {
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                            absl::StrCat(name, " must be at most the server's message limit (",
                                         "--max_message_mb) of ", limit, " bytes, got ", value));
      }
    }
    if (service_->draining()) return ShuttingDownStatus();
    if (absl::Status s = service_->TakeSharedSlot(identity_.tenant); !s.ok()) {
      return service_->Answer(s);
    }
    counted_.store(true);
    const uint64_t request_capacity =
        open.max_request_bytes() > 0 ? open.max_request_bytes() : default_capacity;
    const uint64_t reply_capacity =
        open.max_reply_bytes() > 0 ? open.max_reply_bytes() : default_capacity;
    // The region is host memory (a tmpfs file allocated whole): it is charged to the host
    // budget as a session's KV is, until the stream ends.
    const int64_t region_bytes = static_cast<int64_t>(
        v1::shared_decode::RegionLayout::For(request_capacity, reply_capacity).bytes());
    // The caller's tenant's budget when tenants have one (it holds it until the charge goes).
    region_budgets_ = service_->registry_->BudgetsOf(identity_.tenant);
    MemoryBudget* budget =
        region_budgets_ != nullptr ? region_budgets_->host() : service_->registry_->budget();
    if (absl::Status s = budget->Reserve(
            region_bytes, "a shared decode region (SharedDecodeRequest's capacities)");
        !s.ok()) {
      return service_->Answer(s);
    }
    charged_budget_ = budget;
    charged_bytes_ = region_bytes;
    absl::StatusOr<v1::shared_decode::MappedRegion> region =
        v1::shared_decode::MappedRegion::Create(options.shared_memory_dir, request_capacity,
                                                reply_capacity);
    if (!region.ok()) {
      return grpc::Status(region.status().code() == absl::StatusCode::kResourceExhausted
                              ? grpc::StatusCode::RESOURCE_EXHAUSTED
                              : grpc::StatusCode::FAILED_PRECONDITION,
                          absl::StrCat("kvrecalld could not create a shared decode region: ",
                                       region.status().message()));
    }
    region_ = *std::move(region);
    registered_ = service_->Register(this);
    if (!registered_) return ShuttingDownStatus();
    v1::SharedDecodeRegion answer;
    answer.set_path(region_.path());
    answer.set_bytes(region_.bytes());
    answer.set_layout_version(v1::shared_decode::kLayoutVersion);
    answer.set_max_request_bytes(region_.request_capacity());
    answer.set_max_reply_bytes(region_.reply_capacity());
    SerializeRawMessage(answer, &region_message_);
    return grpc::Status::OK;
  }

  // Gives back the --max_shared_streams slot, once: before the call's final status goes out, so
  // that a runner that reopens at once (after a failed step) finds it free.
  void ReleaseSlot() {
    if (counted_.exchange(false)) {
      service_->ReturnSharedSlot(identity_.tenant);
      if (charged_bytes_ > 0) charged_budget_->Release(charged_bytes_);
    }
  }

  // Wakes the serving thread (a cancellation or the drain), wherever it waits.
  void Wake() {
    if (region_.header() != nullptr) {
      v1::shared_decode::Signal(&region_.header()->request_signal,
                                &region_.header()->server_sleeping);
    }
  }

  // The stream's thread: steps until the stream ends, then the call's Finish.
  void Serve() {
    v1::shared_decode::RegionHeader* const h = region_.header();
    uint32_t seen = 0;
    grpc::Status end;
    while (true) {
      v1::shared_decode::WaitUntil(
          &h->request_signal, &h->server_sleeping, service_->options_.shared_memory_spin,
          absl::Milliseconds(100),
          [&] {
            return h->request_seq.load() != seen || cancelled_.load() || draining_.load() ||
                   revoked_.load() || region_.broken();
          },
          [] { return false; });
      if (cancelled_.load()) {
        end = CancelledStatus();  // nobody is listening
        break;
      }
      if (region_.broken()) {
        end = BrokenRegionStatus("no request of it was being served");
        break;
      }
      if (revoked_.load()) {
        end = RevokedWhileIdleStatus();  // a request that came with it would be refused too
        break;
      }
      const uint32_t request = h->request_seq.load();
      if (request == seen || service_->draining()) {
        // The drain, between steps or with a step not picked up yet: it is not served.
        end = ShuttingDownStatus();
        break;
      }
      seen = request;
      // The runner has mapped the region: its file goes now, so that no other process of the
      // server's user (which the file's 0600 lets in, tokens or not) can open the region and
      // read or inject its steps from here on (probe 26, 4).
      region_.RemoveFile();
      const absl::Time arrived = absl::Now();
      if (v1::shared_decode::ReadPeerWord(h->closing) != 0) {
        Publish(grpc::Status::OK, 0, seen);
        break;
      }
      grpc::Status status = Step();
      const uint64_t reply_bytes = status.ok() ? response_.GetCachedSize() : 0;
      if (status.ok() && service_->decode_calls_ != nullptr) {
        service_->registry_->metrics()->ObserveDecodeRequest(
            absl::ToDoubleSeconds(absl::Now() - arrived));
      }
      if (!status.ok()) {
        // The step ends the stream: its file and slot go before the runner can read why, so
        // that it may reopen at once (probe 8: 13-16 in 100 immediate reopens were refused).
        region_.RemoveFile();
        ReleaseSlot();
      }
      Publish(status, reply_bytes, seen);
      if (!status.ok()) {
        end = std::move(status);
        break;
      }
      if (region_.broken()) {  // the reply went nowhere: the step was applied (probe 21, 1)
        end = BrokenRegionStatus(absl::StrCat(
            "Decode request ", requests_ - 1, "'s step was applied and its reply lost: do not "
            "resend it (GetSession's layer_tokens tell where each layer is)"));
        break;
      }
    }
    h->ended.store(1);
    v1::shared_decode::Signal(&h->reply_signal, &h->runner_sleeping);
    // The stream is over for the runner: its file and slot go before the status does.
    region_.RemoveFile();
    ReleaseSlot();
    HandoffToGrpc(this);
    Finish(std::move(end));
  }

  // The step whose request is in the region: its reply serialized into the region when it
  // succeeds (response_'s cached size is then its length).
  grpc::Status Step() {
    v1::shared_decode::RegionHeader* const h = region_.header();
    const int64_t index = requests_++;
    // Read once and copied out: the runner could change the region under the parse. (The
    // capacities and offsets are the server's own copies, not the header's.)
    const uint64_t bytes = v1::shared_decode::ReadPeerWord(h->request_bytes);
    if (bytes > region_.request_capacity()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat("Decode request ", index, " of this stream claims ", bytes,
                                       " bytes, over the region's max_request_bytes of ",
                                       region_.request_capacity(),
                                       "; nothing of it was applied"));
    }
    request_bytes_.assign(region_.request(), bytes);
    if (region_.broken()) {  // what was copied is zeros: not applied
      return BrokenRegionStatus(
          absl::StrCat("Decode request ", index, " was read as zeros and not applied"));
    }
    if (absl::Status s = service_->StillAuthorized(identity_); !s.ok()) {
      return service_->Answer(s);
    }
    if (!request_.ParseFromString(request_bytes_)) {
      return UnparsableStatus(absl::StrCat("Decode request ", index, " of this stream"),
                              request_);
    }
    const auto cancelled = [this] { return cancelled_.load(); };  // OnCancel's
    if (const ServiceTestHooks& hooks = service_->options_.test_hooks; hooks.before_decode_step) {
      hooks.before_decode_step(cancelled);
    }
    if (cancelled()) return CancelledStatus();  // not applied: its runner has given up
    // Serve refuses a request whose reply could overflow the reply area before applying it.
    response_.Clear();
    grpc::Status status =
        service_->Answer(decoder_.Serve(request_, &response_, region_.reply_capacity()));
    if (!status.ok()) return status;
    const size_t size = response_.ByteSizeLong();
    if (size > region_.reply_capacity()) {  // MaxDecodeReplyBytes fell short: a bug
      return grpc::Status(
          grpc::StatusCode::INTERNAL,
          absl::StrCat("the reply to Decode request ", index, " takes ", size,
                       " bytes, over the region's max_reply_bytes of ", region_.reply_capacity(),
                       " and over its bound; its step was applied (SequenceResult.position and "
                       "GetSession's layer_tokens tell where each layer is)"));
    }
    response_.SerializeWithCachedSizesToArray(reinterpret_cast<uint8_t*>(region_.reply()));
    return grpc::Status::OK;
  }

  // The stream's end when its runner shrank the region's file under the mapping (MappedRegion's
  // broken()): what the region held is gone on both sides. `what_happened` says whether the
  // request in flight was applied: a runner told "not applied" resends it.
  grpc::Status BrokenRegionStatus(absl::string_view what_happened) const {
    return grpc::Status(grpc::StatusCode::DATA_LOSS,
                        absl::StrCat("the shared decode region ", region_.path(),
                                     " was shrunk while mapped; this stream ends (",
                                     what_happened, "; open a new stream)"));
  }

  // Publishes the answer to request `seq`: the reply already in the region (`reply_bytes` of
  // it) when `status` is OK, else the status and its message.
  void Publish(const grpc::Status& status, uint64_t reply_bytes, uint32_t seq) {
    v1::shared_decode::RegionHeader* const h = region_.header();
    if (!status.ok()) {
      const std::string& message = status.error_message();
      reply_bytes = std::min<uint64_t>(message.size(), region_.reply_capacity());
      std::copy_n(message.data(), reply_bytes, region_.reply());
    }
    h->status_code = static_cast<int32_t>(status.error_code());
    h->reply_bytes = static_cast<uint32_t>(reply_bytes);
    h->reply_seq.store(seq);
    v1::shared_decode::Signal(&h->reply_signal, &h->runner_sleeping);
  }

  KvRecallService* const service_;
  CallIdentity identity_;  // the caller's (server/auth.h), checked on each request
  DecodeStream decoder_;
  v1::shared_decode::MappedRegion region_;
  grpc::ByteBuffer region_message_;
  std::atomic<bool> counted_{false};  // holds a --max_shared_streams slot (and the charge)
  std::shared_ptr<TenantBudgets> region_budgets_;  // the caller's tenant's, when it has some
  MemoryBudget* charged_budget_ = nullptr;         // the region's bytes are charged here
  int64_t charged_bytes_ = 0;
  bool registered_ = false;  // for the drain
  std::atomic<bool> cancelled_{false};
  std::atomic<bool> draining_{false};
  std::atomic<bool> revoked_{false};  // TokensReloaded: the stream's token was revoked
  std::thread server_thread_;
  // The serving thread's alone.
  int64_t requests_ = 0;
  std::string request_bytes_;
  v1::DecodeRequest request_;
  v1::DecodeResponse response_;
};

// ---------------------------------------------------------------------------------------------

KvRecallService::KvRecallService(SessionRegistry* registry, const ServiceOptions& options)
    : registry_(registry),
      options_(options),
      decode_calls_(options.stream_call_metrics && registry->metrics() != nullptr
                        ? registry->metrics()->ForMethod(kDecodeMethod)
                        : nullptr),
      prefill_calls_(options.stream_call_metrics && registry->metrics() != nullptr
                         ? registry->metrics()->ForMethod(kPrefillMethod)
                         : nullptr),
      frees_(1, "kvrecall-free"),
      steps_(ThreadsOrDefault(options.worker_threads, std::thread::hardware_concurrency()),
             "kvrecall-step"),
      builds_(steps_.threads(), "kvrecall-build"),
      max_inline_steps_(options.inline_steps >= 0
                            ? options.inline_steps
                            : std::max<int>(1, std::thread::hardware_concurrency() / 4)) {
  registry_->SetClosedListener([this] { TellStreamsSessionsClosed(); });
}

KvRecallService::~KvRecallService() { registry_->SetClosedListener(nullptr); }

bool KvRecallService::TakeInlineStep() {
  int running = inline_steps_.load(std::memory_order_relaxed);
  while (running < max_inline_steps_) {
    if (inline_steps_.compare_exchange_weak(running, running + 1, std::memory_order_acq_rel)) {
      return true;
    }
  }
  return false;
}

void KvRecallService::ReturnInlineStep() {
  inline_steps_.fetch_sub(1, std::memory_order_acq_rel);
}

absl::Status KvRecallService::TakeSharedSlot(const std::string& tenant) {
  absl::MutexLock lock(&shared_slots_mu_);
  int& own = shared_streams_of_[tenant];
  // The tenant's limit first: it tells the caller what closing one of its own would do; the
  // other tenants' streams are not counted for it.
  if (const int limit = options_.max_shared_streams_per_tenant; limit > 0 && own >= limit) {
    return RefusedBy(
        absl::ResourceExhaustedError(absl::StrCat(
            tenant.empty() ? "this server's callers (it authenticates no tenants) have "
                           : absl::StrCat("tenant '", tenant, "' has "),
            own, own == 1 ? " shared Decode stream" : " shared Decode streams",
            " open, the limit per tenant (--max_shared_streams_per_tenant=", limit,
            "): close one or use Decode")),
        "max_shared_streams_per_tenant");
  }
  if (shared_streams_ >= options_.max_shared_streams) {
    if (own == 0) shared_streams_of_.erase(tenant);
    return RefusedBy(
        absl::ResourceExhaustedError(absl::StrCat(
            "--max_shared_streams=", options_.max_shared_streams,
            " shared Decode streams are open, ",
            own == 0 ? "none of them yours: use Decode"
                     : absl::StrCat(own, " of them yours: close one or use Decode"))),
        "max_shared_streams");
  }
  ++own;
  ++shared_streams_;
  return absl::OkStatus();
}

void KvRecallService::ReturnSharedSlot(const std::string& tenant) {
  absl::MutexLock lock(&shared_slots_mu_);
  --shared_streams_;
  auto own = shared_streams_of_.find(tenant);
  if (own != shared_streams_of_.end() && --own->second == 0) shared_streams_of_.erase(own);
}

void KvRecallService::StartDrain() {
  draining_.store(true, std::memory_order_release);
  absl::MutexLock lock(&calls_mu_);
  for (Stream* stream : streams_) stream->Drain();
}

void KvRecallService::TellStreamsSessionsClosed() {
  std::vector<std::shared_ptr<void>> released;
  {
    absl::MutexLock lock(&calls_mu_);
    for (Stream* stream : streams_) {
      if (std::shared_ptr<void> r = stream->OnSessionsClosed(); r != nullptr) {
        released.push_back(std::move(r));
      }
    }
  }
  released.clear();  // outside calls_mu_, which every call's start and end takes
}

bool KvRecallService::AwaitIdle(absl::Time deadline) const {
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(calls_mu_) {
    return streams_.empty() && unary_calls_ == 0;
  };
  absl::MutexLock lock(&calls_mu_);
  return calls_mu_.AwaitWithDeadline(absl::Condition(&idle), deadline);
}

int KvRecallService::open_streams() const {
  absl::MutexLock lock(&calls_mu_);
  return static_cast<int>(streams_.size());
}

bool KvRecallService::Register(Stream* stream) {
  absl::MutexLock lock(&calls_mu_);
  if (draining()) return false;
  streams_.insert(stream);
  return true;
}

void KvRecallService::Unregister(Stream* stream) {
  absl::MutexLock lock(&calls_mu_);
  streams_.erase(stream);
}

void KvRecallService::CountUnary(int delta) {
  absl::MutexLock lock(&calls_mu_);
  unary_calls_ += delta;
}

grpc::ServerUnaryReactor* KvRecallService::CreateSession(grpc::CallbackServerContext* context,
                                                         const grpc::ByteBuffer* request,
                                                         grpc::ByteBuffer* response) {
  ReactionFromGrpc(this);  // the service as StartServer handed it over
  return StartUnary(context, request, response, &KvRecallService::DoCreateSession,
                    &KvRecallService::UndoCreateSession);
}

KvRecallService::CallIdentity KvRecallService::IdentityOf(
    const grpc::ServerContextBase& context) const {
  CallIdentity identity;
  if (tokens_ == nullptr) return identity;  // tenant "": no tokens to check again
  if (options_.test_hooks.before_call_identified) options_.test_hooks.before_call_identified();
  identity.epoch = tokens_->epoch();  // before the table: a reload after shows as a change
  identity.token = std::string(CallBearerToken(context));
  identity.tenant = TenantOf(*tokens_->table(), identity.token);
  return identity;
}

absl::Status KvRecallService::StillAuthorized(CallIdentity& identity) const {
  if (tokens_ == nullptr) return absl::OkStatus();
  if (identity.tenant == kNoTenant) return TokenReloadedAtCallStartStatus();
  const uint64_t epoch = tokens_->epoch();
  if (epoch == identity.epoch) return absl::OkStatus();
  if (Revoked(identity)) {
    return absl::UnauthenticatedError(
        "this stream's bearer token was revoked (the token file was reloaded); nothing of this "
        "request was applied");
  }
  identity.epoch = epoch;
  return absl::OkStatus();
}

bool KvRecallService::Revoked(const CallIdentity& identity) const {
  if (tokens_ == nullptr) return false;
  // Held while `tenant` points into it: a reload may replace the store's table meanwhile.
  const std::shared_ptr<const TokenTable> table = tokens_->table();
  const std::string* tenant = table->Find(identity.token);
  return tenant == nullptr || *tenant != identity.tenant;
}

void KvRecallService::TokensReloaded() {
  absl::MutexLock lock(&calls_mu_);
  for (Stream* stream : streams_) stream->TokensReloaded();
}


grpc::ServerReadReactor<grpc::ByteBuffer>* KvRecallService::Prefill(
    grpc::CallbackServerContext* context, grpc::ByteBuffer* response) {
  ReactionFromGrpc(this);  // the service as StartServer handed it over
  return new PrefillCall(this, context, response, IdentityOf(*context));
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* KvRecallService::Decode(
    grpc::CallbackServerContext* context) {
  ReactionFromGrpc(this);  // the service as StartServer handed it over
  return new DecodeCall(this, context, IdentityOf(*context));
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* KvRecallService::DecodeShared(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request) {
  ReactionFromGrpc(this);  // the service as StartServer handed it over
  return new SharedDecodeCall(this, request, IdentityOf(*context), context->peer());
}

grpc::ServerUnaryReactor* KvRecallService::GetSession(grpc::CallbackServerContext* context,
                                                      const grpc::ByteBuffer* request,
                                                      grpc::ByteBuffer* response) {
  ReactionFromGrpc(this);  // the service as StartServer handed it over
  return StartUnary(context, request, response, &KvRecallService::DoGetSession);
}

grpc::ServerUnaryReactor* KvRecallService::ListSessions(grpc::CallbackServerContext* context,
                                                        const grpc::ByteBuffer* request,
                                                        grpc::ByteBuffer* response) {
  ReactionFromGrpc(this);  // the service as StartServer handed it over
  return StartUnary(context, request, response, &KvRecallService::DoListSessions);
}

grpc::ServerUnaryReactor* KvRecallService::CloseSession(grpc::CallbackServerContext* context,
                                                        const grpc::ByteBuffer* request,
                                                        grpc::ByteBuffer* response) {
  ReactionFromGrpc(this);  // the service as StartServer handed it over
  return StartUnary(context, request, response, &KvRecallService::DoCloseSession);
}

grpc::Status KvRecallService::Answer(const absl::Status& status) {
  if (!status.ok() && registry_->metrics() != nullptr) {
    if (std::string limit = RefusedLimit(status); !limit.empty()) {
      registry_->metrics()->CountRefusal(limit);
    }
  }
  return ToGrpcStatus(status);
}

absl::Status KvRecallService::DoCreateSession(absl::string_view tenant,
                                              const v1::CreateSessionRequest& request,
                                              v1::CreateSessionResponse* response) {
  absl::StatusOr<std::shared_ptr<Session>> session = registry_->Create(request, tenant);
  if (!session.ok()) return session.status();
  response->set_session_id((*session)->id());
  *response->mutable_policy() = PolicyToProto((*session)->policy());
  // The backend's rule for a prompt of any length: a bound below it is a tail of that many.
  constexpr int64_t kAnyLength = std::numeric_limits<int64_t>::max();
  const int64_t needed =
      (*session)->backend()->PromptQueriesNeeded((*session)->layer_config(), kAnyLength);
  response->set_prompt_queries(needed == kAnyLength ? -1 : needed);
  if (options_.test_hooks.after_create_session) options_.test_hooks.after_create_session();
  return absl::OkStatus();
}

void KvRecallService::UndoCreateSession(absl::string_view tenant,
                                        const v1::CreateSessionResponse& response) {
  // Its id was not sent (a ListSessions in the meantime may have listed it: the proto says a
  // cancelled CreateSession closes what it made), unless a retry with its request_id got it.
  registry_->UndoCreate(response.session_id(), tenant);
  ReturnFreedMemory();
}

absl::Status KvRecallService::DoGetSession(absl::string_view tenant,
                                           const v1::GetSessionRequest& request,
                                           v1::SessionInfo* response) {
  absl::StatusOr<std::shared_ptr<Session>> session = registry_->Find(request.session_id(), tenant);
  if (!session.ok()) return PrefixStatus(session.status(), "session_id: ");
  absl::ReaderMutexLock lock(&(*session)->mu());
  *response = (*session)->Info();
  return absl::OkStatus();
}

absl::Status KvRecallService::DoListSessions(absl::string_view tenant,
                                             const v1::ListSessionsRequest& request,
                                             v1::ListSessionsResponse* response) {
  constexpr int kDefaultPageSize = 100;
  constexpr int kMaxPageSize = 500;  // 500 sessions of 1024 layers: under 3 MiB
  if (request.page_size() < 0 || request.page_size() > kMaxPageSize) {
    return absl::InvalidArgumentError(absl::StrCat("page_size must be in [0, ", kMaxPageSize,
                                                   "] (0: ", kDefaultPageSize, "), got ",
                                                   request.page_size()));
  }
  if (!request.page_token().empty() && !SessionRegistry::IsSessionIdForm(request.page_token())) {
    return absl::InvalidArgumentError(
        "page_token must be empty or the next_page_token of a previous reply (a session id)");
  }
  const size_t page_size = request.page_size() == 0 ? kDefaultPageSize : request.page_size();
  // The token is the last id of the previous page: the page goes on after it.
  std::vector<std::shared_ptr<Session>> sessions = registry_->List(tenant);
  std::erase_if(sessions, [&](const auto& s) { return s->id() <= request.page_token(); });
  std::sort(sessions.begin(), sessions.end(),
            [](const auto& a, const auto& b) { return a->id() < b->id(); });
  for (const auto& session : sessions) {
    if (static_cast<size_t>(response->sessions_size()) == page_size) {
      response->set_next_page_token(response->sessions().rbegin()->session_id());
      break;
    }
    absl::ReaderMutexLock lock(&session->mu());
    if (!session->closed()) *response->add_sessions() = session->Info();
  }
  return absl::OkStatus();
}

absl::Status KvRecallService::DoCloseSession(absl::string_view tenant,
                                             const v1::CloseSessionRequest& request,
                                             v1::CloseSessionResponse*) {
  absl::Status closed = registry_->Close(request.session_id(), tenant);
  if (closed.ok()) ReturnFreedMemory();
  return closed;
}

}  // namespace kvrecall
