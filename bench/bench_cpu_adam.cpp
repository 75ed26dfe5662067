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

#include <algorithm>
#include <chrono>
#include <iostream>
#include <vector>

#include "shardtorch/optim/cpu_adam.h"

namespace {

constexpr int kThreads = 2;

void BM_ShardtorchFusedAdamW(benchmark::State& state) {
  const int64_t n = state.range(0);
  auto p = at::randn({n}), g = at::randn({n}), m = at::zeros({n}), v = at::zeros({n});
  int64_t step = 0;
  for (auto _ : state) {
    shardtorch::fused_adam_cpu(p.data_ptr<float>(), g.data_ptr<float>(), m.data_ptr<float>(), v.data_ptr<float>(), n,
                               {1e-4, 0.9, 0.999, 1e-8, 0.01, ++step, true});
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * n);
  state.SetBytesProcessed(state.iterations() * n * 28);
}

// AdamW that also writes the bf16 compute copy of the parameters in the same
// pass (2 more bytes per parameter: 30).
void BM_ShardtorchFusedAdamWBf16Copy(benchmark::State& state) {
  const int64_t n = state.range(0);
  auto p = at::randn({n}), g = at::randn({n}), m = at::zeros({n}), v = at::zeros({n});
  auto low = at::empty({n}, at::kBFloat16);
  int64_t step = 0;
  for (auto _ : state) {
    shardtorch::fused_adam_cpu(p.data_ptr<float>(), g.data_ptr<float>(), m.data_ptr<float>(), v.data_ptr<float>(), n,
                               {1e-4, 0.9, 0.999, 1e-8, 0.01, ++step, true}, low.data_ptr<at::BFloat16>());
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * n);
  state.SetBytesProcessed(state.iterations() * n * 30);
}

void BM_ShardtorchFusedAdam(benchmark::State& state) {
  const int64_t n = state.range(0);
  auto p = at::randn({n}), g = at::randn({n}), m = at::zeros({n}), v = at::zeros({n});
  int64_t step = 0;
  for (auto _ : state) {
    shardtorch::fused_adam_cpu(p.data_ptr<float>(), g.data_ptr<float>(), m.data_ptr<float>(), v.data_ptr<float>(), n,
                               {1e-4, 0.9, 0.999, 1e-8, 0.01, ++step, false});
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

// Paired: every iteration times the roofline, the fused kernel and
// at::_fused_adam(w)_ back to back, so the ratios compare runs under the same
// load (on a shared VM the separate benchmarks above drift by 10-20% between
// each other). All three work on the same parameter, gradient and moments
// (the roofline adds a zero stream to them: same traffic, values unchanged),
// so at 1M the working set (20 MiB) stays in the 32 MiB L3 as it does in the
// separate benchmarks. Counters: medians over the iterations of each one's
// time (ms) and of the per-iteration ratios.
template <bool kDecoupled>
void BM_Paired(benchmark::State& state) {
  const int64_t n = state.range(0);
  auto p = at::randn({n}), g = at::randn({n}), m = at::zeros({n}), v = at::zeros({n}), zero = at::zeros({n});
  std::vector<at::Tensor> ap{p}, ag{g}, am{m}, av{v};
  std::vector<at::Tensor> steps{at::zeros({}, at::kFloat)};
  std::vector<double> ours, aten, roof, speedup, of_roof;
  int64_t step = 0;
  using clock = std::chrono::steady_clock;
  auto ms = [](clock::time_point t0, clock::time_point t1) {
    return std::chrono::duration<double, std::milli>(t1 - t0).count();
  };
  for (auto _ : state) {
    auto t0 = clock::now();
    shardtorch::adam_traffic_roofline(p.data_ptr<float>(), zero.data_ptr<float>(), m.data_ptr<float>(),
                                      v.data_ptr<float>(), n);
    auto t1 = clock::now();
    shardtorch::fused_adam_cpu(p.data_ptr<float>(), g.data_ptr<float>(), m.data_ptr<float>(), v.data_ptr<float>(), n,
                               {1e-4, 0.9, 0.999, 1e-8, 0.01, ++step, kDecoupled});
    auto t2 = clock::now();
    steps[0].fill_(static_cast<double>(step));
    auto t3 = clock::now();
    if (kDecoupled)
      at::_fused_adamw_(ap, ag, am, av, {}, steps, 1e-4, 0.9, 0.999, 0.01, 1e-8, false, false);
    else
      at::_fused_adam_(ap, ag, am, av, {}, steps, 1e-4, 0.9, 0.999, 0.01, 1e-8, false, false);
    auto t4 = clock::now();
    benchmark::ClobberMemory();
    roof.push_back(ms(t0, t1));
    ours.push_back(ms(t1, t2));
    aten.push_back(ms(t3, t4));
    speedup.push_back(aten.back() / ours.back());
    of_roof.push_back(roof.back() / ours.back());
  }
  auto median = [](std::vector<double> x) {
    std::nth_element(x.begin(), x.begin() + x.size() / 2, x.end());
    return x[x.size() / 2];
  };
  state.counters["ours_ms"] = median(ours);
  state.counters["aten_ms"] = median(aten);
  state.counters["roofline_ms"] = median(roof);
  state.counters["vs_aten"] = median(speedup);
  state.counters["of_roofline"] = median(of_roof);
  state.SetItemsProcessed(state.iterations() * n);
}

}  // namespace

// Sizes: 1M parameters (16 MiB of state: cache-resident on the development VM)
// and 16M (256 MiB: main memory).
#define SIZES ->Arg(1 << 16)->Arg(1 << 20)->Arg(1 << 24)->UseRealTime()->Unit(benchmark::kMillisecond)
BENCHMARK(BM_ShardtorchFusedAdam) SIZES;
BENCHMARK(BM_AtFusedAdam) SIZES;
BENCHMARK(BM_TorchOptimAdam) SIZES;
BENCHMARK(BM_ShardtorchFusedAdamW) SIZES;
BENCHMARK(BM_ShardtorchFusedAdamWBf16Copy) SIZES;
BENCHMARK(BM_AtFusedAdamW) SIZES;
BENCHMARK(BM_TorchOptimAdamW) SIZES;
BENCHMARK(BM_StreamRoofline) SIZES;
BENCHMARK(BM_TensorCopy) SIZES;
BENCHMARK(BM_Paired<false>)->Name("BM_PairedAdam") SIZES;
BENCHMARK(BM_Paired<true>)->Name("BM_PairedAdamW") SIZES;

int main(int argc, char** argv) {
  at::set_num_threads(kThreads);
  std::cerr << "bench_cpu_adam: " << kThreads << " ATen threads, fused kernel variant " << shardtorch::fused_adam_isa()
            << "\n";
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
