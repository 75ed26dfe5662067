#pragma once
// Full state dicts of sharded models in safetensors: the parameters (in the
// master dtype: fp32 under mixed precision) and buffers under the module's own
// names, the format PyTorch's `safetensors.torch.load_file` +
// `load_state_dict` read. Saving gathers one flat parameter at a time (memory
// stays bounded) and rank 0 writes atomically; loading works at any world size
// and strategy: every rank reads only its own shard's elements.
#include <torch/nn/module.h>

#include <map>
#include <string>

#include "shardtorch/checkpoint/safetensors.h"

namespace shardtorch {

/// Collective. Rank 0 writes `path`; tied parameters appear under each of their names.
void save_full_state_dict(torch::nn::Module& root, const std::string& path,
                          const std::map<std::string, std::string>& metadata = {});
/// Collective. Every rank reads `path` (a shared file system, or a copy per
/// node) and takes its shards; missing or mis-shaped entries are errors naming
/// the file and the parameter.
void load_full_state_dict(torch::nn::Module& root, const std::string& path);

}  // namespace shardtorch
