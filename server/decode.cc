#include "server/decode.h"

#include <algorithm>
#include <array>
#include <span>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/message.h"
#include "kernels/fidelity.h"
#include "proto/tensor_codec.h"
#include "server/status_util.h"

namespace kvrecall {
namespace {

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

// A step's sequencer check: the position it says its token takes, where it says one, must be
// the layer's length (the position the token would take). Errors read after "steps[i].position ".
absl::Status CheckStepPosition(const v1::SequenceStep& step, Session& session, int layer)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(session.mu()) {
  if (!step.has_position()) return absl::OkStatus();
  if (step.position() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("must be >= 0 (the tokens the layer holds before it), got ", step.position()));
  }
  const int64_t held = session.layer(layer).tokens();
  if (step.position() == held) return absl::OkStatus();
  return absl::AbortedError(absl::StrCat(
      step.position(), ": session '", session.id(), "' layer ", layer, " holds ", held,
      " tokens, so its next token takes position ", held,
      step.position() < held ? " (a step resent after its first send was applied?)" : "",
      "; nothing of this request was applied"));
}

// Builds make(i) for the request's steps i in [0, n), those of one backend contiguous, and calls
// run(backend, group) once per backend: all sequences a backend serves step in one batch. The
// backends whose Step can fail (a device's) go first, in the order they first appear, then the
// others (the CPU's), so that a request whose device sessions step in one run of one backend
// (AttentionBackend::Step) appends its tokens whole or not at all; request order within a
// backend.
template <typename Item, typename Make, typename Run>
absl::Status RunByBackend(std::span<const std::shared_ptr<Session>> sessions,
                          std::vector<Item>& items, Make make, Run run) {
  absl::InlinedVector<AttentionBackend*, 2> backends;
  size_t can_fail = 0;  // backends[0, can_fail): those whose Step can fail, in order met
  for (const auto& session : sessions) {
    AttentionBackend* backend = session->backend();
    if (std::find(backends.begin(), backends.end(), backend) != backends.end()) continue;
    // (Not std::stable_partition afterwards: it allocates a buffer, here for every request.)
    if (backend->StepCanFail()) {
      backends.insert(backends.begin() + can_fail++, backend);
    } else {
      backends.push_back(backend);
    }
  }
  items.clear();
  for (AttentionBackend* backend : backends) {
    const size_t begin = items.size();
    for (size_t i = 0; i < sessions.size(); ++i) {
      if (sessions[i]->backend() == backend) items.push_back(make(static_cast<int>(i)));
    }
    if (absl::Status s = run(backend, std::span<Item>(items.data() + begin, items.size() - begin));
        !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

// Sets every singular scalar field of `message` to a value of its widest encoding, so that its
// ByteSizeLong bounds that of every message of its type with the same strings and repeated
// fields, whatever fields the type gains later. varint_bytes = 10: any value (ten-byte varints:
// negative ints, undeclared enums). Fewer: the non-negative values of at most that many varint
// bytes, an enum its largest declared value; what a reply's counts, positions and paths are
// (bounded by the history's length, which the caller knows).
void FillWidest(google::protobuf::Message* message, int varint_bytes = 10) {
  using google::protobuf::FieldDescriptor;
  const bool any = varint_bytes >= 10;
  // The largest value of `varint_bytes` varint bytes (7 bits each), capped at `cap`.
  auto largest = [varint_bytes](uint64_t cap) {
    const uint64_t most =
        varint_bytes >= 9 ? UINT64_MAX : (uint64_t{1} << (7 * varint_bytes)) - 1;
    return std::min(most, cap);
  };
  const google::protobuf::Descriptor* descriptor = message->GetDescriptor();
  const google::protobuf::Reflection* reflection = message->GetReflection();
  for (int i = 0; i < descriptor->field_count(); ++i) {
    const FieldDescriptor* f = descriptor->field(i);
    if (f->is_repeated()) continue;
    const bool zigzag = f->type() == FieldDescriptor::TYPE_SINT32 ||
                        f->type() == FieldDescriptor::TYPE_SINT64;
    switch (f->cpp_type()) {
      case FieldDescriptor::CPPTYPE_INT32:
        reflection->SetInt32(
            message, f,
            any ? (zigzag ? INT32_MIN : -1)
                : static_cast<int32_t>(largest(zigzag ? INT32_MAX / 2 : INT32_MAX)));
        break;
      case FieldDescriptor::CPPTYPE_INT64:
        reflection->SetInt64(
            message, f,
            any ? (zigzag ? INT64_MIN : -1)
                : static_cast<int64_t>(largest(zigzag ? INT64_MAX / 2 : INT64_MAX)));
        break;
      case FieldDescriptor::CPPTYPE_UINT32:
        reflection->SetUInt32(message, f, static_cast<uint32_t>(largest(UINT32_MAX)));
        break;
      case FieldDescriptor::CPPTYPE_UINT64:
        reflection->SetUInt64(message, f, largest(UINT64_MAX));
        break;
      case FieldDescriptor::CPPTYPE_FLOAT: reflection->SetFloat(message, f, 1); break;
      case FieldDescriptor::CPPTYPE_DOUBLE: reflection->SetDouble(message, f, 1); break;
      case FieldDescriptor::CPPTYPE_BOOL: reflection->SetBool(message, f, true); break;
      case FieldDescriptor::CPPTYPE_ENUM: {  // proto3 enums are open: -1 is ten bytes
        int declared = 0;
        for (int v = 0; v < f->enum_type()->value_count(); ++v) {
          declared = std::max(declared, f->enum_type()->value(v)->number());
        }
        reflection->SetEnumValue(message, f, any ? -1 : declared);
        break;
      }
      default: break;  // strings and messages: the caller sizes them
    }
  }
}

// `trim` (when given) clears the fields a reply leaves out of the widest message.
template <typename Message>
uint64_t WidestBytes(int varint_bytes = 10, void (*trim)(Message*) = nullptr) {
  Message message;
  FillWidest(&message, varint_bytes);
  if (trim != nullptr) trim(&message);
  return message.ByteSizeLong();
}

// WidestBytes<Message>(b, trim) for every varint width b in [1, 10] (index b).
template <typename Message>
std::array<uint64_t, 11> WidestBytesByVarint(void (*trim)(Message*) = nullptr) {
  std::array<uint64_t, 11> out{};
  for (int b = 1; b <= 10; ++b) out[b] = WidestBytes<Message>(b, trim);
  return out;
}

// Clears the HeadDiagnostics fields that compare_exact alone sets.
void ClearFidelity(v1::HeadDiagnostics* head) {
  head->clear_support_recall();
  head->clear_retained_mass();
  head->clear_output_cosine();
  head->clear_rel_l2();
}

// The bytes of a length-delimited field (a string, a message, a packed array) of `bytes`.
uint64_t DelimitedBytes(int field_number, uint64_t bytes) {
  using google::protobuf::io::CodedOutputStream;
  return CodedOutputStream::VarintSize32(static_cast<uint32_t>(field_number) << 3) +
         CodedOutputStream::VarintSize64(bytes) + bytes;
}

// A Tensor of `shape` (its scalars at their widest; the shape packed) holding `payload` bytes
// in field `payload_field` (data, or packed values). Arithmetic alone: it runs for every
// sequence of every shared step.
uint64_t TensorBytes(std::span<const int64_t> shape, int payload_field, uint64_t payload) {
  static const uint64_t kTensorScalars = WidestBytes<v1::Tensor>();
  uint64_t shape_bytes = 0;
  for (int64_t extent : shape) {
    shape_bytes += google::protobuf::io::CodedOutputStream::VarintSize64(extent);
  }
  return kTensorScalars + DelimitedBytes(v1::Tensor::kShapeFieldNumber, shape_bytes) +
         DelimitedBytes(payload_field, payload);
}

}  // namespace

uint64_t MaxDecodeReplyBytes(const v1::DecodeRequest& request,
                             std::span<const v1::Geometry* const> geometries,
                             std::span<const int64_t> tokens) {
  static const uint64_t kResponseScalars = WidestBytes<v1::DecodeResponse>();
  static const uint64_t kTierMicros = WidestBytes<v1::TierMicros>();
  static const auto result_scalars = WidestBytesByVarint<v1::SequenceResult>();
  static const auto head_bytes_with_fidelity = WidestBytesByVarint<v1::HeadDiagnostics>();
  static const auto head_bytes_without_fidelity =
      WidestBytesByVarint<v1::HeadDiagnostics>(&ClearFidelity);
  const auto& head_bytes =
      request.compare_exact() ? head_bytes_with_fidelity : head_bytes_without_fidelity;
  uint64_t total = kResponseScalars +
                   DelimitedBytes(v1::DecodeResponse::kTierMicrosFieldNumber, kTierMicros);
  for (int i = 0; i < request.steps_size(); ++i) {
    const v1::Geometry& g = *geometries[i];
    // A position, count of candidates or support is at most the history's length.
    const int varint = tokens.empty()
                           ? 10
                           : google::protobuf::io::CodedOutputStream::VarintSize64(
                                 static_cast<uint64_t>(tokens[i]));
    const uint64_t result_scalar_bytes = result_scalars[varint];
    const uint64_t head_entry_bytes = head_bytes[varint];
    const bool as_values = request.steps(i).q().values_size() > 0;
    const uint64_t heads = g.q_heads();
    const int64_t out_shape[] = {g.q_heads(), g.head_dim()};
    const int64_t lse_shape[] = {g.q_heads()};
    const uint64_t outputs = heads * g.head_dim();
    uint64_t result =
        result_scalar_bytes +
        DelimitedBytes(v1::SequenceResult::kSessionIdFieldNumber,
                       request.steps(i).session_id().size()) +
        DelimitedBytes(v1::SequenceResult::kOutputFieldNumber,
                       as_values ? TensorBytes(out_shape, v1::Tensor::kValuesFieldNumber,
                                               outputs * sizeof(float))
                                 : TensorBytes(out_shape, v1::Tensor::kDataFieldNumber,
                                               outputs * DTypeSize(g.dtype())));
    if (request.return_lse()) {
      result += DelimitedBytes(
          v1::SequenceResult::kLseFieldNumber,
          TensorBytes(lse_shape, as_values ? v1::Tensor::kValuesFieldNumber
                                           : v1::Tensor::kDataFieldNumber,
                      heads * sizeof(float)));
    }
    if (request.diagnostics() || request.compare_exact()) {
      result += heads * DelimitedBytes(v1::SequenceResult::kHeadsFieldNumber, head_entry_bytes);
    }
    total += DelimitedBytes(v1::DecodeResponse::kResultsFieldNumber, result);
  }
  return total;
}

void DecodeStream::CountStep(int i, double compute_seconds) {
  Session& session = *sessions_[i];
  const int heads = session.geometry().q_heads();
  DecodeCounters& counters = session.counters();
  ++counters.layer_steps;
  counters.head_steps += heads;
  const HeadReport* reports = heads_.data() + head_offsets_[i];
  for (int h = 0; h < heads; ++h) {
    counters.candidates += reports[h].candidates;
    ++counters.paths[static_cast<int>(reports[h].path)];
  }
  if (PolicyMetrics* metrics = session.metrics(); metrics != nullptr) {
    metrics->CountLayerStep(std::span<const HeadReport>(reports, heads), compute_seconds);
  }
}

absl::Status DecodeStream::WithStepsApplied(const absl::Status& failure, int layer) const {
  std::string appended;
  int count = 0;
  for (size_t i = 0; i < sessions_.size(); ++i) {
    const int64_t tokens = sessions_[i]->layer(layer).tokens();
    if (tokens == tokens_before_[i]) continue;
    absl::StrAppend(&appended, count++ == 0 ? "" : ", ", "steps[", i, "] (session '",
                    sessions_[i]->id(), "' now holds ", tokens, ")");
  }
  if (count == 0) return SuffixStatus(failure, "; no token of this request was appended");
  return SuffixStatus(failure, "; tokens appended before it failed: ", appended,
                      count == static_cast<int>(sessions_.size())
                          ? ""
                          : "; the other steps' tokens were not (resend only those)");
}

StepContext* DecodeStream::ContextFor(AttentionBackend* backend) {
  for (auto& [b, context] : contexts_) {
    if (b == backend) return context.get();
  }
  // Only a device's contexts keep host memory (pinned staging): a stream of the CPU placement
  // holds no tenant's budgets, so that its tenant's series go with its sessions.
  if (budgets_ == nullptr && backend->device_budget() != nullptr) {
    budgets_ = registry_->BudgetsOf(tenant_);
  }
  MemoryAccount* host = budgets_ != nullptr ? budgets_->host() : registry_->budget();
  contexts_.emplace_back(backend, backend->NewStepContext(host));
  return contexts_.back().second.get();
}

absl::Status DecodeStream::Serve(const v1::DecodeRequest& request, v1::DecodeResponse* response,
                                 uint64_t max_reply_bytes, absl::string_view reply_limit) {
  const absl::Time start = absl::Now();
  response->set_request_id(request.request_id());
  response->set_layer(request.layer());
  const int n = request.steps_size();
  const int layer = request.layer();
  // A request without steps (a round trip) has no session to check its layer against: it must
  // at least be a layer some session could have. (Each step's session checks its own.)
  if (n == 0 && (layer < 0 || layer >= kMaxLayers)) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer must be in [0, ", kMaxLayers, "), got ", layer));
  }

  // Field names ("steps[3].q") are formatted only into errors: a valid request allocates none.
  sessions_.clear();
  for (int i = 0; i < n; ++i) {
    absl::StatusOr<std::shared_ptr<Session>> session =
        registry_->Find(request.steps(i).session_id(), tenant_);
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
  q_offsets_.assign(n + 1, 0);
  kv_offsets_.assign(n + 1, 0);
  head_offsets_.assign(n + 1, 0);
  for (int i = 0; i < n; ++i) {
    Session& session = *sessions_[i];
    if (absl::Status s = session.CheckDecodable(layer); !s.ok()) {
      return PrefixStatus(s, "steps[", i, "]: ");
    }
    const v1::SequenceStep& step = request.steps(i);
    if (absl::Status s = CheckStepPosition(step, session, layer); !s.ok()) {
      return PrefixStatus(s, "steps[", i, "].position ");
    }
    if (absl::Status s = registry_->limits().CheckContext(session.layer(layer).tokens() + 1,
                                                          session.id(), layer);
        !s.ok()) {
      return PrefixStatus(s, "steps[", i, "]: ");
    }
    const StepSpecs specs(session.geometry());
    for (auto [tensor, spec] :
         {std::pair{&step.q(), &specs.q}, std::pair{&step.k_new(), &specs.k_new},
          std::pair{&step.v_new(), &specs.v_new}}) {
      if (absl::StatusOr<int64_t> rows = CheckTensor(*tensor, *spec); !rows.ok()) {
        return PrefixStatus(rows.status(), "steps[", i, "].");
      }
    }
    q_offsets_[i + 1] = q_offsets_[i] + specs.q_row[0] * specs.q_row[1];
    kv_offsets_[i + 1] = kv_offsets_[i] + specs.kv_row[0] * specs.kv_row[1];
    head_offsets_[i + 1] = head_offsets_[i] + specs.q_row[0];
  }
  if (const uint64_t client = request.max_reply_bytes();
      client > 0 && (max_reply_bytes == 0 || client < max_reply_bytes)) {
    max_reply_bytes = client;
    reply_limit = "the client's max_reply_bytes";
  }
  if (max_reply_bytes > 0) {
    absl::InlinedVector<const v1::Geometry*, 16> geometries;
    absl::InlinedVector<int64_t, 16> tokens;
    for (const auto& session : sessions_) {
      geometries.push_back(&session->geometry());
      tokens.push_back(session->layer(layer).tokens() + 1);
    }
    if (const uint64_t most = MaxDecodeReplyBytes(request, geometries, tokens);
        most > max_reply_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "the reply to this request can take up to ", most,
          " bytes (its outputs", request.return_lse() ? ", lse" : "",
          request.diagnostics() || request.compare_exact() ? ", per-head diagnostics" : "",
          "), over ", reply_limit, " of ", max_reply_bytes,
          " bytes; nothing of it was applied (send fewer sequences a request, or ask for less "
          "of each: diagnostics, compare_exact, lse)"));
    }
  }

  // Phase 2: room for each new token on every tier, and the data decoded into this stream's
  // scratch; an error here still leaves every session as it was.
  const absl::Time reserve_start = absl::Now();
  for (int i = 0; i < n; ++i) {
    Session& session = *sessions_[i];
    if (absl::Status s = session.layer(layer).ReserveToken(); !s.ok()) {
      return PrefixStatus(s, "steps[", i, "] (session '", session.id(), "', layer ", layer, "): ");
    }
  }
  const double reserve_seconds = absl::ToDoubleSeconds(absl::Now() - reserve_start);
  queries_.resize(q_offsets_[n]);
  keys_.resize(kv_offsets_[n]);
  values_.resize(kv_offsets_[n]);
  for (int i = 0; i < n; ++i) {
    const StepSpecs specs(sessions_[i]->geometry());
    const v1::SequenceStep& step = request.steps(i);
    absl::Status s = DecodeTensor(step.q(), specs.q, queries_.data() + q_offsets_[i]);
    if (s.ok()) s = DecodeTensor(step.k_new(), specs.k_new, keys_.data() + kv_offsets_[i]);
    if (s.ok()) s = DecodeTensor(step.v_new(), specs.v_new, values_.data() + kv_offsets_[i]);
    if (!s.ok()) return PrefixStatus(s, "steps[", i, "].");
  }

  // Phase 3: the request is valid; each backend steps its sequences in one batch.
  const bool shadow = request.compare_exact();
  output_.resize(q_offsets_[n]);
  lse_.resize(head_offsets_[n]);
  heads_.resize(head_offsets_[n]);
  if (shadow && supports_.size() < static_cast<size_t>(head_offsets_[n])) {
    supports_.resize(head_offsets_[n]);
  }
  const absl::Time compute_start = absl::Now();
  StepContext::TierSeconds tiers;
  tokens_before_.resize(n);
  for (int i = 0; i < n; ++i) tokens_before_[i] = sessions_[i]->layer(layer).tokens();
  if (absl::Status s = RunByBackend(
          sessions_, steps_,
          [&](int i) {
            return LayerStep{&sessions_[i]->layer(layer),         queries_.data() + q_offsets_[i],
                             keys_.data() + kv_offsets_[i],       values_.data() + kv_offsets_[i],
                             output_.data() + q_offsets_[i],      lse_.data() + head_offsets_[i],
                             heads_.data() + head_offsets_[i],
                             shadow ? supports_.data() + head_offsets_[i] : nullptr};
          },
          [&](AttentionBackend* backend, std::span<LayerStep> group) {
            StepContext* context = ContextFor(backend);
            absl::Status stepped = backend->Step(group, context);
            tiers += context->tier_seconds;
            return stepped;
          });
      !s.ok()) {
    // The steps a run before the failure appended are counted as any other.
    const double compute_seconds = absl::ToDoubleSeconds(absl::Now() - compute_start);
    for (int i = 0; i < n; ++i) {
      if (sessions_[i]->layer(layer).tokens() != tokens_before_[i]) {
        CountStep(i, compute_seconds);
      }
    }
    return PrefixStatus(WithStepsApplied(s, layer), "layer ", layer, ": ");
  }
  const double compute_seconds = absl::ToDoubleSeconds(absl::Now() - compute_start);

  for (int i = 0; i < n; ++i) {
    CountStep(i, compute_seconds);
    Session& session = *sessions_[i];
    const v1::Geometry& g = session.geometry();
    const int heads = g.q_heads();
    const HeadReport* reports = heads_.data() + head_offsets_[i];

    v1::SequenceResult* result = response->add_results();
    result->set_session_id(session.id());
    result->set_position(session.layer(layer).tokens() - 1);
    const bool as_values = request.steps(i).q().values_size() > 0;
    const int64_t out_shape[] = {heads, g.head_dim()};
    EncodeTensor(std::span<const float>(output_.data() + q_offsets_[i],
                                        q_offsets_[i + 1] - q_offsets_[i]),
                 out_shape, g.dtype(), as_values, result->mutable_output());
    if (request.return_lse()) {
      const int64_t lse_shape[] = {heads};
      EncodeTensor(std::span<const float>(lse_.data() + head_offsets_[i], heads), lse_shape,
                   v1::DTYPE_F32, as_values, result->mutable_lse());
    }
    if (request.diagnostics() || request.compare_exact()) {
      for (int h = 0; h < heads; ++h) {
        v1::HeadDiagnostics* head = result->add_heads();
        head->set_path(PathToProto(reports[h].path));
        head->set_candidates(reports[h].candidates);
        head->set_support(reports[h].support);
        head->set_best_cosine(reports[h].best_cosine);
        head->set_bulk_micros(reports[h].bulk_micros);
        head->set_bulk_start_micros(reports[h].bulk_start_micros);
      }
    }
  }
  if (shadow) {
    if (absl::Status s = CompareExact(request, response); !s.ok()) {
      return PrefixStatus(WithStepsApplied(s, layer), "layer ", layer, " (compare_exact): ");
    }
  }
  if (tiers.static_set != 0 || tiers.bulk != 0 || tiers.link_wait != 0) {
    v1::TierMicros* micros = response->mutable_tier_micros();
    micros->set_static_set(tiers.static_set * 1e6);
    micros->set_bulk(tiers.bulk * 1e6);
    micros->set_link_wait(tiers.link_wait * 1e6);
    micros->set_shortlist(tiers.shortlist * 1e6);
    micros->set_launch(tiers.launch * 1e6);
    micros->set_shortlists_ready(tiers.shortlists_ready * 1e6);
    micros->set_device_exact(tiers.device_exact * 1e6);
    micros->set_plan(tiers.plan * 1e6);
    micros->set_decide(tiers.decide * 1e6);
    micros->set_device_exact_wait(tiers.device_exact_wait * 1e6);
    micros->set_finish_wait(tiers.finish_wait * 1e6);
    micros->set_finish(tiers.finish * 1e6);
    micros->set_reserve(reserve_seconds * 1e6);
  }
  response->set_server_micros(absl::ToDoubleMicroseconds(absl::Now() - start));
  return absl::OkStatus();
}

absl::Status DecodeStream::CompareExact(const v1::DecodeRequest& request,
                                        v1::DecodeResponse* response) {
  const int n = request.steps_size();
  full_output_.resize(q_offsets_[n]);
  full_lse_.resize(head_offsets_[n]);
  if (exact_topk_.size() < static_cast<size_t>(head_offsets_[n])) {
    exact_topk_.resize(head_offsets_[n]);
  }
  const int layer = request.layer();
  if (absl::Status s = RunByBackend(
          sessions_, shadows_,
          [&](int i) {
            return ShadowStep{&sessions_[i]->layer(layer), queries_.data() + q_offsets_[i],
                              sessions_[i]->policy().selector.top_k,
                              full_output_.data() + q_offsets_[i],
                              full_lse_.data() + head_offsets_[i],
                              exact_topk_.data() + head_offsets_[i]};
          },
          [&](AttentionBackend* backend, std::span<ShadowStep> group) {
            return backend->Shadow(group, ContextFor(backend));
          });
      !s.ok()) {
    return s;
  }
  thread_local std::vector<uint8_t> marks;
  for (int i = 0; i < n; ++i) {
    const int heads = sessions_[i]->geometry().q_heads();
    const int d = sessions_[i]->geometry().head_dim();
    const int64_t tokens = sessions_[i]->layer(layer).tokens();
    v1::SequenceResult* result = response->mutable_results(i);
    for (int h = 0; h < heads; ++h) {
      const int64_t row = head_offsets_[i] + h;
      v1::HeadDiagnostics* head = result->mutable_heads(h);
      head->set_support_recall(
          static_cast<float>(SupportRecall(supports_[row], exact_topk_[row], tokens, &marks)));
      head->set_retained_mass(static_cast<float>(RetainedMass(lse_[row], full_lse_[row])));
      const float* o = output_.data() + q_offsets_[i] + static_cast<int64_t>(h) * d;
      const float* o_full = full_output_.data() + q_offsets_[i] + static_cast<int64_t>(h) * d;
      head->set_output_cosine(static_cast<float>(OutputCosine(o, o_full, d)));
      head->set_rel_l2(static_cast<float>(RelativeL2(o, o_full, d)));
    }
  }
  return absl::OkStatus();
}

}  // namespace kvrecall
