// The host memory a layer's selector state holds, kept charged to its session's account as the
// state changes, and the growth that state makes as the session decodes held to the budget.
#ifndef KVRECALL_SERVER_BACKENDS_SELECTOR_CHARGE_H_
#define KVRECALL_SERVER_BACKENDS_SELECTOR_CHARGE_H_

#include <cstdint>

#include "absl/status/status.h"
#include "server/memory_budget.h"

namespace kvrecall {

// What grows a layer's host memory as it decodes beside its KV (a graph index linking its new
// tokens), as a refusal names it.
inline constexpr char kSelectorGrowth[] =
    "the selector state this session's decoding grows (CreateSession's max_tokens sets it aside)";

// The state grows before it is charged (the graph links a step's token after the step), so its
// growth cannot be refused before it is made: it is charged where it fits (the session's
// set-aside, else its budget) and, where it does not, charged all the same (the memory exists),
// and the layer's next steps are refused (ReserveStep), that session's only, until its budget
// has room again. Not thread-safe: the layer's owner calls it.
class SelectorCharge {
 public:
  explicit SelectorCharge(MemoryAccount* account) : account_(account) {}
  ~SelectorCharge() {
    if (charged_ != 0) account_->Release(charged_);
  }
  SelectorCharge(const SelectorCharge&) = delete;
  SelectorCharge& operator=(const SelectorCharge&) = delete;

  // Charges the state at `bytes` now, past any limit: built state (its Prefill reserved it).
  void Set(int64_t bytes) {
    const int64_t growth = bytes - charged_;
    charged_ = bytes;
    if (growth > 0) account_->Charge(growth);
    if (growth < 0) account_->Release(-growth);
  }
  // The state is at `bytes` (after a step's selections): its growth is charged where it fits,
  // else charged all the same and this layer marked past its budget.
  void Update(int64_t bytes) {
    const int64_t growth = bytes - charged_;
    charged_ = bytes;
    if (growth < 0) account_->Release(-growth);
    if (growth > 0 && !account_->Reserve(growth, kSelectorGrowth).ok()) {
      account_->Charge(growth);
      over_ = true;
    }
  }
  // Before a step (ReserveToken, after the previous step's deferred linking), with the state at
  // `bytes` (Update): OK unless this layer's growth holds its budget over the limit, then RESOURCE_EXHAUSTED naming the budget (the step must then change
  // nothing). OK again once the budget has room.
  absl::Status ReserveStep(int64_t bytes) {
    Update(bytes);
    if (over_) {
      if (absl::Status s = account_->CheckNotOver(kSelectorGrowth); !s.ok()) return s;
      over_ = false;
    }
    return absl::OkStatus();
  }
  int64_t charged() const { return charged_; }

 private:
  MemoryAccount* const account_;
  int64_t charged_ = 0;
  bool over_ = false;  // this layer's growth was charged past its budget
};

}  // namespace kvrecall

#endif  // KVRECALL_SERVER_BACKENDS_SELECTOR_CHARGE_H_
