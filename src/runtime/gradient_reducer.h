#pragma once
// Internal: how a sharded model's gradients are reduced across ranks. One
// interface, two paths: the sharded strategies reduce-scatter each unit's
// flat gradient (all-reduce under OptimizerOnly) through a
// ReduceScatterBucketer; NoShard all-reduces the parameters' gradients in
// buckets (ReplicatedPath, replicated.h). Communication hooks plug in here.
#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <string>

#include "buckets/reduce_scatter_bucketer.h"
#include "shardtorch/shard_options.h"

namespace shardtorch {
class FlatParam;
}

namespace shardtorch::detail {

class ShardCopies;
class Topology;

class GradientReducer {
 public:
  virtual ~GradientReducer() = default;
  /// The end of a backward that reduces gradients: launches what is still
  /// pending, waits for every reduction in flight and delivers the results
  /// (`sync`: the backward synchronises; without it gradients stay local).
  virtual void finish_backward(bool sync) = 0;
  /// A failed backward: waits for the reductions in flight and drops them
  /// and whatever is staged.
  virtual void discard() = 0;
  /// Reductions started since shard(): flat gradients handed on, or buckets launched.
  virtual int64_t reductions() const = 0;
  /// Routes the reduction across replicas through `hook` from the next
  /// backward on (docs/api.md, "Communication hooks"). Not during a backward.
  void set_comm_hook(std::unique_ptr<CommHook> hook) {
    hook_ = std::move(hook);
    hook_checked_ = false;
    use_hook(hook_.get(), &hook_stats_);
  }
  CommHook* comm_hook() const { return hook_.get(); }
  /// What the hook was handed since shard() (CommStats::comm_hook).
  const HookCounter& hook_stats() const { return hook_stats_; }
  /// Call before the first gradient reduction of every synchronising
  /// backward: after shard() and after set_comm_hook, the first one compares
  /// every rank's hook (none included) through the world's store and throws
  /// on every rank when they differ (check_same_hook, hook_call.h); until it
  /// passes, every such backward compares again.
  void check_hooks_agree(World& world) {
    if (hook_checked_) return;
    check_same_hook(world, hook_.get());
    hook_checked_ = true;
  }
  /// The next synchronising backward compares the hooks again (a rejoin).
  void forget_hook_check() { hook_checked_ = false; }

 protected:
  /// Hands the hook (null: none) and its counter to the bucketer.
  virtual void use_hook(CommHook* hook, HookCounter* counter) = 0;

 private:
  std::unique_ptr<CommHook> hook_;  // a base member: it outlives the bucketers, which may wait on it
  HookCounter hook_stats_;
  bool hook_checked_ = false;  // the ranks' hooks compared since shard() or the last set_comm_hook
};

/// The sharded strategies' reductions.
class ShardedReducer final : public GradientReducer {
 public:
  ShardedReducer(Topology& topology, Strategy strategy, ShardCopies& copies, double bucket_mb, MemoryTracker* mem)
      : topology_(topology), strategy_(strategy), copies_(copies), bucketer_(bucket_mb, mem) {}

  /// Hands `flat`'s staged gradient (of unit `label`) to its reduction; the
  /// result is added into its shard gradient (OptimizerOnly: its whole
  /// gradient) when the reduction completes.
  void reduce(FlatParam& flat, const std::string& label);
  void finish_backward(bool sync) override;
  void discard() override { bucketer_.discard(); }
  int64_t reductions() const override { return reductions_; }
  void use_hook(CommHook* hook, HookCounter* counter) override { bucketer_.launches().hook().set(hook, counter); }
  ReduceScatterBucketer& bucketer() { return bucketer_; }
  const ReduceScatterBucketer& bucketer() const { return bucketer_; }

 private:
  Topology& topology_;
  const Strategy strategy_;
  ShardCopies& copies_;
  ReduceScatterBucketer bucketer_;
  int64_t reductions_ = 0;
};

}  // namespace shardtorch::detail
