#include "index/retopk.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <functional>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <span>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "index/basic_selectors.h"
#include "index/index_selector.h"
#include "index/support_selector.h"
#include "kernels/cpu/attention.h"
#include "kernels/fidelity.h"
#include "tests/test_util.h"

namespace kvrecall {
namespace {

using ::kvrecall::testing::RandomKv;
using ::kvrecall::testing::RandomNormal;
using ::kvrecall::testing::ReferenceTopK;
using ::kvrecall::testing::StopAfterAsks;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

constexpr float kInf = std::numeric_limits<float>::infinity();

KvView Prefix(const KvView& kv, int64_t tokens) {
  KvView prefix = kv;
  prefix.tokens = tokens;
  return prefix;
}

std::vector<float> Unit(const float* x, int n) {
  std::vector<float> unit(n);
  cpu::Normalize(x, n, unit.data());
  return unit;
}

LayerShape Shape(int q_heads, int kv_heads, int head_dim) {
  return LayerShape{q_heads, kv_heads, head_dim, 1.0f / std::sqrt(static_cast<float>(head_dim))};
}

SelectorParams ReTopK(int top_k, float tau, int refresh_interval) {
  SelectorParams params;
  params.kind = SelectorKind::kReTopK;
  params.top_k = top_k;
  params.retopk.tau = tau;
  params.retopk.refresh_interval = refresh_interval;
  return params;
}

std::unique_ptr<SupportSelector> Make(const SelectorParams& params, const LayerShape& shape) {
  absl::StatusOr<std::unique_ptr<SupportSelector>> selector = MakeSelector(params, shape);
  EXPECT_TRUE(selector.ok()) << selector.status();
  return selector.ok() ? std::move(*selector) : nullptr;
}

TEST(ReTopKKernelsTest, DotProductsAndNormalizeMatchScalarReferences) {
  const int n = 37, rows = 5;
  std::vector<float> x = RandomNormal(n, 1), m = RandomNormal(rows * n, 2);
  std::vector<float> out(rows);
  cpu::DotProducts(x.data(), m.data(), rows, n, out.data());
  for (int r = 0; r < rows; ++r) {
    double ref = 0;
    for (int j = 0; j < n; ++j) ref += static_cast<double>(x[j]) * m[r * n + j];
    EXPECT_NEAR(out[r], ref, 1e-4);
  }
  std::vector<float> unit(n);
  const float norm = cpu::Normalize(x.data(), n, unit.data());
  double ref_norm = 0;
  for (float v : x) ref_norm += static_cast<double>(v) * v;
  ref_norm = std::sqrt(ref_norm);
  EXPECT_NEAR(norm, ref_norm, 1e-4);
  for (int j = 0; j < n; ++j) EXPECT_NEAR(unit[j], x[j] / ref_norm, 1e-6);

  std::vector<float> zero(n, 0.0f);
  EXPECT_EQ(cpu::Normalize(zero.data(), n, unit.data()), 0.0f);
  for (float v : unit) EXPECT_EQ(v, 0.0f);
}

TEST(ReTopKKernelsTest, WeightedSupportRecallCountsSoftmaxMass) {
  const std::vector<int32_t> exact = {4, 9, 2};
  const std::vector<float> scores = {2.0f, 1.0f, 0.0f};
  std::vector<uint8_t> marks;
  const double total = 1.0 + std::exp(-1.0) + std::exp(-2.0);
  EXPECT_DOUBLE_EQ(WeightedSupportRecall(std::vector<int32_t>{9, 7, 2}, exact, scores, 10, &marks),
                   (std::exp(-1.0) + std::exp(-2.0)) / total);
  EXPECT_DOUBLE_EQ(WeightedSupportRecall(std::vector<int32_t>{4}, exact, scores, 10, &marks),
                   1.0 / total);
  EXPECT_DOUBLE_EQ(WeightedSupportRecall(exact, exact, scores, 10, &marks), 1.0);
  EXPECT_DOUBLE_EQ(WeightedSupportRecall(std::vector<int32_t>{}, exact, scores, 10, &marks), 0.0);
  EXPECT_DOUBLE_EQ(WeightedSupportRecall(exact, {}, {}, 10, &marks), 1.0);
  EXPECT_EQ(std::count(marks.begin(), marks.end(), 1), 0);
}

TEST(ReTopKPathTest, RefreshWinsThenSimilarityDecides) {
  EXPECT_EQ(ChooseReTopKPath(4, 0.99f, 0.85f, 128, 128), SelectionPath::kRefresh);
  EXPECT_EQ(ChooseReTopKPath(4, 0.99f, 0.85f, 256, 128), SelectionPath::kRefresh);
  EXPECT_EQ(ChooseReTopKPath(0, -kInf, 0.85f, 128, 128), SelectionPath::kRefresh);
  EXPECT_EQ(ChooseReTopKPath(4, 0.99f, 0.85f, 127, 128), SelectionPath::kReuse);
  EXPECT_EQ(ChooseReTopKPath(4, 0.85f, 0.85f, 1, 128), SelectionPath::kReuse);  // >= tau
  EXPECT_EQ(ChooseReTopKPath(4, 0.8499f, 0.85f, 1, 128), SelectionPath::kFallback);
  EXPECT_EQ(ChooseReTopKPath(4, std::nanf(""), -2.0f, 1, 0), SelectionPath::kFallback);
  EXPECT_EQ(ChooseReTopKPath(0, -kInf, -kInf, 1, 0), SelectionPath::kFallback);  // empty cache
  EXPECT_EQ(ChooseReTopKPath(4, -0.5f, -2.0f, 1000, 0), SelectionPath::kReuse);  // Tr = 0
}

TEST(QuerySupportCacheTest, KeepsTheNewestCapacityEntriesInFifoOrder) {
  const int capacity = 4, d = 8;
  QuerySupportCache cache(capacity, d);
  std::vector<std::vector<float>> queries;
  for (int i = 0; i < 11; ++i) {
    std::vector<float> raw = RandomNormal(d, 100 + i);
    queries.push_back(Unit(raw.data(), d));
    const std::vector<int32_t> support = {i, 100 + i, 200 + i};
    cache.Push(queries.back().data(), support);
    ASSERT_EQ(cache.size(), std::min(i + 1, capacity));
    // Age 0 is the oldest surviving entry, age size-1 the one just pushed.
    for (int age = 0; age < cache.size(); ++age) {
      const int pushed = i + 1 - cache.size() + age;
      EXPECT_THAT(cache.support(age), ElementsAreArray({pushed, 100 + pushed, 200 + pushed}));
      EXPECT_EQ(std::memcmp(cache.query(age), queries[pushed].data(), d * sizeof(float)), 0);
    }
    std::vector<float> cosines(cache.size());
    cache.Cosines(queries[0].data(), cosines.data());
    for (int age = 0; age < cache.size(); ++age) {
      EXPECT_EQ(cosines[age], cpu::DotProduct(queries[0].data(), cache.query(age), d));
    }
  }
  EXPECT_EQ(cache.capacity(), capacity);
}

// Its bytes, kept as entries come and go, equal the sum over its slots of what a vector given
// the same supports in the same order holds (supports of changing sizes: a slot's room grows,
// and stays).
TEST(QuerySupportCacheTest, MemoryBytesAreThoseOfItsSlotsKeptAsItChanges) {
  const int capacity = 3, d = 8;
  QuerySupportCache cache(capacity, d);
  std::vector<std::vector<int32_t>> slots(capacity);
  const std::vector<float> query = Unit(RandomNormal(d, 5).data(), d);
  int64_t last = cache.MemoryBytes();
  for (int i = 0; i < 12; ++i) {
    const int size = (i * 7) % 11 + (i == 9 ? 40 : 0);
    std::vector<int32_t> support(size);
    for (int j = 0; j < size; ++j) support[j] = i * 100 + j;
    cache.Push(query.data(), support);
    slots[i % capacity].assign(support.begin(), support.end());  // FIFO: slot i % capacity
    int64_t want = int64_t{capacity} * d * static_cast<int64_t>(sizeof(float));
    for (const std::vector<int32_t>& slot : slots) {
      want += static_cast<int64_t>(slot.capacity() * sizeof(int32_t));
    }
    EXPECT_EQ(cache.MemoryBytes(), want) << "push " << i;
    EXPECT_GE(cache.MemoryBytes(), last) << "push " << i;
    last = cache.MemoryBytes();
  }
}

// The property the reuse path is built on: when the exact top-K support lies inside the
// candidate set, the reuse step returns exactly it, in the exact path's order.
TEST(ReTopKHeadTest, ReuseReturnsTheExactSupportWhenTheCandidatesContainIt) {
  std::mt19937_64 rng(42);
  for (int trial = 0; trial < 60; ++trial) {
    const int d = 16, tokens = 300 + trial * 7, kv_heads = 2;
    const int top_k = 1 + static_cast<int>(rng() % 64);
    const int neighbors = 1 + static_cast<int>(rng() % 4);
    const int window = static_cast<int>(rng() % 40);
    RandomKv kv(tokens, kv_heads, d, 1000 + trial);
    const int kv_head = trial % kv_heads;
    const float scale = 0.25f;
    std::vector<float> q = RandomNormal(d, 2000 + trial, 2.0f);
    std::vector<int32_t> exact;
    cpu::ExactTopK(q.data(), kv.view(), kv_head, scale, top_k, &exact);

    // Spread the exact support (those tokens the recent window does not cover) over the
    // `neighbors` most similar entries, each padded with random other tokens; older, less
    // similar entries hold random supports that must not be used.
    const int capacity = neighbors + 3;
    ReTopKHeadParams params{top_k, neighbors, window, /*refresh_interval=*/0, /*tau=*/0.5f, scale};
    ReTopKHead head(params, capacity, d);
    std::vector<std::vector<int32_t>> parts(neighbors);
    std::set<int32_t> expected_candidates;
    for (int32_t t = std::max(0, tokens - window); t < tokens; ++t) expected_candidates.insert(t);
    for (size_t i = 0; i < exact.size(); ++i) {
      if (exact[i] < tokens - window) parts[rng() % neighbors].push_back(exact[i]);
    }
    for (int e = 0; e < capacity; ++e) {
      std::vector<float> direction = RandomNormal(d, 3000 + trial * 10 + e);
      std::vector<int32_t> support;
      for (int j = 0; j < 5; ++j) support.push_back(static_cast<int32_t>(rng() % tokens));
      if (e >= capacity - neighbors) {
        // The similar entries: close to q so they rank above the others.
        for (int j = 0; j < d; ++j) direction[j] = q[j] + 0.05f * direction[j];
        const std::vector<int32_t>& part = parts[e - (capacity - neighbors)];
        support.insert(support.end(), part.begin(), part.end());
        expected_candidates.insert(support.begin(), support.end());
      }
      head.mutable_cache()->Push(Unit(direction.data(), d).data(), support);
    }

    HeadSelection out;
    head.Step(q.data(), kv.view(), kv_head, /*decode_step=*/1, &out);
    ASSERT_EQ(out.path, SelectionPath::kReuse) << "trial " << trial;
    EXPECT_EQ(out.support, exact) << "trial " << trial;
    EXPECT_EQ(out.candidates, static_cast<int32_t>(expected_candidates.size()));
    EXPECT_GT(out.best_cosine, 0.99f);
    // The step entered the cache as its newest entry, with the support it returned.
    EXPECT_THAT(head.cache().support(capacity - 1), ElementsAreArray(exact));
  }
}

// With deferred pushes a step's (q̄, support) enters the cache only at PushPending, as the
// newest entry, exactly what the step returned; the next step drops one never pushed (its step
// failed), and a PushPending with nothing pending changes nothing.
TEST(ReTopKHeadTest, DeferredPushesEnterAtPushPendingAndAreDroppedByTheNextStep) {
  const int d = 16, tokens = 300, top_k = 8;
  RandomKv kv(tokens, 1, d, 11);
  ReTopKHeadParams params{top_k, /*reuse_neighbors=*/1, /*recent_window=*/4, 0, 0.5f, 1.0f};
  ReTopKHead head(params, /*cache_capacity=*/4, d);
  head.set_defer_push(true);
  const std::vector<float> q1 = RandomNormal(d, 12), q2 = RandomNormal(d, 13),
                           q3 = RandomNormal(d, 14);
  HeadSelection out;
  head.Step(q1.data(), kv.view(), 0, 1, &out);
  EXPECT_EQ(head.cache().size(), 0) << "pending until PushPending";
  head.PushPending();
  ASSERT_EQ(head.cache().size(), 1);
  EXPECT_THAT(head.cache().support(0), ElementsAreArray(out.support));
  const std::vector<float> u1 = Unit(q1.data(), d);
  for (int j = 0; j < d; ++j) EXPECT_FLOAT_EQ(head.cache().query(0)[j], u1[j]);
  head.PushPending();
  EXPECT_EQ(head.cache().size(), 1) << "nothing pending";

  head.Step(q2.data(), kv.view(), 0, 2, &out);  // its step fails: never pushed
  head.Step(q3.data(), kv.view(), 0, 3, &out);
  head.PushPending();
  ASSERT_EQ(head.cache().size(), 2) << "q2's entry dropped by q3's step";
  EXPECT_THAT(head.cache().support(1), ElementsAreArray(out.support));
  const std::vector<float> u3 = Unit(q3.data(), d);
  for (int j = 0; j < d; ++j) EXPECT_FLOAT_EQ(head.cache().query(1)[j], u3[j]);
  EXPECT_GE(head.MemoryBytes(), top_k * static_cast<int64_t>(sizeof(int32_t)));
}

TEST(ReTopKHeadTest, ReuseRanksOnlyTheCandidatesWithTheCurrentQuery) {
  const int d = 16, tokens = 400, top_k = 20;
  RandomKv kv(tokens, 1, d, 5);
  std::vector<float> q = RandomNormal(d, 6);
  ReTopKHeadParams params{top_k, /*reuse_neighbors=*/1, /*recent_window=*/10, 0, -2.0f, 1.0f};
  ReTopKHead head(params, 2, d);
  std::vector<int32_t> cached = {3, 50, 7, 99, 120, 121, 122, 200, 201, 5, 50, 390};
  head.mutable_cache()->Push(Unit(q.data(), d).data(), cached);
  HeadSelection out;
  head.Step(q.data(), kv.view(), 0, 1, &out);
  ASSERT_EQ(out.path, SelectionPath::kReuse);
  // Brute force: the distinct candidates ranked by the current query.
  std::set<int32_t> candidates(cached.begin(), cached.end());
  for (int t = tokens - 10; t < tokens; ++t) candidates.insert(t);
  std::vector<int32_t> ranked(candidates.begin(), candidates.end());
  std::stable_sort(ranked.begin(), ranked.end(), [&](int32_t a, int32_t b) {
    return cpu::DotProduct(q.data(), kv.view().key(a, 0), d) >
           cpu::DotProduct(q.data(), kv.view().key(b, 0), d);
  });
  ranked.resize(top_k);
  EXPECT_EQ(out.support, ranked);
  EXPECT_EQ(out.candidates, static_cast<int32_t>(candidates.size()));
  // The reuse path scored its support on the way: the scores come with it, as ScoreTokens
  // computes them.
  std::vector<float> scores(top_k);
  cpu::ScoreTokens(q.data(), kv.view(), 0, out.support, 1.0f, scores.data());
  EXPECT_EQ(out.support_scores, scores);
}

// Runs `steps` decode steps of a q_heads-head layer through `selector` (built on a prompt of
// `prompt` tokens), recording per step the supports, paths and attention outputs.
struct DecodeRun {
  std::vector<std::vector<std::vector<int32_t>>> supports;  // [step][head]
  std::vector<std::vector<SelectionPath>> paths;            // [step][head]
  std::vector<std::vector<int32_t>> candidates;             // [step][head]
  std::vector<std::vector<float>> outputs;                  // [step][q_heads * d]
};

DecodeRun RunDecode(SupportSelector* selector, const LayerShape& shape, const RandomKv& kv,
                    int64_t prompt, int steps, const std::vector<float>& queries) {
  const int d = shape.head_dim;
  const int64_t row = static_cast<int64_t>(shape.q_heads) * d;
  EXPECT_TRUE(selector->Build(Prefix(kv.view(), prompt), queries.data()).ok());
  DecodeRun run;
  for (int s = 0; s < steps; ++s) {
    const KvView view = Prefix(kv.view(), prompt + s + 1);
    selector->OnAppend(view);
    const float* q = queries.data() + (prompt + s) * row;
    std::vector<std::vector<int32_t>> supports(shape.q_heads);
    std::vector<SelectionPath> paths(shape.q_heads);
    std::vector<int32_t> candidates(shape.q_heads);
    for (int h = 0; h < shape.q_heads; ++h) {
      HeadSelection sel;
      selector->Select(h, q + h * d, view, &sel);
      supports[h] = sel.support;
      paths[h] = sel.path;
      candidates[h] = sel.candidates;
    }
    std::vector<float> o(row), lse(shape.q_heads);
    cpu::MultiHeadAttention(q, shape.q_heads, view, supports, shape.scale, o.data(), lse.data());
    run.supports.push_back(std::move(supports));
    run.paths.push_back(std::move(paths));
    run.candidates.push_back(std::move(candidates));
    run.outputs.push_back(std::move(o));
  }
  return run;
}

// A decode workload with drift: each head's queries follow a slowly rotating direction, so
// consecutive queries are similar (reuse fires) but the top-K moves.
std::vector<float> DriftingQueries(int64_t tokens, int q_heads, int d, uint64_t seed) {
  std::vector<float> out(tokens * q_heads * d);
  for (int h = 0; h < q_heads; ++h) {
    std::vector<float> dir = RandomNormal(d, seed + h, 2.0f);
    for (int64_t t = 0; t < tokens; ++t) {
      std::vector<float> step = RandomNormal(d, seed * 7919 + t * q_heads + h, 0.3f);
      for (int j = 0; j < d; ++j) {
        dir[j] = 0.97f * dir[j] + step[j];
        out[(t * q_heads + h) * d + j] = dir[j];
      }
    }
  }
  return out;
}

TEST(ReTopKSelectorTest, TauTwoEqualsExactTopKBitForBit) {
  const LayerShape shape = Shape(4, 2, 32);
  const int64_t prompt = 700;
  const int steps = 40;
  RandomKv kv(prompt + steps, shape.kv_heads, shape.head_dim, 17);
  const std::vector<float> queries = DriftingQueries(prompt + steps, shape.q_heads, 32, 3);
  std::unique_ptr<SupportSelector> retopk = Make(ReTopK(48, 2.0f, 7), shape);
  SelectorParams exact_params;
  exact_params.kind = SelectorKind::kExactTopK;
  exact_params.top_k = 48;
  std::unique_ptr<SupportSelector> exact = Make(exact_params, shape);
  const DecodeRun a = RunDecode(retopk.get(), shape, kv, prompt, steps, queries);
  const DecodeRun b = RunDecode(exact.get(), shape, kv, prompt, steps, queries);
  for (int s = 0; s < steps; ++s) {
    for (int h = 0; h < shape.q_heads; ++h) {
      EXPECT_EQ(a.supports[s][h], b.supports[s][h]) << "step " << s << " head " << h;
      EXPECT_EQ(a.paths[s][h],
                (s + 1) % 7 == 0 ? SelectionPath::kRefresh : SelectionPath::kFallback);
      EXPECT_EQ(a.candidates[s][h], prompt + s + 1);
    }
    EXPECT_EQ(std::memcmp(a.outputs[s].data(), b.outputs[s].data(),
                          a.outputs[s].size() * sizeof(float)),
              0)
        << "step " << s;
  }
}

// Select in parts (what the tiered placement does when its GPU runs some heads' exact paths):
// Decide, then SelectDecided on the host or CompleteDecided with an exact support chosen
// elsewhere (here the exact top K, handed over in another order), steps every head exactly as
// Select does, cache included, over a decode that mixes the paths.
TEST(ReTopKSelectorTest, DecidedInPartsStepsAsSelect) {
  const LayerShape shape = Shape(4, 2, 32);
  const int64_t prompt = 500;
  const int steps = 60, top_k = 24;
  RandomKv kv(prompt + steps, shape.kv_heads, shape.head_dim, 41);
  const std::vector<float> queries = DriftingQueries(prompt + steps, shape.q_heads, 32, 13);
  std::unique_ptr<SupportSelector> whole = Make(ReTopK(top_k, 0.97f, 11), shape);
  std::unique_ptr<SupportSelector> parts_owner = Make(ReTopK(top_k, 0.97f, 11), shape);
  auto* parts = static_cast<ReTopKSelector*>(parts_owner.get());
  ASSERT_TRUE(whole->Build(Prefix(kv.view(), prompt), queries.data()).ok());
  ASSERT_TRUE(parts->Build(Prefix(kv.view(), prompt), queries.data()).ok());
  const int d = shape.head_dim;
  int reused = 0, completed_elsewhere = 0;
  for (int s = 0; s < steps; ++s) {
    const KvView view = Prefix(kv.view(), prompt + s + 1);
    whole->OnAppend(view);
    parts->OnAppend(view);
    const float* q = queries.data() + (prompt + s) * shape.q_heads * d;
    // Every head decided before any runs.
    std::vector<SelectionPath> decided(shape.q_heads);
    std::vector<float> best(shape.q_heads);
    for (int h = 0; h < shape.q_heads; ++h) {
      decided[h] = parts->Decide(h, q + h * d, view.tokens, &best[h]);
    }
    for (int h = 0; h < shape.q_heads; ++h) {
      HeadSelection want;
      whole->Select(h, q + h * d, view, &want);
      ASSERT_EQ(decided[h], want.path) << "step " << s << " head " << h;
      EXPECT_EQ(best[h], want.best_cosine) << "step " << s << " head " << h;
      if (want.path == SelectionPath::kReuse) ++reused;
      if (want.path != SelectionPath::kReuse && h % 2 == 0) {
        // The exact path run elsewhere: the same support, reversed.
        std::vector<int32_t> support = want.support;
        std::reverse(support.begin(), support.end());
        parts->CompleteDecided(h, support);
        ++completed_elsewhere;
        continue;
      }
      HeadSelection got;
      parts->SelectDecided(h, q + h * d, view, &got);
      EXPECT_EQ(got.path, want.path) << "step " << s << " head " << h;
      EXPECT_EQ(got.best_cosine, want.best_cosine);
      EXPECT_EQ(got.candidates, want.candidates) << "step " << s << " head " << h;
      EXPECT_EQ(got.support, want.support) << "step " << s << " head " << h;
    }
  }
  // Both paths ran, and the reuse steps after a support handed over read the same cache.
  EXPECT_GT(reused, steps * shape.q_heads / 10);
  EXPECT_GT(completed_elsewhere, steps * shape.q_heads / 10);
}

TEST(ReTopKSelectorTest, TauMinusTwoWithoutRefreshAlwaysReuses) {
  const LayerShape shape = Shape(4, 2, 32);
  const int64_t prompt = 600;
  const int steps = 50;
  RandomKv kv(prompt + steps, shape.kv_heads, shape.head_dim, 23);
  const std::vector<float> queries = DriftingQueries(prompt + steps, shape.q_heads, 32, 5);
  std::unique_ptr<SupportSelector> retopk = Make(ReTopK(32, -2.0f, 0), shape);
  const DecodeRun run = RunDecode(retopk.get(), shape, kv, prompt, steps, queries);
  for (int s = 0; s < steps; ++s) {
    for (int h = 0; h < shape.q_heads; ++h) {
      EXPECT_EQ(run.paths[s][h], SelectionPath::kReuse) << "step " << s << " head " << h;
      // R = 4 supports of K = 32 and W = 32 recent tokens: at most 160 candidates.
      EXPECT_LE(run.candidates[s][h], 4 * 32 + 32);
      EXPECT_EQ(run.supports[s][h].size(), 32u);
    }
  }
}

TEST(ReTopKSelectorTest, RefreshesOnEveryTrThStepAndOnlyThen) {
  const LayerShape shape = Shape(2, 1, 16);
  const int64_t prompt = 200;
  const int steps = 23, refresh = 5;
  RandomKv kv(prompt + steps, 1, 16, 29);
  const std::vector<float> queries = DriftingQueries(prompt + steps, 2, 16, 9);
  std::unique_ptr<SupportSelector> retopk = Make(ReTopK(16, -2.0f, refresh), shape);
  const DecodeRun run = RunDecode(retopk.get(), shape, kv, prompt, steps, queries);
  for (int s = 0; s < steps; ++s) {
    const int step = s + 1;  // decode steps count from 1
    for (int h = 0; h < 2; ++h) {
      EXPECT_EQ(run.paths[s][h],
                step % refresh == 0 ? SelectionPath::kRefresh : SelectionPath::kReuse)
          << "step " << step;
    }
  }
}

// The cache after Build holds the last C prompt queries (normalized), oldest first, each with the
// exact top-K over the keys up to its own position; a shorter prompt fills it only partly.
TEST(ReTopKSelectorTest, BuildSeedsEachHeadFromTheLastPromptQueries) {
  for (int64_t prompt : {int64_t{900}, int64_t{20}}) {
    const LayerShape shape = Shape(6, 3, 24);  // three GQA groups of two heads
    RandomKv kv(prompt, shape.kv_heads, shape.head_dim, 31);
    const std::vector<float> queries = RandomNormal(prompt * 6 * 24, 37, 2.0f);
    SelectorParams params = ReTopK(40, 0.85f, 128);
    params.retopk.cache_capacity = 32;
    ReTopKSelector selector(shape, params.top_k, params.retopk);
    ASSERT_TRUE(selector.Build(kv.view(), queries.data()).ok());
    EXPECT_EQ(selector.prompt_tokens(), prompt);
    for (int h = 0; h < 6; ++h) {
      const QuerySupportCache& cache = selector.head(h).cache();
      ASSERT_EQ(cache.size(), std::min<int64_t>(32, prompt));
      EXPECT_EQ(selector.head(h).tau(), 0.85f);
      for (int age = 0; age < cache.size(); ++age) {
        const int64_t p = prompt - cache.size() + age;
        const float* q = queries.data() + (p * 6 + h) * 24;
        const std::vector<float> unit = Unit(q, 24);
        EXPECT_EQ(std::memcmp(cache.query(age), unit.data(), 24 * sizeof(float)), 0);
        const std::vector<int32_t> reference =
            ReferenceTopK(q, Prefix(kv.view(), p + 1), KvHeadOf(h, 6, 3), shape.scale, 40);
        EXPECT_THAT(cache.support(age), ElementsAreArray(reference))
            << "prompt " << prompt << " head " << h << " position " << p;
      }
    }
  }
}

// Heads of a GQA group attend through the same KV head but keep their own caches: a query that
// repeats head 0's last prompt query reuses on head 0 while head 1, with an unrelated history,
// falls back; each head's supports are ranked on its group's KV head.
TEST(ReTopKSelectorTest, HeadsOfAGroupShareTheKvButNotTheCache) {
  const int q_heads = 4, kv_heads = 2, d = 16;
  const LayerShape shape = Shape(q_heads, kv_heads, d);
  const int64_t prompt = 300;
  RandomKv kv(prompt + 1, kv_heads, d, 41);
  std::vector<float> queries = RandomNormal((prompt + 1) * q_heads * d, 43);
  // The decode query of every head repeats head 0's last prompt query.
  const float* last_of_head0 = queries.data() + ((prompt - 1) * q_heads + 0) * d;
  for (int h = 0; h < q_heads; ++h) {
    std::copy(last_of_head0, last_of_head0 + d, queries.begin() + (prompt * q_heads + h) * d);
  }
  SelectorParams params = ReTopK(24, 0.999f, 0);
  params.retopk.recent_window = 0;
  std::unique_ptr<SupportSelector> selector = Make(params, shape);
  ASSERT_TRUE(selector->Build(Prefix(kv.view(), prompt), queries.data()).ok());
  for (int h = 0; h < q_heads; ++h) {
    HeadSelection sel;
    const float* q = queries.data() + (prompt * q_heads + h) * d;
    selector->Select(h, q, kv.view(), &sel);
    EXPECT_EQ(sel.path, h == 0 ? SelectionPath::kReuse : SelectionPath::kFallback) << h;
    const int kv_head = KvHeadOf(h, q_heads, kv_heads);
    if (h == 0) {
      // Reusing its own last prompt support, re-ranked: a subset of that support's tokens.
      std::vector<int32_t> seeded = ReferenceTopK(last_of_head0, Prefix(kv.view(), prompt),
                                                  kv_head, shape.scale, 24);
      std::sort(seeded.begin(), seeded.end());
      std::vector<int32_t> got = sel.support;
      std::sort(got.begin(), got.end());
      EXPECT_EQ(got, seeded);
    } else {
      EXPECT_EQ(sel.support, ReferenceTopK(q, kv.view(), kv_head, shape.scale, 24)) << h;
    }
  }
}

TEST(ReTopKSelectorTest, InvalidKnobsAreRejectedNamingTheField) {
  const LayerShape shape = Shape(2, 1, 8);
  struct Case {
    void (*mutate)(SelectorParams*);
    const char* field;
  };
  const Case cases[] = {
      {[](SelectorParams* p) { p->top_k = 0; }, "policy.top_k"},
      {[](SelectorParams* p) { p->retopk.cache_capacity = 0; }, "policy.retopk.cache_capacity"},
      {[](SelectorParams* p) { p->retopk.reuse_neighbors = 0; }, "policy.retopk.reuse_neighbors"},
      {[](SelectorParams* p) { p->retopk.reuse_neighbors = 33; },
       "policy.retopk.reuse_neighbors"},
      {[](SelectorParams* p) { p->retopk.recent_window = -1; }, "policy.retopk.recent_window"},
      {[](SelectorParams* p) { p->retopk.tau = std::nanf(""); }, "policy.retopk.tau"},
      {[](SelectorParams* p) { p->retopk.tau = kInf; }, "policy.retopk.tau"},
      {[](SelectorParams* p) { p->retopk.refresh_interval = -1; },
       "policy.retopk.refresh_interval"},
      {[](SelectorParams* p) {
         p->retopk.auto_tau = true;
         p->retopk.target_recall = 0.0f;
       },
       "policy.retopk.target_recall"},
      {[](SelectorParams* p) {
         p->retopk.auto_tau = true;
         p->retopk.target_recall = 1.5f;
       },
       "policy.retopk.target_recall"},
      // Without auto_tau too: never echoed back in the effective policy as if it were served.
      {[](SelectorParams* p) { p->retopk.target_recall = std::nanf(""); },
       "policy.retopk.target_recall"},
  };
  for (const Case& c : cases) {
    SelectorParams params = ReTopK(16, 0.85f, 128);
    c.mutate(&params);
    absl::StatusOr<std::unique_ptr<SupportSelector>> selector = MakeSelector(params, shape);
    ASSERT_FALSE(selector.ok()) << c.field;
    EXPECT_EQ(selector.status().code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_THAT(std::string(selector.status().message()), HasSubstr(c.field));
  }
  // The boundaries themselves are valid: R = C, W = 0, Tr = 0, any finite tau, recall 1.
  SelectorParams edge = ReTopK(1, -5.0f, 0);
  edge.retopk.reuse_neighbors = edge.retopk.cache_capacity;
  edge.retopk.recent_window = 0;
  edge.retopk.auto_tau = true;
  edge.retopk.target_recall = 1.0f;
  EXPECT_TRUE(MakeSelector(edge, shape).ok());
}

TEST(ReTopKSelectorTest, BuildRejectsAKvOfAnotherShape) {
  RandomKv kv(10, 2, 8, 1);
  const std::vector<float> queries = RandomNormal(10 * 2 * 8, 2);
  ReTopKSelector selector(Shape(2, 1, 8), 4, ReTopKParams{});
  const absl::Status status = selector.Build(kv.view(), queries.data());
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr("KV has 2 heads of dim 8"));
}

TEST(CalibrateTauTest, PicksTheLowestCosineThatKeepsTheMeanRecall) {
  const std::vector<ReuseSample> samples = {
      {0.95f, 1.0f}, {0.9f, 0.9f}, {0.8f, 0.5f}, {0.7f, 0.2f}, {0.6f, 0.0f}};
  // Reusing everything: mean 2.6 / 5 = 0.52; from 0.7 up: (1 + 2.6) / 5 = 0.72; from 0.8 up:
  // (2 + 2.4) / 5 = 0.88; from 0.9 up: (3 + 1.9) / 5 = 0.98; from 0.95 up: 4 + 1 = 1.0.
  EXPECT_EQ(CalibrateTau(samples, 0.5f, 0.85f), 0.6f);
  EXPECT_EQ(CalibrateTau(samples, 0.71f, 0.85f), 0.7f);
  EXPECT_EQ(CalibrateTau(samples, 0.8f, 0.85f), 0.8f);
  EXPECT_EQ(CalibrateTau(samples, 0.95f, 0.85f), 0.9f);
  EXPECT_EQ(CalibrateTau(samples, 0.99f, 0.85f), 0.95f);
  EXPECT_EQ(CalibrateTau({}, 0.9f, 0.85f), 0.85f);
  // Perfect recall nowhere reused at 1.0 needs every step exact.
  const std::vector<ReuseSample> poor = {{0.99f, 0.5f}, {0.98f, 0.5f}};
  EXPECT_EQ(CalibrateTau(poor, 1.0f, 0.85f), kInf);
  // Equal cosines reuse together: the threshold cannot split them.
  const std::vector<ReuseSample> tied = {{0.9f, 1.0f}, {0.9f, 0.0f}, {0.95f, 1.0f}};
  EXPECT_EQ(CalibrateTau(tied, 0.6f, 0.85f), 0.9f);   // all reused: 2 / 3
  EXPECT_EQ(CalibrateTau(tied, 0.7f, 0.85f), 0.95f);  // 0.9s exact: 3 / 3
}

// A planted two-regime layer: head 0's queries barely move (cosines near 0.99, stable top-K, reuse
// is safe) while head 1's queries jump between random directions (cosines near 0.4, a reused
// support misses most of the exact one). No single tau fits both scales; the calibrated taus must
// let head 0 reuse nearly every step and head 1 rarely, each keeping the target (weighted)
// recall over the decode steps.
// Queries [tokens, 2, d] of two planted heads: head 0 stays near one direction (small jitter),
// head 1 jumps to a fresh random direction every token.
std::vector<float> PlantedQueries(int64_t tokens, int q_heads, int d) {
  std::vector<float> queries(tokens * q_heads * d);
  const std::vector<float> stable = RandomNormal(d, 59, 3.0f);
  for (int64_t t = 0; t < tokens; ++t) {
    const std::vector<float> jitter = RandomNormal(d, 61 + t, 0.3f);
    const std::vector<float> jump = RandomNormal(d, 1000003 + t, 3.0f);
    for (int j = 0; j < d; ++j) {
      queries[(t * q_heads + 0) * d + j] = stable[j] + jitter[j];
      queries[(t * q_heads + 1) * d + j] = jump[j];
    }
  }
  return queries;
}

TEST(ReTopKSelectorTest, AutoTauMeetsTheTargetPerHeadOnAPlantedCase) {
  const int q_heads = 2, d = 32, top_k = 32;
  const LayerShape shape = Shape(q_heads, 1, d);
  const int64_t prompt = 1500;
  const int steps = 200;
  const int64_t tokens = prompt + steps;
  RandomKv kv(tokens, 1, d, 53);
  const std::vector<float> queries = PlantedQueries(tokens, q_heads, d);
  SelectorParams params = ReTopK(top_k, 0.85f, 0);
  params.retopk.auto_tau = true;
  params.retopk.target_recall = 0.9f;
  ReTopKSelector selector(shape, top_k, params.retopk);
  const DecodeRun run = RunDecode(&selector, shape, kv, prompt, steps, queries);

  std::vector<uint8_t> marks;
  for (int h = 0; h < q_heads; ++h) {
    double recall = 0;
    int reused = 0;
    for (int s = 0; s < steps; ++s) {
      const KvView view = Prefix(kv.view(), prompt + s + 1);
      const float* q = queries.data() + ((prompt + s) * q_heads + h) * d;
      std::vector<int32_t> exact;
      cpu::ExactTopK(q, view, 0, shape.scale, top_k, &exact);
      std::vector<float> scores(exact.size());
      cpu::ScoreTokens(q, view, 0, exact, shape.scale, scores.data());
      recall += WeightedSupportRecall(run.supports[s][h], exact, scores, view.tokens, &marks);
      reused += run.paths[s][h] == SelectionPath::kReuse;
    }
    recall /= steps;
    EXPECT_GE(recall, 0.9) << "head " << h;
    if (h == 0) EXPECT_GE(reused, steps * 9 / 10);
    if (h == 1) EXPECT_LE(reused, steps / 5);
  }
}

// A selector over part of the history (the tiered bulk) calibrates on the whole attention: mass
// outside its view counts as kept. When nearly all of each query's mass lies outside the view,
// any reuse keeps it, so tau drops (the jumping head 1 strictly: alone it reuses only at its
// highest cosines); a negligible outside mass changes nothing.
TEST(ReTopKSelectorTest, AutoTauCountsTheMassOutsideTheViewAsKept) {
  const int q_heads = 2, d = 32, top_k = 32;
  const LayerShape shape = Shape(q_heads, 1, d);
  const int64_t prompt = 1500;
  RandomKv kv(prompt, 1, d, 53);
  const std::vector<float> queries = PlantedQueries(prompt, q_heads, d);
  SelectorParams params = ReTopK(top_k, 0.85f, 0);
  params.retopk.auto_tau = true;
  params.retopk.target_recall = 0.9f;
  auto calibrated = [&](ReTopKSelector::OutsideLse outside) {
    ReTopKSelector selector(shape, top_k, params.retopk);
    if (outside) selector.set_outside_lse(std::move(outside));
    EXPECT_TRUE(selector.Build(kv.view(), queries.data()).ok());
    return std::vector<float>{selector.head(0).tau(), selector.head(1).tau()};
  };
  const std::vector<float> alone = calibrated(nullptr);
  const std::vector<float> dominated = calibrated([](const float*, int64_t, int) { return 1e4f; });
  const std::vector<float> negligible = calibrated([](const float*, int64_t, int) { return -1e4f; });
  // The jumping head reuses only at its very highest cosines on its own.
  EXPECT_LT(dominated[1], alone[1]);
  for (int h = 0; h < q_heads; ++h) {
    EXPECT_LE(dominated[h], alone[h]) << "head " << h;
    EXPECT_EQ(negligible[h], alone[h]) << "head " << h;
  }
}

TEST(ReTopKSelectorTest, AutoTauOnAPromptWithoutRoomToReplayKeepsTheFixedTau) {
  const LayerShape shape = Shape(2, 1, 8);
  RandomKv kv(20, 1, 8, 3);
  const std::vector<float> queries = RandomNormal(20 * 2 * 8, 4);
  ReTopKParams params;
  params.auto_tau = true;
  params.tau = 0.7f;
  ReTopKSelector selector(shape, 4, params);  // C = 32 > 20 prompt tokens
  ASSERT_TRUE(selector.Build(kv.view(), queries.data()).ok());
  EXPECT_EQ(selector.head(0).tau(), 0.7f);
  EXPECT_EQ(selector.head(1).tau(), 0.7f);
}

// auto_tau counts a prompt query only when its view is at least R * K + W tokens (a shorter
// one's reuse step scores all of it and recalls everything): a prompt one query short of
// C + kCalibrationQueries counted ones keeps the fixed tau, one more calibrates every head.
TEST(ReTopKSelectorTest, AutoTauCountsOnlyQueriesWhoseViewOutgrowsAReuseStep) {
  const int q_heads = 2, d = 32, top_k = 32;
  const LayerShape shape = Shape(q_heads, 1, d);
  SelectorParams params = ReTopK(top_k, 0.85f, 0);
  params.retopk.auto_tau = true;
  const int64_t min_view = TauCalibration::MinView(top_k, params.retopk);
  EXPECT_EQ(min_view, 4 * top_k + params.retopk.recent_window);
  const int64_t enough = min_view - 1 + params.retopk.cache_capacity + kCalibrationQueries;
  RandomKv kv(enough, 1, d, 53);
  const std::vector<float> queries = PlantedQueries(enough, q_heads, d);
  ReTopKSelector short_one(shape, top_k, params.retopk);
  ASSERT_TRUE(short_one.Build(Prefix(kv.view(), enough - 1), queries.data()).ok());
  ReTopKSelector long_one(shape, top_k, params.retopk);
  ASSERT_TRUE(long_one.Build(kv.view(), queries.data()).ok());
  for (int h = 0; h < q_heads; ++h) {
    EXPECT_EQ(short_one.head(h).tau(), 0.85f) << "head " << h;
    EXPECT_NE(long_one.head(h).tau(), 0.85f) << "head " << h;
  }
}

// The replay sees each prompt query's view as its decode step would have (the keys up to its
// own position), whatever the lead the seeds are chosen with: the tiered bulk's queries, whose
// seeds see the whole bulk, calibrate as the same queries do over the plain prefix. (Before, a
// replayed query saw `lead` rows more, which the static set then counted again as kept.)
// A planted prompt (PlantedQueries) of 1200 tokens, K = 32, auto_tau, and a selector built on
// it the plain way, to compare other builds with.
struct AutoTauPrompt {
  static constexpr int kDim = 32, kTopK = 32;
  static constexpr int64_t kTokens = 1200;
  AutoTauPrompt(int q_heads, int kv_heads, uint64_t seed)
      : shape(Shape(q_heads, kv_heads, kDim)),
        kv(kTokens, kv_heads, kDim, seed),
        queries(PlantedQueries(kTokens, q_heads, kDim)),
        params(ReTopK(kTopK, 0.85f, 0)) {
    params.retopk.auto_tau = true;
    plain = std::make_unique<ReTopKSelector>(shape, kTopK, params.retopk);
    EXPECT_TRUE(plain->Build(kv.view(), queries.data()).ok());
  }
  LayerShape shape;
  RandomKv kv;
  std::vector<float> queries;
  SelectorParams params;
  std::unique_ptr<ReTopKSelector> plain;
};

TEST(ReTopKSelectorTest, AutoTauReplaysEachQueryOverItsOwnPrefixWhateverTheLead) {
  const int q_heads = 2;
  AutoTauPrompt t(q_heads, 1, 57);
  const int64_t prompt = AutoTauPrompt::kTokens;
  const ReTopKSelector& plain = *t.plain;
  const SelectorParams& params = t.params;
  ReTopKSelector led(t.shape, AutoTauPrompt::kTopK, params.retopk, /*query_lead=*/64);
  std::vector<int64_t> rows_asked;
  std::mutex mu;
  led.set_outside_lse([&](const float*, int64_t last_row, int) {
    std::lock_guard<std::mutex> lock(mu);
    rows_asked.push_back(last_row);
    return -1e4f;  // nothing outside: the same recall as the plain selector's
  });
  ASSERT_TRUE(led.Build(t.kv.view(), t.queries.data()).ok());
  for (int h = 0; h < q_heads; ++h) EXPECT_EQ(led.head(h).tau(), plain.head(h).tau());
  // Asked for the replayed queries' own rows (the last C + kCalibrationQueries, per head).
  const int64_t window = params.retopk.cache_capacity + kCalibrationQueries;
  ASSERT_EQ(rows_asked.size(), static_cast<size_t>(q_heads * window));
  EXPECT_EQ(*std::min_element(rows_asked.begin(), rows_asked.end()), prompt - window);
  EXPECT_EQ(*std::max_element(rows_asked.begin(), rows_asked.end()), prompt - 1);
}

// Build's batch top-K can be another implementation (the GPU's where the layer has one): the
// selector is built from its lists, one call a query head, to the same taus and cache entries.
TEST(ReTopKSelectorTest, BuildFindsItsTopKWithTheBatchTopKItIsGiven) {
  const int q_heads = 4, top_k = AutoTauPrompt::kTopK;
  AutoTauPrompt t(q_heads, 2, 59);
  const LayerShape& shape = t.shape;
  const SelectorParams& params = t.params;
  const ReTopKSelector& plain = *t.plain;
  const KvView kv = t.kv.view();
  const std::vector<float>& queries = t.queries;
  ReTopKSelector given(shape, top_k, params.retopk);
  std::atomic<int> calls{0};
  given.set_batch_topk([&](const VectorSet& q, const VectorSet& keys, int k, TopKLists* out,
                           std::span<const int64_t> visible, const BuildStop& stop) {
    ++calls;
    return CpuBatchTopK(q, keys, k, out, visible, stop);
  });
  ASSERT_TRUE(given.Build(kv, queries.data()).ok());
  EXPECT_EQ(calls.load(), q_heads);
  for (int h = 0; h < q_heads; ++h) {
    EXPECT_EQ(given.head(h).tau(), plain.head(h).tau()) << "head " << h;
    const QuerySupportCache& a = given.head(h).cache();
    const QuerySupportCache& b = plain.head(h).cache();
    ASSERT_EQ(a.size(), b.size()) << "head " << h;
    for (int age = 0; age < a.size(); ++age) {
      EXPECT_TRUE(std::ranges::equal(a.support(age), b.support(age))) << h << " " << age;
    }
  }
  // An error of the batch top-K is Build's.
  ReTopKSelector failing(shape, top_k, params.retopk);
  failing.set_batch_topk([](const VectorSet&, const VectorSet&, int, TopKLists*,
                            std::span<const int64_t>, const BuildStop&) {
    return absl::ResourceExhaustedError("the device is full");
  });
  const absl::Status failed = failing.Build(kv, queries.data());
  EXPECT_EQ(failed.code(), absl::StatusCode::kResourceExhausted) << failed;
  EXPECT_THAT(failed.message(), HasSubstr("the device is full"));
}

// A build nobody will use stops (index/build_stop.h): ReTopK asks between blocks of each head's
// batch top-K and before every 16th query of each head's calibration and seeding (a 128K head's
// calibration takes seconds), and hands the stop to its exact search (a graph index here, whose
// build asks it first); once it is requested the build ends with CANCELLED. A stop never
// requested changes nothing.
TEST(ReTopKSelectorTest, AStopEndsTheBuildAndReachesItsExactSearch) {
  const int q_heads = 4, top_k = AutoTauPrompt::kTopK;
  AutoTauPrompt t(q_heads, 2, 61);
  const KvView kv = t.kv.view();
  StopAfterAsks never(0);
  ReTopKSelector asked(t.shape, top_k, t.params.retopk);
  ASSERT_TRUE(asked.BuildUnless(never.stop(), kv, t.queries.data()).ok());
  const int asks = never.asks();
  EXPECT_GE(asks, q_heads * kCalibrationQueries / 16) << "asked within each head's calibration";
  for (int h = 0; h < q_heads; ++h) {
    EXPECT_EQ(asked.head(h).tau(), t.plain->head(h).tau()) << "head " << h;
    const QuerySupportCache& a = asked.head(h).cache();
    const QuerySupportCache& b = t.plain->head(h).cache();
    ASSERT_EQ(a.size(), b.size()) << "head " << h;
    for (int age = 0; age < a.size(); ++age) {
      EXPECT_TRUE(std::ranges::equal(a.support(age), b.support(age))) << h << " " << age;
    }
  }
  for (const int from : {1, asks / 2, asks}) {
    StopAfterAsks stop(from);
    ReTopKSelector stopped(t.shape, top_k, t.params.retopk);
    const absl::Status s = stopped.BuildUnless(stop.stop(), kv, t.queries.data());
    EXPECT_EQ(s.code(), absl::StatusCode::kCancelled) << "stopped at ask " << from << " of "
                                                      << asks << ": " << s;
    EXPECT_THAT(s.message(), HasSubstr("stopped: its result will not be used"));
  }

  SelectorParams graph = t.params;
  graph.kind = SelectorKind::kIndex;
  graph.sinks = graph.recent = 0;
  ReTopKSelector with_graph(t.shape, top_k, t.params.retopk);
  with_graph.set_exact_search(
      std::make_unique<IndexSelector>(t.shape, graph, /*bulk_only=*/true));
  StopAfterAsks at_once(1);
  const absl::Status s = with_graph.BuildUnless(at_once.stop(), kv, t.queries.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kCancelled) << s;
  EXPECT_THAT(s.message(), HasSubstr("the index build stopped"));
}

}  // namespace
}  // namespace kvrecall
