// DecodeShared, Decode through a shared-memory region (proto/shared_decode_region.h), against a
// real in-process server: steps through the C++ client's shared stream equal the gRPC stream's
// bit for bit and brute-force attention; a failed step ends the stream with its status,
// appends nothing, and the next step continues on a new stream; the region's file lives as long
// as the stream (close, cancellation); the server's limits and a hostile runner's bytes get
// clear statuses; the drain ends an idle shared stream with UNAVAILABLE.
#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/kvrecall_client.h"
#include "gtest/gtest.h"
#include "proto/shared_decode_region.h"
#include "server/decode.h"
#include "tests/server_fixture.h"
#include "tests/test_util.h"

namespace kvrecall {
namespace {

namespace shared = ::kvrecall::v1::shared_decode;
using ::kvrecall::testing::FromGrpc;
using ::kvrecall::testing::HasStatus;
using ::kvrecall::testing::MakeGeometry;
using ::kvrecall::testing::MakePolicy;
using ::kvrecall::testing::ReferenceSession;

// A directory of its own for each test's regions.
class SharedDirectory {
 public:
  SharedDirectory() : dir_("shm") { EXPECT_NE(dir_.path(), ""); }
  const std::string& path() const { return dir_.path(); }
  // The region files in it.
  int Regions() const {
    int n = 0;
    for (const auto& entry : std::filesystem::directory_iterator(path())) {
      n += absl::StartsWith(entry.path().filename().string(), "kvrecall-decode-");
    }
    return n;
  }
  // Waits up to 10 s for `n` region files.
  bool AwaitRegions(int n) const {
    return testing::Eventually([&] { return Regions() == n; });
  }

 private:
  testing::TempDirectory dir_;
};

class SharedDecodeTest : public ::kvrecall::testing::PrefilledSessionTest {
 protected:
  ServerOptions Options() const override {
    ServerOptions options;
    options.shared_memory_dir = dir_.path();
    options.max_shared_streams = max_shared_streams_;
    options.max_message_bytes = 1 << 20;
    return options;
  }
  client::Client MakeClient() { return client::Client(server().channel()); }
  static client::DecodeStreamOptions Shared() { return {.shared_memory = true}; }
  // Opens a stream whose region (1 MiB each way) fills the budget that refuses a second one with
  // `refusal`; the region is charged to the server's budget until the stream closes, and the
  // charge gone after.
  void ExpectARegionChargedWhileItsStreamLives(client::Client& c, absl::string_view refusal) {
    RunningServer& running = server().server();
    const int64_t region =
        static_cast<int64_t>(shared::RegionLayout::For(1 << 20, 1 << 20).bytes());
    absl::StatusOr<std::unique_ptr<client::DecodeStream>> first = c.OpenDecodeStream(g_, Shared());
    ASSERT_TRUE(first.ok()) << first.status();
    EXPECT_EQ(running.budget().used(), region);
    EXPECT_TRUE(HasStatus(c.OpenDecodeStream(g_, Shared()).status(),
                          absl::StatusCode::kResourceExhausted, refusal));
    EXPECT_EQ(running.budget().used(), region);
    ASSERT_TRUE((*first)->Close().ok());
    testing::Eventually([&] { return running.budget().used() == 0; }, std::chrono::seconds(5));
    EXPECT_EQ(running.budget().used(), 0);
    absl::StatusOr<std::unique_ptr<client::DecodeStream>> second =
        c.OpenDecodeStream(g_, Shared());
    EXPECT_TRUE(second.ok()) << second.status();
  }

  static constexpr int kHq = 4, kHkv = 2, kD = 16, kPrompt = 48;
  const v1::Geometry g_ = MakeGeometry(2, kHq, kHkv, kD);
  SharedDirectory dir_;
  int max_shared_streams_ = 4;
};

TEST_F(SharedDecodeTest, StepsEqualTheGrpcStreamsAndFullAttention) {
  ReferenceSession ref(g_, kPrompt, 11);
  ReferenceSession twin(g_, kPrompt, 11);
  const std::string a = CreateAndPrefill(ref, MakePolicy(v1::SELECTOR_FULL), 16);
  const std::string b = CreateAndPrefill(twin, MakePolicy(v1::SELECTOR_FULL), 16);
  client::Client c = MakeClient();
  absl::StatusOr<std::unique_ptr<client::DecodeStream>> over_grpc = c.OpenDecodeStream(g_);
  absl::StatusOr<std::unique_ptr<client::DecodeStream>> over_shm =
      c.OpenDecodeStream(g_, Shared());
  ASSERT_TRUE(over_grpc.ok()) << over_grpc.status();
  ASSERT_TRUE(over_shm.ok()) << over_shm.status();
  EXPECT_EQ(dir_.Regions(), 1);
  for (int token = 0; token < 3; ++token) {
    for (int layer = 0; layer < g_.layers(); ++layer) {
      const ReferenceSession::Token t = ref.MakeToken(1000 + 10 * token + layer);
      const std::vector<float> q = ref.Record(layer, t);
      const client::SequenceInput in_a{a, t.q, t.k, t.v};
      const client::SequenceInput in_b{b, t.q, t.k, t.v};
      client::StepResult via_grpc, via_shm;
      ASSERT_TRUE((*over_grpc)->Step(layer, {&in_a, 1}, {.return_lse = true}, &via_grpc).ok());
      ASSERT_TRUE((*over_shm)
                      ->Step(layer, {&in_b, 1}, {.return_lse = true, .diagnostics = true},
                             &via_shm)
                      .ok());
      EXPECT_EQ(via_shm.output, via_grpc.output) << "token " << token << " layer " << layer;
      EXPECT_EQ(via_shm.lse, via_grpc.lse);
      EXPECT_EQ(via_shm.response->results(0).position(), kPrompt + token);
      EXPECT_EQ(via_shm.response->results(0).heads_size(), kHq);
      std::vector<double> lse;
      const std::vector<double> want = ref.FullAttention(layer, q, &lse);
      ::kvrecall::testing::ExpectOutputNear(via_shm.output, want, g_.dtype(), "shared step");
    }
  }
  // An empty request is a round trip too.
  client::StepResult empty;
  ASSERT_TRUE((*over_shm)->Step(0, {}, {}, &empty).ok());
  EXPECT_EQ(empty.response->results_size(), 0);
  EXPECT_EQ((*over_shm)->streams_opened(), 1);
  EXPECT_TRUE((*over_shm)->Close().ok());
  EXPECT_TRUE(dir_.AwaitRegions(0)) << "the closed stream's region file is still there";
  EXPECT_TRUE((*over_grpc)->Close().ok());
}

TEST_F(SharedDecodeTest, FailedStepEndsTheStreamWithItsStatusAndAppendsNothing) {
  ReferenceSession ref(g_, kPrompt, 21);
  const std::string id = CreateAndPrefill(ref, MakePolicy(v1::SELECTOR_FULL), 64);
  client::Client c = MakeClient();
  absl::StatusOr<std::unique_ptr<client::DecodeStream>> stream = c.OpenDecodeStream(g_, Shared());
  ASSERT_TRUE(stream.ok()) << stream.status();
  const ReferenceSession::Token t = ref.MakeToken(5);
  client::StepResult result;
  // A batch naming the live session and one that does not exist: nothing is appended to either.
  const client::SequenceInput batch[] = {{id, t.q, t.k, t.v}, {"no-such-session", t.q, t.k, t.v}};
  EXPECT_TRUE(HasStatus((*stream)->Step(0, batch, {}, &result), absl::StatusCode::kNotFound,
                        "no-such-session"));
  absl::StatusOr<v1::SessionInfo> info = ::kvrecall::testing::GetSession(stub(), id);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->layer_tokens(0), kPrompt);
  EXPECT_TRUE(dir_.AwaitRegions(0)) << "the ended stream's region file is still there";
  // The next step opens a new shared stream and goes on.
  const client::SequenceInput one{id, t.q, t.k, t.v};
  ASSERT_TRUE((*stream)->Step(0, {&one, 1}, {}, &result).ok());
  EXPECT_EQ(result.response->results(0).position(), kPrompt);
  EXPECT_EQ((*stream)->streams_opened(), 2);
  // A query of the wrong size is refused by the client before anything is sent.
  const std::vector<float> short_q(kD);
  const client::SequenceInput wrong{id, short_q, t.k, t.v};
  EXPECT_TRUE(HasStatus((*stream)->Step(0, {&wrong, 1}, {}, &result),
                        absl::StatusCode::kInvalidArgument, "decode batch[0]"));
  // A layer out of range is refused by the server, and ends that stream.
  EXPECT_TRUE(HasStatus((*stream)->Step(7, {&one, 1}, {}, &result),
                        absl::StatusCode::kInvalidArgument, "layer"));
  info = ::kvrecall::testing::GetSession(stub(), id);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->layer_tokens(0), kPrompt + 1);
  EXPECT_EQ(info->layer_tokens(1), kPrompt);
  // Close reports how the last stream ended, as for a gRPC stream.
  EXPECT_TRUE(HasStatus((*stream)->Close(), absl::StatusCode::kInvalidArgument, "layer"));
}

TEST_F(SharedDecodeTest, LimitsAndCapacitiesAreEnforced) {
  client::Client c = MakeClient();
  // Capacities above the server's message limit (1 MiB here).
  EXPECT_TRUE(HasStatus(
      c.OpenDecodeStream(g_, {.shared_memory = true, .max_request_bytes = 2 << 20}).status(),
      absl::StatusCode::kInvalidArgument, "max_request_bytes must be at most"));
  // A request padded past its two sizes (held by gRPC for the stream's life: probe 26, 1).
  {
    v1::SharedDecodeRequest padded;
    padded.GetReflection()->MutableUnknownFields(&padded)->AddLengthDelimited(
        99, std::string(4096, 'x'));
    grpc::ClientContext context;
    std::unique_ptr<grpc::ClientReader<v1::SharedDecodeRegion>> reader =
        stub().DecodeShared(&context, padded);
    v1::SharedDecodeRegion region;
    EXPECT_FALSE(reader->Read(&region));
    const grpc::Status status = reader->Finish();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(status.error_message().find("bytes: at most 1024"), std::string::npos)
        << status.error_message();
  }
  // --max_shared_streams.
  std::vector<std::unique_ptr<client::DecodeStream>> open;
  for (int i = 0; i < max_shared_streams_; ++i) {
    absl::StatusOr<std::unique_ptr<client::DecodeStream>> s = c.OpenDecodeStream(g_, Shared());
    ASSERT_TRUE(s.ok()) << s.status();
    open.push_back(*std::move(s));
  }
  EXPECT_TRUE(HasStatus(c.OpenDecodeStream(g_, Shared()).status(),
                        absl::StatusCode::kResourceExhausted, "--max_shared_streams=4"));
  EXPECT_EQ(testing::RefusalsCounted(server().server(), "max_shared_streams"), 1);
  // A slot is given back once its call is done (just after Close returns).
  auto open_when_free = [&](const client::DecodeStreamOptions& options) {
    absl::StatusOr<std::unique_ptr<client::DecodeStream>> s;
    for (int i = 0; i < 500; ++i) {
      s = c.OpenDecodeStream(g_, options);
      if (s.ok() || s.status().code() != absl::StatusCode::kResourceExhausted) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return s;
  };
  for (auto& s : open) ASSERT_TRUE(s->Close().ok());
  open.clear();
  // A request larger than the region the client asked for: refused before it is sent.
  ReferenceSession ref(g_, kPrompt, 31);
  const std::string id = CreateAndPrefill(ref, MakePolicy(v1::SELECTOR_FULL), 64);
  absl::StatusOr<std::unique_ptr<client::DecodeStream>> small =
      open_when_free({.shared_memory = true, .max_request_bytes = 64});
  ASSERT_TRUE(small.ok()) << small.status();
  const ReferenceSession::Token t = ref.MakeToken(3);
  const client::SequenceInput in{id, t.q, t.k, t.v};
  client::StepResult result;
  EXPECT_TRUE(HasStatus((*small)->Step(0, {&in, 1}, {}, &result),
                        absl::StatusCode::kResourceExhausted, "max_request_bytes of 64"));
  // A reply area smaller than the step's output (4 heads x 16 dims of f32): refused before the
  // step is applied, so that a retry does not append the token twice.
  absl::StatusOr<std::unique_ptr<client::DecodeStream>> tiny =
      open_when_free({.shared_memory = true, .max_reply_bytes = 16});
  ASSERT_TRUE(tiny.ok()) << tiny.status();
  // The region holds 16 bytes of the message; the call's final status holds all of it, which
  // the client returns (it returned the 16 bytes: probe 28, 7).
  EXPECT_TRUE(HasStatus((*tiny)->Step(0, {&in, 1}, {}, &result),
                        absl::StatusCode::kResourceExhausted,
                        "over the reply area of 16 bytes; nothing of it was applied"));
  absl::StatusOr<v1::SessionInfo> info = ::kvrecall::testing::GetSession(stub(), id);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->layer_tokens(0), kPrompt);
  // A reply area that holds the step's output but not its per-head diagnostics: a step asking
  // for them is refused before it is applied (the reply's bound is checked, not its outcome),
  // and the same step without them is served.
  v1::DecodeRequest request;  // what the client sends for `in`, as far as the bound reads it
  request.add_steps()->set_session_id(id);
  const v1::Geometry* const geometry[] = {&g_};
  const uint64_t plain = MaxDecodeReplyBytes(request, geometry);
  request.set_diagnostics(true);
  ASSERT_LT(plain, MaxDecodeReplyBytes(request, geometry));
  absl::StatusOr<std::unique_ptr<client::DecodeStream>> narrow =
      open_when_free({.shared_memory = true, .max_reply_bytes = plain});
  ASSERT_TRUE(narrow.ok()) << narrow.status();
  EXPECT_TRUE(HasStatus((*narrow)->Step(0, {&in, 1}, {.diagnostics = true}, &result),
                        absl::StatusCode::kResourceExhausted, "nothing of it was applied"));
  info = ::kvrecall::testing::GetSession(stub(), id);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->layer_tokens(0), kPrompt);
  ASSERT_TRUE((*narrow)->Step(0, {&in, 1}, {}, &result).ok());
  EXPECT_EQ(result.response->results(0).position(), kPrompt);
}

// What a runner that writes the region by hand (or a hostile one) gets.
class RawRegion {
 public:
  explicit RawRegion(v1::KvRecall::Stub& stub) {
    reader_ = stub.DecodeShared(&context_, v1::SharedDecodeRequest());
    v1::SharedDecodeRegion answer;
    if (!reader_->Read(&answer)) return;
    absl::StatusOr<shared::MappedRegion> region =
        shared::MappedRegion::Open(answer.path(), answer.bytes());
    EXPECT_TRUE(region.ok()) << region.status();
    if (region.ok()) region_ = *std::move(region);
  }
  bool ok() const { return region_.header() != nullptr; }
  shared::RegionHeader* h() const { return region_.header(); }
  const shared::MappedRegion& region() const { return region_; }

  // Publishes `bytes` (claiming `claimed` bytes) as the next request and waits for the answer;
  // the reply's status code, and its message in *message when it is not OK.
  int Send(const std::string& bytes, uint32_t claimed, std::string* message) {
    std::copy(bytes.begin(), bytes.end(), region_.request());
    const uint32_t seq = Publish(claimed);
    const bool answered = shared::WaitUntil(
        &h()->reply_signal, &h()->runner_sleeping, absl::Milliseconds(1), absl::Milliseconds(10),
        [&] { return h()->reply_seq.load() == seq || h()->ended.load(); }, [] { return false; });
    EXPECT_TRUE(answered);
    if (h()->reply_seq.load() != seq) return -1;
    if (h()->status_code != 0) message->assign(region_.reply(), h()->reply_bytes);
    return h()->status_code;
  }
  // Publishes the request already in the region, claiming `claimed` bytes, and wakes the
  // server; the request's sequence number.
  uint32_t Publish(uint32_t claimed) {
    h()->request_bytes = claimed;
    const uint32_t seq = h()->request_seq.load() + 1;
    h()->request_seq.store(seq);
    shared::Signal(&h()->request_signal, &h()->server_sleeping);
    return seq;
  }
  absl::Status Finish() { return FromGrpc(reader_->Finish()); }
  void Cancel() { context_.TryCancel(); }
  // Waits up to 10 s for the server to mark the region ended. (A failed step's reply is
  // published first and `ended` just after it, so a runner reading it at once may see 0.)
  bool AwaitEnded() const {
    return testing::Eventually([&] { return h()->ended.load() == 1; });
  }

 private:
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReader<v1::SharedDecodeRegion>> reader_;
  shared::MappedRegion region_;
};

TEST_F(SharedDecodeTest, HostileRegionBytesGetClearStatuses) {
  {
    RawRegion raw(stub());
    ASSERT_TRUE(raw.ok());
    std::string message;
    EXPECT_EQ(raw.Send("", static_cast<uint32_t>(raw.h()->request_capacity) + 1, &message),
              static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
    EXPECT_TRUE(absl::StrContains(message, "over the region's max_request_bytes")) << message;
    EXPECT_TRUE(HasStatus(raw.Finish(), absl::StatusCode::kInvalidArgument,
                          "over the region's max_request_bytes"));
  }
  {
    RawRegion raw(stub());
    ASSERT_TRUE(raw.ok());
    std::string message;
    const std::string garbage = "\xff\xff\xff\xff\x0f not a message";
    EXPECT_EQ(raw.Send(garbage, static_cast<uint32_t>(garbage.size()), &message),
              static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
    EXPECT_TRUE(absl::StrContains(message, "is not a valid kvrecall.v1.DecodeRequest")) << message;
    EXPECT_TRUE(raw.Finish().code() == absl::StatusCode::kInvalidArgument);
  }
  {
    // A well-formed request whose session does not exist, then nothing more is read.
    RawRegion raw(stub());
    ASSERT_TRUE(raw.ok());
    v1::DecodeRequest request;
    request.add_steps()->set_session_id("nobody");
    std::string message;
    const std::string bytes = request.SerializeAsString();
    EXPECT_EQ(raw.Send(bytes, static_cast<uint32_t>(bytes.size()), &message),
              static_cast<int>(grpc::StatusCode::NOT_FOUND));
    EXPECT_TRUE(raw.AwaitEnded());
    EXPECT_TRUE(raw.Finish().code() == absl::StatusCode::kNotFound);
  }
  EXPECT_TRUE(dir_.AwaitRegions(0));
}

// A runner that shrinks its region's file under the mapping ends its own stream with DATA_LOSS
// (the server's access past the file's end faults, and its SIGBUS handler maps zeros over the
// region instead of the process dying); nothing of a request read as zeros is applied, and the
// server goes on serving. (The test's own mapping is not touched past what the file keeps.)
TEST_F(SharedDecodeTest, ARegionShrunkByItsRunnerEndsItsOwnStreamAlone) {
  ReferenceSession ref(g_, kPrompt, 31);
  const std::string id = CreateAndPrefill(ref, MakePolicy(v1::SELECTOR_FULL), 64);
  {
    // Shrunk to nothing while idle: the server's next look at the header faults.
    RawRegion raw(stub());
    ASSERT_TRUE(raw.ok());
    ASSERT_EQ(truncate(raw.region().path().c_str(), 0), 0);
    EXPECT_TRUE(
        HasStatus(raw.Finish(), absl::StatusCode::kDataLoss, "was shrunk while mapped"));
  }
  {
    // A whole step written, the request area cut off, then the step published (the header
    // stays): the server's copy of the request faults.
    RawRegion raw(stub());
    ASSERT_TRUE(raw.ok());
    const ReferenceSession::Token t = ref.MakeToken(6);
    v1::DecodeRequest request;
    request.set_layer(0);
    *request.add_steps() = ::kvrecall::testing::MakeStep(id, g_, t.q, t.k, t.v);
    const std::string bytes = request.SerializeAsString();
    std::copy(bytes.begin(), bytes.end(), raw.region().request());
    ASSERT_EQ(truncate(raw.region().path().c_str(), shared::kHeaderBytes), 0);
    raw.Publish(static_cast<uint32_t>(bytes.size()));
    EXPECT_TRUE(HasStatus(raw.Finish(), absl::StatusCode::kDataLoss,
                          "Decode request 0 was read as zeros and not applied"));
  }
  absl::StatusOr<v1::SessionInfo> info = ::kvrecall::testing::GetSession(stub(), id);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->layer_tokens(0), kPrompt);
  {
    // The request whole and the reply area cut off: the step is applied and its reply lost,
    // and the status says so (it said "not applied", and a runner resending appended the token
    // twice: probe 21, 1).
    RawRegion raw(stub());
    ASSERT_TRUE(raw.ok());
    const ReferenceSession::Token t = ref.MakeToken(7);
    v1::DecodeRequest request;
    request.set_layer(0);
    *request.add_steps() = ::kvrecall::testing::MakeStep(id, g_, t.q, t.k, t.v);
    const std::string bytes = request.SerializeAsString();
    std::copy(bytes.begin(), bytes.end(), raw.region().request());
    const auto reply_offset = raw.region().reply() - reinterpret_cast<char*>(raw.h());
    ASSERT_EQ(truncate(raw.region().path().c_str(), reply_offset), 0);
    raw.Publish(static_cast<uint32_t>(bytes.size()));
    EXPECT_TRUE(HasStatus(raw.Finish(), absl::StatusCode::kDataLoss,
                          "Decode request 0's step was applied and its reply lost: do not "
                          "resend it"));
  }
  info = ::kvrecall::testing::GetSession(stub(), id);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->layer_tokens(0), kPrompt + 1);
  EXPECT_TRUE(dir_.AwaitRegions(0));
  // The server goes on: a shared stream steps as before.
  client::Client c = MakeClient();
  absl::StatusOr<std::unique_ptr<client::DecodeStream>> stream = c.OpenDecodeStream(g_, Shared());
  ASSERT_TRUE(stream.ok()) << stream.status();
  const ReferenceSession::Token t = ref.MakeToken(8);
  const client::SequenceInput one{id, t.q, t.k, t.v};
  client::StepResult result;
  EXPECT_TRUE((*stream)->Step(0, std::span(&one, 1), {}, &result).ok());
}

TEST_F(SharedDecodeTest, AHeaderRewrittenByTheRunnerDoesNotMoveTheServersAreas) {
  // The runner overwrites the layout fields (capacities past the file, offsets anywhere):
  // the server keeps to the layout it made, so the oversized claim is refused by its own
  // capacity and the reply lands in its own reply area.
  ReferenceSession ref(g_, kPrompt, 51);
  const std::string id = CreateAndPrefill(ref, MakePolicy(v1::SELECTOR_FULL), 64);
  RawRegion raw(stub());
  ASSERT_TRUE(raw.ok());
  const uint64_t capacity = raw.region().request_capacity();
  raw.h()->request_capacity = 0xFFFFFFFFull;
  raw.h()->reply_capacity = 0xFFFFFFFFull;
  raw.h()->request_offset = 1ull << 40;
  raw.h()->reply_offset = 1ull << 40;
  std::string message;
  EXPECT_EQ(raw.Send("", 0xFFFFFFFFu, &message),
            static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
  EXPECT_TRUE(absl::StrContains(message, absl::StrCat("max_request_bytes of ", capacity)))
      << message;
  EXPECT_TRUE(raw.Finish().code() == absl::StatusCode::kInvalidArgument);
  // A well-formed step through a region whose header lies gets its reply where the layout was.
  RawRegion second(stub());
  ASSERT_TRUE(second.ok());
  second.h()->reply_offset = 8;  // over the header itself
  const ReferenceSession::Token t = ref.MakeToken(4);
  v1::DecodeRequest request;
  *request.add_steps() = ref.Step(id, t);
  const std::string bytes = request.SerializeAsString();
  EXPECT_EQ(second.Send(bytes, static_cast<uint32_t>(bytes.size()), &message), 0);
  v1::DecodeResponse reply;
  ASSERT_TRUE(reply.ParseFromArray(second.region().reply(), second.h()->reply_bytes));
  EXPECT_EQ(reply.results(0).position(), kPrompt);
  second.Cancel();
  EXPECT_TRUE(second.Finish().code() == absl::StatusCode::kCancelled);
}

TEST_F(SharedDecodeTest, CancellingTheCallEndsTheStreamAndRemovesItsRegion) {
  RawRegion raw(stub());
  ASSERT_TRUE(raw.ok());
  EXPECT_EQ(dir_.Regions(), 1);
  raw.Cancel();
  EXPECT_TRUE(dir_.AwaitRegions(0));
  EXPECT_TRUE(raw.Finish().code() == absl::StatusCode::kCancelled);
}

TEST_F(SharedDecodeTest, TheDrainEndsAnIdleSharedStreamWithUnavailable) {
  ReferenceSession ref(g_, kPrompt, 41);
  const std::string id = CreateAndPrefill(ref, MakePolicy(v1::SELECTOR_FULL), 64);
  client::Client c = MakeClient();
  absl::StatusOr<std::unique_ptr<client::DecodeStream>> stream = c.OpenDecodeStream(g_, Shared());
  ASSERT_TRUE(stream.ok()) << stream.status();
  const ReferenceSession::Token t = ref.MakeToken(9);
  const client::SequenceInput in{id, t.q, t.k, t.v};
  client::StepResult result;
  ASSERT_TRUE((*stream)->Step(0, {&in, 1}, {}, &result).ok());
  // Shutdown drains: the idle shared stream ends at once, so it returns well within the grace.
  const absl::Time start = absl::Now();
  server().server().Shutdown(absl::Seconds(20));
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_TRUE(HasStatus((*stream)->Step(1, {&in, 1}, {}, &result),
                        absl::StatusCode::kUnavailable, "shutting down"));
}

// A region is host memory: charged to --host_memory_budget_gb while its stream lives.
class SharedDecodeBudgetTest : public SharedDecodeTest {
 protected:
  ServerOptions Options() const override {
    ServerOptions options = SharedDecodeTest::Options();  // 1 MiB capacities each way
    options.host_memory_budget_bytes = 3 << 20;
    return options;
  }
};

TEST_F(SharedDecodeBudgetTest, ARegionIsChargedToTheHostBudgetWhileItsStreamLives) {
  client::Client c = MakeClient();
  ExpectARegionChargedWhileItsStreamLives(c, "host memory budget exceeded: a shared decode region");
}

// With a budget per tenant a region is charged to its caller's tenant (here the one tenant of
// a server without tokens), within the server's budget.
class SharedDecodeTenantBudgetTest : public SharedDecodeTest {
 protected:
  ServerOptions Options() const override {
    ServerOptions options = SharedDecodeTest::Options();  // 1 MiB capacities each way
    options.host_memory_budget_bytes = 8 << 20;
    options.limits.host_bytes_per_tenant = 3 << 20;
    return options;
  }
};

TEST_F(SharedDecodeTenantBudgetTest, ARegionIsChargedToItsCallersTenant) {
  client::Client c = MakeClient();
  ExpectARegionChargedWhileItsStreamLives(
      c,
      "host memory (of every caller: the server authenticates no tenants) budget exceeded: a "
      "shared decode region");
  EXPECT_EQ(testing::RefusalsCounted(server().server(), "host_memory_budget_per_tenant"), 1);
}

class SharedDecodeOffTest : public ::kvrecall::testing::ServerTest {};

TEST_F(SharedDecodeOffTest, WithoutADirectoryDecodeSharedIsRefused) {
  client::Client c(server().channel());
  EXPECT_TRUE(HasStatus(
      c.OpenDecodeStream(MakeGeometry(1, 2, 1, 8), {.shared_memory = true}).status(),
      absl::StatusCode::kFailedPrecondition, "--shared_memory_dir"));
}

// A DecodeShared open refused after it took its slot (by the memory budget, say) gives the slot
// back before its status goes out, so that a runner's immediate reopen within a per-tenant cap
// of 1 is served (review 27, 1: the slot stayed until the call's end, and 5 reopens in 200 were
// refused by the cap).
TEST(SharedDecodeOptionsTest, AnOpenRefusedAfterTakingItsSlotGivesItBackFirst) {
  SharedDirectory dir;
  ServerOptions options;
  options.shared_memory_dir = dir.path();
  options.max_shared_streams_per_tenant = 1;
  options.host_memory_budget_bytes = 16 << 20;
  absl::StatusOr<std::unique_ptr<testing::InProcessServer>> server =
      testing::InProcessServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  client::Client c((*server)->channel());
  const v1::Geometry g = testing::MakeGeometry(1, 2, 1, 8);
  for (int i = 0; i < 100; ++i) {
    EXPECT_TRUE(HasStatus(
        c.OpenDecodeStream(g, {.shared_memory = true, .max_request_bytes = 32 << 20}).status(),
        absl::StatusCode::kResourceExhausted, "a shared decode region"));
    absl::StatusOr<std::unique_ptr<client::DecodeStream>> s =
        c.OpenDecodeStream(g, {.shared_memory = true});
    ASSERT_TRUE(s.ok()) << "reopen " << i << ": " << s.status();
    EXPECT_TRUE((*s)->Close().ok());
  }
}

TEST(SharedDecodeOptionsTest, StartServerChecksTheDirectory) {
  ServerOptions options;
  options.address = "127.0.0.1:0";
  options.shared_memory_dir = "/nonexistent/kvrecall";
  EXPECT_TRUE(HasStatus(StartServer(options).status(), absl::StatusCode::kInvalidArgument,
                        "is not a directory"));
  options.shared_memory_dir = "";
  options.max_shared_streams = 0;
  EXPECT_TRUE(HasStatus(StartServer(options).status(), absl::StatusCode::kInvalidArgument,
                        "max_shared_streams"));
  options.max_shared_streams = 4;
  options.max_shared_streams_per_tenant = -1;
  EXPECT_TRUE(HasStatus(StartServer(options).status(), absl::StatusCode::kInvalidArgument,
                        "--max_shared_streams_per_tenant must be >= 0 (0: no limit), got -1"));
}

TEST(SharedDecodeOptionsTest, StartServerRemovesRegionsOfServersThatAreGone) {
  SharedDirectory dir;
  // A pid above any pid_max is no process; the parent's (ctest's) is a live one. A file of the
  // starting server's own pid is a predecessor's: in a container every kvrecalld is PID 1, and
  // a restarted one kept its predecessor's regions for good.
  const std::string stale = dir.path() + "/kvrecall-decode-999999999-0123456789abcdef01234567";
  const std::string own_pid =
      absl::StrCat(dir.path(), "/kvrecall-decode-", getpid(), "-0123456789abcdef01234567");
  const std::string live =
      absl::StrCat(dir.path(), "/kvrecall-decode-", getppid(), "-0123456789abcdef01234567");
  const std::string other = dir.path() + "/runner-notes";
  // Named like regions but not of their form, or another user's: not this server's to remove
  // (run as root, the sweep removed them: probe 26, 7).
  const std::string alike = dir.path() + "/kvrecall-decode-notes.txt";
  const std::string alike_pid = dir.path() + "/kvrecall-decode-999999999-userfile";
  const std::string others = dir.path() + "/kvrecall-decode-999999998-0123456789abcdef01234567";
  for (const std::string& path : {stale, own_pid, live, other, alike, alike_pid, others}) {
    std::FILE* f = std::fopen(path.c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fclose(f);
  }
  const bool root = geteuid() == 0;
  if (root) ASSERT_EQ(chown(others.c_str(), 65534, 65534), 0);
  ServerOptions options;
  options.address = "127.0.0.1:0";
  options.shared_memory_dir = dir.path();
  absl::StatusOr<std::unique_ptr<RunningServer>> server = StartServer(options);
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_FALSE(std::filesystem::exists(stale));
  EXPECT_FALSE(std::filesystem::exists(own_pid));
  EXPECT_TRUE(std::filesystem::exists(live));
  EXPECT_TRUE(std::filesystem::exists(other));
  EXPECT_TRUE(std::filesystem::exists(alike));
  EXPECT_TRUE(std::filesystem::exists(alike_pid));
  EXPECT_EQ(std::filesystem::exists(others), root) << "another user's (as root), else ours";
}

// Files of this process's pid are another server's while one runs in this process (tests and
// embedders start several): only with none left are they a predecessor's.
TEST(SharedDecodeOptionsTest, ASecondServerInTheProcessKeepsTheFirstsRegions) {
  SharedDirectory dir;
  ServerOptions options;
  options.address = "127.0.0.1:0";
  options.shared_memory_dir = dir.path();
  absl::StatusOr<std::unique_ptr<RunningServer>> first = StartServer(options);
  ASSERT_TRUE(first.ok()) << first.status();
  const std::string region =
      absl::StrCat(dir.path(), "/kvrecall-decode-", getpid(), "-0123456789abcdef01234567");
  std::FILE* f = std::fopen(region.c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::fclose(f);
  absl::StatusOr<std::unique_ptr<RunningServer>> second = StartServer(options);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_TRUE(std::filesystem::exists(region));
  first->reset();
  second->reset();
  absl::StatusOr<std::unique_ptr<RunningServer>> third = StartServer(options);
  ASSERT_TRUE(third.ok()) << third.status();
  EXPECT_FALSE(std::filesystem::exists(region));
}

// Only a runner on the server's host can map a region: a call over a network address (here this
// host's own, not loopback) is refused before it holds a slot (probe 26, 2: a tenant on another
// host took every slot of --max_shared_streams).
TEST(SharedDecodeOptionsTest, ACallOverANetworkAddressIsRefused) {
  std::string own_address;
  ifaddrs* interfaces = nullptr;
  ASSERT_EQ(getifaddrs(&interfaces), 0);
  for (ifaddrs* i = interfaces; i != nullptr && own_address.empty(); i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET) continue;
    char text[INET_ADDRSTRLEN];
    inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr, text,
              sizeof text);
    if (!absl::StartsWith(text, "127.")) own_address = text;
  }
  freeifaddrs(interfaces);
  if (own_address.empty()) GTEST_SKIP() << "this host has no IPv4 address but loopback";
  SharedDirectory dir;
  ServerOptions options;
  options.address = "[::]:0";  // both families: IPv6 loopback too (review 23: refused)
  options.shared_memory_dir = dir.path();
  absl::StatusOr<std::unique_ptr<RunningServer>> server = StartServer(options);
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string port = (*server)->address().substr((*server)->address().rfind(':') + 1);
  for (const std::string& host : {own_address, std::string("127.0.0.1"), std::string("[::1]")}) {
    auto stub = v1::KvRecall::NewStub(grpc::CreateChannel(absl::StrCat(host, ":", port),
                                                          grpc::InsecureChannelCredentials()));
    grpc::ClientContext context;
    std::unique_ptr<grpc::ClientReader<v1::SharedDecodeRegion>> reader =
        stub->DecodeShared(&context, v1::SharedDecodeRequest());
    v1::SharedDecodeRegion region;
    const bool opened = reader->Read(&region);
    if (opened) context.TryCancel();  // its slot back
    const grpc::Status status = reader->Finish();
    if (host == own_address) {
      EXPECT_FALSE(opened);
      EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << host;
      EXPECT_TRUE(absl::StrContains(status.error_message(),
                                    "DecodeShared is for a runner on the server's host"))
          << status.error_message();
    } else {
      EXPECT_TRUE(opened) << status.error_message();  // loopback: a region
    }
  }
}

// A relative --shared_memory_dir names its regions by absolute path, so that a runner in any
// working directory opens them.
TEST(SharedMemoryDirTest, ARelativeDirectoryNamesRegionsByAbsolutePath) {
  SharedDirectory dir;
  ServerOptions options;
  options.address = "127.0.0.1:0";
  options.shared_memory_dir =
      std::filesystem::relative(dir.path(), std::filesystem::current_path()).string();
  ASSERT_FALSE(std::filesystem::path(options.shared_memory_dir).is_absolute());
  absl::StatusOr<std::unique_ptr<RunningServer>> server = StartServer(options);
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = v1::KvRecall::NewStub(
      grpc::CreateChannel((*server)->address(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  auto reader = stub->DecodeShared(&context, v1::SharedDecodeRequest());
  v1::SharedDecodeRegion region;
  ASSERT_TRUE(reader->Read(&region));
  EXPECT_TRUE(std::filesystem::path(region.path()).is_absolute()) << region.path();
  EXPECT_TRUE(std::filesystem::equivalent(std::filesystem::path(region.path()).parent_path(),
                                          dir.path()))
      << region.path();
  context.TryCancel();
  reader->Finish().IgnoreError();
}

}  // namespace
}  // namespace kvrecall
