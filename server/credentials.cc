#include "server/credentials.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpc/grpc_security_constants.h"
#include "grpcpp/security/tls_certificate_provider.h"
#include "grpcpp/security/tls_credentials_options.h"
#include "server/auth.h"
#include "server/file_util.h"

namespace kvrecall {

namespace {

// Descriptor numbers that named the copies of a GrpcTlsFiles gone, each holding an empty file:
// the next GrpcTlsFiles takes them before making new ones, so a process starting servers in
// turn (tests) holds as many as it ever held at once.
absl::Mutex slot_pool_mu(absl::kConstInit);
std::vector<int>& SlotPool() ABSL_EXCLUSIVE_LOCKS_REQUIRED(slot_pool_mu) {
  static auto* pool = new std::vector<int>();
  return *pool;
}

// A new in-memory file holding `text`, modified at `mtime` (seconds), read-only (mode 0400) and
// sealed against writes, so that no other process of the user can change what gRPC reads through
// /proc/PID/fd: its descriptor, or -1 with errno set. An empty one (a pooled slot's) keeps mtime
// 0, which gRPC's watcher takes for a failed stat: it never takes an empty key from it.
int MemoryFile(absl::string_view text, int64_t mtime) {
  const int fd = ::memfd_create("kvrecalld-tls", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return -1;
  size_t written = 0;
  while (written < text.size()) {
    const ssize_t n = ::write(fd, text.data() + written, text.size() - written);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int error = errno;
      ::close(fd);
      errno = error;
      return -1;
    }
    written += static_cast<size_t>(n);
  }
  const timespec times[2] = {{.tv_sec = 0, .tv_nsec = UTIME_OMIT},
                             {.tv_sec = static_cast<time_t>(mtime), .tv_nsec = 0}};
  if (::futimens(fd, times) != 0 || ::fchmod(fd, 0400) != 0 ||
      ::fcntl(fd, F_ADD_SEALS, F_SEAL_WRITE | F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL) != 0) {
    const int error = errno;
    ::close(fd);
    errno = error;
    return -1;
  }
  return fd;
}

std::string ProcPath(int fd) { return fd < 0 ? "" : absl::StrCat("/proc/self/fd/", fd); }

// The key's one PEM block (ReadTlsIdentity's), then the chain's file: gRPC reads both the key and
// the chain from this one text (OpenSSL's key reader takes the first key block; its certificate
// reader skips it, and any key block of the chain's file).
std::string KeyAndChain(const TlsIdentity& identity) {
  std::string text = identity.private_key;
  if (!text.empty() && text.back() != '\n') text += '\n';
  return text + identity.cert_chain;
}

}  // namespace

absl::StatusOr<std::unique_ptr<GrpcTlsFiles>> GrpcTlsFiles::Create(const SecurityOptions& options) {
  absl::StatusOr<TlsIdentity> identity =
      ReadTlsIdentity(options.tls_cert_file, options.tls_key_file, options.tls_client_ca_file, "");
  if (!identity.ok()) return identity.status();
  std::vector<int> slots(kCopies, -1);
  {
    absl::MutexLock lock(&slot_pool_mu);
    for (int copy = 0; copy < kCopies; ++copy) {
      if (copy == kClientCa && !identity->client_ca) continue;
      if (!SlotPool().empty()) {
        slots[copy] = SlotPool().back();
        SlotPool().pop_back();
        continue;
      }
      slots[copy] = MemoryFile("", 0);
      if (slots[copy] < 0) {
        const int error = errno;
        for (int made : slots) {
          if (made >= 0) SlotPool().push_back(made);
        }
        return absl::InternalError(absl::StrCat(
            "cannot keep the TLS files in memory for gRPC (memfd_create: ", strerror(error), ")"));
      }
    }
  }
  std::unique_ptr<GrpcTlsFiles> files(new GrpcTlsFiles(options, *identity, std::move(slots)));
  {
    absl::MutexLock lock(&files->mu_);
    if (absl::Status s = files->Publish(*identity); !s.ok()) return s;
  }
  // gRPC reads the copies by path: one read back says it can (a /proc is mounted).
  absl::StatusOr<std::string> read_back = ReadFileToString(files->cert_path());
  if (!read_back.ok() || *read_back != KeyAndChain(*identity)) {
    return absl::InternalError(absl::StrCat(
        "cannot hand the TLS files to gRPC through ", files->cert_path(), " (is /proc mounted?)",
        read_back.ok() ? "" : ": ", read_back.ok() ? "" : read_back.status().message()));
  }
  return files;
}

GrpcTlsFiles::GrpcTlsFiles(const SecurityOptions& options, TlsIdentity identity,
                           std::vector<int> slots)
    : cert_file_(options.tls_cert_file),
      key_file_(options.tls_key_file),
      client_ca_file_(options.tls_client_ca_file),
      rereadable_(RefreshableTlsFiles({cert_file_, key_file_, client_ca_file_}, "")),
      slots_(std::move(slots)),
      identity_(std::move(identity)) {}

GrpcTlsFiles::~GrpcTlsFiles() {
  absl::MutexLock lock(&slot_pool_mu);
  for (int slot : slots_) {
    if (slot < 0) continue;
    // Empty, so that whatever reads it finds no key; the number stays this process's.
    const int empty = MemoryFile("", 0);
    if (empty >= 0) {
      ::dup3(empty, slot, O_CLOEXEC);
      ::close(empty);
    }
    SlotPool().push_back(slot);
  }
}

absl::Status GrpcTlsFiles::Publish(const TlsIdentity& identity) {
  // gRPC reads the pair's file twice (key, chain) between two looks at its time and reads again
  // when the time changed: a time later than the last, so that a swap between its reads is
  // seen.
  const int64_t mtime = std::max<int64_t>(last_mtime_ + 1, absl::ToUnixSeconds(absl::Now()));
  const std::string texts[kCopies] = {KeyAndChain(identity), identity.client_ca.value_or("")};
  // Two phases: every new file made first (what can fail: memory, descriptors), then each
  // swapped in (dup3 onto a number in use needs no new descriptor).
  int made[kCopies] = {-1, -1};
  for (int copy = 0; copy < kCopies; ++copy) {
    if (slots_[copy] < 0) continue;
    made[copy] = MemoryFile(texts[copy], mtime);
    if (made[copy] < 0) {
      const int error = errno;
      for (int fd : made) {
        if (fd >= 0) ::close(fd);
      }
      return absl::InternalError(
          absl::StrCat("cannot keep the TLS files in memory for gRPC: ", strerror(error)));
    }
  }
  int error = 0;
  for (int copy = 0; copy < kCopies; ++copy) {
    if (made[copy] < 0) continue;
    int swapped;
    do {
      swapped = ::dup3(made[copy], slots_[copy], O_CLOEXEC);
    } while (swapped < 0 && (errno == EINTR || errno == EBUSY));
    if (swapped < 0 && error == 0) error = errno;
    ::close(made[copy]);
  }
  last_mtime_ = mtime;
  if (error != 0) {
    return absl::InternalError(
        absl::StrCat("cannot swap the TLS files gRPC reads: dup3: ", strerror(error)));
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> GrpcTlsFiles::Refresh() {
  // Serialized whole: a read of the old files finishing after a read of the new ones would put
  // the old identity back.
  absl::MutexLock lock(&mu_);
  absl::StatusOr<std::optional<TlsIdentity>> read =
      ReadTlsIdentityAgain(cert_file_, key_file_, client_ca_file_, "", identity_, rereadable_);
  if (!read.ok()) return read.status();
  if (!read->has_value()) return false;
  if (absl::Status s = Publish(**read); !s.ok()) return s;
  identity_ = **std::move(read);
  return true;
}

int64_t GrpcTlsFiles::not_after() const {
  absl::MutexLock lock(&mu_);
  return identity_.not_after;
}

std::string GrpcTlsFiles::key_path() const { return ProcPath(slots_[kKeyAndChain]); }
std::string GrpcTlsFiles::cert_path() const { return ProcPath(slots_[kKeyAndChain]); }
std::string GrpcTlsFiles::client_ca_path() const { return ProcPath(slots_[kClientCa]); }

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
    ServerSecurity plaintext;
    plaintext.credentials = grpc::InsecureServerCredentials();
    return plaintext;
  }
  // Before the files are read: a pipe would be read (and emptied) here first.
  if (options.tls_refresh_seconds > 0) {
    if (absl::Status s = TlsFilesForAPeriod(
            {options.tls_cert_file, options.tls_key_file, options.tls_client_ca_file}, "");
        !s.ok()) {
      return s;
    }
  }
  absl::StatusOr<std::unique_ptr<GrpcTlsFiles>> files = GrpcTlsFiles::Create(options);
  if (!files.ok()) return files.status();
  ServerSecurity security;
  security.tls_files = *std::move(files);
  // gRPC reads the copies every second (cheap: memory), so an identity Refresh took serves new
  // connections within it; the files on disk are read on --tls_refresh_seconds' period and at
  // SIGHUP (RunningServer).
  auto provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      security.tls_files->key_path(), security.tls_files->cert_path(),
      security.tls_files->client_ca_path(), GrpcTlsFiles::kGrpcReadSeconds);
  grpc::experimental::TlsServerCredentialsOptions tls(provider);
  tls.watch_identity_key_cert_pairs();
  if (!options.tls_client_ca_file.empty()) {
    tls.watch_root_certs();
    tls.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  } else {
    tls.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  }
  security.credentials = grpc::experimental::TlsServerCredentials(tls);
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
