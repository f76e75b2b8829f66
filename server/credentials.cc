#include "server/credentials.h"

#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "grpc/grpc_security_constants.h"
#include "grpcpp/security/tls_certificate_provider.h"
#include "grpcpp/security/tls_credentials_options.h"
#include "server/auth.h"

namespace kvrecall {

absl::StatusOr<ServerSecurity> MakeServerCredentials(const SecurityOptions& options,
                                                     ServerMetrics* metrics) {
  if (options.tls_cert_file.empty() && options.tls_key_file.empty()) {
    if (!options.tls_client_ca_file.empty()) {
      return absl::InvalidArgumentError(
          "--tls_client_ca (mutual TLS) needs --tls_cert and --tls_key");
    }
    if (!options.auth_token_file.empty()) {
      return absl::InvalidArgumentError(
          "--auth_token_file needs --tls_cert and --tls_key: gRPC clients send bearer tokens "
          "only over TLS, and a token sent in plaintext could be read on the way");
    }
    // Refused rather than ignored: whoever asks for it expects the TCP listeners to be TLS.
    if (options.plaintext_unix_sockets) {
      return absl::InvalidArgumentError(
          "--plaintext_unix_sockets needs --tls_cert and --tls_key: it exempts the unix:PATH "
          "sockets from TLS, and without TLS every address is plaintext already");
    }
    return ServerSecurity{grpc::InsecureServerCredentials(), nullptr};
  }
  // Before the files are read: a pipe would be read (and emptied) here first.
  if (options.tls_refresh_seconds > 0) {
    if (absl::Status s = RefreshableTlsFiles(
            {options.tls_cert_file, options.tls_key_file, options.tls_client_ca_file}, "");
        !s.ok()) {
      return s;
    }
  }
  absl::StatusOr<TlsIdentity> identity = ReadTlsIdentity(
      options.tls_cert_file, options.tls_key_file, options.tls_client_ca_file, "");
  if (!identity.ok()) return identity.status();
  ServerSecurity security;
  if (options.tls_refresh_seconds <= 0) {
    grpc::SslServerCredentialsOptions ssl;
    ssl.pem_key_cert_pairs.push_back(
        {std::move(identity->private_key), std::move(identity->cert_chain)});
    if (identity->client_ca) {
      ssl.pem_root_certs = *std::move(identity->client_ca);
      ssl.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
    }
    security.credentials = grpc::SslServerCredentials(ssl);
  } else {
    // gRPC reads the files again every refresh (checked above: RefreshableTlsFiles, then
    // ReadTlsIdentity). It takes a pair as it reads it, retrying while the files
    // change under it (a Secret's update, one rename of their directory, is then read whole);
    // a file it cannot use at a refresh fails new handshakes until the refresh after the files
    // are whole again, while connections open keep theirs.
    auto files = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
        options.tls_key_file, options.tls_cert_file, options.tls_client_ca_file,
        static_cast<unsigned int>(options.tls_refresh_seconds));
    grpc::experimental::TlsServerCredentialsOptions tls(files);
    tls.watch_identity_key_cert_pairs();
    if (identity->client_ca) {
      tls.watch_root_certs();
      tls.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
    } else {
      tls.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
    }
    security.credentials = grpc::experimental::TlsServerCredentials(tls);
  }
  // gRPC's local credentials for Unix sockets: plaintext HTTP/2 on the wire (a plaintext
  // client connects as it would to InsecureServerCredentials), refusing any connection that is
  // not over a Unix socket, and, unlike InsecureServerCredentials (whose
  // SetAuthMetadataProcessor aborts the process), running the token check below. Their calls
  // count as private, so a client's call credentials (grpc::AccessTokenCredentials composed
  // with grpc::experimental::LocalCredentials(UDS)) send the token over them.
  if (options.plaintext_unix_sockets) {
    security.unix_socket_credentials = grpc::experimental::LocalServerCredentials(UDS);
  }
  if (!options.auth_token_file.empty()) {
    absl::StatusOr<std::shared_ptr<TokenStore>> tokens =
        TokenStore::FromFile("--auth_token_file", options.auth_token_file);
    if (!tokens.ok()) return tokens.status();
    security.tokens = *std::move(tokens);
    security.credentials->SetAuthMetadataProcessor(
        std::make_shared<TokenAuthProcessor>(security.tokens, metrics));
    if (security.unix_socket_credentials != nullptr) {
      security.unix_socket_credentials->SetAuthMetadataProcessor(
          std::make_shared<TokenAuthProcessor>(security.tokens, metrics));
    }
  }
  return security;
}

}  // namespace kvrecall
