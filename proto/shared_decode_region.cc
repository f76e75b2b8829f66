#include "proto/shared_decode_region.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <climits>
#include <cstring>
#include <ctime>
#include <new>
#include <random>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace kvrecall::v1::shared_decode {
namespace {

uint64_t RoundUpToPage(uint64_t n) { return (n + 4095) & ~uint64_t{4095}; }

constexpr char kRegionFilePrefix[] = "kvrecall-decode-";

absl::Status ErrnoStatus(int error, absl::string_view what) {
  return absl::ErrnoToStatus(error, what);
}

// The regions Create mapped, for the SIGBUS handler: lock-free, so that the handler can read
// them (begin 0: a free slot; a slot is claimed by its begin, then given its end).
struct GuardSlot {
  std::atomic<uintptr_t> begin{0};
  std::atomic<uintptr_t> end{0};
  std::atomic<uint32_t> broken{0};
};
GuardSlot guard_slots[MappedRegion::kMaxGuardedRegions];
struct sigaction previous_sigbus;

// An access past the end of a region whose file the peer shrank: anonymous memory over the
// whole region (mmap is a plain system call on Linux, safe here in practice), and the access
// is retried on it. Any other SIGBUS goes to the handler before this one, or ends the process
// as it would have without this one.
extern "C" void OnSigbus(int signal, siginfo_t* info, void* context) {
  const auto address = reinterpret_cast<uintptr_t>(info->si_addr);
  for (GuardSlot& slot : guard_slots) {
    const uintptr_t begin = slot.begin.load(std::memory_order_acquire);
    const uintptr_t end = slot.end.load(std::memory_order_acquire);
    if (begin == 0 || address < begin || address >= end) continue;
    void* replaced = mmap(reinterpret_cast<void*>(begin), end - begin, PROT_READ | PROT_WRITE,
                          MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (replaced != MAP_FAILED) {
      slot.broken.store(1, std::memory_order_release);
      return;
    }
    break;
  }
  if (previous_sigbus.sa_flags & SA_SIGINFO) {
    if (previous_sigbus.sa_sigaction != nullptr) previous_sigbus.sa_sigaction(signal, info, context);
    return;
  }
  if (previous_sigbus.sa_handler != SIG_DFL && previous_sigbus.sa_handler != SIG_IGN) {
    previous_sigbus.sa_handler(signal);
    return;
  }
  // The default action: the faulting access runs again and ends the process.
  struct sigaction default_action = {};
  default_action.sa_handler = SIG_DFL;
  sigaction(SIGBUS, &default_action, nullptr);
}

// A slot for [base, base + bytes), the handler installed first; -1 when none is free.
int GuardRegion(void* base, uint64_t bytes) {
  static const bool installed = [] {
    struct sigaction action = {};
    action.sa_sigaction = OnSigbus;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_SIGINFO | SA_RESTART;
    return sigaction(SIGBUS, &action, &previous_sigbus) == 0;
  }();
  if (!installed) return -1;
  for (int i = 0; i < MappedRegion::kMaxGuardedRegions; ++i) {
    uintptr_t free = 0;
    GuardSlot& slot = guard_slots[i];
    if (slot.begin.compare_exchange_strong(free, reinterpret_cast<uintptr_t>(base))) {
      slot.broken.store(0, std::memory_order_relaxed);
      slot.end.store(reinterpret_cast<uintptr_t>(base) + bytes, std::memory_order_release);
      return i;
    }
  }
  return -1;
}

void UnguardRegion(int slot) {
  guard_slots[slot].end.store(0, std::memory_order_release);
  guard_slots[slot].begin.store(0, std::memory_order_release);
}

}  // namespace

absl::StatusOr<MappedRegion> MappedRegion::Create(const std::string& directory,
                                                  uint64_t request_capacity,
                                                  uint64_t reply_capacity) {
  if (request_capacity == 0 || reply_capacity == 0 || request_capacity > UINT32_MAX ||
      reply_capacity > UINT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shared decode region capacities must be in [1, 2^32 - 1] bytes, got ", request_capacity,
        " and ", reply_capacity));
  }
  const RegionLayout layout = RegionLayout::For(request_capacity, reply_capacity);
  const uint64_t bytes = layout.bytes();
  std::random_device random;
  MappedRegion region;
  int fd = -1;
  for (int attempt = 0; attempt < 8 && fd < 0; ++attempt) {
    region.path_ = absl::StrFormat("%s/%s%d-%08x%08x%08x", directory, kRegionFilePrefix,
                                   getpid(), random(), random(), random());
    fd = open(region.path_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0 && errno != EEXIST) {
      return ErrnoStatus(errno, absl::StrCat("creating the shared decode region in ", directory));
    }
  }
  if (fd < 0) return absl::InternalError("no free name for a shared decode region");
  region.remove_file_ = true;  // from here on, a failure removes the file with `region`
  if (const int error = posix_fallocate(fd, 0, static_cast<off_t>(bytes)); error != 0) {
    close(fd);
    if (error == ENOSPC) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "no room for a shared decode region of ", bytes, " bytes in ", directory));
    }
    return ErrnoStatus(error, absl::StrCat("sizing ", region.path_));
  }
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int error = errno;
  close(fd);
  if (base == MAP_FAILED) return ErrnoStatus(error, absl::StrCat("mapping ", region.path_));
  region.base_ = base;
  region.bytes_ = bytes;
  region.layout_ = layout;
  region.guard_ = GuardRegion(base, bytes);
  if (region.guard_ < 0) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "no room to guard another shared decode region (", MappedRegion::kMaxGuardedRegions,
        " are mapped)"));
  }
  auto* header = new (base) RegionHeader{};
  header->magic = kMagic;
  header->version = kLayoutVersion;
  header->request_offset = layout.request_offset;
  header->request_capacity = layout.request_capacity;
  header->reply_offset = layout.reply_offset;
  header->reply_capacity = layout.reply_capacity;
  std::atomic_thread_fence(std::memory_order_seq_cst);
  return region;
}

RegionLayout RegionLayout::For(uint64_t request_capacity, uint64_t reply_capacity) {
  const uint64_t reply_offset = kHeaderBytes + RoundUpToPage(request_capacity);
  return RegionLayout{kHeaderBytes, request_capacity, reply_offset, reply_capacity};
}

uint64_t RegionLayout::bytes() const { return reply_offset + RoundUpToPage(reply_capacity); }

absl::StatusOr<MappedRegion> MappedRegion::Open(const std::string& path, uint64_t bytes) {
  if (bytes < kHeaderBytes) {
    return absl::FailedPreconditionError(
        absl::StrCat("a shared decode region of ", bytes, " bytes holds no header"));
  }
  const int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, absl::StrCat("opening the shared decode region ", path));
  struct stat info;
  if (fstat(fd, &info) != 0 || static_cast<uint64_t>(info.st_size) < bytes) {
    close(fd);
    return absl::FailedPreconditionError(
        absl::StrCat("the shared decode region ", path, " is shorter than ", bytes, " bytes"));
  }
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int error = errno;
  close(fd);
  if (base == MAP_FAILED) return ErrnoStatus(error, absl::StrCat("mapping ", path));
  MappedRegion region;
  region.base_ = base;
  region.bytes_ = bytes;
  region.path_ = path;
  const RegionHeader& h = *region.header();
  if (h.magic != kMagic || h.version != kLayoutVersion) {
    return absl::FailedPreconditionError(absl::StrCat(
        path, " is not a shared decode region of layout version ", kLayoutVersion,
        " (magic ", absl::Hex(h.magic), ", version ", h.version, ")"));
  }
  const auto fits = [bytes](uint64_t offset, uint64_t capacity) {
    return offset >= kHeaderBytes && offset <= bytes && capacity <= bytes - offset;
  };
  const RegionLayout layout{h.request_offset, h.request_capacity, h.reply_offset,
                            h.reply_capacity};
  if (!fits(layout.request_offset, layout.request_capacity) ||
      !fits(layout.reply_offset, layout.reply_capacity)) {
    return absl::FailedPreconditionError(
        absl::StrCat("the shared decode region ", path, " lays out areas beyond its ", bytes,
                     " bytes"));
  }
  region.layout_ = layout;
  return region;
}

MappedRegion::MappedRegion(MappedRegion&& other) noexcept { *this = std::move(other); }

MappedRegion& MappedRegion::operator=(MappedRegion&& other) noexcept {
  if (this != &other) {
    Reset();
    base_ = std::exchange(other.base_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    layout_ = std::exchange(other.layout_, RegionLayout{});
    path_ = std::move(other.path_);
    remove_file_ = std::exchange(other.remove_file_, false);
    guard_ = std::exchange(other.guard_, -1);
  }
  return *this;
}

MappedRegion::~MappedRegion() { Reset(); }

void MappedRegion::RemoveFile() {
  if (remove_file_) unlink(path_.c_str());
  remove_file_ = false;
}

bool MappedRegion::broken() const {
  return guard_ >= 0 && guard_slots[guard_].broken.load(std::memory_order_acquire) != 0;
}

void MappedRegion::Reset() {
  if (guard_ >= 0) UnguardRegion(guard_);
  guard_ = -1;
  if (base_ != nullptr) munmap(base_, bytes_);
  if (remove_file_) unlink(path_.c_str());
  base_ = nullptr;
  bytes_ = 0;
  remove_file_ = false;
}

std::optional<int> RegionFileServerPid(std::string_view name) {
  const std::string_view prefix = kRegionFilePrefix;
  if (!name.starts_with(prefix)) return std::nullopt;
  name.remove_prefix(prefix.size());
  // Exactly Create's form: the pid, a dash, 24 lower-case hex digits. Anything else beside
  // the prefix is not a region's (a runner's notes named alike were removed, probe 26, 7).
  const size_t dash = name.find('-');
  if (dash == std::string_view::npos) return std::nullopt;
  const std::string_view random = name.substr(dash + 1);
  if (random.size() != 24 || !std::all_of(random.begin(), random.end(), [](char c) {
        return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
      })) {
    return std::nullopt;
  }
  int pid = 0;
  const auto [end, error] = std::from_chars(name.data(), name.data() + dash, pid);
  if (error != std::errc() || end != name.data() + dash || pid <= 0) return std::nullopt;
  return pid;
}

// Both sides map the region from different processes: the futex is a shared one (no
// FUTEX_PRIVATE_FLAG).
void Signal(std::atomic<uint32_t>* signal, const std::atomic<uint32_t>* sleeping) {
  signal->fetch_add(1);
  if (sleeping->load() != 0) cpu::FutexWake(signal, INT_MAX, cpu::FutexScope::kShared);
}

void FutexWait(std::atomic<uint32_t>* signal, uint32_t seen, absl::Duration timeout) {
  const timespec relative = absl::ToTimespec(timeout);
  cpu::FutexWait(signal, seen, cpu::FutexScope::kShared, &relative);
}

}  // namespace kvrecall::v1::shared_decode
