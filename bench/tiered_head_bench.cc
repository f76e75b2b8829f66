// Where a tiered layer-step's per-head host (bulk) time goes (issue 15): one layer of a
// SyntheticTrace (Llama-3-8B geometry by default) held as the tiered placement holds it (bf16
// host KV; the bulk [sinks, T - recent) behind ReTopK whose exact path is the graph index over
// the bulk), replayed in-process step by step.
//
// Each step runs two passes over the 32 query heads, alternating which goes first so that each
// is measured cold (its rows not yet touched this step) on half the steps:
//  * "step": what TieredLayer::AttendBulkHead does, heads on --threads threads of the compute
//    pool (cpu::ParallelFor, as TieredBackend::StepRun): ReTopKSelector::Select then
//    cpu::PartialAttentionScored; per head and for the whole team, plus an empty loop of one
//    item per thread (the pool's hand-out and join alone). This pass advances the selector's
//    state.
//  * "phases": on one thread, every head through both paths' parts with the public pieces of
//    the selector, timed apart: the match (normalize, cosines with the cache, the R nearest
//    entries), the union of their supports (UnionReuseCandidates), candidate scoring
//    (cpu::ScoreTokens: ns per key), the top-K (cpu::TopKPositions), the graph search of the exact
//    path (IndexSelector::Select over the bulk: ns per scored key) and the partial attention
//    over its support (cpu::PartialAttentionScored). Nothing here changes the ReTopK caches; the
//    exact path's search records the query for linking, as the step's does.
// The step's token leaves the ring into the bulk after both passes (OnAppend, untimed).
//
// Prints one JSON object: percentiles (p50, p90, mean) of every figure, the path mix.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "client/trace/synthetic.h"
#include "index/basic_selectors.h"
#include "index/batch_topk.h"
#include "index/index_selector.h"
#include "index/retopk.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/thread_pool.h"
#include "bench/percentiles.h"
#include "bench/synthetic_layer.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(double, tau, 0.85, "ReTopK tau (fixed)");
ABSL_FLAG(int, threads, 0,
          "the step pass's threads of the compute pool (0: omp_get_max_threads())");
ABSL_FLAG(int, search_width, 1, "the graph search's candidates expanded per round (policy.index)");

namespace kvrecall {
namespace {

using Clock = std::chrono::steady_clock;

double MicrosSince(Clock::time_point start) {
  return std::chrono::duration<double, std::micro>(Clock::now() - start).count();
}

// The figures of a run, each a list of samples (microseconds unless named otherwise).
struct Samples {
  std::vector<double> step_head_us, step_reuse_head_us, step_exact_head_us, step_team_us,
      step_fork_join_us, step_head_sum_us;
  std::vector<double> match_us, union_us, score_us, score_ns_per_key, topk_us, reuse_attend_us,
      reuse_keys, search_us, search_ns_per_key, search_keys, exact_attend_us, reuse_total_us,
      exact_total_us;
};

absl::Status Run() {
  const bench::LayerFlags flags = bench::LayerFromFlags();
  const SyntheticTraceParams& params = flags.trace;
  const int64_t t = params.context;
  const int steps = flags.steps, warmup = flags.warmup, total_steps = params.decode_steps;
  absl::StatusOr<SyntheticTrace> trace = SyntheticTrace::Create(params);
  if (!trace.ok()) return trace.status();
  const int d = params.head_dim, q_heads = params.q_heads, kv_heads = params.kv_heads;
  const int64_t q_row = int64_t{q_heads} * d;

  const auto generate_start = Clock::now();
  const bench::SyntheticLayer layer(*std::move(trace));
  const std::vector<float>& decode_q = layer.decode_q;
  const std::vector<float> prompt_q = layer.PromptQueries();
  const double generate_s = MicrosSince(generate_start) / 1e6;

  // The tiered placement's bulk selector (server/backends/tiered_backend.cc, MakeBulkSelector).
  SelectorParams p;
  p.kind = SelectorKind::kReTopK;
  p.top_k = flags.k;
  p.sinks = flags.sinks;
  p.recent = flags.recent;
  p.retopk.tau = static_cast<float>(absl::GetFlag(FLAGS_tau));
  p.index.search_width = absl::GetFlag(FLAGS_search_width);
  const LayerShape shape{q_heads, kv_heads, d, 1.0f / std::sqrt(static_cast<float>(d))};
  SelectorParams graph = p;
  graph.kind = SelectorKind::kIndex;
  graph.sinks = 0;
  graph.recent = 0;
  // As the tiered placement builds it: the queries see `recent` rows past their own.
  auto exact = std::make_unique<IndexSelector>(shape, graph, /*bulk_only=*/true,
                                               BatchTopKFunction(CpuBatchTopK), p.recent);
  IndexSelector* search = exact.get();
  ReTopKSelector selector(shape, p.top_k, p.retopk, p.recent);
  selector.set_exact_search(std::move(exact));

  const KvView store = layer.store();
  auto bulk_of = [&](int64_t tokens) {
    return store.Tokens(std::min<int64_t>(p.sinks, tokens), BulkTokens(tokens, p.sinks, p.recent));
  };
  const auto build_start = Clock::now();
  if (absl::Status s = selector.Build(bulk_of(t), prompt_q.data() + (int64_t{p.sinks} + p.recent) * q_row);
      !s.ok()) {
    return s;
  }
  const double build_s = MicrosSince(build_start) / 1e6;

  const int threads =
      absl::GetFlag(FLAGS_threads) > 0 ? absl::GetFlag(FLAGS_threads) : omp_get_max_threads();
  Samples samples;
  std::vector<HeadSelection> selections(q_heads);
  std::vector<float> o(q_row), lse(q_heads), head_us(q_heads);
  int64_t reuse_heads = 0, exact_heads = 0;
  // Per-thread scratch of the phases pass.
  std::vector<float> unit(d), cosines(p.retopk.cache_capacity), scores, support_scores;
  std::vector<int32_t> neighbors, candidates, positions, support;
  HeadSelection exact_selection;

  auto step_pass = [&](const KvView& bulk, const float* q, bool record) {
    const auto team_start = Clock::now();
    cpu::ParallelFor(q_heads, threads, [&](int64_t head) {
      const int h = static_cast<int>(head);
      const auto start = Clock::now();
      HeadSelection& sel = selections[h];
      selector.Select(h, q + int64_t{h} * d, bulk, &sel);
      const int kv_head = KvHeadOf(h, q_heads, kv_heads);
      if (sel.support_scores.size() == sel.support.size()) {
        cpu::PartialAttentionScored(sel.support_scores, bulk, kv_head, sel.support,
                                    o.data() + int64_t{h} * d, &lse[h]);
      } else {
        cpu::PartialAttention(q + int64_t{h} * d, bulk, kv_head, sel.support, shape.scale,
                              o.data() + int64_t{h} * d, &lse[h]);
      }
      head_us[h] = MicrosSince(start);
    });
    const double team = MicrosSince(team_start);
    const auto fork_start = Clock::now();
    cpu::ParallelFor(threads, threads, [](int64_t) { asm volatile("" ::: "memory"); });
    const double fork_join = MicrosSince(fork_start);
    if (!record) return;
    samples.step_team_us.push_back(team);
    samples.step_fork_join_us.push_back(fork_join);
    double sum = 0;
    for (int h = 0; h < q_heads; ++h) {
      sum += head_us[h];
      samples.step_head_us.push_back(head_us[h]);
      if (selections[h].path == SelectionPath::kReuse) {
        ++reuse_heads;
        samples.step_reuse_head_us.push_back(head_us[h]);
      } else {
        ++exact_heads;
        samples.step_exact_head_us.push_back(head_us[h]);
      }
    }
    samples.step_head_sum_us.push_back(sum);
  };

  auto phases_pass = [&](const KvView& bulk, const float* q_step, bool record) {
    for (int h = 0; h < q_heads; ++h) {
      const float* q = q_step + int64_t{h} * d;
      const int kv_head = KvHeadOf(h, q_heads, kv_heads);
      const QuerySupportCache& cache = selector.head(h).cache();
      // The reuse path, whatever the head's real path is.
      auto start = Clock::now();
      cpu::Normalize(q, d, unit.data());
      cache.Cosines(unit.data(), cosines.data());
      cpu::TopKPositions(std::span<const float>(cosines.data(), cache.size()),
                         p.retopk.reuse_neighbors, &neighbors);
      const double match = MicrosSince(start);
      start = Clock::now();
      UnionReuseCandidates(cache, neighbors, bulk.tokens, p.retopk.recent_window, &candidates);
      const double union_us = MicrosSince(start);
      start = Clock::now();
      scores.resize(candidates.size());
      cpu::ScoreTokens(q, bulk, kv_head, candidates, shape.scale, scores.data());
      const double score = MicrosSince(start);
      start = Clock::now();
      cpu::TopKPositions(scores, p.top_k, &positions);
      support.resize(positions.size());
      support_scores.resize(positions.size());
      for (size_t i = 0; i < positions.size(); ++i) {
        support[i] = candidates[positions[i]];
        support_scores[i] = scores[positions[i]];
      }
      const double topk = MicrosSince(start);
      start = Clock::now();
      cpu::PartialAttentionScored(support_scores, bulk, kv_head, support, o.data(), &lse[0]);
      const double reuse_attend = MicrosSince(start);
      // The exact path: the graph search over the bulk and the attention over its support.
      start = Clock::now();
      search->Select(h, q, bulk, &exact_selection);
      const double search_us = MicrosSince(start);
      start = Clock::now();
      cpu::PartialAttentionScored(exact_selection.support_scores, bulk, kv_head,
                                  exact_selection.support, o.data(), &lse[0]);
      const double exact_attend = MicrosSince(start);
      if (!record) continue;
      samples.match_us.push_back(match);
      samples.union_us.push_back(union_us);
      samples.score_us.push_back(score);
      samples.reuse_keys.push_back(static_cast<double>(candidates.size()));
      samples.score_ns_per_key.push_back(1e3 * score / std::max<size_t>(1, candidates.size()));
      samples.topk_us.push_back(topk);
      samples.reuse_attend_us.push_back(reuse_attend);
      samples.reuse_total_us.push_back(match + union_us + score + topk + reuse_attend);
      samples.search_us.push_back(search_us);
      samples.search_keys.push_back(exact_selection.candidates);
      samples.search_ns_per_key.push_back(1e3 * search_us /
                                          std::max(1, exact_selection.candidates));
      samples.exact_attend_us.push_back(exact_attend);
      samples.exact_total_us.push_back(search_us + exact_attend);
    }
  };

  for (int s = 0; s < total_steps; ++s) {
    const int64_t tokens = t + s + 1;  // the step's token included
    const KvView bulk = bulk_of(tokens);
    const float* q = decode_q.data() + int64_t{s} * q_row;
    const bool record = s >= warmup;
    // Each pass is cold (first to touch its rows this step) on every other step; only its cold
    // steps are recorded.
    if (s % 2 == 0) {
      step_pass(bulk, q, record);
      phases_pass(bulk, q, false);
    } else {
      phases_pass(bulk, q, record);
      step_pass(bulk, q, false);
    }
    // The step's token pushes the ring's oldest into the bulk.
    if (BulkTokens(tokens, p.sinks, p.recent) > BulkTokens(tokens - 1, p.sinks, p.recent)) {
      selector.OnAppend(bulk);
    }
  }

  nlohmann::json out = {
      {"context", t}, {"steps", steps}, {"threads", threads}, {"k", p.top_k},
      {"tau", p.retopk.tau}, {"search_width", p.index.search_width}, {"generate_s", generate_s}, {"build_s", build_s},
      {"reuse_fraction", static_cast<double>(reuse_heads) / std::max<int64_t>(1, reuse_heads + exact_heads)}};
  auto put = [&](const char* name, const std::vector<double>& v) { out[name] = Percentiles(v); };
  put("step_team_us", samples.step_team_us);
  put("step_fork_join_us", samples.step_fork_join_us);
  put("step_head_sum_us", samples.step_head_sum_us);
  put("step_head_us", samples.step_head_us);
  put("step_reuse_head_us", samples.step_reuse_head_us);
  put("step_exact_head_us", samples.step_exact_head_us);
  put("reuse_match_us", samples.match_us);
  put("reuse_union_us", samples.union_us);
  put("reuse_keys", samples.reuse_keys);
  put("reuse_score_us", samples.score_us);
  put("reuse_score_ns_per_key", samples.score_ns_per_key);
  put("reuse_topk_us", samples.topk_us);
  put("reuse_attend_us", samples.reuse_attend_us);
  put("reuse_total_us", samples.reuse_total_us);
  put("exact_search_us", samples.search_us);
  put("exact_search_keys", samples.search_keys);
  put("exact_search_ns_per_key", samples.search_ns_per_key);
  put("exact_attend_us", samples.exact_attend_us);
  put("exact_total_us", samples.exact_total_us);
  std::printf("%s\n", out.dump().c_str());
  return absl::OkStatus();
}

}  // namespace
}  // namespace kvrecall

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  if (absl::Status s = kvrecall::Run(); !s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
