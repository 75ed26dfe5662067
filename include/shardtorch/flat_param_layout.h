#pragma once
// The layout of a flat parameter: a unit's parameters of one dtype laid end
// to end, padded to a multiple of the world size, rank r owning elements
// [r*S, (r+1)*S). Pure arithmetic (ShardedModel::units() reports it).
#include <cstddef>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "shardtorch/export.h"

namespace shardtorch {

/// Pure arithmetic of a flat parameter's layout; no tensors.
class SHARDTORCH_API FlatParamLayout {
 public:
  FlatParamLayout() = default;
  FlatParamLayout(std::vector<std::vector<int64_t>> shapes, int world_size);

  size_t size() const { return shapes_.size(); }
  int world_size() const { return world_size_; }
  const std::vector<int64_t>& shape(size_t i) const { return shapes_.at(i); }
  int64_t offset(size_t i) const { return offsets_.at(i); }
  int64_t numel(size_t i) const { return numels_.at(i); }
  /// Sum of the parameters' sizes.
  int64_t total_numel() const { return total_; }
  /// total_numel rounded up to a multiple of the world size.
  int64_t padded_numel() const { return shard_numel_ * world_size_; }
  int64_t padding() const { return padded_numel() - total_; }
  /// Elements each rank owns: ceil(total / world size).
  int64_t shard_numel() const { return shard_numel_; }
  /// [begin, end) of rank's shard in flat coordinates.
  std::pair<int64_t, int64_t> shard_range(int rank) const;

  /// The part of parameter i that rank owns: `length` elements starting at
  /// `param_offset` in the flattened parameter and at `shard_offset` in the shard.
  struct SHARDTORCH_API Piece {
    int64_t param_offset;
    int64_t shard_offset;
    int64_t length;
  };
  std::optional<Piece> piece(size_t i, int rank) const;

 private:
  std::vector<std::vector<int64_t>> shapes_;
  std::vector<int64_t> offsets_, numels_;
  int64_t total_ = 0, shard_numel_ = 0;
  int world_size_ = 1;
};

}  // namespace shardtorch
