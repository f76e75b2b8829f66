#include "proto/tensor_codec.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/dtype.h"

namespace kvrecall {
namespace {

constexpr int64_t kRow[] = {2, 3};

TEST(TensorCodecTest, RoundTripsEveryDType) {
  const std::vector<float> data = {0.5f, -1.25f, 3.0f, 1e-3f, -7.0f, 2.0f};
  for (v1::DType dtype : {v1::DTYPE_F32, v1::DTYPE_F16, v1::DTYPE_BF16}) {
    v1::Tensor t;
    EncodeTensor(data, kRow, dtype, /*as_values=*/false, &t);
    std::vector<float> back(6);
    ASSERT_TRUE(DecodeTensor(t, {"x", kRow, false, dtype}, back.data()).ok());
    for (size_t i = 0; i < data.size(); ++i) {
      EXPECT_NEAR(back[i], data[i], dtype == v1::DTYPE_F32 ? 0 : 1e-2 * std::abs(data[i]));
    }
  }
}

TEST(TensorCodecTest, ValuesAreAcceptedWhateverTheSessionDType) {
  v1::Tensor t;
  EncodeTensor(std::vector<float>{1, 2, 3, 4, 5, 6}, kRow, v1::DTYPE_BF16, /*as_values=*/true, &t);
  std::vector<float> back(6);
  ASSERT_TRUE(DecodeTensor(t, {"x", kRow, false, v1::DTYPE_BF16}, back.data()).ok());
  EXPECT_EQ(back, (std::vector<float>{1, 2, 3, 4, 5, 6}));
}

// Decoding into 16-bit KV storage (the tiered placement's host store): a tensor in the storage's
// own dtype is stored bit for bit, float values and other dtypes are narrowed to nearest even,
// and bad values are refused with the index of the element, beyond the first piece too.
TEST(TensorCodecTest, DecodesIntoSixteenBitStorage) {
  constexpr int64_t kRows = 3000;  // 18000 elements: several of the decoder's pieces
  const int64_t row[] = {2, 3};
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> data(kRows * 6);
  for (float& x : data) x = normal(rng);
  const int64_t shape[] = {kRows, 2, 3};
  for (v1::DType dtype : {v1::DTYPE_BF16, v1::DTYPE_F16}) {
    const KvElement element = KvElementOf(dtype);
    EXPECT_EQ(DTypeOf(element), dtype);
    auto narrow = [&](float x) {
      return dtype == v1::DTYPE_BF16 ? FloatToBf16(x) : FloatToF16(x);
    };
    const TensorSpec spec{"k", row, /*rows_free=*/true, dtype};
    // Raw bytes in the storage's dtype: copied.
    v1::Tensor raw;
    EncodeTensor(data, shape, dtype, /*as_values=*/false, &raw);
    std::vector<uint16_t> stored(data.size());
    ASSERT_TRUE(DecodeTensorInto(raw, spec, element, stored.data()).ok());
    EXPECT_EQ(std::memcmp(stored.data(), raw.data().data(), raw.data().size()), 0);
    // Float values: narrowed exactly as kernels/dtype.h narrows.
    v1::Tensor values;
    EncodeTensor(data, shape, dtype, /*as_values=*/true, &values);
    std::vector<uint16_t> from_values(data.size());
    ASSERT_TRUE(DecodeTensorInto(values, spec, element, from_values.data()).ok());
    for (size_t i = 0; i < data.size(); ++i) ASSERT_EQ(from_values[i], narrow(data[i])) << i;
    // A bad value in a later piece is named by its index in the whole tensor.
    values.mutable_values()->Set(9000, std::numeric_limits<float>::quiet_NaN());
    absl::Status s = DecodeTensorInto(values, spec, element, from_values.data());
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("k holds a non-finite value (nan) at element 9000"),
              std::string::npos)
        << s;
    values.mutable_values()->Set(9000, 1e5f);
    s = DecodeTensorInto(values, spec, element, from_values.data());
    EXPECT_NE(s.message().find("k holds 100000 at element 9000, beyond the largest magnitude"),
              std::string::npos)
        << s;
  }
  // f32 storage is DecodeTensor.
  v1::Tensor t;
  EncodeTensor(data, shape, v1::DTYPE_BF16, false, &t);
  std::vector<float> a(data.size()), b(data.size());
  const TensorSpec spec{"k", row, true, v1::DTYPE_BF16};
  ASSERT_TRUE(DecodeTensorInto(t, spec, KvElement::kF32, a.data()).ok());
  ASSERT_TRUE(DecodeTensor(t, spec, b.data()).ok());
  EXPECT_EQ(a, b);
}

TEST(TensorCodecTest, LeadingRowsAreCountedWhenFree) {
  v1::Tensor t;
  EncodeTensor(std::vector<float>(24, 1.0f), std::vector<int64_t>{4, 2, 3}, v1::DTYPE_F32, false,
               &t);
  absl::StatusOr<int64_t> rows = CheckTensor(t, {"x", kRow, true, v1::DTYPE_F32});
  ASSERT_TRUE(rows.ok());
  EXPECT_EQ(*rows, 4);
  // A fixed-shape field accepts [1, row...] but not [4, row...].
  EXPECT_EQ(CheckTensor(t, {"x", kRow, false, v1::DTYPE_F32}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(TensorCodecTest, ErrorsNameTheField) {
  v1::Tensor t;
  EncodeTensor(std::vector<float>(6, 1.0f), kRow, v1::DTYPE_F16, false, &t);
  absl::Status s = CheckTensor(t, {"steps[0].q", kRow, false, v1::DTYPE_BF16}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("steps[0].q has dtype f16"), std::string::npos) << s;
  // A dtype this build does not know is named by its number, not as "unspecified".
  v1::Tensor unknown = t;
  unknown.set_dtype(static_cast<v1::DType>(9));
  s = CheckTensor(unknown, {"chunks[0].q", kRow, false, v1::DTYPE_F32}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("chunks[0].q has the unknown dtype 9, the session's is f32"),
            std::string::npos)
      << s;

  t.mutable_data()->pop_back();
  s = CheckTensor(t, {"k", kRow, false, v1::DTYPE_F16}).status();
  EXPECT_NE(s.message().find("k has 11 bytes"), std::string::npos) << s;

  v1::Tensor wrong_shape;
  EncodeTensor(std::vector<float>(6, 1.0f), std::vector<int64_t>{3, 2}, v1::DTYPE_F32, false,
               &wrong_shape);
  s = CheckTensor(wrong_shape, {"v_new", kRow, false, v1::DTYPE_F32}).status();
  EXPECT_NE(s.message().find("v_new has shape [3, 2], want [2, 3]"), std::string::npos) << s;
  // A shape of a million dimensions is named by its first 8 and its rank, not echoed whole.
  v1::Tensor many_dims = wrong_shape;
  many_dims.clear_shape();
  for (int i = 0; i < 1000000; ++i) many_dims.add_shape(1);
  s = CheckTensor(many_dims, {"q", kRow, false, v1::DTYPE_F32}).status();
  EXPECT_NE(s.message().find("q has shape [1, 1, 1, 1, 1, 1, 1, 1, ... (1000000 dimensions)], "
                             "want [2, 3]"),
            std::string::npos)
      << s;
  EXPECT_LT(s.message().size(), 200u);

  v1::Tensor empty;
  empty.add_shape(2);
  empty.add_shape(3);
  s = CheckTensor(empty, {"q", kRow, false, v1::DTYPE_F32}).status();
  EXPECT_NE(s.message().find("exactly one of data"), std::string::npos) << s;
}

TEST(TensorCodecTest, NonFiniteValuesAreRejected) {
  std::vector<float> data(6, 1.0f);
  data[4] = std::numeric_limits<float>::quiet_NaN();
  for (bool as_values : {false, true}) {
    v1::Tensor t;
    EncodeTensor(data, kRow, v1::DTYPE_F32, as_values, &t);
    std::vector<float> out(6);
    absl::Status s = DecodeTensor(t, {"q", kRow, false, v1::DTYPE_F32}, out.data());
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("q holds a non-finite value"), std::string::npos) << s;
  }
  data[4] = std::numeric_limits<float>::infinity();
  v1::Tensor t;
  EncodeTensor(data, kRow, v1::DTYPE_BF16, false, &t);
  std::vector<float> out(6);
  const absl::Status s = DecodeTensor(t, {"q", kRow, false, v1::DTYPE_BF16}, out.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("q holds a non-finite value"), std::string::npos) << s;
}

TEST(DTypeTest, HalfConversionsMatchKnownBitPatterns) {
  EXPECT_EQ(FloatToF16(1.0f), 0x3c00);
  EXPECT_EQ(FloatToF16(-2.0f), 0xc000);
  EXPECT_EQ(FloatToF16(65504.0f), 0x7bff);
  EXPECT_EQ(FloatToF16(1e6f), 0x7c00);
  EXPECT_EQ(FloatToF16(5.960464477539063e-08f), 0x0001);
  EXPECT_FLOAT_EQ(F16ToFloat(0x0001), 5.960464477539063e-08f);
  EXPECT_FLOAT_EQ(F16ToFloat(0x3555), 0.333251953125f);
  EXPECT_EQ(FloatToBf16(1.0f), 0x3f80);
  EXPECT_FLOAT_EQ(Bf16ToFloat(0x4049), 3.140625f);
  for (uint32_t h = 0; h < 0x7c00; ++h) {  // every finite positive half round-trips
    ASSERT_EQ(FloatToF16(F16ToFloat(static_cast<uint16_t>(h))), h);
  }
}

// ConvertToF32 / ConvertFromF32 run 16 elements a pass (AVX2, F16C) and the rest one by one:
// every input gives the scalar conversions' bits, and a NaN stays a NaN.
TEST(DTypeTest, BulkConversionsGiveTheScalarBits) {
  auto bits = [](float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    return u;
  };
  auto is_nan16 = [](uint16_t h, v1::DType dtype) {
    return dtype == v1::DTYPE_F16 ? (h & 0x7fff) > 0x7c00 : (h & 0x7fff) > 0x7f80;
  };
  // Every 16-bit pattern, and 7 more so that a scalar tail runs too.
  std::vector<uint16_t> halves(65536 + 7);
  for (size_t i = 0; i < halves.size(); ++i) halves[i] = static_cast<uint16_t>(i * 40503u);
  // Floats at, next to and halfway between representable halves and bf16s (the ties), and
  // random bit patterns over every exponent.
  std::vector<float> floats = {0.0f, -0.0f, std::numeric_limits<float>::infinity(),
                               -std::numeric_limits<float>::infinity(), 65520.0f, 65519.99f,
                               std::numeric_limits<float>::quiet_NaN()};
  for (uint32_t h = 0; h < 0x10000; h += 7) {
    for (float f : {F16ToFloat(static_cast<uint16_t>(h)), Bf16ToFloat(static_cast<uint16_t>(h))}) {
      if (!std::isfinite(f)) continue;
      const float up = std::nextafter(f, std::numeric_limits<float>::infinity());
      floats.insert(floats.end(), {f, up, std::nextafter(f, 0.0f), f + (up - f) / 2});
      const uint32_t tie16 = bits(f) + 0x1000, tie_bf16 = bits(f) + 0x8000;  // exact ties
      float t;
      std::memcpy(&t, &tie16, sizeof t);
      floats.push_back(t);
      std::memcpy(&t, &tie_bf16, sizeof t);
      floats.push_back(t);
    }
  }
  std::mt19937 rng(12);
  for (int i = 0; i < 100003; ++i) {
    const uint32_t u = rng();
    float f;
    std::memcpy(&f, &u, sizeof f);
    floats.push_back(f);
  }
  for (v1::DType dtype : {v1::DTYPE_F16, v1::DTYPE_BF16}) {
    auto to_f32 = dtype == v1::DTYPE_F16 ? F16ToFloat : Bf16ToFloat;
    auto from_f32 = dtype == v1::DTYPE_F16 ? FloatToF16 : FloatToBf16;
    std::vector<float> wide(halves.size());
    ConvertToF32(halves.data(), dtype, static_cast<int64_t>(halves.size()), wide.data());
    for (size_t i = 0; i < halves.size(); ++i) {
      if (is_nan16(halves[i], dtype)) {
        ASSERT_TRUE(std::isnan(wide[i])) << DTypeName(dtype) << " " << halves[i];
      } else {
        ASSERT_EQ(bits(wide[i]), bits(to_f32(halves[i]))) << DTypeName(dtype) << " " << halves[i];
      }
    }
    std::vector<uint16_t> narrow(floats.size());
    ConvertFromF32(floats, dtype, narrow.data());
    for (size_t i = 0; i < floats.size(); ++i) {
      if (std::isnan(floats[i])) {
        ASSERT_TRUE(is_nan16(narrow[i], dtype)) << DTypeName(dtype) << " " << narrow[i];
      } else {
        ASSERT_EQ(narrow[i], from_f32(floats[i]))
            << DTypeName(dtype) << " of " << floats[i] << " (bits " << bits(floats[i]) << ")";
      }
    }
  }
}

}  // namespace
}  // namespace kvrecall
