// The fused ReTopK GPU step against the CPU reference selector (index/retopk.h), decision for
// decision: seeded caches, path (reuse / fallback / refresh), best cosine, candidates scored,
// supports up to near-ties and outputs to tolerance, over a ragged batch stepped many times;
// the same steps replayed from a captured CUDA graph; and the cuBLAS batch top-k against the
// CPU one.
#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <set>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "index/batch_topk.h"
#include "index/retopk.h"
#include "kernels/cpu/attention.h"
#include "index/gpu_batch_topk.h"
#include "kernels/cuda/retopk.h"
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
  }
  int64_t prompt;
  DeviceKv kv;
  std::vector<float> queries;  // [prompt + steps, q_heads, head_dim]: the prompt's, then decode
};

class CudaReTopKTest : public ::testing::TestWithParam<Geometry> {};

TEST_P(CudaReTopKTest, StepsMatchTheCpuSelectorDecisionForDecision) {
  KVRECALL_SKIP_WITHOUT_GPU();
  const Geometry g = GetParam();
  constexpr int kTopK = 64, kSteps = 14;
  ReTopKParams params;
  params.cache_capacity = 8;
  params.reuse_neighbors = 3;
  params.recent_window = 16;
  params.tau = 0.9f;
  params.refresh_interval = 5;
  const float scale = g.Shape(1).scale;
  const LayerShape layer{g.q_heads, g.kv_heads, g.head_dim, scale};
  // A ragged batch; the second prompt is shorter than C + K.
  std::vector<std::unique_ptr<Sequence>> seqs;
  seqs.push_back(std::make_unique<Sequence>(3000, kSteps, g, 11));
  seqs.push_back(std::make_unique<Sequence>(70, kSteps, g, 12));
  seqs.push_back(std::make_unique<Sequence>(1500, kSteps, g, 13));
  const int batch = static_cast<int>(seqs.size());
  const cuda::DecodeShape shape = g.Shape(batch);
  const int max_tokens = 3000 + kSteps;
  auto gpu = cuda::ReTopKGpuLayer::Create(shape, kTopK, params, max_tokens);
  ASSERT_TRUE(gpu.ok()) << gpu.status();

  const int row_floats = g.q_heads * g.head_dim;
  std::vector<std::unique_ptr<ReTopKSelector>> cpu;
  for (int b = 0; b < batch; ++b) {
    Sequence& s = *seqs[b];
    KvView prompt_view = s.kv.host.view();
    prompt_view.tokens = s.prompt;
    cpu.push_back(std::make_unique<ReTopKSelector>(layer, kTopK, params));
    ASSERT_TRUE(cpu.back()->Build(prompt_view, s.queries.data()).ok());
    const int count = std::min<int>(params.cache_capacity, s.prompt);
    auto last = ToDevice(std::vector<float>(
        s.queries.begin() + (s.prompt - count) * row_floats,
        s.queries.begin() + s.prompt * row_floats));
    ASSERT_TRUE((*gpu)->Seed(b, s.kv.Contiguous(s.prompt), last.data(), count, {}, nullptr).ok());
  }

  auto d_seqs = ToDevice(std::vector<DeviceSeq>(batch));
  auto d_q = ToDevice(std::vector<float>(batch * row_floats));
  StepOutputs out(shape.rows(), g.head_dim);
  int paths_seen[4] = {0, 0, 0, 0};
  for (int step = 1; step <= kSteps; ++step) {
    std::vector<DeviceSeq> host_seqs;
    std::vector<float> q;
    for (const auto& s : seqs) {
      host_seqs.push_back(s->kv.Contiguous(static_cast<int32_t>(s->prompt + step)));
      const float* qs = s->queries.data() + (s->prompt + step - 1) * row_floats;
      q.insert(q.end(), qs, qs + row_floats);
    }
    ASSERT_EQ(cudaMemcpy(d_seqs.data(), host_seqs.data(), batch * sizeof(DeviceSeq),
                         cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(d_q.data(), q.data(), q.size() * sizeof(float), cudaMemcpyHostToDevice),
              cudaSuccess);
    ASSERT_TRUE((*gpu)->Step(batch, d_seqs.data(), d_q.data(), max_tokens, out.o.data(),
                             out.lse.data(), nullptr)
                    .ok());
    ASSERT_TRUE((*gpu)->errors().CheckAndClear(nullptr).ok());
    const std::vector<uint8_t> paths = ToHost((*gpu)->paths(), shape.rows());
    const std::vector<int32_t> supports = ToHost((*gpu)->supports(), shape.rows() * kTopK);
    const std::vector<int32_t> sizes = ToHost((*gpu)->support_sizes(), shape.rows());
    const std::vector<int32_t> candidates = ToHost((*gpu)->candidates(), shape.rows());
    const std::vector<float> best = ToHost((*gpu)->best_cosines(), shape.rows());
    const std::vector<float> o = out.HostO();
    const std::vector<float> lse = out.HostLse();
    for (int b = 0; b < batch; ++b) {
      Sequence& s = *seqs[b];
      KvView view = s.kv.host.view();
      view.tokens = s.prompt + step;
      for (int h = 0; h < g.q_heads; ++h) {
        SCOPED_TRACE(absl::StrCat("step=", step, " b=", b, " h=", h));
        const int row = b * g.q_heads + h;
        const float* qh = q.data() + row * g.head_dim;
        HeadSelection want;
        cpu[b]->Select(h, qh, view, &want);
        EXPECT_NEAR(best[row], want.best_cosine, 1e-5f);
        if (std::abs(want.best_cosine - params.tau) < 1e-5f) continue;  // a coin flip
        ASSERT_EQ(paths[row], static_cast<uint8_t>(want.path));
        ++paths_seen[paths[row]];
        EXPECT_EQ(candidates[row], want.candidates);
        ASSERT_EQ(sizes[row], static_cast<int>(want.support.size()));
        const int kv_head = KvHeadOf(h, g.q_heads, g.kv_heads);
        std::vector<float> scores(view.tokens);
        cpu::ScoreRange(qh, view, kv_head, 0, view.tokens, scale, scores.data());
        const std::vector<int32_t> got(supports.begin() + row * kTopK,
                                       supports.begin() + row * kTopK + sizes[row]);
        const std::set<int32_t> got_set(got.begin(), got.end()),
            want_set(want.support.begin(), want.support.end());
        ASSERT_EQ(got_set.size(), got.size());
        const float kth = scores[want.support.back()];
        for (int32_t p : got) {
          if (!want_set.count(p)) {
            ASSERT_NEAR(scores[p], kth, kTieTolerance * std::max(1.0f, std::abs(kth))) << p;
          }
        }
        std::vector<float> ref_o(g.head_dim);
        float ref_lse;
        cpu::PartialAttention(qh, view, kv_head, got, scale, ref_o.data(), &ref_lse);
        EXPECT_NEAR(lse[row], ref_lse, kOutputTolerance * std::max(1.0f, std::abs(ref_lse)));
        for (int j = 0; j < g.head_dim; ++j) {
          ASSERT_NEAR(o[row * g.head_dim + j], ref_o[j], kOutputTolerance) << "j=" << j;
        }
      }
    }
  }
  // The run exercised every path.
  EXPECT_GT(paths_seen[static_cast<int>(SelectionPath::kReuse)], 0);
  EXPECT_GT(paths_seen[static_cast<int>(SelectionPath::kFallback)], 0);
  EXPECT_GT(paths_seen[static_cast<int>(SelectionPath::kRefresh)], 0);
}

// The last geometry's 3 * 64 = 192 rows outnumber the H200's 132 multiprocessors, so its finish
// kernel runs the 256-thread blocks (the others the 512-thread ones).
INSTANTIATE_TEST_SUITE_P(Geometries, CudaReTopKTest,
                         ::testing::Values(Geometry{16, 4, 128, KvDtype::kBf16},
                                           Geometry{8, 8, 64, KvDtype::kF16},
                                           Geometry{32, 4, 64, KvDtype::kBf16},
                                           Geometry{64, 8, 128, KvDtype::kBf16}),
                         ::kvrecall::testing::GeometryName);

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
  Sequence s(kPrompt, kSteps, g, 21);
  const int row_floats = g.q_heads * g.head_dim;
  const int count = params.cache_capacity;
  auto last = ToDevice(std::vector<float>(s.queries.begin() + (kPrompt - count) * row_floats,
                                          s.queries.begin() + kPrompt * row_floats));
  std::vector<std::unique_ptr<cuda::ReTopKGpuLayer>> layers;
  for (int i = 0; i < 2; ++i) {
    auto layer = cuda::ReTopKGpuLayer::Create(shape, kTopK, params, kPrompt + kSteps);
    ASSERT_TRUE(layer.ok()) << layer.status();
    ASSERT_TRUE((*layer)->Seed(0, s.kv.Contiguous(kPrompt), last.data(), count, {}, nullptr).ok());
    layers.push_back(*std::move(layer));
  }
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  auto d_seqs = ToDevice(std::vector<DeviceSeq>{s.kv.Contiguous(kPrompt + 1)});
  auto d_q = ToDevice(std::vector<float>(row_floats));
  StepOutputs direct(g.q_heads, g.head_dim), replayed(g.q_heads, g.head_dim);
  // Warm up (kernel attributes are set on first use), then undo its cache push by reseeding.
  ASSERT_TRUE(layers[1]->Step(1, d_seqs.data(), d_q.data(), kPrompt + kSteps, replayed.o.data(),
                              replayed.lse.data(), stream).ok());
  ASSERT_TRUE(layers[1]->Seed(0, s.kv.Contiguous(kPrompt), last.data(), count, {}, stream).ok());
  cudaGraph_t graph;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  ASSERT_TRUE(layers[1]->Step(1, d_seqs.data(), d_q.data(), kPrompt + kSteps, replayed.o.data(),
                              replayed.lse.data(), stream).ok());
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (int step = 1; step <= kSteps; ++step) {
    const std::vector<DeviceSeq> host_seqs{s.kv.Contiguous(kPrompt + step)};
    ASSERT_EQ(cudaMemcpy(d_seqs.data(), host_seqs.data(), sizeof(DeviceSeq),
                         cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(d_q.data(), s.queries.data() + (kPrompt + step - 1) * row_floats,
                         row_floats * sizeof(float), cudaMemcpyHostToDevice),
              cudaSuccess);
    ASSERT_TRUE(layers[0]->Step(1, d_seqs.data(), d_q.data(), kPrompt + kSteps, direct.o.data(),
                                direct.lse.data(), stream).ok());
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    SCOPED_TRACE(absl::StrCat("step ", step));
    EXPECT_EQ(ToHost(layers[0]->paths(), g.q_heads), ToHost(layers[1]->paths(), g.q_heads));
    EXPECT_EQ(ToHost(layers[0]->candidates(), g.q_heads),
              ToHost(layers[1]->candidates(), g.q_heads));
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
  ASSERT_TRUE((*gpu)(query_set, key_set, kTopK, &got, {}).ok());
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
  ASSERT_TRUE((*gpu)(query_set, key_set, kTopK, &got, visible).ok());
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
  EXPECT_EQ((*gpu)(query_set, key_set, 0, &got, {}).code(), absl::StatusCode::kInvalidArgument);
  const VectorSet short_keys{keys.data(), kKeys, 2 * kDim, kDim - 1};
  const absl::Status status = (*gpu)(query_set, short_keys, kTopK, &got, {});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), ::testing::HasSubstr("differs from key dim"));
}

}  // namespace
}  // namespace kvrecall
