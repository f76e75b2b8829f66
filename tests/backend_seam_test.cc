// The layer-backend seam on the CPU backend (server/backends/): a prompt staged in two phases,
// a layer built from it, decode steps whose outputs and reports match brute force, the shadow of
// compare_exact, token reservations that a budget refuses without changing anything, memory
// charged and given back to the byte; MemoryGrant's set-aside; and the placements a server
// without a CUDA device offers.
#include <cmath>
#include <memory>
#include <numeric>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "index/selector_params.h"
#include "kernels/cpu/attention.h"
#include "server/backends/cpu_backend.h"
#include "server/backends/placements.h"
#include "server/backends/selector_charge.h"
#include "server/backends/tiered_backend.h"
#include "server/memory_budget.h"
#include "server/metrics.h"
#include "server/metrics_gauges.h"
#include "tests/server_fixture.h"
#include "tests/test_util.h"

namespace kvrecall {
namespace {

using ::kvrecall::testing::HasStatus;
using ::kvrecall::testing::RandomKv;
using ::kvrecall::testing::RandomNormal;
using ::kvrecall::testing::ReferenceAttention;
using ::kvrecall::testing::ReferenceTopK;
using ::kvrecall::testing::StopAfterAsks;

constexpr int kQHeads = 4, kKvHeads = 2, kDim = 16;

LayerConfig Config(SelectorKind kind, int top_k = 8) {
  LayerConfig config;
  config.shape = LayerShape{kQHeads, kKvHeads, kDim, 1.0f / std::sqrt(float{kDim})};
  config.dtype = v1::DTYPE_F32;
  config.selector.kind = kind;
  config.selector.top_k = top_k;
  config.selector.sinks = 4;
  config.selector.recent = 8;
  return config;
}

// Stages `kv` (and queries) in chunks of `chunk` tokens; a reservation beyond the last chunk is
// never committed and must not count.
std::unique_ptr<PromptStaging> Stage(CpuBackend& backend, const LayerConfig& config,
                                     const SessionAccounts& accounts, const RandomKv& kv,
                                     const std::vector<float>& queries, int64_t chunk) {
  absl::StatusOr<std::unique_ptr<PromptStaging>> staging =
      backend.NewPromptStaging(config, accounts);
  EXPECT_TRUE(staging.ok()) << staging.status();
  EXPECT_EQ((*staging)->kv_element(), KvElement::kF32) << "the CPU placement keeps f32";
  const int64_t kv_row = int64_t{kKvHeads} * kDim, q_row = int64_t{kQHeads} * kDim;
  auto key_tail = [&] { return static_cast<float*>((*staging)->key_tail()); };
  auto value_tail = [&] { return static_cast<float*>((*staging)->value_tail()); };
  for (int64_t t = 0; t < kv.tokens; t += chunk) {
    const int64_t n = std::min(chunk, kv.tokens - t);
    EXPECT_TRUE((*staging)->Reserve(n, "test").ok());
    // (A staging whose selector builds from no query keeps none: query_tail() is null.)
    if (float* tail = (*staging)->query_tail(); tail != nullptr) {
      std::copy_n(queries.data() + t * q_row, n * q_row, tail);
    }
    std::copy_n(kv.keys.data() + t * kv_row, n * kv_row, key_tail());
    std::copy_n(kv.values.data() + t * kv_row, n * kv_row, value_tail());
    EXPECT_TRUE((*staging)->Commit(n, /*with_queries=*/true).ok());
  }
  EXPECT_TRUE((*staging)->Reserve(5, "test").ok());  // reserved, written, never committed
  std::fill_n(key_tail(), 5 * kv_row, 1e6f);
  EXPECT_EQ((*staging)->tokens(), kv.tokens);
  return *std::move(staging);
}

class CpuBackendSeamTest : public ::testing::Test {
 protected:
  MemoryBudget budget_{0};
  CpuBackend backend_;
  SessionAccounts accounts_{&budget_, nullptr};
};

TEST_F(CpuBackendSeamTest, StepsOfABatchMatchBruteForceAndReportTheirPaths) {
  constexpr int64_t kPrompt = 100;
  const LayerConfig full = Config(SelectorKind::kFull);
  const LayerConfig topk = Config(SelectorKind::kExactTopK, 8);
  RandomKv kv_a(kPrompt + 1, kKvHeads, kDim, 1), kv_b(kPrompt + 1, kKvHeads, kDim, 2);
  const std::vector<float> queries = RandomNormal((kPrompt + 1) * kQHeads * kDim, 3);
  // The prompt is the first kPrompt tokens; token kPrompt arrives as a decode step.
  RandomKv prompt_a = kv_a, prompt_b = kv_b;
  prompt_a.tokens = prompt_b.tokens = kPrompt;
  auto layer_a = backend_.BuildLayer(full, accounts_, Stage(backend_, full, accounts_, prompt_a,
                                                            queries, 33),
                                    BuildStop());
  auto layer_b = backend_.BuildLayer(topk, accounts_, Stage(backend_, topk, accounts_, prompt_b,
                                                            queries, 100),
                                    BuildStop());
  ASSERT_TRUE(layer_a.ok()) << layer_a.status();
  ASSERT_TRUE(layer_b.ok()) << layer_b.status();
  EXPECT_EQ((*layer_a)->tokens(), kPrompt);

  const int64_t kv_row = int64_t{kKvHeads} * kDim;
  const float* q = queries.data() + kPrompt * kQHeads * kDim;
  std::vector<float> o(2 * kQHeads * kDim), lse(2 * kQHeads);
  std::vector<HeadReport> heads(2 * kQHeads);
  std::vector<std::vector<int32_t>> supports(2 * kQHeads);
  std::vector<LayerStep> steps;
  for (int b = 0; b < 2; ++b) {
    LayerBackend* layer = b == 0 ? layer_a->get() : layer_b->get();
    const RandomKv& kv = b == 0 ? kv_a : kv_b;
    ASSERT_TRUE(layer->ReserveToken().ok());
    steps.push_back(LayerStep{layer, q, kv.keys.data() + kPrompt * kv_row,
                              kv.values.data() + kPrompt * kv_row, o.data() + b * kQHeads * kDim,
                              lse.data() + b * kQHeads, heads.data() + b * kQHeads,
                              supports.data() + b * kQHeads});
  }
  std::unique_ptr<StepContext> context = backend_.NewStepContext(nullptr);
  ASSERT_TRUE(backend_.Step(steps, context.get()).ok());

  const double scale = full.shape.scale;
  for (int b = 0; b < 2; ++b) {
    const RandomKv& kv = b == 0 ? kv_a : kv_b;
    EXPECT_EQ(steps[b].layer->tokens(), kPrompt + 1);
    for (int h = 0; h < kQHeads; ++h) {
      const float* q_h = q + h * kDim;
      const int kv_head = KvHeadOf(h, kQHeads, kKvHeads);
      const std::vector<int32_t> want =
          b == 0 ? testing::AllTokens(kPrompt + 1) : ReferenceTopK(q_h, kv.view(), kv_head, scale, 8);
      std::vector<double> o_ref;
      const double lse_ref = ReferenceAttention(q_h, kv.view(), kv_head, want, scale, &o_ref);
      const int row = b * kQHeads + h;
      EXPECT_NEAR(lse[row], lse_ref, 1e-4);
      for (int i = 0; i < kDim; ++i) EXPECT_NEAR(o[row * kDim + i], o_ref[i], 1e-5);
      EXPECT_THAT(supports[row], ::testing::UnorderedElementsAreArray(want));
      EXPECT_EQ(heads[row].path, SelectionPath::kExact);
      EXPECT_EQ(heads[row].candidates, kPrompt + 1);
      EXPECT_EQ(heads[row].support, static_cast<int32_t>(want.size()));
    }
  }

  // The shadow: full attention and the exact top-K over the history as it now is.
  std::vector<float> full_o(kQHeads * kDim), full_lse(kQHeads);
  std::vector<std::vector<int32_t>> exact(kQHeads);
  std::vector<ShadowStep> shadow{
      ShadowStep{layer_b->get(), q, 8, full_o.data(), full_lse.data(), exact.data()}};
  ASSERT_TRUE(backend_.Shadow(shadow, context.get()).ok());
  for (int h = 0; h < kQHeads; ++h) {
    const float* q_h = q + h * kDim;
    const int kv_head = KvHeadOf(h, kQHeads, kKvHeads);
    std::vector<double> o_ref;
    const double lse_ref = ReferenceAttention(q_h, kv_b.view(), kv_head,
                                              testing::AllTokens(kPrompt + 1), scale, &o_ref);
    EXPECT_NEAR(full_lse[h], lse_ref, 1e-4);
    for (int i = 0; i < kDim; ++i) EXPECT_NEAR(full_o[h * kDim + i], o_ref[i], 1e-5);
    EXPECT_EQ(exact[h], ReferenceTopK(q_h, kv_b.view(), kv_head, scale, 8));
  }
}

TEST_F(CpuBackendSeamTest, ARefusedReservationChangesNothingAndMemoryIsGivenBack) {
  MemoryBudget small(64 << 10);
  const SessionAccounts accounts{&small, nullptr};
  LayerConfig config = Config(SelectorKind::kReTopK);
  RandomKv kv(60, kKvHeads, kDim, 4);
  const std::vector<float> queries = RandomNormal(60 * kQHeads * kDim, 5);
  {
    auto layer = backend_.BuildLayer(config, accounts, Stage(backend_, config, accounts, kv,
                                                             queries, 60),
                                      BuildStop());
    ASSERT_TRUE(layer.ok()) << layer.status();
    const LayerMemory before = (*layer)->memory();
    EXPECT_GT(before.selector_bytes, 0);  // the ReTopK caches
    EXPECT_EQ(small.used(), before.host_bytes);
    // Fill the budget, so that the next growth of the KV does not fit.
    const int64_t rest = small.limit() - small.used();
    ASSERT_TRUE(small.Reserve(rest, "the test").ok());
    // Step until the KV's capacity is used up and its growth does not fit.
    absl::Status refused;
    for (int i = 0; i < 10000; ++i) {
      refused = (*layer)->ReserveToken();
      if (!refused.ok()) break;
      std::vector<float> o(kQHeads * kDim), lse(kQHeads);
      std::vector<HeadReport> heads(kQHeads);
      std::vector<LayerStep> step{LayerStep{layer->get(), queries.data(), kv.keys.data(),
                                            kv.values.data(), o.data(), lse.data(), heads.data()}};
      ASSERT_TRUE(backend_.Step(step, nullptr).ok());
    }
    // Refused by the KV's growth, or first by the ReTopK state's (charged once it grew, past the
    // full budget: CheckNotOver).
    EXPECT_TRUE(HasStatus(refused, absl::StatusCode::kResourceExhausted,
                          "host memory budget exceeded: "));
    EXPECT_THAT(refused.message(), ::testing::AnyOf(::testing::HasSubstr("the new token needs"),
                                                    ::testing::HasSubstr(kSelectorGrowth)));
    const int64_t tokens = (*layer)->tokens();
    const LayerMemory at_refusal = (*layer)->memory();
    EXPECT_FALSE((*layer)->ReserveToken().ok());
    EXPECT_EQ((*layer)->tokens(), tokens);
    EXPECT_EQ((*layer)->memory().host_bytes, at_refusal.host_bytes);
    small.Release(rest);
  }
  EXPECT_EQ(small.used(), 0) << "every byte of the layer and its staging is given back";
}

// A layer whose Prefill will not commit stops building (index/build_stop.h): BuildLayer hands
// the stop to its selector's build and returns CANCELLED, and every byte of the staging and of
// what the build made is given back.
TEST_F(CpuBackendSeamTest, AStoppedBuildReturnsCancelledAndHoldsNothing) {
  constexpr int64_t kPrompt = 600;
  RandomKv kv(kPrompt, kKvHeads, kDim, 6);
  const std::vector<float> queries = RandomNormal(kPrompt * kQHeads * kDim, 7);
  for (const SelectorKind kind : {SelectorKind::kIndex, SelectorKind::kReTopK}) {
    SCOPED_TRACE(SelectorKindName(kind));
    const LayerConfig config = Config(kind);
    StopAfterAsks stop(1);
    auto layer = backend_.BuildLayer(config, accounts_,
                                     Stage(backend_, config, accounts_, kv, queries, 100),
                                     stop.stop());
    EXPECT_TRUE(HasStatus(layer.status(), absl::StatusCode::kCancelled,
                          "stopped: its result will not be used"))
        << layer.status();
    EXPECT_GE(stop.asks(), 1);  // (and once for each KV head's lists that were not begun)
    EXPECT_EQ(budget_.used(), 0);
  }
}

TEST(MemoryGrantTest, SetAsideIsDrawnFirstAndGivenBack) {
  MemoryBudget budget(1000);
  {
    MemoryGrant grant(&budget);
    ASSERT_TRUE(grant.SetAside(600, "the announcement").ok());
    EXPECT_EQ(budget.used(), 600);
    EXPECT_EQ(grant.held(), 600) << "what is set aside is held";
    EXPECT_TRUE(HasStatus(grant.SetAside(600, "a second one"),
                          absl::StatusCode::kResourceExhausted, "a second one"));
    // Another session cannot take what is set aside.
    EXPECT_FALSE(budget.Reserve(500, "another session").ok());
    ASSERT_TRUE(grant.Reserve(500, "a layer").ok());  // drawn from the set-aside
    EXPECT_EQ(budget.used(), 600);
    EXPECT_EQ(grant.set_aside(), 100);
    ASSERT_TRUE(grant.Reserve(300, "growth").ok());  // 100 set aside + 200 from the budget
    EXPECT_EQ(budget.used(), 800);
    EXPECT_FALSE(grant.Reserve(300, "too much").ok());
    EXPECT_EQ(budget.used(), 800) << "a refusal changes nothing";
    EXPECT_EQ(grant.held(), 800);
    grant.Charge(150);  // memory that exists: past the limit if need be
    EXPECT_EQ(grant.held(), 950);
    EXPECT_EQ(budget.used(), 950);
    // Freed memory goes to the budget while the session holds more than it announced, then
    // back to the set-aside: it keeps its 600.
    grant.Release(300);
    EXPECT_EQ(budget.used(), 650);
    EXPECT_EQ(grant.set_aside(), 0);
    grant.Release(650);
    EXPECT_EQ(grant.held(), 600);
    EXPECT_EQ(grant.set_aside(), 600);
    EXPECT_EQ(budget.used(), 600);
    EXPECT_FALSE(budget.Reserve(500, "another session").ok()) << "nor can it take it now";
    EXPECT_FALSE(grant.Reserve(2000, "past the budget").ok());
    EXPECT_EQ(grant.set_aside(), 600) << "what a refusal drew is put back";
    grant.Charge(700);  // 600 drawn from the set-aside, 100 more from the budget
    EXPECT_EQ(grant.set_aside(), 0);
    EXPECT_EQ(grant.held(), 700);
    EXPECT_EQ(budget.used(), 700);
    // A second announcement adds to the first.
    ASSERT_TRUE(grant.SetAside(50, "again").ok());
    grant.Release(700);
    EXPECT_EQ(grant.set_aside(), 650);
    EXPECT_EQ(budget.used(), 650);
    ASSERT_TRUE(grant.Reserve(20, "drawn").ok());
    EXPECT_EQ(grant.held(), 650);
    // Closed: the set-aside goes back, and what is freed after goes to the budget.
    grant.ReleaseSetAside();
    EXPECT_EQ(grant.held(), 20) << "the drawn bytes are still charged";
    EXPECT_EQ(budget.used(), 20);
    grant.Release(20);
    EXPECT_EQ(grant.held(), 0);
    EXPECT_EQ(budget.used(), 0);
    ASSERT_TRUE(grant.SetAside(100, "after").ok());
  }
  EXPECT_EQ(budget.used(), 0) << "what was still set aside goes back with the grant";
}

TEST(PlacementsTest, WithoutACudaDeviceGpuPlacementsSayWhy) {
  absl::StatusOr<std::unique_ptr<Placements>> placements = Placements::Create({});
  ASSERT_TRUE(placements.ok()) << placements.status();
  if (!(*placements)->gpu().empty()) GTEST_SKIP() << "this machine has a CUDA device";
  absl::StatusOr<AttentionBackend*> gpu =
      (*placements)->Choose(v1::PLACEMENT_GPU, Config(SelectorKind::kFull));
  EXPECT_EQ(gpu.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(gpu.status().message(),
              ::testing::AnyOf(::testing::HasSubstr("no CUDA device"),
                               ::testing::HasSubstr("built without CUDA")));
  EXPECT_THAT(gpu.status().message(),
              ::testing::HasSubstr("PLACEMENT_CPU is, and PLACEMENT_TIERED with its static sets "
                                   "in host memory"));
  absl::StatusOr<AttentionBackend*> cpu =
      (*placements)->Choose(v1::PLACEMENT_CPU, Config(SelectorKind::kFull));
  ASSERT_TRUE(cpu.ok());
  EXPECT_EQ((*cpu)->device(), "cpu");
  PlacementOptions named;
  named.gpus = std::vector<int>{0};
  EXPECT_TRUE(HasStatus(Placements::Create(named).status(), absl::StatusCode::kInvalidArgument,
                        "--gpus names"));
}

// A device's backend as MostRoom sees it: its device budget; nothing else is asked of it.
class DeviceBudgetOnlyBackend final : public AttentionBackend {
 public:
  DeviceBudgetOnlyBackend(std::string device, int64_t limit)
      : device_(std::move(device)), budget_(limit, device_ + " memory", "gpu_memory_budget_gb") {}
  v1::Placement placement() const override { return v1::PLACEMENT_GPU; }
  const std::string& device() const override { return device_; }
  MemoryBudget* device_budget() const override { return &budget_; }
  absl::Status CheckConfig(const LayerConfig&) const override { return absl::OkStatus(); }
  absl::StatusOr<std::unique_ptr<PromptStaging>> NewPromptStaging(
      const LayerConfig&, const SessionAccounts&) override {
    return absl::UnimplementedError("a budget only");
  }
  absl::StatusOr<std::unique_ptr<LayerBackend>> BuildLayer(const LayerConfig&,
                                                           const SessionAccounts&,
                                                           std::unique_ptr<PromptStaging>,
                                                           const BuildStop&) override {
    return absl::UnimplementedError("a budget only");
  }
  std::unique_ptr<StepContext> NewStepContext(MemoryAccount*) override { return nullptr; }
  absl::Status Step(std::span<LayerStep>, StepContext*) override {
    return absl::UnimplementedError("a budget only");
  }
  absl::Status Shadow(std::span<ShadowStep>, StepContext*) override {
    return absl::UnimplementedError("a budget only");
  }

 private:
  const std::string device_;
  mutable MemoryBudget budget_;
};

// A new session goes to the device with the most room for its tenant: a tenant whose share of
// GPU 0 is full goes to GPU 1 though GPU 0 has more free server-wide (review 21: the device with
// the most free budget was chosen, and the tenant refused there with its share of GPU 1 empty).
TEST(PlacementsTest, ASessionGoesWhereItsTenantHasRoom) {
  std::vector<std::unique_ptr<AttentionBackend>> gpus;
  gpus.push_back(std::make_unique<DeviceBudgetOnlyBackend>("cuda:0", 100));
  gpus.push_back(std::make_unique<DeviceBudgetOnlyBackend>("cuda:1", 100));
  MemoryBudget host(0);
  TenantBudgets alice("alice", 0, 30, &host);
  TenantBudgets bob("bob", 0, 60, &host);
  ASSERT_TRUE(alice.Within(gpus[0]->device_budget())->Reserve(30, "alice's").ok());
  ASSERT_TRUE(bob.Within(gpus[1]->device_budget())->Reserve(50, "bob's").ok());
  // Server-wide GPU 0 has 70 free and GPU 1 50: without tenants, GPU 0.
  EXPECT_EQ(MostRoom(gpus, nullptr)->device(), "cuda:0");
  EXPECT_EQ(MostRoom(gpus, &alice)->device(), "cuda:1") << "alice's share of GPU 0 is full";
  EXPECT_EQ(MostRoom(gpus, &bob)->device(), "cuda:0") << "bob has 10 left on GPU 1, 60 on GPU 0";
  alice.Within(gpus[0]->device_budget())->Release(30);
  bob.Within(gpus[1]->device_budget())->Release(50);
}

// /metrics reports each device's memory beside the sum: one device full beside an idle one read
// 50 % summed, though that device refuses (review 22, 5).
TEST(PlacementsTest, EachDevicesMemoryIsReportedApart) {
  std::vector<std::unique_ptr<AttentionBackend>> gpus;
  gpus.push_back(std::make_unique<DeviceBudgetOnlyBackend>("cuda:0", 100));
  gpus.push_back(std::make_unique<DeviceBudgetOnlyBackend>("cuda:1", 0));  // unlimited
  ASSERT_TRUE(gpus[0]->device_budget()->Reserve(95, "a session's").ok());
  const std::vector<DeviceGauges> devices = DeviceGaugesOf(gpus);
  ASSERT_EQ(devices.size(), 2u);
  EXPECT_EQ(devices[0].device, "cuda:0");
  EXPECT_EQ(devices[0].bytes_held, 95);
  EXPECT_EQ(devices[0].bytes_budget, 100);
  EXPECT_EQ(devices[1].device, "cuda:1");
  EXPECT_EQ(devices[1].bytes_held, 0);
  EXPECT_TRUE(std::isinf(devices[1].bytes_budget));
  ServerMetrics metrics;
  metrics.SetGaugeSource([&] {
    ServerGauges gauges;
    gauges.devices = devices;
    return gauges;
  });
  const std::string text = metrics.TextFormat();
  EXPECT_EQ(testing::SeriesValue(text, R"(kvrecall_gpu_device_memory_bytes{device="cuda:0"})"),
            95);
  EXPECT_EQ(
      testing::SeriesValue(text, R"(kvrecall_gpu_device_memory_budget_bytes{device="cuda:0"})"),
      100);
  EXPECT_THAT(text, ::testing::HasSubstr(
                        "\nkvrecall_gpu_device_memory_budget_bytes{device=\"cuda:1\"} +Inf\n"));
  gpus[0]->device_budget()->Release(95);
}

// And each tenant's share of each device: a tenant whose share of GPU 0 is nearly full is refused
// there though it holds nothing of GPU 1, where its summed gauges read half full. Read as a
// scrape reads them (TenantGaugesOf over the registry's tenants), then exported.
TEST(PlacementsTest, EachDevicesTenantShareIsReportedApart) {
  std::vector<std::unique_ptr<AttentionBackend>> gpus;
  gpus.push_back(std::make_unique<DeviceBudgetOnlyBackend>("cuda:0", 100));
  gpus.push_back(std::make_unique<DeviceBudgetOnlyBackend>("cuda:1", 20));  // below a share
  MemoryBudget host(0);
  auto alice = std::make_shared<TenantBudgets>("alice", 0, 30, &host);
  ASSERT_TRUE(alice->Within(gpus[0]->device_budget())->Reserve(29, "alice's").ok());
  ASSERT_TRUE(alice->host()->Reserve(7, "alice's").ok());
  EXPECT_EQ(alice->gpu_used_within(gpus[0]->device_budget()), 29);
  EXPECT_EQ(alice->gpu_used_within(gpus[1]->device_budget()), 0) << "never used";
  // bob holds a session and no memory now.
  const std::vector<SessionRegistry::TenantHoldings> tenants = {{"alice", 1, alice},
                                                                {"bob", 1, nullptr}};
  SessionLimits gpu_shares;
  gpu_shares.gpu_bytes_per_tenant = 30;
  std::vector<TenantGauges> read = TenantGaugesOf(tenants, gpu_shares, gpus);
  ASSERT_EQ(read.size(), 2u);
  ASSERT_TRUE(read[0].has_budgets);
  ASSERT_EQ(read[0].devices.size(), 2u);
  EXPECT_EQ(read[0].devices[0].device, "cuda:0");
  EXPECT_EQ(read[0].devices[0].bytes_held, 29);
  EXPECT_EQ(read[0].devices[0].bytes_budget, 30);
  EXPECT_EQ(read[0].devices[1].device, "cuda:1");
  EXPECT_EQ(read[0].devices[1].bytes_held, 0);
  EXPECT_EQ(read[0].devices[1].bytes_budget, 20) << "the device's budget bounds the share";
  EXPECT_EQ(read[0].gpu_bytes_held, 29);
  EXPECT_EQ(read[0].gpu_bytes_budget, 50);
  EXPECT_EQ(read[0].host_bytes_held, 7);
  EXPECT_TRUE(std::isinf(read[0].host_bytes_budget)) << "no host share of its own";
  ASSERT_EQ(read[1].devices.size(), 2u);
  EXPECT_EQ(read[1].devices[0].bytes_held, 0);
  EXPECT_EQ(read[1].devices[0].bytes_budget, 30);
  EXPECT_EQ(read[1].gpu_bytes_budget, 50);
  // Host shares only: the GPU's are none of the tenant's own (+Inf), what it holds counted.
  SessionLimits host_shares;
  host_shares.host_bytes_per_tenant = 1000;
  const std::vector<TenantGauges> host_only = TenantGaugesOf(tenants, host_shares, gpus);
  ASSERT_EQ(host_only[0].devices.size(), 2u);
  EXPECT_EQ(host_only[0].devices[0].bytes_held, 29);
  EXPECT_TRUE(std::isinf(host_only[0].devices[0].bytes_budget));
  EXPECT_TRUE(std::isinf(host_only[0].devices[1].bytes_budget));
  EXPECT_TRUE(std::isinf(host_only[0].gpu_bytes_budget));
  EXPECT_EQ(host_only[0].host_bytes_budget, 1000);
  // No shares: sessions only.
  const std::vector<TenantGauges> none = TenantGaugesOf(tenants, SessionLimits(), gpus);
  EXPECT_FALSE(none[0].has_budgets);
  EXPECT_TRUE(none[0].devices.empty());
  EXPECT_EQ(none[0].gpu_bytes_held, 0);
  // No GPU: no device series, sums 0.
  const std::vector<TenantGauges> cpu_only = TenantGaugesOf(tenants, gpu_shares, {});
  EXPECT_TRUE(cpu_only[0].devices.empty());
  EXPECT_EQ(cpu_only[0].gpu_bytes_budget, 0);

  ServerMetrics metrics;
  metrics.SetGaugeSource([&] {
    ServerGauges gauges;
    gauges.tenants = read;
    return gauges;
  });
  std::string text = metrics.TextFormat();
  EXPECT_EQ(testing::SeriesValue(text, R"(kvrecall_tenant_gpu_memory_bytes{tenant="alice"})"), 29);
  EXPECT_EQ(
      testing::SeriesValue(text, R"(kvrecall_tenant_gpu_memory_budget_bytes{tenant="alice"})"), 50);
  EXPECT_EQ(testing::SeriesValue(
                text, R"(kvrecall_tenant_gpu_device_memory_bytes{device="cuda:0",tenant="alice"})"),
            29);
  EXPECT_EQ(
      testing::SeriesValue(
          text,
          R"(kvrecall_tenant_gpu_device_memory_budget_bytes{device="cuda:0",tenant="alice"})"),
      30);
  EXPECT_EQ(
      testing::SeriesValue(
          text, R"(kvrecall_tenant_gpu_device_memory_budget_bytes{device="cuda:1",tenant="bob"})"),
      20);
  // (SeriesValue reads an absent series as 0: the idle device's series is there, at 0.)
  EXPECT_THAT(text,
              ::testing::HasSubstr("\nkvrecall_tenant_gpu_device_memory_bytes{device=\"cuda:1\","
                                   "tenant=\"alice\"} 0\n"));
  // A scrape that sees a tenant holding nothing removes its series, the devices' too.
  read.erase(read.begin());
  text = metrics.TextFormat();
  EXPECT_THAT(text, ::testing::Not(::testing::HasSubstr("tenant=\"alice\"")));
  EXPECT_THAT(text, ::testing::HasSubstr("tenant=\"bob\""));
  alice->Within(gpus[0]->device_budget())->Release(29);
  alice->host()->Release(7);
}

TEST(PlacementsTest, FlagsParse) {
  absl::StatusOr<PlacementOptions> all = PlacementOptionsFromFlags("all", -1, 2);
  ASSERT_TRUE(all.ok());
  EXPECT_FALSE(all->gpus.has_value());
  EXPECT_FALSE(all->gpu_memory_budget_bytes.has_value());
  EXPECT_EQ(all->gpu_headroom_bytes, int64_t{2} << 30);
  absl::StatusOr<PlacementOptions> some = PlacementOptionsFromFlags("0,2", 1.5, 0);
  ASSERT_TRUE(some.ok());
  EXPECT_EQ(*some->gpus, (std::vector<int>{0, 2}));
  EXPECT_EQ(*some->gpu_memory_budget_bytes, int64_t{3} << 29);
  absl::StatusOr<PlacementOptions> none = PlacementOptionsFromFlags("none", -1, 2);
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->gpus->empty());
  EXPECT_TRUE(HasStatus(PlacementOptionsFromFlags("0,x", -1, 2).status(),
                        absl::StatusCode::kInvalidArgument, "--gpus must be"));
  EXPECT_TRUE(HasStatus(PlacementOptionsFromFlags("all", -3, 2).status(),
                        absl::StatusCode::kInvalidArgument, "--gpu_memory_budget_gb"));
  EXPECT_TRUE(HasStatus(PlacementOptionsFromFlags("all", -1, -1).status(),
                        absl::StatusCode::kInvalidArgument, "--gpu_memory_headroom_gb"));
  EXPECT_EQ(all->tiered_device_exact_share, 0.75);
  EXPECT_TRUE(all->tiered_device_exact_balance);
  absl::StatusOr<PlacementOptions> host_heads = PlacementOptionsFromFlags("all", -1, 2, 0);
  ASSERT_TRUE(host_heads.ok());
  EXPECT_EQ(host_heads->tiered_device_exact_share, 0.0);
  absl::StatusOr<PlacementOptions> fixed = PlacementOptionsFromFlags("all", -1, 2, 0.5, false);
  ASSERT_TRUE(fixed.ok());
  EXPECT_EQ(fixed->tiered_device_exact_share, 0.5);
  EXPECT_FALSE(fixed->tiered_device_exact_balance);
  for (const double bad : {-0.1, 1.5, std::nan("")}) {
    EXPECT_TRUE(HasStatus(PlacementOptionsFromFlags("all", -1, 2, bad).status(),
                          absl::StatusCode::kInvalidArgument, "--tiered_gpu_exact_share"));
  }
}

// The balance moves the GPU's count of exact heads a head at a time: down when the host waited
// for the device's heads, up when the device ended more than one of its heads' time before the
// host did and ran all it was allowed, never past [0, bound].
TEST(DeviceHeadBalanceTest, MovesAHeadAtATimeTowardsWhereBothHalvesEndTogether) {
  DeviceHeadBalance balance(/*bound=*/24, /*start=*/16);
  EXPECT_EQ(balance.target(), 16);
  DeviceHeadBalance::StepTimes step;
  step.device_heads = step.run_device_heads = 16;
  step.device_exact = 160e-6;  // 10 us a head
  step.launch = 20e-6;
  step.device_step = 230e-6;   // the device ends at ~250 us
  step.host_end = 300e-6;      // the host 50 us later: more than a head's time
  step.finish_wait = 2e-6;     // the synchronization's own cost
  balance.Update(step);
  EXPECT_EQ(balance.target(), 17);
  // Within a head's time of each other: it stays.
  step.device_heads = step.run_device_heads = 17;
  step.device_exact = 170e-6;
  step.host_end = 255e-6;
  balance.Update(step);
  EXPECT_EQ(balance.target(), 17);
  // The host waited for the device's heads: one fewer.
  step.finish_wait = 40e-6;
  balance.Update(step);
  EXPECT_EQ(balance.target(), 16);
  // A retopk step with fewer exact heads than the count: the count did not hold the device
  // back, so slack does not raise it.
  step.finish_wait = 1e-6;
  step.device_heads = step.run_device_heads = 9;
  step.device_exact = 90e-6;
  step.host_end = 600e-6;
  balance.Update(step);
  EXPECT_EQ(balance.target(), 16);
  // Clamped to the bound, and to 0.
  step.device_heads = 24;
  for (int i = 0; i < 20; ++i) {
    step.device_heads = balance.target();
    balance.Update(step);
  }
  EXPECT_EQ(balance.target(), 24);
  step.finish_wait = 1e-3;
  step.device_heads = step.run_device_heads = 10;
  step.device_exact = 100e-6;  // 10 us a head again
  for (int i = 0; i < 40; ++i) balance.Update(step);
  EXPECT_EQ(balance.target(), 0);
  // At 0 the device ran no heads: a wait is not its heads' (the shortlists', the static sets')
  // and the last measured head time decides when to come back.
  step.device_heads = step.run_device_heads = 0;
  step.device_exact = 0;
  balance.Update(step);  // finish_wait still 1 ms
  EXPECT_EQ(balance.target(), 0);
  step.finish_wait = 0;
  step.host_end = step.launch + step.device_step + 5e-6;  // less than a head (10 us)
  balance.Update(step);
  EXPECT_EQ(balance.target(), 0);
  step.host_end = step.launch + step.device_step + 50e-6;
  balance.Update(step);
  EXPECT_EQ(balance.target(), 1);
  // Batched: the run's device time is shared by every sequence's heads. This layer's 2 of the
  // run's 20 heads at 200 us is 10 us a head, not 100: 50 us of slack moves it up.
  DeviceHeadBalance batched(8, 2);
  step.device_heads = 2;
  step.run_device_heads = 20;
  step.device_exact = 200e-6;
  step.finish_wait = 0;
  step.host_end = step.launch + step.device_step + 50e-6;
  batched.Update(step);
  EXPECT_EQ(batched.target(), 3);
  // A wait while this layer ran none of the run's heads does not lower it.
  step.device_heads = 0;
  step.finish_wait = 1e-3;
  batched.Update(step);
  EXPECT_EQ(batched.target(), 3);
  // A start past the bound is the bound.
  EXPECT_EQ(DeviceHeadBalance(4, 16).target(), 4);
}

}  // namespace
}  // namespace kvrecall
