// Test fixtures for anything that talks to a kvrecall server: an in-process server on
// 127.0.0.1 (port 0) with a stub, the real kvrecalld binary as a subprocess on a free loopback
// port, and small helpers to create sessions, stream prompts and drive a Decode stream.
// Header-only so that every tests/*_test.cc can include it without build changes.
#ifndef KVRECALL_TESTS_SERVER_FIXTURE_H_
#define KVRECALL_TESTS_SERVER_FIXTURE_H_

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/kvrecall_client.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "kernels/kv_view.h"
#include "kvrecall/v1/kvrecall.grpc.pb.h"
#include "proto/tensor_codec.h"
#include "server/server.h"
#include "tests/test_util.h"

namespace kvrecall::testing {

// gRPC and absl share the canonical status codes, number for number.
inline absl::Status FromGrpc(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

// Success when `status` has `code` and its message contains `substring`; use as
// EXPECT_TRUE(HasStatus(...)) so that failures report the line of the expectation.
inline ::testing::AssertionResult HasStatus(const absl::Status& status, absl::StatusCode code,
                                            absl::string_view substring) {
  if (status.code() == code && absl::StrContains(status.message(), substring)) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure()
         << "got " << status << "; want " << absl::StatusCodeToString(code)
         << " with a message containing \"" << substring << "\"";
}

// Polls `done` every 10 ms until it holds or `timeout` passes; whether it held.
inline bool Within(absl::Duration timeout, absl::FunctionRef<bool()> done) {
  const absl::Time until = absl::Now() + timeout;
  while (!done()) {
    if (absl::Now() >= until) return false;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return true;
}

// The value of one series in a Prometheus text exposition (`series`: the name and its labels as
// exposed, `kvrecall_x_total{how="ahead"}`); 0 where the text has no such series.
inline double SeriesValue(const std::string& text, absl::string_view series) {
  const std::string line = absl::StrCat("\n", series, " ");
  const size_t at = text.find(line);
  return at == std::string::npos ? 0 : std::stod(text.substr(at + line.size()));
}

// How often `server` refused a request because of `limit` (kvrecall_requests_refused_total).
inline int RefusalsCounted(RunningServer& server, absl::string_view limit) {
  return static_cast<int>(
      SeriesValue(server.metrics().TextFormat(),
                  absl::StrCat("kvrecall_requests_refused_total{limit=\"", limit, "\"}")));
}

// A channel to `address` whose messages may be as large as the server's default limit and
// beyond (so that tests of the server's limit are not stopped by the client's).
inline std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address,
                                                  int max_message_bytes = 256 << 20) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(max_message_bytes);
  args.SetMaxSendMessageSize(max_message_bytes);
  return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
}

// A kvrecall server running inside the test process on 127.0.0.1 with a free port.
class InProcessServer {
 public:
  static absl::StatusOr<std::unique_ptr<InProcessServer>> Start(ServerOptions options = {}) {
    options.address = "127.0.0.1:0";
    absl::StatusOr<std::unique_ptr<RunningServer>> server = StartServer(options);
    if (!server.ok()) return server.status();
    return std::unique_ptr<InProcessServer>(new InProcessServer(*std::move(server)));
  }

  const std::string& address() const { return server_->address(); }
  std::shared_ptr<grpc::Channel> channel() const { return channel_; }
  v1::KvRecall::Stub& stub() { return *stub_; }
  RunningServer& server() { return *server_; }

 private:
  explicit InProcessServer(std::unique_ptr<RunningServer> server)
      : server_(std::move(server)),
        channel_(MakeChannel(server_->address())),
        stub_(v1::KvRecall::NewStub(channel_)) {}

  std::unique_ptr<RunningServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::KvRecall::Stub> stub_;
};

// A GoogleTest fixture whose tests each get a fresh in-process server. Override Options() to
// configure it.
class ServerTest : public ::testing::Test {
 protected:
  virtual ServerOptions Options() const { return {}; }
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<InProcessServer>> server = InProcessServer::Start(Options());
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
  }
  v1::KvRecall::Stub& stub() { return server_->stub(); }
  InProcessServer& server() { return *server_; }
  // Whether PLACEMENT_TIERED keeps its static sets on a GPU here (else in host memory).
  bool TieredOnGpu() { return server().server().placements().tiered().front()->device() != "cpu"; }

  std::unique_ptr<InProcessServer> server_;
};

// The real kvrecalld binary of this build, started on 127.0.0.1 with a port it picks itself
// (it prints the address it listens on; that line is awaited), its output captured.
class KvrecalldProcess {
 public:
  static std::string BinaryPath() { return BuildProgram("server/kvrecalld"); }

  // Starts kvrecalld --address=127.0.0.1:0 --metrics_address=127.0.0.1:0 plus `flags` and waits
  // up to `timeout` for it to listen. `shutdown_signals_ignored`: it starts with SIGINT and
  // SIGTERM ignored, as a background job of a non-interactive shell does. `launcher`: a command
  // that runs kvrecalld as its child (strace ... --), whose exit status is kvrecalld's; pid()
  // is kvrecalld's own, and Stop signals it.
  static absl::StatusOr<std::unique_ptr<KvrecalldProcess>> Start(
      std::vector<std::string> flags = {}, absl::Duration timeout = absl::Seconds(30),
      bool shutdown_signals_ignored = false, std::vector<std::string> launcher = {}) {
    int out[2];
    if (pipe2(out, O_CLOEXEC) != 0) return absl::InternalError("pipe2 failed");
    std::vector<std::string> args = launcher;
    for (std::string a : {BinaryPath(), std::string("--address=127.0.0.1:0"),
                          std::string("--metrics_address=127.0.0.1:0")}) {
      args.push_back(std::move(a));
    }
    args.insert(args.end(), flags.begin(), flags.end());
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    const pid_t pid = fork();
    if (pid < 0) return absl::InternalError("fork failed");
    if (pid == 0) {
      dup2(out[1], STDOUT_FILENO);
      dup2(out[1], STDERR_FILENO);
      if (shutdown_signals_ignored) {
        signal(SIGINT, SIG_IGN);
        signal(SIGTERM, SIG_IGN);
      }
      execvp(argv[0], argv.data());
      _exit(127);
    }
    close(out[1]);
    std::unique_ptr<KvrecalldProcess> process(new KvrecalldProcess(pid, out[0]));
    const std::string marker = "kvrecalld listening on ";
    absl::MutexLock lock(&process->mu_);
    auto listening = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(process->mu_) {
      return process->output_.find('\n', process->output_.find(marker)) != std::string::npos &&
             process->output_.find(marker) != std::string::npos;
    };
    auto ready_or_gone = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(process->mu_) {
      return listening() || process->eof_;
    };
    process->mu_.AwaitWithTimeout(absl::Condition(&ready_or_gone), timeout);
    if (!listening()) {
      return absl::UnavailableError(absl::StrCat(args[0], " did not report listening within ",
                                                 absl::FormatDuration(timeout),
                                                 "; its output: ", process->output_));
    }
    const size_t begin = process->output_.find(marker) + marker.size();
    process->address_ = process->output_.substr(begin, process->output_.find('\n', begin) - begin);
    if (!launcher.empty()) {
      // (-1 must never reach kill(2): it would signal every process this user may.)
      const pid_t server_pid = ChildOf(pid);
      if (server_pid <= 0) {
        return absl::InternalError(absl::StrCat("no child of ", launcher[0], " (pid ", pid, ")"));
      }
      process->server_pid_ = server_pid;
      // Signalled through a pidfd: once the launcher reaps it, its pid may be another's.
      process->server_pidfd_ = static_cast<int>(syscall(SYS_pidfd_open, server_pid, 0));
    }
    return process;
  }

  ~KvrecalldProcess() {
    if (!exited_) {
      if (server_pid_ != pid_) Signal(SIGKILL);
      kill(pid_, SIGKILL);
      int status;
      waitpid(pid_, &status, 0);
    }
    reader_.join();
    close(fd_);
    if (server_pidfd_ >= 0) close(server_pidfd_);
  }

  // Sends `signal` to kvrecalld (not to its launcher): through its pidfd where the kernel gave
  // one, else by pid (which a launcher that reaped it may have seen reused: rare).
  void Signal(int signal) const {
    if (server_pidfd_ >= 0 &&
        syscall(SYS_pidfd_send_signal, server_pidfd_, signal, nullptr, 0) == 0) {
      return;
    }
    if (server_pidfd_ >= 0 && errno == ESRCH) return;  // gone
    kill(server_pid_, signal);
  }

  pid_t pid() const { return server_pid_; }
  const std::string& address() const { return address_; }
  std::string output() const {
    absl::MutexLock lock(&mu_);
    return output_;
  }

  // Sends `signal` and waits up to `timeout` for the process to exit; returns its wait status
  // (check with WIFEXITED/WEXITSTATUS), or DEADLINE_EXCEEDED when it kept running.
  absl::StatusOr<int> Stop(int signal = SIGTERM, absl::Duration timeout = absl::Seconds(30)) {
    Signal(signal);
    const absl::Time deadline = absl::Now() + timeout;
    while (absl::Now() < deadline) {
      int status;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        exited_ = true;
        return status;
      }
      absl::SleepFor(absl::Milliseconds(10));
    }
    return absl::DeadlineExceededError(absl::StrCat("kvrecalld (pid ", server_pid_, ") still runs ",
                                                    absl::FormatDuration(timeout), " after signal ",
                                                    signal));
  }

 private:
  KvrecalldProcess(pid_t pid, int fd)
      : pid_(pid), server_pid_(pid), fd_(fd), reader_([this] { Drain(); }) {}

  // The one process whose parent is `parent` (/proc/PID/stat's fourth field), or -1.
  static pid_t ChildOf(pid_t parent) {
    std::unique_ptr<DIR, int (*)(DIR*)> proc(opendir("/proc"), &closedir);
    if (proc == nullptr) return -1;
    while (const dirent* entry = readdir(proc.get())) {
      pid_t pid = 0;
      if (!absl::SimpleAtoi(entry->d_name, &pid)) continue;
      std::ifstream stat(absl::StrCat("/proc/", pid, "/stat"));
      std::string line;
      if (!std::getline(stat, line) || line.rfind(')') == std::string::npos) continue;
      // After "PID (COMM)": the state, then the parent's pid.
      std::vector<std::string> fields = absl::StrSplit(line.substr(line.rfind(')') + 2), ' ');
      pid_t ppid = 0;
      if (fields.size() > 1 && absl::SimpleAtoi(fields[1], &ppid) && ppid == parent) return pid;
    }
    return -1;
  }

  // Collects the child's output until it closes its end, so the child never blocks on a full
  // pipe and the output stays available to assertions.
  void Drain() {
    char buffer[4096];
    while (true) {
      const ssize_t n = read(fd_, buffer, sizeof buffer);
      if (n < 0 && errno == EINTR) continue;
      absl::MutexLock lock(&mu_);
      if (n <= 0) {
        eof_ = true;
        return;
      }
      output_.append(buffer, n);
    }
  }

  const pid_t pid_;   // the process started (kvrecalld, or its launcher)
  pid_t server_pid_;  // kvrecalld's
  int server_pidfd_ = -1;  // with a launcher: kvrecalld's pidfd
  const int fd_;
  bool exited_ = false;
  std::string address_;
  mutable absl::Mutex mu_;
  std::string output_ ABSL_GUARDED_BY(mu_);
  bool eof_ ABSL_GUARDED_BY(mu_) = false;
  std::thread reader_;
};

// ---------------------------------------------------------------------------------------------
// Request helpers.

inline v1::Geometry MakeGeometry(int layers, int q_heads, int kv_heads, int head_dim,
                                 v1::DType dtype = v1::DTYPE_F32) {
  v1::Geometry g;
  g.set_layers(layers);
  g.set_q_heads(q_heads);
  g.set_kv_heads(kv_heads);
  g.set_head_dim(head_dim);
  g.set_dtype(dtype);
  return g;
}

// sinks, recent: nullopt leaves them unset (the server's defaults).
inline v1::Policy MakePolicy(v1::Selector selector, int top_k = 0,
                             std::optional<int> sinks = std::nullopt,
                             std::optional<int> recent = std::nullopt) {
  return client::CpuPolicy(selector, top_k, sinks, recent);
}

// A tensor of `shape` holding `data` as raw bytes of `dtype` (or as plain values).
inline v1::Tensor MakeTensor(std::span<const float> data, std::vector<int64_t> shape,
                             v1::DType dtype, bool as_values = false) {
  v1::Tensor t;
  EncodeTensor(data, shape, dtype, as_values, &t);
  return t;
}

// The f32 contents of a reply tensor (raw bytes of its own dtype, or values).
inline std::vector<float> TensorValues(const v1::Tensor& t) {
  int64_t count = 1;
  for (int64_t d : t.shape()) count *= d;
  std::vector<float> out(count);
  const std::vector<int64_t> shape(t.shape().begin(), t.shape().end());
  const absl::Status s = DecodeTensor(t, {"reply", shape, false, t.dtype()}, out.data());
  EXPECT_TRUE(s.ok()) << s;
  return out;
}

// `data` as the server sees it after the trip through `dtype` (the reference must use this).
inline std::vector<float> RoundTrip(std::span<const float> data, v1::DType dtype) {
  const std::vector<int64_t> shape = {static_cast<int64_t>(data.size())};
  return TensorValues(MakeTensor(data, shape, dtype));
}

inline absl::StatusOr<std::string> CreateSession(v1::KvRecall::Stub& stub,
                                                 const v1::Geometry& geometry,
                                                 const v1::Policy& policy,
                                                 v1::CreateSessionResponse* response = nullptr) {
  v1::CreateSessionRequest request;
  *request.mutable_geometry() = geometry;
  *request.mutable_policy() = policy;
  v1::CreateSessionResponse local;
  v1::CreateSessionResponse* out = response != nullptr ? response : &local;
  grpc::ClientContext context;
  if (absl::Status s = FromGrpc(stub.CreateSession(&context, request, out)); !s.ok()) return s;
  return out->session_id();
}

inline absl::StatusOr<v1::SessionInfo> GetSession(v1::KvRecall::Stub& stub, const std::string& id) {
  v1::GetSessionRequest request;
  request.set_session_id(id);
  v1::SessionInfo info;
  grpc::ClientContext context;
  if (absl::Status s = FromGrpc(stub.GetSession(&context, request, &info)); !s.ok()) return s;
  return info;
}

inline absl::Status CloseSession(v1::KvRecall::Stub& stub, const std::string& id) {
  v1::CloseSessionRequest request;
  request.set_session_id(id);
  v1::CloseSessionResponse response;
  grpc::ClientContext context;
  return FromGrpc(stub.CloseSession(&context, request, &response));
}

// Streams `chunks` as one Prefill call and returns the server's answer.
inline absl::StatusOr<v1::PrefillResponse> Prefill(v1::KvRecall::Stub& stub,
                                                   std::span<const v1::PrefillChunk> chunks) {
  grpc::ClientContext context;
  v1::PrefillResponse response;
  std::unique_ptr<grpc::ClientWriter<v1::PrefillChunk>> writer = stub.Prefill(&context, &response);
  for (const v1::PrefillChunk& chunk : chunks) {
    if (!writer->Write(chunk)) break;  // the server already answered; Finish says why
  }
  writer->WritesDone();
  if (absl::Status s = FromGrpc(writer->Finish()); !s.ok()) return s;
  return response;
}

// One layer's prompt: q [tokens, q_heads, head_dim], k/v [tokens, kv_heads, head_dim], f32.
struct PromptLayer {
  std::vector<float> q, k, v;
};

// A layer's prompt of `tokens` tokens of `g`, every element N(0, 1) (q, k and v drawn from
// seeds `seed`, `seed` + 1 and `seed` + 2).
inline PromptLayer RandomPromptOf(const v1::Geometry& g, int64_t tokens, uint64_t seed) {
  const int64_t q_row = int64_t{g.q_heads()} * g.head_dim();
  const int64_t kv_row = int64_t{g.kv_heads()} * g.head_dim();
  return PromptLayer{RandomNormal(tokens * q_row, seed), RandomNormal(tokens * kv_row, seed + 1),
                     RandomNormal(tokens * kv_row, seed + 2)};
}

// Cuts a layer's prompt into chunks of at most `chunk_tokens` tokens, encoded in `dtype`.
inline std::vector<v1::PrefillChunk> PromptChunks(const std::string& session_id,
                                                  const v1::Geometry& g, int layer,
                                                  const PromptLayer& prompt, int64_t chunk_tokens,
                                                  bool as_values = false) {
  const int64_t q_row = int64_t{g.q_heads()} * g.head_dim();
  const int64_t kv_row = int64_t{g.kv_heads()} * g.head_dim();
  const int64_t tokens = static_cast<int64_t>(prompt.k.size()) / kv_row;
  std::vector<v1::PrefillChunk> chunks;
  for (int64_t begin = 0; begin < tokens; begin += chunk_tokens) {
    const int64_t n = std::min(chunk_tokens, tokens - begin);
    v1::PrefillChunk c;
    c.set_session_id(session_id);
    c.set_layer(layer);
    c.set_offset(begin);
    auto slice = [&](const std::vector<float>& x, int64_t row) {
      return std::span<const float>(x).subspan(begin * row, n * row);
    };
    *c.mutable_q() =
        MakeTensor(slice(prompt.q, q_row), {n, g.q_heads(), g.head_dim()}, g.dtype(), as_values);
    *c.mutable_k() =
        MakeTensor(slice(prompt.k, kv_row), {n, g.kv_heads(), g.head_dim()}, g.dtype(), as_values);
    *c.mutable_v() =
        MakeTensor(slice(prompt.v, kv_row), {n, g.kv_heads(), g.head_dim()}, g.dtype(), as_values);
    chunks.push_back(std::move(c));
  }
  return chunks;
}

// A SequenceStep of session `id`: q [q_heads, head_dim], k_new/v_new [kv_heads, head_dim].
inline v1::SequenceStep MakeStep(const std::string& id, const v1::Geometry& g,
                                 std::span<const float> q, std::span<const float> k_new,
                                 std::span<const float> v_new, bool as_values = false) {
  v1::SequenceStep step;
  step.set_session_id(id);
  *step.mutable_q() = MakeTensor(q, {g.q_heads(), g.head_dim()}, g.dtype(), as_values);
  *step.mutable_k_new() = MakeTensor(k_new, {g.kv_heads(), g.head_dim()}, g.dtype(), as_values);
  *step.mutable_v_new() = MakeTensor(v_new, {g.kv_heads(), g.head_dim()}, g.dtype(), as_values);
  return step;
}

// The KV a session should hold, exactly as the server decodes what it is sent (after the trip
// through the wire dtype), and the answers it owes in double precision. Prompt tensors are
// random: q ~ N(0, 1.5^2), k, v ~ N(0, 1).
class ReferenceSession {
 public:
  ReferenceSession(const v1::Geometry& g, int64_t prompt_tokens, uint64_t seed) : g_(g) {
    for (int l = 0; l < g.layers(); ++l) {
      PromptLayer p;
      const uint64_t s = seed + 100 * l;
      p.q = RandomNormal(prompt_tokens * g.q_heads() * g.head_dim(), s, 1.5f);
      p.k = RandomNormal(prompt_tokens * g.kv_heads() * g.head_dim(), s + 1);
      p.v = RandomNormal(prompt_tokens * g.kv_heads() * g.head_dim(), s + 2);
      keys_.push_back(RoundTrip(p.k, g.dtype()));
      values_.push_back(RoundTrip(p.v, g.dtype()));
      prompts_.push_back(std::move(p));
    }
  }

  const v1::Geometry& geometry() const { return g_; }
  const PromptLayer& prompt(int layer) const { return prompts_[layer]; }
  // Replaces prompt token t's key in `layer` and `kv_head` (head_dim values), before the prompt
  // is sent.
  void SetPromptKey(int layer, int64_t t, int kv_head, std::span<const float> key) {
    const size_t at = (static_cast<size_t>(t) * g_.kv_heads() + kv_head) * g_.head_dim();
    std::copy(key.begin(), key.end(), prompts_[layer].k.begin() + at);
    const std::vector<float> kept = RoundTrip(std::vector<float>(key.begin(), key.end()),
                                              g_.dtype());
    std::copy(kept.begin(), kept.end(), keys_[layer].begin() + at);
  }
  int64_t tokens(int layer) const {
    return static_cast<int64_t>(keys_[layer].size()) / (g_.kv_heads() * g_.head_dim());
  }
  KvView view(int layer) const {
    return KvView{keys_[layer].data(), values_[layer].data(), tokens(layer), g_.kv_heads(),
                  g_.head_dim()};
  }
  // The geometry's softmax scale, 1 / sqrt(head_dim) when unset (as the server resolves it).
  double scale() const {
    return g_.softmax_scale() > 0 ? static_cast<double>(g_.softmax_scale())
                                  : 1.0 / std::sqrt(static_cast<double>(g_.head_dim()));
  }

  // The f32 inputs of one decode token, before encoding.
  struct Token {
    std::vector<float> q, k, v;
  };
  Token MakeToken(uint64_t seed) const {
    return {RandomNormal(g_.q_heads() * g_.head_dim(), seed, 1.5f),
            RandomNormal(g_.kv_heads() * g_.head_dim(), seed + 1),
            RandomNormal(g_.kv_heads() * g_.head_dim(), seed + 2)};
  }
  v1::SequenceStep Step(const std::string& id, const Token& token, bool as_values = false) const {
    return MakeStep(id, g_, token.q, token.k, token.v, as_values);
  }
  // Appends the token's k/v to `layer` as the server decodes them; returns q as it decodes it.
  std::vector<float> Record(int layer, const Token& token, bool as_values = false) {
    const v1::DType wire = as_values ? v1::DTYPE_F32 : g_.dtype();
    const std::vector<float> k = RoundTrip(token.k, wire);
    const std::vector<float> v = RoundTrip(token.v, wire);
    keys_[layer].insert(keys_[layer].end(), k.begin(), k.end());
    values_[layer].insert(values_[layer].end(), v.begin(), v.end());
    return RoundTrip(token.q, wire);
  }
  // A random next token of `layer`, recorded; *q_seen gets q as the server decodes it.
  v1::SequenceStep NextStep(const std::string& id, int layer, uint64_t seed,
                            std::vector<float>* q_seen, bool as_values = false) {
    const Token token = MakeToken(seed);
    *q_seen = Record(layer, token, as_values);
    return Step(id, token, as_values);
  }

  // Attention of every query head over its support, double precision: [q_heads, head_dim].
  std::vector<double> Attention(int layer, const std::vector<float>& q,
                                const std::vector<std::vector<int32_t>>& supports,
                                std::vector<double>* lse = nullptr) const {
    const int d = g_.head_dim();
    std::vector<double> out;
    for (int h = 0; h < g_.q_heads(); ++h) {
      std::vector<double> o;
      const double l =
          ReferenceAttention(q.data() + h * d, view(layer),
                             KvHeadOf(h, g_.q_heads(), g_.kv_heads()), supports[h], scale(), &o);
      out.insert(out.end(), o.begin(), o.end());
      if (lse != nullptr) lse->push_back(l);
    }
    return out;
  }
  // Attention of every query head over every token of `layer`.
  std::vector<double> FullAttention(int layer, const std::vector<float>& q,
                                    std::vector<double>* lse = nullptr) const {
    return Attention(
        layer, q, std::vector<std::vector<int32_t>>(g_.q_heads(), AllTokens(tokens(layer))), lse);
  }

  // Every layer's prompt in chunks of `chunk_tokens`, layers interleaved chunk by chunk.
  std::vector<v1::PrefillChunk> InterleavedPrompt(const std::string& id,
                                                  int64_t chunk_tokens) const {
    std::vector<std::vector<v1::PrefillChunk>> per_layer;
    for (int l = 0; l < g_.layers(); ++l) {
      per_layer.push_back(PromptChunks(id, g_, l, prompts_[l], chunk_tokens));
    }
    std::vector<v1::PrefillChunk> interleaved;
    for (size_t c = 0; c < per_layer[0].size(); ++c) {
      for (auto& chunks : per_layer) interleaved.push_back(chunks[c]);
    }
    return interleaved;
  }

 private:
  v1::Geometry g_;
  std::vector<PromptLayer> prompts_;
  std::vector<std::vector<float>> keys_;
  std::vector<std::vector<float>> values_;
};

// The supports of a tiered exact top-K over `layer` of `ref` for the step's queries q
// ([q_heads, head_dim]): per query head the exact top `k` of the bulk [sinks, n - recent) and
// the static set (the first `sinks` and last `recent` tokens), as token positions.
inline std::vector<std::vector<int32_t>> TieredExactTopKSupports(const ReferenceSession& ref,
                                                                 const std::vector<float>& q,
                                                                 int k, int sinks, int recent,
                                                                 int layer = 0) {
  const v1::Geometry& g = ref.geometry();
  const int64_t n = ref.tokens(layer);
  const KvView bulk = ref.view(layer).Tokens(sinks, n - sinks - recent);
  std::vector<std::vector<int32_t>> supports(g.q_heads());
  for (int h = 0; h < g.q_heads(); ++h) {
    supports[h] = ReferenceTopK(q.data() + h * g.head_dim(), bulk,
                                KvHeadOf(h, g.q_heads(), g.kv_heads()), ref.scale(), k);
    for (int32_t& t : supports[h]) t += sinks;
    for (int64_t t = 0; t < n; ++t) {
      if (t < sinks || t >= n - recent) supports[h].push_back(static_cast<int32_t>(t));
    }
  }
  return supports;
}

// Decode queries that drift slowly from the prompt's last one (ReTopK reuses) and jump once.
inline std::vector<ReferenceSession::Token> DriftingQueryTokens(const ReferenceSession& ref,
                                                               int steps, uint64_t seed) {
  const v1::Geometry& g = ref.geometry();
  const int64_t q_row = int64_t{g.q_heads()} * g.head_dim();
  std::vector<float> q(ref.prompt(0).q.end() - q_row, ref.prompt(0).q.end());
  std::vector<ReferenceSession::Token> tokens;
  for (int s = 0; s < steps; ++s) {
    ReferenceSession::Token t = ref.MakeToken(seed + 10 * s);
    const std::vector<float> noise = RandomNormal(q_row, seed + 5 * s + 1, 0.3f);
    for (int64_t i = 0; i < q_row; ++i) q[i] = 0.97f * q[i] + noise[i];
    t.q = s == steps / 2 ? RandomNormal(q_row, seed + 999, 1.5f) : q;
    tokens.push_back(std::move(t));
  }
  return tokens;
}

// A server test whose sessions start from a ReferenceSession's prompt.
class PrefilledSessionTest : public ServerTest {
 protected:
  // Creates a session for `ref` and streams its prompt, layers interleaved chunk by chunk (on
  // the test's server, or on `server`'s).
  std::string CreateAndPrefill(const ReferenceSession& ref, const v1::Policy& policy,
                               int64_t chunk_tokens, InProcessServer* server = nullptr) {
    v1::KvRecall::Stub& on = server != nullptr ? server->stub() : stub();
    absl::StatusOr<std::string> id = CreateSession(on, ref.geometry(), policy);
    EXPECT_TRUE(id.ok()) << id.status();
    if (!id.ok()) return "";
    const std::vector<v1::PrefillChunk> interleaved = ref.InterleavedPrompt(*id, chunk_tokens);
    absl::StatusOr<v1::PrefillResponse> prefilled = Prefill(on, interleaved);
    EXPECT_TRUE(prefilled.ok()) << prefilled.status();
    if (prefilled.ok()) {
      EXPECT_EQ(prefilled->session_id(), *id);
      EXPECT_EQ(prefilled->layers_committed(), ref.geometry().layers());
      EXPECT_EQ(prefilled->tokens(), ref.tokens(0));
      EXPECT_GE(prefilled->build_seconds(), 0.0);
    }
    return *id;
  }
};

// Absolute tolerance of an output element of magnitude |x| returned in `dtype`: its rounding
// on the way out plus f32 arithmetic.
inline double OutputTolerance(v1::DType dtype, double x) {
  switch (dtype) {
    case v1::DTYPE_BF16:
      return std::abs(x) * 0x1p-8 + 1e-5;
    case v1::DTYPE_F16:
      return std::abs(x) * 0x1p-10 + 1e-5;
    default:
      return std::abs(x) * 1e-5 + 1e-5;
  }
}

// Asserts got[i] == want[i] within OutputTolerance for every element.
inline void ExpectOutputNear(const std::vector<float>& got, const std::vector<double>& want,
                             v1::DType dtype, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], want[i], OutputTolerance(dtype, want[i])) << what << " element " << i;
  }
}

// A client's side of one Decode stream: a request in, its reply out. Once the server ended
// the stream with an error, every later call returns that error.
class DecodeClient {
 public:
  explicit DecodeClient(v1::KvRecall::Stub& stub) : stream_(stub.Decode(&context_)) {}
  ~DecodeClient() {
    if (!finished_) Finish().IgnoreError();
  }

  absl::StatusOr<v1::DecodeResponse> Step(const v1::DecodeRequest& request) {
    if (finished_) return status_;
    v1::DecodeResponse response;
    if (stream_->Write(request) && stream_->Read(&response)) return response;
    if (absl::Status s = Finish(); !s.ok()) return s;
    return absl::UnknownError("the server ended the Decode stream without an error or a reply");
  }

  // Half-closes the stream and returns the server's final status.
  absl::Status Finish() {
    if (!finished_) {
      stream_->WritesDone();
      status_ = FromGrpc(stream_->Finish());
      finished_ = true;
    }
    return status_;
  }

 private:
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::DecodeRequest, v1::DecodeResponse>> stream_;
  bool finished_ = false;
  absl::Status status_;
};

}  // namespace kvrecall::testing

#endif  // KVRECALL_TESTS_SERVER_FIXTURE_H_
