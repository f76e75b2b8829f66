// The tiered placement's static sets on a CUDA device: per layer, `sinks + recent` slots of keys
// and values in the session's dtype — the first `sinks` tokens, then a ring of the last
// `recent` — which the kernels of kernels/cuda/partial_attention.h read as a DeviceSeq (head +
// ring). A step of a batch is one packed upload (queries, new rows, descriptors), the append
// kernel, split-K attention over every static set and one packed download, all queued on the
// Decode stream's CUDA stream in Start; Finish waits for it.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/memory/memory.h"
#include "absl/strings/str_cat.h"
#include "index/basic_selectors.h"
#include "index/gpu_batch_topk.h"
#include "kernels/cpu/attention.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/kv_write.h"
#include "kernels/cuda/partial_attention.h"
#include "kernels/cuda/pq_shortlist.h"
#include "server/backends/gpu_support.h"
#include "server/backends/tiered_backend.h"

namespace kvrecall {
namespace {

using cuda::CudaStatus;
using cuda::DeviceSeq;
using gpu::Carver;
using gpu::ChargedBuffer;
using gpu::DeviceScope;
using gpu::GpuStepContext;
using gpu::KvDtypeOf;
using gpu::PinnedBuffer;
using gpu::RowElems;
using gpu::ShapeOf;

int Slots(const LayerConfig& config) { return config.selector.sinks + config.selector.recent; }

// The slot of token position p.
int64_t SlotOf(const LayerConfig& config, int64_t p) {
  const int sinks = config.selector.sinks;
  return p < sinks ? p : sinks + (p - sinks) % config.selector.recent;
}

class GpuStaticSet final : public StaticSet {
 public:
  GpuStaticSet(ChargedBuffer<uint16_t> keys, ChargedBuffer<uint16_t> values)
      : keys_(std::move(keys)), values_(std::move(values)) {}
  int64_t device_bytes() const override {
    return static_cast<int64_t>(keys_.bytes() + values_.bytes());
  }
  uint16_t* key_slot(const LayerConfig& config, int64_t slot) const {
    return keys_.data() + slot * RowElems(config);
  }
  uint16_t* value_slot(const LayerConfig& config, int64_t slot) const {
    return values_.data() + slot * RowElems(config);
  }
  // The kernels' view of a static set holding the first `tokens` positions' static tokens.
  DeviceSeq Seq(const LayerConfig& config, int64_t tokens) const {
    const int sinks = config.selector.sinks;
    const int recent = config.selector.recent;
    const int64_t past_sinks = std::max<int64_t>(0, tokens - sinks);
    const int32_t ring_count = static_cast<int32_t>(std::min<int64_t>(past_sinks, recent));
    // The oldest live ring entry is position tokens - ring_count.
    const int32_t ring_start =
        ring_count < recent ? 0 : static_cast<int32_t>(past_sinks % recent);
    return DeviceSeq{keys_.data(),
                     values_.data(),
                     static_cast<int32_t>(std::min<int64_t>(tokens, sinks)),
                     sinks,
                     recent,
                     ring_start,
                     ring_count};
  }

 private:
  ChargedBuffer<uint16_t> keys_;
  ChargedBuffer<uint16_t> values_;
};

// The bulk's codes in device memory ([kv_heads, capacity, M] u8, and the codebooks [kv_heads, M,
// 256, head_dim / M] f32), scanned by kernels/cuda/pq_shortlist.h. Keys joining the bulk are
// coded on the host (one per KV head a step) and copied up on the step's stream.
class GpuBulkCodes final : public BulkCodes {
 public:
  static absl::StatusOr<std::unique_ptr<GpuBulkCodes>> Create(const KvView& bulk,
                                                              const SessionAccounts& accounts,
                                                              int64_t capacity) {
    absl::StatusOr<std::vector<ProductQuantizer>> quantizers = Train(bulk);
    if (!quantizers.ok()) return quantizers.status();
    auto codes = absl::WrapUnique(new GpuBulkCodes(*std::move(quantizers), accounts));
    if (absl::Status s = codes->ChargeQuantizers(); !s.ok()) return s;
    std::vector<float> books;
    for (int h = 0; h < codes->kv_heads(); ++h) {
      const std::vector<float>& b = codes->quantizer(h).codebooks();
      books.insert(books.end(), b.begin(), b.end());
    }
    if (absl::Status s = codes->codebooks_.Allocate(books.size(), accounts.device,
                                                    "the shortlist's codebooks");
        !s.ok()) {
      return s;
    }
    KVRECALL_CUDA_RETURN_IF_ERROR(CudaStatus(
        cudaMemcpy(codes->codebooks_.data(), books.data(), books.size() * sizeof(float),
                   cudaMemcpyHostToDevice),
        "uploading the shortlist's codebooks"));
    if (absl::Status s = codes->Reserve(std::max(capacity, bulk.tokens)); !s.ok()) return s;
    if (absl::Status s = codes->Append(bulk, /*stream=*/0); !s.ok()) return s;
    KVRECALL_CUDA_RETURN_IF_ERROR(
        CudaStatus(cudaStreamSynchronize(0), "uploading the shortlist's codes"));
    return codes;
  }
  int64_t device_bytes() const override {
    return static_cast<int64_t>(codebooks_.bytes() + codes_.bytes());
  }
  // Grows the codes (doubling) into a new allocation, the coded rows copied over.
  absl::Status Reserve(int64_t rows) override {
    if (rows <= capacity_) return absl::OkStatus();
    const int64_t grown_capacity = std::max(rows, 2 * capacity_);
    ChargedBuffer<uint8_t> grown;
    if (absl::Status s = grown.Allocate(kv_heads() * grown_capacity * subspaces_, device_,
                                        "the shortlist's codes");
        !s.ok()) {
      return s;
    }
    if (coded_ > 0) {
      KVRECALL_CUDA_RETURN_IF_ERROR(CudaStatus(
          cudaMemcpy2D(grown.data(), grown_capacity * subspaces_, codes_.data(),
                       capacity_ * subspaces_, coded_ * subspaces_, kv_heads(),
                       cudaMemcpyDeviceToDevice),
          "moving the shortlist's codes"));
    }
    codes_ = std::move(grown);
    capacity_ = grown_capacity;
    return absl::OkStatus();
  }
  // Codes the bulk's rows [coded(), bulk.tokens) and queues their copy on `stream` (Reserve
  // made room). Call while the stream is idle: the copy is from pageable memory.
  absl::Status Append(const KvView& bulk, cudaStream_t stream) {
    if (bulk.tokens <= coded_) return absl::OkStatus();
    const int64_t n = bulk.tokens - coded_;
    scratch_.resize(n * kv_heads() * subspaces_);
    EncodeRows(bulk, coded_, bulk.tokens, scratch_.data());
    KVRECALL_CUDA_RETURN_IF_ERROR(CudaStatus(
        cudaMemcpy2DAsync(codes_.data() + coded_ * subspaces_, capacity_ * subspaces_,
                          scratch_.data(), n * subspaces_, n * subspaces_, kv_heads(),
                          cudaMemcpyHostToDevice, stream),
        "uploading new codes of the bulk"));
    coded_ = bulk.tokens;
    return absl::OkStatus();
  }
  cuda::PqCodeSets sets(int head_dim) const {
    return cuda::PqCodeSets{codebooks_.data(), codes_.data(), capacity_, subspaces_, head_dim};
  }

 private:
  GpuBulkCodes(std::vector<ProductQuantizer> quantizers, const SessionAccounts& accounts)
      : BulkCodes(std::move(quantizers), accounts.host), device_(accounts.device) {}

  MemoryAccount* const device_;
  ChargedBuffer<float> codebooks_;
  ChargedBuffer<uint8_t> codes_;
  int64_t capacity_ = 0;
  std::vector<uint8_t> scratch_;
};

class GpuStaticSetTier final : public StaticSetTier {
 public:
  GpuStaticSetTier(int ordinal, MemoryBudget* budget, BatchTopKFunction batch_topk)
      : ordinal_(ordinal),
        device_(absl::StrCat("cuda:", ordinal)),
        budget_(budget),
        batch_topk_(std::move(batch_topk)) {}

  const std::string& device() const override { return device_; }
  MemoryBudget* device_budget() const override { return budget_; }
  absl::Status CheckConfig(const LayerConfig& config) const override;
  int64_t DeviceBytesFor(const LayerConfig& config) const override {
    return 2 * int64_t{Slots(config)} * RowElems(config) * 2;
  }
  absl::StatusOr<std::unique_ptr<StaticSet>> Build(const LayerConfig& config,
                                                   MemoryAccount* device,
                                                   const KvView& prompt) override;
  absl::StatusOr<std::unique_ptr<BulkCodes>> BuildCodes(const LayerConfig& config,
                                                         const SessionAccounts& accounts,
                                                         const KvView& bulk,
                                                         int64_t capacity) override {
    DeviceScope scope(ordinal_);
    if (!scope.status().ok()) return scope.status();
    absl::StatusOr<std::unique_ptr<GpuBulkCodes>> codes =
        GpuBulkCodes::Create(bulk, accounts, capacity);
    if (!codes.ok()) return codes.status();
    return std::unique_ptr<BulkCodes>(*std::move(codes));
  }
  std::unique_ptr<StepContext> NewStepContext() override {
    return std::make_unique<StaticStepContext>(ordinal_, budget_);
  }
  absl::Status Start(std::span<const StaticSetStep> steps, StepContext* context) override;
  absl::Status WaitShortlists(std::span<const StaticSetStep> steps,
                              StepContext* context) override;
  absl::Status Finish(std::span<const StaticSetStep> steps, StepContext* context) override;
  BatchTopKFunction batch_topk() const override { return batch_topk_; }

 private:
  // The Decode stream's CUDA resources, and where Start left the step's outputs.
  struct StaticStepContext final : StepContext {
    StaticStepContext(int ordinal, MemoryBudget* budget) : ordinal(ordinal), gpu(ordinal, budget) {}
    ~StaticStepContext() override {
      DeviceScope scope(ordinal);
      for (cudaEvent_t event : {begin, end, shortlist_begin, shortlisted}) {
        if (event != nullptr) cudaEventDestroy(event);
      }
    }
    const int ordinal;
    GpuStepContext gpu;
    size_t out_o = 0, out_lse = 0;
    cuda::AttentionWorkspace* ws = nullptr;
    // Around a step's upload, kernels and download: the tier's own time (tier_seconds).
    cudaEvent_t begin = nullptr, end = nullptr;
    // The shortlists: tables and ids on the device ([batch, q_heads, ...]), the ids' download,
    // and the event after it that WaitShortlists waits for.
    ChargedBuffer<float> tables;
    ChargedBuffer<int32_t> ids;
    PinnedBuffer ids_down;
    cuda::TopKWorkspace* topk_ws = nullptr;
    cudaEvent_t shortlist_begin = nullptr, shortlisted = nullptr;
  };

  // Each step's shortlist over its codes (queries and sets already on the device), its ids
  // downloaded, `shortlisted` recorded after them.
  absl::Status LaunchShortlists(std::span<const StaticSetStep> steps, StaticStepContext& state,
                                const float* dev_q, const int32_t* dev_sets, int shortlist,
                                int64_t longest_bulk);

  const int ordinal_;
  const std::string device_;
  MemoryBudget* const budget_;
  const BatchTopKFunction batch_topk_;
};

absl::Status GpuStaticSetTier::LaunchShortlists(std::span<const StaticSetStep> steps,
                                                StaticStepContext& state, const float* dev_q,
                                                const int32_t* dev_sets, int shortlist,
                                                int64_t longest_bulk) {
  GpuStepContext& ctx = state.gpu;
  const LayerConfig& config = *steps.front().config;
  const int q_heads = config.shape.q_heads;
  const int d = config.shape.head_dim;
  const int batch = static_cast<int>(steps.size());
  const int subspaces = BulkCodes::SubspacesFor(d);
  absl::StatusOr<cuda::TopKWorkspace*> ws = ctx.TopKWs(q_heads, longest_bulk);
  if (!ws.ok()) return ws.status();
  state.topk_ws = *ws;
  const size_t tables = static_cast<size_t>(q_heads) * subspaces * ProductQuantizer::kCentroids;
  if (state.tables.size() < tables) {
    if (absl::Status s = state.tables.Allocate(tables, budget_, "the shortlists' tables");
        !s.ok()) {
      return s;
    }
  }
  // ids [batch, q_heads, shortlist] then sizes [batch, q_heads], one download.
  const size_t per_step = static_cast<size_t>(q_heads) * (shortlist + 1);
  if (state.ids.size() < batch * per_step) {
    if (absl::Status s = state.ids.Allocate(batch * per_step, budget_, "the shortlists' ids");
        !s.ok()) {
      return s;
    }
  }
  if (absl::Status s = state.ids_down.Ensure(batch * per_step * sizeof(int32_t), nullptr,
                                             "the shortlists' ids");
      !s.ok()) {
    return s;
  }
  for (cudaEvent_t* event : {&state.shortlist_begin, &state.shortlisted}) {
    if (*event == nullptr) {
      KVRECALL_CUDA_RETURN_IF_ERROR(CudaStatus(cudaEventCreate(event), "creating an event"));
    }
  }
  cudaStream_t stream = ctx.stream();
  KVRECALL_CUDA_RETURN_IF_ERROR(
      CudaStatus(cudaEventRecord(state.shortlist_begin, stream), "timing the shortlists"));
  int32_t* ids = state.ids.data();
  int32_t* sizes = ids + static_cast<size_t>(batch) * q_heads * shortlist;
  for (int b = 0; b < batch; ++b) {
    const StaticSetStep& step = steps[b];
    int32_t* step_sizes = sizes + static_cast<size_t>(b) * q_heads;
    if (step.codes == nullptr || step.bulk.tokens == 0) {
      KVRECALL_CUDA_RETURN_IF_ERROR(CudaStatus(
          cudaMemsetAsync(step_sizes, 0, q_heads * sizeof(int32_t), stream), "no shortlist"));
      continue;
    }
    const auto& codes = *static_cast<const GpuBulkCodes*>(step.codes);
    const cuda::PqShortlistRows rows{dev_q + static_cast<int64_t>(b) * q_heads * d, dev_sets,
                                     nullptr, state.tables.data(), q_heads,
                                     static_cast<int>(step.bulk.tokens)};
    KVRECALL_CUDA_RETURN_IF_ERROR(cuda::PqShortlist(
        codes.sets(d), rows, shortlist, *ws, ids + static_cast<size_t>(b) * q_heads * shortlist,
        step_sizes, nullptr, stream));
  }
  KVRECALL_CUDA_RETURN_IF_ERROR(
      CudaStatus(cudaMemcpyAsync(state.ids_down.data(), ids, batch * per_step * sizeof(int32_t),
                                 cudaMemcpyDeviceToHost, stream),
                 "downloading the shortlists"));
  return CudaStatus(cudaEventRecord(state.shortlisted, stream), "marking the shortlists");
}

absl::Status GpuStaticSetTier::WaitShortlists(std::span<const StaticSetStep> steps,
                                              StepContext* context) {
  DeviceScope scope(ordinal_);
  if (!scope.status().ok()) return scope.status();
  auto& state = static_cast<StaticStepContext&>(*context);
  KVRECALL_CUDA_RETURN_IF_ERROR(
      CudaStatus(cudaEventSynchronize(state.shortlisted), "finding the shortlists on the GPU"));
  float milliseconds = 0;
  KVRECALL_CUDA_RETURN_IF_ERROR(
      CudaStatus(cudaEventElapsedTime(&milliseconds, state.shortlist_begin, state.shortlisted),
                 "timing the shortlists"));
  state.tier_seconds.shortlist = milliseconds * 1e-3;
  // Device-side precondition violations would be this code's bug: every input was validated.
  if (absl::Status s = state.topk_ws->errors().CheckAndClear(state.gpu.stream()); !s.ok()) {
    return absl::InternalError(absl::StrCat("the shortlists' kernels reported: ", s.message()));
  }
  const int q_heads = steps.front().config->shape.q_heads;
  const int batch = static_cast<int>(steps.size());
  const int shortlist = steps.front().shortlist;  // one per run (SameStaticSet)
  const auto* ids = reinterpret_cast<const int32_t*>(state.ids_down.data());
  const int32_t* sizes = ids + static_cast<size_t>(batch) * q_heads * shortlist;
  for (int b = 0; b < batch; ++b) {
    const StaticSetStep& step = steps[b];
    if (step.codes == nullptr) continue;
    std::memcpy(step.shortlist_sizes, sizes + static_cast<size_t>(b) * q_heads,
                q_heads * sizeof(int32_t));
    std::memcpy(step.shortlist_ids, ids + static_cast<size_t>(b) * q_heads * shortlist,
                static_cast<size_t>(q_heads) * shortlist * sizeof(int32_t));
  }
  return absl::OkStatus();
}

absl::Status GpuStaticSetTier::CheckConfig(const LayerConfig& config) const {
  if (absl::Status s = gpu::CheckGpuKv(config, "PLACEMENT_TIERED on a GPU", "the static set");
      !s.ok()) {
    return s;
  }
  return ShapeOf(config, 1).Validate();
}

absl::StatusOr<std::unique_ptr<StaticSet>> GpuStaticSetTier::Build(const LayerConfig& config,
                                                                   MemoryAccount* device,
                                                                   const KvView& prompt) {
  DeviceScope scope(ordinal_);
  if (!scope.status().ok()) return scope.status();
  const int slots = Slots(config);
  const int64_t row = RowElems(config);
  ChargedBuffer<uint16_t> keys, values;
  if (absl::Status s = keys.Allocate(slots * row, device, "the static set"); !s.ok()) return s;
  if (absl::Status s = values.Allocate(slots * row, device, "the static set"); !s.ok()) return s;
  // The prompt's static tokens laid out by slot, widened to f32, keys then values; converted to
  // the KV dtype on the device.
  std::vector<float> host(2 * static_cast<size_t>(slots) * row, 0.0f);
  std::vector<int32_t> ids;
  AppendStaticSet(prompt.tokens, config.selector.sinks, config.selector.recent, &ids);
  for (int32_t p : ids) {
    const int64_t slot = SlotOf(config, p);
    cpu::LoadRow(prompt.key_row(p, 0), prompt.element, static_cast<int>(row),
                 host.data() + slot * row);
    cpu::LoadRow(prompt.value_row(p, 0), prompt.element, static_cast<int>(row),
                 host.data() + (slots + slot) * row);
  }
  ChargedBuffer<float> staged;
  if (absl::Status s = staged.Allocate(host.size(), device, "staging the static set"); !s.ok()) {
    return s;
  }
  KVRECALL_CUDA_RETURN_IF_ERROR(CudaStatus(
      cudaMemcpy(staged.data(), host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice),
      "uploading the static set"));
  const cuda::KvDtype dtype = KvDtypeOf(config.dtype);
  KVRECALL_CUDA_RETURN_IF_ERROR(
      cuda::ConvertToKv(staged.data(), slots * row, dtype, keys.data(), /*stream=*/0));
  KVRECALL_CUDA_RETURN_IF_ERROR(
      cuda::ConvertToKv(staged.data() + slots * row, slots * row, dtype, values.data(), 0));
  KVRECALL_CUDA_RETURN_IF_ERROR(
      CudaStatus(cudaStreamSynchronize(0), "converting the static set to the KV dtype"));
  return std::make_unique<GpuStaticSet>(std::move(keys), std::move(values));
}

absl::Status GpuStaticSetTier::Start(std::span<const StaticSetStep> steps, StepContext* context) {
  DeviceScope scope(ordinal_);
  if (!scope.status().ok()) return scope.status();
  auto& state = static_cast<StaticStepContext&>(*context);
  GpuStepContext& ctx = state.gpu;
  if (absl::Status s = ctx.Start(); !s.ok()) return s;
  state.tier_seconds.shortlist = 0;  // set by WaitShortlists when this step has shortlists
  const LayerConfig& config = *steps.front().config;
  const int batch = static_cast<int>(steps.size());
  const int q_heads = config.shape.q_heads;
  const int d = config.shape.head_dim;
  const int rows = batch * q_heads;
  const int64_t row = RowElems(config);
  absl::StatusOr<cuda::AttentionWorkspace*> ws = ctx.AttentionWs(rows);
  if (!ws.ok()) return ws.status();
  state.ws = *ws;

  Carver in(nullptr);
  const size_t in_q = in.Take<float>(static_cast<size_t>(rows) * d);
  const size_t in_k = in.Take<float>(batch * row);
  const size_t in_v = in.Take<float>(batch * row);
  const size_t in_seqs = in.Take<DeviceSeq>(batch);
  const size_t in_rows = in.Take<cuda::TokenRows>(batch);
  const size_t in_sets = in.Take<int32_t>(q_heads);  // the KV head of each query head
  Carver out(nullptr);
  state.out_o = out.Take<float>(static_cast<size_t>(rows) * d);
  state.out_lse = out.Take<float>(rows);
  if (absl::Status s = ctx.EnsureIo(in.size(), out.size()); !s.ok()) return s;
  std::byte* host_in = ctx.pinned_in();
  std::byte* dev_in = ctx.device_in();
  for (int h = 0; h < q_heads; ++h) {
    in.At<int32_t>(host_in, in_sets)[h] = KvHeadOf(h, q_heads, config.shape.kv_heads);
  }
  // The shortlists' new codes go up first, while the stream is idle (their copy is from
  // pageable memory, which waits for the stream).
  int shortlist = 0;
  int64_t longest_bulk = 0;
  for (const StaticSetStep& step : steps) {
    if (step.codes == nullptr) continue;
    if (absl::Status s = static_cast<GpuBulkCodes*>(step.codes)->Append(step.bulk, ctx.stream());
        !s.ok()) {
      return s;
    }
    shortlist = step.shortlist;
    longest_bulk = std::max(longest_bulk, step.bulk.tokens);
  }
  for (int b = 0; b < batch; ++b) {
    const StaticSetStep& step = steps[b];
    const auto& set = *static_cast<const GpuStaticSet*>(step.set);
    const int64_t tokens = step.host_kv.tokens;  // the new token included
    std::memcpy(in.At<float>(host_in, in_q) + static_cast<int64_t>(b) * q_heads * d, step.q,
                static_cast<size_t>(q_heads) * d * sizeof(float));
    std::memcpy(in.At<float>(host_in, in_k) + b * row, step.k_new, row * sizeof(float));
    std::memcpy(in.At<float>(host_in, in_v) + b * row, step.v_new, row * sizeof(float));
    in.At<DeviceSeq>(host_in, in_seqs)[b] = set.Seq(config, tokens);
    const int64_t slot = SlotOf(config, tokens - 1);
    in.At<cuda::TokenRows>(host_in, in_rows)[b] =
        cuda::TokenRows{set.key_slot(config, slot), set.value_slot(config, slot)};
  }
  cudaStream_t stream = ctx.stream();
  for (cudaEvent_t* event : {&state.begin, &state.end}) {
    if (*event == nullptr) {
      KVRECALL_CUDA_RETURN_IF_ERROR(CudaStatus(cudaEventCreate(event), "creating an event"));
    }
  }
  KVRECALL_CUDA_RETURN_IF_ERROR(
      CudaStatus(cudaEventRecord(state.begin, stream), "timing a static-set step"));
  KVRECALL_CUDA_RETURN_IF_ERROR(
      CudaStatus(cudaMemcpyAsync(dev_in, host_in, in.size(), cudaMemcpyHostToDevice, stream),
                 "uploading a static-set step"));
  if (shortlist > 0) {
    if (absl::Status s = LaunchShortlists(steps, state, in.At<float>(dev_in, in_q),
                                          in.At<int32_t>(dev_in, in_sets), shortlist,
                                          longest_bulk);
        !s.ok()) {
      return s;
    }
  }
  KVRECALL_CUDA_RETURN_IF_ERROR(cuda::AppendTokens(
      batch, static_cast<int>(row), KvDtypeOf(config.dtype),
      in.At<cuda::TokenRows>(dev_in, in_rows), in.At<float>(dev_in, in_k),
      in.At<float>(dev_in, in_v), stream));
  KVRECALL_CUDA_RETURN_IF_ERROR(cuda::PartialAttentionOverSeqs(
      ShapeOf(config, batch), in.At<DeviceSeq>(dev_in, in_seqs), in.At<float>(dev_in, in_q),
      Slots(config), state.ws, out.At<float>(ctx.device_out(), state.out_o),
      out.At<float>(ctx.device_out(), state.out_lse), stream));
  KVRECALL_CUDA_RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(ctx.pinned_out(), ctx.device_out(),
                                                           out.size(), cudaMemcpyDeviceToHost,
                                                           stream),
                                           "downloading a static-set step"));
  return CudaStatus(cudaEventRecord(state.end, stream), "timing a static-set step");
}

absl::Status GpuStaticSetTier::Finish(std::span<const StaticSetStep> steps, StepContext* context) {
  DeviceScope scope(ordinal_);
  if (!scope.status().ok()) return scope.status();
  auto& state = static_cast<StaticStepContext&>(*context);
  GpuStepContext& ctx = state.gpu;
  KVRECALL_CUDA_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(ctx.stream()),
                                           "attending the static sets on the GPU"));
  // Device-side precondition violations would be this code's bug: every input was validated.
  if (absl::Status s = state.ws->errors().CheckAndClear(ctx.stream()); !s.ok()) {
    return absl::InternalError(absl::StrCat("a static-set step's kernels reported: ", s.message()));
  }
  float milliseconds = 0;
  KVRECALL_CUDA_RETURN_IF_ERROR(CudaStatus(
      cudaEventElapsedTime(&milliseconds, state.begin, state.end), "timing a static-set step"));
  // The shortlists ran on the same stream ahead of the static sets: their time is reported
  // apart (tier_seconds.shortlist), not as the static sets'.
  state.tier_seconds.static_set = milliseconds * 1e-3 - state.tier_seconds.shortlist;
  const LayerConfig& config = *steps.front().config;
  const int q_heads = config.shape.q_heads;
  const int d = config.shape.head_dim;
  const float* o = reinterpret_cast<const float*>(ctx.pinned_out() + state.out_o);
  const float* lse = reinterpret_cast<const float*>(ctx.pinned_out() + state.out_lse);
  for (size_t b = 0; b < steps.size(); ++b) {
    std::memcpy(steps[b].o, o + b * q_heads * d, static_cast<size_t>(q_heads) * d * sizeof(float));
    std::memcpy(steps[b].lse, lse + b * q_heads, q_heads * sizeof(float));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<StaticSetTier>> MakeGpuStaticSetTier(int ordinal,
                                                                    MemoryBudget* budget) {
  DeviceScope scope(ordinal);
  if (!scope.status().ok()) return scope.status();
  absl::StatusOr<BatchTopKFunction> topk = MakeGpuBatchTopKFunction();
  if (!topk.ok()) return topk.status();
  // The graph build runs on whichever thread builds the layer: make it this tier's device.
  BatchTopKFunction on_device = [ordinal, topk = *std::move(topk)](
                                    const VectorSet& queries, const VectorSet& keys, int k,
                                    TopKLists* out, std::span<const int64_t> visible) {
    DeviceScope scope(ordinal);
    if (!scope.status().ok()) return scope.status();
    return topk(queries, keys, k, out, visible);
  };
  return std::make_unique<GpuStaticSetTier>(ordinal, budget, std::move(on_device));
}

}  // namespace kvrecall
