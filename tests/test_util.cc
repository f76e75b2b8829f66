#include "tests/test_util.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>

namespace kvrecall::testing {

std::vector<float> RandomNormal(size_t n, uint64_t seed, float stddev) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> out(n);
  for (float& x : out) x = dist(rng);
  return out;
}

RandomKv::RandomKv(int64_t tokens, int kv_heads, int head_dim, uint64_t seed)
    : keys(RandomNormal(tokens * kv_heads * head_dim, seed)),
      values(RandomNormal(tokens * kv_heads * head_dim, seed + 1)),
      tokens(tokens),
      kv_heads(kv_heads),
      head_dim(head_dim) {}

KvView RandomKv::view() const {
  return KvView{keys.data(), values.data(), tokens, kv_heads, head_dim};
}

double ReferenceAttention(const float* q, const KvView& kv, int kv_head,
                          std::span<const int32_t> ids, double scale, std::vector<double>* o) {
  const int d = kv.head_dim;
  o->assign(d, 0.0);
  if (ids.empty()) return -std::numeric_limits<double>::infinity();
  std::vector<double> s(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    const float* k = kv.key(ids[i], kv_head);
    double dot = 0;
    for (int j = 0; j < d; ++j) dot += static_cast<double>(q[j]) * k[j];
    s[i] = scale * dot;
  }
  const double m = *std::max_element(s.begin(), s.end());
  double sum = 0;
  for (double& x : s) sum += (x = std::exp(x - m));
  for (size_t i = 0; i < ids.size(); ++i) {
    const float* v = kv.value(ids[i], kv_head);
    for (int j = 0; j < d; ++j) (*o)[j] += s[i] / sum * v[j];
  }
  return m + std::log(sum);
}

std::vector<int32_t> AllTokens(int64_t tokens) {
  std::vector<int32_t> ids(tokens);
  std::iota(ids.begin(), ids.end(), 0);
  return ids;
}

std::vector<int32_t> ReferenceTopK(const float* q, const KvView& kv, int kv_head, double scale,
                                   int k) {
  std::vector<double> s(kv.tokens);
  for (int64_t t = 0; t < kv.tokens; ++t) {
    double dot = 0;
    for (int j = 0; j < kv.head_dim; ++j) dot += static_cast<double>(q[j]) * kv.key(t, kv_head)[j];
    s[t] = scale * dot;
  }
  std::vector<int32_t> ids = AllTokens(kv.tokens);
  std::stable_sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) { return s[a] > s[b]; });
  ids.resize(std::min<int64_t>(k, kv.tokens));
  return ids;
}

}  // namespace kvrecall::testing
