#include "index/product_quantizer.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/cpu/attention.h"

namespace kvrecall {
namespace {

constexpr int kCentroids = ProductQuantizer::kCentroids;

// Keys per parallel chunk of an encoding or a training round.
constexpr int64_t kBlock = 1024;

// The assignment's view of codebooks [M, 256, sub]: each centroid's |c|^2 ([M, 256]) and the
// codebooks transposed ([M, sub, 256]), so that one pass over a key's part updates its distances
// to 256 centroids with contiguous (vectorized) multiply-adds.
void BuildAssignTables(const std::vector<float>& codebooks, int subspaces, int sub,
                       std::vector<float>* norms, std::vector<float>* transposed) {
  norms->assign(static_cast<size_t>(subspaces) * kCentroids, 0.0f);
  transposed->resize(codebooks.size());
  for (int m = 0; m < subspaces; ++m) {
    for (int c = 0; c < kCentroids; ++c) {
      const float* centroid = codebooks.data() + (static_cast<int64_t>(m) * kCentroids + c) * sub;
      float sum = 0.0f;
      for (int j = 0; j < sub; ++j) {
        sum += centroid[j] * centroid[j];
        (*transposed)[(static_cast<int64_t>(m) * sub + j) * kCentroids + c] = centroid[j];
      }
      (*norms)[m * kCentroids + c] = sum;
    }
  }
}

// Keys one assignment pass codes together: each centroid row it loads serves all of them.
constexpr int kAssignKeys = 4;
// Centroids whose distances stay in registers at once (one AVX-512 vector).
constexpr int kAssignLanes = 16;

// The nearest centroid of each codebook to the parts of keys [0, count) (count <= kAssignKeys),
// given as `scaled` = -2 x ([kAssignKeys, M * sub]): argmin over c of |c|^2 - 2 <x_m, c>
// (|x_m|^2 is the same for every c), the lower c on a tie, into code[k][M]. Every key's
// distances are the same sequence of operations (|c|^2, then one multiply-add per dim in
// order), whatever `count` and the keys beside it: a
// key encoded alone gets the code it gets in a batch. Blocked so that the distances of 16
// centroids for every key of the pass stay in registers while the dims stream by; compiled for
// AVX-512 and AVX2 besides the baseline, picked at load time (the encoding of a 128K prompt's
// keys is most of a shortlist layer's build).
// Under ThreadSanitizer the baseline alone: the clones' resolver runs in the dynamic loader,
// before TSan's runtime is up, and its instrumented entry crashes every binary that links this
// file at load.
#if defined(__SANITIZE_THREAD__)
#define KVRECALL_ASSIGN_CLONES
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define KVRECALL_ASSIGN_CLONES
#endif
#endif
#ifndef KVRECALL_ASSIGN_CLONES
#define KVRECALL_ASSIGN_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#endif
KVRECALL_ASSIGN_CLONES void NearestCentroids(
    const float* norms, const float* transposed, const float* scaled, int count, int subspaces,
    int sub, uint8_t* const* code) {
  const int dim = subspaces * sub;
  for (int m = 0; m < subspaces; ++m) {
    // Per key and lane l: the smallest distance of centroids c0 + l so far and its c (the
    // first, on a tie: c0 ascends and only a strictly smaller one replaces it).
    alignas(64) float best[kAssignKeys][kAssignLanes];
    alignas(64) int32_t best_c[kAssignKeys][kAssignLanes];
    for (int c0 = 0; c0 < kCentroids; c0 += kAssignLanes) {
      alignas(64) float acc[kAssignKeys][kAssignLanes];
      for (int k = 0; k < kAssignKeys; ++k) {
#pragma omp simd
        for (int l = 0; l < kAssignLanes; ++l) acc[k][l] = norms[m * kCentroids + c0 + l];
      }
      for (int j = 0; j < sub; ++j) {
        const float* row = transposed + (static_cast<int64_t>(m) * sub + j) * kCentroids + c0;
        for (int k = 0; k < kAssignKeys; ++k) {
          const float s = scaled[k * dim + m * sub + j];
#pragma omp simd
          for (int l = 0; l < kAssignLanes; ++l) acc[k][l] += s * row[l];
        }
      }
      for (int k = 0; k < kAssignKeys; ++k) {
#pragma omp simd
        for (int l = 0; l < kAssignLanes; ++l) {
          const bool smaller = c0 == 0 || acc[k][l] < best[k][l];
          best[k][l] = smaller ? acc[k][l] : best[k][l];
          best_c[k][l] = smaller ? c0 + l : best_c[k][l];
        }
      }
    }
    // Across the lanes: the smallest distance, the lowest c among its lanes.
    for (int k = 0; k < count; ++k) {
      int c = best_c[k][0];
      float smallest = best[k][0];
      for (int l = 1; l < kAssignLanes; ++l) {
        if (best[k][l] < smallest || (best[k][l] == smallest && best_c[k][l] < c)) {
          smallest = best[k][l];
          c = best_c[k][l];
        }
      }
      code[k][m] = static_cast<uint8_t>(c);
    }
  }
}

// NearestCentroids over keys [begin, end) of f32 rows `rows` (row i at rows + i * dim), codes
// into codes + i * subspaces, a pass of kAssignKeys at a time.
void AssignRows(const float* norms, const float* transposed, const float* rows, int dim,
                int64_t begin, int64_t end, int subspaces, uint8_t* codes) {
  const int sub = dim / subspaces;
  // -2 x of the pass's keys, [kAssignKeys, dim] (exact: a power of two); a pass of fewer keys
  // computes its spare keys on the first one and reads nothing of them.
  thread_local std::vector<float> scaled;
  scaled.resize(static_cast<size_t>(kAssignKeys) * dim);
  for (int64_t i = begin; i < end; i += kAssignKeys) {
    const int count = static_cast<int>(std::min<int64_t>(kAssignKeys, end - i));
    uint8_t* code[kAssignKeys];
    for (int k = 0; k < kAssignKeys; ++k) {
      const float* x = rows + (i + (k < count ? k : 0)) * dim;
      for (int j = 0; j < dim; ++j) scaled[k * dim + j] = -2.0f * x[j];
      code[k] = k < count ? codes + (i + k) * subspaces : nullptr;
    }
    NearestCentroids(norms, transposed, scaled.data(), count, subspaces, sub, code);
  }
}

}  // namespace

absl::StatusOr<ProductQuantizer> ProductQuantizer::Train(const VectorSet& keys,
                                                         const ProductQuantizerParams& params,
                                                         PqAssigner* assigner) {
  if (params.subspaces < 1 || keys.dim < 1 || keys.dim % params.subspaces != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("product quantizer: subspaces must be >= 1 and divide the key dimension ",
                     keys.dim, " (got ", params.subspaces, ")"));
  }
  if (params.iterations < 0 || params.training_keys < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "product quantizer: iterations must be >= 0 and training_keys >= 1 (got ",
        params.iterations, " and ", params.training_keys, ")"));
  }
  if (keys.count < 1) {
    return absl::InvalidArgumentError("product quantizer: no keys to train on");
  }
  const int dim = keys.dim, subspaces = params.subspaces, sub = dim / subspaces;
  ProductQuantizer pq(dim, subspaces);

  // The training sample: an even stride over the keys.
  const int64_t n = std::min(params.training_keys, keys.count);
  std::vector<float> sample(n * dim);
  for (int64_t i = 0; i < n; ++i) {
    cpu::LoadRow(keys.row_data(i * keys.count / n), keys.element, dim, sample.data() + i * dim);
  }
  // Initial centroids: distinct sample rows drawn at random (a fixed seed; the same rows for
  // every codebook), repeating when the sample is short. Not a stride: keys come in runs (a
  // topic's segment), which a stride can sample in step with.
  std::vector<int64_t> rows(n);
  std::iota(rows.begin(), rows.end(), int64_t{0});
  std::mt19937_64 rng(0x5eed);
  for (int64_t c = 0; c < std::min<int64_t>(kCentroids, n); ++c) {
    std::swap(rows[c], rows[c + static_cast<int64_t>(rng() % static_cast<uint64_t>(n - c))]);
  }
  pq.codebooks_.resize(static_cast<size_t>(subspaces) * kCentroids * sub);
  for (int m = 0; m < subspaces; ++m) {
    for (int c = 0; c < kCentroids; ++c) {
      std::copy_n(sample.data() + rows[c % n] * dim + m * sub, sub,
                  pq.codebooks_.data() + (static_cast<int64_t>(m) * kCentroids + c) * sub);
    }
  }

  std::vector<uint8_t> codes(n * subspaces);
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  if (assigner != nullptr && params.iterations > 0) {
    if (absl::Status s = assigner->Load(sample.data(), n, dim); !s.ok()) return s;
  }
  for (int round = 0; round < params.iterations; ++round) {
    if (params.stop.requested()) {
      return BuildStop::Status(absl::StrCat("the product quantizer's training (before round ",
                                            round + 1, " of ", params.iterations, ")"));
    }
    if (assigner != nullptr) {
      if (absl::Status s = assigner->Assign(pq.codebooks_, subspaces, codes.data()); !s.ok()) {
        return s;
      }
    } else {
      BuildAssignTables(pq.codebooks_, subspaces, sub, &pq.norms_, &pq.transposed_);
#pragma omp parallel for schedule(dynamic, 1)
      for (int64_t b = 0; b < blocks; ++b) {
        AssignRows(pq.norms_.data(), pq.transposed_.data(), sample.data(), dim, b * kBlock,
                   std::min(n, (b + 1) * kBlock), subspaces, codes.data());
      }
    }
    // Each centroid moves to the mean of its keys; a centroid left without keys takes half of
    // the largest cluster (faiss's split: the two move apart by a relative 1/1024), so that a
    // codebook does not keep entries nothing is coded with.
    // Codebooks are independent: one per thread (the sums are in double, per codebook, so the
    // result does not depend on the team).
#pragma omp parallel for schedule(dynamic, 1)
    for (int m = 0; m < subspaces; ++m) {
      std::vector<double> sums(static_cast<size_t>(kCentroids) * sub, 0.0);
      std::vector<int64_t> counts(kCentroids, 0);
      for (int64_t i = 0; i < n; ++i) {
        const int c = codes[i * subspaces + m];
        const float* part = sample.data() + i * dim + m * sub;
        double* sum = sums.data() + static_cast<int64_t>(c) * sub;
        for (int j = 0; j < sub; ++j) sum[j] += part[j];
        ++counts[c];
      }
      float* book = pq.codebooks_.data() + static_cast<int64_t>(m) * kCentroids * sub;
      for (int c = 0; c < kCentroids; ++c) {
        if (counts[c] == 0) continue;
        for (int j = 0; j < sub; ++j) {
          book[c * sub + j] = static_cast<float>(sums[static_cast<int64_t>(c) * sub + j] / counts[c]);
        }
      }
      if (n <= kCentroids) continue;  // every key can have a centroid of its own already
      for (int c = 0; c < kCentroids; ++c) {
        if (counts[c] != 0) continue;
        const int largest =
            static_cast<int>(std::max_element(counts.begin(), counts.end()) - counts.begin());
        if (counts[largest] < 2) break;
        constexpr float kSplit = 1.0f / 1024;
        for (int j = 0; j < sub; ++j) {
          const float x = book[largest * sub + j];
          const float step = kSplit * (std::abs(x) + 1e-6f) * (j % 2 == 0 ? 1.0f : -1.0f);
          book[c * sub + j] = x + step;
          book[largest * sub + j] = x - step;
        }
        counts[c] = counts[largest] / 2;
        counts[largest] -= counts[c];
      }
    }
  }
  BuildAssignTables(pq.codebooks_, subspaces, sub, &pq.norms_, &pq.transposed_);
  return pq;
}

void ProductQuantizer::Encode(const VectorSet& keys, uint8_t* codes) const {
  const int64_t blocks = (keys.count + kBlock - 1) / kBlock;
  // A team only for several blocks: a decode step encodes one key per KV head.
#pragma omp parallel if (blocks > 1)
  {
    std::vector<float> rows(static_cast<size_t>(std::min(kBlock, keys.count)) * dim_);
#pragma omp for schedule(dynamic, 1)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t begin = b * kBlock, end = std::min(keys.count, (b + 1) * kBlock);
      for (int64_t i = begin; i < end; ++i) {
        cpu::LoadRow(keys.row_data(i), keys.element, dim_, rows.data() + (i - begin) * dim_);
      }
      AssignRows(norms_.data(), transposed_.data(), rows.data(), dim_, 0, end - begin,
                 subspaces_, codes + begin * subspaces_);
    }
  }
}

void ProductQuantizer::QueryTable(const float* q, float* table) const {
  const int sub = subspace_dim();
  for (int m = 0; m < subspaces_; ++m) {
    const float* part = q + m * sub;
    for (int c = 0; c < kCentroids; ++c) {
      const float* centroid = codebooks_.data() + (static_cast<int64_t>(m) * kCentroids + c) * sub;
      float sum = 0.0f;
      for (int j = 0; j < sub; ++j) sum += part[j] * centroid[j];
      table[m * kCentroids + c] = sum;
    }
  }
}

void ProductQuantizer::ScanCodes(const float* table, const uint8_t* codes, int64_t n,
                                 int subspaces, float* scores) {
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t* code = codes + i * subspaces;
    float sum = 0.0f;
    for (int m = 0; m < subspaces; ++m) sum += table[m * kCentroids + code[m]];
    scores[i] = sum;
  }
}

void ProductQuantizer::Reconstruct(const uint8_t* code, float* out) const {
  const int sub = subspace_dim();
  for (int m = 0; m < subspaces_; ++m) {
    std::copy_n(codebooks_.data() + (static_cast<int64_t>(m) * kCentroids + code[m]) * sub, sub,
                out + m * sub);
  }
}

}  // namespace kvrecall
