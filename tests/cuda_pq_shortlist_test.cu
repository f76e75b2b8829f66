// The GPU shortlist of product-quantized keys (kernels/cuda/pq_shortlist.h) against its CPU
// reference (ProductQuantizer::QueryTable + ScanCodes, index/product_quantizer.h, then the top
// `shortlist` by cpu::TopKPositions): the same positions up to near-ties, the same scores, over
// ragged rows of several code sets (8-byte codes and the general path); exactly the same
// positions and scores where both sides compute in exact integers (the served geometry, ties
// broken by position); the same lists from calls captured in a CUDA graph (as the server runs
// them); misfits refused.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <set>
#include <span>
#include <tuple>
#include <utility>
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

// One PqShortlist call's outputs: ids [rows, kShortlist], sizes [rows], id_scores aligned.
struct ShortlistOutputs {
  std::vector<int32_t> ids, sizes;
  std::vector<float> id_scores;
};

// PqShortlist over `sets` for `queries` ([rows, kDim]) in groups of `group`, row r over set
// set_of_row[r] and its first lengths[r] keys (all kKeys for an empty `lengths`), `calls` times
// on one workspace: each call's outputs.
std::vector<ShortlistOutputs> RunShortlists(const CodeSets& sets, int subspaces,
                                            const std::vector<float>& queries,
                                            const std::vector<int32_t>& set_of_row,
                                            const std::vector<int32_t>& lengths, int group,
                                            int calls = 1) {
  const int rows = static_cast<int>(set_of_row.size());
  std::vector<ShortlistOutputs> out;
  auto ws = cuda::TopKWorkspace::Create(rows, kKeys);
  EXPECT_TRUE(ws.ok()) << ws.status();
  if (!ws.ok()) return out;
  auto d_books = ToDevice(sets.codebooks);
  auto d_codes = ToDevice(sets.codes);
  auto d_queries = ToDevice(queries);
  auto d_sets = ToDevice(set_of_row);
  auto d_lengths = ToDevice(lengths.empty() ? std::vector<int32_t>(rows, kKeys) : lengths);
  auto d_tables = ToDevice(std::vector<float>(rows * subspaces * ProductQuantizer::kCentroids));
  const cuda::PqCodeSets code_sets{d_books.data(), d_codes.data(), kKeys, subspaces, kDim};
  const cuda::PqShortlistRows query_rows{d_queries.data(), d_sets.data(), d_lengths.data(),
                                         d_tables.data(),  rows,          kKeys,
                                         group};
  for (int call = 0; call < calls; ++call) {
    auto d_ids = ToDevice(std::vector<int32_t>(rows * kShortlist, -1));
    auto d_sizes = ToDevice(std::vector<int32_t>(rows, -1));
    auto d_scores = ToDevice(std::vector<float>(rows * kShortlist, -1.0f));
    EXPECT_TRUE(cuda::PqShortlist(code_sets, query_rows, kShortlist, ws->get(), d_ids.data(),
                                  d_sizes.data(), d_scores.data(), nullptr)
                    .ok());
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    out.push_back({ToHost(d_ids.data(), d_ids.size()), ToHost(d_sizes.data(), d_sizes.size()),
                   ToHost(d_scores.data(), d_scores.size())});
  }
  return out;
}

// Row r of `got` against the CPU reference (QueryTable + ScanCodes of its set's first n keys,
// then cpu::TopKPositions): the same size, ids in range and listed once, their scores, and
// every id the reference's or a near-tie of its last.
void ExpectMatchesReference(const CodeSets& sets, int subspaces, int set, const float* query,
                            int n, const ShortlistOutputs& got, int r) {
  std::vector<float> table(subspaces * ProductQuantizer::kCentroids), scores(kKeys);
  std::vector<int32_t> expected;
  sets.quantizers[set].QueryTable(query, table.data());
  ProductQuantizer::ScanCodes(table.data(), sets.codes.data() + size_t{kKeys} * subspaces * set,
                              n, subspaces, scores.data());
  cpu::TopKPositions(std::span<const float>(scores.data(), n), kShortlist, &expected);
  ASSERT_EQ(got.sizes[r], static_cast<int>(expected.size())) << "row " << r;
  const float kth = expected.empty() ? 0.0f : scores[expected.back()];
  const std::set<int32_t> want(expected.begin(), expected.end());
  std::set<int32_t> listed;
  for (int j = 0; j < got.sizes[r]; ++j) {
    const int32_t id = got.ids[r * kShortlist + j];
    ASSERT_TRUE(id >= 0 && id < n) << "row " << r << " id " << id;
    EXPECT_TRUE(listed.insert(id).second) << "row " << r << " lists " << id << " twice";
    EXPECT_NEAR(got.id_scores[r * kShortlist + j], scores[id],
                1e-5f * (1.0f + std::abs(scores[id])));
    if (!want.count(id)) {
      EXPECT_NEAR(scores[id], kth, kTieTolerance * (1.0f + std::abs(kth)))
          << "row " << r << " id " << id;
    }
  }
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
  const std::vector<ShortlistOutputs> got =
      RunShortlists(sets, subspaces, queries, set_of_row, lengths, group);
  ASSERT_EQ(got.size(), 1u);
  for (int r = 0; r < rows; ++r) {
    ExpectMatchesReference(sets, subspaces, set_of_row[r], queries.data() + r * kDim, lengths[r],
                           got[0], r);
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

// Each row's selection bins its scores over the range its table bounds (linear bins): a row
// whose scores all tie (a zero query: a degenerate range, every score in one bin) keeps the
// lowest positions, as the CPU's order does; rows of a wide range beside it are unaffected; and
// a second call over the same inputs gives the same lists (the workspace, the rows' ranges
// included, is left as found).
TEST(PqShortlistBinsTest, TiesKeepTheLowestPositionsAndCallsRepeat) {
  KVRECALL_SKIP_WITHOUT_GPU();
  constexpr int kGroup = 4;
  const CodeSets sets = MakeCodeSets(8);
  const int rows = 2 * kGroup;  // group 0: zero queries; group 1: random ones, scaled up
  std::vector<float> queries = RandomNormal(rows * kDim, 30);
  std::fill(queries.begin(), queries.begin() + kGroup * kDim, 0.0f);
  for (int j = kGroup * kDim; j < rows * kDim; ++j) queries[j] *= 1000.0f;
  const std::vector<int32_t> set_of_row(rows, 1);
  const std::vector<ShortlistOutputs> got =
      RunShortlists(sets, 8, queries, set_of_row, {}, kGroup, /*calls=*/2);
  ASSERT_EQ(got.size(), 2u);
  for (int r = 0; r < kGroup; ++r) {
    std::vector<int32_t> ids(got[0].ids.begin() + r * kShortlist,
                             got[0].ids.begin() + (r + 1) * kShortlist);
    std::sort(ids.begin(), ids.end());
    for (int j = 0; j < kShortlist; ++j) {
      ASSERT_EQ(ids[j], j) << "row " << r << " (every score 0) keeps positions [0, "
                           << kShortlist << ")";
    }
  }
  for (int r = kGroup; r < rows; ++r) {
    ExpectMatchesReference(sets, 8, 1, queries.data() + r * kDim, kKeys, got[0], r);
  }
  // (Each row's ids come in no particular order.)
  auto listed = [&](const ShortlistOutputs& call, int r) {
    std::vector<std::pair<int32_t, float>> pairs;
    for (int j = 0; j < call.sizes[r]; ++j) {
      pairs.emplace_back(call.ids[r * kShortlist + j], call.id_scores[r * kShortlist + j]);
    }
    std::sort(pairs.begin(), pairs.end());
    return pairs;
  };
  for (int r = 0; r < rows; ++r) {
    EXPECT_EQ(listed(got[1], r), listed(got[0], r)) << "row " << r << ": a second call differs";
  }
}

// The served geometry (d = 128 in 8 parts of 16 dims: 8-byte codes, the tables' vector path)
// over `rows` rows, the first half over set 0's kLong keys and the rest over set 1's fewer, in
// groups of `group`, long enough for several scan and collect blocks per row, with integer
// queries and centroids (the first zero_rows queries all zero), so that every table entry and
// score is an exact integer on both sides: the GPU's shortlist of `list` must be the CPU
// reference's exactly, ties (of which there are many) to the lower position, with the exact
// scores (with_scores). Few distinct scores (few_values) put hundreds of tied keys in each
// threshold bin (radix-selected on their positions); many put a few there (ranked by counting).
void ExpectExactShortlists(int rows, int group, bool few_values, bool with_scores, int list,
                           int zero_rows) {
  constexpr int kServedDim = 128, kParts = 8, kPartDims = 16, kCodes = 256, kLong = 40000;
  std::vector<int32_t> set_of_row(rows), lengths(rows);
  for (int r = 0; r < rows; ++r) {
    set_of_row[r] = r < rows / 2 ? 0 : 1;
    lengths[r] = r < rows / 2 ? kLong : kLong - 777;
  }
  std::mt19937 rng(few_values ? 7 : 8);
  std::uniform_int_distribution<int> centroid_value(few_values ? 0 : -8, few_values ? 1 : 8);
  std::uniform_int_distribution<int> query_value(few_values ? 0 : -3, few_values ? 1 : 3);
  std::uniform_int_distribution<int> code_value(0, kCodes - 1);
  std::vector<float> books(2 * kParts * kCodes * kPartDims), queries(rows * kServedDim);
  std::vector<uint8_t> codes(size_t{2} * kLong * kParts);
  for (float& x : books) x = static_cast<float>(centroid_value(rng));
  for (float& x : queries) x = static_cast<float>(query_value(rng));
  std::fill(queries.begin(), queries.begin() + zero_rows * kServedDim, 0.0f);
  for (uint8_t& c : codes) c = static_cast<uint8_t>(code_value(rng));

  auto ws = cuda::TopKWorkspace::Create(rows, kLong);
  ASSERT_TRUE(ws.ok()) << ws.status();
  auto d_books = ToDevice(books);
  auto d_codes = ToDevice(codes);
  auto d_queries = ToDevice(queries);
  auto d_sets = ToDevice(set_of_row);
  auto d_lengths = ToDevice(lengths);
  auto d_tables = ToDevice(std::vector<float>(rows * kParts * kCodes));
  auto d_ids = ToDevice(std::vector<int32_t>(rows * list, -1));
  auto d_sizes = ToDevice(std::vector<int32_t>(rows, -1));
  auto d_scores = ToDevice(std::vector<float>(rows * list, -1.0f));
  const cuda::PqCodeSets code_sets{d_books.data(), d_codes.data(), kLong, kParts, kServedDim};
  const cuda::PqShortlistRows query_rows{d_queries.data(), d_sets.data(), d_lengths.data(),
                                         d_tables.data(),  rows,          kLong,
                                         group};
  ASSERT_TRUE(cuda::PqShortlist(code_sets, query_rows, list, ws->get(), d_ids.data(),
                                d_sizes.data(), with_scores ? d_scores.data() : nullptr, nullptr)
                  .ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<int32_t> ids = ToHost(d_ids.data(), d_ids.size());
  const std::vector<int32_t> sizes = ToHost(d_sizes.data(), d_sizes.size());
  const std::vector<float> id_scores = ToHost(d_scores.data(), d_scores.size());

  for (int r = 0; r < rows; ++r) {
    const int set = set_of_row[r], n = lengths[r];
    // Exact integers: the table's entries, then each key's score.
    std::vector<int64_t> table(kParts * kCodes, 0);
    for (int m = 0; m < kParts; ++m) {
      for (int c = 0; c < kCodes; ++c) {
        for (int j = 0; j < kPartDims; ++j) {
          table[m * kCodes + c] +=
              static_cast<int64_t>(queries[r * kServedDim + m * kPartDims + j]) *
              static_cast<int64_t>(books[((set * kParts + m) * kCodes + c) * kPartDims + j]);
        }
      }
    }
    std::vector<float> scores(n);
    for (int i = 0; i < n; ++i) {
      int64_t sum = 0;
      for (int m = 0; m < kParts; ++m) {
        sum += table[m * kCodes + codes[(static_cast<size_t>(set) * kLong + i) * kParts + m]];
      }
      scores[i] = static_cast<float>(sum);
    }
    std::vector<int32_t> expected;
    cpu::TopKPositions(std::span<const float>(scores.data(), n), list, &expected);
    ASSERT_EQ(sizes[r], static_cast<int>(expected.size())) << "row " << r;
    if (few_values) {
      // The threshold falls inside a run of ties, which only the positions break, and which
      // is longer than the collect pass ranks by counting (so its radix select runs).
      const float kth = scores[expected.back()];
      const auto tied = std::count(scores.begin(), scores.end(), kth);
      const auto kept_tied = std::count_if(expected.begin(), expected.end(),
                                           [&](int32_t i) { return scores[i] == kth; });
      EXPECT_GT(tied, kept_tied) << "row " << r << ": no tie at the threshold";
      EXPECT_GT(tied, 128) << "row " << r << ": too few ties at the threshold";
    }
    const auto row_ids = ids.begin() + static_cast<int64_t>(r) * list;
    std::vector<int32_t> got(row_ids, row_ids + sizes[r]);
    std::sort(got.begin(), got.end());
    std::sort(expected.begin(), expected.end());
    ASSERT_EQ(got, expected) << "row " << r;
    if (with_scores) {
      for (int j = 0; j < sizes[r]; ++j) {
        const int32_t id = row_ids[j];
        ASSERT_EQ(id_scores[static_cast<int64_t>(r) * list + j], scores[id])
            << "row " << r << " id " << id;
      }
    }
  }
}

// (group, few_values, with_scores): 8 rows, a shortlist of 1024.
class PqShortlistExactTest : public ::testing::TestWithParam<std::tuple<int, bool, bool>> {};

TEST_P(PqShortlistExactTest, SelectsExactlyTheCpuTopK) {
  KVRECALL_SKIP_WITHOUT_GPU();
  const auto [group, few_values, with_scores] = GetParam();
  ExpectExactShortlists(/*rows=*/8, group, few_values, with_scores, /*list=*/1024,
                        /*zero_rows=*/0);
}

INSTANTIATE_TEST_SUITE_P(GroupsValuesAndScores, PqShortlistExactTest,
                         ::testing::Combine(::testing::Values(4, 2, 1), ::testing::Bool(),
                                            ::testing::Bool()),
                         [](const ::testing::TestParamInfo<std::tuple<int, bool, bool>>& info) {
                           return "Group" + std::to_string(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) ? "FewValues" : "ManyValues") +
                                  (std::get<2>(info.param) ? "WithScores" : "IdsOnly");
                         });

// Rows of one scan block whose threshold-bin candidates are few (ranked by counting) beside rows
// whose every key ties (all 40000 candidates, more than the collect's last block caches, their
// keys read again on every radix pass), with scores and without.
TEST(PqShortlistMixedTest, FewAndAllTiedCandidatesInOneBlock) {
  KVRECALL_SKIP_WITHOUT_GPU();
  for (const bool with_scores : {true, false}) {
    ExpectExactShortlists(/*rows=*/8, /*group=*/4, /*few_values=*/false, with_scores,
                          /*list=*/1024, /*zero_rows=*/2);
  }
}

// Many rows (so few collect blocks per row, each over a long part: 4 of 10000 positions on an
// H200) and a long shortlist: a block's part holds more positions above the threshold bin (the
// shortlist's 30000 of 40000), or in it (the rows of zero queries, whose scores all tie), than
// the collect pass holds in shared memory at once.
TEST(PqShortlistExactLongTest, LongPartsSelectExactlyTheCpuTopK) {
  KVRECALL_SKIP_WITHOUT_GPU();
  ExpectExactShortlists(/*rows=*/64, /*group=*/4, /*few_values=*/true, /*with_scores=*/true,
                        /*list=*/30000, /*zero_rows=*/8);
  ExpectExactShortlists(/*rows=*/64, /*group=*/4, /*few_values=*/true, /*with_scores=*/false,
                        /*list=*/30000, /*zero_rows=*/8);
}

// The server captures a step's shortlists in a CUDA graph (server/backends/gpu_static_set.cc),
// the calls of a batch one after another on one workspace: two calls captured and the graph
// replayed twice list what the same call lists uncaptured, ids and scores (so the launches stay
// capturable, and each call leaves the workspace as the next one needs it).
TEST(PqShortlistGraphTest, CapturedCallsListTheSame) {
  KVRECALL_SKIP_WITHOUT_GPU();
  constexpr int kGroup = 4, kCalls = 2, kRows = 8;
  const CodeSets sets = MakeCodeSets(8);
  const std::vector<int32_t> set_of_row = {0, 0, 0, 0, 2, 2, 2, 2};
  const std::vector<int32_t> lengths = {kKeys, kKeys, kKeys, kKeys, 5000, 5000, 5000, 5000};
  const std::vector<float> queries = RandomNormal(kRows * kDim, 40);
  const std::vector<ShortlistOutputs> direct =
      RunShortlists(sets, 8, queries, set_of_row, lengths, kGroup);
  ASSERT_EQ(direct.size(), 1u);

  auto ws = cuda::TopKWorkspace::Create(kRows, kKeys);
  ASSERT_TRUE(ws.ok()) << ws.status();
  auto d_books = ToDevice(sets.codebooks);
  auto d_codes = ToDevice(sets.codes);
  auto d_queries = ToDevice(queries);
  auto d_sets = ToDevice(set_of_row);
  auto d_lengths = ToDevice(lengths);
  auto d_tables = ToDevice(std::vector<float>(kRows * 8 * ProductQuantizer::kCentroids));
  const int outputs = kCalls * kRows * kShortlist;
  auto d_ids = ToDevice(std::vector<int32_t>(outputs, -1));
  auto d_sizes = ToDevice(std::vector<int32_t>(kCalls * kRows, -1));
  auto d_scores = ToDevice(std::vector<float>(outputs, -1.0f));
  const cuda::PqCodeSets code_sets{d_books.data(), d_codes.data(), kKeys, 8, kDim};
  const cuda::PqShortlistRows query_rows{
      d_queries.data(), d_sets.data(), d_lengths.data(), d_tables.data(), kRows, kKeys, kGroup};
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  for (int call = 0; call < kCalls; ++call) {
    const int at = call * kRows * kShortlist;
    EXPECT_TRUE(cuda::PqShortlist(code_sets, query_rows, kShortlist, ws->get(),
                                  d_ids.data() + at, d_sizes.data() + call * kRows,
                                  d_scores.data() + at, stream)
                    .ok());
  }
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);

  auto listed = [](const std::vector<int32_t>& ids, const std::vector<int32_t>& sizes,
                   const std::vector<float>& scores, int list, int r) {
    std::vector<std::pair<int32_t, float>> pairs;
    for (int j = 0; j < sizes[list * kRows + r]; ++j) {
      const int at = (list * kRows + r) * kShortlist + j;
      pairs.emplace_back(ids[at], scores[at]);
    }
    std::sort(pairs.begin(), pairs.end());
    return pairs;
  };
  for (int replay = 0; replay < 2; ++replay) {
    ASSERT_EQ(cudaMemsetAsync(d_ids.data(), 0xff, outputs * sizeof(int32_t), stream),
              cudaSuccess);
    ASSERT_EQ(cudaMemsetAsync(d_sizes.data(), 0xff, kCalls * kRows * sizeof(int32_t), stream),
              cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    const std::vector<int32_t> ids = ToHost(d_ids.data(), outputs);
    const std::vector<int32_t> sizes = ToHost(d_sizes.data(), kCalls * kRows);
    const std::vector<float> scores = ToHost(d_scores.data(), outputs);
    for (int call = 0; call < kCalls; ++call) {
      for (int r = 0; r < kRows; ++r) {
        ASSERT_EQ(sizes[call * kRows + r], direct[0].sizes[r]) << "replay " << replay;
        EXPECT_EQ(listed(ids, sizes, scores, call, r),
                  listed(direct[0].ids, direct[0].sizes, direct[0].id_scores, 0, r))
            << "replay " << replay << " call " << call << " row " << r;
      }
    }
  }
  EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

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
  sets.codes = codes.data();
  rows.tables = buffer.data() + 1;  // tables misaligned
  expect_invalid(run(10), "tables must start 16-byte aligned");
}

}  // namespace
}  // namespace kvrecall
