// load_test: many sessions decoding at once against one kvrecalld, each on its own Decode
// stream, with a mix of placements and selectors; reports errors, per layer-step latency (p50 /
// p99 / max) against the same step measured alone in the same run, health-check latency during
// the load, the server's resident memory before, during and after, and the memory the sessions
// report by tier (bench/results/hardening.md, "Load test", and hardening_load_test.{txt,json}).
//
//   load_test --server=127.0.0.1:PORT --server_pid=PID [--sessions=64] [--tokens=1000]
//             [--placements=cpu] [--json=FILE]
//
// Every session gets its own thread, stream and prompt (a synthetic trace's, client/trace/
// synthetic.h, so that queries and keys have a real model's structure); sessions cycle through
// each of --placements with each selector it serves (full, exact_topk, streaming, index and
// retopk; the gpu placement serves no index). Phases: baseline (one session alone, the first
// placement's full), create + prefill all, decode all at once (health checked every
// --health_interval_ms meanwhile), close all. RSS is read from /proc/PID/status; the sessions'
// host and GPU bytes from GetSession, and after the close ListSessions must list none of the
// run's sessions. A session that failed to open counts one error and takes no further part.
#include <algorithm>
#include <atomic>
#include <cinttypes>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/algorithm/container.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/kvrecall_client.h"
#include "client/stats.h"
#include "client/trace/synthetic.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, server, "", "kvrecalld's address");
ABSL_FLAG(int64_t, server_pid, 0, "kvrecalld's pid, for its resident memory");
ABSL_FLAG(int, sessions, 64, "concurrent sessions, each on its own Decode stream and thread");
ABSL_FLAG(int64_t, tokens, 1000, "decode tokens per session");
ABSL_FLAG(int64_t, prompt, 2048, "prompt tokens per session");
ABSL_FLAG(int, layers, 2, "layers per session");
ABSL_FLAG(int, q_heads, 8, "query heads");
ABSL_FLAG(int, kv_heads, 2, "KV heads");
ABSL_FLAG(int, head_dim, 64, "head dimension");
ABSL_FLAG(int, top_k, 128, "K of exact_topk, index and retopk");
ABSL_FLAG(int, baseline_tokens, 200, "tokens of the single-session baseline");
ABSL_FLAG(int, health_interval_ms, 50, "how often health is checked during the load");
ABSL_FLAG(std::string, json, "", "also write the figures as JSON here");
ABSL_FLAG(std::string, placements, "cpu",
          "placements the sessions cycle through, comma-separated (cpu, gpu, tiered), each with "
          "every selector it serves");

namespace kvrecall::bench {
namespace {

using client::Client;
using client::SequenceInput;
using client::StepOptions;
using client::StepResult;

int64_t ResidentBytes(int64_t pid) {
  std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  }
  return -1;
}

struct Percentiles {
  double p50 = 0, p99 = 0, max = 0, mean = 0;
  int64_t count = 0;
};

Percentiles Summarize(const std::vector<double>& micros) {
  Percentiles p;
  p.count = static_cast<int64_t>(micros.size());
  if (micros.empty()) return p;
  p.p50 = client::Percentile(micros, 0.50);
  p.p99 = client::Percentile(micros, 0.99);
  p.max = *std::max_element(micros.begin(), micros.end());
  p.mean = client::Mean(micros);
  return p;
}

nlohmann::json ToJson(const Percentiles& p) {
  return {{"count", p.count}, {"p50_us", p.p50}, {"p99_us", p.p99}, {"max_us", p.max},
          {"mean_us", p.mean}};
}

// A session's placement and selector; sessions cycle through the run's Kinds.
struct Kind {
  v1::Placement placement;
  v1::Selector selector;
  std::string Name() const {
    return absl::StrCat(client::PlacementName(placement), "/", client::SelectorName(selector));
  }
};

// Every selector each of `placements` serves, in the order given (full first in each).
absl::StatusOr<std::vector<Kind>> KindsOf(absl::string_view placements) {
  static constexpr v1::Selector kMix[] = {v1::SELECTOR_FULL, v1::SELECTOR_EXACT_TOPK,
                                          v1::SELECTOR_STREAMING, v1::SELECTOR_INDEX,
                                          v1::SELECTOR_RETOPK};
  std::vector<Kind> kinds;
  std::vector<v1::Placement> seen;
  for (absl::string_view name : absl::StrSplit(placements, ',', absl::SkipWhitespace())) {
    absl::StatusOr<v1::Placement> placement =
        client::ParsePlacement(absl::StripAsciiWhitespace(name));
    if (!placement.ok()) return placement.status();
    if (absl::c_linear_search(seen, *placement)) {
      return absl::InvalidArgumentError(absl::StrCat("placement '", name, "' named twice"));
    }
    seen.push_back(*placement);
    for (v1::Selector selector : kMix) {
      if (*placement == v1::PLACEMENT_GPU && selector == v1::SELECTOR_INDEX) continue;
      kinds.push_back({*placement, selector});
    }
  }
  if (kinds.empty()) return absl::InvalidArgumentError("--placements names none");
  return kinds;
}

// One session: its trace, and the latency of each of its layer-steps.
class Session {
 public:
  Session(int index, Kind kind, const SyntheticTrace& trace)
      : index_(index), kind_(kind), trace_(trace) {}

  absl::Status Open(Client& client) {
    const SyntheticTraceParams& p = trace_.params();
    v1::Geometry g;
    g.set_layers(p.layers);
    g.set_q_heads(p.q_heads);
    g.set_kv_heads(p.kv_heads);
    g.set_head_dim(p.head_dim);
    g.set_dtype(v1::DTYPE_BF16);
    const int k = absl::GetFlag(FLAGS_top_k);
    v1::Policy policy = client::CpuPolicy(kind_.selector, k, 16, 256);
    policy.set_placement(kind_.placement);
    absl::StatusOr<client::SessionHandle> handle =
        client.CreateSession(g, policy, absl::StrCat("load-", index_));
    if (!handle.ok()) return handle.status();
    handle_ = *std::move(handle);
    absl::StatusOr<std::unique_ptr<client::PrefillStream>> prefill = client.StartPrefill(handle_);
    if (!prefill.ok()) return prefill.status();
    const int64_t t = p.context;
    std::vector<float> q(t * p.q_heads * p.head_dim), kk(t * p.kv_heads * p.head_dim),
        v(t * p.kv_heads * p.head_dim);
    for (int l = 0; l < p.layers; ++l) {
      trace_.GenerateRows(l, TracePhase::kPrefill, TraceTensor::kQ, 0, t, q.data());
      trace_.GenerateRows(l, TracePhase::kPrefill, TraceTensor::kK, 0, t, kk.data());
      trace_.GenerateRows(l, TracePhase::kPrefill, TraceTensor::kV, 0, t, v.data());
      if (absl::Status s = (*prefill)->SendLayer(l, q, kk, v); !s.ok()) return s;
    }
    if (absl::Status s = (*prefill)->Finish().status(); !s.ok()) return s;
    open_ = true;
    return absl::OkStatus();
  }

  // Decodes `tokens` tokens (every layer of each) on a stream of its own.
  absl::Status Decode(Client& client, int64_t tokens, std::vector<double>* micros) {
    const SyntheticTraceParams& p = trace_.params();
    absl::StatusOr<std::unique_ptr<client::DecodeStream>> stream =
        client.OpenDecodeStream(handle_.geometry);
    if (!stream.ok()) return stream.status();
    const int64_t qn = int64_t{p.q_heads} * p.head_dim;
    const int64_t kvn = int64_t{p.kv_heads} * p.head_dim;
    std::vector<float> q(p.layers * qn), k(p.layers * kvn), v(p.layers * kvn);
    StepResult result;
    micros->reserve(micros->size() + tokens * p.layers);
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t row = (next_token_++) % p.decode_steps;
      for (int l = 0; l < p.layers; ++l) {
        trace_.GenerateRows(l, TracePhase::kDecode, TraceTensor::kQ, row, 1, &q[l * qn]);
        trace_.GenerateRows(l, TracePhase::kDecode, TraceTensor::kK, row, 1, &k[l * kvn]);
        trace_.GenerateRows(l, TracePhase::kDecode, TraceTensor::kV, row, 1, &v[l * kvn]);
      }
      for (int l = 0; l < p.layers; ++l) {
        const SequenceInput input{handle_.id, std::span<const float>(&q[l * qn], qn),
                                  std::span<const float>(&k[l * kvn], kvn),
                                  std::span<const float>(&v[l * kvn], kvn)};
        const absl::Time start = absl::Now();
        if (absl::Status s = (*stream)->Step(l, {&input, 1}, StepOptions{}, &result); !s.ok()) {
          return s;
        }
        micros->push_back(absl::ToDoubleMicroseconds(absl::Now() - start));
      }
    }
    return (*stream)->Close();
  }

  absl::Status Close(Client& client) { return client.CloseSession(handle_.id); }

  const std::string& id() const { return handle_.id; }
  // Whether CreateSession succeeded (the session is the server's until closed), and whether the
  // Prefill did too: a session that did not open steps no further.
  bool created() const { return !handle_.id.empty(); }
  bool open() const { return open_; }
  const Kind& kind() const { return kind_; }

 private:
  const int index_;
  const Kind kind_;
  const SyntheticTrace& trace_;
  client::SessionHandle handle_;
  bool open_ = false;
  int64_t next_token_ = 0;
};

int Run() {
  const std::string address = absl::GetFlag(FLAGS_server);
  const int64_t pid = absl::GetFlag(FLAGS_server_pid);
  if (address.empty() || pid <= 0) {
    std::fprintf(stderr, "load_test: --server and --server_pid are required\n");
    return 2;
  }
  const int sessions = absl::GetFlag(FLAGS_sessions);
  absl::StatusOr<std::vector<Kind>> kinds = KindsOf(absl::GetFlag(FLAGS_placements));
  if (!kinds.ok()) {
    std::fprintf(stderr, "load_test: --placements: %s\n", kinds.status().ToString().c_str());
    return 2;
  }
  if (sessions < static_cast<int>(kinds->size())) {
    std::fprintf(stderr,
                 "load_test: --sessions=%d is fewer than the %zu kinds of --placements (each "
                 "placement with every selector it serves): some would not run\n",
                 sessions, kinds->size());
    return 2;
  }
  auto kind_of = [&](int session) { return (*kinds)[session % kinds->size()]; };
  const int64_t tokens = absl::GetFlag(FLAGS_tokens);
  SyntheticTraceParams params;
  params.layers = absl::GetFlag(FLAGS_layers);
  params.q_heads = absl::GetFlag(FLAGS_q_heads);
  params.kv_heads = absl::GetFlag(FLAGS_kv_heads);
  params.head_dim = absl::GetFlag(FLAGS_head_dim);
  params.context = absl::GetFlag(FLAGS_prompt);
  params.decode_steps = std::max<int64_t>(tokens, absl::GetFlag(FLAGS_baseline_tokens));
  params.mean_segment = 256;
  params.needles = 4;
  absl::StatusOr<SyntheticTrace> trace = SyntheticTrace::Create(params);
  if (!trace.ok()) {
    std::fprintf(stderr, "load_test: %s\n", trace.status().ToString().c_str());
    return 2;
  }
  if (absl::Status s = kvrecall::client::CheckServerAddress(address); !s.ok()) {
    std::fprintf(stderr, "load_test: --server: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  std::unique_ptr<Client> client = Client::Connect(address);
  nlohmann::json out;
  out["config"] = {{"sessions", sessions},     {"tokens", tokens},
                   {"prompt", params.context}, {"layers", params.layers},
                   {"q_heads", params.q_heads}, {"kv_heads", params.kv_heads},
                   {"head_dim", params.head_dim}, {"dtype", "bf16"},
                   {"top_k", absl::GetFlag(FLAGS_top_k)}};
  for (const Kind& kind : *kinds) out["config"]["kinds"].push_back(kind.Name());
  out["rss_bytes"]["before"] = ResidentBytes(pid);

  // Baseline: one session of the mix's costliest selector (full), alone.
  std::vector<double> alone;
  {
    Session s(0, kind_of(0), *trace);
    if (absl::Status st = s.Open(*client); !st.ok()) {
      std::fprintf(stderr, "load_test: baseline: %s\n", st.ToString().c_str());
      return 1;
    }
    if (absl::Status st = s.Decode(*client, absl::GetFlag(FLAGS_baseline_tokens), &alone);
        !st.ok()) {
      std::fprintf(stderr, "load_test: baseline: %s\n", st.ToString().c_str());
      return 1;
    }
    (void)s.Close(*client);
  }
  out["rss_bytes"]["after_baseline"] = ResidentBytes(pid);

  std::vector<std::unique_ptr<Session>> all;
  std::atomic<int64_t> errors{0};
  absl::Mutex errors_mu;
  std::vector<std::string> error_messages;
  auto record_error = [&](const absl::Status& s) {
    errors.fetch_add(1);
    absl::MutexLock lock(&errors_mu);
    if (error_messages.size() < 10) error_messages.push_back(s.ToString());
  };
  const absl::Time prefill_start = absl::Now();
  for (int i = 0; i < sessions; ++i) {
    all.push_back(std::make_unique<Session>(i, kind_of(i), *trace));
    if (absl::Status s = all.back()->Open(*client); !s.ok()) record_error(s);
  }
  out["prefill_seconds"] = absl::ToDoubleSeconds(absl::Now() - prefill_start);
  out["rss_bytes"]["after_prefill"] = ResidentBytes(pid);
  // What the sessions say they hold, by tier and kind (GetSession's host_bytes, gpu_bytes).
  auto session_bytes = [&](absl::string_view phase) {
    nlohmann::json& by_kind = out["session_bytes"][std::string(phase)];
    for (const auto& s : all) {
      if (!s->open()) continue;
      absl::StatusOr<v1::SessionInfo> info = client->GetSession(s->id());
      if (!info.ok()) {
        record_error(info.status());
        continue;
      }
      nlohmann::json& k = by_kind[s->kind().Name()];
      if (k.is_null()) k = {{"host", int64_t{0}}, {"gpu", int64_t{0}}, {"devices", {}}};
      k["host"] = k["host"].get<int64_t>() + info->host_bytes();
      k["gpu"] = k["gpu"].get<int64_t>() + info->gpu_bytes();
      k["devices"][info->device()] = true;
    }
  };
  session_bytes("after_prefill");

  // The load, with health checks and RSS samples beside it.
  std::vector<std::vector<double>> micros(sessions);
  std::atomic<bool> loaded{true};
  std::vector<double> health_micros;
  int64_t health_failures = 0;
  int64_t rss_peak = 0;
  std::vector<int64_t> rss_samples;
  std::thread watcher([&] {
    auto health = grpc::health::v1::Health::NewStub(client->channel());
    absl::Time next_rss = absl::Now();
    while (loaded.load()) {
      grpc::ClientContext context;
      context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
      grpc::health::v1::HealthCheckResponse response;
      const absl::Time start = absl::Now();
      const grpc::Status s = health->Check(&context, {}, &response);
      const double us = absl::ToDoubleMicroseconds(absl::Now() - start);
      if (s.ok() && response.status() == grpc::health::v1::HealthCheckResponse::SERVING) {
        health_micros.push_back(us);
      } else {
        ++health_failures;
      }
      if (absl::Now() >= next_rss) {
        const int64_t rss = ResidentBytes(pid);
        rss_samples.push_back(rss);
        rss_peak = std::max(rss_peak, rss);
        next_rss += absl::Seconds(1);
      }
      absl::SleepFor(absl::Milliseconds(absl::GetFlag(FLAGS_health_interval_ms)));
    }
  });
  const absl::Time decode_start = absl::Now();
  std::vector<std::thread> threads;
  for (int i = 0; i < sessions; ++i) {
    threads.emplace_back([&, i] {
      if (!all[i]->open()) return;
      if (absl::Status s = all[i]->Decode(*client, tokens, &micros[i]); !s.ok()) record_error(s);
    });
  }
  for (std::thread& t : threads) t.join();
  const double decode_seconds = absl::ToDoubleSeconds(absl::Now() - decode_start);
  out["rss_bytes"]["end_of_decode"] = ResidentBytes(pid);
  loaded.store(false);
  watcher.join();
  session_bytes("end_of_decode");

  for (auto& s : all) {
    if (!s->created()) continue;
    if (absl::Status st = s->Close(*client); !st.ok()) record_error(st);
  }
  absl::SleepFor(absl::Seconds(1));
  out["rss_bytes"]["after_close"] = ResidentBytes(pid);
  // Every session closed: none of the run's may be left listed (other clients' may be).
  if (absl::StatusOr<std::vector<v1::SessionInfo>> listed = client->ListSessions(); !listed.ok()) {
    record_error(listed.status());
  } else {
    int64_t left = 0;
    for (const v1::SessionInfo& info : *listed) {
      left += absl::c_any_of(all, [&](const std::unique_ptr<Session>& s) {
        return s->created() && s->id() == info.session_id();
      });
    }
    out["sessions_listed_after_close"] = left;
    if (left > 0) {
      record_error(absl::InternalError(
          absl::StrCat(left, " of the run's sessions still listed after each was closed")));
    }
  }
  out["rss_bytes"]["peak_during_decode"] = rss_peak;
  out["rss_bytes"]["samples_during_decode"] = rss_samples;

  std::vector<double> loaded_micros;
  for (const auto& m : micros) loaded_micros.insert(loaded_micros.end(), m.begin(), m.end());
  const Percentiles base = Summarize(alone);
  const Percentiles load = Summarize(loaded_micros);
  const Percentiles health = Summarize(health_micros);
  out["errors"] = errors.load();
  out["error_messages"] = error_messages;
  out["decode_seconds"] = decode_seconds;
  out["layer_steps"] = load.count;
  out["layer_steps_per_second"] = load.count / decode_seconds;
  out["step_alone"] = ToJson(base);
  out["step_under_load"] = ToJson(load);
  // The steps of the sessions of one kind (kinds->at(k)) under load.
  auto of_kind = [&](size_t k) {
    std::vector<double> steps;
    for (int i = 0; i < sessions; ++i) {
      if (i % kinds->size() == k) steps.insert(steps.end(), micros[i].begin(), micros[i].end());
    }
    return steps;
  };
  for (size_t k = 0; k < kinds->size(); ++k) {
    out["step_under_load_by_kind"][(*kinds)[k].Name()] = ToJson(Summarize(of_kind(k)));
  }
  // The baseline is the first kind's `full` session alone: it compares with those sessions
  // under load (the mix's cheaper selectors would understate the slowdown; probe 24).
  const Percentiles full_load = Summarize(of_kind(0));
  out["p50_ratio_full_under_load_vs_alone"] = base.p50 > 0 ? full_load.p50 / base.p50 : 0;
  out["health"] = ToJson(health);
  out["health"]["failures"] = health_failures;

  const auto& rss = out["rss_bytes"];
  auto mib = [](int64_t b) { return static_cast<double>(b) / (1 << 20); };
  std::printf("load_test: %d sessions x %" PRId64 " tokens x %d layers on %s\n", sessions, tokens,
              params.layers, address.c_str());
  std::printf("  errors: %" PRId64 "\n", errors.load());
  std::printf("  layer-step alone:      p50 %8.1f us  p99 %8.1f us  max %8.1f us  (%" PRId64
              " steps)\n", base.p50, base.p99, base.max, base.count);
  std::printf("  layer-step under load: p50 %8.1f us  p99 %8.1f us  max %8.1f us  (%" PRId64
              " steps, %.0f steps/s; %s's p50 x%.1f alone)\n",
              load.p50, load.p99, load.max, load.count, load.count / decode_seconds,
              (*kinds)[0].Name().c_str(),
              out["p50_ratio_full_under_load_vs_alone"].get<double>());
  std::printf("  health during load:    p50 %8.1f us  p99 %8.1f us  max %8.1f us  (%" PRId64
              " checks, %" PRId64 " failed)\n", health.p50, health.p99, health.max, health.count,
              health_failures);
  std::printf("  server RSS MiB: before %.1f, after prefill %.1f, peak during decode %.1f, end of "
              "decode %.1f, after close %.1f\n",
              mib(rss["before"]), mib(rss["after_prefill"]), mib(rss_peak),
              mib(rss["end_of_decode"]), mib(rss["after_close"]));
  for (const auto& item : out["step_under_load_by_kind"].items()) {
    const nlohmann::json& p = item.value();
    std::printf("    %-24s p50 %8.1f us  p99 %8.1f us  (%lld steps)\n", item.key().c_str(),
                p["p50_us"].get<double>(), p["p99_us"].get<double>(),
                static_cast<long long>(p["count"].get<int64_t>()));
  }
  for (const auto& phase : out["session_bytes"].items()) {
    for (const auto& kind : phase.value().items()) {
      std::printf("  %s %-24s host %.1f MiB, GPU %.1f MiB on", phase.key().c_str(),
                  kind.key().c_str(), mib(kind.value()["host"].get<int64_t>()),
                  mib(kind.value()["gpu"].get<int64_t>()));
      for (const auto& device : kind.value()["devices"].items()) {
        std::printf(" %s", device.key().c_str());
      }
      std::printf("\n");
    }
  }
  if (!error_messages.empty()) std::printf("  first error: %s\n", error_messages[0].c_str());
  const std::string json = absl::GetFlag(FLAGS_json);
  if (!json.empty()) std::ofstream(json) << out.dump(2) << "\n";
  return errors.load() == 0 && health_failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace kvrecall::bench

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("load_test --server=HOST:PORT --server_pid=PID: kvrecalld under load");
  absl::ParseCommandLine(argc, argv);
  return kvrecall::bench::Run();
}
