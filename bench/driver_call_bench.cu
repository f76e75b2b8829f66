// What the CUDA driver calls of a tiered step cost the host that makes them (issue 15): the
// tier's Start (an event, a captured step's launch) runs on the decode path, and on the H200
// machine's host it took tens of microseconds (bench/results/tiered_serving_history.md).
//
// On one idle stream, each call's host time alone (the stream drained between calls), `reps`
// times after `warmup`: cudaSetDevice of the current device, cudaEventRecord, a 1-D and a 2-D
// cudaMemcpyAsync from pinned memory, an empty kernel's launch, and cudaGraphLaunch of a graph
// shaped like a shortlist step (an event, an upload, `kernels` empty kernels, a download, an
// event); then that graph's launch until the host sees its end (cudaEventSynchronize) and its
// device time between its two events; then the launch of each graph `graphs` spells, node by
// node (which kinds of node make a served step's launch cost what it does), and of those named
// by `pool_graphs` again as the first item of a loop on kvrecall's compute pool whose other items
// gather rows from host memory, as a served step's launch is (TieredBackend::StepRun). Prints one
// JSON object, microseconds; and the device memory an executable copy of each spelled graph
// takes (`graph_copies` of them instantiated and launched, by cudaMemGetInfo), which the
// server's cached captured steps hold beside what its budgets charge.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_split.h"
#include "bench/percentiles.h"
#include "kernels/cpu/thread_pool.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(int, reps, 2000, "timed calls of each kind");
ABSL_FLAG(int, warmup, 50, "untimed calls of each kind first");
ABSL_FLAG(int, kernels, 3, "empty kernels in the step-shaped graph (the shortlist's three)");
ABSL_FLAG(int64_t, upload_bytes, 33 << 10, "the graph's upload (a step's queries and new KV)");
ABSL_FLAG(int64_t, download_bytes, 132 << 10, "the graph's download (32 shortlists of 1024)");
ABSL_FLAG(int, rows_2d, 8, "rows of the 2-D copy (KV heads)");
ABSL_FLAG(int, row_bytes_2d, 8, "bytes per row of the 2-D copy (one key's code)");
ABSL_FLAG(std::string, graphs,
          "served=euKKKKKdekKKKccde,served_no_events=uKKKKKdkKKKccd,"
          "served_no_small_copies=euKKKKKdekKKKde,served_kernels_only=KKKKKkKKK,"
          "nine_small_kernels=kkkkkkkkk,step5=eukde,nine_distinct_kernels=xxxxxxxxx,"
          "nine_big_parameter_kernels=PPPPPPPPP,nine_big_smem_kernels=LLLLLLLLL,"
          "served_distinct=euxxxxxdexxxxccde",
          "graphs to time the launch of, name=nodes in stream order: e an event record "
          "(external, as the server's), u the upload, d the download, s a 4-byte memset, c a "
          "4-byte device-to-device copy, k an empty kernel, K an empty kernel of 1024 blocks, x "
          "an empty kernel of its own function (the next of nine), P an empty kernel taking 2 KB "
          "of parameters, L an empty kernel of 1024 blocks with 100 KB of shared memory");
ABSL_FLAG(std::string, pool_graphs, "served,step5",
          "graphs of --graphs also launched as item 0 of a compute-pool loop");
ABSL_FLAG(int, pool_items, 32, "the pool loop's other items (a step's heads)");
ABSL_FLAG(int, pool_item_rows, 1280, "256-byte rows each of them gathers at random");
ABSL_FLAG(int, pool_gap_us, 300, "the pause between pool loops (a request's round trip)");
ABSL_FLAG(int, graph_copies, 256,
          "executable copies of each --graphs graph instantiated and launched at once, for the "
          "device memory each takes (0: not measured); 256 is the captured steps a Decode "
          "stream keeps at most (gpu_static_set.cc, kMaxCapturedSteps)");

namespace {

__global__ void EmptyKernel() {}

// Kernels that differ from EmptyKernel in one way each, as a served step's kernels do.
template <int kWhich>
__global__ void DistinctKernel() {}
struct BigParameters {
  int words[512];
};
__global__ void BigParameterKernel(const BigParameters p) {
  if (p.words[threadIdx.x] == 42) asm volatile("");  // reads its parameters
}
constexpr int kBigSmemBytes = 100 << 10;
__global__ void BigSmemKernel() {
  extern __shared__ char smem[];
  if (threadIdx.x == 1024) smem[0] = 0;  // never: the allocation alone is the point
}
constexpr void (*kDistinctKernels[])() = {
    DistinctKernel<0>, DistinctKernel<1>, DistinctKernel<2>, DistinctKernel<3>, DistinctKernel<4>,
    DistinctKernel<5>, DistinctKernel<6>, DistinctKernel<7>, DistinctKernel<8>};

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
  if (!Check(cudaFuncSetAttribute(BigSmemKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  kBigSmemBytes),
             "allowing 100 KB of shared memory")) {
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
  // Each spelled graph's launch, the stream drained between launches (as a served step's).
  std::vector<cudaEvent_t> events;
  const std::vector<std::string> pool_graphs = absl::StrSplit(absl::GetFlag(FLAGS_pool_graphs), ',');
  const int pool_items = absl::GetFlag(FLAGS_pool_items);
  const int pool_item_rows = absl::GetFlag(FLAGS_pool_item_rows);
  const auto pool_gap = std::chrono::microseconds(absl::GetFlag(FLAGS_pool_gap_us));
  constexpr int64_t kTableRows = int64_t{1} << 22;  // 1 GiB of 256-byte rows to gather from
  std::vector<uint64_t> table;
  for (const std::string& item :
       std::vector<std::string>(absl::StrSplit(absl::GetFlag(FLAGS_graphs), ','))) {
    const std::vector<std::string> parts = absl::StrSplit(item, '=');
    if (parts.size() != 2) {
      std::fprintf(stderr, "driver_call_bench: --graphs wants name=nodes, got '%s'\n",
                   item.c_str());
      return 2;
    }
    auto enqueue = [&]() {
      bool ok = true;
      size_t event = 0, distinct = 0;
      for (char node : parts[1]) {
        if (!ok) break;
        switch (node) {
          case 'e':
            if (event == events.size()) {
              events.emplace_back();
              ok = Check(cudaEventCreate(&events.back()), "an event");
            }
            ok = ok && Check(cudaEventRecordWithFlags(events[event++], stream,
                                                      cudaEventRecordExternal),
                             "an event node");
            break;
          case 'u':
            ok = Check(cudaMemcpyAsync(dev, host, up, cudaMemcpyHostToDevice, stream), "upload");
            break;
          case 'd':
            ok = Check(cudaMemcpyAsync(host, dev, down, cudaMemcpyDeviceToHost, stream),
                       "download");
            break;
          case 's':
            ok = Check(cudaMemsetAsync(dev, 0, 4, stream), "memset");
            break;
          case 'c':
            ok = Check(cudaMemcpyAsync(static_cast<char*>(dev) + 64, static_cast<char*>(dev) + 128,
                                       4, cudaMemcpyDeviceToDevice, stream),
                       "a small copy");
            break;
          case 'k':
          case 'K':
            EmptyKernel<<<node == 'k' ? 1 : 1024, 32, 0, stream>>>();
            ok = Check(cudaGetLastError(), "a kernel");
            break;
          case 'x':
            kDistinctKernels[distinct++ % std::size(kDistinctKernels)]<<<1, 32, 0, stream>>>();
            ok = Check(cudaGetLastError(), "a distinct kernel");
            break;
          case 'P':
            BigParameterKernel<<<1, 32, 0, stream>>>(BigParameters{});
            ok = Check(cudaGetLastError(), "a kernel of big parameters");
            break;
          case 'L':
            BigSmemKernel<<<1024, 32, kBigSmemBytes, stream>>>();
            ok = Check(cudaGetLastError(), "a kernel of big shared memory");
            break;
          default:
            std::fprintf(stderr, "driver_call_bench: unknown node '%c'\n", node);
            ok = false;
        }
      }
      return ok;
    };
    cudaGraph_t spelled;
    cudaGraphExec_t spelled_exec;
    if (!Check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "capture")) {
      return 1;
    }
    const bool enqueued = enqueue();
    if (!Check(cudaStreamEndCapture(stream, &spelled), "capture") || !enqueued ||
        !Check(cudaGraphInstantiate(&spelled_exec, spelled, 0), "instantiating")) {
      return 1;
    }
    std::vector<double> us;
    for (int i = 0; i < warmup + reps; ++i) {
      const auto t0 = Clock::now();
      const cudaError_t e = cudaGraphLaunch(spelled_exec, stream);
      const double micros = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
      if (!Check(e, "a spelled graph") || !Check(cudaStreamSynchronize(stream), "draining")) {
        return 1;
      }
      if (i >= warmup) us.push_back(micros);
    }
    size_t nodes = 0;
    Check(cudaGraphGetNodes(spelled, nullptr, &nodes), "counting nodes");
    out["graph_launch_us"][parts[0]] = kvrecall::Percentiles(us);
    out["graph_launch_us"][parts[0]]["nodes"] = parts[1];
    out["graph_launch_us"][parts[0]]["graph_nodes"] = nodes;
    if (std::find(pool_graphs.begin(), pool_graphs.end(), parts[0]) != pool_graphs.end()) {
      if (table.empty()) table.assign(kTableRows * 32, 1);
      std::vector<double> pool_us;
      std::vector<uint64_t> sums(pool_items + 1);
      for (int i = 0; i < warmup + reps; ++i) {
        std::this_thread::sleep_for(pool_gap);  // the workers go back to waiting
        cudaError_t e = cudaSuccess;
        double micros = 0;
        kvrecall::cpu::ParallelFor(pool_items + 1, pool_items + 1, [&](int64_t item) {
          if (item == 0) {
            const auto t0 = Clock::now();
            e = cudaGraphLaunch(spelled_exec, stream);
            micros = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
            return;
          }
          uint64_t sum = 0, at = static_cast<uint64_t>(item) * 2654435761u;
          for (int r = 0; r < pool_item_rows; ++r) {
            at = at * 6364136223846793005u + 1442695040888963407u;
            const uint64_t* row = table.data() + (at >> 42) % kTableRows * 32;
            for (int w = 0; w < 32; w += 8) sum += row[w];
          }
          sums[item] = sum;
        });
        if (!Check(e, "a spelled graph in the pool") ||
            !Check(cudaStreamSynchronize(stream), "draining")) {
          return 1;
        }
        if (i >= warmup) pool_us.push_back(micros);
      }
      out["pool_launch_us"][parts[0]] = kvrecall::Percentiles(pool_us);
      out["pool_launch_us"][parts[0]]["checksum"] = sums[1];
    }
    if (const int copies = absl::GetFlag(FLAGS_graph_copies); copies > 0) {
      size_t free_before = 0, free_after = 0, total = 0;
      if (!Check(cudaDeviceSynchronize(), "draining") ||
          !Check(cudaMemGetInfo(&free_before, &total), "free memory")) {
        return 1;
      }
      std::vector<cudaGraphExec_t> execs(copies);
      for (cudaGraphExec_t& copy : execs) {
        if (!Check(cudaGraphInstantiate(&copy, spelled, 0), "instantiating a copy") ||
            !Check(cudaGraphLaunch(copy, stream), "launching a copy")) {
          return 1;
        }
      }
      if (!Check(cudaStreamSynchronize(stream), "draining") ||
          !Check(cudaMemGetInfo(&free_after, &total), "free memory")) {
        return 1;
      }
      for (cudaGraphExec_t copy : execs) cudaGraphExecDestroy(copy);
      const auto held = static_cast<int64_t>(free_before) - static_cast<int64_t>(free_after);
      out["graph_device_bytes"][parts[0]] = {{"copies", copies},
                                             {"bytes", held},
                                             {"bytes_each", held / copies}};
    }
    cudaGraphExecDestroy(spelled_exec);
    cudaGraphDestroy(spelled);
  }
  for (cudaEvent_t e : events) cudaEventDestroy(e);
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
