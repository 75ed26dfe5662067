#pragma once
// The fused CPU Adam's element loops, one per instruction set, with no
// LibTorch header: src/optim/cpu_adam.cpp runs them over ATen's threads, and
// tests/cross_compile_cpu_adam.sh compiles this file alone for aarch64.
#include <cstdint>
#include <string>

#include "../../cuda/adam_math.h"

namespace shardtorch::detail {

/// Elements a kernel updates before it writes their bf16 copy (4 KiB of
/// each array): the copy reads parameters still in L1.
constexpr int64_t kAdamBlock = 1024;

/// Updates n elements of p, m and v from g as torch::optim::Adam(W) does;
/// with `low`, writes p's new values there too, as bf16 bits rounded to
/// nearest even.
using AdamKernel = void (*)(float* p, const float* g, float* m, float* v, int64_t n, cuda::AdamCoeffs c, uint16_t* low);
/// Adds b to a, c and d: the memory traffic of an Adam update, for a roofline.
using RooflineKernel = void (*)(float* a, const float* b, float* c, float* d, int64_t n);

struct AdamKernels {
  AdamKernel adam;
  RooflineKernel roofline;  // of the same instruction set
  std::string name;         // avx512-newton, avx512, avx2 or default
  std::string refused;      // empty, or why `want` was not honoured
};

/// The variant for this CPU, or `want` (SHARDTORCH_ADAM_ISA's value; null:
/// none) where this CPU has it. The choice depends only on the CPU model.
AdamKernels adam_kernels(const char* want);

}  // namespace shardtorch::detail
