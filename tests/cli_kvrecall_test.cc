// The `kvrecall` binary against the real `kvrecalld` binary on loopback: replay of a real
// tinylm trace (generated at test time), its prompt and decode steps sent a command at a time
// (prefill, decode), the session subcommands, the demo, errors (non-zero
// exit with the server's code and message), --token_file and $KVRECALL_TOKEN_FILE, and a
// prompt + decode step sent as plain float JSON through `buf curl` and server reflection.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/ascii.h"
#include "client/kvrecall_client.h"
#include "client/trace/trace.h"
#include "kernels/cpu/attention.h"
#include "kernels/kv_view.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/server_fixture.h"
#include "tests/test_util.h"

namespace kvrecall {
namespace {

using ::kvrecall::testing::KvrecalldProcess;
using ::kvrecall::testing::ScopedEnv;
using ::testing::HasSubstr;
using ::testing::Not;

struct ProcessResult {
  int exit_code = -1;
  std::string out, err;
};

// Runs argv[0] with `argv`, collecting stdout and stderr separately.
ProcessResult RunProcess(const std::vector<std::string>& argv) {
  int out[2], err[2];
  ProcessResult result;
  if (pipe2(out, O_CLOEXEC) != 0 || pipe2(err, O_CLOEXEC) != 0) return result;
  std::vector<std::string> storage = argv;
  std::vector<char*> args;
  for (std::string& a : storage) args.push_back(a.data());
  args.push_back(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    dup2(out[1], STDOUT_FILENO);
    dup2(err[1], STDERR_FILENO);
    execv(args[0], args.data());
    _exit(127);
  }
  close(out[1]);
  close(err[1]);
  pollfd fds[] = {{out[0], POLLIN, 0}, {err[0], POLLIN, 0}};
  std::string* sinks[] = {&result.out, &result.err};
  int open_fds = 2;
  while (open_fds > 0 && poll(fds, 2, -1) > 0) {
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || fds[i].revents == 0) continue;
      char buffer[4096];
      const ssize_t n = read(fds[i].fd, buffer, sizeof buffer);
      if (n > 0) {
        sinks[i]->append(buffer, n);
      } else {
        close(fds[i].fd);
        fds[i].fd = -1;
        --open_fds;
      }
    }
  }
  int status = 0;
  waitpid(pid, &status, 0);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return result;
}

std::string KvrecallBinary() { return testing::BuildProgram("client/kvrecall"); }

class CliTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    // The runs here send no token unless a test says so (the CLI's --token_file defaults to
    // $KVRECALL_TOKEN_FILE, which the environment running the tests might hold).
    unsetenv("KVRECALL_TOKEN_FILE");
    absl::StatusOr<std::unique_ptr<KvrecalldProcess>> server = KvrecalldProcess::Start();
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = server->release();
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }

  // kvrecall SUBCOMMAND --server=<the test's kvrecalld> ARGS...
  static ProcessResult Kvrecall(const std::string& subcommand, std::vector<std::string> args) {
    std::vector<std::string> argv = {KvrecallBinary(), subcommand,
                                     "--server=" + server_->address()};
    argv.insert(argv.end(), args.begin(), args.end());
    return RunProcess(argv);
  }

  // Decode steps of one layer of session `id` at `positions`, each with the same q, k and v,
  // through the client library (a runner that went on with one layer alone).
  static absl::Status StepLayerAlone(const std::string& id, int layer,
                                     const std::vector<int64_t>& positions,
                                     const std::vector<float>& q, const std::vector<float>& k,
                                     const std::vector<float>& v) {
    std::unique_ptr<client::Client> client = client::Client::Connect(server_->address());
    absl::StatusOr<v1::SessionInfo> info = client->GetSession(id);
    if (!info.ok()) return info.status();
    absl::StatusOr<std::unique_ptr<client::DecodeStream>> stream =
        client->OpenDecodeStream(info->geometry());
    if (!stream.ok()) return stream.status();
    client::StepResult result;
    for (int64_t position : positions) {
      const client::SequenceInput input{id, q, k, v, position};
      if (absl::Status s = (*stream)->Step(layer, {&input, 1}, {}, &result); !s.ok()) return s;
    }
    return (*stream)->Close();
  }

  static KvrecalldProcess* server_;
};

KvrecalldProcess* CliTest::server_ = nullptr;

// A real trace of the tinylm model (6 layers, 8 q / 2 kv heads, d=64): 512 prompt tokens and
// 8 decode steps, generated once per test binary by ../shared/models/tinylm_np.py.
class CliReplayTest : public CliTest {
 protected:
  static void SetUpTestSuite() {
    CliTest::SetUpTestSuite();
    const std::filesystem::path models =
        std::filesystem::path(KVRECALL_SOURCE_DIR) / ".." / "shared" / "models";
    if (!std::filesystem::exists(models / "tinylm_np.py") ||
        !std::filesystem::exists(models / "tinylm-a.npz")) {
      skip_reason_ = new std::string(absl::StrCat(
          "no real model at ", models.string(),
          " (CI and the dev machines have ../shared beside the clone); the replay tests need it"));
      return;
    }
    trace_ = new std::string(
        absl::StrCat(::testing::TempDir(), "/cli_tinylm_512.", getpid(), ".safetensors"));
    const ProcessResult made =
        RunProcess({"/usr/bin/python3", (models / "tinylm_np.py").string(), "trace", "--model",
                    (models / "tinylm-a.npz").string(), "--text", "/usr/lib/python3/dist-packages",
                    "--ctx", "512", "--decode", "8", "--out", *trace_});
    ASSERT_EQ(made.exit_code, 0) << made.out << made.err;
  }
  static void TearDownTestSuite() {
    if (trace_ != nullptr) std::filesystem::remove(*trace_);
    delete trace_;
    trace_ = nullptr;
    CliTest::TearDownTestSuite();
  }
  void SetUp() override {
    if (skip_reason_ != nullptr) GTEST_SKIP() << *skip_reason_;
  }

  // The single JSON object `kvrecall replay --json` printed.
  static nlohmann::json ReplayJson(std::vector<std::string> flags) {
    flags.push_back("--trace=" + *trace_);
    flags.push_back("--json");
    const ProcessResult r = Kvrecall("replay", flags);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << r.out;
    return nlohmann::json::parse(r.out, nullptr, /*allow_exceptions=*/false);
  }

  static std::string* trace_;
  static std::string* skip_reason_;
};

std::string* CliReplayTest::trace_ = nullptr;
std::string* CliReplayTest::skip_reason_ = nullptr;

TEST_F(CliReplayTest, FullAttentionOnARealTraceIsExact) {
  const nlohmann::json j = ReplayJson({"--policy=full"});
  ASSERT_TRUE(j.is_object());
  for (const char* key : {"policy", "layers", "q_heads", "kv_heads", "head_dim", "context", "steps",
                          "support_recall", "retained_mass", "output_cosine", "output_cosine_p05",
                          "rel_l2", "path_mix", "latency_us", "mean_candidates", "server_us"}) {
    EXPECT_TRUE(j.contains(key)) << key;
  }
  EXPECT_EQ(j["policy"], "full");
  EXPECT_EQ(j["layers"], 6);
  EXPECT_EQ(j["q_heads"], 8);
  EXPECT_EQ(j["kv_heads"], 2);
  EXPECT_EQ(j["head_dim"], 64);
  EXPECT_EQ(j["context"], 512);
  EXPECT_EQ(j["steps"], 8);
  EXPECT_GE(j["output_cosine"].get<double>(), 0.9999);
  EXPECT_GE(j["output_cosine_p05"].get<double>(), 0.9999);
  EXPECT_LT(j["rel_l2"].get<double>(), 1e-2);  // outputs travel as bf16
  EXPECT_DOUBLE_EQ(j["support_recall"].get<double>(), 1.0);
  EXPECT_NEAR(j["retained_mass"].get<double>(), 1.0, 1e-5);
  for (const char* path : {"reuse", "fallback", "refresh"}) {
    EXPECT_EQ(j["path_mix"][path].get<double>(), 0.0) << path;
  }
  EXPECT_GT(j["latency_us"]["p50"].get<double>(), 0.0);
  EXPECT_GE(j["latency_us"]["p99"].get<double>(), j["latency_us"]["p50"].get<double>());
  EXPECT_GT(j["server_us"]["p50"].get<double>(), 0.0);
}

TEST_F(CliReplayTest, ExactTopKAndStreamingReportTheirFigures) {
  const nlohmann::json topk = ReplayJson({"--policy=exact_topk", "--k=64", "--steps=4"});
  ASSERT_TRUE(topk.is_object());
  EXPECT_EQ(topk["policy"], "exact_topk");
  EXPECT_EQ(topk["top_k"], 64);
  EXPECT_EQ(topk["steps"], 4);
  // The support is the reference's own top-64: full recall, most of the mass.
  EXPECT_DOUBLE_EQ(topk["support_recall"].get<double>(), 1.0);
  EXPECT_GT(topk["retained_mass"].get<double>(), 0.5);
  EXPECT_LT(topk["retained_mass"].get<double>(), 1.0);
  EXPECT_LT(topk["output_cosine"].get<double>(), 0.99999);
  EXPECT_GT(topk["output_cosine"].get<double>(), 0.9);
  EXPECT_DOUBLE_EQ(topk["mean_support"].get<double>(), 64);

  // Dashed flag names work too.
  const nlohmann::json streaming =
      ReplayJson({"--policy=streaming", "--sinks=16", "--recent=48", "--k=64", "--steps=4"});
  ASSERT_TRUE(streaming.is_object());
  EXPECT_EQ(streaming["policy"], "streaming");
  EXPECT_LT(streaming["support_recall"].get<double>(), 1.0);
  EXPECT_GT(streaming["support_recall"].get<double>(), 0.0);
  EXPECT_LT(streaming["retained_mass"].get<double>(), topk["retained_mass"].get<double>());
  EXPECT_DOUBLE_EQ(streaming["mean_support"].get<double>(), 64);
  EXPECT_EQ(streaming["mean_candidates"].get<double>(), 0.0);
}

// --exact_flat_scan reaches the tiered placement's ReTopK: with a refresh on every step the
// exact path runs every step, and scanning the bulk flatly it finds the reference's top-K.
TEST_F(CliReplayTest, ReTopKExactFlatScanReachesTheTieredPlacement) {
  const std::vector<std::string> flags = {"--placement=tiered", "--policy=retopk", "--k=64",
                                          "--sinks=16", "--recent=64", "--refresh=1",
                                          "--steps=4"};
  std::vector<std::string> flat = flags;
  flat.push_back("--exact_flat_scan");
  const nlohmann::json scanned = ReplayJson(flat);
  ASSERT_TRUE(scanned.is_object());
  EXPECT_EQ(scanned["retopk"]["exact_flat_scan"], true);
  EXPECT_EQ(scanned["path_mix"]["refresh"].get<double>(), 1.0);
  EXPECT_DOUBLE_EQ(scanned["support_recall"].get<double>(), 1.0);
  const nlohmann::json searched = ReplayJson(flags);
  ASSERT_TRUE(searched.is_object());
  EXPECT_EQ(searched["retopk"]["exact_flat_scan"], false);
  EXPECT_EQ(searched["path_mix"]["refresh"].get<double>(), 1.0);
}

TEST_F(CliReplayTest, ServerRejectionsExitNonZeroWithTheServersMessage) {
  ProcessResult r = Kvrecall("replay", {"--trace=" + *trace_, "--policy=exact_topk", "--k=-5"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("kvrecall replay: INVALID_ARGUMENT: "));
  EXPECT_THAT(r.err, HasSubstr("policy.top_k must be >= 1, got -5"));
  EXPECT_EQ(r.out, "");

  r = Kvrecall("replay", {"--trace=" + *trace_, "--steps=9"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("steps (9) exceeds the 8 decode steps"));
  // Nothing measured is not a fidelity of 0 (it printed cosines of 0.0 for full attention).
  r = Kvrecall("replay", {"--trace=" + *trace_, "--steps=0"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("INVALID_ARGUMENT: nothing to replay: steps is 0"));
  EXPECT_EQ(r.out, "");
  r = Kvrecall("replay", {"--trace=" + *trace_, "--steps=-5"});  // replayed everything
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("steps must be >= 1 (or -1: all of the trace's), got -5"));
  r = Kvrecall("replay", {"--trace=" + *trace_, "--policy=retopk", "--refresh=-7"});  // was 128
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("--refresh must be >= 0 (or -1: the server's default), got -7"));
}

// `create`, `prefill` and `decode` take a session through a real trace a command at a time, as
// a runner would: each step's output is full attention over the trace's context (policy full),
// a later `decode` goes on from where the session stands (with one layer a token ahead), and
// what cannot be sent is refused by name.
TEST_F(CliReplayTest, PrefillAndDecodeATraceACommandAtATime) {
  const std::string trace_flag = "--trace=" + *trace_;
  absl::StatusOr<Trace> trace = Trace::Open(*trace_);
  ASSERT_TRUE(trace.ok()) << trace.status();
  const TraceGeometry& g = trace->geometry();
  ASSERT_EQ(g.context, 512);
  ASSERT_EQ(g.decode_steps, 8);
  const std::vector<std::string> geometry = {"--layers=6", "--q_heads=8", "--kv_heads=2",
                                             "--head_dim=64", "--dtype=f32"};
  std::vector<std::string> create = geometry;
  create.push_back("--policy=full");
  ProcessResult r = Kvrecall("create", create);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string id(absl::StripAsciiWhitespace(r.out));

  r = Kvrecall("decode", {id, trace_flag});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("kvrecall decode: FAILED_PRECONDITION: session " + id +
                               " has 0 of its 6 layers prefilled: send the trace's prompt first"));
  EXPECT_EQ(r.out, "");
  r = Kvrecall("prefill", {id, trace_flag});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr(id + ": 512 prompt tokens in 6 layers"));
  r = Kvrecall("prefill", {id, trace_flag});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("FAILED_PRECONDITION: layer 0 of session '" + id +
                               "' is already prefilled"));

  // Full attention over the trace's prompt and decode steps up to `step`, query head h.
  const int d = g.head_dim;
  auto reference = [&](int layer, int64_t step, int h) {
    const int64_t tokens = g.context + step + 1;
    std::vector<float> keys(tokens * g.kv_heads * d), values(keys.size());
    std::vector<float> q(static_cast<size_t>(g.q_heads) * d), o(d);
    for (auto [which, dest] :
         {std::pair{TraceTensor::kK, &keys}, std::pair{TraceTensor::kV, &values}}) {
      EXPECT_TRUE(
          trace->ReadRows(layer, TracePhase::kPrefill, which, 0, g.context, dest->data()).ok());
      EXPECT_TRUE(trace
                      ->ReadRows(layer, TracePhase::kDecode, which, 0, step + 1,
                                 dest->data() + g.context * g.kv_heads * d)
                      .ok());
    }
    EXPECT_TRUE(
        trace->ReadRows(layer, TracePhase::kDecode, TraceTensor::kQ, step, 1, q.data()).ok());
    const KvView view{keys.data(), values.data(), tokens, g.kv_heads, d};
    float lse;
    cpu::PartialAttentionRange(q.data() + h * d, view, KvHeadOf(h, g.q_heads, g.kv_heads), 0,
                               tokens, 1.0f / std::sqrt(static_cast<float>(d)), o.data(), &lse);
    return o;
  };
  r = Kvrecall("decode", {id, trace_flag, "--steps=2", "--json", "--outputs", "--compare_exact"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::vector<std::string> lines = absl::StrSplit(r.out, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 12u) << r.out;  // 2 steps of 6 layers, token-major
  for (size_t i = 0; i < lines.size(); ++i) {
    const nlohmann::json j = nlohmann::json::parse(lines[i], nullptr, false);
    ASSERT_TRUE(j.is_object()) << lines[i];
    const int64_t step = i / 6;
    const int layer = static_cast<int>(i % 6);
    EXPECT_EQ(j["step"], step);
    EXPECT_EQ(j["position"], 512 + step);
    EXPECT_EQ(j["layer"], layer);
    EXPECT_GT(j["server_micros"].get<double>(), 0);
    ASSERT_EQ(j["heads"].size(), 8u);
    ASSERT_EQ(j["output"].size(), 8u);
    for (int h = 0; h < 8; ++h) {
      EXPECT_EQ(j["heads"][h]["path"], "PATH_EXACT");
      EXPECT_GT(j["heads"][h]["output_cosine"].get<double>(), 0.99999);
      const std::vector<float> want = reference(layer, step, h);
      const std::vector<float> got = j["output"][h].get<std::vector<float>>();
      ASSERT_EQ(got.size(), want.size());
      for (int i = 0; i < d; ++i) EXPECT_NEAR(got[i], want[i], 1e-4) << layer << " " << h;
    }
  }

  // Layer 0 takes step 2 alone (a runner's step cut short after its first layer): the next
  // `decode` gives that step to the other five layers, then goes on.
  {
    std::vector<float> q(8 * d), k(2 * d), v(2 * d);
    for (auto [which, dest] : {std::pair{TraceTensor::kQ, &q}, std::pair{TraceTensor::kK, &k},
                               std::pair{TraceTensor::kV, &v}}) {
      ASSERT_TRUE(trace->ReadRows(0, TracePhase::kDecode, which, 2, 1, dest->data()).ok());
    }
    EXPECT_TRUE(StepLayerAlone(id, 0, {514}, q, k, v).ok());
  }
  r = Kvrecall("decode", {id, trace_flag, "--steps=1", "--outputs"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, Not(HasSubstr("layer 0:")));
  for (int layer = 1; layer < 6; ++layer) {
    EXPECT_THAT(r.out, HasSubstr(absl::StrCat("step 2 (position 514) layer ", layer, ": server ")));
  }
  EXPECT_THAT(r.out, HasSubstr("  head 7: "));
  EXPECT_THAT(r.out, HasSubstr(id + ": 5 layer-steps sent; its layers hold 515 tokens (3 of the 8 "
                                    "decode steps of "));
  r = Kvrecall("decode", {id, trace_flag, "--steps=6"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("OUT_OF_RANGE: --steps 6, but session " + id +
                               " stands at decode step 3 of the 8 of "));
  r = Kvrecall("decode", {id, trace_flag, "--json"});  // the rest: steps 3 to 7
  ASSERT_EQ(r.exit_code, 0) << r.err;
  lines = absl::StrSplit(r.out, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 30u) << r.out;
  EXPECT_EQ(nlohmann::json::parse(lines.back())["position"], 519);
  EXPECT_FALSE(nlohmann::json::parse(lines.back()).contains("heads"));  // none asked for
  r = Kvrecall("decode", {id, trace_flag});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("OUT_OF_RANGE: session " + id + " holds all 8 decode steps of "));
  r = Kvrecall("get", {id, "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out,
              HasSubstr("\"layer_tokens\":[\"520\",\"520\",\"520\",\"520\",\"520\",\"520\"]"));

  // Usage errors (exit 2) and what the server or the trace refuses (exit 1).
  r = Kvrecall("decode", {id, trace_flag, "--steps=0"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("--steps must be >= 1 (or -1: the rest of the trace's), got 0"));
  for (const char* subcommand : {"prefill", "decode"}) {
    r = Kvrecall(subcommand, {trace_flag});
    EXPECT_EQ(r.exit_code, 2) << subcommand;
    EXPECT_THAT(r.err, HasSubstr(absl::StrCat("usage: kvrecall ", subcommand, " SESSION_ID")));
    r = Kvrecall(subcommand, {id});
    EXPECT_EQ(r.exit_code, 2) << subcommand;
    EXPECT_THAT(r.err, HasSubstr("--trace FILE is required"));
    r = Kvrecall(subcommand, {"s-0123456789abcdef", trace_flag});
    EXPECT_EQ(r.exit_code, 1) << subcommand;
    EXPECT_THAT(r.err, HasSubstr("NOT_FOUND"));
  }
  std::vector<std::string> other = {"--layers=6", "--q_heads=8", "--kv_heads=2", "--head_dim=32"};
  r = Kvrecall("create", other);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string other_id(absl::StripAsciiWhitespace(r.out));
  for (const char* subcommand : {"prefill", "decode"}) {
    r = Kvrecall(subcommand, {other_id, trace_flag});
    EXPECT_EQ(r.exit_code, 1) << subcommand;
    EXPECT_THAT(r.err, HasSubstr("INVALID_ARGUMENT: " + *trace_ +
                                 " has 6 layers, 8 query heads, 2 KV heads and head_dim 64; "
                                 "session " +
                                 other_id + " has 6, 8, 2 and 32"));
  }
  EXPECT_EQ(Kvrecall("close", {id, other_id}).exit_code, 0);
}

// What `decode` cannot send is refused by name: a session prefilled from a prompt of another
// length, a trace with no decode steps, layers more than a token apart; and its text lines carry
// the server's fidelity with --compare_exact.
TEST_F(CliReplayTest, DecodeRefusesWhatItCannotSendByName) {
  testing::TempDirectory dir("cli_decode");
  ASSERT_NE(dir.path(), "");
  const std::vector<std::string> geometry = {"--layers=6", "--q_heads=8", "--kv_heads=2",
                                             "--head_dim=64"};
  for (const auto& [name, steps] : {std::pair{"short", "2"}, std::pair{"none", "0"}}) {
    std::vector<std::string> args = geometry;
    for (const std::string& a :
         {absl::StrCat("--out=", dir.Path(name)), std::string("--context=300"),
          absl::StrCat("--decode_steps=", steps), std::string("--needles=0")}) {
      args.push_back(a);
    }
    const ProcessResult made = Kvrecall("synth", args);
    ASSERT_EQ(made.exit_code, 0) << made.err;
  }
  ProcessResult r = Kvrecall("create", geometry);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string id(absl::StripAsciiWhitespace(r.out));
  r = Kvrecall("prefill", {id, "--trace=" + dir.Path("short")});
  ASSERT_EQ(r.exit_code, 0) << r.err;

  r = Kvrecall("decode", {id, "--trace=" + *trace_});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("FAILED_PRECONDITION: session " + id +
                               "'s prompt has 300 tokens "
                               "and " +
                               *trace_ +
                               "'s 512: the session was not prefilled from "
                               "this trace"));
  r = Kvrecall("decode", {id, "--trace=" + dir.Path("none")});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("OUT_OF_RANGE: " + dir.Path("none") +
                               " has no decode steps: nothing to send"));

  r = Kvrecall("decode", {id, "--trace=" + dir.Path("short"), "--steps=1", "--compare_exact"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("step 0 (position 300) layer 5: server "));
  EXPECT_THAT(r.out, HasSubstr("; paths exact 8; per head 301.0 candidates, 301.0 support; output "
                               "cosine 1.00000 (min 1.00000), support recall 1.000, retained "
                               "mass 1.000\n"));

  // Layer 0 two tokens ahead of the others (its runner went on alone): no whole step mends it.
  const std::vector<float> q(8 * 64, 0.5f), kv(2 * 64, 0.25f);
  EXPECT_TRUE(StepLayerAlone(id, 0, {301, 302}, q, kv, kv).ok());
  r = Kvrecall("decode", {id, "--trace=" + dir.Path("short")});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("FAILED_PRECONDITION: session " + id +
                               "'s layers hold from 301 to "
                               "303 tokens: more than one token apart"));
  EXPECT_EQ(r.out, "");
  EXPECT_EQ(Kvrecall("close", {id}).exit_code, 0);
}

// --help names the subcommands and lists their flags (Abseil's default looked for a source
// file named after the program and printed "No flags matched").
TEST(CliUsageTest, HelpListsTheSubcommandsAndTheirFlags) {
  const ProcessResult r = RunProcess({KvrecallBinary(), "--help"});
  const std::string all = r.out + r.err;
  for (const char* subcommand : {"demo", "create", "prefill", "decode", "get", "list", "close",
                                 "health", "replay", "synth", "bench-index"}) {
    EXPECT_THAT(all, HasSubstr(absl::StrCat("\n  ", subcommand, " "))) << subcommand;
  }
  EXPECT_THAT(all, HasSubstr("Flags from"));
  EXPECT_THAT(all, HasSubstr("--server ("));
  EXPECT_THAT(all, Not(HasSubstr("No flags matched")));
}

TEST_F(CliTest, SessionSubcommandsCreateGetListAndClose) {
  ProcessResult r = Kvrecall(
      "create", {"--layers=3", "--q-heads=8", "--kv-heads=2", "--head-dim=32", "--dtype=f16",
                 "--policy=exact_topk", "--k=16", "--label=cli test", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json created = nlohmann::json::parse(r.out);
  const std::string id = created["session_id"];
  EXPECT_EQ(created["policy"]["top_k"], 16);

  // The tiered exact search by name, and its N filled in (2 * K) in the effective policy (d = 64:
  // a GPU's tier serves 64 and 128).
  r = Kvrecall("create", {"--q-heads=8", "--kv-heads=2", "--head-dim=64", "--dtype=f16",
                          "--placement=tiered", "--policy=index", "--k=16",
                          "--exact_search=shortlist", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json tiered = nlohmann::json::parse(r.out);
  EXPECT_EQ(tiered["policy"]["index"]["exact_search"], "EXACT_SEARCH_SHORTLIST");
  EXPECT_EQ(tiered["policy"]["index"]["shortlist"], 32);
  ASSERT_EQ(Kvrecall("close", {tiered["session_id"]}).exit_code, 0);

  // --sinks, --recent and --W: -1 (their default) leaves the field unset, the server's
  // default; 0 is sent and served (none).
  r = Kvrecall("create", {"--policy=retopk", "--sinks=0", "--W=0", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json zeros = nlohmann::json::parse(r.out);
  EXPECT_EQ(zeros["policy"]["sinks"], 0);
  EXPECT_EQ(zeros["policy"]["recent"], 512);
  EXPECT_EQ(zeros["policy"]["retopk"]["recent_window"], 0);
  ASSERT_EQ(Kvrecall("close", {zeros["session_id"]}).exit_code, 0);

  // --max_tokens sets the KV aside at creation: 1000 tokens x k and v x 2 KV heads x d = 64 x
  // f32 (the flags' default geometry, one layer; the cpu placement keeps f32).
  r = Kvrecall("create", {"--max_tokens=1000", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string announced = nlohmann::json::parse(r.out)["session_id"];
  r = Kvrecall("get", {announced, "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_GE(std::stoll(nlohmann::json::parse(r.out)["host_budget_bytes"].get<std::string>()),
            1000 * 2 * 2 * 64 * 4);
  ASSERT_EQ(Kvrecall("close", {announced}).exit_code, 0);

  // --request_id: run again, the same session; other flags with it, ALREADY_EXISTS.
  r = Kvrecall("create", {"--request_id=cli-retry-1"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string first = r.out;
  r = Kvrecall("create", {"--request_id=cli-retry-1"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, first);
  r = Kvrecall("create", {"--request_id=cli-retry-1", "--label=other"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("ALREADY_EXISTS: request_id 'cli-retry-1' made session"));
  ASSERT_EQ(Kvrecall("close", {first.substr(0, first.size() - 1)}).exit_code, 0);

  r = Kvrecall("get", {id, "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json info = nlohmann::json::parse(r.out);
  EXPECT_EQ(info["geometry"]["layers"], 3);
  EXPECT_EQ(info["geometry"]["head_dim"], 32);
  EXPECT_EQ(info["geometry"]["dtype"], "DTYPE_F16");
  EXPECT_EQ(info["label"], "cli test");

  r = Kvrecall("list", {});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("SESSION"));
  EXPECT_THAT(r.out, HasSubstr(id));
  EXPECT_THAT(r.out, HasSubstr("exact_topk"));
  EXPECT_THAT(r.out, HasSubstr("3 x 8/2 x 32"));
  EXPECT_THAT(r.out, HasSubstr("HELD MiB"));  // what it holds of the host budget

  r = Kvrecall("close", {id});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "closed " + id + "\n");

  r = Kvrecall("get", {id});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.err, "kvrecall get: NOT_FOUND: session_id: no session '" + id + "'\n");
}

TEST_F(CliTest, ErrorsExitNonZeroWithTheServersCodeAndMessage) {
  ProcessResult r = Kvrecall("create", {"--q_heads=8", "--kv_heads=3"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("kvrecall create: INVALID_ARGUMENT: "));
  EXPECT_THAT(r.err, HasSubstr("kv_heads"));

  r = Kvrecall("close", {"no-such-session"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.err, "kvrecall close: NOT_FOUND: session_id: no session 'no-such-session'\n");

  // Usage errors are 2, found before anything is sent.
  r = Kvrecall("create", {"--policy=fastest"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("unknown selector 'fastest'; want one of full, exact_topk"));
  r = Kvrecall("create", {"--placement=tiered", "--policy=index", "--exact_search=fastest"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("unknown exact_search 'fastest'; want one of graph, shortlist"));
  r = Kvrecall("frobnicate", {});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("unknown subcommand 'frobnicate'"));
  r = Kvrecall("replay", {"--trace=/nonexistent.safetensors"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("NOT_FOUND: cannot open /nonexistent.safetensors"));

  // No server at all.
  r = RunProcess({KvrecallBinary(), "list", "--server=127.0.0.1:1"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("kvrecall list: UNAVAILABLE: "));
}

// What the CLI reads and writes locally (traces, flags of bench-index and synth, PEM files)
// is checked by flag name before any work, where it crashed, read past buffers, aborted or
// silently substituted defaults (probe 3).
TEST_F(CliTest, LocalInputsAreRefusedByFlagName) {
  const std::string trace =
      absl::StrCat(::testing::TempDir(), "/cli_local.", getpid(), ".safetensors");
  ProcessResult r = RunProcess({KvrecallBinary(), "synth", "--out=" + trace, "--context=512",
                                "--decode_steps=4", "--needles=1", "--layers=1"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  struct Case {
    std::vector<std::string> args;
    int exit_code;
    std::string message;
  };
  const Case cases[] = {
      {{"bench-index", "--sinks=-1000000"}, 2, "--sinks must be >= 0 (0: none left out)"},
      {{"bench-index", "--recent=-100"}, 2, "--recent must be >= 0 (0: none left out)"},
      {{"bench-index", "--k=-5"}, 2, "--k must be >= 0 (0: 100), got -5"},
      {{"bench-index", "--lists=100,0"}, 2, "--lists must be >= 1 each, got 0"},
      {{"bench-index", "--build_queries=-5"}, 2, "--build_queries must be >= 0 (0: the default)"},
      {{"bench-index", "--search_width=-3"}, 2, "--search_width must be >= 0"},
      {{"bench-index", "--build_queries=99999999"}, 2, "policy.index.build_queries must be <="},
      {{"bench-index", "--hnsw_m=1"}, 2, "--hnsw_m must be >= 2"},
      {{"bench-index", "--index_layers=-1"}, 2, "--index_layers takes non-negative integers"},
      {{"demo", "--decode_steps=0"}, 2, "--decode_steps must be >= 1, got 0"},
      {{"synth", "--out=" + trace + ".x", "--context=100000000000"}, 2,
       "context must be in [1, 2147483647], got 100000000000"},
      {{"synth", "--out=" + trace + ".x", "--topics=2000000000"}, 2, "topics must be in [1, "},
      {{"synth", "--out=" + trace + ".x", "--context=4"}, 2,
       "sinks (attention-sink tokens) must be in [0, context = 4), got 4"},
      {{"replay", "--trace=" + ::testing::TempDir()}, 1, "is not a regular file"},
      {{"replay", "--trace=" + trace, "--prefill_timeout=0"}, 2,
       "--prefill_timeout must be positive, got 0"},
      {{"demo", "--timeout=-1s"}, 2, "--timeout must be positive, got -1s"},
      {{"list", "--timeout=0"}, 2, "--timeout must be positive, got 0"},
      {{"prefill", "x", "--prefill_timeout=-5s"}, 2,
       "--prefill_timeout must be positive, got -5s"},
      // A flag the subcommand does not read is refused, not ignored: which ones do is said.
      {{"get", "x", "--prefill_timeout=5s"}, 2,
       "kvrecall get: --prefill_timeout is not a flag of get (read by demo, prefill, replay)"},
      {{"list", "--policy=retopk"}, 2,
       "kvrecall list: --policy is not a flag of list (read by create, replay)"},
      {{"synth", "--out=" + trace + ".x", "--k=5"}, 2,
       "kvrecall synth: --k is not a flag of synth (read by create, replay, bench-index)"},
      {{"list", "--tls_ca=" + trace}, 1, "--tls_ca: " + trace + " is not a PEM file"},
  };
  for (const Case& c : cases) {
    std::vector<std::string> argv = {KvrecallBinary()};
    argv.insert(argv.end(), c.args.begin(), c.args.end());
    if (c.args[0] == "bench-index") argv.push_back("--trace=" + trace);
    if (c.args[0] == "replay" || c.args[0] == "demo") argv.push_back("--server=127.0.0.1:1");
    r = RunProcess(argv);
    EXPECT_EQ(r.exit_code, c.exit_code) << c.args[1] << ": " << r.err;
    EXPECT_THAT(r.err, HasSubstr(c.message)) << c.args[1];
    EXPECT_EQ(r.out, "") << c.args[1];
  }
  EXPECT_FALSE(std::filesystem::exists(trace + ".x"));
  std::filesystem::remove(trace);
}

// Traces the service would refuse are refused where they are made or read (probe 21, 6 and 7):
// synth's knobs that push a value past what f16 holds or to infinity, and bench-index on a
// trace holding NaN (it reported recall 1.0: a NaN query found every list "exact").
TEST_F(CliTest, TracesOfValuesTheServiceRefusesAreRefused) {
  testing::TempDirectory dir("cli-values");
  ASSERT_NE(dir.path(), "");
  const std::vector<std::string> synth = {KvrecallBinary(), "synth", "--context=256",
                                          "--decode_steps=8", "--layers=1"};
  auto with = [&](std::vector<std::string> args, const std::vector<std::string>& more) {
    args.insert(args.end(), more.begin(), more.end());
    return args;
  };
  ProcessResult r = RunProcess(with(synth, {"--out=" + dir.Path("noisy"), "--decode_noise=1e38"}));
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_THAT(r.err, HasSubstr("beyond the +-65504 the service takes: lower decode_noise"));
  EXPECT_FALSE(std::filesystem::exists(dir.Path("noisy")));
  r = RunProcess(with(synth, {"--out=" + dir.Path("flat"), "--rope_base=inf"}));
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_THAT(r.err, HasSubstr("rope_base must be finite and > 1, got inf"));

  // A trace whose first prompt key is NaN (f32, so the value lands as written).
  const std::string trace = dir.Path("trace");
  r = RunProcess(with(synth, {"--out=" + trace, "--dtype=f32"}));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  {
    // safetensors: an 8-byte little-endian header length, the JSON header, then the data.
    std::fstream f(trace, std::ios::in | std::ios::out | std::ios::binary);
    uint64_t header_bytes = 0;
    f.read(reinterpret_cast<char*>(&header_bytes), sizeof header_bytes);
    std::string header(header_bytes, '\0');
    f.read(header.data(), static_cast<std::streamsize>(header_bytes));
    const nlohmann::json j = nlohmann::json::parse(header);
    const int64_t at = 8 + static_cast<int64_t>(header_bytes) +
                       j.at("layer0.prefill.k").at("data_offsets")[0].get<int64_t>();
    const float nan = std::nanf("");
    f.seekp(at);
    f.write(reinterpret_cast<const char*>(&nan), sizeof nan);
  }
  r = RunProcess({KvrecallBinary(), "bench-index", "--trace=" + trace, "--methods=flat"});
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_THAT(r.err, HasSubstr("layer 0 prefill k holds nan at element 0"));
}

// An interrupted synth removes its temporary file (it left gigabytes of ".partial-" files at
// 1M tokens: probe 21, 5) and ends as the signal ends a process.
TEST_F(CliTest, AnInterruptedSynthLeavesNoPartialFile) {
  testing::TempDirectory dir("cli-partial");
  ASSERT_NE(dir.path(), "");
  const std::string out = dir.Path("big.safetensors");
  const std::string binary = KvrecallBinary();
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    const int null = open("/dev/null", O_WRONLY);
    dup2(null, 1);
    dup2(null, 2);
    execl(binary.c_str(), binary.c_str(), "synth", ("--out=" + out).c_str(), "--context=1048576",
          "--decode_steps=16", "--q_heads=32", "--kv_heads=8", "--head_dim=128", "--layers=4",
          static_cast<char*>(nullptr));
    _exit(127);
  }
  auto partial = [&] {
    for (const auto& entry : std::filesystem::directory_iterator(dir.path())) {
      if (absl::StrContains(entry.path().filename().string(), ".partial-")) return true;
    }
    return false;
  };
  const bool started = testing::Within(absl::Seconds(60), partial);
  kill(pid, SIGTERM);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(started) << "synth made no partial file";
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGTERM) << status;
  EXPECT_FALSE(partial());
  EXPECT_FALSE(std::filesystem::exists(out));
}

// --token_file and its default, $KVRECALL_TOKEN_FILE: the file is read before anything is
// sent (an unreadable or empty one exits 1 naming the flag or the variable and the file), a
// token alone to this plaintext HOST:PORT server means TLS and so gets no answer (never a
// plaintext call carrying it), --token_file= sends none, and to a unix-abstract:NAME server a
// token alone is refused. (tests/auth_tls_test.cc sends tokens to servers that check them.)
TEST_F(CliTest, TokenFileAndItsEnvironmentDefault) {
  testing::TempDirectory dir("cli-token");
  ASSERT_NE(dir.path(), "");
  const std::string token = dir.Path("runner.token");
  const std::string empty = dir.Path("empty.token");
  {
    std::ofstream(token) << "runner-token-0123456789\n";
    std::ofstream(empty) << "";
  }
  ProcessResult r = Kvrecall("list", {"--token_file=" + dir.Path("absent.token")});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("kvrecall list: NOT_FOUND: --token_file: cannot read " +
                               dir.Path("absent.token") + ": No such file or directory"));
  r = Kvrecall("list", {"--token_file=" + empty});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("kvrecall list: INVALID_ARGUMENT: --token_file: " + empty +
                               " is empty"));
  r = Kvrecall("list", {"--token_file=" + token});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("kvrecall list: UNAVAILABLE: "));  // TLS to a plaintext port
  {
    ScopedEnv env("KVRECALL_TOKEN_FILE", dir.Path("absent.token").c_str());
    r = Kvrecall("list", {});
    EXPECT_EQ(r.exit_code, 1);
    EXPECT_THAT(r.err, HasSubstr("kvrecall list: NOT_FOUND: $KVRECALL_TOKEN_FILE: cannot read " +
                                 dir.Path("absent.token")));
    r = Kvrecall("list", {"--token_file=" + empty});  // the flag wins over the variable
    EXPECT_THAT(r.err, HasSubstr("INVALID_ARGUMENT: --token_file: " + empty + " is empty"));
  }
  {
    ScopedEnv env("KVRECALL_TOKEN_FILE", token.c_str());
    r = Kvrecall("list", {});
    EXPECT_EQ(r.exit_code, 1);
    EXPECT_THAT(r.err, HasSubstr("kvrecall list: UNAVAILABLE: "));
    r = Kvrecall("list", {"--token_file="});
    EXPECT_EQ(r.exit_code, 0) << r.err;
    EXPECT_THAT(r.out, HasSubstr("SESSION"));
    r = RunProcess({KvrecallBinary(), "list", "--server=unix-abstract:kvrecall-cli-token-test"});
    EXPECT_EQ(r.exit_code, 1);
    EXPECT_THAT(r.err, HasSubstr("kvrecall list: INVALID_ARGUMENT: a bearer token to "
                                 "unix-abstract:kvrecall-cli-token-test without TLS"));
  }
}

// `kvrecall health` asks grpc.health.v1 of the API port and of the health-only port that
// kvrecalld serves beside a TLS port (which has no reflection for grpcurl-style clients): its
// status on stdout, exit 0 only when SERVING.
TEST_F(CliTest, HealthAsksTheServerOrItsHealthPort) {
  ProcessResult r = Kvrecall("health", {});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "SERVING\n");
  r = Kvrecall("health", {"kvrecall.v1.KvRecall", "--json"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "{\"status\":\"SERVING\"}\n");
  r = Kvrecall("health", {"kvrecall.v1.NoSuchService"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("kvrecall health: NOT_FOUND: unknown service "
                               "'kvrecall.v1.NoSuchService'"));
  r = Kvrecall("health", {"a", "b"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("usage: kvrecall health [SERVICE]"));
  r = Kvrecall("health", {"--health_deadline=0s"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("--health_deadline must be positive"));

  absl::StatusOr<std::unique_ptr<KvrecalldProcess>> with_health_port =
      KvrecalldProcess::Start({"--health_address=127.0.0.1:0"});
  ASSERT_TRUE(with_health_port.ok()) << with_health_port.status();
  const std::string output = (*with_health_port)->output();
  const std::string marker = "kvrecalld health on ";
  const size_t at = output.find(marker);
  ASSERT_NE(at, std::string::npos) << output;
  const std::string health_port =
      output.substr(at + marker.size(), output.find('\n', at) - at - marker.size());
  r = RunProcess({KvrecallBinary(), "health", "kvrecall.v1.KvRecall", "--server=" + health_port});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "SERVING\n");
  // TLS asked of a plaintext port, and nobody listening: the deadline says why, exit 1.
  r = RunProcess({KvrecallBinary(), "health", "--server=" + health_port, "--tls",
                  "--health_deadline=2s"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("kvrecall health: UNAVAILABLE: could not connect to " +
                               health_port + " within --health_deadline=2s"));
  ASSERT_TRUE((*with_health_port)->Stop().ok());
  r = RunProcess({KvrecallBinary(), "health", "--server=" + health_port, "--health_deadline=1s"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("kvrecall health: UNAVAILABLE: could not connect to "));
}

TEST_F(CliTest, DemoPrintsATableOfPolicies) {
  const ProcessResult r = Kvrecall("demo", {"--context=1024", "--decode_steps=4"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("1024 prompt tokens, 4 decode steps"));
  for (const char* row :
       {"full", "exact_topk K=128", "streaming 16+256", "index K=128", "retopk K=128"}) {
    EXPECT_THAT(r.out, HasSubstr(row));
  }
  // The full row: recall and mass 1, cosine 1.
  EXPECT_THAT(r.out, ::testing::ContainsRegex("\nfull +1\\.000 +1\\.000 +1\\.0000"));
}

// buf (installed by scripts/install_deps.sh into .tools/) speaks reflection: no .proto needed.
std::string FindBuf() {
  const std::string local = std::string(KVRECALL_SOURCE_DIR) + "/.tools/node_modules/.bin/buf";
  return std::filesystem::exists(local) ? local : "";
}

std::string JsonFloats(const std::vector<float>& v) {
  return absl::StrCat("[", absl::StrJoin(v, ", "), "]");
}

TEST_F(CliTest, PlainFloatJsonPrefillAndDecodeThroughBufCurl) {
  const std::string buf = FindBuf();
  if (buf.empty()) GTEST_SKIP() << "buf is not installed (scripts/install_deps.sh installs it)";
  const std::string url = "http://" + server_->address() + "/kvrecall.v1.KvRecall/";
  auto curl = [&](const std::string& method, const std::string& data) {
    return RunProcess(
        {buf, "curl", "--protocol", "grpc", "--http2-prior-knowledge", "-d", data, url + method});
  };
  // 1 layer, 2 query heads sharing 1 KV head of dim 4; a 3-token prompt in two chunks.
  ProcessResult r = curl("CreateSession",
                         R"({"geometry": {"layers": 1, "q_heads": 2, "kv_heads": 1,
                             "head_dim": 4, "dtype": "DTYPE_BF16"},
                             "policy": {"selector": "SELECTOR_FULL"}})");
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const std::string id = nlohmann::json::parse(r.out)["sessionId"];

  const std::vector<float> keys = {0.5f, -1,   0.25f, 2, 1,      0,    -0.5f,  0.75f,
                                   -2,   1.5f, 1,     0, 0.125f, 0.5f, -0.25f, 1};
  const std::vector<float> values = {1, 2, 3, 4, -1, 0, 1, 0, 0.5f, 0.5f, -2, 1, 3, -1, 0, 2};
  const std::vector<float> prompt_q(3 * 2 * 4, 0.5f);
  auto slice = [](const std::vector<float>& v, size_t begin, size_t n) {
    return std::vector<float>(v.begin() + begin, v.begin() + begin + n);
  };
  const std::string chunk0 =
      absl::StrCat(R"({"session_id": ")", id,
                   R"(", "layer": 0, "offset": 0, "q": {"shape": [2, 2, 4], "values": )",
                   JsonFloats(slice(prompt_q, 0, 16)), R"(}, "k": {"shape": [2, 1, 4], "values": )",
                   JsonFloats(slice(keys, 0, 8)), R"(}, "v": {"shape": [2, 1, 4], "values": )",
                   JsonFloats(slice(values, 0, 8)), "}}");
  const std::string chunk1 =
      absl::StrCat(R"({"layer": 0, "offset": 2, "q": {"shape": [1, 2, 4], "values": )",
                   JsonFloats(slice(prompt_q, 16, 8)), R"(}, "k": {"shape": [1, 1, 4], "values": )",
                   JsonFloats(slice(keys, 8, 4)), R"(}, "v": {"shape": [1, 1, 4], "values": )",
                   JsonFloats(slice(values, 8, 4)), "}}");
  r = curl("Prefill", chunk0 + "\n" + chunk1);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_EQ(nlohmann::json::parse(r.out)["tokens"], "3");  // int64 is a JSON string

  const std::vector<float> q = {1, 0.5f, -1, 0.25f, -0.5f, 2, 0, 1};
  r = curl(
      "Decode",
      absl::StrCat(
          R"({"request_id": 7, "layer": 0, "return_lse": true, "steps": [{"session_id": ")", id,
          R"(", "q": {"shape": [2, 4], "values": )", JsonFloats(q),
          R"(}, "k_new": {"shape": [1, 4], "values": )", JsonFloats(slice(keys, 12, 4)),
          R"(}, "v_new": {"shape": [1, 4], "values": )", JsonFloats(slice(values, 12, 4)), "}}]}"));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const nlohmann::json reply = nlohmann::json::parse(r.out);
  EXPECT_EQ(reply["requestId"], "7");
  const nlohmann::json& result = reply["results"][0];
  EXPECT_EQ(result["position"], "3");
  const std::vector<float> output = result["output"]["values"].get<std::vector<float>>();
  ASSERT_EQ(output.size(), 8u);
  // Every number above is exact in bf16, so the server attends over exactly these keys.
  const KvView kv{keys.data(), values.data(), 4, 1, 4};
  for (int h = 0; h < 2; ++h) {
    std::vector<double> want;
    const double lse =
        testing::ReferenceAttention(q.data() + 4 * h, kv, 0, testing::AllTokens(4), 0.5, &want);
    for (int i = 0; i < 4; ++i) EXPECT_NEAR(output[4 * h + i], want[i], 1e-5) << h << "," << i;
    EXPECT_NEAR(result["lse"]["values"][h].get<double>(), lse, 1e-5);
  }
}

}  // namespace
}  // namespace kvrecall
