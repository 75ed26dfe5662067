#include "shardtorch/clip.h"

#include <c10/core/GradMode.h>

#include <cmath>
#include <limits>

#include "shard_state.h"

namespace shardtorch {

double clip_grad_norm(torch::nn::Module& root, double max_norm, double norm_type) {
  auto state = detail::state_of(root);
  TORCH_CHECK(state, "shardtorch::clip_grad_norm: this model was never sharded");
  TORCH_CHECK(norm_type > 0, "shardtorch::clip_grad_norm: norm_type ", norm_type, " must be positive");
  c10::NoGradGuard no_grad;
  const bool inf = std::isinf(norm_type);

  // The gradients this rank holds, and whether other ranks hold other parts.
  std::vector<at::Tensor> grads;
  bool sharded = false;
  if (state->ddp()) {
    for (const auto& p : state->ddp_params())
      if (p.grad().defined()) grads.push_back(p.grad());
  } else {
    for (auto& u : state->units()) {
      for (auto& f : u->flats()) {
        if (f->full_grad().defined()) {
          grads.push_back(f->full_grad());  // OptimizerOnly: whole and identical on every rank
        } else if (f->shard_grad().defined()) {
          grads.push_back(f->shard_grad());
          sharded = true;
        }
      }
    }
  }
  // Accumulate in double: one partial value per rank.
  double local = 0.0;
  for (const auto& g : grads) {
    if (inf) {
      local = std::max(local, g.abs().max().item<double>());
    } else {
      local += g.to(at::kDouble).abs().pow(norm_type).sum().item<double>();
    }
  }
  // The strategy is the same on every rank, so either every rank communicates or none does.
  if (sharded || (state->strategy() != Strategy::NoShard && state->strategy() != Strategy::OptimizerOnly)) {
    Comm& comm = state->shard_comm();  // hybrid replicas hold equal shards: the shard group covers everything once
    auto t = at::full({1}, local, at::TensorOptions().dtype(at::kDouble)).to(comm.device());
    comm.all_reduce(t, inf ? c10d::ReduceOp::MAX : c10d::ReduceOp::SUM, "clip_grad_norm");
    local = t.cpu().item<double>();
  }
  const double total = inf ? local : std::pow(local, 1.0 / norm_type);
  const double coef = max_norm / (total + 1e-6);
  if (coef < 1.0) {
    for (auto& g : grads) g.mul_(coef);
  }
  return total;
}

}  // namespace shardtorch
