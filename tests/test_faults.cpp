// Bad input and faults: differing models, misuse, dead and stuck ranks.
#include <gtest/gtest.h>

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <thread>

#include "checkpoint_helpers.h"
#include "models.h"
#include "shardtorch/checkpoint.h"

using namespace testmodels;
using shardtorch::World;
using shardtorch::testing::run_ranks;

namespace {
// Every rank must fail with a message containing all of `needles`.
void expect_all_fail_with(const shardtorch::testing::RunResult& r, std::vector<std::string> needles) {
  ASSERT_FALSE(r.ok);
  for (size_t k = 0; k < r.ranks.size(); ++k) {
    EXPECT_EQ(r.ranks[k].exit_code, 1) << r.summary();
    for (const auto& n : needles)
      EXPECT_NE(r.ranks[k].message.find(n), std::string::npos) << "'" << n << "' in\n" << r.summary();
  }
}
double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// Waits until this rank's progress record in the store (src/comm/progress.h) has
// it at `step`, `phase` and `unit`: what its peers read when they fail.
void wait_until_recorded(World& w, int64_t step, const std::string& phase, const std::string& unit) {
  c10d::PrefixStore store("shardtorch-peers", w.store());
  const std::string key = "progress/" + std::to_string(w.rank());
  const std::string want = std::to_string(step) + "\t" + phase + "\t" + unit + "\t";
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  for (;;) {
    if (store.check({key})) {
      const auto v = store.get(key);
      if (std::string(v.begin(), v.end()).rfind(want, 0) == 0) return;
    }
    if (std::chrono::steady_clock::now() > deadline)
      throw std::runtime_error("rank " + std::to_string(w.rank()) + "'s progress record never reached " + phase);
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

// Ranks that stay away on purpose wait for the others' `done` marks in the
// store rather than for a fixed time.
void mark_done(World& w) { w.store()->set("rank " + std::to_string(w.rank()) + " done", std::vector<uint8_t>{1}); }
void wait_until_done(World& w, const std::vector<int>& ranks) {
  std::vector<std::string> keys;
  for (int r : ranks) keys.push_back("rank " + std::to_string(r) + " done");
  w.store()->wait(keys, std::chrono::seconds(60));
}
}  // namespace

TEST(Faults, ShapeMismatchFailsEveryRankNamingParameterAndRanks) {
  auto t0 = std::chrono::steady_clock::now();
  auto r = run_ranks(3, [](World& w) {
    MLP m(w.rank() == 2 ? 14 : 13);  // rank 2 has another hidden size
    shardtorch::shard(m, w);
  });
  expect_all_fail_with(r, {"models differ across ranks", "'l1.lin.weight' Float[13, 7]", "Float[14, 7]", "on rank 2",
                           "ranks that differ from rank 0: 2"});
  EXPECT_LT(seconds_since(t0), 20.0);
}

// A model on another device than the backend's on one rank only: every
// rank fails at once naming it (the rank alone with it used to fail, and the
// others waited in shard()'s next collective until the timeout).
TEST(Faults, AParameterOnAnotherDeviceOnOneRankFailsEveryRankAtOnce) {
  struct OnImpl : torch::nn::Module {
    explicit OnImpl(c10::Device d) { register_parameter("w", torch::zeros({4, 3}, torch::device(d))); }
  };
  auto t0 = std::chrono::steady_clock::now();
  auto r = run_ranks(
      2,
      [](World& w) {
        auto m = std::make_shared<OnImpl>(w.rank() == 1 ? c10::Device(c10::kMeta) : c10::Device(c10::kCPU));
        shardtorch::shard(*m, w, shardtorch::ShardOptions().strategy(shardtorch::Strategy::NoShard));
      },
      shardtorch::testing::RunOptions().collective_timeout(std::chrono::seconds(30)));
  expect_all_fail_with(r, {"parameter 'w' is on meta but the gloo backend works on cpu", "rank 1"});
  EXPECT_LT(seconds_since(t0), 20.0) << "a rank waited for the collective timeout";
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
    } catch (const shardtorch::Error& e) {  // the library's one error type, naming the rank, no C++ backtrace
      const std::string msg = e.what();
      require(msg.find("shard() was called twice") != std::string::npos, msg);
      require(msg.find("rank " + std::to_string(w.rank())) != std::string::npos, "no rank in: " + msg);
      require(msg.find("frame #") == std::string::npos && msg.find("Exception raised from") == std::string::npos,
              "a backtrace in: " + msg);
      return;
    }
    throw std::runtime_error("second shard() did not throw shardtorch::Error");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

TEST(Faults, OptimizerOfUnshardedModelIsAnError) {
  MLP m;
  try {
    shardtorch::Adam(*m, torch::optim::AdamOptions(1e-3));
    FAIL() << "no error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("never sharded"), std::string::npos) << e.what();
  }
}

// A unit module replaced after shard() takes its unit with it: the next use
// of the model says so on every rank, naming it, instead of a bare message.
TEST(Faults, AUnitReplacedAfterShardIsAnErrorNamingTheRank) {
  auto r = run_ranks(2, [](World& w) {
    MLP m;
    shardtorch::shard(m, w);
    auto opt = shardtorch::Adam(*m, torch::optim::AdamOptions(1e-3));
    m->l2 = m->replace_module("l2", Layer(13, 5, true));
    try {
      opt->zero_grad();
      m(torch::randn({2, 7})).sum().backward();
      opt->step();
    } catch (const std::exception& e) {
      const std::string want = "rank " + std::to_string(w.rank()) + ": a unit of this sharded model no longer exists";
      require(std::string(e.what()).find(want) != std::string::npos, e.what());
      require(std::string(e.what()).find("replaced after shard()") != std::string::npos, e.what());
      return;
    }
    throw std::runtime_error("no error");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// A unit module its parent holds but never registers: shard() never sees
// it, so its parameters would be neither reduced nor trained. Its forward
// inside the sharded model's is an error naming the rank, the module's type
// and the unit it ran in, under a sharded strategy and under NoShard; before
// shard() it runs as a plain module.
struct HidesALayerImpl : torch::nn::Module {
  HidesALayerImpl() : first(register_module("first", Layer(7, 5, true))), hidden(Layer(5, 3, false)) {}
  torch::Tensor forward(torch::Tensor x) { return hidden(first(x)); }
  Layer first;
  Layer hidden;  // not registered
};
SHARDTORCH_MODULE(HidesALayer);

TEST(Faults, AUnitTheModelNeverRegisteredFailsItsForwardNamingIt) {
  auto r = run_ranks(2, [](World& w) {
    for (const auto strategy : {shardtorch::Strategy::FullShard, shardtorch::Strategy::NoShard}) {
      HidesALayer m;
      require(m(torch::randn({2, 7})).size(1) == 3, "before shard() the module does not run as a plain one");
      shardtorch::shard(m, w, shardtorch::ShardOptions().strategy(strategy));
      std::string error = "no error";
      try {
        m(torch::randn({2, 7}));
      } catch (const std::exception& e) {
        error = e.what();
      }
      const std::string want = "rank " + std::to_string(w.rank()) + ": a module of type ";
      require(error.find(want) != std::string::npos &&
                  error.find("LayerImpl declared shardtorch::Sharded, with trainable parameters, ran inside the "
                             "forward of unit '<root>'") != std::string::npos &&
                  error.find("register_module") != std::string::npos,
              std::string(shardtorch::strategy_name(strategy)) + ": " + error);
      // Frozen, it is kept out on purpose (a teacher): it runs, and so does the next forward.
      for (auto& p : m->hidden->parameters()) p.set_requires_grad(false);
      require(m(torch::randn({2, 7})).size(1) == 3, "a frozen unregistered module failed the forward");
    }
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

TEST(Faults, ParametersOutsideAnyUnitNeedARootUnit) {
  auto r = run_ranks(1, [](World& w) {
    auto seq = torch::nn::Sequential(torch::nn::Linear(3, 3));
    try {
      shardtorch::shard(*seq, w);
    } catch (const std::exception& e) {
      require(std::string(e.what()).find("rank 0: shardtorch::shard: 2 parameter(s) belong to no unit (first: "
                                         "'0.weight')") != std::string::npos,
              e.what());
      return;
    }
    throw std::runtime_error("no error");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

TEST(Faults, KilledRankMakesTheOthersFailNamingTheOperation) {
  auto t0 = std::chrono::steady_clock::now();
  auto r = run_ranks(
      3,
      [](World& w) {
        auto model = gpt::GPT(gpt::Config{});
        shardtorch::shard(model, w);
        auto opt = shardtorch::Adam(*model, torch::optim::AdamOptions(1e-3));
        auto x = torch::randint(0, 64, {2, 16}, torch::kLong);
        for (int step = 0; step < 3; ++step) {
          opt->zero_grad();
          auto loss = gpt::lm_loss(model(x), x);
          if (step == 1 && w.rank() == 1) {  // dies in the middle of a step, once its peers can read where
            wait_until_recorded(w, 1, "forward", "head");
            ::raise(SIGKILL);
          }
          loss.backward();
          opt->step();
        }
      },
      shardtorch::testing::RunOptions().collective_timeout(std::chrono::seconds(60)));
  ASSERT_FALSE(r.ok);
  EXPECT_EQ(r.ranks[1].signal, SIGKILL);
  // No survivor may die of SIGPIPE writing to the dead rank's socket.
  for (int k : {0, 2}) {
    EXPECT_EQ(r.ranks[k].exit_code, 1) << r.summary();
    // The survivors are in backward: gathering a block again or reducing gradients.
    EXPECT_NE(r.ranks[k].message.find("for parameters of unit 'blocks.1'"), std::string::npos) << r.summary();
    EXPECT_NE(r.ranks[k].message.find("did not complete"), std::string::npos) << r.summary();
    // ... and name the peer at fault, and where it last was (its forward of step 1).
    EXPECT_NE(r.ranks[k].message.find("Peer at fault: rank 1 is no longer running (pid "), std::string::npos)
        << r.summary();
    EXPECT_NE(r.ranks[k].message.find("it was last at step 1, forward of unit 'head'"), std::string::npos)
        << r.summary();
    EXPECT_EQ(r.ranks[k].message.find("rank " + std::to_string(2 - k) + " is"), std::string::npos)
        << "the other survivor is not at fault\n"
        << r.summary();
  }
  EXPECT_LT(seconds_since(t0), 25.0) << "the survivors should fail at once, not at the collective timeout (60 s)";
}

TEST(Faults, StuckRankTimesOutWithinTheCollectiveTimeout) {
  auto r = run_ranks(
      2,
      [](World& w) {
        MLP m;
        shardtorch::shard(m, w);
        if (w.rank() == 1) {
          wait_until_done(w, {0});  // alive but never joins
          return;
        }
        auto t0 = std::chrono::steady_clock::now();
        try {
          m(torch::randn({4, 7}));
        } catch (const std::exception& e) {
          mark_done(w);
          double waited = seconds_since(t0);
          require(waited < 6.0, "gave up only after " + std::to_string(waited) + " s");
          throw;
        }
        mark_done(w);
      },
      shardtorch::testing::RunOptions().collective_timeout(std::chrono::seconds(2)));
  EXPECT_EQ(r.ranks[1].exit_code, 0) << r.summary();
  EXPECT_EQ(r.ranks[0].exit_code, 1) << r.summary();
  EXPECT_NE(r.ranks[0].message.find("rank 0/2: all_gather for parameters of unit 'l1'"), std::string::npos)
      << r.summary();
  EXPECT_NE(r.ranks[0].message.find("timeout 2 s"), std::string::npos) << r.summary();
  // The rank that did not arrive, and where it is; this rank's place too.
  EXPECT_NE(r.ranks[0].message.find("Peer at fault: rank 1 is alive but did not arrive: it has been at step 0, "
                                    "shard() done for "),
            std::string::npos)
      << r.summary();
  EXPECT_NE(r.ranks[0].message.find("This rank is at step 0, forward of unit 'l1'"), std::string::npos) << r.summary();
  // The message and nothing more: no C++ backtrace of Gloo's or c10d's.
  for (const char* trace : {"Exception raised from", "frame #"})
    EXPECT_EQ(r.ranks[0].message.find(trace), std::string::npos) << r.summary();
}

// A peer in the program's own code between two collectives of the program's
// own, at the same place (step, phase, unit) as this rank, did not arrive:
// the count of collectives it launched on the group says so where its place
// cannot. Before: "Every peer is alive and reporting".
TEST(Faults, APeerBetweenTheProgramsOwnCollectivesIsNamedAsNotArrived) {
  auto r = run_ranks(
      2,
      [](World& w) {
        at::Tensor t = at::ones({4});
        w.comm().all_reduce(t, c10d::ReduceOp::SUM, "the loss");
        if (w.rank() == 1) {
          wait_until_done(w, {0});  // alive, in its own code
          return;
        }
        try {
          w.comm().all_reduce(t, c10d::ReduceOp::SUM, "the loss");
        } catch (const std::exception&) {
          mark_done(w);
          throw;
        }
        mark_done(w);
      },
      shardtorch::testing::RunOptions().collective_timeout(std::chrono::seconds(2)));
  EXPECT_EQ(r.ranks[1].exit_code, 0) << r.summary();
  ASSERT_EQ(r.ranks[0].exit_code, 1) << r.summary();
  const std::string& m = r.ranks[0].message;
  // Launched on the world's Comm: run_ranks's barrier, then "the loss" once on
  // rank 1 and twice on rank 0.
  for (const char* part : {"rank 0/2: all_reduce for the loss", "Peer at fault: rank 1 is alive but did not arrive: ",
                           "ago it had launched 2 collective(s) of this group, this one being number 3 (pid "})
    EXPECT_NE(m.find(part), std::string::npos) << "'" << part << "' in\n" << r.summary();
  EXPECT_EQ(m.find("Every peer is alive"), std::string::npos) << r.summary();
}

// A GoogleTest assertion that fails inside a rank fails that rank, with its
// file, line and message (the rank prints the failure as well); the rank
// whose assertions hold passes. Before: only the printed failure, and the
// test passed.
TEST(Faults, AGoogleTestAssertionThatFailsInARankFailsThatRank) {
  std::printf("[ expected ] one EXPECT_EQ and one ASSERT_TRUE failure from rank 1 follow\n");
  auto r = run_ranks(2, [](World& w) {
    EXPECT_EQ(w.rank(), 0) << "only rank 0 is rank 0";
    ASSERT_TRUE(w.rank() == 0) << "and the body ends here on rank 1";
    if (w.rank() != 0) throw std::runtime_error("not reached: ASSERT_TRUE returned from the body");
  });
  EXPECT_FALSE(r.ok);
  EXPECT_EQ(r.ranks[0].exit_code, 0) << r.summary();
  EXPECT_TRUE(r.ranks[0].message.empty()) << r.summary();
  EXPECT_EQ(r.ranks[1].exit_code, 1) << r.summary();
  for (const char* part : {"assertions failed in this rank: ", "test_faults.cpp:", "only rank 0 is rank 0", "; ",
                           "and the body ends here on rank 1"})
    EXPECT_NE(r.ranks[1].message.find(part), std::string::npos) << "'" << part << "' in\n" << r.summary();
  EXPECT_EQ(r.ranks[1].message.find("not reached"), std::string::npos) << r.summary();
}

// A rank still running at the run's time limit is killed with the stacks of
// its threads in its message (where it hung, readable in a CI log), unless
// the test turns that off.
TEST(Faults, ARankKilledAtTheRunsTimeLimitShowsItsThreadsStacks) {
  for (const bool stacks : {true, false}) {
    SCOPED_TRACE(stacks ? "stacks on" : "stacks off");
    auto r = run_ranks(
        2,
        [](World& w) {
          if (w.rank() == 1)
            for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
        },
        // Rank 0 ends at once; the limit has to find rank 1 asleep in its body.
        shardtorch::testing::RunOptions().timeout(std::chrono::seconds(stacks ? 2 : 1)).stacks_on_timeout(stacks));
    EXPECT_EQ(r.ranks[0].exit_code, 0) << r.summary();
    EXPECT_TRUE(r.ranks[0].message.empty()) << r.summary();
    ASSERT_TRUE(r.ranks[1].timed_out) << r.summary();
    const std::string& m = r.ranks[1].message;
    EXPECT_EQ(m.find("the stacks of its threads when it was killed:\nThread ") != std::string::npos, stacks)
        << r.summary();
    EXPECT_EQ(m.find("clock_nanosleep") != std::string::npos, stacks) << r.summary();  // where it waited
  }
}

// A rank whose whole process stops (SIGSTOP: its threads too) stops
// reporting; the survivor's time-out names it as such.
TEST(Faults, AStoppedRankIsNamedAsSilent) {
  auto r = run_ranks(
      2,
      [](World& w) {
        MLP m;
        shardtorch::shard(m, w);
        if (w.rank() == 1) {
          wait_until_recorded(w, 0, "shard() done", "");
          const std::string pid = std::to_string(::getpid());
          w.store()->set("test: stopped pid", std::vector<uint8_t>(pid.begin(), pid.end()));
          // The stall is the scenario: stopped until rank 0, failed at its 4 s
          // collective timeout, kills it.
          ::raise(SIGSTOP);
        }
        try {
          m(torch::randn({4, 7}));
        } catch (...) {
          const auto pid = w.store()->get("test: stopped pid");
          ::kill(std::stoi(std::string(pid.begin(), pid.end())), SIGKILL);
          throw;
        }
      },
      shardtorch::testing::RunOptions().collective_timeout(std::chrono::seconds(4)).timeout(std::chrono::seconds(60)));
  EXPECT_EQ(r.ranks[0].exit_code, 1) << r.summary();
  EXPECT_EQ(r.ranks[1].signal, SIGKILL) << r.summary();
  EXPECT_NE(r.ranks[0].message.find("Peer at fault: rank 1 stopped reporting "), std::string::npos) << r.summary();
  EXPECT_NE(r.ranks[0].message.find("it was last at step 0, shard() done"), std::string::npos) << r.summary();
}

// A rank that runs fewer steps and ends without an error: its World's
// destruction records that it finished, and where it was, before its
// connections close, so the survivor's error names it as finished rather
// than as dead, stale or late.
TEST(Faults, ARankThatFinishedEarlyIsNamedAsFinished) {
  auto r = run_ranks(
      2,
      [](World& w) {
        const int steps = w.rank() == 1 ? 2 : 3;
        for (int step = 0; step < steps; ++step) {
          auto t = torch::ones({4});
          w.comm().all_reduce(t, c10d::ReduceOp::SUM, "step " + std::to_string(step));
          w.note_step_done();
        }
      },
      shardtorch::testing::RunOptions().check_collectives(false).collective_timeout(std::chrono::seconds(20)));
  EXPECT_EQ(r.ranks[1].exit_code, 0) << r.summary();
  EXPECT_EQ(r.ranks[0].exit_code, 1) << r.summary();
  EXPECT_NE(r.ranks[0].message.find("all_reduce for step 2"), std::string::npos) << r.summary();
  EXPECT_NE(r.ranks[0].message.find("Peer at fault: rank 1 had finished: its World was destroyed "), std::string::npos)
      << r.summary();
  EXPECT_NE(r.ranks[0].message.find("after step 2, optimizer step done, with no exception in flight"),
            std::string::npos)
      << r.summary();
  // The same with a sharded model, whose destruction comes first.
  r = run_ranks(2, [](World& w) {
    testmodels::MLP m;
    shardtorch::shard(m, w);
    auto opt = shardtorch::AdamW(*m, torch::optim::AdamWOptions(1e-2));
    for (int step = 0; step < (w.rank() == 1 ? 2 : 3); ++step) {
      opt->zero_grad();
      m(torch::randn({4, 7})).square().mean().backward();
      opt->step();
    }
  });
  EXPECT_NE(r.ranks[0].message.find("Peer at fault: rank 1 had finished: its World was destroyed "), std::string::npos)
      << r.summary();
  EXPECT_NE(r.ranks[0].message.find("after step 2, optimizer step done, with no exception in flight"),
            std::string::npos)
      << r.summary();
}

// A rank whose World goes while an exception unwinds (it stopped on an
// error of its own) is named as such, not as having finished normally.
TEST(Faults, ARankThatLeftOnAnErrorIsNotNamedAsFinished) {
  auto r = run_ranks(
      2,
      [](World& w) {
        auto t = torch::ones({4});
        w.comm().all_reduce(t, c10d::ReduceOp::SUM, "step 0");
        w.note_step_done();
        if (w.rank() == 1) throw std::runtime_error("an error of rank 1's own");
        w.comm().all_reduce(t, c10d::ReduceOp::SUM, "step 1");
      },
      shardtorch::testing::RunOptions().check_collectives(false).collective_timeout(std::chrono::seconds(20)));
  EXPECT_EQ(r.ranks[1].exit_code, 1) << r.summary();
  EXPECT_EQ(r.ranks[0].exit_code, 1) << r.summary();
  EXPECT_NE(r.ranks[0].message.find("Peer at fault: rank 1 stopped on an error of its own (see its output): its World "
                                    "was destroyed "),
            std::string::npos)
      << r.summary();
  EXPECT_NE(r.ranks[0].message.find("while an exception unwound, after step 1, optimizer step done"), std::string::npos)
      << r.summary();
  EXPECT_EQ(r.ranks[0].message.find("had finished"), std::string::npos) << r.summary();
}

// Groups: a rank named twice, members listing the ranks in different orders
// and a member that never comes are errors naming the group, not a wait for
// a group no one else joins (each used to wait out the timeout in Gloo's
// set-up, with a message about store keys).
TEST(Faults, GroupsOfBadRankListsFailFastNamingTheGroup) {
  auto t0 = std::chrono::steady_clock::now();
  auto twice = run_ranks(
      2,
      [](World& w) {
        w.new_group({0, 1, w.rank()}, "twice");
      },
      shardtorch::testing::RunOptions().collective_timeout(std::chrono::seconds(20)));
  expect_all_fail_with(twice, {"group 'twice' names a rank twice: [0, 1, "});
  auto orders = run_ranks(
      3,
      [](World& w) {
        if (w.rank() == 2) return;
        w.new_group(w.rank() == 0 ? std::vector<int>{0, 1} : std::vector<int>{1, 0}, "pair");
      },
      shardtorch::testing::RunOptions().collective_timeout(std::chrono::seconds(20)));
  ASSERT_FALSE(orders.ok);
  EXPECT_EQ(orders.ranks[2].exit_code, 0) << orders.summary();
  for (int k : {0, 1}) {
    EXPECT_EQ(orders.ranks[k].exit_code, 1) << orders.summary();
    EXPECT_NE(orders.ranks[k].message.find("rank " + std::to_string(k) +
                                           ": the members of group 'pair' list its "
                                           "ranks in different orders"),
              std::string::npos)
        << orders.summary();
    EXPECT_NE(orders.ranks[k].message.find("rank 0 passed [0, 1], 1 member(s) another order"), std::string::npos)
        << orders.summary();
  }
  EXPECT_NE(orders.ranks[1].message.find("this rank [1, 0]"), std::string::npos) << orders.summary();
  EXPECT_LT(seconds_since(t0), 15.0) << "no rank should wait for the collective timeout";

  auto missing = run_ranks(
      3,
      [](World& w) {
        if (w.rank() == 1) {
          wait_until_done(w, {0, 2});  // alive, never joins
          return;
        }
        try {
          w.new_group({0, 1, 2}, "all");
        } catch (...) {
          mark_done(w);
          throw;
        }
        mark_done(w);
      },
      shardtorch::testing::RunOptions().collective_timeout(std::chrono::seconds(2)));
  EXPECT_EQ(missing.ranks[1].exit_code, 0) << missing.summary();
  for (int k : {0, 2}) {
    EXPECT_EQ(missing.ranks[k].exit_code, 1) << missing.summary();
    EXPECT_NE(missing.ranks[k].message.find("rank " + std::to_string(k) +
                                            " waited 2 s for the other members of group 'all' [0, 1, 2] to arrive"),
              std::string::npos)
        << missing.summary();
  }
}

// A CUDA device this process cannot use is refused when the world is made,
// naming the rank, not at the first tensor moved to it: any CUDA device
// without CUDA, and one past the last visible GPU with it.
TEST(Faults, AnUnusableDeviceIsRefusedWhenTheWorldIsMade) {
  const int64_t gpus = at::hasCUDA() ? static_cast<int64_t>(at::getNumGPUs()) : 0;
  const auto device = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(gpus));
  const std::string expected =
      "rank 0 is to compute on " + device.str() + ", but this " +
      (at::hasCUDA() ? "host shows it " + std::to_string(gpus) + " GPU(s)" : std::string("LibTorch has no CUDA"));
  try {
    World::create(c10::make_intrusive<c10d::HashStore>(), 0, 1, shardtorch::WorldOptions().device(device));
    FAIL() << device << " was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
  }
}

// Rendezvous through the launcher's variables: a store no one hosts, a port
// someone else holds and a world whose other rank never starts are errors
// that name the rank, the launcher, the address and the wait, and
// SHARDTORCH_TIMEOUT_S sets that wait (here 1 s instead of 5 minutes).
TEST(Faults, RendezvousFailuresNameTheRankTheAddressAndTheWait) {
  auto r = run_ranks(
      1,
      [](World&) {  // a process of its own: the variables set here stay in it
        c10d::TCPStoreOptions so;
        so.port = 0;  // any free port
        so.isServer = true;
        so.waitWorkers = false;
        auto held = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", so);
        const std::string port = std::to_string(held->getPort());
        auto error_as = [&](const char* rank) -> std::string {
          ::setenv("RANK", rank, 1);
          ::setenv("WORLD_SIZE", "2", 1);
          ::setenv("MASTER_ADDR", "127.0.0.1", 1);
          ::setenv("MASTER_PORT", port.c_str(), 1);
          ::setenv("SHARDTORCH_TIMEOUT_S", "1", 1);
          auto t0 = std::chrono::steady_clock::now();
          try {
            World::from_env();
          } catch (const std::exception& e) {
            require(seconds_since(t0) < 10.0, "waited " + std::to_string(seconds_since(t0)) + " s, not about 1");
            return e.what();
          }
          return "no error";
        };
        auto has = [](const std::string& text, const std::string& needle) {
          require(text.find(needle) != std::string::npos, "'" + needle + "' is not in: " + text);
        };
        has(error_as("0"), "rank 0 of 2 (torchrun) could not host the rendezvous store at 127.0.0.1:" + port +
                               " within 1 s; is another job using MASTER_PORT?");
        held.reset();  // now no one listens there
        has(error_as("1"), "rank 1 of 2 (torchrun) could not reach the rendezvous store at 127.0.0.1:" + port +
                               " within 1 s; is rank 0 running");
        has(error_as("0"),
            "rank 0 could not set up gloo for the world (every one of the 2 ranks must create it) "
            "within 1 s");
      },
      shardtorch::testing::RunOptions().timeout(std::chrono::seconds(60)));
  ASSERT_TRUE(r.ok) << r.summary();
}

// ---- Rank 0's store. Under mpirun, srun or a hand launch, rank 0's process
// hosts the TCPStore the peer records and the collective check use
// (World::from_env); run_ranks' own world rendezvouses through a file, so
// these tests make a second World as from_env does, from the launcher's
// variables set in each rank's process.
namespace {
std::shared_ptr<World> hand_launched(World& w, int timeout_s) {
  if (w.rank() == 0) {  // a free port of this host
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t length = sizeof(a);
    require(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
                ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &length) == 0,
            "no free port");
    ::close(fd);
    w.store()->set("hand launch port", std::to_string(ntohs(a.sin_port)));
  }
  w.store()->set("pid " + std::to_string(w.rank()), std::to_string(::getpid()));
  const std::string port = w.store()->get_to_str("hand launch port");
  ::setenv("RANK", std::to_string(w.rank()).c_str(), 1);
  ::setenv("WORLD_SIZE", std::to_string(w.size()).c_str(), 1);
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  ::setenv("MASTER_PORT", port.c_str(), 1);
  ::setenv("SHARDTORCH_TIMEOUT_S", std::to_string(timeout_s).c_str(), 1);
  ::unsetenv("TORCHELASTIC_USE_AGENT_STORE");
  return World::from_env();
}
pid_t pid_of(World& w, int rank) { return std::stoi(w.store()->get_to_str("pid " + std::to_string(rank))); }
// The process's state letter in /proc/PID/stat ('T': stopped, 'Z': dead, not reaped), 'X' when it is gone.
char state_of(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text;
  if (!std::getline(stat, text)) return 'X';
  return text[text.rfind(')') + 2];
}
void wait_for_state(pid_t pid, const std::string& states) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (states.find(state_of(pid)) == std::string::npos) {
    require(std::chrono::steady_clock::now() < deadline, "pid " + std::to_string(pid) + " never reached " + states);
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}
// From here on, this process's stderr (c10's and c10d's logging) goes to `path`.
void stderr_to(const std::string& path) {
  std::fflush(stderr);
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  ::dup2(fd, 2);
  ::close(fd);
}
// What a rank wrote to stderr, and whether a line of it is a C++ frame (c10's "frame #9: <unknown function> ...").
std::string stderr_of(const Path& dir, int rank) {
  std::ifstream in((dir / ("stderr-" + std::to_string(rank))).string());
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}
bool has_frames(const std::string& text) { return text.find("frame #") != std::string::npos; }
}  // namespace

// A stopped rank 0 (SIGSTOP) stops its store from answering: the survivor's
// collective fails within its timeout (plus the 2 s after which a store that
// does not answer names its host), naming rank 0 as stopped; once continued,
// rank 0 fails too, saying that its own process did not run. Neither prints
// a C++ frame. Before: the survivor's collective check and peer report
// waited on the store with no limit (forever while rank 0 stayed stopped),
// and the report then said "Every peer is alive and reporting".
TEST(RankZeroStore, AStoppedRankZeroIsNamedWithinTheCollectiveTimeout) {
  const TempDir dir;
  auto r = run_ranks(
      2,
      [&](World& w) {
        stderr_to((dir / ("stderr-" + std::to_string(w.rank()))).string());
        auto world = hand_launched(w, 3);
        at::Tensor t = at::ones({4});
        world->comm().all_reduce(t, c10d::ReduceOp::SUM, "before the stop");
        if (world->rank() == 0) {
          ::raise(SIGSTOP);  // until rank 1 has failed
          world->comm().all_reduce(t, c10d::ReduceOp::SUM, "after the stop");
          return;
        }
        const pid_t zero = pid_of(w, 0);
        wait_for_state(zero, "T");
        const auto t0 = std::chrono::steady_clock::now();
        try {
          world->comm().all_reduce(t, c10d::ReduceOp::SUM, "after the stop");
        } catch (const std::exception&) {
          const double waited = seconds_since(t0);
          ::kill(zero, SIGCONT);
          // The timeout and the store's 2 s of silence, with room for a loaded machine.
          require(waited < 3.0 + 9.0, "the error came after " + std::to_string(waited) + " s, timeout 3 s");
          throw;
        }
        ::kill(zero, SIGCONT);
        throw std::runtime_error("no error");
      },
      shardtorch::testing::RunOptions().timeout(std::chrono::seconds(60)));
  ASSERT_EQ(r.ranks[1].exit_code, 1) << r.summary();
  const std::string& m1 = r.ranks[1].message;
  for (const char* part :
       {"shardtorch: rank 1/2: all_reduce for after the stop", "Peer at fault: rank 0 is stopped (pid ",
        "process state T", "it hosts the store at 127.0.0.1:", "which has not answered for "})
    EXPECT_NE(m1.find(part), std::string::npos) << "'" << part << "' in\n" << r.summary();
  EXPECT_EQ(m1.find("Every peer is alive"), std::string::npos) << r.summary();
  EXPECT_EQ(r.ranks[0].exit_code, 1) << r.summary();
  EXPECT_NE(r.ranks[0].message.find("own process did not run for "), std::string::npos) << r.summary();
  for (int k : {0, 1}) {
    EXPECT_FALSE(has_frames(r.ranks[k].message)) << r.summary();
    EXPECT_FALSE(has_frames(stderr_of(dir, k))) << "rank " << k << "'s stderr:\n" << stderr_of(dir, k);
  }
}

// A killed rank 0 takes its store with it: the survivor's error names it as
// no longer running, and nothing prints a C++ frame. Before: c10d logged
// the store client's failure with c10's 30-frame backtrace, and the error
// said only "if rank 0 hosts it, rank 0 may have died".
TEST(RankZeroStore, AKilledRankZeroIsNamedAndNoFramesArePrinted) {
  const TempDir dir;
  auto r = run_ranks(
      2,
      [&](World& w) {
        stderr_to((dir / ("stderr-" + std::to_string(w.rank()))).string());
        auto world = hand_launched(w, 20);
        at::Tensor t = at::ones({4});
        world->comm().all_reduce(t, c10d::ReduceOp::SUM, "before the kill");
        if (world->rank() == 0) ::raise(SIGKILL);
        wait_for_state(pid_of(w, 0), "XZ");
        world->comm().all_reduce(t, c10d::ReduceOp::SUM, "after the kill");
      },
      shardtorch::testing::RunOptions().timeout(std::chrono::seconds(60)));
  EXPECT_EQ(r.ranks[0].signal, SIGKILL) << r.summary();
  ASSERT_EQ(r.ranks[1].exit_code, 1) << r.summary();
  for (const char* part : {"shardtorch: rank 1/2: all_reduce for after the kill",
                           "Peer at fault: rank 0 is no longer running (pid ", "it hosted the store at 127.0.0.1:"})
    EXPECT_NE(r.ranks[1].message.find(part), std::string::npos) << "'" << part << "' in\n" << r.summary();
  EXPECT_FALSE(has_frames(r.ranks[1].message)) << r.summary();
  EXPECT_FALSE(has_frames(stderr_of(dir, 1))) << "rank 1's stderr:\n" << stderr_of(dir, 1);
}

// Rank 0 killed while it writes its file of a sharded save: every survivor
// fails naming it, and none prints a C++ frame (before: every survivor did).
TEST(RankZeroStore, SurvivorsOfRankZerosCrashDuringAShardedSavePrintNoFrames) {
  const TempDir dir;
  auto r = run_ranks(
      3,
      [&](World& w) {
        stderr_to((dir / ("stderr-" + std::to_string(w.rank()))).string());
        auto world = hand_launched(w, 20);
        MLP model;
        shardtorch::shard(model, *world);
        if (world->rank() == 0) die_at("file partly written");
        shardtorch::save_sharded_checkpoint(*model, nullptr, (dir / "ckpt").string(), 1);
      },
      shardtorch::testing::RunOptions().timeout(std::chrono::seconds(60)));
  EXPECT_EQ(r.ranks[0].signal, SIGKILL) << r.summary();
  for (int k : {1, 2}) {
    EXPECT_EQ(r.ranks[k].exit_code, 1) << r.summary();
    EXPECT_NE(r.ranks[k].message.find("Peer at fault: rank 0 is no longer running (pid "), std::string::npos)
        << r.summary();
    EXPECT_FALSE(has_frames(r.ranks[k].message)) << r.summary();
    EXPECT_FALSE(has_frames(stderr_of(dir, k))) << "rank " << k << "'s stderr:\n" << stderr_of(dir, k);
  }
}
