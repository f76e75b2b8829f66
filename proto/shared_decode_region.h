// The shared-memory region of a DecodeShared stream (kvrecall.proto): its layout, the one part
// of the contract between a runner and kvrecalld that the .proto cannot state, and the
// wait / wake protocol both sides follow. The Python client mirrors it (kvrecall/shared.py).
//
// Layout, version 1 (integers little-endian; the file is SharedDecodeRegion.bytes long):
//   [0, kHeaderBytes)                               RegionHeader
//   [request_offset, request_offset + request_capacity)  the request: a serialized
//                                                   DecodeRequest of request_bytes
//   [reply_offset, reply_offset + reply_capacity)   the reply: a serialized DecodeResponse of
//                                                   reply_bytes, or when status_code != 0 the
//                                                   status message (UTF-8) of reply_bytes
// The server writes the layout once before it answers the region; the runner writes the
// request line, the server the reply line. The signal words are bumped by their waiter's peer
// and also by the server itself to wake its own thread (a cancellation, the drain): a runner
// may bump request_signal with a plain load and store (a lost server bump still wakes the
// thread, through FUTEX_WAKE and the flags its thread checks).
//
// One request is in flight at a time. A step:
//   runner  writes the request bytes and request_bytes, then request_seq += 1 (release, as the
//           seq_cst store below), then Signal(request_signal, server_sleeping);
//   server  sees request_seq change, reads request_bytes once, copies the bytes out of the
//           region (the runner could change them under it), serves them, writes the reply (or,
//           for a failed step, status_code and its message), then reply_seq = request_seq, then
//           Signal(reply_signal, runner_sleeping).
// Ending: the runner ends the stream with `closing` = 1 written before a request_seq bump (the
// server answers that request with status OK and ends). The server ends it on its own after a
// failed step (whose reply, published as any reply, carries the status; a message longer than
// the reply area is cut to it) and at a drain or a shutdown: then a request not picked up yet
// is not served (it appended nothing; the call ends UNAVAILABLE), and the runner is signalled
// without a reply. The server sets `ended` whenever the stream ends, after the last reply: a
// runner checks reply_seq first (its reply is there) and `ended` second (no reply will come;
// the call's final status, which the server sends right after, says why).
//
// Waiting (WaitUntil): spin for a while, then sleep in futex(2) on the signal word. A waiter
// reads the signal, sets its *_sleeping flag, re-checks its condition, then sleeps only while
// the signal is unchanged; a signaler bumps the signal after publishing and wakes only when the
// flag is set. Every one of these accesses is sequentially consistent, so no wake-up is lost and
// a step whose peer is awake costs no system call. (What the protocol needs of the memory order:
// the publishing stores are not reordered before the payload's (release), and the signaler's load
// of the sleep flag is not reordered before its bump of the signal (a full fence); the waiter's
// side is ordered by futex(2) itself. On x86-64 aligned 32-bit stores are releases, so a runner
// without C++ atomics needs one locked instruction between the bump and the flag's load.)
#ifndef KVRECALL_PROTO_SHARED_DECODE_REGION_H_
#define KVRECALL_PROTO_SHARED_DECODE_REGION_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "kernels/cpu/spin_wait.h"

namespace kvrecall::v1::shared_decode {

inline constexpr uint32_t kMagic = 0x5244564B;  // "KVDR" in little-endian bytes
inline constexpr uint32_t kLayoutVersion = 1;
inline constexpr uint64_t kHeaderBytes = 4096;

struct RegionHeader {
  // Written once by the server before it answers the region.
  uint32_t magic;
  uint32_t version;
  uint64_t request_offset;
  uint64_t request_capacity;
  uint64_t reply_offset;
  uint64_t reply_capacity;
  // The runner's line.
  alignas(64) std::atomic<uint32_t> request_seq;
  uint32_t request_bytes;
  uint32_t closing;
  // The server's line.
  alignas(64) std::atomic<uint32_t> reply_seq;
  uint32_t reply_bytes;
  int32_t status_code;  // grpc::StatusCode of the reply; 0: reply_bytes of DecodeResponse
  std::atomic<uint32_t> ended;
  // The futex words and sleep flags.
  alignas(64) std::atomic<uint32_t> request_signal;  // the server sleeps on it
  std::atomic<uint32_t> server_sleeping;
  alignas(64) std::atomic<uint32_t> reply_signal;  // the runner sleeps on it
  std::atomic<uint32_t> runner_sleeping;
};
static_assert(sizeof(std::atomic<uint32_t>) == 4 && std::atomic<uint32_t>::is_always_lock_free);
static_assert(offsetof(RegionHeader, request_offset) == 8);
static_assert(offsetof(RegionHeader, reply_capacity) == 32);
static_assert(offsetof(RegionHeader, request_seq) == 64);
static_assert(offsetof(RegionHeader, request_bytes) == 68);
static_assert(offsetof(RegionHeader, closing) == 72);
static_assert(offsetof(RegionHeader, reply_seq) == 128);
static_assert(offsetof(RegionHeader, reply_bytes) == 132);
static_assert(offsetof(RegionHeader, status_code) == 136);
static_assert(offsetof(RegionHeader, ended) == 140);
static_assert(offsetof(RegionHeader, request_signal) == 192);
static_assert(offsetof(RegionHeader, server_sleeping) == 196);
static_assert(offsetof(RegionHeader, reply_signal) == 256);
static_assert(offsetof(RegionHeader, runner_sleeping) == 260);
static_assert(sizeof(RegionHeader) <= kHeaderBytes);

// Where a region's areas lie: what the header's layout fields hold, and what each side keeps a
// private copy of once it has made or checked them (the peer can overwrite the header).
struct RegionLayout {
  uint64_t request_offset = 0;
  uint64_t request_capacity = 0;
  uint64_t reply_offset = 0;
  uint64_t reply_capacity = 0;

  // The layout Create makes: the header, then each area rounded up to pages.
  static RegionLayout For(uint64_t request_capacity, uint64_t reply_capacity);
  // The file's size: the reply area's end, rounded up to a page.
  uint64_t bytes() const;
};

// A mapped region file (MAP_SHARED, read-write); unmapped when destroyed. Create also removes
// the file when destroyed, so that a stream's region does not outlive it.
class MappedRegion {
 public:
  // A new region file in `directory`, mode 0600, named kvrecall-decode-<pid>-<random>, laid
  // out for the capacities, its blocks allocated now (posix_fallocate: a directory without
  // room, such as a full tmpfs, fails here with RESOURCE_EXHAUSTED instead of a SIGBUS at the
  // first write into the mapping). The peer should not shrink the file while it is mapped (same
  // user: it can): an access past its end then faults, and the process's SIGBUS handler (set
  // once, here) maps anonymous memory over the whole region, so that the access and every later
  // one reads zeros and writes nowhere, and marks it broken() instead of the process dying.
  // RESOURCE_EXHAUSTED when kMaxGuardedRegions regions are mapped already.
  static absl::StatusOr<MappedRegion> Create(const std::string& directory,
                                             uint64_t request_capacity, uint64_t reply_capacity);
  // Maps the region at `path` of `bytes` (SharedDecodeRegion) and checks its header:
  // FAILED_PRECONDITION when it is not a region of this layout version or its layout does not
  // fit `bytes`; the errno's status when the file cannot be opened or mapped.
  static absl::StatusOr<MappedRegion> Open(const std::string& path, uint64_t bytes);

  MappedRegion() = default;
  MappedRegion(MappedRegion&& other) noexcept;
  MappedRegion& operator=(MappedRegion&& other) noexcept;
  ~MappedRegion();

  RegionHeader* header() const { return static_cast<RegionHeader*>(base_); }
  // The areas as laid out when the region was created or checked at Open: private copies,
  // never read back from the header, which the peer can overwrite.
  char* request() const { return static_cast<char*>(base_) + layout_.request_offset; }
  char* reply() const { return static_cast<char*>(base_) + layout_.reply_offset; }
  uint64_t request_capacity() const { return layout_.request_capacity; }
  uint64_t reply_capacity() const { return layout_.reply_capacity; }
  const std::string& path() const { return path_; }
  uint64_t bytes() const { return bytes_; }
  // Removes Create's file now (the mapping stays valid); the destructor then leaves it.
  void RemoveFile();
  // Whether the peer shrank Create's file under the mapping (an access faulted): the region's
  // contents are gone, and the stream must end. Any thread may ask.
  bool broken() const;

  // The regions Create can guard at once (the server's shared streams).
  static constexpr int kMaxGuardedRegions = 1024;

 private:
  void Reset();

  void* base_ = nullptr;
  uint64_t bytes_ = 0;
  RegionLayout layout_;
  std::string path_;
  bool remove_file_ = false;  // Create's: the file goes with the mapping
  int guard_ = -1;            // Create's: its slot of the SIGBUS handler's table
};

// The pid in a region file's name (Create's kvrecall-decode-<pid>-<24 hex digits>): the server
// that made it; nullopt when `name` is not of that form.
std::optional<int> RegionFileServerPid(std::string_view name);

// A runner-written word of the header, read once (a relaxed atomic load: the runner may write
// it while the server reads, and the value checked must be the value used).
inline uint32_t ReadPeerWord(uint32_t& word) {
  return std::atomic_ref<uint32_t>(word).load(std::memory_order_relaxed);
}

// Publishing side: bumps `signal` and wakes its sleepers when `sleeping` says there are any.
void Signal(std::atomic<uint32_t>* signal, const std::atomic<uint32_t>* sleeping);

// Sleeps on `signal` while it holds `seen`, for at most `timeout` (futex(2), shared).
void FutexWait(std::atomic<uint32_t>* signal, uint32_t seen, absl::Duration timeout);

// Waits until `ready()`, first polling for up to `spin` (cpu::PollUntil), then sleeping on
// `signal` (flagging `sleeping`) in slices of at most `slice`, after each of which `give_up()`
// is asked. Returns true once ready() holds, false when give_up() did first. ready() and
// give_up() must read the region with sequentially consistent loads (std::atomic's default).
template <typename Ready, typename GiveUp>
bool WaitUntil(std::atomic<uint32_t>* signal, std::atomic<uint32_t>* sleeping, absl::Duration spin,
               absl::Duration slice, const Ready& ready, const GiveUp& give_up) {
  if (cpu::PollUntil(absl::ToChronoNanoseconds(spin), ready)) return true;
  while (true) {
    const uint32_t seen = signal->load();
    sleeping->store(1);
    if (ready()) {
      sleeping->store(0);
      return true;
    }
    FutexWait(signal, seen, slice);
    sleeping->store(0);
    if (ready()) return true;
    if (give_up()) return false;
  }
}

}  // namespace kvrecall::v1::shared_decode

#endif  // KVRECALL_PROTO_SHARED_DECODE_REGION_H_
