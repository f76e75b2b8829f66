// The `kvrecall` CLI's table of subcommands against its flags: every flag the CLI defines is
// global or read by some subcommand, and every flag a subcommand names exists, so that a flag
// given to a subcommand that does not read it is refused (main.cc) rather than silently ignored.
#include <set>
#include <string>
#include <vector>

#include "absl/algorithm/container.h"
#include "absl/flags/commandlineflag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/match.h"
#include "client/cli/subcommands.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvrecall::cli {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(CliFlagsTest, EveryFlagIsReadBySomeSubcommandAndEveryNamedFlagExists) {
  std::set<std::string> named(kGlobalFlags.begin(), kGlobalFlags.end());
  for (const Subcommand& s : Subcommands()) {
    std::set<std::string> own;
    for (const std::string& name : s.flags) {
      const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
      ASSERT_NE(flag, nullptr) << s.name << " names --" << name << ", which is no flag";
      EXPECT_THAT(flag->Filename(), HasSubstr("client/cli/")) << name;
      EXPECT_TRUE(own.insert(name).second) << s.name << " names --" << name << " twice";
      named.insert(name);
    }
  }
  int cli_flags = 0;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (!absl::StrContains(flag->Filename(), "client/cli/")) continue;
    ++cli_flags;
    EXPECT_TRUE(named.contains(std::string(name))) << "no subcommand reads --" << name;
  }
  EXPECT_GT(cli_flags, 60);  // the CLI's flags were linked in (a table checked against nothing)
}

TEST(CliFlagsTest, FlagsAreFoundInEveryFormTheParserTakes) {
  EXPECT_THAT(
      CliFlagsGiven({"kvrecall", "get", "--json", "-k=3", "--noauto_tau", "--server", "localhost:1",
                     "--steps", "-1", "--flagfile=f", "--no_such_flag", "--", "--policy=retopk"}),
      ElementsAre("json", "k", "auto_tau", "server", "steps"));
}

TEST(CliFlagsTest, AFlagTheSubcommandDoesNotReadIsNamedWithItsReaders) {
  const Subcommand* get = nullptr;
  for (const Subcommand& s : Subcommands()) {
    if (std::string_view(s.name) == "get") get = &s;
  }
  ASSERT_NE(get, nullptr);
  EXPECT_TRUE(CheckFlagsRead(*get, {"json", "server", "timeout", "tls_ca"}).ok());
  const absl::Status s = CheckFlagsRead(*get, {"json", "prefill_timeout"});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "--prefill_timeout is not a flag of get (read by demo, prefill, replay)");
}

}  // namespace
}  // namespace kvrecall::cli
