#include "index/index_selector.h"

#include <omp.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "index/basic_selectors.h"
#include "kernels/cpu/attention.h"

namespace kvrecall {

IndexSelector::IndexSelector(const LayerShape& shape, const SelectorParams& params,
                             bool bulk_only, BatchTopKFunction batch_topk)
    : shape_(shape),
      top_k_(params.top_k),
      sinks_(params.sinks),
      recent_(params.recent),
      index_params_(params.index.WithDefaults()),
      bulk_only_(bulk_only) {
  heads_.reserve(shape.q_heads);
  for (int h = 0; h < shape.q_heads; ++h) heads_.emplace_back(index_params_, batch_topk);
}

int64_t IndexSelector::BulkEnd(int64_t tokens) const {
  return std::max<int64_t>(sinks_, tokens - recent_);
}

VectorSet IndexSelector::BulkKeys(const KvView& kv, int kv_head, int64_t end) const {
  if (end <= sinks_) return VectorSet{kv.keys, 0, kv.token_stride(), kv.head_dim, kv.element};
  return VectorSet::KeysOf(kv, kv_head, sinks_, end);
}

VectorSet IndexSelector::RecentQueries(const Head& head) const {
  const int64_t held = std::min<int64_t>(head.queries_seen, kRecentQueries);
  return VectorSet{head.recent_queries.data(), held, shape_.head_dim, shape_.head_dim};
}

absl::Status IndexSelector::Build(const KvView& kv, const float* prompt_queries) {
  if (kv.head_dim != shape_.head_dim || kv.kv_heads != shape_.kv_heads) {
    return absl::InvalidArgumentError(absl::StrCat(
        "index selector built for kv_heads=", shape_.kv_heads, " head_dim=", shape_.head_dim,
        " got a KV of kv_heads=", kv.kv_heads, " head_dim=", kv.head_dim));
  }
  const int64_t bulk_end = BulkEnd(kv.tokens);
  const int64_t query_stride = static_cast<int64_t>(shape_.q_heads) * shape_.head_dim;
  // With at least a head per thread, heads build side by side, each on one thread: a build has
  // serial stretches (the projection's grouping, the connectivity pass) that one head at a time
  // on every thread leaves the other cores idle through. With fewer heads than threads, or
  // inside a parallel region (the server building a prompt's layers side by side), heads build
  // one after another, each on the threads there are.
  const int side_by_side = BuildSideBySide(shape_.q_heads, BuildThreads());
  std::vector<absl::Status> built(shape_.q_heads);
#pragma omp parallel for schedule(dynamic, 1) num_threads(side_by_side) if (side_by_side > 1)
  for (int h = 0; h < shape_.q_heads; ++h) {
    Head& head = heads_[h];
    const int kv_head = KvHeadOf(h, shape_.q_heads, shape_.kv_heads);
    BuildQueries queries;
    // No queries (an empty prompt: the tiered bulk before it has any token) is no query set;
    // offsetting a null pointer would be undefined even unread.
    if (prompt_queries != nullptr) {
      queries.queries = VectorSet{prompt_queries + h * shape_.head_dim, kv.tokens, query_stride,
                                  shape_.head_dim};
    }
    queries.causal = true;
    queries.first_key_position = sinks_;
    built[h] = head.index.Build(BulkKeys(kv, kv_head, bulk_end), queries);
    head.recent_queries.assign(static_cast<size_t>(kRecentQueries) * shape_.head_dim, 0.0f);
    head.queries_seen = 0;
  }
  for (const absl::Status& s : built) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

int IndexSelector::BuildThreads() { return omp_in_parallel() ? 1 : omp_get_max_threads(); }

int IndexSelector::BuildSideBySide(int q_heads, int build_threads) {
  return q_heads >= build_threads ? std::max(1, build_threads) : 1;
}

void IndexSelector::OnAppend(const KvView& kv) {
  const int64_t bulk_end = BulkEnd(kv.tokens);
  bool links = false;
  for (const Head& head : heads_) links = links || head.index.KeysToLink(bulk_end - sinks_) > 0;
  // Heads in parallel when any links: a decode step's Add links a few keys per head
  // (GraphIndex's link_batch), too little work to spread over threads inside one index; an Add
  // that only appends is cheaper than entering a parallel region.
#pragma omp parallel for schedule(dynamic, 1) if (links && shape_.q_heads > 1)
  for (int h = 0; h < shape_.q_heads; ++h) {
    Head& head = heads_[h];
    if (sinks_ + head.index.size() >= bulk_end) continue;
    const int kv_head = KvHeadOf(h, shape_.q_heads, shape_.kv_heads);
    // Add fails only for a key set smaller than the index's; Select then attends the
    // unindexed bulk tokens directly, so the output stays exact for them.
    (void)head.index.Add(BulkKeys(kv, kv_head, bulk_end), RecentQueries(head));
  }
}

void IndexSelector::Select(int q_head, const float* q, const KvView& kv, HeadSelection* out) {
  Head& head = heads_[q_head];
  const int kv_head = KvHeadOf(q_head, shape_.q_heads, shape_.kv_heads);
  const int64_t bulk_end = BulkEnd(kv.tokens);
  const int64_t indexed = std::min<int64_t>(head.index.size(), bulk_end - sinks_);
  out->support.clear();
  out->support_scores.clear();
  if (!bulk_only_) AppendStaticSet(kv.tokens, sinks_, recent_, &out->support);
  // The searches scored every bulk token they return: with no static set in the support, the
  // attention can take those scores (scaled as cpu::ScoreTokens scales them).
  auto keep = [&](int32_t id, float score) {
    out->support.push_back(static_cast<int32_t>(sinks_ + id));
    if (bulk_only_) out->support_scores.push_back(shape_.scale * score);
  };
  out->path = SelectionPath::kExact;
  out->candidates = 0;
  thread_local SearchResult result;
  result.ids.clear();
  result.scores.clear();
  if (indexed > 0) {
    SearchParams params;
    params.list_size = index_params_.search_list_size;
    params.width = index_params_.search_width;
    head.index.Search(BulkKeys(kv, kv_head, sinks_ + head.index.size()), q,
                      top_k_, params, &result);
    out->candidates = static_cast<int32_t>(result.stats.scored);
  }
  if (sinks_ + indexed >= bulk_end) {
    for (size_t i = 0; i < result.ids.size(); ++i) {
      if (result.ids[i] < indexed) keep(result.ids[i], result.scores[i]);
    }
  } else {
    // Bulk tokens the index does not hold yet (OnAppend has not absorbed them, or an Add
    // failed) are scored exactly, as the index's own unlinked tail is, and compete for the top
    // K with what the search found: every bulk token is a candidate whether OnAppend ran before
    // this step or runs after it.
    const VectorSet bulk = BulkKeys(kv, kv_head, bulk_end);
    for (int64_t t = sinks_ + indexed; t < bulk_end; ++t) {
      const int32_t id = static_cast<int32_t>(t - sinks_);
      result.ids.push_back(id);
      result.scores.push_back(
          cpu::DotProduct(q, bulk.row_data(id), bulk.element, shape_.head_dim));
    }
    out->candidates += static_cast<int32_t>(bulk_end - sinks_ - indexed);
    thread_local std::vector<int32_t> best;
    cpu::TopKPositions(result.scores, top_k_, &best);
    for (int32_t at : best) {
      if (result.ids[at] < bulk_end - sinks_) {
        keep(result.ids[at], result.scores[at]);
      }
    }
  }
  // Remember the query for placing the keys that join the bulk later.
  float* slot = head.recent_queries.data() +
                (head.queries_seen % kRecentQueries) * static_cast<int64_t>(shape_.head_dim);
  std::copy(q, q + shape_.head_dim, slot);
  ++head.queries_seen;
}

int64_t IndexSelector::MemoryBytesBound(const LayerShape& shape, const SelectorParams& params,
                                        int64_t tokens, int build_threads) {
  const int64_t bulk = BulkTokens(tokens, params.sinks, params.recent);
  const int64_t per_head = GraphIndex::GraphBytes(params.index, bulk) +
                           int64_t{kRecentQueries} * shape.head_dim * int64_t{sizeof(float)};
  // Heads building side by side hold a build's scratch each, on one thread each.
  const int side_by_side = BuildSideBySide(shape.q_heads, build_threads);
  return per_head * shape.q_heads +
         side_by_side * GraphIndex::BuildScratchBytesBound(
                            params.index, bulk, tokens, shape.head_dim,
                            side_by_side > 1 ? 1 : build_threads);
}

int64_t IndexSelector::MemoryBytes() const {
  int64_t bytes = 0;
  for (const Head& head : heads_) {
    bytes += head.index.MemoryBytes() +
             static_cast<int64_t>(head.recent_queries.capacity() * sizeof(float));
  }
  return bytes;
}

}  // namespace kvrecall
