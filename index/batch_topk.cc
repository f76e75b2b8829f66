#include "index/batch_topk.h"

#include <cblas.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <mutex>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/attention.h"

// OpenBLAS's thread control, when the BLAS linked is OpenBLAS; weak so that any other BLAS
// links too.
extern "C" void openblas_set_num_threads(int num_threads) __attribute__((weak));

namespace kvrecall {
namespace {

// A block of queries times a block of keys is one GEMM; 64 x 2048 scores (512 KiB) stay in L2.
constexpr int kQueryBlock = 64;
constexpr int64_t kKeyBlock = 2048;

// Our OpenMP loops call sgemm from every core; BLAS threads on top would oversubscribe them.
void UseSingleThreadedBlas() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (openblas_set_num_threads != nullptr) openblas_set_num_threads(1);
  });
}

struct Scored {
  float score;
  int32_t id;
};

bool Better(const Scored& a, const Scored& b) {
  return a.score > b.score || (a.score == b.score && a.id < b.id);
}

// Keeps the best k of a stream of scores: candidates above the running threshold accumulate
// and are cut back to k when the buffer fills, which raises the threshold.
class RunningTopK {
 public:
  // The buffer holds up to this many times k candidates before it is cut back to k.
  static constexpr int kBufferFactor = 4;

  explicit RunningTopK(int k) : k_(k), limit_(kBufferFactor * static_cast<size_t>(k)) {}

  void Reset() {
    buffer_.clear();
    buffer_.reserve(limit_);
    threshold_ = -std::numeric_limits<float>::infinity();
  }

  void Offer(const float* scores, int64_t n, int64_t first_id) {
    float threshold = threshold_;
    int64_t j = 0;
    // Once the threshold is up, almost no score passes: a vectorized max over a run of scores
    // skips the run.
    for (; j + kRun <= n; j += kRun) {
      float run_max = scores[j];
#pragma omp simd reduction(max : run_max)
      for (int i = 1; i < kRun; ++i) run_max = std::max(run_max, scores[j + i]);
      if (run_max <= threshold) continue;
      for (int i = 0; i < kRun; ++i) Take(scores[j + i], first_id + j + i, &threshold);
    }
    for (; j < n; ++j) Take(scores[j], first_id + j, &threshold);
  }

  static constexpr int kRun = 16;

  void Take(float score, int64_t id, float* threshold) {
    if (score <= *threshold) return;
    buffer_.push_back({score, static_cast<int32_t>(id)});
    if (buffer_.size() >= limit_) {
      Shrink();
      *threshold = threshold_;
    }
  }

  // Writes the best k, best first, to out (-1 past the candidates seen).
  void Finish(int32_t* out) {
    Shrink();
    std::sort(buffer_.begin(), buffer_.end(), Better);
    for (int i = 0; i < k_; ++i) out[i] = i < static_cast<int>(buffer_.size()) ? buffer_[i].id : -1;
  }

 private:
  void Shrink() {
    if (buffer_.size() <= static_cast<size_t>(k_)) return;
    std::nth_element(buffer_.begin(), buffer_.begin() + (k_ - 1), buffer_.end(), Better);
    threshold_ = buffer_[k_ - 1].score;
    buffer_.resize(k_);
  }

  int k_;
  size_t limit_;  // candidates held before cutting back to k
  std::vector<Scored> buffer_;
  float threshold_ = -std::numeric_limits<float>::infinity();
};

}  // namespace

absl::Status CheckBatchTopKArgs(const VectorSet& queries, const VectorSet& keys, int k,
                                std::span<const int64_t> visible) {
  if (k < 1) return absl::InvalidArgumentError(absl::StrCat("top-k needs k >= 1, got ", k));
  if (queries.dim != keys.dim) {
    return absl::InvalidArgumentError(absl::StrCat("query dim ", queries.dim,
                                                   " differs from key dim ", keys.dim));
  }
  if (keys.count > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat("top-k over ", keys.count, " keys: ids must fit in int32"));
  }
  if (!visible.empty() && static_cast<int64_t>(visible.size()) != queries.count) {
    return absl::InvalidArgumentError(absl::StrCat("causal mask of ", visible.size(),
                                                   " counts for ", queries.count, " queries"));
  }
  if (queries.element != KvElement::kF32) {
    return absl::InvalidArgumentError(absl::StrCat("queries must be f32, got ",
                                                   KvElementName(queries.element)));
  }
  return absl::OkStatus();
}

bool IsCpuBatchTopK(const BatchTopKFunction& batch_topk) {
  using Function = absl::Status (*)(const VectorSet&, const VectorSet&, int, TopKLists*,
                                    std::span<const int64_t>, const BuildStop&);
  const Function* function = batch_topk.target<Function>();
  return function != nullptr && *function == &CpuBatchTopK;
}

int64_t CpuBatchTopKScratchBytes(int64_t keys, int k, int dim, int threads) {
  const int64_t kept = std::min<int64_t>(k, keys);
  const int64_t key_block = std::min(kKeyBlock, keys);
  // The widened key block is counted whatever the keys' type: an f32 build overestimates by it.
  const int64_t per_thread =
      kQueryBlock * (key_block * int64_t{sizeof(float)} +
                     RunningTopK::kBufferFactor * kept * int64_t{sizeof(Scored)}) +
      key_block * dim * int64_t{sizeof(float)};
  return std::max(1, threads) * per_thread;
}

absl::Status CpuBatchTopK(const VectorSet& queries, const VectorSet& keys, int k,
                          TopKLists* out, std::span<const int64_t> visible,
                          const BuildStop& stop) {
  if (absl::Status s = CheckBatchTopKArgs(queries, keys, k, visible); !s.ok()) return s;
  auto visible_of = [&](int64_t query) {
    return visible.empty() ? keys.count : std::clamp<int64_t>(visible[query], 0, keys.count);
  };
  out->k = static_cast<int>(std::min<int64_t>(k, keys.count));
  out->queries = queries.count;
  out->ids.assign(static_cast<size_t>(out->queries) * out->k, 0);
  if (out->k == 0 || queries.count == 0) return absl::OkStatus();
  UseSingleThreadedBlas();

  const int64_t query_blocks = (queries.count + kQueryBlock - 1) / kQueryBlock;
  const int64_t key_block = std::min(kKeyBlock, keys.count);
  // Set once a thread sees the stop requested: the other threads skip their remaining blocks.
  std::atomic<bool> stopped = false;
#pragma omp parallel
  {
    std::vector<float> block_scores(static_cast<size_t>(kQueryBlock) * key_block);
    // 16-bit keys are widened a block at a time for sgemm (f32 keys are read in place).
    std::vector<float> widened(keys.element != KvElement::kF32
                                   ? static_cast<size_t>(key_block) * keys.dim
                                   : 0);
    std::vector<RunningTopK> selectors(kQueryBlock, RunningTopK(out->k));
#pragma omp for schedule(dynamic, 1)
    for (int64_t b = 0; b < query_blocks; ++b) {
      if (stopped.load(std::memory_order_relaxed)) continue;
      if (stop.requested()) {
        stopped.store(true, std::memory_order_relaxed);
        continue;
      }
      const int64_t q0 = b * kQueryBlock;
      const int rows = static_cast<int>(std::min<int64_t>(kQueryBlock, queries.count - q0));
      int64_t block_visible = 0;
      for (int i = 0; i < rows; ++i) {
        selectors[i].Reset();
        block_visible = std::max(block_visible, visible_of(q0 + i));
      }
      for (int64_t k0 = 0; k0 < block_visible; k0 += key_block) {
        const int cols = static_cast<int>(std::min(key_block, block_visible - k0));
        const float* block_keys;
        int64_t block_stride;
        if (keys.element == KvElement::kF32) {
          block_keys = keys.row(k0);
          block_stride = keys.stride;
        } else {
          for (int c = 0; c < cols; ++c) {
            cpu::LoadRow(keys.row_data(k0 + c), keys.element, keys.dim,
                         widened.data() + static_cast<size_t>(c) * keys.dim);
          }
          block_keys = widened.data();
          block_stride = keys.dim;
        }
        // block_scores[rows, cols] = Q[q0:q0+rows] * K[k0:k0+cols]^T.
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, cols, keys.dim, 1.0f,
                    queries.row(q0), static_cast<int>(queries.stride), block_keys,
                    static_cast<int>(block_stride), 0.0f, block_scores.data(), cols);
        for (int i = 0; i < rows; ++i) {
          const int64_t seen = std::min<int64_t>(cols, visible_of(q0 + i) - k0);
          if (seen > 0) {
            selectors[i].Offer(block_scores.data() + static_cast<size_t>(i) * cols, seen, k0);
          }
        }
      }
      for (int i = 0; i < rows; ++i) {
        selectors[i].Finish(out->ids.data() + (q0 + i) * out->k);
      }
    }
  }
  if (stopped.load(std::memory_order_relaxed)) return BuildStop::Status("the batch top-k");
  return absl::OkStatus();
}

}  // namespace kvrecall
