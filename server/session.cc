#include "server/session.h"

#include <cmath>
#include <utility>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "proto/tensor_codec.h"

namespace kvrecall {
namespace {

absl::Status CheckRange(absl::string_view field, int value, int min, int max) {
  if (value < min || value > max) {
    return absl::InvalidArgumentError(
        absl::StrCat("geometry.", field, " must be in [", min, ", ", max, "], got ", value));
  }
  return absl::OkStatus();
}

float EffectiveScale(const v1::Geometry& g) {
  return g.softmax_scale() != 0.0f ? g.softmax_scale()
                                   : 1.0f / std::sqrt(static_cast<float>(g.head_dim()));
}

v1::Geometry WithEffectiveScale(v1::Geometry g) {
  g.set_softmax_scale(EffectiveScale(g));
  return g;
}

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
  return absl::OkStatus();
}

Session::Session(std::string id, std::string label, const v1::Geometry& geometry,
                 const EffectivePolicy& policy, HostMemoryBudget* budget)
    : id_(std::move(id)),
      label_(std::move(label)),
      geometry_(WithEffectiveScale(geometry)),
      policy_(policy),
      shape_{geometry.q_heads(), geometry.kv_heads(), geometry.head_dim(),
             EffectiveScale(geometry)},
      budget_(budget) {
  absl::MutexLock lock(&mu_);
  layers_.resize(geometry.layers());
  for (Layer& layer : layers_) {
    layer.kv = LayerKvStore(shape_.kv_heads, shape_.head_dim, budget_);
  }
}

Session::~Session() {
  absl::MutexLock lock(&mu_);
  Close();
}

absl::StatusOr<std::unique_ptr<SupportSelector>> Session::MakeLayerSelector() const {
  return MakeSelector(policy_.selector, shape_);
}

absl::Status Session::CheckPrefillable(int layer) const {
  if (closed_) return absl::NotFoundError(absl::StrCat("session '", id_, "' was closed"));
  if (layers_[layer].selector != nullptr) {
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
    if (tokens != 0 && s.kv.tokens() != tokens) {
      return absl::InvalidArgumentError(absl::StrCat(
          "layer ", s.layer, " has a prompt of ", s.kv.tokens(), " tokens, but session '", id_,
          "' has prompts of ", tokens, " tokens: every layer's prompt must have one length"));
    }
    tokens = s.kv.tokens();
  }
  for (StagedLayer& s : staged) {
    Layer& layer = layers_[s.layer];
    layer.kv = std::move(s.kv);
    layer.selector = std::move(s.selector);
    layer.selections.assign(shape_.q_heads, HeadSelection{});
    layer.supports.assign(shape_.q_heads, {});
    ChargeSelectorBytes(layer);
  }
  prompt_tokens_ = tokens;
  return absl::OkStatus();
}

absl::Status Session::CheckDecodable(int layer) const {
  if (closed_) return absl::NotFoundError(absl::StrCat("session '", id_, "' was closed"));
  if (layer < 0 || layer >= geometry_.layers()) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " is out of range [0, ",
                                                   geometry_.layers(), ") of session '", id_, "'"));
  }
  if (layers_[layer].selector == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "layer ", layer, " of session '", id_, "' has no prompt yet: Prefill it before Decode"));
  }
  return absl::OkStatus();
}

void Session::ChargeSelectorBytes(Layer& layer) {
  const int64_t now = layer.selector != nullptr ? layer.selector->MemoryBytes() : 0;
  if (now == layer.selector_bytes) return;
  budget_->Charge(now - layer.selector_bytes);
  layer.selector_bytes = now;
}

void Session::Close() {
  closed_ = true;
  for (Layer& layer : layers_) {
    layer.kv.Free();
    layer.selector.reset();
    ChargeSelectorBytes(layer);
    layer.selections.clear();
    layer.supports.clear();
  }
}

v1::SessionInfo Session::Info() const {
  v1::SessionInfo info;
  info.set_session_id(id_);
  info.set_label(label_);
  *info.mutable_geometry() = geometry_;
  *info.mutable_policy() = PolicyToProto(policy_);
  info.set_prompt_tokens(prompt_tokens_);
  int64_t kv_bytes = 0;
  int64_t selector_bytes = 0;
  int layers_prefilled = 0;
  for (const Layer& layer : layers_) {
    kv_bytes += layer.kv.allocated_bytes();
    selector_bytes += layer.selector_bytes;
    layers_prefilled += layer.selector != nullptr;
  }
  info.set_tokens(layers_.empty() ? 0 : layers_[0].kv.tokens());
  info.set_layers_prefilled(layers_prefilled);
  info.set_decode_steps(counters_.layer_steps);
  info.set_host_bytes(kv_bytes + selector_bytes);
  info.set_gpu_bytes(0);  // the CPU placement keeps nothing on a GPU
  info.set_selector_bytes(selector_bytes);
  v1::PathCounts* paths = info.mutable_paths();
  paths->set_exact(counters_.path_exact);
  paths->set_reuse(counters_.path_reuse);
  paths->set_fallback(counters_.path_fallback);
  paths->set_refresh(counters_.path_refresh);
  info.set_mean_candidates(counters_.head_steps == 0
                               ? 0.0
                               : static_cast<double>(counters_.candidates) /
                                     static_cast<double>(counters_.head_steps));
  return info;
}

absl::StatusOr<std::shared_ptr<Session>> SessionRegistry::Create(
    const v1::CreateSessionRequest& request) {
  if (absl::Status s = ValidateGeometry(request.geometry()); !s.ok()) return s;
  absl::StatusOr<EffectivePolicy> policy = ResolvePolicy(request.policy());
  if (!policy.ok()) return policy.status();
  // Selectors are made per layer when a prompt commits; making one now surfaces a selector
  // this build cannot make at CreateSession rather than at the first Prefill.
  const v1::Geometry& g = request.geometry();
  absl::StatusOr<std::unique_ptr<SupportSelector>> probe =
      MakeSelector(policy->selector, LayerShape{g.q_heads(), g.kv_heads(), g.head_dim(), 1.0f});
  if (!probe.ok()) return probe.status();

  thread_local absl::BitGen gen;
  absl::MutexLock lock(&mu_);
  std::string id;
  do {
    id = absl::StrFormat("s-%016x", absl::Uniform<uint64_t>(gen));
  } while (sessions_.contains(id));
  auto session = std::make_shared<Session>(id, request.label(), g, *policy, budget_);
  sessions_.emplace(id, session);
  return session;
}

absl::StatusOr<std::shared_ptr<Session>> SessionRegistry::Find(absl::string_view id) const {
  if (id.empty()) return absl::InvalidArgumentError("must name a session, it is empty");
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return absl::NotFoundError(absl::StrCat("no session '", id, "'"));
  return it->second;
}

absl::Status SessionRegistry::Close(absl::string_view id) {
  std::shared_ptr<Session> session;
  {
    absl::MutexLock lock(&mu_);
    auto it = sessions_.find(id);
    if (it == sessions_.end()) {
      return absl::NotFoundError(absl::StrCat("session_id: no session '", id, "'"));
    }
    session = std::move(it->second);
    sessions_.erase(it);
  }
  // Streams still holding the session see it closed; its memory is freed now, not when the
  // last of them lets go.
  absl::MutexLock lock(&session->mu());
  session->Close();
  return absl::OkStatus();
}

std::vector<std::shared_ptr<Session>> SessionRegistry::List() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<Session>> out;
  out.reserve(sessions_.size());
  for (const auto& [id, session] : sessions_) out.push_back(session);
  return out;
}

}  // namespace kvrecall
