#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/trace/safetensors.h"
#include "client/trace/trace.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/dtype.h"
#include "tests/test_util.h"

namespace kvrecall {
namespace {

using ::testing::HasSubstr;

// A path under the test's temporary directory, removed at destruction.
class TempPath {
 public:
  explicit TempPath(const std::string& name)
      : path_(::testing::TempDir() + "/" + name + "." + std::to_string(::getpid())) {}
  ~TempPath() { std::remove(path_.c_str()); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A safetensors file made of a raw header text and `data_bytes` zero bytes of data.
std::string RawFile(const std::string& header, size_t data_bytes) {
  std::string out(8, '\0');
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + header + std::string(data_bytes, '\0');
}

absl::Status ParseStatus(const std::string& bytes) {
  return SafetensorsFile::FromBytes(bytes, "bad.safetensors").status();
}

float RoundTo(v1::DType dtype, float x) {
  if (dtype == v1::DTYPE_BF16) return Bf16ToFloat(FloatToBf16(x));
  if (dtype == v1::DTYPE_F16) return F16ToFloat(FloatToF16(x));
  return x;
}

TEST(SafetensorsTest, StreamingWriterRoundTripsEveryDTypeAcrossChunkBoundaries) {
  const std::vector<SafetensorsTensorSpec> specs = {
      {"a", v1::DTYPE_F32, {3, 4}}, {"b", v1::DTYPE_BF16, {5}}, {"c", v1::DTYPE_F16, {2, 2, 2}}};
  const std::vector<float> all = testing::RandomNormal(12 + 5 + 8, 7);
  TempPath tmp("st_roundtrip");
  auto writer = SafetensorsWriter::Create(tmp.path(), specs, {{"source", "test"}});
  ASSERT_TRUE(writer.ok()) << writer.status();
  // Chunks of 7 end mid-tensor and span tensor boundaries.
  for (size_t at = 0; at < all.size(); at += 7) {
    const size_t n = std::min<size_t>(7, all.size() - at);
    ASSERT_TRUE((*writer)->Append(std::span<const float>(all).subspan(at, n)).ok());
  }
  EXPECT_EQ((*writer)->remaining_elements(), 0);
  ASSERT_TRUE((*writer)->Finish().ok());

  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(tmp.path());
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->metadata().at("source"), "test");
  size_t at = 0;
  for (const SafetensorsTensorSpec& spec : specs) {
    const SafetensorsTensor* t = *file->Find(spec.name);
    EXPECT_EQ(t->dtype, spec.dtype);
    EXPECT_EQ(t->shape, spec.shape);
    absl::StatusOr<std::vector<float>> got = file->ReadF32(spec.name);
    ASSERT_TRUE(got.ok());
    for (size_t i = 0; i < got->size(); ++i) {
      EXPECT_EQ((*got)[i], RoundTo(spec.dtype, all[at + i])) << spec.name << "[" << i << "]";
    }
    at += got->size();
  }
  // The in-memory serializer writes the same bytes.
  std::vector<std::span<const float>> data = {std::span<const float>(all).subspan(0, 12),
                                              std::span<const float>(all).subspan(12, 5),
                                              std::span<const float>(all).subspan(17, 8)};
  absl::StatusOr<std::string> bytes = SerializeSafetensors(specs, data, {{"source", "test"}});
  ASSERT_TRUE(bytes.ok());
  EXPECT_EQ(*bytes, ReadAll(tmp.path()));
}

TEST(SafetensorsTest, ReadRowsReadsARangeAndRejectsOutOfRange) {
  const std::vector<float> values = {0, 1, 2, 3, 4, 5, 6, 7};
  const std::vector<SafetensorsTensorSpec> specs = {{"x", v1::DTYPE_F32, {4, 2}}};
  const std::span<const float> data[] = {values};
  absl::StatusOr<SafetensorsFile> file =
      SafetensorsFile::FromBytes(*SerializeSafetensors(specs, data, {}), "mem");
  ASSERT_TRUE(file.ok()) << file.status();
  float rows[4];
  ASSERT_TRUE(file->ReadRows("x", 1, 2, rows).ok());
  EXPECT_THAT(rows, ::testing::ElementsAre(2, 3, 4, 5));
  absl::Status s = file->ReadRows("x", 3, 2, rows);
  EXPECT_EQ(s.code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(s.message(), HasSubstr("rows [3, 5) of tensor 'x' with 4 rows"));
  EXPECT_EQ(file->ReadF32("y").status().code(), absl::StatusCode::kNotFound);
}

TEST(SafetensorsTest, MovedFromBytesFileKeepsValidDataPointers) {
  const std::vector<float> values = {1.5f, -2.0f};
  const std::vector<SafetensorsTensorSpec> specs = {{"x", v1::DTYPE_F32, {2}}};
  const std::span<const float> data[] = {values};
  absl::StatusOr<SafetensorsFile> file =
      SafetensorsFile::FromBytes(*SerializeSafetensors(specs, data, {}), "mem");
  ASSERT_TRUE(file.ok());
  SafetensorsFile moved = *std::move(file);
  EXPECT_THAT(*moved.ReadF32("x"), ::testing::ElementsAre(1.5f, -2.0f));
}

TEST(SafetensorsTest, RejectsCorruptFilesWithClearErrors) {
  struct Case {
    std::string bytes;
    std::string message;
  };
  const std::string ok_entry = R"("x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  std::string huge_len = RawFile("{}", 0);
  huge_len[0] = static_cast<char>(0xff);
  const Case cases[] = {
      {"abc", "shorter than 8"},
      {huge_len, "runs past the end of the file"},
      {RawFile("{not json", 0), "header is not a JSON object"},
      {RawFile("[1,2]", 0), "header is not a JSON object"},
      {RawFile(R"({"x":{"dtype":"I32","shape":[2],"data_offsets":[0,8]}})", 8),
       "dtype I32 is not supported"},
      {RawFile(R"({"x":{"shape":[2],"data_offsets":[0,8]}})", 8), "dtype missing"},
      {RawFile(R"({"x":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8),
       "shape[0] is not a non-negative integer (a JSON number)"},
      {RawFile(R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", 8),
       "data_offsets must be two non-negative integers"},
      {RawFile(R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,16]}})", 8),
       "lie outside the data region of 8 bytes"},
      {RawFile(R"({"x":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8),
       "data_offsets span 8 bytes, shape [3] of F32 needs 12"},
      {RawFile("{" + ok_entry + R"(,"y":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8),
       "overlaps the tensor before it"},
      {RawFile(R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8),
       "data region has a hole at bytes [0, 4)"},
      {RawFile("{" + ok_entry + "}", 12), "4 bytes after the last tensor"},
      {RawFile("{" + ok_entry + R"(,"__metadata__":{"n":3}})", 8),
       "__metadata__.n is not a string"},
  };
  for (const Case& c : cases) {
    absl::Status s = ParseStatus(c.bytes);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_THAT(s.message(), HasSubstr(c.message));
    EXPECT_THAT(s.message(), HasSubstr("bad.safetensors"));
  }
}

// Headers a hostile file can hold that the cases above do not: a shape nested 10^5 deep (its
// message once dumped the JSON, recursing per level: a stack overflow) and a tensor with no rows
// whose rows' size overflows (row_elements multiplied it unchecked).
TEST(SafetensorsTest, RejectsDeepAndOverflowingShapesWithoutEchoingThem) {
  const int depth = 100000;
  const std::string deep = R"({"x":{"dtype":"F32","shape":)" + std::string(depth, '[') +
                           std::string(depth, ']') + R"(,"data_offsets":[0,0]}})";
  absl::Status s = ParseStatus(RawFile(deep, 0));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(),
              HasSubstr("tensor 'x': shape[0] is not a non-negative integer (a JSON array)"));
  EXPECT_LT(s.message().size(), 200u);
  s = ParseStatus(RawFile(
      R"({"x":{"dtype":"F32","shape":[0,4611686018427387904,4611686018427387904],)"
      R"("data_offsets":[0,0]}})",
      0));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("overflows 64-bit element counts"));
}

TEST(SafetensorsTest, OpenRefusesWhatIsNotARegularFile) {
  const std::string fifo = ::testing::TempDir() + "/st_fifo." + std::to_string(::getpid());
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  // A FIFO with no writer: opening it must not block.
  for (const std::string& path : {::testing::TempDir(), fifo}) {
    absl::Status s = SafetensorsFile::Open(path).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << path;
    EXPECT_THAT(s.message(), HasSubstr(path + " is not a regular file"));
  }
  std::remove(fifo.c_str());
}

TEST(SafetensorsTest, OpenReportsAMissingFile) {
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open("/nonexistent/x.safetensors");
  EXPECT_EQ(file.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(file.status().message(), HasSubstr("/nonexistent/x.safetensors"));
}

TEST(SafetensorsTest, WriterRejectsMisuse) {
  TempPath tmp("st_misuse");
  EXPECT_THAT(SafetensorsWriter::Create(tmp.path(),
                                        {{"a", v1::DTYPE_F32, {1}}, {"a", v1::DTYPE_F32, {1}}}, {})
                  .status()
                  .message(),
              HasSubstr("tensor 'a' declared twice"));
  EXPECT_THAT(SafetensorsWriter::Create(tmp.path(), {{"__metadata__", v1::DTYPE_F32, {1}}}, {})
                  .status()
                  .message(),
              HasSubstr("invalid tensor name"));
  EXPECT_THAT(
      SafetensorsWriter::Create(tmp.path(), {{"a", v1::DTYPE_F32, {-1}}}, {}).status().message(),
      HasSubstr("invalid shape [-1]"));

  auto writer = SafetensorsWriter::Create(tmp.path(), {{"a", v1::DTYPE_F32, {2}}}, {});
  ASSERT_TRUE(writer.ok());
  const float three[] = {1, 2, 3};
  absl::Status s = (*writer)->Append(std::span<const float>(three).first(1));
  ASSERT_TRUE(s.ok());
  s = (*writer)->Finish();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("1 elements not written, starting in tensor 'a'"));
  auto writer2 = SafetensorsWriter::Create(tmp.path(), {{"a", v1::DTYPE_F32, {2}}}, {});
  s = (*writer2)->Append(three);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("1 values appended past the last declared tensor"));
}

// The files in `dir` whose names start with `prefix`.
std::vector<std::string> FilesStartingWith(const std::string& dir, const std::string& prefix) {
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(prefix, 0) == 0) names.push_back(name);
  }
  return names;
}

// A writer replaces its file only when it finishes: a reader that has the old file mapped reads
// it whole throughout (once truncated in place: SIGBUS), and a writer abandoned or failed leaves
// the old file and no temporary one.
TEST(SafetensorsTest, AWriterReplacesItsFileOnlyWhenFinished) {
  TempPath tmp("st_replace");
  const std::string name = std::filesystem::path(tmp.path()).filename().string();
  const std::string dir = std::filesystem::path(tmp.path()).parent_path().string();
  auto write = [&](float value, bool finish) {
    auto w = SafetensorsWriter::Create(tmp.path(), {{"a", v1::DTYPE_F32, {1024}}}, {});
    ASSERT_TRUE(w.ok()) << w.status();
    const std::vector<float> values(finish ? 1024 : 512, value);
    ASSERT_TRUE((*w)->Append(values).ok());
    if (finish) ASSERT_TRUE((*w)->Finish().ok());
  };
  write(1.0f, true);
  absl::StatusOr<SafetensorsFile> old = SafetensorsFile::Open(tmp.path());
  ASSERT_TRUE(old.ok()) << old.status();
  const std::string before = ReadAll(tmp.path());
  write(2.0f, false);  // abandoned half-way
  EXPECT_EQ(ReadAll(tmp.path()), before);
  EXPECT_EQ(FilesStartingWith(dir, name), std::vector<std::string>{name});
  auto unfinished = SafetensorsWriter::Create(tmp.path(), {{"a", v1::DTYPE_F32, {1024}}}, {});
  ASSERT_TRUE(unfinished.ok());
  EXPECT_FALSE((*unfinished)->Finish().ok());  // elements missing: a failed writer
  unfinished->reset();
  EXPECT_EQ(ReadAll(tmp.path()), before);
  write(3.0f, true);
  absl::StatusOr<std::vector<float>> now = SafetensorsFile::Open(tmp.path())->ReadF32("a");
  ASSERT_TRUE(now.ok());
  EXPECT_EQ(*now, std::vector<float>(1024, 3.0f));
  absl::StatusOr<std::vector<float>> then = old->ReadF32("a");  // the replaced file, still mapped
  ASSERT_TRUE(then.ok());
  EXPECT_EQ(*then, std::vector<float>(1024, 1.0f));
  EXPECT_EQ(FilesStartingWith(dir, name), std::vector<std::string>{name});
}

// What the path names is kept: a symlink stays a link (its target gets the new file), a file's
// permission bits stay, and what is not a regular file is written in place, never replaced (as
// root, `synth --out /dev/null` would have replaced the system's /dev/null with a file).
TEST(SafetensorsTest, AWriterKeepsLinksModesAndDevices) {
  testing::TempDirectory dir("st_keep");
  const std::string target = dir.Path("real.st"), link = dir.Path("link.st");
  auto write = [](const std::string& path, float value) {
    auto w = SafetensorsWriter::Create(path, {{"a", v1::DTYPE_F32, {4}}}, {});
    ASSERT_TRUE(w.ok()) << w.status();
    ASSERT_TRUE((*w)->Append(std::vector<float>(4, value)).ok());
    ASSERT_TRUE((*w)->Finish().ok());
  };
  write(target, 1.0f);
  ASSERT_EQ(::chmod(target.c_str(), 0640), 0);
  ASSERT_EQ(::symlink(target.c_str(), link.c_str()), 0);
  write(link, 2.0f);
  EXPECT_TRUE(std::filesystem::is_symlink(link));
  EXPECT_EQ(*SafetensorsFile::Open(target)->ReadF32("a"), std::vector<float>(4, 2.0f));
  struct stat st;
  ASSERT_EQ(::stat(target.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0640u);
  write("/dev/null", 3.0f);
  ASSERT_EQ(::stat("/dev/null", &st), 0);
  EXPECT_TRUE(S_ISCHR(st.st_mode));
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir.path()),
                          std::filesystem::directory_iterator()),
            2);  // no temporary file left
}

TEST(SafetensorsTest, WriterRefusesAFilePast2To63Bytes) {
  TempPath tmp("st_huge");
  absl::Status s = SafetensorsWriter::Create(tmp.path(),
                                             {{"a", v1::DTYPE_F32, {int64_t{1} << 62}}}, {})
                       .status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("takes the file past 2^63 bytes"));
  s = SafetensorsWriter::Create(tmp.path(),
                                {{"a", v1::DTYPE_BF16, {int64_t{1} << 60}},
                                 {"b", v1::DTYPE_BF16, {int64_t{1} << 60}},
                                 {"c", v1::DTYPE_BF16, {int64_t{1} << 60}},
                                 {"d", v1::DTYPE_BF16, {int64_t{1} << 60}}},
                                {})
          .status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("tensor 'd'"));
  EXPECT_FALSE(std::filesystem::exists(tmp.path()));
}

TraceGeometry SmallGeometry() {
  TraceGeometry g;
  g.layers = 2;
  g.q_heads = 4;
  g.kv_heads = 2;
  g.head_dim = 8;
  g.context = 5;
  g.decode_steps = 3;
  g.dtype = v1::DTYPE_BF16;
  return g;
}

// A file of `specs` whose tensor i holds random values seeded by i.
std::string RandomFile(const std::vector<SafetensorsTensorSpec>& specs,
                       const std::map<std::string, std::string>& metadata) {
  std::vector<std::vector<float>> values;
  std::vector<std::span<const float>> data;
  for (size_t i = 0; i < specs.size(); ++i) {
    int64_t n = 1;
    for (int64_t d : specs[i].shape) n *= d;
    values.push_back(testing::RandomNormal(n, 100 + i));
  }
  for (const auto& v : values) data.emplace_back(v);
  return *SerializeSafetensors(specs, data, metadata);
}

TEST(TraceTest, WriterAndReaderRoundTrip) {
  const TraceGeometry g = SmallGeometry();
  TempPath tmp("trace_roundtrip");
  auto writer = CreateTraceWriter(tmp.path(), g, {{"source", "unit test"}});
  ASSERT_TRUE(writer.ok()) << writer.status();
  std::vector<std::vector<float>> written;
  for (const SafetensorsTensorSpec& spec : TraceTensorSpecs(g)) {
    written.push_back(
        testing::RandomNormal(spec.shape[0] * spec.shape[1] * spec.shape[2], written.size()));
    ASSERT_TRUE((*writer)->Append(written.back()).ok());
  }
  ASSERT_TRUE((*writer)->Finish().ok());

  absl::StatusOr<Trace> trace = Trace::Open(tmp.path());
  ASSERT_TRUE(trace.ok()) << trace.status();
  const TraceGeometry& r = trace->geometry();
  EXPECT_EQ(r.layers, 2);
  EXPECT_EQ(r.q_heads, 4);
  EXPECT_EQ(r.kv_heads, 2);
  EXPECT_EQ(r.head_dim, 8);
  EXPECT_EQ(r.context, 5);
  EXPECT_EQ(r.decode_steps, 3);
  EXPECT_EQ(r.dtype, v1::DTYPE_BF16);
  EXPECT_EQ(trace->metadata().at("source"), "unit test");
  // Writer order is layer-major, prefill q, k, v then decode q, k, v: layer1.prefill.k is 7th.
  absl::StatusOr<std::vector<float>> k = trace->Read(1, TracePhase::kPrefill, TraceTensor::kK);
  ASSERT_TRUE(k.ok());
  ASSERT_EQ(k->size(), written[7].size());
  for (size_t i = 0; i < k->size(); ++i) {
    EXPECT_EQ((*k)[i], RoundTo(v1::DTYPE_BF16, written[7][i]));
  }
  std::vector<float> step(4 * 8);
  ASSERT_TRUE(trace->ReadRows(0, TracePhase::kDecode, TraceTensor::kQ, 2, 1, step.data()).ok());
  for (int i = 0; i < 32; ++i) EXPECT_EQ(step[i], RoundTo(v1::DTYPE_BF16, written[3][64 + i]));
  EXPECT_EQ(trace->Read(2, TracePhase::kPrefill, TraceTensor::kQ).status().code(),
            absl::StatusCode::kOutOfRange);
}

// A trace with no decode steps (a prompt to prefill alone): its decode tensors are empty, at the
// offset where the next layer's prompt begins, which the file's tiling check took for an
// overlap (the trace `kvrecall synth --decode_steps=0` wrote could not be read back).
TEST(TraceTest, ATraceWithoutDecodeStepsRoundTrips) {
  TraceGeometry g = SmallGeometry();
  g.decode_steps = 0;
  TempPath tmp("trace_no_steps");
  auto writer = CreateTraceWriter(tmp.path(), g, {});
  ASSERT_TRUE(writer.ok()) << writer.status();
  for (const SafetensorsTensorSpec& spec : TraceTensorSpecs(g)) {
    ASSERT_TRUE((*writer)->Append(testing::RandomNormal(spec.shape[0] * spec.shape[1] *
                                                        spec.shape[2], 7)).ok());
  }
  ASSERT_TRUE((*writer)->Finish().ok());
  absl::StatusOr<Trace> trace = Trace::Open(tmp.path());
  ASSERT_TRUE(trace.ok()) << trace.status();
  EXPECT_EQ(trace->geometry().decode_steps, 0);
  EXPECT_EQ(trace->geometry().context, 5);
  absl::StatusOr<std::vector<float>> q = trace->Read(1, TracePhase::kDecode, TraceTensor::kQ);
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_TRUE(q->empty());
  // An empty tensor inside another's bytes still does not tile the region.
  const std::string inside =
      RawFile(R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
              R"("y":{"dtype":"F32","shape":[0],"data_offsets":[4,4]}})",
              8);
  EXPECT_THAT(ParseStatus(inside).message(), HasSubstr("'y' overlaps the tensor before it"));
}

TEST(TraceTest, RejectsInconsistentTraces) {
  const TraceGeometry g = SmallGeometry();
  struct Case {
    std::string what;
    std::vector<SafetensorsTensorSpec> specs;
    std::map<std::string, std::string> metadata;
    std::string message;
  };
  std::vector<Case> cases;
  {
    auto specs = TraceTensorSpecs(g);
    specs.erase(specs.begin() + 8);  // layer1.prefill.v
    cases.push_back({"missing", specs, {}, "tensor 'layer1.prefill.v' is missing"});
  }
  {
    auto specs = TraceTensorSpecs(g);
    specs[6].shape[0] = 6;  // layer1.prefill.q has 6 tokens, layer 0 has 5
    cases.push_back({"tokens", specs, {}, "tensor 'layer1.prefill.q' has shape [6, 4, 8]"});
  }
  {
    auto specs = TraceTensorSpecs(g);
    specs[10].shape[1] = 3;  // layer1.decode.k with 3 kv heads
    cases.push_back({"heads", specs, {}, "want [3, 2, 8]"});
  }
  {
    auto specs = TraceTensorSpecs(g);
    specs[4].dtype = v1::DTYPE_F32;
    cases.push_back({"dtype", specs, {}, "tensor 'layer0.decode.k' is f32"});
  }
  {
    auto specs = TraceTensorSpecs(g);
    specs[1].shape = {5, 16};
    cases.push_back({"rank", specs, {}, "tensor 'layer0.prefill.k' has rank 2"});
  }
  {
    TraceGeometry odd = g;
    odd.kv_heads = 3;
    cases.push_back({"gqa", TraceTensorSpecs(odd), {}, "must be >= 1 and divide q_heads"});
  }
  cases.push_back({"metadata",
                   TraceTensorSpecs(g),
                   {{"context", "512"}},
                   "__metadata__.context is \"512\" but the tensors say 5"});
  cases.push_back({"no layers", {{"x", v1::DTYPE_F32, {1}}}, {}, "not a kvrecall trace"});
  for (const int layer : {1024, 2147483647}) {  // the second once overflowed layer + 1
    auto specs = TraceTensorSpecs(g);
    specs.push_back({absl::StrCat("layer", layer, ".prefill.q"), v1::DTYPE_BF16, {0, 1, 1}});
    cases.push_back({absl::StrCat("layer ", layer), specs, {},
                     absl::StrCat("is of layer ", layer, ": a trace has at most 1024 layers")});
  }
  for (Case& c : cases) {
    absl::StatusOr<SafetensorsFile> file =
        SafetensorsFile::FromBytes(RandomFile(c.specs, c.metadata), "t.safetensors");
    ASSERT_TRUE(file.ok()) << c.what << ": " << file.status();
    absl::Status s = Trace::FromFile(*std::move(file)).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.what;
    EXPECT_THAT(s.message(), HasSubstr(c.message)) << c.what;
    EXPECT_THAT(s.message(), HasSubstr("t.safetensors")) << c.what;
  }
}

TEST(TraceTest, WriterRejectsAnInvalidGeometry) {
  TraceGeometry g = SmallGeometry();
  g.context = 0;
  absl::Status s = CreateTraceWriter("/tmp/never-written", g, {}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("context must be >= 1 token, got 0"));
}

}  // namespace
}  // namespace kvrecall
