#include "server/metrics_endpoint.h"

#include <exception>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace kvrecall {

MetricsEndpoint::MetricsEndpoint(std::unique_ptr<prometheus::Exposer> exposer,
                                 std::shared_ptr<ServerMetrics> metrics, std::string address,
                                 int port)
    : metrics_(std::move(metrics)),
      exposer_(std::move(exposer)),
      address_(std::move(address)),
      port_(port) {}

absl::StatusOr<std::unique_ptr<MetricsEndpoint>> MetricsEndpoint::Start(
    const std::string& address, std::shared_ptr<ServerMetrics> metrics) {
  const size_t colon = address.rfind(':');
  int requested_port = -1;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(address.substr(colon + 1), &requested_port) || requested_port < 0 ||
      requested_port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "metrics address '", address, "' must be HOST:PORT with a port in [0, 65535]"));
  }
  std::unique_ptr<prometheus::Exposer> exposer;
  try {
    // One thread serves scrapes; a second lets a slow scraper not block another one.
    exposer = std::make_unique<prometheus::Exposer>(address, /*num_threads=*/2);
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("could not serve metrics on ", address,
                                               " (address in use or invalid?): ", e.what()));
  }
  const std::vector<int> ports = exposer->GetListeningPorts();
  if (ports.empty()) {
    return absl::UnavailableError(absl::StrCat("could not serve metrics on ", address));
  }
  exposer->RegisterCollectable(metrics, "/metrics");
  const std::string bound = absl::StrCat(address.substr(0, colon), ":", ports[0]);
  return std::unique_ptr<MetricsEndpoint>(
      new MetricsEndpoint(std::move(exposer), std::move(metrics), bound, ports[0]));
}

}  // namespace kvrecall
