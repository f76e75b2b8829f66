// PLACEMENT_TIERED served by an in-process server over loopback gRPC: the static set (sinks +
// ring) on the server's static tier — the GPU where there is one, host memory otherwise — and
// the bulk on the host, merged by log-sum-exp. Outputs against brute force: a bulk selector that
// returns the whole bulk equals full attention (to 1e-5 in f32), the exact top-K of the bulk
// plus the static set, streaming as the static set alone; ReTopK and the graph index select from
// the bulk only (supports never larger than K plus the static set) and ReTopK reuses; GetSession
// reports the tiers' bytes (GPU bytes constant in the context); a batch equals its sequences
// stepped alone; what a GPU static tier refuses; a step a tier refuses after validation appends
// its request's tokens whole or not at all, or says which it appended.
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/fidelity.h"
#include "server/status_util.h"
#include "tests/server_fixture.h"
#include "tests/test_util.h"

namespace kvrecall {
namespace {

using ::kvrecall::testing::CreateSession;
using ::kvrecall::testing::DecodeClient;
using ::kvrecall::testing::DriftingQueryTokens;
using ::kvrecall::testing::ExpectOutputNear;
using ::kvrecall::testing::GetSession;
using ::kvrecall::testing::HasStatus;
using ::kvrecall::testing::MakeGeometry;
using ::kvrecall::testing::MakePolicy;
using ::kvrecall::testing::PrefilledSessionTest;
using ::kvrecall::testing::ReferenceSession;
using ::kvrecall::testing::TensorValues;
using ::kvrecall::testing::TieredExactTopKSupports;

constexpr int kSinks = 16;
constexpr int kRecent = 48;

// The tests here hold the graph index's exact search (index, ReTopK's exact path) on either
// tier, so they name it: on a GPU the default is the shortlist, tiered_shortlist_test's.
v1::Policy TieredPolicy(v1::Selector selector, int top_k = 0) {
  v1::Policy p = MakePolicy(selector, top_k, kSinks, kRecent);
  p.set_placement(v1::PLACEMENT_TIERED);
  if (selector == v1::SELECTOR_INDEX || selector == v1::SELECTOR_RETOPK) {
    p.mutable_index()->set_exact_search(v1::EXACT_SEARCH_GRAPH);
  }
  return p;
}

// Token positions of the static set of a layer of n tokens.
std::vector<int32_t> StaticSet(int64_t n) {
  std::vector<int32_t> ids;
  for (int64_t t = 0; t < n; ++t) {
    if (t < kSinks || t >= n - kRecent) ids.push_back(static_cast<int32_t>(t));
  }
  return ids;
}

class TieredPlacementTest : public PrefilledSessionTest {
 protected:
  bool gpu_tier() { return TieredOnGpu(); }
  // The dtypes the static tier serves: every one on the host, the model's on a GPU.
  std::vector<v1::DType> Dtypes() {
    if (gpu_tier()) return {v1::DTYPE_BF16, v1::DTYPE_F16};
    return {v1::DTYPE_F32, v1::DTYPE_BF16};
  }
  absl::StatusOr<v1::DecodeResponse> StepAll(DecodeClient& client,
                                              const std::vector<std::string>& ids,
                                              const ReferenceSession::Token& token,
                                              const ReferenceSession& ref, bool compare) {
    v1::DecodeRequest request;
    request.set_layer(0);
    request.set_return_lse(true);
    request.set_diagnostics(true);
    request.set_compare_exact(compare);
    for (const std::string& id : ids) *request.add_steps() = ref.Step(id, token);
    return client.Step(request);
  }
};

// The exactness of the composition: full attention = static set (static tier) merged with the
// whole bulk (host), for a prompt shorter than the static set too (an empty bulk) and while
// tokens leave the ring into the bulk.
TEST_F(TieredPlacementTest, BulkSelectorReturningTheWholeBulkEqualsFullAttention) {
  for (const v1::DType dtype : Dtypes()) {
    for (const int64_t prompt : {int64_t{40}, int64_t{500}}) {
      const v1::Geometry g = MakeGeometry(1, 8, 2, 64, dtype);
      ReferenceSession ref(g, prompt, 5);
      const std::string id = CreateAndPrefill(ref, TieredPolicy(v1::SELECTOR_FULL), 128);
      DecodeClient client(stub());
      double worst = 0.0;
      for (int step = 0; step < 70; ++step) {
        const ReferenceSession::Token token = ref.MakeToken(300 + step);
        const std::vector<float> q = ref.Record(0, token);
        absl::StatusOr<v1::DecodeResponse> reply =
            StepAll(client, {id}, token, ref, /*compare=*/step % 10 == 0);
        ASSERT_TRUE(reply.ok()) << reply.status();
        const int64_t n = ref.tokens(0);
        const v1::SequenceResult& result = reply->results(0);
        EXPECT_EQ(result.position(), n - 1);
        const std::vector<std::vector<int32_t>> all(g.q_heads(), testing::AllTokens(n));
        const std::vector<double> want = ref.Attention(0, q, all);
        const std::vector<float> got = TensorValues(result.output());
        for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::abs(got[i] - want[i]));
        ExpectOutputNear(got, want, dtype, absl::StrCat("prompt ", prompt, " step ", step));
        for (int h = 0; h < g.q_heads(); ++h) {
          EXPECT_EQ(result.heads(h).support(), n);
          if (step % 10 == 0) EXPECT_GT(result.heads(h).output_cosine(), 0.99999f);
        }
      }
      // f32 on both tiers: the merge is exact up to f32 arithmetic.
      if (dtype == v1::DTYPE_F32) EXPECT_LE(worst, 1e-5) << "prompt " << prompt;
      absl::StatusOr<v1::SessionInfo> info = GetSession(stub(), id);
      ASSERT_TRUE(info.ok()) << info.status();
      EXPECT_EQ(info->device(), gpu_tier() ? "cuda:0" : "cpu");
      EXPECT_EQ(info->paths().exact(), 70 * g.q_heads());
    }
  }
}

TEST_F(TieredPlacementTest, ExactTopKIsTheBulksTopKPlusTheStaticSet) {
  for (const v1::DType dtype : Dtypes()) {
    const v1::Geometry g = MakeGeometry(1, 8, 2, 64, dtype);
    ReferenceSession ref(g, 900, 9);
    const int k = 40;
    const std::string id = CreateAndPrefill(ref, TieredPolicy(v1::SELECTOR_EXACT_TOPK, k), 300);
    DecodeClient client(stub());
    for (int step = 0; step < 8; ++step) {
      const ReferenceSession::Token token = ref.MakeToken(700 + step);
      const std::vector<float> q = ref.Record(0, token);
      absl::StatusOr<v1::DecodeResponse> reply = StepAll(client, {id}, token, ref, false);
      ASSERT_TRUE(reply.ok()) << reply.status();
      const int64_t bulk = ref.tokens(0) - kSinks - kRecent;
      const std::vector<std::vector<int32_t>> supports =
          TieredExactTopKSupports(ref, q, k, kSinks, kRecent);
      for (int h = 0; h < g.q_heads(); ++h) {
        const v1::HeadDiagnostics& head = reply->results(0).heads(h);
        EXPECT_EQ(head.support(), k + kSinks + kRecent);
        EXPECT_EQ(head.candidates(), bulk) << "a flat scan scores the bulk alone";
      }
      ExpectOutputNear(TensorValues(reply->results(0).output()), ref.Attention(0, q, supports),
                       dtype, absl::StrCat("step ", step));
    }
  }
}

TEST_F(TieredPlacementTest, StreamingIsTheStaticSetAlone) {
  const v1::Geometry g = MakeGeometry(1, 8, 2, 64, Dtypes().front());
  ReferenceSession ref(g, 600, 13);
  const std::string id = CreateAndPrefill(ref, TieredPolicy(v1::SELECTOR_STREAMING), 256);
  DecodeClient client(stub());
  for (int step = 0; step < 5; ++step) {
    const ReferenceSession::Token token = ref.MakeToken(900 + step);
    const std::vector<float> q = ref.Record(0, token);
    absl::StatusOr<v1::DecodeResponse> reply = StepAll(client, {id}, token, ref, false);
    ASSERT_TRUE(reply.ok()) << reply.status();
    const std::vector<std::vector<int32_t>> supports(g.q_heads(), StaticSet(ref.tokens(0)));
    ExpectOutputNear(TensorValues(reply->results(0).output()), ref.Attention(0, q, supports),
                     g.dtype(), absl::StrCat("step ", step));
    EXPECT_EQ(reply->results(0).heads(0).candidates(), 0);
  }
}

// Two sessions of one shape whose softmax scales differ, stepping in turn on one Decode stream:
// each attends with its own scale (a GPU's captured steps are kept per stream by what they bake
// in, the scale among it).
TEST_F(TieredPlacementTest, SessionsOfOneShapeKeepTheirOwnSoftmaxScale) {
  v1::Geometry g = MakeGeometry(1, 8, 2, 64, Dtypes().front());
  std::vector<ReferenceSession> refs;
  std::vector<std::string> ids;
  for (const float scale : {0.0f, 0.05f}) {  // 0: 1 / sqrt(64)
    g.set_softmax_scale(scale);
    refs.emplace_back(g, 300, 19);
    ids.push_back(CreateAndPrefill(refs.back(), TieredPolicy(v1::SELECTOR_FULL), 128));
    ASSERT_FALSE(ids.back().empty());
  }
  DecodeClient client(stub());
  for (int step = 0; step < 4; ++step) {
    for (size_t i = 0; i < refs.size(); ++i) {
      const ReferenceSession::Token token = refs[i].MakeToken(600 + step);
      const std::vector<float> q = refs[i].Record(0, token);
      absl::StatusOr<v1::DecodeResponse> reply = StepAll(client, {ids[i]}, token, refs[i], false);
      ASSERT_TRUE(reply.ok()) << reply.status();
      const std::vector<std::vector<int32_t>> all(g.q_heads(),
                                                  testing::AllTokens(refs[i].tokens(0)));
      ExpectOutputNear(TensorValues(reply->results(0).output()), refs[i].Attention(0, q, all),
                       g.dtype(), absl::StrCat("session ", i, " step ", step));
    }
  }
}

// sinks = 0 (a zero is served as sent): the static set is the ring alone, and the bulk starts
// at token 0. Full attention through the merge, and exact top-K of that bulk, as with sinks.
TEST_F(TieredPlacementTest, AStaticSetWithoutSinksIsTheRingAlone) {
  const v1::Geometry g = MakeGeometry(1, 8, 2, 64, Dtypes().front());
  for (const v1::Selector selector : {v1::SELECTOR_FULL, v1::SELECTOR_EXACT_TOPK}) {
    const int k = 40;
    ReferenceSession ref(g, 300, 17);
    v1::Policy policy = TieredPolicy(selector, k);
    policy.set_sinks(0);
    const std::string id = CreateAndPrefill(ref, policy, 128);
    ASSERT_FALSE(id.empty());
    absl::StatusOr<v1::SessionInfo> info = GetSession(stub(), id);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->policy().sinks(), 0);
    EXPECT_EQ(info->gpu_bytes(), gpu_tier() ? 2 * 2 * kRecent * g.kv_heads() * g.head_dim() : 0);
    DecodeClient client(stub());
    for (int step = 0; step < kRecent + 8; ++step) {  // the ring turns over once
      const ReferenceSession::Token token = ref.MakeToken(500 + step);
      const std::vector<float> q = ref.Record(0, token);
      absl::StatusOr<v1::DecodeResponse> reply = StepAll(client, {id}, token, ref, false);
      ASSERT_TRUE(reply.ok()) << reply.status();
      const int64_t n = ref.tokens(0);
      const std::vector<std::vector<int32_t>> supports =
          selector == v1::SELECTOR_FULL
              ? std::vector<std::vector<int32_t>>(g.q_heads(), testing::AllTokens(n))
              : TieredExactTopKSupports(ref, q, k, /*sinks=*/0, kRecent);
      const char* name = selector == v1::SELECTOR_FULL ? "full" : "exact_topk";
      ExpectOutputNear(TensorValues(reply->results(0).output()), ref.Attention(0, q, supports),
                       g.dtype(), absl::StrCat(name, " step ", step));
      const v1::HeadDiagnostics& head = reply->results(0).heads(0);
      EXPECT_EQ(head.support(), selector == v1::SELECTOR_FULL ? n : k + kRecent);
      if (selector == v1::SELECTOR_EXACT_TOPK) EXPECT_EQ(head.candidates(), n - kRecent);
    }
  }
}

TEST_F(TieredPlacementTest, ReTopKAndTheGraphIndexSelectFromTheBulkOnly) {
  const v1::Geometry g = MakeGeometry(1, 8, 2, 64, Dtypes().front());
  ReferenceSession ref(g, 3000, 17);
  const int k = 32;
  v1::Policy retopk = TieredPolicy(v1::SELECTOR_RETOPK, k);
  retopk.mutable_retopk()->set_tau(0.6f);
  retopk.mutable_retopk()->set_refresh_interval(16);
  const std::string retopk_id = CreateAndPrefill(ref, retopk, 1000);
  const std::string index_id = CreateAndPrefill(ref, TieredPolicy(v1::SELECTOR_INDEX, k), 1000);
  DecodeClient client(stub());
  const std::vector<ReferenceSession::Token> tokens = DriftingQueryTokens(ref, 40, 31);
  for (const ReferenceSession::Token& token : tokens) {
    const std::vector<float> q = ref.Record(0, token);
    absl::StatusOr<v1::DecodeResponse> reply =
        StepAll(client, {retopk_id, index_id}, token, ref, /*compare=*/true);
    ASSERT_TRUE(reply.ok()) << reply.status();
    const int64_t bulk = ref.tokens(0) - kSinks - kRecent;
    for (const v1::SequenceResult& result : reply->results()) {
      for (float x : TensorValues(result.output())) ASSERT_TRUE(std::isfinite(x));
      for (const v1::HeadDiagnostics& head : result.heads()) {
        // The static set always; at most K of the bulk besides, and never the whole bulk.
        EXPECT_GE(head.support(), kSinks + kRecent);
        EXPECT_LE(head.support(), kSinks + kRecent + k);
        // Reuse rescoring and the graph search (ReTopK's exact path too) score a part of
        // the bulk, never the static set.
        EXPECT_LT(head.candidates(), bulk) << "a search that scanned the whole bulk";
        EXPECT_GT(head.retained_mass(), 0.0f);
      }
    }
  }
  absl::StatusOr<v1::SessionInfo> info = GetSession(stub(), retopk_id);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_GT(info->paths().reuse(), 0);
  EXPECT_GT(info->paths().fallback() + info->paths().refresh(), 0);
  EXPECT_GT(info->selector_bytes(), 0);
  absl::StatusOr<v1::SessionInfo> index = GetSession(stub(), index_id);
  ASSERT_TRUE(index.ok()) << index.status();
  EXPECT_GT(index->selector_bytes(), 0) << "the graph index lives on the host";
}

// The bulk selectors' outputs against a brute-force reference, where their search cannot miss:
// `index` with a search list longer than the bulk (a best-first search that never drops a
// candidate scores every key the graph reaches) and `retopk` reusing over a recent window
// longer than the bulk (its reuse candidates are then every bulk token, rescored exactly). Both
// must attend exactly the bulk's top K beside the static set, on every step: before and past
// the link threshold (256 steps), where the tokens that left the ring are linked into the
// graph after the steps (deferred), and reach the reuse window as they join the bulk.
TEST_F(TieredPlacementTest, SearchesThatCannotMissAttendTheBulksExactTopK) {
  const v1::Geometry g = MakeGeometry(1, 8, 2, 64, Dtypes().front());
  ReferenceSession ref(g, 600, 61);
  const int k = 24;
  v1::Policy index = TieredPolicy(v1::SELECTOR_INDEX, k);
  index.mutable_index()->set_search_list_size(4096);
  v1::Policy retopk = TieredPolicy(v1::SELECTOR_RETOPK, k);
  retopk.mutable_retopk()->set_tau(-2.0f);  // every step reuses
  retopk.mutable_retopk()->set_refresh_interval(0);
  retopk.mutable_retopk()->set_recent_window(4096);
  const std::string index_id = CreateAndPrefill(ref, index, 600);
  const std::string retopk_id = CreateAndPrefill(ref, retopk, 600);
  ASSERT_FALSE(index_id.empty());
  ASSERT_FALSE(retopk_id.empty());
  DecodeClient client(stub());
  const std::vector<ReferenceSession::Token> tokens = DriftingQueryTokens(ref, 280, 67);
  for (size_t step = 0; step < tokens.size(); ++step) {
    const std::vector<float> q = ref.Record(0, tokens[step]);
    absl::StatusOr<v1::DecodeResponse> reply =
        StepAll(client, {index_id, retopk_id}, tokens[step], ref, /*compare=*/false);
    ASSERT_TRUE(reply.ok()) << reply.status();
    const std::vector<std::vector<int32_t>> supports =
        TieredExactTopKSupports(ref, q, k, kSinks, kRecent);
    const std::vector<double> want = ref.Attention(0, q, supports);
    const int64_t bulk = ref.tokens(0) - kSinks - kRecent;
    for (int i = 0; i < 2; ++i) {
      const v1::SequenceResult& result = reply->results(i);
      const std::string what = absl::StrCat(i == 0 ? "index" : "retopk", " step ", step);
      for (const v1::HeadDiagnostics& head : result.heads()) {
        ASSERT_EQ(head.support(), kSinks + kRecent + k) << what;
        if (i == 1) {
          ASSERT_EQ(head.path(), v1::PATH_REUSE) << what;
          ASSERT_EQ(head.candidates(), bulk) << what;
        }
      }
      ExpectOutputNear(TensorValues(result.output()), want, g.dtype(), what);
      if (::testing::Test::HasFailure()) return;  // one step's report is enough
    }
  }
}

// A tiered reply says where its compute went: the static tier's own time and the bulk's, each
// within the server's; the graph index links the tokens that joined the bulk after the steps
// (deferred), and the steps, which wait for the previous link, still select from the whole
// bulk: past the link threshold (256 steps) as before it.
TEST_F(TieredPlacementTest, AReplySaysWhereItsTimeWent) {
  const v1::Geometry g = MakeGeometry(1, 8, 2, 64, Dtypes().front());
  ReferenceSession ref(g, 600, 37);
  const int k = 32;
  const std::string id = CreateAndPrefill(ref, TieredPolicy(v1::SELECTOR_INDEX, k), 600);
  const std::string cpu_id = CreateAndPrefill(ref, MakePolicy(v1::SELECTOR_FULL), 600);
  DecodeClient client(stub());
  const std::vector<ReferenceSession::Token> tokens = DriftingQueryTokens(ref, 300, 41);
  for (size_t step = 0; step < tokens.size(); ++step) {
    const std::vector<float> q = ref.Record(0, tokens[step]);
    absl::StatusOr<v1::DecodeResponse> reply =
        StepAll(client, {id}, tokens[step], ref, /*compare=*/step % 50 == 0);
    ASSERT_TRUE(reply.ok()) << reply.status();
    ASSERT_TRUE(reply->has_tier_micros()) << "step " << step;
    const v1::TierMicros& micros = reply->tier_micros();
    EXPECT_GT(micros.static_set(), 0.0) << "step " << step;
    EXPECT_GT(micros.bulk(), 0.0) << "step " << step;
    EXPECT_GE(micros.link_wait(), 0.0);
    EXPECT_EQ(micros.shortlist(), 0.0) << "the graph, no shortlist";
    EXPECT_EQ(micros.shortlists_ready(), 0.0) << "the graph, no shortlist";
    EXPECT_GE(micros.launch(), 0.0);
    EXPECT_LE(micros.launch(), micros.bulk() * (1 + 1e-6) + 1) << "step " << step;
    // The choice of the tier's exact heads comes after the launch, within the bulk; without a
    // shortlist the tier takes none, and waits for nothing.
    EXPECT_GE(micros.decide(), 0.0);
    EXPECT_LE(micros.launch() + micros.decide(), micros.bulk() * (1 + 1e-6) + 1)
        << "step " << step;
    EXPECT_EQ(micros.device_exact(), 0.0);
    EXPECT_EQ(micros.device_exact_wait(), 0.0);
    EXPECT_GE(micros.finish_wait(), 0.0);
    // The step's parts, one after another within the server's time.
    EXPECT_GT(micros.finish(), 0.0) << "step " << step;
    EXPECT_GT(micros.reserve(), 0.0) << "step " << step;
    EXPECT_LE(micros.reserve() + micros.plan() + micros.bulk() + micros.link_wait() +
                  micros.finish(),
              reply->server_micros() * (1 + 1e-6) + 1)
        << "step " << step;
    EXPECT_LE(micros.bulk() + micros.link_wait(), reply->server_micros()) << "step " << step;
    EXPECT_LE(micros.static_set(), reply->server_micros()) << "step " << step;
    double heads_micros = 0;
    for (const v1::HeadDiagnostics& head : reply->results(0).heads()) {
      EXPECT_LE(head.support(), kSinks + kRecent + k);
      if (step % 50 == 0) EXPECT_GT(head.retained_mass(), 0.0f) << "step " << step;
      // Each head's part of the bulk: heads run side by side, so each is within the bulk's
      // time (their sum may exceed it), and so is its interval from the bulk's start (which
      // the wait for the previous link is part of).
      EXPECT_GT(head.bulk_micros(), 0.0f) << "step " << step;
      EXPECT_LE(head.bulk_micros(), micros.bulk() * (1 + 1e-6) + 1) << "step " << step;
      EXPECT_GE(head.bulk_start_micros(), 0.0f) << "step " << step;
      EXPECT_LE(head.bulk_start_micros() + head.bulk_micros(),
                (micros.bulk() + micros.link_wait()) * (1 + 1e-6) + 1)
          << "step " << step;
      heads_micros += head.bulk_micros();
    }
    EXPECT_GT(heads_micros, 0.0);
  }
  // A placement with one tier (and nothing to link) reports none.
  absl::StatusOr<v1::DecodeResponse> reply =
      StepAll(client, {cpu_id}, ref.MakeToken(900), ref, /*compare=*/false);
  ASSERT_TRUE(reply.ok()) << reply.status();
  EXPECT_FALSE(reply->has_tier_micros());
  for (const v1::HeadDiagnostics& head : reply->results(0).heads()) {
    EXPECT_EQ(head.bulk_micros(), 0.0f);
    EXPECT_EQ(head.bulk_start_micros(), 0.0f);
  }
}

// ReTopK's exact path over the bulk: the graph index's search by default, a flat scan of the
// bulk when asked; and a prompt shorter than the static set (an empty bulk at build) works.
TEST_F(TieredPlacementTest, ReTopKExactPathSearchesTheGraphOrScansTheBulkWhenAsked) {
  const v1::Geometry g = MakeGeometry(1, 8, 2, 64, Dtypes().front());
  ReferenceSession ref(g, 3000, 23);
  ReferenceSession short_ref(g, 40, 29);
  v1::Policy graph = TieredPolicy(v1::SELECTOR_RETOPK, 32);
  graph.mutable_retopk()->set_tau(2.0f);  // never reuse: every step takes the exact path
  v1::Policy flat = graph;
  flat.mutable_retopk()->set_exact_flat_scan(true);
  flat.mutable_index()->clear_exact_search();  // the scan, not a search
  const std::string graph_id = CreateAndPrefill(ref, graph, 1000);
  const std::string flat_id = CreateAndPrefill(ref, flat, 1000);
  const std::string short_id = CreateAndPrefill(short_ref, graph, 40);
  DecodeClient client(stub());
  for (int step = 0; step < 60; ++step) {
    const ReferenceSession::Token token = ref.MakeToken(400 + step);
    ref.Record(0, token);
    absl::StatusOr<v1::DecodeResponse> reply =
        StepAll(client, {graph_id, flat_id}, token, ref, /*compare=*/step % 20 == 0);
    ASSERT_TRUE(reply.ok()) << reply.status();
    const int64_t bulk = ref.tokens(0) - kSinks - kRecent;
    for (int h = 0; h < g.q_heads(); ++h) {
      const v1::HeadDiagnostics& searched = reply->results(0).heads(h);
      const v1::HeadDiagnostics& scanned = reply->results(1).heads(h);
      EXPECT_NE(searched.path(), v1::PATH_REUSE);
      EXPECT_LT(searched.candidates(), bulk);
      EXPECT_EQ(scanned.candidates(), bulk);
      EXPECT_EQ(searched.support(), 32 + kSinks + kRecent);
      EXPECT_EQ(scanned.support(), 32 + kSinks + kRecent);
      // The flat scan is the bulk's exact top-K: recall 1 against the shadow up to the static
      // set's share, which it holds too.
      if (step % 20 == 0) EXPECT_GT(scanned.retained_mass(), searched.retained_mass() - 0.05f);
    }
    v1::DecodeRequest short_step;
    short_step.set_layer(0);
    short_step.set_diagnostics(true);
    *short_step.add_steps() = short_ref.Step(short_id, short_ref.MakeToken(800 + step));
    absl::StatusOr<v1::DecodeResponse> short_reply = client.Step(short_step);
    ASSERT_TRUE(short_reply.ok()) << short_reply.status();
  }
  absl::StatusOr<v1::SessionInfo> info = GetSession(stub(), graph_id);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->policy().retopk().exact_flat_scan(), false);
  absl::StatusOr<v1::SessionInfo> flat_info = GetSession(stub(), flat_id);
  ASSERT_TRUE(flat_info.ok()) << flat_info.status();
  EXPECT_EQ(flat_info->policy().retopk().exact_flat_scan(), true);
  EXPECT_EQ(info->policy().index().exact_search(), v1::EXACT_SEARCH_GRAPH);
  EXPECT_EQ(flat_info->policy().index().exact_search(), v1::EXACT_SEARCH_UNSPECIFIED)
      << "the scan searches no index";
  EXPECT_GT(info->selector_bytes(), flat_info->selector_bytes()) << "the graph index";
}

// ReTopK's graph over the bulk learns from prompt queries that see `recent` tokens past their
// own bulk row (query r is token sinks + recent + r's): the newest bulk keys of the prompt are
// linked from the queries of the ring's tokens too. (Its graph once took query r to see bulk rows
// [0, r] only: bulk row B - m was linked from m queries, and a query aimed at one of the last
// rows missed it in a third of the heads, where the `index` selector's graph found it; probe 22.)
TEST_F(TieredPlacementTest, ReTopKsGraphFindsTheNewestKeysOfThePromptsBulk) {
  const v1::Geometry g = MakeGeometry(1, 4, 2, 64, Dtypes().front());  // a GPU tier's head_dim
  constexpr int64_t kPrompt = 400;
  constexpr int64_t kLastBulk = kPrompt - kRecent - 1;
  v1::Policy policy = TieredPolicy(v1::SELECTOR_RETOPK, 8);
  policy.mutable_retopk()->set_tau(2.0f);  // never reuse: the step takes the exact path
  policy.mutable_retopk()->set_refresh_interval(0);
  DecodeClient client(stub());
  int misses = 0;
  int head_steps = 0;
  for (uint64_t seed = 0; seed < 6; ++seed) {
    for (const int64_t target : {kLastBulk, kLastBulk - 1, kLastBulk - 2, kLastBulk - 200}) {
      ReferenceSession ref(g, kPrompt, 7000 + 10 * seed);
      const std::string id = CreateAndPrefill(ref, policy, kPrompt);
      // Each head's query is twice the target's key: a score ~16 against the others' ~N(0, 2).
      ReferenceSession::Token token = ref.MakeToken(9000 + seed);
      const int group = g.q_heads() / g.kv_heads();
      const KvView keys = ref.view(0);
      for (int h = 0; h < g.q_heads(); ++h) {
        const float* key = keys.key(target, h / group);
        for (int i = 0; i < g.head_dim(); ++i) token.q[h * g.head_dim() + i] = 2.0f * key[i];
      }
      ref.Record(0, token);
      absl::StatusOr<v1::DecodeResponse> reply =
          StepAll(client, {id}, token, ref, /*compare=*/true);
      ASSERT_TRUE(reply.ok()) << reply.status();
      for (const v1::HeadDiagnostics& head : reply->results(0).heads()) {
        EXPECT_EQ(head.path(), v1::PATH_FALLBACK);
        ++head_steps;
        if (head.retained_mass() < 0.5f) {
          ++misses;
          ADD_FAILURE() << "seed " << seed << ": bulk token " << target << " missed, retained mass "
                        << head.retained_mass();
        }
      }
      ASSERT_TRUE(testing::CloseSession(stub(), id).ok());
    }
  }
  EXPECT_EQ(misses, 0) << "of " << head_steps << " head-steps";
}

// ReTopK's refresh comes every refresh_interval-th decode step counted from the prompt, as the
// API says, also after a prompt shorter than the static set, whose bulk begins to grow only
// once the ring is full (it was counted by the bulk's growth: probe 22). While the bulk is
// empty the static set is the whole attention and the step says PATH_EXACT.
TEST_F(TieredPlacementTest, ReTopKRefreshesCountDecodeStepsFromTheShortPrompt) {
  const v1::Geometry g = MakeGeometry(1, 4, 2, 64, Dtypes().front());
  constexpr int64_t kPrompt = 10;
  constexpr int kInterval = 7;
  v1::Policy policy = TieredPolicy(v1::SELECTOR_RETOPK, 8);
  policy.mutable_retopk()->set_tau(-1.0f);  // reuse whenever the cache holds a support
  policy.mutable_retopk()->set_refresh_interval(kInterval);
  ReferenceSession ref(g, kPrompt, 31);
  const std::string id = CreateAndPrefill(ref, policy, kPrompt);
  DecodeClient client(stub());
  for (int64_t step = 1; step <= 80; ++step) {
    const ReferenceSession::Token token = ref.MakeToken(500 + step);
    ref.Record(0, token);
    absl::StatusOr<v1::DecodeResponse> reply = StepAll(client, {id}, token, ref, false);
    ASSERT_TRUE(reply.ok()) << reply.status();
    const bool bulk_empty = kPrompt + step <= kSinks + kRecent;
    for (const v1::HeadDiagnostics& head : reply->results(0).heads()) {
      if (bulk_empty) {
        EXPECT_EQ(head.path(), v1::PATH_EXACT) << "step " << step;
      } else if (step % kInterval == 0) {
        EXPECT_EQ(head.path(), v1::PATH_REFRESH) << "step " << step;
      } else {
        EXPECT_NE(head.path(), v1::PATH_REFRESH) << "step " << step;
      }
    }
  }
}

TEST_F(TieredPlacementTest, ABatchEqualsEachSequenceAloneAndGpuBytesStayConstant) {
  const v1::Geometry g = MakeGeometry(1, 8, 2, 64, Dtypes().front());
  ReferenceSession short_ref(g, 300, 41);
  ReferenceSession long_ref(g, 1500, 43);
  const v1::Policy policy = TieredPolicy(v1::SELECTOR_EXACT_TOPK, 24);
  const std::string a = CreateAndPrefill(short_ref, policy, 300);
  const std::string b = CreateAndPrefill(long_ref, policy, 500);
  const std::string a_alone = CreateAndPrefill(short_ref, policy, 300);
  const std::string b_alone = CreateAndPrefill(long_ref, policy, 500);
  absl::StatusOr<v1::SessionInfo> short_info = GetSession(stub(), a);
  absl::StatusOr<v1::SessionInfo> long_info = GetSession(stub(), b);
  ASSERT_TRUE(short_info.ok() && long_info.ok());
  EXPECT_EQ(short_info->gpu_bytes(), long_info->gpu_bytes()) << "the static set does not grow";
  EXPECT_GT(long_info->host_bytes(), short_info->host_bytes());
  if (gpu_tier()) {
    EXPECT_EQ(long_info->gpu_bytes(), 2 * 2 * (kSinks + kRecent) * g.kv_heads() * g.head_dim());
  } else {
    EXPECT_EQ(long_info->gpu_bytes(), 0);
  }
  DecodeClient client(stub());
  for (int step = 0; step < 4; ++step) {
    const ReferenceSession::Token x = short_ref.MakeToken(50 + step);
    const ReferenceSession::Token y = long_ref.MakeToken(70 + step);
    v1::DecodeRequest both;
    both.set_layer(0);
    *both.add_steps() = short_ref.Step(a, x);
    *both.add_steps() = long_ref.Step(b, y);
    absl::StatusOr<v1::DecodeResponse> batched = client.Step(both);
    ASSERT_TRUE(batched.ok()) << batched.status();
    v1::DecodeRequest one;
    one.set_layer(0);
    *one.add_steps() = short_ref.Step(a_alone, x);
    absl::StatusOr<v1::DecodeResponse> alone_a = client.Step(one);
    one.clear_steps();
    *one.add_steps() = long_ref.Step(b_alone, y);
    absl::StatusOr<v1::DecodeResponse> alone_b = client.Step(one);
    ASSERT_TRUE(alone_a.ok() && alone_b.ok());
    EXPECT_EQ(TensorValues(batched->results(0).output()), TensorValues(alone_a->results(0).output()));
    EXPECT_EQ(TensorValues(batched->results(1).output()), TensorValues(alone_b->results(0).output()));
  }
}

// The host keeps the complete KV in the session's dtype: a bf16 / f16 session's host store is
// half the cpu placement's (f32) for the same prompt, an f32 one (host tier) the same, while
// outputs stay those of full attention over the values the client sent.
TEST_F(TieredPlacementTest, TheHostKeepsTheKvInTheSessionsDtype) {
  for (const v1::DType dtype : Dtypes()) {
    const v1::Geometry g = MakeGeometry(1, 8, 2, 64, dtype);
    ReferenceSession ref(g, 700, 51);
    v1::Policy cpu_policy = MakePolicy(v1::SELECTOR_FULL, 0, kSinks, kRecent);
    cpu_policy.set_placement(v1::PLACEMENT_CPU);
    const std::string tiered = CreateAndPrefill(ref, TieredPolicy(v1::SELECTOR_FULL), 700);
    const std::string cpu = CreateAndPrefill(ref, cpu_policy, 700);
    absl::StatusOr<v1::SessionInfo> tiered_info = GetSession(stub(), tiered);
    absl::StatusOr<v1::SessionInfo> cpu_info = GetSession(stub(), cpu);
    ASSERT_TRUE(tiered_info.ok() && cpu_info.ok());
    EXPECT_EQ(tiered_info->selector_bytes(), 0);
    EXPECT_EQ(cpu_info->selector_bytes(), 0);
    if (dtype == v1::DTYPE_F32) {
      EXPECT_EQ(tiered_info->host_bytes(), cpu_info->host_bytes());
    } else {
      // Half, to within the pages each array is charged beside its rows (its last page's
      // rounding and its page table's: HostFootprint), two arrays on each side.
      EXPECT_NEAR(2.0 * tiered_info->host_bytes(), cpu_info->host_bytes(), 4.0 * 2 * 4096)
          << DTypeName(dtype);
    }
    DecodeClient client(stub());
    for (int step = 0; step < 3; ++step) {
      const ReferenceSession::Token token = ref.MakeToken(900 + step);
      const std::vector<float> q = ref.Record(0, token);
      absl::StatusOr<v1::DecodeResponse> reply = StepAll(client, {tiered}, token, ref, false);
      ASSERT_TRUE(reply.ok()) << reply.status();
      const std::vector<std::vector<int32_t>> all(g.q_heads(),
                                                  testing::AllTokens(ref.tokens(0)));
      ExpectOutputNear(TensorValues(reply->results(0).output()), ref.Attention(0, q, all), dtype,
                       absl::StrCat("step ", step));
    }
  }
}

TEST_F(TieredPlacementTest, AGpuStaticTierRefusesWhatItCannotHold) {
  if (!gpu_tier()) GTEST_SKIP() << "the host tier holds every dtype";
  EXPECT_TRUE(HasStatus(CreateSession(stub(), MakeGeometry(1, 8, 2, 64, v1::DTYPE_F32),
                                      TieredPolicy(v1::SELECTOR_FULL))
                            .status(),
                        absl::StatusCode::kInvalidArgument,
                        "geometry.dtype DTYPE_F32 is not served by PLACEMENT_TIERED on a GPU"));
  EXPECT_TRUE(HasStatus(CreateSession(stub(), MakeGeometry(1, 8, 2, 80, v1::DTYPE_BF16),
                                      TieredPolicy(v1::SELECTOR_FULL))
                            .status(),
                        absl::StatusCode::kInvalidArgument,
                        "geometry.head_dim 80 is not served by PLACEMENT_TIERED on a GPU"));
}

// A softmax scale past ln 2 in f16 (1: a model that scales its queries in their projection),
// with queries near f16's bound: the static set's kernels apply such a scale to the f32 scores,
// not to the f16 query operand, which it would carry past 65504 (kernels/cuda/mma.cuh), and
// the host tier computes in f32. The output is full attention's, and finite.
TEST_F(TieredPlacementTest, F16ServesSoftmaxScalesPastLn2) {
  v1::Geometry g = MakeGeometry(1, 8, 2, 64, v1::DTYPE_F16);
  g.set_softmax_scale(1.0f);
  ReferenceSession ref(g, 700, 61);
  const std::string id = CreateAndPrefill(ref, TieredPolicy(v1::SELECTOR_FULL), 700);
  DecodeClient client(stub());
  for (int step = 0; step < 3; ++step) {
    ReferenceSession::Token token = ref.MakeToken(950 + step);
    // One head's query near the bound: 65504 x log2(e) would not be an f16.
    for (int i = 0; i < g.head_dim(); ++i) token.q[i] = i % 2 == 0 ? 60000.0f : -60000.0f;
    const std::vector<float> q = ref.Record(0, token);
    absl::StatusOr<v1::DecodeResponse> reply = StepAll(client, {id}, token, ref, false);
    ASSERT_TRUE(reply.ok()) << reply.status();
    const std::vector<std::vector<int32_t>> all(g.q_heads(), testing::AllTokens(ref.tokens(0)));
    const std::vector<float> got = TensorValues(reply->results(0).output());
    for (float x : got) ASSERT_TRUE(std::isfinite(x)) << "step " << step;
    ExpectOutputNear(got, ref.Attention(0, q, all), v1::DTYPE_F16, absl::StrCat("step ", step));
  }
}

// A step a tier refuses after its request was validated (on a GPU: a workspace past the
// device's budget; here the host tier's test check, PlacementOptions::tiered_host_prepare_check,
// refuses the run it is told to). The device's backends step before the CPU's, so a request
// of a cpu and a tiered session is applied whole or not at all; where one run of steps was
// applied before another failed (two static-set shapes), the error names what was applied.
// Either way a resend of what was not applied gives brute force's outputs.
class TieredStepRefusedTest : public PrefilledSessionTest {
 protected:
  // Refuses the run whose Prepare is the `countdown`-th from now (1: the next), once.
  struct Refusal {
    std::atomic<int> countdown{0};
  };
  ServerOptions Options() const override {
    ServerOptions options;
    options.placements.tiered_host_prepare_check = [refusal = refusal_]() -> absl::Status {
      if (refusal->countdown.load() > 0 && refusal->countdown.fetch_sub(1) == 1) {
        // (As a device's budget refuses one: the limit named, for the refusals' count.)
        return RefusedBy(absl::ResourceExhaustedError("test: the tier refused the run's workspace"),
                         "gpu_memory_budget");
      }
      return absl::OkStatus();
    };
    return options;
  }
  // How often the server refused a request for the GPU's budget.
  double GpuBudgetRefusals() {
    return testing::SeriesValue(server().server().metrics().TextFormat(),
                                "kvrecall_requests_refused_total{limit=\"gpu_memory_budget\"}");
  }
  // The session's layer 0 tokens (GetSession).
  int64_t Tokens(const std::string& id) {
    absl::StatusOr<v1::SessionInfo> info = GetSession(stub(), id);
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? info->tokens() : -1;
  }
  // One request of each (ref, id)'s step of its token, the outputs checked against full
  // attention (every session's policy is full) once the server applied them.
  void StepAndCheck(const std::vector<std::pair<ReferenceSession*, std::string>>& sessions,
                    const std::vector<ReferenceSession::Token>& tokens) {
    v1::DecodeRequest request;
    request.set_layer(0);
    for (size_t i = 0; i < sessions.size(); ++i) {
      *request.add_steps() = sessions[i].first->Step(sessions[i].second, tokens[i]);
    }
    DecodeClient client(stub());
    absl::StatusOr<v1::DecodeResponse> reply = client.Step(request);
    ASSERT_TRUE(reply.ok()) << reply.status();
    for (size_t i = 0; i < sessions.size(); ++i) {
      ReferenceSession& ref = *sessions[i].first;
      const std::vector<float> q = ref.Record(0, tokens[i]);
      const std::vector<std::vector<int32_t>> all(ref.geometry().q_heads(),
                                                  testing::AllTokens(ref.tokens(0)));
      EXPECT_EQ(reply->results(i).position(), ref.tokens(0) - 1);
      ExpectOutputNear(TensorValues(reply->results(i).output()), ref.Attention(0, q, all),
                       ref.geometry().dtype(), absl::StrCat("steps[", i, "]"));
    }
  }
  std::shared_ptr<Refusal> refusal_ = std::make_shared<Refusal>();
};

TEST_F(TieredStepRefusedTest, ARequestOfACpuAndATieredSessionIsAppliedWholeOrNotAtAll) {
  if (TieredOnGpu()) GTEST_SKIP() << "the refusal is the host tier's test check";
  const v1::Geometry g = MakeGeometry(1, 4, 2, 16, v1::DTYPE_F32);
  ReferenceSession cpu_ref(g, 100, 71), tiered_ref(g, 200, 73);
  const std::string cpu = CreateAndPrefill(cpu_ref, MakePolicy(v1::SELECTOR_FULL), 100);
  const std::string tiered = CreateAndPrefill(tiered_ref, TieredPolicy(v1::SELECTOR_FULL), 200);
  const std::vector<ReferenceSession::Token> tokens = {cpu_ref.MakeToken(801),
                                                       tiered_ref.MakeToken(803)};
  v1::DecodeRequest request;  // the cpu session first
  request.set_layer(0);
  *request.add_steps() = cpu_ref.Step(cpu, tokens[0]);
  *request.add_steps() = tiered_ref.Step(tiered, tokens[1]);
  refusal_->countdown = 1;
  const double refusals = GpuBudgetRefusals();
  DecodeClient client(stub());
  EXPECT_TRUE(HasStatus(client.Step(request).status(), absl::StatusCode::kResourceExhausted,
                        "test: the tier refused the run's workspace; no token of this request "
                        "was appended"));
  EXPECT_EQ(GpuBudgetRefusals(), refusals + 1) << "counted by the limit it names";
  EXPECT_EQ(Tokens(cpu), 100) << "the cpu session's step was applied";
  EXPECT_EQ(Tokens(tiered), 200);
  StepAndCheck({{&cpu_ref, cpu}, {&tiered_ref, tiered}}, tokens);
  EXPECT_EQ(Tokens(cpu), 101);
  EXPECT_EQ(Tokens(tiered), 201);
}

TEST_F(TieredStepRefusedTest, ARunRefusedAfterAnotherWasAppliedSaysWhichStepsWere) {
  if (TieredOnGpu()) GTEST_SKIP() << "the refusal is the host tier's test check";
  const v1::Geometry g = MakeGeometry(1, 4, 2, 16, v1::DTYPE_F32);
  ReferenceSession cpu_ref(g, 100, 81), a_ref(g, 200, 83), b_ref(g, 300, 85);
  const std::string cpu = CreateAndPrefill(cpu_ref, MakePolicy(v1::SELECTOR_FULL), 100);
  const std::string a = CreateAndPrefill(a_ref, TieredPolicy(v1::SELECTOR_FULL), 200);
  v1::Policy other_shape = TieredPolicy(v1::SELECTOR_FULL);
  other_shape.set_sinks(kSinks / 2);  // another static set: its own run, after a's
  const std::string b = CreateAndPrefill(b_ref, other_shape, 300);
  const std::vector<ReferenceSession::Token> tokens = {
      cpu_ref.MakeToken(811), a_ref.MakeToken(813), b_ref.MakeToken(815)};
  v1::DecodeRequest request;
  request.set_layer(0);
  *request.add_steps() = cpu_ref.Step(cpu, tokens[0]);
  *request.add_steps() = a_ref.Step(a, tokens[1]);
  *request.add_steps() = b_ref.Step(b, tokens[2]);
  refusal_->countdown = 2;  // b's run
  DecodeClient client(stub());
  EXPECT_TRUE(HasStatus(client.Step(request).status(), absl::StatusCode::kResourceExhausted,
                        absl::StrCat("test: the tier refused the run's workspace; tokens "
                                     "appended before it failed: steps[1] (session '",
                                     a, "' now holds 201); the other steps' tokens were not "
                                     "(resend only those)")));
  EXPECT_EQ(Tokens(cpu), 100);
  EXPECT_EQ(Tokens(a), 201);
  EXPECT_EQ(Tokens(b), 300);
  // The appended step is counted as any other (its heads' paths), the others not.
  for (const auto& [id, steps] : {std::pair{a, 1}, std::pair{b, 0}, std::pair{cpu, 0}}) {
    absl::StatusOr<v1::SessionInfo> info = GetSession(stub(), id);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->decode_steps(), steps) << id;
    EXPECT_EQ(info->paths().exact(), steps * g.q_heads()) << id;
  }
  a_ref.Record(0, tokens[1]);  // as the server applied it
  StepAndCheck({{&cpu_ref, cpu}, {&b_ref, b}}, {tokens[0], tokens[2]});
  StepAndCheck({{&cpu_ref, cpu}, {&a_ref, a}, {&b_ref, b}},
               {cpu_ref.MakeToken(821), a_ref.MakeToken(823), b_ref.MakeToken(825)});
}

}  // namespace
}  // namespace kvrecall
