// A contrastive two-tower model: one encoder (with batch norm) and one
// projection, each a unit, applied to two noisy views of the same items. Each
// unit runs twice per forward, and the batch-norm statistics are broadcast
// from rank 0 after every step (ShardOptions::broadcast_buffers), so every
// rank evaluates with the same ones. Launch:
//
//   torchrun --no-python --standalone --nproc-per-node 2 build/examples/two_tower --steps 40 --prefetch
//
// Prints per step the loss (mean over ranks), step time and the all-gathers
// of the step; at the end whether the batch-norm statistics agree on every
// rank, and the retrieval accuracy of held-out pairs (rank 0's evaluation).
// Exits non-zero if the loss did not fall or the statistics differ (which
// they do with --no-broadcast-buffers: each rank then keeps its own).
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <iostream>
#include <optional>
#include <string>

#include "cli.h"
#include "shardtorch/shardtorch.h"

namespace {

namespace po = boost::program_options;

struct EncoderImpl : torch::nn::Module {
  EncoderImpl(int64_t in, int64_t hidden, int64_t out)
      : l1(register_module("l1", torch::nn::Linear(in, hidden))),
        bn(register_module("bn", torch::nn::BatchNorm1d(hidden))),
        l2(register_module("l2", torch::nn::Linear(hidden, out))) {}
  torch::Tensor forward(torch::Tensor x) { return l2(torch::relu(bn(l1(x)))); }
  torch::nn::Linear l1;
  torch::nn::BatchNorm1d bn;
  torch::nn::Linear l2;
};
SHARDTORCH_MODULE(Encoder);

struct ProjectionImpl : torch::nn::Module {
  explicit ProjectionImpl(int64_t dim) : lin(register_module("lin", torch::nn::Linear(dim, dim))) {}
  torch::Tensor forward(torch::Tensor x) { return torch::nn::functional::normalize(lin(x)); }
  torch::nn::Linear lin;
};
SHARDTORCH_MODULE(Projection);

// The root: both towers share the encoder and the projection.
struct TwoTowerImpl : torch::nn::Module {
  TwoTowerImpl(int64_t in, int64_t hidden, int64_t out)
      : enc(register_module("enc", Encoder(in, hidden, out))), proj(register_module("proj", Projection(out))) {}
  std::tuple<torch::Tensor, torch::Tensor> forward(torch::Tensor a, torch::Tensor b) {
    return {proj(enc(a)), proj(enc(b))};
  }
  Encoder enc;
  Projection proj;
};
SHARDTORCH_MODULE(TwoTower);

// InfoNCE in both directions: view a of item i should match view b of item i
// against the other items of the batch.
torch::Tensor contrastive_loss(const torch::Tensor& za, const torch::Tensor& zb, double temperature) {
  auto logits = za.matmul(zb.t()) / temperature;
  auto labels = torch::arange(za.size(0), torch::kLong);
  return (torch::nn::functional::cross_entropy(logits, labels) +
          torch::nn::functional::cross_entropy(logits.t(), labels)) /
         2;
}

struct Args {
  int steps = 40;
  int64_t batch = 32;  // items per rank per step
  int64_t dim = 32, hidden = 64, out = 16;
  double lr = 3e-3, noise = 0.5, temperature = 0.2;
  bool prefetch = false;
  bool broadcast_buffers = true;  // --no-broadcast-buffers: each rank keeps its own statistics
  std::string strategy = "full_shard";
};

// Nothing (and the caller exits) after --help.
std::optional<Args> parse(int argc, char** argv) {
  Args a;
  bool no_broadcast = false;
  po::options_description desc("options");
  desc.add_options()("help", "this text")("steps", cli::number_option(a.steps, "--steps"), "optimizer steps")(
      "batch", cli::number_option(a.batch, "--batch"), "items per rank per step")(
      "lr", cli::number_option(a.lr, "--lr"), "learning rate (AdamW)")(
      "strategy", po::value(&a.strategy)->default_value(a.strategy),
      "full_shard|shard_grad_op|optimizer_only|no_shard|hybrid_shard")("prefetch", po::bool_switch(&a.prefetch),
                                                                       "all-gather the next unit while one computes")(
      "no-broadcast-buffers", po::bool_switch(&no_broadcast), "each rank keeps its own batch-norm statistics");
  if (!cli::parse_command_line(argc, argv, desc,
                               "two_tower: a contrastive two-tower model, sharded (launch with torchrun)"))
    return std::nullopt;
  a.broadcast_buffers = !no_broadcast;
  return a;
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
    TwoTower model(args.dim, args.hidden, args.out);
    auto sharded = shardtorch::shard(model, world,
                                     shardtorch::ShardOptions()
                                         .strategy(shardtorch::parse_strategy(args.strategy))
                                         .prefetch(args.prefetch)
                                         .broadcast_buffers(args.broadcast_buffers));
    auto opt = shardtorch::AdamW(*model, torch::optim::AdamWOptions(args.lr));
    if (lead) {
      std::cout << "two_tower: shared encoder and projection, " << world->size() << " ranks (" << world->backend_name()
                << "), strategy " << shardtorch::strategy_name(sharded.strategy())
                << (args.prefetch ? ", prefetch" : "") << ", " << args.batch << " pairs per rank" << std::endl;
    }
    // The items (the same on every rank); each rank draws its own items and
    // noise every step.
    auto items = torch::randn({4096, args.dim});
    auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + world->rank());
    auto view = [&](const torch::Tensor& x) { return x + args.noise * at::randn(x.sizes(), gen); };

    std::vector<double> losses;
    for (int step = 0; step < args.steps; ++step) {
      auto t0 = std::chrono::steady_clock::now();
      const int64_t gathers = sharded.comm_stats().all_gather.calls;
      auto idx = at::randint(items.size(0), {args.batch}, gen, torch::kLong);
      auto x = items.index_select(0, idx);
      opt->zero_grad();
      auto [za, zb] = model(view(x), view(x));
      auto loss = contrastive_loss(za, zb, args.temperature);
      loss.backward();
      opt->step();
      const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      auto mean_loss = loss.detach().reshape({1}).clone();
      world->comm().all_reduce(mean_loss, c10d::ReduceOp::SUM, "two_tower loss");
      losses.push_back(mean_loss.item<double>() / world->size());
      if (lead) {
        std::printf("step %3d  loss %.4f  step_time %.1f ms  all-gathers %lld  peak gathered units %d\n", step,
                    losses.back(), dt * 1e3, static_cast<long long>(sharded.comm_stats().all_gather.calls - gathers),
                    sharded.memory().peak_gathered_units);
        std::fflush(stdout);
      }
      sharded.reset_peak_memory();
    }

    // Batch-norm statistics: the same on every rank (broadcast from rank 0).
    auto stats = torch::cat({model->enc->bn->running_mean, model->enc->bn->running_var});
    auto lo = stats.clone(), hi = stats.clone();
    world->comm().all_reduce(lo, c10d::ReduceOp::MIN, "two_tower statistics (min)");
    world->comm().all_reduce(hi, c10d::ReduceOp::MAX, "two_tower statistics (max)");
    const bool same = at::equal(lo, hi);

    // Evaluation: retrieve each held-out item's second view among 256 (no
    // gradients: every unit is gathered, used and freed).
    double accuracy = 0;
    {
      torch::NoGradGuard no_grad;
      model->eval();
      auto held = torch::randn({256, args.dim}, gen);
      auto [ea, eb] = model(view(held), view(held));
      accuracy = ea.matmul(eb.t()).argmax(1).eq(torch::arange(256)).to(torch::kDouble).mean().item<double>();
      model->train();
    }
    const size_t k = std::min<size_t>(5, losses.size() / 2);
    double first = 0, last = 0;
    for (size_t i = 0; i < k; ++i) {
      first += losses[i] / k;
      last += losses[losses.size() - 1 - i] / k;
    }
    const bool fell = losses.size() < 10 || last < 0.8 * first;
    if (lead) {
      std::printf("batch-norm statistics: %s across the %d ranks\n", same ? "identical" : "DIFFERENT", world->size());
      std::printf("retrieval accuracy on 256 held-out pairs (rank 0): %.3f (chance %.4f)\n", accuracy, 1.0 / 256);
      if (losses.size() >= 10)
        std::printf("loss %s: mean of the first %zu steps %.4f, of the last %zu steps %.4f\n",
                    fell ? "fell" : "DID NOT FALL", k, first, k, last);
      std::fflush(stdout);
    }
    // No rank exits before rank 0 has printed: torchrun stops the others as
    // soon as one exits with an error, and the verdict would be lost.
    auto done = torch::zeros({1});
    world->comm().all_reduce(done, c10d::ReduceOp::SUM, "two_tower exit");
    return fell && same ? 0 : 2;
  } catch (...) {
    return cli::report_error("two_tower");
  }
}
