// Learns a tiered layer's shortlist codes (server/backends/bulk_codes.h) again, off the decode
// path, while its bulk grows past what they were learned from: a prompt with little or no bulk
// (a short one) would otherwise never get codes, and every exact step would scan the whole
// bulk; codes learned from a few hundred rows code later keys worse than a longer bulk's.
//
// When: codes are learned once the bulk holds kFirstLearnRows rows, then again each time it
// doubles, until they were learned from a bulk of as many rows as the training samples
// (BulkCodes::TrainingParams: a longer bulk would not change what they learn from). A learning
// starts after the step that brings the bulk to that length; it trains on the bulk as it stood
// then, on a thread of its own (one for the process, kLearningThreads cores of OpenMP team), and
// codes the rows the bulk gains meanwhile; the new codes take over at a fixed length
// (TakeOverAt: half again as many rows, and as many more as the layer's index in its model),
// waiting for the learning if it is not done by then. So the step at which a layer's codes
// change depends on its length and index alone, not on when the learning happened to finish;
// and a model's layers, which all start learning at the same token, take over one a token
// rather than all at one token (each codes its catch-up rows and captures its step anew: 32 at
// once made one token cost 1.6-2.6x its neighbours, d130). The price: layer l serves l more
// tokens with the old codes (or, after a prompt too short for codes, a scan of the whole bulk),
// so the 32 tokens of the span cost 1.4-2.2 ms more each, against one token 8-17 ms more (d130,
// bench/results/tiered_serving.md). A learning whose codes could take over only past the most
// tokens the layer may hold (LayerConfig::max_layer_tokens: --max_context_tokens) is not
// started.
//
// Memory: a learning holds a second set of codes (sized, as the first, for the announced
// max_tokens, and at least for the rows they serve until the next learning takes over) beside
// the layer's until it takes over, charged to the session's accounts as it is made; when they
// refuse it, the layer keeps the codes it has and tries again at the next doubling. GetSession
// reports the codes in use (SessionInfo.host_budget_bytes and gpu_budget_bytes the second set
// too); kvrecall_codes_learnings_total counts how learnings
// ended (server/backends/learning_outcomes.h), a refused one among them.
#ifndef KVRECALL_SERVER_BACKENDS_CODES_LEARNING_H_
#define KVRECALL_SERVER_BACKENDS_CODES_LEARNING_H_

#include <algorithm>
#include <cstdint>
#include <memory>

#include "kernels/kv_view.h"
#include "server/backends/attention_backend.h"
#include "server/backends/bulk_codes.h"
#include "server/backends/learning_outcomes.h"
#include "server/work_queue.h"

namespace kvrecall {

class StaticSetTier;

// The queue that learnings run on: one thread for the process, started on first use (a
// learning's training spreads over an OpenMP team, or runs on the tier's device).
WorkQueue* CodesLearningQueue();

// One layer's learnings. Thread-compatible like the layer that owns it (its methods run under
// the session's lock); only its learning's job runs beside them, on the queue.
class CodesLearning final {
 public:
  // The shortest bulk codes are learned from, at prefill: its held-out fifth (51 rows) sets an
  // outlier bar that about 2 % of later keys pass (a bar from fewer keys lets many more pass:
  // half of them from 5 rows), and a flat scan of a shorter bulk costs little.
  static constexpr int64_t kMinLearnRows = 256;
  // The bulk length of a layer's first codes when its prompt had too short a bulk for any: a
  // quantizer of 256 centroids per subspace then learns from 3 keys a centroid (the trained four
  // fifths), and until then an exact step's flat scan reads at most 1024 rows a head.
  static constexpr int64_t kFirstLearnRows = 1024;

  // The bulk length at which codes learned from `learned_rows` rows (0: none) of a layer of
  // `head_dim` are learned again; 0 when never (they saw as many rows as the training samples).
  static int64_t NextLearnAt(int64_t learned_rows, int head_dim);
  // The bulk length at which codes learned from a bulk of `rows` take over in the model's
  // layer `layer` (LayerConfig::layer): half again as many rows, so that the steps between (512
  // tokens at the first learning) cover a queue of the learnings every layer of a model starts
  // at the same step; then one row later for each layer before it, wrapping after a quarter of
  // `rows` (256 layers at the first learning), so that the take-over stays a quarter of `rows`
  // before the next learning (NextLearnAt: twice `rows`).
  static int64_t TakeOverAt(int64_t rows, int32_t layer = 0) {
    return rows + std::max<int64_t>(1, rows / 2) +
           std::max<int32_t>(layer, 0) % std::max<int64_t>(1, rows / 4);
  }
  // The cores a learning's OpenMP team takes.
  static constexpr int kLearningThreads = 2;

  // For a layer of `config` whose codes live on `tier`, charged to `accounts` (every one of
  // them outlives this object), learned from `learned_rows` bulk rows so far (0: no codes).
  // queue: where learnings run (CodesLearningQueue()); tally (null: none) counts how each
  // learning ended.
  CodesLearning(StaticSetTier* tier, const LayerConfig* config, SessionAccounts accounts,
                int64_t learned_rows, WorkQueue* queue, CodesLearningTally* tally = nullptr);
  // Waits for a learning that has begun (it reads the layer's KV); one still queued (behind
  // other layers' learnings) is dropped at once, and learns nothing when the queue reaches it.
  ~CodesLearning();
  CodesLearning(const CodesLearning&) = delete;
  CodesLearning& operator=(const CodesLearning&) = delete;

  // After a step committed its token: `bulk` is the layer's bulk now ([tokens, kv_heads,
  // head_dim] in host memory, whose committed rows stay put until BeforeReserve says they
  // move); starts a learning when the bulk has reached the next learning's length, unless its
  // codes could take over only past LayerConfig::max_layer_tokens: then none ever starts
  // (next_learn_at() is 0).
  void OnCommitted(const KvView& bulk);
  // Before a token is reserved: when the bulk (`bulk`, as in OnCommitted) has reached the
  // learned codes' take-over length, waits for them, codes the rows they lack and puts them in
  // *codes (the old ones go); a learning that failed leaves *codes as it was (and says why on
  // stderr, once a process). `rows_move`: the reservation is about to move the KV's rows, so a
  // learning in flight is waited for first (its codes still take over at their length).
  void BeforeReserve(const KvView& bulk, bool rows_move, std::unique_ptr<BulkCodes>* codes);

  // Whether a learning is started and its codes have not taken over yet.
  bool learning() const { return job_ != nullptr; }
  // The bulk length of the next learning's start (0: none), and the take-over length of the
  // one started (0: none).
  int64_t next_learn_at() const { return next_learn_at_; }
  int64_t take_over_at() const { return take_over_at_; }

 private:
  // One learning on the queue: shared by the layer and, while queued or running, by itself,
  // so that a layer closed before its learning began need not wait for the queue.
  struct Job;

  StaticSetTier* const tier_;
  const LayerConfig* const config_;
  const SessionAccounts accounts_;
  WorkQueue* const queue_;
  CodesLearningTally* const tally_;
  int64_t next_learn_at_ = 0;
  int64_t take_over_at_ = 0;
  std::shared_ptr<Job> job_;  // the learning started, until its codes take over
};

}  // namespace kvrecall

#endif  // KVRECALL_SERVER_BACKENDS_CODES_LEARNING_H_
