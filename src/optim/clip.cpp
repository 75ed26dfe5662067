#include "shardtorch/clip.h"
#include "base/check.h"

#include <c10/core/GradMode.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "runtime/shard_state.h"

namespace shardtorch {

double clip_grad_norm(torch::nn::Module& root, double max_norm, double norm_type) {
  auto state = detail::require_state(root, "clip_grad_norm");
  SHARDTORCH_CHECK(norm_type > 0, "shardtorch::clip_grad_norm: norm_type ", norm_type, " must be positive");
  c10::NoGradGuard no_grad;
  const bool inf = std::isinf(norm_type);

  bool partial = false;
  std::vector<at::Tensor> grads = state->local_gradients(partial);
  // Every partial result stays a 0-d double tensor on the device until one
  // read at the end: on a GPU an .item() per gradient was a host sync each.
  // A NaN gradient makes the norm NaN, as in torch::nn::utils::clip_grad_norm_
  // (a MAX all-reduce may drop a NaN, so it travels as a flag).
  // No copy of a whole gradient: the largest magnitude is max(|max|, |min|),
  // and the sum of powers goes through double a chunk at a time (a whole
  // OptimizerOnly flat gradient in double was 8 bytes per element at once).
  constexpr int64_t kChunk = int64_t{1} << 20;
  const c10::Device device = partial         ? state->shard_comm().device()
                             : grads.empty() ? c10::Device(c10::kCPU)
                                             : grads.front().device();
  const auto dbl = at::TensorOptions().dtype(at::kDouble).device(device);
  std::vector<at::Tensor> parts;  // per gradient: its largest magnitude, or its sum of powers
  for (const auto& g : grads) {
    if (g.numel() == 0) continue;  // max() of nothing throws
    if (inf) {
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
  at::Tensor local = parts.empty() ? at::zeros({}, dbl) : inf ? at::stack(parts).max() : at::stack(parts).sum();
  at::Tensor nan = local.isnan().to(at::kDouble);
  if (partial) {
    Comm& comm = state->shard_comm();  // hybrid replicas hold equal shards: the shard group covers everything once
    if (inf) {
      auto t = at::stack({at::where(nan > 0, at::zeros({}, dbl), local), nan});
      comm.all_reduce(t, c10d::ReduceOp::MAX, "clip_grad_norm");
      local = t[0];
      nan = t[1];
    } else {
      auto t = local.reshape({1});
      comm.all_reduce(t, c10d::ReduceOp::SUM, "clip_grad_norm");  // a NaN stays NaN in a sum
      local = t[0];
    }
  }
  const auto host = at::stack({local, nan}).cpu();  // the one host sync
  const double value = host[0].item<double>();
  const bool any_nan = host[1].item<double>() > 0;
  const double total = any_nan ? std::numeric_limits<double>::quiet_NaN()
                       : inf   ? value
                               : std::pow(value, 1.0 / norm_type);
  const double coef = max_norm / (total + 1e-6);
  if (!(coef >= 1.0)) {  // a NaN coefficient scales too, as torch's clamp(coef, max=1) does
    for (auto& g : grads) g.mul_(coef);
  }
  return total;
}

}  // namespace shardtorch
