#include "client/cli/common.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_format.h"
#include "google/protobuf/util/json_util.h"

ABSL_FLAG(std::string, server, "localhost:50051", "kvrecalld address, HOST:PORT or unix:PATH");
ABSL_FLAG(bool, json, false, "print machine-readable JSON (one object per line)");
ABSL_FLAG(absl::Duration, timeout, absl::InfiniteDuration(),
          "the longest a unary call or a decode step may take (e.g. 5s; inf: no limit); past it "
          "the command fails with DEADLINE_EXCEEDED (a Prefill has --prefill_timeout, health "
          "--health_deadline)");
ABSL_FLAG(absl::Duration, prefill_timeout, absl::InfiniteDuration(),
          "replay, demo and prefill: the longest a Prefill call may take as a whole, its builds "
          "included (inf: no limit); past it DEADLINE_EXCEEDED, and nothing of it is committed");

ABSL_FLAG(bool, tls, false,
          "connect with TLS (implied by the other --tls_* flags, and by --token_file to a "
          "HOST:PORT --server)");
ABSL_FLAG(std::string, tls_ca, "", "PEM roots that signed the server's certificate (default: system roots)");
ABSL_FLAG(std::string, tls_cert, "", "PEM client certificate chain, for servers that require mutual TLS");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_server_name, "",
          "the name to check the server's certificate against, when not --server's host");
namespace {
// --token_file's default: the Helm chart's co-located runner finds its token file there.
std::string TokenFileFromEnvironment() {
  const char* path = std::getenv("KVRECALL_TOKEN_FILE");
  return path == nullptr ? "" : path;
}
}  // namespace
ABSL_FLAG(std::string, token_file, TokenFileFromEnvironment(),
          "a file whose first line is the bearer token for servers started with "
          "--auth_token_file; default: $KVRECALL_TOKEN_FILE (the Helm chart's co-located runner "
          "gets it; --token_file= sends none). Without --tls* flags the token goes over TLS to a "
          "HOST:PORT --server, in plaintext to a unix:PATH one (gRPC's local credentials, for "
          "kvrecalld --plaintext_unix_sockets), and to a unix-abstract:NAME one not at all");

ABSL_FLAG(std::string, placement, "cpu", "where the KV lives: cpu, gpu or tiered");
ABSL_FLAG(std::string, policy, "full",
          "the selector: full, exact_topk, streaming, index or retopk");
ABSL_FLAG(int32_t, k, 0,
          "K for exact_topk, index and retopk (0: server default, 512; bench-index: 100)");
ABSL_FLAG(int32_t, sinks, -1,
          "attention-sink tokens kept by streaming and index, and on the GPU by tiered (-1: "
          "the server's default, 128; 0: none; bench-index: the first tokens left out of the "
          "index, -1 or 0: none)");
ABSL_FLAG(int32_t, recent, -1,
          "recent tokens kept by streaming and index, and on the GPU by tiered (-1: the "
          "server's default, 512; 0: none; bench-index: the last tokens left out of the index, "
          "-1 or 0: none)");
ABSL_FLAG(int32_t, C, 0, "retopk: cached (query, support) entries per head (0: default)");
ABSL_FLAG(int32_t, R, 0, "retopk: most similar cached supports unioned (0: default)");
ABSL_FLAG(int32_t, W, -1,
          "retopk: recent positions added to the candidates (-1: the server's default, 32; 0: "
          "none)");
ABSL_FLAG(float, tau, NAN, "retopk: reuse when the best cosine >= tau (unset: default 0.85)");
ABSL_FLAG(int32_t, refresh, -1,
          "retopk: every N-th decode step runs the exact path; 0 disables (-1: default)");
ABSL_FLAG(bool, auto_tau, false, "retopk: calibrate tau per head from the prefill queries");
ABSL_FLAG(float, target_recall, 0, "retopk with --auto_tau: support recall to keep (0: 0.9)");
ABSL_FLAG(bool, exact_flat_scan, false,
          "retopk under --placement=tiered: the exact path (fallback, refresh) scans the bulk "
          "flatly instead of running the exact search (--exact_search)");
// The graph's knobs: any of them set asks for the graph where --exact_search is empty.
ABSL_FLAG(int32_t, build_queries, 0,
          "graph index: prefill queries sampled per graph (0: default; set, asks for the graph)");
ABSL_FLAG(int32_t, build_topk, 0,
          "graph index: exact top-k keys per sampled query (0: default; set, asks for the graph)");
ABSL_FLAG(int32_t, max_degree, 0,
          "graph index: out-degree cap of the key-key graph (0: default; set, asks for the "
          "graph)");
ABSL_FLAG(int32_t, search_list, 0,
          "graph index: beam size of the decode-time search (0: default; set, asks for the "
          "graph)");
ABSL_FLAG(std::string, exact_search, "",
          "tiered index / retopk: how an exact step finds its top K, graph (the graph index) or "
          "shortlist (product-quantized scores on the static tier, rescored exactly); empty: "
          "the server's default (shortlist on a GPU, graph without one or when a graph knob is "
          "set)");
ABSL_FLAG(int32_t, shortlist, 0,
          "tiered index / retopk: the keys N of each head's shortlist, rescored exactly (0: 2 * K "
          "when the shortlist is the exact search; > 0 asks for the shortlist)");
ABSL_FLAG(int32_t, search_width, 0,
          "graph index: candidates the decode-time search expands per round (0: default; set, "
          "asks for the graph)");
ABSL_FLAG(std::string, graph_scope, "",
          "graph index: query heads sharing a graph: kv_head (one graph per KV head) or "
          "query_head (empty: default; set, asks for the graph)");

namespace kvrecall::cli {

using client::Client;
using client::ParseGraphScope;
using client::ParsePlacement;
using client::ParseSelector;

absl::Status CheckTimeoutFlags() {
  for (const auto& [flag, value] :
       {std::pair{"--timeout", absl::GetFlag(FLAGS_timeout)},
        std::pair{"--prefill_timeout", absl::GetFlag(FLAGS_prefill_timeout)}}) {
    if (value <= absl::ZeroDuration()) {
      return absl::InvalidArgumentError(
          absl::StrCat(flag, " must be positive, got ", absl::FormatDuration(value)));
    }
  }
  return absl::OkStatus();
}

client::ReplayOptions ReplayOptionsFromFlags() {
  client::ReplayOptions options;
  options.decode.step_timeout = absl::GetFlag(FLAGS_timeout);
  options.prefill.timeout = absl::GetFlag(FLAGS_prefill_timeout);
  return options;
}

absl::StatusOr<std::unique_ptr<Client>> ConnectToServer() {
  client::ChannelSecurity security;
  security.tls = absl::GetFlag(FLAGS_tls);
  security.ca_file = absl::GetFlag(FLAGS_tls_ca);
  security.cert_file = absl::GetFlag(FLAGS_tls_cert);
  security.key_file = absl::GetFlag(FLAGS_tls_key);
  security.server_name = absl::GetFlag(FLAGS_tls_server_name);
  if (const std::string path = absl::GetFlag(FLAGS_token_file); !path.empty()) {
    absl::StatusOr<std::string> token = client::ReadTokenFile(path);
    if (!token.ok()) {
      // Named as the user gave it: the flag, or the variable the flag defaults to.
      const absl::string_view source =
          path == TokenFileFromEnvironment() ? "$KVRECALL_TOKEN_FILE" : "--token_file";
      return absl::Status(token.status().code(),
                          absl::StrCat(source, ": ", token.status().message()));
    }
    security.token = *std::move(token);
  }
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(
      absl::GetFlag(FLAGS_server), security,
      client::ClientOptions{.call_timeout = absl::GetFlag(FLAGS_timeout)});
  if (!client.ok()) {
    // The client library names ChannelSecurity's fields; the user wrote flags.
    return absl::Status(client.status().code(),
                        absl::StrReplaceAll(client.status().message(),
                                            {{"ca_file", "--tls_ca"},
                                             {"cert_file", "--tls_cert"},
                                             {"key_file", "--tls_key"},
                                             {"ClientOptions.call_timeout", "--timeout"}}));
  }
  return client;
}

absl::StatusOr<v1::Policy> PolicyFromFlags() {
  v1::Policy policy;
  absl::StatusOr<v1::Placement> placement = ParsePlacement(absl::GetFlag(FLAGS_placement));
  if (!placement.ok()) return placement.status();
  absl::StatusOr<v1::Selector> selector = ParseSelector(absl::GetFlag(FLAGS_policy));
  if (!selector.ok()) return selector.status();
  policy.set_placement(*placement);
  policy.set_selector(*selector);
  policy.set_top_k(absl::GetFlag(FLAGS_k));
  v1::ReTopKParams* retopk = policy.mutable_retopk();
  retopk->set_cache_capacity(absl::GetFlag(FLAGS_C));
  retopk->set_reuse_neighbors(absl::GetFlag(FLAGS_R));
  // -1 alone means unset (the server's default); a 0 is sent (none), and any other negative
  // is the server's INVALID_ARGUMENT, as any out-of-range value.
  if (const int sinks = absl::GetFlag(FLAGS_sinks); sinks != -1) policy.set_sinks(sinks);
  if (const int recent = absl::GetFlag(FLAGS_recent); recent != -1) policy.set_recent(recent);
  if (const int w = absl::GetFlag(FLAGS_W); w != -1) retopk->set_recent_window(w);
  if (const float tau = absl::GetFlag(FLAGS_tau); !std::isnan(tau)) retopk->set_tau(tau);
  if (const int refresh = absl::GetFlag(FLAGS_refresh); refresh >= 0) {
    retopk->set_refresh_interval(refresh);
  } else if (refresh != -1) {  // -1 alone means unset: any other negative is a mistake
    return absl::InvalidArgumentError(
        absl::StrCat("--refresh must be >= 0 (or -1: the server's default), got ", refresh));
  }
  retopk->set_auto_tau(absl::GetFlag(FLAGS_auto_tau));
  retopk->set_target_recall(absl::GetFlag(FLAGS_target_recall));
  retopk->set_exact_flat_scan(absl::GetFlag(FLAGS_exact_flat_scan));
  v1::IndexParams* index = policy.mutable_index();
  index->set_build_queries(absl::GetFlag(FLAGS_build_queries));
  index->set_build_topk(absl::GetFlag(FLAGS_build_topk));
  index->set_max_degree(absl::GetFlag(FLAGS_max_degree));
  index->set_search_list_size(absl::GetFlag(FLAGS_search_list));
  index->set_shortlist(absl::GetFlag(FLAGS_shortlist));
  index->set_search_width(absl::GetFlag(FLAGS_search_width));
  if (const std::string search = absl::GetFlag(FLAGS_exact_search); !search.empty()) {
    absl::StatusOr<v1::ExactSearch> parsed = client::ParseExactSearch(search);
    if (!parsed.ok()) return parsed.status();
    index->set_exact_search(*parsed);
  }
  if (const std::string scope = absl::GetFlag(FLAGS_graph_scope); !scope.empty()) {
    absl::StatusOr<v1::GraphScope> parsed = ParseGraphScope(scope);
    if (!parsed.ok()) return parsed.status();
    index->set_graph_scope(*parsed);
  }
  return policy;
}

int ReportError(absl::string_view subcommand, const absl::Status& status) {
  // gRPC says only "Socket closed" where a TLS handshake fails, or where one side speaks TLS
  // and the other does not: the likely causes, as the Python client gives them.
  std::string hint;
  if (absl::IsUnavailable(status) &&
      absl::StrContains(status.message(), "failed to connect to all addresses")) {
    // (As ConnectToServer's channel decides: any --tls* flag, or a token to a HOST:PORT.)
    const bool tls =
        absl::GetFlag(FLAGS_tls) || !absl::GetFlag(FLAGS_tls_ca).empty() ||
        !absl::GetFlag(FLAGS_tls_cert).empty() || !absl::GetFlag(FLAGS_tls_key).empty() ||
        !absl::GetFlag(FLAGS_tls_server_name).empty() ||
        (!absl::GetFlag(FLAGS_token_file).empty() &&
         !absl::StartsWith(absl::GetFlag(FLAGS_server), "unix"));
    hint = tls ? " (if kvrecalld listens there, the TLS handshake failed: check --tls_ca, the "
                 "client certificate a mutual-TLS server requires (--tls_cert, --tls_key) and "
                 "--tls_server_name)"
               : " (if kvrecalld listens there, it may speak TLS: pass --tls or --tls_ca)";
  }
  std::fprintf(stderr, "kvrecall %s: %s%s\n", std::string(subcommand).c_str(),
               status.ToString().c_str(), hint.c_str());
  return 1;
}

int UsageError(absl::string_view subcommand, absl::string_view message) {
  std::fprintf(stderr, "kvrecall %s: %s\n", std::string(subcommand).c_str(),
               std::string(message).c_str());
  return 2;
}

std::string MessageJson(const google::protobuf::Message& message, bool pretty) {
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = pretty;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = true;
  std::string out;
  // Printing a well-formed message cannot fail (no Any fields in kvrecall.v1).
  (void)google::protobuf::util::MessageToJsonString(message, &out, options);
  return out;
}

TerminalProgress::TerminalProgress() : enabled_(::isatty(STDERR_FILENO) == 1) {}

TerminalProgress::~TerminalProgress() { Done(); }

void TerminalProgress::Update(absl::string_view label, double fraction, absl::string_view detail) {
  if (!enabled_) return;
  const auto now = std::chrono::steady_clock::now();
  if (drawn_ && fraction < 1.0 && now - last_ < std::chrono::milliseconds(100)) return;
  last_ = now;
  drawn_ = true;
  std::fprintf(stderr, "\r\033[K%s %5.1f%% %s", std::string(label).c_str(), 100.0 * fraction,
               std::string(detail).c_str());
  std::fflush(stderr);
}

void TerminalProgress::Done() {
  if (!drawn_) return;
  std::fputc('\n', stderr);
  drawn_ = false;
}

std::function<void(const client::PrefillProgress&)> PrefillProgressOn(TerminalProgress* progress,
                                                                      int layers) {
  return [progress, layers](const client::PrefillProgress& p) {
    progress->Update("prefill",
                     (p.layer + static_cast<double>(p.layer_tokens_sent) /
                                    std::max<int64_t>(p.layer_tokens, 1)) / layers,
                     absl::StrFormat("layer %d/%d, %.0f MiB", p.layer + 1, layers,
                                     p.bytes_sent / double{1 << 20}));
  };
}

absl::StatusOr<TraceSession> OpenTraceSession(const std::string& trace_path,
                                              const std::string& session_id) {
  absl::StatusOr<Trace> trace = Trace::Open(trace_path);
  if (!trace.ok()) return trace.status();
  absl::StatusOr<std::unique_ptr<Client>> client = ConnectToServer();
  if (!client.ok()) return client.status();
  absl::StatusOr<v1::SessionInfo> info = (*client)->GetSession(session_id);
  if (!info.ok()) return info.status();
  if (absl::Status s = client::CheckTraceGeometry(*trace, info->session_id(), info->geometry());
      !s.ok()) {
    return s;
  }
  return TraceSession{*std::move(trace), *std::move(client), *std::move(info)};
}

}  // namespace kvrecall::cli
