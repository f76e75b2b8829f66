// Where a tiered ReTopK step's `decide` time goes (issue 15): the cache match of every query
// head (ReTopKHead::Decide, 32 cosines of d = 128 against its C = 32 cached queries) run as
// TieredBackend runs it, one loop on the process's compute pool right after the step's launch,
// its cold pass (sleeping workers, the caches' cold reads) against the warm loop.
//
// One "step" mimics the server's between two decisions:
//   1. the bulk: a loop over every worker streaming --evict_mb of memory (the heads' scattered
//      rows leave the caches' queries out of the CPU caches);
//   2. with --finish_threads > 0, a small loop on that many threads (the step's last loops):
//      the pool keeps polling only as many workers as the latest loop asked for;
//   3. the client's round trip: --gap_us of sleep (workers past their spin sleep in futex);
//   4. the timed decision loop: ParallelFor(heads, threads, Decide) for each --threads;
// and then, untimed, each head's decided query pushed into its cache, as a step does. Each
// step also times the same decisions again right after (warm caches, awake pool) and, after the
// same prelude, an empty loop of 16 items on 16 threads (`empty_loop_16_us`: the caller's wake
// call and the loop's overhead; the caller may run every item before a worker arrives, so it is
// not the workers' wake-up, which cold minus warm shows).
//
// Prints one JSON object: per thread count the cold and warm decisions' percentiles, and the
// empty loop's.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "bench/int_list.h"
#include "bench/percentiles.h"
#include "index/retopk.h"
#include "kernels/cpu/thread_pool.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(int, q_heads, 32, "query heads decided per step");
ABSL_FLAG(int, head_dim, 128, "head dim");
ABSL_FLAG(int, cache_capacity, 32, "C, cached queries per head");
ABSL_FLAG(std::string, threads, "1,2,4,8,16", "the decision loop's threads, comma-separated");
ABSL_FLAG(int, steps, 60, "measured steps per thread count");
ABSL_FLAG(int, warmup, 5, "steps before them");
ABSL_FLAG(int, evict_mb, 256, "memory the bulk stand-in streams through each step");
ABSL_FLAG(int, finish_threads, 2, "threads of the small loop after the bulk (0: none)");
ABSL_FLAG(int, gap_us, 250, "sleep between the bulk and the decisions (the round trip)");
ABSL_FLAG(int, spin_us, 100, "the pool's polling before its workers sleep (kvrecalld's "
                             "--compute_spin_us)");

namespace kvrecall::bench {
namespace {

using Clock = std::chrono::steady_clock;

double MicrosSince(Clock::time_point start) {
  return std::chrono::duration<double, std::micro>(Clock::now() - start).count();
}

int Main() {
  const int heads = absl::GetFlag(FLAGS_q_heads);
  const int d = absl::GetFlag(FLAGS_head_dim);
  const int capacity = absl::GetFlag(FLAGS_cache_capacity);
  const int steps = absl::GetFlag(FLAGS_steps), warmup = absl::GetFlag(FLAGS_warmup);
  const int finish_threads = absl::GetFlag(FLAGS_finish_threads);
  const auto gap = std::chrono::microseconds(absl::GetFlag(FLAGS_gap_us));
  const int workers = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  if (heads < 1 || d < 1 || capacity < 1 || steps < 1 || warmup < 0 ||
      absl::GetFlag(FLAGS_evict_mb) < 1 || finish_threads < 0 || finish_threads > workers) {
    std::fprintf(stderr, "sizes must be positive, --finish_threads at most the %d cores\n",
                 workers);
    return 2;
  }
  cpu::ThreadPool::Configure(
      {.workers = -1, .spin = std::chrono::microseconds(absl::GetFlag(FLAGS_spin_us))});
  cpu::ThreadPool& pool = cpu::ThreadPool::Process();

  // The heads, their caches filled with drifting unit queries and supports of K = 512.
  ReTopKHeadParams params;
  std::vector<ReTopKHead> decide_heads;
  for (int h = 0; h < heads; ++h) decide_heads.emplace_back(params, capacity, d);
  std::mt19937_64 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> queries(static_cast<size_t>(heads) * d);
  for (float& x : queries) x = normal(rng);
  std::vector<int32_t> support(params.top_k);
  auto next_queries = [&] {  // each head's query drifts (consecutive cosine ~0.8)
    for (float& x : queries) x = 0.8f * x + 0.6f * normal(rng);
  };
  auto push_all = [&] {
    for (int h = 0; h < heads; ++h) {
      for (int32_t& id : support) id = static_cast<int32_t>(rng() % (1 << 20));
      decide_heads[h].CompleteDecided(support);
    }
  };
  std::vector<float> best(heads);
  auto decide = [&](int64_t h) {
    decide_heads[h].Decide(queries.data() + h * d, /*decode_step=*/1, &best[h]);
  };
  for (int i = 0; i < capacity; ++i) {
    next_queries();
    for (int h = 0; h < heads; ++h) decide(h);
    push_all();
  }

  // The bulk stand-in: every worker streams its share of a buffer larger than the CPU caches.
  std::vector<uint64_t> evict(static_cast<size_t>(absl::GetFlag(FLAGS_evict_mb)) << 17, 1);
  std::vector<uint64_t> sums(workers);
  auto prelude = [&] {
    const size_t share = evict.size() / workers;
    pool.ParallelFor(workers, workers, [&](int64_t w) {
      uint64_t sum = 0;
      for (size_t i = w * share; i < (w + 1) * share; i += 8) sum += evict[i]++;
      sums[w] = sum;
    });
    if (finish_threads > 0) {
      pool.ParallelFor(finish_threads, finish_threads, [&](int64_t w) { sums[w] += 1; });
    }
    std::this_thread::sleep_for(gap);
  };

  nlohmann::json doc = {{"q_heads", heads},
                        {"head_dim", d},
                        {"cache_capacity", capacity},
                        {"pool_threads", workers},
                        {"evict_mb", absl::GetFlag(FLAGS_evict_mb)},
                        {"finish_threads", finish_threads},
                        {"gap_us", absl::GetFlag(FLAGS_gap_us)},
                        {"spin_us", absl::GetFlag(FLAGS_spin_us)},
                        {"runs", nlohmann::json::array()}};
  for (int threads : bench::IntListOrExit("threads", absl::GetFlag(FLAGS_threads))) {
    std::vector<double> cold, warm, empty_loop;
    for (int s = 0; s < warmup + steps; ++s) {
      next_queries();
      prelude();
      auto t0 = Clock::now();
      pool.ParallelFor(heads, threads, decide);
      const double cold_us = MicrosSince(t0);
      t0 = Clock::now();
      pool.ParallelFor(heads, threads, decide);
      const double warm_us = MicrosSince(t0);
      push_all();
      prelude();
      t0 = Clock::now();
      pool.ParallelFor(16, 16, [](int64_t) {});
      const double empty_loop_us = MicrosSince(t0);
      if (s < warmup) continue;
      cold.push_back(cold_us);
      warm.push_back(warm_us);
      empty_loop.push_back(empty_loop_us);
    }
    doc["runs"].push_back({{"threads", threads},
                           {"decide_cold_us", Percentiles(cold)},
                           {"decide_warm_us", Percentiles(warm)},
                           {"empty_loop_16_us", Percentiles(empty_loop)}});
    std::fprintf(stderr, "threads %2d: decide cold p50 %.1f us, warm %.1f, empty loop(16) %.1f\n",
                 threads, Percentiles(cold)["p50"].get<double>(),
                 Percentiles(warm)["p50"].get<double>(),
                 Percentiles(empty_loop)["p50"].get<double>());
  }
  std::printf("%s\n", doc.dump(1).c_str());
  return 0;
}

}  // namespace
}  // namespace kvrecall::bench

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("decide_bench: the tiered ReTopK decisions' time, cold and warm");
  absl::ParseCommandLine(argc, argv);
  return kvrecall::bench::Main();
}
