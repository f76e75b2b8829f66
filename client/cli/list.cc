// `kvrecall list`: the server's sessions, as a table or (--json) one JSON object.
#include <cstdio>

#include "absl/flags/flag.h"
#include "client/cli/common.h"
#include "client/cli/subcommands.h"

namespace kvrecall::cli {

using client::PlacementName;
using client::SelectorName;

int RunList(const std::vector<char*>& args) {
  if (!args.empty()) return UsageError("list", "takes no arguments");
  absl::StatusOr<std::unique_ptr<client::Client>> client = ConnectToServer();
  if (!client.ok()) return ReportError("list", client.status());
  absl::StatusOr<std::vector<v1::SessionInfo>> sessions = (*client)->ListSessions();
  if (!sessions.ok()) return ReportError("list", sessions.status());
  if (absl::GetFlag(FLAGS_json)) {
    v1::ListSessionsResponse response;
    for (const v1::SessionInfo& s : *sessions) *response.add_sessions() = s;
    std::printf("%s\n", MessageJson(response, /*pretty=*/false).c_str());
    return 0;
  }
  // HOST MiB: its KV and selector state in host memory; HELD MiB: all it holds of the host
  // budget, that and what is set aside for max_tokens, a prompt being staged, codes being learned.
  std::printf("%-36s  %-10s  %-9s  %-14s  %9s  %10s  %9s  %9s  %s\n", "SESSION", "SELECTOR",
              "PLACEMENT", "L x Hq/Hkv x d", "TOKENS", "STEPS", "HOST MiB", "HELD MiB", "LABEL");
  for (const v1::SessionInfo& s : *sessions) {
    const v1::Geometry& g = s.geometry();
    const std::string shape = std::to_string(g.layers()) + " x " + std::to_string(g.q_heads()) +
                              "/" + std::to_string(g.kv_heads()) + " x " +
                              std::to_string(g.head_dim());
    std::printf("%-36s  %-10s  %-9s  %-14s  %9lld  %10lld  %9.1f  %9.1f  %s\n",
                s.session_id().c_str(), SelectorName(s.policy().selector()).c_str(),
                PlacementName(s.policy().placement()).c_str(), shape.c_str(),
                static_cast<long long>(s.tokens()), static_cast<long long>(s.decode_steps()),
                s.host_bytes() / double{1 << 20}, s.host_budget_bytes() / double{1 << 20},
                s.label().c_str());
  }
  return 0;
}

}  // namespace kvrecall::cli
