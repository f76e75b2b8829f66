// Templated kernels of ReTopK's GPU step (index/retopk.h is the reference):
//   1. ReTopKSelectKernel: normalize q, cosines with the C cached queries, the path, and for
//      reuse the top-R entries' supports ∪ the last W positions, deduplicated exactly;
//   2. ReTopKFinishKernel: scores the candidates with the current query where the keys lie (no
//      gathered copy), takes their top K, softmax·V over them, and updates the cache FIFO on
//      every path (refresh and fallback rows come from the exact top-K kernels).
#ifndef KVRECALL_KERNELS_CUDA_RETOPK_CUH_
#define KVRECALL_KERNELS_CUDA_RETOPK_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/partial_attention.cuh"
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
  int32_t* candidates;     // [rows, max_candidates]
  int32_t* candidate_count;// [rows]: tokens scored to choose the support
  float* candidate_scores; // [rows, max_candidates] (log2 domain)
  int32_t* support;        // [rows, K]
  int32_t* support_size;   // [rows]
};

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

// Inserts key (>= 0) into an open-addressing set of `slots` (a power of two) in shared memory,
// empty = -1; true for the one call that added it. Safe under concurrent inserts from the whole
// block.
__device__ __forceinline__ bool HashInsert(int32_t* table, int log2_slots, int32_t key) {
  const uint32_t mask = (1u << log2_slots) - 1;
  uint32_t h = (static_cast<uint32_t>(key) * 2654435761u) >> (32 - log2_slots);
  while (true) {
    const int32_t prev = atomicCAS(table + h, -1, key);
    if (prev == -1) return true;
    if (prev == key) return false;
    h = (h + 1) & mask;
  }
}

struct ReTopKStepParams {
  ReTopKStepState state;
  const DeviceSeq* seqs;             // [batch]
  const ReTopKCachesView* caches;    // [batch]
  const float* q;                    // [batch, q_heads, head_dim]
  int log2_hash_slots;
};

// One block per row. Dynamic shared memory: the hash set, 4 << log2_hash_slots bytes. Loads
// are issued in batches before their first use: a step is a chain of dependent round trips
// to memory, and their number, not bytes, sets its time.
template <int kDim, int kThreads>
__global__ void __launch_bounds__(kThreads) ReTopKSelectKernel(const ReTopKStepParams p) {
  constexpr int kWarps = kThreads / 32;
  constexpr int kAgesPerWarp = kMaxReTopKCacheCapacity / kWarps;
  constexpr int kPerLane = kDim / 32;
  constexpr int kInsertBatch = 8;
  extern __shared__ int32_t table[];
  __shared__ float unit[kDim];
  __shared__ float cosines[kMaxReTopKCacheCapacity];
  __shared__ float scratch[32];
  __shared__ uint32_t candidate_total;
  __shared__ int32_t neighbor_slots[kMaxReTopKCacheCapacity];
  __shared__ int32_t slot_sizes[kMaxReTopKCacheCapacity];
  __shared__ uint8_t path;
  __shared__ int neighbor_count;
  const ReTopKStepState& s = p.state;
  const int row = blockIdx.x;
  const int b = row / s.q_heads;
  const int h = row - b * s.q_heads;
  const int32_t n = SeqSize(p.seqs[b]);
  const ReTopKCachesView view = p.caches[b];
  const HeadCache cache = HeadCacheOf(view, h, s.capacity, s.top_k, kDim);
  const int64_t step = static_cast<int64_t>(n) - view.prompt_tokens;
  const int entries = *cache.count;
  const int oldest = *cache.oldest;
  const float tau = view.tau[h];

  // Cosines: warp w takes ages w, w + kWarps, ...; all its loads are in flight at once, while
  // the query is normalized.
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const float* cached = cache.queries;
  // Support sizes of every entry, read now so the union below waits on no further round trip.
  if (threadIdx.x < s.capacity) slot_sizes[threadIdx.x] = cache.sizes[threadIdx.x];
  float e[kAgesPerWarp][kPerLane];
#pragma unroll
  for (int a = 0; a < kAgesPerWarp; ++a) {
    const int age = warp + a * kWarps;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      e[a][j] = age < entries
                    ? cached[static_cast<int64_t>((oldest + age) % s.capacity) * kDim + lane + 32 * j]
                    : 0.0f;
    }
  }
  NormalizeToShared<kDim, kThreads>(p.q + static_cast<int64_t>(row) * kDim, unit, scratch);
  if (threadIdx.x < kDim) s.unit_q[static_cast<int64_t>(row) * kDim + threadIdx.x] = unit[threadIdx.x];
#pragma unroll
  for (int a = 0; a < kAgesPerWarp; ++a) {
    float dot = 0.0f;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) dot = fmaf(unit[lane + 32 * j], e[a][j], dot);
    dot = GroupSum<32>(dot);
    const int age = warp + a * kWarps;
    if (lane == 0 && age < entries) cosines[age] = dot;
  }
  __syncthreads();
  if (warp == 0) {
    // Lane l holds ages l and l + 32 (C <= 64).
    float c0 = lane < entries ? cosines[lane] : -INFINITY;
    float c1 = lane + 32 < entries ? cosines[lane + 32] : -INFINITY;
    const float best = GroupMax<32>(fmaxf(c0, c1));
    // ChooseReTopKPath: refresh first; !(best >= tau) sends NaN to the exact path too.
    uint8_t chosen = kPathReuse;
    if (s.refresh_interval > 0 && step % s.refresh_interval == 0) {
      chosen = kPathRefresh;
    } else if (entries == 0 || !(best >= tau)) {
      chosen = kPathFallback;
    }
    // The R most similar entries, ties to the older (cpu::TopKPositions over ages): R rounds of
    // a warp argmax on (cosine, -age).
    const int r = min(s.neighbors, entries);
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
      if (lane == 0) neighbor_slots[i] = (oldest + age) % s.capacity;
      if (age == lane) c0 = -INFINITY;
      if (age == lane + 32) c1 = -INFINITY;
    }
    if (lane == 0) {
      path = chosen;
      neighbor_count = chosen == kPathReuse ? r : 0;
      s.paths[row] = chosen;
      s.exact_rows[row] = chosen != kPathReuse;
      s.best_cosine[row] = best;
      // Nothing to score on the exact path (the finish kernel reports n candidates there).
      if (chosen != kPathReuse) s.candidate_count[row] = 0;
    }
  }
  __syncthreads();
  if (path != kPathReuse) return;

  const int slots = 1 << p.log2_hash_slots;
  for (int i = threadIdx.x; i < slots; i += kThreads) table[i] = -1;
  if (threadIdx.x == 0) candidate_total = 0;
  __syncthreads();
  // The union: all neighbor supports as one flat index space, kInsertBatch loads in flight,
  // then the last W positions. The call that adds a key to the set appends it to the candidates
  // (in no particular order), one atomic per warp and batch reserving the outputs; trip counts
  // are block-uniform so that whole warps reserve together.
  int32_t* out = s.candidates + static_cast<int64_t>(row) * s.max_candidates;
  auto add = [&](bool valid, int32_t id) {
    const bool added = valid && HashInsert(table, p.log2_hash_slots, id);
    const uint32_t at = WarpReserve(added, &candidate_total);
    if (added) out[at] = id;
  };
  const int32_t* supports = cache.supports;
  const int flat = neighbor_count * s.top_k;
  for (int base = 0; base < flat; base += kThreads * kInsertBatch) {
    int32_t id[kInsertBatch];
#pragma unroll
    for (int u = 0; u < kInsertBatch; ++u) {
      const int f = base + threadIdx.x + u * kThreads;
      const int i = f / s.top_k;
      const int j = f - i * s.top_k;
      id[u] = f < flat && j < slot_sizes[neighbor_slots[i]]
                  ? supports[static_cast<int64_t>(neighbor_slots[i]) * s.top_k + j]
                  : -1;
    }
#pragma unroll
    for (int u = 0; u < kInsertBatch; ++u) add(id[u] >= 0, id[u]);
  }
  for (int32_t t0 = max(0, n - s.window); t0 < n; t0 += kThreads) {
    const int32_t t = t0 + static_cast<int32_t>(threadIdx.x);
    add(t < n, t);
  }
  __syncthreads();
  if (threadIdx.x == 0) s.candidate_count[row] = static_cast<int32_t>(candidate_total);
}

// Scores the ids[0:count) (logical positions of seq) with one query (f32 [kDim], times
// scale_log2) where their keys lie, no gathered copy, and calls store(i, id, score) once per i
// (score in the log2 domain). One whole block; kPerGroup keys per lane group in flight at once.
template <typename T, int kDim, int kThreads, typename Store>
__device__ __forceinline__ void ScoreCandidates(const DeviceSeq& seq, int kv_head, int kv_heads,
                                                const float* query, float scale_log2,
                                                const int32_t* ids, int count,
                                                const Store& store) {
  constexpr int kLanes = kDim / kVecElems;
  constexpr int kGroups = kThreads / kLanes;
  // A typical reuse step's ~520 candidates (K = 512) in at most two rounds (head_dim 128).
  static_assert(512 % kThreads == 0);
  constexpr int kPerGroup = 9 * (512 / kThreads);
  const T* keys = static_cast<const T*>(seq.keys);
  float q[1][kVecElems];
  LoadQueries<kLanes, 1>(query, kDim, scale_log2, q);
  const int group = threadIdx.x / kLanes;
  const int part = threadIdx.x % kLanes;
  // A block-uniform trip count: every lane takes part in each GroupSum.
  for (int begin = 0; begin < count; begin += kGroups * kPerGroup) {
    int32_t id[kPerGroup];
#pragma unroll
    for (int u = 0; u < kPerGroup; ++u) {
      const int i = begin + group + u * kGroups;
      id[u] = i < count ? ids[i] : -1;
    }
    uint4 raw[kPerGroup];
#pragma unroll
    for (int u = 0; u < kPerGroup; ++u) {
      raw[u] = make_uint4(0, 0, 0, 0);
      if (id[u] >= 0) {
        raw[u] = LoadKv16(keys + KvOffset(SlotOf(seq, id[u]), kv_head, kv_heads, kDim) +
                          part * kVecElems);
      }
    }
#pragma unroll
    for (int u = 0; u < kPerGroup; ++u) {
      float k[kVecElems];
      Widen8<T>(raw[u], k);
      float acc = 0.0f;
#pragma unroll
      for (int j = 0; j < kVecElems; ++j) acc = fmaf(q[0][j], k[j], acc);
      acc = GroupSum<kLanes>(acc);
      const int i = begin + group + u * kGroups;
      if (part == 0 && i < count) store(i, id[u], acc);
    }
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

// Dynamic shared memory of ReTopKFinishKernel: the selected positions and scores.
inline size_t FinishSmemBytes(int top_k) { return static_cast<size_t>(top_k) * 8; }

// One block per row: for reuse rows, the candidates' scores, their exact top K (ties to the
// lower position), softmax·V over them; for every row, the cache update.
// Blocks of 256 threads keep to 128 registers so that two share a multiprocessor.
template <typename T, int kDim, int kThreads>
__global__ void __launch_bounds__(kThreads, kThreads <= 256 ? 2 : 1)
    ReTopKFinishKernel(const ReTopKStepParams p, float* o, float* lse) {
  constexpr int kPoolBytes =
      kSmemCandidates * 8 > AttendSelectedSmemFloats<kDim, kThreads>() * 4
          ? kSmemCandidates * 8
          : AttendSelectedSmemFloats<kDim, kThreads>() * 4;
  __shared__ __align__(16) unsigned char pool[kPoolBytes];
  __shared__ RadixSelectSmem radix;
  __shared__ float unit[kDim];
  __shared__ uint32_t appended;
  extern __shared__ int32_t selected[];  // [top_k] positions, then [top_k] scores
  const ReTopKStepState& s = p.state;
  const int row = blockIdx.x;
  const int b = row / s.q_heads;
  const int h = row - b * s.q_heads;
  const DeviceSeq seq = p.seqs[b];
  const HeadCache cache = HeadCacheOf(p.caches[b], h, s.capacity, s.top_k, kDim);
  const uint8_t path = s.paths[row];
  const int count = s.candidate_count[row];
  for (int j = threadIdx.x; j < kDim; j += kThreads) {
    unit[j] = s.unit_q[static_cast<int64_t>(row) * kDim + j];
  }
  int32_t* support = s.support + static_cast<int64_t>(row) * s.top_k;
  if (path != kPathReuse) {
    // The exact kernels chose this row's support; cache it.
    if (threadIdx.x == 0) s.candidate_count[row] = SeqSize(seq);
    __syncthreads();
    PushCacheEntry<kThreads>(cache, s.capacity, s.top_k, kDim, unit, support,
                             s.support_size[row]);
    return;
  }
  float* selected_scores = reinterpret_cast<float*>(selected + s.top_k);
  const int k = min(s.top_k, count);
  const int32_t* ids = s.candidates + static_cast<int64_t>(row) * s.max_candidates;
  // Rank keys of the scored candidates: in shared memory when they fit, else from scores kept
  // in the row's global scratch.
  float* scores = s.candidate_scores + static_cast<int64_t>(row) * s.max_candidates;
  uint64_t* cached = reinterpret_cast<uint64_t*>(pool);
  const bool fits = count <= kSmemCandidates;
  const int kv_head = h / (s.q_heads / s.kv_heads);
  ScoreCandidates<T, kDim, kThreads>(seq, kv_head, s.kv_heads,
                                     p.q + static_cast<int64_t>(row) * kDim, s.scale_log2, ids,
                                     count, [&](int i, int32_t id, float score) {
                                       if (fits) {
                                         cached[i] = RankKey(score, id);
                                       } else {
                                         scores[i] = score;
                                       }
                                     });
  auto fresh_key = [&](int i) { return RankKey(scores[i], ids[i]); };
  if (threadIdx.x == 0) appended = 0;
  __syncthreads();
  auto key_at = [&](int i) { return fits ? cached[i] : fresh_key(i); };
  if (k > 0) {
    const RadixThreshold t =
        BlockRadixSelect<kThreads>(count, static_cast<uint32_t>(k), 64, key_at, &radix);
    AppendSelected<kThreads>(count, key_at, t, &appended, selected, selected_scores, support);
  }
  if (threadIdx.x == 0) s.support_size[row] = k;
  __syncthreads();
  AttendSelected<T, kDim, kThreads>(
      k, [&](int i) { return selected[i]; }, [&](int i) { return selected_scores[i]; }, seq,
      kv_head, s.kv_heads, o + static_cast<int64_t>(row) * kDim, lse + row,
      reinterpret_cast<float*>(pool));
  PushCacheEntry<kThreads>(cache, s.capacity, s.top_k, kDim, unit, selected, k);
}

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
  if (threadIdx.x < kDim) cache.queries[static_cast<int64_t>(c) * kDim + threadIdx.x] = unit[threadIdx.x];
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
