// The one percentile every tool quotes (client/stats.h, and bench/percentiles.h's JSON through
// it): numpy's linear interpolation between order statistics. (bench/percentiles.h once took
// the sample at floor(q * n): p99 of 100 samples was their maximum, p50 of an even count the
// upper middle one; probe 24.)
#include <cmath>
#include <numeric>
#include <vector>

#include "bench/percentiles.h"
#include "client/stats.h"
#include "gtest/gtest.h"

namespace kvrecall {
namespace {

// 1, 2, ..., n, shuffled by a stride so that the order statistics must be sorted.
std::vector<double> OneTo(int n) {
  std::vector<double> v(n);
  for (int i = 0; i < n; ++i) v[i] = 1 + (i * 7919) % n;
  return v;
}

TEST(PercentileTest, InterpolatesAsNumpyDoes) {
  // numpy.percentile(np.arange(1, n + 1), [50, 90, 99])
  struct Case {
    int n;
    double p50, p90, p99;
  };
  for (const Case& c : {Case{2, 1.5, 1.9, 1.99}, Case{10, 5.5, 9.1, 9.91},
                        Case{100, 50.5, 90.1, 99.01}, Case{1000, 500.5, 900.1, 990.01}}) {
    const std::vector<double> v = OneTo(c.n);
    EXPECT_NEAR(client::Percentile(v, 0.50), c.p50, 1e-9) << c.n;
    EXPECT_NEAR(client::Percentile(v, 0.90), c.p90, 1e-9) << c.n;
    EXPECT_NEAR(client::Percentile(v, 0.99), c.p99, 1e-9) << c.n;
    const nlohmann::json j = Percentiles(v);
    EXPECT_NEAR(j["p50"].get<double>(), c.p50, 1e-9) << c.n;
    EXPECT_NEAR(j["p90"].get<double>(), c.p90, 1e-9) << c.n;
    EXPECT_NEAR(j["p99"].get<double>(), c.p99, 1e-9) << c.n;
    EXPECT_LT(j["p99"].get<double>(), j["max"].get<double>()) << c.n;
    EXPECT_EQ(j["max"].get<double>(), c.n);
    EXPECT_NEAR(j["mean"].get<double>(), (c.n + 1) / 2.0, 1e-9);
  }
}

TEST(PercentileTest, EdgesOfTheSamples) {
  EXPECT_EQ(client::Percentile({}, 0.5), 0.0);
  EXPECT_EQ(client::Mean({}), 0.0);
  EXPECT_TRUE(Percentiles({}).is_null());
  const std::vector<double> one{42.0};
  EXPECT_EQ(client::Percentile(one, 0.0), 42.0);
  EXPECT_EQ(client::Percentile(one, 0.99), 42.0);
  const std::vector<double> v = OneTo(10);
  EXPECT_EQ(client::Percentile(v, 0.0), 1.0);
  EXPECT_EQ(client::Percentile(v, 1.0), 10.0);
}

}  // namespace
}  // namespace kvrecall
