#include "client/trace/synthetic.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <new>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/kv_view.h"
#include "nlohmann/json.hpp"
#include "proto/tensor_codec.h"

namespace kvrecall {
namespace {

// Strengths of the model's components, as norms of unscaled vectors for head_dim 64 (queries
// are scaled by sqrt(head_dim / 64) so that scaled scores keep their size at other dims).
// With the softmax scale 1/8: a sink scores ~12.5 for every query, a key of the query's topic
// ~7.5 plus up to ~5 of recency, a needle ~30 for the query that asks for it.
constexpr float kKeyOffset = 8.5f;       // common key offset, invisible to queries
constexpr float kKeyNuisance = 6.0f;     // per-key noise in the dims queries do not use
constexpr float kKeyTopic = 4.5f;
// A segment's own direction in its keys (and, at kQuerySegment relative to the topic, in the
// queries about it): a query retrieves a passage, not every token of its topic, so its top-K
// does not spread over a pool of same-topic keys that grows with the context.
constexpr float kKeySegment = 4.5f;
constexpr float kQuerySegment = 0.75f;
constexpr float kKeyTopicNoise = 3.0f;
constexpr float kSinkKey = 40.0f;
constexpr float kNeedleKey = 20.0f;
constexpr float kRecencyKey = 6.3f;
constexpr float kRotaryNoise = 2.0f;
constexpr float kQueryTopic = 10.0f;
constexpr float kQueryNoise = 3.0f;
constexpr float kQuerySink = 2.5f;
constexpr float kNeedleQuery = 12.0f;
constexpr float kNeedleStepTopic = 0.3f;  // topic weight of a query asking for a needle
constexpr float kRecencyQuery = 6.3f;
constexpr float kValueNoise = 0.5f;
constexpr float kNeedleValue = 3.0f;
constexpr float kSinkValue = 0.1f;
// Recency lives in the rotary pairs whose period is 32..2048 tokens.
constexpr double kRecencyMinFrequency = 1.0 / 2048.0;
constexpr double kRecencyMaxFrequency = 1.0 / 32.0;

// Streams of the counter-based generator: each row of each tensor has its own, so rows can be
// generated in any order and chunking.
enum Stream : uint64_t {
  kSpaceStream = 1,
  kTopicStream,
  kNeedleStream,
  kQStream,
  kKStream,
  kVStream,
  kSegmentStream,
  kPrefillFocusStream,
};

uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t StreamSeed(uint64_t seed, uint64_t a, uint64_t b = 0, uint64_t c = 0, uint64_t d = 0) {
  uint64_t h = Mix(seed);
  for (uint64_t part : {a, b, c, d}) h = Mix(h ^ part);
  return h;
}

// SplitMix64 with Box-Muller normals.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t Next() { return Mix(state_ += 0x9e3779b97f4a7c15ull); }
  double Uniform() { return static_cast<double>(Next() >> 11) * 0x1.0p-53; }
  int64_t UniformInt(int64_t n) { return static_cast<int64_t>(Uniform() * n); }
  float Normal() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    const double u = 1.0 - Uniform();  // (0, 1]
    const double v = Uniform();
    const double r = std::sqrt(-2.0 * std::log(u));
    spare_ = static_cast<float>(r * std::sin(2.0 * M_PI * v));
    has_spare_ = true;
    return static_cast<float>(r * std::cos(2.0 * M_PI * v));
  }

 private:
  uint64_t state_;
  float spare_ = 0.0f;
  bool has_spare_ = false;
};

// Dimension ranges of the head: [0, rotary) rotated; [rotary, topic_end) where queries and
// topics live; [topic_end, dim) nuisance dims that only keys use.
struct Layout {
  int dim;
  int rotary;
  int topic_end;
};

Layout LayoutOf(const SyntheticTraceParams& p) {
  return Layout{p.head_dim, p.rotary_dims, p.rotary_dims + (p.head_dim - p.rotary_dims + 1) / 2};
}

// Adds `norm` times a random vector on dims [begin, end) whose expected length is 1.
void AddNoise(Rng& rng, int begin, int end, float norm, float* v) {
  const float per_dim = norm / std::sqrt(static_cast<float>(end - begin));
  for (int i = begin; i < end; ++i) v[i] += per_dim * rng.Normal();
}

void Normalize(float* v, int dim) {
  double sum = 0;
  for (int i = 0; i < dim; ++i) sum += static_cast<double>(v[i]) * v[i];
  const float inv = sum > 0 ? static_cast<float>(1.0 / std::sqrt(sum)) : 0.0f;
  for (int i = 0; i < dim; ++i) v[i] *= inv;
}

// A random unit vector on dims [begin, end), orthogonal to the unit vector `against` if given.
std::vector<float> RandomDirection(Rng& rng, int dim, int begin, int end,
                                   const std::vector<float>* against = nullptr) {
  std::vector<float> v(dim, 0.0f);
  AddNoise(rng, begin, end, 1.0f, v.data());
  if (against != nullptr) {
    double dot = 0;
    for (int i = 0; i < dim; ++i) dot += static_cast<double>(v[i]) * (*against)[i];
    for (int i = 0; i < dim; ++i) v[i] -= static_cast<float>(dot) * (*against)[i];
  }
  Normalize(v.data(), dim);
  return v;
}

void AddScaled(const float* direction, float scale, int dim, float* v) {
  for (int i = 0; i < dim; ++i) v[i] += scale * direction[i];
}

}  // namespace

const char* QueryDriftName(QueryDrift drift) {
  return drift == QueryDrift::kAdversarial ? "adversarial" : "calibrated";
}

absl::StatusOr<QueryDrift> ParseQueryDrift(const std::string& name) {
  if (name == "calibrated") return QueryDrift::kCalibrated;
  if (name == "adversarial") return QueryDrift::kAdversarial;
  return absl::InvalidArgumentError(
      absl::StrCat("synthetic trace: unknown query drift '", name,
                   "'; want calibrated or adversarial"));
}

absl::Status SyntheticTraceParams::Validate() const {
  auto invalid = [](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat("synthetic trace: ", parts...));
  };
  constexpr int kMaxShape = 1024;  // the service's most layers, heads and head_dim
  constexpr int64_t kMaxTokens = (int64_t{1} << 31) - 1;  // its most tokens of a layer
  constexpr int kMaxTopics = 1 << 20;
  if (layers < 1 || layers > kMaxTraceLayers) {
    return invalid("layers must be in [1, ", kMaxTraceLayers, "], got ", layers);
  }
  if (q_heads < 1 || kv_heads < 1 || q_heads > kMaxShape || q_heads % kv_heads != 0) {
    return invalid("q_heads (", q_heads, ") must be a multiple of kv_heads (", kv_heads,
                   ") in [1, ", kMaxShape, "]");
  }
  if (head_dim < 8 || head_dim > kMaxShape || head_dim % 2 != 0) {
    return invalid("head_dim must be even and in [8, ", kMaxShape, "], got ", head_dim);
  }
  if (rotary_dims < 0 || rotary_dims % 2 != 0 || rotary_dims > head_dim - 4) {
    return invalid("rotary_dims must be even and in [0, head_dim - 4], got ", rotary_dims);
  }
  if (!(rope_base > 1.0) || !std::isfinite(rope_base)) {
    return invalid("rope_base must be finite and > 1, got ", rope_base);
  }
  if (context < 1 || context > kMaxTokens) {
    return invalid("context must be in [1, ", kMaxTokens, "], got ", context);
  }
  if (decode_steps < 0 || decode_steps > kMaxTokens - context) {
    return invalid("decode_steps must be in [0, ", kMaxTokens - context,
                   "] (context + decode_steps tokens at most ", kMaxTokens, "), got ",
                   decode_steps);
  }
  if (sinks < 0 || sinks >= context) {
    return invalid("sinks (attention-sink tokens) must be in [0, context = ", context, "), got ",
                   sinks);
  }
  if (topics < 1 || topics > kMaxTopics) {
    return invalid("topics must be in [1, ", kMaxTopics, "], got ", topics);
  }
  if (mean_segment < 1) return invalid("mean_segment must be >= 1, got ", mean_segment);
  if (drift_period < 1) return invalid("drift_period must be >= 1, got ", drift_period);
  if (query_drift != QueryDrift::kCalibrated && query_drift != QueryDrift::kAdversarial) {
    return invalid("query_drift must be calibrated or adversarial");
  }
  if (!std::isfinite(decode_noise)) return invalid("decode_noise must be finite");
  const int64_t needle_room = context * 9 / 10 - std::max<int64_t>(sinks, context / 20);
  if (needles < 0 || needles > decode_steps || needles > needle_room) {
    return invalid("needles must be in [0, min(decode_steps, ", std::max<int64_t>(needle_room, 0),
                   ")], got ", needles);
  }
  if (dtype != v1::DTYPE_BF16 && dtype != v1::DTYPE_F16 && dtype != v1::DTYPE_F32) {
    return invalid("dtype must be bf16, f16 or f32");
  }
  return absl::OkStatus();
}

absl::StatusOr<SyntheticTrace> SyntheticTrace::Create(const SyntheticTraceParams& params) {
  if (absl::Status s = params.Validate(); !s.ok()) return s;
  // The tables Build holds (a trace's tensors are generated from them chunk by chunk): 12 bytes
  // per prompt token, 4 per decode step and 8 per query head and drift period, and per layer
  // and KV head the topics' key directions and value centres, the needles and a basis, each
  // head_dim floats. Measured in double: within Validate's bounds it stays exact enough and
  // cannot overflow. Refused before allocating when above the machine's memory (an allocation
  // the kernel grants lazily would be killed later instead of failing).
  const double d = params.head_dim;
  const double bytes =
      12.0 * params.context + 4.0 * params.decode_steps +
      8.0 * params.q_heads * (params.decode_steps / params.drift_period + 2) +
      4.0 * d * params.layers * params.kv_heads * (2.0 * params.topics + params.needles + d + 3);
  const double memory =
      static_cast<double>(::sysconf(_SC_PHYS_PAGES)) * static_cast<double>(::sysconf(_SC_PAGESIZE));
  auto too_large = [&] {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "synthetic trace: its tables (%.3g GiB: context %d, decode_steps %d, %d layers x %d KV "
        "heads x (2 x %d topics + %d needles) x head_dim %d) do not fit in memory (%.3g GiB)",
        bytes / (1 << 30), params.context, params.decode_steps, params.layers, params.kv_heads,
        params.topics, params.needles, params.head_dim, memory / (1 << 30)));
  };
  if (memory > 0 && bytes > memory) return too_large();
  try {
    return Build(params);
  } catch (const std::bad_alloc&) {
    return too_large();
  }
}

SyntheticTrace SyntheticTrace::Build(const SyntheticTraceParams& params) {
  SyntheticTrace trace(params);
  const Layout layout = LayoutOf(params);
  const int d = params.head_dim;

  for (int layer = 0; layer < params.layers; ++layer) {
    for (int g = 0; g < params.kv_heads; ++g) {
      Rng rng(StreamSeed(params.seed, kSpaceStream, layer, g));
      KeySpace s;
      s.sink = RandomDirection(rng, d, layout.rotary, layout.topic_end);
      s.offset = RandomDirection(rng, d, layout.topic_end, d);
      s.recency.assign(d, 0.0f);
      const int pairs = params.rotary_dims / 2;
      for (int i = 0; i < pairs; ++i) {
        const double frequency = std::pow(params.rope_base, -2.0 * i / params.rotary_dims);
        if (frequency >= kRecencyMinFrequency && frequency <= kRecencyMaxFrequency) {
          s.recency[i] = rng.Normal();
          s.recency[i + pairs] = rng.Normal();
        }
      }
      Normalize(s.recency.data(), d);
      for (int c = 0; c < params.topics; ++c) {
        std::vector<float> t = RandomDirection(rng, d, layout.rotary, layout.topic_end, &s.sink);
        s.topics.insert(s.topics.end(), t.begin(), t.end());
        for (int i = 0; i < d; ++i) s.values.push_back(rng.Normal());
      }
      for (int n = 0; n < params.needles; ++n) {
        std::vector<float> v = RandomDirection(rng, d, layout.rotary, layout.topic_end, &s.sink);
        s.needles.insert(s.needles.end(), v.begin(), v.end());
      }
      // Gram-Schmidt over the sink and needle directions (needles beyond the topic dims'
      // room fall out as ~zero remainders and are skipped).
      for (int n = -1; n < params.needles; ++n) {
        std::vector<float> v = n < 0 ? s.sink : std::vector<float>(s.needles.begin() + n * d,
                                                                   s.needles.begin() + (n + 1) * d);
        for (size_t b = 0; b < s.jitter_free.size(); b += d) {
          double dot = 0;
          for (int i = 0; i < d; ++i) dot += static_cast<double>(v[i]) * s.jitter_free[b + i];
          for (int i = 0; i < d; ++i) v[i] -= static_cast<float>(dot) * s.jitter_free[b + i];
        }
        double norm = 0;
        for (float x : v) norm += static_cast<double>(x) * x;
        if (norm < 1e-6) continue;
        Normalize(v.data(), d);
        s.jitter_free.insert(s.jitter_free.end(), v.begin(), v.end());
      }
      trace.spaces_.push_back(std::move(s));
    }
  }

  // Topic segments of the prompt, topics Zipf-distributed.
  Rng topic_rng(StreamSeed(params.seed, kTopicStream));
  std::vector<double> cumulative(params.topics);
  double total = 0;
  for (int c = 0; c < params.topics; ++c) cumulative[c] = (total += 1.0 / (c + 1));
  auto draw_topic = [&] {
    const double u = topic_rng.Uniform() * total;
    return static_cast<int32_t>(std::lower_bound(cumulative.begin(), cumulative.end(), u) -
                                cumulative.begin());
  };
  trace.prompt_topics_.reserve(params.context);
  trace.prompt_segments_.reserve(params.context);
  for (int32_t segment = 0; static_cast<int64_t>(trace.prompt_topics_.size()) < params.context;
       ++segment) {
    const int32_t topic = draw_topic();
    // Geometric segment length with the requested mean.
    const int64_t length = 1 + static_cast<int64_t>(std::log(1.0 - topic_rng.Uniform()) /
                                                    std::log(1.0 - 1.0 / params.mean_segment));
    for (int64_t i = 0; i < length && static_cast<int64_t>(trace.prompt_topics_.size()) <
                                          params.context; ++i) {
      trace.prompt_topics_.push_back(topic);
      trace.prompt_segments_.push_back(segment);
    }
  }
  // Decode focus: each head drifts through passages drawn from the prompt's own tokens.
  const int64_t periods = params.decode_steps / params.drift_period + 2;
  for (int h = 0; h < params.q_heads; ++h) {
    for (int64_t m = 0; m < periods; ++m) {
      trace.decode_sources_.push_back(topic_rng.UniformInt(params.context));
    }
  }

  // Needles: distinct positions in the prompt's middle 90%, asked for at evenly spaced steps.
  Rng needle_rng(StreamSeed(params.seed, kNeedleStream));
  trace.needle_at_position_.assign(params.context, -1);
  trace.needle_at_step_.assign(params.decode_steps, -1);
  const int64_t lo = std::max<int64_t>(params.sinks, params.context / 20);
  const int64_t hi = params.context * 9 / 10;
  for (int n = 0; n < params.needles; ++n) {
    int64_t position;
    do {
      position = lo + needle_rng.UniformInt(hi - lo);
    } while (trace.needle_at_position_[position] >= 0);
    const int64_t step = (2 * n + 1) * params.decode_steps / (2 * params.needles);
    trace.needle_at_position_[position] = n;
    trace.needle_at_step_[step] = n;
    trace.needles_.push_back(Needle{position, step});
  }
  return trace;
}

TraceGeometry SyntheticTrace::geometry() const {
  TraceGeometry g;
  g.layers = params_.layers;
  g.q_heads = params_.q_heads;
  g.kv_heads = params_.kv_heads;
  g.head_dim = params_.head_dim;
  g.context = params_.context;
  g.decode_steps = params_.decode_steps;
  g.dtype = params_.dtype;
  return g;
}

std::map<std::string, std::string> SyntheticTrace::Metadata() const {
  nlohmann::json needles = nlohmann::json::array();
  for (const Needle& n : needles_) {
    needles.push_back({{"position", n.position}, {"decode_step", n.decode_step}});
  }
  return {
      {"source", "kvrecall synthetic generator (client/trace/synthetic.h)"},
      {"generator", "kvrecall-synthetic-v3"},
      {"seed", absl::StrCat(params_.seed)},
      {"sinks", absl::StrCat(params_.sinks)},
      {"topics", absl::StrCat(params_.topics)},
      {"mean_segment", absl::StrCat(params_.mean_segment)},
      {"drift_period", absl::StrCat(params_.drift_period)},
      {"query_drift", QueryDriftName(params_.query_drift)},
      {"decode_noise", absl::StrCat(decode_noise())},
      {"rotary_dims", absl::StrCat(params_.rotary_dims)},
      {"rope_base", absl::StrCat(params_.rope_base)},
      {"rope", "applied to the leading rotary_dims (rotate-half)"},
      {"needles", needles.dump()},
  };
}

float SyntheticTrace::decode_noise() const {
  if (params_.decode_noise >= 0) return params_.decode_noise;
  return params_.query_drift == QueryDrift::kCalibrated ? kCalibratedDecodeNoise : 0.0f;
}

void SyntheticTrace::ApplyRope(int64_t position, float* v) const {
  const int pairs = params_.rotary_dims / 2;
  for (int i = 0; i < pairs; ++i) {
    const double angle =
        static_cast<double>(position) * std::pow(params_.rope_base, -2.0 * i / params_.rotary_dims);
    const float c = static_cast<float>(std::cos(angle));
    const float s = static_cast<float>(std::sin(angle));
    const float x1 = v[i];
    const float x2 = v[i + pairs];
    v[i] = x1 * c - x2 * s;
    v[i + pairs] = x2 * c + x1 * s;
  }
}

void SyntheticTrace::AddSegment(int layer, int kv_head, int32_t segment, float scale,
                                float* out) const {
  const Layout layout = LayoutOf(params_);
  Rng rng(StreamSeed(params_.seed, kSegmentStream, layer, kv_head, segment));
  const std::vector<float> v = RandomDirection(rng, params_.head_dim, layout.rotary,
                                               layout.topic_end, &space(layer, kv_head).sink);
  AddScaled(v.data(), scale, params_.head_dim, out);
}

void SyntheticTrace::AddFocus(int layer, int kv_head, int64_t source, float weight,
                              float* out) const {
  const int d = params_.head_dim;
  std::vector<float> v(d, 0.0f);
  AddScaled(space(layer, kv_head).topics.data() + prompt_topics_[source] * d, 1.0f, d, v.data());
  AddSegment(layer, kv_head, prompt_segments_[source], kQuerySegment, v.data());
  Normalize(v.data(), d);
  AddScaled(v.data(), weight, d, out);
}

void SyntheticTrace::KeyRow(int layer, int kv_head, int64_t position, int32_t topic,
                            int32_t segment, int needle, uint64_t stream, float* out) const {
  const Layout layout = LayoutOf(params_);
  const int d = params_.head_dim;
  const KeySpace& s = space(layer, kv_head);
  Rng rng(stream);
  std::fill(out, out + d, 0.0f);
  if (position < params_.sinks) {
    AddScaled(s.sink.data(), kSinkKey, d, out);
    AddNoise(rng, 0, d, 1.0f, out);
  } else {
    AddScaled(s.offset.data(), kKeyOffset, d, out);
    AddNoise(rng, layout.topic_end, d, kKeyNuisance, out);
    const float* direction = needle >= 0 ? s.needles.data() + needle * d : s.topics.data() + topic * d;
    AddScaled(direction, needle >= 0 ? kNeedleKey : kKeyTopic, d, out);
    if (needle < 0) AddSegment(layer, kv_head, segment, kKeySegment, out);
    AddNoise(rng, layout.rotary, layout.topic_end, kKeyTopicNoise, out);
    AddScaled(s.recency.data(), kRecencyKey, d, out);
    AddNoise(rng, 0, layout.rotary, kRotaryNoise, out);
  }
  ApplyRope(position, out);
}

void SyntheticTrace::ValueRow(int layer, int kv_head, int32_t topic, int needle, uint64_t stream,
                              float* out) const {
  const int d = params_.head_dim;
  Rng rng(stream);
  std::fill(out, out + d, 0.0f);
  if (needle >= 0) {
    AddNoise(rng, 0, d, kNeedleValue * std::sqrt(static_cast<float>(d)), out);
  } else if (topic < 0) {  // a sink
    AddNoise(rng, 0, d, kSinkValue * std::sqrt(static_cast<float>(d)), out);
  } else {
    AddScaled(space(layer, kv_head).values.data() + topic * d, 1.0f, d, out);
    AddNoise(rng, 0, d, kValueNoise * std::sqrt(static_cast<float>(d)), out);
  }
}

void SyntheticTrace::QueryRow(int layer, int q_head, TracePhase phase, int64_t row,
                              uint64_t stream, float* out) const {
  const Layout layout = LayoutOf(params_);
  const int d = params_.head_dim;
  const KeySpace& s = space(layer, KvHeadOf(q_head, params_.q_heads, params_.kv_heads));
  const float scale = std::sqrt(d / 64.0f);
  Rng rng(stream);
  std::fill(out, out + d, 0.0f);
  AddScaled(s.sink.data(), scale * kQuerySink, d, out);
  AddNoise(rng, layout.rotary, layout.topic_end, scale * kQueryNoise, out);

  std::vector<float> direction(d, 0.0f);
  int64_t position;
  const int kv_head = KvHeadOf(q_head, params_.q_heads, params_.kv_heads);
  const int64_t m = row / params_.drift_period;
  if (phase == TracePhase::kPrefill) {
    position = row;
    // Heads differ in how local they are: for a period of drift_period rows, head h % 4 == 0
    // follows its own segment 90% of the time, h % 4 == 3 only 30%; otherwise it recalls the
    // passage of one earlier token for the whole period. Prompt queries thus move as decode
    // queries do (a focus held for a period, the per-row jitter below), so that the prompt's
    // last queries, which auto_tau calibrates on, behave as the decode queries that follow.
    const double own = 0.9 - 0.2 * (q_head % 4);
    const int64_t start = m * params_.drift_period;
    Rng focus(StreamSeed(params_.seed, kPrefillFocusStream, q_head, m));
    const int64_t source = (start == 0 || focus.Uniform() < own) ? row : focus.UniformInt(start);
    AddFocus(layer, kv_head, source, 1.0f, direction.data());
  } else {
    position = params_.context + row;
    const int64_t periods = params_.decode_steps / params_.drift_period + 2;
    const int64_t* sources = decode_sources_.data() + q_head * periods;
    if (params_.query_drift == QueryDrift::kAdversarial) {
      // The focus glides to the next one over the period: consecutive queries stay alike while
      // the keys they want move elsewhere.
      const float drift = static_cast<float>(row % params_.drift_period) / params_.drift_period;
      AddFocus(layer, kv_head, sources[m], 1.0f - drift, direction.data());
      AddFocus(layer, kv_head, sources[m + 1], drift, direction.data());
    } else {
      // The period's focus, changing abruptly at its end (the query's similarity drops with it).
      AddFocus(layer, kv_head, sources[m], 1.0f, direction.data());
    }
    Normalize(direction.data(), d);
    if (needle_at_step_[row] >= 0) {
      // The asking query is about the needle: its topic recedes.
      AddScaled(s.needles.data() + needle_at_step_[row] * d, scale * kNeedleQuery, d, out);
      for (float& x : direction) x *= kNeedleStepTopic;
    }
  }
  AddScaled(direction.data(), scale * kQueryTopic, d, out);
  AddScaled(s.recency.data(), scale * kRecencyQuery, d, out);
  AddNoise(rng, 0, layout.rotary, kRotaryNoise, out);
  {
    // The row's own jitter, in prompt and decode queries alike (none under the adversarial
    // drift). It lives in the topic dims orthogonal to the sink and needle directions, rescaled to keep
    // its expected norm: sinks keep their share of every query's mass, and a needle is asked for
    // by its own step only.
    if (const float jitter = decode_noise(); jitter > 0) {
      const int basis = static_cast<int>(s.jitter_free.size()) / d;
      const int free_dims = layout.topic_end - layout.rotary - basis;
      if (free_dims > 0) {
        std::vector<float> noise(d, 0.0f);
        AddNoise(rng, layout.rotary, layout.topic_end,
                 scale * jitter * std::sqrt(static_cast<float>(layout.topic_end - layout.rotary) /
                                            free_dims),
                 noise.data());
        for (int b = 0; b < basis; ++b) {
          const float* e = s.jitter_free.data() + b * d;
          double dot = 0;
          for (int i = 0; i < d; ++i) dot += static_cast<double>(noise[i]) * e[i];
          AddScaled(e, -static_cast<float>(dot), d, noise.data());
        }
        AddScaled(noise.data(), 1.0f, d, out);
      }
    }
  }
  ApplyRope(position, out);
}

void SyntheticTrace::GenerateRows(int layer, TracePhase phase, TraceTensor tensor,
                                  int64_t row_begin, int64_t rows, float* out) const {
  const int d = params_.head_dim;
  const int heads = tensor == TraceTensor::kQ ? params_.q_heads : params_.kv_heads;
  const uint64_t kind = tensor == TraceTensor::kQ   ? kQStream
                        : tensor == TraceTensor::kK ? kKStream
                                                    : kVStream;
  const uint64_t phase_id = phase == TracePhase::kPrefill ? 0 : 1;
#pragma omp parallel for schedule(static) if (rows * heads > 256)
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t row = row_begin + r;
    for (int h = 0; h < heads; ++h) {
      float* v = out + (r * heads + h) * d;
      const uint64_t stream =
          StreamSeed(params_.seed, kind, (static_cast<uint64_t>(layer) << 32) | phase_id, h, row);
      if (tensor == TraceTensor::kQ) {
        QueryRow(layer, h, phase, row, stream, v);
        continue;
      }
      // A decode token belongs to the passage its KV group's first query head is on.
      int32_t topic;
      int32_t segment;
      int needle = -1;
      int64_t position;
      if (phase == TracePhase::kPrefill) {
        position = row;
        topic = row < params_.sinks ? -1 : prompt_topics_[row];
        segment = prompt_segments_[row];
        needle = needle_at_position_[row];
      } else {
        position = params_.context + row;
        const int64_t periods = params_.decode_steps / params_.drift_period + 2;
        const int first_head = h * (params_.q_heads / params_.kv_heads);
        const int64_t source = decode_sources_[first_head * periods + row / params_.drift_period];
        topic = prompt_topics_[source];
        segment = prompt_segments_[source];
      }
      if (tensor == TraceTensor::kK) {
        KeyRow(layer, h, position, std::max(topic, 0), segment, needle, stream, v);
      } else {
        ValueRow(layer, h, topic, needle, stream, v);
      }
    }
  }
}

absl::Status SyntheticTrace::Write(const std::string& path) const {
  absl::StatusOr<std::unique_ptr<SafetensorsWriter>> writer =
      CreateTraceWriter(path, geometry(), Metadata());
  if (!writer.ok()) return writer.status();
  constexpr int64_t kChunkRows = 4096;
  std::vector<float> chunk;
  for (int layer = 0; layer < params_.layers; ++layer) {
    for (TracePhase phase : {TracePhase::kPrefill, TracePhase::kDecode}) {
      const int64_t total = phase == TracePhase::kPrefill ? params_.context : params_.decode_steps;
      for (TraceTensor tensor : {TraceTensor::kQ, TraceTensor::kK, TraceTensor::kV}) {
        const int64_t row_floats =
            static_cast<int64_t>(tensor == TraceTensor::kQ ? params_.q_heads : params_.kv_heads) *
            params_.head_dim;
        for (int64_t begin = 0; begin < total; begin += kChunkRows) {
          const int64_t rows = std::min(kChunkRows, total - begin);
          chunk.resize(rows * row_floats);
          GenerateRows(layer, phase, tensor, begin, rows, chunk.data());
          // A value the service refuses (non-finite, or past what f16 holds) makes a trace no
          // replay can serve: the knobs (a huge decode_noise) are refused here, not there.
          if (const int64_t i = FirstOutOfRange(chunk); i >= 0) {
            return absl::InvalidArgumentError(absl::StrCat(
                "the trace would hold ", chunk[i], " (layer ", layer, ", row ",
                begin + i / row_floats, "), beyond the +-", kMaxTensorMagnitude,
                " the service takes: lower decode_noise (", decode_noise(), ")"));
          }
          if (absl::Status s = (*writer)->Append(chunk); !s.ok()) return s;
        }
      }
    }
  }
  return (*writer)->Finish();
}

}  // namespace kvrecall
