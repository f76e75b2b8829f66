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

// Each of `gpus`' devices that has a budget: what `tenant` holds of it (0 where it has used none,
// `tenant` null included) and its share there, `limit_bytes` (<= 0: +Inf, none of its own).
std::vector<DeviceGauges> TenantDeviceGaugesOf(
    const std::vector<std::unique_ptr<AttentionBackend>>& gpus, const TenantBudgets* tenant,
    int64_t limit_bytes);

// Sums over the open sessions of `registry` (each session's lock taken in shared mode, one at
// a time) and over the device budgets of `placements`' GPU backends.
ServerGauges CollectServerGauges(const SessionRegistry& registry, const MemoryBudget& host_budget,
                                 const Placements& placements);

}  // namespace kvrecall

#endif  // KVRECALL_SERVER_METRICS_GAUGES_H_
