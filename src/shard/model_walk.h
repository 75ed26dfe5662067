#pragma once
// Internal: what shard() and the planner find in a module tree: its units
// (pre-order), its parameters (each distinct tensor once, given to its
// innermost unit or to the lowest unit common to all that reach it) and its
// buffers, and how a unit's parameters group into flat parameters.
#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <functional>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "shardtorch/unit.h"

namespace shardtorch::detail {

struct FoundUnit {
  std::string name;
  UnitBase* base;
  int parent;  // index of the enclosing unit, -1 for none
};

struct FoundParam {
  std::string name;
  at::Tensor tensor;
  int unit;  // -1: no unit encloses it
};

struct ModelWalk {
  std::vector<FoundUnit> units;
  std::vector<FoundParam> params;
  std::vector<std::pair<std::string, at::Tensor>> buffers;
};

/// `allow_sharded`: a unit shard() already took is walked (the planner), not refused.
ModelWalk walk_model(torch::nn::Module& root, bool allow_sharded);

/// Parameters and buffers (TensorImpls) of the batch-norm layers under `root`.
std::unordered_set<const void*> batch_norm_tensors(torch::nn::Module& root);

/// A unit's parameters grouped by (dtype, requires_grad, in `apart`), in
/// registration order: its flat parameters. `dtype_of`: the dtype a
/// parameter is grouped by (default its own).
using DtypeOf = std::function<at::ScalarType(const at::Tensor&)>;
std::vector<std::vector<const FoundParam*>> flat_groups(const std::vector<FoundParam>& params, int unit,
                                                        const DtypeOf& dtype_of = {},
                                                        const std::unordered_set<const void*>& apart = {});

}  // namespace shardtorch::detail
