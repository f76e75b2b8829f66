#include "server/prefill.h"

#include <omp.h>

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "proto/tensor_codec.h"
#include "server/status_util.h"

namespace kvrecall {

PrefillStream& PrefillStream::operator=(PrefillStream&& other) noexcept {
  layers_.clear();  // first: released into session_'s grant
  registry_ = other.registry_;
  tenant_ = std::move(other.tenant_);
  session_ = std::move(other.session_);
  started_ = other.started_;
  layers_ = std::move(other.layers_);
  return *this;
}

absl::Status PrefillStream::SessionStatus() const {
  // An open session's lock is not waited for (the service asks of every stream at a close).
  if (session_ == nullptr || !session_->closed()) return absl::OkStatus();
  absl::ReaderMutexLock lock(&session_->mu());
  return session_->CheckOpen();
}

std::optional<Session::Use> PrefillStream::UseSession() const {
  if (session_ == nullptr) return std::nullopt;
  return std::optional<Session::Use>(std::in_place, session_.get());
}

absl::Status PrefillStream::Add(const v1::PrefillChunk& chunk, int64_t index) {
  const std::string prefix = absl::StrCat("chunks[", index, "]");
  if (session_ == nullptr) {
    if (chunk.session_id().empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(prefix, ".session_id is required in the first chunk of a stream"));
    }
    absl::StatusOr<std::shared_ptr<Session>> session =
        registry_->Find(chunk.session_id(), tenant_);
    if (!session.ok()) return PrefixStatus(session.status(), prefix, ".session_id: ");
    session_ = *std::move(session);
    started_ = absl::Now();
  } else if (!chunk.session_id().empty() && chunk.session_id() != session_->id()) {
    return absl::InvalidArgumentError(
        absl::StrCat(prefix, ".session_id '",
                     absl::CHexEscape(chunk.session_id().substr(0, 64)),
                     chunk.session_id().size() > 64 ? "...'" : "'", " differs from the stream's ",
                     "session '", session_->id(), "': one stream prefills one session"));
  } else {
    session_->Touch();  // a long prompt keeps its session from expiring
    // A session closed (or expired) since the stream began takes no more of its prompt.
    if (absl::Status s = SessionStatus(); !s.ok()) return s;
  }

  const v1::Geometry& g = session_->geometry();
  const int layer = chunk.layer();
  if (layer < 0 || layer >= g.layers()) {
    return absl::InvalidArgumentError(
        absl::StrCat(prefix, ".layer ", layer, " is out of range [0, ", g.layers(), ")"));
  }
  auto it = layers_.find(layer);
  if (it == layers_.end()) {
    {
      absl::ReaderMutexLock lock(&session_->mu());
      if (absl::Status s = session_->CheckPrefillable(layer); !s.ok()) return s;
    }
    absl::StatusOr<std::unique_ptr<PromptStaging>> staging =
        session_->backend()->NewPromptStaging(session_->layer_config(), session_->accounts());
    if (!staging.ok()) return staging.status();
    it = layers_.emplace(layer, Staged{*std::move(staging), 0}).first;
  }
  PromptStaging& staging = *it->second.prompt;
  const int64_t received = staging.tokens();
  if (chunk.offset() != received) {
    return absl::InvalidArgumentError(absl::StrCat(
        prefix, ".offset is ", chunk.offset(), " but layer ", layer, " has received ", received,
        " tokens in this stream: a layer's chunks must be contiguous and in order"));
  }

  const int64_t q_row[] = {g.q_heads(), g.head_dim()};
  const int64_t kv_row[] = {g.kv_heads(), g.head_dim()};
  const std::string q_field = absl::StrCat(prefix, ".q");
  const std::string k_field = absl::StrCat(prefix, ".k");
  const std::string v_field = absl::StrCat(prefix, ".v");
  const TensorSpec q_spec{q_field, q_row, /*rows_free=*/true, g.dtype()};
  const TensorSpec k_spec{k_field, kv_row, /*rows_free=*/true, g.dtype()};
  const TensorSpec v_spec{v_field, kv_row, /*rows_free=*/true, g.dtype()};
  // q may be left out (no field at all) where the selector does not need it (Commit checks).
  // Checked in field order (q, k, v), so that the first bad field is the one named.
  const bool with_queries = chunk.has_q();
  absl::StatusOr<int64_t> q_rows =
      with_queries ? CheckTensor(chunk.q(), q_spec) : absl::StatusOr<int64_t>(0);
  if (!q_rows.ok()) return q_rows.status();
  absl::StatusOr<int64_t> k_rows = CheckTensor(chunk.k(), k_spec);
  if (!k_rows.ok()) return k_rows.status();
  absl::StatusOr<int64_t> v_rows = CheckTensor(chunk.v(), v_spec);
  if (!v_rows.ok()) return v_rows.status();
  if (!with_queries) q_rows = *k_rows;
  if (*k_rows != *q_rows || *v_rows != *q_rows) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, " carries ", *q_rows, " tokens of q, ",
                                                   *k_rows, " of k and ", *v_rows,
                                                   " of v: they must be the same tokens"));
  }
  const int64_t n = *q_rows;
  if (absl::Status s = registry_->limits().CheckContext(received + n, session_->id(), layer);
      !s.ok()) {
    return PrefixStatus(s, prefix, ": ");
  }

  const std::string what = absl::StrCat("the prompt of layer ", layer);
  if (absl::Status s = staging.Reserve(n, what); !s.ok()) return s;
  // Decoded straight into the reserved tails; a failure leaves them uncommitted.
  if (with_queries) {
    float* queries = staging.query_tail();
    if (absl::Status s = queries != nullptr ? DecodeTensor(chunk.q(), q_spec, queries)
                                            : CheckTensorValues(chunk.q(), q_spec);
        !s.ok()) {
      return s;
    }
  }
  if (absl::Status s = DecodeTensorInto(chunk.k(), k_spec, staging.kv_element(),
                                        staging.key_tail());
      !s.ok()) {
    return s;
  }
  if (absl::Status s = DecodeTensorInto(chunk.v(), v_spec, staging.kv_element(),
                                        staging.value_tail());
      !s.ok()) {
    return s;
  }
  if (absl::Status s = staging.Commit(n, with_queries); !s.ok()) return s;
  if (!with_queries) it->second.queries_from = staging.tokens();
  return absl::OkStatus();
}

namespace {

// Frees layers taken back from a session, then gives the freed memory back to the system. The
// layers go before the session: they give their memory back through its grants.
void FreeTakenLayers(std::vector<std::unique_ptr<LayerBackend>>& layers,
                     std::shared_ptr<Session>& session) {
  const bool any = !layers.empty();
  layers.clear();
  if (any) ReturnFreedMemory();
  session.reset();
}

}  // namespace

// Layers taken back, freed on a queue's thread; deletes itself once run.
class CommittedPrompt::FreeItem final : public WorkItem {
 public:
  FreeItem(std::vector<std::unique_ptr<LayerBackend>> layers, std::shared_ptr<Session> session)
      : layers_(std::move(layers)), session_(std::move(session)) {}
  void Run() override {
    FreeTakenLayers(layers_, session_);
    delete this;
  }

 private:
  std::vector<std::unique_ptr<LayerBackend>> layers_;
  std::shared_ptr<Session> session_;
};

bool CommittedPrompt::Undo(WorkQueue* frees) {
  if (session_ == nullptr) return false;
  std::vector<std::unique_ptr<LayerBackend>> taken;
  {
    absl::MutexLock lock(&session_->mu());
    taken = session_->UncommitPrompt(layers_);
  }
  layers_.clear();
  const bool undone = !taken.empty();
  if (frees != nullptr) {
    // The session goes too, taken back or not: this may be its last reference (it was closed
    // meanwhile), and its end frees every layer it still holds.
    frees->Push(new FreeItem(std::move(taken), std::move(session_)));
  } else {
    FreeTakenLayers(taken, session_);  // outside the session's lock
  }
  return undone;
}

absl::StatusOr<v1::PrefillResponse> PrefillStream::Commit(absl::FunctionRef<bool()> cancelled,
                                                          CommittedPrompt* committed) {
  auto cancelled_status = [] {
    return absl::CancelledError("the Prefill call was cancelled (or its deadline passed): "
                                "nothing was committed");
  };
  // (A call cancelled before its commit began is told so, whatever its chunks were.)
  if (cancelled()) return cancelled_status();
  if (session_ == nullptr) {
    return absl::InvalidArgumentError("the Prefill stream carried no chunks");
  }
  // Fail before the (possibly long) selector builds when the commit cannot succeed.
  {
    absl::ReaderMutexLock lock(&session_->mu());
    int64_t tokens = session_->prompt_tokens();
    for (const auto& [layer, staged] : layers_) {
      if (absl::Status s = session_->CheckPrefillable(layer); !s.ok()) return s;
      const int64_t received = staged.prompt->tokens();
      if (tokens != 0 && received != tokens) {
        return absl::InvalidArgumentError(
            absl::StrCat("layer ", layer, " received ", received,
                         " prompt tokens, other layers of ", "session '", session_->id(), "' have ",
                         tokens, ": every layer's prompt must have one length"));
      }
      tokens = received;
      const SelectorParams& selector = session_->layer_config().selector;
      const int64_t needed =
          session_->backend()->PromptQueriesNeeded(session_->layer_config(), received);
      if (received - staged.queries_from < needed) {
        return absl::InvalidArgumentError(absl::StrCat(
            "layer ", layer, ": the ", SelectorKindName(selector.kind),
            " selector needs the queries (q) of the prompt's last ", needed,
            " tokens, but the chunks give them only from token ", staged.queries_from,
            " on, of ", received, " (a layer reads q from the chunks after its last chunk "
            "without q)"));
      }
    }
  }

  std::vector<StagedLayer> staged;
  std::vector<std::unique_ptr<PromptStaging>> prompts;
  for (auto& [layer, staging] : layers_) {
    staged.push_back(StagedLayer{layer, nullptr});
    prompts.push_back(std::move(staging.prompt));
  }
  layers_.clear();

  auto is_cancelled = [cancelled] { return cancelled(); };
  const absl::Time build_start = absl::Now();
  AttentionBackend* backend = session_->backend();
  const LayerConfig& config = session_->layer_config();
  const SessionAccounts accounts = session_->accounts();
  // Host-held selector state is charged once built; what it and its builds may take is
  // reserved on the session's grant first (drawn from what max_tokens set aside for it, the rest
  // from its budget: its tenant's or the server's) and given back after the builds, which charge
  // what they made: a policy whose state cannot fit is refused before anything is allocated.
  const int count = static_cast<int>(staged.size());
  // Several layers build in parallel, each on one thread then (a nested region is inactive
  // unless OpenMP was told otherwise); a layer alone builds on the whole team.
  const int build_threads =
      count > 1 && omp_get_max_active_levels() <= 1 ? 1 : omp_get_max_threads();
  int64_t state_bound = 0;
  for (const std::unique_ptr<PromptStaging>& prompt : prompts) {
    state_bound += backend->HostSelectorBytesBound(config, prompt->tokens(), build_threads);
  }
  if (state_bound > 0) {
    if (absl::Status s = accounts.host->Reserve(
            state_bound, absl::StrCat("the ", SelectorKindName(config.selector.kind),
                                      " selector state of ", staged.size(), " layers"));
        !s.ok()) {
      return s;
    }
  }
  // The builds in progress stop too (between their units of work: a block of queries, a graph's
  // step, a k-means round), not only those not yet begun: a client retrying with short
  // deadlines would otherwise pile up builds nobody waits for.
  const BuildStop stop([&is_cancelled, this] { return is_cancelled() || session_->closed(); });
  std::vector<absl::Status> built(staged.size());
#pragma omp parallel for schedule(dynamic) if (count > 1)
  for (int i = 0; i < count; ++i) {
    if (stop.requested()) continue;  // cancelled or closed meanwhile: said below
    const absl::Time layer_start = absl::Now();
    LayerConfig layer_config = config;
    layer_config.layer = staged[i].layer;
    absl::StatusOr<std::unique_ptr<LayerBackend>> layer =
        backend->BuildLayer(layer_config, accounts, std::move(prompts[i]), stop);
    if (layer.ok()) {
      if (PolicyMetrics* metrics = session_->metrics(); metrics != nullptr) {
        metrics->ObserveIndexBuild(absl::ToDoubleSeconds(absl::Now() - layer_start));
      }
      staged[i].built = *std::move(layer);
    } else {
      built[i] = layer.status();
    }
  }
  if (state_bound > 0) accounts.host->Release(state_bound);
  const double build_seconds = absl::ToDoubleSeconds(absl::Now() - build_start);
  // A Prefill cancelled, or whose session closed (CloseSession, or it expired), while its layers
  // built stops them, and the stream hears why (not that a build stopped).
  if (is_cancelled()) return cancelled_status();
  if (absl::Status s = SessionStatus(); !s.ok()) return s;
  for (int i = 0; i < count; ++i) {
    if (!built[i].ok()) {
      return PrefixStatus(built[i], "building layer ", staged[i].layer, ": ");
    }
  }

  v1::PrefillResponse response;
  {
    absl::MutexLock lock(&session_->mu());
    // Checked last, just before the layers are installed.
    if (is_cancelled()) return cancelled_status();
    if (absl::Status s = session_->CommitPrompt(staged); !s.ok()) return s;
    response.set_tokens(session_->prompt_tokens());
    if (committed != nullptr) {
      committed->session_ = session_;
      committed->layers_.clear();
      for (const StagedLayer& s : staged) {
        committed->layers_.emplace_back(s.layer, &session_->layer(s.layer));
      }
    }
  }
  session_->Touch();
  response.set_session_id(session_->id());
  response.set_layers_committed(count);
  response.set_build_seconds(build_seconds);
  if (PolicyMetrics* metrics = session_->metrics(); metrics != nullptr) {
    metrics->ObservePrefill(absl::ToDoubleSeconds(absl::Now() - started_));
  }
  return response;
}

}  // namespace kvrecall
