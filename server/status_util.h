// Small helpers for statuses crossing the server's layers: prefixing a message with the
// request field it concerns, and converting to gRPC's status type.
#ifndef KVRECALL_SERVER_STATUS_UTIL_H_
#define KVRECALL_SERVER_STATUS_UTIL_H_

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "grpcpp/support/status.h"

namespace kvrecall {

// `status` with `prefix` put before its message (OK stays OK). Lets hot paths name a field
// such as "steps[3]." only when something is wrong, instead of formatting it for every request.
template <typename... Parts>
absl::Status PrefixStatus(const absl::Status& status, const Parts&... prefix) {
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrCat(prefix..., status.message()));
}

// absl and gRPC share the canonical status codes, number for number.
inline grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

}  // namespace kvrecall

#endif  // KVRECALL_SERVER_STATUS_UTIL_H_
