// A fixed pool of threads that runs queued work in order: the service's compute (decode steps,
// prompt chunks, selector builds) off gRPC's callback threads, so that those stay free for I/O
// and health checks however busy the pool is, and the one-thread queues of background work (the
// frees of taken-back layers, the host KV's growth, deferred index linking, codes learning, a
// host tier's exact heads). Work items are intrusive: queueing one allocates nothing.
#ifndef KVRECALL_SERVER_WORK_QUEUE_H_
#define KVRECALL_SERVER_WORK_QUEUE_H_

#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace kvrecall {

// Something to run once on a pool thread. An item is in at most one queue at a time; whoever
// pushes it keeps it alive until Run has returned.
class WorkItem {
 public:
  virtual void Run() = 0;

 protected:
  ~WorkItem() = default;

 private:
  friend class WorkQueue;
  WorkItem* next_ = nullptr;
};

class WorkQueue {
 public:
  // Starts `threads` (>= 1; 0 in tests: a queue as one none of whose threads started) threads
  // named `name` (at most 15 characters show in ps/top). When the system refuses a thread (a
  // thread or pid limit), it keeps those it started and status() says so.
  WorkQueue(int threads, std::string name);
  // Runs what is queued, then joins the threads. (A queue none of whose threads started runs
  // nothing: a server refuses to start when its own queues have none, ThreadsStarted; the
  // queues started at first use, the deferred linking's say, have their users run inline.)
  ~WorkQueue();
  WorkQueue(const WorkQueue&) = delete;
  WorkQueue& operator=(const WorkQueue&) = delete;

  // Queues `item` (first in, first out).
  void Push(WorkItem* item);

  int threads() const { return static_cast<int>(threads_.size()); }
  // RESOURCE_EXHAUSTED when fewer threads than asked for could be started.
  const absl::Status& status() const { return status_; }
  // Items queued or running.
  int active() const;

 private:
  void Loop();

  mutable absl::Mutex mu_;
  WorkItem* head_ ABSL_GUARDED_BY(mu_) = nullptr;
  WorkItem* tail_ ABSL_GUARDED_BY(mu_) = nullptr;
  int active_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
  absl::Status status_;
};

}  // namespace kvrecall

#endif  // KVRECALL_SERVER_WORK_QUEUE_H_
