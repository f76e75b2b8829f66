// The product-quantized copy of a tiered layer's bulk keys (policy.index.shortlist): per KV head
// a quantizer trained at prefill on the bulk (index/product_quantizer.h, one code byte per 16
// dims of a key), and the codes of the bulk's keys on the static tier, which every step scans
// for each query head's shortlist (index/shortlist_selector.h rescores it). The host tier keeps
// the codes in host memory and scans them on the CPU (the stand-in); the GPU tier keeps them in
// device memory and scans them there (server/backends/gpu_static_set.cc).
#ifndef KVRECALL_SERVER_BACKENDS_BULK_CODES_H_
#define KVRECALL_SERVER_BACKENDS_BULK_CODES_H_

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "index/build_stop.h"
#include "index/product_quantizer.h"
#include "kernels/kv_view.h"
#include "server/backends/attention_backend.h"

namespace kvrecall {

class BulkCodes {
 public:
  // Key dims per code byte: the codes are 1/32 of bf16 keys' bytes.
  static constexpr int kDimsPerCode = 16;
  // INVALID_ARGUMENT naming the field unless `config`'s head_dim is a multiple of 16 up to 256.
  static absl::Status CheckConfig(const LayerConfig& config);
  static int SubspacesFor(int head_dim) { return head_dim / kDimsPerCode; }
  // Bytes of `rows` coded bulk rows (every KV head) of `config`, and of its codebooks (f32).
  static int64_t CodeBytesFor(const LayerConfig& config, int64_t rows);
  static int64_t CodebookBytesFor(const LayerConfig& config);
  // How the quantizers of a layer of `head_dim` are trained (bench/results/pq_shortlist.md):
  // enough sampled keys and rounds for the shortlist's recall, few enough for the prefill.
  static ProductQuantizerParams TrainingParams(int head_dim);

  virtual ~BulkCodes();

  // Bulk rows coded so far: [0, coded()).
  int64_t coded() const { return coded_; }
  // The bulk the codes were learned on: rows [0, learned_rows()), of which the quantizers
  // trained on the first TrainedRowsOf (the rest set the outlier bar). codes_learning.h learns
  // them again as the bulk grows past it.
  int64_t learned_rows() const { return learned_rows_; }
  // The coded bulk rows of `kv_head` whose codes misrepresent their key most (the largest
  // reconstruction errors: above the prompt bulk's 1 - 1/kOutlierShare quantile), which every
  // exact step rescores whatever the shortlist says: a key unlike the others (a needle) is the
  // one a product quantizer codes worst and the one attention may need most.
  std::span<const int32_t> outliers(int kv_head) const { return outliers_[kv_head]; }
  static constexpr int kOutlierShare = 512;
  // The quantizers learn from a bulk's first TrainedRowsOf(rows) rows; its last fifth sets the
  // outlier bar (the 1 - 1/kOutlierShare quantile of their reconstruction errors). A key the
  // codebooks learned from is coded better than one they never saw, as every key to come: a
  // bar set on their own rows (a few rows a centroid in a short bulk code almost exactly) made
  // most later keys outliers.
  static constexpr int kHeldOutShare = 5;
  static int64_t TrainedRowsOf(int64_t rows) { return rows - rows / kHeldOutShare; }
  int subspaces() const { return subspaces_; }
  int kv_heads() const { return static_cast<int>(quantizers_.size()); }
  const ProductQuantizer& quantizer(int kv_head) const { return quantizers_[kv_head]; }
  // Host bytes charged: the quantizers (which the host tier encodes new keys with), and the
  // codes on the host tier.
  int64_t host_bytes() const { return host_charged_; }
  virtual int64_t device_bytes() const = 0;
  // Room for `rows` coded bulk rows in all (RESOURCE_EXHAUSTED naming the budget: nothing
  // changed).
  virtual absl::Status Reserve(int64_t rows) = 0;
  // Codes `bulk`'s rows [coded(), bulk.tokens) from its keys in host memory ([tokens, kv_heads,
  // head_dim], the layer's bulk; Reserve made room), their outliers included: the rows a
  // layer's bulk gained while these codes were learned (codes_learning.h). Not while a step
  // runs on them. On failure (a device error) the rows stay uncoded.
  absl::Status CodeRows(const KvView& bulk) { return CodeRowsUnless(BuildStop(), bulk); }
  // CodeRows for a build (the prompt's bulk at prefill, a learning's): asks `stop` between
  // units of work (each block of 16384 rows of each KV head on the host, each chunk of rows
  // on a device) and, once it says so, returns CANCELLED with the rows uncoded and the
  // outliers as they were.
  virtual absl::Status CodeRowsUnless(const BuildStop& stop, const KvView& bulk) = 0;
  // The codes of rows [begin, end) of KV head `kv_head`: [end - begin, subspaces()] u8, read
  // from wherever they live (device memory: copied down once the device is idle), so that they
  // can be checked against the quantizer's encoding of the same keys. Between the layer's steps
  // and token reservations (Reserve moves the codes). INVALID_ARGUMENT when begin > end;
  // OUT_OF_RANGE unless 0 <= begin, end <= coded() and the head exists.
  absl::StatusOr<std::vector<uint8_t>> ReadCodes(int kv_head, int64_t begin, int64_t end) const;

 protected:
  // Quantizers trained on `bulk`'s keys ([tokens, kv_heads, head_dim]; at least one token): its
  // first TrainedRowsOf(tokens) rows, with `assigner`'s assignments when given (the GPU tier's
  // device). CANCELLED once `stop` is requested, asked before each k-means round of each head
  // (ProductQuantizerParams::stop).
  static absl::StatusOr<std::vector<ProductQuantizer>> Train(
      const KvView& bulk, PqAssigner* assigner = nullptr,
      const BuildStop& stop = BuildStop());
  // ReadCodes' copy once its range is checked: [end - begin, subspaces()] into `codes`.
  virtual absl::Status CopyCodes(int kv_head, int64_t begin, int64_t end,
                                 uint8_t* codes) const = 0;
  // `host` is charged for what the codes hold in host memory (ChargeHost) until they go.
  BulkCodes(std::vector<ProductQuantizer> quantizers, MemoryAccount* host);
  // Charges `bytes` more of host memory, naming `what` (RESOURCE_EXHAUSTED: nothing changed).
  absl::Status ChargeHost(int64_t bytes, absl::string_view what);
  // ChargeHost for the quantizers' codebooks.
  absl::Status ChargeQuantizers();
  // codes [kv_heads, end - begin, M]: rows [begin, end) of `bulk` encoded (on the calling
  // thread's OpenMP team when there are many), and those among them beyond the outlier
  // threshold added to the outliers (AddOutliers). Not while outliers() is read. `stop` is
  // asked before each block of rows of each KV head: CANCELLED, the outliers as they were.
  absl::Status EncodeRows(const KvView& bulk, int64_t begin, int64_t end, uint8_t* codes,
                          const BuildStop& stop = BuildStop());
  // What CodeRowsUnless's CANCELLED names.
  static constexpr char kCodingStopped[] = "the shortlist's coding";
  // Rows [begin, begin + errors.size()) of `kv_head` coded elsewhere (the GPU tier codes the
  // bulk on its device), given their squared reconstruction errors: those beyond the outlier
  // threshold join the outliers. The head's first call (the bulk the quantizers were trained
  // on, from row 0) sets the threshold from its held-out rows (kHeldOutShare). Not while
  // outliers() is read.
  void AddOutliers(int kv_head, int64_t begin, std::span<const float> errors);

  std::vector<ProductQuantizer> quantizers_;
  std::vector<std::vector<int32_t>> outliers_;  // [kv_heads][...] bulk rows
  std::vector<float> outlier_threshold_;        // [kv_heads]: squared reconstruction error
                                                // (NaN until the head's first AddOutliers)
  int subspaces_ = 0;
  int64_t coded_ = 0;
  int64_t learned_rows_ = 0;

 private:
  MemoryAccount* const host_;
  int64_t host_charged_ = 0;
};

}  // namespace kvrecall

#endif  // KVRECALL_SERVER_BACKENDS_BULK_CODES_H_
