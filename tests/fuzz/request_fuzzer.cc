// libFuzzer target over what a client's bytes reach in kvrecalld without the transport: the
// parsing of every request message, geometry and policy validation (CreateSession), prompt
// chunks (Prefill: session, layer, offsets, shapes, dtypes, values, the budget, the commit),
// decode requests (Decode: validation, tensor decoding, the step itself), GetSession and
// ListSessions, and the tensor codec on its own. Every input starts from a registry holding two
// prefilled sessions ("a": f32, full attention; "b": bf16, ReTopK).
//
// Checked beyond "no crash, no sanitizer report": a refused Decode request, Prefill chunk or
// commit changes no session; an accepted Decode request answers finite outputs, LSEs and
// diagnostics; a tensor the codec accepts holds values within kMaxTensorMagnitude and survives
// an encode/decode round trip unchanged.
//
// Input: records of [kind: 1 byte][length: 2 bytes, little-endian][length bytes], kind mod 7:
//   0 CreateSessionRequest     1 PrefillChunk (into the input's one Prefill stream)
//   2 commit that stream       3 DecodeRequest
//   4 GetSessionRequest        5 ListSessions (the bytes are ignored)
//   6 tensor codec: [rank, dims..., flags] then a serialized Tensor
// Session ids "a" and "b" name the fixture sessions, "c" the last one created by a record;
// other ids are passed through (and must be refused).
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "google/protobuf/util/message_differencer.h"
#include "kvrecall/v1/kvrecall.pb.h"
#include "proto/tensor_codec.h"
#include "server/decode.h"
#include "server/prefill.h"
#include "server/session.h"
#include "tests/fuzz/fuzz_fixture.h"

namespace kvrecall::fuzz {
namespace {

// KVRECALL_FUZZ_VERBOSE=1 prints what each record did (for checking that seeds reach deep).
const bool kVerbose = std::getenv("KVRECALL_FUZZ_VERBOSE") != nullptr;

void Report(const char* what, const absl::Status& status) {
  if (kVerbose) std::fprintf(stderr, "  %s: %s\n", what, status.ToString().c_str());
}

void Check(bool condition, const char* what) {
  if (!condition) {
    std::fprintf(stderr, "request_fuzzer: invariant violated: %s\n", what);
    std::abort();
  }
}

// The infos of every session, in a fixed order, for before/after comparisons.
std::vector<v1::SessionInfo> Snapshot(const SessionRegistry& registry) {
  std::vector<v1::SessionInfo> out;
  for (const std::shared_ptr<Session>& s : registry.List()) {
    absl::ReaderMutexLock lock(&s->mu());
    out.push_back(s->Info());
  }
  std::sort(out.begin(), out.end(), [](const v1::SessionInfo& a, const v1::SessionInfo& b) {
    return a.session_id() < b.session_id();
  });
  return out;
}

// Whether no session changed: what they hold of the budgets aside, which a prompt's staging
// moves before its commit (and a failed one's release gives back).
bool SameSessions(const std::vector<v1::SessionInfo>& a, const std::vector<v1::SessionInfo>& b) {
  if (a.size() != b.size()) return false;
  const google::protobuf::Descriptor* info = v1::SessionInfo::descriptor();
  google::protobuf::util::MessageDifferencer same;
  same.IgnoreField(info->FindFieldByName("host_budget_bytes"));
  same.IgnoreField(info->FindFieldByName("gpu_budget_bytes"));
  for (size_t i = 0; i < a.size(); ++i) {
    if (!same.Compare(a[i], b[i])) return false;
  }
  return true;
}

bool AllFinite(const v1::Tensor& t) {
  if (t.values_size() > 0) {
    for (float x : t.values()) {
      if (!std::isfinite(x)) return false;
    }
    return true;
  }
  const size_t size = DTypeSize(t.dtype());
  if (size == 0 || t.data().size() % size != 0) return false;
  std::vector<float> values(t.data().size() / size);
  ConvertToF32(t.data().data(), t.dtype(), static_cast<int64_t>(values.size()), values.data());
  for (float x : values) {
    if (!std::isfinite(x)) return false;
  }
  return true;
}

class Harness {
 public:
  Harness() : fixture_(), prefill_(&fixture_.registry()) {}

  void Run(const uint8_t* data, size_t size) {
    while (size >= 3) {
      const int kind = data[0] % 7;
      const size_t length = std::min<size_t>(data[1] | (size_t{data[2]} << 8), size - 3);
      Record(kind, data + 3, length);
      data += 3 + length;
      size -= 3 + length;
    }
  }

 private:
  template <typename Message>
  bool Parse(const uint8_t* data, size_t size, Message* message) {
    return message->ParseFromArray(data, static_cast<int>(size));
  }

  void MapId(std::string* id) {
    if (*id == "a") *id = fixture_.id(0);
    else if (*id == "b") *id = fixture_.id(1);
    else if (*id == "c" && !created_.empty()) *id = created_;
  }

  void Record(int kind, const uint8_t* data, size_t size) {
    switch (kind) {
      case 0: {
        v1::CreateSessionRequest request;
        if (!Parse(data, size, &request)) return;
        absl::StatusOr<std::shared_ptr<Session>> session = fixture_.registry().Create(request);
        Report("CreateSession", session.status());
        if (session.ok()) created_ = (*session)->id();
        return;
      }
      case 1: {
        v1::PrefillChunk chunk;
        if (!Parse(data, size, &chunk)) return;
        MapId(chunk.mutable_session_id());
        if (prefill_failed_) return;  // the stream is over
        const std::vector<v1::SessionInfo> before = Snapshot(fixture_.registry());
        const absl::Status s = prefill_.Add(chunk, chunks_++);
        Report("Prefill chunk", s);
        Check(SameSessions(before, Snapshot(fixture_.registry())),
              "a Prefill chunk changed a session before the commit");
        if (!s.ok()) prefill_failed_ = true;
        return;
      }
      case 2: {
        if (prefill_failed_ || chunks_ == 0) return;
        const std::vector<v1::SessionInfo> before = Snapshot(fixture_.registry());
        const absl::StatusOr<v1::PrefillResponse> committed = prefill_.Commit();
        Report("Prefill commit", committed.status());
        if (!committed.ok()) {
          Check(SameSessions(before, Snapshot(fixture_.registry())),
                "a refused Prefill commit changed a session");
        }
        prefill_ = PrefillStream(&fixture_.registry());
        chunks_ = 0;
        return;
      }
      case 3: {
        v1::DecodeRequest request;
        if (!Parse(data, size, &request)) return;
        for (v1::SequenceStep& step : *request.mutable_steps()) MapId(step.mutable_session_id());
        const std::vector<v1::SessionInfo> before = Snapshot(fixture_.registry());
        v1::DecodeResponse response;
        const absl::Status s = decoder_.Serve(request, &response);
        Report("Decode", s);
        if (!s.ok()) {
          Check(SameSessions(before, Snapshot(fixture_.registry())),
                "a refused Decode request changed a session");
          return;
        }
        for (const v1::SequenceResult& r : response.results()) {
          Check(AllFinite(r.output()), "a Decode output is not finite");
          if (request.return_lse()) Check(AllFinite(r.lse()), "a Decode LSE is not finite");
          for (const v1::HeadDiagnostics& h : r.heads()) {
            Check(std::isfinite(h.best_cosine()) || h.path() == v1::PATH_EXACT,
                  "a best cosine is not finite");
            if (request.compare_exact()) {
              Check(std::isfinite(h.support_recall()) && std::isfinite(h.retained_mass()) &&
                        std::isfinite(h.output_cosine()) && std::isfinite(h.rel_l2()),
                    "a fidelity figure is not finite");
            }
          }
        }
        return;
      }
      case 4: {
        v1::GetSessionRequest request;
        if (!Parse(data, size, &request)) return;
        MapId(request.mutable_session_id());
        absl::StatusOr<std::shared_ptr<Session>> s = fixture_.registry().Find(request.session_id());
        if (s.ok()) {
          absl::ReaderMutexLock lock(&(*s)->mu());
          (*s)->Info().SerializeAsString();
        }
        return;
      }
      case 5:
        Snapshot(fixture_.registry());
        return;
      case 6:
        FuzzTensor(data, size);
        return;
    }
  }

  // [rank (mod 4)][dims (mod 9 each)][flags: bit 0 rows_free, bits 1-2 dtype] then a Tensor.
  void FuzzTensor(const uint8_t* data, size_t size) {
    if (size < 1) return;
    const size_t rank = data[0] % 4;
    if (size < 2 + rank) return;
    std::vector<int64_t> row_shape;
    for (size_t i = 0; i < rank; ++i) row_shape.push_back(data[1 + i] % 9);
    const uint8_t flags = data[1 + rank];
    const v1::DType dtype = static_cast<v1::DType>((flags >> 1) & 3);
    v1::Tensor t;
    if (!Parse(data + 2 + rank, size - 2 - rank, &t)) return;
    const TensorSpec spec{"t", row_shape, (flags & 1) != 0, dtype};
    absl::StatusOr<int64_t> rows = CheckTensor(t, spec);
    if (!rows.ok()) return;
    int64_t count = *rows;
    for (int64_t d : row_shape) count *= d;
    Check(count >= 0 && count <= (int64_t{1} << 31), "an accepted tensor's count is out of range");
    std::vector<float> out(count);
    if (!DecodeTensor(t, spec, out.data()).ok()) return;
    for (float x : out) {
      Check(std::abs(x) <= kMaxTensorMagnitude, "a decoded value is beyond the bound");
    }
    if (t.values_size() > 0) return;  // plain values are f32 whatever the dtype says
    std::vector<int64_t> shape(t.shape().begin(), t.shape().end());
    v1::Tensor again;
    EncodeTensor(out, shape, dtype, /*as_values=*/false, &again);
    std::vector<float> back(count);
    Check(DecodeTensor(again, spec, back.data()).ok(), "a re-encoded tensor does not decode");
    Check(std::memcmp(out.data(), back.data(), count * sizeof(float)) == 0,
          "a tensor changed in an encode/decode round trip");
  }

  FuzzFixture fixture_;
  PrefillStream prefill_;
  int64_t chunks_ = 0;
  bool prefill_failed_ = false;
  DecodeStream decoder_{&fixture_.registry()};
  std::string created_;
};

}  // namespace
}  // namespace kvrecall::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kvrecall::fuzz::Harness harness;
  harness.Run(data, size);
  return 0;
}
