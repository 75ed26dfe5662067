// Built with -O3 (CMakeLists.txt) so that each target clone is vectorised.
// On x86-64 the AVX-512 and AVX2 variants are chosen at run time; elsewhere
// (aarch64) the one portable variant runs, vectorised by the compiler for the
// target's baseline (NEON on aarch64).
#include "base/log.h"
#include "shardtorch/optim/cpu_adam.h"
#include "base/check.h"

#include "../../cuda/adam_math.h"
#include "optim/cuda_adam.h"

#include <ATen/Parallel.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>

#if defined(__x86_64__) || defined(__i386__)
#define SHARDTORCH_ADAM_X86 1
#include <immintrin.h>
#else
#define SHARDTORCH_ADAM_X86 0
#endif

namespace shardtorch {
namespace {

// Computed once per step by cuda::adam_coeffs, which the CUDA kernel shares.
using Coeffs = cuda::AdamCoeffs;

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
                                                     float* __restrict m, float* __restrict v, int64_t n, Coeffs c,
                                                     at::BFloat16* __restrict low) {
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

void adam_default(float* p, const float* g, float* m, float* v, int64_t n, Coeffs c, at::BFloat16* low) {
  adam_body(p, g, m, v, n, c, low);
}

#if SHARDTORCH_ADAM_X86

// The Newton variant (on Intel cores with AVX-512): the moments as adam_loop
// computes them; sqrt(v) and the division from the 14-bit estimates
// (vrsqrt14ps, vrcp14ps) refined by one Newton step each, a few ulp from the
// exact quotient. Where sqrt and div are slow (AVX-512 on Intel cores: about
// 12 and 10 cycles a vector) this is several times fewer cycles; on AMD Zen 4
// the estimates cost more than they save (docs/benchmarks.md).
struct NewtonConsts {
  __m512 beta1, omb1, beta2, omb2, eps, step, ibc, decay, wd, half, three_halves, two, tiny, inf;
};

template <bool Tail>
__attribute__((target("avx512f,avx512bw,avx512vl,fma"), always_inline)) inline __m512 load16(const float* a,
                                                                                             __mmask16 k) {
  return Tail ? _mm512_maskz_loadu_ps(k, a) : _mm512_loadu_ps(a);
}

// One vector of 16 at i; `k` masks the tail (loads and stores in the main
// loop are plain: masked ones cost where memory is the bound).
template <bool Tail>
__attribute__((target("avx512f,avx512bw,avx512vl,fma"), always_inline)) inline void newton_vector(
    float* __restrict p, const float* __restrict g, float* __restrict m, float* __restrict v, int64_t i, __mmask16 k,
    bool decoupled, const NewtonConsts& c) {
  __m512 param = load16<Tail>(p + i, k), grad = load16<Tail>(g + i, k);
  if (decoupled) {
    param = _mm512_mul_ps(param, c.decay);
  } else {
    grad = _mm512_fmadd_ps(c.wd, param, grad);
  }
  const __m512 mi = _mm512_fmadd_ps(load16<Tail>(m + i, k), c.beta1, _mm512_mul_ps(grad, c.omb1));
  const __m512 vi = _mm512_fmadd_ps(load16<Tail>(v + i, k), c.beta2, _mm512_mul_ps(_mm512_mul_ps(c.omb2, grad), grad));
  __m512 r = _mm512_rsqrt14_ps(vi);  // 1/sqrt(v), then one Newton step: r (3/2 - v r^2 / 2)
  r = _mm512_mul_ps(r, _mm512_fnmadd_ps(_mm512_mul_ps(_mm512_mul_ps(c.half, vi), r), r, c.three_halves));
  const __m512 sq = _mm512_maskz_mul_ps(_mm512_cmp_ps_mask(vi, c.tiny, _CMP_GE_OQ), vi, r);  // sqrt(v) = v / sqrt(v)
  const __m512 d = _mm512_fmadd_ps(sq, c.ibc, c.eps);
  __m512 q = _mm512_rcp14_ps(d);  // 1/d, then one Newton step: q (2 - d q)
  q = _mm512_mul_ps(q, _mm512_fnmadd_ps(d, q, c.two));
  // v = inf: the estimates give 0 * inf = NaN; sqrt(v) is inf and m / inf
  // is 0 (the exact update leaves the parameter as it is), so 1/d is 0.
  q = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(vi, c.inf, _CMP_EQ_OQ), q, _mm512_setzero_ps());
  const __m512 out = _mm512_fnmadd_ps(c.step, _mm512_mul_ps(mi, q), param);
  if (Tail) {
    _mm512_mask_storeu_ps(m + i, k, mi);
    _mm512_mask_storeu_ps(v + i, k, vi);
    _mm512_mask_storeu_ps(p + i, k, out);
  } else {
    _mm512_storeu_ps(m + i, mi);
    _mm512_storeu_ps(v + i, vi);
    _mm512_storeu_ps(p + i, out);
  }
}

__attribute__((target("avx512f,avx512bw,avx512vl,fma"))) void adam_avx512_newton_loop(float* __restrict p,
                                                                                      const float* __restrict g,
                                                                                      float* __restrict m,
                                                                                      float* __restrict v, int64_t n,
                                                                                      const Coeffs& c) {
  const NewtonConsts k{_mm512_set1_ps(c.beta1),
                       _mm512_set1_ps(c.one_minus_beta1),
                       _mm512_set1_ps(c.beta2),
                       _mm512_set1_ps(c.one_minus_beta2),
                       _mm512_set1_ps(c.eps),
                       _mm512_set1_ps(c.step_size),
                       _mm512_set1_ps(c.inv_sqrt_bc2),
                       _mm512_set1_ps(c.decay),
                       _mm512_set1_ps(c.wd),
                       _mm512_set1_ps(0.5f),
                       _mm512_set1_ps(1.5f),
                       _mm512_set1_ps(2.0f),
                       _mm512_set1_ps(1.17549435e-38f),  // FLT_MIN: below it, sqrt(v) is taken as 0
                       _mm512_set1_ps(std::numeric_limits<float>::infinity())};
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {  // two vectors an iteration: more loads in flight where memory bounds it
    newton_vector<false>(p, g, m, v, i, 0xffff, c.decoupled, k);
    newton_vector<false>(p, g, m, v, i + 16, 0xffff, c.decoupled, k);
  }
  for (; i + 16 <= n; i += 16) newton_vector<false>(p, g, m, v, i, 0xffff, c.decoupled, k);
  if (i < n) newton_vector<true>(p, g, m, v, i, static_cast<__mmask16>((1u << (n - i)) - 1), c.decoupled, k);
}

__attribute__((target("avx512f,avx512bw,avx512vl,fma"))) void adam_avx512_newton(float* p, const float* g, float* m,
                                                                                 float* v, int64_t n, Coeffs c,
                                                                                 at::BFloat16* low) {
  if (low == nullptr) {
    adam_avx512_newton_loop(p, g, m, v, n, c);
    return;
  }
  uint16_t* __restrict out = reinterpret_cast<uint16_t*>(low);
  for (int64_t b = 0; b < n; b += kLowBlock) {
    const int64_t len = std::min(kLowBlock, n - b);
    adam_avx512_newton_loop(p + b, g + b, m + b, v + b, len, c);
    for (int64_t i = b; i < b + len; ++i) out[i] = bf16_bits(p[i]);
  }
}

__attribute__((target("avx512f,avx512bw,avx512vl,fma"))) void adam_avx512(float* p, const float* g, float* m, float* v,
                                                                          int64_t n, Coeffs c, at::BFloat16* low) {
  adam_body(p, g, m, v, n, c, low);
}
__attribute__((target("avx2,fma"))) void adam_avx2(float* p, const float* g, float* m, float* v, int64_t n, Coeffs c,
                                                   at::BFloat16* low) {
  adam_body(p, g, m, v, n, c, low);
}
#endif  // SHARDTORCH_ADAM_X86

// The variant for this CPU: the widest it has (measured in the library on the
// AMD EPYC development VM, AVX-512 beat AVX2+FMA: docs/benchmarks.md), and on
// Intel cores with AVX-512 the Newton variant (1.3x faster where the data is
// in cache, the same where memory bounds it; slower on AMD Zen 4). The choice
// depends only on the CPU model, so ranks on like machines update alike.
// SHARDTORCH_ADAM_ISA=avx512-newton|avx512|avx2|default overrides.
struct Choice {
  Kernel kernel;
  std::string name;
};
Choice choose() {
#if SHARDTORCH_ADAM_X86
  __builtin_cpu_init();
  const bool has512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma");
  const bool has2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  auto automatic = [&]() -> Choice {
    if (has512 && __builtin_cpu_is("intel")) return {adam_avx512_newton, "avx512-newton"};
    if (has512) return {adam_avx512, "avx512"};
    if (has2) return {adam_avx2, "avx2"};
    return {adam_default, "default"};
  };
#else
  auto automatic = []() -> Choice { return {adam_default, "default"}; };
#endif
  const char* want = std::getenv("SHARDTORCH_ADAM_ISA");
  if (want == nullptr) return automatic();
  const std::string w = want;
#if SHARDTORCH_ADAM_X86
  if (w == "avx512" && has512) return {adam_avx512, "avx512"};
  if (w == "avx512-newton" && has512) return {adam_avx512_newton, "avx512-newton"};
  if (w == "avx2" && has2) return {adam_avx2, "avx2"};
#endif
  if (w == "default") return {adam_default, "default"};
  // Not honoured: said once, not silently (ranks on unlike hosts could
  // otherwise update replicated values with different kernels unawares).
  Choice c = automatic();
  const bool known = w == "avx512" || w == "avx512-newton" || w == "avx2";
  SHARDTORCH_WARN_ONCE("shardtorch: SHARDTORCH_ADAM_ISA='", w, "' ",
                       known ? "is not supported by this CPU" : "is not one of avx512-newton, avx512, avx2, default",
                       "; the fused CPU Adam uses '", c.name, "'");
  return c;
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
  // Each coefficient computed in double and rounded once. (1 - 0.999f in
  // fp32 is 0.00099998713: exp_avg_sq was 1.3e-5 off torch::optim::Adam's.)
  const Coeffs c = cuda::adam_coeffs(s.lr, s.beta1, s.beta2, s.eps, s.weight_decay, s.step, s.decoupled);
  const Kernel kernel = chosen().kernel;
  at::parallel_for(0, n, kGrain, [&](int64_t b, int64_t e) {
    kernel(param + b, grad + b, exp_avg + b, exp_avg_sq + b, e - b, c, low ? low + b : nullptr);
  });
}

std::string fused_adam_isa() { return chosen().name; }

namespace {
// fused_adam_cpu with the gradient given as G (fp32 or bf16) to be divided by
// `divisor`: each block of kLowBlock is converted into a buffer that stays in
// L1 and updated from there by the same kernel, so the values are those of
// the update after grad = grad.to(fp32) / divisor (what at::div_ computes:
// an fp32 division by the divisor rounded to fp32; none when it is 1).
template <class G>
void fused_adam_cpu_converting(float* param, const G* grad, float divisor, float* exp_avg, float* exp_avg_sq, int64_t n,
                               const AdamStep& s, at::BFloat16* low) {
  const Coeffs c = cuda::adam_coeffs(s.lr, s.beta1, s.beta2, s.eps, s.weight_decay, s.step, s.decoupled);
  const Kernel kernel = chosen().kernel;
  const bool divide = divisor != 1.0f;
  at::parallel_for(0, n, kGrain, [&](int64_t b, int64_t e) {
    alignas(64) float buf[kLowBlock];
    for (int64_t i = b; i < e; i += kLowBlock) {
      const int64_t len = std::min(kLowBlock, e - i);
      const G* __restrict g = grad + i;
      if (divide) {
        for (int64_t j = 0; j < len; ++j) buf[j] = static_cast<float>(g[j]) / divisor;
      } else {
        for (int64_t j = 0; j < len; ++j) buf[j] = static_cast<float>(g[j]);
      }
      kernel(param + i, buf, exp_avg + i, exp_avg_sq + i, len, c, low ? low + i : nullptr);
    }
  });
}
}  // namespace

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

#if SHARDTORCH_ADAM_X86
__attribute__((target("avx512f,avx512bw,avx512vl,fma"))) void roofline_avx512(float* a, const float* b, float* c,
                                                                              float* d, int64_t n) {
  roofline_body(a, b, c, d, n);
}
__attribute__((target("avx2,fma"))) void roofline_avx2(float* a, const float* b, float* c, float* d, int64_t n) {
  roofline_body(a, b, c, d, n);
}
#endif
void roofline_default(float* a, const float* b, float* c, float* d, int64_t n) { roofline_body(a, b, c, d, n); }

void adam_traffic_roofline(float* a, const float* b, float* c, float* d, int64_t n) {
  // The same instruction set as the Adam kernel chosen here.
  const std::string isa = chosen().name;
#if SHARDTORCH_ADAM_X86
  auto body = isa.rfind("avx512", 0) == 0 ? roofline_avx512 : isa == "avx2" ? roofline_avx2 : roofline_default;
#else
  auto body = roofline_default;
#endif
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
