#include "client/kvrecall_client.h"

#include <algorithm>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "google/protobuf/descriptor.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"
#include "proto/tensor_codec.h"

namespace kvrecall::client {
namespace {

using ::google::protobuf::EnumDescriptor;

// "SELECTOR_EXACT_TOPK" -> "exact_topk" for prefix "SELECTOR_".
std::string LowerEnumName(const EnumDescriptor* descriptor, int value, absl::string_view prefix) {
  const auto* v = descriptor->FindValueByNumber(value);
  if (v == nullptr) return absl::StrCat(value);
  std::string name = v->name();
  if (absl::StartsWith(name, prefix)) name.erase(0, prefix.size());
  return absl::AsciiStrToLower(name);
}

// The value named `name` (either case, '-' for '_', without the prefix); UNSPECIFIED is not
// a name.
absl::StatusOr<int> ParseLowerEnumName(const EnumDescriptor* descriptor, absl::string_view prefix,
                                       absl::string_view name, absl::string_view what) {
  std::string full = absl::AsciiStrToUpper(absl::StrCat(prefix, name));
  std::replace(full.begin(), full.end(), '-', '_');
  const auto* v = descriptor->FindValueByName(full);
  if (v != nullptr && v->number() != 0) return v->number();
  std::vector<std::string> names;
  for (int i = 0; i < descriptor->value_count(); ++i) {
    if (descriptor->value(i)->number() == 0) continue;
    names.push_back(LowerEnumName(descriptor, descriptor->value(i)->number(), prefix));
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown ", what, " '", name, "'; want one of ", absl::StrJoin(names, ", ")));
}

// An ended stream that reported OK still failed the call that noticed it.
absl::Status EndedStatus(const grpc::Status& status, absl::string_view what) {
  if (!status.ok()) return FromGrpcStatus(status);
  return absl::UnavailableError(
      absl::StrCat("the server ended the ", what, " stream without an error or a reply"));
}

}  // namespace

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

std::string SelectorName(v1::Selector selector) {
  return LowerEnumName(v1::Selector_descriptor(), selector, "SELECTOR_");
}
std::string PlacementName(v1::Placement placement) {
  return LowerEnumName(v1::Placement_descriptor(), placement, "PLACEMENT_");
}
std::string DTypeLowerName(v1::DType dtype) {
  return LowerEnumName(v1::DType_descriptor(), dtype, "DTYPE_");
}

absl::StatusOr<v1::Selector> ParseSelector(absl::string_view name) {
  absl::StatusOr<int> v =
      ParseLowerEnumName(v1::Selector_descriptor(), "SELECTOR_", name, "selector");
  if (!v.ok()) return v.status();
  return static_cast<v1::Selector>(*v);
}
absl::StatusOr<v1::Placement> ParsePlacement(absl::string_view name) {
  absl::StatusOr<int> v =
      ParseLowerEnumName(v1::Placement_descriptor(), "PLACEMENT_", name, "placement");
  if (!v.ok()) return v.status();
  return static_cast<v1::Placement>(*v);
}
absl::StatusOr<v1::DType> ParseDType(absl::string_view name) {
  absl::StatusOr<int> v = ParseLowerEnumName(v1::DType_descriptor(), "DTYPE_", name, "dtype");
  if (!v.ok()) return v.status();
  return static_cast<v1::DType>(*v);
}
absl::StatusOr<v1::GraphScope> ParseGraphScope(absl::string_view name) {
  absl::StatusOr<int> v =
      ParseLowerEnumName(v1::GraphScope_descriptor(), "GRAPH_SCOPE_", name, "graph_scope");
  if (!v.ok()) return v.status();
  return static_cast<v1::GraphScope>(*v);
}

v1::Policy CpuPolicy(v1::Selector selector, int top_k, int sinks, int recent) {
  v1::Policy policy;
  policy.set_placement(v1::PLACEMENT_CPU);
  policy.set_selector(selector);
  policy.set_top_k(top_k);
  policy.set_sinks(sinks);
  policy.set_recent(recent);
  return policy;
}

// ---------------------------------------------------------------------------------------------

PrefillStream::PrefillStream(v1::KvRecall::Stub& stub, SessionHandle session,
                             PrefillOptions options)
    : session_(std::move(session)),
      options_(std::move(options)),
      writer_(stub.Prefill(&context_, &response_)) {}

PrefillStream::~PrefillStream() {
  if (finished_) return;
  // Abandoned: cancel so that the server commits nothing.
  context_.TryCancel();
  writer_->Finish();
}

absl::Status PrefillStream::Fail() {
  if (!finished_) {
    status_ = EndedStatus(writer_->Finish(), "Prefill");
    finished_ = true;
  }
  return status_;
}

absl::Status PrefillStream::SendLayer(int layer, std::span<const float> q, std::span<const float> k,
                                      std::span<const float> v) {
  if (finished_) {
    return status_.ok() ? absl::FailedPreconditionError("the Prefill stream is finished") : status_;
  }
  const v1::Geometry& g = session_.geometry;
  const int64_t q_row = int64_t{g.q_heads()} * g.head_dim();
  const int64_t kv_row = int64_t{g.kv_heads()} * g.head_dim();
  const int64_t tokens = kv_row > 0 ? static_cast<int64_t>(k.size()) / kv_row : 0;
  if (tokens < 1 || static_cast<int64_t>(k.size()) != tokens * kv_row || v.size() != k.size() ||
      static_cast<int64_t>(q.size()) != tokens * q_row) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prefill layer ", layer, ": q, k, v hold ", q.size(), ", ", k.size(), ", ", v.size(),
        " floats; want T * ", q_row, ", T * ", kv_row, ", T * ", kv_row, " for T >= 1 (q_heads=",
        g.q_heads(), ", kv_heads=", g.kv_heads(), ", head_dim=", g.head_dim(), ")"));
  }
  const int64_t token_bytes = (q_row + 2 * kv_row) * static_cast<int64_t>(DTypeSize(g.dtype()));
  const int64_t chunk_tokens = std::max<int64_t>(1, options_.max_chunk_bytes / token_bytes);
  chunk_.set_session_id(session_.id);
  chunk_.set_layer(layer);
  for (int64_t begin = 0; begin < tokens; begin += chunk_tokens) {
    const int64_t n = std::min(chunk_tokens, tokens - begin);
    const int64_t q_shape[] = {n, g.q_heads(), g.head_dim()};
    const int64_t kv_shape[] = {n, g.kv_heads(), g.head_dim()};
    chunk_.set_offset(begin);
    EncodeTensor(q.subspan(begin * q_row, n * q_row), q_shape, g.dtype(), false,
                 chunk_.mutable_q());
    EncodeTensor(k.subspan(begin * kv_row, n * kv_row), kv_shape, g.dtype(), false,
                 chunk_.mutable_k());
    EncodeTensor(v.subspan(begin * kv_row, n * kv_row), kv_shape, g.dtype(), false,
                 chunk_.mutable_v());
    if (!writer_->Write(chunk_)) return Fail();
    bytes_sent_ += n * token_bytes;
    if (options_.progress) options_.progress({layer, begin + n, tokens, bytes_sent_});
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::PrefillResponse> PrefillStream::Finish() {
  if (finished_) {
    return status_.ok() ? absl::FailedPreconditionError("the Prefill stream is finished") : status_;
  }
  writer_->WritesDone();
  finished_ = true;
  status_ = FromGrpcStatus(writer_->Finish());
  if (!status_.ok()) return status_;
  return response_;
}

// ---------------------------------------------------------------------------------------------

DecodeStream::DecodeStream(v1::KvRecall::Stub& stub, const v1::Geometry& geometry)
    : stub_(&stub), geometry_(geometry) {
  Open();
}

DecodeStream::~DecodeStream() { Close().IgnoreError(); }

void DecodeStream::Open() {
  stream_.reset();
  context_ = std::make_unique<grpc::ClientContext>();
  stream_ = stub_->Decode(context_.get());
  ++streams_opened_;
  finished_ = false;
  status_ = absl::OkStatus();
}

absl::Status DecodeStream::Fail() {
  if (!finished_) {
    status_ = EndedStatus(stream_->Finish(), "Decode");
    finished_ = true;
  }
  return status_;
}

absl::Status DecodeStream::Close() {
  closed_ = true;
  if (!finished_) {
    stream_->WritesDone();
    status_ = FromGrpcStatus(stream_->Finish());
    finished_ = true;
  }
  return status_;
}

absl::Status DecodeStream::Step(int layer, std::span<const SequenceInput> batch,
                                const StepOptions& options, StepResult* result) {
  if (closed_) return absl::FailedPreconditionError("the Decode stream is closed");
  if (finished_) Open();  // the server ended the last one on a failed step: continue anew
  const v1::Geometry& g = geometry_;
  const int64_t q_row[] = {g.q_heads(), g.head_dim()};
  const int64_t kv_row[] = {g.kv_heads(), g.head_dim()};
  const size_t q_size = static_cast<size_t>(q_row[0] * q_row[1]);
  const size_t kv_size = static_cast<size_t>(kv_row[0] * kv_row[1]);

  const uint64_t request_id = next_request_id_++;
  request_.set_request_id(request_id);
  request_.set_layer(layer);
  request_.set_return_lse(options.return_lse);
  request_.set_diagnostics(options.diagnostics);
  request_.set_compare_exact(options.compare_exact);
  // RemoveLast/Add keep cleared messages for reuse, so a warm request allocates nothing here.
  auto* steps = request_.mutable_steps();
  while (steps->size() > static_cast<int>(batch.size())) steps->RemoveLast();
  while (steps->size() < static_cast<int>(batch.size())) steps->Add();
  for (size_t i = 0; i < batch.size(); ++i) {
    const SequenceInput& in = batch[i];
    if (in.q.size() != q_size || in.k_new.size() != kv_size || in.v_new.size() != kv_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "decode batch[", i, "]: q, k_new, v_new hold ", in.q.size(), ", ", in.k_new.size(), ", ",
          in.v_new.size(), " floats; want ", q_size, ", ", kv_size, ", ", kv_size));
    }
    v1::SequenceStep& step = (*steps)[static_cast<int>(i)];
    step.mutable_session_id()->assign(in.session_id.data(), in.session_id.size());
    EncodeTensor(in.q, q_row, g.dtype(), false, step.mutable_q());
    EncodeTensor(in.k_new, kv_row, g.dtype(), false, step.mutable_k_new());
    EncodeTensor(in.v_new, kv_row, g.dtype(), false, step.mutable_v_new());
  }
  if (!stream_->Write(request_) || !stream_->Read(&response_)) return Fail();
  if (response_.request_id() != request_id ||
      response_.results_size() != static_cast<int>(batch.size())) {
    // Replies no longer pair with requests: this gRPC stream cannot be trusted any further.
    context_->TryCancel();
    Fail().IgnoreError();
    return absl::InternalError(absl::StrCat(
        "Decode reply mismatch: request_id ", response_.request_id(), " with ",
        response_.results_size(), " results for request ", request_id, " of ", batch.size()));
  }
  result->output.resize(batch.size() * q_size);
  result->lse.resize(options.return_lse ? batch.size() * q_row[0] : 0);
  const int64_t lse_row[] = {g.q_heads()};
  for (size_t i = 0; i < batch.size(); ++i) {
    const v1::SequenceResult& r = response_.results(static_cast<int>(i));
    if (absl::Status s =
            DecodeTensor(r.output(), {"DecodeResponse.results[].output", q_row, false, g.dtype()},
                         result->output.data() + i * q_size);
        !s.ok()) {
      return s;
    }
    if (options.return_lse) {
      if (absl::Status s =
              DecodeTensor(r.lse(), {"DecodeResponse.results[].lse", lse_row, false, v1::DTYPE_F32},
                           result->lse.data() + i * q_row[0]);
          !s.ok()) {
        return s;
      }
    }
  }
  result->response = &response_;
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------

Client::Client(std::shared_ptr<grpc::Channel> channel)
    : channel_(std::move(channel)), stub_(v1::KvRecall::NewStub(channel_)) {}

std::unique_ptr<Client> Client::Connect(const std::string& address, int max_message_bytes) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(max_message_bytes);
  return std::make_unique<Client>(
      grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
}

namespace {

// A PEM file's text; `what` names it in errors ("ca_file").
absl::StatusOr<std::string> ReadPemFile(const std::string& path, absl::string_view what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(what, ": cannot read ", path));
  std::ostringstream text;
  text << in.rdbuf();
  if (!absl::StrContains(text.str(), "-----BEGIN ")) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", path, " is not a PEM file"));
  }
  return text.str();
}

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const ChannelSecurity& security) {
  if (!security.secure()) return grpc::InsecureChannelCredentials();
  if (security.cert_file.empty() != security.key_file.empty()) {
    return absl::InvalidArgumentError(
        "cert_file and key_file go together (a client certificate for mutual TLS)");
  }
  grpc::SslCredentialsOptions ssl;
  if (!security.ca_file.empty()) {
    absl::StatusOr<std::string> ca = ReadPemFile(security.ca_file, "ca_file");
    if (!ca.ok()) return ca.status();
    ssl.pem_root_certs = *std::move(ca);
  }
  if (!security.cert_file.empty()) {
    absl::StatusOr<std::string> cert = ReadPemFile(security.cert_file, "cert_file");
    if (!cert.ok()) return cert.status();
    absl::StatusOr<std::string> key = ReadPemFile(security.key_file, "key_file");
    if (!key.ok()) return key.status();
    ssl.pem_cert_chain = *std::move(cert);
    ssl.pem_private_key = *std::move(key);
  }
  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::SslCredentials(ssl);
  if (!security.token.empty()) {
    credentials = grpc::CompositeChannelCredentials(
        credentials, grpc::AccessTokenCredentials(security.token));
  }
  return credentials;
}

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const std::string& address,
                                                        const ChannelSecurity& security,
                                                        int max_message_bytes) {
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials =
      MakeChannelCredentials(security);
  if (!credentials.ok()) return credentials.status();
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(max_message_bytes);
  if (!security.server_name.empty()) args.SetSslTargetNameOverride(security.server_name);
  return std::make_unique<Client>(grpc::CreateCustomChannel(address, *credentials, args));
}

absl::StatusOr<SessionHandle> Client::CreateSession(const v1::Geometry& geometry,
                                                    const v1::Policy& policy,
                                                    absl::string_view label) {
  v1::CreateSessionRequest request;
  *request.mutable_geometry() = geometry;
  *request.mutable_policy() = policy;
  request.set_label(std::string(label));
  v1::CreateSessionResponse response;
  grpc::ClientContext context;
  if (absl::Status s = FromGrpcStatus(stub_->CreateSession(&context, request, &response));
      !s.ok()) {
    return s;
  }
  return SessionHandle{response.session_id(), geometry, response.policy()};
}

absl::StatusOr<std::unique_ptr<PrefillStream>> Client::StartPrefill(const SessionHandle& session,
                                                                    PrefillOptions options) {
  if (options.max_chunk_bytes < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("PrefillOptions.max_chunk_bytes must be >= 1, got ", options.max_chunk_bytes));
  }
  return std::unique_ptr<PrefillStream>(new PrefillStream(*stub_, session, std::move(options)));
}

absl::StatusOr<std::unique_ptr<DecodeStream>> Client::OpenDecodeStream(
    const v1::Geometry& geometry) {
  if (geometry.q_heads() < 1 || geometry.kv_heads() < 1 || geometry.head_dim() < 1 ||
      DTypeSize(geometry.dtype()) == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("OpenDecodeStream needs a geometry with heads, head_dim and a dtype; got ",
                     geometry.ShortDebugString()));
  }
  return std::unique_ptr<DecodeStream>(new DecodeStream(*stub_, geometry));
}

absl::StatusOr<v1::SessionInfo> Client::GetSession(absl::string_view session_id) {
  v1::GetSessionRequest request;
  request.set_session_id(std::string(session_id));
  v1::SessionInfo info;
  grpc::ClientContext context;
  if (absl::Status s = FromGrpcStatus(stub_->GetSession(&context, request, &info)); !s.ok()) {
    return s;
  }
  return info;
}

absl::StatusOr<std::vector<v1::SessionInfo>> Client::ListSessions() {
  std::vector<v1::SessionInfo> sessions;
  v1::ListSessionsRequest request;
  do {
    v1::ListSessionsResponse response;
    grpc::ClientContext context;
    if (absl::Status s = FromGrpcStatus(stub_->ListSessions(&context, request, &response));
        !s.ok()) {
      return s;
    }
    for (v1::SessionInfo& info : *response.mutable_sessions()) sessions.push_back(std::move(info));
    request.set_page_token(response.next_page_token());
  } while (!request.page_token().empty());
  return sessions;
}

absl::Status Client::CloseSession(absl::string_view session_id) {
  v1::CloseSessionRequest request;
  request.set_session_id(std::string(session_id));
  v1::CloseSessionResponse response;
  grpc::ClientContext context;
  return FromGrpcStatus(stub_->CloseSession(&context, request, &response));
}

}  // namespace kvrecall::client
