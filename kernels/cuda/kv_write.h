// Host API of the kernels that write keys and values into a sequence's KV on the GPU, converting
// f32 to the KV dtype: a prompt's rows at an offset (prefill), and one decode token per sequence
// of a batch (the append of a step, one launch for the batch).
#ifndef KVRECALL_KERNELS_CUDA_KV_WRITE_H_
#define KVRECALL_KERNELS_CUDA_KV_WRITE_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/decode_types.h"

namespace kvrecall::cuda {

// dst[i] = src[i] converted to `dtype` (round to nearest even) for i in [0, count): src f32 and
// dst of the KV dtype, both device memory. Neither allocates nor synchronizes.
absl::Status ConvertToKv(const float* src, int64_t count, KvDtype dtype, void* dst,
                         cudaStream_t stream);

// Where one sequence's new token goes: the key and value rows ([row_elems] of the KV dtype) of
// its slot, device addresses.
struct TokenRows {
  void* key = nullptr;
  void* value = nullptr;
};

// For b in [0, batch): rows[b].key = keys[b], rows[b].value = values[b], converted to `dtype`.
// rows: device [batch]; keys and values: device [batch, row_elems] f32. One launch.
absl::Status AppendTokens(int batch, int row_elems, KvDtype dtype, const TokenRows* rows,
                          const float* keys, const float* values, cudaStream_t stream);

}  // namespace kvrecall::cuda

#endif  // KVRECALL_KERNELS_CUDA_KV_WRITE_H_
