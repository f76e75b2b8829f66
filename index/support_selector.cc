#include "index/support_selector.h"

#include <algorithm>
#include <cmath>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "index/basic_selectors.h"
#include "index/index_selector.h"
#include "index/retopk.h"

namespace kvrecall {

const char* SelectorKindName(SelectorKind kind) {
  switch (kind) {
    case SelectorKind::kFull: return "full";
    case SelectorKind::kExactTopK: return "exact_topk";
    case SelectorKind::kStreaming: return "streaming";
    case SelectorKind::kIndex: return "index";
    case SelectorKind::kReTopK: return "retopk";
  }
  return "unknown";
}

const char* GraphScopeName(GraphScope scope) {
  switch (scope) {
    case GraphScope::kDefault: return "default";
    case GraphScope::kKvHead: return "kv_head";
    case GraphScope::kQueryHead: return "query_head";
  }
  return "unknown";
}

GraphIndexParams GraphIndexParams::WithDefaults() const {
  const GraphIndexParams defaults;
  auto pick = [](int value, int fallback) { return value == 0 ? fallback : value; };
  GraphIndexParams out;
  out.build_queries = pick(build_queries, defaults.build_queries);
  out.build_topk = pick(build_topk, defaults.build_topk);
  out.max_degree = pick(max_degree, defaults.max_degree);
  out.search_list_size = pick(search_list_size, defaults.search_list_size);
  out.search_width = pick(search_width, defaults.search_width);
  out.link_threshold = pick(link_threshold, defaults.link_threshold);
  out.link_batch = pick(link_batch, defaults.link_batch);
  out.graph_scope = graph_scope == GraphScope::kDefault ? kDefaultGraphScope : graph_scope;
  return out;
}

absl::Status SupportSelector::BuildUnless(const BuildStop& stop, const KvView& kv,
                                          const PromptQueries& prompt_queries) {
  build_stop_ = stop;
  // What it asks may not outlive the build.
  absl::Cleanup forget = [this] { build_stop_ = BuildStop(); };
  return Build(kv, prompt_queries);
}

int64_t SelectorStateBytesBound(const SelectorParams& params, const LayerShape& shape,
                                int64_t tokens, int build_threads) {
  if (params.kind == SelectorKind::kIndex) {
    return IndexSelector::MemoryBytesBound(shape, params, tokens, build_threads);
  }
  if (params.kind != SelectorKind::kReTopK) return 0;
  const int q_heads = shape.q_heads;
  const int head_dim = shape.head_dim;
  const ReTopKParams& r = params.retopk;
  const int64_t c = r.cache_capacity;
  const int64_t k = params.top_k;
  // The cache (queries and supports), cosines, the candidates of a reuse step (R supports and
  // the recent window) with their scores and positions, and a step's support awaiting its push
  // (ReTopKHead::set_defer_push, the tiered placement's).
  const int64_t candidates = int64_t{r.reuse_neighbors} * k + r.recent_window;
  const int64_t per_head = 4 * (c * (head_dim + k) + c + head_dim + 3 * candidates + k);
  return per_head * q_heads;
}

absl::Status SelectorParams::Validate() const {
  auto invalid = [](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat(parts...));
  };
  // Every size-like knob is bounded above too, so that no request can make a selector
  // allocate without limit (and sums such as sinks + recent cannot overflow).
  auto too_large = [&](const char* field, int64_t value, int64_t max) {
    return invalid("policy.", field, " must be <= ", max, ", got ", value);
  };
  if (top_k < 1) return invalid("policy.top_k must be >= 1, got ", top_k);
  if (top_k > kMaxTopK) return too_large("top_k", top_k, kMaxTopK);
  if (sinks < 0) return invalid("policy.sinks must be >= 0, got ", sinks);
  if (sinks > kMaxWindowTokens) return too_large("sinks", sinks, kMaxWindowTokens);
  if (recent < 0) return invalid("policy.recent must be >= 0, got ", recent);
  if (recent > kMaxWindowTokens) return too_large("recent", recent, kMaxWindowTokens);
  if (kind == SelectorKind::kStreaming && sinks + recent < 1) {
    return invalid("policy.sinks + policy.recent must be >= 1 for the streaming selector");
  }
  const ReTopKParams& r = retopk;
  if (r.cache_capacity < 1) {
    return invalid("policy.retopk.cache_capacity must be >= 1, got ", r.cache_capacity);
  }
  if (r.cache_capacity > kMaxReTopKCacheCapacity) {
    return too_large("retopk.cache_capacity", r.cache_capacity, kMaxReTopKCacheCapacity);
  }
  if (r.reuse_neighbors < 1 || r.reuse_neighbors > r.cache_capacity) {
    return invalid("policy.retopk.reuse_neighbors must be in [1, cache_capacity=",
                   r.cache_capacity, "], got ", r.reuse_neighbors);
  }
  if (r.recent_window < 0) {
    return invalid("policy.retopk.recent_window must be >= 0, got ", r.recent_window);
  }
  if (r.recent_window > kMaxWindowTokens) {
    return too_large("retopk.recent_window", r.recent_window, kMaxWindowTokens);
  }
  if (!std::isfinite(r.tau)) return invalid("policy.retopk.tau must be finite");
  if (r.refresh_interval < 0) {
    return invalid("policy.retopk.refresh_interval must be >= 0, got ", r.refresh_interval);
  }
  // Checked with auto_tau off too: a value that could never be served is not echoed back in
  // the effective policy as if it were.
  if (!(r.target_recall > 0.0f && r.target_recall <= 1.0f)) {
    return invalid("policy.retopk.target_recall must be in (0, 1], got ", r.target_recall);
  }
  if (shortlist < 0) return invalid("policy.index.shortlist must be >= 0, got ", shortlist);
  if (shortlist > kMaxTopK) return too_large("index.shortlist", shortlist, kMaxTopK);
  if (exact_search == ExactSearch::kGraph && shortlist > 0) {
    return invalid("policy.index.exact_search EXACT_SEARCH_GRAPH and policy.index.shortlist ",
                   shortlist, " name two exact searches; set one");
  }
  if (shortlist > 0 || exact_search != ExactSearch::kDefault) {
    // The knob that names an exact search, as the API spells it.
    const char* field = shortlist > 0 ? "policy.index.shortlist"
                        : exact_search == ExactSearch::kGraph
                            ? "policy.index.exact_search EXACT_SEARCH_GRAPH"
                            : "policy.index.exact_search EXACT_SEARCH_SHORTLIST";
    if (kind != SelectorKind::kIndex && kind != SelectorKind::kReTopK) {
      return invalid(field, " applies to the index and retopk selectors");
    }
    if (shortlist > 0 && shortlist < top_k) {
      return invalid("policy.index.shortlist must be >= top_k (", top_k, "), got ", shortlist);
    }
    if (kind == SelectorKind::kReTopK && retopk.exact_flat_scan) {
      return invalid("policy.retopk.exact_flat_scan and ", field,
                     " name two exact paths; set one");
    }
  }
  const GraphIndexParams& g = index;
  for (const auto& [name, value] : {std::pair<const char*, int64_t>{"build_queries", g.build_queries},
                                    {"build_topk", g.build_topk},
                                    {"max_degree", g.max_degree},
                                    {"search_list_size", g.search_list_size},
                                    {"search_width", g.search_width},
                                    {"link_threshold", g.link_threshold},
                                    {"link_batch", g.link_batch}}) {
    if (value < 0) {
      return invalid("policy.index.", name, " must be >= 0 (0 takes the default), got ", value);
    }
  }
  if (g.build_topk == 1) return invalid("policy.index.build_topk must be >= 2, got 1");
  if (g.build_queries > kMaxGraphBuildQueries) {
    return too_large("index.build_queries", g.build_queries, kMaxGraphBuildQueries);
  }
  if (g.build_topk > kMaxGraphBuildTopK) {
    return too_large("index.build_topk", g.build_topk, kMaxGraphBuildTopK);
  }
  if (g.search_list_size > kMaxTopK) {
    return too_large("index.search_list_size", g.search_list_size, kMaxTopK);
  }
  if (g.search_width > kMaxSearchWidth) {
    return invalid("policy.index.search_width must be <= ", kMaxSearchWidth, ", got ",
                   g.search_width);
  }
  if (g.link_threshold > kMaxWindowTokens) {
    return too_large("index.link_threshold", g.link_threshold, kMaxWindowTokens);
  }
  if (g.link_batch > kMaxWindowTokens) {
    return too_large("index.link_batch", g.link_batch, kMaxWindowTokens);
  }
  if (g.max_degree > kMaxGraphDegree) {
    return invalid("policy.index.max_degree must be <= ", kMaxGraphDegree, ", got ",
                   g.max_degree);
  }
  return absl::OkStatus();
}

int64_t PromptQueriesNeeded(const SelectorParams& params, int64_t tokens) {
  switch (params.kind) {
    case SelectorKind::kReTopK:
      return std::min<int64_t>(tokens, int64_t{params.retopk.cache_capacity} +
                                           (params.retopk.auto_tau ? kCalibrationQueries : 0));
    case SelectorKind::kIndex:
      return tokens;
    default:
      return 0;
  }
}

absl::StatusOr<std::unique_ptr<SupportSelector>> MakeSelector(const SelectorParams& params,
                                                              const LayerShape& shape) {
  if (absl::Status s = params.Validate(); !s.ok()) return s;
  switch (params.kind) {
    case SelectorKind::kFull:
      return std::make_unique<FullSelector>();
    case SelectorKind::kExactTopK:
      return std::make_unique<ExactTopKSelector>(shape, params.top_k);
    case SelectorKind::kStreaming:
      return std::make_unique<StreamingSelector>(params.sinks, params.recent);
    case SelectorKind::kReTopK:
      return std::make_unique<ReTopKSelector>(shape, params.top_k, params.retopk);
    case SelectorKind::kIndex:
      return std::make_unique<IndexSelector>(shape, params);
  }
  return absl::UnimplementedError(
      absl::StrCat("selector '", SelectorKindName(params.kind), "' is not available yet"));
}

}  // namespace kvrecall
