// The server-wide account of host memory held by sessions, checked against the operator's
// budget (--host_memory_budget_gb) whenever a prefill or a decode step needs more.
#ifndef KVRECALL_SERVER_HOST_MEMORY_BUDGET_H_
#define KVRECALL_SERVER_HOST_MEMORY_BUDGET_H_

#include <atomic>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace kvrecall {

class HostMemoryBudget {
 public:
  // limit_bytes <= 0 means unlimited.
  explicit HostMemoryBudget(int64_t limit_bytes) : limit_(limit_bytes) {}
  HostMemoryBudget(const HostMemoryBudget&) = delete;
  HostMemoryBudget& operator=(const HostMemoryBudget&) = delete;

  // Charges `bytes`, or charges nothing and returns RESOURCE_EXHAUSTED naming the budget and
  // `what` needed it when the charge would exceed the limit.
  absl::Status Reserve(int64_t bytes, absl::string_view what);

  // Charges memory that already exists (selector state after it was built): the account may
  // then exceed the limit, and further Reserve calls fail until memory is released.
  void Charge(int64_t bytes) { used_.fetch_add(bytes, std::memory_order_relaxed); }
  void Release(int64_t bytes) { used_.fetch_sub(bytes, std::memory_order_relaxed); }

  int64_t used() const { return used_.load(std::memory_order_relaxed); }
  int64_t limit() const { return limit_; }

 private:
  const int64_t limit_;
  std::atomic<int64_t> used_{0};
};

}  // namespace kvrecall

#endif  // KVRECALL_SERVER_HOST_MEMORY_BUDGET_H_
