#include "proto/tensor_codec.h"

#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/dtype.h"

namespace kvrecall {
namespace {

int64_t Product(std::span<const int64_t> dims) {
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  return n;
}

std::string ShapeString(std::span<const int64_t> dims) {
  return absl::StrCat("[", absl::StrJoin(dims, ", "), "]");
}

uint16_t LoadU16(const char* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Index of the first NaN or infinity in x[0, n), or -1. The common all-finite case is one
// branch-free (vectorizable) pass over the exponent bits.
int64_t FirstNonFinite(const float* x, int64_t n) {
  uint32_t non_finite = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, x + i, sizeof u);
    non_finite |= (u & 0x7f800000u) == 0x7f800000u;
  }
  if (non_finite == 0) return -1;
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(x[i])) return i;
  }
  return -1;
}

}  // namespace

size_t DTypeSize(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_F32: return 4;
    case v1::DTYPE_F16:
    case v1::DTYPE_BF16: return 2;
    default: return 0;
  }
}

const char* DTypeName(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_F32: return "f32";
    case v1::DTYPE_F16: return "f16";
    case v1::DTYPE_BF16: return "bf16";
    default: return "unspecified";
  }
}

absl::StatusOr<int64_t> CheckTensor(const v1::Tensor& t, const TensorSpec& spec) {
  const std::span<const int64_t> shape(t.shape().data(), t.shape_size());
  const size_t rank = spec.row_shape.size();
  int64_t rows = 1;
  bool shape_ok = false;
  if (shape.size() == rank + 1) {
    rows = shape[0];
    shape_ok = std::equal(spec.row_shape.begin(), spec.row_shape.end(), shape.begin() + 1) &&
               (spec.rows_free ? rows >= 1 : rows == 1);
  } else if (shape.size() == rank && !spec.rows_free) {
    shape_ok = std::equal(spec.row_shape.begin(), spec.row_shape.end(), shape.begin());
  }
  if (!shape_ok) {
    return absl::InvalidArgumentError(absl::StrCat(
        spec.field, " has shape ", ShapeString(shape), ", want ",
        spec.rows_free ? "[n, " : "", ShapeString(spec.row_shape).substr(spec.rows_free ? 1 : 0)));
  }
  const int64_t count = rows * Product(spec.row_shape);
  const bool has_data = !t.data().empty();
  const bool has_values = t.values_size() > 0;
  if (has_data == has_values) {
    return absl::InvalidArgumentError(
        absl::StrCat(spec.field, " must carry exactly one of data (raw bytes) or values"));
  }
  if (has_values) {
    if (t.values_size() != count) {
      return absl::InvalidArgumentError(absl::StrCat(spec.field, " has ", t.values_size(),
                                                     " values, its shape needs ", count));
    }
    return rows;
  }
  if (t.dtype() != spec.dtype) {
    return absl::InvalidArgumentError(absl::StrCat(spec.field, " has dtype ",
                                                   DTypeName(t.dtype()), ", the session's is ",
                                                   DTypeName(spec.dtype)));
  }
  const size_t want_bytes = static_cast<size_t>(count) * DTypeSize(spec.dtype);
  if (t.data().size() != want_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(spec.field, " has ", t.data().size(),
                                                   " bytes of data, its shape and dtype need ",
                                                   want_bytes));
  }
  return rows;
}

absl::Status DecodeTensor(const v1::Tensor& t, const TensorSpec& spec, float* out) {
  absl::StatusOr<int64_t> rows = CheckTensor(t, spec);
  if (!rows.ok()) return rows.status();
  const int64_t count = *rows * Product(spec.row_shape);
  if (t.values_size() > 0) {
    std::memcpy(out, t.values().data(), count * sizeof(float));
  } else if (DTypeSize(spec.dtype) == 0) {
    return absl::InvalidArgumentError(absl::StrCat(spec.field, " has no dtype"));
  } else {
    ConvertToF32(t.data().data(), spec.dtype, count, out);
  }
  if (const int64_t i = FirstNonFinite(out, count); i >= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(spec.field, " holds a non-finite value (", out[i], ") at element ", i));
  }
  return absl::OkStatus();
}

void ConvertToF32(const void* bytes, v1::DType dtype, int64_t count, float* out) {
  const auto* p = static_cast<const char*>(bytes);
  switch (dtype) {
    case v1::DTYPE_F32:
      std::memcpy(out, p, count * sizeof(float));
      return;
    case v1::DTYPE_F16:
      for (int64_t i = 0; i < count; ++i) out[i] = F16ToFloat(LoadU16(p + 2 * i));
      return;
    case v1::DTYPE_BF16:
      for (int64_t i = 0; i < count; ++i) out[i] = Bf16ToFloat(LoadU16(p + 2 * i));
      return;
    default:
      return;
  }
}

void ConvertFromF32(std::span<const float> values, v1::DType dtype, void* bytes) {
  auto* p = static_cast<char*>(bytes);
  switch (dtype) {
    case v1::DTYPE_F32:
      std::memcpy(p, values.data(), values.size() * sizeof(float));
      return;
    case v1::DTYPE_F16:
      for (size_t i = 0; i < values.size(); ++i) {
        const uint16_t h = FloatToF16(values[i]);
        std::memcpy(p + 2 * i, &h, 2);
      }
      return;
    case v1::DTYPE_BF16:
      for (size_t i = 0; i < values.size(); ++i) {
        const uint16_t h = FloatToBf16(values[i]);
        std::memcpy(p + 2 * i, &h, 2);
      }
      return;
    default:
      return;
  }
}

void EncodeTensor(std::span<const float> data, std::span<const int64_t> shape, v1::DType dtype,
                  bool as_values, v1::Tensor* out) {
  out->Clear();
  for (int64_t d : shape) out->add_shape(d);
  if (as_values) {
    out->set_dtype(v1::DTYPE_F32);
    out->mutable_values()->Add(data.begin(), data.end());
    return;
  }
  out->set_dtype(dtype);
  std::string* bytes = out->mutable_data();
  bytes->resize(data.size() * DTypeSize(dtype));
  ConvertFromF32(data, dtype, bytes->data());
}

}  // namespace kvrecall
