#include "server/prefill.h"

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "proto/tensor_codec.h"
#include "server/status_util.h"

namespace kvrecall {

absl::Status PrefillStream::Add(const v1::PrefillChunk& chunk, int64_t index) {
  const std::string prefix = absl::StrCat("chunks[", index, "]");
  if (session_ == nullptr) {
    if (chunk.session_id().empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(prefix, ".session_id is required in the first chunk of a stream"));
    }
    absl::StatusOr<std::shared_ptr<Session>> session = registry_->Find(chunk.session_id());
    if (!session.ok()) return PrefixStatus(session.status(), prefix, ".session_id: ");
    session_ = *std::move(session);
  } else if (!chunk.session_id().empty() && chunk.session_id() != session_->id()) {
    return absl::InvalidArgumentError(
        absl::StrCat(prefix, ".session_id '", chunk.session_id(), "' differs from the stream's ",
                     "session '", session_->id(), "': one stream prefills one session"));
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
    it =
        layers_
            .emplace(layer,
                     Staging{LayerKvStore(g.kv_heads(), g.head_dim(), session_->budget()),
                             BudgetedRows(int64_t{g.q_heads()} * g.head_dim(), session_->budget())})
            .first;
  }
  Staging& staging = it->second;
  const int64_t received = staging.kv.tokens();
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
  absl::StatusOr<int64_t> q_rows = CheckTensor(chunk.q(), q_spec);
  if (!q_rows.ok()) return q_rows.status();
  absl::StatusOr<int64_t> k_rows = CheckTensor(chunk.k(), k_spec);
  if (!k_rows.ok()) return k_rows.status();
  absl::StatusOr<int64_t> v_rows = CheckTensor(chunk.v(), v_spec);
  if (!v_rows.ok()) return v_rows.status();
  if (*k_rows != *q_rows || *v_rows != *q_rows) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, " carries ", *q_rows, " tokens of q, ",
                                                   *k_rows, " of k and ", *v_rows,
                                                   " of v: they must be the same tokens"));
  }
  const int64_t n = *q_rows;

  const std::string what = absl::StrCat("the prompt of layer ", layer);
  if (absl::Status s = staging.kv.Reserve(n, what); !s.ok()) return s;
  if (absl::Status s = staging.queries.Reserve(n, what); !s.ok()) return s;
  // Decoded straight into the reserved tails; a failure leaves them uncommitted.
  if (absl::Status s = DecodeTensor(chunk.q(), q_spec, staging.queries.tail()); !s.ok()) return s;
  if (absl::Status s = DecodeTensor(chunk.k(), k_spec, staging.kv.key_tail()); !s.ok()) return s;
  if (absl::Status s = DecodeTensor(chunk.v(), v_spec, staging.kv.value_tail()); !s.ok()) return s;
  staging.queries.Commit(n);
  staging.kv.Commit(n);
  return absl::OkStatus();
}

absl::StatusOr<v1::PrefillResponse> PrefillStream::Commit() {
  if (session_ == nullptr) {
    return absl::InvalidArgumentError("the Prefill stream carried no chunks");
  }
  // Fail before the (possibly long) selector builds when the commit cannot succeed.
  {
    absl::ReaderMutexLock lock(&session_->mu());
    int64_t tokens = session_->prompt_tokens();
    for (const auto& [layer, staging] : layers_) {
      if (absl::Status s = session_->CheckPrefillable(layer); !s.ok()) return s;
      if (tokens != 0 && staging.kv.tokens() != tokens) {
        return absl::InvalidArgumentError(
            absl::StrCat("layer ", layer, " received ", staging.kv.tokens(),
                         " prompt tokens, other layers of ", "session '", session_->id(), "' have ",
                         tokens, ": every layer's prompt must have one length"));
      }
      tokens = staging.kv.tokens();
    }
  }

  std::vector<StagedLayer> staged;
  std::vector<const BudgetedRows*> queries;
  staged.reserve(layers_.size());
  for (auto& [layer, staging] : layers_) {
    absl::StatusOr<std::unique_ptr<SupportSelector>> selector = session_->MakeLayerSelector();
    if (!selector.ok()) return selector.status();
    staged.push_back(StagedLayer{layer, std::move(staging.kv), *std::move(selector)});
    queries.push_back(&staging.queries);
  }

  const absl::Time build_start = absl::Now();
  std::vector<absl::Status> built(staged.size());
  const int count = static_cast<int>(staged.size());
#pragma omp parallel for schedule(dynamic) if (count > 1)
  for (int i = 0; i < count; ++i) {
    built[i] = staged[i].selector->Build(staged[i].kv.view(), queries[i]->data());
  }
  const double build_seconds = absl::ToDoubleSeconds(absl::Now() - build_start);
  for (int i = 0; i < count; ++i) {
    if (!built[i].ok()) {
      return absl::Status(built[i].code(), absl::StrCat("building the selector of layer ",
                                                        staged[i].layer, ": ", built[i].message()));
    }
  }

  v1::PrefillResponse response;
  {
    absl::MutexLock lock(&session_->mu());
    if (absl::Status s = session_->CommitPrompt(staged); !s.ok()) return s;
    response.set_tokens(session_->prompt_tokens());
  }
  layers_.clear();  // the prompt queries are not needed any more
  response.set_session_id(session_->id());
  response.set_layers_committed(count);
  response.set_build_seconds(build_seconds);
  return response;
}

}  // namespace kvrecall
