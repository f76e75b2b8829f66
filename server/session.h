// A session: one sequence's attention state on the server — its geometry and policy, the
// attention backend of its placement, and per layer the LayerBackend holding that layer's KV and
// selector state — plus the registry that owns all sessions.
#ifndef KVRECALL_SERVER_SESSION_H_
#define KVRECALL_SERVER_SESSION_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kernels/selection_path.h"
#include "kvrecall/v1/kvrecall.pb.h"
#include "server/backends/attention_backend.h"
#include "server/backends/placements.h"
#include "server/memory_budget.h"
#include "server/metrics.h"
#include "server/policy.h"

namespace kvrecall {

// INVALID_ARGUMENT naming the field when the geometry cannot describe a model: layers >= 1,
// heads >= 1 with kv_heads dividing q_heads, head_dim in [1, kMaxHeadDim], a dtype, and a
// finite non-negative softmax_scale.
inline constexpr int kMaxLayers = 1024;
inline constexpr int kMaxHeads = 1024;
inline constexpr int kMaxHeadDim = 1024;
absl::Status ValidateGeometry(const v1::Geometry& geometry);

// The most tokens a layer of a session can ever hold (prompt + decoded), whatever
// --max_context_tokens says: 2^31 - 1, past any model's context. Token positions are int32
// through the selectors and kernels (the GPU placement's limit too), and it keeps every byte
// count a layer makes of its tokens far inside int64 (2^31 rows of the widest row, 8 MiB, are
// 2^54 bytes), so that no announced max_tokens can wrap an allocation's size.
inline constexpr int64_t kMaxLayerTokens = std::numeric_limits<int32_t>::max();

// The longest label a session may carry (CreateSessionRequest.label), in bytes.
inline constexpr int kMaxLabelBytes = 256;

// Limits a server puts on sessions (kvrecalld's --max_sessions, --max_sessions_per_tenant,
// --host_memory_budget_per_tenant_gb, --gpu_memory_budget_per_tenant_gb, --max_context_tokens and
// --session_idle_ttl_seconds); 0 leaves a limit off. Each refuses before anything is allocated,
// with a status naming the limit (server/status_util.h's RefusedBy, counted by the metrics).
struct SessionLimits {
  // Sessions open at once, of every tenant: CreateSession beyond it gets RESOURCE_EXHAUSTED.
  int64_t max_sessions = 0;
  // Sessions open at once of one tenant (server/auth.h; without tokens every caller is the one
  // tenant ""), so that one tenant cannot take every slot of max_sessions: CreateSession beyond
  // it gets RESOURCE_EXHAUSTED naming it.
  int64_t max_sessions_per_tenant = 0;
  // Bytes of host memory, and of each GPU's, that the sessions of one tenant may hold within the
  // server's budgets (TenantBudgets), so that one tenant cannot take all of them: what a
  // tenant's request needs beyond it gets RESOURCE_EXHAUSTED naming the tenant's budget.
  int64_t host_bytes_per_tenant = 0;
  int64_t gpu_bytes_per_tenant = 0;
  // Tokens per layer of a session (prompt + decoded), at most kMaxLayerTokens: a CreateSession
  // announcing more (max_tokens), a Prefill chunk or a Decode step that would grow a layer past
  // it get RESOURCE_EXHAUSTED. Zero leaves only kMaxLayerTokens.
  int64_t max_context_tokens = 0;
  // A session that no call has used for this long is closed and its memory freed; its id then
  // answers NOT_FOUND saying that it expired. Zero: sessions never expire.
  absl::Duration session_idle_ttl = absl::ZeroDuration();

  // INVALID_ARGUMENT for a negative limit.
  absl::Status Validate() const;
  // OK when a layer may hold `tokens` tokens; otherwise RESOURCE_EXHAUSTED naming
  // max_context_tokens (or kMaxLayerTokens), its value, and `layer` of session `id` (when
  // given). Formats nothing unless it refuses.
  absl::Status CheckContext(int64_t tokens, absl::string_view id = "", int layer = -1) const;
};

// Gives the pages of freed blocks back to the operating system. glibc keeps what a closed
// session freed in its arenas (its mmap threshold grows with the first large block freed, so
// KV arrays come from the arenas too), and the process's resident memory would not go down.
void ReturnFreedMemory();

// The API's name of a path (kvrecall.v1.Path).
v1::Path PathToProto(SelectionPath path);

// A layer built from its prompt by a Prefill stream, handed to Session::CommitPrompt.
struct StagedLayer {
  int layer = 0;
  std::unique_ptr<LayerBackend> built;
};

// Counters of the decode work a session has served (reported by GetSession).
struct DecodeCounters {
  int64_t layer_steps = 0;  // one per layer per token
  int64_t head_steps = 0;   // one per query head per layer-step
  int64_t candidates = 0;   // tokens scored by selectors, summed over head-steps
  int64_t paths[kSelectionPaths] = {};  // head-steps per SelectionPath
};

class Session {
 public:
  // `geometry` must have passed ValidateGeometry and `config` the backend's CheckConfig. The
  // session's memory is charged to `tenant`'s budgets when given (it keeps them alive), else to
  // `host_budget` and the backend's device budget.
  Session(std::string id, std::string label, const v1::Geometry& geometry,
          const EffectivePolicy& policy, const LayerConfig& config, AttentionBackend* backend,
          MemoryBudget* host_budget, std::shared_ptr<TenantBudgets> tenant = nullptr);
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  const std::string& id() const { return id_; }
  const v1::Geometry& geometry() const { return geometry_; }
  const EffectivePolicy& policy() const { return policy_; }
  const LayerConfig& layer_config() const { return config_; }
  AttentionBackend* backend() const { return backend_; }
  // The metrics of the session's placement and selector (null when nobody records them); set
  // by the registry before the session is published.
  PolicyMetrics* metrics() const { return metrics_; }
  void set_metrics(PolicyMetrics* metrics) { metrics_ = metrics; }
  // Where the session's memory is charged (its grants on the host and device budgets).
  SessionAccounts accounts() { return SessionAccounts{&host_grant_, device_grant_.get()}; }
  absl::Mutex& mu() const ABSL_LOCK_RETURNED(mu_) { return mu_; }

  // Marks the session used now: idle sessions expire (SessionLimits::session_idle_ttl) counting
  // from their last use. The registry's Find marks it; long-lived streams mark it per message.
  void Touch() { last_used_ns_.store(absl::GetCurrentTimeNanos(), std::memory_order_relaxed); }
  absl::Time last_used() const {
    return absl::FromUnixNanos(last_used_ns_.load(std::memory_order_relaxed));
  }
  // A call at work on the session for longer than a message (a Prefill's commit, whose builds
  // may outlast the idle TTL): while one lives the session does not expire, and its end counts
  // as a use. Movable; the session must outlive it.
  class Use {
   public:
    explicit Use(Session* session) : session_(session) { session_->users_.fetch_add(1); }
    Use(Use&& other) noexcept : session_(std::exchange(other.session_, nullptr)) {}
    Use& operator=(Use&&) = delete;
    ~Use() {
      if (session_ == nullptr) return;
      session_->Touch();  // before the count drops: the reaper never sees it idle and stale
      session_->users_.fetch_sub(1);
    }

   private:
    Session* session_;
  };
  bool in_use() const { return users_.load() > 0; }

  // Sets aside what the announced max_tokens needs for every layer on each tier
  // (RESOURCE_EXHAUSTED naming the budget when it does not fit). Called once, at admission.
  absl::Status Admit();

  // NOT_FOUND when the session is closed; FAILED_PRECONDITION when `layer` was committed.
  absl::Status CheckPrefillable(int layer) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Installs built prompt layers atomically: all of them or none. Every layer must be
  // prefillable, and all prompts of a session have one length (INVALID_ARGUMENT otherwise).
  absl::Status CommitPrompt(std::vector<StagedLayer>& layers) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes back layers CommitPrompt installed (`installed`: each layer's index and its backend
  // as installed), the session's prompt length 0 again where no layer is left: for a Prefill
  // whose OK never reached its client (gRPC failed the call meanwhile), so that the client, told
  // of a failure, finds nothing committed. Nothing is taken back where any of them was replaced
  // or has been stepped since (someone uses the prompt). Returns the layers taken, for the
  // caller to free outside the lock (none: nothing taken back).
  std::vector<std::unique_ptr<LayerBackend>> UncommitPrompt(
      const std::vector<std::pair<int, const LayerBackend*>>& installed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int64_t prompt_tokens() const ABSL_SHARED_LOCKS_REQUIRED(mu_) { return prompt_tokens_; }

  // NOT_FOUND when closed; INVALID_ARGUMENT when `layer` is out of range; FAILED_PRECONDITION
  // when the layer's prompt is not committed yet.
  absl::Status CheckDecodable(int layer) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // The committed layer `index` (CheckDecodable passed).
  LayerBackend& layer(int index) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return *layers_[index]; }
  DecodeCounters& counters() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return counters_; }

  // Whether Close has run. Needs no lock (a Prefill's builds and the service looking for
  // streams to end must not wait for it); under the lock, it cannot change.
  bool closed() const { return closed_.load(std::memory_order_acquire); }
  // OK while open; once closed, the NOT_FOUND that calls still holding the session are told
  // (naming it and saying why it closed).
  absl::Status CheckOpen() const ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return closed() ? ClosedStatus() : absl::OkStatus();
  }
  // Frees every layer; later calls find the session closed, and are told `why` (empty: a
  // CloseSession) by the NOT_FOUND that streams still holding it get.
  void Close(absl::string_view why = "") ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  v1::SessionInfo Info() const ABSL_SHARED_LOCKS_REQUIRED(mu_);

 private:
  const std::string id_;
  const std::string label_;
  const v1::Geometry geometry_;
  const EffectivePolicy policy_;
  const LayerConfig config_;
  AttentionBackend* const backend_;
  PolicyMetrics* metrics_ = nullptr;
  std::atomic<int64_t> last_used_ns_{absl::GetCurrentTimeNanos()};
  std::atomic<int> users_{0};  // Use objects alive
  // Declared before the layers, which charge them, so that they outlive the layers; the
  // tenant's budgets before the grants on them.
  const std::shared_ptr<TenantBudgets> tenant_budgets_;
  MemoryGrant host_grant_;
  std::unique_ptr<MemoryGrant> device_grant_;  // null when the backend has no device budget

  mutable absl::Mutex mu_;
  std::atomic<bool> closed_{false};  // written under mu_ (see closed())
  std::string closed_why_ ABSL_GUARDED_BY(mu_);  // see Close
  // NOT_FOUND: the session was closed (and why).
  absl::Status ClosedStatus() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  int64_t prompt_tokens_ ABSL_GUARDED_BY(mu_) = 0;  // 0 until a layer is committed
  std::vector<std::unique_ptr<LayerBackend>> layers_ ABSL_GUARDED_BY(mu_);  // null: no prompt yet
  DecodeCounters counters_ ABSL_GUARDED_BY(mu_);
};

// Every live session, by id. Thread-safe.
class SessionRegistry {
 public:
  // `placements` chooses each session's backend; `metrics` (may be null) records what sessions
  // do; all outlive the registry.
  // `limits` must have passed SessionLimits::Validate; with an idle TTL a thread of the
  // registry closes the sessions that expire.
  SessionRegistry(MemoryBudget* host_budget, Placements* placements,
                  ServerMetrics* metrics = nullptr, const SessionLimits& limits = {});
  ~SessionRegistry();
  SessionRegistry(const SessionRegistry&) = delete;
  SessionRegistry& operator=(const SessionRegistry&) = delete;

  // Sessions belong to the tenant that created them (server/auth.h's TenantOf; "" when the
  // server authenticates no one): to any other tenant, Find and Close answer NOT_FOUND as for
  // an id nobody holds, and List leaves them out.

  // Validates geometry and policy, places the session on a backend, admits it, then registers it.
  // With a request_id (CreateSessionRequest.request_id): the session an earlier call of
  // `tenant` with that id made, while it is open and the request is the same.
  absl::StatusOr<std::shared_ptr<Session>> Create(const v1::CreateSessionRequest& request,
                                                  absl::string_view tenant = "");
  // A Create's answer that did not reach its client: closes the session unless another Create
  // with its request_id answered it too (each answer is counted; this takes one back).
  void UndoCreate(absl::string_view id, absl::string_view tenant);
  // NOT_FOUND when there is no such session of `tenant` (saying so when it expired),
  // INVALID_ARGUMENT for an empty id. The message names the id, not the field: callers prefix
  // it (PrefixStatus). Marks the session used (Session::Touch).
  absl::StatusOr<std::shared_ptr<Session>> Find(absl::string_view id,
                                                absl::string_view tenant = "") const;
  // Unregisters and frees the session; NOT_FOUND when `tenant` has none of that id (saying so
  // when it expired).
  absl::Status Close(absl::string_view id, absl::string_view tenant = "");
  // The sessions of `tenant`.
  std::vector<std::shared_ptr<Session>> List(absl::string_view tenant) const;
  // Every session, of every tenant (the server's own accounting: metrics).
  std::vector<std::shared_ptr<Session>> List() const;
  // What one tenant holds: its open sessions, and its budgets while anything is charged to them.
  struct TenantHoldings {
    std::string tenant;
    int64_t sessions_open = 0;
    std::shared_ptr<const TenantBudgets> budgets;  // null: none held, or no per-tenant budgets
  };
  // Every tenant that holds a session or tenant memory (a shared decode region's, a GPU stream's
  // pinned buffers), by name.
  std::vector<TenantHoldings> Tenants() const;
  // Closes the sessions idle for longer than the TTL at `now` (the registry's thread calls it;
  // tests may too) and returns how many it closed.
  int ExpireIdle(absl::Time now);

  // `listener` (null: none) is called after sessions close (Close, ExpireIdle), outside the
  // registry's and the sessions' locks, so that calls still holding a closed session can end
  // now rather than at their next message (the service ends the Prefill streams that stage a
  // prompt for one: their staging is memory no session owns any more). Once this returns, a
  // listener set before is no longer running nor will be called.
  void SetClosedListener(absl::AnyInvocable<void()> listener);

  const SessionLimits& limits() const { return limits_; }

  // The server's host budget.
  MemoryBudget* budget() const { return host_budget_; }
  // `tenant`'s budgets within the server's (the one a session of it holds, if any), or null when
  // the limits give tenants no memory budget of their own.
  std::shared_ptr<TenantBudgets> BudgetsOf(absl::string_view tenant);
  Placements* placements() const { return placements_; }
  ServerMetrics* metrics() const { return metrics_; }

  // Whether `id` has the form of this server's session ids ("s-" and 16 lower-case hex digits),
  // whether or not such a session exists: what a ListSessions page token may be.
  static bool IsSessionIdForm(absl::string_view id);

 private:
  MemoryBudget* const host_budget_;
  Placements* const placements_;
  ServerMetrics* const metrics_;
  const SessionLimits limits_;
  // The longest session id looked up: this server's are "s-" and 16 hex digits.
  static constexpr size_t kMaxSessionIdBytes = 64;
  // NOT_FOUND for `id`, saying that it expired when it did (of `tenant`); INVALID_ARGUMENT,
  // without echoing it, for an id longer than kMaxSessionIdBytes.
  absl::Status NotFound(absl::string_view id, absl::string_view tenant) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Counts one session of `tenant` fewer in held_by_tenant_.
  void ReleaseTenantSlot(absl::string_view tenant) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Forgets the request_id of session `id` (it closed), if it had one.
  void ForgetRequestOf(absl::string_view id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes the session at `it` out of the registry (its tenant's slot and request_id too) and
  // returns it; then CloseUnregistered, outside mu_, frees it and tells the listener.
  std::shared_ptr<Session> UnregisterLocked(
      absl::flat_hash_map<std::string, std::shared_ptr<Session>>::iterator it)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CloseUnregistered(Session& session) ABSL_LOCKS_EXCLUDED(mu_);

  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<Session>> sessions_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::string> tenants_ ABSL_GUARDED_BY(mu_);  // by session id
  // What CreateSession's request_id made: by tenant and request id (RequestKey), the session
  // (empty while it is being made), the request without its id, and the calls that answered
  // it (UndoCreate takes one back); and each such session's key, to forget it at its close.
  struct MadeByRequest {
    std::string session_id;
    v1::CreateSessionRequest request;
    int64_t answers = 0;
  };
  absl::flat_hash_map<std::string, MadeByRequest> made_by_request_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::string> request_key_of_ ABSL_GUARDED_BY(mu_);
  int64_t creating_ ABSL_GUARDED_BY(mu_) = 0;  // admissions in progress (count for max_sessions)
  // Per tenant, its sessions and admissions in progress (max_sessions_per_tenant); a tenant
  // holding none has no entry.
  absl::flat_hash_map<std::string, int64_t> held_by_tenant_ ABSL_GUARDED_BY(mu_);
  // Each tenant's budgets while anything holds them (BudgetsOf); expired entries are dropped
  // when the map has doubled since the last sweep.
  absl::flat_hash_map<std::string, std::weak_ptr<TenantBudgets>> tenant_budgets_
      ABSL_GUARDED_BY(mu_);
  size_t tenant_budgets_swept_ ABSL_GUARDED_BY(mu_) = 0;
  // Ids of expired sessions and their tenants, the latest kExpiredRemembered of them, so that
  // their owners hear why they are gone.
  static constexpr size_t kExpiredRemembered = 1 << 16;
  absl::flat_hash_map<std::string, std::string> expired_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> expired_order_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread reaper_;  // with an idle TTL: runs ExpireIdle
  // Held while the listener runs (after mu_ and the sessions' locks are let go).
  absl::Mutex listener_mu_;
  absl::AnyInvocable<void()> closed_listener_ ABSL_GUARDED_BY(listener_mu_);
  void TellClosedListener();
};

}  // namespace kvrecall

#endif  // KVRECALL_SERVER_SESSION_H_
