// rpc_overhead: what one layer-step costs over gRPC, against the transport's floor. On one open
// stream it alternates an empty request with a layer-step-sized one and reports both round trips
// at p50 / p99; then, in two phases of one kind each, the CPU time per round trip of the client
// process, of its calling thread and (given --server_pid) of the server process.
//
// --protocol=kvrecall: a Decode stream to kvrecalld. The layer-step is 32 query heads (8 KV
// heads, d=128, bf16; q + k_new + v_new = 12 KiB in, 8 KiB out) over a constant 64-token static
// set (streaming selector), so the work per step does not grow; the server reports its own
// compute for the step (server_micros), and the client library's tensor codec is timed alone.
// --protocol=echo: bench/echo_floor's stream with the same message sizes and the same client
// threading (one synchronous stream, write then read), which does nothing with the bytes;
// --protocol=echo-unary: the same exchange as one unary call per round trip.
//
//   rpc_overhead                                    # kvrecalld's server in this process
//   rpc_overhead --server=127.0.0.1:PORT --server_pid=PID
//   rpc_overhead --protocol=echo --server=unix:/tmp/echo.sock --server_pid=PID
//   rpc_overhead --shared_memory [--server=... of a kvrecalld with --shared_memory_dir]
// --shared_memory: kvrecall's steps through a DecodeShared region instead of the Decode stream
// (the call that opens it goes to --server; the in-process server gets a directory in /dev/shm).
#include <omp.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <cstdio>
#include <fstream>
#include <cmath>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "bench/echo_floor.grpc.pb.h"
#include "client/kvrecall_client.h"
#include "client/stats.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "kernels/cpu/attention.h"
#include "kernels/kv_view.h"
#include "nlohmann/json.hpp"
#include "proto/tensor_codec.h"
#include "server/server.h"

ABSL_FLAG(std::string, protocol, "kvrecall",
          "kvrecall (a Decode stream), echo (echo_floor's stream) or echo-unary (one EchoOnce "
          "call per round trip)");
ABSL_FLAG(std::string, server, "",
          "server to measure, HOST:PORT or unix:PATH; empty: start kvrecalld's server in this "
          "process on 127.0.0.1 (kvrecall only)");
ABSL_FLAG(int64_t, server_pid, 0,
          "the server's process id, for its CPU time per round trip; 0: not measured");
ABSL_FLAG(std::string, label, "", "names the run in the JSON (say, the server's API)");
ABSL_FLAG(bool, shared_memory, false,
          "--protocol=kvrecall through shared memory (DecodeShared) instead of the Decode stream");
ABSL_FLAG(int32_t, q_heads, 32, "query heads of the layer-step");
ABSL_FLAG(int32_t, kv_heads, 8, "KV heads");
ABSL_FLAG(int32_t, head_dim, 128, "head dimension");
ABSL_FLAG(std::string, dtype, "bf16", "session dtype: bf16, f16 or f32");
ABSL_FLAG(std::string, selector, "streaming",
          "full or streaming; streaming keeps the attended context constant while tokens append");
ABSL_FLAG(int32_t, context, 64,
          "prompt tokens; streaming attends to all of them (sinks 16, recent context - 16)");
ABSL_FLAG(int32_t, iterations, 5000,
          "measured pairs (empty request, layer-step), and round trips of each CPU phase");
ABSL_FLAG(int32_t, warmup, 500, "pairs run before measuring");
ABSL_FLAG(std::string, json_out, "", "also write the figures as JSON to this file");
ABSL_FLAG(std::string, count_only, "",
          "empty or layer_step: run warmup + iterations round trips of that kind alone, none of "
          "the other kind between them, and report their p50 / p99 only (no CPU phases, no "
          "JSON): for counting the server's instructions per round trip under callgrind "
          "(bench/callgrind_hop.sh), and for the round trip without the pairs' alternation");
ABSL_FLAG(int32_t, echo_work_us, 0,
          "echo: microseconds the server busy-waits before answering each layer-step-sized "
          "request, standing in for a step's compute (reported as its server time)");

namespace kvrecall::client {
namespace {

using Clock = std::chrono::steady_clock;

double CpuMicros(clockid_t clock) {
  timespec ts;
  clock_gettime(clock, &ts);
  return ts.tv_sec * 1e6 + ts.tv_nsec * 1e-3;
}

// CPU time (user + system) of process `pid` from /proc/PID/stat, all its threads, the ended
// ones included; the clock ticks bound its resolution (10 ms), so read it around whole phases.
absl::StatusOr<double> ProcessCpuMicros(int64_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/stat"));
  std::string line;
  if (!std::getline(in, line)) {
    return absl::NotFoundError(absl::StrCat("cannot read /proc/", pid, "/stat"));
  }
  // Fields after the command name, which is in parentheses and may hold spaces.
  std::istringstream fields(line.substr(line.rfind(')') + 2));
  std::string field;
  double utime = 0, stime = 0;
  for (int i = 3; i <= 15 && fields >> field; ++i) {
    if (i == 14) utime = std::stod(field);
    if (i == 15) stime = std::stod(field);
  }
  return (utime + stime) * 1e6 / static_cast<double>(sysconf(_SC_CLK_TCK));
}

int Fail(const absl::Status& status) {
  std::fprintf(stderr, "rpc_overhead: %s\n", status.ToString().c_str());
  return 1;
}

nlohmann::ordered_json Quantiles(const std::vector<double>& us) {
  return {{"p50", Percentile(us, 0.5)}, {"p99", Percentile(us, 0.99)}};
}

// One open stream to the server under test.
class StreamUnderTest {
 public:
  virtual ~StreamUnderTest() = default;
  // One round trip: a layer-step-sized request when `layer_step`, otherwise an empty one.
  virtual absl::Status RoundTrip(bool layer_step) = 0;
  // The server's own time for the last reply (kvrecall's server_micros); -1 when it has none.
  virtual double ServerMicros() const { return -1; }
  virtual absl::Status Close() = 0;
};

struct Geometry {
  v1::Geometry proto;
  int64_t q_size = 0;   // floats of q and of the output
  int64_t kv_size = 0;  // floats of k_new and of v_new
  int64_t request_bytes() const {
    return (q_size + 2 * kv_size) * static_cast<int64_t>(DTypeSize(proto.dtype()));
  }
  int64_t reply_bytes() const { return q_size * static_cast<int64_t>(DTypeSize(proto.dtype())); }
};

std::vector<float> RandomFloats(int64_t n, std::mt19937& rng) {
  std::normal_distribution<float> normal;
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

// A Decode stream to kvrecalld over a prefilled session, through the C++ client library.
class KvRecallStream final : public StreamUnderTest {
 public:
  static absl::StatusOr<std::unique_ptr<KvRecallStream>> Open(const std::string& address,
                                                              const Geometry& g,
                                                              v1::Selector selector, int context) {
    std::unique_ptr<KvRecallStream> s(new KvRecallStream(address, g));
    absl::StatusOr<SessionHandle> session = s->client_->CreateSession(
        g.proto, CpuPolicy(selector, 0, std::min(16, context), std::max(1, context - 16)),
        "rpc_overhead");
    if (!session.ok()) return session.status();
    s->session_ = *std::move(session);
    std::mt19937 rng(1);
    absl::StatusOr<std::unique_ptr<PrefillStream>> prefill = s->client_->StartPrefill(s->session_);
    if (!prefill.ok()) return prefill.status();
    const std::vector<float> q = RandomFloats(context * g.q_size, rng),
                             k = RandomFloats(context * g.kv_size, rng),
                             v = RandomFloats(context * g.kv_size, rng);
    if (absl::Status st = (*prefill)->SendLayer(0, q, k, v); !st.ok()) return st;
    if (absl::StatusOr<v1::PrefillResponse> r = (*prefill)->Finish(); !r.ok()) return r.status();
    absl::StatusOr<std::unique_ptr<DecodeStream>> stream = s->client_->OpenDecodeStream(
        g.proto, {.shared_memory = absl::GetFlag(FLAGS_shared_memory)});
    if (!stream.ok()) return stream.status();
    s->stream_ = *std::move(stream);
    s->q_ = RandomFloats(g.q_size, rng);
    s->k_ = RandomFloats(g.kv_size, rng);
    s->v_ = RandomFloats(g.kv_size, rng);
    return s;
  }

  absl::Status RoundTrip(bool layer_step) override {
    const SequenceInput input{session_.id, q_, k_, v_};
    return stream_->Step(0, layer_step ? std::span(&input, 1) : std::span<SequenceInput>(),
                         options_, &result_);
  }
  double ServerMicros() const override { return result_.response->server_micros(); }
  absl::Status Close() override {
    absl::Status s = stream_->Close();
    client_->CloseSession(session_.id).IgnoreError();
    return s;
  }

 private:
  KvRecallStream(const std::string& address, const Geometry&)
      : client_(Client::Connect(address)) {}

  std::unique_ptr<Client> client_;
  SessionHandle session_;
  std::unique_ptr<DecodeStream> stream_;
  std::vector<float> q_, k_, v_;
  const StepOptions options_;
  StepResult result_;
};

// bench/echo_floor's stream: the same sizes and client threading as DecodeStream::Step (write
// the request, then read its reply, messages reused), nothing else.
class EchoStream final : public StreamUnderTest {
 public:
  EchoStream(const std::string& address, const Geometry& g, uint32_t work_micros)
      : stub_(bench::EchoFloor::NewStub(
            grpc::CreateChannel(address, grpc::InsecureChannelCredentials()))),
        stream_(stub_->Echo(&context_)),
        payload_(g.request_bytes(), '\x33'),
        reply_bytes_(static_cast<uint32_t>(g.reply_bytes())),
        work_micros_(work_micros) {}

  absl::Status RoundTrip(bool layer_step) override {
    // Assigning keeps the string's capacity, as the client library's tensor encode does.
    request_.mutable_payload()->assign(layer_step ? payload_ : std::string());
    request_.set_reply_bytes(layer_step ? reply_bytes_ : 0);
    request_.set_work_micros(layer_step ? work_micros_ : 0);
    if (!stream_->Write(request_) || !stream_->Read(&reply_)) {
      const absl::Status s = FromGrpcStatus(stream_->Finish());
      return s.ok() ? absl::UnavailableError("the echo stream ended without a reply") : s;
    }
    if (reply_.payload().size() != request_.reply_bytes()) {
      return absl::InternalError(absl::StrCat("echo reply of ", reply_.payload().size(),
                                              " bytes, asked for ", request_.reply_bytes()));
    }
    return absl::OkStatus();
  }
  // The work it asked for (0: none, -1 as for no server time at all).
  double ServerMicros() const override {
    return work_micros_ > 0 ? static_cast<double>(work_micros_) : -1;
  }
  absl::Status Close() override {
    stream_->WritesDone();
    return FromGrpcStatus(stream_->Finish());
  }

 private:
  std::unique_ptr<bench::EchoFloor::Stub> stub_;
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReaderWriter<bench::EchoRequest, bench::EchoReply>> stream_;
  const std::string payload_;
  const uint32_t reply_bytes_;
  const uint32_t work_micros_;
  bench::EchoRequest request_;
  bench::EchoReply reply_;
};

// The same exchange as one unary EchoOnce call per round trip (a fresh ClientContext each).
class EchoUnary final : public StreamUnderTest {
 public:
  EchoUnary(const std::string& address, const Geometry& g)
      : stub_(bench::EchoFloor::NewStub(
            grpc::CreateChannel(address, grpc::InsecureChannelCredentials()))),
        payload_(g.request_bytes(), '\x33'),
        reply_bytes_(static_cast<uint32_t>(g.reply_bytes())) {}

  absl::Status RoundTrip(bool layer_step) override {
    request_.mutable_payload()->assign(layer_step ? payload_ : std::string());
    request_.set_reply_bytes(layer_step ? reply_bytes_ : 0);
    grpc::ClientContext context;
    if (absl::Status s = FromGrpcStatus(stub_->EchoOnce(&context, request_, &reply_)); !s.ok()) {
      return s;
    }
    if (reply_.payload().size() != request_.reply_bytes()) {
      return absl::InternalError(absl::StrCat("echo reply of ", reply_.payload().size(),
                                              " bytes, asked for ", request_.reply_bytes()));
    }
    return absl::OkStatus();
  }
  absl::Status Close() override { return absl::OkStatus(); }

 private:
  std::unique_ptr<bench::EchoFloor::Stub> stub_;
  const std::string payload_;
  const uint32_t reply_bytes_;
  bench::EchoRequest request_;
  bench::EchoReply reply_;
};

// CPU time per round trip over `n` round trips of one kind: the client process (all of its
// threads, gRPC's included), its calling thread and, when pid > 0, the server process.
absl::StatusOr<nlohmann::ordered_json> CpuPhase(StreamUnderTest& stream, bool layer_step, int n,
                                                int64_t server_pid) {
  absl::StatusOr<double> server0 = server_pid > 0 ? ProcessCpuMicros(server_pid) : 0.0;
  if (!server0.ok()) return server0.status();
  const double process0 = CpuMicros(CLOCK_PROCESS_CPUTIME_ID);
  const double thread0 = CpuMicros(CLOCK_THREAD_CPUTIME_ID);
  const Clock::time_point t0 = Clock::now();
  for (int i = 0; i < n; ++i) {
    if (absl::Status s = stream.RoundTrip(layer_step); !s.ok()) return s;
  }
  const double wall = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
  nlohmann::ordered_json j;
  j["mean_round_trip_us"] = wall / n;
  j["client_process_cpu_us"] = (CpuMicros(CLOCK_PROCESS_CPUTIME_ID) - process0) / n;
  j["client_thread_cpu_us"] = (CpuMicros(CLOCK_THREAD_CPUTIME_ID) - thread0) / n;
  if (server_pid > 0) {
    absl::StatusOr<double> server1 = ProcessCpuMicros(server_pid);
    if (!server1.ok()) return server1.status();
    j["server_process_cpu_us"] = (*server1 - *server0) / n;
  } else {
    j["server_process_cpu_us"] = nullptr;
  }
  return j;
}

// The client library's own per-step work on the tensors, without the RPC: encoding q, k_new,
// v_new into the session dtype and decoding the output, as DecodeStream::Step does.
absl::StatusOr<std::vector<double>> ClientCodecMicros(const Geometry& g, int warmup,
                                                      int iterations) {
  std::mt19937 rng(2);
  const std::vector<float> q = RandomFloats(g.q_size, rng), k = RandomFloats(g.kv_size, rng),
                           v = RandomFloats(g.kv_size, rng);
  v1::SequenceStep step;
  v1::Tensor output;
  const int64_t q_shape[] = {g.proto.q_heads(), g.proto.head_dim()};
  const int64_t kv_shape[] = {g.proto.kv_heads(), g.proto.head_dim()};
  EncodeTensor(q, q_shape, g.proto.dtype(), false, &output);
  std::vector<float> decoded(g.q_size);
  std::vector<double> us;
  us.reserve(iterations);
  for (int i = 0; i < warmup + iterations; ++i) {
    const Clock::time_point t0 = Clock::now();
    EncodeTensor(q, q_shape, g.proto.dtype(), false, step.mutable_q());
    EncodeTensor(k, kv_shape, g.proto.dtype(), false, step.mutable_k_new());
    EncodeTensor(v, kv_shape, g.proto.dtype(), false, step.mutable_v_new());
    if (absl::Status s =
            DecodeTensor(output, {"output", q_shape, false, g.proto.dtype()}, decoded.data());
        !s.ok()) {
      return s;
    }
    if (i >= warmup) us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  return us;
}

// The attention of the layer-step alone, in this process on the same shapes: 32 heads, each
// over the `context` tokens the streaming selector attends to, by cpu::MultiHeadAttention on
// `threads` threads (0: as many as the server's team would be). The reference for the
// server's compute per step (issue 12: within 2x of the attention on one core).
std::vector<double> AttentionMicros(const Geometry& g, int context, int threads, int warmup,
                                    int iterations) {
  std::mt19937 rng(3);
  const std::vector<float> keys = RandomFloats(context * g.kv_size, rng);
  const std::vector<float> values = RandomFloats(context * g.kv_size, rng);
  const std::vector<float> q = RandomFloats(g.q_size, rng);
  const KvView kv{keys.data(), values.data(), context, g.proto.kv_heads(), g.proto.head_dim()};
  std::vector<std::vector<int32_t>> supports(g.proto.q_heads(), std::vector<int32_t>(context));
  for (std::vector<int32_t>& s : supports) std::iota(s.begin(), s.end(), 0);
  std::vector<float> o(g.q_size), lse(g.proto.q_heads());
  const int saved = omp_get_max_threads();
  if (threads > 0) omp_set_num_threads(threads);  // this thread's teams only
  std::vector<double> us;
  us.reserve(iterations);
  const float scale = 1.0f / std::sqrt(static_cast<float>(g.proto.head_dim()));
  for (int i = 0; i < warmup + iterations; ++i) {
    const Clock::time_point t0 = Clock::now();
    cpu::MultiHeadAttention(q.data(), g.proto.q_heads(), kv, supports, scale, o.data(), lse.data());
    if (i >= warmup) {
      us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    }
  }
  omp_set_num_threads(saved);
  return us;
}

int Main() {
  const std::string protocol = absl::GetFlag(FLAGS_protocol);
  if (protocol != "kvrecall" && protocol != "echo" && protocol != "echo-unary") {
    return Fail(absl::InvalidArgumentError(absl::StrCat(
        "--protocol must be kvrecall, echo or echo-unary, got '", protocol, "'")));
  }
  std::string address = absl::GetFlag(FLAGS_server);
  if (!address.empty()) {
    if (absl::Status s = kvrecall::client::CheckServerAddress(address); !s.ok()) return Fail(s);
  }
  std::unique_ptr<RunningServer> in_process;
  std::string shm_dir;  // the in-process server's, removed at the end
  absl::Cleanup remove_shm_dir = [&] {
    in_process.reset();
    if (!shm_dir.empty()) std::filesystem::remove_all(shm_dir);
  };
  if (address.empty()) {
    if (protocol != "kvrecall") {
      return Fail(absl::InvalidArgumentError("--protocol=echo and echo-unary need --server (echo_floor's)"));
    }
    ServerOptions options;
    options.address = "127.0.0.1:0";
    if (absl::GetFlag(FLAGS_shared_memory)) {
      char dir[] = "/dev/shm/rpc_overhead-XXXXXX";
      if (mkdtemp(dir) == nullptr) return Fail(absl::InternalError("mkdtemp in /dev/shm failed"));
      options.shared_memory_dir = shm_dir = dir;
    }
    absl::StatusOr<std::unique_ptr<RunningServer>> server = StartServer(options);
    if (!server.ok()) return Fail(server.status());
    in_process = *std::move(server);
    address = in_process->address();
  }

  absl::StatusOr<v1::DType> dtype = ParseDType(absl::GetFlag(FLAGS_dtype));
  absl::StatusOr<v1::Selector> selector = ParseSelector(absl::GetFlag(FLAGS_selector));
  if (!dtype.ok()) return Fail(dtype.status());
  if (!selector.ok()) return Fail(selector.status());
  const int context = absl::GetFlag(FLAGS_context);
  Geometry g;
  g.proto.set_layers(1);
  g.proto.set_q_heads(absl::GetFlag(FLAGS_q_heads));
  g.proto.set_kv_heads(absl::GetFlag(FLAGS_kv_heads));
  g.proto.set_head_dim(absl::GetFlag(FLAGS_head_dim));
  g.proto.set_dtype(*dtype);
  g.q_size = int64_t{g.proto.q_heads()} * g.proto.head_dim();
  g.kv_size = int64_t{g.proto.kv_heads()} * g.proto.head_dim();

  std::unique_ptr<StreamUnderTest> stream;
  if (protocol == "kvrecall") {
    absl::StatusOr<std::unique_ptr<KvRecallStream>> s =
        KvRecallStream::Open(address, g, *selector, context);
    if (!s.ok()) return Fail(s.status());
    stream = *std::move(s);
  } else if (protocol == "echo") {
    stream = std::make_unique<EchoStream>(
        address, g, static_cast<uint32_t>(std::max(0, absl::GetFlag(FLAGS_echo_work_us))));
  } else {
    stream = std::make_unique<EchoUnary>(address, g);
  }

  const int warmup = absl::GetFlag(FLAGS_warmup);
  const int iterations = absl::GetFlag(FLAGS_iterations);
  if (const std::string only = absl::GetFlag(FLAGS_count_only); !only.empty()) {
    if (only != "empty" && only != "layer_step") {
      return Fail(absl::InvalidArgumentError(
          absl::StrCat("--count_only must be empty or layer_step, got '", only, "'")));
    }
    std::vector<double> us;
    us.reserve(iterations);
    for (int i = 0; i < warmup + iterations; ++i) {
      const Clock::time_point t0 = Clock::now();
      if (absl::Status s = stream->RoundTrip(only == "layer_step"); !s.ok()) return Fail(s);
      if (i >= warmup) us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    }
    if (absl::Status s = stream->Close(); !s.ok()) return Fail(s);
    std::printf("%s %s: %d %s round trips alone, p50 %.1f us, p99 %.1f us\n", protocol.c_str(),
                absl::GetFlag(FLAGS_label).c_str(), warmup + iterations, only.c_str(),
                Percentile(us, 0.5), Percentile(us, 0.99));
    return 0;
  }
  std::vector<double> empty_us, step_us, server_us, transport_us;
  for (std::vector<double>* v : {&empty_us, &step_us, &server_us, &transport_us}) {
    v->reserve(iterations);
  }
  for (int i = 0; i < warmup + iterations; ++i) {
    // Alternating on one stream, so drift in machine load hits both series alike.
    const Clock::time_point t0 = Clock::now();
    if (absl::Status s = stream->RoundTrip(false); !s.ok()) return Fail(s);
    const Clock::time_point t1 = Clock::now();
    if (absl::Status s = stream->RoundTrip(true); !s.ok()) return Fail(s);
    const Clock::time_point t2 = Clock::now();
    if (i < warmup) continue;
    empty_us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    step_us.push_back(std::chrono::duration<double, std::micro>(t2 - t1).count());
    if (const double server = stream->ServerMicros(); server >= 0) {
      server_us.push_back(server);
      transport_us.push_back(step_us.back() - server);
    }
  }
  const int64_t server_pid = absl::GetFlag(FLAGS_server_pid);
  absl::StatusOr<nlohmann::ordered_json> empty_cpu =
      CpuPhase(*stream, false, iterations, server_pid);
  if (!empty_cpu.ok()) return Fail(empty_cpu.status());
  absl::StatusOr<nlohmann::ordered_json> step_cpu = CpuPhase(*stream, true, iterations, server_pid);
  if (!step_cpu.ok()) return Fail(step_cpu.status());
  if (absl::Status s = stream->Close(); !s.ok()) return Fail(s);

  nlohmann::ordered_json j;
  j["protocol"] = protocol;
  j["label"] = absl::GetFlag(FLAGS_label);
  j["client"] = "c++";
  j["server"] = in_process ? "in-process (127.0.0.1)" : address;
  j["transport"] = absl::GetFlag(FLAGS_shared_memory) ? "shm"
                   : IsUnixSocketAddress(address)   ? "unix"
                                                    : "tcp";
  j["q_heads"] = g.proto.q_heads();
  j["kv_heads"] = g.proto.kv_heads();
  j["head_dim"] = g.proto.head_dim();
  j["dtype"] = DTypeLowerName(g.proto.dtype());
  j["selector"] = protocol == "kvrecall" ? nlohmann::ordered_json(SelectorName(*selector)) : nullptr;
  j["context"] = context;
  j["iterations"] = iterations;
  j["request_bytes"] = g.request_bytes();
  j["reply_bytes"] = g.reply_bytes();
  if (protocol == "echo") j["echo_work_us"] = absl::GetFlag(FLAGS_echo_work_us);
  j["empty_us"] = Quantiles(empty_us);
  j["layer_step_us"] = Quantiles(step_us);
  if (!server_us.empty()) {
    j["layer_step_server_us"] = Quantiles(server_us);
    j["layer_step_minus_server_us"] = Quantiles(transport_us);
  }
  j["cpu_per_round_trip"] = {{"empty", *empty_cpu}, {"layer_step", *step_cpu}};
  std::vector<double> codec_us, attention_one_us, attention_team_us;
  if (protocol == "kvrecall") {
    absl::StatusOr<std::vector<double>> codec = ClientCodecMicros(g, warmup, iterations);
    if (!codec.ok()) return Fail(codec.status());
    codec_us = *std::move(codec);
    j["client_codec_us"] = Quantiles(codec_us);
    attention_one_us = AttentionMicros(g, context, 1, warmup, iterations);
    attention_team_us = AttentionMicros(g, context, 0, warmup, iterations);
    j["attention_alone_us"] = {{"one_thread", Quantiles(attention_one_us)},
                               {"team", Quantiles(attention_team_us)}};
  }

  std::printf("%s %s, C++ client, %d pairs on one stream to %s: %lld B in, %lld B out\n",
              protocol.c_str(), j["label"].get<std::string>().c_str(), iterations,
              j["server"].get<std::string>().c_str(),
              static_cast<long long>(g.request_bytes()), static_cast<long long>(g.reply_bytes()));
  std::printf("  %-34s %9s %9s\n", "round trip (us)", "p50", "p99");
  auto row = [](const char* name, const std::vector<double>& us) {
    if (!us.empty()) {
      std::printf("  %-34s %9.1f %9.1f\n", name, Percentile(us, 0.5), Percentile(us, 0.99));
    }
  };
  row("empty request", empty_us);
  row("layer-step", step_us);
  row("  of which server compute", server_us);
  row("layer-step minus server compute", transport_us);
  row("client tensor codec (no RPC)", codec_us);
  row("attention alone, one thread", attention_one_us);
  row("attention alone, the server's team", attention_team_us);
  auto cpu_row = [](const char* name, const nlohmann::ordered_json& c) {
    std::printf("  %-34s client %6.1f (thread %6.1f)  server %s\n", name,
                c["client_process_cpu_us"].get<double>(), c["client_thread_cpu_us"].get<double>(),
                c["server_process_cpu_us"].is_null()
                    ? "-"
                    : absl::StrCat(c["server_process_cpu_us"].get<double>()).c_str());
  };
  std::printf("  CPU us per round trip:\n");
  cpu_row("empty request", *empty_cpu);
  cpu_row("layer-step", *step_cpu);
  std::printf("%s\n", j.dump().c_str());
  if (const std::string out = absl::GetFlag(FLAGS_json_out); !out.empty()) {
    std::ofstream(out) << j.dump(2) << "\n";
  }
  return 0;
}

}  // namespace
}  // namespace kvrecall::client

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "rpc_overhead [--protocol=kvrecall|echo] [--server=HOST:PORT|unix:PATH] [--server_pid=PID]: "
      "round trips of an empty request and a layer-step on one stream, with CPU time");
  absl::ParseCommandLine(argc, argv);
  // As kvrecalld and echo_floor (server/main.cc): Debian's Abseil would check every absl::Mutex
  // acquisition (gRPC's included) for lock-order cycles; a runner's process may do the same.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  return kvrecall::client::Main();
}
