#include "proto/shared_decode_region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

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
  }
  return *this;
}

MappedRegion::~MappedRegion() { Reset(); }

void MappedRegion::RemoveFile() {
  if (remove_file_) unlink(path_.c_str());
  remove_file_ = false;
}

void MappedRegion::Reset() {
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
  const size_t dash = name.find('-');
  if (dash == std::string_view::npos || name.find('-', dash + 1) != std::string_view::npos) {
    return 0;
  }
  int pid = 0;
  const auto [end, error] = std::from_chars(name.data(), name.data() + dash, pid);
  return error == std::errc() && end == name.data() + dash && pid > 0 ? pid : 0;
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
