// grpc.health.v1.Health for kvrecalld (Check and Watch) on gRPC's callback API, built on the
// health.proto compiled into kvrecall_proto so that server reflection can describe it to
// schema-less clients. Check is answered on gRPC's own thread without waiting for anything the
// KvRecall service does, so health checks answer however loaded the server is.
#ifndef KVRECALL_SERVER_HEALTH_H_
#define KVRECALL_SERVER_HEALTH_H_

#include <atomic>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/server_callback.h"

namespace kvrecall {

using HealthRawCallbackService = grpc::health::v1::Health::WithRawCallbackMethod_Check<
    grpc::health::v1::Health::WithRawCallbackMethod_Watch<grpc::health::v1::Health::Service>>;

class HealthService final : public HealthRawCallbackService {
 public:
  // Reports on the overall server ("") and on each of `services` (full names such as
  // "kvrecall.v1.KvRecall"), all SERVING from the start.
  explicit HealthService(std::vector<std::string> services);

  // Watch calls open now (ended ones leave once gRPC is done with them).
  size_t open_watches() const {
    absl::MutexLock lock(&watches_mu_);
    return watches_.size();
  }

  // Every service becomes NOT_SERVING, every Watch call is told so and ends; call before the
  // server stops so that load balancers and watchers see the shutdown coming.
  void Shutdown();

  // Watch calls open at once (each holds a reactor and its request), and from one host (the
  // peer's address without its port; every Unix-socket peer is one): health needs no token, so
  // one peer must not take every slot from the load balancers' client-side health checks,
  // which open one Watch per connection (review 23). Beyond either, RESOURCE_EXHAUSTED.
  static constexpr size_t kMaxWatches = 1024;
  static constexpr int kMaxWatchesPerHost = 64;

  grpc::ServerUnaryReactor* Check(grpc::CallbackServerContext* context,
                                  const grpc::ByteBuffer* request,
                                  grpc::ByteBuffer* response) override;
  grpc::ServerWriteReactor<grpc::ByteBuffer>* Watch(grpc::CallbackServerContext* context,
                                                    const grpc::ByteBuffer* request) override;

 private:
  using ServingStatus = grpc::health::v1::HealthCheckResponse::ServingStatus;
  class WatchCall;

  ServingStatus StatusOf(const std::string& service) const;
  // Counts `watch` as open from `host` (it is told of changes from then on), or refuses it
  // past a cap.
  grpc::Status Register(WatchCall* watch, const std::string& host);
  void Unregister(WatchCall* watch);

  const std::vector<std::string> services_;
  std::atomic<bool> shut_down_{false};
  mutable absl::Mutex watches_mu_;
  absl::flat_hash_set<WatchCall*> watches_ ABSL_GUARDED_BY(watches_mu_);
  absl::flat_hash_map<std::string, int> watches_per_host_ ABSL_GUARDED_BY(watches_mu_);
};

}  // namespace kvrecall

#endif  // KVRECALL_SERVER_HEALTH_H_
