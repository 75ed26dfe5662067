// Control flow the data decides, differing across ranks inside a unit: a
// branch some ranks take and others do not, so that some of a unit's
// parameters get a gradient on some ranks only (docs/design.md, "Ordering and
// consistency across ranks"). Every strategy must train as the mean of the
// ranks' own losses, and must never pair one rank's collective with another
// rank's different one.
#include <gtest/gtest.h>

#include "models.h"
#include "reference.h"

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
    auto y = torch::tanh(a(x)) * 2;  // nothing saves y itself: it may be changed in place (below)
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
  torch::Tensor forward(torch::Tensor x) { return skip ? x : lin(x); }
  torch::nn::Linear lin;
  bool skip = false;
};
SHARDTORCH_MODULE(Gate);

// [pre] -> first -> mid (branchy) -> [gate] -> in-place scale -> last: every
// one a unit but `pre`, the root's own layer, which runs only while
// `use_pre`; the gate is called only while `call_gate`. Units before and
// after the branchy ones make the order of their reductions matter.
struct BranchNetImpl : torch::nn::Module {
  BranchNetImpl()
      : pre(register_module("pre", torch::nn::Linear(6, 6))),
        first(register_module("first", Layer(6, 6, true))),
        mid(register_module("mid", Branchy())),
        gate(register_module("gate", Gate())),
        last(register_module("last", Layer(6, 4, false))) {}
  torch::Tensor forward(torch::Tensor x) {
    if (use_pre) x = x + pre(x);
    auto h = mid(first(x));
    if (call_gate) {
      h = gate(h);
      h.mul_(0.5);  // in place, on what the gate returned (its input, where it routed around)
    }
    return last(h);
  }
  torch::nn::Linear pre;
  Layer first;
  Branchy mid;
  Gate gate;
  Layer last;
  bool use_pre = true, call_gate = true;
};
SHARDTORCH_MODULE(BranchNet);

constexpr int kSteps = 4;
constexpr int kRows = 4;  // per rank

// Which branches rank r takes at step s.
struct Choice {
  bool branch;            // mid runs b
  bool skip;              // the gate routes around its layer
  bool pre;               // the root runs its own layer
  bool call_gate = true;  // the gate runs at all (the same on every rank)
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
  m->call_gate = c.call_gate;
}

// Micro-batches per step (accumulation): step s, micro-batch k (the last
// synchronises), rank r.
using MicroPlan = Choice (*)(int step, int micro, int rank);

// Every step but the first, whose gradients are compared too: the ranks'
// branches differ from step to step.
const std::set<int> kLaterSteps = {1, 2, 3};

// The single-process reference: `ref` (made with seed 0) trained with Adam
// on the mean of every rank's and micro-batch's loss, each rank's rows of x
// with that rank's choices (`choose(model, step, micro, rank)`); the
// gradients of every step recorded.
template <class Model, class Choose>
testref::Run mean_of_ranks(Model ref, const torch::Tensor& x, int world, int micro, Choose choose) {
  torch::optim::Adam opt(unique_tensors(*ref), torch::optim::AdamOptions(1e-2));
  const int64_t rows = kRows / micro;
  return testref::train_reference(
      *ref, opt, kSteps,
      [&](int s) {
        torch::Tensor loss = torch::zeros({});
        for (int r = 0; r < world; ++r)
          for (int k = 0; k < micro; ++k) {
            choose(ref, s, k, r);
            loss = loss + ref->forward(x.narrow(0, kRows * r + rows * k, rows)).square().mean() / (world * micro);
          }
        return loss;
      },
      kLaterSteps);
}

// In a rank: `steps` of `opt` with `backward(step)` between zero_grad and
// step, recording what mean_of_ranks does.
testref::Run train_like_mean_of_ranks(torch::nn::Module& model, shardtorch::ShardedOptimizer& opt,
                                      const std::function<void(int)>& backward) {
  return testref::train_ranks(model, opt, kSteps, backward, kLaterSteps);
}

struct Case {
  Strategy strategy;
  int world;
  double bucket_mb;  // tiny: one collective per unit, so a wrong order shows as a size mismatch
  bool checkpoint = false;
  bool prefetch = false;
  bool inputs = false;  // backward(inputs = every parameter)
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return std::string(shardtorch::strategy_name(c.strategy)) + "_" + std::to_string(c.world) +
         (c.bucket_mb < 1 ? "_tiny_buckets" : "_buckets") + (c.checkpoint ? "_checkpointed" : "") +
         (c.prefetch ? "_prefetch" : "") + (c.inputs ? "_inputs" : "");
}

void PrintTo(const Case& c, std::ostream* os) { *os << case_name(::testing::TestParamInfo<Case>(c, 0)); }

// Trains with `plan` on every rank (`micro` micro-batches a step, the last
// one synchronising), compares with the single-process reference, and
// requires units_waited(step, rank) units to have waited for their turn in
// the reduction order on each rank and step. `between(rank)` runs after
// each step.
void train_and_check(const Case& c, int micro, MicroPlan plan, const std::function<int64_t(int, int)>& units_waited,
                     const std::function<void(BranchNet&, int)>& between = {}) {
  torch::manual_seed(3);
  auto x = torch::randn({kRows * c.world, 6});
  torch::manual_seed(0);
  const auto want = mean_of_ranks(BranchNet(), x, c.world, micro,
                                  [&](BranchNet& m, int s, int k, int r) { choose(m, plan(s, k, r)); });
  auto r = run_ranks(
      c.world,
      [&](World& w) {
        torch::manual_seed(0);
        BranchNet model;
        auto opts = strategy_options(c.strategy, c.world).bucket_mb(c.bucket_mb).prefetch(c.prefetch);
        if (c.checkpoint) opts.activation_checkpointing_for("mid", true).activation_checkpointing_for("gate", true);
        auto sm = shardtorch::shard(model, w, opts);
        auto opt = shardtorch::Adam(*model, torch::optim::AdamOptions(1e-2));
        const int64_t rows = kRows / micro;
        testref::Run got;
        for (int s = 0; s < kSteps; ++s) {
          const int64_t before = sm.stats().reductions_deferred;
          opt->zero_grad();
          for (int k = 0; k < micro; ++k) {
            sm.set_requires_gradient_sync(k == micro - 1);
            choose(model, plan(s, k, w.rank()));
            auto loss = model(x.narrow(0, kRows * w.rank() + rows * k, rows)).square().mean() / micro;
            if (c.inputs) {
              loss.backward({}, std::nullopt, false, model->parameters());
            } else {
              loss.backward();
            }
          }
          require(sm.memory().gathered_units == 0, "units left gathered after backward");
          (s == 0 ? got.first_grads : got.later_grads[s]) = testref::full_gradients(*model);
          opt->step();
          if (between) between(model, w.rank());
          const int64_t waited = sm.stats().reductions_deferred - before, want_waited = units_waited(s, w.rank());
          require(waited == want_waited, "step " + std::to_string(s) + ": " + std::to_string(waited) +
                                             " units waited for their turn, expected " + std::to_string(want_waited));
        }
        got.final_params = testref::full_parameters(*model);
        testref::expect_same_run(got, want, 1e-5, "rank-dependent branches");
      },
      shardtorch::testing::RunOptions().timeout(std::chrono::seconds(60)).collective_timeout(std::chrono::seconds(5)));
  ASSERT_TRUE(r.ok) << r.summary();
}

template <Plan P>
Choice one_micro_batch(int s, int, int r) {
  return P(s, r);
}
int64_t none_waits(int, int) { return 0; }

class RankDependentBranches : public ::testing::TestWithParam<Case> {};

}  // namespace

// Branches inside units: each rank expects only the gradients its graph will
// deliver, so every unit finishes at the same point of the backward on every
// rank, and none waits for its turn.
TEST_P(RankDependentBranches, InsideUnitsTrainAsTheMeanOfTheRanksLossesAndNoUnitWaits) {
  train_and_check(GetParam(), 1, one_micro_batch<inside_units>, none_waits);
}

// The root's own layer on rank 0 only: elsewhere the root is final at the
// first hook of the backward, long before its turn (last). It waits, and
// nothing else does: the collectives keep one order on every rank.
TEST_P(RankDependentBranches, AUnitFinalBeforeItsTurnOnSomeRanksWaitsForIt) {
  const bool units = GetParam().strategy != Strategy::NoShard;  // NoShard orders buckets, not units
  train_and_check(GetParam(), 1, one_micro_batch<root_too>,
                  [&](int s, int r) -> int64_t { return units && s == 2 && r != 0 ? 1 : 0; });
}

// Accumulation: in the first micro-batch (no sync) rank 0 routes around the
// gate, whose gradients it therefore never stages; the second (synchronising)
// calls no gate at all. Every rank must still reduce what the gate staged.
TEST_P(RankDependentBranches, AccumulationReducesAUnitEveryRankRanWhateverItsDataDid) {
  auto plan = [](int s, int k, int r) {
    Choice c = inside_units(s, r);
    c.skip = k == 0 && r == 0;
    c.call_gate = k == 0;
    return c;
  };
  train_and_check(GetParam(), 2, plan, none_waits);
}

// A forward in grad mode never differentiated, on rank 0 only and between
// steps (a look at one unit's output, say): it must not define the next
// step's reduction order there. (Under FullShard and HybridShard such a
// forward gathers, so every rank must run it.)
TEST_P(RankDependentBranches, AForwardOnOneRankOnlyDoesNotReorderTheNextReductions) {
  const Case c = GetParam();
  const bool gathers = c.strategy == Strategy::FullShard || c.strategy == Strategy::HybridShard;
  train_and_check(c, 1, one_micro_batch<inside_units>, none_waits, [gathers](BranchNet& m, int rank) {
    if (rank == 0 || gathers) m->last(torch::ones({1, 6})).sum().item<double>();
  });
}

namespace {

// A frozen unit (a fixed projection) inside a parent unit whose own
// trainable layer runs before it on some ranks only: on the ranks that skip
// the layer the parent is final at its pre-backward hook, before the child's
// backward all-gather; elsewhere after it. Reductions run on a communicator
// of their own, so the two orders pair up anyway.
struct FrozenImpl : torch::nn::Module {
  FrozenImpl() : lin(register_module("lin", torch::nn::Linear(6, 6))) {
    for (auto& p : parameters()) p.set_requires_grad(false);
  }
  torch::Tensor forward(torch::Tensor x) { return lin(x); }
  torch::nn::Linear lin;
};
SHARDTORCH_MODULE(Frozen);

struct ParentImpl : torch::nn::Module {
  ParentImpl() : own(register_module("own", torch::nn::Linear(6, 6))), child(register_module("child", Frozen())) {}
  torch::Tensor forward(torch::Tensor x) {
    if (use_own) x = own(x);
    return child(x) * 2;
  }
  torch::nn::Linear own;
  Frozen child;
  bool use_own = true;
};
SHARDTORCH_MODULE(Parent);

struct WithParentImpl : torch::nn::Module {
  WithParentImpl()
      : first(register_module("first", Layer(6, 6, true))),
        parent(register_module("parent", Parent())),
        last(register_module("last", Layer(6, 4, false))) {}
  torch::Tensor forward(torch::Tensor x) { return last(parent(first(x))); }
  Layer first;
  Parent parent;
  Layer last;
};
SHARDTORCH_MODULE(WithParent);

// Parent inside two more units of the same kind: each runs its own layer
// only while `use_own`, so a rank that skips them all has three units final
// before the frozen child's backward all-gather, where the others have none.
struct GrandImpl : torch::nn::Module {
  GrandImpl() : own(register_module("own", torch::nn::Linear(6, 6))), inner(register_module("inner", Parent())) {}
  torch::Tensor forward(torch::Tensor x) {
    if (use_own) x = own(x);
    return inner(x) + 1;
  }
  void use(bool b) {
    use_own = b;
    inner->use_own = b;
  }
  torch::nn::Linear own;
  Parent inner;
  bool use_own = true;
};
SHARDTORCH_MODULE(Grand);

struct GreatImpl : torch::nn::Module {
  GreatImpl() : own(register_module("own", torch::nn::Linear(6, 6))), inner(register_module("inner", Grand())) {}
  torch::Tensor forward(torch::Tensor x) {
    if (use_own) x = own(x);
    return inner(x) - 1;
  }
  torch::nn::Linear own;
  Grand inner;
  bool use_own = true;
};
SHARDTORCH_MODULE(Great);

struct NestedNetImpl : torch::nn::Module {
  NestedNetImpl()
      : first(register_module("first", Layer(6, 6, true))),
        great(register_module("great", Great())),
        last(register_module("last", Layer(6, 4, false))) {}
  torch::Tensor forward(torch::Tensor x) { return last(great(first(x))); }
  void use(bool b) {
    great->use_own = b;
    great->inner->use(b);
  }
  Layer first;
  Great great;
  Layer last;
};
SHARDTORCH_MODULE(NestedNet);

}  // namespace

class ParentFinalFirst : public ::testing::TestWithParam<std::pair<Strategy, int>> {};

TEST_P(ParentFinalFirst, AParentFinalBeforeItsFrozenChildGathersOnSomeRanksOnly) {
  const auto [strategy, world] = GetParam();
  auto use_own = [](int s, int r) { return s != 1 || r == 0; };
  torch::manual_seed(3);
  auto x = torch::randn({kRows * world, 6});
  torch::manual_seed(0);
  const auto want = mean_of_ranks(WithParent(), x, world, 1,
                                  [&](WithParent& m, int s, int, int r) { m->parent->use_own = use_own(s, r); });
  auto r = run_ranks(
      world,
      [&](World& w) {
        torch::manual_seed(0);
        WithParent model;
        auto sm = shardtorch::shard(model, w, strategy_options(strategy, world).bucket_mb(1e-4));
        auto opt = shardtorch::Adam(*model, torch::optim::AdamOptions(1e-2));
        const auto got = train_like_mean_of_ranks(*model, *opt, [&](int s) {
          model->parent->use_own = use_own(s, w.rank());
          model(x.narrow(0, kRows * w.rank(), kRows)).square().mean().backward();
        });
        require(sm.stats().reductions_deferred == 0, "a unit waited for its turn");
        testref::expect_same_run(got, want, 1e-5, "a parent final before its child gathers");
      },
      shardtorch::testing::RunOptions().timeout(std::chrono::seconds(60)).collective_timeout(std::chrono::seconds(5)));
  ASSERT_TRUE(r.ok) << shardtorch::strategy_name(strategy) << ": " << r.summary();
}

INSTANTIATE_TEST_SUITE_P(RankDependentBranchesAroundGathers, ParentFinalFirst,
                         ::testing::Values(std::pair{Strategy::FullShard, 2}, std::pair{Strategy::HybridShard, 4}),
                         [](const auto& info) {
                           return std::string(shardtorch::strategy_name(info.param.first)) + "_" +
                                  std::to_string(info.param.second) + "ranks";
                         });

// A unit called twice in one forward, routed around in the first call on
// rank 0 only: there its gradients are final after the second call's
// backward, and the first call's output hook comes later; it must not gather
// the unit again (on the other ranks the unit is still gathered then).
TEST(RankDependentBranchesAroundGathers, AUnitFinalBeforeItsLastOutputHookGathersNothingMore) {
  struct TwiceImpl : torch::nn::Module {
    TwiceImpl()
        : first(register_module("first", Layer(6, 6, true))),
          gate(register_module("gate", Gate())),
          last(register_module("last", Layer(6, 4, false))) {}
    torch::Tensor forward(torch::Tensor x) {
      gate->skip = skip_first;
      auto h = gate(first(x));
      gate->skip = false;
      return last(gate(h));
    }
    Layer first;
    Gate gate;
    Layer last;
    bool skip_first = false;
  };
  auto skip = [](int s, int r) { return s == 1 && r == 0; };
  torch::manual_seed(3);
  auto x = torch::randn({2 * kRows, 6});
  torch::manual_seed(0);
  const auto want =
      mean_of_ranks(std::make_shared<TwiceImpl>(), x, 2, 1,
                    [&](std::shared_ptr<TwiceImpl>& m, int s, int, int r) { m->skip_first = skip(s, r); });
  auto r = run_ranks(
      2,
      [&](World& w) {
        torch::manual_seed(0);
        auto model = std::make_shared<TwiceImpl>();
        auto sm = shardtorch::shard(*model, w, shardtorch::ShardOptions().bucket_mb(1e-4));
        auto opt = shardtorch::Adam(*model, torch::optim::AdamOptions(1e-2));
        const auto got = train_like_mean_of_ranks(*model, *opt, [&](int s) {
          model->skip_first = skip(s, w.rank());
          model->forward(x.narrow(0, kRows * w.rank(), kRows)).square().mean().backward();
        });
        testref::expect_same_run(got, want, 1e-5, "a unit called twice, routed around once");
      },
      shardtorch::testing::RunOptions().timeout(std::chrono::seconds(60)).collective_timeout(std::chrono::seconds(5)));
  ASSERT_TRUE(r.ok) << r.summary();
}

// The strategy, and whether rank 0 looks after zero_grad() (else after step()).
class ForwardOnOneRank : public ::testing::TestWithParam<std::pair<Strategy, bool>> {};

// The same forward on rank 0 only between steps, with a root that is not a
// unit (no root forward marks where a step's forward starts): zero_grad()
// ends the order it would otherwise have begun. And the look taken after
// zero_grad, just before the step's forward: the unit that began the last
// order, beginning again, starts a new one (the look headed rank 0's order
// alone, and the reductions summed other units' gradients, wrong with no
// error). From the second step: before the first, no order has begun.
TEST_P(ForwardOnOneRank, AForwardOnOneRankOnlyUnderAPlainRootDoesNotReorderTheNextReductions) {
  const auto [strategy, after_zero_grad] = GetParam();
  struct PlainImpl : torch::nn::Module {
    PlainImpl()
        : first(register_module("first", Layer(6, 6, true))),
          mid(register_module("mid", Branchy())),
          last(register_module("last", Layer(6, 4, false))) {}
    torch::Tensor forward(torch::Tensor x) { return last(mid(first(x))); }
    Layer first;
    Branchy mid;
    Layer last;
  };
  torch::manual_seed(3);
  auto x = torch::randn({2 * kRows, 6});
  torch::manual_seed(0);
  auto ref = std::make_shared<PlainImpl>();
  torch::optim::Adam ref_opt(unique_tensors(*ref), torch::optim::AdamOptions(1e-2));
  const auto want =
      testref::train_reference(*ref, ref_opt, kSteps, [&](int) { return ref->forward(x).square().mean(); });
  auto r = run_ranks(
      2,
      [&](World& w) {
        torch::manual_seed(0);
        auto model = std::make_shared<PlainImpl>();
        auto sm = shardtorch::shard(*model, w, strategy_options(strategy, 2).bucket_mb(1e-4));
        auto opt = shardtorch::Adam(*model, torch::optim::AdamOptions(1e-2));
        auto look = [&] { model->last(torch::ones({1, 6})).sum().item<double>(); };  // in grad mode
        testref::Run got;
        for (int s = 0; s < kSteps; ++s) {
          opt->zero_grad();
          if (after_zero_grad && s > 0 && w.rank() == 0) look();
          model->forward(x.narrow(0, kRows * w.rank(), kRows)).square().mean().backward();
          if (s == 0) got.first_grads = testref::full_gradients(*model);
          opt->step();
          if (!after_zero_grad && w.rank() == 0) look();
        }
        require(sm.stats().reductions_deferred == 0, "a unit waited for its turn");
        got.final_params = testref::full_parameters(*model);
        testref::expect_same_run(got, want, 1e-5, "a forward on rank 0 only");
      },
      shardtorch::testing::RunOptions().timeout(std::chrono::seconds(60)).collective_timeout(std::chrono::seconds(5)));
  ASSERT_TRUE(r.ok) << shardtorch::strategy_name(strategy) << (after_zero_grad ? ", look after zero_grad: " : ": ")
                    << r.summary();
}

INSTANTIATE_TEST_SUITE_P(RankDependentBranchesAroundGathers, ForwardOnOneRank,
                         ::testing::Values(std::pair{Strategy::ShardGradOp, false},
                                           std::pair{Strategy::OptimizerOnly, false},
                                           std::pair{Strategy::ShardGradOp, true},
                                           std::pair{Strategy::OptimizerOnly, true}),
                         [](const auto& info) {
                           return std::string(shardtorch::strategy_name(info.param.first)) +
                                  (info.param.second ? "_look_after_zero_grad" : "_look_after_step");
                         });

INSTANTIATE_TEST_SUITE_P(
    All, RankDependentBranches,
    ::testing::Values(Case{Strategy::FullShard, 2, 1e-4}, Case{Strategy::FullShard, 3, 25},
                      Case{Strategy::FullShard, 2, 1e-4, true}, Case{Strategy::FullShard, 2, 1e-4, false, true},
                      Case{Strategy::FullShard, 3, 1e-4, false, false, true}, Case{Strategy::ShardGradOp, 2, 1e-4},
                      Case{Strategy::ShardGradOp, 3, 1e-4, true}, Case{Strategy::OptimizerOnly, 2, 1e-4},
                      Case{Strategy::OptimizerOnly, 2, 1e-4, false, false, true}, Case{Strategy::NoShard, 2, 1e-4},
                      Case{Strategy::HybridShard, 2, 1e-4}, Case{Strategy::HybridShard, 4, 1e-4},
                      Case{Strategy::HybridShard, 4, 1e-4, true}, Case{Strategy::HybridShard, 4, 1e-4, false, true}),
    case_name);

struct RoutedCase {
  Strategy strategy;
  int world;
  bool across_replicas;  // routed around on ranks 1 and 2, not on rank 1 alone
};

class UnitsFinalBeforeAGather : public ::testing::TestWithParam<RoutedCase> {};

// Three nested units routed around on rank 1 only: there they are final at
// their pre-backward hooks, one after the other, and their reduce-scatters go
// out before the frozen child's backward all-gather, which rank 0 reaches
// first. More reduce-scatters than the bucketer keeps in flight: waiting for
// the oldest there would wait for rank 0, itself waiting in the all-gather
// for rank 1 (until the collective timeout).
//
// HybridShard at 4 ranks (shard groups {0,1}, {2,3}), routed around on one
// rank of each shard group, the two in different replica groups (ranks 1 and
// 2): their reduce-scatters complete before the all-gather their shard-group
// peers wait in, and the replica all-reduce that follows must not block
// there (it used to, inside the reduce-scatter's completion: rank 1 waited
// for rank 3, 3 in the all-gather for 2, 2 for 0, 0 for 1).
TEST_P(UnitsFinalBeforeAGather, MoreUnitsFinalBeforeAGatherThanReduceScattersInFlight) {
  const RoutedCase c = GetParam();
  const Strategy strategy = c.strategy;
  const int world = c.world;
  auto use_own = [&](int s, int r) { return s != 1 || r == 0 || (c.across_replicas && r == 3); };
  torch::manual_seed(3);
  auto x = torch::randn({kRows * world, 6});
  torch::manual_seed(0);
  const auto want =
      mean_of_ranks(NestedNet(), x, world, 1, [&](NestedNet& m, int s, int, int r) { m->use(use_own(s, r)); });
  auto r = run_ranks(
      world,
      [&](World& w) {
        torch::manual_seed(0);
        NestedNet model;
        auto sm = shardtorch::shard(model, w, strategy_options(strategy, world).bucket_mb(1e-4));
        auto opt = shardtorch::Adam(*model, torch::optim::AdamOptions(1e-2));
        const auto got = train_like_mean_of_ranks(*model, *opt, [&](int s) {
          model->use(use_own(s, w.rank()));
          model(x.narrow(0, kRows * w.rank(), kRows)).square().mean().backward();
        });
        testref::expect_same_run(got, want, 1e-5, "three nested units routed around");
        // Somewhere a launch went past the limit instead of waiting.
        auto past = torch::full({1}, static_cast<double>(sm.stats().reduce_scatters_past_the_limit), torch::kDouble);
        w.comm().all_reduce(past, c10d::ReduceOp::SUM, "launches past the limit");
        require(past.item<double>() >= 1, "no reduce-scatter was launched past the limit");
      },
      shardtorch::testing::RunOptions().timeout(std::chrono::seconds(60)).collective_timeout(std::chrono::seconds(5)));
  ASSERT_TRUE(r.ok) << shardtorch::strategy_name(strategy) << (c.across_replicas ? " across replicas" : "") << ": "
                    << r.summary();
}

INSTANTIATE_TEST_SUITE_P(RankDependentBranchesAroundGathers, UnitsFinalBeforeAGather,
                         ::testing::Values(RoutedCase{Strategy::FullShard, 2, false},
                                           RoutedCase{Strategy::HybridShard, 4, false},
                                           RoutedCase{Strategy::HybridShard, 4, true}),
                         [](const auto& info) {
                           return std::string(shardtorch::strategy_name(info.param.strategy)) + "_" +
                                  std::to_string(info.param.world) + "ranks" +
                                  (info.param.across_replicas ? "_across_replicas" : "");
                         });
