#pragma once
// The memory planner: the per-rank bytes a model will need under a strategy,
// world size, precision and offload policy, by category, computed from the
// flat-parameter layouts alone, before anything is launched or allocated.
//
//   auto units = shardtorch::unit_specs(*model);        // from a model ...
//   auto units = gpt::unit_specs(cfg);                  // ... or from a shape
//   auto plan = shardtorch::plan_memory(units, {options, world_size});
//   std::cout << plan.report();
//
// Model state (the master shards or replicated parameters, gradients and
// optimizer state) is exact: it is the arithmetic shard() and the optimizers
// do, for the rank that owns the most (rank 0), and tests check it against
// ShardedModel::memory() byte for byte. The transient categories
// (gathered_params, grad_staging, buckets) are upper estimates of their peaks
// during a step (docs/benchmarks.md compares them with measurements);
// master_grads (NoShard's fp32 gradient copies under mixed precision, alive
// from backward to the end of the step) is exact.
#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <array>
#include <functional>
#include <string>
#include <vector>

#include "shardtorch/export.h"
#include "shardtorch/memory.h"
#include "shardtorch/sharded.h"

namespace shardtorch {

/// One flat parameter: a unit's parameters of one dtype and trainability.
struct SHARDTORCH_API FlatSpec {
  int64_t numel = 0;
  at::ScalarType dtype = at::kFloat;
  bool trainable = true;
  /// Parameters of batch-norm layers (BatchNorm1d/2d/3d), which unit_specs
  /// puts in a flat of their own. Under mixed precision with
  /// keep_batch_norm_fp32, shard() does too and keeps them in `dtype`
  /// (computed, gathered and reduced in it; NoShard reduces them in the
  /// reduce dtype, in buckets of their own); otherwise plan_memory counts
  /// them in the unit's flat of the same dtype and trainability, as shard()
  /// lays them out.
  bool batch_norm = false;
};

/// One unit as shard() would build it.
struct SHARDTORCH_API UnitSpec {
  std::string name;  // "" for the root
  std::vector<FlatSpec> flats;
};

/// The units and flat parameters shard() would build from `root` (the same
/// walk: innermost unit, shared parameters to the lowest common unit); no
/// communication, nothing allocated.
SHARDTORCH_API std::vector<UnitSpec> unit_specs(torch::nn::Module& root);

struct SHARDTORCH_API PlanOptions {
  ShardOptions options;  // strategy, mixed precision, cpu_offload, hybrid_shard_size, bucket_mb
  int world_size = 1;
  /// fp32 state tensors per optimized element: 2 for Adam/AdamW, 1 for SGD
  /// with momentum, 0 for plain SGD.
  int optimizer_states = 2;
  /// Gradient accumulation without synchronisation (set_requires_gradient_sync(false)
  /// / no_sync on all but the last micro-batch): under the sharded strategies
  /// every unit then keeps its unsharded gradient (grad_staging) from the
  /// first micro-batch to the synchronising one; NoShard accumulates in its
  /// buckets and needs nothing more.
  bool accumulates = false;
  /// A pipeline stage (shardtorch::Pipeline; its units from
  /// pipeline_unit_specs): under FullShard and HybridShard every unit is
  /// gathered once for the whole step, and every unit keeps its staging
  /// gradient from its first micro-batch's backward to the step's reduction.
  bool pipelined = false;
  /// The backend reduces in place (Gloo, on CPU ranks): a reduce-scatter's
  /// output is a view of its input, so buckets cost their inputs alone.
  /// Off, the plan counts outputs too (NCCL), 1/N more than Gloo needs.
  bool reduces_in_place = false;
  /// In-memory snapshots (shardtorch/snapshot.h) with the default buddy
  /// map: two generations of this rank's own snapshot and of the one copy
  /// it keeps for another rank (none at world 1), each its parameter shard
  /// in the master dtype plus the optimizer state of its trainable part
  /// (buffers and the files' headers not counted). Counted as `snapshots`,
  /// in host memory.
  bool snapshots = false;
};

struct SHARDTORCH_API MemoryPlan {
  std::array<int64_t, static_cast<size_t>(Mem::kCount)> bytes{};
  int64_t of(Mem m) const { return bytes[static_cast<size_t>(m)]; }
  /// Parameters (sharded, replicated or host), gradients and optimizer state.
  int64_t model_state() const;
  /// Bytes on the compute device at the peak of a step (model state not in
  /// host memory, plus the transient categories).
  int64_t device_peak() const;
  /// gathered_params + grad_staging + buckets + master_grads.
  int64_t transient() const;
  /// Bytes in host memory (offload, and the in-memory snapshots).
  int64_t host() const;
  int64_t params = 0;  // elements, frozen included, padding excluded
  /// Construct + shard() + a checkpoint load: the most the library holds at
  /// once per rank (parameters and full flat buffers; model-state bytes as
  /// the categories count them). shard() makes the units in order; while it
  /// makes one, a rank holds what the units before it keep, that unit's full
  /// flat buffers (in the dtypes the UnitSpec gives, plus their param_dtype
  /// casts under mixed precision; none under NoShard, ShardGradOp and
  /// OptimizerOnly, whose full buffers are what they keep) and its shard.
  /// Deferred construction (shardtorch/deferred.h): that alone, at most the
  /// parameter categories plus the largest unit's full buffers. Not counted:
  /// the replayed values of the one parameter being copied in (none after
  /// skip_deferred_init) and a checkpoint load's buffer for one piece.
  int64_t startup_deferred = 0;
  /// The same with eager construction: also the parameters, as constructed,
  /// of the unit being made and of every later one (NoShard: the model).
  int64_t startup_eager = 0;
  /// One line per non-empty category, then the totals.
  std::string report() const;
};

SHARDTORCH_API MemoryPlan plan_memory(const std::vector<UnitSpec>& units, const PlanOptions& plan);

/// The largest n in [0, limit] with bytes(n) <= budget, for bytes that do not
/// fall as n grows (the device peak of a model n layers deep); -1 when even
/// bytes(0) is over the budget. Evaluates bytes O(log n) times.
SHARDTORCH_API int64_t largest_that_fits(const std::function<int64_t(int64_t)>& bytes, int64_t budget, int64_t limit);

}  // namespace shardtorch
