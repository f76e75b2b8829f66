#include "server/service.h"

#include <algorithm>
#include <string>

#include "server/decode.h"
#include "server/prefill.h"
#include "server/status_util.h"

namespace kvrecall {
grpc::Status KvRecallService::CreateSession(grpc::ServerContext*,
                                            const v1::CreateSessionRequest* request,
                                            v1::CreateSessionResponse* response) {
  absl::StatusOr<std::shared_ptr<Session>> session = registry_->Create(*request);
  if (!session.ok()) return ToGrpcStatus(session.status());
  response->set_session_id((*session)->id());
  *response->mutable_policy() = PolicyToProto((*session)->policy());
  return grpc::Status::OK;
}

grpc::Status KvRecallService::Prefill(grpc::ServerContext* context,
                                      grpc::ServerReader<v1::PrefillChunk>* reader,
                                      v1::PrefillResponse* response) {
  PrefillStream stream(registry_);
  v1::PrefillChunk chunk;
  for (int64_t index = 0; reader->Read(&chunk); ++index) {
    if (absl::Status s = stream.Add(chunk, index); !s.ok()) return ToGrpcStatus(s);
  }
  // Read() also returns false when the client cancelled: then nothing may be committed.
  if (context->IsCancelled()) {
    return grpc::Status(grpc::StatusCode::CANCELLED, "the Prefill stream was cancelled");
  }
  absl::StatusOr<v1::PrefillResponse> committed = stream.Commit();
  if (!committed.ok()) return ToGrpcStatus(committed.status());
  *response = *std::move(committed);
  return grpc::Status::OK;
}

grpc::Status KvRecallService::Decode(
    grpc::ServerContext*, grpc::ServerReaderWriter<v1::DecodeResponse, v1::DecodeRequest>* stream) {
  DecodeStream decoder(registry_);
  // One request and one reply object per stream: Clear() keeps their allocations.
  v1::DecodeRequest request;
  v1::DecodeResponse response;
  while (stream->Read(&request)) {
    response.Clear();
    if (absl::Status s = decoder.Serve(request, &response); !s.ok()) return ToGrpcStatus(s);
    if (!stream->Write(response)) break;
  }
  return grpc::Status::OK;
}

grpc::Status KvRecallService::GetSession(grpc::ServerContext*, const v1::GetSessionRequest* request,
                                         v1::SessionInfo* response) {
  absl::StatusOr<std::shared_ptr<Session>> session = registry_->Find(request->session_id());
  if (!session.ok()) return ToGrpcStatus(PrefixStatus(session.status(), "session_id: "));
  absl::ReaderMutexLock lock(&(*session)->mu());
  *response = (*session)->Info();
  return grpc::Status::OK;
}

grpc::Status KvRecallService::ListSessions(grpc::ServerContext*, const v1::ListSessionsRequest*,
                                           v1::ListSessionsResponse* response) {
  std::vector<std::shared_ptr<Session>> sessions = registry_->List();
  std::sort(sessions.begin(), sessions.end(),
            [](const auto& a, const auto& b) { return a->id() < b->id(); });
  for (const auto& session : sessions) {
    absl::ReaderMutexLock lock(&session->mu());
    if (!session->closed()) *response->add_sessions() = session->Info();
  }
  return grpc::Status::OK;
}

grpc::Status KvRecallService::CloseSession(grpc::ServerContext*,
                                           const v1::CloseSessionRequest* request,
                                           v1::CloseSessionResponse*) {
  return ToGrpcStatus(registry_->Close(request->session_id()));
}

}  // namespace kvrecall
