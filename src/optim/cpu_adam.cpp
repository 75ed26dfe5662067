// Built with -O3 (CMakeLists.txt) so that each target clone is vectorised.
#include "shardtorch/optim/cpu_adam.h"

#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

namespace shardtorch {
namespace {

struct Coeffs {
  float beta1, one_minus_beta1, beta2, one_minus_beta2, eps, step_size, inv_sqrt_bc2, decay, wd;
  bool decoupled;
};

// The same arithmetic, in the same order, as torch::optim::Adam(W), except
// that 1/sqrt(bias correction 2) multiplies instead of dividing. Inlined into
// one wrapper per instruction set, where it is vectorised.
__attribute__((always_inline)) inline void adam_loop(float* __restrict p, const float* __restrict g,
                                                     float* __restrict m, float* __restrict v, int64_t n,
                                                     const Coeffs& c) {
  if (c.decoupled) {
    for (int64_t i = 0; i < n; ++i) {
      float param = p[i] * c.decay;
      float grad = g[i];
      float mi = m[i] * c.beta1 + grad * c.one_minus_beta1;
      float vi = v[i] * c.beta2 + c.one_minus_beta2 * grad * grad;
      m[i] = mi;
      v[i] = vi;
      p[i] = param - c.step_size * (mi / (std::sqrt(vi) * c.inv_sqrt_bc2 + c.eps));
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      float param = p[i];
      float grad = g[i] + c.wd * param;
      float mi = m[i] * c.beta1 + grad * c.one_minus_beta1;
      float vi = v[i] * c.beta2 + c.one_minus_beta2 * grad * grad;
      m[i] = mi;
      v[i] = vi;
      p[i] = param - c.step_size * (mi / (std::sqrt(vi) * c.inv_sqrt_bc2 + c.eps));
    }
  }
}

// Elements updated before their bf16 copy is written: 4 KiB of each array,
// so the copy reads parameters the update has just left in L1 and memory is
// crossed once.
constexpr int64_t kLowBlock = 1024;

// fp32 -> bf16 bits, rounded to nearest even, NaN kept a (quiet) NaN: what
// at::BFloat16(float) gives, without its branch, so the loop vectorises.
__attribute__((always_inline)) inline uint16_t bf16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7fffffffu) > 0x7f800000u ? uint16_t{0x7fc0} : static_cast<uint16_t>(rounded);
}

__attribute__((always_inline)) inline void adam_body(float* __restrict p, const float* __restrict g,
                                                     float* __restrict m, float* __restrict v, int64_t n,
                                                     Coeffs c, at::BFloat16* __restrict low) {
  if (low == nullptr) {
    adam_loop(p, g, m, v, n, c);
    return;
  }
  uint16_t* __restrict out = reinterpret_cast<uint16_t*>(low);  // at::BFloat16 is its 16 bits
  for (int64_t b = 0; b < n; b += kLowBlock) {
    const int64_t len = std::min(kLowBlock, n - b);
    adam_loop(p + b, g + b, m + b, v + b, len, c);
    for (int64_t i = b; i < b + len; ++i) out[i] = bf16_bits(p[i]);
  }
}

using Kernel = void (*)(float*, const float*, float*, float*, int64_t, Coeffs, at::BFloat16*);

__attribute__((target("avx512f,avx512bw,avx512vl,fma"))) void adam_avx512(
    float* p, const float* g, float* m, float* v, int64_t n, Coeffs c, at::BFloat16* low) {
  adam_body(p, g, m, v, n, c, low);
}
__attribute__((target("avx2,fma"))) void adam_avx2(float* p, const float* g, float* m, float* v, int64_t n,
                                                   Coeffs c, at::BFloat16* low) {
  adam_body(p, g, m, v, n, c, low);
}
void adam_default(float* p, const float* g, float* m, float* v, int64_t n, Coeffs c, at::BFloat16* low) {
  adam_body(p, g, m, v, n, c, low);
}

// The variant for this CPU: the widest it has (measured in the library on the
// AMD EPYC development VM, AVX-512 beat AVX2+FMA: docs/benchmarks.md);
// SHARDTORCH_ADAM_ISA=avx512|avx2|default overrides, for benchmarking.
struct Choice {
  Kernel kernel;
  std::string name;
};
Choice choose() {
  __builtin_cpu_init();
  const bool has512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma");
  const bool has2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (const char* want = std::getenv("SHARDTORCH_ADAM_ISA")) {
    std::string w = want;
    if (w == "avx512" && has512) return {adam_avx512, "avx512"};
    if (w == "avx2" && has2) return {adam_avx2, "avx2"};
    if (w == "default") return {adam_default, "default"};
  }
  if (has512) return {adam_avx512, "avx512"};
  if (has2) return {adam_avx2, "avx2"};
  return {adam_default, "default"};
}
// Per call (a few cached CPU-feature checks and a getenv), so the override
// applies whenever it is set.
Choice chosen() { return choose(); }

}  // namespace

// Elements per parallel_for task. This file is compiled with -fopenmp: ATen's
// parallel_for is inline and OpenMP-based, and without the flag its pragma is
// ignored and every call runs on one thread (measured: 11.7 ms instead of 8.5
// for 16M parameters on the 2-vCPU VM). The runtime is the one LibTorch loads.
constexpr int64_t kGrain = 1 << 15;

void fused_adam_cpu(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, int64_t n, const AdamStep& s,
                    at::BFloat16* low) {
  const double bc1 = 1.0 - std::pow(s.beta1, static_cast<double>(s.step));
  const double bc2 = 1.0 - std::pow(s.beta2, static_cast<double>(s.step));
  // Each coefficient computed in double and rounded once. (1 - 0.999f in
  // fp32 is 0.00099998713: exp_avg_sq was 1.3e-5 off torch::optim::Adam's.)
  auto f = [](double x) { return static_cast<float>(x); };
  Coeffs c{f(s.beta1), f(1.0 - s.beta1), f(s.beta2), f(1.0 - s.beta2), f(s.eps), f(s.lr / bc1),
           f(1.0 / std::sqrt(bc2)), f(1.0 - s.lr * s.weight_decay), f(s.weight_decay), s.decoupled};
  const Kernel kernel = chosen().kernel;
  at::parallel_for(0, n, kGrain, [&](int64_t b, int64_t e) {
    kernel(param + b, grad + b, exp_avg + b, exp_avg_sq + b, e - b, c, low ? low + b : nullptr);
  });
}

std::string fused_adam_isa() { return chosen().name; }

namespace {
__attribute__((always_inline)) inline void roofline_body(float* __restrict a, const float* __restrict b,
                                                         float* __restrict c, float* __restrict d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float x = b[i];
    a[i] += x;
    c[i] += x;
    d[i] += x;
  }
}
}  // namespace

__attribute__((target("avx512f,avx512bw,avx512vl,fma"))) void roofline_avx512(float* a, const float* b, float* c,
                                                                                float* d, int64_t n) {
  roofline_body(a, b, c, d, n);
}
__attribute__((target("avx2,fma"))) void roofline_avx2(float* a, const float* b, float* c, float* d, int64_t n) {
  roofline_body(a, b, c, d, n);
}
void roofline_default(float* a, const float* b, float* c, float* d, int64_t n) { roofline_body(a, b, c, d, n); }

void adam_traffic_roofline(float* a, const float* b, float* c, float* d, int64_t n) {
  // The same instruction set as the Adam kernel chosen here.
  const std::string isa = chosen().name;
  auto body = isa == "avx512" ? roofline_avx512 : isa == "avx2" ? roofline_avx2 : roofline_default;
  at::parallel_for(0, n, kGrain, [&](int64_t lo, int64_t hi) { body(a + lo, b + lo, c + lo, d + lo, hi - lo); });
}

namespace detail {

template <class Options, class State, bool Decoupled>
at::Tensor FusedAdamBase<Options, State, Decoupled>::step(LossClosure closure) {
  at::Tensor loss;
  if (closure) {
    c10::AutoGradMode enable(true);
    loss = closure();
  }
  c10::NoGradGuard no_grad;
  // Everything is checked before anything is updated: a refusal leaves no
  // group stepped and no step counted.
  for (size_t gi = 0; gi < param_groups_.size(); ++gi) {
    const auto& o = static_cast<const Options&>(param_groups_[gi].options());
    const auto [beta1, beta2] = o.betas();
    TORCH_CHECK(!o.amsgrad(), "shardtorch FusedAdam: group ", gi, ": amsgrad is not supported; use torch::optim::Adam");
    TORCH_CHECK(o.lr() >= 0 && o.eps() >= 0 && o.weight_decay() >= 0 && beta1 >= 0 && beta1 < 1 && beta2 >= 0 &&
                    beta2 < 1,
                "shardtorch FusedAdam: group ", gi, ": need lr, eps, weight_decay >= 0 and 0 <= betas < 1, got lr ",
                o.lr(), ", eps ", o.eps(), ", weight_decay ", o.weight_decay(), ", betas (", beta1, ", ", beta2, ")");
    for (const auto& p : param_groups_[gi].params()) {
      if (!p.grad().defined()) continue;
      TORCH_CHECK(p.scalar_type() == at::kFloat && p.device().is_cpu() && p.is_contiguous() &&
                      p.grad().is_contiguous() && p.grad().scalar_type() == at::kFloat &&
                      p.grad().numel() == p.numel(),
                  "shardtorch FusedAdam: group ", gi, ": needs contiguous fp32 CPU parameters and gradients of the "
                  "same size, got a ", p.scalar_type(), " parameter of ", p.numel(), " on ", p.device(), " with a ",
                  p.grad().scalar_type(), " gradient of ", p.grad().numel());
      auto it = state_.find(p.unsafeGetTensorImpl());
      if (it == state_.end()) continue;
      const auto& s = static_cast<const State&>(*it->second);
      for (const at::Tensor& m : {s.exp_avg(), s.exp_avg_sq()})
        TORCH_CHECK(m.defined() && m.scalar_type() == at::kFloat && m.device().is_cpu() && m.is_contiguous() &&
                        m.numel() == p.numel(),
                    "shardtorch FusedAdam: group ", gi, ": a parameter of ", p.numel(),
                    " elements has moments that are not contiguous fp32 CPU tensors of its size");
    }
  }
  for (auto& group : param_groups_) {
    auto& o = static_cast<Options&>(group.options());
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      auto& slot = state_[p.unsafeGetTensorImpl()];
      if (!slot) {
        auto s = std::make_unique<State>();
        s->step(0);
        s->exp_avg(at::zeros_like(p, at::MemoryFormat::Contiguous));
        s->exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Contiguous));
        slot = std::move(s);
      }
      auto& s = static_cast<State&>(*slot);
      s.step(s.step() + 1);
      AdamStep a{o.lr(), std::get<0>(o.betas()), std::get<1>(o.betas()), o.eps(), o.weight_decay(), s.step(),
                 Decoupled};
      fused_adam_cpu(p.data_ptr<float>(), p.grad().data_ptr<float>(), s.exp_avg().template data_ptr<float>(),
                     s.exp_avg_sq().template data_ptr<float>(), p.numel(), a);
    }
  }
  return loss;
}

template class FusedAdamBase<torch::optim::AdamOptions, torch::optim::AdamParamState, false>;
template class FusedAdamBase<torch::optim::AdamWOptions, torch::optim::AdamWParamState, true>;

}  // namespace detail
}  // namespace shardtorch
