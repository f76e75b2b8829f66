// The HTTP endpoint that serves ServerMetrics in the Prometheus text format at /metrics
// (prometheus-cpp's Exposer, on civetweb), started by RunningServer when --metrics_address is set.
#ifndef KVRECALL_SERVER_METRICS_ENDPOINT_H_
#define KVRECALL_SERVER_METRICS_ENDPOINT_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "prometheus/exposer.h"
#include "server/metrics.h"

namespace kvrecall {

class MetricsEndpoint {
 public:
  // Listens on `address` (HOST:PORT; port 0 picks a free one) and serves `metrics` at
  // /metrics until destroyed. INVALID_ARGUMENT for an address without a port, UNAVAILABLE when
  // it cannot be bound.
  static absl::StatusOr<std::unique_ptr<MetricsEndpoint>> Start(
      const std::string& address, std::shared_ptr<ServerMetrics> metrics);

  // HOST:PORT actually listened on (the requested host with the bound port).
  const std::string& address() const { return address_; }
  int port() const { return port_; }

 private:
  MetricsEndpoint(std::unique_ptr<prometheus::Exposer> exposer,
                  std::shared_ptr<ServerMetrics> metrics, std::string address, int port);

  std::shared_ptr<ServerMetrics> metrics_;  // the exposer holds it weakly
  std::unique_ptr<prometheus::Exposer> exposer_;
  std::string address_;
  int port_;
};

}  // namespace kvrecall

#endif  // KVRECALL_SERVER_METRICS_ENDPOINT_H_
