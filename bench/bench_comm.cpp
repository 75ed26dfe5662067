// Micro-benchmarks of the communication path, two ranks as two threads of one
// process over Gloo on loopback (the CPU development machine):
//
//   BM_AllGather / BM_ReduceScatter: c10d through shardtorch::Comm, per-rank
//     shard sizes from 4 KiB to 64 MiB; bytes_per_second counts the bytes a
//     rank sends (ring estimate, (N-1)/N of the full buffer).
//   BM_CheckedAllGather: BM_AllGather on a world with check_collectives on
//     (each all-gather preceded by the ranks' fingerprint exchange), against
//     BM_AllGather of the same size: what the check costs a collective that
//     is waited for at once, when every all-gather is exchanged (no optimizer
//     step between them).
//   BM_AllGatherInSteps / BM_CheckedAllGatherInSteps: eight all-gathers and
//     an optimizer step (World::note_step_done) per iteration, then 0 or
//     2000 µs of sleep (the next forward's compute), unchecked and checked:
//     the check in a training loop's steady state, which exchanges only each
//     step's marker, in the background.
//   BM_BucketerCoalescing: 256 gradient flats of 4K elements reduce-scattered
//     through the ReduceScatterBucketer, coalesced (25 MiB buckets) or one
//     collective each (bucket 0).
//   BM_AllReduceBucketer: the same 256 gradients as parameters of NoShard's
//     AllReduceBucketer (views of its buckets), marked ready in backward's
//     order and all-reduced, coalesced (25 MiB) or one bucket each (0).
//   BM_FlattenParams / BM_UnflattenParams / BM_StageGrads (one thread):
//     laying a unit's parameters out flat (FlatParam construction); giving
//     them memory again and writing the rank's shard back from it (the
//     parameters are views of the flat buffer, so unflattening copies
//     nothing else); adding the gradients into the staging buffer. For a
//     block-shaped unit.
//
//   build/bench/bench_comm --benchmark_format=json
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <iostream>
#include <chrono>
#include <thread>

#include "../src/buckets/all_reduce_bucketer.h"
#include "../src/runtime/flat_param.h"
#include "../src/buckets/reduce_scatter_bucketer.h"
#include "shardtorch/world.h"

namespace {

constexpr int kRanks = 2;
std::shared_ptr<shardtorch::World> g_worlds[kRanks];
std::shared_ptr<shardtorch::World> g_checked[kRanks];  // check_collectives on

void make_worlds(std::shared_ptr<shardtorch::World> (&worlds)[kRanks], bool checked) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  const auto options = shardtorch::WorldOptions().check_collectives(checked);
  std::thread other([&] { worlds[1] = shardtorch::World::create(store, 1, kRanks, options); });
  worlds[0] = shardtorch::World::create(store, 0, kRanks, options);
  other.join();
}

double ring(int64_t full_bytes) { return static_cast<double>(full_bytes) * (kRanks - 1) / kRanks; }

void all_gather_on(benchmark::State& state, std::shared_ptr<shardtorch::World> (&worlds)[kRanks]) {
  auto& comm = worlds[state.thread_index()]->comm();
  const int64_t shard = state.range(0) / 4;
  at::Tensor in = at::randn({shard}), out = at::empty({shard * kRanks});
  for (auto _ : state) comm.all_gather_into(out, in, "bench all-gather");
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * ring(out.nbytes())));
}

void BM_AllGather(benchmark::State& state) { all_gather_on(state, g_worlds); }
void BM_CheckedAllGather(benchmark::State& state) { all_gather_on(state, g_checked); }

// Eight all-gathers and an optimizer step per iteration, then range(1) µs
// before the next step's first all-gather (the next forward's compute; a
// sleep, as two ranks share this VM's two cores): the check's steady state,
// where each step's marker is exchanged in the background and no all-gather
// is.
constexpr int kPerStep = 8;
void all_gathers_in_steps(benchmark::State& state, std::shared_ptr<shardtorch::World> (&worlds)[kRanks]) {
  auto& world = *worlds[state.thread_index()];
  const int64_t shard = state.range(0) / 4;
  at::Tensor in = at::randn({shard}), out = at::empty({shard * kRanks});
  for (auto _ : state) {
    for (int i = 0; i < kPerStep; ++i) world.comm().all_gather_into(out, in, "bench all-gather");
    world.note_step_done();
    if (state.range(1) > 0) std::this_thread::sleep_for(std::chrono::microseconds(state.range(1)));
  }
  state.SetItemsProcessed(state.iterations() * kPerStep);
}
void BM_AllGatherInSteps(benchmark::State& state) { all_gathers_in_steps(state, g_worlds); }
void BM_CheckedAllGatherInSteps(benchmark::State& state) { all_gathers_in_steps(state, g_checked); }

void BM_ReduceScatter(benchmark::State& state) {
  auto& comm = g_worlds[state.thread_index()]->comm();
  const int64_t shard = state.range(0) / 4;
  at::Tensor in = at::randn({shard * kRanks}), out = at::empty({shard});
  for (auto _ : state) comm.reduce_scatter_into(out, in, "bench reduce-scatter");
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * ring(in.nbytes())));
}

void BM_BucketerCoalescing(benchmark::State& state) {
  auto& comm = g_worlds[state.thread_index()]->comm();
  const double bucket_mb = static_cast<double>(state.range(0));
  constexpr int kFlats = 256;
  constexpr int64_t kNumel = 4096;
  std::vector<at::Tensor> grads;
  for (int i = 0; i < kFlats; ++i) grads.push_back(at::randn({kNumel}));
  shardtorch::ReduceScatterBucketer bucketer(bucket_mb, nullptr);
  double sink = 0;
  std::vector<at::Tensor> fresh;
  for (auto& g : grads) fresh.push_back(g.clone());
  for (auto _ : state) {
    // An input the bucketer reduces alone (bucket 0) is all-reduced in place
    // on Gloo: each backward hands it new gradients, so does each iteration.
    state.PauseTiming();
    for (int i = 0; i < kFlats; ++i) grads[i].copy_(fresh[i]);
    state.ResumeTiming();
    for (auto& g : grads)
      bucketer.reduce_scatter(
          g, comm, [&](const at::Tensor& r) { sink += r.numel(); }, "bench");
    bucketer.flush();
    bucketer.free();
  }
  benchmark::DoNotOptimize(sink);
  state.counters["collectives_per_iter"] = benchmark::Counter(
      static_cast<double>(bucketer.launches().counts().launched) / std::max<int64_t>(state.iterations(), 1),
      benchmark::Counter::kAvgThreads);
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * ring(kFlats * kNumel * 4)));
}

void BM_AllReduceBucketer(benchmark::State& state) {
  auto& comm = g_worlds[state.thread_index()]->comm();
  constexpr int kParams = 256;
  constexpr int64_t kNumel = 4096;
  std::vector<at::Tensor> params;
  for (int i = 0; i < kParams; ++i) params.push_back(at::randn({kNumel}).requires_grad_(true));
  shardtorch::AllReduceBucketer bucketer(params, std::vector<std::string>(kParams, "p"),
                                         static_cast<double>(state.range(0)), comm, nullptr);
  bucketer.bind_grads();
  for (auto _ : state) {
    for (int i = kParams - 1; i >= 0; --i) bucketer.mark_ready(static_cast<size_t>(i), /*sync=*/true);
    bucketer.finish(/*sync=*/true, /*error_on_unused=*/true);
  }
  benchmark::DoNotOptimize(params[0].grad().data_ptr());
  state.counters["collectives_per_iter"] =
      benchmark::Counter(static_cast<double>(bucketer.launched()) / std::max<int64_t>(state.iterations(), 1),
                         benchmark::Counter::kAvgThreads);
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * 2 * ring(kParams * kNumel * 4)));
}

// A GPT block's parameter shapes at d_model = D.
std::vector<at::Tensor> block_params(int64_t d) {
  return {at::randn({d}),     at::randn({d}),        at::randn({3 * d, d}), at::randn({d, d}),
          at::randn({d}),     at::randn({d}),        at::randn({d}),        at::randn({4 * d, d}),
          at::randn({4 * d}), at::randn({d, 4 * d}), at::randn({d})};
}

void BM_FlattenParams(benchmark::State& state) {
  const int64_t d = state.range(0);
  int64_t bytes = 0;
  for (auto _ : state) {
    state.PauseTiming();
    auto params = block_params(d);
    std::vector<std::string> names(params.size(), "p");
    state.ResumeTiming();
    shardtorch::FlatParam flat(params, names, kRanks, 0, nullptr);
    bytes = flat.buffer().tensor().nbytes();
    benchmark::DoNotOptimize(flat.shard().data_ptr());
  }
  state.SetBytesProcessed(state.iterations() * bytes);
}

void BM_UnflattenParams(benchmark::State& state) {
  const int64_t d = state.range(0);
  auto params = block_params(d);
  std::vector<std::string> names(params.size(), "p");
  shardtorch::FlatParam flat(params, names, kRanks, 0, nullptr);
  flat.buffer().free();
  for (auto _ : state) {
    flat.buffer().alloc();
    benchmark::DoNotOptimize(flat.params().back().data_ptr());
    flat.write_back_shard();
    flat.buffer().free();
  }
  state.SetBytesProcessed(state.iterations() * flat.shard().nbytes());
}

void BM_StageGrads(benchmark::State& state) {
  const int64_t d = state.range(0);
  auto params = block_params(d);
  for (auto& p : params) p.requires_grad_(true);
  std::vector<std::string> names(params.size(), "p");
  shardtorch::FlatParam flat(params, names, kRanks, 0, nullptr);
  std::vector<at::Tensor> grads;
  for (auto& p : params) grads.push_back(at::randn(p.sizes()));
  for (auto _ : state) {
    for (size_t i = 0; i < params.size(); ++i) {
      flat.params()[i].mutable_grad() = grads[i];
      flat.grads().stage_grad(i);
    }
    benchmark::DoNotOptimize(flat.grads().take_staging_grad().data_ptr());
  }
  state.SetBytesProcessed(state.iterations() * flat.buffer().tensor().nbytes());
}

}  // namespace

BENCHMARK(BM_AllGather)->RangeMultiplier(8)->Range(4 << 10, 64 << 20)->Threads(kRanks)->UseRealTime();
BENCHMARK(BM_CheckedAllGather)->Arg(4 << 10)->Arg(256 << 10)->Threads(kRanks)->UseRealTime();
BENCHMARK(BM_AllGatherInSteps)->Args({4 << 10, 0})->Args({4 << 10, 2000})->Threads(kRanks)->UseRealTime();
BENCHMARK(BM_CheckedAllGatherInSteps)->Args({4 << 10, 0})->Args({4 << 10, 2000})->Threads(kRanks)->UseRealTime();
BENCHMARK(BM_ReduceScatter)->RangeMultiplier(8)->Range(4 << 10, 64 << 20)->Threads(kRanks)->UseRealTime();
BENCHMARK(BM_BucketerCoalescing)->Arg(0)->Arg(25)->Threads(kRanks)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_AllReduceBucketer)->Arg(0)->Arg(25)->Threads(kRanks)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_FlattenParams)->Arg(256)->Arg(1024)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_UnflattenParams)->Arg(256)->Arg(1024)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_StageGrads)->Arg(256)->Arg(1024)->UseRealTime()->Unit(benchmark::kMillisecond);

int main(int argc, char** argv) {
  at::set_num_threads(1);  // the ranks are the parallelism
  benchmark::Initialize(&argc, argv);
  make_worlds(g_worlds, false);
  make_worlds(g_checked, true);
  std::cerr << "bench_comm: " << kRanks << " ranks as threads, Gloo on loopback\n";
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  for (auto& w : g_worlds) w.reset();
  for (auto& w : g_checked) w.reset();
  return 0;
}
