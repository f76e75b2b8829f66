// What a host KV array's growth costs on the decode path: the copy into a new allocation that
// BudgetedRows made before (a new mapping populated whole, then every old byte copied) against
// HostMemory::Grow (the old pages moved by their page tables, only the new ones populated), for
// arrays of a layer's keys (or values) at several lengths, grown by half again as ReserveRows
// grows them. Pinning (a device's cudaHostRegister of the whole array, either way) is not in
// it. Prints one JSON object: per length, each way's p50 and max milliseconds.
//
//   kv_growth_bench --rows=1728,16384,131072 --row_bytes=4096 --repeats=5
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "bench/int_list.h"
#include "nlohmann/json.hpp"
#include "server/host_memory.h"

ABSL_FLAG(std::string, rows, "1728,16384,131072",
          "rows the array holds when it grows (it grows to half again as many)");
ABSL_FLAG(int64_t, row_bytes, 4096,
          "bytes a row: a key of 8 KV heads x d = 128 in bf16 is 2048, in f32 4096");
ABSL_FLAG(int32_t, repeats, 5, "growths timed per way and length");

namespace kvrecall {
namespace {

double Millis(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - since)
      .count();
}

// A freshly allocated and written array of `bytes` (what a layer holds before it grows).
HostMemory Filled(size_t bytes) {
  absl::StatusOr<HostMemory> memory = AllocateHostMemory(bytes);
  if (!memory.ok()) {
    std::fprintf(stderr, "%s\n", std::string(memory.status().message()).c_str());
    std::exit(1);
  }
  std::memset(memory->data(), 0x3c, bytes);
  return *std::move(memory);
}

nlohmann::json Summary(std::vector<double> ms) {
  std::sort(ms.begin(), ms.end());
  return {{"p50_ms", ms[ms.size() / 2]}, {"max_ms", ms.back()}};
}

int Main() {
  const std::vector<int64_t> lengths =
      bench::IntListOrExit<int64_t>("rows", absl::GetFlag(FLAGS_rows));
  const auto row = static_cast<size_t>(absl::GetFlag(FLAGS_row_bytes));
  const int repeats = std::max(1, absl::GetFlag(FLAGS_repeats));
  nlohmann::json out = {{"row_bytes", row}, {"huge_pages", HostHugePages()}};
  for (const int64_t rows : lengths) {
    const size_t old_bytes = static_cast<size_t>(rows) * row;
    const size_t new_bytes = old_bytes + old_bytes / 2;
    std::vector<double> copy_ms, grow_ms;
    for (int r = 0; r < repeats; ++r) {
      {
        HostMemory old = Filled(old_bytes);
        const auto t = std::chrono::steady_clock::now();
        absl::StatusOr<HostMemory> grown = AllocateHostMemory(new_bytes);
        if (!grown.ok()) return 1;
        std::memcpy(grown->data(), old.data(), old_bytes);
        old.reset();
        copy_ms.push_back(Millis(t));
      }
      {
        HostMemory memory = Filled(old_bytes);
        const auto t = std::chrono::steady_clock::now();
        if (!memory.Grow(new_bytes).ok()) return 1;
        grow_ms.push_back(Millis(t));
      }
    }
    out["lengths"].push_back({{"rows", rows},
                              {"bytes_before", old_bytes},
                              {"bytes_after", new_bytes},
                              {"copy", Summary(copy_ms)},
                              {"grow", Summary(grow_ms)}});
  }
  std::printf("%s\n", out.dump(1).c_str());
  return 0;
}

}  // namespace
}  // namespace kvrecall

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return kvrecall::Main();
}
