#include "server/session.h"

#ifdef __GLIBC__
#include <malloc.h>
#endif

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/container/btree_map.h"
#include "absl/random/random.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "google/protobuf/util/message_differencer.h"
#include "proto/tensor_codec.h"
#include "server/host_memory.h"
#include "server/status_util.h"

namespace kvrecall {
namespace {

absl::Status CheckRange(absl::string_view field, int value, int min, int max) {
  if (value < min || value > max) {
    return absl::InvalidArgumentError(
        absl::StrCat("geometry.", field, " must be in [", min, ", ", max, "], got ", value));
  }
  return absl::OkStatus();
}

// The largest softmax scale at which every logit of tensors within kMaxTensorMagnitude stays
// finite in f32 with room to spare (a quarter of FLT_MAX: kernels scale by log2(e) too): the
// tensors' bound holds products of two elements within f32, and an unbounded scale undid it
// (lse +inf, NaN diagnostics, from tensors the API accepts).
float MostSoftmaxScale(int head_dim) {
  const double largest_dot =
      static_cast<double>(head_dim) * kMaxTensorMagnitude * static_cast<double>(kMaxTensorMagnitude);
  return static_cast<float>(std::numeric_limits<float>::max() / 4.0 / largest_dot);
}

float EffectiveScale(const v1::Geometry& g) {
  return g.softmax_scale() != 0.0f ? g.softmax_scale()
                                   : 1.0f / std::sqrt(static_cast<float>(g.head_dim()));
}

v1::Geometry WithEffectiveScale(v1::Geometry g) {
  g.set_softmax_scale(EffectiveScale(g));
  return g;
}

// The API's Path for a SelectionPath: the proto numbers them from 1 (0 is UNSPECIFIED).
static_assert(v1::PATH_EXACT == 1 + static_cast<int>(SelectionPath::kExact));
static_assert(v1::PATH_REUSE == 1 + static_cast<int>(SelectionPath::kReuse));
static_assert(v1::PATH_FALLBACK == 1 + static_cast<int>(SelectionPath::kFallback));
static_assert(v1::PATH_REFRESH == 1 + static_cast<int>(SelectionPath::kRefresh));
static_assert(kSelectionPaths == 4);

}  // namespace

absl::Status ValidateGeometry(const v1::Geometry& g) {
  if (absl::Status s = CheckRange("layers", g.layers(), 1, kMaxLayers); !s.ok()) return s;
  if (absl::Status s = CheckRange("q_heads", g.q_heads(), 1, kMaxHeads); !s.ok()) return s;
  if (absl::Status s = CheckRange("kv_heads", g.kv_heads(), 1, kMaxHeads); !s.ok()) return s;
  if (g.q_heads() % g.kv_heads() != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "geometry.kv_heads (", g.kv_heads(), ") must divide geometry.q_heads (", g.q_heads(), ")"));
  }
  if (absl::Status s = CheckRange("head_dim", g.head_dim(), 1, kMaxHeadDim); !s.ok()) return s;
  if (DTypeSize(g.dtype()) == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("geometry.dtype must be DTYPE_F32, DTYPE_F16 or DTYPE_BF16, got ",
                     static_cast<int>(g.dtype())));
  }
  if (!std::isfinite(g.softmax_scale()) || g.softmax_scale() < 0.0f) {
    return absl::InvalidArgumentError(
        absl::StrCat("geometry.softmax_scale must be finite and >= 0 (0: 1/sqrt(head_dim)), got ",
                     g.softmax_scale()));
  }
  if (const float most = MostSoftmaxScale(g.head_dim()); g.softmax_scale() > most) {
    return absl::InvalidArgumentError(absl::StrCat(
        "geometry.softmax_scale must be at most ", most, " at head_dim ", g.head_dim(),
        " (so that the logits of tensors within +-", kMaxTensorMagnitude,
        " stay finite in f32), got ", g.softmax_scale()));
  }
  return absl::OkStatus();
}

absl::Status SessionLimits::Validate() const {
  if (max_sessions < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_sessions must be >= 0 (0: no limit), got ", max_sessions));
  }
  if (max_sessions_per_tenant < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max_sessions_per_tenant must be >= 0 (0: no limit), got ", max_sessions_per_tenant));
  }
  if (host_bytes_per_tenant < 0 || gpu_bytes_per_tenant < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the memory budgets per tenant must be >= 0 (0: none but the server's), got host ",
        host_bytes_per_tenant, " and GPU ", gpu_bytes_per_tenant, " bytes"));
  }
  if (max_context_tokens < 0 || max_context_tokens > kMaxLayerTokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_context_tokens must be in [0, ", kMaxLayerTokens,
                     "] (0: no limit but the most a layer can hold), got ", max_context_tokens));
  }
  if (session_idle_ttl < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--session_idle_ttl_seconds must be >= 0 (0: sessions never expire), got ",
                     absl::ToDoubleSeconds(session_idle_ttl)));
  }
  return absl::OkStatus();
}

absl::Status SessionLimits::CheckContext(int64_t tokens, absl::string_view id,
                                         int layer) const {
  const bool past_limit = max_context_tokens != 0 && tokens > max_context_tokens;
  if (!past_limit && tokens <= kMaxLayerTokens) return absl::OkStatus();
  std::string what = id.empty() ? "the session" : absl::StrCat("session '", id, "'");
  if (layer >= 0) what = absl::StrCat("layer ", layer, " of ", what);
  if (!past_limit) {
    return absl::ResourceExhaustedError(absl::StrCat(what, " would hold ", tokens,
                                                     " tokens, beyond the most a layer can hold (",
                                                     kMaxLayerTokens, ")"));
  }
  return RefusedBy(absl::ResourceExhaustedError(absl::StrCat(
                       what, " would hold ", tokens, " tokens, beyond this server's limit of ",
                       max_context_tokens, " tokens per layer (--max_context_tokens=",
                       max_context_tokens, ")")),
                   "max_context_tokens");
}

namespace {

// Whether a session's selector state could ever fit the host budget: the least its builds
// reserve (Prefill reserves the bound for the prompt's length; at one token, what every prompt
// needs: a ReTopK cache reserves its eventual C x K supports whatever the prompt) beside the
// KV set aside for max_tokens. A policy for which that exceeds the whole budget could never be
// built: RESOURCE_EXHAUSTED naming the budget, at CreateSession rather than after the prompt
// streamed in. (A KV alone past the budget is Session::Admit's to refuse.)
absl::Status CheckSelectorStateFits(const AttentionBackend& backend, const LayerConfig& config,
                                    int layers, const MemoryBudget& budget) {
  if (budget.limit() <= 0) return absl::OkStatus();
  const int64_t max_tokens = config.expected_tokens;
  const int64_t layer_kv = max_tokens > 0 ? backend.HostKvBytesFor(config, max_tokens) : 0;
  int64_t kv = 0;
  if (__builtin_mul_overflow(layer_kv, int64_t{layers}, &kv) || kv > budget.limit()) {
    return absl::OkStatus();
  }
  const int64_t layer_state =
      backend.HostSelectorBytesBound(config, /*tokens=*/1, /*build_threads=*/1);
  int64_t state = 0;
  const bool overflow = __builtin_mul_overflow(layer_state, int64_t{layers}, &state);
  if (!overflow && state <= budget.limit() - kv) return absl::OkStatus();
  absl::string_view limit = budget.flag();
  absl::ConsumeSuffix(&limit, "_gb");
  return RefusedBy(
      absl::ResourceExhaustedError(absl::StrFormat(
          "%s budget exceeded: the %s selector state of %d layers needs %s bytes%s, more than "
          "the whole %d-byte budget (%s=%.6g) could ever hold: choose smaller selector knobs "
          "(top_k, retopk.cache_capacity, the index's)%s or fewer layers",
          budget.name(), SelectorKindName(config.selector.kind), layers,
          overflow ? "more" : absl::StrCat(state),
          kv > 0 ? absl::StrCat(" beside the ", kv, " of its KV for max_tokens=", max_tokens)
                 : "",
          budget.limit(), budget.flag(), static_cast<double>(budget.limit()) / (1ll << 30),
          kv > 0 ? ", a smaller max_tokens" : "")),
      limit);
}

// Why an expired session was closed: "expired: no call used it for ... (--session_idle_ttl_
// seconds=...)", for the calls that name it later and the streams that held it.
std::string ExpiryReason(absl::Duration ttl) {
  return absl::StrCat("expired: no call used it for ", absl::FormatDuration(ttl),
                      " (--session_idle_ttl_seconds=", absl::ToDoubleSeconds(ttl), ")");
}

}  // namespace

void ReturnFreedMemory() {
#ifdef __GLIBC__
  malloc_trim(0);
#endif
}

v1::Path PathToProto(SelectionPath path) {
  return static_cast<v1::Path>(1 + static_cast<int>(path));
}

Session::Session(std::string id, std::string label, const v1::Geometry& geometry,
                 const EffectivePolicy& policy, const LayerConfig& config,
                 AttentionBackend* backend, MemoryBudget* host_budget,
                 std::shared_ptr<TenantBudgets> tenant)
    : id_(std::move(id)),
      label_(std::move(label)),
      geometry_(WithEffectiveScale(geometry)),
      policy_(policy),
      config_(config),
      backend_(backend),
      tenant_budgets_(std::move(tenant)),
      host_grant_(tenant_budgets_ != nullptr ? tenant_budgets_->host() : host_budget),
      device_grant_(backend->device_budget() == nullptr ? nullptr
                    : std::make_unique<MemoryGrant>(
                          tenant_budgets_ != nullptr
                              ? tenant_budgets_->Within(backend->device_budget())
                              : backend->device_budget())) {
  absl::MutexLock lock(&mu_);
  layers_.resize(geometry.layers());
}

Session::~Session() {
  absl::MutexLock lock(&mu_);
  Close();
}

absl::Status Session::Admit() {
  const int64_t tokens = config_.expected_tokens;
  if (tokens <= 0) return absl::OkStatus();
  const int layers = geometry_.layers();
  // A layer's bytes are far inside int64 (kMaxLayerTokens); every layer's together may not be.
  auto all_layers = [&](int64_t layer_bytes, absl::string_view where) -> absl::StatusOr<int64_t> {
    int64_t bytes = 0;
    if (__builtin_mul_overflow(layer_bytes, int64_t{layers}, &bytes)) {
      return absl::ResourceExhaustedError(absl::StrCat("max_tokens=", tokens, " of ", layers,
                                                       " layers needs more bytes", where,
                                                       " than can be counted"));
    }
    return bytes;
  };
  if (device_grant_ != nullptr) {
    const std::string where = absl::StrCat(" on ", backend_->device());
    absl::StatusOr<int64_t> bytes = all_layers(backend_->DeviceBytesFor(config_, tokens), where);
    if (!bytes.ok()) return bytes.status();
    if (absl::Status s = device_grant_->SetAside(
            *bytes, absl::StrCat("max_tokens=", tokens, " of ", layers, " layers", where));
        !s.ok()) {
      return s;
    }
  }
  // On the host: the KV and what the selector state grows to by then (a graph index over every
  // token, ReTopK's caches; not a build's scratch, which the Prefill reserves while it builds),
  // so that decoding up to max_tokens draws on the set-aside. (The prompt's queries, staged for
  // the build and freed after it, are not set aside either: a prompt's length is not known
  // here, and all of max_tokens' queries would be most of the set-aside.)
  const int64_t layer_host =
      backend_->HostKvBytesFor(config_, tokens) +
      backend_->HostSelectorBytesBound(config_, tokens, /*build_threads=*/0);
  absl::StatusOr<int64_t> bytes = all_layers(layer_host, " of host memory");
  if (!bytes.ok()) return bytes.status();
  // Without a budget (or with one larger than the machine) nothing else would refuse set-asides
  // the machine can never hold (a first Prefill would fail to allocate, or fault in all of it,
  // or a container's limit would kill the server): this one beside what the server holds
  // already (every session's set-asides and memory, the prompts being staged; admissions racing
  // this check may pass it together: a budget flag is exact).
  if (const int64_t usable = MemoryLimitBytes(); usable > 0) {
    const MemoryBudget& server_wide = host_grant_.budget()->server_wide();
    const int64_t held = server_wide.used();
    if (*bytes > usable - std::min(held, usable)) {
      // Where tenants share the server, what it holds is the others' business (review 23).
      const std::string beside =
          held == 0 ? ""
          : server_wide.hides_use()
              ? " beside what this server holds"
              : absl::StrCat(" beside the ", held, " bytes this server holds");
      return absl::ResourceExhaustedError(absl::StrCat(
          "max_tokens=", tokens, " of ", layers, " layers needs ", *bytes,
          " bytes of host KV and selector state", beside, ", more than the ",
          server_wide.hides_use() ? "" : absl::StrCat(usable, " bytes of "),
          "memory it may use (the machine's, or its control group's limit): announce fewer "
          "tokens",
          held > 0 ? ", or wait for memory to be freed" : ""));
    }
  }
  if (*bytes > 0) {
    return host_grant_.SetAside(*bytes,
                                absl::StrCat("max_tokens=", tokens, " of ", layers, " layers"));
  }
  return absl::OkStatus();
}

absl::Status Session::ClosedStatus() const {
  return absl::NotFoundError(absl::StrCat("session '", id_, "' was closed",
                                          closed_why_.empty() ? "" : ": ", closed_why_));
}

absl::Status Session::CheckPrefillable(int layer) const {
  if (closed()) return ClosedStatus();
  if (layers_[layer] != nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("layer ", layer, " of session '", id_,
                     "' is already prefilled; a layer may be prefilled once"));
  }
  return absl::OkStatus();
}

absl::Status Session::CommitPrompt(std::vector<StagedLayer>& staged) {
  int64_t tokens = prompt_tokens_;
  for (const StagedLayer& s : staged) {
    if (absl::Status st = CheckPrefillable(s.layer); !st.ok()) return st;
    if (tokens != 0 && s.built->tokens() != tokens) {
      return absl::InvalidArgumentError(absl::StrCat(
          "layer ", s.layer, " has a prompt of ", s.built->tokens(), " tokens, but session '", id_,
          "' has prompts of ", tokens, " tokens: every layer's prompt must have one length"));
    }
    tokens = s.built->tokens();
  }
  for (StagedLayer& s : staged) layers_[s.layer] = std::move(s.built);
  prompt_tokens_ = tokens;
  return absl::OkStatus();
}

std::vector<std::unique_ptr<LayerBackend>> Session::UncommitPrompt(
    const std::vector<std::pair<int, const LayerBackend*>>& installed) {
  std::vector<std::unique_ptr<LayerBackend>> taken;
  for (const auto& [layer, backend] : installed) {
    if (layers_[layer].get() != backend || backend->tokens() != prompt_tokens_) return taken;
  }
  for (const auto& [layer, backend] : installed) taken.push_back(std::move(layers_[layer]));
  if (std::all_of(layers_.begin(), layers_.end(), [](const auto& l) { return l == nullptr; })) {
    prompt_tokens_ = 0;
  }
  return taken;
}

absl::Status Session::CheckDecodable(int layer) const {
  if (closed()) return ClosedStatus();
  if (layer < 0 || layer >= geometry_.layers()) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " is out of range [0, ",
                                                   geometry_.layers(), ") of session '", id_, "'"));
  }
  if (layers_[layer] == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "layer ", layer, " of session '", id_, "' has no prompt yet: Prefill it before Decode"));
  }
  return absl::OkStatus();
}

void Session::Close(absl::string_view why) {
  closed_why_ = std::string(why);
  closed_.store(true, std::memory_order_release);
  for (std::unique_ptr<LayerBackend>& layer : layers_) layer.reset();
  host_grant_.ReleaseSetAside();
  if (device_grant_ != nullptr) device_grant_->ReleaseSetAside();
}

v1::SessionInfo Session::Info() const {
  v1::SessionInfo info;
  info.set_session_id(id_);
  info.set_label(label_);
  *info.mutable_geometry() = geometry_;
  *info.mutable_policy() = PolicyToProto(policy_);
  info.set_prompt_tokens(prompt_tokens_);
  info.set_device(backend_->device());
  LayerMemory total;
  int layers_prefilled = 0;
  for (const std::unique_ptr<LayerBackend>& layer : layers_) {
    info.add_layer_tokens(layer != nullptr ? layer->tokens() : 0);
    if (layer == nullptr) continue;
    const LayerMemory m = layer->memory();
    total.host_bytes += m.host_bytes;
    total.device_bytes += m.device_bytes;
    total.selector_bytes += m.selector_bytes;
    ++layers_prefilled;
  }
  info.set_tokens(info.layer_tokens(0));
  info.set_layers_prefilled(layers_prefilled);
  info.set_decode_steps(counters_.layer_steps);
  info.set_host_bytes(total.host_bytes);
  info.set_gpu_bytes(total.device_bytes);
  info.set_selector_bytes(total.selector_bytes);
  info.set_host_budget_bytes(host_grant_.held());
  info.set_gpu_budget_bytes(device_grant_ != nullptr ? device_grant_->held() : 0);
  v1::PathCounts* paths = info.mutable_paths();
  paths->set_exact(counters_.paths[static_cast<int>(SelectionPath::kExact)]);
  paths->set_reuse(counters_.paths[static_cast<int>(SelectionPath::kReuse)]);
  paths->set_fallback(counters_.paths[static_cast<int>(SelectionPath::kFallback)]);
  paths->set_refresh(counters_.paths[static_cast<int>(SelectionPath::kRefresh)]);
  info.set_mean_candidates(counters_.head_steps == 0
                               ? 0.0
                               : static_cast<double>(counters_.candidates) /
                                     static_cast<double>(counters_.head_steps));
  return info;
}

namespace {

// This server's session ids: a prefix and 16 lower-case hex digits, one id per 64-bit number.
constexpr absl::string_view kSessionIdPrefix = "s-";
constexpr size_t kSessionIdDigits = 16;
std::string SessionIdOf(uint64_t number) {
  return absl::StrCat(kSessionIdPrefix, absl::Hex(number, absl::kZeroPad16));
}

// CreateSessionRequest.request_id: 1 to kMaxRequestIdBytes printable ASCII characters, no
// spaces (a UUID fits); INVALID_ARGUMENT, without echoing it, otherwise.
constexpr size_t kMaxRequestIdBytes = 128;
absl::Status CheckRequestId(absl::string_view request_id) {
  const bool printable =
      std::ranges::all_of(request_id, [](char c) { return c > ' ' && c < 127; });
  if (request_id.size() <= kMaxRequestIdBytes && printable) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("request_id must be 1 to ", kMaxRequestIdBytes,
                   " printable ASCII characters without spaces, got ", request_id.size(),
                   " bytes", printable ? "" : " with others"));
}

// made_by_request_'s key: request ids are per tenant.
std::string RequestKey(absl::string_view tenant, absl::string_view request_id) {
  return absl::StrCat(tenant, absl::string_view("\0", 1), request_id);
}

}  // namespace

bool SessionRegistry::IsSessionIdForm(absl::string_view id) {
  if (id.size() != kSessionIdPrefix.size() + kSessionIdDigits ||
      !absl::StartsWith(id, kSessionIdPrefix)) {
    return false;
  }
  return std::all_of(id.begin() + kSessionIdPrefix.size(), id.end(),
                     [](char c) { return absl::ascii_isdigit(c) || (c >= 'a' && c <= 'f'); });
}

absl::StatusOr<std::shared_ptr<Session>> SessionRegistry::Create(
    const v1::CreateSessionRequest& request, absl::string_view tenant) {
  if (absl::Status s = ValidateGeometry(request.geometry()); !s.ok()) return s;
  absl::StatusOr<EffectivePolicy> policy = ResolvePolicy(request.policy());
  if (!policy.ok()) return policy.status();
  if (absl::Status s = placements_->ResolveExactSearch(policy->placement, &policy->selector);
      !s.ok()) {
    return s;
  }
  if (request.max_tokens() < 0 || request.max_tokens() > kMaxLayerTokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_tokens must be in [0, ", kMaxLayerTokens,
                     "] (0: not announced; the most a layer can hold), got ",
                     request.max_tokens()));
  }
  if (absl::Status s = limits_.CheckContext(request.max_tokens()); !s.ok()) {
    return PrefixStatus(s, "max_tokens: ");
  }
  if (request.label().size() > kMaxLabelBytes) {
    return absl::InvalidArgumentError(absl::StrCat("label must be at most ", kMaxLabelBytes,
                                                   " bytes, got ", request.label().size()));
  }
  // A request_id names what its first call made, before the limits and budgets, which that
  // session itself may now fill; a new one is marked as being made until it is registered.
  std::string request_key;
  if (!request.request_id().empty()) {
    if (absl::Status s = CheckRequestId(request.request_id()); !s.ok()) return s;
    request_key = RequestKey(tenant, request.request_id());
    v1::CreateSessionRequest without_id = request;
    without_id.clear_request_id();
    // Kept while the session lives: unknown fields a client padded it with are not (review 25).
    without_id.DiscardUnknownFields();
    absl::MutexLock lock(&mu_);
    auto [made, is_new] = made_by_request_.try_emplace(request_key);
    if (!is_new) {
      if (made->second.session_id.empty()) {
        return absl::AbortedError(absl::StrCat("a CreateSession with request_id '",
                                               request.request_id(),
                                               "' is still making its session: retry it"));
      }
      if (!google::protobuf::util::MessageDifferencer::Equals(made->second.request,
                                                              without_id)) {
        return absl::AlreadyExistsError(absl::StrCat(
            "request_id '", request.request_id(), "' made session ", made->second.session_id,
            " from another request (its geometry, policy, label or max_tokens differ): a new "
            "session needs a new request_id"));
      }
      ++made->second.answers;
      const std::shared_ptr<Session>& session = sessions_.at(made->second.session_id);
      session->Touch();
      return session;
    }
    made->second.request = std::move(without_id);
  }
  absl::Cleanup forget_request = [this, &request_key] {
    if (request_key.empty()) return;
    absl::MutexLock lock(&mu_);
    made_by_request_.erase(request_key);
  };
  const v1::Geometry& g = request.geometry();
  const LayerConfig config{
      LayerShape{g.q_heads(), g.kv_heads(), g.head_dim(), EffectiveScale(g)}, g.dtype(),
      policy->selector, request.max_tokens(),
      limits_.max_context_tokens != 0 ? limits_.max_context_tokens : kMaxLayerTokens};
  std::shared_ptr<TenantBudgets> budgets = BudgetsOf(tenant);
  absl::StatusOr<AttentionBackend*> backend =
      placements_->Choose(policy->placement, config, budgets.get());
  if (!backend.ok()) return backend.status();
  if (absl::Status s = CheckSelectorStateFits(**backend, config, g.layers(), *host_budget_);
      !s.ok()) {
    return s;
  }
  if (budgets != nullptr) {
    if (absl::Status s = CheckSelectorStateFits(**backend, config, g.layers(), *budgets->host());
        !s.ok()) {
      return s;
    }
  }

  thread_local absl::BitGen gen;
  std::string id;
  {
    absl::MutexLock lock(&mu_);
    const int64_t open = static_cast<int64_t>(sessions_.size()) + creating_;
    const auto held = held_by_tenant_.find(tenant);
    const int64_t own = held == held_by_tenant_.end() ? 0 : held->second;
    // The caller is told how many of the sessions are its own, so that it knows whether closing
    // one of its own would make room; other tenants' are not named.
    if (limits_.max_sessions_per_tenant > 0 && own >= limits_.max_sessions_per_tenant) {
      return RefusedBy(
          absl::ResourceExhaustedError(absl::StrCat(
              tenant.empty() ? "this server's callers (it authenticates no tenants) hold "
                             : absl::StrCat("tenant '", tenant, "' holds "),
              own, own == 1 ? " session" : " sessions",
              ", the limit per tenant (--max_sessions_per_tenant=",
              limits_.max_sessions_per_tenant, "): close one (CloseSession)")),
          "max_sessions_per_tenant");
    }
    if (limits_.max_sessions > 0 && open >= limits_.max_sessions) {
      return RefusedBy(
          absl::ResourceExhaustedError(absl::StrCat(
              "this server holds ", open, " sessions, its limit (--max_sessions=",
              limits_.max_sessions, "), ",
              own == 0 ? "none of them yours: retry on another server"
                       : absl::StrCat(own, " of them yours: close one (CloseSession) or retry "
                                      "on another server"))),
          "max_sessions");
    }
    ++creating_;  // the slot is held while the session is admitted
    ++held_by_tenant_[tenant];
    do {
      id = SessionIdOf(absl::Uniform<uint64_t>(gen));
    } while (sessions_.contains(id) || expired_.contains(id));
  }
  auto session = std::make_shared<Session>(id, request.label(), g, *policy, config, *backend,
                                           host_budget_, std::move(budgets));
  const absl::Status admitted = session->Admit();
  if (admitted.ok() && metrics_ != nullptr) {
    session->set_metrics(metrics_->ForPolicy(policy->placement, policy->selector.kind));
  }
  absl::MutexLock lock(&mu_);
  --creating_;
  if (!admitted.ok()) {
    ReleaseTenantSlot(tenant);
    return admitted;
  }
  session->Touch();
  sessions_.emplace(id, session);
  tenants_.emplace(id, tenant);
  if (!request_key.empty()) {
    MadeByRequest& made = made_by_request_.at(request_key);
    made.session_id = id;
    made.answers = 1;
    request_key_of_.emplace(id, request_key);
    request_key.clear();  // made: the cleanup leaves it
  }
  return session;
}

void SessionRegistry::UndoCreate(absl::string_view id, absl::string_view tenant) {
  std::shared_ptr<Session> session;
  {
    // The count and the unregistering under one hold of mu_: a retry between them got the
    // session and answered it, and the undo then closed it (review 25).
    absl::MutexLock lock(&mu_);
    auto it = sessions_.find(id);
    if (it == sessions_.end() || tenants_.at(id) != tenant) return;  // closed meanwhile
    const auto key = request_key_of_.find(id);
    if (key != request_key_of_.end() && --made_by_request_.at(key->second).answers > 0) return;
    session = UnregisterLocked(it);
  }
  CloseUnregistered(*session);
}

void SessionRegistry::ForgetRequestOf(absl::string_view id) {
  const auto key = request_key_of_.find(id);
  if (key == request_key_of_.end()) return;
  made_by_request_.erase(key->second);
  request_key_of_.erase(key);
}

SessionRegistry::SessionRegistry(MemoryBudget* host_budget, Placements* placements,
                                 ServerMetrics* metrics, const SessionLimits& limits)
    : host_budget_(host_budget), placements_(placements), metrics_(metrics), limits_(limits) {
  if (limits_.session_idle_ttl <= absl::ZeroDuration()) return;
  // Sessions are closed within a tenth of the TTL (at most a second) of expiring.
  const absl::Duration period =
      std::clamp(limits_.session_idle_ttl / 10, absl::Milliseconds(10), absl::Seconds(1));
  reaper_ = std::thread([this, period] {
    auto stopping = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stopping_; };
    while (true) {
      {
        absl::MutexLock lock(&mu_);
        if (mu_.AwaitWithTimeout(absl::Condition(&stopping), period)) return;
      }
      if (ExpireIdle(absl::Now()) > 0) ReturnFreedMemory();
    }
  });
}

SessionRegistry::~SessionRegistry() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (reaper_.joinable()) reaper_.join();
}

int SessionRegistry::ExpireIdle(absl::Time now) {
  if (limits_.session_idle_ttl <= absl::ZeroDuration()) return 0;
  std::vector<std::shared_ptr<Session>> expired;
  {
    absl::MutexLock lock(&mu_);
    for (auto it = sessions_.begin(); it != sessions_.end();) {
      if (it->second->in_use() || now - it->second->last_used() <= limits_.session_idle_ttl) {
        ++it;
        continue;
      }
      const std::string id = it->first;
      std::string tenant = tenants_.at(id);
      expired.push_back(UnregisterLocked(it++));  // erasing one keeps the others' iterators
      expired_order_.push_back(id);
      expired_.emplace(id, std::move(tenant));
      if (expired_order_.size() > kExpiredRemembered) {
        expired_.erase(expired_order_.front());
        expired_order_.pop_front();
      }
    }
  }
  // As in Close: streams still holding a session see it closed (a Prefill stream paused past
  // the TTL, told why at its next chunk), its memory is freed now.
  const std::string why = absl::StrCat("it ", ExpiryReason(limits_.session_idle_ttl));
  for (const std::shared_ptr<Session>& session : expired) {
    absl::MutexLock lock(&session->mu());
    session->Close(why);
  }
  if (!expired.empty()) TellClosedListener();
  return static_cast<int>(expired.size());
}

void SessionRegistry::SetClosedListener(absl::AnyInvocable<void()> listener) {
  absl::MutexLock lock(&listener_mu_);
  closed_listener_ = std::move(listener);
}

void SessionRegistry::TellClosedListener() {
  absl::MutexLock lock(&listener_mu_);
  if (closed_listener_) closed_listener_();
}

absl::Status SessionRegistry::NotFound(absl::string_view id, absl::string_view tenant) const {
  if (id.size() > kMaxSessionIdBytes) {
    // Not echoed: a client's limit on the reply's metadata (8 KiB by default) would turn an
    // echo of a long id into another error.
    return absl::InvalidArgumentError(absl::StrCat(
        "a session id of ", id.size(), " bytes: this server's ids are at most ",
        kMaxSessionIdBytes));
  }
  if (auto it = expired_.find(id); it != expired_.end() && it->second == tenant) {
    return absl::NotFoundError(absl::StrCat("session '", id, "' ",
                                            ExpiryReason(limits_.session_idle_ttl),
                                            ", so it was closed and its memory freed"));
  }
  return absl::NotFoundError(absl::StrCat("no session '", absl::CHexEscape(id), "'"));
}

absl::StatusOr<std::shared_ptr<Session>> SessionRegistry::Find(absl::string_view id,
                                                               absl::string_view tenant) const {
  if (id.empty()) return absl::InvalidArgumentError("must name a session, it is empty");
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end() || tenants_.at(id) != tenant) return NotFound(id, tenant);
  it->second->Touch();
  return it->second;
}

std::shared_ptr<TenantBudgets> SessionRegistry::BudgetsOf(absl::string_view tenant) {
  if (limits_.host_bytes_per_tenant <= 0 && limits_.gpu_bytes_per_tenant <= 0) return nullptr;
  absl::MutexLock lock(&mu_);
  std::weak_ptr<TenantBudgets>& entry = tenant_budgets_[tenant];
  if (std::shared_ptr<TenantBudgets> held = entry.lock()) return held;
  auto budgets = std::make_shared<TenantBudgets>(tenant, limits_.host_bytes_per_tenant,
                                                 limits_.gpu_bytes_per_tenant, host_budget_);
  entry = budgets;
  if (tenant_budgets_.size() >= 2 * tenant_budgets_swept_) {
    absl::erase_if(tenant_budgets_, [](const auto& e) { return e.second.expired(); });
    tenant_budgets_swept_ = tenant_budgets_.size();
  }
  return budgets;
}

void SessionRegistry::ReleaseTenantSlot(absl::string_view tenant) {
  auto it = held_by_tenant_.find(tenant);
  if (it != held_by_tenant_.end() && --it->second == 0) held_by_tenant_.erase(it);
}

absl::Status SessionRegistry::Close(absl::string_view id, absl::string_view tenant) {
  std::shared_ptr<Session> session;
  {
    absl::MutexLock lock(&mu_);
    auto it = sessions_.find(id);
    if (it == sessions_.end() || tenants_.at(id) != tenant) {
      return PrefixStatus(NotFound(id, tenant), "session_id: ");
    }
    session = UnregisterLocked(it);
  }
  CloseUnregistered(*session);
  return absl::OkStatus();
}

std::shared_ptr<Session> SessionRegistry::UnregisterLocked(
    absl::flat_hash_map<std::string, std::shared_ptr<Session>>::iterator it) {
  const std::string id = it->first;
  std::shared_ptr<Session> session = std::move(it->second);
  sessions_.erase(it);
  ForgetRequestOf(id);
  ReleaseTenantSlot(tenants_.at(id));
  tenants_.erase(id);
  return session;
}

void SessionRegistry::CloseUnregistered(Session& session) {
  // Streams still holding the session see it closed; its memory is freed now, not when the
  // last of them lets go.
  {
    absl::MutexLock lock(&session.mu());
    session.Close();
  }
  TellClosedListener();
}

std::vector<std::shared_ptr<Session>> SessionRegistry::List(absl::string_view tenant) const {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<Session>> out;
  for (const auto& [id, session] : sessions_) {
    if (tenants_.at(id) == tenant) out.push_back(session);
  }
  return out;
}

std::vector<std::shared_ptr<Session>> SessionRegistry::List() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<Session>> out;
  out.reserve(sessions_.size());
  for (const auto& [id, session] : sessions_) out.push_back(session);
  return out;
}

std::vector<SessionRegistry::TenantHoldings> SessionRegistry::Tenants() const {
  absl::btree_map<std::string, TenantHoldings> by_name;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, tenant] : tenants_) ++by_name[tenant].sessions_open;
    for (const auto& [tenant, entry] : tenant_budgets_) {
      if (std::shared_ptr<TenantBudgets> budgets = entry.lock()) {
        by_name[tenant].budgets = std::move(budgets);
      }
    }
  }
  std::vector<TenantHoldings> out;
  out.reserve(by_name.size());
  for (auto& [tenant, holdings] : by_name) {
    holdings.tenant = tenant;
    out.push_back(std::move(holdings));
  }
  return out;
}

}  // namespace kvrecall
