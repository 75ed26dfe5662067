#pragma once
// Internal: clip_grad_norm in two parts, so that a model spread over more
// than one sharded model (a pipeline's stages) can add its other parts'
// contributions before the norm is final (src/parallel/pipeline_clip.cpp).
#include <ATen/ATen.h>

#include <vector>

#include "shardtorch/collectives.h"

namespace shardtorch::detail {

class ShardState;

/// One rank's share of the gradients' norm.
struct GradNorm {
  double norm_type = 2.0;
  bool inf = false;
  /// This rank holds only part of the gradients (the sharded strategies):
  /// the shares are summed (max-ed) over the shard group.
  bool partial = false;
  std::vector<at::Tensor> grads;  // the tensors finish_clip scales
  at::Tensor local;               // 0-d double: the sum of |g|^p, or the largest |g|
  at::Tensor nan;                 // 0-d double: 1 if a gradient holds a NaN
};

/// This rank's share for `state`'s gradients (collective: nothing; reads
/// the gradients after the backward finished).
GradNorm local_grad_norm(ShardState& state, double norm_type);
/// The shares reduced over `comms` in order (sum, or max), the norm, and
/// every gradient scaled by max_norm / (norm + 1e-6) when that is below 1.
/// Returns the norm (NaN if any gradient held a NaN).
double finish_clip(GradNorm& n, double max_norm, const std::vector<Comm*>& comms);

}  // namespace shardtorch::detail
