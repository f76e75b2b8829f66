// The process's pool of persistent worker threads that the parallel loops of a decode step run
// on, whichever thread calls them (a gRPC thread, a step worker, a shared-memory stream's own).
//
// Why not an OpenMP parallel region: libgomp gives every thread that opens a region a pool of
// its own. kvrecalld opens regions from many threads (gRPC's callback threads run steps inline,
// the step and build queues, the deferred linking, shared-memory streams), so the process holds
// many pools; once their threads outnumber the cores libgomp stops spinning between regions, and
// every region pays futex wake-ups of its whole team. On the H200 host a 32-head, 64-token step
// took 56-74 us of server compute over gRPC that way, 42-44 us on this pool (bench/results/
// rpc_floor.md, runs 6 and 7); on the development machine idle pools beside one opener made its
// 2-thread regions 5-20x slower. Here one fixed set of workers serves every caller: a worker that
// finished a loop polls for the next one for `spin` before it sleeps, and a caller always works
// on its own loop, so it never waits for a worker to wake up before progress is made.
// (Prompt-time builds keep OpenMP: they run for seconds, where a wake-up does not matter.)
#ifndef KVRECALL_KERNELS_CPU_THREAD_POOL_H_
#define KVRECALL_KERNELS_CPU_THREAD_POOL_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

namespace kvrecall::cpu {

struct ThreadPoolOptions {
  // Worker threads besides the callers; < 0: omp_get_max_threads() - 1 (OMP_NUM_THREADS and
  // the host's cores decide, as for the OpenMP loops the pool stands in for).
  int workers = -1;
  // How long a worker that ran out of loops polls for a new one before it sleeps in futex(2)
  // (the first few microseconds spinning, then yielding the core to any other runnable thread).
  // A runner's next layer-step usually arrives within a round trip, so the default covers one.
  // Only as many workers poll as the latest loop asked for.
  std::chrono::microseconds spin{100};
};

class ThreadPool {
 public:
  explicit ThreadPool(const ThreadPoolOptions& options);
  // Joins the workers; no loop may be running.
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // The process's pool, made on first use with the options of the last Configure before it
  // (defaults otherwise).
  static ThreadPool& Process();
  // Sets the options the process's pool is made with; false (and nothing changes) once it is
  // made.
  static bool Configure(const ThreadPoolOptions& options);

  // Runs body(i) for every i in [0, items) on at most `threads` threads, the caller's among
  // them, and returns when every call has returned. Items are claimed one at a time in
  // increasing order (the dynamic schedule), so the body must not depend on which thread runs
  // an item. The body must not throw. Loops of several callers run side by side; a body may
  // call ParallelFor itself.
  template <typename Body>
  void ParallelFor(int64_t items, int threads, Body&& body) {
    using Fn = std::remove_reference_t<Body>;
    Run(items, threads,
        [](void* context, int64_t item) { (*static_cast<Fn*>(context))(item); },
        const_cast<void*>(static_cast<const void*>(&body)));
  }

  int workers() const { return static_cast<int>(workers_.size()); }

 private:
  struct Loop;
  void Run(int64_t items, int threads, void (*body)(void*, int64_t), void* context);
  // Joins the first listed loop with a helper slot and items left (under mu_); null: none.
  Loop* Join();
  // index: the worker's place in workers_.
  void WorkerMain(int index);

  const std::chrono::microseconds spin_;
  std::mutex mu_;
  Loop* loops_ = nullptr;  // loops that may still take helpers, newest first (under mu_)
  bool stopping_ = false;  // under mu_
  // Bumped whenever a loop is listed (and at shutdown): the word idle workers sleep on.
  std::atomic<uint32_t> generation_{0};
  std::atomic<int> sleepers_{0};
  // The helpers the latest loop asked for: workers [0, polling_workers_) poll when idle, the
  // others sleep at once.
  std::atomic<int> polling_workers_{0};
  std::vector<std::thread> workers_;
};

// ThreadPool::Process().ParallelFor, or a plain loop on this thread for threads <= 1 or a
// single item (entering the pool costs more than such a loop).
template <typename Body>
void ParallelFor(int64_t items, int threads, Body&& body) {
  if (threads <= 1 || items <= 1) {
    for (int64_t i = 0; i < items; ++i) body(i);
    return;
  }
  ThreadPool::Process().ParallelFor(items, threads, body);
}

}  // namespace kvrecall::cpu

#endif  // KVRECALL_KERNELS_CPU_THREAD_POOL_H_
