// Mixed precision: bf16 training follows fp32 training, reductions happen in
// the dtype asked for, and fp16 overflow on one rank skips the step everywhere.
#include <gtest/gtest.h>

#include <limits>

#include "models.h"

using namespace testmodels;
using shardtorch::MixedPrecision;
using shardtorch::ShardOptions;
using shardtorch::Strategy;
using shardtorch::World;
using shardtorch::testing::run_ranks;

namespace {
constexpr int kSteps = 20;

// ||a - b|| / ||b - start|| over all parameters: how far the mixed-precision
// run strays, relative to how far fp32 training moved.
double drift(const std::map<std::string, torch::Tensor>& a, const std::map<std::string, torch::Tensor>& b,
             const std::map<std::string, torch::Tensor>& start) {
  double diff = 0, moved = 0;
  for (const auto& [n, t] : b) {
    diff += (a.at(n) - t).pow(2).sum().item<double>();
    moved += (t - start.at(n)).pow(2).sum().item<double>();
  }
  return std::sqrt(diff / moved);
}

struct Fp32Reference {
  std::map<std::string, torch::Tensor> start, end;
};

Fp32Reference fp32_reference(const torch::Tensor& x) {
  torch::manual_seed(0);
  auto model = gpt::GPT(gpt::Config{});
  Fp32Reference ref;
  for (auto& [n, p] : unique_params(*model)) ref.start[n] = p.detach().clone();
  torch::optim::Adam opt(unique_tensors(*model), torch::optim::AdamOptions(1e-3));
  for (int s = 0; s < kSteps; ++s) {
    opt.zero_grad();
    gpt::lm_loss(model(x), x).backward();
    opt.step();
  }
  for (auto& [n, p] : unique_params(*model)) ref.end[n] = p.detach().clone();
  return ref;
}
// The first step's gradients of single-process fp32 training on `x`.
std::map<std::string, torch::Tensor> fp32_first_grads(const torch::Tensor& x) {
  torch::manual_seed(0);
  auto model = gpt::GPT(gpt::Config{});
  gpt::lm_loss(model(x), x).backward();
  std::map<std::string, torch::Tensor> out;
  for (auto& [n, p] : unique_params(*model)) out[n] = p.grad().clone();
  return out;
}
}  // namespace

// Trains the GPT 20 steps in bf16 (reductions in `reduce`) on `world` ranks,
// each its share of the same batch, and requires the masters to end within
// 5% of the fp32 movement of single-process training, and full_gradients to
// give the first step's reduced gradients unrounded.
void train_bf16_near_fp32(Strategy strategy, int world, int hybrid_shard_size) {
  auto x = gpt_tokens();
  auto ref = fp32_reference(x);
  const auto ref_grads = fp32_first_grads(x);
  const int64_t rows = x.size(0) / world;
  for (auto reduce : {at::kBFloat16, at::kFloat}) {
    auto r = run_ranks(world, [&](World& w) {
      torch::manual_seed(0);
      auto model = gpt::GPT(gpt::Config{});
      auto opts = ShardOptions().strategy(strategy).mixed_precision(
          MixedPrecision().param_dtype(at::kBFloat16).reduce_dtype(reduce).output_dtype(at::kFloat));
      if (strategy == Strategy::HybridShard) opts.hybrid_shard_size(hybrid_shard_size);
      auto sm = shardtorch::shard(model, w, opts);
      require(model->block_list[0]->fc1->weight.scalar_type() == at::kBFloat16, "parameters should compute in bf16");
      auto opt = shardtorch::Adam(*model, torch::optim::AdamOptions(1e-3));
      auto xs = x.narrow(0, w.rank() * rows, rows);
      for (int s = 0; s < kSteps; ++s) {
        opt->zero_grad();
        auto logits = model(xs);
        require(logits.scalar_type() == at::kFloat, "output_dtype should make the logits fp32");
        gpt::lm_loss(logits, xs).backward();
        if (s == 0) {
          // The reduced gradients as the fp32 masters hold them: sums of two
          // ranks' bf16 gradients need more bits than bf16 has, unless the
          // reduction itself ran in bf16.
          // Each within bf16's error of fp32 training's, by its norm.
          bool beyond_bf16 = false;
          for (const auto& [n, g] : shardtorch::full_gradients(*model)) {
            require(g.scalar_type() == at::kFloat, "full_gradients gave " + n + " in another dtype than fp32");
            beyond_bf16 = beyond_bf16 || !torch::equal(g, g.to(at::kBFloat16).to(at::kFloat));
            auto want = ref_grads.find(n);
            if (want == ref_grads.end()) continue;  // a tied parameter's second name
            const double err = ((g - want->second).norm() / want->second.norm()).item<double>();
            require(err < 0.05, "full_gradients' " + n + " is " + std::to_string(err) + " away from fp32's");
          }
          require(beyond_bf16 == (reduce == at::kFloat),
                  reduce == at::kFloat ? "full_gradients rounded the fp32-reduced gradients to bf16"
                                       : "full_gradients holds values a bf16 reduction cannot give");
        }
        opt->step();
      }
      auto got = shardtorch::full_parameters(*model);
      for (auto& [n, t] : got) require(t.scalar_type() == at::kFloat, "master " + n + " is not fp32");
      std::map<std::string, torch::Tensor> mine;
      for (auto& [n, t] : ref.end) mine[n] = got.at(n);
      double d = drift(mine, ref.end, ref.start);
      if (w.rank() == 0)
        std::printf("  %s world %d reduce %s: drift from fp32 after %d steps %.4f\n",
                    shardtorch::strategy_name(strategy), world, c10::toString(reduce), kSteps, d);
      require(d < 0.05, "bf16 drifted " + std::to_string(d) + " of the fp32 movement");
    });
    ASSERT_TRUE(r.ok) << c10::toString(reduce) << " reductions: " << r.summary();
  }
}

class Bf16 : public ::testing::TestWithParam<Strategy> {};

TEST_P(Bf16, TrainsWithinBf16ToleranceOfFp32Over20Steps) { train_bf16_near_fp32(GetParam(), 2, 1); }

// Two replicas of two shards: bf16 reduce-scatters within a shard group,
// then all-reduces across the replica group (world 2 above has a replica
// group of one shard each, whose reduce-scatter is a copy).
TEST(Bf16HybridShard, TwoReplicasOfTwoShardsTrainWithinBf16ToleranceOfFp32) {
  train_bf16_near_fp32(Strategy::HybridShard, 4, 2);
}

INSTANTIATE_TEST_SUITE_P(Every, Bf16,
                         ::testing::Values(Strategy::FullShard, Strategy::ShardGradOp, Strategy::OptimizerOnly,
                                           Strategy::NoShard, Strategy::HybridShard),
                         [](const auto& info) { return std::string(shardtorch::strategy_name(info.param)); });

TEST(MixedPrecision, ReductionsHappenInTheReduceDtypeAskedFor) {
  // The same backward moves twice the bytes when fp32 reduction is asked for.
  std::vector<int64_t> bytes;
  for (auto reduce : {at::kBFloat16, at::kFloat}) {
    auto r = run_ranks(2, [&](World& w) {
      auto model = gpt::GPT(gpt::Config{});
      auto sm = shardtorch::shard(
          model, w, ShardOptions().mixed_precision(MixedPrecision().param_dtype(at::kBFloat16).reduce_dtype(reduce)));
      auto x = torch::randint(0, 64, {2, 16}, torch::kLong);
      const auto before = sm.comm_stats();  // reductions run on a communicator of their own
      sm.reset_peak_memory();
      gpt::lm_loss(model(x), x).backward();
      // Gathered buffers are bf16: the peak (root and one block) at 2 bytes per element.
      auto units = sm.units();
      int64_t root = units[0].layouts[0].padded_numel(), block = units[1].layouts[0].padded_numel();
      require(sm.memory().max(shardtorch::Mem::GatheredParams) == 2 * (root + block),
              "peak gathered bytes " + std::to_string(sm.memory().max(shardtorch::Mem::GatheredParams)) +
                  ", expected bf16 root + block " + std::to_string(2 * (root + block)));
      auto rs = sm.comm_stats().reduce_scatter;
      auto ag = sm.comm_stats().all_gather;
      rs.bytes_sent -= before.reduce_scatter.bytes_sent;
      ag.bytes_sent -= before.all_gather.bytes_sent;
      // all-gathers move bf16 parameters either way: the root once, the
      // other units in forward and again in backward.
      int64_t expect_ag = 0;
      for (auto& u : sm.units())
        for (auto& l : u.layouts) expect_ag += l.shard_numel() * 2 * (u.name.empty() ? 1 : 2);
      require(ag.bytes_sent == expect_ag, "all-gathers moved " + std::to_string(ag.bytes_sent) + " bytes, expected " +
                                              std::to_string(expect_ag) + " in bf16");
      int64_t expect_rs = 0;
      for (auto& u : sm.units())
        for (auto& l : u.layouts) expect_rs += l.shard_numel() * (reduce == at::kFloat ? 4 : 2);
      require(rs.bytes_sent == expect_rs, "reduce-scatter moved " + std::to_string(rs.bytes_sent) +
                                              " bytes, expected " + std::to_string(expect_rs) + " for " +
                                              c10::toString(reduce));
    });
    ASSERT_TRUE(r.ok) << r.summary();
  }
}

TEST(MixedPrecision, Fp16OverflowOnOneRankSkipsTheStepOnEveryRankAndHalvesTheScale) {
  auto r = run_ranks(2, [](World& w) {
    torch::manual_seed(0);
    auto model = gpt::GPT(gpt::Config{});
    shardtorch::shard(model, w,
                      ShardOptions().mixed_precision(
                          MixedPrecision().param_dtype(at::kHalf).reduce_dtype(at::kFloat).output_dtype(at::kFloat)));
    shardtorch::GradScaler scaler(*model, shardtorch::GradScalerOptions().init_scale(1024));
    auto opt = shardtorch::Adam(*model, torch::optim::AdamOptions(1e-3));
    // ln_f.bias is the last parameter of the root's flat parameter: with two
    // ranks it lies wholly in rank 1's shard, so only rank 1 sees the overflow
    // in the gradients it holds; rank 0 must skip because rank 1 says so.
    bool poison = false;
    model->ln_f->bias.register_hook([&](const torch::Tensor& g) {
      return poison && w.rank() == 1 ? g / at::zeros_like(g) : g;  // inf and nan
    });
    auto x = torch::randint(0, 64, {2, 16}, torch::kLong);
    auto step = [&] {
      opt->zero_grad();
      scaler.scale(gpt::lm_loss(model(x), x)).backward();
      return scaler.step(*opt);
    };
    require(step(), "a clean step should be taken");
    auto before = shardtorch::full_parameters(*model);
    poison = true;
    require(!step(), "rank " + std::to_string(w.rank()) + " took a step another rank overflowed");
    require(scaler.scale_value() == 512, "the scale should halve, is " + std::to_string(scaler.scale_value()));
    auto after = shardtorch::full_parameters(*model);
    for (auto& [n, t] : before) require(at::equal(t, after.at(n)), "skipped step changed " + n);
    poison = false;
    require(step(), "training should continue after the skipped step");
    auto later = shardtorch::full_parameters(*model);
    require(!at::equal(later.at("ln_f.bias"), after.at("ln_f.bias")), "parameters did not move after the skip");
    require(scaler.skipped_steps() == 1, "one step should have been skipped");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

class ScaledSteps : public ::testing::TestWithParam<Strategy> {};

// A loop that unscales (to clip, or to look at the gradients), then decides
// not to step, clears and runs the next backward: the next step unscales the
// new gradients again. It used to step on gradients still multiplied by the
// scale. Trained the same as the loop that never skipped, bitwise.
TEST_P(ScaledSteps, AStepNotTakenAfterUnscaleLeavesTheNextGradientsToBeUnscaled) {
  const shardtorch::Strategy s = GetParam();
  auto r = run_ranks(2, [&](World& w) {
    auto train = [&](bool skip_first, bool refuse_first = false) {
      torch::manual_seed(0);
      auto model = gpt::GPT(gpt::Config{});
      shardtorch::shard(
          model, w,
          strategy_options(s, 2).mixed_precision(MixedPrecision().param_dtype(at::kHalf).output_dtype(at::kFloat)));
      shardtorch::GradScaler scaler(*model, shardtorch::GradScalerOptions().init_scale(1024));
      auto opt = shardtorch::SGD(*model, torch::optim::SGDOptions(0.1));
      auto x = torch::randint(0, 64, {2, 16}, torch::kLong);
      auto backward = [&] {
        opt->zero_grad();
        scaler.scale(gpt::lm_loss(model(x), x)).backward();
      };
      if (skip_first) {
        backward();
        scaler.unscale(*opt);
        shardtorch::clip_grad_norm(*model, 1e9);  // looked at, not stepped
      }
      for (int k = 0; k < 2; ++k) {
        if (k > 0 || !refuse_first) backward();
        if (k == 0 && refuse_first) {  // a step refused inside a summon scope, then taken outside it
          backward();
          bool refused = false;
          try {
            shardtorch::FullParams full(*model);
            scaler.step(*opt);
          } catch (const std::exception&) {
            refused = true;
          }
          require(refused, "a step inside summon_full_params was accepted");
        }
        require(scaler.step(*opt), "a step was skipped");
      }
      return shardtorch::full_parameters(*model);
    };
    auto want = train(false);
    for (auto [skip, refuse] : {std::pair{true, false}, std::pair{false, true}}) {
      auto got = train(skip, refuse);
      for (auto& [n, t] : want)
        require(at::equal(t, got.at(n)), std::string(shardtorch::strategy_name(s)) + ": '" + n + "' differs after " +
                                             (skip ? "a step not taken following unscale" : "a refused step"));
    }
  });
  ASSERT_TRUE(r.ok) << shardtorch::strategy_name(s) << ": " << r.summary();
}

// After a step, taken or skipped, the gradients are unscaled and stay so
// until the next backward: unscale() (to log a norm after a skipped step,
// say) must not divide them again. It did: the step forgot they were
// unscaled, so they were divided by the (halved) scale a second time.
TEST(MixedPrecision, AStepTakenOrSkippedLeavesTheGradientsUnscaled) {
  auto r = run_ranks(2, [](World& w) {
    torch::manual_seed(0);
    auto model = MLP();
    shardtorch::shard(model, w,
                      ShardOptions().mixed_precision(
                          MixedPrecision().param_dtype(at::kHalf).buffer_dtype(at::kHalf).output_dtype(at::kFloat)));
    shardtorch::GradScaler scaler(*model, shardtorch::GradScalerOptions().init_scale(1024));
    auto opt = shardtorch::SGD(*model, torch::optim::SGDOptions(0.1));
    bool poison = false;  // an inf in l3's bias: the step is skipped
    model->l3->lin->bias.register_hook([&](const torch::Tensor& g) { return poison ? g / at::zeros_like(g) : g; });
    auto l1_grad = [&] {
      shardtorch::FullParams full(*model, shardtorch::SummonOptions().with_grads(true));
      return model->l1->lin->weight.grad().to(at::kFloat).clone();
    };
    torch::manual_seed(1 + w.rank());
    auto x = torch::randn({4, 7});
    for (bool skip : {false, true}) {
      poison = skip;
      opt->zero_grad();
      scaler.scale(model(x).square().mean()).backward();
      require(scaler.step(*opt) == !skip, skip ? "the poisoned step was taken" : "the clean step was skipped");
      auto after_step = l1_grad();
      require(after_step.abs().sum().item<double>() > 0, "no gradient");
      scaler.unscale(*opt);
      require(at::equal(l1_grad(), after_step),
              std::string("unscale() after a ") + (skip ? "skipped" : "taken") + " step divided the gradients again");
    }
    require(scaler.scale_value() == 512, "one skip should halve the scale");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// One GradScaler per sharded model: another model's optimizer would step on
// gradients this scaler never divided nor checked. Bad options name the value.
TEST(MixedPrecision, AGradScalerRefusesAnotherModelsOptimizerAndBadOptions) {
  auto r = run_ranks(2, [](World& w) {
    auto a = MLP(), b = MLP();  // a in fp16 with a scaler, b in bf16 (needs none)
    shardtorch::shard(a, w, ShardOptions().mixed_precision(MixedPrecision().param_dtype(at::kHalf)));
    shardtorch::shard(b, w, ShardOptions().mixed_precision(MixedPrecision().param_dtype(at::kBFloat16)));
    shardtorch::GradScaler scaler(*a);
    auto opt_b = shardtorch::SGD(*b, torch::optim::SGDOptions(0.1));
    for (int k = 0; k < 2; ++k) {
      try {
        k == 0 ? scaler.unscale(*opt_b) : (void)scaler.step(*opt_b);
        throw std::runtime_error("another model's optimizer was accepted");
      } catch (const std::exception& e) {
        const std::string want = "rank " + std::to_string(w.rank()) + ": GradScaler::" + (k == 0 ? "unscale" : "step") +
                                 ": the optimizer is over another model than the one this scaler was made for";
        require(std::string(e.what()).find(want) != std::string::npos, e.what());
      }
    }
    auto refused = [&](shardtorch::GradScalerOptions o, const std::string& want) {
      try {
        shardtorch::GradScaler bad(*a, o);
      } catch (const std::exception& e) {
        require(std::string(e.what()).find(want) != std::string::npos, e.what());
        return;
      }
      throw std::runtime_error("accepted options that should name " + want);
    };
    refused(shardtorch::GradScalerOptions().growth_interval(0), "growth_interval >= 1 (got 0)");
    refused(shardtorch::GradScalerOptions().init_scale(std::numeric_limits<double>::infinity()),
            "a finite init_scale > 0 (got inf)");
    refused(shardtorch::GradScalerOptions().growth_factor(std::numeric_limits<double>::infinity()),
            "a finite growth_factor > 1 (got inf)");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

class Fp16Reductions : public ::testing::TestWithParam<std::pair<Strategy, int>> {};

// fp16 reductions divide by the world size before summing, under every
// strategy: two ranks' gradients of 40000 each sum to 80000, beyond fp16's
// 65504, but their mean does not overflow, and is what the parameter gets. NoShard used to sum first (an inf,
// so a skipped step and a halved scale for nothing).
// HybridShard also on four ranks, two replicas of two shards: four
// gradients of 40000 sum to 160000, and the all-reduce across replicas must
// divide before summing too.
TEST_P(Fp16Reductions, Fp16ReductionsDivideBeforeSummingUnderEveryStrategy) {
  const auto [s, world] = GetParam();
  auto r = run_ranks(world, [&](World& w) {
    torch::manual_seed(0);
    auto model = gpt::GPT(gpt::Config{});
    shardtorch::shard(
        model, w,
        strategy_options(s, world).mixed_precision(MixedPrecision().param_dtype(at::kHalf).output_dtype(at::kFloat)));
    shardtorch::GradScaler scaler(*model, shardtorch::GradScalerOptions().init_scale(1024));
    auto opt = shardtorch::Adam(*model, torch::optim::AdamOptions(1e-3));
    model->ln_f->bias.register_hook([](const torch::Tensor& g) { return at::full_like(g, 40000); });
    auto x = torch::randint(0, 64, {2, 16}, torch::kLong);
    opt->zero_grad();
    scaler.scale(gpt::lm_loss(model(x), x)).backward();
    const std::string what = std::string(shardtorch::strategy_name(s)) + " world " + std::to_string(world);
    {
      // The mean of the ranks' 40000s, exact in fp16 at every partial sum.
      shardtorch::FullParams full(*model, shardtorch::SummonOptions().with_grads(true).writeback(false));
      const auto g = model->ln_f->bias.grad();
      require(g.defined() && at::equal(g.to(at::kFloat), at::full(g.sizes(), 40000.0)),
              what + ": the reduced gradient of ln_f.bias is not the mean of the ranks' 40000s, it holds " +
                  (g.defined() ? std::to_string(g.to(at::kFloat).min().item<double>()) + " to " +
                                     std::to_string(g.to(at::kFloat).max().item<double>())
                               : std::string("nothing")));
    }
    require(scaler.step(*opt), what + ": the step was skipped: the fp16 reduction overflowed");
  });
  ASSERT_TRUE(r.ok) << shardtorch::strategy_name(s) << " world " << world << "\n" << r.summary();
}

std::vector<std::pair<Strategy, int>> fp16_reduction_cases() {
  std::vector<std::pair<Strategy, int>> cases;
  for (Strategy s : kAllStrategies) cases.push_back({s, 2});
  cases.push_back({Strategy::HybridShard, 4});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(MixedPrecision, Fp16Reductions, ::testing::ValuesIn(fp16_reduction_cases()),
                         [](const auto& info) {
                           return std::string(shardtorch::strategy_name(info.param.first)) + "_" +
                                  std::to_string(info.param.second) + "ranks";
                         });

// torch::autograd::grad, or backward(inputs=...) of an input, between
// unscale() and step() (an input-gradient penalty computed late, a saliency
// map logged) leaves the parameters' gradients alone, so step() does not
// unscale them a second time.
TEST_P(ScaledSteps, AnInputGradientBetweenUnscaleAndStepDoesNotUnscaleTwice) {
  const shardtorch::Strategy s = GetParam();
  auto r = run_ranks(2, [&](World& w) {
    auto train = [&](int input_grad) {  // 0: none, 1: autograd::grad, 2: backward(inputs=...)
      torch::manual_seed(0);
      auto model = MLP();
      shardtorch::shard(model, w,
                        strategy_options(s, 2).mixed_precision(
                            MixedPrecision().param_dtype(at::kHalf).buffer_dtype(at::kHalf).output_dtype(at::kFloat)));
      shardtorch::GradScaler scaler(*model, shardtorch::GradScalerOptions().init_scale(1024));
      auto opt = shardtorch::SGD(*model, torch::optim::SGDOptions(0.1));
      torch::manual_seed(1 + w.rank());
      auto x = torch::randn({4, 7});
      for (int k = 0; k < 2; ++k) {
        opt->zero_grad();
        scaler.scale(model(x).square().mean()).backward();
        scaler.unscale(*opt);
        if (input_grad > 0) {
          auto xi = x.clone().requires_grad_();
          at::Tensor g;
          if (input_grad == 1) {
            g = torch::autograd::grad({model(xi).sum()}, {xi})[0];
          } else {
            torch::autograd::backward({model(xi).sum()}, {}, std::nullopt, false, {xi});
            g = xi.grad();
          }
          require(g.defined() && g.abs().sum().item<double>() > 0, "no input gradient");
        }
        require(scaler.step(*opt), "a step was skipped");
      }
      return shardtorch::full_parameters(*model);
    };
    auto want = train(0);
    for (int how : {1, 2}) {
      auto got = train(how);
      for (auto& [n, t] : want)
        require(at::equal(t, got.at(n)), std::string(shardtorch::strategy_name(s)) + ": '" + n + "' differs after " +
                                             (how == 1 ? "autograd::grad" : "backward(inputs=...)") +
                                             " between unscale and step");
    }
  });
  ASSERT_TRUE(r.ok) << shardtorch::strategy_name(s) << ": " << r.summary();
}

INSTANTIATE_TEST_SUITE_P(MixedPrecision, ScaledSteps, ::testing::Values(Strategy::FullShard, Strategy::NoShard),
                         StrategyName());

class SummonedGradients : public ::testing::TestWithParam<Strategy> {};

// summon_full_params(with_grads) shows the reduced gradients under every
// strategy, in fp32 and with fp32 reductions of bf16 compute, against one
// process in fp32; NoShard used to show none under bf16 (its masters held
// them; the bf16 parameters had no .grad).
TEST_P(SummonedGradients, SummonWithGradsShowsTheReducedGradientsUnderEveryStrategy) {
  const shardtorch::Strategy s = GetParam();
  // The reference: the mean of the two ranks' losses in one process, fp32, without the library.
  std::vector<torch::Tensor> inputs;
  for (int rank = 0; rank < 2; ++rank) {
    torch::manual_seed(10 + rank);
    inputs.push_back(torch::randn({4, 7}));
  }
  torch::manual_seed(0);
  auto ref = MLP();
  ((ref(inputs[0]).square().mean() + ref(inputs[1]).square().mean()) / 2).backward();
  std::map<std::string, torch::Tensor> want;
  for (auto& [n, p] : unique_params(*ref))
    if (p.requires_grad()) want[n] = p.grad().clone();
  auto r = run_ranks(2, [&](World& w) {
    const std::string what = shardtorch::strategy_name(s);
    auto grads_of = [&](bool bf16) {
      torch::manual_seed(0);
      auto model = MLP();
      auto opts = strategy_options(s, 2);
      if (bf16)
        opts.mixed_precision(
            MixedPrecision().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat).buffer_dtype(at::kBFloat16));
      shardtorch::shard(model, w, opts);
      model(inputs[w.rank()]).to(at::kFloat).square().mean().backward();
      shardtorch::FullParams full(*model, shardtorch::SummonOptions().with_grads(true));
      std::map<std::string, torch::Tensor> g;
      for (auto& [n, p] : unique_params(*model)) {
        if (!p.requires_grad()) continue;
        require(p.grad().defined(), what + ": no gradient for " + n + " inside summon_full_params(with_grads)");
        require(p.grad().scalar_type() == p.scalar_type(), what + ": the gradient of " + n + " is " +
                                                               c10::toString(p.grad().scalar_type()) +
                                                               ", the parameter " + c10::toString(p.scalar_type()));
        g[n] = p.grad().to(at::kFloat).clone();
      }
      return g;
    };
    expect_close_map(grads_of(false), want, 1e-5, what + " fp32 gradients against one process");
    expect_close_map(grads_of(true), want, 3e-2, what + " bf16 gradients against one process in fp32");
  });
  ASSERT_TRUE(r.ok) << shardtorch::strategy_name(s) << ": " << r.summary();
}

INSTANTIATE_TEST_SUITE_P(MixedPrecision, SummonedGradients, ::testing::ValuesIn(kAllStrategies), StrategyName());

TEST(MixedPrecision, ConfigurationErrors) {
  auto r = run_ranks(1, [](World& w) {
    {
      auto model = gpt::GPT(gpt::Config{});
      shardtorch::shard(model, w, ShardOptions().mixed_precision(MixedPrecision().param_dtype(at::kHalf)));
      try {
        shardtorch::Adam(*model, torch::optim::AdamOptions(1e-3));
        throw std::runtime_error("fp16 without a scaler was accepted");
      } catch (const std::exception& e) {
        require(std::string(e.what()).find("rank 0: fp16 mixed precision needs a loss scaler") != std::string::npos,
                e.what());
      }
    }
    {
      auto model = gpt::GPT(gpt::Config{});
      shardtorch::shard(model, w, ShardOptions().mixed_precision(MixedPrecision().param_dtype(at::kBFloat16)));
      try {
        shardtorch::FullParams full(*model, shardtorch::SummonOptions().writeback(true));
        throw std::runtime_error("writeback under mixed precision was accepted");
      } catch (const std::exception& e) {
        require(std::string(e.what()).find("would round the fp32 master") != std::string::npos, e.what());
      }
    }
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// A run stopped and resumed from a sharded checkpoint, the scaler's
// state_dict() carried in user_state, scales as the run that never stopped:
// the same scale after every step (growth after 2 good steps, one of them
// before the save), the same skipped steps, the same parameters bitwise.
TEST(MixedPrecision, AGradScalerResumedFromACheckpointScalesAsTheUninterruptedRun) {
  const TempDir dir;
  const std::string ckpt = (dir / "step-3").string();
  auto r = run_ranks(2, [&](World& w) {
    auto x = torch::randint(0, 64, {2, 16}, torch::kLong);
    const auto opts = shardtorch::GradScalerOptions().init_scale(1024).growth_interval(2);
    struct Run {
      gpt::GPT model{nullptr};
      std::unique_ptr<shardtorch::ShardedOptimizer> opt;
      std::unique_ptr<shardtorch::GradScaler> scaler;
      bool poison = false;
    };
    auto make = [&](shardtorch::GradScalerOptions o) {
      auto run = std::make_unique<Run>();
      torch::manual_seed(0);
      run->model = gpt::GPT(gpt::Config{});
      shardtorch::shard(
          run->model, w,
          ShardOptions().mixed_precision(MixedPrecision().param_dtype(at::kHalf).output_dtype(at::kFloat)));
      run->scaler = std::make_unique<shardtorch::GradScaler>(*run->model, o);
      run->opt = shardtorch::Adam(*run->model, torch::optim::AdamOptions(1e-3));
      Run* raw = run.get();
      run->model->ln_f->bias.register_hook([raw](const torch::Tensor& g) { return raw->poison ? g / 0.0 : g; });
      return run;
    };
    auto step = [&](Run& run, int k) {
      run.poison = k == 1;  // step 1 overflows: skipped, scale halved, good steps back to 0
      run.opt->zero_grad();
      run.scaler->scale(gpt::lm_loss(run.model(x), x)).backward();
      run.scaler->step(*run.opt);
      return run.scaler->scale_value();
    };
    auto whole = make(opts);
    std::vector<double> expected;
    for (int k = 0; k < 6; ++k) expected.push_back(step(*whole, k));
    require(expected[1] == 512 && expected[3] == 1024,
            "the uninterrupted run should halve at step 1 and grow at "
            "step 3 (two good steps, 2 and 3), got " +
                std::to_string(expected[1]) + ", " + std::to_string(expected[3]));

    auto first = make(opts);
    for (int k = 0; k < 3; ++k) step(*first, k);
    auto user = first->scaler->state_dict();
    user["epoch"] = "0";
    shardtorch::save_sharded_checkpoint(*first->model, first->opt.get(), ckpt, 3, user);

    auto resumed = make(shardtorch::GradScalerOptions().growth_interval(2));  // default init_scale: 65536
    std::map<std::string, std::string> back;
    require(shardtorch::load_sharded_checkpoint(*resumed->model, resumed->opt.get(), ckpt, &back) == 3, "step");
    resumed->scaler->load_state_dict(back);
    require(resumed->scaler->scale_value() == expected[2] && resumed->scaler->skipped_steps() == 1,
            "loaded scale " + std::to_string(resumed->scaler->scale_value()) + ", skipped " +
                std::to_string(resumed->scaler->skipped_steps()));
    for (int k = 3; k < 6; ++k) {
      const double s = step(*resumed, k);
      require(s == expected[k], "step " + std::to_string(k) + ": scale " + std::to_string(s) +
                                    ", the uninterrupted "
                                    "run had " +
                                    std::to_string(expected[k]));
    }
    auto a = shardtorch::full_parameters(*whole->model), b = shardtorch::full_parameters(*resumed->model);
    for (auto& [n, t] : a) require(at::equal(t, b.at(n)), "resumed run differs from the uninterrupted one at " + n);
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

TEST(MixedPrecision, GradScalerStateDictRoundTripsExactlyAndLoadingNamesAMissingOrMalformedKey) {
  auto r = run_ranks(1, [](World& w) {
    auto model = gpt::GPT(gpt::Config{});
    shardtorch::shard(model, w, ShardOptions().mixed_precision(MixedPrecision().param_dtype(at::kHalf)));
    shardtorch::GradScaler a(*model, shardtorch::GradScalerOptions().init_scale(1.0 / 3.0));
    shardtorch::GradScaler b(*model);
    // The smallest subnormal too: reachable only by backing off ~1075 times, but then it must still load.
    for (double v : {std::numeric_limits<double>::denorm_min(), 65536.0 * 1024.0 * 1024.0}) {
      shardtorch::GradScaler c(*model, shardtorch::GradScalerOptions().init_scale(v));
      b.load_state_dict(c.state_dict());
      require(b.scale_value() == v, "the scale " + c.state_dict().at("grad_scaler.scale") + " did not round-trip");
    }
    b.load_state_dict(a.state_dict());
    require(b.scale_value() == 1.0 / 3.0, "the scale did not round-trip exactly");
    auto refused = [&](std::map<std::string, std::string> state, const std::string& needle) {
      try {
        b.load_state_dict(state);
      } catch (const std::exception& e) {
        require(std::string(e.what()).find(needle) != std::string::npos, "error lacks '" + needle + "': " + e.what());
        require(b.scale_value() == 1.0 / 3.0, "a refused state changed the scale");
        return;
      }
      throw std::runtime_error("no error for a state needing '" + needle + "'");
    };
    auto good = a.state_dict();
    auto without = good;
    without.erase("grad_scaler.good_steps");
    refused(without, "no 'grad_scaler.good_steps'");
    auto malformed = good;
    malformed["grad_scaler.scale"] = "12abc";
    refused(malformed, "'grad_scaler.scale' is '12abc', not a number");
    for (const char* text : {" 5", "+5", "0x1p3", ""}) {
      auto loose = good;
      loose["grad_scaler.scale"] = text;
      refused(loose, std::string("'grad_scaler.scale' is '") + text + "', not a number");
    }
    auto huge = good;
    huge["grad_scaler.good_steps"] = "99999999999";
    refused(huge, "more than this scaler counts");
    auto negative = good;
    negative["grad_scaler.scale"] = "-1";
    refused(negative, "not a positive finite scale");
    auto minus = good;
    minus["grad_scaler.skipped_steps"] = "-3";
    refused(minus, "neither may be negative");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}
