#include "kernels/cpu/mapped_memory.h"

#include <cstdint>
#include <numeric>

#include "gtest/gtest.h"

namespace kvrecall::cpu {
namespace {

TEST(MappedMemoryTest, LargeBuffersAreWholeAlignedHugePageRangesAndHoldTheirData) {
  // 3 MiB of int32 asks for 2 huge pages' worth; a small buffer is an ordinary allocation.
  MappedVector<int32_t> large(3 << 18);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(large.data()) % kMappedAllocationBytes, 0u);
  EXPECT_EQ(MappedCapacityBytes(large), int64_t{4} << 20);
  std::iota(large.begin(), large.end(), 0);
  int64_t sum = 0;
  for (int32_t x : large) sum += x;
  const int64_t n = large.size();
  EXPECT_EQ(sum, n * (n - 1) / 2);

  MappedVector<int32_t> small(1000, 7);
  EXPECT_EQ(MappedCapacityBytes(small), 4000);
  EXPECT_EQ(small[999], 7);

  // Growing past the threshold moves the data into a mapped buffer.
  small.resize(size_t{1} << 20, 1);
  EXPECT_EQ(small[999], 7);
  EXPECT_EQ(small.back(), 1);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(small.data()) % kMappedAllocationBytes, 0u);
}

TEST(MappedMemoryTest, MappedBytesRoundsLargeSizesUpToWholeHugePages) {
  EXPECT_EQ(MappedBytes(0), 0u);
  EXPECT_EQ(MappedBytes(kMappedAllocationBytes - 1), kMappedAllocationBytes - 1);
  EXPECT_EQ(MappedBytes(kMappedAllocationBytes), kMappedAllocationBytes);
  EXPECT_EQ(MappedBytes(kMappedAllocationBytes + 1), 2 * kMappedAllocationBytes);
}

}  // namespace
}  // namespace kvrecall::cpu
