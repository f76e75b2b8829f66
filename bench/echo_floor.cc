// echo_floor: the transport's floor for kvrecall's Decode stream. A bidirectional-streaming
// service that answers each request with a reply of the size it asks for and does nothing else,
// built against the same gRPC as kvrecalld, in the synchronous API (a thread per stream,
// blocking reads, as kvrecalld serves today) or the callback API (reactors on gRPC's threads).
// bench/rpc_overhead --protocol=echo measures it beside kvrecalld (bench/results/rpc_floor.md).
//
//   echo_floor --api=sync --address=127.0.0.1:0       # prints "echo_floor listening on ADDR"
//   echo_floor --api=callback --address=unix:/tmp/echo.sock
#include <pthread.h>
#include <signal.h>

#include <chrono>
#include <climits>
#include <cstdio>
#include <memory>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "bench/echo_floor.grpc.pb.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "grpcpp/support/server_callback.h"

ABSL_FLAG(std::string, address, "127.0.0.1:0",
          "HOST:PORT (port 0 picks one) or unix:PATH to listen on");
ABSL_FLAG(std::string, api, "sync", "sync (a thread per stream) or callback (reactors)");

namespace kvrecall::bench {
namespace {

// A reply of the size `request` asks for (the string grown only when a request asks for more
// than any before it), after busy-waiting its work_micros.
void Answer(const EchoRequest& request, EchoReply* reply) {
  if (request.work_micros() > 0) {
    const auto until = std::chrono::steady_clock::now() +
                       std::chrono::microseconds(request.work_micros());
    while (std::chrono::steady_clock::now() < until) {
    }
  }
  std::string* payload = reply->mutable_payload();
  if (payload->size() != request.reply_bytes()) payload->assign(request.reply_bytes(), '\x5a');
}

class SyncEcho final : public EchoFloor::Service {
 public:
  grpc::Status Echo(grpc::ServerContext*,
                    grpc::ServerReaderWriter<EchoReply, EchoRequest>* stream) override {
    EchoRequest request;
    EchoReply reply;
    while (stream->Read(&request)) {
      Answer(request, &reply);
      if (!stream->Write(reply)) break;
    }
    return grpc::Status::OK;
  }
  grpc::Status EchoOnce(grpc::ServerContext*, const EchoRequest* request,
                        EchoReply* reply) override {
    Answer(*request, reply);
    return grpc::Status::OK;
  }
};

// One stream: read, write the reply, read again; gRPC runs each reaction on its own threads.
class EchoReactor final : public grpc::ServerBidiReactor<EchoRequest, EchoReply> {
 public:
  EchoReactor() { StartRead(&request_); }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the client half-closed (or the call ended)
      Finish(grpc::Status::OK);
      return;
    }
    Answer(request_, &reply_);
    StartWrite(&reply_);
  }
  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "the reply could not be written"));
      return;
    }
    StartRead(&request_);
  }
  void OnDone() override { delete this; }

 private:
  EchoRequest request_;
  EchoReply reply_;
};

class CallbackEcho final : public EchoFloor::CallbackService {
 public:
  grpc::ServerBidiReactor<EchoRequest, EchoReply>* Echo(grpc::CallbackServerContext*) override {
    return new EchoReactor();
  }
  grpc::ServerUnaryReactor* EchoOnce(grpc::CallbackServerContext* context,
                                     const EchoRequest* request, EchoReply* reply) override {
    Answer(*request, reply);
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }
};

int Main() {
  const std::string api = absl::GetFlag(FLAGS_api);
  const std::string address = absl::GetFlag(FLAGS_address);
  std::unique_ptr<grpc::Service> service;
  if (api == "sync") {
    service = std::make_unique<SyncEcho>();
  } else if (api == "callback") {
    service = std::make_unique<CallbackEcho>();
  } else {
    std::fprintf(stderr, "echo_floor: --api must be sync or callback, got '%s'\n", api.c_str());
    return 2;
  }
  // As kvrecalld (server/main.cc): no lock-order check on every absl::Mutex acquisition.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  // Block the shutdown signals in every thread (gRPC's inherit the mask): sigwait takes them.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  // The builder settings kvrecalld uses (server/server.cc), so that the two differ only in
  // what the service does.
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(address, grpc::InsecureServerCredentials(), &port);
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.SetMaxReceiveMessageSize(64 << 20);
  builder.SetMaxSendMessageSize(64 << 20);
  builder.RegisterService(service.get());
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    std::fprintf(stderr, "echo_floor: could not listen on %s\n", address.c_str());
    return 1;
  }
  std::string listening = address;
  if (!absl::StartsWith(address, "unix:")) {
    listening = absl::StrCat(address.substr(0, address.rfind(':')), ":", port);
  }
  std::printf("echo_floor listening on %s (%s API)\n", listening.c_str(), api.c_str());
  std::fflush(stdout);
  int signal_number = 0;
  sigwait(&signals, &signal_number);
  server->Shutdown();
  server->Wait();
  return 0;
}

}  // namespace
}  // namespace kvrecall::bench

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "echo_floor --api=sync|callback --address=HOST:PORT|unix:PATH: gRPC's floor for a "
      "Decode-sized bidirectional stream");
  absl::ParseCommandLine(argc, argv);
  return kvrecall::bench::Main();
}
