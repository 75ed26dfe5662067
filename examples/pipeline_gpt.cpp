// Pipeline parallelism: trains the example GPT with its layers cut into
// stages on different ranks and micro-batches flowing through them, each
// stage sharded over the data-parallel ranks that hold it (docs/parallelism.md).
//
//   torchrun --no-python --standalone --nproc-per-node 4 build/examples/pipeline_gpt --pp 2 --steps 20
//
// The ranks form a mesh of --pp pipeline ranks times (world / pp)
// data-parallel ones. The model is built deferred (no rank allocates a stage
// it does not run). Prints per step the loss (the mean over the batch), the
// step time and this rank's idle share, then a summary; with --timeline FILE
// writes every rank's actions of the last step as JSON (and a picture of
// them with --plot FILE.png, through bench/pipeline/plot_timeline.py).
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <optional>

#include "cli.h"
#include "gpt.h"
#include "shardtorch/shardtorch.h"

namespace {

namespace po = boost::program_options;

struct Args {
  int steps = 20;
  int pp = 2;
  int64_t batch = 16;  // per data-parallel rank, per step
  int microbatches = 4;
  int chunks = 1;
  std::string schedule = "1f1b";
  std::string strategy;  // full_shard over two or more dp ranks, no_shard over one
  double lr = 3e-3;
  bool bf16 = false;
  bool recompute = false;
  std::string timeline;  // JSON of the last step's actions ("" for none)
  std::string plot;      // PNG drawn from it ("" for none)
  std::string python = "python3";
  gpt::Config cfg;
};

std::optional<Args> parse(int argc, char** argv) {
  Args a;
  a.cfg.n_layer = 4;
  po::options_description desc("options");
  desc.add_options()("help", "this text")("steps", cli::number_option(a.steps, "--steps"), "optimizer steps")(
      "pp", cli::number_option(a.pp, "--pp"), "pipeline ranks (the world size must be a multiple)")(
      "batch", cli::number_option(a.batch, "--batch"), "sequences per data-parallel rank per step")(
      "microbatches", cli::number_option(a.microbatches, "--microbatches"), "micro-batches per step")(
      "chunks", cli::number_option(a.chunks, "--chunks"), "chunks per pipeline rank (interleaved_1f1b: 2 or more)")(
      "schedule", po::value(&a.schedule)->default_value(a.schedule), "gpipe|1f1b|interleaved_1f1b")(
      "strategy", po::value(&a.strategy),
      "how each stage is sharded over its data-parallel ranks (default: full_shard, or no_shard without data "
      "parallelism)")("layers", cli::number_option(a.cfg.n_layer, "--layers"), "transformer blocks")(
      "d-model", cli::number_option(a.cfg.d_model, "--d-model"), "model width")(
      "lr", cli::number_option(a.lr, "--lr"), "learning rate (AdamW)")("bf16", po::bool_switch(&a.bf16),
                                                                       "bf16 compute, fp32 reduction and masters")(
      "activation-checkpointing", po::bool_switch(&a.recompute), "recompute the blocks' activations in backward")(
      "timeline", po::value(&a.timeline), "write the last step's actions of every rank to FILE (JSON)")(
      "plot", po::value(&a.plot), "draw the timeline as FILE.png (needs --timeline and matplotlib)")(
      "python", po::value(&a.python)->default_value(a.python), "Python with matplotlib, for --plot");
  if (!cli::parse_command_line(argc, argv, desc, "pipeline_gpt: trains the example GPT in pipeline stages (torchrun)"))
    return std::nullopt;
  if (!a.plot.empty() && a.timeline.empty()) throw std::invalid_argument("pipeline_gpt: --plot needs --timeline FILE");
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
    TORCH_CHECK(args.pp >= 1 && world->size() % args.pp == 0, "pipeline_gpt: --pp ", args.pp,
                " does not divide the world's ", world->size(), " ranks");
    const int dp = world->size() / args.pp;
    auto mesh = shardtorch::DeviceMesh::create(world, {{"pp", args.pp}, {"dp", dp}});

    torch::manual_seed(0);
    gpt::GPT model = shardtorch::deferred([&] { return gpt::GPT(args.cfg); });  // no parameter allocated yet
    auto shard = shardtorch::ShardOptions()
                     .strategy(shardtorch::parse_strategy(cli::strategy_or_default(args.strategy, dp)))
                     .activation_checkpointing(args.recompute);
    if (args.bf16)
      shard.mixed_precision(
          shardtorch::MixedPrecision().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat).output_dtype(at::kFloat));
    shardtorch::Pipeline pipe(gpt::pipeline_layers(model), mesh,
                              shardtorch::PipelineOptions()
                                  .schedule(shardtorch::parse_schedule(args.schedule))
                                  .microbatches(args.microbatches)
                                  .chunks_per_rank(args.chunks)
                                  .shard(shard)
                                  .record_timeline(true));
    auto opt = shardtorch::AdamW(pipe.module(), torch::optim::AdamWOptions(args.lr).weight_decay(0.01));
    if (lead) {
      std::cout << "pipeline_gpt: GPT with " << args.cfg.n_layer << " blocks, d_model " << args.cfg.d_model << ", "
                << world->size() << " ranks: " << mesh->describe() << ", schedule " << args.schedule << " with "
                << args.microbatches << " micro-batches"
                << (args.chunks > 1 ? ", " + std::to_string(args.chunks) + " chunks per rank" : "") << ", stages "
                << shardtorch::strategy_name(shard.strategy()) << " over dp\n";
      const auto layers = pipe.stage_layers();
      for (size_t s = 0; s < layers.size(); ++s) {
        std::cout << "  stage " << s << " (pipeline rank " << pipe.plan().rank_of(static_cast<int>(s)) << "):";
        for (const auto& l : layers[s]) std::cout << " " << l;
        std::cout << "\n";
      }
      for (const auto& [a, b] : pipe.tied_parameters())
        std::cout << "  tied across stages: " << a << " = " << b << " (gradients summed after each step)\n";
      std::cout << std::flush;
    }
    auto loss_fn = [](const torch::Tensor& logits, const torch::Tensor& tokens) {
      return gpt::lm_loss(logits, tokens);
    };
    const int replica = mesh->coordinate("dp");
    std::vector<double> losses, times, idle;
    for (int step = 0; step < args.steps; ++step) {
      // The first and the last stage read the same batch (the pipeline's share of the step's).
      const bool reads = pipe.is_first_stage() || pipe.is_last_stage();
      auto tokens = reads ? batch_for(args.batch, args.cfg, step, replica) : torch::Tensor();
      const auto t0 = std::chrono::steady_clock::now();
      opt->zero_grad();
      auto loss = pipe.step(pipe.is_first_stage() ? tokens : torch::Tensor(),
                            pipe.is_last_stage() ? tokens : torch::Tensor(), loss_fn);
      opt->step();
      const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      // This rank's idle share of the step: the time outside forwards and backwards.
      double busy = 0, span = 0;
      for (const auto& e : pipe.timeline()) {
        span = std::max(span, e.end);
        if (e.action.kind == shardtorch::pipeline::ActionKind::Forward ||
            e.action.kind == shardtorch::pipeline::ActionKind::Backward)
          busy += e.end - e.start;
      }
      auto mean = loss.reshape({1}).clone();
      mesh->group("dp")->comm().all_reduce(mean, c10d::ReduceOp::SUM, "pipeline_gpt loss");
      losses.push_back(mean.item<double>() / dp);
      times.push_back(dt);
      idle.push_back(span > 0 ? 1.0 - busy / span : 0.0);
      if (lead)
        std::printf("step %3d  loss %.4f  step_time %.1f ms  idle (rank 0) %.0f%%\n", step, losses.back(), dt * 1e3,
                    100 * idle.back());
    }
    auto m = pipe.sharded().memory();
    auto lines = world->comm().all_gather_strings(
        "rank " + std::to_string(world->rank()) + " (stages " +
            [&] {
              std::string s;
              for (int st : pipe.stages()) s += (s.empty() ? "" : ",") + std::to_string(st);
              return s;
            }() +
            "): sharded_params " + shardtorch::format_bytes(m.cur(shardtorch::Mem::ShardedParams)) +
            " | replicated_params " + shardtorch::format_bytes(m.cur(shardtorch::Mem::ReplicatedParams)) +
            " | optimizer_state " + shardtorch::format_bytes(m.cur(shardtorch::Mem::OptimizerState)) +
            " | peak gathered_params " + shardtorch::format_bytes(m.max(shardtorch::Mem::GatheredParams)),
        "pipeline_gpt memory");
    if (!args.timeline.empty()) pipe.write_timeline(args.timeline);
    if (lead) {
      std::cout << "memory:\n";
      for (const auto& l : lines) std::cout << "  " << l << "\n";
      std::vector<double> sorted = times;
      std::sort(sorted.begin(), sorted.end());
      const double theory = shardtorch::pipeline::theoretical_bubble(pipe.plan());
      std::printf(
          "summary: %zu steps, median step %.1f ms, loss %.4f -> %.4f, rank 0 idle %.0f%% in the last step "
          "(the schedule's bubble in theory: %.0f%%)\n",
          times.size(), sorted.empty() ? 0.0 : sorted[sorted.size() / 2] * 1e3, losses.empty() ? 0.0 : losses.front(),
          losses.empty() ? 0.0 : losses.back(), idle.empty() ? 0.0 : 100 * idle.back(), 100 * theory);
      if (!args.timeline.empty()) std::cout << "timeline: " << args.timeline << std::endl;
      if (!args.plot.empty()) {
        const std::string cmd =
            args.python + " " + std::string(SHARDTORCH_PLOT_TIMELINE) + " " + args.timeline + " " + args.plot;
        const int rc = std::system(cmd.c_str());
        std::cout << (rc == 0 ? "plot: " + args.plot : "plot failed: " + cmd) << std::endl;
      }
    }
    auto done = torch::zeros({1});
    world->comm().all_reduce(done, c10d::ReduceOp::SUM, "pipeline_gpt exit");
    const bool fell = losses.size() < 10 || losses.back() < 0.9 * losses.front();
    if (lead && !fell) std::printf("loss DID NOT FALL\n");
    return fell ? 0 : 2;
  } catch (...) {
    return cli::report_error("pipeline_gpt");
  }
}
