// How often a busy thread on this host loses its core, and whether the guest's kernel took it:
// one thread pinned to each CPU it may run on reads the monotonic clock in a loop, and every gap
// between two reads of at least --threshold_us is a stall. Each stall is marked preempted when
// the thread's involuntary context switches (getrusage(RUSAGE_THREAD), read at every turn of the
// loop) rose across it: another task of the guest ran there. A stall with no such switch is time
// the guest gave no other task: the hypervisor's (steal), or an interrupt or softirq on that
// CPU. Per CPU, /proc/stat's steal, irq and softirq over the run are given beside the stalls' own
// time, to tell which. The tiered step's slowest steps at 128K are one thread stalled ~3 ms in a
// head (bench/results/tiered_serving.md, "What is left at 128K"); this measures the host's own
// stalls with no kvrecalld running, to compare.
//
// Prints one JSON object: per thread, its CPU, its stalls by length, preempted or not, their
// time, and its CPU's steal, irq and softirq; over all threads, each class's lengths, their rate
// per thread-second, and how many threads' stalls of the class overlap each one (a whole-machine
// pause stalls every thread together, a CPU taken away one).
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

ABSL_FLAG(int32_t, threads, 0,
          "spinning threads, one pinned to each of the first N CPUs this process may run on; "
          "0: all");
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

// Spins pinned to `cpu` until `end`, recording the gaps of at least `threshold`. Each turn reads
// the switches, then the clock: a switch inside the gap between clock reads t[i-1] and t[i] shows
// in the switches read at turn i or i + 1 (one taken during turn i's read), so the gap is
// preempted when those at turn i + 1 exceed those read at turn i - 1.
std::vector<Stall> Spin(int cpu, Clock::time_point start, Clock::time_point end,
                        Clock::duration threshold, std::atomic<int>* pinning_failures) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  if (pthread_setaffinity_np(pthread_self(), sizeof(set), &set) != 0) {
    pinning_failures->fetch_add(1);
  }
  std::vector<Stall> stalls;
  stalls.reserve(4096);
  std::this_thread::sleep_until(start);
  int64_t switches = InvoluntarySwitches();
  Clock::time_point before = Clock::now();
  int64_t pending_base = -1;  // a gap's switches before it, until the next turn's read
  while (before < end) {
    const int64_t now_switches = InvoluntarySwitches();
    const Clock::time_point now = Clock::now();
    if (pending_base >= 0) {
      stalls.back().preempted = now_switches > pending_base;
      pending_base = -1;
    }
    if (now - before >= threshold) {
      stalls.push_back({std::chrono::duration<double, std::milli>(before - start).count(),
                        std::chrono::duration<double, std::micro>(now - before).count(), false});
      pending_base = switches;
    }
    switches = now_switches;
    before = now;
  }
  if (pending_base >= 0) stalls.back().preempted = InvoluntarySwitches() > pending_base;
  return stalls;
}

// /proc/stat's jiffies (USER_HZ) of one CPU: irq, softirq, steal.
struct CpuTimes {
  int64_t irq = 0, softirq = 0, steal = 0;
};

// Every CPU's line of /proc/stat ("cpuN ..."), by N; empty where it cannot be read.
std::vector<CpuTimes> ReadCpuTimes() {
  std::vector<CpuTimes> times;
  std::ifstream stat("/proc/stat");
  std::string line;
  while (std::getline(stat, line)) {
    if (line.rfind("cpu", 0) != 0 || line.size() < 4 || line[3] < '0' || line[3] > '9') continue;
    std::istringstream fields(line.substr(3));
    int cpu = 0;
    int64_t v[8] = {};  // user nice system idle iowait irq softirq steal
    fields >> cpu;
    for (int64_t& x : v) fields >> x;
    if (!fields || cpu < 0) return {};
    if (static_cast<int>(times.size()) <= cpu) times.resize(cpu + 1);
    times[cpu] = {v[5], v[6], v[7]};
  }
  return times;
}

// For each stall of `of` (start, end in ms), how many threads have a stall of `of` overlapping it
// (its own thread included).
nlohmann::json ThreadsAtOnce(const std::vector<std::vector<Stall>>& stalls, bool preempted) {
  struct Span {
    double start, end;
    size_t thread;
  };
  std::vector<Span> spans;
  for (size_t t = 0; t < stalls.size(); ++t) {
    for (const Stall& s : stalls[t]) {
      if (s.preempted == preempted) spans.push_back({s.start_ms, s.start_ms + s.micros / 1000, t});
    }
  }
  std::vector<double> counts;
  for (const Span& a : spans) {
    std::vector<bool> seen(stalls.size());
    for (const Span& b : spans) {
      if (b.start < a.end && a.start < b.end) seen[b.thread] = true;
    }
    counts.push_back(static_cast<double>(std::count(seen.begin(), seen.end(), true)));
  }
  return Percentiles(counts);
}

int Run() {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (sched_getaffinity(0, sizeof(allowed), &allowed) != 0) {
    std::fprintf(stderr, "host_stalls: sched_getaffinity failed\n");
    return 1;
  }
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &allowed)) cpus.push_back(c);
  }
  const int asked = absl::GetFlag(FLAGS_threads);
  const double seconds = absl::GetFlag(FLAGS_seconds);
  const int threshold_us = absl::GetFlag(FLAGS_threshold_us);
  if (asked < 0 || asked > static_cast<int>(cpus.size()) || !(seconds > 0) || threshold_us < 1) {
    std::fprintf(stderr,
                 "host_stalls: need --threads in [0, %zu] (the CPUs this process may run on), "
                 "--seconds > 0 and --threshold_us >= 1; got %d, %g, %d\n",
                 cpus.size(), asked, seconds, threshold_us);
    return 2;
  }
  if (asked > 0) cpus.resize(asked);
  const int threads = static_cast<int>(cpus.size());
  const auto threshold = std::chrono::microseconds(threshold_us);
  const Clock::time_point start = Clock::now() + std::chrono::milliseconds(100);
  const Clock::time_point end =
      start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  std::atomic<int> pinning_failures{0};
  std::vector<std::vector<Stall>> stalls(threads);
  std::vector<std::thread> spinners;
  for (int t = 0; t < threads; ++t) {
    spinners.emplace_back(
        [&, t] { stalls[t] = Spin(cpus[t], start, end, threshold, &pinning_failures); });
  }
  // /proc/stat over the spinning itself (read from this thread, which sleeps meanwhile).
  std::this_thread::sleep_until(start);
  const std::vector<CpuTimes> times_before = ReadCpuTimes();
  std::this_thread::sleep_until(end);
  const std::vector<CpuTimes> times_after = ReadCpuTimes();
  for (std::thread& spinner : spinners) spinner.join();

  const long hz = sysconf(_SC_CLK_TCK);
  auto jiffies_ms = [&](int64_t jiffies) { return hz > 0 ? 1000.0 * jiffies / hz : -1.0; };
  // Lengths' bins, in ms: [threshold, 0.5), [0.5, 1), [1, 2), [2, 5), [5, inf).
  const std::vector<double> edges_ms = {threshold_us / 1000.0, 0.5, 1, 2, 5};
  auto bin_of = [&](double micros) {
    int b = 0;
    while (b + 1 < static_cast<int>(edges_ms.size()) && micros >= edges_ms[b + 1] * 1000) ++b;
    return b;
  };
  nlohmann::json per_thread = nlohmann::json::array();
  std::vector<double> preempted_micros, unpreempted_micros;
  for (int t = 0; t < threads; ++t) {
    std::vector<int> preempted(edges_ms.size()), not_preempted(edges_ms.size());
    double preempted_ms = 0, not_preempted_ms = 0, longest = 0;
    for (const Stall& s : stalls[t]) {
      (s.preempted ? preempted : not_preempted)[bin_of(s.micros)]++;
      (s.preempted ? preempted_ms : not_preempted_ms) += s.micros / 1000;
      (s.preempted ? preempted_micros : unpreempted_micros).push_back(s.micros);
      longest = std::max(longest, s.micros);
    }
    nlohmann::json row = {{"cpu", cpus[t]},
                          {"stalls", stalls[t].size()},
                          {"preempted_by_bin", preempted},
                          {"not_preempted_by_bin", not_preempted},
                          {"preempted_ms", preempted_ms},
                          {"not_preempted_ms", not_preempted_ms},
                          {"longest_us", longest}};
    const size_t c = static_cast<size_t>(cpus[t]);
    if (c < times_before.size() && c < times_after.size()) {
      row["steal_ms"] = jiffies_ms(times_after[c].steal - times_before[c].steal);
      row["irq_ms"] = jiffies_ms(times_after[c].irq - times_before[c].irq);
      row["softirq_ms"] = jiffies_ms(times_after[c].softirq - times_before[c].softirq);
    }
    per_thread.push_back(row);
  }
  auto rate = [&](const std::vector<double>& of, double min_us) {
    const auto n = std::count_if(of.begin(), of.end(), [&](double us) { return us >= min_us; });
    return static_cast<double>(n) / (threads * seconds);
  };
  nlohmann::json out = {
      {"threads", threads},
      {"seconds", seconds},
      {"threshold_us", threshold_us},
      {"bin_edges_ms", edges_ms},
      {"pinning_failures", pinning_failures.load()},
      {"preempted_stall_us", Percentiles(preempted_micros)},
      {"not_preempted_stall_us", Percentiles(unpreempted_micros)},
      {"per_thread_second",
       {{"preempted", rate(preempted_micros, 0)},
        {"preempted_over_2ms", rate(preempted_micros, 2000)},
        {"not_preempted", rate(unpreempted_micros, 0)},
        {"not_preempted_over_1ms", rate(unpreempted_micros, 1000)},
        {"not_preempted_over_2ms", rate(unpreempted_micros, 2000)}}},
      {"threads_at_once_preempted", ThreadsAtOnce(stalls, true)},
      {"threads_at_once_not_preempted", ThreadsAtOnce(stalls, false)},
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
