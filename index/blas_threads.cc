#include "index/blas_threads.h"

#include <mutex>

// OpenBLAS's thread control, when the BLAS linked is OpenBLAS; weak so that any other BLAS
// links too.
extern "C" void openblas_set_num_threads(int num_threads) __attribute__((weak));

namespace kvrecall {

void UseSingleThreadedBlas() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (openblas_set_num_threads != nullptr) openblas_set_num_threads(1);
  });
}

}  // namespace kvrecall
