// BulkCodes' outliers (server/backends/bulk_codes.h): the prompt bulk's held-out rows set the
// threshold, and a new key coded worse than it joins them, whether coded on the host
// (EncodeRows) or elsewhere with its error given (AddOutliers: the GPU tier codes a step's new
// row in the step's launches).
#include "server/backends/bulk_codes.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "gtest/gtest.h"
#include "index/product_quantizer.h"
#include "kernels/vector_set.h"
#include "server/memory_budget.h"
#include "tests/test_util.h"

namespace kvrecall {
namespace {

using ::kvrecall::testing::PqReconstructionErrors;
using ::kvrecall::testing::RandomNormal;

constexpr int kKvHeads = 2;
constexpr int kDim = 64;
constexpr int64_t kPrompt = 2048;

// Host-memory codes, enough of a BulkCodes to code rows and read them back.
class CodesUnderTest final : public BulkCodes {
 public:
  static std::unique_ptr<CodesUnderTest> Create(const KvView& prompt, MemoryAccount* host) {
    absl::StatusOr<std::vector<ProductQuantizer>> quantizers = Train(prompt);
    EXPECT_TRUE(quantizers.ok()) << quantizers.status();
    if (!quantizers.ok()) return nullptr;
    auto codes = std::unique_ptr<CodesUnderTest>(new CodesUnderTest(*std::move(quantizers), host));
    codes->Code(prompt, 0, prompt.tokens);
    return codes;
  }
  int64_t device_bytes() const override { return 0; }
  absl::Status Reserve(int64_t) override { return absl::OkStatus(); }
  absl::Status CodeRowsUnless(const BuildStop&, const KvView& bulk) override {
    Code(bulk, coded(), bulk.tokens);
    return absl::OkStatus();
  }
  // Codes rows [begin, end): the rows from coded() on.
  void Code(const KvView& bulk, int64_t begin, int64_t end) {
    std::vector<uint8_t> codes(static_cast<size_t>(end - begin) * kv_heads() * subspaces());
    EXPECT_TRUE(EncodeRows(bulk, begin, end, codes.data()).ok());
    const int64_t n = (end - begin) * subspaces();
    for (int h = 0; h < kv_heads(); ++h) {
      codes_[h].resize(end * subspaces());
      std::copy_n(codes.data() + h * n, n, codes_[h].data() + begin * subspaces());
    }
    coded_ = end;
  }
  using BulkCodes::AddOutliers;

 private:
  CodesUnderTest(std::vector<ProductQuantizer> quantizers, MemoryAccount* host)
      : BulkCodes(std::move(quantizers), host), codes_(kv_heads()) {}
  absl::Status CopyCodes(int kv_head, int64_t begin, int64_t end,
                         uint8_t* codes) const override {
    std::copy(codes_[kv_head].begin() + begin * subspaces(),
              codes_[kv_head].begin() + end * subspaces(), codes);
    return absl::OkStatus();
  }

  std::vector<std::vector<uint8_t>> codes_;  // [kv_heads][coded, M]
};

TEST(BulkCodesTest, ANewKeyCodedWorseThanThePromptsOutliersJoinsThem) {
  // The prompt's keys, then four new rows: the second far from every centroid in head 0.
  std::vector<float> keys = RandomNormal((kPrompt + 4) * kKvHeads * kDim, 1);
  const std::vector<float> values(keys.size(), 0.0f);
  const int64_t needle = kPrompt + 1;
  for (int j = 0; j < kDim; ++j) keys[(needle * kKvHeads + 0) * kDim + j] = j % 2 ? 40.0f : -40.0f;
  const KvView all{keys.data(), values.data(), kPrompt + 4, kKvHeads, kDim, KvElement::kF32};
  MemoryBudget host(int64_t{1} << 30);

  std::unique_ptr<CodesUnderTest> codes = CodesUnderTest::Create(all.Tokens(0, kPrompt), &host);
  ASSERT_NE(codes, nullptr);
  // The quantizers learned from the prompt's first TrainedRowsOf rows.
  const int64_t trained = BulkCodes::TrainedRowsOf(kPrompt);
  ASSERT_EQ(trained, kPrompt - kPrompt / BulkCodes::kHeldOutShare);
  for (int h = 0; h < kKvHeads; ++h) {
    absl::StatusOr<ProductQuantizer> pq = ProductQuantizer::Train(
        VectorSet::KeysOf(all, h, 0, trained), BulkCodes::TrainingParams(kDim));
    ASSERT_TRUE(pq.ok()) << pq.status();
    EXPECT_EQ(codes->quantizer(h).codebooks(), pq->codebooks()) << "KV head " << h;
  }
  // The prompt's outliers: its rows coded worse than the held-out rows' 1/kOutlierShare worst.
  // The held-out keys, which the codebooks never saw, are coded worse than the trained ones.
  const std::vector<float> prompt_errors =
      PqReconstructionErrors(codes->quantizer(0), all.Tokens(0, kPrompt), 0);
  std::vector<float> held_out(prompt_errors.begin() + trained, prompt_errors.end());
  const auto m = static_cast<int64_t>(held_out.size());
  const int64_t rank = m - 1 - m / BulkCodes::kOutlierShare;
  std::nth_element(held_out.begin(), held_out.begin() + rank, held_out.end());
  const float bar = held_out[rank];
  std::vector<int32_t> expected_before;
  int64_t trained_above = 0;
  for (int64_t r = 0; r < kPrompt; ++r) {
    if (prompt_errors[r] > bar) expected_before.push_back(static_cast<int32_t>(r));
    trained_above += r < trained && prompt_errors[r] > bar;
  }
  const std::vector<int32_t> before(codes->outliers(0).begin(), codes->outliers(0).end());
  EXPECT_EQ(before, expected_before);
  EXPECT_LE(trained_above, trained / BulkCodes::kOutlierShare);

  // Coded on the host: the far key joins head 0's outliers, once.
  codes->Code(all, kPrompt, kPrompt + 4);
  std::vector<int32_t> expected = before;
  expected.push_back(static_cast<int32_t>(needle));
  EXPECT_EQ(std::vector<int32_t>(codes->outliers(0).begin(), codes->outliers(0).end()), expected);
  const std::vector<int32_t> before_1(codes->outliers(1).begin(), codes->outliers(1).end());

  // Coded elsewhere, errors given: beyond the prompt's threshold joins, an exact code does not.
  const float errors[] = {0.0f, 1e30f};
  codes->AddOutliers(1, kPrompt + 4, errors);
  std::vector<int32_t> expected_1 = before_1;
  expected_1.push_back(static_cast<int32_t>(kPrompt + 5));
  EXPECT_EQ(std::vector<int32_t>(codes->outliers(1).begin(), codes->outliers(1).end()),
            expected_1);

  // ReadCodes gives each row's code as the head's quantizer encodes its key, the prompt's rows
  // and the new ones alike.
  const int64_t begin = kPrompt - 2, end = kPrompt + 4;
  for (int h = 0; h < kKvHeads; ++h) {
    std::vector<uint8_t> want((end - begin) * codes->subspaces());
    codes->quantizer(h).Encode(VectorSet{keys.data() + (begin * kKvHeads + h) * kDim, end - begin,
                                         int64_t{kKvHeads} * kDim, kDim, KvElement::kF32},
                               want.data());
    absl::StatusOr<std::vector<uint8_t>> got = codes->ReadCodes(h, begin, end);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(*got, want) << "KV head " << h;
  }
}

}  // namespace
}  // namespace kvrecall
