// Unit placement, summon_full_params, and the edges of the hook state machine.
#include <gtest/gtest.h>
#include <torch/version.h>

#include "../src/flat_param.h"
#include "../src/storage_access.h"
#include "models.h"

using namespace testmodels;
using shardtorch::Mem;
using shardtorch::Strategy;
using shardtorch::World;
using shardtorch::testing::run_ranks;

TEST(Units, TiedWeightGoesToTheCommonAncestorUnit) {
  auto r = run_ranks(2, [](World& w) {
    auto model = gpt::GPT(gpt::Config{});
    auto sm = shardtorch::shard(model, w);
    auto units = sm.units();
    require(units.size() == 4, "expected root, 2 blocks and head, got " + std::to_string(units.size()));
    require(units[0].name.empty() && units[1].name == "blocks.0" && units[2].name == "blocks.1" && units[3].name == "head",
            "unexpected unit names");
    require(units[3].layouts.empty(), "the head's tied weight should not be in the head unit");
    int seen = 0;
    for (auto& names : units[0].param_names)
      for (auto& n : names) seen += n == "tok_emb.weight" || n == "head.weight";
    require(seen == 1, "the tied weight should be in the root unit exactly once, seen " + std::to_string(seen));
    // Names do not change: the module still lists both names for the one tensor.
    auto params = model->named_parameters();
    require(params.contains("head.weight") && params.contains("tok_emb.weight"), "parameter names changed");
    require(params["head.weight"].is_same(params["tok_emb.weight"]), "tie broken");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

TEST(Units, SummonRank0OnlyKeepsOtherRanksSharded) {
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
TEST(Units, ForwardInsideSummonKeepsTheUnitsAndAStepThereIsRefused) {
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

// One unit registered twice in the module tree (layers sharing weights,
// ALBERT-style): it is one unit, called twice per forward, and trains like
// the same model in one process under every strategy. It used to become two
// units, the second overwriting the first's state: the model then failed
// with "a unit of this sharded model no longer exists".
TEST(Units, AUnitRegisteredTwiceIsOneUnitAndTrainsLikeTorch) {
  struct SharedImpl : torch::nn::Module {
    SharedImpl() : block(Layer(7, 7, true)), head(register_module("head", Layer(7, 3, false))) {
      register_module("first", block);
      register_module("again", block);
    }
    torch::Tensor forward(torch::Tensor x) { return head(block(block(x))); }
    Layer block, head;
  };
  torch::manual_seed(4);
  auto x = torch::randn({kBatch, 7}), y = torch::randn({kBatch, 3});
  torch::manual_seed(0);
  auto ref = std::make_shared<SharedImpl>();
  torch::optim::Adam ref_opt(unique_tensors(*ref), torch::optim::AdamOptions(1e-2));
  const auto want = train_in_one_process(*ref, ref_opt, 3, [&] { return torch::mse_loss(ref->forward(x), y); });
  for (Strategy s : {Strategy::FullShard, Strategy::ShardGradOp, Strategy::NoShard, Strategy::HybridShard}) {
    auto r = run_ranks(2, [&](World& w) {
      torch::manual_seed(0);
      auto model = std::make_shared<SharedImpl>();
      auto sm = shardtorch::shard(*model, w, strategy_options(s, 2));
      if (s != Strategy::NoShard)
        require(sm.units().size() == 2, std::to_string(sm.units().size()) + " units, expected block and head");
      auto opt = shardtorch::Adam(*model, torch::optim::AdamOptions(1e-2));
      const int64_t per = kBatch / 2;
      auto xs = x.narrow(0, w.rank() * per, per), ys = y.narrow(0, w.rank() * per, per);
      for (int k = 0; k < 3; ++k) {
        opt->zero_grad();
        torch::mse_loss(model->forward(xs), ys).backward();
        opt->step();
      }
      shardtorch::FullParams full(*model);
      expect_close_map(snapshot(*model), want, 1e-5, "a unit registered twice");
    });
    ASSERT_TRUE(r.ok) << shardtorch::strategy_name(s) << ": " << r.summary();
  }
}

// Inside summon_full_params(with_grads) param.grad are the reduced
// gradients; a backward there added to them and reduced both again (the old
// gradients counted twice). It is refused on every rank, and training after
// the scope is what it would have been without the attempt, bitwise.
TEST(Units, ABackwardInsideSummonWithGradsIsRefusedAndChangesNothing) {
  for (Strategy s : {Strategy::FullShard, Strategy::ShardGradOp, Strategy::NoShard}) {
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
    ASSERT_TRUE(r.ok) << shardtorch::strategy_name(s) << ": " << r.summary();
  }
}

// Under every sharded strategy (ZeRO-1/2 keep their full parameters between
// steps, offloaded or not): edits in a summon scope reach the shards with
// writeback and are discarded without it, in the full parameters forward
// computes with too; edits that differ by rank, written back, leave every
// rank computing with the same values. (Under ZeRO-1/2 an edit without
// writeback used to stay in the full parameters until the next step, and
// per-rank edits left the ranks computing with different ones.)
TEST(Units, SummonWritesEditsBackIntoTheShards) {
  struct Case {
    Strategy s;
    bool offload;
  };
  for (const Case c : {Case{Strategy::FullShard, false}, Case{Strategy::ShardGradOp, false},
                       Case{Strategy::OptimizerOnly, false}, Case{Strategy::HybridShard, false},
                       Case{Strategy::ShardGradOp, true}}) {
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
}

// Outside its forward and backward a FullShard unit's parameters have no
// memory. Touching their data is a c10::Error that names the rank, the unit
// and the parameters, not a read through a null pointer; the failed access
// changes nothing, and the next forward and a summon see the right values.
TEST(Units, ReadingAFreedParameterIsAClearErrorAndChangesNothing) {
  ASSERT_TRUE(shardtorch::FlatParam::freed_access_is_an_error())
      << "this LibTorch cannot mark a freed storage: a freed parameter's read would crash";
  torch::manual_seed(0);
  auto ref = MLP();
  auto want = ref->l1->lin->weight.detach().clone();
  auto x = torch::randn({4, 7});
  auto want_out = ref->forward(x).detach();
  auto r = run_ranks(2, [&](World& w) {
    torch::manual_seed(0);
    auto m = MLP();
    shardtorch::shard(m, w);
    auto expect_error = [&](const char* what, const std::function<void()>& f) {
      try {
        f();
      } catch (const std::exception& e) {
        std::string msg = e.what();
        for (const std::string& part : {"rank " + std::to_string(w.rank()) + ": unit 'l1' is sharded",
                                        std::string("'l1.lin.weight' [13, 7], 'l1.lin.bias' [13]"),
                                        std::string("FullParams")}) {
          require(msg.find(part) != std::string::npos, std::string(what) + ": message lacks '" + part + "': " + msg);
        }
        return;
      }
      require(false, std::string(what) + " of a freed parameter did not throw");
    };
    expect_error("sum", [&] { (void)m->l1->lin->weight.sum(); });
    expect_error("matmul with a view", [&] { (void)torch::matmul(x, m->l1->lin->weight.t()); });
    expect_error("item", [&] { (void)m->l1->lin->bias[0].item<float>(); });
    expect_error("copy into", [&] {
      torch::NoGradGuard g;
      m->l1->lin->weight.copy_(torch::zeros({13, 7}));
    });
    auto out = m->forward(x);  // gathers: the error is gone while the unit computes
    require(at::allclose(out, want_out, 1e-6, 1e-6), "forward after a refused read differs from the unsharded one");
    out.sum().backward();
    expect_error("sum after backward", [&] { (void)m->l1->lin->weight.sum(); });
    shardtorch::FullParams full(*m);
    require(at::equal(m->l1->lin->weight, want), "summon after a refused write sees a changed weight");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// LibTorch 2.11 sets a storage's data-access error but cannot lift it; the
// library then lowers LibTorch's private flag itself (src/storage_access.cpp).
// That path runs here whatever this LibTorch offers, so that it is tested on a
// LibTorch that lifts the error itself too.
TEST(FreedStorage, LiftingTheAccessErrorThroughItsFlagRestoresReadsAndWrites) {
  namespace sa = shardtorch::storage_access;
  if (!sa::testing::can_lift_through_flag()) GTEST_SKIP() << "LibTorch " << TORCH_VERSION << ": the flag lift is compiled for 2.11 to 2.13 only";
  ASSERT_NE(sa::support(), sa::Support::None) << sa::describe(sa::support());
  auto t = at::arange(6, at::kFloat);
  auto view = t.narrow(0, 2, 3);
  auto* impl = t.storage().unsafeGetStorageImpl();
  auto expect_error = [](const std::string& want, const std::function<void()>& f) {
    try {
      f();
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
      return;
    }
    ADD_FAILURE() << "no error; wanted '" << want << "'";
  };
  ASSERT_TRUE(sa::forbid(impl, "storage gone"));
  expect_error("storage gone", [&] { (void)view.sum(); });
  expect_error("storage gone", [&] { t.add_(1); });
  sa::testing::lift_through_flag(impl);
  EXPECT_EQ(view.sum().item<float>(), 9.0f);  // 2 + 3 + 4: the data was kept
  t.add_(1);
  EXPECT_EQ(t.sum().item<float>(), 21.0f);
  ASSERT_TRUE(sa::forbid(impl, "gone again"));  // a second error names itself, not the first
  expect_error("gone again", [&] { (void)t.sum(); });
  sa::allow(impl);  // whichever lift this LibTorch uses in the library
  EXPECT_EQ(t.sum().item<float>(), 21.0f);
}

// Under ZeRO-1/2 and NoShard the parameters stay whole: reading them outside
// forward is allowed and exact.
TEST(Units, PersistentStrategiesKeepParametersReadable) {
  torch::manual_seed(0);
  auto want = MLP()->l1->lin->weight.detach().clone();
  for (auto strategy : {shardtorch::Strategy::ShardGradOp, shardtorch::Strategy::OptimizerOnly,
                        shardtorch::Strategy::NoShard}) {
    auto r = run_ranks(2, [&](World& w) {
      torch::manual_seed(0);
      auto m = MLP();
      shardtorch::shard(m, w, shardtorch::ShardOptions().strategy(strategy));
      require(at::equal(m->l1->lin->weight, want), "the parameter outside forward differs from the unsharded one");
    });
    ASSERT_TRUE(r.ok) << r.summary();
  }
}

// A unit whose parameter gets no gradient this step (an unused branch) must
// not hang the step: it is reduced as zero at the end of backward.
struct BranchyImpl : torch::nn::Module {
  BranchyImpl() : used(register_module("used", torch::nn::Linear(4, 4))), unused(register_module("unused", torch::nn::Linear(4, 4))) {}
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

TEST(Units, UnusedParametersDoNotHangAndGetZeroGradients) {
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

/// A unit that returns its own parameter (a learned scale), kept gathered
/// after forward so the caller can use it.
struct ScaleImpl : torch::nn::Module {
  ScaleImpl() { s = register_parameter("s", torch::full({5}, 1.5)); }
  torch::Tensor forward(torch::Tensor) { return s; }
  torch::Tensor s;
};
SHARDTORCH_MODULE(Scale);

struct ScaledImpl : torch::nn::Module {
  ScaledImpl() : a(register_module("a", Layer(7, 5, true))), scale(register_module("scale", Scale())) {}
  torch::Tensor forward(torch::Tensor x) { return a(x) * scale(x); }
  Layer a;
  Scale scale;
};
SHARDTORCH_MODULE(Scaled);

// Its output is a copy, not the parameter: the unit's backward hook sits on
// the copy's node, so the parameter collects no hook per forward (it used to
// get one more at every step).
TEST(Units, AUnitReturningItsOwnParameterHooksNothingOnItAndTrainsLikeTorch) {
  torch::manual_seed(5);
  auto x = torch::randn({4, 7});
  torch::manual_seed(0);
  auto ref = Scaled();
  torch::optim::SGD ref_opt(unique_tensors(*ref), torch::optim::SGDOptions(0.1));
  constexpr int kSteps = 3;
  auto want = train_in_one_process(*ref, ref_opt, kSteps, [&] { return ref(x).pow(2).sum(); });
  for (auto s : kAllStrategies) {
    auto r = run_ranks(2, [&](World& w) {
      torch::manual_seed(0);
      auto m = Scaled();
      shardtorch::shard(m, w, strategy_options(s, 2).reshard_after_forward_for("scale", false));
      auto opt = shardtorch::SGD(*m, torch::optim::SGDOptions(0.1));
      const size_t hooks = torch::autograd::impl::hooks(m->scale->s).size();
      for (int step = 0; step < kSteps; ++step) {
        opt->zero_grad();
        (m(x.narrow(0, 2 * w.rank(), 2)).pow(2).sum() * w.size()).backward();
        opt->step();
        require(torch::autograd::impl::hooks(m->scale->s).size() == hooks,
                "the parameter has " + std::to_string(torch::autograd::impl::hooks(m->scale->s).size()) +
                    " hooks after step " + std::to_string(step) + ", " + std::to_string(hooks) + " before");
      }
      expect_close_map(shardtorch::full_parameters(*m), want, 1e-5, "a unit returning its parameter");
    });
    ASSERT_TRUE(r.ok) << shardtorch::strategy_name(s) << ": " << r.summary();
  }
}

TEST(Units, TwoBackwardsBeforeAStepAccumulateLikeTorch) {
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

TEST(Units, EvalForwardUnderNoGradFreesEveryUnit) {
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

TEST(Headers, PublicHeadersDoNotIncludeTorchTorchH) {
  // Compile time matters: the public headers include ATen and torch/nn pieces only.
  int seen = 0;
  std::function<void(const std::string&)> walk = [&](const std::string& dir) {
    for (const auto& name : files::list_directory(dir)) {
      const std::string path = files::join(dir, name);
      if (files::is_directory(path)) walk(path);
      if (!files::is_regular_file(path) || name.size() < 2 || name.substr(name.size() - 2) != ".h") continue;
      ++seen;
      std::ifstream in(path);
      std::string line;
      while (std::getline(in, line)) EXPECT_EQ(line.find("torch/torch.h"), std::string::npos) << path << ": " << line;
    }
  };
  walk(std::string(SHARDTORCH_SOURCE_DIR) + "/include");
  EXPECT_GE(seen, 15) << "public headers not found";
}

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

// Without prefetch a repeated unit is gathered for each of its forwards and
// once in backward; with it (docs/design.md, "Prefetch") it stays gathered
// between its two forwards in a row, the head stays gathered into backward,
// and backward prefetches along the learned order without gathering a unit
// it has already finished: two all-gathers fewer per step once the order is
// learned.
TEST(Units, AUnitCalledSeveralTimesInOneForwardTrainsLikeTorch) {
  torch::manual_seed(5);
  auto xa = torch::randn({4, 7}), xb = torch::randn({4, 7});
  torch::manual_seed(0);
  auto ref = Siamese();
  torch::optim::SGD ref_opt(unique_tensors(*ref), torch::optim::SGDOptions(0.1));
  constexpr int kSteps = 3;
  auto want = train_in_one_process(*ref, ref_opt, kSteps, [&] { return ref(xa, xb).pow(2).sum(); });
  for (auto s : kAllStrategies) {
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
      require(on.gathers == off.gathers - 2 * (kSteps - 1),
              "with prefetch: " + std::to_string(on.gathers) + " all-gathers, " + std::to_string(off.gathers) + " without");
      require(on.peak_units <= 3, "with prefetch at most 3 units gathered, saw " + std::to_string(on.peak_units));
    });
    ASSERT_TRUE(r.ok) << shardtorch::strategy_name(s) << ": " << r.summary();
  }
}

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
TEST(Units, PrefetchFollowsBackwardThroughRepeatedUnitsOfATwoTowerModel) {
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
TEST(Units, PrefetchLooksPastARunOfTheSameUnitInBackward) {
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
TEST(Units, BackwardPrefetchSkipsAUnitThatHasReducedInThisBackward) {
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

/// A root that is not a unit: shard() makes units of its layers only.
struct PlainRoot : torch::nn::Module {
  PlainRoot()
      : l1(register_module("l1", Layer(7, 5, true))),
        l2(register_module("l2", Layer(5, 5, true))),
        l3(register_module("l3", Layer(5, 3, false))) {}
  torch::Tensor forward(torch::Tensor x) { return l3(l2(l1(x))); }
  Layer l1, l2, l3;
};

// Under a root that is not a unit nothing marks where a forward starts, so
// forwards in grad mode without a backward (an evaluation that forgot
// NoGradGuard) ran into the next training forward's recorded order: the two
// steps after them lost prefetch. zero_grad ends the recording: the steps
// after the evaluation gather as many times as the steps before it.
TEST(Units, ForwardsWithoutABackwardDoNotDisturbPrefetchUnderAPlainRoot) {
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
TEST(Units, ZeroGradBetweenForwardAndBackwardKeepsPrefetchUnderAPlainRoot) {
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

// Gradients of gradients (docs/design.md). The tests below train a model
// (seed 0, SGD lr 0.1, 3 steps) in one process and then on 2 ranks under every
// strategy, and compare the parameters.
template <class Model, class Step>
std::map<std::string, torch::Tensor> train_reference(Step step) {
  torch::manual_seed(0);
  Model ref;
  torch::optim::SGD opt(unique_tensors(*ref), torch::optim::SGDOptions(0.1));
  for (int s = 0; s < 3; ++s) {
    opt.zero_grad();
    step(ref);
    opt.step();
  }
  return snapshot(*ref);
}

/// `step(model, sharded, world)` runs one step's forwards and backwards; the
/// optimizer step follows, after which no unit may be gathered.
template <class Model, class Step>
void expect_every_strategy_trains_like(const std::map<std::string, torch::Tensor>& want, const std::string& what,
                                       Step step) {
  for (auto s : kAllStrategies) {
    auto r = run_ranks(2, [&](World& w) {
      torch::manual_seed(0);
      Model m;
      auto sm = shardtorch::shard(m, w, strategy_options(s, 2));
      auto opt = shardtorch::SGD(*m, torch::optim::SGDOptions(0.1));
      for (int i = 0; i < 3; ++i) {
        opt->zero_grad();
        step(m, sm, w);
        opt->step();
        require(sm.memory().gathered_units == 0, "units (held for a graph?) still gathered after the step");
      }
      shardtorch::FullParams full(*m);
      expect_close_map(snapshot(*m), want, 1e-5, what);
    });
    ASSERT_TRUE(r.ok) << shardtorch::strategy_name(s) << ": " << r.summary();
  }
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
TEST(Units, AForwardThatThrowsGivesItsUnitsBackAndTheRetryTrainsLikeTorch) {
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
      expect_close_map(snapshot(*m), want, 1e-5, ckpt ? "checkpointed, after a failed forward" : "after a failed forward");
    });
    ASSERT_TRUE(r.ok) << (ckpt ? "checkpointed: " : "") << r.summary();
  }
}

// A backward run inside another one (a hook that backpropagates an auxiliary
// loss, a checkpoint function of the user's own) was taken for the trace of a
// failed backward: the outer backward's reductions were dropped with a
// warning that an exception had escaped, and the step went on with wrong
// gradients. It is refused on every rank, naming it; a backward after one
// that failed is still taken for that; after zero_grad the model trains like
// torch.
TEST(Units, ABackwardNestedInAnotherIsRefusedAndTrainingGoesOn) {
  torch::manual_seed(4);
  auto x = torch::randn({kBatch, 7}), y = torch::randn({kBatch, 3});
  torch::manual_seed(0);
  auto ref = std::make_shared<PlainRoot>();
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1));
  const auto want = train_in_one_process(*ref, ref_opt, 2, [&] { return torch::mse_loss(ref->forward(x), y); });
  for (Strategy s : {Strategy::FullShard, Strategy::NoShard}) {
    auto r = run_ranks(2, [&](World& w) {
      torch::manual_seed(0);
      auto m = std::make_shared<PlainRoot>();
      shardtorch::shard(*m, w, strategy_options(s, 2));
      auto opt = shardtorch::SGD(*m, torch::optim::SGDOptions(0.1));
      {
        auto aux = m->forward(torch::randn({2, 7})).sum();
        auto h = m->l1(torch::randn({2, 7}));
        // Reached after the outer backward has taken l3's and l2's gradients.
        h.register_hook([&](const torch::Tensor& g) {
          aux.backward();
          return g;
        });
        std::string error;
        try {
          m->l3(m->l2(h)).sum().backward();
        } catch (const std::exception& e) {
          error = e.what();
        }
        require(error.find("rank " + std::to_string(w.rank()) + ": a backward inside another backward") !=
                    std::string::npos,
                "the nested backward was not refused: " + error);
      }
      {
        // A backward that failed is told from one still running: the backward
        // right after it (on a retained graph) is not refused as nested.
        bool fail = true;
        auto h = m->l1(torch::randn({2, 7}));
        h.register_hook([&](const torch::Tensor& g) {
          if (fail) throw std::runtime_error("hook failed");
          return g;
        });
        auto loss = m->l3(m->l2(h)).sum();
        try {
          loss.backward({}, /*retain_graph=*/true);
          throw std::logic_error("the hook did not throw");
        } catch (const std::runtime_error& e) {
          require(std::string(e.what()).find("hook failed") != std::string::npos, e.what());
        }
        fail = false;
        loss.backward();
      }
      const int64_t per = kBatch / 2;
      auto xs = x.narrow(0, w.rank() * per, per), ys = y.narrow(0, w.rank() * per, per);
      for (int k = 0; k < 2; ++k) {
        opt->zero_grad();
        torch::mse_loss(m->forward(xs), ys).backward();
        opt->step();
      }
      shardtorch::FullParams full(*m);
      expect_close_map(snapshot(*m), want, 1e-5, "after a refused nested backward");
    });
    ASSERT_TRUE(r.ok) << shardtorch::strategy_name(s) << ": " << r.summary();
  }
}

// A unit keeping an auxiliary term of a parameter of its own (a router's
// load-balancing sum), backpropagated by a hook while the outer backward
// runs: the nested backward reaches the parameter's accumulator before any
// unit output, and is refused there. The gradient autograd had just
// accumulated into param.grad stayed, and the next backward added it to its
// own (a silently wrong step).
struct GatedImpl : torch::nn::Module {
  GatedImpl() : lin(register_module("lin", torch::nn::Linear(5, 5))) {
    gate = register_parameter("gate", torch::full({5}, 0.5));
  }
  torch::Tensor forward(torch::Tensor x) {
    aux = gate.sum() * 0.1;  // reads no full parameter in backward
    return lin(x) * gate;
  }
  torch::nn::Linear lin;
  torch::Tensor gate, aux;
};
SHARDTORCH_MODULE(Gated);

struct GatedNet : torch::nn::Module {
  GatedNet() : l1(register_module("l1", Layer(7, 5, true))), g(register_module("g", Gated())) {}
  torch::Tensor forward(torch::Tensor x) { return g(l1(x)); }
  Layer l1;
  Gated g;
};

TEST(Units, ARefusedNestedBackwardLeavesNoGradientForTheNextStep) {
  torch::manual_seed(4);
  auto x = torch::randn({kBatch, 7}), y = torch::randn({kBatch, 5});
  torch::manual_seed(0);
  auto ref = std::make_shared<GatedNet>();
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1));
  const auto want = train_in_one_process(*ref, ref_opt, 2, [&] { return torch::mse_loss(ref->forward(x), y); });
  for (Strategy s : {Strategy::FullShard, Strategy::NoShard}) {
    auto r = run_ranks(2, [&](World& w) {
      torch::manual_seed(0);
      auto m = std::make_shared<GatedNet>();
      shardtorch::shard(*m, w, strategy_options(s, 2));
      auto opt = shardtorch::SGD(*m, torch::optim::SGDOptions(0.1));
      const int64_t per = kBatch / 2;
      auto xs = x.narrow(0, w.rank() * per, per), ys = y.narrow(0, w.rank() * per, per);
      {
        auto h = m->l1(xs);
        auto out = m->g(h);
        auto aux = m->g->aux;
        h.register_hook([&](const torch::Tensor& g) {  // after the outer backward has taken g's gradients
          aux.backward();
          return g;
        });
        std::string error;
        try {
          torch::mse_loss(out, ys).backward();
        } catch (const std::exception& e) {
          error = e.what();
        }
        require(error.find("rank " + std::to_string(w.rank()) + ": a backward inside another backward") !=
                    std::string::npos,
                "the nested backward was not refused: " + error);
      }
      for (int k = 0; k < 2; ++k) {
        opt->zero_grad();
        torch::mse_loss(m->forward(xs), ys).backward();
        opt->step();
      }
      shardtorch::FullParams full(*m);
      expect_close_map(snapshot(*m), want, 1e-5, "after a nested backward refused at an accumulator");
    });
    ASSERT_TRUE(r.ok) << shardtorch::strategy_name(s) << ": " << r.summary();
  }
}

// The root unit's own forward fails after its blocks have run (the LM head
// running out of memory). With prefetch, post-forward had kept the last block
// gathered for the backward; the root's failure frees it, so the retry starts
// with only the root gathered, as after any forward of the root.
struct FailingRootImpl : torch::nn::Module {
  FailingRootImpl()
      : l1(register_module("l1", Layer(7, 5, true))),
        l2(register_module("l2", Layer(5, 5, true))),
        head(register_module("head", torch::nn::Linear(5, 3))) {}
  torch::Tensor forward(torch::Tensor x) {
    auto h = l2(l1(x));
    if (fail) throw std::runtime_error("out of memory in the head (simulated)");
    return head(h);
  }
  Layer l1, l2;
  torch::nn::Linear head;
  bool fail = false;
};
SHARDTORCH_MODULE(FailingRoot);

TEST(Units, AFailedForwardOfTheRootFreesTheBlockKeptForBackward) {
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

// The full gradients a with_grads scope puts in param.grad are memory the
// library holds: counted under summoned_grads while the scope lives, each
// storage once (a unit's gradients share its full gradient when the dtypes
// agree), and given back on exit.
TEST(Units, SummonedGradientsAreCountedWhileTheScopeLives) {
  for (Strategy s : {Strategy::FullShard, Strategy::NoShard}) {
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
      ASSERT_TRUE(r.ok) << shardtorch::strategy_name(s) << (bf16 ? " bf16" : "") << ": " << r.summary();
    }
  }
}

// A gradient penalty differentiates the output with respect to the input
// with create_graph, then backward() runs through the graph that built,
// which saved the units' full parameters. The grad call reduces nothing.
TEST(Units, AGradientPenaltyTrainsLikeTorchUnderEveryStrategy) {
  torch::manual_seed(5);
  auto x = torch::randn({4, 7});
  auto penalised = [](MLP& m, const torch::Tensor& xs, const std::function<void()>& between) {
    auto xi = xs.clone().requires_grad_(true);
    auto out = m(xi);
    auto g = torch::autograd::grad({out.sum()}, {xi}, {}, /*retain_graph=*/true, /*create_graph=*/true)[0];
    between();
    return out.square().mean() + (g.norm() - 1).square();
  };
  auto want = train_reference<MLP>([&](MLP& ref) {
    for (int r = 0; r < 2; ++r) (penalised(ref, x.narrow(0, 2 * r, 2), [] {}) / 2).backward();
  });
  expect_every_strategy_trains_like<MLP>(want, "gradient penalty", [&](MLP& m, shardtorch::ShardedModel& sm, World& w) {
    const auto before = sm.comm_stats();
    auto loss = penalised(m, x.narrow(0, 2 * w.rank(), 2), [&] {
      const auto now = sm.comm_stats();
      require(now.reduce_scatter.calls == before.reduce_scatter.calls && now.all_reduce.calls == before.all_reduce.calls,
              "autograd::grad with respect to the input reduced gradients");
    });
    loss.backward();
  });
}

// Higher-order gradients of parameters (backward with create_graph) are a
// clear error, not gradients that silently lose their graph.
TEST(Units, ABackwardWithCreateGraphReachingParametersIsAClearError) {
  for (auto s : {shardtorch::Strategy::FullShard, shardtorch::Strategy::NoShard}) {
    auto r = run_ranks(2, [&](World& w) {
      torch::manual_seed(0);
      auto m = MLP();
      shardtorch::shard(m, w, strategy_options(s, 2));
      std::string error;
      try {
        m(torch::randn({2, 7})).square().sum().backward({}, /*retain_graph=*/true, /*create_graph=*/true);
      } catch (const std::exception& e) {
        error = e.what();
      }
      require(error.find("rank " + std::to_string(w.rank())) != std::string::npos &&
                  error.find("arrived in a backward with create_graph") != std::string::npos &&
                  error.find("l3.lin.") != std::string::npos,
              "expected the create_graph error naming the rank and the parameter, got: " + error.substr(0, 300));
    });
    ASSERT_TRUE(r.ok) << shardtorch::strategy_name(s) << ": " << r.summary();
  }
}

// A backward with create_graph that no backward follows (an input-gradient
// diagnostic after the training backward): the optimizer step releases the
// units it held, whose full copies the update made stale, so the next
// forward gathers the new parameters.
TEST(Units, UnitsHeldForAGraphAreReleasedByTheStep) {
  torch::manual_seed(5);
  auto x = torch::randn({4, 7});
  auto diagnose = [](MLP& m, const torch::Tensor& xs) {
    auto xi = xs.clone().requires_grad_(true);
    return torch::autograd::grad({m(xi).sum()}, {xi}, {}, true, /*create_graph=*/true)[0].norm();
  };
  auto want = train_reference<MLP>([&](MLP& ref) {
    ref(x).square().mean().backward();
    diagnose(ref, x);
  });
  expect_every_strategy_trains_like<MLP>(want, "a create_graph diagnostic before each step",
                                         [&](MLP& m, shardtorch::ShardedModel&, World& w) {
                                           const auto xs = x.narrow(0, 2 * w.rank(), 2);
                                           m(xs).square().mean().backward();
                                           diagnose(m, xs);
                                         });
}

// Two micro-batches' penalties are built before either is differentiated, and
// the root's own parameters lie on the penalty's path where no hook of the
// root fires (the gradient starts from a tensor inside the model): every unit
// still gathered when the graph-building backward ends is held until the step.
struct PenaltyNetImpl : torch::nn::Module {
  PenaltyNetImpl()
      : pre(register_module("pre", torch::nn::Linear(7, 6))),
        body(register_module("body", Layer(6, 5, true))),
        post(register_module("post", torch::nn::Linear(5, 2))) {}
  torch::Tensor forward(torch::Tensor x) {
    hidden = body(pre(x));
    return post(hidden);
  }
  torch::nn::Linear pre;
  Layer body;
  torch::nn::Linear post;
  torch::Tensor hidden;  // the body's output of the last forward
};
SHARDTORCH_MODULE(PenaltyNet);

TEST(Units, PenaltyGraphsBuiltAheadAndThroughTheRootTrainLikeTorch) {
  torch::manual_seed(5);
  auto x = torch::randn({4, 7});
  // The penalty only: its backward reaches the root's `pre` through the graph
  // autograd::grad built, never through a hook on the root's output.
  auto penalty = [](PenaltyNet& m, const torch::Tensor& row) {
    auto xi = row.clone().requires_grad_(true);
    m(xi);
    auto g = torch::autograd::grad({m->hidden.sum()}, {xi}, {}, true, /*create_graph=*/true)[0];
    return (g.norm() - 1).square() + m->hidden.square().mean();
  };
  auto want = train_reference<PenaltyNet>([&](PenaltyNet& ref) {
    for (int r = 0; r < 4; ++r) (penalty(ref, x.narrow(0, r, 1)) / 4).backward();
  });
  expect_every_strategy_trains_like<PenaltyNet>(
      want, "penalties built ahead, through the root", [&](PenaltyNet& m, shardtorch::ShardedModel&, World& w) {
        auto first = penalty(m, x.narrow(0, 2 * w.rank(), 1));
        auto second = penalty(m, x.narrow(0, 2 * w.rank() + 1, 1));
        (first / 2).backward();
        (second / 2).backward();
      });
}

// A gradient penalty through a unit whose parameters are all frozen (a
// frozen feature network between trainable layers, as in GAN R1 penalties
// through a pretrained extractor): autograd::grad with create_graph reaches
// the frozen unit's input, whose hook freed the unit, and the graph it built
// reads the frozen weights again in the second backward ("unit 'mid' is
// sharded"). In a graph-building backward nothing is freed early: the units
// still gathered at its end are held until the step.
struct FrozenMidImpl : torch::nn::Module {
  FrozenMidImpl()
      : first(register_module("first", Layer(7, 6, true))),
        mid(register_module("mid", Layer(6, 6, true))),
        last(register_module("last", Layer(6, 3, false))) {
    for (auto& p : mid->parameters()) p.requires_grad_(false);
  }
  torch::Tensor forward(torch::Tensor x) { return last(mid(first(x))); }
  Layer first, mid, last;
};
SHARDTORCH_MODULE(FrozenMid);

TEST(Units, AGradientPenaltyThroughAFrozenUnitTrainsLikeTorch) {
  torch::manual_seed(5);
  auto x = torch::randn({4, 7});
  auto penalised = [](FrozenMid& m, const torch::Tensor& xs) {
    auto xi = xs.clone().requires_grad_(true);
    auto out = m(xi);
    auto g = torch::autograd::grad({out.sum()}, {xi}, {}, /*retain_graph=*/true, /*create_graph=*/true)[0];
    return out.square().mean() + (g.norm() - 1).square();
  };
  auto want = train_reference<FrozenMid>([&](FrozenMid& ref) {
    for (int r = 0; r < 2; ++r) (penalised(ref, x.narrow(0, 2 * r, 2)) / 2).backward();
  });
  expect_every_strategy_trains_like<FrozenMid>(want, "a penalty through a frozen unit",
                                               [&](FrozenMid& m, shardtorch::ShardedModel&, World& w) {
                                                 penalised(m, x.narrow(0, 2 * w.rank(), 2)).backward();
                                               });
}

// Training with a parameter of no elements; test_checkpoint.cpp takes it
// through clipping, summoning and checkpoints.
TEST(Units, AnEmptyParameterTrainsLikeTorchUnderEveryStrategy) {
  torch::manual_seed(5);
  auto x = torch::randn({4, 7});
  auto want = train_reference<WithEmpty>([&](WithEmpty& ref) { ref(x).square().sum().backward(); });
  expect_every_strategy_trains_like<WithEmpty>(want, "empty parameter", [&](WithEmpty& m, shardtorch::ShardedModel&, World& w) {
    (m(x.narrow(0, 2 * w.rank(), 2)).square().sum() * 2).backward();
  });
}

// A unit whose only trainable parameter is empty (next to frozen ones) has an
// empty trainable flat parameter: nothing to reduce (it used to reach the
// bucketer with a zero-width piece and fail on an unallocated bucket).
TEST(Units, AUnitWhoseOnlyTrainableParameterIsEmptyTrainsLikeTorch) {
  torch::manual_seed(5);
  auto x = torch::randn({4, 7});
  auto want = train_reference<OnlyEmptyTrains>([&](OnlyEmptyTrains& ref) { ref(x).square().sum().backward(); });
  expect_every_strategy_trains_like<OnlyEmptyTrains>(
      want, "empty trainable flat", [&](OnlyEmptyTrains& m, shardtorch::ShardedModel& sm, World& w) {
        (m(x.narrow(0, 2 * w.rank(), 2)).square().sum() * 2).backward();
        require(sm.memory().cur(Mem::GradStaging) == 0, "staged gradients left after backward");
      });
  // Offloaded, unbucketed, and with two replica groups.
  const std::pair<shardtorch::ShardOptions, int> more[] = {
      {strategy_options(shardtorch::Strategy::FullShard, 2).cpu_offload(true), 2},
      {strategy_options(shardtorch::Strategy::ShardGradOp, 2).bucket_mb(0), 2},
      {strategy_options(shardtorch::Strategy::HybridShard, 4), 4}};
  for (const auto& [options, world] : more) {
    auto r = run_ranks(world, [&](World& w) {
      torch::manual_seed(0);
      OnlyEmptyTrains m;
      shardtorch::shard(m, w, options);
      auto opt = shardtorch::SGD(*m, torch::optim::SGDOptions(0.1));
      const int64_t rows = 4 / world;
      for (int i = 0; i < 3; ++i) {
        opt->zero_grad();
        (m(x.narrow(0, rows * w.rank(), rows)).square().sum() * world).backward();
        opt->step();
      }
      shardtorch::FullParams full(*m);
      expect_close_map(snapshot(*m), want, 1e-5, "empty trainable flat");
    });
    ASSERT_TRUE(r.ok) << shardtorch::strategy_name(options.strategy()) << " at " << world << ": " << r.summary();
  }
}

// Frozen integer and bool parameters (an index table, a mask) share a unit
// with trainable ones: they get flat parameters of their own dtypes, are
// gathered and freed like the others, and mixed precision leaves them as
// they are.
struct IndexingLayerImpl : torch::nn::Module {
  IndexingLayerImpl() : lin(register_module("lin", torch::nn::Linear(5, 3))) {
    order = register_parameter("order", torch::tensor({2, 0, 1}, torch::kLong), /*requires_grad=*/false);
    mask = register_parameter("mask", torch::tensor({true, false, true}), /*requires_grad=*/false);
  }
  torch::Tensor forward(torch::Tensor x) { return lin(x).index_select(1, order) * mask; }
  torch::nn::Linear lin;
  torch::Tensor order, mask;
};
SHARDTORCH_MODULE(IndexingLayer);

using WithIndexingImpl = LayerThenImpl<IndexingLayer>;
SHARDTORCH_MODULE(WithIndexing);

TEST(Units, IntegerAndBoolParametersTrainLikeTorchUnderEveryStrategy) {
  torch::manual_seed(5);
  auto x = torch::randn({4, 7});
  auto want = train_reference<WithIndexing>([&](WithIndexing& ref) { ref(x).square().sum().backward(); });
  require(want.at("b.lin.weight").select(0, 1).abs().sum().item<double>() > 0, "the masked row should still train");
  expect_every_strategy_trains_like<WithIndexing>(want, "integer parameters",
                                                  [&](WithIndexing& m, shardtorch::ShardedModel&, World& w) {
                                                    (m(x.narrow(0, 2 * w.rank(), 2)).square().sum() * 2).backward();
                                                  });
  for (auto s : kAllStrategies) {
    auto r = run_ranks(2, [&](World& w) {
      WithIndexing m;
      shardtorch::shard(m, w, strategy_options(s, 2).mixed_precision(
                                  shardtorch::MixedPrecision().param_dtype(at::kBFloat16)));
      auto out = m(x);
      require(out.scalar_type() == at::kBFloat16, "expected a bf16 output");
      out.sum().backward();
      shardtorch::FullParams full(*m);
      require(m->b->order.scalar_type() == at::kLong && at::equal(m->b->order, torch::tensor({2, 0, 1}, torch::kLong)),
              "the index parameter changed under mixed precision");
      require(m->b->mask.scalar_type() == at::kBool && at::equal(m->b->mask, torch::tensor({true, false, true})),
              "the mask parameter changed under mixed precision");
    });
    ASSERT_TRUE(r.ok) << shardtorch::strategy_name(s) << " + bf16: " << r.summary();
  }
}
