// ReTopK's cache match alone on the GPU (kernels/cuda/retopk_match.h) against the CPU
// reference (ReTopKHead::Match, index/retopk.h), decision for decision: best cosine, path
// (reuse / fallback / refresh), the R most similar entries (GPU slots mapped to ages) and the
// reuse candidates exactly, over a ragged batch of sequences with separately allocated caches
// whose FIFOs wrap as both sides push the same entries step after step; candidates written into
// device memory and into mapped host memory alike; device-input violations reported; misfits
// refused.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "index/retopk.h"
#include "kernels/cpu/attention.h"
#include "kernels/cuda/retopk.h"
#include "kernels/cuda/retopk_match.h"
#include "tests/cuda_test_util.h"
#include "tests/test_util.h"

namespace kvrecall {
namespace {

using cuda::DeviceSeq;
using cuda::KvDtype;
using ::kvrecall::testing::Geometry;
using ::kvrecall::testing::RandomNormal;
using ::kvrecall::testing::ToDevice;
using ::kvrecall::testing::ToHost;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

constexpr int kTopK = 40;

ReTopKParams TestParams() {
  ReTopKParams params;
  params.cache_capacity = 8;
  params.reuse_neighbors = 3;
  params.recent_window = 12;
  params.tau = 0.5f;
  params.refresh_interval = 6;
  return params;
}

std::vector<int32_t> Vec(std::span<const int32_t> s) { return {s.begin(), s.end()}; }

std::vector<float> Unit(const float* x, int n) {
  std::vector<float> unit(n);
  cpu::Normalize(x, n, unit.data());
  return unit;
}

// Mapped pinned host memory the kernels can write (freed on destruction).
struct MappedInts {
  explicit MappedInts(size_t n) {
    EXPECT_EQ(cudaHostAlloc(reinterpret_cast<void**>(&host), n * sizeof(int32_t),
                            cudaHostAllocMapped),
              cudaSuccess);
    EXPECT_EQ(cudaHostGetDevicePointer(reinterpret_cast<void**>(&device), host, 0), cudaSuccess);
  }
  ~MappedInts() { cudaFreeHost(host); }
  int32_t* host = nullptr;
  int32_t* device = nullptr;
};

// Sequences with GPU caches and CPU heads holding the same entries; each step matches a batch
// on both sides, compares, then pushes the same new entry into both.
class MatchHarness {
 public:
  MatchHarness(const Geometry& g, std::vector<int32_t> tokens, uint64_t seed)
      : g_(g), params_(TestParams()), tokens_(std::move(tokens)), rng_(seed) {
    const int batch = static_cast<int>(tokens_.size());
    const cuda::DecodeShape shape = g.Shape(batch);
    max_tokens_ = *std::max_element(tokens_.begin(), tokens_.end()) + 64;
    auto ws = cuda::ReTopKMatchWorkspace::Create(shape, kTopK, params_, max_tokens_);
    EXPECT_TRUE(ws.ok()) << ws.status();
    if (ws.ok()) ws_ = *std::move(ws);
    ReTopKHeadParams head;
    head.top_k = kTopK;
    head.reuse_neighbors = params_.reuse_neighbors;
    head.recent_window = params_.recent_window;
    head.refresh_interval = params_.refresh_interval;
    head.tau = params_.tau;
    std::vector<cuda::ReTopKCachesView> views;
    for (int b = 0; b < batch; ++b) {
      auto caches = cuda::ReTopKCaches::Create(g.q_heads, g.head_dim, kTopK, params_);
      EXPECT_TRUE(caches.ok()) << caches.status();
      views.push_back((*caches)->view());
      caches_.push_back(*std::move(caches));
      for (int h = 0; h < g.q_heads; ++h) {
        heads_.emplace_back(head, params_.cache_capacity, g.head_dim);
      }
    }
    d_caches_ = ToDevice(views);
    const int rows = shape.rows();
    unit_q_ = ToDevice(std::vector<float>(rows * g.head_dim));
    paths_ = ToDevice(std::vector<uint8_t>(rows));
    best_ = ToDevice(std::vector<float>(rows));
    neighbors_ = ToDevice(std::vector<int32_t>(rows * (1 + params_.cache_capacity)));
    counts_ = ToDevice(std::vector<int32_t>(rows));
    candidates_ = ToDevice(std::vector<int32_t>(rows * MaxCandidates(), -1));
  }

  int Rows() const { return static_cast<int>(tokens_.size()) * g_.q_heads; }
  int MaxCandidates() const { return static_cast<int>(cuda::ReTopKMaxCandidates(kTopK, params_)); }
  cuda::ReTopKMatchWorkspace* ws() { return ws_.get(); }

  // A support for row `row` of its sequence of `n` tokens: random distinct ids, some of them
  // among the last W (which the union adds anyway), of a random size in [0, K].
  std::vector<int32_t> RandomSupport(int32_t n) {
    std::vector<int32_t> all(n);
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng_);
    all.resize(std::min<int32_t>(n, static_cast<int32_t>(rng_() % (kTopK + 1))));
    return all;
  }

  // Pushes one entry per row into both sides: unit queries from the host (then both caches hold
  // identical floats) or, with `gpu_units`, the GPU's last match's (the host pushes its own).
  void Push(const std::vector<float>& host_units, bool gpu_units) {
    const int rows = Rows();
    std::vector<int32_t> supports(rows * kTopK, -1), sizes(rows);
    for (int row = 0; row < rows; ++row) {
      const std::vector<int32_t> s = RandomSupport(tokens_[row / g_.q_heads]);
      std::copy(s.begin(), s.end(), supports.begin() + row * kTopK);
      sizes[row] = static_cast<int32_t>(s.size());
      const float* unit =
          gpu_units ? heads_[row].unit_query() : host_units.data() + row * g_.head_dim;
      heads_[row].mutable_cache()->Push(unit, s);
    }
    auto d_units = ToDevice(host_units);
    auto d_supports = ToDevice(supports);
    auto d_sizes = ToDevice(sizes);
    const absl::Status pushed = cuda::ReTopKPushEntries(
        g_.Shape(static_cast<int>(tokens_.size())), kTopK, params_, d_caches_.data(),
        gpu_units ? unit_q_.data() : d_units.data(), d_supports.data(), d_sizes.data(), ws_.get(),
        nullptr);
    ASSERT_TRUE(pushed.ok()) << pushed;
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }

  // Random unit queries for every row.
  std::vector<float> RandomUnits(uint64_t seed) {
    const std::vector<float> x = RandomNormal(Rows() * g_.head_dim, seed);
    std::vector<float> units;
    for (int row = 0; row < Rows(); ++row) {
      const std::vector<float> u = Unit(x.data() + row * g_.head_dim, g_.head_dim);
      units.insert(units.end(), u.begin(), u.end());
    }
    return units;
  }

  // Queries: most rows near one of their cached entries (reuse at tau 0.5), some random
  // (fallback).
  std::vector<float> Queries(uint64_t seed) {
    std::vector<float> q = RandomNormal(Rows() * g_.head_dim, seed, 0.05f);
    for (int row = 0; row < Rows(); ++row) {
      if (rng_() % 4 == 0) {
        for (int j = 0; j < g_.head_dim; ++j) q[row * g_.head_dim + j] *= 20.0f;
        continue;
      }
      const QuerySupportCache& cache = heads_[row].cache();
      const float* near = cache.query(static_cast<int>(rng_() % cache.size()));
      for (int j = 0; j < g_.head_dim; ++j) q[row * g_.head_dim + j] += near[j];
    }
    return q;
  }

  // One match of every sequence on both sides; the candidates go to mapped host memory with
  // `mapped`. Counts the paths taken.
  void MatchAndCompare(const std::vector<float>& q, bool mapped,
                       int (&paths_seen)[kSelectionPaths]) {
    const int batch = static_cast<int>(tokens_.size());
    const int rows = Rows();
    std::vector<DeviceSeq> seqs;
    for (int32_t n : tokens_) seqs.push_back(DeviceSeq::Contiguous(nullptr, nullptr, n));
    auto d_seqs = ToDevice(seqs);
    auto d_q = ToDevice(q);
    MappedInts host_candidates(static_cast<size_t>(rows) * MaxCandidates());
    cuda::ReTopKMatchOutputs out{unit_q_.data(), paths_.data(), best_.data(), neighbors_.data(),
                                 counts_.data(),
                                 mapped ? host_candidates.device : candidates_.data()};
    const absl::Status matched =
        cuda::ReTopKMatch(g_.Shape(batch), kTopK, params_, d_seqs.data(), d_caches_.data(),
                          d_q.data(), max_tokens_, ws_.get(), out, nullptr);
    ASSERT_TRUE(matched.ok()) << matched;
    ASSERT_TRUE(ws_->errors().CheckAndClear(nullptr).ok());
    const std::vector<uint8_t> paths = ToHost(paths_.data(), rows);
    const std::vector<float> best = ToHost(best_.data(), rows);
    const int stride = 1 + params_.cache_capacity;
    const std::vector<int32_t> neighbors = ToHost(neighbors_.data(), rows * stride);
    const std::vector<int32_t> counts = ToHost(counts_.data(), rows);
    const std::vector<int32_t> candidates =
        mapped ? std::vector<int32_t>(host_candidates.host,
                                      host_candidates.host + rows * MaxCandidates())
               : ToHost(candidates_.data(), rows * MaxCandidates());
    const std::vector<float> unit_q = ToHost(unit_q_.data(), rows * g_.head_dim);
    for (int row = 0; row < rows; ++row) {
      const int32_t n = tokens_[row / g_.q_heads];
      SCOPED_TRACE(absl::StrCat("row ", row, " n=", n));
      ReTopKHead& head = heads_[row];
      float want_best = 0;
      const SelectionPath want = head.Match(q.data() + row * g_.head_dim, n, n, &want_best);
      for (int j = 0; j < g_.head_dim; ++j) {
        ASSERT_NEAR(unit_q[row * g_.head_dim + j], head.unit_query()[j], 1e-6f);
      }
      EXPECT_NEAR(best[row], want_best, 1e-5f);
      if (std::abs(want_best - params_.tau) < 1e-5f) continue;  // a coin flip
      ASSERT_EQ(paths[row], static_cast<uint8_t>(want));
      ++paths_seen[paths[row]];
      const int32_t* row_neighbors = neighbors.data() + row * stride;
      if (want != SelectionPath::kReuse) {
        EXPECT_EQ(row_neighbors[0], 0);
        EXPECT_EQ(counts[row], n);  // an exact row scores every token
        continue;
      }
      // Near-equal cosines at the R-th place may pick either entry: skip those rows.
      const QuerySupportCache& cache = head.cache();
      std::vector<float> cosines(cache.size());
      cache.Cosines(head.unit_query(), cosines.data());
      std::sort(cosines.begin(), cosines.end(), std::greater<float>());
      const int r = std::min(params_.reuse_neighbors, cache.size());
      if (r < cache.size() && cosines[r - 1] - cosines[r] < 1e-5f) continue;
      ASSERT_EQ(row_neighbors[0], r);
      std::vector<int32_t> ages;
      for (int i = 0; i < r; ++i) ages.push_back(cache.AgeOfSlot(row_neighbors[1 + i]));
      EXPECT_THAT(ages, ElementsAreArray(Vec(head.neighbors())));
      ASSERT_EQ(counts[row], static_cast<int32_t>(head.candidates().size()));
      const int32_t* got = candidates.data() + row * MaxCandidates();
      EXPECT_THAT(std::vector<int32_t>(got, got + counts[row]),
                  ElementsAreArray(Vec(head.candidates())));
      // The host's own union of the GPU's neighbors is the same list.
      std::vector<int32_t> from_ages;
      UnionReuseCandidates(cache, ages, n, params_.recent_window, &from_ages);
      EXPECT_THAT(from_ages, ElementsAreArray(Vec(head.candidates())));
    }
  }

  // Every sequence advances by one token.
  void Advance() {
    for (int32_t& n : tokens_) ++n;
  }

 private:
  Geometry g_;
  ReTopKParams params_;
  std::vector<int32_t> tokens_;
  std::mt19937_64 rng_;
  int max_tokens_ = 0;
  std::unique_ptr<cuda::ReTopKMatchWorkspace> ws_;
  std::vector<std::unique_ptr<cuda::ReTopKCaches>> caches_;
  std::vector<ReTopKHead> heads_;  // [rows]
  cuda::DeviceBuffer<cuda::ReTopKCachesView> d_caches_;
  cuda::DeviceBuffer<float> unit_q_;
  cuda::DeviceBuffer<uint8_t> paths_;
  cuda::DeviceBuffer<float> best_;
  cuda::DeviceBuffer<int32_t> neighbors_;
  cuda::DeviceBuffer<int32_t> counts_;
  cuda::DeviceBuffer<int32_t> candidates_;
};

class CudaReTopKMatchTest : public ::testing::TestWithParam<Geometry> {};

TEST_P(CudaReTopKMatchTest, MatchesTheCpuReferenceDecisionForDecision) {
  KVRECALL_SKIP_WITHOUT_GPU();
  // A ragged batch; the second history is shorter than the window plus a support.
  MatchHarness harness(GetParam(), {700, 30, 2049}, 17);
  ASSERT_NE(harness.ws(), nullptr);
  // Fill the caches past capacity so that their FIFOs have wrapped.
  for (int i = 0; i < TestParams().cache_capacity + 3; ++i) {
    ASSERT_NO_FATAL_FAILURE(harness.Push(harness.RandomUnits(100 + i), /*gpu_units=*/false));
  }
  int paths_seen[kSelectionPaths] = {};
  for (int step = 0; step < 16; ++step) {
    SCOPED_TRACE(absl::StrCat("step ", step));
    ASSERT_NO_FATAL_FAILURE(
        harness.MatchAndCompare(harness.Queries(1000 + step), step % 2 == 1, paths_seen));
    // The GPU appends its own unit queries, the host its own (equal to rounding).
    ASSERT_NO_FATAL_FAILURE(harness.Push(std::vector<float>(), /*gpu_units=*/true));
    harness.Advance();
  }
  EXPECT_GT(paths_seen[static_cast<int>(SelectionPath::kReuse)], 0);
  EXPECT_GT(paths_seen[static_cast<int>(SelectionPath::kFallback)], 0);
  EXPECT_GT(paths_seen[static_cast<int>(SelectionPath::kRefresh)], 0);
}

INSTANTIATE_TEST_SUITE_P(Geometries, CudaReTopKMatchTest,
                         ::testing::Values(Geometry{8, 2, 128, KvDtype::kBf16},
                                           Geometry{4, 4, 64, KvDtype::kF16}),
                         ::kvrecall::testing::GeometryName);

std::string Message(const absl::Status& status) { return std::string(status.message()); }

// Support ids outside the history and sizes above K are skipped and reported; workspaces and
// calls that do not fit are refused with INVALID_ARGUMENT.
TEST(CudaReTopKMatchWorkspaceTest, ViolationsReportedAndMisfitsRefused) {
  KVRECALL_SKIP_WITHOUT_GPU();
  const Geometry g{4, 2, 64, KvDtype::kBf16};
  ReTopKParams params = TestParams();
  params.tau = -2.0f;  // every row with an entry reuses
  params.refresh_interval = 0;
  const cuda::DecodeShape shape = g.Shape(1);
  constexpr int kTokens = 100;
  EXPECT_THAT(Message(cuda::ReTopKMatchWorkspace::Create(shape, kTopK, params, 1 << 26).status()),
              HasSubstr("bytes of shared memory"));
  EXPECT_EQ(cuda::ReTopKMatchWorkspace::Create(shape, kTopK, params, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto ws = cuda::ReTopKMatchWorkspace::Create(shape, kTopK, params, kTokens);
  ASSERT_TRUE(ws.ok()) << ws.status();
  auto caches = cuda::ReTopKCaches::Create(g.q_heads, g.head_dim, kTopK, params);
  ASSERT_TRUE(caches.ok()) << caches.status();
  auto d_caches = ToDevice(std::vector<cuda::ReTopKCachesView>{(*caches)->view()});
  const int rows = shape.rows();
  auto units = ToDevice(std::vector<float>(rows * g.head_dim, 0.125f));
  // Row 0's support holds an id beyond the history; row 1's size exceeds K.
  std::vector<int32_t> supports(rows * kTopK, 1), sizes(rows, 1);
  supports[0] = kTokens + 5;
  sizes[1] = kTopK + 1;
  auto d_supports = ToDevice(supports);
  auto d_sizes = ToDevice(sizes);
  ASSERT_TRUE(cuda::ReTopKPushEntries(shape, kTopK, params, d_caches.data(), units.data(),
                                      d_supports.data(), d_sizes.data(), ws->get(), nullptr)
                  .ok());
  EXPECT_THAT(Message((*ws)->errors().CheckAndClear(nullptr)),
              HasSubstr("a count above its stated maximum"));

  auto d_seqs = ToDevice(std::vector<DeviceSeq>{DeviceSeq::Contiguous(nullptr, nullptr, kTokens)});
  auto d_q = ToDevice(std::vector<float>(rows * g.head_dim, 1.0f));
  auto unit_q = ToDevice(std::vector<float>(rows * g.head_dim));
  auto paths = ToDevice(std::vector<uint8_t>(rows));
  auto best = ToDevice(std::vector<float>(rows));
  auto neighbors = ToDevice(std::vector<int32_t>(rows * (1 + params.cache_capacity)));
  auto counts = ToDevice(std::vector<int32_t>(rows));
  const int max_candidates = static_cast<int>(cuda::ReTopKMaxCandidates(kTopK, params));
  auto candidates = ToDevice(std::vector<int32_t>(rows * max_candidates));
  const cuda::ReTopKMatchOutputs out{unit_q.data(), paths.data(),  best.data(),
                                     neighbors.data(), counts.data(), candidates.data()};
  ASSERT_TRUE(cuda::ReTopKMatch(shape, kTopK, params, d_seqs.data(), d_caches.data(), d_q.data(),
                                kTokens, ws->get(), out, nullptr)
                  .ok());
  EXPECT_THAT(Message((*ws)->errors().CheckAndClear(nullptr)),
              HasSubstr("an index outside its sequence"));
  // Row 0 kept its in-range ids and the window; row 1's support was cut at K (id 1 only).
  const std::vector<int32_t> host_counts = ToHost(counts.data(), rows);
  EXPECT_EQ(host_counts[0], params.recent_window);
  EXPECT_EQ(host_counts[1], 1 + params.recent_window);

  EXPECT_THAT(Message(cuda::ReTopKMatch(g.Shape(2), kTopK, params, d_seqs.data(),
                                        d_caches.data(), d_q.data(), kTokens, ws->get(), out,
                                        nullptr)),
              HasSubstr("do not fit the ReTopK match workspace"));
  EXPECT_THAT(Message(cuda::ReTopKMatch(shape, kTopK, params, d_seqs.data(), d_caches.data(),
                                        d_q.data(), kTokens + 1, ws->get(), out, nullptr)),
              HasSubstr("max_tokens must be in [1, 100]"));
  cuda::ReTopKMatchOutputs missing = out;
  missing.neighbors = nullptr;
  EXPECT_EQ(cuda::ReTopKMatch(shape, kTopK, params, d_seqs.data(), d_caches.data(), d_q.data(),
                              kTokens, ws->get(), missing, nullptr)
                .code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvrecall
