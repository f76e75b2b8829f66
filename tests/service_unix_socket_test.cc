// kvrecall over a Unix domain socket (--address=unix:PATH), for a runner on the same host: the
// server listens there (alone or beside a TCP port), reports the address as given, serves
// decode steps that match brute-force attention through the C++ client, refuses a path another
// server listens on or one that is not a socket, replaces a stale socket file, and kvrecalld and
// the CLI work over it. Also the listening addresses' checks (ports, empty and repeated
// entries) and what the health port serves.
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "client/kvrecall_client.h"
#include "gmock/gmock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/generic/generic_stub.h"
#include "gtest/gtest.h"
#include "server/health.h"
#include "tests/server_fixture.h"
#include "tests/test_util.h"

namespace kvrecall {
namespace {

using grpc::health::v1::Health;
using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;
using ::kvrecall::testing::HasStatus;
using ::kvrecall::testing::KvrecalldProcess;
using ::kvrecall::testing::MakeChannel;
using ::kvrecall::testing::MakeGeometry;
using ::kvrecall::testing::MakePolicy;
using ::kvrecall::testing::RandomNormal;
using ::testing::HasSubstr;
using ::testing::StartsWith;

// A fresh directory for socket files (sun_path holds ~107 bytes, so it stays short).
class UnixSocketTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_NE(dir_.path(), ""); }
  std::string SocketPath(const std::string& name) const { return dir_.Path(name); }

  testing::TempDirectory dir_{"unix"};
};

absl::StatusOr<std::unique_ptr<RunningServer>> StartOn(const std::string& address) {
  ServerOptions options;
  options.address = address;
  return StartServer(options);
}

HealthCheckResponse::ServingStatus CheckHealth(const std::string& address) {
  auto stub = Health::NewStub(MakeChannel(address));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  HealthCheckResponse response;
  const grpc::Status s = stub->Check(&context, HealthCheckRequest(), &response);
  EXPECT_TRUE(s.ok()) << address << ": " << s.error_message();
  return response.status();
}

// Creates a session through `address` with the C++ client, prefills `prompt` tokens, decodes
// one step and checks its output against double-precision attention over prompt + new token.
void DecodeMatchesReference(const std::string& address) {
  constexpr int kHq = 4, kHkv = 2, kD = 16, kT = 40;
  std::unique_ptr<client::Client> c = client::Client::Connect(address);
  const v1::Geometry g = MakeGeometry(1, kHq, kHkv, kD);
  absl::StatusOr<client::SessionHandle> session =
      c->CreateSession(g, MakePolicy(v1::SELECTOR_FULL), "unix socket test");
  ASSERT_TRUE(session.ok()) << session.status();
  const std::vector<float> q_prompt = RandomNormal(kT * kHq * kD, 1);
  std::vector<float> keys = RandomNormal(kT * kHkv * kD, 2);
  std::vector<float> values = RandomNormal(kT * kHkv * kD, 3);
  {
    absl::StatusOr<std::unique_ptr<client::PrefillStream>> prefill = c->StartPrefill(*session);
    ASSERT_TRUE(prefill.ok()) << prefill.status();
    ASSERT_TRUE((*prefill)->SendLayer(0, q_prompt, keys, values).ok());
    absl::StatusOr<v1::PrefillResponse> committed = (*prefill)->Finish();
    ASSERT_TRUE(committed.ok()) << committed.status();
  }
  const std::vector<float> q = RandomNormal(kHq * kD, 4);
  const std::vector<float> k_new = RandomNormal(kHkv * kD, 5);
  const std::vector<float> v_new = RandomNormal(kHkv * kD, 6);
  absl::StatusOr<std::unique_ptr<client::DecodeStream>> stream = c->OpenDecodeStream(g);
  ASSERT_TRUE(stream.ok()) << stream.status();
  const client::SequenceInput input{session->id, q, k_new, v_new};
  client::StepResult result;
  ASSERT_TRUE((*stream)->Step(0, {&input, 1}, {.return_lse = true}, &result).ok());
  EXPECT_EQ(result.response->results(0).position(), kT);

  keys.insert(keys.end(), k_new.begin(), k_new.end());
  values.insert(values.end(), v_new.begin(), v_new.end());
  const KvView kv{keys.data(), values.data(), kT + 1, kHkv, kD};
  const std::vector<int32_t> all = ::kvrecall::testing::AllTokens(kT + 1);
  for (int h = 0; h < kHq; ++h) {
    std::vector<double> o;
    const double lse = ::kvrecall::testing::ReferenceAttention(
        q.data() + h * kD, kv, KvHeadOf(h, kHq, kHkv), all, 1.0 / std::sqrt(kD), &o);
    EXPECT_NEAR(result.lse[h], lse, 1e-4) << "head " << h;
    for (int j = 0; j < kD; ++j) {
      EXPECT_NEAR(result.output[h * kD + j], o[j], 1e-5) << "head " << h << " dim " << j;
    }
  }
  EXPECT_TRUE((*stream)->Close().ok());
  EXPECT_TRUE(c->CloseSession(session->id).ok());
}

TEST_F(UnixSocketTest, ServesDecodeStepsThroughTheClientLibrary) {
  const std::string address = "unix:" + SocketPath("kv.sock");
  absl::StatusOr<std::unique_ptr<RunningServer>> server = StartOn(address);
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_EQ((*server)->address(), address);
  EXPECT_EQ((*server)->port(), 0);
  EXPECT_TRUE(IsUnixSocketAddress((*server)->address()));
  EXPECT_TRUE(std::filesystem::is_socket(SocketPath("kv.sock")));
  EXPECT_EQ(CheckHealth(address), HealthCheckResponse::SERVING);
  DecodeMatchesReference(address);
}

TEST_F(UnixSocketTest, ListensOnTcpAndUnixSocketTogether) {
  const std::string unix_address = "unix://" + SocketPath("both.sock");  // unix:///ABSOLUTE
  absl::StatusOr<std::unique_ptr<RunningServer>> server =
      StartOn(absl::StrCat("127.0.0.1:0,", unix_address));
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_EQ((*server)->addresses().size(), 2u);
  EXPECT_THAT((*server)->address(), StartsWith("127.0.0.1:"));
  EXPECT_NE((*server)->port(), 0);
  EXPECT_EQ((*server)->addresses()[1], unix_address);
  for (const std::string& address : (*server)->addresses()) {
    EXPECT_EQ(CheckHealth(address), HealthCheckResponse::SERVING);
    DecodeMatchesReference(address);
  }
}

TEST_F(UnixSocketTest, RefusesASocketAnotherServerListensOn) {
  const std::string address = "unix:" + SocketPath("taken.sock");
  absl::StatusOr<std::unique_ptr<RunningServer>> first = StartOn(address);
  ASSERT_TRUE(first.ok()) << first.status();
  absl::StatusOr<std::unique_ptr<RunningServer>> second = StartOn(address);
  EXPECT_TRUE(HasStatus(second.status(), absl::StatusCode::kUnavailable,
                        "could not listen on " + address +
                            ": another server listens on that socket"));
  // The first server still has its socket (gRPC would have unlinked it for the second).
  EXPECT_EQ(CheckHealth(address), HealthCheckResponse::SERVING);
}

// The socket file is the server's user's alone whatever umask the process inherited (it was
// the umask's: under 000 any local user could drive every session), and a health port on a
// Unix socket is reported as such and guarded like the main one.
TEST_F(UnixSocketTest, SocketsArePrivateAndAHealthSocketIsGuarded) {
  const std::string path = SocketPath("private.sock");
  const std::string health = "unix:" + SocketPath("health.sock");
  const mode_t inherited = umask(0);
  ServerOptions options;
  options.address = "127.0.0.1:0,unix:" + path;
  options.health_address = health;
  absl::StatusOr<std::unique_ptr<RunningServer>> server = StartServer(options);
  umask(inherited);
  ASSERT_TRUE(server.ok()) << server.status();
  struct stat st;
  ASSERT_EQ(stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  ASSERT_EQ(stat(SocketPath("health.sock").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ((*server)->health_address(), health);  // it read "unix:1"
  EXPECT_EQ(CheckHealth(health), HealthCheckResponse::SERVING);
  ServerOptions second;
  second.address = "127.0.0.1:0";
  second.health_address = health;
  EXPECT_TRUE(HasStatus(StartServer(second).status(), absl::StatusCode::kUnavailable,
                        "could not serve health on " + health +
                            ": another server listens on that socket"));
  EXPECT_EQ(CheckHealth(health), HealthCheckResponse::SERVING);
}

// grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo asked to list the services at
// `address`, as one request on the stream (`list_services: "*"`, field 7): the call's status,
// and in *reply the response's bytes.
grpc::Status ListServicesByReflection(const std::string& address, std::string* reply) {
  grpc::GenericStub stub(MakeChannel(address));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  const std::string request_bytes = {0x3a, 0x01, '*'};
  grpc::Slice slice(request_bytes);
  grpc::ByteBuffer request(&slice, 1);
  grpc::ByteBuffer response;
  absl::Notification done;
  grpc::Status status;
  stub.UnaryCall(&context, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                 grpc::StubOptions(), &request, &response, [&](grpc::Status s) {
                   status = std::move(s);
                   done.Notify();
                 });
  done.WaitForNotification();
  reply->clear();
  std::vector<grpc::Slice> slices;
  if (status.ok() && response.Dump(&slices).ok()) {
    for (const grpc::Slice& piece : slices) {
      reply->append(reinterpret_cast<const char*>(piece.begin()), piece.size());
    }
  }
  return status;
}

// The health port (plaintext, token-free, open to the probes' network) serves grpc.health.v1
// alone: server reflection, registered process-wide before, was served there too, unthrottled,
// a thread per stream (probe 20, 2). The main port still serves it.
TEST(ServerAddressTest, TheHealthPortServesHealthAloneWithoutReflection) {
  ServerOptions options;
  options.address = "127.0.0.1:0";
  options.health_address = "127.0.0.1:0";
  absl::StatusOr<std::unique_ptr<RunningServer>> server = StartServer(options);
  ASSERT_TRUE(server.ok()) << server.status();
  std::string reply;
  const grpc::Status on_health = ListServicesByReflection((*server)->health_address(), &reply);
  EXPECT_EQ(on_health.error_code(), grpc::StatusCode::UNIMPLEMENTED) << on_health.error_message();
  EXPECT_EQ(CheckHealth((*server)->health_address()), HealthCheckResponse::SERVING);
  const grpc::Status on_main = ListServicesByReflection((*server)->addresses().front(), &reply);
  ASSERT_TRUE(on_main.ok()) << on_main.error_message();
  EXPECT_THAT(reply, HasSubstr("kvrecall.v1.KvRecall"));
  EXPECT_THAT(reply, HasSubstr("grpc.health.v1.Health"));
}

// Health needs no token, so what a health request may hold is bounded: a Watch held its request
// for its life, and streams of 60 MB names, gzip-compressed to 60 KB, took gigabytes (probe 26,
// 1). A request of more than 1 KiB is refused at once on the API port (after gRPC's own limit
// and decompression); the health-only port takes 4 KiB messages at most.
TEST(ServerAddressTest, LargeHealthRequestsAreRefusedAtOnce) {
  ServerOptions options;
  options.address = "127.0.0.1:0";
  options.health_address = "127.0.0.1:0";
  absl::StatusOr<std::unique_ptr<RunningServer>> server = StartServer(options);
  ASSERT_TRUE(server.ok()) << server.status();
  // Each call's status: Check, and Watch's first read.
  auto call = [](const std::string& address, size_t name_bytes) {
    auto stub = Health::NewStub(MakeChannel(address));
    HealthCheckRequest request;
    request.set_service(std::string(name_bytes, 'a'));
    grpc::ClientContext check_context, watch_context;
    check_context.set_compression_algorithm(GRPC_COMPRESS_GZIP);
    watch_context.set_compression_algorithm(GRPC_COMPRESS_GZIP);
    HealthCheckResponse response;
    std::vector<grpc::Status> statuses = {stub->Check(&check_context, request, &response)};
    std::unique_ptr<grpc::ClientReader<HealthCheckResponse>> watch =
        stub->Watch(&watch_context, request);
    while (watch->Read(&response)) watch_context.TryCancel();  // an unknown name's one answer
    statuses.push_back(watch->Finish());
    return statuses;
  };
  const std::string api = (*server)->addresses().front();
  for (const grpc::Status& status : call(api, 8 << 20)) {
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(status.error_message(),
                HasSubstr("a health check request of 8388613 bytes: at most 1024"));
  }
  for (const grpc::Status& status : call((*server)->health_address(), 8 << 20)) {
    EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
    EXPECT_THAT(status.error_message(), HasSubstr("larger than max"));
  }
  // A name of 1000 bytes is only unknown.
  const std::vector<grpc::Status> small = call(api, 1000);
  EXPECT_EQ(small[0].error_code(), grpc::StatusCode::NOT_FOUND) << small[0].error_message();
  EXPECT_EQ(CheckHealth((*server)->health_address()), HealthCheckResponse::SERVING);
}

// Health needs no token, so one host must not take every Watch slot (review 23: one peer could
// take all 1024, and the load balancers' client-side health checks, which watch, were refused):
// past HealthService::kMaxWatchesPerHost from one host its next is refused, another host's is
// served, and a slot comes back when its Watch ends.
TEST(ServerAddressTest, OneHostCannotTakeEveryHealthWatch) {
  ServerOptions options;
  options.address = "[::]:0";  // both families: two hosts on one machine, 127.0.0.1 and ::1
  absl::StatusOr<std::unique_ptr<RunningServer>> server = StartServer(options);
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string port = (*server)->address().substr((*server)->address().rfind(':') + 1);
  struct Watcher {
    grpc::ClientContext context;
    std::unique_ptr<grpc::ClientReader<HealthCheckResponse>> reader;
    HealthCheckResponse first;
    bool read = false;
  };
  auto watch = [&](const std::string& host) {
    auto w = std::make_unique<Watcher>();
    auto stub = Health::NewStub(MakeChannel(absl::StrCat(host, ":", port)));
    w->reader = stub->Watch(&w->context, HealthCheckRequest());
    w->read = w->reader->Read(&w->first);
    return w;
  };
  auto end = [](Watcher& w) {
    w.context.TryCancel();
    return w.reader->Finish();
  };
  std::vector<std::unique_ptr<Watcher>> from_ipv4;
  for (int i = 0; i < HealthService::kMaxWatchesPerHost; ++i) {
    from_ipv4.push_back(watch("127.0.0.1"));
    ASSERT_TRUE(from_ipv4.back()->read) << i;
    EXPECT_EQ(from_ipv4.back()->first.status(), HealthCheckResponse::SERVING);
  }
  std::unique_ptr<Watcher> refused = watch("127.0.0.1");
  EXPECT_FALSE(refused->read);
  const grpc::Status status = refused->reader->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(status.error_message(),
              HasSubstr("64 health Watch calls are open from ipv4:127.0.0.1; use Check"));
  std::unique_ptr<Watcher> other_host = watch("[::1]");
  EXPECT_TRUE(other_host->read);
  EXPECT_EQ(other_host->first.status(), HealthCheckResponse::SERVING);
  EXPECT_EQ(CheckHealth(absl::StrCat("127.0.0.1:", port)), HealthCheckResponse::SERVING);
  // One ended: its host's next is served (once the server has seen it end).
  end(*from_ipv4.back());
  from_ipv4.pop_back();
  EXPECT_TRUE(testing::Within(absl::Seconds(5), [&] {
    std::unique_ptr<Watcher> again = watch("127.0.0.1");
    if (!again->read) return false;
    from_ipv4.push_back(std::move(again));
    return true;
  }));
  for (auto& w : from_ipv4) end(*w);
  end(*other_host);
}

// A Watch cancelled while its first status was being written, the write then done, was never
// finished (no read pending to see the cancellation): it kept its slot and connection until
// shutdown, and a few thousand quick cancellations took every slot of their host (probe 27, 1).
TEST_F(UnixSocketTest, CancelledHealthWatchesGiveTheirSlotsBack) {
  const std::string socket = SocketPath("watch.sock");  // the race came most often over one
  ServerOptions options;
  options.address = absl::StrCat("127.0.0.1:0,unix:", socket);
  absl::StatusOr<std::unique_ptr<RunningServer>> server = StartServer(options);
  ASSERT_TRUE(server.ok()) << server.status();
  for (const std::string& address :
       {(*server)->addresses().front(), absl::StrCat("unix:", socket)}) {
    auto stub = Health::NewStub(MakeChannel(address));
    for (int i = 0; i < 2000; ++i) {
      grpc::ClientContext context;
      std::unique_ptr<grpc::ClientReader<HealthCheckResponse>> reader =
          stub->Watch(&context, HealthCheckRequest());
      // Cancelled at moments spread around the server's first write.
      absl::SleepFor(absl::Microseconds(20 * (i % 16)));
      context.TryCancel();
      reader->Finish();
    }
  }
  EXPECT_TRUE(testing::Within(absl::Seconds(10), [&] {
    return (*server)->health().open_watches() == 0;
  })) << (*server)->health().open_watches() << " cancelled Watch calls still open";
}

// kvrecalld's --metrics_address when not given: as exposed as the API, no more (it was
// 0.0.0.0:9090 whatever --address said).
TEST(ServerAddressTest, MetricsDefaultToTheHostOfTheFirstTcpAddress) {
  EXPECT_EQ(DefaultMetricsAddress("0.0.0.0:50051"), "0.0.0.0:9090");
  EXPECT_EQ(DefaultMetricsAddress("127.0.0.1:0,unix:/run/k.sock"), "127.0.0.1:9090");
  EXPECT_EQ(DefaultMetricsAddress("unix:/run/k.sock,[::1]:50051"), "[::1]:9090");
  EXPECT_EQ(DefaultMetricsAddress("localhost:50051"), "localhost:9090");
  EXPECT_EQ(DefaultMetricsAddress("unix:/run/k.sock"), "127.0.0.1:9090");
  EXPECT_EQ(DefaultMetricsAddress("unix-abstract:kv"), "127.0.0.1:9090");
}

TEST(ServerAddressTest, EmptyEntriesAndTooManyWorkersAreRefused) {
  for (const char* address : {"127.0.0.1:0,", ",127.0.0.1:0", "127.0.0.1:0,,unix:/tmp/x"}) {
    EXPECT_TRUE(HasStatus(StartOn(address).status(), absl::StatusCode::kInvalidArgument,
                          "has an empty entry"))
        << address;
  }
  ServerOptions options;
  options.address = "127.0.0.1:0";
  options.worker_threads = kMaxWorkerThreads + 1;
  EXPECT_TRUE(HasStatus(StartServer(options).status(), absl::StatusCode::kInvalidArgument,
                        "worker_threads must be in [0, 1024], got 1025"));
}

// A port past 65535 is refused, naming the flag: gRPC's parser takes it modulo 2^16, so
// :99999 served on 34463 and :65536 on a random port, saying it listened (probe 17, 1); and a
// health port that wrapped onto the API's failed as "address in use".
TEST(ServerAddressTest, PortsOutsideTheirRangeAreRefused) {
  for (const char* address :
       {"127.0.0.1:99999", "127.0.0.1:65536", "127.0.0.1:0,127.0.0.1:113665", "127.0.0.1:-1",
        "127.0.0.1:", "127.0.0.1", "[::1]:70000", "127.0.0.1:12ab", "::1", "fe80::1:8080"}) {
    EXPECT_TRUE(HasStatus(StartOn(address).status(), absl::StatusCode::kInvalidArgument,
                          "must be HOST:PORT with a port in [0, 65535]"))
        << address;
  }
  EXPECT_TRUE(HasStatus(StartOn("127.0.0.1:0,localhost:70000").status(),
                        absl::StatusCode::kInvalidArgument,
                        "--address entry 'localhost:70000' must be HOST:PORT"));
  ServerOptions options;
  options.address = "127.0.0.1:0";
  options.health_address = "127.0.0.1:112664";
  EXPECT_TRUE(HasStatus(StartServer(options).status(), absl::StatusCode::kInvalidArgument,
                        "--health_address entry '127.0.0.1:112664' must be HOST:PORT"));
  // A port the system picks, by address or by name, is served.
  options.health_address = "";
  for (const char* address : {"127.0.0.1:0", "localhost:0"}) {
    options.address = address;
    absl::StatusOr<std::unique_ptr<RunningServer>> server = StartServer(options);
    EXPECT_TRUE(server.ok()) << address << ": " << server.status();
  }
}

TEST_F(UnixSocketTest, ReplacesAStaleSocketFile) {
  // A socket file nobody listens on, as a killed server leaves behind.
  const std::string path = SocketPath("stale.sock");
  const int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_un sa{};
  sa.sun_family = AF_UNIX;
  std::strncpy(sa.sun_path, path.c_str(), sizeof sa.sun_path - 1);
  ASSERT_EQ(bind(fd, reinterpret_cast<const sockaddr*>(&sa), sizeof sa), 0);
  close(fd);
  ASSERT_TRUE(std::filesystem::is_socket(path));
  absl::StatusOr<std::unique_ptr<RunningServer>> server = StartOn("unix:" + path);
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_EQ(CheckHealth("unix:" + path), HealthCheckResponse::SERVING);
}

// A unix:PATH that names something other than a socket is refused before anything binds, and
// left as it was: a failed start chmod-ed it (and a symbolic link's target) to 0600 (probe 20,
// 1). The health port's address is held to the same.
TEST_F(UnixSocketTest, RefusesAPathThatIsNotASocketAndLeavesItAlone) {
  const std::string file = SocketPath("plain-file");
  const std::string directory = SocketPath("a-directory");
  const std::string link = SocketPath("a-link");
  std::FILE* f = std::fopen(file.c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::fclose(f);
  ASSERT_EQ(chmod(file.c_str(), 0644), 0);
  ASSERT_TRUE(std::filesystem::create_directory(directory));
  ASSERT_EQ(chmod(directory.c_str(), 0755), 0);
  ASSERT_EQ(symlink(file.c_str(), link.c_str()), 0);
  auto mode = [](const std::string& path) {
    struct stat st;
    return stat(path.c_str(), &st) == 0 ? st.st_mode & 0777 : 0u;
  };
  for (const auto& [path, what] : std::vector<std::pair<std::string, std::string>>{
           {file, "a file"}, {directory, "a directory"}, {link, "a symbolic link"}}) {
    EXPECT_TRUE(HasStatus(StartOn("127.0.0.1:0,unix:" + path).status(),
                          absl::StatusCode::kInvalidArgument,
                          "--address entry 'unix:" + path + "': " + path +
                              " exists and is not a socket (" + what + ")"))
        << what;
    ServerOptions options;
    options.address = "127.0.0.1:0";
    options.health_address = "unix:" + path;
    EXPECT_TRUE(HasStatus(StartServer(options).status(), absl::StatusCode::kInvalidArgument,
                          "--health_address entry 'unix:" + path + "': " + path +
                              " exists and is not a socket"))
        << what;
  }
  EXPECT_EQ(mode(file), 0644u);
  EXPECT_EQ(mode(directory), 0755u);
  EXPECT_TRUE(std::filesystem::is_regular_file(file));
  EXPECT_TRUE(std::filesystem::is_symlink(link));
  // A directory that does not exist: gRPC cannot bind there.
  EXPECT_TRUE(HasStatus(StartOn("unix:" + SocketPath("missing/kv.sock")).status(),
                        absl::StatusCode::kUnavailable, "could not listen on"));
}

// An empty socket name (an unset variable: --address=unix:$SOCK) is refused: gRPC bound it as
// an abstract socket of NULs that any process of the network namespace could connect to (probe
// 20, 4). Blanks around an entry are not part of it (probe 20, 9: the valid entry was blamed),
// and an entry named twice is refused.
TEST_F(UnixSocketTest, EmptySocketNamesAndRepeatedEntriesAreRefused) {
  for (const char* address : {"unix:", "127.0.0.1:0,unix:", "unix-abstract:"}) {
    EXPECT_TRUE(HasStatus(StartOn(address).status(), absl::StatusCode::kInvalidArgument,
                          "names no socket"))
        << address;
  }
  ServerOptions options;
  options.address = "127.0.0.1:0";
  options.health_address = "unix:";
  EXPECT_TRUE(HasStatus(StartServer(options).status(), absl::StatusCode::kInvalidArgument,
                        "--health_address entry 'unix:' names no socket: unix:PATH needs a PATH"));
  const std::string path = SocketPath("twice.sock");
  EXPECT_TRUE(HasStatus(StartOn("unix:" + path + ", unix:" + path).status(),
                        absl::StatusCode::kInvalidArgument,
                        "names the listener 'unix:" + path + "' twice"));
  if (path.front() == '/') {  // one socket file, spelled two ways
    EXPECT_TRUE(HasStatus(StartOn("unix:" + path + ",unix://" + path).status(),
                          absl::StatusCode::kInvalidArgument, "twice"));
  }
  // Two entries of port 0 ask for two ports.
  absl::StatusOr<std::unique_ptr<RunningServer>> two = StartOn("127.0.0.1:0,127.0.0.1:0");
  ASSERT_TRUE(two.ok()) << two.status();
  EXPECT_NE((*two)->addresses()[0], (*two)->addresses()[1]);
  absl::StatusOr<std::unique_ptr<RunningServer>> server =
      StartOn(" 127.0.0.1:0 , unix:" + path + " ");
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_EQ((*server)->addresses().back(), "unix:" + path);
  EXPECT_EQ(CheckHealth("unix:" + path), HealthCheckResponse::SERVING);
}

// The real binaries: kvrecalld reports the socket it listens on, the CLI reaches it there, and
// a clean shutdown removes the socket file.
TEST_F(UnixSocketTest, KvrecalldAndTheCliOverTheSocket) {
  const std::string path = SocketPath("kvrecalld.sock");
  absl::StatusOr<std::unique_ptr<KvrecalldProcess>> process =
      KvrecalldProcess::Start({"--address=unix:" + path});
  ASSERT_TRUE(process.ok()) << process.status();
  EXPECT_EQ((*process)->address(), "unix:" + path);
  DecodeMatchesReference((*process)->address());
  {
    std::unique_ptr<client::Client> c = client::Client::Connect((*process)->address());
    ASSERT_TRUE(c->CreateSession(MakeGeometry(1, 2, 1, 8), MakePolicy(v1::SELECTOR_FULL),
                                 "listed over the socket")
                    .ok());
  }
  const std::string command = absl::StrCat(testing::BuildProgram("client/kvrecall"),
                                           " list --server=", (*process)->address(), " 2>&1");
  FILE* pipe = popen(command.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string output;
  char buffer[512];
  while (fgets(buffer, sizeof buffer, pipe) != nullptr) output += buffer;
  const int status = pclose(pipe);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << output;
  EXPECT_THAT(output, HasSubstr("listed over the socket"));

  absl::StatusOr<int> stopped = (*process)->Stop(SIGTERM);
  ASSERT_TRUE(stopped.ok()) << stopped.status();
  EXPECT_TRUE(WIFEXITED(*stopped) && WEXITSTATUS(*stopped) == 0) << (*process)->output();
  EXPECT_FALSE(std::filesystem::exists(path)) << "kvrecalld left its socket file behind";
}

}  // namespace
}  // namespace kvrecall
