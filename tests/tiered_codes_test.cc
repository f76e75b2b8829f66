// The product-quantized codes of a tiered layer's bulk, read back from where the static tier
// keeps them (host memory on the host tier; device memory on a GPU's) after decode steps
// through the layer-backend seam: every coded row, the prompt's and those the steps coded as
// their tokens left the ring, holds the nearest centroids of that row's own key, and the keys
// planted far from the rest are outliers at their own rows. A step that coded the wrong ring
// slot, or wrote a code or an outlier to the wrong row, fails here.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <set>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/dtype.h"
#include "server/backends/bulk_codes.h"
#include "server/backends/placements.h"
#include "server/backends/tiered_backend.h"
#include "server/memory_budget.h"
#include "tests/server_fixture.h"
#include "tests/test_util.h"

namespace kvrecall {
namespace {

using ::kvrecall::testing::HasStatus;
using ::kvrecall::testing::PqPartDistance;
using ::kvrecall::testing::RandomNormal;

constexpr int kQHeads = 8, kKvHeads = 2, kDim = 64;
constexpr int kSinks = 4, kRecent = 16;
constexpr int64_t kPrompt = 700;
constexpr int kSteps = 60;
// Decode steps whose keys are planted 40x longer than the others': far from every centroid.
const std::set<int> kPlanted = {5, 17, 30};

LayerConfig Config() {
  LayerConfig config;
  config.shape = LayerShape{kQHeads, kKvHeads, kDim, 1.0f / std::sqrt(float{kDim})};
  config.dtype = v1::DTYPE_BF16;
  config.selector.kind = SelectorKind::kIndex;
  config.selector.top_k = 16;
  config.selector.shortlist = 64;
  config.selector.sinks = kSinks;
  config.selector.recent = kRecent;
  // Fewer than the steps bring: the codes grow (and move) during the decode.
  config.expected_tokens = kPrompt + 10;
  return config;
}

// f32 rounded to the bf16 the layer stores.
std::vector<float> Rounded(std::vector<float> x) {
  for (float& v : x) v = Bf16ToFloat(FloatToBf16(v));
  return x;
}

void CheckCodes(AttentionBackend& backend) {
  SCOPED_TRACE(backend.device());
  MemoryBudget host(0);
  const SessionAccounts accounts{&host, backend.device_budget()};
  const LayerConfig config = Config();
  ASSERT_TRUE(backend.CheckConfig(config).ok());

  // Every token's keys as the layer stores them, [tokens, kv_heads, head_dim].
  const int64_t row = int64_t{kKvHeads} * kDim;
  std::vector<float> keys = Rounded(RandomNormal(kPrompt * row, /*seed=*/21));
  const std::vector<float> values = RandomNormal(kPrompt * row, /*seed=*/22);
  absl::StatusOr<std::unique_ptr<PromptStaging>> staging =
      backend.NewPromptStaging(config, accounts);
  ASSERT_TRUE(staging.ok()) << staging.status();
  ASSERT_EQ((*staging)->kv_element(), KvElement::kBf16);
  ASSERT_TRUE((*staging)->Reserve(kPrompt, "test").ok());
  auto* key_tail = static_cast<uint16_t*>((*staging)->key_tail());
  auto* value_tail = static_cast<uint16_t*>((*staging)->value_tail());
  for (int64_t i = 0; i < kPrompt * row; ++i) {
    key_tail[i] = FloatToBf16(keys[i]);
    value_tail[i] = FloatToBf16(values[i]);
  }
  ASSERT_TRUE((*staging)->Commit(kPrompt, /*with_queries=*/false).ok());
  absl::StatusOr<std::unique_ptr<LayerBackend>> layer =
      backend.BuildLayer(config, accounts, *std::move(staging));
  ASSERT_TRUE(layer.ok()) << layer.status();

  std::unique_ptr<StepContext> context = backend.NewStepContext();
  std::vector<float> o(kQHeads * kDim), lse(kQHeads);
  std::vector<HeadReport> heads(kQHeads);
  for (int step = 0; step < kSteps; ++step) {
    const std::vector<float> q = RandomNormal(kQHeads * kDim, 1000 + step);
    std::vector<float> k = Rounded(RandomNormal(row, 2000 + step, kPlanted.count(step) ? 40 : 1));
    const std::vector<float> v = RandomNormal(row, 3000 + step);
    keys.insert(keys.end(), k.begin(), k.end());
    ASSERT_TRUE((*layer)->ReserveToken().ok());
    LayerStep one{layer->get(), q.data(), k.data(), v.data(), o.data(), lse.data(), heads.data()};
    ASSERT_TRUE(backend.Step(std::span<LayerStep>(&one, 1), context.get()).ok()) << step;
  }

  const BulkCodes* codes = (*layer)->bulk_codes();
  ASSERT_NE(codes, nullptr);
  const int64_t tokens = kPrompt + kSteps;
  const int64_t bulk = tokens - kSinks - kRecent;
  // The bulk as it stands: the prompt's, and a token for every step that pushed one out.
  ASSERT_EQ(codes->coded(), bulk);
  const int subspaces = codes->subspaces();
  for (int h = 0; h < kKvHeads; ++h) {
    absl::StatusOr<std::vector<uint8_t>> read = codes->ReadCodes(h, 0, bulk);
    ASSERT_TRUE(read.ok()) << read.status();
    // A part of the range reads the same rows.
    absl::StatusOr<std::vector<uint8_t>> part = codes->ReadCodes(h, 600, 700);
    ASSERT_TRUE(part.ok()) << part.status();
    EXPECT_EQ(*part, std::vector<uint8_t>(read->begin() + 600 * subspaces,
                                          read->begin() + 700 * subspaces));
    const ProductQuantizer& pq = codes->quantizer(h);
    int misses = 0;
    for (int64_t r = 0; r < bulk; ++r) {
      const float* x = keys.data() + (kSinks + r) * row + int64_t{h} * kDim;
      for (int m = 0; m < subspaces; ++m) {
        double best = std::numeric_limits<double>::infinity();
        for (int c = 0; c < ProductQuantizer::kCentroids; ++c) {
          best = std::min(best, PqPartDistance(pq, x, m, c));
        }
        // Nearest up to the float rounding a device sums in another order.
        const double got = PqPartDistance(pq, x, m, (*read)[r * subspaces + m]);
        if (got > best * (1 + 1e-4) + 1e-6 && ++misses <= 5) {
          ADD_FAILURE() << "KV head " << h << " bulk row " << r << " part " << m << ": code "
                        << int{(*read)[r * subspaces + m]} << " at " << got << ", nearest "
                        << best << (r >= kPrompt - kSinks - kRecent ? " (coded by a step)" : "");
        }
      }
    }
    EXPECT_EQ(misses, 0) << "KV head " << h;
    // The planted keys left the ring kRecent steps after they came: outliers at their rows.
    const std::set<int32_t> outliers(codes->outliers(h).begin(), codes->outliers(h).end());
    for (int step : kPlanted) {
      const int32_t bulk_row = static_cast<int32_t>(kPrompt + step - kSinks);
      ASSERT_LT(bulk_row, bulk);
      EXPECT_TRUE(outliers.count(bulk_row)) << "KV head " << h << " step " << step;
    }
    EXPECT_LT(static_cast<int64_t>(outliers.size()), bulk / 8) << "KV head " << h;
  }

  // What cannot be read is refused by name.
  EXPECT_TRUE(HasStatus(codes->ReadCodes(0, 0, bulk + 1).status(),
                        absl::StatusCode::kOutOfRange, "coded"));
  EXPECT_TRUE(HasStatus(codes->ReadCodes(0, -1, 4).status(), absl::StatusCode::kOutOfRange,
                        "rows [-1, 4)"));
  EXPECT_TRUE(HasStatus(codes->ReadCodes(0, 5, 4).status(), absl::StatusCode::kInvalidArgument,
                        "rows [5, 4)"));
  EXPECT_TRUE(HasStatus(codes->ReadCodes(kKvHeads, 0, 1).status(),
                        absl::StatusCode::kOutOfRange, "KV head 2 out of [0, 2)"));
}

// The host tier everywhere; the device tiers where there is a device.
TEST(TieredCodesTest, EveryCodedRowHoldsItsOwnKeysNearestCentroidsAndOutliersTheirRows) {
  TieredBackend host_tier(MakeHostStaticSetTier());
  CheckCodes(host_tier);
  absl::StatusOr<std::unique_ptr<Placements>> placements = Placements::Create(PlacementOptions{});
  ASSERT_TRUE(placements.ok()) << placements.status();
  for (const std::unique_ptr<AttentionBackend>& tiered : (*placements)->tiered()) {
    if (tiered->device_budget() != nullptr) CheckCodes(*tiered);
  }
}

}  // namespace
}  // namespace kvrecall
