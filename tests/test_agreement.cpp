// Ranks that must agree: ShardOptions compared at shard(), failures inside
// the library's threads and callbacks reported to the caller, errors that
// name the peer at fault (docs/reliability.md, "Ranks and options").
#include <gtest/gtest.h>

#include <chrono>
#include <functional>

#include "models.h"

using namespace testmodels;
using shardtorch::MixedPrecision;
using shardtorch::ShardOptions;
using shardtorch::Strategy;
using shardtorch::World;
using shardtorch::testing::run_ranks;
using shardtorch::testing::RunOptions;

namespace {

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// One option set differently on two ranks.
struct OptionCase {
  const char* label;   // test name
  const char* option;  // as the error names it
  std::function<ShardOptions(int rank)> options;
  const char* on0;  // its value on rank 0, as the error writes it
  const char* on1;  // and on rank 1
};

ShardOptions on(Strategy s) { return ShardOptions().strategy(s); }
ShardOptions bf16(Strategy s = Strategy::FullShard) {
  return on(s).mixed_precision(MixedPrecision().param_dtype(at::kBFloat16));
}

std::vector<OptionCase> option_cases() {
  return {
      {"Strategy", "strategy", [](int r) { return on(r ? Strategy::NoShard : Strategy::FullShard); }, "full_shard",
       "no_shard"},
      // The reported crash: one rank in bf16 aborted in Gloo (SIGABRT).
      {"ParamDtype", "mixed_precision.param_dtype", [](int r) { return r ? bf16() : on(Strategy::FullShard); }, "unset",
       "BFloat16"},
      {"ParamDtypeNoShard", "mixed_precision.param_dtype",
       [](int r) { return r ? bf16(Strategy::NoShard) : on(Strategy::NoShard); }, "unset", "BFloat16"},
      {"ReduceDtype", "mixed_precision.reduce_dtype",
       [](int r) {
         auto o = bf16();
         if (r) o.mixed_precision().reduce_dtype(at::kFloat);
         return o;
       },
       "unset", "Float"},
      {"OutputDtype", "mixed_precision.output_dtype",
       [](int r) {
         auto o = bf16();
         if (r == 0) o.mixed_precision().output_dtype(at::kFloat);
         return o;
       },
       "Float", "unset"},
      {"BufferDtype", "mixed_precision.buffer_dtype",
       [](int r) {
         auto o = bf16();
         if (r) o.mixed_precision().buffer_dtype(at::kBFloat16);
         return o;
       },
       "unset", "BFloat16"},
      {"CastRootInputs", "mixed_precision.cast_root_inputs",
       [](int r) {
         auto o = bf16();
         o.mixed_precision().cast_root_inputs(r == 0);
         return o;
       },
       "true", "false"},
      {"KeepBatchNormFp32", "mixed_precision.keep_batch_norm_fp32",
       [](int r) {
         auto o = bf16();
         o.mixed_precision().keep_batch_norm_fp32(r == 0);
         return o;
       },
       "true", "false"},
      {"ReshardAfterForward", "reshard_after_forward",
       [](int r) { return on(Strategy::FullShard).reshard_after_forward(r == 0); }, "true", "false"},
      {"BucketMb", "bucket_mb", [](int r) { return on(Strategy::FullShard).bucket_mb(r ? 0.5 : 25); }, "25", "0.5"},
      {"SyncModuleStates", "sync_module_states",
       [](int r) { return on(Strategy::FullShard).sync_module_states(r == 0); }, "true", "false"},
      {"BroadcastBuffers", "broadcast_buffers", [](int r) { return on(Strategy::FullShard).broadcast_buffers(r != 0); },
       "false", "true"},
      {"HybridShardSize", "hybrid_shard_size",
       [](int r) { return on(Strategy::HybridShard).hybrid_shard_size(r ? 1 : 2); }, "2", "1"},
      // Invalid on rank 1 only (3 does not divide 2): that rank used to throw
      // alone and leave rank 0 waiting until the timeout.
      {"HybridShardSizeInvalidOnOneRank", "hybrid_shard_size",
       [](int r) { return on(Strategy::HybridShard).hybrid_shard_size(r ? 3 : 2); }, "2", "3"},
      {"DdpAsync", "ddp_async", [](int r) { return on(Strategy::NoShard).ddp_async(r == 0); }, "true", "false"},
      {"ErrorOnUnusedParameters", "error_on_unused_parameters",
       [](int r) { return on(Strategy::NoShard).error_on_unused_parameters(r != 0); }, "false", "true"},
      {"Prefetch", "prefetch", [](int r) { return on(Strategy::FullShard).prefetch(r != 0); }, "false", "true"},
      {"CpuOffload", "cpu_offload", [](int r) { return on(Strategy::FullShard).cpu_offload(r != 0); }, "false", "true"},
      // Invalid on rank 1 only (NoShard refuses offload).
      {"CpuOffloadInvalidOnOneRank", "cpu_offload", [](int r) { return on(Strategy::NoShard).cpu_offload(r != 0); },
       "false", "true"},
      {"ActivationCheckpointing", "activation_checkpointing",
       [](int r) { return on(Strategy::FullShard).activation_checkpointing(r != 0); }, "false", "true"},
      {"ReshardAfterForwardForAUnit", "reshard_after_forward_for('l2')",
       [](int r) {
         auto o = on(Strategy::FullShard);
         if (r == 0) o.reshard_after_forward_for("l2", false);
         return o;
       },
       "false", "unset"},
      {"ActivationCheckpointingForAUnit", "activation_checkpointing_for('l1')",
       [](int r) {
         auto o = on(Strategy::FullShard);
         if (r) o.activation_checkpointing_for("l1", true);
         return o;
       },
       "unset", "true"},
  };
}

class OptionsDiffer : public ::testing::TestWithParam<OptionCase> {};

// Every rank fails in shard(), at once, naming the option, both ranks and
// both values. The body goes on to train a step: without the check, some of
// these abort a rank in Gloo (bf16), wait for the collective timeout
// (prefetch, hybrid_shard_size) or train on with no word (bucket_mb, offload).
TEST_P(OptionsDiffer, EveryRankFailsInShardNamingTheOptionAndBothValues) {
  const OptionCase c = GetParam();
  auto t0 = std::chrono::steady_clock::now();
  auto r = run_ranks(
      2,
      [&c](World& w) {
        MLP m;
        auto sm = shardtorch::shard(m, w, c.options(w.rank()));
        auto opt = shardtorch::Adam(*m, torch::optim::AdamOptions(1e-3));
        opt->zero_grad();
        m(torch::randn({4, 7})).to(torch::kFloat).square().mean().backward();
        opt->step();
      },
      RunOptions().collective_timeout(std::chrono::seconds(45)).timeout(std::chrono::seconds(90)));
  const std::string want =
      std::string("option ") + c.option + " is " + c.on0 + " on rank 0 but " + c.on1 + " on rank 1";
  ASSERT_FALSE(r.ok) << r.summary();
  for (int k = 0; k < 2; ++k) {
    EXPECT_EQ(r.ranks[k].exit_code, 1) << r.summary();
    EXPECT_NE(r.ranks[k].message.find("shardtorch::shard: ShardOptions differ across ranks: "), std::string::npos)
        << r.summary();
    EXPECT_NE(r.ranks[k].message.find(want), std::string::npos) << "'" << want << "' in\n" << r.summary();
    EXPECT_NE(r.ranks[k].message.find("(seen on rank " + std::to_string(k) + ")"), std::string::npos) << r.summary();
  }
  EXPECT_LT(seconds_since(t0), 10.0) << "a rank waited for the collective timeout (45 s)";
}

INSTANTIATE_TEST_SUITE_P(Agreement, OptionsDiffer, ::testing::ValuesIn(option_cases()),
                         [](const ::testing::TestParamInfo<OptionCase>& i) { return std::string(i.param.label); });

}  // namespace

// Three ranks, the last differing in two options: every rank names both,
// each with rank 0's value and rank 2's.
TEST(Agreement, EveryDifferingOptionIsNamedWithTheRankThatDiffers) {
  auto r = run_ranks(3, [](World& w) {
    MLP m;
    auto o = ShardOptions().bucket_mb(w.rank() == 2 ? 1 : 25).prefetch(w.rank() == 2);
    shardtorch::shard(m, w, o);
  });
  ASSERT_FALSE(r.ok);
  for (int k = 0; k < 3; ++k) {
    EXPECT_EQ(r.ranks[k].exit_code, 1) << r.summary();
    for (const char* want :
         {"option bucket_mb is 25 on rank 0 but 1 on rank 2", "option prefetch is false on rank 0 but true on rank 2"})
      EXPECT_NE(r.ranks[k].message.find(want), std::string::npos) << want << " in\n" << r.summary();
    for (const char* not_at_fault : {" on rank 1;", " on rank 1."})
      EXPECT_EQ(r.ranks[k].message.find(not_at_fault), std::string::npos) << r.summary();
  }
}

// Options that agree and are invalid everywhere: the same configuration
// error on every rank (raised after the exchange, no rank left waiting).
TEST(Agreement, AnInvalidConfigurationOnEveryRankIsTheSameErrorEverywhere) {
  auto r = run_ranks(2, [](World& w) {
    MLP m;
    shardtorch::shard(m, w, ShardOptions().strategy(Strategy::HybridShard).hybrid_shard_size(3));
  });
  ASSERT_FALSE(r.ok);
  for (int k = 0; k < 2; ++k) {
    EXPECT_EQ(r.ranks[k].exit_code, 1) << r.summary();
    EXPECT_NE(r.ranks[k].message.find("shardtorch::shard: rank " + std::to_string(k) +
                                      ": HybridShard needs hybrid_shard_size (now 3) to divide the world size 2"),
              std::string::npos)
        << r.summary();
  }
  // Left at its default (0): the error says to set it.
  auto unset = run_ranks(2, [](World& w) {
    MLP m;
    shardtorch::shard(m, w, ShardOptions().strategy(Strategy::HybridShard));
  });
  ASSERT_FALSE(unset.ok);
  for (int k = 0; k < 2; ++k)
    EXPECT_NE(unset.ranks[k].message.find("HybridShard needs hybrid_shard_size(S), the ranks of a shard group: set "
                                          "it to a divisor of the world size 2 (0, the default, is unset)"),
              std::string::npos)
        << unset.summary();
}

namespace {

// A failure injected at one place inside the library's callbacks or threads.
struct InjectCase {
  const char* label;
  const char* site;
  Strategy strategy;
  const char* operation;  // what the error must name, after "shardtorch: rank R"
};

std::vector<InjectCase> inject_cases() {
  return {
      // The thread that waits for CPU reduce-scatters: an exception there must
      // not end the process (std::terminate).
      {"CompletionWatcherThread", "completion watcher", Strategy::FullShard, "/2: reduce_scatter for "},
      {"PreBackwardHook", "pre-backward hook", Strategy::FullShard, ": the pre-backward hook of unit '"},
      {"GradientHook", "gradient hook", Strategy::FullShard, ": the gradient hook of parameter '"},
      {"ExitHookOfAUnitWithFrozenParameters", "exit hook", Strategy::FullShard, ": the exit hook of unit 'l2'"},
      {"ReduceScatterCallback", "reduction callback", Strategy::FullShard,
       ": adding the reduce-scattered gradients of unit '"},
      {"AllReduceCallback", "reduction callback", Strategy::OptimizerOnly,
       ": adding the all-reduced gradients of unit '"},
      {"EndOfBackward", "end of backward", Strategy::ShardGradOp, ": the end of backward (reducing the gradients)"},
      {"EndOfBackwardNoShard", "end of backward", Strategy::NoShard, ": the end of backward (reducing the gradients)"},
      {"NoShardGradientHook", "NoShard gradient hook", Strategy::NoShard,
       ": the gradient hook of parameter 'l3.lin.bias' (NoShard)"},
  };
}

class InjectedFailure : public ::testing::TestWithParam<InjectCase> {};

// Every rank fails at the same place (so the ranks stay in step): the error
// reaches the caller of backward(), naming the rank, the operation and the
// cause; the process lives on, and after zero_grad() the model trains again.
TEST_P(InjectedFailure, ReachesTheCallerNamingTheRankAndTheOperation) {
  const InjectCase c = GetParam();
  auto r = run_ranks(
      2,
      [&c](World& w) {
        MLP m;
        shardtorch::shard(m, w, ShardOptions().strategy(c.strategy));
        auto opt = shardtorch::Adam(*m, torch::optim::AdamOptions(1e-3));
        auto x = torch::randn({4, 7});
        std::string error;
        shardtorch::testing::inject_failure(c.site);
        try {
          opt->zero_grad();
          m(x).square().mean().backward();
          opt->step();
        } catch (const std::exception& e) {
          error = e.what();
        }
        require(!error.empty(), std::string("no error: the failure at '") + c.site + "' was never reached");
        const std::string rank = "shardtorch: rank " + std::to_string(w.rank());
        for (const std::string& want : {rank + c.operation, std::string("failure injected at '") + c.site + "'"})
          require(error.find(want) != std::string::npos, "'" + want + "' is not in: " + error);
        for (int step = 0; step < 2; ++step) {  // and it trains on
          opt->zero_grad();
          m(x).square().mean().backward();
          opt->step();
        }
      },
      RunOptions().collective_timeout(std::chrono::seconds(15)).timeout(std::chrono::seconds(60)));
  ASSERT_TRUE(r.ok) << r.summary();
}

INSTANTIATE_TEST_SUITE_P(Agreement, InjectedFailure, ::testing::ValuesIn(inject_cases()),
                         [](const ::testing::TestParamInfo<InjectCase>& i) { return std::string(i.param.label); });

// One rank's backward fails in a gradient hook and its program catches the
// error and ends: the peer, whose reduce-scatter then fails, gives that
// rank's error (kept for the peers when the hook threw), not only that it
// ended.
TEST(Agreement, AnErrorOneRanksProgramCaughtIsGivenByItsPeer) {
  const auto t0 = std::chrono::steady_clock::now();
  auto r = run_ranks(
      2,
      [](World& w) {
        MLP m;
        shardtorch::shard(m, w, ShardOptions().strategy(Strategy::FullShard));
        auto x = torch::randn({4, 7});
        if (w.rank() == 1) shardtorch::testing::inject_failure("gradient hook");
        try {
          m(x).square().mean().backward();
        } catch (const std::exception&) {
          if (w.rank() == 1) return;  // caught: this rank ends
          throw;
        }
      },
      RunOptions().collective_timeout(std::chrono::seconds(15)).timeout(std::chrono::seconds(60)));
  ASSERT_FALSE(r.ok);
  EXPECT_EQ(r.ranks[1].exit_code, 0) << r.summary();
  const std::string& m = r.ranks[0].message;
  EXPECT_NE(m.find("Peer at fault: rank 1"), std::string::npos) << m;
  EXPECT_NE(m.find("failure injected at 'gradient hook'"), std::string::npos) << m;
  EXPECT_NE(m.find("rank(s) 1 will not report theirs."), std::string::npos) << m;
  EXPECT_NE(m.find("Peer at fault: rank 1 had finished after an error of its own that the program caught (shardtorch: "
                   "rank 1: the gradient hook of parameter 'l3.lin.bias' of unit 'l3' failed: "),
            std::string::npos)
      << m;
  EXPECT_NE(m.find("its World was destroyed "), std::string::npos) << m;
  EXPECT_LT(seconds_since(t0), 10.0) << "rank 0 waited for the collective timeout (15 s)";
}

}  // namespace
