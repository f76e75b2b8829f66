// Deadlines and cancellation in the C++ client (ClientOptions::call_timeout,
// PrefillOptions::timeout, DecodeStreamOptions::step_timeout, DecodeStream::Cancel) against
// real servers: one that holds a step until its client gives up (a test hook), and a kvrecalld
// process stopped with SIGSTOP (a wedged server), over a Decode stream and a shared region.
#include <signal.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "client/kvrecall_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server_fixture.h"
#include "tests/test_util.h"

namespace kvrecall::client {
namespace {

using ::kvrecall::testing::HasStatus;
using ::testing::HasSubstr;

constexpr int64_t kPromptTokens = 8;

// One layer's prompt and a decode token of random values, for a geometry of one layer.
struct Inputs {
  explicit Inputs(const v1::Geometry& g)
      : q(testing::RandomNormal(kPromptTokens * g.q_heads() * g.head_dim(), 1)),
        k(testing::RandomNormal(kPromptTokens * g.kv_heads() * g.head_dim(), 2)),
        v(testing::RandomNormal(kPromptTokens * g.kv_heads() * g.head_dim(), 3)),
        q_new(testing::RandomNormal(g.q_heads() * g.head_dim(), 4)),
        k_new(testing::RandomNormal(g.kv_heads() * g.head_dim(), 5)),
        v_new(testing::RandomNormal(g.kv_heads() * g.head_dim(), 6)) {}
  std::vector<float> q, k, v, q_new, k_new, v_new;
};

// A full-attention session of `g` (one layer) with the prompt of `in`; its handle.
SessionHandle PrefilledSession(Client& client, const v1::Geometry& g, const Inputs& in) {
  absl::StatusOr<SessionHandle> session =
      client.CreateSession(g, testing::MakePolicy(v1::SELECTOR_FULL), "deadline test");
  EXPECT_TRUE(session.ok()) << session.status();
  if (!session.ok()) return {};
  absl::StatusOr<std::unique_ptr<PrefillStream>> prefill = client.StartPrefill(*session);
  EXPECT_TRUE(prefill.ok()) << prefill.status();
  EXPECT_TRUE((*prefill)->SendLayer(0, in.q, in.k, in.v).ok());
  absl::StatusOr<v1::PrefillResponse> done = (*prefill)->Finish();
  EXPECT_TRUE(done.ok()) << done.status();
  return *session;
}

// Layer 0's decode step of `in`'s token, taking position `position`.
absl::Status StepAt(DecodeStream& stream, const SessionHandle& session, const Inputs& in,
                    int64_t position) {
  const SequenceInput step{session.id, in.q_new, in.k_new, in.v_new, position};
  StepResult result;
  return stream.Step(0, {&step, 1}, {}, &result);
}

// Tokens in the session's layer 0, as GetSession tells them.
int64_t LayerTokens(Client& client, const SessionHandle& session) {
  absl::StatusOr<v1::SessionInfo> info = client.GetSession(session.id);
  EXPECT_TRUE(info.ok()) << info.status();
  return info.ok() && info->layer_tokens_size() > 0 ? info->layer_tokens(0) : -1;
}

// ---------------------------------------------------------------------------------------------
// An in-process server whose decode steps a test can hold (ServiceTestHooks::before_decode_step)
// until the client gives up, over a Decode stream (false) or a shared region (true).

class HeldStepTest : public testing::ServerTest, public ::testing::WithParamInterface<bool> {
 protected:
  ServerOptions Options() const override {
    ServerOptions options;
    options.shared_memory_dir = dir_.path();
    options.service_test_hooks.before_decode_step =
        [this](const std::function<bool()>& cancelled) {
          if (!hold_.load()) return;
          held_.store(true);
          // A wedged step: until its client's cancellation arrives (at most 10 s).
          saw_cancel_.store(testing::Eventually(cancelled));
        };
    return options;
  }
  DecodeStreamOptions StreamOptions(absl::Duration step_timeout) const {
    return {.shared_memory = GetParam(), .step_timeout = step_timeout};
  }
  // The step held at the prompt's end saw its call cancelled and was not applied; sent again
  // it goes on a new stream and is applied once.
  void ExpectTheHeldStepUnappliedThenResent(Client& client, DecodeStream& stream,
                                            const SessionHandle& session, const Inputs& in) {
    ASSERT_TRUE(testing::Eventually([&] { return saw_cancel_.load(); }));
    hold_.store(false);
    EXPECT_EQ(LayerTokens(client, session), kPromptTokens);
    EXPECT_TRUE(StepAt(stream, session, in, kPromptTokens).ok());
    EXPECT_EQ(stream.streams_opened(), 2);
    EXPECT_EQ(LayerTokens(client, session), kPromptTokens + 1);
  }

  const v1::Geometry g_ = testing::MakeGeometry(1, 4, 2, 16);
  testing::TempDirectory dir_{"shm"};
  std::atomic<bool> hold_{false};                // hold the next steps
  mutable std::atomic<bool> held_{false};        // a step was held
  mutable std::atomic<bool> saw_cancel_{false};  // and saw its call cancelled
};

TEST_P(HeldStepTest, AStepPastItsTimeoutFailsAndIsNotApplied) {
  Client client(server().channel());
  const Inputs in(g_);
  const SessionHandle session = PrefilledSession(client, g_, in);
  absl::StatusOr<std::unique_ptr<DecodeStream>> stream =
      client.OpenDecodeStream(g_, StreamOptions(absl::Milliseconds(300)));
  ASSERT_TRUE(stream.ok()) << stream.status();

  hold_.store(true);
  const absl::Time start = absl::Now();
  const absl::Status timed_out = StepAt(**stream, session, in, kPromptTokens);
  const absl::Duration waited = absl::Now() - start;
  EXPECT_TRUE(HasStatus(timed_out, absl::StatusCode::kDeadlineExceeded,
                        "no answer within DecodeStreamOptions::step_timeout (300ms)"));
  EXPECT_THAT(timed_out.message(), HasSubstr("resend it with its positions"));
  EXPECT_GE(waited, absl::Milliseconds(300));
  EXPECT_LT(waited, absl::Seconds(5)) << "the timeout did not end the wait";
  ExpectTheHeldStepUnappliedThenResent(client, **stream, session, in);
  EXPECT_TRUE((*stream)->Close().ok());
}

TEST_P(HeldStepTest, CancelEndsAStepInFlightFromAnotherThread) {
  Client client(server().channel());
  const Inputs in(g_);
  const SessionHandle session = PrefilledSession(client, g_, in);
  absl::StatusOr<std::unique_ptr<DecodeStream>> stream =
      client.OpenDecodeStream(g_, {.shared_memory = GetParam()});  // no timeout
  ASSERT_TRUE(stream.ok()) << stream.status();

  hold_.store(true);
  std::thread canceller([&] {
    ASSERT_TRUE(testing::Eventually([&] { return held_.load(); }));
    (*stream)->Cancel();
  });
  const absl::Status cancelled = StepAt(**stream, session, in, kPromptTokens);
  canceller.join();
  EXPECT_TRUE(HasStatus(cancelled, absl::StatusCode::kCancelled,
                        "Decode step: cancelled by DecodeStream::Cancel"));
  ExpectTheHeldStepUnappliedThenResent(client, **stream, session, in);
}

TEST_P(HeldStepTest, CancelBetweenStepsMovesTheNextStepToANewStream) {
  Client client(server().channel());
  const Inputs in(g_);
  const SessionHandle session = PrefilledSession(client, g_, in);
  absl::StatusOr<std::unique_ptr<DecodeStream>> stream =
      client.OpenDecodeStream(g_, StreamOptions(absl::Seconds(30)));
  ASSERT_TRUE(stream.ok()) << stream.status();
  (*stream)->Cancel();
  (*stream)->Cancel();  // twice: the same
  EXPECT_TRUE(StepAt(**stream, session, in, kPromptTokens).ok());
  EXPECT_EQ((*stream)->streams_opened(), 2);
  EXPECT_EQ(LayerTokens(client, session), kPromptTokens + 1);
  // Cancelled before Close: Close has no stream to end and says how the last one ended.
  (*stream)->Cancel();
  EXPECT_TRUE(HasStatus((*stream)->Close(), absl::StatusCode::kCancelled,
                        "the Decode stream was cancelled (DecodeStream::Cancel)"));
}

TEST_P(HeldStepTest, StepsWithinTheirTimeoutAreServedAsWithout) {
  Client client(server().channel());
  const Inputs in(g_);
  const SessionHandle session = PrefilledSession(client, g_, in);
  // Steps of a stream whose timeout is shorter than the run: the watchdog's wake-ups in
  // between break nothing off. (A step on a loaded 2-core machine, under TSan, can take tens
  // of milliseconds: 50 ms failed the shared region's opening there.)
  absl::StatusOr<std::unique_ptr<DecodeStream>> stream =
      client.OpenDecodeStream(g_, StreamOptions(absl::Milliseconds(250)));
  ASSERT_TRUE(stream.ok()) << stream.status();
  const absl::Time end = absl::Now() + absl::Seconds(1);
  int64_t position = kPromptTokens;
  while (absl::Now() < end) {
    ASSERT_TRUE(StepAt(**stream, session, in, position).ok()) << position;
    ++position;
  }
  EXPECT_EQ((*stream)->streams_opened(), 1);
  EXPECT_EQ(LayerTokens(client, session), position);
  EXPECT_TRUE((*stream)->Close().ok());
}

INSTANTIATE_TEST_SUITE_P(Transports, HeldStepTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "SharedRegion" : "DecodeStream";
                         });

// ---------------------------------------------------------------------------------------------
// Unary calls and Prefill against an in-process server whose handlers a test holds.

class HeldCallTest : public testing::ServerTest {
 protected:
  ServerOptions Options() const override {
    ServerOptions options;
    options.service_test_hooks.after_create_session = [this] {
      if (hold_.load()) absl::SleepFor(absl::Seconds(1));
    };
    options.service_test_hooks.before_prefill_commit = [this] {
      if (hold_.load()) absl::SleepFor(absl::Seconds(1));
    };
    return options;
  }
  const v1::Geometry g_ = testing::MakeGeometry(1, 4, 2, 16);
  std::atomic<bool> hold_{false};
};

TEST_F(HeldCallTest, AUnaryCallPastItsTimeoutFailsAndItsRetryFindsTheSession) {
  Client client(server().channel(), {.call_timeout = absl::Milliseconds(200)});
  hold_.store(true);
  const v1::Policy policy = testing::MakePolicy(v1::SELECTOR_FULL);
  absl::StatusOr<SessionHandle> first = client.CreateSession(g_, policy, "held", 0, "req-1");
  EXPECT_TRUE(HasStatus(first.status(), absl::StatusCode::kDeadlineExceeded, ""));
  hold_.store(false);
  // The server made a session whose answer was lost; retries under the same request_id end
  // with one session, whether it is that one or, the lost answer's undone, a new one (ABORTED
  // while the first call's handler runs; a retry may time out too on a slow machine).
  absl::StatusOr<SessionHandle> retried;
  ASSERT_TRUE(testing::Eventually([&] {
    retried = client.CreateSession(g_, policy, "held", 0, "req-1");
    return retried.status().code() != absl::StatusCode::kAborted &&
           retried.status().code() != absl::StatusCode::kDeadlineExceeded;
  }));
  ASSERT_TRUE(retried.ok()) << retried.status();
  absl::StatusOr<std::vector<v1::SessionInfo>> sessions = client.ListSessions();
  ASSERT_TRUE(sessions.ok()) << sessions.status();
  ASSERT_EQ(sessions->size(), 1u);
  EXPECT_EQ(sessions->front().session_id(), retried->id);
}

TEST_F(HeldCallTest, APrefillPastItsTimeoutCommitsNothing) {
  Client client(server().channel());
  const Inputs in(g_);
  absl::StatusOr<SessionHandle> session =
      client.CreateSession(g_, testing::MakePolicy(v1::SELECTOR_FULL));
  ASSERT_TRUE(session.ok()) << session.status();
  hold_.store(true);
  absl::StatusOr<std::unique_ptr<PrefillStream>> prefill =
      client.StartPrefill(*session, {.timeout = absl::Milliseconds(200)});
  ASSERT_TRUE(prefill.ok()) << prefill.status();
  EXPECT_TRUE((*prefill)->SendLayer(0, in.q, in.k, in.v).ok());
  EXPECT_TRUE(HasStatus((*prefill)->Finish().status(), absl::StatusCode::kDeadlineExceeded, ""));
  hold_.store(false);
  // Whatever the commit had done by then is taken back.
  EXPECT_TRUE(testing::Eventually([&] { return LayerTokens(client, *session) == 0; }));
}

TEST_F(HeldCallTest, TimeoutsMustBePositive) {
  Client client(server().channel());
  EXPECT_TRUE(HasStatus(client.OpenDecodeStream(g_, {.step_timeout = absl::ZeroDuration()})
                            .status(),
                        absl::StatusCode::kInvalidArgument,
                        "DecodeStreamOptions.step_timeout must be positive, got 0"));
  absl::StatusOr<SessionHandle> session =
      client.CreateSession(g_, testing::MakePolicy(v1::SELECTOR_FULL));
  ASSERT_TRUE(session.ok()) << session.status();
  EXPECT_TRUE(HasStatus(client.StartPrefill(*session, {.timeout = absl::Seconds(-1)}).status(),
                        absl::StatusCode::kInvalidArgument,
                        "PrefillOptions.timeout must be positive, got -1s"));
  EXPECT_TRUE(HasStatus(Client::Connect(server().address(), ChannelSecurity(),
                                        {.call_timeout = absl::ZeroDuration()})
                            .status(),
                        absl::StatusCode::kInvalidArgument,
                        "ClientOptions.call_timeout must be positive, got 0"));
}

// Options or an address that cannot serve are refused by every call of the Client, with what is
// wrong (the insecure Connect and a Client on the caller's channel return a Client all the same:
// a non-positive call_timeout failed every unary call as DEADLINE_EXCEEDED, a port past 65535
// reached another, channel arguments given with a channel of one's own were ignored).
TEST_F(HeldCallTest, OptionsThatCannotServeAreEveryCallsAnswer) {
  grpc::ChannelArguments keepalive;
  keepalive.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 60'000);
  grpc::ChannelArguments receive_limit;
  receive_limit.SetInt(GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, 1 << 20);
  struct Case {
    std::unique_ptr<Client> client;
    std::string message;
  };
  std::vector<Case> cases;
  cases.push_back({std::make_unique<Client>(server().channel(),
                                            ClientOptions{.call_timeout = absl::ZeroDuration()}),
                   "ClientOptions.call_timeout must be positive, got 0"});
  cases.push_back({std::make_unique<Client>(server().channel(),
                                            ClientOptions{.max_message_bytes = 0}),
                   "ClientOptions.max_message_bytes must be positive, got 0"});
  cases.push_back({std::make_unique<Client>(server().channel(),
                                            ClientOptions{.channel_arguments = keepalive}),
                   "ClientOptions.channel_arguments are for Connect's channel"});
  cases.push_back({Client::Connect(server().address(), {.call_timeout = absl::Seconds(-1)}),
                   "ClientOptions.call_timeout must be positive, got -1s"});
  cases.push_back({Client::Connect(server().address(), {.channel_arguments = receive_limit}),
                   "grpc.max_receive_message_length is Connect's to set"});
  cases.push_back({Client::Connect("127.0.0.1:99999"),
                   "server address '127.0.0.1:99999' must be HOST:PORT with a port in [1, 65535]"});
  for (const Case& c : cases) {
    const v1::Geometry g = g_;
    EXPECT_TRUE(HasStatus(c.client->GetSession("s-0").status(),
                          absl::StatusCode::kInvalidArgument, c.message));
    EXPECT_TRUE(HasStatus(c.client->ListSessions().status(), absl::StatusCode::kInvalidArgument,
                          c.message));
    EXPECT_TRUE(HasStatus(c.client->CloseSession("s-0"), absl::StatusCode::kInvalidArgument,
                          c.message));
    EXPECT_TRUE(HasStatus(
        c.client->CreateSession(g, testing::MakePolicy(v1::SELECTOR_FULL)).status(),
        absl::StatusCode::kInvalidArgument, c.message));
    EXPECT_TRUE(HasStatus(c.client->OpenDecodeStream(g).status(),
                          absl::StatusCode::kInvalidArgument, c.message));
    EXPECT_TRUE(HasStatus(c.client->StartPrefill({"s-0", g, {}}).status(),
                          absl::StatusCode::kInvalidArgument, c.message));
  }
  // The same options on a usable Client, and the caller's channel with no arguments of ours.
  Client usable(server().channel(), {.max_message_bytes = 1 << 20});
  EXPECT_TRUE(usable.ListSessions().ok());
  std::unique_ptr<Client> connected =
      Client::Connect(server().address(), {.channel_arguments = keepalive});
  EXPECT_TRUE(connected->ListSessions().ok());
  absl::StatusOr<std::unique_ptr<Client>> secured =
      Client::Connect(server().address(), ChannelSecurity(), {.channel_arguments = keepalive});
  ASSERT_TRUE(secured.ok()) << secured.status();
  EXPECT_TRUE((*secured)->ListSessions().ok());
}

// ---------------------------------------------------------------------------------------------
// A kvrecalld process stopped with SIGSTOP: no call of it answers until SIGCONT.

// Stops process `pid` and waits until every thread of it is stopped (kill returns before they
// are: a shared stream's polling thread answered a step after it, once in a few runs).
bool StopProcess(pid_t pid) {
  if (kill(pid, SIGSTOP) != 0) return false;
  return testing::Eventually([pid] {
    const std::string tasks = absl::StrCat("/proc/", pid, "/task");
    for (const auto& task : std::filesystem::directory_iterator(tasks)) {
      std::ifstream stat(task.path() / "stat");
      std::string line;
      std::getline(stat, line);
      // "TID (comm) STATE ...": the state follows the last ')'.
      const size_t paren = line.rfind(')');
      if (paren == std::string::npos || paren + 2 >= line.size()) return false;
      if (line[paren + 2] != 'T') return false;
    }
    return true;
  });
}

class WedgedServerTest : public ::testing::TestWithParam<bool> {};

TEST_P(WedgedServerTest, EveryCallEndsByItsTimeoutAndTheStreamRecoversAfter) {
  testing::TempDirectory dir("shm");
  absl::StatusOr<std::unique_ptr<testing::KvrecalldProcess>> process =
      testing::KvrecalldProcess::Start({"--shared_memory_dir=" + dir.path()});
  ASSERT_TRUE(process.ok()) << process.status();
  const std::string address = (*process)->address();
  const v1::Geometry g = testing::MakeGeometry(1, 4, 2, 16);
  const Inputs in(g);
  absl::StatusOr<std::unique_ptr<Client>> client =
      Client::Connect(address, ChannelSecurity(), {.call_timeout = absl::Milliseconds(500)});
  ASSERT_TRUE(client.ok()) << client.status();
  const SessionHandle session = PrefilledSession(**client, g, in);
  absl::StatusOr<std::unique_ptr<DecodeStream>> stream = (*client)->OpenDecodeStream(
      g, {.shared_memory = GetParam(), .step_timeout = absl::Milliseconds(500)});
  ASSERT_TRUE(stream.ok()) << stream.status();
  ASSERT_TRUE(StepAt(**stream, session, in, kPromptTokens).ok());
  // A second stream, open and idle, to be closed while the server is stopped.
  absl::StatusOr<std::unique_ptr<DecodeStream>> idle = (*client)->OpenDecodeStream(
      g, {.shared_memory = GetParam(), .step_timeout = absl::Milliseconds(500)});
  ASSERT_TRUE(idle.ok()) << idle.status();
  StepResult empty;
  ASSERT_TRUE((*idle)->Step(0, {}, {}, &empty).ok());

  ASSERT_TRUE(StopProcess((*process)->pid()));
  const absl::Time start = absl::Now();
  EXPECT_TRUE(HasStatus(StepAt(**stream, session, in, kPromptTokens + 1),
                        absl::StatusCode::kDeadlineExceeded, "step_timeout (500ms)"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  // The next step would open a new stream on a server that does not answer: bounded too.
  EXPECT_TRUE(HasStatus(StepAt(**stream, session, in, kPromptTokens + 1),
                        absl::StatusCode::kDeadlineExceeded, "step_timeout (500ms)"));
  EXPECT_TRUE(HasStatus((*client)->GetSession(session.id).status(),
                        absl::StatusCode::kDeadlineExceeded, ""));
  EXPECT_TRUE(HasStatus((*idle)->Close(), absl::StatusCode::kDeadlineExceeded,
                        "closing the Decode stream: no answer within "
                        "DecodeStreamOptions::step_timeout (500ms)"));
  // The CLI's --timeout, on the same server.
  const std::string command = absl::StrCat(testing::BuildProgram("client/kvrecall"),
                                           " list --timeout=300ms --server=", address, " 2>&1");
  FILE* cli = popen(command.c_str(), "r");
  ASSERT_NE(cli, nullptr);
  std::string said;
  char buffer[512];
  while (fgets(buffer, sizeof buffer, cli) != nullptr) said += buffer;
  EXPECT_EQ(WEXITSTATUS(pclose(cli)), 1) << said;
  EXPECT_THAT(said, HasSubstr("DEADLINE_EXCEEDED"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));

  // Awake again: the step, resent with its position, is applied once (or was: ABORTED).
  ASSERT_EQ(kill((*process)->pid(), SIGCONT), 0);
  const absl::Status resent = StepAt(**stream, session, in, kPromptTokens + 1);
  EXPECT_TRUE(resent.ok() || resent.code() == absl::StatusCode::kAborted) << resent;
  if (!resent.ok()) ASSERT_TRUE(StepAt(**stream, session, in, kPromptTokens + 2).ok());
  EXPECT_EQ(LayerTokens(**client, session), kPromptTokens + (resent.ok() ? 2 : 3));
  EXPECT_TRUE((*stream)->Close().ok());
}

INSTANTIATE_TEST_SUITE_P(Transports, WedgedServerTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "SharedRegion" : "DecodeStream";
                         });

}  // namespace
}  // namespace kvrecall::client
