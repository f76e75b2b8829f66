#include "kernels/cpu/attention.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include "kernels/attention_state.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/thread_pool.h"

namespace kvrecall::cpu {
namespace {

// ---------------------------------------------------------------------------------------------
// Stored element types. Every kernel below is a template over the element type E of the rows
// it reads, instantiated once per KvElement and chosen once per call (WithElement), so the inner
// loops have no branch on the type. Widening is exact: f32 holds every bf16 and f16 value.

template <KvElement E>
using Stored = std::conditional_t<E == KvElement::kF32, float, uint16_t>;

template <KvElement E>
inline float WidenOne(Stored<E> x) {
  if constexpr (E == KvElement::kF32) {
    return x;
  } else if constexpr (E == KvElement::kBf16) {
    return Bf16ToFloat(x);
  } else {
    return F16ToFloat(x);
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// Eight consecutive stored elements as eight f32 lanes.
template <KvElement E>
inline __m256 Widen8(const Stored<E>* p) {
  if constexpr (E == KvElement::kF32) {
    return _mm256_loadu_ps(p);
  } else if constexpr (E == KvElement::kBf16) {
    // bf16 is the top half of an f32: zero-extend to 32 bits and shift into place.
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
  } else {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
}
#endif

// Calls f with the KvElement of `element` as a compile-time constant.
template <typename F>
decltype(auto) WithElement(KvElement element, F&& f) {
  switch (element) {
    case KvElement::kBf16:
      return f(std::integral_constant<KvElement, KvElement::kBf16>());
    case KvElement::kF16:
      return f(std::integral_constant<KvElement, KvElement::kF16>());
    case KvElement::kF32:
      break;
  }
  return f(std::integral_constant<KvElement, KvElement::kF32>());
}

template <KvElement E>
const Stored<E>* KeyRow(const KvView& kv, int64_t t, int h) {
  return static_cast<const Stored<E>*>(kv.keys) + kv.offset(t, h);
}
template <KvElement E>
const Stored<E>* ValueRow(const KvView& kv, int64_t t, int h) {
  return static_cast<const Stored<E>*>(kv.values) + kv.offset(t, h);
}

// Rows a gather over scattered rows (a support, a candidate list) requests
// ahead of the one it works on: enough for the DRAM latency (~100 ns) to pass
// while the rows before it are worked (tens of ns each), few enough to stay in
// L1 (16 rows of 256-512 bytes).
constexpr size_t kRowsAhead = 16;

// Requests every cache line of a row of `bytes` bytes.
inline void PrefetchRow(const void* row, int bytes) {
  const char* p = static_cast<const char*>(row);
  for (int offset = 0; offset < bytes; offset += 64) __builtin_prefetch(p + offset);
}

// Scores are a per-call scratch; thread_local keeps the hot path free of allocations once warm.
std::vector<float>& ScoreScratch(size_t n) {
  thread_local std::vector<float> scratch;
  if (scratch.size() < n) scratch.resize(n);
  return scratch;
}

// Turns scaled scores into softmax weights in place and returns their log-sum-exp.
float SoftmaxInPlace(float* scores, size_t n) {
  if (n == 0) return kEmptyLse;
  float max_score = scores[0];
  for (size_t i = 1; i < n; ++i) max_score = std::max(max_score, scores[i]);
  float sum = 0.0f;
  for (size_t i = 0; i < n; ++i) {
    scores[i] = std::exp(scores[i] - max_score);
    sum += scores[i];
  }
  const float inv = 1.0f / sum;
  for (size_t i = 0; i < n; ++i) scores[i] *= inv;
  return max_score + std::log(sum);
}

// o = sum_i weights[i] * value(token_of(i)). Four tokens per pass over o, so that o is loaded
// and stored once per four value rows rather than once per row (the loop is bound by those).
template <KvElement E, typename TokenOf>
void WeightedValueSum(const float* weights, size_t n, TokenOf token_of, const KvView& kv,
                      int kv_head, float* o) {
  const int d = kv.head_dim;
  const int row_bytes = d * static_cast<int>(sizeof(Stored<E>));
  std::fill(o, o + d, 0.0f);
  // The rows are scattered (a support), so nothing prefetches them but us:
  // kRowsAhead rows ahead, requested before the first pass and then four per
  // pass.
  for (size_t j = 0; j < std::min(n, kRowsAhead); ++j) {
    PrefetchRow(ValueRow<E>(kv, token_of(j), kv_head), row_bytes);
  }
  size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    for (size_t j = i + kRowsAhead; j < std::min(n, i + kRowsAhead + 4); ++j) {
      PrefetchRow(ValueRow<E>(kv, token_of(j), kv_head), row_bytes);
    }
    const float w0 = weights[i], w1 = weights[i + 1], w2 = weights[i + 2], w3 = weights[i + 3];
    const Stored<E>* v0 = ValueRow<E>(kv, token_of(i), kv_head);
    const Stored<E>* v1 = ValueRow<E>(kv, token_of(i + 1), kv_head);
    const Stored<E>* v2 = ValueRow<E>(kv, token_of(i + 2), kv_head);
    const Stored<E>* v3 = ValueRow<E>(kv, token_of(i + 3), kv_head);
    int j = 0;
#if defined(__AVX2__) && defined(__FMA__)
    // Written out rather than left to the compiler, so that every element type rounds the same
    // way (an f32 store and a bf16 store of the same values give the same bits).
    const __m256 a0 = _mm256_set1_ps(w0), a1 = _mm256_set1_ps(w1);
    const __m256 a2 = _mm256_set1_ps(w2), a3 = _mm256_set1_ps(w3);
    for (; j + 8 <= d; j += 8) {
      const __m256 lo =
          _mm256_fmadd_ps(a1, Widen8<E>(v1 + j), _mm256_mul_ps(a0, Widen8<E>(v0 + j)));
      const __m256 hi =
          _mm256_fmadd_ps(a3, Widen8<E>(v3 + j), _mm256_mul_ps(a2, Widen8<E>(v2 + j)));
      _mm256_storeu_ps(o + j, _mm256_add_ps(_mm256_loadu_ps(o + j), _mm256_add_ps(lo, hi)));
    }
#endif
    for (; j < d; ++j) {
      o[j] += (w0 * WidenOne<E>(v0[j]) + w1 * WidenOne<E>(v1[j])) +
              (w2 * WidenOne<E>(v2[j]) + w3 * WidenOne<E>(v3[j]));
    }
  }
  for (; i < n; ++i) {
    const float w = weights[i];
    const Stored<E>* v = ValueRow<E>(kv, token_of(i), kv_head);
    int j = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 a = _mm256_set1_ps(w);
    for (; j + 8 <= d; j += 8) {
      _mm256_storeu_ps(o + j, _mm256_fmadd_ps(a, Widen8<E>(v + j), _mm256_loadu_ps(o + j)));
    }
#endif
    for (; j < d; ++j) o[j] += w * WidenOne<E>(v[j]);
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// The 16 lanes of two accumulators summed in registers.
inline float SumLanes(__m256 sum0, __m256 sum1) {
  const __m256 sum = _mm256_add_ps(sum0, sum1);
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  half = _mm_add_ss(half, _mm_movehdup_ps(half));
  return _mm_cvtss_f32(half);
}
#endif

// sum_i term(a[i], b[i]) over n elements (a of element type A, b of B): 8 lanes at a time into
// two independent accumulators (vector_term(x, y, acc) adds 8 terms to acc), which hides the FMA
// latency, and the lanes summed in registers. Scoring and the graph build's pruning are chains
// of short (head_dim) sums, so both costs are per token.
template <KvElement A, KvElement B, typename VectorTerm, typename ScalarTerm>
float SumOfTerms(const Stored<A>* a, const Stored<B>* b, int n, VectorTerm vector_term,
                 ScalarTerm scalar_term) {
  int i = 0;
  float acc = 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 sum0 = _mm256_setzero_ps();
  __m256 sum1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    sum0 = vector_term(Widen8<A>(a + i), Widen8<B>(b + i), sum0);
    sum1 = vector_term(Widen8<A>(a + i + 8), Widen8<B>(b + i + 8), sum1);
  }
  for (; i + 8 <= n; i += 8) {
    sum0 = vector_term(Widen8<A>(a + i), Widen8<B>(b + i), sum0);
  }
  acc = SumLanes(sum0, sum1);
#endif
  for (; i < n; ++i) acc += scalar_term(WidenOne<A>(a[i]), WidenOne<B>(b[i]));
  return acc;
}

template <KvElement E>
float Dot(const float* q, const Stored<E>* row, int n) {
  return SumOfTerms<KvElement::kF32, E>(
      q, row, n, [](auto x, auto y, auto acc) { return _mm256_fmadd_ps(x, y, acc); },
      [](float x, float y) { return x * y; });
}

template <KvElement A, KvElement B = A>
float Distance(const Stored<A>* a, const Stored<B>* b, int n) {
  return SumOfTerms<A, B>(
      a, b, n,
      [](auto x, auto y, auto acc) {
        const auto d = _mm256_sub_ps(x, y);
        return _mm256_fmadd_ps(d, d, acc);
      },
      [](float x, float y) { return (x - y) * (x - y); });
}

#if defined(__AVX2__) && defined(__FMA__)
// Dot's two accumulators over the same lanes and its sum of the lanes, for R rows at once
// (n a multiple of 8, so that Dot has no scalar tail either).
template <KvElement E, int R>
void DotRows(const float* x, const void* const* rows, int n, float* out) {
  __m256 sum0[R], sum1[R];
  const Stored<E>* row[R];
  for (int r = 0; r < R; ++r) {
    sum0[r] = sum1[r] = _mm256_setzero_ps();
    row[r] = static_cast<const Stored<E>*>(rows[r]);
  }
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 xa = _mm256_loadu_ps(x + i);
    const __m256 xb = _mm256_loadu_ps(x + i + 8);
    for (int r = 0; r < R; ++r) {
      sum0[r] = _mm256_fmadd_ps(xa, Widen8<E>(row[r] + i), sum0[r]);
      sum1[r] = _mm256_fmadd_ps(xb, Widen8<E>(row[r] + i + 8), sum1[r]);
    }
  }
  for (; i + 8 <= n; i += 8) {
    const __m256 xa = _mm256_loadu_ps(x + i);
    for (int r = 0; r < R; ++r) sum0[r] = _mm256_fmadd_ps(xa, Widen8<E>(row[r] + i), sum0[r]);
  }
  for (int r = 0; r < R; ++r) out[r] = SumLanes(sum0[r], sum1[r]);
}

// out[j] = Dot(x[j], row) for Q queries and one row: DotRows with the roles of the two swapped
// (each 8 elements of the row widened once for every query), the same products and sums.
template <KvElement E, int Q>
void DotQueries(const float* const* x, const Stored<E>* row, int n, float* out) {
  __m256 sum0[Q], sum1[Q];
  for (int q = 0; q < Q; ++q) sum0[q] = sum1[q] = _mm256_setzero_ps();
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 wa = Widen8<E>(row + i);
    const __m256 wb = Widen8<E>(row + i + 8);
    for (int q = 0; q < Q; ++q) {
      sum0[q] = _mm256_fmadd_ps(_mm256_loadu_ps(x[q] + i), wa, sum0[q]);
      sum1[q] = _mm256_fmadd_ps(_mm256_loadu_ps(x[q] + i + 8), wb, sum1[q]);
    }
  }
  for (; i + 8 <= n; i += 8) {
    const __m256 wa = Widen8<E>(row + i);
    for (int q = 0; q < Q; ++q) sum0[q] = _mm256_fmadd_ps(_mm256_loadu_ps(x[q] + i), wa, sum0[q]);
  }
  for (int q = 0; q < Q; ++q) out[q] = SumLanes(sum0[q], sum1[q]);
}
#endif

template <KvElement E>
void DotQueriesOf(const float* const* x, int count, const void* row, int n, float* out) {
  const auto* stored = static_cast<const Stored<E>*>(row);
  int q = 0;
#if defined(__AVX2__) && defined(__FMA__)
  if (n % 8 == 0) {
    for (; q + 4 <= count; q += 4) DotQueries<E, 4>(x + q, stored, n, out + q);
    switch (count - q) {
      case 3: DotQueries<E, 3>(x + q, stored, n, out + q); return;
      case 2: DotQueries<E, 2>(x + q, stored, n, out + q); return;
      case 1: DotQueries<E, 1>(x + q, stored, n, out + q); return;
      default: return;
    }
  }
#endif
  for (; q < count; ++q) out[q] = Dot<E>(x[q], stored, n);
}

template <KvElement E>
void DotRowsOf(const float* x, const void* const* rows, int count, int n, float* out) {
  int r = 0;
#if defined(__AVX2__) && defined(__FMA__)
  if (n % 8 == 0) {
    for (; r + 4 <= count; r += 4) DotRows<E, 4>(x, rows + r, n, out + r);
    switch (count - r) {
      case 3: DotRows<E, 3>(x, rows + r, n, out + r); return;
      case 2: DotRows<E, 2>(x, rows + r, n, out + r); return;
      case 1: DotRows<E, 1>(x, rows + r, n, out + r); return;
      default: return;
    }
  }
#endif
  for (; r < count; ++r) out[r] = Dot<E>(x, static_cast<const Stored<E>*>(rows[r]), n);
}

// Scattered rows, prefetched kRowsAhead ahead and scored four at a time
// (DotRowsOf: Dot's arithmetic, bit for bit, with the four rows' loads in
// flight together).
template <KvElement E>
void ScoreTokensOf(const float* q, const KvView& kv, int kv_head, std::span<const int32_t> ids,
                   float scale, float* scores) {
  const size_t n = ids.size();
  const int d = kv.head_dim;
  const int row_bytes = d * static_cast<int>(sizeof(Stored<E>));
  for (size_t j = 0; j < std::min(n, kRowsAhead); ++j) {
    PrefetchRow(KeyRow<E>(kv, ids[j], kv_head), row_bytes);
  }
  const void* rows[4];
  for (size_t i = 0; i < n; i += 4) {
    for (size_t j = i + kRowsAhead; j < std::min(n, i + kRowsAhead + 4); ++j) {
      PrefetchRow(KeyRow<E>(kv, ids[j], kv_head), row_bytes);
    }
    const int count = static_cast<int>(std::min<size_t>(4, n - i));
    for (int r = 0; r < count; ++r) rows[r] = KeyRow<E>(kv, ids[i + r], kv_head);
    DotRowsOf<E>(q, rows, count, d, scores + i);
    for (int r = 0; r < count; ++r) scores[i + r] *= scale;
  }
}

// ScoreTokensOf for several queries: each row requested kRowsAhead rows ahead, then scored for
// the queries its mask names (DotQueriesOf: the row widened once for all of them).
template <KvElement E>
void ScoreTokensForQueriesOf(std::span<const float* const> queries, const KvView& kv,
                             int kv_head, std::span<const int32_t> ids,
                             std::span<const uint32_t> which, float scale, float* const* scores) {
  const size_t n = ids.size();
  const int d = kv.head_dim;
  const int row_bytes = d * static_cast<int>(sizeof(Stored<E>));
  const auto all = static_cast<uint32_t>((uint64_t{1} << queries.size()) - 1);
  for (size_t j = 0; j < std::min(n, kRowsAhead); ++j) {
    PrefetchRow(KeyRow<E>(kv, ids[j], kv_head), row_bytes);
  }
  const float* picked[32];
  int slots[32];
  float got[32];
  for (size_t i = 0; i < n; ++i) {
    if (i + kRowsAhead < n) PrefetchRow(KeyRow<E>(kv, ids[i + kRowsAhead], kv_head), row_bytes);
    int count = 0;
    for (uint32_t bits = which.empty() ? all : which[i] & all; bits != 0; bits &= bits - 1) {
      const int query = __builtin_ctz(bits);
      slots[count] = query;
      picked[count] = queries[query];
      ++count;
    }
    DotQueriesOf<E>(picked, count, KeyRow<E>(kv, ids[i], kv_head), d, got);
    for (int c = 0; c < count; ++c) scores[slots[c]][i] = scale * got[c];
  }
}

template <KvElement E>
void ScoreRangeOf(const float* q, const KvView& kv, int kv_head, int64_t begin, int64_t end,
                  float scale, float* scores) {
  for (int64_t t = begin; t < end; ++t) {
    scores[t - begin] = scale * Dot<E>(q, KeyRow<E>(kv, t, kv_head), kv.head_dim);
  }
}

// The sort key of (score, position) for TopKPositions: ascending keys are
// scores descending, equal scores by position ascending. The score's bits are
// mapped to an unsigned integer of the same order (negatives flipped, positives
// offset past them; -0 is first made +0, which compares equal to it),
// complemented for descending, above the position.
inline uint64_t RankKey(float score, uint32_t position) {
  uint32_t bits;
  const float canonical = score + 0.0f;  // -0 + 0 = +0
  std::memcpy(&bits, &canonical, sizeof(bits));
  const uint32_t ascending = (bits & 0x80000000u) != 0 ? ~bits : bits | 0x80000000u;
  return (uint64_t{~ascending} << 32) | position;
}

// Up to this many scores TopKPositions sorts by comparison, above it by radix.
constexpr size_t kComparisonTopKMax = 64;

// TopKPositions' scratch.
struct RadixScratch {
  std::vector<uint64_t> keys, pool, selected;
};

// Leaves in scratch->keys the `keep` (< its size) smallest of its distinct
// keys, in any order: a most significant digit first radix selection, one byte
// a pass over the keys still undecided (those that share every digit so far
// with the keep-th smallest), without a compare branch.
void SelectSmallest(size_t keep, RadixScratch* scratch) {
  std::vector<uint64_t>& pool = scratch->pool;
  std::vector<uint64_t>& selected = scratch->selected;
  pool.assign(scratch->keys.begin(), scratch->keys.end());
  selected.resize(keep);
  size_t kept = 0;             // selected[0, kept) are in
  size_t open = pool.size();  // pool[0, open) are undecided
  for (int shift = 56; kept + open > keep; shift -= 8) {
    if (shift < 0) {  // only for equal keys, which RankKey never makes
      std::copy(pool.begin(), pool.begin() + (keep - kept), selected.begin() + kept);
      kept = keep;
      open = 0;
      break;
    }
    uint32_t count[256] = {};
    for (size_t i = 0; i < open; ++i) ++count[(pool[i] >> shift) & 255];
    // The boundary digit: every key below it is in, some of those on it.
    uint32_t boundary = 0;
    size_t below = 0;
    while (kept + below + count[boundary] < keep) below += count[boundary++];
    // Below the boundary to `selected` (each write lands at an index < keep),
    // on it compacted in place in `pool` (written at or before where it was
    // read).
    size_t n_in = kept, n_on = 0;
    for (size_t i = 0; i < open; ++i) {
      const uint64_t x = pool[i];
      const uint32_t digit = (x >> shift) & 255;
      selected[n_in] = x;
      n_in += digit < boundary;
      pool[n_on] = x;
      n_on += digit == boundary;
    }
    kept = n_in;
    open = n_on;
  }
  std::copy(pool.begin(), pool.begin() + open, selected.begin() + kept);
  scratch->keys.swap(selected);
}

// Sorts scratch->keys[0, n) ascending: least significant digit first, a byte a
// pass, skipping the bytes that every key shares.
void SortAscending(size_t n, RadixScratch* scratch) {
  if (n < 2) return;
  std::vector<uint64_t>& keys = scratch->keys;
  std::vector<uint64_t>& other = scratch->pool;
  other.resize(n);
  uint64_t all_or = 0, all_and = ~uint64_t{0};
  for (size_t i = 0; i < n; ++i) {
    all_or |= keys[i];
    all_and &= keys[i];
  }
  const uint64_t varying = all_or ^ all_and;
  uint64_t* src = keys.data();
  uint64_t* dst = other.data();
  for (int shift = 0; shift < 64; shift += 8) {
    if (((varying >> shift) & 255) == 0) continue;
    uint32_t start[256] = {};
    for (size_t i = 0; i < n; ++i) ++start[(src[i] >> shift) & 255];
    uint32_t sum = 0;
    for (uint32_t& c : start) {
      const uint32_t count = c;
      c = sum;
      sum += count;
    }
    for (size_t i = 0; i < n; ++i) dst[start[(src[i] >> shift) & 255]++] = src[i];
    std::swap(src, dst);
  }
  if (src != keys.data()) std::copy(src, src + n, keys.data());
}

}  // namespace

float DotProduct(const float* a, const float* b, int n) { return Dot<KvElement::kF32>(a, b, n); }

float DotProduct(const float* q, const void* row, KvElement element, int n) {
  return WithElement(element, [&](auto e) {
    return Dot<decltype(e)::value>(q, static_cast<const Stored<decltype(e)::value>*>(row), n);
  });
}

float SquaredDistance(const float* a, const float* b, int n) {
  return Distance<KvElement::kF32>(a, b, n);
}

float SquaredDistance(const void* a, const void* b, KvElement element, int n) {
  return WithElement(element, [&](auto e) {
    using S = Stored<decltype(e)::value>;
    return Distance<decltype(e)::value>(static_cast<const S*>(a), static_cast<const S*>(b), n);
  });
}

float SquaredDistance(const float* a, const void* b, KvElement element, int n) {
  return WithElement(element, [&](auto e) {
    constexpr KvElement kE = decltype(e)::value;
    return Distance<KvElement::kF32, kE>(a, static_cast<const Stored<kE>*>(b), n);
  });
}

void LoadRow(const void* row, KvElement element, int n, float* out) {
  WithElement(element, [&](auto e) {
    const auto* p = static_cast<const Stored<decltype(e)::value>*>(row);
    for (int i = 0; i < n; ++i) out[i] = WidenOne<decltype(e)::value>(p[i]);
  });
}

void ScoreTokens(const float* q, const KvView& kv, int kv_head, std::span<const int32_t> ids,
                 float scale, float* scores) {
  WithElement(kv.element, [&](auto e) {
    ScoreTokensOf<decltype(e)::value>(q, kv, kv_head, ids, scale, scores);
  });
}

void ScoreTokensForQueries(std::span<const float* const> queries, const KvView& kv, int kv_head,
                           std::span<const int32_t> ids, std::span<const uint32_t> which,
                           float scale, float* const* scores) {
  // A mask names 32 queries at most, one per id.
  assert(which.empty() || (queries.size() <= 32 && which.size() == ids.size()));
  // Without masks, any number of queries, 32 at a time.
  for (size_t first = 0; first < queries.size(); first += 32) {
    const size_t count = std::min<size_t>(32, queries.size() - first);
    WithElement(kv.element, [&](auto e) {
      ScoreTokensForQueriesOf<decltype(e)::value>(queries.subspan(first, count), kv, kv_head, ids,
                                                  which, scale, scores + first);
    });
    if (!which.empty()) break;  // masks name 32 queries at most
  }
}

void DotProductQueries(const float* const* queries, int count, const void* row,
                       KvElement element, int n, float* out) {
  WithElement(element,
              [&](auto e) { DotQueriesOf<decltype(e)::value>(queries, count, row, n, out); });
}

void ScoreRange(const float* q, const KvView& kv, int kv_head, int64_t begin, int64_t end,
                float scale, float* scores) {
  WithElement(kv.element, [&](auto e) {
    ScoreRangeOf<decltype(e)::value>(q, kv, kv_head, begin, end, scale, scores);
  });
}

void DotProducts(const float* x, const float* rows, int64_t n_rows, int n, float* out) {
  for (int64_t i = 0; i < n_rows; ++i) out[i] = DotProduct(x, rows + i * n, n);
}

void DotProductRows(const float* x, const void* const* rows, KvElement element, int count, int n,
                    float* out) {
  WithElement(element,
              [&](auto e) { DotRowsOf<decltype(e)::value>(x, rows, count, n, out); });
}

float Normalize(const float* x, int n, float* unit) {
  const float norm = std::sqrt(DotProduct(x, x, n));
  const float inv = norm > 0.0f ? 1.0f / norm : 0.0f;
  for (int i = 0; i < n; ++i) unit[i] = x[i] * inv;
  return norm;
}

void TopKPositions(std::span<const float> scores, int k, std::vector<int32_t>* positions) {
  const size_t n = scores.size();
  const size_t keep = std::min(static_cast<size_t>(std::max(k, 0)), n);
  // Each (score, position) packed into one integer whose ascending order is the
  // wanted order (RankKey; distinct, as the positions are), then selected and
  // sorted by radix, without a comparison branch: an indirect comparator's
  // mispredictions in nth_element and sort cost a quarter of a reuse head's
  // step (bench/results/tiered_head_cost.md).
  positions->clear();
  if (keep == 0) return;
  thread_local RadixScratch scratch;
  scratch.keys.resize(n);
  for (size_t i = 0; i < n; ++i) scratch.keys[i] = RankKey(scores[i], static_cast<uint32_t>(i));
  if (n <= kComparisonTopKMax) {
    // A few keys (ReTopK's R neighbors among its C cached queries): the radix passes' 256
    // counters a pass cost more than a comparison sort's mispredictions (4 of 32 on the
    // development machine: ~0.7 us by radix, a fraction of that by std::partial_sort).
    std::partial_sort(scratch.keys.begin(), scratch.keys.begin() + keep,
                      scratch.keys.begin() + n);
  } else {
    if (keep < n) SelectSmallest(keep, &scratch);
    SortAscending(keep, &scratch);
  }
  positions->resize(keep);
  for (size_t i = 0; i < keep; ++i) (*positions)[i] = static_cast<int32_t>(scratch.keys[i]);
}

void ExactTopK(const float* q, const KvView& kv, int kv_head, float scale, int k,
               std::vector<int32_t>* ids) {
  std::vector<float>& scores = ScoreScratch(kv.tokens);
  ScoreRange(q, kv, kv_head, 0, kv.tokens, scale, scores.data());
  // Positions in a full-range scan are token ids.
  TopKPositions(std::span<const float>(scores.data(), kv.tokens), k, ids);
}

void PartialAttention(const float* q, const KvView& kv, int kv_head,
                      std::span<const int32_t> ids, float scale, float* o, float* lse) {
  std::vector<float>& weights = ScoreScratch(ids.size());
  ScoreTokens(q, kv, kv_head, ids, scale, weights.data());
  *lse = SoftmaxInPlace(weights.data(), ids.size());
  WithElement(kv.element, [&](auto e) {
    WeightedValueSum<decltype(e)::value>(
        weights.data(), ids.size(), [&](size_t i) { return ids[i]; }, kv, kv_head, o);
  });
}

void PartialAttentionScored(std::span<const float> scores, const KvView& kv, int kv_head,
                            std::span<const int32_t> ids, float* o, float* lse) {
  std::vector<float>& weights = ScoreScratch(ids.size());
  std::copy(scores.begin(), scores.begin() + ids.size(), weights.begin());
  *lse = SoftmaxInPlace(weights.data(), ids.size());
  WithElement(kv.element, [&](auto e) {
    WeightedValueSum<decltype(e)::value>(
        weights.data(), ids.size(), [&](size_t i) { return ids[i]; }, kv, kv_head, o);
  });
}

void PartialAttentionRange(const float* q, const KvView& kv, int kv_head, int64_t begin,
                           int64_t end, float scale, float* o, float* lse) {
  const size_t n = end > begin ? static_cast<size_t>(end - begin) : 0;
  std::vector<float>& weights = ScoreScratch(n);
  ScoreRange(q, kv, kv_head, begin, begin + static_cast<int64_t>(n), scale, weights.data());
  *lse = SoftmaxInPlace(weights.data(), n);
  WithElement(kv.element, [&](auto e) {
    WeightedValueSum<decltype(e)::value>(
        weights.data(), n, [&](size_t i) { return begin + static_cast<int64_t>(i); }, kv,
        kv_head, o);
  });
}

namespace {

// Per-call scratch of GroupedPartialAttention (thread_local, as ScoreScratch).
struct GroupScratch {
  std::vector<float> weights;  // token-major [n rounded up to 8, heads]: scores, then exp
  std::vector<const void*> keys, values;  // [n]: the support's rows of the KV head
};

GroupScratch& GroupScratchFor(size_t weights, size_t n) {
  thread_local GroupScratch scratch;
  if (scratch.weights.size() < weights) scratch.weights.resize(weights);
  if (scratch.keys.size() < n) {
    scratch.keys.resize(n);
    scratch.values.resize(n);
  }
  return scratch;
}

#if defined(__AVX2__) && defined(__FMA__)
// Lane j of the result is the sum of a[j]'s eight lanes.
inline __m256 SumLanes8(const __m256* a) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// Lane j of the result is scale * <q[j % HB], k[j / HB]> for HB query rows and TB key rows
// (HB * TB <= 8; lanes beyond it are 0) of d floats, d a multiple of 8: the token-major order of
// the weights. Each row's chunk is loaded once for all the products it takes part in, each
// product into an accumulator of its own.
template <KvElement E, int HB, int TB>
inline __m256 ScoreBlock(const float* const* q, const void* const* k, int d, __m256 scale) {
  static_assert(HB * TB <= 8);
  __m256 acc[8];
  for (__m256& a : acc) a = _mm256_setzero_ps();
#pragma GCC unroll 4
  for (int c = 0; c < d; c += 8) {
    __m256 kc[TB];
    for (int t = 0; t < TB; ++t) kc[t] = Widen8<E>(static_cast<const Stored<E>*>(k[t]) + c);
    for (int h = 0; h < HB; ++h) {
      const __m256 qc = _mm256_loadu_ps(q[h] + c);
      for (int t = 0; t < TB; ++t) acc[t * HB + h] = _mm256_fmadd_ps(qc, kc[t], acc[t * HB + h]);
    }
  }
  return _mm256_mul_ps(SumLanes8(acc), scale);
}

// exp(x) for x <= 0, eight lanes: Cephes' expf (a degree-6 polynomial on [-ln2/2, ln2/2]
// scaled by 2^n), within 2 ulp of std::exp; 0 below -87.3, where exp leaves the normal floats
// (so -inf gives 0).
inline __m256 ExpNonPositive(__m256 x) {
  const __m256 underflow = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_LT_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i exponent = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(p, _mm256_castsi256_ps(exponent)));
}

// For a vector whose lane j belongs to head j % HB (HB in {1, 2, 4}): the same vector with
// every lane replaced by op over its head's lanes.
template <int HB, typename Op>
inline __m256 ReduceHeads(__m256 v, Op op) {
  v = op(v, _mm256_permute2f128_ps(v, v, 0x01));  // lane j with lane j +- 4
  if constexpr (HB <= 2) v = op(v, _mm256_permute_ps(v, 0x4e));  // with j +- 2
  if constexpr (HB == 1) v = op(v, _mm256_permute_ps(v, 0xb1));  // with j +- 1
  return v;
}

// Attention of HB (1, 2 or 4) heads over n >= 1 rows: q [HB, d]; o [HB, d]; lse [HB]. The
// weights are token-major, [n rounded up to 8, HB].
template <KvElement E, int HB>
void GroupBlock(const float* q, const void* const* keys, const void* const* values, int64_t n,
                int d, float scale, float* weights, float* o, float* lse) {
  constexpr int TB = 8 / HB;  // tokens a vector of scores covers
  const float* q_rows[HB];
  for (int h = 0; h < HB; ++h) q_rows[h] = q + static_cast<int64_t>(h) * d;
  const __m256 vscale = _mm256_set1_ps(scale);
  // Scores, eight at a time; the rows past n (up to a whole vector) score -inf, so that they
  // weigh 0 below.
  const int64_t padded = (n + TB - 1) / TB * TB;
  int64_t i = 0;
  for (; i + TB <= n; i += TB) {
    _mm256_storeu_ps(weights + i * HB, ScoreBlock<E, HB, TB>(q_rows, keys + i, d, vscale));
  }
  if (i < n) {
    const void* last[TB];
    for (int t = 0; t < TB; ++t) last[t] = keys[std::min<int64_t>(i + t, n - 1)];
    __m256 tail = ScoreBlock<E, HB, TB>(q_rows, last, d, vscale);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 past = _mm256_castsi256_ps(
        _mm256_cmpgt_epi32(lane, _mm256_set1_epi32(static_cast<int>((n - i) * HB) - 1)));
    tail = _mm256_blendv_ps(tail, _mm256_set1_ps(-std::numeric_limits<float>::infinity()), past);
    _mm256_storeu_ps(weights + i * HB, tail);
  }
  // Softmax by head: each lane's maximum and sum, reduced over the lanes of its head.
  __m256 vmax = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < padded * HB; j += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(weights + j));
  vmax = ReduceHeads<HB>(vmax, [](__m256 a, __m256 b) { return _mm256_max_ps(a, b); });
  __m256 vsum = _mm256_setzero_ps();
  for (int64_t j = 0; j < padded * HB; j += 8) {
    const __m256 e = ExpNonPositive(_mm256_sub_ps(_mm256_loadu_ps(weights + j), vmax));
    _mm256_storeu_ps(weights + j, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  vsum = ReduceHeads<HB>(vsum, [](__m256 a, __m256 b) { return _mm256_add_ps(a, b); });
  float max_by_lane[8], sum_by_lane[8], inv_sum[HB];
  _mm256_storeu_ps(max_by_lane, vmax);
  _mm256_storeu_ps(sum_by_lane, vsum);
  for (int h = 0; h < HB; ++h) {
    lse[h] = max_by_lane[h] + std::log(sum_by_lane[h]);
    inv_sum[h] = 1.0f / sum_by_lane[h];
  }
  // o[h] = sum_i weights[i, h] * value i / sum[h], R vectors of o at a time for all HB heads.
  constexpr int R = HB <= 2 ? 4 : 2;  // accumulators: HB * R = 8
  auto value_block = [&]<int W>(int c) {
    __m256 acc[HB][W];
    for (int h = 0; h < HB; ++h) {
      for (int r = 0; r < W; ++r) acc[h][r] = _mm256_setzero_ps();
    }
    const float* w = weights;
    auto add_row = [&](int64_t t) {
      const Stored<E>* v_row = static_cast<const Stored<E>*>(values[t]) + c;
      __m256 v[W];
      for (int r = 0; r < W; ++r) v[r] = Widen8<E>(v_row + 8 * r);
      for (int h = 0; h < HB; ++h) {
        const __m256 wh = _mm256_broadcast_ss(w + t * HB + h);
        for (int r = 0; r < W; ++r) acc[h][r] = _mm256_fmadd_ps(wh, v[r], acc[h][r]);
      }
    };
    int64_t t = 0;
    for (; t + 2 <= n; t += 2) {  // two rows a pass: half the loop's own instructions
      add_row(t);
      add_row(t + 1);
    }
    if (t < n) add_row(t);
    for (int h = 0; h < HB; ++h) {
      const __m256 f = _mm256_set1_ps(inv_sum[h]);
      for (int r = 0; r < W; ++r) {
        _mm256_storeu_ps(o + static_cast<int64_t>(h) * d + c + 8 * r, _mm256_mul_ps(acc[h][r], f));
      }
    }
  };
  int c = 0;
  for (; c + 8 * R <= d; c += 8 * R) value_block.template operator()<R>(c);
  for (; c < d; c += 8) value_block.template operator()<1>(c);
}
#endif

}  // namespace

void GroupedPartialAttention(const float* q, int heads, const KvView& kv, int kv_head,
                             std::span<const int32_t> ids, float scale, float* o, float* lse) {
  const int d = kv.head_dim;
  const int64_t n = static_cast<int64_t>(ids.size());
#if defined(__AVX2__) && defined(__FMA__)
  if (d % 8 == 0 && n > 0) {
    GroupScratch& scratch =
        GroupScratchFor(static_cast<size_t>((n + 7) / 8 * 8) * std::min(heads, 4), ids.size());
    for (int64_t i = 0; i < n; ++i) {
      scratch.keys[i] = kv.key_row(ids[i], kv_head);
      scratch.values[i] = kv.value_row(ids[i], kv_head);
    }
    // Four heads at a time, the rest two and one at a time.
    for (int h = 0; h < heads;) {
      const int block = heads - h >= 4 ? 4 : heads - h >= 2 ? 2 : 1;
      const int64_t at = static_cast<int64_t>(h) * d;
      auto run = [&]<int HB>() {
        WithElement(kv.element, [&](auto e) {
          GroupBlock<decltype(e)::value, HB>(q + at, scratch.keys.data(), scratch.values.data(),
                                             n, d, scale, scratch.weights.data(), o + at,
                                             lse + h);
        });
      };
      if (block == 4) {
        run.template operator()<4>();
      } else if (block == 2) {
        run.template operator()<2>();
      } else {
        run.template operator()<1>();
      }
      h += block;
    }
    return;
  }
#endif
  for (int h = 0; h < heads; ++h) {
    PartialAttention(q + static_cast<int64_t>(h) * d, kv, kv_head, ids, scale,
                     o + static_cast<int64_t>(h) * d, lse + h);
  }
}

void MultiHeadAttention(const float* q, int q_heads, const KvView& kv,
                        std::span<const std::vector<int32_t>> supports, float scale, float* o,
                        float* lse) {
  const int d = kv.head_dim;
  const int group = q_heads / kv.kv_heads;
  int64_t tokens = 0;
  for (int h = 0; h < q_heads; ++h) tokens += static_cast<int64_t>(supports[h].size());
  // Scores and the weighted value sum: two multiply-adds per token and dimension.
  const int threads = ThreadsFor(2 * tokens * d, q_heads);
  // The work is split into units of `unit` consecutive heads of one group, as many as there are
  // threads (a group is one unit unless the threads outnumber the groups).
  const int unit = std::max(1, std::min(group, q_heads / threads));
  const int units_per_group = (group + unit - 1) / unit;
  const int units = kv.kv_heads * units_per_group;
  auto attend = [&](int u) {
    const int kv_head = u / units_per_group;
    const int first = kv_head * group + (u % units_per_group) * unit;
    const int end = std::min(first + unit, (kv_head + 1) * group);
    int same = 1;  // heads from `first` on with first's support
    while (first + same < end && supports[first + same] == supports[first]) ++same;
    if (same == end - first) {
      GroupedPartialAttention(q + static_cast<int64_t>(first) * d, same, kv, kv_head,
                              supports[first], scale, o + static_cast<int64_t>(first) * d,
                              lse + first);
      return;
    }
    for (int h = first; h < end; ++h) {
      PartialAttention(q + static_cast<int64_t>(h) * d, kv, kv_head, supports[h], scale,
                       o + static_cast<int64_t>(h) * d, lse + h);
    }
  };
  ParallelFor(units, threads, [&](int64_t u) { attend(static_cast<int>(u)); });
}

void MultiHeadFullAttention(const float* q, int q_heads, const KvView& kv, float scale, float* o,
                            float* lse) {
  const int d = kv.head_dim;
  const int threads = ThreadsFor(2 * int64_t{q_heads} * kv.tokens * d, q_heads);
  ParallelFor(q_heads, threads, [&](int64_t h) {
    PartialAttentionRange(q + h * d, kv, KvHeadOf(static_cast<int>(h), q_heads, kv.kv_heads), 0,
                          kv.tokens, scale, o + h * d, lse + h);
  });
}

}  // namespace kvrecall::cpu
