// Fault tolerance on a CUDA device (docs/fault_tolerance.md, "Devices"): two
// replica groups of one rank each share the GPU. Each group's World computes
// on cuda:0; the cross-replica group is Gloo, whose all-reduce takes the
// device buffers through host memory. The groups train like one process on
// that device, and a group that lost its state heals through host memory.
// Built only against a CUDA LibTorch with fault tolerance (tests/CMakeLists.txt).
//
// Nothing here touches CUDA in the parent process (see test_cuda.cpp).
#include <gtest/gtest.h>

#include <c10/util/StringUtil.h>

#include "../ft/ft_support.h"

namespace {
using namespace ftsupport;

// Group 1 loses its state after step 3 and is healed from group 0 (in
// host memory under CPU offload, on the device otherwise); both groups then
// train like the replay on the same device.
void group_on_cuda_that_lost_its_state_heals(shardtorch::ShardOptions shard) {
  Lighthouse lh(2);
  auto r = shardtorch::testing::run_ranks(2, [&](World& all) {
    GroupRun run;
    run.shard = shard;
    run.device = c10::Device(c10::kCUDA, 0);
    run.tolerance = 1e-5;  // the device's kernels: summed in another order than the replay's
    run.after_step = group_1_loses_its_state_after_step_3;
    auto got = train_group(all, 1, lh.address(), run);
    if (got.counted.size() != 6u || got.counted[0].size() != 1 || got.counted[3] != "0" || got.counted[4] != "01")
      throw std::runtime_error("counted groups per step: " + c10::Join(",", got.counted));
    check_against_replay(all, 1, got, run);
  });
  ASSERT_TRUE(r.ok) << r.summary();
}

TEST(FtCuda, NoShardGroupOnCudaThatLostItsStateHeals) {
  group_on_cuda_that_lost_its_state_heals(shardtorch::ShardOptions().strategy(shardtorch::Strategy::NoShard));
}

TEST(FtCuda, FullShardGroupOnCudaThatLostItsStateHeals) {
  group_on_cuda_that_lost_its_state_heals(shardtorch::ShardOptions().strategy(shardtorch::Strategy::FullShard));
}

// Masters and optimizer state on the host, gradients on the device.
TEST(FtCuda, FullShardGroupOnCudaWithCpuOffloadThatLostItsStateHeals) {
  group_on_cuda_that_lost_its_state_heals(
      shardtorch::ShardOptions().strategy(shardtorch::Strategy::FullShard).cpu_offload(true));
}

}  // namespace
