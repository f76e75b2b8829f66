// The host tier of the tiered placement (server/backends/tiered_backend.h): static sets read from
// the layer's host KV and attended by kernels/cpu, and the bulk's codes scanned on the CPU, so
// that the placement composes without a device.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/memory/memory.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "index/basic_selectors.h"
#include "index/product_quantizer.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/thread_pool.h"
#include "server/backends/bulk_codes.h"
#include "server/backends/tiered_backend.h"

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
  static absl::StatusOr<std::unique_ptr<HostBulkCodes>> Create(const KvView& bulk,
                                                               MemoryAccount* host,
                                                               int64_t capacity) {
    absl::StatusOr<std::vector<ProductQuantizer>> quantizers = Train(bulk);
    if (!quantizers.ok()) return quantizers.status();
    auto codes = absl::WrapUnique(new HostBulkCodes(*std::move(quantizers), host));
    if (absl::Status s = codes->ChargeQuantizers(); !s.ok()) return s;
    if (absl::Status s = codes->Reserve(std::max(capacity, bulk.tokens)); !s.ok()) return s;
    codes->Append(bulk);
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
  // Codes the bulk's rows [coded(), bulk.tokens) (Reserve made room for them).
  void Append(const KvView& bulk) {
    if (bulk.tokens <= coded_) return;
    const int64_t n = bulk.tokens - coded_;
    scratch_.resize(n * kv_heads() * subspaces_);
    EncodeRows(bulk, coded_, bulk.tokens, scratch_.data());
    for (int h = 0; h < kv_heads(); ++h) {
      std::copy_n(scratch_.data() + h * n * subspaces_, n * subspaces_,
                  codes_[h].data() + coded_ * subspaces_);
    }
    coded_ = bulk.tokens;
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

class HostStaticSetTier final : public StaticSetTier {
 public:
  const std::string& device() const override { return device_; }
  MemoryBudget* device_budget() const override { return nullptr; }
  absl::Status CheckConfig(const LayerConfig&) const override { return absl::OkStatus(); }
  int64_t DeviceBytesFor(const LayerConfig&) const override { return 0; }
  absl::StatusOr<std::unique_ptr<StaticSet>> Build(const LayerConfig&, MemoryAccount*,
                                                   const KvView&) override {
    return std::make_unique<HostStaticSet>();
  }
  absl::StatusOr<std::unique_ptr<BulkCodes>> BuildCodes(const LayerConfig&,
                                                         const SessionAccounts& accounts,
                                                         const KvView& bulk,
                                                         int64_t capacity) override {
    absl::StatusOr<std::unique_ptr<HostBulkCodes>> codes =
        HostBulkCodes::Create(bulk, accounts.host, capacity);
    if (!codes.ok()) return codes.status();
    return std::unique_ptr<BulkCodes>(*std::move(codes));
  }
  std::unique_ptr<StepContext> NewStepContext() override {
    return std::make_unique<StepContext>();
  }
  absl::Status Prepare(std::span<const StaticSetStep>, StepContext*) override {
    return absl::OkStatus();
  }
  // The static set is read from the host KV, which has the new token already; the bulk's new
  // rows are coded here.
  absl::Status Start(std::span<const StaticSetStep> steps, StepContext*) override {
    for (const StaticSetStep& step : steps) {
      if (step.codes == nullptr) continue;
      static_cast<HostBulkCodes*>(step.codes)->Append(step.bulk);
      *step.shortlist_coded = step.bulk.tokens;  // every bulk row is coded: none left to the tail
    }
    return absl::OkStatus();
  }
  // Every (sequence, head)'s shortlist on the compute pool.
  absl::Status WaitShortlists(std::span<const StaticSetStep> steps, StepContext*) override;
  absl::Status Finish(std::span<const StaticSetStep> steps, StepContext*) override;

 private:
  const std::string device_ = "cpu";
};

absl::Status HostStaticSetTier::WaitShortlists(std::span<const StaticSetStep> steps,
                                               StepContext* context) {
  const absl::Time start = absl::Now();
  const LayerShape& shape = steps.front().config->shape;
  const int heads = shape.q_heads;
  const int64_t items = static_cast<int64_t>(steps.size()) * heads;
  int64_t work = 0;
  for (const StaticSetStep& step : steps) work += step.bulk.tokens * heads;
  cpu::ParallelFor(items, cpu::ThreadsFor(work, items), [&](int64_t item) {
    const StaticSetStep& step = steps[static_cast<size_t>(item / heads)];
    if (step.codes == nullptr) return;
    const int h = static_cast<int>(item % heads);
    static_cast<const HostBulkCodes*>(step.codes)
        ->Shortlist(shape, h, step.q + int64_t{h} * shape.head_dim, step.bulk.tokens,
                    step.shortlist, step.shortlist_ids + int64_t{h} * step.shortlist,
                    step.shortlist_sizes + h);
  });
  context->tier_seconds.shortlist = absl::ToDoubleSeconds(absl::Now() - start);
  return absl::OkStatus();
}

absl::Status HostStaticSetTier::Finish(std::span<const StaticSetStep> steps,
                                       StepContext* context) {
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
  context->tier_seconds.static_set = absl::ToDoubleSeconds(absl::Now() - start);
  return absl::OkStatus();
}

}  // namespace

std::unique_ptr<StaticSetTier> MakeHostStaticSetTier() {
  return std::make_unique<HostStaticSetTier>();
}

}  // namespace kvrecall
