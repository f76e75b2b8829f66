// The host tier's stand-in for a device's exact heads (HostStaticSetTierOptions::exact_heads),
// through the StaticSetTier calls TieredBackend makes for a step: the heads it is given run the
// host's exact path (ShortlistSelector over the step's shortlist, outliers and uncoded tail,
// then the attention over the support), bit for bit, with their supports as bulk positions,
// and other heads' outputs untouched; a step's exact heads out of range or over its bound, or
// given to a host tier that serves none, are refused with INTERNAL before any runs, and the
// step still finishes. (The served side: tests/tiered_shortlist_test.cc.)
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
#include "server/backends/placements.h"
#include "server/backends/tiered_backend.h"
#include "server/memory_budget.h"
#include "tests/server_fixture.h"
#include "tests/test_util.h"
#include "tests/tier_step_buffers.h"

namespace kvrecall {
namespace {

using ::kvrecall::testing::HasStatus;
using ::kvrecall::testing::RandomKv;
using ::kvrecall::testing::RandomNormal;

constexpr int kQHeads = 4, kKvHeads = 2, kDim = 64;
constexpr int kSinks = 4, kRecent = 8, kTopK = 8, kShortlist = 32;
constexpr int64_t kTokens = 700;

LayerConfig Config() {
  LayerConfig config;
  config.shape = LayerShape{kQHeads, kKvHeads, kDim, 1.0f / std::sqrt(float{kDim})};
  config.selector.kind = SelectorKind::kIndex;
  config.selector.top_k = kTopK;
  config.selector.sinks = kSinks;
  config.selector.recent = kRecent;
  config.selector.shortlist = kShortlist;
  return config;
}

// One layer of kTokens on a host tier, and the buffers of one step of it (the history is the
// step's: its last token is the new one), as TieredBackend lays them out.
class HostExactHeadsTest : public ::testing::Test {
 protected:
  HostExactHeadsTest() : kv_(kTokens, kKvHeads, kDim, 7), q_(RandomNormal(kQHeads * kDim, 8)) {
    // Keys far from every centroid among the bulk's last kUncoded rows, which the codes are
    // built without (the step's Start codes them): the shortlist's outliers (the codes' bar,
    // set on rows they did not learn from, leaves random keys almost none of their own).
    const int64_t row = int64_t{kKvHeads} * kDim;
    const int64_t bulk_end = kTokens - kRecent;
    for (int64_t i = (bulk_end - 4) * row; i < bulk_end * row; ++i) kv_.keys[i] *= 40.0f;
  }
  static constexpr int64_t kUncoded = 8;

  // Builds the static set, and codes of the bulk but its last kUncoded rows, on `tier`.
  void Build(StaticSetTier& tier) {
    absl::StatusOr<std::unique_ptr<StaticSet>> set = tier.Build(config_, nullptr, kv_.view());
    ASSERT_TRUE(set.ok()) << set.status();
    set_ = *std::move(set);
    absl::StatusOr<std::unique_ptr<BulkCodes>> codes = tier.BuildCodes(
        config_, accounts_, bulk().Tokens(0, bulk().tokens - kUncoded), bulk().tokens,
        BuildStop());
    ASSERT_TRUE(codes.ok()) << codes.status();
    codes_ = *std::move(codes);
    context_ = tier.NewStepContext(nullptr);
  }
  KvView bulk() const {
    return kv_.view().Tokens(kSinks, BulkTokens(kTokens, kSinks, kRecent));
  }
  // A step giving the tier query heads `heads` within `bound`; the bulk outputs are reset to
  // marks no exact path writes.
  StaticSetStep Step(const std::vector<int32_t>& heads, int bound) {
    return b_.Step(config_, set_.get(), codes_.get(), kv_.view(), bulk(), q_.data(), nullptr,
                   nullptr, heads, bound);
  }
  // The step's calls in TieredBackend's order; SetExactHeads' status. Every other call must
  // succeed whatever it says (a refused step still finishes).
  absl::Status Run(StaticSetTier& tier, const StaticSetStep& step) {
    const std::span<const StaticSetStep> steps(&step, 1);
    EXPECT_TRUE(tier.Prepare(steps, context_.get()).ok());
    EXPECT_TRUE(tier.Start(steps, context_.get()).ok());
    const absl::Status given = tier.SetExactHeads(steps, context_.get());
    if (given.ok()) EXPECT_TRUE(tier.WaitShortlists(steps, context_.get()).ok());
    EXPECT_TRUE(tier.Finish(steps, context_.get()).ok());
    return given;
  }
  // Whether no exact path wrote query head h's bulk outputs.
  bool Untouched(int h) const { return b_.Untouched(h, kDim); }

  LayerConfig config_ = Config();
  MemoryBudget host_{0};
  SessionAccounts accounts_{&host_, nullptr};
  RandomKv kv_;
  std::vector<float> q_;
  std::unique_ptr<StaticSet> set_;
  std::unique_ptr<BulkCodes> codes_;
  std::unique_ptr<StepContext> context_;
  testing::TierStepBuffers b_;
};

TEST_F(HostExactHeadsTest, ExactHeadsRunTheHostsExactPathBitForBit) {
  HostStaticSetTierOptions options;
  options.exact_heads = true;
  const std::unique_ptr<StaticSetTier> tier = MakeHostStaticSetTier(options);
  Build(*tier);
  ASSERT_TRUE(tier->ServesExactHeads(config_, *codes_, 2));
  ASSERT_NE(tier->host_pinning(), nullptr);
  // The host's shortlists of every head: a step with no exact heads.
  ASSERT_TRUE(Run(*tier, Step({}, 2)).ok());
  const std::vector<int32_t> shortlists = b_.ids, shortlist_sizes = b_.sizes;
  for (int h = 0; h < kQHeads; ++h) EXPECT_TRUE(Untouched(h)) << "head " << h;

  ASSERT_TRUE(Run(*tier, Step({2, 3}, 2)).ok());
  EXPECT_TRUE(Untouched(0));
  EXPECT_TRUE(Untouched(1));
  // Each exact head as the host's Select takes it, over the same shortlist.
  ShortlistSelector exact(config_.shape, kTopK);
  for (int g = 0; g < kKvHeads; ++g) exact.SetOutliers(g, codes_->outliers(g));
  for (int h : {2, 3}) {
    SCOPED_TRACE(absl::StrCat("head ", h));
    exact.SetShortlist(h,
                       std::span<const int32_t>(shortlists.data() + h * kShortlist,
                                                shortlist_sizes[h]),
                       b_.coded);
    HeadSelection want;
    exact.Select(h, q_.data() + h * kDim, bulk(), &want);
    std::vector<float> o(kDim);
    float lse = 0;
    cpu::PartialAttentionScored(want.support_scores, bulk(), KvHeadOf(h, kQHeads, kKvHeads),
                                want.support, o.data(), &lse);
    EXPECT_GT(want.candidates, kShortlist) << "the shortlist and some outliers";
    EXPECT_EQ(b_.candidates[h], want.candidates);
    ASSERT_EQ(b_.support_sizes[h], kTopK);
    const auto support = b_.support.begin() + h * kTopK;
    EXPECT_EQ(std::vector<int32_t>(support, support + kTopK), want.support)
        << "positions in the bulk";
    EXPECT_EQ(b_.bulk_lse[h], lse);
    EXPECT_EQ(std::vector<float>(b_.bulk_o.begin() + h * kDim, b_.bulk_o.begin() + (h + 1) * kDim),
              o);
  }
}

TEST_F(HostExactHeadsTest, ExactHeadsOutOfRangeOrOverTheBoundAreRefused) {
  HostStaticSetTierOptions options;
  options.exact_heads = true;
  const std::unique_ptr<StaticSetTier> tier = MakeHostStaticSetTier(options);
  Build(*tier);
  static_assert(kQHeads == 4);
  for (const testing::RefusedExactHeads& c : testing::RefusedExactHeadsOfFourWithinTwo()) {
    SCOPED_TRACE(c.message);
    EXPECT_TRUE(HasStatus(Run(*tier, Step(c.heads, 2)), absl::StatusCode::kInternal, c.message));
    for (int h = 0; h < kQHeads; ++h) EXPECT_TRUE(Untouched(h)) << "head " << h;
    // The static sets were attended all the same.
    for (int h = 0; h < kQHeads; ++h) EXPECT_TRUE(std::isfinite(b_.lse[h])) << "head " << h;
  }
  // A tier that serves none refuses any.
  const std::unique_ptr<StaticSetTier> plain = MakeHostStaticSetTier(HostStaticSetTierOptions());
  Build(*plain);
  EXPECT_FALSE(plain->ServesExactHeads(config_, *codes_, 2));
  EXPECT_EQ(plain->host_pinning(), nullptr);
  EXPECT_TRUE(HasStatus(Run(*plain, Step({3}, 2)), absl::StatusCode::kInternal, "serves none"));
  EXPECT_TRUE(Untouched(3));
  EXPECT_TRUE(Run(*plain, Step({}, 0)).ok());
}

}  // namespace
}  // namespace kvrecall
