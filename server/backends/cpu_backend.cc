#include "server/backends/cpu_backend.h"

#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/thread_pool.h"
#include "server/backends/deferred_append.h"
#include "server/backends/selector_charge.h"
#include "server/kv_growth.h"
#include "server/kv_store.h"

namespace kvrecall {
namespace {

class CpuLayer final : public LayerBackend {
 public:
  CpuLayer(const LayerConfig& config, MemoryAccount* host, LayerKvStore kv,
           std::unique_ptr<SupportSelector> selector)
      : shape_(config.shape),
        tokens_to_hold_(config.tokens_to_hold()),
        selector_charge_(host),
        kv_(std::move(kv)),
        selector_(std::move(selector)),
        selections_(config.shape.q_heads),
        supports_(config.shape.q_heads),
        appended_(selector_.get()) {
    selector_charge_.Set(selector_->MemoryBytes());  // built: reserved by the Prefill
    // A prompt that (nearly) filled its store has it grown before the first step needs it.
    growth_ahead_.AfterCommit(kv_, tokens_to_hold_);
  }
  ~CpuLayer() override {
    growth_ahead_.Finish(kv_);  // it maps the KV's pages, and charged the host account
    appended_.Wait();
  }

  int64_t tokens() const override { return kv_.tokens(); }
  // Growing the store may move the rows a deferred OnAppend reads: it finishes first. A growth
  // made ahead of need (KvGrowthAhead) is taken here.
  absl::Status ReserveToken() override {
    appended_.Wait();
    // What the previous step's OnAppend grew the selector by is charged (SelectorCharge).
    if (absl::Status s = selector_charge_.ReserveStep(selector_->MemoryBytes()); !s.ok()) {
      return s;
    }
    growth_ahead_.BeforeReserve(kv_, 1);
    return kv_.Reserve(1, "the new token");
  }
  LayerMemory memory() const override {
    const int64_t selector = selector_charge_.charged();
    return LayerMemory{kv_.allocated_bytes() + selector, 0, selector};
  }

  // Appends the step's token, selects every head's support, attends and reports; the selector
  // absorbs the token after that, off the decode path when that is costly (deferred_append.h).
  // Returns the seconds it waited for the previous step's deferred OnAppend.
  double Step(const LayerStep& step);
  // Full attention and each head's exact top-K over the history.
  void Shadow(const ShadowStep& step) const;

 private:
  const LayerShape shape_;
  const int64_t tokens_to_hold_;
  SelectorCharge selector_charge_;  // the selector's state, charged to the host's account
  LayerKvStore kv_;
  KvGrowthAhead growth_ahead_{KvGrowthQueue()};  // kv_'s, off the steps
  std::unique_ptr<SupportSelector> selector_;
  std::vector<HeadSelection> selections_;       // per query head, reused across steps
  std::vector<std::vector<int32_t>> supports_;  // per query head, reused across steps
  // Tokens the selector scored at the previous step, summed over heads (-1: no step yet);
  // predicts whether the next selection is worth running heads in parallel.
  int64_t last_scored_tokens_ = -1;
  // Last: destroyed first, so that a pending OnAppend finishes while the selector and KV exist.
  DeferredAppend appended_;
};

double CpuLayer::Step(const LayerStep& step) {
  appended_.Wait();
  const double waited = appended_.waited_seconds();
  // (What the previous OnAppend grew the selector by was charged by ReserveToken.)
  const int heads = shape_.q_heads;
  const int d = shape_.head_dim;
  kv_.StageToken(step.k_new, step.v_new);
  kv_.Commit(1);
  growth_ahead_.AfterCommit(kv_, tokens_to_hold_);
  const KvView kv = kv_.view();

  SupportSelector* selector = selector_.get();
  const float* q = step.q;
  const int64_t predicted_tokens =
      last_scored_tokens_ >= 0 ? last_scored_tokens_ : static_cast<int64_t>(heads) * kv.tokens;
  const int threads = cpu::ThreadsFor(predicted_tokens * d, heads);
  auto select = [&](int h) {
    HeadSelection& selection = selections_[h];
    // The support buffers travel between the selection and `supports_` (the attention
    // kernel's input) by swapping, so their capacity is reused from step to step.
    std::swap(selection.support, supports_[h]);
    selection.path = SelectionPath::kExact;
    selection.candidates = 0;
    selection.best_cosine = 0.0f;
    selector->Select(h, q + static_cast<int64_t>(h) * d, kv, &selection);
    std::swap(selection.support, supports_[h]);
  };
  cpu::ParallelFor(heads, threads, [&](int64_t h) { select(static_cast<int>(h)); });
  cpu::MultiHeadAttention(q, heads, kv, supports_, shape_.scale, step.o, step.lse);

  last_scored_tokens_ = 0;
  for (int h = 0; h < heads; ++h) {
    const HeadSelection& selection = selections_[h];
    last_scored_tokens_ += selection.candidates;
    step.heads[h] = HeadReport{selection.path, selection.candidates,
                               static_cast<int32_t>(supports_[h].size()), selection.best_cosine};
    if (step.supports != nullptr) step.supports[h] = supports_[h];
  }
  selector_charge_.Update(selector_->MemoryBytes());
  // After the Selects: inline unless deferring pays (then the selector must not be read until
  // the next Wait; what it grows by is charged then).
  appended_.Queue(kv);
  return waited;
}

void CpuLayer::Shadow(const ShadowStep& step) const { HostShadow(shape_, kv_.view(), step); }

}  // namespace

absl::StatusOr<std::unique_ptr<HostPromptStaging>> HostPromptStaging::Create(
    const LayerConfig& config, MemoryAccount* host, KvElement element, int64_t kept_queries) {
  auto staging = std::make_unique<HostPromptStaging>(config.shape, host, element, kept_queries);
  staging->kv.set_most_tokens(config.tokens_to_hold(),
                              config.tokens_to_hold_set() ? MostRows::kSet : MostRows::kCeiling);
  if (config.expected_tokens > 0) {
    if (absl::Status s = staging->kv.Reserve(config.expected_tokens, "the announced max_tokens");
        !s.ok()) {
      return s;
    }
  }
  return staging;
}

absl::Status HostPromptStaging::Reserve(int64_t more, absl::string_view what) {
  if (absl::Status s = kv.Reserve(more, what); !s.ok()) return s;
  return queries.Reserve(more, what);
}

absl::Status HostPromptStaging::Commit(int64_t n, bool with_queries) {
  kv.Commit(n);
  queries.Commit(n, with_queries);
  return absl::OkStatus();
}

int64_t KeptPromptQueries(const AttentionBackend& backend, const LayerConfig& config) {
  return backend.PromptQueriesNeeded(config, std::numeric_limits<int64_t>::max());
}

void HostShadow(const LayerShape& shape, const KvView& kv, const ShadowStep& step) {
  const int heads = shape.q_heads;
  const int d = shape.head_dim;
  cpu::MultiHeadFullAttention(step.q, heads, kv, shape.scale, step.o, step.lse);
  const int threads = cpu::ThreadsFor(static_cast<int64_t>(heads) * kv.tokens * d, heads);
  cpu::ParallelFor(heads, threads, [&](int64_t h) {
    cpu::ExactTopK(step.q + h * d, kv, KvHeadOf(static_cast<int>(h), heads, shape.kv_heads),
                   shape.scale, step.top_k, &step.exact_topk[h]);
  });
}

absl::Status CpuBackend::CheckConfig(const LayerConfig& config) const {
  // Making a selector surfaces one this build cannot make at CreateSession rather than at the
  // first Prefill; selectors allocate nothing before Build.
  return MakeSelector(config.selector, config.shape).status();
}

int64_t CpuBackend::HostSelectorBytesBound(const LayerConfig& config, int64_t tokens,
                                           int build_threads) const {
  return SelectorStateBytesBound(config.selector, config.shape, tokens, build_threads);
}

absl::StatusOr<std::unique_ptr<PromptStaging>> CpuBackend::NewPromptStaging(
    const LayerConfig& config, const SessionAccounts& accounts) {
  return HostPromptStaging::Create(config, accounts.host, KvElement::kF32,
                                   KeptPromptQueries(*this, config));
}

absl::StatusOr<std::unique_ptr<LayerBackend>> CpuBackend::BuildLayer(
    const LayerConfig& config, const SessionAccounts& accounts,
    std::unique_ptr<PromptStaging> prompt, const BuildStop& stop) {
  auto& staged = static_cast<HostPromptStaging&>(*prompt);
  absl::StatusOr<std::unique_ptr<SupportSelector>> selector =
      MakeSelector(config.selector, config.shape);
  if (!selector.ok()) return selector.status();
  if (absl::Status s =
          (*selector)->BuildUnless(stop, staged.kv.view(), staged.prompt_queries());
      !s.ok()) {
    return s;
  }
  // An announced length is reserved now, so that decoding up to it never reallocates: the KV
  // and the selector's state (charged with the layer, from what max_tokens set aside).
  if (config.expected_tokens > staged.kv.tokens()) {
    if (absl::Status s = staged.kv.Reserve(config.expected_tokens - staged.kv.tokens(),
                                           "the announced max_tokens");
        !s.ok()) {
      return s;
    }
    (*selector)->ReserveTokens(config.expected_tokens);
  }
  return std::make_unique<CpuLayer>(config, accounts.host, std::move(staged.kv),
                                    *std::move(selector));
  // The staged queries are freed with `prompt`: selectors that need them kept what they need.
}

std::unique_ptr<StepContext> CpuBackend::NewStepContext(MemoryAccount*) {
  return std::make_unique<StepContext>();
}

absl::Status CpuBackend::Step(std::span<LayerStep> steps, StepContext* context) {
  double link_wait = 0;
  for (const LayerStep& step : steps) link_wait += static_cast<CpuLayer*>(step.layer)->Step(step);
  // The CPU placement keeps no per-stream state: a caller may pass no context.
  if (context != nullptr) {
    context->tier_seconds = StepContext::TierSeconds();
    context->tier_seconds.link_wait = link_wait;
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::Shadow(std::span<ShadowStep> steps, StepContext*) {
  for (const ShadowStep& step : steps) static_cast<const CpuLayer*>(step.layer)->Shadow(step);
  return absl::OkStatus();
}

}  // namespace kvrecall
