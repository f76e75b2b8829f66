// ReTopK (arXiv 2607.27692): per query head, reuses the top-K supports of similar past queries
// instead of scanning the whole history, plus the per-head calibration of its threshold tau.
//
// The per-head decode step is the reference the fused CUDA path mirrors. For query head h with
// post-RoPE query q at decode step s (s = 1 for the first decoded token) over n tokens (the
// current one included):
//   1. q̄ = q / ||q||; cos[i] = <q̄, cached query i> for the cached entries in age order
//      (i = 0 is the oldest); best = max cos (-inf when the cache is empty).
//   2. Path (ChooseReTopKPath): refresh if Tr > 0 and s % Tr == 0; else fallback if the cache is
//      empty or best < tau (or best is NaN); else reuse.
//   3. Reuse: candidates = the supports of the R entries with the highest cos (ties: older
//      first) ∪ the last W positions [n - W, n), deduplicated and sorted by token id; each is
//      scored exactly with the current q (scale * <q, k>); the support is their top K, highest
//      score first, ties by lower token id. candidates = the number of distinct tokens scored.
//      Refresh / fallback: the exact top-K of all n tokens (cpu::ExactTopK), candidates = n.
//   4. (q̄, support) enters the FIFO after either path, evicting the oldest entry when full.
// Only token ids are reused: scores, weights and outputs always come from the current query.
// Because the candidates are sorted by id before the top-K, a reuse step whose candidates contain
// the exact top-K support returns exactly the exact path's support, in the same order.
#ifndef KVRECALL_INDEX_RETOPK_H_
#define KVRECALL_INDEX_RETOPK_H_

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "index/batch_topk.h"
#include "index/selector_params.h"
#include "index/support_selector.h"
#include "kernels/kv_view.h"

namespace kvrecall {

// Step 2 above: the path of one head's decode step. decode_step counts from 1; a
// refresh_interval of 0 disables refresh.
SelectionPath ChooseReTopKPath(int cached_entries, float best_cosine, float tau,
                               int64_t decode_step, int refresh_interval);

// One query head's FIFO of (unit-norm query [head_dim], support of at most K token ids).
// Storage is slot-major ([capacity, head_dim] queries) so the cosines are one pass over
// contiguous memory; entries are addressed by age (0 = oldest).
class QuerySupportCache {
 public:
  QuerySupportCache(int capacity, int head_dim);

  int capacity() const { return capacity_; }
  int size() const { return size_; }
  int head_dim() const { return head_dim_; }

  // The entry of age `age` in [0, size()): its unit query [head_dim] and its support.
  const float* query(int age) const;
  std::span<const int32_t> support(int age) const;

  // Appends an entry as the newest, evicting the oldest when full.
  void Push(const float* unit_query, std::span<const int32_t> support);
  // The same, taking *support's ids without a copy: *support gets the evicted slot's vector in
  // exchange (its content unspecified; its capacity is for the caller to reuse).
  void PushTaking(const float* unit_query, std::vector<int32_t>* support);

  // cosines[age] = <unit_query, query(age)> for age in [0, size()).
  void Cosines(const float* unit_query, float* cosines) const;

  // The age of the entry in `slot` (in [0, capacity)). Slots are FIFO positions numbered as the
  // GPU caches (kernels/cuda/retopk.h) number theirs: the first entry fills slot 0 and a full
  // cache evicts the oldest, so a copy pushed the same entries maps the GPU's slots to ages.
  int AgeOfSlot(int slot) const { return (slot - oldest_ + capacity_) % capacity_; }

  // Its heap bytes, kept as the entries change (a tiered step reads every head's twice: summing
  // them each time took ~10 us a layer, d70).
  int64_t MemoryBytes() const;

 private:
  int Slot(int age) const { return (oldest_ + age) % capacity_; }
  // The slot of a new newest entry (the oldest's when full, evicting it), its query set to
  // unit_query; Push's and PushTaking's.
  int ClaimNewest(const float* unit_query);

  int capacity_;
  int head_dim_;
  int size_ = 0;
  int oldest_ = 0;                               // slot of age 0
  std::vector<float> queries_;                   // [capacity, head_dim], by slot
  std::vector<std::vector<int32_t>> supports_;   // [capacity], by slot
  int64_t support_bytes_ = 0;                    // the supports' capacities, in bytes
};

// Step 3's candidates: the supports of `cache`'s entries of ages `neighbor_ages` ∪ the last
// `window` positions of [0, tokens), sorted by token id and distinct (written over
// *candidates). The one union of the reuse path, whether the neighbors were chosen by
// ReTopKHead::Match or elsewhere (the GPU's match, kernels/cuda/retopk_match.h).
void UnionReuseCandidates(const QuerySupportCache& cache, std::span<const int32_t> neighbor_ages,
                          int64_t tokens, int window, std::vector<int32_t>* candidates);

// The knobs one head steps with (tau is per head under auto_tau).
struct ReTopKHeadParams {
  int top_k = 512;            // K
  int reuse_neighbors = 4;    // R
  int recent_window = 32;     // W
  int refresh_interval = 128; // Tr, 0 disables
  float tau = 0.85f;
  float scale = 1.0f;         // softmax scale of <q, k>; only its sign matters for the ranking
};

// One query head's ReTopK state and its decode step (steps 1-4 above). Not thread-safe: a
// selector owns one per query head, and heads step in parallel.
class ReTopKHead {
 public:
  ReTopKHead(const ReTopKHeadParams& params, int cache_capacity, int head_dim);

  // One decode step for q [head_dim] over kv (which includes the current token), through KV head
  // kv_head. Fills out->support, path, candidates and best_cosine, then updates the cache.
  // exact_search (may be null): what the exact and refresh paths select with, as query head
  // q_head over kv (the graph index's search); null: the flat scan, exact top-K.
  void Step(const float* q, const KvView& kv, int kv_head, int64_t decode_step,
            HeadSelection* out, SupportSelector* exact_search = nullptr, int q_head = 0);

  // Step's first half, the cache match: steps 1-2 for q [head_dim] over `tokens` tokens (the
  // current one included) and, on the reuse path, step 3's neighbors and candidates; nothing is
  // scored. Returns the path and sets *best_cosine. Until the next Match or Step, unit_query()
  // is q̄ [head_dim], and neighbors() (the R most similar entries' ages, most similar first,
  // ties to the older) and candidates() (ascending, distinct) are those of a reuse match, empty
  // otherwise. Leaves the cache unchanged.
  SelectionPath Match(const float* q, int64_t tokens, int64_t decode_step, float* best_cosine);
  const float* unit_query() const { return unit_query_.data(); }

  // Step in parts, for a caller that decides every head's path before it runs any (the tiered
  // placement, which hands the exact paths of some heads to its GPU): Decide is Match without
  // the reuse path's candidates (steps 1-2 and the neighbors); then either StepDecided, the rest
  // of Step on the host, or CompleteDecided with the support the exact path selected elsewhere
  // (token ids over the same kv, any order), each of which pushes the decided query into the
  // cache. Decide itself leaves the cache unchanged: one followed by neither (a step that
  // failed) is undone by the next Decide or Step.
  SelectionPath Decide(const float* q, int64_t decode_step, float* best_cosine);
  void StepDecided(const float* q, const KvView& kv, int kv_head, HeadSelection* out,
                   SupportSelector* exact_search = nullptr, int q_head = 0);
  void CompleteDecided(std::span<const int32_t> support);

  // With deferred pushes, Step and StepDecided keep the step's (q̄, support) aside instead of
  // pushing it: PushPending pushes it once the caller's step has succeeded, and the next Decide
  // or Step drops it. For a caller whose step may still fail after its heads selected (the
  // tiered placement, whose device half ends after the host's heads): a failed step, resent,
  // must not find its own query in the cache. Reserves room for one support of top_k.
  void set_defer_push(bool defer);
  void PushPending();
  std::span<const int32_t> neighbors() const { return neighbors_; }
  std::span<const int32_t> candidates() const { return candidates_; }

  float tau() const { return params_.tau; }
  void set_tau(float tau) { params_.tau = tau; }
  const QuerySupportCache& cache() const { return cache_; }
  QuerySupportCache* mutable_cache() { return &cache_; }

  int64_t MemoryBytes() const;

 private:
  ReTopKHeadParams params_;
  QuerySupportCache cache_;
  // Per-step scratch, kept so that a warm step allocates nothing.
  std::vector<float> unit_query_;
  std::vector<float> cosines_;
  std::vector<int32_t> neighbors_;
  std::vector<int32_t> candidates_;
  std::vector<float> scores_;
  std::vector<int32_t> positions_;
  SelectionPath decided_path_ = SelectionPath::kFallback;
  float decided_best_ = 0.0f;
  bool defer_push_ = false;
  bool pending_ = false;  // pending_support_ (with unit_query_) awaits PushPending
  std::vector<int32_t> pending_support_;
};

// One prompt query replayed through the reuse path during calibration.
struct ReuseSample {
  float best_cosine = 0.0f;  // the step's best cosine with the simulated cache
  // Attention-weighted support recall (WeightedSupportRecall in kernels/fidelity.h) of the
  // reuse path's support against the exact top-K.
  float recall = 0.0f;
};

// The per-head tau of auto_tau: the lowest observed best cosine b such that, if the samples with
// best_cosine >= b reused (at their simulated recall) and the rest ran the exact path (recall 1),
// the mean recall over all samples would be >= target_recall. +inf (never reuse) when only the
// exact path on every sample meets the target; fallback_tau when there are no samples.
float CalibrateTau(std::span<const ReuseSample> samples, float target_recall, float fallback_tau);

// Prompt queries that auto_tau replays per head: the last kCalibrationQueries of the prompt.
// Calibration costs one exact top-K per replayed query (a blocked GEMM against the prompt keys,
// shared with seeding) plus one reuse step each, so beyond that one scan its cost does not grow
// with the prompt.
inline constexpr int kCalibrationQueries = 256;

// auto_tau's calibration of one query head, fed prompt queries in order, each with the keys it
// would attend in the selector's view at its decode step. A query whose view is shorter than
// min_view (R * K + W: the most candidates a reuse step scores) is not counted: a reuse step
// may score all of a shorter view and recall everything whatever the cache, which says nothing
// of tau. Of the queries counted, the first C (the cache's capacity) warm a copy of the
// head that always reuses (tau = -inf, no refresh) with their exact supports; each of the next
// kCalibrationQueries is replayed through that copy and becomes a ReuseSample: the copy's best
// cosine, and the attention-weighted support recall (WeightedSupportRecall) of the support the
// copy reused against the query's exact top-K, counting the mass the query attends outside the
// view as kept. Always reusing makes the copy's cache staler than the real one at any tau (which
// also holds exact supports), so the recall estimate errs low and the chosen tau errs high (safe).
class TauCalibration {
 public:
  // The min_view of a ReTopK selector's calibrations: R * K + W (R capped at C).
  static int64_t MinView(int top_k, const ReTopKParams& params) {
    return int64_t{std::min(params.reuse_neighbors, params.cache_capacity)} * top_k +
           params.recent_window;
  }

  // head: the knobs of the head being calibrated (its tau is not used).
  TauCalibration(const ReTopKHeadParams& head, int cache_capacity, int head_dim,
                 int64_t min_view);

  // Feeds query q [head_dim] of KV head kv_head over kv (the tokens it attends in the view, its
  // own last) with `exact`, its exact top-K over kv (token ids, any order), and outside_lse, the
  // log-sum-exp of its scaled scores over what it attends outside the view (-inf: nothing).
  // Does nothing once done() or when kv is shorter than min_view.
  void Observe(const float* q, const KvView& kv, int kv_head, std::span<const int32_t> exact,
               float outside_lse);
  // Whether every replay sample is in (warming and replaying take C + kCalibrationQueries).
  bool done() const { return static_cast<int>(samples_.size()) >= kCalibrationQueries; }
  // CalibrateTau over the samples.
  float Tau(float target_recall, float fallback_tau) const {
    return CalibrateTau(samples_, target_recall, fallback_tau);
  }

 private:
  float scale_;
  int64_t min_view_;
  ReTopKHead replay_;
  std::vector<ReuseSample> samples_;
  // Per-query scratch.
  std::vector<float> unit_query_;
  std::vector<float> exact_scores_;
  std::vector<uint8_t> marks_;
  HeadSelection selection_;
};

// The ReTopK selector of one layer: one ReTopKHead per query head (heads of a GQA group share
// the KV, not the cache).
//
// Build seeds each head's cache with the last C prompt queries, each with its exact top-K over
// the keys it sees (up to its own position, shifted by query_lead). With auto_tau each head's
// tau is calibrated (TauCalibration) on the prompt's last C + kCalibrationQueries queries whose
// view is at least R * K + W tokens, each over the keys up to its own position (as its decode
// step would have seen the view, whatever the lead). A prompt with fewer keeps the fixed tau:
// calibrating on the first decode steps instead was measured, and a tau calibrated on views of
// 2K-5K tokens cost tinylm-a 0.3-0.5 % more bits/byte than exact top-K by 8K, where the fixed
// tau cost 0.1 % (bench/results/tiered_tinylm16k.md, "auto_tau on a short prompt"). The recall
// is weighted by softmax mass because plain support recall counts a near-zero tail token like
// the dominant one: calibrated on it, tau over-restricts heads whose mass sits in a few stable
// tokens and under-restricts diffuse ones, which measured no better than a fixed tau (an early
// measurement, not kept; the weighted calibration's rows are bench/results/replay_tinylm16k.md's
// `--auto_tau` runs).
class ReTopKSelector : public SupportSelector {
 public:
  // query_lead: prompt query p sits query_lead positions after key p and sees keys
  // [0, min(p + query_lead, T - 1)] (0: the prompt's own causal attention). The tiered placement
  // builds over the bulk, which ends `recent` tokens before the prompt does: its queries (those of
  // the last positions) see the whole bulk.
  ReTopKSelector(const LayerShape& shape, int top_k, const ReTopKParams& params,
                 int64_t query_lead = 0);

  absl::Status Build(const KvView& kv, const PromptQueries& prompt_queries) override;
  void OnAppend(const KvView& kv) override;
  bool OnAppendIsCostly() const override {
    return exact_search_ != nullptr && exact_search_->OnAppendIsCostly();
  }
  void Select(int q_head, const float* q, const KvView& kv, HeadSelection* out) override;
  int64_t MemoryBytes() const override;
  // The exact search's (its graph's), over the same view.
  void ReserveTokens(int64_t tokens) override {
    if (exact_search_ != nullptr) exact_search_->ReserveTokens(tokens);
  }

  // Select in parts (ReTopKHead::Decide): query head q_head's path for q over kv_tokens tokens
  // (the kv Select would be given); then SelectDecided (Select's rest, on the same kv) or
  // CompleteDecided with the support of an exact path run elsewhere (the GPU's). *best_cosine
  // (may be null): the match's best cosine.
  SelectionPath Decide(int q_head, const float* q, int64_t kv_tokens, float* best_cosine);
  void SelectDecided(int q_head, const float* q, const KvView& kv, HeadSelection* out);
  void CompleteDecided(int q_head, std::span<const int32_t> support);
  // ReTopKHead::set_defer_push for every head, after Build (which makes the heads anew);
  // PushPending for query head q_head's step.
  void set_defer_pushes(bool defer);
  void PushPending(int q_head) { heads_[q_head].PushPending(); }

  // The exact and refresh paths select with `search` (built, fed appends and counted with this
  // selector) instead of a flat scan: the graph index in the tiered placement. Before Build.
  void set_exact_search(std::unique_ptr<SupportSelector> search) {
    exact_search_ = std::move(search);
  }
  // For a selector over part of the history (the tiered bulk): outside_lse(q, last_row, q_head)
  // is the log-sum-exp of prompt query q's (query head q_head's) scaled scores over the tokens
  // it would attend outside this selector's view at its decode step, the one whose view ends
  // at row last_row. auto_tau then calibrates on the recall of the whole attention's mass,
  // static set included, rather than of the part's alone. Called from the heads' threads;
  // valid during Build only (unset: nothing outside the view).
  using OutsideLse = std::function<float(const float* q, int64_t last_row, int q_head)>;
  void set_outside_lse(OutsideLse outside_lse) { outside_lse_ = std::move(outside_lse); }
  // Where Build finds its queries' exact top-K over the keys before the last ones it needs (the
  // seeds' and auto_tau's: C + 256 queries against nearly the whole prompt, most of a long
  // prompt's build): CpuBatchTopK unless set, the GPU's (cuBLAS) where the layer has one.
  void set_batch_topk(BatchTopKFunction batch_topk) {
    batch_topk_ = batch_topk != nullptr ? std::move(batch_topk) : BatchTopKFunction(CpuBatchTopK);
  }

  // The view's token count at the end of the prompt, from which decode steps count (the
  // refresh_interval's): Build's view's. For a selector over part of the history (the tiered
  // bulk, which grows only once the static set is full), after Build: the prompt's tokens less
  // those outside the view (negative for a prompt shorter than the static set), so that the
  // n-th decode step is counted n however long the view was then.
  void set_prompt_tokens(int64_t tokens) { prompt_tokens_ = tokens; }

  // The state of query head q_head, for tests and diagnostics.
  const ReTopKHead& head(int q_head) const { return heads_[q_head]; }
  int64_t prompt_tokens() const { return prompt_tokens_; }

 private:
  LayerShape shape_;
  int top_k_;
  ReTopKParams params_;
  int64_t query_lead_ = 0;
  int64_t prompt_tokens_ = 0;
  std::vector<ReTopKHead> heads_;
  std::unique_ptr<SupportSelector> exact_search_;  // null: the flat scan
  OutsideLse outside_lse_;                         // Build only; may be empty
  BatchTopKFunction batch_topk_ = CpuBatchTopK;    // Build only
};

}  // namespace kvrecall

#endif  // KVRECALL_INDEX_RETOPK_H_
