// Bad input and faults: differing models, misuse, dead and stuck ranks.
#include <gtest/gtest.h>

#include <csignal>
#include <thread>

#include "models.h"

using namespace testmodels;
using shardtorch::World;
using shardtorch::testing::run_ranks;

namespace {
// Every rank must fail with a message containing all of `needles`.
void expect_all_fail_with(const shardtorch::testing::RunResult& r, std::vector<std::string> needles) {
  ASSERT_FALSE(r.ok);
  for (size_t k = 0; k < r.ranks.size(); ++k) {
    EXPECT_EQ(r.ranks[k].exit_code, 1) << r.summary();
    for (const auto& n : needles) EXPECT_NE(r.ranks[k].message.find(n), std::string::npos) << "'" << n << "' in\n" << r.summary();
  }
}
double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}
}  // namespace

TEST(Faults, ShapeMismatchFailsEveryRankNamingParameterAndRanks) {
  auto t0 = std::chrono::steady_clock::now();
  auto r = run_ranks(3, [](World& w) {
    MLP m(w.rank() == 2 ? 14 : 13);  // rank 2 has another hidden size
    shardtorch::shard(m, w);
  });
  expect_all_fail_with(r, {"models differ across ranks", "'l1.lin.weight' Float[13, 7]", "Float[14, 7]",
                           "on rank 2", "ranks that differ from rank 0: 2"});
  EXPECT_LT(seconds_since(t0), 20.0);
}

TEST(Faults, DtypeMismatchFailsEveryRank) {
  auto r = run_ranks(2, [](World& w) {
    MLP m;
    if (w.rank() == 1) m->to(torch::kDouble);
    shardtorch::shard(m, w);
  });
  expect_all_fail_with(r, {"models differ across ranks", "'l1.lin.weight' Float", "Double", "rank 1"});
}

TEST(Faults, ParameterCountMismatchFailsEveryRank) {
  auto r = run_ranks(2, [](World& w) {
    MLP m(13, /*extra=*/w.rank() == 1);
    shardtorch::shard(m, w);
  });
  expect_all_fail_with(r, {"models differ across ranks", "extra.weight"});
}

TEST(Faults, ShardTwiceIsAnError) {
  auto r = run_ranks(1, [](World& w) {
    MLP m;
    shardtorch::shard(m, w);
    try {
      shardtorch::shard(m, w);
    } catch (const c10::Error& e) {
      require(std::string(e.what()).find("shard() was called twice") != std::string::npos, e.what());
      return;
    }
    throw std::runtime_error("second shard() did not fail");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

TEST(Faults, OptimizerOfUnshardedModelIsAnError) {
  MLP m;
  try {
    shardtorch::Adam(*m, torch::optim::AdamOptions(1e-3));
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("never sharded"), std::string::npos) << e.what();
  }
}

TEST(Faults, ParametersOutsideAnyUnitNeedARootUnit) {
  auto r = run_ranks(1, [](World& w) {
    auto seq = torch::nn::Sequential(torch::nn::Linear(3, 3));
    try {
      shardtorch::shard(*seq, w);
    } catch (const c10::Error& e) {
      require(std::string(e.what()).find("belong to no unit (first: '0.weight')") != std::string::npos, e.what());
      return;
    }
    throw std::runtime_error("no error");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

TEST(Faults, KilledRankMakesTheOthersFailNamingTheOperation) {
  auto t0 = std::chrono::steady_clock::now();
  auto r = run_ranks(3, [](World& w) {
    auto model = gpt::GPT(gpt::Config{});
    shardtorch::shard(model, w);
    auto opt = shardtorch::Adam(*model, torch::optim::AdamOptions(1e-3));
    auto x = torch::randint(0, 64, {2, 16}, torch::kLong);
    for (int step = 0; step < 3; ++step) {
      opt->zero_grad();
      auto loss = gpt::lm_loss(model(x), x);
      if (step == 1 && w.rank() == 1) ::raise(SIGKILL);  // dies in the middle of a step
      loss.backward();
      opt->step();
    }
  }, shardtorch::testing::RunOptions().collective_timeout(std::chrono::seconds(20)));
  ASSERT_FALSE(r.ok);
  EXPECT_EQ(r.ranks[1].signal, SIGKILL);
  // No survivor may die of SIGPIPE writing to the dead rank's socket.
  for (int k : {0, 2}) {
    EXPECT_EQ(r.ranks[k].exit_code, 1) << r.summary();
    // The survivors are in backward: gathering a block again or reducing gradients.
    EXPECT_NE(r.ranks[k].message.find("for parameters of unit 'blocks.1'"), std::string::npos) << r.summary();
    EXPECT_NE(r.ranks[k].message.find("did not complete"), std::string::npos) << r.summary();
  }
  EXPECT_LT(seconds_since(t0), 25.0) << "the survivors should fail within the collective timeout";
}

TEST(Faults, StuckRankTimesOutWithinTheCollectiveTimeout) {
  auto r = run_ranks(2, [](World& w) {
    MLP m;
    shardtorch::shard(m, w);
    if (w.rank() == 1) {
      std::this_thread::sleep_for(std::chrono::seconds(8));  // alive but never joins
      return;
    }
    auto t0 = std::chrono::steady_clock::now();
    try {
      m(torch::randn({4, 7}));
    } catch (const std::exception& e) {
      double waited = seconds_since(t0);
      require(waited < 6.0, "gave up only after " + std::to_string(waited) + " s");
      throw;
    }
  }, shardtorch::testing::RunOptions().collective_timeout(std::chrono::seconds(2)));
  EXPECT_EQ(r.ranks[1].exit_code, 0) << r.summary();
  EXPECT_EQ(r.ranks[0].exit_code, 1) << r.summary();
  EXPECT_NE(r.ranks[0].message.find("rank 0/2: all_gather for parameters of unit 'l1'"), std::string::npos) << r.summary();
  EXPECT_NE(r.ranks[0].message.find("timeout 2 s"), std::string::npos) << r.summary();
}
