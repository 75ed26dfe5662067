// When units are gathered and freed: unused parameters, backwards before a
// step, evaluation, and forwards that throw.
#include <gtest/gtest.h>

#include "models.h"

using namespace testmodels;
using shardtorch::Mem;
using shardtorch::Strategy;
using shardtorch::World;
using shardtorch::testing::run_ranks;

// A unit whose parameter gets no gradient this step (an unused branch) must
// not hang the step: it is reduced as zero at the end of backward.
struct BranchyImpl : torch::nn::Module {
  BranchyImpl()
      : used(register_module("used", torch::nn::Linear(4, 4))),
        unused(register_module("unused", torch::nn::Linear(4, 4))) {}
  torch::Tensor forward(torch::Tensor x) { return used(x); }
  torch::nn::Linear used, unused;
};
SHARDTORCH_MODULE(Branchy);
struct TwoBranchImpl : torch::nn::Module {
  TwoBranchImpl() : a(register_module("a", Branchy())), b(register_module("b", Branchy())) {}
  torch::Tensor forward(torch::Tensor x) { return b(a(x)); }
  Branchy a, b;
};
SHARDTORCH_MODULE(TwoBranch);

TEST(UnitLifecycle, UnusedParametersDoNotHangAndGetZeroGradients) {
  auto r = run_ranks(2, [](World& w) {
    torch::manual_seed(0);
    auto m = TwoBranch();
    auto sm = shardtorch::shard(m, w);
    auto opt = shardtorch::SGD(*m, torch::optim::SGDOptions(0.1));
    for (int step = 0; step < 2; ++step) {
      opt->zero_grad();
      m(torch::ones({2, 4})).sum().backward();
      require(sm.memory().cur(Mem::GatheredParams) == 0, "units left gathered after backward");
      opt->step();
    }
    shardtorch::FullParams full(*m, shardtorch::SummonOptions().with_grads(true));
    require(m->a->unused->weight.grad().defined() && m->a->unused->weight.grad().eq(0).all().item<bool>(),
            "unused parameter should have a zero gradient");
    require(m->a->used->weight.grad().abs().sum().item<double>() > 0, "used parameter should have a gradient");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

TEST(UnitLifecycle, TwoBackwardsBeforeAStepAccumulateLikeTorch) {
  torch::manual_seed(3);
  auto x1 = torch::randn({4, 7}), x2 = torch::randn({4, 7});
  torch::manual_seed(0);
  auto ref = MLP();
  torch::optim::SGD ref_opt(unique_tensors(*ref), torch::optim::SGDOptions(0.1));
  ref(x1).sum().backward();
  ref(x2).sum().backward();
  ref_opt.step();
  auto want = snapshot(*ref);
  auto r = run_ranks(2, [&](World& w) {
    torch::manual_seed(0);
    auto m = MLP();
    shardtorch::shard(m, w);
    auto opt = shardtorch::SGD(*m, torch::optim::SGDOptions(0.1));
    // Each rank sees half the rows; the sum loss is scaled by N to match the
    // reference (gradients are averaged over ranks).
    auto part = [&](const torch::Tensor& x) { return x.narrow(0, 2 * w.rank(), 2); };
    (m(part(x1)).sum() * w.size()).backward();
    (m(part(x2)).sum() * w.size()).backward();
    opt->step();
    shardtorch::FullParams full(*m);
    expect_close_map(snapshot(*m), want, 1e-5, "two backwards then a step");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

TEST(UnitLifecycle, EvalForwardUnderNoGradFreesEveryUnit) {
  auto r = run_ranks(2, [](World& w) {
    auto m = gpt::GPT(gpt::Config{});
    auto sm = shardtorch::shard(m, w);
    sm.reset_peak_memory();
    torch::NoGradGuard g;
    auto x = torch::randint(0, 64, {2, 16}, torch::kLong);
    auto a = m(x);
    require(sm.memory().gathered_units == 0, "no unit should stay gathered after an eval forward");
    require(sm.memory().peak_gathered_units <= 2, "more than two units gathered in eval");
    auto b = m(x);
    require(at::equal(a, b), "two eval forwards differ");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// A unit whose forward throws while `fail` is set, after computing: a batch
// that runs out of memory half-way.
struct FailingLayerImpl : LayerImpl {
  using LayerImpl::LayerImpl;
  torch::Tensor forward(torch::Tensor x) {
    auto y = LayerImpl::forward(x);
    if (fail) throw std::runtime_error("out of memory (simulated)");
    return y;
  }
  bool fail = false;
};
SHARDTORCH_MODULE(FailingLayer);

struct FailsInTheMiddle : torch::nn::Module {
  FailsInTheMiddle()
      : l1(register_module("l1", Layer(7, 5, true))),
        l2(register_module("l2", FailingLayer(5, 5, true))),
        l3(register_module("l3", Layer(5, 3, false))) {}
  torch::Tensor forward(torch::Tensor x) { return l3(l2(l1(x))); }
  Layer l1;
  FailingLayer l2;
  Layer l3;
};

// A forward that throws in a unit (caught, as a loop that retries a smaller
// batch after running out of memory does) used to leave that unit gathered,
// and the unit prefetched after it gathering, until their next forward. Both
// are freed as the exception passes; the retry then gathers as many times as
// a step before the failure and trains like torch without the failed forward.
// With activation checkpointing the failure comes from inside the
// checkpointed node's first run.
TEST(UnitLifecycle, AForwardThatThrowsGivesItsUnitsBackAndTheRetryTrainsLikeTorch) {
  torch::manual_seed(4);
  auto x = torch::randn({kBatch, 7}), y = torch::randn({kBatch, 3});
  torch::manual_seed(0);
  auto ref = std::make_shared<FailsInTheMiddle>();
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1));
  const auto want = train_in_one_process(*ref, ref_opt, 4, [&] { return torch::mse_loss(ref->forward(x), y); });
  for (bool ckpt : {false, true}) {
    auto r = run_ranks(2, [&](World& w) {
      torch::manual_seed(0);
      auto m = std::make_shared<FailsInTheMiddle>();
      auto sm = shardtorch::shard(*m, w, shardtorch::ShardOptions().prefetch(true).activation_checkpointing(ckpt));
      auto opt = shardtorch::SGD(*m, torch::optim::SGDOptions(0.1));
      const int64_t per = kBatch / 2;
      auto xs = x.narrow(0, w.rank() * per, per), ys = y.narrow(0, w.rank() * per, per);
      std::vector<int64_t> gathers;  // per step
      for (int step = 0; step < 4; ++step) {
        if (step == 2) {
          m->l2->fail = true;
          std::string error;
          try {
            m->forward(xs);
          } catch (const std::exception& e) {
            error = e.what();
          }
          m->l2->fail = false;
          require(error.find("out of memory (simulated)") != std::string::npos, "the forward did not throw: " + error);
          const auto mem = sm.memory();
          require(mem.gathered_units == 0 && mem.cur(Mem::GatheredParams) == 0,
                  "after the failed forward " + std::to_string(mem.gathered_units) + " unit(s), " +
                      std::to_string(mem.cur(Mem::GatheredParams)) + " bytes stay gathered");
        }
        opt->zero_grad();
        const int64_t before = sm.comm_stats().all_gather.calls;
        torch::mse_loss(m->forward(xs), ys).backward();
        gathers.push_back(sm.comm_stats().all_gather.calls - before);
        opt->step();
      }
      std::string seen;
      for (auto g : gathers) seen += std::to_string(g) + " ";
      require(gathers[2] == gathers[1] && gathers[3] == gathers[1], "all-gathers per step: " + seen);
      shardtorch::FullParams full(*m);
      expect_close_map(snapshot(*m), want, 1e-5,
                       ckpt ? "checkpointed, after a failed forward" : "after a failed forward");
    });
    EXPECT_TRUE(r.ok) << (ckpt ? "checkpointed: " : "") << r.summary();
  }
}

// The root unit's own forward fails after its blocks have run (the LM head
// running out of memory). With prefetch, post-forward had kept the last block
// gathered for the backward; the root's failure frees it, so the retry starts
// with only the root gathered, as after any forward of the root.
TEST(UnitLifecycle, AFailedForwardOfTheRootFreesTheBlockKeptForBackward) {
  torch::manual_seed(4);
  auto x = torch::randn({kBatch, 7}), y = torch::randn({kBatch, 3});
  torch::manual_seed(0);
  FailingRoot ref;
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1));
  const auto want = train_in_one_process(*ref, ref_opt, 4, [&] { return torch::mse_loss(ref(x), y); });
  auto r = run_ranks(2, [&](World& w) {
    torch::manual_seed(0);
    FailingRoot m;
    auto sm = shardtorch::shard(m, w, shardtorch::ShardOptions().prefetch(true));
    auto opt = shardtorch::SGD(*m, torch::optim::SGDOptions(0.1));
    const int64_t per = kBatch / 2;
    auto xs = x.narrow(0, w.rank() * per, per), ys = y.narrow(0, w.rank() * per, per);
    for (int step = 0; step < 4; ++step) {
      if (step == 2) {  // the order is learned: l2 is kept gathered after its forward
        m->fail = true;
        std::string error;
        try {
          m(xs);
        } catch (const std::exception& e) {
          error = e.what();
        }
        m->fail = false;
        require(error.find("out of memory in the head") != std::string::npos, "the forward did not throw: " + error);
        require(sm.memory().gathered_units == 1, std::to_string(sm.memory().gathered_units) +
                                                     " units gathered after the root's failed forward, expected "
                                                     "the root alone");
      }
      opt->zero_grad();
      torch::mse_loss(m(xs), ys).backward();
      opt->step();
    }
    shardtorch::FullParams full(*m);
    expect_close_map(snapshot(*m), want, 1e-5, "after the root's failed forward");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}
