#include "server/decode.h"

#include <algorithm>
#include <span>
#include <string>
#include <utility>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/parallel.h"
#include "kernels/fidelity.h"
#include "proto/tensor_codec.h"
#include "server/status_util.h"

namespace kvrecall {
namespace {

v1::Path PathToProto(SelectionPath path) {
  switch (path) {
    case SelectionPath::kExact:
      return v1::PATH_EXACT;
    case SelectionPath::kReuse:
      return v1::PATH_REUSE;
    case SelectionPath::kFallback:
      return v1::PATH_FALLBACK;
    case SelectionPath::kRefresh:
      return v1::PATH_REFRESH;
  }
  return v1::PATH_UNSPECIFIED;
}

void CountPath(SelectionPath path, DecodeCounters* counters) {
  switch (path) {
    case SelectionPath::kExact:
      ++counters->path_exact;
      break;
    case SelectionPath::kReuse:
      ++counters->path_reuse;
      break;
    case SelectionPath::kFallback:
      ++counters->path_fallback;
      break;
    case SelectionPath::kRefresh:
      ++counters->path_refresh;
      break;
  }
}

// Holds the locks of a request's sessions, taken in address order so that two requests
// naming the same sessions in different orders cannot deadlock.
class SessionsLock {
 public:
  explicit SessionsLock(std::span<const std::shared_ptr<Session>> sessions) {
    for (const auto& s : sessions) sorted_.push_back(s.get());
    std::sort(sorted_.begin(), sorted_.end());
    for (Session* s : sorted_) s->mu().Lock();
  }
  ~SessionsLock() {
    for (auto it = sorted_.rbegin(); it != sorted_.rend(); ++it) (*it)->mu().Unlock();
  }
  SessionsLock(const SessionsLock&) = delete;
  SessionsLock& operator=(const SessionsLock&) = delete;

 private:
  // Requests batch a handful of sequences; up to 16 are locked without allocating.
  absl::InlinedVector<Session*, 16> sorted_;
};

// What q, k_new and v_new of a step must look like for a session. Field names are bare
// ("q"): errors get their "steps[i]." prefix where they are raised.
struct StepSpecs {
  explicit StepSpecs(const v1::Geometry& g)
      : q_row{g.q_heads(), g.head_dim()},
        kv_row{g.kv_heads(), g.head_dim()},
        q{"q", q_row, false, g.dtype()},
        k_new{"k_new", kv_row, false, g.dtype()},
        v_new{"v_new", kv_row, false, g.dtype()} {}
  const int64_t q_row[2];
  const int64_t kv_row[2];
  const TensorSpec q, k_new, v_new;
};

}  // namespace

absl::Status DecodeStream::Serve(const v1::DecodeRequest& request, v1::DecodeResponse* response) {
  const absl::Time start = absl::Now();
  response->set_request_id(request.request_id());
  response->set_layer(request.layer());
  const int n = request.steps_size();
  const int layer = request.layer();

  // Field names ("steps[3].q") are formatted only into errors: a valid request allocates none.
  sessions_.clear();
  for (int i = 0; i < n; ++i) {
    absl::StatusOr<std::shared_ptr<Session>> session =
        registry_->Find(request.steps(i).session_id());
    if (!session.ok()) return PrefixStatus(session.status(), "steps[", i, "].session_id: ");
    for (int j = 0; j < i; ++j) {
      if (sessions_[j] == *session) {
        return absl::InvalidArgumentError(
            absl::StrCat("steps[", i, "].session_id '", (*session)->id(), "' repeats steps[", j,
                         "]: a request carries one token per sequence"));
      }
    }
    sessions_.push_back(*std::move(session));
  }
  SessionsLock lock(sessions_);

  // Phase 1: everything that can be checked without touching data.
  query_offsets_.assign(n + 1, 0);
  for (int i = 0; i < n; ++i) {
    Session& session = *sessions_[i];
    if (absl::Status s = session.CheckDecodable(layer); !s.ok()) {
      return PrefixStatus(s, "steps[", i, "]: ");
    }
    const StepSpecs specs(session.geometry());
    const v1::SequenceStep& step = request.steps(i);
    for (auto [tensor, spec] :
         {std::pair{&step.q(), &specs.q}, std::pair{&step.k_new(), &specs.k_new},
          std::pair{&step.v_new(), &specs.v_new}}) {
      if (absl::StatusOr<int64_t> rows = CheckTensor(*tensor, *spec); !rows.ok()) {
        return PrefixStatus(rows.status(), "steps[", i, "].");
      }
    }
    query_offsets_[i + 1] = query_offsets_[i] + int64_t{specs.q_row[0]} * specs.q_row[1];
  }

  // Phase 2: room for each new token, then the data, decoded into that room (uncommitted, so
  // an error here still leaves every session as it was).
  for (int i = 0; i < n; ++i) {
    Session& session = *sessions_[i];
    if (absl::Status s = session.layer(layer).kv.Reserve(1, "the new token"); !s.ok()) {
      return PrefixStatus(s, "steps[", i, "] (session '", session.id(), "', layer ", layer, "): ");
    }
  }
  queries_.resize(query_offsets_[n]);
  for (int i = 0; i < n; ++i) {
    Session& session = *sessions_[i];
    const StepSpecs specs(session.geometry());
    const v1::SequenceStep& step = request.steps(i);
    LayerKvStore& kv = session.layer(layer).kv;
    absl::Status s = DecodeTensor(step.q(), specs.q, queries_.data() + query_offsets_[i]);
    if (s.ok()) s = DecodeTensor(step.k_new(), specs.k_new, kv.key_tail());
    if (s.ok()) s = DecodeTensor(step.v_new(), specs.v_new, kv.value_tail());
    if (!s.ok()) return PrefixStatus(s, "steps[", i, "].");
  }

  // Phase 3: the request is valid; nothing below can fail.
  for (int i = 0; i < n; ++i) {
    Session& session = *sessions_[i];
    session.layer(layer).kv.Commit(1);
    Attend(session, layer, queries_.data() + query_offsets_[i], request,
           request.steps(i).q().values_size() > 0, response->add_results());
  }
  response->set_server_micros(absl::ToDoubleMicroseconds(absl::Now() - start));
  return absl::OkStatus();
}

void DecodeStream::Attend(Session& session, int layer_index, const float* q,
                          const v1::DecodeRequest& request, bool as_values,
                          v1::SequenceResult* result) {
  Session::Layer& layer = session.layer(layer_index);
  const LayerShape& shape = session.shape();
  const int heads = shape.q_heads;
  const int d = shape.head_dim;
  const KvView kv = layer.kv.view();

  layer.selector->OnAppend(kv);
  SupportSelector* selector = layer.selector.get();
  const int64_t predicted_tokens = layer.last_scored_tokens >= 0
                                       ? layer.last_scored_tokens
                                       : static_cast<int64_t>(heads) * kv.tokens;
  const int threads = cpu::ThreadsFor(predicted_tokens * d, heads);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int h = 0; h < heads; ++h) {
    HeadSelection& selection = layer.selections[h];
    // The support buffers travel between the selection and `supports` (the attention
    // kernel's input) by swapping, so their capacity is reused from step to step.
    std::swap(selection.support, layer.supports[h]);
    selection.path = SelectionPath::kExact;
    selection.candidates = 0;
    selection.best_cosine = 0.0f;
    selector->Select(h, q + static_cast<int64_t>(h) * d, kv, &selection);
    std::swap(selection.support, layer.supports[h]);
  }

  output_.resize(static_cast<size_t>(heads) * d);
  lse_.resize(heads);
  cpu::MultiHeadAttention(q, heads, kv, layer.supports, shape.scale, output_.data(), lse_.data());

  DecodeCounters& counters = session.counters();
  ++counters.layer_steps;
  counters.head_steps += heads;
  layer.last_scored_tokens = 0;
  for (const HeadSelection& selection : layer.selections) {
    counters.candidates += selection.candidates;
    layer.last_scored_tokens += selection.candidates;
    CountPath(selection.path, &counters);
  }
  session.ChargeSelectorBytes(layer);

  result->set_session_id(session.id());
  result->set_position(kv.tokens - 1);
  const int64_t out_shape[] = {heads, d};
  EncodeTensor(output_, out_shape, session.geometry().dtype(), as_values, result->mutable_output());
  if (request.return_lse()) {
    const int64_t lse_shape[] = {heads};
    EncodeTensor(lse_, lse_shape, v1::DTYPE_F32, as_values, result->mutable_lse());
  }
  if (request.diagnostics() || request.compare_exact()) {
    for (int h = 0; h < heads; ++h) {
      const HeadSelection& selection = layer.selections[h];
      v1::HeadDiagnostics* head = result->add_heads();
      head->set_path(PathToProto(selection.path));
      head->set_candidates(selection.candidates);
      head->set_support(static_cast<int32_t>(layer.supports[h].size()));
      head->set_best_cosine(selection.best_cosine);
    }
  }
  if (request.compare_exact()) CompareExact(session, layer, q, result);
}

void DecodeStream::CompareExact(const Session& session, const Session::Layer& layer, const float* q,
                                v1::SequenceResult* result) {
  const LayerShape& shape = session.shape();
  const int heads = shape.q_heads;
  const int d = shape.head_dim;
  const int top_k = session.policy().selector.top_k;
  const KvView kv = layer.kv.view();
  full_output_.resize(static_cast<size_t>(heads) * d);
  full_lse_.resize(heads);
  cpu::MultiHeadFullAttention(q, heads, kv, shape.scale, full_output_.data(), full_lse_.data());
  const int threads = cpu::ThreadsFor(static_cast<int64_t>(heads) * kv.tokens * d, heads);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int h = 0; h < heads; ++h) {
    thread_local std::vector<int32_t> exact;
    thread_local std::vector<uint8_t> marks;
    const float* q_h = q + static_cast<int64_t>(h) * d;
    cpu::ExactTopK(q_h, kv, KvHeadOf(h, heads, shape.kv_heads), shape.scale, top_k, &exact);
    v1::HeadDiagnostics* head = result->mutable_heads(h);
    head->set_support_recall(
        static_cast<float>(SupportRecall(layer.supports[h], exact, kv.tokens, &marks)));
    head->set_retained_mass(static_cast<float>(RetainedMass(lse_[h], full_lse_[h])));
    const float* o = output_.data() + static_cast<int64_t>(h) * d;
    const float* o_full = full_output_.data() + static_cast<int64_t>(h) * d;
    head->set_output_cosine(static_cast<float>(OutputCosine(o, o_full, d)));
    head->set_rel_l2(static_cast<float>(RelativeL2(o, o_full, d)));
  }
}

}  // namespace kvrecall
