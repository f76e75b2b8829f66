#include "server/policy.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace kvrecall {
namespace {

// Proto3 scalars cannot say "unset", so the API defines 0 as "take the default".
int OrDefault(int value, int fallback) { return value == 0 ? fallback : value; }

// The graph search list a session's searches use: the one asked for, else max(top_k, the floor)
// (index/selector_params.h). The effective policy says it so; sent back, it asks for nothing.
int EffectiveSearchListSize(int asked, int top_k) {
  return asked > 0 ? asked : std::max(top_k, kDefaultSearchListFloor);
}

absl::StatusOr<SelectorKind> SelectorKindFromProto(v1::Selector selector) {
  switch (selector) {
    case v1::SELECTOR_UNSPECIFIED:
    case v1::SELECTOR_FULL:
      return SelectorKind::kFull;
    case v1::SELECTOR_EXACT_TOPK:
      return SelectorKind::kExactTopK;
    case v1::SELECTOR_STREAMING:
      return SelectorKind::kStreaming;
    case v1::SELECTOR_INDEX:
      return SelectorKind::kIndex;
    case v1::SELECTOR_RETOPK:
      return SelectorKind::kReTopK;
    default:
      break;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("policy.selector has the unknown value ", static_cast<int>(selector)));
}

v1::Selector SelectorKindToProto(SelectorKind kind) {
  switch (kind) {
    case SelectorKind::kFull:
      return v1::SELECTOR_FULL;
    case SelectorKind::kExactTopK:
      return v1::SELECTOR_EXACT_TOPK;
    case SelectorKind::kStreaming:
      return v1::SELECTOR_STREAMING;
    case SelectorKind::kIndex:
      return v1::SELECTOR_INDEX;
    case SelectorKind::kReTopK:
      return v1::SELECTOR_RETOPK;
  }
  return v1::SELECTOR_UNSPECIFIED;
}

absl::StatusOr<v1::Placement> PlacementFromProto(v1::Placement placement) {
  switch (placement) {
    case v1::PLACEMENT_UNSPECIFIED:
    case v1::PLACEMENT_CPU:
      return v1::PLACEMENT_CPU;
    case v1::PLACEMENT_GPU:
    case v1::PLACEMENT_TIERED:
      return placement;  // whether this server has a device for it is the placements' call
    default:
      break;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("policy.placement has the unknown value ", static_cast<int>(placement)));
}

absl::StatusOr<GraphScope> GraphScopeFromProto(v1::GraphScope scope) {
  switch (scope) {
    case v1::GRAPH_SCOPE_UNSPECIFIED:
      return GraphScope::kDefault;
    case v1::GRAPH_SCOPE_KV_HEAD:
      return GraphScope::kKvHead;
    case v1::GRAPH_SCOPE_QUERY_HEAD:
      return GraphScope::kQueryHead;
    default:
      break;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "policy.index.graph_scope has the unknown value ", static_cast<int>(scope)));
}

v1::GraphScope GraphScopeToProto(GraphScope scope) {
  switch (scope) {
    case GraphScope::kKvHead:
      return v1::GRAPH_SCOPE_KV_HEAD;
    case GraphScope::kQueryHead:
      return v1::GRAPH_SCOPE_QUERY_HEAD;
    case GraphScope::kDefault:
      break;
  }
  return v1::GRAPH_SCOPE_UNSPECIFIED;
}

absl::StatusOr<ExactSearch> ExactSearchFromProto(v1::ExactSearch search) {
  switch (search) {
    case v1::EXACT_SEARCH_UNSPECIFIED:
      return ExactSearch::kDefault;
    case v1::EXACT_SEARCH_GRAPH:
      return ExactSearch::kGraph;
    case v1::EXACT_SEARCH_SHORTLIST:
      return ExactSearch::kShortlist;
    default:
      break;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "policy.index.exact_search has the unknown value ", static_cast<int>(search)));
}

v1::ExactSearch ExactSearchToProto(ExactSearch search) {
  switch (search) {
    case ExactSearch::kGraph:
      return v1::EXACT_SEARCH_GRAPH;
    case ExactSearch::kShortlist:
      return v1::EXACT_SEARCH_SHORTLIST;
    case ExactSearch::kDefault:
      break;
  }
  return v1::EXACT_SEARCH_UNSPECIFIED;
}

}  // namespace

absl::StatusOr<EffectivePolicy> ResolvePolicy(const v1::Policy& policy) {
  EffectivePolicy out;
  absl::StatusOr<v1::Placement> placement = PlacementFromProto(policy.placement());
  if (!placement.ok()) return placement.status();
  out.placement = *placement;
  absl::StatusOr<SelectorKind> kind = SelectorKindFromProto(policy.selector());
  if (!kind.ok()) return kind.status();

  SelectorParams& p = out.selector;
  const SelectorParams defaults;
  p.kind = *kind;
  p.top_k = OrDefault(policy.top_k(), defaults.top_k);
  // Present, a zero is served as sent (no sinks, no ring): the fields are proto3 optional.
  p.sinks = policy.has_sinks() ? policy.sinks() : defaults.sinks;
  p.recent = policy.has_recent() ? policy.recent() : defaults.recent;

  const v1::ReTopKParams& r = policy.retopk();
  p.retopk.cache_capacity = OrDefault(r.cache_capacity(), defaults.retopk.cache_capacity);
  p.retopk.reuse_neighbors = OrDefault(r.reuse_neighbors(), defaults.retopk.reuse_neighbors);
  p.retopk.recent_window =
      r.has_recent_window() ? r.recent_window() : defaults.retopk.recent_window;
  p.retopk.tau = r.has_tau() ? r.tau() : defaults.retopk.tau;
  p.retopk.refresh_interval =
      r.has_refresh_interval() ? r.refresh_interval() : defaults.retopk.refresh_interval;
  p.retopk.auto_tau = r.auto_tau();
  p.retopk.exact_flat_scan = r.exact_flat_scan();
  p.retopk.target_recall =
      r.target_recall() == 0.0f ? defaults.retopk.target_recall : r.target_recall();

  const v1::IndexParams& g = policy.index();
  p.index.build_queries = g.build_queries();
  p.index.build_topk = g.build_topk();
  p.index.max_degree = g.max_degree();
  p.index.search_list_size = g.search_list_size();
  p.index.search_width = g.search_width();
  absl::StatusOr<GraphScope> scope = GraphScopeFromProto(g.graph_scope());
  if (!scope.ok()) return scope.status();
  p.index.graph_scope = *scope;
  p.index = p.index.WithDefaults();
  p.shortlist = g.shortlist();
  absl::StatusOr<ExactSearch> search = ExactSearchFromProto(g.exact_search());
  if (!search.ok()) return search.status();
  p.exact_search = *search;
  // A client that tunes the graph asks for it: where the search is unset (and no shortlist N
  // is given), the graph's knobs name the graph wherever it could run (so that the GPU's default
  // shortlist does not ignore them silently).
  const bool graph_knobs = g.build_queries() != 0 || g.build_topk() != 0 || g.max_degree() != 0 ||
                           g.search_list_size() != 0 || g.search_width() != 0 ||
                           g.graph_scope() != v1::GRAPH_SCOPE_UNSPECIFIED;
  // And a knob tuned away from the server's default beside another exact path named for a
  // tiered index or retopk session names two, as EXACT_SEARCH_GRAPH there would. (A knob at its
  // default asks for nothing: an effective policy echoes every knob, and sent back it must be
  // accepted as it was.)
  const GraphIndexParams unset = GraphIndexParams{}.WithDefaults();  // what unset knobs become
  const GraphIndexParams& knobs = p.index;                            // resolved the same way
  const char* graph_knob = knobs.build_queries != unset.build_queries         ? "build_queries"
                           : knobs.build_topk != unset.build_topk             ? "build_topk"
                           : knobs.max_degree != unset.max_degree             ? "max_degree"
                           : EffectiveSearchListSize(knobs.search_list_size, p.top_k) !=
                                   EffectiveSearchListSize(unset.search_list_size, p.top_k)
                               ? "search_list_size"
                           : knobs.search_width != unset.search_width         ? "search_width"
                           : knobs.graph_scope != unset.graph_scope           ? "graph_scope"
                                                                              : nullptr;
  if (graph_knob != nullptr && out.placement == v1::PLACEMENT_TIERED &&
      (p.kind == SelectorKind::kIndex || p.kind == SelectorKind::kReTopK)) {
    const char* other = nullptr;
    if (p.shortlist > 0) {
      other = "policy.index.shortlist";
    } else if (p.exact_search == ExactSearch::kShortlist) {
      other = "policy.index.exact_search EXACT_SEARCH_SHORTLIST";
    } else if (p.kind == SelectorKind::kReTopK && p.retopk.exact_flat_scan) {
      other = "policy.retopk.exact_flat_scan";
    }
    if (other != nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "policy.index.", graph_knob, " tunes the graph index and ", other,
          " names another exact path: set one (the graph's knobs ask for the graph)"));
    }
  }
  const bool graph_could_run =
      p.kind == SelectorKind::kIndex ||
      (p.kind == SelectorKind::kReTopK && out.placement == v1::PLACEMENT_TIERED &&
       !p.retopk.exact_flat_scan);
  if (p.exact_search == ExactSearch::kDefault && p.shortlist == 0 && graph_knobs &&
      graph_could_run) {
    p.exact_search = ExactSearch::kGraph;
  }

  if (absl::Status s = p.Validate(); !s.ok()) return s;
  return out;
}

v1::Policy PolicyToProto(const EffectivePolicy& policy) {
  const SelectorParams& p = policy.selector;
  v1::Policy out;
  out.set_placement(policy.placement);
  out.set_selector(SelectorKindToProto(p.kind));
  out.set_top_k(p.top_k);
  out.set_sinks(p.sinks);
  out.set_recent(p.recent);
  v1::ReTopKParams* r = out.mutable_retopk();
  r->set_cache_capacity(p.retopk.cache_capacity);
  r->set_reuse_neighbors(p.retopk.reuse_neighbors);
  r->set_recent_window(p.retopk.recent_window);
  r->set_tau(p.retopk.tau);
  r->set_refresh_interval(p.retopk.refresh_interval);
  r->set_auto_tau(p.retopk.auto_tau);
  r->set_exact_flat_scan(p.retopk.exact_flat_scan);
  r->set_target_recall(p.retopk.target_recall);
  v1::IndexParams* g = out.mutable_index();
  g->set_build_queries(p.index.build_queries);
  g->set_build_topk(p.index.build_topk);
  g->set_max_degree(p.index.max_degree);
  g->set_search_list_size(EffectiveSearchListSize(p.index.search_list_size, p.top_k));
  g->set_search_width(p.index.search_width);
  g->set_graph_scope(GraphScopeToProto(p.index.graph_scope));
  g->set_shortlist(p.shortlist);
  g->set_exact_search(ExactSearchToProto(p.exact_search));
  return out;
}

}  // namespace kvrecall
