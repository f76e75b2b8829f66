#include "server/health.h"

#include <algorithm>
#include <utility>

#include "absl/time/time.h"

namespace kvrecall {

using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

HealthService::HealthService(std::vector<std::string> services) : services_(std::move(services)) {}

void HealthService::Shutdown() {
  absl::MutexLock lock(&mu_);
  shut_down_ = true;
}

HealthService::ServingStatus HealthService::StatusOf(const std::string& service) const {
  const bool known =
      service.empty() || std::find(services_.begin(), services_.end(), service) != services_.end();
  if (!known) return HealthCheckResponse::SERVICE_UNKNOWN;
  return shut_down_ ? HealthCheckResponse::NOT_SERVING : HealthCheckResponse::SERVING;
}

grpc::Status HealthService::Check(grpc::ServerContext*, const HealthCheckRequest* request,
                                  HealthCheckResponse* response) {
  absl::ReaderMutexLock lock(&mu_);
  const ServingStatus status = StatusOf(request->service());
  if (status == HealthCheckResponse::SERVICE_UNKNOWN) {
    return grpc::Status(grpc::StatusCode::NOT_FOUND,
                        "unknown service '" + request->service() + "'");
  }
  response->set_status(status);
  return grpc::Status::OK;
}

grpc::Status HealthService::Watch(grpc::ServerContext* context, const HealthCheckRequest* request,
                                  grpc::ServerWriter<HealthCheckResponse>* writer) {
  // The sync API has no cancellation callback, so the wait wakes periodically to notice a
  // client that went away; status changes wake it at once.
  constexpr absl::Duration kCancellationPoll = absl::Milliseconds(200);
  ServingStatus sent = HealthCheckResponse::UNKNOWN;
  absl::MutexLock lock(&mu_);
  while (!context->IsCancelled()) {
    const ServingStatus now = StatusOf(request->service());
    if (now != sent) {
      HealthCheckResponse response;
      response.set_status(now);
      mu_.Unlock();
      const bool written = writer->Write(response);
      mu_.Lock();
      if (!written) break;
      sent = now;
      continue;  // the status may have changed while the lock was released
    }
    if (shut_down_) break;  // NOT_SERVING was the last word
    mu_.AwaitWithTimeout(absl::Condition(&shut_down_), kCancellationPoll);
  }
  return grpc::Status::OK;
}

}  // namespace kvrecall
