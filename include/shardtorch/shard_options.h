#pragma once
// What shard() is told: the strategy (ZeRO stage or DDP), mixed precision,
// and every other ShardOptions field. Every rank must pass the same options.
#include <ATen/ATen.h>
#include <torch/arg.h>

#include <map>
#include <optional>
#include <string>

#include "shardtorch/export.h"
#include "shardtorch/log.h"

namespace shardtorch {

/// Where parameters, gradients and optimizer state live (docs/design.md).
enum class Strategy {
  FullShard,      // ZeRO-3: all three sharded
  ShardGradOp,    // ZeRO-2: gradients and optimizer state sharded
  OptimizerOnly,  // ZeRO-1: optimizer state sharded
  NoShard,        // DDP: bucketed, overlapped all-reduce
  HybridShard,    // FullShard within groups of hybrid_shard_size ranks, replicated across groups
};
/// "full_shard"/"zero3", "shard_grad_op"/"zero2", "optimizer_only"/"zero1",
/// "no_shard"/"ddp", "hybrid_shard"/"hybrid" (any case); throws on others.
SHARDTORCH_API Strategy parse_strategy(const std::string& name);
SHARDTORCH_API const char* strategy_name(Strategy s);

/// Mixed precision: fp32 master shards (owned by the optimizer), parameters
/// gathered and computed in param_dtype, gradients reduced in reduce_dtype.
struct SHARDTORCH_API MixedPrecision {
  /// Gathering and compute dtype (kBFloat16, kHalf or kFloat); unset: no mixed precision.
  TORCH_ARG(std::optional<at::ScalarType>, param_dtype) = std::nullopt;
  /// Gradient reduction dtype; unset: param_dtype. kFloat reduces in fp32.
  TORCH_ARG(std::optional<at::ScalarType>, reduce_dtype) = std::nullopt;
  /// The root unit's tensor output is cast to this (e.g. kFloat for the loss).
  TORCH_ARG(std::optional<at::ScalarType>, output_dtype) = std::nullopt;
  /// Floating-point buffers are cast to this at shard().
  TORCH_ARG(std::optional<at::ScalarType>, buffer_dtype) = std::nullopt;
  /// Floating-point tensor arguments of the root's forward are cast to param_dtype.
  TORCH_ARG(bool, cast_root_inputs) = true;
  /// Parameters and buffers of batch-norm layers (BatchNorm1d/2d/3d) stay in
  /// their own dtype (fp32), as under FSDP: they normalise low-precision
  /// inputs with full-precision statistics. false: cast like the others.
  TORCH_ARG(bool, keep_batch_norm_fp32) = true;
};

struct SHARDTORCH_API ShardOptions {
  TORCH_ARG(Strategy, strategy) = Strategy::FullShard;
  /// Mixed precision (every strategy; NoShard keeps fp32 master copies).
  TORCH_ARG(MixedPrecision, mixed_precision) = {};
  /// Free a unit's full parameters after its forward (FullShard and
  /// HybridShard); when false they stay until the end of backward. The root
  /// unit stays gathered after a forward in grad mode either way.
  TORCH_ARG(bool, reshard_after_forward) = true;
  /// Size of one reduce-scatter (or, for NoShard, all-reduce) bucket in MiB;
  /// 0 disables coalescing of reduce-scatters.
  TORCH_ARG(double, bucket_mb) = 25.0;
  /// Broadcast parameters and buffers from rank 0 at shard().
  TORCH_ARG(bool, sync_module_states) = true;
  /// After each optimizer step (of a shardtorch optimizer), broadcast the
  /// module's buffers (batch-norm running statistics, ...) from rank 0, so
  /// every rank's next forward uses rank 0's, as DDP's broadcast_buffers
  /// does. One broadcast per buffer dtype; nothing for a model without
  /// buffers. false: each rank keeps its own (FSDP's behaviour).
  TORCH_ARG(bool, broadcast_buffers) = true;
  /// HybridShard: ranks per shard group (must divide the world size).
  TORCH_ARG(int, hybrid_shard_size) = 0;
  /// NoShard: launch each bucket's all-reduce as soon as its gradients are in
  /// (overlapping backward); false waits for the end of backward.
  TORCH_ARG(bool, ddp_async) = true;
  /// NoShard: a trainable parameter that gets no gradient in a backward on
  /// some rank is an error on every rank naming it (default: reduced as zero
  /// there; one no rank gave a gradient since it was zeroed gets none).
  TORCH_ARG(bool, error_on_unused_parameters) = false;
  /// FullShard and HybridShard: launch the next unit's all-gather (in the
  /// order the previous step ran them) while the current unit computes, in
  /// forward and in backward; one more unit's full parameters alive at a time
  /// (docs/design.md, "Prefetch").
  TORCH_ARG(bool, prefetch) = false;
  /// CPU offload (every strategy but NoShard; docs/offload.md): the fp32
  /// master shards, the gradient shards and the optimizer state live in host
  /// memory (pinned when units compute on an accelerator); a unit's shard is
  /// copied to the device before its all-gather, reduced gradient shards are
  /// copied back, and the optimizer steps on the CPU.
  TORCH_ARG(bool, cpu_offload) = false;
  /// Activation checkpointing (every strategy; docs/api.md, docs/design.md):
  /// every unit that has no unit inside it and shares no parameter with
  /// another unit, the root excepted, keeps only its inputs from the forward
  /// and recomputes its activations in backward, without a second all-gather.
  TORCH_ARG(bool, activation_checkpointing) = false;
  /// Progress reports of shard() (operation "shard": units made of the
  /// total, and their bytes; shardtorch/log.h); unset: the library-wide
  /// set_progress_callback, else the default printing.
  TORCH_ARG(ProgressCallback, progress) = nullptr;

 public:  // (TORCH_ARG leaves the access private)
  /// activation_checkpointing for one unit, by name; true for the root, a
  /// unit with units inside or one with a parameter shared with another unit
  /// (tied) is an error at shard().
  ShardOptions& activation_checkpointing_for(const std::string& unit, bool value) {
    per_unit_checkpointing_[unit] = value;
    return *this;
  }
  const std::map<std::string, bool>& per_unit_checkpointing() const { return per_unit_checkpointing_; }
  /// reshard_after_forward for one unit, by name ("" is the root).
  ShardOptions& reshard_after_forward_for(const std::string& unit, bool value) {
    per_unit_reshard_[unit] = value;
    return *this;
  }
  bool reshard_after_forward_of(const std::string& unit) const {
    auto it = per_unit_reshard_.find(unit);
    return it == per_unit_reshard_.end() ? reshard_after_forward_ : it->second;
  }
  const std::map<std::string, bool>& per_unit_reshard() const { return per_unit_reshard_; }
  /// Whether prefetch takes effect: on, under a strategy that gathers units.
  bool prefetches() const {
    return prefetch() && (strategy() == Strategy::FullShard || strategy() == Strategy::HybridShard);
  }

 private:
  std::map<std::string, bool> per_unit_reshard_;
  std::map<std::string, bool> per_unit_checkpointing_;
};

}  // namespace shardtorch
