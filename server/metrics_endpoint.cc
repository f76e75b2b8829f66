#include "server/metrics_endpoint.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/strings/string_view.h"
#include "prometheus/text_serializer.h"

namespace kvrecall {
namespace {

std::string HttpResponse(absl::string_view status, absl::string_view content_type,
                         absl::string_view body, bool with_body, absl::string_view extra = "") {
  return absl::StrCat("HTTP/1.1 ", status, "\r\nContent-Type: ", content_type,
                      "\r\nContent-Length: ", body.size(), "\r\n", extra,
                      "Connection: close\r\n\r\n", with_body ? body : "");
}

std::string PlainResponse(absl::string_view status, bool with_body,
                          absl::string_view extra = "") {
  return HttpResponse(status, "text/plain; charset=utf-8", absl::StrCat(status, "\n"), with_body,
                      extra);
}

using UniqueSsl = std::unique_ptr<SSL, decltype(&SSL_free)>;

// One peer's connection: its request as read so far, then its response as written so far.
struct Connection {
  int fd = -1;
  absl::Time deadline;
  UniqueSsl ssl{nullptr, &SSL_free};  // null: plain HTTP
  std::string request;
  std::string response;  // non-empty once the request is complete
  size_t sent = 0;
  bool draining = false;  // response sent and our side shut: reading until the peer closes
  // What the last TLS read or write waited for (POLLIN, POLLOUT; 0: none): a handshake or a
  // renegotiation attempt may need to write while the connection reads, or the reverse.
  short tls_waits_for = 0;
  // TLS: the peer's first byte has been seen to open a TLS handshake (else it is plain HTTP,
  // answered with a 400 that says so).
  bool tls_opened = false;
  // TLS: the handshake failed (counted as the endpoint's refusal when the connection closes).
  bool tls_handshake_failed = false;

  // Reading the request (its TLS handshake included), or draining after the response.
  bool reading() const { return response.empty() || draining; }
  short events() const {
    if (tls_waits_for != 0 && !draining) return tls_waits_for;
    return reading() ? POLLIN : POLLOUT;
  }
  // Not being answered: its request is incomplete, or its response is sent and the peer keeps
  // the connection open. The endpoint full, a new peer takes the place of the oldest of these.
  bool Evictable() const { return reading(); }
};

// What one read or write on a connection came to.
enum class Io { kDone, kWouldBlock, kClosed };

// The outcome of a TLS read or write that returned `result`: what it waits for goes to `c`.
Io TlsOutcome(Connection& c, int result) {
  switch (SSL_get_error(c.ssl.get(), result)) {
    case SSL_ERROR_WANT_READ:
      c.tls_waits_for = POLLIN;
      return Io::kWouldBlock;
    case SSL_ERROR_WANT_WRITE:
      c.tls_waits_for = POLLOUT;
      return Io::kWouldBlock;
    case SSL_ERROR_SSL:  // a failed handshake or a broken record: nothing more to do
      c.tls_handshake_failed = !SSL_is_init_finished(c.ssl.get());
      ERR_clear_error();
      return Io::kClosed;
    default:  // the peer closed or reset the connection
      ERR_clear_error();
      return Io::kClosed;
  }
}

// A TLS connection's first byte: a handshake record's (22) opens TLS; any other (an HTTP
// method's letter: a scraper or curl told http://) turns the connection into a plain one
// answered with a 400 naming the scheme, instead of a closed connection that says nothing.
Io OpenTls(Connection& c) {
  unsigned char first = 0;
  const ssize_t peeked = ::recv(c.fd, &first, 1, MSG_PEEK | MSG_DONTWAIT);
  if (peeked == 0) return Io::kClosed;
  if (peeked < 0) return errno == EAGAIN || errno == EINTR ? Io::kWouldBlock : Io::kClosed;
  if (first == 22) {
    c.tls_opened = true;
    return Io::kDone;
  }
  c.ssl.reset();
  c.response = HttpResponse(
      "400 Bad Request", "text/plain; charset=utf-8",
      "400 Bad Request: this endpoint speaks HTTPS: use https:// with this host and port\n", true);
  return Io::kDone;
}

// Reads what the peer sent (the plaintext, with TLS) into `buffer`, `*n` bytes.
Io ReadSome(Connection& c, char* buffer, size_t size, size_t* n) {
  if (c.ssl != nullptr && !c.draining) {
    const int result = SSL_read_ex(c.ssl.get(), buffer, size, n);
    if (result == 1) {
      c.tls_waits_for = 0;
      return Io::kDone;
    }
    return TlsOutcome(c, result);
  }
  // Draining a TLS connection reads its records raw and drops them, as a plain one's bytes.
  const ssize_t read = ::recv(c.fd, buffer, size, MSG_DONTWAIT);
  if (read > 0) {
    *n = static_cast<size_t>(read);
    return Io::kDone;
  }
  return read < 0 && (errno == EAGAIN || errno == EINTR) ? Io::kWouldBlock : Io::kClosed;
}

// Writes the response's next bytes, `*n` of them.
Io WriteSome(Connection& c, size_t* n) {
  const char* data = c.response.data() + c.sent;
  const size_t size = c.response.size() - c.sent;
  if (c.ssl != nullptr) {
    const int result = SSL_write_ex(c.ssl.get(), data, size, n);
    if (result == 1) {
      c.tls_waits_for = 0;
      return Io::kDone;
    }
    return TlsOutcome(c, result);
  }
  // MSG_NOSIGNAL: a peer that reset the connection must not raise SIGPIPE.
  const ssize_t written = ::send(c.fd, data, size, MSG_DONTWAIT | MSG_NOSIGNAL);
  if (written > 0) {
    *n = static_cast<size_t>(written);
    return Io::kDone;
  }
  return written < 0 && (errno == EAGAIN || errno == EINTR) ? Io::kWouldBlock : Io::kClosed;
}

// A server context for `identity`: TLS 1.2 or later, its certificate chain and key, and, with
// its client_ca, client certificates required and checked against those roots. HTTP/1.1 is
// what it speaks: it selects no ALPN protocol, so that a client offering h2 falls back.
absl::StatusOr<SSL_CTX*> MakeTlsContext(const TlsIdentity& identity) {
  std::unique_ptr<SSL_CTX, decltype(&SSL_CTX_free)> context(SSL_CTX_new(TLS_server_method()),
                                                            &SSL_CTX_free);
  auto refused = [](absl::string_view what) {
    return absl::InvalidArgumentError(
        absl::StrCat("the metrics endpoint's TLS: OpenSSL refused ", what, " (", OpenSslReason(),
                     ")"));
  };
  if (context == nullptr) return refused("no context");
  SSL_CTX_set_min_proto_version(context.get(), TLS1_2_VERSION);
  // No session resumption: every response closes its connection, so a ticket would only cost a
  // write per scrape, and with client certificates required a resumption attempt without a
  // session id context is a fatal handshake error (review 29: curl's second URL, nginx).
  SSL_CTX_set_options(context.get(), SSL_OP_NO_RENEGOTIATION | SSL_OP_CIPHER_SERVER_PREFERENCE |
                                         SSL_OP_NO_TICKET);
  SSL_CTX_set_num_tickets(context.get(), 0);
  SSL_CTX_set_session_cache_mode(context.get(), SSL_SESS_CACHE_OFF);
  static constexpr unsigned char kSessionContext[] = "kvrecalld-metrics";
  SSL_CTX_set_session_id_context(context.get(), kSessionContext, sizeof kSessionContext - 1);
  SSL_CTX_set_mode(context.get(),
                   SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
  auto bio_of = [](const std::string& pem) {
    return std::unique_ptr<BIO, decltype(&BIO_free)>(
        BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())), &BIO_free);
  };
  {
    auto bio = bio_of(identity.cert_chain);
    X509* leaf = bio ? PEM_read_bio_X509_AUX(bio.get(), nullptr, nullptr, nullptr) : nullptr;
    const bool used = leaf != nullptr && SSL_CTX_use_certificate(context.get(), leaf) == 1;
    X509_free(leaf);
    if (!used) return refused("--metrics_tls_cert's certificate");
    // The rest of the chain, sent after the server's own.
    while (X509* next = PEM_read_bio_X509_AUX(bio.get(), nullptr, nullptr, nullptr)) {
      if (SSL_CTX_add0_chain_cert(context.get(), next) != 1) {
        X509_free(next);
        return refused("--metrics_tls_cert's chain");
      }
    }
    ERR_clear_error();  // the end of the file
  }
  {
    auto bio = bio_of(identity.private_key);
    // Never OpenSSL's default passphrase prompt on the terminal (ReadTlsIdentity refused an
    // encrypted key already).
    pem_password_cb* no_passphrase = [](char*, int, int, void*) { return -1; };
    EVP_PKEY* key =
        bio ? PEM_read_bio_PrivateKey(bio.get(), nullptr, no_passphrase, nullptr) : nullptr;
    const bool used = key != nullptr && SSL_CTX_use_PrivateKey(context.get(), key) == 1;
    EVP_PKEY_free(key);
    if (!used || SSL_CTX_check_private_key(context.get()) != 1) {
      return refused("--metrics_tls_key's key");
    }
  }
  if (identity.client_ca) {
    auto bio = bio_of(*identity.client_ca);
    X509_STORE* roots = SSL_CTX_get_cert_store(context.get());
    STACK_OF(X509_NAME)* names = sk_X509_NAME_new_null();
    if (names == nullptr) return refused("--metrics_tls_client_ca (no memory)");
    SSL_CTX_set_client_CA_list(context.get(), names);  // named in the CertificateRequest
    while (X509* root = PEM_read_bio_X509_AUX(bio.get(), nullptr, nullptr, nullptr)) {
      X509_NAME* name = X509_NAME_dup(X509_get_subject_name(root));
      const bool added = X509_STORE_add_cert(roots, root) == 1 && name != nullptr &&
                         sk_X509_NAME_push(names, name) > 0;
      X509_free(root);
      if (!added) {
        X509_NAME_free(name);
        return refused("--metrics_tls_client_ca's roots");
      }
    }
    ERR_clear_error();  // the end of the file
    SSL_CTX_set_verify(context.get(), SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT,
                       nullptr);
  }
  return context.release();
}

// `request` without the empty lines that may precede its request line (RFC 9112 2.2: ignored).
absl::string_view WithoutLeadingEmptyLines(absl::string_view request) {
  while (absl::ConsumePrefix(&request, "\r\n") || absl::ConsumePrefix(&request, "\n")) {
  }
  return request;
}

// The value of the first Authorization header of `request` (its request line, then its header
// lines up to the empty one; the name in any case), "" without one.
absl::string_view AuthorizationHeader(absl::string_view request) {
  bool request_line = true;
  for (absl::string_view line : absl::StrSplit(request, '\n')) {
    line = absl::StripTrailingAsciiWhitespace(line);
    if (std::exchange(request_line, false)) continue;
    if (line.empty()) break;  // the end of the headers
    const size_t colon = line.find(':');
    if (colon != absl::string_view::npos &&
        absl::EqualsIgnoreCase(line.substr(0, colon), "authorization")) {
      return absl::StripAsciiWhitespace(line.substr(colon + 1));
    }
  }
  return "";
}


}  // namespace

MetricsEndpoint::MetricsEndpoint(std::shared_ptr<ServerMetrics> metrics,
                                 std::shared_ptr<const TokenStore> scrapers,
                                 std::optional<MetricsTlsFiles> files, TlsIdentity identity,
                                 SSL_CTX* tls, int listener, const int wake[2], std::string address,
                                 int port)
    : metrics_(std::move(metrics)),
      scrapers_(std::move(scrapers)),
      tls_files_(std::move(files)),
      rereadable_(tls_files_ ? RefreshableTlsFiles({tls_files_->cert_file, tls_files_->key_file,
                                                    tls_files_->client_ca_file},
                                                   "metrics_")
                             : absl::OkStatus()),
      tls_identity_(std::move(identity)),
      tls_(tls),
      tls_stall_(StalledTlsRead::BoundFor(tls_files_ ? tls_files_->refresh : absl::ZeroDuration())),
      listener_(listener),
      wake_{wake[0], wake[1]},
      address_(std::move(address)),
      port_(port) {
  thread_ = std::thread([this] { Serve(); });
  if (tls_files_ && tls_files_->refresh > absl::ZeroDuration()) {
    tls_refresh_ = std::thread([this] {
      while (!stop_tls_refresh_.WaitForNotificationWithTimeout(tls_files_->refresh)) RefreshTls();
    });
  }
}

void MetricsEndpoint::CheckStalledTlsRead() {
  if (tls_stall_.StalledNow()) {
    std::fputs(tls_stall_.Message("the metrics endpoint's").c_str(), stderr);
    metrics_->SetTlsFilesUsable("metrics", false);
  }
}

void MetricsEndpoint::StopRefreshing() {
  absl::MutexLock lock(&stop_mu_);
  if (!stop_tls_refresh_.HasBeenNotified()) stop_tls_refresh_.Notify();
}

MetricsEndpoint::~MetricsEndpoint() {
  StopRefreshing();
  if (tls_refresh_.joinable()) tls_refresh_.join();
  const char stop = 1;
  [[maybe_unused]] const ssize_t written = ::write(wake_[1], &stop, 1);
  if (thread_.joinable()) thread_.join();
  ::close(listener_);
  ::close(wake_[0]);
  ::close(wake_[1]);
  absl::MutexLock lock(&tls_mu_);
  SSL_CTX_free(tls_);
}

absl::StatusOr<std::unique_ptr<MetricsEndpoint>> MetricsEndpoint::Start(
    const std::string& address, std::shared_ptr<ServerMetrics> metrics,
    std::shared_ptr<const TokenStore> scrapers, const MetricsTlsFiles* tls) {
  TlsIdentity identity;
  SSL_CTX* context = nullptr;
  if (tls != nullptr) {
    // Before the files are read: a pipe would be read (and emptied) here first.
    if (tls->refresh > absl::ZeroDuration()) {
      if (absl::Status s =
              TlsFilesForAPeriod({tls->cert_file, tls->key_file, tls->client_ca_file}, "metrics_");
          !s.ok()) {
        return s;
      }
    }
    absl::StatusOr<TlsIdentity> read =
        ReadTlsIdentity(tls->cert_file, tls->key_file, tls->client_ca_file, "metrics_");
    if (!read.ok()) return read.status();
    absl::StatusOr<SSL_CTX*> made = MakeTlsContext(*read);
    if (!made.ok()) return made.status();
    identity = *std::move(read);
    context = *made;
  }
  // Freed on every failure below.
  std::unique_ptr<SSL_CTX, decltype(&SSL_CTX_free)> owned_context(context, &SSL_CTX_free);
  const size_t colon = address.rfind(':');
  int requested_port = -1;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(address.substr(colon + 1), &requested_port) || requested_port < 0 ||
      requested_port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "metrics address '", address, "' must be HOST:PORT with a port in [0, 65535]"));
  }
  std::string host = address.substr(0, colon);
  // [::1]:9090 names an IPv6 host; the socket calls want it bare.
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  auto unavailable = [&](absl::string_view why) {
    return absl::UnavailableError(
        absl::StrCat("could not serve metrics on ", address, " (", why, ")"));
  };
  addrinfo hints = {};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (const int error = ::getaddrinfo(host.c_str(), std::to_string(requested_port).c_str(),
                                      &hints, &found);
      error != 0) {
    return unavailable(::gai_strerror(error));
  }
  int listener = -1;
  int bind_errno = 0;
  for (addrinfo* a = found; a != nullptr && listener < 0; a = a->ai_next) {
    const int s = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK,
                           a->ai_protocol);
    if (s < 0) continue;
    // SO_REUSEADDR alone (not SO_REUSEPORT, which would let another kvrecalld bind the same
    // port and take half the scrapes): a busy port is an error.
    const int yes = 1;
    ::setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
    if (::bind(s, a->ai_addr, a->ai_addrlen) == 0 && ::listen(s, SOMAXCONN) == 0) {
      listener = s;
    } else {
      bind_errno = errno;
      ::close(s);
    }
  }
  ::freeaddrinfo(found);
  if (listener < 0) return unavailable(bind_errno != 0 ? strerror(bind_errno) : "no address");
  sockaddr_storage bound = {};
  socklen_t length = sizeof bound;
  ::getsockname(listener, reinterpret_cast<sockaddr*>(&bound), &length);
  const int port = ntohs(bound.ss_family == AF_INET6
                             ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                             : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  int wake[2];
  if (::pipe2(wake, O_CLOEXEC | O_NONBLOCK) != 0) {  // without it the endpoint could not stop
    const int error = errno;
    ::close(listener);
    return unavailable(absl::StrCat("no pipe to stop it by: ", strerror(error)));
  }
  std::optional<MetricsTlsFiles> files;
  if (tls != nullptr) {
    files = *tls;
    metrics->SetTlsFilesUsable("metrics", true);  // read now
    metrics->SetTlsCertificateExpiry("metrics", identity.not_after);
  }
  return std::unique_ptr<MetricsEndpoint>(new MetricsEndpoint(
      std::move(metrics), std::move(scrapers), std::move(files), std::move(identity),
      owned_context.release(), listener, wake, absl::StrCat(address.substr(0, colon), ":", port),
      port));
}

absl::StatusOr<bool> MetricsEndpoint::ReadTlsFiles() {
  if (!tls_files_) {
    return absl::FailedPreconditionError("the metrics endpoint serves plain HTTP: no TLS files");
  }
  // One read at a time (a read of the old files finishing after a read of the new ones would put
  // the old identity back), and none waits for another (a SIGHUP's and the period's).
  if (!tls_read_mu_.TryLock()) {
    return absl::UnavailableError(
        "the metrics endpoint's TLS files are being read already: that read takes them");
  }
  tls_stall_.Begin();
  const MetricsTlsFiles& files = *tls_files_;
  absl::StatusOr<std::optional<TlsIdentity>> read =
      ReadTlsIdentityAgain(files.cert_file, files.key_file, files.client_ca_file, "metrics_",
                           tls_identity_, rereadable_);
  absl::StatusOr<bool> changed =
      read.ok() ? read->has_value() : absl::StatusOr<bool>(read.status());
  if (changed.ok() && *changed) {
    absl::StatusOr<SSL_CTX*> made = MakeTlsContext(**read);
    if (made.ok()) {
      absl::MutexLock lock(&tls_mu_);
      // Connections accepted before keep the context they hold a reference to.
      SSL_CTX_free(std::exchange(tls_, *made));
      metrics_->SetTlsCertificateExpiry("metrics", (*read)->not_after);
      tls_identity_ = **std::move(read);
    } else {
      changed = made.status();
    }
  }
  // (FAILED_PRECONDITION: files read at start only, which read nothing now.)
  if (!absl::IsFailedPrecondition(changed.status())) {
    metrics_->SetTlsFilesUsable("metrics", changed.ok());
  }
  tls_stall_.End();
  tls_read_mu_.Unlock();
  return changed;
}

void MetricsEndpoint::RefreshTls() {
  const absl::StatusOr<bool> read = ReadTlsFiles();
  if (absl::IsUnavailable(read.status())) {
    CheckStalledTlsRead();  // SIGHUP's read, at this moment, or stalled
    return;
  }
  if (!read.ok()) {
    if (std::string said(read.status().message()); said != tls_refresh_error_) {
      std::fprintf(stderr, "kvrecalld: the metrics endpoint keeps its TLS certificate: %s\n",
                   said.c_str());
      tls_refresh_error_ = std::move(said);
    }
    return;
  }
  if (*read) {
    std::fprintf(stderr,
                 "kvrecalld: the metrics endpoint's TLS files changed (%s): they serve the "
                 "connections accepted from now on\n",
                 tls_files_->cert_file.c_str());
  } else if (!tls_refresh_error_.empty()) {
    std::fprintf(stderr, "kvrecalld: the metrics endpoint's TLS files can be used again\n");
  }
  tls_refresh_error_.clear();
}

std::string MetricsEndpoint::Respond(const std::string& request) const {
  // The request line: METHOD SP TARGET SP HTTP/x.y (RFC 9112 3), then the header lines.
  const absl::string_view start = WithoutLeadingEmptyLines(request);
  const absl::string_view line = start.substr(0, start.find('\n'));
  const std::vector<absl::string_view> parts =
      absl::StrSplit(absl::StripTrailingAsciiWhitespace(line), ' ');
  if (parts.size() != 3 || !absl::StartsWith(parts[2], "HTTP/1.")) {
    return PlainResponse("400 Bad Request", true);
  }
  const bool head = parts[0] == "HEAD";
  if (scrapers_ != nullptr) {
    const absl::string_view token = BearerToken(AuthorizationHeader(start));
    if (token.empty() || scrapers_->table()->Find(token) == nullptr) {
      metrics_->CountScrapeRefused(ServerMetrics::ScrapeRefusal::kUnauthorized);
      return PlainResponse("401 Unauthorized", !head,
                           "WWW-Authenticate: Bearer realm=\"kvrecalld metrics\"\r\n");
    }
  }
  if (parts[0] != "GET" && !head) {
    return PlainResponse("405 Method Not Allowed", true, "Allow: GET, HEAD\r\n");
  }
  absl::string_view path = parts[1].substr(0, parts[1].find('?'));
  // The absolute form (a proxy's): http://host:port/metrics.
  if (absl::ConsumePrefix(&path, "http://") || absl::ConsumePrefix(&path, "https://")) {
    const size_t slash = path.find('/');
    path = slash == absl::string_view::npos ? "/" : path.substr(slash);
  }
  if (path != "/metrics") return PlainResponse("404 Not Found", !head);
  return HttpResponse("200 OK", "text/plain; version=0.0.4; charset=utf-8",
                      prometheus::TextSerializer().Serialize(metrics_->Collect()), !head);
}

void MetricsEndpoint::Serve() {
  // A TLS write to a peer that reset the connection raises SIGPIPE (OpenSSL writes with
  // write(2)); blocked on this thread, it stays pending here, harmless, and the write fails
  // with EPIPE. (kvrecalld ignores SIGPIPE already; a test's process may not.)
  sigset_t pipe;
  sigemptyset(&pipe);
  sigaddset(&pipe, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &pipe, nullptr);
  std::vector<Connection> connections;
  std::vector<pollfd> polled;
  absl::Time accept_paused_until = absl::InfinitePast();
  char buffer[4096];
  for (;;) {
    polled.clear();
    polled.push_back({wake_[0], POLLIN, 0});
    // At kMaxConnections a new peer takes the place of the oldest that is not being answered,
    // so that idle peers cannot keep a scrape waiting; with every connection being answered the
    // listener is not polled (new peers wait in the kernel's backlog for a moment). Nor is it
    // for a moment after accept failed for want of descriptors (the listener would stay
    // readable): then the moment's end is a deadline too.
    const bool full = static_cast<int>(connections.size()) >= kMaxConnections;
    const bool paused = absl::Now() < accept_paused_until;
    const bool accepting =
        !paused && (!full || std::ranges::any_of(connections, &Connection::Evictable));
    polled.push_back({accepting ? listener_ : -1, POLLIN, 0});
    absl::Time next = !full && paused ? accept_paused_until : absl::InfiniteFuture();
    for (const Connection& c : connections) {
      polled.push_back({c.fd, c.events(), 0});
      next = std::min(next, c.deadline);
    }
    const int timeout_ms =
        next == absl::InfiniteFuture()
            ? -1
            : static_cast<int>(std::clamp<int64_t>(
                  absl::ToInt64Milliseconds(next - absl::Now()) + 1, 0, 60'000));
    if (::poll(polled.data(), polled.size(), timeout_ms) < 0 && errno != EINTR) {
      std::fprintf(stderr, "kvrecalld: the metrics endpoint stopped: poll failed: %s\n",
                   std::strerror(errno));
      break;
    }
    if (polled[0].revents != 0) break;  // the destructor
    const absl::Time now = absl::Now();
    for (size_t i = 0; i < connections.size(); ++i) {
      Connection& c = connections[i];
      const short revents = polled[i + 2].revents;
      bool done = now >= c.deadline || (revents & POLLNVAL) != 0;
      // Reads until none is left: TLS holds a record's plaintext beyond what one read takes,
      // which poll does not see. A request line and headers past kMaxRequestBytes end it.
      if (!done && c.ssl != nullptr && !c.tls_opened &&
          (revents & (POLLIN | POLLHUP | POLLERR)) != 0) {
        done = OpenTls(c) == Io::kClosed;
        if (!done && c.ssl == nullptr) {
          metrics_->CountScrapeRefused(ServerMetrics::ScrapeRefusal::kPlainHttp);
        }
      }
      while (!done && (revents & (POLLIN | POLLOUT | POLLHUP | POLLERR)) != 0 && c.reading() &&
             (c.ssl == nullptr || c.tls_opened)) {
        size_t n = 0;
        const Io io = ReadSome(c, buffer, sizeof buffer, &n);
        if (io == Io::kClosed) done = true;  // the peer closed (or failed): nothing more to do
        if (io != Io::kDone) break;
        if (c.draining) continue;  // dropped
        c.request.append(buffer, n);
        const absl::string_view head = WithoutLeadingEmptyLines(c.request);
        // The empty line that ends the headers, after a CRLF or a bare LF (RFC 9112 2.2).
        if (head.find("\n\r\n") != absl::string_view::npos ||
            head.find("\n\n") != absl::string_view::npos) {
          c.response = Respond(c.request);
        } else if (c.request.size() > kMaxRequestBytes) {
          c.response = PlainResponse("400 Bad Request", true);
        }
      }
      while (!done && (revents & (POLLIN | POLLOUT | POLLERR)) != 0 && !c.reading()) {
        if (c.sent < c.response.size()) {
          size_t n = 0;
          const Io io = WriteSome(c, &n);
          if (io == Io::kClosed) done = true;
          if (io != Io::kDone) break;
          c.sent += n;
          continue;
        }
        // All sent. TLS: its close_notify first, retried while the socket is full (the
        // response's Content-Length has told its end, but a reader to EOF wants it whole).
        if (c.ssl != nullptr) {
          const int shut = SSL_shutdown(c.ssl.get());
          if (shut < 0 && TlsOutcome(c, shut) == Io::kWouldBlock) break;
          ERR_clear_error();
        }
        // Our side is done; reading on until the peer closes lets the response arrive whole
        // (a close with unread request bytes would reset the connection).
        ::shutdown(c.fd, SHUT_WR);
        c.draining = true;
        c.tls_waits_for = 0;
      }
      if (done) {
        if (c.tls_handshake_failed) {
          metrics_->CountScrapeRefused(ServerMetrics::ScrapeRefusal::kTlsHandshake);
        }
        ::close(c.fd);
        c.fd = -1;
      }
    }
    std::erase_if(connections, [](const Connection& c) { return c.fd < 0; });
    if (accepting && polled[1].revents != 0) {
      // At most kMaxConnections accepts a round, so that a flood of peers cannot keep the
      // connections already open from being served; a round's own peers (at the end) are not
      // evicted by its later ones before their requests were even read.
      for (int accepted = 0; accepted < kMaxConnections; ++accepted) {
        const auto older = connections.end() - accepted;
        const auto oldest_evictable =
            std::find_if(connections.begin(), older, [](const Connection& c) {
              return c.Evictable();
            });
        const bool room = static_cast<int>(connections.size()) < kMaxConnections;
        if (!room && oldest_evictable == older) break;
        const int fd = ::accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0) {
          if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
            accept_paused_until = now + absl::Milliseconds(100);
          }
          break;  // EAGAIN: none left; ECONNABORTED and the like: polled again
        }
        if (!room) {
          ::close(oldest_evictable->fd);
          connections.erase(oldest_evictable);
        }
        Connection& added =
            connections.emplace_back(Connection{.fd = fd, .deadline = now + kConnectionDeadline});
        if (tls_files_) {
          {
            absl::MutexLock lock(&tls_mu_);
            added.ssl.reset(SSL_new(tls_));
          }
          if (added.ssl == nullptr || SSL_set_fd(added.ssl.get(), fd) != 1) {
            ERR_clear_error();
            ::close(fd);
            connections.pop_back();  // no memory for it: as if it had not come
            continue;
          }
          SSL_set_accept_state(added.ssl.get());  // the first read runs the handshake
        }
      }
    }
  }
  for (const Connection& c : connections) ::close(c.fd);
}

}  // namespace kvrecall
