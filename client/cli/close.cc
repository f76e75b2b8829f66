// `kvrecall close SESSION_ID...`: closes sessions, freeing their memory on the server.
#include <cstdio>

#include "client/cli/common.h"
#include "client/cli/subcommands.h"

namespace kvrecall::cli {

using client::Client;

int RunClose(const std::vector<char*>& args) {
  if (args.empty()) return UsageError("close", "usage: kvrecall close SESSION_ID...");
  absl::StatusOr<std::unique_ptr<Client>> connected = ConnectToServer();
  if (!connected.ok()) return ReportError("close", connected.status());
  std::unique_ptr<Client> client = *std::move(connected);
  int exit_status = 0;
  for (const char* id : args) {
    if (absl::Status s = client->CloseSession(id); !s.ok()) {
      exit_status = ReportError("close", s);
    } else {
      std::printf("closed %s\n", id);
    }
  }
  return exit_status;
}

}  // namespace kvrecall::cli
