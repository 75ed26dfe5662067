// Built only against a CUDA LibTorch with a CUDA compiler (CMakeLists.txt);
// src/optim/cuda_adam_none.cpp stands in otherwise.
#include "optim/cuda_adam.h"
#include "base/check.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "../../cuda/fused_adam.h"

namespace shardtorch {

bool fused_adam_cuda_available() { return true; }

namespace detail {

void fused_adam_cuda(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                     const at::Tensor& exp_avg_sq, const at::Tensor& low, const AdamStep& s) {
  const c10::Device dev = param.device();
  for (const at::Tensor* t : {&grad, &exp_avg, &exp_avg_sq}) {
    SHARDTORCH_CHECK(
        t->device() == dev && t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == param.numel(),
        "shardtorch FusedAdam (CUDA): a parameter of ", param.numel(), " elements on ", dev,
        " has a gradient or moment of ", t->numel(), " ", t->scalar_type(), " elements on ", t->device(),
        "; all four must be contiguous fp32 tensors of one size on one device");
  }
  SHARDTORCH_CHECK(!low.defined() || (low.device() == dev && low.scalar_type() == at::kBFloat16 &&
                                      low.is_contiguous() && low.numel() == param.numel()),
                   "shardtorch FusedAdam (CUDA): the bf16 copy of a parameter of ", param.numel(), " elements on ", dev,
                   " must be a contiguous bf16 tensor of its size on the same device");
  c10::cuda::CUDAGuard guard(dev);
  const auto c = cuda::adam_coeffs(s.lr, s.beta1, s.beta2, s.eps, s.weight_decay, s.step, s.decoupled);
  const int err = cuda::fused_adam_launch(
      param.data_ptr<float>(), grad.data_ptr<float>(), exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>(),
      low.defined() ? reinterpret_cast<uint16_t*>(low.data_ptr<at::BFloat16>()) : nullptr, param.numel(), c,
      c10::cuda::getCurrentCUDAStream(dev.index()).stream());
  SHARDTORCH_CHECK(err == 0, "shardtorch FusedAdam (CUDA): kernel launch on ", dev,
                   " failed: ", cuda::fused_adam_error_string(err));
}

}  // namespace detail
}  // namespace shardtorch
