// One layer of a SyntheticTrace held as the tiered placement holds it (bf16 host KV in huge
// pages where offered, f32 queries), generated in-process on every core, and the flags that
// shape it: what the in-process tiered benches (tiered_head_bench, pq_shortlist_bench) replay.
#ifndef KVRECALL_BENCH_SYNTHETIC_LAYER_H_
#define KVRECALL_BENCH_SYNTHETIC_LAYER_H_

#include <algorithm>
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "client/trace/synthetic.h"
#include "kernels/cpu/mapped_memory.h"
#include "kernels/dtype.h"
#include "kernels/kv_view.h"

namespace kvrecall::bench {

// The flags every in-process tiered bench takes (bench/synthetic_layer.cc defines them):
// --context --steps --warmup --q_heads --kv_heads --head_dim --seed, and the selection's --k
// --sinks --recent.
struct LayerFlags {
  SyntheticTraceParams trace;  // decode_steps = steps + warmup
  int steps = 0;               // timed
  int warmup = 0;              // run first, untimed
  int k = 0;
  int sinks = 0;
  int recent = 0;
};
LayerFlags LayerFromFlags();

// Rows [begin, begin + n) of one tensor of layer 0 (`row` floats each), generated chunk by
// chunk on every OpenMP thread into f32 (when non-null) and bf16 (when non-null).
inline void GenerateRows(const SyntheticTrace& trace, TracePhase phase, TraceTensor tensor,
                         int64_t begin, int64_t n, int64_t row, float* f32, uint16_t* bf16) {
  constexpr int64_t kChunk = 1024;
  const int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel
  {
    std::vector<float> scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t first = c * kChunk, count = std::min(kChunk, n - first);
      float* out = f32;
      if (out == nullptr) {
        scratch.resize(count * row);
        out = scratch.data();
      } else {
        out += first * row;
      }
      trace.GenerateRows(0, phase, tensor, begin + first, count, out);
      if (bf16 != nullptr) {
        for (int64_t i = 0; i < count * row; ++i) bf16[first * row + i] = FloatToBf16(out[i]);
      }
    }
  }
}

// The prompt's and the decode steps' keys and values ([context + decode_steps, kv_heads,
// head_dim] bf16) and the decode queries ([decode_steps, q_heads, head_dim] f32) of layer 0.
struct SyntheticLayer {
  explicit SyntheticLayer(SyntheticTrace trace_in) : trace(std::move(trace_in)) {
    const SyntheticTraceParams& p = trace.params();
    const int64_t t = p.context, steps = p.decode_steps;
    const int64_t kv_row = int64_t{p.kv_heads} * p.head_dim, q_row = int64_t{p.q_heads} * p.head_dim;
    keys.resize((t + steps) * kv_row);
    values.resize((t + steps) * kv_row);
    decode_q.resize(steps * q_row);
    GenerateRows(trace, TracePhase::kPrefill, TraceTensor::kK, 0, t, kv_row, nullptr, keys.data());
    GenerateRows(trace, TracePhase::kPrefill, TraceTensor::kV, 0, t, kv_row, nullptr,
                 values.data());
    GenerateRows(trace, TracePhase::kDecode, TraceTensor::kK, 0, steps, kv_row, nullptr,
                 keys.data() + t * kv_row);
    GenerateRows(trace, TracePhase::kDecode, TraceTensor::kV, 0, steps, kv_row, nullptr,
                 values.data() + t * kv_row);
    GenerateRows(trace, TracePhase::kDecode, TraceTensor::kQ, 0, steps, q_row, decode_q.data(),
                 nullptr);
  }

  // Every token's KV, the decode steps' included.
  KvView store() const {
    const SyntheticTraceParams& p = trace.params();
    return KvView{keys.data(), values.data(), p.context + p.decode_steps, p.kv_heads, p.head_dim,
                  KvElement::kBf16};
  }
  // The prompt's queries, [context, q_heads, head_dim] f32 (generated on demand: 2 GiB at 128K).
  std::vector<float> PromptQueries() const {
    const SyntheticTraceParams& p = trace.params();
    const int64_t q_row = int64_t{p.q_heads} * p.head_dim;
    std::vector<float> q(p.context * q_row);
    GenerateRows(trace, TracePhase::kPrefill, TraceTensor::kQ, 0, p.context, q_row, q.data(),
                 nullptr);
    return q;
  }

  SyntheticTrace trace;
  cpu::MappedVector<uint16_t> keys, values;
  std::vector<float> decode_q;
};

}  // namespace kvrecall::bench

#endif  // KVRECALL_BENCH_SYNTHETIC_LAYER_H_
