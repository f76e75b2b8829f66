// A read-only view of one layer's KV cache, the input of every attention kernel.
#ifndef KVRECALL_KERNELS_KV_VIEW_H_
#define KVRECALL_KERNELS_KV_VIEW_H_

#include <cassert>
#include <cstdint>

#include "kernels/dtype.h"

namespace kvrecall {

// Keys and values of one layer: [tokens, kv_heads, head_dim] each, row-major, stored as
// `element` (f32, or the model's bf16 / f16), so the key of token t for KV head h starts
// (t * kv_heads + h) * head_dim elements into keys. The kernels of kernels/cpu read every
// element type; key() and value() hand out f32 rows and are for f32 views only.
struct KvView {
  const void* keys = nullptr;
  const void* values = nullptr;
  int64_t tokens = 0;
  int kv_heads = 0;
  int head_dim = 0;
  KvElement element = KvElement::kF32;

  // Elements from the start of the storage to the row of token t, KV head h.
  int64_t offset(int64_t t, int h) const {
    return (t * kv_heads + h) * static_cast<int64_t>(head_dim);
  }
  // Row (t, h) in the view's element type.
  const void* key_row(int64_t t, int h) const {
    return static_cast<const char*>(keys) + offset(t, h) * KvElementBytes(element);
  }
  const void* value_row(int64_t t, int h) const {
    return static_cast<const char*>(values) + offset(t, h) * KvElementBytes(element);
  }
  // Row (t, h) of an f32 view.
  const float* key(int64_t t, int h) const {
    assert(element == KvElement::kF32);
    return static_cast<const float*>(keys) + offset(t, h);
  }
  const float* value(int64_t t, int h) const {
    assert(element == KvElement::kF32);
    return static_cast<const float*>(values) + offset(t, h);
  }
  // Distance in elements between the same head of consecutive tokens.
  int64_t token_stride() const { return static_cast<int64_t>(kv_heads) * head_dim; }

  // The tokens [begin, begin + count) as a view of their own (token begin becomes token 0).
  KvView Tokens(int64_t begin, int64_t count) const {
    const int64_t skip = begin * token_stride() * KvElementBytes(element);
    return KvView{keys != nullptr ? static_cast<const char*>(keys) + skip : nullptr,
                  values != nullptr ? static_cast<const char*>(values) + skip : nullptr,
                  count, kv_heads, head_dim, element};
  }
};

// Query head -> KV head under grouped-query attention (q_heads / kv_heads queries per group).
inline int KvHeadOf(int q_head, int q_heads, int kv_heads) {
  return q_head / (q_heads / kv_heads);
}

}  // namespace kvrecall

#endif  // KVRECALL_KERNELS_KV_VIEW_H_
