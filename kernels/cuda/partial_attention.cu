#include "kernels/cuda/partial_attention.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/partial_attention.cuh"

namespace kvrecall::cuda {
namespace {

// Merges the `splits` partial states of each row into its final state, one block per row and
// one thread per element of head_dim; MergeStateInto is the same exact merge the CPU uses.
// Merges the `splits` partial states of each row into its final state with MergeStateInto, the
// same exact merge the CPU uses, one thread per element of head_dim: kMergeChains threads per
// element each merge every kMergeChains-th split, then the chains merge as a tree, so the
// dependent merges per thread are splits / kMergeChains + log2(kMergeChains).
// block = (head_dim, kMergeChains), one block per row.
constexpr int kMergeChains = 8;

__global__ void MergeSplitsKernel(const float* partial_o, const float* partial_lse, int splits,
                                  int head_dim, float* o, float* lse) {
  constexpr int kInFlight = 4;  // splits of a chain loaded before any is merged
  extern __shared__ float chain_o[];  // [kMergeChains][head_dim]
  __shared__ float chain_lse[kMergeChains];
  const int64_t row = blockIdx.x;
  const int dim = threadIdx.x;
  const int chain = threadIdx.y;
  float acc_o = 0.0f;
  float acc_lse = kEmptyLse;
  for (int s0 = chain; s0 < splits; s0 += kMergeChains * kInFlight) {
    float part_o[kInFlight], part_lse[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int s = s0 + u * kMergeChains;
      part_o[u] = s < splits ? partial_o[(row * splits + s) * head_dim + dim] : 0.0f;
      part_lse[u] = s < splits ? partial_lse[row * splits + s] : kEmptyLse;  // merges as a no-op
    }
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) MergeStateInto(&part_o[u], part_lse[u], &acc_o, &acc_lse, 1);
  }
  for (int stride = kMergeChains / 2; stride > 0; stride /= 2) {
    if (chain >= stride && chain < 2 * stride) {
      chain_o[chain * head_dim + dim] = acc_o;
      if (dim == 0) chain_lse[chain] = acc_lse;
    }
    __syncthreads();
    if (chain < stride) {
      MergeStateInto(&chain_o[(chain + stride) * head_dim + dim], chain_lse[chain + stride],
                     &acc_o, &acc_lse, 1);
    }
    __syncthreads();
  }
  if (chain == 0) {
    o[row * head_dim + dim] = acc_o;
    if (dim == 0) lse[row] = acc_lse;
  }
}

// (o, lse) <- merge((o, lse), (o_other, lse_other)) for every row, in place.
__global__ void MergeStatesKernel(const float* o_other, const float* lse_other, int head_dim,
                                  float* o, float* lse) {
  const int64_t row = blockIdx.x;
  const int dim = threadIdx.x;
  float acc_lse = lse[row];
  MergeStateInto(o_other + row * head_dim + dim, lse_other[row], o + row * head_dim + dim,
                 &acc_lse, 1);
  __syncthreads();  // every thread read lse[row] before it is replaced
  if (dim == 0) lse[row] = acc_lse;
}


// Three stages of 64 tokens (two tiles, 64 KB of keys and values, in flight) leave room for two
// blocks per multiprocessor; seven stages in one block measured slower.
template <int kDim>
using AttentionTile = TileShape<kDim, 3>;

absl::Status CheckCall(const DecodeShape& shape, const AttentionWorkspace* ws, const void* seqs,
                       const void* q, const void* o, const void* lse) {
  KVRECALL_CUDA_RETURN_IF_ERROR(shape.Validate());
  if (ws == nullptr) return absl::InvalidArgumentError("an AttentionWorkspace is required");
  if (shape.rows() > ws->max_rows()) {
    return absl::InvalidArgumentError(absl::StrCat("batch * q_heads = ", shape.rows(),
                                                   " exceeds the workspace's max_rows ",
                                                   ws->max_rows()));
  }
  if (seqs == nullptr || q == nullptr || o == nullptr || lse == nullptr) {
    return absl::InvalidArgumentError("seqs, q, o and lse must be device pointers, got null");
  }
  return absl::OkStatus();
}

template <typename T, int kDim, int kGroup, bool kIndexed>
struct AttentionKernel {
  using Shape = AttentionTile<kDim>;
  static constexpr auto kKernel = &PartialAttentionKernel<T, Shape, kGroup, kIndexed>;
  static constexpr size_t kSmem = PartialAttentionSmemBytes<T, Shape, kGroup>();

  static absl::StatusOr<SplitPlan> Plan(const DecodeShape& shape, int max_tokens,
                                        const AttentionWorkspace& ws) {
    const absl::StatusOr<int> slots = DeviceBlockSlots<kKernel>(Shape::kThreads, kSmem);
    if (!slots.ok()) return slots.status();
    return PlanKeySplits(max_tokens, Shape::kTile, shape.rows() / kGroup, *slots,
                         ws.max_splits());
  }

  static absl::Status Run(const DecodeShape& shape, PartialAttentionParams params, int max_tokens,
                          AttentionWorkspace* ws, cudaStream_t stream) {
    const absl::StatusOr<SplitPlan> plan = Plan(shape, max_tokens, *ws);
    if (!plan.ok()) return plan.status();
    params.splits = plan->splits;
    params.chunk = plan->chunk;
    params.partial_o = ws->partial_o();
    params.partial_lse = ws->partial_lse();
    params.errors = ws->errors().device_word();
    const dim3 grid(plan->splits, shape.q_heads / kGroup, shape.batch);
    kKernel<<<grid, Shape::kThreads, kSmem, stream>>>(params);
    KVRECALL_CUDA_RETURN_IF_ERROR(LaunchStatus("PartialAttentionKernel"));
    if (plan->splits > 1) {
      MergeSplitsKernel<<<shape.rows(), dim3(kDim, kMergeChains),
                          kMergeChains * kDim * sizeof(float), stream>>>(
          params.partial_o, params.partial_lse, plan->splits, kDim, params.o, params.lse);
      KVRECALL_CUDA_RETURN_IF_ERROR(LaunchStatus("MergeSplitsKernel"));
    }
    return absl::OkStatus();
  }
};

// Calls F::template Apply<AttentionKernel<...>>() for the kernel serving `shape`.
template <bool kIndexed, typename F>
auto DispatchAttention(const DecodeShape& shape, F&& f) {
  return KVRECALL_DISPATCH_KV_DTYPE(shape.dtype, KvT, [&] {
    return KVRECALL_DISPATCH_HEAD_DIM(shape.head_dim, kDim, [&] {
      if constexpr (kIndexed) {
        return f(AttentionKernel<KvT, kDim, 1, true>{});
      } else {
        switch (HeadsPerBlock(shape.group())) {
          case 8:
            return f(AttentionKernel<KvT, kDim, 8, false>{});
          case 4:
            return f(AttentionKernel<KvT, kDim, 4, false>{});
          case 2:
            return f(AttentionKernel<KvT, kDim, 2, false>{});
          default:
            return f(AttentionKernel<KvT, kDim, 1, false>{});
        }
      }
    });
  });
}

PartialAttentionParams BaseParams(const DecodeShape& shape, const DeviceSeq* seqs, const float* q,
                                  float* o, float* lse) {
  PartialAttentionParams params{};
  params.batch = MakeDecodeBatch(shape, seqs, q);
  params.o = o;
  params.lse = lse;
  return params;
}

}  // namespace

absl::StatusOr<std::unique_ptr<AttentionWorkspace>> AttentionWorkspace::Create(int max_rows,
                                                                                int max_splits) {
  if (max_rows < 1 || max_splits < 1) {
    return absl::InvalidArgumentError(absl::StrCat("max_rows and max_splits must be >= 1, got ",
                                                   max_rows, " and ", max_splits));
  }
  std::unique_ptr<AttentionWorkspace> ws(new AttentionWorkspace());
  ws->max_rows_ = max_rows;
  ws->max_splits_ = max_splits;
  const size_t states = static_cast<size_t>(max_rows) * max_splits;
  KVRECALL_CUDA_RETURN_IF_ERROR(AllocateZeroed(states * 128, &ws->partial_o_));
  KVRECALL_CUDA_RETURN_IF_ERROR(AllocateZeroed(states, &ws->partial_lse_));
  absl::StatusOr<KernelErrors> errors = KernelErrors::Create();
  if (!errors.ok()) return errors.status();
  ws->errors_ = *std::move(errors);
  return ws;
}

int64_t AttentionWorkspace::DeviceBytesFor(int max_rows, int max_splits) {
  if (max_rows < 1 || max_splits < 1) return 0;
  const int64_t states = static_cast<int64_t>(max_rows) * max_splits;
  return states * (128 + 1) * sizeof(float) + KernelErrors::kDeviceBytes;
}

int64_t AttentionWorkspace::device_bytes() const {
  return static_cast<int64_t>(partial_o_.bytes() + partial_lse_.bytes()) +
         KernelErrors::kDeviceBytes;
}

absl::StatusOr<SplitPlan> PlanSeqAttention(const DecodeShape& shape, int max_tokens,
                                           const AttentionWorkspace& ws) {
  KVRECALL_CUDA_RETURN_IF_ERROR(shape.Validate());
  return DispatchAttention<false>(shape, [&](auto kernel) {
    return decltype(kernel)::Plan(shape, max_tokens, ws);
  });
}

absl::Status PartialAttentionOverSeqs(const DecodeShape& shape, const DeviceSeq* seqs,
                                      const float* q, int max_tokens, AttentionWorkspace* ws,
                                      float* o, float* lse, cudaStream_t stream) {
  KVRECALL_CUDA_RETURN_IF_ERROR(CheckCall(shape, ws, seqs, q, o, lse));
  if (max_tokens < 0) {
    return absl::InvalidArgumentError(absl::StrCat("max_tokens must be >= 0, got ", max_tokens));
  }
  const PartialAttentionParams params = BaseParams(shape, seqs, q, o, lse);
  return DispatchAttention<false>(shape, [&](auto kernel) {
    return decltype(kernel)::Run(shape, params, max_tokens, ws, stream);
  });
}

absl::Status PartialAttentionOverIds(const DecodeShape& shape, const DeviceSeq* seqs,
                                     const float* q, const int32_t* ids, const int32_t* counts,
                                     int max_ids, AttentionWorkspace* ws, float* o, float* lse,
                                     cudaStream_t stream) {
  KVRECALL_CUDA_RETURN_IF_ERROR(CheckCall(shape, ws, seqs, q, o, lse));
  if (max_ids < 0) {
    return absl::InvalidArgumentError(absl::StrCat("max_ids must be >= 0, got ", max_ids));
  }
  if (max_ids > 0 && (ids == nullptr || counts == nullptr)) {
    return absl::InvalidArgumentError("ids and counts must be device pointers, got null");
  }
  PartialAttentionParams params = BaseParams(shape, seqs, q, o, lse);
  params.ids = ids;
  params.counts = counts;
  params.max_ids = max_ids;
  return DispatchAttention<true>(shape, [&](auto kernel) {
    return decltype(kernel)::Run(shape, params, max_ids, ws, stream);
  });
}

absl::Status MergeAttentionStates(int rows, int head_dim, const float* o_other,
                                  const float* lse_other, float* o, float* lse,
                                  cudaStream_t stream) {
  if (rows < 0 || head_dim < 1 || head_dim > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("rows must be >= 0 and head_dim in [1, 1024], got ", rows, " and ", head_dim));
  }
  if (rows == 0) return absl::OkStatus();
  if (o_other == nullptr || lse_other == nullptr || o == nullptr || lse == nullptr) {
    return absl::InvalidArgumentError("state pointers must be device pointers, got null");
  }
  MergeStatesKernel<<<rows, head_dim, 0, stream>>>(o_other, lse_other, head_dim, o, lse);
  return LaunchStatus("MergeStatesKernel");
}

}  // namespace kvrecall::cuda
