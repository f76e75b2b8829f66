// A server-wide account of the bytes sessions hold in one kind of memory (host DRAM, or one GPU),
// checked against the operator's budget whenever a prefill or a decode step needs more.
#ifndef KVRECALL_SERVER_MEMORY_BUDGET_H_
#define KVRECALL_SERVER_MEMORY_BUDGET_H_

#include <atomic>
#include <cstdint>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace kvrecall {

// What host and device stores charge their allocations to: a budget, or a session's grant on one.
class MemoryAccount {
 public:
  virtual ~MemoryAccount() = default;
  // Charges `bytes`, or charges nothing and returns RESOURCE_EXHAUSTED naming `what`.
  virtual absl::Status Reserve(int64_t bytes, absl::string_view what) = 0;
  // Charges memory that already exists (selector state after it was built), past any limit.
  virtual void Charge(int64_t bytes) = 0;
  virtual void Release(int64_t bytes) = 0;
};

class MemoryBudget final : public MemoryAccount {
 public:
  // limit_bytes <= 0 means unlimited. `name` says which memory ("host memory", "GPU 0 memory")
  // and `flag` which setting bounds it ("host_memory_budget_gb"), for the refusal messages.
  MemoryBudget(int64_t limit_bytes, std::string name, std::string flag)
      : limit_(limit_bytes), name_(std::move(name)), flag_(std::move(flag)) {}
  explicit MemoryBudget(int64_t limit_bytes)
      : MemoryBudget(limit_bytes, "host memory", "host_memory_budget_gb") {}
  MemoryBudget(const MemoryBudget&) = delete;
  MemoryBudget& operator=(const MemoryBudget&) = delete;

  // Charges `bytes`, or charges nothing and returns RESOURCE_EXHAUSTED naming the budget and
  // `what` needed it when the charge would exceed the limit.
  absl::Status Reserve(int64_t bytes, absl::string_view what) override;

  // Charges memory that already exists (selector state after it was built): the account may
  // then exceed the limit, and further Reserve calls fail until memory is released.
  void Charge(int64_t bytes) override { used_.fetch_add(bytes, std::memory_order_relaxed); }
  void Release(int64_t bytes) override { used_.fetch_sub(bytes, std::memory_order_relaxed); }

  int64_t used() const { return used_.load(std::memory_order_relaxed); }
  int64_t limit() const { return limit_; }
  // What Reserve would still grant (INT64_MAX when unlimited).
  int64_t available() const;
  const std::string& name() const { return name_; }
  // The setting that bounds it ("host_memory_budget_gb").
  const std::string& flag() const { return flag_; }

 private:
  const int64_t limit_;
  const std::string name_;
  const std::string flag_;
  std::atomic<int64_t> used_{0};
};

// A session's account on a budget: what the session announced at admission (CreateSession's
// max_tokens) is set aside in the budget up front, and the session's allocations draw on that
// before they ask the budget for more, so an admitted session cannot be starved later by
// sessions admitted after it. What it frees goes back to the set-aside while the session holds
// less than it announced (a failed Prefill's staging, drawn from it, must not hand it to other
// sessions), the rest to the budget. Thread-safe; whatever is still set aside goes back on
// destruction.
class MemoryGrant final : public MemoryAccount {
 public:
  explicit MemoryGrant(MemoryBudget* budget) : budget_(budget) {}
  ~MemoryGrant() override;
  MemoryGrant(const MemoryGrant&) = delete;
  MemoryGrant& operator=(const MemoryGrant&) = delete;

  // Sets `bytes` more aside in the budget (RESOURCE_EXHAUSTED naming `what` when they do not
  // fit): the session holds at least its announcements from then on.
  absl::Status SetAside(int64_t bytes, absl::string_view what);

  absl::Status Reserve(int64_t bytes, absl::string_view what) override;
  void Charge(int64_t bytes) override;
  void Release(int64_t bytes) override;

  // Gives back to the budget whatever is still set aside, and ends the announcements (the
  // session closed): what is released later goes to the budget.
  void ReleaseSetAside();

  int64_t set_aside() const { return set_aside_.load(std::memory_order_relaxed); }
  // What the session holds of the budget: its charges and what is still set aside for it, at
  // least what it announced. The budget's used() is these summed over its grants (and whatever
  // is charged beside them).
  int64_t held() const { return held_.load(std::memory_order_relaxed); }
  MemoryBudget* budget() const { return budget_; }

 private:
  // Takes up to `bytes` of what is set aside; returns how much it took.
  int64_t Draw(int64_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  MemoryBudget* const budget_;
  absl::Mutex mu_;  // orders the updates of the three counts; the reads take none
  int64_t announced_ ABSL_GUARDED_BY(mu_) = 0;  // the set-asides asked for, until released
  std::atomic<int64_t> set_aside_{0};           // written under mu_
  std::atomic<int64_t> held_{0};                // see held(); written under mu_
};

// Whether `gib` (GiB, as the budget flags take it) is 0 (no budget) or from one byte (2^-30) to
// below 2^33 GiB (2^63 bytes): past that range GibToBytes would overflow, or round a budget
// asked for to 0, which means unlimited.
inline bool IsBudgetGib(double gib) {
  return gib == 0 || (gib * 0x1p30 >= 1 && gib < 0x1p33);
}
inline int64_t GibToBytes(double gib) { return static_cast<int64_t>(gib * 0x1p30); }

}  // namespace kvrecall

#endif  // KVRECALL_SERVER_MEMORY_BUDGET_H_
