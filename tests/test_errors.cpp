// One error style: what the library throws is a shardtorch::Error (bad
// checkpoint files: its subclass checkpoint::SafetensorsError), whose message
// carries no C++ backtrace unless SHARDTORCH_SHOW_CPP_STACKTRACES=1.
#include <gtest/gtest.h>

#include <cstdlib>
#include <optional>

#include "captured_warnings.h"
#include "models.h"
#include "shardtorch/checkpoint/safetensors.h"
#include "shardtorch/error.h"
#include "shardtorch/flat_param_layout.h"
#include "shardtorch/gather.h"

namespace {
bool has_backtrace(const std::string& m) {
  return m.find("frame #") != std::string::npos || m.find("Exception raised from") != std::string::npos;
}

std::string thrown_by_layout() {
  try {
    shardtorch::FlatParamLayout({{2}}, 0);  // no ranks
  } catch (const shardtorch::Error& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST(Errors, LibraryErrorsAreShardtorchErrorsWithoutABacktrace) {
  const std::string plain = thrown_by_layout();
  ASSERT_FALSE(plain.empty()) << "FlatParamLayout with no ranks did not throw shardtorch::Error";
  EXPECT_FALSE(has_backtrace(plain)) << plain;

  ::setenv("SHARDTORCH_SHOW_CPP_STACKTRACES", "1", 1);
  const std::string traced = thrown_by_layout();
  ::unsetenv("SHARDTORCH_SHOW_CPP_STACKTRACES");
  EXPECT_EQ(traced.rfind(plain, 0), 0u) << traced;
  EXPECT_TRUE(has_backtrace(traced)) << "SHARDTORCH_SHOW_CPP_STACKTRACES=1 should append the backtrace:\n" << traced;

  // A value other than 0 or 1 leaves them off (it is read while an error is
  // raised, which must not fail in turn).
  ::setenv("SHARDTORCH_SHOW_CPP_STACKTRACES", "yes", 1);
  const std::string unknown = thrown_by_layout();
  ::unsetenv("SHARDTORCH_SHOW_CPP_STACKTRACES");
  EXPECT_EQ(unknown, plain);

  // Checkpoint errors are shardtorch::Errors too.
  EXPECT_THROW(shardtorch::checkpoint::load_file("/nonexistent/shardtorch.safetensors"), shardtorch::Error);
}

// A replacement (SHARDTORCH_REJOIN=1) joins through the job's store: for a
// rank 0 that hosted it in a hand launch, nothing is left to join, and the
// error says so before anything waits. A value other than 0 or 1 is refused.
TEST(Errors, AReplacementForARankZeroThatHostedTheStoreIsRefusedSayingWhy) {
  const shardtorch::EnvLookup yes = [](const std::string& name) -> std::optional<std::string> {
    if (name == "SHARDTORCH_REJOIN") return "yes";
    return std::nullopt;
  };
  EXPECT_THROW(shardtorch::parse_launch_env(yes), shardtorch::Error);
  const std::vector<std::pair<const char*, const char*>> env = {{"RANK", "0"},
                                                                {"WORLD_SIZE", "2"},
                                                                {"MASTER_ADDR", "127.0.0.1"},
                                                                {"MASTER_PORT", "29999"},
                                                                {"SHARDTORCH_REJOIN", "1"}};
  for (const auto& [k, v] : env) ::setenv(k, v, 1);
  std::string message;
  try {
    shardtorch::World::from_env();
  } catch (const shardtorch::Error& e) {
    message = e.what();
  }
  for (const auto& [k, v] : env) ::unsetenv(k);
  EXPECT_NE(message.find("rank 0 hosts the rendezvous store, which went with the lost process"), std::string::npos)
      << message;
}

// A switch the library reads takes 0 or 1: another value is an error naming
// the variable and the value, not a silent "off", when a World is made
// (not at the switch's first use, a checkpoint's save maybe hours in).
TEST(Errors, ASwitchOtherThanZeroOrOneIsRefusedNamingTheVariable) {
  for (const char* name :
       {"SHARDTORCH_BLOCKING_WAIT", "SHARDTORCH_CHECK_COLLECTIVES", "SHARDTORCH_CHECKPOINT_NO_EXCHANGE",
        "SHARDTORCH_REJOIN", "SHARDTORCH_SHOW_CPP_STACKTRACES"}) {
    ::setenv(name, "true", 1);
    std::string message;
    try {
      shardtorch::World::from_env();  // a world of one: no launcher variables
    } catch (const shardtorch::Error& e) {
      message = e.what();
    }
    ::unsetenv(name);
    EXPECT_NE(message.find(std::string("shardtorch: rank 0: environment variable ") + name + "='true' must be 0 or 1"),
              std::string::npos)
        << name << ": " << message;
  }
  // The collective check's probe interval: a whole number of milliseconds, 10 to 60000.
  for (const char* value : {"0.5", "9", "60001", "abc", "100ms"}) {
    ::setenv("SHARDTORCH_CHECK_PROBE_MS", value, 1);
    std::string message;
    try {
      shardtorch::World::from_env();
    } catch (const shardtorch::Error& e) {
      message = e.what();
    }
    ::unsetenv("SHARDTORCH_CHECK_PROBE_MS");
    EXPECT_NE(message.find(std::string("environment variable SHARDTORCH_CHECK_PROBE_MS='") + value +
                           "' must be a whole number of milliseconds from 10 to 60000"),
              std::string::npos)
        << value << ": " << message;
  }
  // A launcher's variable read after the rank names the rank, as every rank prints its own line.
  const shardtorch::EnvLookup bad_timeout = [](const std::string& name) -> std::optional<std::string> {
    if (name == "RANK") return "1";
    if (name == "WORLD_SIZE") return "2";
    if (name == "SHARDTORCH_TIMEOUT_S") return "abc";
    return std::nullopt;
  };
  std::string message;
  try {
    shardtorch::parse_launch_env(bad_timeout);
  } catch (const shardtorch::Error& e) {
    message = e.what();
  }
  EXPECT_EQ(message.rfind("shardtorch: rank 1: ", 0), 0u) << message;
  EXPECT_NE(message.find("SHARDTORCH_TIMEOUT_S"), std::string::npos) << message;
  ::setenv("SHARDTORCH_BLOCKING_WAIT", "0", 1);  // 0 is a value, not an error
  EXPECT_NO_THROW(shardtorch::World::from_env());
  ::unsetenv("SHARDTORCH_BLOCKING_WAIT");
}

// Calls that would do nothing without a word: an optimizer step while the
// gradients are not synchronised (inside no_sync()), a clip before any
// backward, and training a sharded model with no shardtorch optimizer. Each
// warns, saying what to do.
TEST(Errors, AStepOrAClipThatDoesNothingSaysWhy) {
  auto r = shardtorch::testing::run_ranks(2, [](shardtorch::World& w) {
    testmodels::CapturedWarnings warnings;
    c10::WarningUtils::WarningHandlerGuard guard(&warnings);
    testmodels::MLP m;
    auto sharded = shardtorch::shard(m, w);
    auto opt = shardtorch::AdamW(*m, torch::optim::AdamWOptions(1e-2));
    shardtorch::clip_grad_norm(*m, 1.0);
    testmodels::require(warnings.any_with("clip_grad_norm found no gradient to clip"),
                        "no warning for a clip before backward");
    {
      auto no_sync = sharded.no_sync();
      m(torch::randn({4, 7})).square().mean().backward();
      opt->step();
    }
    testmodels::require(warnings.any_with("an optimizer step while gradient synchronisation is off"),
                        "no warning for a step inside no_sync()");
    opt->zero_grad();
    {  // accumulation: the last backward synchronises
      auto no_sync = sharded.no_sync();
      m(torch::randn({4, 7})).square().mean().backward();
    }
    m(torch::randn({4, 7})).square().mean().backward();
    opt->step();
    opt->zero_grad();
    m(torch::randn({4, 7})).square().mean().backward();
    m->l1->zero_grad();  // one unit's gradients cleared: the others still step
    opt->step();
    testmodels::require(!warnings.any_with("an optimizer step with no backward"),
                        "a step after a backward warned that it had none");
    opt->zero_grad();
    opt->step();
    testmodels::require(warnings.any_with("an optimizer step with no backward since zero_grad()"),
                        "no warning for a step with no backward since zero_grad()");
    // torch::optim over the module's own parameters after shard(): no
    // shardtorch optimizer; sharded, the parameters never change; under
    // NoShard, torch::optim's zero_grad fails on the buckets' views.
    for (const auto strategy : {shardtorch::Strategy::FullShard, shardtorch::Strategy::NoShard}) {
      testmodels::CapturedWarnings seen;
      c10::WarningUtils::WarningHandlerGuard inner(&seen);
      testmodels::MLP plain;
      shardtorch::shard(plain, w, shardtorch::ShardOptions().strategy(strategy));
      torch::optim::AdamW wrong(plain->parameters(), torch::optim::AdamWOptions(1e-2));
      plain(torch::randn({4, 7})).square().mean().backward();
      testmodels::require(seen.any_with("a backward reduced the model's gradients and no shardtorch optimizer was "
                                        "built over the model"),
                          "no warning for a torch::optim optimizer over a sharded model's parameters");
      testmodels::require(seen.any_with(strategy == shardtorch::Strategy::NoShard ? "Can't detach views in-place"
                                                                                  : "so its step changes nothing"),
                          "the warning does not say what goes wrong under this strategy");
      // What the warning says is what happens.
      if (strategy == shardtorch::Strategy::NoShard) {
        std::string error = "no error";
        try {
          wrong.zero_grad();
        } catch (const std::exception& e) {
          error = e.what();
        }
        testmodels::require(error.find("Can't detach views in-place") != std::string::npos,
                            "torch::optim's zero_grad under NoShard: " + error);
      } else {
        const auto before = shardtorch::full_parameters(*plain);
        wrong.step();
        for (const auto& [name, value] : shardtorch::full_parameters(*plain))
          testmodels::require(torch::equal(value, before.at(name)), "torch::optim's step changed " + name);
      }
    }
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

// One catch clause is enough, wherever a failure starts: the launcher's
// variables, ranks whose ShardOptions differ in shard(), a collective whose
// peer left, a failure inside the library's thread that waits for
// reduce-scatters: none is a plain std::runtime_error or
// std::invalid_argument.
TEST(Errors, LaunchAgreementCollectiveAndThreadFailuresAreShardtorchErrors) {
  const shardtorch::EnvLookup bad_rank = [](const std::string& name) -> std::optional<std::string> {
    if (name == "RANK") return "one";
    if (name == "WORLD_SIZE") return "2";
    return std::nullopt;
  };
  EXPECT_THROW(shardtorch::parse_launch_env(bad_rank), shardtorch::Error);
  const shardtorch::EnvLookup no_size = [](const std::string& name) -> std::optional<std::string> {
    if (name == "RANK") return "0";
    return std::nullopt;
  };
  EXPECT_THROW(shardtorch::parse_launch_env(no_size), shardtorch::Error);

  using shardtorch::testing::RunOptions;
  auto r = shardtorch::testing::run_ranks(
      2,
      [](shardtorch::World& w) {
        // What `body` throws, unless it is a shardtorch::Error whose message holds `want`.
        auto expect_error = [&](const char* what, const std::string& want, const std::function<void()>& body) {
          try {
            body();
          } catch (const shardtorch::Error& e) {
            if (std::string(e.what()).find(want) != std::string::npos) return;
            throw std::runtime_error(std::string(what) + ": '" + want + "' is not in: " + e.what());
          } catch (const std::exception& e) {
            throw std::runtime_error(std::string(what) + ": not a shardtorch::Error: " + e.what());
          }
          throw std::runtime_error(std::string(what) + ": no error");
        };
        {
          testmodels::MLP m;
          const auto strategy = w.rank() == 0 ? shardtorch::Strategy::FullShard : shardtorch::Strategy::NoShard;
          expect_error("shard() with differing strategies", "ShardOptions differ across ranks",
                       [&] { shardtorch::shard(m, w, shardtorch::ShardOptions().strategy(strategy)); });
        }
        {
          testmodels::MLP m;
          shardtorch::shard(m, w, shardtorch::ShardOptions().strategy(shardtorch::Strategy::FullShard));
          auto opt = shardtorch::Adam(*m, torch::optim::AdamOptions(1e-3));
          shardtorch::testing::inject_failure("completion watcher");
          expect_error("a failure in the completion watcher", "shardtorch: rank " + std::to_string(w.rank()), [&] {
            opt->zero_grad();
            m(torch::randn({4, 7})).square().mean().backward();
            opt->step();
          });
        }
        // Rank 1 leaves; rank 0's all-reduce then fails.
        if (w.rank() == 1) return;
        at::Tensor t = at::ones({4});
        expect_error("an all-reduce whose peer left", "shardtorch: rank 0/2: all_reduce for lonely",
                     [&] { w.comm().all_reduce(t, c10d::ReduceOp::SUM, "lonely"); });
      },
      RunOptions().collective_timeout(std::chrono::seconds(10)).timeout(std::chrono::seconds(60)));
  ASSERT_TRUE(r.ok) << r.summary();
}
