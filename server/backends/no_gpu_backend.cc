// MakeGpuBackends and MakeGpuStaticSetTier of a build without CUDA: no GPU placement or tier,
// and the reason they say.
#include "server/backends/placements.h"
#include "server/backends/tiered_backend.h"

namespace kvrecall {

absl::StatusOr<GpuBackends> MakeGpuBackends(const PlacementOptions& options) {
  if (options.gpus.has_value() && !options.gpus->empty()) {
    return absl::InvalidArgumentError(
        "--gpus names CUDA devices, but this kvrecalld was built without CUDA");
  }
  GpuBackends none;
  none.unavailable =
      "this kvrecalld was built without CUDA (KVRECALL_WITH_CUDA=OFF)";
  return none;
}

absl::StatusOr<std::unique_ptr<StaticSetTier>> MakeGpuStaticSetTier(int, MemoryBudget*, bool) {
  return absl::FailedPreconditionError(
      "this kvrecalld was built without CUDA (KVRECALL_WITH_CUDA=OFF): no GPU static-set tier");
}

}  // namespace kvrecall
