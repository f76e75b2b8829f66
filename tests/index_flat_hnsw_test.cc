// The two baselines behind the KeyIndex interface: the flat scan (exact) and hnswlib (K->K).
#include <cstdint>
#include <memory>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "index/flat_index.h"
#include "index/hnsw_index.h"
#include "kernels/fidelity.h"
#include "tests/test_util.h"

namespace kvrecall {
namespace {

using ::kvrecall::testing::RandomKv;
using ::kvrecall::testing::RandomNormal;
using ::kvrecall::testing::ReferenceTopK;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

TEST(FlatIndexTest, IsExactAgainstBruteForceAndScoresEveryKey) {
  const int64_t tokens = 3000;
  const int d = 32, k = 25;
  RandomKv kv(tokens, 2, d, 3);
  const VectorSet keys = VectorSet::KeysOf(kv.view(), 1, 0, tokens);
  FlatIndex flat;
  ASSERT_TRUE(flat.Build(keys, BuildQueries{}).ok());
  EXPECT_EQ(flat.size(), tokens);
  EXPECT_EQ(flat.MemoryBytes(), 0);
  std::vector<float> q = RandomNormal(10 * d, 4, 2.0f);
  for (int i = 0; i < 10; ++i) {
    SearchResult result;
    flat.Search(keys, q.data() + i * d, k, SearchParams{}, &result);
    EXPECT_THAT(result.ids, ElementsAreArray(ReferenceTopK(q.data() + i * d, kv.view(), 1, 1.0, k)));
    ASSERT_EQ(result.scores.size(), result.ids.size());
    for (size_t j = 0; j < result.ids.size(); ++j) {
      double dot = 0;
      for (int x = 0; x < d; ++x) dot += static_cast<double>(q[i * d + x]) * keys.row(result.ids[j])[x];
      EXPECT_NEAR(result.scores[j], dot, 1e-3);
    }
    EXPECT_EQ(result.stats.scored, tokens);
    EXPECT_EQ(result.stats.hops, 0);
  }
}

TEST(FlatIndexTest, AddExtendsTheScanAndRejectsAShrunkSet) {
  RandomKv kv(100, 1, 8, 1);
  const VectorSet all = VectorSet::KeysOf(kv.view(), 0, 0, 100);
  FlatIndex flat;
  ASSERT_TRUE(flat.Build(all.Slice(0, 60), BuildQueries{}).ok());
  ASSERT_TRUE(flat.Add(all, VectorSet{}).ok());
  EXPECT_EQ(flat.size(), 100);
  std::vector<float> q = RandomNormal(8, 2);
  SearchResult result;
  flat.Search(all, q.data(), 100, SearchParams{}, &result);
  EXPECT_THAT(result.ids, ElementsAreArray(ReferenceTopK(q.data(), kv.view(), 0, 1.0, 100)));

  const absl::Status s = flat.Add(all.Slice(0, 50), VectorSet{});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("holds 100 keys; got a set of 50"));
}

TEST(HnswIndexTest, FindsTheTopKThroughTheSameInterface) {
  const int64_t tokens = 4000;
  const int d = 16, k = 10;
  RandomKv kv(tokens, 2, d, 11);
  const VectorSet keys = VectorSet::KeysOf(kv.view(), 0, 0, tokens);
  std::unique_ptr<KeyIndex> index = std::make_unique<HnswIndex>(HnswParams{});
  EXPECT_STREQ(index->name(), "hnsw");
  ASSERT_TRUE(index->Build(keys, BuildQueries{}).ok());
  EXPECT_EQ(index->size(), tokens);
  // hnswlib holds its own copy of every key.
  EXPECT_GT(index->MemoryBytes(), tokens * d * static_cast<int64_t>(sizeof(float)));

  // In-distribution queries (keys' own distribution) with a generous list: near-exact.
  std::vector<float> q = RandomNormal(50 * d, 12);
  std::vector<uint8_t> marks;
  double recall = 0;
  int64_t scored = 0;
  for (int i = 0; i < 50; ++i) {
    SearchResult result;
    index->Search(keys, q.data() + i * d, k, SearchParams{400}, &result);
    ASSERT_EQ(result.ids.size(), static_cast<size_t>(k));
    const std::vector<int32_t> exact = ReferenceTopK(q.data() + i * d, kv.view(), 0, 1.0, k);
    recall += SupportRecall(result.ids, exact, tokens, &marks);
    scored += result.stats.scored;
    for (size_t j = 1; j < result.scores.size(); ++j) {
      EXPECT_GE(result.scores[j - 1], result.scores[j]);  // best first
    }
  }
  EXPECT_GE(recall / 50, 0.95);
  EXPECT_GT(scored, 0);
  EXPECT_LT(scored / 50, tokens);  // a graph search, not a scan
}

TEST(HnswIndexTest, AddedKeysAreFound) {
  const int d = 16;
  RandomKv kv(3000, 1, d, 21);
  const VectorSet all = VectorSet::KeysOf(kv.view(), 0, 0, 3000);
  HnswIndex index(HnswParams{});
  ASSERT_TRUE(index.Build(all.Slice(0, 1000), BuildQueries{}).ok());
  ASSERT_TRUE(index.Add(all, VectorSet{}).ok());
  EXPECT_EQ(index.size(), 3000);
  // Each added key, as a query scaled up, has itself among its best matches.
  int found = 0;
  for (int64_t t = 1000; t < 3000; t += 97) {
    std::vector<float> q(all.row(t), all.row(t) + d);
    const std::vector<int32_t> exact = ReferenceTopK(q.data(), kv.view(), 0, 1.0, 1);
    SearchResult result;
    index.Search(all, q.data(), 5, SearchParams{200}, &result);
    found += std::find(result.ids.begin(), result.ids.end(), exact[0]) != result.ids.end();
  }
  EXPECT_EQ(found, 21);
}

TEST(HnswIndexTest, RejectsBadParameters) {
  RandomKv kv(10, 1, 8, 1);
  HnswIndex index(HnswParams{1, 10, 10});
  const absl::Status s = index.Build(VectorSet::KeysOf(kv.view(), 0, 0, 10), BuildQueries{});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("hnsw needs m >= 2"));
  const absl::Status add = HnswIndex(HnswParams{}).Add(VectorSet{}, VectorSet{});
  EXPECT_EQ(add.code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace kvrecall
