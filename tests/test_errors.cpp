// One error style: what the library throws is a shardtorch::Error (bad
// checkpoint files: its subclass checkpoint::SafetensorsError), whose message
// carries no C++ backtrace unless SHARDTORCH_SHOW_CPP_STACKTRACES=1.
#include <gtest/gtest.h>

#include <cstdlib>

#include "shardtorch/checkpoint/safetensors.h"
#include "shardtorch/error.h"
#include "shardtorch/flat_param_layout.h"

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
