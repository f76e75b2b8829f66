// The backends a server places sessions on: the CPU placement always; per GPU it was given
// (--gpus) the GPU-resident and the tiered placement, sharing that device's memory budget; and,
// without a GPU, the tiered placement with its static sets in host memory. Chooses the backend of
// a new session.
#ifndef KVRECALL_SERVER_BACKENDS_PLACEMENTS_H_
#define KVRECALL_SERVER_BACKENDS_PLACEMENTS_H_

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/backends/attention_backend.h"
#include "server/backends/cpu_backend.h"
#include "server/backends/learning_outcomes.h"
#include "server/memory_budget.h"

namespace kvrecall {

struct PlacementOptions {
  // CUDA devices to serve GPU placements on; unset: every visible device; empty: none.
  std::optional<std::vector<int>> gpus;
  // Per-device GPU memory budget in bytes; unset: what the device reports free at start minus
  // gpu_headroom_bytes (for the CUDA context, cuBLAS and kernels' launch resources).
  std::optional<int64_t> gpu_memory_budget_bytes;
  int64_t gpu_headroom_bytes = int64_t{2} << 30;
  // GPU decode steps replay a CUDA graph captured once per request shape instead of launching
  // their copies and kernels one by one (bench/results/gpu_serving.md says what it saves).
  bool cuda_graphs = true;
  // The share of an index or retopk layer's query heads (with policy.index.shortlist) whose
  // exact paths may run on the GPU in PLACEMENT_TIERED, reading the host's bulk over PCIe, while
  // the host's threads take the rest (TieredBackend; bench/results/pcie_gather.md). 0: all on
  // the host. With tiered_device_exact_balance it is the most the GPU takes, and each layer
  // moves its count a head at a time towards where the GPU's heads and the host's end together
  // (DeviceHeadBalance); without, the GPU takes that share.
  double tiered_device_exact_share = 0.75;
  bool tiered_device_exact_balance = true;
  // The CPU stand-in for a device's exact heads, for tests: on a server without a GPU, the
  // tiered placement's host tier takes the exact paths that tiered_device_exact_share (and
  // tiered_device_exact_balance) would give a GPU, and runs them with the host's arithmetic on
  // a thread of its own beside the host's heads (HostStaticSetTierOptions::exact_heads), so
  // that the device heads' logic of TieredBackend runs without a device. No effect with a GPU;
  // off in kvrecalld (on a CPU machine those heads would only take cores from the host's).
  bool tiered_host_exact_heads = false;
  // For tests: on a server without a GPU, asked by the tiered placement's host tier as it
  // prepares each run of steps (HostStaticSetTierOptions::prepare_check); a status that is not
  // OK fails the run there, as a device tier's workspace refused by its budget does, so that a
  // step's failure after its request was validated is reached without a device. Unset in
  // kvrecalld.
  std::function<absl::Status()> tiered_host_prepare_check;
  // For tests: likewise asked by the host tier at the end of each run's Finish, once the bulk's
  // heads have run (HostStaticSetTierOptions::finish_check): a status that is not OK fails the
  // run there, as a device's fault or a late host reported with the step's download does, so
  // that a step failing after its heads selected is reached without a device. Unset in
  // kvrecalld.
  std::function<absl::Status()> tiered_host_finish_check;
};

// The options of kvrecalld's --gpus ("all", "none" or ordinals "0,2"), --gpu_memory_budget_gb
// (-1: free minus headroom), --gpu_memory_headroom_gb, --tiered_gpu_exact_share (in [0, 1])
// and --tiered_gpu_exact_balance; INVALID_ARGUMENT naming the flag.
absl::StatusOr<PlacementOptions> PlacementOptionsFromFlags(absl::string_view gpus,
                                                           double budget_gb, double headroom_gb,
                                                           double tiered_gpu_exact_share = 0.75,
                                                           bool tiered_gpu_exact_balance = true);

// Of `candidates` (one placement's backends, one per device), the one whose device budget has
// the most room: its free bytes, or with `tenant` the least of those and the tenant's share free
// there (a tenant full on one GPU goes to another where its share is empty). The first when
// none has a device budget (a tier in host memory). `candidates` is not empty.
AttentionBackend* MostRoom(std::span<const std::unique_ptr<AttentionBackend>> candidates,
                           TenantBudgets* tenant);

// Resolves `selector`'s exact search (policy.index.exact_search) for a session of `placement`,
// where the tiered placement's static tier is on a device or not. An index or retopk selector's
// kDefault becomes kShortlist when shortlist > 0 or on a device's tiered tier (its GPU scans the
// codes: at 128K on the H200 the shortlist of N = 2K finds as much of the exact top K as the
// graph in about a third of its time, bench/results/tiered_serving.md), else kGraph; it stays
// kDefault where retopk's exact path scans (exact_flat_scan, the CPU and GPU placements), as it
// does for the other selectors. kShortlist without an N takes 2 * top_k (its fidelity:
// bench/results/tiered_tinylm16k.md), clamped to kMaxTopK. INVALID_ARGUMENT, with `selector`
// unchanged, for a shortlist asked of a placement other than PLACEMENT_TIERED, or any exact
// search named for retopk there (its exact path scans the whole context).
absl::Status ResolveExactSearch(v1::Placement placement, bool static_tier_on_device,
                                SelectorParams* selector);

class Placements {
 public:
  // INVALID_ARGUMENT for a device that does not exist; without CUDA (in the build or on the
  // machine) only the CPU placement is served, and GPU placements answer why.
  static absl::StatusOr<std::unique_ptr<Placements>> Create(const PlacementOptions& options);

  // The backend for a new session of `layers` layers of `config` under `placement`: the CPU
  // backend, or the device of that placement with the most room (MostRoom; `tenant`: the
  // caller's budgets, when tenants have their own). FAILED_PRECONDITION when the placement has
  // no device here ("no CUDA device"), INVALID_ARGUMENT from the backend's CheckConfig.
  // `config`'s exact search is resolved (ResolveExactSearch, which refuses a shortlist outside
  // PLACEMENT_TIERED).
  absl::StatusOr<AttentionBackend*> Choose(v1::Placement placement, const LayerConfig& config,
                                           TenantBudgets* tenant = nullptr);

  // ResolveExactSearch for this server's tiered placement (on a device when it has GPUs).
  absl::Status ResolveExactSearch(v1::Placement placement, SelectorParams* selector) const;

  AttentionBackend* cpu() { return &cpu_; }
  // Every GPU-resident backend, one per device.
  const std::vector<std::unique_ptr<AttentionBackend>>& gpu() const { return gpu_; }
  // Every tiered backend: one per device, or one whose static sets are in host memory.
  const std::vector<std::unique_ptr<AttentionBackend>>& tiered() const { return tiered_; }
  // How the tiered layers' codes learnings ended, by LearningOutcome, summed over the tiered
  // backends (server/backends/codes_learning.h).
  std::array<int64_t, kLearningOutcomes> CodesLearnings() const;
  // One line for the server's log on the GPU placements: the devices served and how CUDA loads
  // their kernels, or why there are none.
  const std::string& gpu_description() const { return gpu_description_; }

 private:
  Placements() = default;

  CpuBackend cpu_;
  std::vector<std::unique_ptr<AttentionBackend>> gpu_;
  // After gpu_: they charge the budgets the GPU backends own, so they go first.
  std::vector<std::unique_ptr<AttentionBackend>> tiered_;
  std::string no_gpu_reason_;  // why gpu_ is empty
  std::string gpu_description_;
  bool tiered_on_device_ = false;  // tiered_'s static tiers are GPUs (else host memory)
};

// The GPU-resident backends of `options` (one per device) or why there are none: implemented by
// server/backends/gpu_backend.cc in CUDA builds and by no_gpu_backend.cc otherwise.
struct GpuBackends {
  std::vector<std::unique_ptr<AttentionBackend>> backends;  // PLACEMENT_GPU, one per device
  std::vector<std::unique_ptr<AttentionBackend>> tiered;    // PLACEMENT_TIERED, one per device
  std::string unavailable;  // set when `backends` is empty
  // Set when `backends` is not: the devices served and how the CUDA driver loads this process's
  // kernels (CUDA_MODULE_LOADING, which kvrecalld's --cuda_module_loading sets).
  std::string description;
};
absl::StatusOr<GpuBackends> MakeGpuBackends(const PlacementOptions& options);

}  // namespace kvrecall

#endif  // KVRECALL_SERVER_BACKENDS_PLACEMENTS_H_
