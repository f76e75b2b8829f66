// The benchmarks' integer-list flags (bench/int_list.h): what they accept and how they refuse.
#include "bench/int_list.h"

#include <cstdint>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server_fixture.h"

namespace kvrecall {
namespace {

using ::testing::ElementsAre;
using testing::HasStatus;

TEST(BenchIntListTest, ReadsTheListInOrderSkippingEmptyItems) {
  absl::StatusOr<std::vector<int>> list = bench::ParseIntList("batches", "8,1,,16,");
  ASSERT_TRUE(list.ok()) << list.status();
  EXPECT_THAT(*list, ElementsAre(8, 1, 16));
  absl::StatusOr<std::vector<int64_t>> wide =
      bench::ParseIntList<int64_t>("contexts", "4294967296", 1);
  ASSERT_TRUE(wide.ok()) << wide.status();
  EXPECT_THAT(*wide, ElementsAre(int64_t{4294967296}));
  absl::StatusOr<std::vector<int>> zero = bench::ParseIntList("gaps_us", "0,250", 0);
  ASSERT_TRUE(zero.ok()) << zero.status();
  EXPECT_THAT(*zero, ElementsAre(0, 250));
}

TEST(BenchIntListTest, RefusesByFlagAndItem) {
  EXPECT_TRUE(HasStatus(bench::ParseIntList("batches", "1,x").status(),
                        absl::StatusCode::kInvalidArgument,
                        "--batches: 'x' is not an integer of at least 1"));
  EXPECT_TRUE(HasStatus(bench::ParseIntList("threads", "0").status(),
                        absl::StatusCode::kInvalidArgument, "--threads: '0'"));
  EXPECT_TRUE(HasStatus(bench::ParseIntList("gaps_us", "-1", 0).status(),
                        absl::StatusCode::kInvalidArgument, "'-1' is not an integer of at least 0"));
  EXPECT_TRUE(HasStatus(bench::ParseIntList("top_ks", "2.5").status(),
                        absl::StatusCode::kInvalidArgument, "'2.5'"));
  // Past int: refused, not wrapped.
  EXPECT_TRUE(HasStatus(bench::ParseIntList("contexts", "4294967296").status(),
                        absl::StatusCode::kInvalidArgument, "'4294967296'"));
  EXPECT_TRUE(HasStatus(bench::ParseIntList("contexts", ",,").status(),
                        absl::StatusCode::kInvalidArgument, "--contexts: an empty list"));
}

}  // namespace
}  // namespace kvrecall
