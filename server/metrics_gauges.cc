#include "server/metrics_gauges.h"

#include <memory>
#include <vector>

#include "server/host_memory.h"
#include "server/kv_store.h"

namespace kvrecall {

std::vector<DeviceGauges> DeviceGaugesOf(
    const std::vector<std::unique_ptr<AttentionBackend>>& gpus) {
  std::vector<DeviceGauges> devices;
  for (const std::unique_ptr<AttentionBackend>& backend : gpus) {
    const MemoryBudget* budget = backend->device_budget();
    if (budget == nullptr) continue;
    devices.push_back({backend->device(), budget->used(), BudgetGaugeValue(budget->limit())});
  }
  return devices;
}

std::vector<DeviceGauges> TenantDeviceGaugesOf(
    const std::vector<std::unique_ptr<AttentionBackend>>& gpus, const TenantBudgets* tenant,
    int64_t limit_bytes) {
  std::vector<DeviceGauges> devices;
  for (const std::unique_ptr<AttentionBackend>& backend : gpus) {
    const MemoryBudget* budget = backend->device_budget();
    if (budget == nullptr) continue;
    devices.push_back({backend->device(), tenant == nullptr ? 0 : tenant->gpu_used_within(budget),
                       BudgetGaugeValue(limit_bytes)});
  }
  return devices;
}

ServerGauges CollectServerGauges(const SessionRegistry& registry, const MemoryBudget& host_budget,
                                 const Placements& placements) {
  ServerGauges gauges;
  for (const std::shared_ptr<Session>& session : registry.List()) {
    absl::ReaderMutexLock lock(&session->mu());
    if (session->closed()) continue;
    const v1::SessionInfo info = session->Info();
    ++gauges.sessions_open;
    gauges.tokens_held += info.tokens();
  }
  gauges.host_bytes_held = host_budget.used();
  gauges.host_bytes_budget = BudgetGaugeValue(host_budget.limit());
  gauges.devices = DeviceGaugesOf(placements.gpu());
  const int devices = static_cast<int>(gauges.devices.size());
  for (const DeviceGauges& device : gauges.devices) {
    gauges.gpu_bytes_held += device.bytes_held;
    gauges.gpu_bytes_budget += device.bytes_budget;
  }
  const SessionLimits& limits = registry.limits();
  const bool tenants_have_budgets =
      limits.host_bytes_per_tenant > 0 || limits.gpu_bytes_per_tenant > 0;
  for (const SessionRegistry::TenantHoldings& holdings : registry.Tenants()) {
    TenantGauges& tenant = gauges.tenants.emplace_back();
    tenant.tenant = holdings.tenant;
    tenant.sessions_open = holdings.sessions_open;
    tenant.has_budgets = tenants_have_budgets;
    if (!tenants_have_budgets) continue;
    tenant.host_bytes_budget = BudgetGaugeValue(limits.host_bytes_per_tenant);
    // As the server's: 0 without a device (not 0 * +Inf).
    tenant.gpu_bytes_budget =
        devices == 0 ? 0 : devices * BudgetGaugeValue(limits.gpu_bytes_per_tenant);
    tenant.devices =
        TenantDeviceGaugesOf(placements.gpu(), holdings.budgets.get(), limits.gpu_bytes_per_tenant);
    if (holdings.budgets == nullptr) continue;  // nothing charged to it now
    tenant.host_bytes_held = holdings.budgets->host().used();
    tenant.gpu_bytes_held = holdings.budgets->gpu_used();
  }
  gauges.codes_learnings = placements.CodesLearnings();
  gauges.host_kv_growths = HostKvGrowthCounts();
  gauges.host_address_space_held = static_cast<int64_t>(HostAddressSpaceHeld());
  gauges.host_address_space_bound = static_cast<int64_t>(HostAddressSpaceBound());
  return gauges;
}

}  // namespace kvrecall
