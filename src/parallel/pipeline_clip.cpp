// Pipeline::clip_grad_norm: the gradient norm of the whole model, which the
// pipeline's stages hold in parts: each rank's share (summed over its
// data-parallel shard group where the gradients are sharded), then summed
// over the pipeline ranks. A parameter tied across stages has equal
// gradients on every holder after the step (sync_tied): only the copy on its
// first stage counts.
#include <c10/core/GradMode.h>

#include <cmath>

#include "optim/grad_norm.h"
#include "parallel/pipeline_runtime.h"
#include "runtime/shard_state.h"

namespace shardtorch::detail {

double PipelineRuntime::clip_grad_norm(double max_norm, double norm_type) {
  c10::NoGradGuard no_grad;
  GradNorm n = local_grad_norm(*state, norm_type);
  if (!n.inf) {
    for (const auto& t : tied) {
      if (t.counted_here || !t.tensor.requires_grad()) continue;
      for (const auto& p : pieces_of(*state, t.tensor)) {
        if (!p.grad.defined()) continue;
        const at::Tensor g = p.grad.to(at::kDouble);
        const at::Tensor share = norm_type == 2.0 ? g.square().sum() : g.abs().pow(norm_type).sum();
        // NoShard: every dp rank holds the whole gradient and none is summed over dp.
        n.local = n.local - share.to(n.local.device());
      }
    }
  }
  std::vector<Comm*> comms;
  if (n.partial) comms.push_back(&state->topology().shard_comm());
  comms.push_back(&pp->comm());
  return finish_clip(n, max_norm, comms);
}

}  // namespace shardtorch::detail
