// Fixtures of the CUDA kernel tests: device detection (tests skip without a GPU), host<->device
// copies, and KV data rounded to bf16/f16 with the exactly representable f32 copy that the CPU
// reference kernels read.
#ifndef KVRECALL_TESTS_CUDA_TEST_UTIL_H_
#define KVRECALL_TESTS_CUDA_TEST_UTIL_H_

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/decode_types.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/dtype.h"
#include "kernels/kv_view.h"
#include "tests/test_util.h"

namespace kvrecall::testing {

// Outputs of the GPU and CPU kernels, both f32 over identical inputs, differ only by summation
// order: outputs and log-sum-exps agree to this (relative for lse), ...
inline constexpr float kOutputTolerance = 1e-4f;
// ... and scores to this (relative): elements that close to the K-th score are near-ties that
// either side may keep in its top K.
inline constexpr float kTieTolerance = 1e-5f;

// A layer geometry under test.
struct Geometry {
  int q_heads;
  int kv_heads;
  int head_dim;
  cuda::KvDtype dtype;
  float scale = 0.0f;  // the softmax scale; 0 is the usual 1 / sqrt(head_dim)
  // When set, test queries are scaled so that their largest |q| is this (65504: f16's bound,
  // which the API's tensors keep), whatever their spread would be.
  float query_peak = 0.0f;

  float DefaultScale() const { return 1.0f / std::sqrt(static_cast<float>(head_dim)); }
  float Scale() const { return scale > 0.0f ? scale : DefaultScale(); }
  // The standard deviation of test queries whose scores spread as queries of `at_default`
  // would at the usual scale: a test's tolerances then hold at any scale.
  float QueryStd(float at_default) const { return at_default * DefaultScale() / Scale(); }
  // With query_peak: scales `q` so that its largest |q| is query_peak.
  void ScaleToPeak(std::vector<float>* q) const {
    if (query_peak <= 0.0f || q->empty()) return;
    float most = 0.0f;
    for (float x : *q) most = std::max(most, std::abs(x));
    for (float& x : *q) x = std::clamp(x * (query_peak / most), -query_peak, query_peak);
  }
  // n test queries: N(0, QueryStd(at_default)), or those scaled to query_peak.
  std::vector<float> Queries(int64_t n, uint64_t seed, float at_default) const {
    std::vector<float> q = RandomNormal(n, seed, QueryStd(at_default));
    ScaleToPeak(&q);
    return q;
  }

  cuda::DecodeShape Shape(int batch) const {
    return cuda::DecodeShape{batch, q_heads, kv_heads, head_dim, dtype, Scale()};
  }
};

inline std::string GeometryName(const ::testing::TestParamInfo<Geometry>& info) {
  const Geometry& g = info.param;
  std::string name = absl::StrCat("q", g.q_heads, "kv", g.kv_heads, "d", g.head_dim,
                                  g.dtype == cuda::KvDtype::kBf16 ? "bf16" : "f16");
  // Scales past ln 2 are the ones f16's kernels apply to the scores (mma.cuh, ScoreFactor).
  if (g.scale > 0.0f) absl::StrAppend(&name, "scale", static_cast<int>(g.scale * 100), "pct");
  if (g.query_peak > 0.0f) absl::StrAppend(&name, "peak", static_cast<int>(g.query_peak));
  return name;
}

inline bool HasCudaDevice() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

#define KVRECALL_SKIP_WITHOUT_GPU() \
  if (!::kvrecall::testing::HasCudaDevice()) GTEST_SKIP() << "no CUDA device"

// Copies host data into a new device buffer, there for every stream when it returns (a
// pageable cudaMemcpy may return before its bytes land, and a non-blocking stream does not wait
// for it: cuda::CopyToDevice waits); fails the test on an error (tests only).
template <typename T>
cuda::DeviceBuffer<T> ToDevice(const std::vector<T>& host) {
  absl::StatusOr<cuda::DeviceBuffer<T>> buffer =
      cuda::DeviceBuffer<T>::Zeroed(std::max<size_t>(host.size(), 1));
  EXPECT_TRUE(buffer.ok()) << buffer.status();
  if (!host.empty()) {
    const absl::Status copied = cuda::CopyToDevice(buffer->data(), host.data(),
                                                   host.size() * sizeof(T), "ToDevice");
    EXPECT_TRUE(copied.ok()) << copied;
  }
  return *std::move(buffer);
}

template <typename T>
std::vector<T> ToHost(const T* device, size_t n) {
  std::vector<T> host(n);
  if (n > 0) {
    EXPECT_EQ(cudaMemcpy(host.data(), device, n * sizeof(T), cudaMemcpyDeviceToHost),
              cudaSuccess);
  }
  return host;
}

// A device buffer of n floats filled with NaN, so unwritten outputs cannot pass for results.
inline cuda::DeviceBuffer<float> PoisonedFloats(size_t n) {
  std::vector<float> nan(n, std::nanf(""));
  return ToDevice(nan);
}

inline uint16_t EncodeHalf(float x, cuda::KvDtype dtype) {
  return dtype == cuda::KvDtype::kBf16 ? FloatToBf16(x) : FloatToF16(x);
}
inline float DecodeHalf(uint16_t bits, cuda::KvDtype dtype) {
  return dtype == cuda::KvDtype::kBf16 ? Bf16ToFloat(bits) : F16ToFloat(bits);
}

// Device outputs of one decode step, poisoned (NaN, -1) so that unwritten entries show:
// o [rows, head_dim], lse [rows], and for top-K paths support [rows, top_k] and its sizes.
struct StepOutputs {
  StepOutputs(int rows, int head_dim, int top_k = 0)
      : o(PoisonedFloats(static_cast<size_t>(rows) * head_dim)),
        lse(PoisonedFloats(rows)),
        support(ToDevice(std::vector<int32_t>(static_cast<size_t>(rows) * top_k, -1))),
        size(ToDevice(std::vector<int32_t>(rows, -1))) {}

  std::vector<float> HostO() const { return ToHost(o.data(), o.size()); }
  std::vector<float> HostLse() const { return ToHost(lse.data(), lse.size()); }
  std::vector<int32_t> HostSupport() const { return ToHost(support.data(), support.size()); }
  std::vector<int32_t> HostSize() const { return ToHost(size.data(), size.size()); }

  cuda::DeviceBuffer<float> o, lse;
  cuda::DeviceBuffer<int32_t> support, size;
};

// One layer's random KV ([slots, kv_heads, head_dim]) in `dtype` on the device; `host` holds the
// same values in f32 (rounded through the dtype), which is what the CPU reference reads.
struct DeviceKv {
  DeviceKv(int64_t slots, int kv_heads, int head_dim, cuda::KvDtype dtype, uint64_t seed)
      : host(slots, kv_heads, head_dim, seed) {
    std::vector<uint16_t> k(host.keys.size()), v(host.values.size());
    for (size_t i = 0; i < k.size(); ++i) {
      k[i] = EncodeHalf(host.keys[i], dtype);
      host.keys[i] = DecodeHalf(k[i], dtype);
      v[i] = EncodeHalf(host.values[i], dtype);
      host.values[i] = DecodeHalf(v[i], dtype);
    }
    keys = ToDevice(k);
    values = ToDevice(v);
  }

  cuda::DeviceSeq Contiguous(int32_t tokens) const {
    return cuda::DeviceSeq::Contiguous(keys.data(), values.data(), tokens);
  }

  RandomKv host;
  cuda::DeviceBuffer<uint16_t> keys;
  cuda::DeviceBuffer<uint16_t> values;
};

// The slots of logical positions [0, size) of `seq`, in order (mirrors SlotOf in common.cuh).
inline std::vector<int32_t> LogicalSlots(const cuda::DeviceSeq& seq) {
  std::vector<int32_t> slots;
  for (int32_t p = 0; p < seq.head_count; ++p) slots.push_back(p);
  for (int32_t j = 0; j < seq.ring_count; ++j) {
    slots.push_back(seq.ring_begin + (seq.ring_start + j) % seq.ring_capacity);
  }
  return slots;
}

}  // namespace kvrecall::testing

#endif  // KVRECALL_TESTS_CUDA_TEST_UTIL_H_
