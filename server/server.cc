#include "server/server.h"

#include <climits>

#include "absl/strings/str_cat.h"
#include "grpc/grpc.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/resource_quota.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"

namespace kvrecall {
namespace {

// "host:0" with the bound port in place of the requested one.
std::string WithPort(const std::string& address, int port) {
  const size_t colon = address.rfind(':');
  return absl::StrCat(address.substr(0, colon == std::string::npos ? address.size() : colon), ":",
                      port);
}

}  // namespace

RunningServer::RunningServer(const ServerOptions& options)
    : budget_(options.host_memory_budget_bytes),
      registry_(&budget_),
      service_(&registry_),
      health_({v1::KvRecall::service_full_name()}) {}

RunningServer::~RunningServer() {
  Shutdown(absl::ZeroDuration());
  Wait();
}

void RunningServer::Shutdown(absl::Duration grace) {
  {
    absl::MutexLock lock(&shutdown_mu_);
    if (shut_down_) return;
    shut_down_ = true;
  }
  health_.Shutdown();
  if (server_ == nullptr) return;  // never started
  server_->Shutdown(absl::ToChronoTime(absl::Now() + grace));
}

void RunningServer::Wait() {
  if (server_ != nullptr) server_->Wait();
}

absl::StatusOr<std::unique_ptr<RunningServer>> StartServer(const ServerOptions& options) {
  if (options.max_message_bytes < 1 || options.max_message_bytes > INT_MAX) {
    return absl::InvalidArgumentError(absl::StrCat("max_message_bytes must be in [1, ", INT_MAX,
                                                   "], got ", options.max_message_bytes));
  }
  if (options.worker_threads < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("worker_threads must be >= 0, got ", options.worker_threads));
  }
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  std::unique_ptr<RunningServer> running(new RunningServer(options));

  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.address, grpc::InsecureServerCredentials(), &running->port_);
  // gRPC sets SO_REUSEPORT by default: a second server on a busy port would then start and
  // silently take a share of the connections instead of failing.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(options.max_message_bytes));
  if (options.worker_threads > 0) {
    grpc::ResourceQuota quota("kvrecalld");
    quota.SetMaxThreads(options.worker_threads);
    builder.SetResourceQuota(quota);
  }
  builder.RegisterService(&running->service_);
  builder.RegisterService(&running->health_);
  running->server_ = builder.BuildAndStart();
  if (running->server_ == nullptr || running->port_ == 0) {
    return absl::UnavailableError(
        absl::StrCat("could not listen on ", options.address, " (address in use or invalid?)"));
  }
  running->address_ = WithPort(options.address, running->port_);
  return running;
}

}  // namespace kvrecall
