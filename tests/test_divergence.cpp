// Ranks that diverge after shard(): with WorldOptions::check_collectives,
// every rank fails before the first collective that does not pair, naming
// two ranks and where each is (docs/reliability.md, "Ranks that diverge
// after shard()"). Without the check each of these waited for the
// collective timeout, paired the wrong units' data, aborted inside Gloo
// (SIGABRT) or trained on with no word.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "../src/base/env.h"
#include "../src/comm/collective_check.h"
#include "../src/runtime/shard_state.h"
#include "models.h"

using namespace testmodels;
using shardtorch::ShardOptions;
using shardtorch::Strategy;
using shardtorch::World;
using shardtorch::testing::run_ranks;
using shardtorch::testing::RunOptions;

namespace {

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// A collective timeout far above what the tests allow: an error within it
// comes from the check, not from a timeout.
RunOptions checked() {
  return RunOptions()
      .check_collectives(true)
      .collective_timeout(std::chrono::seconds(60))
      .timeout(std::chrono::seconds(90));
}
constexpr double kWithinSeconds = 15.0;

// The environment variable `name` set to `value` (unset for nullptr) for
// the scope (the ranks inherit the environment when they are forked).
class ScopedVariable {
 public:
  ScopedVariable(const char* name, const char* value) : name_(name) {
    if (const char* v = std::getenv(name)) saved_ = v;
    if (value)
      ::setenv(name, value, 1);
    else
      ::unsetenv(name);
  }
  ~ScopedVariable() {
    if (saved_)
      ::setenv(name_, saved_->c_str(), 1);
    else
      ::unsetenv(name_);
  }

 private:
  const char* name_;
  std::optional<std::string> saved_;
};

}  // namespace

// Each test chooses the switch itself (or tests its default): the variable,
// which would replace it in every rank, is unset while it runs. Long waits
// are compared every 100 ms instead of 500 (SHARDTORCH_CHECK_PROBE_MS): the
// outcomes are the same, five times sooner.
class Diverged : public ::testing::Test {
  ScopedVariable choose_here_{"SHARDTORCH_CHECK_COLLECTIVES", nullptr};
  ScopedVariable probe_{"SHARDTORCH_CHECK_PROBE_MS", "100"};
};

namespace {

// Every rank threw CollectivesDiverged, saying each of `words`.
void expect_diverged(const shardtorch::testing::RunResult& r, const std::vector<std::string>& words) {
  ASSERT_FALSE(r.ok) << r.summary();
  for (size_t k = 0; k < r.ranks.size(); ++k) {
    const auto& m = r.ranks[k].message;
    EXPECT_EQ(r.ranks[k].exit_code, 1) << r.summary();
    EXPECT_NE(m.find("shardtorch: rank " + std::to_string(k) + "/" + std::to_string(r.ranks.size()) +
                     ": collectives diverged: rank 0 is at "),
              std::string::npos)
        << r.summary();
    for (const auto& w : words) EXPECT_NE(m.find(w), std::string::npos) << "missing: " << w << "\n" << r.summary();
    for (const char* trace : {"Exception raised from", "frame #"})
      EXPECT_EQ(m.find(trace), std::string::npos) << r.summary();
  }
}

// Ranks 0 .. ranks-1 threw CollectivesDiverged for waits across
// communicators, the message going on with `head`, and saying each of `words`.
void expect_waits_diverged(const shardtorch::testing::RunResult& r, size_t ranks, const std::string& head,
                           const std::vector<std::string>& words) {
  ASSERT_FALSE(r.ok) << r.summary();
  for (size_t k = 0; k < ranks; ++k) {
    const auto& m = r.ranks[k].message;
    EXPECT_EQ(r.ranks[k].exit_code, 1) << r.summary();
    const std::string start = "shardtorch: rank " + std::to_string(k) + "/" + std::to_string(r.ranks.size()) +
                              ": collectives diverged across communicators: ";
    EXPECT_NE(m.find(start + head), std::string::npos) << "missing: " << start + head << "\n" << r.summary();
    for (const auto& w : words) EXPECT_NE(m.find(w), std::string::npos) << "missing: " << w << "\n" << r.summary();
  }
}

// Runs micro-batches of `x` (the last with gradient sync) and one step.
template <class M>
void train_step(M& model, shardtorch::ShardedModel& sharded, shardtorch::ShardedOptimizer& opt, const torch::Tensor& x,
                int micro_batches) {
  opt.zero_grad();
  for (int m = 0; m < micro_batches; ++m) {
    sharded.set_requires_gradient_sync(m + 1 == micro_batches);
    model(x).square().mean().backward();
  }
  sharded.set_requires_gradient_sync(true);
  opt.step();
}

// Three units of one size and one of another, the second skipped where `skip`.
struct RoutedImpl : torch::nn::Module {
  RoutedImpl()
      : a(register_module("a", Layer(6, 6, true))),
        b(register_module("b", Layer(6, 6, true))),
        c(register_module("c", Layer(6, 6, true))),
        d(register_module("d", Layer(6, 2, false))) {}
  torch::Tensor forward(torch::Tensor x) {
    x = a(x);
    if (!skip_b) x = b(x);
    if (!skip_c) x = c(x);
    return d(x);
  }
  Layer a, b, c, d;
  bool skip_b = false, skip_c = false;
};
SHARDTORCH_MODULE(Routed);

}  // namespace

// (a) One rank runs three micro-batches per step, the other two.
TEST_F(Diverged, ADifferentNumberOfMicroBatchesFailsEveryRankNamingBoth) {
  for (Strategy s : {Strategy::FullShard, Strategy::NoShard, Strategy::ShardGradOp}) {
    SCOPED_TRACE(shardtorch::strategy_name(s));
    auto t0 = std::chrono::steady_clock::now();
    auto r = run_ranks(
        2,
        [s](World& w) {
          torch::manual_seed(0);
          MLP m;
          auto sharded = shardtorch::shard(m, w, ShardOptions().strategy(s));
          auto opt = shardtorch::Adam(*m, torch::optim::AdamOptions(1e-3));
          auto x = torch::randn({4, 7});
          for (int step = 0; step < 2; ++step) train_step(m, sharded, *opt, x, w.rank() == 0 ? 3 : 2);
        },
        checked());
    EXPECT_LT(seconds_since(t0), kWithinSeconds) << r.summary();
    if (s == Strategy::FullShard) {
      // Both in the second backward: rank 0 without gradient sync, rank 1 with.
      expect_diverged(r, {"rank 0 is at all_gather for parameters of unit 'l3'",
                          "step 0, in backward 2 since the last optimizer step (gradient sync off)",
                          "but rank 1 is at all_gather for parameters of unit 'l3'",
                          "step 0, in backward 2 since the last optimizer step (gradient sync on)"});
    } else {
      // Nothing gathers in backward: rank 0's third backward meets rank 1's second.
      expect_diverged(r, {"in backward 3 since the last optimizer step (gradient sync on)", "but rank 1 is at",
                          "in backward 2 since the last optimizer step (gradient sync on)"});
    }
  }
}

// A program that catches the divergence and lets its model go (returns
// from main, say) is not held until the collective timeout: each rank tears
// its sharded model down within seconds. Before, under ShardGradOp and
// OptimizerOnly, the destructor waited for a collective that its peer would
// never launch (the peer, for an exchange this rank would never join).
TEST_F(Diverged, ARankThatCaughtTheDivergenceTearsItsModelDownAtOnce) {
  for (Strategy s : {Strategy::FullShard, Strategy::NoShard, Strategy::ShardGradOp, Strategy::OptimizerOnly}) {
    SCOPED_TRACE(shardtorch::strategy_name(s));
    auto r = run_ranks(
        2,
        [s](World& w) {
          torch::manual_seed(0);
          auto m = std::make_unique<MLP>();
          auto sharded =
              std::make_unique<shardtorch::ShardedModel>(shardtorch::shard(*m, w, ShardOptions().strategy(s)));
          auto opt = shardtorch::Adam(**m, torch::optim::AdamOptions(1e-3));
          auto x = torch::randn({4, 7});
          bool diverged = false;
          try {
            for (int step = 0; step < 4; ++step) train_step(*m, *sharded, *opt, x, step == 2 && w.rank() == 1 ? 3 : 2);
          } catch (const shardtorch::CollectivesDiverged&) {
            diverged = true;
          }
          if (!diverged) throw std::runtime_error("no divergence seen");
          const auto t0 = std::chrono::steady_clock::now();
          opt.reset();
          sharded.reset();
          m.reset();
          torch::nn::Linear other(1, 1);
          shardtorch::detail::lookup_model(*other);  // the registry lets the dead model's state go here
          const double teardown = seconds_since(t0);
          if (teardown > 10.0) throw std::runtime_error("the teardown took " + std::to_string(teardown) + " s");
        },
        checked());
    EXPECT_TRUE(r.ok) << r.summary();
  }
}

// (b) One rank stops a step early and goes on to the next collective of its
// program (a barrier before saving); or it exits.
TEST_F(Diverged, ARankThatStopsEarlyFailsEveryRankNamingBoth) {
  auto t0 = std::chrono::steady_clock::now();
  auto r = run_ranks(
      2,
      [](World& w) {
        MLP m;
        auto sharded = shardtorch::shard(m, w);
        auto opt = shardtorch::Adam(*m, torch::optim::AdamOptions(1e-3));
        auto x = torch::randn({4, 7});
        const int steps = w.rank() == 0 ? 3 : 2;
        for (int step = 0; step < steps; ++step) train_step(m, sharded, *opt, x, 1);
        w.barrier();
      },
      checked());
  EXPECT_LT(seconds_since(t0), kWithinSeconds) << r.summary();
  expect_diverged(r, {"rank 0 is at all_gather for parameters of unit 'l1'", "step 2, after 0 backwards",
                      "but rank 1 is at all_reduce for barrier (Float[1]); step 2"});

  // The rank that stopped leaves: the other fails at once, naming it.
  t0 = std::chrono::steady_clock::now();
  auto gone = run_ranks(
      2,
      [](World& w) {
        MLP m;
        auto sharded = shardtorch::shard(m, w);
        auto opt = shardtorch::Adam(*m, torch::optim::AdamOptions(1e-3));
        auto x = torch::randn({4, 7});
        const int steps = w.rank() == 0 ? 3 : 2;
        for (int step = 0; step < steps; ++step) train_step(m, sharded, *opt, x, 1);
      },
      checked());
  EXPECT_LT(seconds_since(t0), kWithinSeconds) << gone.summary();
  EXPECT_EQ(gone.ranks[1].exit_code, 0) << gone.summary();
  EXPECT_EQ(gone.ranks[0].exit_code, 1) << gone.summary();
  EXPECT_NE(gone.ranks[0].message.find("all_gather for parameters of unit 'l1'"), std::string::npos) << gone.summary();
  EXPECT_NE(gone.ranks[0].message.find("Peer at fault: rank 1"), std::string::npos) << gone.summary();
}

// (c) One rank routes around a unit of the same size as the next: without
// the check the two all-gathers paired, each rank computing with the other
// unit's parameters.
TEST_F(Diverged, ADifferentForwardPathFailsEveryRankNamingBothUnits) {
  auto t0 = std::chrono::steady_clock::now();
  auto r = run_ranks(
      2,
      [](World& w) {
        Routed m;
        auto sharded = shardtorch::shard(m, w);
        auto opt = shardtorch::Adam(*m, torch::optim::AdamOptions(1e-3));
        auto x = torch::randn({4, 6});
        train_step(m, sharded, *opt, x, 1);
        m->skip_b = w.rank() == 1;
        train_step(m, sharded, *opt, x, 1);
      },
      checked());
  EXPECT_LT(seconds_since(t0), kWithinSeconds) << r.summary();
  expect_diverged(r, {"rank 0 is at all_gather for parameters of unit 'b' (flat Float of 2 params, 42 elements",
                      "step 1, after 0 backwards",
                      "but rank 1 is at all_gather for parameters of unit 'c' (flat Float of 2 params, 42 elements"});
}

// (d) One rank's batch is half the others'. Caught at the step's first
// collective: an all-gather of the first forward (FullShard) or the first
// reduction of the backward (NoShard, which gathers nothing).
TEST_F(Diverged, ADifferentBatchSizeFailsEveryRankNamingBothShapes) {
  for (Strategy s : {Strategy::FullShard, Strategy::NoShard}) {
    SCOPED_TRACE(shardtorch::strategy_name(s));
    auto t0 = std::chrono::steady_clock::now();
    auto r = run_ranks(
        2,
        [s](World& w) {
          MLP m;
          auto sharded = shardtorch::shard(m, w, ShardOptions().strategy(s));
          auto opt = shardtorch::Adam(*m, torch::optim::AdamOptions(1e-3));
          auto x = torch::randn({w.rank() == 0 ? 8 : 4, 7});
          train_step(m, sharded, *opt, x, 1);
        },
        checked());
    EXPECT_LT(seconds_since(t0), kWithinSeconds) << r.summary();
    expect_diverged(r, {"the step's first forward took Float[8, 7]", "but rank 1 is at",
                        "the step's first forward took Float[4, 7]"});
  }
}

// (e) Collectives of different sizes: one rank skips a unit whose size
// differs from the next one's (this aborted the process inside Gloo's own
// thread: "Received data size doesn't match expected size", SIGABRT), or
// clips its gradients while the other goes on to the next forward.
TEST_F(Diverged, CollectivesOfDifferentSizesAreAnErrorOnEveryRankNotAnAbort) {
  auto t0 = std::chrono::steady_clock::now();
  auto r = run_ranks(
      2,
      [](World& w) {
        Routed m;
        auto sharded = shardtorch::shard(m, w);
        auto opt = shardtorch::Adam(*m, torch::optim::AdamOptions(1e-3));
        auto x = torch::randn({4, 6});
        m->skip_c = w.rank() == 1;
        train_step(m, sharded, *opt, x, 1);
      },
      checked());
  EXPECT_LT(seconds_since(t0), kWithinSeconds) << r.summary();
  for (const auto& rank : r.ranks) EXPECT_EQ(rank.signal, 0) << r.summary();
  expect_diverged(r, {"rank 0 is at all_gather for parameters of unit 'c' (flat Float of 2 params, 42 elements",
                      "but rank 1 is at all_gather for parameters of unit 'd' (flat Float of 2 params, 14 elements"});

  t0 = std::chrono::steady_clock::now();
  auto clip = run_ranks(
      2,
      [](World& w) {
        MLP m;
        auto sharded = shardtorch::shard(m, w);
        auto opt = shardtorch::Adam(*m, torch::optim::AdamOptions(1e-3));
        auto x = torch::randn({4, 7});
        for (int step = 0; step < 2; ++step) {
          opt->zero_grad();
          m(x).square().mean().backward();
          if (w.rank() == 0) shardtorch::clip_grad_norm(*m, 1.0);
          opt->step();
        }
      },
      checked());
  EXPECT_LT(seconds_since(t0), kWithinSeconds) << clip.summary();
  for (const auto& rank : clip.ranks) EXPECT_EQ(rank.signal, 0) << clip.summary();
  expect_diverged(
      clip, {"rank 0 is at all_reduce for clip_grad_norm (Double[1])", "but rank 1 is at the start of step 1 (after "});
}

// The same programs with equal ranks train as before, and the switch must
// agree across ranks.
TEST_F(Diverged, EqualRanksTrainAndTheSwitchMustAgree) {
  auto r = run_ranks(
      2,
      [](World& w) {
        if (!w.checks_collectives()) throw std::runtime_error("the world does not check its collectives");
        Routed m;
        auto sharded = shardtorch::shard(m, w, ShardOptions().prefetch(true));
        auto opt = shardtorch::Adam(*m, torch::optim::AdamOptions(1e-3));
        auto x = torch::randn({4, 6});
        for (int step = 0; step < 7; ++step) {
          if (step == 3) {  // an evaluation on every rank: the step's pattern changes alike
            torch::NoGradGuard no_grad;
            m(x);
          }
          train_step(m, sharded, *opt, step == 5 ? x.narrow(0, 0, 2) : x, 2);  // a short batch, on every rank
        }
        shardtorch::clip_grad_norm(*m, 1.0);
        w.barrier();
      },
      checked());
  ASSERT_TRUE(r.ok) << r.summary();

  auto differ = run_ranks(2, [](World& w) {
    // The body is not reached: the second world is made here, with the switch on rank 1 only.
    auto store = c10::make_intrusive<c10d::PrefixStore>("second", w.store());
    World::create(store, w.rank(), w.size(),
                  shardtorch::WorldOptions()
                      .gloo_hostname("127.0.0.1")
                      .device(c10::Device(c10::kCPU))
                      .backend("gloo")
                      .timeout(std::chrono::seconds(20))
                      .check_collectives(w.rank() == 1));
  });
  ASSERT_FALSE(differ.ok);
  for (const auto& rank : differ.ranks)
    EXPECT_NE(rank.message.find("check_collectives differs across ranks: off on rank 0 but on on rank 1"),
              std::string::npos)
        << differ.summary();
}

// WorldOptions::check_collectives unset: on for CPU worlds of up to
// kCheckedByDefaultUpTo ranks; the variable replaces the option either way;
// on CUDA off, with a warning only where it was asked for.
TEST_F(Diverged, TheCheckIsOnByDefaultForCpuWorldsUpToTheLimit) {
  using shardtorch::detail::check_collectives_choice;
  const int most = shardtorch::WorldOptions::kCheckedByDefaultUpTo;
  EXPECT_TRUE(check_collectives_choice(std::nullopt, nullptr, false, 2).on);
  EXPECT_TRUE(check_collectives_choice(std::nullopt, nullptr, false, most).on);
  EXPECT_FALSE(check_collectives_choice(std::nullopt, nullptr, false, most + 1).on);
  EXPECT_TRUE(check_collectives_choice(true, nullptr, false, most + 1).on);
  EXPECT_FALSE(check_collectives_choice(false, nullptr, false, 2).on);
  EXPECT_TRUE(check_collectives_choice(false, "1", false, 2).on);
  EXPECT_FALSE(check_collectives_choice(true, "0", false, 2).on);
  EXPECT_FALSE(check_collectives_choice(std::nullopt, "0", false, 2).on);
  const auto unset_on_cuda = check_collectives_choice(std::nullopt, nullptr, true, 2);
  EXPECT_FALSE(unset_on_cuda.on);
  EXPECT_FALSE(unset_on_cuda.refused_on_cuda);
  const auto asked_on_cuda = check_collectives_choice(true, nullptr, true, 2);
  EXPECT_FALSE(asked_on_cuda.on);
  EXPECT_TRUE(asked_on_cuda.refused_on_cuda);
  EXPECT_THROW(check_collectives_choice(std::nullopt, "yes", false, 2), shardtorch::Error);
}

// With the options left at their defaults, two CPU ranks that issue
// collectives of different sizes fail at once naming both, as a user's
// first program would (before the default changed: the 60 s timeout here,
// or an abort in Gloo).
TEST_F(Diverged, WithDefaultOptionsADivergenceIsAnErrorAtOnce) {
  const auto t0 = std::chrono::steady_clock::now();
  auto r = run_ranks(
      2,
      [](World& w) {
        if (!w.checks_collectives()) throw std::runtime_error("the world does not check its collectives by default");
        auto t = torch::ones({w.rank() == 0 ? 3 : 5});
        w.comm().all_reduce(t, c10d::ReduceOp::SUM, "the loss");
      },
      RunOptions().collective_timeout(std::chrono::seconds(60)).timeout(std::chrono::seconds(90)));
  EXPECT_LT(seconds_since(t0), kWithinSeconds) << r.summary();
  expect_diverged(r, {"rank 0 is at all_reduce for the loss (Float[3]); step 0",
                      "but rank 1 is at all_reduce for the loss (Float[5]); step 0"});
}

// Ranks that first differ on two communicators: each waits for a check that
// the other never joins (rank 0 on the world, rank 1 on a group of both).
// Without the comparison of long waits, both waited for the collective
// timeout (60 s here).
TEST_F(Diverged, RanksWaitingOnTwoCommunicatorsFailNamingBoth) {
  const auto t0 = std::chrono::steady_clock::now();
  auto r = run_ranks(
      2,
      [](World& w) {
        auto group = w.new_group({0, 1}, "pair");
        auto t = torch::ones({3});
        if (w.rank() == 0)
          w.comm().all_reduce(t, c10d::ReduceOp::SUM, "the world's sum");
        else
          group->all_reduce(t, c10d::ReduceOp::SUM, "the pair's sum");
      },
      checked());
  EXPECT_LT(seconds_since(t0), kWithinSeconds) << r.summary();
  expect_waits_diverged(
      r, 2, "",
      {"rank 0 waits at all_reduce for the world's sum (Float[3]); step 0", "(in its check, exchange ",
       "of communicator 'the world', which rank 1 has not entered: it entered ",
       " but rank 1 waits at all_reduce for the pair's sum (Float[3])",
       "(in its check, exchange 1 of communicator 'group 'pair' of ranks [0, 1] (0)', which rank 0 has not entered: "
       "it entered 0 there)"});
}

// Long waits on two communicators that are not crossed: rank 0 waits on the
// world for rank 2 (slow), rank 1 waits on their group for rank 0, which
// issues it after the world's. Rank 1 has issued the world's collective, so
// nothing is wrong, and everything completes.
TEST_F(Diverged, LongWaitsOnTwoCommunicatorsThatResolveAreNoDivergence) {
  auto r = run_ranks(
      3,
      [](World& w) {
        std::shared_ptr<shardtorch::Comm> group;
        if (w.rank() < 2) group = w.new_group({0, 1}, "pair");
        auto world_sum = torch::full({2}, static_cast<float>(w.rank() + 1));
        auto pair_sum = torch::full({2}, static_cast<float>(w.rank() + 1));
        if (w.rank() == 0) {
          w.comm().all_reduce(world_sum, c10d::ReduceOp::SUM, "the world's sum");
          group->all_reduce(pair_sum, c10d::ReduceOp::SUM, "the pair's sum");
        } else if (w.rank() == 1) {
          auto pending = w.comm().all_reduce_async(world_sum, "the world's sum");
          group->all_reduce(pair_sum, c10d::ReduceOp::SUM, "the pair's sum");
          w.comm().wait(pending);
        } else {
          // Three times the quiet time before a wait is compared.
          std::this_thread::sleep_for(6 * shardtorch::detail::check_probe_interval());
          w.comm().all_reduce(world_sum, c10d::ReduceOp::SUM, "the world's sum");
        }
        if (world_sum[0].item<float>() != 6.0f) throw std::runtime_error("wrong world sum");
        if (group && pair_sum[0].item<float>() != 3.0f) throw std::runtime_error("wrong pair sum");
      },
      checked());
  EXPECT_TRUE(r.ok) << r.summary();
}

namespace {

// Three pair communicators around ranks 0, 1, 2: a = {0, 1}, b = {1, 2},
// c = {0, 2}, made in an order that pairs on every rank. Null where the
// rank is not a member.
struct Ring3 {
  std::shared_ptr<shardtorch::Comm> a, b, c;
  explicit Ring3(World& w) {
    if (w.rank() != 2) a = w.new_group({0, 1}, "a");
    if (w.rank() != 0) b = w.new_group({1, 2}, "b");
    if (w.rank() != 1) c = w.new_group({0, 2}, "c");
  }
};

// A sum of `n` ones over a pair: 2 everywhere.
void pair_sum(shardtorch::Comm& comm, const std::string& what, int64_t n = 2) {
  auto t = torch::ones({n});
  comm.all_reduce(t, c10d::ReduceOp::SUM, what);
  if (t[0].item<float>() != 2.0f) throw std::runtime_error("wrong sum for " + what);
}

// Throws, with the counts, unless the exchanges per step are `expected`.
void require_exchanges(const std::vector<int64_t>& per_step, const std::vector<int64_t>& expected) {
  if (per_step == expected) return;
  std::string got;
  for (auto n : per_step) got += std::to_string(n) + " ";
  throw std::runtime_error("exchanges per step: " + got);
}

// The exchanges on `comm` between successive calls of count(), one entry
// per call after the first.
class ExchangesPerStep {
 public:
  explicit ExchangesPerStep(shardtorch::Comm& comm) : comm_(comm) {}
  void count() {
    const int64_t now = comm_.check_exchanges();
    if (before_ >= 0) per_step.push_back(now - before_);
    before_ = now;
  }
  std::vector<int64_t> per_step;

 private:
  shardtorch::Comm& comm_;
  int64_t before_ = -1;
};

// Waits until each of `ranks` has written that it waits (one of its waits
// has lasted WaitBoard::quiet(), twice SHARDTORCH_CHECK_PROBE_MS).
void await_long_waits(World& w, const std::vector<int>& ranks) {
  auto waits = c10::make_intrusive<c10d::PrefixStore>("shardtorch-waits", w.store());
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  for (int r : ranks) {
    const std::string key = "wait/" + std::to_string(r);
    for (;;) {
      if (waits->check({key})) {
        auto v = waits->get(key);
        if (std::string(v.begin(), v.end()).rfind("waiting", 0) == 0) break;
      }
      if (std::chrono::steady_clock::now() > deadline)
        throw std::runtime_error("rank " + std::to_string(r) + " never waited long");
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
}

}  // namespace

// Three ranks in a cycle of waits over three pair communicators: rank 0
// waits in a for rank 1, rank 1 in b for rank 2, rank 2 in c for rank 0.
// No two of them wait on each other; without the wait-for graph all three
// waited for the collective timeout (60 s here).
TEST_F(Diverged, ThreeRanksWaitingInACycleFailNamingEachOfThem) {
  const auto t0 = std::chrono::steady_clock::now();
  auto r = run_ranks(
      3,
      [](World& w) {
        Ring3 g(w);
        auto t = torch::ones({3});
        if (w.rank() == 0) g.a->all_reduce(t, c10d::ReduceOp::SUM, "a's sum");
        if (w.rank() == 1) g.b->all_reduce(t, c10d::ReduceOp::SUM, "b's sum");
        if (w.rank() == 2) g.c->all_reduce(t, c10d::ReduceOp::SUM, "c's sum");
      },
      checked());
  EXPECT_LT(seconds_since(t0), kWithinSeconds) << r.summary();
  expect_waits_diverged(
      r, 3,
      "ranks 0, 1 and 2 wait for each other in a cycle: rank 0 waits at all_reduce for a's sum (Float[3]); step 0",
      {"(in its check, exchange 1 of communicator 'group 'a' of ranks [0, 1] (0)', which rank 1 has not entered: it "
       "entered 0 there), rank 1 waits at all_reduce for b's sum (Float[3]); step 0",
       "(in its check, exchange 1 of communicator 'group 'b' of ranks [1, 2] (0)', which rank 2 has not entered: it "
       "entered 0 there), and rank 2 waits at all_reduce for c's sum (Float[3]); step 0",
       "(in its check, exchange 1 of communicator 'group 'c' of ranks [0, 2] (0)', which rank 0 has not entered: it "
       "entered 0 there). Every rank must issue the same collectives in the same order on each communicator; none of "
       "the 3 collectives ran"});
}

// A cycle of four (pairs {0, 1}, {1, 2}, {2, 3}, {0, 3}) and a fifth rank
// that waits on the world for all four: it is not on the cycle (no rank of
// the cycle waits for it), so it is not told of it. Its exchange fails once
// the cycle's ranks have left, naming the ranks that left.
TEST_F(Diverged, FourRanksWaitingInACycleFailAndARankWaitingOnThemIsNotBlamed) {
  const auto t0 = std::chrono::steady_clock::now();
  auto r = run_ranks(
      5,
      [](World& w) {
        const int me = w.rank();
        std::shared_ptr<shardtorch::Comm> mine, other;  // where the rank waits; its other pair
        if (me == 0 || me == 1) (me == 0 ? mine : other) = w.new_group({0, 1}, "a");
        if (me == 1 || me == 2) (me == 1 ? mine : other) = w.new_group({1, 2}, "b");
        if (me == 2 || me == 3) (me == 2 ? mine : other) = w.new_group({2, 3}, "c");
        if (me == 3 || me == 0) (me == 3 ? mine : other) = w.new_group({0, 3}, "d");
        auto t = torch::ones({3});
        if (me == 4)
          w.comm().all_reduce(t, c10d::ReduceOp::SUM, "the world's sum");
        else
          mine->all_reduce(t, c10d::ReduceOp::SUM, "the pair's sum");
      },
      checked());
  EXPECT_LT(seconds_since(t0), kWithinSeconds) << r.summary();
  expect_waits_diverged(
      r, 4, "ranks 0, 1, 2 and 3 wait for each other in a cycle: rank 0 waits at ",
      {"'group 'a' of ranks [0, 1] (0)', which rank 1 has not entered",
       "'group 'b' of ranks [1, 2] (0)', which rank 2 has not entered",
       "'group 'c' of ranks [2, 3] (0)', which rank 3 has not entered",
       "'group 'd' of ranks [0, 3] (0)', which rank 0 has not entered", "none of the 4 collectives ran"});
  for (size_t k = 0; k < 4; ++k) EXPECT_EQ(r.ranks[k].message.find("rank 4"), std::string::npos) << r.summary();
  EXPECT_EQ(r.ranks[4].exit_code, 1) << r.summary();
  EXPECT_EQ(r.ranks[4].message.find("collectives diverged"), std::string::npos) << r.summary();
  EXPECT_NE(r.ranks[4].message.find("all_reduce for the world's sum"), std::string::npos) << r.summary();
  EXPECT_NE(r.ranks[4].message.find("Peer at fault: rank "), std::string::npos) << r.summary();
}

// A would-be cycle that resolves: rank 0 waits in a for rank 1, rank 1 in b
// for rank 2, which is slow (it issues b only after both waits have been
// compared for a while), then each goes on to its other pair. Nothing is
// wrong, and every sum completes.
TEST_F(Diverged, LongWaitsInAWouldBeCycleOfThreeThatResolveAreNoDivergence) {
  auto r = run_ranks(
      3,
      [](World& w) {
        Ring3 g(w);
        if (w.rank() == 0) {
          pair_sum(*g.a, "a's sum");
          pair_sum(*g.c, "c's sum");
        } else if (w.rank() == 1) {
          pair_sum(*g.b, "b's sum");
          pair_sum(*g.a, "a's sum");
        } else {
          await_long_waits(w, {0, 1});
          std::this_thread::sleep_for(3 *
                                      shardtorch::detail::check_probe_interval());  // probes with both waits written
          pair_sum(*g.b, "b's sum");
          pair_sum(*g.c, "c's sum");
        }
      },
      checked());
  EXPECT_TRUE(r.ok) << r.summary();
}

// Two threads of one rank issue its collectives. Rank 0's main thread waits
// in c for rank 2 (slow), then issues a; its second thread waits in a2 for
// rank 1, which issues a2 only after a, and rank 1 waits in a for rank 0.
// Had rank 0 one thread, that would be a cycle (0 waits for 1 in a2, 1 for 0
// in a), but its main thread goes on once rank 2 comes: nothing is wrong,
// and every sum completes.
TEST_F(Diverged, LongWaitsOfTwoThreadsOfARankThatResolveAreNoDivergence) {
  auto r = run_ranks(
      3,
      [](World& w) {
        Ring3 g(w);
        std::shared_ptr<shardtorch::Comm> a2;
        if (w.rank() != 2) a2 = w.new_group({0, 1}, "a2");
        if (w.rank() == 0) {
          std::exception_ptr failed;
          std::thread second([&] {
            try {
              std::this_thread::sleep_for(std::chrono::milliseconds(200));  // its wait is written last
              pair_sum(*a2, "a2's sum");
            } catch (...) {
              failed = std::current_exception();
            }
          });
          pair_sum(*g.c, "c's sum");
          pair_sum(*g.a, "a's sum");
          second.join();
          if (failed) std::rethrow_exception(failed);
        } else if (w.rank() == 1) {
          pair_sum(*g.a, "a's sum");
          pair_sum(*a2, "a2's sum");
        } else {
          // Both of rank 0's waits compared twice and more.
          std::this_thread::sleep_for(8 * shardtorch::detail::check_probe_interval());
          pair_sum(*g.c, "c's sum");
        }
      },
      checked());
  EXPECT_TRUE(r.ok) << r.summary();
}

// A divergence on a rank that issued checked collectives from two threads
// in the step: its error says so and how to turn the check off (a second
// thread's collectives can differ from the peers' by timing alone); the
// rank that issued from one thread is not told.
TEST_F(Diverged, ADivergenceOnARankThatIssuedFromTwoThreadsSaysSo) {
  auto r = run_ranks(
      2,
      [](World& w) {
        if (w.rank() == 0) {
          std::exception_ptr failed;
          std::thread other([&] {
            try {
              pair_sum(w.comm(), "the evaluation's sum", 3);
            } catch (...) {
              failed = std::current_exception();
            }
          });
          other.join();
          if (failed) std::rethrow_exception(failed);
          pair_sum(w.comm(), "the loss", 3);
        } else {
          pair_sum(w.comm(), "the evaluation's sum", 3);
          pair_sum(w.comm(), "the loss", 5);
        }
      },
      checked());
  const std::string hint = "This rank issued checked collectives from two or more threads";
  expect_diverged(
      r, {"rank 0 is at all_reduce for the loss (Float[3])", "but rank 1 is at all_reduce for the loss (Float[5])"});
  EXPECT_NE(r.ranks[0].message.find(hint + " in this optimizer step or the last"), std::string::npos) << r.summary();
  EXPECT_NE(r.ranks[0].message.find("WorldOptions::check_collectives(false)"), std::string::npos) << r.summary();
  EXPECT_EQ(r.ranks[1].message.find(hint), std::string::npos) << r.summary();
}

// The check's state machine (docs/design.md, "Checking that ranks are at the
// same collective"): a collective is exchanged when it is its step's first
// or differs from the same place of the previous step; the rest launch at
// once. Counted on the world's communicator, with a step pattern that
// changes on every rank alike (an extra collective in step 5).
TEST_F(Diverged, EachCollectiveIsExchangedOnlyWhenItIsTheStepsFirstOrDiffersFromThePreviousStep) {
  auto r = run_ranks(
      2,
      [](World& w) {
        auto sum = [&](const std::string& what, int64_t n) { pair_sum(w.comm(), what, n); };
        w.note_step_done();  // the set-up's collectives are a step of their own
        // Counted after each step's first collective: by then the step's marker,
        // exchanged in the background, has run (the collective launches after it).
        ExchangesPerStep exchanges(w.comm());
        for (int step = 0; step < 8; ++step) {
          sum("a", 3);
          exchanges.count();
          if (step == 5) sum("extra", 5);
          sum("b", 4);
          auto c = torch::full({2}, static_cast<float>(w.rank()));
          w.comm().broadcast(c, 1, "c");
          if (c[0].item<float>() != 1.0f) throw std::runtime_error("wrong broadcast");
          w.note_step_done();
        }
        // From each step's a to the next's: the step's other collectives, the
        // next step's marker, and its a (never: it matches the previous step's
        // first). Step 0: b and c differ from the set-up's. Step 5: extra, b and
        // c each differ from step 4's at their place. Step 6: b and c differ
        // from step 5's.
        const std::vector<int64_t> expected{3, 1, 1, 1, 1, 4, 3};
        require_exchanges(exchanges.per_step, expected);
      },
      checked());
  EXPECT_TRUE(r.ok) << r.summary();
}

// A step keeps the patterns of its first kMaxPatternsPerStep collectives
// only (here 3), so a program that never steps holds no more: the
// collectives past the bound are exchanged in the next step too, as
// collectives that differ would be.
TEST_F(Diverged, CollectivesPastTheBoundOfKeptPatternsAreExchangedInTheNextStep) {
  auto r = run_ranks(
      2,
      [](World& w) {
        shardtorch::detail::set_max_patterns_per_step(3);
        w.note_step_done();
        ExchangesPerStep exchanges(w.comm());
        for (int step = 0; step < 6; ++step) {
          pair_sum(w.comm(), "a", 3);
          exchanges.count();
          for (const char* what : {"b", "c", "d", "e"}) pair_sum(w.comm(), what, 4);
          w.note_step_done();
        }
        // From step 1's a on: d and e (past the 3 kept of the previous step) and
        // the next step's marker. Step 0's collectives differ from the set-up's.
        require_exchanges({exchanges.per_step.begin() + 1, exchanges.per_step.end()}, {3, 3, 3, 3});
      },
      checked());
  EXPECT_TRUE(r.ok) << r.summary();
}

// shard()'s collectives are not the first step's reference: from the
// second step on, the only exchange per step on the world's communicator
// (FullShard: the all-gathers are on it) is the step's marker. Before,
// the second step exchanged every all-gather too.
TEST_F(Diverged, FromTheSecondStepOnAShardedModelExchangesOnlyTheStepsMarker) {
  auto r = run_ranks(
      2,
      [](World& w) {
        Routed m;
        auto sharded = shardtorch::shard(m, w, ShardOptions());
        auto opt = shardtorch::Adam(*m, torch::optim::AdamOptions(1e-3));
        auto x = torch::randn({4, 6});
        ExchangesPerStep exchanges(w.comm());
        for (int step = 0; step < 4; ++step) {
          opt->zero_grad();
          auto loss = m(x).square().mean();  // its all-gathers launched after the step's marker
          exchanges.count();
          loss.backward();
          opt->step();
        }
        // From step 1's forward to step 2's, and on: the next step's marker.
        require_exchanges({exchanges.per_step.begin() + 1, exchanges.per_step.end()}, {1, 1});
      },
      checked());
  EXPECT_TRUE(r.ok) << r.summary();
}

// Two optimizers stepped one after the other (two World::note_step_done
// with no collective between them): the step without collectives does not
// replace the reference, so the collectives still launch without an
// exchange; only the two markers are exchanged.
TEST_F(Diverged, TwoStepsInARowKeepTheLastStepWithCollectivesAsTheReference) {
  auto r = run_ranks(
      2,
      [](World& w) {
        auto sum = [&](const std::string& what, int64_t n) { pair_sum(w.comm(), what, n); };
        w.note_step_done();
        ExchangesPerStep exchanges(w.comm());
        for (int step = 0; step < 6; ++step) {
          sum("a", 3);
          exchanges.count();
          sum("b", 4);
          w.note_step_done();  // the first model's optimizer
          w.note_step_done();  // the second's
        }
        // Step 0: b differs from the set-up's; then the two markers of each step.
        const std::vector<int64_t> expected{3, 2, 2, 2, 2};
        require_exchanges(exchanges.per_step, expected);
      },
      checked());
  EXPECT_TRUE(r.ok) << r.summary();
}

// Each step's marker is exchanged in the background, on the checker's
// thread, as the optimizer step ends: the step's first collective then
// matches the previous step's first and launches at once, even while a peer
// is still busy before it. Before, it waited for that peer in its own
// exchange. Here the peer stays busy until rank 0 says (in the store) that
// its collective is on the backend: no wall-clock bound, and a launch that
// waits for the peer is seen as the peer giving up after 20 s.
TEST_F(Diverged, AStepsFirstCollectiveLaunchesWithoutWaitingForASlowPeer) {
  auto r = run_ranks(
      2,
      [](World& w) {
        w.note_step_done();
        bool gave_up = false;
        auto step = [&](bool slow) {
          if (slow && w.rank() == 1) {
            try {
              w.store()->wait({"test: rank 0 launched"}, std::chrono::seconds(20));
            } catch (const std::exception&) {
              gave_up = true;  // and go on, so that rank 0's exchange completes
            }
          }
          auto a = torch::ones({3});
          auto pending = w.comm().all_reduce_async(a, "a");
          w.comm().flush_launches();  // returns once "a" is on the backend
          if (slow && w.rank() == 0) w.store()->set("test: rank 0 launched", std::vector<uint8_t>{1});
          w.comm().wait(pending);
          if (a[0].item<float>() != 2.0f) throw std::runtime_error("wrong sum for a");
          auto b = torch::ones({4});
          w.comm().all_reduce(b, c10d::ReduceOp::SUM, "b");
          w.note_step_done();
        };
        for (int i = 0; i < 3; ++i) step(false);
        step(true);
        if (gave_up)
          throw std::runtime_error(
              "rank 0's first collective of the step was not launched while this rank was busy before it: it was "
              "exchanged with the slow peer");
      },
      checked());
  EXPECT_TRUE(r.ok) << r.summary();
}

// Ranks that agree for two steps and then differ in the middle of a step:
// the rank that differs exchanges while its peer launched the collective
// the previous step had there; the two waits form a cycle, and every rank
// fails naming both collectives within seconds.
TEST_F(Diverged, MicroBatchesThatDifferAfterTwoEqualStepsFailEveryRankNamingBoth) {
  for (Strategy s : {Strategy::FullShard, Strategy::NoShard, Strategy::ShardGradOp}) {
    SCOPED_TRACE(shardtorch::strategy_name(s));
    auto t0 = std::chrono::steady_clock::now();
    auto r = run_ranks(
        2,
        [s](World& w) {
          torch::manual_seed(0);
          MLP m;
          auto sharded = shardtorch::shard(m, w, ShardOptions().strategy(s));
          auto opt = shardtorch::Adam(*m, torch::optim::AdamOptions(1e-3));
          auto x = torch::randn({4, 7});
          for (int step = 0; step < 4; ++step) train_step(m, sharded, *opt, x, step == 2 && w.rank() == 0 ? 3 : 2);
        },
        checked());
    EXPECT_LT(seconds_since(t0), kWithinSeconds) << r.summary();
    if (s == Strategy::FullShard) {
      expect_diverged(r, {"rank 0 is at all_gather for parameters of unit 'l3'",
                          "step 2, in backward 2 since the last optimizer step (gradient sync off)",
                          "but rank 1 is at all_gather for parameters of unit 'l3'",
                          "step 2, in backward 2 since the last optimizer step (gradient sync on)", "neither"});
    } else {
      expect_diverged(r, {"step 2, in backward 3 since the last optimizer step (gradient sync on)", "but rank 1 is at",
                          "step 2, in backward 2 since the last optimizer step (gradient sync on)"});
    }
  }
}

// An evaluation forward on rank 0 alone (no gradients, its own batch size):
// both ranks fail naming it, and rank 0's position says it is in a forward
// without gradients and what that forward took.
TEST_F(Diverged, AnEvaluationOnOneRankIsNamedAsSuch) {
  auto r = run_ranks(
      2,
      [](World& w) {
        torch::manual_seed(0);
        MLP m;
        auto sharded = shardtorch::shard(m, w);
        auto opt = shardtorch::Adam(*m, torch::optim::AdamOptions(1e-3));
        auto x = torch::randn({4, 7});
        for (int step = 0; step < 4; ++step) {
          if (step == 2 && w.rank() == 0) {
            torch::NoGradGuard no_grad;
            m(torch::randn({2, 7}));
          }
          train_step(m, sharded, *opt, x, 1);
        }
      },
      checked());
  expect_diverged(
      r, {"rank 0 is at all_gather for parameters of unit 'l1'",
          "step 2, after 0 backwards since the last optimizer step; 1 forward without gradients (an "
          "evaluation) since the last optimizer step, the last taking Float[2, 7]",
          "but rank 1 is at all_gather for parameters of unit 'l1'", "the step's first forward took Float[4, 7]"});
}

// Three ranks, one of which routes around a unit in its third step: the
// two that launched the unit's all-gather each fail naming the one that did
// not, and it fails too.
TEST_F(Diverged, ALoneRankThatDiffersInTheMiddleOfAStepFailsEveryRankNamingIt) {
  auto t0 = std::chrono::steady_clock::now();
  auto r = run_ranks(
      3,
      [](World& w) {
        Routed m;
        auto sharded = shardtorch::shard(m, w);
        auto opt = shardtorch::Adam(*m, torch::optim::AdamOptions(1e-3));
        auto x = torch::randn({4, 6});
        for (int step = 0; step < 4; ++step) {
          m->skip_b = step == 2 && w.rank() == 1;
          train_step(m, sharded, *opt, x, 1);
        }
      },
      checked());
  EXPECT_LT(seconds_since(t0), kWithinSeconds) << r.summary();
  ASSERT_FALSE(r.ok) << r.summary();
  for (size_t k = 0; k < r.ranks.size(); ++k) {
    const auto& m = r.ranks[k].message;
    EXPECT_EQ(r.ranks[k].exit_code, 1) << r.summary();
    EXPECT_NE(m.find("shardtorch: rank " + std::to_string(k) + "/3: collectives diverged: rank "), std::string::npos)
        << r.summary();
    EXPECT_NE(m.find("rank 1 is at all_gather for parameters of unit 'c'"), std::string::npos) << r.summary();
    EXPECT_NE(m.find("is at all_gather for parameters of unit 'b'"), std::string::npos) << r.summary();
    EXPECT_NE(m.find("step 2, after 0 backwards"), std::string::npos) << r.summary();
  }
}

// A rank that steps twice after one backward: its collectives have the
// same sizes as the others' in every later step, and only the step count
// tells them apart. The next step's first collective is always exchanged.
TEST_F(Diverged, ARankThatStepsTwiceFailsAtTheNextStepsFirstCollective) {
  auto t0 = std::chrono::steady_clock::now();
  auto r = run_ranks(
      2,
      [](World& w) {
        MLP m;
        auto sharded = shardtorch::shard(m, w);
        auto opt = shardtorch::Adam(*m, torch::optim::AdamOptions(1e-3));
        auto x = torch::randn({4, 7});
        for (int step = 0; step < 4; ++step) {
          train_step(m, sharded, *opt, x, 1);
          if (step == 1 && w.rank() == 0) opt->step();
        }
      },
      checked());
  EXPECT_LT(seconds_since(t0), kWithinSeconds) << r.summary();
  // Rank 0's second step broadcasts its buffers after the step, as each step does.
  expect_diverged(r, {"rank 0 is at broadcast for buffers of dtype Float ('scale') after a step (Float[7]); step 3",
                      "but rank 1 is at all_gather for parameters of unit 'l1'", "step 2, after 0 backwards"});
}

// A slow rank in the steady state (from the third step on, collectives are
// launched without an exchange): its peer waits in a launched collective
// (backward's first: an all-gather, NoShard's all-reduce, ShardGradOp's
// reduce-scatter waited for at the end of the backward) until that wait is
// written to the store and compared several times, and nothing is wrong:
// every strategy trains on.
TEST_F(Diverged, ASlowRankInTheSteadyStateIsNoDivergence) {
  for (Strategy s : {Strategy::FullShard, Strategy::NoShard, Strategy::ShardGradOp}) {
    SCOPED_TRACE(shardtorch::strategy_name(s));
    auto r = run_ranks(
        2,
        [s](World& w) {
          torch::manual_seed(0);
          MLP m;
          auto sharded = shardtorch::shard(m, w, ShardOptions().strategy(s));
          auto opt = shardtorch::Adam(*m, torch::optim::AdamOptions(1e-3));
          auto x = torch::randn({4, 7});
          for (int step = 0; step < 4; ++step) {
            opt->zero_grad();
            auto loss = m(x).square().mean();
            if (step == 3 && w.rank() == 1) {
              // Until rank 0 has written a wait for a launched collective ("c"), then three probes more.
              auto waits = c10::make_intrusive<c10d::PrefixStore>("shardtorch-waits", w.store());
              const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
              for (;;) {
                if (waits->check({"wait/0"})) {
                  auto v = waits->get("wait/0");
                  if (std::string(v.begin(), v.end()).rfind("waiting\nc ", 0) == 0) break;
                }
                if (std::chrono::steady_clock::now() > deadline)
                  throw std::runtime_error("rank 0 never waited long in a launched collective");
                std::this_thread::sleep_for(std::chrono::milliseconds(20));
              }
              std::this_thread::sleep_for(3 * shardtorch::detail::check_probe_interval());
            }
            loss.backward();
            opt->step();
          }
        },
        checked());
    EXPECT_TRUE(r.ok) << r.summary();
  }
}

namespace {
// A check group whose exchange completes only when released (every rank's
// fingerprint then reads as this rank's): a peer that is late, or gone.
struct Gate {
  std::mutex mu;
  std::condition_variable cv;
  bool open = false;
  int entered = 0;
  bool gone = false;  // the backend was destroyed: the checker's thread has let go of it
};
class HeldWork : public c10d::Work {
 public:
  HeldWork(std::shared_ptr<Gate> gate, at::Tensor out, at::Tensor in)
      : gate_(std::move(gate)), out_(std::move(out)), in_(std::move(in)) {}
  bool wait(std::chrono::milliseconds) override {
    std::unique_lock<std::mutex> lock(gate_->mu);
    gate_->cv.wait(lock, [&] { return gate_->open; });
    out_.copy_(in_.repeat({out_.numel() / in_.numel()}));
    return true;
  }

 private:
  std::shared_ptr<Gate> gate_;
  at::Tensor out_, in_;
};
class HeldExchange : public c10d::Backend {
 public:
  explicit HeldExchange(std::shared_ptr<Gate> gate) : c10d::Backend(0, 2), gate_(std::move(gate)) {}
  ~HeldExchange() override {
    {
      std::lock_guard<std::mutex> lock(gate_->mu);
      gate_->gone = true;
    }
    gate_->cv.notify_all();
  }
  const std::string getBackendName() const override { return "held"; }
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& out, at::Tensor& in,
                                                 const c10d::AllgatherOptions&) override {
    {
      std::lock_guard<std::mutex> lock(gate_->mu);
      ++gate_->entered;
    }
    gate_->cv.notify_all();
    return c10::make_intrusive<HeldWork>(gate_, out, in);
  }

 private:
  std::shared_ptr<Gate> gate_;
};
class DoneWork : public c10d::Work {
 public:
  bool wait(std::chrono::milliseconds) override { return true; }
};
}  // namespace

// A rank that rejoins turns its check off while the checker's thread is inside
// an exchange whose peer has not come (it may come later, on the connection
// being replaced): neither that collective nor one queued behind it launches
// afterwards, on what is by then the new connection; both fail, saying why.
TEST(Snapshots, ARejoinNeverLaunchesOnTheNewConnectionWhatTheCheckHadNotLaunched) {
  auto gate = std::make_shared<Gate>();
  auto launches = std::make_shared<std::atomic<int>>(0);
  auto start = [launches]() -> c10::intrusive_ptr<c10d::Work> {
    ++*launches;
    return c10::make_intrusive<DoneWork>();
  };
  auto describe = [] { return std::string("a test collective"); };
  std::shared_ptr<shardtorch::detail::CheckedLaunch> first, second;
  {
    shardtorch::detail::CollectiveChecker checker(c10::make_intrusive<HeldExchange>(gate), 0, 2);
    std::vector<int64_t> a(shardtorch::detail::kPatternSize, 1), b(shardtorch::detail::kPatternSize, 2);
    first = checker.submit(a, 0, describe, start, std::chrono::seconds(30));
    second = checker.submit(b, 0, describe, start, std::chrono::seconds(30));
    {
      std::unique_lock<std::mutex> lock(gate->mu);
      ASSERT_TRUE(gate->cv.wait_for(lock, std::chrono::seconds(10), [&] { return gate->entered == 1; }))
          << "the checker's thread never began the first exchange";
    }
    checker.cancel_launches("cancelled by the test");
  }  // the thread inside the exchange is left to finish it
  {
    std::lock_guard<std::mutex> lock(gate->mu);
    gate->open = true;
  }
  gate->cv.notify_all();
  for (auto* c : {&first, &second}) {
    try {
      (*c)->launched(/*probe=*/false);
      ADD_FAILURE() << "a cancelled collective was launched";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("cancelled by the test"), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(*launches, 0);
  // The detached checker thread ends with the exchange it ran: wait for it,
  // so that it does not outlive the test (nor the process).
  std::unique_lock<std::mutex> lock(gate->mu);
  EXPECT_TRUE(gate->cv.wait_for(lock, std::chrono::seconds(10), [&] { return gate->gone; }))
      << "the checker's thread still holds its check group";
}

// A group of one rank (a mesh dimension of size 1) has no peer to differ
// from: its collectives are done on the calling thread at once (a copy or
// nothing), without a fingerprint exchange, and give what the backend would.
TEST_F(Diverged, AGroupOfOneRankDoesItsCollectivesAtOnceWithoutAnExchange) {
  auto r = run_ranks(2, [](World& w) {
    auto mesh = shardtorch::DeviceMesh::create(w.shared_from_this(), {{"pp", 2}, {"dp", 1}});
    auto& one = (*mesh)["dp"]->comm();
    auto& two = (*mesh)["pp"]->comm();
    auto in = torch::arange(6, torch::kFloat) + w.rank();
    one.reset_stats();  // setting the group up all-reduced on it
    for (int step = 0; step < 2; ++step) {
      auto gathered = torch::full({6}, -1.0f), scattered = torch::full({6}, -1.0f), summed = in.clone(),
           sent = in.clone(), pair = in.clone();
      one.all_gather_into(gathered, in, "test: gather");
      one.reduce_scatter_into(scattered, in, "test: scatter");
      one.all_reduce(summed, c10d::ReduceOp::SUM, "test: sum");
      one.broadcast(sent, 0, "test: broadcast");
      two.all_reduce(pair, c10d::ReduceOp::SUM, "test: the pair's sum");
      for (const auto* t : {&gathered, &scattered, &summed, &sent})
        require(torch::equal(*t, in), "a collective of one rank changed its data");
      require(torch::equal(pair, 2 * torch::arange(6, torch::kFloat) + 1), "the pair's sum is wrong");
      // Launched is done: nothing is left for another thread.
      auto again = torch::full({6}, -1.0f);
      auto p = one.all_gather_async(again, in, "test: gather, asynchronously");
      require(p.work && p.work->isCompleted(), "the gather of one rank was still running after its launch");
      one.wait(p);
      require(torch::equal(again, in), "the asynchronous gather of one rank changed its data");
    }
    require(one.stats().all_gather.calls == 4 && one.stats().reduce_scatter.calls == 2 &&
                one.stats().all_reduce.calls == 2 && one.stats().broadcast.calls == 2,
            "the group of one did not count its collectives");
    require(one.check_exchanges() == 0,
            "the group of one exchanged fingerprints " + std::to_string(one.check_exchanges()) + " times");
    require(!w.checks_collectives() || two.check_exchanges() > 0, "the pair's collectives were not checked");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}
