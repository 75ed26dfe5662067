#pragma once
// Internal: the process groups of a sharded model: the world, and under the
// strategies that need them the shard, replica and reduce-scatter groups.
#include <memory>
#include <vector>

#include "shardtorch/collectives.h"
#include "shardtorch/world.h"

namespace shardtorch {
enum class Strategy;
}

namespace shardtorch::detail {

class Topology {
 public:
  explicit Topology(std::shared_ptr<World> world) : world_(std::move(world)) {}

  World& world() const { return *world_; }
  /// Collective: makes the groups `strategy` needs, with `shard_size` ranks
  /// per shard group (HybridShard; else the world size).
  void build(Strategy strategy, int shard_size);
  /// The group parameters are sharded over (the world, or the hybrid shard group).
  Comm& shard_comm() const { return shard_group_ ? *shard_group_ : world_->comm(); }
  /// HybridShard: the ranks holding the same shard; else null.
  Comm* replica_comm() const { return replica_group_.get(); }
  /// The group gradient reduce-scatters run on: the shard group's ranks in a
  /// communicator of their own where units gather in backward (FullShard,
  /// HybridShard), so that the reductions, issued in the reduction order,
  /// never have to fall between the same all-gathers on every rank (a unit
  /// final at another point of the backward on some ranks would pair a
  /// reduce-scatter with an all-gather). Else the shard group.
  Comm& reduce_comm() const { return reduce_group_ ? *reduce_group_ : shard_comm(); }
  /// Every distinct communicator: the world's first.
  std::vector<Comm*> comms() const;
  /// The collectives of every communicator, summed.
  CommStats stats() const;

 private:
  std::shared_ptr<World> world_;
  std::shared_ptr<Comm> shard_group_, replica_group_, reduce_group_;
};

}  // namespace shardtorch::detail
