// The knobs of ReTopK (arXiv 2607.27692), shared by the CPU reference (index/retopk.h) and the
// GPU-resident kernels (kernels/cuda/retopk.h).
#ifndef KVRECALL_KERNELS_RETOPK_PARAMS_H_
#define KVRECALL_KERNELS_RETOPK_PARAMS_H_

namespace kvrecall {

struct ReTopKParams {
  int cache_capacity = 32;    // C: cached (query, support) entries per query head, FIFO
  int reuse_neighbors = 4;    // R: most similar cached entries whose supports are unioned
  int recent_window = 32;     // W: most recent positions added to the candidates
  float tau = 0.85f;          // reuse when the best cosine >= tau
  int refresh_interval = 128; // Tr: every Tr-th decode step is exact; 0 disables
  bool auto_tau = false;      // calibrate tau per head from the prefill queries
  float target_recall = 0.9f; // support recall that auto_tau keeps
  // Host selectors of the tiered placement only: the exact path scans the bulk flatly instead
  // of searching the graph index (the kernels always scan).
  bool exact_flat_scan = false;
};

}  // namespace kvrecall

#endif  // KVRECALL_KERNELS_RETOPK_PARAMS_H_
