// Host API of the GPU's exact path over candidate lists (issue 15): for chosen rows of a decode
// step, attention over the exact top K of each row's candidates (its shortlist, its KV head's
// outliers and the positions not yet coded), read wherever the sequence's DeviceSeq points. The
// tiered placement's bulk lives in host memory; registered with the device (cudaHostRegister,
// mapped) the kernel reads its rows over PCIe, so that the GPU can take some of a step's exact
// heads while the host's threads take the rest (bench/results/pcie_gather.md: scattered 256-byte
// rows at ~50 GB/s on the H200 at 128K).
//
// Every pointer argument is device memory or mapped host memory; nothing here allocates or
// synchronizes.
#ifndef KVRECALL_KERNELS_CUDA_CANDIDATE_ATTENTION_H_
#define KVRECALL_KERNELS_CUDA_CANDIDATE_ATTENTION_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/decode_types.h"

namespace kvrecall::cuda {

// The candidates of a step's rows (row = b * q_heads + h), device memory. A row's candidates
// are, deduplicated: the ids of its shortlist (its first shortlist_sizes[row]) and of its KV
// head's outliers that lie in [0, coded[b]) (others are skipped), then every position in
// [coded[b], size of seqs[b]) (rows not yet coded), as ShortlistSelector::Select takes them.
struct CandidateLists {
  const int32_t* shortlists = nullptr;      // [batch * q_heads, shortlist_stride]
  const int32_t* shortlist_sizes = nullptr; // [batch * q_heads] in [0, stride]; null: stride
  int shortlist_stride = 0;
  const int32_t* outliers = nullptr;        // [batch, kv_heads, outlier_stride]
  const int32_t* outlier_counts = nullptr;  // [batch, kv_heads], each in [0, outlier_stride]
  int outlier_stride = 0;
  const int32_t* coded = nullptr;           // [batch]
  int max_uncoded = 0;  // bound on size - coded[b]; a sequence beyond it is an error (below)
};

// Where the results go, indexed by row (device memory): o [batch * q_heads, head_dim] f32,
// lse [batch * q_heads] (natural log; -inf with o = 0 for no candidates), support
// [batch * q_heads, top_k] positions in no particular order, support_size and candidate_count
// [batch * q_heads] (the deduplicated candidates scored). Rows not run are not written.
struct CandidateOutputs {
  float* o = nullptr;
  float* lse = nullptr;
  int32_t* support = nullptr;
  int32_t* support_size = nullptr;
  int32_t* candidate_count = nullptr;
};

// OK when the kernel serves this geometry, top_k and these list bounds on the current device
// (its shared memory holds the largest candidate set), else INVALID_ARGUMENT naming what does
// not fit. Reads the device's limits, allocates nothing.
absl::Status CheckCandidateAttention(const DecodeShape& shape, int top_k,
                                     const CandidateLists& lists);

// CheckCandidateAttention, then the kernel's shared-memory limit raised for these bounds on the
// current device: call it before capturing a CandidateAttention into a CUDA graph (a capture
// must not change a kernel's attributes).
absl::Status PrepareCandidateAttention(const DecodeShape& shape, int top_k,
                                       const CandidateLists& lists);

// Runs rows[0, row_count) (device [row_count] row ids; a negative id is skipped): per row, its
// candidates scored exactly against q[row] (f32 [batch * q_heads, head_dim]) with the keys of
// seqs[b] (DeviceSeq [batch], device memory; its keys and values may be mapped host memory),
// their top K (larger score first, equal scores to the lower position), and the attention state
// over them. The scores are the host's up to f32 summation order, so a near-tie at the K-th may
// go the other way than on the host (whose ShortlistSelector breaks exact ties by list order). One block per row. Ids outside [0, size) are skipped; a
// sequence with more than max_uncoded uncoded positions attends to the first max_uncoded of
// them; both set a bit in *errors (KernelErrors::device_word(), may be null). Checks the
// arguments as CheckCandidateAttention does (INVALID_ARGUMENT); row_count 0 launches nothing.
absl::Status CandidateAttention(const DecodeShape& shape, int top_k, const DeviceSeq* seqs,
                                const float* q, const CandidateLists& lists, const int32_t* rows,
                                int row_count, const CandidateOutputs& out, unsigned* errors,
                                cudaStream_t stream);

}  // namespace kvrecall::cuda

#endif  // KVRECALL_KERNELS_CUDA_CANDIDATE_ATTENTION_H_
