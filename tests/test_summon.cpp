// summon_full_params: rank0_only, forwards, steps and backwards inside a
// scope, writeback into the shards, and the gradients a with_grads scope holds.
#include <gtest/gtest.h>

#include "models.h"

using namespace testmodels;
using shardtorch::Mem;
using shardtorch::Strategy;
using shardtorch::World;
using shardtorch::testing::run_ranks;

TEST(Summon, SummonRank0OnlyKeepsOtherRanksSharded) {
  torch::manual_seed(0);
  auto ref = MLP();
  auto want = ref->l1->lin->weight.detach().clone();
  auto r = run_ranks(3, [&](World& w) {
    torch::manual_seed(0);
    auto m = MLP();
    auto sm = shardtorch::shard(m, w);
    sm.reset_peak_memory();
    {
      shardtorch::FullParams full(*m, shardtorch::SummonOptions().rank0_only(true));
      auto mem = sm.memory();
      if (w.rank() == 0) {
        require(at::equal(m->l1->lin->weight, want), "rank 0 should see the full weight");
        require(mem.gathered_units == 3, "rank 0 should hold all 3 units");
      } else {
        require(mem.gathered_units == 0 && mem.cur(Mem::GatheredParams) == 0, "other ranks should hold nothing");
        require(mem.peak_gathered_units == 1, "other ranks should hold one unit at a time");
      }
    }
    require(sm.memory().cur(Mem::GatheredParams) == 0, "full parameters left after summon");
    // Edits on rank 0 could not reach the other ranks' shards: asking for
    // writeback as well is refused, on every rank, before anything is gathered.
    bool refused = false;
    try {
      shardtorch::FullParams full(*m, shardtorch::SummonOptions().rank0_only(true).writeback(true));
    } catch (const std::exception& e) {
      refused = std::string(e.what()).find("writeback with rank0_only") != std::string::npos;
    }
    require(refused, "rank0_only with writeback was accepted");
    require(sm.memory().cur(Mem::GatheredParams) == 0, "the refused summon gathered something");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// Evaluation inside a summon scope: forwards (with and without grad mode)
// leave the summoned units gathered, so the scope's exit finds them as it left
// them (before, the forward freed them and the exit's writeback threw from a
// destructor: std::terminate). With rank0_only, rank 0 alone can run the model:
// nothing needs a collective. An optimizer step inside a scope is an error on
// every rank (its values would be overwritten on exit).
TEST(Summon, ForwardInsideSummonKeepsTheUnitsAndAStepThereIsRefused) {
  torch::manual_seed(0);
  auto ref = MLP();
  auto x = torch::randn({3, 7});
  auto want = ref(x).detach();
  auto r = run_ranks(2, [&](World& w) {
    torch::manual_seed(0);
    auto m = MLP();
    auto sm = shardtorch::shard(m, w);
    auto opt = shardtorch::AdamW(*m, torch::optim::AdamWOptions(1e-2));
    m(x).square().mean().backward();  // gradients a step inside the scope would apply
    {
      shardtorch::FullParams full(*m);
      {
        torch::NoGradGuard no_grad;
        require(at::allclose(m(x), want), "forward under no_grad inside summon differs");
      }
      auto y = m(x);  // grad mode: backward would follow
      require(at::allclose(y.detach(), want), "forward inside summon differs");
      require(sm.memory().gathered_units == 3, "a forward inside summon freed units");
      bool refused = false;
      try {
        opt->step();
      } catch (const std::exception& e) {
        refused = std::string(e.what()).find("inside a summon_full_params scope") != std::string::npos;
      }
      require(refused, "an optimizer step inside summon was accepted");
      require(opt->inner().state().empty(), "the refused step was applied (the optimizer has state)");
    }
    require(sm.memory().cur(Mem::GatheredParams) == 0, "full parameters left after summon");
    {
      shardtorch::FullParams full(*m, shardtorch::SummonOptions().rank0_only(true));
      if (w.rank() == 0) {
        torch::NoGradGuard no_grad;
        require(at::allclose(m(x), want), "rank 0's forward inside a rank0_only summon differs");
        require(at::allclose(m(x), want), "a second forward inside a rank0_only summon differs");
      }
    }
    require(sm.memory().cur(Mem::GatheredParams) == 0, "full parameters left after the rank0_only summon");
    // Training goes on normally afterwards.
    opt->zero_grad();
    m(x).square().mean().backward();
    opt->step();
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

class WithGrads : public ::testing::TestWithParam<Strategy> {};

// Inside summon_full_params(with_grads) param.grad are the reduced
// gradients; a backward there added to them and reduced both again (the old
// gradients counted twice). It is refused on every rank, and training after
// the scope is what it would have been without the attempt, bitwise.
TEST_P(WithGrads, ABackwardInsideSummonWithGradsIsRefusedAndChangesNothing) {
  const shardtorch::Strategy s = GetParam();
  auto r = run_ranks(2, [&](World& w) {
    auto train = [&](bool attempt) {
      torch::manual_seed(0);
      auto m = MLP();
      shardtorch::shard(m, w, strategy_options(s, 2));
      auto opt = shardtorch::SGD(*m, torch::optim::SGDOptions(0.1));
      torch::manual_seed(1 + w.rank());
      auto x = torch::randn({3, 7});
      m(x).square().mean().backward();
      if (attempt) {
        shardtorch::FullParams full(*m, shardtorch::SummonOptions().with_grads(true));
        std::string error = "none";
        try {
          m(x).square().mean().backward();
        } catch (const std::exception& e) {
          error = e.what();
        }
        require(error.find("rank " + std::to_string(w.rank()) + ": a backward reached ") != std::string::npos &&
                    error.find(" inside a summon_full_params(with_grads) scope") != std::string::npos,
                std::string(shardtorch::strategy_name(s)) + ": a backward inside the scope: " + error);
      }
      opt->step();
      return shardtorch::full_parameters(*m);
    };
    auto want = train(false);
    auto got = train(true);
    for (auto& [n, t] : want)
      require(at::equal(t, got.at(n)), std::string(shardtorch::strategy_name(s)) + ": '" + n +
                                           "' differs after a refused backward inside summon(with_grads)");
  });
  EXPECT_TRUE(r.ok) << shardtorch::strategy_name(s) << ": " << r.summary();
}

INSTANTIATE_TEST_SUITE_P(Summon, WithGrads,
                         ::testing::Values(Strategy::FullShard, Strategy::ShardGradOp, Strategy::NoShard),
                         StrategyName());

namespace {
struct WritebackCase {
  Strategy s;
  bool offload;
};

class Writeback : public ::testing::TestWithParam<WritebackCase> {};
}  // namespace

// Under every sharded strategy (ZeRO-1/2 keep their full parameters between
// steps, offloaded or not): edits in a summon scope reach the shards with
// writeback and are discarded without it, in the full parameters forward
// computes with too; edits that differ by rank, written back, leave every
// rank computing with the same values. (Under ZeRO-1/2 an edit without
// writeback used to stay in the full parameters until the next step, and
// per-rank edits left the ranks computing with different ones.)
TEST_P(Writeback, SummonWritesEditsBackIntoTheShards) {
  const WritebackCase c = GetParam();
  const std::string what = std::string(shardtorch::strategy_name(c.s)) + (c.offload ? "+offload" : "");
  auto r = run_ranks(2, [&](World& w) {
    auto m = MLP();
    shardtorch::shard(m, w, strategy_options(c.s, w.size()).cpu_offload(c.offload));
    const auto x = torch::ones({2, 7});
    auto same_everywhere = [&](const std::string& when) {
      at::Tensor out = m(x).detach(), largest = out.clone();
      w.comm().all_reduce(largest, c10d::ReduceOp::MAX, "compare");
      require(at::equal(out, largest), what + ": the ranks compute different outputs " + when);
      return out;
    };
    {
      shardtorch::FullParams full(*m);
      torch::NoGradGuard g;
      m->l1->lin->weight.fill_(0.5);
      m->l3->lin->bias.fill_(-2.0);
    }
    const at::Tensor edited = same_everywhere("after a writeback");
    {
      shardtorch::FullParams full(*m);
      require(m->l1->lin->weight.eq(0.5).all().item<bool>(), what + ": edit of l1.weight lost");
      require(m->l3->lin->bias.eq(-2.0).all().item<bool>(), what + ": edit of l3.bias lost");
    }
    {
      shardtorch::FullParams full(*m, shardtorch::SummonOptions().writeback(false));
      torch::NoGradGuard g;
      m->l1->lin->weight.fill_(9.0);
    }
    require(at::equal(same_everywhere("after an edit without writeback"), edited),
            what + ": an edit without writeback changed what forward computes");
    {
      shardtorch::FullParams full(*m);
      require(m->l1->lin->weight.eq(0.5).all().item<bool>(), what + ": writeback(false) still wrote back");
    }
    {
      shardtorch::FullParams full(*m);
      torch::NoGradGuard g;
      m->l1->lin->weight.fill_(1.0 + w.rank());  // each rank writes back its own slice of its own edit
    }
    same_everywhere("after edits that differ by rank");
  });
  ASSERT_TRUE(r.ok) << what << ": " << r.summary();
}

INSTANTIATE_TEST_SUITE_P(
    Summon, Writeback,
    ::testing::Values(WritebackCase{Strategy::FullShard, false}, WritebackCase{Strategy::ShardGradOp, false},
                      WritebackCase{Strategy::OptimizerOnly, false}, WritebackCase{Strategy::HybridShard, false},
                      WritebackCase{Strategy::ShardGradOp, true}),
    [](const ::testing::TestParamInfo<WritebackCase>& info) {
      return std::string(shardtorch::strategy_name(info.param.s)) + (info.param.offload ? "_offload" : "");
    });

class GradientsCounted : public ::testing::TestWithParam<Strategy> {};

// The full gradients a with_grads scope puts in param.grad are memory the
// library holds: counted under summoned_grads while the scope lives, each
// storage once (a unit's gradients share its full gradient when the dtypes
// agree), and given back on exit.
TEST_P(GradientsCounted, SummonedGradientsAreCountedWhileTheScopeLives) {
  const shardtorch::Strategy s = GetParam();
  for (bool bf16 : {false, true}) {
    auto r = run_ranks(2, [&](World& w) {
      torch::manual_seed(0);
      FailingRoot m;  // a root unit without buffers: its input is cast to bf16
      auto o = strategy_options(s, 2);
      if (bf16) o.mixed_precision(shardtorch::MixedPrecision().param_dtype(at::kBFloat16));
      auto sm = shardtorch::shard(m, w, o);
      m(torch::ones({2, 7})).square().sum().backward();
      require(sm.memory().cur(Mem::SummonedGrads) == 0, "summoned gradients counted before any scope");
      {
        shardtorch::FullParams full(*m, shardtorch::SummonOptions().with_grads(true));
        int64_t at_least = 0, at_most = 0;  // the gradients' own bytes; their storages' (unit flats, padded)
        for (const auto& p : m->parameters()) {
          if (!p.grad().defined()) continue;
          at_least += p.grad().nbytes();
          at_most += p.grad().storage().nbytes();
        }
        const int64_t counted = sm.memory().cur(Mem::SummonedGrads);
        require(at_least > 0 && counted >= at_least && counted <= at_most,
                "summoned_grads " + std::to_string(counted) + " B, the gradients hold " + std::to_string(at_least) +
                    " B (storages " + std::to_string(at_most) + " B)");
      }
      require(sm.memory().cur(Mem::SummonedGrads) == 0 && sm.memory().max(Mem::SummonedGrads) > 0,
              "summoned gradients still counted after the scope");
    });
    EXPECT_TRUE(r.ok) << shardtorch::strategy_name(s) << (bf16 ? " bf16" : "") << ": " << r.summary();
  }
}

INSTANTIATE_TEST_SUITE_P(Summon, GradientsCounted, ::testing::Values(Strategy::FullShard, Strategy::NoShard),
                         StrategyName());
