#pragma once
// Internal: a DCP checkpoint of a pipeline over several pipeline ranks is
// the whole model's, saved and loaded through the Pipeline's functions
// (shardtorch/pipeline_checkpoint.h); a stage's module by itself is refused
// on every rank before anything is written or changed (docs/checkpoints.md,
// "Pipelines").
#include "base/check.h"
#include "runtime/shard_state.h"

namespace shardtorch::checkpoint::dcp {

/// Throws, naming `who`, when `state` is a stage of a Pipeline over more
/// than one pipeline rank (pipe.module()): it holds part of the model's
/// names, and its ranks are one stage's. A save would write one stage's DCP
/// checkpoint over another's in the same directory; a load is refused unless
/// `ignoring` (ignore_unexpected: each stage then takes its own tensors, and
/// a name no stage holds goes unnoticed).
inline void refuse_pipeline_stage(detail::ShardState& state, bool ignoring, const char* who) {
  SHARDTORCH_CHECK(!state.stage().partial || ignoring, detail::rank_prefix(state.world().global_rank()),
                   ": shardtorch::", who,
                   ": this model is a Pipeline's stage (pipe.module()), which holds part of the model or of the "
                   "World's ranks; call shardtorch::",
                   who,
                   "(pipe, optimizer, dir) (shardtorch/pipeline_checkpoint.h), which every rank of the mesh calls "
                   "and which holds the whole model under the unsplit model's names",
                   ignoring ? ""
                   : std::string(who) == "load_dcp_checkpoint"
                       ? " (or, to load each stage by itself, DcpLoadOptions().ignore_unexpected(true))"
                       : "");
}

}  // namespace shardtorch::checkpoint::dcp
