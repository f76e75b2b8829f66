#include "server/backends/deferred_append.h"

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace kvrecall {

void DeferredAppend::Queue(const KvView& kv) {
  Wait();
  // A queue none of whose threads started (a thread or pid limit when it was first used) would
  // never run it, and the next Wait would block the session for good: inline then.
  if (queue_ == nullptr || queue_->threads() == 0) {
    selector_->OnAppend(kv);
    return;
  }
  kv_ = kv;
  {
    absl::MutexLock lock(&mu_);
    pending_ = true;
  }
  queue_->Push(this);
}

void DeferredAppend::Wait() {
  absl::MutexLock lock(&mu_);
  if (!pending_) {
    waited_seconds_ = 0;
    return;
  }
  const absl::Time start = absl::Now();
  mu_.Await(absl::Condition(
      +[](bool* pending) { return !*pending; }, &pending_));
  waited_seconds_ = absl::ToDoubleSeconds(absl::Now() - start);
}

void DeferredAppend::Run() {
  selector_->OnAppend(kv_);
  absl::MutexLock lock(&mu_);
  pending_ = false;
}

WorkQueue* DeferredAppendQueue() {
  static WorkQueue* const queue = new WorkQueue(1, "kvrecall-link");
  return queue;
}

}  // namespace kvrecall
