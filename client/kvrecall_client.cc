#include "client/kvrecall_client.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <fstream>
#include <optional>
#include <sstream>
#include <thread>
#include <utility>

#include "absl/memory/memory.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "google/protobuf/descriptor.h"
#include "grpc/grpc.h"
#include "grpc/grpc_security_constants.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"
#include "proto/host_port.h"
#include "proto/shared_decode_region.h"
#include "proto/tensor_codec.h"
#include "proto/tsan_handoff.h"

namespace kvrecall::client {
namespace {

using ::google::protobuf::EnumDescriptor;

// "SELECTOR_EXACT_TOPK" -> "exact_topk" for prefix "SELECTOR_".
std::string LowerEnumName(const EnumDescriptor* descriptor, int value, absl::string_view prefix) {
  const auto* v = descriptor->FindValueByNumber(value);
  if (v == nullptr) return absl::StrCat(value);
  std::string name = v->name();
  if (absl::StartsWith(name, prefix)) name.erase(0, prefix.size());
  return absl::AsciiStrToLower(name);
}

// The value named `name` (either case, '-' for '_', without the prefix); UNSPECIFIED is not
// a name.
absl::StatusOr<int> ParseLowerEnumName(const EnumDescriptor* descriptor, absl::string_view prefix,
                                       absl::string_view name, absl::string_view what) {
  std::string full = absl::AsciiStrToUpper(absl::StrCat(prefix, name));
  std::replace(full.begin(), full.end(), '-', '_');
  const auto* v = descriptor->FindValueByName(full);
  if (v != nullptr && v->number() != 0) return v->number();
  std::vector<std::string> names;
  for (int i = 0; i < descriptor->value_count(); ++i) {
    if (descriptor->value(i)->number() == 0) continue;
    names.push_back(LowerEnumName(descriptor, descriptor->value(i)->number(), prefix));
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown ", what, " '", name, "'; want one of ", absl::StrJoin(names, ", ")));
}

// What a transport answers when it is used before its Start made it a stream (a bug).
absl::Status NotStartedStatus() {
  return absl::InternalError("a Decode stream used before its call was started and opened");
}

// An ended stream that reported OK still failed the call that noticed it.
absl::Status EndedStatus(const grpc::Status& status, absl::string_view what) {
  if (!status.ok()) return FromGrpcStatus(status);
  return absl::UnavailableError(
      absl::StrCat("the server ended the ", what, " stream without an error or a reply"));
}

}  // namespace

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

std::string SelectorName(v1::Selector selector) {
  return LowerEnumName(v1::Selector_descriptor(), selector, "SELECTOR_");
}
std::string PlacementName(v1::Placement placement) {
  return LowerEnumName(v1::Placement_descriptor(), placement, "PLACEMENT_");
}
std::string DTypeLowerName(v1::DType dtype) {
  return LowerEnumName(v1::DType_descriptor(), dtype, "DTYPE_");
}
std::string ExactSearchName(v1::ExactSearch search) {
  return LowerEnumName(v1::ExactSearch_descriptor(), search, "EXACT_SEARCH_");
}
std::string PathName(v1::Path path) {
  return LowerEnumName(v1::Path_descriptor(), path, "PATH_");
}

absl::StatusOr<v1::Selector> ParseSelector(absl::string_view name) {
  absl::StatusOr<int> v =
      ParseLowerEnumName(v1::Selector_descriptor(), "SELECTOR_", name, "selector");
  if (!v.ok()) return v.status();
  return static_cast<v1::Selector>(*v);
}
absl::StatusOr<v1::Placement> ParsePlacement(absl::string_view name) {
  absl::StatusOr<int> v =
      ParseLowerEnumName(v1::Placement_descriptor(), "PLACEMENT_", name, "placement");
  if (!v.ok()) return v.status();
  return static_cast<v1::Placement>(*v);
}
absl::StatusOr<v1::DType> ParseDType(absl::string_view name) {
  absl::StatusOr<int> v = ParseLowerEnumName(v1::DType_descriptor(), "DTYPE_", name, "dtype");
  if (!v.ok()) return v.status();
  return static_cast<v1::DType>(*v);
}
absl::StatusOr<v1::GraphScope> ParseGraphScope(absl::string_view name) {
  absl::StatusOr<int> v =
      ParseLowerEnumName(v1::GraphScope_descriptor(), "GRAPH_SCOPE_", name, "graph_scope");
  if (!v.ok()) return v.status();
  return static_cast<v1::GraphScope>(*v);
}
absl::StatusOr<v1::ExactSearch> ParseExactSearch(absl::string_view name) {
  absl::StatusOr<int> v =
      ParseLowerEnumName(v1::ExactSearch_descriptor(), "EXACT_SEARCH_", name, "exact_search");
  if (!v.ok()) return v.status();
  return static_cast<v1::ExactSearch>(*v);
}

v1::Policy CpuPolicy(v1::Selector selector, int top_k, std::optional<int> sinks,
                     std::optional<int> recent) {
  v1::Policy policy;
  policy.set_placement(v1::PLACEMENT_CPU);
  policy.set_selector(selector);
  policy.set_top_k(top_k);
  if (sinks.has_value()) policy.set_sinks(*sinks);
  if (recent.has_value()) policy.set_recent(*recent);
  return policy;
}

// ---------------------------------------------------------------------------------------------

PrefillStream::PrefillStream(v1::KvRecall::Stub& stub, SessionHandle session,
                             PrefillOptions options)
    : session_(std::move(session)),
      options_(std::move(options)) {
  if (options_.timeout != absl::InfiniteDuration()) {
    context_.set_deadline(absl::ToChronoTime(absl::Now() + options_.timeout));
  }
  writer_ = stub.Prefill(&context_, &response_);
}

PrefillStream::~PrefillStream() {
  if (finished_) return;
  // Abandoned: cancel so that the server commits nothing.
  context_.TryCancel();
  writer_->Finish();
}

absl::Status PrefillStream::Fail() {
  if (!finished_) {
    status_ = EndedStatus(writer_->Finish(), "Prefill");
    finished_ = true;
  }
  return status_;
}

absl::Status PrefillStream::SendLayer(int layer, std::span<const float> q, std::span<const float> k,
                                      std::span<const float> v) {
  if (finished_) {
    return status_.ok() ? absl::FailedPreconditionError("the Prefill stream is finished") : status_;
  }
  const v1::Geometry& g = session_.geometry;
  const int64_t q_row = int64_t{g.q_heads()} * g.head_dim();
  const int64_t kv_row = int64_t{g.kv_heads()} * g.head_dim();
  const int64_t tokens = kv_row > 0 ? static_cast<int64_t>(k.size()) / kv_row : 0;
  const bool no_queries = session_.prompt_queries == 0;
  if (tokens < 1 || static_cast<int64_t>(k.size()) != tokens * kv_row || v.size() != k.size() ||
      (static_cast<int64_t>(q.size()) != tokens * q_row && !(no_queries && q.empty()))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prefill layer ", layer, ": q, k, v hold ", q.size(), ", ", k.size(), ", ", v.size(),
        " floats; want T * ", q_row, ", T * ", kv_row, ", T * ", kv_row, " for T >= 1 (q_heads=",
        g.q_heads(), ", kv_heads=", g.kv_heads(), ", head_dim=", g.head_dim(),
        "; q may be empty only for a session that needs no prompt queries, this one's "
        "prompt_queries=", session_.prompt_queries, ")"));
  }
  const int64_t element = DTypeSize(g.dtype());
  const int64_t q_bytes = q_row * element, kv_bytes = 2 * kv_row * element;
  // The first token whose query the session needs: the chunks before it carry k and v alone (as
  // many tokens as the chunk limit holds without q), those from it on q too.
  const int64_t queries_from = session_.prompt_queries < 0
                                   ? 0
                                   : std::max<int64_t>(0, tokens - session_.prompt_queries);
  chunk_.set_session_id(session_.id);
  chunk_.set_layer(layer);
  for (int64_t begin = 0; begin < tokens;) {
    const bool with_q = begin >= queries_from;
    const int64_t token_bytes = kv_bytes + (with_q ? q_bytes : 0);
    const int64_t n = std::min(std::max<int64_t>(1, options_.max_chunk_bytes / token_bytes),
                               (with_q ? tokens : queries_from) - begin);
    const int64_t q_shape[] = {n, g.q_heads(), g.head_dim()};
    const int64_t kv_shape[] = {n, g.kv_heads(), g.head_dim()};
    chunk_.set_offset(begin);
    if (with_q) {
      EncodeTensor(q.subspan(begin * q_row, n * q_row), q_shape, g.dtype(), false,
                   chunk_.mutable_q());
    } else {
      chunk_.clear_q();
    }
    EncodeTensor(k.subspan(begin * kv_row, n * kv_row), kv_shape, g.dtype(), false,
                 chunk_.mutable_k());
    EncodeTensor(v.subspan(begin * kv_row, n * kv_row), kv_shape, g.dtype(), false,
                 chunk_.mutable_v());
    if (!writer_->Write(chunk_)) return Fail();
    bytes_sent_ += n * token_bytes;
    begin += n;
    if (options_.progress) options_.progress({layer, begin, tokens, bytes_sent_});
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::PrefillResponse> PrefillStream::Finish() {
  if (finished_) {
    return status_.ok() ? absl::FailedPreconditionError("the Prefill stream is finished") : status_;
  }
  writer_->WritesDone();
  finished_ = true;
  status_ = FromGrpcStatus(writer_->Finish());
  if (!status_.ok()) return status_;
  return response_;
}

// ---------------------------------------------------------------------------------------------

// The interface DecodeStream steps through: one stream, one request in flight.
class DecodeTransport {
 public:
  virtual ~DecodeTransport() = default;
  // Sends `request` and reads its reply into `response`. Any other outcome ends the stream and
  // returns its status (the server's, or what broke it).
  virtual absl::Status Exchange(const v1::DecodeRequest& request,
                                v1::DecodeResponse* response) = 0;
  // Ends the stream from this side; the server's final status.
  virtual absl::Status Close() = 0;
  // Abandons the stream at once (its replies cannot be trusted any more).
  virtual void Cancel() = 0;
};

namespace {

// A bidirectional gRPC Decode stream.
class GrpcDecodeTransport final : public DecodeTransport {
 public:
  // Starts the call. Apart from the constructor so that Cancel can reach the call while this
  // waits (for a connection to a server that does not answer, say).
  void Start(v1::KvRecall::Stub& stub) { stream_ = stub.Decode(&context_); }

  absl::Status Exchange(const v1::DecodeRequest& request,
                        v1::DecodeResponse* response) override {
    if (stream_ == nullptr) return NotStartedStatus();
    if (stream_->Write(request) && stream_->Read(response)) return absl::OkStatus();
    return EndedStatus(stream_->Finish(), "Decode");
  }
  absl::Status Close() override {
    if (stream_ == nullptr) return NotStartedStatus();
    stream_->WritesDone();
    return FromGrpcStatus(stream_->Finish());
  }
  void Cancel() override { context_.TryCancel(); }

 private:
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::DecodeRequest, v1::DecodeResponse>> stream_;
};

namespace shared = ::kvrecall::v1::shared_decode;

// A DecodeShared stream: the call (a callback reactor) brings the region and, at the end, the
// final status; the steps go through the region (proto/shared_decode_region.h).
class SharedDecodeTransport final : public DecodeTransport,
                                    public grpc::ClientReadReactor<v1::SharedDecodeRegion> {
 public:
  explicit SharedDecodeTransport(absl::Duration spin) : spin_(spin) {}

  ~SharedDecodeTransport() override {
    if (!started_) return;  // no call
    if (!done_.HasBeenNotified()) context_.TryCancel();
    AwaitDone();  // the reactor must outlive the call
  }

  absl::Status Exchange(const v1::DecodeRequest& request,
                        v1::DecodeResponse* response) override {
    shared::RegionHeader* const h = region_.header();
    if (h == nullptr) return NotStartedStatus();
    const size_t size = request.ByteSizeLong();
    if (size > region_.request_capacity()) {
      // Nothing was sent; the stream is abandoned all the same, as a gRPC stream would be
      // by a message over its limit.
      Cancel();
      return absl::ResourceExhaustedError(absl::StrCat(
          "a Decode request of ", size, " bytes exceeds the shared region's max_request_bytes of ",
          region_.request_capacity(), "; nothing of it was sent (DecodeStreamOptions)"));
    }
    if (h->ended.load()) return EndStatus();
    request.SerializeWithCachedSizesToArray(reinterpret_cast<uint8_t*>(region_.request()));
    h->request_bytes = static_cast<uint32_t>(size);
    h->closing = 0;
    const uint32_t seq = h->request_seq.load() + 1;
    h->request_seq.store(seq);
    shared::Signal(&h->request_signal, &h->server_sleeping);
    if (!AwaitReply(seq)) return EndStatus();
    const uint64_t bytes = shared::ReadPeerWord(h->reply_bytes);
    const auto code = static_cast<int32_t>(
        shared::ReadPeerWord(reinterpret_cast<uint32_t&>(h->status_code)));
    if (code != 0) {
      // The step failed and the stream ended (the call ends with the same status, its message
      // whole: the reply area's is cut to its capacity, which lost "nothing of it was
      // applied" from a 64-byte one: probe 28, 7).
      const std::string message(region_.reply(), std::min(bytes, region_.reply_capacity()));
      AwaitDone();
      if (static_cast<int32_t>(final_status_.error_code()) == code &&
          !final_status_.error_message().empty()) {
        return FromGrpcStatus(final_status_);
      }
      return absl::Status(static_cast<absl::StatusCode>(code), message);
    }
    if (bytes > region_.reply_capacity() ||
        !response->ParseFromArray(region_.reply(), static_cast<int>(bytes))) {
      Cancel();
      return absl::InternalError(absl::StrCat("the shared region's reply of ", bytes,
                                              " bytes is not a DecodeResponse"));
    }
    return absl::OkStatus();
  }

  absl::Status Close() override {
    shared::RegionHeader* const h = region_.header();
    if (h == nullptr) return NotStartedStatus();
    if (!h->ended.load()) {
      h->request_bytes = 0;
      h->closing = 1;
      const uint32_t seq = h->request_seq.load() + 1;
      h->request_seq.store(seq);
      shared::Signal(&h->request_signal, &h->server_sleeping);
      AwaitReply(seq);
    }
    AwaitDone();
    return FromGrpcStatus(final_status_);
  }

  void Cancel() override { context_.TryCancel(); }

  void OnReadDone(bool ok) override {
    const GrpcReaction reaction(this);
    if (!got_first_read_) {
      got_first_read_ = true;
      have_region_ = ok;
      HandoffToWaiter(this);
      first_read_.Notify();
    }
    // Read on until the call ends (OnDone follows): its end is how a dead server or a
    // cancellation shows.
    if (ok) {
      HandoffToGrpc(this);
      StartRead(&ignored_);
    }
  }

  void OnDone(const grpc::Status& status) override {
    ReactionFromGrpc(this);
    final_status_ = status;
    call_done_.store(true);
    // Wakes a Step asleep on the region (the server may be gone without a word there).
    if (shared::RegionHeader* h = mapped_.load(); h != nullptr) {
      shared::Signal(&h->reply_signal, &h->runner_sleeping);
    }
    HandoffToWaiter(this);
    if (!first_read_.HasBeenNotified()) first_read_.Notify();
    HandoffToWaiter(this);  // again: the check above, too, comes before the owner's delete
    done_.Notify();
  }

  // Opens the call and maps the region it answers. Apart from the constructor so that Cancel
  // can reach the call while this waits for the region.
  absl::Status Start(v1::KvRecall::Stub& stub, const DecodeStreamOptions& options) {
    started_ = true;
    open_request_.set_max_request_bytes(options.max_request_bytes);
    open_request_.set_max_reply_bytes(options.max_reply_bytes);
    stub.async()->DecodeShared(&context_, &open_request_, this);
    StartRead(&region_message_);
    HandoffToGrpc(this);
    StartCall();
    first_read_.WaitForNotification();
    TakeFromReaction(this);
    if (!have_region_) {
      AwaitDone();
      return EndedStatus(final_status_, "DecodeShared");
    }
    if (region_message_.layout_version() != shared::kLayoutVersion) {
      Cancel();
      return absl::FailedPreconditionError(
          absl::StrCat("the server's shared decode region has layout version ",
                       region_message_.layout_version(), "; this client speaks ",
                       shared::kLayoutVersion));
    }
    absl::StatusOr<shared::MappedRegion> region =
        shared::MappedRegion::Open(region_message_.path(), region_message_.bytes());
    if (!region.ok()) {
      Cancel();
      return absl::Status(region.status().code(),
                          absl::StrCat("DecodeShared: ", region.status().message(),
                                       " (is this runner on the server's host, with access to "
                                       "its --shared_memory_dir?)"));
    }
    region_ = *std::move(region);
    mapped_.store(region_.header());
    return absl::OkStatus();
  }

 private:
  // Waits for OnDone (and takes what it wrote: final_status_).
  void AwaitDone() {
    done_.WaitForNotification();
    TakeFromReaction(this);
  }

  // Waits for the reply to request `seq`; false when the stream ended without it.
  bool AwaitReply(uint32_t seq) {
    shared::RegionHeader* const h = region_.header();
    return shared::WaitUntil(
               &h->reply_signal, &h->runner_sleeping, spin_, absl::Milliseconds(10),
               [&] { return h->reply_seq.load() == seq || h->ended.load(); },
               [&] { return call_done_.load(); }) &&
           h->reply_seq.load() == seq;
  }

  // The stream ended without a reply: the call's final status, once it is there.
  absl::Status EndStatus() {
    AwaitDone();
    return EndedStatus(final_status_, "DecodeShared");
  }

  const absl::Duration spin_;
  bool started_ = false;  // Start ran: there is a call to wait for
  grpc::ClientContext context_;
  v1::SharedDecodeRequest open_request_;  // gRPC may read it until the call is done
  v1::SharedDecodeRegion region_message_;
  v1::SharedDecodeRegion ignored_;
  bool got_first_read_ = false;  // gRPC's reactions are serialized; read after first_read_
  bool have_region_ = false;
  absl::Notification first_read_;
  shared::MappedRegion region_;
  std::atomic<shared::RegionHeader*> mapped_{nullptr};
  std::atomic<bool> call_done_{false};
  grpc::Status final_status_;  // written before done_ is notified
  absl::Notification done_;
};

}  // namespace

// Cancels a DecodeStream's exchange that outlasts step_timeout. Its thread sleeps until the
// armed exchange's deadline, or for one step_timeout while none is armed (an exchange armed
// meanwhile has a later deadline than that wake-up), so that arming costs a lock and no
// wake-up: a stream stepping without pause wakes it about once per step_timeout.
class DecodeStream::Watchdog {
 public:
  Watchdog(DecodeStream* stream, absl::Duration timeout)
      : stream_(stream),
        timeout_(absl::ToChronoNanoseconds(timeout)),
        thread_([this] { Run(); }) {}
  ~Watchdog() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    wake_.notify_one();
    thread_.join();
  }

  void Arm() {
    std::lock_guard<std::mutex> lock(mu_);
    deadline_ = Clock::now() + timeout_;
    armed_ = true;
    fired_ = false;
  }
  // Ends the watch. After it no cancellation comes (one under way has finished).
  void Disarm() {
    std::lock_guard<std::mutex> lock(mu_);
    armed_ = false;
  }

 private:
  using Clock = std::chrono::steady_clock;

  void Run() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      const Clock::time_point wake = armed_ && !fired_ ? deadline_ : Clock::now() + timeout_;
      wake_.wait_until(lock, wake, [&] { return stop_; });
      if (!stop_ && armed_ && !fired_ && Clock::now() >= deadline_) {
        fired_ = true;
        stream_->TimeOut();
      }
    }
  }

  DecodeStream* const stream_;
  const std::chrono::nanoseconds timeout_;
  std::mutex mu_;
  std::condition_variable wake_;  // for stop_ alone
  bool stop_ = false;
  bool armed_ = false;
  bool fired_ = false;
  Clock::time_point deadline_;
  std::thread thread_;  // last: Run reads the members above
};

DecodeStream::DecodeStream(std::shared_ptr<grpc::Channel> channel, int64_t max_reply_bytes,
                           const v1::Geometry& geometry, const DecodeStreamOptions& options)
    : stub_(v1::KvRecall::NewStub(std::move(channel))), geometry_(geometry), options_(options) {
  // A shared region's reply area is the bound there (the server checks it).
  if (!options_.shared_memory) request_.set_max_reply_bytes(max_reply_bytes);
  if (options_.step_timeout != absl::InfiniteDuration()) {
    watchdog_ = std::make_unique<Watchdog>(this, options_.step_timeout);
  }
}

DecodeStream::~DecodeStream() {
  Close().IgnoreError();
  watchdog_.reset();  // its thread may call TimeOut until it is joined
}

void DecodeStream::CancelTransport() {
  absl::MutexLock lock(&transport_mu_);
  if (transport_ != nullptr) transport_->Cancel();
}

void DecodeStream::TimeOut() {
  absl::MutexLock lock(&transport_mu_);
  timed_out_ = true;  // the watchdog is armed only while an exchange is in flight
  if (transport_ != nullptr) transport_->Cancel();
}

void DecodeStream::Cancel() {
  absl::MutexLock lock(&transport_mu_);
  if (in_flight_) {
    cancelled_ = true;
  } else {
    abandoned_ = true;
  }
  if (transport_ != nullptr) transport_->Cancel();
}

void DecodeStream::SetTransport(std::unique_ptr<DecodeTransport> transport) {
  absl::MutexLock lock(&transport_mu_);
  transport_ = std::move(transport);
  // A Cancel or time-out that came while there was no stream to cancel is for this one.
  if (cancelled_ || timed_out_) transport_->Cancel();
}

void DecodeStream::DropTransport() {
  std::unique_ptr<DecodeTransport> dropped;
  {
    absl::MutexLock lock(&transport_mu_);
    dropped = std::move(transport_);
  }
  // Destroyed outside the lock: a shared stream's waits for its call's end.
}

absl::Status DecodeStream::Open() {
  DropTransport();
  ++streams_opened_;
  status_ = absl::OkStatus();
  if (!options_.shared_memory) {
    auto transport = std::make_unique<GrpcDecodeTransport>();
    GrpcDecodeTransport* const started = transport.get();
    SetTransport(std::move(transport));
    started->Start(*stub_);  // its failures show at the first exchange
    return absl::OkStatus();
  }
  auto transport = std::make_unique<SharedDecodeTransport>(options_.spin);
  SharedDecodeTransport* const started = transport.get();
  SetTransport(std::move(transport));
  absl::Status status = started->Start(*stub_, options_);
  if (!status.ok()) DropTransport();
  return status;
}

absl::Status DecodeStream::Watched(absl::string_view what, const bool& carries_step,
                                   const absl::FunctionRef<absl::Status()> body) {
  bool abandoned;
  {
    absl::MutexLock lock(&transport_mu_);
    in_flight_ = true;
    abandoned = abandoned_;
    abandoned_ = false;
  }
  if (abandoned) {
    // The stream Cancel abandoned between exchanges: this one goes on a new stream.
    DropTransport();
    status_ = absl::CancelledError("the Decode stream was cancelled (DecodeStream::Cancel)");
  }
  if (watchdog_ != nullptr) watchdog_->Arm();
  absl::Status status = body();
  if (watchdog_ != nullptr) watchdog_->Disarm();
  bool timed_out;
  bool cancelled;
  {
    absl::MutexLock lock(&transport_mu_);
    in_flight_ = false;
    timed_out = timed_out_;
    cancelled = cancelled_;
    timed_out_ = false;
    cancelled_ = false;
  }
  if (!timed_out && !cancelled) return status;
  // The stream was cancelled under the exchange: it is no longer of use, whatever came back.
  DropTransport();
  // An answer to a step that came before the cancellation is kept: its reply, or the server's
  // refusal (ABORTED: a resent step was applied). Any other failure is the cancellation's (a
  // region whose file the cancelled call took with it, say): restated as such.
  if (status.ok() || (carries_step && status.code() != absl::StatusCode::kCancelled)) {
    return status;
  }
  // What a step broken off may have done, and what to do next.
  constexpr absl::string_view kStepAdvice =
      " A step the server had not begun when the cancellation reached it is not applied; one it "
      "had begun, or read before (a stalled server), may be: resend it with its positions "
      "(ABORTED: it was applied). The next Step opens a new stream";
  const std::string why =
      timed_out ? absl::StrCat(": no answer within DecodeStreamOptions::step_timeout (",
                               absl::FormatDuration(options_.step_timeout), ")")
                : ": cancelled by DecodeStream::Cancel";
  return absl::Status(
      timed_out ? absl::StatusCode::kDeadlineExceeded : absl::StatusCode::kCancelled,
      absl::StrCat(what, why, "; the stream was cancelled (", status.message(), ").",
                   carries_step ? kStepAdvice : ""));
}

absl::Status DecodeStream::OpenWatched() {
  return Watched("opening the Decode stream", /*carries_step=*/false, [this] { return Open(); });
}

absl::Status DecodeStream::Close() {
  closed_ = true;
  status_ = Watched("closing the Decode stream", /*carries_step=*/false, [this] {
    if (transport_ == nullptr) return status_;
    absl::Status end = transport_->Close();
    DropTransport();
    return end;
  });
  return status_;
}

absl::Status DecodeStream::Step(int layer, std::span<const SequenceInput> batch,
                                const StepOptions& options, StepResult* result) {
  if (closed_) return absl::FailedPreconditionError("the Decode stream is closed");
  const v1::Geometry& g = geometry_;
  const int64_t q_row[] = {g.q_heads(), g.head_dim()};
  const int64_t kv_row[] = {g.kv_heads(), g.head_dim()};
  const size_t q_size = static_cast<size_t>(q_row[0] * q_row[1]);
  const size_t kv_size = static_cast<size_t>(kv_row[0] * kv_row[1]);

  const uint64_t request_id = next_request_id_++;
  request_.set_request_id(request_id);
  request_.set_layer(layer);
  request_.set_return_lse(options.return_lse);
  request_.set_diagnostics(options.diagnostics);
  request_.set_compare_exact(options.compare_exact);
  // RemoveLast/Add keep cleared messages for reuse, so a warm request allocates nothing here.
  auto* steps = request_.mutable_steps();
  while (steps->size() > static_cast<int>(batch.size())) steps->RemoveLast();
  while (steps->size() < static_cast<int>(batch.size())) steps->Add();
  for (size_t i = 0; i < batch.size(); ++i) {
    const SequenceInput& in = batch[i];
    if (in.q.size() != q_size || in.k_new.size() != kv_size || in.v_new.size() != kv_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "decode batch[", i, "]: q, k_new, v_new hold ", in.q.size(), ", ", in.k_new.size(), ", ",
          in.v_new.size(), " floats; want ", q_size, ", ", kv_size, ", ", kv_size));
    }
    v1::SequenceStep& step = (*steps)[static_cast<int>(i)];
    step.mutable_session_id()->assign(in.session_id.data(), in.session_id.size());
    EncodeTensor(in.q, q_row, g.dtype(), false, step.mutable_q());
    EncodeTensor(in.k_new, kv_row, g.dtype(), false, step.mutable_k_new());
    EncodeTensor(in.v_new, kv_row, g.dtype(), false, step.mutable_v_new());
    if (in.position.has_value()) {
      step.set_position(*in.position);
    } else {
      step.clear_position();  // the message is reused from the last Step
    }
  }
  bool sent = false;  // by then the step may have reached the server
  absl::Status exchanged = Watched("Decode step", sent, [this, &sent] {
    if (transport_ == nullptr) {  // the last one ended on a failed step: continue anew
      if (absl::Status s = Open(); !s.ok()) return s;
    }
    sent = true;
    absl::Status s = transport_->Exchange(request_, &response_);
    if (!s.ok()) DropTransport();
    return s;
  });
  if (!exchanged.ok()) {
    status_ = exchanged;
    return exchanged;
  }
  if (response_.request_id() != request_id ||
      response_.results_size() != static_cast<int>(batch.size())) {
    // Replies no longer pair with requests: this stream cannot be trusted any further.
    CancelTransport();
    DropTransport();
    return absl::InternalError(absl::StrCat(
        "Decode reply mismatch: request_id ", response_.request_id(), " with ",
        response_.results_size(), " results for request ", request_id, " of ", batch.size()));
  }
  result->output.resize(batch.size() * q_size);
  result->lse.resize(options.return_lse ? batch.size() * q_row[0] : 0);
  const int64_t lse_row[] = {g.q_heads()};
  for (size_t i = 0; i < batch.size(); ++i) {
    const v1::SequenceResult& r = response_.results(static_cast<int>(i));
    if (absl::Status s =
            DecodeTensor(r.output(), {"DecodeResponse.results[].output", q_row, false, g.dtype()},
                         result->output.data() + i * q_size);
        !s.ok()) {
      return s;
    }
    if (options.return_lse) {
      if (absl::Status s =
              DecodeTensor(r.lse(), {"DecodeResponse.results[].lse", lse_row, false, v1::DTYPE_F32},
                           result->lse.data() + i * q_row[0]);
          !s.ok()) {
        return s;
      }
    }
  }
  result->response = &response_;
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------

namespace {

// OK when `options` can serve a Client: a positive call_timeout and receive limit, and, for
// Connect's own channel, channel_arguments without the two Connect sets (for a channel of the
// caller's, none: they would be ignored).
absl::Status CheckClientOptions(const ClientOptions& options, bool own_channel) {
  if (options.call_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("ClientOptions.call_timeout must be positive, got ",
                     absl::FormatDuration(options.call_timeout)));
  }
  if (options.max_message_bytes.has_value() && *options.max_message_bytes <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ClientOptions.max_message_bytes must be positive, got ", *options.max_message_bytes));
  }
  const grpc_channel_args given = options.channel_arguments.c_channel_args();
  // What a default ChannelArguments holds already (gRPC's user agent) is no argument of ours.
  static const grpc::ChannelArguments* const defaults = new grpc::ChannelArguments();
  const grpc_channel_args none = defaults->c_channel_args();
  const bool arguments =
      std::any_of(given.args, given.args + given.num_args, [&](const grpc_arg& a) {
        return std::none_of(none.args, none.args + none.num_args,
                            [&](const grpc_arg& d) { return std::strcmp(a.key, d.key) == 0; });
      });
  if (!own_channel && arguments) {
    return absl::InvalidArgumentError(
        "ClientOptions.channel_arguments are for Connect's channel: a Client on a channel of "
        "the caller's takes none (set them on that channel)");
  }
  for (size_t i = 0; i < given.num_args; ++i) {
    const absl::string_view key = given.args[i].key;
    if (key == GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH || key == GRPC_SSL_TARGET_NAME_OVERRIDE_ARG) {
      return absl::InvalidArgumentError(absl::StrCat(
          "ClientOptions.channel_arguments: ", key,
          " is Connect's to set (ClientOptions.max_message_bytes, ChannelSecurity.server_name)"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

Client::Client(std::shared_ptr<grpc::Channel> channel, const ClientOptions& options)
    : channel_(std::move(channel)),
      stub_(v1::KvRecall::NewStub(channel_)),
      options_(options),
      unusable_(CheckClientOptions(options, /*own_channel=*/false)) {}

namespace {

// `options` with the receive limit Connect gives its channel set, and without the channel
// arguments, which are the channel's now.
ClientOptions WithConnectLimit(ClientOptions options) {
  if (!options.max_message_bytes.has_value()) options.max_message_bytes = kDefaultMaxMessageBytes;
  options.channel_arguments = grpc::ChannelArguments();
  return options;
}

}  // namespace

std::unique_ptr<Client> Client::Connect(const std::string& address,
                                        const ClientOptions& options) {
  const ClientOptions limited = WithConnectLimit(options);
  grpc::ChannelArguments args = options.channel_arguments;
  args.SetMaxReceiveMessageSize(std::max(*limited.max_message_bytes, 1));
  auto client = std::make_unique<Client>(
      grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args), limited);
  if (client->unusable_.ok()) client->unusable_ = CheckServerAddress(address);
  if (client->unusable_.ok()) client->unusable_ = CheckClientOptions(options, true);
  return client;
}

void Client::PrepareUnary(grpc::ClientContext* context) const {
  if (options_.call_timeout != absl::InfiniteDuration()) {
    context->set_deadline(absl::ToChronoTime(absl::Now() + options_.call_timeout));
  }
}

namespace {

// A PEM file's text, which must hold a block of `kind` ("CERTIFICATE"; "PRIVATE KEY" matches
// "RSA PRIVATE KEY" and "EC PRIVATE KEY" too): a key given as the CA, or the reverse, failed
// only as a server that never answered. `what` names it in errors ("ca_file").
absl::StatusOr<std::string> ReadPemFile(const std::string& path, absl::string_view what,
                                        absl::string_view kind) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(what, ": cannot read ", path));
  std::ostringstream text;
  text << in.rdbuf();
  if (!absl::StrContains(text.str(), "-----BEGIN ")) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", path, " is not a PEM file"));
  }
  if (!absl::StrContains(text.str(), absl::StrCat(" ", kind, "-----"))) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": ", path, " holds no PEM ", kind, " block"));
  }
  return text.str();
}

// OK when `token` can travel as an "authorization: Bearer" header: printable ASCII without
// blanks, as kvrecalld's --auth_token_file lists them. A newline (a token file read whole) or a
// non-ASCII character failed every call as UNAVAILABLE "Illegal metadata", which a retry never
// mends.
absl::Status CheckToken(absl::string_view token) {
  for (size_t i = 0; i < token.size(); ++i) {
    if (!absl::ascii_isgraph(static_cast<unsigned char>(token[i]))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "token: character ", i + 1, " of ", token.size(),
          " is not printable ASCII (a bearer token has no blanks or newlines: ReadTokenFile "
          "takes a file's first line without them)"));
    }
  }
  return absl::OkStatus();
}

// OK when a bearer token may go in plaintext to the Unix socket of `target`: a socket (not a
// link) that this user owns. kvrecalld makes its socket 0600, so a runner that may connect runs
// as its user; gRPC's local credentials authenticate no server, and without this check a token
// alone would go to whatever listens at the path (another user's process in a shared /tmp).
// (Not its directory: a pod's emptyDir is 0777, shared by the pod's own containers alone.)
// FAILED_PRECONDITION otherwise.
absl::Status CheckOwnSocket(absl::string_view target) {
  const std::string path = UnixSocketPath(target);
  auto refuse = [&](absl::string_view why) {
    return absl::FailedPreconditionError(absl::StrCat(
        "a bearer token goes in plaintext only to a Unix socket of this user's: ", path, " ",
        why, "; ask for TLS to send it there"));
  };
  struct stat socket_stat;
  if (::lstat(path.c_str(), &socket_stat) != 0) {
    return refuse(absl::StrCat("cannot be read (", std::strerror(errno), ")"));
  }
  if (!S_ISSOCK(socket_stat.st_mode)) return refuse("is not a socket");
  if (socket_stat.st_uid != ::geteuid()) {
    return refuse(absl::StrCat("belongs to uid ", socket_stat.st_uid, ", this process is uid ",
                               ::geteuid()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const ChannelSecurity& security, absl::string_view target) {
  if (!security.secure()) return grpc::InsecureChannelCredentials();
  if (absl::Status s = CheckToken(security.token); !s.ok()) return s;
  if (!security.tls_requested()) {  // a token alone: where it may go depends on the target
    if (absl::StartsWith(target, "unix-abstract:")) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a bearer token to ", target, " without TLS: an abstract socket has no file "
          "permissions (any process of the network namespace may connect), so kvrecalld never "
          "serves one in plaintext; ask for TLS, or connect to a unix:PATH socket"));
    }
    if (absl::StartsWith(target, "unix:")) {
      // Plaintext on a Unix socket (kvrecalld --plaintext_unix_sockets): gRPC's local
      // credentials refuse any other kind of connection and, counting a Unix socket as
      // private, send call credentials over it, which they never do over plaintext TCP.
      if (absl::Status s = CheckOwnSocket(target); !s.ok()) return s;
      return grpc::CompositeChannelCredentials(grpc::experimental::LocalCredentials(UDS),
                                               grpc::AccessTokenCredentials(security.token));
    }
    // HOST:PORT (or any other target): TLS with the system's roots, below.
  }
  if (security.cert_file.empty() != security.key_file.empty()) {
    return absl::InvalidArgumentError(
        "cert_file and key_file go together (a client certificate for mutual TLS)");
  }
  grpc::SslCredentialsOptions ssl;
  if (!security.ca_file.empty()) {
    absl::StatusOr<std::string> ca = ReadPemFile(security.ca_file, "ca_file", "CERTIFICATE");
    if (!ca.ok()) return ca.status();
    ssl.pem_root_certs = *std::move(ca);
  }
  if (!security.cert_file.empty()) {
    absl::StatusOr<std::string> cert = ReadPemFile(security.cert_file, "cert_file", "CERTIFICATE");
    if (!cert.ok()) return cert.status();
    absl::StatusOr<std::string> key = ReadPemFile(security.key_file, "key_file", "PRIVATE KEY");
    if (!key.ok()) return key.status();
    ssl.pem_cert_chain = *std::move(cert);
    ssl.pem_private_key = *std::move(key);
  }
  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::SslCredentials(ssl);
  if (!security.token.empty()) {
    credentials = grpc::CompositeChannelCredentials(
        credentials, grpc::AccessTokenCredentials(security.token));
  }
  return credentials;
}

absl::StatusOr<std::string> ReadTokenFile(const std::string& path) {
  errno = 0;
  std::ifstream in(path);
  if (!in) {
    const int error = errno;
    return absl::NotFoundError(
        absl::StrCat("cannot read ", path, error != 0 ? absl::StrCat(": ", strerror(error)) : ""));
  }
  std::string line;
  if (!std::getline(in, line)) {
    if (in.bad()) return absl::NotFoundError(absl::StrCat("cannot read ", path));
    return absl::InvalidArgumentError(
        absl::StrCat(path, " is empty (its first line should be the bearer token)"));
  }
  std::string token(absl::StripAsciiWhitespace(line));
  if (token.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, " starts with an empty line (its first line should be the token)"));
  }
  return token;
}

absl::Status CheckServerAddress(absl::string_view address) {
  if (absl::StrContains(address, "://") || absl::StartsWith(address, "unix:") ||
      absl::StartsWith(address, "unix-abstract:") || absl::StartsWith(address, "dns:") ||
      absl::StartsWith(address, "ipv4:") || absl::StartsWith(address, "ipv6:")) {
    return absl::OkStatus();  // gRPC's own schemes: its resolvers check them
  }
  if (const std::optional<int64_t> port = PortOfHostPort(address);
      !port.has_value() || *port < 1 || *port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "server address '", address,
        "' must be HOST:PORT with a port in [1, 65535] (an IPv6 host in brackets: [::1]:50051), "
        "unix:PATH or unix-abstract:NAME (gRPC would take the port modulo 2^16, or 443 where "
        "none is given)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const std::string& address,
                                                        const ChannelSecurity& security,
                                                        const ClientOptions& options) {
  if (absl::Status s = CheckServerAddress(address); !s.ok()) return s;
  if (absl::Status s = CheckClientOptions(options, /*own_channel=*/true); !s.ok()) return s;
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials =
      MakeChannelCredentials(security, address);
  if (!credentials.ok()) return credentials.status();
  const ClientOptions limited = WithConnectLimit(options);
  grpc::ChannelArguments args = options.channel_arguments;
  args.SetMaxReceiveMessageSize(*limited.max_message_bytes);
  if (!security.server_name.empty()) args.SetSslTargetNameOverride(security.server_name);
  return std::make_unique<Client>(grpc::CreateCustomChannel(address, *credentials, args),
                                  limited);
}

absl::StatusOr<SessionHandle> Client::CreateSession(const v1::Geometry& geometry,
                                                    const v1::Policy& policy,
                                                    absl::string_view label,
                                                    int64_t max_tokens,
                                                    absl::string_view request_id) {
  v1::CreateSessionRequest request;
  *request.mutable_geometry() = geometry;
  *request.mutable_policy() = policy;
  request.set_label(std::string(label));
  request.set_max_tokens(max_tokens);
  request.set_request_id(std::string(request_id));
  if (!unusable_.ok()) return unusable_;
  v1::CreateSessionResponse response;
  grpc::ClientContext context;
  PrepareUnary(&context);
  if (absl::Status s = FromGrpcStatus(stub_->CreateSession(&context, request, &response));
      !s.ok()) {
    return s;
  }
  return SessionHandle{response.session_id(), geometry, response.policy(),
                       response.has_prompt_queries() ? response.prompt_queries() : -1};
}

absl::StatusOr<std::unique_ptr<PrefillStream>> Client::StartPrefill(const SessionHandle& session,
                                                                    PrefillOptions options) {
  if (!unusable_.ok()) return unusable_;
  if (options.max_chunk_bytes < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("PrefillOptions.max_chunk_bytes must be >= 1, got ", options.max_chunk_bytes));
  }
  if (options.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("PrefillOptions.timeout must be positive, got ",
                                                   absl::FormatDuration(options.timeout)));
  }
  return std::unique_ptr<PrefillStream>(new PrefillStream(*stub_, session, std::move(options)));
}

absl::StatusOr<std::unique_ptr<DecodeStream>> Client::OpenDecodeStream(
    const v1::Geometry& geometry, const DecodeStreamOptions& options) {
  if (!unusable_.ok()) return unusable_;
  if (geometry.q_heads() < 1 || geometry.kv_heads() < 1 || geometry.head_dim() < 1 ||
      DTypeSize(geometry.dtype()) == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("OpenDecodeStream needs a geometry with heads, head_dim and a dtype; got ",
                     geometry.ShortDebugString()));
  }
  if (options.step_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("DecodeStreamOptions.step_timeout must be positive, got ",
                     absl::FormatDuration(options.step_timeout)));
  }
  std::unique_ptr<DecodeStream> stream(
      new DecodeStream(channel_, options_.max_message_bytes.value_or(0), geometry, options));
  if (absl::Status s = stream->OpenWatched(); !s.ok()) return s;
  return stream;
}

absl::StatusOr<v1::SessionInfo> Client::GetSession(absl::string_view session_id) {
  if (!unusable_.ok()) return unusable_;
  v1::GetSessionRequest request;
  request.set_session_id(std::string(session_id));
  v1::SessionInfo info;
  grpc::ClientContext context;
  PrepareUnary(&context);
  if (absl::Status s = FromGrpcStatus(stub_->GetSession(&context, request, &info)); !s.ok()) {
    return s;
  }
  return info;
}

absl::StatusOr<std::vector<v1::SessionInfo>> Client::ListSessions() {
  if (!unusable_.ok()) return unusable_;
  std::vector<v1::SessionInfo> sessions;
  v1::ListSessionsRequest request;
  do {
    v1::ListSessionsResponse response;
    grpc::ClientContext context;
    PrepareUnary(&context);
    if (absl::Status s = FromGrpcStatus(stub_->ListSessions(&context, request, &response));
        !s.ok()) {
      return s;
    }
    for (v1::SessionInfo& info : *response.mutable_sessions()) sessions.push_back(std::move(info));
    request.set_page_token(response.next_page_token());
  } while (!request.page_token().empty());
  return sessions;
}

absl::Status Client::CloseSession(absl::string_view session_id) {
  if (!unusable_.ok()) return unusable_;
  v1::CloseSessionRequest request;
  request.set_session_id(std::string(session_id));
  v1::CloseSessionResponse response;
  grpc::ClientContext context;
  PrepareUnary(&context);
  return FromGrpcStatus(stub_->CloseSession(&context, request, &response));
}

}  // namespace kvrecall::client
