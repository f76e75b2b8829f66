// Templated kernels of the exact top-K decode path: a full-history key scan that scores every
// key once for all query heads sharing it and builds the selection histogram on the way, and
// the attention over the selected tokens that ends the collect pass (topk_select.cuh).
#ifndef KVRECALL_KERNELS_CUDA_EXACT_TOPK_CUH_
#define KVRECALL_KERNELS_CUDA_EXACT_TOPK_CUH_

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/partial_attention.cuh"
#include "kernels/cuda/selected_attention.cuh"
#include "kernels/cuda/topk_select.cuh"
#include "kernels/cuda/topk_workspace.h"

namespace kvrecall::cuda {

struct ScoreKeysParams {
  DecodeBatch batch;
  int splits;
  int chunk;              // keys per block, a multiple of the tile
  float* scores;          // [rows, score_stride]
  RowTopKParams rows;     // histogram, state, active rows, k, score_stride
  unsigned* errors;
};

template <typename T, typename Shape, int kGroup>
constexpr size_t ScoreKeysSmemBytes() {
  constexpr int kHeadDim = Shape::kLanes * kVecElems;
  return static_cast<size_t>(Shape::kStages) * Shape::kTile * kHeadDim * sizeof(T) +
         Shape::kStages * Shape::kTile + kGroup * kBins * 4;
}

// What scan block (x, y, z) serves: split x of head group y of sequence z as planned on the
// host when every row is active (active == null); with active rows the launch's blocks are
// shared out among the head groups that hold one (ShareBlocks), each part at least four tiles,
// so that a step whose few rows are exact reads only their KV heads' keys, on every
// multiprocessor.
template <int kGroup, int kTile>
__device__ BlockShare AssignScanBlock(const ScoreKeysParams& p) {
  const int groups = gridDim.y * gridDim.z;
  if (p.rows.active == nullptr || groups > kMaxSharedUnits) {
    return BlockShare{static_cast<int>(blockIdx.z * gridDim.y + blockIdx.y),
                      static_cast<int>(blockIdx.x), static_cast<int>(gridDim.x), p.chunk, true};
  }
  return ShareBlocks(
      groups,
      [&](int g) {
        const int64_t row0 = static_cast<int64_t>(g / gridDim.y) * p.batch.q_heads +
                             (g % gridDim.y) * kGroup;
        bool any = false;
#pragma unroll
        for (int h = 0; h < kGroup; ++h) any |= p.rows.active[row0 + h] != 0;
        return any;
      },
      p.rows.max_length, kTile, 4 * kTile);
}

// One block: the kGroup query heads q0.. of one KV head over one split of one sequence.
// grid = (splits, q_heads / kGroup, batch), as AssignScanBlock shares it out. Writes each
// active row's scores and adds them to its histogram; the last block of the split group
// locates each row's threshold bin.
// RunTilePipeline's barriers keep the histogram complete before it is flushed.
template <typename T, typename Shape, int kGroup>
__global__ void __launch_bounds__(Shape::kThreads) ScoreKeysKernel(const ScoreKeysParams p) {
  constexpr int kHeadDim = Shape::kLanes * kVecElems;
  constexpr int kTile = Shape::kTile;
  constexpr int kStages = Shape::kStages;
  extern __shared__ __align__(16) unsigned char smem[];
  T* k_tiles = reinterpret_cast<T*>(smem);
  uint8_t* valid = reinterpret_cast<uint8_t*>(k_tiles + kStages * kTile * kHeadDim);
  uint32_t* hist = reinterpret_cast<uint32_t*>(valid + kStages * kTile);  // [kGroup][kBins]
  __shared__ uint32_t scratch[32];
  __shared__ bool last;

  const BlockShare job = AssignScanBlock<kGroup, kTile>(p);
  if (!job.ok) return;
  const int split = job.split;
  const int b = job.unit / gridDim.y;
  const int q0 = (job.unit - b * gridDim.y) * kGroup;
  const int kv_head = q0 / (p.batch.q_heads / p.batch.kv_heads);
  const int64_t row0 = static_cast<int64_t>(b) * p.batch.q_heads + q0;
  uint32_t active = 0;
#pragma unroll
  for (int h = 0; h < kGroup; ++h) active |= RowActive(p.rows, row0 + h) ? 1u << h : 0u;
  if (active == 0) return;

  for (int i = threadIdx.x; i < kGroup * kBins; i += Shape::kThreads) hist[i] = 0;
  __syncthreads();
  const DeviceSeq seq = p.batch.seqs[b];
  const T* keys = static_cast<const T*>(seq.keys);
  // Scores of longer sequences would not fit their rows: cut (RowLength cuts the same way).
  const int32_t n = min(SeqSize(seq), p.rows.max_length);
  if (SeqSize(seq) > p.rows.max_length && threadIdx.x == 0 && split == 0) {
    atomicOr(p.errors, kErrorSeqTooLong);
  }
  const int32_t begin = split * job.chunk;
  const int32_t end = min(begin + job.chunk, n);
  const int num_tiles = end > begin ? (end - begin + kTile - 1) / kTile : 0;
  const RangeTokens tokens{seq, end};

  uint32_t q_frag[kHeadDim / 16][4];
  const ScoreFactor factor = SplitScoreFactor<T>(p.batch.scale_log2);
  LoadQueryFragments<T, kGroup, kHeadDim>(p.batch.q + row0 * kHeadDim, factor, q_frag);

  auto issue = [&](int tile) {
    const int stage = tile % kStages;
    IssueTile<T, Shape, false>(tokens, begin + tile * kTile, keys, keys, kv_head, p.batch.kv_heads,
                               k_tiles + stage * kTile * kHeadDim, nullptr,
                               valid + stage * kTile);
  };
  const int warp = threadIdx.x / 32;
  const int g = (threadIdx.x % 32) / 4;
  const bool scores_row = g < kGroup && (active >> g & 1u);
  float* score_row = scores_row ? p.scores + (row0 + g) * p.rows.score_stride : nullptr;
  uint32_t* row_hist = hist + min(g, kGroup - 1) * kBins;
  RunTilePipeline<kStages>(num_tiles, issue, [&](int tile) {
    // Each warp scores its 16 tokens on tensor cores; lane (g, t) stores head g's scores of its
    // four tokens (a quad covers 8 consecutive positions) and counts them in g's histogram.
    const int first = warp * 16;
    float s[4];
    MmaScores<T, kHeadDim>(k_tiles + (tile % kStages * kTile + first) * kHeadDim, q_frag,
                           factor.after, s);
    if (scores_row) {
      const int32_t tile_begin = begin + tile * kTile + first;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int32_t pos = tile_begin + MmaScoreToken(i);
        if (pos < end) {
          score_row[pos] = s[i];
          atomicAdd(&row_hist[BinOf(s[i])], 1u);
        }
      }
    }
  });
  for (int h = 0; h < kGroup; ++h) {
    if (active >> h & 1u) {
      FlushHistogram<Shape::kThreads>(hist + h * kBins,
                                      p.rows.hist + (row0 + h) * static_cast<int64_t>(kBins));
    }
  }
  if (!FinishedLast(&p.rows.state[row0].blocks_done, job.blocks, &last)) return;
  for (int h = 0; h < kGroup; ++h) {
    if (active >> h & 1u) {
      FindThresholdBin<Shape::kThreads>(p.rows.hist + (row0 + h) * static_cast<int64_t>(kBins),
                                        min(p.rows.k, n), &p.rows.state[row0 + h], scratch);
    }
  }
  if (threadIdx.x == 0) p.rows.state[row0].blocks_done = 0;
}

// Finishes a row of the collect pass with the attention state over its selected tokens (the
// positions and log2-domain scores the collect pass gathered in shared memory).
template <typename T, int kDim, int kThreads>
struct AttendFinish {
  static constexpr int kSmemFloats = AttendSelectedSmemFloats<kDim, kThreads>();
  const DeviceSeq* seqs;
  int q_heads;
  int kv_heads;
  float* o;    // [rows, kDim]
  float* lse;  // [rows]

  __device__ void operator()(const RowTopKParams&, int row, const int32_t* positions,
                             const float* scores, int count, float* smem) const {
    const int b = row / q_heads;
    const int kv_head = (row % q_heads) / (q_heads / kv_heads);
    AttendSelected<T, kDim, kThreads>(
        count, [&](int i) { return positions[i]; }, [&](int i) { return scores[i]; }, seqs[b],
        kv_head, kv_heads, o + static_cast<int64_t>(row) * kDim, lse + row, smem);
  }
};

// Host side of the exact top-K path, shared by ExactTopKAttention and callers that end each
// row with their own Finish (ReTopK's exact rows also update their cache).

// Four stages of 64 tokens (three in flight while one is scored) leave room for two blocks per
// multiprocessor beside their histograms (GQA groups of up to 4). Five stages measured no faster.
template <int kDim>
using ScanTile = TileShape<kDim, 4, 128>;

// Checks a call (ExactTopKAttention's contract) and fills the kernels' parameters.
inline absl::StatusOr<ScoreKeysParams> ExactTopKParams(const DecodeShape& shape,
                                                       const DeviceSeq* seqs, const float* q,
                                                       int max_tokens, int k,
                                                       const uint8_t* active_rows,
                                                       TopKWorkspace* ws, int32_t* support,
                                                       int32_t* support_size) {
  KVRECALL_CUDA_RETURN_IF_ERROR(shape.Validate());
  if (ws == nullptr) return absl::InvalidArgumentError("a TopKWorkspace is required");
  if (k < 1 || max_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("need k >= 1 and max_tokens >= 0, got k=", k, " max_tokens=", max_tokens));
  }
  KVRECALL_CUDA_RETURN_IF_ERROR(ws->CheckFits(shape.rows(), max_tokens));
  if (seqs == nullptr || q == nullptr || support == nullptr || support_size == nullptr) {
    return absl::InvalidArgumentError(
        "seqs, q, support, support_size, o and lse must be device pointers, got null");
  }
  ScoreKeysParams params{};
  params.batch = MakeDecodeBatch(shape, seqs, q);
  params.scores = ws->scores();
  params.errors = ws->errors().device_word();
  RowTopKParams& rows = params.rows;
  rows.scores = ws->scores();
  rows.score_stride = ws->max_tokens();
  rows.active = active_rows;
  rows.seqs = seqs;
  rows.q_heads = shape.q_heads;
  rows.k = k;
  rows.max_length = max_tokens;
  rows.hist = ws->histograms();
  rows.state = ws->states();
  rows.candidates = ws->candidates();
  rows.support = support;
  rows.support_stride = k;
  rows.support_size = support_size;
  return params;
}

template <typename T, int kDim, int kGroup, typename Finish>
absl::Status LaunchExactTopKKernels(const DecodeShape& shape, ScoreKeysParams params,
                                    int max_tokens, const Finish& finish, cudaStream_t stream) {
  using Shape = ScanTile<kDim>;
  constexpr auto kKernel = &ScoreKeysKernel<T, Shape, kGroup>;
  constexpr size_t kSmem = ScoreKeysSmemBytes<T, Shape, kGroup>();
  const absl::StatusOr<int> slots = DeviceBlockSlots<kKernel>(Shape::kThreads, kSmem);
  if (!slots.ok()) return slots.status();
  const int tokens = std::max(max_tokens, 1);
  RowTopKParams rows = params.rows;
  KVRECALL_CUDA_RETURN_IF_ERROR(PlanRowCollect<Finish>(shape.rows(), tokens, &rows));

  const SplitPlan plan = PlanKeySplits(tokens, Shape::kTile, shape.rows() / kGroup, *slots,
                                       /*max_splits=*/1 << 16);
  params.splits = plan.splits;
  params.chunk = plan.chunk;
  const dim3 scan_grid(params.splits, shape.q_heads / kGroup, shape.batch);
  kKernel<<<scan_grid, Shape::kThreads, kSmem, stream>>>(params);
  KVRECALL_CUDA_RETURN_IF_ERROR(LaunchStatus("ScoreKeysKernel"));

  // Collect, select the missing ones, finish.
  return LaunchRowCollect(rows, shape.rows(), finish, stream);
}

// Launches the scan and the collect pass for `shape` (dtype, head_dim and GQA group dispatched
// here); the collect pass ends each row with make_finish.template operator()<KvT, kDim>().
template <typename MakeFinish>
absl::Status LaunchExactTopK(const DecodeShape& shape, const ScoreKeysParams& params,
                             int max_tokens, const MakeFinish& make_finish,
                             cudaStream_t stream) {
  return KVRECALL_DISPATCH_KV_DTYPE(shape.dtype, KvT, [&] {
    return KVRECALL_DISPATCH_HEAD_DIM(shape.head_dim, kDim, [&] {
      const auto finish = make_finish.template operator()<KvT, kDim>();
      switch (HeadsPerBlock(shape.group())) {
        case 8:
          return LaunchExactTopKKernels<KvT, kDim, 8>(shape, params, max_tokens, finish, stream);
        case 4:
          return LaunchExactTopKKernels<KvT, kDim, 4>(shape, params, max_tokens, finish, stream);
        case 2:
          return LaunchExactTopKKernels<KvT, kDim, 2>(shape, params, max_tokens, finish, stream);
        default:
          return LaunchExactTopKKernels<KvT, kDim, 1>(shape, params, max_tokens, finish, stream);
      }
    });
  });
}

}  // namespace kvrecall::cuda

#endif  // KVRECALL_KERNELS_CUDA_EXACT_TOPK_CUH_
