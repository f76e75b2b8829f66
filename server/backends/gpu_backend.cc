// The GPU-resident placement (PLACEMENT_GPU): every layer's whole KV on one CUDA device in the
// session's dtype, attended by the kernels of kernels/cuda — full attention (split-K), streaming
// (sinks + recent as a ring view of the history), exact top-K (full key scan + selection), and
// ReTopK with its query-support caches on the device. One GpuBackend per device; each Decode
// stream has its own CUDA stream, pinned buffers and workspaces (GpuStepContext), and a step of a
// batch costs one upload, the kernels and one download, for all sequences that share a kernel
// configuration.
#include <cudaTypedefs.h>  // the driver's entry points, reached through the runtime
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <numeric>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "index/basic_selectors.h"
#include "index/retopk.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/decode_types.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/exact_topk.h"
#include "kernels/cuda/kv_write.h"
#include "kernels/cuda/partial_attention.h"
#include "kernels/cuda/retopk.h"
#include "kernels/cuda/topk_workspace.h"
#include "server/backends/gpu_support.h"
#include "server/backends/placements.h"
#include "server/backends/step_runs.h"
#include "server/backends/tiered_backend.h"
#include "server/kv_store.h"

namespace kvrecall {
namespace {

using cuda::CudaStatus;
using cuda::DecodeShape;
using cuda::DeviceBuffer;
using cuda::DeviceSeq;
using cuda::KvDtype;
using gpu::ChargedBuffer;
using gpu::Carver;
using gpu::DeviceScope;
using gpu::GpuStepContext;
using gpu::GraphTokenBound;
using gpu::KvBytes;
using gpu::KvDtypeOf;
using gpu::PinnedBuffer;
using gpu::ReportedErrors;
using gpu::RowElems;
using gpu::SameKernels;
using gpu::ShapeOf;

// One layer's keys and values on the device, [capacity, kv_heads, head_dim] each in the KV
// dtype, growing geometrically; appends are two-phase as in BudgetedRows.
class DeviceKv {
 public:
  DeviceKv(const LayerConfig& config, MemoryAccount* account)
      : row_elems_(RowElems(config)), account_(account) {}

  // Room for `more` tokens beyond the committed ones: half again the capacity or, when the
  // budget cannot afford that, exactly what is needed. Growth copies the content on the
  // device, complete when Reserve returns (no kernel of this layer is in flight between steps).
  // RESOURCE_EXHAUSTED naming `what` changes nothing.
  absl::Status Reserve(int64_t more, absl::string_view what) {
    const int64_t needed = tokens_ + more;
    if (needed <= capacity_) return absl::OkStatus();
    if (needed > int64_t{INT32_MAX}) {
      return absl::ResourceExhaustedError(
          absl::StrCat(what, ": a layer on the GPU holds at most 2^31 - 1 tokens"));
    }
    const int64_t grown = std::min<int64_t>(
        INT32_MAX, std::max({needed, capacity_ + capacity_ / 2, int64_t{256}}));
    absl::Status status;
    for (const int64_t capacity : {grown, needed}) {
      ChargedBuffer<uint16_t> keys, values;
      status = keys.Allocate(capacity * row_elems_, account_, what);
      if (status.ok()) status = values.Allocate(capacity * row_elems_, account_, what);
      if (!status.ok()) continue;
      const size_t used = static_cast<size_t>(tokens_) * row_elems_ * 2;
      if (used > 0) {
        status = cuda::CopyDeviceToDevice(keys.data(), keys_.data(), used,
                                          "moving keys to a larger allocation");
        if (status.ok()) {
          status = cuda::CopyDeviceToDevice(values.data(), values_.data(), used,
                                            "moving values to a larger allocation");
        }
        if (!status.ok()) return status;
      }
      keys_ = std::move(keys);
      values_ = std::move(values);
      capacity_ = capacity;
      return absl::OkStatus();
    }
    return status;
  }
  void Commit(int64_t n) { tokens_ += n; }

  uint16_t* key_row(int64_t t) const { return keys_.data() + t * row_elems_; }
  uint16_t* value_row(int64_t t) const { return values_.data() + t * row_elems_; }
  int64_t tokens() const { return tokens_; }
  int64_t bytes() const { return static_cast<int64_t>(keys_.bytes() + values_.bytes()); }

  // The committed history plus `extra` reserved tokens, as the kernels see it.
  DeviceSeq Seq(int64_t extra = 0) const {
    return DeviceSeq::Contiguous(keys_.data(), values_.data(),
                                 static_cast<int32_t>(tokens_ + extra));
  }

 private:
  const int64_t row_elems_;
  MemoryAccount* const account_;
  ChargedBuffer<uint16_t> keys_;
  ChargedBuffer<uint16_t> values_;
  int64_t tokens_ = 0;
  int64_t capacity_ = 0;
};

// The kernels' view of a streaming support over contiguous KV: the first `sinks` tokens and the
// last `recent`, as a DeviceSeq whose ring is the tail of the history.
DeviceSeq StreamingSeq(const DeviceSeq& all, int sinks, int recent) {
  const int32_t n = all.head_count;
  if (n <= sinks + recent) return all;
  return DeviceSeq{all.keys, all.values, sinks, n - recent, recent, 0, recent};
}

// Prompt queries a ReTopK layer keeps from its prompt: the last C seed its caches.
int KeptQueries(const LayerConfig& config) {
  return config.selector.kind == SelectorKind::kReTopK ? config.selector.retopk.cache_capacity : 0;
}

// A prompt on its way to the device: each chunk is decoded into pinned memory, then copied
// asynchronously (while the stream receives the next chunk) and converted to the KV dtype on the
// device. Host memory keeps only the last C queries (ReTopK's seeds) — and, under auto_tau, the
// f32 keys and the window of queries that the CPU calibration replays, freed when the layer is
// built.
class GpuPromptStaging final : public PromptStaging {
 public:
  GpuPromptStaging(int ordinal, const LayerConfig& config, const SessionAccounts& accounts)
      : ordinal_(ordinal),
        config_(config),
        accounts_(accounts),
        kv_(config, accounts.device) {
    if (config.selector.kind == SelectorKind::kReTopK && config.selector.retopk.auto_tau) {
      host_prompt_ = std::make_unique<CalibrationPrompt>(
          config.shape, accounts.host,
          PromptQueriesNeeded(config.selector, std::numeric_limits<int64_t>::max()));
    }
  }
  ~GpuPromptStaging() override {
    DeviceScope scope(ordinal_);
    if (stream_ != nullptr) {
      cudaStreamSynchronize(stream_);
      cudaStreamDestroy(stream_);
    }
  }

  absl::Status Start() {
    DeviceScope scope(ordinal_);
    if (!scope.status().ok()) return scope.status();
    return CudaStatus(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
                      "creating a prefill stream");
  }

  absl::Status Reserve(int64_t more, absl::string_view what) override {
    DeviceScope scope(ordinal_);
    // The pinned and device staging of the previous chunk are reused: its copies must be done.
    KVRECALL_CUDA_RETURN_IF_ERROR(
        CudaStatus(cudaStreamSynchronize(stream_), "copying a prompt chunk to the GPU"));
    const int64_t q_row = int64_t{config_.shape.q_heads} * config_.shape.head_dim;
    const int64_t kv_row = RowElems(config_);
    if (absl::Status s = kv_.Reserve(more, what); !s.ok()) return s;
    if (absl::Status s = pinned_.Ensure(more * (q_row + 2 * kv_row) * sizeof(float), accounts_.host,
                                        what);
        !s.ok()) {
      return s;
    }
    if (static_cast<int64_t>(staged_.size()) < 2 * more * kv_row) {
      if (absl::Status s = staged_.Allocate(2 * more * kv_row, accounts_.device, what); !s.ok()) {
        return s;
      }
    }
    if (host_prompt_ != nullptr) {
      if (absl::Status s = host_prompt_->Reserve(more, what); !s.ok()) return s;
    }
    reserved_ = more;
    return absl::OkStatus();
  }
  float* query_tail() override { return reinterpret_cast<float*>(pinned_.data()); }
  // The chunk's keys and values stay f32 in pinned memory; the device converts them.
  void* key_tail() override { return key_floats(); }
  void* value_tail() override { return key_floats() + reserved_ * RowElems(config_); }
  KvElement kv_element() const override { return KvElement::kF32; }

  absl::Status Commit(int64_t n, bool with_queries) override {
    DeviceScope scope(ordinal_);
    const int64_t kv_row = RowElems(config_);
    const int64_t q_row = int64_t{config_.shape.q_heads} * config_.shape.head_dim;
    // Keys and values: one copy of both (adjacent in pinned memory), then the conversion.
    KVRECALL_CUDA_RETURN_IF_ERROR(CudaStatus(
        cudaMemcpyAsync(staged_.data(), key_floats(), 2 * n * kv_row * sizeof(float),
                        cudaMemcpyHostToDevice, stream_),
        "copying a prompt chunk to the GPU"));
    const KvDtype dtype = KvDtypeOf(config_.dtype);
    KVRECALL_CUDA_RETURN_IF_ERROR(cuda::ConvertToKv(staged_.data(), n * kv_row, dtype,
                                                    kv_.key_row(kv_.tokens()), stream_));
    KVRECALL_CUDA_RETURN_IF_ERROR(cuda::ConvertToKv(
        staged_.data() + n * kv_row, n * kv_row, dtype, kv_.value_row(kv_.tokens()), stream_));
    // The last C queries, oldest first.
    const int keep = KeptQueries(config_);
    if (!with_queries) {
      std::fill_n(query_tail(), n * q_row, 0.0f);
      last_queries_.clear();  // the seeds must come after the last chunk without queries
    } else if (keep > 0) {
      const float* q = query_tail();
      last_queries_.insert(last_queries_.end(), q + std::max<int64_t>(0, n - keep) * q_row,
                           q + n * q_row);
      const int64_t excess = static_cast<int64_t>(last_queries_.size()) - keep * q_row;
      if (excess > 0) last_queries_.erase(last_queries_.begin(), last_queries_.begin() + excess);
    }
    if (host_prompt_ != nullptr) {
      host_prompt_->Append(query_tail(), key_floats(), n, q_row, kv_row);
    }
    kv_.Commit(n);
    reserved_ = 0;
    return absl::OkStatus();
  }
  int64_t tokens() const override { return kv_.tokens(); }

  // What BuildLayer takes over.
  DeviceKv& kv() { return kv_; }
  cudaStream_t stream() const { return stream_; }
  const std::vector<float>& last_queries() const { return last_queries_; }
  // The f32 prompt keys and queries (auto_tau only; null otherwise).
  // Every key, and the last `kept_queries` queries (the calibration's window: the ones its
  // Build reads, PromptQueriesNeeded), as the host staging keeps them.
  struct CalibrationPrompt {
    CalibrationPrompt(const LayerShape& shape, MemoryAccount* host, int64_t kept_queries)
        : keys(int64_t{shape.kv_heads} * shape.head_dim, host),
          queries(int64_t{shape.q_heads} * shape.head_dim, kept_queries, host) {}
    absl::Status Reserve(int64_t more, absl::string_view what) {
      if (absl::Status s = keys.Reserve(more, what); !s.ok()) return s;
      return queries.Reserve(more, what);
    }
    // q [n, q_row] (zeros for a chunk without queries), k [n, kv_row], f32.
    void Append(const float* q, const float* k, int64_t n, int64_t q_row, int64_t kv_row) {
      if (float* tail = queries.tail(); tail != nullptr) {
        std::memcpy(tail, q, n * q_row * sizeof(float));
      }
      std::memcpy(keys.tail(), k, n * kv_row * sizeof(float));
      queries.Commit(n);
      keys.Commit(n);
    }
    PromptQueries prompt_queries() const { return queries.prompt_queries(); }
    BudgetedRows keys;          // [tokens, kv_heads, head_dim]
    PromptQueryWindow queries;  // the prompt's rows [first(), first() + rows())
  };
  const CalibrationPrompt* host_prompt() const { return host_prompt_.get(); }

 private:
  float* key_floats() {
    return query_tail() + reserved_ * config_.shape.q_heads * config_.shape.head_dim;
  }

  const int ordinal_;
  const LayerConfig config_;
  const SessionAccounts accounts_;
  cudaStream_t stream_ = nullptr;
  DeviceKv kv_;
  PinnedBuffer pinned_;                 // [reserved] q, then k, then v, f32
  ChargedBuffer<float> staged_;         // [reserved] k then v, f32, on the device
  int64_t reserved_ = 0;
  std::vector<float> last_queries_;     // [<= C, q_heads, head_dim]
  std::unique_ptr<CalibrationPrompt> host_prompt_;
};

// One layer of a GPU-resident session.
class GpuLayer final : public LayerBackend {
 public:
  // `caches` (ReTopK only) are charged to `device` already; the layer gives them back.
  GpuLayer(int ordinal, const LayerConfig& config, MemoryAccount* device, DeviceKv kv,
           std::unique_ptr<cuda::ReTopKCaches> caches)
      : ordinal_(ordinal),
        config_(config),
        device_(device),
        kv_(std::move(kv)),
        caches_(std::move(caches)) {}
  ~GpuLayer() override {
    DeviceScope scope(ordinal_);
    if (caches_ != nullptr) device_->Release(caches_->device_bytes());
    caches_.reset();
  }

  int64_t tokens() const override { return kv_.tokens(); }
  absl::Status ReserveToken() override {
    DeviceScope scope(ordinal_);
    return kv_.Reserve(1, "the new token");
  }
  LayerMemory memory() const override {
    const int64_t caches = caches_ != nullptr ? caches_->device_bytes() : 0;
    return LayerMemory{0, kv_.bytes() + caches, caches};
  }

  const LayerConfig& config() const { return config_; }
  DeviceKv& kv() { return kv_; }
  const DeviceKv& kv() const { return kv_; }
  cuda::ReTopKCaches* caches() const { return caches_.get(); }

 private:
  const int ordinal_;
  const LayerConfig config_;
  MemoryAccount* const device_;
  DeviceKv kv_;
  std::unique_ptr<cuda::ReTopKCaches> caches_;  // ReTopK only
};


class GpuBackend final : public AttentionBackend {
 public:
  GpuBackend(int ordinal, int64_t budget_bytes, bool cuda_graphs)
      : ordinal_(ordinal),
        cuda_graphs_(cuda_graphs),
        device_(absl::StrCat("cuda:", ordinal)),
        budget_(budget_bytes, absl::StrCat("GPU ", ordinal, " memory"), "gpu_memory_budget_gb") {}

  v1::Placement placement() const override { return v1::PLACEMENT_GPU; }
  const std::string& device() const override { return device_; }
  MemoryBudget* device_budget() const override { return &budget_; }

  absl::Status CheckConfig(const LayerConfig& config) const override;
  int64_t DeviceBytesFor(const LayerConfig& config, int64_t tokens) const override {
    int64_t bytes = KvBytes(config, tokens);
    if (config.selector.kind == SelectorKind::kReTopK) {
      bytes += cuda::ReTopKCaches::DeviceBytesFor(config.shape.q_heads, config.shape.head_dim,
                                                  config.selector.top_k, config.selector.retopk);
    }
    return bytes;
  }
  absl::StatusOr<std::unique_ptr<PromptStaging>> NewPromptStaging(
      const LayerConfig& config, const SessionAccounts& accounts) override {
    auto staging = std::make_unique<GpuPromptStaging>(ordinal_, config, accounts);
    if (absl::Status s = staging->Start(); !s.ok()) return s;
    return staging;
  }
  absl::StatusOr<std::unique_ptr<LayerBackend>> BuildLayer(
      const LayerConfig& config, const SessionAccounts& accounts,
      std::unique_ptr<PromptStaging> prompt, const BuildStop& stop) override;
  std::unique_ptr<StepContext> NewStepContext(MemoryAccount* host) override {
    return std::make_unique<GpuStepContext>(ordinal_, &budget_, host);
  }
  absl::Status Step(std::span<LayerStep> steps, StepContext* context) override;
  absl::Status Shadow(std::span<ShadowStep> steps, StepContext* context) override;

 private:
  // One launch sequence for `steps`, which share SameKernels.
  absl::Status StepBatch(std::span<LayerStep> steps, GpuStepContext& ctx);

  const int ordinal_;
  const bool cuda_graphs_;  // steps replay captured launch sequences (PlacementOptions)
  const std::string device_;
  mutable MemoryBudget budget_;
};

absl::Status GpuBackend::CheckConfig(const LayerConfig& config) const {
  if (absl::Status s = gpu::CheckGpuKv(config, "PLACEMENT_GPU", "the KV"); !s.ok()) return s;
  const SelectorParams& p = config.selector;
  if (p.kind == SelectorKind::kIndex) {
    return absl::InvalidArgumentError(
        "policy.selector SELECTOR_INDEX is not served by PLACEMENT_GPU: the graph index searches "
        "host memory, so it belongs to PLACEMENT_TIERED; PLACEMENT_GPU serves full, exact_topk, "
        "streaming and retopk");
  }
  if (p.kind == SelectorKind::kReTopK) {
    const DecodeShape shape = ShapeOf(config, 1);
    if (absl::Status s = cuda::ReTopKCaches::CheckParams(shape, p.top_k, p.retopk); !s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("policy.retopk is not served by PLACEMENT_GPU: ", s.message()));
    }
  }
  if (p.kind == SelectorKind::kExactTopK || p.kind == SelectorKind::kReTopK) {
    // The selection's bound is the device's shared memory (a K it cannot hold failed its first
    // step with INTERNAL): refused here, naming it.
    return gpu::CheckOnDevice(
        ordinal_,
        absl::StrCat("policy.top_k ", p.top_k, " is not served by PLACEMENT_GPU on ", device_),
        [&] { return cuda::CheckExactTopK(ShapeOf(config, 1), p.top_k); });
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<LayerBackend>> GpuBackend::BuildLayer(
    const LayerConfig& config, const SessionAccounts& accounts,
    std::unique_ptr<PromptStaging> prompt, const BuildStop& stop) {
  DeviceScope scope(ordinal_);
  if (!scope.status().ok()) return scope.status();
  auto& staged = static_cast<GpuPromptStaging&>(*prompt);
  KVRECALL_CUDA_RETURN_IF_ERROR(
      CudaStatus(cudaStreamSynchronize(staged.stream()), "copying the prompt to the GPU"));
  DeviceKv& kv = staged.kv();
  const int64_t tokens = kv.tokens();
  if (tokens > INT32_MAX - 1) {
    return absl::InvalidArgumentError("a prompt on the GPU holds at most 2^31 - 2 tokens");
  }
  std::unique_ptr<cuda::ReTopKCaches> caches;
  if (config.selector.kind == SelectorKind::kReTopK) {
    const SelectorParams& p = config.selector;
    // auto_tau: the CPU calibration of index/retopk.h on the host copy of the prompt, so that
    // both placements choose the same tau per head.
    std::vector<float> taus;
    if (const auto* host = staged.host_prompt(); host != nullptr) {
      ReTopKSelector calibration(config.shape, p.top_k, p.retopk);
      const KvView view{host->keys.data(), nullptr, host->keys.rows(), config.shape.kv_heads,
                        config.shape.head_dim};
      if (absl::Status s = calibration.BuildUnless(stop, view, host->prompt_queries()); !s.ok()) {
        return s;
      }
      for (int h = 0; h < config.shape.q_heads; ++h) taus.push_back(calibration.head(h).tau());
    }
    const int64_t caches_bytes = cuda::ReTopKCaches::DeviceBytesFor(
        config.shape.q_heads, config.shape.head_dim, p.top_k, p.retopk);
    if (absl::Status s = accounts.device->Reserve(caches_bytes, "the ReTopK caches"); !s.ok()) {
      return s;
    }
    absl::StatusOr<std::unique_ptr<cuda::ReTopKCaches>> made =
        cuda::ReTopKCaches::Create(config.shape.q_heads, config.shape.head_dim, p.top_k, p.retopk);
    if (!made.ok()) {
      accounts.device->Release(caches_bytes);
      return made.status();
    }
    caches = *std::move(made);
    const int count = static_cast<int>(
        staged.last_queries().size() / (config.shape.q_heads * config.shape.head_dim));
    ChargedBuffer<float> queries;
    absl::Status seeded = queries.Allocate(std::max<size_t>(1, staged.last_queries().size()),
                                           accounts.device, "the ReTopK seeds");
    if (seeded.ok()) {
      seeded = cuda::CopyToDevice(queries.data(), staged.last_queries().data(),
                                  staged.last_queries().size() * sizeof(float),
                                  "uploading the ReTopK seeds");
    }
    std::unique_ptr<cuda::ReTopKWorkspace> ws;
    if (seeded.ok()) {
      // Seeding scans the prompt once per seed: its own workspace, freed right after.
      const DecodeShape shape = ShapeOf(config, 1);
      const int64_t bytes = cuda::ReTopKWorkspace::DeviceBytesFor(
          shape, p.top_k, p.retopk, static_cast<int>(std::max<int64_t>(1, tokens)));
      seeded = accounts.device->Reserve(bytes, "seeding the ReTopK caches");
      if (seeded.ok()) {
        absl::StatusOr<std::unique_ptr<cuda::ReTopKWorkspace>> made_ws =
            cuda::ReTopKWorkspace::Create(shape, p.top_k, p.retopk,
                                          static_cast<int>(std::max<int64_t>(1, tokens)));
        seeded = made_ws.status();
        if (made_ws.ok()) {
          seeded = cuda::SeedReTopKCaches(shape, p.top_k, p.retopk, kv.Seq(), queries.data(),
                                          count, taus, made_ws->get(), caches.get(),
                                          staged.stream());
        }
        accounts.device->Release(bytes);
      }
    }
    if (!seeded.ok()) {
      accounts.device->Release(caches_bytes);
      return seeded;
    }
  }
  auto layer =
      std::make_unique<GpuLayer>(ordinal_, config, accounts.device, std::move(kv), std::move(caches));
  // An announced length is reserved now, so that decoding up to it never reallocates.
  if (config.expected_tokens > tokens) {
    if (absl::Status s =
            layer->kv().Reserve(config.expected_tokens - tokens, "the announced max_tokens");
        !s.ok()) {
      return s;
    }
  }
  return layer;
}

absl::Status GpuBackend::Step(std::span<LayerStep> steps, StepContext* context) {
  DeviceScope scope(ordinal_);
  if (!scope.status().ok()) return scope.status();
  auto& ctx = static_cast<GpuStepContext&>(*context);
  if (absl::Status s = ctx.Start(); !s.ok()) return s;
  // Runs of steps that share kernels and knobs step together (usually the whole request).
  return ForEachRun(
      steps, ctx.runs,
      [](const LayerStep& first, const LayerStep& step) {
        return SameKernels(static_cast<GpuLayer*>(first.layer)->config(),
                           static_cast<GpuLayer*>(step.layer)->config());
      },
      [&](std::span<LayerStep> batch) { return StepBatch(batch, ctx); });
}

absl::Status GpuBackend::StepBatch(std::span<LayerStep> steps, GpuStepContext& ctx) {
  const LayerConfig& config = static_cast<GpuLayer*>(steps.front().layer)->config();
  const SelectorParams& p = config.selector;
  const int batch = static_cast<int>(steps.size());
  const int q_heads = config.shape.q_heads;
  const int d = config.shape.head_dim;
  const int rows = batch * q_heads;
  const int64_t kv_row = RowElems(config);
  const DecodeShape shape = ShapeOf(config, batch);
  int64_t max_tokens = 1;
  for (const LayerStep& step : steps) {
    max_tokens = std::max(max_tokens, static_cast<GpuLayer*>(step.layer)->kv().tokens() + 1);
  }
  const bool want_supports = steps.front().supports != nullptr;
  const bool topk = p.kind == SelectorKind::kExactTopK;
  const bool retopk = p.kind == SelectorKind::kReTopK;
  // A captured step is planned for a rounded-up history, so that it serves many steps.
  if (cuda_graphs_) max_tokens = GraphTokenBound(max_tokens);

  // Workspaces first: a refusal here changes nothing.
  cuda::AttentionWorkspace* attention_ws = nullptr;
  cuda::TopKWorkspace* topk_ws = nullptr;
  cuda::ReTopKWorkspace* retopk_ws = nullptr;
  if (p.kind == SelectorKind::kFull || p.kind == SelectorKind::kStreaming) {
    absl::StatusOr<cuda::AttentionWorkspace*> ws = ctx.AttentionWs(rows);
    if (!ws.ok()) return ws.status();
    attention_ws = *ws;
  } else if (topk) {
    absl::StatusOr<cuda::TopKWorkspace*> ws = ctx.TopKWs(rows, max_tokens);
    if (!ws.ok()) return ws.status();
    topk_ws = *ws;
  } else {
    absl::StatusOr<cuda::ReTopKWorkspace*> ws = ctx.ReTopKWs(config, batch, max_tokens);
    if (!ws.ok()) return ws.status();
    retopk_ws = *ws;
  }

  // One packed upload: queries, new keys and values, and the per-sequence descriptors.
  Carver in(nullptr);
  const size_t in_q = in.Take<float>(static_cast<size_t>(rows) * d);
  const size_t in_k = in.Take<float>(batch * kv_row);
  const size_t in_v = in.Take<float>(batch * kv_row);
  const size_t in_seqs = in.Take<DeviceSeq>(batch);
  const size_t in_rows = in.Take<cuda::TokenRows>(batch);
  const size_t in_caches = in.Take<cuda::ReTopKCachesView>(retopk ? batch : 0);
  // One packed download: outputs, the kernels' error word, what the reports need, and last the
  // supports (downloaded only when compare_exact asks for them). What ReTopK's kernels leave in
  // their workspace is gathered into it on the device first.
  Carver out(nullptr);
  const size_t out_o = out.Take<float>(static_cast<size_t>(rows) * d);
  const size_t out_lse = out.Take<float>(rows);
  const size_t out_errors = out.Take<unsigned>(1);
  const size_t out_sizes = out.Take<int32_t>(topk || retopk ? rows : 0);
  const size_t out_paths = out.Take<uint8_t>(retopk ? rows : 0);
  const size_t out_candidates = out.Take<int32_t>(retopk ? rows : 0);
  const size_t out_best = out.Take<float>(retopk ? rows : 0);
  const size_t out_support =
      out.Take<int32_t>(topk || retopk ? static_cast<size_t>(rows) * p.top_k : 0);
  // Supports cross PCIe only when compare_exact asked for them.
  const size_t download = want_supports ? out.size() : out_support;
  if (absl::Status s = ctx.EnsureIo(in.size(), out.size(), download); !s.ok()) return s;
  std::byte* host_in = ctx.pinned_in();
  std::byte* dev_in = ctx.device_in();
  std::byte* host_out = ctx.pinned_out();
  std::byte* dev_out = ctx.device_out();
  for (int b = 0; b < batch; ++b) {
    const LayerStep& step = steps[b];
    GpuLayer& layer = *static_cast<GpuLayer*>(step.layer);
    std::memcpy(in.At<float>(host_in, in_q) + static_cast<int64_t>(b) * q_heads * d, step.q,
                static_cast<size_t>(q_heads) * d * sizeof(float));
    std::memcpy(in.At<float>(host_in, in_k) + b * kv_row, step.k_new, kv_row * sizeof(float));
    std::memcpy(in.At<float>(host_in, in_v) + b * kv_row, step.v_new, kv_row * sizeof(float));
    const DeviceSeq all = layer.kv().Seq(/*extra=*/1);
    in.At<DeviceSeq>(host_in, in_seqs)[b] =
        p.kind == SelectorKind::kStreaming ? StreamingSeq(all, p.sinks, p.recent) : all;
    const int64_t n = layer.kv().tokens();
    in.At<cuda::TokenRows>(host_in, in_rows)[b] =
        cuda::TokenRows{layer.kv().key_row(n), layer.kv().value_row(n)};
    if (retopk) in.At<cuda::ReTopKCachesView>(host_in, in_caches)[b] = layer.caches()->view();
  }
  cudaStream_t stream = ctx.stream();
  const cuda::KernelErrors& errors = attention_ws != nullptr ? attention_ws->errors()
                                     : topk                  ? topk_ws->errors()
                                                             : retopk_ws->errors();
  // The step's device work, from the upload to the download: queued as it is, or captured once
  // per StepGraphKey and replayed.
  auto enqueue = [&]() -> absl::Status {
    KVRECALL_CUDA_RETURN_IF_ERROR(CudaStatus(
        cudaMemcpyAsync(dev_in, host_in, in.size(), cudaMemcpyHostToDevice, stream),
        "uploading a decode step"));
    KVRECALL_CUDA_RETURN_IF_ERROR(cuda::AppendTokens(
        batch, static_cast<int>(kv_row), shape.dtype, in.At<cuda::TokenRows>(dev_in, in_rows),
        in.At<float>(dev_in, in_k), in.At<float>(dev_in, in_v), stream));
    const DeviceSeq* seqs = in.At<DeviceSeq>(dev_in, in_seqs);
    const float* q = in.At<float>(dev_in, in_q);
    float* o = out.At<float>(dev_out, out_o);
    float* lse = out.At<float>(dev_out, out_lse);
    const int max_n = static_cast<int>(max_tokens);
    if (attention_ws != nullptr) {
      KVRECALL_CUDA_RETURN_IF_ERROR(
          cuda::PartialAttentionOverSeqs(shape, seqs, q, max_n, attention_ws, o, lse, stream));
    } else if (topk) {
      KVRECALL_CUDA_RETURN_IF_ERROR(cuda::ExactTopKAttention(
          shape, seqs, q, max_n, p.top_k, nullptr, topk_ws, out.At<int32_t>(dev_out, out_support),
          out.At<int32_t>(dev_out, out_sizes), o, lse, stream));
    } else {
      KVRECALL_CUDA_RETURN_IF_ERROR(
          cuda::ReTopKStep(shape, p.top_k, p.retopk, seqs,
                           in.At<cuda::ReTopKCachesView>(dev_in, in_caches), q, max_n, retopk_ws, o,
                           lse, stream));
    }
    auto gather = [&](size_t at, const void* src, size_t bytes) {
      return CudaStatus(
          cudaMemcpyAsync(dev_out + at, src, bytes, cudaMemcpyDeviceToDevice, stream),
          "gathering a decode step's download");
    };
    KVRECALL_CUDA_RETURN_IF_ERROR(gather(out_errors, errors.device_word(), sizeof(unsigned)));
    if (retopk) {
      KVRECALL_CUDA_RETURN_IF_ERROR(gather(out_paths, retopk_ws->paths(), rows));
      KVRECALL_CUDA_RETURN_IF_ERROR(
          gather(out_candidates, retopk_ws->candidates(), rows * sizeof(int32_t)));
      KVRECALL_CUDA_RETURN_IF_ERROR(
          gather(out_sizes, retopk_ws->support_sizes(), rows * sizeof(int32_t)));
      KVRECALL_CUDA_RETURN_IF_ERROR(
          gather(out_best, retopk_ws->best_cosines(), rows * sizeof(float)));
      if (want_supports) {
        KVRECALL_CUDA_RETURN_IF_ERROR(
            gather(out_support, retopk_ws->supports(),
                   static_cast<size_t>(rows) * p.top_k * sizeof(int32_t)));
      }
    }
    return CudaStatus(cudaMemcpyAsync(host_out, dev_out, download, cudaMemcpyDeviceToHost, stream),
                      "downloading a decode step");
  };
  // A step whose queuing failed part-way may have left copies that still read pinned_in and
  // kernels that read its descriptors: the stream is drained before the failure is answered,
  // so that the next request's upload, written into the same pinned buffer, cannot race them.
  auto drained = [stream](absl::Status failure) {
    cudaStreamSynchronize(stream);  // its own error, if any, is the failure's
    return failure;
  };
  if (!cuda_graphs_) {
    if (absl::Status s = enqueue(); !s.ok()) return drained(s);
  } else {
    const GpuStepContext::StepGraphKey key{config, batch, max_tokens, want_supports};
    const cudaGraphExec_t exec = ctx.CapturedFor(key, enqueue);
    if (exec == nullptr) {
      if (absl::Status s = enqueue(); !s.ok()) return drained(s);
    } else if (absl::Status s =
                   CudaStatus(cudaGraphLaunch(exec, stream), "launching a captured decode step");
               !s.ok()) {
      ctx.DropGraph(key);  // captured anew by the next step that needs it
      return drained(s);
    }
  }
  KVRECALL_CUDA_RETURN_IF_ERROR(
      CudaStatus(cudaStreamSynchronize(stream), "running a decode step on the GPU"));
  // Device-side precondition violations would be this code's bug: every input was validated.
  // The word came down with the outputs; only when it is set does CheckAndClear (another
  // synchronization) say what it holds and clear it.
  if (*out.At<unsigned>(host_out, out_errors) != 0) {
    return ReportedErrors(errors, stream, "a decode step's kernels");
  }

  const float* host_o = out.At<float>(host_out, out_o);
  const float* host_lse = out.At<float>(host_out, out_lse);
  for (int b = 0; b < batch; ++b) {
    const LayerStep& step = steps[b];
    GpuLayer& layer = *static_cast<GpuLayer*>(step.layer);
    layer.kv().Commit(1);
    const int64_t n = layer.kv().tokens();
    std::memcpy(step.o, host_o + static_cast<int64_t>(b) * q_heads * d,
                static_cast<size_t>(q_heads) * d * sizeof(float));
    std::memcpy(step.lse, host_lse + b * q_heads, q_heads * sizeof(float));
    for (int h = 0; h < q_heads; ++h) {
      const int r = b * q_heads + h;
      HeadReport& report = step.heads[h];
      std::vector<int32_t>* support = step.supports != nullptr ? &step.supports[h] : nullptr;
      if (support != nullptr) support->clear();
      switch (p.kind) {
        case SelectorKind::kFull:
          report = HeadReport{SelectionPath::kExact, static_cast<int32_t>(n),
                              static_cast<int32_t>(n), 0.0f};
          if (support != nullptr) {
            support->resize(n);
            std::iota(support->begin(), support->end(), 0);
          }
          break;
        case SelectorKind::kStreaming: {
          const int64_t size = std::min<int64_t>(n, int64_t{p.sinks} + p.recent);
          report = HeadReport{SelectionPath::kExact, 0, static_cast<int32_t>(size), 0.0f};
          if (support != nullptr) AppendStaticSet(n, p.sinks, p.recent, support);
          break;
        }
        case SelectorKind::kExactTopK: {
          const int32_t size = out.At<int32_t>(host_out, out_sizes)[r];
          report = HeadReport{SelectionPath::kExact, static_cast<int32_t>(n), size, 0.0f};
          if (support != nullptr) {
            const int32_t* ids = out.At<int32_t>(host_out, out_support) + int64_t{r} * p.top_k;
            support->assign(ids, ids + size);
          }
          break;
        }
        default: {  // ReTopK
          const int32_t size = out.At<int32_t>(host_out, out_sizes)[r];
          report = HeadReport{static_cast<SelectionPath>(out.At<uint8_t>(host_out, out_paths)[r]),
                              out.At<int32_t>(host_out, out_candidates)[r], size,
                              out.At<float>(host_out, out_best)[r]};
          if (support != nullptr) {
            const int32_t* ids = out.At<int32_t>(host_out, out_support) + int64_t{r} * p.top_k;
            support->assign(ids, ids + size);
          }
          break;
        }
      }
    }
  }
  return absl::OkStatus();
}

absl::Status GpuBackend::Shadow(std::span<ShadowStep> steps, StepContext* context) {
  DeviceScope scope(ordinal_);
  if (!scope.status().ok()) return scope.status();
  auto& ctx = static_cast<GpuStepContext&>(*context);
  if (absl::Status s = ctx.Start(); !s.ok()) return s;
  cudaStream_t stream = ctx.stream();
  // One sequence at a time: the shadow is a diagnostic, and sequences may differ in shape.
  for (const ShadowStep& step : steps) {
    const GpuLayer& layer = *static_cast<const GpuLayer*>(step.layer);
    const LayerConfig& config = layer.config();
    const int q_heads = config.shape.q_heads;
    const int d = config.shape.head_dim;
    const int64_t n = layer.kv().tokens();
    const DecodeShape shape = ShapeOf(config, 1);
    absl::StatusOr<cuda::AttentionWorkspace*> attention_ws = ctx.AttentionWs(q_heads);
    if (!attention_ws.ok()) return attention_ws.status();
    absl::StatusOr<cuda::TopKWorkspace*> topk_ws = ctx.TopKWs(q_heads, n);
    if (!topk_ws.ok()) return topk_ws.status();
    Carver in(nullptr);
    const size_t in_q = in.Take<float>(static_cast<size_t>(q_heads) * d);
    const size_t in_seq = in.Take<DeviceSeq>(1);
    Carver out(nullptr);
    const size_t out_o = out.Take<float>(static_cast<size_t>(q_heads) * d);
    const size_t out_lse = out.Take<float>(q_heads);
    const size_t out_sizes = out.Take<int32_t>(q_heads);
    const size_t out_support = out.Take<int32_t>(static_cast<size_t>(q_heads) * step.top_k);
    const size_t out_topk_o = out.Take<float>(static_cast<size_t>(q_heads) * d);
    const size_t out_topk_lse = out.Take<float>(q_heads);
    if (absl::Status s = ctx.EnsureIo(in.size(), out.size(), out_topk_o); !s.ok()) return s;
    std::memcpy(in.At<float>(ctx.pinned_in(), in_q), step.q,
                static_cast<size_t>(q_heads) * d * sizeof(float));
    in.At<DeviceSeq>(ctx.pinned_in(), in_seq)[0] = layer.kv().Seq();
    std::byte* dev_in = ctx.device_in();
    std::byte* dev_out = ctx.device_out();
    KVRECALL_CUDA_RETURN_IF_ERROR(CudaStatus(
        cudaMemcpyAsync(dev_in, ctx.pinned_in(), in.size(), cudaMemcpyHostToDevice, stream),
        "uploading a shadow step"));
    const DeviceSeq* seq = in.At<DeviceSeq>(dev_in, in_seq);
    const float* q = in.At<float>(dev_in, in_q);
    KVRECALL_CUDA_RETURN_IF_ERROR(cuda::PartialAttentionOverSeqs(
        shape, seq, q, static_cast<int>(n), *attention_ws, out.At<float>(dev_out, out_o),
        out.At<float>(dev_out, out_lse), stream));
    KVRECALL_CUDA_RETURN_IF_ERROR(cuda::ExactTopKAttention(
        shape, seq, q, static_cast<int>(n), step.top_k, nullptr, *topk_ws,
        out.At<int32_t>(dev_out, out_support), out.At<int32_t>(dev_out, out_sizes),
        out.At<float>(dev_out, out_topk_o), out.At<float>(dev_out, out_topk_lse), stream));
    KVRECALL_CUDA_RETURN_IF_ERROR(CudaStatus(
        cudaMemcpyAsync(ctx.pinned_out(), dev_out, out_topk_o, cudaMemcpyDeviceToHost, stream),
        "downloading a shadow step"));
    KVRECALL_CUDA_RETURN_IF_ERROR(
        CudaStatus(cudaStreamSynchronize(stream), "running a shadow step on the GPU"));
    std::memcpy(step.o, out.At<float>(ctx.pinned_out(), out_o),
                static_cast<size_t>(q_heads) * d * sizeof(float));
    std::memcpy(step.lse, out.At<float>(ctx.pinned_out(), out_lse), q_heads * sizeof(float));
    for (int h = 0; h < q_heads; ++h) {
      const int32_t size = out.At<int32_t>(ctx.pinned_out(), out_sizes)[h];
      const int32_t* ids = out.At<int32_t>(ctx.pinned_out(), out_support) + int64_t{h} * step.top_k;
      step.exact_topk[h].assign(ids, ids + size);
    }
  }
  return absl::OkStatus();
}

// How the CUDA driver loads this process's kernels, as it decided when it initialized
// (CUDA_MODULE_LOADING), for the start-up log: "CUDA loads their kernels eagerly" (every kernel
// with the context) or "lazily" (each on its first launch, on the launching thread). Asked
// through the runtime's entry point, so that kvrecalld does not link the driver library itself.
std::string KernelLoading() {
  constexpr absl::string_view kUnknown = "the driver does not say how CUDA loads their kernels";
  void* entry = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  if (cudaGetDriverEntryPointByVersion("cuModuleGetLoadingMode", &entry, 11070,
                                       cudaEnableDefault, &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess || entry == nullptr) {
    cudaGetLastError();
    return std::string(kUnknown);
  }
  CUmoduleLoadingMode mode = CU_MODULE_LAZY_LOADING;
  if (reinterpret_cast<PFN_cuModuleGetLoadingMode_v11070>(entry)(&mode) != CUDA_SUCCESS) {
    return std::string(kUnknown);
  }
  switch (mode) {
    case CU_MODULE_EAGER_LOADING:
      return "CUDA loads their kernels eagerly";
    case CU_MODULE_LAZY_LOADING:
      return "CUDA loads their kernels lazily";
  }
  return absl::StrCat("CUDA loads their kernels in the driver's mode ", static_cast<int>(mode));
}

}  // namespace

absl::StatusOr<GpuBackends> MakeGpuBackends(const PlacementOptions& options) {
  GpuBackends out;
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    if (options.gpus.has_value() && !options.gpus->empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--gpus names CUDA devices, but this machine has none (", cudaGetErrorString(err), ")"));
    }
    cudaGetLastError();  // clear the sticky error of a machine without a driver
    out.unavailable = absl::StrCat("no CUDA device (", cudaGetErrorName(err), ": ",
                                   err == cudaSuccess ? "0 devices" : cudaGetErrorString(err),
                                   ")");
    return out;
  }
  std::vector<int> ordinals;
  if (options.gpus.has_value()) {
    ordinals = *options.gpus;
  } else {
    ordinals.resize(count);
    std::iota(ordinals.begin(), ordinals.end(), 0);
  }
  for (int ordinal : ordinals) {
    if (ordinal < 0 || ordinal >= count) {
      return absl::InvalidArgumentError(
          absl::StrCat("--gpus names device ", ordinal, ", but this machine has ", count,
                       " CUDA device(s): 0..", count - 1));
    }
    int64_t budget = 0;
    if (options.gpu_memory_budget_bytes.has_value()) {
      budget = *options.gpu_memory_budget_bytes;
    } else {
      KVRECALL_CUDA_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(ordinal), "cudaSetDevice"));
      size_t free_bytes = 0, total_bytes = 0;
      KVRECALL_CUDA_RETURN_IF_ERROR(
          CudaStatus(cudaMemGetInfo(&free_bytes, &total_bytes), "reading the device's memory"));
      // A headroom at or above the free memory would leave no budget: every gpu and tiered
      // session refused, with nothing said at startup.
      if (options.gpu_headroom_bytes >= static_cast<int64_t>(free_bytes)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--gpu_memory_headroom_gb leaves no budget on device ", ordinal, ": ",
            options.gpu_headroom_bytes, " bytes of headroom, ", free_bytes, " bytes free"));
      }
      budget = static_cast<int64_t>(free_bytes) - options.gpu_headroom_bytes;
    }
    auto backend = std::make_unique<GpuBackend>(ordinal, budget, options.cuda_graphs);
    // The tiered placement's static sets on the same device, charged to the same budget.
    absl::StatusOr<std::unique_ptr<StaticSetTier>> tier =
        MakeGpuStaticSetTier(ordinal, backend->device_budget(), options.cuda_graphs);
    if (!tier.ok()) return tier.status();
    out.tiered.push_back(
        std::make_unique<TieredBackend>(*std::move(tier), options.tiered_device_exact_share,
                                        options.tiered_device_exact_balance));
    out.backends.push_back(std::move(backend));
  }
  if (out.backends.empty()) {
    out.unavailable = "--gpus is empty";
    return out;
  }
  out.description = "GPU placements on device";
  if (ordinals.size() > 1) out.description += "s";
  for (size_t i = 0; i < ordinals.size(); ++i) {
    // (A log line: a device whose name cannot be read is still served.)
    cudaDeviceProp properties;
    const cudaError_t read = cudaGetDeviceProperties(&properties, ordinals[i]);
    absl::StrAppend(&out.description, i == 0 ? " " : ", ", ordinals[i], " (",
                    read == cudaSuccess ? properties.name : cudaGetErrorName(read), ")");
    if (read != cudaSuccess) cudaGetLastError();
  }
  absl::StrAppend(&out.description, "; ", KernelLoading());
  return out;
}


}  // namespace kvrecall
