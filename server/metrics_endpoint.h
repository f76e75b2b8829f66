// The HTTP endpoint that serves ServerMetrics in the Prometheus text format at /metrics
// (prometheus-cpp's text serializer), started by RunningServer when --metrics_address is set;
// HTTPS with --metrics_tls_cert / --metrics_tls_key (OpenSSL, TLS 1.2 or later).
//
// A small HTTP/1.1 server of its own on one thread that polls every connection: whoever reaches
// the port may connect (a scrape's token, where --metrics_token_file asks for one, is read with
// its request), so what a peer can hold is bounded by construction. Each connection has one
// deadline for its whole life (its request read, its response written), so a peer that trickles
// a byte at a time is cut like an idle one and cannot hold a scrape or the process's shutdown;
// at most kMaxConnections are open at once, and a new peer beyond them takes the place of the
// oldest that is not being answered (its request still incomplete, or its response sent and the
// connection still open), so idle peers by the hundred delay no scrape: only as many peers
// connecting within a scrape's own milliseconds could push it out. With TLS the handshake is
// part of the connection's life and under its deadline, like the request. Not prometheus-cpp's
// Exposer (its civetweb workers run on a 100 KiB stack that the static TLS of OpenBLAS and CUDA
// leaves too little of) and not cpp-httplib (its deadlines are per read: one byte a second held
// a worker for hours, and four such peers held every scrape and the shutdown).
#ifndef KVRECALL_SERVER_METRICS_ENDPOINT_H_
#define KVRECALL_SERVER_METRICS_ENDPOINT_H_

#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "server/auth.h"
#include "server/metrics.h"
#include "server/tls_identity.h"

// OpenSSL's, named in members alone.
typedef struct ssl_ctx_st SSL_CTX;

namespace kvrecall {

// The endpoint's TLS (HTTPS): the PEM files of --metrics_tls_cert, --metrics_tls_key and
// --metrics_tls_client_ca, read as the gRPC port's are (ReadTlsIdentity).
struct MetricsTlsFiles {
  std::string cert_file;
  std::string key_file;
  std::string client_ca_file;  // empty: no client certificate asked for
  // How often the files are read again (zero: at start and at ReadTlsFiles only): a
  // replacement that ReadTlsIdentity takes serves the connections accepted after; one it refuses
  // (half a rotation: a key not the certificate's) keeps the identity in force, said once on
  // stderr.
  absl::Duration refresh = absl::ZeroDuration();
};

class MetricsEndpoint {
 public:
  // Listens on `address` (HOST:PORT, HOST a name or an address, [::1] for IPv6; port 0 picks a
  // free one) and serves `metrics` at /metrics (GET or HEAD; other paths answer 404, other
  // methods 405, a malformed or oversized request 400) until destroyed. With `scrapers`, every
  // request must carry "Authorization: Bearer TOKEN" with a token of its table in force (the
  // first such header decides; else 401 with "WWW-Authenticate: Bearer", before its method and
  // path are looked at); without, any peer that reaches the port reads the metrics. With
  // `tls`, every connection is TLS with the identity of its files (and, with a client CA, must
  // present a certificate those roots signed): a peer whose handshake fails is closed without
  // an answer, one that sends plain HTTP gets a 400 that says to use https://; without `tls`,
  // plain HTTP. ReadTlsIdentity's errors for files it cannot use (naming the --metrics_tls_*
  // flag; with a refresh, TlsFilesForAPeriod's first), INVALID_ARGUMENT for an address without
  // a port, UNAVAILABLE when the address cannot be bound.
  static absl::StatusOr<std::unique_ptr<MetricsEndpoint>> Start(
      const std::string& address, std::shared_ptr<ServerMetrics> metrics,
      std::shared_ptr<const TokenStore> scrapers = nullptr,
      const MetricsTlsFiles* tls = nullptr);
  // Closes every connection at once and returns.
  ~MetricsEndpoint();

  // Connections open at once; past that a new peer takes the place of the oldest connection
  // that is not being answered (none: it waits in the kernel's backlog until one ends).
  static constexpr int kMaxConnections = 32;
  // A connection's whole life: from its accept (its TLS handshake included) to its response's
  // last byte. A scrape of the loopback or the cluster network takes a few milliseconds.
  static constexpr absl::Duration kConnectionDeadline = absl::Seconds(2);
  // The most bytes of a request (its line and headers; a GET has no body).
  static constexpr size_t kMaxRequestBytes = 8192;

  // HOST:PORT actually listened on (the requested host with the bound port).
  const std::string& address() const { return address_; }
  int port() const { return port_; }
  // "https" with TLS, else "http".
  const char* scheme() const { return tls_files_ ? "https" : "http"; }
  // Reads the TLS files again now (as every MetricsTlsFiles::refresh does; kvrecalld on
  // SIGHUP): true when a changed identity serves the connections accepted from now on, false
  // when unchanged; why they cannot be used, the identity in force kept (ReadTlsIdentity's,
  // OpenSSL's), setting kvrecall_tls_files_usable{port="metrics"} to 0; FAILED_PRECONDITION,
  // reading nothing, for plain HTTP or when a file was not a regular file at start (a pipe:
  // read once); UNAVAILABLE, reading nothing, while another read is under way. Thread-safe.
  absl::StatusOr<bool> ReadTlsFiles() ABSL_LOCKS_EXCLUDED(tls_read_mu_, tls_mu_);
  // Whether a read of the TLS files runs now (one that does at shutdown is stalled: kvrecalld
  // ends without joining its thread).
  bool reading_tls_files() const { return tls_stall_.reading(); }
  // RunningServer::CheckStalledTlsReads for this port.
  void CheckStalledTlsRead();
  // No period's read of the TLS files starts after this (the server's shutdown). Thread-safe.
  void StopRefreshing() ABSL_LOCKS_EXCLUDED(stop_mu_);

 private:
  MetricsEndpoint(std::shared_ptr<ServerMetrics> metrics,
                  std::shared_ptr<const TokenStore> scrapers, std::optional<MetricsTlsFiles> files,
                  TlsIdentity identity, SSL_CTX* tls, int listener, const int wake[2],
                  std::string address, int port);
  // Serves connections until wake_[0] becomes readable.
  void Serve();
  // ReadTlsFiles every refresh on a thread of its own (one stalled on a hung mount stops no
  // scrape), saying once on stderr what it found; a read found under way is checked for a
  // stall (StalledTlsRead).
  void RefreshTls();
  // The response to one complete request (`request` holds its line and headers).
  std::string Respond(const std::string& request) const;

  const std::shared_ptr<ServerMetrics> metrics_;
  const std::shared_ptr<const TokenStore> scrapers_;  // null: no token asked for
  const std::optional<MetricsTlsFiles> tls_files_;  // nullopt: plain HTTP (never changes)
  // Why the files cannot be read again (a pipe), as found at start; OK when they can.
  const absl::Status rereadable_;
  absl::Mutex tls_read_mu_;  // held by ReadTlsFiles throughout (taken with TryLock)
  TlsIdentity tls_identity_ ABSL_GUARDED_BY(tls_read_mu_);  // what tls_ was made of
  absl::Mutex tls_mu_;
  // Owned (connections hold their own references); null: plain HTTP.
  SSL_CTX* tls_ ABSL_GUARDED_BY(tls_mu_);
  std::string tls_refresh_error_;         // the last refresh's refusal, said once (tls_refresh_'s)
  StalledTlsRead tls_stall_;              // ReadTlsFiles' reads, timed
  absl::Mutex stop_mu_;                   // StopRefreshing's: the notification is notified once
  absl::Notification stop_tls_refresh_;
  std::thread tls_refresh_;  // RefreshTls' thread, with a refresh period
  const int listener_;
  const int wake_[2];  // a byte written to wake_[1] stops Serve
  const std::string address_;
  const int port_;
  std::thread thread_;
};

}  // namespace kvrecall

#endif  // KVRECALL_SERVER_METRICS_ENDPOINT_H_
