// Fault tolerance against torchft's real lighthouse (started here from the
// torchft wheel that scripts/setup.sh pins): the gRPC client inside a process
// that runs LibTorch, and replica groups that train as one process would.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <netinet/in.h>
#include <unistd.h>

#include <c10/util/StringUtil.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/nn/modules/linear.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adamw.h>

#include <chrono>
#include <cstdlib>
#include <cstdio>
#include <functional>
#include <future>
#include <map>
#include <optional>
#include <set>
#include <thread>

#include "ft/ft_support.h"
#include "ft/lighthouse_client.h"
#include "optim/optimizer_state.h"
#include "progress_helpers.h"
#include "shardtorch/error.h"
#include "shardtorch/ft.h"
#include "shardtorch/shardtorch.h"
#include "shardtorch/testing.h"

namespace {
using namespace ftsupport;
using shardtorch::World;
using shardtorch::ft::detail::LighthouseClient;
using shardtorch::ft::detail::Member;
using namespace std::chrono_literals;

Member member(const std::string& id, int64_t step) { return Member{id, "", "127.0.0.1:1", step, 1, "{}"}; }

// Runs `body` in a forked process, so that the gRPC it uses stays out of
// this one, whose later tests fork ranks that use gRPC (it does not survive
// a fork). Its GoogleTest failures, printed there, fail the test here.
void in_child(const std::function<void()>& body) {
  auto r = shardtorch::testing::run_ranks(1, [&](World&) {
    body();
    if (::testing::Test::HasFailure()) throw std::runtime_error("the checks above failed in the child");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

TEST(FtLighthouse, GrpcClientAndLibTorchWorkInOneProcess) {
  // protobuf objects made and parsed by the client, tensors and a Gloo
  // all-reduce of LibTorch (which exports some protobuf symbols of its own),
  // in the same process.
  Lighthouse lh(2);
  auto r = shardtorch::testing::run_ranks(2, [&](World& w) {
    LighthouseClient c(lh.address());
    auto q = c.quorum(member("g" + std::to_string(w.rank()) + ":r", 7 + w.rank()), 20s);
    auto t = at::full({4}, static_cast<float>(w.rank() + 1));
    w.comm().all_reduce(t, c10d::ReduceOp::SUM, "test");
    if (t[0].item<float>() != 3.f) throw std::runtime_error("all-reduce gave " + std::to_string(t[0].item<float>()));
    if (q.participants.size() != 2 || q.participants[1].step != 8)
      throw std::runtime_error("quorum of " + std::to_string(q.participants.size()));
  });
  ASSERT_TRUE(r.ok) << r.summary();
  // A lighthouse of their own: on the first, the children's replicas still
  // count as alive, and two newcomers are not a majority of four.
  Lighthouse lh2(2);
  in_child([&] {
    auto x = at::arange(10, at::kFloat);
    LighthouseClient a(lh2.address()), b("http://" + lh2.address());
    auto fa = std::async(std::launch::async, [&] { return a.quorum(member("g0:a", 3), 20s); });
    auto qb = b.quorum(member("g1:b", 5), 20s);
    auto qa = fa.get();
    b.heartbeat("g1:b", 5s);
    EXPECT_EQ(qa.quorum_id, qb.quorum_id);
    ASSERT_EQ(qa.participants.size(), 2u);
    EXPECT_EQ(qa.participants[0].replica_id, "g0:a");
    EXPECT_EQ(qa.participants[1].replica_id, "g1:b");
    EXPECT_EQ(qa.participants[1].step, 5);
    EXPECT_EQ(qa.participants[0].data, "{}");
    EXPECT_EQ(x.sum().item<float>(), 45.f);
  });
}

// A process forked after gRPC was used in it gets an error that says so from
// a new client and from one it inherited, not calls that hang.
TEST(FtLighthouse, AProcessForkedAfterGrpcWasUsedIsRefusedNotLeftHanging) {
  in_child([] {
    LighthouseClient used("127.0.0.1:" + std::to_string(free_port()));
    const pid_t child = ::fork();
    if (child == 0) {
      int code = 0;
      const auto refused = [&](const std::function<void()>& call, int bit) {
        try {
          call();
        } catch (const shardtorch::Error& e) {
          const std::string m = e.what();
          if (m.find("was forked from pid " + std::to_string(::getppid()) + " after that one had used gRPC") !=
                  std::string::npos &&
              m.find("in the ranks and never in the parent") != std::string::npos)
            return;
        } catch (...) {
        }
        code |= bit;
      };
      refused([] { LighthouseClient fresh("127.0.0.1:1"); }, 1);
      refused([&] { used.heartbeat("g0:x", 1s); }, 2);
      refused([&] { used.quorum(member("g0:x", 0), 1s); }, 4);
      ::_exit(code);
    }
    int status = 0;
    ASSERT_EQ(::waitpid(child, &status, 0), child);
    ASSERT_TRUE(WIFEXITED(status)) << status;
    EXPECT_EQ(WEXITSTATUS(status), 0) << "bits: 1 a new client, 2 heartbeat, 4 quorum; set: not refused";
  });
}

TEST(FtLighthouse, UnreachableLighthouseIsAClearErrorWithinTheTimeout) {
  in_child([] {
    LighthouseClient c("127.0.0.1:" + std::to_string(free_port()));  // nothing listens there
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<std::string> warnings;  // the refusals are said before the timeout ends
    c.set_warn([&](const std::string& w) { warnings.push_back(w); });
    try {
      c.quorum(member("g0:x", 0), 700ms);
      FAIL() << "no error";
    } catch (const shardtorch::Error& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("lighthouse at 127.0.0.1:"), std::string::npos) << m;
      EXPECT_NE(m.find("700 ms"), std::string::npos) << m;
      EXPECT_NE(m.find("torchft_lighthouse"), std::string::npos) << m;
    }
    ASSERT_EQ(warnings.size(), 1u);
    EXPECT_NE(warnings[0].find(" refused "), std::string::npos) << warnings[0];
    EXPECT_NE(warnings[0].find("Is torchft_lighthouse running there"), std::string::npos) << warnings[0];
    // Bounded by the timeout (with a wide margin for a loaded machine), not gRPC's own defaults.
    EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s);
  });
}

// Connected (the lighthouse may take a moment to listen): a request sent
// next is then in flight, not waiting for the channel.
void wait_until_connected(LighthouseClient& c, const std::string& replica_id) {
  for (auto until = std::chrono::steady_clock::now() + 20s;;) {
    try {
      c.heartbeat(replica_id, 5s);
      return;
    } catch (const shardtorch::Error&) {
      if (std::chrono::steady_clock::now() > until) throw;
      std::this_thread::sleep_for(50ms);
    }
  }
}

// A request in flight when the lighthouse dies is sent again until its
// timeout; if no lighthouse comes back, it says so: not only "no quorum
// within the timeout", but that the lighthouse closed the connection, when.
TEST(FtLighthouse, ARequestTheLighthouseDropsSaysWhatEndedItAndAfterHowLong) {
  in_child([] {
    Lighthouse lh(2);  // one client alone: its request waits
    LighthouseClient c(lh.address());
    wait_until_connected(c, "g0:x");
    const auto t0 = std::chrono::steady_clock::now();
    auto pending = std::async(std::launch::async, [&] { return c.quorum(member("g0:x", 0), 3000ms); });
    ASSERT_EQ(pending.wait_for(500ms), std::future_status::timeout) << "a quorum of one with --min_replicas 2";
    lh.stop();
    try {
      pending.get();
      FAIL() << "no error";
    } catch (const shardtorch::Error& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("within 3000 ms"), std::string::npos) << m;
      const auto first = m.find("closed the connection 1 time (first after ");
      ASSERT_NE(first, std::string::npos) << m;
      EXPECT_LT(std::stoll(m.substr(first + 42)), 3000) << m;  // the lighthouse's death, not the timeout
      EXPECT_NE(m.find("may have died or been restarted"), std::string::npos) << m;
    }
    EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s);  // the request's timeout, with a margin
  });
}

// A request in flight when the lighthouse is restarted on its address goes
// on under the new one: it joins the quorum a second client asks for there.
TEST(FtLighthouse, ARequestInFlightGoesOnUnderALighthouseRestartedOnItsAddress) {
  in_child([] {
    Lighthouse lh(2);
    LighthouseClient a(lh.address()), b(lh.address());
    wait_until_connected(a, "g0:a");
    auto pending = std::async(std::launch::async, [&] { return a.quorum(member("g0:a", 3), 30s); });
    ASSERT_EQ(pending.wait_for(500ms), std::future_status::timeout) << "a quorum of one with --min_replicas 2";
    lh.restart();
    const auto qb = b.quorum(member("g1:b", 3), 30s);
    const auto qa = pending.get();
    EXPECT_EQ(qa.quorum_id, qb.quorum_id);
    ASSERT_EQ(qa.participants.size(), 2u);
    EXPECT_EQ(qa.participants[0].replica_id, "g0:a");
    EXPECT_EQ(qa.participants[1].replica_id, "g1:b");
  });
}

void two_groups_train_like_one_process(int ranks, shardtorch::ShardOptions shard, bool prefetch = false) {
  Lighthouse lh(2);
  auto r = shardtorch::testing::run_ranks(2 * ranks, [&](World& all) {
    GroupRun run;
    run.shard = shard;
    run.prefetch = prefetch;
    auto got = train_group(all, ranks, lh.address(), run);
    // Step 0 counts one group (the other starts from its weights); later steps both.
    if (got.counted.size() != 6u || got.counted[0].size() != 1 || got.counted[5] != "01")
      throw std::runtime_error("counted groups per step: " + c10::Join(",", got.counted));
    // One quorum throughout: its cross-replica group is built once.
    if (got.rebuilt != 1)
      throw std::runtime_error("the cross-replica group was built " + std::to_string(got.rebuilt) + " times");
    check_against_replay(all, ranks, got);
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

shardtorch::ShardOptions shard_options(shardtorch::Strategy s) { return shardtorch::ShardOptions().strategy(s); }

TEST(FtManager, TwoNoShardGroupsTrainLikeOneProcess) {
  two_groups_train_like_one_process(1, shard_options(shardtorch::Strategy::NoShard));
}

TEST(FtManager, TwoNoShardGroupsOfTwoRanksTrainLikeOneProcess) {
  two_groups_train_like_one_process(2, shard_options(shardtorch::Strategy::NoShard));
}

TEST(FtManager, TwoNoShardGroupsOfTwoRanksTrainLikeOneProcessWithThePrefetchedQuorum) {
  two_groups_train_like_one_process(2, shard_options(shardtorch::Strategy::NoShard), /*prefetch=*/true);
}

TEST(FtManager, TwoFullShardGroupsOfTwoRanksTrainLikeOneProcess) {
  two_groups_train_like_one_process(2, shard_options(shardtorch::Strategy::FullShard));
}

TEST(FtManager, TwoShardGradOpGroupsOfTwoRanksTrainLikeOneProcess) {
  two_groups_train_like_one_process(2, shard_options(shardtorch::Strategy::ShardGradOp));
}

TEST(FtManager, TwoOptimizerOnlyGroupsOfTwoRanksTrainLikeOneProcess) {
  two_groups_train_like_one_process(2, shard_options(shardtorch::Strategy::OptimizerOnly));
}

// Each group: 2 shard groups of 2 ranks, replicated twice inside the group.
TEST(FtManager, TwoHybridShardGroupsOfFourRanksTrainLikeOneProcess) {
  two_groups_train_like_one_process(4, shard_options(shardtorch::Strategy::HybridShard).hybrid_shard_size(2));
}

// The optimizer steps on the CPU, from host-held masters and state.
TEST(FtManager, TwoFullShardGroupsWithCpuOffloadTrainLikeOneProcess) {
  two_groups_train_like_one_process(2, shard_options(shardtorch::Strategy::FullShard).cpu_offload(true));
}

void group_that_lost_its_state_heals(int ranks, shardtorch::ShardOptions shard) {
  Lighthouse lh(2);
  auto r = shardtorch::testing::run_ranks(2 * ranks, [&](World& all) {
    GroupRun run;
    run.shard = shard;
    run.after_step = group_1_loses_its_state_after_step_3;
    // Each heal's progress, as the library-wide callback receives it.
    std::vector<std::vector<shardtorch::ProgressUpdate>> heals;
    shardtorch::set_progress_callback([&heals](const shardtorch::ProgressUpdate& u) {
      if (u.operation != "heal") return;
      if (heals.empty() || heals.back().back().finished) heals.emplace_back();
      heals.back().push_back(u);
    });
    auto got = train_group(all, ranks, lh.address(), run);
    shardtorch::set_progress_callback(nullptr);
    // Step 3 counted group 0 alone (group 1 was healed), the steps after it both.
    if (got.counted.size() != 6u || got.counted[3] != "0" || got.counted[4] != "01")
      throw std::runtime_error("counted groups per step: " + c10::Join(",", got.counted));
    check_against_replay(all, ranks, got);
    // The healed group's ranks reported the tensors and bytes they received.
    if (all.rank() / ranks == 1) {
      const std::string at = "rank " + std::to_string(all.rank());
      testmodels::require(!heals.empty(), at + ": the heal reported no progress");
      for (const auto& h : heals) {
        testmodels::require_progress(h, "heal", at);
        testmodels::require(h.back().bytes_done > 0, at + ": the heal received no bytes");
      }
    }
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

TEST(FtManager, ShardGradOpGroupThatLostItsStateHealsShardMatched) {
  group_that_lost_its_state_heals(2, shard_options(shardtorch::Strategy::ShardGradOp));
}

TEST(FtManager, OptimizerOnlyGroupThatLostItsStateHealsShardMatched) {
  group_that_lost_its_state_heals(2, shard_options(shardtorch::Strategy::OptimizerOnly));
}

TEST(FtManager, HybridShardGroupThatLostItsStateHealsShardMatched) {
  group_that_lost_its_state_heals(4, shard_options(shardtorch::Strategy::HybridShard).hybrid_shard_size(2));
}

TEST(FtManager, ShardGradOpGroupWithCpuOffloadThatLostItsStateHealsShardMatched) {
  group_that_lost_its_state_heals(2, shard_options(shardtorch::Strategy::ShardGradOp).cpu_offload(true));
}

// As above, but the heal at group 0's step 3 fails on group 1's rank 1 alone
// (loading its user state throws, once): the vote fails, and rank 0, whose
// heal succeeded, goes back to its own step 1 with rank 1. The next quorum
// heals the whole group again (at step 4, counting group 0 alone); then
// every rank of both groups ends bitwise alike.
TEST(FtManager, AVoteThatFailsAfterAHealPutsEveryRankBackOnItsOwnStep) {
  Lighthouse lh(2);
  auto r = shardtorch::testing::run_ranks(4, [&](World& all) {
    GroupRun run;
    run.shard = shard_options(shardtorch::Strategy::ShardGradOp);
    run.after_step = group_1_loses_its_state_after_step_3;
    bool thrown = false;
    run.setup = [&thrown](int g, int rank, shardtorch::ft::Manager& m) {
      m.set_user_state([&m] { return std::to_string(m.step()); },
                       [g, rank, &thrown](const std::string& step) {
                         if (g != 1 || rank != 1 || step != "3" || thrown) return;
                         thrown = true;
                         throw std::runtime_error("injected: group 1 rank 1 could not load the user state of step 3");
                       });
    };
    auto got = train_group(all, 2, lh.address(), run);
    const int g = all.rank() / 2;
    const std::vector<int64_t> want_failed = g == 1 ? std::vector<int64_t>{1} : std::vector<int64_t>{};
    if (got.failed != want_failed)
      throw std::runtime_error("step() after each failed vote: {" + c10::Join(",", got.failed) + "}");
    const auto want = g == 1 ? std::vector<std::string>{"0", "01", "01", "0", "01"}
                             : std::vector<std::string>{"0", "01", "01", "0", "0", "01"};
    if (got.counted != want) throw std::runtime_error("counted groups per step: " + c10::Join(",", got.counted));
    for (auto& [name, t] : got.params) require_alike(all, t, name);
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

TEST(FtManager, OptimizerSteppingDuringTheBackwardIsRefused) {
  // It would update before the group's vote.
  Lighthouse lh(1);
  auto r = shardtorch::testing::run_ranks(1, [&](World& w) {
    at::manual_seed(0);
    Net model(8);
    shardtorch::shard(*model, w, shard_options(shardtorch::Strategy::FullShard).cpu_offload(true));
    auto opt = shardtorch::ShardedOptimizer::make<shardtorch::FusedAdamW>(*model, torch::optim::AdamWOptions(1e-2));
    shardtorch::ft::Manager m(w.shared_from_this(), *model, *opt,
                              shardtorch::ft::ManagerOptions().lighthouse(lh.address()).replica_group("0").log(false));
    opt->overlap_with_backward();
    try {
      m.start_step();
    } catch (const shardtorch::Error& e) {
      if (std::string(e.what()).find("overlap_with_backward") != std::string::npos &&
          std::string(e.what()).find("group '0'") != std::string::npos)
        return;
      throw;
    }
    throw std::runtime_error("start_step() let the optimizer step during the backward");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// Two groups of one rank that differ as `run` says: should_commit() throws
// on both, naming both groups and each of `words`.
void groups_fail_naming_both(GroupRun run, const std::vector<std::string>& words) {
  Lighthouse lh(2);
  auto r = shardtorch::testing::run_ranks(2, [&](World& all) {
    try {
      run.steps = 2;
      train_group(all, 1, lh.address(), run);
    } catch (const shardtorch::Error& e) {
      const std::string m = e.what();
      bool named = m.find("replica groups '") != std::string::npos && m.find("'0'") != std::string::npos &&
                   m.find("'1'") != std::string::npos;
      for (const auto& w : words) named = named && m.find(w) != std::string::npos;
      if (named) return;
      throw std::runtime_error("unexpected error: " + m);
    }
    throw std::runtime_error("no error for groups that differ");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

TEST(FtManager, GroupsWithDifferentModelsFailNamingBothGroups) {
  GroupRun run;
  run.shard = shard_options(shardtorch::Strategy::NoShard);
  run.hidden_for_group1 = 9;
  groups_fail_naming_both(run, {"configured differently", "parameters: '"});
}

// Group 1 computes and reduces its gradients in bf16, group 0 in fp32: the
// first quorum refuses them (the buckets they would all-reduce differ in dtype).
TEST(FtManager, GroupsWithDifferentMixedPrecisionFailNamingBothGroupsAndDtypes) {
  GroupRun run;
  run.shard = shard_options(shardtorch::Strategy::NoShard);
  run.shard_for_group1 = shard_options(shardtorch::Strategy::NoShard)
                             .mixed_precision(shardtorch::MixedPrecision().param_dtype(at::kBFloat16));
  groups_fail_naming_both(run, {"no mixed precision", "parameters in BFloat16"});
}

// One step of a group of this World's ranks: what should_commit() threw
// ("" if nothing), how long after start_step(), and the step count after it.
struct FirstStep {
  std::string error;
  std::chrono::steady_clock::duration took{};
  int64_t step = 0;
};

FirstStep first_step(World& w, shardtorch::Strategy strategy, shardtorch::ft::ManagerOptions options) {
  at::manual_seed(0);
  Net model(8);
  shardtorch::shard(model, w, shardtorch::ShardOptions().strategy(strategy));
  auto opt = shardtorch::AdamW(*model, torch::optim::AdamWOptions(1e-2));
  shardtorch::ft::Manager m(w.shared_from_this(), *model, *opt, options.replica_group("0").log(false));
  FirstStep out;
  const auto t0 = std::chrono::steady_clock::now();
  m.start_step();
  model->forward(batch_x(0, w.rank(), 0)).pow(2).mean().backward();
  try {
    m.should_commit();
  } catch (const shardtorch::Error& e) {
    out.error = e.what();
  }
  out.took = std::chrono::steady_clock::now() - t0;
  out.step = m.step();
  return out;
}

TEST(FtManager, UnreachableLighthouseFailsEveryRankWithinTheQuorumTimeout) {
  const std::string nowhere = "127.0.0.1:" + std::to_string(free_port());
  auto r = shardtorch::testing::run_ranks(2, [&](World& w) {
    auto s =
        first_step(w, shardtorch::Strategy::FullShard,
                   shardtorch::ft::ManagerOptions().lighthouse(nowhere).quorum_timeout(std::chrono::milliseconds(800)));
    if (s.error.empty()) throw std::runtime_error("no error without a lighthouse");
    if (s.error.find("lighthouse at " + nowhere) == std::string::npos || s.error.find("group '0'") == std::string::npos)
      throw std::runtime_error("unexpected error: " + s.error);
    if (s.took > 15s) throw std::runtime_error("the error came after the timeout");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

TEST(FtManager, RestartedGroupWithNoLiveStateFailsInsteadOfTrainingFromScratch) {
  Lighthouse lh(1);
  auto r = shardtorch::testing::run_ranks(1, [&](World& w) {
    auto s = first_step(w, shardtorch::Strategy::NoShard,
                        shardtorch::ft::ManagerOptions().lighthouse(lh.address()).restarted(true));
    if (s.error.empty()) throw std::runtime_error("a restarted group with nobody to heal from trained on");
    if (s.error.find("was restarted and none has committed a step") == std::string::npos)
      throw std::runtime_error("unexpected error: " + s.error);
    if (s.step != 0) throw std::runtime_error("the step count moved");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// The step's state machine: calls out of order are refused, naming the
// call, and a should_commit() that throws still ends the step (the next
// start_step() is not "twice").
TEST(FtManager, CallsOutOfOrderAreRefusedAndAThrownDecisionEndsTheStep) {
  Lighthouse lh(1);
  auto r = shardtorch::testing::run_ranks(1, [&](World& w) {
    at::manual_seed(0);
    Net model(8);
    shardtorch::shard(model, w, shardtorch::ShardOptions().strategy(shardtorch::Strategy::NoShard));
    auto opt = shardtorch::AdamW(*model, torch::optim::AdamWOptions(1e-2));
    // Restarted with nobody to heal from: every should_commit() throws.
    shardtorch::ft::Manager m(
        w.shared_from_this(), *model, *opt,
        shardtorch::ft::ManagerOptions().lighthouse(lh.address()).replica_group("0").restarted(true).log(false));
    auto refused = [](const std::function<void()>& call, const std::string& why) {
      try {
        call();
      } catch (const shardtorch::Error& e) {
        if (std::string(e.what()).find(why) == std::string::npos)
          throw std::runtime_error("expected '" + why + "', got: " + e.what());
        return;
      }
      throw std::runtime_error("not refused: " + why);
    };
    refused([&] { m.should_commit(); }, "should_commit() without start_step()");
    m.start_step();
    refused([&] { m.start_step(); }, "start_step() twice without should_commit()");
    refused([&] { m.set_step(5); }, "between steps");
    model->forward(batch_x(0, w.rank(), 0)).pow(2).mean().backward();
    refused([&] { m.should_commit(); }, "was restarted and none has committed a step");
    m.set_step(0);
    m.start_step();
    refused([&] { m.should_commit(); }, "was restarted and none has committed a step");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// One step of a manager's loop; returns should_commit()'s answer.
bool one_step(shardtorch::ft::Manager& m, Net& model, shardtorch::ShardedOptimizer& opt, int64_t group, int rank) {
  m.start_step();
  opt.zero_grad();
  model->forward(batch_x(group, rank, m.step() % 50)).pow(2).mean().backward();
  const bool committed = m.should_commit();
  if (committed) opt.step();
  return committed;
}

TEST(FtManager, NextQuorumAskedForBeforeSetStepIsAskedForAgain) {
  // should_commit() asks for the next step's quorum at once. Group 0 then
  // moves its step to 100: the lighthouse must learn of it in the very next
  // step, where group 1 (at step 3) is healed from group 0.
  Lighthouse lh(2);
  auto r = shardtorch::testing::run_ranks(2, [&](World& all) {
    auto world = group_world(all, 1);
    const int g = all.rank();
    at::manual_seed(0);
    Net model(8);
    shardtorch::shard(*model, world, shardtorch::ShardOptions().strategy(shardtorch::Strategy::NoShard));
    auto opt = shardtorch::AdamW(*model, torch::optim::AdamWOptions(1e-2));
    shardtorch::ft::Manager m(world, *model, *opt,
                              shardtorch::ft::ManagerOptions()
                                  .lighthouse(lh.address())
                                  .replica_group(std::to_string(g))
                                  .log(false)
                                  .timeout(5s)
                                  .quorum_timeout(10s)
                                  .prefetch_quorum(true));
    for (int i = 0; i < 3; ++i)
      if (!one_step(m, model, *opt, g, 0)) throw std::runtime_error("step " + std::to_string(i) + " not committed");
    if (g == 0) {
      m.set_step(100);
      one_step(m, model, *opt, g, 0);
      const auto& rep = m.last_step();
      if (!rep.committed || rep.step != 100 || rep.healed != std::vector<std::string>{"1"})
        throw std::runtime_error("the step after set_step(100) was step " + std::to_string(rep.step) + ", healed " +
                                 c10::Join(",", rep.healed) + ": the lighthouse got the old step");
    } else {
      // Its next step may fail (group 0 dropped the quorum it had asked for); then it is healed.
      for (int i = 0; i < 4 && m.step() < 100; ++i) one_step(m, model, *opt, g, 0);
      if (m.step() != 101) throw std::runtime_error("group 1 is at step " + std::to_string(m.step()) + ", not 101");
    }
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

TEST(FtManager, DestructorReturnsAtOnceWhileTheNextQuorumIsUnanswered) {
  // After a commit the next step's quorum is in flight; a lighthouse that
  // stopped answering must not hold the program's exit for the quorum timeout.
  Lighthouse lh(1);
  auto r = shardtorch::testing::run_ranks(1, [&](World& w) {
    at::manual_seed(0);
    Net model(8);
    shardtorch::shard(*model, w, shardtorch::ShardOptions().strategy(shardtorch::Strategy::NoShard));
    auto opt = shardtorch::AdamW(*model, torch::optim::AdamWOptions(1e-2));
    std::chrono::steady_clock::time_point t0;
    {
      shardtorch::ft::Manager m(w.shared_from_this(), *model, *opt,
                                shardtorch::ft::ManagerOptions()
                                    .lighthouse(lh.address())
                                    .replica_group("0")
                                    .log(false)
                                    .quorum_timeout(30s)
                                    .prefetch_quorum(true));
      m.start_step();
      opt->zero_grad();
      model->forward(batch_x(0, 0, 0)).pow(2).mean().backward();  // this step's quorum is answered here
      lh.pause();
      if (!m.should_commit()) throw std::runtime_error("step 0 not committed");
      t0 = std::chrono::steady_clock::now();
    }
    const auto took = std::chrono::steady_clock::now() - t0;
    lh.resume();
    if (took > 5s)
      throw std::runtime_error("~Manager took " +
                               std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(took).count()) +
                               " ms");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

TEST(FtSampler, EachGroupReadsItsOwnPartAndTheSameAfterAHeal) {
  shardtorch::ft::ReplicaSampler g0(120, 3, 0, 0, 1, 8), g1(120, 3, 1, 0, 1, 8), g1again(120, 3, 1, 0, 1, 8);
  for (int64_t s = 0; s < 12; ++s) {
    for (auto i : g0.batch(s)) EXPECT_TRUE(i >= 0 && i < 40);
    for (auto i : g1.batch(s)) EXPECT_TRUE(i >= 40 && i < 80);
    EXPECT_EQ(g1.batch(s), g1again.batch(s));
  }
  EXPECT_NE(g1.batch(0), g1.batch(1));
  EXPECT_THROW(shardtorch::ft::ReplicaSampler(2, 3, 0, 0, 1, 8), shardtorch::Error);
}

}  // namespace

namespace {

// The cross-replica rendezvous names of a store's keys ("shardtorch-ft/NAME/...").
std::set<std::string> rendezvous_names(const std::vector<std::string>& keys) {
  std::set<std::string> out;
  for (const auto& key : keys)
    if (key.rfind("shardtorch-ft/", 0) == 0) out.insert(key.substr(14, key.find('/', 14) - 14));
  return out;
}

}  // namespace

// Each new quorum of several groups builds its cross-replica group through a
// rendezvous in the first counted group's store (served by its rank 0). The
// earlier quorums' keys leave that store once a step committed on the new
// group; before, they stayed, one set per reconfiguration. Group 1 leaves
// and comes back three times (a new Manager, as a restart would make).
TEST(FtManager, EarlierQuorumsRendezvousKeysLeaveTheStore) {
  Lighthouse lh(1, /*heartbeat_timeout_ms=*/1000);
  auto r = shardtorch::testing::run_ranks(2, [&](World& all) {
    auto world = group_world(all, 1);
    const int g = all.rank();
    at::manual_seed(0);
    Net model(8);
    shardtorch::shard(*model, world, shardtorch::ShardOptions().strategy(shardtorch::Strategy::NoShard));
    auto opt = shardtorch::AdamW(*model, torch::optim::AdamWOptions(1e-2));
    auto options = [&](bool restarted) {
      return shardtorch::ft::ManagerOptions()
          .lighthouse(lh.address())
          .replica_group(std::to_string(g))
          .log(false)
          .timeout(5s)
          .quorum_timeout(20s)
          .restarted(restarted);
    };
    if (g == 1) {
      // Not before group 0 trains: alone (the lighthouse needs one group), the first life would train by itself.
      all.store()->wait({"group 0 up"}, 60s);
      for (int life = 0; life < 3; ++life) {
        shardtorch::ft::Manager m(world, *model, *opt, options(life > 0));
        for (int committed = 0; committed < 2;) committed += one_step(m, model, *opt, g, 0) ? 1 : 0;
      }
      all.store()->set("group 1 done", "1");
      return;
    }
    shardtorch::ft::Manager m(world, *model, *opt, options(false));
    int rebuilt = 0;
    while (!all.store()->check({"group 1 done"})) {
      if (one_step(m, model, *opt, g, 0) && m.step() == 1) all.store()->set("group 0 up", "1");
      if (m.last_step().reconfigured && m.last_step().counted.size() + m.last_step().healed.size() == 2) ++rebuilt;
    }
    const auto quorums = rendezvous_names(shardtorch::ft::detail::served_store_keys(m));
    if (rebuilt < 3)
      throw std::runtime_error("group 0 built " + std::to_string(rebuilt) + " groups with group 1, not 3");
    if (quorums.size() > 1)
      throw std::runtime_error("group 0's store holds the rendezvous of " + std::to_string(quorums.size()) +
                               " quorums, not just the last one's");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// A restarted group's earlier incarnation is still a participant until the
// lighthouse's heartbeat timeout: here a bare client stands in for it
// (replica '1:stale'). The quorum holds two replicas of group 1; the step
// fails at once naming both, instead of waiting `timeout` in a rendezvous
// the dead one never joins.
TEST(FtManager, AQuorumWithTwoReplicasOfOneGroupFailsTheStepAtOnce) {
  Lighthouse lh(2);
  auto r = shardtorch::testing::run_ranks(1, [&](World& w) {
    LighthouseClient stale(lh.address());
    auto pending = std::async(std::launch::async, [&] {
      return stale.quorum(
          Member{"1:stale", "", "127.0.0.1:1", 0, 1,
                 R"({"group":"1","config":[["strategy","x"]],"restarted":false,"held":"","nonce":"0"})"},
          20s);
    });
    at::manual_seed(0);
    Net model(8);
    shardtorch::shard(*model, w, shardtorch::ShardOptions().strategy(shardtorch::Strategy::NoShard));
    auto opt = shardtorch::AdamW(*model, torch::optim::AdamWOptions(1e-2));
    shardtorch::ft::Manager m(w.shared_from_this(), *model, *opt,
                              shardtorch::ft::ManagerOptions()
                                  .lighthouse(lh.address())
                                  .replica_group("1")
                                  .log(false)
                                  .timeout(30s)
                                  .quorum_timeout(20s));
    const auto t0 = std::chrono::steady_clock::now();
    const bool committed = one_step(m, model, *opt, 1, 0);
    const auto took = std::chrono::steady_clock::now() - t0;
    pending.get();
    const std::string& e = m.last_step().error;
    if (committed) throw std::runtime_error("a step with a dead replica in its quorum committed");
    if (e.find("holds two replicas of group '1' ('1:") == std::string::npos || e.find("'1:stale'") == std::string::npos)
      throw std::runtime_error("unexpected error: " + e);
    if (took > 5s)
      throw std::runtime_error("the step failed only after " +
                               std::to_string(std::chrono::duration<double>(took).count()) + " s");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// Every hyperparameter of every parameter group takes part in the
// comparison across groups: changing any one changes the description of
// the optimizer, which names its value.
TEST(FtConfiguration, EveryHyperparameterOfEveryParamGroupIsCompared) {
  auto r = shardtorch::testing::run_ranks(1, [&](World& w) {
    at::manual_seed(0);
    Net model(8);
    shardtorch::shard(*model, w, shard_options(shardtorch::Strategy::NoShard));
    using torch::optim::AdamOptions;
    using torch::optim::AdamWOptions;
    using torch::optim::SGDOptions;
    using Make = std::function<std::unique_ptr<shardtorch::ShardedOptimizer>()>;
    auto adamw = [&](AdamWOptions o) -> Make { return [&model, o] { return shardtorch::AdamW(*model, o); }; };
    auto adam = [&](AdamOptions o) -> Make { return [&model, o] { return shardtorch::Adam(*model, o); }; };
    auto sgd = [&](SGDOptions o) -> Make { return [&model, o] { return shardtorch::SGD(*model, o); }; };
    auto describe = [](const Make& make) { return shardtorch::detail::describe_optimizer(*make()); };
    const AdamWOptions w0(1e-2);
    const SGDOptions s0 = SGDOptions(0.1).momentum(0.9);
    // (the base, a change of one hyperparameter, what the description must then say)
    const std::vector<std::tuple<Make, Make, std::string>> cases = {
        {adamw(w0), adamw(AdamWOptions(1e-3)), "AdamW; param group 0: lr=0.001,"},
        {adamw(w0), adamw(AdamWOptions(1e-2).betas({0.8, 0.999})), "betas=(0.8, 0.999)"},
        {adamw(w0), adamw(AdamWOptions(1e-2).betas({0.9, 0.99})), "betas=(0.9, 0.99)"},
        {adamw(w0), adamw(AdamWOptions(1e-2).eps(1e-7)), "eps=1e-07"},
        {adamw(w0), adamw(AdamWOptions(1e-2).weight_decay(0.1)), "weight_decay=0.1"},
        {adamw(w0), adamw(AdamWOptions(1e-2).amsgrad(true)), "amsgrad=true"},
        {adamw(w0),
         [&] {
           return shardtorch::AdamW(*model, w0,
                                    {shardtorch::ParamGroup<AdamWOptions>{{model->a->weight}, AdamWOptions(0.5)}});
         },
         "param group 0: lr=0.5,"},
        {adamw(w0), adam(AdamOptions(1e-2)), "Adam; param group 0: lr=0.01,"},
        {adam(AdamOptions(1e-2)), adam(AdamOptions(1e-2).weight_decay(0.1)), "weight_decay=0.1"},
        {sgd(s0), sgd(SGDOptions(0.1)), "momentum=0,"},
        {sgd(s0), sgd(SGDOptions(0.1).momentum(0.9).dampening(0.5)), "dampening=0.5"},
        {sgd(s0), sgd(SGDOptions(0.1).momentum(0.9).nesterov(true)), "nesterov=true"},
        {sgd(s0), sgd(SGDOptions(0.1).momentum(0.9).weight_decay(1e-4)), "weight_decay=1e-04"},
    };
    for (const auto& [base, changed, says] : cases) {
      const std::string a = describe(base), b = describe(changed);
      if (a == b || b.find(says) == std::string::npos)
        throw std::runtime_error("'" + b + "' (against '" + a + "') does not say '" + says + "'");
    }
    // A second parameter group's options count too.
    const std::string two = describe([&] {
      return shardtorch::AdamW(*model, w0, {shardtorch::ParamGroup<AdamWOptions>{{model->a->weight}, w0}});
    });
    if (two.find("; param group 1: lr=0.01,") == std::string::npos)
      throw std::runtime_error("two groups described as '" + two + "'");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

namespace {

// The options every test below gives its groups.
shardtorch::ft::ManagerOptions options_of(const Lighthouse& lh, int group, std::chrono::milliseconds timeout) {
  return shardtorch::ft::ManagerOptions()
      .lighthouse(lh.address())
      .replica_group(std::to_string(group))
      .log(false)
      .timeout(timeout)
      .quorum_timeout(20s);
}

// A step that groups committing together use alike: the first to ask for
// `key` decides it (`mine`); later callers get that one.
int64_t agreed_step(c10d::Store& store, const std::string& key, int64_t mine) {
  const std::string text = std::to_string(mine);
  const auto agreed = store.compareSet(key, {}, std::vector<uint8_t>(text.begin(), text.end()));
  return std::stoll(std::string(agreed.begin(), agreed.end()));
}

}  // namespace

// Groups 0 and 1 train; group 2 joins with another learning rate (AdamW at
// 1e-3 against 1e-2: it would train apart, silently). Only group 2 is
// refused: it throws naming both configurations, while groups 0 and 1 commit
// every step, before, while and after group 2 is in the lighthouse's quorum.
TEST(FtManager, AGroupConfiguredDifferentlyIsRefusedWhileTheGroupsTrainingGoOn) {
  Lighthouse lh(2, /*heartbeat_timeout_ms=*/1000);
  auto r = shardtorch::testing::run_ranks(3, [&](World& all) {
    auto world = group_world(all, 1);
    const int g = all.rank();
    auto& store = *all.store();
    at::manual_seed(0);
    Net model(8);
    shardtorch::shard(*model, world, shard_options(shardtorch::Strategy::NoShard));
    auto opt = shardtorch::AdamW(*model, torch::optim::AdamWOptions(g == 2 ? 1e-3 : 1e-2));
    if (g == 2) {
      store.wait({"group 0 up"}, 60s);
      shardtorch::ft::Manager m(world, *model, *opt, options_of(lh, g, 5s));
      try {
        one_step(m, model, *opt, g, 0);
      } catch (const shardtorch::Error& e) {
        store.set("group 2 refused", "1");
        const std::string msg = e.what();
        for (const char* says :
             {"replica group '2' is refused", "groups already training {0, 1}",
              "optimizer: '2' has AdamW; param group 0: lr=0.001,", "'0' has AdamW; param group 0: lr=0.01,"})
          if (msg.find(says) == std::string::npos) throw std::runtime_error("unexpected error: " + msg);
        return;
      }
      throw std::runtime_error("group 2, with another learning rate, was not refused");
    }
    shardtorch::ft::Manager m(world, *model, *opt, options_of(lh, g, 5s));
    bool refused = false;
    // Both groups stop at the same step (min_replicas is 2): three after the
    // first one that saw group 2's refusal (the other may see it a step later).
    int64_t end = -1;
    while (end < 0 || m.step() < end) {
      if (!one_step(m, model, *opt, g, 0))
        throw std::runtime_error("group " + std::to_string(g) + ": step " + std::to_string(m.step()) +
                                 " not committed: " + m.last_step().error);
      if (g == 0 && m.step() == 2) store.set("group 0 up", "1");
      if (m.last_step().refused == std::vector<std::string>{"2"}) refused = true;
      if (m.last_step().counted != std::vector<std::string>{"0", "1"} && m.step() > 1)
        throw std::runtime_error("counted " + c10::Join(",", m.last_step().counted));
      if (end < 0 && store.check({"group 2 refused"})) end = agreed_step(store, "end", m.step() + 3);
    }
    if (!refused) throw std::runtime_error("group " + std::to_string(g) + " never went without group 2");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

namespace {

// Ends a run's steps in every group alike: `end` is set at the first step
// that counted all three groups, and the groups stop two steps later.
bool three_counted_and_two_more(const shardtorch::ft::Manager& m, int64_t& end) {
  if (end < 0 && m.last_step().committed && m.last_step().counted.size() == 3) end = m.step() + 2;
  return end >= 0 && m.step() >= end;
}

}  // namespace

// A restarted lighthouse counts its quorum ids from the start again. Groups
// 0 and 1 form quorum 1 and group 2 joins them (quorum 2); group 2 stops
// (SIGSTOP) between two steps; once 0 and 1 train without it (quorum 3), the
// lighthouse is killed and started again on the same port; 0 and 1 train
// under its quorum 1; group 2 goes on (SIGCONT) and the new lighthouse's
// quorum 2 holds the same three groups as the old one's did. Group 2's
// cross-replica group (the old quorum 2's) is stale: every group builds a
// new one, no step fails, and group 0's store keeps the last one's
// rendezvous alone (the old quorum 3's too went, although 3 > 2).
TEST(FtManager, ARestartedLighthouseThatRepeatsAQuorumIdGetsAFreshCrossReplicaGroup) {
  Lighthouse lh(2, /*heartbeat_timeout_ms=*/1000);
  auto r = shardtorch::testing::run_ranks(3, [&](World& all) {
    auto world = group_world(all, 1);
    const int g = all.rank();
    auto& store = *all.store();
    at::manual_seed(0);
    Net model(8);
    shardtorch::shard(*model, world, shard_options(shardtorch::Strategy::NoShard));
    auto opt = shardtorch::AdamW(*model, torch::optim::AdamWOptions(1e-2));
    if (g == 2) store.wait({"group 0 up"}, 60s);
    shardtorch::ft::Manager m(world, *model, *opt, options_of(lh, g, 5s));
    auto step = [&] {
      if (!one_step(m, model, *opt, g, 0))
        throw std::runtime_error("group " + std::to_string(g) + ": step " + std::to_string(m.step()) +
                                 " not committed: " + m.last_step().error);
    };
    int64_t end = -1;
    if (g == 2) {
      while (m.last_step().counted.size() != 3) step();  // healed first, then counted with 0 and 1
      const int64_t old_quorum = m.last_step().quorum_id;
      store.set("pid 2", std::to_string(::getpid()));
      ::raise(SIGSTOP);  // until group 0 sends SIGCONT
      do step();
      while (!three_counted_and_two_more(m, end));
      if (m.last_step().quorum_id != old_quorum)
        throw std::runtime_error("the new lighthouse's quorum of three is " + std::to_string(m.last_step().quorum_id) +
                                 ", the old one's was " + std::to_string(old_quorum) +
                                 ": the scenario needs them equal");
      return;
    }
    // Group 0 stops whichever lighthouse runs when it leaves (its own after the restart).
    struct StopLighthouse {
      Lighthouse& lh;
      bool mine;
      ~StopLighthouse() {
        if (mine) lh.stop();
      }
    } stop{lh, g == 0};
    bool restarted = false, continued = false;
    // Both groups restart it after the same step (they commit together): the
    // first after which either saw group 2 stopped and gone from the quorum,
    // plus one (the other may see that a step later).
    int64_t restart_at = -1;
    do {
      step();
      const auto& rep = m.last_step();
      if (g == 0 && m.step() == 2) store.set("group 0 up", "1");
      if (!restarted && restart_at < 0 &&
          ((store.check({"pid 2"}) && rep.counted == std::vector<std::string>{"0", "1"}) ||
           store.check({"restart at"})))
        restart_at = agreed_step(store, "restart at", m.step() + 1);
      if (!restarted && m.step() == restart_at) {
        // Group 2 stopped and left the quorum; neither of these two has a request in flight.
        store.set("at the restart " + std::to_string(g), "1");
        if (g == 0) {
          store.wait({"at the restart 1"}, 60s);
          lh.restart();
          store.set("restarted", "1");
        } else {
          store.wait({"restarted"}, 60s);
        }
        restarted = true;
      } else if (g == 0 && restarted && !continued) {
        const auto pid = store.get("pid 2");
        ::kill(std::stoi(std::string(pid.begin(), pid.end())), SIGCONT);  // a step committed under the new lighthouse
        continued = true;
      }
    } while (!(restarted && three_counted_and_two_more(m, end)));
    if (g == 0) {
      const auto names = rendezvous_names(shardtorch::ft::detail::served_store_keys(m));
      if (names.size() != 1)
        throw std::runtime_error("group 0's store holds the rendezvous of " + std::to_string(names.size()) +
                                 " cross-replica groups: " + c10::Join(", ", names));
    }
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// A member that fails right after publishing its address in a new
// cross-replica group's rendezvous (group 2 here, as one that dies at that
// moment would): the others give up that group within ManagerOptions::timeout
// (2 s), not after Gloo's own waits, and the next quorum builds it again.
TEST(FtManager, BuildingACrossReplicaGroupEndsWithinTheTimeoutWhenAMemberFailsAfterPublishing) {
  Lighthouse lh(2, /*heartbeat_timeout_ms=*/1000);
  auto r = shardtorch::testing::run_ranks(3, [&](World& all) {
    auto world = group_world(all, 1);
    const int g = all.rank();
    auto& store = *all.store();
    at::manual_seed(0);
    Net model(8);
    shardtorch::shard(*model, world, shard_options(shardtorch::Strategy::NoShard));
    auto opt = shardtorch::AdamW(*model, torch::optim::AdamWOptions(1e-2));
    if (g == 2) store.wait({"group 0 up"}, 60s);
    shardtorch::ft::Manager m(world, *model, *opt, options_of(lh, g, 2s));
    if (g == 2) shardtorch::testing::inject_failure("cross-replica rendezvous");
    int failed = 0;
    int64_t end = -1;
    do {
      const auto t0 = std::chrono::steady_clock::now();
      const bool committed = one_step(m, model, *opt, g, 0);
      const auto took = std::chrono::steady_clock::now() - t0;
      if (g == 0 && m.step() == 2) store.set("group 0 up", "1");
      if (committed) continue;
      ++failed;
      if (took > 10s)  // 2 s, not Gloo's own 30 s waits; the rest is room for a loaded machine
        throw std::runtime_error("group " + std::to_string(g) + ": the step that failed (" + m.last_step().error +
                                 ") took " + std::to_string(std::chrono::duration<double>(took).count()) +
                                 " s with a timeout of 2 s");
    } while (!three_counted_and_two_more(m, end));
    if (failed != 1)
      throw std::runtime_error("group " + std::to_string(g) + ": " + std::to_string(failed) + " steps failed, not 1");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}
