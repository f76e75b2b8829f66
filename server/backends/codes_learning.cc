#include "server/backends/codes_learning.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <mutex>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
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

namespace {

// How a learning that ended with `status` ended: its codes took over, or no memory, or another
// error.
LearningOutcome OutcomeOf(const absl::Status& status) {
  if (status.ok()) return LearningOutcome::kTakenOver;
  // Its training or coding stopped because its layer closed (~CodesLearning).
  if (absl::IsCancelled(status)) return LearningOutcome::kAbandoned;
  return absl::IsResourceExhausted(status) ? LearningOutcome::kRefused : LearningOutcome::kFailed;
}

}  // namespace

struct CodesLearning::Job final : WorkItem {
  Job(const CodesLearning& owner, const KvView& bulk, int64_t capacity)
      : tier(owner.tier_),
        config(owner.config_),
        accounts(owner.accounts_),
        bulk(bulk),
        capacity(capacity),
        committed(bulk.tokens) {}

  // Learns unless cancelled before it began; then drops its own reference (it may be the last:
  // nothing of the job is touched after).
  void Run() override {
    std::shared_ptr<Job> self;
    {
      absl::MutexLock lock(&mu);
      self = std::move(queued_self);
      if (cancelled.load(std::memory_order_acquire)) {
        done = true;
        return;
      }
      begun = true;
    }
    // A learning's OpenMP team (the training, the coding on the host) takes a few cores, not
    // the ones the decode steps run on. The setting is the calling thread's (the queue's, or a
    // step's when it learns inline), so it is given back after.
    const int team = omp_get_max_threads();
    omp_set_num_threads(std::min(kLearningThreads, team));
    const BuildStop stop = BuildStop::WhenSet(&cancelled);
    absl::StatusOr<std::unique_ptr<BulkCodes>> codes =
        tier->BuildCodes(*config, accounts, bulk, capacity, stop);
    // The rows committed since, while the layer keeps stepping: fewer are left for the
    // take-over. (Committed rows stay put until BeforeReserve waits for this learning.)
    KvView grown = bulk;
    while (codes.ok() && !stop.requested()) {
      grown.tokens = std::min(committed.load(std::memory_order_acquire), capacity);
      if (grown.tokens <= (*codes)->coded()) break;
      if (absl::Status s = (*codes)->CodeRowsUnless(stop, grown); !s.ok()) codes = s;
    }
    omp_set_num_threads(team);
    absl::MutexLock lock(&mu);
    learned = std::move(codes);
    done = true;
  }
  // Returns once the job has run, or at once when it has not begun (it will not).
  void WaitUnlessQueued() {
    absl::MutexLock lock(&mu);
    auto settled = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu) { return done || !begun; };
    mu.Await(absl::Condition(&settled));
  }
  // Returns once the job has run.
  void Wait() {
    absl::MutexLock lock(&mu);
    mu.Await(absl::Condition(&done));
  }

  StaticSetTier* const tier;
  const LayerConfig* const config;
  const SessionAccounts accounts;
  // The bulk it learns from (its tokens), the room its codes take, and the committed bulk rows
  // it may code beyond them (stored by OnCommitted, read by the learning).
  const KvView bulk;
  const int64_t capacity;
  std::atomic<int64_t> committed;
  std::atomic<bool> cancelled{false};
  absl::Mutex mu;
  bool begun ABSL_GUARDED_BY(mu) = false;
  bool done ABSL_GUARDED_BY(mu) = false;
  std::shared_ptr<Job> queued_self ABSL_GUARDED_BY(mu);  // while queued
  // Once done (read by the owner after Wait).
  absl::StatusOr<std::unique_ptr<BulkCodes>> learned ABSL_GUARDED_BY(mu);
};

CodesLearning::CodesLearning(StaticSetTier* tier, const LayerConfig* config,
                             SessionAccounts accounts, int64_t learned_rows, WorkQueue* queue,
                             CodesLearningTally* tally)
    : tier_(tier),
      config_(config),
      accounts_(accounts),
      queue_(queue),
      tally_(tally),
      next_learn_at_(NextLearnAt(learned_rows, config->shape.head_dim)) {}

CodesLearning::~CodesLearning() {
  if (job_ == nullptr) return;
  job_->cancelled.store(true, std::memory_order_release);
  job_->WaitUnlessQueued();
  // What it learned goes here, while the accounts it charged exist (the job itself may outlive
  // this on the queue's thread, holding nothing charged).
  absl::StatusOr<std::unique_ptr<BulkCodes>> learned;
  absl::MutexLock lock(&job_->mu);
  // A learning that ended refused or failed is counted so even if its take-over never came.
  const bool failed = job_->begun && job_->done && !job_->learned.ok();
  if (tally_ != nullptr) {
    tally_->Count(failed ? OutcomeOf(job_->learned.status()) : LearningOutcome::kAbandoned);
  }
  learned = std::move(job_->learned);
  job_->learned = std::unique_ptr<BulkCodes>();
}

void CodesLearning::OnCommitted(const KvView& bulk) {
  if (job_ != nullptr) job_->committed.store(bulk.tokens, std::memory_order_release);
  if (job_ != nullptr || next_learn_at_ <= 0 || bulk.tokens < next_learn_at_) return;
  const SelectorParams& p = config_->selector;
  if (TakeOverAt(bulk.tokens, config_->layer) >=
      BulkTokens(config_->max_layer_tokens, p.sinks, p.recent)) {
    // The layer can never grow to where these codes (or any later ones) would take over: a
    // learning would cost its memory and cores for nothing.
    next_learn_at_ = 0;
    return;
  }
  take_over_at_ = TakeOverAt(bulk.tokens, config_->layer);
  next_learn_at_ = NextLearnAt(bulk.tokens, config_->shape.head_dim);
  // Room for the announced context, as at prefill, and for the rows these codes serve: up to
  // the next learning's take-over (or twice this one's, the last learning's), so that they do
  // not grow (a new allocation, and a new captured step at every layer) on the token after they
  // take over, as they did sized one row past it (review 13).
  const int64_t serves_until =
      next_learn_at_ > 0 ? TakeOverAt(next_learn_at_, config_->layer) + 1 : 2 * take_over_at_;
  const int64_t capacity =
      std::max(BulkTokens(config_->expected_tokens, p.sinks, p.recent), serves_until);
  job_ = std::make_shared<Job>(*this, bulk, capacity);
  if (queue_->threads() == 0) {
    job_->Run();  // the system refused the queue its thread: learned here, on the step's
    return;
  }
  {
    absl::MutexLock lock(&job_->mu);
    job_->queued_self = job_;
  }
  queue_->Push(job_.get());
}

void CodesLearning::BeforeReserve(const KvView& bulk, bool rows_move,
                                  std::unique_ptr<BulkCodes>* codes) {
  if (job_ == nullptr) return;
  if (bulk.tokens < take_over_at_) {
    if (rows_move) job_->Wait();
    return;
  }
  job_->Wait();
  const std::shared_ptr<Job> job = std::move(job_);
  take_over_at_ = 0;
  absl::StatusOr<std::unique_ptr<BulkCodes>> learned;
  {
    absl::MutexLock lock(&job->mu);
    learned = std::move(job->learned);
  }
  if (learned.ok()) {
    // The rows the learning did not code: those committed after it ended (it codes the rows
    // that come while it runs, until it has caught up).
    if (absl::Status s = (*learned)->Reserve(bulk.tokens); !s.ok()) {
      learned = s;
    } else if (absl::Status s = (*learned)->CodeRows(bulk); !s.ok()) {
      learned = s;
    }
  }
  if (tally_ != nullptr) tally_->Count(OutcomeOf(learned.status()));
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
