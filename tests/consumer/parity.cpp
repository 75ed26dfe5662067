// A user's parity test against the installed package: two ranks under
// run_ranks train the model like one process (shardtorch/parity.h), losses,
// first gradients and final parameters; and a gradient of the wrong scale is
// caught. Proves the testing library's headers and symbols are installed.
#include <shardtorch/parity.h>
#include <shardtorch/shardtorch.h>
#include <shardtorch/testing.h>
#include <torch/optim/sgd.h>

#include <iostream>

#include "net.h"

int main() {
  shardtorch::testing::init();
  torch::manual_seed(1);
  const at::Tensor x = at::randn({8, 4});
  torch::manual_seed(0);
  Net ref;
  torch::optim::SGD ref_opt(shardtorch::testing::distinct_parameters(*ref), torch::optim::SGDOptions(0.1));
  const auto want = shardtorch::testing::train_reference(*ref, ref_opt, 2, [&](int) { return ref(x).square().mean(); });
  for (const double scale : {1.0, 2.0}) {  // 2: a gradient of the wrong scale, which must be caught
    auto r = shardtorch::testing::run_ranks(2, [&](shardtorch::World& w) {
      torch::manual_seed(0);
      Net net;
      shardtorch::shard(net, w);
      auto opt = shardtorch::SGD(*net, torch::optim::SGDOptions(0.1));
      const at::Tensor mine = x.narrow(0, 4 * w.rank(), 4);
      auto got =
          shardtorch::testing::train_ranks(*net, *opt, 2, [&](int) { (net(mine).square().mean() * scale).backward(); });
      shardtorch::testing::expect_same_run(got, want, 1e-5, "full_shard at 2 ranks");
    });
    if (r.ok != (scale == 1.0)) {
      std::cerr << "parity: scale " << scale << ": " << (r.ok ? "passed" : r.summary()) << std::endl;
      return 1;
    }
    if (!r.ok && r.summary().find("first gradients") == std::string::npos) {
      std::cerr << "parity: the wrong scale was not named by the first gradients: " << r.summary() << std::endl;
      return 1;
    }
  }
  std::cout << "parity: two ranks train like one process; a doubled gradient is caught" << std::endl;
  return 0;
}
