#include "kernels/cpu/thread_pool.h"

#include <omp.h>
#include <pthread.h>

#include <algorithm>
#include <climits>

#include "kernels/cpu/spin_wait.h"

namespace kvrecall::cpu {
namespace {

std::mutex& ProcessPoolMutex() {
  static std::mutex mu;
  return mu;
}
ThreadPoolOptions process_options;  // under ProcessPoolMutex()
// Made once under ProcessPoolMutex(), never destroyed; read without the lock once made (every
// parallel loop of a step asks for it).
std::atomic<ThreadPool*> process_pool{nullptr};

}  // namespace

struct ThreadPool::Loop {
  void (*body)(void*, int64_t);
  void* context;
  int64_t items;
  int max_helpers;
  int helpers = 0;       // joined so far (under mu_)
  bool listed = false;   // in loops_ (under mu_)
  Loop* newer = nullptr;  // list links (under mu_)
  Loop* older = nullptr;
  std::atomic<int64_t> next{0};  // the next item to claim
  std::atomic<int> active{0};    // helpers still inside (they may touch the loop)

  void RunItems() {
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < items;
         i = next.fetch_add(1, std::memory_order_relaxed)) {
      body(context, i);
    }
  }
};

ThreadPool::ThreadPool(const ThreadPoolOptions& options) : spin_(options.spin) {
  int workers = options.workers;
  if (workers < 0) {
    // OpenMP's default team size as a fresh thread sees it (OMP_NUM_THREADS, else the cores),
    // not this thread's, which an omp_set_num_threads may have changed.
    int team = 1;
    std::thread([&team] { team = omp_get_max_threads(); }).join();
    workers = team - 1;
  }
  workers_.reserve(std::max(workers, 0));
  for (int i = 0; i < workers; ++i) {
    workers_.emplace_back([this, i] {
      // An OpenMP region inside a loop's body runs on this thread alone, as one nested in an
      // OpenMP loop would (and ThreadsFor gives 1 here).
      omp_set_num_threads(1);
      WorkerMain(i);
    });
    pthread_setname_np(workers_.back().native_handle(), "kvrecall-pool");
  }
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  generation_.fetch_add(1);
  FutexWake(&generation_, INT_MAX, FutexScope::kProcess);
  for (std::thread& worker : workers_) worker.join();
}

ThreadPool& ThreadPool::Process() {
  if (ThreadPool* pool = process_pool.load(std::memory_order_acquire); pool != nullptr) {
    return *pool;
  }
  std::lock_guard<std::mutex> lock(ProcessPoolMutex());
  if (process_pool.load(std::memory_order_relaxed) == nullptr) {
    process_pool.store(new ThreadPool(process_options), std::memory_order_release);
  }
  return *process_pool.load(std::memory_order_relaxed);
}

bool ThreadPool::Configure(const ThreadPoolOptions& options) {
  std::lock_guard<std::mutex> lock(ProcessPoolMutex());
  if (process_pool.load(std::memory_order_relaxed) != nullptr) return false;
  process_options = options;
  return true;
}

void ThreadPool::Run(int64_t items, int threads, void (*body)(void*, int64_t), void* context) {
  Loop loop;
  loop.body = body;
  loop.context = context;
  loop.items = items;
  loop.max_helpers = static_cast<int>(
      std::min<int64_t>({int64_t{threads} - 1, items - 1, int64_t{workers()}}));
  if (loop.max_helpers <= 0) {
    loop.RunItems();
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    loop.older = loops_;
    if (loops_ != nullptr) loops_->newer = &loop;
    loops_ = &loop;
    loop.listed = true;
  }
  // Sequentially consistent with the sleepers' count (WorkerMain): either this sees a worker
  // that is about to sleep, or that worker's futex wait sees the new generation and returns.
  polling_workers_.store(loop.max_helpers, std::memory_order_relaxed);
  generation_.fetch_add(1);
  if (sleepers_.load() > 0) FutexWake(&generation_, loop.max_helpers, FutexScope::kProcess);
  // An OpenMP region inside the caller's items runs on one thread too, as on the workers
  // (this thread's team size restored after).
  const int caller_threads = omp_get_max_threads();
  omp_set_num_threads(1);
  loop.RunItems();
  omp_set_num_threads(caller_threads);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (loop.listed) {
      if (loop.newer != nullptr) loop.newer->older = loop.older;
      if (loop.older != nullptr) loop.older->newer = loop.newer;
      if (loops_ == &loop) loops_ = loop.older;
      loop.listed = false;
    }
  }
  // Unlisted, so no helper joins any more; those inside finish their last item.
  while (!PollUntil(std::chrono::seconds(1),
                    [&] { return loop.active.load(std::memory_order_acquire) == 0; })) {
  }
}

ThreadPool::Loop* ThreadPool::Join() {
  for (Loop* loop = loops_; loop != nullptr; loop = loop->older) {
    if (loop->helpers < loop->max_helpers &&
        loop->next.load(std::memory_order_relaxed) < loop->items) {
      ++loop->helpers;
      loop->active.fetch_add(1, std::memory_order_relaxed);
      return loop;
    }
  }
  return nullptr;
}

void ThreadPool::WorkerMain(int index) {
  for (;;) {
    const uint32_t seen = generation_.load();
    Loop* loop;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) return;
      loop = Join();
    }
    if (loop != nullptr) {
      loop->RunItems();
      loop->active.fetch_sub(1, std::memory_order_release);  // the loop may be gone after this
      continue;
    }
    // Only as many workers poll as the last loop wanted: a step of a few heads does not keep
    // the host's every core busy between steps.
    if (index < polling_workers_.load(std::memory_order_relaxed) &&
        PollUntil(spin_, [&] { return generation_.load(std::memory_order_relaxed) != seen; })) {
      continue;
    }
    sleepers_.fetch_add(1);
    FutexWait(&generation_, seen, FutexScope::kProcess);
    sleepers_.fetch_sub(1);
  }
}

}  // namespace kvrecall::cpu
