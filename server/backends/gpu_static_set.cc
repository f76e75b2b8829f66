// The tiered placement's static sets on a CUDA device: per layer, `sinks + recent` slots of keys
// and values in the session's dtype — the first `sinks` tokens, then a ring of the last
// `recent` — which the kernels of kernels/cuda/partial_attention.h read as a DeviceSeq (head +
// ring). A step of a batch is one packed upload (queries, new rows, descriptors), the append
// kernel, split-K attention over every static set and one packed download, all queued on the
// Decode stream's CUDA stream in Start (with policy.index.shortlist, the shortlists first and
// their ids published to the host, then the codes of the step's new bulk rows, read from the
// ring slots the append overwrites); Finish waits for it. All of it is kernels (bar the memset
// of a step with no coded rows yet): kernels/cuda/step_io.h moves the bytes and stamps the times,
// since a captured step's launch pays ~2 us of host time for each event or copy node, ~0.1 us
// for a kernel node (d40-d45).
//
// A step may also run some query heads' exact paths here (StaticSetStep::device_heads):
// cuda::CandidateAttention reads the bulk's rows from the layer's host KV, registered with the
// device (CudaHostPinning), over PCIe, right after the shortlists, while the static sets run on a
// side stream beside it; the host's threads take the other heads meanwhile
// (bench/results/pcie_gather.md: 16 of 32 heads so cut the bulk's host part 1.7x at 128K and
// 512K on the H200 machine). A launch is planned for each step's bound of such heads, and the
// heads themselves travel in the upload, so that a captured step serves whichever heads
// ReTopK's paths send; their supports come down with the step when it asks for them.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/casts.h"
#include "absl/container/flat_hash_map.h"
#include "absl/memory/memory.h"
#include "absl/strings/str_cat.h"
#include "index/basic_selectors.h"
#include "index/gpu_batch_topk.h"
#include "index/gpu_pq_assigner.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/spin_wait.h"
#include "kernels/cuda/candidate_attention.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/kv_write.h"
#include "kernels/cuda/partial_attention.h"
#include "kernels/cuda/pq_encode.h"
#include "kernels/cuda/pq_shortlist.h"
#include "kernels/cuda/step_io.h"
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
using gpu::ReportedErrors;
using gpu::RowElems;
using gpu::ShapeOf;

int Slots(const LayerConfig& config) { return config.selector.sinks + config.selector.recent; }

// How long a step's exact heads wait on the device for the host to name them (SetExactHeads)
// before they give up and fail the step (kErrorHostWordsLate): the host names them some tens of
// microseconds after the launch (its decisions), or gives none when it fails first; this bounds
// what a host that did neither costs the stream.
constexpr uint64_t kExactHeadsTimeoutNs = 1'000'000'000;

// The T at `offset` bytes into a step's upload or download (`base`: host or device side).
template <typename T>
T* At(std::byte* base, size_t offset) {
  return reinterpret_cast<T*>(base + offset);
}

// The slot of token position p.
int64_t SlotOf(const LayerConfig& config, int64_t p) {
  const int sinks = config.selector.sinks;
  return p < sinks ? p : sinks + (p - sinks) % config.selector.recent;
}

// Host memory registered with CUDA on device `ordinal` (mapped, portable to every device's
// context, read-only for the device where it supports that), so that kernels read a layer's
// host KV through its own address (unified addressing). One per device for the process: layers
// may outlive the tier that pinned them.
class CudaHostPinning final : public HostPinning {
 public:
  static CudaHostPinning* Get(int ordinal) {
    static auto* const pinnings = new absl::flat_hash_map<int, CudaHostPinning*>();
    static std::mutex making;
    const std::lock_guard<std::mutex> lock(making);
    CudaHostPinning*& pinning = (*pinnings)[ordinal];
    if (pinning == nullptr) pinning = new CudaHostPinning(ordinal);
    return pinning;
  }
  absl::Status Pin(void* data, size_t bytes) override {
    // On the tier's device, whichever thread builds the layer (another device's context would
    // be created for nothing, and refused under exclusive-process mode).
    DeviceScope scope(ordinal_);
    if (!scope.status().ok()) return scope.status();
    int read_only = 0;
    cudaDeviceGetAttribute(&read_only, cudaDevAttrHostRegisterReadOnlySupported, ordinal_);
    const unsigned flags = cudaHostRegisterMapped | cudaHostRegisterPortable |
                           (read_only != 0 ? cudaHostRegisterReadOnly : 0u);
    return CudaStatus(cudaHostRegister(data, bytes, flags),
                      absl::StrCat("pinning ", bytes, " bytes of host KV for the device"));
  }
  void Unpin(void* data) override {
    DeviceScope scope(ordinal_);
    if (const cudaError_t e = cudaHostUnregister(data); e != cudaSuccess) {
      std::fprintf(stderr, "kvrecalld: unpinning host KV: %s\n", cudaGetErrorString(e));
    }
  }

 private:
  explicit CudaHostPinning(int ordinal) : ordinal_(ordinal) {}
  const int ordinal_;
};

// The outliers' stride of a step's upload: the most any KV head of `codes` has, rounded up to
// 512, so that a captured step with them is captured again only after that many more.
int64_t OutlierStride(const BulkCodes& codes) {
  size_t most = 0;
  for (int h = 0; h < codes.kv_heads(); ++h) most = std::max(most, codes.outliers(h).size());
  return std::max<int64_t>(512, (static_cast<int64_t>(most) + 511) / 512 * 512);
}

// The bounds of a step's exact heads on the device (cuda::CandidateAttention): the shortlist,
// the outliers' stride, and one uncoded row (a step codes the one row its token pushes out of
// the ring, after the shortlists; GpuStaticSetTier::Prepare holds the codes to that).
cuda::CandidateLists ExactHeadBounds(const LayerConfig& config, int64_t outlier_stride) {
  cuda::CandidateLists lists;
  lists.shortlist_stride = config.selector.shortlist;
  lists.outlier_stride = static_cast<int>(outlier_stride);
  lists.max_uncoded = 1;
  return lists;
}

class GpuStaticSet final : public StaticSet {
 public:
  GpuStaticSet(int ordinal, ChargedBuffer<uint16_t> keys, ChargedBuffer<uint16_t> values)
      : ordinal_(ordinal), keys_(std::move(keys)), values_(std::move(values)) {}
  // The last holder of a session may drop it on any thread, whose current device may be another
  // (--gpus without 0): the buffers are freed on their own device (DeviceScope stays set for
  // the members' destructors, which run after this body).
  ~GpuStaticSet() override { DeviceScope scope(ordinal_); }
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
  const int ordinal_;
  ChargedBuffer<uint16_t> keys_;
  ChargedBuffer<uint16_t> values_;
};

// The bulk's codes in device memory ([kv_heads, capacity, M] u8, and the codebooks [kv_heads, M,
// 256, head_dim / M] f32), scanned by kernels/cuda/pq_shortlist.h. The prompt's bulk and the keys
// joining the bulk (one token a step, the one leaving the static set's ring) are coded on the
// device (kernels/cuda/pq_encode.h), the latter inside the step's launches.
class GpuBulkCodes final : public BulkCodes {
 public:
  // Freed on its own device, whichever thread drops it (as ~GpuStaticSet).
  ~GpuBulkCodes() override { DeviceScope scope(ordinal_); }

  // On device `ordinal`, which the calling thread has made current.
  static absl::StatusOr<std::unique_ptr<GpuBulkCodes>> Create(
      int ordinal, const KvView& bulk, const SessionAccounts& accounts, int64_t capacity,
      const BuildStop& stop) {
    absl::StatusOr<std::vector<ProductQuantizer>> quantizers =
        TrainOnDevice(bulk, accounts, stop);
    if (!quantizers.ok()) return quantizers.status();
    auto codes =
        absl::WrapUnique(new GpuBulkCodes(ordinal, *std::move(quantizers), accounts));
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
    // (Landed when this returns: a pageable cudaMemcpy may return before its bytes do, and the
    // steps' streams, non-blocking, would not wait for them where no row is coded below.)
    if (absl::Status s = cuda::CopyToDevice(codes->codebooks_.data(), books.data(),
                                            books.size() * sizeof(float),
                                            "uploading the shortlist's codebooks");
        !s.ok()) {
      return s;
    }
    if (absl::Status s = codes->Reserve(std::max(capacity, bulk.tokens)); !s.ok()) return s;
    if (absl::Status s = codes->CodeRowsUnless(stop, bulk); !s.ok()) return s;
    codes->learned_rows_ = bulk.tokens;
    return codes;
  }
  int64_t device_bytes() const override {
    return static_cast<int64_t>(codebooks_.bytes() + codes_.bytes());
  }
  // Grows the codes (doubling) into a new allocation, the coded rows copied over.
  absl::Status Reserve(int64_t rows) override {
    if (rows <= capacity_) return absl::OkStatus();
    // From whichever thread reserves the session's next token.
    DeviceScope scope(ordinal_);
    if (!scope.status().ok()) return scope.status();
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
    generation_ = next_generation_.fetch_add(1, std::memory_order_relaxed);
    return absl::OkStatus();
  }
  int64_t capacity() const { return capacity_; }
  // Changes whenever the codes move, and no two allocations of codes share one, whichever
  // object holds them (a captured step names them by address; a layer's relearned codes may
  // take the address of codes freed before).
  uint64_t generation() const { return generation_; }
  // Rows of `bulk` not coded yet: 1 in a step whose token pushes one out of the ring, else 0.
  int64_t Pending(const KvView& bulk) const { return std::max<int64_t>(0, bulk.tokens - coded_); }
  // The jobs ([kv_heads], host memory) that code row coded() on the device from `key_row` (the
  // row's keys, [kv_heads, head_dim] of the KV dtype in device memory: the ring slot it leaves),
  // each KV head's squared reconstruction error to errors[h] (device). Reserve made room; the
  // row counts as coded once MarkRowCoded says the jobs were queued (or launched).
  void NewRowJobs(const uint16_t* key_row, int head_dim, float* errors,
                  cuda::PqEncodeJob* jobs) const {
    const int64_t book_floats = int64_t{ProductQuantizer::kCentroids} * head_dim;
    for (int h = 0; h < kv_heads(); ++h) {
      jobs[h] = cuda::PqEncodeJob{key_row + int64_t{h} * head_dim,
                                  codebooks_.data() + h * book_floats,
                                  codes_.data() + (h * capacity_ + coded_) * subspaces_,
                                  errors + h};
    }
  }
  void MarkRowCoded() { ++coded_; }
  // Row `row`'s errors ([kv_heads], host memory) once its jobs ran: a head's outlier when beyond
  // its threshold. Not while a step's heads read outliers().
  void AddRowOutliers(int64_t row, const float* errors) {
    for (int h = 0; h < kv_heads(); ++h) AddOutliers(h, row, std::span<const float>(errors + h, 1));
  }
  cuda::PqCodeSets sets(int head_dim) const {
    return cuda::PqCodeSets{codebooks_.data(), codes_.data(), capacity_, subspaces_, head_dim};
  }

 private:
  // Trains the quantizers with the training's assignments on the device (GpuPqAssigner: the
  // host's were most of the layer's build), charged to the session while they train; on the host
  // when the budget has no room.
  static absl::StatusOr<std::vector<ProductQuantizer>> TrainOnDevice(
      const KvView& bulk, const SessionAccounts& accounts, const BuildStop& stop) {
    const int64_t rows = std::min(TrainingParams(bulk.head_dim).training_keys,
                                  std::max<int64_t>(TrainedRowsOf(bulk.tokens), 1));
    const int64_t bytes = GpuPqAssigner::DeviceBytesFor(rows, bulk.head_dim);
    if (absl::Status s = accounts.device->Reserve(bytes, "the quantizers' training"); !s.ok()) {
      SayOnHost(training_on_host_, "training", s);
      return Train(bulk, nullptr, stop);
    }
    absl::StatusOr<std::vector<ProductQuantizer>> trained;
    {
      absl::StatusOr<std::unique_ptr<GpuPqAssigner>> assigner =
          GpuPqAssigner::Create(rows, bulk.head_dim);
      if (assigner.ok()) {
        trained = Train(bulk, assigner->get(), stop);
      } else if (absl::IsResourceExhausted(assigner.status())) {
        SayOnHost(training_on_host_, "training", assigner.status());
        trained = Train(bulk, nullptr, stop);
      } else {
        trained = assigner.status();
      }
    }  // its device memory goes before its charge
    accounts.device->Release(bytes);
    return trained;
  }
  // Says once per process and `what` (the training, the prompt's coding) that it runs on the
  // host for want of device memory, and why: the layer is served all the same, its build slower.
  static void SayOnHost(std::once_flag& said, const char* what, const absl::Status& why) {
    std::call_once(said, [&] {
      std::fprintf(stderr, "kvrecalld: the shortlist's %s runs on the host (%s)\n", what,
                   std::string(why.message()).c_str());
    });
  }
  static inline std::once_flag training_on_host_, coding_on_host_;

  // Bulk rows whose keys go up at a time to be coded: 4 MB of staging at 8 KV heads of 128
  // bf16 dims, charged to the session while they are coded.
  static constexpr int64_t kCodingChunkTokens = 2048;

 public:
  // Codes rows [coded(), bulk.tokens) of the bulk (the prompt's at prefill, or those a
  // relearned layer's bulk gained while its codes were learned), their outliers included. On
  // the device (cuda::PqEncode: the host's encoding was most of a long prompt's build): the keys
  // go up a chunk at a time, one launch codes every KV head's in place (28-92 us for 8 rows to a
  // chunk on an H100, bench/results/pq_encode.md; cuda::PqEncodeRows is faster only for a handful
  // of rows) and the keys' reconstruction errors come down. On the host, then uploaded,
  // when the keys are not 16-bit or the budget has no room for the staging. `stop` is asked
  // before each chunk.
  absl::Status CodeRowsUnless(const BuildStop& stop, const KvView& bulk) override {
    const int64_t first = coded_;
    if (bulk.tokens <= first) return absl::OkStatus();
    // Before the staging is made (a build stopped already pays for none).
    if (absl::Status s = stop.Check(kCodingStopped); !s.ok()) return s;
    DeviceScope scope(ordinal_);
    if (!scope.status().ok()) return scope.status();
    if (bulk.element == KvElement::kF32) return CodeRowsOnHost(stop, bulk);  // 16-bit staging
    const int d = bulk.head_dim;
    const int64_t row = int64_t{kv_heads()} * d;  // elements of one token's keys
    const int64_t rows = bulk.tokens - first;
    const int64_t chunk = std::min(rows, kCodingChunkTokens);
    ChargedBuffer<uint16_t> keys;
    ChargedBuffer<float> errors;
    // Not zeroed: each chunk's upload writes the keys the launch reads, the launch every error
    // the download reads.
    absl::Status staged = keys.AllocateForOverwrite(chunk * row, device_, "the keys being coded");
    if (staged.ok()) {
      staged = errors.AllocateForOverwrite(chunk * kv_heads(), device_, "their errors");
    }
    if (absl::IsResourceExhausted(staged)) {
      SayOnHost(coding_on_host_, "coding of the bulk", staged);
      return CodeRowsOnHost(stop, bulk);
    }
    if (!staged.ok()) return staged;
    const int64_t book_floats = int64_t{ProductQuantizer::kCentroids} * d;
    std::vector<std::vector<float>> head_errors(kv_heads(), std::vector<float>(rows));
    std::vector<float> chunk_errors(chunk * kv_heads());
    // The keys go up from a copy: the host KV is pinned a range per growth made where it is, and
    // the driver refuses a copy from pinned memory that runs past its range
    // (cudaErrorInvalidValue; the device's own reads cross them: its kernels read by address).
    const auto host_keys = std::make_unique_for_overwrite<uint16_t[]>(chunk * row);
    for (int64_t begin = first; begin < bulk.tokens; begin += chunk) {
      if (absl::Status s = stop.Check(kCodingStopped); !s.ok()) return s;
      const int64_t n = std::min(chunk, bulk.tokens - begin);
      std::memcpy(host_keys.get(), bulk.key_row(begin, 0), n * row * sizeof(uint16_t));
      KVRECALL_CUDA_RETURN_IF_ERROR(CudaStatus(
          cudaMemcpy(keys.data(), host_keys.get(), n * row * sizeof(uint16_t),
                     cudaMemcpyHostToDevice),
          "uploading the bulk's keys to code"));
      // Every KV head in one launch: head h's keys are every row's h-th part, its codes rows
      // [begin, begin + n) of its [capacity_, M] block, its errors [h, n] of the chunk's.
      cuda::PqEncodeParams p;
      p.keys = keys.data();
      p.element = bulk.element;
      p.count = n;
      p.row_stride = row;
      p.dim = d;
      p.subspaces = subspaces_;
      p.codebooks = codebooks_.data();
      p.codes = codes_.data() + begin * subspaces_;
      p.errors = errors.data();
      p.sets = kv_heads();
      p.key_set_stride = d;
      p.codebook_set_stride = book_floats;
      p.code_set_stride = capacity_ * subspaces_;
      p.error_set_stride = n;
      if (absl::Status s = cuda::PqEncode(p, nullptr); !s.ok()) return s;
      KVRECALL_CUDA_RETURN_IF_ERROR(CudaStatus(
          cudaMemcpy(chunk_errors.data(), errors.data(), n * kv_heads() * sizeof(float),
                     cudaMemcpyDeviceToHost),
          "downloading the bulk's coding errors"));
      for (int h = 0; h < kv_heads(); ++h) {
        std::copy_n(chunk_errors.data() + h * n, n, head_errors[h].data() + (begin - first));
      }
    }
    for (int h = 0; h < kv_heads(); ++h) AddOutliers(h, first, head_errors[h]);
    coded_ = bulk.tokens;
    return absl::OkStatus();
  }

 private:
  absl::Status CodeRowsOnHost(const BuildStop& stop, const KvView& bulk) {
    const int64_t first = coded_;
    const int64_t rows = bulk.tokens - first;
    std::vector<uint8_t> staged(rows * kv_heads() * subspaces_);
    if (absl::Status s = EncodeRows(bulk, first, bulk.tokens, staged.data(), stop); !s.ok()) {
      return s;
    }
    KVRECALL_CUDA_RETURN_IF_ERROR(
        CudaStatus(cudaMemcpy2D(codes_.data() + first * subspaces_, capacity_ * subspaces_,
                                staged.data(), rows * subspaces_, rows * subspaces_, kv_heads(),
                                cudaMemcpyHostToDevice),
                   "uploading the shortlist's codes"));
    // From pageable memory the copy may return before its DMA lands, and the next step's
    // shortlist runs on a non-blocking stream that does not wait for the legacy one.
    KVRECALL_CUDA_RETURN_IF_ERROR(cuda::WaitForLegacyStream("uploading the shortlist's codes"));
    coded_ = bulk.tokens;
    return absl::OkStatus();
  }

  GpuBulkCodes(int ordinal, std::vector<ProductQuantizer> quantizers,
               const SessionAccounts& accounts)
      : BulkCodes(std::move(quantizers), accounts.host),
        ordinal_(ordinal),
        device_(accounts.device) {}

  // Synchronizes the device first: a failed step's coding may still run until the layer's
  // next step drains it, and its row already counts as coded.
  absl::Status CopyCodes(int kv_head, int64_t begin, int64_t end,
                         uint8_t* codes) const override {
    DeviceScope scope(ordinal_);
    if (!scope.status().ok()) return scope.status();
    KVRECALL_CUDA_RETURN_IF_ERROR(
        CudaStatus(cudaDeviceSynchronize(), "waiting for the device before reading codes"));
    return CudaStatus(cudaMemcpy(codes, codes_.data() + (kv_head * capacity_ + begin) * subspaces_,
                                 (end - begin) * subspaces_, cudaMemcpyDeviceToHost),
                      "reading the shortlist's codes");
  }

  const int ordinal_;
  MemoryAccount* const device_;
  ChargedBuffer<float> codebooks_;
  ChargedBuffer<uint8_t> codes_;
  int64_t capacity_ = 0;
  uint64_t generation_ = 0;
  static inline std::atomic<uint64_t> next_generation_{1};
};

class GpuStaticSetTier final : public StaticSetTier {
 public:
  GpuStaticSetTier(int ordinal, MemoryBudget* budget, BatchTopKFunction batch_topk,
                   bool cuda_graphs, bool host_pointers_usable)
      : ordinal_(ordinal),
        cuda_graphs_(cuda_graphs),
        host_pointers_usable_(host_pointers_usable),
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
  absl::StatusOr<std::unique_ptr<BulkCodes>> BuildCodes(
      const LayerConfig& config, const SessionAccounts& accounts, const KvView& bulk,
      int64_t capacity, const BuildStop& stop) override {
    DeviceScope scope(ordinal_);
    if (!scope.status().ok()) return scope.status();
    absl::StatusOr<std::unique_ptr<GpuBulkCodes>> codes =
        GpuBulkCodes::Create(ordinal_, bulk, accounts, capacity, stop);
    if (!codes.ok()) return codes.status();
    return std::unique_ptr<BulkCodes>(*std::move(codes));
  }
  std::unique_ptr<StepContext> NewStepContext(MemoryAccount* host) override {
    return std::make_unique<StaticStepContext>(ordinal_, budget_, host);
  }
  absl::Status Prepare(std::span<const StaticSetStep> steps, StepContext* context) override;
  absl::Status Start(std::span<const StaticSetStep> steps, StepContext* context) override;
  absl::Status SetExactHeads(std::span<const StaticSetStep> steps,
                             StepContext* context) override;
  absl::Status WaitShortlists(std::span<const StaticSetStep> steps,
                              StepContext* context) override;
  absl::Status Finish(std::span<const StaticSetStep> steps, StepContext* context) override;
  BatchTopKFunction batch_topk() const override { return batch_topk_; }
  HostPinning* host_pinning() override {
    return host_pointers_usable_ ? CudaHostPinning::Get(ordinal_) : nullptr;
  }
  bool ServesExactHeads(const LayerConfig& config, const BulkCodes& codes,
                        int heads) const override {
    if (heads < 1 || heads > config.shape.q_heads || !host_pointers_usable_) return false;
    DeviceScope scope(ordinal_);
    if (!scope.status().ok()) return false;
    return cuda::CheckCandidateAttention(ShapeOf(config, 1), config.selector.top_k,
                                         ExactHeadBounds(config, OutlierStride(codes)))
        .ok();
  }

 private:
  // The Decode stream's CUDA resources, and where Start left the step's outputs.
  struct StaticStepContext final : StepContext {
    StaticStepContext(int ordinal, MemoryBudget* budget, MemoryAccount* host)
        : ordinal(ordinal), gpu(ordinal, budget, host) {}
    ~StaticStepContext() override {
      DeviceScope scope(ordinal);
      if (in_flight) DrainFailedStep(*this);
      DropCapturedSteps();
      if (fork != nullptr) cudaEventDestroy(fork);
      if (join != nullptr) cudaEventDestroy(join);
      if (side != nullptr) cudaStreamDestroy(side);
    }
    const int ordinal;
    GpuStepContext gpu;
    // Prepare's layout of the step's pinned input (all of it the step's one upload) and
    // download.
    size_t in_q = 0, in_k = 0, in_v = 0, in_seqs = 0, in_rows = 0, in_sets = 0, in_lengths = 0,
           in_jobs = 0, in_heads_seq = 0, upload = 0;
    size_t out_o = 0, out_lse = 0, out_errors = 0, out_row_errors = 0, out_stamps = 0,
           out_size = 0;
    // The exact heads on the device (0: none this step): the largest bound of any step, the
    // outliers' stride, the layout of their inputs and outputs, the supports' scratch and the
    // kernel's error word.
    int exact_heads = 0;
    int64_t outlier_stride = 0;
    size_t in_bulk_seqs = 0, in_coded = 0, in_outliers = 0, in_outlier_counts = 0;
    // Which rows the exact heads are, given after the launch (SetExactHeads): heads_in (pinned)
    // holds the step's number (word 0, stored last) and its rows from byte kHeadRowsAt
    // ([batch, exact_heads], -1 past a step's own); the step waits for them on the device
    // (cuda::AwaitHostWords, expecting heads_seq from the upload) and copies them to exact_rows.
    // heads_given: the step in flight has its rows (or was given none, ending it); heads_set: the
    // rows are the steps' device_heads (Finish reads their results).
    static constexpr size_t kHeadRowsAt = 16;
    PinnedBuffer heads_in;
    ChargedBuffer<int32_t> exact_rows;  // grown, never shrunk: exact_row_count of them in use
    int exact_row_count = 0;
    uint64_t heads_seq = 0;
    bool heads_given = true, heads_set = false;
    size_t out_bulk_o = 0, out_bulk_lse = 0, out_bulk_candidates = 0;
    // Whether the exact heads' supports come down (out_bulk_support*) or stay in exact_support.
    bool exact_supports = false;
    size_t out_bulk_support = 0, out_bulk_support_sizes = 0;
    ChargedBuffer<int32_t> exact_support;  // [batch * q_heads, top_k], then [batch * q_heads]
    std::unique_ptr<cuda::KernelErrors> exact_errors;
    // With exact heads, the static sets (and the new rows' coding and append before them) run on
    // `side`, forked after the shortlists and joined before the download, beside the exact
    // heads' kernel, which reads the host over PCIe on a few multiprocessors: its time is then
    // the device's critical path (a captured step holds both branches as graph edges).
    cudaStream_t side = nullptr;
    cudaEvent_t fork = nullptr, join = nullptr;
    // Whether a step's work was queued and no Finish has drained it since (a step that failed
    // between the two): the next Prepare drains it, so that its late writes (the shortlists'
    // flag, the pinned output) cannot pass for the next step's.
    bool in_flight = false;
    // Per step of the batch: the bulk row its token pushes out of the ring, coded in the step
    // (-1: none); whether their coding is queued (MarkNewRowsCoded ran).
    std::vector<int64_t> new_row;
    bool new_rows_queued = false;
    // Per step: the coded rows its shortlist scans, and the bound its launches are planned for
    // (the scan itself reads the length from the upload, so that a captured step replays while
    // the bulk grows within the bound).
    std::vector<int64_t> scanned, scan_bound;
    int shortlist = 0;  // the run's (0: no step has codes)
    // The captured steps, by what each bakes in (the key Start builds), with the lookup they
    // were last used at. A model's layers step in turn through one Decode stream and each
    // layer's codes are its own, so one graph per context was captured anew at every layer of
    // every token once the layers had codes (d123, 32 layers at a bulk of ~1.5K rows: 0.54-0.62
    // ms a layer-step, 0.33-0.41 with a graph per key). Each is charged to the device budget
    // (gpu::kCapturedStepDeviceBytes); an empty one (refused or failed) launches eagerly until
    // it is due for another try (gpu::KeptStep).
    absl::flat_hash_map<std::vector<int64_t>, gpu::KeptStep> captured;
    uint64_t captured_runs = 0;
    std::pair<uint64_t, uint64_t> captured_generations{0, 0};  // of `gpu` and of this context
    std::vector<int64_t> key_scratch;
    // Changes whenever a buffer of this context is reallocated.
    uint64_t generation = 0;
    // The most captured steps kept: a model's layers (each live key is used once a token, so
    // stale keys, of bounds left behind or sessions gone, go first) and a few batch shapes.
    static constexpr size_t kMaxCapturedSteps = 256;
    // The captured step for `key`: the one kept, else what `capture` returns (a
    // gpu::CapturedStep, empty when it could not be made), the least recently used one dropped
    // past kMaxCapturedSteps. Null: the step runs eagerly. Every kCaptureRetryRuns lookups,
    // the steps not run for gpu::kCapturedStepStaleRuns are dropped.
    template <typename Capture>
    cudaGraphExec_t CapturedFor(const std::vector<int64_t>& key, Capture capture) {
      ++captured_runs;
      if (captured_runs % gpu::kCaptureRetryRuns == 0) {
        absl::erase_if(captured, [this](const auto& entry) {
          return entry.second.last_run + gpu::kCapturedStepStaleRuns < captured_runs;
        });
      }
      if (auto it = captured.find(key); it != captured.end()) {
        if (it->second.Usable(captured_runs)) {
          it->second.last_run = captured_runs;
          return it->second.step.get();
        }
        captured.erase(it);  // an empty step due for another try
      }
      if (captured.size() >= kMaxCapturedSteps) {
        auto oldest = captured.begin();
        for (auto it = captured.begin(); it != captured.end(); ++it) {
          if (it->second.last_run < oldest->second.last_run) oldest = it;
        }
        captured.erase(oldest);
      }
      return captured.emplace(key, gpu::KeptStep::Of(capture(), captured_runs))
          .first->second.step.get();
    }
    void DropCapturedStep(const std::vector<int64_t>& key) { captured.erase(key); }
    void DropCapturedSteps() { captured.clear(); }
    cuda::AttentionWorkspace* ws = nullptr;
    // The shortlists: tables and ids on the device ([batch, q_heads, ...], then the step's begin
    // stamp at word ids_stamps), and ids_down, where they are published to the host with the
    // shortlisted flag after them (cuda::PublishToHost: the flag is the shortlisted stamp, which
    // WaitShortlists polls; ids_published counts the publishing kernel's blocks).
    ChargedBuffer<float> tables;
    ChargedBuffer<int32_t> ids;
    size_t ids_stamps = 0;
    PinnedBuffer ids_down;
    ChargedBuffer<unsigned> ids_published;
    cuda::TopKWorkspace* topk_ws = nullptr;
    // The flag in ids_down.
    uint64_t* shortlisted() const {
      return reinterpret_cast<uint64_t*>(ids_down.data() + ids_stamps * sizeof(int32_t)) + 1;
    }
  };

  // Waits for a failed step's work on both streams (errors ignored: the step already failed).
  static void DrainFailedStep(StaticStepContext& state) {
    GiveNoExactHeads(state);
    cudaStreamSynchronize(state.gpu.stream());
    if (state.side != nullptr) cudaStreamSynchronize(state.side);
    ClearErrorWords(state);
    state.in_flight = false;
  }
  // After a step that failed in Start was drained: the new rows it coded count as coded
  // (MarkNewRowsCoded), so their outliers are added here from the device's copy of their coding
  // errors, which no download brought (Finish adds them otherwise). A device that cannot copy
  // them (a fault) has them dropped: its next step fails as well.
  static void AddDrainedRowsOutliers(std::span<const StaticSetStep> steps,
                                     StaticStepContext& state) {
    if (!state.new_rows_queued) return;
    const int kv_heads = steps.front().config->shape.kv_heads;
    std::vector<float> errors(steps.size() * kv_heads);
    if (cudaMemcpy(errors.data(), state.gpu.device_out() + state.out_row_errors,
                   errors.size() * sizeof(float), cudaMemcpyDeviceToHost) != cudaSuccess) {
      return;
    }
    AddNewRowsOutliers(steps, state, errors.data());
  }
  // Each step's new bulk row's outliers, from `row_errors` ([steps, kv_heads] host floats, the
  // step's coding errors).
  static void AddNewRowsOutliers(std::span<const StaticSetStep> steps,
                                 const StaticStepContext& state, const float* row_errors) {
    const int kv_heads = steps.front().config->shape.kv_heads;
    for (size_t b = 0; b < steps.size(); ++b) {
      if (state.new_row[b] >= 0) {
        static_cast<GpuBulkCodes*>(steps[b].codes)
            ->AddRowOutliers(state.new_row[b], row_errors + b * kv_heads);
      }
    }
  }
  // After a failed step was drained: what its kernels reported is its own, not the next step's
  // (its exact heads' wait may have timed out, if nobody named them for that long).
  static void ClearErrorWords(StaticStepContext& state) {
    cudaStream_t stream = state.gpu.stream();
    if (state.ws != nullptr) state.ws->errors().CheckAndClear(stream).IgnoreError();
    if (state.topk_ws != nullptr) state.topk_ws->errors().CheckAndClear(stream).IgnoreError();
    if (state.exact_errors != nullptr) state.exact_errors->CheckAndClear(stream).IgnoreError();
  }
  // Gives the step in flight no exact heads when SetExactHeads has not given it its own (a host
  // that failed between Start and SetExactHeads), so that its exact heads' wait ends now.
  static void GiveNoExactHeads(StaticStepContext& state) {
    if (state.heads_given) return;
    auto* rows = reinterpret_cast<int32_t*>(state.heads_in.data() + StaticStepContext::kHeadRowsAt);
    std::fill_n(rows, state.exact_row_count, -1);
    __atomic_store_n(reinterpret_cast<uint64_t*>(state.heads_in.data()), state.heads_seq,
                     __ATOMIC_RELEASE);
    state.heads_given = true;
  }
  // The exact heads' kernel, rows (exact_rows of them: batch x bound), supports' scratch (for
  // `rows` query rows) and error word (Prepare's part).
  absl::Status PrepareExactHeads(const LayerConfig& config, int exact_rows, int rows,
                                 StaticStepContext& state);
  // The shortlists' workspace, tables, ids and their publishing (Prepare's part).
  absl::Status PrepareShortlists(std::span<const StaticSetStep> steps, StaticStepContext& state);
  // Each step's shortlist over its codes (queries and sets already on the device), its ids and
  // the begin stamp published to ids_down, the shortlisted flag raised after them.
  absl::Status LaunchShortlists(std::span<const StaticSetStep> steps, StaticStepContext& state,
                                std::byte* dev_in);
  // Once the new rows' coding is queued (or launched in the captured step), the rows count as
  // coded, once: a retry of a step that fails after that finds them so (the ring slots they
  // were read from hold its token now).
  static void MarkNewRowsCoded(std::span<const StaticSetStep> steps, StaticStepContext& state) {
    if (state.new_rows_queued) return;
    state.new_rows_queued = true;
    for (size_t b = 0; b < steps.size(); ++b) {
      if (state.new_row[b] >= 0) static_cast<GpuBulkCodes*>(steps[b].codes)->MarkRowCoded();
    }
  }
  // The step's device work (its begin stamp, the upload, the shortlists, the static sets, its
  // end stamp, the download), queued on the stream or, `capturing`, into the graph being
  // captured.
  absl::Status EnqueueStep(std::span<const StaticSetStep> steps, StaticStepContext& state,
                           bool capturing);

  const int ordinal_;
  const bool cuda_graphs_;  // steps replay captured launch sequences (PlacementOptions)
  // Kernels may read registered host memory through its host address (the device's
  // cudaDevAttrCanUseHostPointerForRegisteredMem): the exact heads' kernel needs it.
  const bool host_pointers_usable_;
  const std::string device_;
  MemoryBudget* const budget_;
  const BatchTopKFunction batch_topk_;
};

absl::Status GpuStaticSetTier::PrepareShortlists(std::span<const StaticSetStep> steps,
                                                 StaticStepContext& state) {
  GpuStepContext& ctx = state.gpu;
  const LayerConfig& config = *steps.front().config;
  const int q_heads = config.shape.q_heads;
  const int subspaces = BulkCodes::SubspacesFor(config.shape.head_dim);
  const int batch = static_cast<int>(steps.size());
  const int64_t longest = *std::max_element(state.scan_bound.begin(), state.scan_bound.end());
  absl::StatusOr<cuda::TopKWorkspace*> ws = ctx.TopKWs(q_heads, std::max<int64_t>(longest, 1));
  if (!ws.ok()) return ws.status();
  state.topk_ws = *ws;
  const size_t tables = static_cast<size_t>(q_heads) * subspaces * ProductQuantizer::kCentroids;
  if (state.tables.size() < tables) {
    if (absl::Status s = state.tables.Allocate(tables, budget_, "the shortlists' tables");
        !s.ok()) {
      return s;
    }
    ++state.generation;
  }
  // ids [batch, q_heads, shortlist], sizes [batch, q_heads], then the begin stamp and (on the
  // host) the shortlisted flag, 2 u64, 8-byte aligned: published together.
  state.ids_stamps = (batch * static_cast<size_t>(q_heads) * (state.shortlist + 1) + 1) / 2 * 2;
  const size_t words = state.ids_stamps + 4;
  if (state.ids.size() < words) {
    if (absl::Status s = state.ids.Allocate(words, budget_, "the shortlists' ids"); !s.ok()) {
      return s;
    }
    ++state.generation;
  }
  if (state.ids_down.bytes() < words * sizeof(int32_t)) {
    if (absl::Status s = state.ids_down.Ensure(words * sizeof(int32_t), state.gpu.host_account(),
                                               "the shortlists' ids");
        !s.ok()) {
      return s;
    }
    ++state.generation;
  }
  if (state.ids_published.size() == 0) {
    if (absl::Status s = state.ids_published.Allocate(1, budget_, "the shortlists' publishing");
        !s.ok()) {
      return s;
    }
    ++state.generation;
  }
  return absl::OkStatus();
}

absl::Status GpuStaticSetTier::LaunchShortlists(std::span<const StaticSetStep> steps,
                                                StaticStepContext& state, std::byte* dev_in) {
  const LayerConfig& config = *steps.front().config;
  const int q_heads = config.shape.q_heads;
  const int d = config.shape.head_dim;
  const int batch = static_cast<int>(steps.size());
  const int shortlist = state.shortlist;
  cudaStream_t stream = state.gpu.stream();
  int32_t* ids = state.ids.data();
  int32_t* sizes = ids + static_cast<size_t>(batch) * q_heads * shortlist;
  for (int b = 0; b < batch; ++b) {
    const StaticSetStep& step = steps[b];
    int32_t* step_sizes = sizes + static_cast<size_t>(b) * q_heads;
    if (state.scan_bound[b] == 0) {
      KVRECALL_CUDA_RETURN_IF_ERROR(CudaStatus(
          cudaMemsetAsync(step_sizes, 0, q_heads * sizeof(int32_t), stream), "no shortlist"));
      continue;
    }
    const auto& codes = *static_cast<const GpuBulkCodes*>(step.codes);
    // Each row's length (the rows coded before this step: its new ones are placed after the
    // shortlists, off their path, and the exact path rescores them as the bulk's uncoded tail)
    // comes with the upload; the launches are planned for the step's bound.
    const cuda::PqShortlistRows rows{
        At<const float>(dev_in, state.in_q) + static_cast<int64_t>(b) * q_heads * d,
        At<const int32_t>(dev_in, state.in_sets),
        At<const int32_t>(dev_in, state.in_lengths) + static_cast<int64_t>(b) * q_heads,
        state.tables.data(), q_heads, static_cast<int>(state.scan_bound[b]),
        q_heads / config.shape.kv_heads};  // a KV head's query heads share its codes' reads
    KVRECALL_CUDA_RETURN_IF_ERROR(cuda::PqShortlist(
        codes.sets(d), rows, shortlist, state.topk_ws,
        ids + static_cast<size_t>(b) * q_heads * shortlist, step_sizes, nullptr, stream));
  }
  // The ids, sizes and begin stamp, then the flag: kernel nodes, not a copy and an event (each
  // of those costs the captured step's launch ~2 us of host time, d40-d44).
  return cuda::PublishToHost(ids, state.ids_down.data(), (state.ids_stamps + 2) * sizeof(int32_t),
                             state.ids_published.data(), state.shortlisted(), stream);
}

absl::Status GpuStaticSetTier::WaitShortlists(std::span<const StaticSetStep> steps,
                                              StepContext* context) {
  DeviceScope scope(ordinal_);
  if (!scope.status().ok()) return scope.status();
  auto& state = static_cast<StaticStepContext&>(*context);
  // Polled on this core; the stream is asked now and then, so that a failed step surfaces as
  // its error rather than as a wait without end.
  const uint64_t* flag = state.shortlisted();
  auto published = [flag] { return __atomic_load_n(flag, __ATOMIC_ACQUIRE) != 0; };
  while (!cpu::PollUntil(std::chrono::microseconds(20), published)) {
    const cudaError_t e = cudaStreamQuery(state.gpu.stream());
    if (e == cudaErrorNotReady || published()) continue;
    if (e != cudaSuccess) return CudaStatus(e, "finding the shortlists on the GPU");
    return absl::InternalError("the static-set step ended without publishing its shortlists");
  }
  const uint64_t begin = *(flag - 1);
  state.tier_seconds.shortlist = static_cast<double>(*flag - begin) * 1e-9;
  const int q_heads = steps.front().config->shape.q_heads;
  const int batch = static_cast<int>(steps.size());
  const int shortlist = steps.front().shortlist;  // one per run (SameStaticSet)
  const auto* ids = reinterpret_cast<const int32_t*>(state.ids_down.data());
  const int32_t* sizes = ids + static_cast<size_t>(batch) * q_heads * shortlist;
  // The kernels' error word is checked by Finish (it comes down with the static sets): a
  // violation skips elements, and every id left is a bulk position the exact path bounds.
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
  if (absl::Status s = ShapeOf(config, 1).Validate(); !s.ok()) return s;
  const int shortlist = config.selector.shortlist;
  if (shortlist > 0) {
    // The shortlist is the GPU's top-K selection of the codes' scores, bounded by its shared
    // memory (a longer one failed its first step with INTERNAL): refused here, naming it.
    return gpu::CheckOnDevice(ordinal_,
                              absl::StrCat("policy.index.shortlist ", shortlist,
                                           " is not served by PLACEMENT_TIERED on ", device_),
                              [&] { return cuda::CheckRowTopK(shortlist); });
  }
  return absl::OkStatus();
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
  return std::make_unique<GpuStaticSet>(ordinal_, std::move(keys), std::move(values));
}

absl::Status GpuStaticSetTier::Prepare(std::span<const StaticSetStep> steps,
                                       StepContext* context) {
  DeviceScope scope(ordinal_);
  if (!scope.status().ok()) return scope.status();
  auto& state = static_cast<StaticStepContext&>(*context);
  GpuStepContext& ctx = state.gpu;
  if (state.in_flight) {
    GiveNoExactHeads(state);
    KVRECALL_CUDA_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(ctx.stream()),
                                             "draining a failed static-set step"));
    // (Its side stream too: a step that failed before the join leaves work there.)
    if (state.side != nullptr) {
      KVRECALL_CUDA_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(state.side),
                                               "draining a failed static-set step"));
    }
    ClearErrorWords(state);
    state.in_flight = false;
  }
  if (absl::Status s = ctx.Start(); !s.ok()) return s;
  // This step's workspaces, set below: one a refusal freed (GpuStepContext::Remake) must not be
  // read after (ClearErrorWords of a step that fails without a shortlist, say).
  state.ws = nullptr;
  state.topk_ws = nullptr;
  const LayerConfig& config = *steps.front().config;
  const int batch = static_cast<int>(steps.size());
  const int q_heads = config.shape.q_heads;
  const int d = config.shape.head_dim;
  const int rows = batch * q_heads;
  const int64_t row = RowElems(config);
  absl::StatusOr<cuda::AttentionWorkspace*> ws = ctx.AttentionWs(rows);
  if (!ws.ok()) return ws.status();
  state.ws = *ws;
  // Per step: its new bulk row, the rows its shortlist scans and the bound of its launches.
  state.shortlist = 0;
  state.new_row.assign(steps.size(), -1);
  state.new_rows_queued = false;
  state.scanned.assign(steps.size(), 0);
  state.scan_bound.assign(steps.size(), 0);
  for (size_t b = 0; b < steps.size(); ++b) {
    const StaticSetStep& step = steps[b];
    if (step.codes == nullptr) continue;
    const auto& codes = *static_cast<const GpuBulkCodes*>(step.codes);
    state.shortlist = step.shortlist;
    // A step's token pushes at most one row out of the ring into the bulk, coded from the slot
    // it leaves; the prompt's bulk was coded at prefill, and a failed step's row stays coded.
    const int64_t pending = codes.Pending(step.bulk);
    if (pending > 1) {
      return absl::InternalError(absl::StrCat("the bulk's codes lag ", pending,
                                              " rows behind it; a step codes one"));
    }
    if (pending == 1) state.new_row[b] = codes.coded();
    state.scanned[b] = codes.coded();
    state.scan_bound[b] =
        cuda_graphs_ ? gpu::CapturedScanBound(codes.coded(), codes.capacity()) : codes.coded();
  }
  // The bound of query heads the steps may give the device's exact path (SetExactHeads names
  // them), with the bounds its kernel reads.
  state.exact_heads = 0;
  state.outlier_stride = 0;
  state.exact_supports = false;
  for (const StaticSetStep& step : steps) {
    if (step.codes == nullptr || step.device_exact_bound <= 0) continue;
    state.exact_heads = std::max(state.exact_heads, step.device_exact_bound);
    state.outlier_stride = std::max(state.outlier_stride, OutlierStride(*step.codes));
    state.exact_supports |= step.bulk_support != nullptr;
  }
  const bool exact = state.exact_heads > 0;
  Carver in(nullptr);
  state.in_q = in.Take<float>(static_cast<size_t>(rows) * d);
  state.in_k = in.Take<float>(batch * row);
  state.in_v = in.Take<float>(batch * row);
  state.in_seqs = in.Take<DeviceSeq>(batch);
  state.in_rows = in.Take<cuda::TokenRows>(batch);
  state.in_sets = in.Take<int32_t>(q_heads);  // the KV head of each query head
  state.in_lengths = in.Take<int32_t>(rows);  // each row's scanned codes
  // Per step and KV head: the coding of its new bulk row (a skipped job when it has none).
  state.in_jobs = in.Take<cuda::PqEncodeJob>(state.shortlist > 0 ? batch * config.shape.kv_heads
                                                                 : 0);
  // The number of the exact heads' rows to wait for, each step's bulk in host memory, its coded
  // rows, and its KV heads' outliers and their counts.
  const int kv_heads = config.shape.kv_heads;
  state.in_heads_seq = in.Take<uint64_t>(exact ? 1 : 0);
  state.in_bulk_seqs = in.Take<DeviceSeq>(exact ? batch : 0);
  state.in_coded = in.Take<int32_t>(exact ? batch : 0);
  state.in_outliers = in.Take<int32_t>(exact ? batch * kv_heads * state.outlier_stride : 0);
  state.in_outlier_counts = in.Take<int32_t>(exact ? batch * kv_heads : 0);
  state.upload = in.size();
  Carver out(nullptr);
  state.out_o = out.Take<float>(static_cast<size_t>(rows) * d);
  state.out_lse = out.Take<float>(rows);
  // The kernels' error words (the static set's, the shortlists', the exact heads') come down
  // with the outputs: no read of their own.
  state.out_errors = out.Take<unsigned>(3);
  // The new bulk rows' squared reconstruction errors [batch, kv_heads], for their outliers.
  state.out_row_errors =
      out.Take<float>(state.shortlist > 0 ? batch * config.shape.kv_heads : 0);
  // The step's begin and end on the device's clock; with exact heads, the shortlists' end, the
  // static sets' end (the two run side by side), and the exact heads' start (once their rows
  // came) and end.
  state.out_stamps = out.Take<uint64_t>(6);
  // The exact heads' states over the bulk and the candidates they scored, by row.
  state.out_bulk_o = out.Take<float>(exact ? static_cast<size_t>(rows) * d : 0);
  state.out_bulk_lse = out.Take<float>(exact ? rows : 0);
  state.out_bulk_candidates = out.Take<int32_t>(exact ? rows : 0);
  // Their supports and their sizes, by row, when a step wants them back (ReTopK's caches).
  const size_t support_elems = state.exact_supports ? static_cast<size_t>(rows) : 0;
  state.out_bulk_support = out.Take<int32_t>(support_elems * config.selector.top_k);
  state.out_bulk_support_sizes = out.Take<int32_t>(support_elems);
  state.out_size = out.size();
  if (absl::Status s = ctx.EnsureIo(state.upload, state.out_size, state.out_size); !s.ok()) {
    return s;
  }
  if (state.shortlist > 0) {
    if (absl::Status s = PrepareShortlists(steps, state); !s.ok()) return s;
  }
  if (exact) return PrepareExactHeads(config, batch * state.exact_heads, rows, state);
  return absl::OkStatus();
}

absl::Status GpuStaticSetTier::PrepareExactHeads(const LayerConfig& config, int exact_rows,
                                                 int rows, StaticStepContext& state) {
  const int top_k = config.selector.top_k;
  // The kernel's shared memory raised now, outside any capture.
  if (absl::Status s = cuda::PrepareCandidateAttention(
          ShapeOf(config, 1), top_k, ExactHeadBounds(config, state.outlier_stride));
      !s.ok()) {
    return s;
  }
  const size_t support = static_cast<size_t>(rows) * (top_k + 1);
  if (state.exact_support.size() < support) {
    if (absl::Status s =
            state.exact_support.Allocate(support, budget_, "the exact heads' supports");
        !s.ok()) {
      return s;
    }
    ++state.generation;
  }
  // The rows the host gives after the launch (GiveNoExactHeads and the wait fill all of them).
  // Grown only: a reallocation frees device memory, which waits for the whole device.
  state.exact_row_count = exact_rows;
  if (state.exact_rows.size() < static_cast<size_t>(exact_rows)) {
    if (absl::Status s = state.exact_rows.Allocate(exact_rows, budget_, "the exact heads' rows");
        !s.ok()) {
      return s;
    }
    ++state.generation;
  }
  const size_t heads_bytes = StaticStepContext::kHeadRowsAt + exact_rows * sizeof(int32_t);
  if (state.heads_in.bytes() < heads_bytes) {
    if (absl::Status s =
            state.heads_in.Ensure(heads_bytes, state.gpu.host_account(), "the exact heads' rows");
        !s.ok()) {
      return s;
    }
    // A new buffer holds no step's number yet (the device compares it with the next one's).
    *reinterpret_cast<uint64_t*>(state.heads_in.data()) = 0;
    ++state.generation;
  }
  if (state.exact_errors == nullptr) {
    absl::StatusOr<cuda::KernelErrors> errors = cuda::KernelErrors::Create();
    if (!errors.ok()) return errors.status();
    state.exact_errors = std::make_unique<cuda::KernelErrors>(*std::move(errors));
    ++state.generation;
  }
  if (state.side == nullptr) {
    KVRECALL_CUDA_RETURN_IF_ERROR(CudaStatus(
        cudaStreamCreateWithFlags(&state.side, cudaStreamNonBlocking), "creating a side stream"));
    KVRECALL_CUDA_RETURN_IF_ERROR(CudaStatus(
        cudaEventCreateWithFlags(&state.fork, cudaEventDisableTiming), "creating an event"));
    KVRECALL_CUDA_RETURN_IF_ERROR(CudaStatus(
        cudaEventCreateWithFlags(&state.join, cudaEventDisableTiming), "creating an event"));
    ++state.generation;
  }
  return absl::OkStatus();
}

absl::Status GpuStaticSetTier::EnqueueStep(std::span<const StaticSetStep> steps,
                                           StaticStepContext& state, bool capturing) {
  GpuStepContext& ctx = state.gpu;
  const LayerConfig& config = *steps.front().config;
  const int batch = static_cast<int>(steps.size());
  const int64_t row = RowElems(config);
  std::byte* dev_in = ctx.device_in();
  cudaStream_t stream = ctx.stream();
  // The step's device time starts here, on the device's clock, and the upload is a kernel that
  // reads the pinned input: kernel nodes, since each event or copy node of a captured step costs
  // its launch ~2 us of host time on the way to the shortlists, a kernel node ~0.1 us (d40-d43).
  uint64_t* out_stamps = At<uint64_t>(ctx.device_out(), state.out_stamps);
  if (state.shortlist > 0) {
    KVRECALL_CUDA_RETURN_IF_ERROR(cuda::StampTime(
        {out_stamps, reinterpret_cast<uint64_t*>(state.ids.data() + state.ids_stamps)}, stream));
  } else {
    KVRECALL_CUDA_RETURN_IF_ERROR(cuda::StampTime({out_stamps}, stream));
  }
  KVRECALL_CUDA_RETURN_IF_ERROR(
      cuda::CopyByKernel(ctx.pinned_in(), dev_in, state.upload, stream));
  const bool exact = state.exact_heads > 0;
  if (state.shortlist > 0) {
    if (absl::Status s = LaunchShortlists(steps, state, dev_in); !s.ok()) return s;
  }
  // With exact heads, the rest of the static-set work forks onto the side stream here.
  cudaStream_t work = stream;
  if (exact) {
    KVRECALL_CUDA_RETURN_IF_ERROR(
        CudaStatus(cudaEventRecord(state.fork, stream), "forking the static sets"));
    KVRECALL_CUDA_RETURN_IF_ERROR(
        CudaStatus(cudaStreamWaitEvent(state.side, state.fork), "forking the static sets"));
    work = state.side;
  }
  if (state.shortlist > 0) {
    // The new bulk rows, read from the ring slots before the append overwrites them. After the
    // shortlists, which do not scan them (the exact paths rescore them as the uncoded tail).
    cuda::PqEncodeRowsParams coding;
    coding.jobs = At<const cuda::PqEncodeJob>(dev_in, state.in_jobs);
    coding.count = batch * config.shape.kv_heads;
    coding.element = gpu::KvElementOf(config.dtype);
    coding.dim = config.shape.head_dim;
    coding.subspaces = BulkCodes::SubspacesFor(config.shape.head_dim);
    KVRECALL_CUDA_RETURN_IF_ERROR(cuda::PqEncodeRows(coding, work));
    if (!capturing) MarkNewRowsCoded(steps, state);
  }
  KVRECALL_CUDA_RETURN_IF_ERROR(cuda::AppendTokens(
      batch, static_cast<int>(row), KvDtypeOf(config.dtype),
      At<cuda::TokenRows>(dev_in, state.in_rows), At<float>(dev_in, state.in_k),
      At<float>(dev_in, state.in_v), work));
  KVRECALL_CUDA_RETURN_IF_ERROR(cuda::PartialAttentionOverSeqs(
      ShapeOf(config, batch), At<DeviceSeq>(dev_in, state.in_seqs), At<float>(dev_in, state.in_q),
      Slots(config), state.ws, At<float>(ctx.device_out(), state.out_o),
      At<float>(ctx.device_out(), state.out_lse), work));
  // The exact heads given to the device, their keys and values read over PCIe from the host's
  // KV, beside the static sets; joined before the error words and the download.
  if (exact) {
    KVRECALL_CUDA_RETURN_IF_ERROR(cuda::StampTime({out_stamps + 3}, work));
    KVRECALL_CUDA_RETURN_IF_ERROR(
        CudaStatus(cudaEventRecord(state.join, work), "joining the static sets"));
    KVRECALL_CUDA_RETURN_IF_ERROR(cuda::StampTime({out_stamps + 2}, stream));
    // Which rows they are, given by the host after the launch (SetExactHeads): usually here
    // before the shortlists are done.
    cuda::HostWords heads;
    heads.ready = reinterpret_cast<const uint64_t*>(state.heads_in.data());
    heads.expected = At<const uint64_t>(dev_in, state.in_heads_seq);
    heads.words =
        reinterpret_cast<const int32_t*>(state.heads_in.data() + StaticStepContext::kHeadRowsAt);
    heads.dst = state.exact_rows.data();
    heads.count = state.exact_row_count;
    heads.fill = -1;
    heads.timeout_ns = kExactHeadsTimeoutNs;
    heads.error_word = state.exact_errors->device_word();
    heads.stamp = out_stamps + 4;
    KVRECALL_CUDA_RETURN_IF_ERROR(cuda::AwaitHostWords(heads, stream));
    const int rows = batch * config.shape.q_heads;
    const int top_k = config.selector.top_k;
    cuda::CandidateLists lists = ExactHeadBounds(config, state.outlier_stride);
    lists.shortlists = state.ids.data();
    lists.shortlist_sizes = state.ids.data() + static_cast<size_t>(rows) * state.shortlist;
    lists.outliers = At<const int32_t>(dev_in, state.in_outliers);
    lists.outlier_counts = At<const int32_t>(dev_in, state.in_outlier_counts);
    lists.coded = At<const int32_t>(dev_in, state.in_coded);
    const cuda::CandidateOutputs outputs{
        At<float>(ctx.device_out(), state.out_bulk_o),
        At<float>(ctx.device_out(), state.out_bulk_lse),
        state.exact_supports ? At<int32_t>(ctx.device_out(), state.out_bulk_support)
                             : state.exact_support.data(),
        state.exact_supports ? At<int32_t>(ctx.device_out(), state.out_bulk_support_sizes)
                             : state.exact_support.data() + static_cast<size_t>(rows) * top_k,
        At<int32_t>(ctx.device_out(), state.out_bulk_candidates)};
    KVRECALL_CUDA_RETURN_IF_ERROR(cuda::CandidateAttention(
        ShapeOf(config, batch), top_k, At<const DeviceSeq>(dev_in, state.in_bulk_seqs),
        At<const float>(dev_in, state.in_q), lists, state.exact_rows.data(),
        batch * state.exact_heads, outputs, state.exact_errors->device_word(), stream));
    KVRECALL_CUDA_RETURN_IF_ERROR(cuda::StampTime({out_stamps + 5}, stream));
    KVRECALL_CUDA_RETURN_IF_ERROR(
        CudaStatus(cudaStreamWaitEvent(stream, state.join), "joining the static sets"));
  }
  // The static set's error word, then the shortlists' and the exact heads' when there are any.
  const cuda::KernelErrors* words[] = {
      &state.ws->errors(), state.shortlist > 0 ? &state.topk_ws->errors() : nullptr,
      state.exact_heads > 0 ? state.exact_errors.get() : nullptr};
  const int word_count = state.exact_heads > 0 ? 3 : state.shortlist > 0 ? 2 : 1;
  KVRECALL_CUDA_RETURN_IF_ERROR(cuda::GatherErrorWords(
      std::span(words, word_count), At<unsigned>(ctx.device_out(), state.out_errors), stream));
  // Its end (the download kernel's own ~2 us not counted), then the download, writing the
  // pinned output: the host reads it once Finish synchronized the stream.
  KVRECALL_CUDA_RETURN_IF_ERROR(cuda::StampTime({out_stamps + 1}, stream));
  return cuda::CopyByKernel(ctx.device_out(), ctx.pinned_out(), state.out_size, stream);
}

absl::Status GpuStaticSetTier::Start(std::span<const StaticSetStep> steps, StepContext* context) {
  DeviceScope scope(ordinal_);
  if (!scope.status().ok()) return scope.status();
  auto& state = static_cast<StaticStepContext&>(*context);
  GpuStepContext& ctx = state.gpu;
  state.tier_seconds.shortlist = 0;  // set by WaitShortlists when this step has shortlists
  const LayerConfig& config = *steps.front().config;
  const int batch = static_cast<int>(steps.size());
  const int q_heads = config.shape.q_heads;
  const int d = config.shape.head_dim;
  const int64_t row = RowElems(config);
  std::byte* host_in = ctx.pinned_in();
  for (int h = 0; h < q_heads; ++h) {
    At<int32_t>(host_in, state.in_sets)[h] = KvHeadOf(h, q_heads, config.shape.kv_heads);
  }
  for (int b = 0; b < batch; ++b) {
    const StaticSetStep& step = steps[b];
    std::fill_n(At<int32_t>(host_in, state.in_lengths) + b * q_heads, q_heads,
                static_cast<int32_t>(state.scanned[b]));
    if (step.shortlist_coded != nullptr) *step.shortlist_coded = state.scanned[b];
    const auto& set = *static_cast<const GpuStaticSet*>(step.set);
    const int64_t tokens = step.host_kv.tokens;  // the new token included
    std::memcpy(At<float>(host_in, state.in_q) + static_cast<int64_t>(b) * q_heads * d, step.q,
                static_cast<size_t>(q_heads) * d * sizeof(float));
    std::memcpy(At<float>(host_in, state.in_k) + b * row, step.k_new, row * sizeof(float));
    std::memcpy(At<float>(host_in, state.in_v) + b * row, step.v_new, row * sizeof(float));
    At<DeviceSeq>(host_in, state.in_seqs)[b] = set.Seq(config, tokens);
    const int64_t slot = SlotOf(config, tokens - 1);
    At<cuda::TokenRows>(host_in, state.in_rows)[b] =
        cuda::TokenRows{set.key_slot(config, slot), set.value_slot(config, slot)};
    if (state.shortlist == 0) continue;
    // The token leaving the ring (when one does) is in the slot the new token takes.
    const int kv_heads = config.shape.kv_heads;
    cuda::PqEncodeJob* jobs = At<cuda::PqEncodeJob>(host_in, state.in_jobs) + b * kv_heads;
    if (state.new_row[b] < 0) {
      std::fill_n(jobs, kv_heads, cuda::PqEncodeJob{});
    } else {
      static_cast<const GpuBulkCodes*>(step.codes)
          ->NewRowJobs(set.key_slot(config, slot), d,
                       At<float>(ctx.device_out(), state.out_row_errors) + b * kv_heads, jobs);
    }
  }
  if (state.exact_heads > 0) {
    // The rows come after the launch (SetExactHeads); the step waits for this number with them.
    At<uint64_t>(host_in, state.in_heads_seq)[0] = ++state.heads_seq;
    state.heads_given = false;
    state.heads_set = false;
    const int kv_heads = config.shape.kv_heads;
    for (int b = 0; b < batch; ++b) {
      const StaticSetStep& step = steps[b];
      const bool may_give = step.codes != nullptr && step.device_exact_bound > 0;
      At<DeviceSeq>(host_in, state.in_bulk_seqs)[b] = DeviceSeq::Contiguous(
          step.bulk.keys, step.bulk.values, static_cast<int32_t>(step.bulk.tokens));
      At<int32_t>(host_in, state.in_coded)[b] = static_cast<int32_t>(state.scanned[b]);
      int32_t* counts = At<int32_t>(host_in, state.in_outlier_counts) + b * kv_heads;
      for (int g = 0; g < kv_heads; ++g) {
        const std::span<const int32_t> outliers =
            may_give ? step.codes->outliers(g) : std::span<const int32_t>();
        counts[g] = static_cast<int32_t>(outliers.size());
        std::memcpy(At<int32_t>(host_in, state.in_outliers) +
                        (static_cast<int64_t>(b) * kv_heads + g) * state.outlier_stride,
                    outliers.data(), outliers.size() * sizeof(int32_t));
      }
    }
  }
  // The shortlists' flag, raised by the step when their ids are on the host.
  if (state.shortlist > 0) __atomic_store_n(state.shortlisted(), uint64_t{0}, __ATOMIC_RELEASE);
  state.in_flight = true;
  const absl::Status queued = [&]() -> absl::Status {
    cudaStream_t stream = ctx.stream();
    if (!cuda_graphs_) {
      if (absl::Status s = EnqueueStep(steps, state, /*capturing=*/false); !s.ok()) return s;
    } else {
      // What the captured step bakes in: the shapes and knobs (the softmax scale among them:
      // the kernels take it by value, and sessions of one shape may differ in it), the
      // buffers (by address and generation), the upload's layout, each step's codes and launch
      // bound. Everything else (queries, new tokens, static-set slots, scanned lengths) travels
      // in the upload.
      std::vector<int64_t>& key = state.key_scratch;
      key.assign({batch, q_heads, config.shape.kv_heads, d, static_cast<int64_t>(config.dtype),
                  absl::bit_cast<uint32_t>(config.shape.scale), config.selector.sinks,
                  config.selector.recent, state.shortlist,
                  static_cast<int64_t>(ctx.generation()), static_cast<int64_t>(state.generation),
                  static_cast<int64_t>(state.upload), static_cast<int64_t>(state.out_size),
                  state.exact_heads, state.outlier_stride, config.selector.top_k,
                  state.exact_supports});
      for (size_t b = 0; b < steps.size(); ++b) {
        const auto* codes = static_cast<const GpuBulkCodes*>(steps[b].codes);
        key.push_back(reinterpret_cast<intptr_t>(codes));
        key.push_back(codes != nullptr ? static_cast<int64_t>(codes->generation()) : 0);
        key.push_back(state.scan_bound[b]);
      }
      // A reallocated buffer of the contexts leaves every step captured before naming freed
      // memory: none of their keys can come again.
      const std::pair<uint64_t, uint64_t> generations{ctx.generation(), state.generation};
      if (generations != state.captured_generations) {
        state.DropCapturedSteps();
        state.captured_generations = generations;
      }
      const cudaGraphExec_t graph = state.CapturedFor(key, [&] {
        return gpu::CaptureChargedStep(
            stream, budget_, [&] { return EnqueueStep(steps, state, /*capturing=*/true); });
      });
      if (graph == nullptr) {
        if (absl::Status s = EnqueueStep(steps, state, /*capturing=*/false); !s.ok()) return s;
      } else {
        if (absl::Status s = CudaStatus(cudaGraphLaunch(graph, stream),
                                        "launching a captured static-set step");
            !s.ok()) {
          state.DropCapturedStep(key);  // captured anew by the next step that needs it
          return s;
        }
        MarkNewRowsCoded(steps, state);
      }
    }
    return absl::OkStatus();
  }();
  if (!queued.ok()) {
    // What was queued before the failure may read the layers' host KV (the exact heads): it
    // ends here, not in the next Prepare, since the session may free or move that memory first.
    DrainFailedStep(state);
    AddDrainedRowsOutliers(steps, state);
  }
  return queued;
}

absl::Status GpuStaticSetTier::SetExactHeads(std::span<const StaticSetStep> steps,
                                             StepContext* context) {
  auto& state = static_cast<StaticStepContext&>(*context);
  const int q_heads = steps.front().config->shape.q_heads;
  // Every step checked before any row is written (a step without room for heads gives none).
  if (absl::Status s = CheckExactHeads(steps); !s.ok()) {
    GiveNoExactHeads(state);
    return s;
  }
  if (state.heads_given) return absl::OkStatus();  // no step has room for heads (or it ended)
  auto* rows = reinterpret_cast<int32_t*>(state.heads_in.data() + StaticStepContext::kHeadRowsAt);
  for (size_t b = 0; b < steps.size(); ++b) {
    const StaticSetStep& step = steps[b];
    for (int j = 0; j < state.exact_heads; ++j) {
      rows[b * state.exact_heads + j] =
          j < step.device_exact_heads ? static_cast<int32_t>(b) * q_heads + step.device_heads[j]
                                      : -1;
    }
  }
  // The rows before the number that marks them (the device reads them once it sees it).
  __atomic_store_n(reinterpret_cast<uint64_t*>(state.heads_in.data()), state.heads_seq,
                   __ATOMIC_RELEASE);
  state.heads_given = true;
  state.heads_set = true;
  return absl::OkStatus();
}

absl::Status GpuStaticSetTier::Finish(std::span<const StaticSetStep> steps, StepContext* context) {
  DeviceScope scope(ordinal_);
  if (!scope.status().ok()) return scope.status();
  auto& state = static_cast<StaticStepContext&>(*context);
  GpuStepContext& ctx = state.gpu;
  GiveNoExactHeads(state);  // (a host that failed before naming them)
  // The host's wait for the device: none when the step was done by now (the synchronization's
  // own cost is not a wait; DeviceHeadBalance reads it), else until it is.
  const auto wait_start = std::chrono::steady_clock::now();
  const bool done = cudaStreamQuery(ctx.stream()) == cudaSuccess;
  KVRECALL_CUDA_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(ctx.stream()),
                                           "attending the static sets on the GPU"));
  state.tier_seconds.finish_wait =
      done ? 0.0
           : std::chrono::duration<double>(std::chrono::steady_clock::now() - wait_start).count();
  state.in_flight = false;
  // The new rows' outliers first, whatever the error words say (their coding has none, and a
  // failed step's rows stay coded): the heads are done with the outliers.
  AddNewRowsOutliers(steps, state, At<float>(ctx.pinned_out(), state.out_row_errors));
  // Device-side precondition violations would be this code's bug: every input was validated.
  // The word came down with the outputs; only when it is set does CheckAndClear say what it
  // holds.
  // Every word that is set is read (and so cleared), so that none fails the next step too.
  const unsigned* errors = At<unsigned>(ctx.pinned_out(), state.out_errors);
  absl::Status reported;
  if (errors[0] != 0) {
    reported.Update(
        ReportedErrors(state.ws->errors(), ctx.stream(), "a static-set step's kernels"));
  }
  if (state.shortlist > 0 && errors[1] != 0) {
    reported.Update(
        ReportedErrors(state.topk_ws->errors(), ctx.stream(), "the shortlists' kernels"));
  }
  if (state.exact_heads > 0 && errors[2] != 0) {
    reported.Update(ReportedErrors(*state.exact_errors, ctx.stream(), "the exact heads' kernel"));
  }
  if (!reported.ok()) return reported;
  const uint64_t* stamps = At<uint64_t>(ctx.pinned_out(), state.out_stamps);
  // The shortlists ran on the same stream ahead of the static sets, and the exact heads after
  // them: their times are reported apart (tier_seconds.shortlist, .device_exact), not as the
  // static sets'.
  const uint64_t static_end = state.exact_heads > 0 ? stamps[3] : stamps[1];
  state.tier_seconds.static_set =
      static_cast<double>(static_end - stamps[0]) * 1e-9 - state.tier_seconds.shortlist;
  state.tier_seconds.device_exact =
      state.exact_heads > 0 ? static_cast<double>(stamps[5] - stamps[4]) * 1e-9 : 0.0;
  state.tier_seconds.device_exact_wait =
      state.exact_heads > 0 ? static_cast<double>(stamps[4] - stamps[2]) * 1e-9 : 0.0;
  state.tier_seconds.device_step = static_cast<double>(stamps[1] - stamps[0]) * 1e-9;
  const LayerConfig& config = *steps.front().config;
  const int q_heads = config.shape.q_heads;
  const int d = config.shape.head_dim;
  const float* o = reinterpret_cast<const float*>(ctx.pinned_out() + state.out_o);
  const float* lse = reinterpret_cast<const float*>(ctx.pinned_out() + state.out_lse);
  for (size_t b = 0; b < steps.size(); ++b) {
    std::memcpy(steps[b].o, o + b * q_heads * d, static_cast<size_t>(q_heads) * d * sizeof(float));
    std::memcpy(steps[b].lse, lse + b * q_heads, q_heads * sizeof(float));
  }
  if (state.exact_heads == 0 || !state.heads_set) return absl::OkStatus();
  // The exact heads' states over the bulk, into the steps' own bulk states.
  const auto* bulk_o = reinterpret_cast<const float*>(ctx.pinned_out() + state.out_bulk_o);
  const auto* bulk_lse = reinterpret_cast<const float*>(ctx.pinned_out() + state.out_bulk_lse);
  const auto* candidates =
      reinterpret_cast<const int32_t*>(ctx.pinned_out() + state.out_bulk_candidates);
  const int top_k = config.selector.top_k;
  const auto* supports =
      reinterpret_cast<const int32_t*>(ctx.pinned_out() + state.out_bulk_support);
  const auto* support_sizes =
      reinterpret_cast<const int32_t*>(ctx.pinned_out() + state.out_bulk_support_sizes);
  for (size_t b = 0; b < steps.size(); ++b) {
    const StaticSetStep& step = steps[b];
    const int heads = step.codes != nullptr ? step.device_exact_heads : 0;
    for (int j = 0; j < heads; ++j) {
      const int h = step.device_heads[j];
      const size_t row = b * q_heads + h;
      std::memcpy(step.bulk_o + static_cast<size_t>(h) * d, bulk_o + row * d, d * sizeof(float));
      step.bulk_lse[h] = bulk_lse[row];
      step.bulk_candidates[h] = candidates[row];
      if (step.bulk_support == nullptr) continue;
      step.bulk_support_sizes[h] = support_sizes[row];
      std::memcpy(step.bulk_support + static_cast<size_t>(h) * top_k, supports + row * top_k,
                  static_cast<size_t>(support_sizes[row]) * sizeof(int32_t));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<StaticSetTier>> MakeGpuStaticSetTier(int ordinal,
                                                                    MemoryBudget* budget,
                                                                    bool cuda_graphs) {
  DeviceScope scope(ordinal);
  if (!scope.status().ok()) return scope.status();
  absl::StatusOr<BatchTopKFunction> topk = MakeGpuBatchTopKFunction();
  if (!topk.ok()) return topk.status();
  // The graph build runs on whichever thread builds the layer: make it this tier's device.
  BatchTopKFunction on_device = [ordinal, topk = *std::move(topk)](
                                    const VectorSet& queries, const VectorSet& keys, int k,
                                    TopKLists* out, std::span<const int64_t> visible,
                                    const BuildStop& stop) {
    DeviceScope scope(ordinal);
    if (!scope.status().ok()) return scope.status();
    return topk(queries, keys, k, out, visible, stop);
  };
  int host_pointers = 0;
  KVRECALL_CUDA_RETURN_IF_ERROR(CudaStatus(
      cudaDeviceGetAttribute(&host_pointers, cudaDevAttrCanUseHostPointerForRegisteredMem,
                             ordinal),
      "reading whether the device reads registered host memory at its address"));
  return std::make_unique<GpuStaticSetTier>(ordinal, budget, std::move(on_device), cuda_graphs,
                                            host_pointers != 0);
}

}  // namespace kvrecall
