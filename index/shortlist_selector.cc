#include "index/shortlist_selector.h"

#include <algorithm>
#include <bit>
#include <chrono>
#include <cstdint>
#include <vector>

#include "kernels/cpu/attention.h"
#include "kernels/cpu/spin_wait.h"

namespace kvrecall {
namespace {

// The ids one Select has taken, in an open-addressing table sized to the ids it may take (the
// shortlist and the group's outliers: about 2K at 512K), not to the bulk. A table of the bulk's
// positions (4 bytes each: 2 MiB a thread at 512K) was allocated, zeroed and then grown by each
// pool thread's first Selects at a new length, inside a step: one host head of ~16 took 1.5-2.2
// ms instead of ~0.2 in 4-12 of 100 steps at 512K (bench/results/tiered_serving.md, "One slow
// head a step"). This one stays in a core's first caches: 16 bytes per id, 32 KiB a thread at
// the default N = 2K (a shortlist of the largest N the API takes, 2^20, would keep 32 MiB a
// thread, beside the 12 MiB its candidates' lists take). A stamp per slot says which Reset
// filled it, so emptying the set costs nothing.
class TakenIds {
 public:
  // Empties the set, for up to `most` ids.
  void Reset(size_t most) {
    size_t slots = 64;
    while (slots < 2 * most) slots *= 2;  // at most half full: short probes
    if (slots > slots_.size()) {
      slots_.assign(slots, Slot{});
      stamp_ = 0;
      shift_ = 32 - std::countr_zero(slots);
    }
    if (++stamp_ == 0) {  // every 2^32 Resets: the stamps start over
      std::fill(slots_.begin(), slots_.end(), Slot{});
      stamp_ = 1;
    }
  }
  // Adds `id`; false when the set holds it already.
  bool Insert(int32_t id) {
    const size_t mask = slots_.size() - 1;
    // Fibonacci hashing: the product's high bits, which every bit of the id moves.
    size_t i = (static_cast<uint32_t>(id) * 2654435769u) >> shift_;
    while (slots_[i].stamp == stamp_) {
      if (slots_[i].id == id) return false;
      i = (i + 1) & mask;
    }
    slots_[i] = Slot{id, stamp_};
    return true;
  }

 private:
  struct Slot {
    int32_t id = 0;
    uint32_t stamp = 0;
  };
  std::vector<Slot> slots_;
  uint32_t stamp_ = 0;
  int shift_ = 32;
};

}  // namespace

ShortlistSelector::ShortlistSelector(const LayerShape& shape, int top_k)
    : shape_(shape),
      top_k_(top_k),
      heads_(shape.q_heads),
      groups_(std::make_unique<Group[]>(shape.kv_heads)) {}

void ShortlistSelector::SetOutliers(int kv_head, std::span<const int32_t> outliers) {
  Group& group = groups_[kv_head];
  group.outliers = outliers;
  group.chunks = 0;
  group.chunks_left.store(0, std::memory_order_relaxed);
  const int group_size = shape_.q_heads / shape_.kv_heads;
  for (int h = kv_head * group_size; h < (kv_head + 1) * group_size; ++h) {
    heads_[h].planned = false;
  }
}

void ShortlistSelector::SetShortlist(int q_head, std::span<const int32_t> ids, int64_t coded) {
  heads_[q_head].ids = ids;
  heads_[q_head].coded = coded;
}

void ShortlistSelector::PlanOutlierScores(const float* q,
                                          absl::FunctionRef<bool(int q_head)> planned) {
  if (++generation_ == 0) generation_ = 1;  // 0 marks a chunk never taken
  planned_q_ = q;
  const int group_size = shape_.q_heads / shape_.kv_heads;
  for (int g = 0; g < shape_.kv_heads; ++g) {
    Group& group = groups_[g];
    bool any = false;
    for (int h = g * group_size; h < (g + 1) * group_size; ++h) {
      Head& head = heads_[h];
      head.planned = planned(h);
      if (!head.planned) continue;
      any = true;
      // Sized, not filled: the chunks write every outlier inside the view, the only ones a
      // Select takes.
      head.outlier_scores.resize(group.outliers.size());
    }
    const auto rows = static_cast<int64_t>(group.outliers.size());
    group.chunks = any ? static_cast<int>((rows + kOutlierChunk - 1) / kOutlierChunk) : 0;
    if (group.chunks > group.capacity) {
      group.capacity = std::max(group.chunks, 2 * group.capacity);
      group.taken = std::make_unique<std::atomic<uint32_t>[]>(group.capacity);
    }
    group.chunks_left.store(group.chunks, std::memory_order_relaxed);
  }
}

int ShortlistSelector::OutlierChunks(int kv_head) const { return groups_[kv_head].chunks; }

int64_t ShortlistSelector::MemoryBytes() const {
  int64_t bytes = 0;
  for (const Head& head : heads_) {
    bytes += static_cast<int64_t>(head.outlier_scores.capacity() * sizeof(float));
  }
  for (int g = 0; g < shape_.kv_heads; ++g) {
    bytes += int64_t{groups_[g].capacity} * static_cast<int64_t>(sizeof(std::atomic<uint32_t>));
  }
  return bytes;
}

void ShortlistSelector::ScoreOutliers(int kv_head, int chunk, const KvView& kv) {
  Group& group = groups_[kv_head];
  if (chunk < 0 || chunk >= group.chunks) return;
  uint32_t seen = group.taken[chunk].load(std::memory_order_relaxed);
  if (seen == generation_ || !group.taken[chunk].compare_exchange_strong(seen, generation_)) {
    return;  // another thread's
  }
  // The chunk's outliers inside the view (the others are never candidates: Select skips them).
  thread_local std::vector<int32_t> inside;
  thread_local std::vector<int32_t> slots;
  thread_local std::vector<float> scores;
  inside.clear();
  slots.clear();
  const auto begin = static_cast<size_t>(chunk) * kOutlierChunk;
  const size_t end = std::min(group.outliers.size(), begin + kOutlierChunk);
  for (size_t j = begin; j < end; ++j) {
    const int32_t id = group.outliers[j];
    if (id >= 0 && id < kv.tokens) {
      inside.push_back(id);
      slots.push_back(static_cast<int32_t>(j));
    }
  }
  // Each row loaded and widened once for the group's planned heads.
  const int group_size = shape_.q_heads / shape_.kv_heads;
  thread_local std::vector<const float*> queries;
  thread_local std::vector<float*> rows_of;
  thread_local std::vector<Head*> planned;
  queries.clear();
  planned.clear();
  for (int h = kv_head * group_size; h < (kv_head + 1) * group_size; ++h) {
    if (!heads_[h].planned) continue;
    queries.push_back(planned_q_ + static_cast<int64_t>(h) * shape_.head_dim);
    planned.push_back(&heads_[h]);
  }
  scores.resize(planned.size() * inside.size());
  rows_of.resize(planned.size());
  for (size_t j = 0; j < planned.size(); ++j) rows_of[j] = scores.data() + j * inside.size();
  cpu::ScoreTokensForQueries(queries, kv, kv_head, inside, {}, shape_.scale, rows_of.data());
  for (size_t j = 0; j < planned.size(); ++j) {
    std::vector<float>& head_scores = planned[j]->outlier_scores;
    for (size_t i = 0; i < inside.size(); ++i) head_scores[slots[i]] = rows_of[j][i];
  }
  group.chunks_left.fetch_sub(1, std::memory_order_release);
}

void ShortlistSelector::Select(int q_head, const float* q, const KvView& kv, HeadSelection* out) {
  if (fetch_ != nullptr) (*fetch_)();
  const Head& head = heads_[q_head];
  const int kv_head = KvHeadOf(q_head, shape_.q_heads, shape_.kv_heads);
  if (head.planned) {
    // The group's chunks nobody has taken yet, then the wait for those others are scoring.
    Group& group = groups_[kv_head];
    for (int c = 0; c < group.chunks; ++c) ScoreOutliers(kv_head, c, kv);
    auto scored = [&] { return group.chunks_left.load(std::memory_order_acquire) == 0; };
    while (!cpu::PollUntil(std::chrono::milliseconds(1), scored)) {
    }
  }
  const std::span<const int32_t> outliers = groups_[kv_head].outliers;
  const int64_t coded = std::min(head.coded, kv.tokens);
  thread_local std::vector<int32_t> candidates;
  thread_local std::vector<float> scores;
  thread_local std::vector<float> outlier_scores;  // of the outliers taken, in their order
  thread_local std::vector<int32_t> positions;
  // Outliers the shortlist holds too, and repeats, are taken once.
  thread_local TakenIds taken;
  taken.Reset(head.ids.size() + outliers.size());
  auto take = [&](int32_t id) {
    if (id < 0 || id >= coded || !taken.Insert(id)) return false;
    candidates.push_back(id);
    return true;
  };
  candidates.clear();
  outlier_scores.clear();
  for (int32_t id : head.ids) take(id);
  const size_t shortlisted = candidates.size();
  for (size_t j = 0; j < outliers.size(); ++j) {
    if (take(outliers[j]) && head.planned) outlier_scores.push_back(head.outlier_scores[j]);
  }
  const size_t tail = candidates.size();
  for (int64_t t = coded; t < kv.tokens; ++t) candidates.push_back(static_cast<int32_t>(t));
  scores.resize(candidates.size());
  const std::span<const int32_t> all(candidates);
  if (head.planned) {
    // Every candidate's score is the same function of its row whichever call computes it.
    cpu::ScoreTokens(q, kv, kv_head, all.first(shortlisted), shape_.scale, scores.data());
    std::copy(outlier_scores.begin(), outlier_scores.end(), scores.begin() + shortlisted);
    cpu::ScoreTokens(q, kv, kv_head, all.subspan(tail), shape_.scale, scores.data() + tail);
  } else {
    cpu::ScoreTokens(q, kv, kv_head, all, shape_.scale, scores.data());
  }
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
