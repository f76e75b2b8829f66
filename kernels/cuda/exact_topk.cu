#include "kernels/cuda/exact_topk.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/exact_topk.cuh"
#include "kernels/cuda/launch.cuh"

namespace kvrecall::cuda {
namespace {

// Four stages of 64 tokens (three in flight while one is scored) leave room for two blocks per
// multiprocessor beside their histograms (GQA groups of up to 4). Five stages measured no faster.
template <int kDim>
using ScanTile = TileShape<kDim, 4, 128>;

template <typename T, int kDim, int kGroup>
absl::Status LaunchExactTopK(const DecodeShape& shape, ScoreKeysParams params, int max_tokens,
                             float* o, float* lse, cudaStream_t stream) {
  using Shape = ScanTile<kDim>;
  constexpr auto kKernel = &ScoreKeysKernel<T, Shape, kGroup>;
  constexpr size_t kSmem = ScoreKeysSmemBytes<T, Shape, kGroup>();
  const absl::StatusOr<int> slots = DeviceBlockSlots<kKernel>(Shape::kThreads, kSmem);
  if (!slots.ok()) return slots.status();
  using Finish = AttendFinish<T, kDim, kRowPassThreads>;
  constexpr auto kCollect = &RowCollectKernel<kRowPassThreads, Finish>;
  // Registers, not shared memory, bound how many collect blocks a multiprocessor holds.
  const absl::StatusOr<int> collect_slots = DeviceBlockSlots<kCollect>(kRowPassThreads, 0);
  if (!collect_slots.ok()) return collect_slots.status();

  const int tokens = std::max(max_tokens, 1);
  const SplitPlan plan = PlanKeySplits(tokens, Shape::kTile, shape.rows() / kGroup, *slots,
                                       /*max_splits=*/1 << 16);
  params.splits = plan.splits;
  params.chunk = plan.chunk;
  const dim3 scan_grid(params.splits, shape.q_heads / kGroup, shape.batch);
  kKernel<<<scan_grid, Shape::kThreads, kSmem, stream>>>(params);
  KVRECALL_CUDA_RETURN_IF_ERROR(LaunchStatus("ScoreKeysKernel"));

  // Collect, select the missing ones, attend.
  RowTopKParams rows = params.rows;
  PlanRowPasses(shape.rows(), tokens, *collect_slots, &rows);
  const Finish finish{params.batch.seqs, shape.q_heads, shape.kv_heads, o, lse};
  const dim3 collect_grid(rows.splits, shape.rows());
  const size_t collect_smem = RowCollectSmemBytes(rows.k);
  KVRECALL_CUDA_RETURN_IF_ERROR(AllowDynamicSharedMemory<kCollect>(collect_smem));
  kCollect<<<collect_grid, kRowPassThreads, collect_smem, stream>>>(rows, finish);
  return LaunchStatus("RowCollectKernel");
}

}  // namespace

absl::Status ExactTopKAttention(const DecodeShape& shape, const DeviceSeq* seqs, const float* q,
                                int max_tokens, int k, const uint8_t* active_rows,
                                TopKWorkspace* ws, int32_t* support, int32_t* support_size,
                                float* o, float* lse, cudaStream_t stream) {
  KVRECALL_CUDA_RETURN_IF_ERROR(shape.Validate());
  if (ws == nullptr) return absl::InvalidArgumentError("a TopKWorkspace is required");
  if (k < 1 || max_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("need k >= 1 and max_tokens >= 0, got k=", k, " max_tokens=", max_tokens));
  }
  KVRECALL_CUDA_RETURN_IF_ERROR(ws->CheckFits(shape.rows(), max_tokens));
  if (seqs == nullptr || q == nullptr || support == nullptr || support_size == nullptr ||
      o == nullptr || lse == nullptr) {
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
  return KVRECALL_DISPATCH_KV_DTYPE(shape.dtype, KvT, [&] {
    return KVRECALL_DISPATCH_HEAD_DIM(shape.head_dim, kDim, [&] {
      switch (HeadsPerBlock(shape.group())) {
        case 8:
          return LaunchExactTopK<KvT, kDim, 8>(shape, params, max_tokens, o, lse, stream);
        case 4:
          return LaunchExactTopK<KvT, kDim, 4>(shape, params, max_tokens, o, lse, stream);
        case 2:
          return LaunchExactTopK<KvT, kDim, 2>(shape, params, max_tokens, o, lse, stream);
        default:
          return LaunchExactTopK<KvT, kDim, 1>(shape, params, max_tokens, o, lse, stream);
      }
    });
  });
}

}  // namespace kvrecall::cuda
