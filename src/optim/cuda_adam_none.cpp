// Stands in for src/optim/cuda_adam.cpp in a build without CUDA kernels.
#include "optim/cuda_adam.h"
#include "base/check.h"

namespace shardtorch {

bool fused_adam_cuda_available() { return false; }

namespace detail {

void fused_adam_cuda(const at::Tensor& param, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                     const at::Tensor&, const AdamStep&) {
  SHARDTORCH_CHECK(false, "shardtorch FusedAdam: a parameter of ", param.numel(), " elements is on ", param.device(),
                   ", but this shardtorch was built without CUDA kernels (against a CPU LibTorch, or without a CUDA "
                   "compiler); rebuild against a CUDA LibTorch with nvcc on PATH, or use shardtorch::AdamW");
}

}  // namespace detail
}  // namespace shardtorch
