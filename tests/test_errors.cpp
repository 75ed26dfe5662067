// One error style: what the library throws is a shardtorch::Error (bad
// checkpoint files: its subclass checkpoint::SafetensorsError), whose message
// carries no C++ backtrace unless SHARDTORCH_SHOW_CPP_STACKTRACES=1.
#include <gtest/gtest.h>

#include <cstdlib>

#include "models.h"
#include "shardtorch/checkpoint/safetensors.h"

using namespace testmodels;
using shardtorch::World;
using shardtorch::testing::run_ranks;

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

  // Checkpoint errors are shardtorch::Errors too.
  EXPECT_THROW(shardtorch::checkpoint::load_file("/nonexistent/shardtorch.safetensors"), shardtorch::Error);
}

// An error raised on every rank (the model sharded twice), as each rank sees it.
TEST(Errors, ErrorsOfShardedModelsNameTheRankWithoutABacktrace) {
  auto r = run_ranks(2, [](World& w) {
    MLP m;
    shardtorch::shard(m, w);
    try {
      shardtorch::shard(m, w);
    } catch (const shardtorch::Error& e) {
      const std::string msg = e.what();
      require(!has_backtrace(msg), "a backtrace in: " + msg);
      require(msg.find("rank " + std::to_string(w.rank())) != std::string::npos, "no rank in: " + msg);
      return;
    }
    require(false, "sharding twice did not throw shardtorch::Error");
  });
  ASSERT_TRUE(r.ok) << r.summary();
}
