// CPU attention kernels: exact scoring, top-K selection and partial attention returning
// attention states, over a KvView of any stored element type (f32, bf16, f16: rows are widened
// to f32 as they are read; every product and sum is f32). The CUDA backend in kernels/cuda
// mirrors these.
#ifndef KVRECALL_KERNELS_CPU_ATTENTION_H_
#define KVRECALL_KERNELS_CPU_ATTENTION_H_

#include <cstdint>
#include <span>
#include <vector>

#include "kernels/dtype.h"
#include "kernels/kv_view.h"

namespace kvrecall::cpu {

// <a, b> over n floats.
float DotProduct(const float* a, const float* b, int n);
// <q, row> for a stored row of `element` (n elements): for f32 rows, DotProduct bit for bit.
float DotProduct(const float* q, const void* row, KvElement element, int n);

// ||a - b||^2 over n floats.
float SquaredDistance(const float* a, const float* b, int n);
// ||a - b||^2 of two stored rows of `element` (n elements each).
float SquaredDistance(const void* a, const void* b, KvElement element, int n);
// ||a - b||^2 of an f32 vector and a stored row of `element`: when `a` is a stored row of
// `element` widened to f32, SquaredDistance of the two stored rows bit for bit (widening is
// exact and the arithmetic is the same).
float SquaredDistance(const float* a, const void* b, KvElement element, int n);

// out[0, n) = the stored row of `element`, widened to f32 (exactly: bf16 and f16 are subsets).
void LoadRow(const void* row, KvElement element, int n, float* out);

// scores[i] = scale * <q, key(ids[i], kv_head)>. q: [head_dim]; scores: [ids.size()].
void ScoreTokens(const float* q, const KvView& kv, int kv_head, std::span<const int32_t> ids,
                 float scale, float* scores);

// ScoreTokens for several query vectors of one KV head (the query heads of a KV group):
// scores[j][i] = scale * <queries[j], key(ids[i], kv_head)> for every i and every j whose bit
// is set in which[i] (which empty: every j, any number of queries; else one mask per id and at
// most 32 queries), each bit-identical to ScoreTokens'. Each row is requested ahead (masked out
// or not) and loaded once for all its queries, and widened once for every four of them (when
// head_dim is a multiple of 8), so a row a group's heads share costs one read.
// queries: [count][head_dim]; scores: [count][ids.size()].
void ScoreTokensForQueries(std::span<const float* const> queries, const KvView& kv, int kv_head,
                           std::span<const int32_t> ids, std::span<const uint32_t> which,
                           float scale, float* const* scores);

// scores[t - begin] = scale * <q, key(t, kv_head)> for t in [begin, end). q: [head_dim];
// scores: [end - begin].
void ScoreRange(const float* q, const KvView& kv, int kv_head, int64_t begin, int64_t end,
                float scale, float* scores);

// out[i] = <x, rows + i * n> for i in [0, n_rows): x [n] against the row-major [n_rows, n] rows.
void DotProducts(const float* x, const float* rows, int64_t n_rows, int n, float* out);

// out[r] = <x, rows[r]> for r in [0, count): stored rows of `element` scattered in memory (a
// graph node's neighbors), each bit-identical to DotProduct(x, rows[r], element, n). Up to four
// rows at a time share each load of x and run independent accumulator chains, so a few rows
// cost little more than one.
void DotProductRows(const float* x, const void* const* rows, KvElement element, int count, int n,
                    float* out);

// out[j] = <queries[j], row> for j in [0, count): several vectors against one stored row of
// `element` (n elements), each bit-identical to DotProduct(queries[j], row, element, n). The
// row is widened once for up to four of them, whose accumulator chains run side by side.
void DotProductQueries(const float* const* queries, int count, const void* row,
                       KvElement element, int n, float* out);

// unit = x / ||x||_2 over n floats (unit may alias x); returns ||x||_2. A zero x gives a zero unit
// vector, so its cosine with anything is 0.
float Normalize(const float* x, int n, float* unit);

// Positions (into `scores`) of the min(k, scores.size()) largest scores, highest first; equal
// scores are ordered by position so that every backend breaks ties the same way.
void TopKPositions(std::span<const float> scores, int k, std::vector<int32_t>* positions);

// The exact top-k tokens of [0, kv.tokens) for q ([head_dim]) by a full scan, highest score
// first; *ids gets min(k, kv.tokens) of them.
void ExactTopK(const float* q, const KvView& kv, int kv_head, float scale, int k,
               std::vector<int32_t>* ids);

// The attention state of q over the tokens `ids` (kernels/attention_state.h).
// o: [head_dim]; *lse gets the natural-log sum of exp of the scaled scores.
void PartialAttention(const float* q, const KvView& kv, int kv_head,
                      std::span<const int32_t> ids, float scale, float* o, float* lse);

// The attention state of q over the tokens `ids` whose scaled scores the caller has already
// computed (scores[i] for ids[i], as ScoreTokens gives them): only the softmax and the weighted
// sum of the values remain. Equal to PartialAttention over the same ids, bit for bit.
// scores: [ids.size()]; o: [head_dim]; *lse as PartialAttention's.
void PartialAttentionScored(std::span<const float> scores, const KvView& kv, int kv_head,
                            std::span<const int32_t> ids, float* o, float* lse);

// The attention state of q over the contiguous tokens [begin, end). q, o: [head_dim]; *lse as
// PartialAttention's.
void PartialAttentionRange(const float* q, const KvView& kv, int kv_head, int64_t begin,
                           int64_t end, float scale, float* o, float* lse);

// The attention states of `heads` query heads that share KV head `kv_head` and the support
// `ids`: the heads of a grouped-query attention group (or part of one) whose selector gave them
// one support. q: [heads, head_dim], consecutive; o: [heads, head_dim]; lse: [heads]. Each key
// and value row is loaded once for up to four heads and the exponentials run eight at a time;
// the results are PartialAttention's on each head within float rounding (not bit for bit).
void GroupedPartialAttention(const float* q, int heads, const KvView& kv, int kv_head,
                             std::span<const int32_t> ids, float scale, float* o, float* lse);

// Multi-head attention of one decode step over per-head supports, heads in parallel; the heads
// of a KV group with equal supports are attended together (GroupedPartialAttention).
// q: [q_heads, head_dim]; supports[h] are the tokens query head h attends to;
// o: [q_heads, head_dim]; lse: [q_heads].
void MultiHeadAttention(const float* q, int q_heads, const KvView& kv,
                        std::span<const std::vector<int32_t>> supports, float scale, float* o,
                        float* lse);

// Full (exact) multi-head attention over every token of kv; shapes as MultiHeadAttention.
void MultiHeadFullAttention(const float* q, int q_heads, const KvView& kv, float scale, float* o,
                            float* lse);

}  // namespace kvrecall::cpu

#endif  // KVRECALL_KERNELS_CPU_ATTENTION_H_
