#include "server/server.h"

#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <optional>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "grpc/grpc.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/resource_quota.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "proto/host_port.h"
#include "proto/shared_decode_region.h"
#include "proto/tsan_handoff.h"
#include "server/metrics_gauges.h"
#include "server/rpc_metrics_interceptor.h"

namespace kvrecall {
namespace {

// Threads for the synchronous reflection service: gRPC's synchronous server keeps one of them
// polling, so 3 reflection streams are served at once (probe 27 counted them); one beyond gets
// RESOURCE_EXHAUSTED, no other service is affected.
constexpr int kReflectionThreads = 4;

// "host:0" with the bound port in place of the requested one (a Unix socket's address as it is).
std::string WithPort(const std::string& address, int port) {
  if (IsUnixSocketAddress(address)) return address;
  const size_t colon = address.rfind(':');
  return absl::StrCat(address.substr(0, colon == std::string::npos ? address.size() : colon), ":",
                      port);
}

// The name of a --metrics_token_file token given alone on its line.
constexpr absl::string_view kMetricsScraper = "scraper";

// RunningServers alive in this process (their region files carry its pid).
std::atomic<int> running_servers{0};

// True when a server accepts connections on the socket file of `address` (unix:PATH or
// unix:///PATH). gRPC unlinks an existing socket file before it binds, so without this check a
// second server would silently take the path from a live one.
bool UnixSocketInUse(absl::string_view address) {
  const std::string path = UnixSocketPath(address);  // unix-abstract: binding fails itself
  sockaddr_un sa{};
  sa.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof sa.sun_path) return false;  // gRPC rejects it
  std::memcpy(sa.sun_path, path.data(), path.size());
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  const bool in_use = connect(fd, reinterpret_cast<const sockaddr*>(&sa), sizeof sa) == 0;
  close(fd);
  return in_use;
}

// True when `path` names a socket file itself (not through a symbolic link).
bool IsSocketFile(const std::string& path) {
  struct stat st;
  return lstat(path.c_str(), &st) == 0 && S_ISSOCK(st.st_mode);
}

// An address gRPC is to listen on: a unix:PATH, unix:///PATH or unix-abstract:NAME socket, or
// HOST:PORT with a port in [0, 65535] (0: one the system picks), an IPv6 host in brackets
// ([::1]:50051). gRPC's own parser takes the port modulo 2^16, so a typo (:99999) served on an
// unrelated port, or on a random one (:65536), and said it listened; and it reads a bare IPv6
// address (::1, fe80::1:8080) as a host without a port, served on 443. An empty socket name
// (an unset variable: unix:$SOCK) gRPC binds as an abstract socket of NULs, which any process
// of the network namespace may connect to; a PATH that exists and is not a socket (a file, a
// directory, a symbolic link) gRPC cannot bind, and the socket's chmod must not reach it.
// `flag` names the flag in the message.
absl::Status CheckListeningAddress(absl::string_view flag, absl::string_view address) {
  if (absl::StartsWith(address, "unix:") || absl::StartsWith(address, "unix-abstract:")) {
    const bool abstract = absl::StartsWith(address, "unix-abstract:");
    const std::string path = UnixSocketPath(address);
    if (abstract ? address.size() == strlen("unix-abstract:") : path.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          flag, " entry '", address, "' names no socket: ",
          abstract ? "unix-abstract:NAME needs a NAME" : "unix:PATH needs a PATH"));
    }
    struct stat st;
    if (!abstract && lstat(path.c_str(), &st) == 0 && !S_ISSOCK(st.st_mode)) {
      return absl::InvalidArgumentError(absl::StrCat(
          flag, " entry '", address, "': ", path, " exists and is not a socket (",
          S_ISLNK(st.st_mode) ? "a symbolic link" : S_ISDIR(st.st_mode) ? "a directory" : "a file",
          "); kvrecalld binds a new socket there and replaces only a stale socket"));
    }
    return absl::OkStatus();
  }
  if (const std::optional<int64_t> port = PortOfHostPort(address);
      !port.has_value() || *port < 0 || *port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        flag, " entry '", address,
        "' must be HOST:PORT with a port in [0, 65535] (0: any free port; an IPv6 host in "
        "brackets: [::1]:50051), unix:PATH or unix-abstract:NAME"));
  }
  return absl::OkStatus();
}

// The credentials `address` is listened on with: with --plaintext_unix_sockets, a unix:PATH
// socket's are the plaintext ones (its file, made 0600 by BuildWithPrivateSockets, admits this
// user alone); every other address's are the server's (TLS with --tls_cert).
std::shared_ptr<grpc::ServerCredentials> ListenerCredentials(const ServerSecurity& security,
                                                             absl::string_view address) {
  if (security.unix_socket_credentials != nullptr && !UnixSocketPath(address).empty()) {
    return security.unix_socket_credentials;
  }
  return security.credentials;
}

// --plaintext_unix_sockets' addresses: one unix:PATH at least (else the flag does nothing,
// which its user would not expect), and no unix-abstract:NAME, which has no permissions at all:
// served in plaintext, any process of the network namespace could drive every session.
absl::Status CheckPlaintextUnixSockets(const std::vector<std::string>& addresses) {
  bool any_path = false;
  for (const std::string& address : addresses) {
    if (absl::StartsWith(address, "unix-abstract:")) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--plaintext_unix_sockets with --address entry '", address,
          "': the flag serves Unix sockets in plaintext, and an abstract socket has no file "
          "permissions (any process of the network namespace may connect); use a unix:PATH "
          "socket (made 0600) instead, or leave the flag out"));
    }
    any_path = any_path || !UnixSocketPath(address).empty();
  }
  if (!any_path) {
    return absl::InvalidArgumentError(
        "--plaintext_unix_sockets: --address has no unix:PATH entry to serve without TLS");
  }
  return absl::OkStatus();
}

// builder.BuildAndStart() with the socket files of `addresses`' unix:PATH entries readable and
// writable by this process's user alone (connecting takes write permission): made under a
// umask of 077, so that no other user can connect between the bind and the chmod that follows
// (a socket's mode is otherwise whatever umask the process inherited: 000 let any local user
// drive every session of a server without tokens). unix-abstract: names have no permissions.
std::unique_ptr<grpc::Server> BuildWithPrivateSockets(grpc::ServerBuilder& builder,
                                                      const std::vector<std::string>& addresses) {
  std::vector<std::string> paths;
  for (const std::string& address : addresses) {
    if (std::string path = UnixSocketPath(address); !path.empty()) paths.push_back(path);
  }
  if (paths.empty()) return builder.BuildAndStart();
  // The umask is the process's: servers starting at once in one process take turns.
  static absl::Mutex umask_mu(absl::kConstInit);
  absl::MutexLock lock(&umask_mu);
  const mode_t inherited = umask(077);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  umask(inherited);
  if (server == nullptr) return nullptr;  // it bound nothing this call should touch
  for (const std::string& path : paths) {
    if (IsSocketFile(path)) chmod(path.c_str(), 0600);
  }
  return server;
}

// Leaves server reflection out of one builder's server (the health port's). gRPC adds it to
// every server the process builds once grpc++_reflection is loaded (its static initializer
// calls InitProtoReflectionServerBuilderPlugin): the plaintext, token-free health port served
// the API's schema, a thread per stream, with no cap on the threads.
class WithoutReflection : public grpc::ServerBuilderOption {
 public:
  void UpdateArguments(grpc::ChannelArguments*) override {}
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>* plugins) override {
    const std::string reflection = grpc::reflection::ProtoServerReflectionPlugin().name();
    std::erase_if(*plugins, [&](const std::unique_ptr<grpc::ServerBuilderPlugin>& plugin) {
      return plugin->name() == reflection;
    });
  }
};

}  // namespace

std::string DefaultMetricsAddress(absl::string_view address) {
  for (absl::string_view entry : absl::StrSplit(address, ',')) {
    entry = absl::StripAsciiWhitespace(entry);
    const size_t colon = entry.rfind(':');
    if (IsUnixSocketAddress(entry) || colon == absl::string_view::npos || colon == 0) continue;
    return absl::StrCat(entry.substr(0, colon), ":9090");
  }
  return "127.0.0.1:9090";
}

bool IsUnixSocketAddress(absl::string_view address) {
  return absl::StartsWith(address, "unix:") || absl::StartsWith(address, "unix-abstract:");
}

RunningServer::RunningServer(const ServerOptions& options, std::unique_ptr<Placements> placements)
    : budget_(options.host_memory_budget_bytes),
      placements_(std::move(placements)),
      registry_(&budget_, placements_.get(), metrics_.get(), options.limits),
      service_(&registry_, ServiceOptions{.worker_threads = options.worker_threads,
                                          .inline_steps = options.inline_decode_steps,
                                          .stream_call_metrics = !options.metrics_address.empty(),
                                          .shared_memory_dir = options.shared_memory_dir,
                                          .max_shared_streams = options.max_shared_streams,
                                          .max_shared_streams_per_tenant =
                                              options.max_shared_streams_per_tenant,
                                          .shared_memory_spin = options.shared_memory_spin,
                                          .max_message_bytes = options.max_message_bytes,
                                          .test_hooks = options.service_test_hooks}),
      health_({v1::KvRecall::service_full_name()}),
      probe_health_({v1::KvRecall::service_full_name()}),
      grpc_tls_stall_(
          StalledTlsRead::BoundFor(absl::Seconds(options.security.tls_refresh_seconds))) {
  ++running_servers;
}

RunningServer::~RunningServer() {
  if (!stop_tls_watch_.HasBeenNotified()) stop_tls_watch_.Notify();
  if (tls_watch_.joinable()) tls_watch_.join();
  Shutdown(absl::ZeroDuration());
  Wait();
  --running_servers;
}

void RunningServer::Shutdown(absl::Duration grace) {
  {
    absl::MutexLock lock(&shutdown_mu_);
    if (shut_down_) return;
    shut_down_ = true;
  }
  // No period's read of the TLS files starts after this, on either port (ReadingTlsFiles then
  // tells whether one still runs, stalled).
  if (!stop_tls_watch_.HasBeenNotified()) stop_tls_watch_.Notify();
  if (metrics_endpoint_ != nullptr) metrics_endpoint_->StopRefreshing();
  const absl::Time deadline = absl::Now() + grace;
  // The drain first: whoever reads NOT_SERVING must find new work refused.
  service_.StartDrain();
  health_.Shutdown();
  probe_health_.Shutdown();
  if (server_ == nullptr) return;  // never started
  // Until the service is idle gRPC keeps serving, so that health checks read NOT_SERVING and
  // late requests get the service's UNAVAILABLE; gRPC's shutdown then cancels what is left.
  service_.AwaitIdle(deadline);
  server_->Shutdown(absl::ToChronoTime(deadline));
  if (probe_server_ != nullptr) probe_server_->Shutdown(absl::ToChronoTime(deadline));
}

void RunningServer::Wait() {
  // Server::Wait returns after every call's OnDone, whose last touch of a service hands it back
  // (proto/tsan_handoff.h): what follows, ~RunningServer included, comes after them.
  if (server_ != nullptr) {
    server_->Wait();
    ReactionFromGrpc(&service_);
    ReactionFromGrpc(&health_);
  }
  if (probe_server_ != nullptr) {
    probe_server_->Wait();
    ReactionFromGrpc(&probe_health_);
  }
}

absl::StatusOr<size_t> RunningServer::ReloadTokens() {
  if (tokens_ == nullptr) {
    return absl::FailedPreconditionError("no --auth_token_file to reload: calls carry no tokens");
  }
  absl::StatusOr<size_t> size = tokens_->Reload();
  if (size.ok()) service_.TokensReloaded();
  return size;
}

absl::StatusOr<bool> RunningServer::ReadGrpcTlsFiles() {
  // One read at a time, the gauges updated within it (so that they say what the last read
  // found), and none waits for another (a SIGHUP's read says the period's takes the files).
  if (!grpc_tls_read_mu_.TryLock()) {
    return absl::UnavailableError(
        "the gRPC port's TLS files are being read already: that read takes them");
  }
  grpc_tls_stall_.Begin();
  absl::StatusOr<bool> read = grpc_tls_files_->Refresh();
  grpc_tls_stall_.End();
  // (FAILED_PRECONDITION: files read at start only, which read nothing now.)
  if (read.ok() || read.status().code() != absl::StatusCode::kFailedPrecondition) {
    metrics_->SetTlsFilesUsable("grpc", read.ok());
  }
  if (read.ok() && *read) metrics_->SetTlsCertificateExpiry("grpc", grpc_tls_files_->not_after());
  grpc_tls_read_mu_.Unlock();
  return read;
}

bool RunningServer::ReadingTlsFiles() const {
  return grpc_tls_stall_.reading() ||
         (metrics_endpoint_ != nullptr && metrics_endpoint_->reading_tls_files());
}

void RunningServer::CheckStalledTlsReads() {
  if (grpc_tls_stall_.StalledNow()) {
    std::fputs(grpc_tls_stall_.Message("the gRPC port's").c_str(), stderr);
    metrics_->SetTlsFilesUsable("grpc", false);
  }
  if (metrics_endpoint_ != nullptr) metrics_endpoint_->CheckStalledTlsRead();
}

std::vector<std::pair<std::string, absl::StatusOr<bool>>> RunningServer::ReadTlsFiles() {
  std::vector<std::pair<std::string, absl::StatusOr<bool>>> read;
  if (grpc_tls_files_ != nullptr) read.emplace_back("grpc", ReadGrpcTlsFiles());
  if (metrics_endpoint_ != nullptr && metrics_endpoint_->scheme() == std::string("https")) {
    read.emplace_back("metrics", metrics_endpoint_->ReadTlsFiles());
  }
  return read;
}

void RunningServer::WatchTlsFiles(const SecurityOptions& security) {
  tls_watch_ = std::thread([this, security] {
    std::string said;  // the refusal last said; empty: usable
    while (!stop_tls_watch_.WaitForNotificationWithTimeout(
        absl::Seconds(security.tls_refresh_seconds))) {
      const absl::StatusOr<bool> read = ReadGrpcTlsFiles();
      if (absl::IsUnavailable(read.status())) {
        CheckStalledTlsReads();  // SIGHUP's read, at this moment, or stalled
        continue;
      }
      if (read.ok() && *read) {
        std::fprintf(
            stderr,
            "kvrecalld: the gRPC port's TLS files changed (%s): they serve the connections "
            "made from now on\n",
            security.tls_cert_file.c_str());
      }
      const std::string now = read.ok() ? "" : std::string(read.status().message());
      if (read.ok() && !*read && !said.empty()) {
        std::fprintf(stderr, "kvrecalld: the gRPC port's TLS files can be used again\n");
      }
      if (now != said && !now.empty()) {
        std::fprintf(stderr, "kvrecalld: the gRPC port keeps its TLS certificate: %s\n",
                     now.c_str());
      }
      said = now;
    }
  });
}

std::string RunningServer::metrics_url() const {
  if (metrics_endpoint_ == nullptr) return "";
  return absl::StrCat(metrics_endpoint_->scheme(), "://", metrics_address_, "/metrics");
}

absl::StatusOr<size_t> RunningServer::ReloadMetricsTokens() {
  if (scrapers_ == nullptr) {
    return absl::FailedPreconditionError(
        "no --metrics_token_file to reload: scrapes carry no tokens");
  }
  return scrapers_->Reload();
}

absl::Status RunningServer::StartMetricsAndProbes(const ServerOptions& options) {
  metrics_->SetGaugeSource([this] {
    // Each scrape looks for a stalled read of the TLS files (one stalled on its own period's
    // thread can be seen from no other).
    CheckStalledTlsReads();
    return CollectServerGauges(registry_, budget_, *placements_);
  });
  if (!options.metrics_token_file.empty()) {
    if (options.metrics_address.empty()) {
      return absl::InvalidArgumentError(
          "--metrics_token_file needs a metrics endpoint (--metrics_address is empty)");
    }
    absl::StatusOr<std::shared_ptr<TokenStore>> scrapers = TokenStore::FromFile(
        "--metrics_token_file", options.metrics_token_file, std::string(kMetricsScraper));
    if (!scrapers.ok()) return scrapers.status();
    scrapers_ = *std::move(scrapers);
  }
  std::optional<MetricsTlsFiles> metrics_tls;
  if (!options.metrics_tls_cert_file.empty() || !options.metrics_tls_key_file.empty()) {
    if (options.metrics_address.empty()) {
      return absl::InvalidArgumentError(
          "--metrics_tls_cert and --metrics_tls_key need a metrics endpoint (--metrics_address "
          "is empty)");
    }
    metrics_tls = MetricsTlsFiles{
        .cert_file = options.metrics_tls_cert_file,
        .key_file = options.metrics_tls_key_file,
        .client_ca_file = options.metrics_tls_client_ca_file,
        .refresh = absl::Seconds(options.security.tls_refresh_seconds)};
  } else if (!options.metrics_tls_client_ca_file.empty()) {
    return absl::InvalidArgumentError(
        "--metrics_tls_client_ca (mutual TLS) needs --metrics_tls_cert and --metrics_tls_key");
  }
  if (!options.metrics_address.empty()) {
    absl::StatusOr<std::unique_ptr<MetricsEndpoint>> endpoint = MetricsEndpoint::Start(
        options.metrics_address, metrics_, scrapers_, metrics_tls ? &*metrics_tls : nullptr);
    if (!endpoint.ok()) return endpoint.status();
    metrics_endpoint_ = *std::move(endpoint);
    metrics_address_ = metrics_endpoint_->address();
  }
  if (!options.health_address.empty()) {
    if (UnixSocketInUse(options.health_address)) {
      return absl::UnavailableError(absl::StrCat("could not serve health on ",
                                                 options.health_address,
                                                 ": another server listens on that socket"));
    }
    int port = 0;
    grpc::ServerBuilder builder;
    builder.AddListeningPort(options.health_address, grpc::InsecureServerCredentials(), &port);
    builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
    builder.RegisterService(&probe_health_);
    builder.SetOption(std::make_unique<WithoutReflection>());
    // Health requests name a service: nothing near gRPC's 4 MiB default need reach this port.
    builder.SetMaxReceiveMessageSize(4096);
    probe_server_ = BuildWithPrivateSockets(builder, {options.health_address});
    if (probe_server_ == nullptr || port == 0) {
      return absl::UnavailableError(absl::StrCat("could not serve health on ",
                                                 options.health_address,
                                                 " (address in use or invalid?)"));
    }
    health_address_ = WithPort(options.health_address, port);
  }
  return absl::OkStatus();
}

// Checks DecodeShared's options, and removes the region files a kvrecalld that is gone left in
// its directory (a stream's file is removed when the stream ends; a killed server leaves its
// own). A file names its server's pid: another live server's files are left alone. (Servers in
// different pid namespaces must not share a directory: each would take the other's for gone.)
absl::Status PrepareSharedMemoryDir(const ServerOptions& options) {
  if (options.max_shared_streams < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_shared_streams must be >= 1, got ", options.max_shared_streams));
  }
  if (options.max_shared_streams_per_tenant < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_shared_streams_per_tenant must be >= 0 (0: no limit), got ",
                     options.max_shared_streams_per_tenant));
  }
  if (options.shared_memory_spin < absl::ZeroDuration() ||
      options.shared_memory_spin > absl::Seconds(1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--shared_memory_spin_us must be in [0, 1000000], got ",
                     absl::ToInt64Microseconds(options.shared_memory_spin)));
  }
  if (options.shared_memory_dir.empty()) return absl::OkStatus();
  std::error_code error;
  if (!std::filesystem::is_directory(options.shared_memory_dir, error)) {
    return absl::InvalidArgumentError(
        error && error != std::errc::no_such_file_or_directory
            ? absl::StrCat("shared_memory_dir ", options.shared_memory_dir,
                           " cannot be reached by this process (uid ", getuid(),
                           "): ", error.message())
            : absl::StrCat("shared_memory_dir ", options.shared_memory_dir,
                           " is not a directory", error ? " (it does not exist)" : ""));
  }
  // Found at start, not at the first DecodeShared call (which failed FAILED_PRECONDITION).
  if (access(options.shared_memory_dir.c_str(), W_OK | X_OK) != 0) {
    const int access_error = errno;
    return absl::InvalidArgumentError(absl::StrCat(
        "shared_memory_dir ", options.shared_memory_dir, " is not writable by this process (uid ",
        getuid(), "): ", strerror(access_error), "; DecodeShared makes its regions there"));
  }
  for (const auto& entry : std::filesystem::directory_iterator(options.shared_memory_dir, error)) {
    const std::optional<int> pid =
        v1::shared_decode::RegionFileServerPid(entry.path().filename().string());
    if (!pid.has_value()) continue;
    // Only this user's own files, and no link: run as root, the sweep removed other users'
    // files named alike (probe 26, 7).
    struct stat file;
    if (lstat(entry.path().c_str(), &file) != 0 || !S_ISREG(file.st_mode) ||
        file.st_uid != geteuid()) {
      continue;
    }
    // A file of this process's own pid is a predecessor's when no other server runs in this
    // process (in a container every kvrecalld is PID 1, so a restarted one would keep them all
    // for good); a server starting has made none yet.
    const bool live = *pid == getpid() ? running_servers.load() > 0
                                       : kill(*pid, 0) == 0 || errno != ESRCH;
    if (!live) std::filesystem::remove(entry.path(), error);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<RunningServer>> StartServer(const ServerOptions& given) {
  ServerOptions options = given;
  // DecodeShared names its regions to runners by path: an absolute one opens from any working
  // directory (a relative --shared_memory_dir gave paths only the server's could open).
  if (!options.shared_memory_dir.empty()) {
    std::error_code error;
    const std::filesystem::path absolute =
        std::filesystem::absolute(options.shared_memory_dir, error);
    if (error) {
      return absl::InvalidArgumentError(absl::StrCat(
          "shared_memory_dir ", options.shared_memory_dir, ": ", error.message()));
    }
    options.shared_memory_dir = absolute.lexically_normal().string();
  }
  if (options.max_message_bytes < 1 || options.max_message_bytes > INT_MAX) {
    return absl::InvalidArgumentError(absl::StrCat("max_message_bytes must be in [1, ", INT_MAX,
                                                   "], got ", options.max_message_bytes));
  }
  if (options.inline_decode_steps < -1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--inline_decode_steps must be >= -1 (-1: the default), got ",
        options.inline_decode_steps));
  }
  if (options.worker_threads < 0 || options.worker_threads > kMaxWorkerThreads) {
    return absl::InvalidArgumentError(absl::StrCat("--worker_threads must be in [0, ",
                                                   kMaxWorkerThreads, "], got ",
                                                   options.worker_threads));
  }
  if (options.security.tls_refresh_seconds < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--tls_refresh_seconds must be 0 (the TLS files read at start and at SIGHUP only) or "
        "more, got ",
        options.security.tls_refresh_seconds));
  }
  if (absl::Status s = options.limits.Validate(); !s.ok()) return s;
  if (absl::Status s = PrepareSharedMemoryDir(options); !s.ok()) return s;
  // For every server built after it (loading grpc++_reflection does it too); the health port's
  // leaves it out (WithoutReflection).
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  absl::StatusOr<std::unique_ptr<Placements>> placements = Placements::Create(options.placements);
  if (!placements.ok()) return placements.status();
  std::unique_ptr<RunningServer> running(new RunningServer(options, *std::move(placements)));
  if (absl::Status s = running->service_.ThreadsStarted(); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat(s.message(), " (--worker_threads ",
                                               options.worker_threads, ", 0: one per core)"));
  }

  // Entries are taken without the blanks around them ("a:1, b:2"), as DefaultMetricsAddress
  // takes them.
  std::vector<std::string> addresses;
  for (absl::string_view entry : absl::StrSplit(options.address, ',')) {
    addresses.emplace_back(absl::StripAsciiWhitespace(entry));
  }
  for (size_t i = 0; i < addresses.size(); ++i) {
    if (addresses[i].empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "address '", options.address, "' has an empty entry (", i + 1, " of ",
          addresses.size(), "): addresses are separated by single commas"));
    }
    if (absl::Status s = CheckListeningAddress("--address", addresses[i]); !s.ok()) return s;
    // The same listener twice: a socket file however its entry spells it (unix:P, unix:///P),
    // any other entry as written but for port 0 (each asks for a port of its own).
    auto listener = [](const std::string& address) {
      const std::string path = UnixSocketPath(address);
      return path.empty() ? address : absl::StrCat("unix:", path);
    };
    for (size_t j = 0; j < i; ++j) {
      if (listener(addresses[j]) == listener(addresses[i]) &&
          !absl::EndsWith(addresses[i], ":0")) {
        return absl::InvalidArgumentError(absl::StrCat("address '", options.address,
                                                       "' names the listener '", addresses[i],
                                                       "' twice"));
      }
    }
  }
  if (!options.health_address.empty()) {
    if (absl::Status s = CheckListeningAddress("--health_address", options.health_address);
        !s.ok()) {
      return s;
    }
  }
  std::vector<int> ports(addresses.size(), 0);
  absl::StatusOr<ServerSecurity> security =
      MakeServerCredentials(options.security, running->metrics_.get());
  if (!security.ok()) return security.status();
  if (options.security.plaintext_unix_sockets) {
    if (absl::Status s = CheckPlaintextUnixSockets(addresses); !s.ok()) return s;
  }
  running->grpc_tls_files_ = security->tls_files;
  if (running->grpc_tls_files_ != nullptr) {
    running->metrics_->SetTlsFilesUsable("grpc", true);  // read at start
    running->metrics_->SetTlsCertificateExpiry("grpc", running->grpc_tls_files_->not_after());
    if (options.security.tls_refresh_seconds > 0) running->WatchTlsFiles(options.security);
  }
  running->service_.SetTokens(security->tokens);
  running->tokens_ = security->tokens;
  if (security->tokens != nullptr) {
    // Tenants share the server's budgets: a refusal must not tell one what the others hold.
    running->budget_.HideUseFromRefusals();
    for (const std::unique_ptr<AttentionBackend>& backend : running->placements().gpu()) {
      if (MemoryBudget* device = backend->device_budget(); device != nullptr) {
        device->HideUseFromRefusals();
      }
    }
  }
  grpc::ServerBuilder builder;
  for (size_t i = 0; i < addresses.size(); ++i) {
    if (UnixSocketInUse(addresses[i])) {
      return absl::UnavailableError(absl::StrCat("could not listen on ", addresses[i],
                                                 ": another server listens on that socket"));
    }
    builder.AddListeningPort(addresses[i], ListenerCredentials(*security, addresses[i]),
                             &ports[i]);
  }
  // gRPC sets SO_REUSEPORT by default: a second server on a busy port would then start and
  // silently take a share of the connections instead of failing.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(options.max_message_bytes));
  // KvRecall and Health run on gRPC's callback threads; only server reflection (a stream per
  // schema-less client, rarely more than one) is synchronous and needs threads of its own.
  grpc::ResourceQuota quota("kvrecalld");
  quota.SetMaxThreads(kReflectionThreads);
  builder.SetResourceQuota(quota);
  // Every handler of the service takes it first thing (ReactionFromGrpc): all it holds was made
  // before a call reaches it, an order TSan cannot see through gRPC where gRPC's threads predate
  // this server (a second server in the process, as tests start).
  HandoffToGrpc(&running->service_);
  builder.RegisterService(&running->service_);
  builder.RegisterService(&running->health_);
  // Calls are counted and timed only when someone can read the figures (the interceptor sits
  // on every message; bench/results/metrics_overhead.md measures it).
  if (!options.metrics_address.empty()) {
    builder.experimental().SetInterceptorCreators(
        MakeRpcMetricsInterceptors(running->metrics_.get()));
  }
  running->server_ = BuildWithPrivateSockets(builder, addresses);
  // gRPC reports port 1 for a Unix socket it bound, 0 for an address it could not bind.
  for (size_t i = 0; i < addresses.size(); ++i) {
    if (running->server_ == nullptr || ports[i] == 0) {
      return absl::UnavailableError(absl::StrCat(
          "could not listen on ", addresses[i], " (address in use or invalid?)"));
    }
    const bool unix_socket = IsUnixSocketAddress(addresses[i]);
    running->addresses_.push_back(unix_socket ? addresses[i] : WithPort(addresses[i], ports[i]));
    if (i == 0) running->port_ = unix_socket ? 0 : ports[i];
  }
  if (absl::Status s = running->StartMetricsAndProbes(options); !s.ok()) return s;
  return running;
}

}  // namespace kvrecall
