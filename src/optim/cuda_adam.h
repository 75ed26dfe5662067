#pragma once
// Internal: the fused CUDA Adam/AdamW (cuda/fused_adam.cu) behind FusedAdam(W)
// when the optimized tensors are on a CUDA device. In a build without CUDA
// kernels (a CPU LibTorch) fused_adam_cuda_available() is false and
// fused_adam_cuda throws.
#include <ATen/core/Tensor.h>

#include "shardtorch/optim/cpu_adam.h"

namespace shardtorch::detail {

/// One update of `param` (contiguous fp32 on a CUDA device) from `grad`, with
/// both moments on the same device, queued on the device's current stream;
/// `low`, if defined, receives the updated values as bf16.
void fused_adam_cuda(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                     const at::Tensor& exp_avg_sq, const at::Tensor& low, const AdamStep& s);

}  // namespace shardtorch::detail
