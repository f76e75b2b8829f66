// The CPU placement: every layer's KV in host memory (f32) behind its support selector
// (index/), attended by the CPU kernels (kernels/cpu), query heads in parallel with OpenMP.
#ifndef KVRECALL_SERVER_BACKENDS_CPU_BACKEND_H_
#define KVRECALL_SERVER_BACKENDS_CPU_BACKEND_H_

#include <memory>
#include <span>
#include <string>

#include "server/backends/attention_backend.h"

namespace kvrecall {

class CpuBackend final : public AttentionBackend {
 public:
  CpuBackend() = default;

  v1::Placement placement() const override { return v1::PLACEMENT_CPU; }
  const std::string& device() const override { return device_; }
  absl::Status CheckConfig(const LayerConfig& config) const override;
  absl::StatusOr<std::unique_ptr<PromptStaging>> NewPromptStaging(
      const LayerConfig& config, const SessionAccounts& accounts) override;
  absl::StatusOr<std::unique_ptr<LayerBackend>> BuildLayer(
      const LayerConfig& config, const SessionAccounts& accounts,
      std::unique_ptr<PromptStaging> prompt) override;
  std::unique_ptr<StepContext> NewStepContext() override;
  absl::Status Step(std::span<LayerStep> steps, StepContext* context) override;
  absl::Status Shadow(std::span<ShadowStep> steps, StepContext* context) override;

 private:
  const std::string device_ = "cpu";
};

}  // namespace kvrecall

#endif  // KVRECALL_SERVER_BACKENDS_CPU_BACKEND_H_
