#pragma once
// Internal: one rank's whole shard state as a checkpoint file of its own, for
// the in-memory snapshots (shardtorch/snapshot.h). What a rank holds is what a
// sharded checkpoint enumerates (its parameter ranges in the master dtype,
// their optimizer state, the buffers), and it is loaded back by the sharded
// checkpoint's loader, so both formats carry exactly the same state.
#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/index_format.h"

namespace shardtorch {
class ShardedOptimizer;
}

namespace shardtorch::checkpoint {

/// Everything this rank holds, whole (no range left to a replica), and every
/// buffer; each entry names `file`.
std::vector<std::pair<index_format::Entry, at::Tensor>> rank_state(torch::nn::Module& root, ShardedOptimizer* opt,
                                                                   const std::string& file);
/// Every parameter (under each of its names) and buffer of the model, with its shape.
std::map<std::string, std::vector<int64_t>> model_shapes_of(torch::nn::Module& root);
/// The model's strategy, as indexes name it ("full_shard", ...).
std::string strategy_of(torch::nn::Module& root);
/// Collective over the model's World: every rank loads its own `idx` (the
/// entries of the files in `dir`, which must cover what it holds now, as its
/// rank_state() saved them), as load_sharded_checkpoint loads: every rank
/// checks first, the ranks agree (they must pass the same `fingerprint`),
/// then every rank copies. `error`: why this rank cannot load (then every
/// rank throws it, and nothing changes).
void load_rank_state(torch::nn::Module& root, ShardedOptimizer* opt, const std::string& dir,
                     const index_format::Index& idx, const std::string& fingerprint, const std::string& error = "");

}  // namespace shardtorch::checkpoint
