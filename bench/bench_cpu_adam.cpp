// The fused CPU Adam and AdamW against at::_fused_adam(w)_, torch::optim and a
// memory roofline of the same access pattern, on the same sizes and threads. Every benchmark
// reports items_per_second = parameters updated per second (for the copy: the
// parameters whose 28 bytes of Adam traffic the copy moves in that time).
//
//   build/bench/bench_cpu_adam --benchmark_format=json
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>

#include <iostream>

#include "shardtorch/optim/cpu_adam.h"

namespace {

constexpr int kThreads = 2;

void BM_ShardtorchFusedAdamW(benchmark::State& state) {
  const int64_t n = state.range(0);
  auto p = at::randn({n}), g = at::randn({n}), m = at::zeros({n}), v = at::zeros({n});
  int64_t step = 0;
  for (auto _ : state) {
    shardtorch::fused_adam_cpu(p.data_ptr<float>(), g.data_ptr<float>(), m.data_ptr<float>(), v.data_ptr<float>(), n,
                               {1e-4f, 0.9f, 0.999f, 1e-8f, 0.01f, ++step, true});
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * n);
  state.SetBytesProcessed(state.iterations() * n * 28);
}

void BM_ShardtorchFusedAdam(benchmark::State& state) {
  const int64_t n = state.range(0);
  auto p = at::randn({n}), g = at::randn({n}), m = at::zeros({n}), v = at::zeros({n});
  int64_t step = 0;
  for (auto _ : state) {
    shardtorch::fused_adam_cpu(p.data_ptr<float>(), g.data_ptr<float>(), m.data_ptr<float>(), v.data_ptr<float>(), n,
                               {1e-4f, 0.9f, 0.999f, 1e-8f, 0.01f, ++step, false});
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * n);
  state.SetBytesProcessed(state.iterations() * n * 28);
}

void BM_AtFusedAdam(benchmark::State& state) {
  const int64_t n = state.range(0);
  std::vector<at::Tensor> p{at::randn({n})}, g{at::randn({n})}, m{at::zeros({n})}, v{at::zeros({n})};
  std::vector<at::Tensor> steps{at::zeros({}, at::kFloat)};
  for (auto _ : state) {
    steps[0].add_(1);
    at::_fused_adam_(p, g, m, v, {}, steps, 1e-4, 0.9, 0.999, 0.01, 1e-8, false, false);
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * n);
  state.SetBytesProcessed(state.iterations() * n * 28);
}

void BM_TorchOptimAdam(benchmark::State& state) {
  const int64_t n = state.range(0);
  auto p = at::randn({n}).requires_grad_(true);
  p.mutable_grad() = at::randn({n});
  torch::optim::Adam opt({p}, torch::optim::AdamOptions(1e-4).weight_decay(0.01));
  for (auto _ : state) {
    opt.step();
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * n);
  state.SetBytesProcessed(state.iterations() * n * 28);
}

void BM_AtFusedAdamW(benchmark::State& state) {
  const int64_t n = state.range(0);
  std::vector<at::Tensor> p{at::randn({n})}, g{at::randn({n})}, m{at::zeros({n})}, v{at::zeros({n})};
  std::vector<at::Tensor> steps{at::zeros({}, at::kFloat)};
  for (auto _ : state) {
    steps[0].add_(1);
    at::_fused_adamw_(p, g, m, v, {}, steps, 1e-4, 0.9, 0.999, 0.01, 1e-8, false, false);
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * n);
  state.SetBytesProcessed(state.iterations() * n * 28);
}

void BM_TorchOptimAdamW(benchmark::State& state) {
  const int64_t n = state.range(0);
  auto p = at::randn({n}).requires_grad_(true);
  p.mutable_grad() = at::randn({n});
  torch::optim::AdamW opt({p}, torch::optim::AdamWOptions(1e-4).weight_decay(0.01));
  for (auto _ : state) {
    opt.step();
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * n);
  state.SetBytesProcessed(state.iterations() * n * 28);
}

// The roofline of the access pattern itself (shardtorch::adam_traffic_roofline:
// read four fp32 streams, write three, threaded like the fused kernel). No
// Adam update can beat it.
void BM_StreamRoofline(benchmark::State& state) {
  const int64_t n = state.range(0);
  auto a = at::randn({n}), b = at::randn({n}), c = at::zeros({n}), d = at::zeros({n});
  for (auto _ : state) {
    shardtorch::adam_traffic_roofline(a.data_ptr<float>(), b.data_ptr<float>(), c.data_ptr<float>(),
                                      d.data_ptr<float>(), n);
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * n);
  state.SetBytesProcessed(state.iterations() * n * 28);
}

// Tensor::copy_ of 14 bytes per parameter (reads 14, writes 14), for reference.
void BM_TensorCopy(benchmark::State& state) {
  const int64_t n = state.range(0);
  auto src = at::randn({n * 14 / 4}), dst = at::empty({n * 14 / 4});
  for (auto _ : state) {
    dst.copy_(src);
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * n);
  state.SetBytesProcessed(state.iterations() * n * 28);
}

}  // namespace

// Sizes: 1M parameters (16 MiB of state: cache-resident on the development VM)
// and 16M (256 MiB: main memory).
#define SIZES ->Arg(1 << 20)->Arg(1 << 24)->UseRealTime()->Unit(benchmark::kMillisecond)
BENCHMARK(BM_ShardtorchFusedAdam) SIZES;
BENCHMARK(BM_AtFusedAdam) SIZES;
BENCHMARK(BM_TorchOptimAdam) SIZES;
BENCHMARK(BM_ShardtorchFusedAdamW) SIZES;
BENCHMARK(BM_AtFusedAdamW) SIZES;
BENCHMARK(BM_TorchOptimAdamW) SIZES;
BENCHMARK(BM_StreamRoofline) SIZES;
BENCHMARK(BM_TensorCopy) SIZES;

int main(int argc, char** argv) {
  at::set_num_threads(kThreads);
  std::cerr << "bench_cpu_adam: " << kThreads << " ATen threads, fused kernel variant " << shardtorch::fused_adam_isa()
            << "\n";
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
