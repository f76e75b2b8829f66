// The knobs of every support selector, in one struct that travels from the API to the index.
#ifndef KVRECALL_INDEX_SELECTOR_PARAMS_H_
#define KVRECALL_INDEX_SELECTOR_PARAMS_H_

#include <cstdint>

#include "absl/status/status.h"

namespace kvrecall {

enum class SelectorKind { kFull, kExactTopK, kStreaming, kIndex, kReTopK };

const char* SelectorKindName(SelectorKind kind);

struct ReTopKParams {
  int cache_capacity = 32;    // C: cached (query, support) entries per query head, FIFO
  int reuse_neighbors = 4;    // R: most similar cached entries whose supports are unioned
  int recent_window = 32;     // W: most recent positions added to the candidates
  float tau = 0.85f;          // reuse when the best cosine >= tau
  int refresh_interval = 128; // Tr: every Tr-th decode step is exact; 0 disables
  bool auto_tau = false;      // calibrate tau per head from the prefill queries
  float target_recall = 0.9f; // support recall that auto_tau keeps
};

struct GraphIndexParams {
  int build_queries = 0;      // 0: the index's own default
  int build_topk = 0;
  int max_degree = 0;
  int search_list_size = 0;
};

struct SelectorParams {
  SelectorKind kind = SelectorKind::kFull;
  int top_k = 512;  // K
  int sinks = 128;
  int recent = 512;
  ReTopKParams retopk;
  GraphIndexParams index;

  // INVALID_ARGUMENT naming the field when a knob is out of its domain.
  absl::Status Validate() const;
};

}  // namespace kvrecall

#endif  // KVRECALL_INDEX_SELECTOR_PARAMS_H_
