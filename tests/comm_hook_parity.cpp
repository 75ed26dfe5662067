// The shardtorch side of tests/python/comm_hook_parity.py: NoShard with a
// built-in communication hook, the weights and batches of that script's
// formulas, SGD; writes each rank's losses and first reduced gradients, per
// hook (a fresh model each) to OUT_DIR/cpp_HOOK_rankR.json.
//   comm_hook_parity HOOK[,HOOK...] OUT_DIR      (HOOK: allreduce, fp16, bf16; under torchrun, 2 ranks)
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "shardtorch/shardtorch.h"

namespace {

constexpr int kSteps = 6, kIn = 16, kHidden = 32, kOut = 4, kBatch = 8;

struct NetImpl : torch::nn::Module {
  NetImpl()
      : fc1(register_module("fc1", torch::nn::Linear(kIn, kHidden))),
        fc2(register_module("fc2", torch::nn::Linear(kHidden, kOut))) {}
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::tanh(fc1(x))); }
  torch::nn::Linear fc1, fc2;
};
SHARDTORCH_MODULE(Net);

torch::Tensor batch(int step, int rank, int rows, int cols, int mod, double scale) {
  std::vector<float> v;
  for (int b = 0; b < rows; ++b)
    for (int j = 0; j < cols; ++j)
      v.push_back(static_cast<float>((((step * 131 + rank * 71 + b * 17 + j * 7) % mod) - mod / 2) / scale));
  return torch::tensor(v).view({rows, cols});
}

std::string json_list(const torch::Tensor& t) {
  auto c = t.reshape({-1}).to(torch::kDouble).contiguous();
  std::ostringstream s;
  s.precision(17);
  s << "[";
  for (int64_t i = 0; i < c.numel(); ++i) s << (i ? "," : "") << c.data_ptr<double>()[i];
  return s.str() + "]";
}

// Trains a fresh model with `hook`; false for an unknown hook name.
bool train(const std::shared_ptr<shardtorch::World>& world, const std::string& hook, const std::string& out_dir) {
  Net net;
  {
    torch::NoGradGuard no_grad;
    int salt = 0;
    for (auto& p : net->parameters()) {
      std::vector<float> v;
      for (int64_t i = 0; i < p.numel(); ++i)
        v.push_back(static_cast<float>(((i * 37 + salt * 11) % 101 - 50) / 512.0));
      p.copy_(torch::tensor(v).view(p.sizes()));
      ++salt;
    }
  }
  auto sharded = shardtorch::shard(net, world, shardtorch::ShardOptions().strategy(shardtorch::Strategy::NoShard));
  auto group = sharded.comm_hook_group();
  if (hook == "allreduce") {
    sharded.register_comm_hook(shardtorch::allreduce_hook(group));
  } else if (hook == "fp16") {
    sharded.register_comm_hook(shardtorch::fp16_compress_hook(group));
  } else if (hook == "bf16") {
    sharded.register_comm_hook(shardtorch::bf16_compress_hook(group));
  } else {
    std::cerr << "unknown hook " << hook << "\n";
    return false;
  }
  auto opt = shardtorch::SGD(*net, torch::optim::SGDOptions(0.1));
  const int rank = world->rank();
  std::ostringstream losses, grads;
  losses.precision(17);
  for (int step = 0; step < kSteps; ++step) {
    auto x = batch(step, rank, kBatch, kIn, 97, 64.0), y = batch(step + 1000, rank, kBatch, kOut, 89, 128.0);
    opt->zero_grad();
    auto loss = torch::nn::functional::mse_loss(net(x), y);
    loss.backward();
    losses << (step ? "," : "") << loss.item<double>();
    if (step == 0) {
      bool first = true;
      for (const auto& item : net->named_parameters()) {
        grads << (first ? "" : ",") << "\"" << item.key() << "\":" << json_list(item.value().grad());
        first = false;
      }
    }
    opt->step();
  }
  std::ofstream f(out_dir + "/cpp_" + hook + "_rank" + std::to_string(rank) + ".json");
  f << "{\"losses\":[" << losses.str() << "],\"grads\":{" << grads.str() << "}}\n";
  if (!f.good()) throw std::runtime_error("comm_hook_parity: could not write to " + out_dir);
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: comm_hook_parity HOOK[,HOOK...] OUT_DIR   (HOOK: allreduce, fp16, bf16)\n";
    return 2;
  }
  const std::string hooks = argv[1], out_dir = argv[2];
  torch::set_num_threads(1);
  auto world = shardtorch::World::from_env();
  std::stringstream list(hooks);
  for (std::string hook; std::getline(list, hook, ',');)
    if (!train(world, hook, out_dir)) return 2;
  return 0;
}
