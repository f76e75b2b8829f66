// Transport security of kvrecalld's gRPC port: plaintext, TLS, or mutual TLS from PEM files
// (--tls_cert, --tls_key, --tls_client_ca), with the bearer-token check of server/auth.h
// attached when --auth_token_file is given.
#ifndef KVRECALL_SERVER_CREDENTIALS_H_
#define KVRECALL_SERVER_CREDENTIALS_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/security/server_credentials.h"
#include "server/auth.h"
#include "server/metrics.h"

namespace kvrecall {

struct SecurityOptions {
  // PEM certificate chain and private key of the server; both empty: plaintext.
  std::string tls_cert_file;
  std::string tls_key_file;
  // PEM roots: with it, clients must present a certificate they signed (mutual TLS).
  std::string tls_client_ca_file;
  // "TOKEN TENANT" lines (server/auth.h); empty: no token check. Needs TLS: gRPC clients send
  // bearer tokens only over TLS, and a token sent in plaintext is anyone's.
  std::string auth_token_file;

  bool tls() const { return !tls_cert_file.empty(); }
};

// A server's transport security and, with --auth_token_file, the tokens its calls carry.
struct ServerSecurity {
  std::shared_ptr<grpc::ServerCredentials> credentials;
  std::shared_ptr<TokenStore> tokens;  // null: no token check, every call tenant ""
};

// The credentials `options` describe, files read now. INVALID_ARGUMENT for a combination that
// cannot work (a key without a certificate, a client CA or a token file without TLS, a file
// that is not PEM) or a malformed token file; NOT_FOUND / PERMISSION_DENIED for unreadable
// files. `metrics` (may be null) counts unauthenticated calls and must outlive the server.
absl::StatusOr<ServerSecurity> MakeServerCredentials(const SecurityOptions& options,
                                                     ServerMetrics* metrics);

}  // namespace kvrecall

#endif  // KVRECALL_SERVER_CREDENTIALS_H_
