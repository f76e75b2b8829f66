// What a host KV array's growth costs on the decode path: the copy into a new allocation that
// BudgetedRows made before 0890631 (a new mapping populated whole, then every old byte copied)
// against HostMemory::Grow moving the old pages by their page tables (only the new ones
// populated), and Grow within the address space reserved at allocation (BudgetedRows's way
// since c9a57fd: nothing moves, the new pages made accessible and populated), for arrays of a
// layer's keys (or values) at several lengths, grown by half again as ReserveRows grows them.
// Built with CUDA and run where a device is, it also times what a pinned array (the tiered
// placement's, read by the device's exact heads) pays beside: unregistering the old array and
// registering the grown one whole (what a move costs), against registering only the added
// third (a growth in place). Prints one JSON object: per length, each way's p50 and max
// milliseconds.
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

#if KVRECALL_KV_GROWTH_PINS
#include <cuda_runtime.h>
#endif

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "bench/int_list.h"
#include "nlohmann/json.hpp"
#include "server/host_memory.h"
#include "server/kv_store.h"

ABSL_FLAG(std::string, rows, "1728,16384,131072",
          "rows the array holds when it grows (it grows to half again as many)");
ABSL_FLAG(int64_t, row_bytes, 4096,
          "bytes a row: a key of 8 KV heads x d = 128 in bf16 is 2048, in f32 4096");
ABSL_FLAG(int32_t, repeats, 5, "growths timed per way and length");
ABSL_FLAG(bool, pin, true, "also time the pinning, where built with CUDA and a device is present");

namespace kvrecall {
namespace {

double Millis(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - since)
      .count();
}

// A freshly allocated and written array of `bytes` (what a layer holds before it grows), with
// `reserve` bytes of address space to grow into.
HostMemory Filled(size_t bytes, size_t reserve = 0) {
  absl::StatusOr<HostMemory> memory = AllocateHostMemory(bytes, cpu::HostHugePages(), reserve);
  if (!memory.ok()) {
    std::fprintf(stderr, "%s\n", std::string(memory.status().message()).c_str());
    std::exit(1);
  }
  std::memset(memory->data(), 0x3c, bytes);
  return *std::move(memory);
}

#if KVRECALL_KV_GROWTH_PINS
// Registers `bytes` at `data` as CudaHostPinning does (mapped, portable, read-only where the
// device supports it); exits on failure.
void Register(void* data, size_t bytes) {
  int read_only = 0;
  cudaDeviceGetAttribute(&read_only, cudaDevAttrHostRegisterReadOnlySupported, 0);
  const unsigned flags = cudaHostRegisterMapped | cudaHostRegisterPortable |
                         (read_only != 0 ? cudaHostRegisterReadOnly : 0u);
  if (const cudaError_t e = cudaHostRegister(data, bytes, flags); e != cudaSuccess) {
    std::fprintf(stderr, "cudaHostRegister of %zu bytes: %s\n", bytes, cudaGetErrorString(e));
    std::exit(1);
  }
}

void Unregister(void* data) {
  if (const cudaError_t e = cudaHostUnregister(data); e != cudaSuccess) {
    std::fprintf(stderr, "cudaHostUnregister: %s\n", cudaGetErrorString(e));
    std::exit(1);
  }
}

// Whether the pinning is timed: a device is present (its context made here, untimed).
bool DeviceForPinning() {
  int devices = 0;
  return absl::GetFlag(FLAGS_pin) && cudaGetDeviceCount(&devices) == cudaSuccess &&
         devices > 0 && cudaFree(nullptr) == cudaSuccess;
}
#else
bool DeviceForPinning() { return false; }
void Register(void*, size_t) {}
void Unregister(void*) {}
#endif

nlohmann::json Summary(std::vector<double> ms) {
  std::sort(ms.begin(), ms.end());
  return {{"p50_ms", ms[ms.size() / 2]}, {"max_ms", ms.back()}};
}

int Main() {
  const std::vector<int64_t> lengths =
      bench::IntListOrExit<int64_t>("rows", absl::GetFlag(FLAGS_rows));
  const auto row = static_cast<size_t>(absl::GetFlag(FLAGS_row_bytes));
  const int repeats = std::max(1, absl::GetFlag(FLAGS_repeats));
  const bool pins = DeviceForPinning();
  nlohmann::json out = {{"row_bytes", row}, {"huge_pages", cpu::HostHugePages()}, {"pins", pins}};
  for (const int64_t rows : lengths) {
    const size_t old_bytes = static_cast<size_t>(rows) * row;
    const size_t new_bytes = old_bytes + old_bytes / 2;
    std::vector<double> copy_ms, grow_ms, grow_reserved_ms, repin_whole_ms, pin_added_ms;
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
      {
        HostMemory memory = Filled(old_bytes, kHostRowsAddressReserve * old_bytes);
        const std::byte* before = memory.data();
        const auto t = std::chrono::steady_clock::now();
        if (!memory.Grow(new_bytes).ok() || memory.data() != before) return 1;
        grow_reserved_ms.push_back(Millis(t));
      }
      if (pins) {
        // Today's way: the old array unregistered, the grown one registered whole (Grow's
        // pages are populated, so this is the registration alone).
        HostMemory memory = Filled(old_bytes);
        Register(memory.data(), old_bytes);
        auto t = std::chrono::steady_clock::now();
        Unregister(memory.data());
        const double unregister = Millis(t);
        if (!memory.Grow(new_bytes).ok()) return 1;
        t = std::chrono::steady_clock::now();
        Register(memory.data(), new_bytes);
        repin_whole_ms.push_back(unregister + Millis(t));
        Unregister(memory.data());
        // An array whose address never changes: only the added bytes registered, next to
        // the old registration.
        HostMemory whole = Filled(new_bytes);
        Register(whole.data(), old_bytes);
        t = std::chrono::steady_clock::now();
        Register(whole.data() + old_bytes, new_bytes - old_bytes);
        pin_added_ms.push_back(Millis(t));
        Unregister(whole.data() + old_bytes);
        Unregister(whole.data());
      }
    }
    out["lengths"].push_back({{"rows", rows},
                              {"bytes_before", old_bytes},
                              {"bytes_after", new_bytes},
                              {"copy", Summary(copy_ms)},
                              {"grow", Summary(grow_ms)},
                              {"grow_reserved", Summary(grow_reserved_ms)}});
    if (pins) {
      // unpin_repin_whole: the old registration undone and the grown array registered whole
      // (the Grow between them untimed); pin_added: the added bytes' registration alone.
      out["lengths"].back()["unpin_repin_whole"] = Summary(repin_whole_ms);
      out["lengths"].back()["pin_added"] = Summary(pin_added_ms);
    }
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
