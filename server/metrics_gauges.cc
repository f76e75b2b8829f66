#include "server/metrics_gauges.h"

#include <algorithm>
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

std::vector<TenantGauges> TenantGaugesOf(
    const std::vector<SessionRegistry::TenantHoldings>& tenants, const SessionLimits& limits,
    const std::vector<std::unique_ptr<AttentionBackend>>& gpus) {
  const bool tenants_have_budgets =
      limits.host_bytes_per_tenant > 0 || limits.gpu_bytes_per_tenant > 0;
  std::vector<TenantGauges> gauges;
  for (const SessionRegistry::TenantHoldings& holdings : tenants) {
    TenantGauges& tenant = gauges.emplace_back();
    tenant.tenant = holdings.tenant;
    tenant.sessions_open = holdings.sessions_open;
    tenant.has_budgets = tenants_have_budgets;
    if (!tenants_have_budgets) continue;
    tenant.host_bytes_budget = BudgetGaugeValue(limits.host_bytes_per_tenant);
    if (holdings.budgets != nullptr) tenant.host_bytes_held = holdings.budgets->host().used();
    for (const std::unique_ptr<AttentionBackend>& backend : gpus) {
      const MemoryBudget* device = backend->device_budget();
      if (device == nullptr) continue;
      // A share of its own is bounded by the device's budget as well (a budget within it
      // refuses when either is spent): a share above it could never fill. None of its own
      // (+Inf) stays so: the device's gauges say when the device is full.
      const double share = limits.gpu_bytes_per_tenant <= 0
                               ? BudgetGaugeValue(limits.gpu_bytes_per_tenant)
                               : std::min(BudgetGaugeValue(limits.gpu_bytes_per_tenant),
                                          BudgetGaugeValue(device->limit()));
      const int64_t held =
          holdings.budgets == nullptr ? 0 : holdings.budgets->gpu_used_within(device);
      tenant.devices.push_back({backend->device(), held, share});
      // The sums from the same reads (0 without a device, +Inf where a share is).
      tenant.gpu_bytes_held += held;
      tenant.gpu_bytes_budget += share;
    }
  }
  return gauges;
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
  for (const DeviceGauges& device : gauges.devices) {
    gauges.gpu_bytes_held += device.bytes_held;
    gauges.gpu_bytes_budget += device.bytes_budget;
  }
  gauges.tenants = TenantGaugesOf(registry.Tenants(), registry.limits(), placements.gpu());
  gauges.codes_learnings = placements.CodesLearnings();
  gauges.host_kv_growths = HostKvGrowthCounts();
  gauges.host_address_space_held = static_cast<int64_t>(HostAddressSpaceHeld());
  gauges.host_address_space_bound = static_cast<int64_t>(HostAddressSpaceBound());
  return gauges;
}

}  // namespace kvrecall
