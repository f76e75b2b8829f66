// A gRPC server interceptor that records every call into ServerMetrics: calls by method and
// status code, their duration, and each Decode request's latency from arrival to reply.
// Works with the synchronous and the callback API alike.
#ifndef KVRECALL_SERVER_RPC_METRICS_INTERCEPTOR_H_
#define KVRECALL_SERVER_RPC_METRICS_INTERCEPTOR_H_

#include <memory>
#include <vector>

#include "grpcpp/support/server_interceptor.h"
#include "server/metrics.h"

namespace kvrecall {

// For ServerBuilder::experimental().SetInterceptorCreators(). `metrics` must outlive the server.
std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>
MakeRpcMetricsInterceptors(ServerMetrics* metrics);

}  // namespace kvrecall

#endif  // KVRECALL_SERVER_RPC_METRICS_INTERCEPTOR_H_
