#include "server/health.h"

#include <algorithm>
#include <string>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

#include "proto/tsan_handoff.h"
#include "server/raw_messages.h"

namespace kvrecall {

using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

namespace {

// A health request names a service (the longest this server answers for has 21 bytes). Health
// needs no token, so one larger is refused at once, before it is parsed or copied: a Watch
// held the request's bytes for its life, and streams of 60 MB names (gzip makes them 60 KB on
// the wire) took gigabytes (probe 26, 1).
constexpr size_t kMaxRequestBytes = 1024;
// The host part of gRPC's peer string ("ipv4:10.0.0.7:5000" -> "ipv4:10.0.0.7", IPv6 alike);
// any other peer ("unix:..."; Unix-socket peers carry no identity of their own) is its whole.
std::string PeerHost(absl::string_view peer) {
  if (!absl::StartsWith(peer, "ipv4:") && !absl::StartsWith(peer, "ipv6:")) {
    return std::string(peer);
  }
  const size_t port = peer.rfind(':');
  return std::string(peer.substr(0, port));
}

// INVALID_ARGUMENT for a request of more than kMaxRequestBytes.
grpc::Status CheckRequestSize(const grpc::ByteBuffer& request) {
  if (request.Length() <= kMaxRequestBytes) return grpc::Status::OK;
  return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                      absl::StrCat("a health check request of ", request.Length(),
                                   " bytes: at most ", kMaxRequestBytes, " (a service name)"));
}

}  // namespace

// One Watch call: sends the status now and again whenever it changes; ends after sending
// NOT_SERVING at shutdown, or when the client goes away.
class HealthService::WatchCall final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  WatchCall(HealthService* health, std::string service)
      : health_(health), service_(std::move(service)) {}

  // The host it was registered under (HealthService::Register); empty while it is not.
  std::string& host() { return host_; }

  // Sends the current status unless it was sent already or a write is pending (its completion
  // looks again).
  void Update() {
    absl::MutexLock lock(&mu_);
    UpdateLocked();
  }

  // Ends the call with `status` before anything was sent.
  void FinishWith(grpc::Status status) {
    absl::MutexLock lock(&mu_);
    FinishLocked(std::move(status));
  }

  void OnWriteDone(bool ok) override {
    const GrpcReaction reaction(this);
    absl::MutexLock lock(&mu_);
    writing_ = false;
    if (finished_) return;
    // A cancellation during the write (OnCancel left the finish to here): the write may still
    // have succeeded, and nothing else would ever finish the call (no read is pending), which
    // kept its Watch slot and connection until shutdown (probe 27, 1).
    if (!ok || cancelled_) return FinishLocked(grpc::Status::CANCELLED);
    UpdateLocked();
  }

  void OnCancel() override {
    const GrpcReaction reaction(this);
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
    if (!finished_ && !writing_) FinishLocked(grpc::Status::CANCELLED);
  }

  void OnDone() override {
    ReactionFromGrpc(this);
    health_->Unregister(this);
    HealthService* const health = health_;
    delete this;
    HandoffToGrpc(health);  // the last touch of the service: Server::Wait returns after it
  }

 private:
  void UpdateLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_ || writing_) return;
    // After the shutdown nothing changes any more: what is sent then is the last word.
    const bool last = health_->shut_down_.load();
    const ServingStatus now = health_->StatusOf(service_);
    if (now == sent_) {
      if (last) FinishLocked(grpc::Status::OK);
      return;
    }
    HealthCheckResponse response;
    response.set_status(now);
    SerializeRawMessage(response, &out_);
    sent_ = now;
    HandoffToGrpc(this);
    if (last) {
      finished_ = true;
      StartWriteAndFinish(&out_, grpc::WriteOptions(), grpc::Status::OK);
    } else {
      writing_ = true;
      StartWrite(&out_);
    }
  }
  void FinishLocked(grpc::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    finished_ = true;
    HandoffToGrpc(this);
    Finish(std::move(status));
  }

  HealthService* const health_;
  const std::string service_;
  std::string host_;  // guarded by health_->watches_mu_
  absl::Mutex mu_;
  grpc::ByteBuffer out_ ABSL_GUARDED_BY(mu_);
  ServingStatus sent_ ABSL_GUARDED_BY(mu_) = HealthCheckResponse::UNKNOWN;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

HealthService::HealthService(std::vector<std::string> services) : services_(std::move(services)) {}

void HealthService::Shutdown() {
  shut_down_.store(true);
  absl::MutexLock lock(&watches_mu_);
  for (WatchCall* watch : watches_) watch->Update();
}

HealthService::ServingStatus HealthService::StatusOf(const std::string& service) const {
  const bool known =
      service.empty() || std::find(services_.begin(), services_.end(), service) != services_.end();
  if (!known) return HealthCheckResponse::SERVICE_UNKNOWN;
  return shut_down_.load() ? HealthCheckResponse::NOT_SERVING : HealthCheckResponse::SERVING;
}

grpc::ServerUnaryReactor* HealthService::Check(grpc::CallbackServerContext* context,
                                               const grpc::ByteBuffer* request,
                                               grpc::ByteBuffer* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (grpc::Status too_large = CheckRequestSize(*request); !too_large.ok()) {
    reactor->Finish(std::move(too_large));
    return reactor;
  }
  HealthCheckRequest parsed;
  grpc::ByteBuffer bytes(*request);
  if (!ParseRawMessage(&bytes, &parsed)) {
    reactor->Finish(UnparsableStatus("the request", parsed));
    return reactor;
  }
  const ServingStatus status = StatusOf(parsed.service());
  HandoffToGrpc(this);  // this call's last touch of the service (Server::Wait)
  if (status == HealthCheckResponse::SERVICE_UNKNOWN) {
    // A long name is not echoed whole: a client's limit on the reply's metadata (8 KiB by
    // default) would turn the echo into another error (as SessionRegistry::NotFound's ids).
    constexpr size_t kEchoedBytes = 128;
    const std::string& name = parsed.service();
    reactor->Finish(grpc::Status(
        grpc::StatusCode::NOT_FOUND,
        name.size() <= kEchoedBytes
            ? absl::StrCat("unknown service '", name, "'")
            : absl::StrCat("unknown service of ", name.size(), " bytes, beginning '",
                           absl::string_view(name).substr(0, kEchoedBytes), "'")));
    return reactor;
  }
  HealthCheckResponse answer;
  answer.set_status(status);
  SerializeRawMessage(answer, response);
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::Status HealthService::Register(WatchCall* watch, const std::string& host) {
  absl::MutexLock lock(&watches_mu_);
  if (watches_.size() >= kMaxWatches) {
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                        absl::StrCat(kMaxWatches, " health Watch calls are open; use Check"));
  }
  int& from_host = watches_per_host_[host];
  if (from_host >= kMaxWatchesPerHost) {
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                        absl::StrCat(kMaxWatchesPerHost, " health Watch calls are open from ",
                                     host, "; use Check"));
  }
  ++from_host;
  watch->host() = host;
  watches_.insert(watch);
  return grpc::Status::OK;
}

void HealthService::Unregister(WatchCall* watch) {
  absl::MutexLock lock(&watches_mu_);
  if (!watches_.erase(watch)) return;  // refused: never counted
  auto from_host = watches_per_host_.find(watch->host());
  if (--from_host->second == 0) watches_per_host_.erase(from_host);
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* HealthService::Watch(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request) {
  grpc::Status refused = CheckRequestSize(*request);
  HealthCheckRequest parsed;
  grpc::ByteBuffer bytes(*request);
  if (refused.ok() && !ParseRawMessage(&bytes, &parsed)) {
    refused = UnparsableStatus("the request", parsed);
  }
  auto* watch = new WatchCall(this, parsed.service());
  if (refused.ok()) refused = Register(watch, PeerHost(context->peer()));
  if (!refused.ok()) {
    watch->FinishWith(std::move(refused));  // a write reactor that ends at once
  } else {
    watch->Update();
  }
  HandoffToGrpc(watch);  // gRPC reacts only once the handler has returned (after the unlocks)
  return watch;
}

}  // namespace kvrecall
