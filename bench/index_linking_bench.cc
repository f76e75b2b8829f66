// Decode-step latency of the index policy while the bulk grows (issue 15): one layer of a trace
// replayed through IndexSelector as the CPU placement's layer step runs it (OnAppend, every
// head's Select in parallel, multi-head attention over the supports), once per --link_batches
// value in the same run, so that linking each step's token (link_batch 1) and linking the whole
// tail every link_threshold steps (link_batch = link_threshold, the batch linking before issue
// 15) are timed on the same machine, data and load.
//
// Per configuration it prints, as JSON lines: step time percentiles (p50, p90, p99, p99.9, max,
// mean; total, the OnAppend part, and the steps that linked keys and those that did not apart),
// the build time, the bulk recall@K of the index against an
// exact scan of the bulk (sampled every --recall_every steps, outside the timed step), the
// largest tail and the most keys one head's Add linked.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <tuple>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "client/trace/trace.h"
#include "index/index_selector.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/parallel.h"
#include "kernels/fidelity.h"
#include "bench/int_list.h"
#include "bench/percentiles.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, trace, "", "the trace (safetensors, DESIGN.md's replay format)");
ABSL_FLAG(int, layer, 0, "the trace layer to replay");
ABSL_FLAG(int, k, 512, "top K");
ABSL_FLAG(int, sinks, 128, "attention sinks");
ABSL_FLAG(int, recent, 512, "recent window");
ABSL_FLAG(int, build_queries, 0, "graph build queries (0: the default)");
ABSL_FLAG(int, link_threshold, 0, "graph link threshold (0: the default, 256)");
ABSL_FLAG(std::string, link_batches, "256,1",
          "link_batch values to run, in order (>= link_threshold: the old batch linking)");
ABSL_FLAG(int, steps, 0, "decode steps to replay (0: all of the trace's)");
ABSL_FLAG(int, recall_every, 8, "steps between recall samples");

namespace kvrecall {
namespace {

using Clock = std::chrono::steady_clock;

double MicrosSince(Clock::time_point start) {
  return std::chrono::duration<double, std::micro>(Clock::now() - start).count();
}

absl::Status Run() {
  absl::StatusOr<Trace> trace = Trace::Open(absl::GetFlag(FLAGS_trace));
  if (!trace.ok()) return trace.status();
  const TraceGeometry& g = trace->geometry();
  const int layer = absl::GetFlag(FLAGS_layer);
  const int64_t t = g.context;
  int64_t n = g.decode_steps;
  if (absl::GetFlag(FLAGS_steps) > 0) n = std::min<int64_t>(n, absl::GetFlag(FLAGS_steps));
  const int64_t kv_row = static_cast<int64_t>(g.kv_heads) * g.head_dim;
  const int64_t q_row = static_cast<int64_t>(g.q_heads) * g.head_dim;
  std::vector<float> keys((t + g.decode_steps) * kv_row), values((t + g.decode_steps) * kv_row);
  std::vector<float> prompt_q(t * q_row), decode_q(g.decode_steps * q_row);
  for (auto [tensor, phase, dst, rows] :
       {std::tuple{TraceTensor::kK, TracePhase::kPrefill, keys.data(), t},
        std::tuple{TraceTensor::kK, TracePhase::kDecode, keys.data() + t * kv_row,
                   g.decode_steps},
        std::tuple{TraceTensor::kV, TracePhase::kPrefill, values.data(), t},
        std::tuple{TraceTensor::kV, TracePhase::kDecode, values.data() + t * kv_row,
                   g.decode_steps},
        std::tuple{TraceTensor::kQ, TracePhase::kPrefill, prompt_q.data(), t},
        std::tuple{TraceTensor::kQ, TracePhase::kDecode, decode_q.data(), g.decode_steps}}) {
    if (absl::Status s = trace->ReadRows(layer, phase, tensor, 0, rows, dst); !s.ok()) return s;
  }
  const LayerShape shape{g.q_heads, g.kv_heads, g.head_dim,
                         1.0f / std::sqrt(static_cast<float>(g.head_dim))};
  const int heads = g.q_heads;
  const int d = g.head_dim;

  absl::StatusOr<std::vector<int>> link_batches =
      bench::ParseIntList("link_batches", absl::GetFlag(FLAGS_link_batches));
  if (!link_batches.ok()) return link_batches.status();
  for (const int link_batch : *link_batches) {
    SelectorParams params;
    params.kind = SelectorKind::kIndex;
    params.top_k = absl::GetFlag(FLAGS_k);
    params.sinks = absl::GetFlag(FLAGS_sinks);
    params.recent = absl::GetFlag(FLAGS_recent);
    params.index.build_queries = absl::GetFlag(FLAGS_build_queries);
    params.index.link_threshold = absl::GetFlag(FLAGS_link_threshold);
    params.index.link_batch = link_batch;
    if (absl::Status s = params.Validate(); !s.ok()) return s;
    IndexSelector selector(shape, params);
    KvView kv{keys.data(), values.data(), t, g.kv_heads, g.head_dim};
    const Clock::time_point build_start = Clock::now();
    if (absl::Status s = selector.Build(kv, prompt_q.data()); !s.ok()) return s;
    const double build_seconds = MicrosSince(build_start) * 1e-6;

    std::vector<HeadSelection> selections(heads);
    std::vector<std::vector<int32_t>> supports(heads);
    std::vector<float> o(q_row), lse(heads);
    std::vector<double> total_us, append_us, linking_total_us, quiet_total_us;
    std::vector<uint8_t> marks;
    std::vector<int32_t> exact;
    double recall = 0;
    int64_t recall_samples = 0, max_tail = 0, max_linked_per_add = 0, max_searches_per_add = 0;
    int64_t linked_keys = 0;
    for (int64_t s = 0; s < n; ++s) {
      kv.tokens = t + s + 1;
      const float* q = decode_q.data() + s * q_row;
      const Clock::time_point start = Clock::now();
      selector.OnAppend(kv);
      const double appended = MicrosSince(start);
      const int threads = cpu::ThreadsFor(static_cast<int64_t>(heads) * kv.tokens * d, heads);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
      for (int h = 0; h < heads; ++h) {
        selections[h].support.clear();
        selector.Select(h, q + static_cast<int64_t>(h) * d, kv, &selections[h]);
      }
      for (int h = 0; h < heads; ++h) std::swap(supports[h], selections[h].support);
      cpu::MultiHeadAttention(q, heads, kv, supports, shape.scale, o.data(), lse.data());
      const double step = MicrosSince(start);
      total_us.push_back(step);
      append_us.push_back(appended);
      int64_t step_linked = 0;
      for (int i = 0; i < selector.graph_count(); ++i) {
        const GraphIndex& index = selector.graph(i);
        max_tail = std::max(max_tail, index.size() - index.linked());
        max_linked_per_add = std::max(max_linked_per_add, index.last_link().linked_keys);
        max_searches_per_add =
            std::max(max_searches_per_add, index.last_link().projection_queries);
        step_linked += index.last_link().linked_keys;
      }
      linked_keys += step_linked;
      (step_linked > 0 ? linking_total_us : quiet_total_us).push_back(step);

      if (s % absl::GetFlag(FLAGS_recall_every) == 0) {
        const int64_t bulk_end = kv.tokens - params.recent;
        for (int h = 0; h < heads; ++h) {
          const VectorSet bulk = VectorSet::KeysOf(kv, KvHeadOf(h, heads, g.kv_heads),
                                                   params.sinks, bulk_end);
          cpu::ExactTopK(q + static_cast<int64_t>(h) * d, bulk.AsKeyView(), 0, 1.0f,
                         params.top_k, &exact);
          for (int32_t& id : exact) id += params.sinks;
          recall += SupportRecall(supports[h], exact, kv.tokens, &marks);
          ++recall_samples;
        }
      }
    }
    const nlohmann::json out = {
        {"link_batch", link_batch},
        {"link_threshold", params.index.WithDefaults().link_threshold},
        {"trace", absl::GetFlag(FLAGS_trace)},
        {"layer", layer},
        {"geometry",
         {{"q_heads", heads}, {"kv_heads", g.kv_heads}, {"head_dim", d}, {"context", t}}},
        {"k", params.top_k},
        {"steps", n},
        {"threads", omp_get_max_threads()},
        {"build_seconds", build_seconds},
        {"step_us", Percentiles(total_us)},
        {"on_append_us", Percentiles(append_us)},
        {"steps_that_linked", linking_total_us.size()},
        {"linking_step_us",
         linking_total_us.empty() ? nlohmann::json() : Percentiles(linking_total_us)},
        {"quiet_step_us", quiet_total_us.empty() ? nlohmann::json() : Percentiles(quiet_total_us)},
        {"linked_keys_per_step_mean", static_cast<double>(linked_keys) / n},
        {"max_tail", max_tail},
        {"max_keys_linked_per_add", max_linked_per_add},
        {"max_projection_searches_per_add", max_searches_per_add},
        {"bulk_recall", recall / std::max<int64_t>(recall_samples, 1)},
        {"recall_samples", recall_samples}};
    std::printf("%s\n", out.dump().c_str());
    std::fflush(stdout);
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace kvrecall

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  if (absl::GetFlag(FLAGS_trace).empty()) {
    std::fprintf(stderr, "--trace is required\n");
    return 2;
  }
  absl::Status s = kvrecall::Run();
  if (!s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
