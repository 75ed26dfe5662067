#pragma once
// Internal: the parameters of a tensor-parallel model that every rank of the
// group must hold alike, compared by checksum (shardtorch/tensor_parallel.h,
// check_replicated; parallelize() checks every parameter before it splits).
#include <torch/nn/module.h>

#include <memory>
#include <string>

#include "shardtorch/world.h"

namespace shardtorch::detail {

/// Collective over `tp`: this rank's values of `root`'s parameters (each
/// once; `unsplit_only`: those parallelize() did not split; deferred ones
/// skipped; of a sharded model this rank's shard of each) against every other
/// rank's. Throws, on every rank, naming the first that differs and the two
/// ranks; `who` and `why` begin and end the message. Returns how many were compared.
int64_t require_same_parameters(torch::nn::Module& root, World& tp, bool unsplit_only, const std::string& who,
                                const std::string& why);

}  // namespace shardtorch::detail
