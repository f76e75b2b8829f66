// The product quantizer (index/product_quantizer.h) against brute force: every code is the
// nearest centroid of its part, the ADC score is the inner product with the reconstruction,
// k-means lowers the quantization error, 16-bit keys train and encode like their f32 values,
// fewer keys than centroids are reproduced exactly, and bad parameters are refused by name.
#include "index/product_quantizer.h"

#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/dtype.h"
#include "tests/test_util.h"

namespace kvrecall {
namespace {

using ::kvrecall::testing::PqPartDistance;
using ::kvrecall::testing::RandomNormal;
using ::testing::HasSubstr;

VectorSet F32Set(const std::vector<float>& data, int64_t count, int dim) {
  return VectorSet{data.data(), count, dim, dim, KvElement::kF32};
}

// Mean squared reconstruction error of `count` keys.
double QuantizationError(const ProductQuantizer& pq, const std::vector<float>& keys,
                         int64_t count) {
  const int dim = pq.dim();
  std::vector<uint8_t> codes(count * pq.subspaces());
  pq.Encode(F32Set(keys, count, dim), codes.data());
  std::vector<float> back(dim);
  double sum = 0.0;
  for (int64_t i = 0; i < count; ++i) {
    pq.Reconstruct(codes.data() + i * pq.subspaces(), back.data());
    for (int j = 0; j < dim; ++j) {
      const double diff = static_cast<double>(keys[i * dim + j]) - back[j];
      sum += diff * diff;
    }
  }
  return sum / static_cast<double>(count);
}

TEST(ProductQuantizerTest, EveryCodeIsTheNearestCentroidOfItsPart) {
  constexpr int kDim = 32, kKeys = 3000;
  const std::vector<float> keys = RandomNormal(kKeys * kDim, 1);
  ProductQuantizerParams params;
  params.subspaces = 4;
  params.training_keys = 2000;
  params.iterations = 5;
  absl::StatusOr<ProductQuantizer> pq = ProductQuantizer::Train(F32Set(keys, kKeys, kDim), params);
  ASSERT_TRUE(pq.ok()) << pq.status();
  ASSERT_EQ(pq->codebooks().size(), size_t{4} * 256 * 8);
  std::vector<uint8_t> codes(kKeys * 4);
  pq->Encode(F32Set(keys, kKeys, kDim), codes.data());
  for (int64_t i = 0; i < kKeys; ++i) {
    for (int m = 0; m < 4; ++m) {
      double best = std::numeric_limits<double>::infinity();
      for (int c = 0; c < ProductQuantizer::kCentroids; ++c) {
        best = std::min(best, PqPartDistance(*pq, keys.data() + i * kDim, m, c));
      }
      // The GEMM's rounding may pick either of two centroids this close.
      EXPECT_LE(PqPartDistance(*pq, keys.data() + i * kDim, m, codes[i * 4 + m]),
                best + 1e-4 * (1.0 + best))
          << "key " << i << " part " << m;
    }
  }
}

TEST(ProductQuantizerTest, AKeyEncodedAloneGetsItsCodeFromABatch) {
  constexpr int kDim = 64, kKeys = 2500;
  const std::vector<float> keys = RandomNormal(kKeys * kDim, 9);
  ProductQuantizerParams params;
  params.subspaces = 8;
  params.iterations = 2;
  absl::StatusOr<ProductQuantizer> pq = ProductQuantizer::Train(F32Set(keys, kKeys, kDim), params);
  ASSERT_TRUE(pq.ok()) << pq.status();
  std::vector<uint8_t> batch(kKeys * 8), alone(8);
  pq->Encode(F32Set(keys, kKeys, kDim), batch.data());
  for (int64_t i = 0; i < kKeys; i += 97) {
    pq->Encode(F32Set(keys, kKeys, kDim).Slice(i, i + 1), alone.data());
    EXPECT_EQ(std::vector<uint8_t>(batch.begin() + i * 8, batch.begin() + i * 8 + 8), alone)
        << "key " << i;
  }
}

TEST(ProductQuantizerTest, AdcScoreIsTheInnerProductWithTheReconstruction) {
  constexpr int kDim = 64, kKeys = 1500;
  const std::vector<float> keys = RandomNormal(kKeys * kDim, 2);
  const std::vector<float> queries = RandomNormal(5 * kDim, 3);
  for (int subspaces : {1, 8, 16}) {
    ProductQuantizerParams params;
    params.subspaces = subspaces;
    params.iterations = 3;
    absl::StatusOr<ProductQuantizer> pq =
        ProductQuantizer::Train(F32Set(keys, kKeys, kDim), params);
    ASSERT_TRUE(pq.ok()) << pq.status();
    std::vector<uint8_t> codes(kKeys * subspaces);
    pq->Encode(F32Set(keys, kKeys, kDim), codes.data());
    std::vector<float> table(subspaces * ProductQuantizer::kCentroids), scores(kKeys), back(kDim);
    for (int qi = 0; qi < 5; ++qi) {
      const float* q = queries.data() + qi * kDim;
      pq->QueryTable(q, table.data());
      ProductQuantizer::ScanCodes(table.data(), codes.data(), kKeys, subspaces, scores.data());
      for (int64_t i = 0; i < kKeys; ++i) {
        pq->Reconstruct(codes.data() + i * subspaces, back.data());
        double dot = 0.0, magnitude = 0.0;
        for (int j = 0; j < kDim; ++j) {
          dot += static_cast<double>(q[j]) * back[j];
          magnitude += std::abs(static_cast<double>(q[j]) * back[j]);
        }
        EXPECT_NEAR(scores[i], dot, 1e-5 * (1.0 + magnitude))
            << "M=" << subspaces << " query " << qi << " key " << i;
      }
    }
  }
}

TEST(ProductQuantizerTest, KMeansLowersTheQuantizationError) {
  // Keys around 64 cluster centres: what k-means can find and the initial sample alone cannot.
  constexpr int kDim = 16, kKeys = 8192;
  const std::vector<float> centres = RandomNormal(64 * kDim, 4, 3.0f);
  const std::vector<float> noise = RandomNormal(kKeys * kDim, 5, 0.3f);
  std::vector<float> keys(kKeys * kDim);
  for (int64_t i = 0; i < kKeys; ++i) {
    for (int j = 0; j < kDim; ++j) {
      keys[i * kDim + j] = centres[(i * 7 % 64) * kDim + j] + noise[i * kDim + j];
    }
  }
  ProductQuantizerParams params;
  params.subspaces = 2;
  params.iterations = 0;
  absl::StatusOr<ProductQuantizer> initial =
      ProductQuantizer::Train(F32Set(keys, kKeys, kDim), params);
  params.iterations = 10;
  absl::StatusOr<ProductQuantizer> trained =
      ProductQuantizer::Train(F32Set(keys, kKeys, kDim), params);
  ASSERT_TRUE(initial.ok() && trained.ok());
  const double before = QuantizationError(*initial, keys, kKeys);
  const double after = QuantizationError(*trained, keys, kKeys);
  EXPECT_LT(after, 0.8 * before) << "before " << before << " after " << after;
  // Each part of a key is one of 64 centres plus noise of variance 0.09 per dim: with 256
  // centroids a part cannot do worse than its noise.
  EXPECT_LT(after, kDim * 0.09 * 1.1);
}

TEST(ProductQuantizerTest, SixteenBitKeysTrainAndEncodeLikeTheirValues) {
  constexpr int kDim = 32, kKeys = 2000;
  std::vector<float> wide = RandomNormal(kKeys * kDim, 6);
  std::vector<uint16_t> narrow(wide.size());
  for (size_t i = 0; i < wide.size(); ++i) {
    narrow[i] = FloatToBf16(wide[i]);
    wide[i] = Bf16ToFloat(narrow[i]);
  }
  const VectorSet narrow_set{narrow.data(), kKeys, kDim, kDim, KvElement::kBf16};
  ProductQuantizerParams params;
  params.subspaces = 4;
  params.iterations = 4;
  absl::StatusOr<ProductQuantizer> a = ProductQuantizer::Train(narrow_set, params);
  absl::StatusOr<ProductQuantizer> b = ProductQuantizer::Train(F32Set(wide, kKeys, kDim), params);
  absl::StatusOr<ProductQuantizer> again = ProductQuantizer::Train(narrow_set, params);
  ASSERT_TRUE(a.ok() && b.ok() && again.ok());
  EXPECT_EQ(a->codebooks(), b->codebooks());
  EXPECT_EQ(a->codebooks(), again->codebooks());
  std::vector<uint8_t> codes_a(kKeys * 4), codes_b(kKeys * 4);
  a->Encode(narrow_set, codes_a.data());
  b->Encode(F32Set(wide, kKeys, kDim), codes_b.data());
  EXPECT_EQ(codes_a, codes_b);
}

TEST(ProductQuantizerTest, FewerKeysThanCentroidsAreReproducedExactly) {
  constexpr int kDim = 8, kKeys = 10;
  const std::vector<float> keys = RandomNormal(kKeys * kDim, 7);
  ProductQuantizerParams params;
  params.subspaces = 2;
  absl::StatusOr<ProductQuantizer> pq = ProductQuantizer::Train(F32Set(keys, kKeys, kDim), params);
  ASSERT_TRUE(pq.ok()) << pq.status();
  EXPECT_NEAR(QuantizationError(*pq, keys, kKeys), 0.0, 1e-10);
}

// A PqAssigner by brute force in double (the nearest centroid of every part, the lower number on
// a tie), counting its calls, or failing its Load.
class CountingAssigner final : public PqAssigner {
 public:
  absl::Status Load(const float* rows, int64_t count, int dim) override {
    ++loads;
    if (fail) return absl::UnavailableError("no device today");
    rows_ = rows;
    count_ = count;
    dim_ = dim;
    return absl::OkStatus();
  }
  absl::Status Assign(std::span<const float> codebooks, int subspaces, uint8_t* codes) override {
    ++assigns;
    if (assigns == cancel_after && cancel != nullptr) cancel->store(true);
    const int sub = dim_ / subspaces;
    for (int64_t i = 0; i < count_; ++i) {
      for (int m = 0; m < subspaces; ++m) {
        double best = std::numeric_limits<double>::infinity();
        for (int c = 0; c < ProductQuantizer::kCentroids; ++c) {
          const double d = PqPartDistance(codebooks, sub, rows_ + i * dim_, m, c);
          if (d < best) {
            best = d;
            codes[i * subspaces + m] = static_cast<uint8_t>(c);
          }
        }
      }
    }
    return absl::OkStatus();
  }
  int loads = 0, assigns = 0;
  bool fail = false;
  // Sets *cancel as its cancel_after-th Assign runs (a layer closing mid-training).
  std::atomic<bool>* cancel = nullptr;
  int cancel_after = 0;

 private:
  const float* rows_ = nullptr;
  int64_t count_ = 0;
  int dim_ = 0;
};

// An assigner stands in for the team's assignments: loaded once, called once a round, its
// codebooks as good as the team's (the same rule, up to rounding), its error returned as is.
TEST(ProductQuantizerTest, AnAssignerTakesOverTheTrainingAssignments) {
  constexpr int kDim = 32, kKeys = 3000;
  const std::vector<float> keys = RandomNormal(kKeys * kDim, 4);
  ProductQuantizerParams params;
  params.subspaces = 4;
  params.training_keys = 2000;
  params.iterations = 6;
  absl::StatusOr<ProductQuantizer> team =
      ProductQuantizer::Train(F32Set(keys, kKeys, kDim), params);
  ASSERT_TRUE(team.ok()) << team.status();
  CountingAssigner assigner;
  absl::StatusOr<ProductQuantizer> assigned =
      ProductQuantizer::Train(F32Set(keys, kKeys, kDim), params, &assigner);
  ASSERT_TRUE(assigned.ok()) << assigned.status();
  EXPECT_EQ(assigner.loads, 1);
  EXPECT_EQ(assigner.assigns, params.iterations);
  const double team_error = QuantizationError(*team, keys, kKeys);
  EXPECT_NEAR(QuantizationError(*assigned, keys, kKeys), team_error, 0.01 * team_error);

  CountingAssigner failing;
  failing.fail = true;
  absl::StatusOr<ProductQuantizer> failed =
      ProductQuantizer::Train(F32Set(keys, kKeys, kDim), params, &failing);
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(failing.assigns, 0);
}

// Training asks its stop before each round: requested during round 2, it stops before round 3
// with CANCELLED; never requested, it changes nothing.
TEST(ProductQuantizerTest, ACancelledTrainingStopsBeforeItsNextRound) {
  constexpr int kDim = 32, kKeys = 3000;
  const std::vector<float> keys = RandomNormal(kKeys * kDim, 6);
  ProductQuantizerParams params;
  params.subspaces = 4;
  params.iterations = 6;
  std::atomic<bool> cancelled{false};
  params.stop = BuildStop::WhenSet(&cancelled);
  CountingAssigner assigner;
  assigner.cancel = &cancelled;
  assigner.cancel_after = 2;
  const absl::StatusOr<ProductQuantizer> stopped =
      ProductQuantizer::Train(F32Set(keys, kKeys, kDim), params, &assigner);
  EXPECT_EQ(stopped.status().code(), absl::StatusCode::kCancelled) << stopped.status();
  EXPECT_THAT(stopped.status().message(), HasSubstr("training (before round 3 of 6) stopped"));
  EXPECT_EQ(assigner.assigns, 2);

  cancelled.store(false);
  const absl::StatusOr<ProductQuantizer> asked = ProductQuantizer::Train(
      F32Set(keys, kKeys, kDim), params);
  params.stop = BuildStop();
  const absl::StatusOr<ProductQuantizer> plain = ProductQuantizer::Train(
      F32Set(keys, kKeys, kDim), params);
  ASSERT_TRUE(asked.ok() && plain.ok());
  EXPECT_EQ(asked->codebooks(), plain->codebooks());
}

TEST(ProductQuantizerTest, BadParametersAreRefusedByName) {
  const std::vector<float> keys = RandomNormal(100 * 12, 8);
  const VectorSet set = F32Set(keys, 100, 12);
  ProductQuantizerParams params;
  params.subspaces = 5;  // does not divide 12
  absl::StatusOr<ProductQuantizer> pq = ProductQuantizer::Train(set, params);
  EXPECT_EQ(pq.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(pq.status().message(), HasSubstr("divide the key dimension 12 (got 5)"));
  params.subspaces = 0;
  EXPECT_EQ(ProductQuantizer::Train(set, params).status().code(),
            absl::StatusCode::kInvalidArgument);
  params.subspaces = 4;
  params.iterations = -1;
  pq = ProductQuantizer::Train(set, params);
  EXPECT_EQ(pq.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(pq.status().message(), HasSubstr("iterations must be >= 0"));
  params.iterations = 1;
  params.training_keys = 0;
  EXPECT_EQ(ProductQuantizer::Train(set, params).status().code(),
            absl::StatusCode::kInvalidArgument);
  params.training_keys = 100;
  pq = ProductQuantizer::Train(set.Slice(0, 0), params);
  EXPECT_EQ(pq.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(pq.status().message(), HasSubstr("no keys"));
}

}  // namespace
}  // namespace kvrecall
