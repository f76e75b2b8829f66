// What a context's kept CUDA-graph steps cost the device budget, and when a step that could not
// be captured is tried again: shared by the GPU placements (gpu_support.h) and their tests,
// which build without CUDA too.
#ifndef KVRECALL_SERVER_BACKENDS_CAPTURED_STEP_CHARGE_H_
#define KVRECALL_SERVER_BACKENDS_CAPTURED_STEP_CHARGE_H_

#include <cstdint>

namespace kvrecall::gpu {

// The device memory an executable captured step holds beside the buffers it names (the
// driver's copy of its nodes and their kernels' parameters), charged to the device budget while
// a context keeps the step: on an H100 (d130), 256 executable copies of a graph shaped like a
// served tiered step (17 nodes: events, the upload and download, 8 kernels, 2 small copies)
// took 32 MiB by cudaMemGetInfo (bench/driver_call_bench --graph_copies;
// bench/results/tiered_serving.md, "What a captured step holds"). Uncharged, a Decode stream's
// 256 kept steps held up to that much unseen by admission (review 13's L5).
inline constexpr int64_t kCapturedStepDeviceBytes = int64_t{128} << 10;
// A step that could not be captured (its charge refused, or the capture failed) runs eagerly;
// its key is tried again after this many more of its context's captured-step lookups (a
// model's layers look up once each a layer-step: ~8 tokens of a 32-layer model), so that a
// passing shortage does not leave it eager for good (review 13's L6).
inline constexpr uint64_t kCaptureRetryRuns = 256;
// A kept step not run for this many lookups of its context is dropped, its charge given back:
// the keys of codes that took over, of scan bounds left behind and of sessions gone never come
// again, and a Decode stream keeps up to 256 steps (32 MiB charged). A live key of a model's
// layers comes once a token (1024 lookups: 32 tokens of 32 layers); one dropped while still
// live is captured again (~0.3 ms, d117).
inline constexpr uint64_t kCapturedStepStaleRuns = 1024;

}  // namespace kvrecall::gpu

#endif  // KVRECALL_SERVER_BACKENDS_CAPTURED_STEP_CHARGE_H_
