#pragma once
// Internal: what parallelize() attaches to a ParallelLinear or
// ParallelEmbedding it split (shardtorch/tensor_parallel.h).
#include <memory>
#include <string>

#include "shardtorch/tensor_parallel.h"
#include "shardtorch/world.h"

namespace shardtorch::detail {

struct TpLayer {
  std::string name;  // the module's name in the model
  TpStyle style;
  std::shared_ptr<World> group;
  bool sequence_parallel = false;
  int64_t sequence_dim = 1;
  int64_t vocab_start = 0, vocab_end = 0;  // VocabEmbedding: this rank's rows
  bool inputs_compared = false;            // its first forward compared the group's inputs
};

}  // namespace shardtorch::detail
