#include "client/trace/synthetic.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <numeric>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/attention.h"
#include "nlohmann/json.hpp"

namespace kvrecall {
namespace {

using ::testing::HasSubstr;

SyntheticTraceParams Small() {
  SyntheticTraceParams p;
  p.layers = 2;
  p.q_heads = 4;
  p.kv_heads = 2;
  p.head_dim = 64;
  p.context = 8192;
  p.decode_steps = 64;
  p.needles = 4;
  p.seed = 3;
  return p;
}

struct Tensors {
  std::vector<float> q, k, decode_q;
};

Tensors Generate(const SyntheticTrace& trace, int layer) {
  const TraceGeometry g = trace.geometry();
  Tensors t;
  t.q.resize(g.context * g.q_heads * g.head_dim);
  t.k.resize(g.context * g.kv_heads * g.head_dim);
  t.decode_q.resize(g.decode_steps * g.q_heads * g.head_dim);
  trace.GenerateRows(layer, TracePhase::kPrefill, TraceTensor::kQ, 0, g.context, t.q.data());
  trace.GenerateRows(layer, TracePhase::kPrefill, TraceTensor::kK, 0, g.context, t.k.data());
  trace.GenerateRows(layer, TracePhase::kDecode, TraceTensor::kQ, 0, g.decode_steps,
                     t.decode_q.data());
  return t;
}

// Softmax weights of q over keys [0, tokens) of one KV head.
std::vector<double> Attention(const float* q, const KvView& kv, int kv_head, int64_t tokens) {
  std::vector<double> w(tokens);
  const double scale = 1.0 / std::sqrt(static_cast<double>(kv.head_dim));
  for (int64_t t = 0; t < tokens; ++t) w[t] = scale * cpu::DotProduct(q, kv.key(t, kv_head), kv.head_dim);
  const double m = *std::max_element(w.begin(), w.end());
  double sum = 0;
  for (double& x : w) sum += (x = std::exp(x - m));
  for (double& x : w) x /= sum;
  return w;
}

double Cosine(const float* a, const float* b, int n) {
  double ab = 0, aa = 0, bb = 0;
  for (int i = 0; i < n; ++i) ab += a[i] * b[i], aa += a[i] * a[i], bb += b[i] * b[i];
  return ab / std::sqrt(aa * bb);
}

TEST(SyntheticTraceTest, SinksCollectMassAndRecentTokensOutscoreFarOnes) {
  const SyntheticTrace trace = *SyntheticTrace::Create(Small());
  const TraceGeometry g = trace.geometry();
  const Tensors t = Generate(trace, 1);
  const KvView kv{t.k.data(), nullptr, g.context, g.kv_heads, g.head_dim};
  double sink_mass = 0, recent_mass = 0;
  int samples = 0;
  for (int64_t position = 2048; position < g.context; position += 512) {
    for (int h = 0; h < g.q_heads; ++h) {
      const float* q = t.q.data() + (position * g.q_heads + h) * g.head_dim;
      const std::vector<double> w = Attention(q, kv, KvHeadOf(h, g.q_heads, g.kv_heads),
                                              position + 1);
      sink_mass += std::accumulate(w.begin(), w.begin() + trace.params().sinks, 0.0);
      recent_mass += std::accumulate(w.end() - 64, w.end(), 0.0);
      ++samples;
    }
  }
  // 4 sinks among thousands of tokens take a large share; the last 64 tokens far more than
  // their uniform share (64 / position <= 3%).
  EXPECT_GE(sink_mass / samples, 0.2);
  EXPECT_GE(recent_mass / samples, 0.1);
}

TEST(SyntheticTraceTest, EachNeedleIsTheTopKeyOfItsDecodeQueryInEveryLayerAndHead) {
  const SyntheticTrace trace = *SyntheticTrace::Create(Small());
  const TraceGeometry g = trace.geometry();
  ASSERT_EQ(trace.needles().size(), 4u);
  int asked_early = 0, steps_before = 0;
  for (int layer = 0; layer < g.layers; ++layer) {
    const Tensors t = Generate(trace, layer);
    const KvView kv{t.k.data(), nullptr, g.context, g.kv_heads, g.head_dim};
    for (const Needle& needle : trace.needles()) {
      EXPECT_GE(needle.position, g.context / 20);
      EXPECT_LT(needle.position, g.context * 9 / 10);
      for (int h = 0; h < g.q_heads; ++h) {
        const float* q = t.decode_q.data() + (needle.decode_step * g.q_heads + h) * g.head_dim;
        std::vector<int32_t> best;
        cpu::ExactTopK(q, kv, KvHeadOf(h, g.q_heads, g.kv_heads), 1.0f, 1, &best);
        EXPECT_EQ(best[0], needle.position) << "layer " << layer << " head " << h;
        // ... and (nearly) only for the step that asks: the step before wants something else,
        // unless its topic happens to lie close to the needle's direction (random directions in
        // the topic dims: ~1 case in 32 at some seeds, with either drift; the pre-issue-15
        // generator had it at seeds 4 and 5, the calibrated jitter moves it to seed 3).
        if (needle.decode_step > 0) {
          cpu::ExactTopK(q - g.q_heads * g.head_dim, kv, KvHeadOf(h, g.q_heads, g.kv_heads),
                         1.0f, 1, &best);
          asked_early += best[0] == needle.position;
          ++steps_before;
        }
      }
    }
  }
  EXPECT_LE(asked_early * 16, steps_before) << asked_early << " of " << steps_before;
}

TEST(SyntheticTraceTest, QueriesAreOutOfDistributionForKeysAndDecodeQueriesDrift) {
  const SyntheticTrace trace = *SyntheticTrace::Create(Small());
  const TraceGeometry g = trace.geometry();
  const Tensors t = Generate(trace, 0);
  const int d = g.head_dim;
  // Keys share a large common offset: two keys point the same way; a query and a key do not.
  double key_key = 0, query_key = 0;
  int n = 0;
  for (int64_t i = 100; i < g.context; i += 97, ++n) {
    const float* k1 = t.k.data() + i * g.kv_heads * d;
    const float* k2 = t.k.data() + ((i * 7919) % (g.context - 100) + 100) * g.kv_heads * d;
    const float* q = t.q.data() + i * g.q_heads * d;
    key_key += Cosine(k1, k2, d);
    query_key += Cosine(q, k2, d);
  }
  EXPECT_GE(key_key / n, 0.4);
  EXPECT_LE(std::abs(query_key / n), 0.15);

  // Consecutive decode queries of a head are alike; 32 steps (a drift period) apart, less so.
  double adjacent = 0, apart = 0;
  for (int64_t s = 0; s + 32 < g.decode_steps; ++s) {
    const float* q = t.decode_q.data() + s * g.q_heads * d;
    adjacent += Cosine(q, q + g.q_heads * d, d);
    apart += Cosine(q, q + 32 * g.q_heads * d, d);
  }
  EXPECT_GT(adjacent, apart + 0.1 * (g.decode_steps - 32));
}

// Mean cosine of consecutive decode queries of every head, and the same across the steps where
// the drift period (32) changes topic.
struct DecodeCosines {
  double adjacent = 0, at_topic_change = 0;
};

DecodeCosines ConsecutiveDecodeCosines(const SyntheticTraceParams& p) {
  const SyntheticTrace trace = *SyntheticTrace::Create(p);
  const TraceGeometry g = trace.geometry();
  std::vector<float> q(g.decode_steps * g.q_heads * g.head_dim);
  trace.GenerateRows(0, TracePhase::kDecode, TraceTensor::kQ, 0, g.decode_steps, q.data());
  DecodeCosines c;
  int adjacent = 0, changes = 0;
  for (int64_t s = 1; s < g.decode_steps; ++s) {
    bool needle = false;
    for (const Needle& n : trace.needles()) needle |= n.decode_step == s || n.decode_step == s - 1;
    if (needle) continue;
    for (int h = 0; h < g.q_heads; ++h) {
      const float* now = q.data() + (s * g.q_heads + h) * g.head_dim;
      const double cosine = Cosine(now, now - g.q_heads * g.head_dim, g.head_dim);
      if (s % p.drift_period == 0) {
        c.at_topic_change += cosine;
        ++changes;
      } else {
        c.adjacent += cosine;
        ++adjacent;
      }
    }
  }
  c.adjacent /= adjacent;
  c.at_topic_change /= changes;
  return c;
}

// The calibrated drift (the default) matches tinylm-a's step-to-step query cosine (~0.72,
// bench/results/synth_calibration.md) and drops at a topic change, so ReTopK's similarity test
// sees it; the adversarial drift (the pre-issue-15 generator) glides, >= 0.85 alike at every
// step, topic changes included.
TEST(SyntheticTraceTest, CalibratedDriftJittersAndJumpsAdversarialDriftGlides) {
  SyntheticTraceParams p = Small();
  p.decode_steps = 256;
  EXPECT_EQ(p.query_drift, QueryDrift::kCalibrated);
  const DecodeCosines calibrated = ConsecutiveDecodeCosines(p);
  EXPECT_GT(calibrated.adjacent, 0.65);
  EXPECT_LT(calibrated.adjacent, 0.8);
  EXPECT_LT(calibrated.at_topic_change, 0.55);

  p.query_drift = QueryDrift::kAdversarial;
  const DecodeCosines adversarial = ConsecutiveDecodeCosines(p);
  EXPECT_GT(adversarial.adjacent, 0.85);
  EXPECT_GT(adversarial.at_topic_change, 0.85);

  // decode_noise overrides the drift's default jitter: none makes the calibrated drift's steps
  // of one period alike.
  p.query_drift = QueryDrift::kCalibrated;
  p.decode_noise = 0.0f;
  EXPECT_GT(ConsecutiveDecodeCosines(p).adjacent, 0.85);
}

// What ReTopK's reuse rests on, per query head: how alike consecutive queries are in the
// prompt's last kCalibrationQueries (256) rows, which auto_tau calibrates on, and in decode; and
// how much of a decode step's top-K softmax mass (over the prompt) the previous step's exact
// top-K support still holds, within a drift period.
struct ReuseStatistics {
  double prompt_cos1 = 0, decode_cos1 = 0, carried_mass = 0;
};

ReuseStatistics MeasureReuseStatistics(int64_t context) {
  SyntheticTraceParams p = Small();
  p.layers = 1;
  p.context = context;
  const SyntheticTrace trace = *SyntheticTrace::Create(p);
  const TraceGeometry g = trace.geometry();
  const int d = g.head_dim;
  const int64_t q_row = int64_t{g.q_heads} * d;
  constexpr int64_t kTail = 256;
  constexpr int kTopK = 256;
  std::vector<float> k(g.context * g.kv_heads * d), tail(kTail * q_row),
      q(g.decode_steps * q_row);
  trace.GenerateRows(0, TracePhase::kPrefill, TraceTensor::kK, 0, g.context, k.data());
  trace.GenerateRows(0, TracePhase::kPrefill, TraceTensor::kQ, g.context - kTail, kTail,
                     tail.data());
  trace.GenerateRows(0, TracePhase::kDecode, TraceTensor::kQ, 0, g.decode_steps, q.data());
  const KvView kv{k.data(), nullptr, g.context, g.kv_heads, d};
  ReuseStatistics r;
  int64_t prompt_n = 0, decode_n = 0;
  for (int h = 0; h < g.q_heads; ++h) {
    for (int64_t i = 1; i < kTail; ++i, ++prompt_n) {
      r.prompt_cos1 += Cosine(tail.data() + i * q_row + h * d, tail.data() + (i - 1) * q_row + h * d, d);
    }
    std::vector<int64_t> previous;
    for (int64_t s = 0; s < g.decode_steps; ++s) {
      const float* now = q.data() + s * q_row + h * d;
      const std::vector<double> w = Attention(now, kv, KvHeadOf(h, g.q_heads, g.kv_heads),
                                              g.context);
      std::vector<int64_t> order(g.context);
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + kTopK, order.end(),
                        [&](int64_t a, int64_t b) { return w[a] > w[b]; });
      order.resize(kTopK);
      bool needle = false;
      for (const Needle& n : trace.needles()) needle |= n.decode_step == s || n.decode_step == s - 1;
      if (s % p.drift_period != 0 && !needle) {
        double kept = 0, exact = 0;
        for (int64_t t : order) exact += w[t];
        for (int64_t t : previous) kept += w[t];
        r.carried_mass += std::min(1.0, kept / exact);
        r.decode_cos1 += Cosine(now, now - q_row, d);
        ++decode_n;
      }
      previous = std::move(order);
    }
  }
  r.prompt_cos1 /= prompt_n;
  r.decode_cos1 /= decode_n;
  r.carried_mass /= decode_n;
  return r;
}

// A longer prompt does not make decode queries less self-similar (the generator before its
// segments drew a query's top-K from every key of its topic, a pool that grows with the
// context, and ReTopK's reuse collapsed at 128K), and the prompt's last queries move as decode
// queries do, so that auto_tau's calibration on them holds for decode. The supports' stability
// does still fall with the context, by a known amount, held here.
TEST(SyntheticTraceTest, ReuseStatisticsAcrossContextLengths) {
  const ReuseStatistics short_context = MeasureReuseStatistics(8192);
  const ReuseStatistics long_context = MeasureReuseStatistics(65536);
  for (const ReuseStatistics& r : {short_context, long_context}) {
    EXPECT_NEAR(r.prompt_cos1, r.decode_cos1, 0.05);
    EXPECT_GT(r.carried_mass, 0.5);
  }
  EXPECT_NEAR(short_context.decode_cos1, long_context.decode_cos1, 0.02);
  EXPECT_NEAR(short_context.prompt_cos1, long_context.prompt_cos1, 0.03);
  // Not independent: the per-step jitter shifts every other segment's keys at random, and the
  // luckiest of more segments enter the top-K (8K: 0.726, 64K: 0.531 carried, the generator
  // being seeded). The drop scales with the jitter's norm, not its rank
  // (bench/results/synth_calibration.md). A change of the generator that moves it shows here.
  EXPECT_NEAR(short_context.carried_mass, 0.726, 0.03);
  EXPECT_NEAR(long_context.carried_mass, 0.531, 0.03);
  std::printf("context 8192: prompt cos1 %.3f, decode cos1 %.3f, carried mass %.3f\n"
              "context 65536: prompt cos1 %.3f, decode cos1 %.3f, carried mass %.3f\n",
              short_context.prompt_cos1, short_context.decode_cos1, short_context.carried_mass,
              long_context.prompt_cos1, long_context.decode_cos1, long_context.carried_mass);
}

TEST(SyntheticTraceTest, QueryDriftNamesRoundTripAndReachTheMetadata) {
  for (QueryDrift drift : {QueryDrift::kCalibrated, QueryDrift::kAdversarial}) {
    absl::StatusOr<QueryDrift> parsed = ParseQueryDrift(QueryDriftName(drift));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, drift);
  }
  EXPECT_THAT(ParseQueryDrift("smooth").status().message(),
              HasSubstr("unknown query drift 'smooth'; want calibrated or adversarial"));
  SyntheticTraceParams p = Small();
  std::map<std::string, std::string> m = SyntheticTrace::Create(p)->Metadata();
  EXPECT_EQ(m.at("query_drift"), "calibrated");
  EXPECT_EQ(std::stof(m.at("decode_noise")), kCalibratedDecodeNoise);
  p.query_drift = QueryDrift::kAdversarial;
  m = SyntheticTrace::Create(p)->Metadata();
  EXPECT_EQ(m.at("query_drift"), "adversarial");
  EXPECT_EQ(m.at("decode_noise"), "0");
  // The drift shapes queries only (prompt queries get the same jitter as decode ones): keys do
  // not change.
  const SyntheticTrace calibrated = *SyntheticTrace::Create(Small());
  const SyntheticTrace adversarial = *SyntheticTrace::Create(p);
  std::vector<float> a(64 * p.kv_heads * p.head_dim), b(a.size());
  calibrated.GenerateRows(0, TracePhase::kPrefill, TraceTensor::kK, 4000, 64, a.data());
  adversarial.GenerateRows(0, TracePhase::kPrefill, TraceTensor::kK, 4000, 64, b.data());
  EXPECT_EQ(a, b);
  a.resize(p.decode_steps * p.kv_heads * p.head_dim);
  b.resize(a.size());
  calibrated.GenerateRows(1, TracePhase::kDecode, TraceTensor::kK, 0, p.decode_steps, a.data());
  adversarial.GenerateRows(1, TracePhase::kDecode, TraceTensor::kK, 0, p.decode_steps, b.data());
  EXPECT_EQ(a, b);
}

TEST(SyntheticTraceTest, RowsDoNotDependOnChunking) {
  const SyntheticTrace trace = *SyntheticTrace::Create(Small());
  const int row = trace.params().kv_heads * trace.params().head_dim;
  std::vector<float> whole(300 * row), parts(300 * row);
  trace.GenerateRows(1, TracePhase::kPrefill, TraceTensor::kK, 1000, 300, whole.data());
  trace.GenerateRows(1, TracePhase::kPrefill, TraceTensor::kK, 1000, 7, parts.data());
  trace.GenerateRows(1, TracePhase::kPrefill, TraceTensor::kK, 1007, 293, parts.data() + 7 * row);
  EXPECT_EQ(whole, parts);
  const SyntheticTrace same = *SyntheticTrace::Create(Small());
  same.GenerateRows(1, TracePhase::kPrefill, TraceTensor::kK, 1000, 300, parts.data());
  EXPECT_EQ(whole, parts);
}

TEST(SyntheticTraceTest, WritesAReplayTraceThatReadsBack) {
  SyntheticTraceParams p = Small();
  p.context = 1024;
  p.decode_steps = 16;
  p.dtype = v1::DTYPE_F32;
  const SyntheticTrace trace = *SyntheticTrace::Create(p);
  const std::string path =
      ::testing::TempDir() + "/synthetic_" + std::to_string(getpid()) + ".safetensors";
  ASSERT_TRUE(trace.Write(path).ok());
  absl::StatusOr<Trace> read = Trace::Open(path);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->geometry().layers, 2);
  EXPECT_EQ(read->geometry().context, 1024);
  EXPECT_EQ(read->geometry().decode_steps, 16);
  const nlohmann::json needles = nlohmann::json::parse(read->metadata().at("needles"));
  ASSERT_EQ(needles.size(), trace.needles().size());
  EXPECT_EQ(needles[0]["position"].get<int64_t>(), trace.needles()[0].position);
  EXPECT_EQ(needles[0]["decode_step"].get<int64_t>(), trace.needles()[0].decode_step);
  absl::StatusOr<std::vector<float>> decode_k = read->Read(1, TracePhase::kDecode, TraceTensor::kK);
  ASSERT_TRUE(decode_k.ok());
  std::vector<float> expected(decode_k->size());
  trace.GenerateRows(1, TracePhase::kDecode, TraceTensor::kK, 0, 16, expected.data());
  EXPECT_EQ(*decode_k, expected);
  std::remove(path.c_str());
}

TEST(SyntheticTraceTest, RejectsInvalidParameters) {
  SyntheticTraceParams p = Small();
  p.q_heads = 3;
  absl::StatusOr<SyntheticTrace> made = SyntheticTrace::Create(p);
  EXPECT_EQ(made.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(made.status().message(),
              HasSubstr("q_heads (3) must be a multiple of kv_heads (2) in [1, 1024]"));
  p = Small();
  p.needles = 65;
  made = SyntheticTrace::Create(p);
  EXPECT_EQ(made.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(made.status().message(), HasSubstr("needles must be in [0, min(decode_steps"));
  p = Small();
  p.decode_noise = NAN;
  made = SyntheticTrace::Create(p);
  EXPECT_THAT(made.status().message(), HasSubstr("decode_noise must be finite"));
  p = Small();
  p.rotary_dims = 62;
  made = SyntheticTrace::Create(p);
  EXPECT_THAT(made.status().message(), HasSubstr("rotary_dims must be even and in [0, head_dim - 4]"));
  // Sizes past what the service accepts, or whose products overflowed (a context of 10^11
  // aborted in std::bad_alloc; context * 9 overflowed past 2^63 / 9).
  struct Case {
    void (*set)(SyntheticTraceParams&);
    const char* message;
  };
  const Case cases[] = {
      {[](SyntheticTraceParams& q) { q.context = 100'000'000'000; },
       "context must be in [1, 2147483647], got 100000000000"},
      {[](SyntheticTraceParams& q) { q.context = INT64_MAX; }, "context must be in [1, "},
      {[](SyntheticTraceParams& q) { q.decode_steps = 2147483647; },
       "(context + decode_steps tokens at most 2147483647)"},
      {[](SyntheticTraceParams& q) { q.layers = 1025; }, "layers must be in [1, 1024]"},
      {[](SyntheticTraceParams& q) { q.head_dim = 2048; }, "head_dim must be even and in [8, 1024]"},
      {[](SyntheticTraceParams& q) { q.topics = 2'000'000'000; }, "topics must be in [1, 1048576]"},
  };
  for (const Case& c : cases) {
    p = Small();
    c.set(p);
    made = SyntheticTrace::Create(p);
    EXPECT_EQ(made.status().code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_THAT(made.status().message(), HasSubstr(c.message));
  }
  // Within the bounds, tables that do not fit in the machine's memory are RESOURCE_EXHAUSTED
  // before anything is allocated, not an abort: 1024 layers x 2 KV heads of 2 x 2^20 topics of
  // 1024 floats (16 PiB).
  p = Small();
  p.context = 2147483647;
  p.decode_steps = 0;
  p.needles = 0;
  p.layers = 1024;
  p.head_dim = 1024;
  p.rotary_dims = 32;
  p.topics = 1 << 20;
  made = SyntheticTrace::Create(p);
  EXPECT_EQ(made.status().code(), absl::StatusCode::kResourceExhausted) << made.status();
  EXPECT_THAT(made.status().message(), HasSubstr("do not fit in memory"));
  EXPECT_THAT(made.status().message(), HasSubstr("1024 layers x 2 KV heads"));
}

}  // namespace
}  // namespace kvrecall
