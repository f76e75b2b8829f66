// One Prefill stream: validates and stages the prompt chunks of a session's layers as they
// arrive, then, when the stream closes cleanly, builds the layers' selectors and commits them
// all at once. A stream that fails commits nothing.
#ifndef KVRECALL_SERVER_PREFILL_H_
#define KVRECALL_SERVER_PREFILL_H_

#include <cstdint>
#include <map>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvrecall/v1/kvrecall.pb.h"
#include "server/kv_store.h"
#include "server/session.h"

namespace kvrecall {

class PrefillStream {
 public:
  explicit PrefillStream(const SessionRegistry* registry) : registry_(registry) {}

  // Validates chunk number `index` of the stream (session, layer, contiguous offset, tensor
  // shapes, dtype and finiteness, the memory budget) and stages its tensors. On error the
  // stream must be abandoned: nothing of it is committed.
  absl::Status Add(const v1::PrefillChunk& chunk, int64_t index);

  // Builds every staged layer's selector from its prompt keys and queries (layers in
  // parallel), then commits the layers to the session atomically. The staged queries are
  // released afterwards: selectors that need them keep what they need.
  absl::StatusOr<v1::PrefillResponse> Commit();

 private:
  // A layer's prompt as received so far: keys/values [n, kv_heads, head_dim] and post-RoPE
  // queries [n, q_heads, head_dim].
  struct Staging {
    LayerKvStore kv;
    BudgetedRows queries;
  };

  const SessionRegistry* registry_;
  std::shared_ptr<Session> session_;
  std::map<int, Staging> layers_;  // ordered, so commits and errors list layers in order
};

}  // namespace kvrecall

#endif  // KVRECALL_SERVER_PREFILL_H_
