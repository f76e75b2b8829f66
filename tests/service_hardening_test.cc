// The service as a hostile but fair user tries it (issue 14): size-like knobs far beyond reason,
// messages that do not parse (mid-stream and unary), tensor shapes whose element counts
// overflow, finite inputs whose products overflow, many idle streams, health checks under
// load, and SIGTERM while work is in flight. Each test failed before its fix.
#include <dirent.h>
#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/impl/codegen/client_unary_call.h"
#include "grpcpp/impl/codegen/rpc_method.h"
#include "grpcpp/impl/codegen/sync_stream.h"
#include "gtest/gtest.h"
#include "server/host_memory.h"
#include "server/kv_store.h"
#include "tests/server_fixture.h"
#include "tests/test_util.h"

namespace kvrecall {
namespace {

using grpc::health::v1::Health;
using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;
using ::kvrecall::testing::CloseSession;
using ::kvrecall::testing::CreateSession;
using ::kvrecall::testing::DecodeClient;
using ::kvrecall::testing::FromGrpc;
using ::kvrecall::testing::GetSession;
using ::kvrecall::testing::HasStatus;
using ::kvrecall::testing::InProcessServer;
using ::kvrecall::testing::KvrecalldProcess;
using ::kvrecall::testing::MakeChannel;
using ::kvrecall::testing::MakeGeometry;
using ::kvrecall::testing::MakePolicy;
using ::kvrecall::testing::MakeStep;
using ::kvrecall::testing::MakeTensor;
using ::kvrecall::testing::Prefill;
using ::kvrecall::testing::PromptChunks;
using ::kvrecall::testing::RandomPromptOf;
using ::kvrecall::testing::RandomNormal;
using ::kvrecall::testing::ServerTest;
using ::testing::HasSubstr;

constexpr int kQHeads = 4;
constexpr int kKvHeads = 2;
constexpr int kHeadDim = 16;

v1::Geometry SmallGeometry(int layers = 1) {
  return MakeGeometry(layers, kQHeads, kKvHeads, kHeadDim);
}

// Bytes that parse as no protobuf message: field 1, length-delimited, with a length that runs
// past the end of the message.
grpc::ByteBuffer Garbage() {
  static const char kBytes[] = "\x0a\xff\xff\xff\x0f\x01";
  grpc::Slice slice(kBytes, sizeof kBytes - 1);
  return grpc::ByteBuffer(&slice, 1);
}

grpc::ByteBuffer Bytes(const google::protobuf::Message& message) {
  const std::string s = message.SerializeAsString();
  grpc::Slice slice(s);
  return grpc::ByteBuffer(&slice, 1);
}

template <typename Message>
bool ParseBytes(grpc::ByteBuffer& buffer, Message* message) {
  std::vector<grpc::Slice> slices;
  if (!buffer.Dump(&slices).ok()) return false;
  std::string s;
  for (const grpc::Slice& slice : slices) s.append(slice.begin(), slice.end());
  return message->ParseFromString(s);
}

// A unary call with raw bytes as the request, the way a client with a broken encoder makes one.
grpc::Status RawUnary(grpc::Channel* channel, const std::string& method,
                      const grpc::ByteBuffer& request, grpc::ByteBuffer* response) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  const grpc::internal::RpcMethod rpc(method.c_str(), grpc::internal::RpcMethod::NORMAL_RPC,
                                      channel->shared_from_this());
  return grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
      channel, rpc, &context, request, response);
}

// A bidirectional (or client-streaming) raw stream.
class RawStream {
 public:
  RawStream(grpc::Channel* channel, const std::string& method, bool client_streaming)
      : method_(method.c_str(),
                client_streaming ? grpc::internal::RpcMethod::CLIENT_STREAMING
                                 : grpc::internal::RpcMethod::BIDI_STREAMING,
                channel->shared_from_this()) {
    context_.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    if (client_streaming) {
      writer_.reset(grpc::internal::ClientWriterFactory<grpc::ByteBuffer>::Create(
          channel, method_, &context_, &reply_));
    } else {
      stream_.reset(
          grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer, grpc::ByteBuffer>::Create(
              channel, method_, &context_));
    }
  }
  bool Write(const grpc::ByteBuffer& message) {
    return writer_ != nullptr ? writer_->Write(message) : stream_->Write(message);
  }
  bool Read(grpc::ByteBuffer* message) { return stream_->Read(message); }
  grpc::Status Finish() {
    if (writer_ != nullptr) {
      writer_->WritesDone();
      return writer_->Finish();
    }
    stream_->WritesDone();
    grpc::ByteBuffer ignored;
    while (stream_->Read(&ignored)) {
    }
    return stream_->Finish();
  }
  grpc::ByteBuffer& reply() { return reply_; }

 private:
  grpc::internal::RpcMethod method_;
  grpc::ClientContext context_;
  grpc::ByteBuffer reply_;
  std::unique_ptr<grpc::ClientWriter<grpc::ByteBuffer>> writer_;
  std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>> stream_;
};

class HardeningTest : public ServerTest {
 protected:
  // A session of SmallGeometry(layers) with a committed prompt of `tokens` tokens.
  std::string PrefilledSession(int64_t tokens, int layers = 1) {
    const v1::Geometry g = SmallGeometry(layers);
    absl::StatusOr<std::string> id = CreateSession(stub(), g, MakePolicy(v1::SELECTOR_FULL));
    EXPECT_TRUE(id.ok()) << id.status();
    std::vector<v1::PrefillChunk> chunks;
    for (int l = 0; l < layers; ++l) {
      for (v1::PrefillChunk& c : PromptChunks(*id, g, l, RandomPromptOf(g, tokens, 10 + l), 8)) {
        chunks.push_back(std::move(c));
      }
    }
    EXPECT_TRUE(Prefill(stub(), chunks).ok());
    return *id;
  }
  v1::DecodeRequest OneStep(const std::string& id, uint64_t seed, int layer = 0) {
    const v1::Geometry g = SmallGeometry();
    v1::DecodeRequest request;
    request.set_layer(layer);
    *request.add_steps() =
        MakeStep(id, g, RandomNormal(kQHeads * kHeadDim, seed),
                 RandomNormal(kKvHeads * kHeadDim, seed + 1), RandomNormal(kKvHeads * kHeadDim,
                                                                           seed + 2));
    return request;
  }
  int64_t Tokens(const std::string& id) {
    absl::StatusOr<v1::SessionInfo> info = GetSession(stub(), id);
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? info->tokens() : -1;
  }
};

// ---------------------------------------------------------------------------------------------
// Size-like knobs: bounded, refused at once with INVALID_ARGUMENT naming the field and bound.

TEST_F(HardeningTest, HugeSelectorKnobsAreRefusedAtOnce) {
  struct Case {
    std::string message;
    void (*edit)(v1::Policy*);
  };
  const Case cases[] = {
      {"policy.retopk.cache_capacity must be <= 4096, got 100000000",
       [](v1::Policy* p) { p->mutable_retopk()->set_cache_capacity(100000000); }},
      {"policy.retopk.cache_capacity must be <= 4096, got 1073741824",
       [](v1::Policy* p) { p->mutable_retopk()->set_cache_capacity(1 << 30); }},
      {"policy.top_k must be <= 1048576, got 2147483647",
       [](v1::Policy* p) { p->set_top_k(std::numeric_limits<int32_t>::max()); }},
      {"policy.sinks must be <= 16777216, got 2147483647",
       [](v1::Policy* p) { p->set_sinks(std::numeric_limits<int32_t>::max()); }},
      {"policy.recent must be <= 16777216, got 2147483647",
       [](v1::Policy* p) { p->set_recent(std::numeric_limits<int32_t>::max()); }},
      {"policy.retopk.recent_window must be <= 16777216, got 2147483647",
       [](v1::Policy* p) {
         p->mutable_retopk()->set_recent_window(std::numeric_limits<int32_t>::max());
       }},
      {"policy.index.build_queries must be <= 65536, got 1000000000",
       [](v1::Policy* p) { p->mutable_index()->set_build_queries(1000000000); }},
      {"policy.index.build_topk must be <= 4096, got 1000000000",
       [](v1::Policy* p) { p->mutable_index()->set_build_topk(1000000000); }},
      {"policy.index.search_list_size must be <= 1048576, got 1000000000",
       [](v1::Policy* p) { p->mutable_index()->set_search_list_size(1000000000); }},
  };
  for (const v1::Selector selector : {v1::SELECTOR_RETOPK, v1::SELECTOR_INDEX,
                                      v1::SELECTOR_STREAMING}) {
    for (const Case& c : cases) {
      v1::Policy policy = MakePolicy(selector);
      c.edit(&policy);
      v1::CreateSessionRequest request;
      *request.mutable_geometry() = SmallGeometry();
      *request.mutable_policy() = policy;
      v1::CreateSessionResponse response;
      grpc::ClientContext context;
      // Before the bounds, 10^8 ran for over 30 s and grew past 20 GB: the deadline turns
      // that into a failure instead of a hang.
      context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
      const absl::Status status = FromGrpc(stub().CreateSession(&context, request, &response));
      EXPECT_TRUE(HasStatus(status, absl::StatusCode::kInvalidArgument, c.message))
          << v1::Selector_Name(selector);
    }
  }
  // The bounds themselves are accepted.
  v1::Policy edge = MakePolicy(v1::SELECTOR_RETOPK);
  edge.mutable_retopk()->set_cache_capacity(4096);
  edge.mutable_retopk()->set_reuse_neighbors(4096);
  EXPECT_TRUE(CreateSession(stub(), SmallGeometry(), edge).ok());
  grpc::ClientContext context;
  v1::ListSessionsResponse list;
  ASSERT_TRUE(stub().ListSessions(&context, {}, &list).ok());
  EXPECT_EQ(list.sessions_size(), 1);
}

// Selector state is reserved before it is built: with --host_memory_budget_gb=0.05, a ReTopK
// policy whose cache may grow to gigabytes is refused at CreateSession (probe 4: it was accepted
// there, then refused at Prefill), and one that fits the budget but not what is left of it at
// commit, before any of it exists. Before: capacity 3*10^6 was accepted with 864 MB of selector
// state, charged only once built.
class SmallBudgetTest : public HardeningTest {
 protected:
  ServerOptions Options() const override {
    ServerOptions options;
    options.host_memory_budget_bytes = 50ll << 20;
    // No GPU: the host budget is what these tests hold, and their tiered sessions (f32, which
    // a GPU's tiered placement refuses) keep their static sets in host memory on any machine.
    options.placements.gpus.emplace();
    return options;
  }
};

TEST_F(SmallBudgetTest, SelectorStateIsReservedBeforeItIsBuilt) {
  const v1::Geometry g = SmallGeometry();
  // More than the whole budget could ever hold: refused at CreateSession.
  v1::Policy huge = MakePolicy(v1::SELECTOR_RETOPK, /*top_k=*/65536);
  huge.mutable_retopk()->set_cache_capacity(4096);  // up to 4 x 1 GiB of cached supports
  const absl::StatusOr<std::string> never = CreateSession(stub(), g, huge);
  EXPECT_TRUE(HasStatus(never.status(), absl::StatusCode::kResourceExhausted,
                        "host_memory_budget_gb"))
      << never.status();
  EXPECT_THAT(never.status().message(), HasSubstr("retopk selector state of 1 layers"));
  EXPECT_THAT(never.status().message(), HasSubstr("could ever hold"));
  EXPECT_EQ(server().server().budget().used(), 0);

  // Within the budget but not beside what another session set aside (its announced max_tokens:
  // 122880 tokens of 2 x 2 x 16 f32 keys and values, 30 MiB, charged with their pages' tables):
  // refused at Prefill, before any of it exists.
  const int64_t set_aside = LayerKvStore::BytesFor(122880, 2, 16, KvElement::kF32);
  ASSERT_EQ(set_aside, 2 * HostFootprint(15 << 20));
  v1::CreateSessionRequest holder;
  *holder.mutable_geometry() = g;
  *holder.mutable_policy() = MakePolicy(v1::SELECTOR_FULL);
  holder.set_max_tokens(122880);
  v1::CreateSessionResponse held;
  grpc::ClientContext holder_context;
  ASSERT_TRUE(stub().CreateSession(&holder_context, holder, &held).ok());
  EXPECT_EQ(server().server().budget().used(), set_aside);
  v1::Policy large = MakePolicy(v1::SELECTOR_RETOPK, /*top_k=*/65536);
  large.mutable_retopk()->set_cache_capacity(30);  // up to 30 MiB of cached supports
  absl::StatusOr<std::string> id = CreateSession(stub(), g, large);
  ASSERT_TRUE(id.ok()) << id.status();
  const absl::StatusOr<v1::PrefillResponse> refused =
      Prefill(stub(), PromptChunks(*id, g, 0, RandomPromptOf(g, 64, 4), 16));
  EXPECT_TRUE(HasStatus(refused.status(), absl::StatusCode::kResourceExhausted,
                        "host_memory_budget_gb"))
      << refused.status();
  EXPECT_THAT(refused.status().message(), HasSubstr("retopk selector state of 1 layers"));
  absl::StatusOr<v1::SessionInfo> info = GetSession(stub(), *id);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->layers_prefilled(), 0);
  EXPECT_EQ(server().server().budget().used(), set_aside);
  ASSERT_TRUE(testing::CloseSession(stub(), held.session_id()).ok());
  EXPECT_EQ(server().server().budget().used(), 0);

  // The paper's knobs fit easily.
  v1::Policy usual = MakePolicy(v1::SELECTOR_RETOPK, /*top_k=*/32);
  absl::StatusOr<std::string> ok = CreateSession(stub(), g, usual);
  ASSERT_TRUE(ok.ok());
  EXPECT_TRUE(Prefill(stub(), PromptChunks(*ok, g, 0, RandomPromptOf(g, 64, 4), 16)).ok());
}

// The graph index's state and its build are reserved too: its knobs at their bounds (out-degree
// 256, 65536 build queries of top-4096 each) make a build of a 2048-token prompt take some 200
// MB a layer on the way (the projection's edges), which a 50 MiB budget refuses before building
// — in the CPU placement and in the tiered one, whose ReTopK searches a graph over the bulk.
// Before: it was charged only once built, so the build's transient memory was never charged at
// all. Two layers build in parallel, one thread each, so what fits does not depend on the host's
// core count.
TEST_F(SmallBudgetTest, GraphIndexStateIsReservedBeforeItIsBuilt) {
  const v1::Geometry g = SmallGeometry(/*layers=*/2);
  auto both_layers = [&](const std::string& id, int64_t tokens) {
    std::vector<v1::PrefillChunk> chunks = PromptChunks(id, g, 0, RandomPromptOf(g, tokens, 5), 512);
    for (v1::PrefillChunk& c : PromptChunks(id, g, 1, RandomPromptOf(g, tokens, 6), 512)) {
      chunks.push_back(std::move(c));
    }
    return chunks;
  };
  struct Case {
    v1::Selector selector;
    v1::Placement placement;
    const char* what;
  };
  for (const Case& c : {Case{v1::SELECTOR_INDEX, v1::PLACEMENT_CPU, "index selector state"},
                        Case{v1::SELECTOR_INDEX, v1::PLACEMENT_TIERED, "index selector state"},
                        Case{v1::SELECTOR_RETOPK, v1::PLACEMENT_TIERED, "retopk selector state"}}) {
    SCOPED_TRACE(c.what);
    v1::Policy huge = MakePolicy(c.selector, /*top_k=*/64);
    huge.set_placement(c.placement);
    huge.mutable_index()->set_max_degree(256);
    huge.mutable_index()->set_build_queries(65536);
    huge.mutable_index()->set_build_topk(4096);
    absl::StatusOr<std::string> id = CreateSession(stub(), g, huge);
    ASSERT_TRUE(id.ok()) << id.status();
    const absl::StatusOr<v1::PrefillResponse> refused = Prefill(stub(), both_layers(*id, 2048));
    EXPECT_TRUE(HasStatus(refused.status(), absl::StatusCode::kResourceExhausted,
                          "host_memory_budget_gb"))
        << refused.status();
    EXPECT_THAT(refused.status().message(), HasSubstr(absl::StrCat(c.what, " of 2 layers")));
    absl::StatusOr<v1::SessionInfo> info = GetSession(stub(), *id);
    ASSERT_TRUE(info.ok());
    EXPECT_EQ(info->layers_prefilled(), 0);

    // The default knobs fit.
    v1::Policy usual = MakePolicy(c.selector, /*top_k=*/64);
    usual.set_placement(c.placement);
    absl::StatusOr<std::string> ok = CreateSession(stub(), g, usual);
    ASSERT_TRUE(ok.ok());
    const absl::StatusOr<v1::PrefillResponse> fits = Prefill(stub(), both_layers(*ok, 1024));
    EXPECT_TRUE(fits.ok()) << fits.status();
    for (const std::string& session : {*id, *ok}) ASSERT_TRUE(CloseSession(stub(), session).ok());
  }
  EXPECT_EQ(server().server().budget().used(), 0);
}

// ---------------------------------------------------------------------------------------------
// ListSessions could be made to fail for every client: labels were unbounded, so two sessions
// with 3 MiB labels made its one reply larger than the 4 MiB that gRPC clients accept by
// default (RESOURCE_EXHAUSTED for everyone listing), and enough sessions of many layers (each
// reply listing 1024 layer lengths) would do it without labels.

TEST_F(HardeningTest, ListSessionsCannotBeMadeToFailForEveryone) {
  v1::CreateSessionRequest request;
  *request.mutable_geometry() = SmallGeometry();
  *request.mutable_policy() = MakePolicy(v1::SELECTOR_FULL);
  request.set_label(std::string(3 << 20, 'x'));
  v1::CreateSessionResponse response;
  {
    grpc::ClientContext context;
    EXPECT_TRUE(HasStatus(FromGrpc(stub().CreateSession(&context, request, &response)),
                          absl::StatusCode::kInvalidArgument,
                          "label must be at most 256 bytes, got 3145728"));
  }
  // The longest labels, on sessions of 1024 layers, listed a page at a time by a client with
  // gRPC's default limits.
  request.set_label(std::string(256, 'y'));
  request.mutable_geometry()->set_layers(1024);
  std::vector<std::string> ids;
  for (int i = 0; i < 230; ++i) {
    grpc::ClientContext context;
    ASSERT_TRUE(stub().CreateSession(&context, request, &response).ok());
    ids.push_back(response.session_id());
  }
  std::sort(ids.begin(), ids.end());
  auto defaults = v1::KvRecall::NewStub(
      grpc::CreateChannel(server().address(), grpc::InsecureChannelCredentials()));
  std::vector<std::string> listed;
  std::vector<int> pages;
  v1::ListSessionsRequest list;
  do {
    grpc::ClientContext context;
    v1::ListSessionsResponse page;
    const grpc::Status status = defaults->ListSessions(&context, list, &page);
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_LT(page.ByteSizeLong(), 1u << 20);
    for (const v1::SessionInfo& info : page.sessions()) {
      listed.push_back(info.session_id());
      EXPECT_EQ(info.layer_tokens_size(), 1024);
    }
    pages.push_back(page.sessions_size());
    list.set_page_token(page.next_page_token());
  } while (!list.page_token().empty());
  EXPECT_EQ(listed, ids);
  EXPECT_THAT(pages, ::testing::ElementsAre(100, 100, 30));
  list.set_page_size(501);
  grpc::ClientContext context;
  v1::ListSessionsResponse page;
  EXPECT_TRUE(HasStatus(FromGrpc(defaults->ListSessions(&context, list, &page)),
                        absl::StatusCode::kInvalidArgument, "page_size must be in [0, 500]"));
  // A page token is a session id, of a session closed since or not (probe 7: "zzz" read as an
  // id past every session and answered an empty page).
  list.set_page_size(0);
  for (const std::string token :
       {"zzz", "a", "s-0123", "S-0123456789ABCDEF", "s-0123456789abcdeg"}) {
    grpc::ClientContext bad_context;
    list.set_page_token(token);
    EXPECT_TRUE(HasStatus(FromGrpc(defaults->ListSessions(&bad_context, list, &page)),
                          absl::StatusCode::kInvalidArgument, "page_token must be empty or"))
        << token;
  }
  grpc::ClientContext closed_context;
  list.set_page_token("s-0000000000000000");  // before every id: the first page
  ASSERT_TRUE(defaults->ListSessions(&closed_context, list, &page).ok());
  EXPECT_EQ(page.sessions_size(), 100);
}

// ---------------------------------------------------------------------------------------------
// Messages that do not parse.

TEST_F(HardeningTest, UndecodablePrefillChunkFailsTheStreamAndCommitsNothing) {
  const v1::Geometry g = SmallGeometry();
  absl::StatusOr<std::string> id = CreateSession(stub(), g, MakePolicy(v1::SELECTOR_FULL));
  ASSERT_TRUE(id.ok()) << id.status();
  const std::vector<v1::PrefillChunk> chunks = PromptChunks(*id, g, 0, RandomPromptOf(g, 16, 1), 8);
  ASSERT_EQ(chunks.size(), 2u);
  {
    RawStream stream(server().channel().get(), "/kvrecall.v1.KvRecall/Prefill",
                     /*client_streaming=*/true);
    stream.Write(Bytes(chunks[0]));
    stream.Write(Garbage());
    stream.Write(Bytes(chunks[1]));
    EXPECT_TRUE(HasStatus(FromGrpc(stream.Finish()), absl::StatusCode::kInvalidArgument,
                          "chunks[1] is not a valid kvrecall.v1.PrefillChunk"));
  }
  absl::StatusOr<v1::SessionInfo> info = GetSession(stub(), *id);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->layers_prefilled(), 0);
  EXPECT_EQ(info->tokens(), 0);
  // The layer can still be prefilled, in full.
  absl::StatusOr<v1::PrefillResponse> prefilled = Prefill(stub(), chunks);
  ASSERT_TRUE(prefilled.ok()) << prefilled.status();
  EXPECT_EQ(prefilled->tokens(), 16);
}

TEST_F(HardeningTest, UndecodableDecodeRequestFailsTheStreamAndAppendsNothing) {
  const std::string id = PrefilledSession(10);
  RawStream stream(server().channel().get(), "/kvrecall.v1.KvRecall/Decode",
                   /*client_streaming=*/false);
  ASSERT_TRUE(stream.Write(Bytes(OneStep(id, 100))));
  grpc::ByteBuffer reply;
  ASSERT_TRUE(stream.Read(&reply));
  v1::DecodeResponse response;
  ASSERT_TRUE(ParseBytes(reply, &response));
  EXPECT_EQ(response.results(0).position(), 10);
  stream.Write(Garbage());
  stream.Write(Bytes(OneStep(id, 200)));  // after the bad one: must not be served
  EXPECT_FALSE(stream.Read(&reply));
  EXPECT_TRUE(HasStatus(FromGrpc(stream.Finish()), absl::StatusCode::kInvalidArgument,
                        "Decode request 1 of this stream is not a valid kvrecall.v1.DecodeRequest"));
  EXPECT_EQ(Tokens(id), 11);
}

TEST_F(HardeningTest, InvalidUtf8InAStringFieldIsUndecodable) {
  // proto3 strings must be UTF-8; the parser refuses the message as a whole.
  v1::GetSessionRequest request;
  request.set_session_id("s-\xff\xfe");
  grpc::ByteBuffer response;
  const grpc::Status status = RawUnary(server().channel().get(),
                                       "/kvrecall.v1.KvRecall/GetSession", Bytes(request), &response);
  EXPECT_TRUE(HasStatus(FromGrpc(status), absl::StatusCode::kInvalidArgument,
                        "the request is not a valid kvrecall.v1.GetSessionRequest"));
}

TEST_F(HardeningTest, UndecodableUnaryRequestsGetInvalidArgument) {
  const std::pair<const char*, const char*> methods[] = {
      {"/kvrecall.v1.KvRecall/CreateSession", "kvrecall.v1.CreateSessionRequest"},
      {"/kvrecall.v1.KvRecall/GetSession", "kvrecall.v1.GetSessionRequest"},
      {"/kvrecall.v1.KvRecall/ListSessions", "kvrecall.v1.ListSessionsRequest"},
      {"/kvrecall.v1.KvRecall/CloseSession", "kvrecall.v1.CloseSessionRequest"},
      {"/grpc.health.v1.Health/Check", "grpc.health.v1.HealthCheckRequest"},
  };
  for (const auto& [method, type] : methods) {
    grpc::ByteBuffer response;
    const grpc::Status status = RawUnary(server().channel().get(), method, Garbage(), &response);
    EXPECT_TRUE(HasStatus(FromGrpc(status), absl::StatusCode::kInvalidArgument,
                          absl::StrCat("the request is not a valid ", type,
                                       " (its bytes do not parse)")))
        << method;
  }
}

// ---------------------------------------------------------------------------------------------
// A session closed or expired while its prompt streams in (found by TSan).

TEST_F(HardeningTest, ASessionClosedWhileItsPromptStreamsInFreesTheStagedPromptFirst) {
  // Before: ending the stream dropped its reference to the session before the staged chunks,
  // which give their memory back through the session's grant; when the stream held the last
  // reference (the session was closed, or expired, while its prompt streamed in), the chunks
  // were released into the freed session (heap-use-after-free under ASan and TSan).
  const v1::Geometry g = SmallGeometry();
  absl::StatusOr<std::string> id = CreateSession(stub(), g, MakePolicy(v1::SELECTOR_FULL));
  ASSERT_TRUE(id.ok()) << id.status();
  grpc::ClientContext context;
  v1::PrefillResponse response;
  std::unique_ptr<grpc::ClientWriter<v1::PrefillChunk>> writer =
      stub().Prefill(&context, &response);
  for (const v1::PrefillChunk& chunk : PromptChunks(*id, g, 0, RandomPromptOf(g, 256, 3), 64)) {
    ASSERT_TRUE(writer->Write(chunk));
  }
  const MemoryBudget& budget = server().server().budget();
  absl::Time until = absl::Now() + absl::Seconds(60);
  while (budget.used() == 0 && absl::Now() < until) absl::SleepFor(absl::Milliseconds(5));
  ASSERT_GT(budget.used(), 0);  // staged, charged through the session's grant
  ASSERT_TRUE(CloseSession(stub(), *id).ok());
  writer->WritesDone();
  const absl::Status ended = FromGrpc(writer->Finish());
  // Nothing to commit into.
  EXPECT_TRUE(HasStatus(ended, absl::StatusCode::kNotFound, absl::StrCat(*id, "' was closed")));
  until = absl::Now() + absl::Seconds(10);
  while (budget.used() != 0 && absl::Now() < until) absl::SleepFor(absl::Milliseconds(5));
  EXPECT_EQ(budget.used(), 0);
  EXPECT_EQ(GetSession(stub(), *id).status().code(), absl::StatusCode::kNotFound);
}

// ---------------------------------------------------------------------------------------------
// Tensor shapes whose element count overflows int64 passed the byte-size check (the product
// wrapped around to the bytes sent) and made the server reserve 2^58 rows: std::bad_alloc on a
// gRPC thread, and the process died.

TEST_F(HardeningTest, TensorShapeWhoseElementCountOverflowsIsRefused) {
  const v1::Geometry g = SmallGeometry();
  absl::StatusOr<std::string> id = CreateSession(stub(), g, MakePolicy(v1::SELECTOR_FULL));
  ASSERT_TRUE(id.ok()) << id.status();
  const int64_t rows = (int64_t{1} << 58) + 1;  // x 64 and x 32 elements per row wrap to 64, 32
  v1::PrefillChunk chunk;
  chunk.set_session_id(*id);
  auto wrapped = [&](int heads) {
    v1::Tensor t = MakeTensor(RandomNormal(heads * kHeadDim, 3), {1, heads, kHeadDim},
                              v1::DTYPE_F32);
    t.set_shape(0, rows);
    return t;
  };
  *chunk.mutable_q() = wrapped(kQHeads);
  *chunk.mutable_k() = wrapped(kKvHeads);
  *chunk.mutable_v() = wrapped(kKvHeads);
  const std::vector<v1::PrefillChunk> chunks = {chunk};
  EXPECT_TRUE(HasStatus(Prefill(stub(), chunks).status(), absl::StatusCode::kInvalidArgument,
                        "chunks[0].q has shape [288230376151711745, 4, 16]"));
  // The server is alive and the session untouched.
  absl::StatusOr<v1::SessionInfo> info = GetSession(stub(), *id);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->layers_prefilled(), 0);
}

// ---------------------------------------------------------------------------------------------
// Finite inputs whose products overflow f32 (q·k of 1e20s) made every later output NaN.

TEST_F(HardeningTest, FiniteInputsWhoseProductsOverflowAreRefused) {
  const std::string id = PrefilledSession(10);
  DecodeClient decode(stub());
  v1::DecodeRequest request = OneStep(id, 5);
  const std::vector<float> huge(kQHeads * kHeadDim, 1e20f);
  *request.mutable_steps(0)->mutable_q() =
      MakeTensor(huge, {kQHeads, kHeadDim}, v1::DTYPE_F32);
  EXPECT_TRUE(HasStatus(decode.Step(request).status(), absl::StatusCode::kInvalidArgument,
                        "steps[0].q holds 1e+20 at element 0, beyond the largest magnitude"));
  EXPECT_EQ(Tokens(id), 10);
  // The session still answers finite outputs.
  DecodeClient again(stub());
  absl::StatusOr<v1::DecodeResponse> reply = again.Step(OneStep(id, 7));
  ASSERT_TRUE(reply.ok()) << reply.status();
  for (float x : ::kvrecall::testing::TensorValues(reply->results(0).output())) {
    ASSERT_TRUE(std::isfinite(x));
  }
}

// ---------------------------------------------------------------------------------------------
// Many idle streams: they hold no thread, and health checks and other calls keep answering.

int ThreadsOf(pid_t pid) {
  DIR* dir = opendir(absl::StrCat("/proc/", pid, "/task").c_str());
  if (dir == nullptr) return -1;
  int n = 0;
  while (dirent* e = readdir(dir)) n += e->d_name[0] != '.';
  closedir(dir);
  return n;
}

std::unique_ptr<KvrecalldProcess> StartKvrecalld(std::vector<std::string> flags = {}) {
  absl::StatusOr<std::unique_ptr<KvrecalldProcess>> process =
      KvrecalldProcess::Start(std::move(flags));
  EXPECT_TRUE(process.ok()) << process.status();
  return process.ok() ? *std::move(process) : nullptr;
}

grpc::Status CheckHealth(const std::string& address, HealthCheckResponse* response,
                         absl::Duration deadline = absl::Seconds(5)) {
  auto stub = Health::NewStub(MakeChannel(address));
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
  return stub->Check(&context, HealthCheckRequest(), response);
}

// Opens `count` Decode streams over `channels` connections and leaves them idle.
struct IdleStreams {
  IdleStreams(const std::string& address, int count, int channels) {
    for (int c = 0; c < channels; ++c) {
      // Distinct channel arguments keep the channels from sharing one connection.
      grpc::ChannelArguments args;
      args.SetInt("kvrecall.test.channel", c);
      stubs.push_back(v1::KvRecall::NewStub(
          grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args)));
    }
    for (int i = 0; i < count; ++i) {
      streams.push_back(std::make_unique<DecodeClient>(*stubs[i % channels]));
    }
    // An empty request answered on each stream: every stream is open on the server.
    for (auto& s : streams) {
      absl::StatusOr<v1::DecodeResponse> reply = s->Step(v1::DecodeRequest());
      EXPECT_TRUE(reply.ok()) << reply.status();
    }
  }
  std::vector<std::unique_ptr<v1::KvRecall::Stub>> stubs;
  std::vector<std::unique_ptr<DecodeClient>> streams;
};

TEST(HardeningProcessTest, IdleStreamsDoNotStarveHealthOrOtherCalls) {
  // Before: with --worker_threads=16, 15 idle Decode streams made Health/Check and
  // CreateSession fail with RESOURCE_EXHAUSTED.
  std::unique_ptr<KvrecalldProcess> server = StartKvrecalld({"--worker_threads=2"});
  ASSERT_NE(server, nullptr);
  IdleStreams idle(server->address(), 64, 4);
  HealthCheckResponse health;
  const grpc::Status status = CheckHealth(server->address(), &health);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(health.status(), HealthCheckResponse::SERVING);
  auto stub = v1::KvRecall::NewStub(MakeChannel(server->address()));
  EXPECT_TRUE(CreateSession(*stub, SmallGeometry(), MakePolicy(v1::SELECTOR_FULL)).ok());
}

TEST(HardeningProcessTest, IdleStreamsHoldNoThreads) {
  // Before: 1500 idle streams made 1511 server threads.
  std::unique_ptr<KvrecalldProcess> server = StartKvrecalld();
  ASSERT_NE(server, nullptr);
  const int before = ThreadsOf(server->pid());
  ASSERT_GT(before, 0);
  IdleStreams idle(server->address(), 1000, 8);
  const int during = ThreadsOf(server->pid());
  // gRPC's own pollers and executor may grow with 8 connections' traffic (by 9 once on the
  // 16-core H200 host, d102); a thread a stream would be 1000 more.
  EXPECT_LE(during, before + 16) << "threads before " << before << ", with 1000 idle streams "
                                 << during;
  HealthCheckResponse health;
  EXPECT_TRUE(CheckHealth(server->address(), &health).ok());
}

// ---------------------------------------------------------------------------------------------
// SIGTERM: NOT_SERVING first, work in flight finishes, new work gets UNAVAILABLE, and the
// process exits within the grace.

// A session whose Prefill commit takes a while: the index selector's build is a GEMM of
// build_queries x prompt keys per head. Light: about 25 GFLOP (a second or more on a 2-core
// machine); heavy: about 275 GFLOP (for work that must outlast a short grace).
struct SlowPrefill {
  static constexpr int kHeads = 4;
  static constexpr int kDim = 64;
  SlowPrefill(v1::KvRecall::Stub& stub, bool heavy = false)
      : tokens(heavy ? 16384 : 12288), heads(heavy ? 8 : 4) {
    g = MakeGeometry(1, heads, heads, kDim, heavy ? v1::DTYPE_BF16 : v1::DTYPE_F32);
    v1::Policy policy = MakePolicy(v1::SELECTOR_INDEX, 64, 16, 64);
    policy.mutable_index()->set_build_queries(heavy ? 16384 : 4096);
    policy.mutable_index()->set_build_topk(64);
    absl::StatusOr<std::string> created = CreateSession(stub, g, policy);
    EXPECT_TRUE(created.ok()) << created.status();
    id = *created;
    chunks = PromptChunks(id, g, 0, RandomPromptOf(g, tokens, 9), 2048);
  }
  const int64_t tokens;
  const int heads;
  v1::Geometry g;
  std::string id;
  std::vector<v1::PrefillChunk> chunks;
};

// Waits until the in-process server's commit of a Prefill stream runs (every chunk is staged).
void AwaitCommit(RunningServer& server) {
  const absl::Time until = absl::Now() + absl::Seconds(60);
  while (server.service().builds_in_flight() == 0 && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(2));
  }
  ASSERT_GT(server.service().builds_in_flight(), 0);
  absl::SleepFor(absl::Milliseconds(20));  // queued -> running
}

// Streams `chunks` and half-closes, so that the commit starts (flow control holds the writes
// back until the server has taken nearly all of them); Finish() waits for the answer.
class PrefillInFlight {
 public:
  PrefillInFlight(v1::KvRecall::Stub& stub, const std::vector<v1::PrefillChunk>& chunks)
      : writer_(stub.Prefill(&context_, &response_)) {
    for (const v1::PrefillChunk& c : chunks) writer_->Write(c);
    writer_->WritesDone();
  }
  void Cancel() { context_.TryCancel(); }
  absl::StatusOr<v1::PrefillResponse> Finish() {
    if (absl::Status s = FromGrpc(writer_->Finish()); !s.ok()) return s;
    return response_;
  }

 private:
  grpc::ClientContext context_;
  v1::PrefillResponse response_;
  std::unique_ptr<grpc::ClientWriter<v1::PrefillChunk>> writer_;
};

TEST_F(HardeningTest, DrainAnswersNotServingRefusesNewWorkAndFinishesWorkInFlight) {
  // Before: health never said NOT_SERVING during the drain (gRPC stopped answering at once),
  // and open streams kept taking new steps until they were cut off.
  const std::string id = PrefilledSession(10);
  DecodeClient decode(stub());
  ASSERT_TRUE(decode.Step(OneStep(id, 1)).ok());
  auto health = Health::NewStub(server().channel());
  grpc::ClientContext watch_context;
  auto watch = health->Watch(&watch_context, HealthCheckRequest());
  HealthCheckResponse watched;
  ASSERT_TRUE(watch->Read(&watched));
  EXPECT_EQ(watched.status(), HealthCheckResponse::SERVING);

  SlowPrefill slow(stub());
  PrefillInFlight prefill(stub(), slow.chunks);
  AwaitCommit(server().server());
  std::jthread drain([&] { server().server().Shutdown(absl::Seconds(120)); });

  ASSERT_TRUE(watch->Read(&watched));
  EXPECT_EQ(watched.status(), HealthCheckResponse::NOT_SERVING);
  EXPECT_FALSE(watch->Read(&watched));  // the last word
  HealthCheckResponse checked;
  const grpc::Status status = CheckHealth(server().address(), &checked);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(checked.status(), HealthCheckResponse::NOT_SERVING);
  EXPECT_TRUE(HasStatus(decode.Step(OneStep(id, 2)).status(), absl::StatusCode::kUnavailable,
                        "kvrecalld is shutting down"));
  EXPECT_TRUE(HasStatus(CreateSession(stub(), SmallGeometry(), MakePolicy(v1::SELECTOR_FULL))
                            .status(),
                        absl::StatusCode::kUnavailable, "kvrecalld is shutting down"));
  EXPECT_TRUE(server().server().busy()) << "the commit finished before the checks";

  // The commit in flight finishes and is answered.
  absl::StatusOr<v1::PrefillResponse> committed = prefill.Finish();
  ASSERT_TRUE(committed.ok()) << committed.status();
  EXPECT_EQ(committed->tokens(), slow.tokens);
  drain.join();
  EXPECT_EQ(server().server().sessions().List().size(), 2u);
}

TEST_F(HardeningTest, PrefillCancelledDuringItsCommitCommitsNothing) {
  // Before: the client heard CANCELLED (or DEADLINE_EXCEEDED) at once, but the commit went on
  // and installed the prompt, so the layer could never be prefilled again (a retry got
  // FAILED_PRECONDITION "already prefilled").
  SlowPrefill slow(stub());
  PrefillInFlight prefill(stub(), slow.chunks);
  AwaitCommit(server().server());
  const absl::Time cancelled = absl::Now();
  prefill.Cancel();
  EXPECT_EQ(prefill.Finish().status().code(), absl::StatusCode::kCancelled);
  EXPECT_LT(absl::Now() - cancelled, absl::Milliseconds(500));
  // The build stops too (index/build_stop.h; probe 8: it ran its 4-6 s to the end after the
  // client had gone); once it has, nothing of it is installed and its memory is back.
  const absl::Time until = absl::Now() + absl::Seconds(120);
  while (server().server().busy() && absl::Now() < until) absl::SleepFor(absl::Milliseconds(5));
  ASSERT_FALSE(server().server().busy());
  const absl::Duration stopped_after = absl::Now() - cancelled;
  absl::StatusOr<v1::SessionInfo> info = GetSession(stub(), slow.id);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->layers_prefilled(), 0);
  EXPECT_EQ(info->tokens(), 0);
  EXPECT_EQ(server().server().budget().used(), 0);
  // The prompt can be sent again. Its build takes several times what the cancelled build took
  // to stop, 20 ms into it.
  absl::StatusOr<v1::PrefillResponse> again = Prefill(stub(), slow.chunks);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->tokens(), slow.tokens);
  EXPECT_LT(stopped_after, absl::Seconds(again->build_seconds()) / 2)
      << "the cancelled build ran on";
}

// A Prefill whose session is closed (by another call, or its idle TTL) while its layers build
// stops the builds and hears why at once, not once the builds would have ended.
TEST_F(HardeningTest, APrefillWhoseSessionClosesDuringItsCommitStopsItsBuild) {
  // The build of a Prefill like it, for comparison.
  SlowPrefill measured(stub());
  absl::StatusOr<v1::PrefillResponse> whole = Prefill(stub(), measured.chunks);
  ASSERT_TRUE(whole.ok()) << whole.status();
  const int64_t measured_bytes = server().server().budget().used();

  SlowPrefill slow(stub());
  PrefillInFlight prefill(stub(), slow.chunks);
  AwaitCommit(server().server());
  const absl::Time closed = absl::Now();
  ASSERT_TRUE(CloseSession(stub(), slow.id).ok());
  const absl::Status status = prefill.Finish().status();
  const absl::Duration answered_after = absl::Now() - closed;
  EXPECT_TRUE(HasStatus(status, absl::StatusCode::kNotFound, "was closed")) << status;
  EXPECT_LT(answered_after, absl::Seconds(whole->build_seconds()) / 2)
      << "the build of a closed session ran on";
  const absl::Time until = absl::Now() + absl::Seconds(120);
  while (server().server().busy() && absl::Now() < until) absl::SleepFor(absl::Milliseconds(5));
  EXPECT_EQ(server().server().budget().used(), measured_bytes) << "the closed one's is back";
}

// A CreateSession whose deadline passes while its handler runs (held there by a test hook past
// the deadline) is answered DEADLINE_EXCEEDED, and the session it made,
// whose id no client has, is closed again with its memory. Before: it stayed, holding its
// max_tokens' set-aside and a --max_sessions slot until its idle TTL (forever without one).
// CreateSessionRequest.request_id makes a retry safe: the same request again answers the session
// the first call made (whatever the limits say now), another request under the same id is
// ALREADY_EXISTS, a malformed id INVALID_ARGUMENT, and once the session closes the id makes a
// new one. (A runner that lost an answer had no way but ListSessions by label to find the
// session, which otherwise stayed forever without an idle TTL: probe 27.)
TEST(CreateSessionRequestIdTest, ARetryGetsTheSessionTheFirstCallMade) {
  ServerOptions options;
  options.limits.max_sessions = 1;
  absl::StatusOr<std::unique_ptr<InProcessServer>> server = InProcessServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  v1::CreateSessionRequest request;
  *request.mutable_geometry() = SmallGeometry();
  *request.mutable_policy() = MakePolicy(v1::SELECTOR_RETOPK);
  request.set_max_tokens(64);
  request.set_request_id("8d0f7c1e-retry");
  auto create = [&](const v1::CreateSessionRequest& r, v1::CreateSessionResponse* response) {
    grpc::ClientContext context;
    return FromGrpc((*server)->stub().CreateSession(&context, r, response));
  };
  v1::CreateSessionResponse first, again;
  ASSERT_TRUE(create(request, &first).ok());
  const int64_t one_session = (*server)->server().budget().used();
  ASSERT_TRUE(create(request, &again).ok());  // past --max_sessions=1: it is the same session
  EXPECT_EQ(again.session_id(), first.session_id());
  EXPECT_EQ(again.policy().SerializeAsString(), first.policy().SerializeAsString());
  EXPECT_EQ(again.prompt_queries(), first.prompt_queries());
  EXPECT_EQ((*server)->server().sessions().List().size(), 1u);
  EXPECT_EQ((*server)->server().budget().used(), one_session);
  v1::CreateSessionRequest other = request;
  other.set_label("another");
  v1::CreateSessionResponse refused;
  EXPECT_TRUE(HasStatus(create(other, &refused), absl::StatusCode::kAlreadyExists,
                        absl::StrCat("request_id '8d0f7c1e-retry' made session ",
                                     first.session_id(), " from another request")));
  for (const std::string& bad : {std::string("has space"), std::string(129, 'x'),
                                 std::string("tab\t"), std::string("\xc3\xa9")}) {
    other = request;
    other.set_request_id(bad);
    EXPECT_TRUE(HasStatus(create(other, &refused), absl::StatusCode::kInvalidArgument,
                          "request_id must be 1 to 128 printable ASCII characters"))
        << bad;
  }
  other = request;
  other.clear_request_id();
  EXPECT_EQ(create(other, &refused).code(), absl::StatusCode::kResourceExhausted);
  // Closed, its id makes a new session.
  ASSERT_TRUE(CloseSession((*server)->stub(), first.session_id()).ok());
  ASSERT_TRUE(create(request, &again).ok());
  EXPECT_NE(again.session_id(), first.session_id());
  EXPECT_TRUE(GetSession((*server)->stub(), again.session_id()).ok());
}

// A retry that comes while the first call's answer is being lost (its deadline passed in its
// handler, held there by a test hook) gets the session, and the first call's undo leaves it
// open: the answers are counted, and only the last one lost closes it.
TEST(CreateSessionRequestIdTest, ARetryKeepsTheSessionTheFirstCallsLostAnswerWouldClose) {
  ServerOptions options;
  options.worker_threads = 4;  // the retry is served while the first call's handler sleeps
  std::atomic<int> handled{0};
  std::atomic<bool> first_returned{false};
  options.service_test_hooks.after_create_session = [&handled, &first_returned] {
    if (handled.fetch_add(1) > 0) return;
    absl::SleepFor(absl::Seconds(2));
    first_returned = true;  // its undo follows at once, on this thread
  };
  absl::StatusOr<std::unique_ptr<InProcessServer>> server = InProcessServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  RunningServer& running = (*server)->server();
  v1::CreateSessionRequest request;
  *request.mutable_geometry() = SmallGeometry();
  *request.mutable_policy() = MakePolicy(v1::SELECTOR_FULL);
  request.set_request_id("lost-answer");
  auto create = [&](absl::Duration deadline, v1::CreateSessionResponse* response) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
    return FromGrpc((*server)->stub().CreateSession(&context, request, response));
  };
  v1::CreateSessionResponse lost, retried;
  EXPECT_EQ(create(absl::Seconds(1), &lost).code(), absl::StatusCode::kDeadlineExceeded);
  ASSERT_TRUE(create(absl::Seconds(60), &retried).ok());
  EXPECT_EQ(handled.load(), 2) << "the first call's handler had not made the session";
  ASSERT_TRUE(testing::Within(absl::Seconds(10), [&] { return first_returned.load(); }));
  absl::SleepFor(absl::Milliseconds(200));  // its undo (and gRPC's OnDone) have run
  EXPECT_EQ(running.sessions().List().size(), 1u);
  EXPECT_TRUE(GetSession((*server)->stub(), retried.session_id()).ok())
      << "the first call's lost answer closed the session the retry got";
  // A last lost answer closes it: the retry's own, taken back as the registry's undo does.
  running.sessions().UndoCreate(retried.session_id(), "");
  EXPECT_EQ(running.sessions().List().size(), 0u);
}

TEST(CancelRaceTest, ACreateSessionCancelledWhileItsHandlerRunsLeavesNoSession) {
  ServerOptions options;
  std::atomic<int> handled{0};
  options.service_test_hooks.after_create_session = [&handled] {
    ++handled;
    absl::SleepFor(absl::Seconds(2));
  };
  absl::StatusOr<std::unique_ptr<InProcessServer>> server = InProcessServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  RunningServer& running = (*server)->server();
  v1::CreateSessionRequest request;
  *request.mutable_geometry() = SmallGeometry();
  *request.mutable_policy() = MakePolicy(v1::SELECTOR_FULL);
  request.set_max_tokens(64);
  auto create = [&](absl::Duration deadline) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
    v1::CreateSessionResponse response;
    return FromGrpc((*server)->stub().CreateSession(&context, request, &response));
  };
  // Answered: the session stays.
  ASSERT_TRUE(create(absl::Seconds(60)).ok());
  ASSERT_EQ(running.sessions().List().size(), 1u);
  const int64_t one_session = running.budget().used();
  EXPECT_GT(one_session, 0);
  // The deadline passes in the handler (a second: long enough for the call to reach it on a
  // slow machine, under sanitizers too).
  const absl::Status late = create(absl::Seconds(1));
  EXPECT_EQ(late.code(), absl::StatusCode::kDeadlineExceeded) << late;
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while ((running.busy() || running.sessions().List().size() > 1) && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_EQ(handled.load(), 2) << "the late call's handler did not run: nothing was tested";
  EXPECT_EQ(running.sessions().List().size(), 1u);
  EXPECT_EQ(running.budget().used(), one_session);
}

// A CreateSession whose handler ends just past the call's deadline leaves no session: the
// server checks the deadline itself when the handler returns, so what it made is closed again
// whether or not gRPC's OnCancel (from another thread) has come yet, and an answer that did not
// reach the client (the server's deadline runs later than the client's by the request's transit
// and gRPC's rounding of the timeout) is undone when the call is done. Probe 5 found 31 of 39 such calls leaving a session no client knew of.
// (Which of the three catches it here depends on the timing; the contract is checked.)
// And a call whose deadline passed before the server read it is DEADLINE_EXCEEDED in the
// server's metrics, not INVALID_ARGUMENT (its request never parsed).
TEST(CancelRaceTest, ACreateSessionEndingJustPastItsDeadlineLeavesNoSession) {
  ServerOptions options;
  auto deadline = std::make_shared<std::atomic<int64_t>>(0);  // absl::ToUnixNanos
  options.service_test_hooks.after_create_session = [deadline] {
    while (absl::ToUnixNanos(absl::Now()) < deadline->load()) absl::SleepFor(absl::Microseconds(20));
  };
  absl::StatusOr<std::unique_ptr<InProcessServer>> server = InProcessServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  RunningServer& running = (*server)->server();
  v1::CreateSessionRequest request;
  *request.mutable_geometry() = SmallGeometry();
  *request.mutable_policy() = MakePolicy(v1::SELECTOR_FULL);
  request.set_max_tokens(64);
  // What one session holds (its max_tokens set aside).
  int64_t one_session = 0;
  {
    grpc::ClientContext context;
    v1::CreateSessionResponse response;
    ASSERT_TRUE((*server)->stub().CreateSession(&context, request, &response).ok());
    one_session = running.budget().used();
    ASSERT_GT(one_session, 0);
    ASSERT_TRUE(CloseSession((*server)->stub(), response.session_id()).ok());
  }
  int answered = 0, expired = 0;
  for (int i = 0; i < 20; ++i) {
    const absl::Time at = absl::Now() + absl::Milliseconds(100);
    // Past the server's deadline too (it counts the timeout from the request's arrival, up to
    // a millisecond later after gRPC's rounding, and later still under load).
    deadline->store(absl::ToUnixNanos(at + absl::Milliseconds(20)));
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(at));
    v1::CreateSessionResponse response;
    const absl::Status status =
        FromGrpc((*server)->stub().CreateSession(&context, request, &response));
    EXPECT_TRUE(status.ok() || status.code() == absl::StatusCode::kDeadlineExceeded) << status;
    answered += status.ok();
    expired += status.code() == absl::StatusCode::kDeadlineExceeded;
  }
  EXPECT_GT(expired, 0) << "no call ended past its deadline: nothing was tested";
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (running.busy() && absl::Now() < until) absl::SleepFor(absl::Milliseconds(5));
  // The sessions left are exactly those whose answer the client has.
  EXPECT_EQ(running.sessions().List().size(), static_cast<size_t>(answered));
  EXPECT_EQ(running.budget().used(), answered * one_session);
  // Expired before it was read: the metrics say DEADLINE_EXCEEDED.
  deadline->store(0);
  for (int i = 0; i < 5; ++i) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::microseconds(1));
    v1::GetSessionRequest get;
    get.set_session_id("s-0000000000000000");
    v1::SessionInfo info;
    (*server)->stub().GetSession(&context, get, &info);
  }
  while (running.busy() && absl::Now() < until) absl::SleepFor(absl::Milliseconds(5));
  const std::string metrics = running.metrics().TextFormat();
  EXPECT_THAT(metrics, ::testing::Not(::testing::HasSubstr("code=\"INVALID_ARGUMENT\"")));
}

// One build thread, whose first commit a test hook holds until released, so that a second
// Prefill's commit queues behind it.
class OneBuildThreadTest : public HardeningTest {
 protected:
  struct Hold {
    std::atomic<bool> held{false};
    absl::Notification release;
  };
  ServerOptions Options() const override {
    ServerOptions options;
    options.worker_threads = 1;
    // Shared with the server, which may outlive the fixture's members.
    options.service_test_hooks.before_prefill_commit = [hold = hold_] {
      if (!hold->held.exchange(true)) hold->release.WaitForNotification();
    };
    return options;
  }
  void TearDown() override {
    if (!hold_->release.HasBeenNotified()) hold_->release.Notify();
  }
  const std::shared_ptr<Hold> hold_ = std::make_shared<Hold>();
};

// A Prefill cancelled while its commit waits behind another's build gives its staged prompt
// back when the client hears CANCELLED, not once the queue reaches the commit (which then does
// nothing). Before: the staging stayed charged until then, minutes behind long builds.
TEST_F(OneBuildThreadTest, APrefillCancelledWhileItsCommitQueuesGivesItsStagingBackAtOnce) {
  const v1::Geometry g = SmallGeometry();
  absl::StatusOr<std::string> first = CreateSession(stub(), g, MakePolicy(v1::SELECTOR_FULL));
  ASSERT_TRUE(first.ok()) << first.status();
  PrefillInFlight building(stub(), PromptChunks(*first, g, 0, RandomPromptOf(g, 256, 20), 64));
  AwaitCommit(server().server());  // held by the hook
  absl::StatusOr<std::string> id = CreateSession(stub(), g, MakePolicy(v1::SELECTOR_FULL));
  ASSERT_TRUE(id.ok()) << id.status();
  const int64_t before = server().server().budget().used();
  PrefillInFlight queued(stub(), PromptChunks(*id, g, 0, RandomPromptOf(g, 256, 21), 64));
  const absl::Time until = absl::Now() + absl::Seconds(30);
  while (server().server().service().builds_in_flight() < 2 && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(2));
  }
  ASSERT_EQ(server().server().service().builds_in_flight(), 2) << "the second commit queued";
  EXPECT_GT(server().server().budget().used(), before) << "its prompt staged";
  queued.Cancel();
  EXPECT_EQ(queued.Finish().status().code(), absl::StatusCode::kCancelled);
  // (The client hears CANCELLED at once; the server learns of it a moment later.)
  const absl::Time released = absl::Now() + absl::Seconds(5);
  while (server().server().budget().used() != before && absl::Now() < released) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_EQ(server().server().budget().used(), before);
  EXPECT_EQ(server().server().service().builds_in_flight(), 2) << "the first commit still held";
  // The first commit, released, is answered, and the second session can take its prompt.
  hold_->release.Notify();
  ASSERT_TRUE(building.Finish().ok());
  absl::StatusOr<v1::PrefillResponse> again =
      Prefill(stub(), PromptChunks(*id, g, 0, RandomPromptOf(g, 256, 21), 64));
  ASSERT_TRUE(again.ok()) << again.status();
}

TEST(HardeningProcessTest, ExitsWithinTheGraceWhileWorkStillRuns) {
  // Before: a call in flight outlived the grace (gRPC's Shutdown waited for the handler).
  std::unique_ptr<KvrecalldProcess> server = StartKvrecalld({"--shutdown_grace_seconds=0.5"});
  ASSERT_NE(server, nullptr);
  auto stub = v1::KvRecall::NewStub(MakeChannel(server->address()));
  SlowPrefill slow(*stub, /*heavy=*/true);
  PrefillInFlight prefill(*stub, slow.chunks);
  // Every chunk is written: the server stages the last ones and starts the build. (Signalled
  // soon after, not seconds after: on a machine with a GPU the build's top-k lists take
  // milliseconds, and the whole build about a second; d85 once saw it end within 2 s.)
  absl::SleepFor(absl::Milliseconds(200));
  const absl::Time signalled = absl::Now();
  absl::StatusOr<int> status = server->Stop(SIGTERM, absl::Seconds(60));
  ASSERT_TRUE(status.ok()) << status.status();
  const absl::Duration exit_time = absl::Now() - signalled;
  EXPECT_EQ(WEXITSTATUS(*status), 0) << server->output();
  EXPECT_LT(exit_time, absl::Seconds(2.5)) << server->output();
  // The client learns that its prompt was not committed.
  const absl::Status answer = prefill.Finish().status();
  // The service's answer where the build stopped within the grace, else gRPC's at its end.
  EXPECT_EQ(answer.code(), absl::StatusCode::kUnavailable) << answer;
  EXPECT_THAT(
      std::string(answer.message()),
      ::testing::AnyOf(HasSubstr("kvrecalld is shutting down"), HasSubstr("Cancelling all calls")));
}

}  // namespace
}  // namespace kvrecall
