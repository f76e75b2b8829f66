// Per layer-step latency of the CUDA decode kernels on the GPU — full attention (split-K),
// exact top-K (full scan + selection + attention over K), the ReTopK reuse path in steady
// state, and the ReTopK step at the path mix of a recorded pattern (cuda_path_pattern: which
// (step, head) reused, fell back or refreshed on a real or synthetic trace), mix-weighted —
// for Llama-3-8B geometry (32 query / 8 KV heads, d = 128, bf16) over batches and contexts,
// with the bytes each step must move and the bandwidth that implies. Prints one JSON document
// (stdout and --out); bench/cuda_torch_baseline.py measures PyTorch on the same shapes and
// bench/cuda_plot.py puts them side by side.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>
#include <utility>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "bench/cuda_bench_check.h"
#include "bench/int_list.h"
#include "kernels/retopk_params.h"
#include "kernels/selection_path.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/decode_types.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/exact_topk.h"
#include "kernels/cuda/partial_attention.h"
#include "kernels/cuda/retopk.h"

ABSL_FLAG(std::string, batches, "1,8", "batch sizes");
ABSL_FLAG(std::string, contexts, "16384,32768,65536,131072,262144,1048576", "context lengths");
ABSL_FLAG(int, top_k, 512, "K of the exact top-K and ReTopK paths");
ABSL_FLAG(int, reps, 40, "timed replays per measurement (the median is reported)");
ABSL_FLAG(std::string, out, "", "also write the JSON here");
ABSL_FLAG(int, q_heads, 32, "query heads (Llama-3-8B: 32)");
ABSL_FLAG(int, kv_heads, 8, "KV heads (Llama-3-8B: 8)");
ABSL_FLAG(std::string, patterns, "",
          "NAME=FILE,...: path patterns (cuda_path_pattern) to run the ReTopK step at; each KV "
          "head group of the bench takes one (layer, KV head) group of the pattern");

namespace kvrecall::cuda {
namespace {

constexpr int kDim = 128;
// Measured device-to-device copy bandwidth of the H200 here (KINDS.md), the memory floor.
constexpr double kCopyBandwidth = 4.3e12;

using bench::ValueOrDie;

// Standard normal bf16 values from a counter hash (Box-Muller), so 32 GiB fill in milliseconds.
__global__ void FillNormal(__nv_bfloat16* x, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    uint64_t h = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
    h ^= h >> 31;
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 29;
    const float u1 = ((h >> 40) + 1) * (1.0f / 16777217.0f);
    const float u2 = ((h >> 16) & 0xffffff) * (1.0f / 16777216.0f);
    x[i] = __float2bfloat16(sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2));
  }
}

struct Stats {
  double median_us = 0, p10_us = 0, p90_us = 0;
};

// Microseconds between events 2i and 2i + 1 (completed) for each i; destroys the events.
std::vector<double> ElapsedUs(std::vector<cudaEvent_t>& events) {
  std::vector<double> us(events.size() / 2);
  for (size_t i = 0; i < us.size(); ++i) {
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, events[2 * i], events[2 * i + 1]));
    us[i] = 1000.0 * ms;
  }
  for (cudaEvent_t& e : events) cudaEventDestroy(e);
  events.clear();
  return us;
}

// Captures launch() in a CUDA graph and times `reps` replays, each between two events, after
// `warmup` untimed ones; before(i) runs untimed stream work ahead of replay i (i counts warmups).
// One eager launch first sets kernel attributes outside the capture.
Stats TimeGraph(cudaStream_t stream, int warmup, int reps, const std::function<void()>& launch,
                const std::function<void(int)>& before) {
  before(0);
  launch();
  CHECK_CUDA(cudaStreamSynchronize(stream));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  launch();
  CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
  CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  std::vector<cudaEvent_t> events(2 * reps);
  for (cudaEvent_t& e : events) CHECK_CUDA(cudaEventCreate(&e));
  for (int i = 0; i < warmup; ++i) {
    before(i);
    CHECK_CUDA(cudaGraphLaunch(exec, stream));
  }
  for (int i = 0; i < reps; ++i) {
    before(warmup + i);
    CHECK_CUDA(cudaEventRecord(events[2 * i], stream));
    CHECK_CUDA(cudaGraphLaunch(exec, stream));
    CHECK_CUDA(cudaEventRecord(events[2 * i + 1], stream));
  }
  CHECK_CUDA(cudaStreamSynchronize(stream));
  std::vector<double> us = ElapsedUs(events);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  std::sort(us.begin(), us.end());
  return Stats{us[reps / 2], us[reps / 10], us[(9 * reps) / 10]};
}

// Queries of one sequence that drift the way decode queries do: consecutive queries of a head
// have cosine ~0.97 ([steps, q_heads, head_dim]).
std::vector<float> DriftingQueries(int steps, int q_heads, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> state(q_heads * kDim);
  for (float& x : state) x = 1.85f * normal(rng);
  std::vector<float> out;
  for (int t = 0; t < steps; ++t) {
    for (float& x : state) {
      x = 0.97f * x + 0.45f * normal(rng);
      out.push_back(x);
    }
  }
  return out;
}

std::string Record(int batch, int context, const char* kernel, const Stats& t, double bytes,
                   const std::string& extra = "") {
  const double seconds = t.median_us * 1e-6;
  return absl::StrCat("{\"batch\": ", batch, ", \"context\": ", context, ", \"kernel\": \"",
                      kernel, "\", \"median_us\": ", t.median_us, ", \"p10_us\": ", t.p10_us,
                      ", \"p90_us\": ", t.p90_us, ", \"bytes\": ", bytes,
                      ", \"achieved_tbps\": ", bytes / seconds / 1e12,
                      ", \"floor_us\": ", bytes / kCopyBandwidth * 1e6, extra, "}");
}

// A recorded path pattern: paths[(layer * steps + step) * q_heads + head] (SelectionPath codes).
struct PathPattern {
  std::string name;
  int layers = 0, q_heads = 0, kv_heads = 0, steps = 0;
  std::vector<uint8_t> paths;
};

PathPattern ReadPattern(const std::string& name, const std::string& file) {
  std::ifstream in(file);
  std::string magic, version, line;
  PathPattern p;
  p.name = name;
  in >> magic >> version;
  if (magic != "kvrecall-path-pattern" || version != "v1") {
    std::fprintf(stderr, "%s: not a path pattern\n", file.c_str());
    std::exit(1);
  }
  for (int* field : {&p.layers, &p.q_heads, &p.kv_heads, &p.steps}) {
    std::string kv;
    in >> kv;
    *field = std::stoi(kv.substr(kv.find('=') + 1));
  }
  while (in >> line) {
    if (static_cast<int>(line.size()) != p.q_heads) {
      std::fprintf(stderr, "%s: a line of %zu paths, want %d\n", file.c_str(), line.size(),
                   p.q_heads);
      std::exit(1);
    }
    for (char c : line) p.paths.push_back(static_cast<uint8_t>(c - '0'));
  }
  if (static_cast<int64_t>(p.paths.size()) != int64_t{p.layers} * p.steps * p.q_heads) {
    std::fprintf(stderr, "%s: %zu paths, want layers * steps * q_heads\n", file.c_str(),
                 p.paths.size());
    std::exit(1);
  }
  return p;
}

// The ReTopK step of `batch` sequences along a pattern: query head h of sequence b follows head
// (g % G) * group + h % group of layer g / G of the pattern, g = (b * kv_heads + h / group) %
// (layers * G) with G the pattern's KV heads: a step the pattern reused drifts the query on
// (consecutive cosine ~0.97, above tau), one it fell back draws a fresh direction (cosine ~0.1
// with every cached query); refresh steps come from the step count itself (Tr = 128), since each
// step appends a token to a prompt of context - steps. Captured once in a graph; every step is
// timed alone and the mean over the steps is the mix-weighted step.
struct MixResult {
  double mean_us = 0, median_us = 0, p10_us = 0, p90_us = 0;
  double realized[kSelectionPaths] = {};  // share of rows per path, as the GPU chose
  double wanted[kSelectionPaths] = {};    // as the pattern says
  double steps_with_exact = 0;            // share of steps with any refresh/fallback row
};

MixResult RunPattern(const PathPattern& pat, const DecodeShape& shape, int top_k, int context,
                     const DeviceBuffer<__nv_bfloat16>& keys,
                     const DeviceBuffer<__nv_bfloat16>& values, size_t seq_elems,
                     cudaStream_t stream) {
  const int batch = shape.batch, q_heads = shape.q_heads, rows = shape.rows();
  const int group = shape.group();
  if (pat.q_heads / pat.kv_heads != group) {
    std::fprintf(stderr, "pattern %s has GQA groups of %d, the bench %d\n", pat.name.c_str(),
                 pat.q_heads / pat.kv_heads, group);
    std::exit(1);
  }
  ReTopKParams retopk;  // C = 32, R = 4, W = 32, tau = 0.85, Tr = 128
  const int steps = pat.steps;
  const int prompt = context - steps;
  const int c = retopk.cache_capacity;
  const size_t row_floats = static_cast<size_t>(q_heads) * kDim;
  // Queries: C seeding ones then one per step, [batch][c + steps][q_heads][d].
  std::vector<uint8_t> want(static_cast<size_t>(steps) * rows);
  std::vector<float> queries(static_cast<size_t>(batch) * (c + steps) * row_floats);
  std::mt19937_64 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int b = 0; b < batch; ++b) {
    for (int h = 0; h < q_heads; ++h) {
      const int g = (b * shape.kv_heads + h / group) % (pat.layers * pat.kv_heads);
      const int layer = g / pat.kv_heads;
      const int head = (g % pat.kv_heads) * group + h % group;
      std::vector<float> x(kDim);
      for (float& v : x) v = 1.85f * normal(rng);
      for (int t = 0; t < c + steps; ++t) {
        const uint8_t code =
            t < c ? 1
                  : pat.paths[(static_cast<size_t>(layer) * steps + (t - c)) * pat.q_heads + head];
        if (t >= c) want[static_cast<size_t>(t - c) * rows + b * q_heads + h] = code;
        for (float& v : x) {
          const bool jump = code == static_cast<uint8_t>(SelectionPath::kFallback);
          v = jump ? 1.85f * normal(rng) : 0.97f * v + 0.45f * normal(rng);
        }
        const size_t at = ((static_cast<size_t>(b) * (c + steps) + t) * q_heads + h) * kDim;
        std::copy(x.begin(), x.end(), queries.begin() + at);
      }
    }
  }
  auto d_queries = ValueOrDie(DeviceBuffer<float>::Zeroed(queries.size()));
  CHECK_OK(CopyToDevice(d_queries.data(), queries.data(), queries.size() * sizeof(float),
                        "uploading the queries"));
  auto query_at = [&](int b, int t) {
    return d_queries.data() + (static_cast<size_t>(b) * (c + steps) + t) * row_floats;
  };
  // Descriptors of step i (1-based): the prompt plus i tokens.
  std::vector<DeviceSeq> all_seqs;
  for (int i = 0; i <= steps; ++i) {
    for (int b = 0; b < batch; ++b) {
      all_seqs.push_back(DeviceSeq::Contiguous(keys.data() + b * seq_elems,
                                               values.data() + b * seq_elems, prompt + i));
    }
  }
  auto d_all_seqs = ValueOrDie(DeviceBuffer<DeviceSeq>::Zeroed(all_seqs.size()));
  CHECK_OK(CopyToDevice(d_all_seqs.data(), all_seqs.data(), all_seqs.size() * sizeof(DeviceSeq),
                        "uploading the sequences"));
  auto ws = ValueOrDie(ReTopKWorkspace::Create(shape, top_k, retopk, context));
  std::vector<std::unique_ptr<ReTopKCaches>> caches;
  std::vector<ReTopKCachesView> views;
  for (int b = 0; b < batch; ++b) {
    caches.push_back(ValueOrDie(ReTopKCaches::Create(q_heads, kDim, top_k, retopk)));
  }
  auto seed = [&] {
    views.clear();
    for (int b = 0; b < batch; ++b) {
      CHECK_OK(SeedReTopKCaches(shape, top_k, retopk, all_seqs[b], query_at(b, 0), c, {},
                                ws.get(), caches[b].get(), stream));
      views.push_back(caches[b]->view());
    }
  };
  seed();
  auto d_views = ValueOrDie(DeviceBuffer<ReTopKCachesView>::Zeroed(batch));
  CHECK_OK(CopyToDevice(d_views.data(), views.data(), batch * sizeof(ReTopKCachesView),
                        "uploading the cache views"));
  auto d_seqs = ValueOrDie(DeviceBuffer<DeviceSeq>::Zeroed(batch));
  auto d_q = ValueOrDie(DeviceBuffer<float>::Zeroed(rows * kDim));
  auto d_o = ValueOrDie(DeviceBuffer<float>::Zeroed(rows * kDim));
  auto d_lse = ValueOrDie(DeviceBuffer<float>::Zeroed(rows));
  auto d_paths = ValueOrDie(DeviceBuffer<uint8_t>::Zeroed(static_cast<size_t>(steps) * rows));
  auto prepare = [&](int i) {  // inputs of step i (1-based)
    CHECK_CUDA(cudaMemcpyAsync(d_seqs.data(), d_all_seqs.data() + static_cast<size_t>(i) * batch,
                               batch * sizeof(DeviceSeq), cudaMemcpyDeviceToDevice, stream));
    for (int b = 0; b < batch; ++b) {
      CHECK_CUDA(cudaMemcpyAsync(d_q.data() + b * row_floats, query_at(b, c + i - 1),
                                 row_floats * sizeof(float), cudaMemcpyDeviceToDevice, stream));
    }
  };
  auto step = [&] {
    CHECK_OK(ReTopKStep(shape, top_k, retopk, d_seqs.data(), d_views.data(), d_q.data(), context,
                        ws.get(), d_o.data(), d_lse.data(), stream));
  };
  // One eager step sets kernel attributes outside the capture; reseeding undoes it.
  prepare(1);
  step();
  CHECK_CUDA(cudaStreamSynchronize(stream));
  seed();
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  step();
  CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
  CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  std::vector<cudaEvent_t> events(2 * steps);
  for (cudaEvent_t& e : events) CHECK_CUDA(cudaEventCreate(&e));
  for (int i = 1; i <= steps; ++i) {
    prepare(i);
    CHECK_CUDA(cudaEventRecord(events[2 * (i - 1)], stream));
    CHECK_CUDA(cudaGraphLaunch(exec, stream));
    CHECK_CUDA(cudaEventRecord(events[2 * (i - 1) + 1], stream));
    CHECK_CUDA(cudaMemcpyAsync(d_paths.data() + static_cast<size_t>(i - 1) * rows, ws->paths(),
                               rows, cudaMemcpyDeviceToDevice, stream));
  }
  CHECK_CUDA(cudaStreamSynchronize(stream));
  CHECK_OK(ws->errors().CheckAndClear(stream));
  std::vector<double> us = ElapsedUs(events);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  std::vector<uint8_t> got(static_cast<size_t>(steps) * rows);
  CHECK_CUDA(cudaMemcpy(got.data(), d_paths.data(), got.size(), cudaMemcpyDeviceToHost));
  MixResult r;
  int exact_steps = 0;
  for (int i = 0; i < steps; ++i) {
    bool exact = false;
    for (int row = 0; row < rows; ++row) {
      const uint8_t path = got[static_cast<size_t>(i) * rows + row];
      const double share = 1.0 / (static_cast<double>(steps) * rows);
      r.realized[path] += share;
      r.wanted[want[static_cast<size_t>(i) * rows + row]] += share;
      exact |= path != static_cast<uint8_t>(SelectionPath::kReuse);
    }
    exact_steps += exact;
  }
  r.steps_with_exact = static_cast<double>(exact_steps) / steps;
  for (double u : us) r.mean_us += u / steps;
  std::sort(us.begin(), us.end());
  r.median_us = us[steps / 2];
  r.p10_us = us[steps / 10];
  r.p90_us = us[(9 * steps) / 10];
  return r;
}

int Main() {
  const std::vector<int> batches = bench::IntListOrExit("batches", absl::GetFlag(FLAGS_batches));
  const std::vector<int> contexts =
      bench::IntListOrExit("contexts", absl::GetFlag(FLAGS_contexts));
  const int top_k = absl::GetFlag(FLAGS_top_k);
  std::vector<PathPattern> patterns;
  const std::string pattern_flag = absl::GetFlag(FLAGS_patterns);
  for (absl::string_view spec : absl::StrSplit(pattern_flag, ',', absl::SkipEmpty())) {
    const std::pair<std::string, std::string> kv = absl::StrSplit(spec, absl::MaxSplits('=', 1));
    patterns.push_back(ReadPattern(kv.first, kv.second));
  }
  const int q_heads = absl::GetFlag(FLAGS_q_heads);
  const int kv_heads = absl::GetFlag(FLAGS_kv_heads);
  const int reps = absl::GetFlag(FLAGS_reps);
  constexpr int kWarmup = 8;
  const int max_batch = *std::max_element(batches.begin(), batches.end());
  const int max_context = *std::max_element(contexts.begin(), contexts.end());

  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  // One KV region per sequence slot, [max_context, kv_heads, head_dim] each.
  const size_t seq_elems = static_cast<size_t>(max_context) * kv_heads * kDim;
  auto keys = ValueOrDie(DeviceBuffer<__nv_bfloat16>::Zeroed(seq_elems * max_batch));
  auto values = ValueOrDie(DeviceBuffer<__nv_bfloat16>::Zeroed(seq_elems * max_batch));
  FillNormal<<<4096, 256, 0, stream>>>(keys.data(), keys.size(), 1);
  FillNormal<<<4096, 256, 0, stream>>>(values.data(), values.size(), 2);
  CHECK_CUDA(cudaStreamSynchronize(stream));

  const int max_rows = max_batch * q_heads;
  auto attention_ws = ValueOrDie(AttentionWorkspace::Create(max_rows, /*max_splits=*/512));
  auto topk_ws = ValueOrDie(TopKWorkspace::Create(max_rows, max_context));
  auto d_seqs = ValueOrDie(DeviceBuffer<DeviceSeq>::Zeroed(max_batch));
  auto d_caches = ValueOrDie(DeviceBuffer<ReTopKCachesView>::Zeroed(max_batch));
  auto d_q = ValueOrDie(DeviceBuffer<float>::Zeroed(static_cast<size_t>(max_rows) * kDim));
  auto d_o = ValueOrDie(DeviceBuffer<float>::Zeroed(static_cast<size_t>(max_rows) * kDim));
  auto d_lse = ValueOrDie(DeviceBuffer<float>::Zeroed(max_rows));
  auto d_support = ValueOrDie(DeviceBuffer<int32_t>::Zeroed(static_cast<size_t>(max_rows) * top_k));
  auto d_size = ValueOrDie(DeviceBuffer<int32_t>::Zeroed(max_rows));

  ReTopKParams retopk;       // C = 32, R = 4, W = 32, tau = 0.85
  retopk.refresh_interval = 0;  // the reuse path alone; refresh steps cost an exact top-K
  const int steps = retopk.cache_capacity + kWarmup + reps;
  const size_t row_floats = static_cast<size_t>(q_heads) * kDim;
  // Per sequence: C prompt queries then one per decode step, [steps][q_heads][d]; uploaded
  // as [batch][steps][q_heads][d].
  std::vector<float> stream_host;
  for (int b = 0; b < max_batch; ++b) {
    const std::vector<float> qs = DriftingQueries(steps, q_heads, 100 + b);
    stream_host.insert(stream_host.end(), qs.begin(), qs.end());
  }
  auto d_stream = ValueOrDie(DeviceBuffer<float>::Zeroed(stream_host.size()));
  CHECK_OK(CopyToDevice(d_stream.data(), stream_host.data(), stream_host.size() * sizeof(float),
                        "uploading the query stream"));
  auto step_query = [&](int b, int t) {
    return d_stream.data() + (static_cast<size_t>(b) * steps + t) * row_floats;
  };

  std::vector<std::string> records;
  for (int batch : batches) {
    const int rows = batch * q_heads;
    for (int context : contexts) {
      const DecodeShape shape{batch, q_heads, kv_heads, kDim, KvDtype::kBf16,
                              1.0f / std::sqrt(static_cast<float>(kDim))};
      std::vector<DeviceSeq> seqs;
      for (int b = 0; b < batch; ++b) {
        seqs.push_back(DeviceSeq::Contiguous(keys.data() + b * seq_elems,
                                             values.data() + b * seq_elems, context));
      }
      CHECK_OK(CopyToDevice(d_seqs.data(), seqs.data(), batch * sizeof(DeviceSeq),
                            "uploading the sequences"));
      // Full attention and exact top-K on the first decode query of each sequence.
      for (int b = 0; b < batch; ++b) {
        CHECK_OK(CopyDeviceToDevice(d_q.data() + b * row_floats,
                                    step_query(b, retopk.cache_capacity),
                                    row_floats * sizeof(float), "copying the step query"));
      }
      const double kv_bytes = 2.0 * batch * context * kv_heads * kDim * sizeof(__nv_bfloat16);
      const Stats full = TimeGraph(
          stream, kWarmup, reps,
          [&] {
            CHECK_OK(PartialAttentionOverSeqs(shape, d_seqs.data(), d_q.data(), context,
                                              attention_ws.get(), d_o.data(), d_lse.data(),
                                              stream));
          },
          [](int) {});
      const SplitPlan plan = ValueOrDie(PlanSeqAttention(shape, context, *attention_ws));
      records.push_back(Record(batch, context, "own_full", full, kv_bytes,
                               absl::StrCat(", \"splits\": ", plan.splits)));

      const Stats exact = TimeGraph(
          stream, kWarmup, reps,
          [&] {
            CHECK_OK(ExactTopKAttention(shape, d_seqs.data(), d_q.data(), context, top_k,
                                        nullptr, topk_ws.get(), d_support.data(), d_size.data(),
                                        d_o.data(), d_lse.data(), stream));
          },
          [](int) {});
      const double exact_bytes = kv_bytes / 2 + 2.0 * rows * context * sizeof(float) +
                                 static_cast<double>(rows) * top_k * kDim * sizeof(__nv_bfloat16);
      records.push_back(Record(batch, context, "own_exact_topk", exact, exact_bytes));

      // ReTopK: each sequence's caches seeded with the C queries before the timed ones, then
      // steps through the stream.
      auto retopk_ws = ValueOrDie(ReTopKWorkspace::Create(shape, top_k, retopk, context));
      std::vector<std::unique_ptr<ReTopKCaches>> caches;
      std::vector<ReTopKCachesView> views;
      for (int b = 0; b < batch; ++b) {
        caches.push_back(ValueOrDie(ReTopKCaches::Create(q_heads, kDim, top_k, retopk)));
        CHECK_OK(SeedReTopKCaches(shape, top_k, retopk, seqs[b], step_query(b, 0),
                                  retopk.cache_capacity, {}, retopk_ws.get(),
                                  caches.back().get(), stream));
        views.push_back(caches.back()->view());
      }
      CHECK_OK(CopyToDevice(d_caches.data(), views.data(), batch * sizeof(ReTopKCachesView),
                            "uploading the cache views"));
      const Stats reuse = TimeGraph(
          stream, kWarmup, reps,
          [&] {
            CHECK_OK(ReTopKStep(shape, top_k, retopk, d_seqs.data(), d_caches.data(), d_q.data(),
                                context, retopk_ws.get(), d_o.data(), d_lse.data(), stream));
          },
          [&](int i) {
            for (int b = 0; b < batch; ++b) {
              CHECK_CUDA(cudaMemcpyAsync(d_q.data() + b * row_floats,
                                         step_query(b, retopk.cache_capacity + i),
                                         row_floats * sizeof(float), cudaMemcpyDeviceToDevice,
                                         stream));
            }
          });
      CHECK_OK(retopk_ws->errors().CheckAndClear(stream));
      std::vector<uint8_t> paths(rows);
      std::vector<int32_t> candidates(rows);
      CHECK_CUDA(cudaMemcpy(paths.data(), retopk_ws->paths(), rows, cudaMemcpyDeviceToHost));
      CHECK_CUDA(cudaMemcpy(candidates.data(), retopk_ws->candidates(), rows * sizeof(int32_t),
                            cudaMemcpyDeviceToHost));
      int reused = 0;
      double candidate_sum = 0;
      for (int r = 0; r < rows; ++r) {
        if (paths[r] == 1) {
          ++reused;
          candidate_sum += candidates[r];
        }
      }
      const double mean_candidates = reused > 0 ? candidate_sum / reused : 0.0;
      // Per row: cached queries, R supports, candidate keys and ids and scores (written and
      // read), the K selected values, the cache push.
      const double per_row = retopk.cache_capacity * kDim * 4.0 +
                             retopk.reuse_neighbors * top_k * 4.0 +
                             mean_candidates * (kDim * 2.0 + 4 * 4.0) + top_k * kDim * 2.0 +
                             kDim * 4.0 + top_k * 4.0 * 2;
      records.push_back(Record(batch, context, "own_retopk_reuse", reuse, rows * per_row,
                               absl::StrCat(", \"reuse_fraction\": ",
                                            static_cast<double>(reused) / rows,
                                            ", \"mean_candidates\": ", mean_candidates)));
      std::fprintf(stderr,
                   "batch %d context %d: full %.1f us, exact top-K %.1f us, reuse %.1f us\n",
                   batch, context, full.median_us, exact.median_us, reuse.median_us);
      for (const PathPattern& pattern : patterns) {
        const MixResult mix =
            RunPattern(pattern, shape, top_k, context, keys, values, seq_elems, stream);
        const Stats as_stats{mix.median_us, mix.p10_us, mix.p90_us};
        records.push_back(Record(
            batch, context, ("own_retopk_mix_" + pattern.name).c_str(), as_stats, 0.0,
            absl::StrCat(", \"pattern\": \"", pattern.name, "\", \"mean_us\": ", mix.mean_us,
                         ", \"steps\": ", pattern.steps, ", \"reuse_fraction\": ",
                         mix.realized[1], ", \"fallback_fraction\": ", mix.realized[2],
                         ", \"refresh_fraction\": ", mix.realized[3],
                         ", \"pattern_reuse_fraction\": ", mix.wanted[1],
                         ", \"pattern_fallback_fraction\": ", mix.wanted[2],
                         ", \"pattern_refresh_fraction\": ", mix.wanted[3],
                         ", \"steps_with_exact_rows\": ", mix.steps_with_exact)));
        std::fprintf(stderr,
                     "  mix %s: mean %.1f us (median %.1f), reuse %.3f fallback %.3f refresh %.3f "
                     "(pattern %.3f %.3f %.3f), steps with exact rows %.2f\n",
                     pattern.name.c_str(), mix.mean_us, mix.median_us, mix.realized[1],
                     mix.realized[2], mix.realized[3], mix.wanted[1], mix.wanted[2],
                     mix.wanted[3], mix.steps_with_exact);
      }
    }
  }
  const std::string json = absl::StrCat(
      "{\"device\": \"", prop.name, "\", \"sms\": ", prop.multiProcessorCount,
      ", \"q_heads\": ", q_heads, ", \"kv_heads\": ", kv_heads, ", \"head_dim\": ", kDim,
      ", \"dtype\": \"bf16\", \"top_k\": ", top_k, ", \"reps\": ", reps,
      ", \"copy_bandwidth_tbps\": ", kCopyBandwidth / 1e12, ", \"records\": [\n  ",
      absl::StrJoin(records, ",\n  "), "\n]}\n");
  std::fputs(json.c_str(), stdout);
  if (const std::string out = absl::GetFlag(FLAGS_out); !out.empty()) {
    std::ofstream(out) << json;
  }
  return 0;
}

}  // namespace
}  // namespace kvrecall::cuda

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return kvrecall::cuda::Main();
}
