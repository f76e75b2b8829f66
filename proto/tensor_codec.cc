#include "proto/tensor_codec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#endif

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

// A shape as "[a, b, c]"; past 8 dimensions the first 8 and how many there are, so that an error
// about a shape of millions of dimensions is not megabytes long (probe 26, 5: such echoes
// overflowed clients' 8 KiB limit on a status's metadata, hiding the error).
std::string ShapeString(std::span<const int64_t> dims) {
  constexpr size_t kShown = 8;
  if (dims.size() <= kShown) return absl::StrCat("[", absl::StrJoin(dims, ", "), "]");
  return absl::StrCat("[", absl::StrJoin(dims.first(kShown), ", "), ", ... (", dims.size(),
                      " dimensions)]");
}

uint16_t LoadU16(const char* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

#if defined(__AVX2__) && defined(__F16C__)
// Vector forms of kernels/dtype.h's conversions, 16 elements a pass; each returns how many
// elements it converted (a multiple of 16), the caller does the rest with the scalar form.
// They give the scalar forms' bits for every input but NaN, which stays a NaN (F16C quiets
// a signalling NaN's payload where the scalar form keeps it).

int64_t Bf16ToF32Vector(const char* p, int64_t count, float* out) {
  int64_t i = 0;
  for (; i + 16 <= count; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2 * i));
    const __m256i lo = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(h)), 16);
    const __m256i hi = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(h, 1)), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), lo);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i + 8), hi);
  }
  return i;
}

// FloatToBf16 on 8 floats: round to nearest even, a NaN keeps its top bits and turns quiet.
__m256i RoundToBf16(__m256i u) {
  const __m256i abs = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
  // Signed compare is right here: abs < 2^31.
  const __m256i nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7f800000));
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  return _mm256_blendv_epi8(rounded, quiet, nan);
}

int64_t F32ToBf16Vector(const float* x, int64_t count, char* p) {
  int64_t i = 0;
  for (; i + 16 <= count; i += 16) {
    const __m256i a = RoundToBf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i)));
    const __m256i b = RoundToBf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i + 8)));
    // packus works within 128-bit lanes: a0-3 b0-3 a4-7 b4-7, put back in order.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xd8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 2 * i), packed);
  }
  return i;
}

int64_t F16ToF32Vector(const char* p, int64_t count, float* out) {
  int64_t i = 0;
  for (; i + 16 <= count; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2 * i));
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm256_castsi256_si128(h)));
    _mm256_storeu_ps(out + i + 8, _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)));
  }
  return i;
}

int64_t F32ToF16Vector(const float* x, int64_t count, char* p) {
  int64_t i = 0;
  for (; i + 16 <= count; i += 16) {
    const __m128i a = _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT);
    const __m128i b = _mm256_cvtps_ph(_mm256_loadu_ps(x + i + 8), _MM_FROUND_TO_NEAREST_INT);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 2 * i), _mm256_set_m128i(b, a));
  }
  return i;
}
#else
int64_t Bf16ToF32Vector(const char*, int64_t, float*) { return 0; }
int64_t F32ToBf16Vector(const float*, int64_t, char*) { return 0; }
int64_t F16ToF32Vector(const char*, int64_t, float*) { return 0; }
int64_t F32ToF16Vector(const float*, int64_t, char*) { return 0; }
#endif

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
  // A row count whose element count overflows int64 would wrap around to a small product that
  // could match the bytes sent; no message can carry more than 2^31 bytes anyway.
  const int64_t row_elements = Product(spec.row_shape);
  if (shape_ok && row_elements > 0 && rows > (int64_t{1} << 31) / row_elements) {
    shape_ok = false;
  }
  if (!shape_ok) {
    return absl::InvalidArgumentError(absl::StrCat(
        spec.field, " has shape ", ShapeString(shape), ", want ",
        spec.rows_free ? "[n, " : "", ShapeString(spec.row_shape).substr(spec.rows_free ? 1 : 0),
        !spec.rows_free ? ""
        : rows < 1      ? " with n >= 1"
        : rows > 1      ? " with n * row elements <= 2^31"
                        : ""));
  }
  const int64_t count = rows * row_elements;
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
    // (A value this build does not know is named by its number, not as "unspecified".)
    const std::string has = v1::DType_IsValid(t.dtype())
                                ? absl::StrCat("dtype ", DTypeName(t.dtype()))
                                : absl::StrCat("the unknown dtype ", static_cast<int>(t.dtype()));
    return absl::InvalidArgumentError(
        absl::StrCat(spec.field, " has ", has, ", the session's is ", DTypeName(spec.dtype)));
  }
  const size_t want_bytes = static_cast<size_t>(count) * DTypeSize(spec.dtype);
  if (t.data().size() != want_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(spec.field, " has ", t.data().size(),
                                                   " bytes of data, its shape and dtype need ",
                                                   want_bytes));
  }
  return rows;
}

// The common case (none out of range) is one branch-free (vectorizable) pass over the bits: |x|
// as an unsigned integer orders like |x|, and NaN and infinity lie above every finite value.
int64_t FirstOutOfRange(std::span<const float> values) {
  const float* x = values.data();
  const int64_t n = static_cast<int64_t>(values.size());
  uint32_t max_bits;
  std::memcpy(&max_bits, &kMaxTensorMagnitude, sizeof max_bits);
  uint32_t out = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, x + i, sizeof u);
    out |= (u & 0x7fffffffu) > max_bits;
  }
  if (out == 0) return -1;
  for (int64_t i = 0; i < n; ++i) {
    if (!(std::abs(x[i]) <= kMaxTensorMagnitude)) return i;
  }
  return -1;
}

namespace {

// INVALID_ARGUMENT naming `field` and the element's index when x[0, n) (the elements from
// `first` on) holds a value the service refuses; OK otherwise.
absl::Status CheckValues(absl::string_view field, const float* x, int64_t n, int64_t first) {
  const int64_t i = FirstOutOfRange(std::span<const float>(x, n));
  if (i < 0) return absl::OkStatus();
  if (!std::isfinite(x[i])) {
    return absl::InvalidArgumentError(absl::StrCat(field, " holds a non-finite value (", x[i],
                                                   ") at element ", first + i));
  }
  return absl::InvalidArgumentError(absl::StrCat(
      field, " holds ", x[i], " at element ", first + i,
      ", beyond the largest magnitude the service accepts (", kMaxTensorMagnitude,
      "): products of such values overflow float32 attention scores"));
}

}  // namespace

absl::Status DecodeTensor(const v1::Tensor& t, const TensorSpec& spec, float* out) {
  return DecodeTensorInto(t, spec, KvElement::kF32, out);
}

namespace {

// Hands `t`'s `count` values (a tensor that passed CheckTensor) to `store(first, values, n)` a
// piece at a time, each piece widened to f32 (or taken from the values) and checked first.
template <typename Store>
absl::Status ForEachCheckedPiece(const v1::Tensor& t, const TensorSpec& spec, int64_t count,
                                 Store store) {
  constexpr int64_t kPiece = 4096;
  thread_local std::vector<float> piece;
  piece.resize(kPiece);
  const bool raw = t.values_size() == 0;
  for (int64_t first = 0; first < count; first += kPiece) {
    const int64_t n = std::min(kPiece, count - first);
    const float* values;
    if (raw) {
      ConvertToF32(t.data().data() + first * DTypeSize(spec.dtype), spec.dtype, n, piece.data());
      values = piece.data();
    } else {
      values = t.values().data() + first;
    }
    if (absl::Status s = CheckValues(spec.field, values, n, first); !s.ok()) return s;
    store(first, values, n);
  }
  return absl::OkStatus();
}

// CheckTensor's rows times the row size, or its error; INVALID_ARGUMENT for raw data without a
// dtype.
absl::StatusOr<int64_t> CheckedCount(const v1::Tensor& t, const TensorSpec& spec) {
  absl::StatusOr<int64_t> rows = CheckTensor(t, spec);
  if (!rows.ok()) return rows.status();
  if (t.values_size() == 0 && DTypeSize(spec.dtype) == 0) {
    return absl::InvalidArgumentError(absl::StrCat(spec.field, " has no dtype"));
  }
  return *rows * Product(spec.row_shape);
}

}  // namespace

absl::Status DecodeTensorInto(const v1::Tensor& t, const TensorSpec& spec, KvElement element,
                              void* out) {
  absl::StatusOr<int64_t> count = CheckedCount(t, spec);
  if (!count.ok()) return count.status();
  const bool raw = t.values_size() == 0;
  if (element == KvElement::kF32) {
    auto* f32 = static_cast<float*>(out);
    if (raw) {
      ConvertToF32(t.data().data(), spec.dtype, *count, f32);
    } else {
      std::memcpy(f32, t.values().data(), *count * sizeof(float));
    }
    return CheckValues(spec.field, f32, *count, 0);
  }
  // 16-bit storage: a piece at a time is widened (or taken from the values) to be checked, then
  // stored as raw bits when it came in the storage's own dtype, else narrowed.
  const v1::DType stored = DTypeOf(element);
  auto* bytes = static_cast<char*>(out);
  return ForEachCheckedPiece(t, spec, *count, [&](int64_t first, const float* values, int64_t n) {
    if (raw && spec.dtype == stored) {
      std::memcpy(bytes + first * 2, t.data().data() + first * 2, n * 2);
    } else {
      ConvertFromF32(std::span<const float>(values, n), stored, bytes + first * 2);
    }
  });
}

absl::Status CheckTensorValues(const v1::Tensor& t, const TensorSpec& spec) {
  absl::StatusOr<int64_t> count = CheckedCount(t, spec);
  if (!count.ok()) return count.status();
  return ForEachCheckedPiece(t, spec, *count, [](int64_t, const float*, int64_t) {});
}

v1::DType DTypeOf(KvElement element) {
  switch (element) {
    case KvElement::kBf16: return v1::DTYPE_BF16;
    case KvElement::kF16: return v1::DTYPE_F16;
    case KvElement::kF32: break;
  }
  return v1::DTYPE_F32;
}

KvElement KvElementOf(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_BF16: return KvElement::kBf16;
    case v1::DTYPE_F16: return KvElement::kF16;
    default: return KvElement::kF32;
  }
}

void ConvertToF32(const void* bytes, v1::DType dtype, int64_t count, float* out) {
  const auto* p = static_cast<const char*>(bytes);
  switch (dtype) {
    case v1::DTYPE_F32:
      std::memcpy(out, p, count * sizeof(float));
      return;
    case v1::DTYPE_F16:
      for (int64_t i = F16ToF32Vector(p, count, out); i < count; ++i) {
        out[i] = F16ToFloat(LoadU16(p + 2 * i));
      }
      return;
    case v1::DTYPE_BF16:
      for (int64_t i = Bf16ToF32Vector(p, count, out); i < count; ++i) {
        out[i] = Bf16ToFloat(LoadU16(p + 2 * i));
      }
      return;
    default:
      return;
  }
}

void ConvertFromF32(std::span<const float> values, v1::DType dtype, void* bytes) {
  auto* p = static_cast<char*>(bytes);
  const int64_t n = static_cast<int64_t>(values.size());
  switch (dtype) {
    case v1::DTYPE_F32:
      std::memcpy(p, values.data(), values.size() * sizeof(float));
      return;
    case v1::DTYPE_F16:
      for (int64_t i = F32ToF16Vector(values.data(), n, p); i < n; ++i) {
        const uint16_t h = FloatToF16(values[i]);
        std::memcpy(p + 2 * i, &h, 2);
      }
      return;
    case v1::DTYPE_BF16:
      for (int64_t i = F32ToBf16Vector(values.data(), n, p); i < n; ++i) {
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
