#pragma once
// DeviceMesh: the ranks of a World laid out over named dimensions, e.g.
// {{"pp", 2}, {"dp", 4}} for 8 ranks: pipeline stages times data-parallel
// replicas. Ranks are numbered row-major (the last dimension varies fastest,
// as in PyTorch's DeviceMesh): with {pp 2, dp 4}, ranks 0-3 are stage 0 and
// ranks 4-7 stage 1, and rank r has pp coordinate r / 4 and dp coordinate r % 4.
//
// mesh["dp"] is the group of ranks that differ from this one in "dp" alone,
// as a World: shard(model, mesh["dp"], options) shards over it, and every
// feature of a World (the collective check, peer reports naming ranks of the
// whole job, checkpoints) works there. docs/parallelism.md.
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "shardtorch/export.h"
#include "shardtorch/world.h"

namespace shardtorch {

class SHARDTORCH_API DeviceMesh {
 public:
  using Dims = std::vector<std::pair<std::string, int>>;

  /// Collective over `world`: every rank passes the same dimensions in the
  /// same order. The sizes must multiply to the world's size and the names
  /// be distinct and non-empty; a rank that passes other dimensions than
  /// rank 0 is an error on every rank, naming both. Makes one group per
  /// dimension and rank, in the order of the dimensions.
  static std::shared_ptr<DeviceMesh> create(std::shared_ptr<World> world, const Dims& dims);

  /// The group along `dim` that holds this rank, as a World (its rank() is
  /// this rank's coordinate in `dim`). An unknown name is an error listing
  /// the mesh's.
  const std::shared_ptr<World>& operator[](const std::string& dim) const { return group(dim); }
  const std::shared_ptr<World>& group(const std::string& dim) const;
  /// The whole mesh's World.
  const std::shared_ptr<World>& world() const { return world_; }
  const Dims& dims() const { return dims_; }
  int size(const std::string& dim) const;
  /// This rank's coordinate in `dim`.
  int coordinate(const std::string& dim) const;
  /// The ranks (of the mesh's World) of the group along `dim` that holds this
  /// rank, by coordinate.
  std::vector<int> ranks(const std::string& dim) const;
  /// The rank (of the mesh's World) at `coordinates`, one per dimension.
  int rank_at(const std::vector<int>& coordinates) const;
  /// "pp 2 x dp 4"
  std::string describe() const;

 private:
  DeviceMesh() = default;
  size_t index_of(const std::string& dim) const;
  std::shared_ptr<World> world_;
  Dims dims_;
  std::vector<int> coords_;
  std::vector<std::shared_ptr<World>> groups_;
};

}  // namespace shardtorch
