#include "index/product_quantizer.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "index/blas_threads.h"
#include "kernels/cpu/attention.h"

namespace kvrecall {
namespace {

constexpr int kCentroids = ProductQuantizer::kCentroids;

// Keys assigned per GEMM: a block's f32 rows and its [block, 256] distances stay in L2.
constexpr int64_t kBlock = 1024;

// Rows [begin, end) of `keys` widened to f32, [end - begin, dim].
void LoadRows(const VectorSet& keys, int64_t begin, int64_t end, float* out) {
  for (int64_t i = begin; i < end; ++i) {
    cpu::LoadRow(keys.row_data(i), keys.element, keys.dim, out + (i - begin) * keys.dim);
  }
}

// |c|^2 of each centroid of each codebook: [M, 256].
std::vector<float> CentroidNorms(const std::vector<float>& codebooks, int subspaces, int sub) {
  std::vector<float> norms(static_cast<size_t>(subspaces) * kCentroids);
  for (size_t c = 0; c < norms.size(); ++c) {
    const float* centroid = codebooks.data() + c * sub;
    float sum = 0.0f;
    for (int j = 0; j < sub; ++j) sum += centroid[j] * centroid[j];
    norms[c] = sum;
  }
  return norms;
}

// The nearest centroid of codebook m to part m of each of the n rows x ([n, dim]):
// argmin over c of |c|^2 - 2 <x_m, c> (|x_m|^2 is the same for every c), the lower c on a tie;
// written to codes[i * code_stride]. distances: scratch of [n, 256].
void Assign(const float* x, int64_t n, int dim, int m, int sub, const float* codebooks,
            const float* norms, float* distances, uint8_t* codes, int code_stride) {
  const float* book = codebooks + static_cast<int64_t>(m) * kCentroids * sub;
  const float* book_norms = norms + m * kCentroids;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(n), kCentroids, sub,
              -2.0f, x + m * sub, dim, book, sub, 0.0f, distances, kCentroids);
  for (int64_t i = 0; i < n; ++i) {
    const float* row = distances + i * kCentroids;
    int best = 0;
    float best_distance = row[0] + book_norms[0];
    for (int c = 1; c < kCentroids; ++c) {
      const float distance = row[c] + book_norms[c];
      if (distance < best_distance) {
        best_distance = distance;
        best = c;
      }
    }
    codes[i * code_stride] = static_cast<uint8_t>(best);
  }
}

}  // namespace

absl::StatusOr<ProductQuantizer> ProductQuantizer::Train(const VectorSet& keys,
                                                         const ProductQuantizerParams& params) {
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
  UseSingleThreadedBlas();
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
  std::vector<double> sums(static_cast<size_t>(kCentroids) * sub);
  std::vector<int64_t> counts(kCentroids);
  for (int round = 0; round < params.iterations; ++round) {
    const std::vector<float> norms = CentroidNorms(pq.codebooks_, subspaces, sub);
#pragma omp parallel
    {
      std::vector<float> distances(kBlock * kCentroids);
#pragma omp for schedule(dynamic, 1) collapse(2)
      for (int64_t b = 0; b < blocks; ++b) {
        for (int m = 0; m < subspaces; ++m) {
          const int64_t begin = b * kBlock, rows = std::min(kBlock, n - begin);
          Assign(sample.data() + begin * dim, rows, dim, m, sub, pq.codebooks_.data(),
                 norms.data(), distances.data(), codes.data() + begin * subspaces + m,
                 subspaces);
        }
      }
    }
    // Each centroid moves to the mean of its keys; a centroid left without keys takes half of
    // the largest cluster (faiss's split: the two move apart by a relative 1/1024), so that a
    // codebook does not keep entries nothing is coded with.
    for (int m = 0; m < subspaces; ++m) {
      std::fill(sums.begin(), sums.end(), 0.0);
      std::fill(counts.begin(), counts.end(), 0);
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
  return pq;
}

void ProductQuantizer::Encode(const VectorSet& keys, uint8_t* codes) const {
  UseSingleThreadedBlas();
  const int sub = subspace_dim();
  const std::vector<float> norms = CentroidNorms(codebooks_, subspaces_, sub);
  const int64_t blocks = (keys.count + kBlock - 1) / kBlock;
#pragma omp parallel
  {
    std::vector<float> rows(kBlock * dim_), distances(kBlock * kCentroids);
#pragma omp for schedule(dynamic, 1)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t begin = b * kBlock, n = std::min(kBlock, keys.count - begin);
      LoadRows(keys, begin, begin + n, rows.data());
      for (int m = 0; m < subspaces_; ++m) {
        Assign(rows.data(), n, dim_, m, sub, codebooks_.data(), norms.data(), distances.data(),
               codes + begin * subspaces_ + m, subspaces_);
      }
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
