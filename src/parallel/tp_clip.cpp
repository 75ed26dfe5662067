// clip_grad_norm of a tensor-parallel model (shardtorch/tensor_parallel.h):
// a split parameter's slices are summed over the group, a whole one (outside
// the plan, equal on every rank) counted once: each rank's share of those
// is divided by the group's size before the sum.
#include <c10/core/GradMode.h>

#include <set>

#include "base/check.h"
#include "optim/grad_norm.h"
#include "parallel/param_pieces.h"
#include "runtime/placement.h"
#include "runtime/shard_state.h"
#include "shardtorch/tensor_parallel.h"

namespace shardtorch {

double clip_grad_norm(torch::nn::Module& root, const std::shared_ptr<World>& tp, double max_norm, double norm_type) {
  SHARDTORCH_CHECK(tp, "shardtorch::clip_grad_norm: no tensor-parallel World");
  auto state = detail::require_state(root, "clip_grad_norm");
  c10::NoGradGuard no_grad;
  detail::GradNorm n = detail::local_grad_norm(*state, norm_type);
  if (!n.inf && tp->size() > 1) {
    const double keep = 1.0 / tp->size();
    std::set<const void*> seen;
    for (auto& item : root.named_parameters(/*recurse=*/true)) {
      const at::Tensor& p = item.value();
      if (!p.requires_grad() || detail::placement_of(p) || !seen.insert(p.unsafeGetTensorImpl()).second) continue;
      for (const auto& piece : detail::pieces_of(*state, p)) {
        if (!piece.grad.defined()) continue;
        const at::Tensor g = piece.grad.to(at::kDouble);
        const at::Tensor share = norm_type == 2.0 ? g.square().sum() : g.abs().pow(norm_type).sum();
        n.local = n.local - share.to(n.local.device()) * (1.0 - keep);
      }
    }
  }
  std::vector<Comm*> comms;
  if (n.partial) comms.push_back(&state->topology().shard_comm());
  comms.push_back(&tp->comm());
  return detail::finish_clip(n, max_norm, comms);
}

}  // namespace shardtorch
