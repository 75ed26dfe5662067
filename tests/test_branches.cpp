// Control flow the data decides, differing across ranks inside a unit: a
// branch some ranks take and others do not, so that some of a unit's
// parameters get a gradient on some ranks only (docs/design.md, "Ordering and
// consistency across ranks"). Every strategy must train as the mean of the
// ranks' own losses, and must never pair one rank's collective with another
// rank's different one.
#include <gtest/gtest.h>

#include "models.h"

using namespace testmodels;
using shardtorch::ShardOptions;
using shardtorch::Strategy;
using shardtorch::World;
using shardtorch::testing::run_ranks;

namespace {

// A unit whose second layer runs only while `use_b` (a branch the data takes).
struct BranchyImpl : torch::nn::Module {
  BranchyImpl() : a(register_module("a", torch::nn::Linear(6, 6))), b(register_module("b", torch::nn::Linear(6, 6))) {}
  torch::Tensor forward(torch::Tensor x) {
    auto y = torch::tanh(a(x));
    return use_b ? y + b(y) : y;
  }
  torch::nn::Linear a, b;
  bool use_b = true;
};
SHARDTORCH_MODULE(Branchy);

// A unit that, while `skip`, passes its input through without touching its
// parameters at all (a gate that routes around it).
struct GateImpl : torch::nn::Module {
  GateImpl() : lin(register_module("lin", torch::nn::Linear(6, 6))) {}
  torch::Tensor forward(torch::Tensor x) { return skip ? x : torch::tanh(lin(x)); }
  torch::nn::Linear lin;
  bool skip = false;
};
SHARDTORCH_MODULE(Gate);

// [pre] -> first -> mid (branchy) -> gate -> last: every one a unit but
// `pre`, the root's own layer, which runs only while `use_pre`. Units before
// and after the branchy ones make the order of their reductions matter.
struct BranchNetImpl : torch::nn::Module {
  BranchNetImpl()
      : pre(register_module("pre", torch::nn::Linear(6, 6))),
        first(register_module("first", Layer(6, 6, true))),
        mid(register_module("mid", Branchy())),
        gate(register_module("gate", Gate())),
        last(register_module("last", Layer(6, 4, false))) {}
  torch::Tensor forward(torch::Tensor x) {
    if (use_pre) x = x + pre(x);
    return last(gate(mid(first(x))));
  }
  torch::nn::Linear pre;
  Layer first;
  Branchy mid;
  Gate gate;
  Layer last;
  bool use_pre = true;
};
SHARDTORCH_MODULE(BranchNet);

constexpr int kSteps = 4;
constexpr int kRows = 4;  // per rank

// Which branches rank r takes at step s.
struct Choice {
  bool branch;  // mid runs b
  bool skip;    // the gate routes around its layer
  bool pre;     // the root runs its own layer
};
using Plan = Choice (*)(int step, int rank);

// Inside units only: mid's b on rank 0 only at odd steps, the gate skipped
// by rank 1 at step 1.
Choice inside_units(int s, int r) { return {s % 2 == 0 || r == 0, s == 1 && r == 1, true}; }
// The root's own layer too, on rank 0 only at step 2: on the other ranks the
// root (last in the reduction order) has no gradient coming and is final at
// its first hook, the first of the backward.
Choice root_too(int s, int r) {
  Choice c = inside_units(s, r);
  c.pre = s != 2 || r == 0;
  return c;
}

void choose(BranchNet& m, Choice c) {
  m->mid->use_b = c.branch;
  m->gate->skip = c.skip;
  m->use_pre = c.pre;
}

std::map<std::string, torch::Tensor> reference(const torch::Tensor& x, int world, Plan plan) {
  torch::manual_seed(0);
  BranchNet ref;
  torch::optim::Adam opt(unique_tensors(*ref), torch::optim::AdamOptions(1e-2));
  for (int s = 0; s < kSteps; ++s) {
    opt.zero_grad();
    torch::Tensor loss = torch::zeros({});
    for (int r = 0; r < world; ++r) {
      choose(ref, plan(s, r));
      loss = loss + ref(x.narrow(0, kRows * r, kRows)).square().mean() / world;
    }
    loss.backward();
    opt.step();
  }
  return snapshot(*ref);
}

struct Case {
  Strategy strategy;
  int world;
  double bucket_mb;  // tiny: one collective per unit, so a wrong order shows as a size mismatch
  bool checkpoint = false;
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  return std::string(shardtorch::strategy_name(info.param.strategy)) + "_" + std::to_string(info.param.world) +
         (info.param.bucket_mb < 1 ? "_tiny_buckets" : "_buckets") + (info.param.checkpoint ? "_checkpointed" : "");
}

// Trains with `plan` on every rank, compares with the single-process
// reference, and requires units_waited(step, rank) units to have waited for
// their turn in the reduction order on each rank and step.
void train_and_check(const Case& c, Plan plan, const std::function<int64_t(int step, int rank)>& units_waited) {
  torch::manual_seed(3);
  auto x = torch::randn({kRows * c.world, 6});
  const auto want = reference(x, c.world, plan);
  auto r = run_ranks(
      c.world,
      [&](World& w) {
        torch::manual_seed(0);
        BranchNet model;
        auto opts = strategy_options(c.strategy, c.world).bucket_mb(c.bucket_mb);
        if (c.checkpoint) opts.activation_checkpointing_for("mid", true).activation_checkpointing_for("gate", true);
        auto sm = shardtorch::shard(model, w, opts);
        auto opt = shardtorch::Adam(*model, torch::optim::AdamOptions(1e-2));
        for (int s = 0; s < kSteps; ++s) {
          const int64_t before = sm.reductions_deferred();
          opt->zero_grad();
          choose(model, plan(s, w.rank()));
          model(x.narrow(0, kRows * w.rank(), kRows)).square().mean().backward();
          require(sm.memory().gathered_units == 0, "units left gathered after backward");
          opt->step();
          const int64_t waited = sm.reductions_deferred() - before, want_waited = units_waited(s, w.rank());
          require(waited == want_waited, "step " + std::to_string(s) + ": " + std::to_string(waited) +
                                             " units waited for their turn, expected " + std::to_string(want_waited));
        }
        expect_close_map(shardtorch::full_parameters(*model), want, 1e-5, "rank-dependent branches");
      },
      shardtorch::testing::RunOptions().timeout(std::chrono::seconds(60)).collective_timeout(std::chrono::seconds(5)));
  ASSERT_TRUE(r.ok) << r.summary();
}

class RankDependentBranches : public ::testing::TestWithParam<Case> {};

}  // namespace

// Branches inside units: each rank expects only the gradients its graph will
// deliver, so every unit finishes at the same point of the backward on every
// rank, and none waits for its turn.
TEST_P(RankDependentBranches, InsideUnitsTrainAsTheMeanOfTheRanksLossesAndNoUnitWaits) {
  train_and_check(GetParam(), inside_units, [](int, int) -> int64_t { return 0; });
}

// The root's own layer on rank 0 only: elsewhere the root is final at the
// first hook of the backward, long before its turn (last). It waits, and
// nothing else does: the collectives keep one order on every rank.
TEST_P(RankDependentBranches, AUnitFinalBeforeItsTurnOnSomeRanksWaitsForIt) {
  const bool units = GetParam().strategy != Strategy::NoShard;  // NoShard orders buckets, not units
  train_and_check(GetParam(), root_too, [&](int s, int r) -> int64_t { return units && s == 2 && r != 0 ? 1 : 0; });
}

INSTANTIATE_TEST_SUITE_P(
    All, RankDependentBranches,
    ::testing::Values(Case{Strategy::FullShard, 2, 1e-4}, Case{Strategy::FullShard, 3, 25},
                      Case{Strategy::FullShard, 2, 1e-4, true}, Case{Strategy::ShardGradOp, 2, 1e-4},
                      Case{Strategy::ShardGradOp, 3, 1e-4, true}, Case{Strategy::OptimizerOnly, 2, 1e-4},
                      Case{Strategy::NoShard, 2, 1e-4}, Case{Strategy::HybridShard, 2, 1e-4},
                      Case{Strategy::HybridShard, 4, 1e-4}, Case{Strategy::HybridShard, 4, 1e-4, true}),
    case_name);
