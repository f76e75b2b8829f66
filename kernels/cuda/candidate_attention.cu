#include "kernels/cuda/candidate_attention.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernel_errors.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/selected_attention.cuh"
#include "kernels/cuda/topk_select.cuh"

namespace kvrecall::cuda {
namespace {

// One block per row; 16 warps keep 16 x kRowsInFlight key rows in flight, which is what reading
// them over PCIe needs (a round trip of ~1-2 us per row: host memory is far).
constexpr int kThreads = 512;
constexpr int kRowsInFlight = 8;

struct CandidateArgs {
  int q_heads;
  int kv_heads;
  int top_k;
  float scale_log2;
  const DeviceSeq* seqs;
  const float* q;
  CandidateLists lists;
  const int32_t* rows;
  CandidateOutputs out;
  unsigned* errors;
  int log2_slots;       // the hash set of listed ids
  int max_candidates;   // shortlist_stride + outlier_stride + max_uncoded
};

struct SmemLayout {
  size_t table, ids, keys, selected, attend, total;
};

template <int kDim>
__host__ __device__ SmemLayout LayoutOf(int log2_slots, int max_candidates, int top_k) {
  auto up = [](size_t bytes) { return (bytes + 15) / 16 * 16; };
  SmemLayout l{};
  l.table = 0;
  l.ids = l.table + up(size_t{4} << log2_slots);
  l.keys = l.ids + up(size_t{4} * max_candidates);
  l.selected = l.keys + up(size_t{8} * max_candidates);
  l.attend = l.selected + up(size_t{8} * top_k);
  l.total = l.attend + up(size_t{4} * AttendSelectedSmemFloats<kDim, kThreads>());
  return l;
}

int Log2SlotsFor(const CandidateLists& lists) {
  // At most half full: the listed ids (the uncoded tail needs no set, it cannot repeat them).
  const int64_t listed = int64_t{lists.shortlist_stride} + lists.outlier_stride;
  int log2 = 5;
  while ((int64_t{1} << log2) < 2 * listed) ++log2;
  return log2;
}

// The element of a stored half-precision row as f32.
template <typename T>
__device__ __forceinline__ float WidenHalf(uint32_t bits);
template <>
__device__ __forceinline__ float WidenHalf<__nv_bfloat16>(uint32_t bits) {
  return __uint_as_float(bits << 16);
}
template <>
__device__ __forceinline__ float WidenHalf<__half>(uint32_t bits) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
}

// A key row as one warp reads it: lane l holds elements [l * kPer, (l + 1) * kPer), so that the
// warp's one load is the whole contiguous row (256 bytes at d = 128), one request on the link.
template <int kDim>
struct KeyPart;
template <>
struct KeyPart<128> {
  uint2 raw;
  __device__ __forceinline__ void Load(const void* row, int lane) {
    raw = __ldcg(reinterpret_cast<const uint2*>(row) + lane);
  }
  template <typename T>
  __device__ __forceinline__ float Dot(const float (&q)[4]) const {
    return q[0] * WidenHalf<T>(raw.x & 0xffffu) + q[1] * WidenHalf<T>(raw.x >> 16) +
           q[2] * WidenHalf<T>(raw.y & 0xffffu) + q[3] * WidenHalf<T>(raw.y >> 16);
  }
};
template <>
struct KeyPart<64> {
  uint32_t raw;
  __device__ __forceinline__ void Load(const void* row, int lane) {
    raw = __ldcg(reinterpret_cast<const unsigned int*>(row) + lane);
  }
  template <typename T>
  __device__ __forceinline__ float Dot(const float (&q)[4]) const {
    return q[0] * WidenHalf<T>(raw & 0xffffu) + q[1] * WidenHalf<T>(raw >> 16);
  }
};

template <typename T, int kDim>
__global__ void __launch_bounds__(kThreads) CandidateAttentionKernel(const CandidateArgs a) {
  constexpr int kWarps = kThreads / 32;
  constexpr int kPer = kDim / 32;
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ RadixSelectSmem radix;
  __shared__ uint32_t listed;
  __shared__ uint32_t appended;
  const int row = a.rows[blockIdx.x];
  if (row < 0) return;
  const int b = row / a.q_heads;
  const int h = row - b * a.q_heads;
  const int kv_head = h / (a.q_heads / a.kv_heads);
  const DeviceSeq seq = a.seqs[b];
  const int32_t size = SeqSize(seq);
  const SmemLayout l = LayoutOf<kDim>(a.log2_slots, a.max_candidates, a.top_k);
  int32_t* table = reinterpret_cast<int32_t*>(smem + l.table);
  int32_t* ids = reinterpret_cast<int32_t*>(smem + l.ids);
  uint64_t* keys = reinterpret_cast<uint64_t*>(smem + l.keys);
  int32_t* selected = reinterpret_cast<int32_t*>(smem + l.selected);
  float* selected_scores = reinterpret_cast<float*>(selected + a.top_k);
  float* attend = reinterpret_cast<float*>(smem + l.attend);
  const CandidateLists& lists = a.lists;

  int32_t coded = lists.coded[b];
  if (coded < 0) {
    if (threadIdx.x == 0 && a.errors != nullptr) atomicOr(a.errors, kErrorCountOutOfRange);
    coded = 0;
  }
  coded = min(coded, size);
  int uncoded = size - coded;
  if (uncoded > lists.max_uncoded) {
    if (threadIdx.x == 0 && a.errors != nullptr) atomicOr(a.errors, kErrorCountOutOfRange);
    uncoded = lists.max_uncoded;
  }
  const int64_t group_at = static_cast<int64_t>(b) * a.kv_heads + kv_head;
  int outliers = lists.outlier_counts[group_at];
  if (outliers < 0 || outliers > lists.outlier_stride) {
    if (threadIdx.x == 0 && a.errors != nullptr) atomicOr(a.errors, kErrorCountOutOfRange);
    outliers = max(0, min(outliers, lists.outlier_stride));
  }

  // The union of the listed ids below `coded`, in a shared hash set whose inserting thread
  // appends the id (the order is arbitrary: the top K's is by score and position).
  const int slots = 1 << a.log2_slots;
  for (int i = threadIdx.x; i < slots; i += kThreads) table[i] = -1;
  if (threadIdx.x == 0) listed = 0;
  __syncthreads();
  auto add = [&](int32_t id) {
    if (id >= size && a.errors != nullptr) atomicOr(a.errors, kErrorIndexOutOfRange);
    const bool added = id >= 0 && id < coded && HashInsert(table, a.log2_slots, id);
    const uint32_t at = WarpReserve(added, &listed);
    if (added) ids[at] = id;
  };
  const int32_t* shortlist = lists.shortlists + static_cast<int64_t>(row) * lists.shortlist_stride;
  int listed_ids = lists.shortlist_stride;
  if (lists.shortlist_sizes != nullptr) {
    listed_ids = lists.shortlist_sizes[row];
    if (listed_ids < 0 || listed_ids > lists.shortlist_stride) {
      if (threadIdx.x == 0 && a.errors != nullptr) atomicOr(a.errors, kErrorCountOutOfRange);
      listed_ids = max(0, min(listed_ids, lists.shortlist_stride));
    }
  }
  for (int base = 0; base < listed_ids; base += kThreads) {
    const int i = base + threadIdx.x;
    add(i < listed_ids ? shortlist[i] : -1);
  }
  const int32_t* outlier = lists.outliers + group_at * lists.outlier_stride;
  for (int base = 0; base < outliers; base += kThreads) {
    const int i = base + threadIdx.x;
    add(i < outliers ? outlier[i] : -1);
  }
  __syncthreads();
  const int first_uncoded = static_cast<int>(listed);
  const int count = first_uncoded + uncoded;
  for (int i = threadIdx.x; i < uncoded; i += kThreads) ids[first_uncoded + i] = coded + i;
  __syncthreads();

  // Exact scores (log2 domain, as AttendSelected takes them), a warp per row, kRowsInFlight
  // rows of a warp requested before the first is used.
  {
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    float qv[4] = {};
    const float* q = a.q + static_cast<int64_t>(row) * kDim + lane * kPer;
#pragma unroll
    for (int e = 0; e < kPer; ++e) qv[e] = q[e] * a.scale_log2;
    const T* key_base = static_cast<const T*>(seq.keys);
    for (int base = warp * kRowsInFlight; base < count; base += kWarps * kRowsInFlight) {
      KeyPart<kDim> part[kRowsInFlight];
#pragma unroll
      for (int u = 0; u < kRowsInFlight; ++u) {
        const int i = base + u;
        if (i < count) {
          part[u].Load(key_base + KvOffset(SlotOf(seq, ids[i]), kv_head, a.kv_heads, kDim), lane);
        }
      }
#pragma unroll
      for (int u = 0; u < kRowsInFlight; ++u) {
        const int i = base + u;
        if (i >= count) break;
        float s = part[u].template Dot<T>(qv);
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) {
          s += __shfl_xor_sync(0xffffffffu, s, offset);
        }
        if (lane == 0) keys[i] = RankKey(s, ids[i]);
      }
    }
  }
  if (threadIdx.x == 0) appended = 0;
  __syncthreads();

  const int k = min(a.top_k, count);
  int32_t* support = a.out.support + static_cast<int64_t>(row) * a.top_k;
  auto key_at = [&](int i) { return keys[i]; };
  if (k > 0) {
    const RadixThreshold t =
        BlockRadixSelect<kThreads>(count, static_cast<uint32_t>(k), 64, key_at, &radix);
    AppendSelected<kThreads>(count, key_at, t, &appended, selected, selected_scores, support);
  }
  if (threadIdx.x == 0) {
    a.out.support_size[row] = k;
    a.out.candidate_count[row] = count;
  }
  __syncthreads();
  AttendSelected<T, kDim, kThreads, 16>(
      k, [&](int i) { return selected[i]; }, [&](int i) { return selected_scores[i]; }, seq,
      kv_head, a.kv_heads, a.out.o + static_cast<int64_t>(row) * kDim, a.out.lse + row, attend);
}

absl::Status CheckArgs(const DecodeShape& shape, int top_k, const CandidateLists& lists) {
  if (absl::Status s = shape.Validate(); !s.ok()) return s;
  if (top_k < 1) return absl::InvalidArgumentError(absl::StrCat("top_k must be >= 1, got ", top_k));
  if (lists.shortlist_stride < 0 || lists.outlier_stride < 0 || lists.max_uncoded < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "list bounds must be >= 0, got shortlist_stride ", lists.shortlist_stride,
        ", outlier_stride ", lists.outlier_stride, ", max_uncoded ", lists.max_uncoded));
  }
  const int64_t candidates =
      int64_t{lists.shortlist_stride} + lists.outlier_stride + lists.max_uncoded;
  if (candidates > (int64_t{1} << 24)) {
    return absl::InvalidArgumentError(
        absl::StrCat("at most 2^24 candidates a row, got bounds summing to ", candidates));
  }
  return absl::OkStatus();
}

// Shared memory the kernel needs for these bounds, in bytes (0 for bounds CheckArgs refuses).
int64_t CandidateAttentionSmemBytes(const DecodeShape& shape, int top_k,
                                    const CandidateLists& lists) {
  if (!CheckArgs(shape, top_k, lists).ok()) return 0;
  const int max_candidates = lists.shortlist_stride + lists.outlier_stride + lists.max_uncoded;
  return KVRECALL_DISPATCH_HEAD_DIM(shape.head_dim, kDim, [&] {
    return static_cast<int64_t>(
        LayoutOf<kDim>(Log2SlotsFor(lists), max_candidates, top_k).total);
  });
}

}  // namespace

absl::Status CheckCandidateAttention(const DecodeShape& shape, int top_k,
                                     const CandidateLists& lists) {
  if (absl::Status s = CheckArgs(shape, top_k, lists); !s.ok()) return s;
  // The device's opt-in limit, read once per device (a served step checks its bounds).
  const absl::StatusOr<int> most = MaxSharedMemoryPerBlock();
  if (!most.ok()) return most.status();
  // The kernel's static shared memory (the radix select's) beside the dynamic part.
  const int64_t needed = CandidateAttentionSmemBytes(shape, top_k, lists) +
                         static_cast<int64_t>(sizeof(RadixSelectSmem)) + 64;
  if (needed > *most) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a row's candidates (shortlist_stride ", lists.shortlist_stride, " + outlier_stride ",
        lists.outlier_stride, " + max_uncoded ", lists.max_uncoded, ") and top_k ", top_k,
        " need ", needed, " bytes of shared memory; the device has ", *most));
  }
  return absl::OkStatus();
}

absl::Status PrepareCandidateAttention(const DecodeShape& shape, int top_k,
                                       const CandidateLists& lists) {
  if (absl::Status s = CheckCandidateAttention(shape, top_k, lists); !s.ok()) return s;
  const auto smem = static_cast<size_t>(CandidateAttentionSmemBytes(shape, top_k, lists));
  return KVRECALL_DISPATCH_KV_DTYPE(shape.dtype, KvT, [&] {
    return KVRECALL_DISPATCH_HEAD_DIM(shape.head_dim, kDim, [&]() -> absl::Status {
      return AllowDynamicSharedMemory<&CandidateAttentionKernel<KvT, kDim>>(smem);
    });
  });
}

absl::Status CandidateAttention(const DecodeShape& shape, int top_k, const DeviceSeq* seqs,
                                const float* q, const CandidateLists& lists, const int32_t* rows,
                                int row_count, const CandidateOutputs& out, unsigned* errors,
                                cudaStream_t stream) {
  if (absl::Status s = CheckCandidateAttention(shape, top_k, lists); !s.ok()) return s;
  if (row_count < 0) {
    return absl::InvalidArgumentError(absl::StrCat("row_count must be >= 0, got ", row_count));
  }
  if (row_count == 0) return absl::OkStatus();
  if (seqs == nullptr || q == nullptr || rows == nullptr || lists.coded == nullptr ||
      lists.outlier_counts == nullptr || out.o == nullptr || out.lse == nullptr ||
      out.support == nullptr || out.support_size == nullptr || out.candidate_count == nullptr ||
      (lists.shortlist_stride > 0 && lists.shortlists == nullptr) ||
      (lists.outlier_stride > 0 && lists.outliers == nullptr)) {
    return absl::InvalidArgumentError(
        "seqs, q, rows, the lists (for non-zero strides), coded, outlier_counts and every "
        "output must be device pointers, got null");
  }
  CandidateArgs a{};
  a.q_heads = shape.q_heads;
  a.kv_heads = shape.kv_heads;
  a.top_k = top_k;
  a.scale_log2 = shape.scale * kLog2e;
  a.seqs = seqs;
  a.q = q;
  a.lists = lists;
  a.rows = rows;
  a.out = out;
  a.errors = errors;
  a.log2_slots = Log2SlotsFor(lists);
  a.max_candidates = lists.shortlist_stride + lists.outlier_stride + lists.max_uncoded;
  const auto smem = static_cast<size_t>(CandidateAttentionSmemBytes(shape, top_k, lists));
  return KVRECALL_DISPATCH_KV_DTYPE(shape.dtype, KvT, [&] {
    return KVRECALL_DISPATCH_HEAD_DIM(shape.head_dim, kDim, [&]() -> absl::Status {
      KVRECALL_CUDA_RETURN_IF_ERROR(
          AllowDynamicSharedMemory<&CandidateAttentionKernel<KvT, kDim>>(smem));
      CandidateAttentionKernel<KvT, kDim><<<row_count, kThreads, smem, stream>>>(a);
      return LaunchStatus("CandidateAttentionKernel");
    });
  });
}

}  // namespace kvrecall::cuda
