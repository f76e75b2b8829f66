// `kvrecall create`: creates a session from geometry and policy flags and prints its id.
#include <cstdio>

#include "absl/flags/flag.h"
#include "client/cli/common.h"
#include "client/cli/subcommands.h"

ABSL_FLAG(int32_t, layers, 1, "create, synth: model layers");
ABSL_FLAG(int32_t, q_heads, 8, "create, synth: query heads");
ABSL_FLAG(int32_t, kv_heads, 2, "create, synth: key/value heads (must divide q_heads)");
ABSL_FLAG(int32_t, head_dim, 64, "create, synth: head dimension");
ABSL_FLAG(std::string, dtype, "bf16", "create, synth: the model's dtype: bf16, f16 or f32");
ABSL_FLAG(std::string, label, "", "create: free text shown by get and list");
ABSL_FLAG(int64_t, max_tokens, 0,
          "create: the most tokens the session will hold (prompt + decoded), set aside now so "
          "that its KV never grows (0: not announced)");
ABSL_FLAG(std::string, request_id, "",
          "create: makes a retry safe: run again with the same id (and flags), it prints the "
          "session the first run made, if it made one (a UUID, say; empty: none)");

namespace kvrecall::cli {

using client::ParseDType;
using client::SessionHandle;

int RunCreate(const std::vector<char*>& args) {
  if (!args.empty()) return UsageError("create", "takes no arguments, only flags");
  absl::StatusOr<v1::Policy> policy = PolicyFromFlags();
  if (!policy.ok()) return UsageError("create", policy.status().message());
  absl::StatusOr<v1::DType> dtype = ParseDType(absl::GetFlag(FLAGS_dtype));
  if (!dtype.ok()) return UsageError("create", dtype.status().message());
  v1::Geometry geometry;
  geometry.set_layers(absl::GetFlag(FLAGS_layers));
  geometry.set_q_heads(absl::GetFlag(FLAGS_q_heads));
  geometry.set_kv_heads(absl::GetFlag(FLAGS_kv_heads));
  geometry.set_head_dim(absl::GetFlag(FLAGS_head_dim));
  geometry.set_dtype(*dtype);
  absl::StatusOr<std::unique_ptr<client::Client>> client = ConnectToServer();
  if (!client.ok()) return ReportError("create", client.status());
  absl::StatusOr<SessionHandle> session =
      (*client)->CreateSession(geometry, *policy, absl::GetFlag(FLAGS_label),
                               absl::GetFlag(FLAGS_max_tokens), absl::GetFlag(FLAGS_request_id));
  if (!session.ok()) return ReportError("create", session.status());
  if (absl::GetFlag(FLAGS_json)) {
    v1::CreateSessionResponse response;
    response.set_session_id(session->id);
    *response.mutable_policy() = session->policy;
    std::printf("%s\n", MessageJson(response, /*pretty=*/false).c_str());
  } else {
    std::printf("%s\n", session->id.c_str());
  }
  return 0;
}

}  // namespace kvrecall::cli
