// grpc.health.v1.Health for kvrecalld (Check and Watch), built on the health.proto compiled
// into kvrecall_proto so that server reflection can describe it to schema-less clients.
#ifndef KVRECALL_SERVER_HEALTH_H_
#define KVRECALL_SERVER_HEALTH_H_

#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace kvrecall {

class HealthService final : public grpc::health::v1::Health::Service {
 public:
  // Reports on the overall server ("") and on each of `services` (full names such as
  // "kvrecall.v1.KvRecall"), all SERVING from the start.
  explicit HealthService(std::vector<std::string> services);

  // Every service becomes NOT_SERVING and every Watch call ends; call before the server stops
  // so that load balancers and watchers see the shutdown coming.
  void Shutdown();

  grpc::Status Check(grpc::ServerContext* context,
                     const grpc::health::v1::HealthCheckRequest* request,
                     grpc::health::v1::HealthCheckResponse* response) override;
  grpc::Status Watch(grpc::ServerContext* context,
                     const grpc::health::v1::HealthCheckRequest* request,
                     grpc::ServerWriter<grpc::health::v1::HealthCheckResponse>* writer) override;

 private:
  using ServingStatus = grpc::health::v1::HealthCheckResponse::ServingStatus;
  ServingStatus StatusOf(const std::string& service) const ABSL_SHARED_LOCKS_REQUIRED(mu_);

  const std::vector<std::string> services_;
  mutable absl::Mutex mu_;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace kvrecall

#endif  // KVRECALL_SERVER_HEALTH_H_
