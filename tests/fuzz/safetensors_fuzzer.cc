// libFuzzer target over the safetensors reader and the replay-trace validation built on it
// (client/trace/): the input is a whole file. Checked beyond "no crash, no sanitizer report":
// every tensor the reader accepts lies inside the file and reads back in full, and a trace the
// validation accepts reads every tensor of every layer with the shapes its geometry claims.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "client/trace/safetensors.h"
#include "client/trace/trace.h"

namespace {

void Check(bool condition, const char* what) {
  if (!condition) {
    std::fprintf(stderr, "safetensors_fuzzer: invariant violated: %s\n", what);
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using kvrecall::SafetensorsFile;
  absl::StatusOr<SafetensorsFile> file =
      SafetensorsFile::FromBytes(std::string(reinterpret_cast<const char*>(data), size), "fuzz");
  if (!file.ok()) return 0;
  int64_t total = 0;
  for (const auto& [name, tensor] : file->tensors()) {
    Check(tensor.elements >= 0 && tensor.bytes >= 0, "negative size");
    total += tensor.bytes;
    Check(total <= static_cast<int64_t>(size), "tensors larger than the file");
    absl::StatusOr<std::vector<float>> values = file->ReadF32(name);
    Check(values.ok(), "an accepted tensor does not read");
    Check(static_cast<int64_t>(values->size()) == tensor.elements, "a tensor read short");
    if (!tensor.shape.empty() && tensor.shape[0] > 0) {
      std::vector<float> row(tensor.row_elements());
      Check(file->ReadRows(name, tensor.shape[0] - 1, 1, row.data()).ok(), "a last row fails");
      Check(!file->ReadRows(name, tensor.shape[0], 1, row.data()).ok(), "a row past the end reads");
    }
  }
  absl::StatusOr<kvrecall::Trace> trace = kvrecall::Trace::FromFile(*std::move(file));
  if (!trace.ok()) return 0;
  const kvrecall::TraceGeometry& g = trace->geometry();
  for (int l = 0; l < g.layers; ++l) {
    for (auto phase : {kvrecall::TracePhase::kPrefill, kvrecall::TracePhase::kDecode}) {
      const int64_t rows = phase == kvrecall::TracePhase::kPrefill ? g.context : g.decode_steps;
      for (auto t : {kvrecall::TraceTensor::kQ, kvrecall::TraceTensor::kK,
                     kvrecall::TraceTensor::kV}) {
        absl::StatusOr<std::vector<float>> values = trace->Read(l, phase, t);
        Check(values.ok(), "a tensor of an accepted trace does not read");
        Check(static_cast<int64_t>(values->size()) == rows * g.heads(t) * g.head_dim,
              "a trace tensor does not have its geometry's shape");
      }
    }
  }
  return 0;
}
