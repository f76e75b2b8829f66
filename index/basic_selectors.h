// The selectors that need no index: full attention, exact top-K by full scan, and streaming
// (attention sinks + a recent window).
#ifndef KVRECALL_INDEX_BASIC_SELECTORS_H_
#define KVRECALL_INDEX_BASIC_SELECTORS_H_

#include <algorithm>
#include <cstdint>
#include <vector>

#include "index/support_selector.h"

namespace kvrecall {

// Every token: exact attention.
class FullSelector : public SupportSelector {
 public:
  absl::Status Build(const KvView&, const PromptQueries&) override { return absl::OkStatus(); }
  void Select(int q_head, const float* q, const KvView& kv, HeadSelection* out) override;
};

// The K highest-scoring tokens under the current query, by a full scan.
class ExactTopKSelector : public SupportSelector {
 public:
  ExactTopKSelector(const LayerShape& shape, int top_k) : shape_(shape), top_k_(top_k) {}
  absl::Status Build(const KvView&, const PromptQueries&) override { return absl::OkStatus(); }
  void Select(int q_head, const float* q, const KvView& kv, HeadSelection* out) override;

 private:
  LayerShape shape_;
  int top_k_;
};

// The first `sinks` and the last `recent` tokens (StreamingLLM's static set).
class StreamingSelector : public SupportSelector {
 public:
  StreamingSelector(int sinks, int recent) : sinks_(sinks), recent_(recent) {}
  absl::Status Build(const KvView&, const PromptQueries&) override { return absl::OkStatus(); }
  void Select(int q_head, const float* q, const KvView& kv, HeadSelection* out) override;

 private:
  int sinks_;
  int recent_;
};

// Appends the static set {0..sinks) ∪ [tokens - recent, tokens) to *ids, each token once.
// Shared by the streaming selector and the tiered/index policies.
void AppendStaticSet(int64_t tokens, int sinks, int recent, std::vector<int32_t>* ids);

// The log-sum-exp of q's [head_dim] scaled scores (scale * <q, k>) through kv_head over the
// static set of the first `tokens` tokens of kv; -inf when it is empty. What a bulk selector's
// calibration counts as kept whatever it chooses (ReTopKSelector::set_outside_lse).
float StaticSetLse(const float* q, const KvView& kv, int kv_head, float scale, int64_t tokens,
                   int sinks, int recent);

// Tokens of the bulk, [sinks, tokens - recent): what lies outside the static set of a history
// of `tokens`, the part the graph index and the tiered placement's host tier select from.
inline int64_t BulkTokens(int64_t tokens, int sinks, int recent) {
  return std::max<int64_t>(0, tokens - recent - sinks);
}

}  // namespace kvrecall

#endif  // KVRECALL_INDEX_BASIC_SELECTORS_H_
