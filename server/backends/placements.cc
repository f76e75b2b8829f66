#include "server/backends/placements.h"

#include <algorithm>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "server/backends/tiered_backend.h"
#include "server/memory_budget.h"

namespace kvrecall {

absl::StatusOr<PlacementOptions> PlacementOptionsFromFlags(absl::string_view gpus,
                                                           double budget_gb, double headroom_gb,
                                                           double tiered_gpu_exact_share,
                                                           bool tiered_gpu_exact_balance) {
  PlacementOptions options;
  if (gpus == "none") {
    options.gpus.emplace();
  } else if (gpus != "all") {
    options.gpus.emplace();
    for (absl::string_view part : absl::StrSplit(gpus, ',')) {
      int ordinal = 0;
      if (!absl::SimpleAtoi(part, &ordinal) || ordinal < 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--gpus must be 'all', 'none' or device ordinals such as 0,2; got '", gpus, "'"));
      }
      if (std::find(options.gpus->begin(), options.gpus->end(), ordinal) !=
          options.gpus->end()) {  // two backends would each budget the device's whole memory
        return absl::InvalidArgumentError(
            absl::StrCat("--gpus names device ", ordinal, " twice; got '", gpus, "'"));
      }
      options.gpus->push_back(ordinal);
    }
  }
  if (budget_gb != -1 && !IsBudgetGib(budget_gb)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--gpu_memory_budget_gb must be 0, in [2^-30, 2^33) or -1, got ", budget_gb));
  }
  if (budget_gb >= 0) options.gpu_memory_budget_bytes = GibToBytes(budget_gb);
  // A headroom may round to 0 bytes (none), but must not overflow.
  if (!(headroom_gb >= 0 && headroom_gb < 0x1p33)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--gpu_memory_headroom_gb must be in [0, 2^33), got ", headroom_gb));
  }
  options.gpu_headroom_bytes = GibToBytes(headroom_gb);
  if (!(tiered_gpu_exact_share >= 0 && tiered_gpu_exact_share <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--tiered_gpu_exact_share must be in [0, 1], got ", tiered_gpu_exact_share));
  }
  options.tiered_device_exact_share = tiered_gpu_exact_share;
  options.tiered_device_exact_balance = tiered_gpu_exact_balance;
  return options;
}

absl::StatusOr<std::unique_ptr<Placements>> Placements::Create(const PlacementOptions& options) {
  std::unique_ptr<Placements> placements(new Placements());
  absl::StatusOr<GpuBackends> gpus = MakeGpuBackends(options);
  if (!gpus.ok()) return gpus.status();
  placements->gpu_ = std::move(gpus->backends);
  placements->tiered_ = std::move(gpus->tiered);
  placements->tiered_on_device_ = !placements->tiered_.empty();
  placements->no_gpu_reason_ = std::move(gpus->unavailable);
  placements->gpu_description_ =
      placements->gpu_.empty() ? absl::StrCat("no GPU placements: ", placements->no_gpu_reason_)
                               : std::move(gpus->description);
  if (placements->tiered_.empty()) {
    // The static sets in host memory, and with the stand-in the device's share of exact heads
    // (without it the host tier serves none, whatever the share).
    HostStaticSetTierOptions tier;
    tier.exact_heads = options.tiered_host_exact_heads;
    tier.prepare_check = options.tiered_host_prepare_check;
    tier.finish_check = options.tiered_host_finish_check;
    placements->tiered_.push_back(std::make_unique<TieredBackend>(
        MakeHostStaticSetTier(tier), options.tiered_device_exact_share,
        options.tiered_device_exact_balance));
  }
  return placements;
}

std::array<int64_t, kLearningOutcomes> Placements::CodesLearnings() const {
  std::array<int64_t, kLearningOutcomes> counts{};
  for (const std::unique_ptr<AttentionBackend>& backend : tiered_) {
    // Every tiered backend is a TieredBackend (Create, MakeGpuBackends).
    const CodesLearningTally& tally = static_cast<const TieredBackend&>(*backend).codes_learnings();
    for (int i = 0; i < kLearningOutcomes; ++i) {
      counts[i] += tally.count(static_cast<LearningOutcome>(i));
    }
  }
  return counts;
}

absl::Status ResolveExactSearch(v1::Placement placement, bool static_tier_on_device,
                                SelectorParams* selector) {
  SelectorParams& p = *selector;
  if (p.kind != SelectorKind::kIndex && p.kind != SelectorKind::kReTopK) return absl::OkStatus();
  const bool tiered = placement == v1::PLACEMENT_TIERED;
  if (p.shortlist > 0 || p.exact_search == ExactSearch::kShortlist) {
    if (!tiered) {
      return absl::InvalidArgumentError(absl::StrCat(
          p.shortlist > 0 ? "policy.index.shortlist"
                          : "policy.index.exact_search EXACT_SEARCH_SHORTLIST",
          " is served by PLACEMENT_TIERED only (its codes live beside the static set), not by ",
          v1::Placement_Name(placement)));
    }
  } else if (!tiered && p.kind == SelectorKind::kReTopK &&
             p.exact_search != ExactSearch::kDefault) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy.index.exact_search applies to retopk in PLACEMENT_TIERED only: in ",
        v1::Placement_Name(placement), " its exact path scans the whole context"));
  }
  // Refusals are above: what follows only resolves.
  if (p.exact_search == ExactSearch::kDefault) {
    const bool scans = p.kind == SelectorKind::kReTopK && p.retopk.exact_flat_scan;
    if (p.shortlist > 0) {
      p.exact_search = ExactSearch::kShortlist;
    } else if (tiered && !scans) {
      p.exact_search = static_tier_on_device ? ExactSearch::kShortlist : ExactSearch::kGraph;
    } else if (!tiered && p.kind == SelectorKind::kIndex) {
      p.exact_search = ExactSearch::kGraph;
    }
    // Else retopk's exact path scans (exact_flat_scan, or the CPU and GPU placements): no
    // search to name, kDefault stays.
  }
  if (p.exact_search == ExactSearch::kShortlist && p.shortlist == 0) {
    p.shortlist = std::min(2 * p.top_k, kMaxTopK);
  }
  return absl::OkStatus();
}

absl::Status Placements::ResolveExactSearch(v1::Placement placement,
                                            SelectorParams* selector) const {
  return kvrecall::ResolveExactSearch(placement, tiered_on_device_, selector);
}

AttentionBackend* MostRoom(std::span<const std::unique_ptr<AttentionBackend>> candidates,
                           TenantBudgets* tenant) {
  auto room = [tenant](MemoryBudget* device) {
    const int64_t free = device->available();
    return tenant != nullptr ? std::min(free, tenant->Within(device)->available()) : free;
  };
  AttentionBackend* best = candidates.front().get();
  if (best->device_budget() == nullptr) return best;
  int64_t best_room = room(best->device_budget());
  for (const auto& backend : candidates.subspan(1)) {
    if (backend->device_budget() == nullptr) continue;
    if (const int64_t r = room(backend->device_budget()); r > best_room) {
      best = backend.get();
      best_room = r;
    }
  }
  return best;
}

absl::StatusOr<AttentionBackend*> Placements::Choose(v1::Placement placement,
                                                     const LayerConfig& config,
                                                     TenantBudgets* tenant) {
  if (placement == v1::PLACEMENT_CPU) {
    if (absl::Status s = cpu_.CheckConfig(config); !s.ok()) return s;
    return &cpu_;
  }
  if (placement != v1::PLACEMENT_GPU && placement != v1::PLACEMENT_TIERED) {
    return absl::InvalidArgumentError(
        absl::StrCat("policy.placement ", v1::Placement_Name(placement),
                     " is not a placement; PLACEMENT_CPU, PLACEMENT_GPU and PLACEMENT_TIERED are"));
  }
  const auto& candidates = placement == v1::PLACEMENT_GPU ? gpu_ : tiered_;
  if (candidates.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("policy.placement ", v1::Placement_Name(placement),
                     " cannot be served: ", no_gpu_reason_,
                     "; PLACEMENT_CPU is, and PLACEMENT_TIERED with its static sets in host "
                     "memory"));
  }
  // Every device serves the same configurations; the check names what is served.
  if (absl::Status s = candidates.front()->CheckConfig(config); !s.ok()) return s;
  return MostRoom(candidates, tenant);
}

}  // namespace kvrecall
