#include "shardtorch/clip.h"

#include <c10/core/GradMode.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "shard_state.h"

namespace shardtorch {

double clip_grad_norm(torch::nn::Module& root, double max_norm, double norm_type) {
  auto state = detail::require_state(root, "clip_grad_norm");
  TORCH_CHECK(norm_type > 0, "shardtorch::clip_grad_norm: norm_type ", norm_type, " must be positive");
  c10::NoGradGuard no_grad;
  const bool inf = std::isinf(norm_type);

  bool partial = false;
  std::vector<at::Tensor> grads = state->local_gradients(partial);
  // Accumulate in double: one partial value per rank.
  // A NaN gradient makes the norm NaN, as in torch::nn::utils::clip_grad_norm_
  // (std::max would drop it, and so may a MAX all-reduce: it travels as a flag).
  // No copy of a whole gradient: the largest magnitude is max(|max|, |min|),
  // and the sum of powers goes through double a chunk at a time (a whole
  // OptimizerOnly flat gradient in double was 8 bytes per element at once).
  constexpr int64_t kChunk = int64_t{1} << 20;
  double local = 0.0;
  bool nan = false;
  for (const auto& g : grads) {
    if (g.numel() == 0) continue;  // max() of nothing throws
    if (inf) {
      const double hi = g.max().item<double>(), lo = g.min().item<double>();  // NaN propagates through both
      nan = nan || std::isnan(hi) || std::isnan(lo);
      const double m = std::max(std::abs(hi), std::abs(lo));
      if (m > local) local = m;
    } else {
      const at::Tensor flat = g.reshape({-1});
      at::Tensor sum = at::zeros({}, flat.options().dtype(at::kDouble));
      for (int64_t off = 0; off < flat.numel(); off += kChunk) {
        const at::Tensor part = flat.narrow(0, off, std::min(kChunk, flat.numel() - off)).to(at::kDouble);
        sum += norm_type == 2.0 ? part.square().sum() : part.abs().pow(norm_type).sum();
      }
      local += sum.item<double>();
    }
  }
  if (partial) {
    Comm& comm = state->shard_comm();  // hybrid replicas hold equal shards: the shard group covers everything once
    if (inf) {
      auto t = at::tensor({local, nan ? 1.0 : 0.0}, at::TensorOptions().dtype(at::kDouble)).to(comm.device());
      comm.all_reduce(t, c10d::ReduceOp::MAX, "clip_grad_norm");
      t = t.cpu();
      local = t[0].item<double>();
      nan = t[1].item<double>() > 0;
    } else {
      auto t = at::full({1}, local, at::TensorOptions().dtype(at::kDouble)).to(comm.device());
      comm.all_reduce(t, c10d::ReduceOp::SUM, "clip_grad_norm");  // a NaN stays NaN in a sum
      local = t.cpu().item<double>();
    }
  }
  const double total = nan ? std::numeric_limits<double>::quiet_NaN() : inf ? local : std::pow(local, 1.0 / norm_type);
  const double coef = max_norm / (total + 1e-6);
  if (!(coef >= 1.0)) {  // a NaN coefficient scales too, as torch's clamp(coef, max=1) does
    for (auto& g : grads) g.mul_(coef);
  }
  return total;
}

}  // namespace shardtorch
