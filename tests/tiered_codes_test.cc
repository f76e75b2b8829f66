// The product-quantized codes of a tiered layer's bulk, read back from where the static tier
// keeps them (host memory on the host tier; device memory on a GPU's) after decode steps
// through the layer-backend seam: every coded row, the prompt's and those the steps coded as
// their tokens left the ring, holds the nearest centroids of that row's own key, and the keys
// planted far from the rest are outliers at their own rows. A step that coded the wrong ring
// slot, or wrote a code or an outlier to the wrong row, fails here. So do codes learned again
// as a short prompt's bulk grows (server/backends/codes_learning.h) that take over at another
// length, miss rows, or leave the exact path scanning the whole bulk.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "index/basic_selectors.h"
#include "kernels/dtype.h"
#include "server/backends/bulk_codes.h"
#include "server/backends/codes_learning.h"
#include "server/backends/placements.h"
#include "server/backends/tiered_backend.h"
#include "server/memory_budget.h"
#include "server/work_queue.h"
#include "tests/server_fixture.h"
#include "tests/queue_blocker.h"
#include "tests/test_util.h"

namespace kvrecall {
namespace {

using ::kvrecall::testing::HasStatus;
using ::kvrecall::testing::PqPartDistance;
using ::kvrecall::testing::QueueBlocker;
using ::kvrecall::testing::RandomNormal;
using ::kvrecall::testing::StopAfterAsks;

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

// A layer of Config()'s shape with a prompt of `prompt` tokens (keys and values drawn from
// `seed`), whose keys as the layer stores them go to *keys ([tokens, kv_heads, head_dim]).
absl::StatusOr<std::unique_ptr<LayerBackend>> PrefilledLayer(AttentionBackend& backend,
                                                            const SessionAccounts& accounts,
                                                            const LayerConfig& config,
                                                            int64_t prompt, uint64_t seed,
                                                            std::vector<float>* keys,
                                                            const BuildStop& stop = BuildStop()) {
  const int64_t row = int64_t{kKvHeads} * kDim;
  *keys = Rounded(RandomNormal(prompt * row, seed));
  const std::vector<float> values = RandomNormal(prompt * row, seed + 1);
  absl::StatusOr<std::unique_ptr<PromptStaging>> staging =
      backend.NewPromptStaging(config, accounts);
  if (!staging.ok()) return staging.status();
  if ((*staging)->kv_element() != KvElement::kBf16) {
    return absl::InternalError("a tiered layer of a bf16 session stages bf16 KV");
  }
  if (absl::Status s = (*staging)->Reserve(prompt, "test"); !s.ok()) return s;
  auto* key_tail = static_cast<uint16_t*>((*staging)->key_tail());
  auto* value_tail = static_cast<uint16_t*>((*staging)->value_tail());
  for (int64_t i = 0; i < prompt * row; ++i) {
    key_tail[i] = FloatToBf16((*keys)[i]);
    value_tail[i] = FloatToBf16(values[i]);
  }
  if (absl::Status s = (*staging)->Commit(prompt, /*with_queries=*/false); !s.ok()) return s;
  return backend.BuildLayer(config, accounts, *std::move(staging), stop);
}

// A decode step of `layer` with step `step`'s query and token (its key 40x longer than the
// others' when planted: far from every centroid), the key appended to *keys.
void DecodeStep(AttentionBackend& backend, StepContext* context, LayerBackend* layer, int step,
                bool planted, std::vector<float>* keys, std::vector<HeadReport>* heads) {
  const int64_t row = int64_t{kKvHeads} * kDim;
  const std::vector<float> q = RandomNormal(kQHeads * kDim, 1000 + step);
  const std::vector<float> k = Rounded(RandomNormal(row, 2000 + step, planted ? 40 : 1));
  const std::vector<float> v = RandomNormal(row, 3000 + step);
  keys->insert(keys->end(), k.begin(), k.end());
  std::vector<float> o(kQHeads * kDim), lse(kQHeads);
  heads->assign(kQHeads, HeadReport{});
  ASSERT_TRUE(layer->ReserveToken().ok()) << step;
  LayerStep one{layer, q.data(), k.data(), v.data(), o.data(), lse.data(), heads->data()};
  ASSERT_TRUE(backend.Step(std::span<LayerStep>(&one, 1), context).ok()) << step;
  for (float x : lse) ASSERT_TRUE(std::isfinite(x)) << step;
}

// Every coded row of `codes` (bulk rows [0, coded)) holds the nearest centroids of its own
// key (`keys`: every token's, the bulk from token kSinks).
void ExpectNearestCodes(const BulkCodes& codes, const std::vector<float>& keys) {
  const int64_t row = int64_t{kKvHeads} * kDim;
  const int64_t bulk = codes.coded();
  const int subspaces = codes.subspaces();
  for (int h = 0; h < kKvHeads; ++h) {
    absl::StatusOr<std::vector<uint8_t>> read = codes.ReadCodes(h, 0, bulk);
    ASSERT_TRUE(read.ok()) << read.status();
    const ProductQuantizer& pq = codes.quantizer(h);
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
                        << best;
        }
      }
    }
    EXPECT_EQ(misses, 0) << "KV head " << h;
  }
}

void CheckCodes(AttentionBackend& backend) {
  SCOPED_TRACE(backend.device());
  MemoryBudget host(0);
  const SessionAccounts accounts{&host, backend.device_budget()};
  const LayerConfig config = Config();
  ASSERT_TRUE(backend.CheckConfig(config).ok());
  // Every token's keys as the layer stores them, [tokens, kv_heads, head_dim].
  std::vector<float> keys;
  absl::StatusOr<std::unique_ptr<LayerBackend>> layer =
      PrefilledLayer(backend, accounts, config, kPrompt, /*seed=*/21, &keys);
  ASSERT_TRUE(layer.ok()) << layer.status();

  std::unique_ptr<StepContext> context = backend.NewStepContext(nullptr);
  std::vector<HeadReport> heads;
  for (int step = 0; step < kSteps; ++step) {
    DecodeStep(backend, context.get(), layer->get(), step, kPlanted.count(step) > 0, &keys,
               &heads);
    if (::testing::Test::HasFatalFailure()) return;
  }

  const BulkCodes* codes = (*layer)->bulk_codes();
  ASSERT_NE(codes, nullptr);
  const int64_t tokens = kPrompt + kSteps;
  const int64_t bulk = tokens - kSinks - kRecent;
  // The bulk as it stands: the prompt's, and a token for every step that pushed one out.
  ASSERT_EQ(codes->coded(), bulk);
  ExpectNearestCodes(*codes, keys);
  const int subspaces = codes->subspaces();
  for (int h = 0; h < kKvHeads; ++h) {
    // A part of the range reads the same rows.
    absl::StatusOr<std::vector<uint8_t>> read = codes->ReadCodes(h, 0, bulk);
    ASSERT_TRUE(read.ok()) << read.status();
    absl::StatusOr<std::vector<uint8_t>> part = codes->ReadCodes(h, 600, 700);
    ASSERT_TRUE(part.ok()) << part.status();
    EXPECT_EQ(*part, std::vector<uint8_t>(read->begin() + 600 * subspaces,
                                          read->begin() + 700 * subspaces));
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

// Codes learned again as the bulk grows (server/backends/codes_learning.h), on `backend`:
// a prompt of `prompt` tokens decodes, in the model's layer `model_layer`, until its bulk has
// passed the first learning's take-over; the codes change at that length exactly (later by the
// layer's index), hold every row's nearest centroids and the keys planted since as outliers,
// and the exact path's candidates shrink to the shortlist, the outliers and the uncoded rows.
void CheckCodesLearnedAgain(AttentionBackend& backend, int64_t prompt, int32_t model_layer = 0) {
  SCOPED_TRACE(backend.device() + " prompt " + std::to_string(prompt) + " layer " +
               std::to_string(model_layer));
  MemoryBudget host(0);
  const SessionAccounts accounts{&host, backend.device_budget()};
  LayerConfig config = Config();
  config.layer = model_layer;
  std::vector<float> keys;
  absl::StatusOr<std::unique_ptr<LayerBackend>> layer =
      PrefilledLayer(backend, accounts, config, prompt, /*seed=*/31, &keys);
  ASSERT_TRUE(layer.ok()) << layer.status();
  const int64_t prompt_bulk = std::max<int64_t>(0, prompt - kSinks - kRecent);
  const bool prompt_codes = prompt_bulk >= CodesLearning::kMinLearnRows;
  const BulkCodes* codes = (*layer)->bulk_codes();
  ASSERT_EQ(codes != nullptr, prompt_codes);
  if (codes != nullptr) EXPECT_EQ(codes->learned_rows(), prompt_bulk);

  const int64_t learn_at = CodesLearning::kFirstLearnRows;
  const int64_t take_over = CodesLearning::TakeOverAt(learn_at, model_layer);
  ASSERT_EQ(take_over, CodesLearning::TakeOverAt(learn_at) + model_layer);
  ASSERT_EQ(CodesLearning::NextLearnAt(prompt_bulk, kDim), learn_at);
  std::unique_ptr<StepContext> context = backend.NewStepContext(nullptr);
  std::vector<HeadReport> heads;
  // Keys planted beyond the rows the codes learn from (the learning sees a planted key among
  // its rows, and gives it a centroid of its own): outliers of the learned codes.
  std::set<int64_t> planted_rows;
  int64_t tokens = prompt;
  int64_t before_candidates = 0, before_bulk = 0;
  for (int step = 0; BulkTokens(tokens, kSinks, kRecent) < take_over + 40; ++step) {
    const int64_t bulk = BulkTokens(tokens + 1, kSinks, kRecent);  // with the step's token
    const bool planted = tokens - kSinks >= learn_at && step % 29 == 5;
    if (planted) planted_rows.insert(tokens - kSinks);
    DecodeStep(backend, context.get(), layer->get(), step, planted, &keys, &heads);
    if (::testing::Test::HasFatalFailure()) return;
    ++tokens;
    codes = (*layer)->bulk_codes();
    if (bulk - 1 < take_over) {
      // The codes of the prompt (or none) until the take-over, whatever the learning's pace.
      ASSERT_EQ(codes != nullptr, prompt_codes) << step;
      if (codes != nullptr) ASSERT_EQ(codes->learned_rows(), prompt_bulk) << step;
      if (bulk - 1 == take_over - 1) {
        for (const HeadReport& head : heads) before_candidates += head.candidates;
        before_bulk = bulk;
      }
    } else {
      ASSERT_NE(codes, nullptr) << step;
      ASSERT_EQ(codes->learned_rows(), learn_at) << step;
    }
  }
  if (prompt_bulk < CodesLearning::kMinLearnRows) {
    // The last step before the take-over scanned the whole bulk a head: no codes yet.
    EXPECT_EQ(before_candidates, kQHeads * before_bulk);
  } else {
    // A short prompt bulk's codes held its last rows out to set the outlier bar, so that keys
    // they never saw are not all outliers (a bar set on the rows they learned from, coded
    // almost exactly, made nearly every later key one: every step then scanned the bulk).
    EXPECT_LT(before_candidates, kQHeads * before_bulk / 2);
  }

  codes = (*layer)->bulk_codes();
  const int64_t bulk = BulkTokens(tokens, kSinks, kRecent);
  ASSERT_EQ(codes->coded(), bulk);
  ExpectNearestCodes(*codes, keys);
  for (int h = 0; h < kKvHeads; ++h) {
    const std::set<int32_t> outliers(codes->outliers(h).begin(), codes->outliers(h).end());
    for (int64_t r : planted_rows) {
      if (r >= bulk) continue;  // still in the ring
      EXPECT_TRUE(outliers.count(static_cast<int32_t>(r))) << "KV head " << h << " row " << r;
    }
    // The bar is the held-out rows' 1/512 worst (here their worst), so the outliers are the
    // planted rows and a few.
    const auto planted = static_cast<int64_t>(planted_rows.size());
    EXPECT_LT(static_cast<int64_t>(outliers.size()), 2 * planted + 16) << "KV head " << h;
  }
  // Now a head's exact path scores its shortlist, the outliers and the few uncoded rows.
  for (const HeadReport& head : heads) {
    EXPECT_LT(head.candidates, config.selector.shortlist + 64) << bulk;
  }
  EXPECT_EQ(CodesLearning::NextLearnAt(learn_at, kDim), 2 * learn_at);
}

TEST(TieredCodesTest, CodesAreLearnedOnceAShortPromptsBulkHasGrown) {
  TieredBackend host_tier(MakeHostStaticSetTier());
  CheckCodesLearnedAgain(host_tier, /*prompt=*/12);
  // The stand-in of a device's exact heads takes half the heads once codes are there.
  HostStaticSetTierOptions options;
  options.exact_heads = true;
  TieredBackend exact_heads(MakeHostStaticSetTier(options), 0.5);
  CheckCodesLearnedAgain(exact_heads, /*prompt=*/12);
  absl::StatusOr<std::unique_ptr<Placements>> placements = Placements::Create(PlacementOptions{});
  ASSERT_TRUE(placements.ok()) << placements.status();
  for (const std::unique_ptr<AttentionBackend>& tiered : (*placements)->tiered()) {
    if (tiered->device_budget() != nullptr) CheckCodesLearnedAgain(*tiered, /*prompt=*/12);
  }
}

// In a model's layer 7: its codes take over seven rows after layer 0's would.
TEST(TieredCodesTest, CodesOfAShortPromptBulkAreLearnedAgain) {
  constexpr int64_t kPromptBulk = CodesLearning::kMinLearnRows + 44;
  constexpr int32_t kLayer = 7;
  TieredBackend host_tier(MakeHostStaticSetTier());
  CheckCodesLearnedAgain(host_tier, /*prompt=*/kSinks + kRecent + kPromptBulk, kLayer);
  absl::StatusOr<std::unique_ptr<Placements>> placements = Placements::Create(PlacementOptions{});
  ASSERT_TRUE(placements.ok()) << placements.status();
  for (const std::unique_ptr<AttentionBackend>& tiered : (*placements)->tiered()) {
    if (tiered->device_budget() != nullptr) {
      CheckCodesLearnedAgain(*tiered, /*prompt=*/kSinks + kRecent + kPromptBulk, kLayer);
    }
  }
}

// Too short a prompt bulk gets no codes (their held-out bar would pass too many keys): a flat
// scan of it until the first learning.
TEST(TieredCodesTest, ATinyPromptBulkGetsNoCodes) {
  TieredBackend backend(MakeHostStaticSetTier());
  MemoryBudget host(0);
  const SessionAccounts accounts{&host, nullptr};
  std::vector<float> keys;
  for (const int64_t bulk : {int64_t{40}, CodesLearning::kMinLearnRows - 1,
                             CodesLearning::kMinLearnRows}) {
    absl::StatusOr<std::unique_ptr<LayerBackend>> layer =
        PrefilledLayer(backend, accounts, Config(), kSinks + kRecent + bulk, /*seed=*/51, &keys);
    ASSERT_TRUE(layer.ok()) << layer.status();
    EXPECT_EQ((*layer)->bulk_codes() != nullptr, bulk >= CodesLearning::kMinLearnRows) << bulk;
  }
}

// A tiered layer whose Prefill will not commit stops building (index/build_stop.h): asked
// before its static set is made, as its quantizers train and before each KV head's coding of
// the prompt's bulk, each ends the build with CANCELLED, holding nothing.
TEST(TieredCodesTest, AStoppedBuildReturnsCancelledAndHoldsNothing) {
  TieredBackend backend(MakeHostStaticSetTier());
  MemoryBudget host(0);
  const SessionAccounts accounts{&host, nullptr};
  const int64_t prompt = kSinks + kRecent + CodesLearning::kMinLearnRows + 100;
  std::vector<float> keys;
  StopAfterAsks never(0);
  ASSERT_TRUE(PrefilledLayer(backend, accounts, Config(), prompt, 61, &keys, never.stop()).ok());
  EXPECT_EQ(never.asks(),
            1 + kKvHeads * BulkCodes::TrainingParams(kDim).iterations + kKvHeads)
      << "the layer's check, each head's k-means rounds, each head's coding";
  EXPECT_EQ(host.used(), 0);
  const int last_round = never.asks() - kKvHeads;  // then one ask per KV head's coding
  for (const int from : {1, 2, last_round, last_round + 1, never.asks()}) {
    SCOPED_TRACE(from);
    StopAfterAsks stop(from);
    absl::StatusOr<std::unique_ptr<LayerBackend>> layer =
        PrefilledLayer(backend, accounts, Config(), prompt, 61, &keys, stop.stop());
    EXPECT_TRUE(HasStatus(layer.status(), absl::StatusCode::kCancelled,
                          from == 1            ? "the tiered layer's build stopped"
                          : from <= last_round ? "the product quantizer's training (before round"
                                               : "the shortlist's coding stopped"))
        << layer.status();
    EXPECT_EQ(stop.asks(), from);
    EXPECT_EQ(host.used(), 0);
  }
}

// A layer closed while its codes are being learned gives every byte back: it waits for a
// learning that has begun (which reads its KV and charges its session), not for one still
// queued behind other layers' (held here), which learns nothing once the queue reaches it.
TEST(TieredCodesTest, ALayerClosedWhileItsCodesAreLearnedGivesItsMemoryBack) {
  TieredBackend backend(MakeHostStaticSetTier());
  MemoryBudget host(0);
  const SessionAccounts accounts{&host, nullptr};
  LayerConfig config = Config();
  config.expected_tokens = 0;
  std::vector<float> keys;
  for (int64_t extra : {0, 1, 3}) {
    SCOPED_TRACE(extra);
    // (Static: the process's queue may run it after this test.)
    static QueueBlocker blocker;
    if (extra == 0) CodesLearningQueue()->Push(&blocker);
    absl::StatusOr<std::unique_ptr<LayerBackend>> layer =
        PrefilledLayer(backend, accounts, config, /*prompt=*/12, /*seed=*/41, &keys);
    ASSERT_TRUE(layer.ok()) << layer.status();
    std::unique_ptr<StepContext> context = backend.NewStepContext(nullptr);
    std::vector<HeadReport> heads;
    // Up to the step that starts the learning, and `extra` more.
    const int64_t steps = CodesLearning::kFirstLearnRows + kSinks + kRecent - 12 + extra;
    for (int64_t step = 0; step < steps; ++step) {
      DecodeStep(backend, context.get(), layer->get(), static_cast<int>(step), false, &keys,
                 &heads);
      if (::testing::Test::HasFatalFailure()) break;
    }
    EXPECT_EQ((*layer)->bulk_codes(), nullptr);
    // Closed with its learning still queued (behind the blocker): at once, without waiting
    // for the queue; the learning does nothing when the queue reaches it.
    layer->reset();
    EXPECT_EQ(host.used(), 0);
    if (extra == 0) blocker.Release();
  }
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
