// `kvrecall health [SERVICE]`: asks grpc.health.v1.Health/Check of --server (the overall server,
// or SERVICE, e.g. kvrecall.v1.KvRecall) and prints its status. Exits 0 when SERVING, 1 when it
// is not or the call fails, so that it works as a probe in scripts and `kubectl exec`. The
// health-only port kvrecalld serves beside a TLS port (--health_address) has no reflection,
// so grpcurl-style clients need health.proto there; this needs nothing.
#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "client/cli/common.h"
#include "client/cli/subcommands.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/client_context.h"

ABSL_FLAG(absl::Duration, health_deadline, absl::Seconds(10),
          "health: how long to wait for the server's answer, connecting included");

namespace kvrecall::cli {

using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

int RunHealth(const std::vector<char*>& args) {
  if (args.size() > 1) return UsageError("health", "usage: kvrecall health [SERVICE]");
  const absl::Duration deadline = absl::GetFlag(FLAGS_health_deadline);
  if (deadline <= absl::ZeroDuration()) {
    return UsageError("health", "--health_deadline must be positive");
  }
  absl::StatusOr<std::unique_ptr<client::Client>> client = ConnectToServer();
  if (!client.ok()) return ReportError("health", client.status());
  HealthCheckRequest request;
  if (!args.empty()) request.set_service(args[0]);
  HealthCheckResponse response;
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
  context.set_wait_for_ready(true);  // a server still starting answers within the deadline
  const grpc::Status status =
      grpc::health::v1::Health::NewStub((*client)->channel())->Check(&context, request, &response);
  if (status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED &&
      (*client)->channel()->GetState(/*try_to_connect=*/false) ==
          GRPC_CHANNEL_TRANSIENT_FAILURE) {
    // Waiting for the server hides why it never came: say what failed (as the other
    // subcommands, which do not wait, do).
    return ReportError("health", absl::UnavailableError(absl::StrCat(
                                     "could not connect to ", absl::GetFlag(FLAGS_server),
                                     " within --health_deadline=", absl::FormatDuration(deadline),
                                     ": nobody listening there, or TLS asked of a plaintext port "
                                     "(or the reverse)")));
  }
  if (!status.ok()) return ReportError("health", client::FromGrpcStatus(status));
  const std::string name = HealthCheckResponse::ServingStatus_Name(response.status());
  if (absl::GetFlag(FLAGS_json)) {
    std::printf("%s\n", MessageJson(response, /*pretty=*/false).c_str());
  } else {
    std::printf("%s\n", name.c_str());
  }
  return response.status() == HealthCheckResponse::SERVING ? 0 : 1;
}

}  // namespace kvrecall::cli
