#pragma once
// Internal: DCP checkpoints hold no tensor-parallel model (parallelize(),
// shardtorch/tensor_parallel.h): its functions refuse one on every rank
// before they write or change anything (docs/checkpoints.md, "Tensor
// parallelism").
#include <torch/nn/module.h>

#include "base/check.h"
#include "runtime/placement.h"

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
                     "checkpoint converts to DCP for PyTorch with shardtorch-convert sharded-to-dcp)");
}

}  // namespace shardtorch::checkpoint::dcp
