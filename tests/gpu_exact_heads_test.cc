// The GPU tier's exact heads (server/backends/gpu_static_set.cc) through the StaticSetTier calls
// TieredBackend makes for a step, on a captured step: the heads named after the launch
// (SetExactHeads, awaited on the device) run the host's exact path over the same shortlists
// (candidates, support, state); and every way a step can end without naming them leaves no
// trace on the next: heads refused with INTERNAL, a host that never names them before Finish, a
// step abandoned after Start (the next Prepare drains it), a bound that grows and shrinks. A
// step whose wait ran into its timeout would fail its own Finish or the next step. And what the
// captured steps cost the device budget. Skipped without a CUDA device (or a CUDA build).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "gtest/gtest.h"
#include "index/basic_selectors.h"
#include "index/shortlist_selector.h"
#include "kernels/cpu/attention.h"
#include "server/backends/bulk_codes.h"
#include "server/backends/captured_step_charge.h"
#include "server/backends/tiered_backend.h"
#include "server/kv_store.h"
#include "server/memory_budget.h"
#include "tests/server_fixture.h"
#include "tests/test_util.h"
#include "tests/tier_step_buffers.h"

namespace kvrecall {
namespace {

using ::kvrecall::testing::HasStatus;
using ::kvrecall::testing::NarrowedKv;
using ::kvrecall::testing::RandomKv;
using ::kvrecall::testing::RandomNormal;

constexpr int kQHeads = 4, kKvHeads = 2, kDim = 64;
constexpr int kSinks = 4, kRecent = 8, kTopK = 8, kShortlist = 32;
constexpr int64_t kTokens = 700;

class GpuExactHeadsTest : public ::testing::Test {
 protected:
  GpuExactHeadsTest()
      : kv_(RandomKv(kTokens, kKvHeads, kDim, 7), KvElement::kBf16),
        q_(RandomNormal(kQHeads * kDim, 8)) {
    config_.shape = LayerShape{kQHeads, kKvHeads, kDim, 1.0f / std::sqrt(float{kDim})};
    config_.dtype = v1::DTYPE_BF16;
    config_.selector.kind = SelectorKind::kIndex;
    config_.selector.top_k = kTopK;
    config_.selector.sinks = kSinks;
    config_.selector.recent = kRecent;
    config_.selector.shortlist = kShortlist;
  }
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<StaticSetTier>> tier =
        MakeGpuStaticSetTier(0, &device_, /*cuda_graphs=*/true);
    if (!tier.ok()) GTEST_SKIP() << "no GPU tier here: " << tier.status();
    tier_ = *std::move(tier);
    ASSERT_NE(tier_->host_pinning(), nullptr);
    const size_t bytes = kv_.keys.size() * sizeof(uint16_t);
    ASSERT_TRUE(tier_->host_pinning()->Pin(kv_.keys.data(), bytes).ok());
    ASSERT_TRUE(tier_->host_pinning()->Pin(kv_.values.data(), bytes).ok());
    pinned_ = true;
    absl::StatusOr<std::unique_ptr<StaticSet>> set = tier_->Build(config_, &device_, kv_.view());
    ASSERT_TRUE(set.ok()) << set.status();
    set_ = *std::move(set);
    absl::StatusOr<std::unique_ptr<BulkCodes>> codes =
        tier_->BuildCodes(config_, SessionAccounts{&host_, &device_}, bulk(), bulk().tokens,
                          BuildStop());
    ASSERT_TRUE(codes.ok()) << codes.status();
    codes_ = *std::move(codes);
    context_ = tier_->NewStepContext(nullptr);
  }
  void TearDown() override {
    context_.reset();  // drains a step left in flight, before the KV is unpinned
    if (pinned_) {
      tier_->host_pinning()->Unpin(kv_.keys.data());
      tier_->host_pinning()->Unpin(kv_.values.data());
    }
  }
  KvView bulk() const { return kv_.view().Tokens(kSinks, BulkTokens(kTokens, kSinks, kRecent)); }
  // A step (its token is the history's last, appended again to the ring's same slot) giving the
  // tier query heads `heads` within `bound`; the bulk outputs reset to marks.
  StaticSetStep Step(const std::vector<int32_t>& heads, int bound) {
    const float* k_new = kv_.wide_keys.data() + (kTokens - 1) * kKvHeads * kDim;
    const float* v_new = kv_.wide_values.data() + (kTokens - 1) * kKvHeads * kDim;
    return b_.Step(config_, set_.get(), codes_.get(), kv_.view(), bulk(), q_.data(), k_new, v_new,
                   heads, bound);
  }
  // TieredBackend's calls, up to `calls` of them (2: Prepare and Start; 3: and WaitShortlists,
  // never naming the heads; 5: every call); SetExactHeads' status. Every other call must
  // succeed.
  absl::Status Run(const StaticSetStep& step, int calls = 5) {
    const std::span<const StaticSetStep> steps(&step, 1);
    EXPECT_TRUE(tier_->Prepare(steps, context_.get()).ok());
    EXPECT_TRUE(tier_->Start(steps, context_.get()).ok());
    if (calls == 2) return absl::OkStatus();
    absl::Status given = absl::OkStatus();
    if (calls == 5) given = tier_->SetExactHeads(steps, context_.get());
    if (given.ok()) EXPECT_TRUE(tier_->WaitShortlists(steps, context_.get()).ok());
    const absl::Status finished = tier_->Finish(steps, context_.get());
    EXPECT_TRUE(finished.ok()) << finished;
    return given;
  }
  bool Untouched(int h) const { return b_.Untouched(h, kDim); }
  // Expects the last step's heads `heads` to be the host's exact path over the step's own
  // shortlists, and the others untouched.
  void ExpectHostsExactPath(const std::vector<int32_t>& heads) {
    ShortlistSelector exact(config_.shape, kTopK);
    for (int g = 0; g < kKvHeads; ++g) exact.SetOutliers(g, codes_->outliers(g));
    for (int h = 0; h < kQHeads; ++h) {
      SCOPED_TRACE(absl::StrCat("head ", h));
      if (std::find(heads.begin(), heads.end(), h) == heads.end()) {
        EXPECT_TRUE(Untouched(h));
        continue;
      }
      exact.SetShortlist(h, std::span<const int32_t>(b_.ids.data() + h * kShortlist, b_.sizes[h]),
                         b_.coded);
      HeadSelection want;
      exact.Select(h, q_.data() + h * kDim, bulk(), &want);
      std::vector<float> o(kDim);
      float lse = 0;
      cpu::PartialAttentionScored(want.support_scores, bulk(), KvHeadOf(h, kQHeads, kKvHeads),
                                  want.support, o.data(), &lse);
      EXPECT_EQ(b_.candidates[h], want.candidates);
      ASSERT_EQ(b_.support_sizes[h], kTopK);
      const auto support = b_.support.begin() + h * kTopK;
      std::vector<int32_t> got(support, support + kTopK);
      std::sort(got.begin(), got.end());
      std::sort(want.support.begin(), want.support.end());
      EXPECT_EQ(got, want.support) << "bulk positions (f32 sums: a near-tie could differ)";
      EXPECT_NEAR(b_.bulk_lse[h], lse, 1e-4f * std::max(1.0f, std::abs(lse)));
      for (int j = 0; j < kDim; ++j) {
        ASSERT_NEAR(b_.bulk_o[h * kDim + j], o[j], 1e-4f) << "dim " << j;
      }
    }
  }

  LayerConfig config_;
  MemoryBudget host_{0};
  // Bounded (far above what these tests use), so that a test can leave it no room.
  MemoryBudget device_{int64_t{1} << 36, "GPU 0 memory", "gpu_memory_budget_gb"};
  NarrowedKv kv_;
  std::vector<float> q_;
  std::unique_ptr<StaticSetTier> tier_;
  bool pinned_ = false;
  std::unique_ptr<StaticSet> set_;
  std::unique_ptr<BulkCodes> codes_;
  std::unique_ptr<StepContext> context_;
  testing::TierStepBuffers b_;
};

TEST_F(GpuExactHeadsTest, HeadsNamedAfterTheLaunchRunTheHostsExactPath) {
  ASSERT_TRUE(tier_->ServesExactHeads(config_, *codes_, 3));
  for (int round = 0; round < 3; ++round) {  // captured, then replayed with other heads
    SCOPED_TRACE(absl::StrCat("round ", round));
    const std::vector<int32_t> heads = round == 1 ? std::vector<int32_t>{0, 3}
                                                  : std::vector<int32_t>{2, 3};
    ASSERT_TRUE(Run(Step(heads, 2)).ok());
    ExpectHostsExactPath(heads);
  }
  // A larger bound (the rows' buffer grows), then the smaller again (it is kept).
  ASSERT_TRUE(Run(Step({1, 2, 3}, 3)).ok());
  ExpectHostsExactPath({1, 2, 3});
  ASSERT_TRUE(Run(Step({1}, 2)).ok());
  ExpectHostsExactPath({1});
}

TEST_F(GpuExactHeadsTest, AStepThatNamesNoHeadsLeavesNoTraceOnTheNext) {
  // Refused heads: INTERNAL, none run, the step finishes (its wait ended at once, not at its
  // timeout, which would set the error word Finish reads).
  static_assert(kQHeads == 4);
  for (const testing::RefusedExactHeads& c : testing::RefusedExactHeadsOfFourWithinTwo()) {
    SCOPED_TRACE(c.message);
    EXPECT_TRUE(HasStatus(Run(Step(c.heads, 2)), absl::StatusCode::kInternal, c.message));
    for (int h = 0; h < kQHeads; ++h) EXPECT_TRUE(Untouched(h)) << "head " << h;
    for (int h = 0; h < kQHeads; ++h) EXPECT_TRUE(std::isfinite(b_.lse[h])) << "head " << h;
    ASSERT_TRUE(Run(Step({2, 3}, 2)).ok());
    ExpectHostsExactPath({2, 3});
  }
  // A host that never names them: Finish gives the step none, and finishes.
  ASSERT_TRUE(Run(Step({2, 3}, 2), /*calls=*/3).ok());
  for (int h = 0; h < kQHeads; ++h) EXPECT_TRUE(Untouched(h)) << "head " << h;
  ASSERT_TRUE(Run(Step({2, 3}, 2)).ok());
  ExpectHostsExactPath({2, 3});
  // A step abandoned after Start: the next Prepare drains it, and that step runs as any.
  ASSERT_TRUE(Run(Step({0, 1}, 2), /*calls=*/2).ok());
  ASSERT_TRUE(Run(Step({2, 3}, 2)).ok());
  ExpectHostsExactPath({2, 3});
}

// A captured step is charged to the device budget while the step context keeps it
// (gpu::kCapturedStepDeviceBytes) and given back with the context; a step the budget has no
// room to capture runs eagerly, as exact, and is captured once its retry is due
// (gpu::kCaptureRetryRuns lookups later) and there is room (review 13's L5 and L6).
TEST_F(GpuExactHeadsTest, ACapturedStepIsChargedWhileKeptAndRunsEagerlyWithoutRoom) {
  const int64_t before = device_.used();  // the static set and the codes
  ASSERT_TRUE(Run(Step({2, 3}, 2)).ok());
  ExpectHostsExactPath({2, 3});
  const int64_t one_step = device_.used();  // and the context's buffers, one step captured
  ASSERT_TRUE(Run(Step({0, 1}, 2)).ok());
  EXPECT_EQ(device_.used(), one_step) << "the same key: the step kept is replayed";
  // Codes of the same bulk, another object: another key (a step names its codes by address),
  // the same buffers.
  int64_t codes_bytes = 0;
  std::vector<std::unique_ptr<BulkCodes>> kept_codes;
  auto other_codes = [&] {
    const int64_t used = device_.used();
    absl::StatusOr<std::unique_ptr<BulkCodes>> codes = tier_->BuildCodes(
        config_, SessionAccounts{&host_, &device_}, bulk(), bulk().tokens, BuildStop());
    EXPECT_TRUE(codes.ok()) << codes.status();
    codes_bytes += device_.used() - used;
    kept_codes.push_back(std::move(codes_));
    codes_ = codes.ok() ? *std::move(codes) : nullptr;
    return codes_ != nullptr;
  };
  ASSERT_TRUE(other_codes());
  int64_t used = device_.used();
  ASSERT_TRUE(Run(Step({2, 3}, 2)).ok());
  ExpectHostsExactPath({2, 3});
  EXPECT_EQ(device_.used() - used, gpu::kCapturedStepDeviceBytes) << "a second step kept";

  // No room for a third: it runs eagerly, as exact, charging nothing.
  ASSERT_TRUE(other_codes());
  const int64_t filler = device_.available() - gpu::kCapturedStepDeviceBytes + 1;
  device_.Charge(filler);
  used = device_.used();
  ASSERT_TRUE(Run(Step({2, 3}, 2)).ok());
  ExpectHostsExactPath({2, 3});
  EXPECT_EQ(device_.used(), used);
  // Room again: still eager until its retry is due, then captured and charged.
  device_.Release(filler);
  used = device_.used();
  for (uint64_t lookup = 1; lookup < gpu::kCaptureRetryRuns; ++lookup) {
    ASSERT_TRUE(Run(Step({2, 3}, 2)).ok()) << lookup;
  }
  EXPECT_EQ(device_.used(), used) << "tried again before its retry was due";
  ASSERT_TRUE(Run(Step({2, 3}, 2)).ok());
  ExpectHostsExactPath({2, 3});
  EXPECT_EQ(device_.used() - used, gpu::kCapturedStepDeviceBytes);
  ASSERT_TRUE(Run(Step({0, 1}, 2)).ok());
  ExpectHostsExactPath({0, 1});

  // The context gone, its kept steps' charges go with its buffers.
  context_.reset();
  EXPECT_EQ(device_.used(), before + codes_bytes);
}

// A kept step not run for gpu::kCapturedStepStaleRuns lookups (the key of codes that took
// over) is dropped and its charge given back, while the live one stays.
TEST_F(GpuExactHeadsTest, AStaleCapturedStepGivesItsChargeBack) {
  ASSERT_TRUE(Run(Step({2, 3}, 2)).ok());  // captured with the fixture's codes
  std::unique_ptr<BulkCodes> first = std::move(codes_);
  absl::StatusOr<std::unique_ptr<BulkCodes>> codes = tier_->BuildCodes(
      config_, SessionAccounts{&host_, &device_}, bulk(), bulk().tokens, BuildStop());
  ASSERT_TRUE(codes.ok()) << codes.status();
  codes_ = *std::move(codes);
  ASSERT_TRUE(Run(Step({2, 3}, 2)).ok());  // another key: a second step kept
  const int64_t both = device_.used();
  uint64_t lookups = 2;
  for (; lookups <= gpu::kCapturedStepStaleRuns + gpu::kCaptureRetryRuns; ++lookups) {
    ASSERT_TRUE(Run(Step({2, 3}, 2)).ok()) << lookups;
  }
  EXPECT_EQ(device_.used(), both - gpu::kCapturedStepDeviceBytes) << "the first codes' step";
  ExpectHostsExactPath({2, 3});
  ASSERT_TRUE(Run(Step({0, 1}, 2)).ok());
  EXPECT_EQ(device_.used(), both - gpu::kCapturedStepDeviceBytes) << "the live one kept";
}

}  // namespace
}  // namespace kvrecall
