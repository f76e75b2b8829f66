// The host's floor under a tiered step's bulk (issue 15): how fast the compute pool's threads
// score and attend to scattered rows of one layer's host KV, as the exact heads of a shortlist
// step do, at 1, 2, 4, ... threads.
//
// One layer of bf16 KV ([tokens, kv_heads, head_dim], huge pages as server/kv_store.cc maps
// it) filled with N(0, 1). A "step" is `heads` items on the pool (cpu::ParallelFor, as
// TieredBackend runs its heads): item h scores `keys` positions drawn afresh at random from the
// layer (cpu::ScoreTokens, the shortlist's rescoring), keeps the top `top_k`
// (cpu::TopKPositions) and attends to them (cpu::PartialAttentionScored). A "scan" is the
// scoring alone. Fresh positions every step keep the rows out of the caches, as a long context's
// are. Per thread count: the step's and the scan's wall p50, the rows they read (keys, then
// keys and the support's values) in GB/s and ns per row and thread.
//
// Prints one JSON object.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "bench/percentiles.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/mapped_memory.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/dtype.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(int64_t, tokens, 131072, "tokens of the layer");
ABSL_FLAG(int, q_heads, 32, "items per step (query heads)");
ABSL_FLAG(int, kv_heads, 8, "KV heads");
ABSL_FLAG(int, head_dim, 128, "head dim");
ABSL_FLAG(int, keys, 1278, "positions each item scores (a shortlist of 1024 and its outliers)");
ABSL_FLAG(int, top_k, 512, "positions each item attends to");
ABSL_FLAG(std::string, threads, "1,2,4,8,16", "the pool's threads per step, comma-separated");
ABSL_FLAG(int, steps, 40, "measured steps per thread count");
ABSL_FLAG(int, warmup, 4, "steps before them");

namespace kvrecall::bench {
namespace {

using Clock = std::chrono::steady_clock;

int Main() {
  const int64_t tokens = absl::GetFlag(FLAGS_tokens);
  const int q_heads = absl::GetFlag(FLAGS_q_heads), kv_heads = absl::GetFlag(FLAGS_kv_heads);
  const int d = absl::GetFlag(FLAGS_head_dim), keys = absl::GetFlag(FLAGS_keys);
  const int top_k = std::min(absl::GetFlag(FLAGS_top_k), keys);
  const int steps = absl::GetFlag(FLAGS_steps), warmup = absl::GetFlag(FLAGS_warmup);
  if (tokens < 1 || q_heads < 1 || kv_heads < 1 || q_heads % kv_heads != 0 || d < 1 ||
      keys < 1 || keys > tokens || top_k < 1 || steps < 1 || warmup < 0) {
    std::fprintf(stderr, "need tokens >= keys >= 1, kv_heads dividing q_heads, top_k, steps >= 1\n");
    return 2;
  }
  std::vector<int> thread_counts;
  for (absl::string_view part : absl::StrSplit(absl::GetFlag(FLAGS_threads), ',')) {
    int t = 0;
    if (!absl::SimpleAtoi(part, &t) || t < 1) {
      std::fprintf(stderr, "--threads: positive counts, comma-separated\n");
      return 2;
    }
    thread_counts.push_back(t);
  }

  const size_t elements = static_cast<size_t>(tokens) * kv_heads * d;
  cpu::MappedVector<uint16_t> k_rows(elements), v_rows(elements);
  {
    std::mt19937_64 rng(1);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (size_t i = 0; i < elements; ++i) {
      k_rows[i] = FloatToBf16(normal(rng));
      v_rows[i] = FloatToBf16(normal(rng));
    }
  }
  const KvView kv{k_rows.data(), v_rows.data(), tokens, kv_heads, d, KvElement::kBf16};
  std::vector<float> queries(static_cast<size_t>(q_heads) * d);
  {
    std::mt19937_64 rng(2);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (float& x : queries) x = normal(rng);
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const double row_bytes = static_cast<double>(d) * 2;

  // Per item: its positions, its scores, its support and its output.
  std::vector<std::vector<int32_t>> ids(q_heads, std::vector<int32_t>(keys));
  std::vector<std::vector<float>> scores(q_heads, std::vector<float>(keys));
  std::vector<std::vector<int32_t>> top(q_heads), support(q_heads);
  std::vector<std::vector<float>> support_scores(q_heads);
  std::vector<float> out(static_cast<size_t>(q_heads) * d), lse(q_heads);
  std::mt19937_64 rng(3);
  std::uniform_int_distribution<int64_t> position(0, tokens - 1);
  auto draw = [&] {
    for (auto& list : ids) {
      for (int32_t& id : list) id = static_cast<int32_t>(position(rng));
    }
  };

  nlohmann::json runs = nlohmann::json::array();
  for (int threads : thread_counts) {
    std::vector<double> step_us, scan_us;
    for (int i = 0; i < warmup + steps; ++i) {
      for (bool attend : {false, true}) {
        draw();
        const auto t0 = Clock::now();
        cpu::ParallelFor(q_heads, threads, [&](int64_t item) {
          const int h = static_cast<int>(item);
          const int kv_head = KvHeadOf(h, q_heads, kv_heads);
          cpu::ScoreTokens(queries.data() + static_cast<size_t>(h) * d, kv, kv_head, ids[h], scale,
                           scores[h].data());
          if (!attend) return;
          cpu::TopKPositions(scores[h], top_k, &top[h]);
          support[h].resize(top[h].size());
          support_scores[h].resize(top[h].size());
          for (size_t j = 0; j < top[h].size(); ++j) {
            support[h][j] = ids[h][top[h][j]];
            support_scores[h][j] = scores[h][top[h][j]];
          }
          cpu::PartialAttentionScored(support_scores[h], kv, kv_head, support[h],
                                      out.data() + static_cast<size_t>(h) * d, &lse[h]);
        });
        const double us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
        if (i >= warmup) (attend ? step_us : scan_us).push_back(us);
      }
    }
    const double scan_rows = static_cast<double>(q_heads) * keys;
    const double step_rows = scan_rows + static_cast<double>(q_heads) * top_k;
    const double scan_p50 = Percentiles(scan_us)["p50"].get<double>();
    const double step_p50 = Percentiles(step_us)["p50"].get<double>();
    nlohmann::json run = {
        {"threads", threads},
        {"scan_us", Percentiles(scan_us)},
        {"step_us", Percentiles(step_us)},
        {"scan_gb_per_s", scan_rows * row_bytes / scan_p50 / 1e3},
        {"step_gb_per_s", step_rows * row_bytes / step_p50 / 1e3},
        {"scan_ns_per_row_thread", scan_p50 * 1e3 * threads / scan_rows},
        {"step_ns_per_row_thread", step_p50 * 1e3 * threads / step_rows}};
    std::fprintf(stderr,
                 "%2d threads: scan p50 %.1f us (%.1f GB/s, %.1f ns/row/thread), step p50 %.1f us "
                 "(%.1f GB/s)\n",
                 threads, scan_p50, run["scan_gb_per_s"].get<double>(),
                 run["scan_ns_per_row_thread"].get<double>(), step_p50,
                 run["step_gb_per_s"].get<double>());
    runs.push_back(run);
  }
  const nlohmann::json result = {
      {"bench", "host_gather_bench"},
      {"tokens", tokens},
      {"q_heads", q_heads},
      {"kv_heads", kv_heads},
      {"head_dim", d},
      {"keys_per_item", keys},
      {"top_k", top_k},
      {"row_bytes", row_bytes},
      {"pool_workers", cpu::ThreadPool::Process().workers()},
      {"runs", runs}};
  std::printf("%s\n", result.dump(1).c_str());
  return 0;
}

}  // namespace
}  // namespace kvrecall::bench

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "host_gather_bench: scattered-row scoring and attention of one layer's host KV by thread "
      "count (the floor under a tiered step's bulk)");
  absl::ParseCommandLine(argc, argv);
  return kvrecall::bench::Main();
}
