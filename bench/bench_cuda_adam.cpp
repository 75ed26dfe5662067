// bench_cuda_adam (CUDA builds only; docs/gpu.md): the fused CUDA AdamW
// (shardtorch::FusedAdamW on a CUDA tensor, with and without its bf16 copy)
// against ATen's at::_fused_adamw_ and against a device-to-device copy that
// moves as many bytes, for flat shards of several sizes. Also checks the
// update against the CPU kernel and against ATen's. Prints one JSON object a
// line (and writes them to --out FILE).
//
//   build/bench/bench_cuda_adam --out adam.jsonl
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/cuda.h>

#include "shardtorch/optim/cpu_adam.h"

namespace {

double rel_err(const at::Tensor& a, const at::Tensor& b) {
  auto x = a.to(at::kCPU, at::kDouble), y = b.to(at::kCPU, at::kDouble);
  const double scale = y.abs().max().item<double>();
  return (x - y).abs().max().item<double>() / (scale > 0 ? scale : 1.0);
}

// Median milliseconds of `reps` runs of f, each synchronized.
template <class F>
double time_ms(F f, int reps) {
  std::vector<double> ms;
  for (int i = 0; i < reps + 3; ++i) {
    torch::cuda::synchronize();
    auto t0 = std::chrono::steady_clock::now();
    f();
    torch::cuda::synchronize();
    if (i >= 3) ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::string out_path;
  for (int i = 1; i + 1 < argc; ++i)
    if (std::string(argv[i]) == "--out") out_path = argv[i + 1];
  if (!torch::cuda::is_available()) {
    std::cerr << "bench_cuda_adam: no CUDA device\n";
    return 1;
  }
  if (!shardtorch::fused_adam_cuda_available()) {
    std::cerr << "bench_cuda_adam: this shardtorch has no CUDA kernels\n";
    return 1;
  }
  std::ofstream out;
  if (!out_path.empty()) out.open(out_path);
  const auto opts = torch::optim::AdamWOptions(1e-3).betas({0.9, 0.95}).eps(1e-8).weight_decay(0.1);
  const auto dev = at::TensorOptions().device(at::kCUDA).dtype(at::kFloat);
  int rc = 0;
  for (int64_t n : {int64_t{1} << 20, int64_t{1} << 24, int64_t{1} << 26, int64_t{186} << 20}) {
    at::manual_seed(0);
    auto p0 = at::randn({n}, dev), g = at::randn({n}, dev);
    // Ours: FusedAdamW over one flat tensor (the shard), with its bf16 copy.
    auto p = p0.clone().requires_grad_(true);
    p.mutable_grad() = g.clone();
    shardtorch::FusedAdamW ours({p}, opts);
    auto low = at::empty({n}, dev.dtype(at::kBFloat16));
    // ATen's fused AdamW on the same tensor shapes.
    auto q = p0.clone(), mq = at::zeros({n}, dev), vq = at::zeros({n}, dev);
    auto stepq = at::zeros({}, dev);
    auto aten = [&] {
      stepq.add_(1);
      at::_fused_adamw_({q}, {g}, {mq}, {vq}, {}, {stepq}, opts.lr(), 0.9, 0.95, opts.weight_decay(), opts.eps(), false,
                        false);
    };
    // First step of each from the same state: the values agree.
    ours.step();
    aten();
    auto pc = p0.cpu(), gc = g.cpu(), mc = at::zeros({n}), vc = at::zeros({n});
    shardtorch::fused_adam_cpu(pc.data_ptr<float>(), gc.data_ptr<float>(), mc.data_ptr<float>(), vc.data_ptr<float>(),
                               n, shardtorch::AdamStep{opts.lr(), 0.9, 0.95, opts.eps(), opts.weight_decay(), 1, true});
    const double vs_cpu = rel_err(p.detach(), pc), vs_aten = rel_err(p.detach(), q);
    if (vs_cpu > 1e-6) rc = 2;
    const double t_ours = time_ms([&] { ours.step(); }, 20);
    ours.write_low_copy(p, low);
    const double t_ours_low = time_ms([&] { ours.step(); }, 20);
    const double t_aten = time_ms(aten, 20);
    // The least an update moves: reads p, g, m, v; writes p, m, v (28 bytes an
    // element; 30 with the bf16 copy). A copy of B bytes moves 2B.
    auto src = at::empty({n * 15}, dev.dtype(at::kByte)), dst = at::empty({n * 15}, dev.dtype(at::kByte));
    const double t_copy = time_ms([&] { dst.copy_(src); }, 20);
    const double copy_gbs = 30.0 * n / (t_copy * 1e6);
    char line[512];
    std::snprintf(line, sizeof(line),
                  "{\"n\": %lld, \"ours_ms\": %.4f, \"ours_bf16_ms\": %.4f, \"aten_fused_adamw_ms\": %.4f, "
                  "\"copy_roofline_ms\": %.4f, \"copy_GBps\": %.1f, \"ours_bf16_GBps\": %.1f, "
                  "\"ours_bf16_of_roofline\": %.3f, \"ours_vs_aten_speedup\": %.3f, \"rel_err_vs_cpu\": %.3g, "
                  "\"rel_err_vs_aten\": %.3g}",
                  static_cast<long long>(n), t_ours, t_ours_low, t_aten, t_copy, copy_gbs,
                  30.0 * n / (t_ours_low * 1e6), t_copy / t_ours_low, t_aten / t_ours, vs_cpu, vs_aten);
    std::cout << line << std::endl;
    if (out) out << line << "\n";
  }
  return rc;
}
