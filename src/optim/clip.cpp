#include "shardtorch/clip.h"
#include "base/check.h"

#include <c10/core/GradMode.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "base/log.h"
#include "optim/grad_norm.h"
#include "runtime/shard_state.h"

namespace shardtorch {

namespace detail {

GradNorm local_grad_norm(ShardState& state, double norm_type) {
  SHARDTORCH_CHECK(norm_type > 0, "shardtorch::clip_grad_norm: norm_type ", norm_type, " must be positive");
  c10::NoGradGuard no_grad;
  GradNorm n;
  n.norm_type = norm_type;
  n.inf = std::isinf(norm_type);
  n.grads = state.optimizer().local_gradients(n.partial);
  // Every partial result stays a 0-d double tensor on the device until one
  // read at the end: on a GPU an .item() per gradient was a host sync each.
  // A NaN gradient makes the norm NaN, as in torch::nn::utils::clip_grad_norm_
  // (a MAX all-reduce may drop a NaN, so it travels as a flag).
  // No copy of a whole gradient: the largest magnitude is max(|max|, |min|),
  // and the sum of powers goes through double a chunk at a time (a whole
  // OptimizerOnly flat gradient in double was 8 bytes per element at once).
  constexpr int64_t kChunk = int64_t{1} << 20;
  const c10::Device device = n.partial         ? state.topology().shard_comm().device()
                             : n.grads.empty() ? c10::Device(c10::kCPU)
                                               : n.grads.front().device();
  const auto dbl = at::TensorOptions().dtype(at::kDouble).device(device);
  std::vector<at::Tensor> parts;  // per gradient: its largest magnitude, or its sum of powers
  for (const auto& g : n.grads) {
    if (g.numel() == 0) continue;  // max() of nothing throws
    if (n.inf) {
      // at::max propagates NaN, so a NaN in either survives to the result.
      parts.push_back(at::maximum(g.max().abs(), g.min().abs()).to(dbl));
    } else {
      const at::Tensor flat = g.reshape({-1});
      for (int64_t off = 0; off < flat.numel(); off += kChunk) {
        const at::Tensor part = flat.narrow(0, off, std::min(kChunk, flat.numel() - off)).to(at::kDouble);
        parts.push_back((norm_type == 2.0 ? part.square().sum() : part.abs().pow(norm_type).sum()).to(dbl));
      }
    }
  }
  n.local = parts.empty() ? at::zeros({}, dbl) : n.inf ? at::stack(parts).max() : at::stack(parts).sum();
  n.nan = n.local.isnan().to(at::kDouble);
  return n;
}

double finish_clip(GradNorm& n, double max_norm, const std::vector<Comm*>& comms) {
  c10::NoGradGuard no_grad;
  for (Comm* comm : comms) {
    const auto dbl = n.local.options().device(comm->device());
    if (n.inf) {
      auto t = at::stack({at::where(n.nan > 0, at::zeros({}, n.local.options()), n.local), n.nan}).to(dbl);
      comm->all_reduce(t, c10d::ReduceOp::MAX, "clip_grad_norm");
      n.local = t[0];
      n.nan = t[1];
    } else {
      auto t = n.local.reshape({1}).to(dbl);
      comm->all_reduce(t, c10d::ReduceOp::SUM, "clip_grad_norm");  // a NaN stays NaN in a sum
      n.local = t[0];
    }
  }
  const auto host = at::stack({n.local.cpu(), n.nan.cpu()});  // the one host sync
  const double value = host[0].item<double>();
  const bool any_nan = host[1].item<double>() > 0;
  const double total = any_nan ? std::numeric_limits<double>::quiet_NaN()
                       : n.inf ? value
                               : std::pow(std::max(value, 0.0), 1.0 / n.norm_type);
  const double coef = max_norm / (total + 1e-6);
  if (!(coef >= 1.0)) {  // a NaN coefficient scales too, as torch's clamp(coef, max=1) does
    for (auto& g : n.grads) g.mul_(coef);
  }
  return total;
}

}  // namespace detail

double clip_grad_norm(torch::nn::Module& root, double max_norm, double norm_type) {
  auto state = detail::require_state(root, "clip_grad_norm");
  detail::GradNorm n = detail::local_grad_norm(*state, norm_type);
  // Hybrid replicas hold equal shards: the shard group covers everything once.
  std::vector<Comm*> comms;
  if (n.partial) comms.push_back(&state->topology().shard_comm());
  const bool none_here = n.grads.empty();
  const double total = detail::finish_clip(n, max_norm, comms);
  if (none_here && total == 0)
    SHARDTORCH_WARN_ONCE(detail::rank_prefix(state->world().global_rank()),
                         ": clip_grad_norm found no gradient to clip (norm 0, none on this rank): called before "
                         "backward, or after zero_grad()? Clip between the backward and the optimizer step");
  return total;
}

}  // namespace shardtorch
