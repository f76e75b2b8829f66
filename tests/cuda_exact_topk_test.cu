// The CUDA exact top-K path (full scan + selection + attention over the K) and the row top-K
// selection against the CPU reference: same supports up to near-ties, exact tie-breaking by
// lower position, outputs to tolerance; ragged batches, rings, GQA 1/4/8, dims 64 and 128.
#include <algorithm>
#include <cmath>
#include <random>
#include <set>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/attention_state.h"
#include "kernels/cpu/attention.h"
#include "kernels/cuda/exact_topk.h"
#include "kernels/cuda/topk_workspace.h"
#include "tests/cuda_test_util.h"
#include "tests/test_util.h"

namespace kvrecall {
namespace {

using cuda::DeviceSeq;
using cuda::KvDtype;
using ::kvrecall::testing::DeviceKv;
using ::kvrecall::testing::Geometry;
using ::kvrecall::testing::kOutputTolerance;
using ::kvrecall::testing::kTieTolerance;
using ::kvrecall::testing::LogicalSlots;
using ::kvrecall::testing::PoisonedFloats;
using ::kvrecall::testing::RandomNormal;
using ::kvrecall::testing::StepOutputs;
using ::kvrecall::testing::ToDevice;
using ::kvrecall::testing::ToHost;

// Keys and values of `seq` in logical order, as a host KvView the CPU kernels can scan.
struct LogicalKv {
  LogicalKv(const DeviceKv& kv, const DeviceSeq& seq) : slots(LogicalSlots(seq)) {
    const int64_t stride = kv.host.kv_heads * kv.host.head_dim;
    for (int32_t slot : slots) {
      keys.insert(keys.end(), kv.host.keys.begin() + slot * stride,
                  kv.host.keys.begin() + (slot + 1) * stride);
      values.insert(values.end(), kv.host.values.begin() + slot * stride,
                    kv.host.values.begin() + (slot + 1) * stride);
    }
    view = KvView{keys.data(), values.data(), static_cast<int64_t>(slots.size()),
                  kv.host.kv_heads, kv.host.head_dim};
  }
  std::vector<int32_t> slots;
  std::vector<float> keys, values;
  KvView view;
};

// Expects `got` (any order) to be the exact top-k of `scores` up to near-ties at the K-th.
void ExpectSameSupportUpToTies(const std::vector<int32_t>& got, const std::vector<int32_t>& want,
                               const std::vector<float>& scores) {
  ASSERT_EQ(got.size(), want.size());
  const std::set<int32_t> got_set(got.begin(), got.end());
  ASSERT_EQ(got_set.size(), got.size()) << "the support repeats a position";
  if (want.empty()) return;
  const float kth = scores[want.back()];
  const float slack = kTieTolerance * std::max(1.0f, std::abs(kth));
  const std::set<int32_t> want_set(want.begin(), want.end());
  for (int32_t p : got) {
    ASSERT_GE(p, 0);
    ASSERT_LT(p, static_cast<int32_t>(scores.size()));
    if (!want_set.count(p)) EXPECT_NEAR(scores[p], kth, slack) << "extra position " << p;
  }
  for (int32_t p : want) {
    if (!got_set.count(p)) EXPECT_NEAR(scores[p], kth, slack) << "missing position " << p;
  }
}

class CudaExactTopKTest : public ::testing::TestWithParam<Geometry> {};

TEST_P(CudaExactTopKTest, RaggedBatchMatchesCpuExactTopK) {
  KVRECALL_SKIP_WITHOUT_GPU();
  const Geometry g = GetParam();
  constexpr int kTopK = 512;
  DeviceKv kv(12000, g.kv_heads, g.head_dim, g.dtype, 101);
  const void* k = kv.keys.data();
  const void* v = kv.values.data();
  const std::vector<DeviceSeq> seqs = {
      DeviceSeq::Contiguous(k, v, 12000),
      DeviceSeq::Contiguous(k, v, 300),  // shorter than K: everything is selected
      DeviceSeq{k, v, 64, 2000, 3000, 2500, 3000},  // sinks + a full ring read across its wrap
      DeviceSeq::Contiguous(k, v, 0),
      DeviceSeq::Contiguous(k, v, 4097),
  };
  const int batch = static_cast<int>(seqs.size());
  const cuda::DecodeShape shape = g.Shape(batch);
  const std::vector<float> q = g.Queries(shape.rows() * g.head_dim, 3, 2.0f);
  auto ws = cuda::TopKWorkspace::Create(shape.rows(), 12000);
  ASSERT_TRUE(ws.ok()) << ws.status();
  // What a caller charges before allocating is what was allocated.
  EXPECT_EQ((*ws)->device_bytes(), cuda::TopKWorkspace::DeviceBytesFor(shape.rows(), 12000));
  EXPECT_GE((*ws)->device_bytes(), int64_t{8} * shape.rows() * 12000);
  EXPECT_EQ(cuda::TopKWorkspace::DeviceBytesFor(shape.rows(), 0), 0);
  auto d_seqs = ToDevice(seqs);
  auto d_q = ToDevice(q);
  StepOutputs out(shape.rows(), g.head_dim, kTopK);

  // Twice: the second call checks that the first left the workspace clean.
  for (int call = 0; call < 2; ++call) {
    ASSERT_TRUE(cuda::ExactTopKAttention(shape, d_seqs.data(), d_q.data(), 12000, kTopK, nullptr,
                                         ws->get(), out.support.data(), out.size.data(), out.o.data(),
                                         out.lse.data(), nullptr)
                    .ok());
    ASSERT_TRUE((*ws)->errors().CheckAndClear(nullptr).ok());
    const std::vector<int32_t> support = out.HostSupport();
    const std::vector<int32_t> sizes = out.HostSize();
    const std::vector<float> o = out.HostO();
    const std::vector<float> lse = out.HostLse();
    for (int b = 0; b < batch; ++b) {
      const LogicalKv logical(kv, seqs[b]);
      for (int h = 0; h < g.q_heads; ++h) {
        SCOPED_TRACE(absl::StrCat("call=", call, " b=", b, " h=", h));
        const int row = b * g.q_heads + h;
        const int kv_head = KvHeadOf(h, g.q_heads, g.kv_heads);
        const float* qh = q.data() + row * g.head_dim;
        std::vector<int32_t> want;
        cpu::ExactTopK(qh, logical.view, kv_head, shape.scale, kTopK, &want);
        std::vector<float> scores(logical.view.tokens);
        cpu::ScoreRange(qh, logical.view, kv_head, 0, logical.view.tokens, shape.scale,
                        scores.data());
        ASSERT_EQ(sizes[row], static_cast<int>(want.size()));
        const std::vector<int32_t> got(support.begin() + row * kTopK,
                                       support.begin() + row * kTopK + sizes[row]);
        ExpectSameSupportUpToTies(got, want, scores);
        // The state is attention over exactly the returned support.
        std::vector<float> ref_o(g.head_dim);
        float ref_lse;
        cpu::PartialAttention(qh, logical.view, kv_head, got, shape.scale, ref_o.data(), &ref_lse);
        if (got.empty()) {
          EXPECT_EQ(lse[row], kEmptyLse);
        } else {
          EXPECT_NEAR(lse[row], ref_lse, kOutputTolerance * std::max(1.0f, std::abs(ref_lse)));
        }
        for (int j = 0; j < g.head_dim; ++j) {
          ASSERT_NEAR(o[row * g.head_dim + j], ref_o[j], kOutputTolerance) << "j=" << j;
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Geometries, CudaExactTopKTest,
    ::testing::Values(Geometry{8, 8, 64, KvDtype::kBf16}, Geometry{16, 4, 128, KvDtype::kBf16},
                      Geometry{16, 4, 64, KvDtype::kF16}, Geometry{32, 4, 128, KvDtype::kF16},
                      Geometry{6, 2, 128, KvDtype::kBf16},
                      // Scales past ln 2: f16's kernels apply them to the scores.
                      Geometry{16, 4, 64, KvDtype::kF16, 1.0f},
                      Geometry{32, 4, 128, KvDtype::kF16, 2.0f},
                      // Queries at f16's bound: their scores' factor could not be folded in.
                      Geometry{16, 4, 64, KvDtype::kF16, 4.0f, 65504.0f}),
    ::kvrecall::testing::GeometryName);

TEST(CudaExactTopKTiesTest, EqualScoresGoToTheLowerPositions) {
  KVRECALL_SKIP_WITHOUT_GPU();
  // Every key is the same vector, so every score is bitwise equal.
  constexpr int kTokens = 9000, kKvHeads = 2, kDim = 64, kTopK = 100;
  DeviceKv kv(kTokens, kKvHeads, kDim, KvDtype::kBf16, 7);
  std::vector<uint16_t> same(kv.host.keys.size());
  for (size_t i = 0; i < same.size(); ++i) same[i] = FloatToBf16(0.25f * ((i % kDim) % 5));
  auto d_keys = ToDevice(same);
  const cuda::DecodeShape shape{1, 4, kKvHeads, kDim, KvDtype::kBf16, 0.125f};
  auto d_seqs = ToDevice(std::vector<DeviceSeq>{
      DeviceSeq::Contiguous(d_keys.data(), kv.values.data(), kTokens)});
  auto d_q = ToDevice(RandomNormal(shape.rows() * kDim, 2));
  auto ws = cuda::TopKWorkspace::Create(shape.rows(), kTokens);
  ASSERT_TRUE(ws.ok()) << ws.status();
  StepOutputs out(shape.rows(), kDim, kTopK);
  ASSERT_TRUE(cuda::ExactTopKAttention(shape, d_seqs.data(), d_q.data(), kTokens, kTopK, nullptr,
                                       ws->get(), out.support.data(), out.size.data(), out.o.data(),
                                       out.lse.data(), nullptr)
                  .ok());
  const std::vector<int32_t> support = out.HostSupport();
  for (int row = 0; row < shape.rows(); ++row) {
    std::vector<int32_t> got(support.begin() + row * kTopK, support.begin() + (row + 1) * kTopK);
    std::sort(got.begin(), got.end());
    EXPECT_EQ(got, ::kvrecall::testing::AllTokens(kTopK)) << "row " << row;
  }
}

// Active rows of a few head groups: the launch's blocks are shared out among those groups.
TEST(CudaExactTopKActiveRowsTest, InactiveRowsAreNotWritten) {
  KVRECALL_SKIP_WITHOUT_GPU();
  constexpr int kTokens = 3000, kDim = 128, kTopK = 64;
  DeviceKv kv(kTokens, 2, kDim, KvDtype::kBf16, 9);
  const cuda::DecodeShape shape{2, 8, 2, kDim, KvDtype::kBf16, 0.1f};
  auto d_seqs = ToDevice(std::vector<DeviceSeq>{kv.Contiguous(kTokens), kv.Contiguous(2000)});
  const std::vector<float> q = RandomNormal(shape.rows() * kDim, 4);
  auto d_q = ToDevice(q);
  std::vector<uint8_t> active(shape.rows());
  for (int row = 0; row < shape.rows(); ++row) active[row] = row % 3 == 1;
  auto d_active = ToDevice(active);
  auto ws = cuda::TopKWorkspace::Create(shape.rows(), kTokens);
  ASSERT_TRUE(ws.ok()) << ws.status();
  StepOutputs out(shape.rows(), kDim, kTopK);
  for (int call = 0; call < 2; ++call) {
    ASSERT_TRUE(cuda::ExactTopKAttention(shape, d_seqs.data(), d_q.data(), kTokens, kTopK,
                                         d_active.data(), ws->get(), out.support.data(),
                                         out.size.data(), out.o.data(), out.lse.data(), nullptr)
                    .ok());
  }
  const std::vector<int32_t> sizes = out.HostSize();
  const std::vector<int32_t> support = out.HostSupport();
  const std::vector<float> lse = out.HostLse();
  const std::vector<DeviceSeq> seqs{kv.Contiguous(kTokens), kv.Contiguous(2000)};
  for (int row = 0; row < shape.rows(); ++row) {
    if (active[row]) {
      // The active rows' groups share the launch's blocks among them: still the exact top-K.
      SCOPED_TRACE(absl::StrCat("row ", row));
      EXPECT_EQ(sizes[row], kTopK);
      EXPECT_TRUE(std::isfinite(lse[row]));
      const LogicalKv logical(kv, seqs[row / shape.q_heads]);
      const int kv_head = KvHeadOf(row % shape.q_heads, shape.q_heads, shape.kv_heads);
      const float* qh = q.data() + row * kDim;
      std::vector<int32_t> want;
      cpu::ExactTopK(qh, logical.view, kv_head, shape.scale, kTopK, &want);
      std::vector<float> scores(logical.view.tokens);
      cpu::ScoreRange(qh, logical.view, kv_head, 0, logical.view.tokens, shape.scale,
                      scores.data());
      ExpectSameSupportUpToTies(std::vector<int32_t>(support.begin() + row * kTopK,
                                                     support.begin() + (row + 1) * kTopK),
                                want, scores);
    } else {
      EXPECT_EQ(sizes[row], -1) << row;
      EXPECT_TRUE(std::isnan(lse[row])) << row;
    }
  }
}

TEST(CudaExactTopKErrorsTest, HistoriesBeyondMaxTokensAreCutAndReported) {
  KVRECALL_SKIP_WITHOUT_GPU();
  constexpr int kDim = 64, kTopK = 32, kMaxTokens = 1000;
  DeviceKv kv(3000, 1, kDim, KvDtype::kBf16, 5);
  const cuda::DecodeShape shape{1, 2, 1, kDim, KvDtype::kBf16, 0.125f};
  auto d_seqs = ToDevice(std::vector<DeviceSeq>{kv.Contiguous(3000)});
  const std::vector<float> q = RandomNormal(shape.rows() * kDim, 8);
  auto d_q = ToDevice(q);
  auto ws = cuda::TopKWorkspace::Create(shape.rows(), kMaxTokens);
  ASSERT_TRUE(ws.ok()) << ws.status();
  StepOutputs out(shape.rows(), kDim, kTopK);
  ASSERT_TRUE(cuda::ExactTopKAttention(shape, d_seqs.data(), d_q.data(), kMaxTokens, kTopK,
                                       nullptr, ws->get(), out.support.data(), out.size.data(),
                                       out.o.data(), out.lse.data(), nullptr)
                  .ok());
  const absl::Status status = (*ws)->errors().CheckAndClear(nullptr);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()),
              ::testing::HasSubstr("a sequence longer than max_tokens"));
  KvView first = kv.host.view();
  first.tokens = kMaxTokens;
  const std::vector<int32_t> support = out.HostSupport();
  for (int h = 0; h < shape.rows(); ++h) {
    std::vector<int32_t> want;
    cpu::ExactTopK(q.data() + h * kDim, first, 0, shape.scale, kTopK, &want);
    std::vector<int32_t> got(support.begin() + h * kTopK, support.begin() + (h + 1) * kTopK);
    std::sort(got.begin(), got.end());
    std::sort(want.begin(), want.end());
    EXPECT_EQ(got, want) << "head " << h;
  }
  // A workspace too small for the call is an argument error, before any launch.
  EXPECT_EQ(cuda::ExactTopKAttention(shape, d_seqs.data(), d_q.data(), kMaxTokens + 1, kTopK,
                                     nullptr, ws->get(), out.support.data(), out.size.data(),
                                     out.o.data(), out.lse.data(), nullptr)
                .code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(CudaRowTopKTest, RowsWithTiesAndShortRowsMatchTopKPositions) {
  KVRECALL_SKIP_WITHOUT_GPU();
  constexpr int kRows = 6, kLength = 20000, kStride = 20480, kTopK = 300;
  std::mt19937 rng(5);
  std::vector<float> scores(kRows * kStride, 0.0f);
  for (int r = 0; r < kRows; ++r) {
    for (int i = 0; i < kLength; ++i) {
      // Rows 0-1: few distinct values (massive ties across the K-th); rows 2-5:
      // continuous values with some negative zeros and exact repeats.
      const float x = r == 0   ? static_cast<float>(rng() % 7) - 3.0f
                      : r == 1 ? 0.5f  // one value: the candidates overflow shared memory
                               : std::normal_distribution<float>(0.0f, 1.0f)(rng);
      scores[r * kStride + i] = (i % 97 == 0) ? -0.0f : (i % 89 == 0 ? 1.5f : x);
    }
  }
  auto ws = cuda::TopKWorkspace::Create(kRows, kStride);
  ASSERT_TRUE(ws.ok()) << ws.status();
  auto d_scores = ToDevice(scores);
  auto d_support = ToDevice(std::vector<int32_t>(kRows * kTopK, -1));
  auto d_size = ToDevice(std::vector<int32_t>(kRows, -1));
  auto d_support_scores = PoisonedFloats(kRows * kTopK);
  ASSERT_TRUE(cuda::SelectRowTopK(d_scores.data(), kStride, kRows, kLength, nullptr, kTopK,
                                  ws->get(), d_support.data(), kTopK, d_size.data(),
                                  d_support_scores.data(), nullptr)
                  .ok());
  const std::vector<int32_t> support = ToHost(d_support.data(), d_support.size());
  const std::vector<float> support_scores =
      ToHost(d_support_scores.data(), d_support_scores.size());
  const std::vector<int32_t> sizes = ToHost(d_size.data(), d_size.size());
  for (int r = 0; r < kRows; ++r) {
    std::vector<int32_t> want;
    cpu::TopKPositions(std::span<const float>(scores.data() + r * kStride, kLength), kTopK, &want);
    std::sort(want.begin(), want.end());
    std::vector<int32_t> got(support.begin() + r * kTopK, support.begin() + (r + 1) * kTopK);
    for (int j = 0; j < kTopK; ++j) {
      EXPECT_EQ(support_scores[r * kTopK + j], scores[r * kStride + got[j]]);
    }
    std::sort(got.begin(), got.end());
    EXPECT_EQ(sizes[r], kTopK);
    EXPECT_EQ(got, want) << "row " << r;  // exact, ties included
  }
  // Per-row lengths: row r sees its first lengths[r] scores; shorter than k means all of them.
  const std::vector<int32_t> lengths = {100, 0, 301, 20000, 7777, 1};
  auto d_lengths = ToDevice(lengths);
  ASSERT_TRUE(cuda::SelectRowTopK(d_scores.data(), kStride, kRows, kLength, d_lengths.data(),
                                  kTopK, ws->get(), d_support.data(), kTopK, d_size.data(),
                                  nullptr, nullptr)
                  .ok());
  const std::vector<int32_t> ragged = ToHost(d_support.data(), d_support.size());
  const std::vector<int32_t> ragged_sizes = ToHost(d_size.data(), d_size.size());
  for (int r = 0; r < kRows; ++r) {
    std::vector<int32_t> want;
    cpu::TopKPositions(std::span<const float>(scores.data() + r * kStride, lengths[r]), kTopK,
                       &want);
    std::sort(want.begin(), want.end());
    ASSERT_EQ(ragged_sizes[r], static_cast<int>(want.size())) << "row " << r;
    std::vector<int32_t> got(ragged.begin() + r * kTopK,
                             ragged.begin() + r * kTopK + ragged_sizes[r]);
    std::sort(got.begin(), got.end());
    EXPECT_EQ(got, want) << "row " << r;
  }
}

}  // namespace
}  // namespace kvrecall
