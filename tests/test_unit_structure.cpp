// What units are made of: a tied weight, a unit registered twice, a unit
// returning its own parameter, and parameters that are empty, integer or bool.
#include <gtest/gtest.h>

#include "models.h"
#include "trains_like_torch.h"

using namespace testmodels;
using shardtorch::Mem;
using shardtorch::Strategy;
using shardtorch::World;
using shardtorch::testing::run_ranks;

TEST(UnitPlacement, TiedWeightGoesToTheCommonAncestorUnit) {
  auto r = run_ranks(2, [](World& w) {
    auto model = gpt::GPT(gpt::Config{});
    auto sm = shardtorch::shard(model, w);
    auto units = sm.units();
    require(units.size() == 4, "expected root, 2 blocks and head, got " + std::to_string(units.size()));
    require(
        units[0].name.empty() && units[1].name == "blocks.0" && units[2].name == "blocks.1" && units[3].name == "head",
        "unexpected unit names");
    require(units[3].layouts.empty(), "the head's tied weight should not be in the head unit");
    int seen = 0;
    for (auto& names : units[0].param_names)
      for (auto& n : names) seen += n == "tok_emb.weight" || n == "head.weight";
    require(seen == 1, "the tied weight should be in the root unit exactly once, seen " + std::to_string(seen));
    // Names do not change: the module still lists both names for the one tensor.
    auto params = model->named_parameters();
    require(params.contains("head.weight") && params.contains("tok_emb.weight"), "parameter names changed");
    require(params["head.weight"].is_same(params["tok_emb.weight"]), "tie broken");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

class RegisteredTwice : public ::testing::TestWithParam<Strategy> {};

// One unit registered twice in the module tree (layers sharing weights,
// ALBERT-style): it is one unit, called twice per forward, and trains like
// the same model in one process under every strategy (not two units, the
// second overwriting the first's state, which fails with "a unit of this
// sharded model no longer exists").
TEST_P(RegisteredTwice, AUnitRegisteredTwiceIsOneUnitAndTrainsLikeTorch) {
  struct SharedImpl : torch::nn::Module {
    SharedImpl() : block(Layer(7, 7, true)), head(register_module("head", Layer(7, 3, false))) {
      register_module("first", block);
      register_module("again", block);
    }
    torch::Tensor forward(torch::Tensor x) { return head(block(block(x))); }
    Layer block, head;
  };
  torch::manual_seed(4);
  auto x = torch::randn({kBatch, 7}), y = torch::randn({kBatch, 3});
  torch::manual_seed(0);
  auto ref = std::make_shared<SharedImpl>();
  torch::optim::Adam ref_opt(unique_tensors(*ref), torch::optim::AdamOptions(1e-2));
  const auto want = train_in_one_process(*ref, ref_opt, 3, [&] { return torch::mse_loss(ref->forward(x), y); });
  const Strategy s = GetParam();
  auto r = run_ranks(2, [&](World& w) {
    torch::manual_seed(0);
    auto model = std::make_shared<SharedImpl>();
    auto sm = shardtorch::shard(*model, w, strategy_options(s, 2));
    if (s != Strategy::NoShard)
      require(sm.units().size() == 2, std::to_string(sm.units().size()) + " units, expected block and head");
    auto opt = shardtorch::Adam(*model, torch::optim::AdamOptions(1e-2));
    const int64_t per = kBatch / 2;
    auto xs = x.narrow(0, w.rank() * per, per), ys = y.narrow(0, w.rank() * per, per);
    for (int k = 0; k < 3; ++k) {
      opt->zero_grad();
      torch::mse_loss(model->forward(xs), ys).backward();
      opt->step();
    }
    shardtorch::FullParams full(*model);
    expect_close_map(snapshot(*model), want, 1e-5, "a unit registered twice");
  });
  ASSERT_TRUE(r.ok) << shardtorch::strategy_name(s) << ": " << r.summary();
}

INSTANTIATE_TEST_SUITE_P(UnitPlacement, RegisteredTwice,
                         ::testing::Values(Strategy::FullShard, Strategy::ShardGradOp, Strategy::NoShard,
                                           Strategy::HybridShard),
                         StrategyName());

/// A unit that returns its own parameter (a learned scale), kept gathered
/// after forward so the caller can use it.
struct ScaleImpl : torch::nn::Module {
  ScaleImpl() { s = register_parameter("s", torch::full({5}, 1.5)); }
  torch::Tensor forward(torch::Tensor) { return s; }
  torch::Tensor s;
};
SHARDTORCH_MODULE(Scale);

struct ScaledImpl : torch::nn::Module {
  ScaledImpl() : a(register_module("a", Layer(7, 5, true))), scale(register_module("scale", Scale())) {}
  torch::Tensor forward(torch::Tensor x) { return a(x) * scale(x); }
  Layer a;
  Scale scale;
};
SHARDTORCH_MODULE(Scaled);

class OwnParameter : public ::testing::TestWithParam<Strategy> {};

// Its output is a copy, not the parameter: the unit's backward hook sits on
// the copy's node, so the parameter collects no hook per forward (it used to
// get one more at every step).
TEST_P(OwnParameter, AUnitReturningItsOwnParameterHooksNothingOnItAndTrainsLikeTorch) {
  torch::manual_seed(5);
  auto x = torch::randn({4, 7});
  torch::manual_seed(0);
  auto ref = Scaled();
  torch::optim::SGD ref_opt(unique_tensors(*ref), torch::optim::SGDOptions(0.1));
  constexpr int kSteps = 3;
  auto want = train_in_one_process(*ref, ref_opt, kSteps, [&] { return ref(x).pow(2).sum(); });
  const Strategy s = GetParam();
  auto r = run_ranks(2, [&](World& w) {
    torch::manual_seed(0);
    auto m = Scaled();
    shardtorch::shard(m, w, strategy_options(s, 2).reshard_after_forward_for("scale", false));
    auto opt = shardtorch::SGD(*m, torch::optim::SGDOptions(0.1));
    const size_t hooks = torch::autograd::impl::hooks(m->scale->s).size();
    for (int step = 0; step < kSteps; ++step) {
      opt->zero_grad();
      (m(x.narrow(0, 2 * w.rank(), 2)).pow(2).sum() * w.size()).backward();
      opt->step();
      require(torch::autograd::impl::hooks(m->scale->s).size() == hooks,
              "the parameter has " + std::to_string(torch::autograd::impl::hooks(m->scale->s).size()) +
                  " hooks after step " + std::to_string(step) + ", " + std::to_string(hooks) + " before");
    }
    expect_close_map(shardtorch::full_parameters(*m), want, 1e-5, "a unit returning its parameter");
  });
  ASSERT_TRUE(r.ok) << shardtorch::strategy_name(s) << ": " << r.summary();
}

INSTANTIATE_TEST_SUITE_P(UnitPlacement, OwnParameter, ::testing::ValuesIn(kAllStrategies), StrategyName());

// Training with a parameter of no elements; test_checkpoint.cpp takes it
// through clipping, summoning and checkpoints.
TEST(UnusualParameters, AnEmptyParameterTrainsLikeTorchUnderEveryStrategy) {
  torch::manual_seed(5);
  auto x = torch::randn({4, 7});
  auto want = train_reference<WithEmpty>([&](WithEmpty& ref) { ref(x).square().sum().backward(); });
  expect_every_strategy_trains_like<WithEmpty>(want, "empty parameter",
                                               [&](WithEmpty& m, shardtorch::ShardedModel&, World& w) {
                                                 (m(x.narrow(0, 2 * w.rank(), 2)).square().sum() * 2).backward();
                                               });
}

// A unit whose only trainable parameter is empty (next to frozen ones) has an
// empty trainable flat parameter: nothing to reduce (it used to reach the
// bucketer with a zero-width piece and fail on an unallocated bucket).
TEST(UnusualParameters, AUnitWhoseOnlyTrainableParameterIsEmptyTrainsLikeTorch) {
  torch::manual_seed(5);
  auto x = torch::randn({4, 7});
  auto want = train_reference<OnlyEmptyTrains>([&](OnlyEmptyTrains& ref) { ref(x).square().sum().backward(); });
  expect_every_strategy_trains_like<OnlyEmptyTrains>(
      want, "empty trainable flat", [&](OnlyEmptyTrains& m, shardtorch::ShardedModel& sm, World& w) {
        (m(x.narrow(0, 2 * w.rank(), 2)).square().sum() * 2).backward();
        require(sm.memory().cur(Mem::GradStaging) == 0, "staged gradients left after backward");
      });
  // Offloaded, unbucketed, and with two replica groups.
  const std::pair<shardtorch::ShardOptions, int> more[] = {
      {strategy_options(shardtorch::Strategy::FullShard, 2).cpu_offload(true), 2},
      {strategy_options(shardtorch::Strategy::ShardGradOp, 2).bucket_mb(0), 2},
      {strategy_options(shardtorch::Strategy::HybridShard, 4), 4}};
  for (const auto& [options, world] : more) {
    auto r = run_ranks(world, [&](World& w) {
      torch::manual_seed(0);
      OnlyEmptyTrains m;
      shardtorch::shard(m, w, options);
      auto opt = shardtorch::SGD(*m, torch::optim::SGDOptions(0.1));
      const int64_t rows = 4 / world;
      for (int i = 0; i < 3; ++i) {
        opt->zero_grad();
        (m(x.narrow(0, rows * w.rank(), rows)).square().sum() * world).backward();
        opt->step();
      }
      shardtorch::FullParams full(*m);
      expect_close_map(snapshot(*m), want, 1e-5, "empty trainable flat");
    });
    EXPECT_TRUE(r.ok) << shardtorch::strategy_name(options.strategy()) << " at " << world << ": " << r.summary();
  }
}

// Frozen integer and bool parameters (an index table, a mask) share a unit
// with trainable ones: they get flat parameters of their own dtypes, are
// gathered and freed like the others, and mixed precision leaves them as
// they are.
struct IndexingLayerImpl : torch::nn::Module {
  IndexingLayerImpl() : lin(register_module("lin", torch::nn::Linear(5, 3))) {
    order = register_parameter("order", torch::tensor({2, 0, 1}, torch::kLong), /*requires_grad=*/false);
    mask = register_parameter("mask", torch::tensor({true, false, true}), /*requires_grad=*/false);
  }
  torch::Tensor forward(torch::Tensor x) { return lin(x).index_select(1, order) * mask; }
  torch::nn::Linear lin;
  torch::Tensor order, mask;
};
SHARDTORCH_MODULE(IndexingLayer);

using WithIndexingImpl = LayerThenImpl<IndexingLayer>;
SHARDTORCH_MODULE(WithIndexing);

TEST(UnusualParameters, IntegerAndBoolParametersTrainLikeTorchUnderEveryStrategy) {
  torch::manual_seed(5);
  auto x = torch::randn({4, 7});
  auto want = train_reference<WithIndexing>([&](WithIndexing& ref) { ref(x).square().sum().backward(); });
  require(want.at("b.lin.weight").select(0, 1).abs().sum().item<double>() > 0, "the masked row should still train");
  expect_every_strategy_trains_like<WithIndexing>(want, "integer parameters",
                                                  [&](WithIndexing& m, shardtorch::ShardedModel&, World& w) {
                                                    (m(x.narrow(0, 2 * w.rank(), 2)).square().sum() * 2).backward();
                                                  });
  for (auto s : kAllStrategies) {
    auto r = run_ranks(2, [&](World& w) {
      WithIndexing m;
      shardtorch::shard(
          m, w, strategy_options(s, 2).mixed_precision(shardtorch::MixedPrecision().param_dtype(at::kBFloat16)));
      auto out = m(x);
      require(out.scalar_type() == at::kBFloat16, "expected a bf16 output");
      out.sum().backward();
      shardtorch::FullParams full(*m);
      require(m->b->order.scalar_type() == at::kLong && at::equal(m->b->order, torch::tensor({2, 0, 1}, torch::kLong)),
              "the index parameter changed under mixed precision");
      require(m->b->mask.scalar_type() == at::kBool && at::equal(m->b->mask, torch::tensor({true, false, true})),
              "the mask parameter changed under mixed precision");
    });
    EXPECT_TRUE(r.ok) << shardtorch::strategy_name(s) << " + bf16: " << r.summary();
  }
}
