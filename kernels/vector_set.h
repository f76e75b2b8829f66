// Strided sets of vectors and the top-k lists computed over them: the types the index build
// and its CPU and GPU batch top-k share.
#ifndef KVRECALL_KERNELS_VECTOR_SET_H_
#define KVRECALL_KERNELS_VECTOR_SET_H_

#include <cassert>
#include <cstdint>
#include <vector>

#include "kernels/dtype.h"
#include "kernels/kv_view.h"

namespace kvrecall {

// `count` vectors of `dim` elements of type `element`; vector i starts i * stride elements
// into data. Keys of one KV head ([tokens, kv_heads, head_dim] storage, stride
// kv_heads * head_dim, in the KV's element type) and queries of one query head ([tokens,
// q_heads, head_dim] f32, stride q_heads * head_dim) are read in place this way, so no index
// copies the keys it serves (hnswlib, the baseline, keeps its own copy).
struct VectorSet {
  const void* data = nullptr;
  int64_t count = 0;
  int64_t stride = 0;
  int dim = 0;
  KvElement element = KvElement::kF32;

  // Vector i in the set's element type.
  const void* row_data(int64_t i) const {
    return static_cast<const char*>(data) + i * stride * KvElementBytes(element);
  }
  // Vector i of an f32 set.
  const float* row(int64_t i) const {
    assert(element == KvElement::kF32);
    return static_cast<const float*>(data) + i * stride;
  }

  // The vectors [begin, end) of this set.
  VectorSet Slice(int64_t begin, int64_t end) const {
    return VectorSet{data != nullptr ? row_data(begin) : nullptr, end - begin, stride, dim,
                     element};
  }

  // Keys [begin, end) of KV head `kv_head`.
  static VectorSet KeysOf(const KvView& kv, int kv_head, int64_t begin, int64_t end) {
    return VectorSet{kv.keys != nullptr ? kv.key_row(begin, kv_head) : nullptr, end - begin,
                     kv.token_stride(), kv.head_dim, kv.element};
  }

  // This set as the keys of head 0 of a KvView (no values), for the kernels/cpu routines.
  // Requires stride to be a multiple of dim, which both layouts above satisfy.
  KvView AsKeyView() const {
    return KvView{data, nullptr, count, static_cast<int>(stride / dim), dim, element};
  }
};

// The top-k lists of a batch of queries: ids[i * k + j] is the j-th best key of query i, by
// <q, key> with the highest first and ties broken by the lower id.
struct TopKLists {
  int k = 0;                 // entries per query: min(requested k, keys.count)
  int64_t queries = 0;
  std::vector<int32_t> ids;  // [queries, k]

  const int32_t* list(int64_t query) const { return ids.data() + query * k; }
};

}  // namespace kvrecall

#endif  // KVRECALL_KERNELS_VECTOR_SET_H_
