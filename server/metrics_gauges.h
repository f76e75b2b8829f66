// The scrape-time gauges of ServerMetrics (sessions open, tokens held, host and GPU bytes held
// and budgeted), read from the session registry and the memory budgets.
#ifndef KVRECALL_SERVER_METRICS_GAUGES_H_
#define KVRECALL_SERVER_METRICS_GAUGES_H_

#include "server/memory_budget.h"
#include "server/metrics.h"
#include "server/session.h"

namespace kvrecall {

// Sums over the open sessions of `registry`; the host budget is `host_budget`'s. Takes each
// session's lock in shared mode, one at a time.
ServerGauges CollectServerGauges(const SessionRegistry& registry, const MemoryBudget& host_budget);

}  // namespace kvrecall

#endif  // KVRECALL_SERVER_METRICS_GAUGES_H_
