#pragma once
// A fused CPU Adam/AdamW: one pass over parameter, gradient and both moments
// per element, vectorised for AVX-512, AVX2+FMA or plain x86-64 (chosen at run
// time: the shipped build uses no -march=native), split across threads with
// ATen's parallel_for. On a CUDA device (a build against a CUDA LibTorch,
// fused_adam_cuda_available()) the same update runs as one CUDA kernel per
// parameter piece, on the current stream. FusedAdam / FusedAdamW are torch::optim optimizers
// (same options and state classes as torch::optim::Adam / AdamW), so they work
// with shardtorch::ShardedOptimizer, parameter groups and checkpoints:
//
//   auto opt = shardtorch::ShardedOptimizer::make<shardtorch::FusedAdamW>(*model, torch::optim::AdamWOptions(1e-3));
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <string>
#include <unordered_map>

#include "shardtorch/export.h"
#include "shardtorch/optim.h"

namespace shardtorch {

struct SHARDTORCH_API AdamStep {
  // Double, as the options hold them: the kernel's fp32 coefficients (1 - beta2
  // among them) are rounded from the exact values, as torch::optim's are.
  double lr, beta1, beta2, eps, weight_decay;
  int64_t step;    // after increment: 1 on the first step
  bool decoupled;  // AdamW (decay the parameter) or Adam (decay added to the gradient)
};

/// One Adam/AdamW update of n fp32 elements in place. If `low` is not null,
/// the updated parameters are also written there as bf16 (the compute copy).
SHARDTORCH_API void fused_adam_cpu(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, int64_t n,
                                   const AdamStep& s, at::BFloat16* low = nullptr);

/// "avx512-newton", "avx512", "avx2" or "default": the variant fused_adam_cpu
/// runs here (the widest the CPU has; on Intel cores with AVX-512, the one
/// that takes sqrt and the division from hardware estimates refined by a
/// Newton step, a few ulp from the exact update; the environment variable
/// SHARDTORCH_ADAM_ISA overrides).
SHARDTORCH_API std::string fused_adam_isa();

/// Whether this build has the fused CUDA kernel, with which FusedAdam(W) also
/// steps fp32 parameters on a CUDA device (built against a CUDA LibTorch with
/// nvcc; docs/gpu.md).
SHARDTORCH_API bool fused_adam_cuda_available();

/// For benchmarks: the memory roofline of an Adam update's access pattern.
/// Reads a, b, c, d and writes a, c, d (28 bytes per element, the least an
/// update moves) with one add each, compiled and threaded exactly like
/// fused_adam_cpu (same flags, same at::parallel_for grain).
SHARDTORCH_API void adam_traffic_roofline(float* a, const float* b, float* c, float* d, int64_t n);

namespace detail {
template <class Options, class State, bool Decoupled>
class FusedAdamBase : public torch::optim::Optimizer, public LowCopyWriter, public PartialStepper {
 public:
  /// ShardedOptimizer::make checks every rank's optimized tensors up front.
  static constexpr bool kNeedsFp32Cpu = true;
  FusedAdamBase(std::vector<torch::optim::OptimizerParamGroup> groups, Options defaults)
      : torch::optim::Optimizer(std::move(groups), std::make_unique<Options>(defaults)) {}
  FusedAdamBase(std::vector<at::Tensor> params, Options defaults)
      : FusedAdamBase({torch::optim::OptimizerParamGroup(std::move(params))}, defaults) {}
  at::Tensor step(LossClosure closure = nullptr) override;
  void write_low_copy(const at::Tensor& param, at::Tensor low) override;
  void check_step() const override;
  void step_params(const std::vector<at::Tensor>& params) override;
  /// fp32 or bf16 gradients of CPU parameters; each converted and divided a
  /// block at a time inside the update (no fp32 gradient is written).
  bool step_params_with(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                        double divisor) override;

 private:
  void update(at::Tensor& param, const Options& options);
  void update_from(at::Tensor& param, const at::Tensor& grad, double divisor, const Options& options);
  std::unordered_map<const c10::TensorImpl*, at::Tensor> low_;  // parameter -> its bf16 copy
};
}  // namespace detail

using FusedAdam = detail::FusedAdamBase<torch::optim::AdamOptions, torch::optim::AdamParamState, false>;
using FusedAdamW = detail::FusedAdamBase<torch::optim::AdamWOptions, torch::optim::AdamWParamState, true>;

}  // namespace shardtorch
