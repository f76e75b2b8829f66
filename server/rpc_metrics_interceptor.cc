#include "server/rpc_metrics_interceptor.h"

#include <cstring>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/support/interceptor.h"
#include "proto/tsan_handoff.h"

namespace kvrecall {
namespace {

using grpc::experimental::InterceptionHookPoints;

// One per call; gRPC deletes it when the call ends. gRPC creates it, runs its hook points and
// deletes it on whichever of its threads the call is on, in that order; each step takes the
// object from the one before (proto/tsan_handoff.h: what ThreadSanitizer cannot see in gRPC).
class RpcMetricsInterceptor final : public grpc::experimental::Interceptor {
 public:
  explicit RpcMetricsInterceptor(MethodMetrics* method) : method_(method), start_(absl::Now()) {
    HandoffToGrpc(this);
  }
  ~RpcMetricsInterceptor() override { ReactionFromGrpc(this); }

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    ReactionFromGrpc(this);
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS)) {
      method_->CountCall(methods->GetSendStatus().error_code(),
                         absl::ToDoubleSeconds(absl::Now() - start_));
    }
    HandoffToGrpc(this);  // gRPC may run the next hook point, or delete this, once it proceeds
    methods->Proceed();
  }

 private:
  MethodMetrics* const method_;
  const absl::Time start_;
};

class RpcMetricsInterceptorFactory final
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit RpcMetricsInterceptorFactory(ServerMetrics* metrics) : metrics_(metrics) {}

  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    const char* method = info->method() == nullptr ? "" : info->method();
    // No interceptor at all: gRPC then runs the call's messages without its hook machinery.
    if (std::strcmp(method, kDecodeMethod) == 0 || std::strcmp(method, kPrefillMethod) == 0) {
      return nullptr;
    }
    return new RpcMetricsInterceptor(metrics_->ForMethod(method));
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
