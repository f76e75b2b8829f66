#include "bench/synthetic_layer.h"

#include "absl/flags/flag.h"

ABSL_FLAG(int64_t, context, 131072, "prompt tokens T");
ABSL_FLAG(int, steps, 40, "decode steps timed");
ABSL_FLAG(int, warmup, 4, "decode steps run first, untimed");
ABSL_FLAG(int, q_heads, 32, "query heads");
ABSL_FLAG(int, kv_heads, 8, "KV heads");
ABSL_FLAG(int, head_dim, 128, "head dim");
ABSL_FLAG(uint64_t, seed, 100, "synthetic trace seed");
ABSL_FLAG(int, k, 512, "top K");
ABSL_FLAG(int, sinks, 128, "static set: sinks");
ABSL_FLAG(int, recent, 512, "static set: recent ring");

namespace kvrecall::bench {

LayerFlags LayerFromFlags() {
  LayerFlags f;
  f.steps = absl::GetFlag(FLAGS_steps);
  f.warmup = absl::GetFlag(FLAGS_warmup);
  f.k = absl::GetFlag(FLAGS_k);
  f.sinks = absl::GetFlag(FLAGS_sinks);
  f.recent = absl::GetFlag(FLAGS_recent);
  f.trace.context = absl::GetFlag(FLAGS_context);
  f.trace.decode_steps = f.steps + f.warmup;
  f.trace.q_heads = absl::GetFlag(FLAGS_q_heads);
  f.trace.kv_heads = absl::GetFlag(FLAGS_kv_heads);
  f.trace.head_dim = absl::GetFlag(FLAGS_head_dim);
  f.trace.seed = absl::GetFlag(FLAGS_seed);
  return f;
}

}  // namespace kvrecall::bench
