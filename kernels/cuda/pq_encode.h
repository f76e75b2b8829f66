// Host API of the GPU encoder of product-quantized keys: each key's code (its nearest centroid
// in every codebook) and its squared reconstruction error, so that a long prompt's keys are
// coded on the device at prefill (issue 15's build time) and a decode step's new bulk key inside
// the step's own launches, rather than on the host. The CPU reference is ProductQuantizer::Encode
// (index/product_quantizer.h), held to by tests/cuda_pq_encode_test.cu. Nothing here allocates
// or synchronizes.
#ifndef KVRECALL_KERNELS_CUDA_PQ_ENCODE_H_
#define KVRECALL_KERNELS_CUDA_PQ_ENCODE_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/dtype.h"
#include "kernels/cuda/pq_shortlist.h"

namespace kvrecall::cuda {

// The keys of one or more code sets in device memory and where their codes go. Set 0: `count`
// rows of `dim` elements of `element` (f32, bf16 or f16), row i at element i * row_stride of
// `keys` (row_stride >= dim, so that one KV head of a [tokens, kv_heads, dim] block is a code
// set); codebooks [M, 256, dim / M] f32. Set s: the same from the set strides below.
struct PqEncodeParams {
  const void* keys = nullptr;
  KvElement element = KvElement::kBf16;
  int64_t count = 0;
  int64_t row_stride = 0;
  int dim = 0;
  int subspaces = 0;  // M: dividing dim into parts of 4, 8, 16 or 32; M <= kMaxPqSubspaces
  const float* codebooks = nullptr;
  uint8_t* codes = nullptr;  // [count, M] per set
  float* errors = nullptr;   // [count] per set, or null
  // Code sets coded by the one call (a bulk's KV heads): set s's keys, codebooks, codes and
  // errors start these many elements, floats, bytes and floats after set 0's. 1 <= sets <= 65535;
  // with more than one, the sets' codes (|code_set_stride| >= count * M) and errors
  // (|error_set_stride| >= count) must not overlap.
  int sets = 1;
  int64_t key_set_stride = 0;
  int64_t codebook_set_stride = 0;
  int64_t code_set_stride = 0;
  int64_t error_set_stride = 0;
  // Keys a warp weighs at once: 0 lets PqEncodeKeysPerWarp choose from the device's SM count;
  // 1, 2 or 8 takes that split (the codes are the same whichever: tests take each).
  int keys_per_warp = 0;
};

// The keys a warp of PqEncode weighs at once for `count` keys of `sets` sets on a device of `sms`
// multiprocessors: 8 (each centroid read serves 8 keys, each staged codebook 64) when blocks of
// 8 warps' 8 keys still give every SM one; else 2, or 1 (the most blocks) when even 2 would not.
int PqEncodeKeysPerWarp(int64_t count, int sets, int sms);

// For every set, key i < count and codebook m, with x its part m widened to f32:
//   codes[i, m] = the c of the least |c|^2 - 2 <x, c> over codebook m's centroids c, the lower
//     c on a tie, computed as ProductQuantizer::Encode does (|c|^2 summed in order, then one
//     multiply-add of -2 x_j and c_j per dim in order);
//   errors[i] = the sum over the key's dims, in order, of (key_j - reconstruction_j)^2, as
//     BulkCodes weighs its outliers.
// Every set's keys in one launch of a block per (8 warps' keys, set): a warp weighs the 256
// centroids of a codebook staged in shared memory, 8 a lane, against its 8, 2 or 1 keys at once
// (PqEncodeKeysPerWarp, unless keys_per_warp says), so that the keys' chains hide each other's
// latencies and a few hundred keys still spread over the device: 28-92 us for 8 to 2048 keys of
// 8 sets on an H100 (bench/results/pq_encode.md). Reads the device's SM count (once per device)
// when it chooses; the codes are the same on any device and split.
// INVALID_ARGUMENT for shapes outside the bounds above, null pointers with keys to code, or a
// keys_per_warp other than 0, 1, 2 or 8; the runtime's error (or OUT_OF_RANGE for a device
// ordinal of 64 or more) when the SM count cannot be read.
absl::Status PqEncode(const PqEncodeParams& p, cudaStream_t stream);

// One key of a PqEncodeRows call, in device memory: the key (dim elements of the call's
// element type), its codebooks ([M, 256, dim / M] f32), where its code goes ([M] u8; null: the
// job is skipped) and its squared reconstruction error (or null).
struct PqEncodeJob {
  const void* key = nullptr;
  const float* codebooks = nullptr;
  uint8_t* codes = nullptr;
  float* error = nullptr;
};

// Single keys to code, each with its own codebooks and destination, read from device memory
// when the kernel runs: a captured decode step replays with the step's keys (its tokens leaving
// the static sets' rings) without being captured again.
struct PqEncodeRowsParams {
  const PqEncodeJob* jobs = nullptr;  // device [count]
  int count = 0;
  KvElement element = KvElement::kBf16;
  int dim = 0;
  int subspaces = 0;  // as PqEncodeParams
};

// For every job with codes: its code and error as PqEncode computes them for the same key and
// codebooks, bit for bit (the same arithmetic, one block of threads per key). INVALID_ARGUMENT
// for shapes outside PqEncode's bounds, count < 0, or null jobs with count > 0; the jobs'
// pointers are the caller's contract.
absl::Status PqEncodeRows(const PqEncodeRowsParams& p, cudaStream_t stream);

}  // namespace kvrecall::cuda

#endif  // KVRECALL_KERNELS_CUDA_PQ_ENCODE_H_
