// What ReTopK sees on a synthetic trace (client/trace/synthetic.h), measured in-process without
// writing the trace, or on a real one: the decode queries' similarity statistics and the real
// selector's (index/retopk.h) path mix and support recall, per query head (issue 15's
// calibration against tinylm-a, bench/results/synth_calibration.md).
//
// Only the rows the measurement needs are read or generated (SyntheticTrace::GenerateRows is a pure
// function of (params, layer, row)): every key of one layer, the prompt queries ReTopK seeds and
// calibrates from and the decode queries. One KV group of a larger geometry is probed by giving
// the params that group's heads alone: with q_heads = G and kv_heads = 1 the generator produces
// exactly KV head 0 and query heads 0..G-1 of any geometry with G query heads per KV head.
#ifndef KVRECALL_BENCH_SYNTH_PROBE_H_
#define KVRECALL_BENCH_SYNTH_PROBE_H_

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/statusor.h"
#include "client/trace/synthetic.h"
#include "client/trace/trace.h"
#include "kernels/retopk_params.h"
#include "nlohmann/json.hpp"

namespace kvrecall {

struct SynthProbeOptions {
  int layer = 0;
  int top_k = 512;      // K
  ReTopKParams retopk;  // C, R, W, tau, refresh, auto_tau (the paper's defaults)
  // The tiered placement's view: ReTopK selects over the bulk [sinks, tokens - recent) and is
  // built from the prompt queries offset by `recent` (server/backends/tiered_backend.cc);
  // auto_tau counts the static set's mass as kept. false: the cpu placement (whole history).
  bool tiered = false;
  int tiered_sinks = 128;
  int tiered_recent = 512;
  // Keys and queries rounded to bf16, as a bf16 session stores and receives them.
  bool bf16 = false;
  // The cosine the pass shares are counted at (the paper's tau, whatever retopk.tau is).
  float pass_cosine = 0.85f;
};

// Per query head; the means are over the trace's decode steps.
struct SynthProbeHead {
  int q_head = 0;
  float tau = 0.0f;              // the head's tau (calibrated under auto_tau)
  double q_cos1 = 0;             // cosine of consecutive decode queries (steps 1..N-1)
  double q_cos8 = 0;             // the same 8 steps apart
  double best_prompt = 0;        // best cosine with the prompt's last C queries
  double best_decode = 0;        // best cosine with the previous min(C, s) decode queries (s >= 1)
  double best_cache = 0;         // best cosine with ReTopK's cache (what tau is compared with)
  double pass_prompt = 0;        // share of steps with best_prompt >= pass_cosine
  double pass_cache = 0;         // share of steps with best_cache >= pass_cosine
  double rotary_share = 0;       // mean ||q[0, rotary_dims)||^2 / ||q||^2 of decode queries
  double reuse = 0, fallback = 0, refresh = 0;  // ReTopK's path mix
  double recall = 0;             // support recall vs the exact top-K, every step
  double weighted_recall = 0;    // attention-weighted recall (kernels/fidelity.h), every step
  double reuse_recall = 0;       // support recall over reuse steps only (0 if none)
  double topk_keep = 0;          // |exact top-K(s) ∩ exact top-K(s-1)| / K
};

struct SynthProbeReport {
  std::vector<SynthProbeHead> heads;
  SynthProbeHead mean;  // every field averaged over the heads (q_head -1)
};

// Rows [row_begin, row_begin + rows) of one tensor of layer `layer` as f32,
// [rows, heads, head_dim] into out: Trace::ReadRows, or SyntheticTrace::GenerateRows.
using TraceRowSource = std::function<absl::Status(int layer, TracePhase phase, TraceTensor tensor,
                                                  int64_t row_begin, int64_t rows, float* out)>;

// Replays layer options.layer's decode steps of a trace of `geometry` (rows from `rows`)
// through a ReTopKSelector over the prompt and the decode tokens before each step.
// INVALID_ARGUMENT for invalid options (a prompt shorter than C + 1 tokens, a tiered bulk of
// fewer). `rotary_dims` only feeds rotary_share. Memory: (context + decode_steps) * kv_heads *
// head_dim floats of keys and the prompt queries' rows that are read; time: two exact scans of
// the history per head and step.
absl::StatusOr<SynthProbeReport> ProbeTrace(const TraceGeometry& geometry, int rotary_dims,
                                            const TraceRowSource& rows,
                                            const SynthProbeOptions& options);

// ProbeTrace over SyntheticTrace(params), generating only the rows it reads; also
// INVALID_ARGUMENT for invalid params.
absl::StatusOr<SynthProbeReport> ProbeSyntheticTrace(const SyntheticTraceParams& params,
                                                     const SynthProbeOptions& options);

nlohmann::json SynthProbeHeadJson(const SynthProbeHead& head);

}  // namespace kvrecall

#endif  // KVRECALL_BENCH_SYNTH_PROBE_H_
