#include "server/credentials.h"

#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "grpc/grpc_security_constants.h"
#include "server/auth.h"
#include "server/file_util.h"

namespace kvrecall {
namespace {

// The file's PEM text when it holds a block of `kind` ("CERTIFICATE", "PRIVATE KEY" matches
// "RSA PRIVATE KEY" and "EC PRIVATE KEY" too); `flag` names it in errors.
absl::StatusOr<std::string> ReadPem(const std::string& path, absl::string_view kind,
                                    absl::string_view flag) {
  absl::StatusOr<std::string> text = ReadFileToString(path);
  if (!text.ok()) {
    return absl::Status(text.status().code(), absl::StrCat(flag, ": ", text.status().message()));
  }
  if (!absl::StrContains(*text, "-----BEGIN ") ||
      !absl::StrContains(*text, absl::StrCat(kind, "-----"))) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": ", path, " holds no PEM ", kind, " block"));
  }
  return text;
}

}  // namespace

absl::StatusOr<ServerSecurity> MakeServerCredentials(const SecurityOptions& options,
                                                     ServerMetrics* metrics) {
  if (options.tls_cert_file.empty() != options.tls_key_file.empty()) {
    return absl::InvalidArgumentError(
        "--tls_cert and --tls_key go together: give both (TLS) or neither (plaintext)");
  }
  if (!options.tls()) {
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
  absl::StatusOr<std::string> cert = ReadPem(options.tls_cert_file, "CERTIFICATE", "--tls_cert");
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = ReadPem(options.tls_key_file, "PRIVATE KEY", "--tls_key");
  // gRPC cannot ask for a passphrase: an encrypted key only failed later, as an address that
  // could not be listened on.
  if (key.ok() && (absl::StrContains(*key, "ENCRYPTED PRIVATE KEY") ||
                   absl::StrContains(*key, "Proc-Type: 4,ENCRYPTED"))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--tls_key: ", options.tls_key_file,
        " is encrypted, which kvrecalld cannot use; decrypt it (openssl pkey -in KEY -out "
        "PLAIN) and protect the file instead"));
  }
  if (!key.ok()) return key.status();
  grpc::SslServerCredentialsOptions ssl;
  ssl.pem_key_cert_pairs.push_back({*std::move(key), *std::move(cert)});
  if (!options.tls_client_ca_file.empty()) {
    absl::StatusOr<std::string> ca =
        ReadPem(options.tls_client_ca_file, "CERTIFICATE", "--tls_client_ca");
    if (!ca.ok()) return ca.status();
    ssl.pem_root_certs = *std::move(ca);
    ssl.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  ServerSecurity security{grpc::SslServerCredentials(ssl), nullptr};
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
    absl::StatusOr<TokenTable> tokens = TokenTable::Load(options.auth_token_file);
    if (!tokens.ok()) {
      return absl::Status(tokens.status().code(),
                          absl::StrCat("--auth_token_file: ", tokens.status().message()));
    }
    security.tokens =
        std::make_shared<TokenStore>(std::make_shared<const TokenTable>(*std::move(tokens)));
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
