// Whether the GPU should rescore some of a tiered step's exact heads by reading the host's KV
// over PCIe (issue 15's "more bandwidth" lever, as RetroInfer reads host KV): what scattered
// 256-byte row reads from mapped host memory give a GPU kernel, against the same gather from
// device memory, a contiguous copy over the same link, and the host's own threads.
//
// One layer of bf16 keys ([tokens, kv_heads, head_dim], row-major, allocated as
// server/kv_store.cc allocates them: server/host_memory.h, in 2 MiB pages, or in 4 KiB pages
// with --huge_pages=off) filled with N(0, 1) and registered with the device (cudaHostRegister,
// mapped and read-only; the registration's time is reported, as a session would pay it per
// growth of its store, apart from the CUDA context's creation). A GPU "head" scores `rows`
// positions of its KV head, drawn afresh at random every step (a shortlist with its outliers,
// plus the support's value rows: the bytes a head's rescoring and attention read), one warp per
// row, each lane loading 8 bytes, several rows in flight per warp. Prints one JSON object:
// - `gpu`: per count of heads, the kernel's device time (events) and the host's wall from
//   launch to the end of a stream synchronize, reading the mapped host rows and, apart, a copy
//   of them in device memory; the rows' GB/s; and the scores checked against the host's
//   cpu::ScoreTokens (the kernel sums in another order: relative error reported);
// - `copy`: a contiguous pinned host-to-device copy of the same bytes (the link's rate);
// - `split`: a step of `q_heads` heads on `threads` host threads (cpu::ScoreTokens over the same
//   rows, as host_gather_bench's scan), with G of them given to the GPU instead, both at once:
//   the step's wall p50 per G, and the host part's and the GPU part's alone. G = 0 is the
//   all-host step that the tiered placement runs today;
// - `exact`: the same split for whole exact heads: a head's candidates are a shortlist of
//   `shortlist` positions and its KV head's `outliers`; on the GPU cuda::CandidateAttention
//   (kernels/cuda/candidate_attention.h: the union, exact scores, top K, attention over the
//   values, all read from the mapped host KV), on the host what ShortlistSelector::Select runs
//   (cpu::ScoreTokens, cpu::TopKPositions, cpu::PartialAttentionScored). Per G: the kernel alone
//   (device time, from host and from device memory) and the split step's wall;
// - `host_pages`: the host's THP mode (/sys/kernel/mm/transparent_hugepage/enabled, defrag) and,
//   per key array, the AnonHugePages it got (/proc/self/smaps);
// - `pages` (--huge_pages=both): a second copy of the keys in 4 KiB pages, and per step, in
//   turn on each array (the order alternating), on positions of their own: the GPU's gather of
//   all `q_heads` heads from the mapped array (device time), the host threads' gather of them
//   (wall), and the split step of half of them on each. Each figure for both arrays and their
//   ratio, 4 KiB over 2 MiB (above 1: huge pages are faster). The other sections read the
//   2 MiB array.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "bench/cuda_bench_check.h"
#include "bench/percentiles.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/cuda/candidate_attention.h"
#include "kernels/dtype.h"
#include "kernels/kv_view.h"
#include "nlohmann/json.hpp"
#include "server/host_memory.h"

ABSL_FLAG(int64_t, tokens, 131072, "tokens of the layer");
ABSL_FLAG(int, q_heads, 32, "query heads of a step");
ABSL_FLAG(int, kv_heads, 8, "KV heads");
ABSL_FLAG(int, rows, 1790,
          "rows each head reads (1278: a 1024 shortlist with its outliers at 128K, plus 512 "
          "support values)");
ABSL_FLAG(std::string, gpu_heads, "1,2,4,8,16,32", "head counts the GPU gathers for, alone");
ABSL_FLAG(std::string, split_heads, "0,4,8,12,16",
          "heads of the step given to the GPU in the split runs (0: all on the host)");
ABSL_FLAG(int, shortlist, 1024, "an exact head's shortlist (the exact runs)");
ABSL_FLAG(int, outliers, 255, "a KV head's outliers (the exact runs; 255 at 128K)");
ABSL_FLAG(int, top_k, 512, "positions an exact head attends to");
ABSL_FLAG(int, threads, 16, "the host's threads in the split runs");
ABSL_FLAG(int, steps, 100, "measured steps per configuration");
ABSL_FLAG(int, warmup, 10, "steps before them");
ABSL_FLAG(std::string, huge_pages, "on",
          "the host keys' pages: on (2 MiB, as kvrecalld --host_huge_pages allocates them), off "
          "(4 KiB), or both (the sections on the 2 MiB array, then the `pages` comparison of the "
          "two, interleaved step by step)");

namespace kvrecall::bench {
namespace {

using Clock = std::chrono::steady_clock;
constexpr int kHeadDim = 128;   // one warp's 32 lanes x 4 elements
constexpr int kWarpsPerBlock = 8;
constexpr int kRowsPerWarp = 4;  // loads issued before any is used

// scores[h][i] = scale * <q[h], key(ids[h][i], kv_head(h))> for h < blockIdx.y's heads.
// keys: [tokens, kv_heads, 128] bf16; q: [heads, 128] f32; ids, scores: [heads, rows].
__global__ void ScoreRowsKernel(const uint16_t* __restrict__ keys, int kv_heads, int group,
                                const float* __restrict__ q, const int32_t* __restrict__ ids,
                                int rows, float scale, float* __restrict__ scores) {
  const int head = blockIdx.y;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int kv_head = head / group;
  const float4 qv = reinterpret_cast<const float4*>(q + head * kHeadDim)[lane];
  const int first = (blockIdx.x * kWarpsPerBlock + warp) * kRowsPerWarp;
  uint2 raw[kRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int i = first + r;
    if (i < rows) {
      const int64_t t = ids[static_cast<int64_t>(head) * rows + i];
      const uint16_t* row = keys + (t * kv_heads + kv_head) * kHeadDim;
      raw[r] = reinterpret_cast<const uint2*>(row)[lane];
    }
  }
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int i = first + r;
    if (i >= rows) break;
    const float a = __uint_as_float(raw[r].x << 16), b = __uint_as_float(raw[r].x & 0xffff0000u);
    const float c = __uint_as_float(raw[r].y << 16), d = __uint_as_float(raw[r].y & 0xffff0000u);
    float sum = qv.x * a + qv.y * b + qv.z * c + qv.w * d;
    for (int offset = 16; offset > 0; offset >>= 1) {
      sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    }
    if (lane == 0) scores[static_cast<int64_t>(head) * rows + i] = sum * scale;
  }
}

void LaunchScores(const uint16_t* keys, int kv_heads, int group, const float* q,
                  const int32_t* ids, int heads, int rows, float scale, float* scores,
                  cudaStream_t stream) {
  const int rows_per_block = kWarpsPerBlock * kRowsPerWarp;
  const dim3 grid((rows + rows_per_block - 1) / rows_per_block, heads);
  ScoreRowsKernel<<<grid, kWarpsPerBlock * 32, 0, stream>>>(keys, kv_heads, group, q, ids, rows,
                                                             scale, scores);
}

std::vector<int> ParseCounts(const std::string& flag, const char* name, int most) {
  std::vector<int> counts;
  for (absl::string_view part : absl::StrSplit(flag, ',')) {
    int c = 0;
    if (!absl::SimpleAtoi(part, &c) || c < 0 || c > most) {
      std::fprintf(stderr, "--%s: counts in [0, %d], comma-separated\n", name, most);
      std::exit(2);
    }
    counts.push_back(c);
  }
  return counts;
}

double MicrosSince(Clock::time_point t) {
  return std::chrono::duration<double, std::micro>(Clock::now() - t).count();
}

// A copy of the layer's keys in the host's memory and its registration with the device.
struct KeyArray {
  HostMemory memory;
  uint16_t* mapped = nullptr;  // the device's address of it
  double register_us = 0;
  bool read_only = false;
};

void Register(KeyArray& array) {
  void* const host = array.memory.data();
  const size_t bytes = array.memory.size();
  auto t0 = Clock::now();
  // Read-only where the device supports it (the GPU never writes the host's KV).
  array.read_only = true;
  if (cudaHostRegister(host, bytes, cudaHostRegisterMapped | cudaHostRegisterReadOnly) !=
      cudaSuccess) {
    cudaGetLastError();
    array.read_only = false;
    t0 = Clock::now();
    CHECK_CUDA(cudaHostRegister(host, bytes, cudaHostRegisterMapped));
  }
  array.register_us = MicrosSince(t0);
  CHECK_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&array.mapped), host, 0));
}

// The host's THP settings and what each array got (registered), also on stderr after `when`.
nlohmann::json HostPagesJson(const std::vector<KeyArray>& arrays, const char* when) {
  const std::string enabled = TransparentHugePagesMode("enabled");
  const std::string defrag = TransparentHugePagesMode("defrag");
  std::fprintf(stderr, "%s: transparent_hugepage/enabled [%s], defrag [%s]\n", when,
               enabled.c_str(), defrag.c_str());
  nlohmann::json list = nlohmann::json::array();
  for (const KeyArray& array : arrays) {
    const HostMemory& m = array.memory;
    const int64_t huge = ValueOrDie(AnonHugePageBytes(m.data(), m.size()));
    const bool aligned = reinterpret_cast<uintptr_t>(m.data()) % kHugePageBytes == 0;
    list.push_back({{"huge_pages_requested", m.huge_pages_requested()},
                    {"huge_pages_advised", m.huge_pages_advised()},
                    {"aligned_2mib", aligned},
                    {"bytes", m.size()},
                    {"anon_huge_page_bytes", huge},
                    {"register_us", array.register_us},
                    {"registered_read_only", array.read_only}});
    std::fprintf(stderr,
                 "%s: %s array of %zu bytes: MADV_%sHUGEPAGE %s, AnonHugePages %lld (%.1f%%), "
                 "registered in %.0f us\n",
                 when, m.huge_pages_requested() ? "2 MiB" : "4 KiB", m.size(),
                 m.huge_pages_requested() ? "" : "NO",
                 m.huge_pages_requested() ? (m.huge_pages_advised() ? "accepted" : "refused")
                                          : "asked",
                 static_cast<long long>(huge), 100.0 * huge / m.size(), array.register_us);
  }
  return {{"transparent_hugepage_enabled", enabled},
          {"transparent_hugepage_defrag", defrag},
          {"arrays", list}};
}

int Main() {
  const int64_t tokens = absl::GetFlag(FLAGS_tokens);
  const int q_heads = absl::GetFlag(FLAGS_q_heads), kv_heads = absl::GetFlag(FLAGS_kv_heads);
  const int rows = absl::GetFlag(FLAGS_rows), threads = absl::GetFlag(FLAGS_threads);
  const int steps = absl::GetFlag(FLAGS_steps), warmup = absl::GetFlag(FLAGS_warmup);
  if (tokens < 1 || tokens > INT32_MAX || q_heads < 1 || kv_heads < 1 ||
      q_heads % kv_heads != 0 || rows < 1 || threads < 1 || steps < 1 || warmup < 0) {
    std::fprintf(stderr, "need tokens, rows, threads, steps >= 1; kv_heads dividing q_heads\n");
    return 2;
  }
  const std::vector<int> gpu_heads = ParseCounts(absl::GetFlag(FLAGS_gpu_heads), "gpu_heads",
                                                 q_heads);
  const std::vector<int> split_heads =
      ParseCounts(absl::GetFlag(FLAGS_split_heads), "split_heads", q_heads);
  const int group = q_heads / kv_heads;
  const int d = kHeadDim;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const double row_bytes = d * 2.0;

  const std::string pages = absl::GetFlag(FLAGS_huge_pages);
  if (pages != "on" && pages != "off" && pages != "both") {
    std::fprintf(stderr, "--huge_pages: on, off or both\n");
    return 2;
  }
  // The CUDA context first, so that the registrations' times are theirs alone.
  auto t0 = Clock::now();
  CHECK_CUDA(cudaFree(nullptr));
  const double context_us = MicrosSince(t0);

  // The host's keys, as the KV store allocates them, then registered: [0] is the array the
  // sections read (2 MiB pages unless --huge_pages=off), [1] the 4 KiB one of --huge_pages=both.
  const size_t elements = static_cast<size_t>(tokens) * kv_heads * d;
  const size_t key_bytes = elements * sizeof(uint16_t);
  std::vector<KeyArray> arrays;
  for (const bool huge : {pages != "off", false}) {
    if (!arrays.empty() && pages != "both") break;
    arrays.push_back({ValueOrDie(AllocateHostMemory(key_bytes, huge))});
  }
  uint16_t* const host_keys = reinterpret_cast<uint16_t*>(arrays[0].memory.data());
  {
    std::mt19937_64 rng(1);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (size_t i = 0; i < elements; ++i) host_keys[i] = FloatToBf16(normal(rng));
    if (arrays.size() > 1) std::memcpy(arrays[1].memory.data(), host_keys, key_bytes);
  }
  for (KeyArray& array : arrays) Register(array);
  const double register_us = arrays[0].register_us;
  const bool read_only = arrays[0].read_only;
  uint16_t* const mapped_keys = arrays[0].mapped;
  const nlohmann::json host_pages = HostPagesJson(arrays, "host pages");
  uint16_t* device_keys = nullptr;
  CHECK_CUDA(cudaMalloc(&device_keys, key_bytes));
  CHECK_CUDA(cudaMemcpy(device_keys, host_keys, key_bytes, cudaMemcpyHostToDevice));
  const KvView kv{host_keys, host_keys, tokens, kv_heads, d, KvElement::kBf16};

  std::vector<float> queries(static_cast<size_t>(q_heads) * d);
  {
    std::mt19937_64 rng(2);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (float& x : queries) x = normal(rng);
  }
  // Every step's positions, drawn ahead and uploaded once: [draws][q_heads][rows] (a draw per
  // step and configuration keeps the rows out of the caches: 100 steps of 32 x 1790 rows at
  // 128K touch most of the layer).
  // The split runs interleave their configurations step by step (the host's memory speed
  // drifts between and within runs: d52 against d53), each on positions of its own.
  const int draws = warmup + steps;
  const int configs = std::max<int>(1, static_cast<int>(split_heads.size()));
  const int all_draws = draws * configs;
  const size_t per_draw = static_cast<size_t>(q_heads) * rows;
  std::vector<int32_t> ids(per_draw * all_draws);
  {
    std::mt19937_64 rng(3);
    std::uniform_int_distribution<int32_t> position(0, static_cast<int32_t>(tokens - 1));
    for (int32_t& id : ids) id = position(rng);
  }
  float* d_q = nullptr;
  int32_t* d_ids = nullptr;
  float* d_scores = nullptr;
  CHECK_CUDA(cudaMalloc(&d_q, queries.size() * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&d_ids, ids.size() * sizeof(int32_t)));
  CHECK_CUDA(cudaMalloc(&d_scores, per_draw * sizeof(float)));
  CHECK_CUDA(cudaMemcpy(d_q, queries.data(), queries.size() * sizeof(float),
                        cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(d_ids, ids.data(), ids.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));

  // The GPU's scores of draw 0 against the host's, all heads, from the mapped rows.
  double worst_relative = 0;
  {
    LaunchScores(mapped_keys, kv_heads, group, d_q, d_ids, q_heads, rows, scale, d_scores,
                 stream);
    CHECK_CUDA(cudaStreamSynchronize(stream));
    std::vector<float> got(per_draw), want(rows);
    CHECK_CUDA(cudaMemcpy(got.data(), d_scores, per_draw * sizeof(float),
                          cudaMemcpyDeviceToHost));
    for (int h = 0; h < q_heads; ++h) {
      cpu::ScoreTokens(queries.data() + static_cast<size_t>(h) * d, kv,
                       KvHeadOf(h, q_heads, kv_heads),
                       std::span<const int32_t>(ids.data() + static_cast<size_t>(h) * rows, rows),
                       scale, want.data());
      for (int i = 0; i < rows; ++i) {
        const double error = std::abs(got[static_cast<size_t>(h) * rows + i] - want[i]) /
                             std::max(1.0, static_cast<double>(std::abs(want[i])));
        worst_relative = std::max(worst_relative, error);
      }
    }
  }
  const bool scores_agree = worst_relative < 1e-4;
  double exact_lse_worst_relative = 0;  // the exact runs' kernel against the host

  // The GPU alone, per head count and source.
  nlohmann::json gpu = nlohmann::json::array();
  for (int heads : gpu_heads) {
    if (heads == 0) continue;
    for (const bool mapped : {true, false}) {
      std::vector<double> device_us, wall_us;
      for (int s = 0; s < draws; ++s) {
        const int32_t* step_ids = d_ids + per_draw * s;
        const auto t = Clock::now();
        CHECK_CUDA(cudaEventRecord(start, stream));
        LaunchScores(mapped ? mapped_keys : device_keys, kv_heads, group, d_q, step_ids, heads,
                     rows, scale, d_scores, stream);
        CHECK_CUDA(cudaEventRecord(stop, stream));
        CHECK_CUDA(cudaStreamSynchronize(stream));
        const double wall = MicrosSince(t);
        float ms = 0;
        CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
        if (s < warmup) continue;
        device_us.push_back(ms * 1e3);
        wall_us.push_back(wall);
      }
      const double p50 = Percentiles(device_us)["p50"].get<double>();
      const double bytes = static_cast<double>(heads) * rows * row_bytes;
      gpu.push_back({{"heads", heads},
                     {"source", mapped ? "host_mapped" : "device"},
                     {"rows", static_cast<int64_t>(heads) * rows},
                     {"device_us", Percentiles(device_us)},
                     {"wall_us", Percentiles(wall_us)},
                     {"gb_per_s", bytes / p50 / 1e3}});
      std::fprintf(stderr, "gpu %2d heads from %-11s: device p50 %.1f us (%.1f GB/s), wall %.1f\n",
                   heads, mapped ? "host_mapped" : "device", p50, bytes / p50 / 1e3,
                   Percentiles(wall_us)["p50"].get<double>());
    }
  }

  // The link's contiguous rate for the largest gather's bytes.
  nlohmann::json copy;
  {
    const size_t bytes = per_draw * static_cast<size_t>(row_bytes);
    std::vector<double> us;
    for (int s = 0; s < draws; ++s) {
      CHECK_CUDA(cudaEventRecord(start, stream));
      CHECK_CUDA(cudaMemcpyAsync(device_keys, host_keys, bytes, cudaMemcpyHostToDevice, stream));
      CHECK_CUDA(cudaEventRecord(stop, stream));
      CHECK_CUDA(cudaStreamSynchronize(stream));
      float ms = 0;
      CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
      if (s >= warmup) us.push_back(ms * 1e3);
    }
    const double p50 = Percentiles(us)["p50"].get<double>();
    copy = {{"bytes", bytes}, {"device_us", Percentiles(us)},
            {"gb_per_s", static_cast<double>(bytes) / p50 / 1e3}};
    std::fprintf(stderr, "contiguous copy of %zu bytes: %.1f us (%.1f GB/s)\n", bytes, p50,
                 static_cast<double>(bytes) / p50 / 1e3);
  }

  // The split step: heads [0, G) on the GPU (launched first), [G, q_heads) on the host's pool,
  // the step done when both are.
  std::vector<std::vector<float>> host_scores(q_heads, std::vector<float>(rows));
  // Heads [first_head, q_heads) of `keys` on the host's pool, at step_ids ([q_heads][rows]).
  auto host_gather = [&](const KvView& keys, const int32_t* step_ids, int first_head) {
    cpu::ParallelFor(q_heads - first_head, threads, [&](int64_t item) {
      const int h = first_head + static_cast<int>(item);
      cpu::ScoreTokens(queries.data() + static_cast<size_t>(h) * d, keys,
                       KvHeadOf(h, q_heads, kv_heads),
                       std::span<const int32_t>(step_ids + static_cast<size_t>(h) * rows, rows),
                       scale, host_scores[h].data());
    });
  };
  auto host_part = [&](int s, int first_head) {
    host_gather(kv, ids.data() + per_draw * s, first_head);
  };
  nlohmann::json split = nlohmann::json::array();
  {
    std::vector<std::vector<double>> step_us(configs), host_us(configs), gpu_us(configs);
    for (int s = 0; s < draws; ++s) {
      for (int c = 0; c < static_cast<int>(split_heads.size()); ++c) {
        const int g = split_heads[c];
        const int draw = s * configs + c;
        cpu::ParallelFor(threads, threads, [](int64_t) {});  // the pool awake, as in a server step
        const auto t = Clock::now();
        if (g > 0) {
          CHECK_CUDA(cudaEventRecord(start, stream));
          LaunchScores(mapped_keys, kv_heads, group, d_q, d_ids + per_draw * draw, g, rows, scale,
                       d_scores, stream);
          CHECK_CUDA(cudaEventRecord(stop, stream));
        }
        host_part(draw, g);
        const double host = MicrosSince(t);
        if (g > 0) CHECK_CUDA(cudaStreamSynchronize(stream));
        const double wall = MicrosSince(t);
        float ms = 0;
        if (g > 0) CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
        if (s < warmup) continue;
        step_us[c].push_back(wall);
        host_us[c].push_back(host);
        gpu_us[c].push_back(ms * 1e3);
      }
    }
    for (int c = 0; c < static_cast<int>(split_heads.size()); ++c) {
      const int g = split_heads[c];
      split.push_back({{"gpu_heads", g},
                       {"host_heads", q_heads - g},
                       {"step_us", Percentiles(step_us[c])},
                       {"host_part_us", Percentiles(host_us[c])},
                       {"gpu_part_device_us", g > 0 ? Percentiles(gpu_us[c]) : nlohmann::json()}});
      std::fprintf(stderr, "split %2d gpu / %2d host heads: step p50 %.1f us (host part %.1f, gpu "
                   "%.1f)\n", g, q_heads - g, Percentiles(step_us[c])["p50"].get<double>(),
                   Percentiles(host_us[c])["p50"].get<double>(),
                   g > 0 ? Percentiles(gpu_us[c])["p50"].get<double>() : 0.0);
    }
  }

  // Whole exact heads (values read from the keys' array: the same bytes and pattern).
  const int shortlist = absl::GetFlag(FLAGS_shortlist), outliers = absl::GetFlag(FLAGS_outliers);
  const int top_k = absl::GetFlag(FLAGS_top_k);
  nlohmann::json exact = nlohmann::json::array();
  {
    // Per draw: shortlists [q_heads, shortlist] (the draw's first positions) and outliers
    // [kv_heads, outliers] (positions of their own).
    std::vector<int32_t> outlier_ids(static_cast<size_t>(all_draws) * kv_heads * outliers);
    std::vector<int32_t> shortlists(static_cast<size_t>(all_draws) * q_heads * shortlist);
    {
      // A head's candidates distinct, as the server's are (a shortlist is a top-N, the outliers
      // a set; Select takes the rare id on both lists once); the group's heads share none, as
      // on the synthetic trace (bench/results/gqa_overlap.md).
      std::mt19937_64 rng(4);
      std::uniform_int_distribution<int32_t> position(0, static_cast<int32_t>(tokens - 1));
      std::vector<uint32_t> mark(tokens, 0);
      uint32_t stamp = 0;
      auto fresh = [&](uint32_t upto) {
        int32_t p;
        do p = position(rng); while (mark[p] >= upto);
        mark[p] = stamp;
        return p;
      };
      for (int s = 0; s < all_draws; ++s) {
        for (int g = 0; g < kv_heads; ++g) {
          const uint32_t group_stamp = ++stamp;
          int32_t* extra = outlier_ids.data() + (static_cast<size_t>(s) * kv_heads + g) * outliers;
          for (int i = 0; i < outliers; ++i) extra[i] = fresh(group_stamp);
          for (int h = g * group; h < (g + 1) * group; ++h) {
            ++stamp;  // this head's marks: positions marked since group_stamp are taken
            int32_t* list = shortlists.data() + (static_cast<size_t>(s) * q_heads + h) * shortlist;
            for (int i = 0; i < shortlist; ++i) list[i] = fresh(group_stamp);
          }
        }
      }
    }
    int32_t* d_shortlists = nullptr;
    int32_t* d_outliers = nullptr;
    int32_t* d_outlier_counts = nullptr;
    int32_t* d_coded = nullptr;
    int32_t* d_rows = nullptr;
    cuda::DeviceSeq* d_seqs = nullptr;
    CHECK_CUDA(cudaMalloc(&d_shortlists, shortlists.size() * sizeof(int32_t)));
    CHECK_CUDA(cudaMalloc(&d_outliers, outlier_ids.size() * sizeof(int32_t)));
    CHECK_CUDA(cudaMalloc(&d_outlier_counts, kv_heads * sizeof(int32_t)));
    CHECK_CUDA(cudaMalloc(&d_coded, sizeof(int32_t)));
    CHECK_CUDA(cudaMalloc(&d_rows, q_heads * sizeof(int32_t)));
    CHECK_CUDA(cudaMalloc(&d_seqs, 2 * sizeof(cuda::DeviceSeq)));
    CHECK_CUDA(cudaMemcpy(d_shortlists, shortlists.data(), shortlists.size() * sizeof(int32_t),
                          cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(d_outliers, outlier_ids.data(), outlier_ids.size() * sizeof(int32_t),
                          cudaMemcpyHostToDevice));
    const std::vector<int32_t> counts(kv_heads, outliers), rows_list = [&] {
      std::vector<int32_t> r(q_heads);
      for (int h = 0; h < q_heads; ++h) r[h] = h;
      return r;
    }();
    const auto coded = static_cast<int32_t>(tokens);
    CHECK_CUDA(cudaMemcpy(d_outlier_counts, counts.data(), kv_heads * sizeof(int32_t),
                          cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(d_coded, &coded, sizeof(int32_t), cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(d_rows, rows_list.data(), q_heads * sizeof(int32_t),
                          cudaMemcpyHostToDevice));
    const cuda::DeviceSeq seqs[2] = {
        cuda::DeviceSeq::Contiguous(mapped_keys, mapped_keys, static_cast<int32_t>(tokens)),
        cuda::DeviceSeq::Contiguous(device_keys, device_keys, static_cast<int32_t>(tokens))};
    CHECK_CUDA(cudaMemcpy(d_seqs, seqs, sizeof(seqs), cudaMemcpyHostToDevice));
    float *d_o = nullptr, *d_lse = nullptr;
    int32_t *d_support = nullptr, *d_sizes = nullptr, *d_counts = nullptr;
    CHECK_CUDA(cudaMalloc(&d_o, static_cast<size_t>(q_heads) * d * sizeof(float)));
    CHECK_CUDA(cudaMalloc(&d_lse, q_heads * sizeof(float)));
    CHECK_CUDA(cudaMalloc(&d_support, static_cast<size_t>(q_heads) * top_k * sizeof(int32_t)));
    CHECK_CUDA(cudaMalloc(&d_sizes, q_heads * sizeof(int32_t)));
    CHECK_CUDA(cudaMalloc(&d_counts, q_heads * sizeof(int32_t)));
    const cuda::CandidateOutputs outputs{d_o, d_lse, d_support, d_sizes, d_counts};
    const cuda::DecodeShape shape{1, q_heads, kv_heads, d, cuda::KvDtype::kBf16, scale};
    auto launch = [&](int s, int heads, bool mapped) {
      const cuda::CandidateLists lists{
          d_shortlists + static_cast<size_t>(s) * q_heads * shortlist, nullptr, shortlist,
          d_outliers + static_cast<size_t>(s) * kv_heads * outliers, d_outlier_counts, outliers,
          d_coded, 0};
      CHECK_OK(cuda::CandidateAttention(shape, top_k, d_seqs + (mapped ? 0 : 1), d_q, lists,
                                        d_rows, heads, outputs, nullptr, stream));
    };
    // The host's exact head h of draw s, as ShortlistSelector::Select runs it.
    std::vector<std::vector<int32_t>> candidates(q_heads), top(q_heads), support(q_heads);
    std::vector<std::vector<float>> scores(q_heads), support_scores(q_heads);
    std::vector<float> out(static_cast<size_t>(q_heads) * d), lse(q_heads);
    auto host_head = [&](int s, int h) {
      const int kv_head = KvHeadOf(h, q_heads, kv_heads);
      std::vector<int32_t>& c = candidates[h];
      const int32_t* list = shortlists.data() + (static_cast<size_t>(s) * q_heads + h) * shortlist;
      const int32_t* extra =
          outlier_ids.data() + (static_cast<size_t>(s) * kv_heads + kv_head) * outliers;
      c.assign(list, list + shortlist);
      c.insert(c.end(), extra, extra + outliers);
      scores[h].resize(c.size());
      cpu::ScoreTokens(queries.data() + static_cast<size_t>(h) * d, kv, kv_head, c, scale,
                       scores[h].data());
      cpu::TopKPositions(scores[h], top_k, &top[h]);
      support[h].resize(top[h].size());
      support_scores[h].resize(top[h].size());
      for (size_t j = 0; j < top[h].size(); ++j) {
        support[h][j] = c[top[h][j]];
        support_scores[h][j] = scores[h][top[h][j]];
      }
      cpu::PartialAttentionScored(support_scores[h], kv, kv_head, support[h],
                                  out.data() + static_cast<size_t>(h) * d, &lse[h]);
    };
    std::vector<std::vector<double>> mapped_us(configs), device_us(configs), step_us(configs),
        host_us(configs);
    for (int s = 0; s < draws; ++s) {
      for (int c = 0; c < static_cast<int>(split_heads.size()); ++c) {
        const int g = split_heads[c];
        const int draw = s * configs + c;
        // The kernel alone, from the mapped host KV and from the device's copy.
        for (const bool mapped : {true, false}) {
          if (g == 0) break;
          CHECK_CUDA(cudaEventRecord(start, stream));
          launch(draw, g, mapped);
          CHECK_CUDA(cudaEventRecord(stop, stream));
          CHECK_CUDA(cudaStreamSynchronize(stream));
          float ms = 0;
          CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
          if (s >= warmup) (mapped ? mapped_us : device_us)[c].push_back(ms * 1e3);
        }
        // The split step: its rows fresh again (the kernel's reads above left them in the
        // host's caches), so on the next configuration's positions.
        const int fresh = s * configs + (c + 1) % configs;
        cpu::ParallelFor(threads, threads, [](int64_t) {});
        const auto t = Clock::now();
        if (g > 0) launch(fresh, g, /*mapped=*/true);
        cpu::ParallelFor(q_heads - g, threads,
                         [&](int64_t item) { host_head(fresh, g + static_cast<int>(item)); });
        const double host = MicrosSince(t);
        if (g > 0) CHECK_CUDA(cudaStreamSynchronize(stream));
        if (s < warmup) continue;
        step_us[c].push_back(MicrosSince(t));
        host_us[c].push_back(host);
      }
    }
    for (int c = 0; c < static_cast<int>(split_heads.size()); ++c) {
      const int g = split_heads[c];
      nlohmann::json run = {{"gpu_heads", g},
                            {"host_heads", q_heads - g},
                            {"step_us", Percentiles(step_us[c])},
                            {"host_part_us", Percentiles(host_us[c])}};
      if (g > 0) {
        run["kernel_from_host_us"] = Percentiles(mapped_us[c]);
        run["kernel_from_device_us"] = Percentiles(device_us[c]);
      }
      std::fprintf(stderr,
                   "exact %2d gpu / %2d host heads: step p50 %.1f us (host part %.1f); kernel "
                   "from host %.1f, from device %.1f\n",
                   g, q_heads - g, Percentiles(step_us[c])["p50"].get<double>(),
                   Percentiles(host_us[c])["p50"].get<double>(),
                   g > 0 ? Percentiles(mapped_us[c])["p50"].get<double>() : 0.0,
                   g > 0 ? Percentiles(device_us[c])["p50"].get<double>() : 0.0);
      exact.push_back(run);
    }
    // The kernel's result for the first heads of the last draw against the host's.
    if (!split_heads.empty() && *std::max_element(split_heads.begin(), split_heads.end()) > 0) {
      const int g = *std::max_element(split_heads.begin(), split_heads.end());
      launch(draws - 1, g, /*mapped=*/true);
      CHECK_CUDA(cudaStreamSynchronize(stream));
      std::vector<float> got_lse(g);
      CHECK_CUDA(cudaMemcpy(got_lse.data(), d_lse, g * sizeof(float), cudaMemcpyDeviceToHost));
      double worst = 0;
      for (int h = 0; h < g; ++h) {
        host_head(draws - 1, h);
        worst = std::max(worst, std::abs(static_cast<double>(got_lse[h]) - lse[h]) /
                                    std::max(1.0, std::abs(static_cast<double>(lse[h]))));
      }
      exact_lse_worst_relative = worst;
    }
    for (void* p : std::initializer_list<void*>{d_shortlists, d_outliers, d_outlier_counts,
                                                 d_coded, d_rows, d_seqs, d_o, d_lse, d_support,
                                                 d_sizes, d_counts}) {
      CHECK_CUDA(cudaFree(p));
    }
  }

  // 4 KiB against 2 MiB pages (--huge_pages=both), interleaved step by step (the host's memory
  // speed drifts between runs: only figures of one run compare). Per step, each array in turn
  // (which goes first alternates), on positions of its own per measurement: the GPU's gather of
  // all heads from the mapped array, the host's gather of them, and the split step (the first
  // half of the heads on the GPU, the rest on the host, at once).
  nlohmann::json pages_result;
  bool pages_scores_agree = true;
  if (arrays.size() > 1) {
    enum { kGpu, kHost, kSplit, kKinds };
    const size_t page_draws = static_cast<size_t>(draws) * 2 * kKinds;
    std::vector<int32_t> page_ids(per_draw * page_draws);
    {
      std::mt19937_64 rng(5);
      std::uniform_int_distribution<int32_t> position(0, static_cast<int32_t>(tokens - 1));
      for (int32_t& id : page_ids) id = position(rng);
    }
    int32_t* d_page_ids = nullptr;
    CHECK_CUDA(cudaMalloc(&d_page_ids, page_ids.size() * sizeof(int32_t)));
    CHECK_CUDA(cudaMemcpy(d_page_ids, page_ids.data(), page_ids.size() * sizeof(int32_t),
                          cudaMemcpyHostToDevice));
    // The same rows read from either array give the same scores, bit for bit.
    std::vector<float> from[2];
    for (int a = 0; a < 2; ++a) {
      LaunchScores(arrays[a].mapped, kv_heads, group, d_q, d_page_ids, q_heads, rows, scale,
                   d_scores, stream);
      from[a].resize(per_draw);
      CHECK_CUDA(cudaMemcpyAsync(from[a].data(), d_scores, per_draw * sizeof(float),
                                 cudaMemcpyDeviceToHost, stream));
      CHECK_CUDA(cudaStreamSynchronize(stream));
    }
    pages_scores_agree = from[0] == from[1];
    const int half = q_heads / 2;
    std::vector<double> us[2][kKinds];  // [array: 0 the 2 MiB one, 1 the 4 KiB one][kind]
    for (int s = 0; s < draws; ++s) {
      for (int turn = 0; turn < 2; ++turn) {
        const int a = (s + turn) % 2;
        const KvView keys{arrays[a].memory.data(), arrays[a].memory.data(), tokens, kv_heads, d,
                          KvElement::kBf16};
        auto draw = [&](int kind) {
          return per_draw * ((static_cast<size_t>(s) * 2 + a) * kKinds + kind);
        };
        CHECK_CUDA(cudaEventRecord(start, stream));
        LaunchScores(arrays[a].mapped, kv_heads, group, d_q, d_page_ids + draw(kGpu), q_heads,
                     rows, scale, d_scores, stream);
        CHECK_CUDA(cudaEventRecord(stop, stream));
        CHECK_CUDA(cudaStreamSynchronize(stream));
        float ms = 0;
        CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));

        cpu::ParallelFor(threads, threads, [](int64_t) {});  // the pool awake
        auto t = Clock::now();
        host_gather(keys, page_ids.data() + draw(kHost), 0);
        const double host = MicrosSince(t);

        cpu::ParallelFor(threads, threads, [](int64_t) {});
        t = Clock::now();
        LaunchScores(arrays[a].mapped, kv_heads, group, d_q, d_page_ids + draw(kSplit), half,
                     rows, scale, d_scores, stream);
        host_gather(keys, page_ids.data() + draw(kSplit), half);
        CHECK_CUDA(cudaStreamSynchronize(stream));
        const double split = MicrosSince(t);
        if (s < warmup) continue;
        us[a][kGpu].push_back(ms * 1e3);
        us[a][kHost].push_back(host);
        us[a][kSplit].push_back(split);
      }
    }
    CHECK_CUDA(cudaFree(d_page_ids));
    pages_result = {{"scores_agree", pages_scores_agree}};
    const char* const names[kKinds] = {"gpu", "host", "split"};
    const char* const what[kKinds] = {"device time", "wall", "step wall"};
    for (int kind = 0; kind < kKinds; ++kind) {
      const double huge = Percentiles(us[0][kind])["p50"].get<double>();
      const double small = Percentiles(us[1][kind])["p50"].get<double>();
      // Rows read: all heads' (a split step's too, half on each side).
      const double bytes = static_cast<double>(q_heads) * rows * row_bytes;
      pages_result[names[kind]] = {{"heads", q_heads},
                                   {"gpu_heads", kind == kHost ? 0 : kind == kGpu ? q_heads : half},
                                   {"small_pages_us", Percentiles(us[1][kind])},
                                   {"huge_pages_us", Percentiles(us[0][kind])},
                                   {"small_pages_gb_per_s", bytes / small / 1e3},
                                   {"huge_pages_gb_per_s", bytes / huge / 1e3},
                                   {"small_over_huge", small / huge}};
      std::fprintf(stderr,
                   "pages %-5s %2d heads, p50 %s: 4 KiB %.1f us (%.1f GB/s), 2 MiB %.1f us "
                   "(%.1f GB/s); 4 KiB / 2 MiB = %.3f\n",
                   names[kind], q_heads, what[kind], small, bytes / small / 1e3, huge,
                   bytes / huge / 1e3, small / huge);
    }
  }

  int device = 0;
  CHECK_CUDA(cudaGetDevice(&device));
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, device));
  const nlohmann::json result = {{"bench", "pcie_gather_bench"},
                                 {"device", prop.name},
                                 {"tokens", tokens},
                                 {"q_heads", q_heads},
                                 {"kv_heads", kv_heads},
                                 {"head_dim", d},
                                 {"rows_per_head", rows},
                                 {"row_bytes", row_bytes},
                                 {"host_threads", threads},
                                 {"context_us", context_us},
                                 {"register_us", register_us},
                                 {"registered_read_only", read_only},
                                 {"registered_bytes", key_bytes},
                                 {"scores_worst_relative_error", worst_relative},
                                 {"scores_agree", scores_agree},
                                 {"gpu", gpu},
                                 {"copy", copy},
                                 {"split", split},
                                 {"shortlist", absl::GetFlag(FLAGS_shortlist)},
                                 {"outliers", absl::GetFlag(FLAGS_outliers)},
                                 {"top_k", absl::GetFlag(FLAGS_top_k)},
                                 {"exact", exact},
                                 {"exact_lse_worst_relative_error", exact_lse_worst_relative},
                                 {"huge_pages", pages},
                                 {"host_pages", host_pages},
                                 {"pages", pages_result},
                                 {"host_pages_after",
                                  HostPagesJson(arrays, "host pages after the runs")}};
  std::printf("%s\n", result.dump(1).c_str());
  for (const KeyArray& array : arrays) CHECK_CUDA(cudaHostUnregister(array.memory.data()));
  if (!scores_agree || !(exact_lse_worst_relative < 1e-4) || !pages_scores_agree) {
    std::fprintf(stderr,
                 "the GPU's scores or states differ from the host's (%.3g, %.3g), or from the "
                 "4 KiB array's (%s)\n",
                 worst_relative, exact_lse_worst_relative,
                 pages_scores_agree ? "they agree" : "they differ");
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace kvrecall::bench

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "pcie_gather_bench: scattered 256-byte row reads of host KV by a GPU kernel over PCIe, "
      "against device memory, a contiguous copy and the host's threads");
  absl::ParseCommandLine(argc, argv);
  return kvrecall::bench::Main();
}
