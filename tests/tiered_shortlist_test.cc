// PLACEMENT_TIERED with policy.index.shortlist, served by an in-process server over loopback
// gRPC: the bulk's keys product-quantized on the static tier (the GPU where there is one, the
// host otherwise), each step's shortlist of every query head rescored exactly on the host, or,
// for the heads the static tier takes, there (on a CPU machine the host tier's stand-in for a
// device: PlacementOptions::tiered_host_exact_heads), against a host-only server. Against brute
// force: a shortlist as long as the bulk is the bulk's exact top-K (index and ReTopK's exact
// path); a short one is the exact top-K of what a reproduction of the quantizers (same
// training, same codes) lists, its worst-coded keys (outliers) included, while decoding grows
// the codes past the room reserved at prefill; GetSession counts the codes on the tier that
// holds them; the exact search a session gets unasked (the shortlist on a GPU, the graph on the
// host tier); what is refused, by name.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "index/basic_selectors.h"
#include "index/product_quantizer.h"
#include "index/selector_params.h"
#include "kernels/cpu/attention.h"
#include "server/backends/bulk_codes.h"
#include "server/backends/placements.h"
#include "server/backends/tiered_backend.h"
#include "server/kv_growth.h"
#include "tests/server_fixture.h"
#include "tests/test_util.h"

namespace kvrecall {
namespace {

using ::kvrecall::testing::CreateSession;
using ::kvrecall::testing::DecodeClient;
using ::kvrecall::testing::DriftingQueryTokens;
using ::kvrecall::testing::ExpectOutputNear;
using ::kvrecall::testing::GetSession;
using ::kvrecall::testing::HasStatus;
using ::kvrecall::testing::InProcessServer;
using ::kvrecall::testing::MakeGeometry;
using ::kvrecall::testing::MakePolicy;
using ::kvrecall::testing::PqReconstructionErrors;
using ::kvrecall::testing::PrefilledSessionTest;
using ::kvrecall::testing::ReferenceSession;
using ::kvrecall::testing::TensorValues;
using ::kvrecall::testing::TieredExactTopKSupports;
using ::testing::HasSubstr;

constexpr int kSinks = 16;
constexpr int kRecent = 48;
// Decode steps whose keys some tests plant far from every centroid (40x the others'): outliers
// of the codes once they leave the ring.
constexpr int kPlantedSteps = 4;

v1::Policy ShortlistPolicy(v1::Selector selector, int top_k, int shortlist) {
  v1::Policy p = MakePolicy(selector, top_k, kSinks, kRecent);
  p.set_placement(v1::PLACEMENT_TIERED);
  p.mutable_index()->set_shortlist(shortlist);
  if (selector == v1::SELECTOR_RETOPK) p.mutable_retopk()->set_tau(2.0f);  // never reuse
  return p;
}

// ReTopK with a shortlist whose paths mix on DriftingQueryTokens with a few fresh heads: tau 0.6,
// a refresh every 16 steps.
v1::Policy MixedPathsReTopKPolicy(int top_k, int shortlist) {
  v1::Policy p = ShortlistPolicy(v1::SELECTOR_RETOPK, top_k, shortlist);
  p.mutable_retopk()->set_tau(0.6f);
  p.mutable_retopk()->set_refresh_interval(16);
  return p;
}

// Expects two servers' outputs of the same step to agree: each is f32 arithmetic rounded to the
// dtype on the way out, so they may sit a rounding apart each (the GPU's heads sum in another
// order than the host's: d58 saw one bf16 step between them in 3 of 61K elements). `exact`: the
// same arithmetic on both (the host tier's stand-in runs the host's own exact path), so equal.
void ExpectSameOutputs(const std::vector<float>& got, const std::vector<float>& other,
                       v1::DType dtype, const std::string& what, bool exact) {
  ASSERT_EQ(got.size(), other.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    if (exact) {
      ASSERT_EQ(got[i], other[i]) << what << " element " << i;
    } else {
      ASSERT_NEAR(got[i], other[i], 2 * testing::OutputTolerance(dtype, other[i]))
          << what << " element " << i;
    }
  }
}

// Token positions of the static set of a layer of n tokens.
std::vector<int32_t> StaticSet(int64_t n) {
  std::vector<int32_t> ids;
  AppendStaticSet(n, kSinks, kRecent, &ids);
  return ids;
}

// What the server's codes hold, rebuilt from the reference's keys: the quantizers trained on the
// prompt's bulk as BulkCodes trains them (its first TrainedRowsOf rows), every bulk row coded,
// and the outliers: rows whose reconstruction error exceeds the 1 - 1/kOutlierShare quantile of
// the prompt bulk's held-out last rows.
class ReproducedCodes {
 public:
  explicit ReproducedCodes(const KvView& prompt_bulk) {
    for (int h = 0; h < prompt_bulk.kv_heads; ++h) {
      const int64_t trained = BulkCodes::TrainedRowsOf(prompt_bulk.tokens);
      absl::StatusOr<ProductQuantizer> pq =
          ProductQuantizer::Train(VectorSet::KeysOf(prompt_bulk, h, 0, trained),
                                  BulkCodes::TrainingParams(prompt_bulk.head_dim));
      EXPECT_TRUE(pq.ok()) << pq.status();
      quantizers_.push_back(*std::move(pq));
      std::vector<float> errors = Errors(prompt_bulk, h);
      errors.erase(errors.begin(), errors.begin() + trained);  // the held-out rows' errors
      const auto held_out = static_cast<int64_t>(errors.size());
      const int64_t rank = held_out - 1 - held_out / BulkCodes::kOutlierShare;
      std::nth_element(errors.begin(), errors.begin() + rank, errors.end());
      thresholds_.push_back(errors[rank]);
    }
  }
  // Query head h's candidates (its best `n` bulk rows by ADC score and its KV head's outliers)
  // and its support: their exact top K, as token positions.
  std::vector<int32_t> Support(const float* q, int q_heads, int h, const KvView& bulk, int n,
                               int k, float scale, int64_t* candidates) const {
    const int kv_head = KvHeadOf(h, q_heads, bulk.kv_heads);
    const ProductQuantizer& pq = quantizers_[kv_head];
    std::vector<uint8_t> codes(bulk.tokens * pq.subspaces());
    pq.Encode(VectorSet::KeysOf(bulk, kv_head, 0, bulk.tokens), codes.data());
    std::vector<float> table(pq.subspaces() * ProductQuantizer::kCentroids), adc(bulk.tokens);
    pq.QueryTable(q, table.data());
    ProductQuantizer::ScanCodes(table.data(), codes.data(), bulk.tokens, pq.subspaces(),
                                adc.data());
    std::vector<int32_t> shortlist, best;
    cpu::TopKPositions(adc, n, &shortlist);
    const std::vector<float> errors = Errors(bulk, kv_head);
    for (int64_t i = 0; i < bulk.tokens; ++i) {
      if (errors[i] > thresholds_[kv_head] &&
          std::find(shortlist.begin(), shortlist.end(), i) == shortlist.end()) {
        shortlist.push_back(static_cast<int32_t>(i));
      }
    }
    *candidates = static_cast<int64_t>(shortlist.size());
    std::vector<float> exact(shortlist.size());
    cpu::ScoreTokens(q, bulk, kv_head, shortlist, scale, exact.data());
    cpu::TopKPositions(exact, k, &best);
    std::vector<int32_t> support;
    for (int32_t i : best) support.push_back(shortlist[i] + kSinks);
    return support;
  }

 private:
  // Squared reconstruction error of every key of `kv_head` in `bulk`.
  std::vector<float> Errors(const KvView& bulk, int kv_head) const {
    return PqReconstructionErrors(quantizers_[kv_head], bulk, kv_head);
  }

  std::vector<ProductQuantizer> quantizers_;
  std::vector<float> thresholds_;
};

// A server whose static tier takes exact heads: the GPU where there is one, else the host tier's
// stand-in for a device (PlacementOptions::tiered_host_exact_heads), so that the device heads'
// logic runs on a CPU machine too.
ServerOptions DeviceHeadsOptions() {
  ServerOptions options;
  options.placements.tiered_host_exact_heads = true;
  return options;
}

class TieredShortlistTest : public PrefilledSessionTest {
 protected:
  // The tier takes half the exact heads every step (the tests below say which), not a balanced
  // count (BalancedDeviceHeadsTakeTheHostsCandidates has its own server).
  ServerOptions Options() const override {
    ServerOptions options = DeviceHeadsOptions();
    options.placements.tiered_device_exact_share = 0.5;
    options.placements.tiered_device_exact_balance = false;
    return options;
  }
  // A server of the defaults whose host takes every exact head (the device none): what the
  // tests compare this one's device heads with.
  static absl::StatusOr<std::unique_ptr<InProcessServer>> StartHostOnlyServer() {
    ServerOptions host_only;
    host_only.placements.tiered_device_exact_share = 0;
    return InProcessServer::Start(host_only);
  }
  // Whether the static tier is a GPU (bf16 KV, codes in device memory); where it is not, the
  // host tier's stand-in takes the device's exact heads.
  bool gpu_tier() { return TieredOnGpu(); }
  v1::DType dtype() { return gpu_tier() ? v1::DTYPE_BF16 : v1::DTYPE_F32; }
  // Records `token` in ref and steps it on this server's session `id` and on a host-only
  // server's `host_id`, expecting the same outputs; false (with the failure) when a step failed.
  bool StepBoth(DecodeClient& client, const std::string& id, DecodeClient& host_client,
                const std::string& host_id, const ReferenceSession::Token& token,
                ReferenceSession& ref, size_t step, v1::DecodeResponse* reply,
                v1::DecodeResponse* host_reply) {
    ref.Record(0, token);
    absl::StatusOr<v1::DecodeResponse> got = Step(client, {id}, token, ref);
    absl::StatusOr<v1::DecodeResponse> host = Step(host_client, {host_id}, token, ref);
    EXPECT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(host.ok()) << host.status();
    if (!got.ok() || !host.ok()) return false;
    ExpectSameOutputs(TensorValues(got->results(0).output()),
                      TensorValues(host->results(0).output()), dtype(),
                      absl::StrCat("step ", step), !gpu_tier());
    *reply = *std::move(got);
    *host_reply = *std::move(host);
    return true;
  }
  absl::StatusOr<v1::DecodeResponse> Step(DecodeClient& client,
                                          const std::vector<std::string>& ids,
                                          const ReferenceSession::Token& token,
                                          const ReferenceSession& ref) {
    v1::DecodeRequest request;
    request.set_layer(0);
    request.set_diagnostics(true);
    for (const std::string& id : ids) *request.add_steps() = ref.Step(id, token);
    return client.Step(request);
  }
};

TEST_F(TieredShortlistTest, AShortlistAsLongAsTheBulkIsTheBulksExactTopK) {
  const v1::Geometry g = MakeGeometry(1, 8, 2, 64, dtype());
  ReferenceSession ref(g, 900, 51);
  const int k = 40;
  const std::string index_id =
      CreateAndPrefill(ref, ShortlistPolicy(v1::SELECTOR_INDEX, k, 4096), 300);
  const std::string retopk_id =
      CreateAndPrefill(ref, ShortlistPolicy(v1::SELECTOR_RETOPK, k, 4096), 300);
  DecodeClient client(stub());
  for (int step = 0; step < 8; ++step) {
    const ReferenceSession::Token token = ref.MakeToken(700 + step);
    const std::vector<float> q = ref.Record(0, token);
    absl::StatusOr<v1::DecodeResponse> reply = Step(client, {index_id, retopk_id}, token, ref);
    ASSERT_TRUE(reply.ok()) << reply.status();
    const int64_t bulk = ref.tokens(0) - kSinks - kRecent;
    const std::vector<std::vector<int32_t>> supports =
        TieredExactTopKSupports(ref, q, k, kSinks, kRecent);
    for (const v1::SequenceResult& result : reply->results()) {
      for (const v1::HeadDiagnostics& head : result.heads()) {
        EXPECT_NE(head.path(), v1::PATH_REUSE);
        EXPECT_EQ(head.candidates(), bulk) << "the whole bulk, shortlisted";
        EXPECT_EQ(head.support(), k + kSinks + kRecent);
      }
      ExpectOutputNear(TensorValues(result.output()), ref.Attention(0, q, supports), dtype(),
                       absl::StrCat("step ", step));
    }
  }
}

// A model's layers step in turn through one Decode stream, each with codes of its own (a GPU
// keeps a captured step per layer's codes: one per stream was captured anew at every layer),
// for several tokens. Each layer's prompt holds a key of ordinary norm along a direction of
// its own, and its decode queries point that way: its own codes shortlist that key (a 64-row
// shortlist of ~640), which then holds most of the attention mass, where another layer's codes
// would shortlist rows that key is not among. So every head keeps that mass (compare_exact's
// retained_mass), with index and ReTopK (never reusing).
TEST_F(TieredShortlistTest, LayersSteppingInTurnEachAttendTheirOwnBulk) {
  constexpr int kLayers = 3;
  const v1::Geometry g = MakeGeometry(kLayers, 8, 2, 64, dtype());
  const int d = g.head_dim();
  ReferenceSession ref(g, 700, 53);
  std::vector<std::vector<float>> directions;  // a unit vector per layer
  for (int layer = 0; layer < kLayers; ++layer) {
    std::vector<float> u = testing::RandomNormal(d, 900 + layer);
    double norm = 0;
    for (float x : u) norm += double{x} * x;
    for (float& x : u) x = static_cast<float>(x / std::sqrt(norm));
    directions.push_back(u);
    std::vector<float> key(u);
    for (float& x : key) x *= std::sqrt(static_cast<float>(d));  // a N(0, 1) key's norm
    for (int h = 0; h < g.kv_heads(); ++h) ref.SetPromptKey(layer, 150 + 180 * layer, h, key);
  }
  const int k = 16;
  for (const v1::Selector selector : {v1::SELECTOR_INDEX, v1::SELECTOR_RETOPK}) {
    SCOPED_TRACE(selector == v1::SELECTOR_INDEX ? "index" : "retopk");
    ReferenceSession session_ref = ref;
    const std::string id = CreateAndPrefill(session_ref, ShortlistPolicy(selector, k, 64), 300);
    ASSERT_FALSE(id.empty());
    DecodeClient client(stub());
    for (int step = 0; step < 6; ++step) {
      for (int layer = 0; layer < kLayers; ++layer) {
        ReferenceSession::Token token = session_ref.MakeToken(800 + 10 * step + layer);
        for (int h = 0; h < g.q_heads(); ++h) {  // |q| = 8: the key scores 8 after scaling
          for (int j = 0; j < d; ++j) token.q[h * d + j] = 8.0f * directions[layer][j];
        }
        session_ref.Record(layer, token);
        v1::DecodeRequest request;
        request.set_layer(layer);
        request.set_compare_exact(true);
        *request.add_steps() = session_ref.Step(id, token);
        absl::StatusOr<v1::DecodeResponse> reply = client.Step(request);
        ASSERT_TRUE(reply.ok()) << reply.status();
        for (const v1::HeadDiagnostics& head : reply->results(0).heads()) {
          EXPECT_GT(head.retained_mass(), 0.6f) << "step " << step << " layer " << layer;
          EXPECT_EQ(head.support(), k + kSinks + kRecent);
        }
      }
    }
  }
}

// The last half of an index layer's query heads run their exact paths on the device
// (PlacementOptions::tiered_device_exact_share; on a GPU reading the host's bulk over PCIe, on a
// CPU machine on the host tier's stand-in): with a shortlist as long as the bulk their states
// are the brute-force exact top-K's, as the host's heads' are; they report the same candidates
// and no host time, and the step their device time (tier_micros.device_exact). A server given 0
// keeps every head on the host, with the same outputs.
TEST_F(TieredShortlistTest, HalfTheHeadsExactPathsRunOnTheDevice) {
  const v1::Geometry g = MakeGeometry(1, 8, 2, 64, dtype());
  ReferenceSession ref(g, 900, 59);
  const int k = 40;
  const v1::Policy policy = ShortlistPolicy(v1::SELECTOR_INDEX, k, 4096);
  absl::StatusOr<std::unique_ptr<InProcessServer>> other = StartHostOnlyServer();
  ASSERT_TRUE(other.ok()) << other.status();
  const std::string id = CreateAndPrefill(ref, policy, 300);
  const std::string host_id = CreateAndPrefill(ref, policy, 300, other->get());
  DecodeClient client(stub()), host_client((*other)->stub());
  const int device_heads = g.q_heads() / 2;
  for (int step = 0; step < 12; ++step) {
    const ReferenceSession::Token token = ref.MakeToken(900 + step);
    const std::vector<float> q = ref.Record(0, token);
    absl::StatusOr<v1::DecodeResponse> reply = Step(client, {id}, token, ref);
    absl::StatusOr<v1::DecodeResponse> host_reply = Step(host_client, {host_id}, token, ref);
    ASSERT_TRUE(reply.ok()) << reply.status();
    ASSERT_TRUE(host_reply.ok()) << host_reply.status();
    // The device's time for its heads is reported apart from the static sets'.
    EXPECT_GT(reply->tier_micros().device_exact(), 0.0) << "step " << step;
    EXPECT_LE(reply->tier_micros().device_exact(), reply->server_micros()) << "step " << step;
    EXPECT_EQ(host_reply->tier_micros().device_exact(), 0.0) << "step " << step;
    const int64_t bulk = ref.tokens(0) - kSinks - kRecent;
    const std::vector<std::vector<int32_t>> supports =
        TieredExactTopKSupports(ref, q, k, kSinks, kRecent);
    const std::vector<float> got = TensorValues(reply->results(0).output());
    const std::vector<float> host = TensorValues(host_reply->results(0).output());
    ExpectOutputNear(got, ref.Attention(0, q, supports), dtype(), absl::StrCat("step ", step));
    ExpectSameOutputs(got, host, dtype(), absl::StrCat("against the host's, step ", step),
                      !gpu_tier());
    for (int h = 0; h < g.q_heads(); ++h) {
      SCOPED_TRACE(absl::StrCat("step ", step, " head ", h));
      const v1::HeadDiagnostics& head = reply->results(0).heads(h);
      const v1::HeadDiagnostics& host_head = host_reply->results(0).heads(h);
      EXPECT_EQ(head.path(), v1::PATH_EXACT);
      EXPECT_EQ(head.candidates(), bulk) << "the whole bulk, shortlisted";
      EXPECT_EQ(head.candidates(), host_head.candidates());
      EXPECT_EQ(head.support(), k + kSinks + kRecent);
      EXPECT_GT(host_head.bulk_micros(), 0.0f);
      if (h >= g.q_heads() - device_heads) {
        EXPECT_EQ(head.bulk_micros(), 0.0f) << "the device's head";
      } else {
        EXPECT_GT(head.bulk_micros(), 0.0f) << "the host's head";
      }
    }
  }
}

// A prompt whose host KV arrays are mappings of their own (1100 tokens of 8 KV heads x 128: over
// 2 MiB each) and whose session announced no max_tokens: the first decode token grows them
// (kvrecalld --host_kv_growth_ahead=false: in the step; by default: ahead of need, begun when
// the prompt filled them, or in the step where that had not begun), in place within the
// address space they reserved, the device's pin extended by the rows added (server/kv_store.h,
// kHostRowsAddressReserve, kHostRowsReserveMostBytes). Once those rows have left the ring for the bulk, the device's exact
// heads score the bulk across both pins: every step is the bulk's exact top-K (a shortlist as
// long as the bulk) and matches a host-only server.
TEST_F(TieredShortlistTest, AHostKvGrownWhereItIsIsReadAcrossItsPins) {
  for (const bool ahead : {false, true}) {
    SCOPED_TRACE(ahead ? "grown ahead of need" : "grown in the step");
    SetHostKvGrowthAhead(ahead);
    const absl::Cleanup restore = [] { SetHostKvGrowthAhead(true); };
    const v1::Geometry g = MakeGeometry(1, 32, 8, 128, dtype());
    const int64_t prompt = 1100;
    ReferenceSession ref(g, prompt, 62);  // (61 has a near-tie at the K-th score: 1e-7 apart)
    const int k = 40;
    const v1::Policy policy = ShortlistPolicy(v1::SELECTOR_INDEX, k, 4096);
    absl::StatusOr<std::unique_ptr<InProcessServer>> other = StartHostOnlyServer();
    ASSERT_TRUE(other.ok()) << other.status();
    // One chunk: each array holds exactly the prompt, so the first token grows it.
    const std::string id = CreateAndPrefill(ref, policy, prompt);
    const std::string host_id = CreateAndPrefill(ref, policy, prompt, other->get());
    absl::StatusOr<v1::SessionInfo> before = GetSession(stub(), id);
    ASSERT_TRUE(before.ok()) << before.status();
    DecodeClient client(stub()), host_client((*other)->stub());
    for (int step = 0; step < kRecent + 8; ++step) {
      SCOPED_TRACE(absl::StrCat("step ", step));
      const ReferenceSession::Token token = ref.MakeToken(prompt + step);
      const std::vector<float> q = ref.Record(0, token);
      absl::StatusOr<v1::DecodeResponse> reply = Step(client, {id}, token, ref);
      absl::StatusOr<v1::DecodeResponse> host_reply = Step(host_client, {host_id}, token, ref);
      ASSERT_TRUE(reply.ok()) << reply.status();
      ASSERT_TRUE(host_reply.ok()) << host_reply.status();
      if (step == 0) {
        absl::StatusOr<v1::SessionInfo> grown = GetSession(stub(), id);
        ASSERT_TRUE(grown.ok()) << grown.status();
        EXPECT_GT(grown->host_bytes(), before->host_bytes()) << "the first token grew the KV";
      }
      if (gpu_tier()) EXPECT_GT(reply->tier_micros().device_exact(), 0.0);
      const int64_t bulk = ref.tokens(0) - kSinks - kRecent;
      const std::vector<std::vector<int32_t>> supports =
          TieredExactTopKSupports(ref, q, k, kSinks, kRecent);
      const std::vector<float> got = TensorValues(reply->results(0).output());
      ExpectOutputNear(got, ref.Attention(0, q, supports), dtype(), "against the reference");
      ExpectSameOutputs(got, TensorValues(host_reply->results(0).output()), dtype(),
                        "against the host's", !gpu_tier());
      for (const v1::HeadDiagnostics& head : reply->results(0).heads()) {
        ASSERT_EQ(head.candidates(), bulk) << "the whole bulk, shortlisted";
      }
    }
    EXPECT_GT(ref.tokens(0) - kRecent, prompt) << "rows added by the growth are in the bulk";
  }
}

// With a short shortlist the device's heads take what the host's Select takes: the shortlist
// (the same one: the same codes on the same tier), the outliers (on a GPU uploaded every step)
// and the uncoded tail, deduplicated. Against a host-only server, per head: the same candidate
// count, the same support size, outputs to the dtype's tolerance, while decoding adds outliers;
// and a session of another top_k in the same request steps apart (one K a launch).
TEST_F(TieredShortlistTest, AShortShortlistsDeviceHeadsTakeTheHostsCandidates) {
  const v1::Geometry g = MakeGeometry(1, 8, 2, 64, dtype());
  ReferenceSession ref(g, 2600, 63);
  const int k = 32, n = 96;
  absl::StatusOr<std::unique_ptr<InProcessServer>> other = StartHostOnlyServer();
  ASSERT_TRUE(other.ok()) << other.status();
  const std::string id = CreateAndPrefill(ref, ShortlistPolicy(v1::SELECTOR_INDEX, k, n), 1000);
  const std::string wide_id =
      CreateAndPrefill(ref, ShortlistPolicy(v1::SELECTOR_INDEX, 2 * k, n), 1000);
  const std::string host_id =
      CreateAndPrefill(ref, ShortlistPolicy(v1::SELECTOR_INDEX, k, n), 1000, other->get());
  const std::string host_wide_id =
      CreateAndPrefill(ref, ShortlistPolicy(v1::SELECTOR_INDEX, 2 * k, n), 1000, other->get());
  DecodeClient client(stub()), host_client((*other)->stub());
  std::vector<ReferenceSession::Token> tokens = DriftingQueryTokens(ref, 60, 67);
  // The first steps' keys far from every centroid: outliers once they leave the ring (the
  // codes' bar, set on prompt rows they did not learn from, leaves random keys almost none).
  for (int step = 0; step < kPlantedSteps; ++step) {
    for (float& x : tokens[step].k) x *= 40.0f;
  }
  for (size_t step = 0; step < tokens.size(); ++step) {
    ref.Record(0, tokens[step]);
    absl::StatusOr<v1::DecodeResponse> reply = Step(client, {id, wide_id}, tokens[step], ref);
    absl::StatusOr<v1::DecodeResponse> host_reply =
        Step(host_client, {host_id, host_wide_id}, tokens[step], ref);
    ASSERT_TRUE(reply.ok()) << reply.status();
    ASSERT_TRUE(host_reply.ok()) << host_reply.status();
    for (int s = 0; s < 2; ++s) {
      const std::vector<float> got = TensorValues(reply->results(s).output());
      const std::vector<float> host = TensorValues(host_reply->results(s).output());
      ExpectSameOutputs(got, host, dtype(), absl::StrCat("sequence ", s, " step ", step),
                        !gpu_tier());
      for (int h = 0; h < g.q_heads(); ++h) {
        const v1::HeadDiagnostics& head = reply->results(s).heads(h);
        const v1::HeadDiagnostics& host_head = host_reply->results(s).heads(h);
        EXPECT_EQ(head.candidates(), host_head.candidates())
            << "sequence " << s << " step " << step << " head " << h;
        if (step >= kRecent + kPlantedSteps) {  // every planted key in the bulk
          EXPECT_GT(head.candidates(), n) << "the shortlist and outliers, step " << step;
        }
        EXPECT_EQ(head.support(), (s + 1) * k + kSinks + kRecent);
        EXPECT_EQ(head.bulk_micros() == 0.0f, h >= g.q_heads() / 2)
            << "sequence " << s << " step " << step << " head " << h;
      }
    }
  }
}

// Balanced by time (the server's default), a layer gives the device a count of heads that moves
// between steps within the share's bound (here 6 of 8), always its last heads, by the rule of
// DeviceHeadBalance over each step's reported times; whichever they are, each head's candidates
// and support and the outputs are the host-only server's.
TEST_F(TieredShortlistTest, BalancedDeviceHeadsTakeTheHostsCandidates) {
  const v1::Geometry g = MakeGeometry(1, 8, 2, 64, dtype());
  ReferenceSession ref(g, 2600, 79);
  const int k = 32, n = 96;
  ServerOptions balanced = DeviceHeadsOptions();
  absl::StatusOr<std::unique_ptr<InProcessServer>> server = InProcessServer::Start(balanced);
  absl::StatusOr<std::unique_ptr<InProcessServer>> other = StartHostOnlyServer();
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_TRUE(other.ok()) << other.status();
  ASSERT_TRUE(balanced.placements.tiered_device_exact_balance);
  const int bound =
      static_cast<int>(balanced.placements.tiered_device_exact_share * g.q_heads());
  const v1::Policy policy = ShortlistPolicy(v1::SELECTOR_INDEX, k, n);
  const std::string id = CreateAndPrefill(ref, policy, 1000, server->get());
  const std::string host_id = CreateAndPrefill(ref, policy, 1000, other->get());
  DecodeClient client((*server)->stub()), host_client((*other)->stub());
  const std::vector<ReferenceSession::Token> tokens = DriftingQueryTokens(ref, 40, 83);
  std::vector<int> counts;
  std::vector<v1::TierMicros> times;
  for (size_t step = 0; step < tokens.size(); ++step) {
    v1::DecodeResponse reply, host_reply;
    ASSERT_TRUE(StepBoth(client, id, host_client, host_id, tokens[step], ref, step, &reply,
                         &host_reply));
    times.push_back(reply.tier_micros());
    int device_heads = 0;
    for (int h = 0; h < g.q_heads(); ++h) {
      SCOPED_TRACE(absl::StrCat("step ", step, " head ", h));
      const v1::HeadDiagnostics& head = reply.results(0).heads(h);
      EXPECT_EQ(head.candidates(), host_reply.results(0).heads(h).candidates());
      EXPECT_EQ(head.support(), k + kSinks + kRecent);
      if (head.bulk_micros() == 0.0f) {
        ++device_heads;
      } else {
        EXPECT_EQ(device_heads, 0) << "a host head after a device head: not the last heads";
      }
    }
    EXPECT_LE(device_heads, bound) << "step " << step;
    counts.push_back(device_heads);
  }
  // Half the heads on the first step, then a head at a time.
  EXPECT_EQ(counts.front(), g.q_heads() / 2);
  for (size_t s = 1; s < counts.size(); ++s) {
    EXPECT_LE(std::abs(counts[s] - counts[s - 1]), 1) << "step " << s;
  }
  // Each move is DeviceHeadBalance::Update's for the step's times as its reply reports them (the
  // request's one layer, one launch): a step whose host waited for the device (finish_wait past
  // the bar) gives the next step a head fewer; any other gives it as many or one more, and one
  // more only below the bound and when the host's heads outlasted the launch by more than a
  // device head's time (the device's step, which took no less than nothing, ended that long
  // before them). Which way a step moves depends on the machine; that it follows the rule not.
  double head_seconds = DeviceHeadBalance::kUnmeasuredHeadSeconds;
  constexpr double kRounding = 1e-12;  // seconds through the reply's microseconds and back
  for (size_t s = 0; s + 1 < counts.size(); ++s) {
    SCOPED_TRACE(absl::StrCat("step ", s, ": ", times[s].ShortDebugString()));
    if (counts[s] > 0) head_seconds = times[s].device_exact() * 1e-6 / counts[s];
    const double bar = std::max(DeviceHeadBalance::kNoWaitSeconds, 0.5 * head_seconds);
    const double wait = times[s].finish_wait() * 1e-6;
    if (std::abs(wait - bar) < kRounding) continue;  // either side of the bar
    if (wait > bar) {
      EXPECT_EQ(counts[s + 1], std::max(0, counts[s] - 1)) << "the host waited for the device";
    } else if (counts[s + 1] != counts[s]) {
      EXPECT_EQ(counts[s + 1], counts[s] + 1);
      EXPECT_LT(counts[s], bound);
      const double host_after_launch =
          (times[s].bulk() + times[s].link_wait() - times[s].launch()) * 1e-6;
      EXPECT_GT(host_after_launch, head_seconds - kRounding);
    }
  }
}

// A prompt of 3000 tokens announced as 3000 (the codes' room is the prompt's bulk), then 300
// steps: the codes grow (twice over) while every step's support stays the reproduction's.
TEST_F(TieredShortlistTest, AShortShortlistIsRescoredExactlyWhileTheCodesGrow) {
  const v1::Geometry g = MakeGeometry(1, 8, 2, 64, dtype());
  ReferenceSession ref(g, 3000, 53);
  const int k = 32, n = 96;
  const v1::Policy policy = ShortlistPolicy(v1::SELECTOR_INDEX, k, n);
  v1::CreateSessionRequest create;
  *create.mutable_geometry() = g;
  *create.mutable_policy() = policy;
  create.set_max_tokens(3000);
  v1::CreateSessionResponse created;
  grpc::ClientContext context;
  ASSERT_TRUE(stub().CreateSession(&context, create, &created).ok());
  const std::string* id = &created.session_id();
  absl::StatusOr<v1::PrefillResponse> prefilled =
      testing::Prefill(stub(), ref.InterleavedPrompt(*id, 1000));
  ASSERT_TRUE(prefilled.ok()) << prefilled.status();
  const ReproducedCodes codes(ref.view(0).Tokens(kSinks, 3000 - kSinks - kRecent));
  absl::StatusOr<v1::SessionInfo> before = GetSession(stub(), *id);
  ASSERT_TRUE(before.ok()) << before.status();
  DecodeClient client(stub());
  int near = 0, total = 0;
  for (int step = 0; step < 300; ++step) {
    ReferenceSession::Token token = ref.MakeToken(5000 + step);
    if (step < kPlantedSteps) {
      for (float& x : token.k) x *= 40.0f;  // outliers once they leave the ring (as above)
    }
    const std::vector<float> q = ref.Record(0, token);
    absl::StatusOr<v1::DecodeResponse> reply = Step(client, {*id}, token, ref);
    ASSERT_TRUE(reply.ok()) << reply.status();
    // The shortlists' own time, apart from the static set's, within the server's.
    ASSERT_TRUE(reply->has_tier_micros());
    EXPECT_GT(reply->tier_micros().shortlist(), 0.0) << "step " << step;
    EXPECT_GT(reply->tier_micros().static_set(), 0.0) << "step " << step;
    EXPECT_LE(reply->tier_micros().shortlist(), reply->server_micros()) << "step " << step;
    // When they reached the host, and the tier's launch, both within the bulk's time.
    const v1::TierMicros& micros = reply->tier_micros();
    EXPECT_GT(micros.shortlists_ready(), 0.0) << "step " << step;
    EXPECT_LE(micros.shortlists_ready(), (micros.bulk() + micros.link_wait()) * (1 + 1e-6) + 1)
        << "step " << step;
    EXPECT_GE(micros.launch(), 0.0) << "step " << step;
    EXPECT_LE(micros.launch(), micros.bulk() * (1 + 1e-6) + 1) << "step " << step;
    EXPECT_GT(micros.plan(), 0.0) << "step " << step;
    EXPECT_LE(micros.plan() + micros.bulk(), reply->server_micros()) << "step " << step;
    if (step % 25 != 0) continue;
    const int64_t tokens = ref.tokens(0);
    const KvView bulk = ref.view(0).Tokens(kSinks, tokens - kSinks - kRecent);
    std::vector<std::vector<int32_t>> supports(g.q_heads());
    for (int h = 0; h < g.q_heads(); ++h) {
      int64_t candidates = 0;
      supports[h] = codes.Support(q.data() + h * g.head_dim(), g.q_heads(), h, bulk, n, k,
                                  ref.scale(), &candidates);
      const std::vector<int32_t> fixed = StaticSet(tokens);
      supports[h].insert(supports[h].end(), fixed.begin(), fixed.end());
      const v1::HeadDiagnostics& head = reply->results(0).heads(h);
      if (step >= kRecent + kPlantedSteps) {
        EXPECT_GT(candidates, n) << "a few outliers besides the shortlist";
      }
      if (!gpu_tier()) EXPECT_EQ(head.candidates(), candidates) << "step " << step;
      EXPECT_EQ(head.support(), k + kSinks + kRecent);
    }
    const std::vector<float> got = TensorValues(reply->results(0).output());
    const std::vector<double> want = ref.Attention(0, q, supports);
    if (!gpu_tier()) {
      // The host tier scans the codes with the reproduction's arithmetic: the same shortlist.
      ExpectOutputNear(got, want, dtype(), absl::StrCat("step ", step));
      continue;
    }
    // The GPU sums the table lookups in another order: a near-tie at the shortlist's edge may
    // go either way, and change a head's support by a token.
    for (int h = 0; h < g.q_heads(); ++h) {
      double dot = 0, a = 0, b = 0;
      for (int j = 0; j < g.head_dim(); ++j) {
        const double x = got[h * g.head_dim() + j], y = want[h * g.head_dim() + j];
        dot += x * y;
        a += x * x;
        b += y * y;
      }
      near += dot / std::sqrt(a * b) > 0.999;
      ++total;
    }
  }
  if (gpu_tier()) EXPECT_GE(near, total * 95 / 100);
  absl::StatusOr<v1::SessionInfo> after = GetSession(stub(), *id);
  ASSERT_TRUE(after.ok()) << after.status();
  // The codes had room for the bulk of 3001 tokens (the announced 3000 and the first step's)
  // and doubled once: 8 bytes a row (2 KV heads x 64 dims / 16).
  const int64_t row_bytes = g.kv_heads() * g.head_dim() / BulkCodes::kDimsPerCode;
  const int64_t room = 3001 - kSinks - kRecent;
  // The selector's state (wherever it lives) grew by the codes' room and by the exact path's
  // scores of the outliers, 4 bytes per query head and outlier of its KV head, held from step to
  // step (fewer outliers than an eighth of the bulk here: tiered_codes_test's bound) and the
  // claims of their chunks.
  const int64_t scores = after->selector_bytes() - before->selector_bytes() - room * row_bytes;
  EXPECT_GT(scores, 0);
  EXPECT_LE(scores, g.q_heads() * (room / 8) * 4 + g.kv_heads() * 64);
  if (gpu_tier()) {
    EXPECT_EQ(after->gpu_bytes() - before->gpu_bytes(), room * row_bytes);
  } else {
    EXPECT_EQ(after->gpu_bytes(), 0);
  }
}

// ReTopK over a shortlist: the heads that reuse run while the step's shortlists are computed
// (they need none; server/backends/tiered_backend.cc orders them first), the others wait for
// theirs; both kinds in one step, every step well formed.
TEST_F(TieredShortlistTest, ReTopKReusesWhileTheShortlistsAreInFlight) {
  const v1::Geometry g = MakeGeometry(1, 8, 2, 64, dtype());
  ReferenceSession ref(g, 3000, 57);
  const int k = 32, n = 96;
  const v1::Policy policy = MixedPathsReTopKPolicy(k, n);
  const std::string id = CreateAndPrefill(ref, policy, 1000);
  DecodeClient client(stub());
  int mixed_steps = 0;
  std::vector<ReferenceSession::Token> tokens = DriftingQueryTokens(ref, 40, 61);
  for (size_t s = 0; s < tokens.size(); s += 3) {
    // Every third step the first half of the heads asks something new: they fall back while
    // the others reuse.
    const std::vector<float> fresh = testing::RandomNormal(4 * g.head_dim(), 700 + s, 1.5f);
    std::copy(fresh.begin(), fresh.end(), tokens[s].q.begin());
  }
  for (const ReferenceSession::Token& token : tokens) {
    ref.Record(0, token);
    v1::DecodeRequest request;
    request.set_layer(0);
    request.set_diagnostics(true);
    request.set_compare_exact(true);
    *request.add_steps() = ref.Step(id, token);
    absl::StatusOr<v1::DecodeResponse> reply = client.Step(request);
    ASSERT_TRUE(reply.ok()) << reply.status();
    for (float x : TensorValues(reply->results(0).output())) ASSERT_TRUE(std::isfinite(x));
    int reused = 0;
    for (const v1::HeadDiagnostics& head : reply->results(0).heads()) {
      EXPECT_LE(head.support(), k + kSinks + kRecent);
      EXPECT_GT(head.retained_mass(), 0.0f);
      if (head.path() == v1::PATH_REUSE) {
        ++reused;
        // The union of R = 4 cached supports of K and the W = 32 newest bulk keys.
        EXPECT_LE(head.candidates(), 4 * k + 32);
      } else {
        EXPECT_GE(head.candidates(), n) << "the shortlist and the outliers";
      }
    }
    mixed_steps += reused > 0 && reused < g.q_heads();
  }
  EXPECT_GT(mixed_steps, 0) << "no step had both kinds of head";
  absl::StatusOr<v1::SessionInfo> info = GetSession(stub(), id);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_GT(info->paths().reuse(), 0);
  EXPECT_GT(info->paths().fallback() + info->paths().refresh(), 0);
}

// A retopk layer decides every head's path before its heads run; the heads on the exact path
// (fallback, refresh), up to half of them, the last ones, run on the device (a GPU, or the host
// tier's stand-in), and the supports they come back with enter ReTopK's caches as the host's
// would. Against a host-only server over a decode whose paths mix: every head's path, best
// cosine, candidates and support size agree at every step (a reuse step's candidates are the
// union of cached supports, so a support missing from a cache shows), and the outputs to the
// dtype's tolerance (equal on the host tier's stand-in); the decisions' time is reported.
TEST_F(TieredShortlistTest, ReTopKsExactPathsRunOnTheDeviceAndFeedItsCaches) {
  const v1::Geometry g = MakeGeometry(1, 8, 2, 64, dtype());
  ReferenceSession ref(g, 3000, 71);
  const int k = 32, n = 96;
  const v1::Policy policy = MixedPathsReTopKPolicy(k, n);
  absl::StatusOr<std::unique_ptr<InProcessServer>> other = StartHostOnlyServer();
  ASSERT_TRUE(other.ok()) << other.status();
  const std::string id = CreateAndPrefill(ref, policy, 1000);
  const std::string host_id = CreateAndPrefill(ref, policy, 1000, other->get());
  DecodeClient client(stub()), host_client((*other)->stub());
  std::vector<ReferenceSession::Token> tokens = DriftingQueryTokens(ref, 48, 73);
  for (size_t s = 0; s < tokens.size(); s += 3) {
    // Every third step a few heads ask something new: they fall back while the others reuse.
    const std::vector<float> fresh = testing::RandomNormal(5 * g.head_dim(), 800 + s, 1.5f);
    std::copy(fresh.begin(), fresh.end(), tokens[s].q.begin() + (s % 2) * 3 * g.head_dim());
  }
  int device_heads = 0, reuse_heads = 0, mixed_steps = 0;
  for (size_t step = 0; step < tokens.size(); ++step) {
    v1::DecodeResponse reply, host_reply;
    ASSERT_TRUE(StepBoth(client, id, host_client, host_id, tokens[step], ref, step, &reply,
                         &host_reply));
    // The heads the device should have: the last exact-path heads, at most half of them.
    std::vector<bool> on_device(g.q_heads(), false);
    int left = g.q_heads() / 2;
    for (int h = g.q_heads() - 1; h >= 0 && left > 0; --h) {
      if (host_reply.results(0).heads(h).path() != v1::PATH_REUSE) {
        on_device[h] = true;
        --left;
      }
    }
    int reused = 0;
    for (int h = 0; h < g.q_heads(); ++h) {
      SCOPED_TRACE(absl::StrCat("step ", step, " head ", h));
      const v1::HeadDiagnostics& head = reply.results(0).heads(h);
      const v1::HeadDiagnostics& host_head = host_reply.results(0).heads(h);
      ASSERT_EQ(head.path(), host_head.path());
      EXPECT_NEAR(head.best_cosine(), host_head.best_cosine(), 1e-6f);
      EXPECT_EQ(head.candidates(), host_head.candidates());
      EXPECT_EQ(head.support(), host_head.support());
      EXPECT_EQ(head.bulk_micros() == 0.0f, static_cast<bool>(on_device[h]));
      device_heads += on_device[h];
      reused += head.path() == v1::PATH_REUSE;
    }
    reuse_heads += reused;
    mixed_steps += reused > 0 && reused < g.q_heads();
    // The decisions ran after the launch, within the bulk; the device waited for their heads
    // (its clock) at most the step's time.
    const v1::TierMicros& micros = reply.tier_micros();
    EXPECT_GT(micros.decide(), 0.0) << "step " << step;
    EXPECT_LE(micros.launch() + micros.decide(), micros.bulk() * (1 + 1e-6) + 1)
        << "step " << step;
    EXPECT_GE(micros.device_exact_wait(), 0.0) << "step " << step;
    EXPECT_LE(micros.device_exact_wait(), reply.server_micros()) << "step " << step;
  }
  // The decode mixed the paths, and the device took exact heads.
  EXPECT_GT(mixed_steps, 4);
  EXPECT_GT(reuse_heads, 48);
  EXPECT_GT(device_heads, 48);
}

// A step that fails after its heads selected (on a GPU: a fault, or a host too late naming the
// exact heads, reported with the step's download; here the host tier's test check at the end of
// Finish) leaves ReTopK's caches as they were. Resent, it and every later step take the paths,
// best cosines, candidates and outputs of a twin session that never failed, whether ReTopK runs
// on the host alone (the graph's exact path) or hands exact paths to the tier (the shortlist,
// its paths decided before the launch). Before, the host heads' supports entered the cache with
// the failed step: the resent step found its own query there (cosine 1) and reused it.
class TieredFailedStepTest : public TieredShortlistTest {
 protected:
  ServerOptions Options() const override {
    ServerOptions options = TieredShortlistTest::Options();
    options.placements.tiered_host_finish_check = [fail = fail_]() -> absl::Status {
      if (fail->load() > 0 && fail->fetch_sub(1) == 1) {
        return absl::UnavailableError("test: the device's step failed after its heads ran");
      }
      return absl::OkStatus();
    };
    return options;
  }
  // Fails the run whose Finish is the n-th from now (1: the next), once.
  std::shared_ptr<std::atomic<int>> fail_ = std::make_shared<std::atomic<int>>(0);
};

TEST_F(TieredFailedStepTest, AFailedStepLeavesReTopKsCachesAsTheyWere) {
  if (gpu_tier()) GTEST_SKIP() << "the failure is the host tier's test check";
  const v1::Geometry g = MakeGeometry(1, 8, 2, 64, dtype());
  const int k = 32;
  v1::Policy graph = MixedPathsReTopKPolicy(k, 0);
  graph.mutable_index()->set_exact_search(v1::EXACT_SEARCH_GRAPH);
  for (const v1::Policy& policy : {graph, MixedPathsReTopKPolicy(k, 96)}) {
    SCOPED_TRACE(policy.index().shortlist() > 0 ? "shortlist" : "graph");
    ReferenceSession ref(g, 3000, 71);
    const std::string id = CreateAndPrefill(ref, policy, 1000);
    const std::string twin = CreateAndPrefill(ref, policy, 1000);
    DecodeClient client(stub());
    std::vector<ReferenceSession::Token> tokens = DriftingQueryTokens(ref, 30, 73);
    for (size_t s = 0; s < tokens.size(); s += 3) {
      const std::vector<float> fresh = testing::RandomNormal(3 * g.head_dim(), 800 + s, 1.5f);
      std::copy(fresh.begin(), fresh.end(), tokens[s].q.begin() + (s % 2) * 3 * g.head_dim());
    }
    int failed = 0, reused = 0, device_heads = 0;
    for (size_t step = 0; step < tokens.size(); ++step) {
      SCOPED_TRACE(absl::StrCat("step ", step));
      ref.Record(0, tokens[step]);
      if (step % 4 == 2) {  // on every path mix: fails once, then resent
        fail_->store(1);
        DecodeClient failing(stub());  // (a failed step ends its stream)
        EXPECT_TRUE(HasStatus(Step(failing, {id}, tokens[step], ref).status(),
                              absl::StatusCode::kUnavailable,
                              "test: the device's step failed after its heads ran; no token of "
                              "this request was appended"));
        ++failed;
      }
      absl::StatusOr<v1::DecodeResponse> got = Step(client, {id}, tokens[step], ref);
      absl::StatusOr<v1::DecodeResponse> want = Step(client, {twin}, tokens[step], ref);
      ASSERT_TRUE(got.ok()) << got.status();
      ASSERT_TRUE(want.ok()) << want.status();
      ExpectSameOutputs(TensorValues(got->results(0).output()),
                        TensorValues(want->results(0).output()), dtype(), "output",
                        /*exact=*/true);
      for (int h = 0; h < g.q_heads(); ++h) {
        const v1::HeadDiagnostics& head = got->results(0).heads(h);
        const v1::HeadDiagnostics& twin_head = want->results(0).heads(h);
        EXPECT_EQ(head.path(), twin_head.path()) << "head " << h;
        EXPECT_EQ(head.best_cosine(), twin_head.best_cosine()) << "head " << h;
        EXPECT_EQ(head.candidates(), twin_head.candidates()) << "head " << h;
        EXPECT_EQ(head.support(), twin_head.support()) << "head " << h;
        reused += head.path() == v1::PATH_REUSE;
        device_heads += head.bulk_micros() == 0.0f;
      }
    }
    EXPECT_EQ(failed, 7);
    EXPECT_GT(reused, 30) << "the steps reused";
    if (policy.index().shortlist() > 0) EXPECT_GT(device_heads, 30) << "the tier took heads";
    for (const std::string& session : {id, twin}) {
      absl::StatusOr<v1::SessionInfo> info = GetSession(stub(), session);
      ASSERT_TRUE(info.ok()) << info.status();
      EXPECT_EQ(info->tokens(), 3000 + static_cast<int64_t>(tokens.size()));
      EXPECT_EQ(info->decode_steps(), static_cast<int64_t>(tokens.size())) << "failures uncounted";
    }
  }
}

TEST_F(TieredShortlistTest, GetSessionCountsTheCodesWhereTheyLive) {
  const v1::Geometry g = MakeGeometry(1, 8, 2, 64, dtype());
  ReferenceSession ref(g, 2000, 55);
  const std::string plain = CreateAndPrefill(ref, ShortlistPolicy(v1::SELECTOR_EXACT_TOPK, 32, 0),
                                             1000);
  const std::string coded = CreateAndPrefill(ref, ShortlistPolicy(v1::SELECTOR_INDEX, 32, 64),
                                             1000);
  absl::StatusOr<v1::SessionInfo> a = GetSession(stub(), plain);
  absl::StatusOr<v1::SessionInfo> b = GetSession(stub(), coded);
  ASSERT_TRUE(a.ok() && b.ok());
  // Room for the bulk after the first step, 4 code bytes per 64-dim key.
  const int64_t codes = (2001 - kSinks - kRecent) * g.kv_heads() * 4;
  const int64_t codebooks = int64_t{g.kv_heads()} * 256 * g.head_dim() * 4;
  // The steps' lists on the host: each query head's shortlist, its size and candidates.
  const int64_t lists = int64_t{g.q_heads()} * (64 + 2) * 4;
  EXPECT_EQ(b->policy().index().shortlist(), 64);
  if (gpu_tier()) {
    EXPECT_EQ(b->gpu_bytes() - a->gpu_bytes(), codes + codebooks);
    EXPECT_EQ(b->selector_bytes(), codes + codebooks + codebooks + lists)
        << "the host's quantizers too";
  } else {
    EXPECT_EQ(b->gpu_bytes(), 0);
    EXPECT_EQ(b->selector_bytes(), codes + codebooks + lists);
  }
}

// policy.index.exact_search: unset, a tiered index session searches with the shortlist of
// N = 2K where the static tier is a GPU and with the graph where it is host memory, and says so
// in its effective policy; asked for, the shortlist without an N is the one of N = 2K on either
// tier (the same outputs as a session given shortlist = 2K), and the graph is the graph.
TEST_F(TieredShortlistTest, TheExactSearchIsTheShortlistOnAGpuAndTheGraphWithout) {
  const v1::Geometry g = MakeGeometry(1, 8, 2, 64, dtype());
  ReferenceSession ref(g, 900, 61);
  const int k = 40;
  v1::Policy unset = MakePolicy(v1::SELECTOR_INDEX, k, kSinks, kRecent);
  unset.set_placement(v1::PLACEMENT_TIERED);
  v1::Policy shortlist = unset;
  shortlist.mutable_index()->set_exact_search(v1::EXACT_SEARCH_SHORTLIST);
  v1::Policy graph = unset;
  graph.mutable_index()->set_exact_search(v1::EXACT_SEARCH_GRAPH);
  const v1::Policy given_n = ShortlistPolicy(v1::SELECTOR_INDEX, k, 2 * k);
  struct Run {
    std::string id;
    v1::ExactSearch search;
    int n;
  };
  std::vector<Run> runs = {
      {CreateAndPrefill(ref, unset, 300),
       gpu_tier() ? v1::EXACT_SEARCH_SHORTLIST : v1::EXACT_SEARCH_GRAPH, gpu_tier() ? 2 * k : 0},
      {CreateAndPrefill(ref, shortlist, 300), v1::EXACT_SEARCH_SHORTLIST, 2 * k},
      {CreateAndPrefill(ref, graph, 300), v1::EXACT_SEARCH_GRAPH, 0},
      {CreateAndPrefill(ref, given_n, 300), v1::EXACT_SEARCH_SHORTLIST, 2 * k},
  };
  for (const Run& run : runs) {
    absl::StatusOr<v1::SessionInfo> info = GetSession(stub(), run.id);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->policy().index().exact_search(), run.search) << run.id;
    EXPECT_EQ(info->policy().index().shortlist(), run.n) << run.id;
  }
  // ReTopK's exact path takes the same default; a graph knob asks for the graph; a scan or
  // another selector searches no index. As CreateSession echoes them.
  v1::Policy retopk = MakePolicy(v1::SELECTOR_RETOPK, k, kSinks, kRecent);
  retopk.set_placement(v1::PLACEMENT_TIERED);
  v1::Policy tuned = unset;
  tuned.mutable_index()->set_search_width(2);
  // A search list asked for asks for the graph, even the default's length (max(K, 200)), which
  // the effective policy shows (and which an effective policy sent back, its exact search
  // resolved, asks for nothing more: below).
  v1::Policy listed = unset;
  listed.mutable_index()->set_search_list_size(std::max(k, 200));
  v1::Policy scans = retopk;
  scans.mutable_retopk()->set_exact_flat_scan(true);
  v1::Policy exact_topk = MakePolicy(v1::SELECTOR_EXACT_TOPK, k, kSinks, kRecent);
  exact_topk.set_placement(v1::PLACEMENT_TIERED);
  const struct {
    v1::Policy policy;
    v1::ExactSearch search;
    int n;
  } echoes[] = {
      {retopk, gpu_tier() ? v1::EXACT_SEARCH_SHORTLIST : v1::EXACT_SEARCH_GRAPH,
       gpu_tier() ? 2 * k : 0},
      {tuned, v1::EXACT_SEARCH_GRAPH, 0},
      {listed, v1::EXACT_SEARCH_GRAPH, 0},
      {scans, v1::EXACT_SEARCH_UNSPECIFIED, 0},
      {exact_topk, v1::EXACT_SEARCH_UNSPECIFIED, 0},
  };
  for (const auto& echo : echoes) {
    v1::CreateSessionResponse created;
    absl::StatusOr<std::string> id = CreateSession(stub(), g, echo.policy, &created);
    ASSERT_TRUE(id.ok()) << id.status();
    EXPECT_EQ(created.policy().index().exact_search(), echo.search) << echo.policy.DebugString();
    EXPECT_EQ(created.policy().index().shortlist(), echo.n) << echo.policy.DebugString();
    // The effective policy, every default filled in (the search list's max(K, 200) too), sent
    // back is served as it was.
    v1::CreateSessionResponse again;
    ASSERT_TRUE(CreateSession(stub(), g, created.policy(), &again).ok());
    EXPECT_EQ(again.policy().SerializeAsString(), created.policy().SerializeAsString());
  }
  DecodeClient client(stub());
  for (int step = 0; step < 6; ++step) {
    const ReferenceSession::Token token = ref.MakeToken(700 + step);
    ref.Record(0, token);
    std::vector<std::string> ids;
    for (const Run& run : runs) ids.push_back(run.id);
    absl::StatusOr<v1::DecodeResponse> reply = Step(client, ids, token, ref);
    ASSERT_TRUE(reply.ok()) << reply.status();
    std::vector<std::vector<float>> outputs;
    for (const v1::SequenceResult& result : reply->results()) {
      outputs.push_back(TensorValues(result.output()));
    }
    const std::string what = absl::StrCat("step ", step);
    ExpectSameOutputs(outputs[1], outputs[3], dtype(), what + ": shortlist asked, N = 2K given",
                      /*exact=*/true);
    ExpectSameOutputs(outputs[0], gpu_tier() ? outputs[1] : outputs[2], dtype(),
                      what + ": unset, the tier's default", /*exact=*/true);
  }
}

// The exact search's resolution on either kind of static tier (the device branch runs here
// without a device; the served one is TheExactSearchIsTheShortlistOnAGpuAndTheGraphWithout).
TEST(ResolveExactSearchTest, TheDefaultFollowsThePlacementAndItsDevice) {
  struct Case {
    v1::Placement placement;
    SelectorKind kind;
    bool on_device;
    ExactSearch asked;
    int shortlist;
    bool flat_scan;
    ExactSearch want;
    int want_shortlist;
    int top_k = 512;
  };
  using E = ExactSearch;
  const v1::Placement tiered = v1::PLACEMENT_TIERED, cpu = v1::PLACEMENT_CPU;
  const std::vector<Case> cases = {
      {tiered, SelectorKind::kIndex, true, E::kDefault, 0, false, E::kShortlist, 1024},
      {tiered, SelectorKind::kReTopK, true, E::kDefault, 0, false, E::kShortlist, 1024},
      {tiered, SelectorKind::kIndex, false, E::kDefault, 0, false, E::kGraph, 0},
      {tiered, SelectorKind::kReTopK, false, E::kDefault, 0, false, E::kGraph, 0},
      {tiered, SelectorKind::kReTopK, true, E::kDefault, 0, true, E::kDefault, 0},
      {tiered, SelectorKind::kIndex, true, E::kGraph, 0, false, E::kGraph, 0},
      {tiered, SelectorKind::kIndex, false, E::kShortlist, 0, false, E::kShortlist, 1024},
      {tiered, SelectorKind::kIndex, false, E::kDefault, 600, false, E::kShortlist, 600},
      {tiered, SelectorKind::kIndex, true, E::kShortlist, 3000, false, E::kShortlist, 3000},
      {tiered, SelectorKind::kIndex, true, E::kDefault, 0, false, E::kShortlist, kMaxTopK,
       kMaxTopK},
      {tiered, SelectorKind::kIndex, true, E::kDefault, 0, false, E::kShortlist, kMaxTopK,
       kMaxTopK / 2 + 1},
      {cpu, SelectorKind::kIndex, true, E::kDefault, 0, false, E::kGraph, 0},
      {cpu, SelectorKind::kReTopK, true, E::kDefault, 0, false, E::kDefault, 0},
      {v1::PLACEMENT_GPU, SelectorKind::kReTopK, true, E::kDefault, 0, false, E::kDefault, 0},
      {tiered, SelectorKind::kExactTopK, true, E::kDefault, 0, false, E::kDefault, 0},
      {tiered, SelectorKind::kStreaming, true, E::kDefault, 0, false, E::kDefault, 0},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    SelectorParams p;
    p.kind = c.kind;
    p.top_k = c.top_k;
    p.exact_search = c.asked;
    p.shortlist = c.shortlist;
    p.retopk.exact_flat_scan = c.flat_scan;
    ASSERT_TRUE(p.Validate().ok()) << "case " << i << ": " << p.Validate();
    ASSERT_TRUE(ResolveExactSearch(c.placement, c.on_device, &p).ok()) << "case " << i;
    EXPECT_EQ(p.exact_search, c.want) << "case " << i;
    EXPECT_EQ(p.shortlist, c.want_shortlist) << "case " << i;
    EXPECT_TRUE(p.Validate().ok()) << "case " << i << ": " << p.Validate();
  }
  // Refusals leave the policy as it was.
  const struct {
    SelectorKind kind;
    ExactSearch asked;
    int shortlist;
    const char* message;
  } refusals[] = {
      {SelectorKind::kIndex, ExactSearch::kShortlist, 0,
       "policy.index.exact_search EXACT_SEARCH_SHORTLIST is served by PLACEMENT_TIERED only"},
      {SelectorKind::kIndex, ExactSearch::kDefault, 600,
       "policy.index.shortlist is served by PLACEMENT_TIERED only"},
      {SelectorKind::kReTopK, ExactSearch::kGraph, 0,
       "policy.index.exact_search applies to retopk in PLACEMENT_TIERED only: in PLACEMENT_CPU "
       "its exact path scans"},
  };
  for (const auto& r : refusals) {
    SelectorParams p;
    p.kind = r.kind;
    p.exact_search = r.asked;
    p.shortlist = r.shortlist;
    const absl::Status refused = ResolveExactSearch(cpu, true, &p);
    EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << r.message;
    EXPECT_THAT(refused.message(), HasSubstr(r.message));
    EXPECT_EQ(p.exact_search, r.asked) << r.message;
    EXPECT_EQ(p.shortlist, r.shortlist) << r.message;
  }
}

TEST_F(TieredShortlistTest, WhatCannotBeServedIsRefusedByName) {
  const v1::Geometry g = MakeGeometry(1, 8, 2, 64, dtype());
  struct Case {
    const char* message;
    v1::Policy policy;
    v1::Geometry geometry;
  };
  v1::Policy cpu = ShortlistPolicy(v1::SELECTOR_INDEX, 32, 64);
  cpu.set_placement(v1::PLACEMENT_CPU);
  v1::Policy flat = ShortlistPolicy(v1::SELECTOR_RETOPK, 32, 64);
  flat.mutable_retopk()->set_exact_flat_scan(true);
  // policy.index.exact_search's refusals.
  auto searching = [](v1::Policy p, v1::ExactSearch search) {
    p.mutable_index()->set_exact_search(search);
    return p;
  };
  // A graph knob beside another exact path named (the knobs ask for the graph).
  auto tuning = [](v1::Policy p, auto set) {
    set(p.mutable_index());
    return p;
  };
  v1::Policy flat_scan = ShortlistPolicy(v1::SELECTOR_RETOPK, 32, 0);
  flat_scan.mutable_retopk()->set_exact_flat_scan(true);
  v1::Policy flat_graph = ShortlistPolicy(v1::SELECTOR_RETOPK, 32, 0);
  flat_graph.mutable_retopk()->set_exact_flat_scan(true);
  flat_graph.mutable_index()->set_exact_search(v1::EXACT_SEARCH_GRAPH);
  const std::vector<Case> cases = {
      {"policy.index.exact_search EXACT_SEARCH_GRAPH and policy.index.shortlist 64 name two "
       "exact searches",
       searching(ShortlistPolicy(v1::SELECTOR_INDEX, 32, 64), v1::EXACT_SEARCH_GRAPH), g},
      {"policy.index.exact_search EXACT_SEARCH_SHORTLIST applies to the index and retopk "
       "selectors",
       searching(ShortlistPolicy(v1::SELECTOR_EXACT_TOPK, 32, 0), v1::EXACT_SEARCH_SHORTLIST), g},
      {"policy.index.exact_search EXACT_SEARCH_SHORTLIST is served by PLACEMENT_TIERED only",
       searching(MakePolicy(v1::SELECTOR_INDEX, 32, kSinks, kRecent), v1::EXACT_SEARCH_SHORTLIST),
       g},
      {"policy.retopk.exact_flat_scan and policy.index.exact_search EXACT_SEARCH_GRAPH name two "
       "exact paths",
       flat_graph, g},
      {"policy.index.exact_search has the unknown value 7",
       searching(ShortlistPolicy(v1::SELECTOR_INDEX, 32, 0), static_cast<v1::ExactSearch>(7)), g},
      {"policy.index.exact_search EXACT_SEARCH_GRAPH applies to the index and retopk selectors",
       searching(ShortlistPolicy(v1::SELECTOR_EXACT_TOPK, 32, 0), v1::EXACT_SEARCH_GRAPH), g},
      {"policy.index.exact_search applies to retopk in PLACEMENT_TIERED only",
       searching(MakePolicy(v1::SELECTOR_RETOPK, 32, kSinks, kRecent), v1::EXACT_SEARCH_GRAPH),
       g},
      {"policy.index.shortlist is served by PLACEMENT_TIERED only", cpu, g},
      {"policy.index.shortlist must be >= top_k (32), got 16",
       ShortlistPolicy(v1::SELECTOR_INDEX, 32, 16), g},
      {"policy.index.shortlist applies to the index and retopk selectors",
       ShortlistPolicy(v1::SELECTOR_EXACT_TOPK, 32, 64), g},
      {"policy.index.shortlist must be >= 0", ShortlistPolicy(v1::SELECTOR_INDEX, 32, -1), g},
      {"name two exact paths", flat, g},
      {"policy.index.max_degree tunes the graph index and policy.index.shortlist names another "
       "exact path: set one",
       tuning(ShortlistPolicy(v1::SELECTOR_INDEX, 32, 64),
              [](v1::IndexParams* i) { i->set_max_degree(8); }),
       g},
      {"policy.index.search_list_size tunes the graph index and policy.index.exact_search "
       "EXACT_SEARCH_SHORTLIST names another exact path",
       tuning(searching(ShortlistPolicy(v1::SELECTOR_RETOPK, 32, 0), v1::EXACT_SEARCH_SHORTLIST),
              [](v1::IndexParams* i) { i->set_search_list_size(100); }),
       g},
      {"policy.index.graph_scope tunes the graph index and policy.retopk.exact_flat_scan names "
       "another exact path",
       tuning(flat_scan,
              [](v1::IndexParams* i) { i->set_graph_scope(v1::GRAPH_SCOPE_QUERY_HEAD); }),
       g},
      {"policy.index.shortlist needs head_dim a multiple of 16",
       ShortlistPolicy(v1::SELECTOR_INDEX, 32, 64), MakeGeometry(1, 8, 2, 72, dtype())},
  };
  for (const Case& c : cases) {
    if (gpu_tier() && c.geometry.head_dim() == 72) continue;  // the GPU tier refuses d = 72 first
    absl::StatusOr<std::string> id = CreateSession(stub(), c.geometry, c.policy);
    EXPECT_EQ(id.status().code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_THAT(id.status().message(), HasSubstr(c.message));
  }
  // A GPU selects the shortlist with a row's N positions in its shared memory: a longer one than
  // it holds is refused by name (it was admitted, then failed its first step with INTERNAL).
  // The host tier scans the codes on the CPU, with no such bound.
  const v1::Policy longest = ShortlistPolicy(v1::SELECTOR_INDEX, 32, 1 << 20);
  absl::StatusOr<std::string> id = CreateSession(stub(), g, longest);
  if (gpu_tier()) {
    EXPECT_TRUE(HasStatus(id.status(), absl::StatusCode::kInvalidArgument,
                          "policy.index.shortlist 1048576 is not served by PLACEMENT_TIERED on "
                          "cuda:0: a top-K selection of 1048576 a row holds 8 bytes a position"));
  } else {
    EXPECT_TRUE(id.ok()) << id.status();
  }
}

// An effective policy, sent back as a new session's policy, is accepted and gives the same
// effective policy: it names the exact search and carries every graph knob at the server's
// default, which asks for nothing.
TEST_F(TieredShortlistTest, AnEchoedEffectivePolicyIsAcceptedAsItWas) {
  const v1::Geometry g = MakeGeometry(1, 8, 2, 64, dtype());
  v1::Policy flat = ShortlistPolicy(v1::SELECTOR_RETOPK, 32, 0);
  flat.mutable_retopk()->set_exact_flat_scan(true);
  v1::Policy named = ShortlistPolicy(v1::SELECTOR_INDEX, 32, 0);
  named.mutable_index()->set_exact_search(v1::EXACT_SEARCH_SHORTLIST);
  for (const v1::Policy& policy : {ShortlistPolicy(v1::SELECTOR_INDEX, 32, 64),
                                   ShortlistPolicy(v1::SELECTOR_RETOPK, 32, 64), named, flat,
                                   ShortlistPolicy(v1::SELECTOR_INDEX, 32, 0)}) {
    SCOPED_TRACE(policy.DebugString());
    v1::CreateSessionResponse first, again;
    ASSERT_TRUE(CreateSession(stub(), g, policy, &first).ok());
    ASSERT_TRUE(CreateSession(stub(), g, first.policy(), &again).ok());
    EXPECT_EQ(again.policy().DebugString(), first.policy().DebugString());
  }
}

}  // namespace
}  // namespace kvrecall
