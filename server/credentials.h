// Transport security of kvrecalld's gRPC port: plaintext, TLS, or mutual TLS from PEM files
// (--tls_cert, --tls_key, --tls_client_ca, read by server/tls_identity.h), with the
// bearer-token check of server/auth.h attached when --auth_token_file is given; with
// --plaintext_unix_sockets, plaintext credentials for the unix:PATH listeners beside the TLS
// ones, with the same token check.
#ifndef KVRECALL_SERVER_CREDENTIALS_H_
#define KVRECALL_SERVER_CREDENTIALS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
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
  // How often the TLS files are read again (SIGHUP reads them at once too); 0 (the default):
  // at start and at SIGHUP only. A certificate, key or client CA replaced on disk (cert-manager's
  // rotation through a mounted Secret, which the chart turns this on for) serves the connections
  // made after, while the sessions and the connections open stay. Files that cannot be used as
  // they are at a read (half a rotation: a certificate without its new key; a garbled key or CA)
  // keep the identity in force, said once on stderr and in kvrecall_tls_files_usable: gRPC reads
  // validated copies (GrpcTlsFiles), never the files themselves. With a period the files must
  // be regular files (a pipe would be emptied by the first read), else refused at start.
  int tls_refresh_seconds = 0;

  bool tls() const { return !tls_cert_file.empty(); }
};

// The gRPC port's TLS identity as gRPC reads it: copies in memory (memfds, which gRPC's file
// watcher reads through /proc/self/fd every kGrpcReadSeconds) of the files of --tls_cert,
// --tls_key and --tls_client_ca. A copy changes only to a whole identity ReadTlsIdentity
// accepted, so half a rotation or a garbled file on disk never reaches gRPC 1.51, which takes a
// pair as it reads it (failing every new handshake with a broken one) and logs on every read
// of a file that is missing.
class GrpcTlsFiles {
 public:
  // How often gRPC's watcher reads the copies: a new identity serves connections made from at
  // most this long after Refresh took it.
  static constexpr unsigned kGrpcReadSeconds = 1;

  // Reads the files of `options` (ReadTlsIdentity's errors, by flag) and makes their copies;
  // INTERNAL when they cannot be made (no memfd, no /proc).
  static absl::StatusOr<std::unique_ptr<GrpcTlsFiles>> Create(const SecurityOptions& options);
  ~GrpcTlsFiles();
  GrpcTlsFiles(const GrpcTlsFiles&) = delete;
  GrpcTlsFiles& operator=(const GrpcTlsFiles&) = delete;

  // Reads the files again: true when a changed identity replaced the copies, false when it is
  // unchanged; when they cannot be used, the refusal (ReadTlsIdentity's; INTERNAL when the
  // copies cannot be made), the copies as they were; FAILED_PRECONDITION, reading nothing,
  // when a file was not a regular file at start (a pipe: read once). Thread-safe; reads are
  // serialized, so a slow one never puts back what a later one took.
  absl::StatusOr<bool> Refresh() ABSL_LOCKS_EXCLUDED(mu_);
  // The certificate in force: its first certificate's notAfter, in seconds since 1970.
  int64_t not_after() const ABSL_LOCKS_EXCLUDED(mu_);

  // What gRPC's watcher reads: /proc/self/fd/N of the copies. The key and the certificate
  // chain are one file (the key's one PEM block as ReadTlsIdentity wrote it again, then the
  // chain's file: OpenSSL's key reader takes the first key block, its certificate reader skips
  // it), so that one dup3 swaps the pair and gRPC's check of the file's time before and after
  // its two reads sees a swap between them. client_ca_path() is empty without --tls_client_ca.
  std::string key_path() const;
  std::string cert_path() const;
  std::string client_ca_path() const;

 private:
  enum Copy { kKeyAndChain, kClientCa, kCopies };
  GrpcTlsFiles(const SecurityOptions& options, TlsIdentity identity, std::vector<int> slots);
  // Swaps `identity` into the copies, each as a new file with a modification time later than
  // the last, all made before any is swapped in: a failure to make them (INTERNAL) leaves the
  // copies as they were.
  absl::Status Publish(const TlsIdentity& identity) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string cert_file_, key_file_, client_ca_file_;
  // Why the files cannot be read again (a pipe), as found at start; OK when they can.
  const absl::Status rereadable_;
  // Descriptors whose numbers gRPC's paths name, per Copy (-1: no client CA). Never closed:
  // returned to a pool of the process at destruction, so that a watcher gRPC has not yet
  // stopped never reads another file under the same number.
  const std::vector<int> slots_;
  mutable absl::Mutex mu_;
  TlsIdentity identity_ ABSL_GUARDED_BY(mu_);
  int64_t last_mtime_ ABSL_GUARDED_BY(mu_) = 0;  // the copies' modification times increase
};

// A server's transport security and, with --auth_token_file, the tokens its calls carry.
struct ServerSecurity {
  // With TLS: the identity gRPC serves, read again by GrpcTlsFiles::Refresh. It must outlive
  // the server and the credentials (gRPC's watcher reads its copies until they are gone).
  std::shared_ptr<GrpcTlsFiles> tls_files;
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
