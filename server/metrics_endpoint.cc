#include "server/metrics_endpoint.h"

#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "httplib.h"
#include "prometheus/text_serializer.h"

namespace kvrecall {
namespace {

// The endpoint's connections: `workers` threads and at most `max_queued` connections waiting
// for one. Past that the listening thread serves the connection itself, so it accepts no more
// until it is done: later peers wait in the kernel's backlog, holding none of this process's
// file descriptors. (httplib's own pool queues every accepted connection: idle peers could take
// every descriptor the process has, and gRPC's listener, failing accept4, stopped for good.)
class BoundedTaskQueue final : public httplib::TaskQueue {
 public:
  BoundedTaskQueue(int workers, int max_queued)
      : pool_(static_cast<size_t>(workers)), limit_(workers + max_queued) {}

  void enqueue(std::function<void()> fn) override {
    if (pending_.fetch_add(1) >= limit_) {
      pending_.fetch_sub(1);
      fn();
      return;
    }
    pool_.enqueue([this, fn = std::move(fn)] {
      fn();
      pending_.fetch_sub(1);
    });
  }
  void shutdown() override { pool_.shutdown(); }

 private:
  httplib::ThreadPool pool_;
  const int limit_;
  std::atomic<int> pending_{0};  // connections queued or being served by the pool
};

}  // namespace

MetricsEndpoint::MetricsEndpoint(std::shared_ptr<ServerMetrics> metrics,
                                 std::unique_ptr<httplib::Server> http, std::string address,
                                 int port)
    : metrics_(std::move(metrics)),
      http_(std::move(http)),
      address_(std::move(address)),
      port_(port) {
  listener_ = std::thread([this] {
    http_->listen_after_bind();
    listen_returned_ = true;
  });
  // stop() only stops a server that is running: wait for it, or a destructor that came first
  // would leave the listener running and block on the join.
  while (!http_->is_running() && !listen_returned_) {
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

MetricsEndpoint::~MetricsEndpoint() {
  http_->stop();
  if (listener_.joinable()) listener_.join();
}

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
  std::string host = address.substr(0, colon);
  // [::1]:9090 names an IPv6 host; the socket calls want it bare.
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  auto http = std::make_unique<httplib::Server>();
  // httplib's default also sets SO_REUSEPORT, which would let a second server (another
  // kvrecalld) bind the same port and take half the scrapes; a busy port must be an error.
  http->set_socket_options([](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  // Four workers: one scrape at a time is the norm, the others keep a few slow or idle peers
  // from blocking it; a bounded queue and short timeouts keep any number of them from taking
  // the process's file descriptors or the workers for long.
  http->new_task_queue = [] {
    return new BoundedTaskQueue(MetricsEndpoint::kWorkers, MetricsEndpoint::kMaxQueued);
  };
  http->set_read_timeout(std::chrono::seconds(2));
  http->set_write_timeout(std::chrono::seconds(2));
  http->set_keep_alive_timeout(2);
  http->set_keep_alive_max_count(16);
  std::weak_ptr<ServerMetrics> source = metrics;
  http->Get("/metrics", [source](const httplib::Request&, httplib::Response& response) {
    std::shared_ptr<ServerMetrics> collected = source.lock();
    if (collected == nullptr) {
      response.status = 503;
      return;
    }
    response.set_content(prometheus::TextSerializer().Serialize(collected->Collect()),
                         "text/plain; version=0.0.4; charset=utf-8");
  });
  int port = requested_port;
  if (requested_port == 0) {
    port = http->bind_to_any_port(host);
  } else if (!http->bind_to_port(host, requested_port)) {
    port = -1;
  }
  if (port <= 0) {
    return absl::UnavailableError(absl::StrCat("could not serve metrics on ", address,
                                               " (address in use or invalid?)"));
  }
  const std::string bound = absl::StrCat(address.substr(0, colon), ":", port);
  return std::unique_ptr<MetricsEndpoint>(
      new MetricsEndpoint(std::move(metrics), std::move(http), bound, port));
}

}  // namespace kvrecall
