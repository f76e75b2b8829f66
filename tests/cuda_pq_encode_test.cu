// The GPU encoder of product-quantized keys (kernels/cuda/pq_encode.h) against its CPU reference
// (ProductQuantizer::Encode, index/product_quantizer.h, and the squared reconstruction error
// BulkCodes weighs its outliers by): over one KV head of a [count, kv_heads, dim] block of bf16,
// f16 or f32 keys, every part size the encoder takes, the same codes (a differing one only where
// two centroids are equally near, to rounding) and the same errors; every KV head in one call
// (sets) as each in its own, bit for bit; PqEncodeRows (a decode step's keys, one job each, each
// with its codebooks) bit for bit as PqEncode, exact ties to the lower centroid, non-finite
// distances ordered alike, its skipped jobs untouched; every split of the keys among PqEncode's
// warps (and its choice of one) as PqEncodeRows, bit for bit; training with the GPU's
// assignments (index/gpu_pq_assigner.h) as with the host's; misfits refused.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "index/gpu_pq_assigner.h"
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
constexpr int kCount = 2999;  // a multiple of neither the kernel's block nor its warp's keys

// `keys` as `element` stores them: their bytes for the device, and `keys` rounded in place to
// the values those bytes hold, for the host.
std::vector<uint8_t> StoredAs(KvElement element, std::vector<float>* keys) {
  std::vector<uint8_t> stored(keys->size() * KvElementBytes(element));
  if (element == KvElement::kF32) {
    std::memcpy(stored.data(), keys->data(), stored.size());
    return stored;
  }
  const cuda::KvDtype dtype =
      element == KvElement::kBf16 ? cuda::KvDtype::kBf16 : cuda::KvDtype::kF16;
  auto* bits = reinterpret_cast<uint16_t*>(stored.data());
  for (size_t i = 0; i < keys->size(); ++i) {
    bits[i] = EncodeHalf((*keys)[i], dtype);
    (*keys)[i] = DecodeHalf(bits[i], dtype);
  }
  return stored;
}

// (key element type, dim, M): every part size and element type the encoder takes.
using PartSize = std::tuple<KvElement, int, int>;
std::vector<PartSize> PartSizes() {
  return {std::make_tuple(KvElement::kBf16, 128, 8),  // the served shape
          std::make_tuple(KvElement::kF16, 128, 8),
          std::make_tuple(KvElement::kF32, 128, 8),   // a training sample
          std::make_tuple(KvElement::kBf16, 64, 16),  // parts of 4
          std::make_tuple(KvElement::kBf16, 64, 8),   // 8
          std::make_tuple(KvElement::kF16, 64, 2)};   // 32
}
std::string PartSizeName(const PartSize& size) {
  return std::string(KvElementName(std::get<0>(size))) + "Dim" +
         std::to_string(std::get<1>(size)) + "M" + std::to_string(std::get<2>(size));
}

// Codes `jobs` by PqEncodeRows (their keys of `element`, `dim` elements in `subspaces` parts)
// and waits for them: the reference every PqEncode result here is held to bit for bit.
void CodeByRows(const std::vector<cuda::PqEncodeJob>& jobs, KvElement element, int dim,
                int subspaces) {
  auto d_jobs = ToDevice(jobs);
  const cuda::PqEncodeRowsParams rows{.jobs = d_jobs.data(),
                                      .count = static_cast<int>(jobs.size()),
                                      .element = element,
                                      .dim = dim,
                                      .subspaces = subspaces};
  ASSERT_TRUE(cuda::PqEncodeRows(rows, nullptr).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

class PqEncodeTest : public ::testing::TestWithParam<PartSize> {};

TEST_P(PqEncodeTest, MatchesTheCpuEncoder) {
  KVRECALL_SKIP_WITHOUT_GPU();
  const auto [element, dim, subspaces] = GetParam();
  // Keys with a mean and a few directions that dominate, as attention keys have, stored as
  // `element`: their stored bytes for the device, their exact f32 values for the host.
  std::vector<float> keys = RandomNormal(static_cast<size_t>(kCount) * kKvHeads * dim, 7);
  for (size_t i = 0; i < keys.size(); ++i) keys[i] = keys[i] * (1.0f + (i % dim) % 5) + 0.5f;
  const std::vector<uint8_t> stored = StoredAs(element, &keys);
  const VectorSet set{keys.data() + kHead * dim, kCount, kKvHeads * dim, dim, KvElement::kF32};
  ProductQuantizerParams params;
  params.subspaces = subspaces;
  params.iterations = 4;
  params.training_keys = 2048;
  absl::StatusOr<ProductQuantizer> pq = ProductQuantizer::Train(set, params);
  ASSERT_TRUE(pq.ok()) << pq.status();
  std::vector<uint8_t> want(static_cast<size_t>(kCount) * subspaces);
  pq->Encode(set, want.data());

  auto d_keys = ToDevice(stored);
  auto d_books = ToDevice(pq->codebooks());
  auto d_codes = ToDevice(std::vector<uint8_t>(want.size(), 0));
  auto d_errors = ToDevice(std::vector<float>(kCount, -1.0f));
  cuda::PqEncodeParams p;
  p.keys = d_keys.data() + kHead * dim * KvElementBytes(element);
  p.element = element;
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

  // Both KV heads in one call (sets), each with its own codebooks (head 0 against codebooks whose
  // every coordinate is 0.25 more): set 1 is the call above bit for bit, set 0 a call of its own.
  std::vector<float> shifted = pq->codebooks();
  for (float& c : shifted) c += 0.25f;
  std::vector<float> both_books = shifted;
  both_books.insert(both_books.end(), pq->codebooks().begin(), pq->codebooks().end());
  auto d_both_books = ToDevice(both_books);
  auto d_set0_codes = ToDevice(std::vector<uint8_t>(want.size(), 0));
  auto d_set0_errors = ToDevice(std::vector<float>(kCount, -1.0f));
  cuda::PqEncodeParams alone = p;
  alone.keys = d_keys.data();
  alone.codebooks = d_both_books.data();
  alone.codes = d_set0_codes.data();
  alone.errors = d_set0_errors.data();
  ASSERT_TRUE(cuda::PqEncode(alone, nullptr).ok());
  const int64_t code_stride = int64_t{kCount} * subspaces + 5;  // not the sets' own size
  auto d_sets_codes = ToDevice(std::vector<uint8_t>(2 * code_stride, 0));
  auto d_sets_errors = ToDevice(std::vector<float>(2 * (kCount + 3), -1.0f));
  cuda::PqEncodeParams sets = alone;
  sets.codes = d_sets_codes.data();
  sets.errors = d_sets_errors.data();
  sets.sets = 2;
  sets.key_set_stride = dim;
  sets.codebook_set_stride = static_cast<int64_t>(pq->codebooks().size());
  sets.code_set_stride = code_stride;
  sets.error_set_stride = kCount + 3;
  ASSERT_TRUE(cuda::PqEncode(sets, nullptr).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<uint8_t> sets_codes = ToHost(d_sets_codes.data(), d_sets_codes.size());
  const std::vector<float> sets_errors = ToHost(d_sets_errors.data(), d_sets_errors.size());
  EXPECT_EQ(std::vector<uint8_t>(sets_codes.begin(), sets_codes.begin() + got.size()),
            ToHost(d_set0_codes.data(), d_set0_codes.size()));
  EXPECT_EQ(std::vector<uint8_t>(sets_codes.begin() + code_stride,
                                 sets_codes.begin() + code_stride + got.size()),
            got);
  EXPECT_EQ(std::vector<float>(sets_errors.begin(), sets_errors.begin() + kCount),
            ToHost(d_set0_errors.data(), kCount));
  EXPECT_EQ(std::vector<float>(sets_errors.begin() + kCount + 3,
                               sets_errors.begin() + 2 * kCount + 3),
            errors);
  // Nothing written between the sets.
  for (int i = kCount; i < kCount + 3; ++i) EXPECT_EQ(sets_errors[i], -1.0f) << i;
  for (int64_t b = int64_t{kCount} * subspaces; b < code_stride; ++b) {
    EXPECT_EQ(sets_codes[b], 0) << b;
  }

  // The same keys one job each (a decode step's), in reverse order, every fifth job skipped, odd
  // keys against other codebooks full of exact ties (centroids 128-255 repeat 0-127 across
  // warps, each odd one of 0-31 repeats the even one before it within a warp): each job's code
  // and error as PqEncode's with its own codebooks, bit for bit, ties to the lower centroid; and
  // nothing written for a skipped job.
  const int sub = dim / subspaces;
  std::vector<float> tied = pq->codebooks();
  for (int m = 0; m < subspaces; ++m) {
    float* book = tied.data() + static_cast<size_t>(m) * 256 * sub;
    for (int c = 1; c < 32; c += 2) std::copy_n(book + (c - 1) * sub, sub, book + c * sub);
    std::copy_n(book, 128 * sub, book + 128 * sub);
  }
  auto d_tied = ToDevice(tied);
  auto d_tied_codes = ToDevice(std::vector<uint8_t>(want.size(), 0));
  auto d_tied_errors = ToDevice(std::vector<float>(kCount, -1.0f));
  p.codebooks = d_tied.data();
  p.codes = d_tied_codes.data();
  p.errors = d_tied_errors.data();
  ASSERT_TRUE(cuda::PqEncode(p, nullptr).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<uint8_t> tied_got = ToHost(d_tied_codes.data(), d_tied_codes.size());
  const std::vector<float> tied_errors = ToHost(d_tied_errors.data(), d_tied_errors.size());
  constexpr uint8_t kUntouched = 0xee;
  auto d_job_codes = ToDevice(std::vector<uint8_t>(want.size(), kUntouched));
  auto d_job_errors = ToDevice(std::vector<float>(kCount, -1.0f));
  std::vector<cuda::PqEncodeJob> jobs(kCount);
  for (int i = 0; i < kCount; ++i) {
    cuda::PqEncodeJob& job = jobs[kCount - 1 - i];
    job.key = d_keys.data() + (static_cast<int64_t>(i) * kKvHeads + kHead) * dim *
                                  KvElementBytes(element);
    job.codebooks = i % 2 == 0 ? d_books.data() : d_tied.data();
    job.codes = i % 5 == 4 ? nullptr : d_job_codes.data() + static_cast<int64_t>(i) * subspaces;
    job.error = d_job_errors.data() + i;
  }
  ASSERT_NO_FATAL_FAILURE(CodeByRows(jobs, element, dim, subspaces));
  const std::vector<uint8_t> job_codes = ToHost(d_job_codes.data(), d_job_codes.size());
  const std::vector<float> job_errors = ToHost(d_job_errors.data(), d_job_errors.size());
  int ties_resolved_low = 0;
  for (int i = 0; i < kCount; ++i) {
    const bool skipped = i % 5 == 4, tied_books = i % 2 == 1;
    const std::vector<uint8_t>& reference = tied_books ? tied_got : got;
    for (int m = 0; m < subspaces; ++m) {
      const int code = job_codes[i * subspaces + m];
      ASSERT_EQ(code, skipped ? kUntouched : reference[i * subspaces + m])
          << "key " << i << " part " << m;
      if (skipped || !tied_books) continue;
      ASSERT_LT(code, 128) << "key " << i << " part " << m << ": a tie goes to the lower";
      ASSERT_FALSE(code < 32 && code % 2 == 1) << "key " << i << " part " << m;
      ties_resolved_low += code < 32;
    }
    ASSERT_EQ(job_errors[i], skipped ? -1.0f : (tied_books ? tied_errors : errors)[i])
        << "key " << i;
  }
  EXPECT_GT(ties_resolved_low, 0) << "some keys fall on the tied centroids within a warp";
}

INSTANTIATE_TEST_SUITE_P(PartSizes, PqEncodeTest, ::testing::ValuesIn(PartSizes()),
                         [](const ::testing::TestParamInfo<PartSize>& info) {
                           return PartSizeName(info.param);
                         });

// PqEncode gives a warp 8 keys while blocks of 64 keys give every SM one, else 2 while blocks of
// 16 do, else 1 (the most blocks). Host arithmetic: runs without a device.
TEST(PqEncodeKeysPerWarpTest, TakesTheMostKeysThatStillGiveEverySmABlock) {
  for (const int sms : {2, 16, 132, 144}) {
    EXPECT_EQ(cuda::PqEncodeKeysPerWarp(1, 1, sms), 1) << sms;
    EXPECT_EQ(cuda::PqEncodeKeysPerWarp(16 * (sms - 1), 1, sms), 1) << sms;
    EXPECT_EQ(cuda::PqEncodeKeysPerWarp(16 * (sms - 1) + 1, 1, sms), 2) << sms;
    EXPECT_EQ(cuda::PqEncodeKeysPerWarp(64 * (sms - 1), 1, sms), 2) << sms;
    EXPECT_EQ(cuda::PqEncodeKeysPerWarp(64 * (sms - 1) + 1, 1, sms), 8) << sms;
  }
  // The served chunks (8 KV heads) on an H100's 132 SMs, as pq_encode.md timed them.
  EXPECT_EQ(cuda::PqEncodeKeysPerWarp(8, 8, 132), 1);
  EXPECT_EQ(cuda::PqEncodeKeysPerWarp(512, 8, 132), 2);
  EXPECT_EQ(cuda::PqEncodeKeysPerWarp(1024, 8, 132), 2);  // 128 blocks of 64 keys: too few
  EXPECT_EQ(cuda::PqEncodeKeysPerWarp(1056, 8, 132), 8);
  EXPECT_EQ(cuda::PqEncodeKeysPerWarp(16384, 1, 132), 8);  // a training's sample
}

// Whichever split PqEncode takes (chosen from the device, or each asked for), every key's code
// and error is PqEncodeRows' for the same key and codebooks, bit for bit: 2999 keys (a multiple
// of no split's block) of one KV head of two, every part size and element type.
class PqEncodeSplitTest : public ::testing::TestWithParam<std::tuple<PartSize, int>> {};

TEST_P(PqEncodeSplitTest, EverySplitCodesAsPqEncodeRows) {
  KVRECALL_SKIP_WITHOUT_GPU();
  const auto [size, keys_per_warp] = GetParam();
  const auto [element, dim, subspaces] = size;
  std::vector<float> keys = RandomNormal(static_cast<size_t>(kCount) * kKvHeads * dim, 13);
  auto d_keys = ToDevice(StoredAs(element, &keys));
  auto d_books = ToDevice(RandomNormal(static_cast<size_t>(256) * dim, 14));
  constexpr uint8_t kUntouched = 0xee;
  auto d_codes =
      ToDevice(std::vector<uint8_t>(static_cast<size_t>(kCount) * subspaces, kUntouched));
  auto d_errors = ToDevice(std::vector<float>(kCount, -1.0f));
  const size_t key_bytes = static_cast<size_t>(dim) * KvElementBytes(element);
  const cuda::PqEncodeParams p{.keys = d_keys.data() + kHead * key_bytes,
                               .element = element,
                               .count = kCount,
                               .row_stride = kKvHeads * dim,
                               .dim = dim,
                               .subspaces = subspaces,
                               .codebooks = d_books.data(),
                               .codes = d_codes.data(),
                               .errors = d_errors.data(),
                               .keys_per_warp = keys_per_warp};
  ASSERT_TRUE(cuda::PqEncode(p, nullptr).ok());
  auto d_row_codes = ToDevice(std::vector<uint8_t>(d_codes.size(), kUntouched));
  auto d_row_errors = ToDevice(std::vector<float>(kCount, -2.0f));
  std::vector<cuda::PqEncodeJob> jobs(kCount);
  for (int i = 0; i < kCount; ++i) {
    jobs[i] = cuda::PqEncodeJob{d_keys.data() + (int64_t{i} * kKvHeads + kHead) * key_bytes,
                                d_books.data(), d_row_codes.data() + int64_t{i} * subspaces,
                                d_row_errors.data() + i};
  }
  ASSERT_NO_FATAL_FAILURE(CodeByRows(jobs, element, dim, subspaces));
  const std::vector<uint8_t> codes = ToHost(d_codes.data(), d_codes.size());
  const std::vector<uint8_t> row_codes = ToHost(d_row_codes.data(), d_row_codes.size());
  const std::vector<float> errors = ToHost(d_errors.data(), d_errors.size());
  const std::vector<float> row_errors = ToHost(d_row_errors.data(), d_row_errors.size());
  for (int i = 0; i < kCount; ++i) {
    for (int m = 0; m < subspaces; ++m) {
      ASSERT_EQ(codes[i * subspaces + m], row_codes[i * subspaces + m])
          << "key " << i << " part " << m;
    }
    ASSERT_EQ(errors[i], row_errors[i]) << "key " << i;  // (-1 and -2 where untouched)
  }
}

INSTANTIATE_TEST_SUITE_P(
    Splits, PqEncodeSplitTest,
    ::testing::Combine(::testing::ValuesIn(PartSizes()), ::testing::Values(0, 1, 2, 8)),
    [](const ::testing::TestParamInfo<std::tuple<PartSize, int>>& info) {
      const int split = std::get<1>(info.param);
      return PartSizeName(std::get<0>(info.param)) +
             (split == 0 ? std::string("Chosen") : "KeysPerWarp" + std::to_string(split));
    });

// Training with the GPU's assignments (index/gpu_pq_assigner.h) gives the host team's
// quantizers: the same rule and arithmetic, so the same codebooks up to a near-tie's rounding.
TEST(GpuPqAssignerTest, TrainsTheQuantizersTheHostTrains) {
  KVRECALL_SKIP_WITHOUT_GPU();
  constexpr int kDim = 128;
  std::vector<float> keys = RandomNormal(static_cast<size_t>(kCount) * kDim, 9);
  for (size_t i = 0; i < keys.size(); ++i) keys[i] = keys[i] * (1.0f + (i % kDim) % 3) - 0.25f;
  const VectorSet set{keys.data(), kCount, kDim, kDim, KvElement::kF32};
  ProductQuantizerParams params;
  params.subspaces = 8;
  params.iterations = 5;
  params.training_keys = 2500;
  absl::StatusOr<ProductQuantizer> host = ProductQuantizer::Train(set, params);
  ASSERT_TRUE(host.ok()) << host.status();
  absl::StatusOr<std::unique_ptr<GpuPqAssigner>> assigner =
      GpuPqAssigner::Create(params.training_keys, kDim);
  ASSERT_TRUE(assigner.ok()) << assigner.status();
  absl::StatusOr<ProductQuantizer> gpu = ProductQuantizer::Train(set, params, assigner->get());
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  int differing = 0;
  for (size_t i = 0; i < host->codebooks().size(); ++i) {
    differing += host->codebooks()[i] != gpu->codebooks()[i];
  }
  EXPECT_LE(differing, static_cast<int>(host->codebooks().size() / 100));
  // Misfits: more rows than its room, another dim, codebooks of another dim.
  std::vector<uint8_t> codes(kCount * 8);
  EXPECT_EQ((*assigner)->Load(keys.data(), kCount, kDim).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*assigner)->Load(keys.data(), 10, 64).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE((*assigner)->Load(keys.data(), 10, kDim).ok());
  const std::vector<float> small(256 * 64);
  EXPECT_EQ((*assigner)->Assign(small, 8, codes.data()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(GpuPqAssigner::Create(0, kDim).status().code(), absl::StatusCode::kInvalidArgument);
}

// Keys whose distances are not finite (huge finite bf16 values overflow -2 x c; NaN and inf
// keys, which the service refuses but the kernels take): PqEncode orders them as a scan of the
// centroids in order does (centroid 0 kept when its distance is NaN, any other NaN passed over,
// the lower centroid on a tie), computed here on the host with the kernels' arithmetic, and
// PqEncodeRows as PqEncode, code for code and error for error.
TEST(PqEncodeNonFiniteTest, DistancesAreOrderedAsTheScanOrdersThem) {
  KVRECALL_SKIP_WITHOUT_GPU();
  constexpr int kDim = 128, kSubspaces = 8, kKeys = 6;
  constexpr uint16_t kMax = 0x7f7f, kMinusMax = 0xff7f, kInf = 0x7f80, kNan = 0x7fc0;
  std::vector<uint16_t> keys(kKeys * kDim, 0x3f80);  // 1.0
  for (int j = 0; j < kDim; ++j) {
    keys[0 * kDim + j] = kMax;                        // every distance -inf or +inf
    keys[1 * kDim + j] = j % 2 ? kMax : kMinusMax;    // -inf + inf: NaN distances
    keys[4 * kDim + j] = j % 3 ? kInf : kMinusMax;
  }
  keys[2 * kDim + 0] = kNan;   // NaN in the first part: every distance of part 0 NaN
  keys[3 * kDim + 77] = kNan;  // in a later part
  keys[5 * kDim + 5] = kInf;
  const std::vector<float> books = RandomNormal(static_cast<size_t>(256) * kDim, 11);
  auto d_keys = ToDevice(keys);
  auto d_books = ToDevice(books);
  auto d_codes = ToDevice(std::vector<uint8_t>(kKeys * kSubspaces, 0));
  auto d_errors = ToDevice(std::vector<float>(kKeys, 0.0f));
  const cuda::PqEncodeParams p{.keys = d_keys.data(),
                               .element = KvElement::kBf16,
                               .count = kKeys,
                               .row_stride = kDim,
                               .dim = kDim,
                               .subspaces = kSubspaces,
                               .codebooks = d_books.data(),
                               .codes = d_codes.data(),
                               .errors = d_errors.data()};
  ASSERT_TRUE(cuda::PqEncode(p, nullptr).ok());
  auto d_row_codes = ToDevice(std::vector<uint8_t>(kKeys * kSubspaces, 0));
  auto d_row_errors = ToDevice(std::vector<float>(kKeys, 0.0f));
  std::vector<cuda::PqEncodeJob> jobs(kKeys);
  for (int i = 0; i < kKeys; ++i) {
    jobs[i] = cuda::PqEncodeJob{d_keys.data() + i * kDim, d_books.data(),
                                d_row_codes.data() + i * kSubspaces, d_row_errors.data() + i};
  }
  ASSERT_NO_FATAL_FAILURE(CodeByRows(jobs, KvElement::kBf16, kDim, kSubspaces));
  EXPECT_EQ(ToHost(d_row_codes.data(), d_row_codes.size()),
            ToHost(d_codes.data(), d_codes.size()));
  const std::vector<float> want = ToHost(d_errors.data(), kKeys);
  const std::vector<float> got = ToHost(d_row_errors.data(), kKeys);
  auto same = [](float a, float b) { return (std::isnan(a) && std::isnan(b)) || a == b; };
  for (int i = 0; i < kKeys; ++i) EXPECT_PRED2(same, got[i], want[i]) << "key " << i;

  // The scan, on the host: |c|^2 and -2 x (bf16 widened) as fmaf chains in dim order, as
  // pq_encode.h states (a correctly rounded fma on both sides), then the squared errors.
  constexpr int kSub = kDim / kSubspaces;
  const std::vector<uint8_t> codes = ToHost(d_codes.data(), d_codes.size());
  for (int i = 0; i < kKeys; ++i) {
    float error = 0.0f;
    for (int m = 0; m < kSubspaces; ++m) {
      float scaled[kSub];
      for (int j = 0; j < kSub; ++j) {
        const uint32_t bits = uint32_t{keys[i * kDim + m * kSub + j]} << 16;
        float x;
        std::memcpy(&x, &bits, sizeof x);
        scaled[j] = -2.0f * x;
      }
      int best_c = 0;
      float best = 0.0f;
      for (int c = 0; c < 256; ++c) {
        const float* centroid = books.data() + (static_cast<size_t>(m) * 256 + c) * kSub;
        float norm = 0.0f;
        for (int j = 0; j < kSub; ++j) norm = std::fmaf(centroid[j], centroid[j], norm);
        float distance = norm;
        for (int j = 0; j < kSub; ++j) distance = std::fmaf(scaled[j], centroid[j], distance);
        if (c == 0 || distance < best) {
          best = distance;
          best_c = c;
        }
      }
      EXPECT_EQ(codes[i * kSubspaces + m], best_c) << "key " << i << " part " << m;
      const float* chosen = books.data() + (static_cast<size_t>(m) * 256 + best_c) * kSub;
      for (int j = 0; j < kSub; ++j) {
        const float diff = -0.5f * scaled[j] - chosen[j];
        error = std::fmaf(diff, diff, error);
      }
    }
    EXPECT_PRED2(same, want[i], error) << "key " << i;
  }
}

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
  p.codes = codes.data();
  p.sets = 0;
  expect_invalid(cuda::PqEncode(p, nullptr), "sets=0");
  p.sets = 65536;
  expect_invalid(cuda::PqEncode(p, nullptr), "sets=65536");
  p.sets = 2;  // set 1 would write set 0's codes (strides 0)
  expect_invalid(cuda::PqEncode(p, nullptr), "code_set_stride=0");
  p.code_set_stride = 4 * 8;
  EXPECT_TRUE(cuda::PqEncode(p, nullptr).ok());  // no errors: their stride unread
  p.keys_per_warp = 4;
  expect_invalid(cuda::PqEncode(p, nullptr), "keys_per_warp is 0 (chosen), 1, 2 or 8; got 4");
  p.keys_per_warp = 2;
  EXPECT_TRUE(cuda::PqEncode(p, nullptr).ok());
  p.sets = 1;
  p.codes = nullptr;
  p.count = 0;  // nothing to code: nothing read
  EXPECT_TRUE(cuda::PqEncode(p, nullptr).ok());

  cuda::PqEncodeRowsParams rows;
  rows.count = 4;
  rows.dim = 64;
  rows.subspaces = 3;
  expect_invalid(cuda::PqEncodeRows(rows, nullptr), "subspaces=3 dim=64");
  rows.subspaces = 8;
  expect_invalid(cuda::PqEncodeRows(rows, nullptr), "device pointer");  // no jobs
  rows.count = -1;
  expect_invalid(cuda::PqEncodeRows(rows, nullptr), "count=-1");
  rows.count = 0;  // nothing to code: the null jobs not read
  EXPECT_TRUE(cuda::PqEncodeRows(rows, nullptr).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

}  // namespace
}  // namespace kvrecall
