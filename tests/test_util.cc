#include "tests/test_util.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <numeric>
#include <random>
#include <thread>

#include "kernels/dtype.h"
#include "kernels/vector_set.h"

namespace kvrecall::testing {

double PqPartDistance(const ProductQuantizer& pq, const float* x, int m, int c) {
  return PqPartDistance(pq.codebooks(), pq.subspace_dim(), x, m, c);
}

double PqPartDistance(std::span<const float> codebooks, int sub, const float* x, int m, int c) {
  const float* centroid =
      codebooks.data() + (static_cast<int64_t>(m) * ProductQuantizer::kCentroids + c) * sub;
  double sum = 0.0;
  for (int j = 0; j < sub; ++j) {
    const double diff = static_cast<double>(x[m * sub + j]) - centroid[j];
    sum += diff * diff;
  }
  return sum;
}
std::vector<float> PqReconstructionErrors(const ProductQuantizer& pq, const KvView& kv,
                                          int kv_head) {
  std::vector<uint8_t> code(pq.subspaces());
  std::vector<float> back(kv.head_dim), errors(kv.tokens);
  for (int64_t i = 0; i < kv.tokens; ++i) {
    pq.Encode(VectorSet::KeysOf(kv, kv_head, i, i + 1), code.data());
    pq.Reconstruct(code.data(), back.data());
    const float* x = static_cast<const float*>(kv.key_row(i, kv_head));
    float error = 0.0f;
    for (int j = 0; j < kv.head_dim; ++j) error += (x[j] - back[j]) * (x[j] - back[j]);
    errors[i] = error;
  }
  return errors;
}

std::string BuildProgram(std::string_view build_path) {
  namespace fs = std::filesystem;
  const fs::path in_tree = fs::path(KVRECALL_BINARY_DIR) / build_path;
  std::error_code error;
  if (fs::exists(in_tree, error)) return in_tree.string();
  const fs::path self = fs::read_symlink("/proc/self/exe", error);
  if (!error) {
    const fs::path beside = self.parent_path() / in_tree.filename();
    if (fs::exists(beside, error)) return beside.string();
  }
  return in_tree.string();
}

namespace {

// Element j of a stored row of `element`, widened with kernels/dtype.h's scalar conversions (the
// references do not use the kernels they check).
double Element(const void* row, KvElement element, int j) {
  switch (element) {
    case KvElement::kBf16: return Bf16ToFloat(static_cast<const uint16_t*>(row)[j]);
    case KvElement::kF16: return F16ToFloat(static_cast<const uint16_t*>(row)[j]);
    case KvElement::kF32: break;
  }
  return static_cast<const float*>(row)[j];
}

}  // namespace

std::vector<float> RandomNormal(size_t n, uint64_t seed, float stddev) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> out(n);
  for (float& x : out) x = dist(rng);
  return out;
}

RandomKv::RandomKv(int64_t tokens, int kv_heads, int head_dim, uint64_t seed)
    : keys(RandomNormal(tokens * kv_heads * head_dim, seed)),
      values(RandomNormal(tokens * kv_heads * head_dim, seed + 1)),
      tokens(tokens),
      kv_heads(kv_heads),
      head_dim(head_dim) {}

KvView RandomKv::view() const {
  return KvView{keys.data(), values.data(), tokens, kv_heads, head_dim};
}

NarrowedKv::NarrowedKv(const RandomKv& kv, KvElement element)
    : keys(kv.keys.size()),
      values(kv.values.size()),
      wide_keys(kv.keys.size()),
      wide_values(kv.values.size()),
      tokens(kv.tokens),
      kv_heads(kv.kv_heads),
      head_dim(kv.head_dim),
      element(element) {
  const bool bf16 = element == KvElement::kBf16;
  for (size_t i = 0; i < keys.size(); ++i) {
    keys[i] = bf16 ? FloatToBf16(kv.keys[i]) : FloatToF16(kv.keys[i]);
    values[i] = bf16 ? FloatToBf16(kv.values[i]) : FloatToF16(kv.values[i]);
    wide_keys[i] = bf16 ? Bf16ToFloat(keys[i]) : F16ToFloat(keys[i]);
    wide_values[i] = bf16 ? Bf16ToFloat(values[i]) : F16ToFloat(values[i]);
  }
}

KvView NarrowedKv::view() const {
  return KvView{keys.data(), values.data(), tokens, kv_heads, head_dim, element};
}

KvView NarrowedKv::widened_view() const {
  return KvView{wide_keys.data(), wide_values.data(), tokens, kv_heads, head_dim};
}

double ReferenceAttention(const float* q, const KvView& kv, int kv_head,
                          std::span<const int32_t> ids, double scale, std::vector<double>* o) {
  const int d = kv.head_dim;
  o->assign(d, 0.0);
  if (ids.empty()) return -std::numeric_limits<double>::infinity();
  std::vector<double> s(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    const void* k = kv.key_row(ids[i], kv_head);
    double dot = 0;
    for (int j = 0; j < d; ++j) dot += static_cast<double>(q[j]) * Element(k, kv.element, j);
    s[i] = scale * dot;
  }
  const double m = *std::max_element(s.begin(), s.end());
  double sum = 0;
  for (double& x : s) sum += (x = std::exp(x - m));
  for (size_t i = 0; i < ids.size(); ++i) {
    const void* v = kv.value_row(ids[i], kv_head);
    for (int j = 0; j < d; ++j) (*o)[j] += s[i] / sum * Element(v, kv.element, j);
  }
  return m + std::log(sum);
}

std::vector<int32_t> AllTokens(int64_t tokens) {
  std::vector<int32_t> ids(tokens);
  std::iota(ids.begin(), ids.end(), 0);
  return ids;
}

std::vector<int32_t> ReferenceTopK(const float* q, const KvView& kv, int kv_head, double scale,
                                   int k) {
  std::vector<double> s(kv.tokens);
  for (int64_t t = 0; t < kv.tokens; ++t) {
    double dot = 0;
    const void* k = kv.key_row(t, kv_head);
    for (int j = 0; j < kv.head_dim; ++j) {
      dot += static_cast<double>(q[j]) * Element(k, kv.element, j);
    }
    s[t] = scale * dot;
  }
  std::vector<int32_t> ids = AllTokens(kv.tokens);
  std::stable_sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) { return s[a] > s[b]; });
  ids.resize(std::min<int64_t>(k, kv.tokens));
  return ids;
}

TempDirectory::TempDirectory(std::string_view tag) {
  std::string pattern = "/tmp/kvrecall-" + std::string(tag) + "-XXXXXX";
  if (mkdtemp(pattern.data()) != nullptr) path_ = pattern;
}

TempDirectory::~TempDirectory() {
  std::error_code ignored;
  if (!path_.empty()) std::filesystem::remove_all(path_, ignored);
}

std::string TempDirectory::Path(std::string_view name) const {
  return path_ + "/" + std::string(name);
}

int ConnectToLoopback(int port, int receive_buffer) {
  const int s = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (s < 0) return -1;
  if (receive_buffer > 0) {
    setsockopt(s, SOL_SOCKET, SO_RCVBUF, &receive_buffer, sizeof receive_buffer);
  }
  sockaddr_in address = {};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(s, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0) {
    close(s);
    return -1;
  }
  return s;
}

bool Eventually(const std::function<bool()>& done, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!done()) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return true;
}

}  // namespace kvrecall::testing
