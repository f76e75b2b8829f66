// How tiered layers' shortlist-codes learnings (server/backends/codes_learning.h) ended, counted
// for the metrics (kvrecall_codes_learnings_total) apart from the learning itself, so that the
// metrics need not include it.
#ifndef KVRECALL_SERVER_BACKENDS_LEARNING_OUTCOMES_H_
#define KVRECALL_SERVER_BACKENDS_LEARNING_OUTCOMES_H_

#include <array>
#include <atomic>
#include <cstdint>

namespace kvrecall {

// How a learning ended.
enum class LearningOutcome {
  kTakenOver,  // its codes took over at their length
  kRefused,    // no memory for its codes (a budget's or the device's): the layer keeps the
               // ones it has, its exact steps scoring more keys, and tries again at the next
               // doubling
  kFailed,     // another error (a device's)
  kAbandoned,  // the layer closed before the learning ended
};
inline constexpr int kLearningOutcomes = static_cast<int>(LearningOutcome::kAbandoned) + 1;
// The metrics' label of each outcome.
inline const char* LearningOutcomeLabel(LearningOutcome outcome) {
  switch (outcome) {
    case LearningOutcome::kTakenOver:
      return "taken_over";
    case LearningOutcome::kRefused:
      return "refused";
    case LearningOutcome::kFailed:
      return "failed";
    case LearningOutcome::kAbandoned:
      return "abandoned";
  }
  return "unknown";
}

// The learnings of a placement's layers, by outcome (the metrics read it at scrape). Thread-safe.
class CodesLearningTally {
 public:
  void Count(LearningOutcome outcome) {
    counts_[static_cast<int>(outcome)].fetch_add(1, std::memory_order_relaxed);
  }
  int64_t count(LearningOutcome outcome) const {
    return counts_[static_cast<int>(outcome)].load(std::memory_order_relaxed);
  }

 private:
  std::array<std::atomic<int64_t>, kLearningOutcomes> counts_{};
};

}  // namespace kvrecall

#endif  // KVRECALL_SERVER_BACKENDS_LEARNING_OUTCOMES_H_
