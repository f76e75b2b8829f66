// A generator of synthetic replay traces with the statistics that make sparse attention hard
// (DESIGN.md, "A real workload"), for contexts (64K-1M tokens) and needle tests that the real
// tinylm cannot reach.
//
// The model, per layer and KV head (every vector is head_dim long; the first rotary_dims are
// rotated by RoPE at the token's position, the rest are not, as in partial-rotary models):
//  * the prompt is a run of segments (mean `mean_segment` tokens), each on one of `topics` latent
//    topics (Zipf-distributed); a key carries its topic's direction and its segment's own one
//    (a passage), plus noise; a query is about a passage (a token's topic and, weaker, its
//    segment), so its top-K is that passage more than every key of its topic;
//  * queries and keys come from different distributions: keys carry a large common offset and
//    large "nuisance" noise in dimensions that queries do not use, so the keys nearest to a key
//    say little about which keys a query scores highest (Q->K is out of distribution);
//  * attention sinks: the first `sinks` tokens have keys along a direction that every query
//    shares a component of, so they collect softmax mass from every query;
//  * RoPE recency: queries and keys share a component in mid-frequency rotary pairs, so nearby
//    tokens score higher and the bonus fades over hundreds of tokens;
//  * prefill queries, per head and period of drift_period rows, mostly attend their own
//    segment and sometimes one earlier passage, with the decode jitter on every row, so that
//    the prompt's last queries (what auto_tau calibrates on) move as decode queries do;
//    decode queries drift (`query_drift`, calibrated against tinylm-a in
//    bench/results/synth_calibration.md):
//     - kCalibrated (the default): a head's topic changes abruptly every `drift_period` steps
//       and every step jitters around it (`decode_noise`), so consecutive queries have cosine
//       ~0.8 and a topic change shows as a drop in query similarity, as on real traces;
//     - kAdversarial (the generator before issue 15): the topic glides from one to the next over
//       each period, interpolating, with no per-step jitter: every step is >= 0.9 similar to the
//       one before while the support moves to another topic, the worst case for selection
//       reuse (ReTopK reuses ~80% of steps and loses most of its output fidelity);
//  * needles: `needles` prompt positions get a key (and a distinctive value) along a direction
//    of their own that no prefill query uses; one decode step per needle asks for it strongly,
//    making the needle that query's highest-scoring key in every layer and head.
// Query heads of a KV group share its key space but attend differently: each head has its own
// share of own-topic versus earlier-topic queries and its own decode drift. Everything is a
// pure function of (params, layer, row), so any rows can be generated in any order.
#ifndef KVRECALL_CLIENT_TRACE_SYNTHETIC_H_
#define KVRECALL_CLIENT_TRACE_SYNTHETIC_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/trace/trace.h"

namespace kvrecall {

// How decode queries move between steps (see the header comment).
enum class QueryDrift { kCalibrated, kAdversarial };

// "calibrated" / "adversarial"; ParseQueryDrift is INVALID_ARGUMENT for anything else.
const char* QueryDriftName(QueryDrift drift);
absl::StatusOr<QueryDrift> ParseQueryDrift(const std::string& name);

// kCalibrated's per-step decode jitter (bench/results/synth_calibration.md).
inline constexpr float kCalibratedDecodeNoise = 8.0f;

struct SyntheticTraceParams {
  int layers = 1;
  int q_heads = 8;
  int kv_heads = 2;
  int head_dim = 64;
  int64_t context = 65536;      // prompt tokens (T)
  int64_t decode_steps = 256;   // N
  uint64_t seed = 1;
  int sinks = 4;                // attention-sink tokens at the start of the prompt
  int topics = 64;
  int mean_segment = 512;       // mean tokens per topic segment of the prompt
  int drift_period = 32;        // decode steps between topic changes
  QueryDrift query_drift = QueryDrift::kCalibrated;
  // Norm of each decode query's own jitter in the topic dims (head_dim 64 units, as the
  // generator's other strengths); < 0: the drift's default (kCalibratedDecodeNoise for
  // kCalibrated, 0 for kAdversarial).
  float decode_noise = -1.0f;
  int needles = 8;              // placed in the prompt's middle 90%, asked for by decode steps
  int rotary_dims = 32;         // leading dims under RoPE (even, < head_dim)
  double rope_base = 500000.0;
  v1::DType dtype = v1::DTYPE_BF16;  // of the written file

  // INVALID_ARGUMENT naming the field when out of its domain. Sizes are bounded by what the
  // service accepts (layers, heads and head_dim up to 1024; context + decode_steps tokens up to
  // 2^31 - 1) and topics by 2^20, so that no product of them overflows.
  absl::Status Validate() const;
};

// A planted key/value pair and the decode step whose queries must find it.
struct Needle {
  int64_t position = 0;     // prompt token holding the needle's key and value
  int64_t decode_step = 0;  // decode step (0-based) whose queries ask for it
};

class SyntheticTrace {
 public:
  // INVALID_ARGUMENT from params.Validate(); RESOURCE_EXHAUSTED when its tables (a few bytes
  // per prompt token, topics x head_dim floats per layer and KV head) do not fit in memory.
  static absl::StatusOr<SyntheticTrace> Create(const SyntheticTraceParams& params);

  const SyntheticTraceParams& params() const { return params_; }
  TraceGeometry geometry() const;
  const std::vector<Needle>& needles() const { return needles_; }
  // The trace's __metadata__: "source", "generator", "seed", "sinks", "topics", "mean_segment",
  // "drift_period", "query_drift", "decode_noise", "rotary_dims", "rope_base", "rope" and
  // "needles" (a JSON list of {"position", "decode_step"} objects).
  std::map<std::string, std::string> Metadata() const;

  // Rows [row_begin, row_begin + rows) of one tensor as f32, [rows, heads, head_dim] into out
  // (prefill rows are prompt positions, decode rows are steps).
  void GenerateRows(int layer, TracePhase phase, TraceTensor tensor, int64_t row_begin,
                    int64_t rows, float* out) const;

  // Writes the whole trace to `path` in params.dtype, generating it in bounded chunks.
  absl::Status Write(const std::string& path) const;

 private:
  // Directions of one (layer, KV head): every vector head_dim long.
  struct KeySpace {
    std::vector<float> sink;       // shared by the sink keys and (weakly) every query
    std::vector<float> offset;     // common to all keys, unused by queries
    std::vector<float> recency;    // rotary component shared by queries and keys
    std::vector<float> topics;     // [topics, head_dim]
    std::vector<float> needles;    // [needles, head_dim]
    std::vector<float> values;     // [topics, head_dim]: value centre per topic
    // Orthonormal basis of the sink and needle directions, which the decode jitter avoids.
    std::vector<float> jitter_free;  // [basis vectors, head_dim]
  };

  explicit SyntheticTrace(const SyntheticTraceParams& params) : params_(params) {}
  // Create once params are valid (std::bad_alloc escapes).
  static SyntheticTrace Build(const SyntheticTraceParams& params);
  const KeySpace& space(int layer, int kv_head) const {
    return spaces_[layer * params_.kv_heads + kv_head];
  }
  void KeyRow(int layer, int kv_head, int64_t position, int32_t topic, int32_t segment,
              int needle, uint64_t stream, float* out) const;
  // Adds `scale` times prompt segment `segment`'s own unit direction (topic dims, orthogonal to
  // the sink) to out [head_dim].
  void AddSegment(int layer, int kv_head, int32_t segment, float scale, float* out) const;
  // Adds `weight` times the unit direction of a query about prompt token `source`'s passage
  // (its topic and, weaker, its segment) to out [head_dim].
  void AddFocus(int layer, int kv_head, int64_t source, float weight, float* out) const;
  void ValueRow(int layer, int kv_head, int32_t topic, int needle, uint64_t stream,
                float* out) const;
  void QueryRow(int layer, int q_head, TracePhase phase, int64_t row, uint64_t stream,
                float* out) const;
  void ApplyRope(int64_t position, float* v) const;
  float decode_noise() const;  // params_.decode_noise, or the drift's default

  SyntheticTraceParams params_;
  std::vector<KeySpace> spaces_;          // [layers * kv_heads]
  std::vector<int32_t> prompt_topics_;    // [context]
  std::vector<int32_t> prompt_segments_;  // [context]: segment index, from 0
  // [q_heads, decode_steps / drift_period + 2]: the prompt token whose passage (topic and
  // segment) a head's decode queries are about in each drift period.
  std::vector<int64_t> decode_sources_;
  std::vector<Needle> needles_;
  std::vector<int32_t> needle_at_position_;  // [context]: needle index or -1
  std::vector<int32_t> needle_at_step_;      // [decode_steps]: needle index or -1
};

}  // namespace kvrecall

#endif  // KVRECALL_CLIENT_TRACE_SYNTHETIC_H_
