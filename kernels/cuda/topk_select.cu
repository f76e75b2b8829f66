#include "kernels/cuda/topk_select.cuh"

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/topk_workspace.h"

namespace kvrecall::cuda {

namespace {

// Rows padded to 16 bytes, so that every score row can be read with 16-byte loads.
int PaddedTokens(int max_tokens) { return CeilDiv(max_tokens, 4) * 4; }

}  // namespace

int64_t TopKWorkspace::DeviceBytesFor(int max_rows, int max_tokens) {
  if (max_rows < 1 || max_tokens < 1) return 0;
  const int64_t cells = static_cast<int64_t>(max_rows) * PaddedTokens(max_tokens);
  return cells * (sizeof(float) + sizeof(int32_t)) +
         static_cast<int64_t>(max_rows) * (kBins * sizeof(uint32_t) + sizeof(TopKRowState)) +
         KernelErrors::kDeviceBytes;
}

int64_t TopKWorkspace::device_bytes() const {
  return static_cast<int64_t>(scores_.bytes() + candidates_.bytes() + histograms_.bytes() +
                              states_.bytes()) +
         KernelErrors::kDeviceBytes;
}

absl::StatusOr<std::unique_ptr<TopKWorkspace>> TopKWorkspace::Create(int max_rows,
                                                                    int max_tokens) {
  if (max_rows < 1 || max_tokens < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_rows and max_tokens must be >= 1, got ", max_rows, " and ", max_tokens));
  }
  std::unique_ptr<TopKWorkspace> ws(new TopKWorkspace());
  ws->max_rows_ = max_rows;
  ws->max_tokens_ = PaddedTokens(max_tokens);
  const size_t cells = static_cast<size_t>(max_rows) * ws->max_tokens_;
  KVRECALL_CUDA_RETURN_IF_ERROR(AllocateZeroed(cells, &ws->scores_));
  KVRECALL_CUDA_RETURN_IF_ERROR(AllocateZeroed(cells, &ws->candidates_));
  KVRECALL_CUDA_RETURN_IF_ERROR(
      AllocateZeroed(static_cast<size_t>(max_rows) * kBins, &ws->histograms_));
  KVRECALL_CUDA_RETURN_IF_ERROR(AllocateZeroed(max_rows, &ws->states_));
  absl::StatusOr<KernelErrors> errors = KernelErrors::Create();
  if (!errors.ok()) return errors.status();
  ws->errors_ = *std::move(errors);
  return ws;
}

absl::Status TopKWorkspace::CheckFits(int rows, int tokens) const {
  if (rows > max_rows_ || tokens > max_tokens_) {
    return absl::InvalidArgumentError(absl::StrCat(
        rows, " rows of ", tokens, " tokens exceed the top-K workspace's ", max_rows_,
        " rows of ", max_tokens_, " tokens"));
  }
  return absl::OkStatus();
}

absl::Status SelectRowTopK(const float* scores, int64_t stride, int rows, int length,
                           const int32_t* lengths, int k, TopKWorkspace* ws, int32_t* support,
                           int support_stride, int32_t* support_size, float* support_scores,
                           cudaStream_t stream) {
  if (ws == nullptr) return absl::InvalidArgumentError("a TopKWorkspace is required");
  if (rows < 0 || length < 0 || k < 1 || stride < length || support_stride < std::min(k, length)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "need rows >= 0, length >= 0, k >= 1, stride >= length and support_stride >= "
        "min(k, length); got rows=", rows, " length=", length, " k=", k, " stride=", stride,
        " support_stride=", support_stride));
  }
  KVRECALL_CUDA_RETURN_IF_ERROR(ws->CheckFits(rows, 1));
  if (rows == 0) return absl::OkStatus();
  if (scores == nullptr || support == nullptr || support_size == nullptr) {
    return absl::InvalidArgumentError("scores, support and support_size must be device pointers");
  }
  // Candidates need a row of `stride` entries; the workspace's rows are max_tokens long.
  if (stride > ws->max_tokens()) {
    return absl::InvalidArgumentError(absl::StrCat("score rows of stride ", stride,
                                                   " exceed the workspace's max_tokens ",
                                                   ws->max_tokens()));
  }
  // Both passes split the rows alike.
  absl::StatusOr<RowTopKParams> p =
      PlanRowSelection(scores, stride, rows, length, lengths, k, ws, support, support_stride,
                       support_size, support_scores);
  if (!p.ok()) return p.status();
  RowHistogramKernel<kRowPassThreads><<<dim3(p->splits, rows), kRowPassThreads, 0, stream>>>(*p);
  KVRECALL_CUDA_RETURN_IF_ERROR(LaunchStatus("RowHistogramKernel"));
  return LaunchRowSelection(*p, rows, stream);
}

absl::Status CheckRowTopK(int k) { return CheckRowCollectFits<NoFinish>(k); }

absl::StatusOr<RowTopKParams> PlanRowSelection(const float* scores, int64_t stride, int rows,
                                               int length, const int32_t* lengths, int k,
                                               TopKWorkspace* ws, int32_t* support,
                                               int support_stride, int32_t* support_size,
                                               float* support_scores) {
  RowTopKParams p{};
  p.scores = scores;
  p.score_stride = stride;
  p.lengths = lengths;
  p.length = length;
  p.max_length = length;
  p.k = k;
  p.hist = ws->histograms();
  p.state = ws->states();
  p.candidates = ws->candidates();
  p.support = support;
  p.support_stride = support_stride;
  p.support_size = support_size;
  p.support_scores = support_scores;
  KVRECALL_CUDA_RETURN_IF_ERROR(PlanRowCollect<NoFinish>(rows, length, &p));
  return p;
}

absl::Status LaunchRowSelection(const RowTopKParams& p, int rows, cudaStream_t stream) {
  return LaunchRowCollect(p, rows, NoFinish{}, stream);
}

}  // namespace kvrecall::cuda
