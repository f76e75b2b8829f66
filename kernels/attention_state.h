// The attention state (partial output + log-sum-exp): what every partial-attention routine
// returns and the merge consumes, on the CPU and the GPU alike.
#ifndef KVRECALL_KERNELS_ATTENTION_STATE_H_
#define KVRECALL_KERNELS_ATTENTION_STATE_H_

#include <cmath>
#include <limits>

#if defined(__CUDACC__)
#define KVRECALL_HOST_DEVICE __host__ __device__
#else
#define KVRECALL_HOST_DEVICE
#endif

namespace kvrecall {

// For a query q and a token set S with scaled scores s_i = scale * <q, k_i>:
//   lse = log(sum_{i in S} exp(s_i))          (natural log; -inf for an empty S)
//   o   = sum_{i in S} exp(s_i - lse) * v_i   (o = 0 for an empty S)
// Two states over disjoint sets merge exactly into the state over their union, which is why
// the GPU static set and the CPU-retrieved bulk can be attended separately.
inline constexpr float kEmptyLse = -std::numeric_limits<float>::infinity();

// Merges the state (o_other, lse_other) into (o, lse), in place. o and o_other: [head_dim].
KVRECALL_HOST_DEVICE inline void MergeStateInto(const float* o_other, float lse_other, float* o,
                                                float* lse, int head_dim) {
  const float a = *lse;
  const float b = lse_other;
  if (b == kEmptyLse) return;
  if (a == kEmptyLse) {
    for (int i = 0; i < head_dim; ++i) o[i] = o_other[i];
    *lse = b;
    return;
  }
  // Rescale by the larger lse so neither exponent overflows.
  const float m = a > b ? a : b;
  const float wa = expf(a - m);
  const float wb = expf(b - m);
  const float inv = 1.0f / (wa + wb);
  for (int i = 0; i < head_dim; ++i) o[i] = (o[i] * wa + o_other[i] * wb) * inv;
  *lse = m + logf(wa + wb);
}

}  // namespace kvrecall

#endif  // KVRECALL_KERNELS_ATTENTION_STATE_H_
