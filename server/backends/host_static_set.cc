// The host tier of the tiered placement (server/backends/tiered_backend.h): static sets read from
// the layer's host KV and attended by kernels/cpu, and the bulk's codes scanned on the CPU, so
// that the placement composes without a device. With HostStaticSetTierOptions::exact_heads it
// is also the CPU stand-in for a device's exact heads (for tests): the heads a step gives the
// tier run ShortlistSelector's exact path, the host's own code, on a thread of the tier's own
// beside the host's heads, so that the tiered logic above the tier runs without a GPU.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/memory/memory.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "index/basic_selectors.h"
#include "index/product_quantizer.h"
#include "index/shortlist_selector.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/thread_pool.h"
#include "server/backends/bulk_codes.h"
#include "server/backends/tiered_backend.h"
#include "server/kv_store.h"
#include "server/work_queue.h"

namespace kvrecall {
namespace {

class HostStaticSet final : public StaticSet {
 public:
  int64_t device_bytes() const override { return 0; }
};

// The bulk's codes in host memory ([kv_heads][capacity, M]), scanned on the CPU: the shortlist's
// arithmetic of the GPU tier (ProductQuantizer's, which kernels/cuda/pq_shortlist.h is held to),
// so that the placement composes without a device.
class HostBulkCodes final : public BulkCodes {
 public:
  static absl::StatusOr<std::unique_ptr<HostBulkCodes>> Create(
      const KvView& bulk, MemoryAccount* host, int64_t capacity,
      const BuildStop& stop) {
    absl::StatusOr<std::vector<ProductQuantizer>> quantizers =
        Train(bulk, /*assigner=*/nullptr, stop);
    if (!quantizers.ok()) return quantizers.status();
    auto codes = absl::WrapUnique(new HostBulkCodes(*std::move(quantizers), host));
    if (absl::Status s = codes->ChargeQuantizers(); !s.ok()) return s;
    if (absl::Status s = codes->Reserve(std::max(capacity, bulk.tokens)); !s.ok()) return s;
    if (absl::Status s = codes->CodeRowsUnless(stop, bulk); !s.ok()) return s;
    codes->learned_rows_ = bulk.tokens;
    return codes;
  }
  int64_t device_bytes() const override { return 0; }
  absl::Status Reserve(int64_t rows) override {
    if (rows <= capacity_) return absl::OkStatus();
    const int64_t grown = std::max(rows, 2 * capacity_);
    const int64_t bytes = (grown - capacity_) * kv_heads() * subspaces_;
    if (absl::Status s = ChargeHost(bytes, "the shortlist's codes"); !s.ok()) return s;
    for (std::vector<uint8_t>& head : codes_) head.resize(grown * subspaces_);
    capacity_ = grown;
    return absl::OkStatus();
  }
  // On the calling thread; fails only when stopped (host memory, room made by Reserve).
  absl::Status CodeRowsUnless(const BuildStop& stop, const KvView& bulk) override {
    if (bulk.tokens <= coded_) return absl::OkStatus();
    const int64_t n = bulk.tokens - coded_;
    scratch_.resize(n * kv_heads() * subspaces_);
    if (absl::Status s = EncodeRows(bulk, coded_, bulk.tokens, scratch_.data(), stop);
        !s.ok()) {
      return s;
    }
    for (int h = 0; h < kv_heads(); ++h) {
      std::copy_n(scratch_.data() + h * n * subspaces_, n * subspaces_,
                  codes_[h].data() + coded_ * subspaces_);
    }
    coded_ = bulk.tokens;
    return absl::OkStatus();
  }
  // The best `n` of the first `rows` coded rows for query head q_head's query q.
  void Shortlist(const LayerShape& shape, int q_head, const float* q, int64_t rows, int n,
                 int32_t* ids, int32_t* size) const {
    const int kv_head = KvHeadOf(q_head, shape.q_heads, shape.kv_heads);
    thread_local std::vector<float> table, scores;
    thread_local std::vector<int32_t> positions;
    table.resize(static_cast<size_t>(subspaces_) * ProductQuantizer::kCentroids);
    scores.resize(rows);
    quantizers_[kv_head].QueryTable(q, table.data());
    ProductQuantizer::ScanCodes(table.data(), codes_[kv_head].data(), rows, subspaces_,
                                scores.data());
    cpu::TopKPositions(scores, n, &positions);
    std::copy(positions.begin(), positions.end(), ids);
    *size = static_cast<int32_t>(positions.size());
  }

 private:
  HostBulkCodes(std::vector<ProductQuantizer> quantizers, MemoryAccount* host)
      : BulkCodes(std::move(quantizers), host), codes_(kv_heads()) {}
  absl::Status CopyCodes(int kv_head, int64_t begin, int64_t end,
                         uint8_t* codes) const override {
    std::copy(codes_[kv_head].begin() + begin * subspaces_,
              codes_[kv_head].begin() + end * subspaces_, codes);
    return absl::OkStatus();
  }

  std::vector<std::vector<uint8_t>> codes_;
  std::vector<uint8_t> scratch_;
  int64_t capacity_ = 0;
};

// Host memory is the host tier's own: its exact heads read a layer's host KV where it lies, so
// a pin (which TieredBackend asks for before it gives a tier exact heads) has nothing to do.
class NoPinning final : public HostPinning {
 public:
  absl::Status Pin(void*, size_t) override { return absl::OkStatus(); }
  void Unpin(void*) override {}
};

// Query head h's shortlist in `step` (which has codes): the best step.shortlist of the bulk's
// rows, every one coded (Start codes the step's new rows first), into ids [step.shortlist] and
// *size. The host's heads (WaitShortlists) and the exact heads (the worker) take theirs here.
void ShortlistHead(const StaticSetStep& step, int h, int32_t* ids, int32_t* size) {
  const LayerShape& shape = step.config->shape;
  static_cast<const HostBulkCodes*>(step.codes)
      ->Shortlist(shape, h, step.q + int64_t{h} * shape.head_dim, step.bulk.tokens,
                  step.shortlist, ids, size);
}

// A Decode stream's state on the host tier. With exact heads (HostStaticSetTierOptions), the
// step's exact heads, which the tier's worker runs (Run) as a device would: queued by
// SetExactHeads, beside the host's heads, and joined by Finish, or, after a host that failed
// before its Finish, by the next Prepare or the context's end (they write the steps' outputs).
class HostStepContext final : public StepContext, private WorkItem {
 public:
  using Clock = std::chrono::steady_clock;
  // One exact head: query head `head` of steps[step].
  struct ExactHead {
    int32_t step, head;
  };

  ~HostStepContext() override { Join(); }

  // Queues the step's exact heads (`exact`, non-empty) on `worker`; runs them here when none of
  // its threads started (nothing would run them, and Join would wait for good).
  void Queue(WorkQueue* worker) {
    if (worker->threads() == 0) {
      Run();
      return;
    }
    {
      absl::MutexLock lock(&mu_);
      running_ = true;
    }
    worker->Push(this);
  }
  // Returns once the worker is done with the step's exact heads, and the seconds it waited for
  // them (0 when they were done, or none were queued).
  double Join() {
    absl::MutexLock lock(&mu_);
    if (!running_) return 0;
    const Clock::time_point start = Clock::now();
    mu_.Await(absl::Condition(+[](bool* running) { return !*running; }, &running_));
    return std::chrono::duration<double>(Clock::now() - start).count();
  }
  // Whether (sequence, head) item `item` (steps[item / q_heads], head item % q_heads) is an
  // exact head of the step.
  bool OnWorker(int64_t item) const {
    return !on_worker.empty() && on_worker[static_cast<size_t>(item)] != 0;
  }

  // The step's (SetExactHeads' copy, valid until Finish returns), its exact heads, which
  // (sequence, head) items they are ([steps * q_heads], or empty: none), and each step's coded
  // rows its shortlists were chosen among (*shortlist_coded, as the host's heads read it).
  std::vector<StaticSetStep> steps;
  std::vector<ExactHead> exact;
  std::vector<uint8_t> on_worker;
  std::vector<int64_t> coded;
  // When Start returned, and the worker's times of the step's exact heads (in seconds, written
  // before it marks them done): from then to its start, its run, and from then to its end.
  Clock::time_point started;
  double worker_wait = 0, worker_run = 0, worker_step = 0;

 private:
  // The worker's part: each exact head's shortlist, then ShortlistSelector::Select over its
  // candidates (the exact path the host's heads take) and the attention over the support.
  void Run() override;
  // The exact path of `config`'s layers (one shape and top_k a run: SameStaticSet).
  ShortlistSelector& SelectorFor(const LayerConfig& config);

  absl::Mutex mu_;
  bool running_ ABSL_GUARDED_BY(mu_) = false;
  // The worker's own: the exact path, the shape and top_k it was made for, a head's shortlist
  // and its selection.
  std::unique_ptr<ShortlistSelector> selector_;
  LayerShape selector_shape_;
  int selector_top_k_ = 0;
  std::vector<int32_t> ids_;
  HeadSelection selection_;
};

ShortlistSelector& HostStepContext::SelectorFor(const LayerConfig& config) {
  const LayerShape& shape = config.shape;
  const LayerShape& made = selector_shape_;
  if (selector_ == nullptr || shape.q_heads != made.q_heads || shape.kv_heads != made.kv_heads ||
      shape.head_dim != made.head_dim || shape.scale != made.scale ||
      config.selector.top_k != selector_top_k_) {
    selector_ = std::make_unique<ShortlistSelector>(shape, config.selector.top_k);
    selector_shape_ = shape;
    selector_top_k_ = config.selector.top_k;
  }
  return *selector_;
}

void HostStepContext::Run() {
  const Clock::time_point begin = Clock::now();
  int32_t outliers_of = -1;  // the step whose outliers the selector has
  for (const ExactHead& e : exact) {
    const StaticSetStep& step = steps[e.step];
    const LayerShape& shape = step.config->shape;
    ShortlistSelector& selector = SelectorFor(*step.config);
    if (e.step != outliers_of) {
      for (int g = 0; g < shape.kv_heads; ++g) selector.SetOutliers(g, step.codes->outliers(g));
      outliers_of = e.step;
    }
    ids_.resize(step.shortlist);
    int32_t size = 0;
    ShortlistHead(step, e.head, ids_.data(), &size);
    selector.SetShortlist(e.head, std::span<const int32_t>(ids_.data(), size), coded[e.step]);
    const int d = shape.head_dim;
    selector.Select(e.head, step.q + int64_t{e.head} * d, step.bulk, &selection_);
    // Positions in the bulk, as the GPU tier's: the state over the bulk view's rows is the
    // host's over the same rows of the whole history.
    cpu::PartialAttentionScored(selection_.support_scores, step.bulk,
                                KvHeadOf(e.head, shape.q_heads, shape.kv_heads),
                                selection_.support, step.bulk_o + int64_t{e.head} * d,
                                &step.bulk_lse[e.head]);
    step.bulk_candidates[e.head] = selection_.candidates;
    if (step.bulk_support != nullptr) {
      step.bulk_support_sizes[e.head] = static_cast<int32_t>(selection_.support.size());
      std::copy(selection_.support.begin(), selection_.support.end(),
                step.bulk_support + int64_t{e.head} * step.config->selector.top_k);
    }
  }
  const Clock::time_point end = Clock::now();
  worker_wait = std::chrono::duration<double>(begin - started).count();
  worker_run = std::chrono::duration<double>(end - begin).count();
  worker_step = std::chrono::duration<double>(end - started).count();
  absl::MutexLock lock(&mu_);
  running_ = false;
}

class HostStaticSetTier final : public StaticSetTier {
 public:
  explicit HostStaticSetTier(const HostStaticSetTierOptions& options)
      : worker_(options.exact_heads ? std::make_unique<WorkQueue>(1, "kvrecall-exact") : nullptr),
        prepare_check_(options.prepare_check),
        finish_check_(options.finish_check) {}

  const std::string& device() const override { return device_; }
  MemoryBudget* device_budget() const override { return nullptr; }
  absl::Status CheckConfig(const LayerConfig&) const override { return absl::OkStatus(); }
  int64_t DeviceBytesFor(const LayerConfig&) const override { return 0; }
  absl::StatusOr<std::unique_ptr<StaticSet>> Build(const LayerConfig&, MemoryAccount*,
                                                   const KvView&) override {
    return std::make_unique<HostStaticSet>();
  }
  absl::StatusOr<std::unique_ptr<BulkCodes>> BuildCodes(
      const LayerConfig&, const SessionAccounts& accounts, const KvView& bulk, int64_t capacity,
      const BuildStop& stop) override {
    absl::StatusOr<std::unique_ptr<HostBulkCodes>> codes =
        HostBulkCodes::Create(bulk, accounts.host, capacity, stop);
    if (!codes.ok()) return codes.status();
    return std::unique_ptr<BulkCodes>(*std::move(codes));
  }
  std::unique_ptr<StepContext> NewStepContext(MemoryAccount*) override {
    return std::make_unique<HostStepContext>();
  }
  // Ends the exact heads of a step that failed before its Finish; then the test's check.
  absl::Status Prepare(std::span<const StaticSetStep>, StepContext* context) override {
    static_cast<HostStepContext*>(context)->Join();
    return prepare_check_ ? prepare_check_() : absl::OkStatus();
  }
  // The static set is read from the host KV, which has the new token already; the bulk's new
  // rows are coded here.
  absl::Status Start(std::span<const StaticSetStep> steps, StepContext* context) override {
    auto& ctx = static_cast<HostStepContext&>(*context);
    ctx.exact.clear();
    ctx.on_worker.clear();
    for (const StaticSetStep& step : steps) {
      if (step.codes == nullptr) continue;
      step.codes->CodeRows(step.bulk).IgnoreError();  // cannot fail on the host unstopped
      *step.shortlist_coded = step.bulk.tokens;  // every bulk row is coded: none left to the tail
    }
    ctx.started = HostStepContext::Clock::now();
    return absl::OkStatus();
  }
  // With exact heads, the steps' are queued on the worker; INTERNAL (nothing queued) for heads
  // out of range or over a step's bound, and for any without them.
  absl::Status SetExactHeads(std::span<const StaticSetStep> steps, StepContext* context) override;
  // Every (sequence, head)'s shortlist on the compute pool, but the exact heads': the worker
  // takes those itself (as a device scans the codes it holds), and no host head reads them.
  absl::Status WaitShortlists(std::span<const StaticSetStep> steps, StepContext*) override;
  // The static sets, beside the worker's exact heads, then the wait for those.
  absl::Status Finish(std::span<const StaticSetStep> steps, StepContext*) override;
  HostPinning* host_pinning() override { return worker_ != nullptr ? &no_pinning_ : nullptr; }
  // The CPU's exact path has no bounds of its own: any count of an index or retopk layer's
  // heads, when the layer has its codes.
  bool ServesExactHeads(const LayerConfig& config, const BulkCodes& codes,
                        int heads) const override {
    const SelectorParams& p = config.selector;
    return worker_ != nullptr && heads >= 1 && heads <= config.shape.q_heads &&
           (p.kind == SelectorKind::kIndex || p.kind == SelectorKind::kReTopK) &&
           p.shortlist > 0 && p.top_k > 0 && codes.kv_heads() == config.shape.kv_heads;
  }

 private:
  const std::string device_ = "cpu";
  // With exact heads: the thread that runs them (one for the tier: the streams' steps take
  // turns on it, as on one device), and the pin that needs none.
  std::unique_ptr<WorkQueue> worker_;
  NoPinning no_pinning_;
  const std::function<absl::Status()> prepare_check_;  // HostStaticSetTierOptions'
  const std::function<absl::Status()> finish_check_;   // HostStaticSetTierOptions'
};

absl::Status HostStaticSetTier::SetExactHeads(std::span<const StaticSetStep> steps,
                                              StepContext* context) {
  auto& ctx = static_cast<HostStepContext&>(*context);
  if (steps.empty()) return absl::OkStatus();
  const int q_heads = steps.front().config->shape.q_heads;
  // Every step checked before any head runs, as the GPU tier checks them.
  if (absl::Status s = CheckExactHeads(steps); !s.ok()) return s;
  for (const StaticSetStep& step : steps) {
    if (step.device_exact_heads > 0 && worker_ == nullptr) {
      return absl::InternalError(absl::StrCat(
          "a step gives the host tier ", step.device_exact_heads,
          " exact heads; it serves none (HostStaticSetTierOptions::exact_heads)"));
    }
  }
  ctx.exact.clear();
  ctx.coded.clear();
  for (size_t b = 0; b < steps.size(); ++b) {
    const StaticSetStep& step = steps[b];
    ctx.coded.push_back(step.codes != nullptr ? *step.shortlist_coded : 0);
    for (int j = 0; j < step.device_exact_heads; ++j) {
      ctx.exact.push_back({static_cast<int32_t>(b), step.device_heads[j]});
    }
  }
  if (ctx.exact.empty()) return absl::OkStatus();
  ctx.steps.assign(steps.begin(), steps.end());
  ctx.on_worker.assign(steps.size() * q_heads, 0);
  for (const HostStepContext::ExactHead& e : ctx.exact) {
    ctx.on_worker[static_cast<size_t>(e.step) * q_heads + e.head] = 1;
  }
  ctx.Queue(worker_.get());
  return absl::OkStatus();
}

absl::Status HostStaticSetTier::WaitShortlists(std::span<const StaticSetStep> steps,
                                               StepContext* context) {
  const auto& ctx = static_cast<const HostStepContext&>(*context);
  const absl::Time start = absl::Now();
  const LayerShape& shape = steps.front().config->shape;
  const int heads = shape.q_heads;
  const int64_t items = static_cast<int64_t>(steps.size()) * heads;
  int64_t work = 0;
  for (const StaticSetStep& step : steps) work += step.bulk.tokens * heads;
  cpu::ParallelFor(items, cpu::ThreadsFor(work, items), [&](int64_t item) {
    const StaticSetStep& step = steps[static_cast<size_t>(item / heads)];
    if (step.codes == nullptr || ctx.OnWorker(item)) return;
    const int h = static_cast<int>(item % heads);
    ShortlistHead(step, h, step.shortlist_ids + int64_t{h} * step.shortlist,
                  step.shortlist_sizes + h);
  });
  context->tier_seconds.shortlist = absl::ToDoubleSeconds(absl::Now() - start);
  return absl::OkStatus();
}

absl::Status HostStaticSetTier::Finish(std::span<const StaticSetStep> steps,
                                       StepContext* context) {
  auto& ctx = static_cast<HostStepContext&>(*context);
  const absl::Time start = absl::Now();
  thread_local std::vector<int32_t> ids;
  for (const StaticSetStep& step : steps) {
    const LayerShape& shape = step.config->shape;
    const KvView& kv = step.host_kv;
    ids.clear();
    AppendStaticSet(kv.tokens, step.config->selector.sinks, step.config->selector.recent, &ids);
    // Every head attends the same static set: a group's heads read each row once.
    const int group = shape.q_heads / shape.kv_heads;
    for (int kv_head = 0; kv_head < shape.kv_heads; ++kv_head) {
      const int64_t at = static_cast<int64_t>(kv_head) * group * shape.head_dim;
      cpu::GroupedPartialAttention(step.q + at, group, kv, kv_head, ids, shape.scale,
                                   step.o + at, &step.lse[kv_head * group]);
    }
  }
  StepContext::TierSeconds& seconds = context->tier_seconds;
  seconds.static_set = absl::ToDoubleSeconds(absl::Now() - start);
  // The exact heads' times as a device's: their run, their wait for the host's choice after the
  // launch (and for the worker's wake-up), the "device's" step from the launch to their end,
  // and the host's wait for them here (DeviceHeadBalance weighs these).
  seconds.finish_wait = ctx.Join();
  const bool ran = !ctx.exact.empty();
  seconds.device_exact = ran ? ctx.worker_run : 0.0;
  seconds.device_exact_wait = ran ? ctx.worker_wait : 0.0;
  seconds.device_step = ran ? ctx.worker_step : 0.0;
  ctx.exact.clear();
  ctx.on_worker.clear();
  return finish_check_ ? finish_check_() : absl::OkStatus();
}

}  // namespace

std::unique_ptr<StaticSetTier> MakeHostStaticSetTier(const HostStaticSetTierOptions& options) {
  return std::make_unique<HostStaticSetTier>(options);
}

}  // namespace kvrecall
