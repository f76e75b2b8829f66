#include "server/work_queue.h"

#include <pthread.h>

#include <system_error>
#include <utility>

#include "absl/strings/str_cat.h"

namespace kvrecall {

WorkQueue::WorkQueue(int threads, std::string name) {
  threads_.reserve(threads);
  for (int i = 0; i < threads; ++i) {
    try {
      threads_.emplace_back([this] { Loop(); });
    } catch (const std::system_error& e) {
      status_ = absl::ResourceExhaustedError(absl::StrCat(
          "could start only ", i, " of ", threads, " '", name, "' threads: ", e.what()));
      return;
    }
    pthread_setname_np(threads_.back().native_handle(), name.substr(0, 15).c_str());
  }
}

WorkQueue::~WorkQueue() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& t : threads_) t.join();
}

void WorkQueue::Push(WorkItem* item) {
  absl::MutexLock lock(&mu_);
  item->next_ = nullptr;
  if (tail_ == nullptr) {
    head_ = item;
  } else {
    tail_->next_ = item;
  }
  tail_ = item;
  ++active_;
}

int WorkQueue::active() const {
  absl::MutexLock lock(&mu_);
  return active_;
}

void WorkQueue::Loop() {
  auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return head_ != nullptr || stopping_;
  };
  WorkItem* item = nullptr;
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (item != nullptr) --active_;  // the one run last
      mu_.Await(absl::Condition(&ready));
      if (head_ == nullptr) return;  // stopping, and nothing is left
      item = head_;
      head_ = item->next_;
      if (head_ == nullptr) tail_ = nullptr;
    }
    item->Run();
  }
}

}  // namespace kvrecall
