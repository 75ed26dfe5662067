// Trains the example GPT for two steps on 2 ranks (FullShard), saves its full
// state dict and, beside it, a batch of tokens and the logits the sharded
// model computes for them: tests/python/check_full_state_dict.py loads both
// into a PyTorch GPT and compares. usage: export_gpt OUT_DIR
#include <torch/torch.h>

#include <iostream>

#include "../examples/gpt.h"
#include "shardtorch/checkpoint.h"
#include "shardtorch/shardtorch.h"
#include "shardtorch/testing.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: export_gpt OUT_DIR\n";
    return 2;
  }
  const std::string dir = argv[1];
  shardtorch::testing::init();
  torch::manual_seed(5);
  auto x = torch::randint(0, gpt::Config{}.vocab, {4, gpt::Config{}.seq_len}, torch::kLong);
  auto r = shardtorch::testing::run_ranks(2, [&](shardtorch::World& w) {
    torch::manual_seed(0);
    auto model = gpt::GPT(gpt::Config{});
    shardtorch::shard(model, w);
    auto opt = shardtorch::AdamW(*model, torch::optim::AdamWOptions(1e-2));
    for (int s = 0; s < 2; ++s) {
      opt->zero_grad();
      auto xs = x.narrow(0, 2 * w.rank(), 2);
      gpt::lm_loss(model(xs), xs).backward();
      opt->step();
    }
    shardtorch::save_full_state_dict(*model, dir + "/model.safetensors");
    torch::NoGradGuard no_grad;
    auto logits = model(x);
    if (w.rank() == 0) shardtorch::checkpoint::save_file(dir + "/io.safetensors", {{"tokens", x}, {"logits", logits}});
  });
  if (!r.ok) {
    std::cerr << r.summary();
    return 1;
  }
  std::cout << "export_gpt: wrote " << dir << "/model.safetensors and io.safetensors\n";
  return 0;
}
