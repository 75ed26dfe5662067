// Mixed precision with batch norm: its parameters and running statistics
// stay fp32 (MixedPrecision::keep_batch_norm_fp32, on by default), so a bf16
// model with a BatchNorm1d trains, within bf16 tolerance of the same model
// trained in fp32 without the library; cast like the others, its forward fails.
#include <gtest/gtest.h>

#include "models.h"

using namespace testmodels;
using shardtorch::MixedPrecision;
using shardtorch::ShardOptions;
using shardtorch::Strategy;
using shardtorch::World;
using shardtorch::testing::run_ranks;

namespace {

struct BnBlockImpl : torch::nn::Module {
  BnBlockImpl()
      : fc(register_module("fc", torch::nn::Linear(8, 16))), bn(register_module("bn", torch::nn::BatchNorm1d(16))) {}
  torch::Tensor forward(torch::Tensor x) { return torch::relu(bn(fc(x))); }
  torch::nn::Linear fc;
  torch::nn::BatchNorm1d bn;
};
SHARDTORCH_MODULE(BnBlock);

struct BnNetImpl : torch::nn::Module {
  BnNetImpl() : block(register_module("block", BnBlock())), head(register_module("head", torch::nn::Linear(16, 4))) {}
  torch::Tensor forward(torch::Tensor x) { return head(block(x)); }
  BnBlock block;
  torch::nn::Linear head;
};
SHARDTORCH_MODULE(BnNet);

constexpr int kSteps = 10;

torch::Tensor inputs() {
  torch::manual_seed(5);
  return torch::randn({16, 8});
}
torch::Tensor targets() {
  torch::manual_seed(6);
  return torch::randn({16, 4});
}

std::map<std::string, torch::Tensor> state_of(torch::nn::Module& m) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& item : m.named_parameters()) out[item.key()] = item.value().detach().clone();
  for (const auto& item : m.named_buffers())
    if (item.value().is_floating_point()) out[item.key()] = item.value().detach().clone();
  return out;
}

// The same model, data and optimizer in fp32, without the library.
std::pair<std::map<std::string, torch::Tensor>, std::map<std::string, torch::Tensor>> fp32_reference() {
  torch::manual_seed(0);
  BnNet model;
  auto start = state_of(*model);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
  const auto x = inputs(), y = targets();
  for (int s = 0; s < kSteps; ++s) {
    opt.zero_grad();
    torch::mse_loss(model(x), y).backward();
    opt.step();
  }
  return {start, state_of(*model)};
}

// ||got - want|| / ||want - start|| over every tensor of `want` (fp32 in
// `got`): how far a bf16 run strays, relative to how far fp32 training moved.
double drift(const std::map<std::string, torch::Tensor>& got, const std::map<std::string, torch::Tensor>& want,
             const std::map<std::string, torch::Tensor>& start) {
  double diff = 0, moved = 0;
  for (const auto& [n, t] : want) {
    require(got.count(n) > 0, "no " + n);
    require(got.at(n).scalar_type() == at::kFloat, n + " is not fp32");
    diff += (got.at(n) - t).pow(2).sum().item<double>();
    moved += (t - start.at(n)).pow(2).sum().item<double>();
  }
  return std::sqrt(diff / moved);
}

ShardOptions bf16(Strategy s) {
  return ShardOptions().strategy(s).mixed_precision(
      MixedPrecision().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat).output_dtype(at::kFloat));
}

}  // namespace

class Bf16BatchNorm : public ::testing::TestWithParam<Strategy> {};

TEST_P(Bf16BatchNorm, KeepsBatchNormInFp32AndTrainsWithinBf16ToleranceOfFp32) {
  const auto [start, want] = fp32_reference();
  auto r = run_ranks(1, [&, start = start, want = want](World& w) {
    torch::manual_seed(0);
    BnNet model;
    shardtorch::shard(model, w, bf16(GetParam()));
    require(model->block->fc->weight.scalar_type() == at::kBFloat16, "the linear layer should compute in bf16");
    require(model->block->bn->weight.scalar_type() == at::kFloat, "batch norm's weight should stay fp32");
    require(model->block->bn->running_mean.scalar_type() == at::kFloat, "batch norm's statistics should stay fp32");
    auto opt = shardtorch::SGD(*model, torch::optim::SGDOptions(0.1));
    const auto x = inputs(), y = targets();
    for (int s = 0; s < kSteps; ++s) {
      opt->zero_grad();
      torch::mse_loss(model(x), y).backward();
      opt->step();
    }
    // Parameters (fp32 masters) from full_parameters, buffers from the module.
    auto got = shardtorch::full_parameters(*model);
    for (const auto& item : model->named_buffers())
      if (item.value().is_floating_point()) got[item.key()] = item.value().detach().clone();
    const double d = drift(got, want, start);
    std::printf("  %s: drift from fp32 after %d steps %.4f\n", shardtorch::strategy_name(GetParam()), kSteps, d);
    require(d < 0.05, "bf16 drifted " + std::to_string(d) + " of the fp32 movement");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

INSTANTIATE_TEST_SUITE_P(Every, Bf16BatchNorm,
                         ::testing::Values(Strategy::FullShard, Strategy::ShardGradOp, Strategy::NoShard),
                         [](const auto& info) { return std::string(shardtorch::strategy_name(info.param)); });

// Two ranks, each normalising its own half of the batch (as under DDP), with
// statistics broadcast from rank 0 after each step: equal on both ranks, and
// with the parameters within bf16 tolerance of DDP's arithmetic in one
// process in fp32 (both halves' forwards from the same statistics, rank 0's
// update kept, the gradients averaged).
TEST(Bf16BatchNormTwoRanks, TrainsLikeDdpInFp32AndKeepsTheStatisticsEqual) {
  const auto x = inputs(), y = targets();
  auto half = [](const torch::Tensor& t, int rank) { return t.narrow(0, rank * 8, 8); };
  torch::manual_seed(0);
  BnNet ref;
  const auto start = state_of(*ref);
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1));
  for (int s = 0; s < kSteps; ++s) {
    ref_opt.zero_grad();
    auto statistics = [&] {
      return std::make_pair(ref->block->bn->running_mean.clone(), ref->block->bn->running_var.clone());
    };
    auto set_statistics = [&](const std::pair<torch::Tensor, torch::Tensor>& v) {
      torch::NoGradGuard no_grad;
      ref->block->bn->running_mean.copy_(v.first);
      ref->block->bn->running_var.copy_(v.second);
    };
    const auto before = statistics();
    (torch::mse_loss(ref(half(x, 0)), half(y, 0)) / 2).backward();
    const auto rank0 = statistics();
    set_statistics(before);
    (torch::mse_loss(ref(half(x, 1)), half(y, 1)) / 2).backward();
    set_statistics(rank0);
    ref_opt.step();
  }
  const auto want = state_of(*ref);
  auto r = run_ranks(2, [&](World& w) {
    torch::manual_seed(0);
    BnNet model;
    shardtorch::shard(model, w, bf16(Strategy::FullShard));
    auto opt = shardtorch::SGD(*model, torch::optim::SGDOptions(0.1));
    for (int s = 0; s < kSteps; ++s) {
      opt->zero_grad();
      auto loss = torch::mse_loss(model(half(x, w.rank())), half(y, w.rank()));
      require(std::isfinite(loss.item<double>()), "the loss is not finite");
      loss.backward();
      opt->step();
    }
    auto mean = model->block->bn->running_mean.clone();
    auto theirs = mean.clone();
    w.comm().broadcast(theirs, 0, "test");
    require(at::equal(mean, theirs), "the batch-norm statistics differ across ranks");
    auto got = shardtorch::full_parameters(*model);
    for (const auto& item : model->named_buffers())
      if (item.value().is_floating_point()) got[item.key()] = item.value().detach().clone();
    const double d = drift(got, want, start);
    if (w.rank() == 0) std::printf("  two ranks: drift from fp32 after %d steps %.4f\n", kSteps, d);
    require(d < 0.05, "bf16 at two ranks drifted " + std::to_string(d) + " of the fp32 movement");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// Cast like the other parameters (the behaviour before the option), batch
// norm's bf16 weight meets its fp32 statistics and the forward fails.
TEST(Bf16BatchNormCast, WithoutKeepingBatchNormFp32TheForwardFails) {
  auto r = run_ranks(1, [&](World& w) {
    torch::manual_seed(0);
    BnNet model;
    auto opts = bf16(Strategy::FullShard);
    opts.mixed_precision().keep_batch_norm_fp32(false);
    shardtorch::shard(model, w, opts);
    std::string error;
    try {
      model(inputs());
    } catch (const std::exception& e) {
      error = e.what();
    }
    require(error.find("expected scalar type") != std::string::npos, "the forward did not fail: '" + error + "'");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}
