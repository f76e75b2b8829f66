// Fidelity of an approximate attention step against full attention: the figures every
// benchmark speaks in (support recall, retained mass, output cosine, relative L2 error).
#ifndef KVRECALL_KERNELS_FIDELITY_H_
#define KVRECALL_KERNELS_FIDELITY_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

namespace kvrecall {

// Cosine of the angle between a and b ([n] each), accumulated in double; 1 when both are zero.
inline double OutputCosine(const float* a, const float* b, int n) {
  double ab = 0, aa = 0, bb = 0;
  for (int i = 0; i < n; ++i) {
    ab += static_cast<double>(a[i]) * b[i];
    aa += static_cast<double>(a[i]) * a[i];
    bb += static_cast<double>(b[i]) * b[i];
  }
  if (aa == 0 && bb == 0) return 1.0;
  if (aa == 0 || bb == 0) return 0.0;
  return ab / std::sqrt(aa * bb);
}

// ||approx - exact|| / ||exact|| over [n]; the absolute error when exact is zero.
inline double RelativeL2(const float* approx, const float* exact, int n) {
  double diff = 0, norm = 0;
  for (int i = 0; i < n; ++i) {
    const double d = static_cast<double>(approx[i]) - exact[i];
    diff += d * d;
    norm += static_cast<double>(exact[i]) * exact[i];
  }
  return norm == 0 ? std::sqrt(diff) : std::sqrt(diff / norm);
}

// |support ∩ exact| / |exact| for token ids below `tokens` (1 when exact is empty).
// `marks` is caller-owned scratch, all zero on entry and on return.
inline double SupportRecall(std::span<const int32_t> support, std::span<const int32_t> exact,
                            int64_t tokens, std::vector<uint8_t>* marks) {
  if (exact.empty()) return 1.0;
  if (static_cast<int64_t>(marks->size()) < tokens) marks->resize(tokens, 0);
  for (int32_t t : exact) (*marks)[t] = 1;
  int64_t hits = 0;
  for (int32_t t : support) {
    hits += (*marks)[t];
    (*marks)[t] = 0;  // counts each token once even if listed twice
  }
  for (int32_t t : exact) (*marks)[t] = 0;
  return static_cast<double>(hits) / static_cast<double>(exact.size());
}

// The softmax mass of a support under full attention, from the log-sum-exp of its scores and
// that of all tokens: exp(lse_support - lse_full). Rounding can push it a hair above 1.
inline double RetainedMass(float lse_support, float lse_full) {
  return std::min(1.0, std::exp(static_cast<double>(lse_support) - lse_full));
}

}  // namespace kvrecall

#endif  // KVRECALL_KERNELS_FIDELITY_H_
