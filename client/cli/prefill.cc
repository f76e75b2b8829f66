// `kvrecall prefill SESSION_ID --trace FILE`: streams a trace's prompt (every layer's q, k and v)
// into a session made by `kvrecall create`, and prints what the server committed.
#include <cstdio>

#include "absl/flags/flag.h"
#include "absl/strings/str_format.h"
#include "client/cli/common.h"
#include "client/cli/subcommands.h"
#include "client/replay.h"
#include "client/trace/trace.h"

ABSL_DECLARE_FLAG(std::string, trace);

namespace kvrecall::cli {

int RunPrefill(const std::vector<char*>& args) {
  if (args.size() != 1)
    return UsageError("prefill", "usage: kvrecall prefill SESSION_ID --trace FILE");
  const std::string path = absl::GetFlag(FLAGS_trace);
  if (path.empty()) return UsageError("prefill", "--trace FILE is required");
  absl::StatusOr<TraceSession> opened = OpenTraceSession(path, args[0]);
  if (!opened.ok()) return ReportError("prefill", opened.status());
  const v1::SessionInfo& info = opened->info;
  const client::SessionHandle session{info.session_id(), info.geometry(), info.policy()};

  TerminalProgress progress;
  client::PrefillOptions options = ReplayOptionsFromFlags().prefill;
  options.progress = PrefillProgressOn(&progress, info.geometry().layers());
  absl::StatusOr<v1::PrefillResponse> response =
      client::PrefillFromTrace(*opened->client, session, opened->trace, options);
  progress.Done();
  if (!response.ok()) return ReportError("prefill", response.status());
  if (absl::GetFlag(FLAGS_json)) {
    std::printf("%s\n", MessageJson(*response, /*pretty=*/false).c_str());
  } else {
    std::printf("%s: %lld prompt tokens in %d layers (selector state built in %.3f s)\n",
                response->session_id().c_str(), static_cast<long long>(response->tokens()),
                response->layers_committed(), response->build_seconds());
  }
  return 0;
}

}  // namespace kvrecall::cli
