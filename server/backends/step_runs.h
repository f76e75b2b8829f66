// Splits a batched decode step into runs of steps that a backend can launch together (the same
// kernels, the same static set), without allocating in the steady state.
#ifndef KVRECALL_SERVER_BACKENDS_STEP_RUNS_H_
#define KVRECALL_SERVER_BACKENDS_STEP_RUNS_H_

#include <span>
#include <vector>

#include "absl/status/status.h"
#include "server/backends/attention_backend.h"

namespace kvrecall {

// Scratch of ForEachRun, kept in a Decode stream's StepContext and reused from step to step.
struct StepRuns {
  std::vector<LayerStep> pending, batch, rest;
};

// Calls run(batch) for the steps that `together(first, step)` with the first pending one, then
// for the next group, until every step ran once; requests usually make one group. Stops at the
// first error and returns it.
template <typename Together, typename Run>
absl::Status ForEachRun(std::span<LayerStep> steps, StepRuns& runs, Together together, Run run) {
  runs.pending.assign(steps.begin(), steps.end());
  while (!runs.pending.empty()) {
    runs.batch.clear();
    runs.rest.clear();
    const LayerStep& first = runs.pending.front();
    for (const LayerStep& step : runs.pending) {
      (together(first, step) ? runs.batch : runs.rest).push_back(step);
    }
    if (absl::Status s = run(std::span<LayerStep>(runs.batch)); !s.ok()) return s;
    runs.pending.swap(runs.rest);
  }
  return absl::OkStatus();
}

}  // namespace kvrecall

#endif  // KVRECALL_SERVER_BACKENDS_STEP_RUNS_H_
