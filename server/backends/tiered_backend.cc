#include "server/backends/tiered_backend.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <mutex>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "index/basic_selectors.h"
#include "index/index_selector.h"
#include "index/retopk.h"
#include "index/shortlist_selector.h"
#include "kernels/attention_state.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/thread_pool.h"
#include "proto/tensor_codec.h"
#include "server/backends/codes_learning.h"
#include "server/backends/cpu_backend.h"
#include "server/backends/selector_charge.h"
#include "server/backends/deferred_append.h"
#include "server/backends/step_runs.h"
#include "server/kv_growth.h"
#include "server/kv_store.h"

namespace kvrecall {
namespace {

// The bulk as a view of its own, positions relative to `sinks`: what the flat and ReTopK bulk
// selectors see (the graph index takes the whole history and knows its bulk itself).
// The bytes of a tiered layer's per-step lists.
template <typename... Lists>
int64_t StepListBytes(const Lists&... lists) {
  return static_cast<int64_t>(sizeof(int32_t) * (lists.capacity() + ...));
}

// The most a tiered layer's per-step lists take with `config` (its constructor's sizes).
int64_t StepListBytesBound(const LayerConfig& config) {
  const int64_t heads = config.shape.q_heads;
  return static_cast<int64_t>(sizeof(int32_t)) * heads *
         (int64_t{config.selector.shortlist} + 2 + config.selector.top_k + 1);
}

KvView BulkView(const KvView& all, const SelectorParams& p) {
  return all.Tokens(std::min<int64_t>(p.sinks, all.tokens),
                    BulkTokens(all.tokens, p.sinks, p.recent));
}

// The log-sum-exp of query head h's scaled scores for q [head_dim] over the static set of the
// step whose bulk view ends at row last_bulk_row (the sinks and the ring of a history of
// last_bulk_row + sinks + recent + 1 tokens of `all`): ReTopK's calibration counts it as kept.
float BulkQueryStaticSetLse(const LayerConfig& config, const KvView& all,
                            int64_t last_bulk_row, const float* q, int h) {
  const LayerShape& shape = config.shape;
  const SelectorParams& p = config.selector;
  return StaticSetLse(q, all, KvHeadOf(h, shape.q_heads, shape.kv_heads), shape.scale,
                      last_bulk_row + p.sinks + p.recent + 1, p.sinks, p.recent);
}

// What the graph index of ReTopK's exact path is built with: the policy's graph knobs over the
// bulk view, which has no static set of its own (the view is the bulk).
SelectorParams ExactPathGraphParams(const SelectorParams& p) {
  SelectorParams graph = p;
  graph.kind = SelectorKind::kIndex;
  graph.sinks = 0;
  graph.recent = 0;
  return graph;
}

// The selector over the bulk for `config`, and whether its positions are relative to the bulk
// (true) or token positions (the graph index). Streaming has none: the static set is all. With
// policy.index.shortlist, `shortlist` is the exact path's selector (the selector itself for
// index, ReTopK's exact search for retopk), which each step's shortlists are handed to.
struct BulkSelector {
  std::unique_ptr<SupportSelector> selector;
  bool relative = true;
  ShortlistSelector* shortlist = nullptr;
};

absl::StatusOr<BulkSelector> MakeBulkSelector(const LayerConfig& config,
                                              const BatchTopKFunction& batch_topk) {
  const SelectorParams& p = config.selector;
  // Where a build's exact top-K lists come from: the tier's device (cuBLAS), or the host's.
  const BatchTopKFunction build_topk =
      batch_topk != nullptr ? batch_topk : BatchTopKFunction(CpuBatchTopK);
  switch (p.kind) {
    case SelectorKind::kStreaming:
      return BulkSelector{};
    case SelectorKind::kFull:
      return BulkSelector{std::make_unique<FullSelector>(), true};
    case SelectorKind::kExactTopK:
      return BulkSelector{std::make_unique<ExactTopKSelector>(config.shape, p.top_k), true};
    case SelectorKind::kReTopK: {
      // Bulk row r is token sinks + r; the prompt queries it is built from are offset so that
      // query r is the one of token sinks + recent + r, which sees bulk rows [0, r + recent].
      auto retopk = std::make_unique<ReTopKSelector>(config.shape, p.top_k, p.retopk, p.recent);
      // Its build's exact top-K (seeds, auto_tau).
      retopk->set_batch_topk(build_topk);
      if (p.shortlist > 0) {
        auto shortlist = std::make_unique<ShortlistSelector>(config.shape, p.top_k);
        ShortlistSelector* exact = shortlist.get();
        retopk->set_exact_search(std::move(shortlist));
        return BulkSelector{std::move(retopk), true, exact};
      }
      if (!p.retopk.exact_flat_scan) {
        // The exact path searches a graph index over the bulk view.
        // Its Build hands the graph the queries it is given: query r saw bulk rows [0, r + recent].
        retopk->set_exact_search(std::make_unique<IndexSelector>(
            config.shape, ExactPathGraphParams(p), /*bulk_only=*/true, build_topk, p.recent));
      }
      return BulkSelector{std::move(retopk), true};
    }
    case SelectorKind::kIndex:
      if (p.shortlist > 0) {
        auto shortlist = std::make_unique<ShortlistSelector>(config.shape, p.top_k);
        ShortlistSelector* exact = shortlist.get();
        return BulkSelector{std::move(shortlist), true, exact};
      }
      return BulkSelector{
          std::make_unique<IndexSelector>(config.shape, p, /*bulk_only=*/true, build_topk), false};
  }
  return absl::InvalidArgumentError("policy.selector: unknown selector");
}

class TieredLayer final : public LayerBackend {
 public:
  // device_exact_bound: the most query heads whose exact paths the static tier may run in a
  // step (the layer's host KV is pinned for it); 0: none. balance: the count moves within it by
  // time from half the heads (DeviceHeadBalance), else it is the bound.
  // With policy.index.shortlist the codes (null: the prompt had no bulk) are learned again on
  // `tier`, charged to `accounts`, as the bulk grows (CodesLearning), each learning's outcome
  // counted in `learnings`.
  TieredLayer(const LayerConfig& config, StaticSetTier* tier, const SessionAccounts& accounts,
              LayerKvStore kv, BulkSelector bulk, std::unique_ptr<StaticSet> static_set,
              std::unique_ptr<BulkCodes> codes, int device_exact_bound, bool balance,
              CodesLearningTally* learnings)
      : config_(config),
        device_exact_bound_(device_exact_bound),
        balance_(device_exact_bound,
                 balance ? config.shape.q_heads / 2 : device_exact_bound),
        balanced_(balance),
        selector_charge_(accounts.host),
        kv_(std::move(kv)),
        bulk_(std::move(bulk)),
        retopk_(config.selector.kind == SelectorKind::kReTopK
                    ? static_cast<ReTopKSelector*>(bulk_.selector.get())
                    : nullptr),
        static_set_(std::move(static_set)),
        codes_(std::move(codes)),
        on_device_(config.shape.q_heads, 0),
        decided_paths_(config.shape.q_heads),
        decided_best_(config.shape.q_heads),
        selections_(config.shape.q_heads),
        bulk_micros_(config.shape.q_heads),
        bulk_start_micros_(config.shape.q_heads),
        appended_(bulk_.selector.get()) {
    bulk_tokens_seen_ = BulkTokens(kv_.tokens(), config.selector.sinks, config.selector.recent);
    // A prompt that (nearly) filled its store has it grown before the first step needs it.
    growth_ahead_.AfterCommit(kv_, config_.tokens_to_hold());
    if (config.selector.shortlist > 0) {
      learning_ = std::make_unique<CodesLearning>(
          tier, &config_, accounts, codes_ != nullptr ? codes_->learned_rows() : 0,
          CodesLearningQueue(), learnings);
      // The steps' shortlists and the tier's exact heads' results, allocated (and charged with
      // the selector's state) once here rather than at the first step, uncharged: a shortlist
      // of 2^20 takes 4 MiB a query head whatever the context (and codes may come later).
      const size_t heads = config.shape.q_heads;
      shortlist_ids_.resize(heads * config.selector.shortlist);
      shortlist_sizes_.resize(heads);
      device_candidates_.resize(heads);
      if (retopk_ != nullptr && device_exact_bound_ > 0) {
        device_support_.resize(heads * config.selector.top_k);
        device_support_sizes_.resize(heads);
      }
    }
    // A step may fail after its host heads selected (the tier's Finish): their cache entries
    // wait for EndBulk, so that a failed step, resent, does not find its own query cached.
    if (retopk_ != nullptr) retopk_->set_defer_pushes(true);
    selector_charge_.Set(SelectorBytes());  // built: reserved by the Prefill
  }
  ~TieredLayer() override {
    growth_ahead_.Finish(kv_);  // it maps the KV's pages, and charged the host account
    learning_.reset();  // a learning in flight reads the KV and charges the accounts
    appended_.Wait();
  }

  int64_t tokens() const override { return kv_.tokens(); }
  // The static set has a slot for every token it will ever hold; the host store grows, ahead of
  // need off the step where it can (KvGrowthAhead: here its growth is taken), else here (which
  // may move the rows a deferred OnAppend reads: it finishes first), and so do the codes of the
  // bulk when the token pushes one out of the ring. Codes learned again take over first, at
  // their length (which a learning in flight waits for, as it does for rows about to move: a
  // growth within the store's reserved address space moves none).
  absl::Status ReserveToken() override {
    appended_.Wait();
    // What the previous step's OnAppend grew the selector by is charged (SelectorCharge).
    if (absl::Status s = selector_charge_.ReserveStep(SelectorBytes()); !s.ok()) return s;
    growth_ahead_.BeforeReserve(kv_, 1);
    if (learning_ != nullptr) {
      learning_->BeforeReserve(BulkView(kv_.view(), config_.selector),
                               kv_.tokens() + 1 > kv_.tokens_in_place(), &codes_);
    }
    if (codes_ != nullptr) {
      const SelectorParams& p = config_.selector;
      if (absl::Status s = codes_->Reserve(BulkTokens(kv_.tokens() + 1, p.sinks, p.recent));
          !s.ok()) {
        return s;
      }
    }
    return kv_.Reserve(1, "the new token");
  }
  LayerMemory memory() const override {
    const int64_t codes_host = codes_ != nullptr ? codes_->host_bytes() : 0;
    const int64_t codes_device = codes_ != nullptr ? codes_->device_bytes() : 0;
    const int64_t selector = selector_charge_.charged();
    return LayerMemory{kv_.allocated_bytes() + selector + codes_host,
                       static_set_->device_bytes() + codes_device,
                       selector + codes_host + codes_device};
  }

  const BulkCodes* bulk_codes() const override { return codes_.get(); }

  const LayerConfig& config() const { return config_; }
  const LayerKvStore& kv() const { return kv_; }

  // The most query heads whose exact paths the tier may run in `step`: the layer's bound,
  // unless the step wants each head's support reported (the tier reports none) or its store
  // lost its pin. The tier has the last word (StaticSetTier::ServesExactHeads).
  int DeviceExactHeadsFor(const LayerStep& step) const {
    if (codes_ == nullptr || step.supports != nullptr || !kv_.pinned()) return 0;
    return device_exact_bound_;
  }
  const BulkCodes* codes() const { return codes_.get(); }
  // The static tier's part of a step on `all` (the history with the step's token), the
  // shortlist's fields included when the layer has codes, and room for up to `device_bound`
  // query heads' exact paths on the tier, their bulk states to bulk_o [q_heads, head_dim] and
  // bulk_lse [q_heads] (the step's bulk states). Which heads those are is chosen once the tier's
  // step is launched (DecidePath, ChooseDeviceHeads).
  StaticSetStep StaticStep(const LayerStep& step, const KvView& all, int device_bound,
                           float* bulk_o, float* bulk_lse) {
    StaticSetStep out{&config_, static_set_.get(), all, step.q, step.k_new, step.v_new, step.o,
                      step.lse};
    for (int32_t h : device_heads_) on_device_[h] = 0;
    device_heads_.clear();
    device_bound_ = codes_ != nullptr ? std::max(0, device_bound) : 0;
    // A retopk layer that may give the tier heads decides every head's path first.
    decided_ = retopk_ != nullptr && device_bound_ > 0 &&
               BulkView(all, config_.selector).tokens > 0;
    if (codes_ != nullptr) {
      const int n = config_.selector.shortlist;
      out.codes = codes_.get();
      out.bulk = BulkView(all, config_.selector);
      out.shortlist = n;
      out.shortlist_ids = shortlist_ids_.data();
      out.shortlist_sizes = shortlist_sizes_.data();
      out.shortlist_coded = &shortlist_coded_;
      out.device_exact_bound = device_bound_;
      out.bulk_o = bulk_o;
      out.bulk_lse = bulk_lse;
      out.bulk_candidates = device_candidates_.data();
      if (decided_) {
        // ReTopK's caches take the supports of the heads the tier runs (sized at construction:
        // a layer decides only with device_exact_bound_ > 0).
        out.bulk_support = device_support_.data();
        out.bulk_support_sizes = device_support_sizes_.data();
      }
    }
    return out;
  }
  // Whether this step decides every head's path before its heads run (ReTopK giving the tier
  // its exact-path heads): then DecidePath for each head, before ChooseDeviceHeads.
  bool DecidesPaths() const { return decided_; }
  // Query head h's path this step (ReTopKSelector::Decide, the cache match: cosines with the
  // cached queries, no scoring); heads in parallel, each reading only its own cache.
  void DecidePath(const LayerStep& step, const KvView& all, int h) {
    const int d = config_.shape.head_dim;
    decided_paths_[h] = retopk_->Decide(h, step.q + int64_t{h} * d,
                                        BulkView(all, config_.selector).tokens, &decided_best_[h]);
  }
  // The step's heads for the tier into `out` (its StaticStep), as many as the balance's count
  // within the step's bound: an index layer's last ones; a decided retopk layer's last heads on
  // the exact path (fallback, refresh), so that the host's threads keep the reuse heads (whose
  // candidates are the host's caches).
  void ChooseDeviceHeads(StaticSetStep* out) {
    const int heads = config_.shape.q_heads;
    const int count = std::min(device_bound_, balance_.target());
    if (count > 0 && retopk_ == nullptr) {
      for (int h = heads - count; h < heads; ++h) device_heads_.push_back(h);
    } else if (count > 0 && decided_) {
      for (int h = heads - 1; h >= 0 && static_cast<int>(device_heads_.size()) < count; --h) {
        if (decided_paths_[h] != SelectionPath::kReuse) device_heads_.push_back(h);
      }
      std::reverse(device_heads_.begin(), device_heads_.end());
    }
    for (int32_t h : device_heads_) on_device_[h] = 1;
    out->device_heads = device_heads_.data();
    out->device_exact_heads = static_cast<int>(device_heads_.size());
  }
  // Whether query head h's bulk runs on the host this step (not on the tier).
  bool OnHost(int h) const { return on_device_[h] == 0; }
  // After a step that gave the tier up to a bound of heads: moves the count the next one gives
  // (when balanced), from the step's times (this layer's device heads filled in here).
  void BalanceDeviceHeads(DeviceHeadBalance::StepTimes times) {
    if (!balanced_) return;
    times.device_heads = static_cast<int>(device_heads_.size());
    balance_.Update(times);
  }
  // While a step's shortlists are in flight: the exact path calls `fetch` before it reads them
  // (null: they are not, or no longer).
  void SetShortlistFetch(const std::function<void()>* fetch) {
    if (codes_ != nullptr) bulk_.shortlist->set_fetch(fetch);
  }
  // Whether query head h is expected to read its shortlist this step: the layer has codes and
  // the head is not on ReTopK's reuse path, which needs none (decided this step, or else as in
  // its last).
  bool ExpectsShortlist(int h) const {
    if (codes_ == nullptr) return false;
    return (decided_ ? decided_paths_[h] : selections_[h].path) != SelectionPath::kReuse;
  }
  // Hands the shortlists WaitShortlists left in this layer's buffers to the exact path.
  void TakeShortlists() {
    if (codes_ == nullptr) return;
    const int n = config_.selector.shortlist;
    const LayerShape& shape = config_.shape;
    for (int h = 0; h < shape.q_heads; ++h) {
      bulk_.shortlist->SetShortlist(
          h, std::span<const int32_t>(shortlist_ids_.data() + int64_t{h} * n, shortlist_sizes_[h]),
          shortlist_coded_);
    }
  }
  // Before the step's heads (one thread): hands the exact path the outliers, and plans their
  // scoring ahead of the shortlists for the heads expected to read one. Returns whether any
  // head is planned: then the step's loop runs ScoreOutliers for each chunk OutlierChunks
  // counts.
  bool PlanOutliers(const LayerStep& step) {
    if (codes_ == nullptr) return false;
    const LayerShape& shape = config_.shape;
    for (int g = 0; g < shape.kv_heads; ++g) bulk_.shortlist->SetOutliers(g, codes_->outliers(g));
    bool any = false;
    bulk_.shortlist->PlanOutlierScores(step.q, [&](int h) {
      const bool expected = ExpectsShortlist(h) && OnHost(h);
      any |= expected;
      return expected;
    });
    return any;
  }
  int OutlierChunks(int kv_head) const { return bulk_.shortlist->OutlierChunks(kv_head); }
  // A chunk of KV head `kv_head`'s outliers scored for the planned heads of its group: they
  // need no shortlist, so the step's loop runs these first, while the shortlists are in flight.
  void ScoreOutliers(const KvView& all, int kv_head, int chunk) {
    bulk_.shortlist->ScoreOutliers(kv_head, chunk, BulkView(all, config_.selector));
  }

  // Writes the step's token into the reserved host row (not committed yet) and returns the
  // history including it.
  KvView StageToken(const LayerStep& step) {
    kv_.StageToken(step.k_new, step.v_new);
    KvView all = kv_.view();
    all.tokens += 1;
    return all;
  }
  // Commits the staged token; the bulk token it pushed out of the ring (if any) is absorbed by
  // the selector after the step, off the decode path, when that is costly (deferred_append.h).
  void CommitToken();

  // The bulk's part of a step, in three calls so that a batch's heads share one parallel loop:
  // BeginBulk waits for the previous step's deferred OnAppend (the seconds go to *waited) and
  // returns the multiply-adds the heads are expected to take; AttendBulkHead selects query head
  // h's bulk support and attends it ((o, lse) over the bulk; heads in parallel); EndBulk, once
  // the step can no longer fail, writes the step's reports (support sizes and supports include
  // the static set) and gives ReTopK's caches the step's supports.
  int64_t BeginBulk(const KvView& all, double* waited);
  // `bulk_start`: when the step's bulk began (each head reports its start from it).
  void AttendBulkHead(const LayerStep& step, const KvView& all, int h,
                      std::chrono::steady_clock::time_point bulk_start, float* o, float* lse);
  void EndBulk(const LayerStep& step, const KvView& all);
  // Microseconds query head h's bulk took in the layer's last step (0 before the first).
  float last_bulk_micros(int h) const { return bulk_micros_[h]; }

 private:
  // The selector's state and the steps' shortlist buffers, as host memory the layer holds.
  int64_t SelectorBytes() const {
    return (bulk_.selector != nullptr ? bulk_.selector->MemoryBytes() : 0) +
           StepListBytes(shortlist_ids_, shortlist_sizes_, device_candidates_, device_support_,
                         device_support_sizes_);
  }

  const LayerConfig config_;
  const int device_exact_bound_;
  int device_bound_ = 0;        // the step's bound of heads on the tier (StaticStep's)
  DeviceHeadBalance balance_;  // the count of heads the tier takes, within device_exact_bound_
  const bool balanced_;
  SelectorCharge selector_charge_;  // the selector's state and step lists, the host's account
  LayerKvStore kv_;
  KvGrowthAhead growth_ahead_{KvGrowthQueue()};  // kv_'s, off the steps
  BulkSelector bulk_;
  ReTopKSelector* const retopk_;  // bulk_'s selector when it is ReTopK, else null
  // The step's heads on the tier (ascending) and, per query head, whether it is one of them;
  // whether a retopk layer decides every head's path before its heads run (then each head's path
  // and best cosine); the tier's exact heads' candidates [q_heads] and, decided, supports
  // [q_heads, top_k] and their sizes [q_heads].
  std::vector<int32_t> device_heads_;
  std::vector<uint8_t> on_device_;
  bool decided_ = false;
  std::vector<SelectionPath> decided_paths_;
  std::vector<float> decided_best_;
  std::vector<int32_t> device_candidates_, device_support_, device_support_sizes_;
  std::unique_ptr<StaticSet> static_set_;
  std::unique_ptr<BulkCodes> codes_;  // null without policy.index.shortlist (or a bulk yet)
  std::unique_ptr<CodesLearning> learning_;  // with policy.index.shortlist
  std::vector<int32_t> shortlist_ids_, shortlist_sizes_;  // the step's, [q_heads, shortlist]
  int64_t shortlist_coded_ = 0;                           // the bulk rows they were chosen among
  int64_t bulk_tokens_seen_ = 0;  // the bulk's length at the selector's last OnAppend or Build
  std::vector<HeadSelection> selections_;  // per query head, reused across steps
  std::vector<float> bulk_micros_;          // per query head, the last step's
  std::vector<float> bulk_start_micros_;    // per query head, the last step's
  int64_t last_scored_tokens_ = -1;
  // Last: destroyed first, so that a pending OnAppend finishes while the selector and KV exist.
  DeferredAppend appended_;
};

void TieredLayer::CommitToken() {
  kv_.Commit(1);
  growth_ahead_.AfterCommit(kv_, config_.tokens_to_hold());
  const KvView all = kv_.view();
  const KvView bulk = BulkView(all, config_.selector);
  if (learning_ != nullptr) learning_->OnCommitted(bulk);
  if (bulk_.selector == nullptr) return;
  if (bulk.tokens > bulk_tokens_seen_) {
    appended_.Queue(bulk_.relative ? bulk : all);
    bulk_tokens_seen_ = bulk.tokens;
  }
}

int64_t TieredLayer::BeginBulk(const KvView& all, double* waited) {
  const SelectorParams& p = config_.selector;
  const KvView bulk = BulkView(all, p);
  appended_.Wait();
  *waited = appended_.waited_seconds();
  // (What the last OnAppend grew the selector by was charged by ReserveToken.)
  const int heads = config_.shape.q_heads;
  const int64_t predicted = last_scored_tokens_ >= 0 ? last_scored_tokens_
                                                     : static_cast<int64_t>(heads) * bulk.tokens;
  return (predicted + int64_t{heads} * p.top_k) * config_.shape.head_dim;
}

void TieredLayer::AttendBulkHead(const LayerStep& step, const KvView& all, int h,
                                 std::chrono::steady_clock::time_point bulk_start, float* o,
                                 float* lse) {
  const LayerShape& shape = config_.shape;
  const SelectorParams& p = config_.selector;
  const int d = shape.head_dim;
  const KvView bulk = BulkView(all, p);
  const auto start = std::chrono::steady_clock::now();
  HeadSelection& selection = selections_[h];
  selection.support.clear();
  selection.support_scores.clear();
  selection.path = SelectionPath::kExact;
  selection.candidates = 0;
  selection.best_cosine = 0.0f;
  const float* qh = step.q + static_cast<int64_t>(h) * d;
  if (bulk_.selector != nullptr && bulk.tokens > 0) {
    if (decided_) {
      retopk_->SelectDecided(h, qh, bulk, &selection);  // ReTopK's bulk is relative
    } else {
      bulk_.selector->Select(h, qh, bulk_.relative ? bulk : all, &selection);
    }
    if (const int64_t offset = bulk_.relative ? std::min<int64_t>(p.sinks, all.tokens) : 0;
        offset != 0) {
      for (int32_t& id : selection.support) id += static_cast<int32_t>(offset);
    }
  }
  const int kv_head = KvHeadOf(h, shape.q_heads, shape.kv_heads);
  float* oh = o + static_cast<int64_t>(h) * d;
  if (!selection.support.empty() &&
      selection.support_scores.size() == selection.support.size()) {
    // Scored on the way (ReTopK's candidates, the graph search): the same state, unscored again.
    cpu::PartialAttentionScored(selection.support_scores, all, kv_head, selection.support, oh,
                                &lse[h]);
  } else {
    cpu::PartialAttention(qh, all, kv_head, selection.support, shape.scale, oh, &lse[h]);
  }
  using Micros = std::chrono::duration<float, std::micro>;
  bulk_micros_[h] = Micros(std::chrono::steady_clock::now() - start).count();
  bulk_start_micros_[h] = Micros(start - bulk_start).count();
}

void TieredLayer::EndBulk(const LayerStep& step, const KvView& all) {
  const SelectorParams& p = config_.selector;
  const int64_t static_size = all.tokens - BulkView(all, p).tokens;
  last_scored_tokens_ = 0;
  for (int h = 0; h < config_.shape.q_heads; ++h) {
    HeadSelection& selection = selections_[h];
    if (!OnHost(h)) {
      // The tier's exact path: its candidates, its top K (a step that asks for supports gives
      // the tier no heads), no host time. ReTopK's cache takes the support it came back with.
      selection.candidates = device_candidates_[h];
      selection.support.clear();
      selection.support_scores.clear();
      int64_t support_size = std::min(selection.candidates, p.top_k);
      if (decided_) {
        selection.path = decided_paths_[h];
        selection.best_cosine = decided_best_[h];
        support_size = device_support_sizes_[h];
        retopk_->CompleteDecided(
            h, std::span<const int32_t>(device_support_.data() + int64_t{h} * p.top_k,
                                        static_cast<size_t>(support_size)));
      } else {
        selection.path = SelectionPath::kExact;
        selection.best_cosine = 0.0f;
      }
      // (bulk_micros_ keeps the head's last host time: the loop's order estimates a head's
      // cost by it when the head is on the host again.)
      last_scored_tokens_ += selection.candidates;
      step.heads[h] = HeadReport{selection.path, selection.candidates,
                                 static_cast<int32_t>(support_size + static_size),
                                 selection.best_cosine, 0.0f, 0.0f};
      continue;
    }
    if (retopk_ != nullptr) retopk_->PushPending(h);  // the step succeeded
    last_scored_tokens_ += selection.candidates;
    step.heads[h] = HeadReport{selection.path, selection.candidates,
                               static_cast<int32_t>(selection.support.size() + static_size),
                               selection.best_cosine, bulk_micros_[h], bulk_start_micros_[h]};
    if (step.supports != nullptr) {
      std::vector<int32_t>& support = step.supports[h];
      support.assign(selection.support.begin(), selection.support.end());
      AppendStaticSet(all.tokens, p.sinks, p.recent, &support);
    }
  }
  selector_charge_.Update(SelectorBytes());
}

// Whether two layers' static sets step in one launch: the same shapes, dtype, static set and
// shortlist size, and with a shortlist the same top_k (the tier's exact heads take one K a
// launch).
bool SameStaticSet(const LayerConfig& a, const LayerConfig& b) {
  return a.shape.q_heads == b.shape.q_heads && a.shape.kv_heads == b.shape.kv_heads &&
         a.shape.head_dim == b.shape.head_dim && a.shape.scale == b.shape.scale &&
         a.dtype == b.dtype && a.selector.sinks == b.selector.sinks &&
         a.selector.recent == b.selector.recent && a.selector.shortlist == b.selector.shortlist &&
         (a.selector.shortlist == 0 || a.selector.top_k == b.selector.top_k);
}

}  // namespace

absl::Status CheckExactHeads(std::span<const StaticSetStep> steps) {
  for (const StaticSetStep& step : steps) {
    const int q_heads = step.config->shape.q_heads;
    const int heads = step.device_exact_heads;
    const int bound = step.codes != nullptr ? std::max(0, step.device_exact_bound) : 0;
    if (heads < 0 || heads > bound) {
      return absl::InternalError(absl::StrCat("a step gives the device ", heads,
                                              " exact heads over its bound of ", bound));
    }
    for (int j = 0; j < heads; ++j) {
      if (step.device_heads[j] < 0 || step.device_heads[j] >= q_heads) {
        return absl::InternalError(absl::StrCat("a step gives the device query head ",
                                                step.device_heads[j], " of ", q_heads));
      }
    }
  }
  return absl::OkStatus();
}

// A Decode stream's resources: the static tier's, and the bulk states of the largest batch.
class TieredStepContext final : public StepContext {
 public:
  // A chunk of a KV group's outliers, scored ahead of the shortlists (one loop item).
  struct OutlierChunk {
    int32_t sequence, kv_head, chunk;
  };

  explicit TieredStepContext(std::unique_ptr<StepContext> static_context)
      : static_context(std::move(static_context)) {}
  std::unique_ptr<StepContext> static_context;
  // Reused from step to step, so that the steady state allocates nothing.
  StepRuns runs;
  std::vector<float> bulk_o, bulk_lse;
  std::vector<StaticSetStep> static_steps;
  std::vector<KvView> histories;
  std::vector<int64_t> order;  // the loop's items: outlier chunks, then heads longest first
  std::vector<OutlierChunk> outlier_chunks;  // of the planned layers
  std::vector<int64_t> decide_items;         // (sequence, head) pairs whose paths are decided
};

int64_t TieredBackend::HostKvBytesFor(const LayerConfig& config, int64_t tokens) const {
  return LayerKvStore::BytesFor(tokens, config.shape.kv_heads, config.shape.head_dim,
                                KvElementOf(config.dtype));
}

int64_t TieredBackend::PromptQueriesNeeded(const LayerConfig& config, int64_t tokens) const {
  const SelectorParams& p = config.selector;
  if (p.shortlist > 0) {
    // No graph: ReTopK's seeds alone; the shortlist's codes are learned from the keys.
    return p.kind == SelectorKind::kReTopK ? kvrecall::PromptQueriesNeeded(p, tokens) : 0;
  }
  if (p.kind == SelectorKind::kReTopK && !p.retopk.exact_flat_scan) return tokens;
  return kvrecall::PromptQueriesNeeded(p, tokens);
}

int64_t TieredBackend::DeviceBytesFor(const LayerConfig& config, int64_t tokens) const {
  int64_t bytes = tier_->DeviceBytesFor(config);
  const SelectorParams& p = config.selector;
  if (p.shortlist > 0 && tier_->device_budget() != nullptr) {
    bytes += BulkCodes::CodeBytesFor(config, BulkTokens(tokens, p.sinks, p.recent)) +
             BulkCodes::CodebookBytesFor(config);
  }
  return bytes;
}

int64_t TieredBackend::HostSelectorBytesBound(const LayerConfig& config, int64_t tokens,
                                              int build_threads) const {
  const SelectorParams& p = config.selector;
  // The bulk selectors hold what the CPU placement's do (the graph index reads the whole
  // history and knows its bulk), and ReTopK's exact path its graph over the bulk.
  if (p.shortlist > 0) {
    // No graph: ReTopK's caches (index: nothing), the quantizers, and on the host tier the codes.
    int64_t bytes = p.kind == SelectorKind::kReTopK
                        ? SelectorStateBytesBound(p, config.shape, tokens, build_threads)
                        : 0;
    bytes += BulkCodes::CodebookBytesFor(config) + StepListBytesBound(config);
    if (tier_->device_budget() == nullptr) {
      bytes += BulkCodes::CodeBytesFor(config, BulkTokens(tokens, p.sinks, p.recent));
    }
    return bytes;
  }
  int64_t bytes = SelectorStateBytesBound(p, config.shape, tokens, build_threads);
  if (p.kind == SelectorKind::kReTopK && !p.retopk.exact_flat_scan) {
    bytes += SelectorStateBytesBound(ExactPathGraphParams(p), config.shape,
                                     BulkTokens(tokens, p.sinks, p.recent), build_threads);
  }
  return bytes;
}

absl::Status TieredBackend::CheckConfig(const LayerConfig& config) const {
  const SelectorParams& p = config.selector;
  if (p.recent < 1) {
    return absl::InvalidArgumentError(
        "policy.recent must be >= 1 in PLACEMENT_TIERED: the static set's ring holds the newest "
        "token");
  }
  if (absl::Status s = tier_->CheckConfig(config); !s.ok()) return s;
  if (p.shortlist > 0) {
    if (absl::Status s = BulkCodes::CheckConfig(config); !s.ok()) return s;
  }
  // Making the selector surfaces knobs this build cannot serve; nothing is allocated before
  // Build.
  return MakeBulkSelector(config, nullptr).status();
}

absl::StatusOr<std::unique_ptr<PromptStaging>> TieredBackend::NewPromptStaging(
    const LayerConfig& config, const SessionAccounts& accounts) {
  // The host keeps the complete KV in the session's dtype (bf16 / f16: half of f32's bytes, and
  // half the bytes the CPU reads per scored key).
  return HostPromptStaging::Create(config, accounts.host, KvElementOf(config.dtype),
                                   KeptPromptQueries(*this, config));
}

absl::StatusOr<std::unique_ptr<LayerBackend>> TieredBackend::BuildLayer(
    const LayerConfig& config, const SessionAccounts& accounts,
    std::unique_ptr<PromptStaging> prompt, const BuildStop& stop) {
  auto& staged = static_cast<HostPromptStaging&>(*prompt);
  const SelectorParams& p = config.selector;
  const KvView all = staged.kv.view();
  absl::StatusOr<BulkSelector> bulk = MakeBulkSelector(config, tier_->batch_topk());
  if (!bulk.ok()) return bulk.status();
  if (bulk->selector != nullptr) {
    const int64_t q_row = int64_t{config.shape.q_heads} * config.shape.head_dim;
    absl::Status built;
    if (bulk->relative) {
      // Query of bulk row r: the prompt's query of token sinks + recent + r (see above).
      const KvView view = BulkView(all, p);
      const PromptQueries prompt_queries = staged.prompt_queries();
      const PromptQueries queries = view.tokens > 0
                                        ? prompt_queries.Shifted(int64_t{p.sinks} + p.recent, q_row)
                                        : PromptQueries();
      auto* retopk = p.kind == SelectorKind::kReTopK
                         ? static_cast<ReTopKSelector*>(bulk->selector.get())
                         : nullptr;
      if (retopk != nullptr) {
        // auto_tau calibrates on the whole attention: what the static set of a prompt query
        // would have held at its decode step (the sinks and its own last `recent` tokens)
        // counts as kept.
        retopk->set_outside_lse([&all, &config](const float* q, int64_t last_row, int h) {
          return BulkQueryStaticSetLse(config, all, last_row, q, h);
        });
      }
      built = bulk->selector->BuildUnless(stop, view, queries);
      if (retopk != nullptr) {
        retopk->set_outside_lse(nullptr);
        // Decode step n holds prompt + n tokens, the bulk all but the static set's once full.
        retopk->set_prompt_tokens(all.tokens - p.sinks - p.recent);
      }
    } else {
      built = bulk->selector->BuildUnless(stop, all, staged.prompt_queries());
    }
    if (!built.ok()) return built;
  }
  if (absl::Status s = stop.Check("the tiered layer's build"); !s.ok()) return s;
  absl::StatusOr<std::unique_ptr<StaticSet>> static_set =
      tier_->Build(config, accounts.device, all);
  if (!static_set.ok()) return static_set.status();
  std::unique_ptr<BulkCodes> codes;
  if (p.shortlist > 0) {
    // The quantizers learn from the prompt's bulk; a prompt with too short a bulk is served by
    // the shortlist selector's scan of the bulk instead, until the bulk has grown enough to
    // learn from (CodesLearning).
    const KvView bulk = BulkView(all, p);
    if (bulk.tokens >= CodesLearning::kMinLearnRows) {
      const int64_t capacity = BulkTokens(std::max(config.expected_tokens, all.tokens + 1),
                                          p.sinks, p.recent);
      absl::StatusOr<std::unique_ptr<BulkCodes>> built =
          tier_->BuildCodes(config, accounts, bulk, capacity, stop);
      if (!built.ok()) return built.status();
      codes = *std::move(built);
    }
  }
  if (config.expected_tokens > staged.kv.tokens()) {
    if (absl::Status s = staged.kv.Reserve(config.expected_tokens - staged.kv.tokens(),
                                           "the announced max_tokens");
        !s.ok()) {
      return s;
    }
    // The bulk selector's state too (in its view: ReTopK's graph over the bulk rows).
    if (bulk->selector != nullptr) {
      bulk->selector->ReserveTokens(
          bulk->relative ? BulkTokens(config.expected_tokens, p.sinks, p.recent)
                         : config.expected_tokens);
    }
  }
  // The tier reads the host KV of the heads it takes: pinned once it has its room for
  // max_tokens (a growth pins the new allocation again). Without the pin the host takes them.
  int device_heads = DeviceExactHeads(config);  // once the layer has codes (maybe later)
  if (device_heads > 0 && !staged.kv.SetPinning(tier_->host_pinning())) {
    staged.kv.SetPinning(nullptr);
    device_heads = 0;
    static std::once_flag said;
    std::call_once(said, [] {
      std::fprintf(stderr,
                   "kvrecalld: a tiered layer's host KV could not be pinned for its device: its "
                   "exact heads run on the host\n");
    });
  }
  return std::make_unique<TieredLayer>(config, tier_.get(), accounts, std::move(staged.kv),
                                       *std::move(bulk), *std::move(static_set),
                                       std::move(codes), device_heads, device_exact_balance_,
                                       &codes_learnings_);
}

int TieredBackend::DeviceExactHeads(const LayerConfig& config) const {
  const SelectorParams& p = config.selector;
  if (device_exact_share_ <= 0 ||
      (p.kind != SelectorKind::kIndex && p.kind != SelectorKind::kReTopK) || p.shortlist <= 0 ||
      tier_->host_pinning() == nullptr) {
    return 0;
  }
  return std::clamp(static_cast<int>(device_exact_share_ * config.shape.q_heads), 0,
                    config.shape.q_heads);
}

std::unique_ptr<StepContext> TieredBackend::NewStepContext(MemoryAccount* host) {
  return std::make_unique<TieredStepContext>(tier_->NewStepContext(host));
}

absl::Status TieredBackend::Step(std::span<LayerStep> steps, StepContext* context) {
  auto& ctx = static_cast<TieredStepContext&>(*context);
  ctx.tier_seconds = StepContext::TierSeconds();
  // Runs of steps whose static sets step together (usually the whole request).
  return ForEachRun(
      steps, ctx.runs,
      [](const LayerStep& first, const LayerStep& step) {
        return SameStaticSet(static_cast<TieredLayer*>(first.layer)->config(),
                             static_cast<TieredLayer*>(step.layer)->config());
      },
      [&](std::span<LayerStep> batch) { return StepRun(batch, ctx); });
}

absl::Status TieredBackend::StepRun(std::span<LayerStep> batch, TieredStepContext& ctx) {
  const LayerConfig& first = static_cast<TieredLayer*>(batch.front().layer)->config();
  const int heads = first.shape.q_heads;
  const int d = first.shape.head_dim;
  const size_t n = batch.size();
  ctx.bulk_o.resize(n * heads * d);
  ctx.bulk_lse.resize(n * heads);
  ctx.static_steps.clear();
  ctx.histories.clear();
  bool shortlists = false;
  const auto plan_start = std::chrono::steady_clock::now();
  for (size_t i = 0; i < n; ++i) {
    const LayerStep& step = batch[i];
    auto& layer = *static_cast<TieredLayer*>(step.layer);
    ctx.histories.push_back(layer.StageToken(step));
    // The exact heads the tier takes, when it serves them with this layer's bounds.
    int device_heads = layer.DeviceExactHeadsFor(step);
    if (device_heads > 0 &&
        !tier_->ServesExactHeads(layer.config(), *layer.codes(), device_heads)) {
      device_heads = 0;
      static std::once_flag said;
      std::call_once(said, [&] {
        std::fprintf(stderr,
                     "kvrecalld: %s cannot run the exact heads of a tiered layer with shortlist "
                     "%d and top_k %d (its kernel's bounds): the host runs them\n",
                     tier_->device().c_str(), layer.config().selector.shortlist,
                     layer.config().selector.top_k);
      });
    }
    ctx.static_steps.push_back(layer.StaticStep(step, ctx.histories.back(), device_heads,
                                                ctx.bulk_o.data() + i * heads * d,
                                                ctx.bulk_lse.data() + i * heads));
    shortlists |= ctx.static_steps.back().codes != nullptr;
  }
  // The static sets on their tier while the CPU works through the bulk (after the shortlists,
  // which the bulk's exact paths wait for). What the tier needs is reserved first, so that a
  // step that cannot have it fails before a head runs.
  if (absl::Status s = tier_->Prepare(ctx.static_steps, ctx.static_context.get()); !s.ok()) {
    return s;
  }
  // The bulk's start: its time, and each head's start and the shortlists' arrival, from here.
  const auto bulk_start = std::chrono::steady_clock::now();
  auto seconds_since = [](std::chrono::steady_clock::time_point start) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  // The tier's launches, before the heads' loop wakes the compute pool: on the H200 host a
  // graph's launch took twice as long made beside the pool's threads starting on their rows
  // as alone (driver_call_bench, d40), and it is on the shortlists' path.
  if (absl::Status s = tier_->Start(ctx.static_steps, ctx.static_context.get()); !s.ok()) {
    return s;
  }
  const double launched = seconds_since(bulk_start);
  ctx.tier_seconds.launch += launched;
  ctx.tier_seconds.plan += std::chrono::duration<double>(bulk_start - plan_start).count();
  // Which exact heads the tier takes, chosen while its step uploads and runs the shortlists
  // (which its exact heads wait for on the device): ReTopK's path decisions, every (sequence,
  // head) of the batch in one parallel loop (d59-d61: ~85 us for 32 heads on one thread, ~35-45
  // in parallel (d62) on the step's path when they came before the launch).
  ctx.decide_items.clear();
  for (size_t i = 0; i < n; ++i) {
    if (!static_cast<TieredLayer*>(batch[i].layer)->DecidesPaths()) continue;
    for (int h = 0; h < heads; ++h) ctx.decide_items.push_back(static_cast<int64_t>(i) * heads + h);
  }
  if (!ctx.decide_items.empty()) {
    const auto decisions = static_cast<int64_t>(ctx.decide_items.size());
    cpu::ParallelFor(decisions, static_cast<int>(std::max<int64_t>(1, decisions / 2)),
                     [&](int64_t k) {
                       const int64_t item = ctx.decide_items[k];
                       const auto i = static_cast<size_t>(item / heads);
                       static_cast<TieredLayer*>(batch[i].layer)
                           ->DecidePath(batch[i], ctx.histories[i], static_cast<int>(item % heads));
                     });
  }
  for (size_t i = 0; i < n; ++i) {
    if (ctx.static_steps[i].device_exact_bound > 0) {
      static_cast<TieredLayer*>(batch[i].layer)->ChooseDeviceHeads(&ctx.static_steps[i]);
    }
  }
  if (absl::Status s = tier_->SetExactHeads(ctx.static_steps, ctx.static_context.get());
      !s.ok()) {
    // The step is still on the tier (with no exact heads): Finish drains it.
    tier_->Finish(ctx.static_steps, ctx.static_context.get()).IgnoreError();
    return s;
  }
  ctx.tier_seconds.decide += seconds_since(bulk_start) - launched;
  // The shortlists are waited for by the first head that reads one, once, so that the heads
  // that need none (ReTopK's reuse heads) run while they are computed.
  std::once_flag shortlists_fetched;
  absl::Status shortlisted;
  const std::function<void()> fetch_shortlists = [&] {
    std::call_once(shortlists_fetched, [&] {
      shortlisted = tier_->WaitShortlists(ctx.static_steps, ctx.static_context.get());
      if (!shortlisted.ok()) return;
      ctx.tier_seconds.shortlists_ready += seconds_since(bulk_start);
      ctx.tier_seconds.shortlist += ctx.static_context->tier_seconds.shortlist;
      for (const LayerStep& step : batch) static_cast<TieredLayer*>(step.layer)->TakeShortlists();
    });
  };
  if (shortlists) {
    for (const LayerStep& step : batch) {
      static_cast<TieredLayer*>(step.layer)->SetShortlistFetch(&fetch_shortlists);
    }
  }
  double link_wait = 0;
  int64_t work = 0;
  for (size_t i = 0; i < n; ++i) {
    double waited = 0;
    work += static_cast<TieredLayer*>(batch[i].layer)->BeginBulk(ctx.histories[i], &waited);
    link_wait += waited;
  }
  // The outliers' scores need no shortlist: an item per chunk of each KV group's outliers in
  // the layers that plan them, ahead of the heads that wait for a shortlist, so that they are
  // scored while the shortlists are in flight and the exact heads rescore only their shortlists
  // once they arrive.
  const int kv_heads = first.shape.kv_heads;
  ctx.outlier_chunks.clear();
  for (size_t i = 0; i < n; ++i) {
    auto& layer = *static_cast<TieredLayer*>(batch[i].layer);
    if (!layer.PlanOutliers(batch[i])) continue;
    for (int g = 0; g < kv_heads; ++g) {
      for (int c = 0; c < layer.OutlierChunks(g); ++c) {
        ctx.outlier_chunks.push_back({static_cast<int32_t>(i), g, c});
      }
    }
  }
  const auto chunks = static_cast<int64_t>(ctx.outlier_chunks.size());
  // Then every (sequence, head) pair of the batch one at a time: a head on an exact path (a
  // graph search) costs many reuse heads, and a sequence's step would otherwise wait for its
  // slowest head before the next sequence starts.
  const int64_t head_items = static_cast<int64_t>(n) * heads;
  auto layer_of = [&](int64_t item) {
    return static_cast<TieredLayer*>(batch[static_cast<size_t>(item / heads)].layer);
  };
  // The head items that took longest in their layer's last step start first (longest
  // processing time first, the last step's time as the estimate): a long item started last
  // holds the loop up while the other threads idle. While shortlists are in flight, the items
  // expected to need none (ReTopK's reuse heads) go first, the outliers' chunks next, and the
  // heads that wait for a shortlist last: the reuse heads stream the most rows and need nothing,
  // so they start as soon as the loop does, and the outliers are scored by the threads they
  // leave while the shortlists are still on their way. The order changes no result: each item
  // writes its own outputs. (A planned head's Select scores the chunks of its group's outliers
  // no item has taken yet and waits for the rest: it needs no particular order to make
  // progress.) Heads whose exact paths run on the tier are not items: their bulk states come
  // with Finish.
  ctx.order.clear();
  for (int64_t item = 0; item < head_items; ++item) {
    if (layer_of(item)->OnHost(static_cast<int>(item % heads))) ctx.order.push_back(item);
  }
  auto waits = [&](int64_t item) {
    return shortlists && layer_of(item)->ExpectsShortlist(static_cast<int>(item % heads));
  };
  // (std::sort with the item as the tie-break: std::stable_sort would allocate every step.)
  std::sort(ctx.order.begin(), ctx.order.end(), [&](int64_t a, int64_t b) {
    const bool waits_a = waits(a), waits_b = waits(b);
    if (waits_a != waits_b) return waits_b;
    const float cost_a = layer_of(a)->last_bulk_micros(static_cast<int>(a % heads));
    const float cost_b = layer_of(b)->last_bulk_micros(static_cast<int>(b % heads));
    return cost_a > cost_b || (cost_a == cost_b && a < b);
  });
  const auto first_waiting = std::find_if(ctx.order.begin(), ctx.order.end(), waits);
  const auto chunks_at = first_waiting - ctx.order.begin();
  ctx.order.insert(first_waiting, static_cast<size_t>(chunks), 0);
  for (int64_t k = 0; k < chunks; ++k) ctx.order[chunks_at + k] = head_items + k;
  const auto items = static_cast<int64_t>(ctx.order.size());
  const int threads = cpu::ThreadsFor(work, items);
  cpu::ParallelFor(items, threads, [&](int64_t k) {
    const int64_t item = ctx.order[k];
    if (item >= head_items) {
      const TieredStepContext::OutlierChunk& chunk = ctx.outlier_chunks[item - head_items];
      static_cast<TieredLayer*>(batch[chunk.sequence].layer)
          ->ScoreOutliers(ctx.histories[chunk.sequence], chunk.kv_head, chunk.chunk);
      return;
    }
    const size_t i = static_cast<size_t>(item / heads);
    layer_of(item)->AttendBulkHead(batch[i], ctx.histories[i], static_cast<int>(item % heads),
                                   bulk_start, ctx.bulk_o.data() + i * heads * d,
                                   ctx.bulk_lse.data() + i * heads);
  });
  if (shortlists) {
    // Waited for even when no head read one: its errors are the step's.
    fetch_shortlists();
    for (const LayerStep& step : batch) {
      static_cast<TieredLayer*>(step.layer)->SetShortlistFetch(nullptr);
    }
    if (!shortlisted.ok()) {
      // The step is still on the tier: Finish drains it and adds its new rows' outliers (its
      // own error, if any, is the same failure's).
      tier_->Finish(ctx.static_steps, ctx.static_context.get()).IgnoreError();
      return shortlisted;
    }
  }
  const double host_end = seconds_since(bulk_start);
  ctx.tier_seconds.bulk += host_end - link_wait;
  ctx.tier_seconds.link_wait += link_wait;
  if (absl::Status s = tier_->Finish(ctx.static_steps, ctx.static_context.get()); !s.ok()) {
    return s;
  }
  const StepContext::TierSeconds& tier = ctx.static_context->tier_seconds;
  ctx.tier_seconds.static_set += tier.static_set;
  ctx.tier_seconds.device_exact += tier.device_exact;
  ctx.tier_seconds.device_exact_wait += tier.device_exact_wait;
  ctx.tier_seconds.device_step += tier.device_step;
  ctx.tier_seconds.finish_wait += tier.finish_wait;
  // Each layer that could give the tier heads moves its count by the step's times.
  DeviceHeadBalance::StepTimes times;
  for (const StaticSetStep& step : ctx.static_steps) {
    times.run_device_heads += step.device_exact_heads;
  }
  times.device_exact = tier.device_exact;
  times.device_step = tier.device_step;
  times.launch = launched;
  times.host_end = host_end;
  times.finish_wait = tier.finish_wait;
  for (size_t i = 0; i < n; ++i) {
    if (ctx.static_steps[i].device_exact_bound > 0) {
      static_cast<TieredLayer*>(batch[i].layer)->BalanceDeviceHeads(times);
    }
  }
  // The reports once the tier's exact heads are in too (their candidates come with Finish).
  for (size_t i = 0; i < n; ++i) {
    static_cast<TieredLayer*>(batch[i].layer)->EndBulk(batch[i], ctx.histories[i]);
  }
  // The only place the tiers meet.
  for (size_t i = 0; i < n; ++i) {
    for (int h = 0; h < heads; ++h) {
      MergeStateInto(ctx.bulk_o.data() + (i * heads + h) * d, ctx.bulk_lse[i * heads + h],
                     batch[i].o + static_cast<int64_t>(h) * d, &batch[i].lse[h], d);
    }
    static_cast<TieredLayer*>(batch[i].layer)->CommitToken();
  }
  ctx.tier_seconds.finish += seconds_since(bulk_start) - host_end;
  return absl::OkStatus();
}

absl::Status TieredBackend::Shadow(std::span<ShadowStep> steps, StepContext*) {
  // The host holds every token: the shadow is the CPU placement's.
  for (const ShadowStep& step : steps) {
    const auto& layer = *static_cast<const TieredLayer*>(step.layer);
    HostShadow(layer.config().shape, layer.kv().view(), step);
  }
  return absl::OkStatus();
}

void DeviceHeadBalance::Update(const StepTimes& step) {
  // device_exact is the whole run's (every sequence's device heads in one launch).
  if (step.run_device_heads > 0) head_seconds_ = step.device_exact / step.run_device_heads;
  // The host waited for the device, which ran heads of this layer: they were the longer half.
  // (A wait with none is the shortlists', the static sets' or the download's.)
  if (step.finish_wait > std::max(kNoWaitSeconds, 0.5 * head_seconds_)) {
    if (step.device_heads > 0 && target_ > 0) --target_;
    return;
  }
  // The device's step ended (at the latest: it began no later than the launch returned) more
  // than a head's time before the host's heads did, and it ran all it was allowed.
  const double slack = step.host_end - (step.launch + step.device_step);
  if (step.device_heads >= target_ && slack > head_seconds_ && target_ < bound_) ++target_;
}

}  // namespace kvrecall
