// The GPU encoder of product-quantized keys (kernels/cuda/pq_encode.h) against its CPU reference
// (ProductQuantizer::Encode, index/product_quantizer.h, and the squared reconstruction error
// BulkCodes weighs its outliers by): over one KV head of a [count, kv_heads, dim] block of bf16
// or f16 keys, every part size the encoder takes, the same codes (a differing one only where
// two centroids are equally near, to rounding) and the same errors; misfits refused.
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "index/product_quantizer.h"
#include "kernels/cpu/attention.h"
#include "kernels/cuda/pq_encode.h"
#include "tests/cuda_test_util.h"
#include "tests/test_util.h"

namespace kvrecall {
namespace {

using ::kvrecall::testing::DecodeHalf;
using ::kvrecall::testing::EncodeHalf;
using ::kvrecall::testing::PqPartDistance;
using ::kvrecall::testing::RandomNormal;
using ::kvrecall::testing::ToDevice;
using ::kvrecall::testing::ToHost;
using ::testing::HasSubstr;

constexpr int kKvHeads = 2;
constexpr int kHead = 1;  // the code set: every other row of the block
constexpr int kCount = 3000;  // not a multiple of the kernel's block

// (dtype, dim, M).
class PqEncodeTest
    : public ::testing::TestWithParam<std::tuple<cuda::KvDtype, int, int>> {};

TEST_P(PqEncodeTest, MatchesTheCpuEncoder) {
  KVRECALL_SKIP_WITHOUT_GPU();
  const auto [dtype, dim, subspaces] = GetParam();
  // Keys with a mean and a few directions that dominate, as attention keys have, rounded to the
  // 16-bit type: the stored bits for the device, their exact f32 values for the host.
  std::vector<float> keys = RandomNormal(static_cast<size_t>(kCount) * kKvHeads * dim, 7);
  for (size_t i = 0; i < keys.size(); ++i) keys[i] = keys[i] * (1.0f + (i % dim) % 5) + 0.5f;
  std::vector<uint16_t> bits(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    bits[i] = EncodeHalf(keys[i], dtype);
    keys[i] = DecodeHalf(bits[i], dtype);
  }
  const VectorSet set{keys.data() + kHead * dim, kCount, kKvHeads * dim, dim, KvElement::kF32};
  ProductQuantizerParams params;
  params.subspaces = subspaces;
  params.iterations = 4;
  params.training_keys = 2048;
  absl::StatusOr<ProductQuantizer> pq = ProductQuantizer::Train(set, params);
  ASSERT_TRUE(pq.ok()) << pq.status();
  std::vector<uint8_t> want(static_cast<size_t>(kCount) * subspaces);
  pq->Encode(set, want.data());

  auto d_keys = ToDevice(bits);
  auto d_books = ToDevice(pq->codebooks());
  auto d_codes = ToDevice(std::vector<uint8_t>(want.size(), 0));
  auto d_errors = ToDevice(std::vector<float>(kCount, -1.0f));
  cuda::PqEncodeParams p;
  p.keys = d_keys.data() + kHead * dim;
  p.dtype = dtype;
  p.count = kCount;
  p.row_stride = kKvHeads * dim;
  p.dim = dim;
  p.subspaces = subspaces;
  p.codebooks = d_books.data();
  p.codes = d_codes.data();
  p.errors = d_errors.data();
  ASSERT_TRUE(cuda::PqEncode(p, nullptr).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<uint8_t> got = ToHost(d_codes.data(), d_codes.size());
  const std::vector<float> errors = ToHost(d_errors.data(), d_errors.size());

  int differing = 0;
  std::vector<float> back(dim);
  for (int i = 0; i < kCount; ++i) {
    const float* key = set.row(i);
    for (int m = 0; m < subspaces; ++m) {
      const int a = got[i * subspaces + m], b = want[i * subspaces + m];
      if (a == b) continue;
      ++differing;
      const double da = PqPartDistance(*pq, key, m, a), db = PqPartDistance(*pq, key, m, b);
      EXPECT_NEAR(da, db, 1e-4 * (1.0 + db)) << "key " << i << " part " << m;
    }
    // The error of the device's own code, as the host computes one.
    pq->Reconstruct(got.data() + i * subspaces, back.data());
    float error = 0.0f;
    for (int j = 0; j < dim; ++j) error += (key[j] - back[j]) * (key[j] - back[j]);
    EXPECT_NEAR(errors[i], error, 1e-5f * (1.0f + error)) << "key " << i;
  }
  // Near-ties are rare: almost every code is the host's bit for bit.
  EXPECT_LE(differing, kCount * subspaces / 1000);
}

INSTANTIATE_TEST_SUITE_P(
    PartSizes, PqEncodeTest,
    ::testing::Values(std::make_tuple(cuda::KvDtype::kBf16, 128, 8),  // the served shape
                      std::make_tuple(cuda::KvDtype::kF16, 128, 8),
                      std::make_tuple(cuda::KvDtype::kBf16, 64, 16),  // parts of 4
                      std::make_tuple(cuda::KvDtype::kBf16, 64, 8),   // 8
                      std::make_tuple(cuda::KvDtype::kF16, 64, 2)),   // 32
    [](const ::testing::TestParamInfo<std::tuple<cuda::KvDtype, int, int>>& info) {
      return std::string(std::get<0>(info.param) == cuda::KvDtype::kBf16 ? "Bf16" : "F16") +
             "Dim" + std::to_string(std::get<1>(info.param)) + "M" +
             std::to_string(std::get<2>(info.param));
    });

TEST(PqEncodeErrorsTest, MisfitsAreRefused) {
  KVRECALL_SKIP_WITHOUT_GPU();
  auto keys = ToDevice(std::vector<uint16_t>(4 * 64, 0));
  auto books = ToDevice(std::vector<float>(256 * 64, 0.0f));
  auto codes = ToDevice(std::vector<uint8_t>(4 * 16, 0));
  cuda::PqEncodeParams p;
  p.keys = keys.data();
  p.count = 4;
  p.row_stride = 64;
  p.dim = 64;
  p.subspaces = 8;
  p.codebooks = books.data();
  p.codes = codes.data();
  EXPECT_TRUE(cuda::PqEncode(p, nullptr).ok());
  auto expect_invalid = [](const absl::Status& status, const char* what) {
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << what;
    EXPECT_THAT(std::string(status.message()), HasSubstr(what));
  };
  p.subspaces = 3;  // does not divide 64
  expect_invalid(cuda::PqEncode(p, nullptr), "subspaces=3 dim=64");
  p.subspaces = 1;  // parts of 64 dims
  expect_invalid(cuda::PqEncode(p, nullptr), "subspaces=1 dim=64");
  p.subspaces = 8;
  p.row_stride = 32;
  expect_invalid(cuda::PqEncode(p, nullptr), "row_stride=32");
  p.row_stride = 64;
  p.codes = nullptr;
  expect_invalid(cuda::PqEncode(p, nullptr), "device pointers");
  p.count = 0;  // nothing to code: nothing read
  EXPECT_TRUE(cuda::PqEncode(p, nullptr).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

}  // namespace
}  // namespace kvrecall
