// One StaticSetStep's buffers as TieredBackend lays them out, for tests that drive a
// StaticSetTier's calls directly (tests/host_exact_heads_test.cc, tests/gpu_exact_heads_test.cc).
#ifndef KVRECALL_TESTS_TIER_STEP_BUFFERS_H_
#define KVRECALL_TESTS_TIER_STEP_BUFFERS_H_

#include <cstdint>
#include <vector>

#include "kernels/kv_view.h"
#include "server/backends/attention_backend.h"
#include "server/backends/bulk_codes.h"
#include "server/backends/tiered_backend.h"

namespace kvrecall::testing {

struct TierStepBuffers {
  // What no exact path writes: a query head's bulk outputs before its step.
  static constexpr float kMark = 12345.0f;

  // A step of `config`'s layer over `history` (its last token the new one: k_new / v_new, f32
  // [kv_heads, head_dim]) and its bulk, with query q [q_heads, head_dim], giving the tier query
  // heads `device_heads` within `bound`; every output reset (the bulk's to kMark).
  StaticSetStep Step(const LayerConfig& config, StaticSet* set, BulkCodes* codes,
                     const KvView& history, const KvView& bulk, const float* q,
                     const float* k_new, const float* v_new,
                     const std::vector<int32_t>& device_heads, int bound) {
    const int q_heads = config.shape.q_heads, d = config.shape.head_dim;
    const int shortlist = config.selector.shortlist, top_k = config.selector.top_k;
    heads = device_heads;
    o.assign(q_heads * d, 0.0f);
    lse.assign(q_heads, 0.0f);
    ids.assign(q_heads * shortlist, -1);
    sizes.assign(q_heads, 0);
    bulk_o.assign(q_heads * d, kMark);
    bulk_lse.assign(q_heads, kMark);
    candidates.assign(q_heads, -1);
    support.assign(q_heads * top_k, -1);
    support_sizes.assign(q_heads, -1);
    StaticSetStep step{&config, set, history, q, k_new, v_new, o.data(), lse.data()};
    step.codes = codes;
    step.bulk = bulk;
    step.shortlist = shortlist;
    step.shortlist_ids = ids.data();
    step.shortlist_sizes = sizes.data();
    step.shortlist_coded = &coded;
    step.device_heads = heads.data();
    step.device_exact_heads = static_cast<int>(heads.size());
    step.device_exact_bound = bound;
    step.bulk_o = bulk_o.data();
    step.bulk_lse = bulk_lse.data();
    step.bulk_candidates = candidates.data();
    step.bulk_support = support.data();
    step.bulk_support_sizes = support_sizes.data();
    return step;
  }
  // Whether no exact path wrote query head h's bulk outputs (head_dim d).
  bool Untouched(int h, int d) const {
    for (int j = 0; j < d; ++j) {
      if (bulk_o[h * d + j] != kMark) return false;
    }
    return bulk_lse[h] == kMark && candidates[h] == -1 && support_sizes[h] == -1;
  }

  std::vector<int32_t> heads, ids, sizes, candidates, support, support_sizes;
  std::vector<float> o, lse, bulk_o, bulk_lse;
  int64_t coded = 0;
};

// Exact heads every tier refuses with INTERNAL (its message holds `message`) in a step of 4 query
// heads whose bound is 2.
struct RefusedExactHeads {
  std::vector<int32_t> heads;
  const char* message;
};
inline std::vector<RefusedExactHeads> RefusedExactHeadsOfFourWithinTwo() {
  return {{{1, 4}, "query head 4 of 4"},
          {{-1}, "query head -1 of 4"},
          {{1, 2, 3}, "3 exact heads over its bound of 2"}};
}

}  // namespace kvrecall::testing

#endif  // KVRECALL_TESTS_TIER_STEP_BUFFERS_H_
