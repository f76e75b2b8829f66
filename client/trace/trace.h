// Replay traces (DESIGN.md's format): per layer, the prompt's post-RoPE q/k/v and the decode
// steps' q/k/v in one safetensors file; reading with validation and writing.
//
// Tensors, for each layer l (all of one dtype: bf16, f16 or f32):
//   layer{l}.prefill.q  [T, q_heads, head_dim]    layer{l}.decode.q  [N, q_heads, head_dim]
//   layer{l}.prefill.k  [T, kv_heads, head_dim]   layer{l}.decode.k  [N, kv_heads, head_dim]
//   layer{l}.prefill.v  [T, kv_heads, head_dim]   layer{l}.decode.v  [N, kv_heads, head_dim]
// T = context (prompt tokens), N = decode steps. `__metadata__` may hold "source" and the
// geometry as decimal strings ("layers", "q_heads", "kv_heads", "head_dim", "context",
// "decode"); when present they must agree with the shapes.
#ifndef KVRECALL_CLIENT_TRACE_TRACE_H_
#define KVRECALL_CLIENT_TRACE_TRACE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/trace/safetensors.h"
#include "kvrecall/v1/kvrecall.pb.h"

namespace kvrecall {

enum class TracePhase { kPrefill, kDecode };
enum class TraceTensor { kQ, kK, kV };

// "layer{layer}.{prefill|decode}.{q|k|v}".
std::string TraceTensorName(int layer, TracePhase phase, TraceTensor tensor);

// The most layers a trace may have: the service's per-session limit (kMaxLayers, which the
// client cannot include), so that a trace is refused here rather than by CreateSession.
inline constexpr int kMaxTraceLayers = 1024;

struct TraceGeometry {
  int layers = 0;
  int q_heads = 0;
  int kv_heads = 0;
  int head_dim = 0;
  int64_t context = 0;       // T: prompt tokens
  int64_t decode_steps = 0;  // N
  v1::DType dtype = v1::DTYPE_BF16;

  // Heads of `tensor` (q_heads for q, kv_heads for k and v).
  int heads(TraceTensor tensor) const { return tensor == TraceTensor::kQ ? q_heads : kv_heads; }
};

// A validated trace. Open checks, with INVALID_ARGUMENT naming the file and the tensor: every
// layer 0..L-1 has all six tensors, each of rank 3 with the shapes above, T, N, heads and
// head_dim the same in every layer, kv_heads dividing q_heads, one dtype throughout, and the
// metadata's geometry (when present) equal to the shapes', and at most kMaxTraceLayers layers.
// Tensors not named layer{l}.* are ignored. Data is read lazily from the mapping.
class Trace {
 public:
  static absl::StatusOr<Trace> Open(const std::string& path);
  static absl::StatusOr<Trace> FromFile(SafetensorsFile file);

  const TraceGeometry& geometry() const { return geometry_; }
  const std::map<std::string, std::string>& metadata() const { return file_.metadata(); }
  const SafetensorsFile& file() const { return file_; }

  // The whole tensor as f32: [T or N, heads, head_dim].
  absl::StatusOr<std::vector<float>> Read(int layer, TracePhase phase, TraceTensor tensor) const;
  // Rows (tokens or steps) [row_begin, row_begin + rows) into out (rows * heads * head_dim).
  absl::Status ReadRows(int layer, TracePhase phase, TraceTensor tensor, int64_t row_begin,
                        int64_t rows, float* out) const;

 private:
  explicit Trace(SafetensorsFile file) : file_(std::move(file)) {}
  absl::Status Validate();

  SafetensorsFile file_;
  TraceGeometry geometry_;
};

// The tensors of a trace of `geometry`, in the order a trace writer expects their data:
// layer-major, and within a layer prefill q, k, v then decode q, k, v.
std::vector<SafetensorsTensorSpec> TraceTensorSpecs(const TraceGeometry& geometry);

// `metadata` plus the geometry keys named above.
std::map<std::string, std::string> TraceMetadata(const TraceGeometry& geometry,
                                                 std::map<std::string, std::string> metadata);

// Starts writing a trace of `geometry` to `path`: Append the f32 data of TraceTensorSpecs in
// order (any chunking), then Finish. INVALID_ARGUMENT if the geometry is not one Trace::Open
// accepts.
absl::StatusOr<std::unique_ptr<SafetensorsWriter>> CreateTraceWriter(
    const std::string& path, const TraceGeometry& geometry,
    std::map<std::string, std::string> metadata);

}  // namespace kvrecall

#endif  // KVRECALL_CLIENT_TRACE_TRACE_H_
