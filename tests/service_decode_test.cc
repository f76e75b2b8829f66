// The service end to end on loopback: prompts streamed in chunks, decode steps of full,
// exact top-K and streaming sessions (f32, bf16, f16; grouped-query attention) checked against
// double-precision brute force over the KV the server was sent.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "index/selector_params.h"
#include "absl/strings/str_cat.h"
#include "kernels/cpu/attention.h"
#include "kernels/fidelity.h"
#include "kernels/kv_view.h"
#include "server/decode.h"
#include "tests/server_fixture.h"
#include "tests/test_util.h"

namespace kvrecall {
namespace {

using ::kvrecall::testing::AllTokens;
using ::kvrecall::testing::CloseSession;
using ::kvrecall::testing::CreateSession;
using ::kvrecall::testing::DecodeClient;
using ::kvrecall::testing::ExpectOutputNear;
using ::kvrecall::testing::GetSession;
using ::kvrecall::testing::MakeGeometry;
using ::kvrecall::testing::MakePolicy;
using ::kvrecall::testing::Prefill;
using ::kvrecall::testing::PromptChunks;
using ::kvrecall::testing::ReferenceSession;
using ::kvrecall::testing::ReferenceTopK;
using ::kvrecall::testing::SeriesValue;
using ::kvrecall::testing::PrefilledSessionTest;
using ::kvrecall::testing::TensorValues;

class ServiceDecodeTest : public PrefilledSessionTest {};

class FullAttentionByDType : public ServiceDecodeTest,
                             public ::testing::WithParamInterface<v1::DType> {};

TEST_P(FullAttentionByDType, EveryStepEqualsBruteForceOverTheWholeContext) {
  const v1::DType dtype = GetParam();
  ReferenceSession ref(MakeGeometry(/*layers=*/3, /*q_heads=*/8, /*kv_heads=*/2,
                                    /*head_dim=*/32, dtype),
                       /*prompt_tokens=*/90, /*seed=*/1);
  const std::string id = CreateAndPrefill(ref, MakePolicy(v1::SELECTOR_FULL), 37);
  ASSERT_FALSE(id.empty());

  DecodeClient decode(stub());
  for (int step = 0; step < 4; ++step) {
    for (int layer = 0; layer < 3; ++layer) {
      v1::DecodeRequest request;
      request.set_request_id(100 * step + layer);
      request.set_layer(layer);
      request.set_return_lse(true);
      std::vector<float> q;
      *request.add_steps() = ref.NextStep(id, layer, 1000 + 10 * step + layer, &q);
      absl::StatusOr<v1::DecodeResponse> reply = decode.Step(request);
      ASSERT_TRUE(reply.ok()) << reply.status();
      EXPECT_EQ(reply->request_id(), request.request_id());
      EXPECT_EQ(reply->layer(), layer);
      EXPECT_GT(reply->server_micros(), 0.0);
      ASSERT_EQ(reply->results_size(), 1);
      const v1::SequenceResult& result = reply->results(0);
      EXPECT_EQ(result.session_id(), id);
      EXPECT_EQ(result.position(), 90 + step);
      EXPECT_EQ(result.output().dtype(), dtype);
      EXPECT_EQ(result.heads_size(), 0);  // no diagnostics asked for
      std::vector<double> want_lse;
      const std::vector<double> want = ref.FullAttention(layer, q, &want_lse);
      ExpectOutputNear(TensorValues(result.output()), want, dtype,
                       absl::StrCat("step ", step, " layer ", layer));
      const std::vector<float> lse = TensorValues(result.lse());
      ASSERT_EQ(lse.size(), 8u);
      for (int h = 0; h < 8; ++h) EXPECT_NEAR(lse[h], want_lse[h], 1e-4) << "head " << h;
    }
  }
  ASSERT_TRUE(decode.Finish().ok());

  absl::StatusOr<v1::SessionInfo> info = GetSession(stub(), id);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->prompt_tokens(), 90);
  EXPECT_EQ(info->tokens(), 94);
  EXPECT_EQ(info->layers_prefilled(), 3);
  EXPECT_EQ(info->decode_steps(), 12);
  EXPECT_EQ(info->paths().exact(), 12 * 8);
  EXPECT_EQ(info->gpu_bytes(), 0);
  // At least the KV itself: 3 layers x 94 tokens x 2 (k, v) x 2 heads x 32 x 4 bytes.
  EXPECT_GE(info->host_bytes(), 3 * 94 * 2 * 2 * 32 * 4);
  // The full selector scores every token, the new one included: 91..94 over the 4 steps.
  EXPECT_DOUBLE_EQ(info->mean_candidates(), (91 + 92 + 93 + 94) / 4.0);
}

INSTANTIATE_TEST_SUITE_P(DTypes, FullAttentionByDType,
                         ::testing::Values(v1::DTYPE_F32, v1::DTYPE_BF16, v1::DTYPE_F16),
                         [](const auto& info) { return std::string(DTypeName(info.param)); });

// Decodes one token of `layer` for the reference session and returns the reply's only result.
absl::StatusOr<v1::SequenceResult> DecodeOne(DecodeClient& decode, ReferenceSession& ref,
                                             const std::string& id, int layer, uint64_t seed,
                                             std::vector<float>* q, bool diagnostics,
                                             bool compare_exact, bool as_values = false) {
  v1::DecodeRequest request;
  request.set_layer(layer);
  request.set_diagnostics(diagnostics);
  request.set_compare_exact(compare_exact);
  request.set_return_lse(true);
  *request.add_steps() = ref.NextStep(id, layer, seed, q, as_values);
  absl::StatusOr<v1::DecodeResponse> reply = decode.Step(request);
  if (!reply.ok()) return reply.status();
  if (reply->results_size() != 1) return absl::InternalError("expected one result");
  return reply->results(0);
}

// Decodes `steps` tokens into layer 0 of `ref`'s session `id` (f32 KV), each step's output
// equal to full attention over the whole context.
void DecodeStepsOfFullAttention(DecodeClient& decode, ReferenceSession& ref,
                                const std::string& id, int steps) {
  for (int step = 0; step < steps; ++step) {
    SCOPED_TRACE(absl::StrCat("step ", step));
    std::vector<float> q;
    absl::StatusOr<v1::SequenceResult> result =
        DecodeOne(decode, ref, id, 0, 900 + step, &q, false, false);
    ASSERT_TRUE(result.ok()) << result.status();
    ExpectOutputNear(TensorValues(result->output()), ref.FullAttention(0, q), v1::DTYPE_F32,
                     "full attention");
  }
}

TEST_F(ServiceDecodeTest, ExactTopKAttendsTheBruteForceTopK) {
  constexpr int kTopK = 16;
  ReferenceSession ref(MakeGeometry(2, 8, 2, 32), 120, 7);
  const std::string id = CreateAndPrefill(ref, MakePolicy(v1::SELECTOR_EXACT_TOPK, kTopK), 50);
  ASSERT_FALSE(id.empty());
  DecodeClient decode(stub());
  for (int step = 0; step < 3; ++step) {
    for (int layer = 0; layer < 2; ++layer) {
      std::vector<float> q;
      absl::StatusOr<v1::SequenceResult> result =
          DecodeOne(decode, ref, id, layer, 500 + 10 * step + layer, &q, true, true);
      ASSERT_TRUE(result.ok()) << result.status();
      const int64_t tokens = ref.tokens(layer);
      std::vector<std::vector<int32_t>> supports;
      for (int h = 0; h < 8; ++h) {
        supports.push_back(ReferenceTopK(q.data() + h * 32, ref.view(layer), KvHeadOf(h, 8, 2),
                                         ref.scale(), kTopK));
      }
      std::vector<double> lse;
      const std::vector<double> want = ref.Attention(layer, q, supports, &lse);
      ExpectOutputNear(TensorValues(result->output()), want, v1::DTYPE_F32, "exact_topk");
      std::vector<double> full_lse;
      const std::vector<double> full = ref.FullAttention(layer, q, &full_lse);
      ASSERT_EQ(result->heads_size(), 8);
      for (int h = 0; h < 8; ++h) {
        const v1::HeadDiagnostics& head = result->heads(h);
        EXPECT_EQ(head.path(), v1::PATH_EXACT);
        EXPECT_EQ(head.candidates(), tokens);
        EXPECT_EQ(head.support(), kTopK);
        // The fidelity shadow compares against the exact top-K: this selector is that.
        EXPECT_FLOAT_EQ(head.support_recall(), 1.0f);
        EXPECT_NEAR(head.retained_mass(), std::exp(lse[h] - full_lse[h]), 1e-5);
        EXPECT_LT(head.retained_mass(), 1.0f);
        const std::vector<float> o(want.begin() + h * 32, want.begin() + (h + 1) * 32);
        const std::vector<float> o_full(full.begin() + h * 32, full.begin() + (h + 1) * 32);
        EXPECT_NEAR(head.output_cosine(), OutputCosine(o.data(), o_full.data(), 32), 1e-5);
        EXPECT_NEAR(head.rel_l2(), RelativeL2(o.data(), o_full.data(), 32), 1e-4);
      }
    }
  }
}

// A cpu session's host KV grown ahead of need (KvGrowthAhead): a prompt of arrays that are
// mappings of their own (600 tokens of 8 KV heads x 128 in f32: 2.4 MiB each), sent in one
// chunk so that it fills them and a growth starts at once, then decoded past that capacity and
// past five sixths of the next (a second growth ahead), every step equal to full attention over
// the whole context; the session holds the grown capacity.
TEST_F(ServiceDecodeTest, AHostKvGrownAheadOfNeedKeepsEveryStepExact) {
  constexpr int kPrompt = 600, kSteps = 160;
  ReferenceSession ref(MakeGeometry(1, 8, 8, 128), kPrompt, 13);
  const std::string id = CreateAndPrefill(ref, MakePolicy(v1::SELECTOR_FULL), kPrompt);
  ASSERT_FALSE(id.empty());
  DecodeClient decode(stub());
  ASSERT_NO_FATAL_FAILURE(DecodeStepsOfFullAttention(decode, ref, id, kSteps));
  absl::StatusOr<v1::SessionInfo> info = GetSession(stub(), id);
  ASSERT_TRUE(info.ok()) << info.status();
  // At least the first growth (600 -> 900 tokens): keys and values, 4 KiB a token each.
  EXPECT_GE(info->host_bytes(), int64_t{2} * 900 * 8 * 128 * 4);
}

// A short prompt's host KV arrays (16 tokens: 8 KiB each) are mappings from their first row,
// which grow ahead of need: decoding it past eight growths moves or copies neither array in a
// request (before, arrays under 512 KiB lived on the heap, and each growth copied them in the
// step that needed the room), every step still exact, and kvrecall_host_kv_growths_total counts
// how each growth was made.
TEST_F(ServiceDecodeTest, AShortPromptsKvGrowsAheadAndNeverMovesInAStep) {
  constexpr int kPrompt = 16, kSteps = 300;
  ReferenceSession ref(MakeGeometry(1, 4, 2, 64), kPrompt, 17);
  auto growths = [&](const char* how) {
    return SeriesValue(server().server().metrics().TextFormat(),
                       absl::StrCat("kvrecall_host_kv_growths_total{how=\"", how, "\"}"));
  };
  const double ahead = growths("ahead"), waited = growths("waited");
  const double in_place = growths("in_place"), moved = growths("moved");
  const std::string id = CreateAndPrefill(ref, MakePolicy(v1::SELECTOR_FULL), kPrompt);
  ASSERT_FALSE(id.empty());
  DecodeClient decode(stub());
  ASSERT_NO_FATAL_FAILURE(DecodeStepsOfFullAttention(decode, ref, id, kSteps));
  EXPECT_EQ(growths("moved"), moved) << "an array moved or copied in a request";
  // 16 -> 24 -> 36 -> ... -> 406 rows: keys and values, eight growths each, made ahead unless a
  // step needed the rows before the growth thread took them up (then in place, in the step) or
  // finished them (waited for).
  const double made_ahead = growths("ahead") - ahead + growths("waited") - waited;
  EXPECT_GE(made_ahead + growths("in_place") - in_place, 2 * 8);
  // (At least the last growth's two arrays: they start ~45 steps before their rows are needed;
  // the first ones only a step or two before, which a loaded machine may miss.)
  EXPECT_GE(made_ahead, 2) << "growths made ahead";
}

// The index selector (RetrievalAttention) through the service. A search list longer than the
// bulk makes the graph search exhaustive, so every head must attend exactly the static set
// (sinks + recent window) plus the brute-force top-K of the bulk between them, also once decode
// tokens have pushed prompt tokens out of the recent window into the index's growth tail.
TEST_F(ServiceDecodeTest, IndexAttendsTheStaticSetPlusTheBulkTopK) {
  constexpr int kTopK = 16, kSinks = 4, kRecent = 16, kQHeads = 8, kKvHeads = 2, kDim = 32;
  ReferenceSession ref(MakeGeometry(2, kQHeads, kKvHeads, kDim), 300, 11);
  v1::Policy policy = MakePolicy(v1::SELECTOR_INDEX, kTopK, kSinks, kRecent);
  policy.mutable_index()->set_search_list_size(1000);
  const std::string id = CreateAndPrefill(ref, policy, 64);
  ASSERT_FALSE(id.empty());
  DecodeClient decode(stub());
  for (int step = 0; step < kRecent + 8; ++step) {
    for (int layer = 0; layer < 2; ++layer) {
      std::vector<float> q;
      absl::StatusOr<v1::SequenceResult> result =
          DecodeOne(decode, ref, id, layer, 700 + 10 * step + layer, &q, true, false);
      ASSERT_TRUE(result.ok()) << result.status();
      const KvView kv = ref.view(layer);
      const int64_t bulk_end = kv.tokens - kRecent;
      std::vector<std::vector<int32_t>> supports(kQHeads);
      for (int h = 0; h < kQHeads; ++h) {
        std::vector<float> scores(bulk_end - kSinks);
        cpu::ScoreRange(q.data() + h * kDim, kv, KvHeadOf(h, kQHeads, kKvHeads), kSinks,
                        bulk_end, 1.0f, scores.data());
        std::vector<int32_t> top;
        cpu::TopKPositions(scores, kTopK, &top);
        for (int32_t t = 0; t < kSinks; ++t) supports[h].push_back(t);
        for (int32_t p : top) supports[h].push_back(kSinks + p);
        for (int64_t t = bulk_end; t < kv.tokens; ++t) supports[h].push_back(t);
        EXPECT_EQ(result->heads(h).support(), kSinks + kTopK + kRecent) << "head " << h;
      }
      std::vector<double> lse;
      const std::vector<double> want = ref.Attention(layer, q, supports, &lse);
      ExpectOutputNear(TensorValues(result->output()), want, v1::DTYPE_F32,
                       absl::StrCat("index, step ", step, ", layer ", layer));
    }
  }
}

// ReTopK through the service (its semantics: index/retopk.h). With tau = -2 every non-refresh
// step reuses (a cosine is >= -1) and with refresh_interval = 2 every even decode step is
// exact: the paths must alternate per head, which holds only if the server calls OnAppend once
// per step and Select once per head. Exact steps must attend the brute-force top-K.
TEST_F(ServiceDecodeTest, ReTopKPathsFollowThePolicyAndExactStepsAttendTheTopK) {
  constexpr int kTopK = 12;
  ReferenceSession ref(MakeGeometry(1, 4, 2, 16), 150, 9);
  v1::Policy policy = MakePolicy(v1::SELECTOR_RETOPK, kTopK);
  policy.mutable_retopk()->set_tau(-2.0f);
  policy.mutable_retopk()->set_refresh_interval(2);
  policy.mutable_retopk()->set_recent_window(8);
  const std::string id = CreateAndPrefill(ref, policy, 64);
  ASSERT_FALSE(id.empty());
  DecodeClient decode(stub());
  for (int step = 1; step <= 4; ++step) {
    std::vector<float> q;
    absl::StatusOr<v1::SequenceResult> result =
        DecodeOne(decode, ref, id, 0, 700 + step, &q, /*diagnostics=*/true, /*compare=*/true);
    ASSERT_TRUE(result.ok()) << result.status();
    ASSERT_EQ(result->heads_size(), 4);
    const bool refresh = step % 2 == 0;
    for (int h = 0; h < 4; ++h) {
      const v1::HeadDiagnostics& head = result->heads(h);
      EXPECT_EQ(head.path(), refresh ? v1::PATH_REFRESH : v1::PATH_REUSE) << "step " << step;
      EXPECT_EQ(head.support(), kTopK);
      EXPECT_GE(head.support_recall(), 0.0f);
      EXPECT_LE(head.support_recall(), 1.0f);
      EXPECT_GE(head.best_cosine(), -1.0f - 1e-5f);
      EXPECT_LE(head.best_cosine(), 1.0f + 1e-5f);
      if (refresh) {
        EXPECT_EQ(head.candidates(), ref.tokens(0));
        EXPECT_FLOAT_EQ(head.support_recall(), 1.0f);
      } else {
        EXPECT_LT(head.candidates(), ref.tokens(0));
      }
    }
    if (refresh) {
      std::vector<std::vector<int32_t>> supports;
      for (int h = 0; h < 4; ++h) {
        supports.push_back(
            ReferenceTopK(q.data() + h * 16, ref.view(0), KvHeadOf(h, 4, 2), ref.scale(), kTopK));
      }
      ExpectOutputNear(TensorValues(result->output()), ref.Attention(0, q, supports), v1::DTYPE_F32,
                       absl::StrCat("refresh step ", step));
    }
  }
  absl::StatusOr<v1::SessionInfo> info = GetSession(stub(), id);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->paths().reuse(), 2 * 4);
  EXPECT_EQ(info->paths().refresh(), 2 * 4);
  EXPECT_EQ(info->paths().fallback(), 0);
  EXPECT_EQ(info->paths().exact(), 0);
  EXPECT_GT(info->selector_bytes(), 0);  // the query-support caches
  EXPECT_GE(info->host_bytes(), info->selector_bytes());
}

// A reuse step rescores its candidates exactly and keeps their top K: with a recent window as
// long as the context its candidates are every token, so each reuse step must attend exactly
// the brute-force top K, per query head through its KV head (the reuse path's plumbing, which
// the test above checks only by its counts).
TEST_F(ServiceDecodeTest, ReTopKReuseOverAWindowAsLongAsTheContextAttendsTheExactTopK) {
  constexpr int kTopK = 12;
  for (const v1::DType dtype : {v1::DTYPE_F32, v1::DTYPE_BF16}) {
    SCOPED_TRACE(DTypeName(dtype));
    ReferenceSession ref(MakeGeometry(1, 4, 2, 16, dtype), 150, 23);
    v1::Policy policy = MakePolicy(v1::SELECTOR_RETOPK, kTopK);
    policy.mutable_retopk()->set_tau(-2.0f);  // every step reuses
    policy.mutable_retopk()->set_refresh_interval(0);
    policy.mutable_retopk()->set_recent_window(1024);
    const std::string id = CreateAndPrefill(ref, policy, 64);
    ASSERT_FALSE(id.empty());
    DecodeClient decode(stub());
    for (int step = 1; step <= 4; ++step) {
      std::vector<float> q;
      absl::StatusOr<v1::SequenceResult> result =
          DecodeOne(decode, ref, id, 0, 1700 + step, &q, /*diagnostics=*/true, /*compare=*/true);
      ASSERT_TRUE(result.ok()) << result.status();
      ASSERT_EQ(result->heads_size(), 4);
      std::vector<std::vector<int32_t>> supports;
      for (int h = 0; h < 4; ++h) {
        const v1::HeadDiagnostics& head = result->heads(h);
        EXPECT_EQ(head.path(), v1::PATH_REUSE) << "step " << step << ", head " << h;
        EXPECT_EQ(head.candidates(), ref.tokens(0)) << "step " << step << ", head " << h;
        EXPECT_EQ(head.support(), kTopK);
        EXPECT_FLOAT_EQ(head.support_recall(), 1.0f) << "step " << step << ", head " << h;
        supports.push_back(
            ReferenceTopK(q.data() + h * 16, ref.view(0), KvHeadOf(h, 4, 2), ref.scale(), kTopK));
      }
      ExpectOutputNear(TensorValues(result->output()), ref.Attention(0, q, supports), dtype,
                       absl::StrCat("reuse step ", step));
    }
    absl::StatusOr<v1::SessionInfo> info = GetSession(stub(), id);
    ASSERT_TRUE(info.ok());
    EXPECT_EQ(info->paths().reuse(), 4 * 4);
  }
}

// compare_exact's figures are the brute-force ones: per query head, the share of the exact top K
// (ReferenceTopK over every token) that the streaming window holds, exp(lse of the window - lse
// of all tokens), and the cosine and relative L2 error of the window's output against full
// attention, each worked out here in double.
TEST_F(ServiceDecodeTest, CompareExactFiguresAreTheBruteForceOnes) {
  constexpr int kSinks = 4;
  constexpr int kRecent = 8;
  constexpr int kTopK = 8;
  constexpr int kHeads = 4;
  constexpr int kDim = 16;
  ReferenceSession ref(MakeGeometry(1, kHeads, 2, kDim), 40, 29);
  const std::string id =
      CreateAndPrefill(ref, MakePolicy(v1::SELECTOR_STREAMING, kTopK, kSinks, kRecent), 40);
  ASSERT_FALSE(id.empty());
  DecodeClient decode(stub());
  int partial = 0;  // figures strictly between their extremes: the checks are not trivial
  for (int step = 0; step < 3; ++step) {
    std::vector<float> q;
    absl::StatusOr<v1::SequenceResult> result =
        DecodeOne(decode, ref, id, 0, 400 + step, &q, /*diagnostics=*/true, /*compare=*/true);
    ASSERT_TRUE(result.ok()) << result.status();
    ASSERT_EQ(result->heads_size(), kHeads);
    const int64_t n = ref.tokens(0);
    std::vector<int32_t> window;
    for (int64_t t = 0; t < n; ++t) {
      if (t < kSinks || t >= n - kRecent) window.push_back(static_cast<int32_t>(t));
    }
    std::vector<double> lse_window, lse_full;
    const std::vector<double> out =
        ref.Attention(0, q, std::vector<std::vector<int32_t>>(kHeads, window), &lse_window);
    const std::vector<double> full = ref.FullAttention(0, q, &lse_full);
    for (int h = 0; h < kHeads; ++h) {
      SCOPED_TRACE(absl::StrCat("step ", step, ", head ", h));
      const v1::HeadDiagnostics& head = result->heads(h);
      const std::vector<int32_t> exact = ReferenceTopK(q.data() + h * kDim, ref.view(0),
                                                       KvHeadOf(h, kHeads, 2), ref.scale(), kTopK);
      int found = 0;
      for (int32_t t : exact) found += t < kSinks || t >= n - kRecent;
      const double recall = static_cast<double>(found) / kTopK;
      const double mass = std::exp(lse_window[h] - lse_full[h]);
      double ab = 0, aa = 0, bb = 0, diff = 0;
      for (int i = 0; i < kDim; ++i) {
        const double a = out[h * kDim + i], b = full[h * kDim + i];
        ab += a * b;
        aa += a * a;
        bb += b * b;
        diff += (a - b) * (a - b);
      }
      const double cosine = ab / std::sqrt(aa * bb);
      const double rel_l2 = std::sqrt(diff / bb);
      EXPECT_NEAR(head.support_recall(), recall, 1e-6);
      EXPECT_NEAR(head.retained_mass(), mass, 1e-5);
      EXPECT_NEAR(head.output_cosine(), cosine, 1e-5);
      EXPECT_NEAR(head.rel_l2(), rel_l2, 1e-4);
      partial += (recall > 0 && recall < 1) + (mass > 0.01 && mass < 0.99) +
                 (cosine > -0.99 && cosine < 0.99);
    }
  }
  EXPECT_GT(partial, 12);
}

// With tau above any cosine every step falls back to the exact path.
TEST_F(ServiceDecodeTest, ReTopKFallsBackToExactTopKBelowTau) {
  constexpr int kTopK = 10;
  ReferenceSession ref(MakeGeometry(1, 4, 4, 16, v1::DTYPE_BF16), 80, 19);
  v1::Policy policy = MakePolicy(v1::SELECTOR_RETOPK, kTopK);
  policy.mutable_retopk()->set_tau(2.0f);
  policy.mutable_retopk()->set_refresh_interval(0);
  const std::string id = CreateAndPrefill(ref, policy, 80);
  ASSERT_FALSE(id.empty());
  DecodeClient decode(stub());
  for (int step = 1; step <= 3; ++step) {
    std::vector<float> q;
    absl::StatusOr<v1::SequenceResult> result =
        DecodeOne(decode, ref, id, 0, 800 + step, &q, /*diagnostics=*/true, false);
    ASSERT_TRUE(result.ok()) << result.status();
    std::vector<std::vector<int32_t>> supports;
    for (int h = 0; h < 4; ++h) {
      EXPECT_EQ(result->heads(h).path(), v1::PATH_FALLBACK);
      supports.push_back(ReferenceTopK(q.data() + h * 16, ref.view(0), h, ref.scale(), kTopK));
    }
    ExpectOutputNear(TensorValues(result->output()), ref.Attention(0, q, supports), v1::DTYPE_BF16,
                     absl::StrCat("fallback step ", step));
  }
  absl::StatusOr<v1::SessionInfo> info = GetSession(stub(), id);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->paths().fallback(), 3 * 4);
  EXPECT_DOUBLE_EQ(info->mean_candidates(), (81 + 82 + 83) / 3.0);
}

TEST_F(ServiceDecodeTest, StreamingAttendsSinksAndRecentWindow) {
  // Either part of the window may be empty: a zero is served as sent (proto3 optional fields),
  // so a window of recent tokens alone (StreamingLLM without sinks) or of sinks alone can be
  // asked for.
  for (const auto& [sinks, recent] : {std::pair{4, 8}, std::pair{0, 8}, std::pair{4, 0}}) {
    SCOPED_TRACE(absl::StrCat("sinks ", sinks, ", recent ", recent));
    ReferenceSession ref(MakeGeometry(1, 4, 1, 16, v1::DTYPE_BF16), 40, 11);
    const std::string id =
        CreateAndPrefill(ref, MakePolicy(v1::SELECTOR_STREAMING, 0, sinks, recent), 16);
    ASSERT_FALSE(id.empty());
    absl::StatusOr<v1::SessionInfo> info = GetSession(stub(), id);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->policy().sinks(), sinks);
    EXPECT_EQ(info->policy().recent(), recent);
    DecodeClient decode(stub());
    for (int step = 0; step < 3; ++step) {
      std::vector<float> q;
      absl::StatusOr<v1::SequenceResult> result =
          DecodeOne(decode, ref, id, 0, 900 + step, &q, /*diagnostics=*/true, false);
      ASSERT_TRUE(result.ok()) << result.status();
      std::vector<int32_t> support(sinks);
      std::iota(support.begin(), support.end(), 0);
      for (int64_t t = ref.tokens(0) - recent; t < ref.tokens(0); ++t) support.push_back(t);
      const std::vector<double> want =
          ref.Attention(0, q, std::vector<std::vector<int32_t>>(4, support));
      ExpectOutputNear(TensorValues(result->output()), want, v1::DTYPE_BF16, "streaming");
      ASSERT_EQ(result->heads_size(), 4);
      for (const v1::HeadDiagnostics& head : result->heads()) {
        EXPECT_EQ(head.path(), v1::PATH_EXACT);
        EXPECT_EQ(head.support(), sinks + recent);
        EXPECT_EQ(head.candidates(), 0);
        EXPECT_EQ(head.retained_mass(), 0.0f);  // not measured without compare_exact
      }
    }
  }
}

TEST_F(ServiceDecodeTest, CompareExactOfFullAttentionIsPerfect) {
  ReferenceSession ref(MakeGeometry(1, 4, 2, 16), 30, 13);
  const std::string id = CreateAndPrefill(ref, MakePolicy(v1::SELECTOR_FULL, 8), 30);
  ASSERT_FALSE(id.empty());
  DecodeClient decode(stub());
  std::vector<float> q;
  absl::StatusOr<v1::SequenceResult> result = DecodeOne(decode, ref, id, 0, 77, &q, false, true);
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_EQ(result->heads_size(), 4);
  for (const v1::HeadDiagnostics& head : result->heads()) {
    EXPECT_EQ(head.support(), 31);
    EXPECT_FLOAT_EQ(head.support_recall(), 1.0f);
    EXPECT_NEAR(head.retained_mass(), 1.0f, 1e-6);
    EXPECT_NEAR(head.output_cosine(), 1.0f, 1e-6);
    EXPECT_NEAR(head.rel_l2(), 0.0f, 1e-6);
  }
}

// At the largest softmax scale a session may ask for, tensors at the API's bound (65504, f16's
// largest) still give a finite lse and output under every selector: the scale's bound keeps
// the bound of the tensors meaningful (probe 17, 4: at 1e30, lse was +inf and the diagnostics
// NaN).
TEST_F(ServiceDecodeTest, TheLargestScaleKeepsTheLargestTensorsFinite) {
  v1::Geometry g = MakeGeometry(1, 2, 1, 16);
  const double most = std::numeric_limits<float>::max() / 4.0 / (16.0 * 65504.0 * 65504.0);
  g.set_softmax_scale(static_cast<float>(most) * (1.0f - 1e-6f));
  constexpr int kPrompt = 12;
  testing::PromptLayer prompt = testing::RandomPromptOf(g, kPrompt, 5);
  for (float& x : prompt.q) x = 65504.0f;
  // Keys of either sign, token by token: logits at both ends of what the bound allows, so that
  // the softmax spans all of it (its smaller terms underflow to 0, as they must).
  for (size_t i = 0; i < prompt.k.size(); ++i) prompt.k[i] = (i / 16) % 2 ? -65504.0f : 65504.0f;
  for (size_t i = 0; i < prompt.v.size(); ++i) prompt.v[i] = i % 3 == 0 ? -65504.0f : 65504.0f;
  const std::vector<float> q(2 * 16, 65504.0f), k(16, 65504.0f), v(16, -65504.0f);
  for (const v1::Selector selector : {v1::SELECTOR_FULL, v1::SELECTOR_EXACT_TOPK,
                                      v1::SELECTOR_STREAMING, v1::SELECTOR_INDEX,
                                      v1::SELECTOR_RETOPK}) {
    SCOPED_TRACE(v1::Selector_Name(selector));
    v1::CreateSessionResponse created;
    ASSERT_TRUE(CreateSession(stub(), g, MakePolicy(selector, /*top_k=*/4, /*sinks=*/2,
                                                    /*recent=*/4),
                              &created)
                    .ok());
    ASSERT_TRUE(
        Prefill(stub(), testing::PromptChunks(created.session_id(), g, 0, prompt, 5)).ok());
    DecodeClient decode(stub());
    v1::DecodeRequest request;
    request.set_layer(0);
    request.set_return_lse(true);
    request.set_diagnostics(true);
    request.set_compare_exact(true);
    *request.add_steps() =
        testing::MakeStep(created.session_id(), g, q, k, v, /*as_values=*/true);
    absl::StatusOr<v1::DecodeResponse> reply = decode.Step(request);
    ASSERT_TRUE(reply.ok()) << reply.status();
    ASSERT_EQ(reply->results_size(), 1);
    const v1::SequenceResult& result = reply->results(0);
    // (Read as sent: an lse is a logit, which may pass the tensors' bound by far.)
    ASSERT_EQ(result.lse().values_size(), 2);
    for (const float lse : result.lse().values()) EXPECT_TRUE(std::isfinite(lse)) << lse;
    for (const float o : TensorValues(result.output())) {
      EXPECT_TRUE(std::isfinite(o) && std::abs(o) <= 65504.0f) << o;
    }
    for (const v1::HeadDiagnostics& head : result.heads()) {
      EXPECT_TRUE(std::isfinite(head.output_cosine())) << head.output_cosine();
    }
  }
}

TEST_F(ServiceDecodeTest, ValuesInGiveValuesOut) {
  ReferenceSession ref(MakeGeometry(1, 2, 1, 8, v1::DTYPE_BF16), 12, 17);
  const std::string id = CreateAndPrefill(ref, MakePolicy(v1::SELECTOR_FULL), 5);
  ASSERT_FALSE(id.empty());
  DecodeClient decode(stub());
  std::vector<float> q;
  absl::StatusOr<v1::SequenceResult> result =
      DecodeOne(decode, ref, id, 0, 3, &q, false, false, /*as_values=*/true);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->output().values_size(), 2 * 8);
  EXPECT_TRUE(result->output().data().empty());
  EXPECT_EQ(result->lse().values_size(), 2);
  // Values travel as f32, so the output carries no bf16 rounding.
  ExpectOutputNear(TensorValues(result->output()), ref.FullAttention(0, q), v1::DTYPE_F32,
                   "values");
}

TEST_F(ServiceDecodeTest, OneRequestDecodesSeveralSessions) {
  ReferenceSession a(MakeGeometry(2, 8, 2, 32), 25, 21);
  ReferenceSession b(MakeGeometry(2, 4, 4, 16, v1::DTYPE_F16), 40, 22);
  ReferenceSession c(MakeGeometry(2, 6, 3, 8, v1::DTYPE_BF16), 10, 23);
  const std::string id_a = CreateAndPrefill(a, MakePolicy(v1::SELECTOR_FULL), 25);
  const std::string id_b = CreateAndPrefill(b, MakePolicy(v1::SELECTOR_STREAMING, 0, 2, 5), 7);
  const std::string id_c = CreateAndPrefill(c, MakePolicy(v1::SELECTOR_FULL), 3);
  ASSERT_FALSE(id_a.empty() || id_b.empty() || id_c.empty());
  DecodeClient decode(stub());
  for (int step = 0; step < 2; ++step) {
    for (int layer = 0; layer < 2; ++layer) {
      v1::DecodeRequest request;
      request.set_layer(layer);
      std::vector<float> qa, qb, qc;
      *request.add_steps() = a.NextStep(id_a, layer, 40 + step * 7 + layer, &qa);
      *request.add_steps() = b.NextStep(id_b, layer, 50 + step * 7 + layer, &qb);
      *request.add_steps() = c.NextStep(id_c, layer, 60 + step * 7 + layer, &qc);
      absl::StatusOr<v1::DecodeResponse> reply = decode.Step(request);
      ASSERT_TRUE(reply.ok()) << reply.status();
      ASSERT_EQ(reply->results_size(), 3);
      EXPECT_EQ(reply->results(0).session_id(), id_a);
      EXPECT_EQ(reply->results(1).session_id(), id_b);
      EXPECT_EQ(reply->results(2).session_id(), id_c);
      EXPECT_EQ(reply->results(0).position(), 25 + step);
      EXPECT_EQ(reply->results(1).position(), 40 + step);
      EXPECT_EQ(reply->results(2).position(), 10 + step);
      ExpectOutputNear(TensorValues(reply->results(0).output()), a.FullAttention(layer, qa),
                       v1::DTYPE_F32, "a");
      std::vector<int32_t> b_support = {0, 1};
      for (int64_t t = b.tokens(layer) - 5; t < b.tokens(layer); ++t) b_support.push_back(t);
      ExpectOutputNear(TensorValues(reply->results(1).output()),
                       b.Attention(layer, qb, std::vector<std::vector<int32_t>>(4, b_support)),
                       v1::DTYPE_F16, "b");
      ExpectOutputNear(TensorValues(reply->results(2).output()), c.FullAttention(layer, qc),
                       v1::DTYPE_BF16, "c");
    }
  }
}

// MaxDecodeReplyBytes, which every step checks before it is applied, bounds every
// reply: batches of sessions of different geometries and dtypes, q as data and as values, each
// of lse, diagnostics and compare_exact; and it is not far above the real size: beyond the
// numbers at their widest it counts the fields a reply may leave out (tier_micros, ~130 bytes;
// each head's fidelity and timing fields, up to ~60 bytes a head).
TEST_F(ServiceDecodeTest, EveryReplyFitsItsBoundAndTheBoundIsNearIt) {
  ReferenceSession a(MakeGeometry(1, 8, 2, 32), 25, 41);
  ReferenceSession b(MakeGeometry(1, 4, 4, 16, v1::DTYPE_F16), 40, 42);
  ReferenceSession c(MakeGeometry(1, 6, 3, 8, v1::DTYPE_BF16), 10, 43);
  const std::string id_a = CreateAndPrefill(a, MakePolicy(v1::SELECTOR_EXACT_TOPK, 4), 25);
  const std::string id_b = CreateAndPrefill(b, MakePolicy(v1::SELECTOR_STREAMING, 0, 2, 5), 7);
  const std::string id_c = CreateAndPrefill(c, MakePolicy(v1::SELECTOR_FULL), 3);
  ASSERT_FALSE(id_a.empty() || id_b.empty() || id_c.empty());
  const v1::Geometry* const geometries[] = {&a.geometry(), &b.geometry(), &c.geometry()};
  DecodeClient decode(stub());
  uint64_t seed = 100;
  for (const bool as_values : {false, true}) {
    for (int flags = 0; flags < 8; ++flags) {
      for (const int batch : {1, 3}) {
        SCOPED_TRACE(absl::StrCat("as_values ", as_values, ", flags ", flags, ", batch ", batch));
        v1::DecodeRequest request;
        request.set_request_id(~0ull - flags);
        request.set_return_lse(flags & 1);
        request.set_diagnostics(flags & 2);
        request.set_compare_exact(flags & 4);
        std::vector<float> q;
        *request.add_steps() = a.NextStep(id_a, 0, ++seed, &q, as_values);
        if (batch == 3) {
          *request.add_steps() = b.NextStep(id_b, 0, ++seed, &q, as_values);
          *request.add_steps() = c.NextStep(id_c, 0, ++seed, &q, as_values);
        }
        const uint64_t bound =
            MaxDecodeReplyBytes(request, {geometries, static_cast<size_t>(batch)});
        // Knowing each history's length (which bounds positions and per-head counts), as the
        // server does: tighter.
        const int64_t tokens[] = {a.tokens(0), b.tokens(0), c.tokens(0)};
        const uint64_t tight =
            MaxDecodeReplyBytes(request, {geometries, static_cast<size_t>(batch)},
                                {tokens, static_cast<size_t>(batch)});
        absl::StatusOr<v1::DecodeResponse> reply = decode.Step(request);
        ASSERT_TRUE(reply.ok()) << reply.status();
        int heads = 0;
        for (const v1::SequenceResult& r : reply->results()) heads += r.heads_size();
        const uint64_t size = reply->ByteSizeLong();
        EXPECT_LE(size, bound);
        EXPECT_LE(bound, size + 160 + 24 * batch + 64 * heads);
        EXPECT_LE(size, tight);
        EXPECT_LE(tight, size + 160 + 16 * batch + 40 * heads);
        EXPECT_LE(tight, bound);
      }
    }
  }
}

TEST_F(ServiceDecodeTest, EmptyRequestGetsEmptyReply) {
  DecodeClient decode(stub());
  v1::DecodeRequest request;
  request.set_request_id(42);
  request.set_layer(3);
  absl::StatusOr<v1::DecodeResponse> reply = decode.Step(request);
  ASSERT_TRUE(reply.ok()) << reply.status();
  EXPECT_EQ(reply->request_id(), 42u);
  EXPECT_EQ(reply->results_size(), 0);
  EXPECT_TRUE(decode.Finish().ok());
}

TEST_F(ServiceDecodeTest, AnEmptyRequestOfALayerNoSessionCouldHaveIsRefused) {
  for (const int layer : {-1, kMaxLayers}) {
    DecodeClient decode(stub());
    v1::DecodeRequest request;
    request.set_layer(layer);
    EXPECT_TRUE(testing::HasStatus(decode.Step(request).status(),
                                   absl::StatusCode::kInvalidArgument,
                                   absl::StrCat("layer must be in [0, 1024), got ", layer)));
  }
}

TEST_F(ServiceDecodeTest, LayersPrefilledInSeparateStreamsAndChunkSizes) {
  ReferenceSession ref(MakeGeometry(3, 4, 2, 16), 23, 31);
  absl::StatusOr<std::string> id =
      CreateSession(stub(), ref.geometry(), MakePolicy(v1::SELECTOR_FULL));
  ASSERT_TRUE(id.ok()) << id.status();
  // Layer 0 one token per chunk, as plain values.
  absl::StatusOr<v1::PrefillResponse> first =
      Prefill(stub(), PromptChunks(*id, ref.geometry(), 0, ref.prompt(0), 1, /*as_values=*/true));
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->layers_committed(), 1);
  absl::StatusOr<v1::SessionInfo> info = GetSession(stub(), *id);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->layers_prefilled(), 1);
  EXPECT_EQ(info->prompt_tokens(), 23);
  // Layers 2 then 1, whole, in a second stream; later chunks omit the session id.
  std::vector<v1::PrefillChunk> chunks = PromptChunks(*id, ref.geometry(), 2, ref.prompt(2), 23);
  for (v1::PrefillChunk& c : PromptChunks(*id, ref.geometry(), 1, ref.prompt(1), 10)) {
    c.clear_session_id();
    chunks.push_back(std::move(c));
  }
  absl::StatusOr<v1::PrefillResponse> second = Prefill(stub(), chunks);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->layers_committed(), 2);
  EXPECT_EQ(second->tokens(), 23);

  DecodeClient decode(stub());
  for (int layer = 0; layer < 3; ++layer) {
    std::vector<float> q;
    absl::StatusOr<v1::SequenceResult> result =
        DecodeOne(decode, ref, *id, layer, 300 + layer, &q, false, false);
    ASSERT_TRUE(result.ok()) << result.status();
    ExpectOutputNear(TensorValues(result->output()), ref.FullAttention(layer, q), v1::DTYPE_F32,
                     absl::StrCat("layer ", layer));
  }
}

TEST_F(ServiceDecodeTest, ListAndCloseSessionsFreeTheirMemory) {
  ReferenceSession a(MakeGeometry(1, 2, 2, 8), 10, 41);
  ReferenceSession b(MakeGeometry(1, 2, 2, 8), 10, 42);
  const std::string id_a = CreateAndPrefill(a, MakePolicy(v1::SELECTOR_FULL), 10);
  const std::string id_b = CreateAndPrefill(b, MakePolicy(v1::SELECTOR_FULL), 10);
  EXPECT_GT(server().server().budget().used(), 0);

  v1::ListSessionsResponse list;
  {
    grpc::ClientContext context;
    ASSERT_TRUE(stub().ListSessions(&context, {}, &list).ok());
  }
  ASSERT_EQ(list.sessions_size(), 2);
  std::vector<std::string> ids = {list.sessions(0).session_id(), list.sessions(1).session_id()};
  std::sort(ids.begin(), ids.end());
  std::vector<std::string> want = {id_a, id_b};
  std::sort(want.begin(), want.end());
  EXPECT_EQ(ids, want);

  for (const std::string& id : {id_a, id_b}) ASSERT_TRUE(CloseSession(stub(), id).ok());
  EXPECT_EQ(server().server().budget().used(), 0);
  EXPECT_EQ(GetSession(stub(), id_a).status().code(), absl::StatusCode::kNotFound);
  grpc::ClientContext context;
  v1::ListSessionsResponse empty;
  ASSERT_TRUE(stub().ListSessions(&context, {}, &empty).ok());
  EXPECT_EQ(empty.sessions_size(), 0);
}

TEST_F(ServiceDecodeTest, CreateSessionEchoesTheEffectivePolicy) {
  v1::CreateSessionResponse response;
  v1::Policy policy = MakePolicy(v1::SELECTOR_UNSPECIFIED);
  policy.set_placement(v1::PLACEMENT_UNSPECIFIED);
  ASSERT_TRUE(CreateSession(stub(), MakeGeometry(1, 2, 1, 8), policy, &response).ok());
  const v1::Policy& p = response.policy();
  EXPECT_EQ(p.placement(), v1::PLACEMENT_CPU);
  EXPECT_EQ(p.selector(), v1::SELECTOR_FULL);
  EXPECT_EQ(p.top_k(), 512);
  EXPECT_EQ(p.sinks(), 128);
  EXPECT_EQ(p.recent(), 512);
  EXPECT_EQ(p.retopk().cache_capacity(), 32);
  EXPECT_EQ(p.retopk().reuse_neighbors(), 4);
  EXPECT_EQ(p.retopk().recent_window(), 32);
  ASSERT_TRUE(p.retopk().has_tau());
  EXPECT_FLOAT_EQ(p.retopk().tau(), 0.85f);
  ASSERT_TRUE(p.retopk().has_refresh_interval());
  EXPECT_EQ(p.retopk().refresh_interval(), 128);
  const GraphIndexParams index_defaults;
  EXPECT_EQ(p.index().build_queries(), index_defaults.build_queries);
  EXPECT_EQ(p.index().build_topk(), index_defaults.build_topk);
  EXPECT_EQ(p.index().max_degree(), index_defaults.max_degree);
  EXPECT_EQ(p.index().search_list_size(), 512);  // max(top_k, 200), filled in (probe 25, 7)
  EXPECT_EQ(p.index().graph_scope(), kDefaultGraphScope == GraphScope::kKvHead
                                         ? v1::GRAPH_SCOPE_KV_HEAD
                                         : v1::GRAPH_SCOPE_QUERY_HEAD);
  absl::StatusOr<v1::SessionInfo> info = GetSession(stub(), response.session_id());
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->policy().SerializeAsString(), p.SerializeAsString());
  EXPECT_FLOAT_EQ(info->geometry().softmax_scale(), 1.0f / std::sqrt(8.0f));
  EXPECT_EQ(info->layers_prefilled(), 0);
  EXPECT_EQ(info->tokens(), 0);
}

TEST_F(ServiceDecodeTest, ZerosOfOptionalKnobsAreServedAsSent) {
  // sinks, recent and retopk.recent_window are proto3 optional: unset takes the default (above),
  // a zero sent is a zero served (before they were optional, a zero could not be told from
  // unset). An effective policy sent back is accepted as it was.
  v1::Policy policy = MakePolicy(v1::SELECTOR_INDEX, 8, /*sinks=*/0, /*recent=*/16);
  policy.mutable_retopk()->set_recent_window(0);
  v1::CreateSessionResponse response;
  ASSERT_TRUE(CreateSession(stub(), MakeGeometry(1, 2, 1, 8), policy, &response).ok());
  const v1::Policy& p = response.policy();
  EXPECT_EQ(p.sinks(), 0);
  EXPECT_EQ(p.recent(), 16);
  EXPECT_EQ(p.retopk().recent_window(), 0);
  v1::CreateSessionResponse again;
  ASSERT_TRUE(CreateSession(stub(), MakeGeometry(1, 2, 1, 8), p, &again).ok());
  EXPECT_EQ(again.policy().SerializeAsString(), p.SerializeAsString());

  policy.clear_sinks();
  policy.mutable_retopk()->clear_recent_window();
  ASSERT_TRUE(CreateSession(stub(), MakeGeometry(1, 2, 1, 8), policy, &response).ok());
  EXPECT_EQ(response.policy().sinks(), 128);
  EXPECT_EQ(response.policy().recent(), 16);
  EXPECT_EQ(response.policy().retopk().recent_window(), 32);
}

// Either graph scope is served and echoed as asked.
TEST_F(ServiceDecodeTest, CreateSessionEchoesTheGraphScope) {
  for (const v1::GraphScope scope : {v1::GRAPH_SCOPE_KV_HEAD, v1::GRAPH_SCOPE_QUERY_HEAD}) {
    v1::CreateSessionResponse response;
    v1::Policy policy = MakePolicy(v1::SELECTOR_INDEX);
    policy.mutable_index()->set_graph_scope(scope);
    ASSERT_TRUE(CreateSession(stub(), MakeGeometry(1, 4, 2, 8), policy, &response).ok());
    EXPECT_EQ(response.policy().index().graph_scope(), scope);
  }
}

}  // namespace
}  // namespace kvrecall
