// A TLS server's identity read from its PEM files and checked as a listener will use it: one
// code for the gRPC port's files (server/credentials.h) and the metrics endpoint's
// (server/metrics_endpoint.h), each error naming its flag.
#ifndef KVRECALL_SERVER_TLS_IDENTITY_H_
#define KVRECALL_SERVER_TLS_IDENTITY_H_

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "server/file_util.h"

namespace kvrecall {

// A TLS server's identity, read from its PEM files and checked as a listener will use it.
struct TlsIdentity {
  std::string cert_chain;   // PEM: the server's certificate first, then its chain
  // The key of cert_chain's first certificate alone, as ReadTlsIdentity writes it again (PKCS#8
  // PEM, unencrypted): nothing else of its file.
  std::string private_key;
  std::optional<std::string> client_ca;  // PEM roots (mutual TLS); nullopt: none asked for
  // When the chain served stops being valid: the earliest notAfter of cert_chain's
  // certificates (an intermediate may end before the server's own), in seconds since 1970.
  int64_t not_after = 0;
};

// Reads --PREFIXtls_cert, --PREFIXtls_key and, unless `client_ca_file` is empty,
// --PREFIXtls_client_ca (`flag_prefix` "" for the gRPC port's, "metrics_" for the metrics
// endpoint's: errors name the flag). INVALID_ARGUMENT for a certificate without its key (or the
// reverse), a file that is not PEM or does not parse, an encrypted key, a key that is not the
// certificate's, a certificate or key OpenSSL will not serve (a key too small for its security
// level); NOT_FOUND / PERMISSION_DENIED for unreadable files; with FileKind::kRegular,
// INVALID_ARGUMENT for a file that is not a regular one (ReadFileToString's).
absl::StatusOr<TlsIdentity> ReadTlsIdentity(const std::string& cert_file,
                                            const std::string& key_file,
                                            const std::string& client_ca_file,
                                            absl::string_view flag_prefix,
                                            FileKind files = FileKind::kAny);

// Whether `files` (the paths of --PREFIXtls_cert, --PREFIXtls_key, --PREFIXtls_client_ca, in
// that order; empty ones skipped) can be read again (--tls_refresh_seconds, SIGHUP): regular
// files, not pipes, which a read empties. INVALID_ARGUMENT naming the flag otherwise.
absl::Status RefreshableTlsFiles(const std::vector<std::string>& files,
                                 absl::string_view flag_prefix);
// A port's reads of its TLS files, timed: one running past `bound` is stalled (a hung mount).
// Whoever looks (the port's period thread finding a read under way, a scrape, a SIGHUP) learns
// it once (StalledNow), says so on stderr and turns the port's kvrecall_tls_files_usable to 0,
// since nothing is read meanwhile; the read's own outcome sets the gauge when it ends.
// Thread-safe.
class StalledTlsRead {
 public:
  // 3 periods; 30 s for files read at SIGHUP only (no period).
  static absl::Duration BoundFor(absl::Duration period) {
    return period > absl::ZeroDuration() ? 3 * period : absl::Seconds(30);
  }
  explicit StalledTlsRead(absl::Duration bound) : bound_(bound) {}

  void Begin() { started_ns_ = absl::GetCurrentTimeNanos(); }
  void End() {
    started_ns_ = 0;
    said_ = false;
  }
  bool reading() const { return started_ns_.load() != 0; }
  // True once per read that runs past the bound, to the first caller that finds it so.
  bool StalledNow() {
    const int64_t started = started_ns_.load();
    return started != 0 && absl::Nanoseconds(absl::GetCurrentTimeNanos() - started) > bound_ &&
           !said_.exchange(true);
  }
  // What the port says on stderr; `files`: "the gRPC port's", "the metrics endpoint's".
  std::string Message(absl::string_view files) const;

 private:
  const absl::Duration bound_;
  std::atomic<int64_t> started_ns_{0};  // the read's start; 0: none
  std::atomic<bool> said_{false};
};

// What reading the files of ReadTlsIdentity again (--tls_refresh_seconds, SIGHUP) finds
// against the identity `in_force`: the new identity when they changed, nullopt when unchanged;
// the refusal (RefreshableTlsFiles': a file replaced by a pipe; ReadTlsIdentity's) when they
// cannot be used; FAILED_PRECONDITION, reading nothing, when `at_start` (RefreshableTlsFiles'
// answer when they were first read) refused them: files given as pipes are read at start only.
absl::StatusOr<std::optional<TlsIdentity>> ReadTlsIdentityAgain(
    const std::string& cert_file, const std::string& key_file, const std::string& client_ca_file,
    absl::string_view flag_prefix, const TlsIdentity& in_force, const absl::Status& at_start);

// RefreshableTlsFiles at start with a --tls_refresh_seconds period, its refusal saying what to
// do instead.
absl::Status TlsFilesForAPeriod(const std::vector<std::string>& files,
                                absl::string_view flag_prefix);

// OpenSSL's reason for the last error of this thread's queue, which it empties ("" if none).
std::string OpenSslReason();

}  // namespace kvrecall

#endif  // KVRECALL_SERVER_TLS_IDENTITY_H_
