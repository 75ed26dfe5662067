// Parameters outside forward and backward: a FullShard unit's have no memory
// and touching them is a clear error; the other strategies keep them whole.
#include <gtest/gtest.h>
#include <torch/version.h>

#include "../src/runtime/flat_param.h"
#include "../src/base/storage_access.h"
#include "models.h"

using namespace testmodels;
using shardtorch::Mem;
using shardtorch::Strategy;
using shardtorch::World;
using shardtorch::testing::run_ranks;

// Outside its forward and backward a FullShard unit's parameters have no
// memory. Touching their data is a c10::Error that names the rank, the unit
// and the parameters, not a read through a null pointer; the failed access
// changes nothing, and the next forward and a summon see the right values.
TEST(FreedParameters, ReadingAFreedParameterIsAClearErrorAndChangesNothing) {
  ASSERT_TRUE(shardtorch::FullBuffer::freed_access_is_an_error())
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
        for (const std::string& part :
             {"rank " + std::to_string(w.rank()) + ": unit 'l1' is sharded",
              std::string("'l1.lin.weight' [13, 7], 'l1.lin.bias' [13]"), std::string("FullParams")}) {
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
// library then lowers LibTorch's private flag itself (src/base/storage_access.cpp).
// That path runs here whatever this LibTorch offers, so that it is tested on a
// LibTorch that lifts the error itself too.
TEST(FreedStorage, LiftingTheAccessErrorThroughItsFlagRestoresReadsAndWrites) {
  namespace sa = shardtorch::storage_access;
  if (!sa::testing::can_lift_through_flag())
    GTEST_SKIP() << "LibTorch " << TORCH_VERSION << ": the flag lift is compiled for 2.11 to 2.13 only";
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
class Persistent : public ::testing::TestWithParam<Strategy> {};

TEST_P(Persistent, PersistentStrategiesKeepParametersReadable) {
  const Strategy strategy = GetParam();
  torch::manual_seed(0);
  auto want = MLP()->l1->lin->weight.detach().clone();
  auto r = run_ranks(2, [&](World& w) {
    torch::manual_seed(0);
    auto m = MLP();
    shardtorch::shard(m, w, shardtorch::ShardOptions().strategy(strategy));
    require(at::equal(m->l1->lin->weight, want), "the parameter outside forward differs from the unsharded one");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

INSTANTIATE_TEST_SUITE_P(FreedParameters, Persistent,
                         ::testing::Values(Strategy::ShardGradOp, Strategy::OptimizerOnly, Strategy::NoShard),
                         StrategyName());
