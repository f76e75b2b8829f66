// DeferredAppend (server/backends/deferred_append.h): a queued OnAppend runs on the queue's
// thread, not the caller's, with the view it was queued with; Wait returns only after it ran and
// reports how long it blocked; the next Queue and the destructor wait for the pending one; with
// no queue it runs inline.
#include "server/backends/deferred_append.h"

#include <atomic>
#include <chrono>
#include <thread>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"

namespace kvrecall {
namespace {

// Records its OnAppends; each blocks until released when `gate` is set.
class RecordingSelector final : public SupportSelector {
 public:
  absl::Status Build(const KvView&, const PromptQueries&) override { return absl::OkStatus(); }
  void Select(int, const float*, const KvView&, HeadSelection*) override {}
  void OnAppend(const KvView& kv) override {
    if (gate != nullptr) gate->WaitForNotification();
    last_tokens.store(kv.tokens);
    thread.store(std::this_thread::get_id());
    calls.fetch_add(1);
  }
  absl::Notification* gate = nullptr;
  std::atomic<int64_t> last_tokens{0};
  std::atomic<std::thread::id> thread{};
  std::atomic<int> calls{0};
};

KvView ViewOf(int64_t tokens) { return KvView{nullptr, nullptr, tokens, 1, 1}; }

TEST(DeferredAppendTest, RunsOnTheQueueThreadAndWaitReturnsOnlyAfterIt) {
  WorkQueue queue(1, "test-link");
  RecordingSelector selector;
  absl::Notification gate;
  selector.gate = &gate;
  DeferredAppend appended(&selector, &queue);
  appended.Queue(ViewOf(7));
  EXPECT_EQ(selector.calls.load(), 0) << "Queue must not run OnAppend itself";
  std::thread release([&gate] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    gate.Notify();
  });
  appended.Wait();
  EXPECT_EQ(selector.calls.load(), 1);
  EXPECT_EQ(selector.last_tokens.load(), 7);
  EXPECT_NE(selector.thread.load(), std::this_thread::get_id());
  EXPECT_GE(appended.waited_seconds(), 0.02) << "Wait blocked until the OnAppend finished";
  release.join();
  // Nothing pending: Wait returns at once and says so.
  appended.Wait();
  EXPECT_EQ(appended.waited_seconds(), 0.0);
}

TEST(DeferredAppendTest, TheNextQueueAndTheDestructorWaitForThePendingOne) {
  WorkQueue queue(1, "test-link");
  RecordingSelector selector;
  {
    DeferredAppend appended(&selector, &queue);
    for (int64_t t = 1; t <= 50; ++t) appended.Queue(ViewOf(t));
  }  // destroyed with the last one possibly pending
  EXPECT_EQ(selector.calls.load(), 50);
  EXPECT_EQ(selector.last_tokens.load(), 50);
}

TEST(DeferredAppendTest, WithoutAQueueItRunsInline) {
  RecordingSelector selector;
  DeferredAppend appended(&selector, nullptr);
  appended.Queue(ViewOf(3));
  EXPECT_EQ(selector.calls.load(), 1);
  EXPECT_EQ(selector.thread.load(), std::this_thread::get_id());
  appended.Wait();
  EXPECT_EQ(appended.waited_seconds(), 0.0);
}

// A queue none of whose threads started (the system refused them: a thread or pid limit when
// the process first linked a token) runs nothing: its OnAppends run inline instead. Before, the
// item waited there for good, and the layer's next Wait (its next step, its close) with it.
TEST(DeferredAppendTest, AQueueWithoutThreadsRunsItInline) {
  // On the heap: a thread blocked for good (the defect) is left behind with them, and the test
  // fails instead of aborting the binary.
  auto* no_threads = new WorkQueue(0, "test-link");
  ASSERT_EQ(no_threads->threads(), 0);
  auto* selector = new RecordingSelector;
  auto* appended = new DeferredAppend(selector, no_threads);
  auto* done = new std::atomic<bool>(false);
  std::thread step([=] {
    appended->Queue(ViewOf(5));
    appended->Queue(ViewOf(6));  // waits for the first
    appended->Wait();
    done->store(true);
  });
  for (int i = 0; i < 500 && !done->load(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (!done->load()) {
    step.detach();
    FAIL() << "Wait blocked on an OnAppend no thread runs";
  }
  step.join();
  EXPECT_EQ(selector->calls.load(), 2);
  EXPECT_EQ(selector->last_tokens.load(), 6);
  delete appended;
  delete selector;
  delete no_threads;
  delete done;
}

}  // namespace
}  // namespace kvrecall
