// The HOST:PORT and unix:PATH forms of gRPC addresses, read one way by kvrecalld's checks of its
// listening addresses and by the clients' checks of a server's address.
#ifndef KVRECALL_PROTO_HOST_PORT_H_
#define KVRECALL_PROTO_HOST_PORT_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/string_view.h"

namespace kvrecall {

// The port of `address` when it is HOST:PORT: a non-empty host (an IPv6 host in brackets:
// [::1]:50051) and a decimal port, of any value (the caller bounds it: gRPC's own parser takes
// it modulo 2^16); nullopt otherwise (no port, or a bare IPv6 address such as ::1, which gRPC
// reads as a host without a port).
inline std::optional<int64_t> PortOfHostPort(absl::string_view address) {
  const size_t colon = address.rfind(':');
  if (colon == absl::string_view::npos || colon == 0) return std::nullopt;
  const absl::string_view host = address.substr(0, colon);
  if (absl::StrContains(host, ':') && !(host.front() == '[' && host.back() == ']')) {
    return std::nullopt;
  }
  int64_t port = 0;
  if (!absl::SimpleAtoi(address.substr(colon + 1), &port)) return std::nullopt;
  return port;
}

// The socket file a unix:PATH or unix:///ABSOLUTE address names ("" for any other address,
// unix-abstract:NAME included).
inline std::string UnixSocketPath(absl::string_view address) {
  if (!absl::ConsumePrefix(&address, "unix:")) return "";
  if (absl::StartsWith(address, "///")) address.remove_prefix(2);
  return std::string(address);
}

}  // namespace kvrecall

#endif  // KVRECALL_PROTO_HOST_PORT_H_
