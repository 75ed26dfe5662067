// Tensor parallelism: trains the example GPT with its attention heads, MLP
// columns and vocabulary split across --tp ranks, sharded over the
// data-parallel ranks, and with --pp in pipeline stages too (a 3-D mesh)
// (docs/parallelism.md, "Tensor parallelism").
//
//   torchrun --no-python --standalone --nproc-per-node 4 build/examples/tp_gpt --tp 2 --steps 20
//   torchrun --no-python --standalone --nproc-per-node 8 build/examples/tp_gpt --tp 2 --pp 2 --sequence-parallel
//   torchrun --no-python --standalone --nproc-per-node 4 build/examples/tp_gpt --tp 2 --checkpoint ck
//   torchrun --no-python --standalone --nproc-per-node 2 build/examples/tp_gpt --tp 1 --checkpoint ck --resume
//
// --checkpoint saves a sharded checkpoint after the last step, under the
// unsplit model's names: --resume loads it first, at any --tp, --pp and
// world size (docs/checkpoints.md, "Tensor parallelism").
// The ranks form a mesh of pp x dp x tp (dp = world / (pp * tp)). Prints per
// step the loss (the mean over the batch) and the step time, then each rank's
// memory and a summary. Exits 2 when the loss did not fall (not checked
// after --resume).
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <optional>

#include "cli.h"
#include "gpt.h"
#include "shardtorch/shardtorch.h"

namespace {

namespace po = boost::program_options;

struct Args {
  int steps = 20;
  int tp = 2;
  int pp = 1;
  int64_t batch = 16;  // per data-parallel rank, per step
  int microbatches = 4;
  bool sequence_parallel = false;
  std::string strategy;  // full_shard over two or more dp ranks, no_shard over one
  double lr = 3e-3;
  std::string checkpoint;  // saved after the last step
  bool resume = false;     // from `checkpoint`, before the first step
  gpt::Config cfg;
};

std::optional<Args> parse(int argc, char** argv) {
  Args a;
  a.cfg.n_layer = 4;
  po::options_description desc("options");
  desc.add_options()("help", "this text")("steps", cli::number_option(a.steps, "--steps"), "optimizer steps")(
      "tp", cli::number_option(a.tp, "--tp"), "tensor-parallel ranks (must divide the heads, d_ff and the vocabulary)")(
      "pp", cli::number_option(a.pp, "--pp"), "pipeline ranks (1: no pipeline)")(
      "batch", cli::number_option(a.batch, "--batch"), "sequences per data-parallel rank per step")(
      "microbatches", cli::number_option(a.microbatches, "--microbatches"), "micro-batches per step (with --pp)")(
      "sequence-parallel", po::bool_switch(&a.sequence_parallel),
      "norms and residual adds on a slice of the sequence (Megatron-LM's sequence parallelism)")(
      "strategy", po::value(&a.strategy),
      "how the slices are sharded over dp (default: full_shard, or no_shard over one dp rank)")(
      "layers", cli::number_option(a.cfg.n_layer, "--layers"), "transformer blocks")(
      "d-model", cli::number_option(a.cfg.d_model, "--d-model"), "model width")("lr", cli::number_option(a.lr, "--lr"),
                                                                                "learning rate (AdamW)")(
      "checkpoint", po::value(&a.checkpoint), "a sharded checkpoint directory written after the last step")(
      "resume", po::bool_switch(&a.resume), "load --checkpoint before the first step (its step numbers go on)");
  if (!cli::parse_command_line(argc, argv, desc, "tp_gpt: trains the example GPT with tensor parallelism (torchrun)"))
    return std::nullopt;
  if (a.resume && a.checkpoint.empty()) throw std::invalid_argument("tp_gpt: --resume needs --checkpoint DIR");
  return a;
}

// Sequences that count (as train_gpt's): token t = (start + stride * t) mod vocab.
torch::Tensor batch_for(int64_t batch, const gpt::Config& c, int step, int replica) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(1000003ull * step + 7919ull * replica + 17);
  auto start = torch::randint(0, c.vocab, {batch, 1}, g, torch::kLong);
  auto stride = torch::randint(1, 4, {batch, 1}, g, torch::kLong);
  return (start + stride * torch::arange(c.seq_len, torch::kLong).unsqueeze(0)).remainder(c.vocab);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::optional<Args> parsed = parse(argc, argv);
    if (!parsed) return 0;
    const Args& args = *parsed;
    auto world = shardtorch::World::from_env();
    const bool lead = world->rank() == 0;
    TORCH_CHECK(args.tp >= 1 && args.pp >= 1 && world->size() % (args.tp * args.pp) == 0, "tp_gpt: --pp ", args.pp,
                " x --tp ", args.tp, " does not divide the world's ", world->size(), " ranks");
    const int dp = world->size() / (args.tp * args.pp);
    auto mesh = shardtorch::DeviceMesh::create(world, {{"pp", args.pp}, {"dp", dp}, {"tp", args.tp}});
    auto tp = (*mesh)["tp"];

    // Every rank builds the whole model with the same seed, then keeps its
    // slices: the split parameters are the full model's, cut.
    torch::manual_seed(0);
    gpt::GPT model(args.cfg);
    const auto report = shardtorch::parallelize(*model, tp, gpt::tp_plan(args.cfg, args.sequence_parallel));
    auto shard =
        shardtorch::ShardOptions().strategy(shardtorch::parse_strategy(cli::strategy_or_default(args.strategy, dp)));

    std::optional<shardtorch::Pipeline> pipe;
    std::optional<shardtorch::ShardedModel> sharded;
    if (args.pp > 1) {
      pipe.emplace(gpt::pipeline_layers(model), mesh,
                   shardtorch::PipelineOptions().microbatches(args.microbatches).shard(shard));
      sharded = pipe->sharded();
    } else {
      sharded = shardtorch::shard(model, (*mesh)["dp"], shard);
    }
    torch::nn::Module& root = pipe ? pipe->module() : *model;
    auto opt = shardtorch::AdamW(root, torch::optim::AdamWOptions(args.lr).weight_decay(0.01));
    if (lead) {
      std::cout << "tp_gpt: GPT with " << args.cfg.n_layer << " blocks, d_model " << args.cfg.d_model << ", "
                << world->size() << " ranks: " << mesh->describe()
                << (args.sequence_parallel ? ", sequence parallel" : "") << ", slices "
                << shardtorch::strategy_name(shard.strategy()) << " over dp; " << report.split.size()
                << " parameters split\n"
                << std::flush;
    }
    auto loss_fn = [&](const torch::Tensor& logits, const torch::Tensor& tokens) {
      return gpt::lm_loss_tp(logits, tokens, tp);
    };
    int first = 0;
    if (args.resume) {
      first = static_cast<int>(pipe ? shardtorch::load_sharded_checkpoint(*pipe, opt.get(), args.checkpoint)
                                    : shardtorch::load_sharded_checkpoint(*model, opt.get(), args.checkpoint));
      if (lead) std::cout << "resumed from " << args.checkpoint << " at step " << first << "\n" << std::flush;
    }
    const int replica = mesh->coordinate("dp");
    std::vector<double> losses, times;
    for (int step = first; step < first + args.steps; ++step) {
      // Every rank of a tensor-parallel group reads the same batch.
      auto tokens = batch_for(args.batch, args.cfg, step, replica);
      const auto t0 = std::chrono::steady_clock::now();
      opt->zero_grad();
      torch::Tensor loss;
      if (pipe) {
        loss = pipe->step(pipe->is_first_stage() ? tokens : torch::Tensor(),
                          pipe->is_last_stage() ? tokens : torch::Tensor(), loss_fn);
      } else {
        loss = loss_fn(model(tokens), tokens);
        loss.backward();
      }
      opt->step();
      const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      auto mean = loss.detach().reshape({1}).clone();
      (*mesh)["dp"]->comm().all_reduce(mean, c10d::ReduceOp::SUM, "tp_gpt loss");
      losses.push_back(mean.item<double>() / dp);
      times.push_back(dt);
      if (lead) std::printf("step %3d  loss %.4f  step_time %.1f ms\n", step, losses.back(), dt * 1e3);
    }
    if (!args.checkpoint.empty()) {
      const int64_t last = first + args.steps;
      if (pipe)
        shardtorch::save_sharded_checkpoint(*pipe, opt.get(), args.checkpoint, last);
      else
        shardtorch::save_sharded_checkpoint(*model, opt.get(), args.checkpoint, last);
      if (lead) std::cout << "saved " << args.checkpoint << " at step " << last << "\n" << std::flush;
    }
    auto m = sharded->memory();
    auto lines = world->comm().all_gather_strings(
        "rank " + std::to_string(world->rank()) + " (tp " + std::to_string(mesh->coordinate("tp")) +
            "): sharded_params " + shardtorch::format_bytes(m.cur(shardtorch::Mem::ShardedParams)) +
            " | optimizer_state " + shardtorch::format_bytes(m.cur(shardtorch::Mem::OptimizerState)) +
            " | peak gathered_params " + shardtorch::format_bytes(m.max(shardtorch::Mem::GatheredParams)),
        "tp_gpt memory");
    if (lead) {
      std::cout << "memory:\n";
      for (const auto& l : lines) std::cout << "  " << l << "\n";
      std::vector<double> sorted = times;
      std::sort(sorted.begin(), sorted.end());
      std::printf("summary: %zu steps, median step %.1f ms, loss %.4f -> %.4f\n", times.size(),
                  sorted.empty() ? 0.0 : sorted[sorted.size() / 2] * 1e3, losses.empty() ? 0.0 : losses.front(),
                  losses.empty() ? 0.0 : losses.back());
    }
    // A resumed run starts where the loss already fell: nothing to check.
    const bool fell = args.resume || losses.size() < 10 || losses.back() < 0.9 * losses.front();
    if (lead && !fell) std::printf("loss DID NOT FALL\n");
    return fell ? 0 : 2;
  } catch (...) {
    return cli::report_error("tp_gpt");
  }
}
