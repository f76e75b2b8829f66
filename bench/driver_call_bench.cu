// What the CUDA driver calls of a tiered step cost the host that makes them (issue 15): the
// tier's Start (an event, a captured step's launch) and QueueNewCodes (a 2-D copy of a few
// bytes per KV head) run on the decode path, and on the H200 machine's host they took tens of
// microseconds each (bench/results/tiered_serving.md).
//
// On one idle stream, each call's host time alone (the stream drained between calls), `reps`
// times after `warmup`: cudaSetDevice of the current device, cudaEventRecord, a 1-D and a 2-D
// cudaMemcpyAsync from pinned memory, an empty kernel's launch, and cudaGraphLaunch of a graph
// shaped like a shortlist step (an event, an upload, `kernels` empty kernels, a download, an
// event); then that graph's launch until the host sees its end (cudaEventSynchronize) and its
// device time between its two events. Prints one JSON object, microseconds.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "bench/percentiles.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(int, reps, 2000, "timed calls of each kind");
ABSL_FLAG(int, warmup, 50, "untimed calls of each kind first");
ABSL_FLAG(int, kernels, 3, "empty kernels in the step-shaped graph (the shortlist's three)");
ABSL_FLAG(int64_t, upload_bytes, 33 << 10, "the graph's upload (a step's queries and new KV)");
ABSL_FLAG(int64_t, download_bytes, 132 << 10, "the graph's download (32 shortlists of 1024)");
ABSL_FLAG(int, rows_2d, 8, "rows of the 2-D copy (KV heads)");
ABSL_FLAG(int, row_bytes_2d, 8, "bytes per row of the 2-D copy (one key's code)");

namespace {

__global__ void EmptyKernel() {}

bool Check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return true;
  std::fprintf(stderr, "driver_call_bench: %s: %s\n", what, cudaGetErrorString(e));
  return false;
}

using Clock = std::chrono::steady_clock;

int Run() {
  const int reps = absl::GetFlag(FLAGS_reps), warmup = absl::GetFlag(FLAGS_warmup);
  const int kernels = absl::GetFlag(FLAGS_kernels);
  const int64_t up = absl::GetFlag(FLAGS_upload_bytes), down = absl::GetFlag(FLAGS_download_bytes);
  const int rows_2d = absl::GetFlag(FLAGS_rows_2d);
  const int row_bytes_2d = absl::GetFlag(FLAGS_row_bytes_2d);
  if (reps < 1 || warmup < 0 || kernels < 0 || up < 1 || down < 1 || rows_2d < 1 ||
      row_bytes_2d < 1) {
    std::fprintf(stderr, "driver_call_bench: every size and count must be positive\n");
    return 2;
  }
  int device = 0;
  if (!Check(cudaGetDevice(&device), "cudaGetDevice")) return 1;
  cudaStream_t stream;
  cudaEvent_t begin, end;
  void *host = nullptr, *dev = nullptr;
  const int64_t pitch = int64_t{1} << 20;  // the 2-D copy's destination rows lie this far apart
  const int64_t bytes = std::max<int64_t>({up, down, rows_2d * pitch});
  if (!Check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "a stream") ||
      !Check(cudaEventCreate(&begin), "an event") || !Check(cudaEventCreate(&end), "an event") ||
      !Check(cudaMallocHost(&host, bytes), "pinned memory") ||
      !Check(cudaMalloc(&dev, bytes), "device memory")) {
    return 1;
  }
  // The step-shaped graph.
  auto enqueue_step = [&] {
    bool ok = Check(cudaEventRecordWithFlags(begin, stream, cudaEventRecordExternal), "begin");
    ok = ok && Check(cudaMemcpyAsync(dev, host, up, cudaMemcpyHostToDevice, stream), "upload");
    for (int k = 0; k < kernels && ok; ++k) {
      EmptyKernel<<<1, 32, 0, stream>>>();
      ok = Check(cudaGetLastError(), "a kernel");
    }
    ok = ok && Check(cudaMemcpyAsync(host, dev, down, cudaMemcpyDeviceToHost, stream), "download");
    return ok && Check(cudaEventRecordWithFlags(end, stream, cudaEventRecordExternal), "end");
  };
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  if (!Check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "capture") ||
      !enqueue_step() || !Check(cudaStreamEndCapture(stream, &graph), "capture") ||
      !Check(cudaGraphInstantiate(&exec, graph, 0), "instantiating")) {
    return 1;
  }

  nlohmann::json out;
  out["reps"] = reps;
  out["kernels"] = kernels;
  out["upload_bytes"] = up;
  out["download_bytes"] = down;
  // Each call timed alone on the host, the stream drained after it (untimed).
  auto time_calls = [&](const char* name, const std::function<cudaError_t()>& call) {
    std::vector<double> us;
    for (int i = 0; i < warmup + reps; ++i) {
      const auto t0 = Clock::now();
      const cudaError_t e = call();
      const double micros = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
      if (!Check(e, name) || !Check(cudaStreamSynchronize(stream), name)) return false;
      if (i >= warmup) us.push_back(micros);
    }
    out["host_us"][name] = kvrecall::Percentiles(us);
    return true;
  };
  const bool ok =
      time_calls("set_device", [&] { return cudaSetDevice(device); }) &&
      time_calls("event_record", [&] { return cudaEventRecord(begin, stream); }) &&
      time_calls("memcpy_h2d",
                 [&] { return cudaMemcpyAsync(dev, host, up, cudaMemcpyHostToDevice, stream); }) &&
      time_calls("memcpy_2d_h2d",
                 [&] {
                   return cudaMemcpy2DAsync(dev, pitch, host, row_bytes_2d, row_bytes_2d, rows_2d,
                                            cudaMemcpyHostToDevice, stream);
                 }) &&
      time_calls("kernel_launch",
                 [&] {
                   EmptyKernel<<<1, 32, 0, stream>>>();
                   return cudaGetLastError();
                 }) &&
      time_calls("graph_launch", [&] { return cudaGraphLaunch(exec, stream); });
  if (!ok) return 1;
  // The step-shaped graph from its launch until the host sees its end, and its device time.
  std::vector<double> round_trip, device_us;
  for (int i = 0; i < warmup + reps; ++i) {
    const auto t0 = Clock::now();
    if (!Check(cudaGraphLaunch(exec, stream), "graph_launch") ||
        !Check(cudaEventSynchronize(end), "waiting for the graph")) {
      return 1;
    }
    const double micros = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
    float ms = 0;
    if (!Check(cudaEventElapsedTime(&ms, begin, end), "timing the graph")) return 1;
    if (i >= warmup) {
      round_trip.push_back(micros);
      device_us.push_back(1e3 * ms);
    }
  }
  out["graph_round_trip_us"] = kvrecall::Percentiles(round_trip);
  out["graph_device_us"] = kvrecall::Percentiles(device_us);
  std::printf("%s\n", out.dump(1).c_str());
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaFree(dev);
  cudaFreeHost(host);
  cudaEventDestroy(begin);
  cudaEventDestroy(end);
  cudaStreamDestroy(stream);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "driver_call_bench: the host time of a tiered step's CUDA driver calls, as JSON");
  absl::ParseCommandLine(argc, argv);
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::fprintf(stderr, "driver_call_bench: no CUDA device\n");
    return 1;
  }
  return Run();
}
