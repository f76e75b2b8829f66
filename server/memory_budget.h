// An account of the bytes sessions hold in one kind of memory (host DRAM, or one GPU), server-wide
// or one tenant's within it, checked against the operator's budget whenever a prefill or a
// decode step needs more.
#ifndef KVRECALL_SERVER_MEMORY_BUDGET_H_
#define KVRECALL_SERVER_MEMORY_BUDGET_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
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
  // OK unless memory charged past a limit holds this account over it: then RESOURCE_EXHAUSTED
  // naming the budget and `what` would grow further. A session's state that grows as it decodes
  // (a graph index linking its new tokens) is charged once it exists; its next step asks this
  // first, so that a session past its budget grows no more until memory is freed.
  virtual absl::Status CheckNotOver(absl::string_view what) const = 0;
};

class MemoryBudget final : public MemoryAccount {
 public:
  // limit_bytes <= 0 means unlimited. `name` says which memory ("host memory", "GPU 0 memory")
  // and `flag` which setting bounds it ("host_memory_budget_gb"), for the refusal messages.
  // With a `parent` (a tenant's budget within the server's; it must outlive this one) whatever
  // is charged here is charged there too, and a Reserve must fit both.
  MemoryBudget(int64_t limit_bytes, std::string name, std::string flag,
               MemoryBudget* parent = nullptr)
      : limit_(limit_bytes), name_(std::move(name)), flag_(std::move(flag)), parent_(parent) {}
  explicit MemoryBudget(int64_t limit_bytes)
      : MemoryBudget(limit_bytes, "host memory", "host_memory_budget_gb") {}
  MemoryBudget(const MemoryBudget&) = delete;
  MemoryBudget& operator=(const MemoryBudget&) = delete;

  // Charges `bytes`, or charges nothing and returns RESOURCE_EXHAUSTED naming the budget (this
  // one or its parent's, whichever is exceeded) and `what` needed it.
  absl::Status Reserve(int64_t bytes, absl::string_view what) override;

  // Charges memory that already exists (selector state after it was built): the account may
  // then exceed the limit, and further Reserve calls fail until memory is released.
  void Charge(int64_t bytes) override;
  void Release(int64_t bytes) override;
  // Over when more than the limit is used here or in a parent.
  absl::Status CheckNotOver(absl::string_view what) const override;

  int64_t used() const { return used_.load(std::memory_order_relaxed); }
  int64_t limit() const { return limit_; }
  // What Reserve would still grant here, not counting the parent's limit (INT64_MAX when
  // unlimited).
  int64_t available() const;
  // The budget this one is part of (null: the server's own).
  MemoryBudget* parent() const { return parent_; }
  // The server-wide budget: this one's outermost parent, or itself.
  const MemoryBudget& server_wide() const {
    return parent_ == nullptr ? *this : parent_->server_wide();
  }
  const std::string& name() const { return name_; }
  // The setting that bounds it ("host_memory_budget_gb").
  const std::string& flag() const { return flag_; }
  // Marks the budget as shared by tenants who must not learn what the others hold (the
  // server's, where tokens name tenants): its refusals then say that it has not the room, not
  // how much of it is in use (probe 26, 6). Call before the budget is used.
  void HideUseFromRefusals() { hide_use_ = true; }
  bool hides_use() const { return hide_use_; }

 private:
  // Reserve against this budget's own limit only.
  absl::Status ReserveHere(int64_t bytes, absl::string_view what);
  // RESOURCE_EXHAUSTED: "<name> budget exceeded: <why>, <used> of the <limit>-byte budget
  // (<flag>=<GiB>) are in use<then>", naming the limit for the metrics.
  absl::Status Refused(int64_t used, absl::string_view why, absl::string_view then) const;

  const int64_t limit_;
  const std::string name_;
  const std::string flag_;
  bool hide_use_ = false;  // HideUseFromRefusals
  MemoryBudget* const parent_;
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
  // OK while the session holds no more than it announced (what it announced it may always
  // hold); past that, its budget's check.
  absl::Status CheckNotOver(absl::string_view what) const override;

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
  mutable absl::Mutex mu_;  // orders the updates of the three counts; most reads take none
  int64_t announced_ ABSL_GUARDED_BY(mu_) = 0;  // the set-asides asked for, until released
  std::atomic<int64_t> set_aside_{0};           // written under mu_
  std::atomic<int64_t> held_{0};                // see held(); written under mu_
};

// One tenant's share of the server's budgets (kvrecalld's --host_memory_budget_per_tenant_gb and
// --gpu_memory_budget_per_tenant_gb): a budget within the host budget, and one within each GPU's
// budget, made when the tenant first uses that GPU. Its sessions (and other holders of tenant
// memory, such as a shared decode region) share it and keep it alive while they are charged to
// it. Thread-safe.
class TenantBudgets {
 public:
  // `tenant` names it in refusals ("" for the one tenant of a server without tokens); a limit
  // <= 0 leaves that memory bounded by the server's budget alone. `host` outlives it.
  TenantBudgets(absl::string_view tenant, int64_t host_limit_bytes, int64_t gpu_limit_bytes,
                MemoryBudget* host);
  TenantBudgets(const TenantBudgets&) = delete;
  TenantBudgets& operator=(const TenantBudgets&) = delete;

  MemoryBudget* host() { return &host_; }
  const MemoryBudget& host() const { return host_; }
  // The tenant's budget within `device` (a GPU's server-wide budget, which outlives this).
  MemoryBudget* Within(MemoryBudget* device);
  // What the tenant holds within `device`'s budget (0 where it has not used that device).
  int64_t gpu_used_within(const MemoryBudget* device) const;

 private:
  const std::string who_;  // " (tenant 'name')", for the budgets' names
  const int64_t gpu_limit_;
  MemoryBudget host_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<const MemoryBudget*, std::unique_ptr<MemoryBudget>> devices_
      ABSL_GUARDED_BY(mu_);
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
