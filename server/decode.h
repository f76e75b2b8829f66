// The decode pipeline of one Decode stream: validates a request (one layer of one token for
// one or more sequences) in full, reserves room for each sequence's token on every tier, then
// hands the steps to their placements' attention backends — all steps of one backend in one
// batch — and fills the reply, optionally with the fidelity shadow (compare_exact).
#ifndef KVRECALL_SERVER_DECODE_H_
#define KVRECALL_SERVER_DECODE_H_

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"
#include "kvrecall/v1/kvrecall.pb.h"
#include "server/backends/attention_backend.h"
#include "server/session.h"

namespace kvrecall {

// The most bytes the serialized reply to `request` can take: its outputs (and lse, heads'
// diagnostics as the request asks) with every scalar at its widest encoding, so that a step
// can be refused before it is applied rather than after. geometries[i] is the geometry of
// request.steps(i)'s session (its output is [q_heads, head_dim] in that dtype, or f32 values
// when q came as values); tokens[i], when given, the tokens its layer holds with the step's
// (which bound the positions and per-head counts the reply carries; empty: any value).
uint64_t MaxDecodeReplyBytes(const v1::DecodeRequest& request,
                             std::span<const v1::Geometry* const> geometries,
                             std::span<const int64_t> tokens = {});

class DecodeStream {
 public:
  // Steps only sessions of `tenant` (SessionRegistry::Find). What the stream keeps in host
  // memory per backend (a device's pinned staging, StepContext) is charged to the tenant's host
  // budget when tenants have their own, else to the server's.
  explicit DecodeStream(SessionRegistry* registry, std::string tenant = "")
      : registry_(registry), tenant_(std::move(tenant)) {}

  // Serves one request into `response` (which the caller cleared). A request with no steps
  // gets an empty reply. On a validation or budget error nothing was appended for any sequence
  // of the request. A backend's Step may still fail after that (a device's workspace refused,
  // a fault): the backends whose Step can fail step first, so that a request whose device
  // sessions step in one run still appends its tokens whole or not at all; where a failure
  // follows tokens that were appended (several device runs, or compare_exact's shadow after the
  // step), its message names those steps, else it says no token was appended. The sessions of
  // a request are locked together, so streams sharing a session serialize. With
  // `max_reply_bytes` > 0 (a shared region's reply area, gRPC's message limit), a request whose
  // reply could take more (MaxDecodeReplyBytes) is RESOURCE_EXHAUSTED before anything is
  // applied; the message names the limit as `reply_limit`. The request's own max_reply_bytes
  // (the client's receive limit), when smaller, bounds it instead.
  absl::Status Serve(const v1::DecodeRequest& request, v1::DecodeResponse* response,
                     uint64_t max_reply_bytes = 0,
                     absl::string_view reply_limit = "the reply area");

 private:
  // The backend's per-stream context, made on first use (charging the host account).
  StepContext* ContextFor(AttentionBackend* backend);
  // Fills the fidelity fields of each result's heads against the shadow (full attention).
  absl::Status CompareExact(const v1::DecodeRequest& request, v1::DecodeResponse* response);
  // Counts step i of the request, which its backend appended, in its session's counters and
  // policy metrics.
  void CountStep(int i, double compute_seconds);
  // `failure` (a backend's, after validation; its payloads kept) with the tokens of the request
  // appended before it (the steps whose layer holds more than tokens_before_ says), or none.
  absl::Status WithStepsApplied(const absl::Status& failure, int layer) const;

  SessionRegistry* const registry_;
  const std::string tenant_;
  // The tenant's budgets the contexts charge (BudgetsOf, taken with the first device's context;
  // null without per-tenant budgets): declared before contexts_, which release into them.
  std::shared_ptr<TenantBudgets> budgets_;
  absl::InlinedVector<std::pair<AttentionBackend*, std::unique_ptr<StepContext>>, 2> contexts_;
  // Scratch reused across requests so that steady-state decoding allocates little; per step i
  // of the request: queries_[q_offsets_[i]..], keys_/values_[kv_offsets_[i]..], output_
  // like queries_, lse_ and heads_[i * q_heads ...] at head_offsets_[i].
  std::vector<std::shared_ptr<Session>> sessions_;
  std::vector<int64_t> q_offsets_;
  std::vector<int64_t> kv_offsets_;
  std::vector<int64_t> head_offsets_;
  std::vector<int64_t> tokens_before_;  // each step's layer's tokens before the backends ran
  std::vector<float> queries_;
  std::vector<float> keys_;
  std::vector<float> values_;
  std::vector<float> output_;
  std::vector<float> lse_;
  std::vector<HeadReport> heads_;
  std::vector<std::vector<int32_t>> supports_;  // [head_offsets_[n]] with compare_exact
  std::vector<LayerStep> steps_;                // grouped by backend
  std::vector<float> full_output_;
  std::vector<float> full_lse_;
  std::vector<std::vector<int32_t>> exact_topk_;
  std::vector<ShadowStep> shadows_;
};

}  // namespace kvrecall

#endif  // KVRECALL_SERVER_DECODE_H_
