#pragma once
// Internal: the runtime state of one sharded model, kept alive by the model
// (its units, and the registry entry that lives as long as the root module),
// by ShardedModel handles and by optimizers. It owns the parts, each in its
// own file: the process groups (topology.h), the units (unit.h), the
// gradient reduction (gradient_reducer.h: sharded; replicated.h: NoShard),
// the learned orders (execution_order.h), the backward as a whole
// (backward_tracker.h), the host/device copies of offload (shard_copies.h)
// and the buffers (buffer_sync.h), and three small ones here: the
// summon_full_params scopes, the pipelines' step gather, the zero_grad
// listeners. What is left is what spans them: zero_grad, the optimizer
// step's follow-up, the checks made outside a summon scope.
#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "runtime/backward_tracker.h"
#include "runtime/buffer_sync.h"
#include "runtime/execution_order.h"
#include "runtime/gradient_reducer.h"
#include "runtime/replicated.h"
#include "runtime/shard_copies.h"
#include "base/memory_tracker.h"
#include "shardtorch/shard_options.h"
#include "shardtorch/unit.h"
#include "shardtorch/world.h"
#include "runtime/topology.h"
#include "runtime/unit.h"
#include "runtime/unit_list.h"

namespace shardtorch::detail {

/// The summon_full_params scopes alive (on every rank, rank0_only or not).
class SummonScopes {
 public:
  explicit SummonScopes(World& world) : world_(world) {}
  /// `with_grads`: the scope set param.grad; a backward inside it is refused.
  void enter(bool with_grads) {
    ++summons_;
    grad_summons_ += with_grads;
  }
  void leave(bool with_grads) {
    --summons_;
    grad_summons_ -= with_grads;
  }
  bool any() const { return summons_ > 0; }
  /// Throws (this rank) inside a summon_full_params(with_grads) scope.
  /// Names `kind` `name` ("unit", its label): the message is built only on failure,
  /// since every gradient hook calls this.
  void refuse_backward(const char* kind, const std::string& name) const;

 private:
  World& world_;
  int summons_ = 0, grad_summons_ = 0;
};

/// Pipelines (parallel/pipeline.h): every unit gathered for a whole step, and
/// whether several forwards' graphs are alive at once.
class PipelineGather {
 public:
  explicit PipelineGather(UnitList& units) : units_(units) {}
  /// Gathers every unit now and keeps it gathered (pinned) until
  /// release_step_gather(), so that a stage runs all its micro-batches on one
  /// all-gather per unit. Collective over the shard group; nothing under the
  /// strategies whose units stay gathered.
  void gather_for_step();
  void release_step_gather();
  /// Several forwards' graphs are alive at once, each differentiated by a
  /// backward of its own (micro-batches in flight), so a checkpointed unit may
  /// run its forward again before the last one's backward.
  void set_pipelined() { pipelined_ = true; }
  bool pipelined() const { return pipelined_; }

 private:
  UnitList& units_;
  bool step_gather_ = false;
  bool pipelined_ = false;
};

/// Callbacks run at every zero_grad (ShardState::on_zero_grad) until removed.
class ZeroGradListeners {
 public:
  /// `f` runs at every on_zero_grad() until removed (an optimizer's views
  /// drop their gradients, which would keep the old shards' memory alive).
  int add(std::function<void()> f) {
    listeners_.emplace(next_, std::move(f));
    return next_++;
  }
  void remove(int id) { listeners_.erase(id); }
  void run() {
    for (auto& [id, f] : listeners_) f();
  }

 private:
  std::map<int, std::function<void()>> listeners_;
  int next_ = 0;
};

class ShardState : public std::enable_shared_from_this<ShardState> {
 public:
  ShardState(std::shared_ptr<World> world, ShardOptions options);

  World& world() { return topology_.world(); }
  const ShardOptions& options() const { return options_; }
  Strategy strategy() const { return options_.strategy(); }
  MemoryTracker& mem() { return mem_; }

  // ---- the parts
  Topology& topology() { return topology_; }
  const Topology& topology() const { return topology_; }
  BackwardTracker& backward() { return backward_; }
  const BackwardTracker& backward() const { return backward_; }
  ExecutionOrder& order() { return order_; }
  const ExecutionOrder& order() const { return order_; }
  ShardCopies& copies() { return copies_; }
  BufferSync& buffers() { return buffers_; }
  /// The gradient path in use: replicated (NoShard) or sharded.
  GradientReducer& reducer() { return replicated_ ? static_cast<GradientReducer&>(*replicated_) : sharded_; }
  const GradientReducer& reducer() const {
    return replicated_ ? static_cast<const GradientReducer&>(*replicated_) : sharded_;
  }
  ShardedReducer& sharded_reducer() { return sharded_; }
  const ShardedReducer& sharded_reducer() const { return sharded_; }
  /// NoShard: the replicated path; null under the sharded strategies.
  ReplicatedPath* replicated() { return replicated_.get(); }
  const ReplicatedPath* replicated() const { return replicated_.get(); }
  /// shard(), NoShard: makes the replicated path (its parameters come with ReplicatedPath::enable).
  ReplicatedPath& enable_replicated();

  // ---- NoShard's parameters: replicated() holds them
  /// The value of record of a parameter (what checkpoints save and load):
  /// NoShard under mixed precision its fp32 master, else the parameter itself.
  at::Tensor record_of(const at::Tensor& param) const {
    return replicated_ ? replicated_->masters().record_of(param) : param;
  }
  /// Loads `value` into a parameter's record and, when that is a master,
  /// casts it into the parameter too.
  void load_record(const at::Tensor& param, const at::Tensor& value) const {
    at::Tensor record = record_of(param);
    record.copy_(value.view(record.sizes()));
    if (!record.is_same(param)) at::Tensor(param).copy_(record);
  }

  // ---- units
  /// Units in pre-order of the module tree; throws if the model is gone.
  std::vector<std::shared_ptr<Unit>> units() const { return units_.all(); }
  /// The units still alive, in pre-order (cleanup after a failure).
  std::vector<std::shared_ptr<Unit>> live_units() const { return units_.live(); }
  void add_unit(const std::shared_ptr<Unit>& u) { units_.add(u); }
  static void attach(UnitBase& base, std::shared_ptr<Unit> unit) { base.unit_ = std::move(unit); }
  static void attach_no_shard(UnitBase& base, const std::shared_ptr<ShardState>& state) {
    base.no_shard_state_ = state;
  }
  /// shard(): makes `base` a checkpointed unit (docs/design.md).
  /// `unit`: its Unit under the sharded strategies, null under NoShard.
  static void enable_checkpointing(UnitBase& base, std::shared_ptr<ShardState> state, std::string label,
                                   std::vector<at::Tensor> params, const std::shared_ptr<Unit>& unit);
  /// Gradients of gradients (docs/design.md): units still gathered at the end
  /// of a backward that builds a graph (create_graph) are held for that
  /// graph's backward until release_held(): at the optimizer step, a
  /// checkpoint load or after a failed backward.
  void release_held();
  /// Pipelines: the step's gather, and whether micro-batches are in flight.
  PipelineGather& pipeline() { return pipeline_; }
  /// all-gathers `f`'s full parameters from the shards, into its full buffer.
  void regather(Unit& u, FlatParam& f, const std::string& what);

  // ---- gradient synchronisation and summon_full_params
  bool sync() const { return sync_; }
  void set_sync(bool s) { sync_ = s; }
  /// summon_full_params scopes alive.
  SummonScopes& summons() { return summons_; }
  const SummonScopes& summons() const { return summons_; }
  /// Throws (this rank) inside a summon_full_params scope: an optimizer step
  /// or a checkpoint load there would leave the scope's full copies stale.
  void check_outside_summon() const;
  /// Leaving summon_full_params: every unit still unsharded (ZeRO-1/2, whose
  /// full buffers persist, or one a forward left gathered) gathers its full
  /// parameters again from the shards. Collective.
  void regather_unsharded();

  /// fp16 mixed precision needs a GradScaler; one registers itself here.
  bool has_scaler() const { return has_scaler_; }
  void set_has_scaler() { has_scaler_ = true; }

  /// The gradient tensors this rank holds (shards, whole ZeRO-1 gradients or
  /// NoShard bucket views); `partial` is set when other ranks hold other parts.
  std::vector<at::Tensor> local_gradients(bool& partial);
  /// Throws (this rank) naming a parameter whose requires_grad changed since shard().
  void check_requires_grad_unchanged() const;

  // ---- zero_grad and the optimizer step
  /// zero_grad() of the optimizer or of a module: recovers from a failed
  /// backward, counts a gradient generation, and ends the forward order being
  /// recorded (a root that is not a unit marks no forward's start, so forwards
  /// in grad mode without a backward, an evaluation, would run on into the next).
  void on_zero_grad();
  /// The optimizer's zero_grad (and NoShard's root module's): every gradient
  /// of the model, after on_zero_grad().
  void zero_grads();
  ZeroGradListeners& zero_grad_listeners() { return zero_grad_listeners_; }
  /// After the optimizer changed the shards: rebuild persistent full buffers
  /// (ZeRO-1/2), free the stale full copies of the others.
  void after_optimizer_step();
  /// The same after something else replaced the shards (or NoShard's
  /// masters): a heal. Collective over the shard group.
  void after_shards_replaced();

 private:
  // Each part gets what it uses; BackwardTracker, which runs the backward
  // across all of them, and the units (unit.h), which keep the state alive,
  // hold the state itself.
  ShardOptions options_;
  MemoryTracker mem_;
  Topology topology_;
  UnitList units_;
  ShardedReducer sharded_;  // after the groups: its destructor may wait on them
  std::unique_ptr<ReplicatedPath> replicated_;
  ExecutionOrder order_;
  BackwardTracker backward_;
  ShardCopies copies_;
  BufferSync buffers_;
  SummonScopes summons_;
  PipelineGather pipeline_;
  ZeroGradListeners zero_grad_listeners_;
  bool sync_ = true;
  bool has_scaler_ = false;
};

/// The registry of sharded models, by root module (entries die with it).
void register_model(torch::nn::Module& root, const std::shared_ptr<ShardState>& state);
std::shared_ptr<ShardState> lookup_model(torch::nn::Module& root);
/// The state of a sharded model; throws, naming `what` (the call), if it never was.
std::shared_ptr<ShardState> require_state(torch::nn::Module& root, const std::string& what);

/// Every name the module gives each parameter tensor (a tied one has several).
std::map<const void*, std::vector<std::string>> parameter_names(torch::nn::Module& root);

}  // namespace shardtorch::detail
