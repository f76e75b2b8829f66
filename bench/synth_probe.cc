#include "bench/synth_probe.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "index/basic_selectors.h"
#include "index/retopk.h"
#include "kernels/cpu/attention.h"
#include "kernels/dtype.h"
#include "kernels/fidelity.h"

namespace kvrecall {
namespace {

// Running sums of one head's figures; Mean() divides each by its own count.
struct HeadSums {
  double q_cos1 = 0, q_cos8 = 0, best_prompt = 0, best_decode = 0, best_cache = 0;
  double pass_prompt = 0, pass_cache = 0, rotary_share = 0;
  double paths[kSelectionPaths] = {};
  double recall = 0, weighted_recall = 0, reuse_recall = 0, topk_keep = 0;
  int64_t steps = 0, cos1_n = 0, cos8_n = 0, decode_n = 0, keep_n = 0;
};

double Cosine(const float* a, const float* b, int n) {
  double ab = 0, aa = 0, bb = 0;
  for (int i = 0; i < n; ++i) {
    ab += static_cast<double>(a[i]) * b[i];
    aa += static_cast<double>(a[i]) * a[i];
    bb += static_cast<double>(b[i]) * b[i];
  }
  return aa > 0 && bb > 0 ? ab / std::sqrt(aa * bb) : 0.0;
}

// The best cosine of q with rows [begin, end) of `rows` (stride floats apart), -1 if none.
double BestCosine(const float* q, const float* rows, int64_t begin, int64_t end, int64_t stride,
                  int n) {
  double best = -1.0;
  for (int64_t r = begin; r < end; ++r) best = std::max(best, Cosine(q, rows + r * stride, n));
  return best;
}

}  // namespace

absl::StatusOr<SynthProbeReport> ProbeSyntheticTrace(const SyntheticTraceParams& params,
                                                     const SynthProbeOptions& options) {
  absl::StatusOr<SyntheticTrace> trace = SyntheticTrace::Create(params);
  if (!trace.ok()) return trace.status();
  return ProbeTrace(
      trace->geometry(), params.rotary_dims,
      [&](int layer, TracePhase phase, TraceTensor tensor, int64_t begin, int64_t rows,
          float* out) {
        trace->GenerateRows(layer, phase, tensor, begin, rows, out);
        return absl::OkStatus();
      },
      options);
}

absl::StatusOr<SynthProbeReport> ProbeTrace(const TraceGeometry& g, int rotary_dims,
                                            const TraceRowSource& source,
                                            const SynthProbeOptions& options) {
  const int C = options.retopk.cache_capacity;
  const int sinks = options.tiered ? options.tiered_sinks : 0;
  const int recent = options.tiered ? options.tiered_recent : 0;
  if (options.layer < 0 || options.layer >= g.layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("synth probe: layer ", options.layer, " outside [0, ", g.layers, ")"));
  }
  if (options.top_k < 1 || C < 1 || sinks < 0 || recent < 0) {
    return absl::InvalidArgumentError(
        "synth probe: top_k, cache_capacity >= 1 and tiered_sinks, tiered_recent >= 0 required");
  }
  const int64_t T = g.context;
  const int64_t N = g.decode_steps;
  if (BulkTokens(T, sinks, recent) <= C) {
    return absl::InvalidArgumentError(absl::StrCat(
        "synth probe: the selector's prompt (", BulkTokens(T, sinks, recent),
        " tokens) must be longer than the cache (", C, ")"));
  }
  const int d = g.head_dim;
  const int q_heads = g.q_heads;
  const int64_t q_row = static_cast<int64_t>(q_heads) * d;
  const int64_t kv_row = static_cast<int64_t>(g.kv_heads) * d;
  const int layer = options.layer;

  // Keys of the prompt and of every decode step; values are not needed (support and recall
  // depend on scores only).
  std::vector<float> keys((T + N) * kv_row);
  constexpr int64_t kChunk = 4096;
  for (int64_t begin = 0; begin < T; begin += kChunk) {
    if (absl::Status s = source(layer, TracePhase::kPrefill, TraceTensor::kK, begin,
                                std::min(kChunk, T - begin), keys.data() + begin * kv_row);
        !s.ok()) {
      return s;
    }
  }
  if (N > 0) {
    if (absl::Status s = source(layer, TracePhase::kDecode, TraceTensor::kK, 0, N,
                                keys.data() + T * kv_row);
        !s.ok()) {
      return s;
    }
  }
  // Prompt queries: only the rows ReTopK reads (seeding, auto_tau's replay and warm-up) are
  // generated; the buffer is left uninitialised so that the rest costs no memory.
  const int64_t needed =
      std::min<int64_t>(T, C + (options.retopk.auto_tau ? kCalibrationQueries : 0));
  std::unique_ptr<float[]> prompt_q(new float[T * q_row]);
  std::vector<float> decode_q(N * q_row);
  for (absl::Status s :
       {source(layer, TracePhase::kPrefill, TraceTensor::kQ, T - needed, needed,
               prompt_q.get() + (T - needed) * q_row),
        source(layer, TracePhase::kDecode, TraceTensor::kQ, 0, N, decode_q.data())}) {
    if (!s.ok()) return s;
  }

  if (options.bf16) {
    auto round = [](float* v, int64_t n) {
      for (int64_t i = 0; i < n; ++i) v[i] = Bf16ToFloat(FloatToBf16(v[i]));
    };
    round(keys.data(), static_cast<int64_t>(keys.size()));
    round(prompt_q.get() + (T - needed) * q_row, needed * q_row);
    round(decode_q.data(), static_cast<int64_t>(decode_q.size()));
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const LayerShape shape{q_heads, g.kv_heads, d, scale};
  ReTopKSelector selector(shape, options.top_k, options.retopk, /*query_lead=*/recent);
  const KvView prompt{keys.data(), nullptr, T, g.kv_heads, d};
  auto view_of = [&](const KvView& all) {
    return all.Tokens(std::min<int64_t>(sinks, all.tokens), BulkTokens(all.tokens, sinks, recent));
  };
  if (options.tiered) {
    // As the tiered placement does: the static set of the prompt query whose bulk view ends at
    // row `last_row` (the sinks and its own last `recent` tokens) counts as kept.
    selector.set_outside_lse([&](const float* q, int64_t last_row, int h) {
      return StaticSetLse(q, prompt, KvHeadOf(h, q_heads, g.kv_heads), scale,
                          last_row + sinks + recent + 1, sinks, recent);
    });
  }
  const KvView prompt_view = view_of(prompt);
  if (absl::Status s = selector.Build(prompt_view, prompt_q.get() + int64_t{sinks + recent} * q_row);
      !s.ok()) {
    return s;
  }
  selector.set_outside_lse(nullptr);

  std::vector<HeadSums> sums(q_heads);
  std::vector<std::vector<int32_t>> exact(q_heads), previous_exact(q_heads);
  std::vector<std::vector<uint8_t>> marks(q_heads);
  const int rotary = rotary_dims;
  for (int64_t s = 0; s < N; ++s) {
    const KvView all{keys.data(), nullptr, T + s + 1, g.kv_heads, d};
    const KvView view = view_of(all);
    selector.OnAppend(view);
#pragma omp parallel for schedule(dynamic, 1)
    for (int h = 0; h < q_heads; ++h) {
      HeadSums& sum = sums[h];
      const int kv_head = KvHeadOf(h, q_heads, g.kv_heads);
      const float* q = decode_q.data() + s * q_row + static_cast<int64_t>(h) * d;
      // Query statistics.
      if (s >= 1) {
        sum.q_cos1 += Cosine(q, q - q_row, d);
        ++sum.cos1_n;
        sum.best_decode += BestCosine(q, decode_q.data() + h * d, std::max<int64_t>(0, s - C), s,
                                      q_row, d);
        ++sum.decode_n;
      }
      if (s >= 8) {
        sum.q_cos8 += Cosine(q, q - 8 * q_row, d);
        ++sum.cos8_n;
      }
      const double best_prompt = BestCosine(q, prompt_q.get() + h * d, T - C, T, q_row, d);
      sum.best_prompt += best_prompt;
      sum.pass_prompt += best_prompt >= options.pass_cosine;
      double rotary_sq = 0, total_sq = 0;
      for (int i = 0; i < d; ++i) {
        total_sq += static_cast<double>(q[i]) * q[i];
        if (i < rotary) rotary_sq += static_cast<double>(q[i]) * q[i];
      }
      sum.rotary_share += total_sq > 0 ? rotary_sq / total_sq : 0.0;
      // The selector's step against the exact top-K of the same view.
      HeadSelection selection;
      selector.Select(h, q, view, &selection);
      sum.best_cache += selection.best_cosine;
      sum.pass_cache += selection.best_cosine >= options.pass_cosine;
      sum.paths[static_cast<int>(selection.path)] += 1;
      cpu::ExactTopK(q, view, kv_head, scale, options.top_k, &exact[h]);
      std::vector<float> exact_scores(exact[h].size());
      cpu::ScoreTokens(q, view, kv_head, exact[h], scale, exact_scores.data());
      const double recall = SupportRecall(selection.support, exact[h], view.tokens, &marks[h]);
      sum.recall += recall;
      sum.weighted_recall += WeightedSupportRecall(selection.support, exact[h], exact_scores,
                                                   view.tokens, &marks[h]);
      if (selection.path == SelectionPath::kReuse) sum.reuse_recall += recall;
      if (s >= 1 && !previous_exact[h].empty()) {
        sum.topk_keep += SupportRecall(previous_exact[h], exact[h], view.tokens, &marks[h]);
        ++sum.keep_n;
      }
      std::swap(previous_exact[h], exact[h]);
      ++sum.steps;
    }
  }

  SynthProbeReport report;
  auto ratio = [](double x, int64_t n) { return n > 0 ? x / static_cast<double>(n) : 0.0; };
  for (int h = 0; h < q_heads; ++h) {
    const HeadSums& sum = sums[h];
    SynthProbeHead head;
    head.q_head = h;
    head.tau = selector.head(h).tau();
    head.q_cos1 = ratio(sum.q_cos1, sum.cos1_n);
    head.q_cos8 = ratio(sum.q_cos8, sum.cos8_n);
    head.best_prompt = ratio(sum.best_prompt, sum.steps);
    head.best_decode = ratio(sum.best_decode, sum.decode_n);
    head.best_cache = ratio(sum.best_cache, sum.steps);
    head.pass_prompt = ratio(sum.pass_prompt, sum.steps);
    head.pass_cache = ratio(sum.pass_cache, sum.steps);
    head.rotary_share = ratio(sum.rotary_share, sum.steps);
    head.reuse = ratio(sum.paths[static_cast<int>(SelectionPath::kReuse)], sum.steps);
    head.fallback = ratio(sum.paths[static_cast<int>(SelectionPath::kFallback)], sum.steps);
    head.refresh = ratio(sum.paths[static_cast<int>(SelectionPath::kRefresh)], sum.steps);
    head.recall = ratio(sum.recall, sum.steps);
    head.weighted_recall = ratio(sum.weighted_recall, sum.steps);
    head.reuse_recall =
        ratio(sum.reuse_recall, static_cast<int64_t>(sum.paths[static_cast<int>(SelectionPath::kReuse)]));
    head.topk_keep = ratio(sum.topk_keep, sum.keep_n);
    report.heads.push_back(head);
  }
  SynthProbeHead& mean = report.mean;
  mean.q_head = -1;
  int finite_taus = 0;
  for (const SynthProbeHead& h : report.heads) {
    if (std::isfinite(h.tau)) mean.tau += h.tau, ++finite_taus;
  }
  // The mean of the finite taus (+inf: no head reuses at all).
  mean.tau = finite_taus > 0 ? mean.tau / finite_taus : std::numeric_limits<float>::infinity();
  for (const SynthProbeHead& h : report.heads) {
    const double w = 1.0 / q_heads;
    for (auto field : {&SynthProbeHead::q_cos1, &SynthProbeHead::q_cos8,
                       &SynthProbeHead::best_prompt, &SynthProbeHead::best_decode,
                       &SynthProbeHead::best_cache, &SynthProbeHead::pass_prompt,
                       &SynthProbeHead::pass_cache, &SynthProbeHead::rotary_share,
                       &SynthProbeHead::reuse, &SynthProbeHead::fallback, &SynthProbeHead::refresh,
                       &SynthProbeHead::recall, &SynthProbeHead::weighted_recall,
                       &SynthProbeHead::reuse_recall, &SynthProbeHead::topk_keep}) {
      mean.*field += w * h.*field;
    }
  }
  return report;
}

nlohmann::json SynthProbeHeadJson(const SynthProbeHead& h) {
  auto r3 = [](double x) { return std::round(x * 1000.0) / 1000.0; };
  return {{"q_head", h.q_head},
          {"tau", std::isfinite(h.tau) ? nlohmann::json(r3(h.tau)) : nlohmann::json("inf")},
          {"q_cos1", r3(h.q_cos1)},
          {"q_cos8", r3(h.q_cos8)},
          {"best_prompt", r3(h.best_prompt)},
          {"best_decode", r3(h.best_decode)},
          {"best_cache", r3(h.best_cache)},
          {"pass_prompt", r3(h.pass_prompt)},
          {"pass_cache", r3(h.pass_cache)},
          {"rotary_share", r3(h.rotary_share)},
          {"reuse", r3(h.reuse)},
          {"fallback", r3(h.fallback)},
          {"refresh", r3(h.refresh)},
          {"recall", r3(h.recall)},
          {"weighted_recall", r3(h.weighted_recall)},
          {"reuse_recall", r3(h.reuse_recall)},
          {"topk_keep", r3(h.topk_keep)}};
}

}  // namespace kvrecall
