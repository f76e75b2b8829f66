// Small helpers for statuses crossing the server's layers: prefixing a message with the
// request field it concerns (or adding what followed), and converting to gRPC's status type.
#ifndef KVRECALL_SERVER_STATUS_UTIL_H_
#define KVRECALL_SERVER_STATUS_UTIL_H_

#include <string>

#include "absl/status/status.h"
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/types/optional.h"
#include "grpcpp/support/status.h"

namespace kvrecall {

// `status` with `message` for its message, its code and payloads kept (OK stays OK).
inline absl::Status WithMessage(const absl::Status& status, absl::string_view message) {
  if (status.ok()) return status;
  absl::Status changed(status.code(), message);
  status.ForEachPayload([&](absl::string_view type, const absl::Cord& payload) {
    changed.SetPayload(type, payload);
  });
  return changed;
}

// `status` with `prefix` put before its message (OK stays OK); its payloads are kept. Lets hot
// paths name a field such as "steps[3]." only when something is wrong, instead of formatting it
// for every request.
template <typename... Parts>
absl::Status PrefixStatus(const absl::Status& status, const Parts&... prefix) {
  if (status.ok()) return status;
  return WithMessage(status, absl::StrCat(prefix..., status.message()));
}

// `status` with `suffix` put after its message (OK stays OK); its payloads are kept.
template <typename... Parts>
absl::Status SuffixStatus(const absl::Status& status, const Parts&... suffix) {
  if (status.ok()) return status;
  return WithMessage(status, absl::StrCat(status.message(), suffix...));
}

// A request refused by a server limit (RESOURCE_EXHAUSTED from a memory budget, say) names the
// limit in a payload, so that where the call is answered it is counted by limit
// (kvrecall_requests_refused_total, server/metrics.h) once per request, whatever retries or
// prefixes happened on the way.
inline constexpr absl::string_view kRefusedLimitPayload = "type.kvrecall.dev/refused_limit";
// `status` naming `limit` ("host_memory_budget"), a short snake_case name of a server knob.
inline absl::Status RefusedBy(absl::Status status, absl::string_view limit) {
  status.SetPayload(kRefusedLimitPayload, absl::Cord(limit));
  return status;
}
// The limit `status` names, or "" when no limit refused it.
inline std::string RefusedLimit(const absl::Status& status) {
  absl::optional<absl::Cord> limit = status.GetPayload(kRefusedLimitPayload);
  return limit.has_value() ? std::string(*limit) : std::string();
}

// absl and gRPC share the canonical status codes, number for number.
inline grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

}  // namespace kvrecall

#endif  // KVRECALL_SERVER_STATUS_UTIL_H_
