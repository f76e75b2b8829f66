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
// With --group_union=S (0 < S <= 1) the items of a KV group draw their positions from one pool
// of S x group x keys positions, so that the union of the group's lists is about S of their
// sum (bench/results/gqa_overlap.md: 0.62-0.73 on tinylm-a, 0.96 on the synthetic trace), and
// each step runs twice: per head as above, then with each group's union scored once (chunks of
// 128 union rows on the pool, a row loaded once for the group's heads that list it) before the
// heads' top-K and attention. Both give the same supports; the JSON has both walls and their
// ratio.
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
#include "bench/int_list.h"
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
ABSL_FLAG(double, group_union, 0,
          "> 0: a KV group's lists share positions, their union about this share of their sum; "
          "the step also runs with each group's union scored once");

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
  const double group_union = absl::GetFlag(FLAGS_group_union);
  if (!(group_union >= 0 && group_union <= 1)) {
    std::fprintf(stderr, "--group_union: a share in [0, 1] (0: lists drawn apart)\n");
    return 2;
  }
  const int group = q_heads / kv_heads;
  if (group_union > 0 && (group > 32 || group_union * group < 1)) {
    std::fprintf(stderr,
                 "--group_union: at most 32 query heads a KV head, and a share of at least "
                 "1 / (q_heads / kv_heads): a group's union holds one list at least\n");
    return 2;
  }
  const std::vector<int> thread_counts =
      bench::IntListOrExit("threads", absl::GetFlag(FLAGS_threads));

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
  // A group's pool of distinct positions, and the stamps that keep them distinct.
  const auto pool_size = static_cast<int64_t>(
      std::min<double>(static_cast<double>(tokens),
                       std::max<double>(keys, std::round(group_union * group * keys))));
  std::vector<int32_t> pool;
  std::vector<uint32_t> drawn(tokens, 0);
  uint32_t draw_stamp = 0;
  auto draw = [&] {
    if (group_union == 0) {
      for (auto& list : ids) {
        for (int32_t& id : list) id = static_cast<int32_t>(position(rng));
      }
      return;
    }
    for (int g = 0; g < kv_heads; ++g) {
      ++draw_stamp;
      pool.clear();
      while (static_cast<int64_t>(pool.size()) < pool_size) {
        const auto p = static_cast<int32_t>(position(rng));
        if (drawn[p] != draw_stamp) {
          drawn[p] = draw_stamp;
          pool.push_back(p);
        }
      }
      // Head j takes `keys` consecutive pool places from j * (pool - keys) / (group - 1),
      // cyclically: the windows overlap evenly and their union is the whole pool.
      for (int j = 0; j < group; ++j) {
        const int64_t start = group > 1 ? j * (pool_size - keys) / (group - 1) : 0;
        for (int i = 0; i < keys; ++i) {
          ids[g * group + j][i] = pool[static_cast<size_t>((start + i) % pool_size)];
        }
      }
    }
  };

  // Top K and attention of item h over the scores its positions got.
  auto attend_item = [&](int h, int kv_head) {
    cpu::TopKPositions(scores[h], top_k, &top[h]);
    support[h].resize(top[h].size());
    support_scores[h].resize(top[h].size());
    for (size_t j = 0; j < top[h].size(); ++j) {
      support[h][j] = ids[h][top[h][j]];
      support_scores[h][j] = scores[h][top[h][j]];
    }
    cpu::PartialAttentionScored(support_scores[h], kv, kv_head, support[h],
                                out.data() + static_cast<size_t>(h) * d, &lse[h]);
  };
  // The step per head: each item scores its own positions.
  auto step_per_head = [&](int threads, bool attend) {
    cpu::ParallelFor(q_heads, threads, [&](int64_t item) {
      const int h = static_cast<int>(item);
      const int kv_head = KvHeadOf(h, q_heads, kv_heads);
      cpu::ScoreTokens(queries.data() + static_cast<size_t>(h) * d, kv, kv_head, ids[h], scale,
                       scores[h].data());
      if (attend) attend_item(h, kv_head);
    });
  };
  // The step with each group's union scored once: the unions (a loop over the groups), their
  // chunks of kChunk rows (cpu::ScoreTokensForQueries: each row loaded and widened once for the
  // heads of the group that list it), then the heads' top K and attention.
  constexpr int kChunk = 128;
  // A group's union, deduplicated through an open-addressing table of its positions (at most
  // half full: 128 KiB for four lists of 1278, in cache where arrays indexed by position would
  // miss on every lookup). The whole table is cleared each step: the sequential clear also
  // brings it into cache for the random probes that follow, which clearing only the entries
  // used did not (twice the build time on the development machine).
  struct Union {
    std::vector<int32_t> rows;     // distinct positions
    std::vector<uint32_t> heads;   // per row, a bit per head of the group that lists it
    std::vector<int64_t> table;    // (position << 32 | slot), -1: empty
    double build_us = 0;           // this step's
  };
  int table_bits = 1;
  while ((size_t{1} << table_bits) < static_cast<size_t>(2 * group * keys)) ++table_bits;
  const size_t table_size = size_t{1} << table_bits;
  std::vector<Union> unions(group_union > 0 ? kv_heads : 0);
  std::vector<std::vector<int32_t>> slot_of(q_heads, std::vector<int32_t>(keys));
  std::vector<std::vector<float>> union_scores(q_heads);
  std::vector<std::pair<int, int>> chunks;  // (group, chunk)
  double phase_us[4] = {0, 0, 0, 0};  // the last union step's: unions, scores, heads; and the
                                      // longest one group's union took to build
  auto step_by_union = [&](int threads) {
    auto t = Clock::now();
    auto lap = [&](int phase) {
      const auto now = Clock::now();
      phase_us[phase] = std::chrono::duration<double, std::micro>(now - t).count();
      t = now;
    };
    cpu::ParallelFor(kv_heads, threads, [&](int64_t g) {
      const auto start = Clock::now();
      Union& u = unions[g];
      u.table.assign(table_size, -1);
      u.rows.clear();
      u.heads.clear();
      for (int j = 0; j < group; ++j) {
        const int h = static_cast<int>(g) * group + j;
        for (int i = 0; i < keys; ++i) {
          const int32_t p = ids[h][i];
          // Fibonacci hashing: the product's high bits.
          size_t at = static_cast<size_t>((static_cast<uint64_t>(p) * 0x9E3779B97F4A7C15u) >>
                                          (64 - table_bits));
          while (u.table[at] >= 0 && (u.table[at] >> 32) != p) at = (at + 1) & (table_size - 1);
          if (u.table[at] < 0) {
            u.table[at] = int64_t{p} << 32 | static_cast<int64_t>(u.rows.size());
            u.rows.push_back(p);
            u.heads.push_back(0);
          }
          const auto slot = static_cast<int32_t>(u.table[at] & 0xffffffff);
          u.heads[slot] |= uint32_t{1} << j;
          slot_of[h][i] = slot;
        }
      }
      for (int j = 0; j < group; ++j) union_scores[g * group + j].resize(u.rows.size());
      u.build_us = std::chrono::duration<double, std::micro>(Clock::now() - start).count();
    });
    lap(0);
    phase_us[3] = 0;
    for (const Union& u : unions) phase_us[3] = std::max(phase_us[3], u.build_us);
    chunks.clear();
    for (int g = 0; g < kv_heads; ++g) {
      const auto rows = static_cast<int>(unions[g].rows.size());
      for (int c = 0; c * kChunk < rows; ++c) chunks.emplace_back(g, c);
    }
    cpu::ParallelFor(static_cast<int64_t>(chunks.size()), threads, [&](int64_t item) {
      const auto [g, c] = chunks[item];
      const Union& u = unions[g];
      const int begin = c * kChunk;
      const int end = std::min<int>(static_cast<int>(u.rows.size()), begin + kChunk);
      const float* q[32];
      float* to[32];
      for (int j = 0; j < group; ++j) {
        q[j] = queries.data() + static_cast<size_t>(g * group + j) * d;
        to[j] = union_scores[g * group + j].data() + begin;
      }
      cpu::ScoreTokensForQueries(std::span<const float* const>(q, group), kv, g,
                                 std::span<const int32_t>(u.rows).subspan(begin, end - begin),
                                 std::span<const uint32_t>(u.heads).subspan(begin, end - begin),
                                 scale, to);
    });
    lap(1);
    cpu::ParallelFor(q_heads, threads, [&](int64_t item) {
      const int h = static_cast<int>(item);
      for (int i = 0; i < keys; ++i) scores[h][i] = union_scores[h][slot_of[h][i]];
      attend_item(h, KvHeadOf(h, q_heads, kv_heads));
    });
    lap(2);
  };

  // The union's step gives each head the supports and scores its own step gives (checked on
  // one draw, untimed).
  bool union_same = true;
  double union_share = 0;
  if (group_union > 0) {
    draw();
    step_per_head(1, true);
    const std::vector<std::vector<int32_t>> want = support;
    const std::vector<std::vector<float>> want_scores = support_scores;
    step_by_union(1);
    union_same = support == want && support_scores == want_scores;
    for (const Union& u : unions) union_share += static_cast<double>(u.rows.size());
    union_share /= static_cast<double>(q_heads) * keys;
  }

  nlohmann::json runs = nlohmann::json::array();
  for (int threads : thread_counts) {
    std::vector<double> step_us, scan_us, union_us, phases[4];
    for (int i = 0; i < warmup + steps; ++i) {
      for (int pass = 0; pass < (group_union > 0 ? 3 : 2); ++pass) {
        draw();  // fresh rows for every pass: none in the caches from the pass before
        // The pool's workers awake, as they are when a server's step reaches its heads (the
        // draw takes longer than they poll before they sleep).
        cpu::ParallelFor(threads, threads, [](int64_t) {});
        const auto t0 = Clock::now();
        if (pass < 2) {
          step_per_head(threads, /*attend=*/pass == 1);
        } else {
          step_by_union(threads);
        }
        const double us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
        if (i < warmup) continue;
        (pass == 0 ? scan_us : pass == 1 ? step_us : union_us).push_back(us);
        if (pass == 2) {
          for (int phase = 0; phase < 4; ++phase) phases[phase].push_back(phase_us[phase]);
        }
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
    if (group_union > 0) {
      const double union_p50 = Percentiles(union_us)["p50"].get<double>();
      run["union_step_us"] = Percentiles(union_us);
      run["union_step_over_step"] = union_p50 / step_p50;
      double p50[4];
      for (int phase = 0; phase < 4; ++phase) {
        p50[phase] = Percentiles(phases[phase])["p50"].get<double>();
      }
      run["union_phases_p50_us"] = {{"unions", p50[0]},
                                    {"scores", p50[1]},
                                    {"heads", p50[2]},
                                    {"longest_group_build", p50[3]}};
      std::fprintf(stderr,
                   "%2d threads: the step with unions scored once p50 %.1f us (%.2fx): unions "
                   "%.1f (one group at most %.1f), scores %.1f, heads' top K and attention "
                   "%.1f\n",
                   threads, union_p50, union_p50 / step_p50, p50[0], p50[3], p50[1], p50[2]);
    }
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
      {"group_union", group_union},
      {"group_union_measured", union_share},
      {"union_supports_equal", group_union > 0 ? nlohmann::json(union_same) : nlohmann::json()},
      {"pool_workers", cpu::ThreadPool::Process().workers()},
      {"runs", runs}};
  std::printf("%s\n", result.dump(1).c_str());
  if (!union_same) {
    std::fprintf(stderr, "the union's supports differ from the heads' own\n");
    return 1;
  }
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
