// The fused ReTopK GPU step against the CPU reference selector (index/retopk.h), decision for
// decision: seeded caches, path (reuse / fallback / refresh), best cosine, candidates scored,
// supports up to near-ties and outputs to tolerance, over a ragged batch of sequences with
// separately allocated caches stepped many times, also batched in changing subsets and orders;
// workspace sizing and misfit errors; the same steps replayed from a captured CUDA graph; and
// the cuBLAS batch top-k against the CPU one.
#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "index/batch_topk.h"
#include "index/retopk.h"
#include "kernels/cpu/attention.h"
#include "index/gpu_batch_topk.h"
#include "kernels/cuda/batch_topk.h"
#include "kernels/cuda/retopk.h"
#include "kernels/dtype.h"
#include "tests/cuda_test_util.h"
#include "tests/test_util.h"

namespace kvrecall {
namespace {

using cuda::DeviceSeq;
using cuda::KvDtype;
using ::kvrecall::testing::DeviceKv;
using ::kvrecall::testing::Geometry;
using ::kvrecall::testing::kOutputTolerance;
using ::kvrecall::testing::kTieTolerance;
using ::kvrecall::testing::RandomNormal;
using ::kvrecall::testing::StepOutputs;
using ::kvrecall::testing::ToDevice;
using ::kvrecall::testing::ToHost;

// Queries that drift slowly per head ([tokens, q_heads, head_dim]): consecutive queries of a
// head have cosines around 0.9, so both reuse and fallback steps occur at tau = 0.9.
std::vector<float> DriftingQueries(int64_t tokens, int q_heads, int head_dim, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> base = RandomNormal(q_heads * head_dim, seed + 1, 2.0f);
  std::vector<float> out;
  for (int64_t t = 0; t < tokens; ++t) {
    for (int i = 0; i < q_heads * head_dim; ++i) {
      base[i] = 0.97f * base[i] + 0.45f * normal(rng);
      out.push_back(base[i]);
    }
  }
  return out;
}

// Decode steps whose query jumps away from the drift (a topic change): their best cosine
// falls below tau, so they take the fallback path.
constexpr int kJumpSteps[] = {3, 9};

// Sequences with their own GPU caches (allocated separately, as sessions hold them), a CPU
// reference selector each, and one step workspace: steps a batch of any of them, in any order,
// and checks every row against the CPU decision for decision.
class ReTopKHarness {
 public:
  ReTopKHarness(const Geometry& g, int top_k, const ReTopKParams& params,
                std::vector<int64_t> prompts, int steps, int max_batch)
      : g_(g), top_k_(top_k), params_(params), steps_(steps) {
    int64_t longest = 0;
    for (size_t i = 0; i < prompts.size(); ++i) {
      seqs_.push_back(std::make_unique<Sequence>(prompts[i], steps, g, 11 + i));
      longest = std::max(longest, prompts[i]);
    }
    max_tokens_ = static_cast<int>(longest) + steps;
    auto ws = cuda::ReTopKWorkspace::Create(g.Shape(max_batch), top_k, params, max_tokens_);
    EXPECT_TRUE(ws.ok()) << ws.status();
    if (ws.ok()) ws_ = *std::move(ws);
    d_seqs_ = ToDevice(std::vector<DeviceSeq>(max_batch));
    d_caches_ = ToDevice(std::vector<cuda::ReTopKCachesView>(max_batch));
    d_q_ = ToDevice(std::vector<float>(max_batch * RowFloats()));
  }

  int RowFloats() const { return g_.q_heads * g_.head_dim; }
  cuda::ReTopKWorkspace* ws() { return ws_.get(); }

  // Builds every CPU selector and seeds every sequence's GPU caches from its prompt.
  void Seed() {
    const LayerShape layer{g_.q_heads, g_.kv_heads, g_.head_dim, g_.Shape(1).scale};
    for (auto& s : seqs_) {
      KvView prompt_view = s->kv.host.view();
      prompt_view.tokens = s->prompt;
      s->cpu = std::make_unique<ReTopKSelector>(layer, top_k_, params_);
      ASSERT_TRUE(s->cpu->Build(prompt_view, s->queries.data()).ok());
      auto caches = cuda::ReTopKCaches::Create(g_.q_heads, g_.head_dim, top_k_, params_);
      ASSERT_TRUE(caches.ok()) << caches.status();
      s->caches = *std::move(caches);
      EXPECT_EQ(s->caches->device_bytes(),
                cuda::ReTopKCaches::DeviceBytesFor(g_.q_heads, g_.head_dim, top_k_, params_));
      const int count = std::min<int>(params_.cache_capacity, s->prompt);
      const auto prompt_end = s->queries.begin() + s->prompt * RowFloats();
      auto last = ToDevice(std::vector<float>(prompt_end - count * RowFloats(), prompt_end));
      const absl::Status seeded = cuda::SeedReTopKCaches(
          g_.Shape(1), top_k_, params_, s->kv.Contiguous(s->prompt), last.data(), count, {},
          ws_.get(), s->caches.get(), nullptr);
      ASSERT_TRUE(seeded.ok()) << seeded;
    }
  }

  // One decode step of the sequences `order` (a batch in this order), each advancing by one
  // token; checks every row against the CPU selector and counts the paths taken.
  void Step(const std::vector<int>& order, int (&paths_seen)[kSelectionPaths]) {
    const int batch = static_cast<int>(order.size());
    const cuda::DecodeShape shape = g_.Shape(batch);
    std::vector<DeviceSeq> host_seqs;
    std::vector<cuda::ReTopKCachesView> views;
    std::vector<float> q;
    for (int i : order) {
      Sequence& s = *seqs_[i];
      ++s.steps_taken;
      ASSERT_LE(s.steps_taken, steps_);
      host_seqs.push_back(s.kv.Contiguous(static_cast<int32_t>(s.prompt + s.steps_taken)));
      views.push_back(s.caches->view());
      const float* qs = s.queries.data() + (s.prompt + s.steps_taken - 1) * RowFloats();
      q.insert(q.end(), qs, qs + RowFloats());
    }
    ASSERT_EQ(cudaMemcpy(d_seqs_.data(), host_seqs.data(), batch * sizeof(DeviceSeq),
                         cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(d_caches_.data(), views.data(), batch * sizeof(views[0]),
                         cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(d_q_.data(), q.data(), q.size() * sizeof(float), cudaMemcpyHostToDevice),
              cudaSuccess);
    StepOutputs out(shape.rows(), g_.head_dim);
    const absl::Status stepped =
        cuda::ReTopKStep(shape, top_k_, params_, d_seqs_.data(), d_caches_.data(), d_q_.data(),
                         max_tokens_, ws_.get(), out.o.data(), out.lse.data(), nullptr);
    ASSERT_TRUE(stepped.ok()) << stepped;
    ASSERT_TRUE(ws_->errors().CheckAndClear(nullptr).ok());
    const int rows = shape.rows();
    const std::vector<uint8_t> paths = ToHost(ws_->paths(), rows);
    const std::vector<int32_t> supports = ToHost(ws_->supports(), rows * top_k_);
    const std::vector<int32_t> sizes = ToHost(ws_->support_sizes(), rows);
    const std::vector<int32_t> candidates = ToHost(ws_->candidates(), rows);
    const std::vector<float> best = ToHost(ws_->best_cosines(), rows);
    const std::vector<float> o = out.HostO();
    const std::vector<float> lse = out.HostLse();
    const float scale = shape.scale;
    for (int b = 0; b < batch; ++b) {
      Sequence& s = *seqs_[order[b]];
      KvView view = s.kv.host.view();
      view.tokens = s.prompt + s.steps_taken;
      for (int h = 0; h < g_.q_heads; ++h) {
        SCOPED_TRACE(absl::StrCat("sequence ", order[b], " (batch row ", b, ") step ",
                                  s.steps_taken, " h=", h));
        const int row = b * g_.q_heads + h;
        const float* qh = q.data() + row * g_.head_dim;
        HeadSelection want;
        s.cpu->Select(h, qh, view, &want);
        EXPECT_NEAR(best[row], want.best_cosine, 1e-5f);
        if (std::abs(want.best_cosine - params_.tau) < 1e-5f) continue;  // a coin flip
        ASSERT_EQ(paths[row], static_cast<uint8_t>(want.path));
        ++paths_seen[paths[row]];
        EXPECT_EQ(candidates[row], want.candidates);
        ASSERT_EQ(sizes[row], static_cast<int>(want.support.size()));
        const int kv_head = KvHeadOf(h, g_.q_heads, g_.kv_heads);
        std::vector<float> scores(view.tokens);
        cpu::ScoreRange(qh, view, kv_head, 0, view.tokens, scale, scores.data());
        const std::vector<int32_t> got(supports.begin() + row * top_k_,
                                       supports.begin() + row * top_k_ + sizes[row]);
        const std::set<int32_t> got_set(got.begin(), got.end()),
            want_set(want.support.begin(), want.support.end());
        ASSERT_EQ(got_set.size(), got.size());
        const float kth = scores[want.support.back()];
        for (int32_t p : got) {
          if (!want_set.count(p)) {
            ASSERT_NEAR(scores[p], kth, kTieTolerance * std::max(1.0f, std::abs(kth))) << p;
          }
        }
        std::vector<float> ref_o(g_.head_dim);
        float ref_lse;
        cpu::PartialAttention(qh, view, kv_head, got, scale, ref_o.data(), &ref_lse);
        EXPECT_NEAR(lse[row], ref_lse, kOutputTolerance * std::max(1.0f, std::abs(ref_lse)));
        for (int j = 0; j < g_.head_dim; ++j) {
          ASSERT_NEAR(o[row * g_.head_dim + j], ref_o[j], kOutputTolerance) << "j=" << j;
        }
      }
    }
  }

 private:
  struct Sequence {
    Sequence(int64_t prompt, int steps, const Geometry& g, uint64_t seed)
        : prompt(prompt),
          kv(prompt + steps, g.kv_heads, g.head_dim, g.dtype, seed),
          queries(DriftingQueries(prompt + steps, g.q_heads, g.head_dim, seed + 7)) {
      const int row = g.q_heads * g.head_dim;
      for (int step : kJumpSteps) {
        if (step > steps) continue;
        const std::vector<float> fresh = RandomNormal(row, seed + 100 + step, 2.0f);
        std::copy(fresh.begin(), fresh.end(), queries.begin() + (prompt + step - 1) * row);
      }
      // Scores spread as at the usual scale, whatever the geometry's, or queries at the
      // geometry's peak (cosines do not change).
      for (float& x : queries) x *= g.QueryStd(1.0f);
      g.ScaleToPeak(&queries);
    }
    int64_t prompt;
    DeviceKv kv;
    std::vector<float> queries;  // [prompt + steps, q_heads, head_dim]: the prompt's, then decode
    int steps_taken = 0;
    std::unique_ptr<ReTopKSelector> cpu;
    std::unique_ptr<cuda::ReTopKCaches> caches;
  };

  Geometry g_;
  int top_k_;
  ReTopKParams params_;
  int steps_;
  int max_tokens_ = 0;
  std::vector<std::unique_ptr<Sequence>> seqs_;
  std::unique_ptr<cuda::ReTopKWorkspace> ws_;
  cuda::DeviceBuffer<DeviceSeq> d_seqs_;
  cuda::DeviceBuffer<cuda::ReTopKCachesView> d_caches_;
  cuda::DeviceBuffer<float> d_q_;
};

std::string Message(const absl::Status& status) { return std::string(status.message()); }

ReTopKParams TestParams() {
  ReTopKParams params;
  params.cache_capacity = 8;
  params.reuse_neighbors = 3;
  params.recent_window = 16;
  params.tau = 0.9f;
  params.refresh_interval = 5;
  return params;
}

void ExpectEveryPath(const int (&paths_seen)[kSelectionPaths]) {
  EXPECT_GT(paths_seen[static_cast<int>(SelectionPath::kReuse)], 0);
  EXPECT_GT(paths_seen[static_cast<int>(SelectionPath::kFallback)], 0);
  EXPECT_GT(paths_seen[static_cast<int>(SelectionPath::kRefresh)], 0);
}

class CudaReTopKTest : public ::testing::TestWithParam<Geometry> {};

TEST_P(CudaReTopKTest, StepsMatchTheCpuSelectorDecisionForDecision) {
  KVRECALL_SKIP_WITHOUT_GPU();
  constexpr int kTopK = 64, kSteps = 14;
  // A ragged batch; the second prompt is shorter than C + K.
  ReTopKHarness harness(GetParam(), kTopK, TestParams(), {3000, 70, 1500}, kSteps, 3);
  ASSERT_NE(harness.ws(), nullptr);
  ASSERT_NO_FATAL_FAILURE(harness.Seed());
  int paths_seen[kSelectionPaths] = {};
  for (int step = 1; step <= kSteps; ++step) {
    ASSERT_NO_FATAL_FAILURE(harness.Step({0, 1, 2}, paths_seen));
  }
  ExpectEveryPath(paths_seen);
}

// Sessions hold their caches separately and a request batches any of them: each step here
// batches a different subset in a different order (sequences outside it do not advance), so
// each sequence's caches and decode step are its own, whatever batch row it lands in.
TEST_P(CudaReTopKTest, BatchesOfSeparatelyAllocatedSequencesInAnyOrder) {
  KVRECALL_SKIP_WITHOUT_GPU();
  constexpr int kTopK = 64, kSteps = 12;
  ReTopKHarness harness(GetParam(), kTopK, TestParams(), {2500, 40, 1200, 600}, kSteps, 4);
  ASSERT_NE(harness.ws(), nullptr);
  ASSERT_NO_FATAL_FAILURE(harness.Seed());
  const std::vector<std::vector<int>> schedule = {
      {0, 1, 2, 3}, {3, 2, 1, 0}, {2, 0}, {1, 3, 0}, {3}, {0, 2, 3, 1}, {1, 2},
      {2, 3, 0, 1}, {0, 3}, {1, 0, 2, 3}, {3, 1}, {2, 1, 3, 0}, {0, 2}, {3, 0, 1, 2}};
  int paths_seen[kSelectionPaths] = {};
  for (const std::vector<int>& order : schedule) {
    ASSERT_NO_FATAL_FAILURE(harness.Step(order, paths_seen));
  }
  ExpectEveryPath(paths_seen);
}

// The last geometry's 3 * 64 = 192 rows outnumber the H200's 132 multiprocessors, so its finish
// kernel runs the 256-thread blocks (the others the 512-thread ones).
INSTANTIATE_TEST_SUITE_P(Geometries, CudaReTopKTest,
                         ::testing::Values(Geometry{16, 4, 128, KvDtype::kBf16},
                                           Geometry{8, 8, 64, KvDtype::kF16},
                                           Geometry{32, 4, 64, KvDtype::kBf16},
                                           // Scales past ln 2: f16's kernels apply them to
                                           // the scores.
                                           Geometry{8, 8, 64, KvDtype::kF16, 1.0f},
                                           Geometry{16, 4, 128, KvDtype::kF16, 0.75f},
                                           // Queries at f16's bound (the reuse path's
                                           // CandidateScorer and the exact path's scores).
                                           Geometry{8, 8, 64, KvDtype::kF16, 4.0f, 65504.0f},
                                           Geometry{64, 8, 128, KvDtype::kBf16}),
                         ::kvrecall::testing::GeometryName);

// Device bytes are known before allocating, and steps or seedings that do not fit the
// workspace or the caches are refused with INVALID_ARGUMENT before any launch.
TEST(CudaReTopKWorkspaceTest, SizesKnownUpFrontAndMisfitsRefused) {
  KVRECALL_SKIP_WITHOUT_GPU();
  const Geometry g{16, 4, 128, KvDtype::kBf16};
  const ReTopKParams params = TestParams();
  constexpr int kTopK = 64, kTokens = 5000;
  auto ws = cuda::ReTopKWorkspace::Create(g.Shape(2), kTopK, params, kTokens);
  ASSERT_TRUE(ws.ok()) << ws.status();
  EXPECT_EQ((*ws)->device_bytes(),
            cuda::ReTopKWorkspace::DeviceBytesFor(g.Shape(2), kTopK, params, kTokens));
  // The top-K scratch alone is 8 bytes per (row, token).
  EXPECT_GT((*ws)->device_bytes(), int64_t{8} * g.Shape(2).rows() * kTokens);
  EXPECT_EQ(cuda::ReTopKWorkspace::DeviceBytesFor(g.Shape(2), 0, params, kTokens), 0);
  EXPECT_EQ(cuda::ReTopKWorkspace::Create(g.Shape(2), 0, params, kTokens).status().code(),
            absl::StatusCode::kInvalidArgument);
  ReTopKParams huge = params;
  huge.cache_capacity = 65;
  EXPECT_THAT(std::string(cuda::ReTopKCaches::Create(16, 128, kTopK, huge).status().message()),
              ::testing::HasSubstr("cache_capacity must be in [1, 64]"));

  auto caches = cuda::ReTopKCaches::Create(g.q_heads, g.head_dim, kTopK, params);
  ASSERT_TRUE(caches.ok()) << caches.status();
  auto d_seqs = ToDevice(std::vector<DeviceSeq>(3));
  auto d_caches = ToDevice(std::vector<cuda::ReTopKCachesView>(3, (*caches)->view()));
  auto d_q = ToDevice(std::vector<float>(3 * g.q_heads * g.head_dim));
  StepOutputs out(3 * g.q_heads, g.head_dim);
  auto step = [&](int batch, int top_k, int max_tokens) {
    return cuda::ReTopKStep(g.Shape(batch), top_k, params, d_seqs.data(), d_caches.data(),
                            d_q.data(), max_tokens, ws->get(), out.o.data(), out.lse.data(),
                            nullptr);
  };
  EXPECT_EQ(step(3, kTopK, kTokens).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(step(3, kTopK, kTokens)),
              ::testing::HasSubstr("exceed the ReTopK workspace"));
  EXPECT_THAT(Message(step(2, kTopK, kTokens + 1)),
              ::testing::HasSubstr("max_tokens must be in [1, 5000]"));
  EXPECT_THAT(Message(step(2, 2 * kTopK, kTokens)), ::testing::HasSubstr("top_k 128"));
  EXPECT_EQ(cuda::ReTopKStep(g.Shape(1), kTopK, params, d_seqs.data(), nullptr, d_q.data(),
                             kTokens, ws->get(), out.o.data(), out.lse.data(), nullptr)
                .code(),
            absl::StatusCode::kInvalidArgument);

  // Seeding checks the caches' geometry and the prompt against the workspace.
  DeviceKv kv(kTokens + 10, g.kv_heads, g.head_dim, g.dtype, 3);
  auto last = ToDevice(std::vector<float>(params.cache_capacity * g.q_heads * g.head_dim));
  auto other = cuda::ReTopKCaches::Create(g.q_heads, g.head_dim, 2 * kTopK, params);
  ASSERT_TRUE(other.ok());
  auto seed = [&](int32_t prompt, int count, std::span<const float> taus,
                  cuda::ReTopKCaches* target) {
    return Message(cuda::SeedReTopKCaches(g.Shape(1), kTopK, params, kv.Contiguous(prompt),
                                          last.data(), count, taus, ws->get(), target, nullptr));
  };
  const int c = params.cache_capacity;
  EXPECT_THAT(seed(100, c, {}, other->get()), ::testing::HasSubstr("the caches hold"));
  EXPECT_THAT(seed(kTokens + 10, c, {}, caches->get()),
              ::testing::HasSubstr("max_tokens must be in"));
  EXPECT_THAT(seed(100, c - 1, {}, caches->get()), ::testing::HasSubstr("last min(C, T) = 8"));
  const std::vector<float> taus(3, 0.5f);
  EXPECT_THAT(seed(100, c, taus, caches->get()), ::testing::HasSubstr("head_taus must have"));
}

// A step captured once in a CUDA graph and replayed with new lengths and queries (device data)
// gives what direct steps give.
TEST(CudaReTopKGraphTest, ReplayedStepsEqualDirectSteps) {
  KVRECALL_SKIP_WITHOUT_GPU();
  const Geometry g{16, 4, 128, KvDtype::kBf16};
  constexpr int kTopK = 128, kSteps = 6, kPrompt = 4000;
  ReTopKParams params;
  params.tau = 0.9f;
  params.refresh_interval = 4;
  const cuda::DecodeShape shape = g.Shape(1);
  DeviceKv kv(kPrompt + kSteps, g.kv_heads, g.head_dim, g.dtype, 21);
  const std::vector<float> queries = DriftingQueries(kPrompt + kSteps, g.q_heads, g.head_dim, 28);
  const int row_floats = g.q_heads * g.head_dim;
  const int count = params.cache_capacity;
  auto last = ToDevice(std::vector<float>(queries.begin() + (kPrompt - count) * row_floats,
                                          queries.begin() + kPrompt * row_floats));
  // Two sequences' caches seeded alike, one stepped directly and one by the graph, each with
  // its own workspace.
  std::vector<std::unique_ptr<cuda::ReTopKCaches>> caches;
  std::vector<std::unique_ptr<cuda::ReTopKWorkspace>> workspaces;
  auto seed = [&](int i, cudaStream_t stream) {
    return cuda::SeedReTopKCaches(shape, kTopK, params, kv.Contiguous(kPrompt), last.data(),
                                  count, {}, workspaces[i].get(), caches[i].get(), stream);
  };
  for (int i = 0; i < 2; ++i) {
    auto c = cuda::ReTopKCaches::Create(g.q_heads, g.head_dim, kTopK, params);
    ASSERT_TRUE(c.ok()) << c.status();
    caches.push_back(*std::move(c));
    auto ws = cuda::ReTopKWorkspace::Create(shape, kTopK, params, kPrompt + kSteps);
    ASSERT_TRUE(ws.ok()) << ws.status();
    workspaces.push_back(*std::move(ws));
    ASSERT_TRUE(seed(i, nullptr).ok());
  }
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  auto d_seqs = ToDevice(std::vector<DeviceSeq>{kv.Contiguous(kPrompt + 1)});
  auto d_caches0 = ToDevice(std::vector<cuda::ReTopKCachesView>{caches[0]->view()});
  auto d_caches1 = ToDevice(std::vector<cuda::ReTopKCachesView>{caches[1]->view()});
  auto d_q = ToDevice(std::vector<float>(row_floats));
  StepOutputs direct(g.q_heads, g.head_dim), replayed(g.q_heads, g.head_dim);
  auto step = [&](int i, const cuda::DeviceBuffer<cuda::ReTopKCachesView>& views,
                  StepOutputs& out) {
    return cuda::ReTopKStep(shape, kTopK, params, d_seqs.data(), views.data(), d_q.data(),
                            kPrompt + kSteps, workspaces[i].get(), out.o.data(), out.lse.data(),
                            stream);
  };
  // Warm up (kernel attributes are set on first use), then undo its cache push by reseeding.
  ASSERT_TRUE(step(1, d_caches1, replayed).ok());
  ASSERT_TRUE(seed(1, stream).ok());
  cudaGraph_t graph;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  ASSERT_TRUE(step(1, d_caches1, replayed).ok());
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (int s = 1; s <= kSteps; ++s) {
    const std::vector<DeviceSeq> host_seqs{kv.Contiguous(kPrompt + s)};
    ASSERT_EQ(cudaMemcpy(d_seqs.data(), host_seqs.data(), sizeof(DeviceSeq),
                         cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(d_q.data(), queries.data() + (kPrompt + s - 1) * row_floats,
                         row_floats * sizeof(float), cudaMemcpyHostToDevice),
              cudaSuccess);
    ASSERT_TRUE(step(0, d_caches0, direct).ok());
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    SCOPED_TRACE(absl::StrCat("step ", s));
    EXPECT_EQ(ToHost(workspaces[0]->paths(), g.q_heads), ToHost(workspaces[1]->paths(), g.q_heads));
    EXPECT_EQ(ToHost(workspaces[0]->candidates(), g.q_heads),
              ToHost(workspaces[1]->candidates(), g.q_heads));
    const std::vector<float> a = direct.HostO();
    const std::vector<float> b = replayed.HostO();
    for (int j = 0; j < row_floats; ++j) ASSERT_NEAR(a[j], b[j], 1e-6f) << j;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

TEST(CudaBatchTopKTest, MatchesCpuBatchTopKUpToNearTies) {
  KVRECALL_SKIP_WITHOUT_GPU();
  constexpr int kDim = 64, kKeys = 10000, kQueries = 300, kTopK = 50;
  // Strided like the KV layout: keys of head 1 of 2, queries of head 3 of 4.
  const std::vector<float> keys = RandomNormal(kKeys * 2 * kDim, 1);
  const std::vector<float> queries = RandomNormal(kQueries * 4 * kDim, 2);
  const VectorSet key_set{keys.data() + kDim, kKeys, 2 * kDim, kDim};
  const VectorSet query_set{queries.data() + 3 * kDim, kQueries, 4 * kDim, kDim};
  TopKLists want, got;
  ASSERT_TRUE(CpuBatchTopK(query_set, key_set, kTopK, &want).ok());
  auto gpu = MakeGpuBatchTopKFunction();
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  ASSERT_TRUE((*gpu)(query_set, key_set, kTopK, &got, {}, BuildStop()).ok());
  ASSERT_EQ(got.k, want.k);
  ASSERT_EQ(got.queries, want.queries);
  int exact_lists = 0;
  for (int64_t i = 0; i < kQueries; ++i) {
    const float* q = query_set.row(i);
    auto score = [&](int32_t id) { return cpu::DotProduct(q, key_set.row(id), kDim); };
    const std::vector<int32_t> g(got.list(i), got.list(i) + got.k);
    const std::vector<int32_t> w(want.list(i), want.list(i) + want.k);
    exact_lists += g == w;
    const std::set<int32_t> w_set(w.begin(), w.end());
    const float kth = score(w.back());
    for (int j = 0; j < got.k; ++j) {
      if (!w_set.count(g[j])) ASSERT_NEAR(score(g[j]), kth, 1e-4f) << "query " << i;
      if (j > 0) ASSERT_GE(score(g[j - 1]), score(g[j]) - 1e-4f) << "query " << i;
    }
  }
  EXPECT_GE(exact_lists, kQueries - 3) << "lists identical to the CPU's, order included";
  // A causal mask: query i sees keys [0, visible[i]); lists are padded with -1 as on the CPU.
  std::vector<int64_t> visible(kQueries);
  for (int i = 0; i < kQueries; ++i) visible[i] = (i * 37) % (kKeys + 100);  // some over kKeys
  visible[0] = 0;
  visible[1] = 3;
  ASSERT_TRUE(CpuBatchTopK(query_set, key_set, kTopK, &want, visible).ok());
  ASSERT_TRUE((*gpu)(query_set, key_set, kTopK, &got, visible, BuildStop()).ok());
  for (int64_t i = 0; i < kQueries; ++i) {
    const std::vector<int32_t> g(got.list(i), got.list(i) + got.k);
    const std::vector<int32_t> w(want.list(i), want.list(i) + want.k);
    if (g != w) {  // only near-ties may differ
      const float* q = query_set.row(i);
      for (int j = 0; j < got.k; ++j) {
        ASSERT_EQ(g[j] < 0, w[j] < 0) << "padding differs, query " << i;
        if (g[j] >= 0 && g[j] != w[j]) {
          ASSERT_NEAR(cpu::DotProduct(q, key_set.row(g[j]), kDim),
                      cpu::DotProduct(q, key_set.row(w[j]), kDim), 1e-4f)
              << "query " << i;
        }
      }
    }
  }
  // The CPU backend's argument errors, with the same codes.
  EXPECT_EQ((*gpu)(query_set, key_set, 0, &got, {}, BuildStop()).code(),
            absl::StatusCode::kInvalidArgument);
  const VectorSet short_keys{keys.data(), kKeys, 2 * kDim, kDim - 1};
  const absl::Status status = (*gpu)(query_set, short_keys, kTopK, &got, {}, BuildStop());
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), ::testing::HasSubstr("differs from key dim"));
  // A build that will not be used stops: CANCELLED once the call has the device.
  const absl::Status stopped =
      (*gpu)(query_set, key_set, kTopK, &got, {}, BuildStop([] { return true; }));
  EXPECT_EQ(stopped.code(), absl::StatusCode::kCancelled) << stopped;
}

// The ordering contract, exactly: with small integers times one scale as keys and queries,
// every product and sum is exact in f32 whatever the GEMM's order, so the GPU's lists equal the
// CPU's id for id, ties (many: the scores are few distinct values) to the lower id. The scales
// pick the GEMM, the narrowest type every key and query is exact in: integers in [-3, 3] times
// 1 are exact in bf16 (tensor cores on bf16); times 1 + 2^-9 in f16 (11 significant bits:
// 3 * (1 + 2^-9) is 3 + 3 ulp of [2, 4)) but not bf16; times 1 + 2^-12 in neither (f32). Keys
// stored in 16 bits go up as they are and are multiplied in their own type when the queries
// allow it; the choice is the same as for the keys widened to f32. A causal mask pads the short
// lists with -1 on both sides.
TEST(CudaBatchTopKTest, ExactScoresGiveTheCpuListsIdForIdOnEveryGemm) {
  KVRECALL_SKIP_WITHOUT_GPU();
  constexpr int kDim = 64, kKeys = 3000, kQueries = 200, kTopK = 40;
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> small(-3, 3);
  std::vector<float> key_ints(kKeys * 2 * kDim), query_ints(kQueries * kDim);
  for (float& x : key_ints) x = static_cast<float>(small(rng));
  for (float& x : query_ints) x = static_cast<float>(small(rng));
  absl::StatusOr<std::unique_ptr<cuda::GpuBatchTopK>> gpu = cuda::GpuBatchTopK::Create();
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  // Warmed up (as the server's and bench-index's are): every case below then runs on buffers
  // and GEMM settings the warm-up's calls left, which must change nothing of its lists.
  ASSERT_TRUE((*gpu)->WarmUp().ok());
  using Gemm = cuda::GpuBatchTopK::GemmInput;
  struct Case {
    KvElement element;  // of the keys; the queries are f32
    float key_scale;
    float query_scale;
    Gemm gemm;
  };
  constexpr float kF16Only = 1.0f + 0x1p-9f;
  constexpr float kNeither = 1.0f + 0x1p-12f;
  for (const Case& c : {Case{KvElement::kF32, 1.0f, 1.0f, Gemm::kBf16},
                        Case{KvElement::kF32, kF16Only, 1.0f, Gemm::kF16},
                        Case{KvElement::kF32, kNeither, 1.0f, Gemm::kF32},
                        Case{KvElement::kBf16, 1.0f, 1.0f, Gemm::kBf16},
                        Case{KvElement::kBf16, 1.0f, kF16Only, Gemm::kF16},
                        Case{KvElement::kBf16, 1.0f, kNeither, Gemm::kF32},
                        Case{KvElement::kF16, 1.0f, 1.0f, Gemm::kBf16},
                        Case{KvElement::kF16, kF16Only, 1.0f, Gemm::kF16},
                        Case{KvElement::kF16, 1.0f, kNeither, Gemm::kF32}}) {
    SCOPED_TRACE(::testing::Message() << KvElementName(c.element) << " keys times "
                                      << c.key_scale << ", queries times " << c.query_scale);
    std::vector<float> keys = key_ints, queries = query_ints;
    for (float& x : keys) x *= c.key_scale;
    for (float& x : queries) x *= c.query_scale;
    std::vector<uint16_t> narrow_keys(keys.size());
    for (size_t i = 0; i < keys.size(); ++i) {
      narrow_keys[i] = c.element == KvElement::kBf16 ? FloatToBf16(keys[i]) : FloatToF16(keys[i]);
    }
    // Keys of head 1 of 2, read in place; the CPU's lists from the same values in f32.
    const VectorSet wide_set{keys.data() + kDim, kKeys, 2 * kDim, kDim};
    const VectorSet key_set =
        c.element == KvElement::kF32
            ? wide_set
            : VectorSet{narrow_keys.data() + kDim, kKeys, 2 * kDim, kDim, c.element};
    const VectorSet query_set{queries.data(), kQueries, kDim, kDim};
    std::vector<int64_t> visible(kQueries);
    for (int i = 0; i < kQueries; ++i) visible[i] = (i * 29) % (kKeys + 50);
    for (const bool causal : {false, true}) {
      const std::span<const int64_t> mask =
          causal ? std::span<const int64_t>(visible) : std::span<const int64_t>();
      TopKLists want, got;
      ASSERT_TRUE(CpuBatchTopK(query_set, wide_set, kTopK, &want, mask).ok());
      ASSERT_TRUE((*gpu)->Run(query_set, key_set, kTopK, &got, mask).ok());
      EXPECT_EQ((*gpu)->last_gemm_input(), c.gemm);
      ASSERT_EQ(got.k, want.k);
      ASSERT_EQ(got.queries, want.queries);
      for (int64_t i = 0; i < kQueries; ++i) {
        ASSERT_THAT(std::vector<int32_t>(got.list(i), got.list(i) + got.k),
                    ::testing::ElementsAreArray(want.list(i), want.k))
            << "query " << i << (causal ? " (causal)" : "");
      }
    }
  }
}

}  // namespace
}  // namespace kvrecall
