#include "index/batch_topk.h"

#include <omp.h>

#include <cstdint>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/test_util.h"

namespace kvrecall {
namespace {

using ::kvrecall::testing::RandomKv;
using ::kvrecall::testing::RandomNormal;
using ::kvrecall::testing::ReferenceTopK;
using ::kvrecall::testing::StopAfterAsks;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

// Queries of one head of a [n, q_heads, d] buffer, read in place like a prompt's.
VectorSet QueriesOf(const std::vector<float>& q, int64_t n, int q_heads, int d, int head) {
  return VectorSet{q.data() + head * d, n, static_cast<int64_t>(q_heads) * d, d};
}

TEST(CpuBatchTopKTest, MatchesBruteForceOverStridedKeysAndQueries) {
  // More keys than one GEMM block and a query count that is not a multiple of the query block.
  const int64_t tokens = 9000, queries = 150;
  const int kv_heads = 2, q_heads = 4, d = 24, k = 37;
  RandomKv kv(tokens, kv_heads, d, 5);
  std::vector<float> q = RandomNormal(queries * q_heads * d, 6, 2.0f);
  for (int head : {0, 3}) {
    const int kv_head = head / 2;
    TopKLists lists;
    ASSERT_TRUE(CpuBatchTopK(QueriesOf(q, queries, q_heads, d, head),
                             VectorSet::KeysOf(kv.view(), kv_head, 0, tokens), k, &lists)
                    .ok());
    ASSERT_EQ(lists.k, k);
    ASSERT_EQ(lists.queries, queries);
    for (int64_t i = 0; i < queries; ++i) {
      const std::vector<int32_t> expected =
          ReferenceTopK(q.data() + (i * q_heads + head) * d, kv.view(), kv_head, 1.0, k);
      EXPECT_THAT(std::vector<int32_t>(lists.list(i), lists.list(i) + k),
                  ElementsAreArray(expected))
          << "query " << i << " head " << head;
    }
  }
}

TEST(CpuBatchTopKTest, CausalMaskLimitsEachQueryToItsVisibleKeys) {
  const int64_t tokens = 5000, queries = 70;
  const int d = 16, k = 20;
  RandomKv kv(tokens, 1, d, 8);
  std::vector<float> q = RandomNormal(queries * d, 9);
  std::vector<int64_t> visible(queries);
  for (int64_t i = 0; i < queries; ++i) visible[i] = i * 73;  // 0 .. 5037 (clipped to tokens)
  TopKLists lists;
  ASSERT_TRUE(CpuBatchTopK(QueriesOf(q, queries, 1, d, 0),
                           VectorSet::KeysOf(kv.view(), 0, 0, tokens), k, &lists, visible)
                  .ok());
  for (int64_t i = 0; i < queries; ++i) {
    KvView prefix = kv.view();
    prefix.tokens = std::min(visible[i], tokens);
    std::vector<int32_t> expected = ReferenceTopK(q.data() + i * d, prefix, 0, 1.0, k);
    expected.resize(k, -1);  // shorter lists are padded
    EXPECT_THAT(std::vector<int32_t>(lists.list(i), lists.list(i) + k),
                ElementsAreArray(expected))
        << "query " << i << " sees " << visible[i];
  }
}

// 16-bit keys (widened a block at a time): the lists of their values, against brute force over
// the stored values, strided and past one GEMM block, with a causal mask.
TEST(CpuBatchTopKTest, SixteenBitKeysGiveTheListsOfTheirValues) {
  const int64_t tokens = 5000, queries = 70;
  const int kv_heads = 2, q_heads = 2, d = 24, k = 15;
  const RandomKv f32(tokens, kv_heads, d, 12);
  std::vector<float> q = RandomNormal(queries * q_heads * d, 13, 2.0f);
  std::vector<int64_t> visible(queries);
  for (int64_t i = 0; i < queries; ++i) visible[i] = 100 + i * 70;
  for (const KvElement element : {KvElement::kBf16, KvElement::kF16}) {
    const testing::NarrowedKv stored(f32, element);
    TopKLists lists;
    ASSERT_TRUE(CpuBatchTopK(QueriesOf(q, queries, q_heads, d, 1),
                             VectorSet::KeysOf(stored.view(), 1, 0, tokens), k, &lists, visible)
                    .ok());
    for (int64_t i = 0; i < queries; ++i) {
      const KvView prefix = stored.view().Tokens(0, std::min(visible[i], tokens));
      EXPECT_THAT(std::vector<int32_t>(lists.list(i), lists.list(i) + k),
                  ElementsAreArray(ReferenceTopK(q.data() + (i * q_heads + 1) * d, prefix, 1, 1.0,
                                                 k)))
          << KvElementName(element) << " query " << i;
    }
  }
}

TEST(CpuBatchTopKTest, KLargerThanTheKeysReturnsEveryKey) {
  RandomKv kv(10, 1, 8, 1);
  std::vector<float> q = RandomNormal(3 * 8, 2);
  TopKLists lists;
  ASSERT_TRUE(
      CpuBatchTopK(QueriesOf(q, 3, 1, 8, 0), VectorSet::KeysOf(kv.view(), 0, 0, 10), 50, &lists)
          .ok());
  EXPECT_EQ(lists.k, 10);
  EXPECT_THAT(std::vector<int32_t>(lists.list(2), lists.list(2) + 10),
              ElementsAreArray(ReferenceTopK(q.data() + 16, kv.view(), 0, 1.0, 10)));
}

// A build nobody will use stops (index/build_stop.h): the batch top-k asks before each block of
// queries, computes no block once the stop is requested, and ends with CANCELLED; a stop never
// requested is asked before every block and changes nothing.
TEST(CpuBatchTopKTest, AStopRequestedMidwayEndsItWithCancelled) {
  const int64_t tokens = 3000, queries = 40 * 64;  // 40 blocks of 64 queries
  const int d = 16, k = 10;
  const int threads = omp_get_max_threads();
  RandomKv kv(tokens, 1, d, 3);
  const std::vector<float> q = RandomNormal(queries * d, 4);
  const VectorSet keys = VectorSet::KeysOf(kv.view(), 0, 0, tokens);
  for (const int from : {1, 5}) {
    SCOPED_TRACE(from);
    StopAfterAsks stop(from);
    TopKLists lists;
    const absl::Status s =
        CpuBatchTopK(QueriesOf(q, queries, 1, d, 0), keys, k, &lists, {}, stop.stop());
    EXPECT_EQ(s.code(), absl::StatusCode::kCancelled) << s;
    EXPECT_THAT(s.message(), HasSubstr("the batch top-k stopped"));
    // The other threads may each have asked once before they saw it.
    EXPECT_GE(stop.asks(), from);
    EXPECT_LE(stop.asks(), from + threads - 1);
  }
  StopAfterAsks never(0);
  TopKLists asked, plain;
  ASSERT_TRUE(
      CpuBatchTopK(QueriesOf(q, queries, 1, d, 0), keys, k, &asked, {}, never.stop()).ok());
  ASSERT_TRUE(CpuBatchTopK(QueriesOf(q, queries, 1, d, 0), keys, k, &plain).ok());
  EXPECT_EQ(never.asks(), 40);
  EXPECT_EQ(asked.ids, plain.ids);
}

TEST(CpuBatchTopKTest, RejectsBadArguments) {
  RandomKv kv(10, 1, 8, 1);
  std::vector<float> q = RandomNormal(3 * 8, 2);
  const VectorSet keys = VectorSet::KeysOf(kv.view(), 0, 0, 10);
  TopKLists lists;
  absl::Status s = CpuBatchTopK(QueriesOf(q, 3, 1, 8, 0), keys, 0, &lists);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("k >= 1, got 0"));

  s = CpuBatchTopK(VectorSet{q.data(), 3, 4, 4}, keys, 5, &lists);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("query dim 4 differs from key dim 8"));

  const std::vector<int64_t> visible = {1, 2};
  s = CpuBatchTopK(QueriesOf(q, 3, 1, 8, 0), keys, 5, &lists, visible);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("causal mask of 2 counts for 3 queries"));

  const std::vector<uint16_t> half_queries(3 * 8, 0);
  s = CpuBatchTopK(VectorSet{half_queries.data(), 3, 8, 8, KvElement::kBf16}, keys, 5, &lists);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("queries must be f32, got bf16"));
}

}  // namespace
}  // namespace kvrecall
