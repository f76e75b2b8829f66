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

// Attention-weighted support recall: the share of the exact support's softmax mass that `support`
// keeps, sum over exact ∩ support of exp(s) / sum over exact of exp(s), where exact_scores[i] is
// the scaled score s of exact[i]. Unlike SupportRecall, missing a tail token of negligible weight
// costs almost nothing and missing a dominant one almost everything. 1 when exact is empty.
// `marks` is caller-owned scratch, all zero on entry and on return.
inline double WeightedSupportRecall(std::span<const int32_t> support,
                                    std::span<const int32_t> exact,
                                    std::span<const float> exact_scores, int64_t tokens,
                                    std::vector<uint8_t>* marks) {
  if (exact.empty()) return 1.0;
  if (static_cast<int64_t>(marks->size()) < tokens) marks->resize(tokens, 0);
  const float max_score = *std::max_element(exact_scores.begin(), exact_scores.end());
  for (int32_t t : support) (*marks)[t] = 1;
  double kept = 0, total = 0;
  for (size_t i = 0; i < exact.size(); ++i) {
    const double w = std::exp(static_cast<double>(exact_scores[i]) - max_score);
    total += w;
    if ((*marks)[exact[i]]) kept += w;
  }
  for (int32_t t : support) (*marks)[t] = 0;
  return kept / total;
}

// The softmax mass of a support under full attention, from the log-sum-exp of its scores and
// that of all tokens: exp(lse_support - lse_full). Rounding can push it a hair above 1.
inline double RetainedMass(float lse_support, float lse_full) {
  return std::min(1.0, std::exp(static_cast<double>(lse_support) - lse_full));
}

}  // namespace kvrecall

#endif  // KVRECALL_KERNELS_FIDELITY_H_
