// The exact path over a shortlist (policy.index.shortlist, the tiered placement): each query
// head's candidates are the bulk positions its shortlist names (its best approximate scores over
// product-quantized keys, found on the static tier: server/backends/bulk_codes.h), the keys
// its codes misrepresent most (outliers) and the bulk's keys not coded yet; they are rescored
// exactly against the host keys and the top K kept.
#ifndef KVRECALL_INDEX_SHORTLIST_SELECTOR_H_
#define KVRECALL_INDEX_SHORTLIST_SELECTOR_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "absl/functional/function_ref.h"
#include "index/support_selector.h"

namespace kvrecall {

class ShortlistSelector final : public SupportSelector {
 public:
  // Outlier rows a chunk of ScoreOutliers takes (below): a chunk is one item of the step's
  // loop, so that a long list (1023 rows a KV head at 512K) spreads over the waiting threads.
  static constexpr int kOutlierChunk = 128;

  ShortlistSelector(const LayerShape& shape, int top_k);

  // Nothing to build: the codes are the tier's.
  absl::Status Build(const KvView&, const PromptQueries&) override { return absl::OkStatus(); }

  // Before a step's Selects: the outliers of KV head `kv_head`, positions of the bulk view that
  // Select will see (every query head of the KV group rescores them). Read, not copied: they
  // must stay valid until the step's Selects return. Drops the group's plan of the last step
  // (PlanOutlierScores below makes this step's).
  void SetOutliers(int kv_head, std::span<const int32_t> outliers);
  // Before a step's Selects: query head `q_head`'s shortlist, positions of the bulk view, the
  // bulk's first `coded` keys being the ones the shortlist was chosen among (a position outside
  // [0, coded) is skipped: the keys from `coded` on are candidates anyway; so is an outlier
  // outside [0, coded)). Read, not copied, as the outliers.
  void SetShortlist(int q_head, std::span<const int32_t> ids, int64_t coded);
  // Called by every Select before it reads its shortlist (null: none): it may block until the
  // step's shortlists arrive and calls SetShortlist for every head, once per step (a step's
  // heads that never take the exact path, ReTopK's reuse heads, then never wait for it). Read,
  // not copied: set and cleared outside the step's Selects, valid in between.
  void set_fetch(const std::function<void()>* fetch) { fetch_ = fetch; }

  // The outliers' scores ahead of the shortlists. They depend on the query and the outliers
  // alone, so a step can score them while its shortlists are still in flight, each outlier row
  // loaded once for the query heads of its KV group that need it, kOutlierChunk rows at a time.
  //
  // Before the step's Selects, on one thread, after SetOutliers: `planned(h)` says which query
  // heads' outliers are scored ahead this step; q: [q_heads, head_dim], the queries each head's
  // Select will be given, valid until the step's Selects return.
  void PlanOutlierScores(const float* q, absl::FunctionRef<bool(int q_head)> planned);
  // How many chunks KV head `kv_head`'s outliers make (0 if no head of its group is planned).
  int OutlierChunks(int kv_head) const;
  // Scores chunk `chunk` of KV head `kv_head`'s outliers for the planned query heads of its
  // group, over kv (the view the Selects see), unless another call or Select has taken it. A
  // planned head's Select scores every chunk of its group no other call has taken, then waits
  // for the rest: the result is the same whoever scores which chunk. From any thread, between
  // the plan and the end of the step's Selects.
  void ScoreOutliers(int kv_head, int chunk, const KvView& kv);

  // The top K, by exact score, of the shortlist, the outliers and the keys [coded, kv.tokens),
  // each once; support scores included, path kExact. Without a shortlist set (coded 0), a flat
  // scan. A planned head rescores only its shortlist and the tail, and takes its outliers'
  // scores from ScoreOutliers: the same support and scores, bit for bit.
  void Select(int q_head, const float* q, const KvView& kv, HeadSelection* out) override;

  // The outliers' scores and the chunks' claims, which grow with the outliers.
  int64_t MemoryBytes() const override;

 private:
  struct Head {
    std::span<const int32_t> ids;
    int64_t coded = 0;
    bool planned = false;
    std::vector<float> outlier_scores;  // [outliers], the group's order (unset: out of the view)
  };
  struct Group {
    std::span<const int32_t> outliers;
    int chunks = 0;  // this step's, 0 when no head of the group is planned
    // Per chunk, the plan generation it was taken for; [capacity].
    std::unique_ptr<std::atomic<uint32_t>[]> taken;
    int capacity = 0;
    std::atomic<int> chunks_left{0};  // of this step's, not scored yet
  };
  LayerShape shape_;
  int top_k_;
  std::vector<Head> heads_;
  std::unique_ptr<Group[]> groups_;  // [kv_heads]
  const float* planned_q_ = nullptr;
  uint32_t generation_ = 0;  // of the plan, from 1 (0: nothing claimed or scored yet)
  const std::function<void()>* fetch_ = nullptr;
};

}  // namespace kvrecall

#endif  // KVRECALL_INDEX_SHORTLIST_SELECTOR_H_
