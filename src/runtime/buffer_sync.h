#pragma once
// Internal: a sharded model's buffers (batch-norm statistics, ...): cast and
// broadcast from rank 0 at shard(), and again after each optimizer step
// (ShardOptions::broadcast_buffers).
#include <ATen/ATen.h>

#include <string>
#include <utility>
#include <unordered_set>
#include <vector>

#include "shardtorch/collectives.h"

namespace shardtorch {
class World;
struct ShardOptions;
}  // namespace shardtorch

namespace shardtorch::detail {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

/// Broadcasts `tensors` from rank 0 of `comm` in place, one collective per
/// dtype (the tensors of a dtype are copied into one flat buffer and back).
/// `when` completes the error message ("at shard()").
void broadcast_coalesced(Comm& comm, NamedTensors& tensors, const std::string& what, const std::string& when);

class BufferSync {
 public:
  /// At shard(): casts the floating buffers to buffer_dtype (except those in
  /// `keep`: batch norm's, MixedPrecision::keep_batch_norm_fp32), broadcasts
  /// them from rank 0 (sync_module_states) and keeps them for after each step
  /// (broadcast_buffers).
  void setup(World& world, const ShardOptions& options, NamedTensors& buffers,
             const std::unordered_set<const void*>& keep = {});
  /// After each optimizer step, not at the end of backward: the copy raises
  /// the buffers' version counters, and batch norm saves its running
  /// statistics for backward, so a graph kept alive with retain_graph would
  /// fail its next backward. The step already changes the parameters in
  /// place, which such a graph cannot outlive either.
  void broadcast_after_step(World& world);

 private:
  NamedTensors buffers_;
};

}  // namespace shardtorch::detail
