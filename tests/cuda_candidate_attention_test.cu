// The GPU's exact path over candidate lists (kernels/cuda/candidate_attention.h) against the CPU
// reference (ShortlistSelector::Select's candidates, cpu::ScoreTokens, cpu::TopKPositions,
// cpu::PartialAttention): the same deduplicated candidates, the same support up to near-ties,
// outputs to tolerance; from device memory and from host memory mapped for the device (the
// tiered placement's bulk), in one registration or two adjacent ones; rows not asked for
// untouched; bad device data reported, bad bounds refused.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <limits>
#include <random>
#include <set>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/attention_state.h"
#include "kernels/cpu/attention.h"
#include "kernels/cuda/candidate_attention.h"
#include "kernels/cuda/kernel_errors.h"
#include "tests/cuda_test_util.h"
#include "tests/test_util.h"

namespace kvrecall {
namespace {

using cuda::CandidateLists;
using cuda::CandidateOutputs;
using cuda::DeviceSeq;
using cuda::KvDtype;
using ::kvrecall::testing::DeviceKv;
using ::kvrecall::testing::Geometry;
using ::kvrecall::testing::kOutputTolerance;
using ::kvrecall::testing::kTieTolerance;
using ::kvrecall::testing::RandomNormal;
using ::kvrecall::testing::StepOutputs;
using ::kvrecall::testing::ToDevice;
using ::kvrecall::testing::ToHost;
using ::testing::HasSubstr;

constexpr int kShortlist = 300;
constexpr int kOutliers = 70;
constexpr int kMaxUncoded = 64;

// A step's candidate lists on the host: shortlists [batch * q_heads, kShortlist] with repeats,
// -1 padding and ids past `coded` (the uncoded tail takes those), of which every third row lists
// only its first 200 (the rest hold ids that must not count); outliers [batch, kv_heads,
// kOutliers] that overlap the shortlists; per sequence its coded prefix.
struct HostLists {
  std::vector<int32_t> shortlists, shortlist_sizes, outliers, outlier_counts, coded;
};

HostLists MakeLists(const std::vector<int32_t>& sizes, int q_heads, int kv_heads, uint64_t seed) {
  std::mt19937_64 rng(seed);
  HostLists l;
  const int batch = static_cast<int>(sizes.size());
  for (int b = 0; b < batch; ++b) {
    const int32_t coded = std::max(0, sizes[b] - 40);
    l.coded.push_back(coded);
    std::uniform_int_distribution<int32_t> any(0, std::max(0, sizes[b] - 1));
    for (int h = 0; h < q_heads; ++h) {
      l.shortlist_sizes.push_back(h % 3 == 2 ? 200 : kShortlist);
      for (int i = 0; i < kShortlist; ++i) {
        const int pick = static_cast<int>(rng() % 10);
        l.shortlists.push_back(sizes[b] == 0 || pick == 0 ? -1
                               : pick == 1 && i > 0     ? l.shortlists.back()  // a repeat
                                                        : any(rng));
      }
    }
    for (int g = 0; g < kv_heads; ++g) {
      // The last KV head of the last sequence has none; the others some of their group's
      // shortlisted ids among fresh ones.
      const int count = b == batch - 1 && g == kv_heads - 1 ? 0 : kOutliers - g;
      l.outlier_counts.push_back(count);
      const int64_t first_row = (int64_t{b} * q_heads + g * (q_heads / kv_heads)) * kShortlist;
      for (int i = 0; i < kOutliers; ++i) {
        l.outliers.push_back(i >= count ? -1
                             : i % 3 == 0 ? l.shortlists[first_row + i]
                                          : (sizes[b] == 0 ? -1 : any(rng)));
      }
    }
  }
  return l;
}

// What ShortlistSelector::Select takes as candidates of row (b, h): its shortlist's ids below
// coded, its KV head's outliers below coded (each once), then [coded, size).
std::vector<int32_t> ReferenceCandidates(const HostLists& l, int b, int h, int q_heads,
                                         int kv_heads, int32_t size) {
  const int kv_head = KvHeadOf(h, q_heads, kv_heads);
  const int32_t coded = std::min(l.coded[b], size);
  std::set<int32_t> seen;
  std::vector<int32_t> out;
  auto take = [&](int32_t id) {
    if (id >= 0 && id < coded && seen.insert(id).second) out.push_back(id);
  };
  const int64_t row = int64_t{b} * q_heads + h;
  for (int i = 0; i < l.shortlist_sizes[row]; ++i) take(l.shortlists[row * kShortlist + i]);
  const int64_t group = int64_t{b} * kv_heads + kv_head;
  for (int i = 0; i < l.outlier_counts[group]; ++i) take(l.outliers[group * kOutliers + i]);
  for (int32_t t = coded; t < size; ++t) out.push_back(t);
  return out;
}

// Host memory registered with the device for the kernel to read through its mapped address, in
// one registration or in two adjacent ones split at a page inside it (as an array whose address
// never changes is pinned a growth at a time): the kernel's rows then cross from one into the
// other through the host pointer itself (unified addressing, as the tiered placement reads it).
class MappedCopy {
 public:
  MappedCopy(const cuda::DeviceBuffer<uint16_t>& device, int registrations) {
    const size_t bytes = device.bytes();
    const size_t rounded = (bytes + kPage - 1) / kPage * kPage;
    host_ = static_cast<std::byte*>(std::aligned_alloc(kPage, rounded));
    EXPECT_EQ(cudaMemcpy(host_, device.data(), bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    if (registrations == 1) {
      pieces_ = {{host_, rounded}};
    } else {
      // As BudgetedRows pins: the first range as long as the old array (ending inside a
      // page), the next from the first whole page after it.
      const size_t split = rounded / 2 / kPage * kPage;
      pieces_ = {{host_, split - 100}, {host_ + split, rounded - split}};
    }
    for (const auto& [data, size] : pieces_) {
      EXPECT_EQ(cudaHostRegister(data, size, cudaHostRegisterMapped), cudaSuccess);
    }
    int host_pointers = 0;
    cudaDeviceGetAttribute(&host_pointers, cudaDevAttrCanUseHostPointerForRegisteredMem, 0);
    if (registrations > 1) {
      EXPECT_NE(host_pointers, 0) << "two registrations read as one need the host's address";
      mapped_ = host_;
    } else {
      EXPECT_EQ(cudaHostGetDevicePointer(&mapped_, host_, 0), cudaSuccess);
    }
  }
  ~MappedCopy() {
    for (const auto& piece : pieces_) cudaHostUnregister(piece.first);
    std::free(host_);
  }
  const void* mapped() const { return mapped_; }

 private:
  static constexpr size_t kPage = 4096;
  std::byte* host_ = nullptr;
  std::vector<std::pair<std::byte*, size_t>> pieces_;
  void* mapped_ = nullptr;
};

struct StepResult {
  std::vector<int32_t> support, sizes, counts;
  std::vector<float> o, lse;
};

class CudaCandidateAttentionTest : public ::testing::TestWithParam<Geometry> {};

TEST_P(CudaCandidateAttentionTest, MatchesTheCpuExactPathFromDeviceAndMappedHostMemory) {
  KVRECALL_SKIP_WITHOUT_GPU();
  const Geometry g = GetParam();
  constexpr int kTopK = 128;
  const std::vector<int32_t> sizes = {5000, 3000, 90};  // the last: fewer candidates than K
  DeviceKv kv(5000, g.kv_heads, g.head_dim, g.dtype, 7);
  MappedCopy mapped_keys(kv.keys, 1), mapped_values(kv.values, 1);
  MappedCopy split_keys(kv.keys, 2), split_values(kv.values, 2);
  const int batch = static_cast<int>(sizes.size());
  const cuda::DecodeShape shape = g.Shape(batch);
  const std::vector<float> q = RandomNormal(shape.rows() * g.head_dim, 3, 2.0f);
  const HostLists lists = MakeLists(sizes, g.q_heads, g.kv_heads, 11);
  auto d_q = ToDevice(q);
  auto d_shortlists = ToDevice(lists.shortlists);
  auto d_shortlist_sizes = ToDevice(lists.shortlist_sizes);
  auto d_outliers = ToDevice(lists.outliers);
  auto d_outlier_counts = ToDevice(lists.outlier_counts);
  auto d_coded = ToDevice(lists.coded);
  const CandidateLists d_lists{d_shortlists.data(), d_shortlist_sizes.data(), kShortlist,
                               d_outliers.data(),   d_outlier_counts.data(),  kOutliers,
                               d_coded.data(),      kMaxUncoded};
  // Every row but one of sequence 0, sequence 1's in reverse, sequence 2's; a skipped entry.
  std::vector<int32_t> rows;
  for (int h = 1; h < g.q_heads; ++h) rows.push_back(h);
  rows.push_back(-1);
  for (int h = g.q_heads - 1; h >= 0; --h) rows.push_back(g.q_heads + h);
  for (int h = 0; h < g.q_heads; ++h) rows.push_back(2 * g.q_heads + h);
  auto d_rows = ToDevice(rows);
  auto errors = cuda::KernelErrors::Create();
  ASSERT_TRUE(errors.ok()) << errors.status();

  auto run = [&](const void* keys, const void* values) {
    std::vector<DeviceSeq> seqs;
    for (int32_t n : sizes) seqs.push_back(DeviceSeq::Contiguous(keys, values, n));
    auto d_seqs = ToDevice(seqs);
    StepOutputs out(shape.rows(), g.head_dim, kTopK);
    auto counts = ToDevice(std::vector<int32_t>(shape.rows(), -1));
    const CandidateOutputs d_out{out.o.data(), out.lse.data(), out.support.data(),
                                 out.size.data(), counts.data()};
    const absl::Status s =
        cuda::CandidateAttention(shape, kTopK, d_seqs.data(), d_q.data(), d_lists, d_rows.data(),
                                 static_cast<int>(rows.size()), d_out, errors->device_word(),
                                 nullptr);
    EXPECT_TRUE(s.ok()) << s;
    EXPECT_TRUE(errors->CheckAndClear(nullptr).ok());
    return StepResult{out.HostSupport(), out.HostSize(), ToHost(counts.data(), shape.rows()),
               out.HostO(), out.HostLse()};
  };
  const StepResult device = run(kv.keys.data(), kv.values.data());
  const StepResult host = run(mapped_keys.mapped(), mapped_values.mapped());
  const StepResult split = run(split_keys.mapped(), split_values.mapped());

  const KvView view = kv.host.view();
  for (const StepResult* got : {&device, &host, &split}) {
    for (int b = 0; b < batch; ++b) {
      for (int h = 0; h < g.q_heads; ++h) {
        SCOPED_TRACE(absl::StrCat(got == &device ? "device"
                                  : got == &host ? "mapped host"
                                                 : "mapped host, two registrations",
                                  " b=", b, " h=", h));
        const int row = b * g.q_heads + h;
        if (std::find(rows.begin(), rows.end(), row) == rows.end()) {
          EXPECT_EQ(got->sizes[row], -1) << "a row not asked for was written";
          EXPECT_TRUE(std::isnan(got->lse[row]));
          continue;
        }
        const int kv_head = KvHeadOf(h, g.q_heads, g.kv_heads);
        const float* qh = q.data() + static_cast<size_t>(row) * g.head_dim;
        const std::vector<int32_t> candidates =
            ReferenceCandidates(lists, b, h, g.q_heads, g.kv_heads, sizes[b]);
        ASSERT_EQ(got->counts[row], static_cast<int32_t>(candidates.size()));
        std::vector<float> scores(candidates.size());
        cpu::ScoreTokens(qh, view, kv_head, candidates, shape.scale, scores.data());
        std::vector<int32_t> positions;
        cpu::TopKPositions(scores, kTopK, &positions);
        // Scores by token position (-inf off the candidates: choosing one fails the check).
        std::vector<float> by_position(sizes[b], -std::numeric_limits<float>::infinity());
        for (size_t i = 0; i < candidates.size(); ++i) by_position[candidates[i]] = scores[i];
        std::vector<int32_t> want;
        for (int p : positions) want.push_back(candidates[p]);
        ASSERT_EQ(got->sizes[row], static_cast<int32_t>(want.size()));
        const std::vector<int32_t> chosen(got->support.begin() + row * kTopK,
                                          got->support.begin() + row * kTopK + got->sizes[row]);
        ASSERT_EQ(std::set<int32_t>(chosen.begin(), chosen.end()).size(), chosen.size());
        if (!want.empty()) {
          const float kth = by_position[want.back()];
          const float slack = kTieTolerance * std::max(1.0f, std::abs(kth));
          const std::set<int32_t> want_set(want.begin(), want.end());
          for (int32_t p : chosen) {
            ASSERT_GE(p, 0);
            ASSERT_LT(p, sizes[b]);
            if (!want_set.count(p)) EXPECT_NEAR(by_position[p], kth, slack) << "extra " << p;
          }
        }
        std::vector<float> ref_o(g.head_dim);
        float ref_lse = 0;
        cpu::PartialAttention(qh, view, kv_head, chosen, shape.scale, ref_o.data(), &ref_lse);
        EXPECT_NEAR(got->lse[row], ref_lse, kOutputTolerance * std::max(1.0f, std::abs(ref_lse)));
        for (int j = 0; j < g.head_dim; ++j) {
          ASSERT_NEAR(got->o[row * g.head_dim + j], ref_o[j], kOutputTolerance) << "j=" << j;
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Geometries, CudaCandidateAttentionTest,
                         ::testing::Values(Geometry{32, 8, 128, KvDtype::kBf16},
                                           Geometry{8, 2, 64, KvDtype::kF16},
                                           Geometry{4, 4, 128, KvDtype::kF16}),
                         ::kvrecall::testing::GeometryName);

TEST(CudaCandidateAttentionErrorsTest, BadDeviceDataIsReportedAndBadBoundsRefused) {
  KVRECALL_SKIP_WITHOUT_GPU();
  const Geometry g{4, 2, 128, KvDtype::kBf16};
  const cuda::DecodeShape shape = g.Shape(1);
  DeviceKv kv(1000, g.kv_heads, g.head_dim, g.dtype, 5);
  auto d_seqs = ToDevice(std::vector<DeviceSeq>{kv.Contiguous(1000)});
  auto d_q = ToDevice(RandomNormal(shape.rows() * g.head_dim, 4, 1.0f));
  // An id past the sequence; 200 uncoded positions where 64 are allowed.
  std::vector<int32_t> shortlists(shape.rows() * 8, 5);
  shortlists[3] = 1000;
  auto d_shortlists = ToDevice(shortlists);
  auto d_outliers = ToDevice(std::vector<int32_t>(g.kv_heads * 4, 7));
  auto d_counts = ToDevice(std::vector<int32_t>(g.kv_heads, 4));
  auto d_coded = ToDevice(std::vector<int32_t>{800});
  auto d_rows = ToDevice(std::vector<int32_t>{0, 1, 2, 3});
  StepOutputs out(shape.rows(), g.head_dim, 16);
  auto d_cand = ToDevice(std::vector<int32_t>(shape.rows(), -1));
  const CandidateOutputs d_out{out.o.data(), out.lse.data(), out.support.data(), out.size.data(),
                               d_cand.data()};
  auto errors = cuda::KernelErrors::Create();
  ASSERT_TRUE(errors.ok());
  const CandidateLists lists{d_shortlists.data(), nullptr, 8, d_outliers.data(), d_counts.data(),
                             4, d_coded.data(), 64};
  ASSERT_TRUE(cuda::CandidateAttention(shape, 16, d_seqs.data(), d_q.data(), lists, d_rows.data(),
                                       4, d_out, errors->device_word(), nullptr)
                  .ok());
  const absl::Status reported = errors->CheckAndClear(nullptr);
  EXPECT_EQ(reported.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(reported.message(), HasSubstr("an index outside its sequence"));
  // The rows still ran: candidates 5, 7 and the first 64 uncoded positions.
  const std::vector<int32_t> counts = ToHost(d_cand.data(), shape.rows());
  EXPECT_THAT(counts, ::testing::Each(2 + 64));

  // Bounds whose candidate set cannot fit shared memory, a zero top_k, null outputs.
  CandidateLists huge = lists;
  huge.shortlist_stride = 1 << 20;
  absl::Status s = cuda::CheckCandidateAttention(shape, 16, huge);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("shared memory"));
  s = cuda::CandidateAttention(shape, 0, d_seqs.data(), d_q.data(), lists, d_rows.data(), 4,
                               d_out, nullptr, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("top_k"));
  CandidateOutputs no_o = d_out;
  no_o.o = nullptr;
  s = cuda::CandidateAttention(shape, 16, d_seqs.data(), d_q.data(), lists, d_rows.data(), 4,
                               no_o, nullptr, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("null"));
  EXPECT_EQ(cuda::CandidateAttention(shape, 16, d_seqs.data(), d_q.data(), lists, d_rows.data(),
                                     -1, d_out, nullptr, nullptr)
                .code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvrecall
