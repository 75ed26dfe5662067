// The fused CUDA Adam/AdamW over a flat fp32 shard: one pass reads the
// master, the gradient and both moments, and writes the master, both moments
// and, when asked, the master's bf16 copy (docs/gpu.md). No LibTorch header:
// the library's wrapper (src/optim/cuda_adam.cpp) passes raw pointers and the
// stream, so this file also compiles alone (tests: build.cuda_kernel_compiles).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "adam_math.h"
#include "fused_adam.h"

namespace shardtorch::cuda {
namespace {

constexpr int kThreads = 256;

// Four elements a thread per iteration through 16-byte loads where every
// array is 16-byte aligned (the flat shards are), else one at a time.
__global__ void adam_vec4(float* __restrict__ p, const float* __restrict__ g, float* __restrict__ m,
                          float* __restrict__ v, uint16_t* __restrict__ low, int64_t n4, AdamCoeffs c) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n4; i += stride) {
    float4 pp = reinterpret_cast<float4*>(p)[i];
    const float4 gg = reinterpret_cast<const float4*>(g)[i];
    float4 mm = reinterpret_cast<float4*>(m)[i];
    float4 vv = reinterpret_cast<float4*>(v)[i];
    adam_element(pp.x, gg.x, mm.x, vv.x, c);
    adam_element(pp.y, gg.y, mm.y, vv.y, c);
    adam_element(pp.z, gg.z, mm.z, vv.z, c);
    adam_element(pp.w, gg.w, mm.w, vv.w, c);
    reinterpret_cast<float4*>(p)[i] = pp;
    reinterpret_cast<float4*>(m)[i] = mm;
    reinterpret_cast<float4*>(v)[i] = vv;
    if (low != nullptr) {
      ushort4 out{bf16_bits(pp.x), bf16_bits(pp.y), bf16_bits(pp.z), bf16_bits(pp.w)};
      reinterpret_cast<ushort4*>(low)[i] = out;
    }
  }
}

__global__ void adam_scalar(float* __restrict__ p, const float* __restrict__ g, float* __restrict__ m,
                            float* __restrict__ v, uint16_t* __restrict__ low, int64_t begin, int64_t n,
                            AdamCoeffs c) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = begin + static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    adam_element(p[i], g[i], m[i], v[i], c);
    if (low != nullptr) low[i] = bf16_bits(p[i]);
  }
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

int blocks_for(int64_t work, int sms) {
  const int64_t want = (work + kThreads - 1) / kThreads;
  const int64_t cap = static_cast<int64_t>(sms) * 8;  // enough resident warps to saturate memory
  return static_cast<int>(want < 1 ? 1 : (want < cap ? want : cap));
}

}  // namespace

int fused_adam_launch(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, uint16_t* low, int64_t n,
                      const AdamCoeffs& c, void* stream) {
  if (n <= 0) return 0;
  int device = 0, sms = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (e != cudaSuccess) return static_cast<int>(e);
  auto s = static_cast<cudaStream_t>(stream);
  const bool vec = aligned16(param) && aligned16(grad) && aligned16(exp_avg) && aligned16(exp_avg_sq) &&
                   (low == nullptr || reinterpret_cast<uintptr_t>(low) % 8 == 0);
  int64_t done = 0;
  if (vec && n >= 4) {
    const int64_t n4 = n / 4;
    adam_vec4<<<blocks_for(n4, sms), kThreads, 0, s>>>(param, grad, exp_avg, exp_avg_sq, low, n4, c);
    done = n4 * 4;
  }
  if (done < n) adam_scalar<<<blocks_for(n - done, sms), kThreads, 0, s>>>(param, grad, exp_avg, exp_avg_sq, low, done, n, c);
  return static_cast<int>(cudaGetLastError());
}

const char* fused_adam_error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

}  // namespace shardtorch::cuda
