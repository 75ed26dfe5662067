#pragma once
// Internal: a rank's piece of one parameter of a sharded model: the
// elements it owns of the flattened parameter, or, where it holds the whole
// gradient (NoShard, OptimizerOnly), one piece of the whole.
#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace shardtorch::detail {

class ShardState;

struct ParamPiece {
  int64_t offset = 0, length = 0;  // elements [offset, offset + length) of the flattened parameter
  at::Tensor value;                // this rank's values of them (NoShard: the parameter or its master;
                                   // OptimizerOnly: the owned piece, undefined where none)
  at::Tensor grad;                 // their gradient (undefined when there is none)
};

std::vector<ParamPiece> pieces_of(ShardState& state, const at::Tensor& param);

}  // namespace shardtorch::detail
