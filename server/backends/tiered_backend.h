// The tiered placement (PLACEMENT_TIERED, RetrievalAttention composed with ReTopK): per layer a
// small static set — the first `sinks` tokens and a ring of the last `recent` — on a device
// tier (a GPU), and the complete KV in host memory, both in the session's dtype; the CPU selects
// from the host's bulk [sinks, T - recent) (the exact search: the product-quantized shortlist,
// the default on a GPU tier, or the graph index; ReTopK; or a flat scan) and attends, some exact
// heads on the device tier.
// The two partial attention states merge exactly by log-sum-exp (kernels/attention_state.h):
// the merge is the only place the tiers meet.
//
// One decode step of a batch: every new token goes into its host store (reserved before, so
// nothing can fail there) and its static set's ring; the static tier starts attending every
// query head over the static sets (asynchronously, on the GPU), the CPU meanwhile selects and
// attends over the bulk, heads in parallel, and the two states are merged per row.
#ifndef KVRECALL_SERVER_BACKENDS_TIERED_BACKEND_H_
#define KVRECALL_SERVER_BACKENDS_TIERED_BACKEND_H_

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "index/batch_topk.h"
#include "index/build_stop.h"
#include "kernels/kv_view.h"
#include "server/backends/attention_backend.h"
#include "server/backends/bulk_codes.h"
#include "server/backends/codes_learning.h"
#include "server/kv_store.h"

namespace kvrecall {

// One layer's static set on the static tier.
class StaticSet {
 public:
  virtual ~StaticSet() = default;
  virtual int64_t device_bytes() const = 0;
};

// One sequence's part of a static-set step. Host memory.
struct StaticSetStep {
  const LayerConfig* config = nullptr;
  StaticSet* set = nullptr;
  // The layer's host KV including the step's new token (row tokens - 1), in the session's dtype.
  KvView host_kv;
  const float* q = nullptr;      // [q_heads, head_dim]
  const float* k_new = nullptr;  // [kv_heads, head_dim]: the token at position host_kv.tokens-1
  const float* v_new = nullptr;
  float* o = nullptr;            // out: [q_heads, head_dim], the state over the static set
  float* lse = nullptr;          // out: [q_heads]
  // The bulk's shortlist (policy.index.shortlist), when the layer has codes (else null): the
  // layer's bulk this step ([sinks, tokens - recent) of host_kv; Start codes its rows not coded
  // yet), and, once WaitShortlists returned, each query head's best `shortlist` coded bulk rows
  // by approximate score: shortlist_ids [q_heads, shortlist] (host memory, positions in the
  // bulk, in no particular order) and shortlist_sizes [q_heads], chosen among the bulk's first
  // *shortlist_coded rows (set by Start: a tier may scan the rows coded before the step and leave
  // its new ones to the exact path's uncoded tail). The rows of the heads given to the tier
  // (SetExactHeads) may be left as they were: the host reads only its own heads'.
  BulkCodes* codes = nullptr;
  KvView bulk;
  int shortlist = 0;
  int32_t* shortlist_ids = nullptr;
  int32_t* shortlist_sizes = nullptr;
  int64_t* shortlist_coded = nullptr;
  // With codes, the query heads device_heads[0, device_exact_heads) (ascending) run their exact
  // paths on the tier instead of the host (StaticSetTier::ServesExactHeads; the tier reads the
  // two in SetExactHeads, after Start, so that the host may choose them while the step runs):
  // ShortlistSelector::Select's candidates (the shortlist, the KV head's outliers, the uncoded
  // tail), scored exactly against the bulk's rows in host memory (host_kv, pinned by the tier's
  // HostPinning), their top selector.top_k and the attention over them. device_exact_bound: the
  // most heads a step of this layer gives the tier, >= device_exact_heads (constant for a
  // layer, so that a captured step replays whichever heads a step gives). Once Finish returned,
  // each such head h has its state over the bulk in bulk_o [q_heads, head_dim] and bulk_lse
  // [q_heads], and the candidates it scored in bulk_candidates [q_heads]; with bulk_support
  // (else null) its support too, in bulk_support [q_heads, top_k] (positions in the bulk, in no
  // particular order) and bulk_support_sizes [q_heads]. Host memory; other heads untouched.
  const int32_t* device_heads = nullptr;
  int device_exact_heads = 0;
  int device_exact_bound = 0;
  float* bulk_o = nullptr;
  float* bulk_lse = nullptr;
  int32_t* bulk_candidates = nullptr;
  int32_t* bulk_support = nullptr;
  int32_t* bulk_support_sizes = nullptr;
};

// What every tier's SetExactHeads checks before it takes any of the steps' exact heads: each
// step's count within its bound (0 without codes) and its heads among the query heads.
// INTERNAL naming the first that is not.
absl::Status CheckExactHeads(std::span<const StaticSetStep> steps);

// Where static sets live: a GPU (server/backends/gpu_static_set.cc) or, on a machine without
// one, host memory (the same arithmetic on the CPU, so that the placement composes everywhere).
// Thread-safe as AttentionBackend.
class StaticSetTier {
 public:
  virtual ~StaticSetTier() = default;
  // "cuda:0", or "cpu" for the host tier.
  virtual const std::string& device() const = 0;
  // The device's budget; null for the host tier.
  virtual MemoryBudget* device_budget() const = 0;
  // INVALID_ARGUMENT naming the field when the tier cannot hold static sets of `config`.
  virtual absl::Status CheckConfig(const LayerConfig& config) const = 0;
  // Device bytes of one layer's static set (constant in the context length).
  virtual int64_t DeviceBytesFor(const LayerConfig& config) const = 0;
  // The static set of a prompt `prompt` (host, [T, kv_heads, head_dim]), charged to
  // `device` (null for the host tier).
  virtual absl::StatusOr<std::unique_ptr<StaticSet>> Build(const LayerConfig& config,
                                                           MemoryAccount* device,
                                                           const KvView& prompt) = 0;
  // The codes of a layer's bulk (`bulk`: [tokens, kv_heads, head_dim], at least one token) with
  // room for `capacity` rows: the codes charged to the tier's memory (accounts.device on a GPU,
  // accounts.host on the host tier), the quantizers to accounts.host. At prefill, and on the
  // codes' learning thread (codes_learning.h) while steps run, this layer's included (on its
  // other codes): thread-safe, as the rest of the tier. CANCELLED once `stop` is requested,
  // asked as the quantizers train (a learning whose layer closed, a Prefill that will not
  // commit).
  virtual absl::StatusOr<std::unique_ptr<BulkCodes>> BuildCodes(
      const LayerConfig& config, const SessionAccounts& accounts, const KvView& bulk,
      int64_t capacity, const BuildStop& stop) = 0;
  // As AttentionBackend::NewStepContext: host-side buffers charged to `host` (may be null).
  virtual std::unique_ptr<StepContext> NewStepContext(MemoryAccount* host) = 0;
  // A step of `steps` (every step shares SameStaticSet) in five calls. Prepare reserves what the
  // step needs on the tier (workspaces, staging): its resource errors surface there, before the
  // bulk is touched. Start appends each step's token to its static set and starts attending
  // (asynchronously on a device); steps with codes also start their shortlists (before the static
  // sets: the host waits for them) and code their new bulk rows (after the shortlists, which scan
  // the rows before them: a GPU codes the row its ring slot holds until the append). Start
  // returns before the bulk's heads start; SetExactHeads names the tier's exact heads before
  // them; WaitShortlists is called from one of them (or after them), and the shortlists are in
  // the steps' ids once it returned OK; the static-set results
  // are in o and lse once Finish returned (called after the heads: a GPU's new rows' outliers
  // join there; the host tier adds them in Start, before the heads).
  virtual absl::Status Prepare(std::span<const StaticSetStep> steps, StepContext* context) = 0;
  virtual absl::Status Start(std::span<const StaticSetStep> steps, StepContext* context) = 0;
  // The steps' exact heads for the tier (StaticSetStep::device_heads, device_exact_heads, within
  // device_exact_bound), given after Start: the host decides them (ReTopK's cache match) while
  // the started step uploads and runs its shortlists, and the tier's exact heads wait for them
  // on the device. Called once for every step Start started, before WaitShortlists, and followed
  // by Finish whatever it returns (which reads the exact heads' results and ends their work); a
  // host that fails before calling it leaves the tier to run no exact heads (Finish, or the next
  // Prepare, ends the step). INTERNAL for heads out of range or over the bound (then none run).
  virtual absl::Status SetExactHeads(std::span<const StaticSetStep> steps, StepContext* context) {
    return absl::OkStatus();
  }
  virtual absl::Status WaitShortlists(std::span<const StaticSetStep> steps,
                                      StepContext* context) = 0;
  virtual absl::Status Finish(std::span<const StaticSetStep> steps, StepContext* context) = 0;
  // The graph index build's batch top-k on this tier's device (null: on the CPU).
  virtual BatchTopKFunction batch_topk() const { return nullptr; }
  // What makes a layer's host KV readable by the tier (null: the tier reads no host memory).
  virtual HostPinning* host_pinning() { return nullptr; }
  // Whether the tier can run the exact paths of up to `heads` query heads of a step of `config`
  // whose layer has `codes` (one of this tier's: StaticSetStep::device_exact_bound); false when
  // it has no such kernel or the step's bounds (shortlist, outliers, top_k) do not fit it.
  virtual bool ServesExactHeads(const LayerConfig& config, const BulkCodes& codes,
                                int heads) const {
    return false;
  }
};

// The host tier (server/backends/host_static_set.cc): static sets are read from the layer's host
// KV, attended by kernels/cpu; the shortlists' codes are scanned on the CPU.
struct HostStaticSetTierOptions {
  // Serve exact heads (StaticSetTier::ServesExactHeads) as a device would, on a thread of the
  // tier's own beside the host's heads: the CPU stand-in of
  // PlacementOptions::tiered_host_exact_heads, so that TieredBackend's device heads run without
  // a device. Off: the tier takes none (the host's threads run every head).
  bool exact_heads = false;
  // For tests: asked by Prepare; a status that is not OK is Prepare's, as a device tier's
  // refusal of a workspace would be (PlacementOptions::tiered_host_prepare_check).
  std::function<absl::Status()> prepare_check;
  // For tests: asked at the end of Finish, after the static sets' states and the exact heads
  // are in; a status that is not OK is Finish's, as a device's fault reported by the step's
  // download would be (PlacementOptions::tiered_host_finish_check).
  std::function<absl::Status()> finish_check;
};
std::unique_ptr<StaticSetTier> MakeHostStaticSetTier(const HostStaticSetTierOptions& options = {});
// The tier of CUDA device `ordinal`, charging `budget` (the device's, shared with its GPU
// placement); the graph index builds its top-k lists there. With `cuda_graphs` a step's launches
// replay a captured graph (PlacementOptions). CUDA builds only (server/backends/gpu_static_set.cc).
absl::StatusOr<std::unique_ptr<StaticSetTier>> MakeGpuStaticSetTier(int ordinal,
                                                                    MemoryBudget* budget,
                                                                    bool cuda_graphs);

// How many of a layer's query heads the tier's exact path takes, balanced by time
// (PlacementOptions::tiered_device_exact_balance): the step ends when both the device's heads
// and the host's are done, and which half is longer depends on the context, the host's load and
// the link (bench/results/tiered_serving_history.md, d57 and d59: at 128K the host's half, at
// 512K the device's). After each step the count moves by one head: down when the host waited for
// the device, up when the device's step ended more than one of its heads' time before the host's
// heads did (and the count was what held the device back). Within [0, bound]. A layer's
// count is its own, from its launch's times: layers batched in one launch move together.
class DeviceHeadBalance {
 public:
  // One step's times, in seconds. device_heads: the layer's heads the device ran;
  // run_device_heads: every sequence's of the launch; device_exact: the device's time for
  // those; device_step: its whole step (launch to download, device clock); launch: the host's
  // time queueing the step, from the bulk's start; host_end: from the bulk's start to the end
  // of the host's heads; finish_wait: the host's wait for the device after them (0 when it was
  // done).
  struct StepTimes {
    int device_heads = 0;
    int run_device_heads = 0;
    double device_exact = 0, device_step = 0, launch = 0, host_end = 0, finish_wait = 0;
  };
  // A device head's time when the step ran none (a guess; the first step with heads corrects it).
  static constexpr double kUnmeasuredHeadSeconds = 10e-6;
  // A wait below this is too short to move a head for.
  static constexpr double kNoWaitSeconds = 2e-6;

  DeviceHeadBalance(int bound, int start) : bound_(bound), target_(std::clamp(start, 0, bound)) {}
  int bound() const { return bound_; }
  int target() const { return target_; }
  void Update(const StepTimes& step);

 private:
  int bound_;
  int target_;
  double head_seconds_ = kUnmeasuredHeadSeconds;  // the last measured device head's time
};

class TieredStepContext;

class TieredBackend final : public AttentionBackend {
 public:
  // device_exact_share: the share of a layer's query heads (index or retopk, with
  // policy.index.shortlist) whose exact paths may run on the tier, reading the host's bulk over
  // PCIe, when the tier serves them (StaticSetTier::ServesExactHeads) and the layer's host KV
  // could be pinned; the host's threads take the rest. An index layer gives the tier its last
  // heads; a retopk layer decides every head's path once the tier's step is launched, and gives
  // the tier heads on the exact path (fallback, refresh), whose supports come back to its caches. 0: every head on the
  // host. device_exact_balance: the share is the most, and each layer balances its count by
  // time (DeviceHeadBalance) from half its heads; else the tier takes the share every step.
  explicit TieredBackend(std::unique_ptr<StaticSetTier> tier, double device_exact_share = 0,
                         bool device_exact_balance = true)
      : tier_(std::move(tier)),
        device_exact_share_(device_exact_share),
        device_exact_balance_(device_exact_balance) {}

  v1::Placement placement() const override { return v1::PLACEMENT_TIERED; }
  const std::string& device() const override { return tier_->device(); }
  MemoryBudget* device_budget() const override { return tier_->device_budget(); }

  absl::Status CheckConfig(const LayerConfig& config) const override;
  // The static set, and on a device tier the shortlist's codes of a bulk of `tokens`.
  int64_t DeviceBytesFor(const LayerConfig& config, int64_t tokens) const override;
  // The complete KV in the session's dtype.
  int64_t HostKvBytesFor(const LayerConfig& config, int64_t tokens) const override;
  // ReTopK's exact path searches the graph index, built from every prompt query (unless a
  // shortlist replaces the graph).
  int64_t PromptQueriesNeeded(const LayerConfig& config, int64_t tokens) const override;
  int64_t HostSelectorBytesBound(const LayerConfig& config, int64_t tokens,
                                 int build_threads) const override;
  absl::StatusOr<std::unique_ptr<PromptStaging>> NewPromptStaging(
      const LayerConfig& config, const SessionAccounts& accounts) override;
  absl::StatusOr<std::unique_ptr<LayerBackend>> BuildLayer(
      const LayerConfig& config, const SessionAccounts& accounts,
      std::unique_ptr<PromptStaging> prompt, const BuildStop& stop) override;
  std::unique_ptr<StepContext> NewStepContext(MemoryAccount* host) override;
  absl::Status Step(std::span<LayerStep> steps, StepContext* context) override;
  absl::Status Shadow(std::span<ShadowStep> steps, StepContext* context) override;

  // How its layers' codes learnings ended (server/backends/codes_learning.h).
  const CodesLearningTally& codes_learnings() const { return codes_learnings_; }

 private:
  // One launch of the static tier and the bulk work for `batch`, whose static sets match.
  absl::Status StepRun(std::span<LayerStep> batch, TieredStepContext& ctx);

  // Query heads of a layer of `config` whose exact paths the tier runs (0: none).
  int DeviceExactHeads(const LayerConfig& config) const;

  std::unique_ptr<StaticSetTier> tier_;
  const double device_exact_share_;
  const bool device_exact_balance_;
  CodesLearningTally codes_learnings_;  // outlives the layers, as the backend does
};

}  // namespace kvrecall

#endif  // KVRECALL_SERVER_BACKENDS_TIERED_BACKEND_H_
