// A product quantizer of one KV head's keys (faiss's ProductQuantizer, 8-bit codes): small
// enough a copy of the keys to score every one of them cheaply, on the GPU or the CPU, so that
// only a shortlist of the best approximate scores needs the exact keys (issue 15's candidate
// scoring off the host; bench/results/pq_shortlist.md).
//
// The key dimension d is split into `subspaces` M contiguous parts of d / M dims; each part has a
// codebook of 256 centroids, learned by k-means (squared L2) on a sample of the keys, and a key's
// code is its nearest centroid's number in every part: M bytes per key. A query's approximate
// score of a key is the inner product with the key's reconstruction (its centroids side by
// side), computed from a table of the query's inner product with every centroid (asymmetric
// distance computation, ADC): M table lookups per key.
//
// Layouts (row-major, f32 unless noted):
//   codebooks [M, 256, d / M]; codes [n, M] u8; a query's table [M, 256].
#ifndef KVRECALL_INDEX_PRODUCT_QUANTIZER_H_
#define KVRECALL_INDEX_PRODUCT_QUANTIZER_H_

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "index/build_stop.h"
#include "kernels/vector_set.h"

namespace kvrecall {

struct ProductQuantizerParams {
  // M: codebooks, and code bytes per key. Must divide the key dimension.
  int subspaces = 8;
  // Keys k-means learns from: an even stride over the keys (all of them when fewer).
  int64_t training_keys = 16384;
  // Rounds of k-means (assignment, then every centroid moved to its keys' mean).
  int iterations = 10;
  // Asked before each round: once it is requested, Train stops with CANCELLED (a learning whose
  // layer closed, server/backends/codes_learning.h; a Prefill that will not commit).
  BuildStop stop;
};

// The assignment step of training (most of its arithmetic), which a device can take over: Load
// the training rows once, then each round Assign them to the round's codebooks by Encode's rule
// (the nearest centroid of every part, the lower number on a tie; |c|^2, then one multiply-add
// of -2 x_j and c_j per dim in order). index/gpu_pq_assigner.h has the GPU's.
class PqAssigner {
 public:
  virtual ~PqAssigner() = default;
  // rows: [count, dim] f32, valid until the last Assign.
  virtual absl::Status Load(const float* rows, int64_t count, int dim) = 0;
  // codes [count, M] of the loaded rows against codebooks [M, 256, dim / M].
  virtual absl::Status Assign(std::span<const float> codebooks, int subspaces,
                              uint8_t* codes) = 0;
};

class ProductQuantizer {
 public:
  static constexpr int kCentroids = 256;

  // Learns the codebooks from `keys` (any element type; at least one key). INVALID_ARGUMENT
  // when subspaces < 1, the dimension is not a multiple of it, iterations < 0 or
  // training_keys < 1. Deterministic: the same keys and params give the same codebooks. With
  // fewer training keys than centroids, the spare centroids repeat training keys. Runs on the
  // calling thread's OpenMP team; with an `assigner`, its assignments stand in for the team's
  // (an error of its is returned as is).
  static absl::StatusOr<ProductQuantizer> Train(const VectorSet& keys,
                                                const ProductQuantizerParams& params,
                                                PqAssigner* assigner = nullptr);

  int dim() const { return dim_; }
  int subspaces() const { return subspaces_; }
  int subspace_dim() const { return dim_ / subspaces_; }
  // [M, 256, d / M]
  const std::vector<float>& codebooks() const { return codebooks_; }

  // codes [keys.count, M]: each key's nearest centroid per subspace (the lower number on a tie;
  // the same code whether a key is encoded alone or with others).
  // keys.dim must be dim(). Runs on the calling thread's OpenMP team when there are more than
  // 1024 keys, on the calling thread alone otherwise.
  void Encode(const VectorSet& keys, uint8_t* codes) const;

  // table [M, 256]: <q part m, centroid c of codebook m>, q: [dim()].
  void QueryTable(const float* q, float* table) const;

  // scores[i] = sum over m of table[m, codes[i, m]] for i < n: the approximate <q, key i>.
  static void ScanCodes(const float* table, const uint8_t* codes, int64_t n, int subspaces,
                        float* scores);

  // The key whose code is `code` ([M]): centroids side by side, [dim()].
  void Reconstruct(const uint8_t* code, float* out) const;

 private:
  ProductQuantizer(int dim, int subspaces) : dim_(dim), subspaces_(subspaces) {}

  int dim_;
  int subspaces_;
  std::vector<float> codebooks_;
  // What Encode assigns with: |c|^2 [M, 256] and the codebooks transposed [M, d / M, 256].
  std::vector<float> norms_;
  std::vector<float> transposed_;
};

}  // namespace kvrecall

#endif  // KVRECALL_INDEX_PRODUCT_QUANTIZER_H_
