#include "index/index_selector.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "index/basic_selectors.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/mapped_memory.h"

namespace kvrecall {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace

IndexSelector::IndexSelector(const LayerShape& shape, const SelectorParams& params,
                             bool bulk_only, BatchTopKFunction batch_topk)
    : shape_(shape),
      top_k_(params.top_k),
      sinks_(params.sinks),
      recent_(params.recent),
      index_params_(params.index.WithDefaults()),
      bulk_only_(bulk_only),
      batch_topk_(batch_topk) {
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

// One KV head's batch top-k for all its query heads (IndexSelector::Build): each head's lists
// and query sum, ready once `ready` (under the build's mutex).
struct IndexSelector::GroupLists {
  std::vector<TopKLists> lists;
  std::vector<std::vector<float>> query_sums;
  double seconds_per_head = 0;
  absl::Status status;
  bool ready = false;
};

BuildQueries IndexSelector::HeadQueries(int q_head, const float* prompt_queries,
                                        int64_t tokens) const {
  BuildQueries queries;
  // No queries (an empty prompt: the tiered bulk before it has any token) is no query set;
  // offsetting a null pointer would be undefined even unread.
  if (prompt_queries != nullptr) {
    queries.queries = VectorSet{prompt_queries + q_head * shape_.head_dim, tokens,
                                static_cast<int64_t>(shape_.q_heads) * shape_.head_dim,
                                shape_.head_dim};
  }
  queries.causal = true;
  queries.first_key_position = sinks_;
  return queries;
}

void IndexSelector::ComputeGroupLists(const KvView& kv, const float* prompt_queries, int kv_head,
                                      GroupLists* out) const {
  const Clock::time_point start = Clock::now();
  const int group = shape_.q_heads / shape_.kv_heads;
  const VectorSet keys = BulkKeys(kv, kv_head, BulkEnd(kv.tokens));
  // The group's sampled queries side by side ([group x sampled, head_dim]) with their causal
  // counts: one top-k over the keys they share.
  int64_t total = 0;
  std::vector<int64_t> counts(group);
  for (int i = 0; i < group; ++i) {
    counts[i] = GraphIndex::SampledQueryCount(
        index_params_, keys.count, HeadQueries(kv_head * group + i, prompt_queries, kv.tokens));
    total += counts[i];
  }
  cpu::MappedVector<float> queries(static_cast<size_t>(total) * shape_.head_dim);
  std::vector<int64_t> visible;
  out->query_sums.resize(group);
  int64_t offset = 0;
  for (int i = 0; i < group; ++i) {
    out->query_sums[i] = GraphIndex::SampleQueries(
        index_params_, keys, HeadQueries(kv_head * group + i, prompt_queries, kv.tokens),
        queries.data() + offset * shape_.head_dim, &visible);
    offset += counts[i];
  }
  out->lists.assign(group, TopKLists());
  if (keys.count == 0) return;
  TopKLists all;
  out->status = batch_topk_(VectorSet{queries.data(), total, shape_.head_dim, shape_.head_dim},
                            keys, index_params_.build_topk, &all, visible);
  if (!out->status.ok()) return;
  offset = 0;
  for (int i = 0; i < group; ++i) {
    TopKLists& lists = out->lists[i];
    lists.k = all.k;
    lists.queries = counts[i];
    lists.ids.assign(all.ids.begin() + offset * all.k,
                     all.ids.begin() + (offset + counts[i]) * all.k);
    offset += counts[i];
  }
  out->seconds_per_head = SecondsSince(start) / group;
}

absl::Status IndexSelector::Build(const KvView& kv, const float* prompt_queries) {
  if (kv.head_dim != shape_.head_dim || kv.kv_heads != shape_.kv_heads) {
    return absl::InvalidArgumentError(absl::StrCat(
        "index selector built for kv_heads=", shape_.kv_heads, " head_dim=", shape_.head_dim,
        " got a KV of kv_heads=", kv.kv_heads, " head_dim=", kv.head_dim));
  }
  const int64_t bulk_end = BulkEnd(kv.tokens);
  const int group = shape_.q_heads / shape_.kv_heads;
  std::vector<GroupLists> groups(shape_.kv_heads);
  std::mutex mu;
  std::condition_variable ready;
  auto compute = [&](int kv_head) {
    GroupLists lists;
    ComputeGroupLists(kv, prompt_queries, kv_head, &lists);
    std::lock_guard<std::mutex> lock(mu);
    groups[kv_head] = std::move(lists);
    groups[kv_head].ready = true;
    ready.notify_all();
  };
  std::vector<absl::Status> built(shape_.q_heads);
  auto build_head = [&](int h) {
    Head& head = heads_[h];
    const int kv_head = KvHeadOf(h, shape_.q_heads, shape_.kv_heads);
    GroupLists* lists = &groups[kv_head];
    {
      std::unique_lock<std::mutex> lock(mu);
      ready.wait(lock, [&] { return lists->ready; });
    }
    const int i = h - kv_head * group;
    built[h] = lists->status.ok() ? head.index.BuildFromLists(BulkKeys(kv, kv_head, bulk_end),
                                                              lists->query_sums[i],
                                                              lists->lists[i],
                                                              lists->seconds_per_head)
                                  : lists->status;
    lists->lists[i] = TopKLists();  // its lists are done with
    head.recent_queries.assign(static_cast<size_t>(kRecentQueries) * shape_.head_dim, 0.0f);
    head.queries_seen = 0;
  };
  // The top-k lists come one KV head at a time (one batch top-k for its query heads, which
  // share its keys). With at least a head per thread, heads build side by side, each on one
  // thread: a build has serial stretches that one head at a time on every thread leaves the
  // other cores idle through. Their lists are computed first on the whole team when the batch
  // top-k is the CPU's, else (the GPU's) by a thread of their own, one KV head after another,
  // while the heads whose lists are ready build. With fewer heads than threads, or inside a
  // parallel region (the server building a prompt's layers side by side), heads build one
  // after another, each on the threads there are, a KV head's lists just before its heads.
  const int side_by_side = BuildSideBySide(shape_.q_heads, BuildThreads());
  if (side_by_side > 1) {
    std::thread producer;
    if (IsCpuBatchTopK(batch_topk_)) {
      for (int g = 0; g < shape_.kv_heads; ++g) compute(g);
    } else {
      producer = std::thread([&] {
        for (int g = 0; g < shape_.kv_heads; ++g) compute(g);
      });
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(side_by_side)
    for (int h = 0; h < shape_.q_heads; ++h) build_head(h);
    if (producer.joinable()) producer.join();
  } else {
    for (int g = 0; g < shape_.kv_heads; ++g) {
      compute(g);
      for (int h = g * group; h < (g + 1) * group; ++h) build_head(h);
    }
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
  // A build holds every head's top-k lists at most (their KV heads' batch top-k may run ahead
  // of the heads' graphs), one KV head's sampled queries at a time with the batch top-k's
  // scratch, and the graph scratch of the heads that build at once, on one thread each.
  const int group = shape.q_heads / shape.kv_heads;
  const int side_by_side = BuildSideBySide(shape.q_heads, build_threads);
  const int64_t k = std::min<int64_t>(params.index.WithDefaults().build_topk, bulk);
  const int64_t group_queries =
      group * GraphIndex::SampledQueryBytes(params.index, bulk, tokens, shape.head_dim);
  const int64_t group_topk =
      bulk == 0 ? 0
                : CpuBatchTopKScratchBytes(bulk, static_cast<int>(k), shape.head_dim,
                                           std::max(1, build_threads)) +
                      group * GraphIndex::TopKListBytes(params.index, bulk, tokens);
  return per_head * shape.q_heads +
         shape.q_heads * GraphIndex::TopKListBytes(params.index, bulk, tokens) + group_queries +
         group_topk +
         side_by_side * GraphIndex::GraphScratchBytesBound(params.index, bulk, tokens,
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
