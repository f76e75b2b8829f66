#include "server/metrics_gauges.h"

#include <memory>
#include <vector>

#include "server/host_memory.h"
#include "server/kv_store.h"

namespace kvrecall {

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
  for (const std::unique_ptr<AttentionBackend>& backend : placements.gpu()) {
    const MemoryBudget* budget = backend->device_budget();
    if (budget == nullptr) continue;
    gauges.gpu_bytes_held += budget->used();
    gauges.gpu_bytes_budget += BudgetGaugeValue(budget->limit());
  }
  gauges.codes_learnings = placements.CodesLearnings();
  gauges.host_kv_growths = HostKvGrowthCounts();
  gauges.host_address_space_held = static_cast<int64_t>(HostAddressSpaceHeld());
  gauges.host_address_space_bound = static_cast<int64_t>(HostAddressSpaceBound());
  return gauges;
}

}  // namespace kvrecall
