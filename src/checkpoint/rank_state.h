#pragma once
// Internal: one rank's whole shard state as a checkpoint file of its own, for
// the in-memory snapshots (shardtorch/snapshot.h). What a rank holds is what a
// sharded checkpoint enumerates (its parameter ranges in the master dtype,
// their optimizer state, the buffers), and it is loaded back by the sharded
// checkpoint's loader, so both formats carry exactly the same state.
#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/index_format.h"
#include "shardtorch/shard_options.h"

namespace shardtorch {
class ShardedOptimizer;
}  // namespace shardtorch

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
/// Every rank's string, in rank order (`what` names the exchange in errors).
using GatherStrings = std::function<std::vector<std::string>(const std::string& mine, const std::string& what)>;
/// Collective through `gather` (over the model's World's ranks; `rank` is
/// this one's): publishes `dir` as the sharded checkpoint of `step` whose
/// rank files are copies of each rank's `file` (a rank_state() file;
/// `entries`: its index entries, a JSON array), with the model's `shapes`
/// and `user_state` (the same on every rank), as save_sharded_checkpoint
/// publishes: the previous checkpoint in `dir` stays whole until the new one
/// is complete. Returns "" or why it failed (the same text on every rank).
std::string publish_rank_files(const GatherStrings& gather, int rank, const std::string& file,
                               const std::string& entries, Strategy strategy,
                               const std::map<std::string, std::vector<int64_t>>& shapes, int64_t step,
                               const std::map<std::string, std::string>& user_state, const std::string& dir);
/// `keep`: this rank changes nothing (it already holds the state) but takes
/// part in the agreement.
void load_rank_state(torch::nn::Module& root, ShardedOptimizer* opt, const std::string& dir,
                     const index_format::Index& idx, const std::string& fingerprint, const std::string& error = "",
                     bool keep = false);

}  // namespace shardtorch::checkpoint
