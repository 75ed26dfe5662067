// Prefetch along the recorded order: units called several times per forward,
// runs of the same unit, orders that change, and roots that are not units.
#include <gtest/gtest.h>

#include "models.h"

using namespace testmodels;
using shardtorch::Mem;
using shardtorch::Strategy;
using shardtorch::World;
using shardtorch::testing::run_ranks;

/// A shared encoder applied to two inputs (a Siamese network), then once more
/// after another unit: `enc` runs its forward three times per step, twice in
/// a row, and its parameters get the sum of the three uses' gradients.
struct SiameseImpl : torch::nn::Module {
  SiameseImpl()
      : enc(register_module("enc", Layer(7, 7, true))),
        mid(register_module("mid", Layer(7, 7, true))),
        head(register_module("head", Layer(7, 3, false))) {}
  torch::Tensor forward(torch::Tensor a, torch::Tensor b) { return head(enc(mid(enc(a) * enc(b)))); }
  Layer enc, mid, head;
};
SHARDTORCH_MODULE(Siamese);

class RepeatedUnit : public ::testing::TestWithParam<Strategy> {};

// Without prefetch a repeated unit is gathered for each of its forwards and
// once in backward; with it (docs/design.md, "Prefetch") it stays gathered
// between its two forwards in a row, the head stays gathered into backward,
// and backward prefetches along the learned order without gathering a unit
// it has already finished: two all-gathers fewer per step once the order is
// learned.
TEST_P(RepeatedUnit, AUnitCalledSeveralTimesInOneForwardTrainsLikeTorch) {
  torch::manual_seed(5);
  auto xa = torch::randn({4, 7}), xb = torch::randn({4, 7});
  torch::manual_seed(0);
  auto ref = Siamese();
  torch::optim::SGD ref_opt(unique_tensors(*ref), torch::optim::SGDOptions(0.1));
  constexpr int kSteps = 3;
  auto want = train_in_one_process(*ref, ref_opt, kSteps, [&] { return ref(xa, xb).pow(2).sum(); });
  const Strategy s = GetParam();
  auto r = run_ranks(2, [&](World& w) {
    struct Out {
      std::map<std::string, torch::Tensor> params;
      int64_t gathers;
      int peak_units = 0;
    };
    auto run = [&](bool prefetch) {
      torch::manual_seed(0);
      auto m = Siamese();
      auto sm = shardtorch::shard(m, w, strategy_options(s, 2).prefetch(prefetch));
      auto opt = shardtorch::SGD(*m, torch::optim::SGDOptions(0.1));
      auto part = [&](const torch::Tensor& x) { return x.narrow(0, 2 * w.rank(), 2); };
      Out out{{}, -sm.comm_stats().all_gather.calls};  // the world's counters run on across models
      for (int step = 0; step < kSteps; ++step) {
        sm.reset_peak_memory();
        opt->zero_grad();
        (m(part(xa), part(xb)).pow(2).sum() * w.size()).backward();
        require(sm.memory().gathered_units == 0, "units left gathered after backward");
        require(sm.stats().reductions_deferred == 0, "a unit waited for its turn in the reduction order");
        out.peak_units = std::max(out.peak_units, sm.memory().peak_gathered_units);
        opt->step();
      }
      out.gathers += sm.comm_stats().all_gather.calls;
      out.params = shardtorch::full_parameters(*m);
      return out;
    };
    Out off = run(false), on = run(true);
    expect_close_map(off.params, want, 1e-5, "a unit called twice");
    require(expect_close_map(on.params, off.params, 0.0, "prefetch") == 0.0, "prefetch changed the result");
    if (s != shardtorch::Strategy::FullShard && s != shardtorch::Strategy::HybridShard) return;
    // Per step: enc, enc, mid, enc, head in forward (the root has no parameters of its own);
    // head, enc and mid in backward (enc stays gathered until all three uses' gradients are in).
    require(off.gathers == 8 * kSteps, "without prefetch: " + std::to_string(off.gathers) + " all-gathers");
    require(
        on.gathers == off.gathers - 2 * (kSteps - 1),
        "with prefetch: " + std::to_string(on.gathers) + " all-gathers, " + std::to_string(off.gathers) + " without");
    require(on.peak_units <= 3, "with prefetch at most 3 units gathered, saw " + std::to_string(on.peak_units));
  });
  ASSERT_TRUE(r.ok) << shardtorch::strategy_name(s) << ": " << r.summary();
}

INSTANTIATE_TEST_SUITE_P(PrefetchOrder, RepeatedUnit, ::testing::ValuesIn(kAllStrategies), StrategyName());

/// Two towers sharing their units, the root returning both embeddings (a
/// contrastive model): the root's output hooks fire in the middle of backward.
struct TwoTowerImpl : torch::nn::Module {
  TwoTowerImpl() : enc(register_module("enc", Layer(7, 7, true))), proj(register_module("proj", Layer(7, 3, false))) {}
  std::tuple<torch::Tensor, torch::Tensor> forward(torch::Tensor a, torch::Tensor b) {
    return {proj(enc(a)), proj(enc(b))};
  }
  Layer enc, proj;
};
SHARDTORCH_MODULE(TwoTower);

// Order root, enc, proj, enc, proj. Without prefetch: 4 all-gathers in
// forward, proj and enc once each in backward. With prefetch: the last proj
// stays gathered into backward, and no unit is gathered again after it has
// reduced (the root's late hooks do not move backward's place in the order).
TEST(PrefetchOrder, PrefetchFollowsBackwardThroughRepeatedUnitsOfATwoTowerModel) {
  torch::manual_seed(5);
  auto xa = torch::randn({4, 7}), xb = torch::randn({4, 7});
  constexpr int kSteps = 3;
  auto r = run_ranks(2, [&](World& w) {
    auto run = [&](bool prefetch) {
      torch::manual_seed(0);
      auto m = TwoTower();
      auto sm = shardtorch::shard(m, w, shardtorch::ShardOptions().prefetch(prefetch));
      auto opt = shardtorch::SGD(*m, torch::optim::SGDOptions(0.1));
      auto part = [&](const torch::Tensor& x) { return x.narrow(0, 2 * w.rank(), 2); };
      const int64_t before = sm.comm_stats().all_gather.calls;
      int peak = 0;
      for (int step = 0; step < kSteps; ++step) {
        sm.reset_peak_memory();
        opt->zero_grad();
        auto [za, zb] = m(part(xa), part(xb));
        ((za - zb).pow(2).sum() + za.sum()).backward();
        require(sm.memory().gathered_units == 0, "units left gathered after backward");
        require(sm.stats().reductions_deferred == 0, "a unit waited for its turn in the reduction order");
        peak = std::max(peak, sm.memory().peak_gathered_units);
        opt->step();
      }
      const int64_t gathers = sm.comm_stats().all_gather.calls - before;  // before full_parameters() gathers
      return std::make_tuple(gathers, peak, shardtorch::full_parameters(*m));
    };
    auto [off, off_peak, off_params] = run(false);
    auto [on, on_peak, on_params] = run(true);
    require(expect_close_map(on_params, off_params, 0.0, "prefetch") == 0.0, "prefetch changed the result");
    require(off == 6 * kSteps, "without prefetch: " + std::to_string(off) + " all-gathers");
    require(on == off - (kSteps - 1),
            "with prefetch: " + std::to_string(on) + " all-gathers, " + std::to_string(off) + " without");
    require(on_peak <= 3, "with prefetch at most 3 units gathered, saw " + std::to_string(on_peak));
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

/// mid, then enc twice in a row, then head; a probe on the second call's
/// output runs in backward right after that unit's own hook.
struct RunOfTwoImpl : torch::nn::Module {
  RunOfTwoImpl()
      : mid(register_module("mid", Layer(7, 5, true))),
        enc(register_module("enc", Layer(5, 5, true))),
        head(register_module("head", Layer(5, 3, false))) {}
  torch::Tensor forward(torch::Tensor x) {
    auto y = enc(enc(mid(x)));
    if (probe) y.register_hook([this](const torch::Tensor&) { probe(); });
    return head(y);
  }
  Layer mid, enc, head;
  std::function<void()> probe;
};
SHARDTORCH_MODULE(RunOfTwo);

// When backward reaches a unit that ran twice in a row, the unit before the
// run is prefetched at once (not only once backward is past the run).
TEST(PrefetchOrder, PrefetchLooksPastARunOfTheSameUnitInBackward) {
  auto r = run_ranks(2, [&](World& w) {
    torch::manual_seed(0);
    auto m = RunOfTwo();
    auto sm = shardtorch::shard(m, w, shardtorch::ShardOptions().prefetch(true));
    auto opt = shardtorch::SGD(*m, torch::optim::SGDOptions(0.1));
    std::vector<int> seen;  // units gathered when backward reaches enc's second call, per step
    m->probe = [&] { seen.push_back(sm.memory().gathered_units); };
    for (int step = 0; step < 3; ++step) {
      opt->zero_grad();
      m(torch::randn({2, 7})).pow(2).sum().backward();
      opt->step();
    }
    // Step 1 learns the order (nothing prefetched); then enc and mid, the head having reduced.
    require(seen == std::vector<int>({1, 2, 2}), "units gathered at the probe: " + std::to_string(seen[0]) + ", " +
                                                     std::to_string(seen[1]) + ", " + std::to_string(seen[2]));
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

/// Two units whose order in forward flips with `swap`.
struct SwappingImpl : torch::nn::Module {
  SwappingImpl() : a(register_module("a", Layer(6, 6, true))), b(register_module("b", Layer(6, 6, true))) {}
  torch::Tensor forward(torch::Tensor x) { return swap ? a(b(x)) : b(a(x)); }
  Layer a, b;
  bool swap = false;
};
SHARDTORCH_MODULE(Swapping);

// Backward prefetches along the order of the last complete step. When this
// step's forward ran in another order, the unit that order puts next may have
// reduced already in this backward: it is not gathered again (it was, for
// nothing, and held until the end of backward).
TEST(PrefetchOrder, BackwardPrefetchSkipsAUnitThatHasReducedInThisBackward) {
  auto r = run_ranks(2, [&](World& w) {
    auto run = [&](bool prefetch) {
      torch::manual_seed(0);
      auto m = Swapping();
      auto sm = shardtorch::shard(m, w, shardtorch::ShardOptions().prefetch(prefetch));
      auto opt = shardtorch::SGD(*m, torch::optim::SGDOptions(0.1));
      torch::manual_seed(1 + w.rank());
      std::vector<int64_t> gathers;  // per step
      for (int step = 0; step < 4; ++step) {
        m->swap = step == 2;
        opt->zero_grad();
        const int64_t before = sm.comm_stats().all_gather.calls;
        m(torch::randn({2, 6})).pow(2).sum().backward();
        gathers.push_back(sm.comm_stats().all_gather.calls - before);
        opt->step();
      }
      return std::make_pair(gathers, shardtorch::full_parameters(*m));
    };
    auto [off, off_params] = run(false);
    auto [on, on_params] = run(true);
    require(expect_close_map(on_params, off_params, 0.0, "prefetch") == 0.0, "prefetch changed the result");
    // The swapped step gathers b, a in forward and a, b in backward with or
    // without prefetch (the root holds no parameters).
    require(off[2] == 4 && on[2] == off[2], "all-gathers in the swapped step: " + std::to_string(on[2]) +
                                                " with prefetch, " + std::to_string(off[2]) + " without");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// Under a root that is not a unit nothing marks where a forward starts, so
// forwards in grad mode without a backward (an evaluation that forgot
// NoGradGuard) ran into the next training forward's recorded order: the two
// steps after them lost prefetch. zero_grad ends the recording: the steps
// after the evaluation gather as many times as the steps before it.
TEST(PrefetchOrder, ForwardsWithoutABackwardDoNotDisturbPrefetchUnderAPlainRoot) {
  auto r = run_ranks(2, [&](World& w) {
    torch::manual_seed(0);
    auto m = std::make_shared<PlainRoot>();
    auto sm = shardtorch::shard(*m, w, shardtorch::ShardOptions().prefetch(true));
    auto opt = shardtorch::SGD(*m, torch::optim::SGDOptions(0.1));
    torch::manual_seed(1 + w.rank());
    std::vector<int64_t> gathers;  // per training step
    for (int step = 0; step < 6; ++step) {
      if (step == 3)
        for (int k = 0; k < 4; ++k) m->forward(torch::randn({2, 7}));  // evaluation, grad mode on
      opt->zero_grad();
      const int64_t before = sm.comm_stats().all_gather.calls;
      m->forward(torch::randn({2, 7})).pow(2).sum().backward();
      gathers.push_back(sm.comm_stats().all_gather.calls - before);
      opt->step();
    }
    std::string seen;
    for (auto g : gathers) seen += std::to_string(g) + " ";
    require(gathers[2] < gathers[0], "prefetch saved no all-gather once it had learned the order: " + seen);
    for (int step = 3; step < 6; ++step)
      require(gathers[step] == gathers[2], "all-gathers per step, an evaluation before the fourth: " + seen);
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// zero_grad between a forward and its backward (out = model(x);
// opt->zero_grad(); loss.backward()) used to drop the forward's recorded
// order, so the backward learned none and prefetch never started.
TEST(PrefetchOrder, ZeroGradBetweenForwardAndBackwardKeepsPrefetchUnderAPlainRoot) {
  auto r = run_ranks(2, [&](World& w) {
    torch::manual_seed(0);
    auto m = std::make_shared<PlainRoot>();
    auto sm = shardtorch::shard(*m, w, shardtorch::ShardOptions().prefetch(true));
    auto opt = shardtorch::SGD(*m, torch::optim::SGDOptions(0.1));
    torch::manual_seed(1 + w.rank());
    std::vector<int64_t> gathers;
    for (int step = 0; step < 4; ++step) {
      const int64_t before = sm.comm_stats().all_gather.calls;
      auto loss = m->forward(torch::randn({2, 7})).pow(2).sum();
      opt->zero_grad();
      loss.backward();
      gathers.push_back(sm.comm_stats().all_gather.calls - before);
      opt->step();
    }
    std::string seen;
    for (auto g : gathers) seen += std::to_string(g) + " ";
    require(gathers[3] < gathers[0], "prefetch saved no all-gather with zero_grad before backward: " + seen);
  });
  ASSERT_TRUE(r.ok) << r.summary();
}
