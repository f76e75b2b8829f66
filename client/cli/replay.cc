// `kvrecall replay --trace FILE --policy P [knobs] [--steps N] [--json]`: streams a trace
// through the server and prints its fidelity and latency figures as one JSON object.
#include "client/replay.h"

#include <cstdio>

#include "absl/flags/flag.h"
#include "absl/strings/str_format.h"
#include "client/cli/common.h"
#include "client/cli/subcommands.h"
#include "client/trace/trace.h"
#include "proto/tensor_codec.h"

ABSL_FLAG(std::string, trace, "",
          "replay, prefill, decode, bench-index: the trace (safetensors, DESIGN.md's format)");
ABSL_FLAG(int64_t, steps, -1,
          "replay: decode steps to replay (-1: all of the trace's); decode: steps to send (-1: "
          "the rest of the trace's)");

namespace kvrecall::cli {

using client::Replay;
using client::ReplayOptions;
using client::ReplayReport;
using client::ReplayReportJson;

int RunReplay(const std::vector<char*>& args) {
  if (!args.empty()) return UsageError("replay", "takes no arguments, only flags");
  const std::string path = absl::GetFlag(FLAGS_trace);
  if (path.empty()) return UsageError("replay", "--trace FILE is required");
  absl::StatusOr<v1::Policy> policy = PolicyFromFlags();
  if (!policy.ok()) return UsageError("replay", policy.status().message());
  absl::StatusOr<Trace> trace = Trace::Open(path);
  if (!trace.ok()) return ReportError("replay", trace.status());

  TerminalProgress progress;
  ReplayOptions options = ReplayOptionsFromFlags();
  options.policy = *policy;
  options.steps = absl::GetFlag(FLAGS_steps);
  options.prefill.progress = PrefillProgressOn(&progress, trace->geometry().layers);
  options.step_progress = [&](int64_t done, int64_t steps) {
    progress.Update("decode", static_cast<double>(done) / steps,
                    absl::StrFormat("step %d/%d", done, steps));
  };
  absl::StatusOr<std::unique_ptr<client::Client>> client = ConnectToServer();
  if (!client.ok()) return ReportError("replay", client.status());
  absl::StatusOr<ReplayReport> report = Replay(**client, *trace, options);
  progress.Done();
  if (!report.ok()) return ReportError("replay", report.status());
  const int indent = absl::GetFlag(FLAGS_json) ? -1 : 2;
  std::printf("%s\n", ReplayReportJson(*report).dump(indent).c_str());
  return 0;
}

}  // namespace kvrecall::cli
