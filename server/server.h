// Starting and stopping a kvrecall server in-process: the KvRecall service, grpc.health.v1 and
// server reflection on ServerOptions::address's listeners (HOST:PORT and Unix sockets), beside
// an optional health-only port and the metrics endpoint. kvrecalld's main and the tests use it.
#ifndef KVRECALL_SERVER_SERVER_H_
#define KVRECALL_SERVER_SERVER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "grpcpp/server.h"
#include "server/backends/placements.h"
#include "server/credentials.h"
#include "server/health.h"
#include "server/memory_budget.h"
#include "server/metrics.h"
#include "server/metrics_endpoint.h"
#include "server/service.h"
#include "server/session.h"

namespace kvrecall {

// The most worker threads a server starts (ServerOptions::worker_threads; as many again build
// selectors): far above any host's cores, low enough for a process's thread limits.
inline constexpr int kMaxWorkerThreads = 1024;

struct ServerOptions {
  // Where to listen (secured as `security` says): HOST:PORT, where port 0 picks a free port,
  // or unix:PATH, a Unix domain socket for a runner on the same host (unix:///ABSOLUTE and
  // unix-abstract:NAME too); several separated by commas
  // ("0.0.0.0:50051,unix:/run/kvrecall/kvrecall.sock"). A socket file is made 0600 (this user
  // alone may connect); an abstract name has no permissions.
  std::string address = "0.0.0.0:50051";
  // Threads that serve decode steps, prompt chunks and unary calls (as many again build
  // selectors); 0: one per hardware thread. Open streams hold no thread.
  int worker_threads = 0;
  // Decode steps that may run at once on the gRPC thread that read them instead of a worker
  // (ServiceOptions::inline_steps); -1: a quarter of the hardware threads; 0: none.
  int inline_decode_steps = -1;
  // Largest message accepted or sent; larger ones fail with RESOURCE_EXHAUSTED.
  int64_t max_message_bytes = 64ll << 20;
  // DecodeShared, Decode through shared memory for runners on this host (ServiceOptions): the
  // directory of its regions (empty: off), the streams open at once, and how long a stream's
  // thread polls for the next step before it sleeps.
  std::string shared_memory_dir;
  int max_shared_streams = 16;
  // Of them, at most this many of one tenant (--max_shared_streams_per_tenant); 0: no limit.
  int max_shared_streams_per_tenant = 0;
  absl::Duration shared_memory_spin = absl::Microseconds(100);
  // Host memory that sessions may hold (KV, staged prompts, selector state); 0: unlimited.
  int64_t host_memory_budget_bytes = 0;
  // Sessions open at once, tokens per layer of a session, and the idle time after which a
  // session is closed (server/session.h); 0: none.
  SessionLimits limits;
  // The GPUs sessions may be placed on, and their budgets.
  PlacementOptions placements;
  // TLS, mutual TLS and bearer tokens for every address above, but with
  // security.plaintext_unix_sockets the unix:PATH ones are plaintext (tokens still checked);
  // that needs TLS, a unix:PATH address and no unix-abstract:NAME one (server/credentials.h).
  SecurityOptions security;
  // HOST:PORT serving Prometheus metrics at /metrics (port 0 picks one); empty: none, and
  // calls are not counted or timed (kvrecall_rpcs_total and the latency histograms stay empty).
  std::string metrics_address;
  // A file of bearer tokens (a line of 'TOKEN' or 'TOKEN NAME' each) one of which every request
  // to metrics_address must carry (MetricsEndpoint); empty: none asked for. INVALID_ARGUMENT
  // without metrics_address.
  std::string metrics_token_file;
  // PEM files of the metrics endpoint's TLS (HTTPS): its certificate chain and key, and the
  // roots a scraper's client certificate must chain to (mutual TLS; empty: none asked for).
  // Read and checked as the gRPC port's are (ReadTlsIdentity); INVALID_ARGUMENT without
  // metrics_address, for a client CA without a certificate, or one of the pair alone.
  std::string metrics_tls_cert_file;
  std::string metrics_tls_key_file;
  std::string metrics_tls_client_ca_file;
  // HOST:PORT of a plaintext port that serves grpc.health.v1 alone, for probes that cannot
  // speak TLS (Kubernetes' gRPC probes); empty: none.
  std::string health_address;
  // For tests only (in-process servers): the service's hooks (ServiceTestHooks).
  ServiceTestHooks service_test_hooks;
};

// A started server. Destroying it shuts it down.
class RunningServer {
 public:
  ~RunningServer();
  RunningServer(const RunningServer&) = delete;
  RunningServer& operator=(const RunningServer&) = delete;

  // The first address listened on: the requested host with the bound port, or the Unix socket
  // address as requested; addresses() holds every one, in the order of ServerOptions::address.
  const std::string& address() const { return addresses_.front(); }
  const std::vector<std::string>& addresses() const { return addresses_; }
  // The bound port of the first address; 0 when it is a Unix socket.
  int port() const { return port_; }

  // The drain: health turns NOT_SERVING (and keeps answering so), new calls and new steps get
  // UNAVAILABLE, idle streams end, the steps and calls in flight finish; once none is left, or
  // at the latest after `grace`, the server stops and cancels what still runs. Returns when the
  // server has stopped. Idempotent.
  void Shutdown(absl::Duration grace = absl::Seconds(5));
  // Whether work of cancelled calls still runs on the service's threads (it is dropped when
  // done; destroying the server waits for it).
  bool busy() const { return service_.busy(); }
  // Blocks until the server has shut down.
  void Wait();
  // Reads --auth_token_file again and puts its tokens in force for every call that starts
  // after (kvrecalld does on SIGHUP): a revoked token is refused, a new one accepted, and the
  // sessions stay (they belong to tenants, not tokens). A stream open with a token taken out
  // ends: an idle one at once, one at work as its step is answered, nothing of a later request
  // applied (KvRecallService::TokensReloaded, StillAuthorized). The number of tokens; the file's
  // error with the old tokens kept when it cannot be read or parsed; FAILED_PRECONDITION without
  // a token file.
  absl::StatusOr<size_t> ReloadTokens();
  // The same for metrics_token_file: its tokens are asked of every scrape that starts after.
  // FAILED_PRECONDITION without the file.
  absl::StatusOr<size_t> ReloadMetricsTokens();
  // Reads the TLS files of each port with TLS again now (kvrecalld does on SIGHUP), as
  // --tls_refresh_seconds does on its period: per port ("grpc", "metrics"), true when a changed
  // identity serves the connections made from now on (on the gRPC port from gRPC's read of it,
  // within GrpcTlsFiles::kGrpcReadSeconds), false when unchanged, or why the files cannot be
  // used (the identity in force stays; kvrecall_tls_files_usable{port} turns 0); UNAVAILABLE
  // while the port's files are being read already (the period's read, which takes them);
  // FAILED_PRECONDITION for files read at start only (pipes). Empty without TLS.
  std::vector<std::pair<std::string, absl::StatusOr<bool>>> ReadTlsFiles();
  // Whether a read of either port's TLS files runs now. After Shutdown and Wait one that does
  // is stalled (a hung mount), and destroying the server would wait for it: kvrecalld then ends
  // without destroying it.
  bool ReadingTlsFiles() const;
  // Says on stderr, once per read, and shows in kvrecall_tls_files_usable a port's read of its
  // TLS files running past StalledTlsRead's bound (a hung mount): each scrape, each period that
  // finds a read under way and each SIGHUP look.
  void CheckStalledTlsReads();

  SessionRegistry& sessions() { return registry_; }
  const KvRecallService& service() const { return service_; }
  const HealthService& health() const { return health_; }
  ServerMetrics& metrics() { return *metrics_; }
  // Where metrics and the plaintext health port are served (bound ports); empty when not.
  const std::string& metrics_address() const { return metrics_address_; }
  // The metrics' URL (http:// or https://HOST:PORT/metrics); empty without an endpoint.
  std::string metrics_url() const;
  const std::string& health_address() const { return health_address_; }
  Placements& placements() { return *placements_; }
  const MemoryBudget& budget() const { return budget_; }

 private:
  friend absl::StatusOr<std::unique_ptr<RunningServer>> StartServer(const ServerOptions& options);
  RunningServer(const ServerOptions& options, std::unique_ptr<Placements> placements);
  // The metrics endpoint and the plaintext health port, when `options` ask for them.
  absl::Status StartMetricsAndProbes(const ServerOptions& options);
  // With TLS and a --tls_refresh_seconds period: a thread that reads the gRPC port's TLS files
  // again on it (ReadGrpcTlsFiles) and says once on stderr, naming the flag, when they become
  // unusable (the identity in force stays) and when a new identity is taken.
  void WatchTlsFiles(const SecurityOptions& security);
  // grpc_tls_files_->Refresh(), its outcome in kvrecall_tls_files_usable{port="grpc"} and
  // kvrecall_tls_certificate_expiration_timestamp_seconds{port="grpc"}; UNAVAILABLE, reading
  // nothing, while another read is under way.
  absl::StatusOr<bool> ReadGrpcTlsFiles() ABSL_LOCKS_EXCLUDED(grpc_tls_read_mu_);

  MemoryBudget budget_;
  std::unique_ptr<Placements> placements_;
  // Before the registry, which records into it.
  std::shared_ptr<ServerMetrics> metrics_ = std::make_shared<ServerMetrics>();
  SessionRegistry registry_;
  KvRecallService service_;
  HealthService health_;
  std::shared_ptr<TokenStore> scrapers_;  // null without metrics_token_file
  std::unique_ptr<MetricsEndpoint> metrics_endpoint_;
  std::string metrics_address_;
  HealthService probe_health_;  // the same answers as health_, on health_address
  // With TLS: what gRPC's watcher reads; destroyed after the servers, whose credentials use it.
  std::shared_ptr<GrpcTlsFiles> grpc_tls_files_;
  absl::Mutex grpc_tls_read_mu_;  // ReadGrpcTlsFiles'; its reads in turn
  StalledTlsRead grpc_tls_stall_;  // ReadGrpcTlsFiles' reads, timed
  std::unique_ptr<grpc::Server> probe_server_;
  std::string health_address_;
  std::unique_ptr<grpc::Server> server_;
  std::vector<std::string> addresses_;
  int port_ = 0;
  std::shared_ptr<TokenStore> tokens_;  // null without --auth_token_file
  absl::Notification stop_tls_watch_;
  std::thread tls_watch_;  // WatchTlsFiles'; joined first by the destructor
  absl::Mutex shutdown_mu_;
  bool shut_down_ ABSL_GUARDED_BY(shutdown_mu_) = false;
};

// Where metrics are served when --metrics_address is not given: port 9090 on the host of
// `address`'s first HOST:PORT entry ("0.0.0.0:9090" for "0.0.0.0:50051", "[::1]:9090" for
// "[::1]:0"), or 127.0.0.1 when every entry is a Unix socket: the unauthenticated endpoint is
// then no more exposed than the API.
std::string DefaultMetricsAddress(absl::string_view address);

// Whether `address` names a Unix domain socket (unix:PATH or unix-abstract:NAME) for gRPC.
bool IsUnixSocketAddress(absl::string_view address);

// Builds and starts a server; INVALID_ARGUMENT for bad options, UNAVAILABLE when the address
// cannot be bound.
absl::StatusOr<std::unique_ptr<RunningServer>> StartServer(const ServerOptions& options);

}  // namespace kvrecall

#endif  // KVRECALL_SERVER_SERVER_H_
