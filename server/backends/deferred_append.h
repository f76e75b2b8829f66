// Runs a layer's SupportSelector::OnAppend (absorbing the step's token: the graph index links
// it) after the step instead of inside it, on a thread of its own, so that the reply goes out
// without waiting for the linking; the layer's next use waits until it has run.
//
// Selectors score the tokens they have not absorbed yet exactly (index/support_selector.h), so
// a deferred OnAppend keeps every token a candidate; it moves the linking work to between the
// reply and the layer's next step, while the runner computes the other layers (the step's search
// walks a graph one link behind).
#ifndef KVRECALL_SERVER_BACKENDS_DEFERRED_APPEND_H_
#define KVRECALL_SERVER_BACKENDS_DEFERRED_APPEND_H_

#include "absl/synchronization/mutex.h"
#include "index/support_selector.h"
#include "kernels/kv_view.h"
#include "server/work_queue.h"

namespace kvrecall {

// The queue that deferred OnAppends run on: one thread for the process, started on first use
// (each OnAppend spreads its graphs over the decode compute pool, kernels/cpu/thread_pool.h).
WorkQueue* DeferredAppendQueue();

// One layer's pending OnAppend. Thread-compatible like the layer that owns it: the layer's
// methods run one at a time (under its session's lock); only the queued OnAppend runs beside
// them, and the owner calls Wait before anything that the OnAppend reads (the selector, the KV
// rows of the view it was given) may change.
class DeferredAppend final : private WorkItem {
 public:
  // queue: where OnAppend runs (null, or a queue none of whose threads started: inline, in
  // Queue itself).
  DeferredAppend(SupportSelector* selector, WorkQueue* queue)
      : selector_(selector), queue_(queue) {}
  // On DeferredAppendQueue() when the selector's OnAppend is costly, inline otherwise (a queue
  // hop would cost more than an OnAppend with nothing to do). selector may be null (then
  // nothing may be queued).
  explicit DeferredAppend(SupportSelector* selector)
      : DeferredAppend(selector, selector != nullptr && selector->OnAppendIsCostly()
                                     ? DeferredAppendQueue()
                                     : nullptr) {}
  ~DeferredAppend() { Wait(); }
  DeferredAppend(const DeferredAppend&) = delete;
  DeferredAppend& operator=(const DeferredAppend&) = delete;

  // Queues selector->OnAppend(kv); waits for the previous one first. kv's rows must stay put
  // until Wait returns.
  void Queue(const KvView& kv);
  // Returns once no OnAppend is pending; the seconds it waited go to waited_seconds().
  void Wait();
  // Seconds the last Wait blocked (0 when the OnAppend had finished already).
  double waited_seconds() const { return waited_seconds_; }

 private:
  void Run() override;

  SupportSelector* const selector_;
  WorkQueue* const queue_;
  KvView kv_;  // the view of the pending OnAppend
  absl::Mutex mu_;
  bool pending_ ABSL_GUARDED_BY(mu_) = false;
  double waited_seconds_ = 0;
};

}  // namespace kvrecall

#endif  // KVRECALL_SERVER_BACKENDS_DEFERRED_APPEND_H_
