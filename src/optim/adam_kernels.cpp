// Built with -O3 (CMakeLists.txt) so that each target clone is vectorised.
// On x86-64 the AVX-512 and AVX2 variants are chosen at run time; elsewhere
// (aarch64) the one portable variant runs, vectorised by the compiler for the
// target's baseline (NEON on aarch64).
#include "optim/adam_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>

#if defined(__x86_64__) || defined(__i386__)
#define SHARDTORCH_ADAM_X86 1
#include <immintrin.h>
// GCC 12's _mm512_rsqrt14_ps and _mm512_rcp14_ps start from a deliberately
// undefined vector (`__m512 __Y = __Y`), which it then reports as maybe
// uninitialised wherever they are inlined (GCC bug 105593).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#else
#define SHARDTORCH_ADAM_X86 0
#endif

namespace shardtorch::detail {
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

// fp32 -> bf16 bits, rounded to nearest even, NaN kept a (quiet) NaN: what
// c10::BFloat16(float) gives, without its branch, so the loop vectorises.
__attribute__((always_inline)) inline uint16_t bf16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7fffffffu) > 0x7f800000u ? uint16_t{0x7fc0} : static_cast<uint16_t>(rounded);
}

// `loop` over the n elements; with `low`, block by block (kAdamBlock), each
// block's bf16 copy written while its parameters are still in L1, so that
// memory is crossed once.
template <class Loop>
__attribute__((always_inline)) inline void with_bf16_copy(Loop loop, float* p, const float* g, float* m, float* v,
                                                          int64_t n, const Coeffs& c, uint16_t* __restrict low) {
  if (low == nullptr) {
    loop(p, g, m, v, n, c);
    return;
  }
  for (int64_t b = 0; b < n; b += kAdamBlock) {
    const int64_t len = std::min(kAdamBlock, n - b);
    loop(p + b, g + b, m + b, v + b, len, c);
    for (int64_t i = b; i < b + len; ++i) low[i] = bf16_bits(p[i]);
  }
}

// adam_loop with the bf16 copy, inlined into one wrapper per instruction set.
__attribute__((always_inline)) inline void adam_body(float* p, const float* g, float* m, float* v, int64_t n, Coeffs c,
                                                     uint16_t* low) {
  with_bf16_copy(
      [](float* p, const float* g, float* m, float* v, int64_t n, const Coeffs& c)
          __attribute__((always_inline)) { adam_loop(p, g, m, v, n, c); },
      p, g, m, v, n, c, low);
}

void adam_default(float* p, const float* g, float* m, float* v, int64_t n, Coeffs c, uint16_t* low) {
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
                                                                                 uint16_t* low) {
  with_bf16_copy(adam_avx512_newton_loop, p, g, m, v, n, c, low);
}

__attribute__((target("avx512f,avx512bw,avx512vl,fma"))) void adam_avx512(float* p, const float* g, float* m, float* v,
                                                                          int64_t n, Coeffs c, uint16_t* low) {
  adam_body(p, g, m, v, n, c, low);
}
__attribute__((target("avx2,fma"))) void adam_avx2(float* p, const float* g, float* m, float* v, int64_t n, Coeffs c,
                                                   uint16_t* low) {
  adam_body(p, g, m, v, n, c, low);
}
#endif  // SHARDTORCH_ADAM_X86

__attribute__((always_inline)) inline void roofline_body(float* __restrict a, const float* __restrict b,
                                                         float* __restrict c, float* __restrict d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float x = b[i];
    a[i] += x;
    c[i] += x;
    d[i] += x;
  }
}

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

}  // namespace

// The variant for this CPU: the widest it has (measured in the library on the
// AMD EPYC development VM, AVX-512 beat AVX2+FMA: docs/benchmarks.md), and on
// Intel cores with AVX-512 the Newton variant (1.3x faster where the data is
// in cache, the same where memory bounds it; slower on AMD Zen 4).
AdamKernels adam_kernels(const char* want) {
#if SHARDTORCH_ADAM_X86
  __builtin_cpu_init();
  const bool has512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma");
  const bool has2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  auto automatic = [&]() -> AdamKernels {
    if (has512 && __builtin_cpu_is("intel")) return {adam_avx512_newton, roofline_avx512, "avx512-newton", ""};
    if (has512) return {adam_avx512, roofline_avx512, "avx512", ""};
    if (has2) return {adam_avx2, roofline_avx2, "avx2", ""};
    return {adam_default, roofline_default, "default", ""};
  };
#else
  auto automatic = []() -> AdamKernels { return {adam_default, roofline_default, "default", ""}; };
#endif
  if (want == nullptr) return automatic();
  const std::string w = want;
#if SHARDTORCH_ADAM_X86
  if (w == "avx512" && has512) return {adam_avx512, roofline_avx512, "avx512", ""};
  if (w == "avx512-newton" && has512) return {adam_avx512_newton, roofline_avx512, "avx512-newton", ""};
  if (w == "avx2" && has2) return {adam_avx2, roofline_avx2, "avx2", ""};
#endif
  if (w == "default") return {adam_default, roofline_default, "default", ""};
  AdamKernels k = automatic();
  const bool known = w == "avx512" || w == "avx512-newton" || w == "avx2";
  k.refused = known ? "is not supported by this CPU" : "is not one of avx512-newton, avx512, avx2, default";
  return k;
}

}  // namespace shardtorch::detail
