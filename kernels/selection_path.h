// How a query head's support was chosen in one decode step: the one definition that the CPU
// selectors, the CUDA kernels (as uint8_t codes) and the API (kvrecall.v1.Path, checked in
// server/) all use.
#ifndef KVRECALL_KERNELS_SELECTION_PATH_H_
#define KVRECALL_KERNELS_SELECTION_PATH_H_

#include <cstdint>

namespace kvrecall {

enum class SelectionPath : uint8_t {
  kExact = 0,     // a selector without reuse (full, exact_topk, streaming, index)
  kReuse = 1,     // ReTopK reused cached supports
  kFallback = 2,  // ReTopK's best cosine was below tau: exact path
  kRefresh = 3,   // ReTopK's periodic exact step
};
inline constexpr int kSelectionPaths = 4;

}  // namespace kvrecall

#endif  // KVRECALL_KERNELS_SELECTION_PATH_H_
