// Candidate scoring off the host (issue 15): the tiered bulk step of the `index` policy (every
// head exact) with its candidates found two ways, in one process on one synthetic layer
// (client/trace/synthetic.h; Llama-3-8B geometry by default, bf16 host KV as the tiered
// placement holds it):
//  * graph: what the tiered placement does today: each head searches the query-aware graph
//    index over the bulk (IndexSelector, built at prefill with top-k lists on the GPU) and
//    attends to the top K it finds (cpu::PartialAttentionScored), heads on the compute pool.
//  * pq N: a product-quantized copy of the bulk keys on the GPU (index/product_quantizer.h:
//    8-byte codes per key and KV head, learned at prefill on the host), every head's ADC scores
//    of the whole bulk and its best N (kernels/cuda/pq_shortlist.h) in one launch, the N ids
//    copied back, then on the host each head rescores its N keys exactly (cpu::ScoreTokens),
//    keeps the top K and attends, heads on the compute pool. Time: the GPU part (query up,
//    scan, select, ids down, synchronized) + the host part.
// Each step runs every variant once, their order rotating so that each goes first (cold) as
// often. With --kernel_repeats, each step also times the shortlist's launches alone, again and
// again back to back (the GPU part's kernels without the host between them), and counts the
// heads whose last repeat lists other ids than the first call did. Recall: the share
// of each head's exact top K of the bulk (a flat scan, untimed) that a variant attends to, and
// the share of the exact top K's softmax mass it holds.
//
// Decode tokens join the bulk as the ring moves; their codes are encoded up front with the
// prompt's (one key per KV head per step, negligible next to the step), so the GPU copy always
// covers the bulk.
//
// Prints one JSON object.
#include <cuda_runtime_api.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "bench/int_list.h"
#include "bench/percentiles.h"
#include "bench/synthetic_layer.h"
#include "index/gpu_batch_topk.h"
#include "index/index_selector.h"
#include "index/product_quantizer.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/pq_shortlist.h"
#include "kernels/cuda/topk_workspace.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, shortlists, "1024,2048,4096", "PQ shortlist sizes N, comma-separated");
ABSL_FLAG(int, subspaces, 8, "PQ codebooks (code bytes per key and KV head)");
ABSL_FLAG(int64_t, training_keys, 16384, "PQ: keys k-means learns from, per KV head");
ABSL_FLAG(int, iterations, 10, "PQ: k-means rounds");
ABSL_FLAG(bool, graph, true, "also run the graph index (its build takes a while at 512K+)");
ABSL_FLAG(int, search_list_size, 0, "the graph search's list (0: the default, max(K, 200))");
ABSL_FLAG(int, threads, 0, "the host part's threads of the compute pool (0: all)");
ABSL_FLAG(int, kernel_repeats, 0,
          "per step, the shortlist's launches timed this many more times back to back, each "
          "alone between two events (gpu_kernels_repeat_us): the kernels with no host work "
          "between steps");

namespace kvrecall {
namespace {

using Clock = std::chrono::steady_clock;

double MicrosSince(Clock::time_point start) {
  return std::chrono::duration<double, std::micro>(Clock::now() - start).count();
}

// A pinned host buffer (the copies of a step go through it).
template <typename T>
class Pinned {
 public:
  explicit Pinned(size_t n) {
    void* p = nullptr;
    if (cudaMallocHost(&p, n * sizeof(T)) == cudaSuccess) data_ = static_cast<T*>(p);
  }
  ~Pinned() {
    if (data_ != nullptr) cudaFreeHost(data_);
  }
  T* data() const { return data_; }

 private:
  T* data_ = nullptr;
};

// One variant's figures.
struct Variant {
  std::string name;
  int shortlist = 0;  // 0: the graph
  std::vector<double> gpu_us, kernels_us, repeat_us, select_us, host_us, total_us, recall, mass,
      keys_scored;
  // Per head (pq): rescoring, the top K of the shortlist, the attention.
  std::vector<double> score_us, topk_us, attend_us;
  // (pq) FNV-1a over every step's and head's shortlist as a sorted set: two builds whose
  // shortlists are the same sets on the same trace print the same value.
  uint64_t ids_fnv = 14695981039346656037ull;
  // (pq, with --kernel_repeats) Heads whose shortlist after a step's repeated calls differs, as
  // a set, from its first call's (back-to-back calls on one workspace must agree).
  int64_t repeat_mismatches = 0;
};

void FoldFnv(uint64_t x, uint64_t* h) {
  for (int b = 0; b < 8; ++b) {
    *h = (*h ^ ((x >> (8 * b)) & 0xff)) * 1099511628211ull;
  }
}

absl::Status Run() {
  const bench::LayerFlags flags = bench::LayerFromFlags();
  const SyntheticTraceParams& params = flags.trace;
  const int64_t t = params.context;
  const int steps = flags.steps, warmup = flags.warmup, total_steps = params.decode_steps;
  absl::StatusOr<SyntheticTrace> trace = SyntheticTrace::Create(params);
  if (!trace.ok()) return trace.status();
  const int d = params.head_dim, q_heads = params.q_heads, kv_heads = params.kv_heads;
  const int64_t kv_row = int64_t{kv_heads} * d, q_row = int64_t{q_heads} * d;
  const int k = flags.k, sinks = flags.sinks, recent = flags.recent;
  const int threads =
      absl::GetFlag(FLAGS_threads) > 0 ? absl::GetFlag(FLAGS_threads) : omp_get_max_threads();
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));

  std::vector<Variant> variants;
  if (absl::GetFlag(FLAGS_graph)) variants.push_back({"graph", 0});
  int max_shortlist = 0;
  absl::StatusOr<std::vector<int>> shortlists =
      bench::ParseIntList("shortlists", absl::GetFlag(FLAGS_shortlists));
  if (!shortlists.ok()) return shortlists.status();
  for (const int n : *shortlists) {
    variants.push_back({"pq" + std::to_string(n), n});
    max_shortlist = std::max(max_shortlist, n);
  }

  const auto generate_start = Clock::now();
  const int64_t tokens_max = t + total_steps;
  const bench::SyntheticLayer layer(*std::move(trace));
  const KvView store = layer.store();
  const std::vector<float>& decode_q = layer.decode_q;
  const double generate_s = MicrosSince(generate_start) / 1e6;

  nlohmann::json out = {{"context", t},         {"steps", steps},
                        {"threads", threads},   {"k", k},
                        {"q_heads", q_heads},   {"kv_heads", kv_heads},
                        {"head_dim", d},        {"generate_s", generate_s}};

  // The graph: the tiered placement's `index` bulk selector, built from every prompt query.
  const LayerShape shape{q_heads, kv_heads, d, scale};
  std::unique_ptr<IndexSelector> graph;
  if (absl::GetFlag(FLAGS_graph)) {
    const std::vector<float> prompt_q = layer.PromptQueries();
    absl::StatusOr<BatchTopKFunction> gpu_topk = MakeGpuBatchTopKFunction();
    if (!gpu_topk.ok()) return gpu_topk.status();
    SelectorParams p;
    p.kind = SelectorKind::kIndex;
    p.top_k = k;
    p.sinks = sinks;
    p.recent = recent;
    p.index.search_list_size = absl::GetFlag(FLAGS_search_list_size);
    graph = std::make_unique<IndexSelector>(shape, p, /*bulk_only=*/true, *gpu_topk);
    const auto start = Clock::now();
    if (absl::Status s = graph->Build(store.Tokens(0, t), prompt_q.data()); !s.ok()) return s;
    out["graph_build_s"] = MicrosSince(start) / 1e6;
  }

  // The PQ copy: per KV head, trained on the prompt's bulk, every bulk key the steps will see
  // encoded ([kv_heads, set_stride, M]).
  const int subspaces = absl::GetFlag(FLAGS_subspaces);
  ProductQuantizerParams pq_params;
  pq_params.subspaces = subspaces;
  pq_params.training_keys = absl::GetFlag(FLAGS_training_keys);
  pq_params.iterations = absl::GetFlag(FLAGS_iterations);
  const int64_t bulk_max = tokens_max - recent - sinks;
  const int64_t set_stride = bulk_max;
  std::vector<float> codebooks;
  std::vector<uint8_t> codes(kv_heads * set_stride * subspaces);
  double train_s = 0, encode_s = 0;
  for (int h = 0; h < kv_heads; ++h) {
    auto start = Clock::now();
    absl::StatusOr<ProductQuantizer> pq = ProductQuantizer::Train(
        VectorSet::KeysOf(store, h, sinks, t - recent), pq_params);
    if (!pq.ok()) return pq.status();
    train_s += MicrosSince(start) / 1e6;
    start = Clock::now();
    pq->Encode(VectorSet::KeysOf(store, h, sinks, sinks + bulk_max),
               codes.data() + h * set_stride * subspaces);
    encode_s += MicrosSince(start) / 1e6;
    codebooks.insert(codebooks.end(), pq->codebooks().begin(), pq->codebooks().end());
  }
  out["pq_train_s"] = train_s;
  out["pq_encode_s"] = encode_s;
  // What the GPU holds per layer for the prompt's bulk: codes and codebooks.
  const int64_t prompt_bulk = t - recent - sinks;
  out["pq_device_bytes"] = kv_heads * prompt_bulk * subspaces + codebooks.size() * sizeof(float);
  out["full_kv_device_bytes"] = 2 * t * kv_row * int64_t{2};

  auto d_books = cuda::DeviceBuffer<float>::Zeroed(codebooks.size());
  auto d_codes = cuda::DeviceBuffer<uint8_t>::Zeroed(codes.size());
  auto d_q = cuda::DeviceBuffer<float>::Zeroed(q_row);
  auto d_set = cuda::DeviceBuffer<int32_t>::Zeroed(q_heads);
  auto d_ids = cuda::DeviceBuffer<int32_t>::Zeroed(int64_t{q_heads} * max_shortlist);
  auto d_sizes = cuda::DeviceBuffer<int32_t>::Zeroed(q_heads);
  auto d_tables = cuda::DeviceBuffer<float>::Zeroed(int64_t{q_heads} * subspaces * 256);
  auto ws = cuda::TopKWorkspace::Create(q_heads, static_cast<int>(bulk_max));
  for (const absl::Status& s : {d_books.status(), d_codes.status(), d_q.status(), d_set.status(),
                                d_ids.status(), d_sizes.status(), d_tables.status(), ws.status()}) {
    if (!s.ok()) return s;
  }
  std::vector<int32_t> set_of_row(q_heads);
  for (int h = 0; h < q_heads; ++h) set_of_row[h] = KvHeadOf(h, q_heads, kv_heads);
  KVRECALL_CUDA_RETURN_IF_ERROR(cuda::CudaStatus(
      cudaMemcpy(d_books->data(), codebooks.data(), codebooks.size() * sizeof(float),
                 cudaMemcpyHostToDevice), "codebooks up"));
  KVRECALL_CUDA_RETURN_IF_ERROR(cuda::CudaStatus(
      cudaMemcpy(d_codes->data(), codes.data(), codes.size(), cudaMemcpyHostToDevice), "codes up"));
  KVRECALL_CUDA_RETURN_IF_ERROR(cuda::CudaStatus(
      cudaMemcpy(d_set->data(), set_of_row.data(), q_heads * sizeof(int32_t),
                 cudaMemcpyHostToDevice), "sets up"));
  cudaStream_t stream;
  KVRECALL_CUDA_RETURN_IF_ERROR(cuda::CudaStatus(cudaStreamCreate(&stream), "stream"));
  cudaEvent_t events[2];
  for (cudaEvent_t& e : events) {
    KVRECALL_CUDA_RETURN_IF_ERROR(cuda::CudaStatus(cudaEventCreate(&e), "event"));
  }
  const int repeats = std::max(0, absl::GetFlag(FLAGS_kernel_repeats));
  std::vector<cudaEvent_t> repeat_events(2 * repeats);
  for (cudaEvent_t& e : repeat_events) {
    KVRECALL_CUDA_RETURN_IF_ERROR(cuda::CudaStatus(cudaEventCreate(&e), "event"));
  }
  Pinned<float> pinned_q(q_row);
  Pinned<int32_t> pinned_ids(int64_t{q_heads} * max_shortlist), pinned_sizes(q_heads);
  if (pinned_q.data() == nullptr || pinned_ids.data() == nullptr) {
    return absl::ResourceExhaustedError("pinned host buffers");
  }
  const cuda::PqCodeSets code_sets{d_books->data(), d_codes->data(), set_stride, subspaces, d};

  // Per-head scratch.
  std::vector<std::vector<int32_t>> candidates(q_heads), positions(q_heads), support(q_heads),
      exact(q_heads);
  std::vector<std::vector<float>> scores(q_heads), support_scores(q_heads);
  std::vector<HeadSelection> selections(q_heads);
  std::vector<float> o(q_row), lse(q_heads), all_scores;
  std::vector<double> phase_score(q_heads), phase_topk(q_heads), phase_attend(q_heads);

  for (int s = 0; s < total_steps; ++s) {
    const int64_t tokens = t + s + 1;
    const int64_t bulk_end = tokens - recent, bulk_n = bulk_end - sinks;
    const KvView kv = store.Tokens(0, tokens);
    const float* q = decode_q.data() + int64_t{s} * q_row;
    const bool record = s >= warmup;
    // The exact top K of each head's bulk and its softmax weights (untimed).
    std::vector<std::vector<double>> weights(q_heads);
    cpu::ParallelFor(q_heads, threads, [&](int64_t head) {
      const int h = static_cast<int>(head);
      const int kv_head = KvHeadOf(h, q_heads, kv_heads);
      std::vector<int32_t> ids(bulk_n);
      for (int64_t i = 0; i < bulk_n; ++i) ids[i] = static_cast<int32_t>(sinks + i);
      std::vector<float> sc(bulk_n);
      cpu::ScoreTokens(q + int64_t{h} * d, kv, kv_head, ids, scale, sc.data());
      std::vector<int32_t> top;
      cpu::TopKPositions(sc, k, &top);
      exact[h].clear();
      for (int32_t p : top) exact[h].push_back(static_cast<int32_t>(sinks + p));
      const float best = sc[top[0]];
      weights[h].assign(bulk_n, 0.0);
      for (int64_t i = 0; i < bulk_n; ++i) weights[h][i] = std::exp(double{sc[i]} - best);
    });
    auto score_recall = [&](Variant& v, int h, const std::vector<int32_t>& chosen) {
      std::vector<int32_t> a = chosen, b = exact[h];
      std::sort(a.begin(), a.end());
      std::sort(b.begin(), b.end());
      std::vector<int32_t> both;
      std::set_intersection(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(both));
      double got = 0, want = 0;
      for (int32_t id : chosen) got += weights[h][id - sinks];
      for (int32_t id : exact[h]) want += weights[h][id - sinks];
      v.recall.push_back(static_cast<double>(both.size()) / b.size());
      v.mass.push_back(got / want);
    };

    for (size_t turn = 0; turn < variants.size(); ++turn) {
      Variant& v = variants[(turn + s) % variants.size()];
      double gpu_us = 0;
      int64_t scored = 0;
      std::vector<int64_t> head_scored(q_heads, 0);
      if (v.shortlist == 0) {
        const auto start = Clock::now();
        cpu::ParallelFor(q_heads, threads, [&](int64_t head) {
          const int h = static_cast<int>(head);
          HeadSelection& sel = selections[h];
          graph->Select(h, q + int64_t{h} * d, kv, &sel);
          const int kv_head = KvHeadOf(h, q_heads, kv_heads);
          if (sel.support_scores.size() == sel.support.size()) {
            cpu::PartialAttentionScored(sel.support_scores, kv, kv_head, sel.support,
                                        o.data() + int64_t{h} * d, &lse[h]);
          } else {
            cpu::PartialAttention(q + int64_t{h} * d, kv, kv_head, sel.support, scale,
                                  o.data() + int64_t{h} * d, &lse[h]);
          }
          head_scored[h] = sel.candidates;
        });
        const double host_us = MicrosSince(start);
        if (record) {
          v.host_us.push_back(host_us);
          v.total_us.push_back(host_us);
          for (int h = 0; h < q_heads; ++h) score_recall(v, h, selections[h].support);
        }
      } else {
        const int n = v.shortlist;
        auto start = Clock::now();
        std::copy_n(q, q_row, pinned_q.data());
        KVRECALL_CUDA_RETURN_IF_ERROR(cuda::CudaStatus(
            cudaMemcpyAsync(d_q->data(), pinned_q.data(), q_row * sizeof(float),
                            cudaMemcpyHostToDevice, stream), "q up"));
        cuda::PqShortlistRows rows{d_q->data(), d_set->data(), nullptr, d_tables->data(),
                                   q_heads, static_cast<int>(bulk_n)};
        rows.group = q_heads / kv_heads;
        cudaEventRecord(events[0], stream);
        KVRECALL_CUDA_RETURN_IF_ERROR(cuda::PqShortlist(code_sets, rows, n, ws->get(),
                                                        d_ids->data(), d_sizes->data(), nullptr,
                                                        stream));
        cudaEventRecord(events[1], stream);
        KVRECALL_CUDA_RETURN_IF_ERROR(cuda::CudaStatus(
            cudaMemcpyAsync(pinned_ids.data(), d_ids->data(),
                            int64_t{q_heads} * n * sizeof(int32_t),
                            cudaMemcpyDeviceToHost, stream), "ids down"));
        KVRECALL_CUDA_RETURN_IF_ERROR(cuda::CudaStatus(
            cudaMemcpyAsync(pinned_sizes.data(), d_sizes->data(), q_heads * sizeof(int32_t),
                            cudaMemcpyDeviceToHost, stream), "sizes down"));
        KVRECALL_CUDA_RETURN_IF_ERROR(
            cuda::CudaStatus(cudaStreamSynchronize(stream), "shortlist step"));
        gpu_us = MicrosSince(start);
        float kernels_ms = 0;
        cudaEventElapsedTime(&kernels_ms, events[0], events[1]);
        // The selection as a pass of its own (SelectRowTopK: a histogram pass, then the
        // collect), again over the scores the scan left in the workspace (timing only). The
        // shortlist builds the histograms while scanning and runs only the collect pass.
        cudaEventRecord(events[0], stream);
        KVRECALL_CUDA_RETURN_IF_ERROR(cuda::SelectRowTopK(
            ws->get()->scores(), ws->get()->max_tokens(), q_heads, static_cast<int>(bulk_n),
            nullptr, n, ws->get(), d_ids->data(), n, d_sizes->data(), nullptr, stream));
        cudaEventRecord(events[1], stream);
        KVRECALL_CUDA_RETURN_IF_ERROR(cuda::CudaStatus(cudaEventSynchronize(events[1]), "select"));
        float select_ms = 0;
        cudaEventElapsedTime(&select_ms, events[0], events[1]);
        if (record) {
          v.kernels_us.push_back(1e3 * kernels_ms);
          v.select_us.push_back(1e3 * select_ms);
        }
        // The shortlist again, `repeats` times (same inputs, same ids; timing only).
        for (int r = 0; r < repeats; ++r) {
          cudaEventRecord(repeat_events[2 * r], stream);
          KVRECALL_CUDA_RETURN_IF_ERROR(cuda::PqShortlist(code_sets, rows, n, ws->get(),
                                                          d_ids->data(), d_sizes->data(),
                                                          nullptr, stream));
          cudaEventRecord(repeat_events[2 * r + 1], stream);
        }
        if (repeats > 0) {
          KVRECALL_CUDA_RETURN_IF_ERROR(
              cuda::CudaStatus(cudaStreamSynchronize(stream), "repeated shortlists"));
        }
        for (int r = 0; r < repeats && record; ++r) {
          float ms = 0;
          cudaEventElapsedTime(&ms, repeat_events[2 * r], repeat_events[2 * r + 1]);
          v.repeat_us.push_back(1e3 * ms);
        }
        auto sorted_set = [&](const int32_t* all_ids, const int32_t* sizes, int h) {
          const int32_t* ids = all_ids + int64_t{h} * n;
          std::vector<int32_t> set(ids, ids + sizes[h]);
          std::sort(set.begin(), set.end());
          return set;
        };
        for (int h = 0; h < q_heads; ++h) {  // (untimed)
          const std::vector<int32_t> set = sorted_set(pinned_ids.data(), pinned_sizes.data(), h);
          FoldFnv(set.size(), &v.ids_fnv);
          for (int32_t id : set) FoldFnv(static_cast<uint32_t>(id), &v.ids_fnv);
        }
        if (repeats > 0) {  // the last repeat's lists against the first call's (untimed)
          std::vector<int32_t> ids(int64_t{q_heads} * n), sizes(q_heads);
          KVRECALL_CUDA_RETURN_IF_ERROR(cuda::CudaStatus(
              cudaMemcpy(ids.data(), d_ids->data(), ids.size() * sizeof(int32_t),
                         cudaMemcpyDeviceToHost), "repeated ids down"));
          KVRECALL_CUDA_RETURN_IF_ERROR(cuda::CudaStatus(
              cudaMemcpy(sizes.data(), d_sizes->data(), q_heads * sizeof(int32_t),
                         cudaMemcpyDeviceToHost), "repeated sizes down"));
          for (int h = 0; h < q_heads; ++h) {
            if (sorted_set(ids.data(), sizes.data(), h) !=
                sorted_set(pinned_ids.data(), pinned_sizes.data(), h)) {
              ++v.repeat_mismatches;
            }
          }
        }
        start = Clock::now();
        cpu::ParallelFor(q_heads, threads, [&](int64_t head) {
          const int h = static_cast<int>(head);
          const int kv_head = KvHeadOf(h, q_heads, kv_heads);
          const int32_t* ids = pinned_ids.data() + int64_t{h} * n;
          const int size = pinned_sizes.data()[h];
          std::vector<int32_t>& cand = candidates[h];
          cand.resize(size);
          for (int j = 0; j < size; ++j) cand[j] = sinks + ids[j];
          scores[h].resize(size);
          auto phase = Clock::now();
          cpu::ScoreTokens(q + int64_t{h} * d, kv, kv_head, cand, scale, scores[h].data());
          phase_score[h] = MicrosSince(phase);
          phase = Clock::now();
          cpu::TopKPositions(scores[h], k, &positions[h]);
          support[h].resize(positions[h].size());
          support_scores[h].resize(positions[h].size());
          for (size_t i = 0; i < positions[h].size(); ++i) {
            support[h][i] = cand[positions[h][i]];
            support_scores[h][i] = scores[h][positions[h][i]];
          }
          phase_topk[h] = MicrosSince(phase);
          phase = Clock::now();
          cpu::PartialAttentionScored(support_scores[h], kv, kv_head, support[h],
                                      o.data() + int64_t{h} * d, &lse[h]);
          phase_attend[h] = MicrosSince(phase);
          head_scored[h] = size;
        });
        const double host_us = MicrosSince(start);
        if (record) {
          v.gpu_us.push_back(gpu_us);
          v.host_us.push_back(host_us);
          v.total_us.push_back(gpu_us + host_us);
          for (int h = 0; h < q_heads; ++h) {
            score_recall(v, h, support[h]);
            v.score_us.push_back(phase_score[h]);
            v.topk_us.push_back(phase_topk[h]);
            v.attend_us.push_back(phase_attend[h]);
          }
        }
      }
      if (record) {
        for (int h = 0; h < q_heads; ++h) scored += head_scored[h];
        v.keys_scored.push_back(static_cast<double>(scored) / q_heads);
      }
    }
    // The step's token leaves the ring into the bulk (the graph links it; untimed).
    if (graph != nullptr) graph->OnAppend(store.Tokens(0, tokens));
  }
  for (cudaEvent_t e : events) cudaEventDestroy(e);
  for (cudaEvent_t e : repeat_events) cudaEventDestroy(e);
  cudaStreamDestroy(stream);

  for (const Variant& v : variants) {
    nlohmann::json j = {{"total_us", Percentiles(v.total_us)},
                        {"host_us", Percentiles(v.host_us)},
                        {"keys_scored_per_head", Percentiles(v.keys_scored)},
                        {"recall_at_k", Percentiles(v.recall)},
                        {"mass_of_exact_topk", Percentiles(v.mass)}};
    if (v.shortlist > 0) {
      j["gpu_us"] = Percentiles(v.gpu_us);
      j["gpu_kernels_us"] = Percentiles(v.kernels_us);
      if (!v.repeat_us.empty()) j["gpu_kernels_repeat_us"] = Percentiles(v.repeat_us);
      char fnv[17];
      std::snprintf(fnv, sizeof(fnv), "%016llx", static_cast<unsigned long long>(v.ids_fnv));
      j["ids_fnv"] = fnv;
      if (repeats > 0) j["ids_repeat_mismatches"] = v.repeat_mismatches;
      j["gpu_select_alone_us"] = Percentiles(v.select_us);
      j["head_score_us"] = Percentiles(v.score_us);
      j["head_topk_us"] = Percentiles(v.topk_us);
      j["head_attend_us"] = Percentiles(v.attend_us);
    }
    out["variants"][v.name] = j;
  }
  std::printf("%s\n", out.dump().c_str());
  return absl::OkStatus();
}

}  // namespace
}  // namespace kvrecall

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  if (absl::Status s = kvrecall::Run(); !s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
