// Device scratch of the GPU top-K selection (kernels/cuda/topk_select.cuh): per-row scores,
// candidates, histograms and selection state, allocated once and left zeroed by every call.
#ifndef KVRECALL_KERNELS_CUDA_TOPK_WORKSPACE_H_
#define KVRECALL_KERNELS_CUDA_TOPK_WORKSPACE_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/kernel_errors.h"

namespace kvrecall::cuda {

// Per-row selection state on the device; all zero between calls.
struct TopKRowState {
  uint32_t threshold_bin;  // histogram bin of the K-th largest score (kNoThreshold when K = 0)
  uint32_t need;           // how many of that bin's elements belong to the top K
  uint32_t selected;       // positions appended to the support so far
  uint32_t candidates;     // positions of the threshold bin collected so far
  uint32_t blocks_done;    // finished blocks of the current pass, for last-block detection
  // With RowTopKParams::linear_bins: the row's histogram spans [bin_low, bin_low + kBins /
  // bin_scale), written by the row's scorer before pass 1 (LinearBinOf in topk_select.cuh).
  float bin_low;
  float bin_scale;
  uint32_t pad;
};

// Scratch for selecting among up to `max_tokens` scores in each of up to `max_rows` rows. One
// per stream in flight. Device memory: about 8 * max_rows * max_tokens bytes.
class TopKWorkspace {
 public:
  static absl::StatusOr<std::unique_ptr<TopKWorkspace>> Create(int max_rows, int max_tokens);
  // Exact device bytes Create(max_rows, max_tokens) allocates, so that a caller can charge its
  // GPU budget first (0 for arguments Create rejects).
  static int64_t DeviceBytesFor(int max_rows, int max_tokens);
  int64_t device_bytes() const;

  int max_rows() const { return max_rows_; }
  int max_tokens() const { return max_tokens_; }  // the requested one rounded up to 4
  float* scores() const { return scores_.data(); }             // [max_rows, max_tokens]
  int32_t* candidates() const { return candidates_.data(); }   // [max_rows, max_tokens]
  uint32_t* histograms() const { return histograms_.data(); }  // [max_rows, bins]
  TopKRowState* states() const { return states_.data(); }      // [max_rows]
  const KernelErrors& errors() const { return errors_; }

  // INVALID_ARGUMENT unless rows x tokens fits this workspace.
  absl::Status CheckFits(int rows, int tokens) const;

 private:
  TopKWorkspace() = default;
  int max_rows_ = 0;
  int max_tokens_ = 0;
  DeviceBuffer<float> scores_;
  DeviceBuffer<int32_t> candidates_;
  DeviceBuffer<uint32_t> histograms_;
  DeviceBuffer<TopKRowState> states_;
  KernelErrors errors_;
};

// The top min(k, n_r) of the first n_r scores of each row r of `scores` ([rows, stride] f32,
// device), by score and then lower position: support [rows, support_stride] (positions, in no
// particular order), support_size [rows], and when non-null support_scores [rows,
// support_stride]. n_r = lengths[r] (device [rows], each in [0, length]) or, when lengths is
// null, `length`. Scores must not be NaN. Neither allocates nor synchronizes.
absl::Status SelectRowTopK(const float* scores, int64_t stride, int rows, int length,
                           const int32_t* lengths, int k, TopKWorkspace* ws, int32_t* support,
                           int support_stride, int32_t* support_size, float* support_scores,
                           cudaStream_t stream);

// INVALID_ARGUMENT unless the current device can select k a row (SelectRowTopK, the PQ
// shortlist's selection): a row's k positions and scores are gathered in shared memory, 8 bytes
// each, which bounds k (about 28,000 on an H100 or H200) far below index/selector_params.h's
// kMaxTopK. What a server checks a policy's top-K lengths against before it admits a session.
absl::Status CheckRowTopK(int k);

}  // namespace kvrecall::cuda

#endif  // KVRECALL_KERNELS_CUDA_TOPK_WORKSPACE_H_
