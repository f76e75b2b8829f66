// kvrecall: the command-line client of kvrecalld (demo, sessions, a trace's prompt and decode
// steps, trace replay).
// `kvrecall SUBCOMMAND [--flags] [args]`; flags may be spelled with dashes or underscores.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/cli/common.h"
#include "client/cli/subcommands.h"
#include "client/trace/safetensors.h"

namespace kvrecall::cli {
namespace {

// absl flags are identifiers; accept the CLI convention --auto-tau for --auto_tau.
std::vector<std::string> UnderscoreFlagNames(int argc, char** argv) {
  std::vector<std::string> out(argv, argv + argc);
  for (std::string& arg : out) {
    if (arg == "--") break;
    if (arg.size() < 3 || arg.compare(0, 2, "--") != 0) continue;
    const size_t end = std::min(arg.find('='), arg.size());
    for (size_t i = 2; i < end; ++i) {
      if (arg[i] == '-') arg[i] = '_';
    }
  }
  return out;
}

int Main(int argc, char** argv) {
  // An interrupted synth (or any trace write) removes its temporary file, gigabytes at 1M.
  RemovePartialFilesOnSignals();
  std::string usage = "kvrecall SUBCOMMAND [--flags] [args]\n\nsubcommands:\n";
  for (const Subcommand& s : Subcommands()) {
    absl::StrAppend(&usage, absl::StrFormat("  %-12s %s\n", s.name, s.summary));
  }
  absl::StrAppend(&usage, "\n--helpfull lists every flag.");
  absl::SetProgramUsageMessage(usage);
  // --help lists the subcommands' flags (Abseil's default looks for a file named after the
  // program, and found none: "No flags matched").
  absl::FlagsUsageConfig flags_usage;
  flags_usage.contains_help_flags = [](absl::string_view file) {
    return absl::StrContains(file, "client/cli/");
  };
  flags_usage.contains_helpshort_flags = flags_usage.contains_help_flags;
  absl::SetFlagsUsageConfig(flags_usage);

  std::vector<std::string> storage = UnderscoreFlagNames(argc, argv);
  std::vector<char*> args;
  for (std::string& s : storage) args.push_back(s.data());
  std::vector<char*> positional =
      absl::ParseCommandLine(static_cast<int>(args.size()), args.data());
  if (positional.size() < 2) {
    std::fprintf(stderr, "%s\n", usage.c_str());
    return 2;
  }
  for (const Subcommand& s : Subcommands()) {
    if (std::strcmp(positional[1], s.name) == 0) {
      if (absl::Status flags = CheckFlagsRead(s, CliFlagsGiven(storage)); !flags.ok()) {
        return UsageError(s.name, flags.message());
      }
      if (absl::Status flags = CheckTimeoutFlags(); !flags.ok()) {
        return UsageError(s.name, flags.message());
      }
      return s.run(std::vector<char*>(positional.begin() + 2, positional.end()));
    }
  }
  std::fprintf(stderr, "kvrecall: unknown subcommand '%s'\n\n%s\n", positional[1], usage.c_str());
  return 2;
}

}  // namespace
}  // namespace kvrecall::cli

int main(int argc, char** argv) { return kvrecall::cli::Main(argc, argv); }
