// Transport security of kvrecalld's gRPC port: plaintext, TLS, or mutual TLS from PEM files
// (--tls_cert, --tls_key, --tls_client_ca, read by server/tls_identity.h), with the
// bearer-token check of server/auth.h attached when --auth_token_file is given; with
// --plaintext_unix_sockets, plaintext credentials for the unix:PATH listeners beside the TLS
// ones, with the same token check.
#ifndef KVRECALL_SERVER_CREDENTIALS_H_
#define KVRECALL_SERVER_CREDENTIALS_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/security/server_credentials.h"
#include "server/auth.h"
#include "server/metrics.h"
#include "server/tls_identity.h"

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
  // With TLS: the unix:PATH listeners serve plaintext (their socket file, made 0600, admits
  // this process's user alone) while the TCP ones keep TLS. No client certificate is asked for
  // on them (--tls_client_ca applies to TLS listeners only); bearer tokens still are. Needs TLS;
  // StartServer also wants a unix:PATH address and no unix-abstract:NAME one, which has no
  // permissions.
  bool plaintext_unix_sockets = false;
  // How often the TLS files are read again (gRPC's file watcher); 0 (the default): at start
  // only. With a period, a certificate, key or client CA replaced on disk (cert-manager's
  // rotation through a mounted Secret, which the chart turns this on for) serves the
  // connections made after, while the sessions and the connections open stay. The files must
  // then be regular files with a modification time (gRPC 1.51's watcher reads them again and
  // takes a time of 0 for a failed stat), and the certificate and its key replaced in one step
  // (a Secret's update is): gRPC takes a pair as it reads it, and a file it cannot use at a
  // refresh (half a rotation, a garbled key or CA) fails new handshakes until the refresh after
  // the files are whole again, while connections open keep theirs. The metrics endpoint reads
  // its files on the same period (MetricsTlsFiles), keeping its pair until a whole new one is
  // there.
  int tls_refresh_seconds = 0;

  bool tls() const { return !tls_cert_file.empty(); }
};

// A server's transport security and, with --auth_token_file, the tokens its calls carry.
struct ServerSecurity {
  // Every listener's, but for the unix:PATH ones when unix_socket_credentials is set.
  std::shared_ptr<grpc::ServerCredentials> credentials;
  std::shared_ptr<TokenStore> tokens;  // null: no token check, every call tenant ""
  // With plaintext_unix_sockets, the unix:PATH listeners': plaintext (gRPC's local credentials,
  // which take Unix-socket connections alone) with the same token check; null otherwise.
  std::shared_ptr<grpc::ServerCredentials> unix_socket_credentials;
};

// The credentials `options` describe, files read now. INVALID_ARGUMENT for a combination that
// cannot work (a key without a certificate, a client CA, a token file or plaintext Unix
// sockets without TLS, a file that is not PEM) or a malformed token file; NOT_FOUND /
// PERMISSION_DENIED for unreadable files. `metrics` (may be null) counts unauthenticated calls
// and must outlive the server.
absl::StatusOr<ServerSecurity> MakeServerCredentials(const SecurityOptions& options,
                                                     ServerMetrics* metrics);

}  // namespace kvrecall

#endif  // KVRECALL_SERVER_CREDENTIALS_H_
