#include "server/metrics.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "google/protobuf/descriptor.h"
#include "prometheus/text_serializer.h"

namespace kvrecall {
namespace {

using prometheus::Counter;
using prometheus::Family;
using prometheus::Gauge;
using prometheus::Histogram;

// Counts `counter` up to a source's running `total`, of which `counted` it has counted. A total
// below that (a source without such events, a test's) counts nothing back.
void CountUpTo(int64_t total, Counter* counter, int64_t* counted) {
  if (total <= *counted) return;
  counter->Increment(static_cast<double>(total - *counted));
  *counted = total;
}

// The services whose methods get their own series.
constexpr const char* kServedServices[] = {
    "kvrecall.v1.KvRecall",
    "grpc.health.v1.Health",
    "grpc.reflection.v1alpha.ServerReflection",
};

constexpr int kPlacements = 4;  // UNSPECIFIED, CPU, GPU, TIERED
constexpr int kSelectorKinds = 5;

// 1-2-5 boundaries from m1 x 10^e1 up to m2 x 10^e2, parsed from their decimal spelling so
// that the text format shows them as written ("5e-05", not "5.000000000000001e-05").
Histogram::BucketBoundaries OneTwoFive(int first_mantissa, int first_exponent, int last_mantissa,
                                       int last_exponent) {
  Histogram::BucketBoundaries out;
  for (int e = first_exponent; e <= last_exponent; ++e) {
    for (int m : {1, 2, 5}) {
      if (e == first_exponent && m < first_mantissa) continue;
      if (e == last_exponent && m > last_mantissa) continue;
      out.push_back(std::strtod(absl::StrCat(m, "e", e).c_str(), nullptr));
    }
  }
  return out;
}

// 10 us .. 100 s for calls (unary calls are short, streams may last long).
const Histogram::BucketBoundaries& CallBuckets() {
  static const auto* b = new Histogram::BucketBoundaries(OneTwoFive(1, -5, 1, 2));
  return *b;
}
// 5 us .. 2 s for one decode step.
const Histogram::BucketBoundaries& StepBuckets() {
  static const auto* b = new Histogram::BucketBoundaries(OneTwoFive(5, -6, 2, 0));
  return *b;
}
// 1 ms .. 1000 s for prefills and index builds.
const Histogram::BucketBoundaries& BuildBuckets() {
  static const auto* b = new Histogram::BucketBoundaries(OneTwoFive(1, -3, 1, 3));
  return *b;
}
// 1, 4, 16, .. 4^10 (~1M) tokens scored by one head's selector.
const Histogram::BucketBoundaries& CandidateBuckets() {
  static const auto* b = [] {
    auto* bounds = new Histogram::BucketBoundaries;
    for (double v = 1; v <= 1048576; v *= 4) bounds->push_back(v);
    return bounds;
  }();
  return *b;
}

std::string PlacementLabel(v1::Placement placement) {
  std::string name = v1::Placement_Name(placement);
  if (absl::StartsWith(name, "PLACEMENT_")) name.erase(0, 10);
  return absl::AsciiStrToLower(name);
}

const char* PathLabel(SelectionPath path) {
  switch (path) {
    case SelectionPath::kExact:
      return "exact";
    case SelectionPath::kReuse:
      return "reuse";
    case SelectionPath::kFallback:
      return "fallback";
    case SelectionPath::kRefresh:
      return "refresh";
  }
  return "exact";
}

const char* CodeLabel(grpc::StatusCode code) {
  static constexpr const char* kNames[] = {"OK",
                                           "CANCELLED",
                                           "UNKNOWN",
                                           "INVALID_ARGUMENT",
                                           "DEADLINE_EXCEEDED",
                                           "NOT_FOUND",
                                           "ALREADY_EXISTS",
                                           "PERMISSION_DENIED",
                                           "RESOURCE_EXHAUSTED",
                                           "FAILED_PRECONDITION",
                                           "ABORTED",
                                           "OUT_OF_RANGE",
                                           "UNIMPLEMENTED",
                                           "INTERNAL",
                                           "UNAVAILABLE",
                                           "DATA_LOSS",
                                           "UNAUTHENTICATED"};
  const int index = static_cast<int>(code);
  return index >= 0 && index < 17 ? kNames[index] : "UNKNOWN";
}

}  // namespace

double BudgetGaugeValue(int64_t limit_bytes) {
  return limit_bytes > 0 ? static_cast<double>(limit_bytes)
                         : std::numeric_limits<double>::infinity();
}

MethodMetrics::MethodMetrics(std::string method, Family<Counter>* calls, Histogram* duration)
    : method_(std::move(method)), calls_(calls), duration_(duration) {
  // The codes of a server's own faults are exported from the start, at 0, so that an alert on
  // their increase sees the first one (a series born at 1 shows no increase).
  absl::MutexLock lock(&mu_);
  for (const grpc::StatusCode code :
       {grpc::StatusCode::INTERNAL, grpc::StatusCode::UNKNOWN, grpc::StatusCode::DATA_LOSS}) {
    by_code_[static_cast<int>(code)] =
        &calls_->Add({{"method", method_}, {"code", CodeLabel(code)}});
  }
}

void MethodMetrics::CountCall(grpc::StatusCode code, double seconds) {
  duration_->Observe(seconds);
  const int index = static_cast<int>(code);
  const int slot = index >= 0 && index < 17 ? index : static_cast<int>(grpc::StatusCode::UNKNOWN);
  Counter* counter;
  {
    absl::MutexLock lock(&mu_);
    counter = by_code_[slot];
    if (counter == nullptr) {
      counter = &calls_->Add(
          {{"method", method_}, {"code", CodeLabel(static_cast<grpc::StatusCode>(slot))}});
      by_code_[slot] = counter;
    }
  }
  counter->Increment();
}

void PolicyMetrics::CountLayerStep(std::span<const HeadReport> heads, double compute_seconds) {
  series_.layer_steps->Increment();
  std::array<int64_t, kSelectionPaths> by_path = {};
  // One locked update of the candidates histogram for all heads instead of one per head.
  const auto& bounds = CandidateBuckets();
  thread_local std::vector<double> increments;
  increments.assign(bounds.size() + 1, 0.0);
  double sum = 0;
  for (const HeadReport& head : heads) {
    ++by_path[static_cast<int>(head.path)];
    const double c = head.candidates;
    increments[std::lower_bound(bounds.begin(), bounds.end(), c) - bounds.begin()] += 1;
    sum += c;
  }
  for (int p = 0; p < kSelectionPaths; ++p) {
    if (by_path[p] > 0) series_.head_steps[p]->Increment(static_cast<double>(by_path[p]));
  }
  if (!heads.empty()) series_.candidates->ObserveMultiple(increments, sum);
  series_.layer_step_seconds->Observe(compute_seconds);
}

void PolicyMetrics::ObserveIndexBuild(double seconds) {
  series_.index_build_seconds->Observe(seconds);
}

void ServerMetrics::SetTlsFilesUsable(absl::string_view port, bool usable) {
  tls_files_usable_.Add({{"port", std::string(port)}}).Set(usable ? 1 : 0);
}

void ServerMetrics::SetTlsCertificateExpiry(absl::string_view port, int64_t not_after) {
  tls_certificate_expiry_.Add({{"port", std::string(port)}}).Set(static_cast<double>(not_after));
}

void PolicyMetrics::ObservePrefill(double seconds) { series_.prefill_seconds->Observe(seconds); }

ServerMetrics::ServerMetrics()
    : registry_(std::make_shared<prometheus::Registry>()),
      rpcs_(prometheus::BuildCounter()
                .Name("kvrecall_rpcs_total")
                .Help("gRPC calls that finished, by method and status code")
                .Register(*registry_)),
      rpc_seconds_(prometheus::BuildHistogram()
                       .Name("kvrecall_rpc_duration_seconds")
                       .Help("Duration of gRPC calls, from their start to their status (streams "
                             "last as long as the client keeps them open)")
                       .Register(*registry_)),
      layer_steps_(prometheus::BuildCounter()
                       .Name("kvrecall_layer_steps_total")
                       .Help("Decode layer-steps served: one per layer per token per sequence")
                       .Register(*registry_)),
      head_steps_(prometheus::BuildCounter()
                      .Name("kvrecall_head_steps_total")
                      .Help("Decode head-steps (one per query head per layer-step), by the "
                            "path that chose the head's support")
                      .Register(*registry_)),
      candidates_(prometheus::BuildHistogram()
                      .Name("kvrecall_head_step_candidates")
                      .Help("Tokens scored by a query head's selector in one decode step")
                      .Register(*registry_)),
      layer_step_seconds_(prometheus::BuildHistogram()
                              .Name("kvrecall_layer_step_seconds")
                              .Help("Server compute time of one sequence's decode layer-step")
                              .Register(*registry_)),
      index_build_seconds_(prometheus::BuildHistogram()
                               .Name("kvrecall_index_build_seconds")
                               .Help("Building one layer's selector state after a prefill "
                                     "(graph index, ReTopK seeding)")
                               .Register(*registry_)),
      prefill_seconds_(prometheus::BuildHistogram()
                           .Name("kvrecall_prefill_seconds")
                           .Help("Committed Prefill calls: from the stream's first chunk to the "
                                 "commit, selector builds included")
                           .Register(*registry_)),
      refusals_(prometheus::BuildCounter()
                    .Name("kvrecall_requests_refused_total")
                    .Help("Requests refused because they would exceed a server limit")
                    .Register(*registry_)),
      tls_files_usable_(prometheus::BuildGauge()
                            .Name("kvrecall_tls_files_usable")
                            .Help("Whether a port's TLS files, as last read (at start, "
                                  "--tls_refresh_seconds, SIGHUP), can be used (0: the port "
                                  "keeps serving the certificate in force)")
                            .Register(*registry_)),
      tls_certificate_expiry_(prometheus::BuildGauge()
                                  .Name("kvrecall_tls_certificate_expiration_timestamp_seconds")
                                  .Help("When the certificate a port serves now expires (its "
                                        "notAfter, seconds since 1970)")
                                  .Register(*registry_)),
      tenant_sessions_open_(prometheus::BuildGauge()
                                .Name("kvrecall_tenant_sessions_open")
                                .Help("Sessions of a tenant created and not closed")
                                .Register(*registry_)),
      tenant_host_bytes_held_(
          prometheus::BuildGauge()
              .Name("kvrecall_tenant_host_memory_bytes")
              .Help("Host memory held by a tenant (its sessions, their builds, its shared decode "
                    "regions); with --host_memory_budget_per_tenant_gb or "
                    "--gpu_memory_budget_per_tenant_gb only")
              .Register(*registry_)),
      tenant_host_bytes_budget_(
          prometheus::BuildGauge()
              .Name("kvrecall_tenant_host_memory_budget_bytes")
              .Help("A tenant's host memory budget (--host_memory_budget_per_tenant_gb); +Inf: "
                    "none of its own")
              .Register(*registry_)),
      tenant_gpu_bytes_held_(prometheus::BuildGauge()
                                 .Name("kvrecall_tenant_gpu_memory_bytes")
                                 .Help("GPU memory held by a tenant, summed over devices; with "
                                       "budgets per tenant only")
                                 .Register(*registry_)),
      tenant_gpu_bytes_budget_(
          prometheus::BuildGauge()
              .Name("kvrecall_tenant_gpu_memory_budget_bytes")
              .Help("A tenant's shares of the GPUs (--gpu_memory_budget_per_tenant_gb, each "
                    "at most its device's budget) summed over devices; +Inf: none of its own")
              .Register(*registry_)),
      tenant_gpu_device_bytes_held_(prometheus::BuildGauge()
                                        .Name("kvrecall_tenant_gpu_device_memory_bytes")
                                        .Help("GPU memory held by a tenant on one device; with "
                                              "budgets per tenant only")
                                        .Register(*registry_)),
      tenant_gpu_device_bytes_budget_(
          prometheus::BuildGauge()
              .Name("kvrecall_tenant_gpu_device_memory_budget_bytes")
              .Help("A tenant's share of one device (--gpu_memory_budget_per_tenant_gb), which "
                    "refuses it when full whatever it holds elsewhere; +Inf: none of its own")
              .Register(*registry_)) {
  decode_request_seconds_ =
      &prometheus::BuildHistogram()
           .Name("kvrecall_decode_request_seconds")
           .Help(
               "Server-side latency of one Decode request (one layer of one token for a "
               "batch of sequences): from its arrival to its reply being sent")
           .Register(*registry_)
           .Add({}, StepBuckets());
  unauthenticated_ = &prometheus::BuildCounter()
                          .Name("kvrecall_unauthenticated_requests_total")
                          .Help(
                              "Calls refused with UNAUTHENTICATED: no bearer token or an "
                              "unknown one")
                          .Register(*registry_)
                          .Add({});
  prometheus::Family<prometheus::Counter>& scrapes_refused =
      prometheus::BuildCounter()
          .Name("kvrecall_metrics_scrapes_refused_total")
          .Help("Requests and connections the metrics endpoint turned away, by reason: "
                "unauthorized (no valid bearer token: 401), tls_handshake (a TLS handshake "
                "that failed), plain_http (plain HTTP sent to the HTTPS endpoint: 400)")
          .Register(*registry_);
  scrapes_refused_ = {&scrapes_refused.Add({{"reason", "unauthorized"}}),
                      &scrapes_refused.Add({{"reason", "tls_handshake"}}),
                      &scrapes_refused.Add({{"reason", "plain_http"}})};
  auto gauge = [this](const char* name, const char* help) {
    return &prometheus::BuildGauge().Name(name).Help(help).Register(*registry_).Add({});
  };
  sessions_open_ = gauge("kvrecall_sessions_open", "Sessions created and not closed");
  tokens_held_ = gauge("kvrecall_tokens_held",
                       "Tokens in the KV caches of open sessions "
                       "(each session's sequence length, summed)");
  host_bytes_held_ = gauge("kvrecall_host_memory_bytes",
                           "Host memory held by sessions: KV, staged prompts, selector state");
  host_bytes_budget_ = gauge("kvrecall_host_memory_budget_bytes",
                             "The host memory budget (--host_memory_budget_gb); +Inf: unlimited");
  gpu_bytes_held_ =
      gauge("kvrecall_gpu_memory_bytes", "GPU memory held by sessions, summed over devices");
  host_address_space_held_ =
      gauge("kvrecall_host_address_space_reserved_bytes",
            "Address space (not memory) that sessions' host KV mappings hold, with what each "
            "reserves to grow into without moving");
  host_address_space_bound_ =
      gauge("kvrecall_host_address_space_bound_bytes",
            "The bound on that: 32 TiB, or half the process's RLIMIT_AS. Near it, arrays reserve "
            "less and move in the step as they grow");
  gpu_bytes_budget_ = gauge("kvrecall_gpu_memory_budget_bytes",
                            "GPU memory budgets summed over devices; +Inf: unlimited");
  device_bytes_held_ = &prometheus::BuildGauge()
                            .Name("kvrecall_gpu_device_memory_bytes")
                            .Help("GPU memory held by sessions on one device")
                            .Register(*registry_);
  device_bytes_budget_ = &prometheus::BuildGauge()
                              .Name("kvrecall_gpu_device_memory_budget_bytes")
                              .Help("One device's GPU memory budget (--gpu_memory_budget_gb, "
                                    "or its memory); +Inf: unlimited")
                              .Register(*registry_);
  prometheus::Family<Counter>& learnings =
      prometheus::BuildCounter()
          .Name("kvrecall_codes_learnings_total")
          .Help("Tiered layers' shortlist codes learned again as their bulk grew, by outcome: "
                "taken_over; refused (no memory, a budget's or the device's: the layer keeps its "
                "codes, its exact steps scoring more keys); failed (another error); abandoned "
                "(the session closed first)")
          .Register(*registry_);
  for (int i = 0; i < kLearningOutcomes; ++i) {
    codes_learnings_[i] =
        &learnings.Add({{"outcome", LearningOutcomeLabel(static_cast<LearningOutcome>(i))}});
  }
  prometheus::Family<Counter>& growths =
      prometheus::BuildCounter()
          .Name("kvrecall_host_kv_growths_total")
          .Help("Sessions' host KV arrays grown as they filled, in this process (a layer's keys "
                "and values count one each), by how: ahead (of need, off the requests' path); "
                "waited (ahead, but a request needed its rows before it was done, and waited); "
                "in_place (in the Prefill or Decode that needed the rows, where the array is: "
                "its added pages populated, and pinned where a GPU reads them, then); moved (in "
                "that request, to a new address: moved or copied, and pinned again whole). A "
                "Decode that grows or waits stalls, every layer of a model at the same token")
          .Register(*registry_);
  int how = 0;
  for (const char* label : {"ahead", "waited", "in_place", "moved"}) {
    host_kv_growths_[how++] = &growths.Add({{"how", label}});
  }
  prometheus::BuildGauge()
      .Name("kvrecall_build_info")
      .Help("Always 1; the labels describe the build")
      .Register(*registry_)
      .Add({{"cuda",
#ifdef KVRECALL_WITH_CUDA
             "true"
#else
             "false"
#endif
      }})
      .Set(1);

  // Every method of the served services, from the compiled-in descriptors.
  const google::protobuf::DescriptorPool* pool = google::protobuf::DescriptorPool::generated_pool();
  for (const char* service_name : kServedServices) {
    const google::protobuf::ServiceDescriptor* service = pool->FindServiceByName(service_name);
    if (service == nullptr) continue;  // reflection's descriptor is linked in by grpc++_reflection
    for (int i = 0; i < service->method_count(); ++i) {
      const std::string path = absl::StrCat("/", service_name, "/", service->method(i)->name());
      const std::string label = absl::StrCat(service_name, "/", service->method(i)->name());
      methods_.emplace(path,
                       std::make_unique<MethodMetrics>(
                           label, &rpcs_, &rpc_seconds_.Add({{"method", label}}, CallBuckets())));
    }
  }
  auto unknown = std::make_unique<MethodMetrics>(
      "unknown", &rpcs_, &rpc_seconds_.Add({{"method", "unknown"}}, CallBuckets()));
  unknown_method_ = unknown.get();
  methods_.emplace("", std::move(unknown));

  absl::MutexLock lock(&mu_);
  policies_.resize(kPlacements * kSelectorKinds);
}

MethodMetrics* ServerMetrics::ForMethod(absl::string_view path) {
  auto it = methods_.find(path);
  return it == methods_.end() ? unknown_method_ : it->second.get();
}

PolicyMetrics* ServerMetrics::ForPolicy(v1::Placement placement, SelectorKind selector) {
  int p = static_cast<int>(placement);
  if (p < 0 || p >= kPlacements) p = 0;
  int s = static_cast<int>(selector);
  if (s < 0 || s >= kSelectorKinds) s = 0;
  absl::MutexLock lock(&mu_);
  std::unique_ptr<PolicyMetrics>& slot = policies_[p * kSelectorKinds + s];
  if (slot == nullptr) {
    const prometheus::Labels labels = {
        {"placement", PlacementLabel(static_cast<v1::Placement>(p))},
        {"selector", SelectorKindName(static_cast<SelectorKind>(s))}};
    PolicyMetrics::Series series;
    series.layer_steps = &layer_steps_.Add(labels);
    for (int path = 0; path < kSelectionPaths; ++path) {
      prometheus::Labels with_path = labels;
      with_path["path"] = PathLabel(static_cast<SelectionPath>(path));
      series.head_steps[path] = &head_steps_.Add(with_path);
    }
    series.candidates = &candidates_.Add(labels, CandidateBuckets());
    series.layer_step_seconds = &layer_step_seconds_.Add(labels, StepBuckets());
    series.index_build_seconds = &index_build_seconds_.Add(labels, BuildBuckets());
    series.prefill_seconds = &prefill_seconds_.Add(labels, BuildBuckets());
    slot = std::make_unique<PolicyMetrics>(series);
  }
  return slot.get();
}

void ServerMetrics::CountRefusal(absl::string_view limit) {
  Counter* counter;
  {
    absl::MutexLock lock(&mu_);
    auto [it, inserted] = refusals_by_limit_.try_emplace(limit, nullptr);
    if (inserted) it->second = &refusals_.Add({{"limit", std::string(limit)}});
    counter = it->second;
  }
  counter->Increment();
}

void ServerMetrics::SetGaugeSource(std::function<ServerGauges()> source) {
  absl::MutexLock lock(&mu_);
  gauge_source_ = std::move(source);
}

std::vector<prometheus::MetricFamily> ServerMetrics::Collect() const {
  ServerGauges gauges;
  {
    absl::MutexLock lock(&mu_);
    if (gauge_source_) gauges = gauge_source_();
    for (int i = 0; i < kLearningOutcomes; ++i) {
      CountUpTo(gauges.codes_learnings[i], codes_learnings_[i], &codes_learnings_counted_[i]);
    }
    const HostKvGrowths& grown = gauges.host_kv_growths;
    int how = 0;
    for (const int64_t total : {grown.ahead, grown.waited, grown.in_place, grown.moved}) {
      CountUpTo(total, host_kv_growths_[how], &host_kv_growths_counted_[how]);
      ++how;
    }
    SetTenantGauges(gauges.tenants);
    for (const DeviceGauges& device : gauges.devices) {
      auto& [held, budget] = device_series_[device.device];
      if (held == nullptr) {
        held = &device_bytes_held_->Add({{"device", device.device}});
        budget = &device_bytes_budget_->Add({{"device", device.device}});
      }
      held->Set(static_cast<double>(device.bytes_held));
      budget->Set(device.bytes_budget);
    }
  }
  sessions_open_->Set(static_cast<double>(gauges.sessions_open));
  tokens_held_->Set(static_cast<double>(gauges.tokens_held));
  host_bytes_held_->Set(static_cast<double>(gauges.host_bytes_held));
  host_bytes_budget_->Set(gauges.host_bytes_budget);
  gpu_bytes_held_->Set(static_cast<double>(gauges.gpu_bytes_held));
  gpu_bytes_budget_->Set(gauges.gpu_bytes_budget);
  host_address_space_held_->Set(static_cast<double>(gauges.host_address_space_held));
  host_address_space_bound_->Set(static_cast<double>(gauges.host_address_space_bound));
  return registry_->Collect();
}

void ServerMetrics::SetTenantGauges(const std::vector<TenantGauges>& tenants) const {
  absl::flat_hash_set<std::string> holding;
  for (const TenantGauges& tenant : tenants) {
    holding.insert(tenant.tenant);
    const prometheus::Labels labels = {{"tenant", tenant.tenant}};
    TenantSeries& series = tenant_series_[tenant.tenant];
    if (series.sessions_open == nullptr) series.sessions_open = &tenant_sessions_open_.Add(labels);
    series.sessions_open->Set(static_cast<double>(tenant.sessions_open));
    if (!tenant.has_budgets) continue;
    if (series.host_bytes_held == nullptr) {
      series.host_bytes_held = &tenant_host_bytes_held_.Add(labels);
      series.host_bytes_budget = &tenant_host_bytes_budget_.Add(labels);
      series.gpu_bytes_held = &tenant_gpu_bytes_held_.Add(labels);
      series.gpu_bytes_budget = &tenant_gpu_bytes_budget_.Add(labels);
    }
    series.host_bytes_held->Set(static_cast<double>(tenant.host_bytes_held));
    series.host_bytes_budget->Set(tenant.host_bytes_budget);
    series.gpu_bytes_held->Set(static_cast<double>(tenant.gpu_bytes_held));
    series.gpu_bytes_budget->Set(tenant.gpu_bytes_budget);
    for (const DeviceGauges& device : tenant.devices) {
      auto& [held, budget] = series.devices[device.device];
      if (held == nullptr) {
        const prometheus::Labels device_labels = {{"tenant", tenant.tenant},
                                                  {"device", device.device}};
        held = &tenant_gpu_device_bytes_held_.Add(device_labels);
        budget = &tenant_gpu_device_bytes_budget_.Add(device_labels);
      }
      held->Set(static_cast<double>(device.bytes_held));
      budget->Set(device.bytes_budget);
    }
  }
  // A tenant that holds nothing any more has no series (a revoked one included), so that the
  // labels are bounded by the tenants holding something, not by every token file since start.
  absl::erase_if(tenant_series_, [&](auto& entry) {
    if (holding.contains(entry.first)) return false;
    TenantSeries& series = entry.second;
    tenant_sessions_open_.Remove(series.sessions_open);
    if (series.host_bytes_held != nullptr) {
      tenant_host_bytes_held_.Remove(series.host_bytes_held);
      tenant_host_bytes_budget_.Remove(series.host_bytes_budget);
      tenant_gpu_bytes_held_.Remove(series.gpu_bytes_held);
      tenant_gpu_bytes_budget_.Remove(series.gpu_bytes_budget);
    }
    for (const auto& [device, gauges] : series.devices) {
      tenant_gpu_device_bytes_held_.Remove(gauges.first);
      tenant_gpu_device_bytes_budget_.Remove(gauges.second);
    }
    return true;
  });
}

std::string ServerMetrics::TextFormat() const {
  return prometheus::TextSerializer().Serialize(Collect());
}

}  // namespace kvrecall
