// The percentiles a benchmark prints of a list of samples (as JSON): p50, p90, p99, p99.9, max
// and mean; null for no samples.
#ifndef KVRECALL_BENCH_PERCENTILES_H_
#define KVRECALL_BENCH_PERCENTILES_H_

#include <algorithm>
#include <vector>

#include "nlohmann/json.hpp"

namespace kvrecall {

inline nlohmann::json Percentiles(std::vector<double> v) {
  if (v.empty()) return nullptr;
  std::sort(v.begin(), v.end());
  auto at = [&](double p) {
    return v[std::min<size_t>(v.size() - 1, static_cast<size_t>(p * v.size()))];
  };
  double sum = 0;
  for (double x : v) sum += x;
  return {{"p50", at(0.50)},  {"p90", at(0.90)}, {"p99", at(0.99)},
          {"p999", at(0.999)}, {"max", v.back()}, {"mean", sum / v.size()}};
}

}  // namespace kvrecall

#endif  // KVRECALL_BENCH_PERCENTILES_H_
