// The C++ client of kvrecall.v1: sessions, prompts streamed in chunks under gRPC's message
// limit, and one long-lived Decode stream per model runner.
//
// Arrays are f32, row-major: prompt q [T, q_heads, head_dim], prompt k/v [T, kv_heads,
// head_dim]; decode q [q_heads, head_dim], k_new/v_new [kv_heads, head_dim]; outputs
// [batch, q_heads, head_dim]. On the wire they travel as raw bytes of the session's dtype.
// Every error is an absl::Status carrying the gRPC code and the server's message.
#ifndef KVRECALL_CLIENT_KVRECALL_CLIENT_H_
#define KVRECALL_CLIENT_KVRECALL_CLIENT_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"
#include "grpcpp/support/sync_stream.h"
#include "kvrecall/v1/kvrecall.grpc.pb.h"
#include "kvrecall/v1/kvrecall.pb.h"

namespace kvrecall::client {

// The gRPC status as an absl::Status with the same code and message (the code spaces agree).
absl::Status FromGrpcStatus(const grpc::Status& status);

// Lower-case names of the API's enums as the CLI and reports spell them ("exact_topk", "cpu",
// "bf16"), and their parsers, which answer INVALID_ARGUMENT listing the accepted names.
std::string SelectorName(v1::Selector selector);
std::string PlacementName(v1::Placement placement);
std::string DTypeLowerName(v1::DType dtype);
std::string ExactSearchName(v1::ExactSearch search);  // "unspecified", "graph", "shortlist"
std::string PathName(v1::Path path);  // "exact", "reuse", "fallback", "refresh"
absl::StatusOr<v1::Selector> ParseSelector(absl::string_view name);
absl::StatusOr<v1::Placement> ParsePlacement(absl::string_view name);
absl::StatusOr<v1::DType> ParseDType(absl::string_view name);
absl::StatusOr<v1::GraphScope> ParseGraphScope(absl::string_view name);
absl::StatusOr<v1::ExactSearch> ParseExactSearch(absl::string_view name);

// A CPU-placement policy of `selector` with its K (0: the server's default) and static set
// (nullopt: the server's defaults; 0: none).
v1::Policy CpuPolicy(v1::Selector selector, int top_k = 0, std::optional<int> sinks = std::nullopt,
                     std::optional<int> recent = std::nullopt);

// A session as the client needs it to shape tensors: its id, geometry and effective policy.
struct SessionHandle {
  std::string id;
  v1::Geometry geometry;
  v1::Policy policy;
  // The prompt's last tokens whose queries the session needs (CreateSessionResponse's
  // prompt_queries): 0 none, -1 all. PrefillStream sends q for those alone.
  int64_t prompt_queries = -1;
};

struct PrefillProgress {
  int layer = 0;
  int64_t layer_tokens_sent = 0;
  int64_t layer_tokens = 0;
  int64_t bytes_sent = 0;  // tensor bytes sent on this stream so far, all layers (q as sent)
};

// The tensor bytes of a prefill chunk by default: a 1 MiB message, the smallest limit kvrecalld
// takes (--max_message_mb=1), less 4 KiB for the chunk's other fields and its framing (chunks
// of exactly 1 MiB of tensors were refused by such a server, probe 25, 4). Large enough that
// the per-message overhead is negligible.
inline constexpr int64_t kDefaultPrefillChunkBytes = (1 << 20) - (4 << 10);

struct PrefillOptions {
  // Tensor bytes (q + k + v, or k + v where a chunk carries no q) per chunk, at least one
  // token's: the message is that and its framing (see kDefaultPrefillChunkBytes).
  int64_t max_chunk_bytes = kDefaultPrefillChunkBytes;
  // The whole call's deadline, from StartPrefill to Finish's answer (the commit's builds
  // included: seconds per layer for long prompts): past it the call ends with DEADLINE_EXCEEDED
  // and the server commits nothing of it, but for a server that stalled with the whole call read
  // (a stopped process, which takes its deadline from when it wakes): it may commit the whole
  // prompt, never part of it; GetSession's tokens, or a retry refused FAILED_PRECONDITION
  // "already prefilled", tell. InfiniteDuration: none.
  absl::Duration timeout = absl::InfiniteDuration();
  // Called after every chunk is written.
  std::function<void(const PrefillProgress&)> progress;
};

// One Prefill call: layers are sent one after another (each cut into chunks), and Finish
// closes the stream, upon which the server commits every layer sent. A failed stream stays
// failed: later calls return its status. Not thread-safe.
class PrefillStream {
 public:
  ~PrefillStream();

  // q: [T, q_heads, head_dim]; k, v: [T, kv_heads, head_dim]; T >= 1. Only the chunks that
  // hold the session's needed queries (SessionHandle::prompt_queries) carry q; q may be empty
  // when the session needs none.
  absl::Status SendLayer(int layer, std::span<const float> q, std::span<const float> k,
                         std::span<const float> v);
  absl::StatusOr<v1::PrefillResponse> Finish();

 private:
  friend class Client;
  PrefillStream(v1::KvRecall::Stub& stub, SessionHandle session, PrefillOptions options);
  // Ends the stream and remembers the server's status.
  absl::Status Fail();

  SessionHandle session_;
  PrefillOptions options_;
  grpc::ClientContext context_;
  v1::PrefillResponse response_;
  std::unique_ptr<grpc::ClientWriter<v1::PrefillChunk>> writer_;
  v1::PrefillChunk chunk_;  // reused for every chunk
  int64_t bytes_sent_ = 0;
  bool finished_ = false;
  absl::Status status_;
};

// One sequence's input to a decode step. Spans must stay valid during Step.
struct SequenceInput {
  absl::string_view session_id;
  std::span<const float> q;      // [q_heads, head_dim]
  std::span<const float> k_new;  // [kv_heads, head_dim]
  std::span<const float> v_new;  // [kv_heads, head_dim]
  // The position the token must take in the layer (SequenceStep.position): set, a layer holding
  // another number of tokens refuses the step with ABORTED and nothing of it is applied, so a
  // step resent after a lost reply cannot append its token twice.
  std::optional<int64_t> position;
};

struct StepOptions {
  bool return_lse = false;
  bool diagnostics = false;    // per-head path and candidate counts
  bool compare_exact = false;  // also fidelity against full attention, per head
};

// The outcome of one Step. Buffers are reused from step to step; pass the same object back.
struct StepResult {
  std::vector<float> output;  // [batch, q_heads, head_dim]
  std::vector<float> lse;     // [batch, q_heads], when return_lse
  // The server's reply (per-head diagnostics, positions, server_micros); owned by the stream
  // and valid until its next Step.
  const v1::DecodeResponse* response = nullptr;
};

// How a DecodeStream reaches the server.
struct DecodeStreamOptions {
  // Through a shared-memory region (DecodeShared, kvrecall.proto) instead of a gRPC Decode
  // stream: for a runner on the server's host that can open files in the server's
  // --shared_memory_dir. A step then costs a copy each way and, when the server's thread is
  // asleep, one futex wake-up; the gRPC call only opens the region and reports the end.
  bool shared_memory = false;
  // The region's capacities, the largest serialized request and reply; 0: 4 MiB each (at
  // most the server's message limit). The server allocates them when it makes the region.
  uint64_t max_request_bytes = 0;
  uint64_t max_reply_bytes = 0;
  // How long a Step polls for its reply before it sleeps until the server's wake-up.
  absl::Duration spin = absl::Microseconds(500);
  // The longest a Step (opening a new stream included) or Close waits for the server: past
  // it the stream is cancelled and the Step returns DEADLINE_EXCEEDED (as DecodeStream::Cancel
  // does, below). InfiniteDuration: none (a wedged server blocks the Step). A finite one costs
  // the stream a thread, which wakes at most once per step_timeout, not once per step.
  absl::Duration step_timeout = absl::InfiniteDuration();
};

// How a DecodeStream's requests travel (kvrecall_client.cc: gRPC or a shared region).
class DecodeTransport;

// One long-lived Decode stream for sessions of one model geometry: each Step sends one layer of
// one token for a batch of sequences and waits for its reply. Request and reply messages are
// reused, so a warm stream allocates little per step. The server ends the stream on a rejected
// step (kvrecall.proto, Decode and DecodeShared): that Step returns its status, which appended
// nothing (unless its message says "tokens appended before it failed: ...", a device's failure
// after some of its runs: kvrecall.proto), and the next Step opens a new stream and continues
// the sessions, as they were before the failed step. (After a broken connection or a deadline
// the failed step may have been committed in some layers: SequenceResult.position and
// GetSession's layer_tokens tell a runner where each layer is.) Not thread-safe; use one stream
// per thread. It shares its Client's channel and may outlive the Client.
//
// A Step that timed out (DecodeStreamOptions::step_timeout) or was cancelled (Cancel) abandons
// its stream: a step the server had not begun to apply when it saw the cancellation is not
// applied; one it had begun, or read before the cancellation reached it (a stalled server),
// may be applied in its layer, so resend it with its positions (SequenceInput::position:
// ABORTED tells it was applied). The next Step opens a new stream.
class DecodeStream {
 public:
  ~DecodeStream();

  // An empty `batch` sends a request with no steps (a no-op round trip on the stream).
  absl::Status Step(int layer, std::span<const SequenceInput> batch, const StepOptions& options,
                    StepResult* result);
  // Ends the stream from this side and returns the server's final status: after a failed Step
  // with no Step since, how that stream ended (the Step's status, once more); later Steps fail
  // with FAILED_PRECONDITION.
  absl::Status Close();
  // Thread-safe, the one member that may be called while another thread is in Step or Close:
  // abandons the stream and the step in flight, which returns CANCELLED (Close too, without
  // waiting for the server); without one in flight, the next Step opens a new stream.
  // (OpenDecodeStream's first opening is bounded by step_timeout alone: the stream is not the
  // caller's before it returns.)
  void Cancel();
  // Streams opened so far: 1, plus one per Step that followed a failed or cancelled one.
  int streams_opened() const { return streams_opened_; }

 private:
  friend class Client;
  DecodeStream(std::shared_ptr<grpc::Channel> channel, int64_t max_reply_bytes,
               const v1::Geometry& geometry, const DecodeStreamOptions& options);
  class Watchdog;
  // Opens a new stream (the first, or one after a failure).
  absl::Status Open();
  // Cancels the stream, if one is open (a reply that does not pair with its request).
  void CancelTransport();
  // Open under step_timeout's watch (Client::OpenDecodeStream).
  absl::Status OpenWatched();
  // Runs `body` (an exchange with the server: a step, opening a stream, closing it) under
  // step_timeout's watch and Cancel's reach; `what` names it in the error of one they broke
  // off (with what became of its step when `carries_step`, which `body` sets once the step is
  // sent: then the server's own answer, ABORTED say, is kept), after which the stream is
  // dropped.
  absl::Status Watched(absl::string_view what, const bool& carries_step,
                       absl::FunctionRef<absl::Status()> body);
  // The watchdog's Cancel: the exchange in flight outlasted step_timeout.
  void TimeOut();
  // Installs `transport` as the stream (cancelled at once if the exchange in flight was).
  void SetTransport(std::unique_ptr<DecodeTransport> transport);
  // Drops the stream, destroying it outside transport_mu_ (a shared stream waits for its
  // call's end).
  void DropTransport();

  // Its own stub on the Client's channel: a stream kept after its Client reopened itself
  // through the Client's freed stub after a failed step (probe 28, 1).
  const std::unique_ptr<v1::KvRecall::Stub> stub_;
  v1::Geometry geometry_;
  DecodeStreamOptions options_;
  // Null while no stream is open. Set and reset by the thread that steps, under transport_mu_
  // (Cancel reaches the stream through it from other threads); that thread reads it freely.
  std::unique_ptr<DecodeTransport> transport_;
  mutable absl::Mutex transport_mu_;
  bool in_flight_ ABSL_GUARDED_BY(transport_mu_) = false;   // an exchange is under way
  bool cancelled_ ABSL_GUARDED_BY(transport_mu_) = false;   // by Cancel, this exchange
  bool timed_out_ ABSL_GUARDED_BY(transport_mu_) = false;   // by the watchdog, this exchange
  bool abandoned_ ABSL_GUARDED_BY(transport_mu_) = false;   // cancelled between exchanges
  std::unique_ptr<Watchdog> watchdog_;  // with a finite step_timeout
  int streams_opened_ = 0;
  bool closed_ = false;  // by Close: no further stream
  v1::DecodeRequest request_;
  v1::DecodeResponse response_;
  uint64_t next_request_id_ = 1;
  absl::Status status_;  // the last stream's end, once it ended
};

// How a channel to kvrecalld is secured: plaintext (the default), TLS, mutual TLS, and a
// bearer token for servers started with --auth_token_file. Paths name PEM files.
//
// Any field but `token` set means TLS, whatever the target. A token alone goes, by the target:
// to HOST:PORT (any target but the two below) over TLS with the system's roots, as gRPC sends
// call credentials over private channels alone (a token in plaintext TCP could be read on the
// way); to unix:PATH without TLS, over gRPC's local credentials (plaintext on the socket, which
// they check is a Unix socket), for kvrecalld's --plaintext_unix_sockets, and only when PATH is
// a socket this user owns (gRPC's local credentials authenticate no server: kvrecalld makes
// its socket 0600, so a runner that may connect runs as its user); to
// unix-abstract:NAME nowhere: MakeChannelCredentials refuses it (such a socket has no file
// permissions, so kvrecalld serves it with TLS alone; set `tls` to send the token over TLS).
struct ChannelSecurity {
  bool tls = false;          // TLS; implied by every field below but `token` (see above)
  std::string ca_file;       // roots that signed the server's certificate; empty: system roots
  std::string cert_file;     // the client's certificate chain and key, for mutual TLS
  std::string key_file;
  std::string server_name;   // checked against the server's certificate instead of the host
  std::string token;         // sent as "authorization: Bearer TOKEN" with every call

  // Whether the channel is other than plaintext: TLS, or local credentials carrying a token.
  bool secure() const { return tls_requested() || !token.empty(); }
  // Whether a field that means TLS is set (every field but `token`).
  bool tls_requested() const {
    return tls || !ca_file.empty() || !cert_file.empty() || !key_file.empty() ||
           !server_name.empty();
  }
};

// The gRPC channel credentials for `security` on a channel to `target` (an address as
// Client::Connect takes it; empty counts as HOST:PORT), files read now: INVALID_ARGUMENT for a
// key without a certificate (or the reverse), a file that is not PEM or holds no block of its
// kind (CERTIFICATE for ca_file and cert_file, PRIVATE KEY for key_file), a token that is not
// printable ASCII without blanks (as --auth_token_file lists them), or a token alone to a
// unix-abstract:NAME target (ChannelSecurity above), NOT_FOUND for a missing file,
// FAILED_PRECONDITION for a token alone to a unix:PATH that does not exist yet, is not a socket
// or is not this user's (so a runner connects once kvrecalld's socket is there).
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const ChannelSecurity& security, absl::string_view target = "");

// OK when `address` can name a kvrecalld: HOST:PORT with a port in [1, 65535] (an IPv6 host in
// brackets; the port is always written, 443 behind an ingress included), or a target of one of gRPC's schemes (unix:PATH, unix-abstract:NAME, dns:, ipv4:,
// ipv6:, SCHEME://...), which its resolvers check; INVALID_ARGUMENT otherwise. gRPC takes a
// port modulo 2^16 and a missing one as 443: a typo reached another server. Connect (with a
// ChannelSecurity) checks it.
absl::Status CheckServerAddress(absl::string_view address);

// The bearer token in the file at `path`: its first line without the whitespace around it (a
// trailing newline, say), as in a Kubernetes Secret's file; the chart's co-located runner finds
// that path in $KVRECALL_TOKEN_FILE (the library reads no environment: the kvrecall CLI's
// --token_file defaults to it). NOT_FOUND naming `path` when it cannot be read,
// INVALID_ARGUMENT when it is empty or its first line blank.
absl::StatusOr<std::string> ReadTokenFile(const std::string& path);

// The receive limit Connect gives its channel when ClientOptions names none: kvrecalld's own
// default (--max_message_mb=64).
inline constexpr int kDefaultMaxMessageBytes = 64 << 20;

// How a Client's channel and calls behave, beside their security.
struct ClientOptions {
  // The largest reply the channel accepts, which Decode requests tell the server
  // (DecodeRequest.max_reply_bytes: a step whose reply could not arrive is refused before it
  // is applied). Connect sets its channel's receive limit to it (unset:
  // kDefaultMaxMessageBytes). For a Client made on a channel of one's own, that channel's limit
  // (unset: none known, the server's limit alone; gRPC's own default is 4 MiB).
  std::optional<int> max_message_bytes;
  // Each unary call's deadline (CreateSession, GetSession, each page of ListSessions,
  // CloseSession): past it the call fails with DEADLINE_EXCEEDED (a CreateSession sent again
  // with its request_id gets the session the first one made, if it made one).
  // InfiniteDuration: none. Streams have their own (PrefillOptions, DecodeStreamOptions).
  absl::Duration call_timeout = absl::InfiniteDuration();
  // gRPC's channel arguments for Connect's channel (keepalive, reconnect backoff, a user agent:
  // the GRPC_ARG_* of grpc/impl/codegen/grpc_types.h), to which Connect adds the receive limit
  // above and, with TLS, the server name: those two are not to be set here (the secure Connect
  // refuses them).
  grpc::ChannelArguments channel_arguments;
};

// Connects to kvrecalld. Thread-safe: the channel and stub may be shared.
class Client {
 public:
  // On a channel made by the caller: its receive limit unknown unless `options` tells it.
  // Options that cannot serve (a call_timeout or max_message_bytes that is not positive,
  // channel_arguments, which only Connect's own channel takes) make every call of the Client
  // return INVALID_ARGUMENT saying so.
  explicit Client(std::shared_ptr<grpc::Channel> channel, const ClientOptions& options = {});
  // An insecure channel to HOST:PORT. A malformed `address` (CheckServerAddress: gRPC would
  // wrap a port past 65535) or options the overload below refuses make every call of the
  // Client return INVALID_ARGUMENT saying so (the overload below returns the error itself).
  static std::unique_ptr<Client> Connect(const std::string& address,
                                         const ClientOptions& options = {});
  // A channel secured as `security` says; fails only when `address` is malformed
  // (CheckServerAddress), its files are unusable or its token alone cannot go to `address`
  // (MakeChannelCredentials: FAILED_PRECONDITION for a Unix socket that is missing or not
  // this user's; the connection itself is made, and checked, by the first call).
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const std::string& address,
                                                         const ChannelSecurity& security,
                                                         const ClientOptions& options = {});

  // max_tokens: the most tokens the session will hold (prompt + decoded), when the runner knows
  // it (CreateSessionRequest.max_tokens): their memory is set aside now, so that decoding up to
  // it never grows a layer's KV (the server grows an array ahead of need, off the step, within
  // the address space it reserved; past that, or with --host_kv_growth_ahead=false, a growth
  // copies and pins each layer's KV again in the step, all layers at the same token:
  // bench/results/tiered_serving.md, "A model's layers in turn"). 0: not announced.
  // request_id: makes a retry safe (CreateSessionRequest.request_id): a call that failed
  // without an answer (UNAVAILABLE, DEADLINE_EXCEEDED) resent with the same request_id gets the
  // session the first one made, if it made one (ABORTED while that one is still being made:
  // retry; ALREADY_EXISTS for another request under the id). "": none.
  absl::StatusOr<SessionHandle> CreateSession(const v1::Geometry& geometry,
                                              const v1::Policy& policy,
                                              absl::string_view label = "",
                                              int64_t max_tokens = 0,
                                              absl::string_view request_id = "");
  absl::StatusOr<std::unique_ptr<PrefillStream>> StartPrefill(const SessionHandle& session,
                                                              PrefillOptions options = {});
  // Opens the stream now (a shared one maps its region now: its errors come back here).
  absl::StatusOr<std::unique_ptr<DecodeStream>> OpenDecodeStream(
      const v1::Geometry& geometry, const DecodeStreamOptions& options = {});
  absl::StatusOr<v1::SessionInfo> GetSession(absl::string_view session_id);
  // Every session of the caller, by id (following ListSessions' pages).
  absl::StatusOr<std::vector<v1::SessionInfo>> ListSessions();
  absl::Status CloseSession(absl::string_view session_id);

  v1::KvRecall::Stub& stub() { return *stub_; }
  const std::shared_ptr<grpc::Channel>& channel() const { return channel_; }

 private:
  // A unary call's context, with call_timeout's deadline.
  void PrepareUnary(grpc::ClientContext* context) const;

  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::KvRecall::Stub> stub_;
  ClientOptions options_;
  // Why the address or options cannot serve: every call's answer when not OK.
  absl::Status unusable_;
};

}  // namespace kvrecall::client

#endif  // KVRECALL_CLIENT_KVRECALL_CLIENT_H_
