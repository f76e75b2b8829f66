// The server's limits (issue 14), each on a real server on loopback: --max_sessions,
// --max_context_tokens, --session_idle_ttl_seconds, deadlines on every kind of call, and the
// prompt of a cancelled Prefill freed at once. Every limit refuses before allocating, with
// RESOURCE_EXHAUSTED naming the limit and its value, counted by the metrics.
#include <atomic>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/functional/function_ref.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/host_memory.h"
#include "server/kv_store.h"
#include "server/prefill.h"
#include "tests/server_fixture.h"
#include "tests/test_util.h"

namespace kvrecall {
namespace {

using ::kvrecall::testing::CreateSession;
using ::kvrecall::testing::DecodeClient;
using ::kvrecall::testing::FromGrpc;
using ::kvrecall::testing::GetSession;
using ::kvrecall::testing::HasStatus;
using ::kvrecall::testing::MakeGeometry;
using ::kvrecall::testing::MakePolicy;
using ::kvrecall::testing::MakeStep;
using ::kvrecall::testing::Within;
using ::kvrecall::testing::Prefill;
using ::kvrecall::testing::PromptChunks;
using ::kvrecall::testing::RandomPromptOf;
using ::kvrecall::testing::RandomNormal;
using ::kvrecall::testing::RefusalsCounted;
using ::kvrecall::testing::SeriesValue;
using ::kvrecall::testing::ServerTest;
using ::testing::HasSubstr;

constexpr int kQHeads = 4;
constexpr int kKvHeads = 2;
constexpr int kHeadDim = 16;

v1::Geometry SmallGeometry(int layers = 1) {
  return MakeGeometry(layers, kQHeads, kKvHeads, kHeadDim);
}

v1::DecodeRequest OneStep(const std::string& id, uint64_t seed, int layer = 0) {
  const v1::Geometry g = SmallGeometry();
  v1::DecodeRequest request;
  request.set_layer(layer);
  *request.add_steps() = MakeStep(id, g, RandomNormal(kQHeads * kHeadDim, seed),
                                  RandomNormal(kKvHeads * kHeadDim, seed + 1),
                                  RandomNormal(kKvHeads * kHeadDim, seed + 2));
  return request;
}

class LimitsTest : public ServerTest {
 protected:
  ServerOptions Options() const override {
    ServerOptions options;
    options.limits = limits_;
    options.worker_threads = 2;
    return options;
  }
  // A session of SmallGeometry() with a committed prompt of `tokens` tokens.
  std::string PrefilledSession(int64_t tokens) {
    const v1::Geometry g = SmallGeometry();
    absl::StatusOr<std::string> id = CreateSession(stub(), g, MakePolicy(v1::SELECTOR_FULL));
    EXPECT_TRUE(id.ok()) << id.status();
    if (!id.ok()) return "";
    const absl::StatusOr<v1::PrefillResponse> prefilled =
        Prefill(stub(), PromptChunks(*id, g, 0, RandomPromptOf(g, tokens, 10), 8));
    EXPECT_TRUE(prefilled.ok()) << prefilled.status();
    return *id;
  }
  RunningServer& running() { return server().server(); }
  // CreateSession of a `full` session announcing `max_tokens`: its status.
  absl::Status CreateAnnouncing(const v1::Geometry& geometry, int64_t max_tokens) {
    v1::CreateSessionRequest request;
    *request.mutable_geometry() = geometry;
    *request.mutable_policy() = MakePolicy(v1::SELECTOR_FULL);
    request.set_max_tokens(max_tokens);
    v1::CreateSessionResponse response;
    grpc::ClientContext context;
    return FromGrpc(stub().CreateSession(&context, request, &response));
  }

  SessionLimits limits_;
};

// ---------------------------------------------------------------------------------------------

class MaxSessionsTest : public LimitsTest {
 protected:
  MaxSessionsTest() { limits_.max_sessions = 2; }
};

TEST_F(MaxSessionsTest, CreateSessionBeyondTheLimitIsRefusedBeforeAllocating) {
  const v1::Geometry g = SmallGeometry();
  absl::StatusOr<std::string> first = CreateSession(stub(), g, MakePolicy(v1::SELECTOR_FULL));
  ASSERT_TRUE(first.ok()) << first.status();
  const std::string second = PrefilledSession(16);
  const int64_t held = running().budget().used();

  // A third, announcing a large context: refused before anything is set aside.
  v1::CreateSessionRequest request;
  *request.mutable_geometry() = g;
  *request.mutable_policy() = MakePolicy(v1::SELECTOR_FULL);
  request.set_max_tokens(1 << 20);
  v1::CreateSessionResponse response;
  grpc::ClientContext context;
  const absl::Status refused = FromGrpc(stub().CreateSession(&context, request, &response));
  EXPECT_TRUE(HasStatus(refused, absl::StatusCode::kResourceExhausted, "--max_sessions=2"))
      << refused;
  EXPECT_THAT(refused.message(), HasSubstr("holds 2 sessions"));
  EXPECT_EQ(running().budget().used(), held);
  EXPECT_EQ(running().sessions().List().size(), 2u);
  EXPECT_EQ(RefusalsCounted(running(), "max_sessions"), 1);

  // Closing one makes room.
  grpc::ClientContext close_context;
  v1::CloseSessionRequest close;
  close.set_session_id(*first);
  v1::CloseSessionResponse closed;
  ASSERT_TRUE(stub().CloseSession(&close_context, close, &closed).ok());
  EXPECT_TRUE(CreateSession(stub(), g, MakePolicy(v1::SELECTOR_FULL)).ok());
  EXPECT_TRUE(HasStatus(CreateSession(stub(), g, MakePolicy(v1::SELECTOR_FULL)).status(),
                        absl::StatusCode::kResourceExhausted, "--max_sessions=2"));
  EXPECT_EQ(RefusalsCounted(running(), "max_sessions"), 2);
}

TEST_F(MaxSessionsTest, ConcurrentCreatesNeverExceedTheLimit) {
  // Admissions in progress hold their slot: of 16 racing creates, exactly 2 succeed.
  std::vector<absl::Status> statuses(16);
  {
    std::vector<std::jthread> threads;
    for (absl::Status& status : statuses) {
      threads.emplace_back([&] {
        status = CreateSession(stub(), SmallGeometry(), MakePolicy(v1::SELECTOR_FULL)).status();
      });
    }
  }
  int ok = 0;
  for (const absl::Status& status : statuses) {
    if (status.ok()) {
      ++ok;
    } else {
      EXPECT_TRUE(HasStatus(status, absl::StatusCode::kResourceExhausted, "--max_sessions=2"));
    }
  }
  EXPECT_EQ(ok, 2);
  EXPECT_EQ(running().sessions().List().size(), 2u);
}

// ---------------------------------------------------------------------------------------------

class MaxContextTokensTest : public LimitsTest {
 protected:
  MaxContextTokensTest() { limits_.max_context_tokens = 32; }
};

TEST_F(MaxContextTokensTest, CreateSessionAnnouncingMoreIsRefused) {
  const absl::Status refused = CreateAnnouncing(SmallGeometry(), 33);
  EXPECT_TRUE(HasStatus(refused, absl::StatusCode::kResourceExhausted, "--max_context_tokens=32"))
      << refused;
  EXPECT_THAT(refused.message(), HasSubstr("max_tokens"));
  EXPECT_TRUE(running().sessions().List().empty());
  EXPECT_EQ(running().budget().used(), 0);
  EXPECT_EQ(RefusalsCounted(running(), "max_context_tokens"), 1);

  EXPECT_TRUE(CreateAnnouncing(SmallGeometry(), 32).ok());
  // Its layers know the limit: work that pays off only past it is not started (a tiered
  // layer's codes learned again, server/backends/codes_learning.h).
  const std::vector<std::shared_ptr<Session>> sessions = running().sessions().List();
  ASSERT_EQ(sessions.size(), 1u);
  EXPECT_EQ(sessions[0]->layer_config().max_layer_tokens, 32);
}

TEST_F(MaxContextTokensTest, PrefillPastTheLimitCommitsNothing) {
  const v1::Geometry g = SmallGeometry();
  absl::StatusOr<std::string> id = CreateSession(stub(), g, MakePolicy(v1::SELECTOR_FULL));
  ASSERT_TRUE(id.ok()) << id.status();
  // Chunks of 8: chunks[4] would take the layer from 32 to 40 tokens.
  const absl::StatusOr<v1::PrefillResponse> refused =
      Prefill(stub(), PromptChunks(*id, g, 0, RandomPromptOf(g, 40, 3), 8));
  EXPECT_TRUE(HasStatus(refused.status(), absl::StatusCode::kResourceExhausted,
                        "--max_context_tokens=32"))
      << refused.status();
  EXPECT_THAT(refused.status().message(), HasSubstr("chunks[4]"));
  EXPECT_THAT(refused.status().message(), HasSubstr("would hold 40 tokens"));
  absl::StatusOr<v1::SessionInfo> info = GetSession(stub(), *id);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->layers_prefilled(), 0);
  EXPECT_EQ(info->tokens(), 0);
  EXPECT_EQ(RefusalsCounted(running(), "max_context_tokens"), 1);

  // A prompt at the limit is fine.
  EXPECT_TRUE(Prefill(stub(), PromptChunks(*id, g, 0, RandomPromptOf(g, 32, 3), 8)).ok());
}

TEST_F(MaxContextTokensTest, DecodeStepPastTheLimitIsRefusedAndAppendsNothing) {
  const std::string id = PrefilledSession(30);
  DecodeClient decode(stub());
  for (int i = 0; i < 2; ++i) {
    absl::StatusOr<v1::DecodeResponse> step = decode.Step(OneStep(id, 100 + i));
    ASSERT_TRUE(step.ok()) << step.status();
    EXPECT_EQ(step->results(0).position(), 30 + i);
  }
  const absl::StatusOr<v1::DecodeResponse> refused = decode.Step(OneStep(id, 200));
  EXPECT_TRUE(HasStatus(refused.status(), absl::StatusCode::kResourceExhausted,
                        "--max_context_tokens=32"))
      << refused.status();
  EXPECT_THAT(refused.status().message(),
              HasSubstr(absl::StrCat("steps[0]: layer 0 of session '", id, "' would hold 33")));
  absl::StatusOr<v1::SessionInfo> info = GetSession(stub(), id);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->tokens(), 32);
  EXPECT_EQ(RefusalsCounted(running(), "max_context_tokens"), 1);
}

// --max_context_tokens is the most a session's layers will hold, so each host KV array reserves
// address space for that many tokens whole (MostRows::kSet), past the 1 GiB a server without it
// reserves an array: a 16-token prompt's two arrays hold 2 x 16M rows of 128 bytes, 4 GiB.
class ContextReservationTest : public LimitsTest {
 protected:
  ContextReservationTest() { limits_.max_context_tokens = kTokens; }
  static constexpr int64_t kTokens = int64_t{16} << 20;
};

TEST_F(ContextReservationTest, EachHostKvArrayReservesTheServersMostTokens) {
  constexpr int64_t kRowBytes = kKvHeads * kHeadDim * sizeof(float);  // cpu placement: f32
  if (static_cast<int64_t>(HostAddressSpaceBound()) / kHostRowsReserveShares <
      kTokens * kRowBytes) {
    GTEST_SKIP() << "the process's bound on reservations is under 8 TiB (an address-space "
                    "limit): an array's share is smaller than the length";
  }
  const size_t held = HostAddressSpaceHeld();
  const std::string id = PrefilledSession(16);
  ASSERT_FALSE(id.empty());
  const auto reserved = static_cast<int64_t>(HostAddressSpaceHeld() - held);
  EXPECT_GE(reserved, 2 * kTokens * kRowBytes) << "the ceiling's 1 GiB an array, not the length";
  EXPECT_LT(reserved, 2 * kTokens * kRowBytes + (int64_t{64} << 20));
  // What the operator sees of it.
  const std::string metrics = running().metrics().TextFormat();
  EXPECT_EQ(SeriesValue(metrics, "kvrecall_host_address_space_bound_bytes"),
            static_cast<double>(HostAddressSpaceBound()));
  EXPECT_GE(SeriesValue(metrics, "kvrecall_host_address_space_reserved_bytes"),
            static_cast<double>(reserved));
}

// ---------------------------------------------------------------------------------------------

class SessionIdleTtlTest : public LimitsTest {
 protected:
  SessionIdleTtlTest() { limits_.session_idle_ttl = absl::Milliseconds(600); }
};

TEST_F(SessionIdleTtlTest, IdleSessionsExpireAndTheirMemoryIsFreed) {
  const std::string idle = PrefilledSession(64);
  const int64_t one_session = running().budget().used();
  ASSERT_GT(one_session, 0);
  const std::string busy = PrefilledSession(64);
  ASSERT_EQ(running().budget().used(), 2 * one_session);

  // `busy` is used every 100 ms (decode steps and GetSession), `idle` never again.
  DecodeClient decode(stub());
  const absl::Time until = absl::Now() + absl::Seconds(2);
  for (int i = 0; absl::Now() < until; ++i) {
    if (i % 2 == 0) {
      ASSERT_TRUE(decode.Step(OneStep(busy, 10 + i)).ok());
    } else {
      ASSERT_TRUE(GetSession(stub(), busy).ok());
    }
    absl::SleepFor(absl::Milliseconds(100));
  }
  const absl::Status expired = GetSession(stub(), idle).status();
  EXPECT_TRUE(HasStatus(expired, absl::StatusCode::kNotFound, "expired")) << expired;
  EXPECT_THAT(expired.message(), HasSubstr("--session_idle_ttl_seconds=0.6"));
  EXPECT_THAT(expired.message(), HasSubstr(idle));
  // Its memory went back to the budget; the session in use is untouched (what it holds now:
  // its decoding may have grown its KV ahead of need).
  absl::StatusOr<v1::SessionInfo> busy_info = GetSession(stub(), busy);
  ASSERT_TRUE(busy_info.ok()) << busy_info.status();
  EXPECT_GE(busy_info->host_budget_bytes(), one_session);
  EXPECT_EQ(running().budget().used(), busy_info->host_budget_bytes());
  EXPECT_EQ(running().sessions().List().size(), 1u);

  // Every call naming it hears why; a session that never existed does not "expire".
  const absl::StatusOr<v1::DecodeResponse> step = decode.Step(OneStep(idle, 99));
  EXPECT_TRUE(HasStatus(step.status(), absl::StatusCode::kNotFound, "expired")) << step.status();
  v1::CloseSessionRequest close;
  close.set_session_id(idle);
  v1::CloseSessionResponse closed;
  grpc::ClientContext close_context;
  EXPECT_TRUE(HasStatus(FromGrpc(stub().CloseSession(&close_context, close, &closed)),
                        absl::StatusCode::kNotFound, "expired"));
  const absl::Status unknown = GetSession(stub(), "s-0000000000000000").status();
  EXPECT_TRUE(HasStatus(unknown, absl::StatusCode::kNotFound, "no session"));
  EXPECT_FALSE(absl::StrContains(unknown.message(), "expired"));
}

// An expired session's request_id is forgotten with it: the same request makes a new session
// (CreateSessionRequest.request_id: "while a session ... is open").
TEST_F(SessionIdleTtlTest, AnExpiredSessionsRequestIdMakesANewSession) {
  v1::CreateSessionRequest request;
  *request.mutable_geometry() = SmallGeometry();
  *request.mutable_policy() = MakePolicy(v1::SELECTOR_FULL);
  request.set_request_id("expires");
  auto create = [&] {
    grpc::ClientContext context;
    v1::CreateSessionResponse response;
    EXPECT_TRUE(stub().CreateSession(&context, request, &response).ok());
    return response.session_id();
  };
  const std::string first = create();
  EXPECT_EQ(create(), first);
  EXPECT_TRUE(Within(absl::Seconds(10), [&] { return running().sessions().List().empty(); }));
  const std::string second = create();
  EXPECT_NE(second, first);
  EXPECT_TRUE(GetSession(stub(), second).ok());
}

TEST_F(SessionIdleTtlTest, APromptStreamedSlowlyKeepsItsSessionAlive) {
  // Every chunk counts as use: a Prefill stream longer than the TTL, whose chunks come more
  // often than it, commits.
  const v1::Geometry g = SmallGeometry();
  absl::StatusOr<std::string> id = CreateSession(stub(), g, MakePolicy(v1::SELECTOR_FULL));
  ASSERT_TRUE(id.ok()) << id.status();
  grpc::ClientContext context;
  v1::PrefillResponse response;
  auto writer = stub().Prefill(&context, &response);
  for (const v1::PrefillChunk& chunk : PromptChunks(*id, g, 0, RandomPromptOf(g, 64, 5), 4)) {
    ASSERT_TRUE(writer->Write(chunk));
    absl::SleepFor(absl::Milliseconds(100));  // 16 chunks: 1.6 s, well past the TTL
  }
  writer->WritesDone();
  const grpc::Status status = writer->Finish();
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.tokens(), 64);
}

TEST_F(SessionIdleTtlTest, APrefillStreamPausedPastTheTtlEndsAndFreesItsStaging) {
  // A stream whose chunks stop for longer than the TTL: its session expires, and the stream
  // ends then, its staged chunk freed, without waiting for the client's next chunk (probe 7,
  // F2: it held the memory of a session that no longer existed); it hears why.
  const v1::Geometry g = SmallGeometry();
  absl::StatusOr<std::string> id = CreateSession(stub(), g, MakePolicy(v1::SELECTOR_FULL));
  ASSERT_TRUE(id.ok()) << id.status();
  const std::vector<v1::PrefillChunk> chunks = PromptChunks(*id, g, 0, RandomPromptOf(g, 16, 6), 8);
  grpc::ClientContext context;
  v1::PrefillResponse response;
  auto writer = stub().Prefill(&context, &response);
  ASSERT_TRUE(writer->Write(chunks[0]));
  ASSERT_TRUE(Within(absl::Milliseconds(500), [&] { return running().budget().used() > 0; }))
      << "the first chunk staged";
  // The TTL is 600 ms; the client writes nothing meanwhile.
  EXPECT_TRUE(Within(absl::Seconds(5), [&] { return running().budget().used() == 0; }))
      << "the staged chunk freed at the expiry: " << running().budget().used() << " bytes held";
  writer->Write(chunks[1]);  // the stream has ended: the write fails or is dropped
  writer->WritesDone();
  const absl::Status status = FromGrpc(writer->Finish());
  EXPECT_TRUE(HasStatus(status, absl::StatusCode::kNotFound, "expired")) << status;
  EXPECT_THAT(status.message(), HasSubstr("--session_idle_ttl_seconds=0.6"));
  EXPECT_EQ(running().budget().used(), 0);
}

// A commit whose builds outlast the TTL (here a hook holds it 1.5 s before they start; the TTL
// is 600 ms): the session is in use meanwhile and does not expire (probe 8: a 24K-token graph
// build lost its session, "no call used it", after the client had sent everything).
class SlowCommitTtlTest : public SessionIdleTtlTest {
 protected:
  ServerOptions Options() const override {
    ServerOptions options = SessionIdleTtlTest::Options();
    options.service_test_hooks.before_prefill_commit = [] {
      absl::SleepFor(absl::Milliseconds(1500));
    };
    return options;
  }
};

TEST_F(SlowCommitTtlTest, ASessionDoesNotExpireWhileItsPromptIsCommitted) {
  const v1::Geometry g = SmallGeometry();
  absl::StatusOr<std::string> id = CreateSession(stub(), g, MakePolicy(v1::SELECTOR_FULL));
  ASSERT_TRUE(id.ok()) << id.status();
  absl::StatusOr<v1::PrefillResponse> committed =
      Prefill(stub(), PromptChunks(*id, g, 0, RandomPromptOf(g, 32, 9), 8));
  ASSERT_TRUE(committed.ok()) << committed.status();
  EXPECT_EQ(committed->tokens(), 32);
  // The commit's end counts as a use: the session is there, then expires as any other.
  EXPECT_TRUE(GetSession(stub(), *id).ok());
  EXPECT_TRUE(Within(absl::Seconds(5), [&] { return running().sessions().List().empty(); }));
}

// A Prefill cancelled after its commit installed the layers, before the call was answered (a
// hook holds the run there until the call's OnDone has run): the run that installed them takes
// them back, so the client, told CANCELLED, finds nothing committed and nothing held, and the
// session takes its prompt again (review 17b, 1: OnDone and the run raced for what it installed).
class PrefillTakenBackTest : public LimitsTest {
 protected:
  struct Gate {
    std::atomic<bool> armed{true};  // the first commit only
    absl::Notification entered, release;
  };
  ServerOptions Options() const override {
    ServerOptions options = LimitsTest::Options();
    options.service_test_hooks.after_prefill_install = [gate = gate_] {
      if (!gate->armed.exchange(false)) return;
      gate->entered.Notify();
      gate->release.WaitForNotification();
    };
    return options;
  }
  // Streams `chunks` as one Prefill whose commit the hook holds after its install, runs
  // `while_held`, cancels the call, waits until its OnDone has run, then lets the run go on.
  void CancelAfterTheInstall(const std::vector<v1::PrefillChunk>& chunks,
                             const std::function<void()>& while_held = [] {}) {
    // (Released however this returns: a failed ASSERT would leave the build thread held, and
    // the server's shutdown waiting for it.)
    const absl::Cleanup release = [this] {
      if (!gate_->release.HasBeenNotified()) gate_->release.Notify();
    };
    grpc::ClientContext context;
    v1::PrefillResponse response;
    auto writer = stub().Prefill(&context, &response);
    for (const v1::PrefillChunk& chunk : chunks) ASSERT_TRUE(writer->Write(chunk));
    ASSERT_TRUE(writer->WritesDone());
    ASSERT_TRUE(gate_->entered.WaitForNotificationWithTimeout(absl::Seconds(10)));
    while_held();
    context.TryCancel();
    EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::CANCELLED);
    // The call is done (its OnDone ran) while the run that installed the layers holds them.
    ASSERT_TRUE(Within(absl::Seconds(5), [&] { return running().service().open_streams() == 0; }));
  }
  std::shared_ptr<Gate> gate_ = std::make_shared<Gate>();
};

TEST_F(PrefillTakenBackTest, ACommitCancelledBeforeItsAnswerIsTakenBack) {
  const v1::Geometry g = SmallGeometry();
  absl::StatusOr<std::string> id = CreateSession(stub(), g, MakePolicy(v1::SELECTOR_FULL));
  ASSERT_TRUE(id.ok()) << id.status();
  const std::vector<v1::PrefillChunk> chunks = PromptChunks(*id, g, 0, RandomPromptOf(g, 16, 3), 8);
  absl::StatusOr<v1::SessionInfo> info;
  CancelAfterTheInstall(chunks, [&] {
    info = GetSession(stub(), *id);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->layers_prefilled(), 1) << "installed, not answered yet";
  });
  // (Waited for whole: the layers leave the session, then their memory is freed, unlocked.)
  EXPECT_TRUE(Within(absl::Seconds(5), [&] {
    info = GetSession(stub(), *id);
    return info.ok() && info->layers_prefilled() == 0 && info->tokens() == 0 &&
           info->host_bytes() == 0 && running().budget().used() == 0;
  })) << "the installed layers were kept: " << running().budget().used() << " bytes held";
  absl::StatusOr<v1::PrefillResponse> again = Prefill(stub(), chunks);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->tokens(), 16);
}

// A layer taken back leaves the layers an earlier Prefill committed, and their prompt length;
// the layer takes its prompt again, of that length.
TEST_F(PrefillTakenBackTest, ATakenBackLayerLeavesTheOthersAndTheirLength) {
  gate_->armed = false;  // layer 0's Prefill passes
  const v1::Geometry g = SmallGeometry(2);
  absl::StatusOr<std::string> id = CreateSession(stub(), g, MakePolicy(v1::SELECTOR_FULL));
  ASSERT_TRUE(id.ok()) << id.status();
  ASSERT_TRUE(Prefill(stub(), PromptChunks(*id, g, 0, RandomPromptOf(g, 16, 5), 8)).ok());
  const int64_t layer0_bytes = running().budget().used();
  gate_->armed = true;
  const std::vector<v1::PrefillChunk> chunks = PromptChunks(*id, g, 1, RandomPromptOf(g, 16, 6), 8);
  CancelAfterTheInstall(chunks);
  absl::StatusOr<v1::SessionInfo> info;
  EXPECT_TRUE(Within(absl::Seconds(5), [&] {
    info = GetSession(stub(), *id);
    return info.ok() && info->layers_prefilled() == 1 && running().budget().used() == layer0_bytes;
  })) << "layer 1 kept: " << running().budget().used() << " bytes held";
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->tokens(), 16) << "layer 0's prompt length";
  // Layer 1 takes a prompt of that length again (another length is refused, as ever).
  EXPECT_TRUE(HasStatus(
      Prefill(stub(), PromptChunks(*id, g, 1, RandomPromptOf(g, 12, 7), 8)).status(),
      absl::StatusCode::kInvalidArgument, "every layer's prompt must have one length"));
  ASSERT_TRUE(Prefill(stub(), chunks).ok());
  DecodeClient decode(stub());
  for (int layer = 0; layer < 2; ++layer) {
    EXPECT_TRUE(decode.Step(OneStep(*id, 30 + layer, layer)).ok()) << layer;
  }
}

// The other side of the take-back: a commit answered OK whose OK gRPC then lost (the call
// cancelled before the status went out: a chunk past --max_message_mb, or a client gone) is
// taken back when the call is done (OnDone), its layers freed on the frees queue. gRPC gives
// that ordering only by chance (OversizeCallCountTest reaches it about one run in five), so a
// hook says the answer was lost. The session, with and without an announced max_tokens,
// holds no layer and no prompt length, keeps exactly its set-aside, and takes its prompt again
// from it.
class PrefillAnswerLostTest : public LimitsTest {
 protected:
  ServerOptions Options() const override {
    ServerOptions options = LimitsTest::Options();
    options.service_test_hooks.prefill_answer_lost = [lost = lost_] { return lost->load(); };
    return options;
  }
  std::shared_ptr<std::atomic<bool>> lost_ = std::make_shared<std::atomic<bool>>(true);
};

TEST_F(PrefillAnswerLostTest, ACommitWhoseOkWasLostIsTakenBackAtTheCallsEnd) {
  const v1::Geometry g = SmallGeometry();
  for (const int64_t announced : {0, 64}) {
    SCOPED_TRACE(absl::StrCat("max_tokens ", announced));
    v1::CreateSessionRequest request;
    *request.mutable_geometry() = g;
    *request.mutable_policy() = MakePolicy(v1::SELECTOR_FULL);
    request.set_max_tokens(announced);
    v1::CreateSessionResponse created;
    grpc::ClientContext context;
    ASSERT_TRUE(stub().CreateSession(&context, request, &created).ok());
    const std::string& id = created.session_id();
    const int64_t set_aside = running().budget().used();
    EXPECT_EQ(set_aside > 0, announced > 0);

    lost_->store(true);
    const std::vector<v1::PrefillChunk> chunks =
        PromptChunks(id, g, 0, RandomPromptOf(g, 16, 11), 8);
    ASSERT_TRUE(Prefill(stub(), chunks).ok()) << "the client heard OK; the hook says it did not";
    absl::StatusOr<v1::SessionInfo> info;
    // (Freed on the service's frees queue once taken back: waited for, or a set-aside's layers
    // would still hold it, and the next Prefill be charged to the budget beside it. The call
    // queues the free before it leaves the open streams: read in that order.)
    EXPECT_TRUE(Within(absl::Seconds(5), [&] {
      info = GetSession(stub(), id);
      return info.ok() && info->layers_prefilled() == 0 && info->tokens() == 0 &&
             running().service().open_streams() == 0 &&
             running().service().frees_in_flight() == 0 &&
             info->host_budget_bytes() == set_aside && running().budget().used() == set_aside;
    })) << "kept: " << running().budget().used() << " bytes held, " << set_aside
        << " set aside";

    lost_->store(false);
    ASSERT_TRUE(Prefill(stub(), chunks).ok());
    info = GetSession(stub(), id);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->tokens(), 16);
    if (announced > 0) {
      EXPECT_EQ(running().budget().used(), set_aside) << "drawn from the set-aside";
    }
    DecodeClient decode(stub());
    EXPECT_TRUE(decode.Step(OneStep(id, 40, 0)).ok());
    ASSERT_TRUE(testing::CloseSession(stub(), id).ok());
    ASSERT_TRUE(Within(absl::Seconds(5), [&] { return running().budget().used() == 0; }));
  }
}

// A commit whose call's deadline passed by the time it installed its layers (the builds outlast
// it; gRPC's own cancellation, its threads busy, has not come): the run takes the layers back
// and answers DEADLINE_EXCEEDED itself, rather than an OK gRPC would drop. A hook says the
// deadline passed there. The session holds nothing and takes its prompt again.
class PrefillDeadlineAtInstallTest : public LimitsTest {
 protected:
  ServerOptions Options() const override {
    ServerOptions options = LimitsTest::Options();
    options.service_test_hooks.prefill_deadline_passed_at_install = [passed = passed_] {
      return passed->load();
    };
    return options;
  }
  std::shared_ptr<std::atomic<bool>> passed_ = std::make_shared<std::atomic<bool>>(true);
};

TEST_F(PrefillDeadlineAtInstallTest, ACommitPastItsDeadlineAtTheInstallIsTakenBack) {
  const v1::Geometry g = SmallGeometry();
  absl::StatusOr<std::string> id = CreateSession(stub(), g, MakePolicy(v1::SELECTOR_FULL));
  ASSERT_TRUE(id.ok()) << id.status();
  const std::vector<v1::PrefillChunk> chunks =
      PromptChunks(*id, g, 0, RandomPromptOf(g, 16, 12), 8);
  EXPECT_TRUE(HasStatus(Prefill(stub(), chunks).status(), absl::StatusCode::kDeadlineExceeded,
                        "the call's deadline passed before the server answered it"));
  // (Taken back by the run after it answered: waited for.)
  absl::StatusOr<v1::SessionInfo> info;
  EXPECT_TRUE(Within(absl::Seconds(5), [&] {
    info = GetSession(stub(), *id);
    return info.ok() && info->layers_prefilled() == 0 && info->tokens() == 0 &&
           info->host_bytes() == 0 && running().service().open_streams() == 0 &&
           running().budget().used() == 0;
  })) << "kept: " << running().budget().used() << " bytes held";

  passed_->store(false);
  absl::StatusOr<v1::PrefillResponse> again = Prefill(stub(), chunks);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->tokens(), 16);
  DecodeClient decode(stub());
  EXPECT_TRUE(decode.Step(OneStep(*id, 41, 0)).ok());
}

TEST_F(LimitsTest, APrefillStreamWhoseSessionIsClosedEndsAndFreesItsStaging) {
  // CloseSession from another call while a Prefill stream waits for its next chunk: the
  // stream ends at once with the NOT_FOUND its next chunk would get, its staging freed.
  const v1::Geometry g = SmallGeometry();
  absl::StatusOr<std::string> id = CreateSession(stub(), g, MakePolicy(v1::SELECTOR_FULL));
  ASSERT_TRUE(id.ok()) << id.status();
  const std::vector<v1::PrefillChunk> chunks = PromptChunks(*id, g, 0, RandomPromptOf(g, 16, 7), 8);
  grpc::ClientContext context;
  v1::PrefillResponse response;
  auto writer = stub().Prefill(&context, &response);
  ASSERT_TRUE(writer->Write(chunks[0]));
  ASSERT_TRUE(Within(absl::Seconds(2), [&] { return running().budget().used() > 0; }));

  v1::CloseSessionRequest close;
  close.set_session_id(*id);
  v1::CloseSessionResponse closed;
  grpc::ClientContext close_context;
  ASSERT_TRUE(stub().CloseSession(&close_context, close, &closed).ok());
  // Freed at the close (the registry tells the service before CloseSession answers), or, when
  // the chunk's run was still finishing then, by that run as it ends.
  EXPECT_TRUE(Within(absl::Seconds(2), [&] { return running().budget().used() == 0; }))
      << running().budget().used() << " bytes held";
  writer->Write(chunks[1]);
  writer->WritesDone();
  const absl::Status status = FromGrpc(writer->Finish());
  EXPECT_TRUE(HasStatus(status, absl::StatusCode::kNotFound, "was closed")) << status;
  EXPECT_THAT(status.message(), HasSubstr(*id));
  EXPECT_FALSE(absl::StrContains(status.message(), "expired"));
}

TEST_F(LimitsTest, APrefillStreamStagesNothingMoreOnceItsSessionIsClosed) {
  // A layer already staged takes no more chunks for a closed session: PrefillStream itself
  // checks the session at every chunk (the service's ending of paused streams aside).
  const v1::Geometry g = SmallGeometry();
  absl::StatusOr<std::string> id = CreateSession(stub(), g, MakePolicy(v1::SELECTOR_FULL));
  ASSERT_TRUE(id.ok()) << id.status();
  const std::vector<v1::PrefillChunk> chunks = PromptChunks(*id, g, 0, RandomPromptOf(g, 16, 8), 8);
  PrefillStream stream(&running().sessions());
  ASSERT_TRUE(stream.Add(chunks[0], 0).ok());
  EXPECT_TRUE(stream.SessionStatus().ok());
  const int64_t staged = running().budget().used();
  ASSERT_GT(staged, 0);
  ASSERT_TRUE(running().sessions().Close(*id).ok());
  const absl::Status next = stream.Add(chunks[1], 1);
  EXPECT_TRUE(HasStatus(next, absl::StatusCode::kNotFound, "was closed")) << next;
  EXPECT_TRUE(HasStatus(stream.SessionStatus(), absl::StatusCode::kNotFound, "was closed"));
  EXPECT_EQ(running().budget().used(), staged) << "nothing more staged";
}

// ---------------------------------------------------------------------------------------------
// Deadlines: streams end at their deadline, and what they staged is freed then. (A unary
// call's deadline: HardeningTest.HugeSelectorKnobsAreRefusedAtOnce; a Prefill cancelled while
// its commit runs: HardeningTest.PrefillCancelledDuringItsCommitCommitsNothing.)

class DeadlineTest : public LimitsTest {};

TEST_F(DeadlineTest, AnIdleDecodeStreamEndsAtItsDeadline) {
  const std::string id = PrefilledSession(8);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Milliseconds(300)));
  auto stream = stub().Decode(&context);
  ASSERT_TRUE(stream->Write(OneStep(id, 1)));
  v1::DecodeResponse response;
  ASSERT_TRUE(stream->Read(&response));
  const absl::Time start = absl::Now();
  EXPECT_FALSE(stream->Read(&response));  // the stream stays idle until its deadline
  const grpc::Status status = stream->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << status.error_message();
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  // The server let go of the stream: none is open.
  const absl::Time until = absl::Now() + absl::Seconds(5);
  while (running().service().open_streams() > 0 && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(running().service().open_streams(), 0);
  absl::StatusOr<v1::SessionInfo> info = GetSession(stub(), id);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->tokens(), 9);  // the step answered before the deadline was committed
}

// Decode streams count their own calls (kvrecall_rpcs_total, when metrics are served): one
// that ends at its deadline or by the client's cancel is counted so, not OK (probe 8: the failed
// read reached the stream before gRPC's OnCancel, and 20 of 20 were counted OK).
class DecodeCallCountTest : public LimitsTest {
 protected:
  ServerOptions Options() const override {
    ServerOptions options = LimitsTest::Options();
    options.metrics_address = "127.0.0.1:0";
    return options;
  }
  // The Decode calls counted with `code` so far.
  int Counted(absl::string_view code) {
    const std::string series = absl::StrCat("kvrecall_rpcs_total{code=\"", code,
                                            "\",method=\"kvrecall.v1.KvRecall/Decode\"} ");
    const std::string text = running().metrics().TextFormat();
    const size_t at = text.find(series);
    return at == std::string::npos ? 0 : std::stoi(text.substr(at + series.size()));
  }
};

TEST_F(DecodeCallCountTest, StreamsEndedByDeadlineOrCancelAreNotCountedOk) {
  const std::string id = PrefilledSession(8);
  {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Milliseconds(300)));
    auto stream = stub().Decode(&context);
    ASSERT_TRUE(stream->Write(OneStep(id, 1)));
    v1::DecodeResponse response;
    ASSERT_TRUE(stream->Read(&response));
    EXPECT_FALSE(stream->Read(&response));
    EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  }
  {
    grpc::ClientContext context;
    auto stream = stub().Decode(&context);
    ASSERT_TRUE(stream->Write(OneStep(id, 2)));
    v1::DecodeResponse response;
    ASSERT_TRUE(stream->Read(&response));
    context.TryCancel();
    EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  {
    DecodeClient decode(stub());  // a stream the client ends cleanly
    ASSERT_TRUE(decode.Step(OneStep(id, 3)).ok());
  }
  EXPECT_TRUE(Within(absl::Seconds(5), [&] { return running().service().open_streams() == 0; }));
  // The server's deadline runs later than the client's (the request's transit, the timeout's
  // rounding), so the client's own end of its expired call may reach the server first, as a
  // cancel: the expired stream is one or the other, never OK.
  EXPECT_EQ(Counted("DEADLINE_EXCEEDED") + Counted("CANCELLED"), 2);
  EXPECT_GE(Counted("CANCELLED"), 1);
  EXPECT_EQ(Counted("OK"), 1);
}

// A request past --max_message_mb is refused by gRPC itself (the client gets
// RESOURCE_EXHAUSTED): a stream's is counted CANCELLED under its method, never OK (probe 17, 2:
// a Decode stream's failed read looked like a half-close and was counted OK). A unary call's
// never reaches the service (gRPC reads its one message before it dispatches the call), so it
// is not counted at all (the README's metrics table says so).
class OversizeCallCountTest : public DecodeCallCountTest {
 protected:
  ServerOptions Options() const override {
    ServerOptions options = DecodeCallCountTest::Options();
    options.max_message_bytes = 1 << 20;
    return options;
  }
  int Counted(absl::string_view method, absl::string_view code) {
    const std::string series = absl::StrCat("kvrecall_rpcs_total{code=\"", code,
                                            "\",method=\"kvrecall.v1.KvRecall/", method, "\"} ");
    const std::string text = running().metrics().TextFormat();
    const size_t at = text.find(series);
    return at == std::string::npos ? 0 : std::stoi(text.substr(at + series.size()));
  }
};

TEST_F(OversizeCallCountTest, RequestsPastTheMessageLimitAreCountedCancelled) {
  // (Counted from here: the metrics are the process's, and outlive a test's server.)
  std::map<std::pair<std::string, std::string>, int> before;
  for (const char* method : {"GetSession", "Prefill", "Decode"}) {
    for (const char* code : {"OK", "CANCELLED"}) before[{method, code}] = Counted(method, code);
  }
  const auto added = [&](const char* method, const char* code) {
    return Counted(method, code) - before[{method, code}];
  };
  const std::string id = PrefilledSession(8);  // one Prefill OK
  const std::string huge(2 << 20, 'x');
  {
    v1::GetSessionRequest request;
    request.set_session_id(huge);
    grpc::ClientContext context;
    v1::SessionInfo info;
    EXPECT_EQ(stub().GetSession(&context, request, &info).error_code(),
              grpc::StatusCode::RESOURCE_EXHAUSTED);
  }
  // A prompt's first chunk, then one past the limit: the client is told RESOURCE_EXHAUSTED, and
  // the first chunk alone is not committed (gRPC fails the read as a clean close fails it:
  // review 17, 1).
  const v1::Geometry g = SmallGeometry();
  absl::StatusOr<std::string> fresh = CreateSession(stub(), g, MakePolicy(v1::SELECTOR_FULL));
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  {
    grpc::ClientContext context;
    v1::PrefillResponse response;
    auto writer = stub().Prefill(&context, &response);
    std::vector<v1::PrefillChunk> chunks = PromptChunks(*fresh, g, 0, RandomPromptOf(g, 8, 4), 4);
    ASSERT_TRUE(writer->Write(chunks[0]));
    chunks[1].set_session_id(huge);
    writer->Write(chunks[1]);
    writer->WritesDone();
    EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  }
  {
    grpc::ClientContext context;
    auto stream = stub().Decode(&context);
    v1::DecodeRequest request = OneStep(id, 9);
    request.mutable_steps(0)->set_session_id(huge);
    stream->Write(request);
    stream->WritesDone();
    v1::DecodeResponse response;
    EXPECT_FALSE(stream->Read(&response));
    EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  }
  EXPECT_TRUE(Within(absl::Seconds(5), [&] {
    return added("Prefill", "CANCELLED") == 1 && added("Decode", "CANCELLED") == 1 &&
           added("Prefill", "OK") == 1;
  })) << running().metrics().TextFormat();
  EXPECT_EQ(added("Prefill", "OK"), 1) << "the first session's prompt alone";
  EXPECT_EQ(added("Decode", "OK"), 0);
  EXPECT_EQ(added("GetSession", "OK") + added("GetSession", "CANCELLED"), 0);
  // Nothing committed, and nothing held (a take-back frees the layers after it took them: waited
  // for whole).
  absl::StatusOr<v1::SessionInfo> info;
  EXPECT_TRUE(Within(absl::Seconds(5), [&] {
    info = GetSession(stub(), *fresh);
    return info.ok() && info->layers_prefilled() == 0 && info->tokens() == 0 &&
           info->host_bytes() == 0 && info->host_budget_bytes() == 0;
  })) << (info.ok() ? info->DebugString() : info.status().ToString());
  // The session takes a whole prompt afterwards.
  ASSERT_TRUE(Prefill(stub(), PromptChunks(*fresh, g, 0, RandomPromptOf(g, 8, 4), 4)).ok());
}

TEST_F(DeadlineTest, APrefillPastItsDeadlineFreesItsStagedPromptAtOnce) {
  const v1::Geometry g = SmallGeometry();
  absl::StatusOr<std::string> id = CreateSession(stub(), g, MakePolicy(v1::SELECTOR_FULL));
  ASSERT_TRUE(id.ok());
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Milliseconds(500)));
  v1::PrefillResponse response;
  auto writer = stub().Prefill(&context, &response);
  for (const v1::PrefillChunk& chunk : PromptChunks(*id, g, 0, RandomPromptOf(g, 4096, 8), 512)) {
    ASSERT_TRUE(writer->Write(chunk));
  }
  // The chunks are staged (charged to the host budget) while the stream stays open.
  absl::Time until = absl::Now() + absl::Seconds(5);
  while (running().budget().used() == 0 && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_GT(running().budget().used(), 0);
  const grpc::Status status = writer->Finish();  // the client never closes: the deadline does
  EXPECT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << status.error_message();
  // Freed when the call ended (allow the server's side a moment to see the deadline).
  until = absl::Now() + absl::Milliseconds(200);
  while (running().budget().used() != 0 && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(2));
  }
  EXPECT_EQ(running().budget().used(), 0);
  absl::StatusOr<v1::SessionInfo> info = GetSession(stub(), *id);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->layers_prefilled(), 0);
}

TEST(LimitsOptionsTest, NegativeLimitsAreRefusedAtStart) {
  for (SessionLimits limits : {SessionLimits{.max_sessions = -1},
                               SessionLimits{.max_context_tokens = -1},
                               SessionLimits{.max_context_tokens = kMaxLayerTokens + 1},
                               SessionLimits{.session_idle_ttl = absl::Seconds(-1)}}) {
    ServerOptions options;
    options.address = "127.0.0.1:0";
    options.limits = limits;
    const absl::StatusOr<std::unique_ptr<RunningServer>> server = StartServer(options);
    EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument) << server.status();
    EXPECT_THAT(server.status().message(),
                HasSubstr(limits.max_context_tokens != 0 ? "max_context_tokens must be in [0, "
                                                         : "must be >= 0"));
  }
}

// ---------------------------------------------------------------------------------------------

// Without any limit set, a layer still holds at most kMaxLayerTokens tokens: an announced
// max_tokens past it used to wrap the KV store's byte count (2^57 + 1 rows of 128 bytes made a
// 128-byte buffer) and the prompt's first chunk wrote past it.
using TokenCeilingTest = LimitsTest;

TEST_F(TokenCeilingTest, MaxTokensPastWhatALayerCanHoldIsRefusedAndAllocatesNothing) {
  for (const int64_t max_tokens :
       {kMaxLayerTokens + 1, (int64_t{1} << 57) + 1, std::numeric_limits<int64_t>::max()}) {
    const absl::Status refused = CreateAnnouncing(SmallGeometry(), max_tokens);
    EXPECT_TRUE(HasStatus(refused, absl::StatusCode::kInvalidArgument,
                          absl::StrCat("max_tokens must be in [0, 2147483647] (0: not announced; "
                                       "the most a layer can hold), got ",
                                       max_tokens)))
        << refused;
  }
  EXPECT_TRUE(running().sessions().List().empty());
  EXPECT_EQ(running().budget().used(), 0);
  // The server goes on serving.
  EXPECT_FALSE(PrefilledSession(16).empty());
}

// Without a memory budget, a max_tokens whose KV is more than the machine's memory is refused
// at CreateSession (before: set aside, reported as held, and the first Prefill failed to
// allocate). 2^30 tokens of 8 KV heads x 128 dims in f32: 8 TiB a layer.
TEST_F(TokenCeilingTest, MoreKvThanTheMachineHoldsIsRefusedAtCreateSession) {
  const absl::Status refused = CreateAnnouncing(MakeGeometry(1, 8, 8, 128), int64_t{1} << 30);
  EXPECT_TRUE(HasStatus(refused, absl::StatusCode::kResourceExhausted,
                        absl::StrCat("max_tokens=1073741824 of 1 layers needs ",
                                     LayerKvStore::BytesFor(int64_t{1} << 30, 8, 128,
                                                            KvElement::kF32),
                                     " bytes of host KV and selector state, more than the ")))
      << refused;
  EXPECT_THAT(refused.message(),
              HasSubstr(absl::StrCat(MemoryLimitBytes(), " bytes of memory it may use")));
  EXPECT_THAT(refused.message(), HasSubstr("announce fewer tokens"));
  EXPECT_TRUE(running().sessions().List().empty());
  EXPECT_EQ(running().budget().used(), 0);
}

// The same check counts what the other sessions hold (probe 5, 6b: six sessions each under
// the machine's memory were all accepted, together several times over it). Set-asides are only
// counted, never allocated, so this holds nothing of the machine's memory.
TEST_F(TokenCeilingTest, SetAsidesTogetherPastTheMachinesMemoryAreRefused) {
  const int64_t usable = MemoryLimitBytes();
  if (usable <= 0) GTEST_SKIP() << "the system does not say how much memory it has";
  // f32, 8 KV heads x 128 dims: 8 KiB a token; each session announces 60 % of the memory.
  const v1::Geometry g = MakeGeometry(1, 8, 8, 128);
  const int64_t tokens = usable * 6 / 10 / 8192;
  ASSERT_LE(tokens, kMaxLayerTokens);
  ASSERT_TRUE(CreateAnnouncing(g, tokens).ok());
  ASSERT_EQ(running().sessions().List().size(), 1u);
  const std::string first = running().sessions().List()[0]->id();
  const int64_t held = running().budget().used();
  ASSERT_GE(held, tokens * 8192);

  const absl::Status refused = CreateAnnouncing(g, tokens);
  EXPECT_TRUE(HasStatus(refused, absl::StatusCode::kResourceExhausted,
                        absl::StrCat("max_tokens=", tokens, " of 1 layers needs ")))
      << refused;
  EXPECT_THAT(refused.message(),
              HasSubstr(absl::StrCat(" beside the ", held, " bytes this server holds")));
  EXPECT_THAT(refused.message(), HasSubstr("or wait for memory to be freed"));
  EXPECT_EQ(running().sessions().List().size(), 1u);
  EXPECT_EQ(running().budget().used(), held) << "the refused session holds nothing";

  // Once the first closes, the same announcement fits.
  v1::CloseSessionRequest close;
  close.set_session_id(first);
  v1::CloseSessionResponse closed;
  grpc::ClientContext context;
  ASSERT_TRUE(stub().CloseSession(&context, close, &closed).ok());
  EXPECT_TRUE(CreateAnnouncing(g, tokens).ok());
}

TEST_F(TokenCeilingTest, EveryLayersBytesPastInt64AreRefusedAtCreateSession) {
  // 2^31 - 1 tokens of 1024 KV heads x 1024 dims in f32 are ~2^54 bytes a layer; 1024 layers
  // would be ~2^64.
  const absl::Status refused =
      CreateAnnouncing(MakeGeometry(1024, 1024, 1024, 1024), kMaxLayerTokens);
  EXPECT_TRUE(HasStatus(refused, absl::StatusCode::kResourceExhausted,
                        "max_tokens=2147483647 of 1024 layers needs more bytes of host memory "
                        "than can be counted"))
      << refused;
  EXPECT_TRUE(running().sessions().List().empty());
  EXPECT_EQ(running().budget().used(), 0);
}

TEST(SessionLimitsTest, ALayerPastTheCeilingIsRefusedWithoutALimit) {
  const SessionLimits none;
  EXPECT_TRUE(none.CheckContext(kMaxLayerTokens).ok());
  EXPECT_TRUE(HasStatus(none.CheckContext(kMaxLayerTokens + 1, "s", 3),
                        absl::StatusCode::kResourceExhausted,
                        "layer 3 of session 's' would hold 2147483648 tokens, beyond the most a "
                        "layer can hold (2147483647)"));
  const SessionLimits limited{.max_context_tokens = 64};
  EXPECT_TRUE(HasStatus(limited.CheckContext(kMaxLayerTokens + 1),
                        absl::StatusCode::kResourceExhausted, "--max_context_tokens=64"));
}

}  // namespace
}  // namespace kvrecall
