// Decoding and encoding of kvrecall.v1.Tensor: raw little-endian bytes of a dtype (the fast
// path) or plain float values (for people debugging with JSON), to and from f32 arrays and
// 16-bit key/value storage.
#ifndef KVRECALL_PROTO_TENSOR_CODEC_H_
#define KVRECALL_PROTO_TENSOR_CODEC_H_

#include <cstdint>
#include <span>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/dtype.h"
#include "kvrecall/v1/kvrecall.pb.h"

namespace kvrecall {

// Bytes per element of `dtype`; 0 for DTYPE_UNSPECIFIED.
size_t DTypeSize(v1::DType dtype);
const char* DTypeName(v1::DType dtype);

// What a request tensor must look like. `row_shape` is the shape of one row; with
// `rows_free` the tensor is [n, row_shape...] for any n >= 1, otherwise it is row_shape
// (or [1, row_shape...]). Raw data must be in `dtype` (the session's dtype).
struct TensorSpec {
  absl::string_view field;  // named in every error, e.g. "steps[0].q"
  std::span<const int64_t> row_shape;
  bool rows_free = false;
  v1::DType dtype = v1::DTYPE_F32;
};

// The number of rows of `t` (1 unless rows_free), or INVALID_ARGUMENT naming the field when
// the shape, dtype or byte size is wrong. Touches no data.
absl::StatusOr<int64_t> CheckTensor(const v1::Tensor& t, const TensorSpec& spec);

// The largest |value| a request tensor may hold: f16's largest finite value. Below it, a dot
// product of two 1024-dim vectors (times any softmax scale up to 10^4) stays finite in f32,
// so attention scores, their exponentials and the outputs cannot overflow.
inline constexpr float kMaxTensorMagnitude = 65504.0f;

// Index of the first of `values` that is NaN, infinite or beyond kMaxTensorMagnitude (what the
// service refuses in a request), or -1.
int64_t FirstOutOfRange(std::span<const float> values);

// Converts a tensor that passed CheckTensor into f32 at `out` (rows * prod(row_shape)
// floats). INVALID_ARGUMENT naming the field if any value is NaN, infinite or beyond
// kMaxTensorMagnitude; `out` may then hold partial data, so decode into staging memory, never
// into committed state.
absl::Status DecodeTensor(const v1::Tensor& t, const TensorSpec& spec, float* out);

// DecodeTensor into storage of `element` (count elements of it at `out`): the values are
// checked as DecodeTensor checks them and stored as f32, or as raw 16-bit bits — copied when the
// tensor came in that dtype (no rounding), narrowed to nearest even from the values otherwise.
// INVALID_ARGUMENT as DecodeTensor; `out` may then hold partial data.
absl::Status DecodeTensorInto(const v1::Tensor& t, const TensorSpec& spec, KvElement element,
                              void* out);

// DecodeTensor's checks without its output: the shape, and every value (a piece at a time) for
// the tensors whose values nothing keeps.
absl::Status CheckTensorValues(const v1::Tensor& t, const TensorSpec& spec);

// The wire dtype of a stored element type, and back (DTYPE_F32 <-> kF32 for anything else).
v1::DType DTypeOf(KvElement element);
KvElement KvElementOf(v1::DType dtype);

// Element-wise conversion between f32 and the raw little-endian bytes of `dtype` (bf16 and f16
// narrowing round to nearest even); `bytes` holds count * DTypeSize(dtype) bytes. They run on
// every request and reply: 16 elements a pass with AVX2 and F16C where the build targets them
// (the same bits as kernels/dtype.h's scalar conversions, a NaN staying a NaN).
void ConvertToF32(const void* bytes, v1::DType dtype, int64_t count, float* out);
void ConvertFromF32(std::span<const float> values, v1::DType dtype, void* bytes);

// Writes `data` with `shape` into `out`: raw bytes of `dtype`, or plain values when as_values.
void EncodeTensor(std::span<const float> data, std::span<const int64_t> shape, v1::DType dtype,
                  bool as_values, v1::Tensor* out);

}  // namespace kvrecall

#endif  // KVRECALL_PROTO_TENSOR_CODEC_H_
