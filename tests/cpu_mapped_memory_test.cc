#include "kernels/cpu/mapped_memory.h"

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <numeric>
#include <sstream>
#include <string>

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

// The VmFlags of the mapping holding `p` in /proc/self/smaps ("" when none is found).
std::string VmFlagsOf(const void* p) {
  std::ifstream smaps("/proc/self/smaps");
  const auto at = reinterpret_cast<uintptr_t>(p);
  std::string line;
  bool inside = false;
  while (std::getline(smaps, line)) {
    unsigned long begin = 0, end = 0;  // NOLINT(runtime/int): sscanf's %lx
    if (std::sscanf(line.c_str(), "%lx-%lx ", &begin, &end) == 2 && line.find(' ') > 8) {
      inside = begin <= at && at < end;
    } else if (inside && line.rfind("VmFlags:", 0) == 0) {
      return line.substr(8) + " ";
    }
  }
  return "";
}

// --host_huge_pages=false reaches the graph index's buffers too: they were advised huge pages
// whatever the switch said (the switch was the host KV's alone).
TEST(MappedMemoryTest, TheHostSwitchDecidesTheAdvice) {
  ASSERT_TRUE(HostHugePages()) << "on unless turned off";
  SetHostHugePages(false);
  MappedVector<int32_t> off(1 << 20);
  SetHostHugePages(true);
  MappedVector<int32_t> on(1 << 20);
  const std::string off_flags = VmFlagsOf(off.data());
  const std::string on_flags = VmFlagsOf(on.data());
  ASSERT_NE(off_flags, "");
  EXPECT_NE(off_flags.find(" nh "), std::string::npos) << off_flags;
  EXPECT_EQ(off_flags.find(" hg "), std::string::npos) << off_flags;
  if (on_flags.find(" hg ") == std::string::npos) {
    GTEST_SKIP() << "this kernel does not take MADV_HUGEPAGE: " << on_flags;
  }
  EXPECT_EQ(on_flags.find(" nh "), std::string::npos) << on_flags;
}

TEST(MappedMemoryTest, MappedBytesRoundsLargeSizesUpToWholeHugePages) {
  EXPECT_EQ(MappedBytes(0), 0u);
  EXPECT_EQ(MappedBytes(kMappedAllocationBytes - 1), kMappedAllocationBytes - 1);
  EXPECT_EQ(MappedBytes(kMappedAllocationBytes), kMappedAllocationBytes);
  EXPECT_EQ(MappedBytes(kMappedAllocationBytes + 1), 2 * kMappedAllocationBytes);
}

}  // namespace
}  // namespace kvrecall::cpu
