#include "server/backends/bulk_codes.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/attention.h"

namespace kvrecall {
ProductQuantizerParams BulkCodes::TrainingParams(int head_dim) {
  ProductQuantizerParams params;
  params.subspaces = SubspacesFor(head_dim);  // training_keys: the quantizer's default
  params.iterations = 8;
  return params;
}

absl::Status BulkCodes::CheckConfig(const LayerConfig& config) {
  const int d = config.shape.head_dim;
  if (d % kDimsPerCode != 0 || d / kDimsPerCode > 16) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy.index.shortlist needs head_dim a multiple of ", kDimsPerCode, " up to ",
        16 * kDimsPerCode, " (one code byte per ", kDimsPerCode, " dims), got ", d));
  }
  return absl::OkStatus();
}

int64_t BulkCodes::CodeBytesFor(const LayerConfig& config, int64_t rows) {
  return rows * config.shape.kv_heads * SubspacesFor(config.shape.head_dim);
}

int64_t BulkCodes::CodebookBytesFor(const LayerConfig& config) {
  return int64_t{config.shape.kv_heads} * ProductQuantizer::kCentroids * config.shape.head_dim *
         static_cast<int64_t>(sizeof(float));
}

absl::Status BulkCodes::ChargeHost(int64_t bytes, absl::string_view what) {
  if (absl::Status s = host_->Reserve(bytes, what); !s.ok()) return s;
  host_charged_ += bytes;
  return absl::OkStatus();
}

absl::Status BulkCodes::ChargeQuantizers() {
  int64_t bytes = 0;
  for (const ProductQuantizer& pq : quantizers_) {
    bytes += static_cast<int64_t>(pq.codebooks().size() * sizeof(float));
  }
  return ChargeHost(bytes, "the shortlist's codebooks");
}

absl::StatusOr<std::vector<ProductQuantizer>> BulkCodes::Train(
    const KvView& bulk, PqAssigner* assigner, const BuildStop& stop) {
  std::vector<ProductQuantizer> quantizers;
  ProductQuantizerParams params = TrainingParams(bulk.head_dim);
  params.stop = stop;
  for (int h = 0; h < bulk.kv_heads; ++h) {
    absl::StatusOr<ProductQuantizer> pq = ProductQuantizer::Train(
        VectorSet::KeysOf(bulk, h, 0, TrainedRowsOf(bulk.tokens)), params, assigner);
    if (!pq.ok()) return pq.status();
    quantizers.push_back(*std::move(pq));
  }
  return quantizers;
}

BulkCodes::BulkCodes(std::vector<ProductQuantizer> quantizers, MemoryAccount* host)
    : quantizers_(std::move(quantizers)),
      outliers_(quantizers_.size()),
      outlier_threshold_(quantizers_.size(), std::numeric_limits<float>::quiet_NaN()),
      subspaces_(quantizers_.empty() ? 0 : quantizers_.front().subspaces()),
      host_(host) {}

BulkCodes::~BulkCodes() { host_->Release(host_charged_); }

absl::StatusOr<std::vector<uint8_t>> BulkCodes::ReadCodes(int kv_head, int64_t begin,
                                                          int64_t end) const {
  if (kv_head < 0 || kv_head >= kv_heads()) {
    return absl::OutOfRangeError(
        absl::StrCat("KV head ", kv_head, " out of [0, ", kv_heads(), ")"));
  }
  if (begin > end) {
    return absl::InvalidArgumentError(absl::StrCat("rows [", begin, ", ", end, ")"));
  }
  if (begin < 0 || end > coded_) {
    return absl::OutOfRangeError(
        absl::StrCat("rows [", begin, ", ", end, ") outside the ", coded_, " coded"));
  }
  std::vector<uint8_t> codes((end - begin) * subspaces_);
  if (absl::Status s = CopyCodes(kv_head, begin, end, codes.data()); !s.ok()) return s;
  return codes;
}

namespace {

// Rows of one KV head a coding encodes between two asks of its stop: ~45 ms on one core at
// d = 128 (pq_shortlist.md: 0.35 s a 128K-key head), so that a build stops within a few tenths
// of a second (index/build_stop.h).
constexpr int64_t kStopRows = 16384;

}  // namespace

absl::Status BulkCodes::EncodeRows(const KvView& bulk, int64_t begin, int64_t end,
                                   uint8_t* codes, const BuildStop& stop) {
  const int64_t n = end - begin;
  // [kv_heads, n]: added to the outliers once every head is coded, so that a stopped coding
  // changes nothing.
  std::vector<float> errors(kv_heads() * n);
  for (int h = 0; h < kv_heads(); ++h) {
    for (int64_t first = 0; first < n; first += kStopRows) {
      if (absl::Status s = stop.Check(kCodingStopped); !s.ok()) return s;
      const int64_t rows = std::min(kStopRows, n - first);
      const VectorSet keys = VectorSet::KeysOf(bulk, h, begin + first, begin + first + rows);
      uint8_t* block_codes = codes + (h * n + first) * subspaces_;
      float* block_errors = errors.data() + h * n + first;
      quantizers_[h].Encode(keys, block_codes);
      // Each key's squared reconstruction error (a team for the prompt's bulk; a step codes
      // one).
#pragma omp parallel if (rows > 1024)
      {
        std::vector<float> key(keys.dim), back(keys.dim);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < rows; ++i) {
          cpu::LoadRow(keys.row_data(i), keys.element, keys.dim, key.data());
          quantizers_[h].Reconstruct(block_codes + i * subspaces_, back.data());
          float error = 0.0f;
          for (int j = 0; j < keys.dim; ++j) error += (key[j] - back[j]) * (key[j] - back[j]);
          block_errors[i] = error;
        }
      }
    }
  }
  for (int h = 0; h < kv_heads(); ++h) {
    AddOutliers(h, begin, std::span<const float>(errors.data() + h * n, n));
  }
  return absl::OkStatus();
}

void BulkCodes::AddOutliers(int kv_head, int64_t begin, std::span<const float> errors) {
  const int64_t n = static_cast<int64_t>(errors.size());
  float& threshold = outlier_threshold_[kv_head];
  if (std::isnan(threshold) && n > 0) {
    // The trained bulk's held-out rows set the bar (all of it when too short to hold any out):
    // their 1/kOutlierShare worst-coded keys are above it.
    const int64_t held_out = n - TrainedRowsOf(n);
    std::vector<float> sorted(errors.end() - (held_out > 0 ? held_out : n), errors.end());
    const auto m = static_cast<int64_t>(sorted.size());
    const int64_t rank = m - 1 - m / kOutlierShare;
    std::nth_element(sorted.begin(), sorted.begin() + rank, sorted.end());
    threshold = sorted[rank];
  }
  for (int64_t i = 0; i < n; ++i) {
    if (errors[i] > threshold) outliers_[kv_head].push_back(static_cast<int32_t>(begin + i));
  }
}

}  // namespace kvrecall
