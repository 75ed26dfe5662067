#pragma once
// Internal: what shard() gives a checkpointed unit (activation checkpointing,
// docs/design.md); src/runtime/recompute.cpp runs it.
#include <ATen/ATen.h>

#include <atomic>
#include <memory>
#include <string>
#include <vector>

namespace shardtorch::detail {

class ShardState;
class Unit;

/// What a checkpointed unit needs in backward (docs/design.md).
struct Checkpointing {
  std::weak_ptr<ShardState> state;
  std::string label;               // the unit's name, for errors
  std::vector<at::Tensor> params;  // its trainable parameters: where the nested backward stops
  std::weak_ptr<Unit> unit;        // the unit (sharded strategies; a checkpointed unit has none inside it)
  // The last forward's node: alive and not yet differentiated means a second
  // forward now would give its parameters two gradient accumulations.
  std::weak_ptr<std::atomic<bool>> last_pending;
};
}  // namespace shardtorch::detail
