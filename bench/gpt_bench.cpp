// gpt_bench: trains the example GPT for a fixed number of steps on
// deterministic data and writes, per rank, a JSON report of step times,
// losses, memory by category and communication volume. The sweep tool
// (shardtorch-sweep) and the side-by-side comparison with PyTorch
// (bench/peers/run_peers.py) both launch it:
//
//   torchrun --no-python --standalone --nproc-per-node 2 build/bench/gpt_bench \
//       --strategy full_shard --layers 4 --d-model 256 --seq 64 --steps 30 --report /tmp/r
//
// writes /tmp/r.rank0.json and /tmp/r.rank1.json; --pp P runs a pipeline
// (bench/pipeline/run_pipeline_peers.py), --tp T tensor parallelism
// (bench/tp/run_tp_peers.py). `gpt_bench --save-init F` (one process) writes
// the initial weights as a full state dict and exits, so that another
// implementation can start from the same weights (--init F).
//
// Data: at step s (warm-up included), rank r, row b: idx = (s*world + r)*batch
// + b; the row counts from start = idx*2654435761 mod vocab with stride
// 1 + (idx / vocab) mod 3. bench/peers/peer_train.py computes the same rows.
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <optional>
#include <set>
#include <sstream>
#include <thread>
#include <tuple>

#include <boost/json.hpp>
#include <boost/program_options.hpp>

#include <ATen/autocast_mode.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/cuda.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/optim/adamw.h>
#if defined(SHARDTORCH_BENCH_CUDA)
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include "../examples/cli.h"
#include "../examples/gpt.h"
#include "../examples/process_memory.h"
#include "shardtorch/shardtorch.h"

namespace po = boost::program_options;
namespace json = boost::json;

namespace {

struct Args {
  std::string strategy = "full_shard";
  gpt::Config cfg;
  int64_t batch = 8;
  int steps = 30, warmup = 5, threads = 0, hybrid_shard_size = 0;
  double lr = 3e-3, bucket_mb = 25.0;
  bool bf16 = false, offload = false, quiet = false, fused_adam = false, prefetch = false, recompute = false;
  bool deferred = false, overlap_step = false;
  std::string init, save_init, report, profile;
  // Pipeline parallelism (--pp P > 0): P pipeline ranks x world/P data-parallel ones.
  int pp = 0, microbatches = 4, chunks = 1;
  double stand_in_ms = 0;  // with --pp: a stand-in compute per layer (see StandIn)
  std::string schedule = "1f1b", split_at;
  // Tensor parallelism (--tp T > 0): T tensor-parallel ranks x world/T data-parallel ones.
  int tp = 0;
  bool sequence_parallel = false;
};

// The caching allocator's peak and current bytes on a CUDA device (zero
// elsewhere, or in a build against a CPU LibTorch).
struct DevicePeak {
  int64_t allocated = 0, reserved = 0;
};
void reset_device_peak(const c10::Device& d) {
#if defined(SHARDTORCH_BENCH_CUDA)
  if (d.is_cuda()) c10::cuda::CUDACachingAllocator::resetPeakStats(d.index());
#endif
}
DevicePeak device_peak(const c10::Device& d) {
#if defined(SHARDTORCH_BENCH_CUDA)
  if (d.is_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(d.index());
    return {stats.allocated_bytes[0].peak, stats.reserved_bytes[0].peak};  // [0]: all pools
  }
#endif
  return {};
}

at::Tensor batch_tokens(const Args& a, int step, int world, int rank) {
  auto out = at::empty({a.batch, a.cfg.seq_len}, at::kLong);
  auto acc = out.accessor<int64_t, 2>();
  const uint64_t V = static_cast<uint64_t>(a.cfg.vocab);
  for (int64_t b = 0; b < a.batch; ++b) {
    const uint64_t idx = (static_cast<uint64_t>(step) * world + rank) * a.batch + b;
    const uint64_t start = (idx * 2654435761ull) % V, stride = 1 + (idx / V) % 3;
    for (int64_t t = 0; t < a.cfg.seq_len; ++t) acc[b][t] = static_cast<int64_t>((start + stride * t) % V);
  }
  return out;
}

double percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  double pos = q * (v.size() - 1);
  size_t lo = static_cast<size_t>(pos);
  size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (pos - lo);
}

int64_t count_params(torch::nn::Module& m) {
  int64_t n = 0;
  std::set<const void*> seen;  // parameters() lists a tied tensor under each name
  for (const auto& p : m.parameters())
    if (seen.insert(p.unsafeGetTensorImpl()).second) n += p.numel();
  return n;
}

// The optimizer every path trains with (bench/peers/peer_train.py's).
torch::optim::AdamWOptions adamw_options(const Args& a) {
  return torch::optim::AdamWOptions(a.lr).betas({0.9, 0.999}).eps(1e-8).weight_decay(0.01);
}

// Every memory category, current and peak, as the reports hold them.
json::object memory_json(const shardtorch::MemorySnapshot& m) {
  json::object mem;
  for (int i = 0; i < static_cast<int>(shardtorch::Mem::kCount); ++i) {
    auto c = static_cast<shardtorch::Mem>(i);
    mem[shardtorch::mem_name(c)] = json::object{{"current", m.cur(c)}, {"peak", m.max(c)}};
  }
  return mem;
}

// Parameters, gradients and optimizer state, on the device and in host memory.
int64_t model_state_bytes(const shardtorch::MemorySnapshot& m) {
  using shardtorch::Mem;
  return m.cur(Mem::ShardedParams) + m.cur(Mem::ReplicatedParams) + m.cur(Mem::Gradients) + m.cur(Mem::OptimizerState) +
         m.cur(Mem::HostParams) + m.cur(Mem::HostGradients) + m.cur(Mem::HostOptimizerState);
}

double mean_of(const std::vector<double>& v) {
  double mean = 0;
  for (double x : v) mean += x / static_cast<double>(std::max<size_t>(v.size(), 1));
  return mean;
}

// The model's shape and the run's options every report holds ("config");
// a path adds its own.
json::object config_json(const Args& a) {
  return json::object{
      {"vocab", a.cfg.vocab},   {"seq_len", a.cfg.seq_len},   {"d_model", a.cfg.d_model},
      {"n_head", a.cfg.n_head}, {"n_layer", a.cfg.n_layer},   {"batch", a.batch},
      {"dtype", "float32"},     {"fused_adam", a.fused_adam}, {"activation_checkpointing", a.recompute}};
}

// --report PREFIX: this rank's report in PREFIX.rankR.json.
void write_report(const Args& a, const shardtorch::World& world, const json::object& r) {
  if (a.report.empty()) return;
  const std::string path = a.report + ".rank" + std::to_string(world.rank()) + ".json";
  std::ofstream out(path);
  out << json::serialize(r) << "\n";
  TORCH_CHECK(out.good(), "gpt_bench: rank ", world.rank(), " could not write ", path);
}

// --stand-in-ms: a layer's compute made long and exact, whatever the cores:
// its output passes through unchanged after a sleep of `ms`, and its
// gradient after a sleep of twice that (a backward costs about two forwards).
// Sleeping ranks leave the cores to the others, so four pipeline ranks on a
// 2-core machine each see their stand-in time, and the measured idle share
// can be set against the schedule's theory.
struct StandIn : torch::autograd::Function<StandIn> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, double ms) {
    ctx->saved_data["ms"] = ms;
    std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(ms));
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list g) {
    std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(2 * ctx->saved_data["ms"].toDouble()));
    return {g[0], at::Tensor()};
  }
};

// --pp: the GPT as a shardtorch::Pipeline over a {pp, dp} mesh, built
// deferred from the same seed (so its weights are --save-init's, bitwise),
// stages sharded over dp with --strategy. Pipeline d reads
// batch_tokens(step, dp, d): --batch rows per pipeline, as
// bench/pipeline/torch_pipeline.py reads them.
int run_pipeline(const Args& a) {
  auto world = shardtorch::World::from_env();
  const bool lead = world->rank() == 0;
  at::set_num_threads(a.threads > 0 ? a.threads : 1);
  TORCH_CHECK(world->size() % a.pp == 0, "gpt_bench: --pp ", a.pp, " does not divide the world's ", world->size(),
              " ranks");
  TORCH_CHECK(a.init.empty(),
              "gpt_bench: --pp builds the model deferred from seed 0 (--save-init's weights); no --init");
  const int dp = world->size() / a.pp;
  const int64_t baseline_rss = process_memory::resident_bytes();
  auto mesh = shardtorch::DeviceMesh::create(world, {{"pp", a.pp}, {"dp", dp}});
  torch::manual_seed(0);
  gpt::GPT model = shardtorch::deferred([&] { return gpt::GPT(a.cfg); });
  const int64_t params = count_params(*model);
  auto shard = shardtorch::ShardOptions()
                   .strategy(shardtorch::parse_strategy(a.strategy))
                   .bucket_mb(a.bucket_mb)
                   .activation_checkpointing(a.recompute);
  if (shard.strategy() == shardtorch::Strategy::HybridShard) shard.hybrid_shard_size(a.hybrid_shard_size);
  auto options = shardtorch::PipelineOptions()
                     .schedule(shardtorch::parse_schedule(a.schedule))
                     .microbatches(a.microbatches)
                     .chunks_per_rank(a.chunks)
                     .shard(shard)
                     .record_timeline(true);
  if (!a.split_at.empty()) {
    std::vector<std::string> names;
    std::stringstream ss(a.split_at);
    for (std::string n; std::getline(ss, n, ',');) names.push_back(n);
    options.split_at(names);
  }
  auto layers = gpt::pipeline_layers(model);
  if (a.stand_in_ms > 0)
    for (auto& l : layers)
      l.forward = [f = l.forward, ms = a.stand_in_ms](const at::Tensor& x) { return StandIn::apply(f(x), ms); };
  shardtorch::Pipeline pipe(std::move(layers), mesh, options);
  auto adamw = adamw_options(a);
  auto opt = a.fused_adam ? shardtorch::ShardedOptimizer::make<shardtorch::FusedAdamW>(pipe.module(), adamw)
                          : shardtorch::AdamW(pipe.module(), adamw);
  auto loss_fn = [](const at::Tensor& logits, const at::Tensor& t) { return gpt::lm_loss(logits, t); };
  const int d = mesh->coordinate("dp");
  std::vector<double> losses, step_ms, pipe_ms, fwd_ms, bwd_ms, idle_ms, opt_ms, idle_share;
  int64_t sent = 0;
  for (int s = 0; s < a.warmup + a.steps; ++s) {
    if (s == a.warmup) pipe.sharded().reset_peak_memory();
    const bool reads = pipe.is_first_stage() || pipe.is_last_stage();
    at::Tensor tokens = reads ? batch_tokens(a, s, dp, d) : at::Tensor();
    world->barrier();  // ranks start the step together
    const int64_t bytes0 =
        pipe.sharded().comm_stats().total_bytes_sent() + mesh->group("pp")->comm().stats().total_bytes_sent();
    using clock = std::chrono::steady_clock;
    const auto t0 = clock::now();
    opt->zero_grad();
    at::Tensor loss =
        pipe.step(pipe.is_first_stage() ? tokens : at::Tensor(), pipe.is_last_stage() ? tokens : at::Tensor(), loss_fn);
    const auto t1 = clock::now();
    opt->step();
    const auto t2 = clock::now();
    auto ms = [](clock::time_point x, clock::time_point y) {
      return std::chrono::duration<double, std::milli>(y - x).count();
    };
    double f = 0, b = 0;
    for (const auto& e : pipe.timeline()) {
      if (e.action.kind == shardtorch::pipeline::ActionKind::Forward) f += (e.end - e.start) * 1e3;
      if (e.action.kind == shardtorch::pipeline::ActionKind::Backward) b += (e.end - e.start) * 1e3;
    }
    at::Tensor mean = loss.to(at::kDouble).reshape({1}).clone();
    mesh->group("dp")->comm().all_reduce(mean, c10d::ReduceOp::SUM, "gpt_bench loss");
    losses.push_back(mean.item<double>() / dp);
    if (s >= a.warmup) {
      step_ms.push_back(ms(t0, t2));
      pipe_ms.push_back(ms(t0, t1));
      fwd_ms.push_back(f);
      bwd_ms.push_back(b);
      idle_ms.push_back(ms(t0, t1) - f - b);
      opt_ms.push_back(ms(t1, t2));
      idle_share.push_back(1.0 - (f + b) / std::max(1e-9, ms(t0, t1)));
      sent += pipe.sharded().comm_stats().total_bytes_sent() + mesh->group("pp")->comm().stats().total_bytes_sent() -
              bytes0;
    }
    if (lead && !a.quiet && (s + 1 == a.warmup + a.steps || (s + 1) % 10 == 0))
      std::fprintf(stderr, "gpt_bench: step %d/%d loss %.4f %.1f ms\n", s + 1, a.warmup + a.steps, losses.back(),
                   ms(t0, t2));
  }
  const auto m = pipe.sharded().memory();
  const int64_t model_state = model_state_bytes(m);
  const double mean_ms = mean_of(step_ms);
  json::array stages;
  for (const auto& layers : pipe.stage_layers()) stages.push_back(json::value_from(layers));
  json::object r{
      {"impl", "shardtorch_pipeline"},
      {"strategy", shardtorch::strategy_name(shard.strategy())},
      {"world", world->size()},
      {"rank", world->rank()},
      {"pp", a.pp},
      {"dp", dp},
      {"pipeline_rank", mesh->coordinate("pp")},
      {"schedule", a.schedule},
      {"microbatches", a.microbatches},
      {"stand_in_ms", a.stand_in_ms},
      {"chunks", a.chunks},
      {"stages", stages},
      {"config", config_json(a)},
      {"params", params},
      {"warmup", a.warmup},
      {"steps", a.steps},
      {"losses", json::value_from(losses)},
      {"step_ms", json::value_from(step_ms)},
      {"p50_ms", percentile(step_ms, 0.5)},
      {"p95_ms", percentile(step_ms, 0.95)},
      {"phase_p50_ms",
       {{"pipeline", percentile(pipe_ms, 0.5)},
        {"forward", percentile(fwd_ms, 0.5)},
        {"backward", percentile(bwd_ms, 0.5)},
        {"idle", percentile(idle_ms, 0.5)},
        {"optimizer", percentile(opt_ms, 0.5)}}},
      {"idle_share_p50", percentile(idle_share, 0.5)},
      {"theoretical_bubble", shardtorch::pipeline::theoretical_bubble(pipe.plan())},
      {"tokens_per_s", mean_ms > 0 ? dp * a.batch * a.cfg.seq_len / (mean_ms / 1e3) : 0.0},
      {"peak_rss_bytes", process_memory::peak_resident_bytes()},
      {"baseline_rss_bytes", baseline_rss},
      {"model_state_bytes", model_state},
      {"memory", memory_json(m)},
      {"bytes_sent_per_step", a.steps > 0 ? sent / a.steps : 0},
  };
  write_report(a, *world, r);
  if (!a.profile.empty()) pipe.write_timeline(a.profile + ".timeline.json");  // collective
  if (lead && !a.quiet)
    std::printf(
        "gpt_bench: pipeline %s, %s, %d ranks (pp %d x dp %d), %lld params: p50 %.1f ms (pipeline %.1f, "
        "idle %.0f%%, theory %.0f%%, optimizer %.1f), %.0f tokens/s\n",
        a.schedule.c_str(), shardtorch::strategy_name(shard.strategy()), world->size(), a.pp, dp,
        static_cast<long long>(params), percentile(step_ms, 0.5), percentile(pipe_ms, 0.5),
        100 * percentile(idle_share, 0.5), 100 * shardtorch::pipeline::theoretical_bubble(pipe.plan()),
        percentile(opt_ms, 0.5), r["tokens_per_s"].as_double());
  return 0;
}

// The counters of one kind of collective as JSON: calls and bytes sent per step.
json::object per_step(const shardtorch::CollectiveCounter& c, int steps) {
  return json::object{{"calls", static_cast<double>(c.calls) / steps},
                      {"bytes", static_cast<double>(c.bytes_sent) / steps}};
}

// --tp: the GPT split by gpt::tp_plan over the tp dimension of a {dp, tp}
// mesh (--sequence-parallel: Megatron-LM's sequence parallelism), its slices
// sharded over dp with --strategy, the loss by gpt::lm_loss_tp. Built eagerly
// from seed 0 (--save-init's weights, bitwise). Data-parallel replica d reads
// batch_tokens(step, dp, d): --batch rows per replica, the same on every rank
// of its tensor-parallel group. Bytes sent count both the sharding's
// collectives (over dp) and the tensor-parallel ones (over tp).
int run_tensor_parallel(const Args& a) {
  auto world = shardtorch::World::from_env();
  const bool lead = world->rank() == 0;
  at::set_num_threads(a.threads > 0 ? a.threads : 1);
  TORCH_CHECK(world->size() % a.tp == 0, "gpt_bench: --tp ", a.tp, " does not divide the world's ", world->size(),
              " ranks");
  TORCH_CHECK(a.init.empty() && !a.deferred && !a.offload && !a.bf16 && a.strategy != "plain",
              "gpt_bench: --tp builds the model eagerly from seed 0 (--save-init's weights) in float32; no --init, "
              "--deferred, --offload, --bf16 or --strategy plain");
  const int dp = world->size() / a.tp;
  const int64_t baseline_rss = process_memory::resident_bytes();
  auto mesh = shardtorch::DeviceMesh::create(world, {{"dp", dp}, {"tp", a.tp}});
  const auto& tp = (*mesh)["tp"];
  torch::manual_seed(0);
  gpt::GPT model(a.cfg);
  const int64_t params = count_params(*model);
  shardtorch::parallelize(*model, tp, gpt::tp_plan(a.cfg, a.sequence_parallel));
  auto options = shardtorch::ShardOptions()
                     .strategy(shardtorch::parse_strategy(a.strategy))
                     .bucket_mb(a.bucket_mb)
                     .prefetch(a.prefetch)
                     .activation_checkpointing(a.recompute);
  if (options.strategy() == shardtorch::Strategy::HybridShard) options.hybrid_shard_size(a.hybrid_shard_size);
  shardtorch::ShardedModel sharded = shardtorch::shard(*model, (*mesh)["dp"], options);
  auto adamw = adamw_options(a);
  auto opt = a.fused_adam ? shardtorch::ShardedOptimizer::make<shardtorch::FusedAdamW>(*model, adamw)
                          : shardtorch::AdamW(*model, adamw);
  const int d = mesh->coordinate("dp");
  std::vector<double> losses, step_ms, forward_ms, backward_ms, optimizer_ms;
  // The measured steps' traffic, from the barrier to the optimizer step's
  // end (not the loss's all-reduce): tp_comm over tp, dp_comm the sharding's.
  shardtorch::CommStats tp_comm, dp_comm;
  auto add = [](shardtorch::CommStats& acc, const shardtorch::CommStats& now, const shardtorch::CommStats& before) {
    for (auto [c, n, b] : {std::tuple{&acc.all_gather, &now.all_gather, &before.all_gather},
                           std::tuple{&acc.reduce_scatter, &now.reduce_scatter, &before.reduce_scatter},
                           std::tuple{&acc.all_reduce, &now.all_reduce, &before.all_reduce},
                           std::tuple{&acc.broadcast, &now.broadcast, &before.broadcast},
                           std::tuple{&acc.send, &now.send, &before.send}}) {
      c->calls += n->calls - b->calls;
      c->bytes_sent += n->bytes_sent - b->bytes_sent;
    }
  };
  for (int s = 0; s < a.warmup + a.steps; ++s) {
    if (s == a.warmup) sharded.reset_peak_memory();
    at::Tensor tokens = batch_tokens(a, s, dp, d);
    world->barrier();  // ranks start the step together
    const shardtorch::CommStats tp0 = tp->comm().stats(), dp0 = sharded.comm_stats();
    using clock = std::chrono::steady_clock;
    auto since = [](clock::time_point t) {
      return std::chrono::duration<double, std::milli>(clock::now() - t).count();
    };
    const auto t0 = clock::now();
    opt->zero_grad();
    at::Tensor loss = gpt::lm_loss_tp(model(tokens), tokens, tp);
    const double fwd = since(t0);
    loss.backward();
    const double bwd = since(t0) - fwd;
    opt->step();
    const double ms = since(t0);
    if (s >= a.warmup) {
      step_ms.push_back(ms);
      forward_ms.push_back(fwd);
      backward_ms.push_back(bwd);
      optimizer_ms.push_back(ms - fwd - bwd);
      add(tp_comm, tp->comm().stats(), tp0);
      add(dp_comm, sharded.comm_stats(), dp0);
    }
    at::Tensor mean = loss.detach().to(at::kDouble).reshape({1}).clone();
    (*mesh)["dp"]->comm().all_reduce(mean, c10d::ReduceOp::SUM, "gpt_bench loss");
    losses.push_back(mean.item<double>() / dp);
    if (lead && !a.quiet && (s + 1 == a.warmup + a.steps || (s + 1) % 10 == 0))
      std::fprintf(stderr, "gpt_bench: step %d/%d loss %.4f %.1f ms\n", s + 1, a.warmup + a.steps, losses.back(), ms);
  }
  const auto m = sharded.memory();
  const int64_t model_state = model_state_bytes(m);
  const double mean_ms = mean_of(step_ms);
  auto traffic = [&](const shardtorch::CommStats& c) {
    return json::object{{"all_reduce", per_step(c.all_reduce, a.steps)},
                        {"all_gather", per_step(c.all_gather, a.steps)},
                        {"reduce_scatter", per_step(c.reduce_scatter, a.steps)},
                        {"bytes_sent", static_cast<double>(c.total_bytes_sent()) / a.steps}};
  };
  json::object r{
      {"impl", "shardtorch_tp"},
      {"strategy", shardtorch::strategy_name(sharded.strategy())},
      {"world", world->size()},
      {"rank", world->rank()},
      {"tp", a.tp},
      {"dp", dp},
      {"sequence_parallel", a.sequence_parallel},
      {"config", config_json(a)},
      {"params", params},
      {"warmup", a.warmup},
      {"steps", a.steps},
      {"losses", json::value_from(losses)},
      {"step_ms", json::value_from(step_ms)},
      {"p50_ms", percentile(step_ms, 0.5)},
      {"p95_ms", percentile(step_ms, 0.95)},
      {"phase_p50_ms",
       {{"forward", percentile(forward_ms, 0.5)},
        {"backward", percentile(backward_ms, 0.5)},
        {"optimizer", percentile(optimizer_ms, 0.5)}}},
      {"tokens_per_s", mean_ms > 0 ? dp * a.batch * a.cfg.seq_len / (mean_ms / 1e3) : 0.0},
      {"peak_rss_bytes", process_memory::peak_resident_bytes()},
      {"baseline_rss_bytes", baseline_rss},
      {"model_state_bytes", model_state},
      {"memory", memory_json(m)},
      {"tp_traffic_per_step", traffic(tp_comm)},
      {"dp_traffic_per_step", traffic(dp_comm)},
      {"bytes_sent_per_step", (tp_comm.total_bytes_sent() + dp_comm.total_bytes_sent()) / a.steps},
  };
  write_report(a, *world, r);
  if (lead && !a.quiet)
    std::printf(
        "gpt_bench: tensor parallel%s, %s, %d ranks (dp %d x tp %d), %lld params: p50 %.1f ms (forward %.1f, "
        "backward %.1f, optimizer %.1f), %.0f tokens/s, sent %s/step (tp %s, dp %s)\n",
        a.sequence_parallel ? " + sequence parallel" : "", shardtorch::strategy_name(sharded.strategy()), world->size(),
        dp, a.tp, static_cast<long long>(params), percentile(step_ms, 0.5), percentile(forward_ms, 0.5),
        percentile(backward_ms, 0.5), percentile(optimizer_ms, 0.5), r["tokens_per_s"].as_double(),
        shardtorch::format_bytes(r["bytes_sent_per_step"].as_int64()).c_str(),
        shardtorch::format_bytes(tp_comm.total_bytes_sent() / a.steps).c_str(),
        shardtorch::format_bytes(dp_comm.total_bytes_sent() / a.steps).c_str());
  return 0;
}

int run(const Args& a) {
  if (a.pp > 0) return run_pipeline(a);
  if (a.tp > 0) return run_tensor_parallel(a);
  torch::manual_seed(0);
  if (!a.save_init.empty()) {  // one process: the initial weights, unsharded
    gpt::GPT model(a.cfg);
    auto world = shardtorch::World::from_env();
    TORCH_CHECK(world->size() == 1, "gpt_bench --save-init runs as one process, not ", world->size());
    shardtorch::shard(*model, world, shardtorch::ShardOptions().strategy(shardtorch::Strategy::NoShard));
    shardtorch::save_full_state_dict(*model, a.save_init);
    std::cout << "gpt_bench: initial weights (" << count_params(*model) << " parameters) written to " << a.save_init
              << "\n";
    return 0;
  }
  auto world = shardtorch::World::from_env();
  const bool lead = world->rank() == 0;
  // One core a rank on the CPU (ranks share the machine); with an accelerator,
  // host work (offload's gradients and CPU Adam) gets every core unless told.
  if (a.threads > 0) {
    at::set_num_threads(a.threads);
  } else if (world->device().is_cpu()) {
    at::set_num_threads(1);
  }
  const bool plain = a.strategy == "plain";
  const int64_t baseline_rss = process_memory::resident_bytes();  // the process before the model exists
  TORCH_CHECK(!a.deferred || a.strategy != "plain", "gpt_bench: --deferred needs a shardtorch strategy");
  // Deferred: no parameter memory until shard() makes each unit's shards.
  gpt::GPT model = a.deferred ? shardtorch::deferred([&] { return gpt::GPT(a.cfg); }) : gpt::GPT(a.cfg);
  if (!a.deferred) model->to(world->device());  // cuda:LOCAL_RANK under NCCL
  const int64_t params = count_params(*model);
  auto options = shardtorch::ShardOptions()
                     .strategy(plain ? shardtorch::Strategy::NoShard : shardtorch::parse_strategy(a.strategy))
                     .bucket_mb(a.bucket_mb)
                     .cpu_offload(a.offload)
                     .prefetch(a.prefetch)
                     .activation_checkpointing(a.recompute);
  if (options.strategy() == shardtorch::Strategy::HybridShard) options.hybrid_shard_size(a.hybrid_shard_size);
  if (a.bf16) {
    options.mixed_precision(
        shardtorch::MixedPrecision().param_dtype(at::kBFloat16).reduce_dtype(at::kBFloat16).output_dtype(at::kFloat));
  }
  TORCH_CHECK(!plain || world->size() == 1,
              "gpt_bench: --strategy plain (LibTorch alone, no shardtorch) runs as "
              "one process, not ",
              world->size());
  TORCH_CHECK(!plain || (!a.offload && !a.prefetch && !a.recompute && a.init.empty()),
              "gpt_bench: --strategy plain takes none of --offload, --prefetch, --activation-checkpointing, --init");
  // plain: the model as LibTorch trains it alone; under --bf16, autocast to
  // bf16 on the device with fp32 parameters (LibTorch's mixed precision).
  std::optional<shardtorch::ShardedModel> sharded;
  if (!plain) sharded.emplace(shardtorch::shard(*model, world, options));
  if (!a.init.empty()) shardtorch::load_full_state_dict(*model, a.init);
  auto adamw = adamw_options(a);
  // Offloaded masters step on the CPU: there the fused kernel is the one to use.
  const bool fused = a.fused_adam || a.offload;
  TORCH_CHECK(!fused || !plain, "gpt_bench: --fused-adam is shardtorch's; --strategy plain uses torch::optim::AdamW");
  std::unique_ptr<shardtorch::ShardedOptimizer> opt;
  std::unique_ptr<torch::optim::AdamW> plain_opt;
  if (plain) {
    std::vector<at::Tensor> unique;  // parameters() lists the tied head weight under both names
    std::set<const void*> seen;
    for (const auto& p : model->parameters())
      if (seen.insert(p.unsafeGetTensorImpl()).second) unique.push_back(p);
    plain_opt = std::make_unique<torch::optim::AdamW>(unique, adamw);
  } else {
    opt = fused ? shardtorch::ShardedOptimizer::make<shardtorch::FusedAdamW>(*model, adamw)
                : shardtorch::AdamW(*model, adamw);
    if (a.overlap_step) opt->overlap_with_backward();
  }
  const bool autocast = plain && a.bf16 && !world->device().is_cpu();
  TORCH_CHECK(!plain || !a.bf16 || autocast, "gpt_bench: --strategy plain --bf16 is autocast on an accelerator");
  if (autocast) {
    at::autocast::set_autocast_enabled(world->device().type(), true);
    at::autocast::set_autocast_dtype(world->device().type(), at::kBFloat16);
  }

  // Phases are host times: exact on CPU; on an accelerator the forward and
  // backward figures are mostly launch time (only the whole step is synced).
  std::vector<double> losses, step_ms, forward_ms, backward_ms, optimizer_ms;
  int64_t sent = 0;                    // by the library during the measured steps
  int64_t to_device = 0, to_host = 0;  // offload copies during the measured steps
  int64_t exchanges = 0;               // of the collective check on the world's group, during the measured steps
  const int total = a.warmup + a.steps;
  // --profile: the first measured step under LibTorch's profiler (CPU ops and,
  // on CUDA, kernels and copies), saved as a Chrome trace per rank.
  const int profiled = a.profile.empty() ? -1 : a.warmup;
  using torch::autograd::profiler::ProfilerConfig;
  using torch::autograd::profiler::ProfilerState;
  const ProfilerConfig prof_cfg(ProfilerState::KINETO);
  std::set<torch::autograd::profiler::ActivityType> prof_acts{torch::autograd::profiler::ActivityType::CPU};
  if (world->device().is_cuda()) prof_acts.insert(torch::autograd::profiler::ActivityType::CUDA);
  for (int s = 0; s < total; ++s) {
    if (s == a.warmup) {
      if (sharded) sharded->reset_peak_memory();
      reset_device_peak(world->device());
    }
    at::Tensor tokens = batch_tokens(a, s, world->size(), world->rank()).to(world->device());
    world->barrier();  // ranks start the step together
    const int64_t bytes0 = sharded ? sharded->comm_stats().total_bytes_sent() : 0;
    const int64_t exchanges0 = world->comm().check_exchanges();
    const auto traffic0 = sharded ? sharded->stats().offload : shardtorch::ShardStats::OffloadTraffic{};
    if (s == profiled) {
      if (!world->device().is_cpu()) torch::cuda::synchronize(world->device().index());
      torch::autograd::profiler::prepareProfiler(prof_cfg, prof_acts);
      torch::autograd::profiler::enableProfiler(prof_cfg, prof_acts);
    }
    using clock = std::chrono::steady_clock;
    auto since = [](clock::time_point t) {
      return std::chrono::duration<double, std::milli>(clock::now() - t).count();
    };
    auto t0 = clock::now();
    at::Tensor loss;
    {
      RECORD_USER_SCOPE("gpt_bench.forward");
      plain ? plain_opt->zero_grad() : opt->zero_grad();
      loss = gpt::lm_loss(model(tokens), tokens);
      if (autocast) at::autocast::clear_cache();
    }
    const double fwd = since(t0);
    {
      RECORD_USER_SCOPE("gpt_bench.backward");
      loss.backward();
    }
    const double bwd = since(t0) - fwd;
    {
      RECORD_USER_SCOPE("gpt_bench.optimizer");
      plain ? (void)plain_opt->step() : opt->step();
      if (!world->device().is_cpu()) torch::cuda::synchronize(world->device().index());  // the step, not its launch
    }
    double ms = since(t0);
    if (s == profiled) {
      auto result = torch::autograd::profiler::disableProfiler();
      const std::string path = a.profile + ".rank" + std::to_string(world->rank()) + ".json";
      result->save(path);
      if (lead) std::fprintf(stderr, "gpt_bench: step %d profiled into %s\n", s + 1, path.c_str());
    }
    if (s >= a.warmup) {
      step_ms.push_back(ms);
      forward_ms.push_back(fwd);
      backward_ms.push_back(bwd);
      optimizer_ms.push_back(ms - fwd - bwd);
      if (sharded) {
        sent += sharded->comm_stats().total_bytes_sent() - bytes0;
        const auto traffic1 = sharded->stats().offload;
        to_device += traffic1.to_device_bytes - traffic0.to_device_bytes;
        to_host += traffic1.to_host_bytes - traffic0.to_host_bytes;
      }
    }
    at::Tensor mean = loss.detach().to(at::kDouble).reshape({1}).clone();
    world->comm().all_reduce(mean, c10d::ReduceOp::SUM, "gpt_bench loss");
    losses.push_back(mean.item<double>() / world->size());
    if (s >= a.warmup) exchanges += world->comm().check_exchanges() - exchanges0;
    if (lead && !a.quiet && (s + 1 == total || (s + 1) % 10 == 0)) {
      std::fprintf(stderr, "gpt_bench: step %d/%d loss %.4f %.1f ms\n", s + 1, total, losses.back(), ms);
    }
  }

  const auto m = sharded ? sharded->memory() : shardtorch::MemorySnapshot{};
  const DevicePeak dev_peak = device_peak(world->device());
  const int64_t model_state = model_state_bytes(m);
  const double mean_ms = mean_of(step_ms);
  json::object config = config_json(a);
  config["dtype"] = a.bf16 ? "bfloat16" : "float32";
  config["fused_adam"] = fused;
  config["offload"] = a.offload;
  config["overlap_step"] = a.overlap_step;
  config["bucket_mb"] = a.bucket_mb;
  config["prefetch"] = a.prefetch;
  json::object r{
      {"impl", "shardtorch"},
      {"strategy", plain ? "plain" : shardtorch::strategy_name(sharded->strategy())},
      {"world", world->size()},
      {"rank", world->rank()},
      {"config", config},
      {"params", params},
      {"warmup", a.warmup},
      {"steps", a.steps},
      {"losses", json::value_from(losses)},
      {"step_ms", json::value_from(step_ms)},
      {"p50_ms", percentile(step_ms, 0.5)},
      {"p95_ms", percentile(step_ms, 0.95)},
      {"phase_p50_ms",
       {{"forward", percentile(forward_ms, 0.5)},
        {"backward", percentile(backward_ms, 0.5)},
        {"optimizer", percentile(optimizer_ms, 0.5)}}},
      {"tokens_per_s", mean_ms > 0 ? world->size() * a.batch * a.cfg.seq_len / (mean_ms / 1e3) : 0.0},
      {"peak_rss_bytes", process_memory::peak_resident_bytes()},
      {"device_peak_allocated_bytes", dev_peak.allocated},
      {"device_peak_reserved_bytes", dev_peak.reserved},
      {"threads", at::get_num_threads()},
      {"baseline_rss_bytes", baseline_rss},
      {"model_state_bytes", model_state},
      {"memory", memory_json(m)},
      {"peak_gathered_units", m.peak_gathered_units},
      {"bytes_sent_per_step", a.steps > 0 ? sent / a.steps : 0},
      {"offload_to_device_bytes_per_step", a.steps > 0 ? to_device / a.steps : 0},
      {"offload_to_host_bytes_per_step", a.steps > 0 ? to_host / a.steps : 0},
      {"check_collectives", world->checks_collectives()},
      {"check_exchanges_per_step", a.steps > 0 ? static_cast<double>(exchanges) / a.steps : 0.0},
  };
  write_report(a, *world, r);
  if (lead && !a.quiet) {
    std::printf(
        "gpt_bench: %s, %d ranks, %lld params: p50 %.1f ms (forward %.1f, backward %.1f, optimizer %.1f), "
        "p95 %.1f ms, %.0f tokens/s, model state %s/rank, peak RSS %s, device peak %s\n",
        plain ? "plain" : shardtorch::strategy_name(sharded->strategy()), world->size(), static_cast<long long>(params),
        percentile(step_ms, 0.5), percentile(forward_ms, 0.5), percentile(backward_ms, 0.5),
        percentile(optimizer_ms, 0.5), percentile(step_ms, 0.95), r["tokens_per_s"].as_double(),
        shardtorch::format_bytes(model_state).c_str(),
        shardtorch::format_bytes(process_memory::peak_resident_bytes()).c_str(),
        shardtorch::format_bytes(dev_peak.allocated).c_str());
    if (world->checks_collectives())
      std::printf("gpt_bench: collective check on: %.2f exchanges per step on the world's group\n",
                  r["check_exchanges_per_step"].as_double());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  po::options_description desc("gpt_bench: train the example GPT and report time, memory and traffic per rank");
  desc.add_options()("help", "this text")(
      "strategy", po::value(&a.strategy)->default_value(a.strategy),
      "full_shard|shard_grad_op|optimizer_only|no_shard|hybrid_shard, or plain: LibTorch alone (one process)")(
      "hybrid-shard-size", po::value(&a.hybrid_shard_size)->default_value(0), "ranks per shard group (hybrid_shard)")(
      "layers", po::value(&a.cfg.n_layer)->default_value(2), "transformer blocks")(
      "d-model", po::value(&a.cfg.d_model)->default_value(32), "model width")(
      "heads", po::value(&a.cfg.n_head)->default_value(4), "attention heads")(
      "vocab", po::value(&a.cfg.vocab)->default_value(64), "vocabulary size")(
      "seq", po::value(&a.cfg.seq_len)->default_value(16), "sequence length")(
      "batch", po::value(&a.batch)->default_value(a.batch), "sequences per rank per step")(
      "steps", po::value(&a.steps)->default_value(a.steps), "measured steps")(
      "warmup", po::value(&a.warmup)->default_value(a.warmup), "steps before measuring")(
      "lr", po::value(&a.lr)->default_value(a.lr), "AdamW learning rate")(
      "bucket-mb", po::value(&a.bucket_mb)->default_value(a.bucket_mb), "bucket size in MiB")(
      "bf16", po::bool_switch(&a.bf16), "bf16 parameters and reductions, fp32 masters")(
      "offload", po::bool_switch(&a.offload),
      "CPU offload of masters, gradients and optimizer state (implies --fused-adam)")(
      "overlap-step", po::bool_switch(&a.overlap_step),
      "with --offload: update each unit's shard on the host while backward goes on (overlap_with_backward)")(
      "deferred", po::bool_switch(&a.deferred),
      "construct the model deferred (shard() initialises one unit at a time)")(
      "fused-adam", po::bool_switch(&a.fused_adam), "shardtorch::FusedAdamW (CPU) instead of torch::optim::AdamW")(
      "prefetch", po::bool_switch(&a.prefetch), "full_shard/hybrid_shard: all-gather the next unit while one computes")(
      "activation-checkpointing", po::bool_switch(&a.recompute),
      "recompute the blocks' activations in backward instead of keeping them")(
      "threads", po::value(&a.threads)->default_value(a.threads),
      "ATen threads per rank (0: 1 on the CPU, ATen's default with an accelerator)")(
      "profile", po::value(&a.profile),
      "profile the first measured step into PREFIX.rankR.json (Chrome trace); with --pp, the last step's "
      "pipeline timeline into PREFIX.timeline.json")("init", po::value(&a.init),
                                                     "load initial weights from this full state dict")(
      "save-init", po::value(&a.save_init), "write the initial weights here and exit (one process)")(
      "pp", po::value(&a.pp)->default_value(a.pp),
      "pipeline ranks (0: no pipeline); the world is pp x dp, stages sharded over dp with --strategy")(
      "schedule", po::value(&a.schedule)->default_value(a.schedule), "with --pp: gpipe|1f1b|interleaved_1f1b")(
      "microbatches", po::value(&a.microbatches)->default_value(a.microbatches), "with --pp: micro-batches per step")(
      "stand-in-ms", po::value(&a.stand_in_ms)->default_value(a.stand_in_ms),
      "with --pp: each layer sleeps this long in forward (twice in backward) besides its compute")(
      "chunks", po::value(&a.chunks)->default_value(a.chunks), "with --pp: chunks per pipeline rank")(
      "split-at", po::value(&a.split_at), "with --pp: layers that begin stages 1.. (comma-separated)")(
      "tp", po::value(&a.tp)->default_value(a.tp),
      "tensor-parallel ranks (0: none); the world is dp x tp, the GPT split by gpt::tp_plan, slices sharded over dp "
      "with --strategy")("sequence-parallel", po::bool_switch(&a.sequence_parallel),
                         "with --tp: Megatron-LM's sequence parallelism")(
      "report", po::value(&a.report), "write PREFIX.rankR.json per rank")("quiet", po::bool_switch(&a.quiet),
                                                                          "no progress lines");
  try {
    po::variables_map vm;
    po::store(po::parse_command_line(argc, argv, desc), vm);
    if (vm.count("help")) {
      std::cout << desc << "\n";
      return 0;
    }
    po::notify(vm);
    TORCH_CHECK(a.steps >= 1 && a.warmup >= 0 && a.batch >= 1 && a.threads >= 0,
                "gpt_bench: need --steps >= 1, --warmup >= 0, --batch >= 1, --threads >= 0");
    TORCH_CHECK(a.cfg.n_layer >= 1 && a.cfg.d_model >= 1 && a.cfg.n_head >= 1 && a.cfg.vocab >= 1 && a.cfg.seq_len >= 2,
                "gpt_bench: need --layers, --d-model, --heads and --vocab >= 1 and --seq >= 2");
    TORCH_CHECK(a.tp >= 0 && !(a.tp > 0 && a.pp > 0) && (a.tp > 0 || !a.sequence_parallel),
                "gpt_bench: --tp takes no --pp here (examples/tp_gpt runs both); --sequence-parallel needs --tp");
    TORCH_CHECK(a.cfg.d_model % a.cfg.n_head == 0, "gpt_bench: --d-model ", a.cfg.d_model,
                " is not a multiple of --heads ", a.cfg.n_head);
    return run(a);
  } catch (...) {
    return cli::report_error("gpt_bench");
  }
}
