// Grows a layer's host KV ahead of need on a work queue, so that no decode step pays for a
// growth: populating (and, for a device's exact heads, pinning) the rows a growth adds costs
// ~20 ms an array at 128K rows (bench/results/kv_growth.md), and every layer of a model fills at
// the same token, so a 32-layer token that grew its 64 arrays in the step stalled for ~1.3 s.
// A store whose arrays reserved address space grows there while its rows are read and appended
// (LayerKvStore::StartGrowthAhead); one that must move grows in the step as before.
#ifndef KVRECALL_SERVER_KV_GROWTH_H_
#define KVRECALL_SERVER_KV_GROWTH_H_

#include <cstdint>
#include <memory>

#include "server/kv_store.h"
#include "server/work_queue.h"

namespace kvrecall {

// Whether stores grow ahead (true unless turned off: kvrecalld --host_kv_growth_ahead);
// thread-safe, read at every KvGrowthAhead::AfterCommit.
void SetHostKvGrowthAhead(bool on);
bool HostKvGrowthAhead();

// The process's queue for growths ahead: one thread (a growth is the kernel populating and
// pinning pages, bound by memory bandwidth, not cores).
WorkQueue* KvGrowthQueue();

// The growth ahead of one LayerKvStore (a cpu or tiered layer's), driven by its owner (not
// thread-safe: the owner's lock guards it, as it guards the store). The owner calls AfterCommit
// after committing tokens, BeforeReserve before reserving, and Finish before the store is
// freed, moved or pinned anew.
class KvGrowthAhead {
 public:
  // The share of a store's capacity whose use starts a growth ahead: with growths of half
  // again, five sixths leave half the last growth's rows for it to finish in.
  static constexpr int64_t kStartNumerator = 5, kStartDenominator = 6;

  // Growths run on `queue` (KvGrowthQueue()); null or threadless: in AfterCommit's call.
  explicit KvGrowthAhead(WorkQueue* queue) : queue_(queue) {}
  // Waits for a growth that has begun (it maps the store's pages); one still queued never
  // runs. Finish should have ended it: what it charged is only given back there.
  ~KvGrowthAhead();
  KvGrowthAhead(const KvGrowthAhead&) = delete;
  KvGrowthAhead& operator=(const KvGrowthAhead&) = delete;

  // After tokens were committed to `kv`: where HostKvGrowthAhead(), when the store has used
  // five sixths of its capacity, can grow in place, and may hold more than its capacity
  // (`limit`: the tokens the layer is to hold at most, its announced max_tokens or else its
  // ceiling), starts its growth to half again (at most to `limit` and to where it can grow in
  // place). A refusal (the budget) is tried again once half the rows left have been used.
  void AfterCommit(LayerKvStore& kv, int64_t limit);
  // Before `more` tokens are reserved in `kv`: ends a growth that has run, and, when they need
  // it, waits for one that has begun or drops one still queued. A growth that failed or was
  // dropped leaves the store as it was (the reservation then grows it, or says why it cannot).
  void BeforeReserve(LayerKvStore& kv, int64_t more);
  // Waits for a growth in flight (one still queued is dropped) and ends it.
  void Finish(LayerKvStore& kv);

  // Whether a growth is started and not ended.
  bool in_flight() const { return job_ != nullptr; }
  // Growths ended that gave the store its capacity.
  int64_t grown() const { return grown_; }

 private:
  struct Job;
  void End(LayerKvStore& kv);

  WorkQueue* const queue_;
  std::shared_ptr<Job> job_;
  int64_t retry_at_tokens_ = 0;
  int64_t grown_ = 0;
};

}  // namespace kvrecall

#endif  // KVRECALL_SERVER_KV_GROWTH_H_
