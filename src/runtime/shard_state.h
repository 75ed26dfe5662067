#pragma once
// Internal: the runtime state of one sharded model, kept alive by the model
// (its units, and the registry entry that lives as long as the root module),
// by ShardedModel handles and by optimizers. It owns the parts, each in its
// own file: the process groups (topology.h), the units (unit_list.h,
// unit.h), the strategy's path for parameters and gradients
// (strategy_path.h: the sharded reducer, NoShard's replicated path), the
// learned orders (execution_order.h), the backward as a whole
// (backward_tracker.h), the host/device copies of offload (shard_copies.h)
// and the buffers (buffer_sync.h), and three small ones here: the
// summon_full_params scopes, the units' gathers taken together, and the
// model as its optimizers see it (zero_grad, the gradients they read, the
// step's follow-up).
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
#include "runtime/shard_copies.h"
#include "runtime/strategy_path.h"
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
  /// Throws (this rank) inside a scope: an optimizer step or a checkpoint
  /// load there would leave the scope's full copies stale.
  void check_outside() const;

 private:
  World& world_;
  int summons_ = 0, grad_summons_ = 0;
};

/// The units' gathers taken together: a pipeline step's, the ones a
/// graph-building backward holds, and the regathers after the shards changed.
class UnitGathers {
 public:
  UnitGathers(UnitList& units, Topology& topology, ShardCopies& copies)
      : units_(units), topology_(topology), copies_(copies) {}
  /// Pipelines (parallel/pipeline.h): gathers every unit now and keeps it
  /// gathered (pinned) until release_step_gather(), so that a stage runs all
  /// its micro-batches on one all-gather per unit. Collective over the shard
  /// group; nothing under the strategies whose units stay gathered.
  void gather_for_step();
  void release_step_gather();
  /// Several forwards' graphs are alive at once, each differentiated by a
  /// backward of its own (micro-batches in flight), so a checkpointed unit may
  /// run its forward again before the last one's backward.
  void set_pipelined() { pipelined_ = true; }
  bool pipelined() const { return pipelined_; }
  /// Gradients of gradients (docs/design.md): units still gathered at the end
  /// of a backward that builds a graph (create_graph) are held for that
  /// graph's backward until release_held(): at the optimizer step, a
  /// checkpoint load or after a failed backward.
  void release_held();
  /// all-gathers `f`'s full parameters from the shards, into its full buffer.
  void regather(Unit& u, FlatParam& f, const std::string& what);
  /// Leaving summon_full_params: every unit still unsharded (ZeRO-1/2, whose
  /// full buffers persist, or one a forward left gathered) gathers its full
  /// parameters again from the shards. Collective.
  void regather_unsharded();

 private:
  UnitList& units_;
  Topology& topology_;
  ShardCopies& copies_;
  bool step_gather_ = false;
  bool pipelined_ = false;
};

/// What a Pipeline tells its stage's model (parallel/pipeline.cpp).
struct StageInfo {
  /// The stage holds part of the model (more than one pipeline rank), or its
  /// ranks are not the whole World's: DCP checkpoints refuse it.
  bool partial = false;
  /// Each parameter tied across stages: its names on every holding stage,
  /// in stage order, by tensor (a DCP load looks for it under each).
  std::map<const void*, std::vector<std::string>> tied_names;
};

class ShardState;

/// The model as its optimizers (and a module's zero_grad, and GradScaler) see
/// it: zero_grad, the gradients they read, the step's follow-up.
class OptimizerSide {
 public:
  explicit OptimizerSide(ShardState& model) : model_(model) {}
  /// zero_grad() of the optimizer or of a module: recovers from a failed
  /// backward, counts a gradient generation, and ends the forward order being
  /// recorded (a root that is not a unit marks no forward's start, so forwards
  /// in grad mode without a backward, an evaluation, would run on into the next).
  void on_zero_grad();
  /// The optimizer's zero_grad (and NoShard's root module's): every gradient
  /// of the model, after on_zero_grad().
  void zero_grads();
  /// `f` runs at every on_zero_grad() until removed (an optimizer's views
  /// drop their gradients, which would keep the old shards' memory alive).
  int add_zero_grad_listener(std::function<void()> f) {
    listeners_.emplace(next_listener_, std::move(f));
    return next_listener_++;
  }
  void remove_zero_grad_listener(int id) { listeners_.erase(id); }
  /// `f` runs before anything changes the shards or the optimizer state in
  /// place: the optimizer's step, its first step inside a backward, a heal.
  /// A reader of them in the background (a snapshot's copy) finishes first.
  int add_update_guard(std::function<void()> f) {
    guards_.emplace(next_listener_, std::move(f));
    return next_listener_++;
  }
  void remove_update_guard(int id) { guards_.erase(id); }
  void before_update() {
    for (auto& [id, f] : guards_) f();
  }

  /// A shardtorch optimizer was built over this model.
  void optimizer_built() { ++optimizers_built_; }
  /// A backward reduced the gradients. The first with no shardtorch
  /// optimizer built over the model warns once: a torch::optim optimizer
  /// over the module's own parameters would not train it.
  void backward_reduced();
  /// Whether a backward reduced the gradients since the last zero_grad()
  /// (or since shard()): a step without one changes nothing.
  bool reduced_since_zero_grad() const { return reduced_since_zero_grad_; }
  /// Every gradient was cleared outside zero_grads() (the root's Module::zero_grad).
  void all_gradients_cleared() { reduced_since_zero_grad_ = false; }

  /// fp16 mixed precision needs a GradScaler; one registers itself here.
  bool has_scaler() const { return has_scaler_; }
  void set_has_scaler() { has_scaler_ = true; }
  /// The gradient tensors this rank holds (shards, whole ZeRO-1 gradients or
  /// NoShard bucket views); `partial` is set when other ranks hold other parts.
  std::vector<at::Tensor> local_gradients(bool& partial);
  /// Throws (this rank) naming a parameter whose requires_grad changed since shard().
  void check_requires_grad_unchanged() const;

  /// After the optimizer changed the shards: rebuild persistent full buffers
  /// (ZeRO-1/2), free the stale full copies of the others.
  void after_optimizer_step();
  /// The same after something else replaced the shards (or NoShard's
  /// masters): a heal. Collective over the shard group.
  void after_shards_replaced();

 private:
  ShardState& model_;
  std::map<int, std::function<void()>> listeners_, guards_;
  int next_listener_ = 0;
  bool has_scaler_ = false;
  int optimizers_built_ = 0;
  bool warned_no_optimizer_ = false;
  bool reduced_since_zero_grad_ = false;
};

class ShardState : public std::enable_shared_from_this<ShardState> {
 public:
  ShardState(std::shared_ptr<World> world, ShardOptions options);

  World& world() { return topology_.world(); }
  const ShardOptions& options() const { return options_; }
  MemoryTracker& mem() { return mem_; }

  // ---- the parts
  Topology& topology() { return topology_; }
  /// Units in pre-order of the module tree.
  UnitList& units() { return units_; }
  StrategyPath& path() { return path_; }
  /// shard(), NoShard: makes the replicated path (its parameters come with ReplicatedPath::enable).
  ReplicatedPath& enable_replicated();
  ExecutionOrder& order() { return order_; }
  /// Snapshots::rejoin: what the model learned from its steps (the orders,
  /// the hooks' check) is forgotten, so that its next step issues the
  /// collectives and store checks of a new process's first step.
  void forget_learned() {
    order_.forget();
    path_.sharded().forget_hook_check();
    path_.reducer().forget_hook_check();
  }
  BackwardTracker& backward() { return backward_; }
  ShardCopies& copies() { return copies_; }
  BufferSync& buffers() { return buffers_; }
  SummonScopes& summons() { return summons_; }
  UnitGathers& gathers() { return gathers_; }
  OptimizerSide& optimizer() { return optimizer_; }
  StageInfo& stage() { return stage_; }
  const StageInfo& stage() const { return stage_; }

  // ---- shard(): the units' modules
  static void attach(UnitBase& base, std::shared_ptr<Unit> unit) { base.unit_ = std::move(unit); }
  static void attach_no_shard(UnitBase& base, const std::shared_ptr<ShardState>& state) {
    base.no_shard_state_ = state;
  }
  /// shard(): makes `base` a checkpointed unit (docs/design.md).
  /// `unit`: its Unit under the sharded strategies, null under NoShard.
  static void enable_checkpointing(UnitBase& base, std::shared_ptr<ShardState> state, std::string label,
                                   std::vector<at::Tensor> params, const std::shared_ptr<Unit>& unit);

 private:
  // Each part gets what it uses; BackwardTracker, which runs the backward
  // across all of them, OptimizerSide, and the units (unit.h), which keep the
  // state alive, hold the state itself.
  ShardOptions options_;
  MemoryTracker mem_;
  Topology topology_;
  UnitList units_;
  StrategyPath path_;  // after the groups: the sharded reducer's destructor may wait on them
  ExecutionOrder order_;
  BackwardTracker backward_;
  ShardCopies copies_;
  BufferSync buffers_;
  SummonScopes summons_;
  UnitGathers gathers_;
  OptimizerSide optimizer_;
  StageInfo stage_;
};

/// The registry of sharded models, by root module. `owned`: the model's
/// modules own the state (each Unit's owner_, a Unit attached to a unit
/// module), and the entry does not keep it: a model destroyed frees its state
/// (its memory, its World) with it. Otherwise (NoShard under a root that is
/// not a unit) the entry keeps it until a later registration or lookup finds
/// the root gone.
void register_model(torch::nn::Module& root, const std::shared_ptr<ShardState>& state, bool owned);
std::shared_ptr<ShardState> lookup_model(torch::nn::Module& root);
/// The state of a sharded model; throws, naming `what` (the call), if it never was.
std::shared_ptr<ShardState> require_state(torch::nn::Module& root, const std::string& what);

/// Every name the module gives each parameter tensor (a tied one has several).
std::map<const void*, std::vector<std::string>> parameter_names(torch::nn::Module& root);

}  // namespace shardtorch::detail
