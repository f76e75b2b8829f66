#include "server/rpc_metrics_interceptor.h"

#include <cstring>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/support/interceptor.h"

namespace kvrecall {
namespace {

using grpc::experimental::InterceptionHookPoints;

constexpr const char kDecodeMethod[] = "/kvrecall.v1.KvRecall/Decode";

// One per call; gRPC deletes it when the call ends.
class RpcMetricsInterceptor final : public grpc::experimental::Interceptor {
 public:
  RpcMetricsInterceptor(ServerMetrics* metrics, MethodMetrics* method, bool is_decode)
      : metrics_(metrics), method_(method), is_decode_(is_decode), start_(absl::Now()) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (is_decode_) {
      // Decode replies to each request before it reads the next one, so a request's reply is
      // the first message sent after it arrived.
      if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_MESSAGE) &&
          methods->GetRecvMessage() != nullptr) {
        request_arrived_ = absl::Now();
      }
      if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_MESSAGE) &&
          request_arrived_ != absl::InfinitePast()) {
        metrics_->ObserveDecodeRequest(absl::ToDoubleSeconds(absl::Now() - request_arrived_));
        request_arrived_ = absl::InfinitePast();
      }
    }
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS)) {
      method_->CountCall(methods->GetSendStatus().error_code(),
                         absl::ToDoubleSeconds(absl::Now() - start_));
    }
    methods->Proceed();
  }

 private:
  ServerMetrics* const metrics_;
  MethodMetrics* const method_;
  const bool is_decode_;
  const absl::Time start_;
  absl::Time request_arrived_ = absl::InfinitePast();
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
