// The shapes and device-side descriptors every CUDA decode kernel takes: the layer geometry of
// a step, and where each sequence's keys and values live on the GPU.
#ifndef KVRECALL_KERNELS_CUDA_DECODE_TYPES_H_
#define KVRECALL_KERNELS_CUDA_DECODE_TYPES_H_

#include <cmath>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace kvrecall::cuda {

// Element type of keys and values on the GPU. Queries, outputs and every accumulation are f32.
enum class KvDtype { kBf16, kF16 };

// One layer of one decode step: `batch` sequences, each with one query per query head.
struct DecodeShape {
  int batch = 0;
  int q_heads = 0;
  int kv_heads = 0;
  int head_dim = 0;   // 64 or 128
  KvDtype dtype = KvDtype::kBf16;
  float scale = 0.0f; // softmax scale applied to <q, k>

  int rows() const { return batch * q_heads; }  // one (sequence, query head) pair per row
  int group() const { return q_heads / kv_heads; }

  // INVALID_ARGUMENT naming the field when the geometry is not one the kernels serve.
  absl::Status Validate() const {
    if (batch < 1) return absl::InvalidArgumentError(absl::StrCat("batch must be >= 1, got ", batch));
    if (kv_heads < 1 || q_heads < kv_heads || q_heads % kv_heads != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "q_heads must be a positive multiple of kv_heads, got q_heads=", q_heads,
          " kv_heads=", kv_heads));
    }
    if (head_dim != 64 && head_dim != 128) {
      return absl::InvalidArgumentError(
          absl::StrCat("head_dim must be 64 or 128 on the GPU, got ", head_dim));
    }
    if (!(scale > 0.0f) || !std::isfinite(scale)) {
      return absl::InvalidArgumentError(absl::StrCat("scale must be positive and finite, got ", scale));
    }
    return absl::OkStatus();
  }
};

// How the tokens of one launch are split across blocks (flash-decoding). Fixed by host-side
// bounds only, so it stays valid while a captured graph replays with other lengths.
struct SplitPlan {
  int splits = 1;
  int chunk = 0;  // tokens per split, a multiple of the kernel's tile
};

// One sequence's keys and values of one layer on the GPU, and the list of tokens attention
// sees there, by logical position. keys and values: [slots, kv_heads, head_dim] of the layer's
// dtype, row-major. Logical positions [0, size()) map to slots:
//   p <  head_count: slot p (attention sinks; or the whole history when there is no ring);
//   p >= head_count: the ring [ring_begin, ring_begin + ring_capacity), read from its oldest
//                    live entry ring_begin + ring_start on, wrapping at its end.
// Top-K kernels return logical positions; with no ring they are token positions.
// Lives in device memory ([batch] of them per call) so a replayed CUDA graph sees new lengths.
struct DeviceSeq {
  const void* keys = nullptr;
  const void* values = nullptr;
  int32_t head_count = 0;
  int32_t ring_begin = 0;
  int32_t ring_capacity = 0;
  int32_t ring_start = 0;   // in [0, ring_capacity)
  int32_t ring_count = 0;   // in [0, ring_capacity]

  int32_t size() const { return head_count + ring_count; }

  // The whole history [0, tokens) stored contiguously.
  static DeviceSeq Contiguous(const void* keys, const void* values, int32_t tokens) {
    return DeviceSeq{keys, values, tokens, 0, 0, 0, 0};
  }
};

}  // namespace kvrecall::cuda

#endif  // KVRECALL_KERNELS_CUDA_DECODE_TYPES_H_
