// cpu::ThreadPool: every item runs once, on at most the threads asked for, from many callers at
// once, nested, with workers asleep or polling; OpenMP inside a body stays on its thread.
#include "kernels/cpu/thread_pool.h"

#include <omp.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace kvrecall::cpu {
namespace {

// Runs a loop of `items` on `threads` threads of `pool`; every item's run count, and the
// threads that ran items.
struct LoopRecord {
  std::vector<int> runs;
  std::set<std::thread::id> threads;
};
LoopRecord RunLoop(ThreadPool& pool, int64_t items, int threads,
                   std::chrono::microseconds work = std::chrono::microseconds(0)) {
  LoopRecord record;
  std::vector<std::atomic<int>> runs(items);
  std::mutex mu;
  pool.ParallelFor(items, threads, [&](int64_t i) {
    runs[i].fetch_add(1);
    const auto until = std::chrono::steady_clock::now() + work;
    while (std::chrono::steady_clock::now() < until) {
    }
    std::lock_guard<std::mutex> lock(mu);
    record.threads.insert(std::this_thread::get_id());
  });
  for (auto& r : runs) record.runs.push_back(r.load());
  return record;
}

TEST(ThreadPoolTest, EveryItemRunsOnceOnAtMostTheThreadsAsked) {
  ThreadPool pool({.workers = 3, .spin = std::chrono::microseconds(100)});
  ASSERT_EQ(pool.workers(), 3);
  for (int64_t items : {0, 1, 2, 7, 64, 1000}) {
    for (int threads : {1, 2, 4, 8}) {
      const LoopRecord record =
          RunLoop(pool, items, threads, std::chrono::microseconds(items <= 64 ? 50 : 0));
      EXPECT_EQ(record.runs, std::vector<int>(items, 1)) << items << " items, " << threads;
      EXPECT_LE(record.threads.size(), static_cast<size_t>(std::min(threads, 4)))
          << items << " items, " << threads;
    }
  }
}

TEST(ThreadPoolTest, HelpersJoinALoopWithWorkForThem) {
  // 64 items of 200 us on 4 threads: the workers must take part (the caller alone would need
  // every item).
  ThreadPool pool({.workers = 3, .spin = std::chrono::microseconds(100)});
  const LoopRecord record = RunLoop(pool, 64, 4, std::chrono::microseconds(200));
  EXPECT_EQ(record.runs, std::vector<int>(64, 1));
  EXPECT_GT(record.threads.size(), 1u);
}

TEST(ThreadPoolTest, SleepingWorkersAreWokenForANewLoop) {
  // No polling: every worker is asleep in futex between loops, and each loop must wake them.
  ThreadPool pool({.workers = 2, .spin = std::chrono::microseconds(0)});
  for (int round = 0; round < 50; ++round) {
    std::this_thread::sleep_for(std::chrono::microseconds(200));
    const LoopRecord record = RunLoop(pool, 16, 3, std::chrono::microseconds(100));
    ASSERT_EQ(record.runs, std::vector<int>(16, 1)) << "round " << round;
  }
}

TEST(ThreadPoolTest, CallersOnManyThreadsShareThePool) {
  ThreadPool pool({.workers = 3, .spin = std::chrono::microseconds(50)});
  std::vector<std::thread> callers;
  std::atomic<int> bad{0};
  for (int c = 0; c < 6; ++c) {
    callers.emplace_back([&, c] {
      for (int round = 0; round < 100; ++round) {
        const int64_t items = 1 + (c * 7 + round) % 40;
        const LoopRecord record = RunLoop(pool, items, 1 + c % 4);
        if (record.runs != std::vector<int>(items, 1)) bad.fetch_add(1);
      }
    });
  }
  for (std::thread& caller : callers) caller.join();
  EXPECT_EQ(bad.load(), 0);
}

TEST(ThreadPoolTest, ABodyMayRunALoopOfItsOwn) {
  ThreadPool pool({.workers = 3, .spin = std::chrono::microseconds(50)});
  std::vector<std::atomic<int>> runs(8 * 16);
  pool.ParallelFor(8, 4, [&](int64_t outer) {
    pool.ParallelFor(16, 4, [&](int64_t inner) { runs[outer * 16 + inner].fetch_add(1); });
  });
  for (size_t i = 0; i < runs.size(); ++i) EXPECT_EQ(runs[i].load(), 1) << i;
}

TEST(ThreadPoolTest, NoWorkersRunsEverythingOnTheCaller) {
  ThreadPool pool({.workers = 0});
  const LoopRecord record = RunLoop(pool, 10, 8);
  EXPECT_EQ(record.runs, std::vector<int>(10, 1));
  ASSERT_EQ(record.threads.size(), 1u);
  EXPECT_EQ(*record.threads.begin(), std::this_thread::get_id());
}

TEST(ThreadPoolTest, OpenMpInsideABodyStaysOnItsThreadAndTheCallerGetsItsTeamBack) {
  if (omp_get_max_threads() < 2) omp_set_num_threads(2);
  const int caller_threads = omp_get_max_threads();
  ThreadPool pool({.workers = 2, .spin = std::chrono::microseconds(50)});
  std::vector<std::atomic<int>> team(12);
  pool.ParallelFor(12, 3, [&](int64_t i) {
    int size = 0;
#pragma omp parallel
    {
#pragma omp single
      size = omp_get_num_threads();
    }
    team[i].store(size);
  });
  for (size_t i = 0; i < team.size(); ++i) EXPECT_EQ(team[i].load(), 1) << i;
  EXPECT_EQ(omp_get_max_threads(), caller_threads);
}

TEST(ThreadPoolTest, TheProcessPoolIsConfiguredOnlyBeforeItsFirstUse) {
  // The free ParallelFor goes through the process's pool for threads > 1.
  std::vector<std::atomic<int>> runs(32);
  ParallelFor(32, 4, [&](int64_t i) { runs[i].fetch_add(1); });
  for (size_t i = 0; i < runs.size(); ++i) EXPECT_EQ(runs[i].load(), 1) << i;
  EXPECT_FALSE(ThreadPool::Configure({.workers = 1}));
  int serial = 0;
  ParallelFor(5, 1, [&](int64_t) { ++serial; });  // one thread: a plain loop
  EXPECT_EQ(serial, 5);
}

// Configure before the pool's first use sizes it: a loop asking for 8 threads runs on the
// caller and the 2 workers asked for, named kvrecall-pool (what `top -H` shows; the README
// names them). The check runs in a fresh process (the threadsafe death-test style re-runs this
// test alone), where nothing has made the pool yet.
TEST(ThreadPoolTest, AConfigureBeforeTheFirstUseSizesTheProcessPool) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        const bool configured = ThreadPool::Configure({.workers = 2});
        std::mutex mu;
        std::set<std::thread::id> threads;
        ParallelFor(512, 8, [&](int64_t) {
          // Long enough an item for every worker to take some.
          std::this_thread::sleep_for(std::chrono::microseconds(50));
          std::lock_guard<std::mutex> lock(mu);
          threads.insert(std::this_thread::get_id());
        });
        int named = 0;
        for (const auto& task : std::filesystem::directory_iterator("/proc/self/task")) {
          std::ifstream comm(task.path() / "comm");
          std::string name;
          named += std::getline(comm, name) && name == "kvrecall-pool";
        }
        std::fprintf(stderr, "configured %d, workers %d, named %d, threads %zu\n", configured,
                     ThreadPool::Process().workers(), named, threads.size());
        std::exit(threads.size() <= 3 ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "configured 1, workers 2, named 2, threads [23]\n");
}

}  // namespace
}  // namespace kvrecall::cpu
