// Strategy details: no_sync, memory against the ZeRO formulas, DDP overlap and
// bucket views, unused parameters, per-unit resharding, bad configuration.
#include <gtest/gtest.h>

#include "captured_warnings.h"
#include "models.h"
#include "reference.h"

using namespace testmodels;
using shardtorch::Mem;
using shardtorch::ShardOptions;
using shardtorch::Strategy;
using shardtorch::World;
using shardtorch::testing::run_ranks;

namespace {
std::string name_of(const ::testing::TestParamInfo<Strategy>& info) { return shardtorch::strategy_name(info.param); }
}  // namespace

class EveryStrategy : public ::testing::TestWithParam<Strategy> {};

TEST_P(EveryStrategy, NoSyncReducesNothingUntilTheSynchronisingBackward) {
  const Strategy strategy = GetParam();
  auto r = run_ranks(2, [&](World& w) {
    auto model = gpt::GPT(gpt::Config{});
    auto sm = shardtorch::shard(model, w, strategy_options(strategy, 2));
    auto x = torch::randint(0, 64, {2, 16}, torch::kLong);
    {
      auto guard = sm.no_sync();
      require(!sm.requires_gradient_sync(), "no_sync() did not switch sync off");
      gpt::lm_loss(model(x), x).backward();
      gpt::lm_loss(model(x), x).backward();
    }
    require(sm.requires_gradient_sync(), "no_sync() did not restore sync");
    require(sm.stats().gradient_reductions == 0,
            "reduced during no_sync: " + std::to_string(sm.stats().gradient_reductions));
    const int64_t staged = sm.memory().cur(Mem::GradStaging);
    require(sm.memory().rank == w.global_rank(), "memory() is not this rank's");
    if (strategy == Strategy::NoShard) {
      require(staged == 0, "NoShard accumulates in its buckets, nothing staged");
    } else {
      require(staged > 0, "sharded strategies keep unsharded gradients while accumulating");
    }
    gpt::lm_loss(model(x), x).backward();
    require(sm.stats().gradient_reductions > 0, "the synchronising backward reduced nothing");
    require(sm.memory().cur(Mem::GradStaging) == 0, "staged gradients left after the synchronising backward");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

TEST_P(EveryStrategy, ModelStateMemoryMatchesTheZeroFormula) {
  const Strategy strategy = GetParam();
  for (int world : {2, 3, 4}) {
    auto r = run_ranks(world, [&](World& w) {
      auto model = gpt::GPT(gpt::Config{});
      int64_t psi = 0;
      for (auto& [n, p] : unique_params(*model)) psi += p.numel();
      auto sm = shardtorch::shard(model, w, strategy_options(strategy, world));
      auto opt = shardtorch::Adam(*model, torch::optim::AdamOptions(1e-3));
      auto x = torch::randint(0, 64, {2, 16}, torch::kLong);
      gpt::lm_loss(model(x), x).backward();
      opt->step();
      auto m = sm.memory();
      const int64_t state =
          m.cur(Mem::ShardedParams) + m.cur(Mem::ReplicatedParams) + m.cur(Mem::Gradients) + m.cur(Mem::OptimizerState);
      const double n = world, P = static_cast<double>(psi);
      const double s = strategy_options(strategy, world).hybrid_shard_size();  // HybridShard only
      double formula = 0;
      switch (strategy) {
        case Strategy::FullShard:
          formula = 16 * P / n;
          break;
        case Strategy::ShardGradOp:
          formula = 4 * P + 12 * P / n;
          break;
        case Strategy::OptimizerOnly:
          formula = 8 * P + 8 * P / n;
          break;
        case Strategy::NoShard:
          formula = 16 * P;
          break;
        case Strategy::HybridShard:
          formula = 16 * P / s;
          break;
      }
      int64_t padding = 0, flats = 0;
      for (const auto& u : sm.units())
        for (const auto& l : u.layouts) padding += l.padding(), ++flats;
      const double slack = 16.0 * (padding + flats);  // padding, and ceil() per flat parameter
      if (w.rank() == 0) {
        std::printf(
            "  memory %-14s N=%d psi=%lld formula=%.0f measured=%lld (params %lld + %lld, grads %lld, optim %lld)\n",
            shardtorch::strategy_name(strategy), world, static_cast<long long>(psi), formula,
            static_cast<long long>(state), static_cast<long long>(m.cur(Mem::ShardedParams)),
            static_cast<long long>(m.cur(Mem::ReplicatedParams)), static_cast<long long>(m.cur(Mem::Gradients)),
            static_cast<long long>(m.cur(Mem::OptimizerState)));
        std::fflush(stdout);
      }
      require(std::abs(state - formula) <= slack, std::string(shardtorch::strategy_name(strategy)) +
                                                      " at N=" + std::to_string(world) + ": model state " +
                                                      std::to_string(state) + " bytes, formula " +
                                                      std::to_string(formula) + " +- " + std::to_string(slack));
    });
    ASSERT_TRUE(r.ok) << r.summary();
  }
}

// Under bf16 mixed precision NoShard holds what ZeRO counts between steps,
// 2 + 2 + 12 bytes per parameter (bf16 parameters and buckets, fp32 masters
// and moments); the masters' fp32 gradients exist from the synchronising
// backward to the end of the step only, and the model keeps its gradients.
// (A second step without a backward then finds no master gradients.)
TEST(NoShard, MixedPrecisionKeepsTheZeroCountBetweenSteps) {
  auto r = run_ranks(2, [&](World& w) {
    auto model = gpt::GPT(gpt::Config{});
    int64_t psi = 0;
    for (auto& [n, p] : unique_params(*model)) psi += p.numel();
    auto opts = strategy_options(Strategy::NoShard, 2)
                    .mixed_precision(shardtorch::MixedPrecision().param_dtype(at::kBFloat16).output_dtype(at::kFloat));
    auto sm = shardtorch::shard(model, w, opts);
    auto opt = shardtorch::Adam(*model, torch::optim::AdamOptions(1e-3));
    auto x = torch::randint(0, 64, {2, 16}, torch::kLong);
    for (int step = 0; step < 2; ++step) {
      opt->zero_grad();
      gpt::lm_loss(model(x), x).backward();
      const int64_t copies = sm.memory().cur(Mem::MasterGrads);
      require(copies == 4 * psi, "after backward the masters' fp32 gradients hold " + std::to_string(copies) +
                                     " bytes, not 4 psi = " + std::to_string(4 * psi));
      opt->step();
      auto m = sm.memory();
      const int64_t state = m.cur(Mem::ReplicatedParams) + m.cur(Mem::Gradients) + m.cur(Mem::OptimizerState);
      require(state == 16 * psi, "model state after step " + std::to_string(step) + ": " + std::to_string(state) +
                                     " bytes, not 16 psi = " + std::to_string(16 * psi));
      require(m.cur(Mem::MasterGrads) == 0, "the masters' fp32 gradients outlived the step");
    }
    int64_t with_grads = 0;
    for (auto& [n, p] : unique_params(*model)) {
      require(!p.grad().defined() || p.grad().scalar_type() == at::kBFloat16, n + "'s gradient is not bf16");
      with_grads += p.grad().defined();
    }
    require(with_grads > 0, "the step took the model's own gradients away");
    auto before = model->parameters()[0].clone();
    opt->step();  // no backward since the last step: nothing to apply
    require(torch::equal(before, model->parameters()[0]), "a step without a backward changed the parameters");
  });
  ASSERT_TRUE(r.ok) << r.summary();
  // With fp32 reductions the masters' gradients are views of the buckets,
  // nothing is copied, and they stay after the step until zero_grad.
  auto fp32_reduce = run_ranks(2, [&](World& w) {
    auto model = gpt::GPT(gpt::Config{});
    auto mp = shardtorch::MixedPrecision().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat).output_dtype(at::kFloat);
    auto sm = shardtorch::shard(model, w, strategy_options(Strategy::NoShard, 2).mixed_precision(mp));
    auto opt = shardtorch::Adam(*model, torch::optim::AdamOptions(1e-3));
    auto x = torch::randint(0, 64, {2, 16}, torch::kLong);
    gpt::lm_loss(model(x), x).backward();
    const double before = shardtorch::clip_grad_norm(*model, 1e30);
    opt->step();
    const double after = shardtorch::clip_grad_norm(*model, 1e30);
    require(sm.memory().max(Mem::MasterGrads) == 0, "fp32 reductions copied gradients");
    require(before > 0 && after == before, "the gradient norm was " + std::to_string(before) + " before the step and " +
                                               std::to_string(after) + " after it");
  });
  ASSERT_TRUE(fp32_reduce.ok) << fp32_reduce.summary();
}

TEST_P(EveryStrategy, FrozenParametersHoldNoGradientOrOptimizerMemoryAndMatch) {
  const Strategy strategy = GetParam();
  torch::manual_seed(7);
  auto x = torch::randn({12, 7}), y = torch::randn({12, 3});
  torch::manual_seed(0);
  auto ref = MLP();
  torch::optim::Adam ref_opt(unique_tensors(*ref), torch::optim::AdamOptions(1e-3));
  const auto want = testref::train_reference(*ref, ref_opt, 3, [&](int) { return torch::mse_loss(ref(x), y); });
  auto r = run_ranks(2, [&](World& w) {
    torch::manual_seed(0);
    auto m = MLP();
    int64_t trainable = 0;
    for (auto& [n, p] : unique_params(*m)) trainable += p.requires_grad() ? p.numel() : 0;
    auto sm = shardtorch::shard(m, w, strategy_options(strategy, 2));
    auto opt = shardtorch::Adam(*m, torch::optim::AdamOptions(1e-3));
    const auto got = testref::train_ranks(*m, *opt, 3, [&](int) {
      torch::mse_loss(m(x.narrow(0, 6 * w.rank(), 6)), y.narrow(0, 6 * w.rank(), 6)).backward();
    });
    auto mem = sm.memory();
    // Frozen elements have no gradient or optimizer state anywhere.
    require(mem.cur(Mem::OptimizerState) <= 8 * trainable, "optimizer state covers frozen parameters");
    int64_t grad_bound = 4 * trainable;
    for (const auto& u : sm.units())
      for (size_t f = 0; f < u.layouts.size(); ++f)
        if (!u.frozen[f]) grad_bound += 4 * u.layouts[f].padding();
    require(mem.cur(Mem::Gradients) <= grad_bound, "gradient memory covers frozen parameters");
    testref::expect_same_run(got, want, 1e-5, shardtorch::strategy_name(strategy));
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// LibTorch's Module::zero_grad() sets the gradients to none (set_to_none
// defaults to true): a loop that clears them through the module instead of
// the optimizer must train the same.
TEST_P(EveryStrategy, ClearingGradientsThroughTheModuleTrainsAsTheOptimizersZeroGrad) {
  const Strategy strategy = GetParam();
  torch::manual_seed(7);
  auto x = torch::randn({12, 7}), y = torch::randn({12, 3});
  torch::manual_seed(0);
  auto ref = MLP();
  torch::optim::Adam ref_opt(unique_tensors(*ref), torch::optim::AdamOptions(1e-2));
  const auto want = testref::train_reference(*ref, ref_opt, 3, [&](int) { return torch::mse_loss(ref(x), y); });
  auto r = run_ranks(2, [&](World& w) {
    torch::manual_seed(0);
    auto m = MLP();
    auto sm = shardtorch::shard(m, w, strategy_options(strategy, 2));
    auto opt = shardtorch::Adam(*m, torch::optim::AdamOptions(1e-2));
    testref::Run got;
    for (int s = 0; s < 3; ++s) {
      m->zero_grad();                       // set_to_none
      if (strategy != Strategy::NoShard) {  // (NoShard's are views of the cleared buckets)
        for (const auto& g : opt->inner().param_groups())
          for (const auto& p : g.params())
            require(!p.grad().defined(),
                    "an optimizer parameter kept its gradient (and the old shard's memory) "
                    "after the module's zero_grad");
      }
      torch::mse_loss(m(x.narrow(0, 6 * w.rank(), 6)), y.narrow(0, 6 * w.rank(), 6)).backward();
      if (s == 0) got.first_grads = testref::full_gradients(*m);
      opt->step();
    }
    got.final_params = testref::full_parameters(*m);
    testref::expect_same_run(got, want, 1e-5, std::string(shardtorch::strategy_name(strategy)) + ", module zero_grad");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// The same under mixed precision with fp32 reductions of bf16 gradients,
// where NoShard's buckets are not the parameters' own gradients: bitwise as
// the optimizer's zero_grad.
TEST_P(EveryStrategy, ClearingGradientsThroughTheModuleUnderMixedPrecisionTrainsAsTheOptimizersZeroGrad) {
  const Strategy strategy = GetParam();
  torch::manual_seed(7);
  auto x = torch::randn({12, 7}), y = torch::randn({12, 3});
  auto r = run_ranks(2, [&](World& w) {
    auto train = [&](bool through_module) {
      torch::manual_seed(0);
      auto m = MLP();
      auto sm = shardtorch::shard(m, w,
                                  strategy_options(strategy, 2)
                                      .mixed_precision(shardtorch::MixedPrecision()
                                                           .param_dtype(at::kBFloat16)
                                                           .reduce_dtype(at::kFloat)
                                                           .buffer_dtype(at::kBFloat16)
                                                           .output_dtype(at::kFloat)));
      auto opt = shardtorch::Adam(*m, torch::optim::AdamOptions(1e-2));
      for (int s = 0; s < 3; ++s) {
        if (through_module)
          m->zero_grad();
        else
          opt->zero_grad();
        torch::mse_loss(m(x.narrow(0, 6 * w.rank(), 6)), y.narrow(0, 6 * w.rank(), 6)).backward();
        opt->step();
      }
      return shardtorch::full_parameters(*m);
    };
    auto want = train(false);
    auto got = train(true);
    for (auto& [n, t] : want)
      require(at::equal(t, got.at(n)), std::string(shardtorch::strategy_name(strategy)) + ": '" + n +
                                           "' differs with the module's zero_grad under bf16");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

INSTANTIATE_TEST_SUITE_P(All, EveryStrategy, ::testing::ValuesIn(kAllStrategies), name_of);

// Gradients cleared per submodule, one of them set to none, with and without
// mixed precision (where the fp32 buckets are not the gradients): a parameter
// unused on one rank in the next step (here all of b, on rank 1) is reduced
// as zero there, as after the optimizer's zero_grad, not as the gradient its
// bucket slice held from the step before (which the step then zeroed on that
// rank only, leaving the replicas apart).
TEST(NoShard, GradientsSetToNoneInASubmoduleAreReducedAsZeroWhereNoGradientArrives) {
  torch::manual_seed(3);
  auto x = torch::randn({8, 6});
  auto r = run_ranks(2, [&](World& w) {
    auto train = [&](bool by_hand, bool mixed) {
      torch::manual_seed(0);
      Sometimes model;
      auto opts = strategy_options(Strategy::NoShard, 2).bucket_mb(1e-4);
      if (mixed)  // fp32 buckets: the bf16 gradients are added in, not views
        opts.mixed_precision(
            shardtorch::MixedPrecision().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat).output_dtype(at::kFloat));
      shardtorch::shard(model, w, opts);
      auto opt = shardtorch::Adam(*model, torch::optim::AdamOptions(1e-2));
      for (int s = 0; s < 3; ++s) {
        if (by_hand) {  // per submodule: a's zeroed in place, b's set to none
          model->a->zero_grad(/*set_to_none=*/false);
          model->b->zero_grad();
        } else {
          opt->zero_grad();
        }
        model->use_b = s != 1 || w.rank() == 0;
        model(x.narrow(0, 4 * w.rank(), 4)).square().mean().backward();
        opt->step();
      }
      return shardtorch::full_parameters(*model);
    };
    for (bool mixed : {false, true}) {
      auto want = train(false, mixed);
      auto got = train(true, mixed);
      for (auto& [n, t] : want)
        require(at::equal(t, got.at(n)), "'" + n + "' differs when a submodule's gradients were set to none" +
                                             (mixed ? " (bf16, fp32 reductions)" : ""));
    }
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// A unit used on one rank only (b, on rank 0): its parameters get no
// gradient on rank 1 and are reduced as zero there, so the step follows the
// mean of the two ranks' losses, each rank's own forward. With one small
// bucket per parameter, rank 1 has a's buckets full while b's are not: the
// buckets must still be all-reduced in the same order on both ranks (they
// were once launched as they filled, and a's bias was summed with b's).
TEST(NoShard, AUnitUsedOnOneRankOnlyTrainsAsTheMeanOfTheRanksLosses) {
  torch::manual_seed(3);
  auto x = torch::randn({8, 6});
  torch::manual_seed(0);
  Sometimes ref;
  torch::optim::Adam ref_opt(unique_tensors(*ref), torch::optim::AdamOptions(1e-2));
  const auto want = testref::train_reference(*ref, ref_opt, 3, [&](int) {
    torch::Tensor loss = torch::zeros({});
    for (int rank = 0; rank < 2; ++rank) {
      ref->use_b = rank == 0;
      loss = loss + ref(x.narrow(0, 4 * rank, 4)).square().mean() / 2;
    }
    return loss;
  });
  auto r = run_ranks(2, [&](World& w) {
    torch::manual_seed(0);
    Sometimes model;
    shardtorch::shard(model, w, strategy_options(Strategy::NoShard, 2).bucket_mb(1e-4));  // 24 or 144 bytes each
    auto opt = shardtorch::Adam(*model, torch::optim::AdamOptions(1e-2));
    const auto got = testref::train_ranks(*model, *opt, 3, [&](int) {
      model->use_b = w.rank() == 0;
      model(x.narrow(0, 4 * w.rank(), 4)).square().mean().backward();
    });
    testref::expect_same_run(got, want, 1e-5, "a unit used on rank 0 only");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

TEST(NoShard, BucketAllReducesStartDuringBackwardAndGradientsAreBucketViews) {
  auto r = run_ranks(2, [](World& w) {
    auto model = gpt::GPT(gpt::Config{});
    // ~16 KiB buckets: the GPT's ~100 KiB of gradients make several.
    auto sm = shardtorch::shard(model, w, ShardOptions().strategy(Strategy::NoShard).bucket_mb(1.0 / 64));
    auto x = torch::randint(0, 64, {2, 16}, torch::kLong);
    gpt::lm_loss(model(x), x).backward();
    require(sm.stats().buckets_launched_during_backward >= 1, "no bucket was launched before backward ended");
    // Gradients are views of bucket storage: consecutive parameters of one
    // block share a storage.
    auto& ln = model->block_list[1]->ln2;
    require(ln->weight.grad().storage().is_alias_of(ln->bias.grad().storage()), "gradients are not bucket views");
  });
  ASSERT_TRUE(r.ok) << r.summary();
  auto sync = run_ranks(2, [](World& w) {
    auto model = gpt::GPT(gpt::Config{});
    auto sm =
        shardtorch::shard(model, w, ShardOptions().strategy(Strategy::NoShard).bucket_mb(1.0 / 64).ddp_async(false));
    auto x = torch::randint(0, 64, {2, 16}, torch::kLong);
    gpt::lm_loss(model(x), x).backward();
    require(sm.stats().buckets_launched_during_backward == 0, "synchronous mode launched during backward");
    require(sm.stats().gradient_reductions > 1, "synchronous mode reduced nothing");
  });
  ASSERT_TRUE(sync.ok) << sync.summary();
}

struct TwoHeadsImpl : torch::nn::Module {
  TwoHeadsImpl() : a(register_module("a", torch::nn::Linear(4, 4))), b(register_module("b", torch::nn::Linear(4, 4))) {}
  torch::Tensor forward(torch::Tensor x) { return use_b ? a(x) + b(x) : a(x); }  // b only when told
  torch::nn::Linear a, b;
  bool use_b = false;
};
TORCH_MODULE(TwoHeads);

// A parameter no rank gives a gradient ends the backward without one, as
// under DDP and in one process (LibTorch's zero_grad sets gradients to
// none): AdamW neither decays nor moves it and keeps no state for it, and
// the rest trains as the single-process reference does. It used to get a
// zero gradient, which AdamW decayed. A parameter only some ranks use is
// reduced as zero where unused, alike on every rank.
TEST(NoShard, AParameterNoRankUsesGetsNoGradientAndOneSomeUseIsReducedAsZero) {
  auto r = run_ranks(2, [](World& w) {
    const auto x = torch::arange(16, at::kFloat).reshape({4, 4}) / 16;
    const auto options = torch::optim::AdamWOptions(0.1).weight_decay(0.1);
    torch::manual_seed(0);
    TwoHeads ref;
    torch::optim::AdamW ref_opt(ref->parameters(), options);
    torch::manual_seed(0);
    TwoHeads m;
    const at::Tensor b0 = m->b->weight.detach().clone();
    shardtorch::shard(*m, w, ShardOptions().strategy(Strategy::NoShard));
    auto opt = shardtorch::AdamW(*m, options);
    for (int s = 0; s < 3; ++s) {
      opt->zero_grad();
      (m(x.narrow(0, 2 * w.rank(), 2)).sum() / 2).backward();  // the mean over ranks: the full batch's sum / 2
      require(!m->b->weight.grad().defined() && !m->b->bias.grad().defined(), "the unused head has a gradient");
      require(m->a->weight.grad().defined(), "the used head has no gradient");
      opt->step();
      ref_opt.zero_grad();
      (ref(x).sum() / 2).backward();
      ref_opt.step();
    }
    require(at::equal(m->b->weight, b0), "AdamW moved the parameter no rank used");
    require(opt->inner().state().size() == 2, "optimizer state for " + std::to_string(opt->inner().state().size()) +
                                                  " parameters, not the used head's 2");
    for (const auto& [n, t] : std::vector<std::pair<std::string, at::Tensor>>{
             {"a.weight", m->a->weight}, {"a.bias", m->a->bias}, {"b.weight", m->b->weight}}) {
      const at::Tensor want = ref->named_parameters()[n];
      require(at::allclose(t, want, 1e-6, 1e-6), n + " differs from the single-process reference");
    }
    m->use_b = w.rank() == 0;
    opt->zero_grad();
    m(x.narrow(0, 2 * w.rank(), 2)).sum().backward();
    require(m->b->weight.grad().defined() && m->b->bias.grad().defined(), "the head rank 0 used has no gradient");
    // The mean of rank 0's gradient and rank 1's zero, on both: d sum(x W^T + b) / dW has x's column sums in
    // every row, / db is the number of rows.
    const at::Tensor want_w = x.narrow(0, 0, 2).sum(0).expand({4, 4}) / 2, want_b = at::full({4}, 2.0) / 2;
    require(at::allclose(m->b->weight.grad(), want_w, 1e-6, 0) && at::allclose(m->b->bias.grad(), want_b, 1e-6, 0),
            "the gradient of the head rank 0 used is not the mean of rank 0's and a zero");
    opt->step();
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// error_on_unused_parameters: a parameter without a gradient on some rank is
// an error on every rank, naming it and how many ranks had one; the check
// was per rank, so the rank without the gradient threw while the others
// waited in its all-reduce until the collective timeout. The next step works.
TEST(NoShard, ErrorOnUnusedParametersFailsEveryRankAlike) {
  auto e = run_ranks(
      2,
      [](World& w) {
        TwoHeads m;
        shardtorch::shard(*m, w, ShardOptions().strategy(Strategy::NoShard).error_on_unused_parameters(true));
        auto opt = shardtorch::SGD(*m, torch::optim::SGDOptions(0.1));
        m->use_b = w.rank() == 0;
        std::string msg;
        try {
          m(torch::ones({2, 4})).sum().backward();
        } catch (const std::exception& ex) {
          msg = ex.what();
        }
        require(msg.find("'b.weight' (on 1 of 2 ranks") != std::string::npos, "expected b.weight named, got: " + msg);
        require((msg.find("not this one") != std::string::npos) == (w.rank() == 1),
                "this rank's part misreported: " + msg);
        m->use_b = true;
        opt->zero_grad();
        m(torch::ones({2, 4})).sum().backward();
        opt->step();
      },
      shardtorch::testing::RunOptions().collective_timeout(std::chrono::seconds(10)).timeout(std::chrono::seconds(60)));
  ASSERT_TRUE(e.ok) << e.summary();
}

// A unit of two flat parameters (trainable and frozen) whose two all-gathers
// both fail: the forward throws the first one's error, and the second's is
// not printed beside it as a warning (the same failure, said twice).
TEST(FullShard, AFailedGatherOfAUnitWithTwoFlatParametersIsSaidOnce) {
  auto r = run_ranks(2, [](World& w) {
    testmodels::MLP m;
    shardtorch::shard(m, w);
    CapturedWarnings warnings;
    c10::WarningUtils::WarningHandlerGuard guard(&warnings);
    shardtorch::testing::fail_collectives("parameters of unit 'l2'", 2);
    std::string error;
    try {
      m(torch::randn({4, 7}));
    } catch (const std::exception& e) {
      error = e.what();
    }
    shardtorch::testing::fail_collectives("", 0);
    require(error.find("failure injected") != std::string::npos, "the forward said: " + error);
    require(!warnings.any_with("that nothing read failed"), "the second gather's failure was warned about too");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

TEST(FullShard, ReshardAfterForwardPerUnit) {
  auto r = run_ranks(2, [](World& w) {
    auto model = gpt::GPT(gpt::Config{});
    auto sm = shardtorch::shard(model, w, ShardOptions().reshard_after_forward_for("blocks.0", false));
    auto x = torch::randint(0, 64, {2, 16}, torch::kLong);
    auto loss = gpt::lm_loss(model(x), x);
    // After forward: the root and blocks.0 stay gathered, blocks.1 was freed.
    require(sm.memory().gathered_units == 2,
            "expected root and blocks.0 gathered, got " + std::to_string(sm.memory().gathered_units));
    loss.backward();
    require(sm.memory().gathered_units == 0, "units left gathered after backward");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// A group some ranks made (a subgroup of their own) does not shift the
// rendezvous keys of the groups shard() makes for everyone (FullShard's
// reduce-scatter group, HybridShard's groups), nor does one tag naming other
// ranks in another model: keys count per tag and ranks.
TEST(Configuration, AGroupOfSomeRanksDoesNotUpsetTheGroupsShardMakes) {
  auto r = run_ranks(
      4,
      [](World& w) {
        if (w.rank() < 2) {
          auto pair = w.new_group({0, 1}, "pair");
          auto t = torch::ones({1});
          pair->all_reduce(t, c10d::ReduceOp::SUM, "pair");
          require(t.item<float>() == 2.0f, "the pair's all-reduce");
        }
        // Both orders: "reduce-scatter-0" names all four ranks under FullShard and
        // two under HybridShard.
        for (auto s : {Strategy::FullShard, Strategy::HybridShard, Strategy::FullShard}) {
          torch::manual_seed(0);
          MLP model;
          auto sm = shardtorch::shard(model, w, strategy_options(s, 4));
          torch::manual_seed(1);
          torch::mse_loss(model(torch::randn({2, 7})), torch::zeros({2, 3})).backward();
          require(sm.stats().gradient_reductions > 0, std::string(shardtorch::strategy_name(s)) + ": nothing reduced");
        }
      },
      shardtorch::testing::RunOptions().timeout(std::chrono::seconds(60)).collective_timeout(std::chrono::seconds(5)));
  ASSERT_TRUE(r.ok) << r.summary();
}

TEST(Configuration, BadStrategyNamesAndGroupSizesAreClearErrors) {
  EXPECT_EQ(shardtorch::parse_strategy("FULL_SHARD"), Strategy::FullShard);
  EXPECT_EQ(shardtorch::parse_strategy("zero2"), Strategy::ShardGradOp);
  EXPECT_EQ(shardtorch::parse_strategy("ddp"), Strategy::NoShard);
  EXPECT_EQ(shardtorch::parse_strategy("optimizer-only"), Strategy::OptimizerOnly);
  try {
    shardtorch::parse_strategy("zero4");
    FAIL();
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("unknown strategy 'zero4'; expected one of full_shard"), std::string::npos);
  }
  auto r = run_ranks(3, [](World& w) {
    auto model = gpt::GPT(gpt::Config{});
    try {
      shardtorch::shard(model, w, ShardOptions().strategy(Strategy::HybridShard).hybrid_shard_size(2));
    } catch (const std::exception& e) {
      require(std::string(e.what()).find("hybrid_shard_size (now 2) to divide the world size 3") != std::string::npos,
              e.what());
      return;
    }
    throw std::runtime_error("no error");
  });
  ASSERT_TRUE(r.ok) << r.summary();
  auto u = run_ranks(1, [](World& w) {
    auto model = gpt::GPT(gpt::Config{});
    try {
      shardtorch::shard(model, w, ShardOptions().reshard_after_forward_for("blocks.7", false));
    } catch (const std::exception& e) {
      require(std::string(e.what()).find("reshard_after_forward_for('blocks.7') names no unit of this model (its "
                                         "units: 'blocks.0', ") != std::string::npos,
              e.what());
      return;
    }
    throw std::runtime_error("no error");
  });
  ASSERT_TRUE(u.ok) << u.summary();
}

// Prefetch (docs/design.md): the next unit's all-gather runs ahead, in
// forward and in backward, along the order the previous step ran, and the last
// unit of that order stays gathered from its forward into backward. Training
// is bitwise what it is without prefetch, with one all-gather fewer per step
// once the order is known, and one more unit is alive at a time.
class Prefetch : public ::testing::TestWithParam<std::tuple<Strategy, int>> {};

TEST_P(Prefetch, TrainsBitwiseLikeWithoutItWithOneGatherFewerPerStepAndOneMoreUnitAlive) {
  auto [strategy, world] = GetParam();
  auto r = run_ranks(world, [&](World& w) {
    auto x = gpt_tokens();
    const int64_t per = kBatch / w.size();
    auto xs = x.narrow(0, w.rank() * per, per);
    struct Out {
      std::map<std::string, torch::Tensor> params;
      int64_t gathers;
      int peak_units;
    };
    auto run = [&](bool prefetch) {
      torch::manual_seed(0);
      gpt::Config cfg;
      cfg.n_layer = 4;
      auto model = gpt::GPT(cfg);
      auto sm = shardtorch::shard(model, w, strategy_options(strategy, w.size()).prefetch(prefetch));
      auto opt = shardtorch::Adam(*model, torch::optim::AdamOptions(1e-3));
      Out out{{}, -sm.comm_stats().all_gather.calls, 0};  // the world's counters run on across models
      for (int s = 0; s < 4; ++s) {
        sm.reset_peak_memory();
        opt->zero_grad();
        gpt::lm_loss(model(xs), xs).backward();
        opt->step();
        out.peak_units = std::max(out.peak_units, sm.memory().peak_gathered_units);
      }
      {
        torch::NoGradGuard no_grad;  // evaluation gathers synchronously and frees everything
        model(xs);
      }
      require(sm.memory().gathered_units == 0, "units left gathered after an evaluation forward");
      out.gathers += sm.comm_stats().all_gather.calls;
      out.params = shardtorch::full_parameters(*model);
      return out;
    };
    Out off = run(false), on = run(true);
    require(expect_close_map(on.params, off.params, 0.0, "prefetch") == 0.0, "not bitwise");
    // Steps 2-4 follow the order step 1 taught: the last block is not gathered again for backward.
    require(on.gathers == off.gathers - 3, "prefetch should save one all-gather in each of 3 steps: " +
                                               std::to_string(on.gathers) + " vs " + std::to_string(off.gathers));
    require(off.peak_units <= 2,
            "without prefetch at most 2 units are gathered, saw " + std::to_string(off.peak_units));
    require(on.peak_units == 3,
            "with prefetch the root, the computing unit and the next one: saw " + std::to_string(on.peak_units));
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

INSTANTIATE_TEST_SUITE_P(Sharding, Prefetch,
                         ::testing::Combine(::testing::Values(Strategy::FullShard, Strategy::HybridShard),
                                            ::testing::Values(1, 2, 3)),
                         [](const ::testing::TestParamInfo<Prefetch::ParamType>& info) {
                           return std::string(shardtorch::strategy_name(std::get<0>(info.param))) + "_world" +
                                  std::to_string(std::get<1>(info.param));
                         });

// HybridShard sums each launched reduce-scatter's output across the replicas
// with one all-reduce, whatever number of flat parameters the bucket holds
// (not one per flat parameter: here 1, not 4). With buckets
// of about a block's shard there are several launches, and as many all-reduces.
TEST(HybridShard, OneAllReduceAcrossReplicasPerLaunchedBucket) {
  auto x = gpt_tokens().narrow(0, 0, 2);
  for (double mb : {25.0, 0.06}) {
    auto r = run_ranks(4, [&](World& w) {
      torch::manual_seed(0);
      auto model = gpt::GPT(gpt::Config{});
      auto sm = shardtorch::shard(model, w, strategy_options(Strategy::HybridShard, 4).bucket_mb(mb));
      int flats = 0;
      for (const auto& u : sm.units())
        for (bool frozen : u.frozen) flats += !frozen;
      const auto before = sm.comm_stats();
      gpt::lm_loss(model(x), x).backward();
      const auto after = sm.comm_stats();
      const int64_t launches = after.reduce_scatter.calls - before.reduce_scatter.calls;
      const int64_t across = after.all_reduce.calls - before.all_reduce.calls;
      require(across == launches, std::to_string(across) + " all-reduces across replicas for " +
                                      std::to_string(launches) + " reduce-scatters (" + std::to_string(flats) +
                                      " flat parameters), bucket_mb " + std::to_string(mb));
      // The overlap counts reduce-scatters launched beside another, not the
      // all-reduces that continue them (it counted those too).
      require(sm.stats().reduce_scatters_overlapped < launches,
              std::to_string(sm.stats().reduce_scatters_overlapped) + " reduce-scatters overlapped of " +
                  std::to_string(launches) + ", bucket_mb " + std::to_string(mb));
      if (mb == 25.0) require(launches == 1 && flats > 1, "one bucket expected, " + std::to_string(launches));
      if (mb < 1.0) require(launches > 1, "several launches expected with small buckets");
    });
    ASSERT_TRUE(r.ok) << "bucket_mb " << mb << ": " << r.summary();
  }
}

// A backward that throws half-way (here a user hook between two units, after
// the second unit's reduction was launched) leaves reductions in flight and
// units half-reduced. The next forward cleans up, warns once, and training
// goes on exactly as if the failed step had not happened.
namespace {
struct TwoLayerImpl : torch::nn::Module {
  TwoLayerImpl() : a(register_module("a", Layer(7, 13, true))), b(register_module("b", Layer(13, 3, false))) {}
  torch::Tensor forward(torch::Tensor x) {
    auto h = a(x);
    if (fail_next_backward) {
      fail_next_backward = false;
      h.register_hook([](torch::Tensor g) -> torch::Tensor { throw std::runtime_error("user hook failed"); });
    }
    return b(h);
  }
  Layer a, b;
  bool fail_next_backward = false;
};
SHARDTORCH_MODULE(TwoLayer);

// TwoLayer (seed 1) trained `steps` Adam steps in one process on (x, y).
testref::Run two_layer_reference(const torch::Tensor& x, const torch::Tensor& y, int steps) {
  torch::manual_seed(1);
  TwoLayer ref;
  torch::optim::Adam opt(unique_tensors(*ref), torch::optim::AdamOptions(1e-2));
  return testref::train_reference(*ref, opt, steps, [&](int) { return torch::mse_loss(ref(x), y); });
}
}  // namespace

TEST_P(EveryStrategy, AFailedBackwardIsCleanedUpAndTrainingContinuesAsIfItHadNotHappened) {
  const Strategy strategy = GetParam();
  torch::manual_seed(0);
  auto x = torch::randn({kBatch, 7}), y = torch::randn({kBatch, 3});
  const auto want = two_layer_reference(x, y, 3);
  auto r = run_ranks(2, [&](World& w) {
    torch::manual_seed(1);
    TwoLayer model;
    // Tiny buckets: each unit's reduction is launched as soon as its gradients are in.
    auto sm = shardtorch::shard(model, w, strategy_options(strategy, 2).bucket_mb(1e-4));
    auto opt = shardtorch::Adam(*model, torch::optim::AdamOptions(1e-2));
    auto xs = x.narrow(0, w.rank() * kBatch / 2, kBatch / 2), ys = y.narrow(0, w.rank() * kBatch / 2, kBatch / 2);
    CapturedWarnings warnings;
    c10::WarningUtils::WarningHandlerGuard guard(&warnings);
    testref::Run got;
    for (int s = 0; s < 4; ++s) {
      opt->zero_grad();
      model->fail_next_backward = s == 1;
      auto loss = torch::mse_loss(model(xs), ys);
      if (s == 1) {
        bool threw = false;
        try {
          loss.backward();
        } catch (const std::exception& e) {
          threw = std::string(e.what()).find("user hook failed") != std::string::npos;
        }
        require(threw, "the failing hook's exception should reach the caller");
        continue;  // no optimizer step for the failed backward
      }
      loss.backward();
      if (s == 0) got.first_grads = testref::full_gradients(*model);
      opt->step();
      if (s == 2) {
        require(warnings.messages.size() == 1 && warnings.messages[0].find("did not finish") != std::string::npos,
                "expected one warning about the failed backward, got " + std::to_string(warnings.messages.size()));
      }
      auto m = sm.memory();
      require(m.cur(Mem::Buckets) == 0 && m.cur(Mem::GradStaging) == 0,
              "bucket or staging memory left after step " + std::to_string(s));
    }
    got.final_params = testref::full_parameters(*model);
    testref::expect_same_run(got, want, 1e-5, "after a failed backward");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// After a failed backward the gradients are partial: a step, clip_grad_norm
// or a GradScaler reading them is refused until zero_grad (they used to step
// on whatever had been reduced before the failure, with no word). Then
// training goes on as if the failed step had not happened.
TEST_P(EveryStrategy, AStepOrClipAfterAFailedBackwardIsRefusedUntilZeroGrad) {
  const Strategy strategy = GetParam();
  torch::manual_seed(0);
  auto x = torch::randn({kBatch, 7}), y = torch::randn({kBatch, 3});
  const auto want = two_layer_reference(x, y, 3);
  auto r = run_ranks(2, [&](World& w) {
    torch::manual_seed(1);
    TwoLayer model;
    shardtorch::shard(model, w, strategy_options(strategy, 2).bucket_mb(1e-4));
    auto opt = shardtorch::Adam(*model, torch::optim::AdamOptions(1e-2));
    auto xs = x.narrow(0, w.rank() * kBatch / 2, kBatch / 2), ys = y.narrow(0, w.rank() * kBatch / 2, kBatch / 2);
    auto refused = [&](const char* what, const std::function<void()>& f) {
      std::string error = "none";
      try {
        f();
      } catch (const std::exception& e) {
        error = e.what();
      }
      require(error.find("rank " + std::to_string(w.rank()) + ": " + what + " after a backward that did not finish") !=
                  std::string::npos,
              std::string(what) + " after a failed backward: " + error);
    };
    testref::Run got;
    for (int s = 0; s < 4; ++s) {
      opt->zero_grad();
      model->fail_next_backward = s == 1;
      auto loss = torch::mse_loss(model(xs), ys);
      if (s == 1) {
        try {
          loss.backward();
        } catch (const std::exception&) {
        }
        refused("an optimizer step", [&] { opt->step(); });
        refused("reading the gradients (clip_grad_norm, GradScaler)", [&] { shardtorch::clip_grad_norm(*model, 1.0); });
        refused("an optimizer step", [&] { opt->step(); });  // still: nothing but zero_grad makes them whole
        continue;
      }
      loss.backward();
      if (s == 0) got.first_grads = testref::full_gradients(*model);
      opt->step();
    }
    got.final_params = testref::full_parameters(*model);
    testref::expect_same_run(got, want, 1e-5, "after a refused step");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// A collective that fails (as a timed-out one would; injected here on every
// rank) in a backward's gradient reduction, then in a forward's all-gather:
// the backward or forward throws the collective's error, the units go back to
// sharded (none is left reducing or gathering), and training goes on as if
// the two failed steps had not happened.
TEST_P(EveryStrategy, AFailedCollectiveIsCleanedUpAndTrainingContinuesAsIfItHadNotHappened) {
  const Strategy strategy = GetParam();
  const bool gathers_in_forward = strategy == Strategy::FullShard || strategy == Strategy::HybridShard;
  torch::manual_seed(0);
  auto x = torch::randn({kBatch, 7}), y = torch::randn({kBatch, 3});
  const auto want = two_layer_reference(x, y, 3);
  auto r = run_ranks(2, [&](World& w) {
    torch::manual_seed(1);
    TwoLayer model;
    auto sm = shardtorch::shard(model, w, strategy_options(strategy, 2).bucket_mb(1e-4));
    auto opt = shardtorch::Adam(*model, torch::optim::AdamOptions(1e-2));
    auto xs = x.narrow(0, w.rank() * kBatch / 2, kBatch / 2), ys = y.narrow(0, w.rank() * kBatch / 2, kBatch / 2);
    CapturedWarnings warnings;  // the failed backward's warning
    c10::WarningUtils::WarningHandlerGuard guard(&warnings);
    int gathered_between_steps = -1;
    testref::Run got;
    for (int s = 0; s < 5; ++s) {
      opt->zero_grad();
      if (s == 1 || s == 2) {
        shardtorch::testing::fail_collectives(s == 1 ? "gradient" : "parameters of unit 'b'");
        std::string error;
        try {
          torch::mse_loss(model(xs), ys).backward();
        } catch (const std::exception& e) {
          error = e.what();
        }
        shardtorch::testing::fail_collectives("", 0);  // disarmed where nothing gathered
        const bool should_throw = s == 1 || gathers_in_forward;
        require(should_throw == (error.find("failure injected") != std::string::npos),
                "step " + std::to_string(s) + ": " + (error.empty() ? "no error" : "error: " + error));
        continue;  // no optimizer step for the failed step
      }
      torch::mse_loss(model(xs), ys).backward();
      if (s == 0) got.first_grads = testref::full_gradients(*model);
      opt->step();
      auto m = sm.memory();
      require(m.cur(Mem::Buckets) == 0 && m.cur(Mem::GradStaging) == 0,
              "bucket or staging memory left after step " + std::to_string(s));
      if (gathered_between_steps < 0) gathered_between_steps = m.gathered_units;
      require(m.gathered_units == gathered_between_steps,
              "after step " + std::to_string(s) + " " + std::to_string(m.gathered_units) + " units are gathered, not " +
                  std::to_string(gathered_between_steps) + " as after the first");
    }
    got.final_params = testref::full_parameters(*model);
    testref::expect_same_run(got, want, 1e-5, "after failed collectives");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// NoShard with fp32 buckets of bf16 gradients under a root that is not a
// unit: LibTorch's model->zero_grad() cannot reach the buckets (the
// parameters hold no gradient), so the next step's gradients would add to
// the last step's. The first backward after a step with no zero_grad that
// reached the buckets warns, once, saying what to call; the optimizer's
// zero_grad, or a unit root, gives no warning.
TEST(NoShard, AStepWithoutAZeroGradThatReachesFp32BucketsWarnsOnce) {
  auto r = run_ranks(2, [](World& w) {
    auto precision =
        shardtorch::MixedPrecision().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat).buffer_dtype(at::kBFloat16);
    auto x = torch::ones({2, 7}, at::kBFloat16);
    auto count = [&](bool through_module, bool unit_root) {
      CapturedWarnings warnings;
      c10::WarningUtils::WarningHandlerGuard guard(&warnings);
      std::shared_ptr<torch::nn::Module> root;
      std::function<at::Tensor()> loss;
      if (unit_root) {
        auto m = MLP();
        shardtorch::shard(m, w, ShardOptions().strategy(Strategy::NoShard).mixed_precision(precision));
        root = m.ptr();
        loss = [m, x]() mutable { return m(x).to(at::kFloat).sum(); };
      } else {
        auto m = torch::nn::Sequential(torch::nn::Linear(7, 5), torch::nn::Linear(5, 3));
        shardtorch::shard(*m, w, ShardOptions().strategy(Strategy::NoShard).mixed_precision(precision));
        root = m.ptr();
        loss = [m, x]() mutable { return m->forward(x).to(at::kFloat).sum(); };
      }
      auto opt = shardtorch::AdamW(*root, torch::optim::AdamWOptions(1e-3));
      for (int s = 0; s < 3; ++s) {
        if (through_module)
          root->zero_grad();
        else
          opt->zero_grad();
        loss().backward();
        opt->step();
      }
      return std::count_if(warnings.messages.begin(), warnings.messages.end(), [](const std::string& m) {
        return m.find("call opt->zero_grad(), or make the root a unit") != std::string::npos;
      });
    };
    require(count(true, false) == 1,
            "model->zero_grad() on a plain root: expected one warning, got " + std::to_string(count(true, false)));
    require(count(false, false) == 0, "opt->zero_grad() warned");
    require(count(true, true) == 0, "model->zero_grad() on a unit root warned");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}
