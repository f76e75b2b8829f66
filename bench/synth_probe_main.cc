// synth_probe: the decode-query statistics and ReTopK's path mix and support recall
// (bench/synth_probe.h) on synthetic traces, per context, without writing them, or on a real
// trace, per layer. One JSON object per (context or layer) on stdout: the means over the heads,
// and every head's figures with --per_head.
//
//   synth_probe --contexts=16384,131072 --q_heads=4 --kv_heads=1 --head_dim=128 [--auto_tau]
//   synth_probe --trace=tinylm-16k-b.safetensors --rotary_dims=64 [--layer=L]
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "bench/int_list.h"
#include "bench/synth_probe.h"

ABSL_FLAG(std::string, trace, "",
          "probe this trace file (every layer, or --layer) instead of generating synthetic ones");
ABSL_FLAG(std::string, contexts, "16384", "synthetic: prompt tokens, comma-separated");
ABSL_FLAG(int64_t, decode_steps, 256, "synthetic: decode steps replayed");
ABSL_FLAG(int32_t, q_heads, 8, "synthetic: query heads (4 with --kv_heads=1: a Llama-3-8B group)");
ABSL_FLAG(int32_t, kv_heads, 2, "synthetic: KV heads");
ABSL_FLAG(int32_t, head_dim, 64, "synthetic: head dimension");
ABSL_FLAG(int32_t, rotary_dims, 32,
          "the generator's rotary dims (with --trace: the model's, for rotary_share only)");
ABSL_FLAG(double, rope_base, 500000.0, "synthetic: RoPE base");
ABSL_FLAG(uint64_t, seed, 1, "synthetic: the generator's seed");
ABSL_FLAG(std::string, query_drift, "calibrated", "synthetic: calibrated or adversarial");
ABSL_FLAG(double, decode_noise, -1.0, "synthetic: the decode jitter (< 0: the drift's default)");
ABSL_FLAG(int32_t, layer, -1, "the layer probed (-1: layer 0 of a synthetic trace, every layer "
                              "of --trace)");
ABSL_FLAG(int32_t, k, 512, "top K");
ABSL_FLAG(double, tau, 0.85, "ReTopK tau");
ABSL_FLAG(bool, auto_tau, false, "ReTopK calibrates tau per head on the prompt");
ABSL_FLAG(bool, tiered, false, "the tiered placement's bulk view (sinks 128, recent 512)");
ABSL_FLAG(bool, bf16, false, "round keys and queries to bf16 (as a bf16 session holds them)");
ABSL_FLAG(bool, per_head, false, "print every head's figures too");

namespace kvrecall {
namespace {

int Fail(const absl::Status& status) {
  std::fprintf(stderr, "synth_probe: %s\n", status.ToString().c_str());
  return 1;
}

void Print(nlohmann::json out, const SynthProbeOptions& o, const SynthProbeReport& report) {
  out["k"] = o.top_k;
  out["tau"] = o.retopk.tau;
  out["auto_tau"] = o.retopk.auto_tau;
  out["tiered"] = o.tiered;
  out["bf16"] = o.bf16;
  out["mean"] = SynthProbeHeadJson(report.mean);
  if (absl::GetFlag(FLAGS_per_head)) {
    for (const SynthProbeHead& h : report.heads) out["heads"].push_back(SynthProbeHeadJson(h));
  }
  std::printf("%s\n", out.dump().c_str());
  std::fflush(stdout);
}

int Run() {
  SynthProbeOptions o;
  o.top_k = absl::GetFlag(FLAGS_k);
  o.retopk.tau = static_cast<float>(absl::GetFlag(FLAGS_tau));
  o.retopk.auto_tau = absl::GetFlag(FLAGS_auto_tau);
  o.tiered = absl::GetFlag(FLAGS_tiered);
  o.bf16 = absl::GetFlag(FLAGS_bf16);
  const int layer = absl::GetFlag(FLAGS_layer);
  if (const std::string path = absl::GetFlag(FLAGS_trace); !path.empty()) {
    absl::StatusOr<Trace> trace = Trace::Open(path);
    if (!trace.ok()) return Fail(trace.status());
    const TraceGeometry& g = trace->geometry();
    for (int l = layer < 0 ? 0 : layer; l < (layer < 0 ? g.layers : layer + 1); ++l) {
      o.layer = l;
      absl::StatusOr<SynthProbeReport> report = ProbeTrace(
          g, absl::GetFlag(FLAGS_rotary_dims),
          [&](int at, TracePhase phase, TraceTensor tensor, int64_t begin, int64_t rows,
              float* out) { return trace->ReadRows(at, phase, tensor, begin, rows, out); },
          o);
      if (!report.ok()) return Fail(report.status());
      Print({{"trace", path}, {"layer", l}, {"context", g.context}, {"q_heads", g.q_heads},
             {"kv_heads", g.kv_heads}, {"head_dim", g.head_dim}, {"decode_steps", g.decode_steps}},
            o, *report);
    }
    return 0;
  }
  absl::StatusOr<std::vector<int64_t>> contexts =
      bench::ParseIntList<int64_t>("contexts", absl::GetFlag(FLAGS_contexts));
  if (!contexts.ok()) return Fail(contexts.status());
  for (const int64_t context : *contexts) {
    SyntheticTraceParams p;
    p.context = context;
    o.layer = std::max(layer, 0);
    p.layers = o.layer + 1;
    p.q_heads = absl::GetFlag(FLAGS_q_heads);
    p.kv_heads = absl::GetFlag(FLAGS_kv_heads);
    p.head_dim = absl::GetFlag(FLAGS_head_dim);
    p.rotary_dims = absl::GetFlag(FLAGS_rotary_dims);
    p.rope_base = absl::GetFlag(FLAGS_rope_base);
    p.decode_steps = absl::GetFlag(FLAGS_decode_steps);
    p.seed = absl::GetFlag(FLAGS_seed);
    p.decode_noise = static_cast<float>(absl::GetFlag(FLAGS_decode_noise));
    absl::StatusOr<QueryDrift> drift = ParseQueryDrift(absl::GetFlag(FLAGS_query_drift));
    if (!drift.ok()) return Fail(drift.status());
    p.query_drift = *drift;
    absl::StatusOr<SynthProbeReport> report = ProbeSyntheticTrace(p, o);
    if (!report.ok()) return Fail(report.status());
    Print({{"context", p.context}, {"layer", o.layer}, {"q_heads", p.q_heads},
           {"kv_heads", p.kv_heads}, {"head_dim", p.head_dim}, {"decode_steps", p.decode_steps},
           {"seed", p.seed}, {"query_drift", QueryDriftName(p.query_drift)},
           {"decode_noise", p.decode_noise}},
          o, *report);
  }
  return 0;
}

}  // namespace
}  // namespace kvrecall

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return kvrecall::Run();
}
