// A read-only view of one layer's KV cache, the input of every attention kernel.
#ifndef KVRECALL_KERNELS_KV_VIEW_H_
#define KVRECALL_KERNELS_KV_VIEW_H_

#include <cstdint>

namespace kvrecall {

// Keys and values of one layer: [tokens, kv_heads, head_dim] each, row-major f32, so the
// key of token t for KV head h starts at keys + (t * kv_heads + h) * head_dim.
struct KvView {
  const float* keys = nullptr;
  const float* values = nullptr;
  int64_t tokens = 0;
  int kv_heads = 0;
  int head_dim = 0;

  const float* key(int64_t t, int h) const {
    return keys + (t * kv_heads + h) * static_cast<int64_t>(head_dim);
  }
  const float* value(int64_t t, int h) const {
    return values + (t * kv_heads + h) * static_cast<int64_t>(head_dim);
  }
  // Distance in floats between the same head of consecutive tokens.
  int64_t token_stride() const { return static_cast<int64_t>(kv_heads) * head_dim; }
};

// Query head -> KV head under grouped-query attention (q_heads / kv_heads queries per group).
inline int KvHeadOf(int q_head, int q_heads, int kv_heads) {
  return q_head / (q_heads / kv_heads);
}

}  // namespace kvrecall

#endif  // KVRECALL_KERNELS_KV_VIEW_H_
