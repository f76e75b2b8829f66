// The scrape-time gauges of ServerMetrics (sessions open, tokens held, host and GPU bytes held
// and budgeted), read from the session registry and the memory budgets.
#ifndef KVRECALL_SERVER_METRICS_GAUGES_H_
#define KVRECALL_SERVER_METRICS_GAUGES_H_

#include <cstdint>

#include "server/metrics.h"
#include "server/session.h"

namespace kvrecall {

// Sums over the open sessions of `registry`, with the host budget's account (`host_used` bytes
// of `host_limit`, <= 0: unlimited). Takes each session's lock in shared mode, one at a time.
ServerGauges CollectServerGauges(const SessionRegistry& registry, int64_t host_used,
                                 int64_t host_limit);

}  // namespace kvrecall

#endif  // KVRECALL_SERVER_METRICS_GAUGES_H_
