#pragma once
// Internal: how a parameter is split across a tensor-parallel group
// (parallelize(), shardtorch/tensor_parallel.h), for the code that must see
// it whole (checkpoints save the full tensor under the unsplit name and load
// each rank's slice).
#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
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

/// The first parameter of `root` that parallelize() split (its name and
/// placement), if any.
std::optional<std::pair<std::string, Placement>> first_split(torch::nn::Module& root);

/// The whole tensor as [prefix, parts, block, suffix], and the slice's run
/// of each block: [start, start + count) of `block`.
struct Blocks {
  int64_t prefix = 1, parts = 1, block = 0, suffix = 1, start = 0, count = 0;
};
Blocks blocks_of(const Placement& p);
/// Writes `slice` (this slice's elements, in any shape) into its place in
/// `whole` (contiguous, of p.full_shape).
void put_slice(at::Tensor& whole, const at::Tensor& slice, const Placement& p);
/// The slice `p` describes of `whole` (of p.full_shape), contiguous.
at::Tensor take_slice(const at::Tensor& whole, const Placement& p);

/// The whole tensor (of p.full_shape) from this rank's `slice` of it and its
/// group peers' (collective over p.group: an all-gather of the slices).
at::Tensor gather_whole(const at::Tensor& slice, const Placement& p, const std::string& what);

}  // namespace shardtorch::detail
