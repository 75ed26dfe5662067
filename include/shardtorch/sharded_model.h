#pragma once
// shard() and the handle it returns: memory, communication and diagnostic
// counters of a sharded model, gradient synchronisation (no_sync), and the
// layout of its units.
#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "shardtorch/export.h"
#include "shardtorch/flat_param_layout.h"
#include "shardtorch/memory.h"
#include "shardtorch/shard_options.h"
#include "shardtorch/unit.h"
#include "shardtorch/world.h"

namespace c10d {
class CommHookInterface;  // shardtorch/comm_hooks.h
}

namespace shardtorch {

/// A sharded model's diagnostic counters on this rank, since shard()
/// (ShardedModel::stats()).
struct SHARDTORCH_API ShardStats {
  /// Gradient reductions started: flat gradients handed to a reduce-scatter
  /// or all-reduce, and NoShard buckets launched.
  int64_t gradient_reductions = 0;
  /// Sharded strategies: units whose gradients were final before their turn
  /// in the reduction order. They wait (holding their staged gradient) so
  /// that every rank issues its collectives in one order; 0 when units finish
  /// in that order (docs/design.md, "Ordering and consistency across ranks").
  int64_t reductions_deferred = 0;
  /// Sharded strategies: gradient reduce-scatters (OptimizerOnly: its
  /// gradient all-reduces) launched while an earlier one was still in flight
  /// (they overlap each other and the rest of backward; 0 when every bucket
  /// is reduced at the end of backward).
  int64_t reduce_scatters_overlapped = 0;
  /// Sharded strategies: gradient reduce-scatters launched past the limit of
  /// kMaxReduceScattersInFlight, because the oldest had not completed within
  /// kReduceScatterLimitWait: this rank finished units before a peer did
  /// (data-dependent routing). Each holds one more bucket for a while; 0 in
  /// models whose units finish in the same order everywhere.
  int64_t reduce_scatters_past_the_limit = 0;
  /// NoShard: buckets whose all-reduce was launched from a gradient hook,
  /// i.e. while backward was still running (overlap).
  int64_t buckets_launched_during_backward = 0;
  /// CPU offload: bytes copied from host memory to the compute device (master
  /// shards, or their bf16 copies, before all-gathers) and back (reduced
  /// gradient shards); both 0 without offload.
  struct SHARDTORCH_API OffloadTraffic {
    int64_t to_device_bytes = 0, to_host_bytes = 0;
  };
  OffloadTraffic offload;
};

struct SHARDTORCH_API UnitInfo {
  std::string name;  // "" for the root
  std::vector<FlatParamLayout> layouts;
  std::vector<std::vector<std::string>> param_names;  // per flat parameter
  std::vector<bool> frozen;                           // per flat parameter
};

/// What shard() returns: a handle on the sharded model's state.
class SHARDTORCH_API ShardedModel {
 public:
  explicit ShardedModel(std::shared_ptr<detail::ShardState> state) : state_(std::move(state)) {}
  const World& world() const;
  /// This rank's bytes by category.
  MemorySnapshot memory() const;
  void reset_peak_memory();
  /// This rank's collectives so far, summed over the world and (HybridShard)
  /// the shard and replica groups.
  CommStats comm_stats() const;
  std::vector<UnitInfo> units() const;
  Strategy strategy() const;

  /// With false, backwards accumulate gradients locally and reduce nothing;
  /// the first backward with true reduces the sum (gradient accumulation).
  void set_requires_gradient_sync(bool sync);
  bool requires_gradient_sync() const;
  /// RAII: no synchronisation while it lives.
  class SHARDTORCH_API NoSync {
   public:
    explicit NoSync(std::shared_ptr<detail::ShardState> s);
    ~NoSync();
    NoSync(NoSync&&) = default;

   private:
    std::shared_ptr<detail::ShardState> state_;
    bool previous_;
  };
  NoSync no_sync();

  /// This rank's diagnostic counters since shard().
  ShardStats stats() const;

  /// Reduces gradients across replicas through `hook` (shardtorch/comm_hooks.h)
  /// from the next backward on: NoShard's buckets, under FullShard,
  /// ShardGradOp and HybridShard each reduce-scatter's output, under
  /// OptimizerOnly each all-reduced whole flat gradient. Once per model,
  /// outside a backward, on every rank with the same kind of hook.
  /// Contract: docs/api.md, "Communication hooks".
  void register_comm_hook(std::unique_ptr<c10d::CommHookInterface> hook);
  /// The group a hook averages over: NoShard the world, HybridShard this
  /// rank's replica group; null where the world's reduction covered every
  /// rank (FullShard, ShardGradOp, OptimizerOnly, or one replica), which the
  /// built-in hooks take as a group of one.
  c10::intrusive_ptr<c10d::Backend> comm_hook_group() const;

 private:
  std::shared_ptr<detail::ShardState> state_;
};

/// Shards `root` over `world`. Collective: every rank must call it with the
/// same model; models that differ fail on every rank, naming the first
/// differing parameter and the ranks.
SHARDTORCH_API ShardedModel shard(torch::nn::Module& root, std::shared_ptr<World> world, ShardOptions options = {});
inline ShardedModel shard(torch::nn::Module& root, World& world, ShardOptions options = {}) {
  return shard(root, world.shared_from_this(), options);
}
template <class M, class W>
ShardedModel shard(torch::nn::ModuleHolder<M>& root, W&& world, ShardOptions options = {}) {
  return shard(*root, std::forward<W>(world), options);
}
/// The handle of a model shard() was called on; throws if it never was.
SHARDTORCH_API ShardedModel sharded_model(torch::nn::Module& root);

}  // namespace shardtorch
