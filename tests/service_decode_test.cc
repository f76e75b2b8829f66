// The service end to end on loopback: prompts streamed in chunks, decode steps of full,
// exact top-K and streaming sessions (f32, bf16, f16; grouped-query attention) checked against
// double-precision brute force over the KV the server was sent.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/kv_view.h"
#include "tests/server_fixture.h"
#include "tests/test_util.h"

namespace kvrecall {
namespace {

using ::kvrecall::testing::AllTokens;
using ::kvrecall::testing::CreateSession;
using ::kvrecall::testing::DecodeClient;
using ::kvrecall::testing::GetSession;
using ::kvrecall::testing::MakeGeometry;
using ::kvrecall::testing::MakePolicy;
using ::kvrecall::testing::MakeStep;
using ::kvrecall::testing::Prefill;
using ::kvrecall::testing::PromptChunks;
using ::kvrecall::testing::PromptLayer;
using ::kvrecall::testing::RandomNormal;
using ::kvrecall::testing::ReferenceAttention;
using ::kvrecall::testing::ReferenceTopK;
using ::kvrecall::testing::RoundTrip;
using ::kvrecall::testing::ServerTest;
using ::kvrecall::testing::TensorValues;

// The KV a session should hold, as the server saw it (after the trip through the dtype), and
// the requests that put it there.
class ReferenceSession {
 public:
  ReferenceSession(const v1::Geometry& g, int64_t prompt_tokens, uint64_t seed) : g_(g) {
    for (int l = 0; l < g.layers(); ++l) {
      PromptLayer p;
      const uint64_t s = seed + 100 * l;
      p.q = RandomNormal(prompt_tokens * g.q_heads() * g.head_dim(), s, 1.5f);
      p.k = RandomNormal(prompt_tokens * g.kv_heads() * g.head_dim(), s + 1);
      p.v = RandomNormal(prompt_tokens * g.kv_heads() * g.head_dim(), s + 2);
      keys_.push_back(RoundTrip(p.k, g.dtype()));
      values_.push_back(RoundTrip(p.v, g.dtype()));
      prompts_.push_back(std::move(p));
    }
  }

  const v1::Geometry& geometry() const { return g_; }
  const PromptLayer& prompt(int layer) const { return prompts_[layer]; }
  int64_t tokens(int layer) const {
    return static_cast<int64_t>(keys_[layer].size()) / (g_.kv_heads() * g_.head_dim());
  }
  KvView view(int layer) const {
    return KvView{keys_[layer].data(), values_[layer].data(), tokens(layer), g_.kv_heads(),
                  g_.head_dim()};
  }
  double scale() const { return 1.0 / std::sqrt(static_cast<double>(g_.head_dim())); }

  // Random q, k_new, v_new for the next token of `layer`, appended to the reference.
  v1::SequenceStep NextStep(const std::string& id, int layer, uint64_t seed,
                            std::vector<float>* q_seen, bool as_values = false) {
    const std::vector<float> q = RandomNormal(g_.q_heads() * g_.head_dim(), seed, 1.5f);
    const std::vector<float> k = RandomNormal(g_.kv_heads() * g_.head_dim(), seed + 1);
    const std::vector<float> v = RandomNormal(g_.kv_heads() * g_.head_dim(), seed + 2);
    const v1::DType wire = as_values ? v1::DTYPE_F32 : g_.dtype();
    *q_seen = RoundTrip(q, wire);
    const std::vector<float> k_seen = RoundTrip(k, wire);
    const std::vector<float> v_seen = RoundTrip(v, wire);
    keys_[layer].insert(keys_[layer].end(), k_seen.begin(), k_seen.end());
    values_[layer].insert(values_[layer].end(), v_seen.begin(), v_seen.end());
    return MakeStep(id, g_, q, k, v, as_values);
  }

  // Attention of every query head over its support, double precision: [q_heads, head_dim].
  std::vector<double> Attention(int layer, const std::vector<float>& q,
                                const std::vector<std::vector<int32_t>>& supports,
                                std::vector<double>* lse = nullptr) const {
    const int d = g_.head_dim();
    std::vector<double> out;
    for (int h = 0; h < g_.q_heads(); ++h) {
      std::vector<double> o;
      const double l = ReferenceAttention(q.data() + h * d, view(layer),
                                          KvHeadOf(h, g_.q_heads(), g_.kv_heads()), supports[h],
                                          scale(), &o);
      out.insert(out.end(), o.begin(), o.end());
      if (lse != nullptr) lse->push_back(l);
    }
    return out;
  }

 private:
  v1::Geometry g_;
  std::vector<PromptLayer> prompts_;
  std::vector<std::vector<float>> keys_;
  std::vector<std::vector<float>> values_;
};

// Absolute tolerance of an output element of magnitude |x| returned in `dtype`.
double Tolerance(v1::DType dtype, double x) {
  switch (dtype) {
    case v1::DTYPE_BF16: return std::abs(x) * 0x1p-8 + 1e-5;
    case v1::DTYPE_F16: return std::abs(x) * 0x1p-10 + 1e-5;
    default: return std::abs(x) * 1e-5 + 1e-5;
  }
}

void ExpectOutputNear(const std::vector<float>& got, const std::vector<double>& want,
                      v1::DType dtype, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], want[i], Tolerance(dtype, want[i])) << what << " element " << i;
  }
}

std::vector<std::vector<int32_t>> FullSupports(const ReferenceSession& ref, int layer) {
  return std::vector<std::vector<int32_t>>(ref.geometry().q_heads(),
                                           AllTokens(ref.tokens(layer)));
}

class ServiceDecodeTest : public ServerTest {
 protected:
  // Creates a session for `ref` and streams its prompt, layers interleaved chunk by chunk.
  std::string CreateAndPrefill(const ReferenceSession& ref, const v1::Policy& policy,
                               int64_t chunk_tokens) {
    absl::StatusOr<std::string> id = CreateSession(stub(), ref.geometry(), policy);
    EXPECT_TRUE(id.ok()) << id.status();
    if (!id.ok()) return "";
    std::vector<std::vector<v1::PrefillChunk>> per_layer;
    for (int l = 0; l < ref.geometry().layers(); ++l) {
      per_layer.push_back(PromptChunks(*id, ref.geometry(), l, ref.prompt(l), chunk_tokens));
    }
    std::vector<v1::PrefillChunk> interleaved;
    for (size_t c = 0; c < per_layer[0].size(); ++c) {
      for (auto& chunks : per_layer) interleaved.push_back(chunks[c]);
    }
    absl::StatusOr<v1::PrefillResponse> prefilled = Prefill(stub(), interleaved);
    EXPECT_TRUE(prefilled.ok()) << prefilled.status();
    if (prefilled.ok()) {
      EXPECT_EQ(prefilled->session_id(), *id);
      EXPECT_EQ(prefilled->layers_committed(), ref.geometry().layers());
      EXPECT_EQ(prefilled->tokens(), ref.tokens(0));
      EXPECT_GE(prefilled->build_seconds(), 0.0);
    }
    return *id;
  }
};

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
      const std::vector<double> want = ref.Attention(layer, q, FullSupports(ref, layer), &want_lse);
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

}  // namespace
}  // namespace kvrecall
