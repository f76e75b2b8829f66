// The real kvrecalld binary: it listens where it says, answers health checks and reflection
// (also through buf curl where buf is installed), serves decode steps, and shuts down cleanly
// on SIGTERM and SIGINT — turning NOT_SERVING for health watchers first.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "gmock/gmock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"
#include "tests/server_fixture.h"
#include "tests/test_util.h"

namespace kvrecall {
namespace {

using grpc::health::v1::Health;
using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;
using ::kvrecall::testing::CloseSession;
using ::kvrecall::testing::CreateSession;
using ::kvrecall::testing::DecodeClient;
using ::kvrecall::testing::KvrecalldProcess;
using ::kvrecall::testing::MakeChannel;
using ::kvrecall::testing::MakeGeometry;
using ::kvrecall::testing::MakePolicy;
using ::kvrecall::testing::MakeStep;
using ::kvrecall::testing::Prefill;
using ::kvrecall::testing::PromptChunks;
using ::kvrecall::testing::PromptLayer;
using ::kvrecall::testing::RandomNormal;
using ::kvrecall::testing::ScopedEnv;
using ::testing::HasSubstr;
using ::testing::Not;

std::unique_ptr<KvrecalldProcess> StartOrFail(std::vector<std::string> flags = {}) {
  absl::StatusOr<std::unique_ptr<KvrecalldProcess>> process =
      KvrecalldProcess::Start(std::move(flags));
  EXPECT_TRUE(process.ok()) << process.status();
  return process.ok() ? *std::move(process) : nullptr;
}

// Runs `command` through the shell; returns its stdout and stderr, *exit_code its exit status.
std::string RunCommand(const std::string& command, int* exit_code) {
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  std::string output;
  if (pipe == nullptr) return output;
  char buffer[512];
  while (fgets(buffer, sizeof buffer, pipe) != nullptr) output += buffer;
  *exit_code = WEXITSTATUS(pclose(pipe));
  return output;
}

HealthCheckResponse::ServingStatus CheckHealth(const std::string& address,
                                               const std::string& service = "") {
  auto stub = Health::NewStub(MakeChannel(address));
  grpc::ClientContext context;
  HealthCheckRequest request;
  request.set_service(service);
  HealthCheckResponse response;
  const grpc::Status status = stub->Check(&context, request, &response);
  EXPECT_TRUE(status.ok()) << status.error_message();
  return response.status();
}

// Creates a 1-layer session, prefills it and decodes one step through `address`.
void ServeOneStep(const std::string& address) {
  auto stub = v1::KvRecall::NewStub(MakeChannel(address));
  const v1::Geometry g = MakeGeometry(1, 4, 2, 16);
  absl::StatusOr<std::string> id = CreateSession(*stub, g, MakePolicy(v1::SELECTOR_FULL));
  ASSERT_TRUE(id.ok()) << id.status();
  PromptLayer p{RandomNormal(10 * 4 * 16, 1), RandomNormal(10 * 2 * 16, 2),
                RandomNormal(10 * 2 * 16, 3)};
  ASSERT_TRUE(Prefill(*stub, PromptChunks(*id, g, 0, p, 4)).ok());
  DecodeClient decode(*stub);
  v1::DecodeRequest request;
  *request.add_steps() =
      MakeStep(*id, g, RandomNormal(4 * 16, 4), RandomNormal(2 * 16, 5), RandomNormal(2 * 16, 6));
  absl::StatusOr<v1::DecodeResponse> reply = decode.Step(request);
  ASSERT_TRUE(reply.ok()) << reply.status();
  EXPECT_EQ(reply->results(0).position(), 10);
}

TEST(KvrecalldProcessTest, ServesAndStopsCleanlyOnSigterm) {
  std::unique_ptr<KvrecalldProcess> server = StartOrFail();
  ASSERT_NE(server, nullptr);
  EXPECT_THAT(server->address(), ::testing::StartsWith("127.0.0.1:"));
  EXPECT_EQ(CheckHealth(server->address()), HealthCheckResponse::SERVING);
  EXPECT_EQ(CheckHealth(server->address(), "kvrecall.v1.KvRecall"), HealthCheckResponse::SERVING);
  ServeOneStep(server->address());

  absl::StatusOr<int> status = server->Stop(SIGTERM);
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_TRUE(WIFEXITED(*status));
  EXPECT_EQ(WEXITSTATUS(*status), 0) << server->output();
  EXPECT_THAT(server->output(), HasSubstr("shutting down"));
  EXPECT_THAT(server->output(), HasSubstr("kvrecalld: stopped"));
}

TEST(KvrecalldProcessTest, SigintWithAnOpenStreamStopsAfterTheGracePeriod) {
  std::unique_ptr<KvrecalldProcess> server = StartOrFail({"--shutdown_grace_seconds=0.5"});
  ASSERT_NE(server, nullptr);
  auto stub = v1::KvRecall::NewStub(MakeChannel(server->address()));
  DecodeClient idle(*stub);  // an open Decode stream the client never closes
  v1::DecodeRequest empty;
  ASSERT_TRUE(idle.Step(empty).ok());

  absl::StatusOr<int> status = server->Stop(SIGINT, absl::Seconds(20));
  ASSERT_TRUE(status.ok()) << status.status() << server->output();
  EXPECT_TRUE(WIFEXITED(*status)) << "signal " << WTERMSIG(*status) << server->output();
  EXPECT_EQ(WEXITSTATUS(*status), 0) << server->output();
  // The stream was cut by the shutdown, not left hanging.
  const absl::StatusOr<v1::DecodeResponse> cut = idle.Step(empty);
  EXPECT_EQ(cut.status().code(), absl::StatusCode::kUnavailable) << cut.status();
  EXPECT_THAT(cut.status().message(), HasSubstr("kvrecalld is shutting down"));
}

// A process that inherits SIGINT and SIGTERM ignored (a background job of a non-interactive
// shell) still shuts down on them: kvrecalld handles both itself. (It waited for them with
// sigwait before: a signal that came before that call went to a thread a library started before
// main, OpenBLAS's, which dropped it when ignored, or ended the process when not.)
TEST(KvrecalldProcessTest, InheritedIgnoredShutdownSignalsStillStopIt) {
  for (const int signal : {SIGINT, SIGTERM}) {
    absl::StatusOr<std::unique_ptr<KvrecalldProcess>> server = KvrecalldProcess::Start(
        {"--shutdown_grace_seconds=0.5"}, absl::Seconds(30), /*shutdown_signals_ignored=*/true);
    ASSERT_TRUE(server.ok()) << server.status();
    auto stub = v1::KvRecall::NewStub(MakeChannel((*server)->address()));
    DecodeClient idle(*stub);
    ASSERT_TRUE(idle.Step(v1::DecodeRequest()).ok());
    absl::StatusOr<int> status = (*server)->Stop(signal, absl::Seconds(20));
    ASSERT_TRUE(status.ok()) << status.status() << (*server)->output();
    EXPECT_TRUE(WIFEXITED(*status)) << "signal " << WTERMSIG(*status) << (*server)->output();
    EXPECT_EQ(WEXITSTATUS(*status), 0) << (*server)->output();
    EXPECT_THAT((*server)->output(), HasSubstr("shutting down"));
  }
}

// A shutdown signal that comes while kvrecalld is still starting (here: reading its
// certificate from a FIFO the test holds) stops it as soon as it listens, whether the process
// inherited the signal ignored or at its default action. Deterministic where the test above
// signals only once kvrecalld listens: the test opens the FIFO's write end, which returns once
// kvrecalld opened it to read, inside its start and after its handler was installed.
TEST(KvrecalldProcessTest, AShutdownSignalDuringStartupStopsItOnceListening) {
  testing::TempDirectory dir("startup_signal");
  const std::string key = dir.Path("key.pem"), cert = dir.Path("cert.pem");
  int code = -1;
  const std::string made = RunCommand(
      absl::StrCat("openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes "
                   "-keyout ", key, " -out ", cert, " -days 1 -subj /CN=localhost"),
      &code);
  if (code == 127) GTEST_SKIP() << "no openssl: " << made;
  ASSERT_EQ(code, 0) << made;
  std::ifstream cert_file(cert);
  const std::string cert_text((std::istreambuf_iterator<char>(cert_file)),
                              std::istreambuf_iterator<char>());
  for (const bool inherited_ignored : {true, false}) {
    for (const int signal_number : {SIGTERM, SIGINT}) {
      SCOPED_TRACE(absl::StrCat(strsignal(signal_number), inherited_ignored ? " ignored" : ""));
      const std::string fifo = dir.Path(absl::StrCat("cert-", signal_number, inherited_ignored));
      ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
      int out[2];
      ASSERT_EQ(pipe2(out, O_CLOEXEC), 0);
      // Everything the child needs, made before the fork (a child of a threaded process may
      // not allocate).
      const std::string binary = KvrecalldProcess::BinaryPath();
      const std::string tls_cert = "--tls_cert=" + fifo, tls_key = "--tls_key=" + key;
      const pid_t pid = fork();
      ASSERT_GE(pid, 0);
      if (pid == 0) {
        dup2(out[1], STDOUT_FILENO);
        dup2(out[1], STDERR_FILENO);
        signal(SIGINT, inherited_ignored ? SIG_IGN : SIG_DFL);
        signal(SIGTERM, inherited_ignored ? SIG_IGN : SIG_DFL);
        // --tls_refresh_seconds=0: the certificate read once, from the FIFO (gRPC's file
        // watcher would read it a second time, from a FIFO nobody writes again).
        execl(binary.c_str(), binary.c_str(), "--address=127.0.0.1:0", "--metrics_address=",
              tls_cert.c_str(), tls_key.c_str(), "--tls_refresh_seconds=0",
              static_cast<char*>(nullptr));
        _exit(127);
      }
      close(out[1]);
      const int writer = open(fifo.c_str(), O_WRONLY);  // returns once kvrecalld reads it
      ASSERT_GE(writer, 0);
      kill(pid, signal_number);
      absl::SleepFor(absl::Milliseconds(100));  // the signal is taken before the server starts
      ASSERT_EQ(write(writer, cert_text.data(), cert_text.size()),
                static_cast<ssize_t>(cert_text.size()));
      close(writer);
      int status = 0;
      pid_t waited = 0;
      for (int i = 0; i < 400 && waited == 0; ++i) {  // 20 s
        waited = waitpid(pid, &status, WNOHANG);
        if (waited == 0) absl::SleepFor(absl::Milliseconds(50));
      }
      if (waited == 0) {
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
      }
      std::string output;
      char buffer[4096];
      for (ssize_t n; (n = read(out[0], buffer, sizeof buffer)) > 0;) output.append(buffer, n);
      close(out[0]);
      ASSERT_NE(waited, 0) << "still running 20 s after the signal:\n" << output;
      EXPECT_TRUE(WIFEXITED(status)) << "ended by signal " << WTERMSIG(status) << "\n" << output;
      EXPECT_EQ(WEXITSTATUS(status), 0) << output;
      EXPECT_THAT(output, HasSubstr("kvrecalld listening on"));
      EXPECT_THAT(output, HasSubstr("shutting down"));
    }
  }
}

// A --shared_memory_dir this process cannot write is refused at start (it was found at the first
// DecodeShared call). Root writes everywhere, so as root kvrecalld runs as nobody (setpriv).
TEST(KvrecalldProcessTest, AnUnwritableSharedMemoryDirIsRefusedAtStart) {
  testing::TempDirectory dir("unwritable_shm");
  const std::string shm = dir.Path("regions");
  ASSERT_TRUE(std::filesystem::create_directory(shm));
  ASSERT_EQ(chmod(dir.path().c_str(), 0755), 0);  // reachable by all
  ASSERT_EQ(chmod(shm.c_str(), 0555), 0);         // writable by none but root
  int code = -1;
  std::string as_user;
  if (geteuid() == 0) {
    RunCommand("command -v setpriv", &code);
    if (code != 0) GTEST_SKIP() << "running as root without setpriv to drop to nobody";
    as_user = "setpriv --reuid=65534 --regid=65534 --clear-groups ";
  }
  const std::string output = RunCommand(
      absl::StrCat(as_user, KvrecalldProcess::BinaryPath(),
                   " --address=127.0.0.1:0 --metrics_address= --shared_memory_dir=", shm),
      &code);
  EXPECT_EQ(code, 2) << output;  // a flag's value refused
  EXPECT_THAT(output, HasSubstr("shared_memory_dir " + shm + " is not writable by this process"));
  // One it cannot even reach is named as such (it was "not a directory (Permission denied)");
  // its owner reaches a 0700 directory, so this takes another user.
  if (as_user.empty()) return;
  ASSERT_EQ(chmod(dir.path().c_str(), 0700), 0);
  const std::string unreachable = RunCommand(
      absl::StrCat(as_user, KvrecalldProcess::BinaryPath(),
                   " --address=127.0.0.1:0 --metrics_address= --shared_memory_dir=", shm),
      &code);
  EXPECT_EQ(code, 2) << unreachable;
  EXPECT_THAT(unreachable, HasSubstr("cannot be reached by this process"));
}

TEST(KvrecalldProcessTest, HealthWatchSeesNotServingOnShutdown) {
  std::unique_ptr<KvrecalldProcess> server = StartOrFail();
  ASSERT_NE(server, nullptr);
  auto stub = Health::NewStub(MakeChannel(server->address()));
  grpc::ClientContext context;
  HealthCheckRequest request;
  auto watch = stub->Watch(&context, request);
  HealthCheckResponse response;
  ASSERT_TRUE(watch->Read(&response));
  EXPECT_EQ(response.status(), HealthCheckResponse::SERVING);

  kill(server->pid(), SIGTERM);
  ASSERT_TRUE(watch->Read(&response)) << watch->Finish().error_message() << server->output();
  EXPECT_EQ(response.status(), HealthCheckResponse::NOT_SERVING);
  EXPECT_FALSE(watch->Read(&response));
  absl::StatusOr<int> status = server->Stop(SIGTERM);
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(WEXITSTATUS(*status), 0);
}

TEST(KvrecalldProcessTest, UnknownHealthServiceIsNotFound) {
  std::unique_ptr<KvrecalldProcess> server = StartOrFail();
  ASSERT_NE(server, nullptr);
  auto stub = Health::NewStub(MakeChannel(server->address()));
  grpc::ClientContext context;
  HealthCheckRequest request;
  request.set_service("no.such.Service");
  HealthCheckResponse response;
  const grpc::Status status = stub->Check(&context, request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(status.error_message(), HasSubstr("unknown service 'no.such.Service'"));
  // A long name is not echoed whole: the client's limit on the reply's metadata turned it into
  // RESOURCE_EXHAUSTED (probe 20, 8).
  grpc::ClientContext long_context;
  request.set_service(std::string(1000, 'x'));
  const grpc::Status long_status = stub->Check(&long_context, request, &response);
  EXPECT_EQ(long_status.error_code(), grpc::StatusCode::NOT_FOUND) << long_status.error_message();
  EXPECT_THAT(long_status.error_message(),
              HasSubstr("unknown service of 1000 bytes, beginning '" + std::string(128, 'x') +
                        "'"));
  // Past 1 KiB a request is no service name (probe 26, 1).
  grpc::ClientContext longer_context;
  request.set_service(std::string(9000, 'x'));
  const grpc::Status longer_status = stub->Check(&longer_context, request, &response);
  EXPECT_EQ(longer_status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(longer_status.error_message(),
              HasSubstr("a health check request of 9003 bytes: at most 1024"));
}

// --help lists kvrecalld's flags with their help (Abseil's default looked for a source file
// named after the program and printed "No flags matched").
TEST(KvrecalldProcessTest, HelpListsTheFlags) {
  int code = -1;
  const std::string output =
      RunCommand(absl::StrCat(KvrecalldProcess::BinaryPath(), " --help"), &code);
  EXPECT_EQ(code, 1) << "Abseil's --help exits 1";
  EXPECT_THAT(output, HasSubstr("--address (HOST:PORT to listen on"));
  EXPECT_THAT(output, HasSubstr("--host_memory_budget_gb"));
  EXPECT_THAT(output, Not(HasSubstr("No flags matched")));
}

TEST(KvrecalldProcessTest, BadFlagsAndBusyPortsFailToStart) {
  std::unique_ptr<KvrecalldProcess> server = StartOrFail();
  ASSERT_NE(server, nullptr);
  const std::string taken = absl::StrCat("--address=", server->address());
  int code = -1;
  // kvrecalld with `flags` exits `want` and says `message`.
  auto expect_exit = [&](const std::string& flags, int want, const std::string& message) {
    const std::string out =
        RunCommand(absl::StrCat(KvrecalldProcess::BinaryPath(), " ", flags), &code);
    EXPECT_EQ(code, want) << flags << ": " << out;
    EXPECT_THAT(out, HasSubstr(message)) << flags;
  };
  expect_exit(taken, 1, "could not listen on " + server->address());
  // A command line Abseil's parser refuses exits 1, as the README says (probe 25, 1: it said 2).
  expect_exit("--no_such_flag=1", 1, "Unknown command line flag 'no_such_flag'");
  expect_exit("--max_sessions=abc", 1, "Illegal value 'abc' specified for flag 'max_sessions'");
  expect_exit("--flagfile=/nonexistent/flags", 1, "/nonexistent/flags");

  const std::string bad =
      absl::StrCat(KvrecalldProcess::BinaryPath(), " --max_message_mb=0 2>&1 >/dev/null");
  EXPECT_EQ(WEXITSTATUS(std::system(bad.c_str())), 2);
  expect_exit("--malloc_mmap_threshold_kb=-1", 2,
              "--malloc_mmap_threshold_kb must be in [0, 32768]");
  expect_exit("--compute_spin_us=-1", 2, "--compute_spin_us must be in [0, 1000000]");
  // Values that were silently taken for something else: an endless grace (nan, inf), no grace
  // (negative), no budget (a budget past 2^63 bytes, or one that rounds to 0 bytes), and two
  // backends each budgeting one device's whole memory.
  for (const auto& [flag, message] : std::vector<std::pair<std::string, std::string>>{
           {"--shutdown_grace_seconds=nan", "--shutdown_grace_seconds must be finite and >= 0"},
           {"--shutdown_grace_seconds=inf", "--shutdown_grace_seconds must be finite and >= 0"},
           {"--shutdown_grace_seconds=-5", "--shutdown_grace_seconds must be finite and >= 0"},
           {"--host_memory_budget_gb=1e10", "--host_memory_budget_gb must be 0 (no budget) or"},
           {"--host_memory_budget_gb=1e-10", "--host_memory_budget_gb must be 0 (no budget) or"},
           {"--gpus=0,0", "--gpus names device 0 twice"},
           {"--gpu_memory_budget_gb=1e10", "--gpu_memory_budget_gb must be 0, in [2^-30, 2^33)"},
           {"--gpu_memory_budget_gb=1e-10", "--gpu_memory_budget_gb must be 0, in [2^-30, 2^33)"},
           {"--cuda_module_loading=EAGER",
            "--cuda_module_loading must be eager, lazy or empty, got 'EAGER'"},
           // Arguments that are not flags were ignored (probe 20, 3): a boolean's value after a
           // space left the flag true, a flag without dashes or after `--` did nothing.
           {"--plaintext_unix_sockets false", "unexpected argument 'false' (1 not a flag)"},
           {"max_sessions=1", "unexpected argument 'max_sessions=1'"},
           {"-- --max_sessions=1", "unexpected argument '--max_sessions=1'"},
       }) {
    expect_exit(flag, 2, message);
  }
  // Values the server's own options refuse, each naming its flag as given, with the exit code of
  // the flags above (probe 17, 1 and 8: a port past 65535 was served modulo 2^16; the spin's
  // message named no flag there is; these exited 1, the others 2).
  for (const auto& [flag, message] : std::vector<std::pair<std::string, std::string>>{
           {"--address=127.0.0.1:99999",
            "--address entry '127.0.0.1:99999' must be HOST:PORT with a port in [0, 65535]"},
           {"--address=127.0.0.1:0 --health_address=127.0.0.1:112664",
            "--health_address entry '127.0.0.1:112664' must be HOST:PORT"},
           {"--shared_memory_spin_us=2000000",
            "--shared_memory_spin_us must be in [0, 1000000], got 2000000"},
           {"--worker_threads=5000", "--worker_threads must be in [0, 1024], got 5000"},
           {"--max_sessions=-1", "--max_sessions must be >= 0"},
           {"--max_sessions_per_tenant=-1", "--max_sessions_per_tenant must be >= 0"},
           {"--host_memory_budget_per_tenant_gb=-1",
            "--host_memory_budget_per_tenant_gb must be 0 (none but the server's budget) or in "
            "[2^-30, 2^33) GiB, got -1"},
           {"--gpu_memory_budget_per_tenant_gb=nan",
            "--gpu_memory_budget_per_tenant_gb must be 0"},
           {"--tls_cert=/nonexistent.pem --tls_key=/nonexistent.key",
            "--tls_cert: cannot read /nonexistent.pem"},
           {"--address=unix:", "--address entry 'unix:' names no socket"},
           {"--address=127.0.0.1:0 --health_address=unix:/",
            "--health_address entry 'unix:/': / exists and is not a socket (a directory)"},
           {"--address=127.0.0.1:0 --metrics_token_file=/nonexistent/tokens",
            "--metrics_token_file needs a metrics endpoint (--metrics_address is empty)"},
       }) {
    expect_exit("--metrics_address= " + flag, 2, message);
  }
  expect_exit(
      "--address=127.0.0.1:0 --metrics_address=127.0.0.1:0 --metrics_token_file=/nonexistent/t",
      2, "--metrics_token_file: cannot read /nonexistent/t");
}

// Flags from a --flagfile are flags like any other: its --metrics_address was replaced by the
// default (port 9090), because only argv was searched for it.
TEST(KvrecalldProcessTest, AFlagfilesMetricsAddressIsServed) {
  testing::TempDirectory dir("flagfile");
  ASSERT_NE(dir.path(), "");
  std::ofstream(dir.Path("flags")) << "--metrics_address=127.0.0.1:0\n";
  int code = -1;
  const std::string output =
      RunCommand(absl::StrCat("timeout -s TERM 3 ", KvrecalldProcess::BinaryPath(),
                              " --address=127.0.0.1:0 --flagfile=", dir.Path("flags")),
                 &code);
  EXPECT_THAT(output, HasSubstr("kvrecalld metrics on http://127.0.0.1:"));
  EXPECT_THAT(output, Not(HasSubstr("127.0.0.1:9090")));
}

// The start-up log says what GPU placements are served and which CUDA_MODULE_LOADING kvrecalld
// put in force: EAGER by default, the flag's when given (over the environment's), else the
// environment's when it has one. With a device it also says how the driver loads the kernels,
// its own answer (cuModuleGetLoadingMode), not the flag's echo; without one, why there are no
// GPU placements.
TEST(KvrecalldProcessTest, TheLogSaysHowCudaLoadsTheKernels) {
  auto log_of = [](std::vector<std::string> flags, const char* environment) -> std::string {
    ScopedEnv env("CUDA_MODULE_LOADING", environment);
    std::unique_ptr<KvrecalldProcess> server = StartOrFail(std::move(flags));
    if (server == nullptr) return "";
    const std::string output = server->output();
    EXPECT_TRUE(server->Stop().ok());
    return output;
  };
  const std::string by_default = log_of({}, nullptr);
  ASSERT_THAT(by_default, HasSubstr("kvrecalld listening on "));
  const bool device = !absl::StrContains(by_default, "kvrecalld: no GPU placements: ");
  // What each start must say: the variable in force and, with a device, the driver's mode.
  auto expect = [&](const std::string& log, const std::string& variable, const std::string& how) {
    EXPECT_THAT(log, HasSubstr(absl::StrCat("(CUDA_MODULE_LOADING=", variable, ")\n")));
    if (device) {
      EXPECT_THAT(log, HasSubstr(absl::StrCat("; CUDA loads their kernels ", how, " (")));
    } else {
      EXPECT_THAT(log, ::testing::ContainsRegex(
                           "kvrecalld: no GPU placements: (no CUDA device|this kvrecalld was "
                           "built without CUDA)"));
      EXPECT_THAT(log, ::testing::Not(HasSubstr("loads their kernels")));
    }
  };
  expect(by_default, "EAGER", "eagerly");
  if (device) EXPECT_THAT(by_default, HasSubstr("kvrecalld: GPU placements on device"));
  expect(log_of({"--cuda_module_loading=lazy"}, nullptr), "LAZY", "lazily");
  expect(log_of({}, "LAZY"), "LAZY", "lazily");
  expect(log_of({"--cuda_module_loading="}, "LAZY"), "LAZY", "lazily");
  expect(log_of({}, ""), "EAGER", "eagerly");  // set but empty: not a value
  expect(log_of({"--cuda_module_loading=eager"}, "LAZY"), "EAGER", "eagerly");
  expect(log_of({"--cuda_module_loading=lazy"}, "EAGER"), "LAZY", "lazily");
}

// The resident memory of a process, from /proc (0 when unreadable).
int64_t ResidentBytes(pid_t pid) {
  std::FILE* f = std::fopen(absl::StrCat("/proc/", pid, "/statm").c_str(), "r");
  if (f == nullptr) return 0;
  long pages = 0, resident = 0;
  const int read = std::fscanf(f, "%ld %ld", &pages, &resident);
  std::fclose(f);
  return read == 2 ? int64_t{resident} * sysconf(_SC_PAGESIZE) : 0;
}

// Closed sessions give their memory back to the OS while others stay open: 8 sessions of 4 MiB
// KV arrays (2 layers of keys and values: 128 MiB a round), opened concurrently, close while
// small ones opened beside them live on, six times. After each round the server may keep some
// of what the round held resident (gRPC's and malloc's buffers of the concurrent prefills: 3 to
// 31 MiB here, varying from round to round without growing), but not a third of it: KV that
// outlives its close (or that malloc keeps resident after it was freed, as glibc's adaptive mmap
// threshold did under the load test: bench/results/hardening.md) fails the first round, and a
// session's KV (16 MiB) left behind every round fails by the sixth.
TEST(KvrecalldProcessTest, ClosedSessionsGiveTheirMemoryBack) {
  std::unique_ptr<KvrecalldProcess> server = StartOrFail();
  ASSERT_NE(server, nullptr);
  auto stub = v1::KvRecall::NewStub(MakeChannel(server->address()));
  const v1::Geometry g = MakeGeometry(2, 8, 8, 128);
  constexpr int64_t kTokens = 1024;
  const PromptLayer prompt{RandomNormal(kTokens * 8 * 128, 1), RandomNormal(kTokens * 8 * 128, 2),
                           RandomNormal(kTokens * 8 * 128, 3)};
  auto open_session = [&](int64_t tokens) -> std::string {
    absl::StatusOr<std::string> id = CreateSession(*stub, g, MakePolicy(v1::SELECTOR_FULL));
    EXPECT_TRUE(id.ok()) << id.status();
    if (!id.ok()) return "";
    const PromptLayer part{
        std::vector<float>(prompt.q.begin(), prompt.q.begin() + tokens * 8 * 128),
        std::vector<float>(prompt.k.begin(), prompt.k.begin() + tokens * 8 * 128),
        std::vector<float>(prompt.v.begin(), prompt.v.begin() + tokens * 8 * 128)};
    std::vector<v1::PrefillChunk> chunks = PromptChunks(*id, g, 0, part, 256);
    for (v1::PrefillChunk& c : PromptChunks(*id, g, 1, part, 256)) chunks.push_back(std::move(c));
    EXPECT_TRUE(Prefill(*stub, chunks).ok());
    return *id;
  };
  auto close_session = [&](const std::string& id) { EXPECT_TRUE(CloseSession(*stub, id).ok()); };
  // A first session warms what a server keeps once it has served (threads, gRPC's buffers).
  close_session(open_session(kTokens));
  const int64_t before = ResidentBytes(server->pid());
  absl::Mutex small_mu;
  std::vector<std::string> small;  // small sessions that stay open
  for (int round = 0; round < 6; ++round) {
    // Opened concurrently, as runners do: the server's threads allocate from several arenas.
    std::vector<std::string> ids(8);
    std::vector<std::thread> openers;
    for (int s = 0; s < 8; ++s) {
      openers.emplace_back([&, s] {
        ids[s] = open_session(kTokens);
        if (s % 2 == 0) {
          std::string id = open_session(16);
          absl::MutexLock lock(&small_mu);
          small.push_back(std::move(id));
        }
      });
    }
    for (std::thread& t : openers) t.join();
    const int64_t held = ResidentBytes(server->pid());
    EXPECT_GT(held - before, 8 * 2 * 2 * (int64_t{4} << 20)) << "the KV is resident while open";
    for (const std::string& id : ids) close_session(id);
    const int64_t after = ResidentBytes(server->pid());
    EXPECT_LT(after - before, (held - before) / 3)
        << "round " << round << ": " << (before >> 20) << " MiB before, " << (held >> 20)
        << " MiB open, " << (after >> 20) << " MiB after closing";
  }
}

// buf (installed by scripts/install_deps.sh into .tools/) speaks reflection: no .proto needed.
std::string FindBuf() {
  const std::string local = std::string(KVRECALL_SOURCE_DIR) + "/.tools/node_modules/.bin/buf";
  if (std::filesystem::exists(local)) return local;
  if (std::system("command -v buf >/dev/null 2>&1") == 0) return "buf";
  return "";
}

TEST(KvrecalldProcessTest, BufCurlWorksThroughReflection) {
  const std::string buf = FindBuf();
  if (buf.empty()) GTEST_SKIP() << "buf is not installed (scripts/install_deps.sh installs it)";
  std::unique_ptr<KvrecalldProcess> server = StartOrFail();
  ASSERT_NE(server, nullptr);
  const std::string base = absl::StrCat(buf, " curl --protocol grpc --http2-prior-knowledge ");
  const std::string url = absl::StrCat("http://", server->address());
  int code = -1;

  std::string out = RunCommand(base + "--list-services " + url, &code);
  EXPECT_EQ(code, 0) << out;
  EXPECT_THAT(out, HasSubstr("kvrecall.v1.KvRecall"));
  EXPECT_THAT(out, HasSubstr("grpc.health.v1.Health"));
  EXPECT_THAT(out, HasSubstr("grpc.reflection.v1alpha.ServerReflection"));

  out = RunCommand(base + url + "/grpc.health.v1.Health/Check", &code);
  EXPECT_EQ(code, 0) << out;
  EXPECT_THAT(out, HasSubstr("\"status\": \"SERVING\""));

  // A person debugging with JSON: create a session, then read it back.
  out = RunCommand(base +
                       "-d '{\"geometry\": {\"layers\": 2, \"qHeads\": 4, \"kvHeads\": 2, "
                       "\"headDim\": 8, \"dtype\": \"DTYPE_BF16\"}, \"policy\": {\"selector\": "
                       "\"SELECTOR_STREAMING\", \"sinks\": 4, \"recent\": 16}}' " +
                       url + "/kvrecall.v1.KvRecall/CreateSession",
                   &code);
  EXPECT_EQ(code, 0) << out;
  EXPECT_THAT(out, HasSubstr("\"selector\": \"SELECTOR_STREAMING\""));
  const size_t at = out.find("\"sessionId\": \"");
  ASSERT_NE(at, std::string::npos) << out;
  const size_t begin = at + std::string("\"sessionId\": \"").size();
  const std::string id = out.substr(begin, out.find('"', begin) - begin);

  out = RunCommand(
      base + "-d '{\"sessionId\": \"" + id + "\"}' " + url + "/kvrecall.v1.KvRecall/GetSession",
      &code);
  EXPECT_EQ(code, 0) << out;
  EXPECT_THAT(out, HasSubstr("\"headDim\": 8"));

  // Errors come back with their code and message.
  out = RunCommand(
      base + "-d '{\"sessionId\": \"s-missing\"}' " + url + "/kvrecall.v1.KvRecall/GetSession",
      &code);
  EXPECT_NE(code, 0);
  EXPECT_THAT(out, HasSubstr("not_found"));
  EXPECT_THAT(out, HasSubstr("no session 's-missing'"));
}

}  // namespace
}  // namespace kvrecall
