// Who is calling: bearer tokens mapped to tenants (--auth_token_file, "token tenant" lines),
// checked for every call but grpc.health.v1 by a gRPC AuthMetadataProcessor on the TLS port;
// the tenant of an authenticated call is a property of its AuthContext (TenantOf).
#ifndef KVRECALL_SERVER_AUTH_H_
#define KVRECALL_SERVER_AUTH_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/security/auth_metadata_processor.h"
#include "grpcpp/server_context.h"
#include "server/metrics.h"

namespace kvrecall {

// The AuthContext property that holds an authenticated call's tenant.
inline constexpr char kTenantProperty[] = "kvrecall_tenant";
// Tokens shorter than this are refused when the file is loaded: they are too easy to guess.
inline constexpr int kMinTokenLength = 16;
inline constexpr int kMaxTenantLength = 64;

// The tokens of --auth_token_file. Immutable once parsed; thread-safe.
class TokenTable {
 public:
  // `text` holds one "TOKEN TENANT" pair per line, separated by spaces or tabs; blank lines
  // and lines starting with '#' are skipped. A token is printable ASCII without spaces, at
  // least kMinTokenLength long, and appears once; a tenant is 1..kMaxTenantLength characters
  // of [A-Za-z0-9._-] and may have several tokens (rotation). INVALID_ARGUMENT naming
  // `source` and the line otherwise, and for a file without any token.
  static absl::StatusOr<TokenTable> Parse(absl::string_view text, absl::string_view source);
  // Reads and parses a file; NOT_FOUND / PERMISSION_DENIED when it cannot be read.
  static absl::StatusOr<TokenTable> Load(const std::string& path);

  // The tenant of `token`, or nullptr. Compares against every token in constant time per
  // token, so that the time taken does not tell how much of a guess was right.
  const std::string* Find(absl::string_view token) const;
  size_t size() const { return entries_.size(); }

 private:
  struct Entry {
    std::string token;
    std::string tenant;
  };
  std::vector<Entry> entries_;
};

// Checks "authorization: Bearer TOKEN" on every call except grpc.health.v1.Health's (probes
// carry no token): a missing or unknown token fails the call with UNAUTHENTICATED before any
// service sees it. A known token's tenant becomes the call's kTenantProperty (and its peer
// identity); the authorization header is consumed, so services never see the token.
class TokenAuthProcessor final : public grpc::AuthMetadataProcessor {
 public:
  // `metrics` (may be null) counts the refusals and must outlive the server.
  TokenAuthProcessor(TokenTable tokens, ServerMetrics* metrics)
      : tokens_(std::move(tokens)), metrics_(metrics) {}
  ~TokenAuthProcessor() override;  // by gRPC, after its last Process (proto/tsan_handoff.h)

  bool IsBlocking() const override { return false; }  // a table lookup: runs inline
  grpc::Status Process(const InputMetadata& auth_metadata, grpc::AuthContext* context,
                       OutputMetadata* consumed_auth_metadata,
                       OutputMetadata* response_metadata) override;

 private:
  const TokenTable tokens_;
  ServerMetrics* const metrics_;
};

// The tenant of a call: its kTenantProperty, or "" when the server authenticates no one.
std::string TenantOf(const grpc::ServerContextBase& context);

}  // namespace kvrecall

#endif  // KVRECALL_SERVER_AUTH_H_
