// What the `kvrecall` subcommands share: the --server and --json flags, the policy flags, error
// reporting with exit codes, JSON printing of API messages and terminal progress.
#ifndef KVRECALL_CLIENT_CLI_COMMON_H_
#define KVRECALL_CLIENT_CLI_COMMON_H_

#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "absl/flags/declare.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "client/kvrecall_client.h"
#include "client/replay.h"
#include "client/trace/trace.h"
#include "google/protobuf/message.h"
#include "kvrecall/v1/kvrecall.pb.h"

ABSL_DECLARE_FLAG(std::string, server);
ABSL_DECLARE_FLAG(bool, json);
ABSL_DECLARE_FLAG(absl::Duration, timeout);
ABSL_DECLARE_FLAG(absl::Duration, prefill_timeout);

namespace kvrecall::cli {

// A client of --server, secured as --tls, --tls_ca, --tls_cert, --tls_key, --tls_server_name
// and --token_file (where not given, $KVRECALL_TOKEN_FILE) say, its unary calls bounded by
// --timeout; INVALID_ARGUMENT / NOT_FOUND naming the flag (or the variable) when a file is
// unusable or --timeout is not positive, INVALID_ARGUMENT for a token alone to a
// unix-abstract:NAME server (client::ChannelSecurity). (replay and demo bound their decode
// steps by --timeout too, and their Prefill by --prefill_timeout: ReplayOptionsFromFlags.)
absl::StatusOr<std::unique_ptr<client::Client>> ConnectToServer();

// The policy that --placement, --policy, --k, --sinks, --recent, the ReTopK flags (--C, --R,
// --W, --tau, --refresh, --auto_tau, --target_recall) and the index flags describe; unset knobs
// stay zero/unset so the server fills in its defaults. INVALID_ARGUMENT for unknown names.
absl::StatusOr<v1::Policy> PolicyFromFlags();

// INVALID_ARGUMENT naming --timeout or --prefill_timeout when it is not positive: main checks
// it before any subcommand runs (a usage error, exit 2).
absl::Status CheckTimeoutFlags();

// The Decode and Prefill options of replay and demo: step_timeout from --timeout, the
// Prefill's timeout from --prefill_timeout.
client::ReplayOptions ReplayOptionsFromFlags();

// Prints "kvrecall <subcommand>: <CODE>: <message>" to stderr and returns 1.
int ReportError(absl::string_view subcommand, const absl::Status& status);
// Prints "kvrecall <subcommand>: <message>" to stderr and returns 2.
int UsageError(absl::string_view subcommand, absl::string_view message);

// An API message as JSON with the .proto field names; pretty spreads it over lines.
std::string MessageJson(const google::protobuf::Message& message, bool pretty);

// A single status line on stderr, redrawn at most ten times a second, shown only when stderr
// is a terminal (so logs and pipes stay clean).
class TerminalProgress {
 public:
  TerminalProgress();
  ~TerminalProgress();
  // `fraction` in [0, 1]; `detail` follows the percentage.
  void Update(absl::string_view label, double fraction, absl::string_view detail);
  // Ends the line (if one was drawn).
  void Done();

 private:
  bool enabled_;
  bool drawn_ = false;
  std::chrono::steady_clock::time_point last_;
};

// What `prefill` and `decode` work on: a trace, a client of --server and a session whose
// geometry takes the trace's tensors.
struct TraceSession {
  Trace trace;
  std::unique_ptr<client::Client> client;
  v1::SessionInfo info;
};
// Opens `trace_path`, connects (ConnectToServer) and asks for `session_id`: the first error of
// the three, or CheckTraceGeometry's when the session cannot take the trace.
absl::StatusOr<TraceSession> OpenTraceSession(const std::string& trace_path,
                                              const std::string& session_id);

// A PrefillOptions::progress that draws `progress`'s line (which must outlive the call): the
// share of a prompt of `layers` layers sent, by tokens, not bytes (how many of a prompt's q
// travel depends on the policy).
std::function<void(const client::PrefillProgress&)> PrefillProgressOn(TerminalProgress* progress,
                                                                      int layers);

}  // namespace kvrecall::cli

#endif  // KVRECALL_CLIENT_CLI_COMMON_H_
