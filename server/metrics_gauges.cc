#include "server/metrics_gauges.h"

#include <memory>
#include <vector>

namespace kvrecall {

ServerGauges CollectServerGauges(const SessionRegistry& registry, int64_t host_used,
                                 int64_t host_limit) {
  ServerGauges gauges;
  for (const std::shared_ptr<Session>& session : registry.List()) {
    absl::ReaderMutexLock lock(&session->mu());
    if (session->closed()) continue;
    const v1::SessionInfo info = session->Info();
    ++gauges.sessions_open;
    gauges.tokens_held += info.tokens();
    gauges.gpu_bytes_held += info.gpu_bytes();
  }
  gauges.host_bytes_held = host_used;
  gauges.host_bytes_budget = BudgetGaugeValue(host_limit);
  return gauges;
}

}  // namespace kvrecall
