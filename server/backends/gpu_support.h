// What the CUDA halves of the placements share (server/backends/gpu_backend.cc, the GPU-resident
// placement, and gpu_static_set.cc, the tiered placement's static set): the device scope of an
// entry point, pinned and budget-charged device buffers, a Decode stream's CUDA resources, and the
// packing of a step's arrays into one copy. CUDA builds only.
#ifndef KVRECALL_SERVER_BACKENDS_GPU_SUPPORT_H_
#define KVRECALL_SERVER_BACKENDS_GPU_SUPPORT_H_

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/decode_types.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/kernel_errors.h"
#include "kernels/cuda/partial_attention.h"
#include "kernels/cuda/retopk.h"
#include "kernels/cuda/topk_workspace.h"
#include "kernels/dtype.h"
#include "server/backends/attention_backend.h"
#include "server/backends/captured_step_charge.h"
#include "server/backends/step_runs.h"
#include "server/memory_budget.h"

namespace kvrecall::gpu {

using cuda::CudaStatus;
using cuda::DecodeShape;
using cuda::DeviceBuffer;
using cuda::DeviceSeq;
using cuda::KvDtype;

// Split-K partial states the full and streaming paths may use per row (flash-decoding):
// enough for a 1M-token history to spread over every multiprocessor.
inline constexpr int kMaxSplits = 512;

// Makes `ordinal` the calling thread's current device for the scope (every entry point of the
// backend runs on whichever thread gRPC gives it).
class DeviceScope {
 public:
  explicit DeviceScope(int ordinal)
      : status_(CudaStatus(cudaSetDevice(ordinal), "cudaSetDevice")) {}
  const absl::Status& status() const { return status_; }

 private:
  absl::Status status_;
};

// `check` (a cuda:: bound of the device's, say its shared memory) run with device `ordinal`
// current: its INVALID_ARGUMENT prefixed with `what` (the policy's value and where it is not
// served), for CheckConfig; any other failure as it is.
template <typename Check>
absl::Status CheckOnDevice(int ordinal, absl::string_view what, const Check& check) {
  DeviceScope scope(ordinal);
  if (!scope.status().ok()) return scope.status();
  absl::Status s = check();
  if (!absl::IsInvalidArgument(s)) return s;
  return absl::InvalidArgumentError(absl::StrCat(what, ": ", s.message()));
}

inline KvDtype KvDtypeOf(v1::DType dtype) {
  return dtype == v1::DTYPE_F16 ? KvDtype::kF16 : KvDtype::kBf16;
}
// The same as the element type of a KV view (kernels/dtype.h).
inline KvElement KvElementOf(v1::DType dtype) {
  return dtype == v1::DTYPE_F16 ? KvElement::kF16 : KvElement::kBf16;
}

inline int64_t RowElems(const LayerConfig& config) {
  return int64_t{config.shape.kv_heads} * config.shape.head_dim;
}

inline DecodeShape ShapeOf(const LayerConfig& config, int batch) {
  return DecodeShape{batch,
                     config.shape.q_heads,
                     config.shape.kv_heads,
                     config.shape.head_dim,
                     KvDtypeOf(config.dtype),
                     config.shape.scale};
}

// Device bytes of the KV of `tokens` tokens: keys and values, 2 bytes an element.
inline int64_t KvBytes(const LayerConfig& config, int64_t tokens) {
  return 2 * tokens * RowElems(config) * 2;
}

// The size a buffer of `held` bytes grows to when `bytes` are needed: by half at least, so that
// a growing batch or history reallocates it rarely.
inline size_t GrownBytes(size_t held, size_t bytes) { return std::max(bytes, held + held / 2); }

// Pinned host memory, for the asynchronous copies of prompts and steps.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  ~PinnedBuffer() { Free(); }

  // At least `bytes`, the content not kept; charged to `account` (may be null).
  absl::Status Ensure(size_t bytes, MemoryAccount* account, absl::string_view what) {
    if (bytes <= bytes_) return absl::OkStatus();
    Free();
    const size_t grown = GrownBytes(bytes_, bytes);
    if (account != nullptr) {
      if (absl::Status s = account->Reserve(static_cast<int64_t>(grown), what); !s.ok()) return s;
    }
    void* ptr = nullptr;
    absl::Status s = CudaStatus(cudaHostAlloc(&ptr, grown, cudaHostAllocDefault),
                                absl::StrCat("allocating ", grown, " pinned bytes for ", what));
    if (!s.ok()) {
      if (account != nullptr) account->Release(static_cast<int64_t>(grown));
      return s;
    }
    data_ = static_cast<std::byte*>(ptr);
    bytes_ = grown;
    account_ = account;
    return absl::OkStatus();
  }
  std::byte* data() const { return data_; }
  size_t bytes() const { return bytes_; }

 private:
  void Free() {
    if (data_ != nullptr) cudaFreeHost(data_);
    if (account_ != nullptr) account_->Release(static_cast<int64_t>(bytes_));
    data_ = nullptr;
    bytes_ = 0;
    account_ = nullptr;
  }
  std::byte* data_ = nullptr;
  size_t bytes_ = 0;
  MemoryAccount* account_ = nullptr;
};

// Device memory charged to a MemoryAccount for as long as it lives.
template <typename T>
class ChargedBuffer {
 public:
  ChargedBuffer() = default;
  ChargedBuffer(ChargedBuffer&& other) noexcept { *this = std::move(other); }
  ChargedBuffer& operator=(ChargedBuffer&& other) noexcept {
    if (this != &other) {
      Free();
      buffer_ = std::move(other.buffer_);
      account_ = std::exchange(other.account_, nullptr);
    }
    return *this;
  }
  ~ChargedBuffer() { Free(); }

  // `count` zeroed elements, the previous content freed; RESOURCE_EXHAUSTED naming `what`.
  absl::Status Allocate(size_t count, MemoryAccount* account, absl::string_view what) {
    return Charge(count, account, what, &DeviceBuffer<T>::Zeroed);
  }
  // The same, not zeroed (DeviceBuffer::ForOverwrite): for staging whose every element is
  // written before any is read.
  absl::Status AllocateForOverwrite(size_t count, MemoryAccount* account,
                                    absl::string_view what) {
    return Charge(count, account, what, &DeviceBuffer<T>::ForOverwrite);
  }
  void Free() {
    if (account_ != nullptr) account_->Release(static_cast<int64_t>(buffer_.bytes()));
    buffer_ = DeviceBuffer<T>();
    account_ = nullptr;
  }
  T* data() const { return buffer_.data(); }
  size_t size() const { return buffer_.size(); }
  size_t bytes() const { return buffer_.bytes(); }

 private:
  // Allocate's and AllocateForOverwrite's: reserves the bytes, then makes the buffer with
  // `make` (DeviceBuffer's Zeroed or ForOverwrite), the reservation given back if it fails.
  absl::Status Charge(size_t count, MemoryAccount* account, absl::string_view what,
                      absl::StatusOr<DeviceBuffer<T>> (*make)(size_t)) {
    Free();
    const int64_t bytes = static_cast<int64_t>(count * sizeof(T));
    if (absl::Status s = account->Reserve(bytes, what); !s.ok()) return s;
    absl::StatusOr<DeviceBuffer<T>> fresh = make(count);
    if (!fresh.ok()) {
      account->Release(bytes);
      return fresh.status();
    }
    buffer_ = *std::move(fresh);
    account_ = account;
    return absl::OkStatus();
  }

  DeviceBuffer<T> buffer_;
  MemoryAccount* account_ = nullptr;
};

// INVALID_ARGUMENT naming the geometry field when the KV of `config` cannot live on a GPU: the
// kernels keep it in the model's dtype (bf16 or f16) and serve head dims 64 and 128.
// `served_by` names the placement ("PLACEMENT_GPU"), `what` what it keeps there ("the KV").
inline absl::Status CheckGpuKv(const LayerConfig& config, absl::string_view served_by,
                               absl::string_view what) {
  if (config.dtype != v1::DTYPE_BF16 && config.dtype != v1::DTYPE_F16) {
    return absl::InvalidArgumentError(absl::StrCat(
        "geometry.dtype ", v1::DType_Name(config.dtype), " is not served by ", served_by,
        ", which keeps ", what, " in the model's dtype: use DTYPE_BF16 or DTYPE_F16 (or "
        "PLACEMENT_CPU for f32)"));
  }
  if (config.shape.head_dim != 64 && config.shape.head_dim != 128) {
    return absl::InvalidArgumentError(absl::StrCat("geometry.head_dim ", config.shape.head_dim,
                                                   " is not served by ", served_by,
                                                   ": its kernels serve 64 and 128"));
  }
  return absl::OkStatus();
}

// Whether two layers can step in one launch sequence: the same kernels with the same knobs.
inline bool SameKernels(const LayerConfig& a, const LayerConfig& b) {
  const SelectorParams& x = a.selector;
  const SelectorParams& y = b.selector;
  if (a.shape.q_heads != b.shape.q_heads || a.shape.kv_heads != b.shape.kv_heads ||
      a.shape.head_dim != b.shape.head_dim || a.shape.scale != b.shape.scale ||
      a.dtype != b.dtype || x.kind != y.kind) {
    return false;
  }
  switch (x.kind) {
    case SelectorKind::kExactTopK:
      return x.top_k == y.top_k;
    case SelectorKind::kStreaming:
      return x.sinks == y.sinks && x.recent == y.recent;
    case SelectorKind::kReTopK:
      return x.top_k == y.top_k && x.retopk.cache_capacity == y.retopk.cache_capacity &&
             x.retopk.reuse_neighbors == y.retopk.reuse_neighbors &&
             x.retopk.recent_window == y.retopk.recent_window &&
             x.retopk.refresh_interval == y.retopk.refresh_interval;
    default:
      return true;
  }
}

namespace internal {

// `enqueue`'s work on `stream` captured into an executable graph, or null when it cannot be
// captured (the step then runs eagerly: the reason goes to stderr once per process). Not for
// callers: a kept graph holds device memory no budget sees (CaptureChargedStep charges it).
template <typename Enqueue>
cudaGraphExec_t CaptureStep(cudaStream_t stream, const Enqueue& enqueue) {
  absl::Status status = CudaStatus(
      cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "beginning a capture");
  cudaGraph_t graph = nullptr;
  if (status.ok()) {
    status = enqueue();
    // Ended whatever enqueue said, so that the stream leaves capture mode.
    absl::Status ended = CudaStatus(cudaStreamEndCapture(stream, &graph), "ending a capture");
    if (status.ok()) status = ended;
  }
  cudaGraphExec_t exec = nullptr;
  // (Update, not an assignment: nvcc's front end warns of the discarded Status& of one, and
  // tests/gpu_support_test.cu compiles this header with it.)
  if (status.ok()) {
    status.Update(
        CudaStatus(cudaGraphInstantiate(&exec, graph, 0), "instantiating a captured step"));
  }
  if (graph != nullptr) cudaGraphDestroy(graph);
  if (!status.ok()) {
    cudaGetLastError();  // a failed capture leaves no sticky error behind
    exec = nullptr;
    static std::once_flag said;
    std::call_once(said, [&] {
      std::fprintf(stderr, "kvrecalld: a decode step could not be captured in a CUDA graph (%s); "
                   "such steps run eagerly\n", std::string(status.message()).c_str());
    });
  }
  return exec;
}

}  // namespace internal

// An executable captured step and its charge, destroyed and given back together. Move-only;
// empty: no step (its capture refused or failed).
class CapturedStep {
 public:
  CapturedStep() = default;
  CapturedStep(cudaGraphExec_t exec, MemoryAccount* account) : exec_(exec), account_(account) {}
  CapturedStep(CapturedStep&& other) noexcept { *this = std::move(other); }
  CapturedStep& operator=(CapturedStep&& other) noexcept {
    if (this != &other) {
      Reset();
      exec_ = std::exchange(other.exec_, nullptr);
      account_ = std::exchange(other.account_, nullptr);
    }
    return *this;
  }
  ~CapturedStep() { Reset(); }

  cudaGraphExec_t get() const { return exec_; }
  void Reset() {
    if (exec_ != nullptr) cudaGraphExecDestroy(exec_);
    if (account_ != nullptr) account_->Release(kCapturedStepDeviceBytes);
    exec_ = nullptr;
    account_ = nullptr;
  }

 private:
  cudaGraphExec_t exec_ = nullptr;
  MemoryAccount* account_ = nullptr;
};

// `enqueue`'s work captured (internal::CaptureStep) and charged to `account`: empty, nothing
// charged, when the account has no room for it (nothing is captured then) or the capture failed.
template <typename Enqueue>
CapturedStep CaptureChargedStep(cudaStream_t stream, MemoryAccount* account,
                                const Enqueue& enqueue) {
  if (absl::Status s = account->Reserve(kCapturedStepDeviceBytes, "a captured decode step");
      !s.ok()) {
    static std::once_flag said;
    std::call_once(said, [&] {
      std::fprintf(stderr,
                   "kvrecalld: a decode step was not captured in a CUDA graph (%s); such steps "
                   "run eagerly until there is room\n",
                   std::string(s.message()).c_str());
    });
    return {};
  }
  const cudaGraphExec_t exec = internal::CaptureStep(stream, enqueue);
  if (exec == nullptr) {
    account->Release(kCapturedStepDeviceBytes);
    return {};
  }
  return CapturedStep(exec, account);
}

// A context's captured step for one key: the step (empty: it runs eagerly), the lookup it was
// last used at, and, when empty, the lookup from which it is captured again.
struct KeptStep {
  CapturedStep step;
  uint64_t last_run = 0;
  uint64_t retry_at = 0;
  // Kept as it is at lookup `run`: a step, or an empty one not yet due for another try.
  bool Usable(uint64_t run) const { return step.get() != nullptr || run < retry_at; }
  static KeptStep Of(CapturedStep step, uint64_t run) {
    const uint64_t retry_at = step.get() == nullptr ? run + kCaptureRetryRuns : 0;
    return KeptStep{std::move(step), run, retry_at};
  }
};

// A Decode stream's resources on one device. Buffers grow to the largest batch and history the
// stream has seen and are charged while the stream lives: the device's to the device's budget,
// the pinned host buffers the steps are copied through to `host` (the stream's tenant's host
// budget or the server's; null: nowhere, for tests), since page-locked memory is host memory
// no other use can take back.
class GpuStepContext final : public StepContext {
 public:
  GpuStepContext(int ordinal, MemoryBudget* budget, MemoryAccount* host)
      : ordinal_(ordinal), budget_(budget), host_(host) {}
  ~GpuStepContext() override {
    DeviceScope scope(ordinal_);
    DropGraphs();
    if (stream_ != nullptr) {
      cudaStreamSynchronize(stream_);
      cudaStreamDestroy(stream_);
    }
    attention_ws_.reset();
    topk_ws_.reset();
    retopk_ws_.reset();
    budget_->Release(workspace_bytes_);
  }

  absl::Status Start() {
    if (stream_ != nullptr) return absl::OkStatus();
    return CudaStatus(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
                      "creating a decode stream");
  }
  cudaStream_t stream() const { return stream_; }
  StepRuns runs;  // the backend's scratch for splitting a request into launches

  // Room for `in_bytes` of step input on both sides, `out_bytes` of output on the device and the
  // first `download_bytes` of it (at most out_bytes) in pinned host memory: what the kernels
  // write but the host never reads (supports, unless compare_exact asks for them) takes no
  // page-locked memory.
  absl::Status EnsureIo(size_t in_bytes, size_t out_bytes, size_t download_bytes) {
    // Growing a buffer reallocates it, so it drops the graphs first, as the workspaces do.
    // (Addresses would not tell: a new allocation often gets the freed one's address, and a
    // graph's copy nodes still name the freed allocation; cuGraphLaunch then crashed.)
    if (pinned_in_.bytes() < in_bytes || pinned_out_.bytes() < download_bytes ||
        device_in_.bytes() < in_bytes || device_out_.bytes() < out_bytes) {
      DropGraphs();
    }
    if (absl::Status s = pinned_in_.Ensure(in_bytes, host_, "a decode step's pinned input");
        !s.ok()) {
      return s;
    }
    if (absl::Status s = pinned_out_.Ensure(download_bytes, host_, "a decode step's pinned output");
        !s.ok()) {
      return s;
    }
    if (device_in_.bytes() < in_bytes) {
      if (absl::Status s = device_in_.Allocate(GrownBytes(device_in_.bytes(), in_bytes), budget_,
                                               "a step's input");
          !s.ok()) {
        return s;
      }
    }
    if (device_out_.bytes() < out_bytes) {
      if (absl::Status s = device_out_.Allocate(GrownBytes(device_out_.bytes(), out_bytes), budget_,
                                                "a step's output");
          !s.ok()) {
        return s;
      }
    }
    return absl::OkStatus();
  }
  // Where the stream's host-side buffers are charged (the constructor's `host`; may be null).
  MemoryAccount* host_account() const { return host_; }
  // Changes whenever a buffer or workspace of this context is reallocated: what a graph captured
  // elsewhere (the tiered placement's static sets) keys on, since a new allocation may reuse a
  // freed one's address.
  uint64_t generation() const { return generation_; }
  std::byte* pinned_in() const { return pinned_in_.data(); }
  std::byte* pinned_out() const { return pinned_out_.data(); }
  std::byte* device_in() const { return device_in_.data(); }
  std::byte* device_out() const { return device_out_.data(); }

  absl::StatusOr<cuda::AttentionWorkspace*> AttentionWs(int rows) {
    if (attention_ws_ == nullptr || attention_ws_->max_rows() < rows) {
      const int64_t bytes = cuda::AttentionWorkspace::DeviceBytesFor(rows, kMaxSplits);
      KVRECALL_CUDA_RETURN_IF_ERROR(
          Remake(&attention_ws_, &attention_bytes_, bytes, "a decode workspace",
                 [&] { return cuda::AttentionWorkspace::Create(rows, kMaxSplits); }));
    }
    return attention_ws_.get();
  }
  absl::StatusOr<cuda::TopKWorkspace*> TopKWs(int rows, int64_t tokens) {
    if (topk_ws_ == nullptr || topk_ws_->max_rows() < rows || topk_ws_->max_tokens() < tokens) {
      // Grown with slack in the history so that a growing session does not re-create it often.
      const int64_t want_tokens =
          std::min<int64_t>(INT32_MAX / 2, std::max<int64_t>(tokens, tokens + tokens / 4));
      const int want_rows = std::max(rows, topk_ws_ != nullptr ? topk_ws_->max_rows() : 0);
      const int64_t bytes =
          cuda::TopKWorkspace::DeviceBytesFor(want_rows, static_cast<int>(want_tokens));
      KVRECALL_CUDA_RETURN_IF_ERROR(Remake(
          &topk_ws_, &topk_bytes_, bytes, "a top-K workspace",
          [&] { return cuda::TopKWorkspace::Create(want_rows, static_cast<int>(want_tokens)); }));
    }
    return topk_ws_.get();
  }
  absl::StatusOr<cuda::ReTopKWorkspace*> ReTopKWs(const LayerConfig& config, int batch,
                                                  int64_t tokens) {
    const SelectorParams& p = config.selector;
    if (retopk_ws_ == nullptr || retopk_ws_->max_batch() < batch ||
        retopk_ws_->max_tokens() < tokens || !SameKernels(retopk_config_, config)) {
      const int64_t want_tokens =
          std::min<int64_t>(INT32_MAX / 2, std::max<int64_t>(tokens, tokens + tokens / 4));
      const int want_batch =
          std::max(batch, retopk_ws_ != nullptr && SameKernels(retopk_config_, config)
                              ? retopk_ws_->max_batch()
                              : 0);
      const DecodeShape shape = ShapeOf(config, want_batch);
      const int64_t bytes = cuda::ReTopKWorkspace::DeviceBytesFor(shape, p.top_k, p.retopk,
                                                                  static_cast<int>(want_tokens));
      KVRECALL_CUDA_RETURN_IF_ERROR(
          Remake(&retopk_ws_, &retopk_bytes_, bytes, "a ReTopK workspace", [&] {
            return cuda::ReTopKWorkspace::Create(shape, p.top_k, p.retopk,
                                                 static_cast<int>(want_tokens));
          }));
      retopk_config_ = config;
    }
    return retopk_ws_.get();
  }

  // What a captured step's launches bake in besides this context's buffers: the kernels and
  // their knobs (SameKernels), the batch, the history bound the launches were planned for and
  // whether the supports come down. Everything else a step varies (queries, new tokens, the
  // sequences' lengths and KV addresses, ReTopK's caches) travels in the packed upload.
  struct StepGraphKey {
    LayerConfig config;
    int batch = 0;
    int64_t max_tokens = 0;
    bool supports = false;
    bool Matches(const StepGraphKey& other) const {
      return batch == other.batch && max_tokens == other.max_tokens &&
             supports == other.supports && SameKernels(config, other.config);
    }
  };
  // The captured step for `key`: the one kept, else `enqueue` captured on the stream and
  // charged to the budget (CaptureChargedStep), the oldest kept dropped beyond kMaxGraphs. Null
  // when it could not be captured (the step then runs eagerly; tried again after
  // kCaptureRetryRuns lookups).
  template <typename Enqueue>
  cudaGraphExec_t CapturedFor(const StepGraphKey& key, const Enqueue& enqueue) {
    ++graph_runs_;
    for (auto it = graphs_.begin(); it != graphs_.end(); ++it) {
      if (!it->key.Matches(key)) continue;
      if (it->kept.Usable(graph_runs_)) return it->kept.step.get();
      graphs_.erase(it);  // an empty step due for another try
      break;
    }
    if (graphs_.size() >= kMaxGraphs) graphs_.erase(graphs_.begin());
    graphs_.push_back(
        StepGraph{key, KeptStep::Of(CaptureChargedStep(stream_, budget_, enqueue), graph_runs_)});
    return graphs_.back().kept.step.get();
  }
  // Drops the step kept for `key` (its launch failed): captured anew by the next step.
  void DropGraph(const StepGraphKey& key) {
    for (auto it = graphs_.begin(); it != graphs_.end(); ++it) {
      if (it->key.Matches(key)) {
        graphs_.erase(it);
        return;
      }
    }
  }

 private:
  // A few shapes of request per stream: batch sizes and history bounds in use.
  static constexpr size_t kMaxGraphs = 8;
  struct StepGraph {
    StepGraphKey key;
    KeptStep kept;
  };
  // Graphs name the step buffers and workspaces by address: any reallocation drops them all.
  void DropGraphs() {
    graphs_.clear();
    ++generation_;
  }

  // Replaces *ws by create()'s workspace of `bytes` device bytes, charged in *held. The old one
  // is freed first (its bytes may be what the new one needs: a growing session's workspace
  // holds most of them), and its charge moves to the new one's in one step (no other stream
  // can take the bytes between), so that the charge follows what is allocated whatever fails:
  // 0 after the budget's refusal or a failed allocation, `bytes` after success.
  template <typename Workspace, typename Create>
  absl::Status Remake(std::unique_ptr<Workspace>* ws, int64_t* held, int64_t bytes,
                      absl::string_view what, Create create) {
    DropGraphs();
    ws->reset();
    if (absl::Status s = Recharge(held, bytes, what); !s.ok()) {
      (void)Recharge(held, 0, what);  // a release, which cannot fail
      return s;
    }
    absl::StatusOr<std::unique_ptr<Workspace>> made = create();
    if (!made.ok()) {
      (void)Recharge(held, 0, what);
      return made.status();
    }
    *ws = *std::move(made);
    return absl::OkStatus();
  }

  // Moves the charge *held from its old value to `bytes` (RESOURCE_EXHAUSTED: nothing changed).
  absl::Status Recharge(int64_t* held, int64_t bytes, absl::string_view what) {
    if (bytes > *held) {
      if (absl::Status s = budget_->Reserve(bytes - *held, what); !s.ok()) return s;
    } else {
      budget_->Release(*held - bytes);
    }
    workspace_bytes_ += bytes - *held;
    *held = bytes;
    return absl::OkStatus();
  }

  const int ordinal_;
  MemoryBudget* const budget_;
  MemoryAccount* const host_;
  cudaStream_t stream_ = nullptr;
  PinnedBuffer pinned_in_;
  PinnedBuffer pinned_out_;
  ChargedBuffer<std::byte> device_in_;
  ChargedBuffer<std::byte> device_out_;
  std::unique_ptr<cuda::AttentionWorkspace> attention_ws_;
  std::unique_ptr<cuda::TopKWorkspace> topk_ws_;
  std::unique_ptr<cuda::ReTopKWorkspace> retopk_ws_;
  LayerConfig retopk_config_;
  int64_t attention_bytes_ = 0, topk_bytes_ = 0, retopk_bytes_ = 0;
  int64_t workspace_bytes_ = 0;  // the sum of the three, charged to budget_
  std::vector<StepGraph> graphs_;
  uint64_t graph_runs_ = 0;  // CapturedFor's lookups
  uint64_t generation_ = 0;  // see generation()
};

// Carves aligned arrays out of one contiguous buffer (the packed input or output of a step), so
// that one copy moves them all.
class Carver {
 public:
  explicit Carver(std::byte* base) : base_(base) {}
  template <typename T>
  size_t Take(size_t count) {
    offset_ = (offset_ + 15) / 16 * 16;
    const size_t at = offset_;
    offset_ += count * sizeof(T);
    return at;
  }
  size_t size() const { return offset_; }
  template <typename T>
  T* At(std::byte* base, size_t offset) const {
    return reinterpret_cast<T*>(base + offset);
  }

 private:
  std::byte* base_;
  size_t offset_ = 0;
};

// The bound a captured step is planned for: `tokens` rounded up to a sixteenth of its power of
// two (at least 256 tokens), so that a growing session captures again after ~6 % of growth and
// its launches plan for at most ~6 % more keys than there are. The gpu placement bounds its
// histories so, the tiered placement its shortlists' scans (CapturedScanBound).
inline int64_t GraphTokenBound(int64_t tokens) {
  int64_t bucket = 256;
  while (bucket * 32 <= tokens) bucket *= 2;
  const int64_t rounded = (tokens + bucket - 1) / bucket * bucket;
  return std::max(tokens, std::min<int64_t>(INT32_MAX / 2, rounded));
}

// The scan bound of a captured step whose shortlist scans `coded` rows of codes with room for
// `capacity` (>= coded): planned for the row the next step will scan too, so that the bound
// moves (and the step is captured again) on the step that reaches a bucket's end rather than
// the one after. The take-overs of a model's layer 0 whose codes were first learned at 1024
// rows come at bucket ends (1536, 3072, ... rows): such a step, captured anyway for the new
// codes, plans the next bucket, and the step after it is not captured once more (d117: 45 +
// ~140 + 92 us to destroy, capture and instantiate; d119). Layer l takes over l rows later
// (CodesLearning::TakeOverAt), within the next bucket: where it had codes before, the bound's
// move and the take-over are two captures. 0 rows: 0 (no scan).
inline int64_t CapturedScanBound(int64_t coded, int64_t capacity) {
  return coded > 0 ? std::min(capacity, GraphTokenBound(coded + 1)) : 0;
}

// INTERNAL naming `who` and what `errors` holds, once its word came down set: device-side
// violations of preconditions are this code's bug, since every input was validated.
// CheckAndClear synchronizes `stream` to say which, and clears the word.
inline absl::Status ReportedErrors(const cuda::KernelErrors& errors, cudaStream_t stream,
                                   absl::string_view who) {
  absl::Status s = errors.CheckAndClear(stream);
  if (s.ok()) s.Update(absl::InternalError("the kernels' error word was set, then read as clear"));
  // A late host (UNAVAILABLE) failed the step without any fault of its inputs or this code's:
  // the runner may resend it. Anything else the kernels report is this code's bug.
  if (absl::IsUnavailable(s)) {
    return absl::UnavailableError(
        absl::StrCat(who, " reported: ", s.message(), "; the step may be resent"));
  }
  return absl::InternalError(absl::StrCat(who, " reported: ", s.message()));
}

}  // namespace kvrecall::gpu

#endif  // KVRECALL_SERVER_BACKENDS_GPU_SUPPORT_H_
