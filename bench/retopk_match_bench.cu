// Where the tiered placement's ReTopK cache match should run (issue 15): per decode step of a
// batch (every query head of every sequence), what a tiered step does before it scores any
// candidate — normalize q, cosines against the C cached queries, best and path, the R most
// similar entries, their supports ∪ the last W bulk positions sorted and deduplicated — timed
//   * on the host, with the real code (ReTopKHead::Match, the one ReTopKHead::Step runs), on one
//     thread and on the OpenMP team a tiered step would use (cpu::ThreadsFor of its work); and
//     its union alone on the team (UnionReuseCandidates: marked in a bitmap of the bulk and read
//     back in order), beside the baseline it replaced, the same union by sort and unique (its
//     lists are checked equal);
//   * on the GPU, caches there as the design card puts them (kernels/cuda/retopk_match.h:
//     ReTopKDecideKernel, the GPU-resident step's own decision, and the union), end to end with
//     the host waiting: the step's queries uploaded, the match, the results downloaded —
//       neighbors:          path, best cosine and the R entries' slots; the host then unions the
//                           supports from its own copies (UnionReuseCandidates, on the team);
//       candidates:         the union on the GPU too, the whole candidate lists downloaded;
//       candidates_mapped:  the same lists written by the kernel into mapped host memory;
//     alone, and queued on one stream with the static set's step (the packed upload, the append,
//     split-K attention over sinks + ring, its download, as server/backends/gpu_static_set.cc
//     launches them) — after it (static_then_*), since in a tiered step the host would wait for
//     the match before starting its bulk work, and before it (*_then_static).
// Every row takes the reuse path (--tau below every cosine; the exact path has no union), so
// this is the match's most expensive case. Each row's cached supports are K distinct ids drawn
// from a pool of its own of --support_pool * K bulk positions, so similar entries overlap. Each
// step also appends one (q̄, support) entry per row, untimed (it follows the scoring in a real
// step): on the host a copy, on the GPU an upload of K ids per row and ReTopKPushEntries
// (its device time is reported as push_device_us).
// Prints a table and one JSON document (stdout and --out): p50 / p99 wall-clock microseconds per
// step and variant, CUDA-event device time for the GPU's part, and each variant's p50 over the
// host team's. Without a CUDA device the host variants run alone.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "bench/cuda_bench_check.h"
#include "bench/int_list.h"
#include "client/stats.h"
#include "index/retopk.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/decode_types.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/kv_write.h"
#include "kernels/cuda/partial_attention.h"
#include "kernels/cuda/retopk.h"
#include "kernels/cuda/retopk_match.h"
#include "kernels/retopk_params.h"
#include "kernels/selection_path.h"

ABSL_FLAG(std::string, batches, "1,8", "batch sizes (sequences per step)");
ABSL_FLAG(std::string, top_ks, "512,2048", "K values");
ABSL_FLAG(std::string, bulk_tokens, "131072,524288",
          "bulk lengths n: the id range of the supports (the GPU's union spans a bitmap of it)");
ABSL_FLAG(int, steps, 200, "timed steps per variant");
ABSL_FLAG(int, warmup, 20, "untimed steps before them");
ABSL_FLAG(int, one_thread_steps, 0, "timed steps of the one-thread host variant (0: --steps)");
ABSL_FLAG(int, q_heads, 32, "query heads (Llama-3-8B: 32)");
ABSL_FLAG(int, kv_heads, 8, "KV heads (Llama-3-8B: 8)");
ABSL_FLAG(int, cache_capacity, 32, "C");
ABSL_FLAG(int, reuse_neighbors, 4, "R");
ABSL_FLAG(int, recent_window, 32, "W");
ABSL_FLAG(double, tau, -2.0, "reuse threshold (the default: every row reuses)");
ABSL_FLAG(double, support_pool, 2.0, "each row's supports come from a pool of this many times K");
ABSL_FLAG(int, sinks, 128, "static set: sinks");
ABSL_FLAG(int, recent, 512, "static set: ring of the last tokens");
ABSL_FLAG(bool, gpu, true, "run the GPU variants when a CUDA device is present");
ABSL_FLAG(std::string, out, "", "also write the JSON here");

namespace kvrecall {
namespace {

using cuda::CudaStatus;
using cuda::DeviceSeq;
using Clock = std::chrono::steady_clock;

constexpr int kDim = 128;
constexpr int kQuerySets = 16;  // distinct step queries, cycled

using bench::ValueOrDie;

double Micros(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::micro>(b - a).count();
}

struct Percentiles {
  double p50 = 0, p99 = 0, mean = 0;
};
// Interpolated, as every tool's percentiles are (client/stats.h).
Percentiles Summarize(const std::vector<double>& v) {
  return Percentiles{client::Percentile(v, 0.5), client::Percentile(v, 0.99), client::Mean(v)};
}

// One configuration's inputs, shared by every variant: per row (b * q_heads + h) a bank of
// supports (the first C seed the cache, the others are appended step by step), the seeding
// unit queries, and kQuerySets sets of step queries.
struct Inputs {
  int batch, q_heads, top_k, rows;
  int32_t bulk_tokens;
  ReTopKParams params;
  int bank;                                    // supports per row
  std::vector<int32_t> supports;               // [rows, bank, top_k]
  std::vector<float> seed_units;               // [C, rows, kDim]
  std::vector<float> queries;                  // [kQuerySets, rows, kDim]

  const int32_t* support(int row, int i) const {
    return supports.data() + (static_cast<size_t>(row) * bank + i % bank) * top_k;
  }
  const float* query_set(int step) const {
    return queries.data() + static_cast<size_t>(step % kQuerySets) * rows * kDim;
  }
  // The support row `row` appends after step `step` (steps count from 0).
  const int32_t* pushed(int row, int step) const {
    return support(row, params.cache_capacity + step);
  }
};

Inputs MakeInputs(int batch, int q_heads, int top_k, int32_t n, const ReTopKParams& params,
                  double pool_factor, uint64_t seed) {
  Inputs in{batch, q_heads, top_k, batch * q_heads, n, params, params.cache_capacity + 8};
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal;
  const int pool_size = std::min<int64_t>(n, std::max<int64_t>(top_k, pool_factor * top_k));
  in.supports.resize(static_cast<size_t>(in.rows) * in.bank * top_k);
  std::vector<int32_t> pool;
  for (int row = 0; row < in.rows; ++row) {
    // The row's pool: pool_size distinct positions of [0, n).
    pool.clear();
    std::vector<bool> taken(n, false);
    std::uniform_int_distribution<int32_t> position(0, n - 1);
    while (static_cast<int>(pool.size()) < pool_size) {
      const int32_t p = position(rng);
      if (!taken[p]) {
        taken[p] = true;
        pool.push_back(p);
      }
    }
    for (int i = 0; i < in.bank; ++i) {
      // K distinct ids of the pool in random order (a partial shuffle).
      for (int j = 0; j < top_k; ++j) {
        std::uniform_int_distribution<int> pick(j, pool_size - 1);
        std::swap(pool[j], pool[pick(rng)]);
      }
      std::copy(pool.begin(), pool.begin() + top_k,
                in.supports.begin() + (static_cast<size_t>(row) * in.bank + i) * top_k);
    }
  }
  auto fill = [&](std::vector<float>* v, size_t count) {
    v->resize(count);
    for (float& x : *v) x = normal(rng);
  };
  fill(&in.seed_units, static_cast<size_t>(params.cache_capacity) * in.rows * kDim);
  for (size_t i = 0; i < in.seed_units.size(); i += kDim) {
    cpu::Normalize(in.seed_units.data() + i, kDim, in.seed_units.data() + i);
  }
  fill(&in.queries, static_cast<size_t>(kQuerySets) * in.rows * kDim);
  return in;
}

ReTopKHeadParams HeadParams(const Inputs& in) {
  ReTopKHeadParams p;
  p.top_k = in.top_k;
  p.reuse_neighbors = in.params.reuse_neighbors;
  p.recent_window = in.params.recent_window;
  p.refresh_interval = in.params.refresh_interval;
  p.tau = in.params.tau;
  return p;
}

// Every row's head with its cache seeded by the C first supports of its bank.
std::vector<ReTopKHead> SeededHeads(const Inputs& in) {
  std::vector<ReTopKHead> heads(in.rows,
                                ReTopKHead(HeadParams(in), in.params.cache_capacity, kDim));
  for (int c = 0; c < in.params.cache_capacity; ++c) {
    for (int row = 0; row < in.rows; ++row) {
      heads[row].mutable_cache()->Push(
          in.seed_units.data() + (static_cast<size_t>(c) * in.rows + row) * kDim,
          std::span<const int32_t>(in.support(row, c), in.top_k));
    }
  }
  return heads;
}

// Runs body(row) for every row, on `threads` OpenMP threads as a tiered step does.
template <typename Body>
void ForRows(int rows, int threads, const Body& body) {
  if (threads > 1) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int row = 0; row < rows; ++row) body(row);
  } else {
    for (int row = 0; row < rows; ++row) body(row);
  }
}

// Appends the entry of step `step` to every row's host cache (untimed in every variant).
void PushHost(const Inputs& in, int step, std::vector<ReTopKHead>* heads) {
  for (int row = 0; row < in.rows; ++row) {
    ReTopKHead& head = (*heads)[row];
    head.mutable_cache()->Push(head.unit_query(),
                               std::span<const int32_t>(in.pushed(row, step), in.top_k));
  }
}

// What one variant measured.
struct Result {
  std::string variant;
  int threads = 1;
  int steps = 0;
  Percentiles wall, device, push;
  double mean_candidates = 0;  // per reuse row
  double reuse_fraction = 0;
  int64_t bytes_up = 0, bytes_down = 0;
  int mismatched_rows = -1;  // GPU variants: rows whose candidates differ from the host's
};

// What a host variant times.
enum class HostPart {
  kMatch,        // ReTopKHead::Match: the whole match
  kUnion,        // UnionReuseCandidates alone, on the neighbors of an untimed Match
  kSortUnion,  // the baseline UnionReuseCandidates replaced: the same union by sort and unique
};

// The baseline of HostPart::kSortUnion: the union of UnionReuseCandidates (sorted, distinct) by
// concatenating, sorting and deduplicating, as the host did before its bitmap union.
void SortUnion(const QuerySupportCache& cache, std::span<const int32_t> ages, int64_t tokens,
               int window, std::vector<int32_t>* candidates) {
  candidates->clear();
  for (int32_t age : ages) {
    std::span<const int32_t> s = cache.support(age);
    candidates->insert(candidates->end(), s.begin(), s.end());
  }
  for (int64_t t = std::max<int64_t>(0, tokens - window); t < tokens; ++t) {
    candidates->push_back(static_cast<int32_t>(t));
  }
  std::sort(candidates->begin(), candidates->end());
  candidates->erase(std::unique(candidates->begin(), candidates->end()), candidates->end());
}

Result RunHost(const Inputs& in, HostPart part, int threads, int steps, int warmup) {
  std::vector<ReTopKHead> heads = SeededHeads(in);
  Result r;
  r.variant = part == HostPart::kMatch       ? (threads > 1 ? "host_team" : "host_1t")
              : part == HostPart::kUnion     ? "host_team_union_only"
                                             : "baseline_host_team_sort_union_only";
  r.threads = threads;
  r.steps = steps;
  std::vector<double> wall;
  int64_t candidates = 0, reuse = 0, rows_seen = 0;
  std::vector<SelectionPath> paths(in.rows);
  std::vector<std::vector<int32_t>> unions(in.rows);
  auto match = [&](const float* q, int row) {
    float best;
    paths[row] = heads[row].Match(q + static_cast<size_t>(row) * kDim, in.bulk_tokens,
                                  in.bulk_tokens, &best);
  };
  for (int step = -warmup; step < steps; ++step) {
    const float* q = in.query_set(step + warmup);
    if (part != HostPart::kMatch) ForRows(in.rows, threads, [&](int row) { match(q, row); });
    const auto t0 = Clock::now();
    ForRows(in.rows, threads, [&](int row) {
      if (part == HostPart::kMatch) return match(q, row);
      const ReTopKHead& head = heads[row];
      if (part == HostPart::kUnion) {
        UnionReuseCandidates(head.cache(), head.neighbors(), in.bulk_tokens,
                             in.params.recent_window, &unions[row]);
      } else {
        SortUnion(head.cache(), head.neighbors(), in.bulk_tokens, in.params.recent_window,
                  &unions[row]);
      }
    });
    const auto t1 = Clock::now();
    if (step >= 0) {
      wall.push_back(Micros(t0, t1));
      for (int row = 0; row < in.rows; ++row) {
        ++rows_seen;
        if (paths[row] == SelectionPath::kReuse) {
          ++reuse;
          candidates += static_cast<int64_t>(heads[row].candidates().size());
        }
      }
    }
    if (step == steps - 1 && part != HostPart::kMatch) {
      r.mismatched_rows = 0;
      for (int row = 0; row < in.rows; ++row) {
        const std::span<const int32_t> want = heads[row].candidates();
        if (!std::equal(want.begin(), want.end(), unions[row].begin(), unions[row].end())) {
          ++r.mismatched_rows;
        }
      }
    }
    PushHost(in, step + warmup, &heads);
  }
  r.wall = Summarize(wall);
  r.reuse_fraction = rows_seen > 0 ? static_cast<double>(reuse) / rows_seen : 0;
  r.mean_candidates = reuse > 0 ? static_cast<double>(candidates) / reuse : 0;
  return r;
}

// ---------------------------------------------------------------------------------------------
// The GPU side.

enum class Mode { kNeighbors, kCandidates, kCandidatesMapped };
enum class Order { kAlone, kStaticAlone, kStaticThenMatch, kMatchThenStatic };

const char* ModeName(Mode m) {
  switch (m) {
    case Mode::kNeighbors: return "neighbors";
    case Mode::kCandidates: return "candidates";
    case Mode::kCandidatesMapped: return "candidates_mapped";
  }
  return "";
}

// Byte offsets of a packed buffer, each region 256-byte aligned.
class Layout {
 public:
  template <typename T>
  size_t Take(size_t count) {
    const size_t at = size_;
    size_ = (size_ + count * sizeof(T) + 255) / 256 * 256;
    return at;
  }
  size_t size() const { return size_; }

 private:
  size_t size_ = 0;
};

template <typename T>
T* At(void* base, size_t offset) {
  return reinterpret_cast<T*>(static_cast<char*>(base) + offset);
}

// Pinned host memory (mapped into the device's address space with `mapped`).
class Pinned {
 public:
  Pinned(size_t bytes, bool mapped) {
    CHECK_CUDA(cudaHostAlloc(&host_, std::max<size_t>(bytes, 1),
                             mapped ? cudaHostAllocMapped : cudaHostAllocDefault));
    if (mapped) CHECK_CUDA(cudaHostGetDevicePointer(&device_, host_, 0));
  }
  ~Pinned() { cudaFreeHost(host_); }
  Pinned(const Pinned&) = delete;
  Pinned& operator=(const Pinned&) = delete;
  void* host() const { return host_; }
  void* device() const { return device_; }

 private:
  void* host_ = nullptr;
  void* device_ = nullptr;
};

class GpuBench {
 public:
  GpuBench(const Inputs& in, int kv_heads, int sinks, int recent, int threads)
      : in_(in), kv_heads_(kv_heads), sinks_(sinks), recent_(recent), threads_(threads) {
    shape_ = cuda::DecodeShape{in.batch, in.q_heads, kv_heads, kDim, cuda::KvDtype::kBf16,
                               1.0f / std::sqrt(static_cast<float>(kDim))};
    CHECK_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    for (cudaEvent_t* e : {&begin_, &match_end_, &static_end_, &push_begin_, &push_end_}) {
      CHECK_CUDA(cudaEventCreate(e));
    }
    const int rows = in.rows;
    max_candidates_ = static_cast<int>(cuda::ReTopKMaxCandidates(in.top_k, in.params));
    ws_ = ValueOrDie(
        cuda::ReTopKMatchWorkspace::Create(shape_, in.top_k, in.params, in.bulk_tokens));
    attention_ws_ = ValueOrDie(cuda::AttentionWorkspace::Create(rows));
    // The step's upload: queries and the bulk lengths (the match); the new token's rows,
    // descriptors and slots (the static set).
    const int64_t row_elems = int64_t{kv_heads} * kDim;
    in_q_ = up_.Take<float>(static_cast<size_t>(rows) * kDim);
    in_bulk_ = up_.Take<DeviceSeq>(in.batch);
    match_up_bytes_ = up_.size();
    in_k_ = up_.Take<float>(in.batch * row_elems);
    in_v_ = up_.Take<float>(in.batch * row_elems);
    in_seqs_ = up_.Take<DeviceSeq>(in.batch);
    in_rows_ = up_.Take<cuda::TokenRows>(in.batch);
    // The match's results, then (modes with the union on the GPU, copied) the candidates.
    out_best_ = down_.Take<float>(rows);
    out_counts_ = down_.Take<int32_t>(rows);
    out_neighbors_ = down_.Take<int32_t>(static_cast<size_t>(rows) *
                                         (1 + in.params.cache_capacity));
    out_paths_ = down_.Take<uint8_t>(rows);
    decisions_bytes_ = down_.size();
    out_candidates_ = down_.Take<int32_t>(static_cast<size_t>(rows) * max_candidates_);
    // The static set's results.
    static_o_ = static_down_.Take<float>(static_cast<size_t>(rows) * kDim);
    static_lse_ = static_down_.Take<float>(rows);
    // The pushed entries.
    push_supports_ = push_up_.Take<int32_t>(static_cast<size_t>(rows) * in.top_k);
    push_sizes_ = push_up_.Take<int32_t>(rows);

    d_up_ = ValueOrDie(cuda::DeviceBuffer<char>::Zeroed(up_.size()));
    d_down_ = ValueOrDie(cuda::DeviceBuffer<char>::Zeroed(down_.size()));
    d_static_down_ = ValueOrDie(cuda::DeviceBuffer<char>::Zeroed(static_down_.size()));
    d_push_ = ValueOrDie(cuda::DeviceBuffer<char>::Zeroed(push_up_.size()));
    d_unit_q_ = ValueOrDie(cuda::DeviceBuffer<float>::Zeroed(static_cast<size_t>(rows) * kDim));
    h_up_ = std::make_unique<Pinned>(up_.size(), false);
    h_down_ = std::make_unique<Pinned>(down_.size(), false);
    h_static_down_ = std::make_unique<Pinned>(static_down_.size(), false);
    h_push_ = std::make_unique<Pinned>(push_up_.size(), false);
    h_mapped_ = std::make_unique<Pinned>(static_cast<size_t>(rows) * max_candidates_ * 4, true);
    // One static set per sequence ([sinks + recent, kv_heads, kDim] bf16; zeros: the
    // attention's time does not depend on the values).
    const size_t slots = static_cast<size_t>(sinks + recent);
    for (int b = 0; b < in.batch; ++b) {
      static_keys_.push_back(ValueOrDie(cuda::DeviceBuffer<uint16_t>::Zeroed(slots * row_elems)));
      static_values_.push_back(
          ValueOrDie(cuda::DeviceBuffer<uint16_t>::Zeroed(slots * row_elems)));
    }
    host_k_ = std::vector<float>(in.batch * row_elems, 0.01f);
  }

  ~GpuBench() {
    for (cudaEvent_t e : {begin_, match_end_, static_end_, push_begin_, push_end_}) {
      cudaEventDestroy(e);
    }
    cudaStreamDestroy(stream_);
  }

  // One variant: `order` places the match relative to the static set's step (kStaticAlone: the
  // static set's step alone, no match).
  Result Run(Mode mode, Order order, int steps, int warmup) {
    Reset();
    Result r;
    r.variant = VariantName(mode, order);
    r.threads = threads_;
    r.steps = steps;
    const bool match = order != Order::kStaticAlone;
    const bool with_static = order != Order::kAlone;
    const bool union_on_gpu = mode != Mode::kNeighbors;
    const int rows = in_.rows;
    const size_t down_bytes = mode == Mode::kCandidates ? down_.size() : decisions_bytes_;
    r.bytes_up = with_static ? up_.size() : match_up_bytes_;
    r.bytes_down = (match ? down_bytes : 0) + (with_static ? static_down_.size() : 0);
    std::vector<double> wall, device, push;
    std::vector<std::vector<int32_t>> host_union(rows);
    int64_t reuse = 0, candidates = 0, rows_seen = 0;
    for (int step = -warmup; step < steps; ++step) {
      const int s = step + warmup;
      if (match && s > 0) {
        Push(s - 1, step > 0 ? &push : nullptr);
      }
      const auto t0 = Clock::now();
      Pack(s, with_static);
      CHECK_CUDA(cudaEventRecord(begin_, stream_));
      const size_t upload = with_static ? up_.size() : match_up_bytes_;
      CHECK_CUDA(cudaMemcpyAsync(d_up_.data(), h_up_->host(), upload, cudaMemcpyHostToDevice,
                                 stream_));
      if (order == Order::kStaticThenMatch || order == Order::kStaticAlone) StaticSet();
      if (match) {
        cuda::ReTopKMatchOutputs out{
            d_unit_q_.data(), At<uint8_t>(d_down_.data(), out_paths_),
            At<float>(d_down_.data(), out_best_), At<int32_t>(d_down_.data(), out_neighbors_),
            At<int32_t>(d_down_.data(), out_counts_), nullptr};
        if (mode == Mode::kCandidates) {
          out.candidates = At<int32_t>(d_down_.data(), out_candidates_);
        } else if (mode == Mode::kCandidatesMapped) {
          out.candidates = static_cast<int32_t*>(h_mapped_->device());
        }
        CHECK_OK(cuda::ReTopKMatch(shape_, in_.top_k, in_.params,
                                   At<DeviceSeq>(d_up_.data(), in_bulk_),
                                   d_views_.data(), At<float>(d_up_.data(), in_q_),
                                   in_.bulk_tokens, ws_.get(), out, stream_));
        CHECK_CUDA(cudaMemcpyAsync(h_down_->host(), d_down_.data(), down_bytes,
                                   cudaMemcpyDeviceToHost, stream_));
      }
      CHECK_CUDA(cudaEventRecord(match_end_, stream_));
      if (order == Order::kMatchThenStatic) StaticSet();
      CHECK_CUDA(cudaEventRecord(static_end_, stream_));
      // The host waits for what it needs before its bulk work: the match (or, alone, the
      // static set).
      CHECK_CUDA(cudaEventSynchronize(match_end_));
      if (match && !union_on_gpu) {
        // The supports' copies on the host: the GPU's slots are the mirror's slots.
        const uint8_t* paths = At<uint8_t>(h_down_->host(), out_paths_);
        const int32_t* neighbors = At<int32_t>(h_down_->host(), out_neighbors_);
        const int stride = 1 + in_.params.cache_capacity;
        ForRows(rows, threads_, [&](int row) {
          thread_local std::vector<int32_t> row_ages;
          row_ages.clear();
          if (paths[row] != static_cast<uint8_t>(SelectionPath::kReuse)) {
            host_union[row].clear();
            return;
          }
          const int32_t* n = neighbors + static_cast<size_t>(row) * stride;
          const QuerySupportCache& cache = mirror_[row].cache();
          for (int i = 0; i < n[0]; ++i) row_ages.push_back(cache.AgeOfSlot(n[1 + i]));
          UnionReuseCandidates(cache, row_ages, in_.bulk_tokens, in_.params.recent_window,
                               &host_union[row]);
        });
      }
      const auto t1 = Clock::now();
      CHECK_CUDA(cudaEventSynchronize(static_end_));
      float ms = 0;
      CHECK_CUDA(cudaEventElapsedTime(&ms, begin_, order == Order::kStaticAlone ? static_end_
                                                                                : match_end_));
      if (step >= 0) {
        wall.push_back(Micros(t0, t1));
        device.push_back(1000.0 * ms);
      }
      if (!match) continue;
      if (step >= 0) {
        const uint8_t* paths = At<uint8_t>(h_down_->host(), out_paths_);
        for (int row = 0; row < rows; ++row) {
          ++rows_seen;
          if (paths[row] != static_cast<uint8_t>(SelectionPath::kReuse)) continue;
          ++reuse;
          candidates +=
              union_on_gpu ? RowCount(row) : static_cast<int64_t>(host_union[row].size());
        }
      }
      if (step == steps - 1) r.mismatched_rows = Check(mode, s, host_union);
    }
    CHECK_OK(ws_->errors().CheckAndClear(stream_));
    CHECK_OK(attention_ws_->errors().CheckAndClear(stream_));
    r.wall = Summarize(wall);
    r.device = Summarize(device);
    r.push = Summarize(push);
    r.reuse_fraction = rows_seen > 0 ? static_cast<double>(reuse) / rows_seen : 0;
    r.mean_candidates = reuse > 0 ? static_cast<double>(candidates) / reuse : 0;
    return r;
  }

  static std::string VariantName(Mode mode, Order order) {
    switch (order) {
      case Order::kAlone: return absl::StrCat("gpu_", ModeName(mode));
      case Order::kStaticAlone: return "static_set_alone";
      case Order::kStaticThenMatch: return absl::StrCat("static_then_", ModeName(mode));
      case Order::kMatchThenStatic: return absl::StrCat(ModeName(mode), "_then_static");
    }
    return "";
  }

 private:
  // Fresh caches seeded as the host heads are (the same C entries in the same order, so the
  // GPU's slots are the mirror's), and a fresh mirror.
  void Reset() {
    caches_.clear();
    std::vector<cuda::ReTopKCachesView> views;
    for (int b = 0; b < in_.batch; ++b) {
      caches_.push_back(ValueOrDie(
          cuda::ReTopKCaches::Create(in_.q_heads, kDim, in_.top_k, in_.params)));
      views.push_back(caches_.back()->view());
    }
    d_views_ = ValueOrDie(cuda::DeviceBuffer<cuda::ReTopKCachesView>::Zeroed(in_.batch));
    CHECK_CUDA(cudaMemcpy(d_views_.data(), views.data(), views.size() * sizeof(views[0]),
                          cudaMemcpyHostToDevice));
    const int rows = in_.rows;
    auto units = ValueOrDie(cuda::DeviceBuffer<float>::Zeroed(static_cast<size_t>(rows) * kDim));
    for (int c = 0; c < in_.params.cache_capacity; ++c) {
      int32_t* supports = At<int32_t>(h_push_->host(), push_supports_);
      int32_t* sizes = At<int32_t>(h_push_->host(), push_sizes_);
      for (int row = 0; row < rows; ++row) {
        std::memcpy(supports + static_cast<size_t>(row) * in_.top_k, in_.support(row, c),
                    in_.top_k * sizeof(int32_t));
        sizes[row] = in_.top_k;
      }
      CHECK_CUDA(cudaMemcpy(units.data(),
                            in_.seed_units.data() + static_cast<size_t>(c) * rows * kDim,
                            static_cast<size_t>(rows) * kDim * sizeof(float),
                            cudaMemcpyHostToDevice));
      CHECK_CUDA(cudaMemcpy(d_push_.data(), h_push_->host(), push_up_.size(),
                            cudaMemcpyHostToDevice));
      CHECK_OK(cuda::ReTopKPushEntries(shape_, in_.top_k, in_.params, d_views_.data(),
                                       units.data(), At<int32_t>(d_push_.data(), push_supports_),
                                       At<int32_t>(d_push_.data(), push_sizes_), ws_.get(),
                                       stream_));
      CHECK_CUDA(cudaStreamSynchronize(stream_));
    }
    mirror_ = SeededHeads(in_);
  }

  // Appends step `step`'s entries (after the scoring, in a real step): the supports uploaded,
  // ReTopKPushEntries with the match's unit queries; the host mirror alike. Records the device
  // time into *push when given.
  void Push(int step, std::vector<double>* push) {
    int32_t* supports = At<int32_t>(h_push_->host(), push_supports_);
    int32_t* sizes = At<int32_t>(h_push_->host(), push_sizes_);
    for (int row = 0; row < in_.rows; ++row) {
      std::memcpy(supports + static_cast<size_t>(row) * in_.top_k, in_.pushed(row, step),
                  in_.top_k * sizeof(int32_t));
      sizes[row] = in_.top_k;
    }
    CHECK_CUDA(cudaEventRecord(push_begin_, stream_));
    CHECK_CUDA(cudaMemcpyAsync(d_push_.data(), h_push_->host(), push_up_.size(),
                               cudaMemcpyHostToDevice, stream_));
    CHECK_OK(cuda::ReTopKPushEntries(shape_, in_.top_k, in_.params, d_views_.data(),
                                     d_unit_q_.data(), At<int32_t>(d_push_.data(), push_supports_),
                                     At<int32_t>(d_push_.data(), push_sizes_), ws_.get(),
                                     stream_));
    CHECK_CUDA(cudaEventRecord(push_end_, stream_));
    // The mirror appends the same entries: q̄ of that step as the host normalizes it (equal to
    // the GPU's to rounding), so that Check's host match sees the GPU's cosines.
    const float* q = in_.query_set(step);
    std::vector<float> unit(kDim);
    for (int row = 0; row < in_.rows; ++row) {
      cpu::Normalize(q + static_cast<size_t>(row) * kDim, kDim, unit.data());
      mirror_[row].mutable_cache()->Push(
          unit.data(), std::span<const int32_t>(in_.pushed(row, step), in_.top_k));
    }
    CHECK_CUDA(cudaEventSynchronize(push_end_));
    if (push != nullptr) {
      float ms = 0;
      CHECK_CUDA(cudaEventElapsedTime(&ms, push_begin_, push_end_));
      push->push_back(1000.0 * ms);
    }
  }

  // The step's upload, packed in pinned memory: the queries and bulk lengths, and for the
  // static set the new token's rows, descriptors and slots.
  void Pack(int step, bool with_static) {
    void* h = h_up_->host();
    std::memcpy(At<float>(h, in_q_), in_.query_set(step),
                static_cast<size_t>(in_.rows) * kDim * sizeof(float));
    DeviceSeq* bulk = At<DeviceSeq>(h, in_bulk_);
    for (int b = 0; b < in_.batch; ++b) {
      bulk[b] = DeviceSeq::Contiguous(nullptr, nullptr, in_.bulk_tokens);
    }
    if (!with_static) return;
    const size_t row_elems = static_cast<size_t>(kv_heads_) * kDim;
    std::memcpy(At<float>(h, in_k_), host_k_.data(), host_k_.size() * sizeof(float));
    std::memcpy(At<float>(h, in_v_), host_k_.data(), host_k_.size() * sizeof(float));
    // A full ring whose oldest entry moves on by one each step.
    const int32_t ring_start = step % recent_;
    const int32_t newest = sinks_ + (ring_start + recent_ - 1) % recent_;
    for (int b = 0; b < in_.batch; ++b) {
      At<DeviceSeq>(h, in_seqs_)[b] = DeviceSeq{static_keys_[b].data(), static_values_[b].data(),
                                                sinks_, sinks_, recent_, ring_start, recent_};
      At<cuda::TokenRows>(h, in_rows_)[b] =
          cuda::TokenRows{static_keys_[b].data() + newest * row_elems,
                          static_values_[b].data() + newest * row_elems};
    }
  }

  // The static set's step after the upload: the append, split-K attention over every static
  // set, the download of (o, lse).
  void StaticSet() {
    CHECK_OK(cuda::AppendTokens(in_.batch, kv_heads_ * kDim, cuda::KvDtype::kBf16,
                                At<cuda::TokenRows>(d_up_.data(), in_rows_),
                                At<float>(d_up_.data(), in_k_), At<float>(d_up_.data(), in_v_),
                                stream_));
    CHECK_OK(cuda::PartialAttentionOverSeqs(
        shape_, At<DeviceSeq>(d_up_.data(), in_seqs_), At<float>(d_up_.data(), in_q_),
        sinks_ + recent_, attention_ws_.get(), At<float>(d_static_down_.data(), static_o_),
        At<float>(d_static_down_.data(), static_lse_), stream_));
    CHECK_CUDA(cudaMemcpyAsync(h_static_down_->host(), d_static_down_.data(),
                               static_down_.size(), cudaMemcpyDeviceToHost, stream_));
  }

  int64_t RowCount(int row) const {
    return At<int32_t>(h_down_->host(), out_counts_)[row];
  }
  const int32_t* RowCandidates(Mode mode, int row) const {
    const int32_t* base = mode == Mode::kCandidatesMapped
                              ? static_cast<const int32_t*>(h_mapped_->host())
                              : At<int32_t>(h_down_->host(), out_candidates_);
    return base + static_cast<size_t>(row) * max_candidates_;
  }

  // Rows of the last step whose candidates differ from the host mirror's own match of the same
  // queries (its caches hold the same supports).
  int Check(Mode mode, int step, const std::vector<std::vector<int32_t>>& host_union) {
    const float* q = in_.query_set(step);
    int mismatched = 0;
    for (int row = 0; row < in_.rows; ++row) {
      float best;
      mirror_[row].Match(q + static_cast<size_t>(row) * kDim, in_.bulk_tokens, in_.bulk_tokens,
                         &best);
      const std::span<const int32_t> want = mirror_[row].candidates();
      std::span<const int32_t> got;
      if (mode == Mode::kNeighbors) {
        got = host_union[row];
      } else {
        const bool reuse = At<uint8_t>(h_down_->host(), out_paths_)[row] ==
                           static_cast<uint8_t>(SelectionPath::kReuse);
        got = std::span<const int32_t>(RowCandidates(mode, row), reuse ? RowCount(row) : 0);
      }
      if (!std::equal(want.begin(), want.end(), got.begin(), got.end())) ++mismatched;
    }
    return mismatched;
  }

  const Inputs& in_;
  const int kv_heads_, sinks_, recent_, threads_;
  cuda::DecodeShape shape_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t begin_, match_end_, static_end_, push_begin_, push_end_;
  int max_candidates_ = 0;
  std::unique_ptr<cuda::ReTopKMatchWorkspace> ws_;
  std::unique_ptr<cuda::AttentionWorkspace> attention_ws_;
  std::vector<std::unique_ptr<cuda::ReTopKCaches>> caches_;
  cuda::DeviceBuffer<cuda::ReTopKCachesView> d_views_;
  std::vector<ReTopKHead> mirror_;  // the host's copies of the supports, [rows]
  Layout up_, down_, static_down_, push_up_;
  size_t in_q_, in_bulk_, in_k_, in_v_, in_seqs_, in_rows_, match_up_bytes_;
  size_t out_best_, out_counts_, out_neighbors_, out_paths_, out_candidates_, decisions_bytes_;
  size_t static_o_, static_lse_, push_supports_, push_sizes_;
  cuda::DeviceBuffer<char> d_up_, d_down_, d_static_down_, d_push_;
  cuda::DeviceBuffer<float> d_unit_q_;
  std::unique_ptr<Pinned> h_up_, h_down_, h_static_down_, h_push_, h_mapped_;
  std::vector<cuda::DeviceBuffer<uint16_t>> static_keys_, static_values_;
  std::vector<float> host_k_;
};

bool HasDevice() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

std::string Json(const Result& r, int batch, int top_k, int32_t n, double host_team_p50,
                 double host_1t_p50) {
  auto ratio = [&](double base) { return base > 0 ? r.wall.p50 / base : 0.0; };
  return absl::StrCat(
      "{\"batch\": ", batch, ", \"top_k\": ", top_k, ", \"bulk_tokens\": ", n,
      ", \"variant\": \"", r.variant, "\", \"threads\": ", r.threads, ", \"steps\": ", r.steps,
      ", \"p50_us\": ", r.wall.p50, ", \"p99_us\": ", r.wall.p99, ", \"mean_us\": ", r.wall.mean,
      ", \"device_p50_us\": ", r.device.p50, ", \"device_p99_us\": ", r.device.p99,
      ", \"push_device_p50_us\": ", r.push.p50, ", \"ratio_p50_to_host_team\": ",
      ratio(host_team_p50), ", \"ratio_p50_to_host_1t\": ", ratio(host_1t_p50),
      ", \"bytes_up\": ", r.bytes_up, ", \"bytes_down\": ", r.bytes_down,
      ", \"mean_candidates\": ", r.mean_candidates, ", \"reuse_fraction\": ", r.reuse_fraction,
      ", \"mismatched_rows\": ", r.mismatched_rows, "}");
}

int Main() {
  const int q_heads = absl::GetFlag(FLAGS_q_heads);
  const int kv_heads = absl::GetFlag(FLAGS_kv_heads);
  const int steps = absl::GetFlag(FLAGS_steps);
  const int warmup = absl::GetFlag(FLAGS_warmup);
  const int one_thread_steps =
      absl::GetFlag(FLAGS_one_thread_steps) > 0 ? absl::GetFlag(FLAGS_one_thread_steps) : steps;
  ReTopKParams params;
  params.cache_capacity = absl::GetFlag(FLAGS_cache_capacity);
  params.reuse_neighbors = absl::GetFlag(FLAGS_reuse_neighbors);
  params.recent_window = absl::GetFlag(FLAGS_recent_window);
  params.tau = static_cast<float>(absl::GetFlag(FLAGS_tau));
  params.refresh_interval = 0;
  const bool gpu = absl::GetFlag(FLAGS_gpu) && HasDevice();
  std::string device = "none";
  if (gpu) {
    cudaDeviceProp prop{};
    CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
    device = prop.name;
  } else {
    std::fprintf(stderr, "%s: GPU variants skipped\n",
                 absl::GetFlag(FLAGS_gpu) ? "no CUDA device" : "--gpu=false");
  }
  std::vector<std::string> records;
  for (int32_t n : bench::IntListOrExit("bulk_tokens", absl::GetFlag(FLAGS_bulk_tokens))) {
    for (int top_k : bench::IntListOrExit("top_ks", absl::GetFlag(FLAGS_top_ks))) {
      for (int batch : bench::IntListOrExit("batches", absl::GetFlag(FLAGS_batches))) {
        const Inputs in = MakeInputs(batch, q_heads, top_k, n, params,
                                     absl::GetFlag(FLAGS_support_pool), 1234 + batch + top_k);
        // The team a tiered step runs its bulk on: cpu::ThreadsFor of its predicted work (every
        // row's candidates and K, times d).
        const int64_t work = static_cast<int64_t>(in.rows) *
                             (cuda::ReTopKMaxCandidates(top_k, params) + top_k) * kDim;
        const int team = cpu::ThreadsFor(work, in.rows);
        std::vector<Result> results;
        results.push_back(RunHost(in, HostPart::kMatch, 1, one_thread_steps, warmup));
        results.push_back(RunHost(in, HostPart::kMatch, team, steps, warmup));
        results.push_back(RunHost(in, HostPart::kUnion, team, steps, warmup));
        results.push_back(RunHost(in, HostPart::kSortUnion, team, steps, warmup));
        if (gpu) {
          GpuBench bench(in, kv_heads, absl::GetFlag(FLAGS_sinks), absl::GetFlag(FLAGS_recent),
                         team);
          for (Mode mode : {Mode::kNeighbors, Mode::kCandidates, Mode::kCandidatesMapped}) {
            results.push_back(bench.Run(mode, Order::kAlone, steps, warmup));
          }
          results.push_back(bench.Run(Mode::kNeighbors, Order::kStaticAlone, steps, warmup));
          for (Mode mode : {Mode::kNeighbors, Mode::kCandidates}) {
            results.push_back(bench.Run(mode, Order::kStaticThenMatch, steps, warmup));
            results.push_back(bench.Run(mode, Order::kMatchThenStatic, steps, warmup));
          }
        }
        const double team_p50 = results[1].wall.p50, one_p50 = results[0].wall.p50;
        std::fprintf(stderr,
                     "batch %d, K %d, bulk %d: %d rows, team %d threads, %.0f candidates per "
                     "reuse row\n",
                     batch, top_k, n, in.rows, team, results[1].mean_candidates);
        std::fprintf(stderr, "  %-40s %10s %10s %12s %10s %8s %8s\n", "variant", "p50 us",
                     "p99 us", "device p50", "push p50", "/team", "mismatch");
        for (const Result& r : results) {
          std::fprintf(stderr, "  %-40s %10.1f %10.1f %12.1f %10.1f %8.2f %8d\n",
                       r.variant.c_str(), r.wall.p50, r.wall.p99, r.device.p50, r.push.p50,
                       team_p50 > 0 ? r.wall.p50 / team_p50 : 0.0, r.mismatched_rows);
          records.push_back(Json(r, batch, top_k, n, team_p50, one_p50));
        }
      }
    }
  }
  const std::string json = absl::StrCat(
      "{\"device\": \"", device, "\", \"host_threads\": ", omp_get_max_threads(),
      ", \"q_heads\": ", q_heads, ", \"kv_heads\": ", kv_heads, ", \"head_dim\": ", kDim,
      ", \"cache_capacity\": ", params.cache_capacity, ", \"reuse_neighbors\": ",
      params.reuse_neighbors, ", \"recent_window\": ", params.recent_window, ", \"tau\": ",
      params.tau, ", \"support_pool\": ", absl::GetFlag(FLAGS_support_pool),
      ", \"sinks\": ", absl::GetFlag(FLAGS_sinks), ", \"recent\": ", absl::GetFlag(FLAGS_recent),
      ", \"records\": [\n  ", absl::StrJoin(records, ",\n  "), "\n]}\n");
  std::fputs(json.c_str(), stdout);
  if (const std::string out = absl::GetFlag(FLAGS_out); !out.empty()) {
    std::ofstream(out) << json;
  }
  return 0;
}

}  // namespace
}  // namespace kvrecall

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return kvrecall::Main();
}
