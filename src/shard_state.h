#pragma once
// Internal: the state behind shard(). One ShardState per sharded model, shared
// by its units; units are owned by their modules (UnitBase::unit_).
#include <torch/csrc/autograd/function.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "shardtorch/reduce_scatter_bucketer.h"
#include "shardtorch/sharded.h"

namespace shardtorch::detail {

enum class UnitState { Sharded, Gathering, Unsharded, Reducing };
const char* state_name(UnitState s);

class Unit : public std::enable_shared_from_this<Unit> {
 public:
  Unit(std::shared_ptr<ShardState> owner, std::string name, int index, bool is_root, bool reshard_after_forward);

  const std::string& name() const { return name_; }
  std::string label() const { return name_.empty() ? "<root>" : name_; }
  int index() const { return index_; }
  bool is_root() const { return is_root_; }
  UnitState state() const { return state_; }
  std::vector<std::unique_ptr<FlatParam>>& flats() { return flats_; }
  ShardState& owner() { return *owner_; }
  const std::shared_ptr<ShardState>& owner_shared() const { return owner_; }

  void unshard();
  void reshard();
  void pre_forward();
  void post_forward(const std::vector<at::Tensor>& outputs);
  void pre_backward();
  void on_grad_ready(size_t flat, size_t param);
  /// Hands every trainable flat gradient to the bucketer and reshards.
  void reduce_grads();
  /// End of backward bookkeeping reset.
  bool needs_final_reduce() const { return touched_ && !reduced_ && expected_grads_ > 0; }
  void reset_backward() {
    touched_ = reduced_ = false;
    received_grads_ = 0;
  }
  void register_grad_hooks();

 private:
  std::shared_ptr<ShardState> owner_;
  std::string name_;
  int index_;
  bool is_root_;
  bool reshard_after_forward_;
  UnitState state_ = UnitState::Sharded;
  std::vector<std::unique_ptr<FlatParam>> flats_;
  std::vector<c10::intrusive_ptr<torch::autograd::Node>> accumulators_;
  int expected_grads_ = 0, received_grads_ = 0;
  bool touched_ = false, reduced_ = false;
};

class ShardState {
 public:
  ShardState(std::shared_ptr<World> world, ShardOptions options);

  World& world() { return *world_; }
  const std::shared_ptr<World>& world_ptr() const { return world_; }
  const ShardOptions& options() const { return options_; }
  MemoryTracker& mem() { return mem_; }
  ReduceScatterBucketer& bucketer() { return bucketer_; }

  /// Units in pre-order of the module tree; throws if the model is gone.
  std::vector<std::shared_ptr<Unit>> units() const;
  void add_unit(const std::shared_ptr<Unit>& u) { units_.push_back(u); }
  static void attach(UnitBase& base, std::shared_ptr<Unit> unit) { base.unit_ = std::move(unit); }

  /// Queues finish_backward() on the autograd engine once per backward.
  void ensure_end_of_backward_callback();
  void finish_backward();
  /// After the shards changed (optimizer step): full copies are stale.
  void reshard_all();

 private:
  std::shared_ptr<World> world_;
  ShardOptions options_;
  MemoryTracker mem_;
  ReduceScatterBucketer bucketer_;
  std::vector<std::weak_ptr<Unit>> units_;
  bool callback_queued_ = false;
};

}  // namespace shardtorch::detail
