#pragma once
// Multi-rank tests in one test binary: run_ranks forks one process per rank,
// each rendezvouses with the others through a FileStore in a fresh temporary
// directory and talks over Gloo on loopback (or NCCL/Gloo with CUDA tensors,
// one GPU per rank, when asked for). A rank's exception, non-zero exit, crash
// or time-out fails the run with that rank's message; the parent asserts.
//
//   TEST(MyModel, TrainsSharded) {
//     auto r = shardtorch::testing::run_ranks(2, [](shardtorch::World& world) {
//       ...                           // throw, TORCH_CHECK or EXPECT_* to fail
//     });
//     ASSERT_TRUE(r.ok) << r.summary();
//   }
//
// Fork safety: the parent must not have started threads that children need
// (ATen's OpenMP pool, CUDA). Call shardtorch::testing::init() first thing in
// main(): it sets ATen to one intra-op thread in the parent. Children inherit
// the parent's memory, so a reference computed before run_ranks is visible to
// every rank.
//
// GoogleTest: in a program where some file includes this header after
// <gtest/gtest.h>, a GoogleTest assertion that fails inside a rank's body
// fails that rank, its file, line and message in the rank's message. Where
// every file includes them the other way round, such a failure is only
// printed: the rank exits 0.
#include <torch/arg.h>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "shardtorch/export.h"
#include "shardtorch/world.h"

namespace shardtorch::testing {

struct SHARDTORCH_API RunOptions {
  /// Wall-clock limit for the whole run; ranks still alive are killed.
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::seconds(120);
  /// Timeout of every collective inside the ranks.
  TORCH_ARG(std::chrono::milliseconds, collective_timeout) = std::chrono::seconds(30);
  /// kCPU: Gloo on CPU tensors. kCUDA: device cuda:rank, backend "auto".
  TORCH_ARG(c10::DeviceType, device_type) = c10::kCPU;
  /// Intra-op threads in each rank.
  TORCH_ARG(int, threads) = 1;
  /// WorldOptions::check_collectives of each rank's world (unset: its default).
  TORCH_ARG(std::optional<bool>, check_collectives) = std::nullopt;
  /// A rank still alive at `timeout` has the stacks of all its threads
  /// (gdb, when installed) appended to its message before it is killed.
  /// Off for a test that uses the time limit as its way of killing a rank.
  TORCH_ARG(bool, stacks_on_timeout) = true;
};

struct SHARDTORCH_API RankOutcome {
  int exit_code = -1;  // -1: killed by a signal or the time limit
  int signal = 0;
  bool timed_out = false;
  std::string message;  // what the rank threw, if anything; then, timed out, its threads' stacks
};

struct SHARDTORCH_API RunResult {
  bool ok = false;
  std::vector<RankOutcome> ranks;
  std::string summary() const;
};

using RankBody = std::function<void(World& world)>;

SHARDTORCH_API void init();
SHARDTORCH_API RunResult run_ranks(int world_size, const RankBody& body, RunOptions options = {});

/// Fault injection for the library's callbacks and threads: the next `count`
/// times this process reaches `site`, the library throws there, as a bug or a
/// failed allocation would, and the error must reach the caller (of
/// backward(), or of the collective's wait) naming the rank and the
/// operation. Sites (docs/testing.md): "completion watcher", "pre-backward
/// hook", "gradient hook", "exit hook", "reduction callback", "end of
/// backward", "NoShard gradient hook", "cross-replica rendezvous". Not for
/// production use.
SHARDTORCH_API void inject_failure(const std::string& site, int count = 1);

/// Fault injection for recovery tests: the next `count` collectives on this
/// process whose description contains `what` complete and then fail, as one
/// that timed out would (the error names the collective and says it was
/// injected). The collective itself runs, so ranks that all arm the same
/// failure stay in step. Not for production use.
SHARDTORCH_API void fail_collectives(const std::string& what, int count = 1);

}  // namespace shardtorch::testing

namespace shardtorch::detail {
/// The failures a test framework has recorded in the current test so far,
/// one line each ("file:line: message"). run_ranks calls it in each rank
/// before and after the body: failures recorded in between fail the rank.
using FailureProbe = std::vector<std::string> (*)();
/// Set by this header's GoogleTest probe below; the last one set is used.
SHARDTORCH_API void set_failure_probe(FailureProbe probe);
}  // namespace shardtorch::detail

#if defined(GOOGLETEST_INCLUDE_GTEST_GTEST_H_) || defined(GTEST_INCLUDE_GTEST_GTEST_H_)
namespace shardtorch::detail {
inline std::vector<std::string> googletest_failures() {
  std::vector<std::string> out;
  const ::testing::TestInfo* test = ::testing::UnitTest::GetInstance()->current_test_info();
  if (test == nullptr) return out;
  const ::testing::TestResult& result = *test->result();
  for (int i = 0; i < result.total_part_count(); ++i) {
    const ::testing::TestPartResult& part = result.GetTestPartResult(i);
    if (part.failed())
      out.push_back(std::string(part.file_name() ? part.file_name() : "(unknown file)") + ":" +
                    std::to_string(part.line_number()) + ": " + part.summary());
  }
  return out;
}
inline const bool googletest_probe_set = (set_failure_probe(&googletest_failures), true);
}  // namespace shardtorch::detail
#endif
