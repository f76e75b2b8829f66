// The CUDA partial-attention kernels against the CPU reference kernels (kernels/cpu): ranges
// with sinks and a wrapping ring, id lists, ragged batches, GQA ratios 1, 3, 4 and 8, head dims
// 64 and 128, bf16 and f16; the LSE merge; device-input errors, reported and gathered.
#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/attention_state.h"
#include "kernels/cpu/attention.h"
#include "kernels/cuda/kernel_errors.h"
#include "kernels/cuda/partial_attention.h"
#include "tests/cuda_test_util.h"
#include "tests/test_util.h"

namespace kvrecall {
namespace {

using cuda::DeviceSeq;
using cuda::KvDtype;
using ::kvrecall::testing::DeviceKv;
using ::kvrecall::testing::Geometry;
using ::kvrecall::testing::kOutputTolerance;
using ::kvrecall::testing::LogicalSlots;
using ::kvrecall::testing::RandomNormal;
using ::kvrecall::testing::StepOutputs;
using ::kvrecall::testing::ToDevice;

// Expects (o, lse) of every row to equal cpu::PartialAttention over ids_of(b, h).
template <typename IdsOf>
void ExpectMatchesCpu(const cuda::DecodeShape& shape, const DeviceKv& kv,
                      const std::vector<float>& q, const std::vector<float>& o,
                      const std::vector<float>& lse, IdsOf ids_of) {
  const int d = shape.head_dim;
  std::vector<float> ref_o(d);
  for (int b = 0; b < shape.batch; ++b) {
    for (int h = 0; h < shape.q_heads; ++h) {
      const int row = b * shape.q_heads + h;
      const std::vector<int32_t> ids = ids_of(b, h);
      float ref_lse;
      cpu::PartialAttention(q.data() + row * d, kv.host.view(),
                            KvHeadOf(h, shape.q_heads, shape.kv_heads), ids, shape.scale,
                            ref_o.data(), &ref_lse);
      SCOPED_TRACE(absl::StrCat("b=", b, " h=", h, " tokens=", ids.size()));
      if (ids.empty()) {
        EXPECT_EQ(lse[row], kEmptyLse);
      } else {
        EXPECT_NEAR(lse[row], ref_lse, kOutputTolerance * std::max(1.0f, std::abs(ref_lse)));
      }
      for (int j = 0; j < d; ++j) {
        ASSERT_NEAR(o[row * d + j], ref_o[j], kOutputTolerance) << "j=" << j;
      }
    }
  }
}

class CudaPartialAttentionTest : public ::testing::TestWithParam<Geometry> {};

// A ragged batch: long and short contiguous histories, a full ring read across its wrap, a
// partly filled ring that wraps, and an empty sequence.
std::vector<DeviceSeq> RaggedBatch(const DeviceKv& kv) {
  const void* k = kv.keys.data();
  const void* v = kv.values.data();
  return {
      DeviceSeq::Contiguous(k, v, 5000),
      DeviceSeq::Contiguous(k, v, 37),
      DeviceSeq{k, v, /*head_count=*/16, /*ring_begin=*/16, /*ring_capacity=*/512,
                /*ring_start=*/300, /*ring_count=*/512},
      DeviceSeq{k, v, 16, 1000, 256, 200, 100},
      DeviceSeq::Contiguous(k, v, 0),
  };
}

TEST_P(CudaPartialAttentionTest, RangesOfARaggedBatchMatchCpu) {
  KVRECALL_SKIP_WITHOUT_GPU();
  const Geometry g = GetParam();
  DeviceKv kv(6000, g.kv_heads, g.head_dim, g.dtype, 17);
  const std::vector<DeviceSeq> seqs = RaggedBatch(kv);
  const cuda::DecodeShape shape = g.Shape(static_cast<int>(seqs.size()));
  const std::vector<float> q = g.Queries(shape.rows() * g.head_dim, 5, 2.0f);
  auto ws = cuda::AttentionWorkspace::Create(shape.rows());
  ASSERT_TRUE(ws.ok()) << ws.status();
  // What a caller charges before allocating is what was allocated.
  EXPECT_EQ((*ws)->device_bytes(), cuda::AttentionWorkspace::DeviceBytesFor(shape.rows()));
  EXPECT_GE((*ws)->device_bytes(), int64_t{128} * 4 * shape.rows() * (*ws)->max_splits());
  EXPECT_EQ(cuda::AttentionWorkspace::DeviceBytesFor(0), 0);
  auto d_seqs = ToDevice(seqs);
  auto d_q = ToDevice(q);

  // Twice, outputs poisoned in between: the first call left the workspace reusable.
  for (int call = 0; call < 2; ++call) {
    SCOPED_TRACE(absl::StrCat("call ", call));
    StepOutputs fresh(shape.rows(), g.head_dim);
    ASSERT_TRUE(cuda::PartialAttentionOverSeqs(shape, d_seqs.data(), d_q.data(), 5000, ws->get(),
                                               fresh.o.data(), fresh.lse.data(), nullptr)
                    .ok());
    ASSERT_TRUE((*ws)->errors().CheckAndClear(nullptr).ok());
    ExpectMatchesCpu(shape, kv, q, fresh.HostO(), fresh.HostLse(),
                     [&](int b, int) { return LogicalSlots(seqs[b]); });
  }
}

TEST_P(CudaPartialAttentionTest, IdListsMatchCpu) {
  KVRECALL_SKIP_WITHOUT_GPU();
  const Geometry g = GetParam();
  DeviceKv kv(6000, g.kv_heads, g.head_dim, g.dtype, 23);
  const std::vector<DeviceSeq> seqs = RaggedBatch(kv);
  const cuda::DecodeShape shape = g.Shape(static_cast<int>(seqs.size()));
  const std::vector<float> q = g.Queries(shape.rows() * g.head_dim, 7, 2.0f);
  constexpr int kMaxIds = 700;
  // Ragged counts (0, full and in between), ids anywhere in the sequence, repeats allowed.
  std::mt19937 rng(3);
  std::vector<int32_t> ids(shape.rows() * kMaxIds, -1), counts(shape.rows());
  for (int row = 0; row < shape.rows(); ++row) {
    const int32_t n = seqs[row / g.q_heads].size();
    counts[row] = n == 0 ? 0 : (row % 3 == 0 ? kMaxIds : static_cast<int>(rng() % kMaxIds));
    for (int i = 0; i < counts[row]; ++i) ids[row * kMaxIds + i] = static_cast<int32_t>(rng() % n);
  }
  auto ws = cuda::AttentionWorkspace::Create(shape.rows());
  ASSERT_TRUE(ws.ok()) << ws.status();
  auto d_seqs = ToDevice(seqs);
  auto d_q = ToDevice(q);
  auto d_ids = ToDevice(ids);
  auto d_counts = ToDevice(counts);
  StepOutputs out(shape.rows(), g.head_dim);

  ASSERT_TRUE(cuda::PartialAttentionOverIds(shape, d_seqs.data(), d_q.data(), d_ids.data(),
                                            d_counts.data(), kMaxIds, ws->get(), out.o.data(),
                                            out.lse.data(), nullptr)
                  .ok());
  ASSERT_TRUE((*ws)->errors().CheckAndClear(nullptr).ok());
  ExpectMatchesCpu(shape, kv, q, out.HostO(), out.HostLse(), [&](int b, int h) {
                     const int row = b * g.q_heads + h;
                     const std::vector<int32_t> logical = LogicalSlots(seqs[b]);
                     std::vector<int32_t> slots;
                     for (int i = 0; i < counts[row]; ++i) {
                       slots.push_back(logical[ids[row * kMaxIds + i]]);
                     }
                     return slots;
                   });
}

INSTANTIATE_TEST_SUITE_P(
    Geometries, CudaPartialAttentionTest,
    ::testing::Values(Geometry{8, 8, 64, KvDtype::kBf16}, Geometry{8, 8, 128, KvDtype::kF16},
                      Geometry{16, 4, 128, KvDtype::kBf16}, Geometry{16, 4, 64, KvDtype::kF16},
                      Geometry{32, 4, 128, KvDtype::kBf16}, Geometry{32, 4, 64, KvDtype::kBf16},
                      Geometry{6, 2, 128, KvDtype::kF16},
                      // Scales past ln 2: f16's kernels apply them to the scores.
                      Geometry{8, 8, 128, KvDtype::kF16, 1.0f},
                      Geometry{16, 4, 64, KvDtype::kF16, 4.0f},
                      Geometry{16, 4, 64, KvDtype::kBf16, 1.0f},
                      // Queries at f16's bound (the API's on tensors) at a softmax scale of 4:
                      // their scores' factor, scale x log2(e), could not be folded into an f16
                      // query operand (mma.cuh, ScoreFactor).
                      Geometry{8, 2, 128, KvDtype::kF16, 4.0f, 65504.0f}),
    ::kvrecall::testing::GeometryName);

// The GPU state over the first part of a history merged with the CPU state over the rest is
// the state over the whole history.
TEST(CudaMergeTest, GpuPartMergedWithCpuPartEqualsWhole) {
  KVRECALL_SKIP_WITHOUT_GPU();
  const Geometry g{16, 4, 128, KvDtype::kBf16};
  DeviceKv kv(5000, g.kv_heads, g.head_dim, g.dtype, 31);
  const cuda::DecodeShape shape = g.Shape(1);
  const std::vector<float> q = RandomNormal(shape.rows() * g.head_dim, 9, 2.0f);
  auto ws = cuda::AttentionWorkspace::Create(shape.rows());
  ASSERT_TRUE(ws.ok()) << ws.status();
  auto d_seqs = ToDevice(std::vector<DeviceSeq>{kv.Contiguous(3000)});
  auto d_q = ToDevice(q);
  StepOutputs out(shape.rows(), g.head_dim);
  ASSERT_TRUE(cuda::PartialAttentionOverSeqs(shape, d_seqs.data(), d_q.data(), 3000, ws->get(),
                                             out.o.data(), out.lse.data(), nullptr)
                  .ok());

  std::vector<float> cpu_o(shape.rows() * g.head_dim), cpu_lse(shape.rows());
  for (int h = 0; h < g.q_heads; ++h) {
    cpu::PartialAttentionRange(q.data() + h * g.head_dim, kv.host.view(),
                               KvHeadOf(h, g.q_heads, g.kv_heads), 3000, 5000, shape.scale,
                               cpu_o.data() + h * g.head_dim, &cpu_lse[h]);
  }
  auto d_cpu_o = ToDevice(cpu_o);
  auto d_cpu_lse = ToDevice(cpu_lse);
  ASSERT_TRUE(cuda::MergeAttentionStates(shape.rows(), g.head_dim, d_cpu_o.data(),
                                         d_cpu_lse.data(), out.o.data(), out.lse.data(), nullptr)
                  .ok());
  ExpectMatchesCpu(shape, kv, q, out.HostO(), out.HostLse(),
                   [](int, int) { return ::kvrecall::testing::AllTokens(5000); });
}

TEST(CudaPartialAttentionErrorsTest, OutOfRangeIdsAreSkippedAndReported) {
  KVRECALL_SKIP_WITHOUT_GPU();
  const Geometry g{8, 8, 64, KvDtype::kBf16};
  DeviceKv kv(100, g.kv_heads, g.head_dim, g.dtype, 41);
  const cuda::DecodeShape shape = g.Shape(1);
  const std::vector<float> q = RandomNormal(shape.rows() * g.head_dim, 1);
  constexpr int kMaxIds = 3;
  std::vector<int32_t> ids, counts(shape.rows(), kMaxIds);
  for (int row = 0; row < shape.rows(); ++row) ids.insert(ids.end(), {5, 50, 100});  // 100: out
  auto ws = cuda::AttentionWorkspace::Create(shape.rows());
  ASSERT_TRUE(ws.ok()) << ws.status();
  auto d_seqs = ToDevice(std::vector<DeviceSeq>{kv.Contiguous(100)});
  auto d_q = ToDevice(q);
  auto d_ids = ToDevice(ids);
  auto d_counts = ToDevice(counts);
  StepOutputs out(shape.rows(), g.head_dim);
  ASSERT_TRUE(cuda::PartialAttentionOverIds(shape, d_seqs.data(), d_q.data(), d_ids.data(),
                                            d_counts.data(), kMaxIds, ws->get(), out.o.data(),
                                            out.lse.data(), nullptr)
                  .ok());
  // Gathered into a download with another workspace's clean word (as a step gathers them).
  absl::StatusOr<cuda::KernelErrors> clean = cuda::KernelErrors::Create();
  ASSERT_TRUE(clean.ok()) << clean.status();
  const cuda::KernelErrors* words[] = {&clean.value(), &(*ws)->errors()};
  auto gathered = ToDevice(std::vector<unsigned>{7, 7});
  ASSERT_TRUE(cuda::GatherErrorWords(words, gathered.data(), nullptr).ok());
  EXPECT_EQ(::kvrecall::testing::ToHost(gathered.data(), 2),
            (std::vector<unsigned>{0, cuda::kErrorIndexOutOfRange}));
  const cuda::KernelErrors* too_many[cuda::kMaxGatheredErrorWords + 1] = {};
  EXPECT_EQ(cuda::GatherErrorWords(too_many, gathered.data(), nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  const cuda::KernelErrors* null_word[] = {nullptr};
  EXPECT_EQ(cuda::GatherErrorWords(null_word, gathered.data(), nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  const absl::Status status = (*ws)->errors().CheckAndClear(nullptr);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()),
              ::testing::HasSubstr("an index outside its sequence"));
  EXPECT_TRUE((*ws)->errors().CheckAndClear(nullptr).ok()) << "the word is cleared";
  ExpectMatchesCpu(shape, kv, q, out.HostO(), out.HostLse(),
                   [](int, int) { return std::vector<int32_t>{5, 50}; });
}

TEST(CudaPartialAttentionErrorsTest, UnservedShapesAreInvalidArguments) {
  // Validation happens before any device call, so this runs without a GPU too.
  const absl::Status dim = cuda::PartialAttentionOverSeqs(
      cuda::DecodeShape{1, 8, 8, 96, KvDtype::kBf16, 0.1f}, nullptr, nullptr, 10, nullptr,
      nullptr, nullptr, nullptr);
  EXPECT_EQ(dim.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(dim.message()), ::testing::HasSubstr("head_dim must be 64 or 128"));
  const absl::Status heads = cuda::PartialAttentionOverSeqs(
      cuda::DecodeShape{1, 6, 4, 64, KvDtype::kBf16, 0.1f}, nullptr, nullptr, 10, nullptr,
      nullptr, nullptr, nullptr);
  EXPECT_EQ(heads.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(heads.message()),
              ::testing::HasSubstr("q_heads must be a positive multiple of kv_heads"));
}

}  // namespace
}  // namespace kvrecall
