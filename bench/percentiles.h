// The percentiles a benchmark prints of a list of samples (as JSON): p50, p90, p99, p99.9, max
// and mean; null for no samples. Interpolated as every tool's are (client/stats.h).
#ifndef KVRECALL_BENCH_PERCENTILES_H_
#define KVRECALL_BENCH_PERCENTILES_H_

#include <algorithm>
#include <vector>

#include "client/stats.h"
#include "nlohmann/json.hpp"

namespace kvrecall {

inline nlohmann::json Percentiles(const std::vector<double>& v) {
  if (v.empty()) return nullptr;
  auto at = [&](double q) { return client::Percentile(v, q); };
  return {{"p50", at(0.50)},  {"p90", at(0.90)},
          {"p99", at(0.99)},  {"p999", at(0.999)},
          {"max", *std::max_element(v.begin(), v.end())}, {"mean", client::Mean(v)}};
}

}  // namespace kvrecall

#endif  // KVRECALL_BENCH_PERCENTILES_H_
