#include "kernels/cuda/retopk_match.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/retopk.cuh"

namespace kvrecall::cuda {
namespace {

constexpr int kUnionThreads = 256;
constexpr int kPushThreads = 128;
// Support ids each thread loads before it marks them, so that the loads overlap.
constexpr int kUnionLoadBatch = 4;

struct ReTopKUnionParams {
  const DeviceSeq* seqs;          // [batch]
  const ReTopKCachesView* caches; // [batch]
  const uint8_t* paths;           // [rows]
  const int32_t* neighbors;       // [rows, 1 + capacity]
  int32_t* candidate_count;       // [rows]
  int32_t* candidates;            // [rows, max_candidates]
  unsigned* errors;
  int q_heads;
  int head_dim;
  int capacity;
  int top_k;
  int window;
  int max_candidates;
  int max_tokens;                 // the bound of every n
  int max_words;                  // bitmap words of max_tokens
};

// Shared memory of ReTopKUnionKernel beyond its static part: the bitmap of the history, then
// the candidates in order.
size_t UnionSmemBytes(int max_words, int max_candidates) {
  return 4 * (static_cast<size_t>(max_words) + static_cast<size_t>(max_candidates));
}

int BitmapWords(int max_tokens) { return (max_tokens + 31) / 32; }

// One block per row; rows the decision did not send to reuse return at once. Marks the R
// entries' supports and the last W positions in a bitmap of the history [0, n) (deduplication
// for free), then lists the set bits in order: each thread owns a run of words, a block scan
// gives each run its offset, the list is staged in shared memory and written out coalesced.
template <int kThreads>
__global__ void __launch_bounds__(kThreads) ReTopKUnionKernel(const ReTopKUnionParams p) {
  extern __shared__ uint32_t bits[];  // [max_words], then the staged candidates
  __shared__ uint32_t scan_scratch[32];
  __shared__ uint32_t total;
  const int row = blockIdx.x;
  if (p.paths[row] != kPathReuse) return;
  const int b = row / p.q_heads;
  const int h = row - b * p.q_heads;
  int32_t n = SeqSize(p.seqs[b]);
  if (n > p.max_tokens) {
    if (threadIdx.x == 0) atomicOr(p.errors, kErrorSeqTooLong);
    n = p.max_tokens;
  }
  const int words = (n + 31) / 32;
  for (int w = threadIdx.x; w < words; w += kThreads) bits[w] = 0u;
  __syncthreads();

  const int32_t* neighbors = p.neighbors + static_cast<int64_t>(row) * (1 + p.capacity);
  const int r = neighbors[0];
  const HeadCache cache = HeadCacheOf(p.caches[b], h, p.capacity, p.top_k, p.head_dim);
  bool out_of_range = false;
  auto mark = [&](int32_t id) { atomicOr(bits + (id >> 5), 1u << (id & 31)); };
  for (int i = 0; i < r; ++i) {
    const int slot = neighbors[1 + i];
    const int size = min(cache.sizes[slot], p.top_k);
    const int32_t* support = cache.supports + static_cast<int64_t>(slot) * p.top_k;
    for (int j0 = threadIdx.x; j0 < size; j0 += kThreads * kUnionLoadBatch) {
      int32_t id[kUnionLoadBatch];
#pragma unroll
      for (int u = 0; u < kUnionLoadBatch; ++u) {
        const int j = j0 + u * kThreads;
        id[u] = j < size ? support[j] : -1;
      }
#pragma unroll
      for (int u = 0; u < kUnionLoadBatch; ++u) {
        if (j0 + u * kThreads >= size) continue;
        if (id[u] >= 0 && id[u] < n) {
          mark(id[u]);
        } else {
          out_of_range = true;
        }
      }
    }
  }
  for (int32_t t = max(0, n - p.window) + static_cast<int32_t>(threadIdx.x); t < n;
       t += kThreads) {
    mark(t);
  }
  if (out_of_range) atomicOr(p.errors, kErrorIndexOutOfRange);
  __syncthreads();

  // Thread t lists the set bits of words [t * per, (t + 1) * per), after those of the threads
  // before it.
  const int per = (words + kThreads - 1) / kThreads;
  const int w0 = min(words, static_cast<int>(threadIdx.x) * per);
  const int w1 = min(words, w0 + per);
  uint32_t mine = 0;
  for (int w = w0; w < w1; ++w) mine += __popc(bits[w]);
  const uint32_t end = BlockInclusiveScan<kThreads>(mine, scan_scratch);
  int32_t* staged = reinterpret_cast<int32_t*>(bits + p.max_words);
  uint32_t at = end - mine;
  for (int w = w0; w < w1; ++w) {
    for (uint32_t x = bits[w]; x != 0u; x &= x - 1u) {
      // At most R * K + W distinct ids were marked; the bound only guards the buffer.
      if (at < static_cast<uint32_t>(p.max_candidates)) staged[at] = w * 32 + __ffs(x) - 1;
      ++at;
    }
  }
  if (threadIdx.x == kThreads - 1) total = min(end, static_cast<uint32_t>(p.max_candidates));
  __syncthreads();
  const int count = static_cast<int>(total);
  int32_t* out = p.candidates + static_cast<int64_t>(row) * p.max_candidates;
  for (int i = threadIdx.x; i < count; i += kThreads) out[i] = staged[i];
  if (threadIdx.x == 0) p.candidate_count[row] = count;
}

// One block per row: appends (unit_q[row], supports[row, 0:sizes[row]]) to the row's cache.
template <int kThreads>
__global__ void __launch_bounds__(kThreads)
    ReTopKPushKernel(const ReTopKCachesView* caches, int q_heads, int capacity, int top_k,
                     int head_dim, const float* unit_q, const int32_t* supports,
                     const int32_t* sizes, unsigned* errors) {
  const int row = blockIdx.x;
  const int b = row / q_heads;
  const int h = row - b * q_heads;
  int size = sizes[row];
  if (size < 0 || size > top_k) {
    if (threadIdx.x == 0) atomicOr(errors, kErrorCountOutOfRange);
    size = max(0, min(size, top_k));
  }
  PushCacheEntry<kThreads>(HeadCacheOf(caches[b], h, capacity, top_k, head_dim), capacity, top_k,
                           head_dim, unit_q + static_cast<int64_t>(row) * head_dim,
                           supports + static_cast<int64_t>(row) * top_k, size);
}

}  // namespace

// The workspace's private parts, for the functions below.
struct ReTopKMatchLaunch {
  static absl::Status Match(const DecodeShape& shape, int top_k, const ReTopKParams& params,
                            const DeviceSeq* seqs, const ReTopKCachesView* caches,
                            const float* q, int max_tokens, ReTopKMatchWorkspace* ws,
                            const ReTopKMatchOutputs& out, cudaStream_t stream) {
    if (ws == nullptr) return absl::InvalidArgumentError("a ReTopKMatchWorkspace is required");
    KVRECALL_CUDA_RETURN_IF_ERROR(ws->CheckFits(shape, top_k, params, max_tokens));
    if (seqs == nullptr || caches == nullptr || q == nullptr || out.unit_q == nullptr ||
        out.paths == nullptr || out.best_cosine == nullptr || out.neighbors == nullptr ||
        out.candidate_count == nullptr) {
      return absl::InvalidArgumentError(
          "seqs, caches, q and every output but candidates must be device pointers, got null");
    }
    const int rows = shape.rows();
    const int max_candidates = static_cast<int>(ReTopKMaxCandidates(top_k, params));
    ReTopKStepState s = ReTopKStepKnobs(shape, top_k, params);
    s.unit_q = out.unit_q;
    s.paths = out.paths;
    s.exact_rows = ws->exact_rows_.data();
    s.best_cosine = out.best_cosine;
    s.neighbors_of = out.neighbors;
    s.candidate_count = out.candidate_count;
    const ReTopKStepParams decide{s, seqs, caches, q, /*log2_hash_slots=*/0, /*pool_bytes=*/0};
    KVRECALL_CUDA_RETURN_IF_ERROR(KVRECALL_DISPATCH_HEAD_DIM(shape.head_dim, kDim, [&] {
      ReTopKDecideKernel<kDim, kReTopKDecideThreads>
          <<<rows, kReTopKDecideThreads, 0, stream>>>(decide);
      return LaunchStatus("ReTopKDecideKernel");
    }));
    if (out.candidates == nullptr) return absl::OkStatus();
    const int max_words = BitmapWords(max_tokens);
    const ReTopKUnionParams u{seqs,
                              caches,
                              out.paths,
                              out.neighbors,
                              out.candidate_count,
                              out.candidates,
                              ws->errors_.device_word(),
                              shape.q_heads,
                              shape.head_dim,
                              params.cache_capacity,
                              top_k,
                              params.recent_window,
                              max_candidates,
                              max_tokens,
                              max_words};
    const size_t smem = UnionSmemBytes(max_words, max_candidates);
    KVRECALL_CUDA_RETURN_IF_ERROR(
        AllowDynamicSharedMemory<&ReTopKUnionKernel<kUnionThreads>>(smem));
    ReTopKUnionKernel<kUnionThreads><<<rows, kUnionThreads, smem, stream>>>(u);
    return LaunchStatus("ReTopKUnionKernel");
  }

  static absl::Status Push(const DecodeShape& shape, int top_k, const ReTopKParams& params,
                           const ReTopKCachesView* caches, const float* unit_q,
                           const int32_t* supports, const int32_t* sizes,
                           ReTopKMatchWorkspace* ws, cudaStream_t stream) {
    if (ws == nullptr) return absl::InvalidArgumentError("a ReTopKMatchWorkspace is required");
    KVRECALL_CUDA_RETURN_IF_ERROR(ws->CheckFits(shape, top_k, params, ws->max_tokens_));
    if (caches == nullptr || unit_q == nullptr || supports == nullptr || sizes == nullptr) {
      return absl::InvalidArgumentError(
          "caches, unit_q, supports and sizes must be device pointers, got null");
    }
    ReTopKPushKernel<kPushThreads><<<shape.rows(), kPushThreads, 0, stream>>>(
        caches, shape.q_heads, params.cache_capacity, top_k, shape.head_dim, unit_q, supports,
        sizes, ws->errors_.device_word());
    return LaunchStatus("ReTopKPushKernel");
  }
};

absl::StatusOr<std::unique_ptr<ReTopKMatchWorkspace>> ReTopKMatchWorkspace::Create(
    const DecodeShape& max_shape, int top_k, const ReTopKParams& params, int max_tokens) {
  KVRECALL_CUDA_RETURN_IF_ERROR(ReTopKCaches::CheckParams(max_shape, top_k, params));
  if (max_tokens < 1) {
    return absl::InvalidArgumentError(absl::StrCat("max_tokens must be >= 1, got ", max_tokens));
  }
  const absl::StatusOr<int> smem_limit = MaxSharedMemoryPerBlock();
  if (!smem_limit.ok()) return smem_limit.status();
  const int max_candidates = static_cast<int>(ReTopKMaxCandidates(top_k, params));
  const size_t smem = UnionSmemBytes(BitmapWords(max_tokens), max_candidates);
  // The kernel's static shared memory: the scan's 32 words and the total.
  if (smem + 33 * 4 > static_cast<size_t>(*smem_limit)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_tokens ", max_tokens, " with ", max_candidates, " candidates needs ", smem,
        " bytes of shared memory for the GPU's candidate union; the device has ", *smem_limit,
        " per block"));
  }
  std::unique_ptr<ReTopKMatchWorkspace> ws(new ReTopKMatchWorkspace());
  ws->max_rows_ = max_shape.rows();
  ws->q_heads_ = max_shape.q_heads;
  ws->head_dim_ = max_shape.head_dim;
  ws->top_k_ = top_k;
  ws->capacity_ = params.cache_capacity;
  ws->max_tokens_ = max_tokens;
  KVRECALL_CUDA_RETURN_IF_ERROR(AllocateZeroed(ws->max_rows_, &ws->exact_rows_));
  absl::StatusOr<KernelErrors> errors = KernelErrors::Create();
  if (!errors.ok()) return errors.status();
  ws->errors_ = *std::move(errors);
  // Kernel attributes are set here, outside any graph capture of a match.
  KVRECALL_CUDA_RETURN_IF_ERROR(
      AllowDynamicSharedMemory<&ReTopKUnionKernel<kUnionThreads>>(smem));
  return ws;
}

int64_t ReTopKMatchWorkspace::device_bytes() const {
  return static_cast<int64_t>(exact_rows_.bytes()) + KernelErrors::kDeviceBytes;
}

absl::Status ReTopKMatchWorkspace::CheckFits(const DecodeShape& shape, int top_k,
                                             const ReTopKParams& params, int max_tokens) const {
  KVRECALL_CUDA_RETURN_IF_ERROR(ReTopKCaches::CheckParams(shape, top_k, params));
  if (shape.rows() > max_rows_ || shape.q_heads != q_heads_ || shape.head_dim != head_dim_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "batch ", shape.batch, " x ", shape.q_heads, " query heads of dim ", shape.head_dim,
        " do not fit the ReTopK match workspace's ", max_rows_, " rows of ", q_heads_,
        " heads of dim ", head_dim_));
  }
  if (top_k > top_k_ || params.cache_capacity != capacity_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "top_k ", top_k, " and cache_capacity ", params.cache_capacity,
        " do not fit the ReTopK match workspace's ", top_k_, " and ", capacity_));
  }
  if (max_tokens < 1 || max_tokens > max_tokens_) {
    return absl::InvalidArgumentError(absl::StrCat("max_tokens must be in [1, ", max_tokens_,
                                                   "] for this ReTopK match workspace, got ",
                                                   max_tokens));
  }
  return absl::OkStatus();
}

absl::Status ReTopKMatch(const DecodeShape& shape, int top_k, const ReTopKParams& params,
                         const DeviceSeq* seqs, const ReTopKCachesView* caches, const float* q,
                         int max_tokens, ReTopKMatchWorkspace* ws, const ReTopKMatchOutputs& out,
                         cudaStream_t stream) {
  return ReTopKMatchLaunch::Match(shape, top_k, params, seqs, caches, q, max_tokens, ws, out,
                                  stream);
}

absl::Status ReTopKPushEntries(const DecodeShape& shape, int top_k, const ReTopKParams& params,
                               const ReTopKCachesView* caches, const float* unit_q,
                               const int32_t* supports, const int32_t* sizes,
                               ReTopKMatchWorkspace* ws, cudaStream_t stream) {
  return ReTopKMatchLaunch::Push(shape, top_k, params, caches, unit_q, supports, sizes, ws,
                                 stream);
}

}  // namespace kvrecall::cuda
