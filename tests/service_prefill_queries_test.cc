// Prefill chunks may leave the prompt's queries out where the selector never reads them: a full
// session prefilled without any q decodes exactly; a ReTopK session needs the queries of its
// last cache_capacity tokens, and without them the whole Prefill is refused and commits nothing.
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "index/support_selector.h"
#include "server/policy.h"
#include "server/session.h"
#include "tests/server_fixture.h"

namespace kvrecall {
namespace {

using ::kvrecall::testing::CreateSession;
using ::kvrecall::testing::DecodeClient;
using ::kvrecall::testing::ExpectOutputNear;
using ::kvrecall::testing::GetSession;
using ::kvrecall::testing::HasStatus;
using ::kvrecall::testing::MakeGeometry;
using ::kvrecall::testing::MakePolicy;
using ::kvrecall::testing::Prefill;
using ::kvrecall::testing::ReferenceSession;
using ::kvrecall::testing::ServerTest;
using ::kvrecall::testing::TensorValues;

class PrefillQueriesTest : public ServerTest {
 protected:
  // The prompt of `ref` in chunks of `chunk` tokens; chunks that start before `q_from` carry no q.
  static std::vector<v1::PrefillChunk> Chunks(const ReferenceSession& ref, const std::string& id,
                                              int64_t chunk, int64_t q_from) {
    std::vector<v1::PrefillChunk> chunks = ref.InterleavedPrompt(id, chunk);
    for (v1::PrefillChunk& c : chunks) {
      if (c.offset() < q_from) c.clear_q();
    }
    return chunks;
  }
};

TEST_F(PrefillQueriesTest, AFullSessionNeedsNoQueries) {
  const v1::Geometry g = MakeGeometry(2, 4, 2, 16, v1::DTYPE_BF16);
  ReferenceSession ref(g, 200, 1);
  absl::StatusOr<std::string> id = CreateSession(stub(), g, MakePolicy(v1::SELECTOR_FULL));
  ASSERT_TRUE(id.ok());
  ASSERT_TRUE(Prefill(stub(), Chunks(ref, *id, 64, /*q_from=*/200)).ok());
  DecodeClient client(stub());
  std::vector<float> q;
  v1::DecodeRequest request;
  *request.add_steps() = ref.NextStep(*id, 0, 7, &q);
  absl::StatusOr<v1::DecodeResponse> reply = client.Step(request);
  ASSERT_TRUE(reply.ok()) << reply.status();
  ExpectOutputNear(TensorValues(reply->results(0).output()), ref.FullAttention(0, q), g.dtype(),
                   "full attention after a prompt without queries");
}

TEST_F(PrefillQueriesTest, ReTopKNeedsTheQueriesOfItsSeeds) {
  const v1::Geometry g = MakeGeometry(1, 4, 2, 16, v1::DTYPE_F32);
  ReferenceSession ref(g, 200, 2);
  v1::Policy policy = MakePolicy(v1::SELECTOR_RETOPK, 16);
  policy.mutable_retopk()->set_cache_capacity(32);
  absl::StatusOr<std::string> id = CreateSession(stub(), g, policy);
  ASSERT_TRUE(id.ok());
  // q only from token 192 on: the last 8 tokens, fewer than C = 32.
  EXPECT_TRUE(HasStatus(Prefill(stub(), Chunks(ref, *id, 64, 192)).status(),
                        absl::StatusCode::kInvalidArgument,
                        "layer 0: the retopk selector needs the queries (q) of the prompt's last "
                        "32 tokens, but the chunks give them only from token 192 on, of 200"));
  absl::StatusOr<v1::SessionInfo> info = GetSession(stub(), *id);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->layers_prefilled(), 0) << "the refused Prefill committed nothing";
  // q from token 128 on covers the seeds.
  absl::StatusOr<v1::PrefillResponse> ok = Prefill(stub(), Chunks(ref, *id, 64, 128));
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->tokens(), 200);
}

// The server keeps only the prompt's last queries a ReTopK layer reads (its seeds and, with
// auto_tau, the calibration window: 32 + 256 of 600 here, across chunks of 50), and builds the
// same layer as a ReTopK selector built from every query: each step's paths and outputs match
// that reference's, step after step.
TEST_F(PrefillQueriesTest, AReTopKLayerBuiltFromItsLastQueriesIsBuiltAsFromAll) {
  const v1::Geometry g = MakeGeometry(1, 4, 2, 16, v1::DTYPE_F32);
  ReferenceSession ref(g, 600, 3);
  v1::Policy policy = MakePolicy(v1::SELECTOR_RETOPK, 16);
  policy.mutable_retopk()->set_cache_capacity(32);
  policy.mutable_retopk()->set_auto_tau(true);
  absl::StatusOr<std::string> id = CreateSession(stub(), g, policy);
  ASSERT_TRUE(id.ok()) << id.status();
  ASSERT_TRUE(Prefill(stub(), Chunks(ref, *id, 50, 0)).ok());

  absl::StatusOr<EffectivePolicy> effective = ResolvePolicy(policy);
  ASSERT_TRUE(effective.ok()) << effective.status();
  const LayerShape shape{g.q_heads(), g.kv_heads(), g.head_dim(),
                         static_cast<float>(ref.scale())};
  absl::StatusOr<std::unique_ptr<SupportSelector>> local =
      MakeSelector(effective->selector, shape);
  ASSERT_TRUE(local.ok()) << local.status();
  ASSERT_TRUE((*local)->Build(ref.view(0), ref.prompt(0).q.data()).ok());

  DecodeClient decode(stub());
  int reused = 0;
  for (int step = 0; step < 24; ++step) {
    const ReferenceSession::Token token = ref.MakeToken(7000 + 10 * step);
    const std::vector<float> q = ref.Record(0, token);
    v1::DecodeRequest request;
    request.set_diagnostics(true);
    *request.add_steps() = ref.Step(*id, token);
    absl::StatusOr<v1::DecodeResponse> reply = decode.Step(request);
    ASSERT_TRUE(reply.ok()) << reply.status();
    std::vector<std::vector<int32_t>> supports(g.q_heads());
    for (int h = 0; h < g.q_heads(); ++h) {
      HeadSelection selection;
      (*local)->Select(h, q.data() + h * g.head_dim(), ref.view(0), &selection);
      supports[h] = selection.support;
      EXPECT_EQ(reply->results(0).heads(h).path(), PathToProto(selection.path))
          << "step " << step << " head " << h;
      reused += selection.path == SelectionPath::kReuse;
    }
    (*local)->OnAppend(ref.view(0));
    ExpectOutputNear(TensorValues(reply->results(0).output()), ref.Attention(0, q, supports),
                     v1::DTYPE_F32, absl::StrCat("step ", step));
  }
  EXPECT_GT(reused, 0) << "the steps exercise the caches the prompt's queries seeded";
}

// The tiered placement shifts the window onto its bulk (bulk row r is the prompt's token
// sinks + recent + r): its ReTopK caches are seeded from the prompt's last queries whether the
// staging kept every query (the graph, which is built from all) or the window alone (the flat
// scan). A fresh session asked the prompt's own last and C-th last queries finds them in its
// caches (best cosine 1), and both sessions decide alike, head by head.
TEST_F(PrefillQueriesTest, ATieredReTopKSeedsItsCachesFromThePromptsLastQueries) {
  const v1::Geometry g = MakeGeometry(1, 4, 2, 64, v1::DTYPE_BF16);
  constexpr int kTokens = 700, kCapacity = 32;
  ReferenceSession ref(g, kTokens, 5);
  auto policy = [](bool graph) {
    v1::Policy p = MakePolicy(v1::SELECTOR_RETOPK, 16, 16, 32);
    p.set_placement(v1::PLACEMENT_TIERED);
    p.mutable_retopk()->set_cache_capacity(kCapacity);
    p.mutable_retopk()->set_auto_tau(true);
    if (graph) {
      p.mutable_index()->set_exact_search(v1::EXACT_SEARCH_GRAPH);
    } else {
      p.mutable_retopk()->set_exact_flat_scan(true);
    }
    return p;
  };
  const int q_row = g.q_heads() * g.head_dim();
  for (const int64_t probe : {int64_t{kTokens - 1}, int64_t{kTokens - kCapacity}}) {
    std::vector<v1::DecodeResponse> replies;
    for (const bool graph : {true, false}) {
      absl::StatusOr<std::string> id = CreateSession(stub(), g, policy(graph));
      ASSERT_TRUE(id.ok()) << id.status();
      ASSERT_TRUE(Prefill(stub(), Chunks(ref, *id, 100, 0)).ok());
      ReferenceSession::Token token = ref.MakeToken(9000 + probe);
      token.q.assign(ref.prompt(0).q.begin() + probe * q_row,
                     ref.prompt(0).q.begin() + (probe + 1) * q_row);
      v1::DecodeRequest request;
      request.set_diagnostics(true);
      *request.add_steps() = ref.Step(*id, token);
      DecodeClient decode(stub());
      absl::StatusOr<v1::DecodeResponse> reply = decode.Step(request);
      ASSERT_TRUE(reply.ok()) << reply.status();
      replies.push_back(*std::move(reply));
      ASSERT_TRUE(testing::CloseSession(stub(), *id).ok());
    }
    for (int h = 0; h < g.q_heads(); ++h) {
      const v1::HeadDiagnostics& all = replies[0].results(0).heads(h);
      const v1::HeadDiagnostics& window = replies[1].results(0).heads(h);
      EXPECT_GT(window.best_cosine(), 0.999f) << "probe " << probe << " head " << h;
      EXPECT_EQ(window.best_cosine(), all.best_cosine()) << "probe " << probe << " head " << h;
      EXPECT_EQ(window.path(), all.path()) << "probe " << probe << " head " << h;
    }
  }
}

}  // namespace
}  // namespace kvrecall
