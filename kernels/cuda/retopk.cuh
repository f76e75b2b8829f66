// Templated kernels of ReTopK's GPU step (index/retopk.h is the reference):
//   1. ReTopKDecideKernel: normalizes q, cosines with the C cached queries, the path and the R
//      most similar entries; the exact kernels then serve the refresh and fallback rows (their
//      collect pass ends with ReTopKExactFinish, which pushes the exact support into the cache)
//      while, beside them,
//   2. ReTopKReuseKernel serves the reuse rows: the R entries' supports ∪ the last W positions
//      deduplicated exactly, the candidates scored on tensor cores where the keys lie (no
//      gathered copy), their top K (ties to the lower position), softmax·V, the cache push.
#ifndef KVRECALL_KERNELS_CUDA_RETOPK_CUH_
#define KVRECALL_KERNELS_CUDA_RETOPK_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/exact_topk.cuh"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/retopk.h"
#include "kernels/cuda/selected_attention.cuh"
#include "kernels/cuda/topk_select.cuh"
#include "kernels/selection_path.h"

namespace kvrecall::cuda {

// Path codes on the device: the values of SelectionPath.
inline constexpr uint8_t kPathExact = static_cast<uint8_t>(SelectionPath::kExact);
inline constexpr uint8_t kPathReuse = static_cast<uint8_t>(SelectionPath::kReuse);
inline constexpr uint8_t kPathFallback = static_cast<uint8_t>(SelectionPath::kFallback);
inline constexpr uint8_t kPathRefresh = static_cast<uint8_t>(SelectionPath::kRefresh);

// The knobs of a step and the per-row scratch and results (a ReTopKWorkspace's), device
// memory. A row is one (sequence b, query head h) pair: row = b * q_heads + h.
struct ReTopKStepState {
  int q_heads;
  int kv_heads;
  int capacity;        // C
  int neighbors;       // R
  int window;          // W
  int top_k;           // K
  int refresh_interval;
  int max_candidates;  // R * K + W
  float scale_log2;
  float* unit_q;           // [rows, head_dim]
  uint8_t* paths;          // [rows]
  uint8_t* exact_rows;     // [rows]: 1 when the exact kernels serve the row
  float* best_cosine;      // [rows]
  int32_t* neighbors_of;   // [rows, 1 + C]: how many entries a reuse row unions, then their slots
  int32_t* candidates;     // [rows, max_candidates]: the fallback when they outgrow shared memory
  int32_t* candidate_count;// [rows]: tokens scored to choose the support
  float* candidate_scores; // [rows, max_candidates] (log2 domain), same fallback
  int32_t* support;        // [rows, K]
  int32_t* support_size;   // [rows]
};

// A step's knobs as its state holds them, every pointer null (for the launcher to set).
inline ReTopKStepState ReTopKStepKnobs(const DecodeShape& shape, int top_k,
                                       const ReTopKParams& params) {
  ReTopKStepState s{};
  s.q_heads = shape.q_heads;
  s.kv_heads = shape.kv_heads;
  s.capacity = params.cache_capacity;
  s.neighbors = params.reuse_neighbors;
  s.window = params.recent_window;
  s.top_k = top_k;
  s.refresh_interval = params.refresh_interval;
  s.max_candidates = static_cast<int>(ReTopKMaxCandidates(top_k, params));
  s.scale_log2 = shape.scale * kLog2e;
  return s;
}

// One query head's part of a sequence's caches (ReTopKCachesView).
struct HeadCache {
  float* queries;     // [C, head_dim], by slot
  int32_t* supports;  // [C, K], by slot
  int32_t* sizes;     // [C]
  int32_t* count;
  int32_t* oldest;
};

__device__ __forceinline__ HeadCache HeadCacheOf(const ReTopKCachesView& v, int h, int capacity,
                                                 int top_k, int head_dim) {
  const int64_t e = static_cast<int64_t>(h) * capacity;
  return HeadCache{v.queries + e * head_dim, v.supports + e * top_k, v.sizes + e, v.count + h,
                   v.oldest + h};
}

// unit[0:kDim] (shared) = x / ||x|| (zero for a zero x), as cpu::Normalize. One whole block.
template <int kDim, int kThreads>
__device__ void NormalizeToShared(const float* x, float* unit, float* scratch) {
  static_assert(kThreads >= kDim);
  const float v = threadIdx.x < kDim ? x[threadIdx.x] : 0.0f;
  const float norm = sqrtf(BlockSum<kThreads>(v * v, scratch));
  const float inv = norm > 0.0f ? 1.0f / norm : 0.0f;
  if (threadIdx.x < kDim) unit[threadIdx.x] = v * inv;
  __syncthreads();
}

struct ReTopKStepParams {
  ReTopKStepState state;
  const DeviceSeq* seqs;             // [batch]
  const ReTopKCachesView* caches;    // [batch]
  const float* q;                    // [batch, q_heads, head_dim]
  int log2_hash_slots;
  int pool_bytes;                    // ReTopKReuseKernel's first shared-memory region
};

// Threads of a ReTopKDecideKernel block, wherever it is launched (the step, the match alone).
inline constexpr int kReTopKDecideThreads = 128;

// One block per row: the step's path (ChooseReTopKPath) and, for reuse, the R most similar
// entries (cpu::TopKPositions over ages: ties to the older). Every cached slot is loaded at
// once (ages are mapped afterwards), with the query, so the decision waits on two round trips:
// the descriptors, then the cache.
template <int kDim, int kThreads>
__global__ void __launch_bounds__(kThreads) ReTopKDecideKernel(const ReTopKStepParams p) {
  constexpr int kWarps = kThreads / 32;
  constexpr int kSlotsPerWarp = kMaxGpuReTopKCacheCapacity / kWarps;
  constexpr int kPerLane = kDim / 32;
  __shared__ float cosines[kMaxGpuReTopKCacheCapacity];  // by slot
  const ReTopKStepState& s = p.state;
  const int row = blockIdx.x;
  const int b = row / s.q_heads;
  const int h = row - b * s.q_heads;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const ReTopKCachesView view = p.caches[b];
  const int32_t n = SeqSize(p.seqs[b]);
  float x[kPerLane];
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) x[j] = p.q[static_cast<int64_t>(row) * kDim + lane + 32 * j];
  const float* cached = view.queries + static_cast<int64_t>(h) * s.capacity * kDim;
  float e[kSlotsPerWarp][kPerLane];
#pragma unroll
  for (int a = 0; a < kSlotsPerWarp; ++a) {
    const int slot = warp + a * kWarps;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      e[a][j] = slot < s.capacity ? cached[slot * kDim + lane + 32 * j] : 0.0f;
    }
  }
  const int entries = view.count[h];
  const int oldest = view.oldest[h];
  const float tau = view.tau[h];
  // Every warp normalizes the query itself (no block reduction on the way).
  float ss = 0.0f;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) ss = fmaf(x[j], x[j], ss);
  const float norm = sqrtf(GroupSum<32>(ss));
  const float inv = norm > 0.0f ? 1.0f / norm : 0.0f;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) x[j] *= inv;
  if (warp == 0) {
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      s.unit_q[static_cast<int64_t>(row) * kDim + lane + 32 * j] = x[j];
    }
  }
#pragma unroll
  for (int a = 0; a < kSlotsPerWarp; ++a) {
    float dot = 0.0f;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) dot = fmaf(x[j], e[a][j], dot);
    dot = GroupSum<32>(dot);
    const int slot = warp + a * kWarps;
    if (lane == 0 && slot < s.capacity) cosines[slot] = dot;
  }
  __syncthreads();
  if (warp != 0) return;
  // Lane l holds ages l and l + 32 (C <= 64); age a is slot (oldest + a) % C.
  auto slot_of_age = [&](int age) {
    const int slot = oldest + age;
    return slot >= s.capacity ? slot - s.capacity : slot;
  };
  float c0 = lane < entries ? cosines[slot_of_age(lane)] : -INFINITY;
  float c1 = lane + 32 < entries ? cosines[slot_of_age(lane + 32)] : -INFINITY;
  const float best = GroupMax<32>(fmaxf(c0, c1));
  const int64_t step = static_cast<int64_t>(n) - view.prompt_tokens;
  // ChooseReTopKPath: refresh first; !(best >= tau) sends NaN to the exact path too.
  uint8_t chosen = kPathReuse;
  if (s.refresh_interval > 0 && step % s.refresh_interval == 0) {
    chosen = kPathRefresh;
  } else if (entries == 0 || !(best >= tau)) {
    chosen = kPathFallback;
  }
  int32_t* neighbors = s.neighbors_of + static_cast<int64_t>(row) * (1 + s.capacity);
  const int r = chosen == kPathReuse ? min(s.neighbors, entries) : 0;
  // The R most similar entries: R rounds of a warp argmax on (cosine, -age).
  for (int i = 0; i < r; ++i) {
    const bool second = c1 > c0;  // on a tie the younger age (l + 32) loses
    float value = second ? c1 : c0;
    int age = second ? lane + 32 : lane;
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
      const float other_value = __shfl_xor_sync(0xffffffffu, value, offset);
      const int other_age = __shfl_xor_sync(0xffffffffu, age, offset);
      if (other_value > value || (other_value == value && other_age < age)) {
        value = other_value;
        age = other_age;
      }
    }
    if (lane == 0) neighbors[1 + i] = slot_of_age(age);
    if (age == lane) c0 = -INFINITY;
    if (age == lane + 32) c1 = -INFINITY;
  }
  if (lane == 0) {
    neighbors[0] = r;
    s.paths[row] = chosen;
    s.exact_rows[row] = chosen != kPathReuse;
    s.best_cosine[row] = best;
    // The exact path scores every token.
    if (chosen != kPathReuse) s.candidate_count[row] = n;
  }
}

// Appends (unit query, support[0:size]) of a row as its newest cache entry, evicting the
// oldest when full (QuerySupportCache::Push). One whole block; `unit` and `support` may be
// shared or global memory and must be complete.
template <int kThreads>
__device__ void PushCacheEntry(const HeadCache& cache, int capacity, int top_k, int head_dim,
                               const float* unit, const int32_t* support, int size) {
  const int entries = *cache.count;
  const int oldest = *cache.oldest;
  __syncthreads();  // every thread has read the FIFO state before thread 0 advances it
  const int slot = entries < capacity ? (oldest + entries) % capacity : oldest;
  for (int j = threadIdx.x; j < head_dim; j += kThreads) {
    cache.queries[static_cast<int64_t>(slot) * head_dim + j] = unit[j];
  }
  for (int j = threadIdx.x; j < size; j += kThreads) {
    cache.supports[static_cast<int64_t>(slot) * top_k + j] = support[j];
  }
  if (threadIdx.x == 0) {
    cache.sizes[slot] = size;
    if (entries < capacity) {
      *cache.count = entries + 1;
    } else {
      *cache.oldest = (oldest + 1) % capacity;
    }
  }
}

// Scores gathered candidate tokens against one query on tensor cores, eight tokens per
// m16n8k16 product, the keys going from global memory straight into B fragments (no staging).
// A dot product does not care in which order the dimensions are summed, so they are permuted
// alike in both operands: lane t of a token's quad loads the token's dimensions
// [t * kDim / 4, (t + 1) * kDim / 4) as 16-byte vectors, and k-step ks takes its words 2 ks and
// 2 ks + 1 (dimensions t * kDim / 4 + 4 ks + 0..3). Rows 0 and 8 of A carry the query's hi and
// lo parts (mma.cuh), the other rows zero, so lanes 0..3 receive the scores.
template <typename T, int kDim>
struct CandidateScorer {
  static constexpr int kVectors = kDim / 32;  // 16-byte loads per lane and token
  static constexpr int kSteps = kDim / 16;
  uint32_t a[kSteps][4];
  float after = 1.0f;  // ScoreFactor::after, applied by Score

  // The query (f32 [kDim]) as A fragments; Score's scores are it times `factor`, which
  // SplitScoreFactor divides between the fragments and the scores.
  __device__ __forceinline__ void LoadQuery(const float* q, float factor) {
    const ScoreFactor split = SplitScoreFactor<T>(factor);
    const float f = split.folded;
    after = split.after;
    const int lane = threadIdx.x % 32;
    const int t = lane % 4;
#pragma unroll
    for (int ks = 0; ks < kSteps; ++ks) {
      if (lane < 4) {
        const float4 v = __ldg(reinterpret_cast<const float4*>(q + t * (kDim / 4) + 4 * ks));
        SplitPair<T>(v.x * f, v.y * f, &a[ks][0], &a[ks][1]);
        SplitPair<T>(v.z * f, v.w * f, &a[ks][2], &a[ks][3]);
      } else {
        a[ks][0] = a[ks][1] = a[ks][2] = a[ks][3] = 0u;
      }
    }
  }

  // This lane's part of one token's key (nothing is read for a null row; it scores 0).
  __device__ __forceinline__ void LoadKey(const T* key_row, uint4 (&raw)[kVectors]) const {
    const int t = threadIdx.x % 4;
#pragma unroll
    for (int v = 0; v < kVectors; ++v) {
      raw[v] = key_row != nullptr ? LoadKv16(key_row + t * (kDim / 4) + v * kVecElems)
                                  : make_uint4(0, 0, 0, 0);
    }
  }

  // After every lane of the warp loaded its quad's token (token g = lane / 4 of eight): lanes
  // 0..3 get the scores of tokens 2t and 2t + 1 in s[0], s[1].
  __device__ __forceinline__ void Score(const uint4 (&raw)[kVectors], float (&s)[2]) const {
    float c[2][4] = {};
#pragma unroll
    for (int ks = 0; ks < kSteps; ++ks) {
      const uint32_t* words = reinterpret_cast<const uint32_t*>(&raw[ks / 2]);
      Mma16816<T>(c[ks & 1], a[ks], words[2 * (ks % 2)], words[2 * (ks % 2) + 1]);
    }
    s[0] = ((c[0][0] + c[0][2]) + (c[1][0] + c[1][2])) * after;
    s[1] = ((c[0][1] + c[0][3]) + (c[1][1] + c[1][3])) * after;
  }
};

// Shared memory of ReTopKReuseKernel beyond its static part: the pool (the hash set, then the
// candidates' rank keys, then AttendSelected's scratch), the candidate ids and the selection.
inline size_t ReuseSmemBytes(int pool_bytes, int max_candidates, int top_k) {
  return static_cast<size_t>(pool_bytes) + static_cast<size_t>(max_candidates) * 4 +
         static_cast<size_t>(top_k) * 8;
}
template <int kDim, int kThreads>
int ReusePoolBytes(int log2_hash_slots, int max_candidates) {
  const int keys = 8 * (max_candidates < kSmemCandidates ? max_candidates : kSmemCandidates);
  const int attend = 4 * AttendSelectedSmemFloats<kDim, kThreads>();
  const int table = 4 << log2_hash_slots;
  const int most = table > keys ? table : keys;
  return ((most > attend ? most : attend) + 15) / 16 * 16;
}

// One block per row; rows the decision did not send to reuse return at once. The union: the
// R entries' supports read in one batch (their sizes beside them), inserted into a shared hash
// set whose inserting thread appends the key to the candidates; then the last W positions.
// Blocks of 256 threads keep to 128 registers so that two share a multiprocessor.
template <typename T, int kDim, int kThreads>
__global__ void __launch_bounds__(kThreads, kThreads <= 256 ? 2 : 1)
    ReTopKReuseKernel(const ReTopKStepParams p, float* o, float* lse) {
  constexpr int kWarps = kThreads / 32;
  constexpr int kInsertBatch = 8;
  // Groups of eight candidates one warp scores per round: at 512 threads and d = 128 a
  // typical reuse step's ~520 candidates in one round of loads.
  constexpr int kInFlight = kDim == 128 ? 5 : 8;
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ RadixSelectSmem radix;
  __shared__ int32_t neighbor_slot[kMaxGpuReTopKCacheCapacity];
  __shared__ int32_t neighbor_size[kMaxGpuReTopKCacheCapacity];
  __shared__ uint32_t candidate_total;
  __shared__ uint32_t appended;
  const ReTopKStepState& s = p.state;
  const int row = blockIdx.x;
  const int b = row / s.q_heads;
  const int h = row - b * s.q_heads;
  const int32_t* neighbors = s.neighbors_of + static_cast<int64_t>(row) * (1 + s.capacity);
  const uint8_t path = s.paths[row];
  const int r = neighbors[0];
  const DeviceSeq seq = p.seqs[b];
  const ReTopKCachesView view = p.caches[b];
  if (path != kPathReuse) return;
  int32_t* table = reinterpret_cast<int32_t*>(smem);
  uint64_t* keys = reinterpret_cast<uint64_t*>(smem);
  int32_t* ids = reinterpret_cast<int32_t*>(smem + p.pool_bytes);
  int32_t* selected = ids + s.max_candidates;  // [top_k] positions, then [top_k] scores
  float* selected_scores = reinterpret_cast<float*>(selected + s.top_k);
  const HeadCache cache = HeadCacheOf(view, h, s.capacity, s.top_k, kDim);
  const int32_t n = SeqSize(seq);

  const int slots = 1 << p.log2_hash_slots;
  for (int i = threadIdx.x; i < slots; i += kThreads) table[i] = -1;
  if (threadIdx.x < r) neighbor_slot[threadIdx.x] = neighbors[1 + threadIdx.x];
  if (threadIdx.x == 0) candidate_total = 0;
  __syncthreads();
  if (threadIdx.x < r) neighbor_size[threadIdx.x] = cache.sizes[neighbor_slot[threadIdx.x]];
  // All of this thread's support ids, loaded before the sizes are known (masked after).
  const int flat = r * s.top_k;
  int i0 = threadIdx.x / s.top_k;
  int j0 = threadIdx.x - i0 * s.top_k;
  auto add = [&](bool valid, int32_t id) {
    const bool added = valid && HashInsert(table, p.log2_hash_slots, id);
    const uint32_t at = WarpReserve(added, &candidate_total);
    if (added) ids[at] = id;
  };
  for (int base = 0; base < flat; base += kThreads * kInsertBatch) {
    int32_t id[kInsertBatch];
    int ii[kInsertBatch];
    int jj[kInsertBatch];
#pragma unroll
    for (int u = 0; u < kInsertBatch; ++u) {
      ii[u] = i0;
      jj[u] = j0;
      const bool in = base + threadIdx.x + u * kThreads < flat;
      id[u] = in ? cache.supports[static_cast<int64_t>(neighbor_slot[i0]) * s.top_k + j0] : -1;
      // Advance (i, j) by kThreads flat positions.
      j0 += kThreads;
      while (j0 >= s.top_k) {
        j0 -= s.top_k;
        ++i0;
      }
      if (!in) i0 = 0;  // keeps the next (unused) load's address in range
    }
    __syncthreads();  // the sizes are in
#pragma unroll
    for (int u = 0; u < kInsertBatch; ++u) add(id[u] >= 0 && jj[u] < neighbor_size[ii[u]], id[u]);
  }
  for (int32_t t0 = max(0, n - s.window); t0 < n; t0 += kThreads) {
    const int32_t t = t0 + static_cast<int32_t>(threadIdx.x);
    add(t < n, t);
  }
  __syncthreads();
  const int count = static_cast<int>(candidate_total);

  // Scores, as rank keys: in the pool when they fit, else through the row's global scratch.
  const bool fits = count <= kSmemCandidates;
  float* spill_scores = s.candidate_scores + static_cast<int64_t>(row) * s.max_candidates;
  int32_t* spill_ids = s.candidates + static_cast<int64_t>(row) * s.max_candidates;
  const int kv_head = h / (s.q_heads / s.kv_heads);
  {
    CandidateScorer<T, kDim> scorer;
    scorer.LoadQuery(p.q + static_cast<int64_t>(row) * kDim, s.scale_log2);
    const T* key_base = static_cast<const T*>(seq.keys);
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int groups = (count + 7) / 8;  // the hash set's memory becomes the keys'
    for (int g0 = warp; g0 < groups; g0 += kWarps * kInFlight) {
      uint4 raw[kInFlight][CandidateScorer<T, kDim>::kVectors];
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) {
        const int i = (g0 + u * kWarps) * 8 + lane / 4;
        const T* key_row =
            i < count ? key_base + KvOffset(SlotOf(seq, ids[i]), kv_head, s.kv_heads, kDim)
                      : nullptr;
        scorer.LoadKey(key_row, raw[u]);
      }
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) {
        float score[2];
        scorer.Score(raw[u], score);
        if (lane < 4) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int i = (g0 + u * kWarps) * 8 + 2 * lane + e;
            if (i < count) {
              if (fits) {
                keys[i] = RankKey(score[e], ids[i]);
              } else {
                spill_scores[i] = score[e];
                spill_ids[i] = ids[i];
              }
            }
          }
        }
      }
    }
  }
  if (threadIdx.x == 0) appended = 0;
  __syncthreads();
  const int k = min(s.top_k, count);
  int32_t* support = s.support + static_cast<int64_t>(row) * s.top_k;
  auto key_at = [&](int i) {
    return fits ? keys[i] : RankKey(__ldcg(spill_scores + i), __ldcg(spill_ids + i));
  };
  if (k > 0) {
    const RadixThreshold t =
        BlockRadixSelect<kThreads>(count, static_cast<uint32_t>(k), 64, key_at, &radix);
    AppendSelected<kThreads>(count, key_at, t, &appended, selected, selected_scores, support);
  }
  if (threadIdx.x == 0) {
    s.support_size[row] = k;
    s.candidate_count[row] = count;
  }
  __syncthreads();
  AttendSelected<T, kDim, kThreads, 16>(
      k, [&](int i) { return selected[i]; }, [&](int i) { return selected_scores[i]; }, seq,
      kv_head, s.kv_heads, o + static_cast<int64_t>(row) * kDim, lse + row,
      reinterpret_cast<float*>(smem));
  PushCacheEntry<kThreads>(cache, s.capacity, s.top_k, kDim,
                           s.unit_q + static_cast<int64_t>(row) * kDim, selected, k);
}

// Ends the exact path's collect pass of a refresh or fallback row: the attention state over
// its exact top K, then (unit query, that support) pushed into the row's cache.
template <typename T, int kDim, int kThreads>
struct ReTopKExactFinish {
  static constexpr int kSmemFloats = AttendFinish<T, kDim, kThreads>::kSmemFloats;
  AttendFinish<T, kDim, kThreads> attend;
  const ReTopKCachesView* caches;  // [batch]
  const float* unit_q;             // [rows, kDim]
  int capacity;
  int top_k;

  __device__ void operator()(const RowTopKParams& p, int row, const int32_t* positions,
                             const float* scores, int count, float* smem) const {
    attend(p, row, positions, scores, count, smem);
    const int b = row / attend.q_heads;
    const int h = row - b * attend.q_heads;
    PushCacheEntry<kThreads>(HeadCacheOf(caches[b], h, capacity, top_k, kDim), capacity, top_k,
                             kDim, unit_q + static_cast<int64_t>(row) * kDim, positions, count);
  }
};

// Seeding: entry c of every head of one sequence's caches from prompt query c (of `count`,
// oldest first) and its exact support (support [count, q_heads, K], sizes [count, q_heads]).
// grid = (count, q_heads).
template <int kDim, int kThreads>
__global__ void __launch_bounds__(kThreads)
    ReTopKSeedKernel(const ReTopKCachesView caches, int q_heads, int capacity, int top_k,
                     const float* queries, int count, const int32_t* support,
                     const int32_t* support_size) {
  __shared__ float unit[kDim];
  __shared__ float scratch[32];
  const int c = blockIdx.x;
  const int h = blockIdx.y;
  const int64_t src = static_cast<int64_t>(c) * q_heads + h;
  NormalizeToShared<kDim, kThreads>(queries + src * kDim, unit, scratch);
  const HeadCache cache = HeadCacheOf(caches, h, capacity, top_k, kDim);
  if (threadIdx.x < kDim) {
    cache.queries[static_cast<int64_t>(c) * kDim + threadIdx.x] = unit[threadIdx.x];
  }
  const int size = support_size[src];
  for (int j = threadIdx.x; j < size; j += kThreads) {
    cache.supports[static_cast<int64_t>(c) * top_k + j] = support[src * top_k + j];
  }
  if (threadIdx.x == 0) {
    cache.sizes[c] = size;
    if (c == 0) {
      *cache.count = count;
      *cache.oldest = 0;
    }
  }
}

}  // namespace kvrecall::cuda

#endif  // KVRECALL_KERNELS_CUDA_RETOPK_CUH_
