// The table of the `kvrecall` CLI's subcommands (client/cli/subcommands.h): each one's summary,
// its Run function and the flags it reads, and the check that a command line sets no other.
#include "client/cli/subcommands.h"

#include <string>
#include <vector>

#include "absl/algorithm/container.h"
#include "absl/flags/commandlineflag.h"
#include "absl/flags/reflection.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"

namespace kvrecall::cli {
namespace {

// The index's knobs, read by PolicyFromFlags and by bench-index.
const std::vector<std::string> kIndexKnobs = {
    "k",          "sinks",      "recent",       "build_queries",
    "build_topk", "max_degree", "search_width", "graph_scope"};
// The rest of PolicyFromFlags'.
const std::vector<std::string> kPolicy = {
    "placement", "policy",   "search_list",   "C",               "R",            "W",
    "tau",       "refresh",  "auto_tau",      "target_recall",   "exact_flat_scan",
    "exact_search", "shortlist"};
const std::vector<std::string> kGeometry = {"layers", "q_heads", "kv_heads", "head_dim", "dtype"};

std::vector<std::string> Flags(std::initializer_list<std::vector<std::string>> groups) {
  std::vector<std::string> all;
  for (const std::vector<std::string>& group : groups) {
    all.insert(all.end(), group.begin(), group.end());
  }
  return all;
}

}  // namespace

const std::vector<std::string> kGlobalFlags = {"server",     "tls",     "tls_ca",
                                               "tls_cert",   "tls_key", "tls_server_name",
                                               "token_file", "timeout", "json"};

const std::vector<Subcommand>& Subcommands() {
  static const auto* const subcommands = new std::vector<Subcommand>{
      {"demo", "a synthetic session through several policies; prints fidelity and latency", RunDemo,
       Flags({{"context", "decode_steps", "prefill_timeout"}})},
      {"create", "create a session (--layers --q_heads --kv_heads --head_dim --dtype + policy)",
       RunCreate, Flags({kGeometry, kPolicy, kIndexKnobs, {"label", "max_tokens", "request_id"}})},
      {"prefill", "send a trace's prompt to a session: kvrecall prefill SESSION_ID --trace FILE",
       RunPrefill, Flags({{"trace", "prefill_timeout"}})},
      {"decode",
       "send a trace's next decode steps: kvrecall decode SESSION_ID --trace FILE [--steps N]",
       RunDecode, Flags({{"trace", "steps", "diagnostics", "compare_exact", "outputs"}})},
      {"get", "show a session: kvrecall get SESSION_ID", RunGet, Flags({})},
      {"list", "list your sessions (with tokens: your tenant's)", RunList, Flags({})},
      {"close", "close sessions: kvrecall close SESSION_ID...", RunClose, Flags({})},
      {"health", "ask grpc.health.v1 of the server (or of SERVICE): kvrecall health [SERVICE]",
       RunHealth, Flags({{"health_deadline"}})},
      {"replay", "replay a trace: --trace FILE --policy P [knobs] [--steps N] [--json]", RunReplay,
       Flags({kPolicy, kIndexKnobs, {"trace", "steps", "prefill_timeout"}})},
      {"synth", "write a synthetic trace: --out FILE [--context T --decode_steps N ...]", RunSynth,
       Flags({kGeometry,
              {"out", "context", "decode_steps", "decode_noise", "drift_period", "mean_segment",
               "needles", "query_drift", "rope_base", "rotary_dims", "seed", "sink_tokens",
               "topics"}})},
      {"bench-index", "graph vs hnsw vs flat index: --trace FILE [--k 100] [--json]", RunBenchIndex,
       Flags({kIndexKnobs,
              {"trace", "graph_topk", "hnsw_ef_construction", "hnsw_m", "index_layers", "keys",
               "lists", "methods"}})},
  };
  return *subcommands;
}

std::vector<std::string> CliFlagsGiven(const std::vector<std::string>& args) {
  std::vector<std::string> given;
  for (size_t i = 1; i < args.size(); ++i) {
    absl::string_view arg = args[i];
    if (arg == "--") break;
    if (!absl::ConsumePrefix(&arg, "-")) continue;
    absl::ConsumePrefix(&arg, "-");
    std::string name(arg.substr(0, arg.find('=')));
    const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    if (flag == nullptr && absl::StartsWith(name, "no")) {
      flag = absl::FindCommandLineFlag(name.substr(2));
      if (flag != nullptr) name = name.substr(2);
    }
    if (flag != nullptr && absl::StrContains(flag->Filename(), "client/cli/")) {
      given.push_back(name);
    }
  }
  return given;
}

absl::Status CheckFlagsRead(const Subcommand& subcommand, const std::vector<std::string>& given) {
  for (const std::string& name : given) {
    if (absl::c_linear_search(kGlobalFlags, name) ||
        absl::c_linear_search(subcommand.flags, name)) {
      continue;
    }
    std::vector<std::string> readers;
    for (const Subcommand& s : Subcommands()) {
      if (absl::c_linear_search(s.flags, name)) readers.push_back(s.name);
    }
    return absl::InvalidArgumentError(
        absl::StrCat("--", name, " is not a flag of ", subcommand.name, " (",
                     readers.empty() ? "no subcommand reads it"
                                     : absl::StrCat("read by ", absl::StrJoin(readers, ", ")),
                     ")"));
  }
  return absl::OkStatus();
}

}  // namespace kvrecall::cli
