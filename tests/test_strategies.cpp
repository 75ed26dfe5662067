// Every strategy trains to the parameters single-process training reaches,
// with accumulation, clipping, and the memory the ZeRO analysis predicts.
#include <gtest/gtest.h>

#include <torch/nn/utils/clip_grad.h>

#include "models.h"
#include "reference.h"

using namespace testmodels;
using shardtorch::Mem;
using shardtorch::ShardOptions;
using shardtorch::Strategy;
using shardtorch::World;
using shardtorch::testing::run_ranks;

namespace {

constexpr double kTol = 1e-5;

// One training recipe, run whole in this process or sharded on a rank:
// `micro` micro-batches per step (no sync on all but the last), optional
// clipping, Adam.
struct Recipe {
  int steps = 4;
  int micro = 1;
  double clip = 0;  // 0: none
  double norm_type = 2.0;
  double lr = 1e-3;
  // Each step starts with a micro-batch whose gradients are accumulated
  // without sync and then thrown away by zero_grad(): it must leave no trace.
  bool discarded_micro_batch = false;
};

// The first gradients (after clipping, where the recipe clips) and the final
// parameters, and the norms clipping saw.
struct Result {
  testref::Run run;
  std::vector<double> norms;
};

Result train_reference(const Recipe& r, const torch::Tensor& x) {
  torch::manual_seed(0);
  auto model = gpt::GPT(gpt::Config{});
  torch::optim::Adam opt(unique_tensors(*model), torch::optim::AdamOptions(r.lr));
  Result res;
  for (int s = 0; s < r.steps; ++s) {
    opt.zero_grad();
    gpt::lm_loss(model(x), x).backward();
    if (r.clip > 0) res.norms.push_back(torch::nn::utils::clip_grad_norm_(unique_tensors(*model), r.clip, r.norm_type));
    if (s == 0) res.run.first_grads = testref::gradients_of(*model);
    opt.step();
  }
  res.run.final_params = snapshot(*model);
  return res;
}

Result train_sharded(World& w, const Recipe& r, const torch::Tensor& x, ShardOptions opts) {
  torch::manual_seed(0);
  auto model = gpt::GPT(gpt::Config{});
  auto sm = shardtorch::shard(model, w, opts);
  auto opt = shardtorch::Adam(*model, torch::optim::AdamOptions(r.lr));
  const int64_t per = kBatch / w.size(), mb = per / r.micro;
  Result res;
  for (int s = 0; s < r.steps; ++s) {
    if (r.discarded_micro_batch) {
      sm.set_requires_gradient_sync(false);
      auto junk = x.narrow(0, w.rank() * per, per).flip({1});
      gpt::lm_loss(model(junk), junk).backward();
    }
    opt->zero_grad();
    if (r.discarded_micro_batch)
      require(sm.memory().cur(Mem::GradStaging) == 0, "gradients staged without sync survived zero_grad()");
    for (int k = 0; k < r.micro; ++k) {
      sm.set_requires_gradient_sync(k == r.micro - 1);
      auto xs = x.narrow(0, w.rank() * per + k * mb, mb);
      (gpt::lm_loss(model(xs), xs) / r.micro).backward();
    }
    if (r.clip > 0) res.norms.push_back(shardtorch::clip_grad_norm(*model, r.clip, r.norm_type));
    if (s == 0) res.run.first_grads = testref::full_gradients(*model);
    opt->step();
  }
  res.run.final_params = testref::full_parameters(*model);
  return res;
}

void compare(const Result& got, const Result& want, const std::string& what) {
  testref::expect_same_run(got.run, want.run, kTol, what);
  require(got.norms.size() == want.norms.size(), what + ": norm count");
  for (size_t i = 0; i < want.norms.size(); ++i) {
    double e = std::abs(got.norms[i] - want.norms[i]) / std::abs(want.norms[i]);
    require(e <= kTol, what + ": total norm " + std::to_string(got.norms[i]) + " vs " + std::to_string(want.norms[i]));
  }
}

}  // namespace

class StrategyParity : public ::testing::TestWithParam<std::tuple<Strategy, int>> {};

TEST_P(StrategyParity, MatchesSingleProcess) {
  auto [strategy, world] = GetParam();
  auto x = gpt_tokens();
  Recipe recipe;
  auto want = train_reference(recipe, x);
  auto r = run_ranks(world, [&](World& w) {
    compare(train_sharded(w, recipe, x, strategy_options(strategy, world)), want, shardtorch::strategy_name(strategy));
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

TEST_P(StrategyParity, AccumulatingMicroBatchesEqualsOneBigBatch) {
  auto [strategy, world] = GetParam();
  auto x = gpt_tokens();
  Recipe big;
  Recipe acc;
  acc.micro = world == 3 ? 2 : 3;  // rows per rank: 12, 6, 4, 3
  auto want = train_reference(big, x);
  auto r = run_ranks(world, [&](World& w) {
    compare(train_sharded(w, acc, x, strategy_options(strategy, world)), want,
            std::string(shardtorch::strategy_name(strategy)) + " with " + std::to_string(acc.micro) + " micro-batches");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

TEST_P(StrategyParity, ZeroGradDiscardsGradientsAccumulatedWithoutSync) {
  auto [strategy, world] = GetParam();
  auto x = gpt_tokens();
  Recipe plain;
  Recipe discarding;
  discarding.discarded_micro_batch = true;
  auto want = train_reference(plain, x);
  auto r = run_ranks(world, [&](World& w) {
    compare(train_sharded(w, discarding, x, strategy_options(strategy, world)), want,
            std::string(shardtorch::strategy_name(strategy)) + " after a discarded micro-batch");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

TEST_P(StrategyParity, ClippingEqualsTorchClipGradNorm) {
  auto [strategy, world] = GetParam();
  auto x = gpt_tokens();
  for (double norm_type : {2.0, std::numeric_limits<double>::infinity()}) {
    Recipe recipe;
    recipe.clip = norm_type == 2.0 ? 0.5 : 0.01;  // small enough to clip every step
    recipe.norm_type = norm_type;
    auto want = train_reference(recipe, x);
    for (double n : want.norms) ASSERT_GT(n, recipe.clip) << "the reference must actually clip";
    auto r = run_ranks(world, [&](World& w) {
      compare(train_sharded(w, recipe, x, strategy_options(strategy, world)), want,
              std::string(shardtorch::strategy_name(strategy)) + " clipping, norm " + std::to_string(norm_type));
    });
    ASSERT_TRUE(r.ok) << r.summary();
  }
}

// A unit whose last bias element gets a NaN gradient and nothing else does
// (sqrt(0 * b) is 0 forward; backward multiplies sqrt's infinite slope by 0).
// Flattened, that element is the last: at 2 ranks only rank 1's shard has it.
struct NanLayerImpl : torch::nn::Module {
  NanLayerImpl() : lin(register_module("lin", torch::nn::Linear(4, 4))) {}
  torch::Tensor forward(torch::Tensor x) { return lin(x) + torch::sqrt(lin->bias.narrow(0, 3, 1) * 0); }
  torch::nn::Linear lin;
};
SHARDTORCH_MODULE(NanLayer);

class NanGradient : public ::testing::TestWithParam<Strategy> {};

// The norm is NaN on every rank, as torch::nn::utils::clip_grad_norm_ gives,
// so a loop that skips the step on a non-finite norm does skip it; with
// either norm, and the NaN in one rank's shard only.
TEST_P(NanGradient, ANaNGradientInOneRanksShardGivesANaNNormEverywhere) {
  const shardtorch::Strategy strategy = GetParam();
  for (double norm_type : {2.0, std::numeric_limits<double>::infinity()}) {
    torch::manual_seed(0);
    NanLayer ref;
    ref(torch::randn({3, 4})).pow(2).mean().backward();
    const double want = torch::nn::utils::clip_grad_norm_(ref->parameters(), 1.0, norm_type);
    ASSERT_TRUE(std::isnan(want)) << "torch's norm " << norm_type << ": " << want;
    auto r = run_ranks(2, [&](World& w) {
      torch::manual_seed(0);
      NanLayer m;
      shardtorch::shard(m, w, strategy_options(strategy, 2));
      m(torch::randn({3, 4})).pow(2).mean().backward();
      const double norm = shardtorch::clip_grad_norm(*m, 1.0, norm_type);
      require(std::isnan(norm), std::string(shardtorch::strategy_name(strategy)) + " norm " +
                                    std::to_string(norm_type) + ": " + std::to_string(norm) + ", want NaN");
    });
    ASSERT_TRUE(r.ok) << shardtorch::strategy_name(strategy) << " norm " << norm_type << ": " << r.summary();
  }
}

INSTANTIATE_TEST_SUITE_P(Clipping, NanGradient, ::testing::ValuesIn(kAllStrategies), StrategyName());

// Gradients larger than the chunk the norm goes through double by (2^20
// elements): the norm and the clipped gradients still equal torch's, for the
// 2-, 3- and inf-norms, whole (OptimizerOnly) and sharded (FullShard).
struct WideImpl : torch::nn::Module {
  WideImpl() : lin(register_module("lin", torch::nn::Linear(1200, 1000))) {}
  torch::Tensor forward(torch::Tensor x) { return lin(x); }
  torch::nn::Linear lin;
};
SHARDTORCH_MODULE(Wide);

class WideGradient : public ::testing::TestWithParam<Strategy> {};

TEST_P(WideGradient, GradientsLargerThanAChunkClipLikeTorch) {
  const shardtorch::Strategy strategy = GetParam();
  for (double norm_type : {2.0, 3.0, std::numeric_limits<double>::infinity()}) {
    const std::string what = std::string(shardtorch::strategy_name(strategy)) + " norm " + std::to_string(norm_type);
    auto r = run_ranks(2, [&](World& w) {
      torch::manual_seed(0);
      Wide m;
      shardtorch::shard(m, w, strategy_options(strategy, 2));
      torch::manual_seed(1 + w.rank());
      m(torch::randn({2, 1200})).pow(2).mean().backward();
      // torch's clip of the same (reduced, whole) gradients, in double as
      // ours accumulates (torch's fp32 norm of 1.2M elements is 2e-5 off).
      std::vector<torch::Tensor> copies;
      {
        shardtorch::FullParams full(*m, shardtorch::SummonOptions().with_grads(true));
        for (const auto& p : m->parameters()) {
          auto c = p.detach().to(at::kDouble).requires_grad_(true);
          c.mutable_grad() = p.grad().to(at::kDouble);
          copies.push_back(c);
        }
      }
      const double want = torch::nn::utils::clip_grad_norm_(copies, 0.5, norm_type);
      const double norm = shardtorch::clip_grad_norm(*m, 0.5, norm_type);
      require(std::abs(norm - want) <= 1e-12 * want,
              what + ": " + std::to_string(norm) + ", torch " + std::to_string(want));
      shardtorch::FullParams full(*m, shardtorch::SummonOptions().with_grads(true));
      require(at::allclose(m->lin->weight.grad().to(at::kDouble), copies[0].grad(), 1e-6, 1e-12),
              what + ": clipped gradients differ");
    });
    ASSERT_TRUE(r.ok) << what << ": " << r.summary();
  }
}

INSTANTIATE_TEST_SUITE_P(Clipping, WideGradient, ::testing::Values(Strategy::OptimizerOnly, Strategy::FullShard),
                         StrategyName());

INSTANTIATE_TEST_SUITE_P(All, StrategyParity,
                         ::testing::Combine(::testing::ValuesIn(kAllStrategies), ::testing::Values(1, 2, 3, 4)),
                         [](const ::testing::TestParamInfo<StrategyParity::ParamType>& info) {
                           return std::string(shardtorch::strategy_name(std::get<0>(info.param))) + "_world" +
                                  std::to_string(std::get<1>(info.param));
                         });

// Buckets small enough that every block's gradients launch their own
// reduce-scatter during backward, several in flight while backward goes on
// (and accumulation and clipping on top): training still matches.
class SmallBucketParity : public ::testing::TestWithParam<std::tuple<Strategy, int>> {};

TEST_P(SmallBucketParity, ReduceScattersInFlightDuringBackwardMatchSingleProcess) {
  auto [strategy, world] = GetParam();
  auto x = gpt_tokens();
  Recipe recipe;
  recipe.micro = world == 4 ? 3 : 2;
  recipe.clip = 0.5;
  auto want = train_reference(recipe, x);
  auto r = run_ranks(world, [&](World& w) {
    auto opts = strategy_options(strategy, world).bucket_mb(0.06);  // about one block's gradient shard
    {
      torch::manual_seed(0);
      auto probe = gpt::GPT(gpt::Config{});
      auto sm = shardtorch::shard(probe, w, opts);
      gpt::lm_loss(probe(x.narrow(0, 0, 2)), x.narrow(0, 0, 2)).backward();
      // OptimizerOnly all-reduces each unit's gradients alone (every rank keeps them whole), through the same queue.
      const bool whole = strategy == Strategy::OptimizerOnly;
      const int64_t calls = whole ? sm.comm_stats().all_reduce.calls : sm.comm_stats().reduce_scatter.calls;
      require(calls >= 3, std::string("expected a ") + (whole ? "gradient all-reduce" : "reduce-scatter") +
                              " per unit (two blocks and the root) with 0.06 MiB buckets, got " +
                              std::to_string(calls));
      require(sm.stats().reduce_scatters_overlapped >= 1,
              "no gradient reduction was launched while another was in flight");
      require(sm.stats().reductions_deferred == 0, "a unit waited for its turn in the reduction order");
    }
    compare(train_sharded(w, recipe, x, opts), want,
            std::string(shardtorch::strategy_name(strategy)) + " with small buckets");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

INSTANTIATE_TEST_SUITE_P(
    Strategies, SmallBucketParity,
    ::testing::Values(std::make_tuple(Strategy::FullShard, 2), std::make_tuple(Strategy::FullShard, 3),
                      std::make_tuple(Strategy::ShardGradOp, 2), std::make_tuple(Strategy::OptimizerOnly, 2),
                      std::make_tuple(Strategy::OptimizerOnly, 3), std::make_tuple(Strategy::HybridShard, 4)),
    [](const ::testing::TestParamInfo<SmallBucketParity::ParamType>& info) {
      return std::string(shardtorch::strategy_name(std::get<0>(info.param))) + "_world" +
             std::to_string(std::get<1>(info.param));
    });

struct SkippedUnitCase {
  Strategy strategy;
  int world;
  bool prefetch;
};

// Every strategy at 2 ranks; FullShard with prefetch; HybridShard at 4 ranks with and without.
std::vector<SkippedUnitCase> skipped_unit_cases() {
  std::vector<SkippedUnitCase> cases;
  for (Strategy s : kAllStrategies) cases.push_back({s, 2, false});
  cases.push_back({Strategy::FullShard, 2, true});
  cases.push_back({Strategy::HybridShard, 4, true});
  cases.push_back({Strategy::HybridShard, 4, false});
  return cases;
}

class SkippedUnit : public ::testing::TestWithParam<SkippedUnitCase> {};

// Accumulation where the synchronising micro-batch does not run a unit that an
// earlier one did: that unit's gradients, staged without sync, are reduced in
// this step (they used to wait for some later step's reduction). With
// prefetch the skipped unit is gathered for nothing (the order learned says it
// comes next) and must still reduce (it used to fail "reduces its gradients
// while gathering"); HybridShard at 4 ranks has two replica groups.
TEST_P(SkippedUnit, AUnitTheSynchronisingMicroBatchSkipsIsStillReduced) {
  const auto [strategy, world, prefetch] = GetParam();
  torch::manual_seed(5);
  auto x = torch::randn({8, 6});
  auto loss_of = [](Sometimes& m, const torch::Tensor& xs, bool use_b) {
    m->use_b = use_b;
    return m(xs).square().mean() / 2;  // two micro-batches
  };
  torch::manual_seed(0);
  auto ref = Sometimes();
  torch::optim::Adam ref_opt(unique_tensors(*ref), torch::optim::AdamOptions(1e-2));
  const auto want = testref::train_reference(*ref, ref_opt, 3, [&](int) {
    auto first = loss_of(ref, x.narrow(0, 0, 4), true);
    return first + loss_of(ref, x.narrow(0, 4, 4), false);
  });
  auto r = run_ranks(world, [&](World& w) {
    torch::manual_seed(0);
    auto m = Sometimes();
    auto sm = shardtorch::shard(m, w, strategy_options(strategy, world).prefetch(prefetch));
    auto opt = shardtorch::Adam(*m, torch::optim::AdamOptions(1e-2));
    const int64_t rows = 4 / world;
    const auto got = testref::train_ranks(*m, *opt, 3, [&](int) {
      sm.set_requires_gradient_sync(false);
      loss_of(m, x.narrow(0, rows * w.rank(), rows), true).backward();
      sm.set_requires_gradient_sync(true);
      loss_of(m, x.narrow(0, 4 + rows * w.rank(), rows), false).backward();
      require(sm.memory().cur(Mem::GradStaging) == 0, "gradients staged without sync were left unreduced");
    });
    testref::expect_same_run(got, want, kTol, shardtorch::strategy_name(strategy));
  });
  ASSERT_TRUE(r.ok) << shardtorch::strategy_name(strategy) << " at " << world << (prefetch ? " with prefetch" : "")
                    << "\n"
                    << r.summary();
}

INSTANTIATE_TEST_SUITE_P(Accumulation, SkippedUnit, ::testing::ValuesIn(skipped_unit_cases()), [](const auto& info) {
  return std::string(shardtorch::strategy_name(info.param.strategy)) + "_" + std::to_string(info.param.world) +
         "ranks" + (info.param.prefetch ? "_prefetch" : "");
});

// Batch norm inside a unit: each rank normalises with its own batch, so the
// running statistics differ across ranks unless rank 0's are broadcast after
// each step (broadcast_buffers, on by default, as in DDP). The reference is
// DDP's arithmetic in one process: both ranks' forwards start from the same
// buffers, rank 0's update survives, and the gradients are averaged. Each
// step runs two backwards through one graph (retain_graph): batch norm saved
// its statistics for backward, so changing them before the step would break
// the second.
struct NormBlockImpl : torch::nn::Module {
  NormBlockImpl()
      : lin(register_module("lin", torch::nn::Linear(6, 5))), bn(register_module("bn", torch::nn::BatchNorm1d(5))) {}
  torch::Tensor forward(torch::Tensor x) { return torch::tanh(bn(lin(x))); }
  torch::nn::Linear lin;
  torch::nn::BatchNorm1d bn;
};
SHARDTORCH_MODULE(NormBlock);
struct NormNetImpl : torch::nn::Module {
  NormNetImpl() : block(register_module("block", NormBlock())), out(register_module("out", torch::nn::Linear(5, 2))) {}
  torch::Tensor forward(torch::Tensor x) { return out(block(x)); }
  NormBlock block;
  torch::nn::Linear out;
};
SHARDTORCH_MODULE(NormNet);

class BatchNormBuffers : public ::testing::TestWithParam<Strategy> {};

TEST_P(BatchNormBuffers, BatchNormStatisticsFollowRankZeroLikeDDP) {
  const shardtorch::Strategy strategy = GetParam();
  torch::manual_seed(9);
  auto x = torch::randn({8, 6}) * 2 + 1;
  auto rows = [&](int r) { return x.narrow(0, 4 * r, 4); };
  auto buffers_of = [](torch::nn::Module& m) {
    std::map<std::string, torch::Tensor> out;
    for (auto& b : m.named_buffers()) out[b.key()] = b.value().detach().clone();
    return out;
  };
  auto set_buffers = [](torch::nn::Module& m, const std::map<std::string, torch::Tensor>& v) {
    torch::NoGradGuard g;
    for (auto& b : m.named_buffers()) b.value().copy_(v.at(b.key()));
  };
  constexpr int kSteps = 3;
  torch::manual_seed(0);
  auto ref = NormNet();
  torch::optim::SGD ref_opt(unique_tensors(*ref), torch::optim::SGDOptions(0.1));
  for (int s = 0; s < kSteps; ++s) {
    ref_opt.zero_grad();
    auto start = buffers_of(*ref);
    (ref(rows(0)).square().mean() / 2).backward();
    auto after0 = buffers_of(*ref);
    set_buffers(*ref, start);
    (ref(rows(1)).square().mean() / 2).backward();
    set_buffers(*ref, after0);
    ref_opt.step();
  }
  auto want = snapshot(*ref);
  auto want_buffers = buffers_of(*ref);
  for (bool broadcast : {true, false}) {
    auto r = run_ranks(2, [&](World& w) {
      torch::manual_seed(0);
      auto m = NormNet();
      auto sm = shardtorch::shard(m, w, strategy_options(strategy, 2).broadcast_buffers(broadcast));
      auto opt = shardtorch::SGD(*m, torch::optim::SGDOptions(0.1));
      const int64_t broadcasts = sm.comm_stats().broadcast.calls;
      for (int s = 0; s < kSteps; ++s) {
        opt->zero_grad();
        auto loss = m(rows(w.rank())).square().mean() / 2;  // twice: the gradient of the mean
        loss.backward({}, /*retain_graph=*/true);
        loss.backward();
        opt->step();
      }
      // Float statistics and the Long batch counter: one broadcast each per step.
      require(sm.comm_stats().broadcast.calls - broadcasts == (broadcast ? 2 * kSteps : 0),
              "broadcasts: " + std::to_string(sm.comm_stats().broadcast.calls - broadcasts));
      auto got = buffers_of(*m);
      require(got.at("block.bn.num_batches_tracked").item<int64_t>() == kSteps, "batch counter");
      const double err = rel_err(got.at("block.bn.running_mean"), want_buffers.at("block.bn.running_mean"));
      if (broadcast || w.rank() == 0) {
        expect_close_map(got, want_buffers, kTol, "buffers");
      } else {
        require(err > 1e-2, "without broadcast_buffers rank 1 keeps its own statistics; relative difference " +
                                std::to_string(err));
      }
      shardtorch::FullParams full(*m);
      expect_close_map(snapshot(*m), want, kTol, "parameters");
    });
    ASSERT_TRUE(r.ok) << shardtorch::strategy_name(strategy) << " broadcast_buffers " << broadcast << "\n"
                      << r.summary();
  }
}

INSTANTIATE_TEST_SUITE_P(Buffers, BatchNormBuffers, ::testing::ValuesIn(kAllStrategies), StrategyName());
