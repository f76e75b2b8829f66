// Concurrency: many sessions decoded at once on separate streams each get exactly their own
// answers, and two streams decoding the same session serialize step by step.
#include <algorithm>
#include <cmath>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "tests/server_fixture.h"
#include "tests/test_util.h"

namespace kvrecall {
namespace {

using ::kvrecall::testing::DecodeClient;
using ::kvrecall::testing::ExpectOutputNear;
using ::kvrecall::testing::GetSession;
using ::kvrecall::testing::MakeGeometry;
using ::kvrecall::testing::MakePolicy;
using ::kvrecall::testing::ReferenceSession;
using ::kvrecall::testing::PrefilledSessionTest;
using ::kvrecall::testing::TensorValues;

class ServiceConcurrencyTest : public PrefilledSessionTest {};

TEST_F(ServiceConcurrencyTest, SessionsOnSeparateStreamsDecodeIndependently) {
  constexpr int kSessions = 6;
  constexpr int kSteps = 15;
  std::vector<std::unique_ptr<ReferenceSession>> refs;
  std::vector<std::string> ids;
  for (int i = 0; i < kSessions; ++i) {
    const v1::DType dtype = i % 2 == 0 ? v1::DTYPE_F32 : v1::DTYPE_BF16;
    refs.push_back(
        std::make_unique<ReferenceSession>(MakeGeometry(2, 4, 2, 16, dtype), 30 + i, 1000 * i));
    ids.push_back(CreateAndPrefill(*refs.back(), MakePolicy(v1::SELECTOR_FULL), 16));
  }
  // Each thread keeps its own stream; failures are collected and asserted afterwards.
  std::vector<std::string> failures(kSessions);
  std::vector<std::thread> threads;
  for (int i = 0; i < kSessions; ++i) {
    threads.emplace_back([&, i] {
      ReferenceSession& ref = *refs[i];
      DecodeClient decode(stub());
      for (int step = 0; step < kSteps && failures[i].empty(); ++step) {
        for (int layer = 0; layer < 2; ++layer) {
          v1::DecodeRequest request;
          request.set_layer(layer);
          std::vector<float> q;
          *request.add_steps() = ref.NextStep(ids[i], layer, 7 * step + layer + 100 * i, &q);
          absl::StatusOr<v1::DecodeResponse> reply = decode.Step(request);
          if (!reply.ok()) {
            failures[i] = reply.status().ToString();
            return;
          }
          const std::vector<double> want = ref.FullAttention(layer, q);
          const std::vector<float> got = TensorValues(reply->results(0).output());
          for (size_t j = 0; j < want.size(); ++j) {
            if (std::abs(got[j] - want[j]) >
                testing::OutputTolerance(ref.geometry().dtype(), want[j])) {
              failures[i] = absl::StrCat("step ", step, " layer ", layer, " element ", j, ": ",
                                         got[j], " vs ", want[j]);
              return;
            }
          }
          if (reply->results(0).position() != ref.tokens(layer) - 1) {
            failures[i] = absl::StrCat("position ", reply->results(0).position());
            return;
          }
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int i = 0; i < kSessions; ++i) EXPECT_EQ(failures[i], "") << "session " << i;
  for (int i = 0; i < kSessions; ++i) {
    absl::StatusOr<v1::SessionInfo> info = GetSession(stub(), ids[i]);
    ASSERT_TRUE(info.ok());
    EXPECT_EQ(info->tokens(), 30 + i + kSteps);
    EXPECT_EQ(info->decode_steps(), 2 * kSteps);
  }
}

TEST_F(ServiceConcurrencyTest, StreamsSharingASessionSerialize) {
  constexpr int kStreams = 3;
  constexpr int kSteps = 20;
  constexpr int64_t kPrompt = 25;
  ReferenceSession ref(MakeGeometry(1, 4, 2, 16), kPrompt, 5);
  const std::string id = CreateAndPrefill(ref, MakePolicy(v1::SELECTOR_FULL), 16);
  ASSERT_FALSE(id.empty());

  // Every stream sends its own tokens; the reply says where each one landed.
  struct Sent {
    ReferenceSession::Token token;
    int64_t position = -1;
    std::vector<float> output;
  };
  std::vector<std::vector<Sent>> sent(kStreams);
  std::vector<std::string> failures(kStreams);
  std::vector<std::thread> threads;
  for (int s = 0; s < kStreams; ++s) {
    threads.emplace_back([&, s] {
      DecodeClient decode(stub());
      for (int step = 0; step < kSteps; ++step) {
        Sent item{ref.MakeToken(10000 * (s + 1) + 3 * step)};
        v1::DecodeRequest request;
        *request.add_steps() = ref.Step(id, item.token);
        absl::StatusOr<v1::DecodeResponse> reply = decode.Step(request);
        if (!reply.ok()) {
          failures[s] = reply.status().ToString();
          return;
        }
        item.position = reply->results(0).position();
        item.output = TensorValues(reply->results(0).output());
        sent[s].push_back(std::move(item));
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int s = 0; s < kStreams; ++s) ASSERT_EQ(failures[s], "") << "stream " << s;

  // Positions are a permutation of the appended range: no step was lost or doubled.
  std::vector<const Sent*> by_position(kStreams * kSteps, nullptr);
  for (const auto& stream : sent) {
    for (const Sent& item : stream) {
      ASSERT_GE(item.position, kPrompt);
      ASSERT_LT(item.position, kPrompt + kStreams * kSteps);
      ASSERT_EQ(by_position[item.position - kPrompt], nullptr) << item.position;
      by_position[item.position - kPrompt] = &item;
    }
  }
  // Replaying the tokens in that order reproduces every answer: each step saw exactly the
  // tokens before it, whole.
  for (const Sent* item : by_position) {
    const std::vector<float> q = ref.Record(0, item->token);
    ExpectOutputNear(item->output, ref.FullAttention(0, q), v1::DTYPE_F32,
                     absl::StrCat("position ", item->position));
  }
  absl::StatusOr<v1::SessionInfo> info = GetSession(stub(), id);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->tokens(), kPrompt + kStreams * kSteps);
}

}  // namespace
}  // namespace kvrecall
