// The gRPC service kvrecall.v1.KvRecall: sessions, Prefill streams and Decode streams over a
// SessionRegistry (synchronous API: one server thread per open stream).
#ifndef KVRECALL_SERVER_SERVICE_H_
#define KVRECALL_SERVER_SERVICE_H_

#include "kvrecall/v1/kvrecall.grpc.pb.h"
#include "server/session.h"

namespace kvrecall {

class KvRecallService final : public v1::KvRecall::Service {
 public:
  explicit KvRecallService(SessionRegistry* registry) : registry_(registry) {}

  grpc::Status CreateSession(grpc::ServerContext* context, const v1::CreateSessionRequest* request,
                             v1::CreateSessionResponse* response) override;
  grpc::Status Prefill(grpc::ServerContext* context, grpc::ServerReader<v1::PrefillChunk>* reader,
                       v1::PrefillResponse* response) override;
  grpc::Status Decode(
      grpc::ServerContext* context,
      grpc::ServerReaderWriter<v1::DecodeResponse, v1::DecodeRequest>* stream) override;
  grpc::Status GetSession(grpc::ServerContext* context, const v1::GetSessionRequest* request,
                          v1::SessionInfo* response) override;
  grpc::Status ListSessions(grpc::ServerContext* context, const v1::ListSessionsRequest* request,
                            v1::ListSessionsResponse* response) override;
  grpc::Status CloseSession(grpc::ServerContext* context, const v1::CloseSessionRequest* request,
                            v1::CloseSessionResponse* response) override;

 private:
  SessionRegistry* registry_;
};

}  // namespace kvrecall

#endif  // KVRECALL_SERVER_SERVICE_H_
