// The CPU placement: every layer's KV in host memory (f32) behind its support selector
// (index/), attended by the CPU kernels (kernels/cpu), query heads in parallel on the decode
// compute pool (kernels/cpu/thread_pool.h; OpenMP only in the selectors' builds).
#ifndef KVRECALL_SERVER_BACKENDS_CPU_BACKEND_H_
#define KVRECALL_SERVER_BACKENDS_CPU_BACKEND_H_

#include <memory>
#include <span>
#include <string>

#include "server/backends/attention_backend.h"
#include "server/kv_store.h"

namespace kvrecall {

// A prompt in host memory as it arrives: the layer's KV store itself (it becomes the layer's),
// in `element`, and the queries (f32), which only the selector's build reads. Shared by the
// placements that keep the KV on the host (cpu in f32, and the bulk of tiered in the session's
// dtype).
class HostPromptStaging final : public PromptStaging {
 public:
  // kept_queries: how many of the prompt's last queries the selector's build reads
  // (PromptQueriesNeeded of any length: 0, a window such as ReTopK's seeds, or every one).
  // Only those are held (with none, a chunk's q is only checked), instead of staging
  // [T, q_heads, head_dim] f32 (4x the KV of a bf16 GQA layer with 4 query heads per KV head)
  // that nothing reads.
  HostPromptStaging(const LayerShape& shape, MemoryAccount* host, KvElement element,
                    int64_t kept_queries)
      : kv(shape.kv_heads, shape.head_dim, host, element),
        queries(int64_t{shape.q_heads} * shape.head_dim, kept_queries, host) {}

  // A staging for a layer of `config` whose KV already holds room for its announced max_tokens
  // (LayerConfig::expected_tokens; 0: none announced), so that the prompt's chunks land in the
  // layer's final allocation: growing geometrically and then to the announced size at the
  // build would copy the whole prompt KV (and map its pages) twice more, ~0.2 s of a 128K
  // layer's build. Its arrays reserve address space for the most tokens the layer will hold
  // (LayerConfig::tokens_to_hold), to grow without moving.
  static absl::StatusOr<std::unique_ptr<HostPromptStaging>> Create(const LayerConfig& config,
                                                                   MemoryAccount* host,
                                                                   KvElement element,
                                                                   int64_t kept_queries);

  absl::Status Reserve(int64_t more, absl::string_view what) override;
  float* query_tail() override { return queries.tail(); }
  void* key_tail() override { return kv.key_tail(); }
  void* value_tail() override { return kv.value_tail(); }
  KvElement kv_element() const override { return kv.element(); }
  absl::Status Commit(int64_t n, bool with_queries) override;
  int64_t tokens() const override { return kv.tokens(); }

  // The prompt's last kept queries for the selector's build (zeros where a chunk came without
  // q); none where none are kept.
  PromptQueries prompt_queries() const { return queries.prompt_queries(); }

  LayerKvStore kv;
  // The last min(tokens, kept_queries) queries [rows, q_heads, head_dim], from the prompt's row
  // queries.first() (a chunk's beyond them until its Commit drops them); empty with none kept.
  PromptQueryWindow queries;
};

// How many of a prompt's last queries `backend`'s layers of `config` build from, whatever the
// prompt's length (PromptQueriesNeeded of any length): HostPromptStaging's kept_queries.
int64_t KeptPromptQueries(const AttentionBackend& backend, const LayerConfig& config);

// Full attention and each head's exact top-K over the history `kv` (compare_exact's shadow of
// every placement whose complete KV is on the host).
void HostShadow(const LayerShape& shape, const KvView& kv, const ShadowStep& step);

class CpuBackend final : public AttentionBackend {
 public:
  CpuBackend() = default;

  v1::Placement placement() const override { return v1::PLACEMENT_CPU; }
  bool StepCanFail() const override { return false; }
  const std::string& device() const override { return device_; }
  absl::Status CheckConfig(const LayerConfig& config) const override;
  // Keys and values in f32 (the host store's layout here).
  int64_t HostKvBytesFor(const LayerConfig& config, int64_t tokens) const override {
    return LayerKvStore::BytesFor(tokens, config.shape.kv_heads, config.shape.head_dim,
                                  KvElement::kF32);
  }
  int64_t HostSelectorBytesBound(const LayerConfig& config, int64_t tokens,
                                 int build_threads) const override;
  absl::StatusOr<std::unique_ptr<PromptStaging>> NewPromptStaging(
      const LayerConfig& config, const SessionAccounts& accounts) override;
  absl::StatusOr<std::unique_ptr<LayerBackend>> BuildLayer(
      const LayerConfig& config, const SessionAccounts& accounts,
      std::unique_ptr<PromptStaging> prompt, const BuildStop& stop) override;
  std::unique_ptr<StepContext> NewStepContext(MemoryAccount* host) override;
  absl::Status Step(std::span<LayerStep> steps, StepContext* context) override;
  absl::Status Shadow(std::span<ShadowStep> steps, StepContext* context) override;

 private:
  const std::string device_ = "cpu";
};

}  // namespace kvrecall

#endif  // KVRECALL_SERVER_BACKENDS_CPU_BACKEND_H_
