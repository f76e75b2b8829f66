// The HTTP endpoint that serves ServerMetrics in the Prometheus text format at /metrics
// (cpp-httplib; prometheus-cpp's text serializer), started by RunningServer when
// --metrics_address is set.
//
// Not prometheus-cpp's Exposer: its civetweb workers run on a fixed 100 KiB stack from which
// glibc also carves the static TLS of every loaded library (OpenBLAS alone takes 60 KiB, the
// CUDA runtime 4 KiB more), and a scrape overflowed what was left. httplib's workers are
// std::threads with the default stack.
#ifndef KVRECALL_SERVER_METRICS_ENDPOINT_H_
#define KVRECALL_SERVER_METRICS_ENDPOINT_H_

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "server/metrics.h"

namespace httplib {
class Server;
}  // namespace httplib

namespace kvrecall {

class MetricsEndpoint {
 public:
  // Listens on `address` (HOST:PORT; port 0 picks a free one) and serves `metrics` at
  // /metrics (GET; other paths answer 404) until destroyed. INVALID_ARGUMENT for an address
  // without a port, UNAVAILABLE when it cannot be bound.
  static absl::StatusOr<std::unique_ptr<MetricsEndpoint>> Start(
      const std::string& address, std::shared_ptr<ServerMetrics> metrics);
  ~MetricsEndpoint();

  // Connections served at once, and accepted ones waiting for a worker; past both the endpoint
  // accepts no more until one is done (the rest wait in the kernel's backlog). A peer that
  // sends nothing for 2 s is dropped.
  static constexpr int kWorkers = 4;
  static constexpr int kMaxQueued = 16;

  // HOST:PORT actually listened on (the requested host with the bound port).
  const std::string& address() const { return address_; }
  int port() const { return port_; }

 private:
  MetricsEndpoint(std::shared_ptr<ServerMetrics> metrics, std::unique_ptr<httplib::Server> http,
                  std::string address, int port);

  std::shared_ptr<ServerMetrics> metrics_;
  std::unique_ptr<httplib::Server> http_;
  std::atomic<bool> listen_returned_ = false;
  std::thread listener_;
  std::string address_;
  int port_;
};

}  // namespace kvrecall

#endif  // KVRECALL_SERVER_METRICS_ENDPOINT_H_
