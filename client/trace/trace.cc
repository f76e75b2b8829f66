#include "client/trace/trace.h"

#include <algorithm>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "proto/tensor_codec.h"

namespace kvrecall {
namespace {

constexpr TracePhase kPhases[] = {TracePhase::kPrefill, TracePhase::kDecode};
constexpr TraceTensor kTensors[] = {TraceTensor::kQ, TraceTensor::kK, TraceTensor::kV};

absl::Status CheckGeometry(const TraceGeometry& g, absl::string_view where) {
  auto invalid = [&](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": ", parts...));
  };
  if (g.layers < 1 || g.layers > kMaxTraceLayers) {
    return invalid("layers must be in [1, ", kMaxTraceLayers, "], got ", g.layers);
  }
  if (g.q_heads < 1 || g.kv_heads < 1 || g.q_heads % g.kv_heads != 0) {
    return invalid("kv_heads (", g.kv_heads, ") must be >= 1 and divide q_heads (", g.q_heads, ")");
  }
  if (g.head_dim < 1) return invalid("head_dim must be >= 1, got ", g.head_dim);
  if (g.context < 1) return invalid("context must be >= 1 token, got ", g.context);
  if (g.decode_steps < 0) return invalid("decode steps must be >= 0, got ", g.decode_steps);
  if (SafetensorsDTypeName(g.dtype) == nullptr) {
    return invalid("dtype must be bf16, f16 or f32, got ", DTypeName(g.dtype));
  }
  return absl::OkStatus();
}

// The layer of a tensor named "layer{l}.{prefill|decode}.{q|k|v}"; -1 for any other name.
int TraceTensorLayer(absl::string_view name) {
  if (!absl::ConsumePrefix(&name, "layer")) return -1;
  const size_t dot = name.find('.');
  int layer = 0;
  if (dot == absl::string_view::npos ||
      name.substr(0, dot).find_first_not_of("0123456789") != absl::string_view::npos ||
      !absl::SimpleAtoi(name.substr(0, dot), &layer)) {
    return -1;
  }
  for (TracePhase phase : kPhases) {
    for (TraceTensor which : kTensors) {
      if (TraceTensorName(layer, phase, which) == absl::StrCat("layer", name)) return layer;
    }
  }
  return -1;
}

}  // namespace

std::string TraceTensorName(int layer, TracePhase phase, TraceTensor tensor) {
  const char* phase_name = phase == TracePhase::kPrefill ? "prefill" : "decode";
  const char* tensor_name = tensor == TraceTensor::kQ ? "q" : tensor == TraceTensor::kK ? "k" : "v";
  return absl::StrCat("layer", layer, ".", phase_name, ".", tensor_name);
}

absl::StatusOr<Trace> Trace::Open(const std::string& path) {
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
  if (!file.ok()) return file.status();
  return FromFile(*std::move(file));
}

absl::StatusOr<Trace> Trace::FromFile(SafetensorsFile file) {
  Trace trace(std::move(file));
  if (absl::Status s = trace.Validate(); !s.ok()) return s;
  return trace;
}

absl::Status Trace::Validate() {
  auto invalid = [&](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat(file_.label(), ": ", parts...));
  };
  int layers = 0;
  for (const auto& [name, tensor] : file_.tensors()) {
    const int layer = TraceTensorLayer(name);
    if (layer >= kMaxTraceLayers) {
      return invalid("tensor '", name, "' is of layer ", layer, ": a trace has at most ",
                     kMaxTraceLayers, " layers (the service's limit)");
    }
    layers = std::max(layers, layer + 1);
  }
  if (layers == 0) return invalid("no layer0.* tensors: not a kvrecall trace");
  auto find_rank3 = [&](const std::string& name) -> absl::StatusOr<const SafetensorsTensor*> {
    absl::StatusOr<const SafetensorsTensor*> t = file_.Find(name);
    if (!t.ok()) {
      return invalid("tensor '", name, "' is missing (the trace has ", layers, " layers)");
    }
    if ((*t)->shape.size() != 3) {
      return invalid("tensor '", name, "' has rank ", (*t)->shape.size(),
                     ", want 3 ([tokens, heads, head_dim])");
    }
    return t;
  };
  // The geometry comes from layer 0; every tensor is then checked against it.
  TraceGeometry& g = geometry_;
  g.layers = layers;
  absl::StatusOr<const SafetensorsTensor*> prefill_q =
      find_rank3(TraceTensorName(0, TracePhase::kPrefill, TraceTensor::kQ));
  absl::StatusOr<const SafetensorsTensor*> prefill_k =
      find_rank3(TraceTensorName(0, TracePhase::kPrefill, TraceTensor::kK));
  absl::StatusOr<const SafetensorsTensor*> decode_q =
      find_rank3(TraceTensorName(0, TracePhase::kDecode, TraceTensor::kQ));
  for (const auto* t : {&prefill_q, &prefill_k, &decode_q}) {
    if (!t->ok()) return t->status();
  }
  g.dtype = (*prefill_q)->dtype;
  g.context = (*prefill_q)->shape[0];
  g.q_heads = static_cast<int>((*prefill_q)->shape[1]);
  g.head_dim = static_cast<int>((*prefill_q)->shape[2]);
  g.kv_heads = static_cast<int>((*prefill_k)->shape[1]);
  g.decode_steps = (*decode_q)->shape[0];
  for (int l = 0; l < layers; ++l) {
    for (TracePhase phase : kPhases) {
      for (TraceTensor which : kTensors) {
        const std::string name = TraceTensorName(l, phase, which);
        absl::StatusOr<const SafetensorsTensor*> t = find_rank3(name);
        if (!t.ok()) return t.status();
        if ((*t)->dtype != g.dtype) {
          return invalid("tensor '", name, "' is ", DTypeName((*t)->dtype), " but '",
                         (*prefill_q)->name, "' is ", DTypeName(g.dtype),
                         ": a trace holds one dtype");
        }
        const std::vector<int64_t>& shape = (*t)->shape;
        const int64_t want[3] = {phase == TracePhase::kPrefill ? g.context : g.decode_steps,
                                 g.heads(which), g.head_dim};
        if (shape[0] != want[0] || shape[1] != want[1] || shape[2] != want[2]) {
          return invalid("tensor '", name, "' has shape [", absl::StrJoin(shape, ", "), "], want [",
                         absl::StrJoin(want, ", "), "] (T=", g.context, ", N=", g.decode_steps,
                         ", q_heads=", g.q_heads, ", kv_heads=", g.kv_heads,
                         ", head_dim=", g.head_dim, " from layer 0)");
        }
      }
    }
  }
  if (absl::Status s = CheckGeometry(g, file_.label()); !s.ok()) return s;
  const std::pair<const char*, int64_t> declared[] = {
      {"layers", g.layers},     {"q_heads", g.q_heads}, {"kv_heads", g.kv_heads},
      {"head_dim", g.head_dim}, {"context", g.context}, {"decode", g.decode_steps}};
  for (const auto& [key, actual] : declared) {
    const auto it = file_.metadata().find(key);
    if (it == file_.metadata().end()) continue;
    int64_t value = 0;
    if (!absl::SimpleAtoi(it->second, &value) || value != actual) {
      return invalid("__metadata__.", key, " is \"", it->second, "\" but the tensors say ", actual);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<float>> Trace::Read(int layer, TracePhase phase,
                                               TraceTensor tensor) const {
  if (layer < 0 || layer >= geometry_.layers) {
    return absl::OutOfRangeError(
        absl::StrCat(file_.label(), ": layer ", layer, " of ", geometry_.layers));
  }
  return file_.ReadF32(TraceTensorName(layer, phase, tensor));
}

absl::Status Trace::ReadRows(int layer, TracePhase phase, TraceTensor tensor, int64_t row_begin,
                             int64_t rows, float* out) const {
  if (layer < 0 || layer >= geometry_.layers) {
    return absl::OutOfRangeError(
        absl::StrCat(file_.label(), ": layer ", layer, " of ", geometry_.layers));
  }
  return file_.ReadRows(TraceTensorName(layer, phase, tensor), row_begin, rows, out);
}

std::vector<SafetensorsTensorSpec> TraceTensorSpecs(const TraceGeometry& g) {
  std::vector<SafetensorsTensorSpec> specs;
  for (int l = 0; l < g.layers; ++l) {
    for (TracePhase phase : kPhases) {
      const int64_t rows = phase == TracePhase::kPrefill ? g.context : g.decode_steps;
      for (TraceTensor which : kTensors) {
        specs.push_back(
            {TraceTensorName(l, phase, which), g.dtype, {rows, g.heads(which), g.head_dim}});
      }
    }
  }
  return specs;
}

std::map<std::string, std::string> TraceMetadata(const TraceGeometry& g,
                                                 std::map<std::string, std::string> metadata) {
  metadata["layers"] = absl::StrCat(g.layers);
  metadata["q_heads"] = absl::StrCat(g.q_heads);
  metadata["kv_heads"] = absl::StrCat(g.kv_heads);
  metadata["head_dim"] = absl::StrCat(g.head_dim);
  metadata["context"] = absl::StrCat(g.context);
  metadata["decode"] = absl::StrCat(g.decode_steps);
  return metadata;
}

absl::StatusOr<std::unique_ptr<SafetensorsWriter>> CreateTraceWriter(
    const std::string& path, const TraceGeometry& geometry,
    std::map<std::string, std::string> metadata) {
  if (absl::Status s = CheckGeometry(geometry, path); !s.ok()) return s;
  return SafetensorsWriter::Create(path, TraceTensorSpecs(geometry),
                                   TraceMetadata(geometry, std::move(metadata)));
}

}  // namespace kvrecall
