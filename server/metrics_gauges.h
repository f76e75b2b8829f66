// The scrape-time gauges of ServerMetrics: sessions open, tokens held, host and GPU bytes held
// and budgeted (server-wide, per device and per tenant), the shortlist codes' learnings, host KV
// growths and address space, read from the session registry, the budgets and the placements.
#ifndef KVRECALL_SERVER_METRICS_GAUGES_H_
#define KVRECALL_SERVER_METRICS_GAUGES_H_

#include "server/backends/placements.h"
#include "server/memory_budget.h"
#include "server/metrics.h"
#include "server/session.h"

namespace kvrecall {

// Each of `gpus`' devices that has a budget: its name, what is held of it, its limit.
std::vector<DeviceGauges> DeviceGaugesOf(
    const std::vector<std::unique_ptr<AttentionBackend>>& gpus);

// Each tenant of `tenants` (SessionRegistry::Tenants()) as its gauges read under `limits`: its
// open sessions and, with budgets per tenant, its host memory and, on each of `gpus`' devices
// that has a budget, what it holds of that device and its share there (its limit, or the
// device's budget where that is lower; +Inf without a limit of its own), and their sums.
std::vector<TenantGauges> TenantGaugesOf(
    const std::vector<SessionRegistry::TenantHoldings>& tenants, const SessionLimits& limits,
    const std::vector<std::unique_ptr<AttentionBackend>>& gpus);

// Sums over the open sessions of `registry` (each session's lock taken in shared mode, one at
// a time) and over the device budgets of `placements`' GPU backends; its tenants' gauges as
// TenantGaugesOf reads them.
ServerGauges CollectServerGauges(const SessionRegistry& registry, const MemoryBudget& host_budget,
                                 const Placements& placements);

}  // namespace kvrecall

#endif  // KVRECALL_SERVER_METRICS_GAUGES_H_
