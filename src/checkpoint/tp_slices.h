#pragma once
// Internal: checkpoints of a tensor-parallel model (parallelize(),
// shardtorch/tensor_parallel.h). A parameter parallelize() split is saved
// whole, under its name and its unsplit shape, assembled from every rank's
// slice; a load gives each rank its slice, reading only the elements of it
// (docs/checkpoints.md, "Tensor parallelism").
//
// A split parameter's slice (runtime/placement.h) is, in the whole tensor of
// shape [P..., D, Q...] split along D in `parts` blocks, rank r's run of
// D / parts / size elements of each block. Flattened, the slice's elements
// are runs of the whole tensor's: one per (prefix index, block).
#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "checkpoint/model_part.h"
#include "runtime/placement.h"

namespace shardtorch::detail {
class ShardState;
}

namespace shardtorch::checkpoint {

/// Elements [local, local + length) of a flattened slice are elements
/// [whole, whole + length) of the flattened whole tensor.
struct Run {
  int64_t whole = 0, local = 0, length = 0;
};

/// Elements [begin, begin + length) of the flattened slice `p` describes,
/// as runs of the flattened whole tensor, in order; runs that follow each
/// other in the whole tensor are one.
std::vector<Run> runs_of(const detail::Placement& p, int64_t begin, int64_t length);
/// `rows` runs of `length` elements, the i-th at whole + i * stride of the
/// whole tensor (stride 0 when rows is 1): elements [local, local + rows *
/// length) of the slice. A row-wise split weight's slice is one such block
/// per range rather than a run per row.
struct Rows {
  int64_t whole = 0, local = 0, length = 0, rows = 1, stride = 0;
};
/// `runs` (in order, each starting in the slice where the one before ends)
/// as few Rows as hold them: runs of one length at one distance are one.
std::vector<Rows> rows_of(const std::vector<Run>& runs);
using detail::put_slice;  // runtime/placement.h
using detail::take_slice;
/// Elements [begin, begin + length) of the flattened slice, from a source of
/// the whole tensor's elements: read(first, count) returns `count` elements
/// of the flattened whole tensor from `first` (called once per run).
at::Tensor read_slice(const detail::Placement& p, int64_t begin, int64_t length,
                      const std::function<at::Tensor(int64_t first, int64_t count)>& read);
/// Elements [begin, begin + length) of the flattened `t` as runs of the
/// flattened tensor a checkpoint holds: t's own elements when parallelize()
/// did not split it.
std::vector<Run> saved_runs(const at::Tensor& t, int64_t begin, int64_t length);
/// The shape a checkpoint holds `t` under: the whole tensor's when
/// parallelize() split it.
std::vector<int64_t> saved_shape(const at::Tensor& t);

/// `root` (sharded, state `state`) when parallelize() split some of its
/// parameters: the ModelPart that makes a checkpoint function collective over
/// the mesh of the tensor-parallel group and the model's World. nullopt
/// when no parameter is split. `who` names the function in errors: a model
/// whose World and tensor-parallel group are not the two dimensions of one
/// mesh (a pipeline's stages take the pipeline's functions).
std::optional<ModelPart> tensor_parallel_part(torch::nn::Module& root, detail::ShardState& state, const char* who);
/// Adds what tensor_parallel_part() describes to `part` (a pipeline's):
/// the tp rank, the split names, and their whole shapes in part.shapes.
/// Returns the tensor-parallel group (null when nothing is split).
std::shared_ptr<World> describe_tensor_parallel(torch::nn::Module& root, ModelPart& part, const char* who);

}  // namespace shardtorch::checkpoint
