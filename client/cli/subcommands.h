// The subcommands of the `kvrecall` CLI, one file each, and their table (subcommands.cc), which
// main.cc dispatches by.
//
// Each takes the positional arguments that follow its name (flags are parsed before it runs)
// and returns the process exit status: 0 on success, 1 when the server or a file reported an
// error (printed with its code and message), 2 for a usage error.
#ifndef KVRECALL_CLIENT_CLI_SUBCOMMANDS_H_
#define KVRECALL_CLIENT_CLI_SUBCOMMANDS_H_

#include <string>
#include <vector>

#include "absl/status/status.h"

namespace kvrecall::cli {

// One subcommand: its name, its line in `kvrecall --help`, what runs it and what it reads.
struct Subcommand {
  const char* name;
  const char* summary;
  int (*run)(const std::vector<char*>& args);
  // The CLI's flags it reads beyond kGlobalFlags: any other given on its command line is a
  // usage error, not silently ignored (CliFlagsTest holds every flag to being read by some
  // subcommand).
  std::vector<std::string> flags;
};

// The flags every subcommand takes, whether or not it reads them: where the server is and how
// to reach it (ConnectToServer's), and --json, so that an alias or a script may set them for
// every subcommand.
extern const std::vector<std::string> kGlobalFlags;

// Every subcommand, in the order `kvrecall --help` lists them.
const std::vector<Subcommand>& Subcommands();

// The CLI's own flags (not Abseil's --flagfile and the like) that `args` (argv with flag names
// in underscores) sets before a "--": --NAME and --NAME=VALUE, -NAME, and --noNAME for a
// boolean NAME. (A --flagfile's are not seen: they are taken as given.)
std::vector<std::string> CliFlagsGiven(const std::vector<std::string>& args);

// INVALID_ARGUMENT naming the first flag of `given` that `subcommand` does not read, and the
// subcommands that do.
absl::Status CheckFlagsRead(const Subcommand& subcommand, const std::vector<std::string>& given);

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
