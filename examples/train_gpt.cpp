// The main job: trains the example GPT with FullShard (ZeRO-3) on a synthetic
// task whose loss can fall, its data split across ranks with LibTorch's
// distributed sampler. Launch:
//
//   torchrun --no-python --standalone --nproc-per-node 2 build/examples/train_gpt --steps 40
//
// Prints per step the loss (mean over ranks), step time and tokens/s, and per
// rank the bytes the library holds by category. Exits non-zero if the loss did
// not fall.
#include <torch/data.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <iostream>
#include <sstream>

#include "gpt.h"
#include "shardtorch/shardtorch.h"

namespace {

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
  int accumulate = 1;  // micro-batches per step
  double clip = 0;     // 0: no clipping
  bool offload = false;   // CPU offload of masters, gradients, optimizer state (fused CPU AdamW)
  bool prefetch = false;  // all-gather the next unit while one computes
  gpt::Config cfg;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string k = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument("train_gpt: " + k + " needs a value");
      return argv[++i];
    };
    if (k == "--steps") a.steps = std::stoi(next());
    else if (k == "--batch") a.batch = std::stoll(next());
    else if (k == "--lr") a.lr = std::stod(next());
    else if (k == "--layers") a.cfg.n_layer = std::stoll(next());
    else if (k == "--d-model") a.cfg.d_model = std::stoll(next());
    else if (k == "--strategy") a.strategy = next();
    else if (k == "--hybrid-shard-size") a.hybrid_shard_size = std::stoi(next());
    else if (k == "--bf16") a.bf16 = true;
    else if (k == "--accumulate") a.accumulate = std::stoi(next());
    else if (k == "--clip") a.clip = std::stod(next());
    else if (k == "--offload") a.offload = true;
    else if (k == "--prefetch") a.prefetch = true;
    else if (k == "--help") {
      std::cout << "train_gpt [--steps N] [--batch B per rank] [--lr LR] [--layers L] [--d-model D]\n"
                   "          [--strategy full_shard|shard_grad_op|optimizer_only|no_shard|hybrid_shard]\n"
                   "          [--hybrid-shard-size S] [--bf16] [--accumulate K micro-batches] [--clip MAX_NORM]\n"
                   "          [--offload (CPU offload, fused CPU AdamW)] [--prefetch]\n";
      std::exit(0);
    } else throw std::invalid_argument("train_gpt: unknown argument " + k);
  }
  return a;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Args args = parse(argc, argv);
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
                       .prefetch(args.prefetch);
    if (args.bf16) {
      options.mixed_precision(shardtorch::MixedPrecision().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat)
                                  .output_dtype(at::kFloat));
    }
    auto sharded = shardtorch::shard(model, world, options);
    auto adamw = torch::optim::AdamWOptions(args.lr).weight_decay(0.01);
    // Offloaded masters live in host memory: the fused CPU kernel steps them.
    auto opt = args.offload ? shardtorch::ShardedOptimizer::make<shardtorch::FusedAdamW>(*model, adamw)
                            : shardtorch::AdamW(*model, adamw);

    if (lead) {
      std::cout << "shardtorch demo: GPT with " << args.cfg.n_layer << " blocks, d_model " << args.cfg.d_model
                << ", " << world->size() << " ranks (" << world->backend_name() << "), strategy "
                << shardtorch::strategy_name(sharded.strategy()) << (args.bf16 ? ", bf16" : "") << ", batch "
                << args.batch << " per rank in " << args.accumulate << " micro-batch(es)"
                << (args.clip > 0 ? ", clip " + std::to_string(args.clip) : "") << (args.offload ? ", CPU offload" : "")
                << (args.prefetch ? ", prefetch" : "") << std::endl;
    }
    const int64_t dataset_size = 4096;
    std::vector<double> losses;
    int step = 0;
    for (size_t epoch = 0; step < args.steps; ++epoch) {
      // LibTorch's distributed sampler: each rank draws its own slice of a
      // permutation shared by all ranks; a new permutation every epoch.
      torch::data::samplers::DistributedRandomSampler sampler(dataset_size, world->size(), world->rank());
      sampler.set_epoch(epoch);
      auto loader = torch::data::make_data_loader(
          CountingDataset(dataset_size, args.cfg.vocab, args.cfg.seq_len).map(torch::data::transforms::Stack<>()),
          std::move(sampler), torch::data::DataLoaderOptions().batch_size(args.batch).drop_last(true));
      for (auto& batch : *loader) {
        if (step >= args.steps) break;
        sharded.reset_peak_memory();
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
        auto m = sharded.memory();
        std::ostringstream mine;
        mine << "rank " << world->rank() << ": sharded_params " << shardtorch::format_bytes(m.cur(shardtorch::Mem::ShardedParams))
             << " | replicated_params " << shardtorch::format_bytes(m.cur(shardtorch::Mem::ReplicatedParams))
             << " | gradients " << shardtorch::format_bytes(m.cur(shardtorch::Mem::Gradients))
             << " | optimizer_state " << shardtorch::format_bytes(m.cur(shardtorch::Mem::OptimizerState))
             << (args.offload ? " | host (params, grads, optimizer) " +
                                    shardtorch::format_bytes(m.cur(shardtorch::Mem::HostParams) +
                                                             m.cur(shardtorch::Mem::HostGradients) +
                                                             m.cur(shardtorch::Mem::HostOptimizerState))
                              : std::string())
             << " | peak gathered_params " << shardtorch::format_bytes(m.max(shardtorch::Mem::GatheredParams))
             << " (" << m.peak_gathered_units << " units)"
             << " | peak buckets " << shardtorch::format_bytes(m.max(shardtorch::Mem::Buckets))
             << " | peak grad_staging " << shardtorch::format_bytes(m.max(shardtorch::Mem::GradStaging));
        auto lines = world->comm().all_gather_strings(mine.str(), "demo memory report");
        if (lead) {
          double tokens = static_cast<double>(args.batch * args.cfg.seq_len * world->size());
          std::printf("step %3d  loss %.4f  step_time %.1f ms  tokens/s %.0f", step, l, dt * 1e3, tokens / dt);
          if (args.clip > 0) std::printf("  grad_norm %.3f", norm);
          std::printf("\n");
          for (auto& line : lines) std::printf("    %s\n", line.c_str());
          std::fflush(stdout);
        }
        ++step;
      }
    }
    const size_t k = std::min<size_t>(5, losses.size() / 2);
    double first = 0, last = 0;
    for (size_t i = 0; i < k; ++i) {
      first += losses[i] / k;
      last += losses[losses.size() - 1 - i] / k;
    }
    const bool fell = k > 0 && last < 0.9 * first;
    if (lead) {
      std::printf("loss %s: mean of the first %zu steps %.4f, of the last %zu steps %.4f\n",
                  fell ? "fell" : "DID NOT FALL", k, first, k, last);
    }
    return fell ? 0 : 2;
  } catch (const std::exception& e) {
    std::cerr << "train_gpt: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
