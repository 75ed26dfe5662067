#pragma once
// Internal: how a parameter is split across a tensor-parallel group
// (parallelize(), shardtorch/tensor_parallel.h), for the code that must see
// it whole (checkpoints save the full tensor under the unsplit name and load
// each rank's slice).
#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "shardtorch/world.h"

namespace shardtorch::detail {

struct Placement {
  int64_t dim = 0;                  // split along this dimension ...
  int parts = 1;                    // ... of `parts` blocks laid end to end, each split into `size` slices
  std::vector<int64_t> full_shape;  // the unsplit tensor's
  int rank = 0, size = 1;           // this rank's slice of each block, of `size`
  std::shared_ptr<World> group;     // the tensor-parallel group that splits it
};

/// Records `t`'s placement (replacing an earlier one). Entries die with their tensors.
void set_placement(const at::Tensor& t, Placement p);
/// `t`'s placement, if parallelize() split it.
std::optional<Placement> placement_of(const at::Tensor& t);

}  // namespace shardtorch::detail
