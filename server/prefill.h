// One Prefill stream: validates and stages the prompt chunks of a session's layers as they
// arrive (in the PromptStaging of the session's backend: host memory, or on to a GPU), then,
// when the stream closes cleanly, builds the layers and commits them all at once. A stream that
// fails commits nothing.
#ifndef KVRECALL_SERVER_PREFILL_H_
#define KVRECALL_SERVER_PREFILL_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kvrecall/v1/kvrecall.pb.h"
#include "server/backends/attention_backend.h"
#include "server/session.h"
#include "server/work_queue.h"

namespace kvrecall {

// What a Prefill's commit installed (PrefillStream::Commit), to take it back where the call's OK
// never reached its client.
class CommittedPrompt {
 public:
  // Takes the layers back (Session::UncommitPrompt) unless they are in use since, frees them
  // and gives the freed memory back to the system; whether it did. Once at most; nothing for an
  // empty one. (The layers are the session's, visible to other streams, until then.) With
  // `frees`, the freeing and the giving back (munmaps, device frees, malloc_trim), and the
  // release of the session, run on that queue instead, after Undo has returned: for a caller
  // on one of gRPC's threads.
  bool Undo(WorkQueue* frees = nullptr);

 private:
  class FreeItem;
  friend class PrefillStream;
  std::shared_ptr<Session> session_;
  std::vector<std::pair<int, const LayerBackend*>> layers_;
};

class PrefillStream {
 public:
  // Fills only sessions of `tenant` (SessionRegistry::Find).
  explicit PrefillStream(const SessionRegistry* registry, std::string tenant = "")
      : registry_(registry), tenant_(std::move(tenant)) {}
  PrefillStream(PrefillStream&&) = default;
  // Frees the staged layers before it lets go of the session: they give their memory back
  // through the session's grant, and the stream may hold the session's last reference (it was
  // closed, or expired, while its prompt streamed in).
  PrefillStream& operator=(PrefillStream&& other) noexcept;

  // Validates chunk number `index` of the stream (session, layer, contiguous offset, tensor
  // shapes, dtype and finiteness, the memory budget) and stages its tensors. On error the
  // stream must be abandoned: nothing of it is committed.
  absl::Status Add(const v1::PrefillChunk& chunk, int64_t index);

  // Builds every staged layer (indexes, caches; layers in parallel), then commits the layers to
  // the session atomically. The staging is released afterwards. When `cancelled` says true
  // before the layers are installed (the call was cancelled or its deadline passed; asked from
  // the builds' threads as they go and last under the session's lock, just before the
  // install), the builds stop (index/build_stop.h) and nothing is committed (CANCELLED). A
  // session closed meanwhile stops them too (NOT_FOUND, as SessionStatus). `cancelled` is
  // asked often and from several threads at once: it must be thread-safe and cheap.
  // What it installed goes to `committed` (when given), for an Undo.
  absl::StatusOr<v1::PrefillResponse> Commit(
      absl::FunctionRef<bool()> cancelled = [] { return false; },
      CommittedPrompt* committed = nullptr);

  // OK unless the session this stream stages a prompt for was closed (a CloseSession, or it
  // expired): then the NOT_FOUND its next chunk would get, saying why. Add and Commit ask it
  // themselves (Commit's builds stop when the session closes); from another thread, not while
  // they run (they set the session).
  absl::Status SessionStatus() const;

  // Keeps the stream's session from expiring while the guard lives (Session::Use): for its
  // commit, whose builds may outlast the idle TTL. Empty before the first chunk.
  std::optional<Session::Use> UseSession() const;

 private:
  const SessionRegistry* registry_;
  std::string tenant_;
  std::shared_ptr<Session> session_;
  absl::Time started_;  // when the first chunk arrived
  // A layer's prompt as received so far.
  struct Staged {
    std::unique_ptr<PromptStaging> prompt;
    int64_t queries_from = 0;  // every token from here on came with its query
  };
  // Ordered, so that commits and errors list layers in order. After session_, so that it is
  // destroyed first (its staging is charged to the session's grant).
  std::map<int, Staged> layers_;
};

}  // namespace kvrecall

#endif  // KVRECALL_SERVER_PREFILL_H_
