// The subcommands of the `kvrecall` CLI, one file each, dispatched by main.cc's table.
//
// Each takes the positional arguments that follow its name (flags are parsed before it runs)
// and returns the process exit status: 0 on success, 1 when the server or a file reported an
// error (printed with its code and message), 2 for a usage error.
#ifndef KVRECALL_CLIENT_CLI_SUBCOMMANDS_H_
#define KVRECALL_CLIENT_CLI_SUBCOMMANDS_H_

#include <vector>

namespace kvrecall::cli {

int RunDemo(const std::vector<char*>& args);
int RunCreate(const std::vector<char*>& args);
int RunPrefill(const std::vector<char*>& args);
int RunDecode(const std::vector<char*>& args);
int RunGet(const std::vector<char*>& args);
int RunList(const std::vector<char*>& args);
int RunClose(const std::vector<char*>& args);
int RunReplay(const std::vector<char*>& args);
int RunSynth(const std::vector<char*>& args);
int RunBenchIndex(const std::vector<char*>& args);
int RunHealth(const std::vector<char*>& args);

}  // namespace kvrecall::cli

#endif  // KVRECALL_CLIENT_CLI_SUBCOMMANDS_H_
