#pragma once
// Internal: the communication hook that averages each gradient bucket across
// the replica groups of this step's quorum. It never throws: a failure marks
// the step, which the vote then rejects.
#include "ft/quorum.h"
#include "shardtorch/comm_hooks.h"

namespace shardtorch::ft::detail {

/// What the hook needs of the manager's step.
class StepLink {
 public:
  virtual ~StepLink() = default;
  /// This step's quorum; throws when there is none to be had in time.
  virtual const Quorum& wait_quorum() = 0;
  /// The cross-replica group that serves it (null: none, a quorum of one).
  virtual c10d::Backend* cross_group() = 0;
  /// Records why the step cannot commit (the first reason is kept).
  virtual void fail_step(const std::string& why) = 0;
};

class ReplicaHook : public c10d::CommHookInterface {
 public:
  /// `inner`: the group a bucket is averaged over first (NoShard's world,
  /// HybridShard's replica group); null or of one rank: none.
  ReplicaHook(StepLink* step, c10::intrusive_ptr<c10d::Backend> inner) : step_(step), inner_(std::move(inner)) {}

  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override;
  at::Tensor parseHookResult(const c10::IValue& result) override { return result.toTensor(); }

 private:
  // `buffer` (this group's mean) summed over the cross-replica group and
  // divided by the groups that count; a healed group sends zeros.
  static c10::intrusive_ptr<c10::ivalue::Future> across(StepLink* step, at::Tensor buffer);

  StepLink* step_;
  c10::intrusive_ptr<c10d::Backend> inner_;
};

}  // namespace shardtorch::ft::detail
