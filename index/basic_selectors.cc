#include "index/basic_selectors.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "kernels/cpu/attention.h"

namespace kvrecall {

void AppendStaticSet(int64_t tokens, int sinks, int recent, std::vector<int32_t>* ids) {
  const int64_t sink_end = std::min<int64_t>(sinks, tokens);
  const int64_t recent_begin = std::max<int64_t>(sink_end, tokens - recent);
  // Sized once and filled by iota: it runs for every head of every step.
  const size_t at = ids->size();
  ids->resize(at + static_cast<size_t>(sink_end + tokens - recent_begin));
  std::iota(ids->begin() + at, ids->begin() + at + sink_end, 0);
  std::iota(ids->begin() + at + sink_end, ids->end(), static_cast<int32_t>(recent_begin));
}

float StaticSetLse(const float* q, const KvView& kv, int kv_head, float scale, int64_t tokens,
                   int sinks, int recent) {
  thread_local std::vector<int32_t> ids;
  thread_local std::vector<float> scores;
  ids.clear();
  AppendStaticSet(tokens, sinks, recent, &ids);
  if (ids.empty()) return -std::numeric_limits<float>::infinity();
  scores.resize(ids.size());
  cpu::ScoreTokens(q, kv, kv_head, ids, scale, scores.data());
  const float top = *std::max_element(scores.begin(), scores.end());
  double sum = 0;
  for (float x : scores) sum += std::exp(static_cast<double>(x) - top);
  return static_cast<float>(top + std::log(sum));
}

void FullSelector::Select(int, const float*, const KvView& kv, HeadSelection* out) {
  out->support.resize(kv.tokens);
  std::iota(out->support.begin(), out->support.end(), 0);
  out->path = SelectionPath::kExact;
  out->candidates = static_cast<int32_t>(kv.tokens);
}

void ExactTopKSelector::Select(int q_head, const float* q, const KvView& kv, HeadSelection* out) {
  cpu::ExactTopK(q, kv, KvHeadOf(q_head, shape_.q_heads, shape_.kv_heads), shape_.scale, top_k_,
                 &out->support);
  out->path = SelectionPath::kExact;
  out->candidates = static_cast<int32_t>(kv.tokens);
}

void StreamingSelector::Select(int, const float*, const KvView& kv, HeadSelection* out) {
  out->support.clear();
  AppendStaticSet(kv.tokens, sinks_, recent_, &out->support);
  out->path = SelectionPath::kExact;
  out->candidates = 0;
}

}  // namespace kvrecall
