// The main job: trains the example GPT with FullShard (ZeRO-3) on a synthetic
// task whose loss can fall, its data split across ranks with LibTorch's
// distributed sampler. Launch:
//
//   torchrun --no-python --standalone --nproc-per-node 2 build/examples/train_gpt --steps 40
//
// Prints per step one line (the loss, mean over ranks; step time; tokens/s),
// every --report-every steps and at the end the bytes each rank's library
// holds by category, and at the end a fingerprint of the parameters (a hash
// of their bytes) and a summary. Exits non-zero if the loss did not fall
// (runs of 10 steps or more).
//
// Checkpoints and resuming: --checkpoint DIR saves a sharded checkpoint
// (parameters, optimizer state, and the data-loader position as user state)
// every --save-every steps and at the end; --resume continues from DIR with
// the same data order, so a run stopped at step k and resumed reaches the same
// parameters, bitwise, as one that never stopped (same ranks and options).
// --export FILE writes a full state dict Python's safetensors can load.
//
//   torchrun --no-python --standalone --nproc-per-node 2 build/examples/train_gpt --steps 20 --checkpoint ck
//   torchrun --no-python --standalone --nproc-per-node 2 build/examples/train_gpt --steps 40 --checkpoint ck --resume
#include <torch/data.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <optional>
#include <sstream>

#include "cli.h"
#include "gpt.h"
#include "shardtorch/shardtorch.h"

namespace {

namespace po = boost::program_options;

// Sequences that count: token t = (start + stride * t) mod vocab, with a random
// start and a stride in 1..3. After two tokens the rest is determined, so a
// model that learns the rule drives the loss far below log(vocab).
class CountingDataset : public torch::data::datasets::Dataset<CountingDataset> {
 public:
  CountingDataset(int64_t size, int64_t vocab, int64_t seq_len) : size_(size), vocab_(vocab), seq_len_(seq_len) {}
  torch::data::Example<> get(size_t index) override {
    int64_t start = static_cast<int64_t>((index * 2654435761u) % vocab_);
    int64_t stride = 1 + static_cast<int64_t>((index / vocab_) % 3);
    auto t = (torch::arange(seq_len_, torch::kLong) * stride + start).remainder(vocab_);
    return {t, t};
  }
  torch::optional<size_t> size() const override { return size_; }

 private:
  int64_t size_, vocab_, seq_len_;
};

struct Args {
  int steps = 40;
  int64_t batch = 8;  // per rank, per optimizer step
  double lr = 3e-3;
  std::string strategy = "full_shard";
  int hybrid_shard_size = 1;
  bool bf16 = false;
  int accumulate = 1;       // micro-batches per step
  double clip = 0;          // 0: no clipping
  bool offload = false;     // CPU offload of masters, gradients, optimizer state (fused CPU AdamW)
  bool prefetch = false;    // all-gather the next unit while one computes
  bool recompute = false;   // activation checkpointing of the blocks
  int64_t dataset = 4096;   // sequences per epoch
  std::string checkpoint;   // sharded checkpoint directory ("" for none)
  int save_every = 0;       // steps between checkpoints (0: only at the end)
  bool resume = false;      // continue from `checkpoint` if it exists
  std::string export_path;  // full state dict written at the end ("" for none)
  int report_every = 10;    // steps between memory reports (0: only at the end)
  gpt::Config cfg;
};

// Nothing (and the caller exits) after --help.
std::optional<Args> parse(int argc, char** argv) {
  Args a;
  po::options_description desc("options");
  desc.add_options()("help", "this text")("steps", cli::number_option(a.steps, "--steps"), "optimizer steps")(
      "batch", cli::number_option(a.batch, "--batch"), "sequences per rank per step")(
      "lr", cli::number_option(a.lr, "--lr"), "learning rate (AdamW)")(
      "layers", cli::number_option(a.cfg.n_layer, "--layers"), "transformer blocks")(
      "d-model", cli::number_option(a.cfg.d_model, "--d-model"), "model width")(
      "strategy", po::value(&a.strategy)->default_value(a.strategy),
      "full_shard|shard_grad_op|optimizer_only|no_shard|hybrid_shard")(
      "hybrid-shard-size", cli::number_option(a.hybrid_shard_size, "--hybrid-shard-size"), "hybrid_shard group size")(
      "bf16", po::bool_switch(&a.bf16), "bf16 parameters in compute, fp32 reduction and masters")(
      "accumulate", cli::number_option(a.accumulate, "--accumulate"), "micro-batches per step")(
      "clip", cli::number_option(a.clip, "--clip"), "gradient norm clipping (0: none)")(
      "offload", po::bool_switch(&a.offload), "CPU offload (fused CPU AdamW)")(
      "prefetch", po::bool_switch(&a.prefetch), "all-gather the next unit while one computes")(
      "activation-checkpointing", po::bool_switch(&a.recompute), "recompute the blocks' activations in backward")(
      "dataset", cli::number_option(a.dataset, "--dataset"), "sequences per epoch")(
      "checkpoint", po::value(&a.checkpoint), "sharded checkpoint directory")(
      "save-every", cli::number_option(a.save_every, "--save-every"), "steps between checkpoints (0: only at the end)")(
      "resume", po::bool_switch(&a.resume), "continue from --checkpoint if it exists")(
      "export", po::value(&a.export_path), "full state dict written at the end (FILE.safetensors)")(
      "report-every", cli::number_option(a.report_every, "--report-every"),
      "steps between memory reports (0: only at the end)");
  if (!cli::parse_command_line(argc, argv, desc, "train_gpt: trains the example GPT, sharded (launch with torchrun)"))
    return std::nullopt;
  if (a.resume && a.checkpoint.empty()) throw std::invalid_argument("train_gpt: --resume needs --checkpoint DIR");
  return a;
}

// FNV-1a over the bytes of every parameter, in the module's order: equal
// fingerprints mean bitwise-equal parameters. Collective (gathers the shards).
uint64_t fingerprint(torch::nn::Module& model) {
  shardtorch::FullParams full(model);
  uint64_t h = 1469598103934665603ull;
  for (const auto& p : model.parameters()) {
    auto c = p.detach().contiguous();
    auto* b = static_cast<const unsigned char*>(c.data_ptr());
    for (size_t i = 0; i < c.nbytes(); ++i) h = (h ^ b[i]) * 1099511628211ull;
  }
  return h;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::optional<Args> parsed = parse(argc, argv);
    if (!parsed) return 0;
    const Args& args = *parsed;
    auto world = shardtorch::World::from_env();
    const bool lead = world->rank() == 0;
    torch::manual_seed(0);
    gpt::GPT model(args.cfg);
    TORCH_CHECK(args.accumulate >= 1 && args.batch % args.accumulate == 0, "train_gpt: --batch ", args.batch,
                " must be a multiple of --accumulate ", args.accumulate);
    auto options = shardtorch::ShardOptions()
                       .strategy(shardtorch::parse_strategy(args.strategy))
                       .hybrid_shard_size(args.hybrid_shard_size)
                       .cpu_offload(args.offload)
                       .prefetch(args.prefetch)
                       .activation_checkpointing(args.recompute);
    if (args.bf16) {
      options.mixed_precision(
          shardtorch::MixedPrecision().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat).output_dtype(at::kFloat));
    }
    auto sharded = shardtorch::shard(model, world, options);
    auto adamw = torch::optim::AdamWOptions(args.lr).weight_decay(0.01);
    // Offloaded masters live in host memory: the fused CPU kernel steps them.
    auto opt = args.offload ? shardtorch::ShardedOptimizer::make<shardtorch::FusedAdamW>(*model, adamw)
                            : shardtorch::AdamW(*model, adamw);

    if (lead) {
      std::cout << "shardtorch demo: GPT with " << args.cfg.n_layer << " blocks, d_model " << args.cfg.d_model << ", "
                << world->size() << " ranks (" << world->backend_name() << "), strategy "
                << shardtorch::strategy_name(sharded.strategy()) << (args.bf16 ? ", bf16" : "") << ", batch "
                << args.batch << " per rank in " << args.accumulate << " micro-batch(es)"
                << (args.clip > 0 ? ", clip " + std::to_string(args.clip) : "") << (args.offload ? ", CPU offload" : "")
                << (args.prefetch ? ", prefetch" : "") << (args.recompute ? ", activation checkpointing" : "")
                << std::endl;
    }
    // Where the data stands: the epoch, and how many of its batches are done.
    int step = 0;
    size_t first_epoch = 0;
    int64_t done_in_epoch = 0;
    if (args.resume && shardtorch::sharded_checkpoint_exists(args.checkpoint)) {
      std::map<std::string, std::string> position;
      step = static_cast<int>(shardtorch::load_sharded_checkpoint(*model, opt.get(), args.checkpoint, &position));
      TORCH_CHECK(position.count("epoch") && position.count("batches_done_in_epoch"), "train_gpt: checkpoint ",
                  args.checkpoint, " has no data-loader position (not written by train_gpt?)");
      first_epoch = std::stoull(position.at("epoch"));
      done_in_epoch = std::stoll(position.at("batches_done_in_epoch"));
      if (lead)
        std::cout << "resumed from " << args.checkpoint << " at step " << step << " (epoch " << first_epoch << ", "
                  << done_in_epoch << " batches into it)" << std::endl;
    } else if (args.resume && lead) {
      std::cout << "no checkpoint at " << args.checkpoint << ": starting from step 0" << std::endl;
    }
    auto save = [&](size_t epoch, int64_t batches_done) {
      shardtorch::save_sharded_checkpoint(
          *model, opt.get(), args.checkpoint, step,
          {{"epoch", std::to_string(epoch)}, {"batches_done_in_epoch", std::to_string(batches_done)}});
      if (lead) std::cout << "saved " << args.checkpoint << " at step " << step << std::endl;
    };
    // Every rank's bytes by category (peaks since the last reset), printed by
    // rank 0. Collective.
    auto memory_report = [&](const std::string& title) {
      auto m = sharded.memory();
      std::ostringstream mine;
      mine << "rank " << world->rank() << ": sharded_params "
           << shardtorch::format_bytes(m.cur(shardtorch::Mem::ShardedParams)) << " | replicated_params "
           << shardtorch::format_bytes(m.cur(shardtorch::Mem::ReplicatedParams)) << " | gradients "
           << shardtorch::format_bytes(m.cur(shardtorch::Mem::Gradients)) << " | optimizer_state "
           << shardtorch::format_bytes(m.cur(shardtorch::Mem::OptimizerState))
           << (args.offload ? " | host (params, grads, optimizer) " +
                                  shardtorch::format_bytes(m.cur(shardtorch::Mem::HostParams) +
                                                           m.cur(shardtorch::Mem::HostGradients) +
                                                           m.cur(shardtorch::Mem::HostOptimizerState))
                            : std::string())
           << " | peak gathered_params " << shardtorch::format_bytes(m.max(shardtorch::Mem::GatheredParams)) << " ("
           << m.peak_gathered_units << " units)"
           << " | peak buckets " << shardtorch::format_bytes(m.max(shardtorch::Mem::Buckets)) << " | peak grad_staging "
           << shardtorch::format_bytes(m.max(shardtorch::Mem::GradStaging));
      auto lines = world->comm().all_gather_strings(mine.str(), "demo memory report");
      if (lead) {
        std::printf("  %s:\n", title.c_str());
        for (auto& line : lines) std::printf("    %s\n", line.c_str());
        std::fflush(stdout);
      }
    };
    std::vector<double> losses, step_seconds;
    sharded.reset_peak_memory();
    int peaks_since = step;  // the step since which the memory peaks count
    for (size_t epoch = first_epoch; step < args.steps; ++epoch) {
      // LibTorch's distributed sampler: each rank draws its own slice of a
      // permutation shared by all ranks; a new permutation every epoch.
      torch::data::samplers::DistributedRandomSampler sampler(args.dataset, world->size(), world->rank());
      sampler.set_epoch(epoch);
      auto loader = torch::data::make_data_loader(
          CountingDataset(args.dataset, args.cfg.vocab, args.cfg.seq_len).map(torch::data::transforms::Stack<>()),
          std::move(sampler), torch::data::DataLoaderOptions().batch_size(args.batch).drop_last(true));
      int64_t in_epoch = 0;
      for (auto& batch : *loader) {
        if (step >= args.steps) break;
        if (epoch == first_epoch && in_epoch < done_in_epoch) {  // consumed before the checkpoint
          ++in_epoch;
          continue;
        }
        ++in_epoch;
        if (args.report_every > 0 && step % args.report_every == 0 && step != peaks_since) {
          sharded.reset_peak_memory();
          peaks_since = step;
        }
        auto t0 = std::chrono::steady_clock::now();
        opt->zero_grad();
        at::Tensor loss = at::zeros({});
        const int64_t mb = args.batch / args.accumulate;
        for (int k = 0; k < args.accumulate; ++k) {
          sharded.set_requires_gradient_sync(k == args.accumulate - 1);  // reduce once, on the last micro-batch
          auto xs = batch.data.narrow(0, k * mb, mb);
          auto l = gpt::lm_loss(model(xs), xs) / args.accumulate;
          l.backward();
          loss = loss + l.detach();
        }
        double norm = args.clip > 0 ? shardtorch::clip_grad_norm(*model, args.clip) : 0.0;
        opt->step();
        double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

        auto mean_loss = loss.detach().reshape({1}).clone();
        world->comm().all_reduce(mean_loss, c10d::ReduceOp::SUM, "demo loss");
        double l = mean_loss.item<double>() / world->size();
        losses.push_back(l);
        step_seconds.push_back(dt);
        if (lead) {
          double tokens = static_cast<double>(args.batch * args.cfg.seq_len * world->size());
          std::printf("step %3d  loss %.4f  step_time %.1f ms  tokens/s %.0f", step, l, dt * 1e3, tokens / dt);
          if (args.clip > 0) std::printf("  grad_norm %.3f", norm);
          std::printf("\n");
          std::fflush(stdout);
        }
        // Collective: every rank reports at the same steps.
        if (args.report_every > 0 && (step + 1) % args.report_every == 0 && step + 1 < args.steps)
          memory_report("memory after step " + std::to_string(step));
        ++step;
        if (!args.checkpoint.empty() && ((args.save_every > 0 && step % args.save_every == 0) || step == args.steps))
          save(epoch, in_epoch);
      }
      TORCH_CHECK(in_epoch > 0, "train_gpt: --dataset ", args.dataset, " has no full batch of ", args.batch,
                  " per rank at ", world->size(), " ranks");
    }
    if (!step_seconds.empty())
      memory_report("memory at the end (peaks since step " + std::to_string(peaks_since) + ")");
    if (!args.export_path.empty()) {
      shardtorch::save_full_state_dict(*model, args.export_path, {{"step", std::to_string(step)}});
      if (lead) std::cout << "exported the full state dict to " << args.export_path << std::endl;
    }
    const uint64_t print = fingerprint(*model);
    if (lead)
      std::printf("parameters after step %d: fingerprint %016llx\n", step, static_cast<unsigned long long>(print));
    const size_t k = std::min<size_t>(5, losses.size() / 2);
    double first = 0, last = 0;
    for (size_t i = 0; i < k; ++i) {
      first += losses[i] / k;
      last += losses[losses.size() - 1 - i] / k;
    }
    const bool judged = losses.size() >= 10;
    const bool fell = !judged || last < 0.9 * first;
    if (lead && judged) {
      std::printf("loss %s: mean of the first %zu steps %.4f, of the last %zu steps %.4f\n",
                  fell ? "fell" : "DID NOT FALL", k, first, k, last);
    }
    if (lead && !step_seconds.empty()) {
      std::vector<double> sorted = step_seconds;
      std::sort(sorted.begin(), sorted.end());
      double total = 0;
      for (double t : step_seconds) total += t;
      const double tokens = static_cast<double>(args.batch * args.cfg.seq_len * world->size()) * step_seconds.size();
      std::printf("summary: %zu steps on %d ranks in %.1f s, median step %.1f ms, %.0f tokens/s; loss %.4f -> %.4f\n",
                  step_seconds.size(), world->size(), total, sorted[sorted.size() / 2] * 1e3, tokens / total,
                  losses.front(), losses.back());
    }
    if (lead) std::fflush(stdout);
    // No rank exits before rank 0 has printed: torchrun stops the others as
    // soon as one exits with an error, and the verdict would be lost.
    auto done = torch::zeros({1});
    world->comm().all_reduce(done, c10d::ReduceOp::SUM, "train_gpt exit");
    return fell ? 0 : 2;
  } catch (...) {
    return cli::report_error("train_gpt");
  }
  return 0;
}
