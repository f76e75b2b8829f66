// MakeGpuBackends of a build without CUDA: no GPU placement, and the reason it says.
#include "server/backends/placements.h"

namespace kvrecall {

absl::StatusOr<GpuBackends> MakeGpuBackends(const PlacementOptions& options) {
  if (options.gpus.has_value() && !options.gpus->empty()) {
    return absl::InvalidArgumentError(
        "--gpus names CUDA devices, but this kvrecalld was built without CUDA");
  }
  GpuBackends none;
  none.unavailable =
      "this kvrecalld was built without CUDA (KVRECALL_WITH_CUDA=OFF): only PLACEMENT_CPU is "
      "served";
  return none;
}

}  // namespace kvrecall
