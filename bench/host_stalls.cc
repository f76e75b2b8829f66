// How often a busy thread on this host loses its core, and whether the kernel took it: one
// thread pinned to each CPU reads the monotonic clock in a loop, and every gap between two
// reads of at least --threshold_us is a stall. Each stall is marked preempted when the
// thread's involuntary context switches (getrusage(RUSAGE_THREAD), read at least every
// millisecond) rose across it: the kernel ran something else there. A stall with no such
// switch is time the thread's CPU did not run at all: the hypervisor's (steal), an SMI or the
// like. The tiered step's slowest steps at 128K are one thread stalled ~3 ms in a head
// (bench/results/tiered_serving.md, "What is left at 128K"); this measures the host's own rate
// of such stalls with no kvrecalld running, to compare.
//
// Prints one JSON object: per thread, its stalls by length, preempted or not, and its longest;
// over all threads, the stalls' lengths, their rate per thread-second, how many threads stalled
// at once (a whole-machine pause hits every thread together, a stolen CPU one), and /proc/stat's
// steal over the run.
//
//   host_stalls --seconds=30 --threshold_us=200
#include <pthread.h>
#include <sched.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "bench/percentiles.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(int32_t, threads, 0, "spinning threads, one pinned to each of the first N CPUs; 0: all");
ABSL_FLAG(double, seconds, 30, "how long every thread spins");
ABSL_FLAG(int32_t, threshold_us, 200, "the shortest gap between two clock reads counted a stall");

namespace kvrecall {
namespace {

using Clock = std::chrono::steady_clock;

struct Stall {
  double start_ms = 0;  // since the run's start
  double micros = 0;
  bool preempted = false;  // the thread's involuntary context switches rose across it
};

int64_t InvoluntarySwitches() {
  rusage usage{};
  getrusage(RUSAGE_THREAD, &usage);
  return usage.ru_nivcsw;
}

// Spins on the clock until `end`, recording the gaps of at least `threshold`.
std::vector<Stall> Spin(int cpu, Clock::time_point start, Clock::time_point end,
                        Clock::duration threshold, std::atomic<int>* pinned_failures) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  if (pthread_setaffinity_np(pthread_self(), sizeof(set), &set) != 0) pinned_failures->fetch_add(1);
  std::vector<Stall> stalls;
  stalls.reserve(4096);
  constexpr auto kSwitchesEvery = std::chrono::milliseconds(1);
  std::this_thread::sleep_until(start);
  Clock::time_point before = Clock::now();
  int64_t switches = InvoluntarySwitches();
  Clock::time_point next_read = before + kSwitchesEvery;
  while (before < end) {
    const Clock::time_point now = Clock::now();
    if (now - before >= threshold) {
      const int64_t after = InvoluntarySwitches();
      stalls.push_back({std::chrono::duration<double, std::milli>(before - start).count(),
                        std::chrono::duration<double, std::micro>(now - before).count(),
                        after > switches});
      switches = after;
      next_read = now + kSwitchesEvery;
    } else if (now >= next_read) {
      switches = InvoluntarySwitches();
      next_read = now + kSwitchesEvery;
    }
    before = now;
  }
  return stalls;
}

// /proc/stat's steal jiffies (USER_HZ) summed over the CPUs, or -1.
int64_t StealJiffies() {
  std::ifstream stat("/proc/stat");
  std::string line;
  while (std::getline(stat, line)) {
    if (line.rfind("cpu ", 0) != 0) continue;
    std::istringstream fields(line.substr(4));
    int64_t value = 0;
    int read = 0;
    while (read < 8 && fields >> value) ++read;  // user nice system idle iowait irq softirq steal
    return read == 8 ? value : -1;
  }
  return -1;
}

int Run() {
  const int cpus = static_cast<int>(std::thread::hardware_concurrency());
  const int threads = absl::GetFlag(FLAGS_threads) > 0 ? absl::GetFlag(FLAGS_threads) : cpus;
  const double seconds = absl::GetFlag(FLAGS_seconds);
  const int threshold_us = absl::GetFlag(FLAGS_threshold_us);
  if (threads > cpus || !(seconds > 0) || threshold_us < 1) {
    std::fprintf(stderr,
                 "host_stalls: need --threads in [0, %d], --seconds > 0 and --threshold_us >= 1; "
                 "got %d, %g, %d\n",
                 cpus, threads, seconds, threshold_us);
    return 2;
  }
  const auto threshold = std::chrono::microseconds(threshold_us);
  const Clock::time_point start = Clock::now() + std::chrono::milliseconds(100);
  const Clock::time_point end =
      start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  const int64_t steal_before = StealJiffies();
  std::atomic<int> pinned_failures{0};
  std::vector<std::vector<Stall>> stalls(threads);
  std::vector<std::thread> spinners;
  for (int t = 0; t < threads; ++t) {
    spinners.emplace_back([&, t] { stalls[t] = Spin(t, start, end, threshold, &pinned_failures); });
  }
  for (std::thread& spinner : spinners) spinner.join();
  const int64_t steal_after = StealJiffies();

  // Lengths' bins, in ms: [0.2, 0.5), [0.5, 1), [1, 2), [2, 5), [5, inf) with the default.
  const std::vector<double> edges_ms = {threshold_us / 1000.0, 0.5, 1, 2, 5};
  auto bin_of = [&](double micros) {
    int b = 0;
    while (b + 1 < static_cast<int>(edges_ms.size()) && micros >= edges_ms[b + 1] * 1000) ++b;
    return b;
  };
  nlohmann::json per_thread = nlohmann::json::array();
  std::vector<double> all_micros, unpreempted_micros;
  // (start, end, thread) of every stall of 1 ms or more, for how many overlap.
  struct Span {
    double start, end;
    int thread;
  };
  std::vector<Span> long_stalls;
  for (int t = 0; t < threads; ++t) {
    std::vector<int> preempted(edges_ms.size()), not_preempted(edges_ms.size());
    double longest = 0, stalled = 0;
    for (const Stall& s : stalls[t]) {
      (s.preempted ? preempted : not_preempted)[bin_of(s.micros)]++;
      longest = std::max(longest, s.micros);
      stalled += s.micros;
      all_micros.push_back(s.micros);
      if (!s.preempted) unpreempted_micros.push_back(s.micros);
      if (s.micros >= 1000) long_stalls.push_back({s.start_ms, s.start_ms + s.micros / 1000, t});
    }
    per_thread.push_back({{"cpu", t},
                          {"stalls", stalls[t].size()},
                          {"preempted_by_bin", preempted},
                          {"not_preempted_by_bin", not_preempted},
                          {"longest_us", longest},
                          {"stalled_fraction", stalled / (seconds * 1e6)}});
  }
  // For each long stall, the threads whose long stalls overlap it (itself included).
  std::vector<int> overlap_counts;
  for (const Span& a : long_stalls) {
    std::vector<bool> seen(threads);
    for (const Span& b : long_stalls) {
      if (b.start < a.end && a.start < b.end) seen[b.thread] = true;
    }
    overlap_counts.push_back(static_cast<int>(std::count(seen.begin(), seen.end(), true)));
  }
  auto rate = [&](double min_us, bool unpreempted_only) {
    const std::vector<double>& from = unpreempted_only ? unpreempted_micros : all_micros;
    const auto n = std::count_if(from.begin(), from.end(), [&](double us) { return us >= min_us; });
    return static_cast<double>(n) / (threads * seconds);
  };
  const long hz = sysconf(_SC_CLK_TCK);
  nlohmann::json out = {
      {"threads", threads},
      {"cpus", cpus},
      {"seconds", seconds},
      {"threshold_us", threshold_us},
      {"bin_edges_ms", edges_ms},
      {"pinning_failures", pinned_failures.load()},
      {"stalls", all_micros.size()},
      {"stall_us", Percentiles(all_micros)},
      {"not_preempted_stall_us", Percentiles(unpreempted_micros)},
      {"per_thread_second",
       {{"over_1ms", rate(1000, false)},
        {"over_2ms", rate(2000, false)},
        {"not_preempted_over_1ms", rate(1000, true)},
        {"not_preempted_over_2ms", rate(2000, true)}}},
      {"long_stalls", long_stalls.size()},
      {"long_stall_threads_at_once",
       overlap_counts.empty() ? nlohmann::json(nullptr)
                              : Percentiles({overlap_counts.begin(), overlap_counts.end()})},
      {"steal_fraction",
       steal_before < 0 || steal_after < 0 || hz <= 0
           ? nlohmann::json(nullptr)
           : nlohmann::json(static_cast<double>(steal_after - steal_before) / hz /
                            (cpus * seconds))},
      {"per_thread", per_thread}};
  std::printf("%s\n", out.dump().c_str());
  return 0;
}

}  // namespace
}  // namespace kvrecall

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "host_stalls: how often a spinning thread per CPU loses its core, preempted by the kernel "
      "or not");
  absl::ParseCommandLine(argc, argv);
  return kvrecall::Run();
}
