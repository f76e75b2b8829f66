#include "server/rpc_metrics_interceptor.h"

#include <cstring>
#include <deque>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/support/interceptor.h"
#include "server/tsan_handoff.h"

namespace kvrecall {
namespace {

using grpc::experimental::InterceptionHookPoints;

constexpr const char kDecodeMethod[] = "/kvrecall.v1.KvRecall/Decode";

// One per call; gRPC deletes it when the call ends. gRPC creates it, runs its hook points and
// deletes it on whichever of its threads the call is on, in that order; each step takes the
// object from the one before (server/tsan_handoff.h: what ThreadSanitizer cannot see in gRPC).
class RpcMetricsInterceptor final : public grpc::experimental::Interceptor {
 public:
  RpcMetricsInterceptor(ServerMetrics* metrics, MethodMetrics* method, bool is_decode)
      : metrics_(metrics), method_(method), is_decode_(is_decode), start_(absl::Now()) {
    HandoffToGrpc(this);
  }
  ~RpcMetricsInterceptor() override { ReactionFromGrpc(this); }

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    ReactionFromGrpc(this);
    if (is_decode_) {
      // Decode answers every request with one reply, in order (a rejected request ends the
      // stream), so the n-th reply sent answers the n-th request received, even when a client
      // sends ahead of the replies.
      if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_MESSAGE) &&
          methods->GetRecvMessage() != nullptr) {
        absl::MutexLock lock(&mu_);
        arrivals_.push_back(absl::Now());
      }
      if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_MESSAGE)) {
        absl::Time arrived = absl::InfinitePast();
        {
          absl::MutexLock lock(&mu_);
          if (!arrivals_.empty()) {
            arrived = arrivals_.front();
            arrivals_.pop_front();
          }
        }
        if (arrived != absl::InfinitePast()) {
          metrics_->ObserveDecodeRequest(absl::ToDoubleSeconds(absl::Now() - arrived));
        }
      }
    }
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS)) {
      method_->CountCall(methods->GetSendStatus().error_code(),
                         absl::ToDoubleSeconds(absl::Now() - start_));
    }
    HandoffToGrpc(this);  // gRPC may run the next hook point, or delete this, once it proceeds
    methods->Proceed();
  }

 private:
  ServerMetrics* const metrics_;
  MethodMetrics* const method_;
  const bool is_decode_;
  const absl::Time start_;
  // Reads and writes of a stream may run on different threads in the callback API.
  absl::Mutex mu_;
  std::deque<absl::Time> arrivals_ ABSL_GUARDED_BY(mu_);  // requests not answered yet
};

class RpcMetricsInterceptorFactory final
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit RpcMetricsInterceptorFactory(ServerMetrics* metrics) : metrics_(metrics) {}

  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    const char* method = info->method() == nullptr ? "" : info->method();
    return new RpcMetricsInterceptor(metrics_, metrics_->ForMethod(method),
                                     std::strcmp(method, kDecodeMethod) == 0);
  }

 private:
  ServerMetrics* const metrics_;
};

}  // namespace

std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>
MakeRpcMetricsInterceptors(ServerMetrics* metrics) {
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> out;
  out.push_back(std::make_unique<RpcMetricsInterceptorFactory>(metrics));
  return out;
}

}  // namespace kvrecall
