// PLACEMENT_GPU served by an in-process server over loopback gRPC (skipped without a CUDA
// device): outputs against brute force (full, streaming, exact top-K) and against the CPU
// placement fed the same tokens (ReTopK: path per head, path mix, output cosine); a batch of 8
// sessions in one request equal to each stepped alone; the bad inputs of the CPU suite answered
// with the same codes; what the GPU placement refuses at CreateSession; the GPU memory budget
// enforced at admission and at growth, a refused step leaving the session as it was; and a
// stream's pinned host buffers charged to the host budget.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/fidelity.h"
#include "server/backends/captured_step_charge.h"
#include "server/memory_budget.h"
#include "tests/server_fixture.h"
#include "tests/test_util.h"

namespace kvrecall {
namespace {

using ::testing::HasSubstr;
using ::kvrecall::testing::CreateSession;
using ::kvrecall::testing::DecodeClient;
using ::kvrecall::testing::ExpectOutputNear;
using ::kvrecall::testing::GetSession;
using ::kvrecall::testing::HasStatus;
using ::kvrecall::testing::InProcessServer;
using ::kvrecall::testing::MakeGeometry;
using ::kvrecall::testing::MakePolicy;
using ::kvrecall::testing::Prefill;
using ::kvrecall::testing::PrefilledSessionTest;
using ::kvrecall::testing::ReferenceSession;
using ::kvrecall::testing::ReferenceTopK;
using ::kvrecall::testing::TensorValues;
using ::kvrecall::testing::Within;

v1::Policy GpuPolicy(v1::Selector selector, int top_k = 0,
                     std::optional<int> sinks = std::nullopt,
                     std::optional<int> recent = std::nullopt) {
  v1::Policy p = MakePolicy(selector, top_k, sinks, recent);
  p.set_placement(v1::PLACEMENT_GPU);
  return p;
}

// Every test runs twice: decode steps replaying captured CUDA graphs (the default) and launched
// eagerly (--cuda_graphs=false).
class GpuPlacementTest : public PrefilledSessionTest, public ::testing::WithParamInterface<bool> {
 protected:
  ServerOptions Options() const override {
    ServerOptions options;
    options.placements.cuda_graphs = GetParam();
    return options;
  }
  void SetUp() override {
    PrefilledSessionTest::SetUp();
    if (server().server().placements().gpu().empty()) GTEST_SKIP() << "no CUDA device";
  }

  // One decode token of layer 0 for every session in `ids`, in one request.
  absl::StatusOr<v1::DecodeResponse> StepAll(DecodeClient& client,
                                              const std::vector<std::string>& ids,
                                              const std::vector<ReferenceSession::Token>& tokens,
                                              const ReferenceSession& ref, bool compare = false) {
    v1::DecodeRequest request;
    request.set_layer(0);
    request.set_return_lse(true);
    request.set_diagnostics(true);
    request.set_compare_exact(compare);
    for (size_t i = 0; i < ids.size(); ++i) *request.add_steps() = ref.Step(ids[i], tokens[i]);
    return client.Step(request);
  }
};

// Geometries the GPU kernels serve: tinylm-a's and Llama-3-8B's, and f16 at a softmax scale of
// 1 (a model that scales its queries in their projection), past ln 2, where f16's kernels apply
// the scale to the scores rather than to the query (kernels/cuda/mma.cuh, ScoreFactor).
struct GpuGeometry {
  int q_heads, kv_heads, head_dim;
  v1::DType dtype;
  float softmax_scale = 0.0f;  // 0: the server's 1 / sqrt(head_dim)

  v1::Geometry Of(int layers) const {
    v1::Geometry g = MakeGeometry(layers, q_heads, kv_heads, head_dim, dtype);
    g.set_softmax_scale(softmax_scale);
    return g;
  }
};
constexpr GpuGeometry kGeometries[] = {{8, 2, 64, v1::DTYPE_BF16},
                                       {32, 8, 128, v1::DTYPE_BF16},
                                       {8, 8, 64, v1::DTYPE_F16},
                                       {8, 2, 64, v1::DTYPE_F16, 1.0f}};

TEST_P(GpuPlacementTest, FullStreamingAndExactTopKMatchBruteForce) {
  for (const GpuGeometry& geo : kGeometries) {
    const v1::Geometry g = geo.Of(2);
    ReferenceSession ref(g, 1500, 11);
    const std::vector<v1::Policy> policies = {GpuPolicy(v1::SELECTOR_FULL),
                                              GpuPolicy(v1::SELECTOR_STREAMING, 0, 16, 64),
                                              GpuPolicy(v1::SELECTOR_EXACT_TOPK, 64)};
    std::vector<std::string> ids;
    for (const v1::Policy& p : policies) ids.push_back(CreateAndPrefill(ref, p, 700));
    for (const std::string& id : ids) {
      absl::StatusOr<v1::SessionInfo> info = GetSession(stub(), id);
      ASSERT_TRUE(info.ok()) << info.status();
      EXPECT_EQ(info->device(), "cuda:0");
      EXPECT_GE(info->gpu_bytes(), 2 * 2 * 1500 * geo.kv_heads * geo.head_dim * 2);
      EXPECT_EQ(info->host_bytes(), 0);
    }
    DecodeClient client(stub());
    for (int step = 0; step < 6; ++step) {
      // The same token for all three sessions; the reference records it once.
      const ReferenceSession::Token token = ref.MakeToken(1000 + step);
      const std::vector<float> q = ref.Record(0, token);
      absl::StatusOr<v1::DecodeResponse> reply =
          StepAll(client, ids, {token, token, token}, ref, /*compare=*/true);
      ASSERT_TRUE(reply.ok()) << reply.status();
      ASSERT_EQ(reply->results_size(), 3);
      const int64_t n = ref.tokens(0);
      for (int s = 0; s < 3; ++s) {
        const v1::SequenceResult& result = reply->results(s);
        EXPECT_EQ(result.position(), n - 1);
        std::vector<std::vector<int32_t>> supports(g.q_heads());
        for (int h = 0; h < g.q_heads(); ++h) {
          const int kv_head = KvHeadOf(h, g.q_heads(), g.kv_heads());
          if (s == 0) supports[h] = testing::AllTokens(n);
          if (s == 1) {
            for (int64_t t = 0; t < n; ++t) {
              if (t < 16 || t >= n - 64) supports[h].push_back(static_cast<int32_t>(t));
            }
          }
          if (s == 2) {
            supports[h] = ReferenceTopK(q.data() + h * g.head_dim(), ref.view(0), kv_head,
                                        ref.scale(), 64);
          }
          const v1::HeadDiagnostics& head = result.heads(h);
          EXPECT_EQ(head.path(), v1::PATH_EXACT);
          EXPECT_EQ(head.support(), static_cast<int32_t>(supports[h].size()));
          if (s == 0) {
            EXPECT_GT(head.output_cosine(), 0.99999f);
            EXPECT_NEAR(head.retained_mass(), 1.0f, 1e-4f);
          }
          // The shadow's exact top-K is the support itself: recall 1 up to ties at the K-th.
          if (s == 2) EXPECT_GE(head.support_recall(), 0.98f) << "head " << h;
        }
        ExpectOutputNear(TensorValues(result.output()), ref.Attention(0, q, supports), g.dtype(),
                         absl::StrCat("geometry q", geo.q_heads, " d", geo.head_dim, " session ",
                                      s, " step ", step));
      }
    }
  }
}

// Decode queries that drift slowly (cosine ~0.95 step to step) and jump away once: reuse,
// fallback and refresh steps all occur.
std::vector<ReferenceSession::Token> DriftingTokens(const ReferenceSession& ref, int steps,
                                                    uint64_t seed) {
  const v1::Geometry& g = ref.geometry();
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  // Start from the prompt's last query, so that the seeded caches are similar.
  const int64_t q_row = int64_t{g.q_heads()} * g.head_dim();
  std::vector<float> q(ref.prompt(0).q.end() - q_row, ref.prompt(0).q.end());
  std::vector<ReferenceSession::Token> tokens;
  for (int s = 0; s < steps; ++s) {
    ReferenceSession::Token t = ref.MakeToken(seed + 10 * s);
    for (float& x : q) x = 0.97f * x + 0.3f * normal(rng);
    t.q = s == steps / 2 ? testing::RandomNormal(q_row, seed + 999, 1.5f) : q;
    tokens.push_back(std::move(t));
  }
  return tokens;
}

TEST_P(GpuPlacementTest, ReTopKTakesTheCpuPlacementsPathsAndOutputs) {
  for (const GpuGeometry& geo : kGeometries) {
    const v1::Geometry g = geo.Of(1);
    // Prompt queries that drift too, so that the seeded caches hold similar queries.
    ReferenceSession ref(g, 2000, 21);
    for (bool auto_tau : {false, true}) {
      v1::Policy cpu = MakePolicy(v1::SELECTOR_RETOPK, 64);
      cpu.mutable_retopk()->set_tau(0.6f);
      cpu.mutable_retopk()->set_refresh_interval(16);
      cpu.mutable_retopk()->set_auto_tau(auto_tau);
      v1::Policy gpu = cpu;
      gpu.set_placement(v1::PLACEMENT_GPU);
      const std::string cpu_id = CreateAndPrefill(ref, cpu, 2000);
      const std::string gpu_id = CreateAndPrefill(ref, gpu, 512);
      const std::vector<ReferenceSession::Token> tokens = DriftingTokens(ref, 40, 77);
      DecodeClient client(stub());
      int same_path = 0, heads = 0;
      for (const ReferenceSession::Token& token : tokens) {
        absl::StatusOr<v1::DecodeResponse> reply =
            StepAll(client, {cpu_id, gpu_id}, {token, token}, ref);
        ASSERT_TRUE(reply.ok()) << reply.status();
        const std::vector<float> o_cpu = TensorValues(reply->results(0).output());
        const std::vector<float> o_gpu = TensorValues(reply->results(1).output());
        for (int h = 0; h < g.q_heads(); ++h) {
          ++heads;
          same_path += reply->results(0).heads(h).path() == reply->results(1).heads(h).path();
          EXPECT_NEAR(reply->results(0).heads(h).best_cosine(),
                      reply->results(1).heads(h).best_cosine(), 1e-4f);
          EXPECT_GT(OutputCosine(o_cpu.data() + h * g.head_dim(), o_gpu.data() + h * g.head_dim(),
                                 g.head_dim()),
                    0.999)
              << "head " << h;
        }
      }
      EXPECT_GE(same_path, heads * 99 / 100) << "geometry q" << geo.q_heads;
      absl::StatusOr<v1::SessionInfo> a = GetSession(stub(), cpu_id);
      absl::StatusOr<v1::SessionInfo> b = GetSession(stub(), gpu_id);
      ASSERT_TRUE(a.ok() && b.ok());
      const double total = static_cast<double>(heads);
      EXPECT_NEAR(a->paths().reuse() / total, b->paths().reuse() / total, 0.01);
      EXPECT_NEAR(a->paths().fallback() / total, b->paths().fallback() / total, 0.01);
      EXPECT_EQ(a->paths().refresh(), b->paths().refresh());
      if (!auto_tau) EXPECT_GT(b->paths().reuse(), 0);  // random prompts may calibrate to never
      EXPECT_GT(b->paths().fallback() + b->paths().refresh(), 0);
      EXPECT_GT(b->selector_bytes(), 0) << "the caches live on the GPU";
    }
  }
}

TEST_P(GpuPlacementTest, ABatchOfEightEqualsEachSessionAlone) {
  const v1::Geometry g = MakeGeometry(1, 32, 8, 128, v1::DTYPE_BF16);
  for (v1::Selector selector : {v1::SELECTOR_FULL, v1::SELECTOR_EXACT_TOPK, v1::SELECTOR_RETOPK}) {
    std::vector<std::unique_ptr<ReferenceSession>> refs;
    std::vector<std::string> batched, alone;
    for (int b = 0; b < 8; ++b) {
      refs.push_back(std::make_unique<ReferenceSession>(g, 600 + 97 * b, 300 + b));  // ragged
      batched.push_back(CreateAndPrefill(*refs[b], GpuPolicy(selector, 64), 256));
      alone.push_back(CreateAndPrefill(*refs[b], GpuPolicy(selector, 64), 256));
    }
    DecodeClient client(stub());
    for (int step = 0; step < 5; ++step) {
      std::vector<ReferenceSession::Token> tokens;
      v1::DecodeRequest together;
      together.set_diagnostics(true);
      for (int b = 0; b < 8; ++b) {
        tokens.push_back(refs[b]->MakeToken(5000 + 10 * step + b));
        *together.add_steps() = refs[b]->Step(batched[b], tokens[b]);
      }
      absl::StatusOr<v1::DecodeResponse> all = client.Step(together);
      ASSERT_TRUE(all.ok()) << all.status();
      for (int b = 0; b < 8; ++b) {
        v1::DecodeRequest one;
        one.set_diagnostics(true);
        *one.add_steps() = refs[b]->Step(alone[b], tokens[b]);
        absl::StatusOr<v1::DecodeResponse> single = client.Step(one);
        ASSERT_TRUE(single.ok()) << single.status();
        const std::vector<float> x = TensorValues(all->results(b).output());
        const std::vector<float> y = TensorValues(single->results(0).output());
        ASSERT_EQ(x.size(), y.size());
        for (size_t i = 0; i < x.size(); ++i) {
          // One bf16 rounding step apart at most (the split plan depends on the batch).
          ASSERT_NEAR(x[i], y[i], std::abs(y[i]) * 0x1p-7 + 1e-5)
              << v1::Selector_Name(selector) << " sequence " << b << " element " << i;
        }
        for (int h = 0; h < g.q_heads(); ++h) {
          EXPECT_EQ(all->results(b).heads(h).path(), single->results(0).heads(h).path());
          EXPECT_EQ(all->results(b).heads(h).support(), single->results(0).heads(h).support());
        }
      }
    }
  }
}

TEST_P(GpuPlacementTest, BadInputsGetTheCodesOfTheCpuPlacement) {
  const v1::Geometry g = MakeGeometry(2, 8, 2, 64, v1::DTYPE_BF16);
  ReferenceSession ref(g, 300, 5);
  const std::string cpu = CreateAndPrefill(ref, MakePolicy(v1::SELECTOR_EXACT_TOPK, 32), 300);
  const std::string gpu = CreateAndPrefill(ref, GpuPolicy(v1::SELECTOR_EXACT_TOPK, 32), 300);
  const ReferenceSession::Token token = ref.MakeToken(9);
  struct Bad {
    const char* what;
    std::function<void(v1::DecodeRequest&)> spoil;
  };
  const std::vector<Bad> cases = {
      {"layer out of range", [](v1::DecodeRequest& r) { r.set_layer(7); }},
      {"q of the wrong shape", [](v1::DecodeRequest& r) { r.mutable_steps(0)->mutable_q()->set_shape(0, 3); }},
      {"k_new of the wrong dtype",
       [](v1::DecodeRequest& r) { r.mutable_steps(0)->mutable_k_new()->set_dtype(v1::DTYPE_F16); }},
      {"v_new truncated",
       [](v1::DecodeRequest& r) { r.mutable_steps(0)->mutable_v_new()->mutable_data()->resize(10); }},
      {"a NaN in q",
       [](v1::DecodeRequest& r) {
         std::string& d = *r.mutable_steps(0)->mutable_q()->mutable_data();
         d[0] = '\xc0';
         d[1] = '\x7f';  // bf16 NaN
       }},
      {"an unknown session", [](v1::DecodeRequest& r) { r.mutable_steps(0)->set_session_id("s-0"); }},
  };
  for (const Bad& c : cases) {
    absl::StatusCode codes[2];
    for (int i = 0; i < 2; ++i) {
      v1::DecodeRequest request;
      *request.add_steps() = ref.Step(i == 0 ? cpu : gpu, token);
      c.spoil(request);
      DecodeClient client(stub());
      codes[i] = client.Step(request).status().code();
    }
    EXPECT_EQ(codes[0], codes[1]) << c.what;
    EXPECT_NE(codes[1], absl::StatusCode::kOk) << c.what;
  }
  // Nothing was appended by any of them.
  for (const std::string& id : {cpu, gpu}) {
    absl::StatusOr<v1::SessionInfo> info = GetSession(stub(), id);
    ASSERT_TRUE(info.ok());
    EXPECT_THAT(info->layer_tokens(), ::testing::ElementsAre(300, 300));
  }
  // A layer not prefilled yet, on the GPU as on the CPU.
  absl::StatusOr<std::string> fresh = CreateSession(stub(), g, GpuPolicy(v1::SELECTOR_FULL));
  ASSERT_TRUE(fresh.ok());
  v1::DecodeRequest request;
  *request.add_steps() = ref.Step(*fresh, token);
  DecodeClient client(stub());
  EXPECT_TRUE(HasStatus(client.Step(request).status(), absl::StatusCode::kFailedPrecondition,
                        "has no prompt yet"));
}

TEST_P(GpuPlacementTest, WhatTheGpuDoesNotServeIsRefusedAtCreateSession) {
  struct Case {
    v1::Geometry geometry;
    v1::Policy policy;
    const char* message;
  };
  v1::Policy big_cache = GpuPolicy(v1::SELECTOR_RETOPK, 64);
  big_cache.mutable_retopk()->set_cache_capacity(65);
  big_cache.mutable_retopk()->set_reuse_neighbors(4);
  const std::vector<Case> cases = {
      {MakeGeometry(1, 8, 2, 64, v1::DTYPE_F32), GpuPolicy(v1::SELECTOR_FULL), "geometry.dtype"},
      {MakeGeometry(1, 8, 2, 96, v1::DTYPE_BF16), GpuPolicy(v1::SELECTOR_FULL),
       "geometry.head_dim 96"},
      {MakeGeometry(1, 8, 2, 64, v1::DTYPE_BF16), GpuPolicy(v1::SELECTOR_INDEX),
       "policy.selector SELECTOR_INDEX"},
      {MakeGeometry(1, 8, 2, 64, v1::DTYPE_BF16), big_cache, "policy.retopk"},
      // The selection holds a row's K positions in shared memory (d180: K = 2^20 was admitted,
      // then its first step failed with INTERNAL).
      {MakeGeometry(1, 8, 2, 64, v1::DTYPE_BF16), GpuPolicy(v1::SELECTOR_EXACT_TOPK, 1 << 20),
       "policy.top_k 1048576 is not served by PLACEMENT_GPU on cuda:0: a top-K selection of "
       "1048576 a row holds 8 bytes a position in shared memory"},
  };
  for (const Case& c : cases) {
    EXPECT_TRUE(HasStatus(CreateSession(stub(), c.geometry, c.policy).status(),
                          absl::StatusCode::kInvalidArgument, c.message));
  }
  grpc::ClientContext context;
  v1::ListSessionsResponse list;
  ASSERT_TRUE(stub().ListSessions(&context, {}, &list).ok());
  EXPECT_EQ(list.sessions_size(), 0);
}

// A Decode stream's captured step is charged to the GPU budget while the stream keeps it
// (gpu::kCapturedStepDeviceBytes, review 13's L5): with the same session and steps, a server
// that captures holds exactly one step's charge more than one that launches eagerly, and both
// hold the same (their sessions' KV) once their streams are gone.
TEST_P(GpuPlacementTest, AKeptCapturedStepIsChargedToTheGpuBudget) {
  ServerOptions options = Options();
  options.placements.cuda_graphs = !GetParam();
  absl::StatusOr<std::unique_ptr<InProcessServer>> other = InProcessServer::Start(options);
  ASSERT_TRUE(other.ok()) << other.status();
  auto gpu_used = [](InProcessServer& server) {
    return server.server().placements().gpu().front()->device_budget()->used();
  };
  const v1::Geometry g = MakeGeometry(1, 8, 2, 64, v1::DTYPE_BF16);
  ReferenceSession ref(g, 300, 41);
  const std::string id = CreateAndPrefill(ref, GpuPolicy(v1::SELECTOR_FULL), 300);
  const std::string other_id =
      CreateAndPrefill(ref, GpuPolicy(v1::SELECTOR_FULL), 300, other->get());
  ASSERT_EQ(gpu_used(**other), gpu_used(server()));
  int64_t open = 0;
  {
    DecodeClient client(stub()), other_client((*other)->stub());
    for (int step = 0; step < 3; ++step) {
      const ReferenceSession::Token token = ref.MakeToken(step);
      ref.Record(0, token);
      ASSERT_TRUE(StepAll(client, {id}, {token}, ref).ok());
      ASSERT_TRUE(StepAll(other_client, {other_id}, {token}, ref).ok());
    }
    const int64_t captured = gpu::kCapturedStepDeviceBytes;
    EXPECT_EQ(gpu_used(server()) - gpu_used(**other), GetParam() ? captured : -captured);
    open = std::max(gpu_used(server()), gpu_used(**other));
  }
  // The streams' contexts go when their calls end, after the clients see them end; the
  // sessions' KV, grown by the steps, stays.
  for (int wait = 0; wait < 200 && (gpu_used(server()) != gpu_used(**other) ||
                                    gpu_used(server()) + gpu::kCapturedStepDeviceBytes >= open);
       ++wait) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(gpu_used(server()), gpu_used(**other));
  EXPECT_LT(gpu_used(server()) + gpu::kCapturedStepDeviceBytes, open) << "workspaces given back";
}

// A server whose GPU budget is 128 MiB.
class GpuBudgetTest : public GpuPlacementTest {
 protected:
  ServerOptions Options() const override {
    ServerOptions options = GpuPlacementTest::Options();
    options.placements.gpu_memory_budget_bytes = 128 << 20;
    return options;
  }
};

TEST_P(GpuBudgetTest, AdmissionAndGrowthAreRefusedAndChangeNothing) {
  const v1::Geometry g = MakeGeometry(1, 8, 8, 128, v1::DTYPE_BF16);  // 4 KiB of KV a token
  v1::CreateSessionRequest request;
  *request.mutable_geometry() = g;
  *request.mutable_policy() = GpuPolicy(v1::SELECTOR_FULL);
  request.set_max_tokens(100000);  // 410 MB
  v1::CreateSessionResponse response;
  grpc::ClientContext context;
  EXPECT_TRUE(HasStatus(testing::FromGrpc(stub().CreateSession(&context, request, &response)),
                        absl::StatusCode::kResourceExhausted, "GPU 0 memory budget exceeded"));

  // A prompt of 8000 tokens (33 MB) fits; decoding grows the KV geometrically (with the old
  // allocation held while the content moves) until a growth does not fit.
  ReferenceSession ref(g, 8000, 3);
  const std::string id = CreateAndPrefill(ref, GpuPolicy(v1::SELECTOR_FULL), 500);
  absl::StatusOr<v1::SessionInfo> before = GetSession(stub(), id);
  ASSERT_TRUE(before.ok());
  absl::Status refused;
  int steps = 0;
  {
    DecodeClient client(stub());
    for (; steps < 20000 && refused.ok(); ++steps) {
      v1::DecodeRequest step;
      *step.add_steps() = ref.Step(id, ref.MakeToken(steps));
      refused = client.Step(step).status();
    }
  }
  EXPECT_TRUE(HasStatus(refused, absl::StatusCode::kResourceExhausted,
                        "GPU 0 memory budget exceeded"));
  absl::StatusOr<v1::SessionInfo> after = GetSession(stub(), id);
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->tokens(), 8000 + steps - 1) << "the refused step appended nothing";
  EXPECT_LE(after->gpu_bytes(), 128 << 20);
  // The session still serves a step once memory is free again: close nothing, just retry on a
  // new stream with a budget that now holds only this session — still refused, still intact.
  DecodeClient client(stub());
  v1::DecodeRequest step;
  *step.add_steps() = ref.Step(id, ref.MakeToken(99999));
  EXPECT_EQ(client.Step(step).status().code(), absl::StatusCode::kResourceExhausted);
  absl::StatusOr<v1::SessionInfo> still = GetSession(stub(), id);
  ASSERT_TRUE(still.ok());
  EXPECT_EQ(still->tokens(), after->tokens());

  // Admission with an announced length that fits sets it aside; decoding up to it never fails.
  grpc::ClientContext close_context;
  v1::CloseSessionRequest close;
  close.set_session_id(id);
  v1::CloseSessionResponse closed;
  ASSERT_TRUE(stub().CloseSession(&close_context, close, &closed).ok());
  ReferenceSession small(g, 1000, 4);
  v1::CreateSessionRequest announced;
  *announced.mutable_geometry() = g;
  *announced.mutable_policy() = GpuPolicy(v1::SELECTOR_FULL);
  announced.set_max_tokens(1100);
  grpc::ClientContext create_context;
  ASSERT_TRUE(stub().CreateSession(&create_context, announced, &response).ok());
  ASSERT_TRUE(Prefill(stub(), small.InterleavedPrompt(response.session_id(), 1000)).ok());
  absl::StatusOr<v1::SessionInfo> reserved = GetSession(stub(), response.session_id());
  ASSERT_TRUE(reserved.ok());
  EXPECT_GE(reserved->gpu_bytes(), 1100 * 4096);
  DecodeClient decode(stub());
  for (int s = 0; s < 100; ++s) {
    v1::DecodeRequest r;
    *r.add_steps() = small.Step(response.session_id(), small.MakeToken(s));
    ASSERT_TRUE(decode.Step(r).ok()) << "step " << s;
  }
  absl::StatusOr<v1::SessionInfo> grown = GetSession(stub(), response.session_id());
  ASSERT_TRUE(grown.ok());
  EXPECT_EQ(grown->gpu_bytes(), reserved->gpu_bytes()) << "no reallocation up to max_tokens";
}

// A request of a cpu session and two gpu sessions whose batch needs a larger workspace than the
// GPU's budget has left: the GPU refuses it after validation, in its Step. The gpu sessions step
// before the cpu one (server/decode.cc), so no token of the request is appended, the cpu
// session's included, and the refusal says so; with room again the same request is served and
// matches brute force.
TEST_P(GpuBudgetTest, ARequestTheGpuRefusesInItsStepAppendsNoToken) {
  // Llama-3-8B's heads: a batch of 2 needs ~8.5 MB more attention workspace than a batch of 1
  // (32 more rows of 512 splits), more than a set-aside's rounding leaves of the budget below.
  const v1::Geometry g = MakeGeometry(1, 32, 8, 128, v1::DTYPE_BF16);
  ReferenceSession cpu_ref(g, 64, 91), a_ref(g, 64, 93), b_ref(g, 64, 95);
  const std::string cpu = CreateAndPrefill(cpu_ref, MakePolicy(v1::SELECTOR_FULL), 64);
  const std::string a = CreateAndPrefill(a_ref, GpuPolicy(v1::SELECTOR_FULL), 64);
  const std::string b = CreateAndPrefill(b_ref, GpuPolicy(v1::SELECTOR_FULL), 64);
  {
    // Each gpu session alone first: the stream's workspaces and buffers for a batch of 1.
    DecodeClient client(stub());
    for (auto [ref, id] : {std::pair{&a_ref, a}, std::pair{&b_ref, b}}) {
      v1::DecodeRequest alone;
      const ReferenceSession::Token token = ref->MakeToken(700);
      *alone.add_steps() = ref->Step(id, token);
      ASSERT_TRUE(client.Step(alone).ok());
      ref->Record(0, token);
    }
  }
  // The budget filled by a session's set-aside (max_tokens), as far as admission lets it.
  MemoryBudget& budget = *server().server().placements().gpu().front()->device_budget();
  // (The stream's workspaces go with it, once gRPC is done with its call.)
  Within(absl::Seconds(5), [&] { return server().server().service().open_streams() == 0; });
  const int64_t base = budget.used();
  // (A closed session's memory is given back when its last reference goes: waited for.)
  auto back_to_base = [&] {
    return Within(absl::Seconds(5), [&] { return budget.used() <= base; });
  };
  int64_t lo = 0, hi = budget.available() / 256 + 1;  // set-asides of lo tokens fit, hi's not
  auto create_filler = [&](int64_t tokens) -> absl::StatusOr<std::string> {
    v1::CreateSessionRequest request;
    *request.mutable_geometry() = g;
    *request.mutable_policy() = GpuPolicy(v1::SELECTOR_FULL);
    request.set_max_tokens(tokens);
    v1::CreateSessionResponse response;
    grpc::ClientContext context;
    absl::Status s = testing::FromGrpc(stub().CreateSession(&context, request, &response));
    if (!s.ok()) return s;
    return response.session_id();
  };
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    absl::StatusOr<std::string> filler = create_filler(mid);
    if (filler.ok()) {
      lo = mid;
      ASSERT_TRUE(testing::CloseSession(stub(), *filler).ok());
      ASSERT_TRUE(back_to_base()) << budget.used() << " used, " << base << " before";
    } else {
      ASSERT_EQ(filler.status().code(), absl::StatusCode::kResourceExhausted) << filler.status();
      hi = mid;
    }
  }
  ASSERT_GT(lo, 0);
  absl::StatusOr<std::string> filler = create_filler(lo);
  ASSERT_TRUE(filler.ok()) << filler.status();

  const std::vector<ReferenceSession::Token> tokens = {
      cpu_ref.MakeToken(801), a_ref.MakeToken(803), b_ref.MakeToken(805)};
  v1::DecodeRequest request;  // the cpu session first
  request.set_layer(0);
  *request.add_steps() = cpu_ref.Step(cpu, tokens[0]);
  *request.add_steps() = a_ref.Step(a, tokens[1]);
  *request.add_steps() = b_ref.Step(b, tokens[2]);
  {
    DecodeClient client(stub());
    EXPECT_TRUE(HasStatus(client.Step(request).status(), absl::StatusCode::kResourceExhausted,
                          "no token of this request was appended"))
        << budget.available() << " bytes of the budget left";
  }
  for (const auto& [id, tokens_held] : {std::pair{cpu, 64}, std::pair{a, 65}, std::pair{b, 65}}) {
    absl::StatusOr<v1::SessionInfo> info = GetSession(stub(), id);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->tokens(), tokens_held) << id;
  }

  ASSERT_TRUE(testing::CloseSession(stub(), *filler).ok());
  ASSERT_TRUE(back_to_base()) << budget.used() << " used, " << base << " before";
  DecodeClient client(stub());
  absl::StatusOr<v1::DecodeResponse> reply = client.Step(request);
  ASSERT_TRUE(reply.ok()) << reply.status();
  ReferenceSession* refs[] = {&cpu_ref, &a_ref, &b_ref};
  for (int i = 0; i < 3; ++i) {
    const std::vector<float> q = refs[i]->Record(0, tokens[i]);
    const std::vector<std::vector<int32_t>> all(g.q_heads(),
                                                testing::AllTokens(refs[i]->tokens(0)));
    ExpectOutputNear(TensorValues(reply->results(i).output()), refs[i]->Attention(0, q, all),
                     g.dtype(), absl::StrCat("steps[", i, "]"));
  }
}

// A server whose host memory budget is 1 MiB.
class GpuHostBudgetTest : public GpuPlacementTest {
 protected:
  ServerOptions Options() const override {
    ServerOptions options = GpuPlacementTest::Options();
    options.host_memory_budget_bytes = 1 << 20;
    return options;
  }
};

// A Decode stream's pinned host buffers (what its GPU steps are copied through) are host memory
// no other use can take back: they are charged to the host budget while the stream lives, and
// hold only what comes down. An exact_topk session of K = 16384 over 32 query heads downloads
// 2 MiB of supports only when compare_exact asks for them; before, every step kept that much
// pinned, uncharged, on every stream (with K = 2^20, which the GPU then admitted, 128 MiB).
TEST_P(GpuHostBudgetTest, AStreamsPinnedBuffersAreChargedToTheHostBudget) {
  const v1::Geometry g = MakeGeometry(1, 32, 1, 64, v1::DTYPE_BF16);
  ReferenceSession ref(g, 64, 97);
  const std::string id = CreateAndPrefill(ref, GpuPolicy(v1::SELECTOR_EXACT_TOPK, 16384), 64);
  ASSERT_FALSE(id.empty());
  MemoryBudget& budget = const_cast<MemoryBudget&>(server().server().budget());
  Within(absl::Seconds(5), [&] { return server().server().service().open_streams() == 0; });
  const int64_t base = budget.used();
  {
    DecodeClient client(stub());
    const ReferenceSession::Token token = ref.MakeToken(901);
    absl::StatusOr<v1::DecodeResponse> reply = StepAll(client, {id}, {token}, ref);
    ASSERT_TRUE(reply.ok()) << reply.status();
    ref.Record(0, token);
    const int64_t held = budget.used() - base;
    EXPECT_GT(held, 0) << "the stream's pinned buffers are charged";
    EXPECT_LT(held, 256 << 10) << "without the supports, which do not come down";
    // The supports would come down: 2 MiB of pinned memory, past the budget.
    const ReferenceSession::Token next = ref.MakeToken(902);
    {
      DecodeClient refused(stub());  // (a failed step ends its stream)
      EXPECT_TRUE(HasStatus(StepAll(refused, {id}, {next}, ref, /*compare=*/true).status(),
                            absl::StatusCode::kResourceExhausted, "a decode step's pinned output"));
    }
    absl::StatusOr<v1::SessionInfo> info = GetSession(stub(), id);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->tokens(), 65) << "the refused step appended nothing";
    reply = StepAll(client, {id}, {next}, ref);
    ASSERT_TRUE(reply.ok()) << reply.status();
  }
  // Given back with the stream's context, once gRPC is done with its call.
  EXPECT_TRUE(Within(absl::Seconds(5), [&] { return budget.used() == base; }))
      << budget.used() << " used, " << base << " before";
}

// --gpu_memory_budget_per_tenant_gb: a tenant's sessions hold at most its share of each GPU's
// budget (here the one tenant of a server without tokens), refused naming the tenant's budget,
// charged within the device's, and given back when a session closes.
class GpuTenantBudgetTest : public GpuPlacementTest {
 protected:
  ServerOptions Options() const override {
    ServerOptions options = GpuPlacementTest::Options();
    options.placements.gpu_memory_budget_bytes = 512 << 20;
    options.limits.gpu_bytes_per_tenant = 128 << 20;
    return options;
  }
};

TEST_P(GpuTenantBudgetTest, ATenantsSessionsHoldAtMostItsShareOfTheGpu) {
  const v1::Geometry g = MakeGeometry(1, 8, 8, 128, v1::DTYPE_BF16);  // 4 KiB of KV a token
  auto create = [&](int64_t max_tokens) -> absl::StatusOr<std::string> {
    v1::CreateSessionRequest request;
    *request.mutable_geometry() = g;
    *request.mutable_policy() = GpuPolicy(v1::SELECTOR_FULL);
    request.set_max_tokens(max_tokens);
    v1::CreateSessionResponse response;
    grpc::ClientContext context;
    absl::Status s = testing::FromGrpc(stub().CreateSession(&context, request, &response));
    if (!s.ok()) return s;
    return response.session_id();
  };
  MemoryBudget* device = server().server().placements().gpu().front()->device_budget();
  const int64_t before = device->used();
  absl::StatusOr<std::string> first = create(20000);  // 82 MB of the tenant's 134
  ASSERT_TRUE(first.ok()) << first.status();
  const int64_t set_aside = device->used() - before;
  EXPECT_GE(set_aside, 20000 * 4096);
  const absl::Status refused = create(20000).status();
  EXPECT_TRUE(HasStatus(refused, absl::StatusCode::kResourceExhausted,
                        "GPU 0 memory (of every caller: the server authenticates no tenants) "
                        "budget exceeded: max_tokens=20000 of 1 layers on cuda:0"));
  EXPECT_THAT(refused.message(), HasSubstr("(gpu_memory_budget_per_tenant_gb=0.125)"));
  EXPECT_EQ(testing::RefusalsCounted(server().server(), "gpu_memory_budget_per_tenant"), 1);
  EXPECT_EQ(device->used() - before, set_aside) << "the refusal charged nothing";
  ASSERT_TRUE(create(5000).ok()) << "what is left of the share";
  // /metrics shows the one tenant's GPU memory and its share (one device here).
  const std::string scrape = server().server().metrics().TextFormat();
  EXPECT_EQ(testing::SeriesValue(scrape, R"(kvrecall_tenant_gpu_memory_bytes{tenant=""})"),
            device->used() - before);
  EXPECT_EQ(testing::SeriesValue(scrape, R"(kvrecall_tenant_gpu_memory_budget_bytes{tenant=""})"),
            (128 << 20) * server().server().placements().gpu().size());
  EXPECT_EQ(testing::SeriesValue(scrape, absl::StrCat("kvrecall_gpu_device_memory_bytes{device=\"",
                                                      server().server().placements().gpu()
                                                          .front()->device(),
                                                      "\"}")),
            device->used());
  // And the tenant's share of that device apart (the alert reads these).
  const std::string on_device = absl::StrCat(
      "{device=\"", server().server().placements().gpu().front()->device(), "\",tenant=\"\"}");
  EXPECT_EQ(testing::SeriesValue(
                scrape, absl::StrCat("kvrecall_tenant_gpu_device_memory_bytes", on_device)),
            device->used() - before);
  EXPECT_EQ(testing::SeriesValue(
                scrape, absl::StrCat("kvrecall_tenant_gpu_device_memory_budget_bytes", on_device)),
            128 << 20);
  ASSERT_TRUE(testing::CloseSession(stub(), *first).ok());
  EXPECT_TRUE(create(20000).ok()) << "the closed session's share is back";
}

std::string LaunchName(const ::testing::TestParamInfo<bool>& info) {
  return info.param ? "CudaGraphs" : "Eager";
}
INSTANTIATE_TEST_SUITE_P(Launches, GpuPlacementTest, ::testing::Bool(), LaunchName);
INSTANTIATE_TEST_SUITE_P(Launches, GpuBudgetTest, ::testing::Bool(), LaunchName);
INSTANTIATE_TEST_SUITE_P(Launches, GpuHostBudgetTest, ::testing::Bool(), LaunchName);
INSTANTIATE_TEST_SUITE_P(Launches, GpuTenantBudgetTest, ::testing::Bool(), LaunchName);

}  // namespace
}  // namespace kvrecall
