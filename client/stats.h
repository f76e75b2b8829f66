// Summary statistics of measured samples (latencies, per-head fidelity) as the reports print
// them: mean and percentiles. One definition for every tool that quotes a percentile (the CLI's
// replay, the benches' JSON through bench/percentiles.h).
#ifndef KVRECALL_CLIENT_STATS_H_
#define KVRECALL_CLIENT_STATS_H_

#include <algorithm>
#include <cmath>
#include <span>
#include <vector>

namespace kvrecall::client {

// The q-quantile (q in [0, 1]) of `samples` with linear interpolation between order
// statistics (numpy's default): p50 of an even count is the mean of the middle two, p99 of 100
// samples lies between the two largest. 0 for no samples. Sorts a copy.
inline double Percentile(std::span<const double> samples, double q) {
  if (samples.empty()) return 0.0;
  std::vector<double> sorted(samples.begin(), samples.end());
  std::sort(sorted.begin(), sorted.end());
  const double rank = std::clamp(q, 0.0, 1.0) * static_cast<double>(sorted.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(rank));
  const size_t hi = std::min(lo + 1, sorted.size() - 1);
  return sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - static_cast<double>(lo));
}

// 0 for no samples.
inline double Mean(std::span<const double> samples) {
  if (samples.empty()) return 0.0;
  double sum = 0.0;
  for (double x : samples) sum += x;
  return sum / static_cast<double>(samples.size());
}

}  // namespace kvrecall::client

#endif  // KVRECALL_CLIENT_STATS_H_
