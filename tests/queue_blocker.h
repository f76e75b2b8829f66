// A work item that holds its WorkQueue's thread until released (server/work_queue.h), so that a
// test can keep an item queued behind it: a learning queued behind other layers' learnings.
#ifndef KVRECALL_TESTS_QUEUE_BLOCKER_H_
#define KVRECALL_TESTS_QUEUE_BLOCKER_H_

#include "absl/synchronization/notification.h"
#include "server/work_queue.h"

namespace kvrecall::testing {

// Push it, then Release it from another thread (or after the work it holds back is checked);
// it must outlive its Run.
class QueueBlocker final : public WorkItem {
 public:
  void Run() override { release_.WaitForNotification(); }
  void Release() { release_.Notify(); }

 private:
  absl::Notification release_;
};

}  // namespace kvrecall::testing

#endif  // KVRECALL_TESTS_QUEUE_BLOCKER_H_
