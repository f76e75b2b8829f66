#include "index/shortlist_selector.h"

#include <algorithm>

#include "kernels/cpu/attention.h"

namespace kvrecall {

ShortlistSelector::ShortlistSelector(const LayerShape& shape, int top_k)
    : shape_(shape), top_k_(top_k), heads_(shape.q_heads) {}

void ShortlistSelector::SetShortlist(int q_head, std::span<const int32_t> ids,
                                     std::span<const int32_t> outliers, int64_t coded) {
  heads_[q_head] = Head{ids, outliers, coded};
}

void ShortlistSelector::Select(int q_head, const float* q, const KvView& kv, HeadSelection* out) {
  if (fetch_ != nullptr) (*fetch_)();
  const Head& head = heads_[q_head];
  const int64_t coded = std::min(head.coded, kv.tokens);
  thread_local std::vector<int32_t> candidates;
  thread_local std::vector<float> scores;
  thread_local std::vector<int32_t> positions;
  // Outliers the shortlist holds too are taken once: a stamp per coded row says which Select
  // took it last (stamps are per thread, and a Select's is new).
  thread_local std::vector<uint32_t> taken;
  thread_local uint32_t stamp = 0;
  if (taken.size() < static_cast<size_t>(coded)) taken.resize(coded, 0);
  if (++stamp == 0) {
    std::fill(taken.begin(), taken.end(), 0);
    stamp = 1;
  }
  candidates.clear();
  for (std::span<const int32_t> list : {head.ids, head.outliers}) {
    for (int32_t id : list) {
      if (id >= 0 && id < coded && taken[id] != stamp) {
        taken[id] = stamp;
        candidates.push_back(id);
      }
    }
  }
  for (int64_t t = coded; t < kv.tokens; ++t) candidates.push_back(static_cast<int32_t>(t));
  scores.resize(candidates.size());
  const int kv_head = KvHeadOf(q_head, shape_.q_heads, shape_.kv_heads);
  cpu::ScoreTokens(q, kv, kv_head, candidates, shape_.scale, scores.data());
  cpu::TopKPositions(scores, top_k_, &positions);
  out->support.resize(positions.size());
  out->support_scores.resize(positions.size());
  for (size_t i = 0; i < positions.size(); ++i) {
    out->support[i] = candidates[positions[i]];
    out->support_scores[i] = scores[positions[i]];
  }
  out->path = SelectionPath::kExact;
  out->candidates = static_cast<int32_t>(candidates.size());
}

}  // namespace kvrecall
