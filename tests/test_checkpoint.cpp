// Unusual model and optimizer state through both kinds of checkpoint: an
// empty parameter, and optimizer groups that differ in amsgrad.
#include <gtest/gtest.h>

#include <cmath>

#include "models.h"
#include "shardtorch/checkpoint.h"

using namespace testmodels;
using shardtorch::Strategy;
using shardtorch::World;
using shardtorch::testing::run_ranks;

namespace {

struct EmptyParameterCase {
  Strategy s;
  bool offload;
  bool bf16;
};

// Every strategy, and FullShard offloaded and with bf16.
std::vector<EmptyParameterCase> empty_parameter_cases() {
  std::vector<EmptyParameterCase> cases;
  for (auto s : kAllStrategies) cases.push_back({s, false, false});
  cases.push_back({Strategy::FullShard, true, false});
  cases.push_back({Strategy::FullShard, false, true});
  return cases;
}

class EmptyParameter : public ::testing::TestWithParam<EmptyParameterCase> {};

}  // namespace

// A parameter with no elements has an empty flat parameter (or an empty slice
// of one) under every strategy: clipping skips it, summoning and both kinds
// of checkpoint carry it, and loading into a differently initialised model
// reproduces the saved parameters and optimizer state bitwise.
TEST_P(EmptyParameter, AnEmptyParameterGoesThroughClippingSummonAndBothCheckpoints) {
  const TempDir dir;
  torch::manual_seed(5);
  auto x = torch::randn({4, 7});
  const EmptyParameterCase c = GetParam();
  const std::string what =
      std::string(shardtorch::strategy_name(c.s)) + (c.offload ? "+offload" : "") + (c.bf16 ? "+bf16" : "");
  const auto full = (dir / (what + ".safetensors")).string(), sharded = (dir / what).string();
  auto options = [&] {
    auto o = strategy_options(c.s, 2).cpu_offload(c.offload);
    if (c.bf16) o.mixed_precision(shardtorch::MixedPrecision().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat));
    return o;
  };
  auto r = run_ranks(2, [&](World& w) {
    torch::manual_seed(0);
    WithEmpty m;
    auto sm = shardtorch::shard(m, w, options());
    auto opt = shardtorch::AdamW(*m, torch::optim::AdamWOptions(1e-2));
    for (int step = 0; step < 2; ++step) {
      opt->zero_grad();
      (m(x.narrow(0, 2 * w.rank(), 2)).square().sum() * 2).backward();
      double norm2 = shardtorch::clip_grad_norm(*m, 1e9);
      double norm_inf = shardtorch::clip_grad_norm(*m, 1e9, INFINITY);
      require(std::isfinite(norm2) && norm2 > 0 && norm_inf > 0 && norm_inf <= norm2, "bad gradient norms");
      opt->step();
    }
    {
      shardtorch::FullParams scope(*m);
      require(m->b->none.sizes() == at::IntArrayRef({0, 3}), "the empty parameter changed shape");
      require(m->b->lin->weight.abs().sum().item<double>() > 0, "summoned weight is zero");
    }
    auto mine = shardtorch::full_parameters(*m);
    require(mine.count("b.none") && mine.at("b.none").numel() == 0, "full_parameters lost the empty parameter");
    shardtorch::save_full_state_dict(*m, full);
    shardtorch::save_sharded_checkpoint(*m, opt.get(), sharded, 2);

    torch::manual_seed(1);
    WithEmpty again;
    shardtorch::shard(again, w, options());
    auto opt2 = shardtorch::AdamW(*again, torch::optim::AdamWOptions(1e-2));
    require(shardtorch::load_sharded_checkpoint(*again, opt2.get(), sharded) == 2, "wrong step");
    auto loaded = shardtorch::full_parameters(*again);
    for (auto& [n, t] : mine) require(at::equal(loaded.at(n), t), n + " differs after the sharded checkpoint");
    // This rank's optimizer state, piece by piece (both models are laid out alike).
    const auto& had = opt->views().pieces();
    const auto& got = opt2->views().pieces();
    require(had.size() == got.size(), "the optimizers have different pieces");
    int compared = 0;
    for (size_t k = 0; k < had.size(); ++k) {
      auto a = opt->inner().state().find(had[k].view.unsafeGetTensorImpl());
      auto b = opt2->inner().state().find(got[k].view.unsafeGetTensorImpl());
      require((a == opt->inner().state().end()) == (b == opt2->inner().state().end()),
              had[k].name + ": optimizer state on one side only");
      if (a == opt->inner().state().end()) continue;
      auto& sa = static_cast<torch::optim::AdamWParamState&>(*a->second);
      auto& sb = static_cast<torch::optim::AdamWParamState&>(*b->second);
      require(sa.step() == sb.step() && at::equal(sa.exp_avg(), sb.exp_avg()) &&
                  at::equal(sa.exp_avg_sq(), sb.exp_avg_sq()),
              had[k].name + ": optimizer state differs after the sharded checkpoint (in its values or its shape)");
      ++compared;
    }
    require(compared > 0, "no optimizer state compared on rank " + std::to_string(w.rank()));
    torch::manual_seed(2);
    WithEmpty third;
    shardtorch::shard(third, w, options());
    shardtorch::load_full_state_dict(*third, full);
    auto from_full = shardtorch::full_parameters(*third);
    for (auto& [n, t] : mine) require(at::equal(from_full.at(n), t), n + " differs after the full state dict");
  });
  ASSERT_TRUE(r.ok) << what << ": " << r.summary();
  auto saved = shardtorch::read_sharded_checkpoint(sharded);
  ASSERT_TRUE(saved.count("b.none|param")) << what << ": the empty parameter is not listed";
  EXPECT_EQ(saved.at("b.none|param").numel(), 0) << what;
  EXPECT_GT(saved.at("b.lin.weight|exp_avg").abs().sum().item<double>(), 0) << what;
}

INSTANTIATE_TEST_SUITE_P(Checkpoint, EmptyParameter, ::testing::ValuesIn(empty_parameter_cases()),
                         [](const ::testing::TestParamInfo<EmptyParameterCase>& info) {
                           return std::string(shardtorch::strategy_name(info.param.s)) +
                                  (info.param.offload ? "_offload" : "") + (info.param.bf16 ? "_bf16" : "");
                         });

class AmsgradGroups : public ::testing::TestWithParam<Strategy> {};

// Groups that differ in amsgrad: only the amsgrad group's parameters have a
// max_exp_avg_sq. Loading asked whether the checkpoint had any at all and
// then planned one for every parameter, failing with "not all saved (a
// missing shard?)". Each parameter's state now comes back as it was saved.
TEST_P(AmsgradGroups, OptimizerStateOfGroupsThatDifferInAmsgradRoundTrips) {
  const TempDir dir;
  const shardtorch::Strategy s = GetParam();
  const std::string ckpt = (dir / shardtorch::strategy_name(s)).string();
  auto r = run_ranks(2, [&](World& w) {
    MLP m;
    shardtorch::shard(m, w, strategy_options(s, 2));
    auto make = [&] {
      return shardtorch::Adam(*m, torch::optim::AdamOptions(0.1),
                              {{{m->l1->lin->weight}, torch::optim::AdamOptions(0.1).amsgrad(true)}});
    };
    auto backward = [&](const std::unique_ptr<shardtorch::ShardedOptimizer>& opt) {
      opt->zero_grad();
      m(torch::ones({2, 7}) * (1 + w.rank())).square().sum().backward();
    };
    auto opt = make();
    backward(opt);
    opt->step();
    shardtorch::save_sharded_checkpoint(*m, opt.get(), ckpt, 1);
    auto resumed = make();
    require(shardtorch::load_sharded_checkpoint(*m, resumed.get(), ckpt) == 1, "wrong step");
    auto &a = opt->inner(), &b = resumed->inner();
    int with_max = 0;
    for (size_t g = 0; g < a.param_groups().size(); ++g) {
      for (size_t k = 0; k < a.param_groups()[g].params().size(); ++k) {
        auto* pa = a.param_groups()[g].params()[k].unsafeGetTensorImpl();
        auto* pb = b.param_groups()[g].params()[k].unsafeGetTensorImpl();
        require(a.state().count(pa) == b.state().count(pb), "state present on one side only");
        if (!a.state().count(pa)) continue;
        auto& sa = static_cast<torch::optim::AdamParamState&>(*a.state().at(pa));
        auto& sb = static_cast<torch::optim::AdamParamState&>(*b.state().at(pb));
        require(sa.step() == sb.step() && at::equal(sa.exp_avg(), sb.exp_avg()) &&
                    at::equal(sa.exp_avg_sq(), sb.exp_avg_sq()),
                "moments differ after the load");
        require(sa.max_exp_avg_sq().defined() == sb.max_exp_avg_sq().defined() &&
                    (!sa.max_exp_avg_sq().defined() || at::equal(sa.max_exp_avg_sq(), sb.max_exp_avg_sq())),
                "max_exp_avg_sq differs after the load (group " + std::to_string(g) + ")");
        with_max += sa.max_exp_avg_sq().defined();
      }
    }
    require(with_max <= 1, "max_exp_avg_sq outside the amsgrad group");
    backward(resumed);
    resumed->step();
  });
  EXPECT_TRUE(r.ok) << shardtorch::strategy_name(s) << ": " << r.summary();
}

INSTANTIATE_TEST_SUITE_P(Checkpoint, AmsgradGroups, ::testing::Values(Strategy::FullShard, Strategy::NoShard),
                         StrategyName());
