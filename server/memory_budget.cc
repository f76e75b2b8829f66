#include "server/memory_budget.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "server/status_util.h"

namespace kvrecall {

absl::Status MemoryBudget::Reserve(int64_t bytes, absl::string_view what) {
  if (absl::Status s = ReserveHere(bytes, what); !s.ok()) return s;
  if (parent_ != nullptr) {
    if (absl::Status s = parent_->Reserve(bytes, what); !s.ok()) {
      used_.fetch_sub(bytes, std::memory_order_relaxed);
      return s;
    }
  }
  return absl::OkStatus();
}

void MemoryBudget::Charge(int64_t bytes) {
  used_.fetch_add(bytes, std::memory_order_relaxed);
  if (parent_ != nullptr) parent_->Charge(bytes);
}

void MemoryBudget::Release(int64_t bytes) {
  used_.fetch_sub(bytes, std::memory_order_relaxed);
  if (parent_ != nullptr) parent_->Release(bytes);
}

absl::Status MemoryBudget::Refused(int64_t used, absl::string_view why,
                                   absl::string_view then) const {
  // The limit is the flag without its unit: "host_memory_budget".
  absl::string_view limit = flag_;
  absl::ConsumeSuffix(&limit, "_gb");
  const double gib = static_cast<double>(limit_) / (1ll << 30);
  return RefusedBy(
      absl::ResourceExhaustedError(
          hide_use_ ? absl::StrFormat("%s budget exceeded: %s, more than the %d-byte budget "
                                      "(%s=%.6g) that this server's tenants share has free%s",
                                      name_, why, limit_, flag_, gib, then)
                    : absl::StrFormat("%s budget exceeded: %s, %d of the %d-byte budget "
                                      "(%s=%.6g) are in use%s",
                                      name_, why, used, limit_, flag_, gib, then)),
      limit);
}

absl::Status MemoryBudget::CheckNotOver(absl::string_view what) const {
  const int64_t used = used_.load(std::memory_order_relaxed);
  if (limit_ > 0 && used > limit_) {
    return Refused(used, absl::StrCat(what, " grew past it"),
                   ": it grows no more until memory is freed");
  }
  return parent_ != nullptr ? parent_->CheckNotOver(what) : absl::OkStatus();
}

absl::Status MemoryBudget::ReserveHere(int64_t bytes, absl::string_view what) {
  if (limit_ <= 0 || bytes <= 0) {
    used_.fetch_add(bytes, std::memory_order_relaxed);
    return absl::OkStatus();
  }
  int64_t used = used_.load(std::memory_order_relaxed);
  while (true) {
    if (used + bytes > limit_) {
      return Refused(used, absl::StrCat(what, " needs ", bytes, " more bytes"), "");
    }
    if (used_.compare_exchange_weak(used, used + bytes, std::memory_order_relaxed)) {
      return absl::OkStatus();
    }
  }
}

int64_t MemoryBudget::available() const {
  if (limit_ <= 0) return std::numeric_limits<int64_t>::max();
  return std::max<int64_t>(0, limit_ - used());
}

MemoryGrant::~MemoryGrant() { ReleaseSetAside(); }

void MemoryGrant::ReleaseSetAside() {
  absl::MutexLock lock(&mu_);
  const int64_t released = set_aside_.exchange(0, std::memory_order_relaxed);
  held_.fetch_sub(released, std::memory_order_relaxed);
  announced_ = 0;
  budget_->Release(released);
}

absl::Status MemoryGrant::SetAside(int64_t bytes, absl::string_view what) {
  if (bytes <= 0) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  if (absl::Status s = budget_->Reserve(bytes, what); !s.ok()) return s;
  set_aside_.fetch_add(bytes, std::memory_order_relaxed);
  held_.fetch_add(bytes, std::memory_order_relaxed);
  announced_ += bytes;
  return absl::OkStatus();
}

int64_t MemoryGrant::Draw(int64_t bytes) {
  const int64_t take = std::clamp<int64_t>(bytes, 0, set_aside_.load(std::memory_order_relaxed));
  set_aside_.fetch_sub(take, std::memory_order_relaxed);
  return take;
}

absl::Status MemoryGrant::Reserve(int64_t bytes, absl::string_view what) {
  absl::MutexLock lock(&mu_);
  const int64_t drawn = Draw(bytes);
  if (absl::Status s = budget_->Reserve(bytes - drawn, what); !s.ok()) {
    set_aside_.fetch_add(drawn, std::memory_order_relaxed);  // give back what was drawn
    return s;
  }
  held_.fetch_add(bytes - drawn, std::memory_order_relaxed);  // the drawn bytes were held
  return absl::OkStatus();
}

void MemoryGrant::Charge(int64_t bytes) {
  absl::MutexLock lock(&mu_);
  const int64_t drawn = Draw(bytes);
  held_.fetch_add(bytes - drawn, std::memory_order_relaxed);
  budget_->Charge(bytes - drawn);
}

absl::Status MemoryGrant::CheckNotOver(absl::string_view what) const {
  {
    absl::MutexLock lock(&mu_);
    if (held_.load(std::memory_order_relaxed) <= announced_) return absl::OkStatus();
  }
  return budget_->CheckNotOver(what);
}

void MemoryGrant::Release(int64_t bytes) {
  absl::MutexLock lock(&mu_);
  // The session keeps holding what it announced: freed bytes refill the set-aside up to that.
  const int64_t held = held_.load(std::memory_order_relaxed);
  const int64_t kept = std::clamp<int64_t>(announced_ - (held - bytes), 0, bytes);
  set_aside_.fetch_add(kept, std::memory_order_relaxed);
  held_.fetch_sub(bytes - kept, std::memory_order_relaxed);
  budget_->Release(bytes - kept);
}

namespace {

std::string TenantSuffix(absl::string_view tenant) {
  return tenant.empty() ? " (of every caller: the server authenticates no tenants)"
                        : absl::StrCat(" (tenant '", tenant, "')");
}

}  // namespace

TenantBudgets::TenantBudgets(absl::string_view tenant, int64_t host_limit_bytes,
                             int64_t gpu_limit_bytes, MemoryBudget* host)
    : who_(TenantSuffix(tenant)),
      gpu_limit_(gpu_limit_bytes),
      host_(host_limit_bytes, absl::StrCat(host->name(), who_),
            "host_memory_budget_per_tenant_gb", host) {}

MemoryBudget* TenantBudgets::Within(MemoryBudget* device) {
  absl::MutexLock lock(&mu_);
  std::unique_ptr<MemoryBudget>& budget = devices_[device];
  if (budget == nullptr) {
    budget = std::make_unique<MemoryBudget>(gpu_limit_, absl::StrCat(device->name(), who_),
                                            "gpu_memory_budget_per_tenant_gb", device);
  }
  return budget.get();
}

int64_t TenantBudgets::gpu_used_within(const MemoryBudget* device) const {
  absl::MutexLock lock(&mu_);
  const auto it = devices_.find(device);
  return it == devices_.end() ? 0 : it->second->used();
}

}  // namespace kvrecall
