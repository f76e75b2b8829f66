// rpc_overhead: what one layer-step costs over gRPC beyond the attention itself. On one Decode
// stream it alternates an empty request (no sequences) with a 32-query-head layer-step (8 KV
// heads, d=128, bf16, a small static context) and reports both round trips, the server's
// compute for the layer-step and the differences, at p50 and p99.
//
//   rpc_overhead                       # starts kvrecalld's server in this process (loopback)
//   rpc_overhead --server=HOST:PORT    # measures a running kvrecalld
#include <time.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "client/kvrecall_client.h"
#include "client/stats.h"
#include "nlohmann/json.hpp"
#include "proto/tensor_codec.h"
#include "server/server.h"

ABSL_FLAG(std::string, server, "",
          "kvrecalld to measure, HOST:PORT; empty: start a server in this process on 127.0.0.1");
ABSL_FLAG(int32_t, q_heads, 32, "query heads of the layer-step");
ABSL_FLAG(int32_t, kv_heads, 8, "KV heads");
ABSL_FLAG(int32_t, head_dim, 128, "head dimension");
ABSL_FLAG(std::string, dtype, "bf16", "session dtype: bf16, f16 or f32");
ABSL_FLAG(std::string, selector, "streaming",
          "full or streaming; streaming keeps the attended context constant while tokens append");
ABSL_FLAG(int32_t, context, 64,
          "prompt tokens; streaming attends to all of them (sinks 16, recent context - 16)");
ABSL_FLAG(int32_t, iterations, 5000, "measured pairs (empty request, layer-step)");
ABSL_FLAG(int32_t, warmup, 500, "pairs run before measuring");
ABSL_FLAG(std::string, json_out, "", "also write the figures as JSON to this file");

namespace kvrecall::client {
namespace {

using Clock = std::chrono::steady_clock;

// CPU time of the calling thread: what the client itself spends, whatever the machine's load.
double ThreadCpuMicros() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec * 1e6 + ts.tv_nsec * 1e-3;
}

int Fail(const absl::Status& status) {
  std::fprintf(stderr, "rpc_overhead: %s\n", status.ToString().c_str());
  return 1;
}

nlohmann::ordered_json Quantiles(const std::vector<double>& us) {
  return {{"p50", Percentile(us, 0.5)}, {"p99", Percentile(us, 0.99)}};
}

int Main() {
  std::unique_ptr<RunningServer> in_process;
  std::string address = absl::GetFlag(FLAGS_server);
  if (address.empty()) {
    ServerOptions options;
    options.address = "127.0.0.1:0";
    absl::StatusOr<std::unique_ptr<RunningServer>> server = StartServer(options);
    if (!server.ok()) return Fail(server.status());
    in_process = *std::move(server);
    address = in_process->address();
  }
  std::unique_ptr<Client> client = Client::Connect(address);

  absl::StatusOr<v1::DType> dtype = ParseDType(absl::GetFlag(FLAGS_dtype));
  absl::StatusOr<v1::Selector> selector = ParseSelector(absl::GetFlag(FLAGS_selector));
  if (!dtype.ok()) return Fail(dtype.status());
  if (!selector.ok()) return Fail(selector.status());
  const int context = absl::GetFlag(FLAGS_context);
  v1::Geometry geometry;
  geometry.set_layers(1);
  geometry.set_q_heads(absl::GetFlag(FLAGS_q_heads));
  geometry.set_kv_heads(absl::GetFlag(FLAGS_kv_heads));
  geometry.set_head_dim(absl::GetFlag(FLAGS_head_dim));
  geometry.set_dtype(*dtype);
  v1::Policy policy;
  policy.set_placement(v1::PLACEMENT_CPU);
  policy.set_selector(*selector);
  policy.set_sinks(std::min(16, context));
  policy.set_recent(std::max(1, context - 16));
  absl::StatusOr<SessionHandle> session = client->CreateSession(geometry, policy, "rpc_overhead");
  if (!session.ok()) return Fail(session.status());

  const int64_t q_size = int64_t{geometry.q_heads()} * geometry.head_dim();
  const int64_t kv_size = int64_t{geometry.kv_heads()} * geometry.head_dim();
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  auto random = [&](int64_t n) {
    std::vector<float> v(n);
    for (float& x : v) x = normal(rng);
    return v;
  };
  {
    absl::StatusOr<std::unique_ptr<PrefillStream>> prefill = client->StartPrefill(*session);
    if (!prefill.ok()) return Fail(prefill.status());
    const std::vector<float> q = random(context * q_size), k = random(context * kv_size),
                             v = random(context * kv_size);
    if (absl::Status s = (*prefill)->SendLayer(0, q, k, v); !s.ok()) return Fail(s);
    if (absl::StatusOr<v1::PrefillResponse> r = (*prefill)->Finish(); !r.ok()) {
      return Fail(r.status());
    }
  }

  absl::StatusOr<std::unique_ptr<DecodeStream>> stream = client->OpenDecodeStream(geometry);
  if (!stream.ok()) return Fail(stream.status());
  const std::vector<float> q = random(q_size), k = random(kv_size), v = random(kv_size);
  const SequenceInput input{session->id, q, k, v};
  StepResult result;
  const StepOptions options;
  const int warmup = absl::GetFlag(FLAGS_warmup);
  const int iterations = absl::GetFlag(FLAGS_iterations);
  std::vector<double> empty_us, step_us, server_us, empty_server_us, empty_cpu_us, step_cpu_us;
  empty_us.reserve(iterations);
  step_us.reserve(iterations);
  server_us.reserve(iterations);
  empty_server_us.reserve(iterations);
  for (int i = 0; i < warmup + iterations; ++i) {
    // Alternating on one stream, so drift in machine load hits both series alike.
    const double c0 = ThreadCpuMicros();
    const Clock::time_point t0 = Clock::now();
    if (absl::Status s = (*stream)->Step(0, {}, options, &result); !s.ok()) return Fail(s);
    const Clock::time_point t1 = Clock::now();
    const double c1 = ThreadCpuMicros();
    const double empty_server = result.response->server_micros();
    if (absl::Status s = (*stream)->Step(0, {&input, 1}, options, &result); !s.ok()) {
      return Fail(s);
    }
    const Clock::time_point t2 = Clock::now();
    const double c2 = ThreadCpuMicros();
    if (i < warmup) continue;
    empty_cpu_us.push_back(c1 - c0);
    step_cpu_us.push_back(c2 - c1);
    empty_us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    step_us.push_back(std::chrono::duration<double, std::micro>(t2 - t1).count());
    server_us.push_back(result.response->server_micros());
    empty_server_us.push_back(empty_server);
  }
  if (absl::Status s = (*stream)->Close(); !s.ok()) return Fail(s);
  client->CloseSession(session->id).IgnoreError();

  // The client library's own per-step work on the tensors, without the RPC: encoding q, k_new,
  // v_new into the session dtype and decoding the output, as DecodeStream::Step does.
  std::vector<double> codec_us;
  codec_us.reserve(iterations);
  {
    v1::SequenceStep step;
    v1::Tensor output;
    const int64_t q_shape[] = {geometry.q_heads(), geometry.head_dim()};
    const int64_t kv_shape[] = {geometry.kv_heads(), geometry.head_dim()};
    EncodeTensor(q, q_shape, geometry.dtype(), false, &output);
    std::vector<float> decoded(q_size);
    for (int i = 0; i < warmup + iterations; ++i) {
      const Clock::time_point t0 = Clock::now();
      EncodeTensor(q, q_shape, geometry.dtype(), false, step.mutable_q());
      EncodeTensor(k, kv_shape, geometry.dtype(), false, step.mutable_k_new());
      EncodeTensor(v, kv_shape, geometry.dtype(), false, step.mutable_v_new());
      if (absl::Status s =
              DecodeTensor(output, {"output", q_shape, false, geometry.dtype()}, decoded.data());
          !s.ok()) {
        return Fail(s);
      }
      if (i >= warmup) {
        codec_us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
      }
    }
  }

  // Per pair: the layer-step's round trip minus its server compute, i.e. what the hop costs
  // when it carries the tensors.
  std::vector<double> transport_us(step_us.size());
  for (size_t i = 0; i < step_us.size(); ++i) transport_us[i] = step_us[i] - server_us[i];
  const double overhead_p50 = Percentile(step_us, 0.5) - Percentile(empty_us, 0.5);
  const double transport_over_empty_p50 = Percentile(transport_us, 0.5) - Percentile(empty_us, 0.5);

  nlohmann::ordered_json j;
  j["server"] = in_process ? "in-process (127.0.0.1)" : address;
  j["q_heads"] = geometry.q_heads();
  j["kv_heads"] = geometry.kv_heads();
  j["head_dim"] = geometry.head_dim();
  j["dtype"] = DTypeLowerName(geometry.dtype());
  j["selector"] = SelectorName(*selector);
  j["context"] = context;
  j["iterations"] = iterations;
  j["request_bytes"] = (q_size + 2 * kv_size) * (geometry.dtype() == v1::DTYPE_F32 ? 4 : 2);
  j["empty_us"] = Quantiles(empty_us);
  j["layer_step_us"] = Quantiles(step_us);
  j["layer_step_server_us"] = Quantiles(server_us);
  j["empty_server_us"] = Quantiles(empty_server_us);
  j["layer_step_minus_server_us"] = Quantiles(transport_us);
  j["client_codec_us"] = Quantiles(codec_us);
  j["client_thread_cpu_us"] = {{"empty", Quantiles(empty_cpu_us)},
                               {"layer_step", Quantiles(step_cpu_us)}};
  j["overhead_p50_us"] = overhead_p50;
  j["transport_overhead_p50_us"] = transport_over_empty_p50;
  j["target_us"] = 30;

  std::printf(
      "layer-step %d q heads / %d kv heads x d=%d (%s, %s over %d tokens), %d pairs on "
      "one stream to %s\n",
      geometry.q_heads(), geometry.kv_heads(), geometry.head_dim(),
      DTypeLowerName(geometry.dtype()).c_str(), SelectorName(*selector).c_str(), context,
      iterations, j["server"].get<std::string>().c_str());
  std::printf("  %-34s %9s %9s\n", "round trip (us)", "p50", "p99");
  auto row = [](const char* name, const std::vector<double>& us) {
    std::printf("  %-34s %9.1f %9.1f\n", name, Percentile(us, 0.5), Percentile(us, 0.99));
  };
  row("empty request", empty_us);
  row("layer-step", step_us);
  row("  of which server compute", server_us);
  row("layer-step minus server compute", transport_us);
  row("client tensor codec (no RPC)", codec_us);
  row("client thread CPU, empty request", empty_cpu_us);
  row("client thread CPU, layer-step", step_cpu_us);
  std::printf(
      "  overhead at p50: layer-step - empty = %.1f us (target <= 30); "
      "excluding server compute = %.1f us\n",
      overhead_p50, transport_over_empty_p50);
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
      "rpc_overhead [--server=HOST:PORT]: gRPC round trip of a layer-step vs an empty request");
  absl::ParseCommandLine(argc, argv);
  return kvrecall::client::Main();
}
