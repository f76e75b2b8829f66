// Summary statistics of measured samples (latencies, per-head fidelity) as the reports print
// them: mean and percentiles.
#ifndef KVRECALL_CLIENT_STATS_H_
#define KVRECALL_CLIENT_STATS_H_

#include <span>

namespace kvrecall::client {

// The q-quantile (q in [0, 1]) of `samples` with linear interpolation between order
// statistics (numpy's default); 0 for no samples. Sorts a copy.
double Percentile(std::span<const double> samples, double q);

double Mean(std::span<const double> samples);

}  // namespace kvrecall::client

#endif  // KVRECALL_CLIENT_STATS_H_
