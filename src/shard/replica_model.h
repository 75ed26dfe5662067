#pragma once
// Internal: what fault tolerance across replica groups (src/ft) needs of a
// sharded model, and no more: its options, the tensors that make this rank's
// state (what a heal sends and overwrites), the follow-up of a heal, whether
// an optimizer steps during the backward, and taking a hook off the model.
#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <memory>
#include <string>
#include <vector>

#include "shardtorch/shard_options.h"

namespace c10d {
class CommHookInterface;
}

namespace shardtorch::detail {

class ShardState;

class ReplicaModel {
 public:
  /// Throws, naming `what`, if shard() was never called on `root`.
  ReplicaModel(torch::nn::Module& root, const std::string& what);
  ~ReplicaModel();

  const ShardOptions& options() const;
  /// This rank's model state, in one order on every replica of the model:
  /// its shards (NoShard: the parameters' records), then the buffers. Writing
  /// into them replaces the state (between replace_begin and replace_end).
  std::vector<at::Tensor> state_tensors() const;
  /// Before writing into state_tensors(): waits for the copies that read
  /// them (CPU offload).
  void replace_begin();
  /// After every rank of the model replaced its state: drops what was made
  /// from the old shards. Collective over the model's shard group.
  void replace_end();
  /// Whether an optimizer steps during the backward
  /// (ShardedOptimizer::overlap_with_backward).
  bool optimizer_steps_in_backward() const;
  /// Takes `hook` off the model if it is the one registered now.
  void unregister_comm_hook(const c10d::CommHookInterface* hook);

 private:
  torch::nn::Module& root_;
  std::shared_ptr<ShardState> state_;
};

}  // namespace shardtorch::detail
