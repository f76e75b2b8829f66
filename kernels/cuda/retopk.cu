#include "kernels/cuda/retopk.h"

#include <algorithm>
#include <type_traits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/exact_topk.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/retopk.cuh"

namespace kvrecall::cuda {
namespace {

// Reuse blocks: 512 threads while every row has a multiprocessor to itself (one row's latency
// is the step's), 256 when rows outnumber multiprocessors, so that two blocks share one and all
// rows run in one wave (measured with the earlier finish kernel at batch 8: 40 -> 35 us; at
// batch 1 the 256-thread block was slower, 16 -> 21 us).
constexpr int kReuseThreadsFewRows = 512;
constexpr int kReuseThreadsManyRows = 256;
constexpr int kSeedThreads = 128;
// The candidate set lives in shared memory at most half full: 2^15 slots (128 KB).
constexpr int kMaxLog2HashSlots = 15;

// OK when the kernels serve these knobs and this geometry.
absl::Status CheckKnobs(int q_heads, int head_dim, int top_k, const ReTopKParams& params) {
  if (q_heads < 1) {
    return absl::InvalidArgumentError(absl::StrCat("q_heads must be >= 1, got ", q_heads));
  }
  if (head_dim != 64 && head_dim != 128) {
    return absl::InvalidArgumentError(
        absl::StrCat("head_dim must be 64 or 128 on the GPU, got ", head_dim));
  }
  if (top_k < 1) return absl::InvalidArgumentError(absl::StrCat("top_k must be >= 1, got ", top_k));
  if (params.cache_capacity < 1 || params.cache_capacity > kMaxGpuReTopKCacheCapacity) {
    return absl::InvalidArgumentError(absl::StrCat("cache_capacity must be in [1, ",
                                                   kMaxGpuReTopKCacheCapacity, "] on the GPU, got ",
                                                   params.cache_capacity));
  }
  if (params.reuse_neighbors < 1 || params.recent_window < 0 || params.refresh_interval < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "need reuse_neighbors >= 1, recent_window >= 0, refresh_interval >= 0; got ",
        params.reuse_neighbors, ", ", params.recent_window, ", ", params.refresh_interval));
  }
  return absl::OkStatus();
}

// log2 of the hash-set slots for `candidates` keys (at most half full).
int Log2HashSlots(int64_t candidates) {
  int log2_slots = 1;
  while ((int64_t{1} << log2_slots) < 2 * candidates) ++log2_slots;
  return log2_slots;
}

// Element counts of a ReTopKCaches' buffers.
struct CachesLayout {
  size_t queries, supports, sizes, heads;
  static CachesLayout For(int q_heads, int head_dim, int top_k, const ReTopKParams& params) {
    const size_t entries = static_cast<size_t>(q_heads) * params.cache_capacity;
    return CachesLayout{entries * head_dim, entries * top_k, entries,
                        static_cast<size_t>(q_heads)};
  }
  int64_t Bytes() const {
    return static_cast<int64_t>(queries * sizeof(float) + supports * sizeof(int32_t) +
                                sizes * sizeof(int32_t) + heads * (2 * sizeof(int32_t) +
                                                                   sizeof(float)));
  }
};

// Element counts of a ReTopKWorkspace's own buffers (its TopKWorkspace aside).
struct WorkspaceLayout {
  size_t rows, unit_q, neighbors, candidates, support, batch, seed_support, seed_sizes;
  static WorkspaceLayout For(const DecodeShape& max_shape, int top_k, const ReTopKParams& params) {
    const size_t rows = max_shape.rows();
    const size_t c_heads = static_cast<size_t>(params.cache_capacity) * max_shape.q_heads;
    return WorkspaceLayout{rows,
                           rows * max_shape.head_dim,
                           rows * (1 + static_cast<size_t>(params.cache_capacity)),
                           rows * static_cast<size_t>(ReTopKMaxCandidates(top_k, params)),
                           rows * top_k,
                           static_cast<size_t>(max_shape.batch),
                           c_heads * top_k,
                           c_heads};
  }
  int64_t Bytes() const {
    // unit_q, paths, exact_rows, best_cosine, neighbors, candidates, candidate_count,
    // candidate_scores, support, support_size, seed_seqs, seed_o, seed_lse, seed_support,
    // seed_sizes.
    return static_cast<int64_t>(
        unit_q * 4 + rows + rows + rows * 4 + neighbors * 4 + candidates * 4 + rows * 4 +
        candidates * 4 +
        support * 4 + rows * 4 + batch * sizeof(DeviceSeq) + unit_q * 4 + rows * 4 +
        seed_support * 4 + seed_sizes * 4);
  }
};

// Opts ReTopKReuseKernel in to its shared memory for these knobs; returns the pool's bytes.
template <typename T, int kDim, int kThreads>
absl::StatusOr<int> AllowReuseSmem(int log2_slots, int max_candidates, int top_k) {
  const int pool = ReusePoolBytes<kDim, kThreads>(log2_slots, max_candidates);
  KVRECALL_CUDA_RETURN_IF_ERROR(AllowDynamicSharedMemory<&ReTopKReuseKernel<T, kDim, kThreads>>(
      ReuseSmemBytes(pool, max_candidates, top_k)));
  return pool;
}

template <typename T>
int64_t Bytes(const DeviceBuffer<T>& b) {
  return static_cast<int64_t>(b.bytes());
}

}  // namespace

// The classes' private parts, for the functions below.
struct ReTopKLaunch {
  static ReTopKStepState State(const DecodeShape& shape, int top_k, const ReTopKParams& params,
                               const ReTopKWorkspace& ws) {
    ReTopKStepState s = ReTopKStepKnobs(shape, top_k, params);
    s.unit_q = ws.unit_q_.data();
    s.paths = ws.paths_.data();
    s.exact_rows = ws.exact_rows_.data();
    s.best_cosine = ws.best_cosine_.data();
    s.neighbors_of = ws.neighbors_.data();
    s.candidates = ws.candidates_.data();
    s.candidate_count = ws.candidate_count_.data();
    s.candidate_scores = ws.candidate_scores_.data();
    s.support = ws.support_.data();
    s.support_size = ws.support_size_.data();
    return s;
  }

  static absl::Status Seed(const DecodeShape& shape, int top_k, const ReTopKParams& params,
                           const DeviceSeq& seq, const float* last_queries, int count,
                           std::span<const float> head_taus, ReTopKWorkspace* ws,
                           ReTopKCaches* caches, cudaStream_t stream);
  static absl::Status Step(const DecodeShape& shape, int top_k, const ReTopKParams& params,
                           const DeviceSeq* seqs, const ReTopKCachesView* caches, const float* q,
                           int max_tokens, ReTopKWorkspace* ws, float* o, float* lse,
                           cudaStream_t stream);
};

absl::Status ReTopKCaches::CheckParams(const DecodeShape& shape, int top_k,
                                       const ReTopKParams& params) {
  KVRECALL_CUDA_RETURN_IF_ERROR(shape.Validate());
  KVRECALL_CUDA_RETURN_IF_ERROR(CheckKnobs(shape.q_heads, shape.head_dim, top_k, params));
  const int64_t candidates = ReTopKMaxCandidates(top_k, params);
  if (Log2HashSlots(candidates) > kMaxLog2HashSlots) {
    return absl::InvalidArgumentError(absl::StrCat(
        "reuse_neighbors * top_k + recent_window = ", candidates, " candidates exceed the GPU's ",
        (1 << kMaxLog2HashSlots) / 2));
  }
  return absl::OkStatus();
}

int64_t ReTopKCaches::DeviceBytesFor(int q_heads, int head_dim, int top_k,
                                     const ReTopKParams& params) {
  if (!CheckKnobs(q_heads, head_dim, top_k, params).ok()) return 0;
  return CachesLayout::For(q_heads, head_dim, top_k, params).Bytes();
}

absl::StatusOr<std::unique_ptr<ReTopKCaches>> ReTopKCaches::Create(int q_heads, int head_dim,
                                                                  int top_k,
                                                                  const ReTopKParams& params) {
  KVRECALL_CUDA_RETURN_IF_ERROR(CheckKnobs(q_heads, head_dim, top_k, params));
  const CachesLayout layout = CachesLayout::For(q_heads, head_dim, top_k, params);
  std::unique_ptr<ReTopKCaches> caches(new ReTopKCaches());
  caches->q_heads_ = q_heads;
  caches->head_dim_ = head_dim;
  caches->top_k_ = top_k;
  caches->capacity_ = params.cache_capacity;
  KVRECALL_CUDA_RETURN_IF_ERROR(AllocateZeroed(layout.queries, &caches->queries_));
  KVRECALL_CUDA_RETURN_IF_ERROR(AllocateZeroed(layout.supports, &caches->supports_));
  KVRECALL_CUDA_RETURN_IF_ERROR(AllocateZeroed(layout.sizes, &caches->sizes_));
  KVRECALL_CUDA_RETURN_IF_ERROR(AllocateZeroed(layout.heads, &caches->count_));
  KVRECALL_CUDA_RETURN_IF_ERROR(AllocateZeroed(layout.heads, &caches->oldest_));
  KVRECALL_CUDA_RETURN_IF_ERROR(AllocateZeroed(layout.heads, &caches->tau_));
  const std::vector<float> taus(q_heads, params.tau);
  KVRECALL_CUDA_RETURN_IF_ERROR(
      CopyToDevice(caches->tau_.data(), taus.data(), taus.size() * sizeof(float),
                   "initializing tau"));
  return caches;
}

ReTopKCachesView ReTopKCaches::view() const {
  return ReTopKCachesView{queries_.data(), supports_.data(), sizes_.data(), count_.data(),
                          oldest_.data(),  tau_.data(),      prompt_tokens_};
}

int64_t ReTopKCaches::device_bytes() const {
  return Bytes(queries_) + Bytes(supports_) + Bytes(sizes_) + Bytes(count_) + Bytes(oldest_) +
         Bytes(tau_);
}

int64_t ReTopKWorkspace::DeviceBytesFor(const DecodeShape& max_shape, int top_k,
                                        const ReTopKParams& params, int max_tokens) {
  if (max_tokens < 1 || !ReTopKCaches::CheckParams(max_shape, top_k, params).ok()) return 0;
  return WorkspaceLayout::For(max_shape, top_k, params).Bytes() +
         TopKWorkspace::DeviceBytesFor(max_shape.rows(), max_tokens);
}

absl::StatusOr<std::unique_ptr<ReTopKWorkspace>> ReTopKWorkspace::Create(
    const DecodeShape& max_shape, int top_k, const ReTopKParams& params, int max_tokens) {
  KVRECALL_CUDA_RETURN_IF_ERROR(ReTopKCaches::CheckParams(max_shape, top_k, params));
  if (max_tokens < 1) {
    return absl::InvalidArgumentError(absl::StrCat("max_tokens must be >= 1, got ", max_tokens));
  }
  const int64_t candidates = ReTopKMaxCandidates(top_k, params);
  const int log2_slots = Log2HashSlots(candidates);
  std::unique_ptr<ReTopKWorkspace> ws(new ReTopKWorkspace());
  ws->max_shape_ = max_shape;
  ws->top_k_ = top_k;
  ws->capacity_ = params.cache_capacity;
  ws->max_tokens_ = max_tokens;
  ws->max_candidates_ = static_cast<int>(candidates);
  const WorkspaceLayout l = WorkspaceLayout::For(max_shape, top_k, params);
  KVRECALL_CUDA_RETURN_IF_ERROR(AllocateZeroed(l.unit_q, &ws->unit_q_));
  KVRECALL_CUDA_RETURN_IF_ERROR(AllocateZeroed(l.rows, &ws->paths_));
  KVRECALL_CUDA_RETURN_IF_ERROR(AllocateZeroed(l.rows, &ws->exact_rows_));
  KVRECALL_CUDA_RETURN_IF_ERROR(AllocateZeroed(l.rows, &ws->best_cosine_));
  KVRECALL_CUDA_RETURN_IF_ERROR(AllocateZeroed(l.neighbors, &ws->neighbors_));
  KVRECALL_CUDA_RETURN_IF_ERROR(AllocateZeroed(l.candidates, &ws->candidates_));
  KVRECALL_CUDA_RETURN_IF_ERROR(AllocateZeroed(l.rows, &ws->candidate_count_));
  KVRECALL_CUDA_RETURN_IF_ERROR(AllocateZeroed(l.candidates, &ws->candidate_scores_));
  KVRECALL_CUDA_RETURN_IF_ERROR(AllocateZeroed(l.support, &ws->support_));
  KVRECALL_CUDA_RETURN_IF_ERROR(AllocateZeroed(l.rows, &ws->support_size_));
  KVRECALL_CUDA_RETURN_IF_ERROR(AllocateZeroed(l.batch, &ws->seed_seqs_));
  KVRECALL_CUDA_RETURN_IF_ERROR(AllocateZeroed(l.unit_q, &ws->seed_o_));
  KVRECALL_CUDA_RETURN_IF_ERROR(AllocateZeroed(l.rows, &ws->seed_lse_));
  KVRECALL_CUDA_RETURN_IF_ERROR(AllocateZeroed(l.seed_support, &ws->seed_support_));
  KVRECALL_CUDA_RETURN_IF_ERROR(AllocateZeroed(l.seed_sizes, &ws->seed_sizes_));
  absl::StatusOr<std::unique_ptr<TopKWorkspace>> exact =
      TopKWorkspace::Create(max_shape.rows(), max_tokens);
  if (!exact.ok()) return exact.status();
  ws->exact_ws_ = *std::move(exact);
  // The exact path of a step runs on a stream of the workspace's own, beside the reuse rows.
  KVRECALL_CUDA_RETURN_IF_ERROR(CudaStatus(
      cudaStreamCreateWithFlags(&ws->side_, cudaStreamNonBlocking), "creating a stream"));
  KVRECALL_CUDA_RETURN_IF_ERROR(CudaStatus(
      cudaEventCreateWithFlags(&ws->fork_, cudaEventDisableTiming), "creating an event"));
  KVRECALL_CUDA_RETURN_IF_ERROR(CudaStatus(
      cudaEventCreateWithFlags(&ws->join_, cudaEventDisableTiming), "creating an event"));
  // Kernel attributes are set here, outside any graph capture of a step.
  KVRECALL_CUDA_RETURN_IF_ERROR(KVRECALL_DISPATCH_KV_DTYPE(max_shape.dtype, KvT, [&] {
    return KVRECALL_DISPATCH_HEAD_DIM(max_shape.head_dim, kDim, [&]() -> absl::Status {
      KVRECALL_CUDA_RETURN_IF_ERROR(AllowReuseSmem<KvT, kDim, kReuseThreadsFewRows>(
                                        log2_slots, static_cast<int>(candidates), top_k)
                                        .status());
      return AllowReuseSmem<KvT, kDim, kReuseThreadsManyRows>(
                 log2_slots, static_cast<int>(candidates), top_k)
          .status();
    });
  }));
  return ws;
}

ReTopKWorkspace::~ReTopKWorkspace() {
  if (join_ != nullptr) cudaEventDestroy(join_);
  if (fork_ != nullptr) cudaEventDestroy(fork_);
  if (side_ != nullptr) cudaStreamDestroy(side_);
}

int64_t ReTopKWorkspace::device_bytes() const {
  return Bytes(unit_q_) + Bytes(paths_) + Bytes(exact_rows_) + Bytes(best_cosine_) +
         Bytes(neighbors_) + Bytes(candidates_) + Bytes(candidate_count_) +
         Bytes(candidate_scores_) +
         Bytes(support_) + Bytes(support_size_) + Bytes(seed_seqs_) + Bytes(seed_o_) +
         Bytes(seed_lse_) + Bytes(seed_support_) + Bytes(seed_sizes_) +
         exact_ws_->device_bytes();
}

absl::Status ReTopKWorkspace::CheckFits(const DecodeShape& shape, int top_k,
                                        const ReTopKParams& params, int max_tokens) const {
  KVRECALL_CUDA_RETURN_IF_ERROR(CheckKnobs(shape.q_heads, shape.head_dim, top_k, params));
  if (shape.rows() > max_rows() || shape.q_heads > max_shape_.q_heads ||
      shape.head_dim > max_shape_.head_dim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "batch ", shape.batch, " x ", shape.q_heads, " query heads of dim ", shape.head_dim,
        " exceed the ReTopK workspace's ", max_rows(), " rows of at most ", max_shape_.q_heads,
        " heads of dim ", max_shape_.head_dim));
  }
  if (top_k > top_k_ || params.cache_capacity > capacity_ ||
      ReTopKMaxCandidates(top_k, params) > max_candidates_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "top_k ", top_k, ", cache_capacity ", params.cache_capacity, " and ",
        ReTopKMaxCandidates(top_k, params), " candidates exceed the ReTopK workspace's ",
        top_k_, ", ", capacity_, " and ", max_candidates_));
  }
  if (max_tokens < 1 || max_tokens > max_tokens_) {
    return absl::InvalidArgumentError(absl::StrCat("max_tokens must be in [1, ", max_tokens_,
                                                   "] for this ReTopK workspace, got ",
                                                   max_tokens));
  }
  return absl::OkStatus();
}

absl::Status ReTopKLaunch::Seed(const DecodeShape& shape, int top_k, const ReTopKParams& params,
                                const DeviceSeq& seq, const float* last_queries, int count,
                                std::span<const float> head_taus, ReTopKWorkspace* ws,
                                ReTopKCaches* caches, cudaStream_t stream) {
  if (ws == nullptr || caches == nullptr) {
    return absl::InvalidArgumentError("a ReTopKWorkspace and ReTopKCaches are required");
  }
  DecodeShape one = shape;
  one.batch = 1;
  KVRECALL_CUDA_RETURN_IF_ERROR(one.Validate());
  const int prompt = seq.head_count;
  if (caches->q_heads_ != shape.q_heads || caches->head_dim_ != shape.head_dim ||
      caches->top_k_ != top_k || caches->capacity_ != params.cache_capacity) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the caches hold ", caches->q_heads_, " heads of dim ", caches->head_dim_, ", K ",
        caches->top_k_, ", C ", caches->capacity_, "; seeding asks for ", shape.q_heads, ", ",
        shape.head_dim, ", ", top_k, ", ", params.cache_capacity));
  }
  if (seq.ring_count != 0 || prompt < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "seeding needs a contiguous history, got ", prompt, " tokens and ", seq.ring_count,
        " ring entries"));
  }
  KVRECALL_CUDA_RETURN_IF_ERROR(ws->CheckFits(one, top_k, params, std::max(prompt, 1)));
  if (count != std::min(params.cache_capacity, prompt)) {
    return absl::InvalidArgumentError(absl::StrCat("seeding takes the last min(C, T) = ",
                                                   std::min(params.cache_capacity, prompt),
                                                   " prompt queries, got ", count));
  }
  if (!head_taus.empty() && static_cast<int>(head_taus.size()) != shape.q_heads) {
    return absl::InvalidArgumentError(absl::StrCat("head_taus must have q_heads = ",
                                                   shape.q_heads, " entries, got ",
                                                   head_taus.size()));
  }
  if (count > 0 && last_queries == nullptr) {
    return absl::InvalidArgumentError("last_queries must be a device pointer, got null");
  }
  const int q_heads = shape.q_heads;
  const std::vector<float> taus =
      head_taus.empty() ? std::vector<float>(q_heads, params.tau)
                        : std::vector<float>(head_taus.begin(), head_taus.end());
  KVRECALL_CUDA_RETURN_IF_ERROR(CudaStatus(
      cudaMemcpyAsync(caches->tau_.data(), taus.data(), q_heads * sizeof(float),
                      cudaMemcpyHostToDevice, stream),
      "setting tau"));
  KVRECALL_CUDA_RETURN_IF_ERROR(CudaStatus(
      cudaMemsetAsync(caches->count_.data(), 0, q_heads * sizeof(int32_t), stream),
      "clearing the cache"));
  KVRECALL_CUDA_RETURN_IF_ERROR(CudaStatus(
      cudaMemsetAsync(caches->oldest_.data(), 0, q_heads * sizeof(int32_t), stream),
      "clearing the cache"));

  // Exact supports of the seeding queries, as many per launch as the workspace has rows for:
  // query i sees the prefix [0, prompt - count + i + 1).
  std::vector<DeviceSeq> prefixes(count);
  for (int i = 0; i < count; ++i) {
    prefixes[i] = DeviceSeq::Contiguous(seq.keys, seq.values, prompt - count + i + 1);
  }
  const int per_launch = std::min(ws->max_batch(), ws->max_rows() / q_heads);
  const int64_t row_floats = static_cast<int64_t>(q_heads) * shape.head_dim;
  for (int c0 = 0; c0 < count; c0 += per_launch) {
    const int m = std::min(per_launch, count - c0);
    KVRECALL_CUDA_RETURN_IF_ERROR(CudaStatus(
        cudaMemcpyAsync(ws->seed_seqs_.data(), prefixes.data() + c0, m * sizeof(DeviceSeq),
                        cudaMemcpyHostToDevice, stream),
        "uploading seeding prefixes"));
    DecodeShape chunk = shape;
    chunk.batch = m;
    KVRECALL_CUDA_RETURN_IF_ERROR(ExactTopKAttention(
        chunk, ws->seed_seqs_.data(), last_queries + c0 * row_floats, prompt, top_k, nullptr,
        ws->exact_ws_.get(), ws->seed_support_.data() + static_cast<int64_t>(c0) * q_heads * top_k,
        ws->seed_sizes_.data() + static_cast<int64_t>(c0) * q_heads, ws->seed_o_.data(),
        ws->seed_lse_.data(), stream));
    // The host copies above must not be overwritten while in flight.
    KVRECALL_CUDA_RETURN_IF_ERROR(
        CudaStatus(cudaStreamSynchronize(stream), "seeding the ReTopK cache"));
  }
  if (count > 0) {
    const ReTopKCachesView view = caches->view();
    KVRECALL_CUDA_RETURN_IF_ERROR(KVRECALL_DISPATCH_HEAD_DIM(shape.head_dim, kDim, [&] {
      ReTopKSeedKernel<kDim, kSeedThreads><<<dim3(count, q_heads), kSeedThreads, 0, stream>>>(
          view, q_heads, params.cache_capacity, top_k, last_queries, count,
          ws->seed_support_.data(), ws->seed_sizes_.data());
      return LaunchStatus("ReTopKSeedKernel");
    }));
  }
  KVRECALL_CUDA_RETURN_IF_ERROR(
      CudaStatus(cudaStreamSynchronize(stream), "seeding the ReTopK cache"));
  caches->prompt_tokens_ = prompt;
  return absl::OkStatus();
}

absl::Status ReTopKLaunch::Step(const DecodeShape& shape, int top_k, const ReTopKParams& params,
                                const DeviceSeq* seqs, const ReTopKCachesView* caches,
                                const float* q, int max_tokens, ReTopKWorkspace* ws, float* o,
                                float* lse, cudaStream_t stream) {
  KVRECALL_CUDA_RETURN_IF_ERROR(shape.Validate());
  if (ws == nullptr) return absl::InvalidArgumentError("a ReTopKWorkspace is required");
  KVRECALL_CUDA_RETURN_IF_ERROR(ws->CheckFits(shape, top_k, params, max_tokens));
  if (seqs == nullptr || caches == nullptr || q == nullptr || o == nullptr || lse == nullptr) {
    return absl::InvalidArgumentError(
        "seqs, caches, q, o and lse must be device pointers, got null");
  }
  const int rows = shape.rows();
  const int max_candidates = static_cast<int>(ReTopKMaxCandidates(top_k, params));
  const int log2_slots = Log2HashSlots(max_candidates);
  ReTopKStepParams p{State(shape, top_k, params, *ws), seqs, caches, q, log2_slots, 0};
  const absl::StatusOr<int> sms = MultiprocessorCount();
  if (!sms.ok()) return sms.status();
  absl::StatusOr<ScoreKeysParams> exact =
      ExactTopKParams(shape, seqs, q, max_tokens, top_k, ws->exact_rows_.data(),
                      ws->exact_ws_.get(), ws->support_.data(), ws->support_size_.data());
  if (!exact.ok()) return exact.status();
  return KVRECALL_DISPATCH_KV_DTYPE(shape.dtype, KvT, [&] {
    return KVRECALL_DISPATCH_HEAD_DIM(shape.head_dim, kDim, [&]() -> absl::Status {
      ReTopKDecideKernel<kDim, kReTopKDecideThreads>
          <<<rows, kReTopKDecideThreads, 0, stream>>>(p);
      KVRECALL_CUDA_RETURN_IF_ERROR(LaunchStatus("ReTopKDecideKernel"));
      // Refresh and fallback rows on the side stream, reuse rows here, joined at the end.
      KVRECALL_CUDA_RETURN_IF_ERROR(
          CudaStatus(cudaEventRecord(ws->fork_, stream), "forking the exact path"));
      KVRECALL_CUDA_RETURN_IF_ERROR(
          CudaStatus(cudaStreamWaitEvent(ws->side_, ws->fork_, 0), "forking the exact path"));
      KVRECALL_CUDA_RETURN_IF_ERROR(LaunchExactTopK(
          shape, *exact, max_tokens,
          [&]<typename T, int kD>() {
            return ReTopKExactFinish<T, kD, kRowPassThreads>{
                AttendFinish<T, kD, kRowPassThreads>{seqs, shape.q_heads, shape.kv_heads, o,
                                                     lse},
                caches, ws->unit_q_.data(), params.cache_capacity, top_k};
          },
          ws->side_));
      KVRECALL_CUDA_RETURN_IF_ERROR(
          CudaStatus(cudaEventRecord(ws->join_, ws->side_), "joining the exact path"));
      auto reuse = [&](auto threads) -> absl::Status {
        constexpr int kThreads = decltype(threads)::value;
        const absl::StatusOr<int> pool =
            AllowReuseSmem<KvT, kDim, kThreads>(log2_slots, max_candidates, top_k);
        if (!pool.ok()) return pool.status();
        p.pool_bytes = *pool;
        ReTopKReuseKernel<KvT, kDim, kThreads>
            <<<rows, kThreads, ReuseSmemBytes(*pool, max_candidates, top_k), stream>>>(p, o, lse);
        return LaunchStatus("ReTopKReuseKernel");
      };
      KVRECALL_CUDA_RETURN_IF_ERROR(
          rows <= *sms ? reuse(std::integral_constant<int, kReuseThreadsFewRows>{})
                       : reuse(std::integral_constant<int, kReuseThreadsManyRows>{}));
      return CudaStatus(cudaStreamWaitEvent(stream, ws->join_, 0), "joining the exact path");
    });
  });
}

absl::Status SeedReTopKCaches(const DecodeShape& shape, int top_k, const ReTopKParams& params,
                              const DeviceSeq& seq, const float* last_queries, int count,
                              std::span<const float> head_taus, ReTopKWorkspace* ws,
                              ReTopKCaches* caches, cudaStream_t stream) {
  return ReTopKLaunch::Seed(shape, top_k, params, seq, last_queries, count, head_taus, ws, caches,
                            stream);
}

absl::Status ReTopKStep(const DecodeShape& shape, int top_k, const ReTopKParams& params,
                        const DeviceSeq* seqs, const ReTopKCachesView* caches, const float* q,
                        int max_tokens, ReTopKWorkspace* ws, float* o, float* lse,
                        cudaStream_t stream) {
  return ReTopKLaunch::Step(shape, top_k, params, seqs, caches, q, max_tokens, ws, o, lse,
                            stream);
}

}  // namespace kvrecall::cuda
