#include "server/kv_growth.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <mutex>
#include <string>
#include <utility>

#include "absl/synchronization/mutex.h"

namespace kvrecall {

namespace {
std::atomic<bool> growth_ahead_on{true};
}  // namespace

void SetHostKvGrowthAhead(bool on) { growth_ahead_on.store(on, std::memory_order_relaxed); }
bool HostKvGrowthAhead() { return growth_ahead_on.load(std::memory_order_relaxed); }

WorkQueue* KvGrowthQueue() {
  static WorkQueue* const queue = new WorkQueue(1, "kvrecall-grow");
  return queue;
}

// One growth on the queue: shared by the owner and, while queued, by itself, so that an owner
// that finishes before it began need not wait for the queue.
struct KvGrowthAhead::Job final : WorkItem {
  explicit Job(LayerKvStore::Growth growth) : growth(std::move(growth)) {}

  void Run() override {
    std::shared_ptr<Job> self;
    {
      absl::MutexLock lock(&mu);
      self = std::move(queued_self);
      if (cancelled) {
        done = true;
        return;
      }
      begun = true;
    }
    growth.Run();  // the owner reads `growth` only once `done` is set
    absl::MutexLock lock(&mu);
    done = true;
  }
  bool Done() {
    absl::MutexLock lock(&mu);
    return done;
  }
  // Waits for a begun growth (returns whether it was still running); one not begun never will.
  bool CancelOrWait() {
    absl::MutexLock lock(&mu);
    if (!begun) {
      cancelled = true;
      return false;
    }
    const bool running = !done;
    mu.Await(absl::Condition(&done));
    return running;
  }

  absl::Mutex mu;
  bool begun = false, done = false, cancelled = false;
  std::shared_ptr<Job> queued_self;
  LayerKvStore::Growth growth;
};

KvGrowthAhead::~KvGrowthAhead() {
  if (job_ != nullptr) job_->CancelOrWait();
}

void KvGrowthAhead::AfterCommit(LayerKvStore& kv, int64_t limit) {
  if (job_ != nullptr || kv.tokens() < retry_at_tokens_ || !HostKvGrowthAhead()) return;
  const int64_t capacity = kv.capacity();
  const int64_t left = capacity - kv.tokens();
  if (capacity >= limit ||
      left * kStartDenominator > capacity * (kStartDenominator - kStartNumerator)) {
    return;
  }
  // As ReserveRows grows it: half again, within where it grows in place.
  const int64_t target = std::min({kv.tokens_in_place(), limit,
                                   std::max(capacity + capacity / 2, kv.tokens() + 1)});
  if (target <= capacity) return;  // it would move: the step that needs the row grows it
  absl::StatusOr<LayerKvStore::Growth> growth =
      kv.StartGrowthAhead(target, "the host KV grown ahead of need");
  if (!growth.ok()) {
    retry_at_tokens_ = kv.tokens() + std::max<int64_t>(1, left / 2);
    return;
  }
  job_ = std::make_shared<Job>(*std::move(growth));
  if (queue_ == nullptr || queue_->threads() == 0) {
    job_->Run();  // no queue thread: grown here
    return;
  }
  {
    absl::MutexLock lock(&job_->mu);
    job_->queued_self = job_;
  }
  queue_->Push(job_.get());
}

void KvGrowthAhead::BeforeReserve(LayerKvStore& kv, int64_t more) {
  if (job_ == nullptr) return;
  if (kv.tokens() + more <= kv.capacity() && !job_->Done()) return;
  // Needed now: a growth begun is waited for; one still queued (behind other layers' and
  // sessions' growths on the one queue thread) is dropped, and the reservation grows the store
  // itself, in place.
  if (job_->CancelOrWait()) job_->growth.MarkWaitedFor();
  End(kv);
}

void KvGrowthAhead::Finish(LayerKvStore& kv) {
  if (job_ == nullptr) return;
  job_->CancelOrWait();
  End(kv);
}

void KvGrowthAhead::End(LayerKvStore& kv) {
  const std::shared_ptr<Job> job = std::move(job_);
  const int64_t tokens = kv.tokens(), capacity = kv.capacity();
  if (absl::Status s = kv.EndGrowthAhead(std::move(job->growth)); !s.ok()) {
    retry_at_tokens_ = tokens + std::max<int64_t>(1, (capacity - tokens) / 2);
    static std::once_flag said;
    std::call_once(said, [&] {
      std::fprintf(stderr,
                   "kvrecalld: a layer's host KV could not be grown ahead of need (%s): it "
                   "grows in the step that needs it\n",
                   std::string(s.message()).c_str());
    });
    return;
  }
  if (kv.capacity() > capacity) ++grown_;
}

}  // namespace kvrecall
