// ReTopK's path decisions on a real or synthetic trace, for cuda_decode_bench's mix-weighted
// step: runs the CPU reference selector (index/retopk.h; the GPU step takes the same decisions)
// over every layer's decode steps and writes which path each (layer, step, query head) took.
//
// Output (--out), text:
//   kvrecall-path-pattern v1 layers=L q_heads=Q kv_heads=KV steps=N
//   then L * N lines, layer-major: Q digits each, the SelectionPath of head 0..Q-1 at that step
//   (1 reuse, 2 fallback, 3 refresh).
// stdout: a JSON summary (the path mix, per layer and overall, and the flags).
#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "client/trace/trace.h"
#include "index/retopk.h"
#include "kernels/retopk_params.h"
#include "kernels/selection_path.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, trace, "", "the trace (safetensors, DESIGN.md's replay format)");
ABSL_FLAG(std::string, out, "", "where the pattern goes");
ABSL_FLAG(int, k, 512, "top K");
ABSL_FLAG(int, R, 4, "ReTopK reuse_neighbors");
ABSL_FLAG(double, tau, 0.85, "ReTopK tau (the fallback when --auto_tau calibrates nothing)");
ABSL_FLAG(bool, auto_tau, false, "calibrate tau per head on the prompt");
ABSL_FLAG(double, target_recall, 0.9, "auto_tau's weighted support recall target");

namespace kvrecall {
namespace {

absl::Status Run() {
  const std::string path = absl::GetFlag(FLAGS_trace);
  const std::string out_path = absl::GetFlag(FLAGS_out);
  if (path.empty() || out_path.empty()) {
    return absl::InvalidArgumentError("--trace and --out are required");
  }
  absl::StatusOr<Trace> trace = Trace::Open(path);
  if (!trace.ok()) return trace.status();
  const TraceGeometry& g = trace->geometry();
  ReTopKParams params;
  params.reuse_neighbors = absl::GetFlag(FLAGS_R);
  params.tau = static_cast<float>(absl::GetFlag(FLAGS_tau));
  params.auto_tau = absl::GetFlag(FLAGS_auto_tau);
  params.target_recall = static_cast<float>(absl::GetFlag(FLAGS_target_recall));
  const int top_k = absl::GetFlag(FLAGS_k);
  const LayerShape shape{g.q_heads, g.kv_heads, g.head_dim,
                         1.0f / std::sqrt(static_cast<float>(g.head_dim))};
  std::ofstream out(out_path);
  out << "kvrecall-path-pattern v1 layers=" << g.layers << " q_heads=" << g.q_heads
      << " kv_heads=" << g.kv_heads << " steps=" << g.decode_steps << "\n";
  nlohmann::json layers = nlohmann::json::array();
  int64_t total[kSelectionPaths] = {};
  const int64_t t = g.context;
  const int64_t n = g.decode_steps;
  const int64_t kv_row = static_cast<int64_t>(g.kv_heads) * g.head_dim;
  const int64_t q_row = static_cast<int64_t>(g.q_heads) * g.head_dim;
  for (int layer = 0; layer < g.layers; ++layer) {
    std::vector<float> keys((t + n) * kv_row), values((t + n) * kv_row);
    std::vector<float> prompt_q(t * q_row), decode_q(n * q_row);
    for (auto [tensor, phase, dst, rows, offset] :
         {std::tuple{TraceTensor::kK, TracePhase::kPrefill, keys.data(), t, int64_t{0}},
          std::tuple{TraceTensor::kK, TracePhase::kDecode, keys.data(), n, t},
          std::tuple{TraceTensor::kV, TracePhase::kPrefill, values.data(), t, int64_t{0}},
          std::tuple{TraceTensor::kV, TracePhase::kDecode, values.data(), n, t}}) {
      absl::Status read = trace->ReadRows(layer, phase, tensor, 0, rows, dst + offset * kv_row);
      if (!read.ok()) return read;
    }
    absl::Status read = trace->ReadRows(layer, TracePhase::kPrefill, TraceTensor::kQ, 0, t,
                                        prompt_q.data());
    if (read.ok()) {
      read = trace->ReadRows(layer, TracePhase::kDecode, TraceTensor::kQ, 0, n, decode_q.data());
    }
    if (!read.ok()) return read;
    KvView kv{keys.data(), values.data(), t, g.kv_heads, g.head_dim};
    ReTopKSelector selector(shape, top_k, params);
    absl::Status built = selector.Build(kv, prompt_q.data());
    if (!built.ok()) return built;
    int64_t counts[kSelectionPaths] = {};
    HeadSelection selection;
    for (int64_t s = 0; s < n; ++s) {
      kv.tokens = t + s + 1;
      selector.OnAppend(kv);
      std::string line;
      for (int h = 0; h < g.q_heads; ++h) {
        selector.Select(h, decode_q.data() + s * q_row + h * g.head_dim, kv, &selection);
        const int code = static_cast<int>(selection.path);
        ++counts[code];
        ++total[code];
        line.push_back(static_cast<char>('0' + code));
      }
      out << line << "\n";
    }
    const double heads = static_cast<double>(n) * g.q_heads;
    layers.push_back({{"layer", layer},
                      {"reuse", counts[1] / heads},
                      {"fallback", counts[2] / heads},
                      {"refresh", counts[3] / heads}});
  }
  out.close();
  if (!out) return absl::InternalError(absl::StrCat("cannot write ", out_path));
  const double heads = static_cast<double>(n) * g.q_heads * g.layers;
  const nlohmann::json summary = {
      {"trace", path},
      {"out", out_path},
      {"k", top_k},
      {"retopk",
       {{"C", params.cache_capacity},
        {"R", params.reuse_neighbors},
        {"W", params.recent_window},
        {"tau", params.tau},
        {"refresh", params.refresh_interval},
        {"auto_tau", params.auto_tau},
        {"target_recall", params.target_recall}}},
      {"geometry",
       {{"layers", g.layers},
        {"q_heads", g.q_heads},
        {"kv_heads", g.kv_heads},
        {"head_dim", g.head_dim},
        {"context", t},
        {"steps", n}}},
      {"path_mix",
       {{"reuse", total[1] / heads},
        {"fallback", total[2] / heads},
        {"refresh", total[3] / heads}}},
      {"layers", layers}};
  std::puts(summary.dump().c_str());
  return absl::OkStatus();
}

}  // namespace
}  // namespace kvrecall

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const absl::Status status = kvrecall::Run();
  if (!status.ok()) {
    std::fprintf(stderr, "cuda_path_pattern: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}
