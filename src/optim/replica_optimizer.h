#pragma once
// Internal: what fault tolerance across replica groups (src/ft) needs of a
// sharded optimizer, and no more: its description, and the state of each
// piece it updates as plain tensors (what a heal sends and installs).
#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

namespace shardtorch {
class ShardedOptimizer;
}

namespace shardtorch::detail {

/// One piece's optimizer state: its step (Adam(W); 0 otherwise) and its
/// tensors; none before the piece's first step.
struct PieceState {
  int64_t step = 0;
  std::vector<at::Tensor> tensors;
};

class ReplicaOptimizer {
 public:
  explicit ReplicaOptimizer(ShardedOptimizer& opt) : opt_(opt) {}

  /// The optimizer and its hyperparameters, in words (equal strings, equal options).
  std::string describe() const;
  /// The pieces of this rank's shards the optimizer updates, in one order
  /// on every replica of the model; each state tensor is shaped like its piece.
  std::vector<at::Tensor> pieces() const;
  /// The state of each piece, in pieces()' order.
  std::vector<PieceState> states() const;
  /// Replaces the state of each piece (in pieces()' order) with `states`,
  /// its tensors moved to their piece's device; a piece given no tensors
  /// drops its state. Throws, changing nothing, for an optimizer whose state
  /// shardtorch cannot make (docs/fault_tolerance.md).
  void install(std::vector<PieceState> states);

 private:
  ShardedOptimizer& opt_;
};

}  // namespace shardtorch::detail
