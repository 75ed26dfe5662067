#pragma once
// Communication hooks: c10d's DDP hook interface (c10d::CommHookInterface,
// c10d::GradBucket) replacing the gradient reduction across replicas, and
// the built-in hooks (all-reduce, fp16 and bf16 compression). Register one
// with ShardedModel::register_comm_hook. The contract (when a hook runs,
// what it gets, what it must return) is in docs/api.md, "Communication hooks".
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>

#include <memory>

#include "shardtorch/export.h"

namespace shardtorch {

/// The hook type: c10d's own. A hook receives a bucket of this rank's
/// gradients and returns a future of their mean over its group (the hook
/// divides, as DDP's hooks do).
using CommHook = c10d::CommHookInterface;

/// The hooks below hold the group they reduce over: a c10d Backend
/// (ShardedModel::comm_hook_group()). A null group stands for a group of
/// one rank: the bucket is returned as it is.
using HookGroup = c10::intrusive_ptr<c10d::Backend>;

/// c10d's AllReduceCommHook (default_comm_hooks.hpp), which libtorch does not
/// export: divides the bucket by the group size, then all-reduces it in place
/// (PyTorch's `allreduce_hook`).
class SHARDTORCH_API AllReduceHook : public c10d::CppCommHookInterface<HookGroup> {
 public:
  explicit AllReduceHook(HookGroup group) : c10d::CppCommHookInterface<HookGroup>(std::move(group)) {}
  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override;
};

/// Casts the bucket to `dtype`, divides by the group size, all-reduces it and
/// copies the result back into the bucket (PyTorch's `fp16_compress_hook` and
/// `bf16_compress_hook`; c10d's FP16CompressCommHook is the fp16 one, not
/// exported by libtorch either).
class SHARDTORCH_API CompressHook : public c10d::CppCommHookInterface<HookGroup> {
 public:
  CompressHook(HookGroup group, at::ScalarType dtype)
      : c10d::CppCommHookInterface<HookGroup>(std::move(group)), dtype_(dtype) {}
  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override;
  /// The dtype it reduces in (ranks compare it: docs/api.md).
  at::ScalarType dtype() const { return dtype_; }

 private:
  at::ScalarType dtype_;
};

SHARDTORCH_API std::unique_ptr<CommHook> allreduce_hook(HookGroup group);
SHARDTORCH_API std::unique_ptr<CommHook> fp16_compress_hook(HookGroup group);
SHARDTORCH_API std::unique_ptr<CommHook> bf16_compress_hook(HookGroup group);

/// A future already completed with `value` (a hook that reduces nothing).
SHARDTORCH_API c10::intrusive_ptr<c10::ivalue::Future> completed_future(const at::Tensor& value);

}  // namespace shardtorch
