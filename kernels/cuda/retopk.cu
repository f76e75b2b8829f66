#include "kernels/cuda/retopk.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/exact_topk.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/retopk.cuh"

namespace kvrecall::cuda {
namespace {

constexpr int kSelectThreads = 256;
// Finish blocks: 512 threads while every row has a multiprocessor to itself (one row's latency
// is the step's), 256 when rows outnumber multiprocessors, so that two blocks share one and all
// rows run in one wave (measured at batch 8: 40 -> 35 us; at batch 1 the 256-thread block is
// slower, 16 -> 21 us).
constexpr int kFinishThreadsFewRows = 512;
constexpr int kFinishThreadsManyRows = 256;
constexpr int kSeedThreads = 128;
// The candidate set lives in shared memory at most half full: 2^15 slots (128 KB).
constexpr int kMaxLog2HashSlots = 15;

}  // namespace

ReTopKDeviceState ReTopKGpuLayer::DeviceView() const {
  ReTopKDeviceState s{};
  s.q_heads = shape_.q_heads;
  s.kv_heads = shape_.kv_heads;
  s.capacity = params_.cache_capacity;
  s.neighbors = params_.reuse_neighbors;
  s.window = params_.recent_window;
  s.top_k = top_k_;
  s.refresh_interval = params_.refresh_interval;
  s.max_candidates = max_candidates_;
  s.scale_log2 = shape_.scale * kLog2e;
  s.cache_queries = cache_queries_.data();
  s.cache_supports = cache_supports_.data();
  s.cache_sizes = cache_sizes_.data();
  s.cache_count = cache_count_.data();
  s.cache_oldest = cache_oldest_.data();
  s.tau = tau_.data();
  s.prompt_tokens = prompt_tokens_.data();
  s.unit_q = unit_q_.data();
  s.paths = paths_.data();
  s.exact_rows = exact_rows_.data();
  s.best_cosine = best_cosine_.data();
  s.candidates = candidates_.data();
  s.candidate_count = candidate_count_.data();
  s.candidate_scores = candidate_scores_.data();
  s.support = support_.data();
  s.support_size = support_size_.data();
  return s;
}

absl::StatusOr<std::unique_ptr<ReTopKGpuLayer>> ReTopKGpuLayer::Create(
    const DecodeShape& shape, int top_k, const ReTopKParams& params, int max_tokens) {
  KVRECALL_CUDA_RETURN_IF_ERROR(shape.Validate());
  if (top_k < 1 || max_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("need top_k >= 1 and max_tokens >= 1, got ", top_k, " and ", max_tokens));
  }
  if (params.cache_capacity < 1 || params.cache_capacity > kMaxCacheCapacity) {
    return absl::InvalidArgumentError(absl::StrCat("cache_capacity must be in [1, ",
                                                   kMaxCacheCapacity, "] on the GPU, got ",
                                                   params.cache_capacity));
  }
  if (params.reuse_neighbors < 1 || params.recent_window < 0 || params.refresh_interval < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "need reuse_neighbors >= 1, recent_window >= 0, refresh_interval >= 0; got ",
        params.reuse_neighbors, ", ", params.recent_window, ", ", params.refresh_interval));
  }
  std::unique_ptr<ReTopKGpuLayer> layer(new ReTopKGpuLayer());
  layer->shape_ = shape;
  layer->top_k_ = top_k;
  layer->params_ = params;
  layer->max_tokens_ = max_tokens;
  const int64_t candidates =
      static_cast<int64_t>(std::min(params.reuse_neighbors, params.cache_capacity)) * top_k +
      params.recent_window;
  int log2_slots = 1;
  while ((int64_t{1} << log2_slots) < 2 * candidates) ++log2_slots;
  if (log2_slots > kMaxLog2HashSlots) {
    return absl::InvalidArgumentError(absl::StrCat(
        "reuse_neighbors * top_k + recent_window = ", candidates, " candidates exceed the GPU's ",
        (1 << kMaxLog2HashSlots) / 2));
  }
  layer->max_candidates_ = static_cast<int>(candidates);
  layer->log2_hash_slots_ = log2_slots;

  const size_t rows = shape.rows();
  const size_t c = params.cache_capacity;
  const size_t d = shape.head_dim;
  KVRECALL_CUDA_RETURN_IF_ERROR(AllocateZeroed(rows * c * d, &layer->cache_queries_));
  KVRECALL_CUDA_RETURN_IF_ERROR(AllocateZeroed(rows * c * top_k, &layer->cache_supports_));
  KVRECALL_CUDA_RETURN_IF_ERROR(AllocateZeroed(rows * c, &layer->cache_sizes_));
  KVRECALL_CUDA_RETURN_IF_ERROR(AllocateZeroed(rows, &layer->cache_count_));
  KVRECALL_CUDA_RETURN_IF_ERROR(AllocateZeroed(rows, &layer->cache_oldest_));
  KVRECALL_CUDA_RETURN_IF_ERROR(AllocateZeroed(rows, &layer->tau_));
  KVRECALL_CUDA_RETURN_IF_ERROR(AllocateZeroed(shape.batch, &layer->prompt_tokens_));
  KVRECALL_CUDA_RETURN_IF_ERROR(AllocateZeroed(rows * d, &layer->unit_q_));
  KVRECALL_CUDA_RETURN_IF_ERROR(AllocateZeroed(rows, &layer->paths_));
  KVRECALL_CUDA_RETURN_IF_ERROR(AllocateZeroed(rows, &layer->exact_rows_));
  KVRECALL_CUDA_RETURN_IF_ERROR(AllocateZeroed(rows, &layer->best_cosine_));
  KVRECALL_CUDA_RETURN_IF_ERROR(AllocateZeroed(rows * candidates, &layer->candidates_));
  KVRECALL_CUDA_RETURN_IF_ERROR(AllocateZeroed(rows, &layer->candidate_count_));
  KVRECALL_CUDA_RETURN_IF_ERROR(AllocateZeroed(rows * candidates, &layer->candidate_scores_));
  KVRECALL_CUDA_RETURN_IF_ERROR(AllocateZeroed(rows * top_k, &layer->support_));
  KVRECALL_CUDA_RETURN_IF_ERROR(AllocateZeroed(rows, &layer->support_size_));
  KVRECALL_CUDA_RETURN_IF_ERROR(AllocateZeroed(shape.batch, &layer->seed_seqs_));
  KVRECALL_CUDA_RETURN_IF_ERROR(AllocateZeroed(rows * d, &layer->seed_o_));
  KVRECALL_CUDA_RETURN_IF_ERROR(AllocateZeroed(rows, &layer->seed_lse_));
  KVRECALL_CUDA_RETURN_IF_ERROR(AllocateZeroed(c * shape.q_heads * top_k, &layer->seed_support_));
  KVRECALL_CUDA_RETURN_IF_ERROR(AllocateZeroed(c * shape.q_heads, &layer->seed_sizes_));
  absl::StatusOr<std::unique_ptr<TopKWorkspace>> ws =
      TopKWorkspace::Create(static_cast<int>(rows), max_tokens);
  if (!ws.ok()) return ws.status();
  layer->exact_ws_ = *std::move(ws);
  const std::vector<float> taus(rows, params.tau);
  KVRECALL_CUDA_RETURN_IF_ERROR(CudaStatus(
      cudaMemcpy(layer->tau_.data(), taus.data(), rows * sizeof(float), cudaMemcpyHostToDevice),
      "initializing tau"));
  const int hash_bytes = 4 << log2_slots;
  KVRECALL_CUDA_RETURN_IF_ERROR(KVRECALL_DISPATCH_KV_DTYPE(shape.dtype, KvT, [&] {
    return KVRECALL_DISPATCH_HEAD_DIM(shape.head_dim, kDim, [&]() -> absl::Status {
      KVRECALL_CUDA_RETURN_IF_ERROR(
          AllowDynamicSharedMemory<&ReTopKSelectKernel<kDim, kSelectThreads>>(hash_bytes));
      KVRECALL_CUDA_RETURN_IF_ERROR(
          AllowDynamicSharedMemory<&ReTopKFinishKernel<KvT, kDim, kFinishThreadsFewRows>>(
              FinishSmemBytes(top_k)));
      return AllowDynamicSharedMemory<&ReTopKFinishKernel<KvT, kDim, kFinishThreadsManyRows>>(
          FinishSmemBytes(top_k));
    });
  }));
  return layer;
}

absl::Status ReTopKGpuLayer::Seed(int b, const DeviceSeq& seq, const float* last_queries,
                                  int count, std::span<const float> head_taus,
                                  cudaStream_t stream) {
  const int prompt = seq.head_count;
  if (b < 0 || b >= shape_.batch) {
    return absl::InvalidArgumentError(
        absl::StrCat("sequence slot ", b, " outside [0, ", shape_.batch, ")"));
  }
  if (seq.ring_count != 0 || prompt > max_tokens_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "seeding needs a contiguous history of at most ", max_tokens_, " tokens, got ", prompt,
        " tokens and ", seq.ring_count, " ring entries"));
  }
  if (count != std::min(params_.cache_capacity, prompt)) {
    return absl::InvalidArgumentError(absl::StrCat("seeding takes the last min(C, T) = ",
                                                   std::min(params_.cache_capacity, prompt),
                                                   " prompt queries, got ", count));
  }
  if (!head_taus.empty() && static_cast<int>(head_taus.size()) != shape_.q_heads) {
    return absl::InvalidArgumentError(absl::StrCat("head_taus must have q_heads = ",
                                                   shape_.q_heads, " entries, got ",
                                                   head_taus.size()));
  }
  if (count > 0 && last_queries == nullptr) {
    return absl::InvalidArgumentError("last_queries must be a device pointer, got null");
  }
  const int q_heads = shape_.q_heads;
  const int64_t row0 = static_cast<int64_t>(b) * q_heads;
  const std::vector<float> taus =
      head_taus.empty() ? std::vector<float>(q_heads, params_.tau)
                        : std::vector<float>(head_taus.begin(), head_taus.end());
  KVRECALL_CUDA_RETURN_IF_ERROR(CudaStatus(
      cudaMemcpyAsync(tau_.data() + row0, taus.data(), q_heads * sizeof(float),
                      cudaMemcpyHostToDevice, stream),
      "setting tau"));
  KVRECALL_CUDA_RETURN_IF_ERROR(CudaStatus(
      cudaMemcpyAsync(prompt_tokens_.data() + b, &prompt, sizeof prompt, cudaMemcpyHostToDevice,
                      stream),
      "setting the prompt length"));
  KVRECALL_CUDA_RETURN_IF_ERROR(CudaStatus(
      cudaMemsetAsync(cache_count_.data() + row0, 0, q_heads * sizeof(int32_t), stream),
      "clearing the cache"));
  KVRECALL_CUDA_RETURN_IF_ERROR(CudaStatus(
      cudaMemsetAsync(cache_oldest_.data() + row0, 0, q_heads * sizeof(int32_t), stream),
      "clearing the cache"));

  // Exact supports of the seeding queries, up to `batch` of them per launch: query i sees the
  // prefix [0, prompt - count + i + 1).
  std::vector<DeviceSeq> prefixes(count);
  for (int i = 0; i < count; ++i) {
    prefixes[i] = DeviceSeq::Contiguous(seq.keys, seq.values, prompt - count + i + 1);
  }
  const int64_t row_floats = static_cast<int64_t>(q_heads) * shape_.head_dim;
  for (int c0 = 0; c0 < count; c0 += shape_.batch) {
    const int m = std::min(shape_.batch, count - c0);
    KVRECALL_CUDA_RETURN_IF_ERROR(CudaStatus(
        cudaMemcpyAsync(seed_seqs_.data(), prefixes.data() + c0, m * sizeof(DeviceSeq),
                        cudaMemcpyHostToDevice, stream),
        "uploading seeding prefixes"));
    DecodeShape chunk = shape_;
    chunk.batch = m;
    KVRECALL_CUDA_RETURN_IF_ERROR(ExactTopKAttention(
        chunk, seed_seqs_.data(), last_queries + c0 * row_floats, prompt, top_k_, nullptr,
        exact_ws_.get(), seed_support_.data() + static_cast<int64_t>(c0) * q_heads * top_k_,
        seed_sizes_.data() + static_cast<int64_t>(c0) * q_heads, seed_o_.data(),
        seed_lse_.data(), stream));
    // The host copies above must not be overwritten while in flight.
    KVRECALL_CUDA_RETURN_IF_ERROR(
        CudaStatus(cudaStreamSynchronize(stream), "seeding the ReTopK cache"));
  }
  if (count > 0) {
    const ReTopKDeviceState state = DeviceView();
    KVRECALL_CUDA_RETURN_IF_ERROR(KVRECALL_DISPATCH_HEAD_DIM(shape_.head_dim, kDim, [&] {
      ReTopKSeedKernel<kDim, kSeedThreads><<<dim3(count, q_heads), kSeedThreads, 0, stream>>>(
          state, b, last_queries, count, seed_support_.data(), seed_sizes_.data(), prompt);
      return LaunchStatus("ReTopKSeedKernel");
    }));
  }
  return CudaStatus(cudaStreamSynchronize(stream), "seeding the ReTopK cache");
}

absl::Status ReTopKGpuLayer::Step(int batch, const DeviceSeq* seqs, const float* q,
                                  int max_tokens, float* o, float* lse, cudaStream_t stream) {
  if (batch < 1 || batch > shape_.batch) {
    return absl::InvalidArgumentError(
        absl::StrCat("batch must be in [1, ", shape_.batch, "], got ", batch));
  }
  if (max_tokens < 1 || max_tokens > max_tokens_) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_tokens must be in [1, ", max_tokens_, "], got ", max_tokens));
  }
  if (seqs == nullptr || q == nullptr || o == nullptr || lse == nullptr) {
    return absl::InvalidArgumentError("seqs, q, o and lse must be device pointers, got null");
  }
  DecodeShape shape = shape_;
  shape.batch = batch;
  const int rows = shape.rows();
  const ReTopKStepParams params{DeviceView(), seqs, q, log2_hash_slots_};
  const absl::StatusOr<int> sms = MultiprocessorCount();
  if (!sms.ok()) return sms.status();
  return KVRECALL_DISPATCH_KV_DTYPE(shape.dtype, KvT, [&] {
    return KVRECALL_DISPATCH_HEAD_DIM(shape.head_dim, kDim, [&]() -> absl::Status {
      ReTopKSelectKernel<kDim, kSelectThreads>
          <<<rows, kSelectThreads, 4 << log2_hash_slots_, stream>>>(params);
      KVRECALL_CUDA_RETURN_IF_ERROR(LaunchStatus("ReTopKSelectKernel"));
      KVRECALL_CUDA_RETURN_IF_ERROR(ExactTopKAttention(shape, seqs, q, max_tokens, top_k_,
                                                       exact_rows_.data(), exact_ws_.get(),
                                                       support_.data(), support_size_.data(), o,
                                                       lse, stream));
      if (rows <= *sms) {
        ReTopKFinishKernel<KvT, kDim, kFinishThreadsFewRows>
            <<<rows, kFinishThreadsFewRows, FinishSmemBytes(top_k_), stream>>>(params, o, lse);
      } else {
        ReTopKFinishKernel<KvT, kDim, kFinishThreadsManyRows>
            <<<rows, kFinishThreadsManyRows, FinishSmemBytes(top_k_), stream>>>(params, o, lse);
      }
      return LaunchStatus("ReTopKFinishKernel");
    });
  });
}

}  // namespace kvrecall::cuda
