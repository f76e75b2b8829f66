// Bad input to the service: every case gets the right status code and a message naming the
// field, changes nothing (the session's length and later answers are as if it never came), and
// leaves the server serving other sessions.
#include <unistd.h>

#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/backends/codes_learning.h"
#include "server/kv_growth.h"
#include "server/kv_store.h"
#include "tests/server_fixture.h"
#include "tests/test_util.h"

namespace kvrecall {
namespace {

using ::kvrecall::testing::CreateSession;
using ::kvrecall::testing::DecodeClient;
using ::kvrecall::testing::ExpectOutputNear;
using ::kvrecall::testing::GetSession;
using ::kvrecall::testing::HasStatus;
using ::kvrecall::testing::MakeGeometry;
using ::kvrecall::testing::MakePolicy;
using ::kvrecall::testing::MakeStep;
using ::kvrecall::testing::MakeTensor;
using ::kvrecall::testing::Prefill;
using ::kvrecall::testing::PromptChunks;
using ::kvrecall::testing::PromptLayer;
using ::kvrecall::testing::RandomPromptOf;
using ::kvrecall::testing::RandomNormal;
using ::kvrecall::testing::ReferenceSession;
using ::kvrecall::testing::ServerTest;
using ::kvrecall::testing::TensorValues;
using ::testing::HasSubstr;

constexpr int kLayers = 2;
constexpr int kQHeads = 4;
constexpr int kKvHeads = 2;
constexpr int kHeadDim = 16;
constexpr int64_t kPrompt = 20;

// A reference session together with its id on the server.
struct TrackedSession {
  std::string id;
  std::unique_ptr<ReferenceSession> ref;
  uint64_t seed = 0;

  const v1::Geometry& geometry() const { return ref->geometry(); }
  ReferenceSession::Token NextToken() { return ref->MakeToken(seed += 3); }
};

class ServiceErrorsTest : public ServerTest {
 protected:
  void SetUp() override {
    ServerTest::SetUp();
    victim_ = NewSession(100);
    bystander_ = NewSession(200);
  }

  // A full-attention f32 session with a committed prompt of kPrompt tokens on every layer.
  TrackedSession NewSession(uint64_t seed) {
    TrackedSession s;
    s.seed = seed * 1000;
    s.ref = std::make_unique<ReferenceSession>(MakeGeometry(kLayers, kQHeads, kKvHeads, kHeadDim),
                                               kPrompt, seed);
    absl::StatusOr<std::string> id =
        CreateSession(stub(), s.geometry(), MakePolicy(v1::SELECTOR_FULL));
    EXPECT_TRUE(id.ok()) << id.status();
    s.id = *id;
    EXPECT_TRUE(Prefill(stub(), s.ref->InterleavedPrompt(s.id, 8)).ok());
    return s;
  }

  // A session shaped like the victim's, without a prompt yet.
  absl::StatusOr<std::string> FreshSession() {
    return CreateSession(stub(), victim_.geometry(), MakePolicy(v1::SELECTOR_FULL));
  }
  // A random prompt layer of kPrompt tokens for fresh sessions.
  PromptLayer FreshPrompt() const { return RandomPromptOf(victim_.geometry(), kPrompt, 1); }

  // Decodes one valid token on every layer of `s` and checks the positions and outputs.
  void ExpectServesCorrectly(TrackedSession& s) {
    DecodeClient decode(stub());
    for (int layer = 0; layer < kLayers; ++layer) {
      v1::DecodeRequest request;
      request.set_layer(layer);
      std::vector<float> q;
      *request.add_steps() = s.ref->NextStep(s.id, layer, s.seed += 3, &q);
      absl::StatusOr<v1::DecodeResponse> reply = decode.Step(request);
      ASSERT_TRUE(reply.ok()) << reply.status();
      ASSERT_EQ(reply->results_size(), 1);
      EXPECT_EQ(reply->results(0).position(), s.ref->tokens(layer) - 1);
      ExpectOutputNear(TensorValues(reply->results(0).output()), s.ref->FullAttention(layer, q),
                       v1::DTYPE_F32, absl::StrCat("layer ", layer));
    }
  }

  // After a rejected request: the victim kept its length on every layer and answers exactly,
  // and the bystander is served too.
  void ExpectNothingChanged() {
    absl::StatusOr<v1::SessionInfo> info = GetSession(stub(), victim_.id);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->tokens(), victim_.ref->tokens(0));
    EXPECT_EQ(info->layers_prefilled(), kLayers);
    ExpectServesCorrectly(victim_);
    ExpectServesCorrectly(bystander_);
  }

  // Sends one request on a fresh stream; the stream must end with the error.
  absl::Status DecodeError(const v1::DecodeRequest& request) {
    DecodeClient decode(stub());
    absl::StatusOr<v1::DecodeResponse> reply = decode.Step(request);
    if (reply.ok()) return absl::InternalError("the request was accepted");
    return reply.status();
  }

  // A valid request for the victim's next token (which is not recorded: it must be refused).
  v1::DecodeRequest VictimRequest(int layer = 0) {
    v1::DecodeRequest request;
    request.set_layer(layer);
    *request.add_steps() = victim_.ref->Step(victim_.id, victim_.NextToken());
    return request;
  }

  TrackedSession victim_;
  TrackedSession bystander_;
};

TEST_F(ServiceErrorsTest, UnknownSessionIsNotFound) {
  v1::DecodeRequest request = VictimRequest();
  request.mutable_steps(0)->set_session_id("s-nonexistent");
  EXPECT_TRUE(HasStatus(DecodeError(request), absl::StatusCode::kNotFound,
                        "steps[0].session_id: no session 's-nonexistent'"));
  EXPECT_TRUE(HasStatus(GetSession(stub(), "s-nonexistent").status(), absl::StatusCode::kNotFound,
                        "no session 's-nonexistent'"));
  grpc::ClientContext context;
  v1::CloseSessionRequest close;
  close.set_session_id("s-nonexistent");
  v1::CloseSessionResponse closed;
  EXPECT_TRUE(HasStatus(testing::FromGrpc(stub().CloseSession(&context, close, &closed)),
                        absl::StatusCode::kNotFound, "no session 's-nonexistent'"));
  // An id longer than any the server makes is not echoed: a client's 8 KiB limit on the reply's
  // metadata would turn the echo into another error. Bytes that are not text are escaped.
  const std::string long_id(10000, 'x');
  for (const absl::Status& status :
       {GetSession(stub(), long_id).status(), [&] {
          v1::DecodeRequest long_request = VictimRequest();
          long_request.mutable_steps(0)->set_session_id(long_id);
          return DecodeError(long_request);
        }()}) {
    EXPECT_TRUE(HasStatus(status, absl::StatusCode::kInvalidArgument,
                          "a session id of 10000 bytes: this server's ids are at most 64"))
        << status;
  }
  EXPECT_TRUE(HasStatus(GetSession(stub(), std::string("s-\0\n", 4)).status(),
                        absl::StatusCode::kNotFound, "no session 's-\\x00\\n'"));
  ExpectNothingChanged();
}

TEST_F(ServiceErrorsTest, ABatchWithOneUnknownSessionAppendsNothing) {
  v1::DecodeRequest request = VictimRequest();
  *request.add_steps() = bystander_.ref->Step(bystander_.id, bystander_.NextToken());
  request.mutable_steps(1)->set_session_id("s-gone");
  EXPECT_TRUE(HasStatus(DecodeError(request), absl::StatusCode::kNotFound, "steps[1].session_id"));
  ExpectNothingChanged();
}

TEST_F(ServiceErrorsTest, EmptyOrRepeatedSessionIdIsInvalid) {
  v1::DecodeRequest request = VictimRequest();
  request.mutable_steps(0)->clear_session_id();
  EXPECT_TRUE(HasStatus(DecodeError(request), absl::StatusCode::kInvalidArgument,
                        "steps[0].session_id: must name a session, it is empty"));
  request = VictimRequest();
  *request.add_steps() = victim_.ref->Step(victim_.id, victim_.NextToken());
  EXPECT_TRUE(HasStatus(DecodeError(request), absl::StatusCode::kInvalidArgument,
                        "steps[1].session_id '" + victim_.id + "' repeats steps[0]"));
  ExpectNothingChanged();
}

TEST_F(ServiceErrorsTest, AStepWhosePositionTheLayerContradictsIsAbortedAndAppendsNothing) {
  const int64_t held = victim_.ref->tokens(0);
  ASSERT_EQ(bystander_.ref->tokens(0), held);
  // The bystander's step says the right position, the victim's another: the whole batch fails.
  for (const int64_t wrong : {held - 1, held + 1, int64_t{0}}) {
    v1::DecodeRequest request;
    request.set_layer(0);
    *request.add_steps() = bystander_.ref->Step(bystander_.id, bystander_.NextToken());
    request.mutable_steps(0)->set_position(held);
    *request.add_steps() = victim_.ref->Step(victim_.id, victim_.NextToken());
    request.mutable_steps(1)->set_position(wrong);
    EXPECT_TRUE(HasStatus(DecodeError(request), absl::StatusCode::kAborted,
                          absl::StrCat("steps[1].position ", wrong, ": session '", victim_.id,
                                       "' layer 0 holds ", held,
                                       " tokens, so its next token takes position ", held)))
        << wrong;
  }
  v1::DecodeRequest request = VictimRequest(1);
  request.mutable_steps(0)->set_position(-1);
  EXPECT_TRUE(HasStatus(DecodeError(request), absl::StatusCode::kInvalidArgument,
                        "steps[0].position must be >= 0 (the tokens the layer holds before "
                        "it), got -1"));
  ExpectNothingChanged();
}

TEST_F(ServiceErrorsTest, AResentStepThatSaysItsPositionIsNotAppendedTwice) {
  // A runner whose reply was lost resends the request as it was: the layers that took the token
  // refuse it, and each holds it once.
  for (int layer = 0; layer < kLayers; ++layer) {
    v1::DecodeRequest request;
    request.set_layer(layer);
    std::vector<float> q;
    *request.add_steps() = victim_.ref->NextStep(victim_.id, layer, victim_.seed += 3, &q);
    const int64_t position = victim_.ref->tokens(layer) - 1;
    request.mutable_steps(0)->set_position(position);
    DecodeClient decode(stub());
    absl::StatusOr<v1::DecodeResponse> reply = decode.Step(request);
    ASSERT_TRUE(reply.ok()) << reply.status();
    EXPECT_EQ(reply->results(0).position(), position);
    ExpectOutputNear(TensorValues(reply->results(0).output()),
                     victim_.ref->FullAttention(layer, q), v1::DTYPE_F32,
                     absl::StrCat("layer ", layer));
    EXPECT_TRUE(HasStatus(DecodeError(request), absl::StatusCode::kAborted,
                          absl::StrCat("holds ", position + 1, " tokens, so its next token takes "
                                       "position ", position + 1,
                                       " (a step resent after its first send was applied?); "
                                       "nothing of this request was applied")));
  }
  ExpectNothingChanged();
}

TEST_F(ServiceErrorsTest, WrongTensorShapesAndSizes) {
  v1::DecodeRequest request = VictimRequest();
  *request.mutable_steps(0)->mutable_q() =
      MakeTensor(RandomNormal(3 * kHeadDim, 1), {3, kHeadDim}, v1::DTYPE_F32);
  EXPECT_TRUE(HasStatus(DecodeError(request), absl::StatusCode::kInvalidArgument,
                        "steps[0].q has shape [3, 16], want [4, 16]"));

  request = VictimRequest();
  request.mutable_steps(0)->mutable_k_new()->mutable_data()->resize(7);
  EXPECT_TRUE(HasStatus(DecodeError(request), absl::StatusCode::kInvalidArgument,
                        "steps[0].k_new has 7 bytes of data, its shape and dtype need 128"));

  request = VictimRequest();
  request.mutable_steps(0)->mutable_v_new()->clear_data();
  EXPECT_TRUE(HasStatus(DecodeError(request), absl::StatusCode::kInvalidArgument,
                        "steps[0].v_new must carry exactly one of data (raw bytes) or values"));

  request = VictimRequest();
  *request.mutable_steps(0)->mutable_v_new() =
      MakeTensor(RandomNormal(kKvHeads * kHeadDim, 1), {kKvHeads, kHeadDim}, v1::DTYPE_F32,
                 /*as_values=*/true);
  request.mutable_steps(0)->mutable_v_new()->mutable_values()->RemoveLast();
  EXPECT_TRUE(HasStatus(DecodeError(request), absl::StatusCode::kInvalidArgument,
                        "steps[0].v_new has 31 values, its shape needs 32"));
  ExpectNothingChanged();
}

TEST_F(ServiceErrorsTest, DTypeMismatch) {
  v1::DecodeRequest request = VictimRequest();
  const ReferenceSession::Token token = victim_.NextToken();
  *request.mutable_steps(0)->mutable_v_new() =
      MakeTensor(token.v, {kKvHeads, kHeadDim}, v1::DTYPE_BF16);
  EXPECT_TRUE(HasStatus(DecodeError(request), absl::StatusCode::kInvalidArgument,
                        "steps[0].v_new has dtype bf16, the session's is f32"));
  ExpectNothingChanged();
}

TEST_F(ServiceErrorsTest, NaNAndInfAreRejectedForTheWholeBatch) {
  for (const float bad :
       {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    v1::DecodeRequest request = VictimRequest();
    ReferenceSession::Token token = bystander_.NextToken();
    token.k[5] = bad;
    *request.add_steps() = bystander_.ref->Step(bystander_.id, token);
    EXPECT_TRUE(HasStatus(DecodeError(request), absl::StatusCode::kInvalidArgument,
                          "steps[1].k_new holds a non-finite value"));

    request = VictimRequest(1);
    token = victim_.NextToken();
    token.q[0] = -bad;
    *request.mutable_steps(0)->mutable_q() =
        MakeTensor(token.q, {kQHeads, kHeadDim}, v1::DTYPE_F32, /*as_values=*/true);
    EXPECT_TRUE(HasStatus(DecodeError(request), absl::StatusCode::kInvalidArgument,
                          "steps[0].q holds a non-finite value"));
  }
  ExpectNothingChanged();
}

TEST_F(ServiceErrorsTest, LayerOutOfRange) {
  for (int layer : {kLayers, -1}) {
    EXPECT_TRUE(HasStatus(DecodeError(VictimRequest(layer)), absl::StatusCode::kInvalidArgument,
                          absl::StrCat("steps[0]: layer ", layer, " is out of range [0, 2)")));
  }
  ExpectNothingChanged();
}

TEST_F(ServiceErrorsTest, DecodeBeforePrefill) {
  absl::StatusOr<std::string> fresh = FreshSession();
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  v1::DecodeRequest request = VictimRequest();
  request.mutable_steps(0)->set_session_id(*fresh);
  EXPECT_TRUE(HasStatus(DecodeError(request), absl::StatusCode::kFailedPrecondition,
                        "layer 0 of session '" + *fresh + "' has no prompt yet"));
  // Prefilled on layer 0 only: layer 1 is still refused.
  const PromptLayer p = FreshPrompt();
  ASSERT_TRUE(Prefill(stub(), PromptChunks(*fresh, victim_.geometry(), 0, p, 20)).ok());
  request.set_layer(1);
  EXPECT_TRUE(HasStatus(DecodeError(request), absl::StatusCode::kFailedPrecondition,
                        "layer 1 of session '" + *fresh + "' has no prompt yet"));
  absl::StatusOr<v1::SessionInfo> info = GetSession(stub(), *fresh);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->layers_prefilled(), 1);
  ExpectNothingChanged();
}

TEST_F(ServiceErrorsTest, SecondPrefillOfALayerCommitsNothing) {
  absl::StatusOr<std::string> fresh = FreshSession();
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  const PromptLayer p = FreshPrompt();
  ASSERT_TRUE(Prefill(stub(), PromptChunks(*fresh, victim_.geometry(), 0, p, 20)).ok());
  // Layer 1 (new) and layer 0 (again) in one stream: the stream fails, layer 1 stays empty.
  std::vector<v1::PrefillChunk> chunks = PromptChunks(*fresh, victim_.geometry(), 1, p, 20);
  chunks.push_back(PromptChunks(*fresh, victim_.geometry(), 0, p, 20)[0]);
  EXPECT_TRUE(HasStatus(Prefill(stub(), chunks).status(), absl::StatusCode::kFailedPrecondition,
                        "layer 0 of session '" + *fresh + "' is already prefilled"));
  absl::StatusOr<v1::SessionInfo> info = GetSession(stub(), *fresh);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->layers_prefilled(), 1);
  EXPECT_EQ(info->tokens(), kPrompt);
  // The victim's layers are committed: prefilling them again is refused too.
  EXPECT_TRUE(
      HasStatus(Prefill(stub(), PromptChunks(victim_.id, victim_.geometry(), 1, p, 20)).status(),
                absl::StatusCode::kFailedPrecondition, "layer 1 of session '" + victim_.id));
  ExpectNothingChanged();
}

TEST_F(ServiceErrorsTest, BadPrefillStreamsCommitNothing) {
  absl::StatusOr<std::string> fresh = FreshSession();
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  const v1::Geometry g = victim_.geometry();
  const PromptLayer p = FreshPrompt();
  const std::vector<v1::PrefillChunk> good0 = PromptChunks(*fresh, g, 0, p, 5);
  const std::vector<v1::PrefillChunk> good1 = PromptChunks(*fresh, g, 1, p, 5);

  std::vector<v1::PrefillChunk> chunks = good0;
  chunks.erase(chunks.begin() + 1);  // offsets 0, 10, ...
  EXPECT_TRUE(HasStatus(Prefill(stub(), chunks).status(), absl::StatusCode::kInvalidArgument,
                        "chunks[1].offset is 10 but layer 0 has received 5 tokens in this stream"));

  chunks = good0;
  chunks[0].clear_session_id();
  EXPECT_TRUE(HasStatus(Prefill(stub(), chunks).status(), absl::StatusCode::kInvalidArgument,
                        "chunks[0].session_id is required in the first chunk"));

  chunks = good0;
  chunks[0].set_session_id("s-nope");
  EXPECT_TRUE(HasStatus(Prefill(stub(), chunks).status(), absl::StatusCode::kNotFound,
                        "chunks[0].session_id: no session 's-nope'"));

  chunks = good0;
  chunks[2].set_session_id(victim_.id);
  EXPECT_TRUE(
      HasStatus(Prefill(stub(), chunks).status(), absl::StatusCode::kInvalidArgument,
                "chunks[2].session_id '" + victim_.id + "' differs from the stream's session"));

  chunks = good0;
  chunks[3].set_layer(kLayers);
  EXPECT_TRUE(HasStatus(Prefill(stub(), chunks).status(), absl::StatusCode::kInvalidArgument,
                        "chunks[3].layer 2 is out of range [0, 2)"));

  chunks = good0;
  *chunks[1].mutable_k() =
      MakeTensor(std::vector<float>(5 * 3 * kHeadDim, 1.0f), {5, 3, kHeadDim}, v1::DTYPE_F32);
  EXPECT_TRUE(HasStatus(Prefill(stub(), chunks).status(), absl::StatusCode::kInvalidArgument,
                        "chunks[1].k has shape [5, 3, 16], want [n, 2, 16]"));

  chunks = good0;
  *chunks[1].mutable_k() = MakeTensor(std::vector<float>(), {0, kKvHeads, kHeadDim},
                                      v1::DTYPE_F32);
  EXPECT_TRUE(HasStatus(Prefill(stub(), chunks).status(), absl::StatusCode::kInvalidArgument,
                        "chunks[1].k has shape [0, 2, 16], want [n, 2, 16] with n >= 1"));

  chunks = good0;
  *chunks[1].mutable_v() = MakeTensor(std::vector<float>(4 * kKvHeads * kHeadDim, 1.0f),
                                      {4, kKvHeads, kHeadDim}, v1::DTYPE_F32);
  EXPECT_TRUE(HasStatus(Prefill(stub(), chunks).status(), absl::StatusCode::kInvalidArgument,
                        "chunks[1] carries 5 tokens of q, 5 of k and 4 of v"));

  chunks = good0;
  *chunks[2].mutable_q() = MakeTensor(std::vector<float>(5 * kQHeads * kHeadDim, 1.0f),
                                      {5, kQHeads, kHeadDim}, v1::DTYPE_F16);
  EXPECT_TRUE(HasStatus(Prefill(stub(), chunks).status(), absl::StatusCode::kInvalidArgument,
                        "chunks[2].q has dtype f16, the session's is f32"));

  // A NaN in the last chunk of layer 1 sinks the whole stream, layer 0 included.
  chunks = good0;
  chunks.insert(chunks.end(), good1.begin(), good1.end());
  std::vector<float> poisoned(5 * kKvHeads * kHeadDim, 0.5f);
  poisoned[17] = std::numeric_limits<float>::quiet_NaN();
  *chunks.back().mutable_v() = MakeTensor(poisoned, {5, kKvHeads, kHeadDim}, v1::DTYPE_F32);
  EXPECT_TRUE(HasStatus(Prefill(stub(), chunks).status(), absl::StatusCode::kInvalidArgument,
                        "chunks[7].v holds a non-finite value (nan) at element 17"));

  // Layers of one session have one prompt length.
  chunks = good0;
  chunks.insert(chunks.end(), good1.begin(), good1.end() - 1);
  EXPECT_TRUE(HasStatus(Prefill(stub(), chunks).status(), absl::StatusCode::kInvalidArgument,
                        "every layer's prompt must have one length"));

  EXPECT_TRUE(HasStatus(Prefill(stub(), {}).status(), absl::StatusCode::kInvalidArgument,
                        "the Prefill stream carried no chunks"));

  absl::StatusOr<v1::SessionInfo> info = GetSession(stub(), *fresh);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->layers_prefilled(), 0);
  EXPECT_EQ(info->tokens(), 0);
  // Nothing was half-committed: the very same prompt now goes through.
  chunks = good0;
  chunks.insert(chunks.end(), good1.begin(), good1.end());
  absl::StatusOr<v1::PrefillResponse> ok = Prefill(stub(), chunks);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->layers_committed(), 2);
  EXPECT_EQ(ok->tokens(), kPrompt);
  ExpectNothingChanged();
}

TEST_F(ServiceErrorsTest, CancelledPrefillCommitsNothing) {
  absl::StatusOr<std::string> fresh = FreshSession();
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  const PromptLayer p = FreshPrompt();
  const std::vector<v1::PrefillChunk> chunks = PromptChunks(*fresh, victim_.geometry(), 0, p, 5);
  {
    grpc::ClientContext context;
    v1::PrefillResponse response;
    auto writer = stub().Prefill(&context, &response);
    for (const v1::PrefillChunk& c : chunks) ASSERT_TRUE(writer->Write(c));
    context.TryCancel();
    EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  // Had the cancelled stream committed, this prefill of the same layer would be refused.
  absl::StatusOr<v1::PrefillResponse> again = Prefill(stub(), chunks);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->tokens(), kPrompt);
  ExpectNothingChanged();
}

TEST_F(ServiceErrorsTest, BadGeometryIsInvalid) {
  struct Case {
    v1::Geometry geometry;
    std::string message;
  };
  v1::Geometry nan_scale = MakeGeometry(1, 4, 2, 16);
  nan_scale.set_softmax_scale(std::numeric_limits<float>::quiet_NaN());
  v1::Geometry negative_scale = MakeGeometry(1, 4, 2, 16);
  negative_scale.set_softmax_scale(-1.0f);
  v1::Geometry huge_scale = MakeGeometry(1, 4, 2, 16);
  huge_scale.set_softmax_scale(1e30f);  // (probe 17, 4: lse +inf from in-range tensors)
  const std::vector<Case> cases = {
      {MakeGeometry(1, 8, 3, 16), "geometry.kv_heads (3) must divide geometry.q_heads (8)"},
      {MakeGeometry(0, 8, 2, 16), "geometry.layers must be in [1, 1024], got 0"},
      {MakeGeometry(2, 0, 2, 16), "geometry.q_heads must be in [1, 1024], got 0"},
      {MakeGeometry(2, 8, -2, 16), "geometry.kv_heads must be in [1, 1024], got -2"},
      {MakeGeometry(2, 8, 2, 0), "geometry.head_dim must be in [1, 1024], got 0"},
      {MakeGeometry(2, 8, 2, 4096), "geometry.head_dim must be in [1, 1024], got 4096"},
      {MakeGeometry(2, 8, 2, 16, v1::DTYPE_UNSPECIFIED),
       "geometry.dtype must be DTYPE_F32, DTYPE_F16 or DTYPE_BF16, got 0"},
      {nan_scale, "geometry.softmax_scale must be finite and >= 0"},
      {negative_scale, "geometry.softmax_scale must be finite and >= 0"},
      {huge_scale, "geometry.softmax_scale must be at most 1.23915e+27 at head_dim 16"},
  };
  for (const Case& c : cases) {
    EXPECT_TRUE(HasStatus(CreateSession(stub(), c.geometry, MakePolicy(v1::SELECTOR_FULL)).status(),
                          absl::StatusCode::kInvalidArgument, c.message));
  }
  grpc::ClientContext context;
  v1::ListSessionsResponse list;
  ASSERT_TRUE(stub().ListSessions(&context, {}, &list).ok());
  EXPECT_EQ(list.sessions_size(), 2);  // the victim and the bystander only
  ExpectNothingChanged();
}

TEST_F(ServiceErrorsTest, BadPolicyKnobs) {
  struct Case {
    v1::Policy policy;
    absl::StatusCode code;
    std::string message;
  };
  std::vector<Case> cases;
  auto add = [&](absl::StatusCode code, std::string message, auto edit) {
    v1::Policy p = MakePolicy(v1::SELECTOR_EXACT_TOPK);
    edit(p);
    cases.push_back({p, code, std::move(message)});
  };
  const auto invalid = absl::StatusCode::kInvalidArgument;
  add(invalid, "policy.top_k must be >= 1, got -5", [](v1::Policy& p) { p.set_top_k(-5); });
  add(invalid, "policy.sinks must be >= 0, got -1", [](v1::Policy& p) { p.set_sinks(-1); });
  add(invalid, "policy.recent must be >= 0, got -3", [](v1::Policy& p) { p.set_recent(-3); });
  // A zero is served as sent where the field is present (proto3 optional), so these can be
  // asked for now: a streaming selector with an empty window, a tiered ring of no tokens.
  add(invalid, "policy.sinks + policy.recent must be >= 1 for the streaming selector",
      [](v1::Policy& p) {
        p.set_selector(v1::SELECTOR_STREAMING);
        p.set_sinks(0);
        p.set_recent(0);
      });
  add(invalid, "policy.recent must be >= 1 in PLACEMENT_TIERED", [](v1::Policy& p) {
    p.set_placement(v1::PLACEMENT_TIERED);
    p.set_selector(v1::SELECTOR_STREAMING);
    p.set_recent(0);
  });
  add(invalid, "policy.retopk.recent_window must be >= 0, got -2",
      [](v1::Policy& p) { p.mutable_retopk()->set_recent_window(-2); });
  add(invalid, "policy.retopk.reuse_neighbors must be in [1, cache_capacity=8], got 9",
      [](v1::Policy& p) {
        p.mutable_retopk()->set_cache_capacity(8);
        p.mutable_retopk()->set_reuse_neighbors(9);
      });
  add(invalid, "policy.retopk.tau must be finite",
      [](v1::Policy& p) { p.mutable_retopk()->set_tau(std::numeric_limits<float>::infinity()); });
  add(invalid, "policy.retopk.refresh_interval must be >= 0, got -1",
      [](v1::Policy& p) { p.mutable_retopk()->set_refresh_interval(-1); });
  add(invalid, "policy.retopk.target_recall must be in (0, 1], got 1.5", [](v1::Policy& p) {
    p.mutable_retopk()->set_auto_tau(true);
    p.mutable_retopk()->set_target_recall(1.5f);
  });
  add(invalid, "policy.index.max_degree must be <= 256, got 300",
      [](v1::Policy& p) { p.mutable_index()->set_max_degree(300); });
  add(invalid, "policy.index.search_list_size must be >= 0 (0 takes the default), got -2",
      [](v1::Policy& p) { p.mutable_index()->set_search_list_size(-2); });
  add(invalid, "policy.index.build_queries must be >= 0 (0 takes the default), got -1",
      [](v1::Policy& p) { p.mutable_index()->set_build_queries(-1); });
  add(invalid, "policy.index.search_width must be <= 4, got 5",
      [](v1::Policy& p) { p.mutable_index()->set_search_width(5); });
  add(invalid, "policy.index.search_width must be >= 0 (0 takes the default), got -1",
      [](v1::Policy& p) { p.mutable_index()->set_search_width(-1); });
  add(invalid, "policy.index.graph_scope has the unknown value 3",
      [](v1::Policy& p) { p.mutable_index()->set_graph_scope(static_cast<v1::GraphScope>(3)); });
  add(invalid, "policy.selector has the unknown value 99",
      [](v1::Policy& p) { p.set_selector(static_cast<v1::Selector>(99)); });
  add(invalid, "policy.placement has the unknown value 7",
      [](v1::Policy& p) { p.set_placement(static_cast<v1::Placement>(7)); });
  // Without a CUDA device (or without CUDA in the build), GPU placements say why.
  if (server().server().placements().gpu().empty()) {
    add(absl::StatusCode::kFailedPrecondition,
        "policy.placement PLACEMENT_GPU cannot be served: ",
        [](v1::Policy& p) { p.set_placement(v1::PLACEMENT_GPU); });
  }
  for (const Case& c : cases) {
    EXPECT_TRUE(HasStatus(CreateSession(stub(), MakeGeometry(1, 4, 2, 16), c.policy).status(),
                          c.code, c.message));
  }
  grpc::ClientContext context;
  v1::ListSessionsResponse list;
  ASSERT_TRUE(stub().ListSessions(&context, {}, &list).ok());
  EXPECT_EQ(list.sessions_size(), 2);
  ExpectNothingChanged();
}

// A server whose messages are capped at 1 MiB.
class ServiceMessageLimitTest : public ServiceErrorsTest {
 protected:
  ServerOptions Options() const override {
    ServerOptions options;
    options.max_message_bytes = 1 << 20;
    return options;
  }
};

TEST_F(ServiceMessageLimitTest, OversizeMessagesAreResourceExhausted) {
  // 9000 tokens x (4 + 2 + 2) heads x 16 x 4 bytes: about 4.4 MiB in one chunk.
  constexpr int64_t kBig = 9000;
  PromptLayer p{RandomNormal(kBig * kQHeads * kHeadDim, 1),
                RandomNormal(kBig * kKvHeads * kHeadDim, 2),
                RandomNormal(kBig * kKvHeads * kHeadDim, 3)};
  absl::StatusOr<std::string> fresh = FreshSession();
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  EXPECT_TRUE(
      HasStatus(Prefill(stub(), PromptChunks(*fresh, victim_.geometry(), 0, p, kBig)).status(),
                absl::StatusCode::kResourceExhausted, "larger than max"));
  // The same prompt in chunks under the limit is fine.
  ASSERT_TRUE(Prefill(stub(), PromptChunks(*fresh, victim_.geometry(), 0, p, 1000)).ok());

  v1::DecodeRequest request = VictimRequest();
  request.mutable_steps(0)->mutable_q()->mutable_data()->resize(2 << 20);
  EXPECT_TRUE(
      HasStatus(DecodeError(request), absl::StatusCode::kResourceExhausted, "larger than max"));
  ExpectNothingChanged();
}

// A Decode request under the message limit whose reply could exceed it (many query heads a KV
// head, with per-head diagnostics) is refused before it is applied: gRPC would fail to send the
// reply of a step every session had taken, and a runner that resends would append each token
// twice. Without the diagnostics the same steps fit and are served.
TEST_F(ServiceMessageLimitTest, ADecodeWhoseReplyCouldExceedTheLimitIsRefusedFirst) {
  // Fewer than 64 sessions: ThreadSanitizer holds at most 64 locks a thread (a request locks
  // its sessions together).
  const v1::Geometry g = MakeGeometry(1, 1024, 1, 2);
  constexpr int kSessions = 48;
  std::vector<std::unique_ptr<ReferenceSession>> refs;
  std::vector<std::string> ids;
  for (int i = 0; i < kSessions; ++i) {
    refs.push_back(std::make_unique<ReferenceSession>(g, 1, 40 + i));
    absl::StatusOr<std::string> id = CreateSession(stub(), g, MakePolicy(v1::SELECTOR_FULL));
    ASSERT_TRUE(id.ok()) << id.status();
    ASSERT_TRUE(Prefill(stub(), refs.back()->InterleavedPrompt(*id, 1)).ok());
    ids.push_back(*id);
  }
  v1::DecodeRequest request;
  for (int i = 0; i < kSessions; ++i) {
    *request.add_steps() = refs[i]->Step(ids[i], refs[i]->MakeToken(900 + i));
  }
  request.set_return_lse(true);
  request.set_diagnostics(true);
  request.set_compare_exact(true);
  ASSERT_LT(request.ByteSizeLong(), 1u << 20);
  const absl::Status refused = DecodeError(request);
  EXPECT_TRUE(HasStatus(refused, absl::StatusCode::kResourceExhausted,
                        "over the server's message limit (--max_message_mb) of 1048576 bytes; "
                        "nothing of it was applied"))
      << refused;
  for (const std::string& id : {ids.front(), ids.back()}) {
    absl::StatusOr<v1::SessionInfo> info = GetSession(stub(), id);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->tokens(), 1) << "a refused step was applied";
  }
  request.set_diagnostics(false);
  request.set_compare_exact(false);
  DecodeClient decode(stub());
  absl::StatusOr<v1::DecodeResponse> reply = decode.Step(request);
  ASSERT_TRUE(reply.ok()) << reply.status();
  EXPECT_EQ(reply->results_size(), kSessions);
  absl::StatusOr<v1::SessionInfo> info = GetSession(stub(), ids.back());
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->tokens(), 2);
  ExpectNothingChanged();
}

// A server with a host memory budget of 64 KiB.
class ServiceMemoryBudgetTest : public ServerTest {
 protected:
  ServerOptions Options() const override {
    ServerOptions options;
    options.host_memory_budget_bytes = 64 << 10;
    return options;
  }
};

// An announced max_tokens sets the layers' host KV aside at CreateSession, in the bytes the
// placement keeps it in: f32 on the cpu placement, the session's dtype (bf16 here, half of it)
// on the tiered one. 64 KiB holds 56 tokens of 2 x 2 x 64 f32 and 112 of bf16 (each array is
// charged its whole pages and a page table's: LayerKvStore::BytesFor).
TEST_F(ServiceMemoryBudgetTest, AnnouncedTokensSetTheHostKvAsideInThePlacementsLayout) {
  const v1::Geometry g = MakeGeometry(1, 4, 2, 64, v1::DTYPE_BF16);
  if (sysconf(_SC_PAGESIZE) != 4096) GTEST_SKIP() << "pages of another size";
  for (const auto& [placement, fits, element] :
       {std::tuple{v1::PLACEMENT_CPU, 56, KvElement::kF32},
        std::tuple{v1::PLACEMENT_TIERED, 112, KvElement::kBf16}}) {
    ASSERT_LE(LayerKvStore::BytesFor(fits, 2, 64, element), 64 << 10);
    ASSERT_GT(LayerKvStore::BytesFor(fits + 1, 2, 64, element), 64 << 10);
    v1::Policy policy = MakePolicy(v1::SELECTOR_FULL, 0, 4, 8);
    policy.set_placement(placement);
    for (const int tokens : {fits + 1, fits}) {
      v1::CreateSessionRequest request;
      *request.mutable_geometry() = g;
      *request.mutable_policy() = policy;
      request.set_max_tokens(tokens);
      v1::CreateSessionResponse response;
      grpc::ClientContext context;
      const absl::Status status =
          testing::FromGrpc(stub().CreateSession(&context, request, &response));
      if (tokens > fits) {
        EXPECT_TRUE(HasStatus(status, absl::StatusCode::kResourceExhausted,
                              absl::StrCat("max_tokens=", tokens, " of 1 layers")))
            << v1::Placement_Name(placement) << " " << status;
        EXPECT_EQ(server().server().budget().used(), 0);
        continue;
      }
      ASSERT_TRUE(status.ok()) << v1::Placement_Name(placement) << " " << status;
      EXPECT_EQ(server().server().budget().used(), LayerKvStore::BytesFor(fits, 2, 64, element));
      grpc::ClientContext close_context;
      v1::CloseSessionRequest close;
      close.set_session_id(response.session_id());
      v1::CloseSessionResponse closed;
      ASSERT_TRUE(stub().CloseSession(&close_context, close, &closed).ok());
      EXPECT_EQ(server().server().budget().used(), 0);
    }
  }
}

// A Prefill that fails after staging some of an announced session's prompt gives what it staged
// back to the session's set-aside, not to the budget: the session still holds its max_tokens,
// and its whole prompt still fits however the budget fills meanwhile (probe 7: every failed or
// cancelled Prefill handed the set-aside to other sessions).
TEST_F(ServiceMemoryBudgetTest, AFailedPrefillKeepsTheSessionsSetAside) {
  const v1::Geometry g = MakeGeometry(1, 4, 2, 64);
  constexpr int kAnnounced = 32;  // 32 KiB of f32 KV (40 KiB charged), most of the budget
  const int64_t set_aside = LayerKvStore::BytesFor(kAnnounced, 2, 64, KvElement::kF32);
  v1::CreateSessionRequest request;
  *request.mutable_geometry() = g;
  *request.mutable_policy() = MakePolicy(v1::SELECTOR_FULL);
  request.set_max_tokens(kAnnounced);
  v1::CreateSessionResponse created;
  grpc::ClientContext context;
  ASSERT_TRUE(stub().CreateSession(&context, request, &created).ok());
  const std::string& id = created.session_id();
  const MemoryBudget& budget = server().server().budget();
  ASSERT_EQ(budget.used(), set_aside);

  const PromptLayer prompt{RandomNormal(kAnnounced * 4 * 64, 1),
                           RandomNormal(kAnnounced * 2 * 64, 2),
                           RandomNormal(kAnnounced * 2 * 64, 3)};
  std::vector<v1::PrefillChunk> chunks = PromptChunks(id, g, 0, prompt, 16);
  chunks[1].set_offset(17);  // not where the first chunk ended
  EXPECT_TRUE(HasStatus(Prefill(stub(), chunks).status(), absl::StatusCode::kInvalidArgument,
                        "offset"));
  absl::StatusOr<v1::SessionInfo> info = GetSession(stub(), id);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->host_budget_bytes(), set_aside) << "its set-aside, whole";
  EXPECT_EQ(budget.used(), set_aside);
  EXPECT_EQ(budget.available(), (64 << 10) - set_aside) << "nothing more for others";

  ASSERT_TRUE(Prefill(stub(), PromptChunks(id, g, 0, prompt, 16)).ok());
  info = GetSession(stub(), id);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->tokens(), kAnnounced);
  EXPECT_EQ(info->host_budget_bytes(), budget.used());
}

// Decodes `steps` random tokens into the session `id` of `g`, each through its layers in turn.
void DecodeRandomTokens(v1::KvRecall::Stub& stub, const std::string& id, const v1::Geometry& g,
                        int steps, uint64_t seed) {
  DecodeClient decode(stub);
  for (int step = 0; step < steps; ++step) {
    for (int layer = 0; layer < g.layers(); ++layer) {
      const PromptLayer token = RandomPromptOf(g, 1, seed + 3 * step + 1000003 * layer);
      v1::DecodeRequest one;
      one.set_layer(layer);
      *one.add_steps() = MakeStep(id, g, token.q, token.k, token.v);
      ASSERT_TRUE(decode.Step(one).ok()) << step << " layer " << layer;
    }
  }
}

// Waits (60 s at most) until no codes learning is queued or running.
void WaitForTheLearnings() {
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (CodesLearningQueue()->active() > 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_EQ(CodesLearningQueue()->active(), 0) << "a learning still runs after 60 s";
}

// What each session holds of the host budget (SessionInfo.host_budget_bytes) adds up to the
// memory gauge, where host_bytes leaves out what is set aside for max_tokens (all of it before
// the Prefill) and shortlist codes being learned beside those in use; the learning's outcome
// reaches the metrics once its codes take over.
TEST_F(ServerTest, EachSessionsBudgetBytesAddUpToTheMemoryGauge) {
  // No growth ahead (kvrecalld --host_kv_growth_ahead=false): the rows a layer grows ahead of
  // need are budget bytes it does not use yet, which would blur the shares asserted below
  // (ServiceDecodeTest.AHostKvGrownAheadOfNeedKeepsEveryStepExact covers them).
  SetHostKvGrowthAhead(false);
  const absl::Cleanup ahead_again = [] { SetHostKvGrowthAhead(true); };
  // bf16, which a GPU tier keeps (the cpu placement keeps f32 KV whatever the dtype).
  const v1::Geometry g = MakeGeometry(1, 4, 2, 64, v1::DTYPE_BF16);
  const MemoryBudget& gauge = server().server().budget();
  auto info_of = [&](const std::string& id) {
    absl::StatusOr<v1::SessionInfo> info = GetSession(stub(), id);
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? *info : v1::SessionInfo();
  };
  // Announced and not prefilled: its KV for max_tokens set aside, none of it used yet.
  v1::CreateSessionRequest request;
  *request.mutable_geometry() = g;
  *request.mutable_policy() = MakePolicy(v1::SELECTOR_FULL);
  request.set_max_tokens(500);
  v1::CreateSessionResponse announced;
  grpc::ClientContext context;
  ASSERT_TRUE(stub().CreateSession(&context, request, &announced).ok());
  v1::SessionInfo info = info_of(announced.session_id());
  EXPECT_EQ(info.host_bytes(), 0);
  EXPECT_EQ(info.host_budget_bytes(), LayerKvStore::BytesFor(500, 2, 64, KvElement::kF32))
      << "keys and values, f32";
  EXPECT_EQ(info.host_budget_bytes(), gauge.used());
  // Without --max_context_tokens a layer may grow to the most a layer can hold.
  for (const std::shared_ptr<Session>& session : server().server().sessions().List()) {
    EXPECT_EQ(session->layer_config().max_layer_tokens, kMaxLayerTokens);
  }

  // A tiered index layer with a shortlist: codes learned from its prompt's 512 bulk rows, and
  // learned again once decoding brings the bulk to 1024, beside those in use until 1536.
  constexpr int kSinks = 4, kRecent = 16, kPromptBulk = 512;
  v1::Policy policy = MakePolicy(v1::SELECTOR_INDEX, 16, kSinks, kRecent);
  policy.set_placement(v1::PLACEMENT_TIERED);
  policy.mutable_index()->set_shortlist(64);
  absl::StatusOr<std::string> tiered = CreateSession(stub(), g, policy);
  ASSERT_TRUE(tiered.ok()) << tiered.status();
  ASSERT_TRUE(Prefill(stub(), PromptChunks(*tiered, g, 0,
                                           RandomPromptOf(g, kSinks + kRecent + kPromptBulk, 10),
                                           128))
                  .ok());
  // What it holds beyond its layer's memory before any learning (on a GPU tier, device buffers
  // its layer does not report), which the second set of codes adds to until the take-over.
  auto beyond_memory = [](const v1::SessionInfo& i) {
    return i.host_budget_bytes() + i.gpu_budget_bytes() - i.host_bytes() - i.gpu_bytes();
  };
  const int64_t beyond_before = beyond_memory(info_of(*tiered));
  EXPECT_GE(beyond_before, 0);
  const int64_t learn_at = CodesLearning::kFirstLearnRows;
  ASSERT_EQ(CodesLearning::NextLearnAt(kPromptBulk, g.head_dim()), learn_at);
  DecodeRandomTokens(stub(), *tiered, g, learn_at - kPromptBulk, 100);
  WaitForTheLearnings();
  info = info_of(*tiered);
  EXPECT_GT(beyond_memory(info), beyond_before)
      << "the codes being learned are held beside those in use";

  // A cpu session, prefilled without an announcement: it holds what it uses.
  absl::StatusOr<std::string> plain = CreateSession(stub(), g, MakePolicy(v1::SELECTOR_FULL));
  ASSERT_TRUE(plain.ok()) << plain.status();
  ASSERT_TRUE(Prefill(stub(), PromptChunks(*plain, g, 0, RandomPromptOf(g, 100, 20), 64)).ok());
  const v1::SessionInfo plain_info = info_of(*plain);
  EXPECT_EQ(plain_info.host_budget_bytes(), plain_info.host_bytes());

  EXPECT_EQ(info_of(announced.session_id()).host_budget_bytes() + info.host_budget_bytes() +
                plain_info.host_budget_bytes(),
            gauge.used());

  // At the take-over the second set replaces the first, and the metrics count it.
  const std::string taken_over = "kvrecall_codes_learnings_total{outcome=\"taken_over\"} ";
  EXPECT_THAT(server().server().metrics().TextFormat(), HasSubstr(taken_over + "0\n"));
  DecodeRandomTokens(stub(), *tiered, g, CodesLearning::TakeOverAt(learn_at) - learn_at + 1,
                     5000);
  EXPECT_EQ(beyond_memory(info_of(*tiered)), beyond_before) << "the old codes given back";
  EXPECT_THAT(server().server().metrics().TextFormat(), HasSubstr(taken_over + "1\n"));
}

// A model's layers all start learning their codes at the same token; they take over one a
// token (CodesLearning::TakeOverAt, by the layer's index the Prefill gives each layer), so that
// no token pays every layer's take-over: the metrics count one more take-over a token.
TEST_F(ServerTest, AModelsLayersTakeOverTheirLearnedCodesOneAToken) {
  constexpr int kLayers = 4, kSinks = 4, kRecent = 16, kPromptBulk = 512;
  const v1::Geometry g = MakeGeometry(kLayers, 4, 2, 64, v1::DTYPE_BF16);
  v1::Policy policy = MakePolicy(v1::SELECTOR_INDEX, 16, kSinks, kRecent);
  policy.set_placement(v1::PLACEMENT_TIERED);
  policy.mutable_index()->set_shortlist(64);
  absl::StatusOr<std::string> id = CreateSession(stub(), g, policy);
  ASSERT_TRUE(id.ok()) << id.status();
  std::vector<v1::PrefillChunk> chunks;
  for (int layer = 0; layer < kLayers; ++layer) {
    for (v1::PrefillChunk& chunk :
         PromptChunks(*id, g, layer,
                      RandomPromptOf(g, kSinks + kRecent + kPromptBulk, 10 + layer), 256)) {
      chunks.push_back(std::move(chunk));
    }
  }
  ASSERT_TRUE(Prefill(stub(), chunks).ok());
  auto taken_over = [this] {
    const std::string text = server().server().metrics().TextFormat();
    const std::string name = "kvrecall_codes_learnings_total{outcome=\"taken_over\"} ";
    const size_t at = text.find(name);
    return at == std::string::npos ? -1 : std::stoll(text.substr(at + name.size()));
  };
  const int64_t before = taken_over();
  ASSERT_GE(before, 0);
  const int64_t learn_at = CodesLearning::kFirstLearnRows;
  ASSERT_EQ(CodesLearning::NextLearnAt(kPromptBulk, g.head_dim()), learn_at);
  DecodeRandomTokens(stub(), *id, g, learn_at - kPromptBulk, 100);
  WaitForTheLearnings();
  // Up to the token whose step reserves bulk row TakeOverAt(learn_at), none has taken over.
  const int64_t first = CodesLearning::TakeOverAt(learn_at);
  DecodeRandomTokens(stub(), *id, g, static_cast<int>(first - learn_at), 200);
  EXPECT_EQ(taken_over(), before);
  for (int token = 0; token < kLayers + 2; ++token) {
    DecodeRandomTokens(stub(), *id, g, 1, 300 + 7 * token);
    EXPECT_EQ(taken_over() - before, std::min(token + 1, kLayers)) << "token " << token;
  }
}

// With max_tokens announced the prompt is staged in the layer's final allocation: the host KV
// is exactly the announced tokens' rows (no geometric slack from the chunks' growth, no copy to
// the announced size at the build).
TEST_F(ServerTest, AnnouncedTokensStageThePromptInItsFinalAllocation) {
  const v1::Geometry g = MakeGeometry(1, 4, 2, 64);
  constexpr int kPrompt = 300, kDecode = 10;
  v1::CreateSessionRequest request;
  *request.mutable_geometry() = g;
  *request.mutable_policy() = MakePolicy(v1::SELECTOR_FULL);
  request.set_max_tokens(kPrompt + kDecode);
  v1::CreateSessionResponse response;
  grpc::ClientContext context;
  ASSERT_TRUE(stub().CreateSession(&context, request, &response).ok());
  PromptLayer p{RandomNormal(kPrompt * 4 * 64, 1), RandomNormal(kPrompt * 2 * 64, 2),
                RandomNormal(kPrompt * 2 * 64, 3)};
  ASSERT_TRUE(Prefill(stub(), PromptChunks(response.session_id(), g, 0, p, 37)).ok());
  absl::StatusOr<v1::SessionInfo> info = GetSession(stub(), response.session_id());
  ASSERT_TRUE(info.ok()) << info.status();
  // Keys and values, f32 on the cpu placement.
  EXPECT_EQ(info->host_bytes() - info->selector_bytes(),
            LayerKvStore::BytesFor(kPrompt + kDecode, 2, 64, KvElement::kF32));
}

TEST_F(ServiceMemoryBudgetTest, PrefillAndDecodeStopAtTheBudget) {
  const v1::Geometry g = MakeGeometry(1, kQHeads, kKvHeads, kHeadDim);
  // A prompt of 400 tokens needs 400 x (2 + 2) x 16 x 4 bytes = 100 KiB of KV while staged.
  absl::StatusOr<std::string> big = CreateSession(stub(), g, MakePolicy(v1::SELECTOR_FULL));
  ASSERT_TRUE(big.ok());
  PromptLayer p{RandomNormal(400 * kQHeads * kHeadDim, 1),
                RandomNormal(400 * kKvHeads * kHeadDim, 2),
                RandomNormal(400 * kKvHeads * kHeadDim, 3)};
  EXPECT_TRUE(HasStatus(Prefill(stub(), PromptChunks(*big, g, 0, p, 50)).status(),
                        absl::StatusCode::kResourceExhausted,
                        "host memory budget exceeded: the prompt of layer 0 needs"));
  EXPECT_EQ(server().server().budget().used(), 0);  // the failed stream released its staging

  // 60 tokens fit (60 x 256 bytes of KV once committed); decoding grows it to the limit.
  absl::StatusOr<std::string> id = CreateSession(stub(), g, MakePolicy(v1::SELECTOR_FULL));
  ASSERT_TRUE(id.ok());
  p.q.resize(60 * kQHeads * kHeadDim);
  p.k.resize(60 * kKvHeads * kHeadDim);
  p.v.resize(60 * kKvHeads * kHeadDim);
  ASSERT_TRUE(Prefill(stub(), PromptChunks(*id, g, 0, p, 60)).ok());
  DecodeClient decode(stub());
  absl::Status refused;
  int64_t tokens = 60;
  for (int step = 0; step < 1000 && refused.ok(); ++step) {
    const std::vector<float> q = RandomNormal(kQHeads * kHeadDim, 10 + step);
    const std::vector<float> kv = RandomNormal(kKvHeads * kHeadDim, 5000 + step);
    v1::DecodeRequest request;
    *request.add_steps() = MakeStep(*id, g, q, kv, kv);
    absl::StatusOr<v1::DecodeResponse> reply = decode.Step(request);
    if (reply.ok()) {
      EXPECT_EQ(reply->results(0).position(), tokens);
      ++tokens;
    } else {
      refused = reply.status();
    }
  }
  EXPECT_TRUE(HasStatus(refused, absl::StatusCode::kResourceExhausted,
                        "steps[0] (session '" + *id +
                            "', layer 0): host memory budget exceeded: the new token needs"));
  EXPECT_THAT(std::string(refused.message()), HasSubstr("65536-byte budget"));
  EXPECT_LE(server().server().budget().used(), 64 << 10);
  absl::StatusOr<v1::SessionInfo> info = GetSession(stub(), *id);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->tokens(), tokens);  // the refused step appended nothing
  EXPECT_GT(tokens, 200);             // the budget, not something else, stopped it

  // Closing the session returns its memory: a new prompt fits again.
  grpc::ClientContext context;
  v1::CloseSessionRequest close;
  close.set_session_id(*id);
  v1::CloseSessionResponse closed;
  ASSERT_TRUE(stub().CloseSession(&context, close, &closed).ok());
  EXPECT_EQ(server().server().budget().used(), 0);
  absl::StatusOr<std::string> again = CreateSession(stub(), g, MakePolicy(v1::SELECTOR_FULL));
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(Prefill(stub(), PromptChunks(*again, g, 0, p, 60)).ok());
}

// A server whose host memory budget is kBudgetBytes.
template <int64_t kBudgetBytes>
class BudgetedServerTest : public ServerTest {
 protected:
  ServerOptions Options() const override {
    ServerOptions options;
    options.host_memory_budget_bytes = kBudgetBytes;
    return options;
  }
};

// A graph index grows as it links decoded tokens (here 32 graphs, one per query head, over a
// KV of 512 bytes a token: its state grows ~20 times faster than the KV). That growth exists
// before it is charged, so it was charged past the budget, step after step, without limit (probe
// 23: a tenant held 317 % of its share, 158 % of the server's budget, and other tenants were
// refused). Now a session past its budget by such growth takes no more steps until memory is
// freed (its refused step appends nothing), unless its max_tokens set the growth aside: then it
// decodes to max_tokens within what it was given.
using SelectorGrowthBudgetTest = BudgetedServerTest<4 << 20>;

v1::Policy GrowingIndexPolicy() {
  v1::Policy policy = MakePolicy(v1::SELECTOR_INDEX, 8);
  policy.mutable_index()->set_graph_scope(v1::GRAPH_SCOPE_QUERY_HEAD);
  return policy;
}

TEST_F(SelectorGrowthBudgetTest, ASessionPastTheBudgetByItsSelectorsGrowthStepsNoMore) {
  const v1::Geometry g = MakeGeometry(1, 32, 1, 64);
  // A bystander: a `full` session whose KV has room for its next tokens.
  ReferenceSession bystander_ref(g, 300, 6);
  absl::StatusOr<std::string> bystander = CreateSession(stub(), g, MakePolicy(v1::SELECTOR_FULL));
  ASSERT_TRUE(bystander.ok()) << bystander.status();
  ASSERT_TRUE(Prefill(stub(), bystander_ref.InterleavedPrompt(*bystander, 300)).ok());
  ReferenceSession ref(g, 300, 7);
  absl::StatusOr<std::string> id = CreateSession(stub(), g, GrowingIndexPolicy());
  ASSERT_TRUE(id.ok()) << id.status();
  ASSERT_TRUE(Prefill(stub(), ref.InterleavedPrompt(*id, 300)).ok());
  MemoryBudget& budget = const_cast<MemoryBudget&>(server().server().budget());
  DecodeClient client(stub());
  absl::Status refused;
  int64_t most_used = 0;
  int steps = 0;
  for (; steps < 20000; ++steps) {
    v1::DecodeRequest request;
    *request.add_steps() = ref.Step(*id, ref.MakeToken(1000 + steps));
    refused = client.Step(request).status();
    most_used = std::max(most_used, budget.used());
    if (!refused.ok()) break;
  }
  ASSERT_FALSE(refused.ok()) << "the graph grew to " << most_used << " bytes unrefused";
  EXPECT_TRUE(HasStatus(refused, absl::StatusCode::kResourceExhausted,
                        "host memory budget exceeded: "));
  EXPECT_THAT(refused.message(), HasSubstr("the selector state this session's decoding grows"));
  // Past the budget by one step's growth at most (a graph's arrays doubling once), not by every
  // step's.
  EXPECT_LT(most_used, 2 * budget.limit()) << steps << " steps";
  absl::StatusOr<v1::SessionInfo> before = GetSession(stub(), *id);
  ASSERT_TRUE(before.ok());
  v1::DecodeRequest again;
  *again.add_steps() = ref.Step(*id, ref.MakeToken(99));
  EXPECT_EQ(client.Step(again).status().code(), absl::StatusCode::kResourceExhausted);
  absl::StatusOr<v1::SessionInfo> after = GetSession(stub(), *id);
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->tokens(), before->tokens()) << "a refused step appends nothing";
  // The growth is that session's: the bystander, within its own memory, still steps (the
  // refusal once reached every session that announced nothing; review 21).
  v1::DecodeRequest bystander_step;
  *bystander_step.add_steps() = bystander_ref.Step(*bystander, bystander_ref.MakeToken(5));
  DecodeClient bystander_client(stub());
  EXPECT_TRUE(bystander_client.Step(bystander_step).ok());
  ASSERT_TRUE(testing::CloseSession(stub(), *id).ok());
  ASSERT_TRUE(testing::CloseSession(stub(), *bystander).ok());
  EXPECT_EQ(budget.used(), 0);
}

using AnnouncedGrowthBudgetTest = BudgetedServerTest<256 << 20>;

TEST_F(AnnouncedGrowthBudgetTest, MaxTokensSetsTheSelectorsGrowthAside) {
  const v1::Geometry g = MakeGeometry(1, 32, 1, 64);
  constexpr int64_t kMaxTokens = 1500;
  ReferenceSession ref(g, 300, 8);
  v1::CreateSessionRequest create;
  *create.mutable_geometry() = g;
  *create.mutable_policy() = GrowingIndexPolicy();
  create.set_max_tokens(kMaxTokens);
  v1::CreateSessionResponse created;
  grpc::ClientContext context;
  ASSERT_TRUE(stub().CreateSession(&context, create, &created).ok());
  const std::string id = created.session_id();
  const MemoryBudget& budget = server().server().budget();
  const int64_t set_aside = budget.used();
  // The KV for 1500 tokens (768 KB) and what its graphs may grow to.
  EXPECT_GT(set_aside, 4 * kMaxTokens * 64 * 4 * 2);
  ASSERT_TRUE(Prefill(stub(), ref.InterleavedPrompt(id, 300)).ok());
  EXPECT_EQ(budget.used(), set_aside) << "the prompt and its graphs drew on the set-aside";
  DecodeClient client(stub());
  for (int64_t step = 300; step < kMaxTokens; ++step) {
    v1::DecodeRequest request;
    *request.add_steps() = ref.Step(id, ref.MakeToken(step));
    ASSERT_TRUE(client.Step(request).ok()) << "step " << step;
    ASSERT_EQ(budget.used(), set_aside) << "step " << step << ": held past what it announced";
  }
  absl::StatusOr<v1::SessionInfo> info = GetSession(stub(), id);
  ASSERT_TRUE(info.ok());
  EXPECT_GT(info->selector_bytes(), 20 * kMaxTokens * 64) << "the graphs grew";
  ASSERT_TRUE(testing::CloseSession(stub(), id).ok());
  EXPECT_EQ(budget.used(), 0);
}

// Room for 64 tokens' prompt (1 KiB a token of f32 KV with 2 KV heads of 64 dims: the cpu
// placement's) and their queries' window, not all of their queries too.
using ServiceQueryStagingTest = BudgetedServerTest<112 << 10>;

// A prompt's queries are staged only as far as the selector's build reads them: a 64-token
// prompt whose KV takes 64 KiB (f32 on the cpu placement) fits the 112 KiB budget with its
// queries sent (each chunk's are checked, and dropped beyond the last ones the build reads:
// ReTopK's 8 seeds here), where staging them all takes 128 KiB (probe 4: a tiered bf16 session
// of 144 MiB peaked at 720 MiB during its prefill). The graph index, built from every query,
// stages them all, and such a prompt does not fit. (bf16 and 64 dims: what a GPU's tiered
// placement serves.)
TEST_F(ServiceQueryStagingTest, APromptsQueriesAreStagedOnlyWhereTheBuildReadsThem) {
  constexpr int kDim = 64;
  const v1::Geometry g = MakeGeometry(1, kQHeads, kKvHeads, kDim, v1::DTYPE_BF16);
  constexpr int kTokens = 64;
  const PromptLayer p{RandomNormal(kTokens * kQHeads * kDim, 1),
                      RandomNormal(kTokens * kKvHeads * kDim, 2),
                      RandomNormal(kTokens * kKvHeads * kDim, 3)};
  struct Case {
    v1::Placement placement;
    v1::Selector selector;
    bool fits;
  };
  for (const Case& c : {Case{v1::PLACEMENT_CPU, v1::SELECTOR_FULL, true},
                        Case{v1::PLACEMENT_CPU, v1::SELECTOR_EXACT_TOPK, true},
                        Case{v1::PLACEMENT_TIERED, v1::SELECTOR_EXACT_TOPK, true},
                        Case{v1::PLACEMENT_TIERED, v1::SELECTOR_STREAMING, true},
                        Case{v1::PLACEMENT_CPU, v1::SELECTOR_RETOPK, true},
                        Case{v1::PLACEMENT_CPU, v1::SELECTOR_INDEX, false}}) {
    const std::string name =
        absl::StrCat(v1::Placement_Name(c.placement), " ", v1::Selector_Name(c.selector));
    v1::CreateSessionRequest request;
    *request.mutable_geometry() = g;
    *request.mutable_policy() = MakePolicy(c.selector, 8, 4, 8);
    request.mutable_policy()->set_placement(c.placement);
    if (c.selector == v1::SELECTOR_RETOPK) {
      request.mutable_policy()->mutable_retopk()->set_cache_capacity(8);
    }
    // The KV staged in its final allocation, without slack; not for the graph index, whose
    // state's bound at 64 tokens beside that KV is more than the budget (CreateSession refuses
    // a policy that could never fit): its prompt's queries alone are refused here.
    if (c.selector != v1::SELECTOR_INDEX) request.set_max_tokens(kTokens);
    v1::CreateSessionResponse response;
    grpc::ClientContext create_context;
    const grpc::Status created = stub().CreateSession(&create_context, request, &response);
    ASSERT_TRUE(created.ok()) << name << ": " << created.error_message();
    const std::string* id = &response.session_id();
    const absl::Status prefilled = Prefill(stub(), PromptChunks(*id, g, 0, p, 8)).status();
    if (c.fits) {
      ASSERT_TRUE(prefilled.ok()) << name << ": " << prefilled;
      absl::StatusOr<v1::SessionInfo> info = GetSession(stub(), *id);
      ASSERT_TRUE(info.ok()) << info.status();
      EXPECT_EQ(info->tokens(), kTokens) << name;
    } else {
      EXPECT_TRUE(HasStatus(prefilled, absl::StatusCode::kResourceExhausted,
                            "host memory budget exceeded: the prompt of layer 0 needs"))
          << name << ": " << prefilled;
    }
    ASSERT_TRUE(testing::CloseSession(stub(), *id).ok());
    EXPECT_EQ(server().server().budget().used(), 0) << name;
  }
}

// Room for a small tiered shortlist session: its build holds the 128 KiB of codebooks (2 KV
// heads of 64 dims) twice (the state reserved for the build, then what the build charges) beside
// the prompt.
using ServiceShortlistBudgetTest = BudgetedServerTest<1 << 20>;

// A tiered session's per-step shortlist lists (a query head's N ids) are host memory it holds:
// counted in the state a prefill must fit, so that a shortlist of 2^16 is refused by the budget
// instead of allocating 1 MiB a layer unseen (probe 4: 16 layers of shortlist 2^20 took 2 GiB
// past a 50 MB budget, GetSession saying 0.46 MB); at CreateSession, as more than the whole
// budget could ever hold.
TEST_F(ServiceShortlistBudgetTest, ATieredShortlistsListsAreCountedInItsState) {
  constexpr int kDim = 64;
  const v1::Geometry g = MakeGeometry(1, kQHeads, kKvHeads, kDim, v1::DTYPE_BF16);
  const PromptLayer p{RandomNormal(kPrompt * kQHeads * kDim, 1),
                      RandomNormal(kPrompt * kKvHeads * kDim, 2),
                      RandomNormal(kPrompt * kKvHeads * kDim, 3)};
  for (const int shortlist : {1 << 16, 64}) {
    v1::Policy policy = MakePolicy(v1::SELECTOR_INDEX, 8, 4, 8);
    policy.set_placement(v1::PLACEMENT_TIERED);
    policy.mutable_index()->set_shortlist(shortlist);
    absl::StatusOr<std::string> id = CreateSession(stub(), g, policy);
    if (shortlist > 64) {
      EXPECT_TRUE(HasStatus(id.status(), absl::StatusCode::kResourceExhausted,
                            "host memory budget exceeded: the index selector state of 1 layers"))
          << id.status();
      EXPECT_EQ(server().server().budget().used(), 0);
      continue;
    }
    ASSERT_TRUE(id.ok()) << id.status();
    EXPECT_TRUE(Prefill(stub(), PromptChunks(*id, g, 0, p, 10)).ok());
    absl::StatusOr<v1::SessionInfo> info = GetSession(stub(), *id);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_GE(info->selector_bytes(), int64_t{kQHeads} * (shortlist + 2) * 4);
    ASSERT_TRUE(testing::CloseSession(stub(), *id).ok());
    EXPECT_EQ(server().server().budget().used(), 0) << shortlist;
  }
}

}  // namespace
}  // namespace kvrecall
