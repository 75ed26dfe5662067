// A communication hook of one's own: bf16 compression with error feedback.
// Each bucket is sent in bf16, which halves the bytes of fp32 gradients; what
// rounding lost is kept on this rank and added to the same bucket at the
// next step, so no part of a gradient is lost for good (plain bf16
// compression drops it). Launch:
//
//   torchrun --no-python --standalone --nproc-per-node 2 build/examples/comm_hook --steps 60
//   torchrun --no-python --standalone --nproc-per-node 4 build/examples/comm_hook --strategy hybrid_shard
//   --hybrid-shard-size 2
//
// Prints the loss (rank 0's batch) as it trains and what the hook sent; exits
// non-zero if the loss did not fall by half.
#include <ATen/core/jit_type.h>
#include <torch/torch.h>

#include <cstdio>
#include <iostream>
#include <map>
#include <string>

#include "cli.h"
#include "shardtorch/shardtorch.h"

namespace {

// The hook: c10d's interface, with the group it averages over as its state.
class ErrorFeedbackBf16Hook : public c10d::CppCommHookInterface<shardtorch::HookGroup> {
 public:
  explicit ErrorFeedbackBf16Hook(shardtorch::HookGroup group) : CppCommHookInterface(std::move(group)) {}

  // Called on the backward's thread with this rank's bucket; returns at once
  // with a future of the bucket's mean over the group.
  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    at::Tensor grads = bucket.getBuffer();  // a view of the bucket: writing it writes the bucket
    at::Tensor& residual = residuals_[bucket.getIndex()];
    if (residual.defined() && residual.sizes() == grads.sizes()) grads.add_(residual);
    at::Tensor compressed = grads.to(at::kBFloat16);
    residual = grads - compressed.to(grads.scalar_type());  // what rounding lost: sent with the next step
    sent_bytes_ += compressed.nbytes();
    ++buckets_;
    if (!state_) {  // a group of one (FullShard, ShardGradOp): the bucket is the mean already
      grads.copy_(compressed);
      return shardtorch::completed_future(grads);
    }
    compressed.div_(state_->getSize());  // the hook divides: it returns the mean, as DDP's hooks
    std::vector<at::Tensor> tensors{compressed};
    auto all_reduced = state_->allreduce(tensors)->getFuture();
    // Runs on a Gloo thread when the sum is in; an exception here would
    // become the future's error and reach the caller of backward.
    return all_reduced->then(
        [grads](c10::ivalue::Future& f) {
          grads.copy_(f.value().toTensorVector().at(0));
          return c10::IValue(grads);
        },
        c10::TensorType::get());
  }

  int64_t sent_bytes() const { return sent_bytes_; }
  int64_t buckets() const { return buckets_; }

 private:
  std::map<size_t, at::Tensor> residuals_;  // by bucket index: the same bucket every step
  int64_t sent_bytes_ = 0, buckets_ = 0;
};

struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t in, int64_t out) : lin(register_module("lin", torch::nn::Linear(in, out))) {}
  torch::Tensor forward(torch::Tensor x) { return torch::tanh(lin(x)); }
  torch::nn::Linear lin;
};
SHARDTORCH_MODULE(Block);

struct RegressorImpl : torch::nn::Module {
  RegressorImpl()
      : b1(register_module("b1", Block(16, 64))),
        b2(register_module("b2", Block(64, 64))),
        head(register_module("head", torch::nn::Linear(64, 1))) {}
  torch::Tensor forward(torch::Tensor x) { return head(b2(b1(x))); }
  Block b1, b2;
  torch::nn::Linear head;
};
SHARDTORCH_MODULE(Regressor);

}  // namespace

int main(int argc, char** argv) {
  try {
    namespace po = boost::program_options;
    int steps = 60, hybrid = 0;
    std::string strategy = "no_shard";
    po::options_description desc("options");
    desc.add_options()("help", "this text")("steps", cli::number_option(steps, "--steps"), "training steps")(
        "strategy", po::value(&strategy)->default_value(strategy), "no_shard, full_shard, shard_grad_op, hybrid_shard")(
        "hybrid-shard-size", cli::number_option(hybrid, "--hybrid-shard-size"), "ranks per shard group (hybrid_shard)");
    if (!cli::parse_command_line(argc, argv, desc, "usage: comm_hook [options]  (under torchrun --no-python)"))
      return 0;
    auto world = shardtorch::World::from_env();
    torch::manual_seed(0);
    Regressor model;
    auto options = shardtorch::ShardOptions().strategy(shardtorch::parse_strategy(strategy));
    if (hybrid > 0) options.hybrid_shard_size(hybrid);
    auto sharded = shardtorch::shard(model, world, options);
    auto owned = std::make_unique<ErrorFeedbackBf16Hook>(sharded.comm_hook_group());
    const ErrorFeedbackBf16Hook* hook = owned.get();
    sharded.register_comm_hook(std::move(owned));
    auto opt = shardtorch::AdamW(*model, torch::optim::AdamWOptions(1e-2));

    const auto w_true = torch::randn({16, 1});  // the function to learn: the same on every rank
    torch::manual_seed(1000 + world->rank());   // each rank its own samples of it
    double first = 0, last = 0;
    for (int step = 0; step < steps; ++step) {
      auto x = torch::randn({32, 16});
      auto y = torch::tanh(x.matmul(w_true) * 0.25);
      opt->zero_grad();
      auto loss = torch::mse_loss(model(x), y);
      loss.backward();
      opt->step();
      last = loss.item<double>();
      if (step == 0) first = last;
      if (world->rank() == 0 && (step % 10 == 0 || step + 1 == steps)) std::printf("step %3d  loss %.5f\n", step, last);
    }
    if (world->rank() == 0)
      std::printf("the hook reduced %lld buckets, %lld bytes in bf16 on this rank\n",
                  static_cast<long long>(hook->buckets()), static_cast<long long>(hook->sent_bytes()));
    if (!(last < 0.5 * first)) {
      std::fprintf(stderr, "comm_hook: rank %d: the loss went from %.5f to %.5f, not below half\n", world->rank(),
                   first, last);
      return 1;
    }
    return 0;
  } catch (...) {
    return cli::report_error("comm_hook");
  }
}
