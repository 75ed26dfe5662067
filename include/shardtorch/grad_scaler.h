#pragma once
// Dynamic loss scaling for fp16 mixed precision. The decision to skip a step
// is agreed across ranks: if any rank finds an inf or nan in the gradients it
// holds, every rank skips the step and lowers the scale.
//
//   shardtorch::GradScaler scaler(*model);             // before building the optimizer
//   auto opt = shardtorch::AdamW(*model, ...);
//   scaler.scale(loss).backward();
//   scaler.unscale(*opt);                               // optional, e.g. before clipping
//   shardtorch::clip_grad_norm(*model, 1.0);
//   scaler.step(*opt);                                  // steps unless a rank overflowed
#include <ATen/ATen.h>
#include <torch/arg.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "shardtorch/export.h"
#include "shardtorch/optim.h"

namespace shardtorch {

namespace detail {
class ShardState;
}

struct SHARDTORCH_API GradScalerOptions {
  TORCH_ARG(double, init_scale) = 65536.0;
  TORCH_ARG(double, growth_factor) = 2.0;
  TORCH_ARG(double, backoff_factor) = 0.5;
  /// Consecutive good steps before the scale grows.
  TORCH_ARG(int, growth_interval) = 2000;
};

class SHARDTORCH_API GradScaler {
 public:
  explicit GradScaler(torch::nn::Module& root, GradScalerOptions options = {});

  /// loss × scale.
  at::Tensor scale(const at::Tensor& loss) const;
  /// Divides this rank's gradients by the scale, once: again only after a
  /// backward or zero_grad has changed them (a step not taken after unscale).
  void unscale(ShardedOptimizer& opt);
  /// Collective. Unscales if not done yet, agrees across ranks whether any
  /// gradient is inf or nan, steps the optimizer if none is, updates the
  /// scale. Returns whether the step was taken.
  bool step(ShardedOptimizer& opt);

  double scale_value() const { return scale_; }
  int64_t skipped_steps() const { return skipped_; }

  /// What a resumed run needs to scale as this one would have: the scale,
  /// the good steps since it last changed and the steps skipped, under the
  /// keys "grad_scaler.scale", "grad_scaler.good_steps" and
  /// "grad_scaler.skipped_steps" (the scale as the shortest text that reads
  /// back exactly, in the C locale whatever the process's). Merge it
  /// into save_sharded_checkpoint's `user_state`; it is the same on every rank.
  std::map<std::string, std::string> state_dict() const;
  /// Restores a state_dict() (other keys are ignored, so the whole
  /// `user_state` load_sharded_checkpoint gave back may be passed). Throws,
  /// naming the key, if one is missing or is not a number this scaler accepts.
  void load_state_dict(const std::map<std::string, std::string>& state);

 private:
  void check_optimizer(const ShardedOptimizer& opt, const char* who) const;
  std::shared_ptr<detail::ShardState> state_;
  GradScalerOptions options_;
  double scale_;
  std::optional<uint64_t> unscaled_at_;  // the gradients' generation when unscaled
  int good_steps_ = 0;
  int64_t skipped_ = 0;
};

}  // namespace shardtorch
