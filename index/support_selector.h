// The support-selector abstraction: per layer, chooses the tokens each query head of a decode
// step attends to. Full, exact top-K, streaming, the graph index, the shortlist over
// product-quantized keys and ReTopK implement it.
#ifndef KVRECALL_INDEX_SUPPORT_SELECTOR_H_
#define KVRECALL_INDEX_SUPPORT_SELECTOR_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "index/build_stop.h"
#include "index/selector_params.h"
#include "kernels/kv_view.h"
#include "kernels/selection_path.h"

namespace kvrecall {

// The outcome of selecting for one query head in one step.
struct HeadSelection {
  std::vector<int32_t> support;  // token positions attended to, each once, in any order
  // scale * <q, key> of each support token, aligned with `support` (exactly as
  // cpu::ScoreTokens computes it), where the selector scored every one of them on its way (the
  // attention then need not score them again); empty otherwise.
  std::vector<float> support_scores;
  SelectionPath path = SelectionPath::kExact;
  int32_t candidates = 0;        // tokens scored to choose the support
  float best_cosine = 0.0f;      // ReTopK only
};

// Shapes the selector is built for. Layout of queries: [tokens, q_heads, head_dim].
struct LayerShape {
  int q_heads = 0;
  int kv_heads = 0;
  int head_dim = 0;
  float scale = 0.0f;  // softmax scale applied to <q, k>
};

// The prompt's queries a selector is built from: rows [first, T) of [T, q_heads, head_dim]
// (post-RoPE, f32), `data` pointing at row `first`. The placements keep only the last rows the
// selector needs (PromptQueriesNeeded), so that a 128K prompt's queries (2 GiB of f32 for 32
// heads of 128 dims) are not held for a selector that reads its last few hundred.
struct PromptQueries {
  PromptQueries() = default;
  // Every row, from `all` (may be null: none).
  PromptQueries(const float* all) : data(all) {}  // NOLINT(google-explicit-constructor)
  PromptQueries(const float* rows, int64_t first_row) : data(rows), first(first_row) {}

  // Row p (p >= first) of rows of `stride` floats.
  const float* row(int64_t p, int64_t stride) const { return data + (p - first) * stride; }
  // The same rows seen from `by` rows later (row p here is row p - by there; rows before `by`
  // are dropped).
  PromptQueries Shifted(int64_t by, int64_t stride) const {
    if (data == nullptr) return {};
    return by >= first ? PromptQueries(row(by, stride), 0) : PromptQueries(data, first - by);
  }

  const float* data = nullptr;
  int64_t first = 0;
};

// One instance serves one layer of one session. The call order is:
//   Build (once, after the prompt is committed) then, per decode step,
//   Select (once per query head, possibly from several threads at once for different heads)
//   and OnAppend (once per step, after the step's token was appended: before the step's Selects
//   or after them, possibly on another thread, but never while another call runs).
// Select must choose over every token of its kv, including those appended after the last
// OnAppend (the graph index scores them exactly), so that OnAppend can run off the decode path.
class SupportSelector {
 public:
  virtual ~SupportSelector() = default;

  // Builds state from the committed prompt. kv holds the prompt's T tokens; prompt_queries
  // holds at least the last PromptQueriesNeeded of them (a selector needing rows it does not
  // hold fails with FAILED_PRECONDITION).
  virtual absl::Status Build(const KvView& kv, const PromptQueries& prompt_queries) = 0;

  // Absorbs the tokens appended since the last call (kv.tokens includes them).
  virtual void OnAppend(const KvView& kv) {}
  // Whether OnAppend does enough work (linking keys into a graph index) that the placements
  // run it after the step's reply rather than inside the step (server/backends/deferred_append.h).
  virtual bool OnAppendIsCostly() const { return false; }

  // Chooses the support of query head `q_head` for query q [head_dim] over kv (which includes
  // the current token). Heads are independent: calls for different heads may run in parallel.
  virtual void Select(int q_head, const float* q, const KvView& kv, HeadSelection* out) = 0;

  // Host bytes held by the selector itself (indexes, caches), not counting the KV.
  virtual int64_t MemoryBytes() const { return 0; }
  // After Build: makes room for a history of `tokens` tokens (a session's announced max_tokens),
  // so that growing to it allocates nothing more: MemoryBytes() is then what
  // SelectorStateBytesBound(params, shape, tokens, 0) says (the graph index's arrays; the
  // others hold no state that grows with the history).
  virtual void ReserveTokens(int64_t tokens) {}

  // Build, asking `stop` between its units of work (index/build_stop.h): once it is requested,
  // it returns CANCELLED and the selector must not be used. `stop` is forgotten after.
  absl::Status BuildUnless(const BuildStop& stop, const KvView& kv,
                           const PromptQueries& prompt_queries);

 protected:
  // For Build: the stop of BuildUnless (never requested in a plain Build).
  const BuildStop& build_stop() const { return build_stop_; }

 private:
  BuildStop build_stop_;
};

// How many of a prompt's last tokens must come with their queries for the selector `params`
// to be built from a prompt of `tokens` tokens: none for full, exact_topk and streaming (they
// never look at past queries), the seeds of its caches (and the calibration window under
// auto_tau) for ReTopK, all of them for the query-aware graph index.
int64_t PromptQueriesNeeded(const SelectorParams& params, int64_t tokens);

// The most host bytes the selector `params` of one layer holds, or uses on the way, once built
// from a prompt of `tokens` tokens on `build_threads` OpenMP threads: ReTopK's cache (C entries
// of a unit query and a support of up to K indices) and its step scratch, whatever the context;
// the graph index's adjacency over the prompt's bulk and its build's scratch
// (IndexSelector::MemoryBytesBound); 0 for the others.
// Reserved before a layer is built, so that a policy whose state cannot fit the memory budget
// is refused before anything is allocated; what decoding adds later is charged as it grows.
// build_threads 0: the state a built selector keeps over `tokens` tokens, without a build's
// scratch (what a session announcing `tokens` sets aside for its selector's growth).
int64_t SelectorStateBytesBound(const SelectorParams& params, const LayerShape& shape,
                                int64_t tokens, int build_threads);

// Makes the selector `params.kind` for one layer of the given shape.
absl::StatusOr<std::unique_ptr<SupportSelector>> MakeSelector(const SelectorParams& params,
                                                              const LayerShape& shape);

}  // namespace kvrecall

#endif  // KVRECALL_INDEX_SUPPORT_SELECTOR_H_
