// Parses a benchmark's comma-separated integer-list flag ("1,8", "16384,65536"), so that every
// benchmark reads and refuses such lists the same way.
#ifndef KVRECALL_BENCH_INT_LIST_H_
#define KVRECALL_BENCH_INT_LIST_H_

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"

namespace kvrecall::bench {

// The integers of `text`, in order (empty items are skipped: "1,,8" is {1, 8}); each must be at
// least `min` and fit Int. Otherwise InvalidArgumentError naming `flag` and the bad item; an
// empty list is refused too.
template <typename Int = int>
absl::StatusOr<std::vector<Int>> ParseIntList(absl::string_view flag, absl::string_view text,
                                              int64_t min = 1) {
  std::vector<Int> out;
  for (absl::string_view item : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    int64_t v = 0;
    if (!absl::SimpleAtoi(item, &v) || v < min || v > std::numeric_limits<Int>::max()) {
      return absl::InvalidArgumentError(absl::StrCat("--", flag, ": '", item,
                                                     "' is not an integer of at least ", min));
    }
    out.push_back(static_cast<Int>(v));
  }
  if (out.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, ": an empty list"));
  }
  return out;
}

// ParseIntList for a benchmark's Main: prints the error and exits with status 2 on a bad list.
template <typename Int = int>
std::vector<Int> IntListOrExit(absl::string_view flag, absl::string_view text, int64_t min = 1) {
  absl::StatusOr<std::vector<Int>> list = ParseIntList<Int>(flag, text, min);
  if (!list.ok()) {
    std::fprintf(stderr, "%s\n", std::string(list.status().message()).c_str());
    std::exit(2);
  }
  return *std::move(list);
}

}  // namespace kvrecall::bench

#endif  // KVRECALL_BENCH_INT_LIST_H_
