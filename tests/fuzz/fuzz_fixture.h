// The starting state of every request_fuzzer input, and the seed requests written by
// fuzz_seeds: a registry with two prefilled sessions ("a": 2 layers, f32, full attention;
// "b": 1 layer, bf16, ReTopK), built through the same PrefillStream the service uses.
#ifndef KVRECALL_TESTS_FUZZ_FUZZ_FIXTURE_H_
#define KVRECALL_TESTS_FUZZ_FUZZ_FIXTURE_H_

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "kvrecall/v1/kvrecall.pb.h"
#include "proto/tensor_codec.h"
#include "server/backends/placements.h"
#include "server/prefill.h"
#include "server/session.h"

namespace kvrecall::fuzz {

// What the fixture's sessions look like.
struct FixtureSession {
  v1::Geometry geometry;
  v1::Policy policy;
  int64_t prompt_tokens;
};

inline v1::Geometry MakeGeometry(int layers, int q_heads, int kv_heads, int head_dim,
                                 v1::DType dtype) {
  v1::Geometry g;
  g.set_layers(layers);
  g.set_q_heads(q_heads);
  g.set_kv_heads(kv_heads);
  g.set_head_dim(head_dim);
  g.set_dtype(dtype);
  return g;
}

inline std::vector<FixtureSession> FixtureSessions() {
  std::vector<FixtureSession> out(2);
  out[0].geometry = MakeGeometry(2, 2, 1, 4, v1::DTYPE_F32);
  out[0].policy.set_selector(v1::SELECTOR_FULL);
  out[0].prompt_tokens = 6;
  out[1].geometry = MakeGeometry(1, 4, 2, 8, v1::DTYPE_BF16);
  out[1].policy.set_selector(v1::SELECTOR_RETOPK);
  out[1].policy.set_top_k(4);
  out[1].policy.mutable_retopk()->set_cache_capacity(4);
  out[1].policy.mutable_retopk()->set_reuse_neighbors(2);
  out[1].policy.mutable_retopk()->set_recent_window(2);
  out[1].prompt_tokens = 12;
  return out;
}

// Deterministic values in [-2, 2).
inline std::vector<float> Ramp(int64_t n, int seed) {
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = static_cast<float>(((i * 37 + seed * 11) % 64) - 32) / 16;
  return v;
}

inline v1::Tensor RampTensor(std::vector<int64_t> shape, v1::DType dtype, int seed) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  v1::Tensor t;
  EncodeTensor(Ramp(n, seed), shape, dtype, /*as_values=*/false, &t);
  return t;
}

// One chunk of a prompt: tokens [offset, offset + n) of `layer`.
inline v1::PrefillChunk PromptChunk(const std::string& id, const v1::Geometry& g, int layer,
                                    int64_t offset, int64_t n) {
  v1::PrefillChunk c;
  c.set_session_id(id);
  c.set_layer(layer);
  c.set_offset(offset);
  const int seed = static_cast<int>(layer * 1000 + offset);
  *c.mutable_q() = RampTensor({n, g.q_heads(), g.head_dim()}, g.dtype(), seed);
  *c.mutable_k() = RampTensor({n, g.kv_heads(), g.head_dim()}, g.dtype(), seed + 1);
  *c.mutable_v() = RampTensor({n, g.kv_heads(), g.head_dim()}, g.dtype(), seed + 2);
  return c;
}

inline v1::SequenceStep DecodeStep(const std::string& id, const v1::Geometry& g, int seed) {
  v1::SequenceStep s;
  s.set_session_id(id);
  *s.mutable_q() = RampTensor({g.q_heads(), g.head_dim()}, g.dtype(), seed);
  *s.mutable_k_new() = RampTensor({g.kv_heads(), g.head_dim()}, g.dtype(), seed + 1);
  *s.mutable_v_new() = RampTensor({g.kv_heads(), g.head_dim()}, g.dtype(), seed + 2);
  return s;
}

inline void Require(const absl::Status& status, const char* what) {
  if (!status.ok()) {
    std::fprintf(stderr, "fuzz fixture: %s: %s\n", what, std::string(status.message()).c_str());
    std::abort();
  }
}

class FuzzFixture {
 public:
  // A budget, so that inputs cannot make the fuzzer run out of memory through sizes the
  // service accepts.
  static constexpr int64_t kBudgetBytes = int64_t{256} << 20;

  FuzzFixture()
      : budget_(kBudgetBytes),
        placements_(CpuOnlyPlacements()),
        registry_(&budget_, placements_.get()) {
    for (const FixtureSession& s : FixtureSessions()) {
      v1::CreateSessionRequest request;
      *request.mutable_geometry() = s.geometry;
      *request.mutable_policy() = s.policy;
      absl::StatusOr<std::shared_ptr<Session>> session = registry_.Create(request);
      Require(session.status(), "CreateSession");
      ids_.push_back((*session)->id());
      PrefillStream prefill(&registry_);
      int64_t index = 0;
      for (int l = 0; l < s.geometry.layers(); ++l) {
        for (int64_t offset = 0; offset < s.prompt_tokens; offset += 4) {
          const int64_t n = std::min<int64_t>(4, s.prompt_tokens - offset);
          Require(prefill.Add(PromptChunk(ids_.back(), s.geometry, l, offset, n), index++),
                  "Prefill chunk");
        }
      }
      Require(prefill.Commit().status(), "Prefill commit");
    }
  }

  SessionRegistry& registry() { return registry_; }
  const std::string& id(int i) const { return ids_[i]; }

 private:
  // The CPU placement alone: no device is probed (the fuzzed code is above the seam).
  static std::unique_ptr<Placements> CpuOnlyPlacements() {
    PlacementOptions options;
    options.gpus.emplace();
    absl::StatusOr<std::unique_ptr<Placements>> placements = Placements::Create(options);
    Require(placements.status(), "placements");
    return *std::move(placements);
  }

  MemoryBudget budget_;
  std::unique_ptr<Placements> placements_;
  SessionRegistry registry_;
  std::vector<std::string> ids_;
};

}  // namespace kvrecall::fuzz

#endif  // KVRECALL_TESTS_FUZZ_FUZZ_FIXTURE_H_
