// One BLAS thread per caller: the index's OpenMP loops call sgemm from every core, and BLAS
// threads of its own on top would oversubscribe them.
#ifndef KVRECALL_INDEX_BLAS_THREADS_H_
#define KVRECALL_INDEX_BLAS_THREADS_H_

namespace kvrecall {

// Sets OpenBLAS (when it is the BLAS linked) to one thread per call, once per process.
void UseSingleThreadedBlas();

}  // namespace kvrecall

#endif  // KVRECALL_INDEX_BLAS_THREADS_H_
