// TLS, mutual TLS and bearer-token tenants with real certificates that openssl makes for the
// suite: an in-process kvrecall server reached through the C++ client, plaintext Unix sockets
// beside a TLS port (plaintext_unix_sockets), kvrecalld's flags, the kvrecall CLI against a
// real kvrecalld, and the metrics endpoint's HTTPS (--metrics_tls_*) reached by an OpenSSL
// client.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509_vfy.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "client/kvrecall_client.h"
#include "gmock/gmock.h"
#include "grpc/grpc_security_constants.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "server/auth.h"
#include "server/credentials.h"
#include "server/metrics_endpoint.h"
#include "server/tls_identity.h"
#include "tests/server_fixture.h"
#include "tests/test_util.h"

namespace kvrecall {
namespace {

using testing::HasStatus;
using ::testing::HasSubstr;
using ::testing::Not;

// The output (stdout and stderr) and exit status of a shell command.
struct CommandResult {
  int exit_code = -1;
  std::string output;
};
CommandResult RunCommand(const std::string& command) {
  CommandResult result;
  FILE* pipe = popen(absl::StrCat(command, " 2>&1").c_str(), "r");
  if (pipe == nullptr) return result;
  char buffer[4096];
  for (size_t n; (n = fread(buffer, 1, sizeof buffer, pipe)) > 0;) result.output.append(buffer, n);
  const int status = pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return result;
}

void WriteFile(const std::string& path, const std::string& text) { std::ofstream(path) << text; }
std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

constexpr char kAliceToken[] = "alice-token-0123456789";
// How gRPC's client says the server ended a connection mid-handshake (a TLS port given
// plaintext, a mutual-TLS port given no or a stranger's certificate), where a port nobody
// listens on says "Connection refused".
constexpr char kClosedByTheServer[] = "Socket closed";
// How it says a TLS handshake met a plaintext HTTP/2 server (whose answer is no TLS record).
constexpr char kPlaintextPeer[] = "wrong version number";
constexpr char kBobToken[] = "bob-token-0123456789ab";

// A certificate authority, a server certificate for 127.0.0.1 / localhost / kvrecall.test and a
// client certificate signed by it, a second CA with its own client certificate (trusted by
// nobody), and a token file naming two tenants; made once for the whole suite.
class Pki {
 public:
  static const Pki& Get() {
    // Destroyed at exit, which removes its directory.
    static const Pki pki;
    return pki;
  }
  std::string Path(absl::string_view name) const { return dir_.Path({name.data(), name.size()}); }
  const std::string& error() const { return error_; }

 private:
  Pki() {
    if (dir_.path().empty()) {
      error_ = "could not make a temporary directory";
      return;
    }
    WriteFile(Path("server.ext"), "subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kvrecall.test\n");
    WriteFile(Path("client.ext"), "extendedKeyUsage=clientAuth\n");
    const std::string key = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
    const std::vector<std::string> steps = {
        absl::StrCat("openssl req -x509 ", key, " -keyout ca.key -out ca.pem -days 2",
                     " -subj '/CN=kvrecall test CA'"),
        absl::StrCat("openssl req -x509 ", key, " -keyout wrong-ca.key -out wrong-ca.pem -days 2",
                     " -subj '/CN=another CA'"),
        absl::StrCat("openssl req ", key,
                     " -keyout server.key -out server.csr -subj '/CN=kvrecalld'"),
        "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2"
        " -extfile server.ext -out server.pem",
        absl::StrCat("openssl req ", key, " -keyout client.key -out client.csr -subj '/CN=runner'"),
        "openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2"
        " -extfile client.ext -out client.pem",
        absl::StrCat("openssl req ", key,
                     " -keyout stranger.key -out stranger.csr -subj '/CN=stranger'"),
        "openssl x509 -req -in stranger.csr -CA wrong-ca.pem -CAkey wrong-ca.key -CAcreateserial"
        " -days 2 -extfile client.ext -out stranger.pem",
        "openssl x509 -in ca.pem -trustout -out ca-trusted.pem",  // TRUSTED CERTIFICATE
        // The server's next certificate, of the other CA (a rotation to a new issuer).
        absl::StrCat("openssl req ", key,
                     " -keyout server-next.key -out server-next.csr -subj '/CN=kvrecalld'"),
        "openssl x509 -req -in server-next.csr -CA wrong-ca.pem -CAkey wrong-ca.key"
        " -CAcreateserial -days 3 -extfile server.ext -out server-next.pem",
    };
    for (const std::string& step : steps) {
      CommandResult r = RunCommand(absl::StrCat("cd ", dir_.path(), " && ", step));
      if (r.exit_code != 0) {
        error_ = absl::StrCat(step, " failed: ", r.output);
        return;
      }
    }
    WriteFile(Path("tokens"), absl::StrCat("# kvrecall test tenants\n", kAliceToken, " alice\n",
                                           "\n", kBobToken, "\tbob\n"));
    WriteFile(Path("alice.token"), absl::StrCat(kAliceToken, "\n"));
    WriteFile(Path("not-pem"), "just text\n");
  }

  testing::TempDirectory dir_{"pki"};
  std::string error_;
};

class TlsTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_EQ(Pki::Get().error(), ""); }
  const Pki& pki() const { return Pki::Get(); }

  SecurityOptions Tls() const {
    SecurityOptions s;
    s.tls_cert_file = pki().Path("server.pem");
    s.tls_key_file = pki().Path("server.key");
    return s;
  }
  SecurityOptions MutualTls() const {
    SecurityOptions s = Tls();
    s.tls_client_ca_file = pki().Path("ca.pem");
    return s;
  }
  SecurityOptions WithTokens() const {
    SecurityOptions s = Tls();
    s.auth_token_file = pki().Path("tokens");
    return s;
  }
  client::ChannelSecurity TrustingCa() const {
    client::ChannelSecurity c;
    c.ca_file = pki().Path("ca.pem");
    return c;
  }
  // A client of the running server that trusts its CA and sends `token`.
  std::unique_ptr<client::Client> ConnectWithToken(const char* token) const {
    client::ChannelSecurity channel = TrustingCa();
    channel.token = token;
    absl::StatusOr<std::unique_ptr<client::Client>> c =
        client::Client::Connect(server_->address(), channel);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *std::move(c) : nullptr;
  }

  void Start(const SecurityOptions& security, const SessionLimits& limits = {},
             int64_t host_memory_budget_bytes = 0) {
    ServerOptions options;
    options.security = security;
    options.limits = limits;
    options.host_memory_budget_bytes = host_memory_budget_bytes;
    options.service_test_hooks = hooks_;
    options.shared_memory_dir = shared_memory_dir_;
    options.max_shared_streams = max_shared_streams_;
    options.max_shared_streams_per_tenant = max_shared_streams_per_tenant_;
    absl::StatusOr<std::unique_ptr<testing::InProcessServer>> server =
        testing::InProcessServer::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
  }

  // Whether `call` was refused by the connection for `reason` (gRPC's words for what ended the
  // handshake, in the status): UNAVAILABLE alone is also what a port nobody listens on gives.
  static ::testing::AssertionResult RefusedFor(const absl::Status& call, absl::string_view reason) {
    return testing::HasStatus(call, absl::StatusCode::kUnavailable, reason);
  }

  // ListSessions over a channel secured as `security` says; the status is the call's.
  absl::StatusOr<std::vector<v1::SessionInfo>> List(const client::ChannelSecurity& security) {
    absl::StatusOr<std::unique_ptr<client::Client>> c =
        client::Client::Connect(server_->address(), security);
    if (!c.ok()) return c.status();
    return (*c)->ListSessions();
  }

  grpc::health::v1::HealthCheckResponse::ServingStatus Health(
      const client::ChannelSecurity& security) {
    absl::StatusOr<std::unique_ptr<client::Client>> c =
        client::Client::Connect(server_->address(), security);
    EXPECT_TRUE(c.ok()) << c.status();
    auto stub = grpc::health::v1::Health::NewStub((*c)->channel());
    grpc::ClientContext context;
    grpc::health::v1::HealthCheckRequest request;
    grpc::health::v1::HealthCheckResponse response;
    const grpc::Status s = stub->Check(&context, request, &response);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return response.status();
  }

  // The suite's file `name` written to `path` as the kubelet updates a Secret's files: written
  // whole beside it, then renamed into place.
  void PutPkiFile(const std::string& name, const std::string& path) const {
    WriteFile(path + ".new", ReadFile(pki().Path(name)));
    ASSERT_EQ(std::rename((path + ".new").c_str(), path.c_str()), 0);
  }
  // The notAfter of the PKI's certificate `name` in seconds since 1970, as openssl and date
  // read it (-1 if they cannot).
  int64_t NotAfter(const std::string& name) const {
    CommandResult r = RunCommand(absl::StrCat("date -u -d \"$(openssl x509 -noout -enddate -in ",
                                              pki().Path(name), " | cut -d= -f2)\" +%s"));
    int64_t seconds = -1;
    return r.exit_code == 0 && absl::SimpleAtoi(absl::StripAsciiWhitespace(r.output), &seconds)
               ? seconds
               : -1;
  }
  // The value of the series `line` ("name{labels}") in a text exposition, -1 without it.
  static double Series(const std::string& text, const std::string& line) {
    const size_t at = text.find("\n" + line + " ");
    double value = -1;
    if (at == std::string::npos) return value;
    const size_t begin = at + line.size() + 2;
    return absl::SimpleAtod(text.substr(begin, text.find('\n', begin) - begin), &value) ? value
                                                                                        : -1;
  }

  ServiceTestHooks hooks_;  // the next Start's
  std::string shared_memory_dir_;  // the next Start's --shared_memory_dir
  int max_shared_streams_ = 16;  // and its --max_shared_streams
  int max_shared_streams_per_tenant_ = 0;  // and --max_shared_streams_per_tenant
  std::unique_ptr<testing::InProcessServer> server_;
};

// A session of full attention, one decode step through `c`, checked against the brute-force
// reference over prompt plus the new token.
void ExpectDecodeMatchesFullAttention(client::Client& c) {
  const v1::Geometry g = testing::MakeGeometry(1, 2, 1, 8);
  const int64_t tokens = 12;
  std::vector<float> q = testing::RandomNormal(tokens * 2 * 8, 1);
  std::vector<float> k = testing::RandomNormal((tokens + 1) * 8, 2);
  std::vector<float> v = testing::RandomNormal((tokens + 1) * 8, 3);
  absl::StatusOr<client::SessionHandle> session =
      c.CreateSession(g, testing::MakePolicy(v1::SELECTOR_FULL));
  ASSERT_TRUE(session.ok()) << session.status();
  absl::StatusOr<std::unique_ptr<client::PrefillStream>> prefill = c.StartPrefill(*session);
  ASSERT_TRUE(prefill.ok()) << prefill.status();
  ASSERT_TRUE((*prefill)
                  ->SendLayer(0, q, std::span(k).first(tokens * 8), std::span(v).first(tokens * 8))
                  .ok());
  ASSERT_TRUE((*prefill)->Finish().ok());
  absl::StatusOr<std::unique_ptr<client::DecodeStream>> decode = c.OpenDecodeStream(g);
  ASSERT_TRUE(decode.ok()) << decode.status();
  const std::vector<float> q_t = testing::RandomNormal(2 * 8, 4);
  const client::SequenceInput input{session->id, q_t, std::span(k).last(8), std::span(v).last(8)};
  client::StepResult result;
  const absl::Status step = (*decode)->Step(0, std::span(&input, 1), {}, &result);
  ASSERT_TRUE(step.ok()) << step;
  const KvView kv{k.data(), v.data(), tokens + 1, 1, 8};
  for (int h = 0; h < 2; ++h) {
    std::vector<double> want;
    testing::ReferenceAttention(q_t.data() + h * 8, kv, 0, testing::AllTokens(tokens + 1),
                                1.0 / std::sqrt(8.0), &want);
    for (int d = 0; d < 8; ++d) EXPECT_NEAR(result.output[h * 8 + d], want[d], 1e-5);
  }
  EXPECT_TRUE((*decode)->Close().ok());
  EXPECT_TRUE(c.CloseSession(session->id).ok());
}

TEST_F(TlsTest, DecodesOverTlsAndRefusesPlaintextAndUntrustedServers) {
  Start(Tls());
  absl::StatusOr<std::unique_ptr<client::Client>> c =
      client::Client::Connect(server_->address(), TrustingCa());
  ASSERT_TRUE(c.ok()) << c.status();
  ExpectDecodeMatchesFullAttention(**c);

  // A plaintext client gets no answer from a TLS port: it closes the connection.
  EXPECT_TRUE(RefusedFor(List({}).status(), kClosedByTheServer));
  // A client trusting another CA refuses the server's certificate.
  client::ChannelSecurity wrong_ca;
  wrong_ca.ca_file = pki().Path("wrong-ca.pem");
  EXPECT_TRUE(RefusedFor(List(wrong_ca).status(), "certificate verify failed"));
  // The certificate names kvrecall.test, not other.test.
  client::ChannelSecurity named = TrustingCa();
  named.server_name = "kvrecall.test";
  EXPECT_TRUE(List(named).ok());
  named.server_name = "other.test";
  EXPECT_TRUE(RefusedFor(List(named).status(), "Peer name other.test is not in peer certificate"));
  EXPECT_TRUE(server_->server().sessions().List().empty());
}

TEST_F(TlsTest, MutualTlsNeedsAClientCertificateFromTheClientCa) {
  Start(MutualTls());
  client::ChannelSecurity with_cert = TrustingCa();
  with_cert.cert_file = pki().Path("client.pem");
  with_cert.key_file = pki().Path("client.key");
  absl::StatusOr<std::unique_ptr<client::Client>> c =
      client::Client::Connect(server_->address(), with_cert);
  ASSERT_TRUE(c.ok()) << c.status();
  ExpectDecodeMatchesFullAttention(**c);

  // Without a certificate, or with one of another CA, the server ends the handshake.
  EXPECT_TRUE(RefusedFor(List(TrustingCa()).status(), kClosedByTheServer));
  client::ChannelSecurity stranger = TrustingCa();
  stranger.cert_file = pki().Path("stranger.pem");
  stranger.key_file = pki().Path("stranger.key");
  EXPECT_TRUE(RefusedFor(List(stranger).status(), kClosedByTheServer));
}

TEST_F(TlsTest, TokensGateEveryServiceButHealth) {
  Start(WithTokens());
  EXPECT_TRUE(HasStatus(List(TrustingCa()).status(), absl::StatusCode::kUnauthenticated,
                        "requires a bearer token"));
  client::ChannelSecurity wrong = TrustingCa();
  wrong.token = "not-a-token-of-this-server";
  EXPECT_TRUE(
      HasStatus(List(wrong).status(), absl::StatusCode::kUnauthenticated, "unknown bearer token"));
  // A token that is a prefix of a real one is no token.
  wrong.token = std::string(kAliceToken).substr(0, 20);
  EXPECT_EQ(List(wrong).status().code(), absl::StatusCode::kUnauthenticated);
  // Probes carry no token.
  EXPECT_EQ(Health(TrustingCa()), grpc::health::v1::HealthCheckResponse::SERVING);

  client::ChannelSecurity alice = TrustingCa();
  alice.token = kAliceToken;
  absl::StatusOr<std::unique_ptr<client::Client>> c =
      client::Client::Connect(server_->address(), alice);
  ASSERT_TRUE(c.ok());
  ExpectDecodeMatchesFullAttention(**c);

  const std::string text = server_->server().metrics().TextFormat();
  EXPECT_THAT(text, HasSubstr("\nkvrecall_unauthenticated_requests_total 3\n"));
}

// A reload that takes a token away stops the streams open with it at their next request, with
// nothing of that request applied; a stream whose token stays goes on (SIGHUP calls
// ReloadTokens; a revoked token's streams otherwise kept serving as long as they stayed open).
TEST_F(TlsTest, ARevokedTokensOpenStreamsStopAtTheirNextRequest) {
  constexpr char kCarolToken[] = "carol-token-0123456789";
  SecurityOptions security = WithTokens();
  security.auth_token_file = pki().Path("revoked.tokens");
  WriteFile(security.auth_token_file,
            absl::StrCat(kAliceToken, " alice\n", kCarolToken, " alice\n"));
  Start(security);
  std::unique_ptr<client::Client> alice = ConnectWithToken(kAliceToken);
  std::unique_ptr<client::Client> carol = ConnectWithToken(kCarolToken);  // alice's tenant too
  const v1::Geometry g = testing::MakeGeometry(1, 2, 1, 8);
  absl::StatusOr<client::SessionHandle> session =
      alice->CreateSession(g, testing::MakePolicy(v1::SELECTOR_FULL), "revoked");
  ASSERT_TRUE(session.ok()) << session.status();
  const std::vector<float> q = testing::RandomNormal(4 * 2 * 8, 1);
  const std::vector<float> kv = testing::RandomNormal(4 * 8, 2);
  absl::StatusOr<std::unique_ptr<client::PrefillStream>> prefill = alice->StartPrefill(*session);
  ASSERT_TRUE(prefill.ok());
  ASSERT_TRUE((*prefill)->SendLayer(0, q, kv, kv).ok());
  ASSERT_TRUE((*prefill)->Finish().ok());
  const std::vector<float> q_t = testing::RandomNormal(2 * 8, 3);
  const std::vector<float> kv_t = testing::RandomNormal(8, 4);
  const client::SequenceInput input{session->id, q_t, kv_t, kv_t};
  client::StepResult result;
  absl::StatusOr<std::unique_ptr<client::DecodeStream>> alices = alice->OpenDecodeStream(g);
  absl::StatusOr<std::unique_ptr<client::DecodeStream>> carols = carol->OpenDecodeStream(g);
  ASSERT_TRUE(alices.ok() && carols.ok());
  ASSERT_TRUE((*alices)->Step(0, std::span(&input, 1), {}, &result).ok());
  ASSERT_TRUE((*carols)->Step(0, std::span(&input, 1), {}, &result).ok());
  ASSERT_TRUE(testing::Within(absl::Seconds(5), [&] {
    return server_->server().service().open_streams() == 2;  // the prefill's is done
  }));
  // Alice's token taken out: her stream, idle, ends at once, without a request of hers (one
  // that never sends again held its slot for good: probe 26, 3); carol's goes on.
  WriteFile(security.auth_token_file, absl::StrCat(kCarolToken, " alice\n"));
  absl::StatusOr<size_t> reloaded = server_->server().ReloadTokens();
  ASSERT_TRUE(reloaded.ok()) << reloaded.status();
  EXPECT_EQ(*reloaded, 1u);
  EXPECT_TRUE(testing::Within(absl::Seconds(5), [&] {
    return server_->server().service().open_streams() == 1;
  }));
  EXPECT_TRUE(HasStatus((*alices)->Step(0, std::span(&input, 1), {}, &result),
                        absl::StatusCode::kUnauthenticated,
                        "this stream's bearer token was revoked"));
  ASSERT_TRUE((*carols)->Step(0, std::span(&input, 1), {}, &result).ok());
  EXPECT_EQ(result.response->results(0).position(), 6);  // 4 + 2 steps: alice's last not taken
  EXPECT_TRUE((*carols)->Close().ok());
  EXPECT_EQ(alice->ListSessions().status().code(), absl::StatusCode::kUnauthenticated);
  // A file that does not parse leaves the tokens in force.
  WriteFile(security.auth_token_file, "short alice\n");
  EXPECT_EQ(server_->server().ReloadTokens().status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(carol->ListSessions().ok());
}

// A reload between the auth processor's check of a call's token and the service's lookup of its
// tenant leaves the call with no tenant: every kind of call is refused by name, nothing applied
// (review 23: such a call ran as the no-tenant identity and met NOT_FOUND, or a stream stayed
// open serving nothing).
TEST_F(TlsTest, ACallWhoseTokenIsReloadedAwayAsItStartsIsRefused) {
  SecurityOptions security = WithTokens();
  security.auth_token_file = pki().Path("reloaded_at_start.tokens");
  const std::string with_alice = absl::StrCat(kAliceToken, " alice\n", kBobToken, " bob\n");
  WriteFile(security.auth_token_file, with_alice);
  testing::TempDirectory regions("tls-regions");
  shared_memory_dir_ = regions.path();
  std::atomic<bool> reload_next_call{false};
  hooks_.before_call_identified = [&] {
    if (!reload_next_call.exchange(false)) return;
    WriteFile(security.auth_token_file, absl::StrCat(kBobToken, " bob\n"));
    ASSERT_TRUE(server_->server().ReloadTokens().ok());
  };
  Start(security);
  std::unique_ptr<client::Client> alice = ConnectWithToken(kAliceToken);
  const v1::Geometry g = testing::MakeGeometry(1, 2, 1, 8);
  absl::StatusOr<client::SessionHandle> session =
      alice->CreateSession(g, testing::MakePolicy(v1::SELECTOR_FULL));
  ASSERT_TRUE(session.ok()) << session.status();
  const std::vector<float> q = testing::RandomNormal(4 * 2 * 8, 1);
  const std::vector<float> kv = testing::RandomNormal(4 * 8, 2);
  const std::vector<float> q_t = testing::RandomNormal(2 * 8, 3);
  const std::vector<float> kv_t = testing::RandomNormal(8, 4);
  const client::SequenceInput input{session->id, q_t, kv_t, kv_t};
  client::StepResult result;
  constexpr char kRefused[] = "bearer token is no longer valid (the token file was reloaded as";
  // Each call below starts as its token is reloaded away; the token is then put back.
  auto refused_as_it_starts = [&](const std::function<absl::Status()>& call) {
    reload_next_call = true;
    const absl::Status status = call();
    EXPECT_FALSE(reload_next_call) << "the call was not identified";
    WriteFile(security.auth_token_file, with_alice);
    EXPECT_TRUE(server_->server().ReloadTokens().ok());
    return HasStatus(status, absl::StatusCode::kUnauthenticated, kRefused);
  };
  EXPECT_TRUE(refused_as_it_starts([&] { return alice->ListSessions().status(); }));
  EXPECT_TRUE(refused_as_it_starts([&] {
    return alice->CreateSession(g, testing::MakePolicy(v1::SELECTOR_FULL)).status();
  }));
  EXPECT_TRUE(refused_as_it_starts([&] { return alice->GetSession(session->id).status(); }));
  EXPECT_TRUE(refused_as_it_starts([&] { return alice->CloseSession(session->id); }));
  EXPECT_TRUE(refused_as_it_starts([&] {
    absl::StatusOr<std::unique_ptr<client::PrefillStream>> prefill =
        alice->StartPrefill(*session);
    if (!prefill.ok()) return prefill.status();
    absl::Status sent = (*prefill)->SendLayer(0, q, kv, kv);
    absl::Status finished = (*prefill)->Finish().status();
    return sent.ok() ? finished : sent;
  }));
  EXPECT_TRUE(refused_as_it_starts([&] {
    absl::StatusOr<std::unique_ptr<client::DecodeStream>> decode = alice->OpenDecodeStream(g);
    if (!decode.ok()) return decode.status();
    return (*decode)->Step(0, std::span(&input, 1), {}, &result);
  }));
  // DecodeShared is refused as it opens, before it takes a slot and a region.
  EXPECT_TRUE(refused_as_it_starts([&] {
    return alice->OpenDecodeStream(g, {.shared_memory = true}).status();
  }));
  EXPECT_TRUE(std::filesystem::is_empty(regions.path()));
  // Nothing was applied: one session, never prefilled; the token works again.
  absl::StatusOr<std::vector<v1::SessionInfo>> listed = alice->ListSessions();
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].tokens(), 0);
  absl::StatusOr<std::unique_ptr<client::PrefillStream>> prefill = alice->StartPrefill(*session);
  ASSERT_TRUE(prefill.ok());
  ASSERT_TRUE((*prefill)->SendLayer(0, q, kv, kv).ok());
  ASSERT_TRUE((*prefill)->Finish().ok());
  EXPECT_TRUE(alice->CloseSession(session->id).ok());
}

// A CreateSession's request_id is its tenant's: another tenant's call with the same id makes a
// session of its own, and does not learn of the first.
TEST_F(TlsTest, RequestIdsArePerTenant) {
  Start(WithTokens());
  std::unique_ptr<client::Client> alice = ConnectWithToken(kAliceToken);
  std::unique_ptr<client::Client> bob = ConnectWithToken(kBobToken);
  const v1::Geometry g = testing::MakeGeometry(1, 2, 1, 8);
  const v1::Policy full = testing::MakePolicy(v1::SELECTOR_FULL);
  absl::StatusOr<client::SessionHandle> alices = alice->CreateSession(g, full, "", 0, "same-id");
  absl::StatusOr<client::SessionHandle> bobs = bob->CreateSession(g, full, "", 0, "same-id");
  ASSERT_TRUE(alices.ok() && bobs.ok());
  EXPECT_NE(alices->id, bobs->id);
  absl::StatusOr<client::SessionHandle> alices_again =
      alice->CreateSession(g, full, "", 0, "same-id");
  ASSERT_TRUE(alices_again.ok());
  EXPECT_EQ(alices_again->id, alices->id);
  // Bob's other request under the id is checked against his own session alone.
  absl::StatusOr<client::SessionHandle> bobs_other =
      bob->CreateSession(g, full, "another label", 0, "same-id");
  EXPECT_TRUE(HasStatus(bobs_other.status(), absl::StatusCode::kAlreadyExists,
                        absl::StrCat("made session ", bobs->id)));
  EXPECT_EQ(bob->GetSession(alices->id).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(TlsTest, SessionsBelongToTheTenantThatCreatedThem) {
  Start(WithTokens());
  std::unique_ptr<client::Client> alice = ConnectWithToken(kAliceToken);
  std::unique_ptr<client::Client> bob = ConnectWithToken(kBobToken);
  const v1::Geometry g = testing::MakeGeometry(1, 2, 1, 8);
  absl::StatusOr<client::SessionHandle> session =
      alice->CreateSession(g, testing::MakePolicy(v1::SELECTOR_FULL), "alice's");
  ASSERT_TRUE(session.ok()) << session.status();
  const std::vector<float> q = testing::RandomNormal(4 * 2 * 8, 1);
  const std::vector<float> kv = testing::RandomNormal(4 * 8, 2);

  // To bob, alice's session is a session that does not exist: the same code and message as
  // an id nobody holds.
  const std::string absent = "no-such-session";
  auto as_absent = [&](absl::Status status) {
    std::string message(status.message());
    const size_t at = message.find(session->id);
    if (at != std::string::npos) message.replace(at, session->id.size(), absent);
    return absl::Status(status.code(), message);
  };
  const absl::Status absent_get = bob->GetSession(absent).status();
  EXPECT_EQ(absent_get.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(as_absent(bob->GetSession(session->id).status()), absent_get);
  EXPECT_EQ(as_absent(bob->CloseSession(session->id)), bob->CloseSession(absent));
  absl::StatusOr<std::unique_ptr<client::PrefillStream>> prefill = bob->StartPrefill(*session);
  ASSERT_TRUE(prefill.ok());
  (void)(*prefill)->SendLayer(0, q, kv, kv);
  EXPECT_EQ((*prefill)->Finish().status().code(), absl::StatusCode::kNotFound);
  absl::StatusOr<std::vector<v1::SessionInfo>> bobs = bob->ListSessions();
  ASSERT_TRUE(bobs.ok());
  EXPECT_TRUE(bobs->empty());

  // Alice's session is untouched: she prefills it, decodes on it, lists and closes it; bob's
  // decode step on it is NOT_FOUND and appends nothing.
  absl::StatusOr<std::unique_ptr<client::PrefillStream>> own = alice->StartPrefill(*session);
  ASSERT_TRUE(own.ok());
  ASSERT_TRUE((*own)->SendLayer(0, q, kv, kv).ok());
  ASSERT_TRUE((*own)->Finish().ok());
  const std::vector<float> q_t = testing::RandomNormal(2 * 8, 3);
  const std::vector<float> kv_t = testing::RandomNormal(8, 4);
  const client::SequenceInput input{session->id, q_t, kv_t, kv_t};
  client::StepResult result;
  absl::StatusOr<std::unique_ptr<client::DecodeStream>> bob_stream = bob->OpenDecodeStream(g);
  ASSERT_TRUE(bob_stream.ok());
  EXPECT_TRUE(HasStatus((*bob_stream)->Step(0, std::span(&input, 1), {}, &result),
                        absl::StatusCode::kNotFound, "no session"));
  absl::StatusOr<std::unique_ptr<client::DecodeStream>> alice_stream = alice->OpenDecodeStream(g);
  ASSERT_TRUE(alice_stream.ok());
  ASSERT_TRUE((*alice_stream)->Step(0, std::span(&input, 1), {}, &result).ok());
  EXPECT_TRUE((*alice_stream)->Close().ok());
  absl::StatusOr<std::vector<v1::SessionInfo>> alices = alice->ListSessions();
  ASSERT_TRUE(alices.ok());
  ASSERT_EQ(alices->size(), 1u);
  EXPECT_EQ((*alices)[0].session_id(), session->id);
  EXPECT_EQ((*alices)[0].tokens(), 5);  // 4 prompt tokens and alice's step; bob's took none
  EXPECT_TRUE(alice->CloseSession(session->id).ok());
}

// --max_shared_streams_per_tenant keeps one tenant from taking every DecodeShared slot (probe
// 26's left item); a refusal by either limit says how many of the streams are the caller's.
TEST_F(TlsTest, OneTenantCannotTakeEverySharedStream) {
  testing::TempDirectory regions("tls-regions");
  shared_memory_dir_ = regions.path();
  max_shared_streams_ = 3;
  max_shared_streams_per_tenant_ = 2;
  Start(WithTokens());
  std::unique_ptr<client::Client> alice = ConnectWithToken(kAliceToken);
  std::unique_ptr<client::Client> bob = ConnectWithToken(kBobToken);
  const v1::Geometry g = testing::MakeGeometry(1, 2, 1, 8);
  const client::DecodeStreamOptions shared = {.shared_memory = true};
  std::vector<std::unique_ptr<client::DecodeStream>> alices;
  for (int i = 0; i < 2; ++i) {
    absl::StatusOr<std::unique_ptr<client::DecodeStream>> s = alice->OpenDecodeStream(g, shared);
    ASSERT_TRUE(s.ok()) << s.status();
    alices.push_back(*std::move(s));
  }
  EXPECT_TRUE(HasStatus(alice->OpenDecodeStream(g, shared).status(),
                        absl::StatusCode::kResourceExhausted,
                        "tenant 'alice' has 2 shared Decode streams open, the limit per tenant "
                        "(--max_shared_streams_per_tenant=2): close one or use Decode"));
  EXPECT_EQ(testing::RefusalsCounted(server_->server(), "max_shared_streams_per_tenant"), 1);
  absl::StatusOr<std::unique_ptr<client::DecodeStream>> bobs = bob->OpenDecodeStream(g, shared);
  ASSERT_TRUE(bobs.ok()) << bobs.status();
  EXPECT_TRUE(HasStatus(bob->OpenDecodeStream(g, shared).status(),
                        absl::StatusCode::kResourceExhausted,
                        "--max_shared_streams=3 shared Decode streams are open, 1 of them yours"));
  EXPECT_EQ(testing::RefusalsCounted(server_->server(), "max_shared_streams"), 1);
  // A closed stream gives its tenant's slot back, and the server's.
  EXPECT_TRUE(alices[0]->Close().ok());
  alices.erase(alices.begin());
  absl::StatusOr<std::unique_ptr<client::DecodeStream>> bobs_second =
      bob->OpenDecodeStream(g, shared);
  EXPECT_TRUE(bobs_second.ok()) << bobs_second.status();
  EXPECT_TRUE(HasStatus(alice->OpenDecodeStream(g, shared).status(),
                        absl::StatusCode::kResourceExhausted,
                        "--max_shared_streams=3 shared Decode streams are open, 1 of them yours: "
                        "close one or use Decode"));
  // A tenant holding none of a full server's streams is told so, not to close one.
  for (auto& stream : alices) EXPECT_TRUE(stream->Close().ok());
  EXPECT_TRUE((*bobs)->Close().ok());
  EXPECT_TRUE((*bobs_second)->Close().ok());
  alices.clear();
  max_shared_streams_per_tenant_ = 0;
  Start(WithTokens());
  alice = ConnectWithToken(kAliceToken);
  bob = ConnectWithToken(kBobToken);
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<std::unique_ptr<client::DecodeStream>> s = alice->OpenDecodeStream(g, shared);
    ASSERT_TRUE(s.ok()) << s.status();
    alices.push_back(*std::move(s));
  }
  EXPECT_TRUE(HasStatus(bob->OpenDecodeStream(g, shared).status(),
                        absl::StatusCode::kResourceExhausted,
                        "--max_shared_streams=3 shared Decode streams are open, none of them "
                        "yours: use Decode"));
}

// --max_sessions_per_tenant keeps one tenant from taking every --max_sessions slot, and a refusal
// by either says how many of the sessions are the caller's, never whose the others are: bob,
// holding none, was told to close one (probe 20, 5).
TEST_F(TlsTest, OneTenantCannotTakeEverySlot) {
  SessionLimits limits;
  limits.max_sessions = 3;
  limits.max_sessions_per_tenant = 2;
  Start(WithTokens(), limits);
  std::unique_ptr<client::Client> alice = ConnectWithToken(kAliceToken);
  std::unique_ptr<client::Client> bob = ConnectWithToken(kBobToken);
  const v1::Geometry g = testing::MakeGeometry(1, 2, 1, 8);
  const v1::Policy policy = testing::MakePolicy(v1::SELECTOR_FULL);
  std::vector<std::string> alices;
  for (int i = 0; i < 2; ++i) {
    absl::StatusOr<client::SessionHandle> s = alice->CreateSession(g, policy);
    ASSERT_TRUE(s.ok()) << s.status();
    alices.push_back(s->id);
  }
  EXPECT_TRUE(HasStatus(alice->CreateSession(g, policy).status(),
                        absl::StatusCode::kResourceExhausted,
                        "tenant 'alice' holds 2 sessions, the limit per tenant "
                        "(--max_sessions_per_tenant=2): close one (CloseSession)"));
  EXPECT_EQ(testing::RefusalsCounted(server_->server(), "max_sessions_per_tenant"), 1);
  absl::StatusOr<client::SessionHandle> bobs = bob->CreateSession(g, policy);
  ASSERT_TRUE(bobs.ok()) << bobs.status();
  EXPECT_TRUE(HasStatus(bob->CreateSession(g, policy).status(),
                        absl::StatusCode::kResourceExhausted,
                        "this server holds 3 sessions, its limit (--max_sessions=3), 1 of them "
                        "yours: close one (CloseSession) or retry on another server"));
  EXPECT_EQ(testing::RefusalsCounted(server_->server(), "max_sessions"), 1);
  // A closed session gives its tenant's slot back, and the server's.
  ASSERT_TRUE(bob->CloseSession(bobs->id).ok());
  ASSERT_TRUE(bob->CreateSession(g, policy).ok());
  ASSERT_TRUE(alice->CloseSession(alices[0]).ok());
  ASSERT_TRUE(alice->CreateSession(g, policy).ok());

  // A tenant holding none of a full server's sessions is told so, not to close one.
  limits.max_sessions = 2;
  limits.max_sessions_per_tenant = 0;
  Start(WithTokens(), limits);
  alice = ConnectWithToken(kAliceToken);
  bob = ConnectWithToken(kBobToken);
  for (int i = 0; i < 2; ++i) ASSERT_TRUE(alice->CreateSession(g, policy).ok());
  EXPECT_TRUE(HasStatus(bob->CreateSession(g, policy).status(),
                        absl::StatusCode::kResourceExhausted,
                        "this server holds 2 sessions, its limit (--max_sessions=2), none of them "
                        "yours: retry on another server"));

  // A session that expired gives its tenant's slot back too (as one closed does, and one whose
  // admission failed: SessionRegistry::Create).
  limits = SessionLimits();
  limits.max_sessions_per_tenant = 1;
  limits.session_idle_ttl = absl::Milliseconds(200);
  Start(WithTokens(), limits);
  alice = ConnectWithToken(kAliceToken);
  ASSERT_TRUE(alice->CreateSession(g, policy).ok());
  EXPECT_TRUE(HasStatus(alice->CreateSession(g, policy).status(),
                        absl::StatusCode::kResourceExhausted,
                        "tenant 'alice' holds 1 session, the limit per tenant"));
  EXPECT_TRUE(testing::Within(absl::Seconds(10),
                              [&] { return alice->CreateSession(g, policy).ok(); }));
}

// --host_memory_budget_per_tenant_gb keeps one tenant from taking all of the host budget: a
// tenant's sessions hold at most its share (their KV set aside for max_tokens, their selector
// state), refused naming the tenant's budget while other tenants still get theirs, within the
// server's budget; a closed session gives its share back.
TEST_F(TlsTest, OneTenantCannotTakeAllTheHostMemory) {
  constexpr int64_t kMiB = 1 << 20;
  SessionLimits limits;
  limits.host_bytes_per_tenant = 64 * kMiB;
  Start(WithTokens(), limits, /*host_memory_budget_bytes=*/100 * kMiB);
  std::unique_ptr<client::Client> alice = ConnectWithToken(kAliceToken);
  std::unique_ptr<client::Client> bob = ConnectWithToken(kBobToken);
  const v1::Geometry g = testing::MakeGeometry(1, 2, 1, 64);
  const v1::Policy full = testing::MakePolicy(v1::SELECTOR_FULL);
  // f32 keys and values of one KV head of 64: 51.2 MB (and its pages' rounding) set aside for
  // 100000 tokens.
  constexpr int64_t kTokens = 100000;
  absl::StatusOr<client::SessionHandle> first = alice->CreateSession(g, full, "", kTokens);
  ASSERT_TRUE(first.ok()) << first.status();
  const int64_t set_aside = server_->server().budget().used();
  ASSERT_GE(set_aside, 51200000);
  ASSERT_LT(set_aside, 52 * kMiB);
  EXPECT_TRUE(HasStatus(alice->CreateSession(g, full, "", kTokens).status(),
                        absl::StatusCode::kResourceExhausted,
                        absl::StrCat("host memory (tenant 'alice') budget exceeded: "
                                     "max_tokens=100000 of 1 layers needs ", set_aside,
                                     " more bytes, ", set_aside,
                                     " of the 67108864-byte budget "
                                     "(host_memory_budget_per_tenant_gb=0.0625) are in use")));
  EXPECT_EQ(testing::RefusalsCounted(server_->server(), "host_memory_budget_per_tenant"), 1);
  // Bob has a share of his own; the server's budget (100 MiB) is what refuses more.
  absl::StatusOr<client::SessionHandle> bobs = bob->CreateSession(g, full, "", kTokens);
  ASSERT_TRUE(bobs.ok()) << bobs.status();
  EXPECT_EQ(server_->server().budget().used(), 2 * set_aside);
  // The operator sees each tenant's sessions and share on /metrics.
  std::string scrape = server_->server().metrics().TextFormat();
  EXPECT_EQ(testing::SeriesValue(scrape, R"(kvrecall_tenant_sessions_open{tenant="alice"})"), 1);
  EXPECT_EQ(testing::SeriesValue(scrape, R"(kvrecall_tenant_sessions_open{tenant="bob"})"), 1);
  EXPECT_EQ(testing::SeriesValue(scrape, R"(kvrecall_tenant_host_memory_bytes{tenant="alice"})"),
            set_aside);
  EXPECT_EQ(
      testing::SeriesValue(scrape, R"(kvrecall_tenant_host_memory_budget_bytes{tenant="bob"})"),
      64 * kMiB);
  // The server's budget, which the tenants share, refuses without telling alice how much of
  // it bob holds (probe 26, 6).
  const absl::Status full_server = alice->CreateSession(g, full, "", kTokens / 4).status();
  EXPECT_TRUE(HasStatus(full_server, absl::StatusCode::kResourceExhausted,
                        absl::StrCat("host memory budget exceeded: max_tokens=25000 of 1 layers "
                                     "needs ")));
  EXPECT_THAT(full_server.message(), HasSubstr("more than the 104857600-byte budget "
                                               "(host_memory_budget_gb=0.0976562) that this "
                                               "server's tenants share has free"));
  EXPECT_THAT(full_server.message(), Not(HasSubstr(absl::StrCat(2 * set_aside))));
  // Nor does the machine's own limit, which a max_tokens past the machine meets first where
  // the machine is smaller than 51 GB (review 23).
  const absl::Status past_machine = alice->CreateSession(g, full, "", 100000000).status();
  EXPECT_EQ(past_machine.code(), absl::StatusCode::kResourceExhausted) << past_machine;
  EXPECT_THAT(past_machine.message(), Not(HasSubstr(absl::StrCat(2 * set_aside))));
  EXPECT_EQ(testing::RefusalsCounted(server_->server(), "host_memory_budget"), 1);
  // A selector whose state could never fit the tenant's share (but would the server's) is
  // refused at CreateSession.
  v1::Policy retopk = testing::MakePolicy(v1::SELECTOR_RETOPK, 2048);
  retopk.mutable_retopk()->set_cache_capacity(4096);
  EXPECT_TRUE(HasStatus(bob->CreateSession(g, retopk, "", 1000).status(),
                        absl::StatusCode::kResourceExhausted,
                        "host memory (tenant 'bob') budget exceeded: the retopk selector state"));
  // A closed session gives its tenant's share back.
  ASSERT_TRUE(alice->CloseSession(first->id).ok());
  EXPECT_EQ(server_->server().budget().used(), set_aside);
  ASSERT_TRUE(alice->CreateSession(g, full, "", kTokens).ok());
  ASSERT_TRUE(bob->CloseSession(bobs->id).ok());
  absl::StatusOr<client::SessionHandle> bobs_again = bob->CreateSession(g, full, "", kTokens);
  ASSERT_TRUE(bobs_again.ok()) << bobs_again.status();
  // A tenant that holds nothing any more has no series.
  ASSERT_TRUE(bob->CloseSession(bobs_again->id).ok());
  scrape = server_->server().metrics().TextFormat();
  EXPECT_THAT(scrape, Not(HasSubstr("tenant=\"bob\"")));
  EXPECT_EQ(testing::SeriesValue(scrape, R"(kvrecall_tenant_host_memory_bytes{tenant="alice"})"),
            set_aside);
}

// A gateway multiplexes tenants over one connection: each call is its own token's tenant's.
// (The tenant was once read from gRPC's AuthContext, which the calls of a connection share: the
// connection's first tenant then owned every later call on it, whoever's token it carried.)
TEST_F(TlsTest, EachCallIsItsOwnTokensTenantOnASharedConnection) {
  Start(WithTokens());
  absl::StatusOr<std::unique_ptr<client::Client>> c =
      client::Client::Connect(server_->address(), TrustingCa());  // no token of its own
  ASSERT_TRUE(c.ok()) << c.status();
  auto stub = v1::KvRecall::NewStub((*c)->channel());
  auto as = [](grpc::ClientContext* context, const char* token) {
    context->AddMetadata("authorization", absl::StrCat("Bearer ", token));
  };
  auto create = [&](const char* token, const char* label) {
    grpc::ClientContext context;
    as(&context, token);
    v1::CreateSessionRequest request;
    *request.mutable_geometry() = testing::MakeGeometry(1, 2, 1, 8);
    *request.mutable_policy() = testing::MakePolicy(v1::SELECTOR_FULL);
    request.set_label(label);
    v1::CreateSessionResponse response;
    const grpc::Status s = stub->CreateSession(&context, request, &response);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return response.session_id();
  };
  auto list = [&](const char* token) {
    grpc::ClientContext context;
    as(&context, token);
    v1::ListSessionsResponse response;
    const grpc::Status s = stub->ListSessions(&context, v1::ListSessionsRequest(), &response);
    EXPECT_TRUE(s.ok()) << s.error_message();
    std::vector<std::string> labels;
    for (const v1::SessionInfo& info : response.sessions()) labels.push_back(info.label());
    return labels;
  };
  auto close = [&](const char* token, const std::string& id) {
    grpc::ClientContext context;
    as(&context, token);
    v1::CloseSessionRequest request;
    request.set_session_id(id);
    v1::CloseSessionResponse response;
    return testing::FromGrpc(stub->CloseSession(&context, request, &response));
  };
  // Alice's call first on the connection, then bob's, then alice's again.
  const std::string alices = create(kAliceToken, "alice's");
  const std::string bobs = create(kBobToken, "bob's");
  EXPECT_THAT(list(kAliceToken), ::testing::ElementsAre("alice's"));
  EXPECT_THAT(list(kBobToken), ::testing::ElementsAre("bob's"));
  EXPECT_TRUE(HasStatus(close(kBobToken, alices), absl::StatusCode::kNotFound, "no session"));
  EXPECT_TRUE(HasStatus(close(kAliceToken, bobs), absl::StatusCode::kNotFound, "no session"));
  // A decode step of bob's on alice's session is NOT_FOUND too, on the same connection.
  {
    grpc::ClientContext context;
    as(&context, kBobToken);
    auto stream = stub->Decode(&context);
    v1::DecodeRequest request;
    request.set_layer(0);
    *request.add_steps() = testing::MakeStep(alices, testing::MakeGeometry(1, 2, 1, 8),
                                             testing::RandomNormal(16, 1),
                                             testing::RandomNormal(8, 2),
                                             testing::RandomNormal(8, 3));
    ASSERT_TRUE(stream->Write(request));
    v1::DecodeResponse response;
    EXPECT_FALSE(stream->Read(&response));
    EXPECT_TRUE(HasStatus(testing::FromGrpc(stream->Finish()), absl::StatusCode::kNotFound,
                          "no session"));
  }
  EXPECT_TRUE(close(kAliceToken, alices).ok());
  EXPECT_TRUE(close(kBobToken, bobs).ok());
}

// plaintext_unix_sockets (kvrecalld --plaintext_unix_sockets): a TLS server whose unix:PATH
// socket speaks plaintext, for a runner beside it that holds no certificate (the chart's
// co-located runner), while its TCP port keeps TLS. The socket file (0600) admits the server's
// user alone; tokens are still checked there. (Every address was served with the port's TLS
// credentials, so a co-located runner needed a CA, a client certificate and a token.)
class PlaintextUnixSocketTest : public TlsTest {
 protected:
  void SetUp() override {
    TlsTest::SetUp();
    ASSERT_NE(sockets_.path(), "");
  }
  std::string SocketPath() const { return sockets_.Path("kvrecall.sock"); }
  std::string Socket() const { return "unix:" + SocketPath(); }
  const std::string& Tcp() const { return running_->address(); }

  // A server on 127.0.0.1 (port 0) and Socket(), secured as `security` says.
  void StartWithSocket(SecurityOptions security, bool plaintext_unix_sockets = true) {
    ServerOptions options;
    options.address = absl::StrCat("127.0.0.1:0,", Socket());
    options.security = std::move(security);
    options.security.plaintext_unix_sockets = plaintext_unix_sockets;
    absl::StatusOr<std::unique_ptr<RunningServer>> server = StartServer(options);
    ASSERT_TRUE(server.ok()) << server.status();
    running_ = *std::move(server);
  }

  // ListSessions at `address` through the C++ client, its channel secured as `security` says.
  static absl::StatusOr<std::vector<v1::SessionInfo>> ListAt(
      const std::string& address, const client::ChannelSecurity& security) {
    absl::StatusOr<std::unique_ptr<client::Client>> c = client::Client::Connect(address, security);
    if (!c.ok()) return c.status();
    return (*c)->ListSessions();
  }

  // A stub at `address` over `credentials`, and a call context that sends "authorization:
  // Bearer `token`" as plain metadata (none for nullptr).
  static std::unique_ptr<v1::KvRecall::Stub> StubAt(
      const std::string& address, const std::shared_ptr<grpc::ChannelCredentials>& credentials) {
    return v1::KvRecall::NewStub(grpc::CreateChannel(address, credentials));
  }
  static void Prepare(grpc::ClientContext* context, const char* token) {
    context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    if (token != nullptr) context->AddMetadata("authorization", absl::StrCat("Bearer ", token));
  }
  static absl::Status RawList(const std::string& address,
                              const std::shared_ptr<grpc::ChannelCredentials>& credentials,
                              const char* token) {
    grpc::ClientContext context;
    Prepare(&context, token);
    v1::ListSessionsResponse response;
    return testing::FromGrpc(
        StubAt(address, credentials)->ListSessions(&context, v1::ListSessionsRequest(), &response));
  }
  // Health/Check at `address` in plaintext: its status, or the call's error.
  static absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus> PlaintextHealth(
      const std::string& address) {
    auto stub = grpc::health::v1::Health::NewStub(
        grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
    grpc::ClientContext context;
    Prepare(&context, nullptr);
    grpc::health::v1::HealthCheckResponse response;
    const grpc::Status s = stub->Check(&context, grpc::health::v1::HealthCheckRequest(), &response);
    if (!s.ok()) return testing::FromGrpc(s);
    return response.status();
  }

  testing::TempDirectory sockets_{"tls-sock"};
  std::unique_ptr<RunningServer> running_;  // before sockets_ goes
};

TEST_F(PlaintextUnixSocketTest, TheSocketSpeaksPlaintextAndTheTcpPortKeepsTls) {
  StartWithSocket(Tls());
  ASSERT_EQ(running_->addresses().size(), 2u);
  EXPECT_EQ(running_->addresses()[1], Socket());
  struct stat st;
  ASSERT_EQ(stat(SocketPath().c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  // The runner: a plaintext client on the socket decodes.
  std::unique_ptr<client::Client> runner = client::Client::Connect(Socket());
  ExpectDecodeMatchesFullAttention(*runner);
  EXPECT_EQ(PlaintextHealth(Socket()).value_or(grpc::health::v1::HealthCheckResponse::UNKNOWN),
            grpc::health::v1::HealthCheckResponse::SERVING);
  // The TCP port: a plaintext client gets no answer, a TLS one does.
  EXPECT_TRUE(RefusedFor(ListAt(Tcp(), {}).status(), kClosedByTheServer));
  EXPECT_TRUE(RefusedFor(PlaintextHealth(Tcp()).status(), kClosedByTheServer));
  absl::StatusOr<std::unique_ptr<client::Client>> tls =
      client::Client::Connect(Tcp(), TrustingCa());
  ASSERT_TRUE(tls.ok()) << tls.status();
  ExpectDecodeMatchesFullAttention(**tls);
  // The socket speaks no TLS: a TLS client's handshake fails there.
  EXPECT_TRUE(RefusedFor(ListAt(Socket(), TrustingCa()).status(), kPlaintextPeer));
}

// Client certificates cannot be checked without TLS: the socket asks for none, the TCP port
// still does.
TEST_F(PlaintextUnixSocketTest, MutualTlsStaysOnTheTcpPort) {
  StartWithSocket(MutualTls());
  EXPECT_TRUE(ListAt(Socket(), {}).ok());
  EXPECT_TRUE(RefusedFor(ListAt(Tcp(), TrustingCa()).status(), kClosedByTheServer));
  client::ChannelSecurity with_cert = TrustingCa();
  with_cert.cert_file = pki().Path("client.pem");
  with_cert.key_file = pki().Path("client.key");
  EXPECT_TRUE(ListAt(Tcp(), with_cert).ok());
}

// A token file applies to the plaintext socket as to the TLS port: a call needs a known token
// (as plain metadata, or through gRPC's local credentials, which carry call credentials over
// a Unix socket), health excepted, and its tenant is the token's on either listener.
TEST_F(PlaintextUnixSocketTest, TokensAreStillRequiredOnTheSocket) {
  StartWithSocket(WithTokens());
  const std::shared_ptr<grpc::ChannelCredentials> plaintext = grpc::InsecureChannelCredentials();
  EXPECT_TRUE(HasStatus(RawList(Socket(), plaintext, nullptr), absl::StatusCode::kUnauthenticated,
                        "requires a bearer token"));
  EXPECT_TRUE(HasStatus(RawList(Socket(), plaintext, "not-a-token-of-this-server"),
                        absl::StatusCode::kUnauthenticated, "unknown bearer token"));
  EXPECT_TRUE(RawList(Socket(), plaintext, kAliceToken).ok());
  const std::shared_ptr<grpc::ChannelCredentials> local_with_token =
      grpc::CompositeChannelCredentials(grpc::experimental::LocalCredentials(UDS),
                                        grpc::AccessTokenCredentials(kAliceToken));
  EXPECT_TRUE(RawList(Socket(), local_with_token, nullptr).ok());
  EXPECT_EQ(PlaintextHealth(Socket()).value_or(grpc::health::v1::HealthCheckResponse::UNKNOWN),
            grpc::health::v1::HealthCheckResponse::SERVING);

  // Alice's session made over the socket is alice's over the TLS port, and not bob's.
  {
    grpc::ClientContext context;
    Prepare(&context, kAliceToken);
    v1::CreateSessionRequest request;
    *request.mutable_geometry() = testing::MakeGeometry(1, 2, 1, 8);
    *request.mutable_policy() = testing::MakePolicy(v1::SELECTOR_FULL);
    request.set_label("made over the socket");
    v1::CreateSessionResponse response;
    const grpc::Status s = StubAt(Socket(), plaintext)->CreateSession(&context, request, &response);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  client::ChannelSecurity alice = TrustingCa();
  alice.token = kAliceToken;
  absl::StatusOr<std::vector<v1::SessionInfo>> alices = ListAt(Tcp(), alice);
  ASSERT_TRUE(alices.ok()) << alices.status();
  ASSERT_EQ(alices->size(), 1u);
  EXPECT_EQ((*alices)[0].label(), "made over the socket");
  client::ChannelSecurity bob = TrustingCa();
  bob.token = kBobToken;
  absl::StatusOr<std::vector<v1::SessionInfo>> bobs = ListAt(Tcp(), bob);
  ASSERT_TRUE(bobs.ok()) << bobs.status();
  EXPECT_TRUE(bobs->empty());
  EXPECT_THAT(running_->metrics().TextFormat(),
              HasSubstr("\nkvrecall_unauthenticated_requests_total 2\n"));
}

// Without the flag, the socket is served with the TCP port's TLS credentials, as before.
TEST_F(PlaintextUnixSocketTest, WithoutTheFlagTheSocketSpeaksTls) {
  StartWithSocket(Tls(), /*plaintext_unix_sockets=*/false);
  EXPECT_TRUE(RefusedFor(ListAt(Socket(), {}).status(), kClosedByTheServer));
  EXPECT_TRUE(RefusedFor(PlaintextHealth(Socket()).status(), kClosedByTheServer));
  // A unix: target's authority is "localhost", which the server's certificate names.
  EXPECT_TRUE(ListAt(Socket(), TrustingCa()).ok());
}

// The flag without TLS (every address is plaintext already: its user expected TLS on the TCP
// ports), without a unix:PATH address (nothing to apply it to), or with a unix-abstract:NAME
// one (no file permissions: plaintext would admit every process of the network namespace) is
// refused before anything listens.
TEST_F(PlaintextUnixSocketTest, NonsensicalCombinationsAreRefusedAtStart) {
  auto start = [](const std::string& address, SecurityOptions security) {
    ServerOptions options;
    options.address = address;
    options.security = std::move(security);
    options.security.plaintext_unix_sockets = true;
    return StartServer(options).status();
  };
  EXPECT_TRUE(HasStatus(start(absl::StrCat("127.0.0.1:0,", Socket()), SecurityOptions()),
                        absl::StatusCode::kInvalidArgument,
                        "--plaintext_unix_sockets needs --tls_cert and --tls_key"));
  EXPECT_TRUE(HasStatus(start("127.0.0.1:0", Tls()), absl::StatusCode::kInvalidArgument,
                        "--plaintext_unix_sockets: --address has no unix:PATH entry"));
  const std::string abstract = absl::StrCat("unix-abstract:kvrecall-tls-test-", getpid());
  EXPECT_TRUE(HasStatus(start(absl::StrCat(Socket(), ",", abstract), Tls()),
                        absl::StatusCode::kInvalidArgument,
                        absl::StrCat("--plaintext_unix_sockets with --address entry '", abstract,
                                     "': the flag serves Unix sockets in plaintext, and an "
                                     "abstract socket has no file permissions")));
  EXPECT_FALSE(std::filesystem::exists(SocketPath()));
}

// kvrecall's own token option over the plaintext socket: ChannelSecurity::token alone to a
// unix:PATH target travels over gRPC's local credentials (plaintext, Unix sockets alone) with
// access-token call credentials. (It implied TLS, whose handshake the plaintext socket fails,
// so a co-located runner had to build its channel by hand.) Any TLS field still means TLS.
TEST_F(PlaintextUnixSocketTest, TheClientsTokenGoesOverTheSocketWithoutTls) {
  StartWithSocket(WithTokens());
  client::ChannelSecurity alice;
  alice.token = kAliceToken;
  absl::StatusOr<std::unique_ptr<client::Client>> runner = client::Client::Connect(Socket(), alice);
  ASSERT_TRUE(runner.ok()) << runner.status();
  ExpectDecodeMatchesFullAttention(**runner);
  // No token, a wrong one, a prefix of a real one: UNAUTHENTICATED on the socket.
  EXPECT_TRUE(HasStatus(ListAt(Socket(), {}).status(), absl::StatusCode::kUnauthenticated,
                        "requires a bearer token"));
  client::ChannelSecurity wrong;
  wrong.token = "not-a-token-of-this-server";
  EXPECT_TRUE(HasStatus(ListAt(Socket(), wrong).status(), absl::StatusCode::kUnauthenticated,
                        "unknown bearer token"));
  wrong.token = std::string(kAliceToken).substr(0, 20);
  EXPECT_EQ(ListAt(Socket(), wrong).status().code(), absl::StatusCode::kUnauthenticated);
  // The token's tenant is alice on either listener: a session made over the socket is hers
  // over the TLS port, not bob's.
  absl::StatusOr<client::SessionHandle> made = (*runner)->CreateSession(
      testing::MakeGeometry(1, 2, 1, 8), testing::MakePolicy(v1::SELECTOR_FULL), "socket");
  ASSERT_TRUE(made.ok()) << made.status();
  client::ChannelSecurity alice_tls = TrustingCa();
  alice_tls.token = kAliceToken;
  absl::StatusOr<std::vector<v1::SessionInfo>> alices = ListAt(Tcp(), alice_tls);
  ASSERT_TRUE(alices.ok()) << alices.status();
  ASSERT_EQ(alices->size(), 1u);
  EXPECT_EQ((*alices)[0].session_id(), made->id);
  client::ChannelSecurity bob;
  bob.token = kBobToken;
  absl::StatusOr<std::vector<v1::SessionInfo>> bobs = ListAt(Socket(), bob);
  ASSERT_TRUE(bobs.ok()) << bobs.status();
  EXPECT_TRUE(bobs->empty());
  // A token alone to the TCP port still means TLS, with the system's roots, which do not
  // trust the suite's CA: no answer. With the CA it is answered.
  EXPECT_TRUE(RefusedFor(ListAt(Tcp(), alice).status(), "certificate verify failed"));
  EXPECT_TRUE(ListAt(Tcp(), alice_tls).ok());
  // A TLS field with the token asks for TLS on the socket too, whose handshake it fails there.
  EXPECT_TRUE(RefusedFor(ListAt(Socket(), alice_tls).status(), kPlaintextPeer));
  EXPECT_THAT(running_->metrics().TextFormat(),
              HasSubstr("\nkvrecall_unauthenticated_requests_total 3\n"));
}

// A token alone goes in plaintext only to a socket of this user's (review 4: local credentials
// authenticate no server, so it went to whatever listened at the path, another user's process
// in a shared /tmp): not to a path that is no socket, a link to the real one, or (as root here)
// a socket another user owns. Refused before any channel is made, by code and message.
TEST_F(PlaintextUnixSocketTest, ATokenAloneGoesOnlyToASocketOfThisUsers) {
  StartWithSocket(WithTokens());
  client::ChannelSecurity alice;
  alice.token = kAliceToken;
  const std::string dir = std::filesystem::path(SocketPath()).parent_path();
  auto refused = [&](const std::string& path, const std::string& why) {
    const std::string message = absl::StrCat(
        "a bearer token goes in plaintext only to a Unix socket of this user's: ", path, " ", why);
    EXPECT_TRUE(HasStatus(client::Client::Connect("unix:" + path, alice).status(),
                          absl::StatusCode::kFailedPrecondition, message));
  };
  refused(dir + "/absent.sock", "cannot be read (No such file or directory)");
  const std::string link = dir + "/link.sock";
  std::filesystem::create_symlink(SocketPath(), link);
  refused(link, "is not a socket");
  ASSERT_TRUE(client::Client::Connect(Socket(), alice).ok()) << "the socket itself is this user's";
  if (geteuid() == 0) {
    ASSERT_EQ(chown(SocketPath().c_str(), 65534, 65534), 0) << std::strerror(errno);
    refused(SocketPath(), "belongs to uid 65534, this process is uid 0");
    ASSERT_EQ(chown(SocketPath().c_str(), 0, 0), 0);
  }
  // With a TLS field the caller asked for TLS: no check (the handshake authenticates).
  client::ChannelSecurity over_tls = TrustingCa();
  over_tls.token = kAliceToken;
  EXPECT_TRUE(client::Client::Connect("unix:" + link, over_tls).ok());
}

// A token alone to an abstract socket is refused before any channel is made: kvrecalld never
// serves one in plaintext (no file permissions), and a silent plaintext token is what the
// caller would not expect. With a TLS field it goes over TLS, as to any target.
TEST_F(TlsTest, ATokenAloneToAnAbstractSocketIsRefused) {
  client::ChannelSecurity alice;
  alice.token = kAliceToken;
  const std::string abstract = "unix-abstract:kvrecall-token-test";
  const std::string message = absl::StrCat("a bearer token to ", abstract, " without TLS");
  EXPECT_TRUE(HasStatus(client::MakeChannelCredentials(alice, abstract).status(),
                        absl::StatusCode::kInvalidArgument, message));
  EXPECT_TRUE(HasStatus(client::Client::Connect(abstract, alice).status(),
                        absl::StatusCode::kInvalidArgument, message));
  client::ChannelSecurity over_tls = TrustingCa();
  over_tls.token = kAliceToken;
  EXPECT_TRUE(client::MakeChannelCredentials(over_tls, abstract).ok());
  over_tls = alice;
  over_tls.tls = true;
  EXPECT_TRUE(client::Client::Connect(abstract, over_tls).ok());
  // Without a token an abstract socket is plaintext as before, and no target refuses one.
  EXPECT_TRUE(client::Client::Connect(abstract, client::ChannelSecurity()).ok());
  EXPECT_TRUE(client::MakeChannelCredentials(alice).ok());
}

// A token alone to HOST:PORT is never sent in plaintext: the client speaks TLS (system roots),
// so a plaintext server gets a handshake it cannot answer, and no call.
TEST_F(TlsTest, ATokenAloneToHostPortGoesOverTls) {
  Start(SecurityOptions());  // plaintext
  EXPECT_TRUE(List({}).ok());
  client::ChannelSecurity alice;
  alice.token = kAliceToken;
  EXPECT_TRUE(RefusedFor(List(alice).status(), kPlaintextPeer));
  // What goes on the wire: a listener of the test's own reads the client's first bytes, a TLS
  // handshake record (0x16 0x03 ...), never HTTP/2's preface or the token.
  const int listener = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(listener, 0);
  sockaddr_in address = {};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof address;
  ASSERT_EQ(bind(listener, reinterpret_cast<sockaddr*>(&address), sizeof address), 0);
  ASSERT_EQ(listen(listener, 1), 0);
  ASSERT_EQ(getsockname(listener, reinterpret_cast<sockaddr*>(&address), &length), 0);
  const timeval five_seconds = {.tv_sec = 5, .tv_usec = 0};
  setsockopt(listener, SOL_SOCKET, SO_RCVTIMEO, &five_seconds, sizeof five_seconds);
  std::thread caller([&] {
    absl::StatusOr<std::unique_ptr<client::Client>> c =
        client::Client::Connect(absl::StrCat("127.0.0.1:", ntohs(address.sin_port)), alice);
    if (c.ok()) (void)(*c)->ListSessions();  // fails once the listener closes the connection
  });
  std::string received;
  const int connection = accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
  if (connection >= 0) {
    setsockopt(connection, SOL_SOCKET, SO_RCVTIMEO, &five_seconds, sizeof five_seconds);
    char buffer[4096];
    const ssize_t n = read(connection, buffer, sizeof buffer);
    if (n > 0) received.assign(buffer, n);
    close(connection);
  }
  close(listener);
  caller.join();
  ASSERT_GE(received.size(), 3u) << "the client sent nothing";
  EXPECT_EQ(received[0], '\x16') << "not a TLS handshake record";
  EXPECT_EQ(received[1], '\x03');
  EXPECT_EQ(received.find("PRI * HTTP/2.0"), std::string::npos);
  EXPECT_EQ(received.find(kAliceToken), std::string::npos);
}

// A token a header cannot carry (a newline: a token file read whole; a non-ASCII character)
// failed every call as UNAVAILABLE "Illegal metadata", a code a runner retries (probe 20, 11);
// a key given as the CA failed as a server that never answered.
TEST_F(TlsTest, ATokenOrPemFileTheChannelCannotUseIsRefusedAtOnce) {
  for (const auto& [token, message] : std::vector<std::pair<std::string, std::string>>{
           {std::string(kAliceToken) + "\n", "is not printable ASCII"},
           {"tok\xc3\xa9-0123456789abcdef", "token: character 4 of 22 is not printable ASCII"},
           {"two words", "token: character 4 of 9"}}) {
    client::ChannelSecurity security = TrustingCa();
    security.token = token;
    EXPECT_TRUE(HasStatus(client::MakeChannelCredentials(security, "127.0.0.1:1").status(),
                          absl::StatusCode::kInvalidArgument, message))
        << token;
    security = client::ChannelSecurity();
    security.token = token;  // a token alone to a socket, checked before the socket is
    EXPECT_TRUE(HasStatus(client::MakeChannelCredentials(security, "unix:/nonexistent").status(),
                          absl::StatusCode::kInvalidArgument, message))
        << token;
  }
  client::ChannelSecurity key_as_ca;
  key_as_ca.ca_file = pki().Path("server.key");
  EXPECT_TRUE(HasStatus(client::MakeChannelCredentials(key_as_ca, "127.0.0.1:1").status(),
                        absl::StatusCode::kInvalidArgument,
                        "ca_file: " + pki().Path("server.key") + " holds no PEM CERTIFICATE"));
  client::ChannelSecurity cert_as_key = TrustingCa();
  cert_as_key.cert_file = pki().Path("client.pem");
  cert_as_key.key_file = pki().Path("client.pem");
  EXPECT_TRUE(HasStatus(client::MakeChannelCredentials(cert_as_key, "127.0.0.1:1").status(),
                        absl::StatusCode::kInvalidArgument,
                        "key_file: " + pki().Path("client.pem") + " holds no PEM PRIVATE KEY"));
}

TEST(ReadTokenFileTest, ReadsTheFirstLineAndNamesTheFileWhenItCannot) {
  testing::TempDirectory dir("token-file");
  ASSERT_NE(dir.path(), "");
  // The first line without the whitespace around it, however the file ends.
  const std::vector<std::pair<const char*, const char*>> files = {
      {"newline", "tok-0123456789abcdef\n"},
      {"bare", "tok-0123456789abcdef"},
      {"crlf", "tok-0123456789abcdef\r\n"},
      {"padded", "  tok-0123456789abcdef \nsecond line\n"}};
  for (const auto& [name, text] : files) {
    WriteFile(dir.Path(name), text);
    absl::StatusOr<std::string> token = client::ReadTokenFile(dir.Path(name));
    ASSERT_TRUE(token.ok()) << name << ": " << token.status();
    EXPECT_EQ(*token, "tok-0123456789abcdef") << name;
  }
  WriteFile(dir.Path("empty"), "");
  EXPECT_TRUE(HasStatus(client::ReadTokenFile(dir.Path("empty")).status(),
                        absl::StatusCode::kInvalidArgument, dir.Path("empty") + " is empty"));
  WriteFile(dir.Path("blank"), " \ntok-0123456789abcdef\n");
  EXPECT_TRUE(HasStatus(client::ReadTokenFile(dir.Path("blank")).status(),
                        absl::StatusCode::kInvalidArgument,
                        dir.Path("blank") + " starts with an empty line"));
  EXPECT_TRUE(HasStatus(client::ReadTokenFile(dir.Path("absent")).status(),
                        absl::StatusCode::kNotFound,
                        "cannot read " + dir.Path("absent") + ": No such file or directory"));
  EXPECT_TRUE(HasStatus(client::ReadTokenFile(dir.path()).status(), absl::StatusCode::kNotFound,
                        "cannot read " + dir.path()));
}

TEST_F(TlsTest, BadSecurityOptionsAreRefusedBeforeListening) {
  auto start = [](const SecurityOptions& security) {
    ServerOptions options;
    options.address = "127.0.0.1:0";
    options.security = security;
    return StartServer(options).status();
  };
  SecurityOptions tokens_in_plaintext;
  tokens_in_plaintext.auth_token_file = pki().Path("tokens");
  EXPECT_TRUE(HasStatus(start(tokens_in_plaintext), absl::StatusCode::kInvalidArgument,
                        "--auth_token_file needs --tls_cert and --tls_key"));
  SecurityOptions cert_only = Tls();
  cert_only.tls_key_file.clear();
  EXPECT_TRUE(HasStatus(start(cert_only), absl::StatusCode::kInvalidArgument,
                        "--tls_cert and --tls_key go together"));
  SecurityOptions ca_only;
  ca_only.tls_client_ca_file = pki().Path("ca.pem");
  EXPECT_TRUE(HasStatus(start(ca_only), absl::StatusCode::kInvalidArgument,
                        "--tls_client_ca (mutual TLS) needs --tls_cert"));
  SecurityOptions missing = Tls();
  missing.tls_cert_file = pki().Path("absent.pem");
  EXPECT_TRUE(HasStatus(start(missing), absl::StatusCode::kNotFound, "--tls_cert: cannot read"));
  SecurityOptions not_a_key = Tls();
  not_a_key.tls_key_file = pki().Path("not-pem");
  EXPECT_TRUE(HasStatus(start(not_a_key), absl::StatusCode::kInvalidArgument,
                        "holds no PEM PRIVATE KEY block"));
  SecurityOptions encrypted = Tls();  // failed later, as an address that could not be listened on
  encrypted.tls_key_file = pki().Path("encrypted.key");
  WriteFile(encrypted.tls_key_file,
            "-----BEGIN ENCRYPTED PRIVATE KEY-----\nMIIFHDBOBgkqhkiG9w0BBQ0wQTApBgkqhkiG9w0B\n"
            "-----END ENCRYPTED PRIVATE KEY-----\n");
  EXPECT_TRUE(HasStatus(start(encrypted), absl::StatusCode::kInvalidArgument,
                        "encrypted.key is encrypted, which kvrecalld cannot use"));
  // Files with the right PEM markers that gRPC would take and then fail to listen with, blaming
  // no file (probe 20, 7): each is refused naming its flag and what is wrong.
  SecurityOptions mismatched = Tls();
  mismatched.tls_key_file = pki().Path("client.key");
  EXPECT_TRUE(HasStatus(start(mismatched), absl::StatusCode::kInvalidArgument,
                        "--tls_key: " + pki().Path("client.key") +
                            " is not the key of --tls_cert's certificate"));
  const std::string garbled_block = "-----BEGIN CERTIFICATE-----\nnot base64 at all\n"
                                    "-----END CERTIFICATE-----\n";
  WriteFile(pki().Path("garbled.pem"), garbled_block);
  SecurityOptions garbled_cert = Tls();
  garbled_cert.tls_cert_file = pki().Path("garbled.pem");
  EXPECT_TRUE(HasStatus(start(garbled_cert), absl::StatusCode::kInvalidArgument,
                        "--tls_cert: " + pki().Path("garbled.pem") +
                            ": certificate 1 does not parse"));
  WriteFile(pki().Path("garbled.key"),
            "-----BEGIN PRIVATE KEY-----\nnot base64 at all\n-----END PRIVATE KEY-----\n");
  SecurityOptions garbled_key = Tls();
  garbled_key.tls_key_file = pki().Path("garbled.key");
  EXPECT_TRUE(HasStatus(start(garbled_key), absl::StatusCode::kInvalidArgument,
                        "--tls_key: " + pki().Path("garbled.key") +
                            ": the private key does not parse"));
  // A CA file whose second certificate is garbled: the first alone would have been trusted.
  WriteFile(pki().Path("half-ca.pem"), ReadFile(pki().Path("ca.pem")) + garbled_block);
  SecurityOptions garbled_ca = MutualTls();
  garbled_ca.tls_client_ca_file = pki().Path("half-ca.pem");
  EXPECT_TRUE(HasStatus(start(garbled_ca), absl::StatusCode::kInvalidArgument,
                        "--tls_client_ca: " + pki().Path("half-ca.pem") +
                            ": certificate 2 does not parse"));
  // A garbled "TRUSTED CERTIFICATE" block is a certificate that does not parse; a valid one
  // (openssl x509 -trustout), which gRPC reads, is served (review 20b: it was refused).
  WriteFile(pki().Path("trusted.pem"),
            "-----BEGIN TRUSTED CERTIFICATE-----\nAAAA\n-----END TRUSTED CERTIFICATE-----\n");
  SecurityOptions trusted_garbled = Tls();
  trusted_garbled.tls_cert_file = pki().Path("trusted.pem");
  EXPECT_TRUE(HasStatus(start(trusted_garbled), absl::StatusCode::kInvalidArgument,
                        "certificate 1 does not parse"));
  SecurityOptions trusted_ca = MutualTls();
  trusted_ca.tls_client_ca_file = pki().Path("ca-trusted.pem");
  EXPECT_TRUE(start(trusted_ca).ok());
  WriteFile(pki().Path("bad-tokens"), "short alice\n");
  SecurityOptions bad_tokens = WithTokens();
  bad_tokens.auth_token_file = pki().Path("bad-tokens");
  EXPECT_TRUE(HasStatus(start(bad_tokens), absl::StatusCode::kInvalidArgument,
                        "--auth_token_file: " + pki().Path("bad-tokens") + ":1: token is 5"));
}

// ---------------------------------------------------------------------------------------------
// The metrics endpoint over TLS (--metrics_tls_cert, --metrics_tls_key, --metrics_tls_client_ca).

// A TCP connection to 127.0.0.1:`port` (testing::ConnectToLoopback's) with a 5 s receive
// timeout, or -1.
int ConnectLoopback(int port, int receive_buffer = 0) {
  const int s = testing::ConnectToLoopback(port, receive_buffer);
  if (s < 0) return -1;
  timeval timeout = {5, 0};
  setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
  return s;
}

// What an HTTPS exchange with the endpoint came to: whether the handshake (the server's
// certificate checked against the CA for 127.0.0.1) completed, the response read until the
// endpoint closed, and OpenSSL's reason where the handshake or a read failed.
struct HttpsExchange {
  bool handshake = false;
  std::string response;
  std::string error;
  bool resumed = false;  // the handshake resumed the session offered
};
// How the client side of Https behaves.
struct HttpsClient {
  std::string ca_file;
  std::string cert_file;  // with key_file: the client certificate (mutual TLS)
  std::string key_file;
  int max_version = 0;                 // e.g. TLS1_2_VERSION; 0: the library's highest
  SSL_SESSION** session = nullptr;     // offered to resume when set; the new one kept there
  int receive_buffer = 0;              // SO_RCVBUF before connecting; 0: the system's
  absl::Duration read_after = absl::ZeroDuration();  // before reading the response
};
HttpsExchange Https(int port, const HttpsClient& client, const std::string& request) {
  HttpsExchange result;
  std::unique_ptr<SSL_CTX, decltype(&SSL_CTX_free)> context(SSL_CTX_new(TLS_client_method()),
                                                            &SSL_CTX_free);
  SSL_CTX_load_verify_locations(context.get(), client.ca_file.c_str(), nullptr);
  SSL_CTX_set_verify(context.get(), SSL_VERIFY_PEER, nullptr);
  if (client.max_version != 0) SSL_CTX_set_max_proto_version(context.get(), client.max_version);
  if (!client.cert_file.empty()) {
    SSL_CTX_use_certificate_chain_file(context.get(), client.cert_file.c_str());
    SSL_CTX_use_PrivateKey_file(context.get(), client.key_file.c_str(), SSL_FILETYPE_PEM);
  }
  const int s = ConnectLoopback(port, client.receive_buffer);
  if (s < 0) return result;
  std::unique_ptr<SSL, decltype(&SSL_free)> ssl(SSL_new(context.get()), &SSL_free);
  SSL_set_fd(ssl.get(), s);
  X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(ssl.get()), "127.0.0.1");
  if (client.session != nullptr && *client.session != nullptr) {
    SSL_set_session(ssl.get(), *client.session);
  }
  if (SSL_connect(ssl.get()) == 1) {
    result.handshake = true;
    result.resumed = SSL_session_reused(ssl.get()) == 1;
    SSL_write(ssl.get(), request.data(), static_cast<int>(request.size()));
    absl::SleepFor(client.read_after);
    char buffer[4096];
    size_t n = 0;
    int read;
    while ((read = SSL_read_ex(ssl.get(), buffer, sizeof buffer, &n)) == 1) {
      result.response.append(buffer, n);
    }
    if (SSL_get_error(ssl.get(), read) == SSL_ERROR_SSL) result.error = OpenSslReason();
    if (client.session != nullptr) {
      SSL_SESSION_free(*client.session);
      *client.session = SSL_get1_session(ssl.get());
    }
  } else {
    result.error = OpenSslReason();
  }
  ERR_clear_error();
  close(s);
  return result;
}

// `request` sent in plaintext over a fresh connection: what came back until the endpoint closed.
std::string Plaintext(int port, const std::string& request) {
  const int s = ConnectLoopback(port);
  if (s < 0) return "";
  send(s, request.data(), request.size(), MSG_NOSIGNAL);
  std::string reply;
  char buffer[4096];
  for (ssize_t n; (n = read(s, buffer, sizeof buffer)) > 0;) reply.append(buffer, n);
  close(s);
  return reply;
}

constexpr char kScrape[] = "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n";

class MetricsTlsTest : public TlsTest {
 protected:
  // The endpoint on a free loopback port with the suite's server certificate (and, with
  // `client_ca`, mutual TLS) and the scraper token "scraper-token-0123456789".
  std::unique_ptr<MetricsEndpoint> StartEndpoint(const std::string& client_ca = "") {
    return StartEndpoint({.cert_file = pki().Path("server.pem"),
                          .key_file = pki().Path("server.key"),
                          .client_ca_file = client_ca});
  }
  std::unique_ptr<MetricsEndpoint> StartEndpoint(const MetricsTlsFiles& files) {
    absl::StatusOr<TokenTable> table =
        TokenTable::Parse("scraper-token-0123456789\n", "tokens", "scraper");
    EXPECT_TRUE(table.ok()) << table.status();
    if (!table.ok()) return nullptr;
    absl::StatusOr<std::unique_ptr<MetricsEndpoint>> endpoint = MetricsEndpoint::Start(
        "127.0.0.1:0", metrics_,
        std::make_shared<TokenStore>(std::make_shared<const TokenTable>(*table)), &files);
    EXPECT_TRUE(endpoint.ok()) << endpoint.status();
    return endpoint.ok() ? *std::move(endpoint) : nullptr;
  }
  static std::string WithToken() {
    return absl::StrCat(kScrape, "Authorization: Bearer scraper-token-0123456789\r\n\r\n");
  }
  HttpsClient Trusting() const { return {.ca_file = pki().Path("ca.pem")}; }
  HttpsClient WithCertificate(const char* name) const {
    HttpsClient c = Trusting();
    c.cert_file = pki().Path(absl::StrCat(name, ".pem"));
    c.key_file = pki().Path(absl::StrCat(name, ".key"));
    return c;
  }
  // The endpoint's refusals for `reason` once they reach `want` (a refused handshake is counted
  // as the endpoint closes its connection, just after its peer saw the alert), or after 2 s.
  double RefusedReaching(const char* reason, double want) const {
    testing::Eventually([&] { return Refused(reason) >= want; }, std::chrono::seconds(2));
    return Refused(reason);
  }
  // The endpoint's refusals for `reason`, as its metrics say.
  double Refused(const char* reason) const {
    const std::string text = metrics_->TextFormat();
    const std::string series =
        absl::StrCat("kvrecall_metrics_scrapes_refused_total{reason=\"", reason, "\"} ");
    const size_t at = text.find(series);
    return at == std::string::npos ? -1 : std::stod(text.substr(at + series.size()));
  }

  std::shared_ptr<ServerMetrics> metrics_ = std::make_shared<ServerMetrics>();
};

// A scrape over TLS reads the whole text (larger than a TLS record: the endpoint's partial
// writes) with the token, 401 without; plaintext HTTP gets a 400 naming the scheme, a client
// that does not trust the CA nothing; each refusal is counted.
TEST_F(MetricsTlsTest, ServesHttpsAndAnswersNothingOutsideTls) {
  std::unique_ptr<MetricsEndpoint> endpoint = StartEndpoint();
  ASSERT_NE(endpoint, nullptr);
  EXPECT_STREQ(endpoint->scheme(), "https");
  const int port = endpoint->port();
  HttpsExchange ok = Https(port, Trusting(), WithToken());
  ASSERT_TRUE(ok.handshake) << ok.error;
  EXPECT_THAT(ok.response, ::testing::StartsWith("HTTP/1.1 200 OK\r\n"));
  EXPECT_THAT(ok.response, HasSubstr("# TYPE kvrecall_sessions_open gauge"));
  const size_t body = ok.response.find("\r\n\r\n") + 4;
  EXPECT_THAT(ok.response, HasSubstr(absl::StrCat("Content-Length: ", ok.response.size() - body,
                                                  "\r\n")));
  EXPECT_GT(ok.response.size(), 16384u) << "one TLS record: the partial writes were not tried";
  EXPECT_EQ(ok.error, "");  // the close_notify came: no truncation
  HttpsExchange no_token = Https(port, Trusting(), absl::StrCat(kScrape, "\r\n"));
  ASSERT_TRUE(no_token.handshake) << no_token.error;
  EXPECT_THAT(no_token.response, ::testing::StartsWith("HTTP/1.1 401 Unauthorized\r\n"));
  EXPECT_THAT(no_token.response, Not(HasSubstr("kvrecall_")));
  EXPECT_EQ(Refused("unauthorized"), 1);

  // Plain HTTP (a scraper or curl told http://) is told the scheme, and nothing else.
  const std::string plain = Plaintext(port, WithToken());
  EXPECT_THAT(plain, ::testing::StartsWith("HTTP/1.1 400 Bad Request\r\n"));
  EXPECT_THAT(plain,
              HasSubstr("this endpoint speaks HTTPS: use https:// with this host and port\n"));
  EXPECT_THAT(plain, Not(HasSubstr("kvrecall_")));
  EXPECT_EQ(Refused("plain_http"), 1);
  EXPECT_EQ(Refused("tls_handshake"), 0);
  HttpsExchange untrusted = Https(port, {.ca_file = pki().Path("wrong-ca.pem")}, WithToken());
  EXPECT_FALSE(untrusted.handshake);
  EXPECT_THAT(untrusted.error, HasSubstr("certificate verify failed"));
  EXPECT_EQ(untrusted.response, "");
  // The endpoint still serves after each, and counted the failed handshake once it closed it.
  EXPECT_THAT(Https(port, Trusting(), WithToken()).response,
              ::testing::StartsWith("HTTP/1.1 200 OK"));
  EXPECT_EQ(RefusedReaching("tls_handshake", 1), 1);
}

// A scraper that reads slowly through a small window makes the endpoint's TLS writes wait for
// the socket (WANT_WRITE): a response of hundreds of records still arrives whole.
TEST_F(MetricsTlsTest, ASlowReaderGetsTheWholeResponse) {
  for (int i = 0; i < 3000; ++i) metrics_->CountRefusal(absl::StrCat("a_limit_of_this_test_", i));
  std::unique_ptr<MetricsEndpoint> endpoint = StartEndpoint();
  ASSERT_NE(endpoint, nullptr);
  HttpsClient slow = Trusting();
  slow.receive_buffer = 4096;
  slow.read_after = absl::Milliseconds(300);
  HttpsExchange read = Https(endpoint->port(), slow, WithToken());
  ASSERT_TRUE(read.handshake) << read.error;
  EXPECT_EQ(read.error, "");
  EXPECT_GT(read.response.size(), 200000u);
  const size_t body = read.response.find("\r\n\r\n") + 4;
  EXPECT_THAT(read.response, HasSubstr(absl::StrCat("Content-Length: ",
                                                    read.response.size() - body, "\r\n")));
  EXPECT_THAT(read.response, HasSubstr("limit=\"a_limit_of_this_test_2999\""));
}

// A peer that starts a handshake and stalls is cut at the connection's deadline, and scrapes
// are answered meanwhile; the endpoint's destruction does not wait for such peers.
TEST_F(MetricsTlsTest, AStalledHandshakeIsCutAtTheDeadline) {
  std::unique_ptr<MetricsEndpoint> endpoint = StartEndpoint();
  ASSERT_NE(endpoint, nullptr);
  const int port = endpoint->port();
  std::vector<int> stalled;
  // A TLS record header announcing a handshake message, then nothing.
  const char partial_hello[] = {0x16, 0x03, 0x01, 0x02, 0x00, 0x01};
  for (int i = 0; i < 4; ++i) {
    stalled.push_back(ConnectLoopback(port));
    ASSERT_GE(stalled.back(), 0);
    ASSERT_EQ(send(stalled.back(), partial_hello, sizeof partial_hello, MSG_NOSIGNAL),
              static_cast<ssize_t>(sizeof partial_hello));
  }
  const absl::Time started = absl::Now();
  EXPECT_THAT(Https(port, Trusting(), WithToken()).response,
              ::testing::StartsWith("HTTP/1.1 200 OK"));
  EXPECT_LT(absl::Now() - started, absl::Milliseconds(1500));
  for (int s : stalled) {
    char byte;
    EXPECT_LE(read(s, &byte, 1), 0);  // closed by the endpoint (5 s timeout: -1, EAGAIN)
  }
  EXPECT_LT(absl::Now() - started, MetricsEndpoint::kConnectionDeadline + absl::Seconds(2));
  for (int s : stalled) close(s);
  stalled.clear();
  for (int i = 0; i < 4; ++i) {
    stalled.push_back(ConnectLoopback(port));
    send(stalled.back(), partial_hello, 3, MSG_NOSIGNAL);
  }
  const absl::Time destroy = absl::Now();
  endpoint.reset();
  EXPECT_LT(absl::Now() - destroy, absl::Seconds(1));
  for (int s : stalled) close(s);
}

// With a client CA, a scraper must present a certificate those roots signed; one that offers
// to resume its last session (curl's second URL, a proxy's pool) is served as a new one.
TEST_F(MetricsTlsTest, MutualTlsNeedsAScraperCertificateFromTheClientCa) {
  std::unique_ptr<MetricsEndpoint> endpoint = StartEndpoint(pki().Path("ca.pem"));
  ASSERT_NE(endpoint, nullptr);
  const int port = endpoint->port();
  HttpsExchange with_cert = Https(port, WithCertificate("client"), WithToken());
  ASSERT_TRUE(with_cert.handshake) << with_cert.error;
  EXPECT_THAT(with_cert.response, ::testing::StartsWith("HTTP/1.1 200 OK\r\n"));
  // TLS 1.3: the client's handshake ends before the server has checked its certificate; the
  // refusal comes as an alert instead of the response.
  HttpsExchange without = Https(port, Trusting(), WithToken());
  EXPECT_EQ(without.response, "");
  EXPECT_THAT(without.error, HasSubstr("alert certificate required"));
  HttpsExchange stranger = Https(port, WithCertificate("stranger"), WithToken());
  EXPECT_EQ(stranger.response, "");
  EXPECT_THAT(stranger.error, HasSubstr("alert unknown ca"));
  EXPECT_EQ(RefusedReaching("tls_handshake", 2), 2);
  for (const int version : {TLS1_2_VERSION, TLS1_3_VERSION}) {
    SSL_SESSION* session = nullptr;
    HttpsClient resuming = WithCertificate("client");
    resuming.max_version = version;
    resuming.session = &session;
    for (int i = 0; i < 3; ++i) {
      const HttpsExchange again = Https(port, resuming, WithToken());
      EXPECT_TRUE(again.handshake) << version << " " << again.error;
      EXPECT_THAT(again.response, ::testing::StartsWith("HTTP/1.1 200 OK")) << version << " " << i;
      EXPECT_FALSE(again.resumed) << version;
    }
    SSL_SESSION_free(session);
  }
  EXPECT_EQ(Refused("tls_handshake"), 2);
}

TEST_F(MetricsTlsTest, BadMetricsTlsOptionsAreRefusedBeforeListening) {
  auto start = [](const std::function<void(ServerOptions&)>& set) {
    ServerOptions options;
    options.address = "127.0.0.1:0";
    options.metrics_address = "127.0.0.1:0";
    set(options);
    return StartServer(options).status();
  };
  const std::string cert = pki().Path("server.pem");
  const std::string key = pki().Path("server.key");
  EXPECT_TRUE(HasStatus(start([&](ServerOptions& o) { o.metrics_tls_cert_file = cert; }),
                        absl::StatusCode::kInvalidArgument,
                        "--metrics_tls_cert and --metrics_tls_key go together"));
  EXPECT_TRUE(HasStatus(start([&](ServerOptions& o) { o.metrics_tls_key_file = key; }),
                        absl::StatusCode::kInvalidArgument,
                        "--metrics_tls_cert and --metrics_tls_key go together"));
  EXPECT_TRUE(HasStatus(
      start([&](ServerOptions& o) { o.metrics_tls_client_ca_file = pki().Path("ca.pem"); }),
      absl::StatusCode::kInvalidArgument,
      "--metrics_tls_client_ca (mutual TLS) needs --metrics_tls_cert and --metrics_tls_key"));
  EXPECT_TRUE(HasStatus(start([&](ServerOptions& o) {
                          o.metrics_address.clear();
                          o.metrics_tls_cert_file = cert;
                          o.metrics_tls_key_file = key;
                        }),
                        absl::StatusCode::kInvalidArgument,
                        "--metrics_tls_cert and --metrics_tls_key need a metrics endpoint"));
  EXPECT_TRUE(HasStatus(start([&](ServerOptions& o) {
                          o.metrics_tls_cert_file = pki().Path("absent.pem");
                          o.metrics_tls_key_file = key;
                        }),
                        absl::StatusCode::kNotFound, "--metrics_tls_cert: cannot read"));
  EXPECT_TRUE(HasStatus(start([&](ServerOptions& o) {
                          o.metrics_tls_cert_file = cert;
                          o.metrics_tls_key_file = pki().Path("client.key");
                        }),
                        absl::StatusCode::kInvalidArgument,
                        "--metrics_tls_key: " + pki().Path("client.key") +
                            " is not the key of --metrics_tls_cert's certificate"));
  EXPECT_TRUE(HasStatus(start([&](ServerOptions& o) {
                          o.metrics_tls_cert_file = cert;
                          o.metrics_tls_key_file = key;
                          o.metrics_tls_client_ca_file = pki().Path("not-pem");
                        }),
                        absl::StatusCode::kInvalidArgument,
                        "--metrics_tls_client_ca: " + pki().Path("not-pem") +
                            " holds no PEM CERTIFICATE block"));
  // The gRPC port's TLS does not make the metrics HTTPS, nor does the metrics' need it.
  absl::StatusOr<std::unique_ptr<RunningServer>> both = StartServer([&] {
    ServerOptions o;
    o.address = "127.0.0.1:0";
    o.metrics_address = "127.0.0.1:0";
    o.metrics_tls_cert_file = cert;
    o.metrics_tls_key_file = key;
    return o;
  }());
  ASSERT_TRUE(both.ok()) << both.status();
  EXPECT_THAT((*both)->metrics_url(),
              ::testing::MatchesRegex("https://127\\.0\\.0\\.1:[0-9]+/metrics"));
  both->reset();
  absl::StatusOr<std::unique_ptr<RunningServer>> grpc_tls_only = StartServer([&] {
    ServerOptions o;
    o.address = "127.0.0.1:0";
    o.metrics_address = "127.0.0.1:0";
    o.security = Tls();
    return o;
  }());
  ASSERT_TRUE(grpc_tls_only.ok()) << grpc_tls_only.status();
  EXPECT_THAT((*grpc_tls_only)->metrics_url(),
              ::testing::MatchesRegex("http://127\\.0\\.0\\.1:[0-9]+/metrics"));
}

// The endpoint reads its files again every refresh: a whole new pair serves the connections
// accepted after; half a rotation (the certificate without its key), or a file that vanished,
// keeps the pair in force.
TEST_F(MetricsTlsTest, ARotatedCertificateServesTheNextScrapes) {
  testing::TempDirectory dir("metrics-rotation");
  const std::string cert = dir.Path("tls.crt");
  const std::string key = dir.Path("tls.key");
  PutPkiFile("server.pem", cert);
  PutPkiFile("server.key", key);
  std::unique_ptr<MetricsEndpoint> endpoint = StartEndpoint(
      {.cert_file = cert, .key_file = key, .refresh = absl::Milliseconds(200)});
  ASSERT_NE(endpoint, nullptr);
  const int port = endpoint->port();
  auto served_to = [&](const char* ca) {
    return absl::StartsWith(Https(port, {.ca_file = pki().Path(ca)}, WithToken()).response,
                            "HTTP/1.1 200 OK");
  };
  ASSERT_TRUE(served_to("ca.pem"));
  auto usable = [&] {
    return absl::StrContains(metrics_->TextFormat(),
                             "kvrecall_tls_files_usable{port=\"metrics\"} 1");
  };
  EXPECT_TRUE(usable());
  PutPkiFile("server-next.pem", cert);  // the certificate without its key
  absl::SleepFor(absl::Milliseconds(800));
  EXPECT_TRUE(served_to("ca.pem")) << "half a rotation was taken";
  EXPECT_FALSE(usable());
  EXPECT_FALSE(served_to("wrong-ca.pem"));
  PutPkiFile("server-next.key", key);
  testing::Eventually([&] { return served_to("wrong-ca.pem"); }, std::chrono::seconds(5));
  EXPECT_TRUE(served_to("wrong-ca.pem"));
  EXPECT_FALSE(served_to("ca.pem"));
  EXPECT_TRUE(usable());
  ASSERT_EQ(std::remove(key.c_str()), 0);  // a file gone keeps the pair too
  absl::SleepFor(absl::Milliseconds(800));
  EXPECT_TRUE(served_to("wrong-ca.pem"));
}

// ReadTlsFiles (kvrecalld's SIGHUP) reads the files at once, with no period: a whole new pair
// serves the next scrapes; half a rotation is refused by flag, the pair in force kept.
TEST_F(MetricsTlsTest, ReadingTheFilesNowTakesARotationWithoutAPeriod) {
  testing::TempDirectory dir("metrics-read-now");
  const std::string cert = dir.Path("tls.crt");
  const std::string key = dir.Path("tls.key");
  PutPkiFile("server.pem", cert);
  PutPkiFile("server.key", key);
  std::unique_ptr<MetricsEndpoint> endpoint = StartEndpoint({.cert_file = cert, .key_file = key});
  ASSERT_NE(endpoint, nullptr);
  auto served_to = [&](const char* ca) {
    return absl::StartsWith(
        Https(endpoint->port(), {.ca_file = pki().Path(ca)}, WithToken()).response,
        "HTTP/1.1 200 OK");
  };
  ASSERT_TRUE(served_to("ca.pem"));
  auto expires = [&] {
    return static_cast<int64_t>(Series(
        metrics_->TextFormat(),
        "kvrecall_tls_certificate_expiration_timestamp_seconds{port=\"metrics\"}"));
  };
  EXPECT_GT(NotAfter("server.pem"), 0);
  EXPECT_EQ(expires(), NotAfter("server.pem"));
  absl::StatusOr<bool> read = endpoint->ReadTlsFiles();
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_FALSE(*read);
  PutPkiFile("server-next.pem", cert);  // the certificate without its key
  EXPECT_TRUE(HasStatus(endpoint->ReadTlsFiles().status(), absl::StatusCode::kInvalidArgument,
                        "--metrics_tls_key: " + key));
  EXPECT_TRUE(absl::StrContains(metrics_->TextFormat(),
                                "kvrecall_tls_files_usable{port=\"metrics\"} 0"));
  EXPECT_TRUE(served_to("ca.pem"));
  PutPkiFile("server-next.key", key);
  read = endpoint->ReadTlsFiles();
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_TRUE(*read);
  EXPECT_TRUE(served_to("wrong-ca.pem"));
  EXPECT_FALSE(served_to("ca.pem"));
  EXPECT_TRUE(absl::StrContains(metrics_->TextFormat(),
                                "kvrecall_tls_files_usable{port=\"metrics\"} 1"));
  EXPECT_EQ(expires(), NotAfter("server-next.pem"));
  absl::StatusOr<std::unique_ptr<MetricsEndpoint>> plain =
      MetricsEndpoint::Start("127.0.0.1:0", metrics_);
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_TRUE(HasStatus((*plain)->ReadTlsFiles().status(),
                        absl::StatusCode::kFailedPrecondition,
                        "the metrics endpoint serves plain HTTP: no TLS files"));
}

// What OpenSSL will not serve (here a 1024-bit RSA key under its security level) is refused
// naming the flag and file, on either port (the gRPC port said "address in use or invalid?").
TEST_F(MetricsTlsTest, AKeyOpenSslWillNotServeIsRefusedByName) {
  {
    std::unique_ptr<SSL_CTX, decltype(&SSL_CTX_free)> defaults(SSL_CTX_new(TLS_server_method()),
                                                               &SSL_CTX_free);
    if (SSL_CTX_get_security_level(defaults.get()) < 2) {
      GTEST_SKIP() << "this system's OpenSSL serves 1024-bit RSA keys (security level < 2)";
    }
  }
  const std::string dir = std::filesystem::path(pki().Path("ca.pem")).parent_path();
  CommandResult made = RunCommand(absl::StrCat(
      "cd ", dir, " && openssl req -x509 -newkey rsa:1024 -nodes -keyout weak.key -out weak.pem",
      " -days 2 -subj /CN=weak"));
  ASSERT_EQ(made.exit_code, 0) << made.output;
  const MetricsTlsFiles weak = {.cert_file = pki().Path("weak.pem"),
                                .key_file = pki().Path("weak.key")};
  absl::StatusOr<std::unique_ptr<MetricsEndpoint>> metrics =
      MetricsEndpoint::Start("127.0.0.1:0", metrics_, nullptr, &weak);
  EXPECT_TRUE(HasStatus(metrics.status(), absl::StatusCode::kInvalidArgument,
                        "--metrics_tls_cert: " + pki().Path("weak.pem") +
                            ": OpenSSL will not serve this certificate (ee key too small)"));
  ServerOptions options;
  options.address = "127.0.0.1:0";
  options.security.tls_cert_file = pki().Path("weak.pem");
  options.security.tls_key_file = pki().Path("weak.key");
  EXPECT_TRUE(HasStatus(StartServer(options).status(), absl::StatusCode::kInvalidArgument,
                        "--tls_cert: " + pki().Path("weak.pem") +
                            ": OpenSSL will not serve this certificate"));
}

// What a listener is given of the TLS files is what was checked: the key alone (a key file
// holding certificates too once had gRPC serve those as the chain's first, failing every
// handshake or serving an old certificate), and the chain's end is its first certificate to
// expire.
TEST_F(TlsTest, AKeyFileHoldingCertificatesServesTheCertificateFilesChain) {
  testing::TempDirectory dir("key-bundle");
  const std::string key = dir.Path("bundle.key");
  WriteFile(key, ReadFile(pki().Path("server.key")) + ReadFile(pki().Path("server-next.pem")));
  absl::StatusOr<TlsIdentity> identity = ReadTlsIdentity(pki().Path("server.pem"), key, "", "");
  ASSERT_TRUE(identity.ok()) << identity.status();
  EXPECT_THAT(identity->private_key, HasSubstr("-----BEGIN PRIVATE KEY-----"));
  EXPECT_THAT(identity->private_key, Not(HasSubstr("CERTIFICATE")));
  EXPECT_EQ(identity->not_after, NotAfter("server.pem"));
  SecurityOptions security = Tls();
  security.tls_key_file = key;
  Start(security);
  auto serves_to = [&](const char* ca) {
    client::ChannelSecurity trusting;
    trusting.ca_file = pki().Path(ca);
    absl::StatusOr<std::unique_ptr<client::Client>> c =
        client::Client::Connect(server_->address(), trusting);
    return c.ok() && (*c)->ListSessions().ok();
  };
  EXPECT_TRUE(serves_to("ca.pem"));
  EXPECT_FALSE(serves_to("wrong-ca.pem"));
  // A chain whose second certificate (here ca.pem, valid two days) ends before the server's
  // own (three): the chain ends with it.
  const std::string chain = dir.Path("chain.pem");
  WriteFile(chain, ReadFile(pki().Path("server-next.pem")) + ReadFile(pki().Path("ca.pem")));
  identity = ReadTlsIdentity(chain, pki().Path("server-next.key"), "", "");
  ASSERT_TRUE(identity.ok()) << identity.status();
  ASSERT_LT(NotAfter("ca.pem"), NotAfter("server-next.pem"));
  EXPECT_EQ(identity->not_after, NotAfter("ca.pem"));
}

// The gRPC port reads its TLS files again every --tls_refresh_seconds (and when asked: SIGHUP):
// a certificate replaced on disk (a Secret's rotation) serves the connections made after while
// the sessions stay; files that cannot be used as they are (half a rotation, a garbled or
// missing key) keep the pair in force serving, where gRPC's own reading of them failed every
// new handshake.
TEST_F(TlsTest, ARotatedCertificateServesNewConnectionsAndTheSessionsStay) {
  testing::TempDirectory dir("rotation");
  const std::string cert = dir.Path("tls.crt");
  const std::string key = dir.Path("tls.key");
  PutPkiFile("server.pem", cert);
  PutPkiFile("server.key", key);
  SecurityOptions security;
  security.tls_cert_file = cert;
  security.tls_key_file = key;
  security.tls_refresh_seconds = 1;
  Start(security);
  // A health stub on a channel of its own (no subchannel shared with an earlier channel)
  // trusting `ca`, and whether a check over it succeeded (the handshake, and the call).
  auto health_trusting = [&](const char* ca) {
    client::ChannelSecurity trusting;
    trusting.ca_file = pki().Path(ca);
    absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials =
        client::MakeChannelCredentials(trusting, server_->address());
    EXPECT_TRUE(credentials.ok()) << credentials.status();
    grpc::ChannelArguments own_pool;
    own_pool.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    return grpc::health::v1::Health::NewStub(
        grpc::CreateCustomChannel(server_->address(), *credentials, own_pool));
  };
  auto check = [](grpc::health::v1::Health::Stub& stub) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    grpc::health::v1::HealthCheckRequest request;
    grpc::health::v1::HealthCheckResponse response;
    return stub.Check(&context, request, &response).ok();
  };
  auto serves_to = [&](const char* ca) { return check(*health_trusting(ca)); };
  ASSERT_TRUE(serves_to("ca.pem"));
  absl::StatusOr<std::unique_ptr<client::Client>> before =
      client::Client::Connect(server_->address(), TrustingCa());
  ASSERT_TRUE(before.ok()) << before.status();
  absl::StatusOr<client::SessionHandle> session = (*before)->CreateSession(
      testing::MakeGeometry(1, 2, 1, 8), testing::MakePolicy(v1::SELECTOR_FULL));
  ASSERT_TRUE(session.ok()) << session.status();

  // A channel open before the rotation: its connection keeps the old certificate.
  auto open_before = health_trusting("ca.pem");
  ASSERT_TRUE(check(*open_before));
  auto usable = [&] {
    const std::string text = server_->server().metrics().TextFormat();
    return absl::StrContains(text, "kvrecall_tls_files_usable{port=\"grpc\"} 1");
  };
  EXPECT_TRUE(usable());
  auto expires = [&] {
    return static_cast<int64_t>(
        Series(server_->server().metrics().TextFormat(),
               "kvrecall_tls_certificate_expiration_timestamp_seconds{port=\"grpc\"}"));
  };
  EXPECT_GT(NotAfter("server.pem"), 0);
  EXPECT_EQ(expires(), NotAfter("server.pem"));
  ASSERT_NE(NotAfter("server.pem"), NotAfter("server-next.pem"));
  // Half a rotation (the certificate without its key): said (the gauge), and the pair in force
  // keeps serving new connections (gRPC reads validated copies, never the files).
  PutPkiFile("server-next.pem", cert);
  ASSERT_TRUE(testing::Eventually([&] { return !usable(); }, std::chrono::seconds(5)));
  absl::SleepFor(absl::Milliseconds(1500));  // a read of gRPC's since
  EXPECT_TRUE(serves_to("ca.pem")) << "half a rotation reached gRPC";
  EXPECT_FALSE(serves_to("wrong-ca.pem"));
  // The whole rotation: the new pair serves the connections made after.
  PutPkiFile("server-next.key", key);
  EXPECT_TRUE(testing::Eventually([&] { return serves_to("wrong-ca.pem"); },
                                  std::chrono::seconds(10)));
  EXPECT_FALSE(serves_to("ca.pem"));
  EXPECT_TRUE(usable());
  EXPECT_EQ(expires(), NotAfter("server-next.pem"));
  EXPECT_TRUE(check(*open_before)) << "the connection open before was cut";
  // A garbled key, then no key at all: the pair in force still serves new connections.
  WriteFile(key + ".new", "-----BEGIN PRIVATE KEY-----\ngarbled\n-----END PRIVATE KEY-----\n");
  ASSERT_EQ(std::rename((key + ".new").c_str(), key.c_str()), 0);
  ASSERT_TRUE(testing::Eventually([&] { return !usable(); }, std::chrono::seconds(5)));
  ASSERT_EQ(std::remove(key.c_str()), 0);
  absl::SleepFor(absl::Milliseconds(1500));
  EXPECT_TRUE(serves_to("wrong-ca.pem")) << "a broken key on disk reached gRPC";
  EXPECT_FALSE(usable());
  PutPkiFile("server-next.key", key);
  EXPECT_TRUE(testing::Eventually(usable, std::chrono::seconds(5)));
  EXPECT_TRUE(serves_to("wrong-ca.pem"));
  // The session made before is there, for a client of the new CA.
  client::ChannelSecurity next;
  next.ca_file = pki().Path("wrong-ca.pem");
  absl::StatusOr<std::unique_ptr<client::Client>> after =
      client::Client::Connect(server_->address(), next);
  ASSERT_TRUE(after.ok()) << after.status();
  absl::StatusOr<std::vector<v1::SessionInfo>> listed = (*after)->ListSessions();
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].session_id(), session->id);
  server_.reset();

  // --tls_refresh_seconds=0: the files as they were at start until asked to read them again
  // (ReadTlsFiles: kvrecalld's SIGHUP).
  PutPkiFile("server.pem", cert);
  PutPkiFile("server.key", key);
  security.tls_refresh_seconds = 0;
  Start(security);
  ASSERT_TRUE(serves_to("ca.pem"));
  PutPkiFile("server-next.pem", cert);
  PutPkiFile("server-next.key", key);
  absl::SleepFor(absl::Milliseconds(1500));
  EXPECT_TRUE(serves_to("ca.pem"));
  EXPECT_FALSE(serves_to("wrong-ca.pem"));
  auto read_now = [&] {
    std::vector<std::pair<std::string, absl::StatusOr<bool>>> read =
        server_->server().ReadTlsFiles();
    EXPECT_EQ(read.size(), 1u);
    EXPECT_EQ(read.empty() ? "" : read[0].first, "grpc");
    return read.empty() ? absl::StatusOr<bool>(absl::UnknownError("none")) : read[0].second;
  };
  absl::StatusOr<bool> read = read_now();
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_TRUE(*read);
  EXPECT_TRUE(testing::Eventually([&] { return serves_to("wrong-ca.pem"); },
                                  std::chrono::seconds(5)));
  read = read_now();
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_FALSE(*read) << "unchanged files read as a change";
  PutPkiFile("server.key", key);  // the key of another certificate
  EXPECT_TRUE(HasStatus(read_now().status(), absl::StatusCode::kInvalidArgument,
                        "--tls_key: " + key));
  EXPECT_FALSE(usable());
  absl::SleepFor(absl::Milliseconds(1500));
  EXPECT_TRUE(serves_to("wrong-ca.pem"));
  // A key given as a pipe (--tls_key=<(...)) is read at start; a read asked for later reads
  // nothing, says why, and leaves the gauge as it was.
  server_.reset();
  ASSERT_EQ(mkfifo(dir.Path("fifo.key").c_str(), 0600), 0);
  std::thread writer([&] { WriteFile(dir.Path("fifo.key"), ReadFile(pki().Path("server.key"))); });
  PutPkiFile("server.pem", cert);
  SecurityOptions piped = security;
  piped.tls_key_file = dir.Path("fifo.key");
  Start(piped);
  writer.join();
  ASSERT_TRUE(serves_to("ca.pem"));
  EXPECT_TRUE(HasStatus(read_now().status(), absl::StatusCode::kFailedPrecondition,
                        "--tls_key: " + dir.Path("fifo.key") +
                            " is not a regular file, which cannot be read again (a pipe is read "
                            "once): the TLS files were read at start only"));
  EXPECT_TRUE(usable());
  EXPECT_TRUE(serves_to("ca.pem"));
  // Files that cannot be read again are refused with a period, by flag.
  SecurityOptions pipe = security;
  pipe.tls_key_file = dir.Path("fifo.key");
  pipe.tls_refresh_seconds = 60;
  ServerOptions with_pipe;
  with_pipe.address = "127.0.0.1:0";
  with_pipe.security = pipe;
  // (ReadTlsIdentity would block on the FIFO: the check comes first.)
  EXPECT_TRUE(HasStatus(StartServer(with_pipe).status(), absl::StatusCode::kInvalidArgument,
                        "--tls_key: " + dir.Path("fifo.key") +
                            " is not a regular file, which cannot be read again (a pipe is read "
                            "once): give a regular file, or --tls_refresh_seconds=0 to read it at "
                            "start only"));
  // A file dated 1970 (as some image builds leave them) is served, and read again: gRPC reads
  // copies with times of their own (its watcher took a time of 0 for a failed stat).
  server_.reset();
  PutPkiFile("server.pem", cert);
  PutPkiFile("server.key", key);
  ASSERT_EQ(RunCommand("touch -d @0 " + cert + " " + key).exit_code, 0);
  security.tls_refresh_seconds = 1;
  Start(security);
  EXPECT_TRUE(serves_to("ca.pem"));
  PutPkiFile("server-next.pem", cert);
  PutPkiFile("server-next.key", key);
  ASSERT_EQ(RunCommand("touch -d @0 " + cert + " " + key).exit_code, 0);
  EXPECT_TRUE(testing::Eventually([&] { return serves_to("wrong-ca.pem"); },
                                  std::chrono::seconds(10)));
  security.tls_refresh_seconds = -1;
  ServerOptions negative;
  negative.address = "127.0.0.1:0";
  negative.security = security;
  EXPECT_TRUE(HasStatus(StartServer(negative).status(), absl::StatusCode::kInvalidArgument,
                        "--tls_refresh_seconds must be 0 (the TLS files read at start and at "
                        "SIGHUP only) or more, got -1"));
}

// A token file given as a pipe (--auth_token_file=<(...)) is read at start only: reading it
// again (SIGHUP) would block the reading thread until some writer came.
TEST(TokenStoreTest, APipeIsReadAtStartOnly) {
  testing::TempDirectory dir("token-pipe");
  const std::string fifo = dir.Path("tokens");
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  std::thread writer([&] { WriteFile(fifo, "runner-token-0123456789 team\n"); });
  absl::StatusOr<std::shared_ptr<TokenStore>> store =
      TokenStore::FromFile("--auth_token_file", fifo);
  writer.join();
  ASSERT_TRUE(store.ok()) << store.status();
  ASSERT_NE((*store)->table()->Find("runner-token-0123456789"), nullptr);
  std::future<absl::StatusOr<size_t>> reload =
      std::async(std::launch::async, [&] { return (*store)->Reload(); });
  if (reload.wait_for(std::chrono::seconds(5)) != std::future_status::ready) {
    WriteFile(fifo, "");  // a writer, so that the blocked read ends
    FAIL() << "Reload blocked on the pipe";
  }
  EXPECT_TRUE(HasStatus(reload.get().status(), absl::StatusCode::kFailedPrecondition,
                        "--auth_token_file: " + fifo +
                            " is not a regular file, which cannot be read again (a pipe is read "
                            "once): the tokens were read at start only"));
  EXPECT_NE((*store)->table()->Find("runner-token-0123456789"), nullptr);  // still in force
}

// A read again checks what the path is at the read itself (never opening it unless it is a
// regular file), not only by a stat before it: a token or TLS file swapped for a pipe between
// the two is refused, not read (which blocked until a writer came), and so is a directory.
TEST(TokenStoreTest, AReadAgainRefusesAPipeAtTheReadItself) {
  testing::TempDirectory dir("pipe-opened");
  const std::string fifo = dir.Path("swapped");
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  std::future<absl::Status> tokens = std::async(
      std::launch::async, [&] { return TokenTable::Load(fifo, "", FileKind::kRegular).status(); });
  std::future<absl::Status> tls = std::async(std::launch::async, [&] {
    return ReadTlsIdentity(fifo, fifo, "", "", FileKind::kRegular).status();
  });
  for (std::future<absl::Status>* read : {&tokens, &tls}) {
    while (read->wait_for(std::chrono::seconds(5)) != std::future_status::ready) {
      // A writer that never blocks (no reader: ENXIO), so that a blocked read ends.
      const int writer = open(fifo.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);
      if (writer >= 0) close(writer);
      ADD_FAILURE() << "a read blocked on the pipe";
    }
  }
  const std::string refusal = fifo + " is a pipe, not a regular file, which cannot be read again";
  EXPECT_TRUE(HasStatus(tokens.get(), absl::StatusCode::kInvalidArgument, refusal));
  EXPECT_TRUE(HasStatus(tls.get(), absl::StatusCode::kInvalidArgument, "--tls_cert: " + refusal));
  EXPECT_TRUE(HasStatus(TokenTable::Load(dir.Path(""), "", FileKind::kRegular).status(),
                        absl::StatusCode::kInvalidArgument, "is a directory, not a regular file"));
  // A regular file is read as before.
  const std::string file = dir.Path("tokens");
  WriteFile(file, "runner-token-0123456789 team\n");
  absl::StatusOr<TokenTable> read = TokenTable::Load(file, "", FileKind::kRegular);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_NE(read->Find("runner-token-0123456789"), nullptr);
}

TEST(TokenTableTest, ParsesTokensAndTenantsAndRefusesMalformedLines) {
  absl::StatusOr<TokenTable> t = TokenTable::Parse(
      "# comment\n\n  aaaaaaaaaaaaaaaa   team-a\nbbbbbbbbbbbbbbbb\tteam.b_2\r\n"
      "cccccccccccccccc team-a\n",
      "tokens");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->size(), 3u);
  ASSERT_NE(t->Find("aaaaaaaaaaaaaaaa"), nullptr);
  EXPECT_EQ(*t->Find("aaaaaaaaaaaaaaaa"), "team-a");
  EXPECT_EQ(*t->Find("bbbbbbbbbbbbbbbb"), "team.b_2");
  EXPECT_EQ(*t->Find("cccccccccccccccc"), "team-a");
  EXPECT_EQ(t->Find("aaaaaaaaaaaaaaa"), nullptr);
  EXPECT_EQ(t->Find("aaaaaaaaaaaaaaaaa"), nullptr);
  EXPECT_EQ(t->Find(""), nullptr);

  struct Case {
    const char* text;
    const char* error;
  };
  for (const Case& c : std::vector<Case>{
           {"aaaaaaaaaaaaaaaa\n", "f:1: expected 'TOKEN TENANT', got 1 fields"},
           {"x y z\n", "f:1: expected 'TOKEN TENANT', got 3 fields"},
           {"# only\n\naaaaaaa t\n", "f:3: token is 7 characters, at least 16 are required"},
           {"aaaaaaaaaaaaaaaa t/x\n",
            "f:1: tenant has a character not in [A-Za-z0-9._-] (character 2 of 3)"},
           {"aaaaaaaaaaaaaaaa t\naaaaaaaaaaaaaaaa u\n", "f:2: this token is already listed"},
           {"# nothing\n", "f: no 'TOKEN TENANT' line"},
       }) {
    EXPECT_TRUE(HasStatus(TokenTable::Parse(c.text, "f").status(),
                          absl::StatusCode::kInvalidArgument, c.error))
        << c.text;
  }
  EXPECT_TRUE(HasStatus(TokenTable::Load("/nonexistent/tokens").status(),
                        absl::StatusCode::kNotFound, "cannot read /nonexistent/tokens"));
}

// kvrecalld's flags and the kvrecall CLI's, end to end.
class TlsProcessTest : public TlsTest {
 protected:
  void SetUp() override {
    TlsTest::SetUp();
    // A CLI run sends no token unless its flags (or a test's own KVRECALL_TOKEN_FILE=) say so:
    // --token_file defaults to $KVRECALL_TOKEN_FILE, which the tests' environment might hold.
    unsetenv("KVRECALL_TOKEN_FILE");
  }
  static std::string Cli() { return testing::BuildProgram("client/kvrecall"); }
};

TEST_F(TlsProcessTest, KvrecalldServesTlsAndTokensToTheCli) {
  absl::StatusOr<std::unique_ptr<testing::KvrecalldProcess>> server =
      testing::KvrecalldProcess::Start(
          {"--tls_cert=" + pki().Path("server.pem"), "--tls_key=" + pki().Path("server.key"),
           "--tls_client_ca=" + pki().Path("ca.pem"), "--auth_token_file=" + pki().Path("tokens")});
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string base =
      absl::StrCat(Cli(), " --server=", (*server)->address(), " --tls_ca=", pki().Path("ca.pem"));
  const std::string cert = absl::StrCat(" --tls_cert=", pki().Path("client.pem"),
                                        " --tls_key=", pki().Path("client.key"));
  const std::string token = absl::StrCat(" --token_file=", pki().Path("alice.token"));

  CommandResult created = RunCommand(absl::StrCat(
      base, cert, token, " create --layers=1 --q_heads=2 --kv_heads=1 --head_dim=8 --json"));
  EXPECT_EQ(created.exit_code, 0) << created.output;
  EXPECT_THAT(created.output, HasSubstr("session_id"));
  CommandResult listed = RunCommand(absl::StrCat(base, cert, token, " list --json"));
  EXPECT_EQ(listed.exit_code, 0) << listed.output;
  EXPECT_THAT(listed.output, HasSubstr("session_id"));

  CommandResult no_token = RunCommand(absl::StrCat(base, cert, " list"));
  EXPECT_EQ(no_token.exit_code, 1);
  EXPECT_THAT(no_token.output, HasSubstr("UNAUTHENTICATED"));
  CommandResult no_cert = RunCommand(absl::StrCat(base, token, " list"));
  EXPECT_EQ(no_cert.exit_code, 1);
  EXPECT_THAT(no_cert.output, HasSubstr("UNAVAILABLE"));
  // (gRPC says "Socket closed"; the CLI names the likely causes, as the Python client does.)
  EXPECT_THAT(no_cert.output, HasSubstr("the TLS handshake failed: check --tls_ca, the client "
                                        "certificate a mutual-TLS server requires"));
  CommandResult bad_file = RunCommand(absl::StrCat(base, " --tls_cert=", pki().Path("client.pem"),
                                                   " --tls_key=/nonexistent.key list"));
  EXPECT_EQ(bad_file.exit_code, 1);
  EXPECT_THAT(bad_file.output, HasSubstr("--tls_key: cannot read /nonexistent.key"));
  CommandResult empty_token =
      RunCommand(absl::StrCat(base, cert, " --token_file=", pki().Path("not-a-file"), " list"));
  EXPECT_EQ(empty_token.exit_code, 1);
  EXPECT_THAT(empty_token.output, HasSubstr("--token_file: cannot read"));

  absl::StatusOr<int> stopped = (*server)->Stop();
  ASSERT_TRUE(stopped.ok());
  EXPECT_TRUE(WIFEXITED(*stopped) && WEXITSTATUS(*stopped) == 0);
}

// SIGHUP reads --auth_token_file again: a token taken out is refused, one put in accepted for
// the same tenant's sessions, which stay; a file that does not parse keeps the tokens in force.
// (Revoking a token meant a restart that lost every session, and SIGHUP ended the process.)
TEST_F(TlsProcessTest, SighupReloadsTheTokensAndTheSessionsStay) {
  constexpr char kCarolToken[] = "carol-token-0123456789";
  const std::string tokens = pki().Path("reloaded.tokens");
  WriteFile(tokens, absl::StrCat(kAliceToken, " alice\n"));
  WriteFile(pki().Path("carol.token"), absl::StrCat(kCarolToken, "\n"));
  absl::StatusOr<std::unique_ptr<testing::KvrecalldProcess>> server =
      testing::KvrecalldProcess::Start({"--tls_cert=" + pki().Path("server.pem"),
                                        "--tls_key=" + pki().Path("server.key"),
                                        "--auth_token_file=" + tokens});
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string base =
      absl::StrCat(Cli(), " --server=", (*server)->address(), " --tls_ca=", pki().Path("ca.pem"));
  const std::string as_alice = absl::StrCat(base, " --token_file=", pki().Path("alice.token"));
  const std::string as_carol = absl::StrCat(base, " --token_file=", pki().Path("carol.token"));
  CommandResult created = RunCommand(
      absl::StrCat(as_alice, " create --layers=1 --q_heads=2 --kv_heads=1 --head_dim=8 --json"));
  ASSERT_EQ(created.exit_code, 0) << created.output;
  EXPECT_EQ(RunCommand(as_carol + " list").exit_code, 1);  // not yet a token
  auto hang_up_and_await = [&](const std::string& line) {
    kill((*server)->pid(), SIGHUP);
    return testing::Eventually([&] { return absl::StrContains((*server)->output(), line); });
  };
  // Alice's token rotated out, Carol's in for the same tenant.
  WriteFile(tokens, absl::StrCat("# rotated\n", kCarolToken, " alice\n"));
  ASSERT_TRUE(hang_up_and_await("kvrecalld: SIGHUP: reloaded 1 tokens from " + tokens))
      << (*server)->output();
  CommandResult old_token = RunCommand(as_alice + " list");
  EXPECT_EQ(old_token.exit_code, 1);
  EXPECT_THAT(old_token.output, HasSubstr("UNAUTHENTICATED: unknown bearer token"));
  CommandResult listed = RunCommand(as_carol + " list --json");
  EXPECT_EQ(listed.exit_code, 0) << listed.output;
  EXPECT_THAT(listed.output, HasSubstr("session_id"));  // alice's session, through Carol's token
  // A file that does not parse: the tokens in force stay.
  WriteFile(tokens, "short alice\n");
  ASSERT_TRUE(hang_up_and_await("the tokens in force stay")) << (*server)->output();
  EXPECT_THAT((*server)->output(), HasSubstr("token is 5 characters, at least 16"));
  EXPECT_EQ(RunCommand(as_carol + " list").exit_code, 0);
  absl::StatusOr<int> stopped = (*server)->Stop();
  ASSERT_TRUE(stopped.ok());
  EXPECT_TRUE(WIFEXITED(*stopped) && WEXITSTATUS(*stopped) == 0) << (*server)->output();
}

// strace, which the stalled-read tests run kvrecalld under, with what they ask of it.
bool StraceCanDelayOpens() {
  return std::system(
             "strace -f --seccomp-bpf -o /dev/null -P /dev/null -e trace=openat -e "
             "inject=openat:delay_enter=1:when=2+ true >/dev/null 2>&1") == 0;
}
constexpr char kNoStrace[] =
    "strace cannot delay a process's opens here (scripts/install_deps.sh installs it; ptrace may "
    "be forbidden)";

// A launcher under which each thread's `from`-th open of the `paths` (absolute: strace matches
// a path as the call names it) and those after wait `seconds` (--seccomp-bpf: no other system
// call stops; strace counts each thread's opens of any of the paths, apart from other threads').
std::vector<std::string> StallingOpens(const std::vector<std::string>& paths, int seconds = 15,
                                       int from = 2) {
  std::vector<std::string> launcher = {"strace", "-f", "--seccomp-bpf", "-o", "/dev/null"};
  for (const std::string& path : paths) {
    launcher.push_back("-P");
    launcher.push_back(path);
  }
  launcher.push_back("-e");
  launcher.push_back("trace=openat");
  launcher.push_back("-e");
  launcher.push_back(
      absl::StrCat("inject=openat:delay_enter=", seconds * 1'000'000, ":when=", from, "+"));
  launcher.push_back("--");
  return launcher;
}

// The port of a kvrecalld process's metrics endpoint, from the line its output names it in; 0
// when none.
int MetricsPort(const testing::KvrecalldProcess& server) {
  const std::string out = server.output();
  const size_t at = out.find("kvrecalld metrics on http");
  const size_t colon = at == std::string::npos ? at : out.find("127.0.0.1:", at);
  int port = 0;
  if (colon == std::string::npos) return 0;
  const size_t begin = colon + std::string("127.0.0.1:").size();
  return absl::SimpleAtoi(out.substr(begin, out.find('/', begin) - begin), &port) ? port : 0;
}

// A kvrecalld process's plain-HTTP metrics.
std::string ScrapeMetrics(const testing::KvrecalldProcess& server) {
  const int s = testing::ConnectToLoopback(MetricsPort(server));
  if (s < 0) return "";
  const std::string request =
      "GET /metrics HTTP/1.1\r\nHost: kvrecalld\r\nConnection: close\r\n\r\n";
  std::string response;
  if (write(s, request.data(), request.size()) == static_cast<ssize_t>(request.size())) {
    char buffer[4096];
    for (ssize_t n; (n = read(s, buffer, sizeof buffer)) > 0;) response.append(buffer, n);
  }
  close(s);
  return response;
}

// SIGHUP's reads run on a thread of their own: a read stalled on its file (a hung NFS mount or
// secret store; here strace holds the token file's open for 20 s) leaves the server
// serving and SIGTERM heeded at once; the process ends without waiting for the read. (The reads
// ran on the thread that takes SIGTERM: it went unheeded until the file answered.)
TEST_F(TlsProcessTest, ASighupReadStalledOnItsFileLeavesSigtermHeeded) {
  if (!StraceCanDelayOpens()) GTEST_SKIP() << kNoStrace;
  const std::string tokens = pki().Path("stalled.tokens");
  WriteFile(tokens, absl::StrCat(kAliceToken, " alice\n"));
  absl::StatusOr<std::unique_ptr<testing::KvrecalldProcess>> server =
      testing::KvrecalldProcess::Start(
          {"--tls_cert=" + pki().Path("server.pem"), "--tls_key=" + pki().Path("server.key"),
           "--auth_token_file=" + tokens},
          absl::Seconds(60), /*shutdown_signals_ignored=*/false, StallingOpens({tokens}));
  ASSERT_TRUE(server.ok()) << server.status();
  // The reading thread's first open is served at once.
  (*server)->Signal(SIGHUP);
  ASSERT_TRUE(testing::Eventually([&] {
    return absl::StrContains((*server)->output(), "kvrecalld: SIGHUP: reloaded 1 tokens from");
  })) << (*server)->output();
  // Its second stalls (20 s); a SIGHUP meanwhile is taken at once.
  (*server)->Signal(SIGHUP);
  absl::SleepFor(absl::Seconds(1));
  (*server)->Signal(SIGHUP);
  ASSERT_TRUE(testing::Eventually([&] {
    return absl::StrContains((*server)->output(),
                             "kvrecalld: SIGHUP: the files are being read already (for ");
  })) << (*server)->output();
  const std::string said = (*server)->output();
  EXPECT_EQ(said.find("reloaded"), said.rfind("reloaded")) << said;  // the stalled read: nothing
  EXPECT_THAT(said, HasSubstr("they are read again once that read ends"));
  // The tokens in force serve meanwhile.
  CommandResult listed = RunCommand(
      absl::StrCat(Cli(), " --server=", (*server)->address(), " --tls_ca=", pki().Path("ca.pem"),
                   " --token_file=", pki().Path("alice.token"), " list"));
  EXPECT_EQ(listed.exit_code, 0) << listed.output;
  // SIGTERM: the server stops at once, the read still stalled, and the process ends.
  (*server)->Signal(SIGTERM);
  EXPECT_TRUE(testing::Eventually([&] {
    return absl::StrContains((*server)->output(),
                             "kvrecalld: a read of the token or TLS files is still running (a "
                             "stalled filesystem?); left to it");
  })) << (*server)->output();
  EXPECT_THAT((*server)->output(), HasSubstr("kvrecalld: stopped"));
  // (strace itself ends once its delay is over.)
  absl::StatusOr<int> stopped = (*server)->Stop(SIGTERM, absl::Seconds(60));
  ASSERT_TRUE(stopped.ok()) << stopped.status() << "\n" << (*server)->output();
  EXPECT_TRUE(WIFEXITED(*stopped) && WEXITSTATUS(*stopped) == 0) << (*server)->output();
}

// A SIGHUP's read of the TLS files stalled on a hung mount holds the port's read: the period's
// reads find it under way, and once it has run 3 periods (StalledTlsRead) say so on stderr and
// turn kvrecall_tls_files_usable to 0 (KvrecallTlsFilesUnusable fires), where they said nothing.
TEST_F(TlsProcessTest, ASighupTlsReadStalledIsSaidByThePeriodsReads) {
  if (!StraceCanDelayOpens()) GTEST_SKIP() << kNoStrace;
  const std::string cert = pki().Path("held.pem");
  WriteFile(cert, ReadFile(pki().Path("server.pem")));
  absl::StatusOr<std::unique_ptr<testing::KvrecalldProcess>> server =
      testing::KvrecalldProcess::Start(
          {"--tls_cert=" + cert, "--tls_key=" + pki().Path("server.key"),
           "--tls_refresh_seconds=2"},
          absl::Seconds(60), /*shutdown_signals_ignored=*/false, StallingOpens({cert}, 25));
  ASSERT_TRUE(server.ok()) << server.status();
  // The reading thread's first read is served, its second stalls; the periods' reads then open
  // nothing (the read under way takes the files).
  (*server)->Signal(SIGHUP);
  ASSERT_TRUE(testing::Eventually([&] {
    return absl::StrContains((*server)->output(), "the gRPC port's TLS files are unchanged");
  })) << (*server)->output();
  (*server)->Signal(SIGHUP);
  EXPECT_TRUE(testing::Eventually(
      [&] {
        return absl::StrContains((*server)->output(),
                                 "kvrecalld: the gRPC port's TLS files have been read by one "
                                 "read for over 6s (a stalled filesystem?)");
      },
      std::chrono::seconds(15)))
      << (*server)->output();
  EXPECT_THAT(ScrapeMetrics(**server), HasSubstr("\nkvrecall_tls_files_usable{port=\"grpc\"} 0\n"));
  (*server)->Signal(SIGTERM);
  EXPECT_TRUE(testing::Eventually([&] {
    return absl::StrContains((*server)->output(),
                             "still running (a stalled filesystem?); left to it");
  })) << (*server)->output();
  absl::StatusOr<int> stopped = (*server)->Stop(SIGTERM, absl::Seconds(60));
  ASSERT_TRUE(stopped.ok()) << stopped.status() << "\n" << (*server)->output();
  EXPECT_TRUE(WIFEXITED(*stopped) && WEXITSTATUS(*stopped) == 0) << (*server)->output();
}

// A period's read of the TLS files stalled on a hung mount (--tls_refresh_seconds, as the chart
// sets it) leaves SIGTERM heeded too: the process ends without joining the stalled thread (it
// waited for the read before: 23 s here). The metrics endpoint's period read has a thread of its
// own, so its scrapes go on meanwhile (they stalled with it before), and a scrape finds both
// ports' reads stalled, which their own stuck threads cannot tell.
TEST_F(TlsProcessTest, APeriodsTlsReadStalledOnItsFileLeavesSigtermHeeded) {
  if (!StraceCanDelayOpens()) GTEST_SKIP() << kNoStrace;
  const std::string grpc_cert = pki().Path("stalled-grpc.pem");
  const std::string metrics_cert = pki().Path("stalled-metrics.pem");
  WriteFile(grpc_cert, ReadFile(pki().Path("server.pem")));
  WriteFile(metrics_cert, ReadFile(pki().Path("server.pem")));
  // The start opens each certificate once, on one thread; each port's period thread opens its
  // own each second, and its third read (at 3 s) waits 15 s in strace.
  absl::StatusOr<std::unique_ptr<testing::KvrecalldProcess>> server =
      testing::KvrecalldProcess::Start(
          {"--tls_cert=" + grpc_cert, "--tls_key=" + pki().Path("server.key"),
           "--metrics_tls_cert=" + metrics_cert, "--metrics_tls_key=" + pki().Path("server.key"),
           "--tls_refresh_seconds=1"},
          absl::Seconds(60), /*shutdown_signals_ignored=*/false,
          StallingOpens({grpc_cert, metrics_cert}, 15, /*from=*/3));
  ASSERT_TRUE(server.ok()) << server.status();
  absl::SleepFor(absl::Seconds(7));  // both periods' third reads stalled, for over 3 periods
  CommandResult listed = RunCommand(absl::StrCat(Cli(), " --server=", (*server)->address(),
                                                 " --tls_ca=", pki().Path("ca.pem"), " list"));
  EXPECT_EQ(listed.exit_code, 0) << listed.output;
  const HttpsExchange scraped =
      Https(MetricsPort(**server), {.ca_file = pki().Path("ca.pem")},
            "GET /metrics HTTP/1.1\r\nHost: kvrecalld\r\nConnection: close\r\n\r\n");
  EXPECT_TRUE(scraped.handshake) << scraped.error;
  // The scrape finds both reads stalled (their own period threads cannot tell), says so, and
  // shows it.
  EXPECT_THAT(scraped.response, HasSubstr("\nkvrecall_tls_files_usable{port=\"metrics\"} 0\n"));
  EXPECT_THAT(scraped.response, HasSubstr("\nkvrecall_tls_files_usable{port=\"grpc\"} 0\n"));
  for (const char* files : {"the gRPC port's", "the metrics endpoint's"}) {
    EXPECT_THAT((*server)->output(),
                HasSubstr(absl::StrCat("kvrecalld: ", files,
                                       " TLS files have been read by one "
                                       "read for over 3s (a stalled filesystem?)")));
  }
  (*server)->Signal(SIGTERM);
  EXPECT_TRUE(testing::Eventually([&] {
    return absl::StrContains((*server)->output(),
                             "kvrecalld: a read of the TLS files is still running (a stalled "
                             "filesystem?); left to it");
  })) << (*server)->output();
  EXPECT_THAT((*server)->output(), HasSubstr("kvrecalld: stopped"));
  absl::StatusOr<int> stopped = (*server)->Stop(SIGTERM, absl::Seconds(60));
  ASSERT_TRUE(stopped.ok()) << stopped.status() << "\n" << (*server)->output();
  EXPECT_TRUE(WIFEXITED(*stopped) && WEXITSTATUS(*stopped) == 0) << (*server)->output();
}

// SIGHUP reads the TLS files of both ports again (with no --tls_refresh_seconds period): a
// renewed certificate serves the connections made after, and the sessions stay; half a
// rotation keeps the certificate in force, said.
TEST_F(TlsProcessTest, SighupReadsTheTlsFilesAgain) {
  testing::TempDirectory dir("sighup-tls");
  const std::string cert = dir.Path("tls.crt");
  const std::string key = dir.Path("tls.key");
  PutPkiFile("server.pem", cert);
  PutPkiFile("server.key", key);
  absl::StatusOr<std::unique_ptr<testing::KvrecalldProcess>> server =
      testing::KvrecalldProcess::Start({"--tls_cert=" + cert, "--tls_key=" + key,
                                        "--metrics_tls_cert=" + cert,
                                        "--metrics_tls_key=" + key});
  ASSERT_TRUE(server.ok()) << server.status();
  auto cli = [&](const char* ca, const std::string& command) {
    return RunCommand(absl::StrCat(Cli(), " --server=", (*server)->address(),
                                   " --tls_ca=", pki().Path(ca), " ", command));
  };
  CommandResult created =
      cli("ca.pem", "create --layers=1 --q_heads=2 --kv_heads=1 --head_dim=8 --json");
  ASSERT_EQ(created.exit_code, 0) << created.output;
  auto hang_up_and_await = [&](const std::string& line) {
    kill((*server)->pid(), SIGHUP);
    return testing::Eventually([&] { return absl::StrContains((*server)->output(), line); });
  };
  ASSERT_TRUE(hang_up_and_await("kvrecalld: SIGHUP: the gRPC port's TLS files are unchanged"))
      << (*server)->output();
  EXPECT_THAT((*server)->output(),
              HasSubstr("kvrecalld: SIGHUP: the metrics endpoint's TLS files are unchanged"));
  // Half a rotation: the certificate in force stays on both ports.
  PutPkiFile("server-next.pem", cert);
  ASSERT_TRUE(hang_up_and_await("the certificate in force stays")) << (*server)->output();
  EXPECT_THAT((*server)->output(),
              HasSubstr("--tls_key: " + key + " is not the key of --tls_cert's certificate"));
  EXPECT_THAT((*server)->output(), HasSubstr("--metrics_tls_key: " + key +
                                             " is not the key of --metrics_tls_cert's"));
  absl::SleepFor(absl::Milliseconds(1500));  // a read of gRPC's since
  EXPECT_EQ(cli("ca.pem", "list").exit_code, 0);
  // The whole rotation.
  PutPkiFile("server-next.key", key);
  ASSERT_TRUE(
      hang_up_and_await("kvrecalld: SIGHUP: the gRPC port's TLS files changed: they "
                        "serve the connections made from gRPC's next read"))
      << (*server)->output();
  EXPECT_THAT((*server)->output(),
              HasSubstr("kvrecalld: SIGHUP: the metrics endpoint's TLS files changed"));
  EXPECT_TRUE(testing::Eventually([&] { return cli("wrong-ca.pem", "list").exit_code == 0; }));
  CommandResult listed = cli("wrong-ca.pem", "list --json");
  EXPECT_EQ(listed.exit_code, 0) << listed.output;
  EXPECT_THAT(listed.output, HasSubstr("session_id"));  // the session made before
  EXPECT_NE(cli("ca.pem", "list").exit_code, 0);
  absl::StatusOr<int> stopped = (*server)->Stop();
  ASSERT_TRUE(stopped.ok());
  EXPECT_TRUE(WIFEXITED(*stopped) && WEXITSTATUS(*stopped) == 0) << (*server)->output();
}

// kvrecalld --plaintext_unix_sockets: the CLI reaches the socket without TLS and the TCP port
// with it alone; the flag without a unix:PATH address is refused, saying so.
TEST_F(TlsProcessTest, KvrecalldServesItsUnixSocketInPlaintextWithTheFlag) {
  testing::TempDirectory sockets("tls-sock");
  ASSERT_NE(sockets.path(), "");
  const std::string socket = "unix:" + sockets.Path("kvrecall.sock");
  const std::vector<std::string> tls = {"--tls_cert=" + pki().Path("server.pem"),
                                        "--tls_key=" + pki().Path("server.key"),
                                        "--plaintext_unix_sockets"};
  std::vector<std::string> flags = tls;
  flags.push_back("--address=127.0.0.1:0," + socket);
  absl::StatusOr<std::unique_ptr<testing::KvrecalldProcess>> server =
      testing::KvrecalldProcess::Start(flags);
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_THAT((*server)->output(), HasSubstr("kvrecalld also listening on " + socket));
  CommandResult over_socket = RunCommand(absl::StrCat(Cli(), " --server=", socket, " list"));
  EXPECT_EQ(over_socket.exit_code, 0) << over_socket.output;
  const std::string tcp = absl::StrCat(Cli(), " --server=", (*server)->address());
  CommandResult plaintext_tcp = RunCommand(tcp + " list");
  EXPECT_EQ(plaintext_tcp.exit_code, 1);
  EXPECT_THAT(plaintext_tcp.output, HasSubstr("UNAVAILABLE"));
  EXPECT_THAT(plaintext_tcp.output, HasSubstr("it may speak TLS: pass --tls or --tls_ca"));
  CommandResult tls_tcp =
      RunCommand(absl::StrCat(tcp, " --tls_ca=", pki().Path("ca.pem"), " list"));
  EXPECT_EQ(tls_tcp.exit_code, 0) << tls_tcp.output;
  absl::StatusOr<int> stopped = (*server)->Stop();
  ASSERT_TRUE(stopped.ok());
  EXPECT_TRUE(WIFEXITED(*stopped) && WEXITSTATUS(*stopped) == 0) << (*server)->output();

  absl::StatusOr<std::unique_ptr<testing::KvrecalldProcess>> refused =
      testing::KvrecalldProcess::Start(tls);  // --address=127.0.0.1:0 alone
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(std::string(refused.status().message()),
              HasSubstr("kvrecalld: --plaintext_unix_sockets: --address has no unix:PATH entry"));
}

// The CLI's token over kvrecalld's plaintext socket, from --token_file or from
// $KVRECALL_TOKEN_FILE (what the chart's co-located runner gets), while to the TCP port a
// token still means TLS.
TEST_F(TlsProcessTest, TheCliSendsItsTokenOverThePlaintextSocket) {
  testing::TempDirectory sockets("tls-sock");
  ASSERT_NE(sockets.path(), "");
  const std::string socket = "unix:" + sockets.Path("kvrecall.sock");
  absl::StatusOr<std::unique_ptr<testing::KvrecalldProcess>> server =
      testing::KvrecalldProcess::Start(
          {"--tls_cert=" + pki().Path("server.pem"), "--tls_key=" + pki().Path("server.key"),
           "--auth_token_file=" + pki().Path("tokens"), "--plaintext_unix_sockets",
           "--address=127.0.0.1:0," + socket});
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string over_socket = absl::StrCat(Cli(), " --server=", socket);
  const std::string alice = " --token_file=" + pki().Path("alice.token");
  const std::string env = "KVRECALL_TOKEN_FILE=" + pki().Path("alice.token") + " ";

  CommandResult created = RunCommand(absl::StrCat(
      over_socket, alice, " create --layers=1 --q_heads=2 --kv_heads=1 --head_dim=8 --json"));
  ASSERT_EQ(created.exit_code, 0) << created.output;
  CommandResult listed = RunCommand(absl::StrCat(env, over_socket, " list --json"));
  EXPECT_EQ(listed.exit_code, 0) << listed.output;
  EXPECT_THAT(listed.output, HasSubstr("session_id"));  // alice's, through the variable
  CommandResult no_token = RunCommand(over_socket + " list");
  EXPECT_EQ(no_token.exit_code, 1);
  EXPECT_THAT(no_token.output, HasSubstr("UNAUTHENTICATED: this server requires a bearer token"));
  // --token_file= sends none, even with the variable set.
  CommandResult none = RunCommand(absl::StrCat(env, over_socket, " --token_file= list"));
  EXPECT_EQ(none.exit_code, 1);
  EXPECT_THAT(none.output, HasSubstr("UNAUTHENTICATED: this server requires a bearer token"));
  WriteFile(pki().Path("wrong.token"), "not-a-token-of-this-server\n");
  CommandResult wrong =
      RunCommand(absl::StrCat(over_socket, " --token_file=", pki().Path("wrong.token"), " list"));
  EXPECT_EQ(wrong.exit_code, 1);
  EXPECT_THAT(wrong.output, HasSubstr("UNAUTHENTICATED: unknown bearer token"));
  CommandResult unreadable = RunCommand(
      absl::StrCat("KVRECALL_TOKEN_FILE=", pki().Path("absent.token"), " ", over_socket, " list"));
  EXPECT_EQ(unreadable.exit_code, 1);
  EXPECT_THAT(unreadable.output, HasSubstr("NOT_FOUND: $KVRECALL_TOKEN_FILE: cannot read " +
                                           pki().Path("absent.token")));

  // To the TCP port the variable's token means TLS: the system's roots refuse the suite's
  // certificate, the CA accepts it.
  const std::string tcp = absl::StrCat(Cli(), " --server=", (*server)->address());
  CommandResult system_roots = RunCommand(absl::StrCat(env, tcp, " list"));
  EXPECT_EQ(system_roots.exit_code, 1);
  EXPECT_THAT(system_roots.output, HasSubstr("UNAVAILABLE"));
  CommandResult with_ca =
      RunCommand(absl::StrCat(env, tcp, " --tls_ca=", pki().Path("ca.pem"), " list --json"));
  EXPECT_EQ(with_ca.exit_code, 0) << with_ca.output;
  EXPECT_THAT(with_ca.output, HasSubstr("session_id"));
  absl::StatusOr<int> stopped = (*server)->Stop();
  ASSERT_TRUE(stopped.ok());
  EXPECT_TRUE(WIFEXITED(*stopped) && WEXITSTATUS(*stopped) == 0) << (*server)->output();
}

TEST_F(TlsProcessTest, KvrecalldRefusesTokensWithoutTls) {
  absl::StatusOr<std::unique_ptr<testing::KvrecalldProcess>> server =
      testing::KvrecalldProcess::Start({"--auth_token_file=" + pki().Path("tokens")});
  ASSERT_FALSE(server.ok());
  EXPECT_THAT(std::string(server.status().message()),
              HasSubstr("kvrecalld: --auth_token_file needs --tls_cert and --tls_key"));
}

}  // namespace
}  // namespace kvrecall
