// The GPU shortlist of product-quantized keys (kernels/cuda/pq_shortlist.h) against its CPU
// reference (ProductQuantizer::QueryTable + ScanCodes, index/product_quantizer.h, then the top
// `shortlist` by cpu::TopKPositions): the same positions up to near-ties, the same scores, over
// ragged rows of several code sets (8-byte codes and the general path); misfits refused.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <set>
#include <tuple>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "index/product_quantizer.h"
#include "kernels/cpu/attention.h"
#include "kernels/cuda/pq_shortlist.h"
#include "kernels/cuda/topk_workspace.h"
#include "tests/cuda_test_util.h"
#include "tests/test_util.h"

namespace kvrecall {
namespace {

using ::kvrecall::testing::kTieTolerance;
using ::kvrecall::testing::RandomNormal;
using ::kvrecall::testing::ToDevice;
using ::kvrecall::testing::ToHost;
using ::testing::HasSubstr;

constexpr int kDim = 64;
constexpr int kSets = 3;
constexpr int kKeys = 9000;  // per set: three blocks of the scan, the last one partial
constexpr int kShortlist = 300;

struct CodeSets {
  std::vector<ProductQuantizer> quantizers;
  std::vector<float> codebooks;  // [sets, M, 256, dim / M]
  std::vector<uint8_t> codes;    // [sets, kKeys, M]
};

CodeSets MakeCodeSets(int subspaces) {
  CodeSets out;
  ProductQuantizerParams params;
  params.subspaces = subspaces;
  params.iterations = 3;
  params.training_keys = 4096;
  for (int s = 0; s < kSets; ++s) {
    const std::vector<float> keys = RandomNormal(kKeys * kDim, 10 + s);
    const VectorSet set{keys.data(), kKeys, kDim, kDim, KvElement::kF32};
    absl::StatusOr<ProductQuantizer> pq = ProductQuantizer::Train(set, params);
    EXPECT_TRUE(pq.ok()) << pq.status();
    out.codebooks.insert(out.codebooks.end(), pq->codebooks().begin(), pq->codebooks().end());
    const size_t at = out.codes.size();
    out.codes.resize(at + size_t{kKeys} * subspaces);
    pq->Encode(set, out.codes.data() + at);
    out.quantizers.push_back(*std::move(pq));
  }
  return out;
}

// (code bytes M, rows per group).
class PqShortlistTest : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(PqShortlistTest, MatchesTheCpuReference) {
  KVRECALL_SKIP_WITHOUT_GPU();
  const auto [subspaces, group] = GetParam();
  const CodeSets sets = MakeCodeSets(subspaces);
  // Ragged groups of rows over the sets: full, partial, single, empty, shorter than the
  // shortlist; each row of a group has its own query.
  const std::vector<int32_t> set_of_group = {0, 1, 2, 0, 1, 2, 1};
  const std::vector<int32_t> length_of_group = {kKeys, 4097, kKeys - 5, 0, 1, 250, 4096};
  std::vector<int32_t> set_of_row, lengths;
  for (size_t g = 0; g < set_of_group.size(); ++g) {
    set_of_row.insert(set_of_row.end(), group, set_of_group[g]);
    lengths.insert(lengths.end(), group, length_of_group[g]);
  }
  const int rows = static_cast<int>(set_of_row.size());
  const std::vector<float> queries = RandomNormal(rows * kDim, 20);

  auto ws = cuda::TopKWorkspace::Create(rows, kKeys);
  ASSERT_TRUE(ws.ok()) << ws.status();
  auto d_books = ToDevice(sets.codebooks);
  auto d_codes = ToDevice(sets.codes);
  auto d_queries = ToDevice(queries);
  auto d_sets = ToDevice(set_of_row);
  auto d_lengths = ToDevice(lengths);
  auto d_ids = ToDevice(std::vector<int32_t>(rows * kShortlist, -1));
  auto d_sizes = ToDevice(std::vector<int32_t>(rows, -1));
  auto d_scores = ToDevice(std::vector<float>(rows * kShortlist, -1.0f));
  auto d_tables = ToDevice(std::vector<float>(rows * subspaces * ProductQuantizer::kCentroids));
  const cuda::PqCodeSets code_sets{d_books.data(), d_codes.data(), kKeys, subspaces, kDim};
  const cuda::PqShortlistRows query_rows{d_queries.data(), d_sets.data(), d_lengths.data(),
                                         d_tables.data(),  rows,          kKeys,
                                         group};
  ASSERT_TRUE(cuda::PqShortlist(code_sets, query_rows, kShortlist, ws->get(), d_ids.data(),
                                d_sizes.data(), d_scores.data(), nullptr)
                  .ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<int32_t> ids = ToHost(d_ids.data(), d_ids.size());
  const std::vector<int32_t> sizes = ToHost(d_sizes.data(), d_sizes.size());
  const std::vector<float> id_scores = ToHost(d_scores.data(), d_scores.size());

  std::vector<float> table(subspaces * ProductQuantizer::kCentroids), scores(kKeys);
  std::vector<int32_t> expected;
  for (int r = 0; r < rows; ++r) {
    const ProductQuantizer& pq = sets.quantizers[set_of_row[r]];
    const int n = lengths[r];
    pq.QueryTable(queries.data() + r * kDim, table.data());
    const uint8_t* codes =
        sets.codes.data() + static_cast<size_t>(set_of_row[r]) * kKeys * subspaces;
    ProductQuantizer::ScanCodes(table.data(), codes, n, subspaces, scores.data());
    cpu::TopKPositions(std::span<const float>(scores.data(), n), kShortlist, &expected);
    ASSERT_EQ(sizes[r], static_cast<int>(expected.size())) << "row " << r;
    const float kth = expected.empty() ? 0.0f : scores[expected.back()];
    const std::set<int32_t> want(expected.begin(), expected.end());
    std::set<int32_t> got;
    for (int j = 0; j < sizes[r]; ++j) {
      const int32_t id = ids[r * kShortlist + j];
      ASSERT_TRUE(id >= 0 && id < n) << "row " << r << " id " << id;
      EXPECT_TRUE(got.insert(id).second) << "row " << r << " lists " << id << " twice";
      EXPECT_NEAR(id_scores[r * kShortlist + j], scores[id], 1e-5f * (1.0f + std::abs(scores[id])));
      // Either the reference's too, or a near-tie of its last.
      if (!want.count(id)) {
        EXPECT_NEAR(scores[id], kth, kTieTolerance * (1.0f + std::abs(kth)))
            << "row " << r << " id " << id;
      }
    }
  }
}

// Groups of 1, 2, 4 rows per scan block, and of 8 (two blocks of 4 read each code).
INSTANTIATE_TEST_SUITE_P(CodeBytesAndGroups, PqShortlistTest,
                         ::testing::Combine(::testing::Values(8, 4, 16),
                                            ::testing::Values(1, 2, 4, 8)),
                         [](const ::testing::TestParamInfo<std::tuple<int, int>>& info) {
                           return "M" + std::to_string(std::get<0>(info.param)) + "Group" +
                                  std::to_string(std::get<1>(info.param));
                         });

TEST(PqShortlistErrorsTest, MisfitsAreRefused) {
  KVRECALL_SKIP_WITHOUT_GPU();
  auto ws = cuda::TopKWorkspace::Create(2, 1000);
  ASSERT_TRUE(ws.ok());
  // Room for one set's codebooks (M x 256 x dim / M floats), which the successful runs read.
  auto buffer = ToDevice(std::vector<float>(256 * kDim, 0.0f));
  auto codes = ToDevice(std::vector<uint8_t>(8 * 2000, 0));
  auto set_of_row = ToDevice(std::vector<int32_t>(2, 0));
  // The outputs apart from the inputs: a successful run writes them.
  auto ids = ToDevice(std::vector<int32_t>(2 * 10, 0));
  auto sizes = ToDevice(std::vector<int32_t>(2, 0));
  cuda::PqCodeSets sets{buffer.data(), codes.data(), 1000, 8, kDim};
  cuda::PqShortlistRows rows{buffer.data(), set_of_row.data(), nullptr, buffer.data(), 2, 1000};
  auto run = [&](int shortlist) {
    return cuda::PqShortlist(sets, rows, shortlist, ws->get(), ids.data(), sizes.data(), nullptr,
                             nullptr);
  };
  EXPECT_TRUE(run(10).ok());
  auto expect_invalid = [](const absl::Status& status, const char* what) {
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << what;
    EXPECT_THAT(std::string(status.message()), HasSubstr(what));
  };
  expect_invalid(run(0), "shortlist >= 1");
  sets.subspaces = 3;  // does not divide 64
  expect_invalid(run(10), "subspaces=3 dim=64");
  sets.subspaces = 8;
  sets.set_stride = 999;  // shorter than the rows
  expect_invalid(run(10), "set_stride >= max_length");
  sets.set_stride = 2000;
  rows.max_length = 2000;  // beyond the workspace
  EXPECT_EQ(run(10).code(), absl::StatusCode::kInvalidArgument);
  rows.max_length = 1000;
  rows.tables = nullptr;
  expect_invalid(run(10), "tables");
  rows.tables = buffer.data();
  rows.group = 3;  // does not divide the 2 rows
  expect_invalid(run(10), "2 rows in groups of 3");
  rows.group = 0;
  expect_invalid(run(10), "2 rows in groups of 0");
  rows.group = 2;
  EXPECT_TRUE(run(10).ok());
  sets.codes = codes.data() + 1;  // 8-byte codes misaligned
  expect_invalid(run(10), "aligned");
}

}  // namespace
}  // namespace kvrecall
