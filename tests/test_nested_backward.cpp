// A backward inside another one is refused on every rank, and training goes
// on as if it had not been attempted.
#include <gtest/gtest.h>

#include "models.h"

using namespace testmodels;
using shardtorch::Mem;
using shardtorch::Strategy;
using shardtorch::World;
using shardtorch::testing::run_ranks;

class Nested : public ::testing::TestWithParam<Strategy> {};

// A backward run inside another one (a hook that backpropagates an auxiliary
// loss, a checkpoint function of the user's own) was taken for the trace of a
// failed backward: the outer backward's reductions were dropped with a
// warning that an exception had escaped, and the step went on with wrong
// gradients. It is refused on every rank, naming it; a backward after one
// that failed is still taken for that; after zero_grad the model trains like
// torch.
TEST_P(Nested, ABackwardNestedInAnotherIsRefusedAndTrainingGoesOn) {
  torch::manual_seed(4);
  auto x = torch::randn({kBatch, 7}), y = torch::randn({kBatch, 3});
  torch::manual_seed(0);
  auto ref = std::make_shared<PlainRoot>();
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1));
  const auto want = train_in_one_process(*ref, ref_opt, 2, [&] { return torch::mse_loss(ref->forward(x), y); });
  const shardtorch::Strategy s = GetParam();
  auto r = run_ranks(2, [&](World& w) {
    torch::manual_seed(0);
    auto m = std::make_shared<PlainRoot>();
    shardtorch::shard(*m, w, strategy_options(s, 2));
    auto opt = shardtorch::SGD(*m, torch::optim::SGDOptions(0.1));
    {
      auto aux = m->forward(torch::randn({2, 7})).sum();
      auto h = m->l1(torch::randn({2, 7}));
      // Reached after the outer backward has taken l3's and l2's gradients.
      h.register_hook([&](const torch::Tensor& g) {
        aux.backward();
        return g;
      });
      std::string error;
      try {
        m->l3(m->l2(h)).sum().backward();
      } catch (const std::exception& e) {
        error = e.what();
      }
      require(
          error.find("rank " + std::to_string(w.rank()) + ": a backward inside another backward") != std::string::npos,
          "the nested backward was not refused: " + error);
    }
    {
      // A backward that failed is told from one still running: the backward
      // right after it (on a retained graph) is not refused as nested.
      bool fail = true;
      auto h = m->l1(torch::randn({2, 7}));
      h.register_hook([&](const torch::Tensor& g) {
        if (fail) throw std::runtime_error("hook failed");
        return g;
      });
      auto loss = m->l3(m->l2(h)).sum();
      try {
        loss.backward({}, /*retain_graph=*/true);
        throw std::logic_error("the hook did not throw");
      } catch (const std::runtime_error& e) {
        require(std::string(e.what()).find("hook failed") != std::string::npos, e.what());
      }
      fail = false;
      loss.backward();
    }
    const int64_t per = kBatch / 2;
    auto xs = x.narrow(0, w.rank() * per, per), ys = y.narrow(0, w.rank() * per, per);
    for (int k = 0; k < 2; ++k) {
      opt->zero_grad();
      torch::mse_loss(m->forward(xs), ys).backward();
      opt->step();
    }
    shardtorch::FullParams full(*m);
    expect_close_map(snapshot(*m), want, 1e-5, "after a refused nested backward");
  });
  EXPECT_TRUE(r.ok) << shardtorch::strategy_name(s) << ": " << r.summary();
}

// A unit keeping an auxiliary term of a parameter of its own (a router's
// load-balancing sum), backpropagated by a hook while the outer backward
// runs: the nested backward reaches the parameter's accumulator before any
// unit output, and is refused there. The gradient autograd had just
// accumulated into param.grad stayed, and the next backward added it to its
// own (a silently wrong step).
struct GatedImpl : torch::nn::Module {
  GatedImpl() : lin(register_module("lin", torch::nn::Linear(5, 5))) {
    gate = register_parameter("gate", torch::full({5}, 0.5));
  }
  torch::Tensor forward(torch::Tensor x) {
    aux = gate.sum() * 0.1;  // reads no full parameter in backward
    return lin(x) * gate;
  }
  torch::nn::Linear lin;
  torch::Tensor gate, aux;
};
SHARDTORCH_MODULE(Gated);

struct GatedNet : torch::nn::Module {
  GatedNet() : l1(register_module("l1", Layer(7, 5, true))), g(register_module("g", Gated())) {}
  torch::Tensor forward(torch::Tensor x) { return g(l1(x)); }
  Layer l1;
  Gated g;
};

TEST_P(Nested, ARefusedNestedBackwardLeavesNoGradientForTheNextStep) {
  torch::manual_seed(4);
  auto x = torch::randn({kBatch, 7}), y = torch::randn({kBatch, 5});
  torch::manual_seed(0);
  auto ref = std::make_shared<GatedNet>();
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1));
  const auto want = train_in_one_process(*ref, ref_opt, 2, [&] { return torch::mse_loss(ref->forward(x), y); });
  const shardtorch::Strategy s = GetParam();
  auto r = run_ranks(2, [&](World& w) {
    torch::manual_seed(0);
    auto m = std::make_shared<GatedNet>();
    shardtorch::shard(*m, w, strategy_options(s, 2));
    auto opt = shardtorch::SGD(*m, torch::optim::SGDOptions(0.1));
    const int64_t per = kBatch / 2;
    auto xs = x.narrow(0, w.rank() * per, per), ys = y.narrow(0, w.rank() * per, per);
    {
      auto h = m->l1(xs);
      auto out = m->g(h);
      auto aux = m->g->aux;
      h.register_hook([&](const torch::Tensor& g) {  // after the outer backward has taken g's gradients
        aux.backward();
        return g;
      });
      std::string error;
      try {
        torch::mse_loss(out, ys).backward();
      } catch (const std::exception& e) {
        error = e.what();
      }
      require(
          error.find("rank " + std::to_string(w.rank()) + ": a backward inside another backward") != std::string::npos,
          "the nested backward was not refused: " + error);
    }
    for (int k = 0; k < 2; ++k) {
      opt->zero_grad();
      torch::mse_loss(m->forward(xs), ys).backward();
      opt->step();
    }
    shardtorch::FullParams full(*m);
    expect_close_map(snapshot(*m), want, 1e-5, "after a nested backward refused at an accumulator");
  });
  EXPECT_TRUE(r.ok) << shardtorch::strategy_name(s) << ": " << r.summary();
}

INSTANTIATE_TEST_SUITE_P(NestedBackward, Nested, ::testing::Values(Strategy::FullShard, Strategy::NoShard),
                         StrategyName());
