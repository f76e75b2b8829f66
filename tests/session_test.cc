// A session's prompt layers on the CPU backend (server/session.h): CommitPrompt installs them,
// and UncommitPrompt takes back what one commit installed, for a Prefill whose OK never reached
// its client: all of its layers or none, never a layer stepped since nor a closed session's,
// the prompt length 0 again once no layer is left, and the memory given back through the grant.
#include <cmath>
#include <memory>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "index/build_stop.h"
#include "server/backends/cpu_backend.h"
#include "server/memory_budget.h"
#include "server/policy.h"
#include "server/session.h"
#include "tests/test_util.h"

namespace kvrecall {
namespace {

using ::kvrecall::testing::RandomKv;
using ::kvrecall::testing::RandomNormal;

constexpr int kLayers = 3, kQHeads = 4, kKvHeads = 2, kDim = 16;
constexpr int64_t kPrompt = 40;

using Installed = std::vector<std::pair<int, const LayerBackend*>>;

class SessionPromptTest : public ::testing::Test {
 protected:
  SessionPromptTest() {
    geometry_.set_layers(kLayers);
    geometry_.set_q_heads(kQHeads);
    geometry_.set_kv_heads(kKvHeads);
    geometry_.set_head_dim(kDim);
    geometry_.set_dtype(v1::DTYPE_F32);
    config_.shape = LayerShape{kQHeads, kKvHeads, kDim, 1.0f / std::sqrt(float{kDim})};
    config_.dtype = v1::DTYPE_F32;
    config_.selector.kind = SelectorKind::kFull;
    policy_.selector = config_.selector;
    session_ = std::make_unique<Session>("s", "", geometry_, policy_, config_, &backend_,
                                         &budget_);
  }

  // A layer built from a random prompt of `tokens` tokens, charged to the session.
  StagedLayer Built(int layer, int64_t tokens) {
    const SessionAccounts accounts = session_->accounts();
    absl::StatusOr<std::unique_ptr<PromptStaging>> staging =
        backend_.NewPromptStaging(config_, accounts);
    EXPECT_TRUE(staging.ok()) << staging.status();
    const RandomKv kv(tokens, kKvHeads, kDim, 10 + layer);
    EXPECT_TRUE((*staging)->Reserve(tokens, "test").ok());
    std::copy(kv.keys.begin(), kv.keys.end(), static_cast<float*>((*staging)->key_tail()));
    std::copy(kv.values.begin(), kv.values.end(), static_cast<float*>((*staging)->value_tail()));
    EXPECT_TRUE((*staging)->Commit(tokens, /*with_queries=*/false).ok());
    absl::StatusOr<std::unique_ptr<LayerBackend>> built =
        backend_.BuildLayer(config_, accounts, *std::move(staging), BuildStop());
    EXPECT_TRUE(built.ok()) << built.status();
    return StagedLayer{layer, *std::move(built)};
  }

  // Commits new layers `numbers` of `tokens` tokens as one Prefill would; returns what it
  // installed.
  Installed Commit(const std::vector<int>& numbers, int64_t tokens = kPrompt) {
    std::vector<StagedLayer> layers;
    for (int layer : numbers) layers.push_back(Built(layer, tokens));
    Installed installed;
    for (const StagedLayer& s : layers) installed.emplace_back(s.layer, s.built.get());
    absl::MutexLock lock(&session_->mu());
    const absl::Status committed = session_->CommitPrompt(layers);
    EXPECT_TRUE(committed.ok()) << committed;
    return installed;
  }

  // Takes back `installed`; returns how many layers it took (freed here, under the lock: a
  // test's).
  size_t Uncommit(const Installed& installed) {
    absl::MutexLock lock(&session_->mu());
    return session_->UncommitPrompt(installed).size();
  }

  int64_t PromptTokens() {
    absl::MutexLock lock(&session_->mu());
    return session_->prompt_tokens();
  }
  bool Decodable(int layer) {
    absl::MutexLock lock(&session_->mu());
    return session_->CheckDecodable(layer).ok();
  }

  // One decode step of `layer`: its history grows by a token.
  void Step(int layer) {
    absl::MutexLock lock(&session_->mu());
    LayerBackend& backend = session_->layer(layer);
    ASSERT_TRUE(backend.ReserveToken().ok());
    const std::vector<float> q = RandomNormal(kQHeads * kDim, 1);
    const std::vector<float> kv = RandomNormal(kKvHeads * kDim, 2);
    std::vector<float> o(kQHeads * kDim), lse(kQHeads);
    std::vector<HeadReport> heads(kQHeads);
    std::vector<LayerStep> steps{LayerStep{&backend, q.data(), kv.data(), kv.data(), o.data(),
                                           lse.data(), heads.data()}};
    ASSERT_TRUE(backend_.Step(steps, nullptr).ok());
  }

  MemoryBudget budget_{0};
  CpuBackend backend_;
  v1::Geometry geometry_;
  LayerConfig config_;
  EffectivePolicy policy_;
  std::unique_ptr<Session> session_;
};

TEST_F(SessionPromptTest, AWholePromptTakenBackLeavesNothingAndTakesAPromptAgain) {
  const Installed installed = Commit({0, 1, 2});
  EXPECT_EQ(PromptTokens(), kPrompt);
  EXPECT_GT(budget_.used(), 0);
  EXPECT_EQ(Uncommit(installed), 3u);
  EXPECT_EQ(PromptTokens(), 0);
  EXPECT_EQ(budget_.used(), 0) << "the layers' memory is given back as they are freed";
  for (int layer = 0; layer < kLayers; ++layer) EXPECT_FALSE(Decodable(layer));
  // A prompt of another length is now the session's first.
  Commit({0, 1, 2}, 25);
  EXPECT_EQ(PromptTokens(), 25);
}

// Two Prefills of one layer each, taken back in either order: the length stays while a layer
// is left, and is 0 once none is (review 17b, 3).
TEST_F(SessionPromptTest, LayersOfTwoCommitsTakenBackInEitherOrder) {
  for (const bool first_back_first : {true, false}) {
    SCOPED_TRACE(first_back_first ? "first commit taken back first" : "second first");
    const Installed first = Commit({0});
    const Installed second = Commit({1});
    EXPECT_EQ(Uncommit(first_back_first ? first : second), 1u);
    EXPECT_EQ(PromptTokens(), kPrompt) << "a layer is left";
    EXPECT_EQ(Decodable(0), !first_back_first);
    EXPECT_EQ(Decodable(1), first_back_first);
    EXPECT_EQ(Uncommit(first_back_first ? second : first), 1u);
    EXPECT_EQ(PromptTokens(), 0);
    EXPECT_EQ(budget_.used(), 0);
  }
}

// A layer that was stepped since its commit is someone's: nothing of that commit is taken
// back, not even its other layers (all of them or none).
TEST_F(SessionPromptTest, NothingIsTakenBackOnceALayerWasStepped) {
  const Installed installed = Commit({0, 1});
  Step(1);
  const int64_t held = budget_.used();
  EXPECT_EQ(Uncommit(installed), 0u);
  EXPECT_EQ(PromptTokens(), kPrompt);
  EXPECT_TRUE(Decodable(0));
  EXPECT_TRUE(Decodable(1));
  EXPECT_EQ(budget_.used(), held);
}

// A closed session freed its layers: there is nothing to take back.
TEST_F(SessionPromptTest, NothingIsTakenBackFromAClosedSession) {
  const Installed installed = Commit({0, 1, 2});
  {
    absl::MutexLock lock(&session_->mu());
    session_->Close();
  }
  EXPECT_EQ(budget_.used(), 0);
  EXPECT_EQ(Uncommit(installed), 0u);
}

}  // namespace
}  // namespace kvrecall
