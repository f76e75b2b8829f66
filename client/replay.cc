#include "client/replay.h"

#include <chrono>
#include <cmath>
#include <optional>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/stats.h"
#include "kernels/cpu/attention.h"
#include "kernels/fidelity.h"
#include "kernels/kv_view.h"

namespace kvrecall::client {
namespace {

using Clock = std::chrono::steady_clock;

double MicrosSince(Clock::time_point start) {
  return std::chrono::duration<double, std::micro>(Clock::now() - start).count();
}

Quantiles QuantilesOf(const std::vector<double>& samples) {
  return {Percentile(samples, 0.50), Percentile(samples, 0.99)};
}

}  // namespace

absl::Status CheckTraceGeometry(const Trace& trace, absl::string_view session_id,
                                const v1::Geometry& geometry) {
  const TraceGeometry& g = trace.geometry();
  if (g.layers == geometry.layers() && g.q_heads == geometry.q_heads() &&
      g.kv_heads == geometry.kv_heads() && g.head_dim == geometry.head_dim()) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrFormat(
      "%s has %d layers, %d query heads, %d KV heads and head_dim %d; session %s has %d, %d, %d "
      "and %d",
      trace.file().label(), g.layers, g.q_heads, g.kv_heads, g.head_dim, session_id,
      geometry.layers(), geometry.q_heads(), geometry.kv_heads(), geometry.head_dim()));
}

absl::StatusOr<v1::PrefillResponse> PrefillFromTrace(Client& client, const SessionHandle& session,
                                                     const Trace& trace,
                                                     const PrefillOptions& options,
                                                     std::vector<LayerKv>* kv) {
  if (absl::Status s = CheckTraceGeometry(trace, session.id, session.geometry); !s.ok()) return s;
  const TraceGeometry& g = trace.geometry();
  const size_t kv_prompt = static_cast<size_t>(g.context) * g.kv_heads * g.head_dim;
  if (kv != nullptr) {
    bool fits = kv->size() == static_cast<size_t>(g.layers);
    for (const LayerKv& layer : *kv) {
      fits = fits && layer.keys.size() >= kv_prompt && layer.values.size() >= kv_prompt;
    }
    if (!fits) {
      return absl::InvalidArgumentError(
          absl::StrCat("PrefillFromTrace: kv must hold ", g.layers, " layers of at least ",
                       kv_prompt, " keys and values each"));
    }
  }
  absl::StatusOr<std::unique_ptr<PrefillStream>> stream = client.StartPrefill(session, options);
  if (!stream.ok()) return stream.status();
  LayerKv scratch;  // each layer's prompt in turn, when the caller keeps none
  for (int l = 0; l < g.layers; ++l) {
    absl::StatusOr<std::vector<float>> q = trace.Read(l, TracePhase::kPrefill, TraceTensor::kQ);
    if (!q.ok()) return q.status();
    LayerKv& layer = kv != nullptr ? (*kv)[l] : scratch;
    for (auto [which, dest] :
         {std::pair{TraceTensor::kK, &layer.keys}, std::pair{TraceTensor::kV, &layer.values}}) {
      if (dest->size() < kv_prompt) dest->resize(kv_prompt);
      if (absl::Status s =
              trace.ReadRows(l, TracePhase::kPrefill, which, 0, g.context, dest->data());
          !s.ok()) {
        return s;
      }
    }
    if (absl::Status s = (*stream)->SendLayer(l, *q, std::span(layer.keys).first(kv_prompt),
                                              std::span(layer.values).first(kv_prompt));
        !s.ok()) {
      return s;
    }
  }
  return (*stream)->Finish();
}

absl::StatusOr<ReplayReport> Replay(Client& client, const Trace& trace,
                                    const ReplayOptions& options) {
  const TraceGeometry& g = trace.geometry();
  if (options.steps < -1) {
    return absl::InvalidArgumentError(
        absl::StrCat("steps must be >= 1 (or -1: all of the trace's), got ", options.steps));
  }
  const int64_t steps = options.steps == -1 ? g.decode_steps : options.steps;
  if (steps > g.decode_steps) {
    return absl::InvalidArgumentError(absl::StrCat("steps (", steps, ") exceeds the ",
                                                   g.decode_steps, " decode steps of ",
                                                   trace.file().label()));
  }
  // Every figure of the report is a mean or quantile over the steps: none is nothing measured,
  // not a fidelity of 0.
  if (steps == 0) {
    return absl::InvalidArgumentError(
        options.steps == 0
            ? std::string("nothing to replay: steps is 0")
            : absl::StrCat("nothing to replay: ", trace.file().label(), " has no decode steps"));
  }
  v1::Geometry geometry;
  geometry.set_layers(g.layers);
  geometry.set_q_heads(g.q_heads);
  geometry.set_kv_heads(g.kv_heads);
  geometry.set_head_dim(g.head_dim);
  geometry.set_dtype(g.dtype);
  const float scale = 1.0f / std::sqrt(static_cast<float>(g.head_dim));

  // Two sessions with the same policy get the same inputs: `probe` answers with compare_exact
  // diagnostics (whose full-attention pass would inflate the server's time), `timed` answers
  // plainly and gives the latency figures.
  absl::StatusOr<SessionHandle> probe =
      client.CreateSession(geometry, options.policy, absl::StrCat(options.label, " (probe)"));
  if (!probe.ok()) return probe.status();
  absl::Cleanup close_probe = [&] { client.CloseSession(probe->id).IgnoreError(); };
  absl::StatusOr<SessionHandle> timed =
      client.CreateSession(geometry, options.policy, absl::StrCat(options.label, " (timed)"));
  if (!timed.ok()) return timed.status();
  absl::Cleanup close_timed = [&] { client.CloseSession(timed->id).IgnoreError(); };

  ReplayReport report;
  report.trace = trace.file().label();
  report.policy = probe->policy;
  report.geometry = g;
  report.steps = steps;
  report.layer_steps = steps * g.layers;

  const int64_t kv_row = int64_t{g.kv_heads} * g.head_dim;
  std::vector<LayerKv> kv(g.layers);
  for (LayerKv& layer : kv) {
    layer.keys.resize((g.context + steps) * kv_row);
    layer.values.resize((g.context + steps) * kv_row);
  }
  const Clock::time_point prefill_start = Clock::now();
  for (const SessionHandle* session : {&*probe, &*timed}) {
    absl::StatusOr<v1::PrefillResponse> prefilled =
        PrefillFromTrace(client, *session, trace, options.prefill, &kv);
    if (!prefilled.ok()) return prefilled.status();
    if (session == &*probe) {
      report.prefill_seconds = MicrosSince(prefill_start) * 1e-6;
      report.prefill_build_seconds = prefilled->build_seconds();
    }
  }

  absl::StatusOr<std::unique_ptr<DecodeStream>> stream =
      client.OpenDecodeStream(geometry, options.decode);
  if (!stream.ok()) return stream.status();
  const int d = g.head_dim;
  std::vector<float> q(static_cast<size_t>(g.q_heads) * d);
  std::vector<float> reference(q.size());
  StepResult timed_result, probe_result;
  const StepOptions timed_options;
  StepOptions probe_options;
  probe_options.diagnostics = true;
  probe_options.compare_exact = true;

  const size_t layer_steps = static_cast<size_t>(report.layer_steps);
  const size_t head_steps = layer_steps * g.q_heads;
  std::vector<double> latency_us, server_us, cosines;
  latency_us.reserve(layer_steps);
  server_us.reserve(layer_steps);
  cosines.reserve(head_steps);
  double rel_l2 = 0, recall = 0, mass = 0, candidates = 0, support = 0, server_cosine = 0;
  int64_t reuse = 0, fallback = 0, refresh = 0;

  for (int64_t t = 0; t < steps; ++t) {
    const int64_t row = g.context + t;
    for (int l = 0; l < g.layers; ++l) {
      float* k_new = kv[l].keys.data() + row * kv_row;
      float* v_new = kv[l].values.data() + row * kv_row;
      for (auto [which, dest] :
           {std::pair{TraceTensor::kQ, q.data()}, std::pair{TraceTensor::kK, k_new},
            std::pair{TraceTensor::kV, v_new}}) {
        if (absl::Status s = trace.ReadRows(l, TracePhase::kDecode, which, t, 1, dest); !s.ok()) {
          return s;
        }
      }
      const std::span<const float> k_span(k_new, kv_row), v_span(v_new, kv_row);
      // Each token's position said, so that a session out of step with the trace is refused
      // instead of measured.
      const SequenceInput timed_input{timed->id, q, k_span, v_span, row};
      const SequenceInput probe_input{probe->id, q, k_span, v_span, row};

      const Clock::time_point start = Clock::now();
      if (absl::Status s = (*stream)->Step(l, {&timed_input, 1}, timed_options, &timed_result);
          !s.ok()) {
        return s;
      }
      latency_us.push_back(MicrosSince(start));
      server_us.push_back(timed_result.response->server_micros());
      if (absl::Status s = (*stream)->Step(l, {&probe_input, 1}, probe_options, &probe_result);
          !s.ok()) {
        return s;
      }

      // Full attention over the trace's own context, one head at a time on this thread.
      const KvView view{kv[l].keys.data(), kv[l].values.data(), row + 1, g.kv_heads, d};
      const auto& heads = probe_result.response->results(0).heads();
      if (heads.size() != g.q_heads) {
        return absl::InternalError(absl::StrCat("the server returned ", heads.size(),
                                                " head diagnostics, want ", g.q_heads));
      }
      for (int h = 0; h < g.q_heads; ++h) {
        float lse;
        cpu::PartialAttentionRange(q.data() + h * d, view, KvHeadOf(h, g.q_heads, g.kv_heads), 0,
                                   view.tokens, scale, reference.data() + h * d, &lse);
        const float* o = probe_result.output.data() + h * d;
        cosines.push_back(OutputCosine(o, reference.data() + h * d, d));
        rel_l2 += RelativeL2(o, reference.data() + h * d, d);
        const v1::HeadDiagnostics& head = heads[h];
        recall += head.support_recall();
        mass += head.retained_mass();
        candidates += head.candidates();
        support += head.support();
        server_cosine += head.output_cosine();
        reuse += head.path() == v1::PATH_REUSE;
        fallback += head.path() == v1::PATH_FALLBACK;
        refresh += head.path() == v1::PATH_REFRESH;
      }
    }
    if (options.step_progress) options.step_progress(t + 1, steps);
  }
  if (absl::Status s = (*stream)->Close(); !s.ok()) return s;

  const double n = head_steps > 0 ? static_cast<double>(head_steps) : 1.0;
  report.support_recall = recall / n;
  report.retained_mass = mass / n;
  report.mean_candidates = candidates / n;
  report.mean_support = support / n;
  report.reuse = reuse / n;
  report.fallback = fallback / n;
  report.refresh = refresh / n;
  report.output_cosine = Mean(cosines);
  report.output_cosine_p05 = Percentile(cosines, 0.05);
  report.output_cosine_min = Percentile(cosines, 0.0);
  report.rel_l2 = rel_l2 / n;
  report.server_output_cosine = server_cosine / n;
  report.latency_us = QuantilesOf(latency_us);
  report.server_us = QuantilesOf(server_us);
  return report;
}

nlohmann::ordered_json ReplayReportJson(const ReplayReport& r) {
  const TraceGeometry& g = r.geometry;
  nlohmann::ordered_json j;
  j["policy"] = SelectorName(r.policy.selector());
  j["placement"] = PlacementName(r.policy.placement());
  j["top_k"] = r.policy.top_k();
  j["sinks"] = r.policy.sinks();
  j["recent"] = r.policy.recent();
  if (r.policy.selector() == v1::SELECTOR_RETOPK) {
    const v1::ReTopKParams& p = r.policy.retopk();
    j["retopk"] = {{"C", p.cache_capacity()},
                   {"R", p.reuse_neighbors()},
                   {"W", p.recent_window()},
                   {"tau", p.tau()},
                   {"refresh", p.refresh_interval()},
                   {"auto_tau", p.auto_tau()},
                   {"target_recall", p.target_recall()},
                   {"exact_flat_scan", p.exact_flat_scan()}};
  }
  j["trace"] = r.trace;
  j["dtype"] = DTypeLowerName(g.dtype);
  j["layers"] = g.layers;
  j["q_heads"] = g.q_heads;
  j["kv_heads"] = g.kv_heads;
  j["head_dim"] = g.head_dim;
  j["context"] = g.context;
  j["steps"] = r.steps;
  j["layer_steps"] = r.layer_steps;
  j["support_recall"] = r.support_recall;
  j["retained_mass"] = r.retained_mass;
  j["output_cosine"] = r.output_cosine;
  j["output_cosine_p05"] = r.output_cosine_p05;
  j["output_cosine_min"] = r.output_cosine_min;
  j["rel_l2"] = r.rel_l2;
  j["server_output_cosine"] = r.server_output_cosine;
  j["path_mix"] = {{"reuse", r.reuse}, {"fallback", r.fallback}, {"refresh", r.refresh}};
  j["mean_candidates"] = r.mean_candidates;
  j["mean_support"] = r.mean_support;
  j["latency_us"] = {{"p50", r.latency_us.p50}, {"p99", r.latency_us.p99}};
  j["server_us"] = {{"p50", r.server_us.p50}, {"p99", r.server_us.p99}};
  j["prefill_seconds"] = r.prefill_seconds;
  j["prefill_build_seconds"] = r.prefill_build_seconds;
  return j;
}

}  // namespace kvrecall::client
