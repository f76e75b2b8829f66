// `kvrecall decode SESSION_ID --trace FILE [--steps N]`: sends a trace's decode steps (every
// layer of each, token-major) to a session prefilled from that trace (its geometry and prompt
// length are checked, not its contents), from wherever the session stands, and prints each
// layer-step's times and, when asked, the server's per-head diagnostics and the attention
// output: a runner's decode loop, one command at a time, for debugging.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/cli/common.h"
#include "client/cli/subcommands.h"
#include "client/replay.h"
#include "client/trace/trace.h"
#include "nlohmann/json.hpp"

ABSL_DECLARE_FLAG(std::string, trace);
ABSL_DECLARE_FLAG(int64_t, steps);
ABSL_FLAG(bool, diagnostics, false,
          "decode: also each head's path, candidates scored and support (the server's "
          "diagnostics)");
ABSL_FLAG(bool, compare_exact, false,
          "decode: also each head's fidelity against full attention over the session's whole "
          "context (the server's compare_exact: support recall, retained mass, output cosine); "
          "implies --diagnostics");
ABSL_FLAG(bool, outputs, false,
          "decode: also each layer-step's attention output, [q_heads, head_dim] (with --json as "
          "a list of rows)");

namespace kvrecall::cli {
namespace {

// Which of the trace's decode steps go to the session, from where its layers stand.
struct DecodePlan {
  int64_t first_step = 0;  // the trace's decode step the session's shortest layers take next
  int64_t steps = 0;       // steps to send from first_step (each to every layer lacking it)
  std::vector<int64_t> layer_tokens;  // tokens each layer holds now
};

// FAILED_PRECONDITION when the session is not prefilled from a prompt of the trace's length or
// its layers are more than a token apart; OUT_OF_RANGE when the trace has fewer steps left
// than asked for (or none). The session cannot tell which prompt filled it: a trace of the same
// geometry and prompt length is taken as its own (the tokens' positions are what is checked).
absl::StatusOr<DecodePlan> PlanDecode(const v1::SessionInfo& info, const Trace& trace,
                                      int64_t steps) {
  const TraceGeometry& g = trace.geometry();
  const std::string& id = info.session_id();
  if (info.layers_prefilled() < g.layers) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "session %s has %d of its %d layers prefilled: send the trace's prompt first (kvrecall "
        "prefill %s --trace %s)",
        id, info.layers_prefilled(), g.layers, id, trace.file().label()));
  }
  if (info.prompt_tokens() != g.context) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "session %s's prompt has %d tokens and %s's %d: the session was not prefilled from this "
        "trace",
        id, info.prompt_tokens(), trace.file().label(), g.context));
  }
  DecodePlan plan;
  plan.layer_tokens.assign(info.layer_tokens().begin(), info.layer_tokens().end());
  if (plan.layer_tokens.size() != static_cast<size_t>(g.layers)) {
    return absl::InternalError(
        absl::StrFormat("the server told %d layers' tokens for session %s, "
                        "which has %d layers",
                        plan.layer_tokens.size(), id, g.layers));
  }
  const auto [shortest, longest] =
      std::minmax_element(plan.layer_tokens.begin(), plan.layer_tokens.end());
  if (*longest - *shortest > 1) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "session %s's layers hold from %d to %d tokens: more than one token apart, which "
        "no sequence of whole steps leaves",
        id, *shortest, *longest));
  }
  if (g.decode_steps == 0) {
    return absl::OutOfRangeError(
        absl::StrFormat("%s has no decode steps: nothing to send", trace.file().label()));
  }
  plan.first_step = *shortest - g.context;
  const int64_t left = g.decode_steps - plan.first_step;
  if (left <= 0) {
    return absl::OutOfRangeError(absl::StrFormat(
        "session %s holds all %d decode steps of %s (%d tokens): nothing left to send", id,
        g.decode_steps, trace.file().label(), *shortest));
  }
  plan.steps = steps == -1 ? left : steps;
  if (plan.steps > left) {
    return absl::OutOfRangeError(absl::StrFormat(
        "--steps %d, but session %s stands at decode step %d of the %d of %s: %d left", steps, id,
        plan.first_step, g.decode_steps, trace.file().label(), left));
  }
  return plan;
}

// One layer-step as a human reads it: times, then (when the server sent them) the heads' paths
// and means, then their fidelity.
std::string LayerStepLine(int64_t step, int64_t position, int layer, double latency_us,
                          const v1::DecodeResponse& response, bool compare_exact) {
  std::string line = absl::StrFormat(
      "step %d (position %d) layer %d: server %.0f us, round trip "
      "%.0f us",
      step, position, layer, response.server_micros(), latency_us);
  const auto& heads = response.results(0).heads();
  if (heads.empty()) return line;
  int paths[5] = {};
  double candidates = 0, support = 0, cosine = 0, cosine_min = 1, recall = 0, mass = 0;
  for (const v1::HeadDiagnostics& head : heads) {
    ++paths[std::clamp(static_cast<int>(head.path()), 0, 4)];
    candidates += head.candidates();
    support += head.support();
    cosine += head.output_cosine();
    cosine_min = std::min<double>(cosine_min, head.output_cosine());
    recall += head.support_recall();
    mass += head.retained_mass();
  }
  const double n = heads.size();
  std::vector<std::string> mix;
  for (int p = 0; p < 5; ++p) {
    if (paths[p] > 0)
      mix.push_back(absl::StrCat(client::PathName(static_cast<v1::Path>(p)), " ", paths[p]));
  }
  absl::StrAppendFormat(&line, "; paths %s; per head %.1f candidates, %.1f support",
                        absl::StrJoin(mix, ", "), candidates / n, support / n);
  if (compare_exact) {
    absl::StrAppendFormat(&line,
                          "; output cosine %.5f (min %.5f), support recall %.3f, retained mass "
                          "%.3f",
                          cosine / n, cosine_min, recall / n, mass / n);
  }
  return line;
}

}  // namespace

int RunDecode(const std::vector<char*>& args) {
  if (args.size() != 1) {
    return UsageError("decode", "usage: kvrecall decode SESSION_ID --trace FILE [--steps N]");
  }
  const std::string path = absl::GetFlag(FLAGS_trace);
  if (path.empty()) return UsageError("decode", "--trace FILE is required");
  const int64_t steps_flag = absl::GetFlag(FLAGS_steps);
  if (steps_flag == 0 || steps_flag < -1) {
    return UsageError("decode", absl::StrCat("--steps must be >= 1 (or -1: the rest of the "
                                             "trace's), got ",
                                             steps_flag));
  }
  const bool json = absl::GetFlag(FLAGS_json);
  const bool outputs = absl::GetFlag(FLAGS_outputs);
  client::StepOptions step_options;
  step_options.compare_exact = absl::GetFlag(FLAGS_compare_exact);
  step_options.diagnostics = step_options.compare_exact || absl::GetFlag(FLAGS_diagnostics);

  absl::StatusOr<TraceSession> opened = OpenTraceSession(path, args[0]);
  if (!opened.ok()) return ReportError("decode", opened.status());
  const Trace& trace = opened->trace;
  const v1::SessionInfo& info = opened->info;
  absl::StatusOr<DecodePlan> plan = PlanDecode(info, trace, steps_flag);
  if (!plan.ok()) return ReportError("decode", plan.status());

  absl::StatusOr<std::unique_ptr<client::DecodeStream>> stream =
      opened->client->OpenDecodeStream(info.geometry(), ReplayOptionsFromFlags().decode);
  if (!stream.ok()) return ReportError("decode", stream.status());
  const TraceGeometry& g = trace.geometry();
  const int d = g.head_dim;
  std::vector<float> q(static_cast<size_t>(g.q_heads) * d);
  std::vector<float> k(static_cast<size_t>(g.kv_heads) * d), v(k.size());
  const bool tiered = info.policy().placement() == v1::PLACEMENT_TIERED;
  client::StepResult result;
  int64_t sent = 0;
  for (int64_t t = plan->first_step; t < plan->first_step + plan->steps; ++t) {
    const int64_t position = g.context + t;
    for (int l = 0; l < g.layers; ++l) {
      // A layer that took this token already (a step cut short in some layers) goes on with
      // the next.
      if (plan->layer_tokens[l] > position) continue;
      for (auto [which, dest] :
           {std::pair{TraceTensor::kQ, q.data()}, std::pair{TraceTensor::kK, k.data()},
            std::pair{TraceTensor::kV, v.data()}}) {
        if (absl::Status s = trace.ReadRows(l, TracePhase::kDecode, which, t, 1, dest); !s.ok()) {
          return ReportError("decode", s);
        }
      }
      const client::SequenceInput input{info.session_id(), q, k, v, position};
      const auto start = std::chrono::steady_clock::now();
      if (absl::Status s = (*stream)->Step(l, {&input, 1}, step_options, &result); !s.ok()) {
        return ReportError("decode", s);
      }
      const double latency_us =
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start)
              .count();
      ++sent;
      const v1::DecodeResponse& response = *result.response;
      if (json) {
        nlohmann::ordered_json j;
        j["step"] = t;
        j["position"] = position;
        j["layer"] = l;
        j["server_micros"] = response.server_micros();
        j["latency_us"] = latency_us;
        if (tiered) {
          j["tier_micros"] =
              nlohmann::ordered_json::parse(MessageJson(response.tier_micros(), false));
        }
        if (step_options.diagnostics) {
          j["heads"] = nlohmann::json::array();
          for (const v1::HeadDiagnostics& head : response.results(0).heads()) {
            nlohmann::ordered_json h = nlohmann::ordered_json::parse(MessageJson(head, false));
            // Only what the server measured: the fidelity with compare_exact, the bulk's times
            // on the tiered placement (the rest would read as zeros measured).
            if (!step_options.compare_exact) {
              for (const char* key :
                   {"support_recall", "retained_mass", "output_cosine", "rel_l2"}) {
                h.erase(key);
              }
            }
            if (!tiered) {
              for (const char* key : {"bulk_micros", "bulk_start_micros"}) h.erase(key);
            }
            j["heads"].push_back(std::move(h));
          }
        }
        if (outputs) {
          j["output"] = nlohmann::json::array();
          for (int h = 0; h < g.q_heads; ++h) {
            j["output"].push_back(std::vector<float>(result.output.begin() + h * d,
                                                     result.output.begin() + (h + 1) * d));
          }
        }
        std::printf("%s\n", j.dump().c_str());
      } else {
        std::printf("%s\n",
                    LayerStepLine(t, position, l, latency_us, response, step_options.compare_exact)
                        .c_str());
        for (int h = 0; outputs && h < g.q_heads; ++h) {
          std::vector<std::string> row;
          for (int i = 0; i < d; ++i)
            row.push_back(absl::StrFormat("%.6g", result.output[h * d + i]));
          std::printf("  head %d: %s\n", h, absl::StrJoin(row, " ").c_str());
        }
      }
    }
  }
  if (absl::Status s = (*stream)->Close(); !s.ok()) return ReportError("decode", s);
  if (!json) {
    const int64_t next = plan->first_step + plan->steps;
    std::printf(
        "%s: %lld layer-steps sent; its layers hold %lld tokens (%lld of the %lld decode "
        "steps of %s)\n",
        info.session_id().c_str(), static_cast<long long>(sent),
        static_cast<long long>(g.context + next), static_cast<long long>(next),
        static_cast<long long>(g.decode_steps), trace.file().label().c_str());
  }
  return 0;
}

}  // namespace kvrecall::cli
