// Parameters a unit's backward still reads after its last trainable
// gradient has arrived: frozen weights beside trainable adapters (LoRA), a
// second output computed from frozen weights, and trainable parameters that a
// backward(inputs=...) leaves out. Under FullShard and HybridShard such a
// unit must stay gathered until the gradient of its input is complete.
#include <gtest/gtest.h>

#include "models.h"

using namespace testmodels;
using shardtorch::Mem;
using shardtorch::Strategy;
using shardtorch::World;
using shardtorch::testing::run_ranks;

namespace {

// A frozen linear layer with a trainable low-rank adapter beside it: the
// adapter's accumulators run before the product with the frozen weight yields
// the input's gradient.
struct LoraImpl : torch::nn::Module {
  LoraImpl()
      : base(register_module("base", torch::nn::Linear(6, 6))),
        a(register_module("a", torch::nn::Linear(torch::nn::LinearOptions(6, 2).bias(false)))),
        b(register_module("b", torch::nn::Linear(torch::nn::LinearOptions(2, 6).bias(false)))) {
    for (auto& p : base->parameters()) p.set_requires_grad(false);
  }
  torch::Tensor forward(torch::Tensor x) { return base(x) + b(a(x)); }
  torch::nn::Linear base, a, b;
};
SHARDTORCH_MODULE(Lora);

// Two outputs: one from a frozen weight, one from a trainable one; the root
// uses the frozen one first in forward, so its gradient arrives last.
struct TwoOutImpl : torch::nn::Module {
  TwoOutImpl()
      : frozen(register_module("frozen", torch::nn::Linear(6, 6))),
        trained(register_module("trained", torch::nn::Linear(6, 6))) {
    for (auto& p : frozen->parameters()) p.set_requires_grad(false);
  }
  std::tuple<torch::Tensor, torch::Tensor> forward(torch::Tensor x) {
    return {torch::tanh(frozen(x)), trained(x)};
  }
  torch::nn::Linear frozen, trained;
};
SHARDTORCH_MODULE(TwoOut);

struct AdaptedImpl : torch::nn::Module {
  AdaptedImpl()
      : first(register_module("first", Layer(6, 6, true))),
        l1(register_module("l1", Lora())),
        two(register_module("two", TwoOut())),
        l2(register_module("l2", Lora())),
        last(register_module("last", Layer(6, 4, false))) {}
  torch::Tensor forward(torch::Tensor x) {
    auto h = l1(first(x));
    auto [f, t] = two(h);
    return last(l2(f * 0.5 + torch::tanh(t)));
  }
  Layer first;
  Lora l1;
  TwoOut two;
  Lora l2;
  Layer last;
};
SHARDTORCH_MODULE(Adapted);

// A unit with frozen parameters only, between trainable ones.
struct FrozenLayerImpl : torch::nn::Module {
  FrozenLayerImpl() : lin(register_module("lin", torch::nn::Linear(6, 6))) {
    for (auto& p : parameters()) p.set_requires_grad(false);
  }
  torch::Tensor forward(torch::Tensor x) { return torch::tanh(lin(x)); }
  torch::nn::Linear lin;
};
SHARDTORCH_MODULE(FrozenLayer);

struct SandwichImpl : torch::nn::Module {
  SandwichImpl()
      : first(register_module("first", Layer(6, 6, true))),
        frozen(register_module("frozen", FrozenLayer())),
        last(register_module("last", Layer(6, 4, false))) {}
  torch::Tensor forward(torch::Tensor x) { return last(frozen(first(x))); }
  Layer first;
  FrozenLayer frozen;
  Layer last;
};
SHARDTORCH_MODULE(Sandwich);

constexpr int kSteps = 3;

}  // namespace

TEST(FrozenParameters, AdaptersBesideFrozenWeightsTrainLikeTorchUnderEveryStrategy) {
  torch::manual_seed(3);
  auto x = torch::randn({8, 6});
  torch::manual_seed(0);
  Adapted ref;
  torch::optim::Adam ref_opt(unique_tensors(*ref), torch::optim::AdamOptions(1e-2));
  auto want = train_in_one_process(*ref, ref_opt, kSteps, [&] { return ref(x).square().mean(); });
  for (auto s : kAllStrategies) {
    for (bool prefetch : {false, true}) {
      auto r = run_ranks(2, [&](World& w) {
        torch::manual_seed(0);
        Adapted m;
        auto sm = shardtorch::shard(m, w, strategy_options(s, 2).prefetch(prefetch).bucket_mb(1e-4));
        auto opt = shardtorch::Adam(*m, torch::optim::AdamOptions(1e-2));
        for (int step = 0; step < kSteps; ++step) {
          opt->zero_grad();
          (m(x.narrow(0, 4 * w.rank(), 4)).square().mean()).backward();
          require(sm.memory().cur(Mem::GatheredParams) == 0 || s == Strategy::ShardGradOp ||
                      s == Strategy::OptimizerOnly || s == Strategy::NoShard,
                  "units left gathered after backward");
          opt->step();
        }
        expect_close_map(shardtorch::full_parameters(*m), want, 1e-5, "adapters beside frozen weights");
      });
      ASSERT_TRUE(r.ok) << shardtorch::strategy_name(s) << (prefetch ? " with prefetch" : "") << ": " << r.summary();
    }
  }
}

// The frozen weights are freed once the gradient of the unit's input is
// complete, not kept to the end of backward: at most the units a plain
// FullShard step keeps (the root, one computing, one prefetched) plus one.
TEST(FrozenParameters, FrozenWeightsAreFreedOnceTheInputGradientIsComplete) {
  auto r = run_ranks(2, [](World& w) {
    torch::manual_seed(0);
    Adapted m;
    auto sm = shardtorch::shard(m, w);
    auto x = torch::randn({4, 6});
    sm.reset_peak_memory();
    m(x).square().mean().backward();
    const int peak = sm.memory().peak_gathered_units;
    require(peak <= 2, "peak of " + std::to_string(peak) + " units gathered (root has none; expected 2 at most)");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// backward(inputs=...) naming one unit's parameters: the others' parameters
// are in the graph but get no gradient, and their weights are still read for
// the gradient flowing through them.
TEST(FrozenParameters, ABackwardForSomeParametersOnlyReadsTheOthersWeights) {
  torch::manual_seed(3);
  auto x = torch::randn({8, 6});
  auto inputs_of = [](Adapted& m) { return m->first->parameters(); };
  torch::manual_seed(0);
  Adapted ref;
  torch::optim::SGD ref_opt(unique_tensors(*ref), torch::optim::SGDOptions(0.1));
  for (int step = 0; step < kSteps; ++step) {
    ref_opt.zero_grad();
    ref(x).square().mean().backward({}, std::nullopt, false, inputs_of(ref));
    ref_opt.step();
  }
  auto want = snapshot(*ref);
  for (auto s : kAllStrategies) {
    auto r = run_ranks(2, [&](World& w) {
      torch::manual_seed(0);
      Adapted m;
      shardtorch::shard(m, w, strategy_options(s, 2).bucket_mb(1e-4));
      auto opt = shardtorch::SGD(*m, torch::optim::SGDOptions(0.1));  // a zero gradient changes nothing
      for (int step = 0; step < kSteps; ++step) {
        opt->zero_grad();
        m(x.narrow(0, 4 * w.rank(), 4)).square().mean().backward({}, std::nullopt, false, inputs_of(m));
        opt->step();
      }
      expect_close_map(shardtorch::full_parameters(*m), want, 1e-5, "backward for some parameters only");
    });
    ASSERT_TRUE(r.ok) << shardtorch::strategy_name(s) << ": " << r.summary();
  }
}

// Checkpointed, a unit with only frozen parameters is recomputed in backward
// (its input needs a gradient) and has nothing to reduce: nothing waits for it.
TEST(FrozenParameters, ACheckpointedFrozenUnitBetweenTrainableOnesTrainsLikeTorch) {
  torch::manual_seed(3);
  auto x = torch::randn({8, 6});
  torch::manual_seed(0);
  Sandwich ref;
  torch::optim::Adam ref_opt(unique_tensors(*ref), torch::optim::AdamOptions(1e-2));
  auto want = train_in_one_process(*ref, ref_opt, kSteps, [&] { return ref(x).square().mean(); });
  for (auto s : {Strategy::FullShard, Strategy::ShardGradOp}) {
    auto r = run_ranks(2, [&](World& w) {
      torch::manual_seed(0);
      Sandwich m;
      auto sm = shardtorch::shard(m, w, strategy_options(s, 2).activation_checkpointing_for("frozen", true));
      auto opt = shardtorch::Adam(*m, torch::optim::AdamOptions(1e-2));
      for (int step = 0; step < kSteps; ++step) {
        opt->zero_grad();
        m(x.narrow(0, 4 * w.rank(), 4)).square().mean().backward();
        opt->step();
      }
      require(sm.reductions_deferred() == 0, std::to_string(sm.reductions_deferred()) + " units waited");
      expect_close_map(shardtorch::full_parameters(*m), want, 1e-5, "a checkpointed frozen unit");
    });
    ASSERT_TRUE(r.ok) << shardtorch::strategy_name(s) << ": " << r.summary();
  }
}
