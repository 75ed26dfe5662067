#pragma once
// One Adam/AdamW element update, shared by the CUDA kernel (fused_adam.cu)
// and its host reference (tests): the arithmetic and its order are those of
// shardtorch's fused CPU Adam (src/optim/adam_kernels.cpp), coefficient for
// coefficient, so the two differ only by the hardware's fp32 rounding of
// sqrt and division (and FMA contraction).
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define SHARDTORCH_HD __host__ __device__ __forceinline__
#else
#define SHARDTORCH_HD inline
#endif

namespace shardtorch::cuda {

/// Coefficients of one step, each computed in double and rounded once
/// (adam_coeffs), as the CPU kernel does.
struct AdamCoeffs {
  float beta1, one_minus_beta1, beta2, one_minus_beta2, eps, step_size, inv_sqrt_bc2, decay, wd;
  int decoupled;  // AdamW (decay the parameter) or Adam (decay added to the gradient)
};

/// `step` counts from 1. Host only: the kernel receives the result.
inline AdamCoeffs adam_coeffs(double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step,
                              bool decoupled) {
  const double bc1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  auto f = [](double x) { return static_cast<float>(x); };
  return AdamCoeffs{f(beta1), f(1.0 - beta1), f(beta2), f(1.0 - beta2), f(eps), f(lr / bc1),
                    f(1.0 / std::sqrt(bc2)), f(1.0 - lr * weight_decay), f(weight_decay), decoupled ? 1 : 0};
}

/// Updates p, m and v in place from g.
SHARDTORCH_HD void adam_element(float& p, float g, float& m, float& v, const AdamCoeffs& c) {
  float param = p;
  if (c.decoupled) {
    param = param * c.decay;
  } else {
    g = g + c.wd * param;
  }
  const float mi = m * c.beta1 + g * c.one_minus_beta1;
  const float vi = v * c.beta2 + c.one_minus_beta2 * g * g;
  m = mi;
  v = vi;
  p = param - c.step_size * (mi / (sqrtf(vi) * c.inv_sqrt_bc2 + c.eps));
}

/// fp32 -> bf16 bits, rounded to nearest even, NaN kept a quiet NaN (as
/// at::BFloat16(float) and the CPU kernel round).
SHARDTORCH_HD uint16_t bf16_bits(float x) {
#if defined(__CUDA_ARCH__)
  const uint32_t u = __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
#endif
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7fffffffu) > 0x7f800000u ? uint16_t{0x7fc0} : static_cast<uint16_t>(rounded);
}

}  // namespace shardtorch::cuda
