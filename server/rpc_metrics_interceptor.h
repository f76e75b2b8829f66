// A gRPC server interceptor that records every call into ServerMetrics, calls by method and
// status code and their duration, except the Decode and Prefill streams, which KvRecallService
// records itself (server/service.h): gRPC runs an intercepted call's every message through its
// interceptor machinery, about 13K instructions per Decode round trip (bench/results/
// rpc_floor.md, dev-machine figures), and a stream counts itself once gRPC says whether its
// status reached the client. Works with the synchronous and the callback API alike.
#ifndef KVRECALL_SERVER_RPC_METRICS_INTERCEPTOR_H_
#define KVRECALL_SERVER_RPC_METRICS_INTERCEPTOR_H_

#include <memory>
#include <vector>

#include "grpcpp/support/server_interceptor.h"
#include "server/metrics.h"

namespace kvrecall {

// The methods the interceptor leaves to the service: its streams count themselves once gRPC
// says whether their status reached the client (a stream that answered OK is CANCELLED where
// gRPC failed it meanwhile).
inline constexpr char kDecodeMethod[] = "/kvrecall.v1.KvRecall/Decode";
inline constexpr char kPrefillMethod[] = "/kvrecall.v1.KvRecall/Prefill";

// For ServerBuilder::experimental().SetInterceptorCreators(). `metrics` must outlive the server.
std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>
MakeRpcMetricsInterceptors(ServerMetrics* metrics);

}  // namespace kvrecall

#endif  // KVRECALL_SERVER_RPC_METRICS_INTERCEPTOR_H_
