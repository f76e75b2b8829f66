#include "server/host_memory_budget.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace kvrecall {

absl::Status HostMemoryBudget::Reserve(int64_t bytes, absl::string_view what) {
  if (limit_ <= 0 || bytes <= 0) {
    used_.fetch_add(bytes, std::memory_order_relaxed);
    return absl::OkStatus();
  }
  int64_t used = used_.load(std::memory_order_relaxed);
  while (true) {
    if (used + bytes > limit_) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "host memory budget exceeded: %s needs %d more bytes, %d of the %d-byte budget "
          "(host_memory_budget_gb=%.3f) are in use",
          what, bytes, used, limit_, static_cast<double>(limit_) / (1ll << 30)));
    }
    if (used_.compare_exchange_weak(used, used + bytes, std::memory_order_relaxed)) {
      return absl::OkStatus();
    }
  }
}

}  // namespace kvrecall
