// `kvrecall synth --out FILE [--context T] [--decode_steps N] [--layers L] [geometry] [model]
// [--query_drift calibrated|adversarial]`:
// writes a synthetic replay trace (client/trace/synthetic.h) and prints its needles as JSON.
#include <cstdio>
#include <string>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "client/cli/common.h"
#include "client/cli/subcommands.h"
#include "client/trace/synthetic.h"
#include "nlohmann/json.hpp"
#include "proto/tensor_codec.h"

// Geometry flags shared with create and demo.
ABSL_DECLARE_FLAG(int32_t, layers);
ABSL_DECLARE_FLAG(int32_t, q_heads);
ABSL_DECLARE_FLAG(int32_t, kv_heads);
ABSL_DECLARE_FLAG(int32_t, head_dim);
ABSL_DECLARE_FLAG(std::string, dtype);
ABSL_DECLARE_FLAG(int64_t, context);
ABSL_DECLARE_FLAG(int64_t, decode_steps);

ABSL_FLAG(std::string, out, "", "synth: the trace file to write");
ABSL_FLAG(uint64_t, seed, 1, "synth: random seed (same flags and seed, same trace)");
ABSL_FLAG(int32_t, sink_tokens, 4, "synth: attention-sink tokens at the start of the prompt");
ABSL_FLAG(int32_t, topics, 64, "synth: latent topics of the prompt");
ABSL_FLAG(int32_t, mean_segment, 512, "synth: mean tokens per topic segment");
ABSL_FLAG(int32_t, drift_period, 32, "synth: decode steps between topic changes");
ABSL_FLAG(std::string, query_drift, "calibrated",
          "synth: how decode queries move between steps. calibrated (default): the topic changes "
          "abruptly every drift_period steps and each step jitters around it, matching tinylm-a's "
          "step-to-step query cosine and ReTopK path mix (bench/results/synth_calibration.md); "
          "adversarial: the generator before issue 15, the topic glides smoothly to the next one "
          "with no jitter, so queries stay >= tau alike while their support moves (the worst "
          "case for selection reuse)");
ABSL_FLAG(double, decode_noise, -1.0,
          "synth: norm of each decode query's own jitter (< 0: the drift's default, 8 for "
          "calibrated, 0 for adversarial)");
ABSL_FLAG(int32_t, needles, 8, "synth: planted key/value pairs, one decode step asks for each");
ABSL_FLAG(int32_t, rotary_dims, 32, "synth: leading dims under RoPE");
ABSL_FLAG(double, rope_base, 500000.0, "synth: RoPE base");

namespace kvrecall::cli {

int RunSynth(const std::vector<char*>& args) {
  if (!args.empty()) return UsageError("synth", "takes no arguments, only flags");
  SyntheticTraceParams p;
  p.layers = absl::GetFlag(FLAGS_layers);
  p.q_heads = absl::GetFlag(FLAGS_q_heads);
  p.kv_heads = absl::GetFlag(FLAGS_kv_heads);
  p.head_dim = absl::GetFlag(FLAGS_head_dim);
  p.context = absl::GetFlag(FLAGS_context);
  p.decode_steps = absl::GetFlag(FLAGS_decode_steps);
  p.seed = absl::GetFlag(FLAGS_seed);
  p.sinks = absl::GetFlag(FLAGS_sink_tokens);
  p.topics = absl::GetFlag(FLAGS_topics);
  p.mean_segment = absl::GetFlag(FLAGS_mean_segment);
  p.drift_period = absl::GetFlag(FLAGS_drift_period);
  absl::StatusOr<QueryDrift> drift = ParseQueryDrift(absl::GetFlag(FLAGS_query_drift));
  if (!drift.ok()) return UsageError("synth", drift.status().message());
  p.query_drift = *drift;
  p.decode_noise = static_cast<float>(absl::GetFlag(FLAGS_decode_noise));
  p.needles = absl::GetFlag(FLAGS_needles);
  p.rotary_dims = absl::GetFlag(FLAGS_rotary_dims);
  p.rope_base = absl::GetFlag(FLAGS_rope_base);
  const std::string dtype = absl::GetFlag(FLAGS_dtype);
  if (dtype == "bf16") {
    p.dtype = v1::DTYPE_BF16;
  } else if (dtype == "f16") {
    p.dtype = v1::DTYPE_F16;
  } else if (dtype == "f32") {
    p.dtype = v1::DTYPE_F32;
  } else {
    return UsageError("synth", "--dtype must be bf16, f16 or f32");
  }
  const std::string out = absl::GetFlag(FLAGS_out);
  if (out.empty()) return UsageError("synth", "--out FILE is required");

  absl::StatusOr<SyntheticTrace> trace = SyntheticTrace::Create(p);
  if (!trace.ok()) return UsageError("synth", trace.status().message());
  if (absl::Status s = trace->Write(out); !s.ok()) return ReportError("synth", s);
  nlohmann::json report = {{"wrote", out}, {"context", p.context},
                           {"decode_steps", p.decode_steps}, {"layers", p.layers},
                           {"q_heads", p.q_heads}, {"kv_heads", p.kv_heads},
                           {"head_dim", p.head_dim}, {"dtype", dtype}, {"seed", p.seed},
                           {"query_drift", QueryDriftName(p.query_drift)},
                           {"decode_noise", std::stod(trace->Metadata().at("decode_noise"))},
                           {"needles", nlohmann::json::parse(trace->Metadata().at("needles"))}};
  std::printf("%s\n", report.dump(absl::GetFlag(FLAGS_json) ? -1 : 2).c_str());
  return 0;
}

}  // namespace kvrecall::cli
