// `kvrecall get SESSION_ID`: prints a session's geometry, policy, length, memory and counters.
#include <cstdio>

#include "absl/flags/flag.h"
#include "client/cli/common.h"
#include "client/cli/subcommands.h"

namespace kvrecall::cli {

int RunGet(const std::vector<char*>& args) {
  if (args.size() != 1) return UsageError("get", "usage: kvrecall get SESSION_ID");
  absl::StatusOr<std::unique_ptr<client::Client>> client = ConnectToServer();
  if (!client.ok()) return ReportError("get", client.status());
  absl::StatusOr<v1::SessionInfo> info = (*client)->GetSession(args[0]);
  if (!info.ok()) return ReportError("get", info.status());
  std::printf("%s\n", MessageJson(*info, /*pretty=*/!absl::GetFlag(FLAGS_json)).c_str());
  return 0;
}

}  // namespace kvrecall::cli
