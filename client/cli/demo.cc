// `kvrecall demo`: generates a small synthetic trace (client/trace/synthetic.h), replays it
// through --server with several policies and prints a table of fidelity and latency.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "client/cli/common.h"
#include "client/cli/subcommands.h"
#include "client/replay.h"
#include "client/trace/synthetic.h"
#include "client/trace/trace.h"

ABSL_FLAG(int64_t, context, 4096, "demo, synth: prompt tokens of the synthetic trace");
ABSL_FLAG(int64_t, decode_steps, 32, "demo, synth: decode steps of the synthetic trace");

namespace kvrecall::cli {

using client::Client;
using client::CpuPolicy;
using client::Replay;
using client::ReplayOptions;
using client::ReplayReport;
namespace {

// The synthetic trace written to a temporary file and opened; the file is unlinked at once
// (the mapping keeps the data).
absl::StatusOr<Trace> MakeDemoTrace(const SyntheticTraceParams& params) {
  absl::StatusOr<SyntheticTrace> synthetic = SyntheticTrace::Create(params);
  if (!synthetic.ok()) return synthetic.status();
  const char* tmpdir = std::getenv("TMPDIR");
  std::string path =
      absl::StrCat(tmpdir != nullptr ? tmpdir : "/tmp", "/kvrecall-demo-XXXXXX.safetensors");
  const int fd = ::mkstemps(path.data(), static_cast<int>(sizeof(".safetensors") - 1));
  if (fd < 0) return absl::ErrnoToStatus(errno, absl::StrCat("cannot create ", path));
  ::close(fd);
  absl::Status written = synthetic->Write(path);
  absl::StatusOr<Trace> trace = written.ok() ? Trace::Open(path) : written;
  ::unlink(path.c_str());
  return trace;
}

}  // namespace

int RunDemo(const std::vector<char*>& args) {
  if (!args.empty()) return UsageError("demo", "takes no arguments, only flags");
  SyntheticTraceParams params;
  params.layers = 2;
  params.q_heads = 8;
  params.kv_heads = 2;
  params.head_dim = 64;
  params.context = absl::GetFlag(FLAGS_context);
  params.decode_steps = absl::GetFlag(FLAGS_decode_steps);
  if (params.decode_steps < 1) {  // every figure of the table is over the decode steps
    return UsageError("demo", absl::StrCat("--decode_steps must be >= 1, got ",
                                           params.decode_steps));
  }
  params.mean_segment = 256;
  params.drift_period = 8;
  params.needles = std::min<int64_t>(2, params.decode_steps);
  const ReplayOptions flagged = ReplayOptionsFromFlags();
  absl::StatusOr<Trace> trace = MakeDemoTrace(params);
  if (!trace.ok()) return ReportError("demo", trace.status());
  const TraceGeometry& g = trace->geometry();

  const std::string server = absl::GetFlag(FLAGS_server);
  std::printf(
      "kvrecall demo against %s: synthetic trace, %d layers, %d query / %d KV heads of dim %d "
      "(bf16),\n%lld prompt tokens, %lld decode steps; fidelity against full attention computed "
      "by this client.\n\n",
      server.c_str(), g.layers, g.q_heads, g.kv_heads, g.head_dim,
      static_cast<long long>(g.context), static_cast<long long>(g.decode_steps));
  std::printf("%-22s %7s %7s %9s %9s %8s %6s %10s %10s %10s %10s\n", "policy", "recall", "mass",
              "cosine", "cos p05", "rel_l2", "reuse", "cand/head", "e2e p50us", "e2e p99us",
              "srv p50us");

  struct Row {
    std::string name;
    v1::Policy policy;
  };
  const Row rows[] = {
      {"full", CpuPolicy(v1::SELECTOR_FULL, 128)},
      {"exact_topk K=128", CpuPolicy(v1::SELECTOR_EXACT_TOPK, 128)},
      {"streaming 16+256", CpuPolicy(v1::SELECTOR_STREAMING, 128, 16, 256)},
      {"index K=128", CpuPolicy(v1::SELECTOR_INDEX, 128, 16, 256)},
      {"retopk K=128", CpuPolicy(v1::SELECTOR_RETOPK, 128)},
  };
  absl::StatusOr<std::unique_ptr<Client>> connected = ConnectToServer();
  if (!connected.ok()) return ReportError("demo", connected.status());
  std::unique_ptr<Client> client = *std::move(connected);
  int shown = 0;
  for (const Row& row : rows) {
    ReplayOptions options = flagged;
    options.policy = row.policy;
    options.label = absl::StrCat("kvrecall demo: ", row.name);
    absl::StatusOr<ReplayReport> r = Replay(*client, *trace, options);
    if (!r.ok()) {
      // A selector this server does not offer yet is a row, not a failure of the demo.
      if (r.status().code() != absl::StatusCode::kUnimplemented) {
        return ReportError("demo", r.status());
      }
      std::printf("%-22s not available: %s\n", row.name.c_str(),
                  std::string(r.status().message()).c_str());
      continue;
    }
    ++shown;
    std::printf("%-22s %7.3f %7.3f %9.5f %9.5f %8.4f %5.0f%% %10.0f %10.0f %10.0f %10.0f\n",
                row.name.c_str(), r->support_recall, r->retained_mass, r->output_cosine,
                r->output_cosine_p05, r->rel_l2, 100 * r->reuse, r->mean_candidates,
                r->latency_us.p50, r->latency_us.p99, r->server_us.p50);
  }
  std::printf(
      "\nrecall: |support ∩ exact top-128| / 128; mass: softmax mass of the support under full "
      "attention;\ncand/head: tokens scored per head to choose the support; latency: one "
      "layer-step of one sequence.\n");
  return shown > 0 ? 0 : 1;
}

}  // namespace kvrecall::cli
