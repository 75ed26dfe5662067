#pragma once
// Every byte the library holds, by category, with peaks.
#include <array>
#include <cstdint>
#include <string>

#include "shardtorch/export.h"

namespace shardtorch {

enum class Mem : int {
  ShardedParams = 0,   // this rank's shards of the flat parameters
  ReplicatedParams,    // parameters kept whole between steps (ZeRO-1/2 flat buffers, DDP's parameters)
  Gradients,           // this rank's gradient shards
  OptimizerState,      // optimizer state over the shards
  GatheredParams,      // full (unsharded) flat parameters alive now
  GradStaging,         // a unit's full flat gradient while backward fills it
  Buckets,             // reduce-scatter bucket buffers
  MasterGrads,         // NoShard, mixed precision: the masters' fp32 gradients, from backward to the end of the step
  HostParams,          // CPU offload: master shards in host memory
  HostGradients,       // CPU offload: gradient shards in host memory
  HostOptimizerState,  // CPU offload: optimizer state in host memory
  SummonedGrads,       // the full gradients a summon_full_params(with_grads) scope sets in param.grad
  Snapshots,           // in-memory snapshots (shardtorch/snapshot.h) in node-local shared memory: this rank's own
                       // and the copies it keeps for others, as of the last after_step, restore or finish
  kCount
};

SHARDTORCH_API const char* mem_name(Mem m);

struct SHARDTORCH_API MemorySnapshot {
  std::array<int64_t, static_cast<size_t>(Mem::kCount)> current{};
  std::array<int64_t, static_cast<size_t>(Mem::kCount)> peak{};
  int gathered_units = 0;       // units whose full parameters are alive now
  int peak_gathered_units = 0;  // the most alive at once since the last reset
  int rank = -1;                // the global rank whose memory this is (ShardedModel::memory()); -1: none
  int64_t cur(Mem m) const { return current[static_cast<size_t>(m)]; }
  int64_t max(Mem m) const { return peak[static_cast<size_t>(m)]; }
  /// One line per category: "sharded_params 1.2 MiB (peak 1.2 MiB)", each
  /// after "[rank R] " when `rank` is set, so that ranks printing at once
  /// can be told apart.
  std::string report() const;
};

/// "1.50 MiB"
SHARDTORCH_API std::string format_bytes(int64_t bytes);

}  // namespace shardtorch
