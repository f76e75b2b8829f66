// `kvrecall bench-index --trace FILE [--k 100] [--lists 100,200,...] [--json]`: the index
// benchmark of issue 4. Per layer and query head it indexes the trace's prefill keys (the bulk
// [--sinks, T - --recent) as the index selector would; everything by default) with the query-
// aware graph (built from the head's prefill queries by the index selector, as the server
// builds a layer), hnswlib (keys only, one per KV head) and the flat scan, searches with the
// trace's decode queries, and prints, per method, recall@k against the exact top-k over the
// same keys and the fraction of keys scored, as a curve over the search-list size, plus build
// time per layer (the graph's split into its steps), page faults and memory. Figures are
// averaged over layers, heads and decode steps.
#include <omp.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "client/cli/common.h"
#include "client/cli/subcommands.h"
#include "client/kvrecall_client.h"
#include "client/trace/trace.h"
#include "index/flat_index.h"
#include "index/graph_index.h"
#include "index/hnsw_index.h"
#include "index/index_selector.h"
#include "index/selector_params.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/mapped_memory.h"
#include "kernels/dtype.h"
#include "kernels/fidelity.h"
#include "proto/tensor_codec.h"
#include "nlohmann/json.hpp"

#ifdef KVRECALL_WITH_CUDA
#include "index/gpu_batch_topk.h"
#endif

// Shared with replay and the policy flags.
ABSL_DECLARE_FLAG(std::string, trace);
ABSL_DECLARE_FLAG(int32_t, k);
ABSL_DECLARE_FLAG(int32_t, sinks);
ABSL_DECLARE_FLAG(int32_t, recent);
ABSL_DECLARE_FLAG(int32_t, build_queries);
ABSL_DECLARE_FLAG(int32_t, search_width);
ABSL_DECLARE_FLAG(int32_t, build_topk);
ABSL_DECLARE_FLAG(int32_t, max_degree);
ABSL_DECLARE_FLAG(std::string, graph_scope);

ABSL_FLAG(std::string, lists, "100,150,200,300,500,800,1200",
          "bench-index: search-list sizes of the recall curve (graph list, hnsw ef)");
ABSL_FLAG(std::string, methods, "graph,hnsw,flat", "bench-index: methods to measure");
ABSL_FLAG(std::string, index_layers, "", "bench-index: layers to measure, e.g. 0,3 (empty: all)");
ABSL_FLAG(int32_t, hnsw_m, 16, "bench-index: hnswlib M");
ABSL_FLAG(int32_t, hnsw_ef_construction, 200, "bench-index: hnswlib ef_construction");
ABSL_FLAG(std::string, keys, "f32",
          "bench-index: how the keys are held while indexed and searched: f32 (widened to f32, "
          "in ordinary memory) or served (in the trace's dtype, in memory mapped as kvrecalld's "
          "KV store maps its rows: huge pages where the kernel offers them)");
ABSL_FLAG(std::string, graph_topk, "cpu",
          "bench-index: where the graph build's exact top-k lists are computed: cpu (OpenBLAS) "
          "or gpu (cuBLAS; needs a CUDA build and a device)");

namespace kvrecall::cli {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// The process's minor page faults so far: a build's fresh memory faults in on first touch, at
// microseconds a page in a VM.
int64_t MinorPageFaults() {
  rusage usage;
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_minflt;
}

// What the GPU batch top-k's calls did (the JSON's "graph_topk_gpu").
struct GpuTopKReport {
#ifdef KVRECALL_WITH_CUDA
  std::shared_ptr<GpuBatchTopKStats> stats = std::make_shared<GpuBatchTopKStats>();
#endif
  nlohmann::json ToJson() const {
#ifdef KVRECALL_WITH_CUDA
    return {{"calls", stats->calls},
            {"seconds", stats->seconds},
            {"gemm_calls", {{"bf16", stats->bf16_calls},
                            {"f16", stats->f16_calls},
                            {"f32", stats->f32_calls}}}};
#else
    return nullptr;
#endif
  }
};

// The graph build's batch top-k for --graph_topk.
absl::StatusOr<BatchTopKFunction> MakeGraphTopK(const std::string& where,
                                                const GpuTopKReport& report) {
  if (where == "cpu") return BatchTopKFunction(CpuBatchTopK);
  if (where != "gpu") {
    return absl::InvalidArgumentError(
        absl::StrCat("--graph_topk must be cpu or gpu, got '", where, "'"));
  }
#ifdef KVRECALL_WITH_CUDA
  return MakeGpuBatchTopKFunction(report.stats);
#else
  return absl::FailedPreconditionError(
      "--graph_topk=gpu: this kvrecall was built without CUDA (KVRECALL_WITH_CUDA=OFF)");
#endif
}

// --sinks / --recent as the tokens bench-index leaves out of the index: their -1 (unset, the
// server's default for the other commands) leaves none out, as 0 does.
int ExcludedTokens(int flag) { return flag == -1 ? 0 : flag; }

// --graph_scope (the policy flag's names) as the selector's knob.
absl::StatusOr<GraphScope> GraphScopeFromFlag() {
  const std::string name = absl::GetFlag(FLAGS_graph_scope);
  if (name.empty()) return GraphScope::kDefault;
  absl::StatusOr<v1::GraphScope> parsed = client::ParseGraphScope(name);
  if (!parsed.ok()) return parsed.status();
  return *parsed == v1::GRAPH_SCOPE_KV_HEAD ? GraphScope::kKvHead : GraphScope::kQueryHead;
}

absl::StatusOr<std::vector<int>> ParseInts(const std::string& flag, const std::string& text) {
  std::vector<int> out;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    int value;
    if (!absl::SimpleAtoi(part, &value) || value < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag, " takes non-negative integers separated by commas, got '",
                       text, "'"));
    }
    out.push_back(value);
  }
  return out;
}

// One curve point summed over (layer, head, step) samples.
struct PointSums {
  double recall = 0, scanned = 0, hops = 0, seconds = 0;
  int64_t samples = 0;
};

struct MethodSums {
  std::vector<PointSums> points;
  double build_seconds = 0;
  std::vector<double> build_seconds_by_layer;  // the first includes the GPU's first allocations
  int64_t build_faults = 0;                    // minor page faults while building
  int64_t memory_bytes = 0;
  int64_t indexes = 0;  // built (a graph shared by query heads counts once)
  GraphBuildStats graph_stats;  // summed, graph only
};

// The data of one layer, as f32, and the keys as the index reads them (--keys).
struct LayerData {
  std::vector<float> prefill_q, prefill_k, decode_q;
  cpu::MappedVector<uint16_t> served_k;  // --keys=served of a 16-bit trace
};

class IndexBench {
 public:
  IndexBench(const Trace& trace, int k, int64_t sinks, int64_t recent, std::vector<int> lists,
             bool served_keys)
      : trace_(trace),
        g_(trace.geometry()),
        k_(k),
        lists_(std::move(lists)),
        served_keys_(served_keys) {
    key_begin_ = std::min<int64_t>(sinks, g_.context);
    key_end_ = std::max<int64_t>(key_begin_, g_.context - recent);
  }

  int64_t keys() const { return key_end_ - key_begin_; }

  absl::Status RunLayer(int layer, const std::vector<std::string>& methods,
                        const GraphIndexParams& graph_params, const HnswParams& hnsw_params,
                        const BatchTopKFunction& graph_topk) {
    LayerData data;
    for (auto [phase, tensor, out] :
         {std::tuple{TracePhase::kPrefill, TraceTensor::kQ, &data.prefill_q},
          std::tuple{TracePhase::kPrefill, TraceTensor::kK, &data.prefill_k},
          std::tuple{TracePhase::kDecode, TraceTensor::kQ, &data.decode_q}}) {
      absl::StatusOr<std::vector<float>> read = trace_.Read(layer, phase, tensor);
      if (!read.ok()) return read.status();
      // As the service refuses them: a NaN key scored as nothing and a NaN query found every
      // list "exact", so recall read 1.0 (probe 21, 6).
      if (const int64_t i = FirstOutOfRange(*read); i >= 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "layer ", layer, " ", phase == TracePhase::kPrefill ? "prefill" : "decode", " ",
            tensor == TraceTensor::kQ ? "q" : "k", " holds ", (*read)[i], " at element ", i,
            ": the service takes finite values within +-", kMaxTensorMagnitude));
      }
      *out = std::move(*read);
    }
    KvView kv{data.prefill_k.data(), nullptr, g_.context, g_.kv_heads, g_.head_dim};
    if (served_keys_) {
      // The server's KV store holds the prompt's rows in its dtype, in mapped memory: the key
      // reads of a build and a search then cost what they cost there (an f32 trace's keys are
      // copied into mapped memory as they are).
      const KvElement element = KvElementOf(g_.dtype);
      data.served_k.resize(data.prefill_k.size() * KvElementBytes(element) / 2);
      if (element == KvElement::kF32) {
        std::memcpy(data.served_k.data(), data.prefill_k.data(), data.prefill_k.size() * 4);
      } else {
        for (size_t i = 0; i < data.prefill_k.size(); ++i) {
          data.served_k[i] = element == KvElement::kBf16 ? FloatToBf16(data.prefill_k[i])
                                                         : FloatToF16(data.prefill_k[i]);
        }
      }
      data.prefill_k = std::vector<float>();
      kv = KvView{data.served_k.data(), nullptr, g_.context, g_.kv_heads, g_.head_dim, element};
    }
    const int64_t q_stride = static_cast<int64_t>(g_.q_heads) * g_.head_dim;
    const int group = g_.q_heads / g_.kv_heads;

    // Ground truth: the exact top-k of every (head, step) over the same keys.
    std::vector<std::vector<int32_t>> exact(g_.q_heads * g_.decode_steps);
#pragma omp parallel for schedule(dynamic, 4)
    for (int64_t i = 0; i < static_cast<int64_t>(exact.size()); ++i) {
      const int h = static_cast<int>(i / g_.decode_steps);
      const int64_t step = i % g_.decode_steps;
      const VectorSet keys = KeySet(kv, h / group);
      cpu::ExactTopK(data.decode_q.data() + step * q_stride + h * g_.head_dim,
                     keys.AsKeyView(), 0, 1.0f, k_, &exact[i]);
    }

    for (const std::string& method : methods) {
      // The graph: the index selector's build over the layer, as the server builds it (a KV
      // head's query heads' top-k lists in one batch top-k, graphs side by side), one graph per
      // query head or per KV head (graph_params.graph_scope); each query head searches its
      // own. Query-agnostic indexes are built once per KV head and shared by its query heads,
      // side by side, each by a share of the threads.
      const bool per_kv_head = method != "graph";
      const int index_count = per_kv_head ? g_.kv_heads : g_.q_heads;
      std::vector<const KeyIndex*> built_indexes;  // each once
      std::unique_ptr<IndexSelector> selector;
      std::vector<std::unique_ptr<KeyIndex>> owned(index_count);
      std::vector<const KeyIndex*> indexes(index_count);
      std::vector<absl::Status> built(index_count);
      const int64_t faults_before = MinorPageFaults();
      const Clock::time_point build_start = Clock::now();
      if (method == "graph") {
        SelectorParams params;
        params.kind = SelectorKind::kIndex;
        params.sinks = static_cast<int>(key_begin_);
        params.recent = static_cast<int>(g_.context - key_end_);
        params.index = graph_params;
        selector = std::make_unique<IndexSelector>(
            LayerShape{g_.q_heads, g_.kv_heads, g_.head_dim, 1.0f}, params, /*bulk_only=*/true,
            graph_topk);
        built[0] = selector->Build(kv, data.prefill_q.data());
        for (int h = 0; h < index_count; ++h) indexes[h] = &selector->head_index(h);
        for (int i = 0; i < selector->graph_count(); ++i) {
          built_indexes.push_back(&selector->graph(i));
        }
      } else {
        const int side_by_side = std::min(index_count, omp_get_max_threads());
        const int threads_each = std::max(1, omp_get_max_threads() / side_by_side);
        const int saved_levels = omp_get_max_active_levels();
        omp_set_max_active_levels(2);
#pragma omp parallel for schedule(dynamic, 1) num_threads(side_by_side)
        for (int i = 0; i < index_count; ++i) {
          omp_set_num_threads(threads_each);
          if (method == "hnsw") {
            owned[i] = std::make_unique<HnswIndex>(hnsw_params);
          } else {
            owned[i] = std::make_unique<FlatIndex>();
          }
          built[i] = owned[i]->Build(KeySet(kv, i), BuildQueries());
          indexes[i] = owned[i].get();
        }
        omp_set_max_active_levels(saved_levels);
        built_indexes = indexes;
      }
      const double build_seconds = SecondsSince(build_start);
      const int64_t build_faults = MinorPageFaults() - faults_before;
      for (const absl::Status& s : built) {
        if (!s.ok()) return s;
      }
      MethodSums& sums = sums_[method];
      sums.build_seconds += build_seconds;
      sums.build_seconds_by_layer.push_back(build_seconds);
      sums.build_faults += build_faults;
      for (const KeyIndex* index : built_indexes) {
        sums.memory_bytes += index->MemoryBytes();
        ++sums.indexes;
        if (method == "graph") {
          sums.graph_stats += static_cast<const GraphIndex&>(*index).build_stats();
        }
      }

      const std::vector<int> flat_lists = {0};
      const std::vector<int>& lists = method == "flat" ? flat_lists : lists_;
      sums.points.resize(lists.size());
      for (size_t p = 0; p < lists.size(); ++p) {
        double recall = 0, scanned = 0, hops = 0, seconds = 0;
#pragma omp parallel reduction(+ : recall, scanned, hops, seconds)
        {
          std::vector<uint8_t> marks;
          SearchResult result;
#pragma omp for schedule(dynamic, 4)
          for (int64_t i = 0; i < static_cast<int64_t>(exact.size()); ++i) {
            const int h = static_cast<int>(i / g_.decode_steps);
            const int64_t step = i % g_.decode_steps;
            const int kv_head = h / group;
            const KeyIndex& index = *indexes[per_kv_head ? kv_head : h];
            const Clock::time_point start = Clock::now();
            index.Search(KeySet(kv, kv_head),
                         data.decode_q.data() + step * q_stride + h * g_.head_dim, k_,
                         SearchParams{lists[p]}, &result);
            seconds += SecondsSince(start);
            recall += SupportRecall(result.ids, exact[i], keys(), &marks);
            scanned += static_cast<double>(result.stats.scored) / keys();
            hops += static_cast<double>(result.stats.hops);
          }
        }
        PointSums& total = sums.points[p];
        total.recall += recall;
        total.scanned += scanned;
        total.hops += hops;
        total.seconds += seconds;
        total.samples += static_cast<int64_t>(exact.size());
      }
      sums_lists_[method] = lists;
    }
    ++layers_;
    return absl::OkStatus();
  }

  nlohmann::json Report(const std::vector<std::string>& methods) const {
    nlohmann::json out;
    for (const std::string& method : methods) {
      const MethodSums& sums = sums_.at(method);
      const std::vector<int>& lists = sums_lists_.at(method);
      nlohmann::json points = nlohmann::json::array();
      for (size_t p = 0; p < lists.size(); ++p) {
        const PointSums& s = sums.points[p];
        points.push_back({{"list_size", lists[p]},
                          {"recall", s.recall / s.samples},
                          {"scanned_fraction", s.scanned / s.samples},
                          {"hops", s.hops / s.samples},
                          {"search_microseconds", 1e6 * s.seconds / s.samples}});
      }
      nlohmann::json m = {{"points", points},
                          {"build_seconds", sums.build_seconds},
                          {"build_seconds_per_layer", sums.build_seconds / layers_},
                          {"build_seconds_by_layer", sums.build_seconds_by_layer},
                          {"build_page_faults_per_layer", sums.build_faults / layers_},
                          {"memory_bytes", sums.memory_bytes},
                          {"memory_bytes_per_layer", sums.memory_bytes / layers_},
                          {"indexes", sums.indexes}};
      if (method == "graph") {
        const GraphBuildStats& s = sums.graph_stats;
        const double n = static_cast<double>(sums.indexes);
        m["graph"] = {{"build_queries_per_index", s.build_queries / n},
                      {"covered_key_fraction", s.covered_keys / n / keys()},
                      {"repaired_keys_per_index", s.repaired_keys / n},
                      {"unreachable_keys", s.unreachable_keys},
                      {"average_degree", s.average_degree / n},
                      // Per index: the indexes of a layer build side by side, so these
                      // add up to more than the layer's wall time (build_seconds_per_layer).
                      {"topk_seconds_per_index", s.topk_seconds / n},
                      {"graph_seconds_per_index", s.graph_seconds / n},
                      {"graph_steps_seconds_per_index",
                       {{"key_copy", s.key_copy_seconds / n},
                        {"projection", s.projection_seconds / n},
                        {"reverse_edges", s.reverse_seconds / n},
                        {"entry_and_mean", s.entry_seconds / n},
                        {"outliers", s.outlier_seconds / n},
                        {"repair", s.repair_seconds / n}}},
                      {"pruning_distances_per_index", s.pruning_distances / n}};
      }
      out[method] = m;
    }
    return out;
  }

 private:
  VectorSet KeySet(const KvView& kv, int kv_head) const {
    return VectorSet::KeysOf(kv, kv_head, key_begin_, key_end_);
  }

  const Trace& trace_;
  TraceGeometry g_;
  int k_;
  std::vector<int> lists_;
  bool served_keys_;
  int64_t key_begin_ = 0;
  int64_t key_end_ = 0;
  int layers_ = 0;
  std::map<std::string, MethodSums> sums_;
  std::map<std::string, std::vector<int>> sums_lists_;
};

}  // namespace

int RunBenchIndex(const std::vector<char*>& args) {
  if (!args.empty()) return UsageError("bench-index", "takes no arguments, only flags");
  const std::string path = absl::GetFlag(FLAGS_trace);
  if (path.empty()) return UsageError("bench-index", "--trace FILE is required");
  if (absl::GetFlag(FLAGS_k) < 0) {
    return UsageError("bench-index", absl::StrCat("--k must be >= 0 (0: 100), got ",
                                                  absl::GetFlag(FLAGS_k)));
  }
  const int k = absl::GetFlag(FLAGS_k) > 0 ? absl::GetFlag(FLAGS_k) : 100;
  absl::StatusOr<std::vector<int>> lists = ParseInts("lists", absl::GetFlag(FLAGS_lists));
  if (!lists.ok()) return UsageError("bench-index", lists.status().message());
  for (const int list : *lists) {
    if (list < 1) {  // a list of 0 would search with the method's own default, mislabelled
      return UsageError("bench-index", absl::StrCat("--lists must be >= 1 each, got ", list));
    }
  }
  struct CountFlag {
    const char* name;
    int value;
    const char* zero;  // what 0 means
  };
  for (const CountFlag& flag :
       {CountFlag{"--sinks", ExcludedTokens(absl::GetFlag(FLAGS_sinks)), "none left out"},
        CountFlag{"--recent", ExcludedTokens(absl::GetFlag(FLAGS_recent)), "none left out"},
        CountFlag{"--build_queries", absl::GetFlag(FLAGS_build_queries), "the default"},
        CountFlag{"--search_width", absl::GetFlag(FLAGS_search_width), "the default"},
        CountFlag{"--build_topk", absl::GetFlag(FLAGS_build_topk), "the default"},
        CountFlag{"--max_degree", absl::GetFlag(FLAGS_max_degree), "the default"}}) {
    if (flag.value < 0) {
      return UsageError("bench-index", absl::StrCat(flag.name, " must be >= 0 (0: ", flag.zero,
                                                    "), got ", flag.value));
    }
  }
  if (absl::GetFlag(FLAGS_hnsw_m) < 2 || absl::GetFlag(FLAGS_hnsw_ef_construction) < 1) {
    return UsageError("bench-index",
                      absl::StrCat("--hnsw_m must be >= 2 and --hnsw_ef_construction >= 1, got ",
                                   absl::GetFlag(FLAGS_hnsw_m), " and ",
                                   absl::GetFlag(FLAGS_hnsw_ef_construction)));
  }
  std::vector<std::string> methods = absl::StrSplit(absl::GetFlag(FLAGS_methods), ',',
                                                    absl::SkipEmpty());
  for (const std::string& m : methods) {
    if (m != "graph" && m != "hnsw" && m != "flat") {
      return UsageError("bench-index", absl::StrCat("--methods: unknown method '", m,
                                                    "' (graph, hnsw, flat)"));
    }
  }
  absl::StatusOr<Trace> trace = Trace::Open(path);
  if (!trace.ok()) return ReportError("bench-index", trace.status());
  const TraceGeometry& g = trace->geometry();
  std::vector<int> layers;
  if (absl::GetFlag(FLAGS_index_layers).empty()) {
    for (int l = 0; l < g.layers; ++l) layers.push_back(l);
  } else {
    absl::StatusOr<std::vector<int>> chosen =
        ParseInts("index_layers", absl::GetFlag(FLAGS_index_layers));
    if (!chosen.ok()) return UsageError("bench-index", chosen.status().message());
    layers = *chosen;
    for (int l : layers) {
      if (l >= g.layers) {  // ParseInts refuses negatives
        return UsageError("bench-index", absl::StrCat("--index_layers: the trace has ",
                                                      g.layers, " layers, got ", l));
      }
    }
  }
  if (g.decode_steps == 0) return UsageError("bench-index", "the trace has no decode steps");

  GraphIndexParams graph_params;
  graph_params.build_queries = absl::GetFlag(FLAGS_build_queries);
  graph_params.search_width = absl::GetFlag(FLAGS_search_width);
  graph_params.build_topk = absl::GetFlag(FLAGS_build_topk);
  graph_params.max_degree = absl::GetFlag(FLAGS_max_degree);
  absl::StatusOr<GraphScope> scope = GraphScopeFromFlag();
  if (!scope.ok()) return UsageError("bench-index", scope.status().message());
  graph_params.graph_scope = *scope;
  // The service's bounds on K and the graph's knobs (their upper bounds: the lower ones are
  // checked above, by flag name).
  SelectorParams as_policy;
  as_policy.kind = SelectorKind::kIndex;
  as_policy.top_k = k;
  as_policy.index = graph_params;
  if (absl::Status s = as_policy.Validate(); !s.ok()) {
    return UsageError("bench-index", s.message());
  }
  graph_params = graph_params.WithDefaults();
  HnswParams hnsw_params;
  hnsw_params.m = absl::GetFlag(FLAGS_hnsw_m);
  hnsw_params.ef_construction = absl::GetFlag(FLAGS_hnsw_ef_construction);

  const GpuTopKReport gpu_topk;
  absl::StatusOr<BatchTopKFunction> graph_topk =
      MakeGraphTopK(absl::GetFlag(FLAGS_graph_topk), gpu_topk);
  if (!graph_topk.ok()) return ReportError("bench-index", graph_topk.status());

  const std::string keys = absl::GetFlag(FLAGS_keys);
  if (keys != "f32" && keys != "served") {
    return UsageError("bench-index",
                      absl::StrCat("--keys must be f32 or served, got '", keys, "'"));
  }
  IndexBench bench(*trace, k, ExcludedTokens(absl::GetFlag(FLAGS_sinks)),
                   ExcludedTokens(absl::GetFlag(FLAGS_recent)), *lists, keys == "served");
  if (bench.keys() < k) {
    return UsageError("bench-index", absl::StrCat("only ", bench.keys(), " keys to index for k=", k));
  }
  TerminalProgress progress;
  for (size_t i = 0; i < layers.size(); ++i) {
    progress.Update("bench-index", static_cast<double>(i) / layers.size(),
                    absl::StrFormat("layer %d", layers[i]));
    if (absl::Status s = bench.RunLayer(layers[i], methods, graph_params, hnsw_params, *graph_topk); !s.ok()) {
      progress.Done();
      return ReportError("bench-index", s);
    }
  }
  progress.Done();
  const nlohmann::json report = {
      {"trace", path},
      {"k", k},
      {"keys", bench.keys()},
      {"context", g.context},
      {"decode_steps", g.decode_steps},
      {"layers", layers},
      {"q_heads", g.q_heads},
      {"kv_heads", g.kv_heads},
      {"head_dim", g.head_dim},
      {"threads", omp_get_max_threads()},
      {"keys_held", keys},
      {"graph_topk", absl::GetFlag(FLAGS_graph_topk)},
      {"graph_topk_gpu", gpu_topk.ToJson()},
      {"graph_params",
       {{"build_queries", graph_params.build_queries},
        {"search_width", graph_params.WithDefaults().search_width},
        {"build_topk", graph_params.build_topk},
        {"max_degree", graph_params.max_degree},
        {"graph_scope", GraphScopeName(graph_params.graph_scope)}}},
      {"hnsw_params", {{"m", hnsw_params.m}, {"ef_construction", hnsw_params.ef_construction}}},
      {"methods", bench.Report(methods)},
  };
  std::printf("%s\n", report.dump(absl::GetFlag(FLAGS_json) ? -1 : 2).c_str());
  return 0;
}

}  // namespace kvrecall::cli
