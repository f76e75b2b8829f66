// Sends traces to a kvrecall server: a trace's prompt into a session (PrefillFromTrace), and a
// whole replay (prefill, then every decode step of every layer, token-major) that measures
// fidelity against full attention computed locally from the trace, the server's selection
// figures and per layer-step latency (Replay).
#ifndef KVRECALL_CLIENT_REPLAY_H_
#define KVRECALL_CLIENT_REPLAY_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "client/kvrecall_client.h"
#include "client/trace/trace.h"
#include "kvrecall/v1/kvrecall.pb.h"
#include "nlohmann/json.hpp"

namespace kvrecall::client {

// One layer's keys and values as f32, row-major [tokens, kv_heads, head_dim].
struct LayerKv {
  std::vector<float> keys, values;
};

// OK when a session of `geometry` can take `trace`'s tensors: the same layers, query heads, KV
// heads and head_dim (the dtypes may differ: the client converts, as for any runner's f32);
// INVALID_ARGUMENT naming both geometries otherwise.
absl::Status CheckTraceGeometry(const Trace& trace, absl::string_view session_id,
                                const v1::Geometry& geometry);

// Streams every layer's prompt of `trace` to `session` in one Prefill call (chunked under the
// message limit by PrefillStream; q for every token, whatever session.prompt_queries says) and
// returns the server's reply. With `kv` (one LayerKv per layer, each sized for at least the
// prompt's rows), each layer's prompt keys and values are also left in its first rows.
// CheckTraceGeometry's error before anything is sent; then the server's.
absl::StatusOr<v1::PrefillResponse> PrefillFromTrace(Client& client, const SessionHandle& session,
                                                     const Trace& trace,
                                                     const PrefillOptions& options,
                                                     std::vector<LayerKv>* kv = nullptr);

struct ReplayOptions {
  v1::Policy policy;
  int64_t steps = -1;  // decode steps to replay; -1: all of the trace's
  std::string label = "kvrecall replay";
  PrefillOptions prefill;
  DecodeStreamOptions decode;  // the one Decode stream's (step_timeout, say)
  // Called after every decode step (all layers) with (steps done, steps).
  std::function<void(int64_t, int64_t)> step_progress;
};

struct Quantiles {
  double p50 = 0;
  double p99 = 0;
};

// Figures of one replay. Fidelity figures are over head-steps (one query head of one layer of
// one decode step).
struct ReplayReport {
  std::string trace;  // the trace's file
  v1::Policy policy;  // effective, as the server filled it in
  TraceGeometry geometry;
  int64_t steps = 0;        // decode steps replayed
  int64_t layer_steps = 0;  // steps * layers
  // From the server's compare_exact diagnostics (means).
  double support_recall = 0;   // |support ∩ exact top-K| / K
  double retained_mass = 0;    // softmax mass of the support under full attention
  double mean_candidates = 0;  // tokens scored per head-step to choose the support
  double mean_support = 0;     // tokens attended per head-step
  // Shares of head-steps by path (exact is the rest).
  double reuse = 0, fallback = 0, refresh = 0;
  // The client's own comparison of the server's outputs with full attention over the trace.
  double output_cosine = 0;      // mean
  double output_cosine_p05 = 0;  // 5th percentile
  double output_cosine_min = 0;
  double rel_l2 = 0;                 // mean ||o - o_full|| / ||o_full||
  double server_output_cosine = 0;   // the server's own compare_exact figure (mean)
  Quantiles latency_us;              // per layer-step, end to end through the client library
  Quantiles server_us;               // per layer-step, the server's compute (server_micros)
  double prefill_seconds = 0;        // the whole Prefill call, end to end
  double prefill_build_seconds = 0;  // the server's part spent building selector state
};

// Creates a session with the trace's geometry (its dtype) and `options.policy`, streams the
// prompt of every layer in one Prefill call, then for t in [0, steps) and layer in [0, L) one
// Decode step with compare_exact on one stream, and closes the session (also on error).
// Errors carry the server's status; INVALID_ARGUMENT when steps is not in [1, the trace's]
// (or -1), before anything is sent.
absl::StatusOr<ReplayReport> Replay(Client& client, const Trace& trace,
                                    const ReplayOptions& options);

// The report as one JSON object with the keys of issue 2: policy, layers, q_heads, kv_heads,
// head_dim, context, steps, support_recall, retained_mass, output_cosine, output_cosine_p05,
// rel_l2, path_mix {reuse, fallback, refresh}, latency_us {p50, p99}, and more.
nlohmann::ordered_json ReplayReportJson(const ReplayReport& report);

}  // namespace kvrecall::client

#endif  // KVRECALL_CLIENT_REPLAY_H_
