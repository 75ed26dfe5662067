#pragma once
// Gradient clipping over a sharded model, equal to clipping the unsharded
// gradients with torch::nn::utils::clip_grad_norm_.
#include <torch/nn/module.h>

#include "shardtorch/export.h"

namespace shardtorch {

/// Collective. Computes the norm_type-norm (2, any p > 0, or infinity) of all
/// gradients of the sharded model, scales every gradient by
/// max_norm / (norm + 1e-6) when that is below 1, and returns the norm.
SHARDTORCH_API double clip_grad_norm(torch::nn::Module& root, double max_norm, double norm_type = 2.0);

}  // namespace shardtorch
