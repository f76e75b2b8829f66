// The C++ client library and trace replay against a real in-process kvrecall server.
#include <unistd.h>

#include <cmath>
#include <string>
#include <vector>

#include "client/kvrecall_client.h"
#include "client/replay.h"
#include "client/trace/synthetic.h"
#include "client/trace/trace.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server_fixture.h"
#include "tests/test_util.h"

namespace kvrecall::client {
namespace {

using ::testing::HasSubstr;

// A prompt of `tokens` random tokens for every layer of `g`, plus the decode inputs.
struct RandomPrompt {
  RandomPrompt(const v1::Geometry& g, int64_t tokens, uint64_t seed) {
    for (int l = 0; l < g.layers(); ++l) {
      const uint64_t s = seed + 10 * l;
      // Values as the server stores them: rounded through the session's dtype.
      q.push_back(testing::RoundTrip(testing::RandomNormal(tokens * g.q_heads() * g.head_dim(), s),
                                     g.dtype()));
      k.push_back(testing::RoundTrip(
          testing::RandomNormal(tokens * g.kv_heads() * g.head_dim(), s + 1), g.dtype()));
      v.push_back(testing::RoundTrip(
          testing::RandomNormal(tokens * g.kv_heads() * g.head_dim(), s + 2), g.dtype()));
    }
  }
  std::vector<std::vector<float>> q, k, v;  // per layer
};

class ClientTest : public testing::ServerTest {
 protected:
  void SetUp() override {
    ServerTest::SetUp();
    client_ = std::make_unique<Client>(server().channel());
  }

  // Creates a session and prefills every layer of `prompt` in one stream.
  SessionHandle Prefilled(const v1::Geometry& g, const RandomPrompt& prompt,
                          v1::Selector selector = v1::SELECTOR_FULL) {
    absl::StatusOr<SessionHandle> session =
        client_->CreateSession(g, testing::MakePolicy(selector), "client test");
    EXPECT_TRUE(session.ok()) << session.status();
    absl::StatusOr<std::unique_ptr<PrefillStream>> stream = client_->StartPrefill(*session);
    EXPECT_TRUE(stream.ok());
    for (int l = 0; l < g.layers(); ++l) {
      EXPECT_TRUE((*stream)->SendLayer(l, prompt.q[l], prompt.k[l], prompt.v[l]).ok());
    }
    EXPECT_TRUE((*stream)->Finish().ok());
    return *session;
  }

  std::unique_ptr<Client> client_;
};

// Attention of q [q_heads, d] over the first `tokens` tokens of (keys, values), per head in
// double precision.
std::vector<double> Reference(const v1::Geometry& g, const float* q, const std::vector<float>& keys,
                              const std::vector<float>& values, int64_t tokens,
                              std::vector<double>* lse) {
  const KvView kv{keys.data(), values.data(), tokens, g.kv_heads(), g.head_dim()};
  const double scale = 1.0 / std::sqrt(static_cast<double>(g.head_dim()));
  std::vector<double> out;
  lse->clear();
  for (int h = 0; h < g.q_heads(); ++h) {
    std::vector<double> o;
    lse->push_back(testing::ReferenceAttention(q + h * g.head_dim(), kv,
                                               KvHeadOf(h, g.q_heads(), g.kv_heads()),
                                               testing::AllTokens(tokens), scale, &o));
    out.insert(out.end(), o.begin(), o.end());
  }
  return out;
}

TEST_F(ClientTest, PrefillsInChunksThenDecodesFullAttentionExactly) {
  for (v1::DType dtype : {v1::DTYPE_F32, v1::DTYPE_BF16}) {
    SCOPED_TRACE(DTypeLowerName(dtype));
    const v1::Geometry g = testing::MakeGeometry(2, 4, 2, 16, dtype);
    const int64_t tokens = 300;
    RandomPrompt prompt(g, tokens, 7);
    absl::StatusOr<SessionHandle> session =
        client_->CreateSession(g, testing::MakePolicy(v1::SELECTOR_FULL));
    ASSERT_TRUE(session.ok()) << session.status();

    // Full attention needs no prompt queries: chunks of k and v alone, 20 tokens of them in
    // the bytes of 10 tokens' q, k and v: 15 per layer, each reported.
    const int64_t token_bytes = (4 + 2 * 2) * 16 * (dtype == v1::DTYPE_F32 ? 4 : 2);
    const int64_t kv_token_bytes = 2 * 2 * 16 * (dtype == v1::DTYPE_F32 ? 4 : 2);
    PrefillOptions options;
    options.max_chunk_bytes = 10 * token_bytes + 3;
    std::vector<PrefillProgress> progress;
    options.progress = [&](const PrefillProgress& p) { progress.push_back(p); };
    absl::StatusOr<std::unique_ptr<PrefillStream>> stream =
        client_->StartPrefill(*session, options);
    ASSERT_TRUE(stream.ok());
    for (int l = 0; l < 2; ++l) {
      ASSERT_TRUE((*stream)->SendLayer(l, prompt.q[l], prompt.k[l], prompt.v[l]).ok());
    }
    absl::StatusOr<v1::PrefillResponse> prefilled = (*stream)->Finish();
    ASSERT_TRUE(prefilled.ok()) << prefilled.status();
    EXPECT_EQ(prefilled->layers_committed(), 2);
    EXPECT_EQ(prefilled->tokens(), tokens);
    EXPECT_EQ(session->prompt_queries, 0);
    ASSERT_EQ(progress.size(), 30u);
    EXPECT_EQ(progress[14].layer, 0);
    EXPECT_EQ(progress[14].layer_tokens_sent, 300);
    EXPECT_EQ(progress[15].layer_tokens_sent, 20);
    EXPECT_EQ(progress.back().bytes_sent, 2 * tokens * kv_token_bytes);

    absl::StatusOr<v1::SessionInfo> info = client_->GetSession(session->id);
    ASSERT_TRUE(info.ok());
    EXPECT_EQ(info->prompt_tokens(), tokens);
    EXPECT_EQ(info->layers_prefilled(), 2);

    absl::StatusOr<std::unique_ptr<DecodeStream>> decode = client_->OpenDecodeStream(g);
    ASSERT_TRUE(decode.ok());
    StepOptions step_options;
    step_options.return_lse = true;
    StepResult result;
    const double tolerance = dtype == v1::DTYPE_F32 ? 2e-5 : 1e-2;
    for (int step = 0; step < 3; ++step) {
      for (int l = 0; l < 2; ++l) {
        const std::vector<float> q =
            testing::RoundTrip(testing::RandomNormal(4 * 16, 100 + step * 2 + l), dtype);
        const std::vector<float> k_new =
            testing::RoundTrip(testing::RandomNormal(2 * 16, 200 + step * 2 + l), dtype);
        const std::vector<float> v_new =
            testing::RoundTrip(testing::RandomNormal(2 * 16, 300 + step * 2 + l), dtype);
        prompt.k[l].insert(prompt.k[l].end(), k_new.begin(), k_new.end());
        prompt.v[l].insert(prompt.v[l].end(), v_new.begin(), v_new.end());
        const SequenceInput input{session->id, q, k_new, v_new};
        ASSERT_TRUE((*decode)->Step(l, {&input, 1}, step_options, &result).ok());
        std::vector<double> lse;
        const std::vector<double> want =
            Reference(g, q.data(), prompt.k[l], prompt.v[l], tokens + step + 1, &lse);
        ASSERT_EQ(result.output.size(), want.size());
        for (size_t i = 0; i < want.size(); ++i) {
          EXPECT_NEAR(result.output[i], want[i], tolerance * (1 + std::abs(want[i])));
        }
        ASSERT_EQ(result.lse.size(), 4u);
        for (int h = 0; h < 4; ++h) EXPECT_NEAR(result.lse[h], lse[h], 1e-4 * (1 + lse[h]));
        EXPECT_EQ(result.response->results(0).position(), tokens + step);
      }
    }
    EXPECT_TRUE((*decode)->Close().ok());
  }
}

// CreateSession says which prompt queries a session needs (CreateSessionResponse's
// prompt_queries), and the prefill sends q in the chunks that hold them alone: none for
// exact_topk, ReTopK's last C (+256 with auto_tau), every one for the graph index; the server
// commits each (it refuses a prefill that lacks needed queries).
TEST_F(ClientTest, PrefillSendsTheQueriesTheSessionNeedsAlone) {
  // f32 for the cpu placement; bf16 at d = 64 for the tiered one, which a GPU's tier serves too.
  const v1::Geometry f32 = testing::MakeGeometry(1, 4, 2, 16, v1::DTYPE_F32);
  const v1::Geometry bf16 = testing::MakeGeometry(1, 4, 2, 64, v1::DTYPE_BF16);
  const int64_t tokens = 700;
  v1::Policy auto_tau = testing::MakePolicy(v1::SELECTOR_RETOPK);
  auto_tau.mutable_retopk()->set_auto_tau(true);
  // Tiered: ReTopK's exact path is by default the graph without a GPU, which needs every query,
  // and the shortlist on one, which needs ReTopK's last C alone.
  v1::Policy tiered_retopk = testing::MakePolicy(v1::SELECTOR_RETOPK);
  tiered_retopk.set_placement(v1::PLACEMENT_TIERED);
  const struct {
    v1::Policy policy;
    const v1::Geometry& g;
    int64_t prompt_queries;
  } cases[] = {
      {testing::MakePolicy(v1::SELECTOR_EXACT_TOPK), f32, 0},
      {testing::MakePolicy(v1::SELECTOR_RETOPK), f32, 32},
      {auto_tau, f32, 32 + 256},
      {testing::MakePolicy(v1::SELECTOR_INDEX), f32, -1},
      {tiered_retopk, bf16, TieredOnGpu() ? 32 : -1},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.policy.DebugString());
    const v1::Geometry& g = c.g;
    const RandomPrompt prompt(g, tokens, 11);
    const int64_t element = g.dtype() == v1::DTYPE_F32 ? 4 : 2;
    const int64_t q_bytes = g.q_heads() * g.head_dim() * element;
    const int64_t kv_bytes = 2 * g.kv_heads() * g.head_dim() * element;
    absl::StatusOr<SessionHandle> session = client_->CreateSession(g, c.policy);
    ASSERT_TRUE(session.ok()) << session.status();
    EXPECT_EQ(session->prompt_queries, c.prompt_queries);
    if (c.policy.placement() == v1::PLACEMENT_TIERED) {
      EXPECT_EQ(session->policy.index().exact_search(),
                TieredOnGpu() ? v1::EXACT_SEARCH_SHORTLIST : v1::EXACT_SEARCH_GRAPH);
    }
    // q goes with the needed queries' tokens alone.
    PrefillOptions options;
    options.max_chunk_bytes = 50 * (q_bytes + kv_bytes);
    int64_t bytes_sent = 0;
    options.progress = [&](const PrefillProgress& p) { bytes_sent = p.bytes_sent; };
    absl::StatusOr<std::unique_ptr<PrefillStream>> stream =
        client_->StartPrefill(*session, options);
    ASSERT_TRUE(stream.ok());
    const std::vector<float> no_q;
    ASSERT_TRUE((*stream)
                    ->SendLayer(0, c.prompt_queries == 0 ? no_q : prompt.q[0], prompt.k[0],
                                prompt.v[0])
                    .ok());
    absl::StatusOr<v1::PrefillResponse> prefilled = (*stream)->Finish();
    ASSERT_TRUE(prefilled.ok()) << prefilled.status();
    const int64_t with_q = c.prompt_queries < 0 ? tokens : c.prompt_queries;
    EXPECT_EQ(bytes_sent, tokens * kv_bytes + with_q * q_bytes);
    EXPECT_EQ(prefilled->tokens(), tokens);
  }
}

TEST_F(ClientTest, BatchesSequencesOfSeveralSessionsInOneStep) {
  const v1::Geometry g = testing::MakeGeometry(1, 4, 2, 8);
  RandomPrompt a_prompt(g, 50, 1), b_prompt(g, 70, 2);
  const SessionHandle a = Prefilled(g, a_prompt);
  const SessionHandle b = Prefilled(g, b_prompt);
  absl::StatusOr<std::unique_ptr<DecodeStream>> decode = client_->OpenDecodeStream(g);
  ASSERT_TRUE(decode.ok());
  const std::vector<float> q = testing::RandomNormal(32, 5), kv = testing::RandomNormal(16, 6);
  const SequenceInput batch[] = {{a.id, q, kv, kv}, {b.id, q, kv, kv}};
  StepOptions options;
  options.diagnostics = true;
  StepResult result;
  ASSERT_TRUE((*decode)->Step(0, batch, options, &result).ok());
  ASSERT_EQ(result.output.size(), 2u * 32);
  for (auto [i, prompt, tokens] : {std::tuple{0, &a_prompt, 50}, std::tuple{1, &b_prompt, 70}}) {
    prompt->k[0].insert(prompt->k[0].end(), kv.begin(), kv.end());
    prompt->v[0].insert(prompt->v[0].end(), kv.begin(), kv.end());
    std::vector<double> lse;
    const std::vector<double> want =
        Reference(g, q.data(), prompt->k[0], prompt->v[0], tokens + 1, &lse);
    for (size_t j = 0; j < want.size(); ++j) {
      EXPECT_NEAR(result.output[i * 32 + j], want[j], 2e-5 * (1 + std::abs(want[j])));
    }
    const v1::SequenceResult& r = result.response->results(i);
    ASSERT_EQ(r.heads_size(), 4);
    EXPECT_EQ(r.heads(0).path(), v1::PATH_EXACT);
    EXPECT_EQ(r.heads(0).support(), tokens + 1);
  }
}

TEST_F(ClientTest, AnEmptyStepIsARoundTripThatChangesNothing) {
  const v1::Geometry g = testing::MakeGeometry(1, 4, 2, 8);
  const SessionHandle s = Prefilled(g, RandomPrompt(g, 20, 3));
  absl::StatusOr<std::unique_ptr<DecodeStream>> decode = client_->OpenDecodeStream(g);
  StepResult result;
  ASSERT_TRUE((*decode)->Step(0, {}, {}, &result).ok());
  EXPECT_TRUE(result.output.empty());
  EXPECT_EQ(result.response->results_size(), 0);
  EXPECT_EQ(client_->GetSession(s.id)->tokens(), 20);
  EXPECT_EQ(client_->GetSession(s.id)->decode_steps(), 0);
}

TEST_F(ClientTest, ErrorsCarryTheServersCodeAndMessage) {
  absl::Status s = client_->GetSession("nope").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr("no session 'nope'"));

  s = client_
          ->CreateSession(testing::MakeGeometry(1, 4, 3, 8), testing::MakePolicy(v1::SELECTOR_FULL))
          .status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("kv_heads"));

  const v1::Geometry g = testing::MakeGeometry(1, 4, 2, 8);
  const RandomPrompt prompt(g, 10, 4);
  const SessionHandle session = Prefilled(g, prompt);
  // A second prefill of layer 0 is refused when the stream closes.
  absl::StatusOr<std::unique_ptr<PrefillStream>> again = client_->StartPrefill(session);
  ASSERT_TRUE(again.ok());
  ASSERT_TRUE((*again)->SendLayer(0, prompt.q[0], prompt.k[0], prompt.v[0]).ok());
  s = (*again)->Finish().status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("already prefilled"));

  // Client-side shape checks name the argument and send nothing.
  const std::vector<float> q(32), kv(16), short_kv(15);
  absl::StatusOr<std::unique_ptr<PrefillStream>> bad = client_->StartPrefill(session);
  s = (*bad)->SendLayer(0, q, short_kv, short_kv);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("prefill layer 0: q, k, v hold 32, 15, 15 floats"));
  absl::StatusOr<std::unique_ptr<DecodeStream>> decode = client_->OpenDecodeStream(g);
  StepResult result;
  const SequenceInput wrong{session.id, q, short_kv, kv};
  s = (*decode)->Step(0, {&wrong, 1}, {}, &result);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("decode batch[0]: q, k_new, v_new hold 32, 15, 16"));

  // A step the server rejects ends the gRPC stream and appends nothing; the next step goes on
  // on a new stream (DecodeStreamRecoversAfterAFailedStep).
  const SequenceInput out_of_range{session.id, q, kv, kv};
  s = (*decode)->Step(5, {&out_of_range, 1}, {}, &result);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("layer 5 is out of range [0, 1)"));
  EXPECT_EQ(client_->GetSession(session.id)->tokens(), 10);  // nothing was appended
}

TEST_F(ClientTest, DecodeStreamRecoversAfterAFailedStep) {
  // Before: a failed step left the DecodeStream failed for good (every later Step returned the
  // same status), although the proto says the client libraries continue on a new stream.
  const v1::Geometry g = testing::MakeGeometry(2, 4, 2, 8);
  RandomPrompt prompt(g, 12, 7);
  const SessionHandle session = Prefilled(g, prompt);
  absl::StatusOr<std::unique_ptr<DecodeStream>> decode = client_->OpenDecodeStream(g);
  ASSERT_TRUE(decode.ok());
  const std::vector<float> q = testing::RandomNormal(32, 8), kv = testing::RandomNormal(16, 9);
  std::vector<float> nan_q = q;
  nan_q[3] = std::nanf("");
  const SequenceInput good{session.id, q, kv, kv};
  const SequenceInput bad{session.id, nan_q, kv, kv};
  StepResult result;
  // Token 12 reaches layer 0; its layer-1 step is rejected (NaN), appending nothing.
  ASSERT_TRUE((*decode)->Step(0, {&good, 1}, {}, &result).ok());
  absl::Status failed = (*decode)->Step(1, {&bad, 1}, {}, &result);
  EXPECT_EQ(failed.code(), absl::StatusCode::kInvalidArgument) << failed;
  EXPECT_THAT(failed.message(), HasSubstr("steps[0].q"));
  absl::StatusOr<v1::SessionInfo> info = client_->GetSession(session.id);
  ASSERT_TRUE(info.ok());
  EXPECT_THAT(info->layer_tokens(), ::testing::ElementsAre(13, 12));
  EXPECT_EQ((*decode)->streams_opened(), 1);

  // The runner resends the layer-1 step: the same DecodeStream continues on a new gRPC stream.
  ASSERT_TRUE((*decode)->Step(1, {&good, 1}, {}, &result).ok());
  EXPECT_EQ((*decode)->streams_opened(), 2);
  EXPECT_EQ(result.response->results(0).position(), 12);
  prompt.k[1].insert(prompt.k[1].end(), kv.begin(), kv.end());
  prompt.v[1].insert(prompt.v[1].end(), kv.begin(), kv.end());
  std::vector<double> lse;
  const std::vector<double> want = Reference(g, q.data(), prompt.k[1], prompt.v[1], 13, &lse);
  for (size_t j = 0; j < want.size(); ++j) {
    EXPECT_NEAR(result.output[j], want[j], 2e-5 * (1 + std::abs(want[j])));
  }
  ASSERT_TRUE((*decode)->Step(0, {&good, 1}, {}, &result).ok());  // and on, with the next token
  EXPECT_EQ(result.response->results(0).position(), 13);
  info = client_->GetSession(session.id);
  ASSERT_TRUE(info.ok());
  EXPECT_THAT(info->layer_tokens(), ::testing::ElementsAre(14, 13));

  // Once closed, a DecodeStream opens no new stream.
  EXPECT_TRUE((*decode)->Close().ok());
  EXPECT_EQ((*decode)->Step(0, {&good, 1}, {}, &result).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*decode)->streams_opened(), 2);
}

// A DecodeStream kept after its Client is gone goes on, across a failed step too: it reopened
// itself through the Client's stub, freed with it (a crash: probe 28, 1).
TEST_F(ClientTest, ADecodeStreamOutlivesItsClient) {
  const v1::Geometry g = testing::MakeGeometry(1, 4, 2, 8);
  RandomPrompt prompt(g, 12, 21);
  const SessionHandle session = Prefilled(g, prompt);
  absl::StatusOr<std::unique_ptr<DecodeStream>> decode;
  {
    Client own(server().channel());
    decode = own.OpenDecodeStream(g);
    ASSERT_TRUE(decode.ok());
  }
  const std::vector<float> q = testing::RandomNormal(32, 22), kv = testing::RandomNormal(16, 23);
  SequenceInput step{session.id, q, kv, kv};
  StepResult result;
  ASSERT_TRUE((*decode)->Step(0, {&step, 1}, {}, &result).ok());
  step.position = 99;  // refused: nothing appended, the stream ends
  EXPECT_EQ((*decode)->Step(0, {&step, 1}, {}, &result).code(), absl::StatusCode::kAborted);
  step.position.reset();
  ASSERT_TRUE((*decode)->Step(0, {&step, 1}, {}, &result).ok());  // on a stream of its own stub
  EXPECT_EQ((*decode)->streams_opened(), 2);
  EXPECT_EQ(result.response->results(0).position(), 13);
  EXPECT_TRUE((*decode)->Close().ok());
}

// A client's own receive limit (Connect's max_message_bytes) travels with its requests: a step
// whose reply could exceed it is refused before it applies. (gRPC refused such a reply on the
// client after the server had applied the step: probe 28, 3.)
TEST_F(ClientTest, AReplyPastTheClientsLimitIsRefusedBeforeTheStepApplies) {
  const v1::Geometry g = testing::MakeGeometry(1, 32, 1, 16);
  RandomPrompt prompt(g, 6, 31);
  const SessionHandle session = Prefilled(g, prompt);
  std::unique_ptr<Client> small = Client::Connect(server().address(), {.max_message_bytes = 3072});
  absl::StatusOr<std::unique_ptr<DecodeStream>> decode = small->OpenDecodeStream(g);
  ASSERT_TRUE(decode.ok());
  const std::vector<float> q = testing::RandomNormal(32 * 16, 32);
  const std::vector<float> kv = testing::RandomNormal(16, 33);
  const SequenceInput step{session.id, q, kv, kv};
  StepResult result;
  const StepOptions everything{.return_lse = true, .diagnostics = true, .compare_exact = true};
  EXPECT_TRUE(testing::HasStatus((*decode)->Step(0, {&step, 1}, everything, &result),
                                 absl::StatusCode::kResourceExhausted,
                                 "over the client's max_reply_bytes of 3072 bytes; nothing of it "
                                 "was applied"));
  EXPECT_EQ(client_->GetSession(session.id)->tokens(), 6);
  ASSERT_TRUE((*decode)->Step(0, {&step, 1}, {}, &result).ok());  // a smaller reply fits
  EXPECT_EQ(result.response->results(0).position(), 6);
}

TEST_F(ClientTest, ConnectTakesTheCallersChannelArguments) {
  // One whose effect shows: the replies' headers past a 1-byte metadata limit.
  ClientOptions options;
  options.channel_arguments.SetInt(GRPC_ARG_MAX_METADATA_SIZE, 1);
  std::unique_ptr<Client> limited = Client::Connect(server().address(), options);
  const v1::Geometry g = testing::MakeGeometry(1, 4, 2, 16);
  EXPECT_TRUE(testing::HasStatus(
      limited->CreateSession(g, testing::MakePolicy(v1::SELECTOR_FULL)).status(),
      absl::StatusCode::kResourceExhausted, "received initial metadata size exceeds limit"));
  EXPECT_TRUE(
      Client::Connect(server().address())->CreateSession(g, testing::MakePolicy(v1::SELECTOR_FULL))
          .ok());
  // What Connect sets itself is not to be set there.
  ClientOptions receive_limit;
  receive_limit.channel_arguments.SetMaxReceiveMessageSize(1 << 20);
  EXPECT_TRUE(testing::HasStatus(
      Client::Connect(server().address(), ChannelSecurity(), receive_limit).status(),
      absl::StatusCode::kInvalidArgument,
      "grpc.max_receive_message_length is Connect's to set (ClientOptions.max_message_bytes"));
}

TEST_F(ClientTest, AStepThatSaysItsPositionIsNotAppendedTwice) {
  const v1::Geometry g = testing::MakeGeometry(1, 4, 2, 8);
  const RandomPrompt prompt(g, 12, 11);
  const SessionHandle session = Prefilled(g, prompt);
  absl::StatusOr<std::unique_ptr<DecodeStream>> decode = client_->OpenDecodeStream(g);
  ASSERT_TRUE(decode.ok());
  const std::vector<float> q = testing::RandomNormal(32, 12), kv = testing::RandomNormal(16, 13);
  const SequenceInput at_12{session.id, q, kv, kv, 12};
  StepResult result;
  ASSERT_TRUE((*decode)->Step(0, {&at_12, 1}, {}, &result).ok());
  EXPECT_EQ(result.response->results(0).position(), 12);
  // Resent (its reply lost, say): refused, nothing appended; the stream goes on afterwards.
  absl::Status resent = (*decode)->Step(0, {&at_12, 1}, {}, &result);
  EXPECT_EQ(resent.code(), absl::StatusCode::kAborted) << resent;
  EXPECT_THAT(resent.message(), HasSubstr("holds 13 tokens, so its next token takes position 13"));
  EXPECT_EQ(client_->GetSession(session.id)->tokens(), 13);
  const SequenceInput at_13{session.id, q, kv, kv, 13};
  ASSERT_TRUE((*decode)->Step(0, {&at_13, 1}, {}, &result).ok());
  EXPECT_EQ(result.response->results(0).position(), 13);
  // A step that says none goes at the end: the reused request carries no earlier position.
  const SequenceInput anywhere{session.id, q, kv, kv};
  ASSERT_TRUE((*decode)->Step(0, {&anywhere, 1}, {}, &result).ok());
  EXPECT_EQ(result.response->results(0).position(), 14);
  EXPECT_EQ(client_->GetSession(session.id)->tokens(), 15);
}

TEST_F(ClientTest, DecodeBeforePrefillIsAFailedPrecondition) {
  const v1::Geometry g = testing::MakeGeometry(1, 4, 2, 8);
  absl::StatusOr<SessionHandle> s =
      client_->CreateSession(g, testing::MakePolicy(v1::SELECTOR_FULL));
  ASSERT_TRUE(s.ok());
  absl::StatusOr<std::unique_ptr<DecodeStream>> decode = client_->OpenDecodeStream(g);
  const std::vector<float> q(32), kv(16);
  const SequenceInput input{s->id, q, kv, kv};
  StepResult result;
  absl::Status status = (*decode)->Step(0, {&input, 1}, {}, &result);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(status.message(), HasSubstr("has no prompt yet"));
}

TEST_F(ClientTest, ListsAndClosesSessions) {
  const v1::Geometry g = testing::MakeGeometry(1, 4, 2, 8);
  absl::StatusOr<SessionHandle> a =
      client_->CreateSession(g, testing::MakePolicy(v1::SELECTOR_FULL), "first");
  absl::StatusOr<SessionHandle> b =
      client_->CreateSession(g, testing::MakePolicy(v1::SELECTOR_STREAMING, 0, 4, 8), "second");
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(b->policy.sinks(), 4);
  absl::StatusOr<std::vector<v1::SessionInfo>> sessions = client_->ListSessions();
  ASSERT_TRUE(sessions.ok());
  std::vector<std::string> labels;
  for (const v1::SessionInfo& s : *sessions) labels.push_back(s.label());
  EXPECT_THAT(labels, ::testing::UnorderedElementsAre("first", "second"));
  ASSERT_TRUE(client_->CloseSession(a->id).ok());
  EXPECT_EQ(client_->ListSessions()->size(), 1u);
  EXPECT_EQ(client_->CloseSession(a->id).code(), absl::StatusCode::kNotFound);
}

// max_tokens goes with the request: the KV of that many tokens of every layer is set aside at
// creation (2 layers x 1000 tokens x k and v x 2 KV heads x d = 8 x f32), none without it.
TEST_F(ClientTest, CreateSessionAnnouncesMaxTokens) {
  const v1::Geometry g = testing::MakeGeometry(2, 4, 2, 8);
  const v1::Policy policy = testing::MakePolicy(v1::SELECTOR_FULL);
  absl::StatusOr<SessionHandle> plain = client_->CreateSession(g, policy, "plain");
  absl::StatusOr<SessionHandle> announced = client_->CreateSession(g, policy, "announced", 1000);
  ASSERT_TRUE(plain.ok() && announced.ok());
  absl::StatusOr<v1::SessionInfo> plain_info = client_->GetSession(plain->id);
  absl::StatusOr<v1::SessionInfo> announced_info = client_->GetSession(announced->id);
  ASSERT_TRUE(plain_info.ok() && announced_info.ok());
  EXPECT_EQ(plain_info->host_budget_bytes(), 0);
  EXPECT_GE(announced_info->host_budget_bytes(), 2 * 1000 * 2 * 2 * 8 * 4);
  EXPECT_EQ(client_->CreateSession(g, policy, "", int64_t{1} << 40).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// The smallest message limit kvrecalld takes (--max_message_mb=1) receives the default chunks:
// 128 tokens of k and v (8 KiB each) made exactly 1 MiB of tensors, refused with the chunk's
// framing ("1048644 vs. 1048576", probe 25, 4).
class SmallestMessageLimitTest : public ClientTest {
 protected:
  ServerOptions Options() const override {
    ServerOptions options;
    options.max_message_bytes = 1 << 20;
    return options;
  }
};

TEST_F(SmallestMessageLimitTest, TheDefaultChunksFit) {
  const v1::Geometry g = testing::MakeGeometry(1, 8, 8, 128);
  const RandomPrompt prompt(g, 1000, 3);
  const SessionHandle session = Prefilled(g, prompt);
  absl::StatusOr<v1::SessionInfo> info = client_->GetSession(session.id);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->prompt_tokens(), 1000);
}

// A port past 65535 reached another server (gRPC takes it modulo 2^16: :113657 listed the
// sessions of the server on 48121), and a missing one port 443 (probe 21, 8); gRPC's own
// schemes pass to its resolvers.
TEST(ServerAddressTest, AConnectionsPortIsCheckedBeforeGrpcWrapsIt) {
  for (const char* address : {"127.0.0.1:113657", "127.0.0.1:99999", "127.0.0.1:0", "localhost",
                              "::1", "fe80::1:8080", ":50051", "127.0.0.1:", "127.0.0.1:5x"}) {
    EXPECT_TRUE(testing::HasStatus(Client::Connect(address, ChannelSecurity()).status(),
                                   absl::StatusCode::kInvalidArgument,
                                   absl::StrCat("server address '", address,
                                                "' must be HOST:PORT with a port in [1, 65535]")))
        << address;
  }
  for (const char* address : {"127.0.0.1:50051", "localhost:1", "[::1]:65535", "unix:/tmp/k.sock",
                              "unix-abstract:kv", "dns:///localhost:50051", "ipv4:127.0.0.1:1"}) {
    EXPECT_TRUE(CheckServerAddress(address).ok()) << address;
  }
}

TEST(ApiNamesTest, ParseAndPrintTheEnumsInLowerCase) {
  for (v1::Selector s : {v1::SELECTOR_FULL, v1::SELECTOR_EXACT_TOPK, v1::SELECTOR_STREAMING,
                         v1::SELECTOR_INDEX, v1::SELECTOR_RETOPK}) {
    EXPECT_EQ(*ParseSelector(SelectorName(s)), s);
  }
  EXPECT_EQ(SelectorName(v1::SELECTOR_EXACT_TOPK), "exact_topk");
  EXPECT_EQ(*ParseSelector("exact-topk"), v1::SELECTOR_EXACT_TOPK);
  EXPECT_EQ(*ParsePlacement("tiered"), v1::PLACEMENT_TIERED);
  EXPECT_EQ(*ParseDType("BF16"), v1::DTYPE_BF16);
  absl::Status s = ParseSelector("unspecified").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(),
            "unknown selector 'unspecified'; want one of full, exact_topk, streaming, index, "
            "retopk");
  EXPECT_THAT(ParseDType("f64").status().message(), HasSubstr("want one of f32, f16, bf16"));
  for (v1::ExactSearch e : {v1::EXACT_SEARCH_GRAPH, v1::EXACT_SEARCH_SHORTLIST}) {
    EXPECT_EQ(*ParseExactSearch(ExactSearchName(e)), e);
  }
  EXPECT_EQ(ExactSearchName(v1::EXACT_SEARCH_UNSPECIFIED), "unspecified");
  EXPECT_EQ(ParseExactSearch("unspecified").status().message(),
            "unknown exact_search 'unspecified'; want one of graph, shortlist");
}

// A small synthetic trace on disk, opened (the file is removed once mapped).
Trace SyntheticForReplay() {
  SyntheticTraceParams p;
  p.layers = 2;
  p.q_heads = 4;
  p.kv_heads = 2;
  p.head_dim = 32;
  p.rotary_dims = 16;
  p.context = 600;
  p.decode_steps = 6;
  p.mean_segment = 64;
  p.topics = 8;
  p.needles = 1;
  absl::StatusOr<SyntheticTrace> synthetic = SyntheticTrace::Create(p);
  EXPECT_TRUE(synthetic.ok()) << synthetic.status();
  const std::string path =
      ::testing::TempDir() + "/client_replay." + std::to_string(::getpid()) + ".safetensors";
  EXPECT_TRUE(synthetic->Write(path).ok());
  absl::StatusOr<Trace> trace = Trace::Open(path);
  ::unlink(path.c_str());
  EXPECT_TRUE(trace.ok()) << trace.status();
  return *std::move(trace);
}

TEST_F(ClientTest, ReplayReportsFidelityAgainstItsOwnFullAttention) {
  const Trace trace = SyntheticForReplay();
  ReplayOptions options;
  options.policy = testing::MakePolicy(v1::SELECTOR_FULL, 32);
  int64_t last_step = 0;
  options.step_progress = [&](int64_t done, int64_t) { last_step = done; };
  absl::StatusOr<ReplayReport> full = Replay(*client_, trace, options);
  ASSERT_TRUE(full.ok()) << full.status();
  EXPECT_EQ(last_step, 6);
  EXPECT_EQ(full->steps, 6);
  EXPECT_EQ(full->layer_steps, 12);
  EXPECT_EQ(full->geometry.context, 600);
  EXPECT_GE(full->output_cosine, 0.9999);
  EXPECT_GE(full->output_cosine_p05, 0.9999);
  EXPECT_LT(full->rel_l2, 1e-2);  // bf16 outputs
  EXPECT_DOUBLE_EQ(full->support_recall, 1.0);
  EXPECT_NEAR(full->retained_mass, 1.0, 1e-5);
  EXPECT_DOUBLE_EQ(full->mean_support, 600 + 3.5);  // every token, mean over steps 1..6
  EXPECT_GT(full->latency_us.p50, 0);
  EXPECT_GE(full->latency_us.p99, full->latency_us.p50);
  EXPECT_GT(full->server_us.p50, 0);

  options.policy = testing::MakePolicy(v1::SELECTOR_EXACT_TOPK, 32);
  absl::StatusOr<ReplayReport> topk = Replay(*client_, trace, options);
  ASSERT_TRUE(topk.ok()) << topk.status();
  EXPECT_DOUBLE_EQ(topk->support_recall, 1.0);  // the selector is the reference's top-32
  EXPECT_LT(topk->retained_mass, 1.0);
  EXPECT_DOUBLE_EQ(topk->mean_support, 32);
  EXPECT_LT(topk->output_cosine, full->output_cosine);
  // The client's comparison and the server's compare_exact measure the same outputs.
  EXPECT_NEAR(topk->output_cosine, topk->server_output_cosine, 1e-3);

  options.policy = testing::MakePolicy(v1::SELECTOR_STREAMING, 32, 4, 28);
  options.steps = 3;
  absl::StatusOr<ReplayReport> streaming = Replay(*client_, trace, options);
  ASSERT_TRUE(streaming.ok()) << streaming.status();
  EXPECT_EQ(streaming->steps, 3);
  EXPECT_LT(streaming->support_recall, 1.0);
  EXPECT_DOUBLE_EQ(streaming->mean_support, 32);
  EXPECT_EQ(streaming->mean_candidates, 0);

  const nlohmann::ordered_json j = ReplayReportJson(*streaming);
  for (const char* key : {"policy", "layers", "q_heads", "kv_heads", "head_dim", "context", "steps",
                          "support_recall", "retained_mass", "output_cosine", "output_cosine_p05",
                          "rel_l2", "path_mix", "latency_us", "mean_candidates", "server_us"}) {
    EXPECT_TRUE(j.contains(key)) << key;
  }
  EXPECT_EQ(j["policy"], "streaming");
  EXPECT_EQ(j["path_mix"]["reuse"], 0.0);

  // Every replay closed its sessions.
  EXPECT_TRUE(client_->ListSessions()->empty());

  options.steps = 7;
  absl::Status s = Replay(*client_, trace, options).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("steps (7) exceeds the 6 decode steps"));
}

}  // namespace
}  // namespace kvrecall::client
