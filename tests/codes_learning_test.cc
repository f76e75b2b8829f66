// CodesLearning (server/backends/codes_learning.h) on the host tier, driven as a tiered layer
// drives it (OnCommitted after each token, BeforeReserve before the next): its schedule; codes
// that take over at their length whatever the learning's pace (a learning held up on its queue
// until the take-over gives the same codes, bit for bit, as one that ran at once and coded the
// later rows as they came); a learning waited for before the rows it reads move; and a learning
// the budget refuses, which leaves the codes as they were.
#include "server/backends/codes_learning.h"

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <memory>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/vector_set.h"
#include "server/backends/bulk_codes.h"
#include "server/backends/tiered_backend.h"
#include "server/memory_budget.h"
#include "server/work_queue.h"
#include "tests/queue_blocker.h"
#include "tests/server_fixture.h"
#include "tests/test_util.h"

namespace kvrecall {
namespace {

using ::kvrecall::testing::HasStatus;
using ::kvrecall::testing::NarrowedKv;
using ::kvrecall::testing::QueueBlocker;
using ::kvrecall::testing::RandomKv;
using ::kvrecall::testing::StopAfterAsks;

constexpr int kQHeads = 4, kKvHeads = 2, kDim = 64;

LayerConfig Config() {
  LayerConfig config;
  config.shape = LayerShape{kQHeads, kKvHeads, kDim, 1.0f / std::sqrt(float{kDim})};
  config.selector.kind = SelectorKind::kIndex;
  config.selector.top_k = 16;
  config.selector.shortlist = 64;
  config.selector.sinks = 4;
  config.selector.recent = 16;
  config.dtype = v1::DTYPE_BF16;
  return config;
}

// Every coded row's codes and every head's outliers, as read back.
struct CodesState {
  int64_t coded = 0, learned_rows = 0;
  std::vector<std::vector<uint8_t>> codes;
  std::vector<std::vector<int32_t>> outliers;
  bool operator==(const CodesState&) const = default;
};
CodesState StateOf(const BulkCodes& codes) {
  CodesState state{codes.coded(), codes.learned_rows(), {}, {}};
  for (int h = 0; h < codes.kv_heads(); ++h) {
    absl::StatusOr<std::vector<uint8_t>> read = codes.ReadCodes(h, 0, codes.coded());
    EXPECT_TRUE(read.ok()) << read.status();
    state.codes.push_back(read.ok() ? *read : std::vector<uint8_t>());
    state.outliers.emplace_back(codes.outliers(h).begin(), codes.outliers(h).end());
  }
  return state;
}

// On the host tier, and on the GPU tier where there is a device (its learning codes on the
// device, in chunks, whoever codes which rows).
class CodesLearningTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    if (!GetParam()) return;
    absl::StatusOr<std::unique_ptr<StaticSetTier>> tier =
        MakeGpuStaticSetTier(0, &device_, /*cuda_graphs=*/true);
    if (!tier.ok()) GTEST_SKIP() << "no GPU tier here: " << tier.status();
    tier_ = *std::move(tier);
    accounts_.device = &device_;
  }

  // A bulk of up to kRows rows, its first `rows` committed (bf16, as a GPU tier codes it).
  static constexpr int64_t kRows = 2048;
  KvView Bulk(int64_t rows) const { return narrowed_.view().Tokens(0, rows); }

  // Drives a layer with no codes from an empty bulk to `rows` rows on `queue`. Without `held`,
  // the learning is waited for (as before rows move) ten rows in, so that it has coded those
  // and the take-over codes the rest; with it, the learning waits on the queue until the
  // take-over, which waits for it (it codes every row then). Returns the codes.
  std::unique_ptr<BulkCodes> Drive(WorkQueue* queue, int64_t rows, QueueBlocker* held) {
    CodesLearning learning(tier_.get(), &config_, accounts_, 0, queue, &tally_);
    std::unique_ptr<BulkCodes> codes;
    const int64_t take_over = CodesLearning::TakeOverAt(CodesLearning::kFirstLearnRows);
    std::thread releaser;
    for (int64_t n = 0; n < rows; ++n) {
      if (held != nullptr && n == take_over) {
        // The take-over's BeforeReserve waits for the held learning: released from elsewhere.
        releaser = std::thread([held] {
          std::this_thread::sleep_for(std::chrono::milliseconds(50));
          held->Release();
        });
      }
      const bool wait = held == nullptr && n == CodesLearning::kFirstLearnRows + 10;
      learning.BeforeReserve(Bulk(n), /*rows_move=*/wait, &codes);
      EXPECT_EQ(codes != nullptr, n >= take_over) << n;
      learning.OnCommitted(Bulk(n + 1));
      EXPECT_EQ(learning.learning(), n + 1 >= CodesLearning::kFirstLearnRows && n < take_over)
          << n;
    }
    if (releaser.joinable()) releaser.join();
    return codes;
  }

  LayerConfig config_ = Config();
  NarrowedKv narrowed_{RandomKv(kRows, kKvHeads, kDim, 5), KvElement::kBf16};
  std::unique_ptr<StaticSetTier> tier_ = MakeHostStaticSetTier();
  MemoryBudget host_{0};
  MemoryBudget device_{0};
  SessionAccounts accounts_{&host_, nullptr};
  CodesLearningTally tally_;
};

INSTANTIATE_TEST_SUITE_P(Tiers, CodesLearningTest, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "Gpu" : "Host";
                         });

TEST(CodesLearningScheduleTest, FirstAt1024ThenAtEveryDoublingUntilTheTrainingsSample) {
  const int64_t sample = BulkCodes::TrainingParams(kDim).training_keys;
  EXPECT_EQ(CodesLearning::NextLearnAt(0, kDim), 1024);
  EXPECT_EQ(CodesLearning::NextLearnAt(40, kDim), 1024);
  EXPECT_EQ(CodesLearning::NextLearnAt(1024, kDim), 2048);
  EXPECT_EQ(CodesLearning::NextLearnAt(10000, kDim), 20000);
  EXPECT_EQ(CodesLearning::NextLearnAt(sample - 1, kDim), 2 * (sample - 1));
  EXPECT_EQ(CodesLearning::NextLearnAt(sample, kDim), 0);
  EXPECT_EQ(CodesLearning::TakeOverAt(1024), 1536);
  EXPECT_EQ(CodesLearning::TakeOverAt(3), 4);
}

// A model's layers, which all learn at the same token, take over one a token: each a row
// later than the layer before, wrapping after a quarter of the rows learned from, so that every
// take-over comes before the next learning (twice the rows).
TEST(CodesLearningScheduleTest, EachLayerTakesOverARowAfterTheLayerBefore) {
  EXPECT_EQ(CodesLearning::TakeOverAt(1024, 0), 1536);
  EXPECT_EQ(CodesLearning::TakeOverAt(1024, 1), 1537);
  EXPECT_EQ(CodesLearning::TakeOverAt(1024, 31), 1567);
  EXPECT_EQ(CodesLearning::TakeOverAt(1024, 255), 1791);
  EXPECT_EQ(CodesLearning::TakeOverAt(1024, 256), 1536);
  EXPECT_EQ(CodesLearning::TakeOverAt(3, 5), 4) << "too few rows to spread over";
  for (const int64_t rows : {int64_t{3}, int64_t{256}, int64_t{1024}, int64_t{40000}}) {
    for (int32_t layer = 0; layer < 400; ++layer) {
      ASSERT_LT(CodesLearning::TakeOverAt(rows, layer), 2 * rows) << rows << " " << layer;
    }
  }
}

TEST_P(CodesLearningTest, CodesTakeOverAtTheirLengthWhateverTheLearningsPace) {
  const int64_t rows = CodesLearning::TakeOverAt(CodesLearning::kFirstLearnRows) + 20;
  const int64_t take_over = CodesLearning::TakeOverAt(CodesLearning::kFirstLearnRows);
  // At once, on a queue of its own.
  WorkQueue prompt(1, "test-prompt");
  const std::unique_ptr<BulkCodes> at_once = Drive(&prompt, rows, nullptr);
  ASSERT_NE(at_once, nullptr);
  EXPECT_EQ(at_once->learned_rows(), CodesLearning::kFirstLearnRows);
  EXPECT_EQ(at_once->coded(), take_over);  // later rows are the tier's to code, at its steps
  // Held on its queue until the take-over.
  WorkQueue held_queue(1, "test-held");
  QueueBlocker blocker;
  held_queue.Push(&blocker);
  const std::unique_ptr<BulkCodes> held = Drive(&held_queue, rows, &blocker);
  ASSERT_NE(held, nullptr);
  EXPECT_TRUE(StateOf(*held) == StateOf(*at_once));
  EXPECT_EQ(tally_.count(LearningOutcome::kTakenOver), 2);
  EXPECT_EQ(tally_.count(LearningOutcome::kRefused) + tally_.count(LearningOutcome::kFailed) +
                tally_.count(LearningOutcome::kAbandoned),
            0);
  // Rows beyond those the codebooks learned from are there, and the outliers are few.
  for (int h = 0; h < kKvHeads; ++h) {
    EXPECT_LT(at_once->outliers(h).size(), 16u) << "KV head " << h;
  }
  EXPECT_GT((GetParam() ? device_ : host_).used(), 0);  // the codes, charged to the session
}

// A tier codes a bulk's keys as its quantizers encode them, whether the rows are few or many (a
// prompt's bulk; a few rows, then many, coded after it: the GPU tier codes every KV head in one
// launch a chunk of 2048 rows, its staging not zeroed, and the last case takes three chunks),
// and each row's error goes to its own KV head's outliers: keys planted far from every centroid
// in KV head 1 alone, in rows coded by each call, are that head's outliers and not the other's.
TEST_P(CodesLearningTest, CodedRowsAreTheQuantizersEncodingFewOrMany) {
  // The last case codes past two of the GPU tier's chunks of 2048 rows in one call, a far key in
  // its last, partial chunk.
  constexpr int64_t kMostRows = 4700;
  constexpr int64_t kPlanted[] = {302, 1200, 1503, 1800, 4500};
  for (const auto& [prompt, rows] : {std::pair<int64_t, int64_t>{300, kRows},
                                     std::pair<int64_t, int64_t>{1500, kRows},
                                     std::pair<int64_t, int64_t>{300, kMostRows}}) {
    SCOPED_TRACE(absl::StrCat(prompt, " rows of prompt, ", rows, " coded"));
    // Planted after the prompt alone: a far key among the rows that train the codebooks (or
    // set the outliers' bar) would shape them instead.
    RandomKv kv(rows, kKvHeads, kDim, 5);
    // (Init-captures: clang's OpenMP mode cannot capture a structured binding.)
    auto planted_in = [from = prompt, to = rows](int64_t row) { return row >= from && row < to; };
    for (const int64_t row : kPlanted) {
      if (!planted_in(row)) continue;
      float* key = kv.keys.data() + (row * kKvHeads + 1) * kDim;
      for (int i = 0; i < kDim; ++i) key[i] *= 20.0f;
    }
    const NarrowedKv planted(kv, KvElement::kBf16);
    const KvView all = planted.view().Tokens(0, rows);
    absl::StatusOr<std::unique_ptr<BulkCodes>> codes =
        tier_->BuildCodes(config_, accounts_, all.Tokens(0, prompt), rows, BuildStop());
    ASSERT_TRUE(codes.ok()) << codes.status();
    for (const int64_t grown : {prompt + 7, rows}) {
      ASSERT_TRUE((*codes)->CodeRows(all.Tokens(0, grown)).ok()) << grown;
    }
    ASSERT_EQ((*codes)->coded(), rows);
    for (int h = 0; h < kKvHeads; ++h) {
      std::vector<uint8_t> want(rows * (*codes)->subspaces());
      (*codes)->quantizer(h).Encode(VectorSet::KeysOf(all, h, 0, rows), want.data());
      absl::StatusOr<std::vector<uint8_t>> got = (*codes)->ReadCodes(h, 0, rows);
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_TRUE(*got == want) << "KV head " << h;
      const std::set<int32_t> outliers((*codes)->outliers(h).begin(),
                                       (*codes)->outliers(h).end());
      for (const int64_t row : kPlanted) {
        if (!planted_in(row)) continue;
        EXPECT_EQ(outliers.count(static_cast<int32_t>(row)), h == 1 ? 1u : 0u)
            << "KV head " << h << " row " << row;
      }
    }
  }
}

TEST_P(CodesLearningTest, ALearningInFlightIsWaitedForBeforeTheRowsMove) {
  WorkQueue queue(1, "test-move");
  QueueBlocker blocker;
  CodesLearning learning(tier_.get(), &config_, accounts_, 0, &queue);
  std::unique_ptr<BulkCodes> codes;
  const int64_t start = CodesLearning::kFirstLearnRows;
  queue.Push(&blocker);
  learning.OnCommitted(Bulk(start));
  ASSERT_TRUE(learning.learning());
  // Not yet its take-over, and the rows stay: nothing waits.
  learning.BeforeReserve(Bulk(start), /*rows_move=*/false, &codes);
  EXPECT_EQ(codes, nullptr);
  // The rows are about to move: the learning (held on its queue) is waited for.
  std::atomic<bool> released{false};
  std::thread releaser([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    released.store(true);
    blocker.Release();
  });
  learning.BeforeReserve(Bulk(start), /*rows_move=*/true, &codes);
  EXPECT_TRUE(released.load()) << "returned before the learning ran";
  releaser.join();
  // Its codes still take over at their length, not before.
  EXPECT_EQ(codes, nullptr);
  EXPECT_TRUE(learning.learning());
  const int64_t take_over = CodesLearning::TakeOverAt(start);
  EXPECT_EQ(learning.take_over_at(), take_over);
  learning.BeforeReserve(Bulk(take_over), /*rows_move=*/false, &codes);
  ASSERT_NE(codes, nullptr);
  EXPECT_EQ(codes->coded(), take_over);
  EXPECT_FALSE(learning.learning());
  EXPECT_EQ(learning.next_learn_at(), 2 * start);
}

TEST_P(CodesLearningTest, NoLearningStartsWhoseCodesCouldNeverTakeOver) {
  // A layer that may hold (the server's --max_context_tokens) a bulk of exactly the take-over's
  // length: its last reservation, the one that would take over, sees a row fewer. No learning,
  // nothing charged, none later either. A model's layer 3 takes over three rows later.
  const int64_t start = CodesLearning::kFirstLearnRows;
  const int64_t static_rows = config_.selector.sinks + config_.selector.recent;
  for (const int32_t layer : {0, 3}) {
    SCOPED_TRACE(absl::StrCat("layer ", layer));
    config_.layer = layer;
    config_.max_layer_tokens = static_rows + CodesLearning::TakeOverAt(start, layer);
    {
      WorkQueue queue(1, "test-unreachable");
      CodesLearning learning(tier_.get(), &config_, accounts_, 0, &queue);
      learning.OnCommitted(Bulk(start));
      EXPECT_FALSE(learning.learning());
      EXPECT_EQ(learning.next_learn_at(), 0);
      EXPECT_EQ(host_.used() + device_.used(), 0);
    }
    // One token more and the take-over is within reach: the learning starts.
    config_.max_layer_tokens += 1;
    WorkQueue queue(1, "test-reachable");
    CodesLearning learning(tier_.get(), &config_, accounts_, 0, &queue);
    learning.OnCommitted(Bulk(start));
    EXPECT_TRUE(learning.learning());
    EXPECT_EQ(learning.take_over_at(), CodesLearning::TakeOverAt(start) + layer);
  }
}

TEST_P(CodesLearningTest, ALearningTheBudgetRefusesKeepsTheCodesAsTheyWere) {
  // Room for the prompt's codes (128 KiB of codebooks and their codes), not for a second set.
  MemoryBudget tight(200 << 10);
  const SessionAccounts accounts{&tight, GetParam() ? &device_ : nullptr};
  const int64_t prompt = CodesLearning::kMinLearnRows + 44;
  absl::StatusOr<std::unique_ptr<BulkCodes>> built =
      tier_->BuildCodes(config_, accounts, Bulk(prompt), kRows, BuildStop());
  ASSERT_TRUE(built.ok()) << built.status();
  std::unique_ptr<BulkCodes> codes = *std::move(built);
  const BulkCodes* const prompts = codes.get();
  const int64_t held = tight.used();
  WorkQueue queue(1, "test-refused");
  CodesLearning learning(tier_.get(), &config_, accounts, prompt, &queue, &tally_);
  const int64_t start = CodesLearning::kFirstLearnRows;
  EXPECT_EQ(learning.next_learn_at(), start);
  learning.OnCommitted(Bulk(start));
  ASSERT_TRUE(learning.learning());
  learning.BeforeReserve(Bulk(CodesLearning::TakeOverAt(start)), false, &codes);
  EXPECT_EQ(codes.get(), prompts);
  EXPECT_EQ(codes->learned_rows(), prompt);
  EXPECT_FALSE(learning.learning());
  EXPECT_EQ(learning.next_learn_at(), 2 * start) << "tried again at the next doubling";
  EXPECT_EQ(tight.used(), held) << "the refused learning's charges given back";
  EXPECT_EQ(tally_.count(LearningOutcome::kRefused), 1) << "counted for the metrics";
  EXPECT_EQ(tally_.count(LearningOutcome::kTakenOver), 0);
}

TEST_P(CodesLearningTest, ALearningItsLayerClosesFirstIsCountedAbandoned) {
  const int64_t start = CodesLearning::kFirstLearnRows;
  // Closed while still queued (behind a blocker): dropped unrun.
  {
    WorkQueue queue(1, "test-abandoned-queued");
    QueueBlocker blocker;
    queue.Push(&blocker);
    {
      CodesLearning learning(tier_.get(), &config_, accounts_, 0, &queue, &tally_);
      learning.OnCommitted(Bulk(start));
      ASSERT_TRUE(learning.learning());
    }
    blocker.Release();
  }
  EXPECT_EQ(tally_.count(LearningOutcome::kAbandoned), 1);
  // Closed after it learned (waited for as before rows move), its codes charged until then.
  WorkQueue queue(1, "test-abandoned-learned");
  {
    CodesLearning learning(tier_.get(), &config_, accounts_, 0, &queue, &tally_);
    learning.OnCommitted(Bulk(start));
    std::unique_ptr<BulkCodes> codes;
    learning.BeforeReserve(Bulk(start), /*rows_move=*/true, &codes);
    EXPECT_EQ(codes, nullptr);
    EXPECT_GT(host_.used() + device_.used(), 0) << "the learned codes, held until the take-over";
  }
  EXPECT_EQ(tally_.count(LearningOutcome::kAbandoned), 2);
  EXPECT_EQ(tally_.count(LearningOutcome::kTakenOver) + tally_.count(LearningOutcome::kRefused) +
                tally_.count(LearningOutcome::kFailed),
            0);
  EXPECT_EQ(host_.used() + device_.used(), 0) << "its memory given back";
}

// A coding of more rows that is stopped (a learning whose layer closed in its catch-up) leaves
// the codes as they were, outliers included: coded again unstopped, they are the codes of a
// coding never stopped. (The host asks before each KV head's rows: stopped at the second head,
// with the first one's coded; a device asks before each chunk.)
TEST_P(CodesLearningTest, AStoppedCodingLeavesTheCodesAsTheyWere) {
  const int64_t learned = CodesLearning::kFirstLearnRows;
  absl::StatusOr<std::unique_ptr<BulkCodes>> reference =
      tier_->BuildCodes(config_, accounts_, Bulk(learned), kRows, BuildStop());
  ASSERT_TRUE(reference.ok()) << reference.status();
  ASSERT_TRUE((*reference)->CodeRows(Bulk(kRows)).ok());
  absl::StatusOr<std::unique_ptr<BulkCodes>> codes =
      tier_->BuildCodes(config_, accounts_, Bulk(learned), kRows, BuildStop());
  ASSERT_TRUE(codes.ok()) << codes.status();
  const CodesState before = StateOf(**codes);
  const int from = GetParam() ? 1 : 2;
  StopAfterAsks stop(from);
  EXPECT_TRUE(HasStatus((*codes)->CodeRowsUnless(stop.stop(), Bulk(kRows)),
                        absl::StatusCode::kCancelled, "the shortlist's coding stopped"));
  EXPECT_EQ(stop.asks(), from);
  EXPECT_TRUE(StateOf(**codes) == before);
  ASSERT_TRUE((*codes)->CodeRows(Bulk(kRows)).ok());
  EXPECT_TRUE(StateOf(**codes) == StateOf(**reference));
  int64_t outliers_coded_after = 0;  // the test's teeth: rows whose outliers a stop could leave
  for (int h = 0; h < kKvHeads; ++h) {
    for (const int32_t row : (*reference)->outliers(h)) outliers_coded_after += row >= learned;
  }
  EXPECT_GT(outliers_coded_after, 0);
}

// A learning's training stops when its layer closes (probe 8: CloseSession waited up to 1.7 s
// for one): the tier's build asks the flag between heads and k-means rounds, returns CANCELLED
// and leaves nothing charged; a learning that ends so counts as abandoned, not failed.
TEST_P(CodesLearningTest, ATrainingWhoseLayerClosedStopsAndHoldsNothing) {
  std::atomic<bool> cancelled{true};
  absl::StatusOr<std::unique_ptr<BulkCodes>> built = tier_->BuildCodes(
      config_, accounts_, Bulk(CodesLearning::kFirstLearnRows), kRows,
      BuildStop::WhenSet(&cancelled));
  EXPECT_EQ(built.status().code(), absl::StatusCode::kCancelled) << built.status();
  EXPECT_EQ(host_.used() + device_.used(), 0);

  // Closed while its training runs (a queue thread of its own; the close sets the flag): the
  // learning is counted abandoned whether the close came mid-training or after it.
  WorkQueue queue(1, "test-closed-training");
  {
    CodesLearning learning(tier_.get(), &config_, accounts_, 0, &queue, &tally_);
    learning.OnCommitted(Bulk(CodesLearning::kFirstLearnRows));
    ASSERT_TRUE(learning.learning());
  }
  EXPECT_EQ(tally_.count(LearningOutcome::kAbandoned), 1);
  EXPECT_EQ(tally_.count(LearningOutcome::kFailed), 0);
  EXPECT_EQ(host_.used() + device_.used(), 0);
}

TEST_P(CodesLearningTest, ALearningRefusedIsCountedSoThoughItsLayerClosesBeforeTheTakeOver) {
  MemoryBudget tight(1 << 10);  // no room for codebooks
  const SessionAccounts accounts{&tight, GetParam() ? &tight : nullptr};
  WorkQueue queue(1, "test-refused-closed");
  {
    CodesLearning learning(tier_.get(), &config_, accounts, 0, &queue, &tally_);
    learning.OnCommitted(Bulk(CodesLearning::kFirstLearnRows));
    std::unique_ptr<BulkCodes> codes;
    learning.BeforeReserve(Bulk(CodesLearning::kFirstLearnRows), /*rows_move=*/true, &codes);
  }
  EXPECT_EQ(tally_.count(LearningOutcome::kRefused), 1);
  EXPECT_EQ(tally_.count(LearningOutcome::kAbandoned), 0);
  EXPECT_EQ(tight.used(), 0);
}

}  // namespace
}  // namespace kvrecall
