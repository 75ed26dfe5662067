#pragma once
// Internal: the communication of tensor-parallel layers as autograd
// functions, each with its adjoint as its backward (Megatron-LM's "regions"):
//
//   copy_to_group     identity          | all-reduce of the gradient
//   reduce_from_group all-reduce        | identity
//   gather_dim        all-gather on dim | this rank's chunk of the gradient
//   split_dim         this rank's chunk | all-gather of the gradient
//   gather_for_column all-gather on dim | reduce-scatter of the gradient (sequence parallel)
//   reduce_scatter    reduce-scatter    | all-gather of the gradient (sequence parallel)
//
// Chunks along a dimension follow the ranks' order; every collective goes
// through the group's Comm (its timeout, errors and the collective check).
#include <ATen/ATen.h>

#include <string>

#include "shardtorch/collectives.h"

namespace shardtorch::detail::tp {

at::Tensor copy_to_group(const at::Tensor& x, Comm& comm, const std::string& what);
at::Tensor reduce_from_group(const at::Tensor& x, Comm& comm, const std::string& what);
at::Tensor gather_dim(const at::Tensor& x, int64_t dim, Comm& comm, const std::string& what);
at::Tensor split_dim(const at::Tensor& x, int64_t dim, Comm& comm, const std::string& what);
at::Tensor gather_for_column(const at::Tensor& x, int64_t dim, Comm& comm, const std::string& what);
at::Tensor reduce_scatter(const at::Tensor& x, int64_t dim, Comm& comm, const std::string& what);

/// Without autograd: `x` gathered along `dim` (every rank's chunk, in order).
at::Tensor all_gather_along(const at::Tensor& x, int64_t dim, Comm& comm, const std::string& what);

}  // namespace shardtorch::detail::tp
