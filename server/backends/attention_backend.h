// The seam between the decode pipeline and the placements: an AttentionBackend (one per
// placement and device) builds the LayerBackend that each layer of a session holds — which owns
// that layer's KV and selector state wherever they live — and steps batches of them, returning
// an attention state (o, lse) per (sequence, query head) row.
//
// Life of a layer: the Prefill stream appends the prompt to a PromptStaging (two-phase, as
// BudgetedRows), BuildLayer turns it into a LayerBackend (indexes, caches) outside the session's
// lock, and the session installs the built layers atomically. A decode step first asks every
// layer of the request to ReserveToken (a refusal leaves every layer as it was), then the
// backend's Step appends each token and attends, for all of its layers of the request at once.
#ifndef KVRECALL_SERVER_BACKENDS_ATTENTION_BACKEND_H_
#define KVRECALL_SERVER_BACKENDS_ATTENTION_BACKEND_H_

#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "index/build_stop.h"
#include "index/selector_params.h"
#include "index/support_selector.h"
#include "kernels/dtype.h"
#include "kernels/selection_path.h"
#include "kvrecall/v1/kvrecall.pb.h"
#include "server/memory_budget.h"

namespace kvrecall {

class BulkCodes;  // server/backends/bulk_codes.h

// What one layer of a session is built for.
struct LayerConfig {
  LayerShape shape;                   // q_heads, kv_heads, head_dim, softmax scale
  v1::DType dtype = v1::DTYPE_F32;    // the model's dtype: device tiers keep KV in it
  SelectorParams selector;
  int64_t expected_tokens = 0;        // CreateSession's max_tokens; 0: not announced
  // The most tokens the layer may ever hold: the server's --max_context_tokens, else the most a
  // layer can (kMaxLayerTokens). Work that pays off only past it (a learning whose codes would
  // take over beyond it) is not started.
  int64_t max_layer_tokens = std::numeric_limits<int32_t>::max();
  // The layer's index in its session's model (0 where a layer is built alone). Work that every
  // layer of a model would otherwise do at the same token is spread over tokens by it: a
  // learning's take-over (CodesLearning::TakeOverAt).
  int32_t layer = 0;

  // The most tokens the layer is to hold: the announced max_tokens, else max_layer_tokens (what
  // a store grown ahead of need grows to at most: KvGrowthAhead).
  int64_t tokens_to_hold() const {
    return expected_tokens > 0 ? expected_tokens : max_layer_tokens;
  }
  // Whether tokens_to_hold() is a length someone set (max_tokens, --max_context_tokens) rather
  // than only the most a layer can hold.
  bool tokens_to_hold_set() const {
    return expected_tokens > 0 || max_layer_tokens < std::numeric_limits<int32_t>::max();
  }
};

// Where a session's memory is charged: host bytes and, for placements with a GPU part, the
// bytes of that GPU (null for the CPU placement). Both outlive the session's layers.
struct SessionAccounts {
  MemoryAccount* host = nullptr;
  MemoryAccount* device = nullptr;
};

// Bytes one layer holds, by tier.
struct LayerMemory {
  int64_t host_bytes = 0;      // KV and selector state in host memory
  int64_t device_bytes = 0;    // KV and selector state in GPU memory
  int64_t selector_bytes = 0;  // the part of both held by indexes and caches
};

// How one query head's support was chosen in a step.
struct HeadReport {
  SelectionPath path = SelectionPath::kExact;
  int32_t candidates = 0;   // tokens scored to choose the support
  int32_t support = 0;      // tokens attended to
  float best_cosine = 0.0f; // ReTopK: the best cosine with a cached query
  float bulk_micros = 0.0f; // tiered: the host's time for the head's part over the bulk
  float bulk_start_micros = 0.0f;  // tiered: when that part began, from the start of the bulk
};

// A layer's prompt as a Prefill stream delivers it, row-major: queries [n, q_heads, head_dim]
// (post-RoPE, f32), keys and values [n, kv_heads, head_dim] in the staging's kv_element() (f32,
// or the session's dtype where the placement keeps that). Appends are two-phase: Reserve room,
// write the rows at the tails, then Commit them; rows never committed are not part of it.
class PromptStaging {
 public:
  virtual ~PromptStaging() = default;
  // Room for `more` tokens beyond the committed ones; RESOURCE_EXHAUSTED naming `what` changes
  // nothing.
  virtual absl::Status Reserve(int64_t more, absl::string_view what) = 0;
  // Where the reserved tokens go; valid until Commit or the next Reserve. query_tail() is null
  // where the staging keeps no queries (the selector's build reads none): a chunk's q is then
  // checked and dropped.
  virtual float* query_tail() = 0;
  virtual void* key_tail() = 0;
  virtual void* value_tail() = 0;
  // The element type key_tail() and value_tail() take.
  virtual KvElement kv_element() const = 0;
  // Makes the next n reserved tokens part of the prompt (may start copies to a device).
  // with_queries false: the chunk came without queries and query_tail() holds nothing (the
  // Prefill stream checks that the selector did not need them, PromptQueriesNeeded).
  virtual absl::Status Commit(int64_t n, bool with_queries) = 0;
  virtual int64_t tokens() const = 0;
};

// One layer of one session, built from its prompt. Not thread-safe: the session's lock guards it.
class LayerBackend {
 public:
  virtual ~LayerBackend() = default;
  // Tokens held: the prompt and every committed decode token.
  virtual int64_t tokens() const = 0;
  // Room for one more token on every tier the layer uses; RESOURCE_EXHAUSTED (a budget) leaves
  // the layer as it was (but for a tiered layer's shortlist codes, which change at a length:
  // codes_learning.h). Step consumes the reservation.
  virtual absl::Status ReserveToken() = 0;
  virtual LayerMemory memory() const = 0;
  // The product-quantized codes of the layer's bulk keys where it keeps them (a tiered layer
  // with policy.index.shortlist whose bulk had rows to learn from: at prefill, or once the bulk
  // grew: server/backends/codes_learning.h), for inspection between steps and token
  // reservations; null otherwise.
  virtual const BulkCodes* bulk_codes() const { return nullptr; }
};

// One sequence's part of a batched decode step. Inputs and outputs are host memory.
struct LayerStep {
  LayerBackend* layer = nullptr;  // made by the backend that steps it; ReserveToken succeeded
  const float* q = nullptr;       // [q_heads, head_dim] f32, post-RoPE
  const float* k_new = nullptr;   // [kv_heads, head_dim] f32: appended before attending
  const float* v_new = nullptr;   // [kv_heads, head_dim] f32
  float* o = nullptr;             // out: [q_heads, head_dim] f32
  float* lse = nullptr;           // out: [q_heads] (natural log)
  HeadReport* heads = nullptr;    // out: [q_heads]
  // out, when non-null: [q_heads] the token positions each head attended to (any order).
  std::vector<int32_t>* supports = nullptr;
};

// Full attention over one layer's whole history, for compare_exact (no token is appended).
struct ShadowStep {
  const LayerBackend* layer = nullptr;
  const float* q = nullptr;          // [q_heads, head_dim] f32
  int top_k = 0;                     // K of the exact top-K to report
  float* o = nullptr;                // out: [q_heads, head_dim] full attention
  float* lse = nullptr;              // out: [q_heads]
  std::vector<int32_t>* exact_topk = nullptr;  // out: [q_heads] the exact top-K positions
};

// Per-Decode-stream resources of a backend (a CUDA stream, pinned buffers, workspaces): one
// stream steps one request at a time, so these are reused without locking.
class StepContext {
 public:
  virtual ~StepContext() = default;

  // Where a Step's compute went, for a placement with more than one tier (zeros elsewhere);
  // set by every Step, summed over the steps it ran.
  struct TierSeconds {
    // The static sets' attention on their tier: on a GPU its own time on the device's clock,
    // from the step's start to its results' download (overlapping `bulk`); on the host tier,
    // its compute.
    double static_set = 0;
    double bulk = 0;       // the host's selection and attention over the bulk
    double link_wait = 0;  // waiting for the previous step's deferred OnAppend
    double shortlist = 0;  // the tiered shortlists on their tier (policy.index.shortlist)
    // The host's time queueing the static tier's step (before the bulk's heads start).
    double launch = 0;
    // From the bulk's start until the shortlists were on the host, the exact heads' wait
    // (policy.index.shortlist; 0 without).
    double shortlists_ready = 0;
    // The device's time for the exact heads it took (TierMicros.device_exact; 0: none), and its
    // wait for the host's choice of them (TierMicros.device_exact_wait).
    double device_exact = 0;
    double device_exact_wait = 0;
    // The host's time before the bulk: the steps staged, the tier's step planned and prepared
    // (TierMicros.plan).
    double plan = 0;
    // The host's time choosing the tier's exact heads after the launch (TierMicros.decide), and
    // after the bulk's heads until the step's end (TierMicros.finish).
    double decide = 0;
    double finish = 0;
    // On a GPU tier: the device's whole step on its clock (begin to end stamp), and the host's
    // wait for it at the end of the step (0 when it was done by then).
    double device_step = 0;
    double finish_wait = 0;

    // Adds every field of `other` (a request's steps, summed).
    TierSeconds& operator+=(const TierSeconds& other) {
      static_set += other.static_set;
      bulk += other.bulk;
      link_wait += other.link_wait;
      shortlist += other.shortlist;
      launch += other.launch;
      shortlists_ready += other.shortlists_ready;
      device_exact += other.device_exact;
      device_exact_wait += other.device_exact_wait;
      plan += other.plan;
      decide += other.decide;
      finish += other.finish;
      device_step += other.device_step;
      finish_wait += other.finish_wait;
      return *this;
    }
  };
  TierSeconds tier_seconds;
};

// A placement on one device. Thread-safe: any number of streams call it at once, each with its
// own StepContext and with the locks of the sessions it steps.
class AttentionBackend {
 public:
  virtual ~AttentionBackend() = default;

  virtual v1::Placement placement() const = 0;
  // Where its layers live: "cpu", "cuda:0", ... (GetSession reports it).
  virtual const std::string& device() const = 0;
  // The device's budget (null for the CPU placement): sessions are placed where most is free.
  virtual MemoryBudget* device_budget() const { return nullptr; }

  // INVALID_ARGUMENT naming the policy or geometry field when layers of `config` cannot be
  // served here, with a message that says what is served. Checked at CreateSession, before
  // anything is allocated.
  virtual absl::Status CheckConfig(const LayerConfig& config) const = 0;
  // Device bytes a layer of `config` holds for `tokens` tokens (KV and caches), for admission.
  virtual int64_t DeviceBytesFor(const LayerConfig& config, int64_t tokens) const { return 0; }
  // Host bytes of a layer of `config`'s KV for `tokens` tokens (0 where the KV is not on the
  // host), for admission.
  virtual int64_t HostKvBytesFor(const LayerConfig& config, int64_t tokens) const { return 0; }
  // How many of a prompt's last tokens must come with their queries for a layer of `config`
  // to be built (index/support_selector.h's PromptQueriesNeeded unless the placement's
  // selectors read more).
  virtual int64_t PromptQueriesNeeded(const LayerConfig& config, int64_t tokens) const {
    return kvrecall::PromptQueriesNeeded(config.selector, tokens);
  }
  // The most host bytes a layer of `config` built from a prompt of `tokens` tokens on
  // `build_threads` OpenMP threads holds or uses on the way in selector state (indexes, caches;
  // index/support_selector.h's SelectorStateBytesBound for the selectors the placement makes).
  // The Prefill reserves it before any build, so that a policy whose state cannot fit is
  // refused before it is made. build_threads 0: the state alone, without a build's scratch
  // (what CreateSession's max_tokens sets aside for the state's growth).
  virtual int64_t HostSelectorBytesBound(const LayerConfig& config, int64_t tokens,
                                         int build_threads) const {
    return 0;
  }

  virtual absl::StatusOr<std::unique_ptr<PromptStaging>> NewPromptStaging(
      const LayerConfig& config, const SessionAccounts& accounts) = 0;
  // Builds a layer (indexes, caches) from a staged prompt, which it consumes. May take long;
  // runs outside the session's lock, several layers in parallel. Its builds ask `stop` as they
  // go (index/build_stop.h): once it is requested (the Prefill will not commit), BuildLayer
  // returns CANCELLED soon, having charged nothing it keeps.
  virtual absl::StatusOr<std::unique_ptr<LayerBackend>> BuildLayer(
      const LayerConfig& config, const SessionAccounts& accounts,
      std::unique_ptr<PromptStaging> prompt, const BuildStop& stop) = 0;

  // A Decode stream's context for this backend's steps; what it keeps in host memory (a
  // device's pinned staging) is charged to `host` (the stream's tenant's host budget or the
  // server's; null: nowhere, for tests) while it lives.
  virtual std::unique_ptr<StepContext> NewStepContext(MemoryAccount* host) = 0;
  // One decode step of `steps` (layers this backend built, of sessions the caller has locked,
  // each with a token reserved): appends each step's token, selects, attends and reports.
  // Every input was validated before; what may still fail is the device's: a workspace its
  // budget refuses (RESOURCE_EXHAUSTED), a fault (INTERNAL). Steps that need different launches
  // step in runs, one after another: a run that fails appends no token to its steps, and the
  // runs of this Step before it stay applied (the caller tells which from the layers' tokens).
  virtual absl::Status Step(std::span<LayerStep> steps, StepContext* context) = 0;
  // Whether Step can fail at all. A request's steps on several backends are stepped one
  // backend after another, those whose Step can fail first, so that such a failure leaves the
  // others' sessions as they were (server/decode.cc).
  virtual bool StepCanFail() const { return true; }
  // Full attention and the exact top-K for each of `steps`, over the histories as they are.
  virtual absl::Status Shadow(std::span<ShadowStep> steps, StepContext* context) = 0;
};

}  // namespace kvrecall

#endif  // KVRECALL_SERVER_BACKENDS_ATTENTION_BACKEND_H_
