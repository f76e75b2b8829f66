// kvrecalld: the kvrecall server. Serves kvrecall.v1.KvRecall, grpc.health.v1.Health and
// server reflection on --address until SIGTERM or SIGINT, then shuts down cleanly; SIGHUP reads
// the token files and the TLS files again.
#include <fcntl.h>
#include <malloc.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kernels/cpu/thread_pool.h"
#include "server/host_memory.h"
#include "server/kv_growth.h"
#include "server/server.h"

ABSL_FLAG(std::string, address, "0.0.0.0:50051",
          "HOST:PORT to listen on (port 0 picks one), or unix:PATH (a Unix domain socket for a "
          "runner on the same host, made 0600: the server's user alone may connect; "
          "unix-abstract:NAME has no permissions at all, any process of the network namespace "
          "may connect); several separated by commas. Every entry is served with the same "
          "credentials (TLS with --tls_cert), but see --plaintext_unix_sockets");
ABSL_FLAG(int, worker_threads, 0,
          "threads serving decode steps, prompt chunks and unary calls (as many again build "
          "selectors), at most 1024; an open gRPC stream holds no thread (a DecodeShared "
          "stream holds one of its own); 0: one per hardware thread");
ABSL_FLAG(int, inline_decode_steps, -1,
          "Decode steps that may run at once on the gRPC thread that read them, saving the "
          "hand-off to a worker thread (a wake-up per layer-step); further steps queue for the "
          "workers; -1: a quarter of the hardware threads (at least 1); 0: every step queues");
ABSL_FLAG(int, max_message_mb, 64,
          "largest gRPC message accepted or sent, in MiB; larger ones get RESOURCE_EXHAUSTED");
ABSL_FLAG(std::string, shared_memory_dir, "",
          "serve DecodeShared (Decode through shared memory, for a runner on this host) with its "
          "regions in this directory, one file per stream (a tmpfs such as /dev/shm, or a pod's "
          "emptyDir shared with the runner's container; same user); empty: off");
ABSL_FLAG(int, max_shared_streams, 16,
          "DecodeShared streams open at once (each holds a thread); more get RESOURCE_EXHAUSTED");
ABSL_FLAG(int, max_shared_streams_per_tenant, 0,
          "DecodeShared streams open at once of one tenant (--auth_token_file's; without tokens "
          "every caller is one tenant), so that no tenant takes every --max_shared_streams "
          "slot; more get RESOURCE_EXHAUSTED; 0: no limit but --max_shared_streams");
ABSL_FLAG(int, shared_memory_spin_us, 100,
          "microseconds a DecodeShared stream's thread polls for the next step before it "
          "sleeps (0 to 1000000)");
ABSL_FLAG(int, compute_spin_us, 100,
          "microseconds an idle thread of the decode compute pool (kernels/cpu/thread_pool.h) "
          "polls for the next step's work before it sleeps; a runner's next layer-step usually "
          "comes within a round trip (0 to 1000000)");
ABSL_FLAG(double, host_memory_budget_gb, 0,
          "host memory (GiB) that sessions may hold: KV, staged prompts, selector state and "
          "DecodeShared regions; "
          "requests that need more get RESOURCE_EXHAUSTED; 0: unlimited");
ABSL_FLAG(int64_t, max_sessions, 0,
          "sessions open at once (of every tenant); CreateSession beyond it gets "
          "RESOURCE_EXHAUSTED; 0: no limit");
ABSL_FLAG(int64_t, max_sessions_per_tenant, 0,
          "sessions open at once of one tenant (--auth_token_file's; without tokens every "
          "caller is one tenant), so that no tenant takes every --max_sessions slot; "
          "CreateSession beyond it gets RESOURCE_EXHAUSTED; 0: no limit");
ABSL_FLAG(double, host_memory_budget_per_tenant_gb, 0,
          "host memory (GiB) that the sessions of one tenant may hold, within "
          "--host_memory_budget_gb (KV, staged prompts, selector state, shared decode "
          "regions), so that no tenant takes all of it; beyond it the tenant's requests get "
          "RESOURCE_EXHAUSTED; 0: none but the server's");
ABSL_FLAG(double, gpu_memory_budget_per_tenant_gb, 0,
          "GPU memory (GiB) that the sessions of one tenant may hold on each device, within "
          "--gpu_memory_budget_gb (the decode workspaces and captured steps of a request are "
          "the server's); beyond it the tenant's requests get RESOURCE_EXHAUSTED; 0: none but "
          "the server's");
ABSL_FLAG(int64_t, max_context_tokens, 0,
          "tokens (prompt + decoded) each layer of a session may hold; a CreateSession "
          "announcing more, or a Prefill chunk or Decode step growing a layer past it, gets "
          "RESOURCE_EXHAUSTED; each host KV array reserves address space (not memory) for this "
          "many tokens, to grow to them without moving; 0: no limit");
ABSL_FLAG(double, session_idle_ttl_seconds, 0,
          "a session that no call used for this long is closed and its memory freed (its id "
          "then answers NOT_FOUND saying it expired); 0: sessions never expire");
ABSL_FLAG(std::string, gpus, "all",
          "CUDA devices that GPU placements may use: 'all' (every visible device), 'none', or a "
          "comma-separated list of ordinals such as 0,2; each session lives on the one with the "
          "most budget free");
ABSL_FLAG(double, gpu_memory_budget_gb, -1,
          "GPU memory (GiB) that sessions, decode workspaces and the Decode streams' captured "
          "steps may hold on each device; beyond it requests get RESOURCE_EXHAUSTED; -1: what "
          "the device reports free at start minus --gpu_memory_headroom_gb; 0: unlimited");
ABSL_FLAG(double, gpu_memory_headroom_gb, 2,
          "with --gpu_memory_budget_gb=-1, device memory left outside the budget for the CUDA "
          "context, cuBLAS and kernel launch resources");
ABSL_FLAG(bool, cuda_graphs, true,
          "GPU decode steps replay a CUDA graph captured once per request shape (batch, knobs, "
          "history bucket) instead of launching each copy and kernel");
ABSL_FLAG(std::string, cuda_module_loading, "",
          "when CUDA loads the GPU placements' kernels: `eager` (all as the server starts) or "
          "`lazy` (each on its first launch, CUDA's own default); empty: CUDA_MODULE_LOADING "
          "from the environment, else eager. Sets CUDA_MODULE_LOADING");
ABSL_FLAG(double, tiered_gpu_exact_share, 0.75,
          "in PLACEMENT_TIERED with the shortlist exact search (policy.index.exact_search, the "
          "default on a GPU) and SELECTOR_INDEX or SELECTOR_RETOPK, "
          "the share of a layer's query heads whose exact paths may run on the GPU, reading the "
          "host's KV over PCIe, while the host's threads take the rest (retopk: of the heads "
          "whose cache match sends them to the exact path); 0 to 1 (0: all on the host); with "
          "--tiered_gpu_exact_balance the most the GPU takes");
ABSL_FLAG(bool, tiered_gpu_exact_balance, true,
          "each tiered layer moves the number of exact heads it gives the GPU a head at a time "
          "(up to --tiered_gpu_exact_share of them) towards where the GPU's heads and the host's "
          "end together; false: the GPU takes the share every step");
ABSL_FLAG(double, shutdown_grace_seconds, 5,
          "on SIGTERM/SIGINT: health turns NOT_SERVING, new calls and steps get UNAVAILABLE, and "
          "the calls in flight have this long to finish before they are cancelled and the "
          "process exits");
ABSL_FLAG(std::string, metrics_address, "auto",
          "HOST:PORT serving Prometheus metrics at /metrics (port 0 picks one); empty: none. "
          "Plain HTTP unless --metrics_tls_cert, unauthenticated unless --metrics_token_file: "
          "auto (the default) is port "
          "9090 on the host of --address's first HOST:PORT entry (127.0.0.1 when there is none, "
          "only Unix sockets), so that the metrics are no more exposed than the API");
ABSL_FLAG(std::string, metrics_token_file, "",
          "file of bearer tokens, a line of 'TOKEN' (a Secret holding just the token) or 'TOKEN "
          "NAME' each (16+ printable characters; # starts a comment): every request to "
          "/metrics must carry 'Authorization: Bearer TOKEN' with one of them, else 401. "
          "Without --metrics_tls_cert the token travels in plaintext HTTP: it keeps out whoever "
          "reaches the port (another tenant's pod), not whoever can read its traffic. SIGHUP "
          "reads the file again");
ABSL_FLAG(std::string, metrics_tls_cert, "",
          "PEM certificate chain of the metrics endpoint; with --metrics_tls_key it serves "
          "HTTPS (TLS 1.2+), so that the metrics and their token travel encrypted (may be "
          "--tls_cert's files; read again with --tls_refresh_seconds and at SIGHUP)");
ABSL_FLAG(std::string, metrics_tls_key, "", "PEM private key of --metrics_tls_cert");
ABSL_FLAG(int, tls_refresh_seconds, 0,
          "how often the TLS files (--tls_cert, --tls_key, --tls_client_ca and the "
          "--metrics_tls_* ones) are read again; 0: at start and at SIGHUP only. A certificate "
          "replaced on disk (a Secret's rotation; the chart sets 60) serves the connections made "
          "after, and the sessions stay. Files that cannot be used as they are at a read (a "
          "certificate without its new key, a garbled file) keep the certificate in force, said "
          "once on stderr and in kvrecall_tls_files_usable. With a period the files must be "
          "regular files (a pipe is read once)");
ABSL_FLAG(std::string, metrics_tls_client_ca, "",
          "PEM roots: scrapers must present a certificate they signed (mutual TLS on the "
          "metrics endpoint)");
ABSL_FLAG(std::string, health_address, "",
          "HOST:PORT of a plaintext port serving grpc.health.v1 alone, for probes that cannot "
          "speak TLS (Kubernetes' gRPC probes); empty: none");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate chain of the server; with --tls_key: TLS on every --address entry "
          "(but unix:PATH ones with --plaintext_unix_sockets)");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM roots: clients must present a certificate they signed (mutual TLS; not on "
          "the plaintext sockets of --plaintext_unix_sockets)");
ABSL_FLAG(bool, plaintext_unix_sockets, false,
          "with --tls_cert/--tls_key: serve --address's unix:PATH sockets without TLS while its "
          "HOST:PORT entries keep it, for a runner on this host (a co-located container) that "
          "holds no certificate; the socket file, made 0600, admits this process's user alone. "
          "--auth_token_file's tokens are still required there (sent as 'authorization: Bearer "
          "TOKEN' metadata, or by gRPC's local credentials with access-token call credentials); "
          "client certificates (--tls_client_ca) cannot be checked without TLS and are not. "
          "Refused without TLS, without a unix:PATH entry, and with a unix-abstract:NAME entry "
          "(no file permissions: any process of the network namespace could connect)");
ABSL_FLAG(std::string, auth_token_file, "",
          "file of 'TOKEN TENANT' lines: every call but grpc.health.v1 needs 'authorization: "
          "Bearer TOKEN' (else UNAUTHENTICATED), and a session belongs to the tenant that "
          "created it (to others it does not exist); needs TLS, and applies to every listener, "
          "the plaintext sockets of --plaintext_unix_sockets too. SIGHUP reads the file again: a "
          "token taken out is refused, and its open streams end: an idle one at once, one at work "
          "as its step is answered; a file given as a pipe is read at start only (a line "
          "starting with # is a comment)");

ABSL_FLAG(bool, host_huge_pages, true,
          "back sessions' host KV arrays (and staged prompts) of 2 MiB or more, or smaller with "
          "room to grow past 2 MiB while the process's mappings are few, with 2 MiB transparent "
          "huge pages (each its own 2 MiB-aligned mapping, MADV_HUGEPAGE), so that scattered row "
          "reads by the host's threads and by a GPU over PCIe need fewer address translations; "
          "takes effect where /sys/kernel/mm/transparent_hugepage/enabled is madvise or always; "
          "the graph index's adjacency and build scratch of 2 MiB or more follow it too; "
          "false: 4 KiB pages (MADV_NOHUGEPAGE)");
ABSL_FLAG(bool, host_kv_growth_ahead, true,
          "grow a layer's host KV (cpu and tiered placements) ahead of need on a thread of its "
          "own (within the address space its arrays reserve), so that no decode step populates "
          "and pins the rows a growth adds; false: the step that needs a row grows the KV");
ABSL_FLAG(int, malloc_mmap_threshold_kb, 1024,
          "blocks of at least this many KiB get a mapping of their own, returned to the OS when "
          "freed (glibc's M_MMAP_THRESHOLD; the trim threshold is 4x); 0: glibc's adaptive "
          "default, which keeps up to tens of MiB per arena resident after sessions close");

namespace {

// The signals' pipe: the handler writes a signal's number (SIGTERM, SIGINT: shut down; SIGHUP:
// read the token and TLS files again), main reads it.
int shutdown_pipe[2] = {-1, -1};

// Async-signal-safe: one write(2) of one byte to the pipe's non-blocking end.
extern "C" void WriteShutdownSignal(int signal_number) {
  const int saved_errno = errno;
  const auto byte = static_cast<unsigned char>(signal_number);
  [[maybe_unused]] const ssize_t written = write(shutdown_pipe[1], &byte, 1);
  errno = saved_errno;
}

// The action of `signals`: `handler` (WriteShutdownSignal, or SIG_DFL).
void SetSignalsHandler(std::initializer_list<int> signals, void (*handler)(int)) {
  struct sigaction action = {};
  action.sa_handler = handler;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  for (const int signal_number : signals) sigaction(signal_number, &action, nullptr);
}

// SIGHUP's reads of the token and TLS files, on a thread of their own: a read stalled on a hung
// filesystem (an NFS mount, a FUSE secret store) holds this thread, never main's, which must
// stay free to take SIGTERM. SIGHUPs that come while a read runs ask for one read after it.
class SighupReader {
 public:
  explicit SighupReader(kvrecall::RunningServer* server)
      : server_(server), thread_([this] { Run(); }) {}
  SighupReader(const SighupReader&) = delete;
  SighupReader& operator=(const SighupReader&) = delete;
  // Every path out of main stops it first (Finish); one that did not must not free the mutex
  // its thread waits on.
  ~SighupReader() {
    if (thread_.joinable() && !Finish(absl::ZeroDuration())) std::_Exit(1);
  }

  void Ask() {
    absl::Duration reading_for = absl::InfiniteDuration();
    {
      absl::MutexLock lock(&mu_);
      asked_ = true;
      if (reading_) reading_for = absl::Now() - read_start_;
    }
    if (reading_for != absl::InfiniteDuration()) {
      std::printf(
          "kvrecalld: SIGHUP: the files are being read already (for %s); they are read "
          "again once that read ends\n",
          absl::FormatDuration(absl::Trunc(reading_for, absl::Milliseconds(1))).c_str());
      std::fflush(stdout);
    }
  }

  // No read starts after this (a SIGHUP asked for one during the shutdown is not served).
  void StopReading() {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }

  // Stops reading, waits up to `wait` for a read under way to end, and joins the thread. False
  // when the read still runs (stalled): the thread is left to it, and the server it reads must
  // outlive the process (std::_Exit).
  bool Finish(absl::Duration wait) {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
      if (!mu_.AwaitWithTimeout(absl::Condition(this, &SighupReader::NotReading), wait)) {
        return false;
      }
    }
    thread_.join();
    return true;
  }

 private:
  void Run() {
    for (;;) {
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(this, &SighupReader::AskedOrStopping));
        if (stopping_) return;
        asked_ = false;
        reading_ = true;
        read_start_ = absl::Now();
      }
      ReadFiles();
      absl::MutexLock lock(&mu_);
      reading_ = false;
    }
  }

  bool AskedOrStopping() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return asked_ || stopping_; }
  bool NotReading() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !reading_; }

  // The token files and TLS files again (revoking or adding a token, renewing a certificate,
  // keeps every session), a line each. Without any it says there is no token file to read.
  void ReadFiles() {
    auto report = [](const absl::StatusOr<size_t>& reloaded, const char* what,
                     const std::string& file) {
      if (reloaded.ok()) {
        std::printf("kvrecalld: SIGHUP: reloaded %zu %s from %s\n", *reloaded, what, file.c_str());
      } else {
        std::printf("kvrecalld: SIGHUP: %s; the %s in force stay\n",
                    std::string(reloaded.status().message()).c_str(), what);
      }
      std::fflush(stdout);
    };
    const std::string tenants = absl::GetFlag(FLAGS_auth_token_file);
    const std::string scrapers = absl::GetFlag(FLAGS_metrics_token_file);
    const std::vector<std::pair<std::string, absl::StatusOr<bool>>> tls = server_->ReadTlsFiles();
    if (!tenants.empty() || (scrapers.empty() && tls.empty())) {
      report(server_->ReloadTokens(), "tokens", tenants);
    }
    if (!scrapers.empty()) report(server_->ReloadMetricsTokens(), "metrics tokens", scrapers);
    // And the TLS files of each port with TLS.
    for (const auto& [port, read] : tls) {
      const char* files = port == "grpc" ? "gRPC port's TLS files" : "metrics endpoint's TLS files";
      if (absl::IsUnavailable(read.status())) server_->CheckStalledTlsReads();
      if (absl::IsUnavailable(read.status()) || absl::IsFailedPrecondition(read.status())) {
        // Being read already, or read at start only: nothing read now.
        std::printf("kvrecalld: SIGHUP: %s\n", std::string(read.status().message()).c_str());
      } else if (!read.ok()) {
        std::printf("kvrecalld: SIGHUP: %s; the certificate in force stays\n",
                    std::string(read.status().message()).c_str());
      } else {
        std::printf("kvrecalld: SIGHUP: the %s %s\n", files,
                    !*read           ? "are unchanged"
                    : port == "grpc" ? "changed: they serve the connections made from gRPC's "
                                       "next read of them (within a second)"
                                     : "changed: they serve the connections made from now on");
      }
      std::fflush(stdout);
    }
  }

  kvrecall::RunningServer* const server_;
  absl::Mutex mu_;
  bool asked_ ABSL_GUARDED_BY(mu_) = false;
  bool reading_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time read_start_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;  // last: started once the members above are
};

}  // namespace

int main(int argc, char** argv) {
  // The shutdown signals go to a handler that writes their number to a pipe main reads, set
  // first of all so that one inherited as ignored is not lost while the process starts. (sigwait
  // alone was not enough: threads that libraries start before main, OpenBLAS's, do not block the
  // signals, and one the kernel handed them was dropped when the process inherited SIG_IGN for
  // it, as a background job of a non-interactive shell does, or ended the process under SIG_DFL.)
  // The write end never blocks a handler: a full pipe already holds a signal to act on.
  if (pipe2(shutdown_pipe, O_CLOEXEC) != 0 ||
      fcntl(shutdown_pipe[1], F_SETFL, fcntl(shutdown_pipe[1], F_GETFL) | O_NONBLOCK) != 0) {
    std::fprintf(stderr, "kvrecalld: cannot make the shutdown signals' pipe\n");
    return 1;
  }
  // SIGHUP too: by default it ended the process at once, without the drain.
  SetSignalsHandler({SIGTERM, SIGINT, SIGHUP}, WriteShutdownSignal);
  // A peer that resets a connection mid-write must end that write (EPIPE), not the process:
  // gRPC and the metrics endpoint write with MSG_NOSIGNAL, but a library that does not would
  // raise SIGPIPE, whose default action ends the process with every session.
  signal(SIGPIPE, SIG_IGN);
  absl::SetProgramUsageMessage(
      "kvrecalld --address=HOST:PORT: decode-time attention as a gRPC service (kvrecall.v1)");
  // --help lists the flags of this file (Abseil's default looks for a file named after the
  // program, and found none: "No flags matched").
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [](absl::string_view file) {
    return absl::EndsWith(file, "server/main.cc");
  };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  absl::SetFlagsUsageConfig(usage);
  // What is left is the program's name and any argument that is not a flag: a value after a
  // space where a boolean takes `=` (--plaintext_unix_sockets false sets it true and leaves
  // "false"), a flag without its dashes, or anything after `--`. Served, it would be ignored.
  if (const std::vector<char*> rest = absl::ParseCommandLine(argc, argv); rest.size() > 1) {
    std::fprintf(stderr,
                 "kvrecalld: unexpected argument '%s' (%zu not a flag): flags are --name=value "
                 "(a boolean's value after '=', as in --plaintext_unix_sockets=false)\n",
                 rest[1], rest.size() - 1);
    return 2;
  }
  // Abseil built without NDEBUG (Debian's, which gRPC's locks use too) checks every absl::Mutex
  // acquisition for lock-order cycles, in a graph behind one process-wide lock: thousands of
  // instructions per Decode round trip (bench/results/rpc_floor.md, dev-machine figures). The
  // tests keep the check; the served process does without it.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  // Before anything starts CUDA, which reads CUDA_MODULE_LOADING once (other threads may run:
  // OpenBLAS's, started before main, which read no environment). Loaded lazily (CUDA's
  // default), a kernel first launched mid-decode (a new shape's, a take-over's) loads its module
  // on the step's thread, once per process: the first index take-over at batch 1 took 3.4-4.1
  // ms lazily and 1.5 eagerly in d108-d109 (an H100), for ~2-3 s more at start and ~450 MiB more
  // device memory (bench/results/tiered_serving.md, "The step at a take-over").
  const std::string module_loading = absl::GetFlag(FLAGS_cuda_module_loading);
  if (!module_loading.empty() && module_loading != "eager" && module_loading != "lazy") {
    std::fprintf(stderr,
                 "kvrecalld: --cuda_module_loading must be eager, lazy or empty, got '%s'\n",
                 module_loading.c_str());
    return 2;
  }
  // Empty: the environment's value, unless it has none (or an empty one, which CUDA would take
  // for its own default, lazy).
  const char* inherited = std::getenv("CUDA_MODULE_LOADING");
  const bool keep = module_loading.empty() && inherited != nullptr && *inherited != '\0';
  if (!keep && setenv("CUDA_MODULE_LOADING", module_loading == "lazy" ? "LAZY" : "EAGER",
                      /*overwrite=*/1) != 0) {
    std::fprintf(stderr, "kvrecalld: cannot set CUDA_MODULE_LOADING: %s\n",
                 std::strerror(errno));
    return 1;
  }
  // Memory a closed session frees must go back to the OS. By default glibc raises its mmap
  // threshold to the size of every large block freed (up to 32 MiB) and its trim threshold to
  // twice that, so once the first session has closed, KV arrays below 32 MiB come from malloc's
  // arenas, whose free tops (tens of MiB each) stay resident; malloc_trim does not return them
  // (bench/results/hardening.md: 441 MB held by the arenas, 7.6 MB of it in use). A fixed
  // threshold, set before any server thread starts, keeps every larger block (KV arrays, graph
  // adjacency, caches) in a mapping of its own, unmapped when it is freed.
  const int threshold_kb = absl::GetFlag(FLAGS_malloc_mmap_threshold_kb);
  if (threshold_kb < 0 || threshold_kb > (32 << 10)) {
    std::fprintf(stderr, "kvrecalld: --malloc_mmap_threshold_kb must be in [0, 32768], got %d\n",
                 threshold_kb);
    return 2;
  }
  if (threshold_kb > 0) {
    mallopt(M_MMAP_THRESHOLD, threshold_kb << 10);
    mallopt(M_TRIM_THRESHOLD, 4 * (threshold_kb << 10));
  }

  // Before any session allocates its KV.
  kvrecall::cpu::SetHostHugePages(absl::GetFlag(FLAGS_host_huge_pages));
  kvrecall::SetHostKvGrowthAhead(absl::GetFlag(FLAGS_host_kv_growth_ahead));
  if (absl::GetFlag(FLAGS_host_huge_pages) && kvrecall::TransparentHugePagesMode() == "never") {
    std::fprintf(stderr,
                 "kvrecalld: transparent huge pages are off on this host "
                 "(/sys/kernel/mm/transparent_hugepage/enabled: never): the KV stays in 4 KiB "
                 "pages\n");
  }

  const double budget_gb = absl::GetFlag(FLAGS_host_memory_budget_gb);
  const int max_message_mb = absl::GetFlag(FLAGS_max_message_mb);
  if (!kvrecall::IsBudgetGib(budget_gb)) {
    std::fprintf(stderr,
                 "kvrecalld: --host_memory_budget_gb must be 0 (no budget) or in [2^-30, 2^33) "
                 "GiB, got %g\n",
                 budget_gb);
    return 2;
  }
  for (const auto& [flag, gib] :
       {std::pair{"host_memory_budget_per_tenant_gb",
                  absl::GetFlag(FLAGS_host_memory_budget_per_tenant_gb)},
        std::pair{"gpu_memory_budget_per_tenant_gb",
                  absl::GetFlag(FLAGS_gpu_memory_budget_per_tenant_gb)}}) {
    if (!kvrecall::IsBudgetGib(gib)) {
      std::fprintf(stderr,
                   "kvrecalld: --%s must be 0 (none but the server's budget) or in [2^-30, 2^33) "
                   "GiB, got %g\n",
                   flag, gib);
      return 2;
    }
  }
  if (max_message_mb < 1 || max_message_mb > 2047) {
    std::fprintf(stderr, "kvrecalld: --max_message_mb must be in [1, 2047], got %d\n",
                 max_message_mb);
    return 2;
  }
  const int compute_spin_us = absl::GetFlag(FLAGS_compute_spin_us);
  if (compute_spin_us < 0 || compute_spin_us > 1000000) {
    std::fprintf(stderr, "kvrecalld: --compute_spin_us must be in [0, 1000000], got %d\n",
                 compute_spin_us);
    return 2;
  }
  // Before any server thread runs a step (the pool is made on first use).
  kvrecall::cpu::ThreadPool::Configure(
      {.workers = -1, .spin = std::chrono::microseconds(compute_spin_us)});
  kvrecall::ServerOptions options;
  options.address = absl::GetFlag(FLAGS_address);
  options.worker_threads = absl::GetFlag(FLAGS_worker_threads);
  options.inline_decode_steps = absl::GetFlag(FLAGS_inline_decode_steps);
  options.max_message_bytes = int64_t{max_message_mb} << 20;
  options.shared_memory_dir = absl::GetFlag(FLAGS_shared_memory_dir);
  options.max_shared_streams = absl::GetFlag(FLAGS_max_shared_streams);
  options.max_shared_streams_per_tenant = absl::GetFlag(FLAGS_max_shared_streams_per_tenant);
  options.shared_memory_spin = absl::Microseconds(absl::GetFlag(FLAGS_shared_memory_spin_us));
  options.host_memory_budget_bytes = kvrecall::GibToBytes(budget_gb);
  options.limits.max_sessions = absl::GetFlag(FLAGS_max_sessions);
  options.limits.max_sessions_per_tenant = absl::GetFlag(FLAGS_max_sessions_per_tenant);
  options.limits.max_context_tokens = absl::GetFlag(FLAGS_max_context_tokens);
  options.limits.host_bytes_per_tenant =
      kvrecall::GibToBytes(absl::GetFlag(FLAGS_host_memory_budget_per_tenant_gb));
  options.limits.gpu_bytes_per_tenant =
      kvrecall::GibToBytes(absl::GetFlag(FLAGS_gpu_memory_budget_per_tenant_gb));
  const double ttl_seconds = absl::GetFlag(FLAGS_session_idle_ttl_seconds);
  if (!(ttl_seconds >= 0) || !std::isfinite(ttl_seconds)) {
    std::fprintf(stderr, "kvrecalld: --session_idle_ttl_seconds must be finite and >= 0, got %g\n",
                 ttl_seconds);
    return 2;
  }
  options.limits.session_idle_ttl = absl::Seconds(ttl_seconds);
  // NaN and infinity would make the grace endless (absl::Seconds maps both to forever).
  const double grace_seconds = absl::GetFlag(FLAGS_shutdown_grace_seconds);
  if (!(grace_seconds >= 0) || !std::isfinite(grace_seconds)) {
    std::fprintf(stderr, "kvrecalld: --shutdown_grace_seconds must be finite and >= 0, got %g\n",
                 grace_seconds);
    return 2;
  }
  absl::StatusOr<kvrecall::PlacementOptions> placements = kvrecall::PlacementOptionsFromFlags(
      absl::GetFlag(FLAGS_gpus), absl::GetFlag(FLAGS_gpu_memory_budget_gb),
      absl::GetFlag(FLAGS_gpu_memory_headroom_gb), absl::GetFlag(FLAGS_tiered_gpu_exact_share),
      absl::GetFlag(FLAGS_tiered_gpu_exact_balance));
  if (!placements.ok()) {
    std::fprintf(stderr, "kvrecalld: %s\n", std::string(placements.status().message()).c_str());
    return 2;
  }
  options.placements = *std::move(placements);
  options.placements.cuda_graphs = absl::GetFlag(FLAGS_cuda_graphs);
  options.metrics_address = absl::GetFlag(FLAGS_metrics_address);
  // A sentinel, not a scan of argv: a --flagfile's (or --fromenv's) value was taken for no
  // value and replaced.
  if (options.metrics_address == "auto") {
    options.metrics_address = kvrecall::DefaultMetricsAddress(options.address);
  }
  options.metrics_token_file = absl::GetFlag(FLAGS_metrics_token_file);
  options.metrics_tls_cert_file = absl::GetFlag(FLAGS_metrics_tls_cert);
  options.metrics_tls_key_file = absl::GetFlag(FLAGS_metrics_tls_key);
  options.metrics_tls_client_ca_file = absl::GetFlag(FLAGS_metrics_tls_client_ca);
  options.health_address = absl::GetFlag(FLAGS_health_address);
  options.security.tls_cert_file = absl::GetFlag(FLAGS_tls_cert);
  options.security.tls_key_file = absl::GetFlag(FLAGS_tls_key);
  options.security.tls_client_ca_file = absl::GetFlag(FLAGS_tls_client_ca);
  options.security.auth_token_file = absl::GetFlag(FLAGS_auth_token_file);
  options.security.plaintext_unix_sockets = absl::GetFlag(FLAGS_plaintext_unix_sockets);
  options.security.tls_refresh_seconds = absl::GetFlag(FLAGS_tls_refresh_seconds);

  // The threads started from here on block the shutdown signals (gRPC's inherit the mask), so
  // that their calls are not interrupted; main takes them again once the server listens.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  absl::StatusOr<std::unique_ptr<kvrecall::RunningServer>> server = kvrecall::StartServer(options);
  if (!server.ok()) {
    std::fprintf(stderr, "kvrecalld: %s\n", std::string(server.status().message()).c_str());
    // 2, as for the flags checked above, where the server refuses a flag's value (an address, a
    // limit, a file a flag names that is missing, unreadable or malformed); 1 where it could not
    // start (a port in use, a device).
    const absl::Status& s = server.status();
    return absl::IsInvalidArgument(s) || absl::IsNotFound(s) || absl::IsPermissionDenied(s) ? 2
                                                                                           : 1;
  }
  // Printed before the line below, so that whoever waits for that one can read these.
  std::printf("kvrecalld: %s (CUDA_MODULE_LOADING=%s)\n",
              (*server)->placements().gpu_description().c_str(),
              std::getenv("CUDA_MODULE_LOADING"));
  if (!(*server)->metrics_address().empty()) {
    std::printf("kvrecalld metrics on %s\n", (*server)->metrics_url().c_str());
  }
  if (!(*server)->health_address().empty()) {
    std::printf("kvrecalld health on %s\n", (*server)->health_address().c_str());
  }
  // Scripts and tests wait for this line (and read the port from it when they asked for 0).
  std::printf("kvrecalld listening on %s\n", (*server)->address().c_str());
  for (size_t i = 1; i < (*server)->addresses().size(); ++i) {
    std::printf("kvrecalld also listening on %s\n", (*server)->addresses()[i].c_str());
  }
  std::fflush(stdout);

  // Started with the signals blocked, as the threads before it.
  SighupReader sighup_reader(server->get());
  // This thread takes the signals again (beside any thread a library started before main).
  pthread_sigmask(SIG_UNBLOCK, &signals, nullptr);
  unsigned char signal_number = 0;
  for (;;) {
    // poll first: unlike a read under SA_RESTART it returns after any handler (signal(7)), so
    // that a handler deferred to the end of the interrupted call still runs. ThreadSanitizer
    // defers them so: a read restarted in the kernel never ended, and its kvrecalld never saw
    // SIGTERM (KvrecalldProcessTest under scripts/sanitize.sh tsan).
    pollfd readable = {.fd = shutdown_pipe[0], .events = POLLIN, .revents = 0};
    if (poll(&readable, 1, -1) != 1 || read(shutdown_pipe[0], &signal_number, 1) != 1) {
      if (errno == EINTR) continue;
      std::fprintf(stderr, "kvrecalld: reading the shutdown signals' pipe failed\n");
      if (!sighup_reader.Finish(absl::ZeroDuration())) std::_Exit(1);
      return 1;
    }
    if (signal_number != SIGHUP) break;
    sighup_reader.Ask();
  }
  // A second signal during the grace ends the process at once (the default action).
  SetSignalsHandler({SIGTERM, SIGINT}, SIG_DFL);
  std::printf("kvrecalld: received %s, shutting down (again to stop at once)\n",
              strsignal(signal_number));
  std::fflush(stdout);
  sighup_reader.StopReading();  // no SIGHUP read starts after this
  (*server)->Shutdown(absl::Seconds(grace_seconds));
  (*server)->Wait();
  std::printf("kvrecalld: stopped\n");
  std::fflush(stdout);
  // A read of the files still running (a SIGHUP's, a period's TLS read) after a second more is
  // stalled (a hung mount): it keeps its thread, and the process ends without destroying the
  // server under it, or joining that thread.
  const absl::Time give_up = absl::Now() + absl::Seconds(1);
  const bool sighup_read_ended = sighup_reader.Finish(absl::Seconds(1));
  while ((*server)->ReadingTlsFiles() && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  if (!sighup_read_ended || (*server)->ReadingTlsFiles()) {
    std::printf(
        "kvrecalld: a read of the %s files is still running (a stalled filesystem?); "
        "left to it\n",
        sighup_read_ended ? "TLS" : "token or TLS");
    std::fflush(stdout);
    std::_Exit(0);
  }
  // Work of calls cancelled at the end of the grace (a selector build, say) stops at its next
  // check (index/build_stop.h), but nobody waits for its result: exit without waiting for it.
  if ((*server)->busy()) std::_Exit(0);
  return 0;
}
