// Starting and stopping a kvrecall server in-process: the KvRecall service, grpc.health.v1 and
// server reflection on one listening address. kvrecalld's main and the tests both use it.
#ifndef KVRECALL_SERVER_SERVER_H_
#define KVRECALL_SERVER_SERVER_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/server.h"
#include "server/health.h"
#include "server/host_memory_budget.h"
#include "server/service.h"
#include "server/session.h"

namespace kvrecall {

struct ServerOptions {
  // HOST:PORT to listen on (insecure); port 0 picks a free port (see RunningServer::address).
  std::string address = "0.0.0.0:50051";
  // Upper bound on gRPC's server threads (each open stream holds one); 0: gRPC's default.
  int worker_threads = 0;
  // Largest message accepted or sent; larger ones fail with RESOURCE_EXHAUSTED.
  int64_t max_message_bytes = 64ll << 20;
  // Host memory that sessions may hold (KV, staged prompts, selector state); 0: unlimited.
  int64_t host_memory_budget_bytes = 0;
};

// A started server. Destroying it shuts it down.
class RunningServer {
 public:
  ~RunningServer();
  RunningServer(const RunningServer&) = delete;
  RunningServer& operator=(const RunningServer&) = delete;

  // The address actually listened on: the requested host with the bound port.
  const std::string& address() const { return address_; }
  int port() const { return port_; }

  // Health turns NOT_SERVING, then the server stops accepting calls and waits up to `grace`
  // for calls in flight before cancelling them. Idempotent.
  void Shutdown(absl::Duration grace = absl::Seconds(5));
  // Blocks until the server has shut down.
  void Wait();

  SessionRegistry& sessions() { return registry_; }
  const HostMemoryBudget& budget() const { return budget_; }

 private:
  friend absl::StatusOr<std::unique_ptr<RunningServer>> StartServer(const ServerOptions& options);
  explicit RunningServer(const ServerOptions& options);

  HostMemoryBudget budget_;
  SessionRegistry registry_;
  KvRecallService service_;
  HealthService health_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
  int port_ = 0;
  absl::Mutex shutdown_mu_;
  bool shut_down_ ABSL_GUARDED_BY(shutdown_mu_) = false;
};

// Builds and starts a server; INVALID_ARGUMENT for bad options, UNAVAILABLE when the address
// cannot be bound.
absl::StatusOr<std::unique_ptr<RunningServer>> StartServer(const ServerOptions& options);

}  // namespace kvrecall

#endif  // KVRECALL_SERVER_SERVER_H_
