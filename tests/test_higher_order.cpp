// Gradients of gradients (docs/design.md): gradient penalties train like torch
// under every strategy; backward with create_graph reaching parameters is an error.
#include <gtest/gtest.h>

#include "models.h"
#include "trains_like_torch.h"

using namespace testmodels;
using shardtorch::Mem;
using shardtorch::Strategy;
using shardtorch::World;
using shardtorch::testing::run_ranks;

// A gradient penalty differentiates the output with respect to the input
// with create_graph, then backward() runs through the graph that built,
// which saved the units' full parameters. The grad call reduces nothing.
TEST(HigherOrderGradients, AGradientPenaltyTrainsLikeTorchUnderEveryStrategy) {
  torch::manual_seed(5);
  auto x = torch::randn({4, 7});
  auto penalised = [](MLP& m, const torch::Tensor& xs, const std::function<void()>& between) {
    auto xi = xs.clone().requires_grad_(true);
    auto out = m(xi);
    auto g = torch::autograd::grad({out.sum()}, {xi}, {}, /*retain_graph=*/true, /*create_graph=*/true)[0];
    between();
    return out.square().mean() + (g.norm() - 1).square();
  };
  auto want = train_reference<MLP>([&](MLP& ref) {
    for (int r = 0; r < 2; ++r) (penalised(ref, x.narrow(0, 2 * r, 2), [] {}) / 2).backward();
  });
  expect_every_strategy_trains_like<MLP>(want, "gradient penalty", [&](MLP& m, shardtorch::ShardedModel& sm, World& w) {
    const auto before = sm.comm_stats();
    auto loss = penalised(m, x.narrow(0, 2 * w.rank(), 2), [&] {
      const auto now = sm.comm_stats();
      require(
          now.reduce_scatter.calls == before.reduce_scatter.calls && now.all_reduce.calls == before.all_reduce.calls,
          "autograd::grad with respect to the input reduced gradients");
    });
    loss.backward();
  });
}

class CreateGraph : public ::testing::TestWithParam<Strategy> {};

// Higher-order gradients of parameters (backward with create_graph) are a
// clear error, not gradients that silently lose their graph.
TEST_P(CreateGraph, ABackwardWithCreateGraphReachingParametersIsAClearError) {
  const shardtorch::Strategy s = GetParam();
  auto r = run_ranks(2, [&](World& w) {
    torch::manual_seed(0);
    auto m = MLP();
    shardtorch::shard(m, w, strategy_options(s, 2));
    std::string error;
    try {
      m(torch::randn({2, 7})).square().sum().backward({}, /*retain_graph=*/true, /*create_graph=*/true);
    } catch (const std::exception& e) {
      error = e.what();
    }
    require(error.find("rank " + std::to_string(w.rank())) != std::string::npos &&
                error.find("arrived in a backward with create_graph") != std::string::npos &&
                error.find("l3.lin.") != std::string::npos,
            "expected the create_graph error naming the rank and the parameter, got: " + error.substr(0, 300));
  });
  EXPECT_TRUE(r.ok) << shardtorch::strategy_name(s) << ": " << r.summary();
}

INSTANTIATE_TEST_SUITE_P(HigherOrderGradients, CreateGraph, ::testing::Values(Strategy::FullShard, Strategy::NoShard),
                         StrategyName());

// A backward with create_graph that no backward follows (an input-gradient
// diagnostic after the training backward): the optimizer step releases the
// units it held, whose full copies the update made stale, so the next
// forward gathers the new parameters.
TEST(HigherOrderGradients, UnitsHeldForAGraphAreReleasedByTheStep) {
  torch::manual_seed(5);
  auto x = torch::randn({4, 7});
  auto diagnose = [](MLP& m, const torch::Tensor& xs) {
    auto xi = xs.clone().requires_grad_(true);
    return torch::autograd::grad({m(xi).sum()}, {xi}, {}, true, /*create_graph=*/true)[0].norm();
  };
  auto want = train_reference<MLP>([&](MLP& ref) {
    ref(x).square().mean().backward();
    diagnose(ref, x);
  });
  expect_every_strategy_trains_like<MLP>(want, "a create_graph diagnostic before each step",
                                         [&](MLP& m, shardtorch::ShardedModel&, World& w) {
                                           const auto xs = x.narrow(0, 2 * w.rank(), 2);
                                           m(xs).square().mean().backward();
                                           diagnose(m, xs);
                                         });
}

// Two micro-batches' penalties are built before either is differentiated, and
// the root's own parameters lie on the penalty's path where no hook of the
// root fires (the gradient starts from a tensor inside the model): every unit
// still gathered when the graph-building backward ends is held until the step.
struct PenaltyNetImpl : torch::nn::Module {
  PenaltyNetImpl()
      : pre(register_module("pre", torch::nn::Linear(7, 6))),
        body(register_module("body", Layer(6, 5, true))),
        post(register_module("post", torch::nn::Linear(5, 2))) {}
  torch::Tensor forward(torch::Tensor x) {
    hidden = body(pre(x));
    return post(hidden);
  }
  torch::nn::Linear pre;
  Layer body;
  torch::nn::Linear post;
  torch::Tensor hidden;  // the body's output of the last forward
};
SHARDTORCH_MODULE(PenaltyNet);

TEST(HigherOrderGradients, PenaltyGraphsBuiltAheadAndThroughTheRootTrainLikeTorch) {
  torch::manual_seed(5);
  auto x = torch::randn({4, 7});
  // The penalty only: its backward reaches the root's `pre` through the graph
  // autograd::grad built, never through a hook on the root's output.
  auto penalty = [](PenaltyNet& m, const torch::Tensor& row) {
    auto xi = row.clone().requires_grad_(true);
    m(xi);
    auto g = torch::autograd::grad({m->hidden.sum()}, {xi}, {}, true, /*create_graph=*/true)[0];
    return (g.norm() - 1).square() + m->hidden.square().mean();
  };
  auto want = train_reference<PenaltyNet>([&](PenaltyNet& ref) {
    for (int r = 0; r < 4; ++r) (penalty(ref, x.narrow(0, r, 1)) / 4).backward();
  });
  expect_every_strategy_trains_like<PenaltyNet>(want, "penalties built ahead, through the root",
                                                [&](PenaltyNet& m, shardtorch::ShardedModel&, World& w) {
                                                  auto first = penalty(m, x.narrow(0, 2 * w.rank(), 1));
                                                  auto second = penalty(m, x.narrow(0, 2 * w.rank() + 1, 1));
                                                  (first / 2).backward();
                                                  (second / 2).backward();
                                                });
}

// A gradient penalty through a unit whose parameters are all frozen (a
// frozen feature network between trainable layers, as in GAN R1 penalties
// through a pretrained extractor): autograd::grad with create_graph reaches
// the frozen unit's input, whose hook freed the unit, and the graph it built
// reads the frozen weights again in the second backward ("unit 'mid' is
// sharded"). In a graph-building backward nothing is freed early: the units
// still gathered at its end are held until the step.
struct FrozenMidImpl : torch::nn::Module {
  FrozenMidImpl()
      : first(register_module("first", Layer(7, 6, true))),
        mid(register_module("mid", Layer(6, 6, true))),
        last(register_module("last", Layer(6, 3, false))) {
    for (auto& p : mid->parameters()) p.requires_grad_(false);
  }
  torch::Tensor forward(torch::Tensor x) { return last(mid(first(x))); }
  Layer first, mid, last;
};
SHARDTORCH_MODULE(FrozenMid);

TEST(HigherOrderGradients, AGradientPenaltyThroughAFrozenUnitTrainsLikeTorch) {
  torch::manual_seed(5);
  auto x = torch::randn({4, 7});
  auto penalised = [](FrozenMid& m, const torch::Tensor& xs) {
    auto xi = xs.clone().requires_grad_(true);
    auto out = m(xi);
    auto g = torch::autograd::grad({out.sum()}, {xi}, {}, /*retain_graph=*/true, /*create_graph=*/true)[0];
    return out.square().mean() + (g.norm() - 1).square();
  };
  auto want = train_reference<FrozenMid>([&](FrozenMid& ref) {
    for (int r = 0; r < 2; ++r) (penalised(ref, x.narrow(0, 2 * r, 2)) / 2).backward();
  });
  expect_every_strategy_trains_like<FrozenMid>(want, "a penalty through a frozen unit",
                                               [&](FrozenMid& m, shardtorch::ShardedModel&, World& w) {
                                                 penalised(m, x.narrow(0, 2 * w.rank(), 2)).backward();
                                               });
}
