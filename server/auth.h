// Who is calling: bearer tokens mapped to tenants (--auth_token_file, "token tenant" lines),
// checked for every call but grpc.health.v1 by a gRPC AuthMetadataProcessor on every listener
// (TLS, and the plaintext Unix sockets of --plaintext_unix_sockets); the tenant of an
// authenticated call is its own token's (TenantOf). The same tables hold the tokens a scrape of
// the metrics endpoint must carry (--metrics_token_file, MetricsEndpoint).
#ifndef KVRECALL_SERVER_AUTH_H_
#define KVRECALL_SERVER_AUTH_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/security/auth_metadata_processor.h"
#include "grpcpp/server_context.h"
#include "server/file_util.h"
#include "server/metrics.h"

namespace kvrecall {

// Tokens shorter than this are refused when the file is loaded: they are too easy to guess.
inline constexpr int kMinTokenLength = 16;
inline constexpr int kMaxTenantLength = 64;

// The tokens of --auth_token_file (or --metrics_token_file). Immutable once parsed; thread-safe.
class TokenTable {
 public:
  // `text` holds one "TOKEN TENANT" pair per line, separated by spaces or tabs; blank lines
  // and lines starting with '#' are skipped (so no token can begin with '#': its line would
  // read as a comment). A token is printable ASCII without spaces, at
  // least kMinTokenLength long, and appears once; a tenant is 1..kMaxTenantLength characters
  // of [A-Za-z0-9._-] and may have several tokens (rotation). With `lone_token_tenant` not
  // empty, a line of a token alone is that tenant's (--metrics_token_file: a Secret holding
  // just the token that the scraper sends too), and the second field is a name of fewer than
  // kMinTokenLength characters (a longer one reads as a second token on the line). Messages
  // never echo a field. INVALID_ARGUMENT naming `source` and the line
  // otherwise, and for a file without any token.
  static absl::StatusOr<TokenTable> Parse(absl::string_view text, absl::string_view source,
                                          absl::string_view lone_token_tenant = "");
  // Reads and parses a file; NOT_FOUND / PERMISSION_DENIED when it cannot be read,
  // INVALID_ARGUMENT for a file not of `kind` (ReadFileToString's).
  static absl::StatusOr<TokenTable> Load(const std::string& path,
                                         absl::string_view lone_token_tenant = "",
                                         FileKind kind = FileKind::kAny);

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

// The token table in force. kvrecalld reads its file again on SIGHUP (Reload), so that a token
// is revoked or added without a restart losing every session; a call's check and its tenant
// each read the table once. Thread-safe.
class TokenStore {
 public:
  explicit TokenStore(std::shared_ptr<const TokenTable> table) : table_(std::move(table)) {}
  // The store of the token file `path` that the flag `flag` names (TokenTable::Load with
  // `lone_token_tenant`), its errors prefixed with the flag ("--auth_token_file: ...").
  static absl::StatusOr<std::shared_ptr<TokenStore>> FromFile(
      std::string flag, std::string path, std::string lone_token_tenant = "");
  // Reads the store's file again and puts its table in force: the number of tokens; the error,
  // prefixed with the flag, with the table in force kept when the file cannot be read or parsed;
  // FAILED_PRECONDITION, reading nothing, for a store not made from a file or from one that is
  // not a regular file (a pipe: read once, at start).
  absl::StatusOr<size_t> Reload();
  std::shared_ptr<const TokenTable> table() const {
    absl::MutexLock lock(&mu_);
    return table_;
  }
  void Replace(std::shared_ptr<const TokenTable> table) {
    absl::MutexLock lock(&mu_);
    table_ = std::move(table);
    epoch_.fetch_add(1, std::memory_order_release);
  }
  // How many times the table was replaced: a stream checks its token again only when this
  // changed since its last check (one atomic load per request otherwise).
  uint64_t epoch() const { return epoch_.load(std::memory_order_acquire); }

 private:
  // Where FromFile read the table ("" for a store made from a table).
  std::string flag_, path_, lone_token_tenant_;
  bool read_once_ = false;  // the file was not a regular file (a pipe) when first read
  mutable absl::Mutex mu_;
  std::shared_ptr<const TokenTable> table_ ABSL_GUARDED_BY(mu_);
  std::atomic<uint64_t> epoch_{0};
};

// The token of an "authorization" header's value "Bearer TOKEN" (the scheme in any case,
// surrounding spaces dropped), or "" when the value is not of that form.
absl::string_view BearerToken(absl::string_view authorization);

// Checks "authorization: Bearer TOKEN" on every call except grpc.health.v1.Health's (probes
// carry no token): a missing or unknown token fails the call with UNAUTHENTICATED before any
// service sees it. The header stays with the call: its tenant is read from it (TenantOf), not
// from the AuthContext, which gRPC shares between the calls of a connection, so that a
// connection carrying several tenants' calls (a gateway's) keeps each call to its own.
class TokenAuthProcessor final : public grpc::AuthMetadataProcessor {
 public:
  // `metrics` (may be null) counts the refusals and must outlive the server.
  TokenAuthProcessor(std::shared_ptr<const TokenStore> tokens, ServerMetrics* metrics)
      : tokens_(std::move(tokens)), metrics_(metrics) {}
  ~TokenAuthProcessor() override;  // by gRPC, after its last Process (proto/tsan_handoff.h)

  bool IsBlocking() const override { return false; }  // a table lookup: runs inline
  grpc::Status Process(const InputMetadata& auth_metadata, grpc::AuthContext* context,
                       OutputMetadata* consumed_auth_metadata,
                       OutputMetadata* response_metadata) override;

 private:
  const std::shared_ptr<const TokenStore> tokens_;
  ServerMetrics* const metrics_;
};

// The tenant of a call whose bearer token (CallBearerToken) is `token`: the token's tenant in
// `tokens` (a server without tokens gives every call the tenant "": KvRecallService::IdentityOf).
// A call the processor let through without a known token (health checks, or a call whose token
// a reload removed between the check and this lookup) gets kNoTenant, which the service refuses
// (UNAUTHENTICATED).
inline constexpr char kNoTenant[] = "?";
std::string TenantOf(const TokenTable& tokens, absl::string_view token);
// A call's bearer token ("" without an authorization header of the form "Bearer TOKEN").
absl::string_view CallBearerToken(const grpc::ServerContextBase& context);

}  // namespace kvrecall

#endif  // KVRECALL_SERVER_AUTH_H_
