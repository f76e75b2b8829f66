// kvrecalld's Prometheus metrics: every metric family the server exports, the calls that record
// into them, and the scrape-time gauges (prometheus-cpp; served by server/metrics_endpoint.h).
//
// Names follow Prometheus conventions: the `kvrecall_` prefix, base units (seconds, bytes),
// `_total` for counters. Label values are bounded: gRPC methods of the services kvrecalld serves
// (`unknown` for anything else), status code names, placement / selector / path names, the
// limits of server/ that refuse requests, and the tenants holding something (server/auth.h).
#ifndef KVRECALL_SERVER_METRICS_H_
#define KVRECALL_SERVER_METRICS_H_

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/support/status.h"
#include "index/selector_params.h"
#include "kernels/selection_path.h"
#include "kvrecall/v1/kvrecall.pb.h"
#include "prometheus/collectable.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "server/backends/attention_backend.h"
#include "server/backends/learning_outcomes.h"
#include "server/kv_store.h"

namespace kvrecall {

// One GPU's memory: what is held of its budget (by every session, or by one tenant's within its
// share), and the budget (+Inf: unlimited).
struct DeviceGauges {
  std::string device;  // "cuda:0"
  int64_t bytes_held = 0;
  double bytes_budget = 0;
};

// One tenant's scrape-time gauges (server/auth.h's tenants; "" for the one tenant of a server
// without tokens). Its memory is reported only with budgets per tenant, which are what count it.
struct TenantGauges {
  std::string tenant;
  int64_t sessions_open = 0;
  bool has_budgets = false;      // whether the limits give tenants memory budgets of their own
  int64_t host_bytes_held = 0;   // what the tenant's host budget has charged
  double host_bytes_budget = 0;  // +Inf: no host budget of its own (the server's bounds it)
  int64_t gpu_bytes_held = 0;    // summed over devices
  double gpu_bytes_budget = 0;   // summed over devices; 0 without any, +Inf: none of its own
  // And each device's share (with budgets per tenant, one per GPU): what the tenant holds of it
  // and its limit there. A device refuses the tenant when that share is full, whatever it holds
  // of the others, so a sum over devices can read half full where one refuses.
  std::vector<DeviceGauges> devices;
};

// What the scrape-time gauges report, and the running totals that counters count up to;
// filled by the callback given to SetGaugeSource.
struct ServerGauges {
  int64_t sessions_open = 0;
  int64_t tokens_held = 0;  // sequence length summed over open sessions
  int64_t host_bytes_held = 0;
  double host_bytes_budget = 0;  // +Inf: unlimited (see BudgetGaugeValue)
  int64_t gpu_bytes_held = 0;    // summed over devices
  double gpu_bytes_budget = 0;   // summed over devices; 0 without any, +Inf when one is unlimited
  // And each device's (a device refuses when it is full, however much room the others have).
  std::vector<DeviceGauges> devices;
  // Address space the host KV's mappings hold with their reservations, and its bound
  // (HostAddressSpaceHeld, HostAddressSpaceBound).
  int64_t host_address_space_held = 0;
  int64_t host_address_space_bound = 0;
  // Tiered layers' codes learnings by how they ended (LearningOutcome), since the start.
  std::array<int64_t, kLearningOutcomes> codes_learnings{};
  // Host KV arrays' growths by how they were made, since the start (HostKvGrowthCounts).
  HostKvGrowths host_kv_growths;
  // Each tenant that holds a session or memory now.
  std::vector<TenantGauges> tenants;
};

// A budget's limit as its gauge reads: limit_bytes <= 0 (unlimited) is +Inf, so that
// `held / budget` reads 0 rather than dividing by zero.
double BudgetGaugeValue(int64_t limit_bytes);

// The metrics of one gRPC method: calls by status code and their duration.
class MethodMetrics {
 public:
  MethodMetrics(std::string method, prometheus::Family<prometheus::Counter>* calls,
                prometheus::Histogram* duration);
  MethodMetrics(const MethodMetrics&) = delete;
  MethodMetrics& operator=(const MethodMetrics&) = delete;

  // One finished call: its status code and how long it lasted.
  void CountCall(grpc::StatusCode code, double seconds);
  const std::string& method() const { return method_; }

 private:
  const std::string method_;
  prometheus::Family<prometheus::Counter>* const calls_;
  prometheus::Histogram* const duration_;
  absl::Mutex mu_;
  // Indexed by status code (0..16); created on first use so that only codes seen are exported,
  // but for the server's faults' (INTERNAL, UNKNOWN, DATA_LOSS), exported from the start.
  std::array<prometheus::Counter*, 17> by_code_ ABSL_GUARDED_BY(mu_) = {};
};

// The decode metrics of one (placement, selector) pair, resolved once so that recording a
// layer-step touches no label map. Thread-safe.
class PolicyMetrics {
 public:
  struct Series {
    prometheus::Counter* layer_steps;
    std::array<prometheus::Counter*, kSelectionPaths> head_steps;  // by SelectionPath
    prometheus::Histogram* candidates;
    prometheus::Histogram* layer_step_seconds;
    prometheus::Histogram* index_build_seconds;
    prometheus::Histogram* prefill_seconds;
  };
  explicit PolicyMetrics(const Series& series) : series_(series) {}

  // One layer-step of one sequence: each query head's report (path, tokens its selector
  // scored), and the server's compute time for the step (the backend's step of the request's
  // batch, which this sequence's result waited for).
  void CountLayerStep(std::span<const HeadReport> heads, double compute_seconds);
  // Building one layer's selector state (graph index, ReTopK seeding) after a prefill.
  void ObserveIndexBuild(double seconds);
  // A committed Prefill: its wall time, first chunk to commit (builds included).
  void ObservePrefill(double seconds);

 private:
  const Series series_;
};

class ServerMetrics final : public prometheus::Collectable {
 public:
  ServerMetrics();
  ServerMetrics(const ServerMetrics&) = delete;
  ServerMetrics& operator=(const ServerMetrics&) = delete;

  // The metrics of a gRPC method by its full path ("/kvrecall.v1.KvRecall/Decode"); methods of
  // services kvrecalld does not serve share the `unknown` series. Never null.
  MethodMetrics* ForMethod(absl::string_view path);
  // Server-side latency of one Decode request: from its arrival to its reply being sent.
  void ObserveDecodeRequest(double seconds) { decode_request_seconds_->Observe(seconds); }
  // A call turned away by the token check before it reached a service (server/auth.h).
  void CountUnauthenticated() { unauthenticated_->Increment(); }
  // Why the metrics endpoint turned a peer away (MetricsEndpoint): no valid bearer token
  // (401), a TLS handshake that failed (a client certificate refused, an untrusted server
  // certificate, another protocol), plain HTTP sent to the HTTPS endpoint (400).
  enum class ScrapeRefusal { kUnauthorized, kTlsHandshake, kPlainHttp };
  void CountScrapeRefused(ScrapeRefusal why) {
    scrapes_refused_[static_cast<int>(why)]->Increment();
  }
  // Whether a port's TLS files, as last read (at start, every --tls_refresh_seconds, at SIGHUP),
  // can be used: 0 while a read finds them unusable (the port keeps serving the certificate in
  // force). `port`: "grpc" or "metrics"; the first call creates its series.
  void SetTlsFilesUsable(absl::string_view port, bool usable);
  // When the certificate `port` serves now expires (its notAfter, seconds since 1970).
  void SetTlsCertificateExpiry(absl::string_view port, int64_t not_after);

  // The series of a session's placement and selector kind, created on first use (so a scrape
  // shows the pairs that served sessions). Never null; stable for the metrics' lifetime. Call
  // once per session, not per step: it takes a lock.
  PolicyMetrics* ForPolicy(v1::Placement placement, SelectorKind selector);
  // A request refused because of `limit` (e.g. "host_memory_budget"): a short snake_case name
  // of a server knob. Thread-safe; the first call per limit creates its series. The service
  // calls it for every answer that carries a limit (server/status_util.h's RefusedBy).
  void CountRefusal(absl::string_view limit);

  // Called at every scrape to fill the gauges (sessions, tokens, bytes). Set it before the
  // endpoint serves; without one the gauges stay zero.
  void SetGaugeSource(std::function<ServerGauges()> source);

  // prometheus::Collectable: refreshes the gauges, then every family.
  std::vector<prometheus::MetricFamily> Collect() const override;

  // The families as the Prometheus text format (what /metrics serves).
  std::string TextFormat() const;

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Counter>& rpcs_;
  prometheus::Family<prometheus::Histogram>& rpc_seconds_;
  prometheus::Histogram* decode_request_seconds_;
  prometheus::Counter* unauthenticated_;
  std::array<prometheus::Counter*, 3> scrapes_refused_;  // by ScrapeRefusal
  prometheus::Family<prometheus::Counter>& layer_steps_;
  prometheus::Family<prometheus::Counter>& head_steps_;
  prometheus::Family<prometheus::Histogram>& candidates_;
  prometheus::Family<prometheus::Histogram>& layer_step_seconds_;
  prometheus::Family<prometheus::Histogram>& index_build_seconds_;
  prometheus::Family<prometheus::Histogram>& prefill_seconds_;
  prometheus::Family<prometheus::Counter>& refusals_;
  prometheus::Family<prometheus::Gauge>& tls_files_usable_;
  prometheus::Family<prometheus::Gauge>& tls_certificate_expiry_;
  prometheus::Gauge* sessions_open_;
  prometheus::Gauge* tokens_held_;
  prometheus::Gauge* host_bytes_held_;
  prometheus::Gauge* host_bytes_budget_;
  prometheus::Gauge* gpu_bytes_held_;
  prometheus::Gauge* gpu_bytes_budget_;
  // kvrecall_gpu_device_memory_bytes and _budget_bytes {device}: made at the first scrape (the
  // devices are the process's for its life).
  prometheus::Family<prometheus::Gauge>* device_bytes_held_ = nullptr;
  prometheus::Family<prometheus::Gauge>* device_bytes_budget_ = nullptr;
  mutable absl::flat_hash_map<std::string, std::pair<prometheus::Gauge*, prometheus::Gauge*>>
      device_series_ ABSL_GUARDED_BY(mu_);
  prometheus::Gauge* host_address_space_held_;
  prometheus::Gauge* host_address_space_bound_;
  // kvrecall_codes_learnings_total, by LearningOutcome: counted up to the source's totals.
  std::array<prometheus::Counter*, kLearningOutcomes> codes_learnings_{};
  // kvrecall_host_kv_growths_total: ahead, waited, in_place, moved (HostKvGrowths), the same
  // way.
  std::array<prometheus::Counter*, 4> host_kv_growths_{};

  // kvrecall_tenant_*: a tenant's series are made at the first scrape that sees it holding
  // anything, and removed at the first that sees it holding nothing.
  prometheus::Family<prometheus::Gauge>& tenant_sessions_open_;
  prometheus::Family<prometheus::Gauge>& tenant_host_bytes_held_;
  prometheus::Family<prometheus::Gauge>& tenant_host_bytes_budget_;
  prometheus::Family<prometheus::Gauge>& tenant_gpu_bytes_held_;
  prometheus::Family<prometheus::Gauge>& tenant_gpu_bytes_budget_;
  prometheus::Family<prometheus::Gauge>& tenant_gpu_device_bytes_held_;
  prometheus::Family<prometheus::Gauge>& tenant_gpu_device_bytes_budget_;
  struct TenantSeries {
    prometheus::Gauge* sessions_open = nullptr;
    // Null until a scrape sees the tenant with budgets of its own.
    prometheus::Gauge* host_bytes_held = nullptr;
    prometheus::Gauge* host_bytes_budget = nullptr;
    prometheus::Gauge* gpu_bytes_held = nullptr;
    prometheus::Gauge* gpu_bytes_budget = nullptr;
    // kvrecall_tenant_gpu_device_memory_bytes and _budget_bytes, by device.
    absl::flat_hash_map<std::string, std::pair<prometheus::Gauge*, prometheus::Gauge*>> devices;
  };
  // Sets the tenants' series from `tenants`; removes those of the tenants it leaves out.
  void SetTenantGauges(const std::vector<TenantGauges>& tenants) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Built in the constructor, read-only afterwards.
  absl::flat_hash_map<std::string, std::unique_ptr<MethodMetrics>> methods_;
  MethodMetrics* unknown_method_ = nullptr;

  mutable absl::Mutex mu_;
  std::function<ServerGauges()> gauge_source_ ABSL_GUARDED_BY(mu_);
  // The source's codes_learnings at the last scrape (its counters have counted them).
  mutable std::array<int64_t, kLearningOutcomes> codes_learnings_counted_ ABSL_GUARDED_BY(mu_) =
      {};
  // And its host_kv_growths, in host_kv_growths_'s order.
  mutable std::array<int64_t, 4> host_kv_growths_counted_ ABSL_GUARDED_BY(mu_) = {};
  absl::flat_hash_map<std::string, prometheus::Counter*> refusals_by_limit_ ABSL_GUARDED_BY(mu_);
  mutable absl::flat_hash_map<std::string, TenantSeries> tenant_series_ ABSL_GUARDED_BY(mu_);
  // [placement][selector], flattened; null until first used.
  std::vector<std::unique_ptr<PolicyMetrics>> policies_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvrecall

#endif  // KVRECALL_SERVER_METRICS_H_
