#pragma once
// Internal: the strategy's path for a sharded model's parameters and
// gradients: the sharded reducer, and under NoShard the replicated path (its
// parameters, their masters and their bucketed all-reduce).
#include <ATen/ATen.h>

#include <memory>

#include "runtime/gradient_reducer.h"
#include "runtime/replicated.h"

namespace shardtorch::detail {

class StrategyPath {
 public:
  /// `topology` .. `mem`: the sharded reducer's (gradient_reducer.h).
  StrategyPath(Topology& topology, Strategy strategy, ShardCopies& copies, double bucket_mb, MemoryTracker* mem)
      : sharded_(topology, strategy, copies, bucket_mb, mem) {}

  /// The gradient path in use: replicated (NoShard) or sharded.
  GradientReducer& reducer() { return replicated_ ? static_cast<GradientReducer&>(*replicated_) : sharded_; }
  ShardedReducer& sharded() { return sharded_; }
  /// NoShard: the replicated path; null under the sharded strategies.
  ReplicatedPath* replicated() const { return replicated_.get(); }
  /// shard(), NoShard: `path` becomes the replicated path.
  ReplicatedPath& set_replicated(std::unique_ptr<ReplicatedPath> path) {
    replicated_ = std::move(path);
    return *replicated_;
  }

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

 private:
  ShardedReducer sharded_;
  std::unique_ptr<ReplicatedPath> replicated_;
};

}  // namespace shardtorch::detail
