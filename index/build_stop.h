// How a long build (a graph index, ReTopK's caches, a quantizer's training) learns that nobody
// will use what it makes (its Prefill was cancelled or ran past its deadline, its session
// closed, its layer's codes learning was dropped), so that it stops early instead of holding
// cores and memory for seconds.
//
// A build asks `requested()` between units of work (a block of queries of a batch top-k, a step
// of a graph's build, 16 queries of ReTopK's calibration, a k-means round: at most a few tenths
// of a second each at 128K tokens on one core) and, once it says true, stops with `Status()`:
// CANCELLED, holding nothing its owner keeps. The callers of a stopped build decide what the
// client hears (the Prefill says why it stopped, not "stopped").
#ifndef KVRECALL_INDEX_BUILD_STOP_H_
#define KVRECALL_INDEX_BUILD_STOP_H_

#include <atomic>
#include <functional>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace kvrecall {

// A copyable predicate a build asks whether to stop; default-constructed, it never says so.
class BuildStop {
 public:
  // Never requested.
  BuildStop() = default;
  // Requested once `requested` says true (and from then on: it must not go back to false).
  // Asked from several threads at once, often: it must be thread-safe and cheap (an atomic's
  // load, a clock's read), and outlive every build given it.
  explicit BuildStop(std::function<bool()> requested) : requested_(std::move(requested)) {}
  // Requested once `*flag` holds true (null: never). The flag must outlive every build given it.
  static BuildStop WhenSet(const std::atomic<bool>* flag) {
    if (flag == nullptr) return BuildStop();
    return BuildStop([flag] { return flag->load(std::memory_order_acquire); });
  }

  bool requested() const { return requested_ && requested_(); }

  // CANCELLED naming what stopped: "<what> stopped: its result will not be used".
  static absl::Status Status(absl::string_view what) {
    return absl::CancelledError(absl::StrCat(what, " stopped: its result will not be used"));
  }
  // OK, or Status(what) once requested.
  absl::Status Check(absl::string_view what) const {
    return requested() ? Status(what) : absl::OkStatus();
  }

 private:
  std::function<bool()> requested_;
};

}  // namespace kvrecall

#endif  // KVRECALL_INDEX_BUILD_STOP_H_
