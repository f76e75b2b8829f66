// Shared test fixtures: random KV data, brute-force double-precision references, temporary
// directories, an environment variable for a scope and a bounded wait for what another thread
// finishes.
#ifndef KVRECALL_TESTS_TEST_UTIL_H_
#define KVRECALL_TESTS_TEST_UTIL_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "index/build_stop.h"
#include "index/product_quantizer.h"
#include "kernels/kv_view.h"

namespace kvrecall::testing {

// One of this build's programs by its path in the build tree ("server/kvrecalld"): the build
// tree's when it is there, else the program of the same name beside the running test (a bundle
// copied to another machine holds them side by side), else the build tree's path all the same.
std::string BuildProgram(std::string_view build_path);

// Sets (or, given null, unsets) an environment variable for its scope, then restores what the
// process had: for a child process started in the scope, or code that reads it.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* was = std::getenv(name); was != nullptr) saved_ = was;
    if (value == nullptr) {
      unsetenv(name);
    } else {
      setenv(name, value, 1);
    }
  }
  ~ScopedEnv() {
    if (saved_.has_value()) {
      setenv(name_, saved_->c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* const name_;
  std::optional<std::string> saved_;
};

// n floats from N(0, stddev^2), reproducible from `seed`.
std::vector<float> RandomNormal(size_t n, uint64_t seed, float stddev = 1.0f);

// Owns one layer's KV ([tokens, kv_heads, head_dim] each) and hands out views of it.
struct RandomKv {
  RandomKv(int64_t tokens, int kv_heads, int head_dim, uint64_t seed);
  KvView view() const;
  std::vector<float> keys;
  std::vector<float> values;
  int64_t tokens;
  int kv_heads;
  int head_dim;
};

// A RandomKv rounded to a 16-bit element type (bf16 or f16, nearest even): its stored bits, and
// the same values widened back to f32, so that a kernel must give the same result over both
// views.
struct NarrowedKv {
  NarrowedKv(const RandomKv& kv, KvElement element);
  KvView view() const;          // the 16-bit storage
  KvView widened_view() const;  // f32 holding exactly the stored values
  std::vector<uint16_t> keys;
  std::vector<uint16_t> values;
  std::vector<float> wide_keys;
  std::vector<float> wide_values;
  int64_t tokens;
  int kv_heads;
  int head_dim;
  KvElement element;
};

// Squared distance, in double, of part m of `x` to centroid c of codebook m of `codebooks`
// ([M, 256, sub]) or of `pq`'s: what a product quantizer's code should minimize.
double PqPartDistance(std::span<const float> codebooks, int sub, const float* x, int m, int c);
double PqPartDistance(const ProductQuantizer& pq, const float* x, int m, int c);
// Each key's squared reconstruction error under `pq` (its nearest centroids side by side), as
// BulkCodes measures it: keys of KV head `kv_head` of `kv`, [tokens] (f32 rows).
std::vector<float> PqReconstructionErrors(const ProductQuantizer& pq, const KvView& kv,
                                          int kv_head);

// Attention of q over kv's tokens `ids` for one KV head, in double precision (any element type).
// o: [head_dim]; returns the natural-log log-sum-exp (-inf for an empty set).
double ReferenceAttention(const float* q, const KvView& kv, int kv_head,
                          std::span<const int32_t> ids, double scale, std::vector<double>* o);

// All token ids [0, tokens).
std::vector<int32_t> AllTokens(int64_t tokens);

// The k highest-scoring tokens by brute force in double precision, ties by lower id.
std::vector<int32_t> ReferenceTopK(const float* q, const KvView& kv, int kv_head, double scale,
                                   int k);

// A TCP socket connected to 127.0.0.1:`port` (with `receive_buffer` > 0, its SO_RCVBUF set
// before connecting), or -1.
int ConnectToLoopback(int port, int receive_buffer = 0);

// Polls `done` every 10 ms for up to `timeout`; whether it came true (its last answer).
bool Eventually(const std::function<bool()>& done,
                std::chrono::milliseconds timeout = std::chrono::seconds(10));

// A build stop (index/build_stop.h) requested from its `from`-th ask on (1: at once; 0: never),
// counting how often builds asked it: where in a build a stop is seen, and that it is asked.
class StopAfterAsks {
 public:
  explicit StopAfterAsks(int from) : from_(from) {}
  StopAfterAsks(const StopAfterAsks&) = delete;
  StopAfterAsks& operator=(const StopAfterAsks&) = delete;

  BuildStop stop() {
    return BuildStop([this] { return ++asks_ >= from_ && from_ > 0; });
  }
  int asks() const { return asks_.load(); }

 private:
  const int from_;
  std::atomic<int> asks_ = 0;
};

// A fresh directory under /tmp (/tmp/kvrecall-TAG-XXXXXX), removed with everything in it when
// this is destroyed. path() is empty when it could not be made (a test asserts on it).
class TempDirectory {
 public:
  explicit TempDirectory(std::string_view tag);
  ~TempDirectory();
  TempDirectory(const TempDirectory&) = delete;
  TempDirectory& operator=(const TempDirectory&) = delete;

  const std::string& path() const { return path_; }
  // path()/name.
  std::string Path(std::string_view name) const;

 private:
  std::string path_;
};

}  // namespace kvrecall::testing

#endif  // KVRECALL_TESTS_TEST_UTIL_H_
