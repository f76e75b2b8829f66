// Writes the seed corpora of the fuzz targets from real requests and real files:
//   fuzz_seeds OUT_DIR   ->  OUT_DIR/request/*  (request_fuzzer records, tests/fuzz/fuzz_fixture.h)
//                            OUT_DIR/safetensors/*  (trace files as kvrecall writes them)
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <span>
#include <string>
#include <vector>

#include "client/trace/safetensors.h"
#include "client/trace/trace.h"
#include "tests/fuzz/fuzz_fixture.h"

namespace kvrecall::fuzz {
namespace {

// One request_fuzzer record.
void AddRecord(int kind, const std::string& bytes, std::string* out) {
  out->push_back(static_cast<char>(kind));
  out->push_back(static_cast<char>(bytes.size() & 0xff));
  out->push_back(static_cast<char>((bytes.size() >> 8) & 0xff));
  out->append(bytes);
}

void Write(const std::filesystem::path& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

std::string TensorRecord(std::vector<int64_t> row_shape, bool rows_free, v1::DType dtype,
                         const v1::Tensor& t) {
  std::string out(1, static_cast<char>(row_shape.size()));
  for (int64_t d : row_shape) out.push_back(static_cast<char>(d));
  out.push_back(static_cast<char>((rows_free ? 1 : 0) | (static_cast<int>(dtype) << 1)));
  return out + t.SerializeAsString();
}

void WriteRequestSeeds(const std::filesystem::path& dir) {
  const std::vector<FixtureSession> fixture = FixtureSessions();
  const char* names[] = {"a", "b"};
  int n = 0;
  auto seed = [&](const std::string& bytes) {
    Write(dir / ("seed-" + std::to_string(n++)), bytes);
  };
  // Decode steps on each fixture session (every layer), with and without diagnostics, and a
  // batch of both.
  for (int s = 0; s < 2; ++s) {
    std::string records;
    for (int l = 0; l < fixture[s].geometry.layers(); ++l) {
      v1::DecodeRequest request;
      request.set_layer(l);
      request.set_return_lse(true);
      request.set_diagnostics(true);
      request.set_compare_exact(l == 0);
      *request.add_steps() = DecodeStep(names[s], fixture[s].geometry, 7 * l + s);
      AddRecord(3, request.SerializeAsString(), &records);
    }
    seed(records);
  }
  {
    v1::DecodeRequest batch;
    *batch.add_steps() = DecodeStep("a", fixture[0].geometry, 1);
    *batch.add_steps() = DecodeStep("b", fixture[1].geometry, 2);
    std::string records;
    AddRecord(3, batch.SerializeAsString(), &records);
    v1::GetSessionRequest get;
    get.set_session_id("b");
    AddRecord(4, get.SerializeAsString(), &records);
    AddRecord(5, "", &records);
    seed(records);
  }
  // A new session of each selector: created, prefilled in two chunks, committed, decoded.
  for (v1::Selector selector : {v1::SELECTOR_FULL, v1::SELECTOR_EXACT_TOPK, v1::SELECTOR_STREAMING,
                                v1::SELECTOR_INDEX, v1::SELECTOR_RETOPK}) {
    for (v1::DType dtype : {v1::DTYPE_F32, v1::DTYPE_F16, v1::DTYPE_BF16}) {
      v1::CreateSessionRequest create;
      v1::Geometry& g = *create.mutable_geometry();
      g = MakeGeometry(1, 2, 2, 4, dtype);
      v1::Policy& p = *create.mutable_policy();
      p.set_selector(selector);
      p.set_top_k(3);
      p.set_sinks(1);
      p.set_recent(2);
      p.mutable_retopk()->set_cache_capacity(2);
      p.mutable_retopk()->set_reuse_neighbors(1);
      p.mutable_index()->set_build_queries(4);
      p.mutable_index()->set_build_topk(2);
      p.mutable_index()->set_max_degree(4);
      std::string records;
      AddRecord(0, create.SerializeAsString(), &records);
      AddRecord(1, PromptChunk("c", g, 0, 0, 4).SerializeAsString(), &records);
      AddRecord(1, PromptChunk("c", g, 0, 4, 4).SerializeAsString(), &records);
      AddRecord(2, "", &records);
      for (int step = 0; step < 3; ++step) {
        v1::DecodeRequest request;
        request.set_diagnostics(true);
        *request.add_steps() = DecodeStep("c", g, step);
        AddRecord(3, request.SerializeAsString(), &records);
      }
      seed(records);
    }
  }
  // Plain float values, as a JSON client sends them.
  {
    v1::DecodeRequest request;
    v1::SequenceStep* step = request.add_steps();
    *step = DecodeStep("a", fixture[0].geometry, 3);
    for (v1::Tensor* t : {step->mutable_q(), step->mutable_k_new(), step->mutable_v_new()}) {
      const std::vector<int64_t> shape(t->shape().begin(), t->shape().end());
      int64_t count = 1;
      for (int64_t d : shape) count *= d;
      EncodeTensor(Ramp(count, 5), shape, v1::DTYPE_F32, /*as_values=*/true, t);
    }
    std::string records;
    AddRecord(3, request.SerializeAsString(), &records);
    seed(records);
  }
  // The tensor codec alone, in each dtype, raw and as values.
  {
    std::string records;
    for (v1::DType dtype : {v1::DTYPE_F32, v1::DTYPE_F16, v1::DTYPE_BF16}) {
      AddRecord(6, TensorRecord({2, 3}, true, dtype, RampTensor({4, 2, 3}, dtype, 1)), &records);
      AddRecord(6, TensorRecord({2, 3}, false, dtype, RampTensor({2, 3}, dtype, 2)), &records);
    }
    v1::Tensor values;
    EncodeTensor(Ramp(6, 3), std::vector<int64_t>{2, 3}, v1::DTYPE_F32, true, &values);
    AddRecord(6, TensorRecord({2, 3}, false, v1::DTYPE_BF16, values), &records);
    seed(records);
  }
}

void WriteSafetensorsSeeds(const std::filesystem::path& dir) {
  int n = 0;
  for (v1::DType dtype : {v1::DTYPE_BF16, v1::DTYPE_F16, v1::DTYPE_F32}) {
    TraceGeometry g;
    g.layers = 2;
    g.q_heads = 2;
    g.kv_heads = 1;
    g.head_dim = 4;
    g.context = 5;
    g.decode_steps = 2;
    g.dtype = dtype;
    const std::vector<SafetensorsTensorSpec> specs = TraceTensorSpecs(g);
    std::vector<std::vector<float>> data;
    std::vector<std::span<const float>> spans;
    for (const SafetensorsTensorSpec& spec : specs) {
      int64_t count = 1;
      for (int64_t d : spec.shape) count *= d;
      data.push_back(Ramp(count, static_cast<int>(data.size())));
    }
    for (const std::vector<float>& d : data) spans.push_back(d);
    absl::StatusOr<std::string> file =
        SerializeSafetensors(specs, spans, TraceMetadata(g, {{"source", "fuzz_seeds"}}));
    Require(file.status(), "SerializeSafetensors");
    Write(dir / ("trace-" + std::to_string(n++)), *file);
  }
}

}  // namespace
}  // namespace kvrecall::fuzz

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUT_DIR\n", argv[0]);
    return 2;
  }
  const std::filesystem::path out(argv[1]);
  std::filesystem::create_directories(out / "request");
  std::filesystem::create_directories(out / "safetensors");
  kvrecall::fuzz::WriteRequestSeeds(out / "request");
  kvrecall::fuzz::WriteSafetensorsSeeds(out / "safetensors");
  return 0;
}
