// A session: one sequence's attention state on the server — its geometry and policy, and per
// layer the KV cache and the support selector — plus the registry that owns all sessions.
#ifndef KVRECALL_SERVER_SESSION_H_
#define KVRECALL_SERVER_SESSION_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "index/support_selector.h"
#include "kvrecall/v1/kvrecall.pb.h"
#include "server/host_memory_budget.h"
#include "server/kv_store.h"
#include "server/policy.h"

namespace kvrecall {

// INVALID_ARGUMENT naming the field when the geometry cannot describe a model: layers >= 1,
// heads >= 1 with kv_heads dividing q_heads, head_dim in [1, kMaxHeadDim], a dtype, and a
// finite non-negative softmax_scale.
inline constexpr int kMaxLayers = 1024;
inline constexpr int kMaxHeads = 1024;
inline constexpr int kMaxHeadDim = 1024;
absl::Status ValidateGeometry(const v1::Geometry& geometry);

// A prompt layer assembled by a Prefill stream, handed to Session::CommitPrompt.
struct StagedLayer {
  int layer = 0;
  LayerKvStore kv;                            // the prompt's keys and values
  std::unique_ptr<SupportSelector> selector;  // built on kv
};

// Counters of the decode work a session has served (reported by GetSession).
struct DecodeCounters {
  int64_t layer_steps = 0;  // one per layer per token
  int64_t head_steps = 0;   // one per query head per layer-step
  int64_t candidates = 0;   // tokens scored by selectors, summed over head-steps
  int64_t path_exact = 0;   // head-steps per path
  int64_t path_reuse = 0;
  int64_t path_fallback = 0;
  int64_t path_refresh = 0;
};

class Session {
 public:
  // Per-layer state. The selector is null until the layer's prompt is committed.
  struct Layer {
    LayerKvStore kv;
    std::unique_ptr<SupportSelector> selector;
    int64_t selector_bytes = 0;                  // what was last charged to the budget for it
    std::vector<HeadSelection> selections;       // per query head, reused across steps
    std::vector<std::vector<int32_t>> supports;  // per query head, reused across steps
    // Tokens the selector scored at the previous step, summed over heads (-1: no step yet);
    // predicts whether the next selection is worth running heads in parallel.
    int64_t last_scored_tokens = -1;
  };

  // `geometry` must have passed ValidateGeometry.
  Session(std::string id, std::string label, const v1::Geometry& geometry,
          const EffectivePolicy& policy, HostMemoryBudget* budget);
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  const std::string& id() const { return id_; }
  const v1::Geometry& geometry() const { return geometry_; }
  const EffectivePolicy& policy() const { return policy_; }
  const LayerShape& shape() const { return shape_; }
  HostMemoryBudget* budget() const { return budget_; }
  absl::Mutex& mu() const ABSL_LOCK_RETURNED(mu_) { return mu_; }

  // Makes the selector of one layer, not yet built.
  absl::StatusOr<std::unique_ptr<SupportSelector>> MakeLayerSelector() const;

  // FAILED_PRECONDITION when the session is closed (NOT_FOUND) or `layer` was committed.
  absl::Status CheckPrefillable(int layer) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Installs prompt layers atomically: all of them or none. Every layer must be prefillable,
  // and all prompts of a session have one length (INVALID_ARGUMENT otherwise).
  absl::Status CommitPrompt(std::vector<StagedLayer>& layers) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int64_t prompt_tokens() const ABSL_SHARED_LOCKS_REQUIRED(mu_) { return prompt_tokens_; }

  // NOT_FOUND when closed; INVALID_ARGUMENT when `layer` is out of range; FAILED_PRECONDITION
  // when the layer's prompt is not committed yet.
  absl::Status CheckDecodable(int layer) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  Layer& layer(int index) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return layers_[index]; }
  DecodeCounters& counters() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return counters_; }
  // Re-charges the budget for a layer's selector state after it changed.
  void ChargeSelectorBytes(Layer& layer) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  bool closed() const ABSL_SHARED_LOCKS_REQUIRED(mu_) { return closed_; }
  // Frees every layer; later calls find the session closed.
  void Close() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  v1::SessionInfo Info() const ABSL_SHARED_LOCKS_REQUIRED(mu_);

 private:
  const std::string id_;
  const std::string label_;
  const v1::Geometry geometry_;
  const EffectivePolicy policy_;
  const LayerShape shape_;
  HostMemoryBudget* const budget_;

  mutable absl::Mutex mu_;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  int64_t prompt_tokens_ ABSL_GUARDED_BY(mu_) = 0;  // 0 until a layer is committed
  std::vector<Layer> layers_ ABSL_GUARDED_BY(mu_);
  DecodeCounters counters_ ABSL_GUARDED_BY(mu_);
};

// Every live session, by id. Thread-safe.
class SessionRegistry {
 public:
  explicit SessionRegistry(HostMemoryBudget* budget) : budget_(budget) {}

  // Validates geometry and policy, then registers a new session.
  absl::StatusOr<std::shared_ptr<Session>> Create(const v1::CreateSessionRequest& request);
  // NOT_FOUND when there is no such session, INVALID_ARGUMENT for an empty id. The message
  // names the id, not the field: callers prefix it (PrefixStatus).
  absl::StatusOr<std::shared_ptr<Session>> Find(absl::string_view id) const;
  // Unregisters and frees the session; NOT_FOUND when there is none.
  absl::Status Close(absl::string_view id);
  std::vector<std::shared_ptr<Session>> List() const;

  HostMemoryBudget* budget() const { return budget_; }

 private:
  HostMemoryBudget* const budget_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<Session>> sessions_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvrecall

#endif  // KVRECALL_SERVER_SESSION_H_
