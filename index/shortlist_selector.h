// The exact path over a shortlist (policy.index.shortlist, the tiered placement): each query
// head's candidates are the bulk positions its shortlist names (its best approximate scores over
// product-quantized keys, found on the static tier: server/backends/bulk_codes.h), the keys
// its codes misrepresent most (outliers) and the bulk's keys not coded yet; they are rescored
// exactly against the host keys and the top K kept.
#ifndef KVRECALL_INDEX_SHORTLIST_SELECTOR_H_
#define KVRECALL_INDEX_SHORTLIST_SELECTOR_H_

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "index/support_selector.h"

namespace kvrecall {

class ShortlistSelector final : public SupportSelector {
 public:
  ShortlistSelector(const LayerShape& shape, int top_k);

  // Nothing to build: the codes are the tier's.
  absl::Status Build(const KvView&, const float*) override { return absl::OkStatus(); }

  // Before a step's Selects: query head `q_head`'s shortlist and its KV head's outliers,
  // positions of the bulk view that Select will see, the bulk's first `coded` keys being the ones
  // the shortlist was chosen among (a position outside [0, coded) is skipped: the keys from
  // `coded` on are candidates anyway). Both are read, not copied: they must stay valid until the
  // step's Selects return.
  void SetShortlist(int q_head, std::span<const int32_t> ids, std::span<const int32_t> outliers,
                    int64_t coded);
  // Called by every Select before it reads its shortlist (null: none): it may block until the
  // step's shortlists arrive and calls SetShortlist for every head, once per step (a step's
  // heads that never take the exact path, ReTopK's reuse heads, then never wait for it). Read,
  // not copied: set and cleared outside the step's Selects, valid in between.
  void set_fetch(const std::function<void()>* fetch) { fetch_ = fetch; }

  // The top K, by exact score, of the shortlist, the outliers and the keys [coded, kv.tokens),
  // each once; support scores included, path kExact. Without a shortlist set (coded 0), a flat
  // scan.
  void Select(int q_head, const float* q, const KvView& kv, HeadSelection* out) override;

 private:
  struct Head {
    std::span<const int32_t> ids;
    std::span<const int32_t> outliers;
    int64_t coded = 0;
  };
  LayerShape shape_;
  int top_k_;
  std::vector<Head> heads_;
  const std::function<void()>* fetch_ = nullptr;
};

}  // namespace kvrecall

#endif  // KVRECALL_INDEX_SHORTLIST_SELECTOR_H_
