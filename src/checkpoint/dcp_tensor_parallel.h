#pragma once
// Internal: DCP checkpoints hold no tensor-parallel model (parallelize(),
// shardtorch/tensor_parallel.h) and no stage of a pipeline over several
// pipeline ranks: its functions refuse one on every rank before they write
// or change anything (docs/checkpoints.md, "Tensor parallelism" and
// "Pipelines").
#include <torch/nn/module.h>

#include "base/check.h"
#include "runtime/placement.h"
#include "runtime/shard_state.h"

namespace shardtorch::checkpoint::dcp {

/// Throws, naming `who` and the first parameter parallelize() split, when
/// `root` has one. `global_rank`: this rank's, for the message.
inline void refuse_tensor_parallel(torch::nn::Module& root, int global_rank, const char* who) {
  for (const auto& item : root.named_parameters())
    SHARDTORCH_CHECK(!detail::placement_of(item.value()), detail::rank_prefix(global_rank), ": shardtorch::", who,
                     ": parameter '", item.key(),
                     "' is a tensor-parallel slice (parallelize() split it), and DCP checkpoints of a "
                     "tensor-parallel model are not supported; save and load it with save_sharded_checkpoint / "
                     "load_sharded_checkpoint, save_full_state_dict / load_full_state_dict or save_hf_checkpoint / "
                     "load_hf_checkpoint, which hold it under the unsplit model's names and shapes (a sharded "
                     "checkpoint converts to DCP for PyTorch with shardtorch-convert sharded-to-dcp; a DCP "
                     "checkpoint from PyTorch loads into the unsplit model, at any number of ranks, whose sharded "
                     "checkpoint then loads into this one)");
}

/// Throws, naming `who`, when `state` is a stage of a Pipeline over more
/// than one pipeline rank (pipe.module()): it holds part of the model's
/// names, and its ranks are one stage's. A
/// save would write one stage's DCP checkpoint over another's in the same
/// directory; a load is refused unless `ignoring` (ignore_unexpected: each
/// stage then takes its own tensors, and a name no stage holds goes
/// unnoticed).
inline void refuse_pipeline_stage(detail::ShardState& state, bool ignoring, const char* who) {
  SHARDTORCH_CHECK(!state.stage().partial || ignoring, detail::rank_prefix(state.world().global_rank()),
                   ": shardtorch::", who,
                   ": this model is a Pipeline's stage (pipe.module()), which holds part of the model or of the "
                   "World's ranks; DCP checkpoints of a pipeline are supported only at one pipeline rank whose "
                   "data-parallel dimension is the whole World. Save and load a "
                   "sharded checkpoint through the "
                   "Pipeline's overloads (shardtorch/pipeline_checkpoint.h), which shardtorch-convert sharded-to-dcp "
                   "turns into a DCP checkpoint for PyTorch; a DCP checkpoint from PyTorch loads into the unsplit "
                   "model, at any number of ranks, whose sharded checkpoint then loads into the pipeline");
}

}  // namespace shardtorch::checkpoint::dcp
