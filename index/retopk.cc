#include "index/retopk.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "index/basic_selectors.h"
#include "index/batch_topk.h"
#include "index/key_index.h"
#include "kernels/cpu/attention.h"
#include "kernels/fidelity.h"

namespace kvrecall {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// The top k of `candidates` (token ids, ascending and distinct) under q, highest first; ties go
// to the lower id because positions follow id order. support_scores (may be null): their scaled
// scores.
void TopKOfCandidates(const float* q, const KvView& kv, int kv_head, float scale, int k,
                      std::span<const int32_t> candidates, std::vector<float>* scores,
                      std::vector<int32_t>* positions, std::vector<int32_t>* support,
                      std::vector<float>* support_scores = nullptr) {
  scores->resize(candidates.size());
  cpu::ScoreTokens(q, kv, kv_head, candidates, scale, scores->data());
  cpu::TopKPositions(*scores, k, positions);
  support->resize(positions->size());
  for (size_t i = 0; i < positions->size(); ++i) (*support)[i] = candidates[(*positions)[i]];
  if (support_scores != nullptr) {
    support_scores->resize(positions->size());
    for (size_t i = 0; i < positions->size(); ++i) (*support_scores)[i] = (*scores)[(*positions)[i]];
  }
}

// kv restricted to its first `tokens` tokens: what a prompt query at position tokens - 1 sees.
KvView Prefix(const KvView& kv, int64_t tokens) {
  KvView prefix = kv;
  prefix.tokens = tokens;
  return prefix;
}

}  // namespace

SelectionPath ChooseReTopKPath(int cached_entries, float best_cosine, float tau,
                               int64_t decode_step, int refresh_interval) {
  if (refresh_interval > 0 && decode_step % refresh_interval == 0) {
    return SelectionPath::kRefresh;
  }
  // Written as !(best >= tau) so that a NaN cosine takes the exact path.
  if (cached_entries == 0 || !(best_cosine >= tau)) return SelectionPath::kFallback;
  return SelectionPath::kReuse;
}

QuerySupportCache::QuerySupportCache(int capacity, int head_dim)
    : capacity_(capacity),
      head_dim_(head_dim),
      queries_(static_cast<size_t>(capacity) * head_dim),
      supports_(capacity) {}

const float* QuerySupportCache::query(int age) const {
  return queries_.data() + static_cast<size_t>(Slot(age)) * head_dim_;
}

std::span<const int32_t> QuerySupportCache::support(int age) const {
  return supports_[Slot(age)];
}

int QuerySupportCache::ClaimNewest(const float* unit_query) {
  int slot;
  if (size_ < capacity_) {
    slot = Slot(size_);
    ++size_;
  } else {
    slot = oldest_;
    oldest_ = (oldest_ + 1) % capacity_;
  }
  std::copy(unit_query, unit_query + head_dim_,
            queries_.begin() + static_cast<size_t>(slot) * head_dim_);
  return slot;
}

void QuerySupportCache::Push(const float* unit_query, std::span<const int32_t> support) {
  const int slot = ClaimNewest(unit_query);
  const size_t before = supports_[slot].capacity();
  supports_[slot].assign(support.begin(), support.end());
  support_bytes_ += static_cast<int64_t>(supports_[slot].capacity() - before) *
                    static_cast<int64_t>(sizeof(int32_t));
}

void QuerySupportCache::PushTaking(const float* unit_query, std::vector<int32_t>* support) {
  const int slot = ClaimNewest(unit_query);
  const size_t before = supports_[slot].capacity();
  supports_[slot].swap(*support);
  support_bytes_ +=
      (static_cast<int64_t>(supports_[slot].capacity()) - static_cast<int64_t>(before)) *
      static_cast<int64_t>(sizeof(int32_t));
}

void QuerySupportCache::Cosines(const float* unit_query, float* cosines) const {
  // Ages [0, size) occupy slots [oldest, capacity) then [0, ...): two contiguous passes.
  const int first = std::min(size_, capacity_ - oldest_);
  cpu::DotProducts(unit_query, query(0), first, head_dim_, cosines);
  cpu::DotProducts(unit_query, queries_.data(), size_ - first, head_dim_, cosines + first);
}

int64_t QuerySupportCache::MemoryBytes() const {
  return static_cast<int64_t>(queries_.capacity()) * static_cast<int64_t>(sizeof(float)) +
         support_bytes_;
}

ReTopKHead::ReTopKHead(const ReTopKHeadParams& params, int cache_capacity, int head_dim)
    : params_(params),
      cache_(cache_capacity, head_dim),
      unit_query_(head_dim),
      cosines_(cache_capacity) {}

void UnionReuseCandidates(const QuerySupportCache& cache, std::span<const int32_t> neighbor_ages,
                          int64_t tokens, int window, std::vector<int32_t>* candidates) {
  // Marked in a bitmap of [0, tokens) and read back in order, as the GPU's union does: a sort of
  // the R * K ids mispredicted a branch for every few (98-99.5 % of the match's time,
  // bench/results/retopk_match.md), a scan of tokens / 64 words does not. The bitmap is left
  // zero for the next call on this thread.
  int64_t lowest = std::max<int64_t>(0, tokens - window), highest = tokens - 1;
  for (int32_t age : neighbor_ages) {
    for (int32_t id : cache.support(age)) {
      lowest = std::min<int64_t>(lowest, id);
      highest = std::max<int64_t>(highest, id);
    }
  }
  candidates->clear();
  if (highest < lowest) return;
  thread_local std::vector<uint64_t> bits;
  const size_t words = static_cast<size_t>(highest / 64 + 1);
  if (bits.size() < words) bits.resize(words, 0);
  uint64_t* const word = bits.data();
  auto mark = [word](int64_t id) { word[id >> 6] |= uint64_t{1} << (id & 63); };
  for (int32_t age : neighbor_ages) {
    for (int32_t id : cache.support(age)) mark(id);
  }
  for (int64_t t = std::max<int64_t>(0, tokens - window); t < tokens; ++t) mark(t);
  for (int64_t w = lowest >> 6; w <= highest >> 6; ++w) {
    for (uint64_t x = word[w]; x != 0; x &= x - 1) {
      candidates->push_back(static_cast<int32_t>(w * 64 + __builtin_ctzll(x)));
    }
    word[w] = 0;
  }
}

SelectionPath ReTopKHead::Decide(const float* q, int64_t decode_step, float* best_cosine) {
  pending_ = false;  // a step that failed after its selection
  cpu::Normalize(q, cache_.head_dim(), unit_query_.data());
  const int entries = cache_.size();
  cache_.Cosines(unit_query_.data(), cosines_.data());
  float best = -kInf;
  for (int i = 0; i < entries; ++i) best = std::max(best, cosines_[i]);
  *best_cosine = best;
  const SelectionPath path =
      ChooseReTopKPath(entries, best, params_.tau, decode_step, params_.refresh_interval);
  neighbors_.clear();
  candidates_.clear();
  if (path == SelectionPath::kReuse) {
    cpu::TopKPositions(std::span<const float>(cosines_.data(), entries), params_.reuse_neighbors,
                       &neighbors_);
  }
  decided_path_ = path;
  decided_best_ = best;
  return path;
}

SelectionPath ReTopKHead::Match(const float* q, int64_t tokens, int64_t decode_step,
                                float* best_cosine) {
  const SelectionPath path = Decide(q, decode_step, best_cosine);
  if (path == SelectionPath::kReuse) {
    UnionReuseCandidates(cache_, neighbors_, tokens, params_.recent_window, &candidates_);
  }
  return path;
}

void ReTopKHead::Step(const float* q, const KvView& kv, int kv_head, int64_t decode_step,
                      HeadSelection* out, SupportSelector* exact_search, int q_head) {
  Decide(q, decode_step, &out->best_cosine);
  StepDecided(q, kv, kv_head, out, exact_search, q_head);
}

void ReTopKHead::StepDecided(const float* q, const KvView& kv, int kv_head, HeadSelection* out,
                             SupportSelector* exact_search, int q_head) {
  out->path = decided_path_;
  out->best_cosine = decided_best_;
  if (out->path == SelectionPath::kReuse) {
    UnionReuseCandidates(cache_, neighbors_, kv.tokens, params_.recent_window, &candidates_);
    TopKOfCandidates(q, kv, kv_head, params_.scale, params_.top_k, candidates_, &scores_,
                     &positions_, &out->support, &out->support_scores);
    out->candidates = static_cast<int32_t>(candidates_.size());
  } else if (exact_search != nullptr) {
    exact_search->Select(q_head, q, kv, out);
    out->path = decided_path_;
    out->best_cosine = decided_best_;
  } else {
    cpu::ExactTopK(q, kv, kv_head, params_.scale, params_.top_k, &out->support);
    out->support_scores.clear();
    out->candidates = static_cast<int32_t>(kv.tokens);
  }
  if (defer_push_) {
    pending_support_.assign(out->support.begin(), out->support.end());
    pending_ = true;
  } else {
    cache_.Push(unit_query_.data(), out->support);
  }
}

void ReTopKHead::CompleteDecided(std::span<const int32_t> support) {
  cache_.Push(unit_query_.data(), support);
}

void ReTopKHead::set_defer_push(bool defer) {
  defer_push_ = defer;
  pending_ = false;
  if (defer) pending_support_.reserve(static_cast<size_t>(params_.top_k));
}

void ReTopKHead::PushPending() {
  if (!pending_) return;
  cache_.PushTaking(unit_query_.data(), &pending_support_);
  pending_ = false;
}

int64_t ReTopKHead::MemoryBytes() const {
  auto bytes = [](const auto& v) {
    return static_cast<int64_t>(v.capacity() * sizeof(v[0]));
  };
  return cache_.MemoryBytes() + bytes(unit_query_) + bytes(cosines_) + bytes(neighbors_) +
         bytes(candidates_) + bytes(scores_) + bytes(positions_) + bytes(pending_support_);
}

float CalibrateTau(std::span<const ReuseSample> samples, float target_recall,
                   float fallback_tau) {
  if (samples.empty()) return fallback_tau;
  std::vector<ReuseSample> sorted(samples.begin(), samples.end());
  std::sort(sorted.begin(), sorted.end(), [](const ReuseSample& a, const ReuseSample& b) {
    return a.best_cosine < b.best_cosine;
  });
  const size_t n = sorted.size();
  // suffix[i]: summed recall of the samples that reuse when tau = sorted[i].best_cosine.
  std::vector<double> suffix(n + 1, 0.0);
  for (size_t i = n; i-- > 0;) suffix[i] = suffix[i + 1] + sorted[i].recall;
  // Raising tau turns reuse steps (recall <= 1) into exact ones (recall 1), so the estimate only
  // grows with i: the first i that meets the target gives the lowest tau. Equal cosines reuse
  // together, so only the first of a run is a possible threshold.
  for (size_t i = 0; i < n; ++i) {
    if (i > 0 && sorted[i].best_cosine == sorted[i - 1].best_cosine) continue;
    const double mean_recall = (static_cast<double>(i) + suffix[i]) / static_cast<double>(n);
    if (mean_recall >= target_recall) return sorted[i].best_cosine;
  }
  return kInf;
}

TauCalibration::TauCalibration(const ReTopKHeadParams& head, int cache_capacity, int head_dim,
                               int64_t min_view)
    : scale_(head.scale),
      min_view_(min_view),
      replay_(
          [&head] {
            ReTopKHeadParams always_reuse = head;
            always_reuse.tau = -kInf;
            always_reuse.refresh_interval = 0;
            return always_reuse;
          }(),
          cache_capacity, head_dim),
      unit_query_(head_dim) {
  samples_.reserve(kCalibrationQueries);
}

void TauCalibration::Observe(const float* q, const KvView& kv, int kv_head,
                             std::span<const int32_t> exact, float outside_lse) {
  if (done() || kv.tokens < min_view_) return;
  QuerySupportCache* cache = replay_.mutable_cache();
  if (cache->size() < cache->capacity()) {  // warming: the query enters with its exact support
    cpu::Normalize(q, cache->head_dim(), unit_query_.data());
    cache->Push(unit_query_.data(), exact);
    return;
  }
  replay_.Step(q, kv, kv_head, /*decode_step=*/1, &selection_);
  exact_scores_.resize(exact.size());
  cpu::ScoreTokens(q, kv, kv_head, exact, scale_, exact_scores_.data());
  double recall = WeightedSupportRecall(selection_.support, exact, exact_scores_, kv.tokens,
                                        &marks_);
  if (outside_lse > -kInf && !exact_scores_.empty()) {
    // The mass outside the view is attended whatever the selector chooses: the recall of the
    // whole attention is (kept + outside) / (exact + outside).
    const double top = std::max<double>(
        outside_lse, *std::max_element(exact_scores_.begin(), exact_scores_.end()));
    double exact_mass = 0;
    for (float score : exact_scores_) exact_mass += std::exp(score - top);
    const double outside = std::exp(outside_lse - top);
    recall = (recall * exact_mass + outside) / (exact_mass + outside);
  }
  samples_.push_back({selection_.best_cosine, static_cast<float>(recall)});
}

ReTopKSelector::ReTopKSelector(const LayerShape& shape, int top_k, const ReTopKParams& params,
                               int64_t query_lead)
    : shape_(shape), top_k_(top_k), params_(params), query_lead_(query_lead) {
  const ReTopKHeadParams head_params{top_k, params.reuse_neighbors, params.recent_window,
                                     params.refresh_interval, params.tau, shape.scale};
  heads_.assign(shape.q_heads, ReTopKHead(head_params, params.cache_capacity, shape.head_dim));
}

absl::Status ReTopKSelector::Build(const KvView& kv, const PromptQueries& prompt_queries) {
  if (kv.kv_heads != shape_.kv_heads || kv.head_dim != shape_.head_dim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "retopk: KV has ", kv.kv_heads, " heads of dim ", kv.head_dim, ", the layer expects ",
        shape_.kv_heads, " of dim ", shape_.head_dim));
  }
  if (kv.tokens > 0 && prompt_queries.data == nullptr) {
    return absl::InvalidArgumentError("retopk: the prompt queries are required to seed the cache");
  }
  if (exact_search_ != nullptr) {
    if (absl::Status s = exact_search_->BuildUnless(build_stop(), kv, prompt_queries); !s.ok()) {
      return s;
    }
  }
  const int capacity = params_.cache_capacity;
  const int d = shape_.head_dim;
  const int64_t tokens = kv.tokens;
  // Prompt positions whose exact top-K is needed: the last C (seeding) and, with auto_tau, the
  // calibration's (C to warm, then the replayed ones) among those whose view (keys [0, p]) it
  // counts; none when too few are counted to calibrate (the fixed tau then).
  const int64_t window = int64_t{capacity} + kCalibrationQueries;
  const int64_t min_view = TauCalibration::MinView(top_k_, params_);
  int64_t calibration_begin =
      params_.auto_tau ? std::max(tokens - window, std::min(min_view - 1, tokens)) : tokens;
  if (tokens - calibration_begin < window) calibration_begin = tokens;
  const int64_t seed_begin = std::max<int64_t>(0, tokens - capacity);
  const int64_t begin = std::min(calibration_begin, seed_begin);
  if (tokens > 0 && begin < prompt_queries.first) {
    return absl::FailedPreconditionError(absl::StrCat(
        "retopk: the prompt queries from row ", begin, " are needed, got them from row ",
        prompt_queries.first));
  }
  const ReTopKHeadParams head_params{top_k_, params_.reuse_neighbors, params_.recent_window,
                                     params_.refresh_interval, params_.tau, shape_.scale};
  prompt_tokens_ = tokens;
  for (int h = 0; h < shape_.q_heads; ++h) heads_[h] = ReTopKHead(head_params, capacity, d);
  // Nothing to seed the caches with (the tiered bulk before it holds a token); the queries may
  // be null, and offsetting a null pointer would be undefined even unread.
  if (tokens == 0) return absl::OkStatus();

  const int64_t query_stride = static_cast<int64_t>(shape_.q_heads) * d;

  // Exact top-K of query p over keys [0, last]: one batched top-K (GEMM) over the keys before
  // `begin` for all needed queries, then per query an exact rescoring of that list together
  // with the keys [begin, last].
  std::vector<TopKLists> head_lists(shape_.q_heads);
  const BatchTopKFunction& batch_topk = batch_topk_;
  for (int h = 0; h < shape_.q_heads; ++h) {
    const int kv_head = KvHeadOf(h, shape_.q_heads, shape_.kv_heads);
    const VectorSet queries{prompt_queries.row(begin, query_stride) + static_cast<int64_t>(h) * d,
                            tokens - begin, query_stride, d};
    if (absl::Status s = batch_topk(queries, VectorSet::KeysOf(kv, kv_head, 0, begin), top_k_,
                                    &head_lists[h], {}, build_stop());
        !s.ok()) {
      return s;
    }
  }

  // Asked before every 16th query of a head's calibration and of its seeding (each query
  // rescores its list and the keys after `begin`, and a 128K head's calibration takes
  // seconds); heads begun after it is requested stop at their first query.
  std::atomic<bool> stopped = false;
  auto stop_now = [&](int64_t i) {
    if (stopped.load(std::memory_order_relaxed)) return true;
    if (i % 16 != 0 || !build_stop().requested()) return false;
    stopped.store(true, std::memory_order_relaxed);
    return true;
  };
#pragma omp parallel for schedule(dynamic, 1)
  for (int h = 0; h < shape_.q_heads; ++h) {
    const int kv_head = KvHeadOf(h, shape_.q_heads, shape_.kv_heads);
    const TopKLists& lists = head_lists[h];
    auto query_at = [&](int64_t p) { return prompt_queries.row(p, query_stride) + h * d; };
    std::vector<int32_t> candidates, positions, exact;
    std::vector<float> scores;
    auto exact_top_k = [&](int64_t p, int64_t last) {
      const int32_t* list = lists.list(p - begin);
      candidates.assign(list, list + lists.k);
      std::sort(candidates.begin(), candidates.end());
      for (int64_t t = begin; t <= last; ++t) candidates.push_back(static_cast<int32_t>(t));
      TopKOfCandidates(query_at(p), kv, kv_head, shape_.scale, top_k_, candidates, &scores,
                       &positions, &exact);
    };
    // The calibration: each query over the keys up to its own position, as its decode step
    // would have seen the view.
    if (calibration_begin < tokens) {
      TauCalibration calibration(head_params, capacity, d, min_view);
      for (int64_t p = calibration_begin; p < tokens; ++p) {
        if (stop_now(p - calibration_begin)) break;
        exact_top_k(p, p);
        const float outside = outside_lse_ ? outside_lse_(query_at(p), p, h) : -kInf;
        calibration.Observe(query_at(p), Prefix(kv, p + 1), kv_head, exact, outside);
      }
      if (stopped.load(std::memory_order_relaxed)) continue;
      heads_[h].set_tau(calibration.Tau(params_.target_recall, params_.tau));
    }
    // The seeds: each query over the keys it sees now (its position shifted by the lead).
    std::vector<float> unit(d);
    for (int64_t p = seed_begin; p < tokens; ++p) {
      if (stop_now(p - seed_begin)) break;
      exact_top_k(p, std::min(p + query_lead_, tokens - 1));
      cpu::Normalize(query_at(p), d, unit.data());
      heads_[h].mutable_cache()->Push(unit.data(), exact);
    }
  }
  if (stopped.load(std::memory_order_relaxed)) return BuildStop::Status("the ReTopK build");
  return absl::OkStatus();
}

void ReTopKSelector::OnAppend(const KvView& kv) {
  if (exact_search_ != nullptr) exact_search_->OnAppend(kv);
}

void ReTopKSelector::Select(int q_head, const float* q, const KvView& kv, HeadSelection* out) {
  heads_[q_head].Step(q, kv, KvHeadOf(q_head, shape_.q_heads, shape_.kv_heads),
                      kv.tokens - prompt_tokens_, out, exact_search_.get(), q_head);
}

SelectionPath ReTopKSelector::Decide(int q_head, const float* q, int64_t kv_tokens,
                                     float* best_cosine) {
  float best = 0.0f;
  const SelectionPath path = heads_[q_head].Decide(q, kv_tokens - prompt_tokens_, &best);
  if (best_cosine != nullptr) *best_cosine = best;
  return path;
}

void ReTopKSelector::SelectDecided(int q_head, const float* q, const KvView& kv,
                                   HeadSelection* out) {
  heads_[q_head].StepDecided(q, kv, KvHeadOf(q_head, shape_.q_heads, shape_.kv_heads), out,
                             exact_search_.get(), q_head);
}

void ReTopKSelector::CompleteDecided(int q_head, std::span<const int32_t> support) {
  heads_[q_head].CompleteDecided(support);
}

void ReTopKSelector::set_defer_pushes(bool defer) {
  for (ReTopKHead& head : heads_) head.set_defer_push(defer);
}

int64_t ReTopKSelector::MemoryBytes() const {
  int64_t bytes = exact_search_ != nullptr ? exact_search_->MemoryBytes() : 0;
  for (const ReTopKHead& head : heads_) bytes += head.MemoryBytes();
  return bytes;
}

}  // namespace kvrecall
