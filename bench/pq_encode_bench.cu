// How the GPU tier's coding of bulk rows scales with their count (issue 15: a take-over codes the
// rows its learning left on the step's path, a prefill its prompt's bulk;
// server/backends/gpu_static_set.cc): cuda::PqEncode called once per KV head, PqEncode once for
// every KV head (sets), and cuda::PqEncodeRows (a block per row and KV head, the decode step's
// kernel). For each row count, the device time of coding `rows` rows of every KV head
// ([rows, kv_heads, dim] bf16 keys, codebooks [M, 256, dim / M] f32 per head, as BulkCodes
// codes them) by each, timed with events on one stream, p50 of `reps` after `warmup`; the
// jobs' upload apart. Prints one JSON object, microseconds.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "bench/cuda_bench_check.h"
#include "bench/int_list.h"
#include "bench/percentiles.h"
#include "kernels/cuda/pq_encode.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, rows, "8,64,128,256,512,768,1024,1536,2048", "rows to code, per run");
ABSL_FLAG(int, kv_heads, 8, "KV heads (each its own codebooks)");
ABSL_FLAG(int, dim, 128, "head dimension");
ABSL_FLAG(int, subspaces, 8, "codebooks per head (BulkCodes: one per 16 dims)");
ABSL_FLAG(int, reps, 30, "timed runs of each kernel and row count");
ABSL_FLAG(int, warmup, 3, "untimed runs first");

namespace {

// The device time of `run` on `stream`, µs, p50 etc. over `reps` after `warmup` runs.
template <typename Run>
nlohmann::json Timed(cudaStream_t stream, int warmup, int reps, Run run) {
  cudaEvent_t begin, end;
  CHECK_CUDA(cudaEventCreate(&begin));
  CHECK_CUDA(cudaEventCreate(&end));
  std::vector<double> us;
  for (int i = 0; i < warmup + reps; ++i) {
    CHECK_CUDA(cudaEventRecord(begin, stream));
    run();
    CHECK_CUDA(cudaEventRecord(end, stream));
    CHECK_CUDA(cudaEventSynchronize(end));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, begin, end));
    if (i >= warmup) us.push_back(ms * 1e3);
  }
  cudaEventDestroy(begin);
  cudaEventDestroy(end);
  return kvrecall::Percentiles(us);
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "pq_encode_bench: device time of coding bulk rows by PqEncode (a launch per KV head, or "
      "one for every head) and by PqEncodeRows (a block per row and KV head)");
  absl::ParseCommandLine(argc, argv);
  namespace cuda = kvrecall::cuda;
  absl::StatusOr<std::vector<int>> rows_list =
      kvrecall::bench::ParseIntList("--rows", absl::GetFlag(FLAGS_rows));
  CHECK_OK(rows_list.status());
  const int kv_heads = absl::GetFlag(FLAGS_kv_heads), dim = absl::GetFlag(FLAGS_dim);
  const int subspaces = absl::GetFlag(FLAGS_subspaces);
  const int reps = absl::GetFlag(FLAGS_reps), warmup = absl::GetFlag(FLAGS_warmup);
  int max_rows = 0;
  for (int r : *rows_list) max_rows = std::max(max_rows, r);

  // Random bf16 keys (the top halves of f32 normals) and f32 codebooks.
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  std::vector<uint16_t> keys(int64_t{max_rows} * kv_heads * dim);
  for (uint16_t& k : keys) {
    const float x = normal(rng);
    uint32_t bits;
    std::memcpy(&bits, &x, 4);
    k = static_cast<uint16_t>(bits >> 16);
  }
  const int64_t book_floats = int64_t{256} * dim;  // [M, 256, dim / M]
  std::vector<float> books(book_floats * kv_heads);
  for (float& c : books) c = normal(rng);

  void* d_keys;
  float *d_books, *d_errors;
  uint8_t* d_codes;
  cuda::PqEncodeJob* d_jobs;
  CHECK_CUDA(cudaMalloc(&d_keys, keys.size() * sizeof(uint16_t)));
  CHECK_CUDA(cudaMalloc(&d_books, books.size() * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&d_errors, int64_t{max_rows} * kv_heads * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&d_codes, int64_t{max_rows} * kv_heads * subspaces));
  CHECK_CUDA(cudaMalloc(&d_jobs, int64_t{max_rows} * kv_heads * sizeof(cuda::PqEncodeJob)));
  CHECK_CUDA(
      cudaMemcpy(d_keys, keys.data(), keys.size() * sizeof(uint16_t), cudaMemcpyHostToDevice));
  CHECK_CUDA(
      cudaMemcpy(d_books, books.data(), books.size() * sizeof(float), cudaMemcpyHostToDevice));
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const int64_t row = int64_t{kv_heads} * dim;

  nlohmann::json runs = nlohmann::json::array();
  for (const int n : *rows_list) {
    // As GpuBulkCodes::CodeRowsUnless lays them out: codes [kv_heads, capacity, M] (capacity n
    // here), errors [kv_heads, n].
    // Every KV head as one call's sets; head h alone is the same call from h's offsets.
    cuda::PqEncodeParams every_head;
    every_head.keys = d_keys;
    every_head.element = kvrecall::KvElement::kBf16;
    every_head.count = n;
    every_head.row_stride = row;
    every_head.dim = dim;
    every_head.subspaces = subspaces;
    every_head.codebooks = d_books;
    every_head.codes = d_codes;
    every_head.errors = d_errors;
    every_head.sets = kv_heads;
    every_head.key_set_stride = dim;
    every_head.codebook_set_stride = book_floats;
    every_head.code_set_stride = int64_t{n} * subspaces;
    every_head.error_set_stride = n;
    auto per_head = [&] {
      for (int h = 0; h < kv_heads; ++h) {
        cuda::PqEncodeParams p = every_head;
        p.sets = 1;
        p.keys = static_cast<const uint16_t*>(d_keys) + h * every_head.key_set_stride;
        p.codebooks = d_books + h * every_head.codebook_set_stride;
        p.codes = d_codes + h * every_head.code_set_stride;
        p.errors = d_errors + h * every_head.error_set_stride;
        CHECK_OK(cuda::PqEncode(p, stream));
      }
    };
    auto all_sets = [&] { CHECK_OK(cuda::PqEncode(every_head, stream)); };
    std::vector<cuda::PqEncodeJob> jobs(int64_t{n} * kv_heads);
    for (int h = 0; h < kv_heads; ++h) {
      for (int i = 0; i < n; ++i) {
        jobs[int64_t{h} * n + i] = cuda::PqEncodeJob{
            static_cast<const uint16_t*>(d_keys) + i * row + int64_t{h} * dim,
            d_books + h * book_floats, d_codes + (int64_t{h} * n + i) * subspaces,
            d_errors + int64_t{h} * n + i};
      }
    }
    auto upload_jobs = [&] {
      CHECK_CUDA(cudaMemcpyAsync(d_jobs, jobs.data(), jobs.size() * sizeof(cuda::PqEncodeJob),
                                 cudaMemcpyHostToDevice, stream));
    };
    upload_jobs();
    CHECK_CUDA(cudaStreamSynchronize(stream));
    auto by_rows = [&] {
      cuda::PqEncodeRowsParams p;
      p.jobs = d_jobs;
      p.count = static_cast<int>(jobs.size());
      p.element = kvrecall::KvElement::kBf16;
      p.dim = dim;
      p.subspaces = subspaces;
      CHECK_OK(cuda::PqEncodeRows(p, stream));
    };
    const nlohmann::json heads_us = Timed(stream, warmup, reps, per_head);
    const nlohmann::json sets_us = Timed(stream, warmup, reps, all_sets);
    const nlohmann::json rows_us = Timed(stream, warmup, reps, by_rows);
    const nlohmann::json jobs_us = Timed(stream, warmup, reps, upload_jobs);
    runs.push_back({{"rows", n},
                    {"per_head_us", heads_us},
                    {"all_sets_us", sets_us},
                    {"by_rows_us", rows_us},
                    {"jobs_upload_us", jobs_us},
                    {"by_rows_over_all_sets",
                     rows_us["p50"].get<double>() / sets_us["p50"].get<double>()}});
    std::fprintf(stderr,
                 "rows %5d: per head %8.1f us, every head at once %8.1f us, by rows %8.1f us "
                 "(+ jobs %6.1f)\n",
                 n, heads_us["p50"].get<double>(), sets_us["p50"].get<double>(),
                 rows_us["p50"].get<double>(), jobs_us["p50"].get<double>());
  }
  cudaDeviceProp properties;
  CHECK_CUDA(cudaGetDeviceProperties(&properties, 0));
  const nlohmann::json out = {{"device", properties.name}, {"kv_heads", kv_heads},
                              {"dim", dim},                {"subspaces", subspaces},
                              {"reps", reps},              {"runs", runs}};
  std::printf("%s\n", out.dump(1).c_str());
  return 0;
}
