#include "server/backends/codes_learning.h"

#include <omp.h>

#include <algorithm>
#include <cstdio>
#include <mutex>
#include <string>
#include <utility>

#include "index/basic_selectors.h"
#include "server/backends/tiered_backend.h"

namespace kvrecall {

WorkQueue* CodesLearningQueue() {
  static WorkQueue* const queue = new WorkQueue(1, "kvrecall-codes");
  return queue;
}

int64_t CodesLearning::NextLearnAt(int64_t learned_rows, int head_dim) {
  if (learned_rows >= BulkCodes::TrainingParams(head_dim).training_keys) return 0;
  return std::max(kFirstLearnRows, 2 * learned_rows);
}

CodesLearning::CodesLearning(StaticSetTier* tier, const LayerConfig* config,
                             SessionAccounts accounts, int64_t learned_rows, WorkQueue* queue)
    : tier_(tier),
      config_(config),
      accounts_(accounts),
      queue_(queue),
      next_learn_at_(NextLearnAt(learned_rows, config->shape.head_dim)) {}

CodesLearning::~CodesLearning() {
  cancelled_.store(true, std::memory_order_relaxed);
  Wait();
}

void CodesLearning::OnCommitted(const KvView& bulk) {
  committed_.store(bulk.tokens, std::memory_order_release);
  if (started_ || next_learn_at_ <= 0 || bulk.tokens < next_learn_at_) return;
  started_ = true;
  take_over_at_ = TakeOverAt(bulk.tokens);
  next_learn_at_ = NextLearnAt(bulk.tokens, config_->shape.head_dim);
  bulk_ = bulk;
  const SelectorParams& p = config_->selector;
  // Room for the announced context, as at prefill, and at least past the take-over.
  capacity_ = std::max(BulkTokens(config_->expected_tokens, p.sinks, p.recent),
                       take_over_at_ + 1);
  {
    absl::MutexLock lock(&mu_);
    running_ = true;
  }
  if (queue_->threads() == 0) {
    Run();  // the system refused the queue its thread: learned here, on the step's
    return;
  }
  queue_->Push(this);
}

void CodesLearning::Run() {
  // A learning's OpenMP team (the training, the coding on the host) takes a few cores, not the
  // ones the decode steps run on (the setting is this thread's: the queue's, or the step's when
  // it learns inline).
  static thread_local const bool team_set = [] {
    omp_set_num_threads(std::min(kLearningThreads, omp_get_num_procs()));
    return true;
  }();
  (void)team_set;
  absl::StatusOr<std::unique_ptr<BulkCodes>> learned =
      cancelled_.load(std::memory_order_relaxed)
          ? absl::CancelledError("the layer was closed before its codes were learned")
          : tier_->BuildCodes(*config_, accounts_, bulk_, capacity_);
  // The rows committed since, while the layer keeps stepping: fewer are left for the take-over.
  // (Committed rows stay put until BeforeReserve waits for this learning.)
  KvView grown = bulk_;
  while (learned.ok() && !cancelled_.load(std::memory_order_relaxed)) {
    grown.tokens = std::min(committed_.load(std::memory_order_acquire), capacity_);
    if (grown.tokens <= (*learned)->coded()) break;
    if (absl::Status s = (*learned)->CodeRows(grown); !s.ok()) learned = s;
  }
  absl::MutexLock lock(&mu_);
  learned_ = std::move(learned);
  running_ = false;
}

void CodesLearning::Wait() {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](bool* running) { return !*running; }, &running_));
}

void CodesLearning::BeforeReserve(const KvView& bulk, bool rows_move,
                                  std::unique_ptr<BulkCodes>* codes) {
  if (!started_) return;
  if (bulk.tokens < take_over_at_) {
    if (rows_move) Wait();
    return;
  }
  Wait();
  started_ = false;
  take_over_at_ = 0;
  absl::StatusOr<std::unique_ptr<BulkCodes>> learned = std::move(learned_);
  learned_ = std::unique_ptr<BulkCodes>();
  if (learned.ok()) {
    // The rows the learning did not code: those committed after it ended (it codes the rows
    // that come while it runs, until it has caught up).
    if (absl::Status s = (*learned)->Reserve(bulk.tokens); !s.ok()) {
      learned = s;
    } else if (absl::Status s = (*learned)->CodeRows(bulk); !s.ok()) {
      learned = s;
    }
  }
  if (!learned.ok()) {
    static std::once_flag said;
    std::call_once(said, [&] {
      std::fprintf(stderr,
                   "kvrecalld: a tiered layer's shortlist codes could not be learned again "
                   "from its grown bulk (%s): it keeps the codes it has\n",
                   std::string(learned.status().message()).c_str());
    });
    return;
  }
  *codes = *std::move(learned);
}

}  // namespace kvrecall
