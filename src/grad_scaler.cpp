#include "shardtorch/grad_scaler.h"

#include <c10/core/GradMode.h>

#include "shard_state.h"

namespace shardtorch {

GradScaler::GradScaler(torch::nn::Module& root, GradScalerOptions options)
    : state_(detail::require_state(root, "GradScaler")), options_(options), scale_(options.init_scale()) {
  TORCH_CHECK(scale_ > 0 && options.growth_factor() > 1 && options.backoff_factor() > 0 && options.backoff_factor() < 1,
              "shardtorch::GradScaler: need init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1");
  state_->set_has_scaler();
}

at::Tensor GradScaler::scale(const at::Tensor& loss) const { return loss * scale_; }

void GradScaler::unscale(ShardedOptimizer&) {
  // Once per value of the gradients: after a backward or a zero_grad (a step
  // the user chose not to take after unscale) they are scaled again.
  if (unscaled_at_ == state_->gradient_generation()) return;
  c10::NoGradGuard no_grad;
  bool partial = false;
  for (auto& g : state_->local_gradients(partial)) g.mul_(1.0 / scale_);
  unscaled_at_ = state_->gradient_generation();
}

bool GradScaler::step(ShardedOptimizer& opt) {
  unscale(opt);
  bool partial = false;
  bool found = false;
  for (auto& g : state_->local_gradients(partial)) {
    if (!at::isfinite(g).all().item<bool>()) {
      found = true;
      break;
    }
  }
  // Every rank must make the same decision, whatever part of the gradients it holds.
  auto& comm = state_->world().comm();
  auto flag = at::full({1}, found ? 1.0f : 0.0f).to(comm.device());
  comm.all_reduce(flag, c10d::ReduceOp::MAX, "GradScaler inf/nan check");
  if (flag.cpu().item<float>() > 0) {
    scale_ *= options_.backoff_factor();
    unscaled_at_.reset();
    good_steps_ = 0;
    ++skipped_;
    return false;
  }
  opt.step();  // if it throws (refused), the gradients stay marked unscaled: a retry does not divide again
  unscaled_at_.reset();
  if (++good_steps_ >= options_.growth_interval()) {
    scale_ *= options_.growth_factor();
    good_steps_ = 0;
  }
  return true;
}

}  // namespace shardtorch
