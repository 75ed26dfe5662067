#pragma once
// Internal: NoShard (DDP): whole parameters on every rank, gradients
// all-reduced in buckets from the gradient accumulators' hooks, and under
// mixed precision fp32 masters for the optimizer and for checkpoints.
#include <ATen/ATen.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "runtime/gradient_reducer.h"
#include "buckets/all_reduce_bucketer.h"
#include "runtime/unit.h"

namespace shardtorch::detail {

class ShardState;

/// NoShard under mixed precision: the fp32 masters of the parameters (what
/// the optimizer updates and checkpoints keep), and their gradients.
class ReplicatedMasters {
 public:
  explicit ReplicatedMasters(MemoryTracker& mem) : mem_(mem) {}
  ReplicatedMasters(const ReplicatedMasters&) = delete;
  ReplicatedMasters& operator=(const ReplicatedMasters&) = delete;

  /// The masters of the trainable parameters, in their order (empty without
  /// mixed precision).
  const std::vector<at::Tensor>& all() const { return masters_; }
  /// Makes the master of trainable `param` (a copy of it, before it is cast).
  void add(const at::Tensor& param);
  /// A frozen floating parameter computes in param_dtype and keeps its fp32
  /// master here.
  void add_frozen(const at::Tensor& param, at::Tensor master);
  /// The value of record of a parameter (what checkpoints save and load):
  /// its fp32 master under mixed precision, else the parameter itself.
  at::Tensor record_of(const at::Tensor& param) const {
    auto it = master_of_.find(param.unsafeGetTensorImpl());
    return it == master_of_.end() ? param : it->second;
  }
  /// Points the masters' grads at the reduced gradients of `ddp`: views of
  /// buckets in the masters' dtype, or fp32 copies of buckets in a lower
  /// dtype. The copies are transient: ReplicatedPath::after_optimizer_step()
  /// releases them (converted_only), zero_grad every master grad, so between
  /// steps NoShard holds 16 bytes per parameter under bf16, as ZeRO counts
  /// it, not 20.
  void bind_grads(const AllReduceBucketer& ddp);
  void release_grads(const AllReduceBucketer& ddp, bool converted_only = false);

 private:
  /// Master i's grad is a copy (its bucket is in another dtype), not a view of its bucket.
  bool grad_is_copied(const AllReduceBucketer& ddp, size_t i) const {
    return ddp.grad_view(i).scalar_type() != masters_[i].scalar_type();
  }

  MemoryTracker& mem_;
  std::vector<at::Tensor> masters_;
  std::unordered_map<const void*, at::Tensor> master_of_;  // every parameter's fp32 master
  int64_t grad_bytes_ = 0;                                 // of the fp32 copies bound as grads
};

class ReplicatedPath final : public GradientReducer {
 public:
  /// `state`: the model's, for the gradient hooks (held weakly).
  ReplicatedPath(World& world, MemoryTracker& mem, const ShardOptions& options, std::weak_ptr<ShardState> state)
      : world_(world), mem_(mem), options_(options), state_(std::move(state)), masters_(mem) {}
  /// Takes the trainable parameters `params`, named `names`: under mixed
  /// precision they become param_dtype with fp32 masters, and every one gets
  /// a gradient hook. Once, at shard(), after masters().add_frozen.
  /// `keep`: parameters that stay in their dtype under mixed precision.
  void enable(std::vector<at::Tensor> params, std::vector<std::string> names,
              const std::unordered_set<const void*>& keep = {});

  void finish_backward(bool sync) override;
  void discard() override { ddp_->discard(); }
  int64_t reductions() const override { return ddp_->launched(); }
  void use_hook(CommHook* hook, HookCounter* counter) override { ddp_->hook().set(hook, counter); }

  AllReduceBucketer& bucketer() { return *ddp_; }
  const AllReduceBucketer& bucketer() const { return *ddp_; }
  const std::vector<at::Tensor>& params() const { return params_; }
  const std::vector<std::string>& names() const { return names_; }
  const std::vector<AccumulatorRef>& accumulators() const { return accumulators_; }
  /// Under mixed precision: the fp32 masters of params() and of frozen parameters.
  ReplicatedMasters& masters() { return masters_; }
  const ReplicatedMasters& masters() const { return masters_; }
  /// The tensors the optimizer updates: masters, or the parameters.
  const std::vector<at::Tensor>& optimized() const { return masters_.all().empty() ? params_ : masters_.all(); }
  /// The optimizer updated the parameters themselves, or their masters.
  void after_optimizer_step();
  /// zero_grad: the buckets and the masters' gradients.
  void zero_grads();
  /// Parameter i's gradient arrived: warns once if a step went by without a
  /// zero_grad that could reach buckets of another dtype than i.
  void note_gradient(size_t i);
  /// zero_grad of any kind reached the model (the warning above resets).
  void on_zero_grad();

 private:
  World& world_;
  MemoryTracker& mem_;
  const ShardOptions& options_;
  std::weak_ptr<ShardState> state_;
  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  ReplicatedMasters masters_;
  std::unique_ptr<AllReduceBucketer> ddp_;
  std::vector<AccumulatorRef> accumulators_;
  // An optimizer step happened and no zero_grad reached the buckets since
  // (warned about once, where the buckets are not the gradients).
  bool stepped_since_zero_ = false, warned_unzeroed_ = false;
};

}  // namespace shardtorch::detail
