// Host allocations in huge pages (server/host_memory.h): large ones are 2 MiB-aligned mappings
// of their own, in huge pages where the host's THP mode allows it and in 4 KiB pages when
// asked; small ones are ordinary; the process-wide switch picks the default; an allocation that
// cannot be had is RESOURCE_EXHAUSTED.
#include "server/host_memory.h"

#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>

#include "gtest/gtest.h"
#include "tests/server_fixture.h"

namespace kvrecall {
namespace {

using ::kvrecall::testing::HasStatus;

bool Aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % kHugePageBytes == 0; }

// Writes a pattern over every byte and reads it back.
void ExpectWritable(const HostMemory& memory) {
  for (size_t i = 0; i < memory.size(); ++i) memory.data()[i] = static_cast<std::byte>(i * 7);
  for (size_t i = 0; i < memory.size(); ++i) {
    ASSERT_EQ(memory.data()[i], static_cast<std::byte>(i * 7)) << "byte " << i;
  }
}

// Whether the host backs MADV_HUGEPAGE mappings with huge pages.
bool HugePagesAvailable() {
  const std::string mode = TransparentHugePagesMode();
  return mode == "madvise" || mode == "always";
}

TEST(HostMemoryTest, LargeAllocationsAreAlignedMappingsOfTheirOwn) {
  const size_t bytes = 3 * kHugePageBytes + 100;
  absl::StatusOr<HostMemory> memory = AllocateHostMemory(bytes, /*huge_pages=*/true);
  ASSERT_TRUE(memory.ok()) << memory.status();
  EXPECT_TRUE(Aligned(memory->data()));
  EXPECT_EQ(memory->size(), bytes);
  EXPECT_TRUE(memory->mapped());
  EXPECT_TRUE(memory->huge_pages_requested());
  // Any kernel built with THP accepts the advice, whatever its mode (even "never").
  EXPECT_EQ(memory->huge_pages_advised(), TransparentHugePagesMode() != "unavailable");
  ExpectWritable(*memory);

  absl::StatusOr<HostMemory> small_pages = AllocateHostMemory(kHugePageBytes, false);
  ASSERT_TRUE(small_pages.ok()) << small_pages.status();
  EXPECT_TRUE(Aligned(small_pages->data()));
  EXPECT_TRUE(small_pages->mapped());
  EXPECT_FALSE(small_pages->huge_pages_requested());
  EXPECT_FALSE(small_pages->huge_pages_advised());
  ExpectWritable(*small_pages);
}

TEST(HostMemoryTest, SmallAllocationsAreOrdinary) {
  for (const size_t bytes : {size_t{0}, size_t{1}, size_t{4096}, kHugePageBytes - 1}) {
    absl::StatusOr<HostMemory> memory = AllocateHostMemory(bytes, /*huge_pages=*/true);
    ASSERT_TRUE(memory.ok()) << bytes << ": " << memory.status();
    EXPECT_NE(memory->data(), nullptr) << bytes;
    EXPECT_EQ(memory->size(), bytes);
    EXPECT_FALSE(memory->mapped()) << bytes;
    EXPECT_FALSE(memory->huge_pages_requested()) << bytes;
    ExpectWritable(*memory);
  }
}

TEST(HostMemoryTest, MovingHandsTheAllocationOver) {
  absl::StatusOr<HostMemory> memory = AllocateHostMemory(kHugePageBytes * 2, true);
  ASSERT_TRUE(memory.ok()) << memory.status();
  std::byte* const data = memory->data();
  std::memset(data, 5, memory->size());
  HostMemory moved = *std::move(memory);
  EXPECT_EQ(moved.data(), data);
  EXPECT_TRUE(moved.mapped());
  EXPECT_TRUE(moved.huge_pages_requested());
  EXPECT_EQ(moved.data()[moved.size() - 1], std::byte{5});
  EXPECT_EQ(memory->data(), nullptr);  // NOLINT: moved from, and empty
  EXPECT_EQ(memory->size(), 0u);       // NOLINT
  EXPECT_FALSE(memory->mapped());      // NOLINT
  moved = HostMemory();
  EXPECT_EQ(moved.data(), nullptr);
  EXPECT_FALSE(moved.huge_pages_requested());
}

TEST(HostMemoryTest, TheSwitchPicksTheDefault) {
  ASSERT_TRUE(HostHugePages()) << "on unless turned off";
  SetHostHugePages(false);
  absl::StatusOr<HostMemory> off = AllocateHostMemory(2 * kHugePageBytes);
  SetHostHugePages(true);
  absl::StatusOr<HostMemory> on = AllocateHostMemory(2 * kHugePageBytes);
  ASSERT_TRUE(off.ok() && on.ok());
  EXPECT_FALSE(off->huge_pages_requested());
  EXPECT_TRUE(on->huge_pages_requested());
  // Both are aligned mappings of their own: only the advice differs.
  EXPECT_TRUE(off->mapped() && Aligned(off->data()));
  EXPECT_TRUE(on->mapped() && Aligned(on->data()));
  absl::StatusOr<int64_t> off_huge = AnonHugePageBytes(off->data(), off->size());
  ASSERT_TRUE(off_huge.ok()) << off_huge.status();
  EXPECT_EQ(*off_huge, 0) << "MADV_NOHUGEPAGE keeps 4 KiB pages in every THP mode";
}

TEST(HostMemoryTest, MemoryThatCannotBeHadIsResourceExhausted) {
  // Beyond any address space; and beyond what a size_t can round up.
  EXPECT_TRUE(HasStatus(AllocateHostMemory(size_t{1} << 62, true).status(),
                        absl::StatusCode::kResourceExhausted,
                        "cannot allocate 4611686018427387904 bytes of host memory"));
  EXPECT_TRUE(HasStatus(AllocateHostMemory(SIZE_MAX, false).status(),
                        absl::StatusCode::kResourceExhausted, "bytes of host memory"));
}

TEST(HostMemoryTest, HugePagesBackTheMappingWhereTheHostAllowsThem) {
  if (!HugePagesAvailable()) {
    GTEST_SKIP() << "transparent huge pages are '" << TransparentHugePagesMode()
                 << "' on this host (/sys/kernel/mm/transparent_hugepage/enabled): the kernel "
                    "backs no mapping with them";
  }
  // Two whole huge pages, then 8 KiB past the last boundary, which stay small pages.
  const size_t bytes = 2 * kHugePageBytes + 8192;
  absl::StatusOr<HostMemory> memory = AllocateHostMemory(bytes, /*huge_pages=*/true);
  ASSERT_TRUE(memory.ok()) << memory.status();
  ASSERT_TRUE(memory->huge_pages_advised());
  absl::StatusOr<int64_t> huge = AnonHugePageBytes(memory->data(), memory->size());
  ASSERT_TRUE(huge.ok()) << huge.status();
  // Populated at allocation (after the advice): at least one huge page, at most the two whole
  // ones (defragmentation may fail to find a second on a busy host).
  EXPECT_GE(*huge, static_cast<int64_t>(kHugePageBytes));
  EXPECT_LE(*huge, static_cast<int64_t>(2 * kHugePageBytes));
}

TEST(HostMemoryTest, TheModeIsTheBracketedWord) {
  std::ifstream file("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string line;
  if (!std::getline(file, line)) {
    EXPECT_EQ(TransparentHugePagesMode(), "unavailable");
    return;
  }
  const std::string mode = TransparentHugePagesMode();
  EXPECT_TRUE(mode == "always" || mode == "madvise" || mode == "never") << mode;
  EXPECT_NE(line.find("[" + mode + "]"), std::string::npos) << line;
}

}  // namespace
}  // namespace kvrecall
