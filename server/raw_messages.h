// Parsing requests from and serializing replies to the raw grpc::ByteBuffers of the service's
// callback methods. The service takes messages raw so that a message that does not parse gets
// INVALID_ARGUMENT with a message saying so (gRPC's generated handlers answer UNIMPLEMENTED or
// INTERNAL with no message, or, inside a stream, end the stream as if the client had finished).
#ifndef KVRECALL_SERVER_RAW_MESSAGES_H_
#define KVRECALL_SERVER_RAW_MESSAGES_H_

#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/message.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/proto_buffer_reader.h"
#include "grpcpp/support/proto_buffer_writer.h"
#include "grpcpp/support/status.h"

namespace kvrecall {

// Parses `buffer` into `message` (cleared first; its allocations are kept for reuse) and
// releases the buffer. False when the bytes are not such a message.
inline bool ParseRawMessage(grpc::ByteBuffer* buffer, google::protobuf::Message* message) {
  bool parsed;
  {
    grpc::ProtoBufferReader reader(buffer);
    parsed = reader.status().ok() && message->ParseFromZeroCopyStream(&reader);
  }
  buffer->Clear();
  return parsed;
}

// The INVALID_ARGUMENT answer to a message that did not parse; `what` names it ("the request",
// "Decode request 3").
inline grpc::Status UnparsableStatus(absl::string_view what,
                                     const google::protobuf::Message& message) {
  return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                      absl::StrCat(what, " is not a valid ", message.GetTypeName(),
                                   " (its bytes do not parse); nothing of it was applied"));
}

// Serializes `message` into `buffer`, the way gRPC's generated code does (one slice for small
// messages, a chain of slices written in place for large ones).
inline void SerializeRawMessage(const google::protobuf::Message& message,
                                grpc::ByteBuffer* buffer) {
  const size_t size = message.ByteSizeLong();
  if (size <= GRPC_SLICE_INLINED_SIZE) {
    grpc::Slice slice(size);
    message.SerializeWithCachedSizesToArray(const_cast<uint8_t*>(slice.begin()));
    grpc::ByteBuffer one(&slice, 1);
    buffer->Swap(&one);
    return;
  }
  buffer->Clear();
  grpc::ProtoBufferWriter writer(buffer, grpc::kProtoBufferWriterMaxBufferLength,
                                 static_cast<int>(size));
  message.SerializeToZeroCopyStream(&writer);
}

}  // namespace kvrecall

#endif  // KVRECALL_SERVER_RAW_MESSAGES_H_
