// Conversion between the API's Policy message and the selector knobs (SelectorParams), with
// defaults filled in (whether a placement is served here is server/backends/placements.h's call).
#ifndef KVRECALL_SERVER_POLICY_H_
#define KVRECALL_SERVER_POLICY_H_

#include "absl/status/statusor.h"
#include "index/selector_params.h"
#include "kvrecall/v1/kvrecall.pb.h"

namespace kvrecall {

// A session's policy after defaults were applied and every knob was validated.
struct EffectivePolicy {
  v1::Placement placement = v1::PLACEMENT_CPU;
  SelectorParams selector;
};

// Fills zero/unset knobs with their defaults (index/selector_params.h) and validates the result.
// An unset exact search becomes the graph here when the policy sets a graph knob (and no
// shortlist) where a graph could run, and a graph knob beside another exact path named is
// refused; otherwise the search's default depends on the placement's device and is left to it
// (server/backends/placements.h, ResolveExactSearch). INVALID_ARGUMENT naming the field (e.g.
// "policy.retopk.reuse_neighbors") for a bad knob or an unknown enum value.
absl::StatusOr<EffectivePolicy> ResolvePolicy(const v1::Policy& policy);

// The policy as the API spells it, every knob explicit (echoed by CreateSession/GetSession).
v1::Policy PolicyToProto(const EffectivePolicy& policy);

}  // namespace kvrecall

#endif  // KVRECALL_SERVER_POLICY_H_
