// Runs the kernels of adam_kernels.cpp over ATen's threads; compiled with
// -fopenmp (CMakeLists.txt) so that ATen's inline parallel_for uses them.
#include "base/log.h"
#include "shardtorch/optim/cpu_adam.h"
#include "base/check.h"

#include "optim/adam_kernels.h"
#include "optim/cuda_adam.h"

#include <ATen/Parallel.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>

namespace shardtorch {
namespace {

using Coeffs = cuda::AdamCoeffs;
using detail::kAdamBlock;

// Per call (a few cached CPU-feature checks and a getenv), so that
// SHARDTORCH_ADAM_ISA=avx512-newton|avx512|avx2|default applies whenever it
// is set. One not honoured is said once, not silently: ranks on unlike hosts
// could otherwise update replicated values with different kernels unawares.
detail::AdamKernels chosen() {
  const char* want = std::getenv("SHARDTORCH_ADAM_ISA");
  detail::AdamKernels k = detail::adam_kernels(want);
  if (!k.refused.empty())
    SHARDTORCH_WARN_ONCE("shardtorch: SHARDTORCH_ADAM_ISA='", want, "' ", k.refused, "; the fused CPU Adam uses '",
                         k.name, "'");
  return k;
}

uint16_t* bits(at::BFloat16* low) { return reinterpret_cast<uint16_t*>(low); }  // at::BFloat16 is its 16 bits

}  // namespace

// Elements per parallel_for task. This file is compiled with -fopenmp: ATen's
// parallel_for is inline and OpenMP-based, and without the flag its pragma is
// ignored and every call runs on one thread (measured: 11.7 ms instead of 8.5
// for 16M parameters on the 2-vCPU VM). The runtime is the one LibTorch loads.
constexpr int64_t kGrain = 1 << 15;

void fused_adam_cpu(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, int64_t n, const AdamStep& s,
                    at::BFloat16* low) {
  // Each coefficient computed in double and rounded once. (1 - 0.999f in
  // fp32 is 0.00099998713: exp_avg_sq was 1.3e-5 off torch::optim::Adam's.)
  const Coeffs c = cuda::adam_coeffs(s.lr, s.beta1, s.beta2, s.eps, s.weight_decay, s.step, s.decoupled);
  const detail::AdamKernel kernel = chosen().adam;
  at::parallel_for(0, n, kGrain, [&](int64_t b, int64_t e) {
    kernel(param + b, grad + b, exp_avg + b, exp_avg_sq + b, e - b, c, low ? bits(low + b) : nullptr);
  });
}

std::string fused_adam_isa() { return chosen().name; }

namespace {
// fused_adam_cpu with the gradient given as G (fp32 or bf16) to be divided by
// `divisor`: each block of kAdamBlock is converted into a buffer that stays in
// L1 and updated from there by the same kernel, so the values are those of
// the update after grad = grad.to(fp32) / divisor (what at::div_ computes:
// an fp32 division by the divisor rounded to fp32; none when it is 1).
template <class G>
void fused_adam_cpu_converting(float* param, const G* grad, float divisor, float* exp_avg, float* exp_avg_sq, int64_t n,
                               const AdamStep& s, at::BFloat16* low) {
  const Coeffs c = cuda::adam_coeffs(s.lr, s.beta1, s.beta2, s.eps, s.weight_decay, s.step, s.decoupled);
  const detail::AdamKernel kernel = chosen().adam;
  const bool divide = divisor != 1.0f;
  at::parallel_for(0, n, kGrain, [&](int64_t b, int64_t e) {
    alignas(64) float buf[kAdamBlock];
    for (int64_t i = b; i < e; i += kAdamBlock) {
      const int64_t len = std::min(kAdamBlock, e - i);
      const G* __restrict g = grad + i;
      if (divide) {
        for (int64_t j = 0; j < len; ++j) buf[j] = static_cast<float>(g[j]) / divisor;
      } else {
        for (int64_t j = 0; j < len; ++j) buf[j] = static_cast<float>(g[j]);
      }
      kernel(param + i, buf, exp_avg + i, exp_avg_sq + i, len, c, low ? bits(low + i) : nullptr);
    }
  });
}
}  // namespace

void adam_traffic_roofline(float* a, const float* b, float* c, float* d, int64_t n) {
  const detail::RooflineKernel body = chosen().roofline;  // the instruction set of the Adam kernel chosen here
  at::parallel_for(0, n, kGrain, [&](int64_t lo, int64_t hi) { body(a + lo, b + lo, c + lo, d + lo, hi - lo); });
}

namespace detail {

// Declared in src/runtime/offload.cpp: this file is the one compiled with OpenMP.
void set_thread_parallelism(int threads) {
#ifdef _OPENMP
  omp_set_num_threads(threads);
#else
  (void)threads;
#endif
}

template <class Options, class State, bool Decoupled>
at::Tensor FusedAdamBase<Options, State, Decoupled>::step(LossClosure closure) {
  at::Tensor loss;
  if (closure) {
    c10::AutoGradMode enable(true);
    loss = closure();
  }
  c10::NoGradGuard no_grad;
  check_step();
  for (auto& group : param_groups_)
    for (auto& p : group.params()) update(p, static_cast<Options&>(group.options()));
  return loss;
}

template <class Options, class State, bool Decoupled>
void FusedAdamBase<Options, State, Decoupled>::check_step() const {
  // Everything is checked before anything is updated: a refusal leaves no
  // group stepped and no step counted.
  for (size_t gi = 0; gi < param_groups_.size(); ++gi) {
    const auto& o = static_cast<const Options&>(param_groups_[gi].options());
    const auto [beta1, beta2] = o.betas();
    SHARDTORCH_CHECK(!o.amsgrad(), "shardtorch FusedAdam: group ", gi,
                     ": amsgrad is not supported; use torch::optim::Adam");
    SHARDTORCH_CHECK(
        o.lr() >= 0 && o.eps() >= 0 && o.weight_decay() >= 0 && beta1 >= 0 && beta1 < 1 && beta2 >= 0 && beta2 < 1,
        "shardtorch FusedAdam: group ", gi, ": need lr, eps, weight_decay >= 0 and 0 <= betas < 1, got lr ", o.lr(),
        ", eps ", o.eps(), ", weight_decay ", o.weight_decay(), ", betas (", beta1, ", ", beta2, ")");
    for (const auto& p : param_groups_[gi].params()) {
      if (!p.grad().defined()) continue;
      const bool on_device = p.is_cuda() && fused_adam_cuda_available();
      SHARDTORCH_CHECK(p.scalar_type() == at::kFloat && (p.device().is_cpu() || on_device) && p.is_contiguous() &&
                           p.grad().is_contiguous() && p.grad().scalar_type() == at::kFloat &&
                           p.grad().numel() == p.numel() && p.grad().device() == p.device(),
                       "shardtorch FusedAdam: group ", gi,
                       ": needs contiguous fp32 parameters and gradients of the "
                       "same size on one device (the CPU, or CUDA in a build with CUDA kernels), got a ",
                       p.scalar_type(), " parameter of ", p.numel(), " on ", p.device(), " with a ",
                       p.grad().scalar_type(), " gradient of ", p.grad().numel(), " on ", p.grad().device());
      auto it = state_.find(p.unsafeGetTensorImpl());
      if (it == state_.end()) continue;
      const auto& s = static_cast<const State&>(*it->second);
      for (const at::Tensor& m : {s.exp_avg(), s.exp_avg_sq()})
        SHARDTORCH_CHECK(m.defined() && m.scalar_type() == at::kFloat && m.device() == p.device() &&
                             m.is_contiguous() && m.numel() == p.numel(),
                         "shardtorch FusedAdam: group ", gi, ": a parameter of ", p.numel(), " elements on ",
                         p.device(), " has moments that are not contiguous fp32 tensors of its size on its device");
    }
  }
}

template <class Options, class State, bool Decoupled>
void FusedAdamBase<Options, State, Decoupled>::step_params(const std::vector<at::Tensor>& params) {
  c10::NoGradGuard no_grad;
  for (const auto& want : params)
    for (auto& group : param_groups_)
      for (auto& p : group.params())
        if (p.unsafeGetTensorImpl() == want.unsafeGetTensorImpl()) update(p, static_cast<Options&>(group.options()));
}

template <class Options, class State, bool Decoupled>
bool FusedAdamBase<Options, State, Decoupled>::step_params_with(const std::vector<at::Tensor>& params,
                                                                const std::vector<at::Tensor>& grads, double divisor) {
  c10::NoGradGuard no_grad;
  SHARDTORCH_CHECK(params.size() == grads.size(), "shardtorch FusedAdam: step_params_with got ", params.size(),
                   " parameters and ", grads.size(), " gradients");
  // Everything is looked at before anything is updated.
  std::vector<std::pair<at::Tensor*, const Options*>> found;
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& g = grads[i];
    const at::Tensor& want = params[i];
    if (!(g.defined() && want.device().is_cpu() && g.device().is_cpu() && want.scalar_type() == at::kFloat &&
          (g.scalar_type() == at::kFloat || g.scalar_type() == at::kBFloat16) && g.is_contiguous() &&
          want.is_contiguous() && g.numel() == want.numel()))
      return false;
    at::Tensor* hit = nullptr;
    const Options* options = nullptr;
    for (auto& group : param_groups_)
      for (auto& p : group.params())
        if (p.unsafeGetTensorImpl() == want.unsafeGetTensorImpl()) {
          hit = &p;
          options = &static_cast<const Options&>(group.options());
        }
    if (hit == nullptr) return false;
    found.emplace_back(hit, options);
  }
  for (size_t i = 0; i < found.size(); ++i) update_from(*found[i].first, grads[i], divisor, *found[i].second);
  return true;
}

template <class Options, class State, bool Decoupled>
void FusedAdamBase<Options, State, Decoupled>::update(at::Tensor& p, const Options& o) {
  if (!p.grad().defined()) return;
  update_from(p, p.grad(), 1.0, o);
}

template <class Options, class State, bool Decoupled>
void FusedAdamBase<Options, State, Decoupled>::update_from(at::Tensor& p, const at::Tensor& grad, double divisor,
                                                           const Options& o) {
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
  AdamStep a{o.lr(), std::get<0>(o.betas()), std::get<1>(o.betas()), o.eps(), o.weight_decay(), s.step(), Decoupled};
  auto low = low_.find(p.unsafeGetTensorImpl());
  if (p.is_cuda()) {  // step_params_with refuses CUDA parameters: grad is p.grad()
    fused_adam_cuda(p, grad, s.exp_avg(), s.exp_avg_sq(), low == low_.end() ? at::Tensor() : low->second, a);
    return;
  }
  float* m = s.exp_avg().template data_ptr<float>();
  float* v = s.exp_avg_sq().template data_ptr<float>();
  at::BFloat16* l = low == low_.end() ? nullptr : low->second.template data_ptr<at::BFloat16>();
  const auto d = static_cast<float>(divisor);
  if (grad.scalar_type() == at::kBFloat16) {
    fused_adam_cpu_converting(p.data_ptr<float>(), grad.data_ptr<at::BFloat16>(), d, m, v, p.numel(), a, l);
  } else if (divisor != 1.0) {
    fused_adam_cpu_converting(p.data_ptr<float>(), grad.data_ptr<float>(), d, m, v, p.numel(), a, l);
  } else {
    fused_adam_cpu(p.data_ptr<float>(), grad.data_ptr<float>(), m, v, p.numel(), a, l);
  }
}

template <class Options, class State, bool Decoupled>
void FusedAdamBase<Options, State, Decoupled>::write_low_copy(const at::Tensor& param, at::Tensor low) {
  SHARDTORCH_CHECK(low.scalar_type() == at::kBFloat16 && low.device() == param.device() && low.is_contiguous() &&
                       low.numel() == param.numel(),
                   "shardtorch FusedAdam: the low-precision copy of a parameter of ", param.numel(), " elements on ",
                   param.device(), " must be a contiguous bf16 tensor of its size on its device, got ",
                   low.scalar_type(), " of ", low.numel(), " on ", low.device());
  low_[param.unsafeGetTensorImpl()] = std::move(low);
}

template class FusedAdamBase<torch::optim::AdamOptions, torch::optim::AdamParamState, false>;
template class FusedAdamBase<torch::optim::AdamWOptions, torch::optim::AdamWParamState, true>;

}  // namespace detail
}  // namespace shardtorch
