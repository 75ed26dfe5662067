// FullShard training equals single-process training on the full batch.
#include <gtest/gtest.h>

#include <cmath>

#include "models.h"
#include "reference.h"

using namespace testmodels;
using shardtorch::World;
using shardtorch::testing::run_ranks;

namespace {

constexpr double kTol = 1e-5;

template <class Model>
struct Reference {
  std::map<std::string, torch::Tensor> first_grads, final_params;
  std::vector<double> losses;
};

// Trains `make()` on the full batch in this process with torch::optim.
template <class Model, class MakeModel, class LossFn, class MakeOpt>
Reference<Model> train_reference(MakeModel make, LossFn loss_fn, MakeOpt make_opt, const torch::Tensor& x,
                                 const torch::Tensor& y, int steps) {
  torch::manual_seed(0);
  Model model = make();
  auto opt = make_opt(*model);
  Reference<Model> ref;
  for (int s = 0; s < steps; ++s) {
    opt->zero_grad();
    auto loss = loss_fn(model, x, y);
    loss.backward();
    ref.losses.push_back(loss.template item<double>());
    if (s == 0)
      for (auto& [n, p] : unique_params(*model))
        if (p.grad().defined()) ref.first_grads[n] = p.grad().clone();
    opt->step();
  }
  ref.final_params = snapshot(*model);
  return ref;
}

// The same on `world` ranks, each on its slice; checks the first gradients,
// the final parameters and the memory accounting against the reference.
template <class Model, class MakeModel, class LossFn, class MakeOpt>
void train_sharded(World& w, MakeModel make, LossFn loss_fn, MakeOpt make_opt, const torch::Tensor& x,
                   const torch::Tensor& y, int steps, const Reference<Model>& ref, shardtorch::ShardOptions opts = {},
                   int max_gathered_units = 2) {
  torch::manual_seed(0);
  Model model = make();
  auto sm = shardtorch::shard(model, w, opts);
  auto opt = make_opt(*model);
  const int64_t per = kBatch / w.size();
  auto xs = x.narrow(0, w.rank() * per, per), ys = y.narrow(0, w.rank() * per, per);

  // Memory: every flat parameter holds ceil(numel / N) elements on this rank.
  int64_t expect_shard_bytes = 0;
  for (const auto& u : sm.units())
    for (const auto& l : u.layouts) {
      require(l.shard_numel() == (l.total_numel() + w.size() - 1) / w.size(), "shard is not ceil(numel/N)");
      expect_shard_bytes += l.shard_numel() * 4;
    }
  auto m0 = sm.memory();
  require(m0.cur(shardtorch::Mem::ShardedParams) == expect_shard_bytes,
          "sharded bytes " + std::to_string(m0.cur(shardtorch::Mem::ShardedParams)) +
              " != " + std::to_string(expect_shard_bytes));
  require(m0.cur(shardtorch::Mem::GatheredParams) == 0, "full parameters alive after shard()");
  sm.reset_peak_memory();

  for (int s = 0; s < steps; ++s) {
    sm.reset_peak_memory();
    opt->zero_grad();
    auto loss = loss_fn(model, xs, ys);
    loss.backward();
    auto m = sm.memory();
    require(m.peak_gathered_units <= max_gathered_units, "step " + std::to_string(s) + ": peak gathered units " +
                                                             std::to_string(m.peak_gathered_units) + " > " +
                                                             std::to_string(max_gathered_units));
    require(m.peak_gathered_units >= 1, "no unit was ever gathered?");
    require(m.cur(shardtorch::Mem::Buckets) == 0, "buckets alive after backward");
    require(m.cur(shardtorch::Mem::GatheredParams) == 0, "full parameters alive after backward");
    require(m.cur(shardtorch::Mem::GradStaging) == 0, "gradient staging alive after backward");
    if (s == 0) {
      shardtorch::FullParams full(*model, shardtorch::SummonOptions().with_grads(true).writeback(false));
      std::map<std::string, torch::Tensor> grads;
      for (auto& [n, p] : unique_params(*model))
        if (p.requires_grad()) grads[n] = p.grad().clone();
      double e = expect_close_map(grads, ref.first_grads, kTol, "gradients before the first step");
      if (w.rank() == 0) std::cout << "  world " << w.size() << ": max relative error of first gradients " << e << "\n";
    }
    opt->step();
  }
  // Units became final in the reduction order: none waited for its turn.
  require(sm.stats().reductions_deferred == 0, std::to_string(sm.stats().reductions_deferred) + " reductions deferred");
  shardtorch::FullParams full(*model);
  double e = expect_close_map(snapshot(*model), ref.final_params, kTol,
                              "parameters after " + std::to_string(steps) + " steps");
  if (w.rank() == 0)
    std::cout << "  world " << w.size() << ": max relative error of parameters after " << steps << " steps " << e
              << std::endl;
}

auto make_gpt = [] { return gpt::GPT(gpt::Config{}); };
auto gpt_loss = [](gpt::GPT& m, const torch::Tensor& x, const torch::Tensor&) { return gpt::lm_loss(m(x), x); };
auto make_mlp = [] { return testmodels::MLP(); };
auto mlp_loss = [](testmodels::MLP& m, const torch::Tensor& x, const torch::Tensor& y) {
  return torch::mse_loss(m(x), y);
};
auto torch_adam = [](torch::nn::Module& m) {
  return std::make_unique<torch::optim::Adam>(unique_tensors(m), torch::optim::AdamOptions(1e-3));
};
auto sharded_adam = [](torch::nn::Module& m) { return shardtorch::Adam(m, torch::optim::AdamOptions(1e-3)); };

}  // namespace

class GptParity : public ::testing::TestWithParam<int> {};

TEST_P(GptParity, FullShardAdamMatchesSingleProcess) {
  auto x = gpt_tokens();
  auto ref = train_reference<gpt::GPT>(make_gpt, gpt_loss, torch_adam, x, x, 5);
  auto r = run_ranks(GetParam(),
                     [&](World& w) { train_sharded<gpt::GPT>(w, make_gpt, gpt_loss, sharded_adam, x, x, 5, ref); });
  ASSERT_TRUE(r.ok) << r.summary();
}

INSTANTIATE_TEST_SUITE_P(Worlds, GptParity, ::testing::Values(1, 2, 3, 4));

class MlpParity : public ::testing::TestWithParam<int> {};

TEST_P(MlpParity, OddSizesFrozenBiasAndBufferMatchSingleProcess) {
  torch::manual_seed(7);
  auto x = torch::randn({kBatch, 7});
  auto y = torch::randn({kBatch, 3});
  auto ref = train_reference<testmodels::MLP>(make_mlp, mlp_loss, torch_adam, x, y, 6);
  auto r = run_ranks(GetParam(), [&](World& w) {
    // A different buffer on every rank before shard(): rank 0's must win.
    auto make = [&] {
      auto m = testmodels::MLP();
      m->scale.fill_(1.0 + w.rank());
      return m;
    };
    train_sharded<testmodels::MLP>(w, make, mlp_loss, sharded_adam, x, y, 6, ref);
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

INSTANTIATE_TEST_SUITE_P(Worlds, MlpParity, ::testing::Values(1, 2, 3, 4));

TEST(Parity, ParamGroupsAdamWNoDecayOnNormsAndBiasesWithLrSchedule) {
  auto x = gpt_tokens();
  auto groups_of = [](torch::nn::Module& m) {
    std::vector<torch::Tensor> decay, no_decay;
    for (auto& [n, p] : unique_params(m)) {
      bool nd = n.find("bias") != std::string::npos || n.find("ln") != std::string::npos;
      (nd ? no_decay : decay).push_back(p);
    }
    return std::make_pair(decay, no_decay);
  };
  auto opts = [](double wd) { return torch::optim::AdamWOptions(3e-3).weight_decay(wd); };
  // The learning rate changes before each step: 3e-3, 2.5e-3, 2e-3, 1.5e-3.
  torch::manual_seed(0);
  auto ref_model = gpt::GPT(gpt::Config{});
  auto [d, nd] = groups_of(*ref_model);
  torch::optim::AdamW ref_opt(
      {torch::optim::OptimizerParamGroup(d, std::make_unique<torch::optim::AdamWOptions>(opts(0.1))),
       torch::optim::OptimizerParamGroup(nd, std::make_unique<torch::optim::AdamWOptions>(opts(0.0)))},
      opts(0.0));
  const int steps = 4;
  const auto want = testref::train_reference(*ref_model, ref_opt, steps, [&](int s) {
    if (s > 0)
      for (auto& g : ref_opt.param_groups()) g.options().set_lr(3e-3 - 1e-3 * s * 0.5);
    return gpt::lm_loss(ref_model(x), x);
  });

  auto r = run_ranks(3, [&](World& w) {
    torch::manual_seed(0);
    auto model = gpt::GPT(gpt::Config{});
    shardtorch::shard(model, w);
    auto [dd, ndd] = groups_of(*model);
    auto opt = shardtorch::AdamW(*model, opts(0.0), {{dd, opts(0.1)}, {ndd, opts(0.0)}});
    require(opt->num_groups() == 2, "expected 2 groups, got " + std::to_string(opt->num_groups()));
    const int64_t per = kBatch / w.size();
    auto xs = x.narrow(0, w.rank() * per, per);
    const auto got = testref::train_ranks(*model, *opt, steps, [&](int s) {
      if (s > 0) opt->set_lr(3e-3 - 1e-3 * s * 0.5);
      gpt::lm_loss(model(xs), xs).backward();
    });
    require(std::abs(opt->lr(1) - (3e-3 - 1e-3 * (steps - 1) * 0.5)) < 1e-12, "set_lr did not stick");
    testref::expect_same_run(got, want, kTol, "AdamW with groups");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// The default group (parameters named in no group) must exist on every rank,
// also on one that owns none of their elements: here at 2 ranks the MLP's
// trainable biases (l1's, l3's) lie wholly in rank 1's shards. Before, rank 0
// had one group and rank 1 two, so set_lr(1, ...) threw on rank 0 only.
TEST(Parity, TheDefaultParamGroupExistsOnEveryRank) {
  torch::manual_seed(7);
  auto x = torch::randn({kBatch, 7});
  auto y = torch::randn({kBatch, 3});
  auto weights_of = [](torch::nn::Module& m) {
    std::vector<torch::Tensor> w, b;
    for (auto& [n, p] : unique_params(m))
      if (p.requires_grad()) (n.find("bias") != std::string::npos ? b : w).push_back(p);
    return std::make_pair(w, b);
  };
  auto opts = [](double wd) { return torch::optim::AdamWOptions(1e-2).weight_decay(wd); };
  auto torch_groups = [&](torch::nn::Module& m) {
    auto [w, b] = weights_of(m);
    return std::make_unique<torch::optim::AdamW>(
        std::vector<torch::optim::OptimizerParamGroup>{
            torch::optim::OptimizerParamGroup(w, std::make_unique<torch::optim::AdamWOptions>(opts(0.1))),
            torch::optim::OptimizerParamGroup(b, std::make_unique<torch::optim::AdamWOptions>(opts(0.0)))},
        opts(0.0));
  };
  auto ref = train_reference<testmodels::MLP>(make_mlp, mlp_loss, torch_groups, x, y, 4);
  auto sharded_groups = [&](torch::nn::Module& m) {
    auto opt = shardtorch::AdamW(m, opts(0.0), {{weights_of(m).first, opts(0.1)}});
    require(opt->num_groups() == 2, "expected 2 groups on every rank, got " + std::to_string(opt->num_groups()));
    opt->set_lr(1, 1e-2);  // the default group, on every rank
    return opt;
  };
  auto r = run_ranks(
      2, [&](World& w) { train_sharded<testmodels::MLP>(w, make_mlp, mlp_loss, sharded_groups, x, y, 4, ref); });
  ASSERT_TRUE(r.ok) << r.summary();
}

class BadGroups : public ::testing::TestWithParam<shardtorch::Strategy> {};

// A parameter given twice, in two groups or twice in one, and a tensor that
// is not the model's are errors naming the rank and the parameter.
TEST_P(BadGroups, BadParameterGroupsNameTheRankAndTheParameter) {
  const shardtorch::Strategy s = GetParam();
  auto r = run_ranks(2, [&](World& w) {
    testmodels::MLP m;
    shardtorch::shard(m, w, testmodels::strategy_options(s, 2));
    auto w1 = m->l1->lin->weight;
    auto opts = torch::optim::AdamWOptions(1e-2);
    auto error_of = [&](std::vector<shardtorch::ParamGroup<torch::optim::AdamWOptions>> groups) -> std::string {
      try {
        shardtorch::AdamW(*m, opts, std::move(groups));
      } catch (const std::exception& e) {
        return e.what();
      }
      return "no error";
    };
    const std::string rank = "rank " + std::to_string(w.rank()) + ": ";
    for (const auto& e : {error_of({{{w1}, opts}, {{w1}, opts}}), error_of({{{w1, w1}, opts}})})
      require(e.find(rank + "parameter 'l1.lin.weight' [13, 7] is given twice") != std::string::npos, e);
    const auto e = error_of({{{torch::zeros({2, 2}, torch::requires_grad())}, opts}});
    require(
        e.find(rank + "a tensor of shape [2, 2] given in a parameter group is not a parameter") != std::string::npos,
        e);
  });
  ASSERT_TRUE(r.ok) << shardtorch::strategy_name(s) << ": " << r.summary();
}

INSTANTIATE_TEST_SUITE_P(Parity, BadGroups,
                         ::testing::Values(shardtorch::Strategy::FullShard, shardtorch::Strategy::NoShard),
                         testmodels::StrategyName());

TEST(Parity, SgdMomentumNesterovWeightDecay) {
  torch::manual_seed(7);
  auto x = torch::randn({kBatch, 7});
  auto y = torch::randn({kBatch, 3});
  auto sgd_opts = torch::optim::SGDOptions(0.05).momentum(0.9).nesterov(true).weight_decay(1e-3);
  auto torch_sgd = [&](torch::nn::Module& m) {
    return std::make_unique<torch::optim::SGD>(unique_tensors(m), sgd_opts);
  };
  auto sharded_sgd = [&](torch::nn::Module& m) { return shardtorch::SGD(m, sgd_opts); };
  auto ref = train_reference<testmodels::MLP>(make_mlp, mlp_loss, torch_sgd, x, y, 6);
  auto r =
      run_ranks(2, [&](World& w) { train_sharded<testmodels::MLP>(w, make_mlp, mlp_loss, sharded_sgd, x, y, 6, ref); });
  ASSERT_TRUE(r.ok) << r.summary();
}

TEST(Parity, NoReshardAfterForwardAndNoCoalescing) {
  auto x = gpt_tokens();
  auto ref = train_reference<gpt::GPT>(make_gpt, gpt_loss, torch_adam, x, x, 3);
  auto r = run_ranks(2, [&](World& w) {
    train_sharded<gpt::GPT>(w, make_gpt, gpt_loss, sharded_adam, x, x, 3, ref,
                            shardtorch::ShardOptions().reshard_after_forward(false).bucket_mb(0),
                            /*max_gathered_units=*/3);  // root and both blocks stay until the end of backward
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// expect_same_run names the tensor at fault: one the reference has and the
// run lacks, one the run has and the reference lacks, both shapes, and a
// NaN as such (it printed "by -nan", and only counts for the first two).
TEST(Parity, ARunThatDiffersFromTheReferenceIsNamedByItsTensor) {
  using shardtorch::testing::Run;
  Run want;
  want.first_grads = {{"a", at::ones({2})}, {"b", at::ones({3})}};
  want.final_params = want.first_grads;
  const auto message = [&](const Run& got) {
    try {
      shardtorch::testing::expect_same_run(got, want, 1e-6, "run");
    } catch (const std::runtime_error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  Run got = want;
  EXPECT_EQ(message(got), "no error");
  got.first_grads.erase("b");
  EXPECT_EQ(message(got), "run: first gradients: 'b' is missing (the reference has it, of shape [3])");
  got = want;
  got.first_grads["c"] = at::ones({1});
  EXPECT_EQ(message(got), "run: first gradients: 'c' (of shape [1]) is not in the reference");
  got = want;
  got.final_params["b"] = at::ones({4});
  EXPECT_EQ(message(got), "run: final parameters: 'b' is of shape [4], the reference's [3]");
  got = want;
  got.first_grads["a"] = at::full({2}, NAN);
  EXPECT_EQ(message(got),
            "run: first gradients: 'a' has a NaN or infinite element where the reference has none, or "
            "the other way round");
}
